"""``--spec auto`` beyond one request: continuous batching (each sequence its own arm, the draft's
cache paged), /metrics by proposer, a lookahead arm, the CLI flags and the draft auto picks."""
from __future__ import annotations

import argparse

import pytest
import torch
from prometheus_client import generate_latest

from tokenleap.cache.paged import PagedKVCache
from tokenleap.config import SamplingParams
from tokenleap.serve.metrics import make_registry
from tokenleap.serve.scheduler import Scheduler, SchedulerConfig
from tokenleap.spec.bandit import BanditConfig
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.auto import AutoProposer
from tokenleap.spec.proposers.ngram import NgramProposer

from serving_helpers import CHUNK, MAX_LEN, VOCAB, ChatToyTokenizer, alone, model, proposer, workload
from test_scheduler import submit


def auto_engine(blocks: int = 128, slots: int = 16) -> Engine:
    cache = PagedKVCache(model().config, blocks, MAX_LEN, torch.float32, block_size=16, num_slots=slots)
    arms = {"draft": proposer("draft", blocks, slots), "ngram": NgramProposer(3, 1)}
    return Engine(model(), ChatToyTokenizer(VOCAB), max_len=MAX_LEN, prefill_chunk=CHUNK, cache=cache,
                  proposer=AutoProposer(arms, BanditConfig(max_k=4)), controller=ControllerConfig(max_k=4))


@pytest.mark.parametrize("sampled", [False, True])
def test_continuous_batching_with_auto_equals_each_alone(sampled):
    eng = auto_engine()
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=16, log_interval=0))
    sampling = lambda i: dict(temperature=0.8, top_p=0.95, seed=1000 + i) if sampled else {}  # noqa: E731
    jobs = [(p, SamplingParams(max_tokens=m, ignore_eos=True, **sampling(i)))
            for i, (p, m) in enumerate(workload(12, seed=3))]
    sinks = [submit(sched, p, params) for p, params in jobs]
    sched.run_until_idle()
    for (prompt, params), sink in zip(jobs, sinks):
        assert sink.tokens == alone(prompt, params).generated, prompt
    assert eng.cache.num_used_blocks == 0 and eng.proposer.arms["draft"].cache.num_used_blocks == 0
    snap = sched.snapshot()
    by = dict(snap.accepted_by_proposer)
    assert sum(by.values()) == snap.num_accepted_tokens and "none" not in by
    text = generate_latest(make_registry(sched.snapshot, "tiny")).decode()
    for name, n in by.items():
        assert f'tokenleap:spec_decode_num_accepted_tokens_by_proposer_total{{model_name="tiny",proposer="{name}"}} {float(n)}' in text


def test_auto_with_a_lookahead_arm_equals_plain():
    """An arm with auxiliary rows (lookahead's Jacobi window) inside auto: the rows are reserved and
    dropped whichever arm drafts, and the output is plain decoding's."""
    from conftest import ToyTokenizer, tiny_model
    from tokenleap.spec.proposers.draft_model import DraftModelProposer
    from tokenleap.spec.proposers.lookahead import LookaheadProposer
    target, draft = tiny_model(seed=0), tiny_model(seed=3)
    for params in (SamplingParams(max_tokens=48, ignore_eos=True),
                   SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.8, seed=4)):
        for prompt in ([5, 6, 7, 8, 9, 10, 11, 5, 6, 7], list(range(20, 45))):
            plain = Engine(target, ToyTokenizer(96), max_len=256)
            *_, (ref, _) = plain.generate(prompt, params)
            # lookahead listed first: the first step, before any cost is measured, tries the arms in this
            # order, so the window is exercised whatever the timings make the bandit choose later
            arms = {"lookahead": LookaheadProposer(), "draft": DraftModelProposer(draft, 96, 256), "ngram": NgramProposer(4, 1)}
            eng = Engine(target, ToyTokenizer(96), max_len=256, proposer=AutoProposer(arms, BanditConfig(max_k=4)),
                         tree_nodes=12)
            *_, (seq, _) = eng.generate(prompt, params)
            assert seq.generated == ref.generated
            assert seq.stats.proposer_steps.get("lookahead", 0) > 0


