"""``POST /v1/embeddings`` as OpenAI, vLLM and llama.cpp (``--embeddings``) serve it: one vector per
input text (or token id list), pooled from the model's final hidden states (``models/embed.py``),
L2-normalized (vLLM's ``normalize`` false: as pooled), as float lists or base64 (float32 little-endian,
or vLLM's ``embed_dtype`` / ``endianness``); and llama.cpp's own
``POST /embedding`` (``content``, ``embd_normalize``; with ``--pooling none`` a vector a token).
Served only when the server was started with ``--embeddings`` (``ServerConfig.embeddings``: the
pooling), as llama.cpp does; otherwise a 400 says so (as vLLM answers a model without the task; a 5xx
would make OpenAI's client retry). The vectors are computed on the scheduler's
thread, one prefill window per call (``Scheduler.call``), so decoding goes on between the windows of
a long input and between inputs."""
from __future__ import annotations

import asyncio
import base64
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
from fastapi import FastAPI, Request as HTTPRequest

from tokenleap.models.embed import embed_windows, normalize_embedding
from tokenleap.serve.context_window import truncate_prompt
from tokenleap.serve.protocol import APIError, Int64, _Strict, bad_request
from tokenleap.serve.body import parse_body
from tokenleap.serve.request import QueueFullError
from tokenleap.serve.responses import new_id, now


