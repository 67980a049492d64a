"""The trained draft head (``--spec eagle``): the drafting runtime computes what the training forward
does, the head's cache holds exactly the target's features paired with the next tokens, greedy and
seeded output equal plain decoding (one sequence and several in a step, contiguous and paged caches,
a prefix the target never computed), training raises the head's agreement with the target, and a
head file is checked when loaded."""
from __future__ import annotations

import pytest
import torch

from tokenleap.cache.paged import PagedKVCache
from tokenleap.cache.contiguous import KVCache
from tokenleap.config import ConfigError, SamplingParams
from tokenleap.heads.eagle import EagleConfig, EagleHead
from tokenleap.heads.features import collect_features
from tokenleap.heads.train import TrainConfig, held_out_agreement, subset_ids, train_head
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.draft_head import float_rows
from tokenleap.spec.proposers.eagle import EagleProposer

from conftest import ToyTokenizer, tiny_model

VOCAB = 96
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.8, top_k=40, seed=3)
PROMPTS = [[5, 9, 14, 3, 7, 9, 14, 3, 7, 9], list(range(3, 22)), [11, 12, 11, 13]]


def _model():
    return tiny_model("qwen2", seed=4, vocab=VOCAB, hidden=64, intermediate=128, layers=4)


def _texts(model, n: int, seed: int) -> list[list[int]]:
    """Prompts of random tokens, each followed by the model's greedy continuation."""
    plain, gen, out = Engine(model, ToyTokenizer(VOCAB, (2,)), max_len=128), torch.Generator().manual_seed(seed), []
    for _ in range(n):
        prompt = torch.randint(3, VOCAB, (8,), generator=gen).tolist()
        *_, (seq, _) = plain.generate(prompt, SamplingParams(max_tokens=48, ignore_eos=True))
        out.append(seq.tokens)
    return out


@pytest.fixture(scope="module")
def trained():
    model = _model()
    cfg = EagleConfig.for_target(model.config, subset=VOCAB)
    examples = collect_features(model, _texts(model, 40, 1))
    head, report = train_head(model, examples, cfg,
                              train=TrainConfig(epochs=12, lr=3e-3, accumulate=2, second_step=True))
    return model, head, report


def _engine(model, head, paged=False, k=3, slots=3, int8=True):
    cache = (PagedKVCache(model.config, 64, 128, model.dtype, block_size=4, num_slots=slots) if paged
             else KVCache(model.config, slots, 128, model.dtype))
    proposer = EagleProposer(head, model, (), 128, int8=int8) if head is not None else None
    return Engine(model, ToyTokenizer(VOCAB, (2,)), max_len=128, proposer=proposer,
                  controller=ControllerConfig(max_k=4, fixed_k=k), cache=cache)


def _generate(eng, prompt, params):
    *_, (seq, _) = eng.generate(prompt, params)
    return seq


def test_training_raises_agreement_with_the_target(trained):
    model, head, report = trained
    held_out = [e for e in collect_features(model, _texts(model, 8, 2))]
    rows = float_rows(model.lm_head, subset_ids(head.cfg, ())).float()
    untrained = EagleHead(head.cfg)
    assert report["held_out_agreement"] > 0
    assert held_out_agreement(head, model, held_out, rows) > held_out_agreement(untrained, model, held_out, rows) + 0.1


