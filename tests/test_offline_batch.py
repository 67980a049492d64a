"""``LLM.generate`` of several prompts: decoded together by the continuous-batching scheduler (with
speculation), each output token-identical to the same prompt generated alone, in the prompts' order."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tokenleap.api import LLM
from tokenleap.config import ConfigError, SamplingParams, SpecConfig
from tokenleap.spec.engine import Engine
from tokenleap.models.pretrained import LoadedModel

from serving_helpers import VOCAB, ChatToyTokenizer, EncodeChatToy, model, workload

# (fixed draft lengths: a timed one drafts only where measured costs say it pays, which on a busy machine
# can be nowhere in a short batch -- and the tests below count drafted and accepted tokens)
SPECS = {None: SpecConfig(), "ngram": SpecConfig(method="ngram", num_tokens=3),
         "draft": SpecConfig(method="draft", draft_model="tiny-draft", num_tokens=3)}


def make_llm(kind: str | None, max_num_seqs: int = 16, max_model_len: int = 128) -> LLM:
    def loaded(m):
        return LoadedModel(m, ChatToyTokenizer(VOCAB), torch.float32, "none", "tiny", None)
    draft = loaded(model(77)) if kind == "draft" else None
    return LLM.from_loaded(loaded(model(1)), SPECS[kind], draft, max_model_len=max_model_len, max_num_seqs=max_num_seqs)


@pytest.fixture
def batch_sizes(monkeypatch):
    """The number of sequences in every engine step."""
    sizes = []
    step = Engine.step

    def counting(self, seqs, k=None):
        sizes.append(len(seqs))
        return step(self, seqs, k)
    monkeypatch.setattr(Engine, "step", counting)
    return sizes


@pytest.mark.parametrize("kind,seeded", [("ngram", False), ("draft", False), ("draft", True), (None, True)])
def test_batched_generate_equals_one_at_a_time(kind, seeded, batch_sizes):
    llm = make_llm(kind, max_num_seqs=4)  # 7 prompts, 4 at a time: later ones join as others finish
    jobs = workload(7, seed=5)
    prompts = [p for p, _ in jobs]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, **(dict(temperature=0.9, top_p=0.95, seed=40 + i)
                                                                if seeded else {}))
              for i, (_, m) in enumerate(jobs)]
    outs = llm.generate(prompts, params)
    assert max(batch_sizes) > 1  # decoded together
    assert llm._engine is None  # on a paged engine of their own: the one-prompt engine was never built
    batch_sizes.clear()
    alone = [llm.generate(p, sp)[0] for p, sp in zip(prompts, params)]
    assert set(batch_sizes) == {1}
    for prompt, out, ref in zip(prompts, outs, alone):
        assert out.prompt == prompt and out.prompt_tokens == len(prompt)
        assert (out.token_ids, out.text, out.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
        assert out.stats["new_tokens"] == len(out.token_ids) and out.seconds > 0
    if kind is not None:
        assert sum(o.stats["draft_tokens"] for o in outs) > 0
    if kind is not None and not seeded:  # (sampled from a random tiny model, drafts are rarely accepted)
        assert sum(o.stats["accepted_tokens"] for o in outs) > 0


def test_one_params_for_all_text_prompts_and_bad_lists():
    llm = make_llm("ngram")
    prompts = ["hello there", "abcabcabc", "x", "hello there"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=7))
    assert [o.prompt for o in outs] == prompts and outs[0].token_ids == outs[3].token_ids
    assert [o.text for o in outs] == [llm.generate(p, SamplingParams(max_tokens=7))[0].text for p in prompts]
    with pytest.raises(ConfigError, match="2 SamplingParams for 4 prompts"):
        llm.generate(prompts, [SamplingParams(), SamplingParams()])
    with pytest.raises(ConfigError, match="no prompts"):
        llm.generate([])
    for bad_prompt in ([VOCAB], [-1], [1, 2.5], [True]):  # token ids outside the vocabulary, or not ids
        with pytest.raises(ConfigError, match="token ids"):
            llm.generate(bad_prompt)
    with pytest.raises(ConfigError, match="prompt is text or a list of token ids, got int"):
        llm.generate(["fine", 5])
    with pytest.raises(ConfigError, match="prompts must be"):
        llm.generate(5)
    with pytest.raises(ConfigError, match="must be a SamplingParams .* got dict"):
        llm.generate("x", {"max_tokens": 3})
    assert llm.engine.cache.num_free_slots == llm.engine.cache.num_slots  # nothing left held


def test_vllm_style_calls_prompt_dicts_cumulative_logprob_and_max_tokens_none():
    """vLLM's spellings: prompt dicts, ``sampling_params=``, ``use_tqdm``, ``get_tokenizer()``,
    ``cumulative_logprob``, ``max_tokens=None`` (up to the window's end); a stream left open holds its
    slot and ``generate`` goes on beside it, a second stream is refused clearly."""
    llm = make_llm("ngram", max_model_len=48)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ids = llm.encode("hello there")
    want = llm.generate("hello there", params)[0]
    by_dict = llm.generate([{"prompt": "hello there"}, {"prompt_token_ids": ids}], sampling_params=params,
                           use_tqdm=False)
    assert [o.token_ids for o in by_dict] == [want.token_ids] * 2 and by_dict[1].prompt == ids
    # every output has vLLM's request_id (unique: one per request, a batch's and a stream's alike) and finished
    ids_seen = [o.request_id for o in [want, *by_dict]]
    assert all(i.isdigit() for i in ids_seen) and len(set(ids_seen)) == 3 and all(o.finished for o in by_dict)
    assert llm.generate({"prompt_token_ids": ids}, params)[0].token_ids == want.token_ids
    assert llm.get_tokenizer() is llm.tokenizer
    with pytest.raises(ConfigError, match="'prompt' .* or 'prompt_token_ids'"):
        llm.generate({"text": "x"}, params)
    with pytest.raises(ConfigError, match="not both"):
        llm.generate("x", params, sampling_params=params)
    with pytest.raises(ConfigError, match="stream and infill take one prompt"):
        next(llm.stream(["hello", "there"], params))
    out = llm.generate("hello there", SamplingParams(max_tokens=6, logprobs=1, ignore_eos=True))[0].outputs[0]
    assert out.cumulative_logprob == pytest.approx(sum(t.logprob for t in out.logprobs))
    assert want.outputs[0].cumulative_logprob is None  # (no logprobs asked for)
    whole = llm.generate("hello there", SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert len(whole.token_ids) == 48 - len(ids) and whole.finish_reason == "length"
    stream = llm.stream("abcabc", params)
    next(stream)  # left open: its slot stays held
    assert llm.generate("hello there", params)[0].token_ids == want.token_ids
    with pytest.raises(ConfigError, match="still open"):
        next(llm.stream("x", params))
    stream.close()
    assert llm.generate("hello there", params)[0].token_ids == want.token_ids


def test_sizes_and_speculative_settings_are_checked_before_loading():
    for kw, words in ((dict(max_model_len=-5), "max_model_len"), (dict(max_model_len=1), "max_model_len"),
                      (dict(max_num_seqs=0), "max_num_seqs"), (dict(num_slots=True), "num_slots"),
                      (dict(speculative={"method": "ngram", "bogus": 1}), "bogus"),
                      (dict(speculative="ngram"), "SpecConfig"),
                      (dict(speculative={"method": "ngram", "ngram_min": "a"}), "ngram_min"),
                      (dict(speculative={"method": "layerskip", "skip_layers": 5}), "skip_layers"),
                      (dict(speculative={"method": "draft", "draft_model": "m", "draft_quant": "q3"}), "draft_quant"),
                      (dict(speculative={"method": "ngram", "draft_vocab": "x"}), "draft_vocab"),
                      (dict(speculative={"method": "draft", "draft_model": 5}), "draft_model"),
                      # a setting only another method reads is refused, as the command line refuses its flag
                      (dict(speculative={"method": "ngram", "draft_model": "m"}), "draft_model goes with"),
                      (dict(speculative={"method": "lookahead", "draft_quant": "int4"}), "draft_quant and"),
                      (dict(speculative={"method": "draft", "model": "m", "skip_layers": "1-3"}), "skip_layers"),
                      (dict(speculative={"method": "ngram", "draft_head": "h.pt"}), "draft_head goes"),
                      (dict(speculative={"num_tokens": 4}), "num_tokens sets"),
                      (dict(speculative={"model": "m", "draft_model": "m"}), "not both")):
        with pytest.raises(ConfigError, match=words):
            LLM("no-such-model", **kw)  # (the model is never looked up)
    llm = LLM.from_loaded(make_llm(None).target, max_model_len=64)
    assert llm.max_len == 64
    assert SpecConfig(method="draft", draft_model=Path("/models/d")).draft_model == "/models/d"  # a Path is a path


def test_speculative_settings_take_vllms_spellings_and_the_command_lines_defaults():
    """vLLM's speculative_config names (num_speculative_tokens, model, prompt_lookup_max / _min, method
    draft_model; an eagle model is the head), a draft model alone meaning method "draft" and method
    "auto" alone picking an installed draft, as ``--draft-model`` / ``--spec auto`` do."""
    from tokenleap.api import _spec_config
    ngram = _spec_config({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3,
                          "prompt_lookup_min": 1})
    assert (ngram.method, ngram.num_tokens, ngram.ngram_max, ngram.ngram_min) == ("ngram", 5, 3, 1)
    for d in ({"model": "d"}, {"method": "draft_model", "model": "d"}, {"draft_model": "d"}):
        spec = _spec_config({**d, "num_speculative_tokens": 3})
        assert (spec.method, spec.draft_model, spec.num_tokens) == ("draft", "d", 3), d
    assert _spec_config({"method": "eagle", "model": "head.pt"}).draft_head == "head.pt"
    assert _spec_config({"method": "auto"}).draft_model == "auto"
    assert _spec_config({"method": "auto", "draft_model": None}).draft_model is None  # (auto without a draft)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):  # the error names what is accepted
        _spec_config({"method": "ngram", "num_spec_tokens": 5})


def test_a_context_past_the_models_positions_is_cut_with_a_warning(caplog):
    target = make_llm(None).target
    positions = target.model.config.max_position_embeddings
    with caplog.at_level("WARNING", logger="tokenleap"):
        assert LLM.from_loaded(target, max_model_len=positions * 2).max_len == positions
    assert f"max_model_len {positions * 2} is more than the {positions} positions" in caplog.text


def test_chat_renders_each_conversation_and_generates_it():
    llm = make_llm("ngram")
    llm.tokenizer = tok = EncodeChatToy(VOCAB)
    one = [{"role": "system", "content": "be short"}, {"role": "user", "content": "hello there"}]
    two = [{"role": "user", "content": "abcabc"}, {"role": "assistant", "content": "abc"}]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    [out] = llm.chat(one, params)  # one conversation
    assert out.prompt == tok.encode("<system>be short<user>hello there<assistant>")
    assert out.token_ids == llm.generate(out.prompt, params)[0].token_ids
    outs = llm.chat([one, two], params, continue_final_message=True)  # a batch, the reply continuing each
    assert [o.prompt for o in outs] == [tok.encode("<system>be short<user>hello there"),
                                        tok.encode("<user>abcabc<assistant>abc")]
    assert [o.token_ids for o in outs] == [llm.generate(o.prompt, params)[0].token_ids for o in outs]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert llm.chat(two, params, tools=tools)[0].prompt == tok.encode("<tools>f<user>abcabc<assistant>abc<assistant>")
    # OpenAI-style text parts are the text they hold, a part a line (as vLLM joins them); others are refused
    parts = [{"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "text", "text": "abc"}]}]
    assert llm.chat(parts, params)[0].prompt == tok.encode("<user>abc\nabc<assistant>")
    with pytest.raises(ConfigError, match="content parts must be text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ConfigError, match="no messages"):
        llm.chat([])


def test_stop_reason_names_the_stop_string_or_stop_token():
    """vLLM's ``stop_reason``: the stop string matched or the stop token id, None for any other end."""
    llm = make_llm("ngram")
    ref = llm.generate("hello there", SamplingParams(max_tokens=12, ignore_eos=True))[0]
    word, tok = ref.text[3:5], ref.token_ids[6]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, stop=(word,)),
              SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(tok,)),
              SamplingParams(max_tokens=12, ignore_eos=True)]
    batched = llm.generate(["hello there"] * 3, params)
    for outs in (batched, [llm.generate("hello there", p)[0] for p in params]):
        assert [o.stop_reason for o in outs] == [word, tok, None]
        assert [o.finish_reason for o in outs] == ["stop", "stop", "length"]
        assert outs[0].to_dict()["stop_reason"] == word


