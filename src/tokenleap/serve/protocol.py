"""OpenAI-compatible request bodies (pydantic, strict types) and their translation to
``SamplingParams``; errors are ``APIError`` carrying the OpenAI error object.

Value checks are ``SamplingParams``'s own (one message per bad value for every entry point); this
module only adds what is HTTP-specific: types, ``n``, the context length. The response objects
are in ``responses``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, field_validator

from tokenleap.config import ConfigError, SamplingParams, StructuredOutput
from tokenleap.spec.seeded import choice_seed

MAX_N = 16  # choices per request
MAX_PROMPTS = 16  # prompts in one completions request
MAX_STOP = 16
MAX_TEMPERATURE = 100.0  # far past any useful value (the distribution is flat long before): refuse as absurd
def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# every integer field is a signed 64-bit value, as the sampler's tensors hold it: a larger one is a 400
# naming the field (pydantic's message, with the field's path), never an overflow deeper down; a float
# with no fraction (5.0, as Python clients may send) is taken as that integer, as vLLM takes it
Int64 = Annotated[int, BeforeValidator(_integral), Field(ge=-2**63, le=2**63 - 1)]
_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def llamacpp_body(self) -> dict[str, Any]:
        """llama.cpp's server's form: ``code`` the HTTP status, a prompt over the context its own type."""
        kind = "exceed_context_size_error" if self.code == "context_length_exceeded" else self.type
        return {"error": {"code": self.status, "message": self.message, "type": kind}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def failed(error: str, status: int = 500) -> APIError:
    """The error of a request that failed while it ran (``Output.error`` and ``error_status``)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return APIError(status, f"the request failed: {error}", kind)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, the usage so far in every chunk


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: one constraint. Its switches for the grammar backend
    (``disable_any_whitespace`` and the like) are vLLM's engine's, not read here; a structural tag is
    refused (``structured_output``)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # (pydantic's own json)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None


class _Sampling(_Strict):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    n: Int64 | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    min_tokens: Int64 | None = None  # vLLM's
    truncate_prompt_tokens: Int64 | None = None  # vLLM's: the prompt's last N tokens only (-1: the context's length)
    stop_token_ids: list[Int64] | None = None  # vLLM's
    include_stop_str_in_output: bool | None = False  # vLLM's
    skip_special_tokens: bool | None = True  # vLLM's: false writes special tokens into the text
    return_tokens_as_token_ids: bool | None = False  # vLLM's: logprobs name tokens "token_id:ID"
    return_token_ids: bool | None = False  # vLLM's: the reply's and the prompt's token ids in the response
    allowed_token_ids: list[Int64] | None = None  # vLLM's
    bad_words: list[str] | None = None  # vLLM's
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    repetition_last_n: Int64 | None = None  # llama.cpp's repeat_last_n: the penalty's window (0 / absent: all)
    logit_bias: dict[str, float] | None = None
    min_p_after_top_p: bool | None = None  # Hugging Face's and Ollama's filter order (Ollama's routes set it)
    user: str | None = None
    # what this server cannot do, refused when asked for (request_checks.check_common), not ignored
    use_beam_search: bool | None = None
    priority: Int64 | None = None
    cache_salt: str | None = None
    logits_processors: list[Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # structured output: OpenAI's response_format, or vLLM's structured_outputs (its guided_* fields before)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("n", mode="before")
    @classmethod
    def _n_default(cls, value: Any) -> Any:
        return 1 if value is None else value  # null: the default, as OpenAI's schema has it


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int64] | list[list[Int64]]
    max_tokens: Int64 | None = None  # OpenAI's default is 16
    logprobs: Int64 | None = None
    echo: bool | None = False  # the prompt starts the text (with max_tokens 0: nothing else)
    suffix: str | None = None  # text after the gap: the reply fills in the middle (text/fim.py)
    prompt_logprobs: Int64 | None = None  # vLLM's: each prompt token's logprob and this many alternatives
    best_of: Int64 | None = None  # only n itself (the choices are not ranked): more is refused
    n_indent: Int64 | None = None  # llama.cpp's code-completion stops (its /completion and /infill)
    t_max_predict_ms: float | None = None
    temperature_last: bool | None = None  # llama.cpp's sampler order: the filters, then the temperature
    add_special_tokens: bool | None = True  # vLLM's: false leaves out the tokens the tokenizer adds (a BOS)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class RefusalPart(_Strict):  # an assistant turn's refusal, as OpenAI returns it: its text
    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


