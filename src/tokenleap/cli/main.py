"""Command line: ``tokenleap generate | models | chat | bench | serve | verify | calibrate | train-head``.

This module builds the parser, holds the flags several commands share (the model's, the sampling
ones, speculation's) with their checks, and runs a command; each command's own flags and work are in
a module of its own (``generate.py``, ``models.py``, ``chat.py``, ...). Every bad flag ends in one
line on stderr and exit code 2, without a traceback; flags that can be checked without the model
(names, paths, quantization, dtype) are checked before anything loads."""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenleap.config import QUANT_MODES, ConfigError, SamplingParams, SpecConfig, default_ngram_min
from tokenleap.errors import TokenleapError


QUANT_HELP = "none, int8, int4 (weight-only), w8a8 (int8 weights and activations; AMX-INT8 CPUs)"
"""``--quant``'s values in every command's help: those of ``config.QUANT_MODES``, which ``check_quant_dtype`` takes."""


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


def add_chat_template_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) that renders chats instead of the "
                        "model's own, as vLLM's --chat-template (llama.cpp's --chat-template-file)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="catalog name, GGUF file or Hugging Face model directory")
    p.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has native bf16, else float32), "
                                                    "float32, bfloat16, float16")
    p.add_argument("--quant", default="none", help=f"quantization: {QUANT_HELP}")
    p.add_argument("--spec", choices=["none", "draft", "ngram", "lookahead", "layerskip", "eagle", "auto"],
                   default=None,
                   help="speculative method (not given: draft with --draft-model, else none; serve: auto); auto: "
                        "per request and step, the proposer that pays (n-gram, the draft model -- without "
                        "--draft-model an installed catalog draft of the target's tokenizer, if memory "
                        "allows --, other methods), else plain decoding")
    p.add_argument("--draft-model", help="draft model (catalog name or path) for --spec draft or auto (auto without "
                                        "it picks an installed catalog draft of the target's tokenizer, at int4)")
    p.add_argument("--draft-quant", default=None,
                   help=f"draft weight quantization: {', '.join(QUANT_MODES)} (default: none for --spec draft, "
                        "int4 for --spec auto's draft)")
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
    p.add_argument("--draft-vocab", type=non_negative_int, default=SpecConfig.draft_vocab,
                   help="draft head over the first N token ids + special + prompt tokens (0: full vocabulary)")
    p.add_argument("--num-spec-tokens", type=_num_spec_tokens, default="auto",
                   help="draft length: 'auto' (adaptive, falls back to plain decoding) or a fixed N "
                        "(default: %(default)s)")
    p.add_argument("--max-spec-tokens", type=positive_int, default=SpecConfig.max_num_tokens,
                   help="upper bound for the adaptive draft length (default: %(default)s)")
    p.add_argument("--ngram-max", type=positive_int, default=SpecConfig.ngram_max,
                   help="longest suffix match n-gram lookup drafts from (default: %(default)s)")
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
                   help="the most drafted nodes a token tree may hold; under --spec-tree auto the controller "
                        "chooses up to it (default: %(default)s)")
    p.add_argument("--lookahead-window", type=positive_int, default=SpecConfig.lookahead_window,
                   help="--spec lookahead: future positions W of the Jacobi window (default: %(default)s)")
    p.add_argument("--lookahead-ngram", type=positive_int, default=SpecConfig.lookahead_ngram,
                   help="--spec lookahead: n-gram size N (the window has N - 1 levels; default: %(default)s)")
    p.add_argument("--lookahead-guesses", type=positive_int, default=SpecConfig.lookahead_guesses,
                   help="--spec lookahead: n-gram guesses G verified per step (default: %(default)s)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context window (default: 4096, or the model's positions if fewer)")
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
    if args.draft_head is not None and not args.draft_head.strip():
        raise UsageError("--draft-head is empty: give a head file, or auto (the model's head train-head stored)")
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
    _refuse_unread_tuning(args)
    check_model_args(args)
    try:
        return _spec_from_flags(args)
    except ConfigError as e:  # SpecConfig names its fields: a command line's user knows the flags
        message = str(e)
        for field_name, flag in _SPEC_FLAGS.items():
            message = re.sub(rf"\b{field_name}\b", flag, message)
        raise UsageError(message) from None


