"""Greedy speculative output is token-identical to plain greedy output, for every proposer."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tokenleap.config import MIN_TEMPERATURE, ConfigError, SamplingParams
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.errors import PromptTooLongError
from tokenleap.models.build import build_transformer
from tokenleap.spec.proposers.cascade import CascadeDraftProposer
from tokenleap.spec.proposers.draft_head import ReducedVocabHead
from tokenleap.spec.proposers.draft_model import DraftModelProposer, _warn_short
from tokenleap.spec.proposers.ngram import NgramProposer
from tokenleap.spec.sequence import Sequence

from conftest import ToyDetokenizer, ToyTokenizer, random_weights, tiny_config, tiny_model

VOCAB = 96
PROMPTS = [[5, 9, 14, 3, 7, 9, 14, 3], [40, 41, 42, 43, 40, 41], [11] * 6 + [12, 13, 11, 11]]


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", seed=1, vocab=VOCAB, hidden=64, intermediate=128, layers=2)


def engine(target, proposer=None, k: int | str = "auto", eos=(2,)):
    fixed = None if k == "auto" else k
    return Engine(target, ToyTokenizer(VOCAB, eos), max_len=128, proposer=proposer,
                  controller=ControllerConfig(max_k=6, fixed_k=fixed))


def run(eng, prompt, params):
    *_, (seq, _) = eng.generate(prompt, params)
    return seq


def plain(target, prompt, params, eos=(2,)):
    return run(engine(target, eos=eos), prompt, params)


def proposers(target):
    yield "self-draft", lambda: DraftModelProposer(target, VOCAB, 128)
    yield "random-draft", lambda: DraftModelProposer(tiny_model("qwen2", seed=77, vocab=VOCAB), VOCAB, 128)
    yield "ngram", lambda: NgramProposer(3, 1)


@pytest.mark.parametrize("k", [1, 3, 5, "auto"])
def test_greedy_speculative_equals_plain(target, k):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        want = plain(target, prompt, params).generated
        for name, make in proposers(target):
            seq = run(engine(target, make(), k), prompt, params)
            assert seq.generated == want, f"{name} k={k} prompt={prompt}"
            assert seq.finish_reason == "length"


def _resized(model, vocab: int, seed: int = 5):
    """``model`` with its embedding and head cut or padded to ``vocab`` rows (padding: random
    embeddings, zero head rows -- an untrained row, as a padded vocabulary's are, seldom wins)."""
    cfg = replace(model.config, vocab_size=vocab)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    extra = random_weights(cfg, seed)
    extra["lm_head.weight"].zero_()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[name][:vocab]
        weights[name] = torch.cat([w, extra[name][len(w):]]) if len(w) < vocab else w
    return build_transformer(cfg, weights, torch.float32)


@pytest.mark.parametrize("draft_vocab,target_vocab", [(VOCAB, VOCAB + 32), (VOCAB + 32, VOCAB)])
def test_a_draft_padded_to_another_vocabulary_size_is_lossless(target, draft_vocab, target_vocab):
    """Qwen2.5's 0.5B-3B hold 151,936 embedding rows and its 7B and larger 152,064, one tokenizer: the
    draft's logits are fitted to the target's size, greedy and seeded output equal plain decoding's,
    and a draft that is the target's own weights still agrees nearly always."""
    tgt = _resized(target, target_vocab, seed=3)
    draft = _resized(target, draft_vocab, seed=4)
    with pytest.raises(Exception, match="differs from the target's"):
        DraftModelProposer(draft, target_vocab, 128)
    for params in (SamplingParams(max_tokens=30, ignore_eos=True),
                   SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=11)):
        for prompt in PROMPTS:
            want = run(Engine(tgt, ToyTokenizer(target_vocab, (2,)), max_len=128), prompt, params).generated
            for kind, head in ((DraftModelProposer, None), (CascadeDraftProposer, None),
                               (DraftModelProposer, ReducedVocabHead(draft.lm_head, 40))):
                proposer = kind(draft, target_vocab, 128, head=head, fit_vocab=True)
                eng = Engine(tgt, ToyTokenizer(target_vocab, (2,)), max_len=128, proposer=proposer,
                             controller=ControllerConfig(max_k=6, fixed_k=4))
                seq = run(eng, prompt, params)
                assert seq.generated == want, (kind, head, params, prompt)
                if params.greedy and head is None:
                    assert seq.stats.draft_acceptance_rate > 0.5


def test_self_draft_accepts_everything_and_random_draft_little(target):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    same = run(engine(target, DraftModelProposer(target, VOCAB, 128), 4), PROMPTS[0], params)
    assert same.stats.draft_acceptance_rate == 1.0
    assert same.stats.tau > 3.0
    rand = run(engine(target, DraftModelProposer(tiny_model("qwen2", seed=77, vocab=VOCAB), VOCAB, 128), 4),
               PROMPTS[0], params)
    assert rand.stats.draft_acceptance_rate < 0.5


