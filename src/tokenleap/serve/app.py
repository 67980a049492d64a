"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/responses, /v1/models (and
/v1/models/{id}), /health, /metrics, vLLM's /tokenize, /detokenize, /version and /ping
(``token_routes.py``), /v1/embeddings with ``--embeddings`` (``embedding_routes.py``), and llama.cpp's
/completion, /infill, /props, /slots and /apply-template.

The model lives in the app; requests become ``scheduler.Request``s processed by the scheduler's
background thread (continuous batching), so no model work runs on the asyncio loop, and a request's
prompt is tokenized on a pool of prompt threads (``off_loop``), so no prompt holds it up either. Each HTTP
request owns an ``asyncio.Queue``; the scheduler thread puts outputs on it with
``loop.call_soon_threadsafe``. A client that disconnects (a cancelled stream, or the disconnect
message a non-streaming request's watcher awaits) has its sequences cancelled at once: the scheduler
drops them, freeing their KV blocks, before its next step.

``create_app`` (or ``OpenAIServer(engine, config, scheduler).app()``) is the one place the FastAPI
app is built: routes, API-key checks (the OpenAPI docs included), CORS, error bodies, and one log
line per finished request (``tokenleap.serve.requests``).
"""
from __future__ import annotations

import datetime
import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenleap.config import MAX_LOGPROBS, ConfigError
from tokenleap.errors import PromptTooLongError
from tokenleap.serve.context_window import check_each_max_tokens, check_max_tokens, truncate_prompt
from tokenleap.serve.chat_render import chat_messages, chat_options
from tokenleap.serve.body import parse_body
from tokenleap.serve.protocol import APIError, ChatRequest, CompletionRequest, bad_request, sampling_params
from tokenleap.serve.request_ids import add_request_ids
from tokenleap.serve.request_checks import check_prompt_logprobs
from tokenleap.serve.responses import Format, add_prompt_logprobs, new_id, now, usage_options
from tokenleap.serve.chunks import openai_chunks
from tokenleap.serve.response_store import DEFAULT_CAPACITY, LRUStore, ResponseStore
from tokenleap.serve.responses_routes import ResponsesRoutes
from tokenleap.serve.scheduler import QueueFullError, Scheduler, SchedulerConfig
from tokenleap.serve.metrics import make_registry
from tokenleap.serve.jobs import ClientGone, Job, PromptView
from tokenleap.serve.error_handlers import add_error_handlers
from tokenleap.serve.origins import add_origin_checks
from tokenleap.serve.checks_and_prompts import ChecksAndPrompts
from tokenleap.serve.infill import fim_encoder
from tokenleap.serve.llamacpp import LlamaCppRoutes
from tokenleap.serve.messages_routes import MessagesRoutes
from tokenleap.serve.llamacpp_info import LlamaCppInfoRoutes
from tokenleap.serve.token_routes import TokenRoutes
from tokenleap.serve.embedding_routes import EmbeddingRoutes
from tokenleap.serve.ollama_routes import OllamaRoutes
from tokenleap.serve.tools import reply_grammar

request_log = logging.getLogger("tokenleap.serve.requests")  # one line per finished request


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    model_aliases: tuple[str, ...] = ()  # other names accepted in a request's "model" (catalog name, path)
    api_key: str | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # CORS: origins a browser may call from ("*": any); () pages served from this machine only (as Ollama)
    allowed_origins: tuple[str, ...] = ()
    log_prompts: bool = False  # put each request's prompt text in its log line
    docs: bool = True  # serve /docs and /openapi.json (behind the API key when one is set)
    responses_store: int = DEFAULT_CAPACITY  # Responses API objects kept for previous_response_id (0: none)
    embeddings: str | None = None  # /v1/embeddings' pooling ("last", "mean"); None: not served (400)
    reasoning: bool = True  # a thinking model's <think> block as reasoning_content (--reasoning-format auto)
    quantization: str | None = None  # how the weights are stored, as Ollama's /api/tags shows it (None: the dtype)


class OpenAIServer(ChecksAndPrompts):
    """The request handlers around one engine and its scheduler (``scheduler``: one built elsewhere,
    by default one from ``config.scheduler``; either way the app's lifespan starts and stops it).
    ``response_store`` keeps Responses API objects: in memory, ``config.responses_store`` of them
    (replicas put a store they share in its place)."""

    def __init__(self, engine, config: ServerConfig, scheduler: Scheduler | None = None) -> None:
        self.engine, self.cfg = engine, config
        self.response_store: ResponseStore = LRUStore(config.responses_store)
        self.tokenizer = engine.tokenizer
        self.scheduler = scheduler if scheduler is not None else Scheduler(engine, config.scheduler)
        self.proposer_name = engine.proposer.name if engine.proposer is not None else "none"
        self.registry = make_registry(self.scheduler.snapshot, config.model_name)
        self.created = now()
        super().__init__()  # the prompt encoder, its threads, the token texts

    # -- app --------------------------------------------------------------------------------
    def app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI):
            self.scheduler.start()
            try:
                yield
            finally:
                self.scheduler.shutdown()
                self.stop_prompt_threads()

        app = FastAPI(title="tokenleap", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        add_error_handlers(app)  # (before CORS: its middleware wraps the error answers too)
        if self.cfg.docs:  # FastAPI's own routes would skip the API key
            app.add_api_route("/openapi.json", self.openapi, methods=["GET"], include_in_schema=False)
            app.add_api_route("/docs", self.docs, methods=["GET"], include_in_schema=False)
        add_origin_checks(app, self.cfg.allowed_origins)  # CORS, and other pages' requests refused
        add_request_ids(app)  # (outermost: the answers of every middleware within carry the id too)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])
        app.add_api_route("/chat/completions", self.chat, methods=["POST"])  # (llama.cpp serves both paths)
        ResponsesRoutes(self).add_to(app)
        MessagesRoutes(self).add_to(app)  # Anthropic's /v1/messages
        LlamaCppRoutes(self).add_to(app)  # llama.cpp's own /completion and /infill (code at a cursor)
        LlamaCppInfoRoutes(self).add_to(app)  # ... and its /props, /apply-template
        app.add_api_route("/v1/models", self.models, methods=["GET", "HEAD"])
        app.add_api_route("/models", self.models, methods=["GET", "HEAD"])
        app.add_api_route("/v1/models/{name:path}", self.model_card, methods=["GET", "HEAD"])
        TokenRoutes(self).add_to(app)  # /tokenize, /detokenize, /version, /ping
        EmbeddingRoutes(self).add_to(app)  # /v1/embeddings (with --embeddings)
        OllamaRoutes(self).add_to(app)  # Ollama's /api/chat, /api/generate, /api/tags ...
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["HEAD"], include_in_schema=False)  # (load balancers)
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.state.server = self
        return app

    # -- endpoints --------------------------------------------------------------------------
    async def completions(self, request: HTTPRequest) -> Response:
        self._auth(request)
        req = parse_body(await request.body(), CompletionRequest)
        self._check(req)
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(f"best_of must equal n ({req.n}): choices are not generated to be ranked and dropped",
                              "best_of")
        if req.truncate_prompt_tokens is not None and req.suffix is not None:
            raise bad_request("truncate_prompt_tokens would cut a fill-in-the-middle prompt's start: leave it "
                              "out with suffix", "truncate_prompt_tokens")
        prompts, budgets, fmt, view = await self.off_loop(lambda: self._completion_prompts(req))
        return await self._run(request, req, prompts, budgets, fmt, req.logprobs, view)

    def _completion_prompts(self, req: CompletionRequest) -> tuple[list[list[int]], list[int], Format, PromptView]:
        """A completion request's prompts as ids, each one's token budget, its reply format and what
        of the prompt its choices show (echo, prompt logprobs)."""
        encode = fim_encoder(self.tokenizer, req) if req.suffix is not None else \
            (lambda p: self.prompts.encode(p, req.add_special_tokens is not False))
        prompts = [truncate_prompt(p, req.truncate_prompt_tokens, self.engine.max_len)
                   for p in self.prompts.many(req.prompt, encode)]
        echo_only = req.max_tokens == 0  # the prompt (and its logprobs) alone, as vLLM and OpenAI answer it
        if echo_only and not req.echo:
            raise bad_request("max_tokens 0 returns the prompt alone: it needs echo set to true", "max_tokens")
        budgets = check_each_max_tokens(1 if echo_only else req.max_tokens, prompts, self.engine.max_len, 16)
        fmt = Format(new_id("cmpl"), "text_completion", self.cfg.model_name, now(), chat=False,
                      **usage_options(req), token_ids=bool(req.return_token_ids),
                      tokens=self._token_text(req.logprobs is not None, req.return_tokens_as_token_ids))
        echo = None
        if req.echo:  # the prompt as given (token ids, or one truncated: decoded) starts each choice
            texts = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else req.prompt
            texts = prompts if req.truncate_prompt_tokens is not None else texts
            echo = [t if isinstance(t, str) else self.tokenizer.decode(t, skip_special_tokens=False)
                    for t in texts for _ in range(req.n)]
        return prompts, budgets, fmt, PromptView(echo, req.logprobs if req.echo else None, echo_only,
                                                 check_prompt_logprobs(req))

    async def chat(self, request: HTTPRequest) -> Response:
        self._auth(request)
        req = parse_body(await request.body(), ChatRequest)
        self._check(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                              "top_logprobs")
        prompt, budget, fmt, view, prediction = await self.off_loop(lambda: self._chat_prompt(req))
        return await self._run(request, req, [prompt], [budget], fmt, (req.top_logprobs or 0) if req.logprobs else None,
                               view, prediction)

    def _chat_prompt(self, req: ChatRequest) -> tuple[list[int], int, Format, PromptView, tuple[int, ...]]:
        """A chat request's prompt ids (the template rendered), its token budget, reply format, echo and
        prompt logprobs, and its prediction's ids."""
        tools = self._plan_tools(req)
        messages = chat_messages(req)
        prompt = truncate_prompt(self.prompts.encode_chat(messages, tools, chat_options(req)),
                                 req.truncate_prompt_tokens, self.engine.max_len)
        named = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        budget = check_max_tokens(getattr(req, named), len(prompt), self.engine.max_len, None, named, "messages")
        fmt = Format(new_id("chatcmpl"), "chat.completion", self.cfg.model_name, now(), chat=True,
                      **usage_options(req), tools=tools, token_ids=bool(req.return_token_ids),
                      tokens=self._token_text(bool(req.logprobs), req.return_tokens_as_token_ids),
                      reasoning=self._reasoning(req, prompt))
        # vLLM's echo: the last message's text starts each reply if it has the reply's role (an assistant
        # message the reply continues, or one before a new assistant turn)
        new_turn = req.add_generation_prompt is not False and not req.continue_final_message
        echo = req.echo and messages[-1]["role"] == ("assistant" if new_turn else messages[-1]["role"])
        view = PromptView([messages[-1]["content"]] * req.n if echo else None,
                          prompt_logprobs=check_prompt_logprobs(req))
        return prompt, budget, fmt, view, self._prediction(req)

    async def models(self, request: HTTPRequest) -> dict[str, Any]:
        """OpenAI's model list; Anthropic's for its clients (they send ``anthropic-version``)."""
        self._auth(request)
        if "anthropic-version" in request.headers:
            card = self._anthropic_card()
            return {"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}
        return {"object": "list", "data": [self._card()]}

    async def model_card(self, name: str, request: HTTPRequest) -> dict[str, Any]:
        """OpenAI's ``GET /v1/models/{model}`` (the served name or one of its aliases); Anthropic's
        form for its clients."""
        self._auth(request)
        self._check_model(name)
        return self._anthropic_card() if "anthropic-version" in request.headers else self._card()

    def _anthropic_card(self) -> dict[str, Any]:
        created = datetime.datetime.fromtimestamp(self.created, datetime.timezone.utc)
        return {"type": "model", "id": self.cfg.model_name, "display_name": self.cfg.model_name,
                "created_at": created.isoformat().replace("+00:00", "Z")}

    def _card(self) -> dict[str, Any]:
        return {"id": self.cfg.model_name, "object": "model", "created": self.created, "owned_by": "tokenleap",
                "max_model_len": self.engine.max_len}

    async def openapi(self, request: HTTPRequest) -> JSONResponse:
        self._auth(request)
        return JSONResponse(request.app.openapi())

    async def docs(self, request: HTTPRequest) -> Response:
        self._auth(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title="tokenleap API")

    async def health(self) -> Response:
        ok = self.scheduler.alive
        return JSONResponse({"status": "ok" if ok else "scheduler stopped"}, status_code=200 if ok else 503)

    async def metrics(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    # -- running a request ------------------------------------------------------------------
    async def _run(self, http: HTTPRequest, req, prompts: list[list[int]], budgets: list[int], fmt: Format,
                   logprobs: int | None = None, view: PromptView = PromptView(),
                   prediction: tuple[int, ...] = ()) -> Response:
        job = await self._start(req, prompts, budgets, reply_grammar(fmt.tools, req), logprobs, view, prediction)

        async def final(texts, reasons, scored) -> dict[str, Any]:
            choices = [{**fmt.choice(i, t, r, s), "stop_reason": job.stop_reason(i)}
                       for i, (t, r, s) in enumerate(zip(texts, reasons, scored))]
            if fmt.token_ids:  # vLLM's return_token_ids: a chat's one prompt beside its choices
                for choice, r in zip(choices, job.requests):
                    choice.update(token_ids=[] if view.echo_only else list(r.seq.generated),  # (echo alone: none)
                                  **({} if fmt.chat else {"prompt_token_ids": list(r.seq.prompt)}))
            body = fmt.obj(choices, usage=job.usage(),
                           **({"prompt_token_ids": list(job.requests[0].seq.prompt)} if fmt.chat and fmt.token_ids
                              else {}))
            if view.prompt_logprobs is not None:
                add_prompt_logprobs(body, job.prompt_scored, view.prompt_logprobs,
                                    self._token_text(True, req.return_tokens_as_token_ids), fmt.chat)
            return body
        return await self._answer(http, job, fmt, bool(req.stream), openai_chunks(job, fmt), final)

    async def _answer(self, http: HTTPRequest, job: Job, fmt: Format, stream: bool, events: AsyncIterator[str],
                      final, media_type: str = "text/event-stream") -> Response:
        """A started job's response: ``events`` as a stream (server-sent events, or another
        ``media_type``), or else the JSON object that ``final(texts, reasons, scored)`` gives for the
        whole replies (a client gone first: 499)."""
        if stream:
            return StreamingResponse(self._logged(job, fmt, events), media_type=media_type)
        try:
            texts, reasons, scored = await self._collect(http, job, fmt)
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(await final(texts, reasons, scored))

    async def _start(self, req, prompts: list[list[int]], budgets: list[int], spec, logprobs: int | None = None,
                     view: PromptView = PromptView(), prediction: tuple[int, ...] = ()) -> Job:
        """The request's sequences submitted (``spec``: the grammar its replies follow, if any;
        ``prediction``: token ids the replies are expected to resemble)."""
        if spec is not None:  # the first structured request builds the grammar tokenizer (~1 s): off the loop
            try:
                await self.off_loop(lambda: self.engine.constraints.prepare(spec))
            except ConfigError as e:
                raise bad_request(str(e), "response_format") from None
        # (off the loop: a sequence's creation tokenizes its bad_words and copies its grammar's matcher)
        seqs = await self.off_loop(lambda: self._sequences(req, prompts, budgets, logprobs, view, spec, prediction))
        job = self._submit(seqs, sum(len(p) for p in prompts), view)
        if self.cfg.log_prompts:  # as the client sent it: a completion's prompt, or the chat messages
            job.prompt_text = req.prompt if isinstance(getattr(req, "prompt", None), str) else json.dumps(
                req.prompt if hasattr(req, "prompt") else [m.model_dump(exclude_none=True) for m in req.messages],
                ensure_ascii=False)
        return job

    async def _collect(self, http: HTTPRequest, job: Job, fmt: Format):
        """``job.collect``; then, however it ends, the job's sequences are cancelled and its line logged."""
        try:
            return await job.collect(http)
        finally:
            job.cancel()
            self._log(job, fmt)

    def _sequences(self, req, prompts: list[list[int]], budgets: list[int], logprobs: int | None,
                   view: PromptView, structured=None, prediction: tuple[int, ...] = ()) -> list:
        """The request's sequences, ``n`` a prompt, each checked (a 400 naming what is wrong)."""
        if len(prompts) * req.n > self.scheduler.capacity:  # never admitted, however long the client waits
            raise bad_request(f"this request has {len(prompts) * req.n} sequences (n times its prompts) but the "
                              f"server takes at most {self.scheduler.capacity} at once (--max-num-seqs plus "
                              f"--max-waiting)", "n")
        seqs, prompt_param = [], "messages" if isinstance(req, ChatRequest) else "prompt"
        for prompt, budget in zip(prompts, budgets):
            for choice in range(req.n):
                params = sampling_params(req, budget, choice, logprobs, view.engine_logprobs, structured, prediction)
                try:
                    seqs.append(self.engine.create(prompt, params))
                except PromptTooLongError as e:
                    raise bad_request(str(e), prompt_param, "context_length_exceeded") from None
                except ConfigError as e:  # an empty prompt, or a schema, regex or grammar that does not compile
                    raise bad_request(str(e), "response_format" if prompt else prompt_param) from None
        return seqs

    def _submit(self, seqs: list, prompt_tokens: int, view: PromptView) -> Job:
        job = Job(self.scheduler, seqs, prompt_tokens, view)
        try:
            self.scheduler.submit(job.requests)
        except QueueFullError as e:
            raise APIError(503, f"the server is busy: {e}", "server_busy", None, "queue_full") from None
        return job

    async def _logged(self, job: Job, fmt: Format, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """``events`` as they come; then, however the stream ends (the client gone too), the job's
        sequences are cancelled and its line logged."""
        try:
            async with aclosing(events):
                async for event in events:
                    yield event
        finally:
            job.cancel()
            self._log(job, fmt)

    def _log(self, job: Job, fmt: Format) -> None:
        request_log.info(job.log_line(fmt.id, self.proposer_name))


def create_app(engine, config: ServerConfig, scheduler: Scheduler | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (an ``Engine`` built on a ``PagedKVCache``); the app's
    lifespan starts and stops the scheduler (``scheduler``: one given, or one of ``config.scheduler``).
    The handlers are ``app.state.server`` (an ``OpenAIServer``)."""
    return OpenAIServer(engine, config, scheduler).app()
