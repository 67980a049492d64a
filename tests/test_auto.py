"""``--spec auto``: a composite proposer choosing per sequence and per step among a draft model and
n-gram lookup. Whatever it picks, output must be plain decoding's: greedy and seeded token for
token, unseeded in distribution -- also when the arm switches mid-request, so the draft model
catches up on tokens another arm drafted."""
from __future__ import annotations

import itertools

import pytest
import torch

import tokenleap.spec.engine as engine_mod
import tokenleap.spec.step_verify as step_verify
from tokenleap.config import SamplingParams, SpecConfig
from tokenleap.spec.bandit import BanditConfig, Choice
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.auto import AutoProposer
from tokenleap.spec.proposers.base import Draft, DraftRequest
from tokenleap.spec.proposers.draft_model import DraftModelProposer
from tokenleap.spec.proposers.ngram import NgramProposer
from tokenleap.spec.sampling import make_generator

from bandit_helpers import FLAT, bandit, costs
from conftest import ToyTokenizer, tiny_model

V = 96
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 30, 31, 32, 3, 4, 30], list(range(20, 45))]


@pytest.fixture(scope="module")
def models():
    return tiny_model(seed=0), tiny_model(seed=3)  # target, a different draft (partial acceptance)


def auto(draft, max_len: int = 256, vocab: int = V) -> AutoProposer:
    # (n-gram from one-token matches too: the toy models repeat single tokens, rarely pairs)
    return AutoProposer({"draft": DraftModelProposer(draft, vocab, max_len), "ngram": NgramProposer(4, 1)},
                        BanditConfig(max_k=4))


def alternating(proposer: AutoProposer) -> AutoProposer:
    """Force the arm to switch every step (draft, n-gram, draft, ...; n-gram without a match hands the
    step to the draft): the paths a real choice takes, at their most frequent."""
    counter = itertools.count()

    def plan(seq, batch, target, backlogs, remaining, max_k, present=None):
        first, second = ("draft", "ngram") if next(counter) % 2 == 0 else ("ngram", "draft")
        return [Choice(first, min(3, max_k), 0.0), Choice(second, min(3, max_k), 0.0)]

    proposer.bandit.plan = plan  # type: ignore[method-assign]
    return proposer


def generate(target, proposer, prompt, params, max_len: int = 256, vocab: int = V):
    eng = Engine(target, ToyTokenizer(vocab), max_len=max_len, proposer=proposer,
                 controller=ControllerConfig(max_k=4))
    *_, (seq, _) = eng.generate(prompt, params)
    return seq


@pytest.mark.parametrize("forced", [False, True])
def test_auto_greedy_equals_plain(models, forced):
    target, draft = models
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    for prompt in PROMPTS:
        plain = generate(target, None, prompt, params)
        prop = alternating(auto(draft)) if forced else auto(draft)
        seq = generate(target, prop, prompt, params)
        assert seq.generated == plain.generated
        shares = seq.stats.to_dict()["proposers"]
        assert sum(p["tokens"] for p in shares.values()) == seq.stats.new_tokens
        if forced:  # both arms drafted within the one request
            assert shares["draft"]["steps"] > 0 and shares["ngram"]["steps"] > 0


def test_auto_seeded_equals_plain_seeded(models):
    target, draft = models
    for seed, prompt in zip((1, 2, 3), PROMPTS):
        params = SamplingParams(max_tokens=40, temperature=0.8, seed=seed, ignore_eos=True)
        plain = generate(target, None, prompt, params)
        seq = generate(target, alternating(auto(draft)), prompt, params)
        assert seq.generated == plain.generated
        assert seq.stats.proposer_steps.get("draft", 0) > 0 and seq.stats.proposer_steps.get("ngram", 0) > 0


def test_draft_arm_catches_up_after_ngram_steps(models):
    """The draft model is told nothing while n-gram drafts; its next proposal feeds what it missed."""
    target, draft = models
    prop = alternating(auto(draft))
    generate(target, prop, PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True))
    drafts = prop.bandit.arms["draft"].costs
    assert drafts.catch_up_cost is not None  # a backlog was fed at a draft proposal


