"""Serving counters, kept apart from how they are shown: a Prometheus collector and log lines.

``ServeStats`` holds what only the scheduler knows (prompt tokens, preemptions, finished requests,
and the per-request latency and length histograms); speculation counters come from the engine's
``SpecStats`` totals. ``ServeSnapshot`` is one consistent read of both plus the gauges (queue
lengths, KV blocks), taken by the scheduler; the exporters are pure functions of snapshots.

Every family is exported twice, as ``tokenleap:NAME`` and as vLLM's ``vllm:NAME`` (the names are
vLLM's), so dashboards and alerts written for vLLM work unchanged.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

PREFIXES = ("tokenleap", "vllm")

_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
            480.0, 960.0, 1920.0, 7680.0)
_FIRST_TOKEN = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_PER_TOKEN = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
              40.0, 80.0)
_TOKENS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 500000
# name -> (help, bucket upper bounds); vLLM's histogram names
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "time_to_first_token_seconds": ("Time from arrival to the first generated token", _FIRST_TOKEN),
    # one observation per decoding step that handed a request tokens after its first (a speculative step's
    # accepted run is one gap); vLLM V1 exports the same figures under both names (the first deprecated)
    "time_per_output_token_seconds": ("Time between successive token emissions of a request", _PER_TOKEN),
    "inter_token_latency_seconds": ("Time between successive token emissions of a request", _PER_TOKEN),
    "request_time_per_output_token_seconds": ("Mean time per generated token after the first, per request",
                                              _PER_TOKEN),
    "e2e_request_latency_seconds": ("Time from arrival to the last token", _LATENCY),
    "request_queue_time_seconds": ("Time from arrival to the first admission into the batch", _LATENCY),
    "request_prefill_time_seconds": ("Time from the first admission to the first token", _LATENCY),
    "request_decode_time_seconds": ("Time from the first token to the last", _LATENCY),
    "request_prompt_tokens": ("Prompt tokens per request", _TOKENS),
    "request_generation_tokens": ("Generated tokens per request", _TOKENS),
}


@dataclass(frozen=True)
class RequestTiming:
    """One finished sequence's times (``time.monotonic()`` seconds) and lengths."""

    arrival: float
    scheduled: float  # first admitted into the running batch
    first_token: float
    finished: float
    prompt_tokens: int
    generation_tokens: int

    def observations(self) -> dict[str, float]:
        decode = self.finished - self.first_token
        out = {"e2e_request_latency_seconds": self.finished - self.arrival,
               "request_queue_time_seconds": self.scheduled - self.arrival,
               "request_prefill_time_seconds": self.first_token - self.scheduled,
               "request_decode_time_seconds": decode,
               "request_prompt_tokens": self.prompt_tokens, "request_generation_tokens": self.generation_tokens}
        if self.generation_tokens > 1:
            out["request_time_per_output_token_seconds"] = decode / (self.generation_tokens - 1)
        return out


