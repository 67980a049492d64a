"""``tokenleap verify`` (certify.py): passes on a tiny target / draft pair, and fails with a clear
report when a deliberately broken verifier is patched into the engine -- one that accepts drafts
too often when sampling (``min(1, p/q) ** 0.5``), one that keeps a wrong greedy draft.

The tiny target is built so that a modest sample count has power: its residual stream is
dominated by one direction that the LM head maps onto token 0, so each step puts about half its
mass on token 0 and spreads the rest over the vocabulary -- a distribution whose shape moves
clearly with the temperature (as a real model's long tail does), unlike a random tiny model's.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

import tokenleap.spec.certify as certify_module
import tokenleap.spec.step_verify as step_verify
import tokenleap.spec.verify as verify_module
from tokenleap.spec.certify import (CertifyConfig, Certificate, certify, check_distribution, check_greedy,
                               chi2_homogeneity)
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.models.build import build_transformer
from tokenleap.spec.proposers.draft_model import DraftModelProposer
from tokenleap.spec.sampling import inverse_cdf, rand_rows
from tokenleap.spec.stats import SpecStats
from tokenleap.spec.verify import Verification

from conftest import ToyTokenizer, random_weights, tiny_config

V, SLOTS = 64, 16
PROMPTS = [[5, 3, 1], [4, 5, 6, 4, 5, 6], [1, 1, 2, 2, 3]]
CFG = CertifyConfig(samples=500, max_tokens=16, block=6)


def peaked_model(seed: int, lead: float):
    """One layer, small random weights; embeddings near one vector c, and the head's row 0 along c,
    so token 0's logit is about ``lead`` above a noisy tail."""
    cfg = tiny_config("llama", vocab=V, hidden=32, intermediate=64, heads=2, kv_heads=1, layers=1)
    w = random_weights(cfg, seed, scale=0.05)
    gen = torch.Generator().manual_seed(seed + 100)
    c = torch.randn(cfg.hidden_size, generator=gen)  # [hidden]
    w["model.embed_tokens.weight"] = c + 0.3 * torch.randn(V, cfg.hidden_size, generator=gen)  # [V, hidden]
    head = 0.3 * torch.randn(V, cfg.hidden_size, generator=gen) / math.sqrt(cfg.hidden_size)  # [V, hidden]
    head[0] += lead * c / c.norm() / math.sqrt(cfg.hidden_size)  # the normed state is ~ c / |c| * sqrt(hidden)
    w["lm_head.weight"] = head
    return build_transformer(cfg, w, torch.float32)


def engine_factory(target, draft, tree_nodes: int = 0, proposer_class=DraftModelProposer):
    def make(speculative: bool) -> Engine:
        proposer = proposer_class(draft, V, 32, num_slots=SLOTS) if speculative else None
        return Engine(target, ToyTokenizer(V, eos=()), max_len=32, num_slots=SLOTS, proposer=proposer,
                      controller=ControllerConfig(max_k=4, fixed_k=4), tree_nodes=tree_nodes)
    return make


@pytest.fixture(scope="module")
def target():
    return peaked_model(11, 5.0)


@pytest.fixture(scope="module")
def factory(target):
    return engine_factory(target, peaked_model(12, 1.0))  # the draft: far flatter, another tail


def test_certifies_a_correct_engine(factory):
    cert = certify(factory, PROMPTS, CFG)
    report = cert.report()
    assert cert.passed, report
    names = ["greedy", "seeded", "distribution", "power", "block-rule", "acceptance"]
    assert [c.name for c in cert.checks] == names
    assert all(line.startswith("PASS") for line in report.splitlines()[:-1]) and "lossless" in report
    by_name = {c.name: c.figures for c in cert.checks}
    assert by_name["greedy"]["accepted_tokens"] > 0 and by_name["distribution"]["accepted_tokens"] > 0
    assert by_name["power"]["p_value"] < CFG.alpha <= by_name["distribution"]["p_value"]
    assert by_name["block-rule"]["rows"] == 3 * CFG.block
    count = by_name["acceptance"]
    assert count["trials"] > CFG.samples and count["p_value"] >= CFG.alpha and 1 < count["detectable_factor"] < 1.1
    json.dumps(cert.to_dict())  # the --json form


