"""Ollama's API routes (``ollama_api.py``), so clients written for an Ollama server use this one:

- ``POST /api/chat``, ``POST /api/generate``: replies, streamed as JSON lines by default;
- ``POST /api/embed`` (``input``: a text or a list; normalized vectors; ``truncate``, by default
  true: a long input's first tokens) and the older ``POST /api/embeddings`` (``prompt``: one
  vector, not normalized), with ``--embeddings`` as the OpenAI route;
- ``GET /api/tags``, ``GET /api/ps``, ``POST /api/show``, ``GET /api/version``: the served model
  (its name with Ollama's ``:latest`` tag, family, size, quantization, context length, chat template,
  capabilities -- completion, tools, insert, thinking, embedding, as this model and server have them);
- ``POST /api/pull`` of the served model: success, with nothing to download (another model: 404);
  ``/api/create``, ``/api/copy``, ``/api/push``, ``DELETE /api/delete``: a 501, since the server serves
  the one model it was started with;
- ``GET /`` (and ``HEAD``): "tokenleap is running", where Ollama's clients check that a server is up.

A request names the model as served, as one of its aliases, or either with ``:latest``, in any case
(as Ollama's names); another name is a 404. Errors take Ollama's form, ``{"error": "..."}`` (``error_handlers.py``).
"""
from __future__ import annotations

import hashlib
import time
from typing import Any

import torch
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from tokenleap.config import ConfigError
from tokenleap.models.catalog import CATALOG
from tokenleap.models.embed import normalize_embedding
from tokenleap.serve.embedding_routes import EmbeddingRoutes
from tokenleap.serve.ollama_api import (ChatBody, GenerateBody, ReplyWriter, chat_request, context_window,
                                        created_at, fit_window, generate_request, load_reply, logprobs_wanted,
                                        thinking_kwargs)
from tokenleap.serve.context_window import fit_turns
from tokenleap.serve.chat_render import chat_messages, chat_options
from tokenleap.serve.protocol import (APIError, ChatRequest, CompletionRequest, Int64, _Strict, bad_request,
                                      structured_output)
from tokenleap.serve.body import parse_body
from tokenleap.serve.reasoning import template_thinks
from tokenleap.serve.responses import Format, new_id, now
from tokenleap.serve.tools import ToolPlan, reply_grammar
from tokenleap.text.fim import encode_fim, fim_tokens

PREFIX = "/api/"
_DTYPE_LABELS = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}  # unquantized weights
# the Ollama release whose API these routes follow (clients check it before using newer fields)
OLLAMA_VERSION = "0.13.0"
NDJSON = "application/x-ndjson"


class _Named(_Strict):
    model: str | None = None
    name: str | None = None  # (older clients' name for it)


class EmbedBody(_Strict):  # POST /api/embed
    model: str
    input: str | list[str]
    truncate: bool | None = True
    dimensions: Int64 | None = None
    options: dict[str, Any] | None = None  # accepted, unused
    keep_alive: str | float | None = None


class EmbeddingsBody(_Strict):  # POST /api/embeddings (the older route)
    model: str
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None


class PullBody(_Named):
    stream: bool | None = None
    insecure: bool | None = None


