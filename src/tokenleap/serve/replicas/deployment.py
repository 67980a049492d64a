"""``tokenleap serve --replicas N`` on Ray Serve: N engine replicas behind one OpenAI endpoint.

- ``Replica`` (one Ray Serve replica each): one whole tokenleap server -- engine, scheduler, paged
  cache, proposer -- built from the same parsed command line as ``tokenleap serve`` (``cli/serve.
  build_app``), with ``--threads-per-replica`` torch threads. It runs each forwarded request through
  that server's FastAPI app in-process (``asgi_bridge.run_asgi``), so the routes, checks and
  response formats are the single-process server's own, not a copy.
- ``Ingress`` (Ray Serve's HTTP entry): forwards every request to a replica chosen by
  ``replica_router.LoadAffinityRouter`` (fewest ongoing requests, ties by prompt-prefix affinity) and
  relays the response, streamed as it comes. A replica that dies before answering has its request
  sent to another one; a stream cut by a dying replica ends with an error event and ``[DONE]``.
  Ray Serve restarts the dead replica. ``/metrics`` merges the replicas' exports
  (``replica_metrics``).
"""

import argparse
import asyncio
import json
import logging
import shlex
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from prometheus_client.core import CounterMetricFamily
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import ReplicaUnavailableError

from tokenleap.serve.replicas.bridge import HTTPCall, ResponseStart, forwarded_headers, run_asgi
from tokenleap.serve.error_handlers import error_body, http_status
from tokenleap.serve.messages_routes import PATH as MESSAGES_PATH
from tokenleap.serve.ollama_routes import PREFIX as OLLAMA_PREFIX
from tokenleap.serve.protocol import APIError
from tokenleap.serve.replicas.metrics import MetricsBoard, board_name, merge_exports
from tokenleap.serve.replicas.router import AFFINITY_KWARG, LoadAffinityRouter, affinity_key
from tokenleap.serve.replicas.store import SharedStore, create_store_actor
from tokenleap.serve.response_store import DEFAULT_CAPACITY
from tokenleap.cli.replicas import threads_per_replica

log = logging.getLogger("tokenleap.serve.replicas.deployment")

REPLICA_GONE = (RayActorError, ReplicaUnavailableError)  # the replica's process died or cannot be reached


@dataclass(frozen=True)
class ReplicaSettings:
    """How the replicas and the ingress are deployed; ``args``: the parsed ``serve`` command line."""

    args: argparse.Namespace | None
    threads: int = 1  # torch threads and Ray CPUs of each replica
    replicas: int = 1
    autoscale: tuple[int, int] | None = None  # (min, max) replicas
    served_name: str = "model"
    app_name: str = "tokenleap"
    max_ongoing_requests: int = 80  # per replica (its batch and its queue), beyond which the ingress queues
    target_ongoing_requests: int = 16  # autoscaling's goal per replica
    affinity_chars: int = 1024  # prompt characters hashed for prefix affinity (about one prefill window)
    attempts: int = 3  # tries of a request whose replica dies before anything reached the client
    metrics_period_s: float = 2.0  # how often each replica posts its /metrics export
    health_check_period_s: float = 5.0
    app_factory: Callable[[], FastAPI] | None = None  # builds each replica's app instead of ``args`` (tests)
    responses_store: int = DEFAULT_CAPACITY  # Responses API objects the replicas' shared store keeps


def settings_from_args(args: argparse.Namespace, **overrides: Any) -> ReplicaSettings:
    """Replica settings from the ``serve`` command line (``overrides``: any other field)."""
    fields: dict[str, Any] = dict(
        args=args, threads=threads_per_replica(args), replicas=args.replicas, autoscale=args.autoscale,
        served_name=args.served_model_name or args.model, max_ongoing_requests=args.max_num_seqs + args.max_waiting,
        target_ongoing_requests=args.max_num_seqs, affinity_chars=4 * args.prefill_chunk,
        responses_store=args.responses_store)
    return ReplicaSettings(**{**fields, **overrides})


