"""The plain sampler's exact next-token probabilities after sampled prefixes -- the reference
``tokenleap verify`` tests speculative samples against (``certify.py``).

Every row comes from a row-exact forward of the plain target, bitwise the row plain decoding
computes for that prefix (the block rule), so the only noise left in a test is the samples' own.
Rows are large (one float per vocabulary entry: 600 KB at 150k tokens), so none is kept for long: the
fit test's are reduced to the figures of the tokens sampled after them as each forward gives them,
and the acceptance count keeps only the rows of the sample it reads (those it shares with the next
sample are reused, not computed again).
"""
from __future__ import annotations

import torch

from tokenleap.cache.contiguous import KVCache
from tokenleap.models.transformer import Segment
from tokenleap.spec.acceptance import Trial, acceptance_mean
from tokenleap.spec.sampling import logits_to_probs
from tokenleap.spec.stat_tests import token_figures


def _prompt_row(model, prompt: list[int], room: int, temperature: float) -> tuple[KVCache, int, torch.Tensor]:
    """A one-slot cache of ``room`` positions holding ``prompt``, its slot, and the row after it [vocab]."""
    cache = KVCache(model.config, 1, room, model.dtype)
    slot = cache.allocate()
    last = torch.tensor([len(prompt) - 1])
    first = model(torch.tensor(prompt), [Segment(slot, 0, len(prompt))], cache, logit_rows=last).logits  # [1, vocab]
    return cache, slot, logits_to_probs(first, temperature)[0]


Figures = tuple[float, float, float, float]  # stat_tests.TokenFigures' four values for one token


def plain_next_figures(model, prompt: list[int], samples: set[tuple[int, ...]], temperature: float
                       ) -> dict[tuple[tuple[int, ...], int], Figures]:
    """For each position of each sampled tuple, keyed by (prefix, token), the figures the fit test reads
    (``stat_tests.token_figures``) of that token under the plain sampler's exact distribution after
    ``prompt + prefix``: one row-exact forward per distinct longest prefix, rows bitwise those of plain
    decoding (the block rule), each reduced to its tokens' figures as soon as it is computed."""
    successors: dict[tuple[int, ...], set[int]] = {}  # each prefix's sampled next tokens
    for sample in samples:
        for j, token in enumerate(sample):
            successors.setdefault(sample[:j], set()).add(token)
    longest = sorted({s[:-1] for s in samples if s})
    room = len(prompt) + max((len(p) for p in longest), default=0)
    cache, slot, row = _prompt_row(model, prompt, room, temperature)
    out: dict[tuple[tuple[int, ...], int], Figures] = {}
    _reduce(out, [()], row[None], successors)
    done = {()}
    for prefix in longest:
        if prefix in done:
            continue
        logits = model(torch.tensor(prefix), [Segment(slot, len(prompt), len(prefix))], cache,
                       row_exact=True).logits  # [len(prefix), vocab]
        new = [j for j in range(len(prefix)) if prefix[:j + 1] not in done]
        _reduce(out, [prefix[:j + 1] for j in new], logits_to_probs(logits[new], temperature), successors)
        done.update(prefix[:j + 1] for j in new)
    return out


def _reduce(out: dict, prefixes: list[tuple[int, ...]], rows: torch.Tensor, successors: dict) -> None:
    """Add to ``out`` the figures of each prefix's sampled next tokens, prefix i's row ``rows[i]`` # [vocab]."""
    pairs = [(i, t) for i, prefix in enumerate(prefixes) for t in sorted(successors.get(prefix, ()))]
    if not pairs:
        return
    f = token_figures(torch.tensor([t for _, t in pairs]), rows, torch.tensor([i for i, _ in pairs]))
    for (i, t), values in zip(pairs, torch.stack([f.lo, f.mass, f.mean, f.var], 1).tolist()):  # [pairs, 4]
        out[(prefixes[i], t)] = tuple(values)


def trial_means(model, prompt: list[int], samples: list[tuple[tuple[int, ...], list[Trial]]], temperature: float
                ) -> tuple[list[Trial], list[float]]:
    """Each trial's acceptance probability ``min(1, p(x) / q(x))``, ``p`` the plain sampler's exact
    distribution after the trial's prefix (``sample[:position]``), in the samples' order. The samples
    are taken in token order, so each shares the longest prefix it can with the one before: its
    forward (row-exact) starts where that shared prefix ends, over the cache the earlier one wrote,
    and the shared rows are reused -- the same bitwise rows as a forward over each sample alone.
    Returns the trials in the order of their means."""
    deepest = max((t.position for _, trials in samples for t in trials), default=0)
    cache, slot, first = _prompt_row(model, prompt, len(prompt) + max(deepest, 1), temperature)
    means_of: dict[int, list[float]] = {}
    done: tuple[int, ...] = ()  # the tokens whose rows ``rows`` holds (row j - 1: after done[:j])
    rows = first.new_empty((0, first.numel()))  # [len(done), vocab]
    for i in sorted((i for i, (_, trials) in enumerate(samples) if trials), key=lambda i: samples[i][0]):
        sample, trials = samples[i]
        tokens = tuple(sample[:max(t.position for t in trials)])
        shared = next((j for j, (a, b) in enumerate(zip(tokens, done)) if a != b), min(len(tokens), len(done)))
        if len(tokens) > shared:
            logits = model(torch.tensor(tokens[shared:]), [Segment(slot, len(prompt) + shared, len(tokens) - shared)],
                           cache, row_exact=True).logits  # [len(tokens) - shared, vocab]
            rows = torch.cat([rows[:shared], logits_to_probs(logits, temperature)])  # [len(tokens), vocab]
            done = tokens
        means_of[i] = [acceptance_mean(float((first if t.position == 0 else rows[t.position - 1])[t.token]), t.q)
                       for t in trials]
    tested = [t for i in sorted(means_of) for t in samples[i][1]]
    return tested, [m for i in sorted(means_of) for m in means_of[i]]


__all__ = ["plain_next_figures", "trial_means"]
