"""A draft model with another tokenizer (proposers/cross_tokenizer.py): drafts go through text.

Two small BPE tokenizers over the same letters, with different merges, give a tiny target and a
tiny draft different vocabularies. Greedy and seeded output equal plain decoding; unseeded
sampling keeps the target's exact distribution (chi-square over every continuation, with a biased
verifier rejected at the same sample size); the text mapping keeps committed tokens, drops the
last (maybe partial) token and falls back where the context would re-tokenize differently; the
draft cache rolled back to the re-tokenized text drafts what a fresh draft would."""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models

import tokenleap.spec.engine as engine_mod
import tokenleap.spec.step_verify as step_verify
import test_spec_sampling as sampling_check
from tokenleap.config import SamplingParams
from tokenleap.models.build import build_transformer
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.cross_tokenizer import CrossTokenizerProposer, same_tokenizer
from tokenleap.spec.proposers.draft_model import DraftModelProposer
from tokenleap.spec.sampling import make_generator, sample
from tokenleap.spec.verify import Verification
from tokenleap.text.tokenizer import Tokenizer

from conftest import ToyTokenizer, random_weights, tiny_config, tiny_model

LETTERS = "abcdefgh"


def bpe(alphabet: str, merges: list[tuple[str, str]]) -> Tokenizer:
    """A BPE tokenizer: one token per letter, then one per merge (in merge order)."""
    vocab = {c: i for i, c in enumerate(alphabet)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    return Tokenizer(Backend(models.BPE(vocab=vocab, merges=merges)))


TARGET_TOK = bpe(LETTERS, [("a", "b"), ("c", "d"), ("ab", "c"), ("e", "e")])  # 12 tokens
DRAFT_TOK = bpe(LETTERS, [("b", "c"), ("d", "a"), ("a", "b"), ("g", "h"), ("h", "a")])  # 13 tokens
PROMPTS = ["abcdabcd", "eeffgghh", "hagabcdeabc"]
PARAMS = {
    "greedy": SamplingParams(max_tokens=30, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.9, seed=5),
    "seeded-top-p": SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.2, top_p=0.9, seed=17),
}


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", seed=1, vocab=TARGET_TOK.vocab_size)


@pytest.fixture(scope="module")
def draft():
    return tiny_model("llama", seed=9, vocab=DRAFT_TOK.vocab_size)


def cross(draft, target_tok=TARGET_TOK, draft_tok=DRAFT_TOK, max_len=160):
    return CrossTokenizerProposer(DraftModelProposer(draft, draft.config.vocab_size, max_len), target_tok, draft_tok)


def _engine(target, proposer, vocab, k=4):
    return Engine(target, ToyTokenizer(vocab, eos=()), max_len=160, proposer=proposer,
                  controller=ControllerConfig(max_k=6, fixed_k=k if proposer is not None else None))


def _run(eng, prompt, params):
    *_, (seq, _) = eng.generate(prompt, params)
    return seq


def test_tokenizers_differ_and_are_told_apart():
    assert TARGET_TOK.encode("abcd", add_special_tokens=False) != DRAFT_TOK.encode("abcd", add_special_tokens=False)
    assert not same_tokenizer(TARGET_TOK, DRAFT_TOK)
    assert same_tokenizer(TARGET_TOK, bpe(LETTERS, [("a", "b"), ("c", "d"), ("ab", "c"), ("e", "e")]))
    padded = bpe(LETTERS, [("a", "b"), ("c", "d"), ("ab", "c"), ("e", "e")])
    padded.backend.add_special_tokens([f"[PAD{i}]" for i in range(12, 16)])  # (a GGUF of a padded vocabulary)
    assert padded.vocab_size == TARGET_TOK.vocab_size + 4 and same_tokenizer(TARGET_TOK, padded)


@pytest.mark.parametrize("kind", list(PARAMS))
def test_cross_tokenizer_output_equals_plain(target, draft, kind):
    params = PARAMS[kind]
    vocab = TARGET_TOK.vocab_size
    proposed = 0
    for text in PROMPTS:
        prompt = TARGET_TOK.encode(text, add_special_tokens=False)
        want = _run(_engine(target, None, vocab), prompt, params).generated
        for k in (2, 5):
            seq = _run(_engine(target, cross(draft), vocab, k), prompt, params)
            assert seq.generated == want, (kind, text, k)
            proposed += seq.stats.draft_tokens
    assert proposed > 0  # the draft did propose


