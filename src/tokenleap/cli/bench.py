"""``tokenleap bench``: registered into the main parser by ``cli.build_parser``."""
from __future__ import annotations

import argparse
import shlex
import sys

from tokenleap.bench.datasets import DATASETS
from tokenleap.bench.common import FAMILIES

from tokenleap.cli.main import QUANT_HELP, check_model_ref, check_quant_dtype, positive_int
from tokenleap.config import QUANT_MODES

_EPILOG = f"""methods: {', '.join(FAMILIES)}
  options: draft:k=4 | draft:k=auto,kmax=8 | draft:vocab=0 (full draft head) | ngram:k=3,max=4,min=1 |
           draft-tree:k=auto,nodes=15 | ngram-tree:k=4,nodes=8 (token trees of at most `nodes` drafted nodes) |
           ngram:tree=auto | draft:tree=auto,nodes=15 (plain, chain or tree chosen per step from measured costs;
           tree=on is the -tree family, tree=off -- the default -- chains) |
           cascade:k=auto (draft, its own steps speculated by n-gram lookup: --draft-spec ngram) |
           draft:model=smollm2-135m-instruct (this method's draft instead of --draft, e.g. another tokenizer's) |
           lookahead:window=3,ngram=3,guesses=3 (Jacobi window W x N-1 levels, G n-gram guesses) |
           layerskip:k=auto,skip=auto (the target drafts with some layers skipped: skip=auto calibrated and
           stored per model -- tokenleap calibrate --, or a list like skip=4-6+10-14) |
           eagle:k=auto,head=auto (a trained draft head: head=auto the one tokenleap train-head stored, or a file) |
           hf-assisted:k=5 | hf-prompt-lookup:k=10,max=2 | llamacpp-prompt-lookup:k=10,max=2
           (llama_cpp_python's lookup: it computes logits for every prompt row, so its prefill is slower
           than llama.cpp's own lookup decoding)
  plain is always run (speedups and the equality check are relative to it); sampled runs are seeded
  per prompt (--seed + prompt index), so tokenleap's methods must equal plain then too (peers are not
  compared). Figures: docs/METRICS.md.
datasets: {', '.join(DATASETS)}, or a JSONL file with "prompt" (and optional "category", "id") per line.
example:
  tokenleap bench --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
      --dataset humaneval --limit 20 --methods plain,draft:k=auto,ngram,hf-plain --quant int8 --out bench-out
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark methods and peers side by side (Spec-Bench style)",
                              epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model: catalog name, GGUF file or HF directory")
    p.add_argument("--draft", help="draft model for draft, cascade and hf-assisted (another tokenizer's: "
                                   "tokenleap drafts through text)")
    p.add_argument("--dataset", default="humaneval", help=f"{', '.join(DATASETS)} or a JSONL file")
    p.add_argument("--methods", default="plain,ngram", help="comma-separated method list (see below)")
    p.add_argument("--limit", type=positive_int, default=None, help="first N prompts of the dataset")
    p.add_argument("--max-new-tokens", "--max-tokens", dest="max_new_tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; outputs are checked for equality with plain (sampled: seeded, tokenleap methods)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=positive_int, default=1, help="runs per prompt and method; medians are reported")
    p.add_argument("--out", default="bench-results", help="output directory (refused if it exists, unless --resume)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--quant", default="none", help=f"tokenleap target weights: {QUANT_HELP}")
    p.add_argument("--draft-quant", default="none", help=f"tokenleap draft weights: {', '.join(QUANT_MODES)}")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out: runs what is missing, a prompt's methods side by side (a prompt "
                        "that lacks a method, one cut by the interruption or added now, runs again with every method); "
                        "a peer that failed stays skipped")
    p.add_argument("--no-chat", action="store_true", help="raw prompts, no chat template for instruct models")
    p.add_argument("--pass-at-1", action="store_true",
                   help="run HumanEval tests on the outputs (executes model-written code in a subprocess)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch and llama.cpp threads (default: torch's)")
    p.add_argument("--cache-dir", default=None, help="where converted models are kept")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)


def command_line(args: argparse.Namespace) -> str:
    """The command as parsed, every option spelled out, so results.json says exactly what ran."""
    words = ["tokenleap", "bench"]
    for key, value in vars(args).items():
        if key in ("func", "command") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        words += [flag] if value is True else [flag, str(value)]
    return shlex.join(words)


def cmd_bench(args: argparse.Namespace) -> int:
    from tokenleap.bench import bench

    # what can be checked without a model is checked before the target loads
    check_quant_dtype({"--quant": args.quant, "--draft-quant": args.draft_quant}, {"--dtype": args.dtype})
    check_model_ref("--target", args.target, args.cache_dir)
    if args.draft:
        check_model_ref("--draft", args.draft, args.cache_dir)
    from tokenleap.bench.methods import parse_methods
    for spec in parse_methods(args.methods):
        if spec.get("model"):
            check_model_ref(f"--methods {spec.name}", spec.get("model"), args.cache_dir)

    results = bench(args.target, draft=args.draft, dataset=args.dataset, methods=args.methods, limit=args.limit,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                    repeats=args.repeats, out=args.out, dtype=args.dtype, quant=args.quant,
                    draft_quant=args.draft_quant, resume=args.resume, chat=not args.no_chat,
                    pass_at_1=args.pass_at_1, cache_dir=args.cache_dir, threads=args.threads,
                    progress=not args.no_progress, command=command_line(args))
    plots = results.get("plots", [])  # (file names in args.out)
    print(f"results in {args.out}/ (results.json, report.md, results.jsonl{''.join(', ' + p for p in plots)})",
          file=sys.stderr)
    kinds = {m["name"]: m["kind"] for m in results["methods"]}
    lossy = [m for m in results["equality"].get("mismatches", []) if kinds.get(m["method"]) == "tokenleap"]
    return 1 if lossy else 0  # a tokenleap method that is not lossless fails the command


