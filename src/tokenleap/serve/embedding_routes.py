"""``POST /v1/embeddings`` as OpenAI, vLLM and llama.cpp (``--embeddings``) serve it: one vector per
input text (or token id list), pooled from the model's final hidden states (``models/embed.py``),
as float lists or base64 of little-endian float32. Served only when the server was started with
``--embeddings`` (``ServerConfig.embeddings``: the pooling), as llama.cpp does; otherwise a 501 says
so. The vectors are computed on the scheduler's thread, one prefill window per call
(``Scheduler.call``), so decoding goes on between the windows of a long input and between inputs."""
from __future__ import annotations

import asyncio
import base64
from functools import partial
from typing import Any

import numpy as np
from fastapi import FastAPI, Request as HTTPRequest

from tokenleap.models.embed import embed_windows
from tokenleap.serve.protocol import APIError, EmbeddingRequest, bad_request, parse_body
from tokenleap.serve.request import QueueFullError
from tokenleap.serve.responses import new_id, now

MAX_INPUTS = 2048  # OpenAI's limit on the texts of one request


class EmbeddingRoutes:
    """The route above for ``server`` (an ``app.OpenAIServer``: its checks, encoding and scheduler)."""

    def __init__(self, server) -> None:
        self.server = server

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/embeddings", self.embeddings, methods=["POST"])

    async def embeddings(self, request: HTTPRequest) -> dict[str, Any]:
        server = self.server
        server._auth(request)
        pooling = server.cfg.embeddings
        if pooling is None:
            raise APIError(501, "this server does not serve embeddings: start it with --embeddings",
                           "not_implemented_error", None, "embeddings_off")
        req = parse_body(await request.body(), EmbeddingRequest)
        server._check_model(req.model)
        model = server.engine.model
        if req.dimensions is not None and req.dimensions != model.config.hidden_size:
            raise bad_request(f"dimensions: this model's embeddings have {model.config.hidden_size} dimensions "
                              "and cannot be shortened", "dimensions")
        texts = [req.input] if isinstance(req.input, str) or (req.input and isinstance(req.input[0], int)) \
            else req.input
        if not texts or len(texts) > MAX_INPUTS:
            raise bad_request(f"input must hold 1 to {MAX_INPUTS} texts or token id lists", "input")
        ids = []
        for t in texts:
            if isinstance(t, str) and not t:
                raise bad_request("input must not contain empty strings", "input")
            ids.append(server._encode(t, True, "input"))
            if len(ids[-1]) > server.engine.max_len:
                raise bad_request(f"this model's maximum context length is {server.engine.max_len} tokens; an input "
                                  f"has {len(ids[-1])}", "input")
        vectors = []
        try:
            for x in ids:  # a prefill window per scheduler call: decoding goes on between them
                steps = embed_windows(model, x, pooling, chunk=server.engine.prefill_chunk)
                vec = None
                while vec is None:
                    vec = await asyncio.wrap_future(server.scheduler.call(partial(next, steps)))
                vectors.append(vec)
        except QueueFullError as e:
            raise APIError(503, str(e), "server_busy", None, "shutting_down") from None
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        tokens = sum(len(x) for x in ids)
        return {"id": new_id("embd"), "object": "list", "created": now(), "model": server.cfg.model_name,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(v, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(v.numpy().astype("<f4").tobytes()).decode()
    return np.asarray(v, dtype=np.float32).tolist()
