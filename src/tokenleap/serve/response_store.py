"""Stored Responses API objects: what ``previous_response_id``, ``GET /v1/responses/{id}``, its
``/input_items`` and ``DELETE`` read.

A stored response keeps its Response object, the input items it was given (each with an id) and
the whole conversation its reply continues (every earlier turn of its ``previous_response_id``
chain, its own input and its reply as chat messages; instructions are not part of it, since OpenAI
does not carry a response's instructions over to the next). So a chained request needs one lookup,
and deleting or evicting an earlier response never breaks a later one. The earlier turns' message
dicts are shared between the entries of a chain (only the lists are per entry), so a long chain
holds each message once.

The store is in memory and bounded: past ``capacity`` responses the least recently used one is
dropped (``capacity`` 0: nothing is kept). It is async so that replicas can share one held by a
Ray actor (``replicas/deployment.py``) behind the same four calls.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from tokenleap.serve.protocol import bad_request

DEFAULT_CAPACITY = 1000


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was returned
    input_items: list[dict[str, Any]]  # the request's input items, each with an "id"
    messages: list[dict[str, Any]]  # the conversation through this reply, as chat messages


class ResponseStore(Protocol):
    capacity: int

    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def put(self, response_id: str, entry: StoredResponse) -> None: ...

    async def delete(self, response_id: str) -> bool: ...


class LRUStore:
    """Responses by id in this process, least recently used dropped past ``capacity``."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 0:
            raise ValueError(f"the response store's capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    async def get(self, response_id: str) -> StoredResponse | None:
        return self.get_now(response_id)

    async def put(self, response_id: str, entry: StoredResponse) -> None:
        self.put_now(response_id, entry)

    async def delete(self, response_id: str) -> bool:
        return self.delete_now(response_id)

    # the same, called synchronously (the Ray actor that shares a store between replicas)
    def get_now(self, response_id: str) -> StoredResponse | None:
        entry = self._items.get(response_id)
        if entry is not None:
            self._items.move_to_end(response_id)
        return entry

    def put_now(self, response_id: str, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._items[response_id] = entry
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def delete_now(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


def page(items: list[dict[str, Any]], limit: int, order: str, after: str | None) -> dict[str, Any]:
    """A list object of ``items`` as OpenAI pages them: ``order`` asc (given order) or desc, starting
    after the item whose id is ``after`` (a 400 when no item has it), at most ``limit`` items."""
    if order not in ("asc", "desc"):
        raise bad_request("order must be asc or desc", "order")
    if not 1 <= limit <= 100:
        raise bad_request(f"limit must be an integer in [1, 100], got {limit}", "limit")
    ordered = list(items) if order == "asc" else list(reversed(items))
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise bad_request(f"no input item has the id {after!r}", "after")
        ordered = ordered[ids.index(after) + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}
