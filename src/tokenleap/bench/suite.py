"""``bench(...)``: dataset + models + methods -> ``run_bench``; what ``tokenleap bench`` calls."""
from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenleap.bench.common import BenchError, BenchMethod
from tokenleap.bench.datasets import BenchPrompt, load_dataset
from tokenleap.bench.machine import machine_info, rss_mb, versions
from tokenleap.bench.methods import MethodSpec, ModelOptions, ModelPool, build_methods, describe_target, parse_methods
from tokenleap.bench.runner import BenchSettings, check_out_dir, check_resume, run_bench
from tokenleap.config import ConfigError, SamplingParams
from tokenleap.spec.sampling import torch_seed

_NEEDS_DRAFT = ("draft", "draft-tree", "cascade", "hf-assisted")


def encode_prompts(tokenizer, prompts: list[BenchPrompt], chat: bool) -> list[list[int]]:
    """Token ids per prompt: the chat template around the user message, or the raw text; a
    fill-in-the-middle prompt (``extra["suffix"]``) as the model's FIM prompt, chat or not."""
    def encode(p: BenchPrompt) -> list[int]:
        if "suffix" in p.extra:
            return fim_prompt(tokenizer, p)[0]
        if chat:
            return tokenizer.encode_chat([{"role": "user", "content": p.user_message}])
        return tokenizer.encode(p.text)
    return [encode(p) for p in prompts]


def stop_ids(tokenizer, prompts: list[BenchPrompt]) -> list[tuple[int, ...]]:
    """Tokens besides EOS that end each prompt's reply: a FIM prompt's bookkeeping tokens."""
    return [fim_prompt(tokenizer, p)[1].stop_ids if "suffix" in p.extra else () for p in prompts]


def fim_prompt(tokenizer, p: BenchPrompt):
    from tokenleap.config import ConfigError
    from tokenleap.text.fim import encode_fim
    try:
        return encode_fim(tokenizer, p.text, p.extra["suffix"])
    except ConfigError as e:
        raise BenchError(f"prompt {p.id} fills in the middle: {e}") from None


def bench(target: str, *, draft: str | None = None, dataset: str = "humaneval",
          methods: str | Sequence[MethodSpec] = "plain,ngram", limit: int | None = None,
          max_new_tokens: int = 128, temperature: float = 0.0, seed: int = 0, repeats: int = 1,
          out: str | Path = "bench-results", dtype: str = "auto", quant: str = "none",
          draft_quant: str = "none", resume: bool = False, chat: bool = True, pass_at_1: bool = False,
          cache_dir: str | None = None, threads: int | None = None, progress: bool = True,
          command: str | None = None, extra_methods: Sequence[BenchMethod] = ()) -> dict[str, Any]:
    """Run a benchmark and write results.json, results.jsonl, report.md and PNGs into ``out``."""
    import torch

    from tokenleap.bench.plots import require_matplotlib
    require_matplotlib()  # a run's plots are drawn at its end: refuse before hours of measuring
    try:  # every request's sampling checked before anything is written or loaded
        SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed)
    except ConfigError as e:
        raise BenchError(str(e).replace("temperature", "--temperature", 1)) from None
    specs = parse_methods(methods) if isinstance(methods, str) else list(methods)
    missing_draft = [s.name for s in specs if s.family in _NEEDS_DRAFT and not s.get("model")]
    if missing_draft and not draft:  # (a method naming its own draft, model=NAME, needs no --draft)
        raise BenchError(f"method(s) {', '.join(missing_draft)} need a draft model: pass --draft MODEL "
                         f"(or the method's own, e.g. draft:model=NAME)")
    pooled = [s.name for s in specs if s.get("pool")]
    if pooled and repeats > 1:  # a repeat would draft from the output of the one before it
        raise BenchError(f"method(s) {', '.join(pooled)} keep earlier outputs (pool=N): run them with --repeats 1")
    if pooled and resume:  # the requests run before the interruption would be missing from their pools
        raise BenchError(f"method(s) {', '.join(pooled)} keep earlier outputs (pool=N), which a resumed run would "
                         "not have: run them again from the start")
    ds = load_dataset(dataset, limit)
    if pass_at_1 and not any("test" in p.extra for p in ds.prompts):
        raise BenchError(f"--pass-at-1 runs the prompts' tests, and dataset {dataset!r} has none here (humaneval, "
                         "fim and the mix's code prompts do)")
    check_out_dir(Path(out), resume)  # before any model loads
    threads = threads or torch.get_num_threads()
    named = Path(dataset).expanduser()  # a file however its path is spelled; a built-in set by its name
    known = {"target": target, "draft": draft, "dataset": str(named.resolve()) if named.is_file() else dataset,
             "dataset_sha256": ds.digest, "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed,
             "quant": quant, "draft_quant": draft_quant, "threads": threads}
    if resume:
        check_resume(Path(out), known)
    torch.set_num_threads(threads)
    torch.manual_seed(torch_seed(seed))
    rss_before = rss_mb()
    pool = ModelPool(ModelOptions(target, draft, dtype, quant, draft_quant, cache_dir, threads))
    t0 = time.perf_counter()
    tok = pool.target().tokenizer  # loads the target (shared by every method)
    target_seconds = round(time.perf_counter() - t0, 2)
    # (fill-in-the-middle prompts are the model's FIM prompts, never chat)
    use_chat = chat and bool(tok.chat_template) and not all("suffix" in p.extra for p in ds.prompts)
    prompt_ids = encode_prompts(tok, ds.prompts, use_chat)
    limit_len = pool.target().model.config.max_context
    for p, ids in zip(ds.prompts, prompt_ids):  # every prompt fits before any request runs
        if len(ids) >= limit_len:
            raise BenchError(f"prompt {p.id} has {len(ids)} tokens and the model reads {limit_len} positions: "
                             "shorten it or leave it out of the dataset")
    pool.opts.max_len = min(max(map(len, prompt_ids)) + max_new_tokens + 16, limit_len)
    built, infos = build_methods(specs, pool)
    identity = {**known, "dtype": str(pool.dtype).removeprefix("torch."), "chat": use_chat}
    settings = BenchSettings(Path(out), max_new_tokens, temperature, seed, repeats, resume, use_chat,
                             pass_at_1, progress=progress, identity=identity)
    context = {"command": command or shlex.join(sys.argv), "machine": machine_info(), "versions": versions(),
               "dataset": ds.describe(), "target_model": describe_target(pool), "threads": threads, "rss_before_load_mb": rss_before,
               "target_load_seconds": target_seconds}
    return run_bench(settings, ds.prompts, prompt_ids, [*built, *extra_methods],
                     infos + [_info(m) for m in extra_methods], context, stop_ids(tok, ds.prompts))


def _info(method: BenchMethod):
    from tokenleap.bench.common import MethodInfo
    return MethodInfo(method.name, method.name.partition(":")[0], method.kind)
