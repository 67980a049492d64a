"""Replay held-out replies through a draft head that keeps learning, and report its agreement.

The question: would a head that takes a training step on what the target has just written (online
distillation) agree with the target more on what comes next? Without changing the proposer, the
replies ``train-head`` held out are replayed in order: every ``--every`` positions the head predicts
the next ones from the target's features (its argmax against the target's), then takes one AdamW
step (the training loss, bf16 autocast where native) on the last ``--window`` positions; what it
learns carries from one reply to the next. ``--lr 0`` gives the head as trained.

    python scripts/head_online_replay.py --model qwen2.5-coder-1.5b-instruct --replies gen.jsonl \\
        --head eagle_big.safetensors --every 64 --window 128 --lr 3e-5
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--quant", default="int4")
    p.add_argument("--replies", required=True, help="the replies file train-head wrote (its held-out share is used)")
    p.add_argument("--head", required=True)
    p.add_argument("--every", type=int, default=64)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-5)
    args = p.parse_args()

    from tokenleap.api import LLM
    from tokenleap.heads.eagle import EagleHead
    from tokenleap.heads.features import FeatureStore
    from tokenleap.heads.train import TrainConfig, _loss, _run, held_out_split, subset_ids
    from tokenleap.models.catalog import default_cache_dir
    from tokenleap.models.pretrained import cpu_has_native_bf16
    from tokenleap.spec.proposers.draft_head import float_rows

    llm = LLM(args.model, quant=args.quant)
    model = llm.target.model
    rows_json = [json.loads(line) for line in open(args.replies, encoding="utf-8") if line.strip()]
    sequences = [[int(t) for t in r["prompt"]] + [int(t) for t in r["output"]] for r in rows_json]
    store = FeatureStore.for_target(default_cache_dir(), llm.target, print)
    train = TrainConfig()
    valid, _ = held_out_split(store.get(model, sequences, "replies"), train.valid_share, train.seed)
    head = EagleHead.load(args.head)
    specials = llm.tokenizer.backend.get_added_tokens_decoder().keys()
    rows = float_rows(model.lm_head, subset_ids(head.cfg, specials)).float()  # [S, H]
    bf16 = cpu_has_native_bf16()
    train_rows = rows.bfloat16() if bf16 else rows
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr or 1.0, betas=(0.9, 0.95), weight_decay=0.0)
    agree = count = steps = 0
    learning = 0.0
    for ex in valid:
        n = ex.tokens.shape[0]
        for c in range(0, n - 1, args.every):
            end = min(n, c + args.every + 1)
            with torch.no_grad():
                pred, true, _ = _run(head, model, ex, 0, end, 0.0, None)  # the whole reply so far as context
            agree += int(((pred[c:] @ rows.T).argmax(-1) == (true[c:] @ rows.T).argmax(-1)).sum())
            count += end - 1 - c
            if args.lr > 0:
                t0 = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    pred, true, _ = _run(head, model, ex, max(0, end - args.window - 1), end, train.feature_noise, None)
                    loss, _ = _loss(pred, true, train_rows, train.ce_weight)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                opt.step()
                learning += time.perf_counter() - t0
                steps += 1
    print(json.dumps({"lr": args.lr, "every": args.every, "window": args.window, "positions": count,
                      "agreement": round(agree / max(1, count), 4), "steps": steps,
                      "learning_ms_a_position": round(1000 * learning / max(1, count), 2)}))


if __name__ == "__main__":
    main()
