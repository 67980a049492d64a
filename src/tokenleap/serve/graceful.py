"""uvicorn's server with a bounded, announced shutdown.

On SIGTERM or Ctrl-C uvicorn stops taking connections and then waits for every open one to end, with
no limit: a stream of thousands of tokens keeps the process alive for minutes, saying nothing, until a
supervisor kills it (docker stop after 10 s, systemd after 90 s) and the clients get a bare end of
stream. This server says what it waits for, lets the requests in flight go on for ``grace`` seconds,
then ends those still running or queued with an error (a stream gets its error event and ``[DONE]``),
so the connections close and the app shuts down in order. A second Ctrl-C stops at once: the
requests still running are ended then and there.
"""
from __future__ import annotations

import asyncio
import socket
import sys

import uvicorn

from tokenleap.serve.scheduler import Scheduler


class GracefulServer(uvicorn.Server):
    def __init__(self, app, scheduler: Scheduler, grace: float) -> None:
        # tokenleap logs each request itself (uvicorn's access log off); uvicorn's own hard limit on the
        # wait sits a few seconds past ``grace``: tasks that outlive the abort are cancelled
        super().__init__(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=grace + 5))
        self.scheduler, self.grace = scheduler, grace
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if self.force_exit and self._loop is not None:  # a second Ctrl-C: end the streams now -- on Python
            # 3.12+ uvicorn's shutdown still awaits Server.wait_closed(), which waits for every connection
            self._loop.call_soon_threadsafe(self.scheduler.abort_all, "the server was stopped")

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        busy = len(self.server_state.tasks)
        if busy:
            print(f"tokenleap: shutting down: {busy} request(s) in flight, ended in {self.grace:g} s if still "
                  "running (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
        else:
            print("tokenleap: shutting down", file=sys.stderr, flush=True)
        asyncio.get_running_loop().call_later(self.grace, self.scheduler.abort_all, "the server is shutting down")
        await super().shutdown(sockets)
        if self.force_exit:  # a second Ctrl-C: uvicorn stops waiting and skips the app's shutdown
            await self._stop_now()

    async def _stop_now(self) -> None:
        """End the requests still running at once (a stream gets its error event), give their
        connections a moment to say so, then shut the app down: left to the process's exit, each open
        stream and the app's lifespan died in a KeyboardInterrupt traceback, about 100 lines apiece."""
        self.scheduler.abort_all("the server was stopped")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 1.0
        while self.server_state.tasks and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for task in self.server_state.tasks:  # (a handler that did not end: cancelled quietly)
            task.cancel()
        await self.lifespan.shutdown()