# -- the draft --spec auto picks ------------------------------------------------------------------
def test_pick_draft_same_tokenizer_installed_and_in_memory(monkeypatch):
    from tokenleap.models import pairing
    monkeypatch.setattr(pairing, "_installed", lambda name, cache_dir: name == "qwen2.5-coder-0.5b-instruct")
    pick = pairing.pick_draft("qwen2.5-coder-1.5b-instruct", available=8 << 30)
    assert pick.name == "qwen2.5-coder-0.5b-instruct" and pick.quant == "int4" and "tokenizer" in pick.reason
    assert pairing.pick_draft("qwen2.5-coder-1.5b-instruct", quant="int8", available=8 << 30).quant == "int8"
    tight = pairing.pick_draft("qwen2.5-coder-1.5b-instruct", available=1 << 30)
    assert tight.name is None and "available" in tight.reason
    assert pairing.pick_draft("qwen2.5-coder-0.5b-instruct", available=8 << 30).name is None  # nothing smaller
    assert pairing.pick_draft("/some/model.gguf", available=8 << 30).name is None


def test_pick_draft_on_a_fresh_machine_names_the_install(monkeypatch):
    from tokenleap.models import pairing
    monkeypatch.setattr(pairing, "_installed", lambda name, cache_dir: False)
    pick = pairing.pick_draft("qwen2.5-coder-1.5b-instruct", available=8 << 30)
    assert pick.name is None and "tokenleap models install qwen2.5-coder-0.5b-instruct" in pick.reason


def test_resolve_auto_draft(monkeypatch):
    from tokenleap.spec.proposers.factory import resolve_auto_draft
    from tokenleap.config import SpecConfig
    from tokenleap.models import pairing
    monkeypatch.setattr(pairing, "_installed", lambda name, cache_dir: True)
    monkeypatch.setattr(pairing, "available_memory", lambda: 8 << 30)
    spec, note = resolve_auto_draft(SpecConfig(method="auto", draft_model="auto"), "catalog:qwen2.5-coder-1.5b-instruct", None)
    assert spec.draft_model == "qwen2.5-coder-0.5b-instruct" and spec.draft_quant == "int4" and note
    same, none = resolve_auto_draft(SpecConfig(method="auto", draft_model="m.gguf"), "x", None)
    assert same.draft_model == "m.gguf" and none is None
    # a draft named for auto drafts at auto's precision unless one is given; "none" asks for unquantized,
    # for a picked draft too
    assert same.draft_quant == "int4"
    for quant in ("none", "int8"):
        named, _ = resolve_auto_draft(SpecConfig(method="auto", draft_model="m.gguf", draft_quant=quant), "x", None)
        picked, _ = resolve_auto_draft(SpecConfig(method="auto", draft_model="auto", draft_quant=quant),
                                       "catalog:qwen2.5-coder-1.5b-instruct", None)
        assert named.draft_quant == picked.draft_quant == quant
    # method draft: unset is unquantized, as before; "none" (the old default) still goes with any method
    assert SpecConfig(method="draft", draft_model="m.gguf").draft_quant is None
    assert SpecConfig(method="ngram", draft_quant="none").method == "ngram"


def test_a_target_given_as_a_catalog_models_file_gets_its_draft(monkeypatch, tmp_path):
    """A target named by the path of a catalog model's GGUF (the installed file, or a copy of it
    elsewhere: its size and SHA-256) is that catalog model, and auto picks its draft."""
    from dataclasses import replace
    from tokenleap.config import SpecConfig
    from tokenleap.models import catalog, pairing
    from tokenleap.spec.proposers.factory import resolve_auto_draft
    monkeypatch.setattr(pairing, "_installed", lambda name, cache_dir: True)
    monkeypatch.setattr(pairing, "available_memory", lambda: 8 << 30)
    name = "qwen2.5-coder-1.5b-instruct"
    installed, copy, other = tmp_path / "installed.gguf", tmp_path / "copy.gguf", tmp_path / "other.gguf"
    installed.write_bytes(b"GGUF" + b"x" * 60)
    copy.write_bytes(installed.read_bytes())
    other.write_bytes(b"GGUF" + b"y" * 60)
    monkeypatch.setitem(catalog.CATALOG, name, replace(catalog.CATALOG[name], size=64,
                                                        sha256=catalog.sha256_file(installed)))
    draft = "qwen2.5-coder-0.5b-instruct"  # (still the smaller one)
    monkeypatch.setitem(catalog.CATALOG, draft, replace(catalog.CATALOG[draft], size=32))
    monkeypatch.setattr(catalog, "joined_path", lambda n, cache_dir=None: installed if n == name else None)
    auto = SpecConfig(method="auto", draft_model="auto")
    for model in (f"gguf:{installed}", str(copy)):
        spec, note = resolve_auto_draft(auto, model, tmp_path)
        assert spec.draft_model == "qwen2.5-coder-0.5b-instruct" and "installed" in note, model
    spec, note = resolve_auto_draft(auto, f"gguf:{other}", tmp_path)
    assert spec.draft_model is None and "not a catalog model" in note
    monkeypatch.setattr(catalog, "sha256_file", lambda *a: pytest.fail("a known copy was hashed again"))
    assert catalog.catalog_name_of(str(copy), tmp_path) == name  # (its marker from the first look)
    monkeypatch.undo()  # a cache that cannot be written (read-only): the copy is still known, only hashed again
    monkeypatch.setitem(catalog.CATALOG, name, replace(catalog.CATALOG[name], size=64,
                                                        sha256=catalog.sha256_file(installed)))

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(catalog.Path, "write_text", read_only)
    monkeypatch.setattr(catalog.Path, "mkdir", read_only)
    assert catalog.catalog_name_of(str(copy), tmp_path / "elsewhere") == name