class Replica:
    """One tokenleap server inside a Ray Serve replica (see the module docstring)."""

    async def __init__(self, settings: ReplicaSettings) -> None:
        import torch
        torch.set_num_threads(settings.threads)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if getattr(settings.args, "disable_log_requests", False):
            logging.getLogger("tokenleap.serve.requests").setLevel(logging.WARNING)
        self.settings = settings
        if settings.app_factory is not None:
            self.app = settings.app_factory()
        else:
            from tokenleap.cli.serve import build_app
            self.app, _ = build_app(settings.args)
        server = self.app.state.server
        if server.response_store.capacity > 0:  # one store for all replicas (the ingress holds it)
            server.response_store = SharedStore(settings.app_name, settings.responses_store)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the scheduler thread
        self.name = serve.get_replica_context().replica_tag
        self.ongoing = 0
        self._poster = asyncio.ensure_future(self._post_metrics())

    async def serve_http(self, call: HTTPCall, affinity: str | None = None) -> AsyncIterator[ResponseStart | bytes]:
        """Run one forwarded request; yields its ``ResponseStart`` (naming this replica), then body pieces.
        ``affinity`` is read by the router only."""
        self.ongoing += 1
        try:
            async for item in run_asgi(self.app, call):
                yield replace(item, replica=self.name) if isinstance(item, ResponseStart) else item
        finally:
            self.ongoing -= 1

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router reads besides Ray's own request counts."""
        stats: dict[str, Any] = {"requests": self.ongoing}
        scheduler = self._scheduler()
        if scheduler is not None:
            snap = scheduler.snapshot()
            stats.update(running=snap.running, waiting=snap.waiting, kv_usage=snap.kv_usage)
        return stats

    def check_health(self) -> None:
        scheduler = self._scheduler()
        if scheduler is not None and not scheduler.alive:
            raise RuntimeError("the replica's scheduler thread stopped")

    def __del__(self) -> None:  # Ray Serve stops the replica
        poster = getattr(self, "_poster", None)
        if poster is not None:
            poster.cancel()

    def _scheduler(self):
        server = getattr(self.app.state, "server", None)
        return getattr(server, "scheduler", None)

    async def _post_metrics(self) -> None:
        """Post this replica's /metrics export to the ingress's board every ``metrics_period_s``."""
        name = board_name(self.settings.app_name)
        while True:
            try:
                text = b"".join([p async for p in run_asgi(self.app, HTTPCall("GET", "/metrics"))
                                 if isinstance(p, bytes)])
                board = await asyncio.to_thread(ray.get_actor, name)
                board.post.remote(self.name, text.decode())
            except ValueError:  # no board yet: the ingress creates it
                pass
            except Exception as e:  # metrics must never take a replica down
                log.warning("could not post metrics: %s", e)
            await asyncio.sleep(self.settings.metrics_period_s)


def stream_cut(path: str) -> bytes:  # (defined before Ingress: Ray Serve pickles the class where it is decorated)
    """The end of a stream whose replica failed, in the form of the route's events: Anthropic's error
    event on /v1/messages, an error line on Ollama's /api/ routes, else an OpenAI error object and
    ``[DONE]``."""
    err = APIError(500, "the replica serving this request failed; retry the request", "server_error")
    body = json.dumps(error_body(path, err), ensure_ascii=False)
    if path.startswith(MESSAGES_PATH):
        return f"event: error\ndata: {body}\n\n".encode()
    if path.startswith(OLLAMA_PREFIX):
        return f"{body}\n".encode()
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()


ingress_app = FastAPI(title="tokenleap (replicas)", docs_url=None, redoc_url=None, openapi_url=None)
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


