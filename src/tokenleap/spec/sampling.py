"""Logits -> probabilities, exact greedy, and seeded sampling. Pure functions.

Filtering order (vLLM's):

1. temperature: ``logits / T``; ``T == 0`` means greedy and yields a one-hot row at the argmax;
2. min-p: drop tokens with ``p < min_p * p_max`` (``min_p == 0`` disables);
3. top-k: keep the ``k`` highest logits (``k == 0`` disables);
4. top-p (nucleus): keep the smallest set of the most probable tokens left whose cumulative
   probability, renormalized over them, reaches ``top_p`` (``top_p == 1`` disables);
5. renormalize with a softmax over the kept logits.

Min-p and top-k commute; min-p before top-p matters: top-p then measures the mass of what min-p
left (vLLM's order; Hugging Face's and llama.cpp's apply top-p first, and min-p after it).

With ``min_p_after_top_p`` (Hugging Face's and Ollama's order) top-p measures top-k's distribution
and min-p comes after it. With ``temperature_last`` (llama.cpp's default sampler chain: top-k, top-p,
min-p, then the temperature) the filters judge the untempered distribution, in that order too, and
the temperature divides the logits that are left: a high temperature then flattens the survivors
without letting min-p's or top-p's tail back in.

The most probable token is always kept. Ties are broken by token id, lower id first (a stable
descending sort), so "first max" is the rule everywhere, ``greedy`` included.

Row independence: every operation works within a row (elementwise ops, and softmax / sort /
cumsum along the vocabulary), so row ``i``'s result does not depend on the other rows. Parameters
may be Python scalars (same for every row) or tensors ``# [n]`` (one value per row), so a batch
can mix requests. The target and the draft model must be filtered by this same function with the
same parameters; rejection sampling in :mod:`tokenleap.spec.verify` relies on it.

Two sources of randomness:

* an unseeded request draws float64 uniforms from its own ``torch.Generator`` (inverse CDF, one
  uniform per row; speculation verifies by rejection sampling, :mod:`tokenleap.spec.verify`);
* a seeded request uses :class:`tokenleap.spec.seeded.SeededNoise`: the token at sequence position
  ``t`` is ``argmin_x E(t, x) / p_t(x)`` with ``E ~ Exp(1)`` keyed by (seed, t, x) alone (the
  Gumbel-max trick), an exact sample from ``p_t``, the same whatever proposed it.

Neither ever chooses a zero-probability token.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenleap.config import SamplingParams
from tokenleap.spec.seeded import SeededNoise

Generators = torch.Generator | Sequence[torch.Generator | None] | None
Param = float | int | torch.Tensor

# Cumulative mass within this of top_p counts as reaching it, so an exact boundary
# (e.g. 0.5 + 0.25 with top_p = 0.75) is not decided by float32 rounding of a running sum.
_TOP_P_EPS = 1e-6
# A row's highest logits the filters look at first (the full sort only where they cannot decide)
_CANDIDATES = 256


def logits_to_probs(
    logits: torch.Tensor,  # [n, vocab], any float dtype
    temperature: Param = 1.0,
    top_k: Param = 0,
    top_p: Param = 1.0,
    min_p: Param = 0.0,
    temperature_last: Param = False,
    min_p_after_top_p: Param = False,
) -> torch.Tensor:  # [n, vocab] float32
    """Filtered, renormalized float32 probabilities; see the module docstring for the order.

    Each parameter is a Python scalar or a tensor ``# [n]`` with one value per row.
    """
    assert logits.dim() == 2, f"logits must be [n, vocab], got shape {tuple(logits.shape)}"
    n = logits.shape[0]
    t = _column(temperature, n, torch.float32)  # [n, 1]
    is_greedy = t == 0  # [n, 1]
    raw = logits.float()  # [n, vocab]
    x = raw / torch.where(is_greedy, 1.0, t)  # [n, vocab]
    last = _column(temperature_last, n, torch.bool)  # [n, 1]
    judged = torch.where(last, raw, x) if bool(last.any()) else x  # [n, vocab]: what the filters look at
    after = _column(min_p_after_top_p, n, torch.bool)  # [n, 1]
    keep = _keep_mask(judged, is_greedy, top_k, top_p, min_p, ~(last | after))  # [n, vocab] bool, or None
    if keep is not None:
        x = x.masked_fill(~keep, float("-inf"))
    return torch.softmax(x, dim=-1)  # [n, vocab]


def _keep_mask(
    x: torch.Tensor,  # [n, vocab] float32, temperature applied (or not: ``temperature_last``)
    is_greedy: torch.Tensor,  # [n, 1] bool
    top_k: Param,
    top_p: Param,
    min_p: Param,
    min_p_first: torch.Tensor,  # [n, 1] bool: min-p before top-p (vLLM's order), else after (HF's, llama.cpp's)
) -> torch.Tensor | None:  # [n, vocab] bool in vocabulary order; None when nothing is filtered
    n, vocab = x.shape
    k = _column(top_k, n, torch.long)  # [n, 1]
    k = torch.where((k <= 0) | (k > vocab), vocab, k)
    k = torch.where(is_greedy, 1, k)
    p = _column(top_p, n, torch.float32)  # [n, 1]
    m = _column(min_p, n, torch.float32)  # [n, 1]
    if not bool((k < vocab).any() or (p < 1).any() or (m > 0).any()):
        return None
    if vocab < 4 * _CANDIDATES:
        return _keep_sorted(x, k, p, m, min_p_first)
    keep, done = _keep_among_candidates(x, k, p, m, _CANDIDATES, min_p_first)
    if not bool(done.all()):  # rows whose kept set may reach past the candidates: the full sort
        rest = ~done
        keep[rest] = _keep_sorted(x[rest], k[rest], p[rest], m[rest], min_p_first[rest])
    return keep


def _keep_sorted(
    x: torch.Tensor,  # [n, vocab] float32
    k: torch.Tensor,  # [n, 1] long, 1..vocab
    p: torch.Tensor,  # [n, 1] float32
    m: torch.Tensor,  # [n, 1] float32
    min_p_first: torch.Tensor | None = None,  # [n, 1] bool (None: every row)
) -> torch.Tensor:  # [n, vocab] bool in vocabulary order
    """The filters on the whole row in stable descending order (lower id first among equals)."""
    vocab = x.shape[1]
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)  # [n, vocab] each
    keep = torch.arange(vocab) < k  # [n, vocab], in sorted order from here on
    probs = torch.softmax(sorted_x.masked_fill(~keep, float("-inf")), dim=-1)  # [n, vocab]
    return _scatter(_nucleus(keep, probs, p, m, min_p_first), order)


def _keep_among_candidates(
    x: torch.Tensor,  # [n, vocab] float32
    k: torch.Tensor,  # [n, 1] long
    p: torch.Tensor,  # [n, 1] float32
    m: torch.Tensor,  # [n, 1] float32
    c: int,
    min_p_first: torch.Tensor | None = None,  # [n, 1] bool (None: every row)
) -> tuple[torch.Tensor, torch.Tensor]:  # keep [n, vocab] bool, done [n] bool
    """The filters on each row's ``c`` highest logits only, in the full sort's order.

    Sorting a 152k vocabulary costs tens of milliseconds a row -- more than the rest of a
    verification step -- while the tokens a filter keeps are almost always among the first few
    hundred. Every filter keeps a prefix of the sorted row (positions below k, cumulative mass
    below top_p, probability at least min_p * p_max: each holds for a position only if it holds for
    every earlier one), so when the last candidate is dropped nothing after it is kept, and the
    candidates decide the row. ``done`` is False where they cannot: the last candidate is kept,
    the c-th value is tied with a token outside the candidates (which of the equals the full sort
    puts first is then unknown), or top-k's normalizer spans tokens past the candidates
    (c < k < vocab). Those rows go to the full sort. The kept set is the full sort's except where
    a row's cumulative mass lands within float rounding of top_p (the masses are summed from
    ``exp(logit - logsumexp)`` rather than from a softmax of the sorted row); plain decoding and
    every verifier filter through this same function, so speculation stays exact either way.
    """
    n, vocab = x.shape
    vals, idx = torch.topk(x, c, dim=-1)  # [n, c] each, descending; order among equal values unspecified
    by_id = torch.argsort(idx, dim=-1)  # then ordered as the stable sort orders them: lower id first among equals
    vals, idx = vals.gather(1, by_id), idx.gather(1, by_id)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices  # [n, c]
    vals, idx = vals.gather(1, order), idx.gather(1, order)
    whole = (x >= vals[:, -1:]).sum(dim=-1) == c  # [n]: no token outside ties with the last candidate
    in_k = torch.arange(c) < k  # [n, c]
    # top-k's softmax over the first k sorted tokens: among the candidates when k <= c, every token when k = vocab
    lse = torch.logsumexp(vals.masked_fill(~in_k, float("-inf")), dim=-1, keepdim=True)  # [n, 1]
    if bool((k > c).any()):
        lse = torch.where(k <= c, lse, torch.logsumexp(x, dim=-1, keepdim=True))
    probs = torch.exp(vals - lse).masked_fill(~in_k, 0.0)  # [n, c]
    keep_c = _nucleus(in_k, probs, p, m, min_p_first)  # [n, c]
    # top-p over min-p's renormalized mass needs all of that mass: a min-p set reaching the last candidate
    # may reach past it
    past = (_min_p_first_rows(m, min_p_first) & (probs[:, -1:] >= m * probs[:, :1])).squeeze(1)  # [n]
    done = whole & ~keep_c[:, -1] & ~past & ((k <= c) | (k >= vocab)).squeeze(1)
    return torch.zeros(n, vocab, dtype=torch.bool).scatter_(1, idx, keep_c), done


def _nucleus(keep: torch.Tensor, probs: torch.Tensor, p: torch.Tensor, m: torch.Tensor,
             min_p_first: torch.Tensor | None = None) -> torch.Tensor:
    """``keep`` (top-k, in sorted order) narrowed by min-p and top-p (``min_p_first``: top-p over the
    mass min-p left, renormalized; else over top-k's); probs: [n, width] in sorted order, top-k's
    softmax (where top-k keeps tokens past ``width``, its mass there is not in the row)."""
    by_min_p = probs >= m * probs[:, :1]  # [n, width]: p / p_max does not depend on normalization
    first = _min_p_first_rows(m, min_p_first)  # [n, 1]
    if bool(first.any()):
        # (a row whose min-p set reaches the last column is decided by the full sort: its sum is whole there)
        kept = torch.where(keep & by_min_p, probs, 0.0)  # [n, width]
        probs = torch.where(first, kept / kept.sum(dim=-1, keepdim=True), probs)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [n, width]
    keep = keep & ((mass_before < p - _TOP_P_EPS) | (p >= 1)) & by_min_p
    keep[:, 0] = True
    return keep


def _min_p_first_rows(m: torch.Tensor, min_p_first: torch.Tensor | None) -> torch.Tensor:  # [n, 1] bool
    """The rows whose top-p measures the mass min-p left: a min-p set, in vLLM's order (None: every row)."""
    return (m > 0) if min_p_first is None else (m > 0) & min_p_first


def _scatter(keep: torch.Tensor, order: torch.Tensor) -> torch.Tensor:  # [n, vocab] sorted -> vocabulary order
    return torch.zeros_like(keep).scatter(-1, order, keep)


def _column(value: Param, n: int, dtype: torch.dtype) -> torch.Tensor:  # [n, 1]
    """A per-row parameter as a column: a scalar is repeated, a ``# [n]`` tensor is reshaped."""
    if isinstance(value, torch.Tensor):
        assert value.numel() in (1, n), f"a per-row parameter needs 1 or {n} values, got {value.numel()}"
        return value.to(dtype).reshape(-1, 1).expand(n, 1)
    return torch.full((n, 1), value, dtype=dtype)


def greedy(logits: torch.Tensor) -> torch.Tensor:  # [...] long
    """Exact argmax over the last dimension (``logits # [..., vocab]``); first max on ties."""
    return torch.argmax(logits, dim=-1)


_ARGMAX_BLOCK = 1024  # columns whose maximum argmax_rows takes first


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # x [n, vocab] float -> [n] long
    """``torch.argmax(x, dim=-1)`` exactly (first maximum on ties; a NaN counts as the maximum, the
    first NaN wins) in two passes that vectorize: each block of columns' maximum, then the argmax
    within the first block holding the row's maximum. Torch's CPU argmax kernel does not vectorize:
    over a 152k vocabulary it is ~4x slower on one thread (greedy verification's whole cost)."""
    n, vocab = x.shape
    b = _ARGMAX_BLOCK
    if vocab < 2 * b:
        return torch.argmax(x, dim=-1)
    blocks, tail = divmod(vocab, b)
    maxima = x[:, :blocks * b].reshape(n, blocks, b).amax(dim=-1)  # [n, blocks]
    if tail:
        maxima = torch.cat([maxima, x[:, blocks * b:].amax(dim=-1, keepdim=True)], dim=1)  # [n, blocks + 1]
    first = torch.argmax(maxima, dim=-1)  # [n]: the first block holding the maximum (NaN: the first NaN)
    # the tail block's columns past the vocabulary repeat its last one, after it: never the first maximum
    cols = (first[:, None] * b + torch.arange(b)).clamp_(max=vocab - 1)  # [n, b]
    return first * b + torch.argmax(x.gather(1, cols), dim=-1)


def sample(
    probs: torch.Tensor,  # [n, vocab], non-negative, each row with positive mass
    generator: Generators = None,
) -> torch.Tensor:  # [n] long
    """One token per row, drawn with probability proportional to ``probs`` (need not sum to 1).

    ``generator`` is one ``torch.Generator`` for all rows, or a sequence with one per row (a
    batch of requests, each with its own seed). One float64 uniform is drawn per row, so the
    result of row ``i`` with its own generator does not depend on the rest of the batch.
    """
    assert probs.dim() == 2, f"probs must be [n, vocab], got shape {tuple(probs.shape)}"
    u = rand_rows(probs.shape[0], 1, generator)  # [n, 1] float64 in [0, 1)
    return inverse_cdf(probs, u)


def inverse_cdf(
    weights: torch.Tensor,  # [n, vocab], non-negative
    u: torch.Tensor,  # [n, 1] float64 uniforms in [0, 1)
) -> torch.Tensor:  # [n] long
    """The token whose cumulative interval contains ``u * total``; never a zero-weight token.

    A token with zero weight has an empty interval and is never found. If rounding puts
    ``u * total`` at or past the end, the last token with positive weight is returned.
    """
    cum = torch.cumsum(weights.double(), dim=-1)  # [n, vocab]
    total = cum[:, -1:].contiguous()  # [n, 1]
    hit = torch.searchsorted(cum, u * total, right=True)  # [n, 1]
    last = torch.searchsorted(cum, total, right=False)  # [n, 1] last positive token
    return torch.minimum(hit, last).squeeze(-1)  # [n]


def rand_rows(n: int, size: int, generator: Generators) -> torch.Tensor:  # [n, size] float64
    """Uniforms in [0, 1): from one generator for all rows, or one generator per row."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(n, size, generator=generator, dtype=torch.float64)
    assert len(generator) == n, f"need one generator per row: {n} rows, {len(generator)} generators"
    if n == 0:
        return torch.empty(0, size, dtype=torch.float64)
    return torch.stack([torch.rand(size, generator=g, dtype=torch.float64) for g in generator])


def torch_seed(seed: int) -> int:
    """A seed of any size (a request's, a bench's) as the 64 bits torch's generators take."""
    return seed % 2**64


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator: seeded when ``seed`` is given, else non-deterministic."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(torch_seed(seed))
    return g


def request_randomness(seed: int | None) -> "torch.Generator | SeededNoise":
    """What a sampled request draws from: ``SeededNoise`` when seeded, else its own generator."""
    return make_generator(None) if seed is None else SeededNoise(seed)


@dataclass(frozen=True, eq=False)
class SamplingFilters:
    """Per-row filter parameters for a batch that mixes requests (see :func:`logits_to_probs`)."""

    temperature: torch.Tensor  # [n] float32
    top_k: torch.Tensor  # [n] long
    top_p: torch.Tensor  # [n] float32
    min_p: torch.Tensor  # [n] float32
    temperature_last: torch.Tensor  # [n] bool
    min_p_after_top_p: torch.Tensor  # [n] bool

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], rows: Sequence[int] | None = None
    ) -> "SamplingFilters":
        """One row per request, or ``rows[i]`` rows for request ``i`` (e.g. ``k_i + 1`` to verify)."""
        repeats = torch.tensor(list(rows) if rows is not None else [1] * len(params))  # [requests]
        assert repeats.numel() == len(params), "rows needs one count per request"

        def column(name: str, dtype: torch.dtype) -> torch.Tensor:  # [n]
            values = torch.tensor([getattr(sp, name) for sp in params], dtype=dtype)  # [requests]
            return values.repeat_interleave(repeats)

        return cls(column("temperature", torch.float32), column("top_k", torch.long),
                   column("top_p", torch.float32), column("min_p", torch.float32),
                   column("temperature_last", torch.bool), column("min_p_after_top_p", torch.bool))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # logits [n, vocab] -> [n, vocab]
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p, self.temperature_last,
                               self.min_p_after_top_p)


def params_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [n, vocab] -> [n, vocab]
    """``logits_to_probs`` with one request's filters (every row)."""
    return logits_to_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p,
                           params.temperature_last, params.min_p_after_top_p)


__all__ = ["logits_to_probs", "params_probs", "greedy", "argmax_rows", "sample", "inverse_cdf", "rand_rows",
           "make_generator",
           "request_randomness", "SamplingFilters"]
