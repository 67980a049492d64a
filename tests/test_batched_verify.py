"""Verification shared across a step's sequences (spec/step_verify.py): one argmax over the rows of
every greedy sequence without logit adjustments, each sequence walking its own slice -- the same
tokens as each sequence decoded alone, whatever else shares its step."""
from __future__ import annotations

import pytest
import torch

import tokenleap.spec.engine as engine_mod
import tokenleap.spec.step_verify as step_verify
from tokenleap.config import SamplingParams
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.base import Draft
from tokenleap.spec.proposers.ngram import NgramProposer
from tokenleap.spec.sampling import argmax_rows, make_generator
from tokenleap.spec.sequence import Sequence
from tokenleap.spec.tree import TokenTree

from conftest import ToyTokenizer, tiny_model

VOCAB = 96
PROMPTS = [[5, 9, 14, 3, 7, 9, 14, 3, 7, 9, 14, 8, 5, 9, 14, 3], [11, 12, 11, 13, 11, 12, 11, 14, 11, 12],
           [40, 41, 42, 43, 40, 41, 42, 43, 40, 41], [20, 21, 20, 22, 20, 21, 20, 23, 20], [7, 8, 9, 7, 8, 9, 7]]
PARAMS = [  # greedy, greedy with penalties, seeded, unseeded (a generator of the test's), greedy
    SamplingParams(max_tokens=24, ignore_eos=True),
    SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4),
    SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, seed=4),
    SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, top_k=30),
    SamplingParams(max_tokens=20, ignore_eos=True),
]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=3, vocab=VOCAB, hidden=64, intermediate=128, layers=2)


def _engine(model, slots: int) -> Engine:
    return Engine(model, ToyTokenizer(VOCAB, (2,)), max_len=96, num_slots=slots, proposer=NgramProposer(3, 1),
                  controller=ControllerConfig(max_k=4, fixed_k=4), tree_nodes=8)


def _generators(monkeypatch) -> None:
    """Unseeded requests draw from generators seeded by creation order, so a batch and a run alone
    can be given the same ones."""
    seeds = iter(range(100, 200))
    monkeypatch.setattr(engine_mod, "request_randomness",
                        lambda seed: make_generator(next(seeds)) if seed is None else step_verify.SeededNoise(seed))


def _spy(monkeypatch) -> list[list]:
    """Each step's shared rows (one list per step)."""
    steps, share = [], step_verify.share_rows
    monkeypatch.setattr(engine_mod, "share_rows", lambda *a: (steps.append(share(*a)), steps[-1])[1])
    return steps


def test_a_mixed_batch_gives_every_sequence_its_tokens_alone(model, monkeypatch):
    alone = []
    for prompt, params in zip(PROMPTS, PARAMS):
        _generators(monkeypatch)  # (the one unseeded sequence gets the generator the batch gives it)
        *_, (seq, _) = _engine(model, 1).generate(prompt, params)
        alone.append(seq.generated)
    _generators(monkeypatch)
    steps = _spy(monkeypatch)
    eng = _engine(model, len(PROMPTS))
    seqs = [eng.add(p, params) for p, params in zip(PROMPTS, PARAMS)]
    reports = []
    while not all(s.finished for s in seqs):
        reports.append(eng.step(seqs))
    assert [s.generated for s in seqs] == alone
    outcomes = [o for r in reports for o in r.outcomes]
    assert any(o.tree_nodes for o in outcomes) and any(o.drafted and o.tree_nodes is None for o in outcomes)
    # the greedy sequences without penalties shared one argmax; the others verified on their own rows
    shared = [[r.choice is not None for r in rows] for rows in steps]
    assert shared[0] == [True, False, False, False, True]
    assert any(o.tree_nodes and o.seq_id in (seqs[0].seq_id, seqs[4].seq_id) for o in outcomes)


def _seq(params: SamplingParams, generated: list[int] = ()) -> Sequence:
    return Sequence(seq_id=0, prompt=[5, 6, 7], params=params, eos_ids=frozenset({2}), detokenizer=None,
                    tokens=[5, 6, 7, *generated])


def test_shared_rows_walk_the_argmax_each_sequence_would_compute():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(14, 5000, generator=gen)  # [rows, vocab]: argmax_rows' blocks, and a tail
    logits[3, 17] = logits[3, 4040] = logits[3].max() + 1.0  # a tie: the lower id wins in every path
    greedy, penalized = SamplingParams(max_tokens=9), SamplingParams(max_tokens=9, frequency_penalty=0.7)
    seqs = [_seq(greedy, [9]), _seq(penalized, [9]), _seq(greedy), _seq(greedy, [4])]
    spans = [(0, 5), (5, 3), (8, 4), (12, 2)]  # rows 8..11: a tree of 4 nodes; rows 12..13 aux after a root
    rows = step_verify.share_rows(seqs, logits, spans)
    assert [r.choice is not None for r in rows] == [True, False, True, True]
    for r, (start, n) in zip(rows, spans):
        assert torch.equal(r.logits, logits[start:start + n])
        assert r.choice is None or r.choice == logits[start:start + n].argmax(-1).tolist()
    assert rows[0].choice[3] == 17
    drafts = [logits[i].argmax().item() for i in range(4)]  # the target's own choices: all accepted
    got = step_verify.verify_chain(seqs[0], Draft(drafts, None), rows[0])
    want = step_verify.verify_chain(seqs[0], Draft(drafts, None), step_verify.TargetRows(rows[0].logits))
    assert got == want and got.num_accepted == 4
    first = rows[2].choice[0]
    tree = TokenTree(torch.tensor([9, first, (first + 1) % 5000, 78]), torch.tensor([-1, 0, 0, 1]))
    got = step_verify.verify_tree(seqs[2], tree, rows[2])
    assert got == step_verify.verify_tree(seqs[2], tree, step_verify.TargetRows(rows[2].logits))
    assert got.path[:1] == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torch_argmax(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, 151936, generator=gen)  # [rows, vocab]: 148 blocks of 1024 and a tail of 384
    x[0, 5000] = x[0, 90000] = 100.0  # a tie across blocks: the first
    x[1, 151935] = 100.0  # the last column, in the tail
    x[2, 151000] = x[2, 151935] = 100.0  # a tie inside the tail
    x[3] = float("-inf")  # nothing allowed: column 0, as torch.argmax says
    x[4, 7] = x[4, 3] = float("nan")  # a NaN counts as the maximum: the first NaN
    x[5, 150000], x[5, 2] = float("nan"), float("inf")
    x[6] = 0.0
    x[6, 3000] = -0.0  # -0.0 == 0.0: the first
    x[7, 2047] = x[7, 2048] = 50.0  # either side of a block boundary
    x[8, 151552:] = 100.0  # the whole tail
    x = x.to(dtype)
    want = torch.argmax(x, dim=-1)
    assert argmax_rows(x).tolist() == want.tolist()
    assert want[:9].tolist() == [5000, 151935, 151000, 0, 3, 150000, 0, 2047, 151552]
    small = x[:, :1500]  # fewer than two blocks: torch's own argmax
    assert argmax_rows(small).tolist() == torch.argmax(small, dim=-1).tolist()