# a proposer's tuning flags: (dest, flag, its default, the methods that read it; None: every speculative one)
_TUNING = (("max_spec_tokens", "--max-spec-tokens", SpecConfig.max_num_tokens, None),
           ("max_tree_nodes", "--max-tree-nodes", SpecConfig.max_tree_nodes, None),
           ("ngram_pool", "--ngram-pool", SpecConfig.ngram_pool, ("ngram", "auto", "draft")),
           ("ngram_max", "--ngram-max", SpecConfig.ngram_max, ("ngram", "auto", "lookahead", "layerskip")),
           ("ngram_min", "--ngram-min", None, ("ngram", "auto")),
           ("draft_vocab", "--draft-vocab", SpecConfig.draft_vocab, ("draft", "auto")),
           ("lookahead_window", "--lookahead-window", SpecConfig.lookahead_window, ("lookahead", "auto")),
           ("lookahead_ngram", "--lookahead-ngram", SpecConfig.lookahead_ngram, ("lookahead", "auto")),
           ("lookahead_guesses", "--lookahead-guesses", SpecConfig.lookahead_guesses, ("lookahead", "auto")))


def _refuse_unread_tuning(args: argparse.Namespace) -> None:
    """A tuning flag given (not its default) where ``--spec`` makes nothing read it is a usage error, as
    the other speculation flags are: silently ignored, it would look as if it had an effect."""
    for dest, flag, default, methods in _TUNING:
        if getattr(args, dest, default) == default:
            continue
        if args.spec == "none":
            raise UsageError(f"{flag} tunes speculation, and --spec is none (plain decoding): give --spec "
                             "(auto, ngram, draft, ...) or drop it")
        if methods is not None and args.spec not in methods:
            raise UsageError(f"{flag} is not read by --spec {args.spec}; it goes with --spec {', '.join(methods)}")
        if dest == "ngram_pool" and args.spec == "draft" and args.draft_spec != "ngram":
            raise UsageError(f"{flag} goes with --spec draft only with --draft-spec ngram (a cascade's guesses)")


# SpecConfig's fields that a flag of another name sets
_SPEC_FLAGS = {"num_tokens": "--num-spec-tokens", "max_num_tokens": "--max-spec-tokens", "ngram_max": "--ngram-max",
               "ngram_min": "--ngram-min", "ngram_pool": "--ngram-pool", "max_tree_nodes": "--max-tree-nodes",
               "lookahead_window": "--lookahead-window", "lookahead_ngram": "--lookahead-ngram",
               "lookahead_guesses": "--lookahead-guesses", "draft_vocab": "--draft-vocab",
               "draft_quant": "--draft-quant", "draft_dtype": "--draft-dtype"}


def _spec_from_flags(args: argparse.Namespace) -> SpecConfig:
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
    """Each flag's quantization (None: unset) is one tokenleap has, each dtype (None: unset) one it computes in."""
    from tokenleap.models.checkpoint import as_dtype
    for flag, value in quants.items():
        if value is not None and value not in QUANT_MODES:
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
    """A JSONL prompts file's prompts (``read_prompt_records``)."""
    return [r["prompt"] for r in read_prompt_records(path)]


def read_prompt_records(path: str) -> list[dict]:
    """A JSONL prompts file's lines, each an object with a non-empty string "prompt" (and any "id" the
    output should carry); other fields are ignored, with one warning naming them (sampling settings are
    the command's flags)."""
    from tokenleap.text.files import jsonl_lines
    records, ignored = [], set()
    for n, line in enumerate(jsonl_lines(read_text_arg(path, "prompts file")), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} line {n}: not valid JSON ({e.msg}: column {e.colno})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise UsageError(f"{path} line {n}: each line needs a non-empty string field \"prompt\"")
        ignored.update(k for k in obj if k not in ("prompt", "id"))
        records.append(obj)
    if not records:
        raise UsageError(f"prompts file {path} is empty: it needs one JSON object with a \"prompt\" per line")
    if ignored:
        print(f"tokenleap: warning: {path}: fields other than \"prompt\" and \"id\" are ignored "
              f"({', '.join(sorted(ignored))}); give sampling settings as flags", file=sys.stderr)
    return records


def read_text_arg(path: str, flag: str) -> str:
    """A UTF-8 text file, or a usage error saying why not."""
    from tokenleap.text.files import read_text_file
    try:
        return read_text_file(path, flag)
    except ValueError as e:
        raise UsageError(str(e)) from None


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """The sampling flags of ``generate`` and ``chat`` (``max_tokens``: the default budget)."""
    p.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=max_tokens,
                   help=f"most tokens a reply may have (default {max_tokens})")
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
    """``SamplingParams`` of the ``add_sampling_args`` flags (``extra``: further fields); a value the
    params refuse is a usage error naming the flag (``--top-p``), not the API field (``top_p``)."""
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop or ()),
                              ignore_eos=args.ignore_eos, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                              min_tokens=args.min_tokens, **extra)
    except ConfigError as e:
        message = str(e).replace(" (or None: up to the context's end)", "")  # (None is the API's, no flag's)
        if not re.match(rf"({'|'.join(_SAMPLING_FLAGS)}) ", message):
            raise
        raise UsageError(re.sub(rf"\b({'|'.join(_SAMPLING_FLAGS)})\b",
                                lambda m: "--" + m.group(1).replace("_", "-"), message)) from None


