"""llama.cpp's own server API beside the OpenAI one, for clients written for llama.cpp's server:
``POST /completion`` (also ``/completions``): a prompt (text or token ids) continued; and
``POST /infill``: code completion at a cursor, as editor plugins (llama.vscode and others) call it
(``input_prefix`` / ``input_suffix`` around the cursor, ``input_extra``: other files' chunks as
context, ``prompt``: text the middle starts with; the prompt is ``text/fim.py``'s).

Both run through the same scheduler, sampling and speculation as ``/v1/completions``. llama.cpp's
sampling names and defaults are taken where a field is absent (``n_predict`` -1: up to the context's
end; ``temperature`` 0.8, ``top_k`` 40, ``top_p`` 0.95, ``min_p`` 0.05; ``seed`` -1: unseeded;
``repeat_penalty``); ``json_schema`` or ``grammar`` (GBNF) constrain the reply as
``response_format`` / ``guided_grammar`` do; its other options (``n_probs``, ``cache_prompt``,
``samplers`` ...) are ignored. The reply has llama.cpp's shape: ``{"content", "stop": true, "stop_type" ("eos", "word": a
stop string, "limit"), "stopping_word", "tokens_predicted", "tokens_evaluated", "timings",
"model"}``; streamed, one ``data: {"content": ..., "stop": false}`` event a piece, then the final object.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import Response

from tokenleap.config import ConfigError
from tokenleap.serve.jobs import Job
from tokenleap.serve.protocol import APIError, CompletionRequest, Int64, _Strict, bad_request, \
    check_max_tokens, parse_body, structured_output
from tokenleap.serve.responses import Format, new_id, now
from tokenleap.text.fim import encode_fim


class _LlamaSampling(_Strict):
    model: str | None = None
    n_predict: Int64 | None = None
    temperature: float | None = None
    top_k: Int64 | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: list[str] | None = None
    stream: bool | None = False
    ignore_eos: bool | None = False
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    json_schema: dict[str, Any] | None = None  # the reply follows this JSON schema ...
    grammar: str | None = None  # ... or this grammar (GBNF, as llama.cpp takes it, or Lark)

    def completion(self) -> CompletionRequest:
        """The same request in ``/v1/completions`` terms (llama.cpp's defaults filled in)."""
        def given(value, default):
            return default if value is None else value
        return CompletionRequest.model_construct(**{
            **{name: field.default for name, field in CompletionRequest.model_fields.items()},
            "model": self.model, "prompt": "", "temperature": given(self.temperature, 0.8),
            "top_k": given(self.top_k, 40), "top_p": given(self.top_p, 0.95), "min_p": given(self.min_p, 0.05),
            "seed": None if self.seed in (None, -1) else self.seed, "stop": self.stop, "stream": bool(self.stream),
            "ignore_eos": bool(self.ignore_eos), "repetition_penalty": self.repeat_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "max_tokens": None if self.n_predict in (None, -1) else self.n_predict,
            "guided_json": self.json_schema, "guided_grammar": self.grammar})


class LlamaCompletionRequest(_LlamaSampling):
    prompt: str | list[Int64]


class InputChunk(_Strict):
    filename: str | None = None
    text: str = ""


class InfillRequest(_LlamaSampling):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InputChunk] | None = None
    prompt: str = ""


_STOP_TYPES = {"stop": "eos", "length": "limit"}  # a stop string: "word" (with its "stopping_word")


class LlamaCppRoutes:
    """llama.cpp's ``/completion`` and ``/infill`` for ``server`` (an ``app.OpenAIServer``: its
    checks, jobs and log)."""

    def __init__(self, server) -> None:
        self.server = server

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/completion", self.complete, methods=["POST"])
        app.add_api_route("/completions", self.complete, methods=["POST"])
        app.add_api_route("/infill", self.infill, methods=["POST"])

    async def complete(self, request: HTTPRequest) -> Response:
        self.server._auth(request)
        body = parse_body(await request.body(), LlamaCompletionRequest)
        req = body.completion()
        self.server._check(req)
        [ids] = self.server._prompts(body.prompt)
        return await self._run(request, req, ids, "completion")

    async def infill(self, request: HTTPRequest) -> Response:
        server = self.server
        server._auth(request)
        body = parse_body(await request.body(), InfillRequest)
        req = body.completion()
        server._check(req)
        files = [(c.filename, c.text) for c in body.input_extra or []]
        try:
            ids, fim = encode_fim(server.tokenizer, body.input_prefix, body.input_suffix, files, body.prompt)
        except ConfigError as e:
            raise bad_request(str(e), "input_suffix") from None
        except (ValueError, TypeError, UnicodeError) as e:
            raise bad_request(f"the input could not be tokenized: {e}", "input_prefix") from None
        req.stop_token_ids = list(fim.stop_ids)
        return await self._run(request, req, ids, "infill")

    async def _run(self, request: HTTPRequest, req: CompletionRequest, ids: list[int], kind: str) -> Response:
        server = self.server
        budget = check_max_tokens(req.max_tokens, len(ids), server.engine.max_len, None, "n_predict")
        fmt = Format(new_id("cmpl"), kind, server.cfg.model_name, now(), chat=False)
        job = await server._start(req, [ids], [budget], structured_output(req))

        async def final(texts, reasons, _) -> dict[str, Any]:
            return self._final(texts[0], reasons[0], job)
        return await server._answer(request, job, fmt, bool(req.stream), self._events(job), final)

    async def _events(self, job: Job) -> AsyncIterator[str]:
        reason = None
        async for i, out in job.outputs():
            if out.error:
                yield _sse(APIError(500, f"the request failed: {out.error}", "server_error").body())
                return
            piece, _ = job.piece(i, out)
            reason = out.finish_reason or reason
            if piece:
                yield _sse({"content": piece, "stop": False})
        yield _sse(self._final("", reason, job))

    def _final(self, text: str, reason: str | None, job: Job) -> dict[str, Any]:
        usage = job.usage()
        stopped_by = job.stop_reason(0)
        word = stopped_by if isinstance(stopped_by, str) else ""
        return {"content": text, "stop": True, "stop_type": "word" if word else _STOP_TYPES.get(reason, "none"),
                "stopping_word": word, "model": self.server.cfg.model_name,
                "tokens_predicted": usage["completion_tokens"], "tokens_evaluated": usage["prompt_tokens"],
                "truncated": False, "timings": _timings(job, usage)}


def _timings(job: Job, usage: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's ``timings`` of a finished request: the prompt's time (arrival to first token, so a
    queue wait counts) over the tokens computed (those taken from the prefix cache: ``cache_n``), and
    the generation's (first token to now) over the tokens generated."""
    end, first = time.monotonic(), job.requests[0].first_token_time
    first = end if first is None else first
    cached = job.requests[0].seq.cached_tokens
    out: dict[str, Any] = {"cache_n": cached}
    for name, n, seconds in (("prompt", usage["prompt_tokens"] - cached, first - job.t0),
                             ("predicted", usage["completion_tokens"], end - first)):
        ms = 1000.0 * max(seconds, 0.0)
        out.update({f"{name}_n": n, f"{name}_ms": ms, f"{name}_per_token_ms": ms / n if n else 0.0,
                    f"{name}_per_second": 1000.0 * n / ms if n and ms > 0 else 0.0})
    return out


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