def test_eos_and_max_tokens_inside_a_draft(target):
    base = plain(target, PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True)).generated
    eos = base[7]  # a token the target emits at step 8: make it EOS
    first = base.index(eos)
    for name, make in proposers(target):
        seq = run(engine(target, make(), 4, eos=(eos,)), PROMPTS[1], SamplingParams(max_tokens=30))
        assert seq.generated == base[: first + 1] and seq.finish_reason == "stop", name
        for max_tokens in (1, 2, 6, 9):
            seq = run(engine(target, make(), 4), PROMPTS[1], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            assert seq.generated == base[:max_tokens], (name, max_tokens)


def test_stop_token_ids_and_min_tokens(target):
    """vLLM's stop_token_ids end the reply (the token kept in its ids); min_tokens holds EOS, stop
    tokens and stop strings back until that many tokens -- part of the target distribution, so
    speculation reproduces it exactly."""
    base = plain(target, PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True)).generated
    stop_tok = base[5]
    first = base.index(stop_tok)
    eos = 2
    for name, make in [("plain", lambda: None), *proposers(target)]:
        seq = run(engine(target, make(), 4), PROMPTS[1],
                  SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(stop_tok,)))
        assert seq.generated == base[:first + 1] and seq.finish_reason == "stop", name
        assert seq.stop_reason == stop_tok, name  # vLLM's stop_reason: the stop token id
        # EOS made overwhelmingly likely: without min_tokens the reply is EOS at once, with it
        # exactly min_tokens other tokens come first, then EOS
        params = SamplingParams(max_tokens=30, logit_bias={eos: 60.0})
        seq = run(engine(target, make(), 4), PROMPTS[1], params)
        assert seq.generated == [eos] and seq.stop_reason is None, name  # an EOS token: no stop_reason
        seq = run(engine(target, make(), 4), PROMPTS[1], replace(params, min_tokens=6))
        assert len(seq.generated) == 7 and seq.generated[-1] == eos and eos not in seq.generated[:6], name
        assert seq.generated == run(engine(target), PROMPTS[1], replace(params, min_tokens=6)).generated, name
        # a stop string inside the first min_tokens tokens does not end the reply, however many tokens
        # a step adds (only matches ending in a token past min_tokens count), and the stream is the text
        text = plain(target, PROMPTS[2], SamplingParams(max_tokens=30, ignore_eos=True)).text
        stopped = SamplingParams(max_tokens=30, ignore_eos=True, stop=(text[2:4],), min_tokens=10)
        ref = plain(target, PROMPTS[2], stopped)
        pieces = list(engine(target, make(), 4).generate(PROMPTS[2], stopped))
        seq = pieces[-1][0]
        assert len(seq.generated) >= 10 and len(seq.text) > 4, name
        assert (seq.generated, seq.text, seq.finish_reason) == (ref.generated, ref.text, ref.finish_reason), name
        assert "".join(piece for _, piece in pieces) == seq.text, name


def test_a_temperature_near_zero_is_raised_to_the_least_one(target, caplog):
    """A temperature above 0 and below ``MIN_TEMPERATURE`` is raised to it with a warning (vLLM's
    rule): 1e-38 would overflow logits / T to infinity and leave no probabilities to sample from.
    Every method then samples as plain decoding at that temperature does; 0 stays greedy."""
    least = SamplingParams(max_tokens=12, ignore_eos=True, temperature=MIN_TEMPERATURE, seed=3)
    want = plain(target, PROMPTS[0], least).generated
    for t in (1e-38, 1e-30, 9e-6):
        params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=t, seed=3)
        assert params.temperature == MIN_TEMPERATURE and not params.greedy
        for name, make in [("plain", lambda: None), *proposers(target)]:
            assert run(engine(target, make(), 3), PROMPTS[0], params).generated == want, (name, t)
    assert "temperature 1e-38 is below 0.01" in caplog.text
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=0.5).temperature == 0.5
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2  # -1: no seed (vLLM's)


class Letters:
    def piece(self, i: int) -> str:
        return "_abcd"[i]


@pytest.mark.parametrize("stops", [("bc",), ("bc", "zzzzzzzzzz")])
def test_a_stop_string_inside_min_tokens_is_passed_over_whatever_a_step_adds(stops):
    """Only stop strings ending in a token past ``min_tokens`` count, whether the tokens come one a
    step (the text handed out between steps) or all in one step: "bc" ends at token 3 of "abcdabc",
    inside min_tokens 4, so the reply ends at the second "bc" -- also beside a longer stop string
    (each string's window is its own length, as vLLM looks)."""
    def sequence():
        return Sequence(seq_id=0, prompt=[0], params=SamplingParams(max_tokens=20, stop=stops, min_tokens=4),
                        eos_ids=frozenset(), detokenizer=ToyDetokenizer(Letters()))
    tokens = [1, 2, 3, 4, 1, 2, 3]
    one_by_one, streamed = sequence(), ""
    for t in tokens:
        one_by_one.append([t])
        streamed += one_by_one.take_text()
    at_once = sequence()
    assert at_once.append(tokens) == 7
    for seq in (one_by_one, at_once):
        assert (seq.text, seq.finish_reason, seq.stop_reason) == ("abcda", "stop", "bc")
    assert streamed == "abcda" and at_once.take_text() == "abcda"