class OllamaRoutes:
    """The routes above for ``server`` (an ``app.OpenAIServer``: its checks, encoding and jobs)."""

    def __init__(self, server) -> None:
        self.server = server
        self.embeddings = EmbeddingRoutes(server)
        self.started = created_at()
        self._details: dict[str, Any] | None = None  # the model's details and weight bytes, found once
        self._size = 0

    def add_to(self, app: FastAPI) -> None:
        for path, handler, method in (("chat", self.chat, "POST"), ("generate", self.generate, "POST"),
                                      ("embed", self.embed, "POST"), ("embeddings", self.embed_one, "POST"),
                                      ("tags", self.tags, "GET"), ("ps", self.ps, "GET"), ("show", self.show, "POST"),
                                      ("version", self.version, "GET"), ("pull", self.pull, "POST"),
                                      ("create", self.not_served, "POST"), ("copy", self.not_served, "POST"),
                                      ("push", self.not_served, "POST"), ("delete", self.not_served, "DELETE")):
            app.add_api_route(PREFIX + path, handler, methods=[method])
        app.add_api_route("/", self.root, methods=["GET", "HEAD"], include_in_schema=False)

    # -- replies ----------------------------------------------------------------------------
    async def chat(self, request: HTTPRequest) -> Response:
        server = self.server
        server._auth(request)
        body = parse_body(await request.body(), ChatBody)
        name = self._check_model(body.model)
        if not body.messages:
            return JSONResponse(load_reply(name, True, body.keep_alive))
        self._check_think(body, name)
        chat = chat_request(body)
        chat.model = None  # (checked above, with Ollama's tag)
        server._check(chat)
        logprobs = logprobs_wanted(body)
        tools = server._plan_tools(chat)
        window = context_window(body, server.engine.max_len)
        messages, options = chat_messages(chat), chat_options(chat)
        encode = lambda kept: server.prompts.encode_chat(kept, tools, options)  # noqa: E731

        def prompt_ids() -> list[int]:  # the oldest turns go first, then the long message's middle
            if body.truncate is False:
                return encode(messages)
            return fit_window(body, fit_turns(messages, encode, window - 1)[1], window)
        prompt = await server.off_loop(prompt_ids)
        job = await server._start(chat, [prompt], [self._budget(chat.max_tokens, len(prompt), window)],
                                  reply_grammar(tools, chat), logprobs)
        writer = ReplyWriter(name, True, job, tools, server._reasoning(chat, prompt),
                             server._token_text(logprobs is not None))
        return await self._answer(request, job, writer, chat.stream, "chat")

    async def generate(self, request: HTTPRequest) -> Response:
        server = self.server
        server._auth(request)
        body = parse_body(await request.body(), GenerateBody)
        name = self._check_model(body.model)
        if not (body.prompt or body.suffix or body.system):
            return JSONResponse(load_reply(name, False, body.keep_alive))
        self._check_think(body, name)
        req = generate_request(body)
        req.model = None
        server._check(req)
        logprobs = logprobs_wanted(body)
        window = context_window(body, server.engine.max_len)
        ids, templated = await server.off_loop(lambda: self._prompt(body, req, window))
        reasoning = server._reasoning(ChatRequest.model_construct(), ids) if templated else None
        job = await server._start(req, [ids], [self._budget(req.max_tokens, len(ids), window)],
                                  structured_output(req), logprobs)
        writer = ReplyWriter(name, False, job, ToolPlan(), reasoning, server._token_text(logprobs is not None),
                             context=ids,
                             encode=lambda text: server.prompts.encode(text, add_special_tokens=False) if text else [])
        return await self._answer(request, job, writer, req.stream, "generate")

    def _prompt(self, body: GenerateBody, req: CompletionRequest, window: int) -> tuple[list[int], bool]:
        """The generate request's prompt ids, and whether the chat template rendered them: the gap
        between prompt and ``suffix`` (FIM), the ``raw`` prompt, or prompt and ``system`` as a chat;
        after the ``context`` a previous reply returned (its oldest tokens cut to fit the ``window``)."""
        server = self.server
        if body.suffix:
            try:
                ids, fim = encode_fim(server.tokenizer, body.prompt or "", body.suffix)
            except ConfigError as e:
                raise bad_request(str(e), "suffix") from None
            req.stop_token_ids = list(fim.stop_ids)
            templated = False
        elif body.raw or not getattr(server.tokenizer, "chat_template", None):
            ids, templated = server.prompts.encode(body.prompt or ""), False
        else:
            messages = [{"role": "system", "content": body.system}] if body.system else []
            options = {"add_generation_prompt": True, **thinking_kwargs(body)}
            ids, templated = server.prompts.encode_chat(
                messages + [{"role": "user", "content": body.prompt or ""}], ToolPlan(), options), True
        if body.context:
            context = server.prompts.encode(list(body.context), param="context")
            if body.truncate is not False:  # the oldest tokens go where the window is short of room
                context = context[max(0, len(context) + len(ids) + 1 - window):]
            ids = context + ids
        return fit_window(body, ids, window), templated

    def _budget(self, requested: int | None, prompt_len: int, window: int) -> int:
        """Tokens the reply may have: ``num_predict`` (None: up to the window's end), cut to the room
        the ``window`` leaves, as Ollama stops there; a 400 when the prompt leaves none."""
        room = window - prompt_len
        if room < 1:
            limit = ("this model's maximum context length" if window == self.server.engine.max_len
                     else "the context window (options.num_ctx)")
            raise bad_request(f"{limit} is {window} tokens; the prompt has {prompt_len}", "prompt",
                              "context_length_exceeded")
        if requested is not None and requested < 1:
            raise bad_request(f"options.num_predict must be -1, -2 or >= 1, got {requested}", "options")
        return min(requested or room, room)

    async def _answer(self, request: HTTPRequest, job, writer: ReplyWriter, stream: bool, kind: str) -> Response:
        fmt = Format(new_id("ollama"), kind, writer.model, now(), chat=writer.chat)  # (the request's log line)

        async def final(texts, reasons, scored) -> dict[str, Any]:
            return writer.final(texts[0], reasons[0], scored[0])
        return await self.server._answer(request, job, fmt, stream, writer.lines(), final, media_type=NDJSON)

    # -- embeddings -------------------------------------------------------------------------
    async def embed(self, request: HTTPRequest) -> dict[str, Any]:
        server = self.server
        server._auth(request)
        t0 = time.monotonic()
        pooling = self.embeddings.pooled("input")
        body = parse_body(await request.body(), EmbedBody)
        name = self._check_model(body.model)
        self.embeddings.check_dimensions(body.dimensions)
        truncate = body.truncate is not False
        ids = await server.off_loop(lambda: self.embeddings.token_lists(body.input, truncate=truncate))
        vectors = await self.embeddings.vectors(ids, pooling)
        return {"model": name, "embeddings": [normalize_embedding(v.float(), 2).tolist() for v in vectors],
                "total_duration": int((time.monotonic() - t0) * 1e9), "load_duration": 0,
                "prompt_eval_count": sum(len(x) for x in ids)}

    async def embed_one(self, request: HTTPRequest) -> dict[str, Any]:
        server = self.server
        server._auth(request)
        pooling = self.embeddings.pooled("prompt")
        body = parse_body(await request.body(), EmbeddingsBody)
        self._check_model(body.model)
        if not body.prompt:
            return {"embedding": []}
        ids = await server.off_loop(lambda: self.embeddings.token_lists(body.prompt, truncate=True))
        vector, = await self.embeddings.vectors(ids, pooling)
        return {"embedding": vector.float().tolist()}

    # -- the model --------------------------------------------------------------------------
    async def tags(self, request: HTTPRequest) -> dict[str, Any]:
        self.server._auth(request)
        return {"models": [self._entry()]}

    async def ps(self, request: HTTPRequest) -> dict[str, Any]:
        self.server._auth(request)
        entry = self._entry()
        return {"models": [{**entry, "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
                            "context_length": self.server.engine.max_len}]}

    async def show(self, request: HTTPRequest) -> dict[str, Any]:
        server = self.server
        server._auth(request)
        body = parse_body(await request.body(), _Named)
        self._check_model(body.model or body.name or "")
        cfg, details = server.engine.model.config, self._model_details()
        arch = details["family"]
        template = getattr(server.tokenizer, "chat_template", None) or ""
        info = {"general.architecture": arch, "general.parameter_count": _parameter_count(cfg),
                f"{arch}.context_length": server.engine.max_len, f"{arch}.embedding_length": cfg.hidden_size,
                f"{arch}.block_count": cfg.num_hidden_layers, f"{arch}.attention.head_count": cfg.num_attention_heads,
                f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
                f"{arch}.feed_forward_length": cfg.intermediate_size}
        return {"modelfile": "", "parameters": "", "template": template, "details": details, "model_info": info,
                "capabilities": self._capabilities(template), "modified_at": self.started}

    async def root(self) -> Response:
        """A liveness line at the root, where Ollama's clients look for their server."""
        return Response("tokenleap is running", media_type="text/plain")

    async def version(self) -> dict[str, str]:
        """The version Ollama's clients check before they call (no API key asked: as /health, it tells
        nothing of the model or its use)."""
        return {"version": OLLAMA_VERSION}

    async def pull(self, request: HTTPRequest) -> Response:
        self.server._auth(request)
        body = parse_body(await request.body(), PullBody)
        self._check_model(body.model or body.name or "")
        if body.stream is False:
            return JSONResponse({"status": "success"})
        return Response('{"status":"success"}\n', media_type=NDJSON)

    async def not_served(self, request: HTTPRequest) -> Response:
        self.server._auth(request)
        raise APIError(501, f"this server serves the one model it was started with ('{self.server.cfg.model_name}'); "
                            "it cannot create, copy, push or delete models", "not_implemented_error")

    def _check_think(self, body, name: str) -> None:
        """``think`` on (true or an effort) for a model whose template writes no thinking: a 400, as Ollama's."""
        template = getattr(self.server.tokenizer, "chat_template", None)
        if body.think not in (None, False) and not template_thinks(template):
            raise bad_request(f'"{name}" does not support thinking', "think")

    def _check_model(self, name: str) -> str:
        """The model's name in replies (Ollama's tagged form) once ``name`` is found to be it; a 404 else."""
        cfg = self.server.cfg
        if not name:
            raise bad_request("model is required", "model")
        # case-insensitive, as Ollama's own names are ("Llama3.1" finds "llama3.1"); the OpenAI routes match exactly
        served = {n.casefold().removesuffix(":latest") for n in (cfg.model_name, *cfg.model_aliases)}
        if name.casefold().removesuffix(":latest") not in served:
            raise APIError(404, f"model '{name}' not found: this server serves '{self._tagged()}'", "not_found")
        return self._tagged()

    def _tagged(self) -> str:
        name = self.server.cfg.model_name
        return name if ":" in name else name + ":latest"

    def _entry(self) -> dict[str, Any]:
        details = self._model_details()
        name = self._tagged()
        digest = hashlib.sha256(f"{name} {details} {self._size}".encode()).hexdigest()
        return {"name": name, "model": name, "modified_at": self.started, "size": self._size, "digest": digest,
                "details": details}

    def _model_details(self) -> dict[str, Any]:
        if self._details is None:
            from tokenleap.models.quant import weight_bytes
            server = self.server
            model = server.engine.model
            names = (server.cfg.model_name, *server.cfg.model_aliases)
            gguf = any(a.endswith(".gguf") or a in CATALOG for a in names)  # (the catalog's models are GGUFs)
            quant = server.cfg.quantization or _DTYPE_LABELS.get(model.dtype, str(model.dtype))
            self._size = weight_bytes(model)
            self._details = {"parent_model": "", "format": "gguf" if gguf else "safetensors",
                             "family": model.config.architecture, "families": [model.config.architecture],
                             "parameter_size": _size_label(_parameter_count(model.config)),
                             "quantization_level": quant}
        return self._details

    def _capabilities(self, template: str) -> list[str]:
        server = self.server
        out = ["completion"]
        if "tools" in template:
            out.append("tools")
        if fim_tokens(server.tokenizer) is not None:
            out.append("insert")
        if template_thinks(template):
            out.append("thinking")
        if server.cfg.embeddings not in (None, "none"):
            out.append("embedding")
        return out


def _parameter_count(cfg) -> int:
    """The decoder's parameters from its shape: embeddings (and an untied head), attention, MLP, norms."""
    heads = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    attention = cfg.hidden_size * (2 * heads + 2 * kv)
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return embed + cfg.num_hidden_layers * (attention + mlp + 2 * cfg.hidden_size) + cfg.hidden_size


def _size_label(n: int) -> str:
    """Ollama's parameter_size: "1.5B", "494.0M"."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"