# -- sampling: exact distribution while switching ------------------------------------------------
SV, N_NEW, N_SAMPLES = 3, 4, 1500
SPROMPT = [0, 1, 2, 1]
SPARAMS = dict(temperature=0.9, top_k=0, top_p=1.0)


def small(seed: int, scale: float):
    from conftest import random_weights, tiny_config
    from tokenleap.models.build import build_transformer
    cfg = tiny_config("llama", vocab=SV, hidden=32, intermediate=64, heads=2, kv_heads=1)
    return build_transformer(cfg, random_weights(cfg, seed, scale=scale), torch.float32)


def sampled(target, draft, monkeypatch, seed: int) -> dict[tuple[int, ...], int]:
    gen = torch.Generator().manual_seed(seed)
    monkeypatch.setattr(engine_mod, "request_randomness",
                        lambda _: make_generator(int(torch.randint(0, 2**31, (1,), generator=gen))))
    eng = Engine(target, ToyTokenizer(SV, eos=()), max_len=32, proposer=alternating(auto(draft, 32, SV)),
                 controller=ControllerConfig(max_k=3))
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(N_SAMPLES):
        *_, (seq, _) = eng.generate(SPROMPT, SamplingParams(max_tokens=N_NEW, ignore_eos=True, **SPARAMS))
        counts[tuple(seq.generated)] = counts.get(tuple(seq.generated), 0) + 1
    assert eng.totals.proposer_steps["draft"] > 0 and eng.totals.proposer_steps["ngram"] > 0
    return counts


@pytest.fixture(scope="module")
def small_pair():
    return small(11, 1.0), small(12, 2.0)


def test_auto_sampling_matches_target_distribution(small_pair, monkeypatch):
    from test_spec_sampling import exact_distribution, p_value
    target, draft = small_pair
    assert p_value(sampled(target, draft, monkeypatch, seed=7), exact_distribution(target)) > 1e-3


def test_auto_sampling_check_rejects_a_biased_verifier(small_pair, monkeypatch):
    """Negative control: the same test, same seed, with rejections resampled from p instead of the
    residual (a classic bug) must fail."""
    from test_spec_sampling import exact_distribution, p_value
    from tokenleap.spec.sampling import sample
    from tokenleap.spec.verify import Verification

    def biased(draft_tokens, draft_probs, target_probs, generator=None):
        k = draft_tokens.shape[0]
        u = torch.rand(k, generator=generator, dtype=torch.float64)
        for i in range(k):
            x = int(draft_tokens[i])
            q = float(draft_probs[i, x]) if draft_probs is not None else 1.0
            if u[i] * q >= float(target_probs[i, x]):
                return Verification(draft_tokens[:i].tolist() + [int(sample(target_probs[i:i + 1], generator)[0])], i)
        return Verification(draft_tokens.tolist() + [int(sample(target_probs[k:], generator)[0])], k)

    monkeypatch.setattr(step_verify, "verify_sampling", biased)
    target, draft = small_pair
    assert p_value(sampled(target, draft, monkeypatch, seed=7), exact_distribution(target)) < 1e-3


# -- the bandit's choices ------------------------------------------------------------------------
def test_each_sequence_gets_the_arm_its_own_text_favours():
    b, target = bandit(draft_cost=0.003), costs(FLAT)
    code, prose = b.new_sequence(), b.new_sequence()
    for _ in range(10):
        b.observe_acceptance(code, "ngram", 4, 4)
        b.observe_acceptance(code, "draft", 4, 1)
        b.observe_acceptance(prose, "ngram", 4, 0)
        b.observe_acceptance(prose, "draft", 4, 3)
    assert b.plan(code, 1, target, {}, 100, 4)[0].arm == "ngram"
    assert b.plan(prose, 1, target, {}, 100, 4)[0].arm == "draft"


def test_acceptance_follows_the_text_as_it_changes():
    b, target = bandit(draft_cost=0.003), costs(FLAT)
    seq = b.new_sequence()
    for _ in range(10):
        b.observe_acceptance(seq, "ngram", 4, 0)
        b.observe_acceptance(seq, "draft", 4, 3)
    assert b.plan(seq, 1, target, {}, 100, 4)[0].arm == "draft"
    for _ in range(10):  # the request starts copying: n-gram drafts are now all accepted
        b.observe_acceptance(seq, "ngram", 4, 4)
    assert b.plan(seq, 1, target, {}, 100, 4)[0].arm == "ngram"