def test_special_tokens_are_written_into_the_text_only_when_asked(smollm2_gguf):
    """vLLM's skip_special_tokens: by default a control token the reply holds is left out of its text;
    False writes it (the token ids are the same either way)."""
    llm = LLM(smollm2_gguf)
    special = llm.tokenizer.token_to_id("<|im_start|>")
    params = dict(max_tokens=3, allowed_token_ids=(special,), ignore_eos=True)
    hidden, shown = llm.generate(["Hi", "Hi"], [SamplingParams(**params),
                                               SamplingParams(**params, skip_special_tokens=False)])
    assert hidden.token_ids == shown.token_ids == [special] * 3
    assert hidden.text == "" and shown.text == "<|im_start|>" * 3
    assert llm.generate("Hi", SamplingParams(**params, skip_special_tokens=False))[0].text == shown.text  # alone too


def test_the_servers_requests_carry_skip_special_tokens():
    from tokenleap.serve.protocol import ChatRequest, CompletionRequest, sampling_params
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert sampling_params(ChatRequest.model_validate(chat), 5, 0).skip_special_tokens is True
    off = ChatRequest.model_validate({**chat, "skip_special_tokens": False})
    assert sampling_params(off, 5, 0).skip_special_tokens is False
    assert sampling_params(CompletionRequest.model_validate({"prompt": "x", "skip_special_tokens": False}), 5,
                           0).skip_special_tokens is False
    # seed -1 is no seed (vLLM's), for every choice; another seed gives each choice its own
    assert not sampling_params(ChatRequest.model_validate(chat), 5, 0).min_p_after_top_p  # (vLLM's order)
    assert sampling_params(ChatRequest.model_validate({**chat, "min_p_after_top_p": True}), 5, 0).min_p_after_top_p
    unseeded = ChatRequest.model_validate({**chat, "seed": -1, "temperature": 1.0, "n": 2})
    assert [sampling_params(unseeded, 5, j).seed for j in (0, 1)] == [None, None]
    assert sampling_params(ChatRequest.model_validate({**chat, "seed": 7}), 5, 1).seed not in (None, 7)


