"""Layer-skip self-speculation: the target drafts for itself with some layers skipped, in its own
cache. Greedy and seeded output equal plain decoding (contiguous and paged caches, float32 and
int8 weights -- the compiled layer path --, several sequences in one step); skipping nothing
accepts every drafted token; a skipped layer is neither run nor written; the skip-list syntax."""
from __future__ import annotations

import json

import pytest
import torch

from tokenleap.cache.contiguous import KVCache
from tokenleap.cache.paged import PagedKVCache
from tokenleap.config import ConfigError, SamplingParams
from tokenleap.models.quant import quantize_
from tokenleap.models.transformer import Segment
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.layerskip import LayerSkipProposer, format_skip, parse_skip_layers
from tokenleap.spec.proposers.base import Draft
from tokenleap.spec.proposers.ngram import NgramProposer

from conftest import ToyTokenizer, a_model_file, tiny_model

VOCAB = 96
PROMPTS = [[5, 9, 14, 3, 7, 9, 14, 3, 7, 9], list(range(3, 22)), [11, 12, 11, 13]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, top_k=30, seed=5)
SEEDED_PENALTIES = SamplingParams(max_tokens=24, temperature=0.8, seed=9, repetition_penalty=1.2,
                                  presence_penalty=0.3, min_tokens=6)


def _model(weights: str = "fp32"):
    m = tiny_model("qwen2", seed=4, vocab=VOCAB, hidden=64, intermediate=128, layers=4)
    if weights == "int8":
        quantize_(m, "int8")  # every product on tokenleap's kernels: the compiled decoder_layer path
    return m


def _cache(model, paged: bool, slots: int = 3):
    if paged:
        return PagedKVCache(model.config, 64, 64, model.dtype, block_size=4, num_slots=slots)
    return KVCache(model.config, slots, 64, model.dtype)


def _engine(model, skip, paged=False, k: int | None = 3, slots: int = 3, lookup: bool = False):
    ctl = ControllerConfig(max_k=4, fixed_k=k)
    finder = NgramProposer(4, 2) if lookup else None
    proposer = LayerSkipProposer(model, skip, lookup=finder) if skip is not None else None
    return Engine(model, ToyTokenizer(VOCAB, (2,)), max_len=64, proposer=proposer, controller=ctl,
                  cache=_cache(model, paged, slots))


def _generate(eng, prompt, params):
    *_, (seq, _) = eng.generate(prompt, params)
    return seq