_SAMPLING_FLAGS = ("max_tokens", "logprobs", "temperature", "top_k", "top_p", "min_p", "seed", "stop",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")  # --top-p, ...


def build_parser() -> argparse.ArgumentParser:
    from tokenleap import __version__
    parser = Parser(prog="tokenleap", description="Lossless speculative decoding for LLMs")
    parser.add_argument("--version", action="version", version=f"tokenleap {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from tokenleap.cli import bench, calibrate, chat, generate, models, serve, train_head, verify
    for module in (generate, models, chat, bench, serve, verify, calibrate, train_head):
        module.register(sub)
    parser.commands = sub.choices  # (main names a subcommand's unknown flags through its own parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = None  # (an error while the parser builds has none)
    try:
        parser = build_parser()  # (its imports take a while: a Ctrl-C there is an interruption too)
        args, unknown = parser.parse_known_args(argv)
        if unknown and args.command in INTERMIXED:  # a positional after an option (`models list --json NAME`)
            argv = sys.argv[1:] if argv is None else argv
            args = parser.commands[args.command].parse_intermixed_args(argv[argv.index(args.command) + 1:], args)
        elif unknown:  # named by the subcommand's parser: its --help lists the flags it takes
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
        if args.command == "serve":  # (the server logs through its own configuration)
            return args.func(args)
        with _warnings_to_stderr():
            return args.func(args)
    except TokenleapError as e:  # (a bad value's ConfigError among them)
        print(f"tokenleap: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (on a terminal, on a line of its own after any streamed text)
        print(f"{chr(10) if sys.stdout.isatty() else ''}tokenleap: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`tokenleap ... | head`): stop quietly, as other tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # (the interpreter's own flush at exit would raise again)
        return 141  # what a shell reports for a process ended by SIGPIPE
    except OSError as e:  # a file it cannot read or write (a read-only cache, a directory in its place)
        if not isinstance(e.filename, (str, bytes, os.PathLike)) or os.environ.get("TOKENLEAP_TRACEBACK"):
            raise  # (not a file's error -- a socket's, a library's, a bug's: its traceback says where)
        print(f"tokenleap: error: {os_error_line(e, getattr(args, 'cache_dir', None))}", file=sys.stderr)
        return 2


INTERMIXED = ("models",)  # commands whose positionals may come after their options (no subcommands of their own)


@contextlib.contextmanager
def _warnings_to_stderr() -> Iterator[None]:
    """While a command runs, the library's warnings (``logging``, logger "tokenleap") go to standard error
    as the command's own messages do: ``tokenleap: warning: ...`` (without a handler Python prints the bare
    message). Records still propagate (to a program's own handlers, if it set any: then they are not
    printed twice by Python's fallback); the handler goes when the command ends."""
    log, handler = logging.getLogger("tokenleap"), _CommandStderr()
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)


class _CommandStderr(logging.Handler):
    """Warnings and errors as ``tokenleap: LEVEL: message`` lines on ``sys.stderr`` as it is at each record."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"tokenleap: {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr)
        except Exception:  # noqa: BLE001 -- logging's rule: a record that cannot be written is reported, not raised
            self.handleError(record)


def unwritable_place(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` where a file cannot be made under it -- a file, or a
    directory this process cannot write (``os.access``: a read-only file system refuses root too) --
    else None: said before long work, not at its save."""
    place = next((p for p in path.parents if p.exists()), None)
    if place is None or (place.is_dir() and os.access(place, os.W_OK | os.X_OK)):
        return None
    return place


def os_error_line(e: OSError, cache_dir: str | None) -> str:
    """``e`` in one line: what failed on which file, and for a file in tokenleap's cache what to do."""
    from tokenleap.models.catalog import default_cache_dir
    line = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    failed = Path(os.fsdecode(e.filename)).absolute() if e.filename else None
    if failed is not None and failed.is_relative_to(cache.absolute()):
        line += (f" (in tokenleap's cache {cache}: make it writable, remove the damaged entry, or give another "
                 "directory with TOKENLEAP_CACHE or --cache-dir)")
    elif failed is not None and cache.absolute().is_relative_to(failed):  # (making the cache's parents: a
        line += (f" (making tokenleap's cache {cache}: give a writable directory with TOKENLEAP_CACHE or "
                 "--cache-dir)")  # read-only or missing home, as a service account's)
    return line


if __name__ == "__main__":
    sys.exit(main())
