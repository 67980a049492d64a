"""``tokenleap train-head --model M``: train a feature-level draft head (EAGLE-style) for ``--spec eagle``.

1. The target answers training prompts (``--prompts``, default: about 190 varied programming and
   general requests shipped with tokenleap, none from the benchmark's sets), greedy, through the chat
   template. Replies are kept in ``--replies FILE`` when given, and read from it on a later run
   instead of generating again. ``--texts`` adds plain text or code files as they are, cut into
   pieces of the training window: any text teaches the head the target's next-token behaviour, and
   costs one prefill pass a token where a reply costs a generated token.
2. The target's features (final hidden states) of every position are computed in one prefill pass,
   and kept under the cache directory per source (the replies, each text file) for later runs.
3. The head is trained on them (``heads/train.py``) and saved where ``--spec eagle`` looks for this
   model (``--output`` elsewhere); a held-out share of the replies reports how often the head's next
   token agrees with the target's on what the target itself writes.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from importlib import resources
from pathlib import Path

from tokenleap.cli.main import (UsageError, check_model_ref, check_quant_dtype, positive_int, read_prompts_file,
                                read_text_arg, unwritable_place)
from tokenleap.text.files import jsonl_lines


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train-head", help="train a draft head on the target's own hidden states "
                                                 "(for --spec eagle)")
    p.add_argument("--model", required=True, help="catalog name, GGUF file or Hugging Face model directory")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--quant", default="int4", help="the target's quantization while generating and computing "
                                                    "features: none, int8, int4 (default), w8a8 (AMX-INT8 CPUs)")
    p.add_argument("--prompts", "--prompts-file", metavar="FILE",
                   help="JSONL file with a \"prompt\" per line (default: tokenleap's training prompts)")
    p.add_argument("--texts", nargs="*", default=[], metavar="FILE",
                   help="text or code files trained on as they are (cut into pieces of 1,024 tokens)")
    p.add_argument("--replies", metavar="FILE", help="JSONL of generated replies: read if it exists, else written")
    p.add_argument("--max-tokens", type=positive_int, default=384, help="longest generated reply")
    p.add_argument("--epochs", type=positive_int, default=4, help="passes over the training texts (default: 4)")
    p.add_argument("--lr", type=float, default=1e-3, help="the optimizer's learning rate (default: 1e-3)")
    p.add_argument("--second-step", action="store_true",
                   help="also train the second draft token from the head's own prediction (twice the time)")
    p.add_argument("--intermediate-size", type=positive_int, default=None,
                   help="the head's MLP width (default: half the target's)")
    p.add_argument("--output", help="where to save the head (default: where --spec eagle looks for --model)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--cache-dir", default=None, help="where converted models and heads are kept")
    p.set_defaults(func=cmd_train_head)


def default_prompts() -> list[str]:
    text = resources.files("tokenleap.heads").joinpath("data/prompts.jsonl").read_text(encoding="utf-8")
    return [json.loads(line)["prompt"] for line in jsonl_lines(text) if line.strip()]


def _log(msg: str) -> None:
    print(f"[train-head] {msg}", file=sys.stderr, flush=True)


def _check_output(path: Path, flag: str = "--output") -> None:
    """A usage error if the head cannot be saved at ``path``: a directory, under a file, or in a
    directory this process cannot write (``flag`` names where the path came from)."""
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory: give the head's file, e.g. {path / 'head.safetensors'}")
    place = unwritable_place(path)
    if place is not None:
        why = "not writable" if place.is_dir() else "a file, not a directory"
        raise UsageError(f"{flag} {path}: {place} is {why}")


def cmd_train_head(args: argparse.Namespace) -> int:
    check_quant_dtype({"--quant": args.quant}, {"--dtype": args.dtype})
    check_model_ref("--model", args.model, args.cache_dir)
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise UsageError(f"--lr must be a positive finite number, got {args.lr}")
    if args.output:  # checked before hours of work, not at the save
        _check_output(Path(args.output))
    if args.replies and not Path(args.replies).exists():  # written after the generation: checked before it
        _check_output(Path(args.replies), "--replies")
    prompts = read_prompts_file(args.prompts) if args.prompts else default_prompts()
    texts = [read_text_arg(path, "--texts") for path in args.texts]
    from tokenleap.api import LLM
    from tokenleap.heads.eagle import EagleConfig, default_head_path
    from tokenleap.heads.features import FeatureStore, text_pieces
    from tokenleap.heads.train import TrainConfig, held_out_split, train_head
    from tokenleap.models.catalog import default_cache_dir

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, quant=args.quant, cache_dir=args.cache_dir,
              speculative={"method": "auto", "draft_model": "auto"}, max_num_seqs=8, num_slots=8)
    root = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    name = llm.target.source.removeprefix("catalog:")
    out = Path(args.output) if args.output else default_head_path(root, name)
    if not args.output:  # (the default place, in the cache: before the replies and the training)
        _check_output(out, "the head's place in the cache,")
    store = FeatureStore.for_target(root, llm.target, _log)
    replies = Path(args.replies) if args.replies else None
    train = TrainConfig(epochs=args.epochs, lr=args.lr, second_step=args.second_step)
    replied = store.get(llm.target.model, _replies(llm, prompts, args.max_tokens, replies), "replies")
    valid, examples = held_out_split(replied, train.valid_share, train.seed)  # held out: the target's own text
    for path, text in zip(args.texts, texts):
        examples += store.get(llm.target.model, text_pieces(llm.tokenizer.encode(text), train.window), path)
    _log(f"{len(examples) + len(valid)} texts, {sum(int(e.tokens.shape[0]) for e in examples + valid)} tokens "
         f"({time.perf_counter() - t0:.0f} s)")
    if not examples:
        raise UsageError("nothing to train on: the replies and --texts hold no text of 3 tokens or more")
    model = llm.target.model
    cfg = EagleConfig.for_target(model.config, args.intermediate_size, target=args.model)
    specials = llm.tokenizer.backend.get_added_tokens_decoder().keys()
    head, report = train_head(model, examples, cfg, specials, train, _log, valid=valid)
    head.save(out)
    report.update(path=str(out), intermediate_size=cfg.intermediate_size,
                  total_seconds=round(time.perf_counter() - t0, 1))
    if args.json:
        print(json.dumps(report))
    else:
        print(f"saved {out}: held-out agreement {report.get('held_out_agreement', 'n/a')}, "
              f"{report['tokens']} tokens, {report['seconds']} s training")
    return 0


def _replies(llm, prompts: list[str], max_tokens: int, path: Path | None) -> list[list[int]]:
    """Each prompt (chat template) followed by the target's greedy reply, as token ids; read from
    ``path`` when it exists, else generated (and written there when given)."""
    from tokenleap.config import SamplingParams
    if path is not None and path.exists():
        try:
            rows = [json.loads(line) for line in jsonl_lines(read_text_arg(str(path), "--replies")) if line.strip()]
            out = [[int(t) for t in r["prompt"]] + [int(t) for t in r["output"]] for r in rows]
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"--replies {path}: not a replies file this command wrote (each line a JSON object "
                             f"with token id lists \"prompt\" and \"output\"): {e}") from None
        if not out:  # (said before a features file of nothing is stored for it)
            raise UsageError(f"--replies {path} holds no replies: give a file this command wrote, or a path that "
                             "does not exist yet to generate the replies there")
        vocab = llm.target.model.config.vocab_size
        if any(not 0 <= t < vocab for ids in out for t in ids):
            raise UsageError(f"--replies {path}: token ids outside this model's vocabulary ({vocab}): "
                             "a replies file written for another model")
        _log(f"{len(rows)} replies read from {path}")
        return out
    rows, t0 = [], time.perf_counter()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i in range(0, len(prompts), llm.max_num_seqs):
        batch = [[{"role": "user", "content": p}] for p in prompts[i:i + llm.max_num_seqs]]
        rows += [{"prompt": list(o.prompt), "output": list(o.token_ids)} for o in llm.chat(batch, params)]
        _log(f"replies: {len(rows)}/{len(prompts)} ({time.perf_counter() - t0:.0f} s)")
    if path is not None:  # written whole: an interrupted run leaves no file a rerun would take as complete
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return [r["prompt"] + r["output"] for r in rows]
