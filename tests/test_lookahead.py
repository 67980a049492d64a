"""Lookahead decoding (spec/proposers/lookahead.py) and the engine's auxiliary rows (Draft.aux).

The window's rows follow the paper's mask and their logits are bitwise plain decoding of their own
prefix; they never reach the output or the cache; Jacobi iterations fill the pool with n-grams that
later steps verify; and output is plain decoding's -- greedy and seeded token for token (contiguous
and paged caches, continuous batching), unseeded in distribution (with a negative control)."""
from __future__ import annotations

import pytest
import torch

import tokenleap.spec.tree_verify as tv
from tokenleap.cache.contiguous import KVCache
from tokenleap.cache.paged import PagedKVCache
from tokenleap.config import ConfigError, SamplingParams, SpecConfig
from tokenleap.models.transformer import Segment
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine, _layout
from tokenleap.spec.proposers.base import DraftRequest
from tokenleap.spec.proposers.lookahead import LookaheadProposer

from conftest import ToyTokenizer, tiny_model
from tree_helpers import restart_from_p_ignoring_q

VOCAB = 96
PROMPT = [5, 9, 14, 3, 7, 9, 14, 3, 7, 9, 14, 8, 5, 9, 14, 3]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=3, vocab=VOCAB, hidden=64, intermediate=128, layers=2)


def _request(tokens, k=32, max_nodes=8, max_aux=64):
    # (k longer than any earlier continuation in PROMPT: the lookup cannot fill it, the window is attached)
    return DraftRequest(0, tokens, k, SamplingParams(), None, max_nodes=max_nodes, max_aux=max_aux)


def test_window_rows_follow_the_papers_mask():
    """W = 3, N = 4: level 0 is a chain below the root; column i of level l sees level 0 up to
    column i, then its own column's levels -- at depth i + l + 1."""
    p = LookaheadProposer(window=3, ngram=4, guesses=1)
    p.begin(0, PROMPT)
    state = p._seqs[0]
    state.base, state.levels = len(PROMPT), [[40, 41, 42], [50, 51, 52], [60, 61, 62]]
    draft = p._propose(_request(PROMPT))
    assert p.aux_rows == 9 and draft.aux.tokens == [40, 41, 42, 50, 51, 52, 60, 61, 62]
    layout = _layout(type("S", (), {"tokens": PROMPT})(), draft)
    n = 1 + len(draft.tokens)  # the root and the drafted nodes come first
    assert layout.layout and layout.size == n + 9
    row = {(lv, i): n + 3 * lv + i for lv in range(3) for i in range(3)}
    for (lv, i), r in row.items():
        seen = set(torch.nonzero(layout.visible()[r])[:, 0].tolist())
        want = {0} | {row[0, j] for j in range(i + 1)} | {row[m, i] for m in range(1, lv + 1)}
        assert seen == want, (lv, i)
        assert int(layout.depth[r]) == i + lv + 1
    assert not layout.visible()[n:, 1:n].any()  # the window never sees a guess


def test_jacobi_iteration_shifts_levels_and_fills_the_pool():
    p = LookaheadProposer(window=2, ngram=3, guesses=3)
    p.begin(0, PROMPT)
    state = p._seqs[0]
    state.base, state.levels = len(PROMPT), [[40, 41], [50, 51]]
    draft = p._propose(_request(PROMPT))
    logits = torch.zeros(len(draft.aux.tokens), VOCAB)
    logits[-2, 70], logits[-1, 71] = 1.0, 1.0  # the last level's outputs: 70, 71
    draft.aux.observe(logits)
    p.accept(0, 0)
    assert state.levels == [[50, 51], [70, 71]] and state.base == len(PROMPT) + 1
    assert list(state.pool[40]) == [(50, 70)] and list(state.pool[41]) == [(51, 71)]
    # two tokens decided since (one emitted by this step, one by a step without the window):
    # the first column is dropped, a new one filled from the text
    tokens = PROMPT + [40, 41]
    p._align(state, tokens)
    assert state.base == len(tokens) and [row[0] for row in state.levels] == [51, 71]
    assert all(row[1] in tokens for row in state.levels)
    # a pool n-gram starting with the last token is guessed, after the text's own continuation
    paths, _ = p._guesses(_request(PROMPT + [41]), state)
    assert [51, 71] in paths


