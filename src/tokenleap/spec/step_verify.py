"""One sequence's verification within a step -- pure functions of its sampling parameters and
history, its draft and the target's rows; no cache, no model, and nothing of the sequence changed
but its generator's state (unseeded verification draws from it).

The target's rows first get the request's own history (penalties, logit bias, the grammar's mask,
min_tokens), each row for its own path; then the rule the request samples by decides: greedy
(argmax walk), seeded (the drafter-invariant race, ``seeded.py``) or unseeded (rejection sampling).
``verify.py`` (chains) and ``tree_verify.py`` (trees) hold the rules themselves.

**Shared across a step** (:func:`share_rows`): a greedy sequence whose rows need no adjustment is
verified by the argmax of each row alone, so one argmax over the rows of every such sequence of
the step (a run of adjacent segments at a time) replaces a call per sequence, and each walks its
own slice. The argmax of a row does not depend on the rows beside it (first maximum on ties), so
the tokens are those of the sequence verified alone. Greedy rows take ``sampling.argmax_rows``
(torch's argmax, exactly, several times faster over a large vocabulary): that kernel, not the
loop over sequences, is what greedy verification costs. Sampled rows are not shared: there the cost
is the filtering itself (softmax; top-p's sort, ~30 ms a row over a 152k vocabulary), and one
call over several sequences' rows measured no faster than a call per sequence (one thread).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenleap.config import ConfigError
from tokenleap.errors import ModelFormatError
from tokenleap.spec.acceptance import chain_trials, tree_trials
from tokenleap.spec.penalties import apply_penalties, suppress_early_stops
from tokenleap.spec.proposers.base import Draft
from tokenleap.spec.sampling import argmax_rows, params_probs
from tokenleap.spec.seeded import SeededNoise
from tokenleap.spec.sequence import Sequence
from tokenleap.spec.tree import TokenTree
from tokenleap.spec.tree_verify import TreeVerification, verify_tree_choices, verify_tree_coupled, verify_tree_sampling
from tokenleap.spec.verify import Verification, verify_coupled, verify_greedy_choices, verify_sampling


def check_finite(logits: torch.Tensor) -> None:
    """A ``ModelFormatError`` when a row of the target's ``logits`` [rows, vocab] holds NaN or +inf
    (one max a row: NaN propagates through it): weights damaged past what any choice of token can
    mean. Without it greedy decoding would read token 0 from such a row and sampling fail obscurely."""
    if not bool(torch.isfinite(logits.amax(dim=-1)).all()):
        raise ModelFormatError("the model computed NaN or infinite logits: its weights are damaged (a corrupt "
                               "file or conversion) or overflow this dtype; check the model file, or try "
                               "--dtype float32")


@dataclass(frozen=True, eq=False)
class TargetRows:
    """One sequence's verified rows of a step's forward, with what the step computed for them
    together with other sequences' rows."""

    logits: torch.Tensor  # [n, vocab]: row i is the target's distribution after node i's path
    # [n] each row's argmax, from one argmax over several sequences' rows (None: not shared -- a
    # sampled sequence, or one whose history adjusts its rows)
    choice: list[int] | None = None

    @property
    def size(self) -> int:
        return self.logits.shape[0]


