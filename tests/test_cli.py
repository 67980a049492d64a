"""The command line: bad input gets one clear message and a non-zero exit, never a traceback;
greedy output on the real SmolLM2 equals Hugging Face transformers' greedy output."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest
import torch

from tokenleap.cli.main import main, read_prompts_file

from test_gguf import tiny_state, write_tiny_gguf


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def assert_error(capsys, args, *needles):
    code, out, err = run_cli(capsys, *args)
    assert code != 0
    assert "Traceback" not in err
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"


def test_unknown_model(capsys):
    assert_error(capsys, ["generate", "--model", "no-such-model", "--prompt", "hi"],
                 "--model 'no-such-model' is neither a catalog model")


def test_truncated_gguf(capsys, tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", tiny_state("llama"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    assert_error(capsys, ["generate", "--model", str(cut), "--prompt", "hi", "--cache-dir", str(tmp_path)],
                 "truncated", str(cut))


def test_unsupported_architecture(capsys, tmp_path):
    path = write_tiny_gguf(tmp_path / "f.gguf", "falcon", tiny_state("llama"), permute=False)
    assert_error(capsys, ["generate", "--model", str(path), "--prompt", "hi", "--cache-dir", str(tmp_path)],
                 "falcon")


@pytest.mark.parametrize("flag,value,needle", [
    ("--temperature", "-1", "--temperature must be >= 0"),
    ("--top-p", "0", "--top-p must be in (0, 1]"),
    ("--top-p", "1.5", "--top-p must be in (0, 1]"),
    ("--top-k", "-2", "--top-k must be an integer >= 0"),
    ("--max-tokens", "0", "--max-tokens must be an integer >= 1"),
    ("--logprobs", "30", "--logprobs must be an integer in [0, 20]"),
    ("--presence-penalty", "5", "--presence-penalty must be in [-2, 2]"),
    ("--min-tokens", "500", "--min-tokens must be an integer in [0, --max-tokens]"),
    # accepted by a looser check once, then an overflow, a division by zero or an hour of bookkeeping
    ("--temperature", "1e39", "--temperature must be >= 0 and fit a 32-bit float"),
    ("--repetition-penalty", "1e-300", "--repetition-penalty must be in [1e-6, 1e6]"),
    ("--max-spec-tokens", "1000000", "--max-spec-tokens must be an integer in 1 .. 256"),
    ("--num-spec-tokens", "1000", "--num-spec-tokens must be 'auto' or an integer in 1 .. 256"),
])
def test_invalid_sampling_values(capsys, flag, value, needle):
    spec = ["--spec", "ngram"] if flag == "--max-spec-tokens" else []  # (a tuning flag: with a method that reads it)
    assert_error(capsys, ["generate", "--model", "smollm2-135m-instruct", "--prompt", "hi", flag, value, *spec], needle)


def test_a_skip_list_past_any_model_is_refused_before_it_is_built(capsys):
    assert_error(capsys, ["generate", "--model", "smollm2-135m-instruct", "--prompt", "hi", "--spec", "layerskip",
                          "--skip-layers", "0-999999999"], "goes past any model's layers")


def test_a_reader_that_goes_away_ends_the_output_quietly():
    """`tokenleap generate ... | head -c 5`: the closed pipe ends the command without a traceback."""
    cmd = [sys.executable, "-m", "tokenleap.cli.main", "generate", "--model", "smollm2-135m-instruct", "--prompt",
           "Count to one hundred.", "--max-tokens", "200", "--ignore-eos"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(proc.stdout.read(5)) == 5
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141 and b"Traceback" not in err, err.decode()


def test_a_cache_that_cannot_be_written_is_one_line_naming_the_file(capsys, tmp_path, monkeypatch):
    """An OSError on a file (a read-only cache, a directory where a file should be) ends the command
    with one line naming the file -- for one in tokenleap's cache, what to do -- not a traceback."""
    from tokenleap import api
    from tokenleap.cli.main import main
    inside = tmp_path / "converted" / "model.safetensors"

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system", str(inside))
    monkeypatch.setattr(api, "LLM", read_only)
    argv = ["generate", "--model", "smollm2-135m-instruct", "--prompt", "hi", "--cache-dir", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"Read-only file system: {inside} (in tokenleap's cache {tmp_path}" in err
    monkeypatch.setattr(api, "LLM", lambda *a, **k: (_ for _ in ()).throw(IsADirectoryError(
        21, "Is a directory", "/elsewhere/x.gguf")))
    assert main(argv) == 2
    assert capsys.readouterr().err == "tokenleap: error: Is a directory: /elsewhere/x.gguf\n"
    # a parent of the cache that cannot be made (a read-only home): what to do as well
    monkeypatch.setattr(api, "LLM", lambda *a, **k: (_ for _ in ()).throw(PermissionError(
        13, "Permission denied", str(tmp_path / "home"))))
    assert main([*argv[:-1], str(tmp_path / "home" / ".cache" / "tokenleap")]) == 2
    assert "Permission denied: " in (err := capsys.readouterr().err) and "TOKENLEAP_CACHE or --cache-dir" in err
    for e in (OSError(28, "No space left on device"), OSError(9, "Bad file descriptor", 987)):  # no file named
        monkeypatch.setattr(api, "LLM", lambda *a, **k: (_ for _ in ()).throw(e))
        with pytest.raises(OSError):  # (its traceback says where)
            main(argv)


def test_prompts_file_errors(capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert_error(capsys, ["generate", "--model", "x", "--prompts-file", str(empty)], "is empty")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    assert_error(capsys, ["generate", "--model", "x", "--prompts-file", str(bad)], "line 2", '"prompt"')
    bad.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
    assert_error(capsys, ["generate", "--model", "x", "--prompts-file", str(bad)], "line 2", "non-empty")
    assert_error(capsys, ["generate", "--model", "x", "--prompts-file", str(tmp_path / "missing.jsonl")],
                 "does not exist")
    assert_error(capsys, ["generate", "--model", "x", "--prompts-file", str(tmp_path)], "is not a file")
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    assert_error(capsys, ["generate", "--model", "x", "--prompts-file", str(latin)], "is not UTF-8 text")
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "ok"}\n')
    assert read_prompts_file(str(bom)) == ["ok"]


def test_flag_spellings_and_where_errors_point(capsys, tmp_path, smollm2_gguf):
    """An unknown flag points at the subcommand's --help; --max-new-tokens / --max-tokens and --prompts /
    --prompts-file are other spellings of generate's, bench's and the other commands' flags; a prompts
    file's failing prompt is named."""
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "x", "--prompt", "hi", "--threads", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unrecognized arguments: --threads 2 (see tokenleap generate --help)" in err
    from tokenleap.cli.main import build_parser
    args = build_parser().parse_args(["generate", "--model", "x", "--max-new-tokens", "7", "--prompts", "f.jsonl"])
    assert (args.max_tokens, args.prompts_file) == (7, "f.jsonl")
    assert build_parser().parse_args(["bench", "--target", "x", "--max-tokens", "9"]).max_new_tokens == 9
    for command in (["verify", "--model", "x"], ["calibrate", "--model", "x"], ["train-head", "--model", "x"]):
        assert build_parser().parse_args(command + ["--prompts-file", "f.jsonl"]).prompts == "f.jsonl"  # as generate
    from tokenleap.cli.bench import command_line  # what a bench's results.json records: flags, nothing else
    recorded = command_line(build_parser().parse_args(["bench", "--target", "x", "--limit", "2"]))
    assert recorded.startswith("tokenleap bench --target x") and "--limit 2" in recorded
    assert build_parser().parse_args(shlex.split(recorded)[1:]).limit == 2
    assert_error(capsys, ["generate", "--model", "smollm2-135m-instruct", "--prompt", "hi", "--spec", "ngram",
                          "--ngram-max", "2", "--ngram-min", "3"], "1 <= --ngram-min <= --ngram-max")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n{"prompt": "' + "word " * 600 + '"}\n')
    assert_error(capsys, ["generate", "--model", "smollm2-135m-instruct", "--max-model-len", "256", "--max-tokens",
                          "2", "--prompts-file", str(prompts)], "p.jsonl, prompt 2 of 2: the prompt has")


def test_text_that_is_not_unicode_and_a_cache_dir_that_is_a_file(capsys, tmp_path, smollm2_gguf):
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\u00e9".encode("latin-1"))
    for flag in ("--grammar", "--prediction"):
        assert_error(capsys, ["generate", "--model", "smollm2-135m-instruct", "--prompt", "hi", flag, str(latin)],
                     "is not UTF-8 text")
    assert_error(capsys, ["generate", "--model", "smollm2-135m-instruct", "--prompt", "caf\udcff"],
                 "not valid Unicode")
    assert_error(capsys, ["generate", "--model", "smollm2-135m-instruct", "--prompt", "hi", "--cache-dir",
                          __file__], "is not a directory")


def test_needs_exactly_one_prompt_source(capsys):
    assert_error(capsys, ["generate", "--model", "x"], "exactly one of --prompt")


def test_bad_num_spec_tokens_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "x", "--prompt", "hi", "--num-spec-tokens", "0"])
    assert e.value.code == 2
    assert "auto' or an integer >= 1" in capsys.readouterr().err