def test_window_rows_are_plain_decoding_and_leave_no_trace(model):
    """The aux rows' logits are bitwise those of plain decoding of their prefix; after the step the
    cache holds only the accepted tokens and later steps continue as plain decoding."""
    cache = KVCache(model.config, 2, 64, torch.float32)
    slot = cache.allocate()
    model(torch.tensor(PROMPT), [Segment(slot, 0, len(PROMPT))], cache)
    p = LookaheadProposer(window=3, ngram=3, guesses=2)
    p.begin(0, PROMPT)
    draft = p._propose(_request(PROMPT + [7]))
    layout = _layout(type("S", (), {"tokens": PROMPT + [7]})(), draft)
    logits = model(layout.tokens, [Segment(slot, len(PROMPT), layout.size, tree=layout)], cache,
                   row_exact=True).logits  # [n + aux, vocab]
    ref = KVCache(model.config, 1, 64, torch.float32)
    for node in range(layout.size):
        tail = [int(layout.tokens[c]) for c in [0] + layout.path(node)]
        r = ref.allocate()
        model(torch.tensor(PROMPT), [Segment(r, 0, len(PROMPT))], ref)
        for i, tok in enumerate(tail):
            want = model(torch.tensor([tok]), [Segment(r, len(PROMPT) + i, 1)], ref, row_exact=True).logits[0]
        ref.free(r)
        assert torch.equal(logits[node], want), node


def _engine(model, proposer=None, cache=None, k=4):
    nodes = SpecConfig(method="lookahead", max_num_tokens=k, lookahead_guesses=3).tree_nodes if proposer else 0
    return Engine(model, ToyTokenizer(VOCAB, (2,)), max_len=96, proposer=proposer, cache=cache, tree_nodes=nodes,
                  controller=ControllerConfig(max_k=k, fixed_k=k if proposer else None))


def _generate(eng, prompt, params):
    *_, (seq, _) = eng.generate(prompt, params)
    return seq


class _Recording(LookaheadProposer):
    """Counts the steps whose window ran and the tokens accepted from pool (Jacobi) guesses."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.windows, self.pool_hits, self._last = 0, 0, {}

    def _propose(self, r):
        d = super()._propose(r)
        self.windows += d is not None and d.aux is not None
        lookup = self._lookup.propose(r.seq_id, r.tokens, r.k, r.params, None)
        self._last[r.seq_id] = (d, lookup.tokens if lookup else [])
        return d

    def accept(self, seq_id, num_accepted, path=None):
        d, lookup = self._last.pop(seq_id)
        if d is not None and num_accepted:
            kept = (d.tree.tokens[path].tolist() if d.tree is not None else d.tokens[:num_accepted])
            self.pool_hits += kept[: len(lookup)] != lookup[: len(kept)] or len(kept) > len(lookup)
        super().accept(seq_id, num_accepted, path)


CASES = [
    SamplingParams(max_tokens=48, ignore_eos=True),
    SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.8, seed=4),
    SamplingParams(max_tokens=48, temperature=0.9, top_k=20, seed=9, repetition_penalty=1.3,
                   presence_penalty=0.4, min_tokens=10),
]


@pytest.mark.parametrize("params", CASES, ids=["greedy", "seeded", "seeded-penalties"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_lookahead_equals_plain(model, params, paged):
    prompts = [PROMPT, [11, 12, 11, 13, 11, 12, 11, 14, 11, 12], [30, 31, 32]]
    proposer = _Recording(window=3, ngram=3, guesses=3)
    for prompt in prompts:
        want = _generate(_engine(model), prompt, params).generated
        cache = PagedKVCache(model.config, 40, 96, torch.float32, block_size=4, num_slots=1) if paged else None
        eng = _engine(model, proposer, cache)
        assert _generate(eng, prompt, params).generated == want, prompt
        if paged:
            assert eng.cache.num_used_blocks == 0
    assert proposer.windows > 10  # the window ran beside the guesses
    if params.greedy:
        assert proposer.pool_hits > 0  # Jacobi n-grams were accepted, not only the text's own


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_scheduler_with_lookahead_equals_requests_alone(sampled):
    """Continuous batching, every sequence's guesses and window in one forward on a paged cache:
    outputs equal each request alone, every block given back (the window's included)."""
    from serving_helpers import alone, paged_engine, workload
    from tokenleap.serve.scheduler import Request, Scheduler, SchedulerConfig

    eng = paged_engine(None, blocks=80, k=3)
    eng.proposer = _Recording(window=3, ngram=3, guesses=3)
    eng.tree_nodes = SpecConfig(method="lookahead", max_num_tokens=3).tree_nodes
    eng.controller.cfg = ControllerConfig(max_k=3, fixed_k=3)
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=6, log_interval=0))
    jobs = []
    for i, (prompt, m) in enumerate(workload(8, seed=3)):
        extra = dict(temperature=0.8, seed=70 + i) if sampled else {}
        params = SamplingParams(max_tokens=m, ignore_eos=True, **extra)
        tokens: list[int] = []
        sched.submit([Request(eng.create(prompt, params), lambda o, t=tokens: t.extend(o.token_ids))])
        jobs.append((prompt, params, tokens))
    sched.run_until_idle()
    for prompt, params, tokens in jobs:
        assert tokens == alone(prompt, params).generated, prompt
    assert eng.proposer.windows > 0
    assert eng.cache.num_used_blocks == 0


