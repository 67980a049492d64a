"""``LLM``'s coroutines: ``astream`` gives ``stream``'s chunks while the event loop keeps running, and a
reader that stops early (cancelled, or leaving its loop) stops the generation and frees its slot --
after the step in flight, never under it; ``agenerate`` / ``achat`` give ``generate`` / ``chat``'s outputs,
and cancelled, stop before their next step."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import torch

from tokenleap.api import LLM
from tokenleap.config import SamplingParams, SpecConfig
from tokenleap.models.pretrained import LoadedModel

from serving_helpers import VOCAB, EncodeChatToy, model

PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


def make_llm() -> LLM:
    loaded = LoadedModel(model(1), EncodeChatToy(VOCAB), torch.float32, "none", "tiny", None)
    return LLM.from_loaded(loaded, SpecConfig(method="ngram"), max_model_len=96)


def _wait_for(condition, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_astream_gives_streams_chunks_while_the_loop_runs():
    llm = make_llm()
    want = list(llm.stream("abcabc", PARAMS))

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)
        tick = asyncio.create_task(ticker())
        got = [c async for c in llm.astream("abcabc", PARAMS)]
        tick.cancel()
        return got, ticks
    got, ticks = asyncio.run(main())
    # (how many tokens each chunk holds is the step's: the draft lengths follow measured costs)
    assert "".join(c.text for c in got) == "".join(c.text for c in want) and got[-1].finished
    assert got[-1].output.token_ids == want[-1].output.token_ids and len(got[-1].token_ids) == 40
    assert ticks >= len(got)  # the loop ran between the chunks
    assert llm.engine.cache.num_free_slots == llm.num_slots


def test_a_cancelled_reader_frees_its_slot_after_the_step_in_flight(monkeypatch):
    llm = make_llm()
    want = llm.generate("abcabc", PARAMS)[0].token_ids
    gate, stepping = threading.Event(), threading.Event()
    real = llm.stream

    def gated(*args, **kwargs):  # the second chunk's step waits for the gate
        steps = real(*args, **kwargs)
        yield next(steps)
        stepping.set()
        gate.wait(10)
        yield from steps
    monkeypatch.setattr(llm, "stream", gated)

    async def main():
        first = asyncio.Event()

        async def read():
            async for _ in llm.astream("abcabc", PARAMS):
                first.set()
        task = asyncio.create_task(read())
        await asyncio.wait_for(first.wait(), 10)
        await asyncio.to_thread(stepping.wait, 10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        held = llm.engine.cache.num_free_slots  # the step in flight still holds it: not closed under it
        gate.set()
        return held, await asyncio.to_thread(_wait_for, lambda: llm.engine.cache.num_free_slots == llm.num_slots)
    assert asyncio.run(main()) == (0, True)
    monkeypatch.undo()
    assert llm.generate("abcabc", PARAMS)[0].token_ids == want  # the engine goes on as before


def test_leaving_the_loop_early_frees_the_slot_and_the_coroutines_give_the_blocking_calls_outputs():
    llm = make_llm()
    conversation = [{"role": "user", "content": "abc"}]

    async def main():
        async with contextlib.aclosing(llm.astream("abcabc", PARAMS)) as chunks:
            async for _ in chunks:
                break
        free = llm.engine.cache.num_free_slots
        outs = await llm.agenerate(["abcabc", "xyz"], PARAMS)
        replies = await llm.achat(conversation, sampling_params=PARAMS)
        return free, outs, replies
    free, outs, replies = asyncio.run(main())
    assert free == llm.num_slots
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(["abcabc", "xyz"], PARAMS)]
    assert replies[0].token_ids == llm.chat(conversation, PARAMS)[0].token_ids


def _gate_steps(monkeypatch, engine_class, at: int):
    """Every engine's steps counted; the ``at``-th waits for the gate (``stepping`` set while it waits)."""
    gate, stepping, calls = threading.Event(), threading.Event(), []
    real = engine_class.step

    def step(engine, *args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            stepping.set()
            gate.wait(10)
        return real(engine, *args, **kwargs)
    monkeypatch.setattr(engine_class, "step", step)
    return gate, stepping, calls


def _cancel_mid_call(call, gate, stepping):
    """Run the coroutine ``call()``, cancel it while a step waits at the gate, then open the gate."""
    async def main():
        task = asyncio.create_task(call())
        await asyncio.to_thread(stepping.wait, 10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        gate.set()
    asyncio.run(main())


def test_a_cancelled_agenerate_or_achat_stops_before_its_next_step(monkeypatch):
    """A one-prompt call (the LLM's own engine) and a batch (an engine of its own): cancelled while a step
    runs, neither takes another step, and the LLM's slot is free again. (``asyncio.run`` returns once
    its worker threads have ended: the counts are final.)"""
    from tokenleap.spec.engine import Engine
    llm = make_llm()
    _, _, full = _gate_steps(monkeypatch, Engine, at=0)
    llm.generate("abcabc", PARAMS)
    assert len(full) > 4  # (the whole generation takes many steps)
    monkeypatch.undo()
    for call in (lambda: llm.agenerate("abcabc", PARAMS),
                 lambda: llm.achat([{"role": "user", "content": "abc"}], PARAMS),
                 lambda: llm.agenerate(["abcabc", "xyz"], PARAMS)):
        gate, stepping, calls = _gate_steps(monkeypatch, Engine, at=2)
        _cancel_mid_call(call, gate, stepping)
        assert len(calls) == 2 and llm.engine.cache.num_free_slots == llm.num_slots
        monkeypatch.undo()
    assert llm.generate("abcabc", PARAMS)[0].token_ids == llm.generate("abcabc", PARAMS)[0].token_ids