def test_stop_string_spanning_tokens(target):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = plain(target, PROMPTS[2], params)
    text = ref.text
    stop = text[9:12]  # starts inside token 5 and ends inside token 6
    cut = text.index(stop)
    for name, make in proposers(target):
        seq = run(engine(target, make(), 4), PROMPTS[2], SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)))
        assert seq.text == text[:cut] and seq.finish_reason == "stop" and seq.stop_reason == stop, name
        assert seq.generated == ref.generated[: len(seq.generated)]


def test_streamed_text_never_shows_a_stop_string(target):
    ref = plain(target, PROMPTS[2], SamplingParams(max_tokens=30, ignore_eos=True)).text
    stop = ref[9:12]
    eng = engine(target, NgramProposer(3, 1), 3)
    pieces = [piece for _, piece in eng.generate(PROMPTS[2], SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)))]
    assert "".join(pieces) == ref[: ref.index(stop)]


def test_a_draft_of_fewer_positions_drafts_only_within_them(target, caplog):
    """A draft model whose context is shorter than the target's: past its positions (a long prompt,
    or a reply that grows past them) the steps are plain, as a warning says; the output is the target's
    either way."""
    cfg = replace(tiny_config("qwen2", vocab=VOCAB), max_position_embeddings=24)
    short = build_transformer(cfg, random_weights(cfg, 1), torch.float32)  # the target's weights
    _warn_short.cache_clear()
    with caplog.at_level("WARNING", logger="tokenleap"):
        DraftModelProposer(short, VOCAB, 128)
        DraftModelProposer(short, VOCAB, 128)  # (said once: an LLM builds a proposer for each of its engines)
        DraftModelProposer(short, VOCAB, 24)  # (a context within its positions: nothing to say)
    assert [r.getMessage() for r in caplog.records] == [
        "the draft model reads 24 positions, fewer than the 128 of this context: a sequence past 24 tokens "
        "decodes without it"]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in (PROMPTS[0], list(range(3, 33))):  # the reply passes 24 positions; the prompt alone does
        for tree in (0, 6):
            eng = Engine(target, ToyTokenizer(VOCAB), max_len=128, proposer=DraftModelProposer(short, VOCAB, 128),
                         controller=ControllerConfig(max_k=4, fixed_k=3), tree_nodes=tree)
            seq = run(eng, prompt, params)
            assert seq.generated == plain(target, prompt, params).generated, (len(prompt), tree)
            assert (seq.stats.draft_tokens > 0) == (len(prompt) < 20), (len(prompt), tree)


def test_prompt_longer_than_context_is_refused(target):
    eng = Engine(target, ToyTokenizer(VOCAB), max_len=16)
    with pytest.raises(PromptTooLongError, match="context window is 16"):
        eng.add(list(range(3, 20)), SamplingParams())
    assert eng.cache.num_free_slots == 1
    with pytest.raises(ConfigError, match="the prompt is empty"):  # (a bad value, not a long prompt)
        eng.add([], SamplingParams())
    # (text a tokenizer with added tokens encodes past the model's embeddings)
    for bad in (VOCAB, -1):
        with pytest.raises(ConfigError, match=f"token id {bad}, outside the model's vocabulary of {VOCAB}"):
            eng.add([3, bad], SamplingParams())
    assert eng.cache.num_free_slots == 1


def test_a_prefill_that_fails_or_is_interrupted_frees_its_slot(target):
    """An engine of one slot stays usable after a request fails in its prefill (every token barred:
    nothing left to choose) or is interrupted there (Ctrl-C)."""
    eng = Engine(target, ToyTokenizer(VOCAB), max_len=64, proposer=NgramProposer(3, 1))
    want = run(eng, PROMPTS[0], SamplingParams(max_tokens=5)).generated
    with pytest.raises(ConfigError, match="leave no token"):  # every token barred: found at the first token
        run(eng, PROMPTS[0], SamplingParams(max_tokens=5, bad_word_ids=tuple((t,) for t in range(VOCAB))))
    with pytest.raises(ConfigError, match=r"allowed_token_ids must be token ids in \[0, 96\)"):
        run(eng, PROMPTS[0], SamplingParams(max_tokens=5, allowed_token_ids=(VOCAB + 5,)))  # (refused up front)
    with pytest.raises(ConfigError, match=r"logit_bias must map token ids in \[0, 96\)"):
        run(eng, PROMPTS[0], SamplingParams(max_tokens=5, logit_bias={VOCAB + 5: 3.0}))  # (not silently ignored)
    with pytest.raises(ConfigError, match=r"bad_word_ids must be token ids in \[0, 96\)"):
        run(eng, PROMPTS[0], SamplingParams(max_tokens=5, bad_word_ids=((3, VOCAB),)))  # (a word never barred)
    with pytest.raises(ConfigError, match=r"prediction must be token ids in \[0, 96\)"):
        run(eng, PROMPTS[0], SamplingParams(max_tokens=5, prediction=(4, VOCAB + 1)))
    forward = eng.model.forward

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    eng.model.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        run(eng, PROMPTS[0], SamplingParams(max_tokens=5))
    eng.model.forward = forward
    assert eng.cache.num_free_slots == 1
    assert run(eng, PROMPTS[0], SamplingParams(max_tokens=5)).generated == want


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_seeded_sampling_gives_plain_seeded_tokens_for_any_proposer(target, k):
    """A seeded request samples with noise keyed by position (drafter-invariant), so speculation
    reproduces plain seeded sampling token for token, whatever the proposer and draft length."""
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    for prompt in PROMPTS:
        want = plain(target, prompt, params).generated
        assert plain(target, prompt, params).generated == want
        assert plain(target, prompt, replace(params, seed=99)).generated != want
        for name, make in proposers(target):
            seq = run(engine(target, make(), k), prompt, params)
            assert seq.generated == want, f"{name} k={k} prompt={prompt}"
    self_draft = run(engine(target, DraftModelProposer(target, VOCAB, 128), 4), PROMPTS[0], params)
    assert self_draft.stats.draft_acceptance_rate == 1.0  # the same noise: a self-draft always matches


