"""``tokenleap calibrate --model M --spec layerskip [--prompts FILE]``: choose the layers a layer-skip
draft skips, ahead of time, and store the choice where ``--spec layerskip`` (``--skip-layers auto``)
finds it for this model, dtype and quantization.

The search (``spec/proposers/layerskip_search.py``) runs on each prompt and the model's own early
output (``--max-tokens`` greedy tokens, decoded plainly first); then the chosen set is measured for
real: the prompts decoded plainly and with layer-skip speculation, greedy, outputs compared."""
from __future__ import annotations

import argparse
import json
import sys
import time

from tokenleap.cli.main import (QUANT_HELP, UsageError, check_model_ref, check_quant_dtype, positive_int,
                                read_prompts_file, unwritable_place)

DEFAULT_PROMPTS = (
    "Complete the following Python function:\n\n```python\nfrom typing import List\n\n\n"
    "def below_zero(operations: List[int]) -> bool:\n    \"\"\" You're given a list of deposit and withdrawal "
    "operations on a bank account that starts with\n    zero balance. Your task is to detect if at any point "
    "the balance of account falls below zero, and\n    at that point function should return True. Otherwise it "
    "should return False.\n    >>> below_zero([1, 2, 3])\n    False\n    >>> below_zero([1, 2, -4, 5])\n"
    "    True\n    \"\"\"\n```",
    "Complete the following Python function:\n\n```python\ndef fib(n: int) -> int:\n    \"\"\"Return the n-th "
    "Fibonacci number.\n    >>> fib(10)\n    55\n    \"\"\"\n```",
    "Explain in a few sentences why the sky is blue, for a curious ten-year-old.",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("calibrate", help="choose a layer-skip draft's skipped layers ahead of time and store "
                                                "them for --spec layerskip")
    p.add_argument("--model", required=True, help="catalog name, GGUF file or Hugging Face model directory")
    p.add_argument("--spec", choices=["layerskip"], default="layerskip", help="the method to calibrate")
    p.add_argument("--dtype", default="auto",
                   help="auto, float32, bfloat16, float16 (calibrations are stored per dtype)")
    p.add_argument("--quant", default="none", help=f"{QUANT_HELP}; calibrations are stored per quantization")
    p.add_argument("--prompts", "--prompts-file", metavar="FILE",
                   help="JSONL file with a \"prompt\" per line (default: two code prompts and a chat prompt)")
    p.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--max-tokens", type=positive_int, default=48,
                   help="tokens of the model's own output calibrated on, and decoded in the measurement")
    p.add_argument("--candidates", type=positive_int, default=3, help="layers re-scored at each growth step")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--cache-dir", default=None, help="where converted models and calibrations are kept")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    check_quant_dtype({"--quant": args.quant}, {"--dtype": args.dtype})
    check_model_ref("--model", args.model, args.cache_dir)
    prompts = read_prompts_file(args.prompts) if args.prompts else list(DEFAULT_PROMPTS)
    from tokenleap.spec.proposers.factory import LAYERSKIP_MIN_SPEEDUP, layerskip_joins_auto
    from tokenleap.config import SamplingParams
    from tokenleap.models.pretrained import load_model
    from tokenleap.spec.engine import Engine
    from tokenleap.models.checkpoint import model_key
    from tokenleap.spec.proposers import layerskip_search as ls
    from tokenleap.spec.proposers.layerskip import LayerSkipProposer, format_skip

    def log(line: str) -> None:
        if not args.json:
            print(f"[tokenleap] {line}", file=sys.stderr)

    target = load_model(args.model, dtype=args.dtype, quant=args.quant, cache_dir=args.cache_dir)
    tok, model = target.tokenizer, target.model
    path = ls.store_path(args.cache_dir, model_key(target.source, target.gguf_path, target.dtype, target.quant))
    place = unwritable_place(path)
    if place is not None:  # said before the search, not after it
        raise UsageError(f"cannot store the calibration under {place}: not writable (give a writable cache with "
                         "TOKENLEAP_CACHE or --cache-dir)")
    ids = [tok.encode(p) if args.no_chat else tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens)
    plain = Engine(model, tok, max_len=max(len(i) for i in ids) + args.max_tokens + 16)
    texts = []
    for p in ids:  # each prompt with the model's own early output
        *_, (seq, _) = plain.generate(p, params)
        texts.append(p + seq.generated)
    log(f"searching {model.config.num_hidden_layers} layers on {len(texts)} prompts ...")
    cal = ls.search(model, texts, ls.SearchConfig(candidates=args.candidates), log=log)
    ls.save_calibration(path, cal)
    measured = _measure(model, tok, ids, params, plain, LayerSkipProposer(model, cal.skip_set))
    result = {"model": target.source, "dtype": str(target.dtype).removeprefix("torch."), "quant": target.quant,
              "skip_layers": format_skip(cal.skip_set), "num_layers": cal.num_layers, "stored": str(path),
              "calibration": cal.to_dict(), "measured": measured,
              "auto_arm": layerskip_joins_auto(cal.predicted_speedup)}  # whether --spec auto drafts with it
    # exit 1 if layer skip's greedy output differed from plain decoding's: never expected (verification
    # keeps it lossless), so a defect to report, whatever the calibration's figures
    status = 0 if measured["outputs_equal"] else 1
    if status:
        print("tokenleap: error: layer skip's greedy output differed from plain decoding's on these prompts -- "
              "a defect in tokenleap (please report it with the model and prompts)", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
        return status
    print(f"skip layers {result['skip_layers']} ({len(cal.skip)} of {cal.num_layers}); stored at {path}")
    print(f"calibration: agreement {cal.agreement:.2f} on {cal.positions} positions, predicted "
          f"{cal.predicted_speedup:.2f}x at k={cal.k} (draft token {cal.draft_seconds * 1e3:.1f} ms, plain step "
          f"{cal.full_seconds * 1e3:.1f} ms), search {cal.search_seconds:.0f}s")
    print(f"measured (greedy, {measured['tokens']} tokens): plain {measured['plain_tok_s']:.2f} tok/s, layerskip "
          f"{measured['layerskip_tok_s']:.2f} tok/s ({measured['speedup']:.2f}x), tau {measured['tau']:.2f}, "
          f"draft acceptance {measured['draft_acceptance']:.1%}, outputs equal: {measured['outputs_equal']}")
    print("--spec auto: layer skip is one of its proposers" if result["auto_arm"] else
          f"--spec auto leaves layer skip out on this machine (predicted under {LAYERSKIP_MIN_SPEEDUP:.2f}x)")
    return status


def _measure(model, tok, ids: list[list[int]], params, plain, proposer) -> dict:
    """Decode ``ids`` plainly and with ``proposer`` (greedy): tokens per second, tau, acceptance."""
    from tokenleap.spec.engine import Engine
    spec = Engine(model, tok, max_len=plain.max_len, proposer=proposer)
    seconds = {"plain": 0.0, "layerskip": 0.0}
    outs: dict[str, list] = {"plain": [], "layerskip": []}
    tokens = 0
    for p in ids:
        for name, eng in (("plain", plain), ("layerskip", spec)):
            t0 = time.perf_counter()
            *_, (seq, _) = eng.generate(p, params)
            seconds[name] += time.perf_counter() - t0
            outs[name].append(seq.generated)
        tokens += len(outs["plain"][-1])
    t = spec.totals
    rate = {name: sum(len(o) for o in outs[name]) / s if s > 0 else 0.0 for name, s in seconds.items()}
    return {"tokens": tokens, "plain_tok_s": round(rate["plain"], 3), "layerskip_tok_s": round(rate["layerskip"], 3),
            "speedup": round(rate["layerskip"] / rate["plain"], 3) if rate["plain"] else 0.0,
            "tau": round(t.to_dict()["mean_accepted_tokens"], 3),
            "draft_acceptance": round(t.accepted_tokens / t.draft_tokens, 4) if t.draft_tokens else 0.0,
            "outputs_equal": outs["plain"] == outs["layerskip"]}