@pytest.mark.parametrize("kind", [None, "draft"])
def test_n_completions_a_prompt_as_vllms_outputs(kind):
    """SamplingParams.n: a prompt's n completions in ``outputs`` (vLLM's ``output.outputs[j]``), decoded
    together; a seeded one's j-th is that prompt generated alone with choice_seed(seed, j) (not seed + j:
    nearby seeds would share samples), a greedy one's are all plain greedy decoding's; the output's own
    fields are its first completion's."""
    from tokenleap.spec.seeded import choice_seed
    llm = make_llm(kind)
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=5, n=3, logprobs=1, ignore_eos=True)
    greedy = SamplingParams(max_tokens=8, n=2, ignore_eos=True)
    first, second, third = llm.generate(["hello there", "abcabc", "why"], [seeded, greedy, replace(greedy, n=1)])
    assert [c.index for c in first.outputs] == [0, 1, 2] and choice_seed(5, 0) == 5
    for j, c in enumerate(first.outputs):
        alone = llm.generate("hello there", replace(seeded, n=1, seed=choice_seed(5, j)))[0]
        assert (c.text, c.token_ids, c.finish_reason) == (alone.text, alone.token_ids, alone.finish_reason)
        if j:  # (seed + j's first completion is another sample)
            assert c.token_ids != llm.generate("hello there", replace(seeded, n=1, seed=5 + j))[0].token_ids
        assert [t.token_id for t in c.logprobs] == alone.token_ids
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # (different seeds, different samples)
    assert (first.text, first.token_ids) == (first.outputs[0].text, first.outputs[0].token_ids)
    plain = llm.generate("abcabc", replace(greedy, n=1))[0]
    assert [c.token_ids for c in second.outputs] == [plain.token_ids] * 2
    assert second.prompt_token_ids == plain.prompt_token_ids == llm.encode("abcabc", False)
    assert len(third.outputs) == 1 and "outputs" not in third.to_dict() and len(first.to_dict()["outputs"]) == 3
    # the request's counters and rate are its completions' together, over its wall time
    assert first.stats["new_tokens"] == sum(len(c.token_ids) for c in first.outputs) == 24
    assert first.stats["total_seconds"] == round(first.seconds, 4)
    assert first.tokens_per_second == pytest.approx(24 / first.seconds)
    assert third.stats["new_tokens"] == len(third.token_ids)
    [one] = llm.generate("why", replace(greedy, n=2))  # one prompt, two completions
    assert [c.token_ids for c in one.outputs] == [third.token_ids] * 2
    with pytest.raises(ConfigError, match="stream gives one completion"):
        next(llm.stream("why", greedy))
    for n in (0, 10**9):  # (vLLM's limit: 16384)
        with pytest.raises(ConfigError, match=r"n must be an integer in \[1, 16384\]"):
            SamplingParams(n=n)


