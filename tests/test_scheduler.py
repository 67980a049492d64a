"""Continuous batching, driven synchronously (``run_until_idle``), so every check is deterministic."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from tokenleap.config import ConfigError, SamplingParams
from tokenleap.serve.scheduler import QueueFullError, Request, Scheduler, SchedulerConfig
from tokenleap.serve.metrics import ServeSnapshot, log_line, make_registry

from serving_helpers import FailingProposer, alone, paged_engine, workload


class Collector:
    def __init__(self) -> None:
        self.outputs = []

    def __call__(self, out) -> None:
        self.outputs.append(out)

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

    @property
    def finish_reason(self):
        return self.outputs[-1].finish_reason if self.outputs else None


def submit(sched: Scheduler, prompt: list[int], params: SamplingParams) -> Collector:
    sink = Collector()
    sched.submit([Request(sched.engine.create(prompt, params), sink)])
    return sink


def run_workload(kind, blocks, n=12, max_seqs=16, seed=0, sampled=False, k="auto"):
    """``sampled``: seeded sampling (each request its own seed) instead of greedy; ``k``: the draft length."""
    eng = paged_engine(kind, blocks=blocks, k=k)
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=max_seqs, log_interval=0))
    sampling = lambda i: dict(temperature=0.8, top_p=0.95, seed=1000 + i) if sampled else {}  # noqa: E731
    jobs = [(p, SamplingParams(max_tokens=m, ignore_eos=True, **sampling(i)))
            for i, (p, m) in enumerate(workload(n, seed))]
    sinks = [submit(sched, p, params) for p, params in jobs]
    sched.run_until_idle()
    for (prompt, params), sink in zip(jobs, sinks):
        ref = alone(prompt, params)
        assert sink.tokens == ref.generated and sink.text == ref.text, prompt
        assert sink.finish_reason == "length"
    assert eng.cache.num_used_blocks == 0
    if kind == "draft":
        assert eng.proposer.cache.num_used_blocks == 0
    return sched


@pytest.mark.parametrize("kind", [None, "ngram", "draft", "self-draft"])
def test_batched_outputs_equal_alone(kind):
    # (n-gram at a fixed length: the timed controller drafted 2-4 of ~60 steps of this batch, by measured costs)
    sched = run_workload(kind, blocks=128, k=3 if kind == "ngram" else "auto")
    assert sched.stats.preemptions == 0 and sched.stats.finished == {"length": 12}
    if kind in ("ngram", "self-draft"):
        assert sched.engine.totals.accepted_tokens > 0


# requests that overflow a 10-block pool (160 token slots) whatever the draft length: with 12, one
# preemption happened or not depending on the draft lengths the timed controller chose
SMALL_POOL_REQUESTS = 20


@pytest.mark.parametrize("kind", [None, "ngram", "draft"])
def test_preemption_in_a_small_pool_keeps_outputs_exact(kind):
    sched = run_workload(kind, blocks=10, n=SMALL_POOL_REQUESTS, seed=1)  # sequences of up to 95 tokens
    assert sched.stats.preemptions > 0


@pytest.mark.parametrize("kind", [None, "ngram", "draft", "self-draft"])
@pytest.mark.parametrize("blocks", [128, 10])
def test_seeded_sampled_outputs_equal_alone_under_batching_and_preemption(kind, blocks):
    """A seeded request's tokens do not depend on the batch, the draft length or a preemption."""
    sched = run_workload(kind, blocks=blocks, n=SMALL_POOL_REQUESTS if blocks == 10 else 12, seed=1, sampled=True)
    assert (sched.stats.preemptions > 0) == (blocks == 10)
    if kind == "self-draft":
        assert sched.engine.totals.accepted_tokens > 0


def test_scheduler_refuses_a_pool_smaller_than_one_sequence():
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        Scheduler(paged_engine(blocks=8))