def test_spec_config_and_cli_flags(capsys):
    spec = SpecConfig(method="lookahead", lookahead_window=2, lookahead_ngram=4, lookahead_guesses=3)
    assert spec.tree_nodes == 8 + 2 * 3  # the longest draft and G - 1 pool n-grams of N - 1 tokens
    for bad in (dict(lookahead_ngram=1), dict(lookahead_window=0), dict(lookahead_guesses=True)):
        with pytest.raises(ConfigError):
            SpecConfig(method="lookahead", **bad)
    from tokenleap.cli.main import main
    for argv in (["--spec", "lookahead", "--lookahead-ngram", "1"], ["--spec", "lookahead", "--draft-model", "x"],
                 ["--spec", "lookahead", "--lookahead-window", "0"]):
        try:
            code = main(["generate", "--model", "/no/such/model.gguf", "--prompt", "x", *argv])
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "error:" in err[0], (argv, err)


def test_bench_lookahead_method_builds_a_lookahead_engine(model):
    from types import SimpleNamespace

    from tokenleap.bench.methods import build_tokenleap, parse_methods

    pool = SimpleNamespace(target=lambda: SimpleNamespace(model=model, tokenizer=ToyTokenizer(VOCAB, (2,))),
                           opts=SimpleNamespace(max_len=64))
    (spec,) = parse_methods("lookahead:window=2,ngram=4,guesses=2", add_plain=False)
    eng = build_tokenleap(spec, pool).engine
    assert isinstance(eng.proposer, LookaheadProposer)
    assert (eng.proposer.window, eng.proposer.ngram, eng.proposer.guesses) == (2, 4, 2)
    assert eng.tree_nodes > 0 and eng.proposer.aux_rows == 6


# -- unseeded sampling is exact ------------------------------------------------------------
V, N_NEW, N_SAMPLES = 3, 4, 1200
SMALL_PROMPT = [0, 1, 2, 1, 0, 1]


@pytest.fixture(scope="module")
def small():
    from conftest import random_weights, tiny_config
    from tokenleap.models.build import build_transformer
    cfg = tiny_config("llama", vocab=V, hidden=32, intermediate=64, heads=2, kv_heads=1)
    return build_transformer(cfg, random_weights(cfg, 11, scale=1.0), torch.float32)


def _exact(target) -> dict[tuple[int, ...], float]:
    import itertools

    from tokenleap.spec.sampling import logits_to_probs
    out = {}
    for cont in itertools.product(range(V), repeat=N_NEW):
        ids = SMALL_PROMPT + list(cont)
        cache = KVCache(target.config, 1, 32, torch.float32)
        logits = target(torch.tensor(ids), [Segment(cache.allocate(), 0, len(ids))], cache).logits
        probs = logits_to_probs(logits[len(SMALL_PROMPT) - 1:-1], 0.9, 0, 1.0)  # [N_NEW, V]
        out[cont] = float(torch.prod(probs[torch.arange(N_NEW), torch.tensor(cont)]))
    return out


