"""llama.cpp's own server API beside the OpenAI one, for clients written for llama.cpp's server:
``POST /completion`` (also ``/completions``): a prompt continued; and ``POST /infill``: code
completion at a cursor, as editor plugins (llama.vscode and others) call it (``input_prefix`` /
``input_suffix`` around the cursor, ``input_extra``: other files' chunks as context, ``prompt``: text
the middle starts with; the prompt is ``text/fim.py``'s). ``llamacpp_info.py`` serves the rest of
that API (``/props``, ``/apply-template``).

Both run through the same scheduler, sampling and speculation as ``/v1/completions``. A
``/completion`` prompt is a string, token ids, or a list mixing the two (one prompt); a list of
strings or of such lists is several prompts, answered with a list of results in order (streamed:
each event carries its prompt's ``index``). An ``/infill`` prompt that would not leave room for
``n_predict`` tokens is cut as llama.cpp cuts it (``text/fim.py``: the prefix's end, the suffix's
start, the other files' end). llama.cpp's sampling names and defaults are taken where a field is
absent (``n_predict`` -1 or -2: up to the context's end, 0: the prompt alone, a cache warm-up that
returns no tokens; ``temperature`` 0.8, ``top_k`` 40,
``top_p`` 0.95, ``min_p`` 0.05, applied in llama.cpp's default order -- top-k, top-p and min-p on the
model's distribution, the temperature last; ``seed`` -1: unseeded; ``repeat_penalty`` over the last
``repeat_last_n`` 64 tokens, -1: all, 0: off); ``logit_bias`` as
``[[token, bias], ...]`` (a token id or a string, whose tokens all get the bias; ``false``: banned) or
an object; ``json_schema`` or ``grammar`` (GBNF) constrain the reply as ``response_format`` /
``guided_grammar`` do; ``n_probs`` N > 0 adds ``completion_probabilities``: each generated token's
log-probability and the N most likely tokens, from the model's raw logits (llama.cpp's form without
``post_sampling_probs``, which is refused); ``return_tokens`` adds the generated ids; ``n_cmpl``
completions of each prompt (a list: each prompt's in turn; seeded, the first at seed and the others at
seeds hashed from (seed, j)). Its other options (``cache_prompt``: the prefix cache is always on, ``samplers``, ``t_max_prompt_ms`` ...)
are ignored; ``n_indent`` and ``t_max_predict_ms`` stop a code completion as llama.cpp's do
(``spec/sequence.py``); ``response_fields`` picks the final result's fields.

The reply has llama.cpp's shape: ``{"index", "content", "tokens", "stop": true, "stop_type" ("eos",
"word": a stop string, "limit"), "stopping_word", "tokens_predicted", "tokens_evaluated",
"tokens_cached", "timings", "model"}``; streamed, one ``data: {"index", "content", "tokens", "stop":
false}`` event a piece, then the final object.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import Response

from tokenleap.config import MAX_LOGPROBS, ConfigError
from tokenleap.serve.jobs import Job
from tokenleap.serve.context_window import check_each_max_tokens
from tokenleap.serve.protocol import (MAX_PROMPTS, CompletionRequest, Int64, _Strict, bad_request, failed,
                                      repeat_window, structured_output)
from tokenleap.serve.body import parse_body
from tokenleap.serve.request_checks import refuse_unserved
from tokenleap.serve.responses import Format, Scored, TokenText, new_id, now, token_logprob_entries
from tokenleap.text.fim import encode_fim, required_fim_tokens

_BiasKey = Int64 | str


class _LlamaSampling(_Strict):
    model: str | None = None
    n_predict: Int64 | None = None
    max_tokens: Int64 | None = None  # the OpenAI name llama.cpp also takes for n_predict
    temperature: float | None = None
    top_k: Int64 | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None  # (a string alone: a list of one)
    stream: bool | None = False
    ignore_eos: bool | None = False
    repeat_penalty: float | None = None
    repeat_last_n: Int64 | None = None  # the penalty's window: 64 by default, -1 the whole context, 0 off
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: list[list[_BiasKey | float | bool]] | dict[str, float | bool] | None = None
    n_probs: Int64 | None = None  # the N most likely tokens with each generated one
    post_sampling_probs: bool | None = None  # probabilities after the samplers: not served (refused)
    return_tokens: bool | None = False  # the generated ids in "tokens"
    n_cmpl: Int64 | None = None  # completions of each prompt (OpenAI's n)
    json_schema: dict[str, Any] | None = None  # the reply follows this JSON schema ...
    grammar: str | None = None  # ... or this grammar (GBNF, as llama.cpp takes it, or Lark)
    n_indent: Int64 | None = None  # a new line indented less ends the reply (code completion)
    response_fields: list[str] | None = None  # the final object's fields kept, "a/b" unnested under that name
    t_max_predict_ms: float | None = None  # past this from the first token, a new line ends the reply
    # llama.cpp's other samplers: not served, so refused unless at their neutral value (_UNSERVED_SAMPLERS)
    typical_p: float | None = None
    mirostat: Int64 | None = None
    dry_multiplier: float | None = None
    xtc_probability: float | None = None
    dynatemp_range: float | None = None
    top_n_sigma: float | None = None

    def model_post_init(self, context: Any) -> None:
        if self.n_predict is None:  # (n_predict wins where both are given, as in llama.cpp)
            self.n_predict = self.max_tokens

    def completion(self, server) -> CompletionRequest:
        """The same request in ``/v1/completions`` terms (llama.cpp's defaults filled in; a text key
        of ``logit_bias`` tokenized by ``server``, an ``app.OpenAIServer``, with no special tokens)."""
        def given(value, default):
            return default if value is None else value
        if self.post_sampling_probs:
            raise bad_request("post_sampling_probs is not supported: n_probs gives the model's own "
                              "probabilities (its raw logits)", "post_sampling_probs")
        refuse_unserved(self, _UNSERVED_SAMPLERS)
        if self.n_probs is not None and not 0 <= self.n_probs <= MAX_LOGPROBS:
            raise bad_request(f"n_probs must be in [0, {MAX_LOGPROBS}], got {self.n_probs}", "n_probs")
        # llama.cpp's readings: a temperature <= 0 is greedy (< 0 documented as greedy with n_probs), top_k
        # <= 0 and min_p <= 0 are off, top_p <= 0 keeps the most likely token alone
        top_k, top_p = given(self.top_k, 40), given(self.top_p, 0.95)
        if top_p <= 0:
            top_k, top_p = 1, 1.0
        return CompletionRequest.model_construct(**{
            **{name: field.default for name, field in CompletionRequest.model_fields.items()},
            "model": self.model, "prompt": "", "temperature": max(given(self.temperature, 0.8), 0.0),
            "top_k": max(top_k, 0), "top_p": top_p, "min_p": max(given(self.min_p, 0.05), 0.0),
            "seed": None if self.seed in (None, -1) else self.seed, "stop": self.stop, "stream": bool(self.stream),
            "ignore_eos": bool(self.ignore_eos),
            **repeat_window(self.repeat_penalty, given(self.repeat_last_n, 64), "repeat_last_n"),
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            # n_predict < 0: up to the context's end (-1 and -2 alike); 0: the prompt alone (a cache warm-up,
            # as editor plugins send it: its first token is computed, none returned)
            "max_tokens": None if self.n_predict is None or self.n_predict < 0 else max(self.n_predict, 1),
            "n": given(self.n_cmpl, 1),
            "logit_bias": _bias(self.logit_bias, lambda text: server.prompts.encode(text, False, "logit_bias")) or None,
            "logprobs": self.n_probs or None, "guided_json": self.json_schema or None,
            "guided_grammar": self.grammar or None,  # llama.cpp's defaults {} and "": none
            "n_indent": self.n_indent, "t_max_predict_ms": self.t_max_predict_ms,
            "temperature_last": True})  # llama.cpp's default chain: top-k, top-p, min-p, then temperature


# llama.cpp's samplers this server does not run: a value away from llama.cpp's neutral one asks for them
_NOT_RUN = ("not supported by this server (its samplers: temperature, top_k, top_p, min_p and the penalties); "
            "leave it out or at its neutral value")
_UNSERVED_SAMPLERS = {"typical_p": (lambda v: v < 1.0, _NOT_RUN), "mirostat": (lambda v: v != 0, _NOT_RUN),
                      "dry_multiplier": (lambda v: v != 0, _NOT_RUN), "xtc_probability": (lambda v: v > 0, _NOT_RUN),
                      "dynatemp_range": (lambda v: v > 0, _NOT_RUN), "top_n_sigma": (lambda v: v >= 0, _NOT_RUN)}


def _bias(given, encode) -> dict[str, float]:
    """llama.cpp's ``logit_bias`` as OpenAI's {token id: bias}. Pairs ``[key, value]`` or an object;
    a key is a token id (an integer; in the object, a string of digits) or else text, every token of
    which gets the bias (``encode``: text -> ids, no special tokens added); a value is a bias or
    ``false`` (banned: -100)."""
    pairs = list(given.items()) if isinstance(given, dict) else given or []
    out: dict[str, float] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise bad_request("logit_bias entries must be [token id or text, bias or false]", "logit_bias")
        key, value = pair
        if value is True or not isinstance(value, (int, float)):
            raise bad_request(f"a logit_bias value must be a number or false, got {value!r}", "logit_bias")
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise bad_request(f"a logit_bias key must be a token id or text, got {key!r}", "logit_bias")
        if isinstance(key, int) or (isinstance(given, dict) and key.isdigit()):
            ids = [int(key)]
        else:
            ids = encode(key)
        out.update({str(t): -100.0 if value is False else float(value) for t in ids})
    return out


class LlamaCompletionRequest(_LlamaSampling):
    prompt: str | list[Int64 | str | list[Int64 | str]]


class InputChunk(_Strict):
    filename: str | None = None
    text: str  # (required, as llama.cpp checks each chunk for it)


class InfillRequest(_LlamaSampling):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InputChunk] | None = None
    prompt: str = ""


_STOP_TYPES = {"stop": "eos", "length": "limit"}  # a stop string: "word" (with its "stopping_word")


PATHS = ("/completion", "/completions", "/infill")  # llama.cpp's own routes (its error form answers there)


class LlamaCppRoutes:
    """llama.cpp's ``/completion`` and ``/infill`` for ``server`` (an ``app.OpenAIServer``: its
    checks, jobs and log)."""

    def __init__(self, server) -> None:
        self.server = server

    def add_to(self, app: FastAPI) -> None:
        for path in PATHS:
            app.add_api_route(path, self.infill if path == "/infill" else self.complete, methods=["POST"])

    async def complete(self, request: HTTPRequest) -> Response:
        server = self.server
        server._auth(request)
        body = parse_body(await request.body(), LlamaCompletionRequest)
        req = body.completion(server)
        server._check(req)
        prompts = await server.off_loop(lambda: [_join(p, server) for p in _prompts(body.prompt)])
        # (one result is an object, several an array: llama.cpp's rule, a one-prompt list included)
        return await self._run(request, body, req, prompts, "completion", multi=len(prompts) > 1 or req.n > 1)

    async def infill(self, request: HTTPRequest) -> Response:
        server = self.server
        server._auth(request)
        body = parse_body(await request.body(), InfillRequest)
        req = body.completion(server)
        server._check(req)
        files = [(c.filename, c.text) for c in body.input_extra or []]
        try:
            required_fim_tokens(server.tokenizer)
        except ConfigError as e:
            raise bad_request(str(e), "input_suffix") from None
        limit = -1 if body.n_predict is None or body.n_predict < 0 else body.n_predict

        def encode():
            try:
                ids, fim = encode_fim(server.tokenizer, body.input_prefix, body.input_suffix, files, body.prompt)
                cut = len(ids) + max(limit, 0) > server.engine.max_len  # cut as llama.cpp cuts it
                if cut:
                    ids, fim = encode_fim(server.tokenizer, body.input_prefix, body.input_suffix, files, body.prompt,
                                          fit=(server.engine.max_len, limit))
            except (ValueError, TypeError, UnicodeError) as e:
                raise bad_request(f"the input could not be tokenized: {e}", "input_prefix") from None
            return ids, fim, cut
        ids, fim, cut = await server.off_loop(encode)
        req.stop_token_ids = list(fim.stop_ids)
        return await self._run(request, body, req, [ids], "infill", multi=req.n > 1, truncated=cut)

    async def _run(self, request: HTTPRequest, body: _LlamaSampling, req: CompletionRequest,
                   prompts: list[list[int]], kind: str, multi: bool, truncated: bool = False) -> Response:
        server = self.server
        # n_predict past the context's end stops there (llama.cpp's "limit"), as a default would
        budgets = check_each_max_tokens(None, prompts, server.engine.max_len, req.max_tokens, "n_predict")
        fmt = Format(new_id("cmpl"), kind, server.cfg.model_name, now(), chat=False)
        job = await server._start(req, prompts, budgets, structured_output(req), req.logprobs)
        shape = _Shape(job, server.cfg.model_name, TokenText(server.tokenizer) if req.logprobs else None,
                       bool(body.return_tokens), prompt_only=body.n_predict == 0, fields=body.response_fields,
                       truncated=truncated)

        async def final(texts, reasons, scored) -> Any:
            results = [shape.final(i, texts[i], reasons[i], scored[i]) for i in range(len(texts))]
            return results if multi else results[0]
        return await server._answer(request, job, fmt, bool(req.stream), shape.events(), final)


def picked(result: dict[str, Any], fields: list[str] | None) -> dict[str, Any]:
    """llama.cpp's ``response_fields``: only these fields of a final result, a nested one (``"timings/
    prompt_n"``) at the top under its path; a field that is not there is left out."""
    if not fields:
        return result
    out: dict[str, Any] = {}
    for path in fields:
        value: Any = result
        for key in path.split("/"):
            value = value.get(key, _MISSING) if isinstance(value, dict) else _MISSING
        if value is not _MISSING:
            out[path] = value
    return out


