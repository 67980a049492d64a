"""One Responses API store for all replicas of an app, so that a request naming a
``previous_response_id`` finds it whichever replica the router picks.

The ingress creates a named Ray actor holding an ``LRUStore`` (the single-process server's store,
unchanged); each replica's server reaches it through ``SharedStore``, which has the store's async
calls. The actor lives as long as the ingress: if the ingress restarts, stored responses are gone
(a later ``previous_response_id`` naming one gets the store's 404).
"""
from __future__ import annotations

import asyncio

import ray
from ray.exceptions import RayActorError

from tokenleap.serve.response_store import LRUStore, StoredResponse


def store_name(app_name: str) -> str:
    return f"tokenleap-responses-{app_name}"


def create_store_actor(app_name: str, capacity: int):
    """The app's store actor (the one already running under its name, if any)."""
    return ray.remote(LRUStore).options(name=store_name(app_name), get_if_exists=True, num_cpus=0).remote(capacity)


class SharedStore:
    """The ``ResponseStore`` calls on the app's store actor, found by name when first used (and
    again after the actor was lost)."""

    def __init__(self, app_name: str, capacity: int) -> None:
        self.name, self.capacity = store_name(app_name), capacity
        self._actor = None

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self._call("get_now", response_id)

    async def put(self, response_id: str, entry: StoredResponse) -> None:
        await self._call("put_now", response_id, entry)

    async def delete(self, response_id: str) -> bool:
        return await self._call("delete_now", response_id)

    async def _call(self, method: str, *args):
        for attempt in range(2):
            if self._actor is None:
                self._actor = await asyncio.to_thread(ray.get_actor, self.name)
            try:
                return await getattr(self._actor, method).remote(*args)
            except RayActorError:  # the ingress (and its store) restarted: look the new one up once
                self._actor = None
                if attempt:
                    raise
