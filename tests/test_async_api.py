"""``LLM``'s coroutines: ``astream`` requests open at once are decoded together by the LLM's scheduler,
each output token-identical to its request alone, while the event loop keeps running; a reader that
stops early (cancelled, or leaving its loop) is dropped at the next iteration and its slot freed;
``agenerate`` / ``achat`` give ``generate`` / ``chat``'s outputs and, cancelled, stop before their next step."""
from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import torch

from tokenleap.api import LLM
from tokenleap.config import ConfigError, SamplingParams, SpecConfig
from tokenleap.errors import PromptTooLongError
from tokenleap.models.pretrained import LoadedModel

from serving_helpers import VOCAB, EncodeChatToy, model, wait_until

PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


def make_llm() -> LLM:
    loaded = LoadedModel(model(1), EncodeChatToy(VOCAB), torch.float32, "none", "tiny", None)
    return LLM.from_loaded(loaded, SpecConfig(method="ngram"), max_model_len=96)


def _all_free(llm: LLM) -> bool:
    scheduler = llm._coroutines
    return scheduler.idle and scheduler.engine.cache.num_free_slots == scheduler.engine.cache.num_slots


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
    assert "".join(c.text for c in got) == "".join(c.text for c in want) == got[-1].output.text and got[-1].finished
    assert got[-1].output.token_ids == want[-1].output.token_ids == got[-1].token_ids and len(got[-1].token_ids) == 40
    assert ticks >= len(got)  # the loop ran between the chunks
    assert wait_until(lambda: _all_free(llm))


def test_concurrent_astreams_are_decoded_together_each_as_if_alone(monkeypatch):
    """Six streams at once on an LLM of one slot (its ``stream`` would refuse the second): all are served,
    in batches, greedy and seeded outputs equal to each prompt generated alone."""
    from tokenleap.spec.engine import Engine
    llm = make_llm()
    prompts = ["abcabc", "xyz", "hello", "abab", "qq", "zzzz"]
    cases = [PARAMS] + [SamplingParams(max_tokens=30, temperature=0.9, seed=s, ignore_eos=True) for s in (3, 11)]
    want = [[llm.generate(p, params)[0].token_ids for p in prompts] for params in cases]
    widest, real = [], Engine.step
    monkeypatch.setattr(Engine, "step", lambda e, seqs, *a, **k: widest.append(len(seqs)) or real(e, seqs, *a, **k))

    async def one(prompt, params):
        return [c async for c in llm.astream(prompt, params)][-1].output.token_ids

    async def main(params):
        return list(await asyncio.gather(*(one(p, params) for p in prompts)))
    assert [asyncio.run(main(params)) for params in cases] == want
    assert max(widest) > 1  # (batched, not one after another)
    assert wait_until(lambda: _all_free(llm))


def test_a_cancelled_reader_is_dropped_at_the_next_iteration(monkeypatch):
    from tokenleap.spec.engine import Engine
    llm = make_llm()
    gate, stepping, calls = _gate_steps(monkeypatch, Engine, at=2)
    chunks = []

    async def read():
        async for c in llm.astream("abcabc", PARAMS):
            chunks.append(c)
    _cancel_mid_call(read, gate, stepping)
    assert wait_until(lambda: _all_free(llm))
    assert len(calls) == 2 and not any(c.finished for c in chunks)  # no step after the one in flight
    monkeypatch.undo()
    assert llm.generate("abcabc", PARAMS)[0].token_ids == llm.generate("abcabc", PARAMS)[0].token_ids


def test_leaving_the_loop_early_frees_the_slot_and_the_coroutines_give_the_blocking_calls_outputs():
    llm = make_llm()
    conversation = [{"role": "user", "content": "abc"}]

    async def main():
        async with contextlib.aclosing(llm.astream("abcabc", PARAMS)) as chunks:
            async for _ in chunks:
                break
        freed = await asyncio.to_thread(wait_until, lambda: _all_free(llm))
        outs = await llm.agenerate(["abcabc", "xyz"], PARAMS)
        replies = await llm.achat(conversation, sampling_params=PARAMS)
        return freed, outs, replies
    freed, outs, replies = asyncio.run(main())
    assert freed
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(["abcabc", "xyz"], PARAMS)]
    assert replies[0].token_ids == llm.chat(conversation, PARAMS)[0].token_ids


def test_astream_refuses_what_it_cannot_run_before_it_queues():
    llm = make_llm()

    async def first(prompt, params):
        return [c async for c in llm.astream(prompt, params)]
    with pytest.raises(PromptTooLongError, match="context window is 96"):
        asyncio.run(first("a" * 200, PARAMS))
    with pytest.raises(ConfigError, match="astream gives one completion"):
        asyncio.run(first("abc", SamplingParams(n=2)))
    assert llm._coroutines is None or _all_free(llm)