def _sqrt_acceptance(draft_tokens, draft_probs, target_probs, generator=None):
    """Rejection sampling that accepts with min(1, p/q) ** 0.5 (too often where p < q)."""
    k = draft_tokens.shape[0]
    u = rand_rows(1, k, generator)[0]  # [k]
    for i in range(k):
        x = int(draft_tokens[i])
        p, q = float(target_probs[i, x]), float(draft_probs[i, x])
        if not u[i] < min(1.0, p / q) ** 0.5:
            residual = (target_probs[i] - draft_probs[i]).clamp_min(0).double()[None]  # [1, vocab]
            return Verification(draft_tokens[:i].tolist() + [int(inverse_cdf(residual, rand_rows(1, 1, generator))[0])], i)
    last = inverse_cdf(target_probs[k:].double(), rand_rows(1, 1, generator))  # [1]
    return Verification(draft_tokens.tolist() + [int(last[0])], k)


def test_fails_a_verifier_that_accepts_too_often(factory, monkeypatch):
    monkeypatch.setattr(step_verify, "verify_sampling", _sqrt_acceptance)
    checks = check_distribution(factory, PROMPTS[0], CFG)
    cert = Certificate(tuple(checks))
    report = cert.report()
    assert not cert.passed
    line = report.splitlines()[0]
    assert line.startswith("FAIL  distribution") and "do not follow the plain distribution" in line, report
    assert report.splitlines()[1].startswith("PASS  power"), report  # the test could see it: a real failure
    assert "NOT certified" in report


def test_the_acceptance_count_fails_a_verifier_the_distribution_tests_pass(factory, monkeypatch):
    """Drafts kept with min(1, 1.1 p/q): the fit and homogeneity tests cannot tell at these sample
    sizes (the bias sits on the drafted tokens, diluted over the vocabulary), the count of kept
    drafts against the exact expectation does -- and under-acceptance fails it as well."""
    real = verify_module._num_accepted
    for factor, sign in ((1.1, 1), (0.9, -1)):
        monkeypatch.setattr(verify_module, "_num_accepted", lambda x, q, p, u, f=factor: real(x, q, p, u / f))
        cfg = CertifyConfig(samples=300, block=6)
        distribution, power, acceptance = check_distribution(factory, PROMPTS[0], cfg)
        assert distribution.passed and power.passed, (distribution.summary, power.summary)
        # (too few kept can also reject a draft min(1, p/q) = 1 made certain: that line says so instead)
        said = ("not kept as often as min(1, p/q) says", "went the way min(1, p/q) made impossible")
        assert not acceptance.passed and any(s in acceptance.summary for s in said), acceptance.summary
        assert sign * acceptance.figures["z"] > 3, acceptance.summary


def test_trial_means_read_the_rows_plain_next_figures_reduces(target, monkeypatch):
    """Each trial's mean equals the one from the fit test's table of figures by prefix and token -- the
    same bitwise rows, for the root row and deeper ones -- with the samples' shared prefixes computed once: the
    forwards feed 2 + 1 + 2 + 1 tokens for these samples, not 2 + 2 + 4 + 5, and the trials come back in
    the samples' order."""
    from tokenleap.spec.acceptance import Trial, acceptance_mean
    from tokenleap.spec.exact_probs import plain_next_figures, trial_means
    samples = [((7, 9, 11, 13), [Trial(1, 9, 1.0, True), Trial(2, 12, 0.25, False)]),
               ((7, 3), [Trial(0, 5, 0.5, False), Trial(2, 4, 1.0, False)]),  # position 2: past the end, kept
               ((8,), []),
               ((7, 9, 11, 13, 2), [Trial(4, 6, 0.3, False), Trial(1, 9, 0.9, True)]),
               ((7, 9, 11, 13, 5, 1), [Trial(5, 2, 0.6, False)])]
    fed, real = [], type(target).forward

    def counted(self, tokens, *args, **kwargs):
        fed.append(len(tokens))
        return real(self, tokens, *args, **kwargs)
    monkeypatch.setattr(type(target), "forward", counted)
    tested, means = trial_means(target, PROMPTS[0], samples, 0.8)
    assert sorted(fed[1:]) == [1, 1, 2, 2], fed  # (the prompt's forward first)
    monkeypatch.undo()
    sampled = {s[:t.position] + (t.token,) for s, ts in samples for t in ts}
    table = plain_next_figures(target, PROMPTS[0], sampled, 0.8)
    want = [acceptance_mean(table[(s[:t.position], t.token)][1], t.q) for s, ts in samples for t in ts]
    assert tested == [t for _, ts in samples for t in ts] and means == want and 0 < min(means) < max(means) <= 1


