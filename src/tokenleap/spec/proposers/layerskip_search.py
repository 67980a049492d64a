"""Choosing the layers a layer-skip draft skips (SWIFT-style): a short search that maximises
predicted accepted tokens per second, from acceptance and costs measured on the model itself.

Acceptance of a candidate skipped set is measured on texts (a request's prompt and early output):
the full model is run over a text once, then the draft (the same model, kept layers only) over
its last ``window`` positions, reading the full model's cache for the context before them. The
fraction of positions where the draft's argmax is the target's is the agreement ``a``; the mean
negative log-likelihood of the target's argmax under the draft ranks candidates more finely.
(The window's drafted rows see each other's draft keys, a longer run of drafts than any real
step: ``a`` errs low.)

Costs are timed on the machine: a one-row forward of the full model (``t_full``), of no layer with
the model's head (``t_bare``) and with the draft's (``t_head``), and of ``max_k + 1`` rows
(verification). A draft token with ``n`` kept layers costs ``t_head + n * (t_full - t_bare) / L``; a step drafting ``k`` yields
``(1 - a^(k+1)) / (1 - a)`` tokens for ``k`` draft tokens plus one verification, and the predicted
speed-up is that rate times ``t_full``.

Search: the layers are ranked by how little each changes the hidden state over the window in one
full forward (1 - the cosine of its input and output, ShortGPT's block influence); the skipped set
then grows one layer at a time, each time re-scoring the ``candidates`` least influential remaining
layers with the set so far and adding the one with the best NLL, until agreement falls below
``min_agreement`` or the predicted speed-up has fallen ``patience`` times in a row; the set along
the way with the best predicted speed-up is chosen. About ``candidates`` forwards of ``window``
rows per layer tried.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tokenleap.cache.contiguous import KVCache
from tokenleap.models.cache_files import written_aside
from tokenleap.models.transformer import Segment, Transformer


@dataclass(frozen=True)
class SearchConfig:
    window: int = 64  # scored positions per text: its last ones
    context: int = 448  # at most this many tokens before them
    max_k: int = 8  # draft lengths the speed model considers
    candidates: int = 2  # layers re-scored at each growth step
    min_agreement: float = 0.3  # growth stops below this agreement
    patience: int = 3  # growth stops after the predicted speed-up fell this many times in a row
    timing_repeats: int = 3


@dataclass(frozen=True)
class Calibration:
    """What the search chose and why: the skipped layers, their measured agreement with the full
    model, the draft length and speed-up the cost model predicts, the measured costs."""

    skip: tuple[int, ...]
    num_layers: int
    agreement: float
    k: int
    predicted_speedup: float
    draft_seconds: float  # one drafted token (one row through the kept layers and the head)
    full_seconds: float  # one plain decoding step (one row through every layer)
    verify_seconds: float  # a forward of max_k + 1 rows
    positions: int  # scored positions the agreement was measured on
    search_seconds: float = 0.0

    @property
    def skip_set(self) -> frozenset[int]:
        return frozenset(self.skip)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        d = dict(d)
        d["skip"] = tuple(int(i) for i in d["skip"])
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class _Text:
    """One calibration text: the full model's cache of its context and its argmax over the window."""

    def __init__(self, model: Transformer, tokens: list[int], cfg: SearchConfig) -> None:
        tokens = tokens[-(cfg.window + cfg.context):]
        self.window = min(cfg.window, len(tokens) - 1)
        self.start = len(tokens) - self.window  # the first scored row's position
        self.tokens = tokens
        self.cache = KVCache(model.config, 1, len(tokens) + cfg.max_k + 2, model.dtype)
        self.slot = self.cache.allocate()
        rows = torch.arange(self.start, len(tokens))
        logits = model(torch.tensor(tokens), [Segment(self.slot, 0, len(tokens))], self.cache,
                       logit_rows=rows).logits  # [window, vocab]
        self.target = logits.argmax(-1)  # [window]: what the full model predicts after each row
        self.influence = self._influence(model)  # [layers]

    def _influence(self, model: Transformer) -> torch.Tensor:
        """Per layer, 1 - cos(input, output) of the window's hidden states, from one full forward."""
        layers = model.config.num_hidden_layers
        window = torch.tensor(self.tokens[self.start:])
        out = model(window, [Segment(self.slot, self.start, self.window)], self.cache,
                    hidden_layers=tuple(range(layers)), logit_rows=torch.tensor([0]))
        x = model.embed(window).float()  # [window, hidden]: layer 0's input
        influence = []
        for i in range(layers):
            y = out.hidden[i].float()
            influence.append(1.0 - float(torch.nn.functional.cosine_similarity(x, y, dim=-1).mean()))
            x = y
        return torch.tensor(influence)

    def score(self, model: Transformer, skip: frozenset[int], head=None) -> tuple[int, float]:
        """(positions where the draft's argmax is the target's, summed NLL of the target's argmax),
        the draft scoring with ``head`` (None: the model's)."""
        window = torch.tensor(self.tokens[self.start:])
        logits = model(window, [Segment(self.slot, self.start, self.window)], self.cache, skip=skip,
                       head=head).logits  # [window, vocab]
        nll = (-torch.log_softmax(logits, -1).gather(1, self.target[:, None])).clamp(max=50.0)  # [window, 1]
        return int((logits.argmax(-1) == self.target).sum()), float(nll.sum())