def test_paged_draft_cache_gives_plain_output_too(target, draft):
    """The server's setting: the draft's cache paged (blocks freed as it rolls back)."""
    from tokenleap.cache.paged import PagedKVCache
    params = PARAMS["seeded"]
    for text in PROMPTS:
        prompt = TARGET_TOK.encode(text, add_special_tokens=False)
        cache = PagedKVCache(draft.config, 24, 160, torch.float32, block_size=8, num_slots=1)
        inner = DraftModelProposer(draft, draft.config.vocab_size, 160, cache=cache)
        proposer = CrossTokenizerProposer(inner, TARGET_TOK, DRAFT_TOK)
        eng = _engine(target, proposer, TARGET_TOK.vocab_size)
        assert _run(eng, prompt, params).generated == _run(_engine(target, None, TARGET_TOK.vocab_size), prompt,
                                                           params).generated
        assert cache.num_free_blocks == 24  # every block given back at the end


def test_a_cascade_of_another_tokenizer_is_plain_output_and_named_cascade(target, draft):
    """--spec draft --draft-spec ngram with a draft of another tokenizer: n-gram lookup speculates the
    draft's own steps behind the text mapping; output as plain, steps counted as the cascade's."""
    from tokenleap.spec.proposers.cascade import CascadeDraftProposer
    params = PARAMS["seeded"]
    for text in PROMPTS:
        prompt = TARGET_TOK.encode(text, add_special_tokens=False)
        proposer = CrossTokenizerProposer(CascadeDraftProposer(draft, draft.config.vocab_size, 160), TARGET_TOK,
                                          DRAFT_TOK)
        seq = _run(_engine(target, proposer, TARGET_TOK.vocab_size), prompt, params)
        assert seq.generated == _run(_engine(target, None, TARGET_TOK.vocab_size), prompt, params).generated
        assert proposer.name == "cascade" and set(seq.stats.proposer_steps) == {"cascade", "none"}


class _OracleDraft:
    """A stand-in draft that 'predicts' the text a target will write (known in advance) in the
    draft tokenizer's canonical tokens; it keeps no cache, so ``fed`` is whatever it was told."""

    def __init__(self, text: str) -> None:
        self.text, self._fed = text, {}

    def begin(self, seq_id, prompt):
        self._fed[seq_id] = 0

    def fed(self, seq_id):
        return self._fed[seq_id]

    def rewind(self, seq_id, length):
        self._fed[seq_id] = min(self._fed[seq_id], length)

    def prefill(self, seq_id, tokens):
        self._fed[seq_id] = len(tokens)

    def backlog(self, seq_id, tokens):
        return 0

    def propose_many(self, requests):
        from tokenleap.spec.proposers.base import Draft
        out = []
        for r in requests:
            have = b"".join(DRAFT_TOK.token_bytes(t) for t in r.tokens).decode()
            assert self.text.startswith(have), "the draft's context is the committed text"
            rest = DRAFT_TOK.encode(self.text[len(have):], add_special_tokens=False)
            self._fed[r.seq_id] = len(r.tokens) + r.k - 1
            out.append(Draft(tokens=rest[:r.k], probs=None))
        return out

    def end(self, seq_id):
        self._fed.pop(seq_id, None)


def test_a_draft_that_knows_the_text_is_accepted_in_full(target):
    """With one token per letter on the target's side, its tokenization of any text is unique: a
    draft whose text is right must have every proposed token accepted, whatever its own token
    boundaries (the draft's merges cut the text elsewhere)."""
    letters_tok = bpe(LETTERS, [])
    model = tiny_model("qwen2", seed=3, vocab=len(LETTERS))
    params = PARAMS["greedy"]
    prompt = letters_tok.encode("abcdhgab", add_special_tokens=False)
    want = _run(_engine(model, None, len(LETTERS)), prompt, params).generated
    text = "abcdhgab" + "".join(LETTERS[t] for t in want)
    proposer = CrossTokenizerProposer(_OracleDraft(text), letters_tok, DRAFT_TOK)
    seq = _run(_engine(model, proposer, len(LETTERS), k=5), prompt, params)
    assert seq.generated == want
    assert seq.stats.draft_tokens > 0 and seq.stats.draft_acceptance_rate == 1.0
    assert seq.stats.tau > 2  # several tokens a step


