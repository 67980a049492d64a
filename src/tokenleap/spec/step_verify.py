"""One sequence's verification within a step -- pure functions of its sampling parameters and
history, its draft and the target's rows; no cache, no model, no mutation of the sequence.

The target's rows first get the request's own history (penalties, logit bias, the grammar's mask,
min_tokens), each row for its own path; then the rule the request samples by decides: greedy
(argmax walk), seeded (the drafter-invariant race, ``seeded.py``) or unseeded (rejection sampling).
``verify.py`` (chains) and ``tree_verify.py`` (trees) hold the rules themselves.
"""
from __future__ import annotations

import torch

from tokenleap.spec.penalties import apply_penalties, suppress_early_stops
from tokenleap.spec.proposers.base import Draft
from tokenleap.spec.sampling import logits_to_probs
from tokenleap.spec.seeded import SeededNoise
from tokenleap.spec.sequence import Sequence
from tokenleap.spec.tree import TokenTree
from tokenleap.spec.tree_verify import TreeVerification, verify_tree_coupled, verify_tree_greedy, verify_tree_sampling
from tokenleap.spec.verify import Verification, verify_coupled, verify_greedy, verify_sampling


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
    return logits


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


def verify_chain(seq: Sequence, draft: Draft | None, logits: torch.Tensor) -> Verification:
    """``seq``'s chain (``draft``; None: a plain step) against its rows ``logits`` [k + 1, vocab]."""
    drafted = draft.tokens if draft else []
    p = seq.params
    logits = target_logits(seq, logits, drafted)
    tokens = torch.tensor(drafted, dtype=torch.long)  # [k]
    if p.greedy:
        return verify_greedy(tokens, logits)
    probs = logits_to_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)  # [k + 1, vocab]
    if isinstance(seq.generator, SeededNoise):  # row 0 chooses the token at position len(tokens)
        return verify_coupled(tokens, probs, seq.generator, len(seq.tokens))
    return verify_sampling(tokens, draft.probs if draft else None, probs, seq.generator)


def verify_tree(seq: Sequence, tree: TokenTree, logits: torch.Tensor) -> TreeVerification:
    """``seq``'s token tree against its rows ``logits`` [n, vocab] (one per node)."""
    p = seq.params
    logits = tree_target_logits(seq, tree, logits)  # [n, vocab]
    if p.greedy:
        return verify_tree_greedy(tree, logits)
    probs = logits_to_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)  # [n, vocab]
    if isinstance(seq.generator, SeededNoise):  # the root's row chooses the token at position len(tokens)
        return verify_tree_coupled(tree, probs, seq.generator, len(seq.tokens))
    return verify_tree_sampling(tree, probs, seq.generator)


__all__ = ["adjusts_rows", "target_logits", "tree_target_logits", "verify_chain", "verify_tree"]