class _Seeded(LookaheadProposer):
    """A pool holding every n-gram from the start (a 4-token request is too short for the window
    to fill one), so the guesses branch at every step; the window still runs beside them."""

    def begin(self, seq_id, prompt):
        import itertools
        super().begin(seq_id, prompt)
        for ngram in itertools.product(range(V), repeat=self.ngram):
            self._remember(self._seqs[seq_id], ngram)


def _p_value(target, monkeypatch, seed: int) -> tuple[float, int]:
    """Chi-square p-value of N_SAMPLES unseeded lookahead samples against the exact distribution,
    and how many steps verified a branching trie."""
    import tokenleap.spec.engine as engine_mod
    from scipy.stats import chisquare

    from tokenleap.spec.sampling import make_generator
    gen = torch.Generator().manual_seed(seed)
    monkeypatch.setattr(engine_mod, "request_randomness",
                        lambda _: make_generator(int(torch.randint(0, 2**31, (1,), generator=gen))))
    eng = Engine(target, ToyTokenizer(V, eos=()), max_len=32, proposer=_Seeded(2, 3, 3),
                 controller=ControllerConfig(max_k=3, fixed_k=3),
                 tree_nodes=SpecConfig(method="lookahead", max_num_tokens=3).tree_nodes)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(N_SAMPLES):
        seq = _generate(eng, SMALL_PROMPT, SamplingParams(max_tokens=N_NEW, ignore_eos=True, temperature=0.9))
        counts[tuple(seq.generated)] = counts.get(tuple(seq.generated), 0) + 1
    exact = _exact(target)
    obs, exp, rest = [], [], [0, 0.0]
    for key in sorted(exact, key=exact.get, reverse=True):  # pool the cells with small expectations
        if exact[key] * N_SAMPLES >= 5:
            obs.append(counts.get(key, 0))
            exp.append(exact[key] * N_SAMPLES)
        else:
            rest[0] += counts.get(key, 0)
            rest[1] += exact[key] * N_SAMPLES
    obs.append(rest[0])
    exp.append(rest[1])
    exp = [e * N_SAMPLES / sum(exp) for e in exp]
    return float(chisquare(obs, exp).pvalue), eng.totals.tree_steps


def test_unseeded_lookahead_samples_the_target_distribution(small, monkeypatch):
    p, trees = _p_value(small, monkeypatch, seed=5)
    assert trees > 100  # branching tries were verified, not only chains
    assert p > 1e-3


def test_same_check_rejects_a_biased_tree_verifier(small, monkeypatch):
    """The same test, same seed, detects a verifier that on rejection draws from p itself (not
    from p without the rejected guess)."""
    monkeypatch.setattr(tv, "_try_children", restart_from_p_ignoring_q)
    p, _ = _p_value(small, monkeypatch, seed=5)
    assert p < 1e-4


def test_the_window_is_left_out_where_the_lookup_fills_the_draft():
    """Copied text: the text's own continuation already gives the k tokens asked for, so the step
    carries no Jacobi rows (it costs what a prompt-lookup step costs); asked for more than the
    lookup finds, the window is attached."""
    p = LookaheadProposer(window=3, ngram=3, guesses=2)
    p.begin(0, PROMPT)
    copied = p._propose(_request(PROMPT, k=4))
    assert copied.aux is None and copied.tokens[:4] == PROMPT[4:8]
    longer = p._propose(_request(PROMPT, k=32))
    assert longer.aux is not None and len(longer.aux.tokens) == 3  # a fresh window: one level


def test_the_controller_prices_the_window_rows_drafting_steps_carried(model):
    """The engine tells the controller what each drafting step's window added: on a prompt the
    lookup keeps copying, the priced rows fall from the window's maximum."""
    p = LookaheadProposer(window=3, ngram=3, guesses=2)
    eng = Engine(model, ToyTokenizer(VOCAB, ()), max_len=256, proposer=p, controller=ControllerConfig(max_k=4, fixed_k=2))
    assert eng.controller.aux_rows == 6
    for _ in eng.generate(PROMPT * 4, SamplingParams(max_tokens=40, ignore_eos=True)):
        pass
    assert eng.controller.aux_rows < 6