def test_prompt_longer_than_context(capsys, smollm2_gguf):
    assert_error(capsys, ["generate", "--model", "smollm2-135m-instruct", "--prompt", "word " * 64,
                          "--max-model-len", "32"], "context window is 32")


# -- end to end on the real SmolLM2 -----------------------------------------------------------
PROMPTS = ["def fibonacci(n):", "The three primary colors are", "import numpy as np\n\ndef normalize(x):"]


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    from tokenleap.models.checkpoint import convert_gguf
    d = convert_gguf(smollm2_gguf, torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    return model


def cli_json(capsys, *extra: str) -> list[dict]:
    code, out, err = run_cli(capsys, "generate", "--model", "smollm2-135m-instruct", "--dtype", "float32",
                             "--max-tokens", "24", "--ignore-eos", "--json", *extra)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_greedy_generate_equals_transformers(capsys, tmp_path, hf_smollm2):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    rows = cli_json(capsys, "--prompts-file", str(f))
    assert len(rows) == len(PROMPTS)
    from tokenleap.text.tokenizer import Tokenizer
    from tokenleap.models.checkpoint import load_checkpoint
    tok = Tokenizer.from_dir(load_checkpoint("smollm2-135m-instruct", torch.float32).tokenizer_dir)
    for prompt, row in zip(PROMPTS, rows):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            ref = hf_smollm2.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, ids.shape[1]:]
        assert row["token_ids"] == ref.tolist(), prompt
        assert row["num_tokens"] == 24 and row["text"] == tok.decode(row["token_ids"])
        assert row["tokens_per_second"] > 0 and row["seconds"] > 0