def test_plain_when_nothing_pays_then_a_probe():
    b, target = bandit(draft_cost=0.012), costs(FLAT)  # a draft token costs more than a target step
    seq = b.new_sequence()
    for _ in range(10):
        b.observe_acceptance(seq, "ngram", 4, 0)
        b.observe_acceptance(seq, "draft", 4, 1)
    plans = [b.plan(seq, 1, target, {}, 100, 4) for _ in range(b.cfg.probe_every)]
    assert all(p == [] for p in plans[:-1])
    b2, seq2 = bandit(draft_cost=0.001), None  # a cheap draft that is merely unaccepted gets probed
    seq2 = b2.new_sequence()
    for _ in range(10):
        b2.observe_acceptance(seq2, "ngram", 4, 0)
        b2.observe_acceptance(seq2, "draft", 4, 0)
    plans = [b2.plan(seq2, 1, target, {}, 100, 4) for _ in range(b2.cfg.probe_every)]
    assert all(p == [] for p in plans[:-1])
    assert plans[-1] == [Choice("draft", b2.cfg.probe_k, 0.0, probe=True)]


def test_a_catch_up_that_does_not_pay_back_keeps_the_draft_out():
    b, target = bandit(draft_cost=0.002, settle_steps=0), costs(FLAT)
    b.observe_catch_up("draft", 100, 0.5)  # 5 ms a token the draft missed
    seq = b.new_sequence()
    for _ in range(10):
        b.observe_acceptance(seq, "draft", 4, 3)
        b.observe_acceptance(seq, "ngram", 4, 0)
    assert b.plan(seq, 1, target, {"draft": 2}, 100, 4)[0].arm == "draft"
    assert b.plan(seq, 1, target, {"draft": 400}, 5, 4) == []  # 2 s to catch up for 5 tokens


def test_leaving_a_draft_in_step_is_charged_its_catch_up():
    """A draft model that drafted the last step and pays would catch up on whatever another arm's
    step emits: a free arm slightly ahead on its own figures takes the step only while the draft is
    behind anyway, and one far ahead (copying) takes it regardless."""
    def ranked(ngram_accepts: int, draft_backlog: int) -> list[str]:
        b, target = bandit(draft_cost=0.003, settle_steps=0), costs(FLAT)
        b.observe_catch_up("draft", 100, 0.05)
        seq = b.new_sequence()
        for _ in range(10):
            b.observe_acceptance(seq, "ngram", 4, ngram_accepts)
            b.observe_acceptance(seq, "draft", 4, 2)
        return [c.arm for c in b.rank(seq, 1, target, {"draft": draft_backlog}, 100, 4)]

    assert ranked(ngram_accepts=1, draft_backlog=1) == ["ngram", "draft"]  # the draft is behind already
    assert ranked(ngram_accepts=1, draft_backlog=0) == ["draft", "ngram"]  # switching would cost a catch-up
    assert ranked(ngram_accepts=4, draft_backlog=0) == ["ngram", "draft"]  # copying gains more than that


class _Warmable:
    """A stand-in draft arm: a backlog until prefilled, and a record of its prefills."""
    shadow = False

    def __init__(self) -> None:
        self.fed: dict[int, int] = {}
        self.prefills = 0

    def begin(self, seq_id, prompt):
        self.fed[seq_id] = 0

    def backlog(self, seq_id, tokens):
        return len(tokens) - self.fed[seq_id]

    def prefill(self, seq_id, tokens):
        self.fed[seq_id], self.prefills = len(tokens), self.prefills + 1


