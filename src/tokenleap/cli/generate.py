"""``tokenleap generate``: text from a prompt (or a JSONL file of them), streamed or as JSON lines,
with any speculation method, structured output, fill in the middle and predicted outputs."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import replace

from tokenleap.cli.main import (UsageError, add_chat_template_arg, add_model_args, add_sampling_args,
                                read_prompt_records, read_text_arg, sampling_from_args, spec_config)
from tokenleap.cli.output import stats_line
from tokenleap.config import StructuredOutput
from tokenleap.errors import TokenleapError


def register(subparsers: argparse._SubParsersAction) -> None:
    g = subparsers.add_parser("generate", help="generate text from a prompt or a JSONL prompts file")
    add_model_args(g)
    add_chat_template_arg(g)
    g.add_argument("--prompt", help="prompt text (-: read it from standard input)")
    g.add_argument("--file", "-f", dest="prompt_file", metavar="FILE",
                   help="a UTF-8 text file holding the prompt (as llama.cpp's -f: one final line end dropped)")
    g.add_argument("--prompts-file", "--prompts", dest="prompts_file",
                   help="JSONL file with a \"prompt\" field per line")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message before the prompt (implies --chat; llama.cpp's -sys, vLLM chat's "
                        "--system-prompt)")
    g.add_argument("--suffix", help="fill in the middle: the prompt is the code before the gap, this the code after")
    add_sampling_args(g, max_tokens=128)
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each generated token's logprob and its N most likely alternatives")
    g.add_argument("--prediction", metavar="FILE",
                   help="text the reply is expected to resemble (e.g. the file being edited, or a previous reply): "
                        "n-gram drafting proposes from it too (OpenAI's Predicted Outputs; output unchanged)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt instead of streamed text")
    so = g.add_mutually_exclusive_group()  # structured output: the reply follows a grammar
    so.add_argument("--json-schema", metavar="SCHEMA", help="reply is JSON matching this schema (JSON text or a file)")
    so.add_argument("--json-object", action="store_true", help="reply is a JSON object")
    so.add_argument("--regex", help="reply matches this regular expression")
    so.add_argument("--choice", action="append", help="reply is one of these strings (repeatable)")
    so.add_argument("--grammar", metavar="FILE",
                    help="reply follows this grammar (Lark, or GBNF as llama.cpp writes it)")
    g.add_argument("--stats", action="store_true", help="print speculation metrics to stderr")
    g.set_defaults(func=cmd_generate)


def structured_args(args: argparse.Namespace) -> StructuredOutput | None:
    """--json-schema (JSON text or a file) / --json-object / --regex / --choice / --grammar (a Lark or GBNF file)."""
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            text = read_text_arg(text, "--json-schema")
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise UsageError(f"--json-schema is not valid JSON: {e}") from None
        return StructuredOutput(json=schema)
    if args.json_object:
        return StructuredOutput(json_object=True)
    if args.regex is not None:
        return StructuredOutput(regex=args.regex)
    if args.choice:
        return StructuredOutput(choice=tuple(args.choice))
    if args.grammar is not None:
        return StructuredOutput(grammar=read_text_arg(args.grammar, "--grammar"))
    return None


def cmd_generate(args: argparse.Namespace) -> int:
    if sum(x is not None for x in (args.prompt, args.prompt_file, args.prompts_file)) != 1:
        raise UsageError("give exactly one of --prompt TEXT (- for standard input), --file PROMPT.txt or "
                         "--prompts-file FILE.jsonl")
    records = _prompts(args)
    prompts = [r["prompt"] for r in records]
    if args.system is not None:
        args.chat = True  # (a system message is a conversation's)
    if args.suffix is not None and args.chat:
        raise UsageError("--suffix (fill in the middle) takes a plain prompt, not --chat or --system")
    params = sampling_from_args(args, logprobs=args.logprobs, structured=structured_args(args))
    if args.logprobs is not None and not args.json:
        print("tokenleap: warning: --logprobs shows in --json output only", file=sys.stderr)
    if params.structured is not None:  # an invalid schema, regex or grammar fails before loading
        from tokenleap.spec.structured import grammar_of
        grammar_of(params.structured)
    spec = spec_config(args)
    predicted = read_text_arg(args.prediction, "--prediction") if args.prediction is not None else None
    from tokenleap.api import LLM
    llm = LLM(args.model, dtype=args.dtype, quant=args.quant, speculative=spec,
              max_model_len=args.max_model_len, cache_dir=args.cache_dir, chat_template=args.chat_template)
    if predicted:  # the reply's expected text: the lookup drafters propose from it too
        params = replace(params, prediction=tuple(llm.tokenizer.encode(predicted, add_special_tokens=False)))
    if args.stats:
        print(f"[tokenleap] {llm.describe()}", file=sys.stderr)
    requests = []
    for n, prompt in enumerate(prompts, 1):  # every prompt checked before any is generated
        with _naming(args, n, len(prompts)):
            ids, fim_params = (llm.infill_request(prompt, args.suffix, params) if args.suffix is not None
                               else (llm.encode(_conversation(prompt, args.system), chat=args.chat), params))
            llm.engine.create(ids, fim_params)  # (validation only: no cache touched)
            requests.append((prompt, ids, fim_params))
    for n, (prompt, ids, fim_params) in enumerate(requests, 1):
        with _naming(args, n, len(prompts)):
            for chunk in llm.stream(ids, fim_params):
                if not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
        out = chunk.output
        out.prompt = prompt  # (a fill-in-the-middle request ran on ids)
        if args.json:  # (a prompts file's outputs name their line: its index among the prompts, its "id")
            line = records[n - 1]
            named = ({"index": n - 1, **({"id": line["id"]} if "id" in line else {})}
                     if args.prompts_file is not None else {})
            print(json.dumps({**named, **out.to_dict()}, ensure_ascii=False))
        else:
            sys.stdout.write("\n")
        if args.stats:
            print(f"[tokenleap] {stats_line(out.stats)}", file=sys.stderr)
    return 0


def _conversation(prompt: str, system: str | None) -> str | list[dict[str, str]]:
    """The prompt as ``LLM.encode`` takes it: the text, or with a system message the two messages."""
    if system is None:
        return prompt
    return [{"role": "system", "content": system}, {"role": "user", "content": prompt}]


def _prompts(args: argparse.Namespace) -> list[dict]:
    """The prompts to generate from, each ``{"prompt": text}`` (a JSONL line's "id" kept): ``--prompt``
    (``-``: standard input), ``--file``'s text, or the JSONL file's lines."""
    if args.prompts_file is not None:
        return read_prompt_records(args.prompts_file)
    if args.prompt_file is None and args.prompt != "-":
        return [{"prompt": args.prompt}]
    if args.prompt_file is not None:
        where, text = f"--file {args.prompt_file}", read_text_arg(args.prompt_file, "--file")
    else:  # (standard input's bytes, read as a file's are: not the locale's encoding)
        where, text = "--prompt -: standard input", read_text_arg("-", "--prompt -")
    text = text.removesuffix("\n")  # (an editor's or echo's last line end)
    if not text.strip():
        raise UsageError(f"{where} held no prompt")
    return [{"prompt": text}]


@contextlib.contextmanager
def _naming(args: argparse.Namespace, n: int, total: int) -> Iterator[None]:
    """A prompts file's errors name the prompt (its n-th of ``total``); a lone prompt's pass unchanged."""
    try:
        yield
    except TokenleapError as e:
        if args.prompts_file is None:
            raise
        raise UsageError(f"{args.prompts_file}, prompt {n} of {total}: {e}") from None