def _gate_steps(monkeypatch, engine_class, at: int):
    """Every engine's steps counted; the ``at``-th waits for the gate (``stepping`` set while it waits)."""
    gate, stepping, calls = threading.Event(), threading.Event(), []
    real = engine_class.step

    def step(engine, *args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            stepping.set()
            gate.wait(60)
        return real(engine, *args, **kwargs)
    monkeypatch.setattr(engine_class, "step", step)
    return gate, stepping, calls


def _cancel_mid_call(call, gate, stepping):
    """Run the coroutine ``call()``, cancel it while a step waits at the gate, then open the gate."""
    async def main():
        task = asyncio.create_task(call())
        await asyncio.to_thread(stepping.wait, 60)  # (generous: a busy machine builds the engine slowly)
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


def test_streams_on_several_threads_step_the_engine_one_at_a_time(monkeypatch):
    """``stream`` on two threads (an LLM of two slots): the shared engine never runs two steps at once,
    and each output equals its prompt's alone."""
    import time
    from tokenleap.spec.engine import Engine
    loaded = LoadedModel(model(1), EncodeChatToy(VOCAB), torch.float32, "none", "tiny", None)
    llm = LLM.from_loaded(loaded, SpecConfig(method="ngram"), max_model_len=96, num_slots=2)
    prompts = ["abcabc", "xyz"]
    want = [llm.generate(p, PARAMS)[0].token_ids for p in prompts]
    active, widest, real = [0], [0], Engine.step

    def step(engine, *args, **kwargs):
        active[0] += 1
        widest[0] = max(widest[0], active[0])
        time.sleep(0.002)  # (a step long enough for another thread to come in)
        try:
            return real(engine, *args, **kwargs)
        finally:
            active[0] -= 1
    monkeypatch.setattr(Engine, "step", step)
    got = [None, None]
    start = threading.Barrier(2)

    def run(i):
        start.wait(10)
        got[i] = [c for c in llm.stream(prompts[i], PARAMS)][-1].output.token_ids
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want and widest[0] == 1


def test_a_stream_collected_inside_another_streams_step_is_closed_after_it(monkeypatch):
    """An abandoned stream held in a reference cycle, freed by a garbage collection inside another
    stream's step on the same thread: its close waits for the end of that step (it waited for the
    step's own gate before: a deadlock), then frees its slot."""
    import gc
    import weakref
    from tokenleap.spec.engine import Engine
    loaded = LoadedModel(model(1), EncodeChatToy(VOCAB), torch.float32, "none", "tiny", None)
    llm = LLM.from_loaded(loaded, SpecConfig(method="ngram"), max_model_len=96, num_slots=2)
    want = llm.generate("xyz", PARAMS)[0].token_ids  # (builds the engine: later objects are collectable)

    class Holder:
        pass

    def abandon():
        holder = Holder()
        holder.me, holder.stream = holder, llm.stream("abcabc", PARAMS)
        next(holder.stream)  # (holds a slot)
        return weakref.ref(holder)
    abandoned = abandon()
    collected, real = [], Engine.step

    def step(engine, *args, **kwargs):
        if abandoned() is not None:
            collected.append(gc.collect())
        return real(engine, *args, **kwargs)
    monkeypatch.setattr(Engine, "step", step)
    got = []
    thread = threading.Thread(target=lambda: got.append(list(llm.stream("xyz", PARAMS))[-1].output.token_ids),
                              daemon=True)
    gc.disable()
    try:
        thread.start()
        thread.join(30)
    finally:
        gc.enable()
    assert not thread.is_alive() and got == [want] and abandoned() is None and collected
    assert llm.engine.cache.num_free_slots == 2


EXIT_WITH_STREAMS_OPEN = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
import torch
from tokenleap.api import LLM
from tokenleap.config import SamplingParams, SpecConfig
from tokenleap.models.pretrained import LoadedModel
from conftest import tiny_model
from serving_helpers import EncodeChatToy
m = tiny_model("qwen2", seed=1, vocab=96, hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1024)
llm = LLM.from_loaded(LoadedModel(m, EncodeChatToy(96), torch.float32, "none", "tiny", None),
                      SpecConfig(method="ngram"), max_model_len=512, max_num_seqs=4)
async def main():
    async def read(i):
        async for _ in llm.astream("abc" * 10 + str(i), SamplingParams(max_tokens=450, ignore_eos=True)):
            pass
    tasks = [asyncio.create_task(read(i)) for i in range(4)]
    await asyncio.sleep(1.0)
    print("returning with streams open", flush=True)
asyncio.run(main())
"""


def test_a_program_that_returns_with_streams_open_exits_cleanly():
    """``asyncio.run`` returning while astream requests run: the scheduler's step in flight ends and its
    thread stops at exit (a daemon thread inside a torch step when the interpreter finalized aborted
    the process, exit status 134, in three runs of four)."""
    import subprocess
    import sys
    from pathlib import Path
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", EXIT_WITH_STREAMS_OPEN, str(Path(__file__).parent)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "returning with streams open" in done.stdout, done.stderr[-2000:]


def test_an_llm_collected_after_astream_stops_its_scheduler_and_frees_its_engine():
    """The scheduler's thread held its engine (a KV cache of up to the serving budget) for as long as the
    process ran, after its LLM was gone; now the LLM's collection stops it."""
    import gc
    import weakref
    llm = make_llm()

    async def one():
        return [c async for c in llm.astream("abcabc", PARAMS)][-1].output.token_ids
    assert asyncio.run(one()) == llm.generate("abcabc", PARAMS)[0].token_ids
    thread, engine = llm._coroutines._thread, weakref.ref(llm._coroutines.engine)
    del llm
    gc.collect()
    thread.join(10)
    gc.collect()
    assert not thread.is_alive() and engine() is None