def test_drafting_runtime_computes_the_training_forward():
    """Pairs fed a few rows at a time against the head's cache give the whole-sequence forward's values."""
    model = _model()
    head = EagleHead(EagleConfig.for_target(model.config, subset=VOCAB))
    torch.manual_seed(0)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.1)
    prop = EagleProposer(head, model, (), 128, int8=False)
    tokens = list(range(3, 23))
    feats = torch.randn(len(tokens), 64)
    prop.begin(0, tokens[:4])
    st = prop._states[0]
    got = []
    for lo, hi in ((0, 5), (5, 6), (6, 9), (9, 19)):
        got.append(prop._run([(st, feats[lo:hi], tokens[lo + 1:hi + 1], lo)]))
    with torch.no_grad():
        want = head(feats[:19], model.embed(torch.tensor(tokens[1:20])).float(), torch.arange(19))
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-5, atol=1e-5)
    # the second-step training pass is the second draft token: real pairs up to r, then the head's own
    with torch.no_grad():
        _, again = head.two_steps(feats[:19], model.embed(torch.tensor(tokens[1:20])).float(), torch.arange(19))
    for r in (0, 7, 17):
        prop.begin(1, tokens[:4])
        st = prop._states[1]
        first = prop._run([(st, feats[:r + 1], tokens[1:r + 2], 0)])[-1:]  # f^_{r+1}
        second = prop._run([(st, first, [tokens[r + 2]], r + 1)])
        torch.testing.assert_close(second[0], again[r], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_eagle_output_equals_plain(trained, params, paged):
    model, head, _ = trained
    accepted = 0
    for prompt in PROMPTS:
        want = _generate(_engine(model, None, paged), prompt, params).generated
        seq = _generate(_engine(model, head, paged), prompt, params)
        assert seq.generated == want, prompt
        assert seq.stats.draft_tokens > 0
        accepted += seq.stats.accepted_tokens
    assert accepted > 0  # drafts were kept: the rows after an accepted run fed the head too


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_eagle_steps_equal_each_alone(trained, params):
    model, head, _ = trained
    want = [_generate(_engine(model, None), p, params).generated for p in PROMPTS]
    eng = _engine(model, head, k=None)
    seqs = [eng.add(p, params) for p in PROMPTS]
    while not all(s.finished for s in seqs):
        eng.step(seqs)
    assert [s.generated for s in seqs] == want


def test_head_cache_holds_the_targets_features_paired_with_next_tokens(trained):
    """After a generation the head's cache equals a fresh pass over the target's features of the
    whole text: every verified row's feature went in once, at its position, beside the next token."""
    model, head, _ = trained
    eng = _engine(model, head, int8=False)
    prompt = PROMPTS[1]
    seq = eng.add(prompt, GREEDY)
    while not seq.finished:
        eng.step([seq])
    st = eng.proposer._states[seq.seq_id]
    fed = st.fed
    assert fed > len(prompt) and st.base == 0
    feats = collect_features(model, [seq.tokens])[0].feats.float()  # bf16 copies: compare loosely
    fresh = EagleProposer(head, model, (), 128, int8=False)
    fresh.begin(0, prompt)
    fresh._run([(fresh._states[0], feats[:fed], seq.tokens[1:fed + 1], 0)])
    torch.testing.assert_close(st.keys[:fed], fresh._states[0].keys[:fed], rtol=0.05, atol=0.05)


def test_prefix_the_target_did_not_compute_leaves_output_unchanged(trained):
    """Features from position p on only (a cached prefix): the head starts there; output is plain's."""
    model, head, _ = trained
    prompt = PROMPTS[1]
    want = _generate(_engine(model, None), prompt, GREEDY).generated
    eng = _engine(model, head)
    take = eng.proposer.take_features
    eng.proposer.take_features = lambda sid, pos, f: take(sid, max(pos, 6), f[max(0, 6 - pos):])
    seq = _generate(eng, prompt, GREEDY)
    assert seq.generated == want
    assert seq.stats.draft_tokens > 0


def test_head_file_round_trip_and_refusals(trained, tmp_path):
    model, head, _ = trained
    path = tmp_path / "head.safetensors"
    head.save(path)
    loaded = EagleHead.load(path)
    assert loaded.cfg == head.cfg
    for (a, pa), (b, pb) in zip(head.named_parameters(), loaded.named_parameters()):
        assert a == b and torch.equal(pa, pb)
    with pytest.raises(ConfigError, match="no draft head file"):
        EagleHead.load(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="cannot read the draft head"):
        EagleHead.load(tmp_path / "junk.safetensors")
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ConfigError, match="not a tokenleap draft head"):
        EagleHead.load(tmp_path / "other.safetensors")
    wider = tiny_model("qwen2", seed=4, vocab=VOCAB, hidden=128, intermediate=128, layers=2)
    with pytest.raises(ConfigError, match="hidden size 64"):
        EagleProposer(loaded, wider)
    import os
    mask = os.umask(0o022)
    try:  # written with the process's umask (a head an admin trains is readable by a server's user)
        head.save(tmp_path / "shared.safetensors")
    finally:
        os.umask(mask)
    assert (tmp_path / "shared.safetensors").stat().st_mode & 0o777 == 0o644
    # a diverged training's weights: not saved, and such a file (made elsewhere) not loaded -- its
    # drafts crashed every sampled request (a NaN distribution)
    import copy
    diverged = copy.deepcopy(head)
    with torch.no_grad():
        next(diverged.parameters()).fill_(float("nan"))
    with pytest.raises(ConfigError, match="non-finite weights"):
        diverged.save(tmp_path / "nan.safetensors")
    assert not (tmp_path / "nan.safetensors").exists()
    tensors = load_file(str(path))
    tensors = {k: torch.full_like(v, float("inf")) if k == "fc.weight" else v for k, v in tensors.items()}
    with safe_open(str(path), framework="pt") as f:
        save_file(tensors, str(tmp_path / "inf.safetensors"), metadata=f.metadata())
    with pytest.raises(ConfigError, match="non-finite weights") as refused:
        EagleHead.load(tmp_path / "inf.safetensors")
    assert "cannot read" not in str(refused.value)  # said once, not wrapped again
    # metadata naming an impossible shape: one line, before any tensor is made (no torch warning)
    import json
    import warnings
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["tokenleap_eagle"])
    for change, said in (({"num_heads": 0}, "num_heads 0"), ({"num_kv_heads": 3}, "evenly"),
                         ({"rope_theta": "x"}, "rope_theta")):
        save_file(load_file(str(path)), str(tmp_path / "shape.safetensors"),
                  metadata={"tokenleap_eagle": json.dumps({**meta, **change})})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ConfigError, match=said):
                EagleHead.load(tmp_path / "shape.safetensors")
    # metadata and tensors that disagree: refused before the head's memory is taken (metadata can name any
    # size) -- and a tensor that would broadcast into its parameter ([1] into [64]) is no head either
    import tokenleap.heads.eagle as eagle_mod
    def allocating(self, cfg):
        raise AssertionError(f"a head of {cfg} was allocated")
    monkey = pytest.MonkeyPatch()
    monkey.setattr(eagle_mod.EagleHead, "__init__", allocating)
    try:
        for meta_change, tensors_change, said in (
                ({"intermediate_size": 10**7}, {}, r"gate_proj.weight is \[\d+, 64\], its metadata says "
                                                   r"\[10000000, 64\]"),
                ({}, {"fc.bias": torch.zeros(1)}, r"fc.bias is \[1\], its metadata says \[64\]")):
            save_file({**load_file(str(path)), **tensors_change}, str(tmp_path / "odd.safetensors"),
                      metadata={"tokenleap_eagle": json.dumps({**meta, **meta_change})})
            with pytest.raises(ConfigError, match="is damaged: its tensor " + said):
                EagleHead.load(tmp_path / "odd.safetensors")
        kept = {k: v for k, v in load_file(str(path)).items() if not k.startswith(("gate_proj", "up_proj"))}
        save_file(kept, str(tmp_path / "odd.safetensors"),
                  metadata={"tokenleap_eagle": json.dumps({**meta, "intermediate_size": 10**7})})
        with pytest.raises(ConfigError, match="is damaged: it lacks gate_proj.weight, up_proj.weight"):
            EagleHead.load(tmp_path / "odd.safetensors")
        with pytest.raises(ConfigError, match="hidden size 64"):  # the target's fit, checked first too
            EagleHead.load(path, wider.config)
        from types import SimpleNamespace
        from tokenleap.spec.proposers.factory import eagle_proposer
        with pytest.raises(ConfigError, match="hidden size 64"):  # and so from the factory the CLI uses
            eagle_proposer(SimpleNamespace(model=wider, source="wider"), str(path), 64, tmp_path)
    finally:
        monkey.undo()


