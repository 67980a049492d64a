"""Where ``tokenleap generate`` takes its prompt from (--prompt, - for standard input, --file, a JSONL file),
and a prompts file's prompts all checked before any is generated."""
from __future__ import annotations

import io
import json
import sys

from test_cli import assert_error, run_cli

BASE = ["generate", "--model", "smollm2-135m-instruct", "--max-tokens", "6", "--ignore-eos", "--json"]
PROMPT = "The three primary colors are"


def _stdin(data: bytes) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.BytesIO(data), encoding="latin-1")  # (a locale that is not UTF-8)


def _ids(capsys, *args: str) -> list[list[int]]:
    code, out, err = run_cli(capsys, *BASE, *args)
    assert code == 0, err
    return [json.loads(line)["token_ids"] for line in out.splitlines()]


def test_standard_input_and_a_text_file_give_what_the_flag_gives(capsys, tmp_path, monkeypatch, smollm2_gguf):
    """As llama.cpp's -f, one final line end is dropped (``echo`` and editors end the text with one): the
    prompt's tokens are those of the same text given to --prompt."""
    want = _ids(capsys, "--prompt", PROMPT)
    monkeypatch.setattr(sys, "stdin", _stdin(b"\xef\xbb\xbf" + PROMPT.encode() + b"\r\n"))
    assert _ids(capsys, "--prompt", "-") == want
    (tmp_path / "p.txt").write_text(PROMPT + "\n")
    assert _ids(capsys, "-f", str(tmp_path / "p.txt")) == want == _ids(capsys, "--file", str(tmp_path / "p.txt"))
    assert len(want) == 1 and len(want[0]) == 6
    monkeypatch.setattr(sys, "stdin", _stdin(PROMPT.encode() + b"\n\n"))  # (only one line end goes)
    assert _ids(capsys, "--prompt", "-") != want
    monkeypatch.setattr(sys, "stdin", _stdin(b"  \n"))
    assert_error(capsys, BASE + ["--prompt", "-"], "standard input held no prompt")
    monkeypatch.setattr(sys, "stdin", _stdin(b"Hello \xff\n"))  # (read as UTF-8, whatever the locale)
    assert_error(capsys, BASE + ["--prompt", "-"], "standard input is not UTF-8 text (byte 6)")
    (tmp_path / "empty.txt").write_text("\n")
    assert_error(capsys, BASE + ["--file", str(tmp_path / "empty.txt")], "empty.txt held no prompt")
    assert_error(capsys, BASE + ["--prompt", "hi", "--file", str(tmp_path / "p.txt")], "exactly one of --prompt")
    assert_error(capsys, BASE + ["--file", str(tmp_path / "missing.txt")], "missing.txt")


def test_a_prompts_file_is_checked_whole_before_any_prompt_is_generated(capsys, tmp_path, smollm2_gguf):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hi", "word " * 100, "there")))
    code, out, err = run_cli(capsys, *BASE, "--max-model-len", "64", "--prompts-file", str(prompts))
    assert code == 2 and "p.jsonl, prompt 2 of 3: the prompt has" in err
    assert out == ""  # (the first prompt was not generated, then the run cut short)
