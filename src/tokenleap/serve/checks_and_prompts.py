"""The checks every API's routes make of a request (API key, model name, sampling fields, tools)
and the prompt work they share (predictions, reasoning, token texts), done off the event loop where
it tokenizes (``off_loop``): the base of ``app.OpenAIServer``, whose routes and the other APIs' route
classes (``server._check`` ...) call them."""
from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi import Request as HTTPRequest

from tokenleap.serve.prompts import Prompts
from tokenleap.serve.protocol import APIError, ChatRequest, bad_request, structured_output
from tokenleap.serve.reasoning import Reasoning, opened_by, template_thinks
from tokenleap.serve.request_checks import check_common, check_logit_bias, check_token_ids
from tokenleap.serve.responses import TokenText
from tokenleap.serve.tools import ToolPlan, plan_tools

T = TypeVar("T")
PROMPT_THREADS = 4  # requests tokenized at once, off the event loop (each holds its prompt's text and ids)


class ChecksAndPrompts:
    """Needs ``cfg`` (a ``ServerConfig``), ``engine`` and ``tokenizer``; call ``__init__`` for the rest."""

    def __init__(self) -> None:
        self._tokens: TokenText | None = None  # token texts for logprobs, cached across requests
        self.prompts = Prompts(self.tokenizer, self.engine.model.config.vocab_size)  # requests' prompts -> ids
        # requests' prompt work (tokenizing, the chat template, echo text) runs on threads of its own, so a
        # long prompt holds up neither the event loop that streams the other replies and answers /health
        # nor a short prompt sent after it (up to PROMPT_THREADS long ones at once)
        self._prompt_threads: ThreadPoolExecutor | None = None  # (made at the first request)

    async def off_loop(self, work: Callable[[], T]) -> T:
        """``work()`` -- a request's tokenization and the checks that need its ids -- on a prompt
        thread; what it raises (a 400) raises here."""
        if self._prompt_threads is None:
            self._prompt_threads = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="tokenleap-prompts")
        return await asyncio.get_running_loop().run_in_executor(self._prompt_threads, work)

    def stop_prompt_threads(self) -> None:
        """Let the prompt threads go (the app's lifespan ends); a later request makes new ones."""
        threads, self._prompt_threads = self._prompt_threads, None
        if threads is not None:
            threads.shutdown(wait=False, cancel_futures=True)

    def _auth(self, request: HTTPRequest) -> None:
        key = self.cfg.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>' "
                                "(or 'x-api-key: <key>')", "authentication_error", None, "invalid_api_key")

    def _check(self, req) -> None:
        self._check_model(req.model)
        check_common(req)
        check_logit_bias(req.logit_bias, self.engine.model.config.vocab_size)
        for name in ("stop_token_ids", "allowed_token_ids"):
            check_token_ids(getattr(req, name), self.engine.model.config.vocab_size, name)
        stops = {*(() if req.ignore_eos else self.engine.eos_ids), *(req.stop_token_ids or ())}
        if req.min_tokens and req.allowed_token_ids and set(req.allowed_token_ids) <= stops:
            raise bad_request("allowed_token_ids holds only tokens that end the reply, which min_tokens forbids "
                              "before its count", "allowed_token_ids")

    def _plan_tools(self, req: ChatRequest) -> ToolPlan:
        tools = plan_tools(req, getattr(self.tokenizer, "chat_template", None))
        if tools.prefix:  # a forced call's grammar takes this reply: the format is still checked
            structured_output(req)
        return tools

    def _prediction(self, req: ChatRequest) -> tuple[int, ...]:
        """OpenAI's ``prediction`` (its text's token ids): the lookup drafters propose from it too."""
        if req.prediction is None:
            return ()
        content = req.prediction.content
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        return tuple(self.prompts.encode(text, False, "prediction")) if text else ()

    def _reasoning(self, req: ChatRequest, prompt: list[int]) -> Reasoning | None:
        """How the replies' thinking is split from their content: where the chat template writes
        thinking blocks, unless the server or the request (llama.cpp's reasoning_format) says none."""
        if not self.cfg.reasoning or req.reasoning_format == "none":
            return None
        if not template_thinks(getattr(self.tokenizer, "chat_template", None)):
            return None
        return Reasoning(opened_by(self._token_text(True).joined(prompt[-8:])), req.include_reasoning is not False)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name.removesuffix(":latest") not in (self.cfg.model_name, *self.cfg.model_aliases):
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{self.cfg.model_name}'", "invalid_request_error", "model", "model_not_found")

    def _token_text(self, wanted: bool, as_ids: bool | None = False) -> TokenText | None:
        """The tokens' texts for logprobs (``as_ids``: vLLM's return_tokens_as_token_ids), if ``wanted``."""
        if not wanted:
            return None
        if self._tokens is None:
            self._tokens = TokenText(self.tokenizer)
        return self._tokens.with_ids() if as_ids else self._tokens