def test_the_fit_test_on_reduced_rows_gives_what_it_gives_on_whole_rows(target):
    """``fit_of`` over ``plain_next_figures``' table (each row reduced to its sampled tokens' figures as it
    is computed) gives bitwise the fit test over every prefix's whole row, each from a forward of its own."""
    from tokenleap.cache.contiguous import KVCache
    from tokenleap.models.transformer import Segment
    from tokenleap.spec.certify import fit_of
    from tokenleap.spec.exact_probs import plain_next_figures
    from tokenleap.spec.sampling import logits_to_probs
    from tokenleap.spec.stat_tests import fit_test
    gen = torch.Generator().manual_seed(3)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(40):
        sample = tuple(int(x) for x in torch.randint(0, 6, (3,), generator=gen))
        counts[sample] = counts.get(sample, 0) + 1
    table = plain_next_figures(target, PROMPTS[0], set(counts), 0.8)
    tokens, rows = [], []
    prompt = PROMPTS[0]
    for sample, count in sorted(counts.items()):  # plain decoding of each sample: its prompt, then a token a step
        cache = KVCache(target.config, 1, len(prompt) + 4, target.dtype)
        slot = cache.allocate()
        logits = target(torch.tensor(prompt), [Segment(slot, 0, len(prompt))], cache,
                        logit_rows=torch.tensor([len(prompt) - 1])).logits  # [1, vocab]
        for j, tok in enumerate(sample):
            tokens += [tok] * count
            rows += [logits_to_probs(logits, 0.8)[0]] * count
            logits = target(torch.tensor([tok]), [Segment(slot, len(prompt) + j, 1)], cache, row_exact=True).logits
    whole = fit_test(torch.tensor(tokens), torch.stack(rows), torch.Generator().manual_seed(4))
    assert fit_of(counts, table, torch.Generator().manual_seed(4)) == whole and whole.ks.n == 120


def test_a_tree_proposer_counts_its_walks(target, monkeypatch):
    """Draft trees: the first child at each node of the walk is a trial; a right verifier passes."""
    walks = []
    real = Engine._verify_tree

    def counted(self, seq, tree, rows):
        walks.append(tree.size)
        return real(self, seq, tree, rows)
    monkeypatch.setattr(Engine, "_verify_tree", counted)
    cfg = CertifyConfig(samples=200, block=6)
    acceptance = check_distribution(engine_factory(target, peaked_model(12, 1.0), tree_nodes=8), PROMPTS[0], cfg)[2]
    assert walks and max(walks) > 5  # trees, not chains, were verified
    assert acceptance.passed and acceptance.figures["trials"] >= cfg.samples, acceptance.summary


def test_fails_a_greedy_verifier_that_keeps_one_wrong_token(target, monkeypatch):
    real = step_verify.verify_greedy_choices

    def keeps_first_draft(draft_tokens, choice):
        v = real(draft_tokens, choice)
        if v.num_accepted == 0 and draft_tokens:  # bug: the first draft token is kept anyway
            return Verification([draft_tokens[0], choice[1]], 1)
        return v

    monkeypatch.setattr(step_verify, "verify_greedy_choices", keeps_first_draft)
    cfg = tiny_config("llama", vocab=V, hidden=32, intermediate=64, heads=2, kv_heads=1, layers=1)
    wrong = build_transformer(cfg, random_weights(cfg, 12, scale=1.0), torch.float32)  # drafts other tokens
    result, _ = check_greedy(engine_factory(target, wrong), PROMPTS, CFG)
    assert not result.passed
    assert result.line().startswith("FAIL  greedy") and "differs at token" in result.line()
    assert result.figures["mismatches"] and result.figures["identical"] < len(PROMPTS)


def test_chi2_homogeneity_pools_rare_categories():
    same = chi2_homogeneity({"a": 50, "b": 50, "c": 1}, {"a": 52, "b": 48, "d": 2})
    assert same.categories == 2 and same.dof == 1 and same.p_value > 0.5  # c and d pooled into b
    differ = chi2_homogeneity({"a": 90, "b": 10}, {"a": 50, "b": 50})
    assert differ.p_value < 1e-8
    # the statistic against a hand computation: a 2 x 2 table [[30, 20], [20, 30]], chi2 = 4.0, dof 1
    hand = chi2_homogeneity({"a": 30, "b": 20}, {"a": 20, "b": 30})
    assert hand.statistic == pytest.approx(4.0) and hand.p_value == pytest.approx(0.0455003, rel=1e-5)
    assert chi2_homogeneity({"a": 10}, {"a": 7}).p_value == 1.0  # one category: nothing to tell apart