@pytest.mark.parametrize("last", [False, True])
def test_seeded_sampling_with_penalties_and_top_k_gives_plain_seeded_tokens(target, last):
    """(``temperature_last``: llama.cpp's order, the filters before the temperature -- the verifier and the
    drafts filter as plain decoding does.)"""
    params = SamplingParams(max_tokens=24, temperature=1.3, top_k=20, min_p=0.3 if last else 0.02, seed=7,
                            ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.3, temperature_last=last)
    want = plain(target, PROMPTS[2], params).generated
    for name, make in proposers(target):
        assert run(engine(target, make(), 3), PROMPTS[2], params).generated == want, name
    if last:
        assert want != plain(target, PROMPTS[2], replace(params, temperature_last=False)).generated


def test_unseeded_sampling_differs_run_to_run(target):
    params = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    draft = tiny_model("qwen2", seed=77, vocab=VOCAB)
    outs = {tuple(run(engine(target, DraftModelProposer(draft, VOCAB, 128), 3), PROMPTS[0], params).generated)
            for _ in range(3)}
    assert len(outs) > 1


@pytest.mark.parametrize("float32_activations", [False, True])
def test_bf16_greedy_speculative_equals_plain(float32_activations):
    """bf16 weights with bf16 activations, and with float32 activations (what --dtype bfloat16 loads
    on CPUs without native bf16: the kernel computes in float32, and the KV cache is float32)."""
    from tokenleap.models.build import float32_activations_
    target = tiny_model("llama", seed=4, vocab=VOCAB, dtype=torch.bfloat16, hidden=128, intermediate=256)
    if float32_activations:
        float32_activations_(target)
        assert target.dtype == torch.float32 and target.lm_head.weight.dtype == torch.bfloat16
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = plain(target, PROMPTS[0], params).generated
    for proposer in (NgramProposer(3, 1), DraftModelProposer(target, VOCAB, 128)):
        seq = run(engine(target, proposer, 4), PROMPTS[0], params)
        assert seq.generated == want


def test_reduced_vocabulary_draft_head_stays_lossless(target):
    from tokenleap.spec.proposers.draft_head import ReducedVocabHead
    draft = tiny_model("qwen2", seed=77, vocab=VOCAB)
    head = ReducedVocabHead(draft.lm_head, static_size=40, special_ids=[2])
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for prompt in PROMPTS:
        want = plain(target, prompt, params).generated
        seq = run(engine(target, DraftModelProposer(draft, VOCAB, 128, head=head), 3), prompt, params)
        assert seq.generated == want
    seq_head = head.for_prompt(PROMPTS[1])  # prompt tokens 40..43 join the subset
    logits = seq_head(torch.randn(2, draft.config.hidden_size))
    allowed = set(range(40)) | {2, 40, 41, 42, 43}
    assert {i for i in range(VOCAB) if torch.isfinite(logits[0, i])} == allowed


