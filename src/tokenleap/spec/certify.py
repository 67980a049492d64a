"""``tokenleap verify``: evidence that speculation is lossless for one configuration.

Speculative decoding claims that it changes nothing but speed. The project's tests show that on
tiny models; this module checks it on the user's own target, proposer and settings, with four
checks that each compare a plain engine against a speculative one built by the same factory:

* **greedy** -- speculative greedy output is token-identical to plain greedy output;
* **seeded** -- seeded sampling gives the same tokens with and without speculation;
* **distribution** -- unseeded sampling (rejection sampling): the first ``positions`` generated
  tokens of plain and speculative samples, by a chi-square test of homogeneity of their joint
  counts, and every speculative token against the target's exact plain distribution for its
  prefix (a goodness-of-fit test, ``stat_tests``); its **power** is shown on a known small bias
  (plain sampling at temperature T * 0.9, the same number of samples, must be rejected): if the
  test cannot see that bias, it could not have seen a broken verifier either, and the sample count
  is too small to certify anything;
* **block rule** -- the logits of a one-token step equal, bit for bit, the matching row of a
  k-token verification block (what makes greedy speculation exact in the first place);
* **acceptance** -- the drafts the distribution check's speculative samples tested (each sample run
  to ``trial_tokens`` tokens) were kept as often as ``min(1, p/q)`` with the target's exact ``p``
  says (``acceptance.py``): the directed test of the verifier's rule, which sees a few percent of
  over-acceptance that the distribution tests see only diluted over the vocabulary.

A check whose speculative engine drafted nothing fails too: it would certify plain decoding
against itself. The functions are pure apart from the engines: they take an
``EngineFactory`` (``factory(speculative) -> Engine``) and token-id prompts, so the tests run them
on tiny models and the CLI on real ones.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tokenleap.cache.contiguous import KVCache
from tokenleap.config import ConfigError, SamplingParams
from tokenleap.spec.acceptance import Trial, acceptance_count, acceptance_verdict
from tokenleap.spec.engine import Engine
from tokenleap.spec.exact_probs import plain_next_figures, trial_means
from tokenleap.spec.stats import SpecStats
from tokenleap.models.transformer import Segment
from tokenleap.spec.sampling import make_generator, torch_seed
from tokenleap.spec.sequence import Sequence
from tokenleap.spec.stat_tests import Fit, TokenFigures, chi2_homogeneity, fit_figures

EngineFactory = Callable[[bool], Engine]  # speculative? -> an engine (the same target either way)

DEFAULT_PROMPTS = (  # the distribution check samples continuations of the first the method drafts after
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three most important things to know about the French Revolution are",
    "Repeat after me: red, green, blue, red, green, blue, red, green,",
    "import numpy as np\n\ndef normalize(x):\n",
)


@dataclass(frozen=True)
class CertifyConfig:
    """What the checks run: token counts, the sampling temperature, sample size and test level."""

    max_tokens: int = 32  # tokens generated per prompt by the greedy and seeded checks
    temperature: float = 1.0  # of the sampled checks
    samples: int = 300  # samples per arm of the distribution check (plain, speculative, biased)
    positions: int = 2  # the distribution check compares the joint of the first N generated tokens
    alpha: float = 0.01  # test level: plain vs speculative must not reject, the bias must
    bias: float = 0.9  # the power check's temperature factor
    block: int = 8  # rows of the block in the one-row-vs-block check
    trial_tokens: int = 16  # tokens each speculative sample runs to, for the acceptance count's trials
    seed: int = 0  # seeds of the seeded check and of every random stream

    def __post_init__(self) -> None:
        for name in ("max_tokens", "samples", "positions", "block", "trial_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.positions < 2:
            raise ConfigError("positions must be >= 2: the first token comes from the prompt's prefill, "
                              "which never drafts")
        if not self.temperature > 0:
            raise ConfigError(f"the sampled checks need a temperature > 0, got {self.temperature!r}")
        if not 0 < self.alpha < 0.5:
            raise ConfigError(f"alpha must be in (0, 0.5), got {self.alpha!r}")
        if not 0 < self.bias < 1:
            raise ConfigError(f"bias must be in (0, 1), got {self.bias!r}")


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict, a one-line summary of its figures, and the figures themselves."""

    name: str
    passed: bool
    summary: str
    figures: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name:<12s} {self.summary}"


