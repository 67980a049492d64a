"""``LLM.close()``: what an LLM holds is freed now, calls after it and streams still open fail clearly."""
from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest
import torch

from tokenleap.api import LLM
from tokenleap.config import SamplingParams, SpecConfig
from tokenleap.errors import LLMClosedError
from tokenleap.models.pretrained import LoadedModel
from tokenleap.spec.engine import Engine

from conftest import tiny_model
from serving_helpers import VOCAB, EncodeChatToy
from test_async_api import _gate_steps as gate_steps

PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


def make_llm() -> LLM:
    """(a model of its own: the helpers' shared one is kept for other tests)"""
    loaded = LoadedModel(tiny_model("qwen2", seed=1, vocab=VOCAB), EncodeChatToy(VOCAB), torch.float32, "none",
                         "tiny", None)
    return LLM.from_loaded(loaded, SpecConfig(method="ngram"), max_model_len=96)


async def _astream_ids(llm: LLM, prompt: str) -> list[int]:
    return [c async for c in llm.astream(prompt, PARAMS)][-1].output.token_ids


def _gate_steps(monkeypatch, at: int):
    return gate_steps(monkeypatch, Engine, at)


def _read_in_thread(llm: LLM) -> tuple[threading.Thread, dict]:
    """A thread reading a stream of ``llm`` to its end (started); what it read or raised lands in the dict."""
    result: dict[str, object] = {}

    def read() -> None:
        try:
            result["chunks"] = list(llm.stream("abcabc", PARAMS))
        except Exception as e:  # (what the stream raised: the test checks it)
            result["error"] = e
    reader = threading.Thread(target=read)
    reader.start()
    return reader, result


def test_close_frees_the_weights_engines_and_scheduler_and_later_calls_fail_clearly():
    llm = make_llm()
    want = llm.generate("abcabc", PARAMS)[0].token_ids
    assert asyncio.run(_astream_ids(llm, "abcabc")) == want
    assert [c for c in llm.stream("abcabc", PARAMS)][-1].output.token_ids == want
    weights = weakref.ref(llm.target.model)
    engines = [weakref.ref(llm.engine), weakref.ref(llm._coroutines.engine)]
    thread = llm._coroutines._thread
    llm.close()
    gc.collect()
    assert llm.closed and not thread.is_alive()
    assert weights() is None and all(e() is None for e in engines)
    calls = [lambda: llm.generate("abc", PARAMS), lambda: llm.generate(["abc", "xyz"], PARAMS),
             lambda: list(llm.stream("abc", PARAMS)), lambda: llm.chat([{"role": "user", "content": "abc"}]),
             lambda: llm.encode("abc"), lambda: llm.engine, lambda: llm.describe(), lambda: llm.embed("abc"),
             lambda: llm.get_tokenizer(), lambda: asyncio.run(_astream_ids(llm, "abc")),
             lambda: asyncio.run(llm.agenerate("abc", PARAMS))]
    for call in calls:
        with pytest.raises(LLMClosedError, match="closed"):
            call()
    llm.close()  # (again: nothing to do)


def test_a_with_block_closes_the_llm():
    with make_llm() as llm:
        assert len(llm.generate("abcabc", PARAMS)[0].token_ids) == 40
    assert llm.closed and not llm.target and not llm.draft
    with pytest.raises(LLMClosedError):  # (a call that read the models just after the close: a clear error)
        llm.target.model  # noqa: B018