def _part_kind(part: Any) -> str | None:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return {"text": "TextPart", "refusal": "RefusalPart"}.get(kind)


# a message's content part, told apart by its "type" (an error names that part's own fields, not the
# other kind's; the tags are class names, which error messages leave out)
ContentPart = Annotated[Annotated[TextPart, Tag("TextPart")] | Annotated[RefusalPart, Tag("RefusalPart")],
                        Discriminator(_part_kind, custom_error_type="part_type",
                                      custom_error_message="a content part needs \"type\": \"text\"")]


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an assistant turn's thinking, for templates that show it again

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """A part of another kind (an image, audio, a file) named as such, not as a type mismatch."""
        for i, part in enumerate(value if isinstance(value, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in ("text", "refusal"):
                raise ValueError(f"part {i} is of type {kind!r}: this server reads text parts only (images, "
                                 "audio and files are not supported)")
        return value


class Prediction(_Strict):  # OpenAI's Predicted Outputs: text the reply is expected to resemble
    type: Literal["content"]
    content: str | list[TextPart]


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    prediction: Prediction | None = None
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: Int64 | None = None
    prompt_logprobs: Int64 | None = None  # vLLM's, as on completions (of the rendered conversation)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None  # OpenAI's deprecated form of tools: refused, naming tools
    function_call: Any = None
    # vLLM's chat extras: variables for the template (e.g. enable_thinking), and continuing the
    # final assistant message instead of starting a new one
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # a request's own template: refused, as vLLM refuses an untrusted one
    documents: list[dict[str, Any]] | None = None  # vLLM's: passed to the template (retrieval-augmented ones)
    reasoning_effort: str | None = None  # OpenAI's, passed to the template as vLLM passes it
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = False
    echo: bool | None = False  # vLLM's: the reply starts with the last message's text where it has the reply's role
    # a thinking model's reply: its <think> block returned (vLLM's include_reasoning) or, with llama.cpp's
    # reasoning_format "none", left in the content
    include_reasoning: bool | None = None
    reasoning_format: Literal["none", "auto", "deepseek"] | None = None


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Sampling):  # OpenAI's Responses API (responses_input.py)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # false: the response is not kept (response_store.py)
    tools: list[dict[str, Any]] | None = None  # function tools (others are refused)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None  # a stored response whose conversation this continues
    include: list[str] | None = None  # "message.output_text.logprobs": each output token's logprob
    top_logprobs: Int64 | None = None  # with it: this many alternatives a token
    background: bool | None = None  # answer at once; the reply runs on (responses_background.py)
    truncation: str | None = None  # "auto": the oldest turns dropped to fit the context; "disabled": a 400
    conversation: Any = None  # OpenAI's stored conversations and prompts: none are kept here (refused)
    prompt: Any = None


def sampling_params(req: _Sampling, max_tokens: int, choice: int, logprobs: int | None = None,
                    prompt_logprobs: int | None = None, structured: StructuredOutput | None = None,
                    prediction: tuple[int, ...] = ()) -> SamplingParams:
    """``SamplingParams`` for choice ``choice`` of ``req`` (a seeded choice's seed: ``seeded.choice_seed``);
    ``structured``: the reply's grammar when the caller has it (the request's, or a forced tool call's);
    ``prediction``: the predicted output's token ids."""
    top_k = req.top_k if req.top_k is not None else 0
    if req.min_tokens and req.min_tokens > max_tokens:  # (the budget: max_tokens, its default, or the context's room)
        raise bad_request(f"min_tokens ({req.min_tokens}) is more than the {max_tokens} tokens this reply may "
                          "have (max_tokens, its default, or what the context leaves after the prompt)", "min_tokens")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_k=0 if top_k == -1 else top_k, top_p=1.0 if req.top_p is None else req.top_p,
            min_p=req.min_p or 0.0, seed=None if req.seed in (None, -1) else choice_seed(req.seed, choice),
            stop=tuple([req.stop] if isinstance(req.stop, str) else (req.stop or ())),
            ignore_eos=bool(req.ignore_eos), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            repetition_last_n=req.repetition_last_n or 0,
            logit_bias=logit_bias_by_id(req.logit_bias), structured=structured or structured_output(req),
            min_tokens=req.min_tokens or 0, stop_token_ids=tuple(req.stop_token_ids or ()),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            skip_special_tokens=req.skip_special_tokens is not False,
            allowed_token_ids=tuple(req.allowed_token_ids or ()), bad_words=tuple(req.bad_words or ()),
            prediction=prediction, n_indent=getattr(req, "n_indent", None) or 0,
            t_max_predict_ms=getattr(req, "t_max_predict_ms", None) or 0.0,
            temperature_last=bool(getattr(req, "temperature_last", None)),
            min_p_after_top_p=bool(req.min_p_after_top_p))
    except ConfigError as e:
        message = str(e)
        param = message.split(" ", 1)[0]
        raise bad_request(message, param if param.isidentifier() else None) from None


