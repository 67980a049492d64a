"""Typed, frozen configuration: model shape and sampling parameters (speculation settings:
``spec_config.py``, importable from here too).

Validation lives here (``__post_init__``) so every entry point -- Python API, CLI, HTTP --
reports the same clear message for the same bad value.
"""
from __future__ import annotations

import json as _json
import logging
import re
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")  # rope scaling as transformers defines it
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
QUANT_MODES = ("none", "int8", "int4", "w8a8")  # weight quantizations (w8a8: models/w8a8.py)
MAX_LOGPROBS = 20  # most alternatives a request may ask for per token (vLLM's default limit)
MAX_DRAFT_TOKENS = 256  # the longest draft (or tree) a step may verify
FLOAT32_MAX = 3.4028234663852886e38  # sampling parameters become float32 tensors
# vLLM's rule: a temperature above 0 and below this is raised to it (1e-38 would overflow the logits)
MIN_TEMPERATURE = 0.01
MAX_N = 16384  # most completions a prompt may ask for (vLLM's limit)


class TokenleapError(Exception):
    """Base class of user-facing errors (``errors.py`` has the others; this one is here, under
    ``ConfigError``, because every module imports this one)."""


class ConfigError(TokenleapError, ValueError):
    """A configuration or request value is invalid; the message says which and why (a ``ValueError``
    too, as Python's own bad-value errors)."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder of one of ``SUPPORTED_ARCHITECTURES``. Field names follow Hugging Face's
    config.json; ``from_hf_dict`` reads one (``models/hf_config.py``), ``to_hf_dict`` writes one back.

    Families differ only in flags derived here: Qwen3 and Gemma 3 normalise q and k per head
    (``qk_norm``); Gemma 3 scales embeddings by sqrt(hidden), stores norm weights as offsets from 1,
    and wraps attention and MLP in pre and post norms (``gemma_style``)."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    # a bias on the q/k/v projections (Qwen2's always), and on o_proj too where transformers puts it
    # there (Llama, Qwen3, Gemma 3: ``o_proj_bias``)
    attention_bias: bool = False
    mlp_bias: bool = False  # a bias on gate/up/down (Llama's mlp_bias)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # rope scaling of the (global) layers: sorted (key, value) pairs of transformers' rope parameters,
    # "rope_type" among them; () is plain RoPE
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    rope_freq_factors: tuple[float, ...] = ()  # a GGUF's rope_freqs tensor: inv_freq[i] /= factor[i]
    sliding_window: int | None = None  # a sliding layer's query sees this many keys, itself included
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"; () = all alike
    rope_local_base_freq: float | None = None  # RoPE base of sliding layers where it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (default head_dim)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    hidden_act: str = "silu"  # "silu" (SwiGLU) | "gelu_pytorch_tanh" (GeGLU)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; tokenleap supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        for name in ("eos_token_ids", "rope_freq_factors", "layer_types"):
            if not isinstance(getattr(self, name), tuple):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope scaling type {rope_type!r} is not supported by tokenleap (it implements "
                              f"{', '.join(ROPE_TYPES)}); use a checkpoint without it")
        if self.rope_freq_factors and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ConfigError(f"rope_freq_factors needs head_dim / 2 = {self.head_dim // 2} values, "
                              f"got {len(self.rope_freq_factors)}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"activation {self.hidden_act!r} is not supported; tokenleap runs "
                              f"{', '.join(HIDDEN_ACTS)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.layer_types and (len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types)
                                 <= {"full_attention", "sliding_attention"}):
            raise ConfigError("layer_types needs one of 'full_attention' / 'sliding_attention' per layer")

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @property
    def max_context(self) -> int:
        """Positions the model takes, as vLLM derives them from its rope scaling: YaRN extends its
        ``original_max_position_embeddings`` by its factor, linear and dynamic scaling extend
        ``max_position_embeddings`` by theirs (not Gemma 3's linear scaling, or Llama 3's: their
        ``max_position_embeddings`` already counts it)."""
        s = self.rope_scaling_dict
        kind, factor = s.get("rope_type", "default"), float(s.get("factor") or 1.0)
        if kind == "yarn":
            return max(self.max_position_embeddings, int(s["original_max_position_embeddings"] * factor))
        if kind == "dynamic" or (kind == "linear" and self.architecture != "gemma3"):
            return int(self.max_position_embeddings * max(factor, 1.0))
        return self.max_position_embeddings

    @property
    def o_proj_bias(self) -> bool:
        """o_proj has a bias: ``attention_bias`` outside Qwen2 (whose bias is on q/k/v only), in the
        families whose transformers attention has one there."""
        return self.attention_bias and self.architecture in ("llama", "qwen3", "gemma3")

    @property
    def qk_norm(self) -> bool:
        """q and k are RMS-normalised per head before RoPE (q_norm / k_norm weights)."""
        return self.architecture in ("qwen3", "gemma3")

    @property
    def gemma_style(self) -> bool:
        """Embeddings scaled by sqrt(hidden), norms multiply by (1 + weight), pre/post norms."""
        return self.architecture == "gemma3"

    def is_sliding(self, layer: int) -> bool:
        """Layer ``layer`` attends over the last ``sliding_window`` positions only."""
        if self.sliding_window is None:
            return False
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json dictionary (see ``models/hf_config.py``)."""
        from tokenleap.models.hf_config import config_from_hf_dict  # lazy: models imports this module

        return config_from_hf_dict(d)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json a Hugging Face loader accepts for this model (``from_hf_dict`` reads it back)."""
        from tokenleap.models.hf_config import config_to_hf_dict

        return config_to_hf_dict(self)


@dataclass(frozen=True)
class StructuredOutput:
    """A reply constrained to a grammar (``structured.py``): exactly one of a JSON schema (JSON text
    or a dict), any JSON object, a regular expression, a choice among strings, or a grammar (Lark, or
    llama.cpp's GBNF)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", _json.dumps(self.json))  # key order kept: it orders the reply's keys
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        _check(len(given) == 1, "structured output needs exactly one of json, json_object, regex, choice, grammar; "
                                f"got {', '.join(given) or 'none'}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value.strip() != ""), f"{name} must be a non-empty string")
        _check(self.choice is None or (self.choice and all(isinstance(c, str) and c for c in self.choice)),
               "choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, n))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. ``temperature == 0`` means exact greedy (argmax); a temperature
    above 0 and below ``MIN_TEMPERATURE`` is raised to it, with a warning (vLLM's rule). ``seed`` -1
    means no seed (vLLM's, and llama.cpp's)."""

    max_tokens: int | None = 128  # None: up to the context window's end (vLLM's)
    temperature: float = 0.0
    top_k: int = 0  # 0 disables (-1 too, as in vLLM: taken as 0)
    top_p: float = 1.0
    min_p: float = 0.0
    # llama.cpp's order: top-k, top-p and min-p on the untempered distribution, temperature on what is left
    # (default: vLLM's, temperature first, then min-p, top-k, top-p; ``sampling.py``)
    temperature_last: bool = False
    # Hugging Face's and Ollama's order: top-p on top-k's distribution, then min-p (default: vLLM's, min-p
    # first; temperature_last's llama.cpp order has it too)
    min_p_after_top_p: bool = False
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # report each generated token's log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (the first has none)
    presence_penalty: float = 0.0  # OpenAI's: subtract once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtract per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # HF / vLLM's: shrink the logits of tokens seen in prompt or output
    repetition_last_n: int = 0  # llama.cpp / Ollama's window: only the last n tokens count as seen (0: all)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit); a dict is accepted
    structured: StructuredOutput | None = None  # constrain the reply to a grammar (JSON schema, regex, ...)
    min_tokens: int = 0  # vLLM's: no EOS, stop token or stop string before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # vLLM's: tokens that end the reply (kept in its token ids)
    include_stop_str_in_output: bool = False  # vLLM's: a stop string that ended the reply stays in its text
    # vLLM's: special tokens the reply holds (control tokens such as <|im_start|>) are left out of its text;
    # False writes them (an EOS or stop token that ends the reply is never in the text)
    skip_special_tokens: bool = True
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: the reply's tokens are chosen among these only (empty: all)
    # vLLM's bad_words: words the reply may not contain (the engine tokenizes them into bad_word_ids)
    bad_words: tuple[str, ...] = ()
    # HF's bad_words_ids: token sequences the reply may not contain -- a sequence's last token is barred
    # where the reply's last tokens are the rest of it
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    # OpenAI's Predicted Outputs: token ids the reply is expected to resemble; lookup drafters propose
    # from them too (output unchanged, only faster where the reply follows them)
    prediction: tuple[int, ...] = ()
    # llama.cpp's code-completion stops: a new line indented less than n_indent columns ends the reply
    # (cut after its indentation); past t_max_predict_ms from the first token, a reply that has a new
    # line ends (0: off)
    n_indent: int = 0
    t_max_predict_ms: float = 0.0
    # vLLM's: completions per prompt (LLM.generate / LLM.chat; a seeded request's j-th with
    # seeded.choice_seed(seed, j)); a sequence is one completion
    n: int = 1

    def __post_init__(self) -> None:
        for name in ("stop", "bad_words"):  # a string alone stands for a list of one
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, (getattr(self, name),))
        for name in ("stop", "bad_words", "stop_token_ids", "prediction", "allowed_token_ids"):
            value = getattr(self, name)
            if value is None:  # (vLLM's and OpenAI's "none")
                object.__setattr__(self, name, ())
            elif not isinstance(value, tuple):
                _check(hasattr(value, "__iter__") and not isinstance(value, (dict, str, bytes)),
                       f"{name} must be a list, got {type(value).__name__}")
                object.__setattr__(self, name, tuple(value))
        if not isinstance(self.bad_word_ids, tuple) or not all(isinstance(w, tuple) for w in self.bad_word_ids):
            try:
                object.__setattr__(self, "bad_word_ids", tuple(tuple(w) for w in self.bad_word_ids))
            except TypeError:
                raise ConfigError("bad_word_ids must be sequences of token ids") from None
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        _check(is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        _check(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
               f"max_tokens must be an integer >= 1 (or None: up to the context's end), got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and 0 <= self.temperature <= FLOAT32_MAX,
               f"temperature must be >= 0 and fit a 32-bit float (at most {FLOAT32_MAX:.4g}), "
               f"got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / T would overflow float32 as T nears 0
            logging.getLogger("tokenleap").warning("temperature %g is below %g, which may overflow the logits; "
                                                   "it is raised to %g", self.temperature, MIN_TEMPERATURE,
                                                   MIN_TEMPERATURE)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        _check(is_int(self.top_k) and self.top_k >= -1,
               f"top_k must be an integer >= 0 (0 or -1, as vLLM's, disables it), got {self.top_k!r}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        if self.seed == -1:
            object.__setattr__(self, "seed", None)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (is_int(value) and 0 <= value <= MAX_LOGPROBS),
                   f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        # (below 1e-6 a logit divided by it can leave float32's range, and the sampler would see inf; the upper
        # bound is generous: vLLM takes any positive value, and 1e6 already bars a seen token outright)
        _check(_is_number(self.repetition_penalty) and 1e-6 <= self.repetition_penalty <= 1e6,
               f"repetition_penalty must be in [1e-6, 1e6] (1 disables it), got {self.repetition_penalty!r}")
        _check(is_int(self.repetition_last_n) and self.repetition_last_n >= 0,
               f"repetition_last_n must be an integer >= 0 (0: the whole prompt and output), "
               f"got {self.repetition_last_n!r}")
        _check(all(is_int(t) and t >= 0 and _is_number(b) and -100 <= b <= 100
                   for t, b in self.logit_bias),
               "logit_bias must map token ids >= 0 to biases in [-100, 100]")
        _check(is_int(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
               f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        _check(all(is_int(t) and t >= 0 for t in self.prediction),
               "prediction must be token ids (integers >= 0)")
        for name in ("stop_token_ids", "allowed_token_ids"):
            _check(all(is_int(t) and t >= 0 for t in getattr(self, name)),
                   f"{name} must be token ids >= 0")
        _check(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words must be non-empty strings")
        _check(all(w and all(is_int(t) and t >= 0 for t in w)
                   for w in self.bad_word_ids),
               "bad_word_ids must be non-empty sequences of token ids >= 0")
        _check(is_int(self.n_indent) and self.n_indent >= 0,
               f"n_indent must be an integer >= 0, got {self.n_indent!r}")
        _check(_is_number(self.t_max_predict_ms) and 0 <= self.t_max_predict_ms < float("inf"),
               f"t_max_predict_ms must be a number >= 0, got {self.t_max_predict_ms!r}")
        _check(self.structured is None or isinstance(self.structured, StructuredOutput),
               "structured must be a StructuredOutput")
        for name in ("temperature_last", "min_p_after_top_p"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Penalties, a logit bias, allowed tokens or barred words change the target's logits before
        choosing (``penalties.py``)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.allowed_token_ids or self.bad_word_ids)


def is_int(x: Any) -> bool:
    """An integer, not a bool (``True`` is an ``int`` to Python, never a count or a token id here)."""
    return isinstance(x, int) and not isinstance(x, bool)


_TOKEN_KEY = re.compile(r"\s*[0-9]+\s*")  # a token id as OpenAI's JSON keys spell it (ASCII digits only)


def _bias_pairs(bias: Any) -> tuple:
    """``logit_bias`` (a dict, pairs, or None) as (token id, bias) pairs sorted by id: keys spelled as
    OpenAI's JSON spells them ("1234") read as ids, and a key given twice keeps its last bias, as a dict
    does. The values are checked with the other fields."""
    if bias is None:
        return ()
    try:
        given = list(bias.items()) if isinstance(bias, dict) else [(t, b) for t, b in bias]
    except (TypeError, ValueError):
        raise ConfigError("logit_bias must map token ids to biases ({id: bias})") from None
    merged: dict[Any, Any] = {}
    for t, b in given:
        merged[int(t) if isinstance(t, str) and _TOKEN_KEY.fullmatch(t) else t] = b
    return tuple(sorted(merged.items(), key=lambda kv: kv[0] if is_int(kv[0]) else -1))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


from tokenleap.spec_config import SpecConfig, default_ngram_min  # noqa: E402 (kept importable from here)