def share_rows(seqs: list[Sequence], logits: torch.Tensor, spans: list[tuple[int, int]]) -> list[TargetRows]:
    """Each sequence's :class:`TargetRows`: ``spans[i] = (start, n)``, sequence i verifies rows
    ``logits[start:start + n]`` (``logits``: [rows, vocab], the step's forward). Greedy sequences
    without row adjustments get their argmax from one call per run of adjacent such sequences."""
    shared = [s.params.greedy and not adjusts_rows(s) for s in seqs]
    choices: list[list[int] | None] = [None] * len(seqs)
    i = 0
    while i < len(seqs):
        if not shared[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(seqs) and shared[j + 1]:
            j += 1
        lo, hi = spans[i][0], spans[j][0] + spans[j][1]  # the run's rows (any aux rows between included)
        run = argmax_rows(logits[lo:hi]).tolist()  # [hi - lo]
        for m in range(i, j + 1):
            start, n = spans[m]
            choices[m] = run[start - lo:start - lo + n]
        i = j + 1
    return [TargetRows(logits[start:start + n], c) for (start, n), c in zip(spans, choices)]


def adjusts_rows(seq: Sequence) -> bool:
    """Whether ``seq``'s history changes the target's rows before choosing (penalties, logit
    bias, a grammar, min_tokens not yet reached)."""
    p = seq.params
    return p.adjusts_logits or seq.constraint is not None or p.min_tokens > seq.num_generated


def target_logits(seq: Sequence, logits: torch.Tensor, drafted: list[int]) -> torch.Tensor:
    """The target's logits given each row's history: row i follows ``drafted[:i]``.
    ``logits``: [len(drafted) + 1, vocab]."""
    p = seq.params
    if p.adjusts_logits:
        logits = apply_penalties(logits, p, seq.prompt, seq.generated, drafted)
    if seq.constraint is not None:  # structured output: each row masked for its own grammar state
        logits = seq.constraint.mask(logits, drafted)
    if p.min_tokens > seq.num_generated:
        logits = suppress_early_stops(logits, p, seq.num_generated, seq.eos_ids)
    if (p.allowed_token_ids or p.bad_word_ids) and not bool(torch.isfinite(logits).any(dim=-1).all()):
        logits = _unreachable_rows_cleared(logits, drafted)
    return logits


def _unreachable_rows_cleared(logits: torch.Tensor, drafted: list[int]) -> torch.Tensor:
    """``logits`` [k + 1, vocab] where some row allows no token. A row the verification can reach (each
    drafted token before it allowed by its own row) is the request's dead end, as in plain decoding: a
    ``ConfigError``. A row after a drafted token its own row forbids is never reached (that token is
    rejected there), so it may follow a history plain decoding never has: it is made uniform instead."""
    reachable = len(drafted) + 1
    for i, t in enumerate(drafted):
        if not bool(torch.isfinite(logits[i, t])):
            reachable = i + 1
            break
    if not bool(torch.isfinite(logits[:reachable]).any(dim=-1).all()):
        raise ConfigError("allowed_token_ids or bad_words leave no token that the reply's grammar (or min_tokens) "
                          "allows here")
    out = logits.clone()
    out[reachable:] = 0.0  # (never read: uniform, so that nothing downstream meets a row of -inf)
    return out


def tree_target_logits(seq: Sequence, tree: TokenTree, logits: torch.Tensor) -> torch.Tensor:
    """:func:`target_logits` for every node of ``tree``, each on its own path (a leaf's path at a
    time; a node shared by several paths has the same history on each). ``logits``: [n, vocab]."""
    if not adjusts_rows(seq):
        return logits
    out, done, tokens = logits.float().clone(), [False] * tree.size, tree.tokens.tolist()
    for leaf in (i for i in range(tree.size) if not tree.children[i]):
        path = tree.path(leaf)
        rows = [0] + path
        adjusted = target_logits(seq, logits[rows], [tokens[c] for c in path])  # [len(rows), vocab]
        for r, node in enumerate(rows):
            if not done[node]:
                out[node], done[node] = adjusted[r], True
    return out


def verify_chain(seq: Sequence, draft: Draft | None, rows: TargetRows) -> Verification:
    """``seq``'s chain (``draft``; None: a plain step) against its rows (k + 1 of them)."""
    drafted = draft.tokens if draft else []
    p = seq.params
    if p.greedy and rows.choice is not None:
        return verify_greedy_choices(drafted, rows.choice)
    logits = target_logits(seq, rows.logits, drafted)  # [k + 1, vocab]
    if p.greedy:
        return verify_greedy_choices(drafted, argmax_rows(logits).tolist())
    tokens = torch.tensor(drafted, dtype=torch.long)  # [k]
    probs = params_probs(logits, p)  # [k + 1, vocab]
    if isinstance(seq.generator, SeededNoise):  # row 0 chooses the token at position len(tokens)
        return verify_coupled(tokens, probs, seq.generator, len(seq.tokens))
    q = draft.probs if draft else None
    result = verify_sampling(tokens, q, probs, seq.generator)
    if seq.trials is not None:
        seq.trials += chain_trials(seq.num_generated, drafted, q, result.num_accepted)
    return result


def verify_tree(seq: Sequence, tree: TokenTree, rows: TargetRows) -> TreeVerification:
    """``seq``'s token tree against its rows (one per node)."""
    p = seq.params
    if p.greedy and rows.choice is not None:
        return verify_tree_choices(tree, rows.choice)
    logits = tree_target_logits(seq, tree, rows.logits)  # [n, vocab]
    if p.greedy:
        return verify_tree_choices(tree, argmax_rows(logits).tolist())
    probs = params_probs(logits, p)  # [n, vocab]
    if isinstance(seq.generator, SeededNoise):  # the root's row chooses the token at position len(tokens)
        return verify_tree_coupled(tree, probs, seq.generator, len(seq.tokens))
    result = verify_tree_sampling(tree, probs, seq.generator)
    if seq.trials is not None:
        seq.trials += tree_trials(seq.num_generated, tree, result.path)
    return result


__all__ = ["TargetRows", "share_rows", "adjusts_rows", "target_logits", "tree_target_logits", "verify_chain",
           "verify_tree"]