def test_ngram_speculation_equals_plain_on_real_model(capsys, smollm2_gguf):
    prompt = "Repeat this list exactly: alpha, beta, gamma, delta, alpha, beta, gamma, delta, alpha,"
    plain = cli_json(capsys, "--prompt", prompt, "--chat")[0]
    spec = cli_json(capsys, "--prompt", prompt, "--chat", "--spec", "ngram", "--num-spec-tokens", "4")[0]
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["stats"]["draft_tokens"] > 0 and spec["stats"]["mean_accepted_tokens"] >= 1.0
    auto = cli_json(capsys, "--prompt", prompt, "--chat", "--spec", "ngram")[0]
    assert auto["token_ids"] == plain["token_ids"]
    # (a fixed depth: a timed one may decode plainly wherever n-gram lookup has a proposal)
    tree = cli_json(capsys, "--prompt", prompt, "--chat", "--spec", "ngram", "--spec-tree", "on",
                    "--num-spec-tokens", "4", "--max-tree-nodes", "8", "--logprobs", "2")[0]
    assert tree["token_ids"] == plain["token_ids"] and tree["stats"]["draft_tokens"] > 0
    assert "logprobs" not in auto
    # logprobs on the real model: the same figures with and without speculation
    lp_plain = cli_json(capsys, "--prompt", prompt, "--chat", "--logprobs", "2")[0]["logprobs"]
    lp_spec = cli_json(capsys, "--prompt", prompt, "--chat", "--logprobs", "2", "--spec", "ngram")[0]["logprobs"]
    assert lp_spec == lp_plain and [e["token_id"] for e in lp_plain] == plain["token_ids"]
    assert tree["logprobs"] == lp_plain  # a tree's accepted rows give the same figures
    assert all(e["logprob"] <= 0 and e["top"][0] == [e["token_id"], e["logprob"]] for e in lp_plain)


