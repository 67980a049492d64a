"""Serving counters, kept apart from how they are shown: a Prometheus collector and a log line.

``ServeStats`` holds what only the scheduler knows (prompt tokens, preemptions, finished requests);
speculation counters come from the engine's ``SpecStats`` totals. ``ServeSnapshot`` is one consistent
read of both plus the gauges (queue lengths, KV blocks), taken by the scheduler; the exporters are
pure functions of snapshots. Metric names follow vLLM's ``vllm:*`` names with a ``tokenleap:`` prefix.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


@dataclass
class ServeStats:
    prompt_tokens: int = 0  # prompt tokens prefilled (recomputation after preemption not counted)
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests

    def record_finish(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1


@dataclass(frozen=True)
class ServeSnapshot:
    time: float  # time.monotonic() when taken
    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    finished: dict[str, int]
    num_drafts: int  # steps with a non-empty draft, over all sequences
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]  # [i] drafts whose first i+1 tokens were accepted
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens reused instead of computed

    @property
    def kv_usage(self) -> float:
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0


class ServeCollector(Collector):
    """Builds the metric families from a fresh snapshot at every scrape."""

    def __init__(self, snapshot: Callable[[], ServeSnapshot], model_name: str) -> None:
        self.snapshot, self.model_name = snapshot, model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s, labels, model = self.snapshot(), ["model_name"], [self.model_name]
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch", s.running),
            ("num_requests_waiting", "Requests waiting to be admitted", s.waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)", s.kv_usage),
            ("kv_cache_blocks_used", "KV-cache blocks in use", s.blocks_used),
            ("kv_cache_blocks_free", "KV-cache blocks free", s.blocks_total - s.blocks_used),
        ):
            g = GaugeMetricFamily(f"tokenleap:{name}", doc, labels=labels)
            g.add_metric(model, value)
            yield g
        for name, doc, value in (
            ("prompt_tokens", "Prompt tokens prefilled", s.prompt_tokens),
            ("generation_tokens", "Tokens generated", s.generation_tokens),
            ("num_preemptions", "Sequences preempted for lack of KV-cache blocks", s.preemptions),
            ("spec_decode_num_drafts", "Speculative steps with a non-empty draft", s.num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens proposed", s.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted", s.num_accepted_tokens),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)", s.prefix_cache_hits),
        ):
            c = CounterMetricFamily(f"tokenleap:{name}", doc, labels=labels)
            c.add_metric(model, value)
            yield c
        yield self._per_position(s)
        finished = CounterMetricFamily("tokenleap:request_success", "Finished requests by finish reason",
                                       labels=labels + ["finished_reason"])
        for reason, n in sorted(s.finished.items()):
            finished.add_metric(model + [reason], n)
        yield finished

    def _per_position(self, s: ServeSnapshot) -> CounterMetricFamily:
        c = CounterMetricFamily("tokenleap:spec_decode_num_accepted_tokens_per_pos",
                                "Accepted draft tokens at each draft position (0-based)",
                                labels=["model_name", "position"])
        for pos, n in enumerate(s.accepted_per_pos):
            c.add_metric([self.model_name, str(pos)], n)
        return c


def make_registry(snapshot: Callable[[], ServeSnapshot], model_name: str) -> CollectorRegistry:
    """A registry of our own (not the process-global one), so several apps can coexist."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServeCollector(snapshot, model_name))
    return registry


def log_line(prev: ServeSnapshot, now: ServeSnapshot) -> str:
    """The periodic one-line summary: throughput over the interval between two snapshots."""
    dt = max(now.time - prev.time, 1e-9)
    prompt_rate = (now.prompt_tokens - prev.prompt_tokens) / dt
    gen_rate = (now.generation_tokens - prev.generation_tokens) / dt
    line = (f"running: {now.running} reqs, waiting: {now.waiting} reqs, "
            f"KV blocks: {now.blocks_used} used / {now.blocks_total - now.blocks_used} free "
            f"({now.kv_usage:.1%}), prompt: {prompt_rate:.1f} tok/s, generation: {gen_rate:.1f} tok/s, "
            f"preemptions: {now.preemptions}")
    queried = now.prefix_cache_queries - prev.prefix_cache_queries
    if queried:
        line += f", prefix cache hit rate {(now.prefix_cache_hits - prev.prefix_cache_hits) / queried:.1%}"
    drafts = now.num_drafts - prev.num_drafts
    if drafts:
        proposed = now.num_draft_tokens - prev.num_draft_tokens
        accepted = now.num_accepted_tokens - prev.num_accepted_tokens
        per_pos = [(a - (prev.accepted_per_pos[i] if i < len(prev.accepted_per_pos) else 0)) / drafts
                   for i, a in enumerate(now.accepted_per_pos)]
        line += (f", spec: {drafts} drafts, acceptance rate {accepted / max(proposed, 1):.1%}, "
                 f"mean acceptance length {1 + accepted / drafts:.2f}, per position "
                 f"[{' '.join(f'{p:.2f}' for p in per_pos)}]")
    return line
