"""A model whose weights are damaged (a NaN or an infinity reaching the logits) stops with a
``ModelFormatError`` that says so, greedy or sampled, prefill or decoding step -- not token 0 read
from a NaN row, nor an IndexError from a sampler fed NaN, nor NaN logprobs."""
from __future__ import annotations

import pytest
import torch

from tokenleap.config import SamplingParams
from tokenleap.errors import ModelFormatError
from tokenleap.models.build import build_transformer
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.ngram import NgramProposer
from tokenleap.spec.step_verify import check_finite

from conftest import random_weights, tiny_config
from serving_helpers import VOCAB, ChatToyTokenizer


def damaged(value: float, where: str = "model.norm.weight"):
    cfg = tiny_config("llama", vocab=VOCAB)
    weights = random_weights(cfg, 3)
    weights[where] = weights[where].clone()
    weights[where][5] = value
    return build_transformer(cfg, weights, torch.float32)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, temperature=0.8),
                                    SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=2)])
def test_damaged_weights_stop_with_a_clear_error(value, params):
    eng = Engine(damaged(value), ChatToyTokenizer(VOCAB), max_len=64, proposer=NgramProposer(3, 1))
    with pytest.raises(ModelFormatError, match="NaN or infinite logits"):
        list(eng.generate([3, 4, 5, 3, 4, 5, 3, 4], params))


@pytest.mark.parametrize("proposer", [None, NgramProposer(3, 1)])
def test_a_damaged_row_met_only_while_decoding_stops_at_that_step(proposer):
    """The embedding row of the first token generated is NaN: the prefill is sound, the step that reads
    the token back is not."""
    prompt, params = [3, 4, 5, 3, 4, 5, 3, 4], SamplingParams(max_tokens=6)
    cfg = tiny_config("llama", vocab=VOCAB)
    weights = random_weights(cfg, 3)
    *_, (seq, _) = Engine(build_transformer(cfg, weights, torch.float32), ChatToyTokenizer(VOCAB),
                          max_len=64).generate(prompt, params)
    first = seq.generated[0]
    assert first not in prompt
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    weights["model.embed_tokens.weight"][first] = float("nan")
    eng = Engine(build_transformer(cfg, weights, torch.float32), ChatToyTokenizer(VOCAB), max_len=64,
                 proposer=proposer)
    steps = eng.generate(prompt, params)
    seq, _ = next(steps)  # the prefill's token
    assert seq.generated == [first]
    with pytest.raises(ModelFormatError, match="NaN or infinite logits"):
        list(steps)


def test_the_check_reads_only_a_rows_maximum():
    check_finite(torch.tensor([[0.0, -float("inf"), 2.0], [1.0, 1.0, 1.0]]))  # a masked entry is fine
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ModelFormatError):
            check_finite(torch.tensor([[0.0, 1.0, 2.0], [1.0, bad, 1.0]]))