def test_structured_output_on_real_model(capsys, smollm2_gguf):
    """--regex / --choice / --json-schema replies follow their grammar, with and without speculation."""
    import re
    row = cli_json(capsys, "--prompt", "What year did the Apollo 11 mission land?", "--chat",
                   "--regex", "[0-9]{4}")[0]
    assert re.fullmatch("[0-9]{4}", row["text"])
    schema = '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}'
    for extra in ((), ("--spec", "ngram")):
        row = cli_json(capsys, "--prompt", "Name the capital of France as JSON.", "--chat", "--max-tokens", "40",
                       "--json-schema", schema, *extra)[0]
        assert isinstance(json.loads(row["text"])["city"], str)
    row = cli_json(capsys, "--prompt", "Is the sky blue?", "--chat", "--choice", "yes", "--choice", "no")[0]
    assert row["text"] in ("yes", "no")


def test_bad_structured_output_fails_before_loading(capsys, tmp_path):
    # the model name is unknown too: the grammar is checked first
    assert_error(capsys, ["generate", "--model", "no-such-model", "--prompt", "x", "--regex", "("],
                 "invalid regex", "unclosed group")
    assert_error(capsys, ["generate", "--model", "no-such-model", "--prompt", "x", "--json-schema", "{nope"],
                 "--json-schema is not valid JSON")
    assert_error(capsys, ["generate", "--model", "no-such-model", "--prompt", "x", "--json-schema",
                          str(tmp_path / "missing.json")], "does not exist")
    with pytest.raises(SystemExit):  # argparse: one constraint at a time
        main(["generate", "--model", "x", "--prompt", "x", "--regex", "a", "--json-object"])


def test_models_lists_the_catalog(capsys):
    code, out, _ = run_cli(capsys, "models")
    assert code == 0
    for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"):
        assert name in out