# -- the command line -----------------------------------------------------------------------------
def parse(argv: list[str]) -> argparse.Namespace:
    from tokenleap.cli.main import build_parser
    return build_parser().parse_args(argv)


def test_cli_spec_auto_picks_a_draft_unless_one_is_named(tmp_path):
    from tokenleap.cli.main import spec_config
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    spec = spec_config(parse(["generate", "--model", str(gguf), "--spec", "auto", "--prompt", "x"]))
    assert spec.method == "auto" and spec.draft_model == "auto"
    spec = spec_config(parse(["generate", "--model", str(gguf), "--spec", "auto", "--draft-model", str(gguf),
                              "--prompt", "x"]))
    assert spec.draft_model == str(gguf) and spec.draft_quant is None  # (auto's precision: resolve_auto_draft)
    spec = spec_config(parse(["generate", "--model", str(gguf), "--spec", "auto", "--draft-quant", "none",
                              "--prompt", "x"]))
    assert spec.draft_quant == "none"  # asked for: an unquantized draft


def test_cli_draft_model_alone_implies_draft_and_spec_none_refuses_one(tmp_path, capsys):
    from tokenleap.cli.main import main, spec_config
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert spec_config(parse(["generate", "--model", str(gguf), "--prompt", "x"])).method is None
    assert spec_config(parse(["generate", "--model", str(gguf), "--spec", "none", "--prompt", "x"])).method is None
    spec = spec_config(parse(["generate", "--model", str(gguf), "--draft-model", str(gguf), "--prompt", "x"]))
    assert spec.method == "draft" and spec.draft_model == str(gguf)
    assert main(["generate", "--model", str(gguf), "--spec", "none", "--draft-model", str(gguf), "--prompt", "x"]) == 2
    assert "--spec none decodes plainly" in capsys.readouterr().err


def test_cli_draft_model_auto_needs_spec_auto(tmp_path, capsys):
    from tokenleap.cli.main import main
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert main(["generate", "--model", str(gguf), "--spec", "draft", "--draft-model", "auto", "--prompt", "x"]) == 2
    assert "--draft-model auto" in capsys.readouterr().err


def test_serve_defaults_to_auto_marked_as_the_default(tmp_path):
    from tokenleap.cli.serve import serve_spec_config
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    spec = serve_spec_config(parse(["serve", "--model", str(gguf)]))
    assert spec.method == "auto" and spec.extra.get("serve_default")
    explicit = serve_spec_config(parse(["serve", "--model", str(gguf), "--spec", "ngram"]))
    assert explicit.method == "ngram" and not explicit.extra.get("serve_default")


def test_stats_line_names_the_proposers():
    from tokenleap.cli.output import stats_line
    from tokenleap.spec.stats import SpecStats
    st = SpecStats()
    for name, acc, kept in (("none", 0, 1), ("ngram", 3, 4), ("draft", 1, 2), ("ngram", 2, 3)):
        st.record_step(0 if name == "none" else 4, acc, kept)
        st.record_proposer(name, acc, kept)
    shares = st.to_dict()["proposers"]
    assert shares["ngram"] == {"steps": 2, "accepted_tokens": 5, "tokens": 7, "share": 0.7}
    assert "tokens by proposer: ngram 70%, draft 20%, none 10%" in stats_line(st.to_dict())
    one = SpecStats()  # one proposer drafted (auto picked it every step): the line still names it
    one.record_step(4, 3, 4)
    one.record_proposer("draft", 3, 4)
    assert stats_line(one.to_dict()).endswith(", tokens by proposer: draft 100%")
    assert "by proposer" not in stats_line(SpecStats().to_dict())  # plain decoding


