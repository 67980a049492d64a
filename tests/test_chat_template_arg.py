"""``--chat-template`` / ``LLM(chat_template=...)`` (vLLM's and llama.cpp's): a Jinja template, given
as a file or as its text, renders chats instead of the model's own; its turn-end token stops replies;
a template that does not parse, or a value that is neither, is refused before the model loads."""
from __future__ import annotations

import json

import pytest

from tokenleap.cli.main import main
from tokenleap.cli.serve import build_engine
from tokenleap.models import pretrained
from tokenleap.text.tokenizer import ChatTemplateError, Tokenizer, read_chat_template

from test_tokenizer import CHATML, tiny_metadata

PLAIN = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


def _tokenizer(template: str) -> Tokenizer:
    md = tiny_metadata(**{"tokenizer.chat_template": template})
    md["tokenizer.ggml.eos_token_id"] = md["tokenizer.ggml.tokens"].index("<|endoftext|>")
    return Tokenizer.from_gguf_metadata(md)


def test_a_template_replaces_the_models_and_its_turn_end_stops():
    tok = _tokenizer("[{{ messages[0]['content'] }}]")
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end not in tok.eos_token_ids
    tok.use_chat_template(CHATML)
    assert tok.chat_template == CHATML and im_end in tok.eos_token_ids
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user")
    with pytest.raises(ChatTemplateError, match="the chat template given does not parse"):
        tok.use_chat_template("{% for m in messages %}")
    assert tok.chat_template == CHATML  # (a refused one changes nothing)
    tok.use_chat_template(PLAIN)  # a given template's turn end goes with it
    assert im_end not in tok.eos_token_ids


def test_the_models_own_turn_end_stays_a_stop():
    tok = _tokenizer(CHATML)  # (its fine-tuning writes <|im_end|> whatever template renders the prompt)
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end in tok.eos_token_ids
    tok.use_chat_template(PLAIN)
    assert tok.chat_template == PLAIN and im_end in tok.eos_token_ids


def test_a_file_or_the_templates_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("\ufeff" + PLAIN, encoding="utf-8")  # (an editor's byte-order mark: not template text)
    assert read_chat_template(str(path)) == PLAIN == read_chat_template(PLAIN)
    with pytest.raises(ChatTemplateError, match="no such file, and not a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match="the chat template given does not parse"):
        read_chat_template("{% for m in messages %}")  # (so refused before a model loads)
    long = "{% for m in messages %}" + "x" * 400 + "{% endfor %}"  # (longer than a file name may be)
    assert read_chat_template(long) == long
    with pytest.raises(ChatTemplateError, match="cannot read the chat template file"):
        read_chat_template("y" * 400)


def test_generate_and_serve_render_with_it(smollm2_gguf, tmp_path, capsys):
    path = tmp_path / "t.jinja"
    path.write_text(PLAIN, encoding="utf-8")
    code = main(["generate", "--model", str(smollm2_gguf), "--chat", "--chat-template", str(path), "--prompt", "hi",
                 "--max-tokens", "2", "--json", "--cache-dir", str(tmp_path / "c")])
    out = json.loads(capsys.readouterr().out)
    model = pretrained.load_model(smollm2_gguf, cache_dir=tmp_path / "c")
    assert code == 0 and out["prompt_tokens"] == len(model.tokenizer.encode("<<hi>>"))
    engine = build_engine(str(smollm2_gguf), cache_dir=str(tmp_path / "c"), chat_template=PLAIN, max_model_len=64)
    assert engine.tokenizer.chat_template == PLAIN
    code = main(["generate", "--model", str(smollm2_gguf), "--chat", "--chat-template", "nothing.jinja",
                 "--prompt", "hi", "--cache-dir", str(tmp_path / "c")])
    assert code != 0 and "no such file" in capsys.readouterr().err


def test_apply_chat_template_tokenize_gives_ids_as_transformers_does():
    tok = _tokenizer(CHATML)
    messages = [{"role": "user", "content": "the"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False)
    ids = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    assert isinstance(text, str) and ids == tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    # a request's template variables (chat_template_kwargs) cannot turn the rendered prompt into ids
    assert tok.encode_chat(messages, tokenize=True) == tok.encode_chat(messages)