def test_draft_prefill_skipped_while_speculation_does_not_pay_then_caught_up(target):
    """With speculation predicted not to pay, the draft does not prefill the prompt; when drafting
    starts, the first proposal feeds the backlog, reported as catch-up (prefill) time, and the
    output still equals plain greedy decoding."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = plain(target, PROMPTS[0], params).generated
    draft = DraftModelProposer(target, VOCAB, 128)
    eng = engine(target, draft)
    eng.controller.draft_cost = 10.0  # measured: drafting a token costs far more than a forward
    eng.controller.observe_forward(1, 0.01)
    assert not eng.controller.would_speculate(1)
    seq = eng.add(PROMPTS[0], params)
    while eng.prefill_step(seq):
        pass
    assert draft._fed[seq.seq_id] == 0  # the draft's prefill was skipped
    d = draft.propose(seq.seq_id, seq.tokens, 2, params, None)  # drafting turns on: catch up first
    assert d is not None and d.catch_up_seconds > 0 and draft._fed[seq.seq_id] == len(seq.tokens) + 1
    draft.accept(seq.seq_id, 0)
    eng.controller.draft_cost = 0.0  # now speculation pays
    while not seq.finished:
        eng.step([seq])
    assert seq.generated == want
    assert seq.stats.tau > 1.0
    eng.release(seq)


@pytest.mark.parametrize("cascade", [False, True])
def test_a_draft_says_how_many_of_its_tokens_came_out_of_its_catch_up(target, cascade):
    """A proposal that first feeds a backlog drafts its first token in that forward (catch-up
    time); the draft model and the cascade say so, so the rest can price a draft token."""
    from tokenleap.spec.proposers.cascade import CascadeDraftProposer

    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    draft = (CascadeDraftProposer if cascade else DraftModelProposer)(target, VOCAB, 128)
    draft.begin(0, PROMPTS[2])  # not prefilled: the first proposal feeds the whole prompt
    d = draft.propose(0, PROMPTS[2], 4, greedy, None)
    assert d.catch_up_seconds > 0 and d.catch_up_tokens == len(PROMPTS[2])
    assert len(d.tokens) == 4 and d.catch_up_drafted == 1
    draft.accept(0, 4)
    d = draft.propose(0, PROMPTS[2] + d.tokens + [11], 3, greedy, None)  # one token behind: no backlog
    assert d.catch_up_seconds == 0.0 and d.catch_up_drafted == 0 and len(d.tokens) == 3


def test_a_step_that_caught_up_still_times_its_later_draft_tokens(target):
    """A probe after plain steps catches the draft up first. Its tokens drafted after the catch-up
    are timed into the draft cost, so a figure caught at a slow moment is re-measured by probes
    rather than kept until drafting resumes (which that figure may forbid)."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    draft = DraftModelProposer(target, VOCAB, 128)
    eng = engine(target, draft)
    eng.controller.draft_cost = 10.0  # a figure timed through a stall: the draft's prefill is skipped
    eng.controller.observe_forward(1, 0.01)
    seq = eng.add(PROMPTS[0], params)
    while eng.prefill_step(seq):
        pass
    eng.controller.draft_cost = 0.0
    report = eng.step([seq])
    work = report.draft
    assert report.k >= 2 and work.catch_up_tokens > 0 and work.catch_up_drafted == 1
    timed = eng.controller._draft_obs[1]
    assert list(timed)[-1] == pytest.approx(work.seconds / (work.tokens - 1)) and len(timed) == 2
    eng.release(seq)


def test_a_request_alone_starts_from_the_prior_acceptance_and_feeds_the_draft(target):
    """Acceptance learned on earlier requests describes their text: a request that starts alone
    restarts from the prior, feeds the draft, and its own steps decide (here a self-draft: every
    token accepted). A request that joins another keeps what was learned; and where drafting
    could not pay even at full acceptance, the lone request's draft prefill is still skipped."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = plain(target, PROMPTS[0], params).generated
    draft = DraftModelProposer(target, VOCAB, 128, num_slots=2)
    # (a random toy draft is unsure of every token: no confidence stops, so that its acceptance decides)
    eng = Engine(target, ToyTokenizer(VOCAB, (2,)), max_len=128, num_slots=2, proposer=draft,
                 controller=ControllerConfig(max_k=6, confidence_stop=False))
    c = eng.controller
    for rows in range(1, 10):
        c.observe_forward(rows, 0.01)
    c.draft_cost = 0.001
    # the steps' measured times are left out, so that acceptance alone decides: a toy forward takes
    # 0.3-10 ms by the machine's load, and a fast one-row figure beside the seeded multi-row ones
    # makes drafting look dear
    for timing in ("observe_forward", "observe_draft", "observe_draft_after_catch_up", "observe_catch_up",
                   "observe_step"):
        setattr(c, timing, lambda *args, **kwargs: None)

    def learn_poor_acceptance():
        for _ in range(30):  # an earlier request's text: no drafted token accepted
            c.observe_acceptance(6, 0)
        assert not c.would_speculate(1) and c.could_pay(1)

    learn_poor_acceptance()
    seq = eng.add(PROMPTS[0], params)
    assert c.accept == [c.cfg.prior_acceptance] * 6 and draft._fed[seq.seq_id] == len(PROMPTS[0])
    while not seq.finished:
        eng.step([seq])
    assert seq.generated == want and seq.stats.tau > 2.0

    learn_poor_acceptance()
    before = list(c.accept)
    joining = eng.add(PROMPTS[1], params)  # beside a running request: nothing forgotten, nothing fed
    assert c.accept == before and draft._fed[joining.seq_id] == 0
    eng.release(seq)
    eng.release(joining)

    c.draft_cost = 10.0  # drafting cannot pay at all: a lone request skips the draft prefill still
    alone = eng.add(PROMPTS[2], params)
    assert draft._fed[alone.seq_id] == 0
    eng.release(alone)


def test_a_step_whose_draft_also_caught_up_records_no_draft_cost(target):
    """A draft forward that feeds one sequence's backlog beside another's draft counts as catch-up
    whole, so the step's drafting would look almost free: it records no draft-cost figure; the
    next step, with nothing to catch up, does."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    draft = DraftModelProposer(target, VOCAB, 128, num_slots=2)
    eng = Engine(target, ToyTokenizer(VOCAB, (2,)), max_len=128, num_slots=2, proposer=draft,
                 controller=ControllerConfig(max_k=6))
    fed = eng.add(PROMPTS[0], params)  # the draft prefills it alongside
    eng.controller.draft_cost = 10.0  # then speculation is predicted not to pay: the draft skips a prompt
    eng.controller.observe_forward(1, 0.01)
    skipped = eng.add(PROMPTS[1], params)
    assert draft.backlog(skipped.seq_id, skipped.tokens) > 0 and draft.backlog(fed.seq_id, fed.tokens) == 0
    eng.step([fed, skipped], 2)
    assert 2 not in eng.controller.draft_cost_at and eng.controller.catch_up_cost is not None
    eng.step([fed, skipped], 2)
    assert eng.controller.draft_cost_at[2] > 0
    for s in (fed, skipped):
        eng.release(s)


