"""Time one decode / verification step of a real model: a forward over R new rows (row-exact, as
verification computes them) after a 200-token prompt, with the compiled decoder layer and with the
Python layers (or, with ``--compare vnni``, int4 / int6 products on the AVX2 tiles and on the AVX-512
VNNI ones), alternating, median ms over repeats.

    python scripts/bench_steps.py --model qwen2.5-coder-1.5b-instruct --rows 1 2 4 6
    python scripts/bench_steps.py --model qwen2.5-coder-0.5b-instruct --gguf-other int4 --rows 1
    python scripts/bench_steps.py --compare vnni --rows 1 2 4 6 8
    python scripts/bench_steps.py --compare amx --rows 4 6 8 12 16   # an AMX CPU: AMX-INT8 vs VNNI tiles
    python scripts/bench_steps.py --compare pair --pair-rows 5 --rows 3 4 5   # blocked int6's VNNI two-block tiles from 4 vs 5 rows
    python scripts/bench_steps.py --compare attention512 --prompt 2000 --rows 1 4   # AVX-512 vs AVX2 attention
    python scripts/bench_steps.py --random-like config.json --quant int4 --rows 1 4 8 16

``--random-like`` builds the model from a Hugging Face config.json with random weights instead
(quantized by tokenleap's own quantizer, every layer alike; W8A8 without smoothing), for machines
that hold no checkpoint: a step's time depends on the shapes and kinds of its weights, not their
values.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tokenleap import kernels
from tokenleap.cache.contiguous import KVCache
from tokenleap.config import ModelConfig
from tokenleap.models.build import build_transformer
from tokenleap.models.pretrained import load_model, prepare_for_kernels_, resolve_dtype
from tokenleap.models.quant import quantize_
from tokenleap.models.transformer import Segment, Transformer


def random_model(config_path: str, dtype: str, quant: str) -> Transformer:
    """A model of ``config_path``'s shape with random weights (normal, std 0.02; norms at 1)."""
    config = ModelConfig.from_hf_dict(json.loads(open(config_path).read()))
    dt = resolve_dtype(dtype)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    weights = {name: (torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=g) * 0.02).to(dt)
               for name, shape in shapes.items() if not name.endswith("rotary_emb.inv_freq")}
    model = build_transformer(config, weights, dt)
    del weights
    if quant != "none":
        quantize_(model, quant)
    prepare_for_kernels_(model, dt, quant)
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--dtype", default="auto", help="e.g. bfloat16 (with --quant none)")
    ap.add_argument("--gguf-other", default="int8", help="how a GGUF's non-4-bit tensors load (drafts: int4)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6])
    ap.add_argument("--random-like", metavar="CONFIG_JSON", help="random weights in this HF config's shape")
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--pair-rows", type=int, default=1000,
                    help="with --compare pair: the other threshold of the VNNI two-block tiles on blocked int6 "
                         "tensors (default: never; paired tensors take them at every row count)")
    ap.add_argument("--compare", choices=["layers", "vnni", "amx", "pair", "attention512"], default="layers",
                    help="layers: compiled vs Python decoder layers; vnni: int4 / int6 on the AVX2 vs the AVX-512 VNNI "
                         "tiles (the AVX2 tiles reading this machine's paired layout, slower than an AVX2 machine's "
                         "blocked one); amx: int4 / int6 on the AMX-INT8 tiles (from AMX_INT8_MIN_ROWS rows) vs the VNNI tiles; "
                         "pair: the VNNI two-block tiles from the built-in row count vs from --pair-rows; "
                         "attention512: the AVX-512 attention kernel vs the AVX2 one")
    args = ap.parse_args()
    if args.random_like:
        model = random_model(args.random_like, args.dtype, args.quant)
        args.model = f"random weights shaped like {args.random_like}"
    else:
        model = load_model(args.model, dtype=args.dtype, quant=args.quant, gguf_other=args.gguf_other).model
    cache = KVCache(model.config, 1, args.prompt + max(args.rows) + 1, model.dtype)
    slot = cache.allocate()
    model(torch.randint(0, 1000, (args.prompt,), generator=torch.Generator().manual_seed(0)),
          [Segment(slot, 0, args.prompt)], cache)
    if args.compare in ("vnni", "amx", "pair") and not kernels.vnni_supported():
        raise SystemExit(f"--compare {args.compare}: this CPU has no AVX-512 VNNI")
    if args.compare == "attention512" and not kernels.attention512_supported():
        raise SystemExit("--compare attention512: this CPU has no AVX-512")
    if args.compare == "amx" and not kernels.w8a8_available():  # (AMX-INT8 tiles granted)
        raise SystemExit("--compare amx: this CPU has no AMX-INT8 tiles")
    labels = {"layers": ("compiled layers", "python layers"), "vnni": ("VNNI tiles", "AVX2 tiles"),
              "amx": ("AMX-INT8 tiles", "VNNI tiles"), "attention512": ("AVX-512 attention", "AVX2 attention"),
              "pair": ("two-block tiles built-in", f"from {args.pair_rows} rows")}[args.compare]
    times: dict[tuple[bool, int], list[float]] = {}
    for _ in range(args.repeats):
        for fused in (True, False):
            if args.compare == "layers":
                model.use_fused_layers = fused
            elif args.compare == "vnni":
                kernels.set_vnni(fused)
            elif args.compare == "attention512":
                kernels.set_attention512(fused)
            elif args.compare == "pair":
                kernels.set_vnni_pair_rows(0 if fused else args.pair_rows)
            else:
                kernels.set_vnni(True)
                kernels.set_amx_int8_rows(kernels.AMX_INT8_MIN_ROWS if fused else 0)
            for rows in args.rows:
                t = time.perf_counter()
                model(torch.arange(rows), [Segment(slot, args.prompt, rows)], cache, row_exact=True)
                times.setdefault((fused, rows), []).append(time.perf_counter() - t)
    print(f"{args.model} ({args.dtype}, {args.quant}, other {args.gguf_other}), {torch.get_num_threads()} threads; median ms")
    for rows in args.rows:
        f, p = (statistics.median(times[(fz, rows)]) * 1e3 for fz in (True, False))
        print(f"rows {rows}: {labels[0]} {f:.1f}  {labels[1]} {p:.1f}")


if __name__ == "__main__":
    main()