def test_train_head_command_and_spec_eagle_on_a_real_model(capsys, tmp_path, smollm2_gguf):
    """tokenleap train-head on SmolLM2 (two prompts, a short reply each, one epoch), then --spec eagle
    with that head: output equal to plain decoding; replies and features are reused on a rerun."""
    import json
    from tokenleap.cli.main import main
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "List three colors."}\n{"prompt": "Name two planets."}\n')
    head, replies = tmp_path / "head.safetensors", tmp_path / "replies.jsonl"
    cache = tmp_path / "cache"
    args = ["train-head", "--model", str(smollm2_gguf), "--quant", "none", "--prompts", str(prompts),
            "--max-tokens", "12", "--epochs", "1", "--replies", str(replies), "--output", str(head), "--json",
            "--cache-dir", str(cache)]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["path"] == str(head) and head.is_file() and report["tokens"] > 24
    assert len(replies.read_text().splitlines()) == 2
    assert len(list(cache.glob("heads/*/features/*.pt"))) == 1  # the replies' features, kept for reruns
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "replies read from" in err and "features read from" in err
    rows = {}
    for spec in (["--spec", "none"], ["--spec", "eagle", "--draft-head", str(head), "--num-spec-tokens", "3"]):
        assert main(["generate", "--model", str(smollm2_gguf), "--prompt", "Count from one to ten.", "--chat",
                     "--max-tokens", "24", "--json", "--stats", *spec]) == 0
        out, err = capsys.readouterr()
        rows[spec[1]] = json.loads(out.splitlines()[0])
    assert f"speculation: eagle, draft length 3; draft head {head}" in err  # --stats names the head
    assert rows["eagle"]["token_ids"] == rows["none"]["token_ids"]
    assert rows["eagle"]["stats"]["draft_tokens"] > 0 and "eagle" in rows["eagle"]["stats"]["proposers"]
    assert main(["generate", "--model", str(smollm2_gguf), "--prompt", "x", "--spec", "eagle",
                 "--draft-head", str(tmp_path / "none.safetensors")]) == 2
    assert "train-head" in capsys.readouterr().err