def _finished(eng, n: int, reason: str) -> None:
    """Record a sequence that generated ``n`` tokens and ended for ``reason``."""
    seq = eng.create(PROMPTS[1], SamplingParams(max_tokens=200))
    seq.tokens += [5] * n
    seq.finish_reason = reason
    eng.release(seq)


def test_expected_remaining_follows_recently_finished_lengths(target):
    """What a catch-up is weighed against: max_tokens left until sequences have finished, then the
    median length (the lower middle of an even count) of finished ones that ran longer and of twice
    what was generated, less what was generated (capped by max_tokens)."""
    eng = engine(target)
    long = eng.create(PROMPTS[0], SamplingParams(max_tokens=100))
    assert eng.expected_remaining(long) == 100  # nothing finished yet
    for n in (6, 10, 12):
        _finished(eng, n, "stop")
    assert eng.expected_remaining(long) == 10
    long.tokens += [5] * 8  # 8 generated: finished lengths above that are 10 and 12, and the guess 16
    assert eng.expected_remaining(long) == 12 - 8
    long.tokens += [5] * 12  # 20 generated, longer than any finished one: as many again, capped
    assert eng.expected_remaining(long) == 20
    assert eng.expected_remaining(eng.create(PROMPTS[0], SamplingParams(max_tokens=4))) == 4
    cancelled = eng.add(PROMPTS[2], SamplingParams(max_tokens=50))
    eng.release(cancelled)  # an aborted sequence says nothing about lengths
    assert eng.expected_remaining(eng.create(PROMPTS[0], SamplingParams(max_tokens=100))) == 10


def test_a_sequence_cut_off_by_max_tokens_counts_as_at_least_that_long(target):
    """A short request stopped by its max_tokens (a warm-up) says the text would have gone on: it
    must not cap the prediction for a longer request at its own length, and once the longer one
    has passed it, it says nothing."""
    eng = engine(target)
    run(eng, PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True))  # cut off at 8
    long = eng.create(PROMPTS[0], SamplingParams(max_tokens=100))
    assert eng.expected_remaining(long) == 100
    long.tokens += [5] * 20
    assert eng.expected_remaining(long) == 80  # nothing known: max_tokens left
    for n in (30, 40, 50):
        _finished(eng, n, "stop")
    assert eng.expected_remaining(long) == 40 - 20  # the cut-off one is shorter: ignored
    _finished(eng, 60, "length")
    _finished(eng, 70, "length")
    _finished(eng, 80, "length")
    assert eng.expected_remaining(long) == 50 - 20  # median of 30, 40, 50, >= 60, >= 70, >= 80, the guess 40
    eng = engine(target)
    _finished(eng, 50, "stop")
    _finished(eng, 60, "length")
    short = eng.create(PROMPTS[0], SamplingParams(max_tokens=128))
    assert eng.expected_remaining(short) == 50  # of 50 and one cut off (>= 60): the lower, not unbounded
    short.tokens += [5] * 55
    assert eng.expected_remaining(short) == 110 - 55  # only a cut-off one ran longer: the guess, not the limit


def test_newcomers_skip_the_draft_prefill_when_their_batch_would_not_speculate(target):
    """The draft prefill of a new sequence is judged at the batch it joins (every sequence holding
    a slot), not at the size of the last step: two requests arriving together in a batch where
    speculation does not pay leave the draft idle; a request alone feeds it alongside."""
    draft = DraftModelProposer(target, VOCAB, 128, num_slots=2)
    eng = Engine(target, ToyTokenizer(VOCAB, (2,)), max_len=128, num_slots=2, proposer=draft,
                 controller=ControllerConfig(max_k=6))
    for rows in range(1, 15):  # two rows as cheap as one, then compute-bound
        eng.controller.observe_forward(rows, max(1.0, rows / 2))
    eng.controller.draft_cost = 0.0
    assert eng.controller.would_speculate(1) and not eng.controller.would_speculate(2)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    pair = [eng.create(p, params) for p in PROMPTS[:2]]
    for seq in pair:
        eng.attach(seq)
    for seq in pair:
        while eng.prefill_step(seq):
            pass
    assert [draft._fed[s.seq_id] for s in pair] == [0, 0]
    eng.release(pair[1])
    alone = eng.add(PROMPTS[2], params)  # joins a batch of two again: still skipped
    assert draft._fed[alone.seq_id] == 0
    eng.release(pair[0])
    eng.release(alone)
    alone = eng.add(PROMPTS[2], params)
    assert draft._fed[alone.seq_id] == len(PROMPTS[2])
    eng.release(alone)


