"""The filters' order is vLLM's: min-p before top-p, so top-p measures the mass min-p left; with
``min_p_after_top_p`` Hugging Face's and Ollama's (top-p, then min-p); with ``temperature_last``
llama.cpp's chain (top-p before min-p) on the untempered distribution."""
from __future__ import annotations

import itertools

import pytest
import torch

from tokenleap.config import SamplingParams
from tokenleap.spec.sampling import logits_to_probs, params_probs


def vllm_reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
                   ) -> torch.Tensor:  # [n, vocab] -> [n, vocab]
    """vLLM's sampler written out on its own: temperature, min-p (logits below min_p * p_max set to
    -inf), then top-k and top-p over the softmax of what is left (top-p keeps a token while the mass
    before it, in descending order, is below p)."""
    x = logits.double() / temperature
    probs = torch.softmax(x, dim=-1)
    x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    order = torch.argsort(x, dim=-1, descending=True, stable=True)
    sorted_probs = torch.softmax(x.gather(1, order), dim=-1)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = before >= top_p
    drop[:, 0] = False
    x = x.scatter(1, order, x.gather(1, order).masked_fill(drop, float("-inf")))
    return torch.softmax(x, dim=-1).float()


def hf_reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
                 ) -> torch.Tensor:  # [n, vocab] -> [n, vocab]
    """Hugging Face's (and Ollama's) order written out: temperature, top-k, top-p over top-k's softmax,
    then min-p."""
    x = logits.double() / temperature
    if 0 < top_k < x.shape[-1]:
        x = x.masked_fill(x < torch.topk(x, top_k, dim=-1).values[:, -1:], float("-inf"))
    order = torch.argsort(x, dim=-1, descending=True, stable=True)
    sorted_probs = torch.softmax(x.gather(1, order), dim=-1)
    drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
    drop[:, 0] = False
    x = x.scatter(1, order, x.gather(1, order).masked_fill(drop, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return torch.softmax(x, dim=-1).float()


def test_min_p_narrows_what_top_p_measures():
    """0.4 / 0.3 / 0.25 / 0.05 with min-p 0.5 (keeps >= 0.2) and top-p 0.72: min-p first leaves three
    tokens, renormalized 0.42 / 0.32 / 0.26, and top-p keeps two of them; top-p first (llama.cpp's
    order) keeps three."""
    logits = torch.tensor([[0.4, 0.3, 0.25, 0.05]]).log()
    vllm = params_probs(logits, SamplingParams(temperature=1.0, min_p=0.5, top_p=0.72))
    torch.testing.assert_close(vllm, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))
    llamacpp = params_probs(logits, SamplingParams(temperature=1.0, min_p=0.5, top_p=0.72, temperature_last=True))
    torch.testing.assert_close(llamacpp, torch.tensor([[0.4, 0.3, 0.25, 0.0]]) / 0.95)
    hf = params_probs(logits, SamplingParams(temperature=1.0, min_p=0.5, top_p=0.72, min_p_after_top_p=True))
    torch.testing.assert_close(hf, llamacpp)  # (at T = 1 the two differ only in where the temperature goes)


@pytest.mark.parametrize("vocab", [50, 3000, 40000])  # the full sort, and the candidates' path
def test_every_filter_together_equals_vllms_order(vocab):
    g = torch.Generator().manual_seed(vocab)
    settings = [(1.0, 0, 0.9, 0.05), (0.7, 40, 0.8, 0.1), (1.3, 0, 0.5, 0.001), (1.0, 20, 0.95, 0.3),
                (2.0, 0, 0.3, 0.0005), (0.9, 0, 1.0, 0.2), (1.1, 100, 0.6, 0.0)]
    for spread in (1.0, 4.0, 10.0):  # nearly flat (min-p's set past the candidates), moderate, peaked
        logits = torch.randn(4, vocab, generator=g)
        logits[:, :30] += torch.linspace(spread, spread / 5, 30)
        for (t, k, p, m), hf in itertools.product(settings, (False, True)):
            got = logits_to_probs(logits, t, k, p, m, min_p_after_top_p=hf)
            want = (hf_reference if hf else vllm_reference)(logits, t, k, p, m)
            # the same kept set, but for a token at top-p's edge of a flat row of thousands (float32 sums)
            differ = ((got > 0) != (want > 0)).sum(dim=-1)
            assert int(differ.max()) <= (1 if vocab > 1000 else 0), (vocab, spread, t, k, p, m, hf, differ)
            both = (got > 0) & (want > 0)
            torch.testing.assert_close(got[both], want[both], atol=1e-7, rtol=1e-3)


def test_each_row_keeps_its_own_order_in_a_batch():
    from tokenleap.spec.sampling import SamplingFilters
    logits = torch.randn(3, 3000, generator=torch.Generator().manual_seed(5))
    logits[:, :30] += torch.linspace(4.0, 0.8, 30)
    rows = [SamplingParams(temperature=1.2, top_p=0.6, min_p=0.02, min_p_after_top_p=hf) for hf in (False, True)]
    rows.append(SamplingParams(temperature=1.2, top_p=0.6, min_p=0.02, temperature_last=True))
    batch = SamplingFilters.from_params(rows).probs(logits)
    for i, sp in enumerate(rows):
        assert torch.equal(batch[i], params_probs(logits[i:i + 1], sp)[0]), i
    assert not torch.equal(batch[0] > 0, batch[1] > 0)  # (the orders differ on this row set)