def test_a_bad_prompt_in_a_batch_is_named_by_the_callers_index():
    """Refused before any work, naming the prompt as the caller numbered it (n > 1 repeats prompts
    inside the batch: the index is the caller's, not the repeated list's)."""
    llm = make_llm(None, max_model_len=64)
    good = SamplingParams(max_tokens=2, temperature=0.8, seed=1, n=3)
    bad = replace(good, stop_token_ids=(10_000,))
    with pytest.raises(ConfigError, match=r"^prompt 2 of the batch: stop_token_ids"):
        llm.generate([[5, 6], [7, 8], [9, 10]], [good, good, bad])
    with pytest.raises(ConfigError, match=r"^prompt 1 of the batch: the prompt is empty"):
        llm.generate([[5, 6], []], good)
    with pytest.raises(Exception, match=r"^prompt 1 of the batch: the prompt has 100 tokens"):
        llm.generate([[5, 6], [3] * 100], good)


def test_a_slot_taken_after_the_check_sends_generate_to_a_batch_engine(monkeypatch):
    """Another thread may take LLM.engine's last slot between generate's check and the allocation:
    the call then runs on a batch engine of its own (the same output), not a "streams open" error."""
    llm = make_llm("ngram")
    params = SamplingParams(max_tokens=6)
    want = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    cache = llm.engine.cache
    taken = cache.allocate()  # as if a thread took it just after the check below saw it free
    free = type(cache).num_free_slots  # (this cache only: the batch engine's own must count truly)
    monkeypatch.setattr(type(cache), "num_free_slots", property(lambda self: 1 if self is cache else free.fget(self)))
    assert llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids == want
    cache.free(taken)


def test_an_llm_pickles_after_use_and_its_copy_builds_its_own_engine():
    import pickle

    llm = make_llm("ngram")
    params = SamplingParams(max_tokens=5)
    want = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    copy = pickle.loads(pickle.dumps(llm))
    assert copy._engine is None and copy.generate([[5, 6, 7]], params)[0].outputs[0].token_ids == want