def warm_arms(ngram_accepts: int, draft_accepts: int, remaining: float = 100, settle_steps: int = 0) -> int:
    """Prefills the draft arm gets for a new sequence after earlier sequences measured the arms."""
    prop = AutoProposer({"draft": _Warmable(), "ngram": NgramProposer(4, 1)}, BanditConfig(max_k=4))
    prop.bandit = bandit(draft_cost=0.002, settle_steps=settle_steps)
    prop.bandit.observe_catch_up("draft", 100, 0.05)  # 0.5 ms a prompt token
    old = prop.bandit.new_sequence()
    for _ in range(20):
        prop.bandit.observe_acceptance(old, "ngram", 4, ngram_accepts)
        prop.bandit.observe_acceptance(old, "draft", 4, draft_accepts)
    prop.target = costs(FLAT)
    prop.begin(0, list(range(40)))
    prop.prefill(0, list(range(40)), 1, remaining)
    return prop.arms["draft"].prefills


def test_the_draft_is_prefilled_only_when_it_would_draft_first():
    assert warm_arms(ngram_accepts=0, draft_accepts=3) == 1  # prose so far: the draft drafts first
    assert warm_arms(ngram_accepts=4, draft_accepts=3) == 0  # n-gram lookup serves: no draft prefill
    assert warm_arms(ngram_accepts=0, draft_accepts=3, remaining=1) == 0  # a warm-up one token cannot repay
    assert warm_arms(ngram_accepts=0, draft_accepts=3, settle_steps=3) == 0  # n-gram measures this text first


def test_a_new_sequence_settles_before_a_draft_catches_up():
    b, target = bandit(draft_cost=0.002), costs(FLAT)
    b.observe_catch_up("draft", 100, 0.05)
    old = b.new_sequence()
    for _ in range(20):  # earlier sequences: prose, the draft's
        b.observe_acceptance(old, "ngram", 4, 0)
        b.observe_acceptance(old, "draft", 4, 3)
    code, prose = b.new_sequence(), b.new_sequence()
    for _ in range(b.cfg.settle_steps):  # nobody catches up while n-gram's shadow measures each text
        assert "draft" not in [c.arm for c in b.plan(code, 1, target, {"draft": 40}, 100, 4)]
        assert "draft" not in [c.arm for c in b.plan(prose, 1, target, {"draft": 40}, 100, 4)]
        b.observe_acceptance(code, "ngram", 4, 4)  # the code copies its prompt
        b.observe_acceptance(prose, "ngram", 4, 0)
    assert b.plan(code, 1, target, {"draft": 40}, 100, 4)[0].arm == "ngram"
    assert b.plan(prose, 1, target, {"draft": 40}, 100, 4)[0].arm == "draft"


def test_auto_draft_arm_is_a_cascade_unless_trees_are_on(models):
    from tokenleap.api import LLM
    from tokenleap.models.pretrained import LoadedModel
    from tokenleap.spec.proposers.cascade import CascadeDraftProposer

    def loaded(m):
        return LoadedModel(m, ToyTokenizer(V), torch.float32, "none", "tiny", None)
    target, draft = models
    chains = LLM.from_loaded(loaded(target), SpecConfig(method="auto", draft_model="d"), draft=loaded(draft))
    trees = LLM.from_loaded(loaded(target), SpecConfig(method="auto", draft_model="d", tree="on"), draft=loaded(draft))
    assert isinstance(chains.proposer.arms["draft"], CascadeDraftProposer)
    assert not isinstance(trees.proposer.arms["draft"], CascadeDraftProposer)
    # the draft's own settings (the int4 auto picks, a dtype) and layer skip's keep the other arms in
    for extra in ({"draft_quant": "int4"}, {"draft_dtype": "float32"}, {"skip_layers": "0"}):
        llm = LLM.from_loaded(loaded(target), SpecConfig(method="auto", draft_model="d", **extra), draft=loaded(draft))
        assert {"draft", "ngram"} <= set(llm.proposer.arms), extra


def test_spec_config_auto():
    assert SpecConfig(method="auto").method == "auto"
    assert SpecConfig(method="auto", draft_model="auto").draft_model == "auto"
    from tokenleap.config import ConfigError
    with pytest.raises(ConfigError):
        SpecConfig(method="draft", draft_model="auto")


