"""The plain sampler's exact next-token probabilities after sampled prefixes -- the reference
``tokenleap verify`` tests speculative samples against (``certify.py``).

Every row comes from a row-exact forward of the plain target, bitwise the row plain decoding
computes for that prefix (the block rule), so the only noise left in a test is the samples' own.
Rows are large (one float per vocabulary entry: 600 KB at 150k tokens), so the fit test keeps the
few short prefixes it needs whole, and the acceptance count reads one probability from each row of a
sample and lets the row go.
"""
from __future__ import annotations

import torch

from tokenleap.cache.contiguous import KVCache
from tokenleap.models.transformer import Segment
from tokenleap.spec.acceptance import Trial, acceptance_mean
from tokenleap.spec.sampling import logits_to_probs


def _prompt_row(model, prompt: list[int], room: int, temperature: float) -> tuple[KVCache, int, torch.Tensor]:
    """A one-slot cache of ``room`` positions holding ``prompt``, its slot, and the row after it [vocab]."""
    cache = KVCache(model.config, 1, room, model.dtype)
    slot = cache.allocate()
    last = torch.tensor([len(prompt) - 1])
    first = model(torch.tensor(prompt), [Segment(slot, 0, len(prompt))], cache, logit_rows=last).logits  # [1, vocab]
    return cache, slot, logits_to_probs(first, temperature)[0]


def plain_next_probs(model, prompt: list[int], samples: set[tuple[int, ...]], temperature: float
                     ) -> dict[tuple[int, ...], torch.Tensor]:
    """The plain sampler's exact distribution of the next token after ``prompt + prefix``, for every
    proper prefix (the empty one included) of every sampled tuple: one row-exact forward per
    distinct longest prefix, rows bitwise those of plain decoding (the block rule)."""
    longest = sorted({s[:-1] for s in samples if s})
    room = len(prompt) + max((len(p) for p in longest), default=0)
    cache, slot, row = _prompt_row(model, prompt, room, temperature)
    out = {(): row}
    for prefix in longest:
        if not prefix or prefix in out:
            continue
        logits = model(torch.tensor(prefix), [Segment(slot, len(prompt), len(prefix))], cache,
                       row_exact=True).logits  # [len(prefix), vocab]
        probs = logits_to_probs(logits, temperature)  # [len(prefix), vocab]
        for j in range(len(prefix)):
            out.setdefault(prefix[:j + 1], probs[j])
    return out


def trial_means(model, prompt: list[int], samples: list[tuple[tuple[int, ...], list[Trial]]], temperature: float
                ) -> tuple[list[Trial], list[float]]:
    """Each trial's acceptance probability ``min(1, p(x) / q(x))``, ``p`` the plain sampler's exact
    distribution after the trial's prefix (``sample[:position]``): one row-exact forward per sample
    over its tokens up to its deepest trial, each row read for its trials and dropped. Returns the
    trials in the order of their means."""
    deepest = max((t.position for _, trials in samples for t in trials), default=0)
    cache, slot, first = _prompt_row(model, prompt, len(prompt) + max(deepest, 1), temperature)
    tested, means = [], []
    for sample, trials in samples:
        if not trials:
            continue
        depth = max(t.position for t in trials)
        probs = None
        if depth:  # row j - 1 is the distribution after sample[:j]
            logits = model(torch.tensor(sample[:depth]), [Segment(slot, len(prompt), depth)], cache,
                           row_exact=True).logits  # [depth, vocab]
            probs = logits_to_probs(logits, temperature)  # [depth, vocab]
        for t in trials:
            row = first if t.position == 0 else probs[t.position - 1]  # [vocab]
            tested.append(t)
            means.append(acceptance_mean(float(row[t.token]), t.q))
    return tested, means


__all__ = ["plain_next_probs", "trial_means"]