@dataclass(frozen=True)
class Certificate:
    checks: tuple[CheckResult, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def report(self) -> str:
        verdict = "lossless on these checks" if self.passed else "NOT certified"
        return "\n".join([c.line() for c in self.checks] + [f"verdict: {verdict}"])

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "checks": [asdict(c) for c in self.checks]}


# -- running requests -----------------------------------------------------------------------
def run_request(engine: Engine, prompt: list[int], params: SamplingParams,
                generator: torch.Generator | None = None) -> Sequence:
    """Decode one request to the end; ``generator`` replaces an unseeded request's own randomness
    (so a certificate is reproducible)."""
    seq = engine.create(prompt, params)
    if generator is not None:
        seq.generator = generator
    engine.attach(seq)
    try:
        while engine.prefill_step(seq):
            pass
        while not seq.finished:
            engine.step([seq])
    finally:
        engine.release(seq)
    return seq


def _drafted(stats: SpecStats) -> str:
    return (f"{stats.draft_tokens} drafted, {stats.accepted_tokens} accepted "
            f"(tau {stats.tau:.2f})")


def _compare_outputs(name: str, make: EngineFactory, prompts: list[list[int]],
                     params_of: Callable[[int], SamplingParams]) -> tuple[CheckResult, list[list[int]]]:
    """Plain vs speculative outputs of every prompt, token for token; also returns plain's."""
    plain, spec = make(False), make(True)
    stats, outputs, diffs = SpecStats(), [], []
    for i, prompt in enumerate(prompts):
        params = params_of(i)
        want = run_request(plain, prompt, params).generated
        seq = run_request(spec, prompt, params)
        stats.merge(seq.stats)
        outputs.append(want)
        got = seq.generated
        if got != want:
            at = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            diffs.append({"prompt": i, "token": at, "plain": want[at:at + 4], "speculative": got[at:at + 4]})
    same = len(prompts) - len(diffs)
    figures = {"prompts": len(prompts), "identical": same, "tokens": sum(map(len, outputs)),
               "draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens,
               "tau": round(stats.tau, 4), "mismatches": diffs}
    summary = f"{same}/{len(prompts)} prompts token-identical, {figures['tokens']} tokens; {_drafted(stats)}"
    if diffs:
        d = diffs[0]
        summary += (f"; prompt {d['prompt']} differs at token {d['token']}: plain {d['plain']} "
                    f"vs speculative {d['speculative']}")
    elif stats.draft_tokens == 0:
        summary += "; nothing was drafted, so speculation was not exercised (try other prompts)"
    return CheckResult(name, not diffs and stats.draft_tokens > 0, summary, figures), outputs


def check_greedy(make: EngineFactory, prompts: list[list[int]], cfg: CertifyConfig
                 ) -> tuple[CheckResult, list[list[int]]]:
    """Greedy speculative output == plain greedy output on every prompt."""
    params = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True)
    return _compare_outputs("greedy", make, prompts, lambda i: params)


def check_seeded(make: EngineFactory, prompts: list[list[int]], cfg: CertifyConfig) -> CheckResult:
    """Seeded sampling (seed ``cfg.seed + i`` for prompt i): the same tokens with and without speculation."""
    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=cfg.seed + i,
                              ignore_eos=True)
    return _compare_outputs("seeded", make, prompts, params)[0]


