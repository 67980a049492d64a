"""Which replica serves a request: the least loaded one; among equally loaded ones the replica
that last served the same prompt start (its prefix cache likely holds those windows), else the one
routed to least recently, so that light traffic (loads mostly tied at 0) alternates between
replicas instead of always going to the first one listed.

``LoadAffinityRouter`` is a Ray Serve request router (it runs inside the ingress, in the
deployment handle that calls the replicas). A replica's load is its number of ongoing requests:
Ray's live count for the handle (incremented as requests are sent, corrected by probing the
replicas), or, where that count is missing or stale, what the replica last reported in its
routing stats; plus the requests this router has just picked it for that Ray has not yet counted
(``PickLedger``). Ray routes a burst of requests before it counts the first one sent, so without
those picks every request of the burst would see the same loads and go to the same replica.

The router hands Ray one replica per rank, in its own order, so that Ray takes its first pick
rather than re-deciding among equals by its own count (which lacks the pending picks). A replica
whose live count has lapsed is given its last report as its count, since otherwise Ray would probe
it with a 0.1 s deadline that a busy machine misses, and route to the next replica every time.
The ingress passes each request's ``affinity`` key (``affinity_key``: a hash of the prompt's
first window of text) as a keyword argument of the replica call.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

AFFINITY_KWARG = "affinity"


def affinity_key(body: bytes, chars: int) -> str | None:
    """A hash of the first ``chars`` characters of a completion's prompt or a chat's messages (as
    text; for token-id prompts the first ``chars // 4`` ids; a Responses request's instructions and
    input as the chat messages they become; an /infill request's context files and prefix), or None
    when the body has none of them."""
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(req, dict):
        return None
    prompt = req.get("prompt", req.get("messages"))
    if isinstance(req.get("input_prefix"), str):  # llama.cpp's /infill: its context files, then the prefix
        extra = req.get("input_extra") if isinstance(req.get("input_extra"), list) else []
        prompt = "".join(str(c.get("text", "")) for c in extra if isinstance(c, dict)) + req["input_prefix"]
    elif prompt is None and "input" in req:
        given = req["input"]
        prompt = ([{"role": "system", "content": req["instructions"]}] if req.get("instructions") else []) + (
            [{"role": "user", "content": given}] if isinstance(given, str) else given if isinstance(given, list) else [])
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and "prompt" in req:
        prompt = prompt[0]  # a batch of prompts: its first one
    if isinstance(prompt, str):
        start = prompt[:chars]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        start = json.dumps(prompt[: max(1, chars // 4)])
    elif isinstance(prompt, list) and prompt:  # chat messages: role and content, in order
        text = "".join(f"<{m.get('role')}>{m.get('content')}" if isinstance(m, dict) else str(m) for m in prompt)
        start = text[:chars]
    else:
        return None
    return hashlib.blake2b(start.encode("utf-8", "replace"), digest_size=12).hexdigest()


def rank_by_load(loads: dict[Hashable, int], preferred: Hashable | None,
                 last_routed: dict[Hashable, int] | None = None) -> list[list[Hashable]]:
    """Replica ids in ranks of equal load, least loaded first; ``preferred`` (the affinity
    replica) alone ahead of its rank when that rank is the least loaded one. Within a rank, ids are
    ordered by ``last_routed`` (a counter value per id; never routed first), since Ray Serve takes
    the first of equally loaded replicas."""
    last_routed = last_routed or {}
    ranks: dict[int, list[Hashable]] = {}
    for rid, load in loads.items():
        ranks.setdefault(load, []).append(rid)
    ordered = [sorted(ranks[load], key=lambda rid: last_routed.get(rid, -1)) for load in sorted(ranks)]
    if ordered and preferred in ordered[0] and len(ordered[0]) > 1:
        ordered[0] = [r for r in ordered[0] if r != preferred]
        ordered.insert(0, [preferred])
    return ordered


class PickLedger:
    """Replicas picked for requests that Ray has not yet counted as sent to them. ``sent`` drops a
    replica's oldest pick; a pick Ray never sends (it routed elsewhere, or the request was
    cancelled) lapses after ``ttl_s``."""

    def __init__(self, ttl_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._picks: dict[Hashable, deque[float]] = {}  # replica -> times it was picked, oldest first

    def pick(self, replica: Hashable) -> None:
        self._picks.setdefault(replica, deque()).append(self._clock())

    def sent(self, replica: Hashable) -> None:
        picks = self._picks.get(replica)
        if picks:
            picks.popleft()

    def pending(self, replica: Hashable) -> int:
        picks = self._picks.get(replica)
        if not picks:
            return 0
        oldest = self._clock() - self._ttl_s
        while picks and picks[0] < oldest:
            picks.popleft()
        return len(picks)


class LoadAffinityRouter(FIFOMixin, RequestRouter):
    """Least ongoing requests first; ties go to the replica that served the same prompt start."""

    def initialize_state(self, max_keys: int = 4096, **_: Any) -> None:
        """Called by Ray Serve right after construction (with the deployment's router kwargs)."""
        self._last: OrderedDict[str, ReplicaID] = OrderedDict()  # affinity key -> replica that served it
        self._max_keys = max_keys
        self._routed = 0  # requests routed so far
        self._last_routed: dict[ReplicaID, int] = {}  # replica -> value of _routed when last chosen
        self._picks = PickLedger()

    def _load(self, replica: RunningReplica) -> int:
        cache = self.replica_queue_len_cache
        live = cache.get(replica.replica_id)
        if live is None:
            live = int((replica.routing_stats or {}).get("requests", 0))
            cache.update(replica.replica_id, live)
        return live + self._picks.pending(replica.replica_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        key = _key(pending_request)
        preferred = self._last.get(key) if key is not None else None
        ranks = rank_by_load({rid: self._load(r) for rid, r in by_id.items()}, preferred, self._last_routed)
        order = [rid for rank in ranks for rid in rank]
        self._picks.pick(order[0])
        return [[by_id[rid]] for rid in order]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._picks.sent(replica_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._routed += 1
        self._last_routed[replica_id] = self._routed
        key = _key(pending_request)
        if key is None:
            return
        self._last[key] = replica_id
        self._last.move_to_end(key)
        while len(self._last) > self._max_keys:
            self._last.popitem(last=False)


def _key(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    key = pending_request.kwargs.get(AFFINITY_KWARG)
    return key if isinstance(key, str) else None