@dataclass(frozen=True)
class HistogramData:
    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # per bucket (not cumulative); the last: above every bound
    total: float

    def buckets(self) -> list[tuple[str, int]]:
        """Prometheus's cumulative ``le`` buckets, ``+Inf`` last."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out


class RequestHistograms:
    """The per-request histograms, written by the scheduler thread and read by scrapes (a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {name: [0] * (len(bounds) + 1) for name, (_, bounds) in HISTOGRAMS.items()}
        self._sums = dict.fromkeys(HISTOGRAMS, 0.0)

    def record(self, timing: RequestTiming) -> None:
        """A finished request's observations (its first token's: ``record_first_token``)."""
        with self._lock:
            for name, value in timing.observations().items():
                self._observe(name, value)

    def record_first_token(self, seconds: float) -> None:
        """A request's first token came ``seconds`` after its arrival: observed then, as vLLM does, so a
        request cancelled later still counts in the time to first token."""
        with self._lock:
            self._observe("time_to_first_token_seconds", seconds)

    def record_gap(self, seconds: float) -> None:
        """A request handed tokens ``seconds`` after its previous tokens (the inter-token latency)."""
        with self._lock:
            for name in ("time_per_output_token_seconds", "inter_token_latency_seconds"):
                self._observe(name, seconds)

    def _observe(self, name: str, value: float) -> None:
        bounds = HISTOGRAMS[name][1]
        self._counts[name][next((i for i, b in enumerate(bounds) if value <= b), len(bounds))] += 1
        self._sums[name] += value

    def read(self) -> dict[str, HistogramData]:
        with self._lock:
            return {name: HistogramData(HISTOGRAMS[name][1], tuple(c), self._sums[name])
                    for name, c in self._counts.items()}


@dataclass
class ServeStats:
    prompt_tokens: int = 0  # prompt tokens prefilled (recomputation after preemption not counted)
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    # finished requests (not aborted); the time to the first token of every request that had one
    histograms: RequestHistograms = field(default_factory=RequestHistograms)

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
    tree_steps: int = 0  # steps that verified a token tree (their positions above are depths)
    tree_nodes: int = 0  # drafted nodes of those trees
    accepted_per_rank: tuple[int, ...] = ()  # [r] accepted tree nodes that were their parent's (r+1)-th child
    accepted_by_proposer: tuple[tuple[str, int], ...] = ()  # (proposer, draft tokens it had accepted); auto: its arms
    histograms: dict[str, HistogramData] = field(default_factory=dict)

    @property
    def kv_usage(self) -> float:
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0


class ServeCollector(Collector):
    """Builds the metric families from a fresh snapshot at every scrape."""

    def __init__(self, snapshot: Callable[[], ServeSnapshot], model_name: str) -> None:
        self.snapshot, self.model_name = snapshot, model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        s = self.snapshot()
        for prefix in PREFIXES:
            yield from self._families(s, prefix)

    def _families(self, s: ServeSnapshot, prefix: str) -> Iterator[Any]:
        labels, model = ["model_name"], [self.model_name]
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch", s.running),
            ("num_requests_waiting", "Requests waiting to be admitted", s.waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)", s.kv_usage),
            ("kv_cache_blocks_used", "KV-cache blocks in use", s.blocks_used),
            ("kv_cache_blocks_free", "KV-cache blocks free", s.blocks_total - s.blocks_used),
        ):
            g = GaugeMetricFamily(f"{prefix}:{name}", doc, labels=labels)
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
            ("spec_decode_num_tree_steps", "Speculative steps that verified a token tree", s.tree_steps),
            ("spec_decode_num_tree_nodes", "Drafted nodes of the verified token trees", s.tree_nodes),
        ):
            c = CounterMetricFamily(f"{prefix}:{name}", doc, labels=labels)
            c.add_metric(model, value)
            yield c
        for name, doc, label, counts in (
            ("per_pos", "Accepted draft tokens at each draft position (0-based)", "position", s.accepted_per_pos),
            ("per_sibling_rank", "Accepted token-tree nodes by their rank among siblings (0: first)", "rank",
             s.accepted_per_rank),
        ):
            family = CounterMetricFamily(f"{prefix}:spec_decode_num_accepted_tokens_{name}", doc,
                                         labels=labels + [label])
            for i, n in enumerate(counts):
                family.add_metric(model + [str(i)], n)
            yield family
        by_proposer = CounterMetricFamily(f"{prefix}:spec_decode_num_accepted_tokens_by_proposer",
                                          "Draft tokens accepted, by the proposer that drafted them (--spec auto: "
                                          "each of its proposers)", labels=labels + ["proposer"])
        for name, n in s.accepted_by_proposer:
            by_proposer.add_metric(model + [name], n)
        yield by_proposer
        finished = CounterMetricFamily(f"{prefix}:request_success", "Finished requests by finish reason",
                                       labels=labels + ["finished_reason"])
        for reason, n in sorted(s.finished.items()):
            finished.add_metric(model + [reason], n)
        yield finished
        for name, data in s.histograms.items():
            h = HistogramMetricFamily(f"{prefix}:{name}", HISTOGRAMS[name][0], labels=labels)
            h.add_metric(model, data.buckets(), data.total)
            yield h


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


def request_log_line(fields: dict[str, Any]) -> str:
    """One finished HTTP request as ``request key=value ...``: numbers as they are, text quoted as a
    JSON string (so a prompt with spaces or newlines stays on one parseable line)."""
    parts = []
    for key, value in fields.items():
        if isinstance(value, float):
            value = f"{value:.4f}"
        elif not isinstance(value, int):
            value = json.dumps(str(value), ensure_ascii=False)
        parts.append(f"{key}={value}")
    return "request " + " ".join(parts)
