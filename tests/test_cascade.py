"""Cascade drafting (proposers/cascade.py): n-gram guesses speculate the draft model's own steps.

The proposals -- tokens and each token's draft distribution -- equal plain draft-model drafting's
token for token (greedy, seeded, unseeded with the same generator state, a reduced-vocabulary
head, a grammar-free batch of sequences), with fewer draft forwards where the text repeats; the
target's output equals plain decoding."""
from __future__ import annotations

import pytest
import torch

from tokenleap.config import SamplingParams
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.base import DraftRequest
from tokenleap.spec.proposers.cascade import CascadeDraftProposer
from tokenleap.spec.proposers.draft_model import DraftModelProposer
from tokenleap.spec.sampling import make_generator
from tokenleap.spec.seeded import SeededNoise

from conftest import ToyTokenizer, tiny_model

VOCAB = 96
# repetitive prompts: a tiny random draft also falls into loops, which the n-gram guesses follow
# (a low temperature: its flat distributions would otherwise rarely repeat a guess)
PROMPTS = [[5, 9, 14, 3, 7, 9, 14, 3, 7, 9], [40, 41, 42, 43, 40, 41, 42, 43, 40], [11] * 6 + [12, 13, 11, 11]]
PARAMS = {
    "greedy": SamplingParams(max_tokens=40, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.15, seed=21),
    "unseeded": SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.15),
}


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", seed=1, vocab=VOCAB, hidden=64, intermediate=128, layers=2)


@pytest.fixture(scope="module")
def draft():
    return tiny_model("qwen2", seed=78, vocab=VOCAB)


def _generator(params: SamplingParams, seed: int):
    if params.greedy:
        return None
    return SeededNoise(params.seed) if params.seed is not None else make_generator(seed)


@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize("reduced_head", [False, True], ids=["full-head", "reduced-head"])
def test_cascade_proposals_equal_plain_draft_proposals(draft, kind, reduced_head):
    """Rounds of proposals over a growing sequence (each round keeps a few drafted tokens, as a
    target's partial acceptance would): the same tokens and distributions as plain drafting."""
    from tokenleap.spec.proposers.draft_head import ReducedVocabHead
    params = PARAMS[kind]
    head = ReducedVocabHead(draft.lm_head, static_size=40, special_ids=[2]) if reduced_head else None
    plain = DraftModelProposer(draft, VOCAB, 256, num_slots=3, head=head)
    cascade = CascadeDraftProposer(draft, VOCAB, 256, num_slots=3, head=head)
    seqs = {i: list(p) for i, p in enumerate(PROMPTS)}
    gens = {name: {i: _generator(params, 100 + i) for i in seqs} for name in ("plain", "cascade")}
    for p in (plain, cascade):
        for i, tokens in seqs.items():
            p.begin(i, tokens)
    for rnd in range(12):
        ks = [6, 3, 8]
        reqs = {name: [DraftRequest(i, list(t), ks[i], params, gens[name][i]) for i, t in seqs.items()]
                for name in gens}
        want = plain.propose_many(reqs["plain"])
        got = cascade.propose_many(reqs["cascade"])
        for i, (w, g) in enumerate(zip(want, got)):
            assert g.tokens == w.tokens, (kind, rnd, i)
            assert (g.probs is None) == (w.probs is None)
            if w.probs is not None:
                assert torch.equal(g.probs, w.probs)
            keep = (rnd + i) % (len(w.tokens) + 1)  # accept a varying prefix, then a "recovered" token
            seqs[i] += w.tokens[:keep] + [(w.tokens[keep] + 1) % VOCAB if keep < len(w.tokens) else 7]
            plain.accept(i, keep)
            cascade.accept(i, keep)
    assert cascade.stats["kept"] > 0, "no guess was ever kept: the test exercised nothing"
    assert cascade.stats["forwards"] < sum(len(s) for s in seqs.values())  # fewer forwards than tokens


def _engine(target, proposer):
    return Engine(target, ToyTokenizer(VOCAB, (2,)), max_len=160, proposer=proposer,
                  controller=ControllerConfig(max_k=6, fixed_k=5 if proposer is not None else None))


def _run(eng, prompt, params):
    *_, (seq, _) = eng.generate(prompt, params)
    return seq


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_cascade_output_equals_plain_decoding(target, draft, kind):
    params = PARAMS[kind]
    for prompt in PROMPTS:
        want = _run(_engine(target, None), prompt, params).generated
        plain_draft = _run(_engine(target, DraftModelProposer(draft, VOCAB, 160)), prompt, params)
        cascade = CascadeDraftProposer(draft, VOCAB, 160)
        seq = _run(_engine(target, cascade), prompt, params)
        assert seq.generated == want, prompt
        assert seq.stats.draft_tokens == plain_draft.stats.draft_tokens  # the same proposals
        assert seq.stats.accepted_tokens == plain_draft.stats.accepted_tokens


def test_cascade_self_draft_keeps_guesses_and_saves_forwards(target):
    """The target as its own draft on a repeating prompt: every proposal accepted, and most draft
    tokens come from kept guesses rather than their own forward."""
    prompt = [5, 9, 14, 3, 7] * 4
    params = PARAMS["greedy"]
    cascade = CascadeDraftProposer(target, VOCAB, 160)
    seq = _run(_engine(target, cascade), prompt, params)
    assert seq.generated == _run(_engine(target, None), prompt, params).generated
    assert seq.stats.draft_acceptance_rate == 1.0
    assert cascade.stats["kept"] > 0 and cascade.stats["forwards"] < seq.stats.draft_tokens


def test_bench_cascade_row_equals_plain(smollm2_gguf, tmp_path):
    """``tokenleap bench --methods draft,cascade``: the cascade row runs and its outputs equal plain's
    (SmolLM2 drafting for itself: every draft accepted, so the n-gram guesses are exercised)."""
    import json

    from tokenleap.cli.main import main
    out = tmp_path / "bench"
    rc = main(["bench", "--target", "smollm2-135m-instruct", "--draft", "smollm2-135m-instruct", "--dataset", "chat",
               "--limit", "1", "--max-new-tokens", "24", "--methods", "draft:k=4,cascade:k=4", "--out", str(out),
               "--no-progress"])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert {m["name"]: m["status"] for m in results["methods"]} == {"plain": "ok", "draft:k=4": "ok",
                                                                     "cascade:k=4": "ok"}
    assert results["equality"]["by_method"]["cascade:k=4"]["compared"] == 1
    assert not results["equality"]["mismatches"]


@pytest.mark.parametrize("flags,message", [
    (["--draft-spec", "ngram"], "use it with --spec draft --draft-model M"),
    (["--spec", "ngram", "--draft-spec", "ngram"], "use it with --spec draft --draft-model M"),
    (["--spec", "draft", "--draft-model", "smollm2-135m-instruct", "--draft-spec", "ngram", "--spec-tree", "on"],
     "drop --spec-tree on"),
])
def test_draft_spec_flag_misuse_is_one_line_before_loading(flags, message, capsys, monkeypatch):
    import tokenleap.api
    from tokenleap.cli.main import main
    monkeypatch.setattr(tokenleap.api, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["generate", "--model", "smollm2-135m-instruct", "--prompt", "hi", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