def test_auto_arms_by_name_and_an_uncalibrated_layer_skip_left_out(monkeypatch):
    """Other methods join auto by name when proposer_for builds them; layer skip only with its skipped
    set known (a calibration stored or --skip-layers), so no search runs inside a user's request."""
    import tokenleap.spec.proposers.factory as factory
    from tokenleap.config import ConfigError, SpecConfig

    class Arm:
        def __init__(self, name, skip, predicted_speedup=None):
            self.name, self.skip, self.predicted_speedup = name, skip, predicted_speedup

    calibrated = {"value": None, "speedup": None}

    def build(spec, *a, **k):
        if spec.method == "layerskip":
            return Arm("layerskip", calibrated["value"], calibrated["speedup"])
        if spec.method in ("lookahead", "ngram"):
            return Arm(spec.method, None)
        raise ConfigError("unknown")

    monkeypatch.setattr(factory, "proposer_for", build)
    assert list(factory.auto_proposer(SpecConfig(method="auto"), None, None, 64, 1, None).arms) == ["lookahead", "ngram"]
    calibrated["value"] = frozenset({3})
    assert list(factory.auto_proposer(SpecConfig(method="auto"), None, None, 64, 1, None).arms) == \
        ["layerskip", "lookahead", "ngram"]
    # a calibration that predicted no gain on this machine keeps it out; one that did, or a skipped
    # set given without a prediction (--skip-layers), lets it in
    for speedup, joins in ((0.0, False), (0.999, False), (factory.LAYERSKIP_MIN_SPEEDUP, True), (1.4, True), (None, True)):
        calibrated["speedup"] = speedup
        arms = list(factory.auto_proposer(SpecConfig(method="auto"), None, None, 64, 1, None).arms)
        assert arms == (["layerskip"] if joins else []) + ["lookahead", "ngram"], speedup


class FakeArm:
    """An arm as auto_proposer reads it: no layer-skip calibration, no output pool."""
    skip, predicted_speedup, output_pool = None, None, None


class FakeTarget:
    """What auto_proposer reads of a loaded target."""
    class model:
        class config:
            vocab_size = 64
    tokenizer = None


def fake_builder(*methods: str):
    """A ``proposer_for`` that builds a FakeArm for ``methods`` and refuses the others."""
    def build(spec, *a, **k):
        from tokenleap.config import ConfigError
        if spec.method in methods:
            return FakeArm()
        raise ConfigError("unknown")
    return build


def test_lookahead_joins_auto_only_without_a_draft_model(monkeypatch):
    """Beside a draft model, auto's arms are the draft (a cascade), n-gram lookup and a layer skip that
    pays; lookahead joins only where no draft model is loaded."""
    import tokenleap.spec.proposers.factory as factory
    from tokenleap.config import SpecConfig
    Target = FakeTarget

    fed = []
    monkeypatch.setattr(factory, "proposer_for", fake_builder("lookahead", "ngram"))
    # (draft_proposer's arguments after the draft: vocabulary, max_len, slots, draft vocab, cache, draft_spec, ...)
    monkeypatch.setattr(factory, "draft_proposer", lambda draft, *a, **k: fed.append((draft, a[5])) or FakeArm())
    assert factory.lookahead_joins_auto(False) and not factory.lookahead_joins_auto(True)
    assert list(factory.auto_proposer(SpecConfig(method="auto"), Target, None, 64, 1, None).arms) == ["lookahead", "ngram"]
    draft = object()
    assert list(factory.auto_proposer(SpecConfig(method="auto"), Target, draft, 64, 1, None).arms) == ["draft", "ngram"]
    assert fed == [(draft, "ngram")]  # the draft arm drafts as a cascade


def test_auto_shares_one_output_pool_between_its_ngram_arm_and_the_cascade(monkeypatch, tmp_path):
    """--ngram-pool: the n-gram arm and the draft's cascade look up the same earlier outputs."""
    import tokenleap.spec.proposers.factory as factory
    from tokenleap.cli.main import spec_config
    from tokenleap.config import SpecConfig
    from tokenleap.spec.proposers.output_pool import OutputPool
    Target = FakeTarget

    fed = []
    monkeypatch.setattr(factory, "proposer_for", fake_builder("ngram"))
    monkeypatch.setattr(factory, "draft_proposer", lambda draft, *a, **k: fed.append(a[-1]) or FakeArm())
    arms = factory.auto_proposer(SpecConfig(method="auto", ngram_pool=1000), Target, object(), 64, 1, None).arms
    assert isinstance(fed[0], OutputPool) and arms["ngram"].output_pool is fed[0] and fed[0].max_tokens == 1000
    arms = factory.auto_proposer(SpecConfig(method="auto", ngram_pool=0), Target, object(), 64, 1, None).arms
    assert fed[1] is None and arms["ngram"].output_pool is None  # 0: off
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    argv = ["generate", "--model", str(gguf), "--spec", "ngram", "--prompt", "x"]
    assert spec_config(parse(argv + ["--ngram-pool", "4096"])).ngram_pool == 4096
    assert spec_config(parse(argv)).ngram_pool == SpecConfig.ngram_pool