_MISSING = object()


def _is_multi(prompt) -> bool:
    """Several prompts: a list of strings, or a list holding lists (llama.cpp's rule)."""
    return isinstance(prompt, list) and bool(prompt) and (
        all(isinstance(p, str) for p in prompt) or any(isinstance(p, list) for p in prompt))


def _prompts(prompt) -> list:
    """The request's prompts, each a string or a list mixing token ids and strings."""
    if not _is_multi(prompt):
        return [prompt]
    if not all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("a list of prompts holds strings or lists of token ids and strings, not bare ids",
                          "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    return prompt


def _join(prompt, server) -> list[int]:
    """One prompt's ids: a string encoded as ``/v1/completions`` does (a BOS where the model adds
    one); a list's strings encoded in place between its ids, a BOS only before a leading string (as
    llama.cpp does)."""
    if isinstance(prompt, str) or not prompt:
        return server.prompts.many(prompt)[0]  # (an empty prompt: refused there)
    ids: list[int] = []
    for j, part in enumerate(prompt):
        if isinstance(part, str):
            ids += server.prompts.encode(part, add_special_tokens=j == 0)
        else:
            ids.append(part)
    return server.prompts.encode(ids)  # (checks the ids against the vocabulary)


class _Shape:
    """One job's replies in llama.cpp's shapes: stream events and final objects, per prompt."""

    def __init__(self, job: Job, model: str, tokens: TokenText | None, return_tokens: bool,
                 prompt_only: bool = False, fields: list[str] | None = None, truncated: bool = False) -> None:
        self.job, self.model, self.tokens, self.return_tokens = job, model, tokens, return_tokens
        self.fields = fields  # response_fields: the final result's fields kept
        self.truncated = truncated  # the prompt was cut to fit the context
        self.prompt_only = prompt_only  # n_predict 0: the reply's one computed token is not returned

    async def events(self) -> AsyncIterator[str]:
        reasons: dict[int, str | None] = {}
        async for i, out in self.job.outputs():
            if out.error:
                yield _sse(failed(out.error, out.error_status).llamacpp_body())
                return
            piece, scored = self.job.piece(i, out)
            reasons[i] = out.finish_reason or reasons.get(i)
            if (piece or out.token_ids) and not self.prompt_only:
                event: dict[str, Any] = {"index": i, "content": piece, "tokens": list(out.token_ids), "stop": False}
                if self.tokens is not None:
                    event["completion_probabilities"] = token_logprob_entries(scored, self.tokens, ids=True)
                yield _sse(event)
            if out.finish_reason is not None:
                yield _sse(self.final(i, "", out.finish_reason, [], whole=False))

    def final(self, i: int, text: str, reason: str | None, scored: list[Scored], whole: bool = True) -> dict[str, Any]:
        """Prompt ``i``'s final object: the whole reply, or (``whole`` false) a stream's last event."""
        job = self.job
        stopped_by = job.stop_reason(i)
        word = stopped_by if isinstance(stopped_by, str) and not self.prompt_only else ""
        seq = job.requests[i].seq
        if self.prompt_only:
            text, reason, scored = "", "length", []
        returned = list(seq.generated) if self.return_tokens and whole and not self.prompt_only else []
        out = {"index": i, "content": text, "tokens": returned,
               "stop": True, "stop_type": "word" if word else _STOP_TYPES.get(reason, "none"),
               "stopping_word": word, "model": self.model,
               "tokens_predicted": 0 if self.prompt_only else job.generated[i],
               "tokens_evaluated": len(seq.prompt), "tokens_cached": seq.cached_tokens, "truncated": self.truncated,
               "timings": _timings(job, i, 0 if self.prompt_only else job.generated[i])}
        if self.tokens is not None and whole:
            out["completion_probabilities"] = token_logprob_entries(scored, self.tokens, ids=True)
        return picked(out, self.fields)



def _timings(job: Job, i: int, predicted: int) -> dict[str, Any]:
    """llama.cpp's ``timings`` of prompt ``i``'s finished reply: the prompt's time (arrival to first
    token, so a queue wait counts) over the tokens computed (those taken from the prefix cache:
    ``cache_n``), and the generation's (first token to now) over the tokens generated."""
    request = job.requests[i]
    end, first = time.monotonic(), request.first_token_time
    first = end if first is None else first
    cached = request.seq.cached_tokens
    out: dict[str, Any] = {"cache_n": cached}
    for name, n, seconds in (("prompt", len(request.seq.prompt) - cached, first - job.t0),
                             ("predicted", predicted, end - first)):
        ms = 1000.0 * max(seconds, 0.0)
        out.update({f"{name}_n": n, f"{name}_ms": ms, f"{name}_per_token_ms": ms / n if n else 0.0,
                    f"{name}_per_second": 1000.0 * n / ms if n and ms > 0 else 0.0})
    return out


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