def repeat_window(penalty: float | None, last_n: int, param: str) -> dict[str, Any]:
    """llama.cpp's and Ollama's repeat penalty over the last ``last_n`` tokens (-1: the whole context,
    0: no penalty) as the ``repetition_penalty`` / ``repetition_last_n`` fields; a 400 naming
    ``param`` for another negative window."""
    if last_n < -1:
        raise bad_request(f"{param} must be -1 (the whole context), 0 (off) or more, got {last_n}",
                          param.split(".")[0])
    return {"repetition_penalty": penalty if last_n else None, "repetition_last_n": max(last_n, 0)}


def sampling_fields(req: _Sampling) -> dict[str, Any]:
    """``req``'s sampling fields by name (to carry them into another request type)."""
    return {name: getattr(req, name) for name in _Sampling.model_fields}


def structured_output(req: _Sampling) -> StructuredOutput | None:
    """The grammar a request's reply must follow, if any: one of response_format,
    structured_outputs' fields and guided_*."""
    fmt = req.response_format
    asked: dict[str, tuple[str, Any]] = {f"guided_{kind}": (kind, getattr(req, f"guided_{kind}"))
                                         for kind in ("json", "regex", "choice", "grammar")}
    if req.structured_outputs is not None:
        so = req.structured_outputs
        if so.structural_tag is not None:
            raise bad_request("structured_outputs.structural_tag is not supported; give json, regex, choice, grammar "
                              "or json_object", "structured_outputs")
        asked.update({f"structured_outputs.{kind}": (kind, getattr(so, "json_" if kind == "json" else kind))
                      for kind in ("json", "regex", "choice", "grammar")})
        if so.json_object:
            asked["structured_outputs.json_object"] = ("json_object", True)
    if fmt is not None and fmt.type == "json_object":
        asked["response_format"] = ("json_object", True)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
        asked["response_format"] = ("json", fmt.json_schema.schema_)
    asked = {k: v for k, v in asked.items() if v[1] is not None}
    if not asked:
        return None
    if len(asked) > 1:
        raise bad_request(f"give one structured output constraint, not {' and '.join(asked)}",
                          next(iter(asked)).split(".")[0])
    (label, (kind, value)), = asked.items()
    param = label.split(".")[0]
    if kind == "json" and isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            raise bad_request(f"{label} is not valid JSON", param) from None
    try:
        return StructuredOutput(**{kind: value})
    except ConfigError as e:  # an empty choice list, regex or grammar
        raise bad_request(f"{label}: {e}", param) from None


_TOKEN_KEY = re.compile(r"\s*[0-9]{1,19}\s*")  # ASCII digits only ("²".isdigit() holds, int() refuses it)


def logit_bias_by_id(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        if not _TOKEN_KEY.fullmatch(key):
            raise bad_request(f"logit_bias keys must be token ids, got {key[:40]!r}", "logit_bias")
        out[int(key)] = value
    return out