def test_long_prompt_prefill_is_interleaved_with_decoding():
    sched = Scheduler(paged_engine(), SchedulerConfig(log_interval=0))  # prefill budget: one 8-token chunk
    short = submit(sched, [5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
    sched.iterate()
    long = submit(sched, list(range(3, 90)), SamplingParams(max_tokens=5, ignore_eos=True))  # 11 chunks
    while not long.outputs:
        sched.iterate()
    assert len(short.tokens) >= 11  # the short request decoded during every prefill chunk
    sched.run_until_idle()
    assert long.tokens == alone(list(range(3, 90)), SamplingParams(max_tokens=5, ignore_eos=True)).generated


def test_cancelled_requests_free_everything_at_once():
    eng = paged_engine("draft", blocks=64)
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=4, log_interval=0))
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    sinks, reqs = [], []
    for prompt, _ in workload(8):
        sink = Collector()
        reqs.append(Request(eng.create(prompt, params), sink))
        sinks.append(sink)
    sched.submit(reqs)
    for _ in range(5):
        sched.iterate()
    for r in reqs[::2]:  # running and waiting ones alike
        sched.cancel(r)
    sched.iterate()
    assert all(r.done for r in reqs[::2])
    assert len(sched.running) + len(sched.waiting) == 4
    sched.run_until_idle()
    assert eng.cache.num_used_blocks == 0 and eng.proposer.cache.num_used_blocks == 0
    assert eng.cache.num_free_slots == eng.cache.num_slots
    assert sched.stats.finished == {"abort": 4, "length": 4}


