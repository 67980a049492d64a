"""Token trees (spec/tree.py) and their verification (spec/tree_verify.py).

Exactness of unseeded tree verification is checked statistically: a Markov "target" (the row at a
node depends only on the node's token) and a different Markov "draft" whose children are drawn
without replacement; every emitted token must follow the target's transition from the token before
it. The same test, at the same seed and size, rejects two classic multi-candidate bugs.
"""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

import tokenleap.spec.tree_verify as tv
from tokenleap.spec.sampling import logits_to_probs
from tokenleap.spec.seeded import SeededNoise
from tokenleap.spec.tree import TokenTree
from tokenleap.spec.tree_verify import verify_tree_coupled, verify_tree_greedy, verify_tree_sampling
from tokenleap.spec.verify import verify_coupled, verify_greedy, verify_sampling

from tree_helpers import no_q_update, restart_from_p_with_q


def _tree(tokens, parents, q=None):
    return TokenTree(torch.tensor(tokens), torch.tensor(parents), q)


def test_tree_shape_helpers():
    t = _tree([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 3])
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert t.children == [[1, 2], [3, 4], [], [5], [], []]
    assert t.path(5) == [1, 3, 5] and t.path(0) == []
    assert t.positions(10).tolist() == [10, 11, 11, 12, 12, 13]
    vis = t.visible()
    assert vis[5].tolist() == [True, True, False, True, False, True]
    assert vis[2].tolist() == [True, False, True, False, False, False]  # never a sibling
    assert t.compaction([1, 3, 5]) == [(3, 2), (5, 3)]
    assert not t.is_chain and TokenTree.chain(9, [1, 2]).is_chain


def test_trie_from_paths_merges_prefixes():
    t = TokenTree.from_paths(7, [[1, 2, 3], [1, 2, 4], [5]])
    assert t.tokens.tolist() == [7, 1, 2, 3, 4, 5]
    assert t.parents.tolist() == [-1, 0, 1, 2, 2, 0]


@pytest.mark.parametrize("tokens,parents,message", [
    ([1, 2], [0, 0], "parents\\[0\\] must be -1"),
    ([1, 2, 3], [-1, 2, 0], "earlier node"),
    ([1, 2, 2], [-1, 0, 0], "distinct"),
])
def test_invalid_trees_are_refused(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        _tree(tokens, parents)


def test_greedy_follows_argmax_through_siblings():
    # root's argmax is 3 (second child), node 2's argmax 4 (its child), then 0 after it
    logits = torch.full((5, 6), -1.0)
    logits[0, 3] = logits[2, 4] = logits[4, 0] = logits[1, 5] = 1.0
    t = _tree([9, 1, 3, 2, 4], [-1, 0, 0, 1, 2])
    v = verify_tree_greedy(t, logits)
    assert v.path == [2, 4] and v.tokens == [3, 4, 0] and v.num_accepted == 2


@pytest.mark.parametrize("k", [0, 1, 4])
def test_chains_verify_as_the_chain_verifier(k):
    g = torch.Generator().manual_seed(k)
    vocab = 7
    for trial in range(30):
        logits = torch.randn(k + 1, vocab, generator=g) * 2
        drafts = torch.randint(0, vocab, (k,), generator=g)
        probs = logits_to_probs(logits, temperature=1.0)
        q = logits_to_probs(torch.randn(k, vocab, generator=g), temperature=1.0)
        if trial % 3 == 0:  # the draft agrees with the target's argmax
            drafts = logits.argmax(-1)[:k]
        t = TokenTree.chain(9, drafts.tolist(), q)
        ref = verify_greedy(drafts, logits)
        assert verify_tree_greedy(t, logits).tokens == ref.tokens
        for q_arg in (q, None):
            tree = TokenTree.chain(9, drafts.tolist(), q_arg)
            a = verify_tree_sampling(tree, probs, torch.Generator().manual_seed(trial))
            b = verify_sampling(drafts, q_arg, probs, torch.Generator().manual_seed(trial))
            assert a.tokens == b.tokens and a.num_accepted == b.num_accepted
        noise = SeededNoise(trial)
        assert verify_tree_coupled(t, probs, noise, 40).tokens == verify_coupled(drafts, probs, noise, 40).tokens


def test_coupled_emits_the_seeded_choices_in_any_branch():
    vocab, noise, pos = 11, SeededNoise(5), 100
    g = torch.Generator().manual_seed(0)
    row = logits_to_probs(torch.randn(vocab, vocab, generator=g), temperature=1.0)  # Markov: row by token
    plain = [3]
    for d in range(3):  # plain seeded sampling of three tokens after the root token 3
        plain.append(int(noise.choose(row[plain[-1]][None], pos + d)[0]))
    decoy = [(plain[1] + 1) % vocab, (plain[1] + 2) % vocab]
    t = TokenTree.from_paths(3, [[decoy[0]], [decoy[1], 0], [plain[1], plain[2]]])
    v = verify_tree_coupled(t, row[t.tokens], noise, pos)
    assert v.tokens == plain[1:4] and [int(t.tokens[c]) for c in v.path] == plain[1:3]


# ---- statistical exactness of unseeded tree verification ----
V = 5
BRANCHING = (3, 2, 1)  # children drawn per node at depth 0, 1, 2
TARGET = logits_to_probs(torch.randn(V, V, generator=torch.Generator().manual_seed(1)) * 1.5, temperature=1.0)
DRAFT = logits_to_probs(torch.randn(V, V, generator=torch.Generator().manual_seed(2)) * 1.5, temperature=1.0)


def _random_tree(root: int, g: torch.Generator, stochastic: bool) -> TokenTree:
    tokens, parents, frontier = [root], [-1], [0]
    for width in BRANCHING:
        nxt = []
        for node in frontier:
            if stochastic:  # without replacement from the draft's row
                kids = torch.multinomial(DRAFT[tokens[node]], width, replacement=False, generator=g)
            else:  # deterministic: the draft's top tokens
                kids = DRAFT[tokens[node]].argsort(descending=True)[:width]
            for x in kids.tolist():
                nxt.append(len(tokens))
                tokens.append(x)
                parents.append(node)
        frontier = nxt
    t = torch.tensor(tokens)
    return TokenTree(t, torch.tensor(parents), DRAFT[t] if stochastic else None)


def _transition_p_value(stochastic: bool, trials: int = 1500) -> float:
    """p-value of 'every emitted token follows TARGET's row of the token before it'."""
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(V, V)
    for i in range(trials):
        root = i % V
        tree = _random_tree(root, g, stochastic)
        v = verify_tree_sampling(tree, TARGET[tree.tokens], g)
        prev = root
        for tok in v.tokens:
            counts[prev, tok] += 1
            prev = tok
    n = counts.sum(-1, keepdim=True)  # [V, 1]
    expected = n * TARGET  # [V, V]
    stat = float(((counts - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, V * (V - 1)))


@pytest.mark.parametrize("stochastic", [True, False])
def test_tree_sampling_is_exact(stochastic):
    assert _transition_p_value(stochastic) > 0.001


@pytest.mark.parametrize("biased", [no_q_update, restart_from_p_with_q])
def test_statistical_check_rejects_biased_tree_verifiers(biased, monkeypatch):
    monkeypatch.setattr(tv, "_try_children", biased)
    assert _transition_p_value(True) < 0.001