@dataclass(frozen=True)
class _Costs:
    full: float  # one row through every layer and the model's head: a plain step
    head: float  # one row through no layer and the draft's head
    layer: float  # one row through one layer
    verify: float  # max_k + 1 rows through every layer
    max_k: int

    def draft(self, kept: int) -> float:
        return self.head + kept * self.layer

    def rows(self, r: int) -> float:
        return self.full + (self.verify - self.full) * (r - 1) / self.max_k

    def best(self, agreement: float, kept: int) -> tuple[int, float]:
        """(k, predicted speed-up over plain) for a draft of ``kept`` layers with this agreement (the
        best k, also where no k beats plain decoding: the speed-up is then below 1)."""
        best = (0, 0.0)
        for k in range(1, self.max_k + 1):
            tokens = k + 1.0 if agreement >= 1.0 else (1.0 - agreement ** (k + 1)) / (1.0 - agreement)
            speedup = tokens / (k * self.draft(kept) + self.rows(k + 1)) * self.full
            if speedup > best[1]:
                best = (k, speedup)
        return best


def measure_costs(model: Transformer, text: _Text, cfg: SearchConfig, head=None) -> _Costs:
    """Time one-row forwards of every layer and of none (with the model's head and the draft's),
    and a max_k + 1 row verification, on the decode path (row-exact), at the end of ``text``'s
    cache; the best of a few repeats each."""
    n, slot, layers = len(text.tokens), text.slot, model.config.num_hidden_layers

    def timed(rows: int, skip: frozenset[int], draft_head=None) -> float:
        best = float("inf")
        ids = (text.tokens * rows)[-rows:]  # (a text shorter than the rows: repeated; only the time counts)
        for _ in range(cfg.timing_repeats):
            t0 = time.perf_counter()
            model(torch.tensor(ids), [Segment(slot, n, rows)], text.cache, row_exact=True, skip=skip, head=draft_head)
            best = min(best, time.perf_counter() - t0)
        return best

    none = frozenset(range(layers))
    full, bare = timed(1, frozenset()), timed(1, none)
    return _Costs(full=full, head=timed(1, none, head) if head is not None else bare,
                  layer=max(0.0, full - bare) / layers, verify=timed(cfg.max_k + 1, frozenset()), max_k=cfg.max_k)


def search(model: Transformer, texts: list[list[int]], cfg: SearchConfig = SearchConfig(),
           log=None, head=None) -> Calibration:
    """The skipped set with the best predicted speed-up on ``texts`` (token id lists, each at least
    two tokens) for drafts scoring with ``head`` (None: the model's); ``log(str)`` hears the progress."""
    t0 = time.perf_counter()
    prepared = [_Text(model, t, cfg) for t in texts if len(t) >= 2]
    if not prepared:
        raise ValueError("layer-skip calibration needs a text of at least two tokens")
    layers = model.config.num_hidden_layers
    positions = sum(t.window for t in prepared)
    costs = measure_costs(model, prepared[0], cfg, head)

    def evaluate(skip: frozenset[int]) -> tuple[float, float]:  # (agreement, mean NLL)
        hits, nll = 0, 0.0
        for t in prepared:
            h, s = t.score(model, skip, head)
            hits, nll = hits + h, nll + s
        return hits / positions, nll / positions

    influence = sum(t.influence * t.window for t in prepared) / positions  # [layers]
    order = [int(i) for i in torch.argsort(influence)]  # least influential first
    current: frozenset[int] = frozenset()
    best, falls, last = (0.0, current, 1.0, 0), 0, 0.0  # the empty set only if nothing else can be tried
    while len(current) < layers - 1 and falls < cfg.patience:
        remaining = [layer for layer in order if layer not in current][:cfg.candidates]
        scored = {layer: evaluate(current | {layer}) for layer in remaining}
        layer = min(scored, key=lambda x: scored[x][1])
        current = current | {layer}
        agreement = scored[layer][0]
        k, speedup = costs.best(agreement, layers - len(current))
        if log:
            log(f"skip {len(current):2d} layers: agreement {agreement:.2f}, predicted {speedup:.2f}x at k={k}")
        if speedup > best[0]:
            best = (speedup, current, agreement, k)
        falls, last = (falls + 1 if speedup < last else 0), speedup
        if agreement < cfg.min_agreement:
            break
    speedup, skip, agreement, k = best
    return Calibration(skip=tuple(sorted(skip)), num_layers=layers, agreement=round(agreement, 4), k=k,
                       predicted_speedup=round(speedup, 3),
                       draft_seconds=round(costs.draft(layers - len(skip)), 6),
                       full_seconds=round(costs.full, 6), verify_seconds=round(costs.verify, 6), positions=positions,
                       search_seconds=round(time.perf_counter() - t0, 2))


# -- the on-disk cache: one calibration per model, dtype and quantization -------------------------
def store_path(cache_dir: Path | str | None, key: str) -> Path:
    from tokenleap.models.catalog import default_cache_dir
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "layerskip" / f"{key}.json"


def load_calibration(path: Path, num_layers: int) -> Calibration | None:
    """The stored calibration, or None (missing, unreadable, or for another layer count)."""
    try:
        cal = Calibration.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return cal if cal.num_layers == num_layers and all(0 <= i < num_layers for i in cal.skip) else None


def save_calibration(path: Path, cal: Calibration) -> None:
    with written_aside(path) as tmp:  # a concurrent reader sees the old file or the new one
        tmp.write_text(json.dumps(cal.to_dict(), indent=1), encoding="utf-8")
