"""The target's features for training a draft head: computed by prefill, kept on disk per source.

A feature is the target's final normed hidden state at a position (what its LM head reads). A
training text's features come from one prefill pass over it; they depend on the text, the model and
its precision, so the store keys them by all three and a later run with the same source reads them
instead of computing them again (a few minutes for 60,000 tokens on two cores).
"""
from __future__ import annotations

import hashlib
import json
import pickle
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenleap.heads.eagle import default_head_path
from tokenleap.models.cache_files import remove_abandoned, written_aside
from tokenleap.models.embed import embed

MIN_TOKENS = 3  # a text trains the head on pairs (f_t, x_{t+1}) -> f_{t+1}: two at least, from three tokens


@dataclass(frozen=True)
class Example:
    tokens: torch.Tensor  # [n] token ids
    feats: torch.Tensor  # [n, H] the target's features (bfloat16)


def collect_features(model, sequences: Iterable[list[int]],
                     log: Callable[[str], None] = lambda _: None) -> list[Example]:
    """The target's features of every position of each token sequence (``MIN_TOKENS`` or more)."""
    out = []
    t0, total = time.perf_counter(), 0
    for i, ids in enumerate(sequences):
        if len(ids) < MIN_TOKENS:
            continue
        f = embed(model, [ids], pooling="none", normalize=False)[0]  # [n, H]
        out.append(Example(torch.tensor(ids), f.to(torch.bfloat16)))
        total += len(ids)
        if (i + 1) % 20 == 0:
            log(f"features: {i + 1} texts, {total} tokens, {total / (time.perf_counter() - t0):.0f} tokens/s")
    return out


def text_pieces(ids: list[int], window: int) -> list[list[int]]:
    """A long text's token ids cut into consecutive pieces of at most ``window`` + 1 tokens (one
    training window each: a piece's last token is only a target, so the next piece starts there)."""
    return [ids[i:i + window + 1] for i in range(0, max(1, len(ids) - 1), window)]


class FeatureStore:
    """Features kept under ``root``, one file per source, named by a hash of the model's identity
    (source, dtype, quantization) and the source's token ids."""

    def __init__(self, root: Path, target, log: Callable[[str], None] = lambda _: None) -> None:
        self.root = Path(root)
        self.identity = {"model": str(target.source), "dtype": str(target.dtype), "quant": str(target.quant)}
        self.log = log

    @classmethod
    def for_target(cls, cache_root: Path, target, log: Callable[[str], None] = lambda _: None) -> "FeatureStore":
        """The store beside where ``train-head`` saves the target's head (``<cache>/heads/<model>/features``)."""
        model = str(target.source).removeprefix("catalog:")
        return cls(default_head_path(Path(cache_root), model).parent / "features", target, log)

    def path(self, sequences: list[list[int]]) -> Path:
        digest = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode())
        for ids in sequences:
            digest.update(json.dumps(ids).encode())
        return self.root / f"{digest.hexdigest()[:24]}.pt"

    def get(self, model, sequences: list[list[int]], label: str) -> list[Example]:
        """The examples of ``sequences`` (one source, named ``label`` in the log): read when stored,
        else computed and stored."""
        sequences = [s for s in sequences if len(s) >= MIN_TOKENS]
        path = self.path(sequences)
        if path.exists():
            try:
                stored = torch.load(path, weights_only=True)
                examples = [Example(t, f) for t, f in zip(stored["tokens"], stored["feats"])]
            except (OSError, RuntimeError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError) as e:
                self.log(f"ignoring {path}: {e}")
            else:
                if [e.tokens.tolist() for e in examples] == sequences:
                    self.log(f"{label}: features read from {path}")
                    return examples
                self.log(f"{path} holds other texts: computing {label}'s features again")
        self.log(f"{label}: computing the features of {sum(map(len, sequences))} tokens")
        examples = collect_features(model, sequences, self.log)
        remove_abandoned(path.parent, "*.pt")  # stores killed part-way (up to a gigabyte each)
        try:
            with written_aside(path) as tmp:  # an interrupted run leaves no partial file
                torch.save({"tokens": [e.tokens for e in examples], "feats": [e.feats for e in examples]}, tmp)
        except (OSError, RuntimeError) as e:  # a read-only cache: train on them anyway (torch raises RuntimeError)
            self.log(f"{label}: features not kept ({e})")
        return examples
