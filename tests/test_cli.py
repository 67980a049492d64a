"""The command line: bad input gets one clear message and a non-zero exit, never a traceback;
greedy output on the real SmolLM2 equals Hugging Face transformers' greedy output."""
from __future__ import annotations

import json

import pytest
import torch

from tokenleap.cli import main

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
    ("--temperature", "-1", "temperature must be >= 0"),
    ("--top-p", "0", "top_p must be in (0, 1]"),
    ("--top-p", "1.5", "top_p must be in (0, 1]"),
    ("--top-k", "-2", "top_k must be an integer >= 0"),
    ("--max-tokens", "0", "max_tokens must be an integer >= 1"),
    ("--logprobs", "30", "logprobs must be an integer in [0, 20]"),
    ("--presence-penalty", "5", "presence_penalty must be in [-2, 2]"),
    ("--min-tokens", "500", "min_tokens must be an integer in [0, max_tokens]"),
])
def test_invalid_sampling_values(capsys, flag, value, needle):
    assert_error(capsys, ["generate", "--model", "smollm2-135m-instruct", "--prompt", "hi", flag, value], needle)


def test_prompts_file_errors(capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert_error(capsys, ["generate", "--model", "x", "--prompts-file", str(empty)], "is empty")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    assert_error(capsys, ["generate", "--model", "x", "--prompts-file", str(bad)], "line 2", '"prompt"')
    assert_error(capsys, ["generate", "--model", "x", "--prompts-file", str(tmp_path / "missing.jsonl")],
                 "does not exist")


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
    from tokenleap.models.loader import convert_gguf
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
    from tokenleap.tokenizer import Tokenizer
    from tokenleap.models.loader import load_checkpoint
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
    assert "logprobs" not in auto
    # logprobs on the real model: the same figures with and without speculation
    lp_plain = cli_json(capsys, "--prompt", prompt, "--chat", "--logprobs", "2")[0]["logprobs"]
    lp_spec = cli_json(capsys, "--prompt", prompt, "--chat", "--logprobs", "2", "--spec", "ngram")[0]["logprobs"]
    assert lp_spec == lp_plain and [e["token_id"] for e in lp_plain] == plain["token_ids"]
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
                          str(tmp_path / "missing.json")], "cannot read")
    with pytest.raises(SystemExit):  # argparse: one constraint at a time
        main(["generate", "--model", "x", "--prompt", "x", "--regex", "a", "--json-object"])


def test_models_lists_the_catalog(capsys):
    code, out, _ = run_cli(capsys, "models")
    assert code == 0
    for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"):
        assert name in out