# -- the distribution check -----------------------------------------------------------------
def sample_counts(engine: Engine, prompt: list[int], temperature: float, n: int, positions: int,
                  seed: int, batch: int | None = None, trials: list | None = None, tokens: int = 0
                  ) -> tuple[dict[tuple[int, ...], int], SpecStats]:
    """Counts of the first ``positions`` generated tokens over ``n`` unseeded samples (rejection
    sampling), each request with its own generator drawn from a stream seeded by ``seed``.

    ``positions + 1`` tokens are generated so that every counted position after the first (which
    the prefill samples) goes through verification of a draft. Requests run ``batch`` at a time
    (default: the engine's cache slots) through batched steps -- each sequence's tokens are those
    it would get alone, since every row is computed row-exact. ``trials``, if given, receives each
    sample's generated tokens and its verification trials (``acceptance.Trial``);
    ``tokens`` generates more than ``positions + 1`` tokens (more trials; the counts are the same)."""
    params = SamplingParams(max_tokens=max(tokens, positions + 1), temperature=temperature, ignore_eos=True)
    stream = torch.Generator().manual_seed(torch_seed(seed))
    batch = max(1, min(batch or engine.cache.num_slots, n))
    counts: dict[tuple[int, ...], int] = {}
    stats = SpecStats()
    for start in range(0, n, batch):
        seqs = []
        try:
            for _ in range(min(batch, n - start)):
                seq = engine.create(prompt, params)
                seq.generator = make_generator(int(torch.randint(0, 2**62, (1,), generator=stream)))
                seq.trials = [] if trials is not None else None
                engine.attach(seq)
                seqs.append(seq)
                while engine.prefill_step(seq):
                    pass
            while any(not s.finished for s in seqs):
                engine.step(seqs)
        finally:
            for seq in seqs:
                engine.release(seq)
        for seq in seqs:
            stats.merge(seq.stats)
            key = tuple(seq.generated[:positions])
            counts[key] = counts.get(key, 0) + 1
            if trials is not None:
                out = seq.generated  # (a trial past the end, of a draft cut at max_tokens, has no known prefix)
                trials.append((tuple(out), [t for t in seq.trials if t.position <= len(out)]))
    return counts, stats


def fit_of(counts: dict[tuple[int, ...], int], table: dict[tuple[tuple[int, ...], int], tuple],
           generator: torch.Generator) -> Fit:
    """Every position of every sample tested against its exact plain distribution (``stat_tests``),
    through the figures ``table`` holds by (prefix, token) (``exact_probs.plain_next_figures``)."""
    figures = []
    for sample, count in sorted(counts.items()):
        for j, tok in enumerate(sample):
            figures += [table[(sample[:j], tok)]] * count
    lo, mass, mean, var = torch.tensor(figures, dtype=torch.float64).reshape(-1, 4).T  # [n] each
    return fit_figures(TokenFigures(lo, mass, mean, var), generator)