def test_text_mapping_keeps_committed_tokens_and_drops_the_last():
    p = cross(tiny_model("llama", seed=9, vocab=DRAFT_TOK.vocab_size))
    ids = lambda s: TARGET_TOK.encode(s, add_special_tokens=False)  # noqa: E731
    ab, c, d = TARGET_TOK.token_to_id("ab"), TARGET_TOK.token_to_id("c"), TARGET_TOK.token_to_id("d")
    # "gg" + "abcabd": in context ["g", "g", "abc", "ab", "d"]; the last ("d") may be partial: dropped
    assert p._target_tokens(ids("gg"), b"abcabd") == [TARGET_TOK.token_to_id("abc"), ab]
    # committed "...a" then "bcd": in context "abcd" would re-tokenize the committed "a" -> the new
    # text alone ("b", "cd"), its last dropped
    committed = ids("ee") + [TARGET_TOK.token_to_id("a")]
    assert p._target_tokens(committed, b"bcd") == [TARGET_TOK.token_to_id("b")]
    assert p._target_tokens(ids("ee"), b"c") == []  # one token of text: nothing sure to propose
    assert p._target_tokens(ids("ee"), b"cdc") == [TARGET_TOK.token_to_id("cd")]
    assert c != d


def test_rolled_back_draft_cache_drafts_what_a_fresh_draft_does(draft):
    """Rounds of proposals, each followed by a partial acceptance and a 'recovered' token: the
    proposal equals that of a new proposer seeing the same tokens with an empty cache (so the
    rollback to the re-tokenized text's common prefix left nothing stale)."""
    live = cross(draft)
    tokens = TARGET_TOK.encode("abcdabcdee", add_special_tokens=False)
    live.begin(0, tokens)
    params = PARAMS["greedy"]
    for rnd in range(10):
        fresh = cross(draft)
        fresh.begin(0, list(tokens))
        want = fresh.propose(0, list(tokens), 5, params, None)
        got = live.propose(0, list(tokens), 5, params, None)
        assert (got and got.tokens) == (want and want.tokens), rnd
        drafted = got.tokens if got else []
        keep = rnd % (len(drafted) + 1)
        tokens += drafted[:keep] + [(rnd * 5) % TARGET_TOK.vocab_size]
        live.accept(0, keep)


# -- unseeded sampling: exactness on a 3-token target (test_spec_sampling's enumeration) --------------------
SMALL_TARGET_TOK = bpe("ab", [("a", "b")])  # a, b, ab: the 3-token vocabulary of test_spec_sampling
SMALL_DRAFT_TOK = bpe("ab", [("b", "a"), ("a", "a")])  # a, b, ba, aa


def _small_draft():
    cfg = tiny_config("llama", vocab=SMALL_DRAFT_TOK.vocab_size, hidden=32, intermediate=64, heads=2, kv_heads=1)
    return build_transformer(cfg, random_weights(cfg, 12, scale=2.0), torch.float32)


def _counts(target, draft, seed, monkeypatch):
    V, n_new = sampling_check.V, sampling_check.N_NEW
    proposer = CrossTokenizerProposer(DraftModelProposer(draft, draft.config.vocab_size, 32),
                                      SMALL_TARGET_TOK, SMALL_DRAFT_TOK)
    eng = Engine(target, ToyTokenizer(V, eos=()), max_len=32, proposer=proposer,
                 controller=ControllerConfig(max_k=3, fixed_k=3))
    gen = torch.Generator().manual_seed(seed)
    monkeypatch.setattr(engine_mod, "request_randomness",
                        lambda _: make_generator(int(torch.randint(0, 2**31, (1,), generator=gen))))
    counts: dict[tuple[int, ...], int] = {}
    drafted = 0
    for _ in range(sampling_check.N_SAMPLES):
        params = SamplingParams(max_tokens=n_new, ignore_eos=True, **sampling_check.PARAMS)
        *_, (seq, _) = eng.generate(sampling_check.PROMPT, params)
        counts[tuple(seq.generated)] = counts.get(tuple(seq.generated), 0) + 1
        drafted += seq.stats.draft_tokens
    assert drafted > sampling_check.N_SAMPLES  # the cross-tokenizer draft proposed throughout
    return counts


def test_unseeded_cross_tokenizer_sampling_matches_target_distribution(monkeypatch):
    target = sampling_check.model(11, 1.0)
    counts = _counts(target, _small_draft(), seed=5, monkeypatch=monkeypatch)
    assert sampling_check.p_value(counts, sampling_check.exact_distribution(target)) > 1e-3