class _WindowOnly:
    """A stand-in lookahead arm: every step carries its own rows and ``guess`` (none by default)."""
    shadow = False
    aux_rows = 4
    guess: list[int] = []

    def begin(self, seq_id, prompt):
        pass

    def backlog(self, seq_id, tokens):
        return 0

    def propose_many(self, requests):
        return [Draft(tokens=list(self.guess), probs=None, aux=object()) for _ in requests]  # type: ignore[arg-type]

    def accept(self, seq_id, num_accepted, path=None):
        pass


def test_a_step_with_only_the_arms_own_rows_counts_as_a_miss():
    """Such a step emits one token; left uncounted, the arm's figures would keep promising the yield
    of its steps with guesses while most of its steps have none."""
    prop = AutoProposer({"lookahead": _WindowOnly()}, BanditConfig(max_k=4))
    prop.begin(0, [1, 2, 3])
    prop._plans[0] = [Choice("lookahead", 4, 0.0)]
    (d,) = prop.propose_many([DraftRequest(0, [1, 2, 3], 4, SamplingParams(), None)])
    assert d is not None and d.tokens == [] and d.proposer == "lookahead"
    prop.accept(0, 0)
    acc = prop._seqs[0].arms["lookahead"].acceptance
    assert acc.trials[0] == 1.0 and acc.hits[0] == 0.0


def test_a_draft_shorter_than_asked_and_accepted_whole_counts_its_next_position_as_a_miss():
    arm = _WindowOnly()
    arm.guess = [5, 6]
    prop = AutoProposer({"lookahead": arm}, BanditConfig(max_k=4))
    prop.begin(0, [1, 2, 3])
    prop._plans[0] = [Choice("lookahead", 4, 0.0)]
    prop.propose_many([DraftRequest(0, [1, 2, 3], 4, SamplingParams(), None)])
    prop.accept(0, 2)
    acc = prop._seqs[0].arms["lookahead"].acceptance
    assert acc.trials[:4] == [1.0, 1.0, 1.0, 0.0] and acc.hits[:3] == [1.0, 1.0, 0.0]


def test_a_probe_that_misses_delays_the_arms_next_probe_and_a_draft_accepted_whole_restores_it():
    """Only probes count misses (a ranked draft's misses are the acceptance figures' business); any
    draft of the arm accepted whole shows the text suits it again."""
    arm = _WindowOnly()
    arm.guess = [5, 6]
    prop = AutoProposer({"lookahead": arm}, BanditConfig(max_k=4))
    prop.begin(0, [1, 2, 3])
    state = prop._seqs[0].arms["lookahead"]
    for probe, accepted, misses in ((False, 0, 0), (True, 0, 1), (True, 1, 1), (True, 0, 2), (True, 2, 0),
                                    (True, 0, 1), (False, 1, 1), (False, 2, 0)):
        prop._plans[0] = [Choice("lookahead", 2, 0.0, probe=probe)]
        prop.propose_many([DraftRequest(0, [1, 2, 3], 2, SamplingParams(), None)])
        prop.accept(0, accepted)
        assert state.probe_misses == misses


def test_an_arm_that_caught_up_still_times_its_later_draft_tokens(models):
    """An arm's proposal that first catches the draft up (a probe after plain steps or other arms'
    steps) prices a draft token by the tokens drafted after the catch-up, for one sequence; in a
    batch the catch-up's forward drafted for the others too, so no figure is taken."""
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    for seqs in (1, 2):
        prop = AutoProposer({"draft": DraftModelProposer(models[1], V, 256, num_slots=2), "ngram": NgramProposer(4, 1)},
                            BanditConfig(max_k=4))
        arm = prop.arms["draft"]
        for i in range(seqs):
            arm.begin(i, PROMPTS[2])  # not prefilled: the proposal feeds the prompt first
        got = prop._draft("draft", [DraftRequest(i, PROMPTS[2], 4, greedy) for i in range(seqs)])
        assert all(d.catch_up_drafted == 1 and len(d.tokens) == 4 and d.proposer == "draft" for d in got)
        costs = prop.bandit.arms["draft"].costs
        assert costs.catch_up_cost is not None
        assert (set(costs.draft_cost_at) == {1}) if seqs == 1 else (costs.draft_cost_at == {})