# (Ray Serve pickles this class by value when it is decorated: its methods may use only names
# defined above this point)
@serve.ingress(ingress_app)
class Ingress:
    """The HTTP entry: forwards each request to a replica and relays the answer (module docstring)."""

    def __init__(self, replicas, settings: ReplicaSettings) -> None:
        self.replicas, self.settings = replicas, settings
        self.board = ray.remote(MetricsBoard).options(name=board_name(settings.app_name), get_if_exists=True,
                                                      num_cpus=0).remote()
        self.store = create_store_actor(settings.app_name, settings.responses_store)  # the replicas' Responses
        self.routed: dict[str, int] = {}  # replica -> requests it answered
        self.retries = 0
        self.cut_streams = 0

    @ingress_app.get("/metrics")
    async def metrics(self) -> Response:
        try:
            texts = await self.board.read.remote(3 * self.settings.metrics_period_s + 1)
        except RayActorError:  # the board died with a previous ingress: start a new one
            self.board = ray.remote(MetricsBoard).options(name=board_name(self.settings.app_name),
                                                          get_if_exists=True, num_cpus=0).remote()
            texts = {}
        routed = CounterMetricFamily("tokenleap:ingress_requests", "Requests the ingress forwarded, by the replica "
                                     "that answered", labels=["replica"])
        for replica, n in sorted(self.routed.items()):
            routed.add_metric([replica], n)
        retried = CounterMetricFamily("tokenleap:ingress_retries", "Requests resent after their replica died")
        retried.add_metric([], self.retries)
        cut = CounterMetricFamily("tokenleap:ingress_cut_streams", "Streams ended by an error event because their "
                                  "replica died")
        cut.add_metric([], self.cut_streams)
        body = merge_exports(texts, [routed, retried, cut])
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @ingress_app.api_route("/{path:path}", methods=_METHODS)
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        path, root = request.scope["path"], request.scope.get("root_path", "")
        if root and path.startswith(root):  # served under a route prefix: the replicas' routes start at /
            path = path[len(root):] or "/"
        call = HTTPCall(request.method, path, request.url.query.encode(),
                        forwarded_headers(request.headers.raw), body)
        key = affinity_key(body, self.settings.affinity_chars) if request.method == "POST" else None
        failure = "no replica answered"
        for attempt in range(self.settings.attempts):
            if attempt:
                self.retries += 1
                await asyncio.sleep(0.2 * attempt)  # time for the router to drop the dead replica
            gen = self.replicas.options(stream=True).serve_http.remote(call, **{AFFINITY_KWARG: key})
            try:
                start = await gen.__anext__()
                if start.streamed:
                    self.routed[start.replica] = self.routed.get(start.replica, 0) + 1
                    # the background task also runs when the client left before the body started
                    return StreamingResponse(self._relay(gen, path), start.status, headers=dict(start.headers),
                                             background=BackgroundTask(gen.cancel))
                content = b"".join([piece async for piece in gen])
            except asyncio.CancelledError:  # the client went away: so does the replica's work
                gen.cancel()
                raise
            except REPLICA_GONE as e:
                failure = f"{type(e).__name__}: {e}"
                log.warning("replica lost before answering (attempt %d): %s", attempt + 1, failure)
                continue
            self.routed[start.replica] = self.routed.get(start.replica, 0) + 1
            return Response(content, start.status, headers=dict(start.headers))
        message = f"no replica could serve the request ({failure}); retry later"
        return JSONResponse(error_body(path, APIError(503, message, "server_busy")),
                            status_code=http_status(path, 503), headers={"Retry-After": "1"})

    async def _relay(self, gen, path: str) -> AsyncIterator[bytes]:
        """A streamed body as the replica sends it; an error event (``stream_cut``) if the replica fails."""
        try:
            async for piece in gen:
                yield piece
        except Exception as e:  # the replica died (or failed) mid-stream: end the stream cleanly
            self.cut_streams += 1
            log.warning("stream cut: %s: %s", type(e).__name__, e)
            yield stream_cut(path)
        finally:
            gen.cancel()  # the client left (or the stream ended): stop the replica's work


def replica_options(settings: ReplicaSettings) -> dict[str, Any]:
    """The replica deployment's Ray Serve options: a fixed count, or autoscaling on ongoing requests."""
    scaling: dict[str, Any]
    if settings.autoscale is not None:
        lo, hi = settings.autoscale
        scaling = {"autoscaling_config": {
            "min_replicas": lo, "max_replicas": hi, "initial_replicas": min(max(settings.replicas, lo, 1), hi),
            "target_ongoing_requests": settings.target_ongoing_requests}}
    else:
        scaling = {"num_replicas": settings.replicas}
    return dict(**scaling, max_ongoing_requests=settings.max_ongoing_requests,
                ray_actor_options={"num_cpus": settings.threads},
                health_check_period_s=settings.health_check_period_s, health_check_timeout_s=30.0,
                graceful_shutdown_timeout_s=5.0, logging_config={"enable_access_log": False},
                request_router_config=RequestRouterConfig(request_router_class=LoadAffinityRouter,
                                                          request_routing_stats_period_s=1.0))


def build_application(settings: ReplicaSettings):
    """The Ray Serve application: the ingress bound to the replica deployment."""
    most = settings.autoscale[1] if settings.autoscale else settings.replicas
    replica = serve.deployment(Replica, name="Replica").options(**replica_options(settings))
    ingress = serve.deployment(Ingress, name="Ingress").options(
        num_replicas=1, ray_actor_options={"num_cpus": 0}, logging_config={"enable_access_log": False},
        max_ongoing_requests=max(256, 2 * most * settings.max_ongoing_requests))
    return ingress.bind(replica.bind(settings), settings)


def app_builder(args: dict[str, Any]):
    """Ray Serve application builder (``import_path: tokenleap.serve.replicas.deployment:app_builder``, as in
    deploy/rayservice.yaml): ``args["argv"]`` holds the ``tokenleap serve`` options, as a list or a
    string."""
    from tokenleap.cli.main import build_parser
    argv = args.get("argv", [])
    argv = shlex.split(argv) if isinstance(argv, str) else [str(a) for a in argv]
    ns = build_parser().parse_args(["serve", *argv])
    return build_application(settings_from_args(ns))