@pytest.mark.parametrize("params", [GREEDY, SEEDED, SEEDED_PENALTIES], ids=["greedy", "seeded", "seeded-penalties"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_layerskip_output_equals_plain(params, paged, weights):
    model = _model(weights)
    for prompt in PROMPTS:
        want = _generate(_engine(model, None, paged), prompt, params).generated
        seq = _generate(_engine(model, frozenset({1, 2}), paged), prompt, params)
        assert seq.generated == want, prompt
        assert seq.stats.draft_tokens > 0  # it did speculate


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_layerskip_adaptive_k_equals_plain(paged):
    model = _model("int8")
    for prompt in PROMPTS:
        want = _generate(_engine(model, None, paged), prompt, GREEDY).generated
        assert _generate(_engine(model, frozenset({2}), paged, k=None), prompt, GREEDY).generated == want


@pytest.mark.parametrize("lookup", [False, True], ids=["layers", "layers+lookup"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_layerskip_steps_equal_each_alone(paged, params, lookup):
    """Several sequences drafted in one forward per position and verified in one step (with prompt
    lookup: copying sequences take the lookup's draft, the others the skipped layers', in one step)."""
    model = _model("int8")
    want = [_generate(_engine(model, None, paged), p, params).generated for p in PROMPTS]
    eng = _engine(model, frozenset({0, 3}), paged, lookup=lookup)
    seqs = [eng.add(p, params) for p in PROMPTS]
    while not all(s.finished for s in seqs):
        eng.step(seqs)
    assert [s.generated for s in seqs] == want
    for s in seqs:
        eng.release(s)
    if paged:
        assert eng.cache.num_free_blocks == eng.cache.num_blocks  # every block given back


def test_copied_text_drafts_by_prompt_lookup_and_output_equals_plain():
    """With a lookup, a sequence whose text repeats takes the lookup's continuation (no skipped-layer
    forward for it), the others draft with the layers; output is plain decoding's. (Greedy: this toy
    model's greedy text falls into a loop the lookup copies; seeded and sampled runs of both kinds of
    draft: test_batched_layerskip_steps_equal_each_alone, test_layerskip_sampling.py.)"""
    model, params = _model("int8"), GREEDY
    prompt = [5, 9, 14, 3, 7, 8, 6] * 3
    want = _generate(_engine(model, None), prompt, params).generated
    eng = _engine(model, frozenset({1, 2}), lookup=True)
    found, forwards = [], []
    copied, draft_position = eng.proposer._copied, eng.proposer._draft_position
    eng.proposer._copied = lambda r: found.append((r.k, copied(r))) or found[-1][1]
    eng.proposer._draft_position = lambda lanes: forwards.append(len(lanes)) or draft_position(lanes)
    seq = _generate(eng, prompt, params)
    assert seq.generated == want
    copies = [(k, d) for k, d in found if d is not None]
    assert copies and len(copies) < len(found)  # both kinds of draft
    assert all(d.probs is None and len(d.tokens) == k for k, d in copies)  # point masses, the k asked for
    assert len(forwards) == sum(k for k, d in found if d is None)  # one layer forward a token not copied


class _EveryOtherStep(NgramProposer):
    """A lookup that finds a continuation (fixed tokens) on every other call: mixes both kinds of draft."""

    calls = 0

    def propose(self, seq_id, tokens, k, params, generator):
        self.calls += 1
        return Draft(tokens=[0, 87, 0, 87][:k], probs=None) if self.calls % 2 else None


@pytest.mark.parametrize("params", [SEEDED, SEEDED_PENALTIES], ids=["seeded", "seeded-penalties"])
def test_seeded_output_with_copied_and_layer_drafts_mixed_equals_plain(params):
    model = _model("int8")
    for prompt in PROMPTS:
        want = _generate(_engine(model, None), prompt, params).generated
        eng = _engine(model, frozenset({1, 2}))
        eng.proposer.lookup = _EveryOtherStep()
        seq = _generate(eng, prompt, params)
        assert seq.generated == want, prompt
        assert eng.proposer.lookup.calls >= 4


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_skipping_nothing_accepts_every_draft(weights):
    """The draft is then the target itself, row for row: every step accepts all k drafts (tau = k + 1)."""
    model = _model(weights)
    k = 3
    seq = _generate(_engine(model, frozenset(), k=k), PROMPTS[1], SamplingParams(max_tokens=1 + 4 * (k + 1),
                                                                                ignore_eos=True))
    st = seq.stats
    assert st.draft_steps == 4 and st.draft_tokens == 4 * k
    assert st.accepted_tokens == st.draft_tokens
    assert seq.generated == _generate(_engine(model, None), PROMPTS[1], seq.params).generated


def test_skipped_layers_are_not_written_and_rows_match_the_python_path():
    model = _model("int8")
    skip = frozenset({1, 3})
    out = {}
    for fused in (True, False):
        model.use_fused_layers = fused
        cache = KVCache(model.config, 1, 64, model.dtype)
        slot = cache.allocate()
        model(torch.tensor(PROMPTS[1]), [Segment(slot, 0, len(PROMPTS[1]))], cache)
        before = [t.clone() for t in cache.k]
        n = len(PROMPTS[1])
        out[fused] = model(torch.tensor([40]), [Segment(slot, n, 1)], cache, row_exact=True, skip=skip).logits
        for layer in range(4):
            changed = not torch.equal(cache.k[layer][slot, :, n], before[layer][slot, :, n])
            assert changed == (layer not in skip), layer
    model.use_fused_layers = True
    assert torch.equal(out[True], out[False])
    full = model(torch.tensor([40]), [Segment(slot, n, 1)], cache, row_exact=True).logits
    assert not torch.equal(full, out[True])  # skipping changes the row


def test_skip_list_syntax():
    assert parse_skip_layers("4,5,6,10-14") == frozenset({4, 5, 6, 10, 11, 12, 13, 14})
    assert parse_skip_layers("auto") == "auto"
    assert parse_skip_layers("3+7-8") == frozenset({3, 7, 8})
    assert parse_skip_layers(format_skip(frozenset({0, 1, 2, 5, 9, 10}))) == frozenset({0, 1, 2, 5, 9, 10})
    assert format_skip(frozenset()) == "none"
    for bad in ("x", "5-3", "-1", "4,,5"):
        with pytest.raises(ConfigError):
            parse_skip_layers(bad)
    with pytest.raises(ConfigError, match="do not exist"):
        parse_skip_layers("2,30", num_layers=28)
    with pytest.raises(ConfigError, match="no draft"):
        LayerSkipProposer(_model(), frozenset(range(4)))


@pytest.mark.parametrize("weights", ["fp32", "int8", "int4", "bf16"])
def test_prefix_head_scores_its_ids_as_the_full_head(weights):
    """The drafts' reduced head (views of the target's head weights): ids below n and the kept ids
    get the full head's logits, every other id -inf."""
    from tokenleap.spec.proposers.layerskip_head import prefix_head
    m = tiny_model("qwen2", seed=4, vocab=256, hidden=64, intermediate=128, layers=2,
                   dtype=torch.bfloat16 if weights == "bf16" else torch.float32)
    if weights in ("int8", "int4"):
        quantize_(m, weights)
    head = prefix_head(m, 64, keep_ids=(200, 2))
    assert head is not None
    x = torch.randn(3, 64)
    full = m.lm_head(x, True).float()  # [3, 256]
    got = head(x, True)
    ids = list(range(64)) + [200]
    torch.testing.assert_close(got[:, ids], full[:, ids], rtol=1e-5, atol=1e-5)
    rest = torch.ones(256, dtype=torch.bool)
    rest[ids] = False
    assert torch.isinf(got[:, rest]).all()
    assert prefix_head(m, 129) is None  # a vocabulary under twice n: nothing to save


def _texts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (40,), generator=gen).tolist() for _ in range(2)]


def test_search_chooses_a_strict_subset_and_the_store_round_trips(tmp_path):
    from tokenleap.models.checkpoint import model_key
    from tokenleap.spec.proposers import layerskip_search as ls
    model = _model("int8")
    cfg = ls.SearchConfig(window=16, context=32, max_k=3, timing_repeats=1, min_agreement=0.0, patience=10)
    lines = []
    cal = ls.search(model, _texts(), cfg, log=lines.append)
    assert 1 <= len(cal.skip) <= 3 and set(cal.skip) <= set(range(4))
    assert 0.0 <= cal.agreement <= 1.0 and cal.positions == 32 and 0 <= cal.k <= 3
    assert len(lines) == 3  # grown to every size below all four layers (no early stop asked)
    path = ls.store_path(tmp_path, model_key(str(tmp_path / "m"), None, torch.float32, "int8"))
    ls.save_calibration(path, cal)
    assert ls.load_calibration(path, 4) == cal
    assert ls.load_calibration(path, 5) is None  # another layer count: not this model
    path.write_text("{not json")
    assert ls.load_calibration(path, 4) is None


def test_skip_auto_calibrates_on_the_first_request_then_reuses_the_stored_choice(tmp_path):
    from types import SimpleNamespace

    from tokenleap.spec.proposers.layerskip import layerskip_proposer
    model = _model("int8")
    loaded = SimpleNamespace(model=model, tokenizer=ToyTokenizer(VOCAB, (2,)), source=str(tmp_path / "tiny"),
                             gguf_path=None, dtype=torch.float32, quant="int8")
    want = _generate(_engine(model, None), PROMPTS[1], GREEDY).generated
    logs = []
    first = layerskip_proposer(loaded, "auto", tmp_path, log=logs.append)
    assert first.skip is None  # chosen at the first proposal
    eng = Engine(model, ToyTokenizer(VOCAB, (2,)), max_len=64, proposer=first,
                 controller=ControllerConfig(max_k=4, fixed_k=3))
    assert _generate(eng, PROMPTS[1], GREEDY).generated == want
    assert first.skip is not None and len(first.skip) < 4
    assert len(logs) == 1 and "calibrated" in logs[0] and list((tmp_path / "layerskip").glob("*.json"))
    second = layerskip_proposer(loaded, "auto", tmp_path, log=logs.append)
    assert second.skip == first.skip and "calibrated," in logs[1]  # read back, no new search
    stored = json.loads(next((tmp_path / "layerskip").glob("*.json")).read_text())
    assert second.predicted_speedup == stored["predicted_speedup"]  # what --spec auto weighs it by
    # a set predicted slower than plain decoding says what that means, rather than only naming it
    assert all(("below plain decoding" in line) == (stored["predicted_speedup"] < 1) for line in logs)
    given = layerskip_proposer(loaded, "1,2", tmp_path)
    assert given.skip == frozenset({1, 2}) and given.predicted_speedup is None


def test_a_stored_calibration_is_named_on_stderr_once_a_process(tmp_path, capsys):
    """(An LLM builds a proposer for each engine it makes; a caller's own log hears every one.)"""
    from types import SimpleNamespace

    from tokenleap.spec.proposers.layerskip import layerskip_proposer
    model = _model("int8")
    loaded = SimpleNamespace(model=model, tokenizer=ToyTokenizer(VOCAB, (2,)), source=str(tmp_path / "t2"),
                             gguf_path=None, dtype=torch.float32, quant="int8")
    first = layerskip_proposer(loaded, "auto", tmp_path, log=lambda _: None)
    _generate(Engine(model, ToyTokenizer(VOCAB, (2,)), max_len=64, proposer=first,
                     controller=ControllerConfig(max_k=4, fixed_k=3)), PROMPTS[1], GREEDY)  # calibrates, stores
    assert list((tmp_path / "layerskip").glob("*.json")) and capsys.readouterr().err == ""
    for _ in range(3):
        assert layerskip_proposer(loaded, "auto", tmp_path).skip == first.skip
    assert capsys.readouterr().err.count("layer skip: skipping layers") == 1
    heard = []
    layerskip_proposer(loaded, "auto", tmp_path, log=heard.append)
    assert len(heard) == 1


# (command line, the error it must give). "MODEL" stands for an existing file: these commands are
# refused before a model is read, so no model needs to be installed (and an error about a missing
# model cannot stand in for the one each line is about).
LAYERSKIP_BAD_FLAGS = [
    (["generate", "--model", "MODEL", "--prompt", "x", "--spec", "ngram", "--skip-layers", "3"],
     "--skip-layers goes with --spec layerskip"),
    (["generate", "--model", "MODEL", "--prompt", "x", "--spec", "layerskip", "--skip-layers", "3x"],
     "'3x' is not a layer index"),
    (["generate", "--model", "MODEL", "--prompt", "x", "--spec", "layerskip", "--draft-model", "MODEL"],
     "not a draft model"),
    (["calibrate", "--model", "no-such-model"], "'no-such-model' is neither a catalog model"),
    (["calibrate", "--model", "MODEL", "--quant", "int3"], "'int3' is not a quantization"),
    (["calibrate", "--model", "MODEL", "--prompts", "/no/such/prompts.jsonl"], "does not exist"),
    (["bench", "--target", "MODEL", "--methods", "layerskip:skip=x"], "option skip must be"),
    (["bench", "--target", "MODEL", "--methods", "layerskip:lookup=maybe"], "option lookup must be on or off"),
    (["generate", "--model", "MODEL", "--prompt", "x", "--spec", "ngram", "--skip-lookup", "off"],
     "--skip-lookup goes with --spec layerskip"),
]


def test_skip_lookup_flag_reaches_the_spec_config(tmp_path):
    from tokenleap.cli.main import build_parser, spec_config

    base = ["generate", "--model", a_model_file(tmp_path), "--prompt", "x", "--spec", "layerskip"]
    assert spec_config(build_parser().parse_args(base)).layerskip_lookup is True
    assert spec_config(build_parser().parse_args(base + ["--skip-lookup", "off"])).layerskip_lookup is False


@pytest.mark.parametrize("argv,message", LAYERSKIP_BAD_FLAGS, ids=[" ".join(a[2:]) for a, _ in LAYERSKIP_BAD_FLAGS])
def test_bad_layerskip_flags_give_one_line_and_exit_2(capsys, tmp_path, monkeypatch, argv, message):
    import tokenleap.api
    import tokenleap.bench.methods
    import tokenleap.models.pretrained
    import tokenleap.spec.proposers.factory
    from tokenleap.cli.main import main

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded for a command line that should have been refused")
    # every module that binds load_model by name, imported before the patch so none keeps ``refuse``
    for module in (tokenleap.models.pretrained, tokenleap.api, tokenleap.spec.proposers.factory,
                   tokenleap.bench.methods):
        monkeypatch.setattr(module, "load_model", refuse)
    model = a_model_file(tmp_path)
    argv = [model if a == "MODEL" else a for a in argv]
    if argv[0] == "bench":
        argv = argv + ["--out", str(tmp_path / "out")]
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "error:" in err and message in err, err


def test_prefix_head_of_an_int6_head():
    """An int4 target's head is the GGUF's Q6_K tensor kept exactly (Int6Linear): its rows are sliced too."""
    from test_int6 import random_q6k
    from tokenleap.models.int6 import Int6Linear, int6_from_gguf_q6k
    from tokenleap.spec.proposers.layerskip_head import prefix_head
    m = tiny_model("qwen2", seed=4, vocab=256, hidden=256, intermediate=128, layers=1, heads=4)
    m.lm_head = Int6Linear(*int6_from_gguf_q6k(random_q6k(256, 256, seed=3), (256, 256)))
    head = prefix_head(m, 64, keep_ids=(200,))
    x = torch.randn(2, 256)
    ids = list(range(64)) + [200]
    assert torch.equal(head(x, True)[:, ids], m.lm_head(x, True)[:, ids])


def test_calibrate_on_the_real_model_and_its_exit_status(smollm2_gguf, tmp_path, capsys, monkeypatch):
    """`tokenleap calibrate`: stores a skipped set and measures it (outputs equal: exit 0); were layer
    skip's greedy output to differ from plain decoding's, the command says it is a defect and exits 1."""
    from pathlib import Path

    import tokenleap.cli.calibrate as calibrate_cli
    from tokenleap.cli.main import main
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Count from one to ten."}\n')
    argv = ["calibrate", "--model", str(smollm2_gguf), "--prompts", str(prompts), "--max-tokens", "8",
            "--candidates", "1", "--cache-dir", str(tmp_path / "cache"), "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["measured"]["outputs_equal"] is True and Path(result["stored"]).exists()
    real = calibrate_cli._measure
    monkeypatch.setattr(calibrate_cli, "_measure", lambda *a: {**real(*a), "outputs_equal": False})
    assert main(argv) == 1
    assert "differed from plain decoding" in capsys.readouterr().err
    # a cache the calibration cannot be stored in: said before the search (which ran whole, then failed)
    from tokenleap.spec.proposers import layerskip_search
    monkeypatch.setattr(layerskip_search, "search", lambda *a, **k: pytest.fail("searched"))
    monkeypatch.setattr(calibrate_cli, "unwritable_place", lambda path: path.parent)  # (root writes through chmod)
    assert main(argv) == 2
    assert "cannot store the calibration under" in capsys.readouterr().err
