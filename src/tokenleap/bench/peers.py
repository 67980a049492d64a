"""Peers measured in the same run: Hugging Face transformers ``generate`` and llama.cpp.

Both get the same prompt token ids as tokenleap. transformers runs the weights tokenleap converted
from the same GGUF (the cached safetensors directory, in the bench dtype, unquantized); llama.cpp
runs the GGUF file itself, with its own quantized kernels. A peer whose package is missing is
recorded as skipped; one that fails to load is recorded as failed. Neither stops the run.
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

from tokenleap.config import SamplingParams
from tokenleap.bench.common import PEER, Generation, MethodInfo
from tokenleap.bench.methods import MethodSpec, ModelPool

HF_PROMPT_LOOKUP_K = 10  # the value transformers' documentation uses
LLAMACPP_LOOKUP_K, LLAMACPP_LOOKUP_NGRAM = 10, 2  # LlamaPromptLookupDecoding's defaults


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def build_peer(spec: MethodSpec, pool: ModelPool, info: MethodInfo) -> Any | None:
    """The peer method, or None with ``info.status`` set to skipped / failed and the reason."""
    package = "transformers" if spec.family.startswith("hf-") else "llama_cpp"
    if not _installed(package):
        pip = "transformers accelerate" if package == "transformers" else "llama-cpp-python==0.3.36 diskcache"
        info.status, info.reason = "skipped", f"{package} is not installed (pip install {pip})"
        return None
    try:
        return _build_hf(spec, pool) if package == "transformers" else _build_llamacpp(spec, pool)
    except Exception as e:  # a peer's own failure must not end the run
        info.status, info.reason = "failed", f"could not load: {type(e).__name__}: {e}"
        return None


# -- Hugging Face transformers ---------------------------------------------------------------
def hf_model_dir(loaded, dtype, cache_dir: str | None) -> Path:
    """A directory transformers can load: the converted GGUF (cached), or the HF directory itself."""
    if loaded.gguf_path is not None:
        from tokenleap.models.checkpoint import convert_gguf
        return convert_gguf(Path(loaded.gguf_path), dtype, Path(cache_dir) if cache_dir else None)
    return Path(loaded.source.removeprefix("hf:"))


def _load_hf(pool: ModelPool, which: str):
    def make():
        import torch
        import transformers
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()  # (its weight-loading bar: the bench draws its own progress)
        loaded = pool.target() if which == "target" else pool.draft("hf-assisted")
        path = hf_model_dir(loaded, loaded.dtype, pool.opts.cache_dir)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=loaded.dtype)
        model.eval()
        torch.set_num_threads(pool.opts.threads)
        return model
    return pool.get(f"hf-{which}", make)


def _build_hf(spec: MethodSpec, pool: ModelPool) -> "HFMethod":
    kwargs: dict[str, Any] = {}
    if spec.family == "hf-assisted":
        kwargs["assistant_model"] = _load_hf(pool, "draft")
        if spec.get("k"):
            kwargs.update(num_assistant_tokens=int(spec.get("k")), num_assistant_tokens_schedule="constant")
    elif spec.family == "hf-prompt-lookup":
        kwargs["prompt_lookup_num_tokens"] = int(spec.get("k", HF_PROMPT_LOOKUP_K))
        if spec.get("max"):
            kwargs["max_matching_ngram_size"] = int(spec.get("max"))
    target = pool.target()
    method = HFMethod(spec.name, _load_hf(pool, "target"), kwargs, target.tokenizer)
    method.detail = {"engine": "transformers", "dtype": str(target.dtype).removeprefix("torch."),
                     "quant": "none (dequantized weights)"}
    return method


class HFMethod:
    kind = PEER

    def __init__(self, name: str, model, gen_kwargs: dict[str, Any], tokenizer) -> None:
        self.name, self.model, self.gen_kwargs, self.tokenizer = name, model, gen_kwargs, tokenizer
        self.eos = [int(i) for i in tokenizer.eos_token_ids]
        self.detail: dict[str, Any] = {}

    def _sampling(self, params: SamplingParams) -> dict[str, Any]:
        if params.greedy:
            return {"do_sample": False}
        import torch
        from tokenleap.spec.sampling import torch_seed
        if params.seed is not None:
            torch.manual_seed(torch_seed(params.seed))
        return {"do_sample": True, "temperature": params.temperature, "top_k": params.top_k,
                "top_p": params.top_p, "min_p": params.min_p or None}

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        import torch
        ids = torch.tensor([prompt_ids])  # [1, prompt]
        eos = [*([] if params.ignore_eos else self.eos), *params.stop_token_ids] or None
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_tokens,
                                      eos_token_id=eos, pad_token_id=self.eos[0] if self.eos else 0,
                                      **self._sampling(params), **self.gen_kwargs)
        seconds = time.perf_counter() - t0
        new = out[0, len(prompt_ids):].tolist()
        reason = "stop" if new and eos and new[-1] in eos else "length"
        return Generation(new, self.tokenizer.decode(new), seconds, reason)


# -- llama.cpp ---------------------------------------------------------------------------------
def _build_llamacpp(spec: MethodSpec, pool: ModelPool) -> "LlamaCppMethod":
    try:
        import llama_cpp
    except ModuleNotFoundError as e:  # (its package does not pull in diskcache, which it imports)
        raise ModuleNotFoundError(f"{e}: the llama.cpp peers need `pip install llama-cpp-python==0.3.36 "
                                  "diskcache` (which builds llama.cpp from source: minutes)") from None
    target = pool.target()
    if target.gguf_path is None:
        raise ValueError("llama.cpp needs a GGUF target (a catalog name or a .gguf file)")
    draft = None
    if spec.family == "llamacpp-prompt-lookup":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        draft = LlamaPromptLookupDecoding(max_ngram_size=int(spec.get("max", LLAMACPP_LOOKUP_NGRAM)),
                                          num_pred_tokens=int(spec.get("k", LLAMACPP_LOOKUP_K)))
    threads = pool.opts.threads
    llm = llama_cpp.Llama(model_path=str(target.gguf_path), n_ctx=pool.opts.max_len + 32, n_threads=threads,
                          n_threads_batch=threads, draft_model=draft, verbose=False)
    method = LlamaCppMethod(spec.name, llm, target.tokenizer)
    method.detail = {"engine": "llama.cpp", "weights": Path(target.gguf_path).name, "threads": threads}
    if draft is not None:  # (llama_cpp_python's lookup computes logits for every prompt row, llama.cpp's own does not)
        method.detail["engine"] = "llama.cpp through llama_cpp_python's prompt lookup (logits of every row)"
    return method


class LlamaCppMethod:
    kind = PEER

    def __init__(self, name: str, llm, tokenizer) -> None:
        self.name, self.llm, self.tokenizer = name, llm, tokenizer
        self.eos = {int(i) for i in tokenizer.eos_token_ids}
        self.detail: dict[str, Any] = {}

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        greedy = params.greedy
        if params.seed is not None:
            self.llm.set_seed(params.seed)
        t0 = time.perf_counter()
        self.llm.reset()  # no prefix reuse from the previous request: every request pays its prefill
        out: list[int] = []
        reason = "length"
        for tok in self.llm.generate(prompt_ids, top_k=1 if greedy else params.top_k, top_p=params.top_p,
                                     min_p=params.min_p, temp=0.0 if greedy else params.temperature,
                                     repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if (int(tok) in self.eos and not params.ignore_eos) or int(tok) in params.stop_token_ids:
                reason = "stop"
                break
            if len(out) >= params.max_tokens:
                break
        seconds = time.perf_counter() - t0
        return Generation(out, self.tokenizer.decode(out), seconds, reason)
