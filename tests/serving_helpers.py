"""Shared pieces of the serving tests: a paged engine on a tiny model, the same request run alone,
a ToyTokenizer with a chat template, and a real uvicorn server on a free loopback port."""
from __future__ import annotations

import threading
import time

import torch
import uvicorn

from tokenleap.config import SamplingParams
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.cache.paged import PagedKVCache
from tokenleap.spec.proposers.draft_model import DraftModelProposer
from tokenleap.spec.proposers.ngram import NgramProposer

from conftest import ToyTokenizer, tiny_model

VOCAB = 96
MAX_LEN = 128
CHUNK = 8  # prefill chunk: small, so prompts span several chunks


class ChatToyTokenizer(ToyTokenizer):
    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class EncodeChatToy(ChatToyTokenizer):
    """The toy chat template behind ``encode_chat`` (what real tokenizers have), tools shown as text."""

    def encode_chat(self, messages, add_generation_prompt=True, continue_final_message=False, tools=None, **kw):
        text = self.apply_chat_template(messages, add_generation_prompt and not continue_final_message)
        return self.encode(("<tools>" + ",".join(t["function"]["name"] for t in tools) if tools else "") + text)


BOS = 1


class BosToyTokenizer(ChatToyTokenizer):
    """The toy tokenizer with a BOS before encoded text, as Llama's and Gemma's tokenizers add one."""

    bos_token_id = BOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + super().encode(text)


_MODELS: dict[int, object] = {}


def model(seed: int = 1):
    if seed not in _MODELS:
        _MODELS[seed] = tiny_model("qwen2", seed=seed, vocab=VOCAB)
    return _MODELS[seed]


def proposer(kind: str | None, blocks: int, slots: int, block_size: int = 16, window: int = 256,
             max_len: int = MAX_LEN):
    """``window``: the draft's catch-up chunk, also the windows its prefix cache keeps."""
    if kind is None:
        return None
    if kind == "ngram":
        return NgramProposer(3, 1)
    draft = model(77) if kind == "draft" else model(1)  # "self-draft": the target drafts for itself
    cache = PagedKVCache(draft.config, blocks, max_len, torch.float32, block_size=block_size, num_slots=slots)
    return DraftModelProposer(draft, VOCAB, max_len, cache=cache, catch_up_chunk=window)


def paged_engine(kind: str | None = None, blocks: int = 64, slots: int = 16, k: int | str = "auto",
                 chunk: int = CHUNK, block_size: int = 16, max_len: int = MAX_LEN) -> Engine:
    """(With the default chunk of 8 and blocks of 16 no prompt window is whole blocks: no prefix caching.)"""
    cache = PagedKVCache(model().config, blocks, max_len, torch.float32, block_size=block_size, num_slots=slots)
    fixed = None if k == "auto" else k
    return Engine(model(), ChatToyTokenizer(VOCAB), max_len=max_len, prefill_chunk=chunk, cache=cache,
                  proposer=proposer(kind, blocks, slots, block_size, chunk if chunk != CHUNK else 256, max_len),
                  controller=ControllerConfig(max_k=4, fixed_k=fixed))


def alone(prompt: list[int], params: SamplingParams, chunk: int = CHUNK):
    """The sequence run by itself through a plain engine (contiguous cache, same prefill chunk)."""
    eng = Engine(model(), ChatToyTokenizer(VOCAB), max_len=MAX_LEN, prefill_chunk=chunk)
    *_, (seq, _) = eng.generate(prompt, params)
    return seq


def serve_workload_equals_alone(eng: Engine, sampled: bool, n: int = 12, seed: int = 1):
    """``workload(n, seed)`` submitted at once to a scheduler over ``eng`` and run to the end (seeded
    sampling when ``sampled``); asserts each output equals the request run alone; returns the scheduler."""
    from tokenleap.serve.scheduler import Request, Scheduler, SchedulerConfig
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=16, log_interval=0))
    jobs = []
    for i, (prompt, tokens) in enumerate(workload(n, seed)):
        extra = dict(temperature=0.8, top_p=0.95, seed=1000 + i) if sampled else {}
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, **extra)
        sink: list = []
        sched.submit([Request(eng.create(prompt, params), sink.append)])
        jobs.append((prompt, params, sink))
    sched.run_until_idle()
    for prompt, params, sink in jobs:
        assert [t for o in sink for t in o.token_ids] == alone(prompt, params).generated, prompt
    return sched


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) pairs of mixed lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(1, 45, (1,), generator=g))
        prompt = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        if length > 10:  # some repetition, so n-gram drafts get accepted
            prompt = prompt[: length // 2] * 2
        out.append((prompt, int(torch.randint(1, 50, (1,), generator=g))))
    return out


class FailingProposer:
    """Wraps a proposer; its proposals fail for sequences whose prompt starts with token 66."""

    name = "failing"

    def __init__(self, inner) -> None:
        self.inner, self.bad = inner, set()

    def begin(self, seq_id, prompt):
        if prompt[0] == 66:
            self.bad.add(seq_id)
        self.inner.begin(seq_id, prompt)

    def prefill(self, seq_id, tokens):
        self.inner.prefill(seq_id, tokens)

    def propose(self, seq_id, tokens, k, params, generator):
        if seq_id in self.bad:
            raise RuntimeError("boom in propose")
        return self.inner.propose(seq_id, tokens, k, params, generator)

    def propose_many(self, requests):
        if any(r.seq_id in self.bad for r in requests):
            raise RuntimeError("boom in propose")
        return self.inner.propose_many(requests)

    def backlog(self, seq_id, tokens):
        return self.inner.backlog(seq_id, tokens)

    def accept(self, seq_id, n):
        self.inner.accept(seq_id, n)

    def end(self, seq_id):
        self.inner.end(seq_id)


def wait_until(predicate, timeout: float = 60.0) -> bool:
    """Poll ``predicate`` (no assertion on timing: only a generous upper bound)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1 at a free port, in a thread."""

    def __init__(self, app) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.app = app

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        if not wait_until(lambda: self.server.started, 30):
            raise RuntimeError("uvicorn did not start")
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def scheduler(self):
        return self.app.state.server.scheduler