def test_eagle_flags_checked_before_loading(capsys, tmp_path):
    from conftest import a_model_file
    from tokenleap.cli.main import UsageError, main
    model = a_model_file(tmp_path)
    for args, needle in ((["--draft-head", "h.safetensors"], "--draft-head goes with --spec eagle"),
                         (["--spec", "eagle", "--draft-head", ""], "--draft-head is empty"),
                         (["--spec", "eagle", "--draft-model", model], "not a draft model")):
        assert main(["generate", "--model", model, "--prompt", "hi", *args]) == 2
        assert needle in capsys.readouterr().err
    for lr in ("0", "inf", "nan"):
        assert main(["train-head", "--model", model, "--lr", lr]) == 2
        assert "--lr must be a positive finite number" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("x")  # an --output the head could not be saved at: said before any work
    for output, needle in ((tmp_path, "is a directory"), (tmp_path / "a_file" / "h.safetensors", "is a file")):
        assert main(["train-head", "--model", model, "--output", str(output)]) == 2
        assert needle in capsys.readouterr().err
    # a --replies file to write where none can be: said before the replies are generated
    assert main(["train-head", "--model", model, "--replies", str(tmp_path / "a_file" / "r.jsonl")]) == 2
    assert "--replies" in (err := capsys.readouterr().err) and "is a file" in err
    from tokenleap.cli.train_head import _replies
    bad = tmp_path / "replies.jsonl"
    for text in ('{"prompt": [1, 2]}\n', "not json\n", '{"prompt": "ab", "output": [1]}\n'):
        bad.write_text(text)
        with pytest.raises(UsageError, match="not a replies file"):
            _replies(None, [], 8, bad)
    from types import SimpleNamespace
    llm = SimpleNamespace(target=SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=100))))
    bad.write_text('{"prompt": [1, 2], "output": [3, 150]}\n')  # another model's replies
    with pytest.raises(UsageError, match="outside this model's vocabulary"):
        _replies(llm, [], 8, bad)
    bad.write_text("\n")  # none at all: said, not trained on nothing
    with pytest.raises(UsageError, match="holds no replies"):
        _replies(llm, [], 8, bad)


@pytest.fixture(scope="module")
def serving_head():
    from serving_helpers import model
    target = model()
    examples = collect_features(target, _texts(target, 24, 3))
    head, _ = train_head(target, examples, EagleConfig.for_target(target.config, subset=VOCAB),
                         train=TrainConfig(epochs=8, lr=3e-3, accumulate=2))
    return head


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("blocks", [128, 9])
def test_eagle_batched_serving_equals_alone(serving_head, sampled, blocks):
    """Continuous batching with a head: prefills without drafting alongside (the features still come),
    several sequences drafted in one forward a position, preemption (9 blocks) recomputing a
    sequence's features -- every output equals the request run alone."""
    from serving_helpers import CHUNK, MAX_LEN, ChatToyTokenizer, model, serve_workload_equals_alone
    cache = PagedKVCache(model().config, blocks, MAX_LEN, torch.float32, block_size=16, num_slots=16)
    eng = Engine(model(), ChatToyTokenizer(VOCAB), max_len=MAX_LEN, prefill_chunk=CHUNK, cache=cache,
                 proposer=EagleProposer(serving_head, model(), (), MAX_LEN),
                 controller=ControllerConfig(max_k=4, fixed_k=3))
    sched = serve_workload_equals_alone(eng, sampled)
    if blocks == 128 or not sampled:  # (the seeded run's admissions fit 9 blocks without a preemption)
        assert (sched.stats.preemptions > 0) == (blocks == 9)
    assert eng.totals.accepted_tokens > 0 and eng.cache.num_used_blocks == 0
    assert not eng.proposer._states  # every finished sequence's head cache freed