def test_a_long_backlog_is_caught_up_a_chunk_per_step(target):
    """A draft that skipped a long prompt feeds it ``catch_up_chunk`` tokens a step, drafting
    nothing for that sequence meanwhile (so the others of its batch are not stalled), then drafts;
    the output equals plain greedy decoding."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompt = (PROMPTS[0] * 4)[:30]
    want = plain(target, prompt, params).generated
    draft = DraftModelProposer(target, VOCAB, 128, catch_up_chunk=8)
    eng = engine(target, draft, k=2)
    seq = eng.create(prompt, params)
    eng.attach(seq)
    while eng.prefill_step(seq, draft_alongside=False):
        pass
    assert draft._fed[seq.seq_id] == 0 and draft.backlog(seq.seq_id, seq.tokens) == len(seq.tokens) - 2
    fed = []
    while not seq.finished:
        eng.step([seq])
        fed.append(draft._fed[seq.seq_id])
    # 31 tokens after the prefill, one more each plain step: 8 fed a step while more than 8 are
    # missing (steps 1-4), then the rest with the first draft
    assert fed[:4] == [8, 16, 24, 32] and seq.stats.target_forwards < 16
    assert seq.stats.draft_steps > 0 and seq.stats.tau > 1.0
    assert seq.generated == want
    eng.release(seq)


def test_draft_prefilled_alongside_when_speculation_is_expected(target):
    draft = DraftModelProposer(target, VOCAB, 128)
    eng = engine(target, draft)
    assert eng.controller.would_speculate(1)  # nothing measured yet: drafting is expected to pay
    seq = eng.add(PROMPTS[1], SamplingParams(max_tokens=4))
    eng.prefill_step(seq)
    assert draft._fed[seq.seq_id] == len(PROMPTS[1])
    assert eng.controller.catch_up_cost is not None  # the draft's prefill measured, per token
    d = draft.propose(seq.seq_id, seq.tokens, 2, seq.params, None)
    assert d is not None and d.catch_up_seconds == 0.0
    eng.release(seq)


@pytest.mark.parametrize("reduced_head", [False, True])
def test_batched_drafting_equals_one_sequence_at_a_time(target, reduced_head):
    """propose_many drafts every sequence's position j in one forward; the drafts equal those of
    separate proposals, and sequences stepped together still decode exactly as plain greedy."""
    from tokenleap.spec.proposers.base import DraftRequest
    from tokenleap.spec.proposers.draft_head import ReducedVocabHead

    draft_model = tiny_model("qwen2", seed=78, vocab=VOCAB)
    head = ReducedVocabHead(draft_model.lm_head, static_size=40, special_ids=[2]) if reduced_head else None
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)

    def proposer():
        return DraftModelProposer(draft_model, VOCAB, 128, num_slots=3, head=head)

    batched, single = proposer(), proposer()
    for i, p in enumerate(PROMPTS):
        batched.begin(i, p)
        single.begin(i, p)
    batched.prefill(0, PROMPTS[0])  # lanes start with different backlogs: 1 token, a whole prompt
    single.prefill(0, PROMPTS[0])
    reqs = [DraftRequest(i, p + [7], k, greedy) for i, (p, k) in enumerate(zip(PROMPTS, (3, 1, 4)))]
    got = batched.propose_many(reqs)
    want = [single.propose(r.seq_id, r.tokens, r.k, r.params, None) for r in reqs]
    assert [d.tokens for d in got] == [d.tokens for d in want]
    assert [len(d.tokens) for d in got] == [3, 1, 4]
    assert got[0].catch_up_seconds == 0.0 and got[1].catch_up_seconds > 0.0

    eng = Engine(target, ToyTokenizer(VOCAB, (2,)), max_len=128, num_slots=3, proposer=proposer(),
                 controller=ControllerConfig(max_k=4, fixed_k=3))
    seqs = [eng.add(p, greedy) for p in PROMPTS]
    for s in seqs:
        while eng.prefill_step(s):
            pass
    while not all(s.finished for s in seqs):
        eng.step(seqs)
    for s, p in zip(seqs, PROMPTS):
        assert s.generated == plain(target, p, greedy).generated
    assert 3 in eng.controller.draft_cost_at  # drafting cost measured for a batch of three


def test_draft_out_of_cache_blocks_mid_proposal_forgets_its_drafted_tokens():
    """A paged draft cache running out of blocks at draft position 2 yields no draft, and the
    draft tokens already fed are not kept as if they were the sequence's."""
    from tokenleap.cache.paged import PagedKVCache

    draft_model = tiny_model("qwen2", seed=78, vocab=VOCAB)
    cache = PagedKVCache(draft_model.config, 2, 64, torch.float32, block_size=4, num_slots=1)  # 8 tokens
    draft = DraftModelProposer(draft_model, VOCAB, 64, cache=cache)
    tokens = [5, 9, 14, 3, 7, 9, 14]  # 7 tokens: drafts 1 and 2 are fed into the 8th place, draft 3 fails
    draft.begin(0, tokens)
    assert draft.propose(0, tokens, 3, SamplingParams(max_tokens=8), None) is None
    assert draft._fed[0] == len(tokens) and cache.lengths[draft._slot[0]] == len(tokens)