def test_abort_all_ends_running_queued_and_just_submitted_requests_with_an_error():
    """A server whose shutdown grace ran out: every request -- running, waiting, or submitted since the
    last iteration -- gets one error output and frees its slot; an abort with nothing to end is spent
    on the next iteration, not kept for a later request."""
    eng = paged_engine("draft", blocks=64)
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=2, log_interval=0))
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    sinks = [submit(sched, prompt, params) for prompt, _ in workload(4)]
    for _ in range(3):
        sched.iterate()
    late = submit(sched, workload(5)[-1][0], params)
    sched.abort_all("the server is shutting down")
    assert not sched.idle
    sched.iterate()
    for sink in [*sinks, late]:
        assert sink.finish_reason == "error" and sink.outputs[-1].error == "the server is shutting down"
        assert [o.finish_reason for o in sink.outputs].count("error") == 1 and sink.outputs[-1].error_status == 503
    with pytest.raises(QueueFullError, match="shutting down"):  # a request made after the abort: refused
        submit(sched, workload(1)[0][0], params)
    assert sched.idle and eng.cache.num_free_slots == eng.cache.num_slots and eng.cache.num_used_blocks == 0
    sched.abort_all("nothing to end")
    sched.run_until_idle()
    sched._closed = None  # (what start() does: a restarted app's scheduler takes requests again)
    after = submit(sched, workload(1)[0][0], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.run_until_idle()
    assert after.finish_reason == "length" and len(after.tokens) == 3


@pytest.mark.parametrize("where", ["prefill", "propose"])
def test_a_failing_request_does_not_disturb_the_others(where):
    eng = paged_engine("ngram", k=2)
    if where == "propose":
        eng.proposer = FailingProposer(eng.proposer)
    else:  # the target's prefill raises
        prefill_step = eng.prefill_step

        def failing(seq, draft_alongside=True):
            if seq.prompt[0] == 66:
                raise RuntimeError("boom in prefill")
            return prefill_step(seq, draft_alongside)
        eng.prefill_step = failing
    sched = Scheduler(eng, SchedulerConfig(log_interval=0))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [[5, 9, 14, 3, 5, 9], [66, 5, 9, 14, 3, 5, 9], [40, 41, 42, 40, 41]]
    sinks = [submit(sched, p, params) for p in prompts]
    sched.run_until_idle()
    assert sinks[1].finish_reason == "error" and "boom" in sinks[1].outputs[-1].error
    for i in (0, 2):
        assert sinks[i].tokens == alone(prompts[i], params).generated
    assert eng.cache.num_used_blocks == 0
    assert sched.stats.finished == {"error": 1, "length": 2}


def test_scheduler_passes_the_batch_size_to_the_controller():
    eng = paged_engine("ngram")
    seen = []
    choose_step = eng.controller.choose_step
    eng.controller.choose_step = lambda batch=1, *rest, **kw: seen.append(batch) or choose_step(batch, *rest, **kw)
    sched = Scheduler(eng, SchedulerConfig(log_interval=0, prefill_budget=1000))  # all prefilled at once
    for i, (prompt, _) in enumerate(workload(5)):
        submit(sched, prompt, SamplingParams(max_tokens=5 + 5 * i, ignore_eos=True))
    sched.run_until_idle()
    assert seen[0] == 5 and seen[-1] == 1  # the batch shrinks as requests finish

    seen.clear()
    sched = Scheduler(eng, SchedulerConfig(log_interval=0, prefill_budget=1))  # one prompt an iteration
    for prompt, _ in workload(3):
        submit(sched, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    stepped = []
    step = eng.step
    eng.step = lambda seqs, k=None: stepped.append(len(seqs)) or step(seqs, k)
    while not stepped:
        sched.iterate()
    # the first step ran while the others were still prefilling: judged as the batch about to run
    assert stepped[0] < 3 and seen == [3]


def test_metrics_export_and_log_line():
    sched = run_workload("self-draft", blocks=128, n=4)
    snap = sched.snapshot()
    assert snap.num_drafts > 0 and snap.num_accepted_tokens > 0 and snap.generation_tokens > 0
    text = generate_latest(make_registry(sched.snapshot, "tiny")).decode()
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "generation_tokens_total", "prompt_tokens_total"):
        assert f"tokenleap:{name}{{" in text, name
    assert 'tokenleap:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in text
    prev = ServeSnapshot(0.0, 0, 0, 0, 10, 0, 0, 0, {}, 0, 0, 0, ())
    now = ServeSnapshot(10.0, 3, 1, 4, 10, 200, 500, 2, {}, 100, 300, 150, (80, 50, 20))
    line = log_line(prev, now)
    assert "running: 3 reqs, waiting: 1 reqs" in line and "4 used / 6 free (40.0%)" in line
    assert "generation: 50.0 tok/s" in line and "prompt: 20.0 tok/s" in line
    assert "acceptance rate 50.0%" in line and "mean acceptance length 2.50" in line
    assert "[0.80 0.50 0.20]" in line
    assert "prefix cache" not in line  # nothing looked up
    cached = ServeSnapshot(10.0, 3, 1, 4, 10, 200, 500, 2, {}, 100, 300, 150, (80, 50, 20),
                           prefix_cache_queries=512, prefix_cache_hits=256)
    assert "prefix cache hit rate 50.0%" in log_line(prev, cached)


def test_a_snapshot_reads_the_proposer_table_while_the_loop_adds_to_it():
    """/metrics reads the totals on the HTTP thread while the scheduler's thread records steps: a
    proposer named for the first time mid-read must not fail the scrape (the table is copied whole)."""
    sched = run_workload("self-draft", blocks=128, n=2, k=3)  # (a fixed length: a proposer named in the table)

    class Growing(dict):  # a step of a new proposer recorded while a reader walks the table
        def items(self):
            for i, item in enumerate(super().items()):
                self[f"new-{i}"] = 1
                yield item

    sched.engine.totals.proposer_accepted = Growing(sched.engine.totals.proposer_accepted)
    assert sched.engine.totals.proposer_accepted and sched.snapshot().accepted_by_proposer


def test_one_admission_rule_counted_in_sequences():
    """Waiting sequences never pass max_waiting beyond the batch's free places -- and none of those
    while the KV pool holds sequences back (a free place then admits nobody): a request of n
    choices counts n. Driven to preemption in a small pool, every accepted submit keeps the rule."""
    from tokenleap.serve.scheduler import QueueFullError
    eng = paged_engine(None, blocks=10)
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=4, max_waiting=3, log_interval=0))
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    batch = [Request(eng.create([5, 6, 7] * 12, params), Collector()) for _ in range(7)]  # 4 free places + 3
    sched.submit(batch)
    with pytest.raises(QueueFullError, match="adds 1"):
        sched.submit([Request(eng.create([5], params), Collector())])
    accepted = refused = 0
    while not sched.idle:
        sched.iterate()
        for n in (1, 2, 3):
            free = 0 if sched._short else max(0, 4 - len(sched.running))
            try:
                sched.submit([Request(eng.create([9, 8] * (n + 3), params), Collector()) for _ in range(n)])
            except QueueFullError:
                refused += 1
                continue
            accepted += 1
            assert len(sched.waiting) + len(sched._inbox) <= 3 + free
        if accepted > 12:
            break
    assert sched.stats.preemptions > 0
    assert accepted > 0 and refused > 0
