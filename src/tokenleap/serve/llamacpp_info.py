"""The rest of llama.cpp's server API that its clients read (its web UI, editor plugins, scripts):

- ``GET /props``: the server's properties -- the context length (``n_ctx``), the default sampling
  settings of ``/completion`` (llama.cpp's, which ``llamacpp.py`` applies), the slots (sequences
  served at once), the chat template, BOS / EOS tokens, and whether speculation is on;
- ``POST /apply-template``: chat messages (with ``tools`` and ``chat_template_kwargs``, as
  ``/v1/chat/completions`` takes them) rendered into the prompt text the model would be given,
  returned as ``{"prompt"}`` for the client to edit and send to ``/completion``;
- ``GET /slots``: one entry per slot (``total_slots`` of them): whether it is processing, and for a
  running request its limit, sampling settings and tokens decoded so far (``?fail_on_no_slot=1``: a
  503 when every slot is busy);
- ``GET /v1/health``, the same as ``/health``.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from tokenleap import __version__
from tokenleap.serve.chat_render import chat_messages, chat_options
from tokenleap.serve.protocol import APIError, ChatRequest
from tokenleap.serve.body import parse_body

# /completion's defaults where a request leaves a field out (llama.cpp's; llamacpp.py applies them)
DEFAULT_PARAMS: dict[str, Any] = {
    "n_predict": -1, "seed": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
    "repeat_penalty": 1.0, "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0, "stop": [], "max_tokens": -1,
    "ignore_eos": False, "stream": False, "n_probs": 0, "grammar": ""}


class LlamaCppInfoRoutes:
    """``/props``, ``/apply-template``, ``/slots`` and ``/v1/health`` for ``server`` (an ``app.OpenAIServer``)."""

    def __init__(self, server) -> None:
        self.server = server

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/props", self.props, methods=["GET"])
        app.add_api_route("/apply-template", self.apply_template, methods=["POST"])
        app.add_api_route("/slots", self.slots, methods=["GET"])
        app.add_api_route("/v1/health", self.server.health, methods=["GET"])

    async def props(self, request: HTTPRequest) -> dict[str, Any]:
        server = self.server
        server._auth(request)
        tok, cfg = server.tokenizer, server.cfg
        settings = {"id": 0, "id_task": -1, "n_ctx": server.engine.max_len,
                    "speculative": server.engine.proposer is not None, "is_processing": False,
                    "params": dict(DEFAULT_PARAMS), "prompt": ""}
        return {"default_generation_settings": settings, "total_slots": server.scheduler.max_seqs,
                "model_alias": cfg.model_name, "model_path": (cfg.model_aliases or (cfg.model_name,))[0],
                "chat_template": getattr(tok, "chat_template", None) or "",
                "bos_token": getattr(tok, "bos_token", None) or "", "eos_token": getattr(tok, "eos_token", None) or "",
                "modalities": {"vision": False, "audio": False}, "build_info": f"tokenleap {__version__}",
                "speculative_method": server.proposer_name, "is_sleeping": False}

    async def slots(self, request: HTTPRequest) -> Response:
        server = self.server
        server._auth(request)
        sched, n_ctx, speculative = server.scheduler, server.engine.max_len, server.engine.proposer is not None
        running = list(sched.running)  # (a copy: the scheduler thread changes the list)
        if request.query_params.get("fail_on_no_slot") in ("1", "true") and len(running) >= sched.max_seqs:
            raise APIError(503, "no slot is free", "unavailable_error")
        out = []
        for i in range(sched.max_seqs):
            entry: dict[str, Any] = {"id": i, "id_task": -1, "n_ctx": n_ctx, "speculative": speculative,
                                     "is_processing": i < len(running)}
            if i < len(running):
                seq = running[i].seq
                p = seq.params
                entry["id_task"] = seq.seq_id
                entry["params"] = {"n_predict": p.max_tokens, "temperature": p.temperature, "top_k": p.top_k,
                                   "top_p": p.top_p, "min_p": p.min_p, "seed": -1 if p.seed is None else p.seed,
                                   "stop": list(p.stop), "ignore_eos": p.ignore_eos}
                decoded = seq.num_generated
                entry["next_token"] = {"has_next_token": not seq.finished, "n_decoded": decoded,
                                       "n_remain": p.max_tokens - decoded}
            out.append(entry)
        return JSONResponse(out)

    async def apply_template(self, request: HTTPRequest) -> dict[str, str]:
        server = self.server
        server._auth(request)
        req = parse_body(await request.body(), ChatRequest)
        server._check_model(req.model)
        tools = server._plan_tools(req)
        return {"prompt": await server.off_loop(
            lambda: server.prompts.render_chat(chat_messages(req), tools, chat_options(req)))}