def check_distribution(make: EngineFactory, prompts: list[int] | list[list[int]],
                       cfg: CertifyConfig) -> list[CheckResult]:
    """Unseeded sampling, plain vs speculative, by two tests, and their power on a known bias, on the
    first of ``prompts`` (a prompt, or a list of them) after which the method drafts within the
    counted positions -- a method that finds nothing to draft there after one prompt (n-gram lookup
    after a story's opening) is tested on the next.

    The homogeneity test compares the two samples' joint counts of the first tokens. The
    goodness-of-fit test checks every sampled token against the target's exact plain distribution
    for its prefix (``stat_tests.fit_test``); plain's own samples must pass it as well (a check
    of the reference probabilities). Power: plain sampling at T * ``bias`` must be rejected by the
    goodness-of-fit test -- the one a certificate can rest on at a few hundred samples.

    Returns the distribution, power and acceptance checks (``check_acceptance``: the speculative
    samples, run to ``cfg.trial_tokens`` tokens, give its trials)."""
    plain, spec = make(False), make(True)
    t, n = cfg.temperature, cfg.samples
    prompts = [prompts] if prompts and isinstance(prompts[0], int) else prompts
    for index, prompt in enumerate(prompts):
        # drafts tested at the counted positions (1 .. positions - 1; 0 is the prefill's) are what
        # exercise the two tests. Short samples (positions + 1 tokens, a stream of their own) find the
        # first prompt with any, so the long samples the count needs run after one prompt only.
        if index < len(prompts) - 1:
            pilot: list[tuple[tuple[int, ...], list[Trial]]] = []
            sample_counts(spec, prompt, t, n, cfg.positions, cfg.seed + 5, trials=pilot)
            if not any(tr.position < cfg.positions for _, ts in pilot for tr in ts):
                continue
        trials: list[tuple[tuple[int, ...], list[Trial]]] = []  # (a sample's tokens, its trials)
        spec_counts, stats = sample_counts(spec, prompt, t, n, cfg.positions, cfg.seed + 2, trials=trials,
                                           tokens=cfg.trial_tokens)
        break
    verified = sum(tr.position < cfg.positions for _, ts in trials for tr in ts)
    base, _ = sample_counts(plain, prompt, t, n, cfg.positions, cfg.seed + 1)
    biased, _ = sample_counts(plain, prompt, t * cfg.bias, n, cfg.positions, cfg.seed + 3)
    same = chi2_homogeneity(base, spec_counts)
    power = chi2_homogeneity(base, biased)
    table = plain_next_figures(plain.model, prompt, set(base) | set(spec_counts) | set(biased), t)
    stream = torch.Generator().manual_seed(torch_seed(cfg.seed + 4))
    fit_plain, fit_spec, fit_bias = (fit_of(c, table, stream) for c in (base, spec_counts, biased))
    head = f"prompt {index}, first {cfg.positions} tokens at T={t:g}, {n} samples each"
    figures = {"prompt": index, "samples": n, "positions": cfg.positions, "temperature": t, "alpha": cfg.alpha,
               "chi2": round(same.statistic, 4), "dof": same.dof, "p_value": same.p_value,
               "categories": same.categories, "fit_ks": round(fit_spec.ks.statistic, 5),
               "fit_pit_mean": round(fit_spec.ks.mean, 5), "fit_loglik_z": round(fit_spec.score.z, 4),
               "fit_tokens": fit_spec.ks.n, "fit_p_value": fit_spec.p_value,
               "plain_fit_p_value": fit_plain.p_value, "draft_tokens": stats.draft_tokens,
               "accepted_tokens": stats.accepted_tokens, "verified_positions": verified}
    rejected = same.rejects(cfg.alpha) or fit_spec.rejects(cfg.alpha)
    ok = not rejected and not fit_plain.rejects(cfg.alpha) and verified > 0
    summary = (f"{head}: homogeneity chi2 {same.statistic:.1f}, dof {same.dof}, p {same.p_value:.3g}; "
               f"fit to the exact plain probabilities over {fit_spec.ks.n} tokens: KS {fit_spec.ks.statistic:.4f}, "
               f"log-likelihood z {fit_spec.score.z:+.2f}, p {fit_spec.p_value:.3g} (alpha {cfg.alpha:g}); "
               f"{_drafted(stats)}, {verified} tested at the counted positions")
    if rejected:
        summary += "; speculative samples do not follow the plain distribution"
    elif fit_plain.rejects(cfg.alpha):
        summary += (f"; plain's own samples do not fit the computed probabilities (p {fit_plain.p_value:.3g}): "
                    "the reference is wrong, nothing is certified")
    elif verified == 0:
        summary += (f"; no draft was tested at the first {cfg.positions} tokens after any of the {len(prompts)} "
                    "prompts, so speculation was not exercised")
        room = min(spec.max_len - len(p) for p in prompts)
        summary += (f" (a prompt leaves {max(room, 0)} tokens of the {spec.max_len}-token context window: give a "
                    "larger --max-model-len or shorter --prompts)" if room < cfg.positions + 2 else
                    " (give --prompts with text the method drafts from, e.g. text that repeats)")
    result = CheckResult("distribution", ok, summary, figures)
    detected = fit_bias.rejects(cfg.alpha)
    summary = (f"plain at T={t * cfg.bias:g} against the T={t:g} probabilities ({n} samples): KS "
               f"{fit_bias.ks.statistic:.4f}, log-likelihood z {fit_bias.score.z:+.2f}, p {fit_bias.p_value:.3g}; "
               f"homogeneity T={t:g} vs T={t * cfg.bias:g}: p {power.p_value:.3g}; ")
    summary += ("the bias is detected" if detected else
                f"the bias is NOT detected: {n} samples are too few to certify; raise --samples or --positions")
    power_figures = {"samples": n, "temperature": t, "biased_temperature": t * cfg.bias,
                     "fit_ks": round(fit_bias.ks.statistic, 5), "fit_loglik_z": round(fit_bias.score.z, 4),
                     "p_value": fit_bias.p_value, "chi2": round(power.statistic, 4), "dof": power.dof,
                     "homogeneity_p_value": power.p_value, "categories": power.categories}
    acceptance = check_acceptance(plain.model, prompt, trials, cfg)
    return [result, CheckResult("power", detected, summary, power_figures), acceptance]