def test_same_check_rejects_a_verifier_that_resamples_from_p(monkeypatch):
    """Negative control: on rejection, draw from p instead of p without the drafted token."""
    def biased(draft_tokens, draft_probs, target_probs, generator=None):
        k = draft_tokens.shape[0]
        u = torch.rand(k, generator=generator, dtype=torch.float64)
        for i in range(k):
            x = int(draft_tokens[i])
            if u[i] >= float(target_probs[i, x]):  # point-mass q: accept with probability p(x)
                tok = int(sample(target_probs[i:i + 1], generator)[0])  # bug: from p, not the residual
                return Verification(draft_tokens[:i].tolist() + [tok], i)
        return Verification(draft_tokens.tolist() + [int(sample(target_probs[k:], generator)[0])], k)

    target = sampling_check.model(11, 1.0)
    monkeypatch.setattr(step_verify, "verify_sampling", biased)
    counts = _counts(target, _small_draft(), seed=5, monkeypatch=monkeypatch)
    assert sampling_check.p_value(counts, sampling_check.exact_distribution(target)) < 1e-6


@pytest.mark.slow
def test_real_smollm2_drafts_for_qwen_coder_1_5b():
    """SmolLM2-135M (49k-token vocabulary) drafting for Qwen2.5-Coder-1.5B (152k): greedy and seeded
    output equal to plain decoding, with drafts accepted."""
    from dataclasses import replace

    from tokenleap.api import LLM
    from tokenleap.config import SpecConfig
    from tokenleap.models import catalog
    for name in ("qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"):
        if catalog.missing_packages(catalog.CATALOG[name]):
            pytest.skip(f"{name} is not installed: {catalog.CATALOG[name].install_command()}")
    spec = SpecConfig(method="draft", draft_model="smollm2-135m-instruct", draft_quant="int4", num_tokens=4)
    llm = LLM("qwen2.5-coder-1.5b-instruct", quant="int4", speculative=spec, max_model_len=1024)
    assert isinstance(llm.proposer, CrossTokenizerProposer)
    plain = LLM.from_loaded(llm.target, max_model_len=1024)
    prompt = "Write a Python function that returns the n-th Fibonacci number, with a docstring."
    greedy = SamplingParams(max_tokens=48)
    got = llm.generate(prompt, greedy, chat=True)[0]
    assert got.token_ids == plain.generate(prompt, greedy, chat=True)[0].token_ids
    assert got.stats["accepted_tokens"] > 0
    seeded = replace(greedy, temperature=0.8, top_p=0.95, seed=11)
    assert llm.generate(prompt, seeded, chat=True)[0].token_ids == plain.generate(prompt, seeded, chat=True)[0].token_ids


@pytest.mark.slow
def test_bench_cross_tokenizer_row_equals_plain(smollm2_gguf, tmp_path):
    """``tokenleap bench --draft`` of another tokenizer (Gemma 3's SentencePiece vocabulary drafting
    for SmolLM2's byte-level BPE): the draft row runs through text and its outputs equal plain's."""
    import json

    from tokenleap.cli.main import main
    from tokenleap.models import catalog
    if catalog.missing_packages(catalog.CATALOG["gemma-3-270m"]):
        pytest.skip("gemma-3-270m is not installed")
    out = tmp_path / "bench"
    rc = main(["bench", "--target", "smollm2-135m-instruct", "--draft", "gemma-3-270m", "--dataset", "chat",
               "--limit", "1", "--max-new-tokens", "24", "--methods", "draft:k=3", "--out", str(out), "--no-progress"])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert {m["name"]: m["status"] for m in results["methods"]} == {"plain": "ok", "draft:k=3": "ok"}
    assert results["equality"]["by_method"]["draft:k=3"]["compared"] == 1
    assert not results["equality"]["mismatches"]
    draft_row = [r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())
                 if r.get("method") == "draft:k=3"]
    assert draft_row and sum(r["stats"]["draft_tokens"] for r in draft_row) > 0  # it did draft


def test_the_draft_model_is_named_where_speculation_is_described(target, draft):
    """--stats and the server's startup line say which draft model drafts, at which precision, and
    whether it drafts through text (another tokenizer)."""
    from tokenleap.cli.serve import _speculation
    from tokenleap.models.pretrained import LoadedModel
    from tokenleap.spec.proposers.base import draft_model_note
    from tokenleap.spec.proposers.factory import draft_proposer
    other = LoadedModel(draft, DRAFT_TOK, torch.float32, "none", "catalog:tiny-draft", None)
    through_text = draft_proposer(other, target.config.vocab_size, 64, target_tokenizer=TARGET_TOK)
    assert draft_model_note(through_text) == "draft model tiny-draft (float32), another tokenizer: drafts through text"
    same = LoadedModel(tiny_model("qwen2", seed=2, vocab=TARGET_TOK.vocab_size), TARGET_TOK, torch.float32, "int4",
                       "hf:/models/d", None)
    chain = draft_proposer(same, target.config.vocab_size, 64, target_tokenizer=TARGET_TOK)
    assert _speculation(chain) == "draft (draft model hf:/models/d (int4))"