# -- every sub-command: a bad flag is one line on stderr and exit code 2, before any model loads ----------
SMOL = "smollm2-135m-instruct"
BAD_FLAGS = [
    ["generate", "--model", "no-such-model", "--prompt", "x"],
    ["generate", "--model", SMOL, "--prompt", "x", "--draft-model", "no-such-draft"],
    ["generate", "--model", SMOL, "--prompt", "x", "--draft-model", "/no/such/draft.gguf"],
    ["generate", "--model", SMOL, "--prompt", "x", "--draft-model", SMOL, "--draft-quant", "int3"],
    ["generate", "--model", SMOL, "--prompt", "x", "--draft-model", SMOL, "--draft-dtype", "float8"],
    ["generate", "--model", SMOL, "--prompt", "x", "--spec", "ngram", "--draft-quant", "int4"],
    ["generate", "--model", SMOL, "--prompt", "x", "--spec", "none", "--draft-dtype", "float32"],
    ["generate", "--model", SMOL, "--prompt", "x", "--num-spec-tokens", "5"],
    ["generate", "--model", SMOL, "--prompt", "x", "--dtype", "int4"],
    ["generate", "--model", SMOL, "--prompt", "x", "--quant", "q4"],
    ["generate", "--model", SMOL, "--prompt", "x", "--max-model-len", "-5"],
    ["generate", "--model", SMOL, "--prompt", "x", "--spec", "ngram", "--draft-model", SMOL],
    ["generate", "--model", SMOL, "--prompt", "x", "--spec", "draft"],
    ["generate", "--model", SMOL, "--prompt", "x", "--spec", "medusa"],
    ["generate", "--model", SMOL, "--prompt", "x", "--ngram-min", "0"],
    ["generate", "--model", SMOL, "--prompt", "x", "--spec", "ngram", "--ngram-pool", "-1"],
    ["generate", "--model", SMOL, "--prompt", "x", "--max-tokens", "abc"],
    ["generate", "--model", SMOL, "--prompt", "x", "--top-p", "2"],
    ["generate", "--model", SMOL, "--prompt", "x", "--no-such-flag"],
    ["generate", "--model", SMOL, "--prompt", "x", "--spec-tree", "on"],
    ["generate", "--model", SMOL, "--prompt", "x", "--spec", "ngram", "--spec-tree", "maybe"],
    ["generate", "--model", SMOL, "--prompt", "x", "--spec", "ngram", "--spec-tree", "on", "--max-tree-nodes", "0"],
    ["serve", "--model", "no-such-model"],
    ["serve", "--model", SMOL, "--port", "70000"],
    ["serve", "--model", SMOL, "--port", "http"],
    ["serve", "--model", SMOL, "--max-model-len", "-5"],
    ["serve", "--model", SMOL, "--draft-model", "no-such-draft"],
    ["serve", "--model", SMOL, "--draft-model", SMOL, "--draft-quant", "int9"],
    ["serve", "--model", SMOL, "--spec", "ngram", "--draft-model", SMOL],
    ["serve", "--model", SMOL, "--spec", "none", "--draft-model", SMOL],
    ["generate", "--model", SMOL, "--prompt", "x", "--spec", "none", "--draft-model", SMOL],
    ["serve", "--model", SMOL, "--max-num-seqs", "0"],
    ["serve", "--model", SMOL, "--max-waiting", "-1"],
    ["serve", "--model", SMOL, "--block-size", "0"],
    ["serve", "--model", SMOL, "--num-kv-blocks", "-3"],
    ["serve", "--model", SMOL, "--kv-cache-gb", "nan"],
    ["serve", "--model", SMOL, "--prefill-chunk", "0"],
    ["serve", "--model", SMOL, "--log-interval", "-1"],
    ["bench", "--target", "no-such-model"],
    ["bench", "--target", SMOL, "--draft", "no-such-draft"],
    ["bench", "--target", SMOL, "--quant", "int3"],
    ["bench", "--target", SMOL, "--dtype", "fp8"],
    ["bench", "--target", SMOL, "--temperature", "-1"],
    ["bench", "--target", SMOL, "--temperature", "nan"],
    ["bench", "--target", SMOL, "--temperature", "1e39"],
    ["bench", "--target", SMOL, "--limit", "0"],
    ["bench", "--target", SMOL, "--dataset", "no-such-dataset"],
    ["bench", "--target", SMOL, "--methods", "plain,bogus"],
    ["bench", "--target", SMOL, "--methods", "plain,draft"],
    ["verify", "--model", SMOL],
    ["verify", "--model", "no-such-model", "--spec", "ngram"],
    ["verify", "--model", SMOL, "--draft-model", "no-such-draft"],
    ["verify", "--model", SMOL, "--spec", "ngram", "--draft-model", SMOL],
    ["verify", "--model", SMOL, "--spec", "none", "--draft-model", SMOL],
    ["verify", "--model", SMOL, "--spec", "ngram", "--samples", "0"],
    ["verify", "--model", SMOL, "--spec", "ngram", "--positions", "1"],
    ["verify", "--model", SMOL, "--spec", "ngram", "--alpha", "0.7"],
    ["verify", "--model", SMOL, "--spec", "ngram", "--temperature", "0"],
    ["verify", "--model", SMOL, "--spec", "ngram", "--max-model-len", "-5"],
    ["verify", "--model", SMOL, "--spec", "ngram", "--prompts", "/no/such/prompts.jsonl"],
    ["models", "install"],
    ["models", "install", "no-such-model"],
    ["models", "list", "no-such-model"],
    ["models", "no-such-model"],
    ["models", "show", "smollm2-135m-instruct"],
    ["models", "--cache-dir", "/etc/passwd"],
]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any attempt to load a model fails the test loudly (a traceback, which the test then sees)."""
    import tokenleap.models.pretrained

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded for a command line that should have been refused")
    monkeypatch.setattr(tokenleap.models.pretrained, "load_model", refuse)
    monkeypatch.setattr("tokenleap.api.load_model", refuse)
    monkeypatch.setattr("tokenleap.spec.proposers.factory.load_model", refuse)  # a draft model


@pytest.mark.parametrize("argv", BAD_FLAGS, ids=[" ".join(a) for a in BAD_FLAGS])
def test_bad_flags_give_one_line_and_exit_2(capsys, tmp_path, no_model_loads, argv):
    if argv[0] == "bench":
        argv = argv + ["--out", str(tmp_path / "out")]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()  # a refused bench wrote nothing (its --out stays free for the re-run)


def test_version(capsys):
    from tokenleap import __version__
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tokenleap {__version__}"


def test_models_shows_size_state_and_the_install_command(capsys, monkeypatch, tmp_path):
    import tokenleap.models.catalog as catalog
    monkeypatch.setattr(catalog, "missing_packages", lambda entry: [f"{entry.packages[0]}=={entry.version}"])
    code, out, _ = run_cli(capsys, "models", "--cache-dir", str(tmp_path))
    assert code == 0
    line = next(ln for ln in out.splitlines() if ln.startswith("qwen2.5-coder-1.5b-instruct"))
    assert "1.04 GiB" in line and "not installed" in line
    assert "tokenleap models install qwen2.5-coder-1.5b-instruct" in out and "pip install" not in out
    code, out, _ = run_cli(capsys, "models", "--json", "--cache-dir", str(tmp_path))
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["qwen2.5-coder-0.5b-instruct"]["size_bytes"] == 491_400_064
    assert rows["qwen2.5-coder-0.5b-instruct"]["converted"] == []
    code, out, _ = run_cli(capsys, "models", "list", "smollm2-135m-instruct", "--json", "--cache-dir", str(tmp_path))
    assert code == 0 and [r["name"] for r in json.loads(out)] == ["smollm2-135m-instruct"]  # the one named
    code, out, _ = run_cli(capsys, "models", "smollm2-135m-instruct", "--json", "--cache-dir", str(tmp_path))
    assert code == 0 and [r["name"] for r in json.loads(out)] == ["smollm2-135m-instruct"]  # `list` implied


def test_models_shows_converted_state(capsys, smollm2_gguf, tmp_path):
    from tokenleap.models.checkpoint import convert_gguf
    code, out, _ = run_cli(capsys, "models", "--cache-dir", str(tmp_path))
    assert "smollm2-135m-instruct" in out and "not converted yet" in out.split("smollm2-135m-instruct")[1]
    convert_gguf(smollm2_gguf, torch.float32, tmp_path)
    code, out, _ = run_cli(capsys, "models", "--cache-dir", str(tmp_path))
    assert "installed, converted (float32)" in out.split("smollm2-135m-instruct")[1].splitlines()[0]


def test_a_prediction_file_drafts_from_its_text_on_real_model(capsys, tmp_path, smollm2_gguf):
    """--prediction FILE: the reply predicted by an earlier run's text is drafted from it -- the same
    tokens, in fewer target forwards than prompt lookup alone."""
    prompt = "Write three short sentences about the sea."
    plain = cli_json(capsys, "--prompt", prompt, "--chat", "--max-tokens", "40")[0]
    f = tmp_path / "prediction.txt"
    f.write_text(plain["text"], encoding="utf-8")
    fixed = ("--spec", "ngram", "--num-spec-tokens", "6")  # (a timed draft length may decode plainly)
    without = cli_json(capsys, "--prompt", prompt, "--chat", "--max-tokens", "40", *fixed)[0]
    with_it = cli_json(capsys, "--prompt", prompt, "--chat", "--max-tokens", "40", *fixed, "--prediction", str(f))[0]
    assert with_it["token_ids"] == without["token_ids"] == plain["token_ids"]
    assert with_it["stats"]["accepted_tokens"] > without["stats"]["accepted_tokens"] + 10
    assert_error(capsys, ["generate", "--model", "smollm2-135m-instruct", "--prompt", "x", "--prediction",
                          str(tmp_path / "missing.txt")], "--prediction", "does not exist")


def test_verify_without_a_method_says_what_it_needs(capsys, no_model_loads):
    """Not a complaint about --num-spec-tokens (verify's own default), which the user never gave."""
    for extra in ([], ["--spec", "none"]):
        assert main(["verify", "--model", SMOL, *extra]) == 2
        err = capsys.readouterr().err
        assert "verify compares speculative decoding with plain decoding" in err and "num-spec-tokens" not in err
