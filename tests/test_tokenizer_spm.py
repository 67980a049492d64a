"""SentencePiece GGUF tokenizers: tiny vocabularies written as GGUF files, checked against the
tokenizer transformers builds from the same file (ids, decoded text, BOS), for each family's style."""
from __future__ import annotations

import os
import random

import pytest

from tokenleap.errors import ModelFormatError
from tokenleap.text.gguf_tokenizer import read_gguf_tokenizer_metadata, write_tokenizer_files
from tokenleap.text.tokenizer import Tokenizer
from tokenleap.text.sentencepiece import merges_from_vocab

gguf = pytest.importorskip("gguf")

# normal pieces, best first (scores fall with the position); the space and newline runs are user-defined
PIECES = ["▁", "t", "h", "e", "a", "b", "c", "▁t", "he", "▁the", "ab", "▁a", "▁ab", "abc", "é", "中",
          "\n", "  ", "   ", "\n\n"]
USER_DEFINED = ("\n\n", "  ", "   ")
TEXTS = ["the", " the  ab\n\n\nabc", "  x é中 😀", "<|im_end|>the<think> ab", "", "   ", "he<unk>c",
         "\tab\r\nc  \n", "abcabc ▁the", "😀中é", "a" * 9 + " " * 7 + "b"]


def spm_metadata(arch: str = "llama", **overrides):
    """A small SentencePiece vocabulary shaped like GGUF metadata: specials, 256 byte pieces, pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES + ["<|im_end|>", "<think>"]
    types = [2, 3, 3] + [6] * 256 + [4 if p in USER_DEFINED else 1 for p in PIECES] + [3, 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(PIECES))] + [0.0, 0.0]
    md = {"general.architecture": arch, "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    md.update(overrides)
    return {k: v for k, v in md.items() if v is not None}


def write_gguf(md, path):
    """A GGUF holding the tokenizer and just enough model config for transformers to read it."""
    w = gguf.GGUFWriter(str(path), md["general.architecture"])
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model(md["tokenizer.ggml.model"])
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_scores(md["tokenizer.ggml.scores"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_bos_token_id(md["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])
    w.add_unk_token_id(md["tokenizer.ggml.unknown_token_id"])
    if "tokenizer.ggml.add_bos_token" in md:
        w.add_add_bos_token(md["tokenizer.ggml.add_bos_token"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = ["a", "b", "c", "t", "h", "e", " ", "  ", "\n", "\t", "é", "中", "😀", "<s>", "<think>", "x"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20))) for _ in range(n)]


@pytest.mark.parametrize("arch, model", [("llama", "llama"), ("mistral", "llama"), ("gemma3", "llama"),
                                         ("phi3", "llama"), ("gemma4", "gemma4")])
def test_ids_and_text_match_transformers(tmp_path, arch, model):
    transformers = pytest.importorskip("transformers", minversion="5.0")  # the conversion compared against
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    md = spm_metadata(arch, **{"tokenizer.ggml.model": model})
    write_gguf(md, tmp_path / "t.gguf")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    write_tokenizer_files(read_gguf_tokenizer_metadata(tmp_path / "t.gguf"), tmp_path / "tok")
    tok = Tokenizer.from_dir(tmp_path / "tok")
    assert tok.vocab_size == len(md["tokenizer.ggml.tokens"])
    assert tok.add_bos_token == (model != "gemma4")  # SentencePiece adds BOS unless told not to; gemma4 never
    for text in TEXTS + _random_texts(120):
        ids = tok.encode(text)
        assert ids == ref.encode(text), repr(text)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), repr(text)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids), repr(text)


def test_pieces_bytes_and_specials():
    tok = Tokenizer.from_gguf_metadata(spm_metadata("gemma3"))
    spell = [tok.id_to_token(i) for i in tok.encode(" the  \n\n\n😀", add_special_tokens=False)]
    # a space run is a piece (respelled "▁▁"), "\n\n" a user-defined token, the emoji four byte pieces
    assert spell == ["▁the", "▁▁", "\n\n", "\n", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    for text in TEXTS + _random_texts(60, seed=2):  # no space prefix: token bytes join to the text
        ids = tok.encode(text, add_special_tokens=False)
        want = text.replace("▁", " ").encode("utf-8")  # a literal "▁" is a space to SentencePiece
        assert b"".join(tok.token_bytes(i) for i in ids) == want, repr(text)
    assert tok.token_bytes(tok.token_to_id("<think>")) == b"<think>"
    assert tok.token_bytes(tok.eos_token_id) == b"</s>"
    assert tok.encode("<|im_end|>")[-1] == tok.token_to_id("<|im_end|>")
    assert tok.decode(tok.encode("<|im_end|>a")) == "a"  # control tokens are special

    llama = Tokenizer.from_gguf_metadata(spm_metadata("llama"))
    ids = llama.encode("the the", add_special_tokens=False)
    assert [llama.id_to_token(i) for i in ids] == ["▁the", "▁the"]  # the space prefix
    assert llama.token_bytes(ids[0]) == b" the" and llama.decode(ids) == "the the"
    no_prefix = Tokenizer.from_gguf_metadata(spm_metadata("llama", **{"tokenizer.ggml.add_space_prefix": False,
                                                                      "tokenizer.ggml.add_bos_token": False}))
    assert [no_prefix.id_to_token(i) for i in no_prefix.encode("the the")] == ["t", "he", "▁the"]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_streamed_text_equals_full_decode(arch):
    """The detokenizer decodes a sliding window: a decoder that strips the prefix space (llama,
    phi3) must not eat the spaces between windows."""
    tok = Tokenizer.from_gguf_metadata(spm_metadata(arch))
    for text in TEXTS + _random_texts(40, seed=4):
        ids = tok.encode(text)
        for skip in (True, False):
            detok = tok.detokenizer(skip_special_tokens=skip)
            streamed = "".join(detok.add(i) for i in ids) + detok.flush()
            assert streamed == tok.decode(ids, skip_special_tokens=skip), (arch, text)


def test_file_merges_are_used_when_present():
    md = spm_metadata("llama", **{"tokenizer.ggml.merges": ["▁ t", "h e"]})  # no "▁t he": "▁the" unreachable
    tok = Tokenizer.from_gguf_metadata(md)
    assert [tok.id_to_token(i) for i in tok.encode("the", add_special_tokens=False)] == ["▁t", "he"]
    with pytest.raises(ModelFormatError, match="inconsistent"):
        Tokenizer.from_gguf_metadata(spm_metadata("llama", **{"tokenizer.ggml.merges": ["q zz"]}))


def test_merges_from_vocab_match_transformers_ordering():
    """Ranks with ties, repeated lengths: the same merge list transformers derives."""
    pytest.importorskip("transformers", minversion="5.0")
    from transformers import tokenization_utils_base as tub
    rng = random.Random(5)
    letters = "abcde"
    pieces = list(letters) + list(dict.fromkeys(
        "".join(rng.choice(letters) for _ in range(rng.randint(2, 5))) for _ in range(300)))
    rank = {p: float(rng.randint(-6, 0)) for p in pieces}  # many ties
    want = tub.generate_merges({p: i for i, p in enumerate(pieces)}, rank)
    assert len(want) > 100
    assert merges_from_vocab(pieces, rank) == want


def test_bad_sentencepiece_metadata_is_refused():
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata(spm_metadata("llama", **{"tokenizer.ggml.scores": None}))
    with pytest.raises(ModelFormatError, match="encoder-decoder"):
        Tokenizer.from_gguf_metadata(spm_metadata("t5", **{"tokenizer.ggml.model": "t5"}))
    with pytest.raises(ModelFormatError, match="token_type and tokens differ"):
        Tokenizer.from_gguf_metadata(spm_metadata("llama", **{"tokenizer.ggml.token_type": [1]}))
