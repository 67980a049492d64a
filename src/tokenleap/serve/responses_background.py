"""Background responses (``background: true`` on ``POST /v1/responses``), as OpenAI runs them: the
request is answered at once with the stored response ``in_progress`` and no output, the reply is
generated without the client, and ``GET /v1/responses/{id}`` shows it ``completed`` (or
``incomplete`` at the token budget, ``failed`` with its error) when done. ``POST .../cancel`` stops
one still running: it is stored ``cancelled``, with the text generated so far.

A background response must be stored (``store`` not false, and a store that keeps responses), and
is not streamed here (``stream`` with ``background`` is refused: poll the response instead). Each
server process runs its own; with replicas the store is shared, so any replica answers a ``GET``,
while a cancel must reach the replica running the response.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from tokenleap.serve.jobs import Job
from tokenleap.serve.protocol import failed
from tokenleap.serve.responses import Scored
from tokenleap.serve.responses_api import ResponseWriter

Keep = Callable[[dict[str, Any]], Awaitable[None]]


class BackgroundResponses:
    """The background responses this process runs: response id -> its task."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task] = {}

    def start(self, job: Job, writer: ResponseWriter, keep: Keep, done: Callable[[], None]) -> None:
        """Run ``job`` to its end without a client, storing the finished response with ``keep``
        (``done``: called once it has ended, however)."""
        task = asyncio.get_running_loop().create_task(self._run(job, writer, keep, done))
        self._tasks[writer.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(writer.id, None))

    async def cancel(self, response_id: str) -> bool:
        """Stop a running response (stored ``cancelled``); False if this process runs none by that id."""
        task = self._tasks.get(response_id)
        if task is None:
            return False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return True

    @staticmethod
    async def _run(job: Job, writer: ResponseWriter, keep: Keep, done: Callable[[], None]) -> None:
        text, reason, scored = "", None, []  # type: str, str | None, list[Scored]
        try:
            async for i, out in job.outputs():
                if out.error:
                    err = failed(out.error, out.error_status)
                    await keep(writer.ended("failed", text, {"code": err.type, "message": err.message}))
                    return
                piece, tokens = job.piece(i, out)
                text, scored = text + piece, scored + tokens
                reason = out.finish_reason or reason
            await keep(writer.final(text, reason, job.usage(), scored))
        except asyncio.CancelledError:
            job.cancel()
            await keep(writer.ended("cancelled", text))
        finally:
            done()
