"""Text <-> token ids over HTTP, as vLLM and llama.cpp serve them, and vLLM's small probes:

- ``POST /tokenize``: a prompt's (or a conversation's, as chat renders it) token ids. vLLM's form
  (``prompt`` or ``messages``; ``add_special_tokens``, default true) and llama.cpp's (``content``;
  ``add_special``, default false; ``with_pieces``: each token's text beside its id);
- ``POST /detokenize``: token ids to text (``prompt``, vLLM's name, and ``content``, llama.cpp's);
- ``GET /tokenizer_info``: the tokenizer's settings (special tokens, chat template, context length),
  as vLLM serves them -- enough for a client such as lm-evaluation-harness to tokenize through the
  server with no tokenizer files of its own;
- ``GET /version`` (tokenleap's version) and ``GET /ping`` (200 while the scheduler runs), as vLLM
  answers them.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import Response

from tokenleap import __version__
from tokenleap.serve.chat_render import chat_messages, chat_options
from tokenleap.serve.protocol import ChatMessage, ChatRequest, Int64, ToolDef, _Strict, bad_request
from tokenleap.serve.request_checks import check_token_ids
from tokenleap.serve.body import parse_body


class TokenizeRequest(_Strict):  # vLLM's /tokenize: a prompt or chat messages; llama.cpp's: content
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    content: str | None = None  # llama.cpp's name for the prompt
    with_pieces: bool = False  # llama.cpp's: each token as {"id", "piece"}
    parse_special: bool = True  # llama.cpp's: false reads special tokens' spellings as plain text
    # a BOS (or other special tokens the model adds) before the text: vLLM's name (default true) or
    # llama.cpp's (default false, as is its default for a "content" request)
    add_special_tokens: bool | None = None
    add_special: bool | None = None
    # vLLM's for messages: rendered as the chat endpoint renders them (chat_render.chat_options, tools)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None
    return_token_strs: bool | None = False  # vLLM's: each token's vocabulary string too ("token_strs")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Int64]


class TokenRoutes:
    """The routes above for ``server`` (an ``app.OpenAIServer``: its checks and encoding)."""

    def __init__(self, server) -> None:
        self.server = server

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_api_route("/tokenizer_info", self.tokenizer_info, methods=["GET"])
        app.add_api_route("/version", self.version, methods=["GET"])
        app.add_api_route("/ping", self.ping, methods=["GET", "POST"])

    async def tokenize(self, request: HTTPRequest) -> dict[str, Any]:
        """The model's special tokens (a BOS) are added as each API does by default: for a
        ``prompt``, not for a ``content``, unless ``add_special_tokens`` or ``add_special`` says."""
        server = self.server
        server._auth(request)
        req = parse_body(await request.body(), TokenizeRequest)
        server._check_model(req.model)
        return await server.off_loop(lambda: self._tokenize(req))

    def _tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        server = self.server
        given = [v for v in (req.prompt, req.content, req.messages) if v is not None]
        if len(given) != 1:
            raise bad_request("give exactly one of prompt (or content) or messages")
        text = req.prompt if req.prompt is not None else req.content
        flags = {f for f in (req.add_special_tokens, req.add_special) if f is not None}
        if len(flags) > 1:
            raise bad_request("add_special_tokens and add_special disagree", "add_special")
        special = flags.pop() if flags else req.content is None
        if text is None:
            chat = ChatRequest.model_construct(
                messages=req.messages, add_generation_prompt=req.add_generation_prompt, tools=req.tools,
                continue_final_message=req.continue_final_message, chat_template_kwargs=req.chat_template_kwargs)
            ids = server.prompts.encode_chat(chat_messages(chat), server._plan_tools(chat), chat_options(chat))
        else:
            ids = server.prompts.encode(text, special, parse_special=req.parse_special)
        tokens: list[Any] = [{"id": t, "piece": _piece(server.tokenizer, t)} for t in ids] if req.with_pieces else ids
        out = {"count": len(ids), "max_model_len": server.engine.max_len, "tokens": tokens}
        if req.return_token_strs:
            out["token_strs"] = [server.tokenizer.id_to_token(t) for t in ids]
        return out

    async def detokenize(self, request: HTTPRequest) -> dict[str, Any]:
        server = self.server
        server._auth(request)
        req = parse_body(await request.body(), DetokenizeRequest)
        server._check_model(req.model)
        check_token_ids(req.tokens, server.engine.model.config.vocab_size, "tokens")
        # (special tokens spelled, as both do)
        text = await server.off_loop(lambda: server.tokenizer.decode(req.tokens, skip_special_tokens=False))
        return {"prompt": text, "content": text}  # (vLLM's name, llama.cpp's)

    async def tokenizer_info(self, request: HTTPRequest) -> dict[str, Any]:
        server = self.server
        server._auth(request)
        tok = server.tokenizer
        info: dict[str, Any] = dict(getattr(tok, "config", {}))
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        for name in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template"):
            info[name] = getattr(tok, name, None)  # special tokens by their text (not {"content": ...})
        info["add_bos_token"] = bool(getattr(tok, "add_bos_token", False))
        info["model_max_length"] = server.engine.max_len
        return info

    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    async def ping(self) -> Response:
        return await self.server.health()


def _piece(tokenizer, token_id: int) -> str | list[int]:
    """llama.cpp's ``with_pieces`` piece: the token's text (a special token spelled out), or its byte
    values where it holds part of a UTF-8 character."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8") if raw else tokenizer.decode([token_id], skip_special_tokens=False)
    except UnicodeDecodeError:
        return list(raw)