def test_engine_reports_step_overhead_to_the_controller(target):
    eng = engine(target, NgramProposer(3, 1))
    run(eng, PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
    table = eng.controller.step_overhead  # (speculative?, batch) -> seconds beyond the forwards
    assert table and set(k[1] for k in table) == {1} and all(v >= 0 for v in table.values())


def test_packed_bf16_weights_replace_the_float_copy():
    """What --dtype bfloat16 loads on CPUs without native bf16: each weight matrix kept once, in the
    kernel's packed layout (the LM head, tied to the embedding, is kept); nothing computed changes."""
    from tokenleap import kernels
    from tokenleap.models.build import float32_activations_, pack_bf16_weights_
    from tokenleap.models.quant import weight_bytes
    if not kernels.available():
        pytest.skip("tokenleap's kernels are not available here")
    target = float32_activations_(tiny_model("qwen2", seed=4, vocab=VOCAB, dtype=torch.bfloat16, hidden=128,
                                             intermediate=256))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = plain(target, PROMPTS[0], params).generated
    before = weight_bytes(target)
    released = pack_bf16_weights_(target)
    layers = target.config.num_hidden_layers
    assert released == 7 * layers  # q, k, v, o, gate, up, down of every layer
    assert all(m.weight.numel() == 0 for m in target.model.layers.modules() if hasattr(m, "_packed"))
    assert target.lm_head.weight.numel() > 0 and weight_bytes(target) == before
    assert plain(target, PROMPTS[0], params).generated == want
    assert run(engine(target, DraftModelProposer(target, VOCAB, 128), 4), PROMPTS[0], params).generated == want


def test_starting_an_engine_keeps_the_loaded_objects_out_of_garbage_collections(target, monkeypatch):
    """Full collections skip what was alive when the engine started (the model's module tree), so a
    collection mid-generation does not walk the ~300k objects loading leaves; TOKENLEAP_GC_FREEZE=0
    leaves the collector alone."""
    import gc

    gc.unfreeze()
    assert any(o is target for o in gc.get_objects())
    engine(target)
    assert gc.get_freeze_count() > 0
    assert not any(o is target for o in gc.get_objects())  # in the permanent generation now
    gc.unfreeze()
    monkeypatch.setenv("TOKENLEAP_GC_FREEZE", "0")
    engine(target)
    assert gc.get_freeze_count() == 0 and any(o is target for o in gc.get_objects())


def test_ngram_lookup_drafts_from_two_token_matches_by_default(tmp_path):
    """A one-token suffix match rarely predicts the next tokens, so by default n-gram lookup drafts
    only from matches of 2..ngram_max tokens (ngram_min=1 restores the one-token ones); a
    --ngram-max below the default minimum lowers the minimum with it."""
    import argparse

    from tokenleap.cli.main import build_parser, spec_config
    from tokenleap.config import SpecConfig
    one = [1, 2, 3, 9, 4, 5, 6, 1, 9]  # the suffix (9) occurred before, (1, 9) did not
    two = [1, 2, 3, 9, 4, 5, 6, 3, 9]  # the suffix (3, 9) occurred before
    default, unigram = NgramProposer(), NgramProposer(4, 1)
    for p in (default, unigram):
        p.begin(0, [])
        p.begin(1, [])
    assert default.propose(0, one, 3, None, None) is None
    assert unigram.propose(0, one, 3, None, None).tokens == [4, 5, 6]
    assert default.propose(1, two, 3, None, None).tokens == [4, 5, 6]
    assert SpecConfig().ngram_min == 2 and NgramProposer(1).ngram_min == 1
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")

    def spec(*flags: str) -> SpecConfig:
        argv = ["generate", "--model", str(gguf), "--prompt", "x", *flags]
        args: argparse.Namespace = build_parser().parse_args(argv)
        return spec_config(args)

    assert spec("--spec", "ngram").ngram_min == 2
    assert spec("--spec", "ngram", "--ngram-max", "1").ngram_min == 1
    assert spec("--spec", "ngram", "--ngram-min", "1").ngram_min == 1


def test_top_k_minus_one_disables_it_as_in_vllm():
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    with pytest.raises(ConfigError, match="top_k must be"):
        SamplingParams(top_k=-2)