def check_acceptance(model, prompt: list[int], samples: list[tuple[tuple[int, ...], list[Trial]]],
                     cfg: CertifyConfig) -> CheckResult:
    """The distribution check's speculative samples (their tokens and trials), counted
    (``acceptance``): drafts kept against the number the target's exact probabilities predict."""
    tested, means = trial_means(model, prompt, samples, cfg.temperature)
    passed, summary, figures = acceptance_verdict(acceptance_count(tested, means), cfg.alpha, tested)
    return CheckResult("acceptance", passed, summary, figures)


# -- the one-row-vs-block rule --------------------------------------------------------------
def check_block_rule(engine: Engine, prompts: list[list[int]], continuations: list[list[int]],
                     cfg: CertifyConfig) -> CheckResult:
    """For each prompt, a ``cfg.block``-token verification block (its greedy continuation) against
    the same tokens fed one step at a time: every row's logits must be bitwise equal."""
    model = engine.model
    rows = bad = 0
    worst, first_bad = 0.0, None
    for i, (prompt, cont) in enumerate(zip(prompts, continuations)):
        block = (cont or prompt)[:cfg.block]
        if len(prompt) + len(block) > engine.max_len:
            continue
        cache = KVCache(model.config, 2, len(prompt) + len(block), model.dtype)
        a, b = cache.allocate(), cache.allocate()
        for slot in (a, b):
            model(torch.tensor(prompt), [Segment(slot, 0, len(prompt))], cache, logit_rows=torch.tensor([0]))
        together = model(torch.tensor(block), [Segment(a, len(prompt), len(block))], cache,
                         row_exact=True).logits  # [block, vocab]
        for j, tok in enumerate(block):
            alone = model(torch.tensor([tok]), [Segment(b, len(prompt) + j, 1)], cache,
                          row_exact=True).logits  # [1, vocab]
            rows += 1
            if not torch.equal(alone[0], together[j]):
                bad += 1
                worst = max(worst, float((alone[0].float() - together[j].float()).abs().max()))
                first_bad = first_bad or (i, j)
    figures = {"rows": rows, "differing_rows": bad, "max_abs_diff": worst}
    summary = f"{rows - bad}/{rows} rows bitwise equal over {len(prompts)} prompts (blocks of {cfg.block})"
    if bad:
        summary += f"; first difference: prompt {first_bad[0]} row {first_bad[1]}, max |diff| {worst:.3g}"
    elif rows == 0:
        summary += "; no prompt fits the context window with its block"
    return CheckResult("block-rule", rows > 0 and bad == 0, summary, figures)


def certify(make: EngineFactory, prompts: list[list[int]], cfg: CertifyConfig | None = None,
            progress: Callable[[str], None] | None = None) -> Certificate:
    """Run every check; ``progress(name)`` is called before each (the CLI prints it)."""
    cfg = cfg or CertifyConfig()
    if not prompts or any(not p for p in prompts):
        raise ConfigError("verify needs at least one prompt, and no prompt may be empty")
    say = progress or (lambda _: None)
    say("greedy")
    greedy, continuations = check_greedy(make, prompts, cfg)
    say("seeded")
    seeded = check_seeded(make, prompts, cfg)
    say("distribution")
    distribution, power, acceptance = check_distribution(make, prompts, cfg)
    say("block-rule")
    block = check_block_rule(make(False), prompts, continuations, cfg)
    return Certificate((greedy, seeded, distribution, power, block, acceptance))  # (acceptance last: the
    # first five keep the places they had in --json's list before it)


__all__ = ["DEFAULT_PROMPTS", "CertifyConfig", "CheckResult", "Certificate", "EngineFactory", "certify",
           "check_greedy", "check_seeded", "check_distribution", "check_acceptance", "check_block_rule",
           "chi2_homogeneity",
           "sample_counts", "run_request", "plain_next_figures", "fit_of"]