def test_the_distribution_check_samples_after_the_first_prompt_the_method_drafts_for(factory, monkeypatch):
    """A method with nothing to draft after the first prompt (n-gram lookup after a story's opening)
    is tested after the next; none drafting after any prompt fails, saying what to give."""
    real, sampled, silent = certify_module.sample_counts, [], [PROMPTS[0]]

    def sample_counts(engine, prompt, *args, **kwargs):
        counts, stats = real(engine, prompt, *args, **kwargs)
        sampled.append(list(prompt))
        if list(prompt) in silent and kwargs.get("trials") is not None:
            kwargs["trials"].clear()  # (as if nothing were drafted: no draft was tested either)
        return counts, SpecStats() if list(prompt) in silent else stats  # (as if nothing were drafted)
    monkeypatch.setattr(certify_module, "sample_counts", sample_counts)
    cfg = CertifyConfig(samples=40, block=6)
    result = check_distribution(factory, PROMPTS, cfg)[0]
    assert result.figures["prompt"] == 1 and result.figures["draft_tokens"] > 0
    assert sampled[:2] == PROMPTS[:2] and set(map(tuple, sampled[2:])) == {tuple(PROMPTS[1])}
    silent[:] = PROMPTS
    result = check_distribution(factory, PROMPTS, cfg)[0]
    assert not result.passed
    assert "no draft was tested at the first 2 tokens after any of the 3 prompts" in result.summary
    assert "--prompts" in result.summary


def test_a_prompt_that_fills_the_context_is_named_as_the_reason_nothing_was_drafted(factory):
    result, _, acceptance = check_distribution(factory, [[5, 3, 1] * 10], CertifyConfig(samples=12, block=6))
    assert not result.passed and "a prompt leaves 2 tokens of the 32-token context window" in result.summary
    assert not acceptance.passed and "no draft was tested" in acceptance.summary


def test_drafts_past_the_counted_positions_do_not_exercise_the_distribution_check(target):
    """A method that drafts only from the fifth token on: the samples run to 16 tokens for the
    acceptance count, but the two distribution tests see the first 2, where nothing was verified --
    plain against plain, which must not pass as exercised."""
    class LateDrafter(DraftModelProposer):
        def propose_many(self, requests):
            out = super().propose_many(requests)
            return [d if len(r.tokens) - len(PROMPTS[0]) >= 4 else None for r, d in zip(requests, out)]

    make = engine_factory(target, peaked_model(12, 1.0), proposer_class=LateDrafter)
    result, _, acceptance = check_distribution(make, PROMPTS[0], CertifyConfig(samples=40, block=6))
    assert result.figures["draft_tokens"] > 0 and result.figures["verified_positions"] == 0
    assert not result.passed and "no draft was tested at the first 2 tokens" in result.summary
    assert acceptance.figures["trials"] > 0  # (the count has its trials, later in the samples)


def test_power_failure_fails_the_certificate(factory):
    """Too few samples to see the temperature bias: the report says so and the run fails."""
    power = check_distribution(factory, PROMPTS[0], CertifyConfig(samples=12, block=6))[1]
    assert not power.passed and "too few to certify" in power.summary and "raise --samples" in power.summary


def test_config_errors():
    from tokenleap.config import ConfigError
    with pytest.raises(ConfigError, match="positions must be >= 2"):
        CertifyConfig(positions=1)
    with pytest.raises(ConfigError, match="temperature > 0"):
        CertifyConfig(temperature=0.0)


def test_verify_command_reports_each_check_and_exits_1_on_failure(factory, monkeypatch, tmp_path, capsys):
    """The CLI on the tiny pair (the engine factory patched in): one line per check, the verdict,
    exit 1 when a check fails (here: 12 samples cannot show power), and the same as JSON."""
    import tokenleap.cli.verify as verify_cli
    from tokenleap.cli.main import main

    monkeypatch.setattr(verify_cli, "engine_factory",
                        lambda args, spec: (factory, lambda text: ToyTokenizer(V).encode(text)[:6]))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "abcabc"}\n{"prompt": "hello"}\n')
    argv = ["verify", "--model", str(tmp_path), "--spec", "ngram", "--prompts", str(prompts), "--samples", "12",
            "--max-tokens", "8"]
    assert main(argv) == 1
    out = capsys.readouterr().out.splitlines()
    assert [ln.split()[1] for ln in out[:6]] == ["greedy", "seeded", "distribution", "power", "block-rule",
                                                 "acceptance"]
    assert out[3].startswith("FAIL  power") and out[-1] == "verdict: NOT certified"
    assert out[0].startswith("PASS  greedy") and "2/2 prompts token-identical" in out[0]
    assert main(argv + ["--json"]) == 1
    cert = json.loads(capsys.readouterr().out)
    assert cert["passed"] is False and cert["prompts"] == 2 and len(cert["checks"]) == 6