def test_a_stream_on_another_thread_ends_after_the_step_in_flight(monkeypatch):
    """close() waits for the step another thread has in flight, then that stream raises before its next."""
    llm = make_llm()
    gate, stepping, calls = _gate_steps(monkeypatch, at=3)
    reader, result = _read_in_thread(llm)
    assert stepping.wait(60)
    closer = threading.Thread(target=llm.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()  # waiting for the step in flight
    gate.set()
    closer.join(60)
    reader.join(60)
    assert not closer.is_alive() and not reader.is_alive()
    assert isinstance(result.get("error"), LLMClosedError) and len(calls) == 3


def test_an_open_astream_raises_once_the_llm_is_closed(monkeypatch):
    llm = make_llm()
    gate, stepping, calls = _gate_steps(monkeypatch, at=3)

    async def main():
        task = asyncio.create_task(_astream_ids(llm, "abcabc"))
        await asyncio.to_thread(stepping.wait, 60)
        closer = threading.Thread(target=llm.close)
        closer.start()
        gate.set()
        await asyncio.to_thread(closer.join, 60)
        with pytest.raises(LLMClosedError):
            await asyncio.wait_for(task, 60)
    asyncio.run(main())
    assert len(calls) == 3


def test_a_scheduler_shut_down_refuses_later_requests_rather_than_queue_them_for_ever():
    from tokenleap.serve.request import QueueFullError, Request
    llm = make_llm()
    asyncio.run(_astream_ids(llm, "abc"))
    scheduler = llm._coroutines
    seq = scheduler.engine.create(llm.encode("abc"), PARAMS)
    scheduler.shutdown("gone")
    with pytest.raises(QueueFullError, match="gone"):
        scheduler.submit([Request(seq, lambda out: None)])


def test_a_close_during_the_engines_build_waits_for_it_and_drops_it(monkeypatch):
    import tokenleap.serve.batch as batch
    llm = make_llm()
    building, release, real = threading.Event(), threading.Event(), batch.request_engine

    def slow(l):
        building.set()
        release.wait(60)
        return real(l)
    monkeypatch.setattr(batch, "request_engine", slow)
    result: dict[str, object] = {}

    def build() -> None:
        try:
            result["engine"] = llm.engine
        except Exception as e:  # (what the build raised: checked below)
            result["error"] = e
    builder = threading.Thread(target=build)
    builder.start()
    assert building.wait(60)
    weights = weakref.ref(llm.target.model)
    closer = threading.Thread(target=llm.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()  # waiting for the build
    release.set()
    closer.join(60)
    builder.join(60)
    gc.collect()
    assert isinstance(result.get("error"), LLMClosedError) and llm._engine is None and weights() is None


def test_a_stream_between_steps_when_closed_takes_no_further_step(monkeypatch):
    """A reader on another thread that passed every check before the close and reaches the step gate after
    it raises there: no step follows the close."""
    llm = make_llm()
    paused, release, entries, gate_step = threading.Event(), threading.Event(), [], llm._steps.step
    me = threading.current_thread()

    def step():  # the reader's third step waits at the gate's door (the close's own entry passes)
        if threading.current_thread() is not me:
            entries.append(1)
            if len(entries) == 3:
                paused.set()
                release.wait(60)
        return gate_step()
    monkeypatch.setattr(llm._steps, "step", step)
    steps, real_step = [], Engine.step
    monkeypatch.setattr(Engine, "step", lambda engine, *a, **k: steps.append(1) or real_step(engine, *a, **k))
    reader, result = _read_in_thread(llm)
    assert paused.wait(60)
    llm.close()
    before = len(steps)
    release.set()
    reader.join(60)
    assert isinstance(result.get("error"), LLMClosedError) and len(steps) == before


def test_a_closed_llm_pickles_and_copies_and_a_close_inside_a_collection_returns():
    import copy
    import pickle
    llm = make_llm()
    assert len(llm.generate("abc", PARAMS)[0].token_ids) == 40

    class Owner:  # (in a cycle: its __del__ runs inside a collection, here close()'s own)
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            llm.close()
    enabled = gc.isenabled()
    gc.disable()
    try:
        Owner()
        closer = threading.Thread(target=llm.close, daemon=True)
        closer.start()
        closer.join(30)
        assert not closer.is_alive()  # (the close inside the collection returned)
    finally:
        if enabled:
            gc.enable()
    for again in (pickle.loads(pickle.dumps(llm)), copy.deepcopy(llm)):
        assert again.closed and not hasattr(again.target, "__deepcopy__")
        with pytest.raises(LLMClosedError):
            again.generate("abc", PARAMS)


def test_a_close_inside_a_step_on_the_same_thread_does_not_wait_for_its_own_step(monkeypatch):
    """(a finalizer or a signal handler run while this thread steps): the close returns, the stream then
    raises before its next step."""
    llm = make_llm()
    calls, real = [], Engine.step

    def step(engine, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            llm.close()
        return real(engine, *args, **kwargs)
    monkeypatch.setattr(Engine, "step", step)
    done = []
    reader = threading.Thread(target=lambda: done.append(pytest.raises(LLMClosedError, lambda: list(
        llm.stream("abcabc", PARAMS)))), daemon=True)
    reader.start()
    reader.join(30)
    assert done and not reader.is_alive() and len(calls) == 2 and llm.closed