class EmbeddingRequest(_Strict):  # OpenAI's /v1/embeddings
    model: str | None = None
    input: str | list[str] | list[Int64] | list[list[Int64]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: Int64 | None = None  # vLLM's: each input's last N tokens (-1: the context's length)
    # vLLM's: unit length or the pooled vector as it is; base64's number type and byte order; a BOS or not
    normalize: bool | None = None
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    endianness: Literal["native", "little", "big"] = "native"
    add_special_tokens: bool | None = True


class LlamaEmbeddingRequest(_Strict):  # llama.cpp's /embedding: content (or input), embd_normalize
    model: str | None = None
    content: str | list[str] | list[Int64] | list[list[Int64]] | None = None
    input: str | list[str] | list[Int64] | list[list[Int64]] | None = None
    embd_normalize: int = 2


MAX_INPUTS = 2048  # OpenAI's limit on the texts of one request


class EmbeddingRoutes:
    """The routes above for ``server`` (an ``app.OpenAIServer``: its checks, encoding and scheduler)."""

    def __init__(self, server) -> None:
        self.server = server

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/embeddings", self.embeddings, methods=["POST"])
        app.add_api_route("/embedding", self.llamacpp_embedding, methods=["POST"])  # llama.cpp's (both names)
        app.add_api_route("/embeddings", self.llamacpp_embedding, methods=["POST"])

    async def embeddings(self, request: HTTPRequest) -> dict[str, Any]:
        server = self.server
        server._auth(request)
        pooling = self.pooled("input")
        req = parse_body(await request.body(), EmbeddingRequest)
        server._check_model(req.model)
        self.check_dimensions(req.dimensions)
        ids = await server.off_loop(lambda: self.token_lists(req.input, keep_last=req.truncate_prompt_tokens,
                                                             add_special_tokens=req.add_special_tokens is not False))
        vectors = await self.vectors(ids, pooling)
        data = [{"object": "embedding", "index": i,
                 "embedding": _encoded(v if req.normalize is False else normalize_embedding(v, 2), req)}
                for i, v in enumerate(vectors)]
        tokens = sum(len(x) for x in ids)
        return {"id": new_id("embd"), "object": "list", "created": now(), "model": server.cfg.model_name,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def llamacpp_embedding(self, request: HTTPRequest) -> list[dict[str, Any]]:
        """llama.cpp's own form: ``[{"index": i, "embedding": [[...]]}]`` -- one pooled vector in a
        list, or (``--pooling none``) one vector a token -- normalized as ``embd_normalize`` says."""
        server = self.server
        server._auth(request)
        pooling = self.pooling()
        req = parse_body(await request.body(), LlamaEmbeddingRequest)
        server._check_model(req.model)
        given = [v for v in (req.content, req.input) if v is not None]
        if len(given) != 1:
            raise bad_request("give the text to embed as content (or input)", "content")
        vectors = await self.vectors(await server.off_loop(lambda: self.token_lists(given[0])), pooling)
        return [{"index": i, "embedding": normalize_embedding(v.reshape(-1, v.shape[-1]), req.embd_normalize).tolist()}
                for i, v in enumerate(vectors)]

    def pooling(self) -> str:
        """The server's pooling (``--pooling``); a 400 when it serves no embeddings."""
        pooling = self.server.cfg.embeddings
        if pooling is None:
            raise APIError(400, "this server does not serve embeddings: start it with --embeddings",
                           "invalid_request_error", None, "embeddings_off")
        return pooling

    def pooled(self, param: str) -> str:
        """``pooling()``, refusing ``--pooling none``: the routes that answer one vector an input
        (``param``: the input's field, named in the 400)."""
        pooling = self.pooling()
        if pooling == "none":
            raise bad_request("this server pools no embeddings (--pooling none): per-token vectors are not "
                              "OpenAI-compatible; ask llama.cpp's POST /embedding for them", param)
        return pooling

    def check_dimensions(self, dimensions: int | None) -> None:
        """A request's ``dimensions``: the model's own, or none given (vectors are not shortened)."""
        hidden = self.server.engine.model.config.hidden_size
        if dimensions is not None and dimensions != hidden:
            raise bad_request(f"dimensions: this model's embeddings have {hidden} dimensions and cannot be "
                              "shortened", "dimensions")

    def token_lists(self, value, truncate: bool = False, keep_last: int | None = None,
                    add_special_tokens: bool = True) -> list[list[int]]:
        """The inputs' token ids (a text, token ids, or a list of either); one over the context is a 400,
        or with ``truncate`` cut to the context's length (its first tokens), or with ``keep_last``
        (vLLM's truncate_prompt_tokens) to its last tokens."""
        server = self.server
        texts = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else value
        if not texts or len(texts) > MAX_INPUTS:
            raise bad_request(f"input must hold 1 to {MAX_INPUTS} texts or token id lists", "input")
        ids = []
        for t in texts:
            if isinstance(t, str) and not t:
                raise bad_request("input must not contain empty strings", "input")
            ids.append(server.prompts.encode(t, add_special_tokens, "input"))
            if truncate:  # (Ollama's default: the input's first tokens, as many as the context holds)
                ids[-1] = ids[-1][:server.engine.max_len]
            ids[-1] = truncate_prompt(ids[-1], keep_last, server.engine.max_len)
            if len(ids[-1]) > server.engine.max_len:
                raise bad_request(f"this model's maximum context length is {server.engine.max_len} tokens; an input "
                                  f"has {len(ids[-1])}", "input")
        return ids

    async def vectors(self, ids: list[list[int]], pooling: str) -> list[torch.Tensor]:
        """Each token list's embedding, unnormalized: [hidden] (pooling none: [tokens, hidden])."""
        server = self.server
        vectors = []
        try:
            for x in ids:  # a prefill window per scheduler call: decoding goes on between them
                steps = embed_windows(server.engine.model, x, pooling, normalize=False,
                                      chunk=server.engine.prefill_chunk)
                vec = None
                while vec is None:
                    vec = await asyncio.wrap_future(server.scheduler.call(partial(next, steps)))
                vectors.append(vec)
        except QueueFullError as e:
            raise APIError(503, str(e), "server_busy", None, "shutting_down") from None
        return vectors


def _encoded(v: torch.Tensor, req: EmbeddingRequest) -> list[float] | str:
    """A vector as the request asks: a float list, or base64 of its ``embed_dtype`` numbers in the
    ``endianness`` asked (native is little-endian on the CPUs served)."""
    if req.encoding_format != "base64":
        return np.asarray(v, dtype=np.float32).tolist()
    order = ">" if req.endianness == "big" else "<"
    if req.embed_dtype == "bfloat16":  # (numpy has no bfloat16: its 16-bit patterns)
        raw = v.float().to(torch.bfloat16).view(torch.int16).numpy().astype(order + "i2")
    else:
        raw = v.float().numpy().astype(order + ("f2" if req.embed_dtype == "float16" else "f4"))
    return base64.b64encode(raw.tobytes()).decode()
