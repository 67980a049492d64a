"""What ``LLM``'s calls take, in the forms vLLM's users write: ``stream`` / ``astream`` with
``sampling_params=`` and a whole conversation under ``chat=True`` (the same reply as ``chat``), and
``SamplingParams``' ``logit_bias`` as None or with OpenAI's string keys."""
from __future__ import annotations

import asyncio

import pytest
import torch

from tokenleap.api import LLM
from tokenleap.config import ConfigError, SamplingParams, SpecConfig
from tokenleap.models.pretrained import LoadedModel

from serving_helpers import VOCAB, EncodeChatToy, model

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
CONVERSATION = [{"role": "system", "content": "abc"}, {"role": "user", "content": "cab"},
                {"role": "assistant", "content": "bca"}, {"role": "user", "content": [{"type": "text", "text": "a"}]}]


def make_llm() -> LLM:
    loaded = LoadedModel(model(1), EncodeChatToy(VOCAB), torch.float32, "none", "tiny", None)
    return LLM.from_loaded(loaded, SpecConfig(method="ngram"), max_model_len=96)


def test_stream_takes_a_conversation_and_sampling_params_by_vllms_name():
    llm = make_llm()
    want = llm.chat(CONVERSATION, PARAMS)[0]
    *_, last = llm.stream(CONVERSATION, chat=True, sampling_params=PARAMS)
    assert last.output.token_ids == want.token_ids and last.output.prompt == want.prompt_token_ids

    async def collect():
        return [chunk async for chunk in llm.astream(CONVERSATION, chat=True, sampling_params=PARAMS)]
    assert asyncio.run(collect())[-1].output.token_ids == want.token_ids
    with pytest.raises(ConfigError, match="a conversation, a list of messages, with chat=True"):
        list(llm.stream(CONVERSATION, PARAMS))
    with pytest.raises(ConfigError, match="not a message: give a conversation"):
        llm.generate(CONVERSATION, PARAMS, chat=True)
    with pytest.raises(ConfigError, match="not both"):
        list(llm.stream("abc", PARAMS, sampling_params=PARAMS))
    llm.close()


def test_logit_bias_as_none_or_with_string_keys():
    assert SamplingParams(logit_bias=None).logit_bias == ()
    assert SamplingParams(logit_bias={"12": 5, 3: -1}).logit_bias == ((3, -1), (12, 5))
    assert SamplingParams(logit_bias={"5": 100, 5: -100}).logit_bias == ((5, -100),)  # the last, as a dict keeps
    assert SamplingParams(logit_bias=[(3, 1), (1, 2)]) == SamplingParams(logit_bias={1: 2, 3: 1})
    for bad in ({"x": 1}, 5, {-1: 2}, {"²": 1}, {"１２": 1}, (1, 2), ((1,),), {"-1": 1}):
        with pytest.raises(ConfigError, match="logit_bias must map token ids"):
            SamplingParams(logit_bias=bad)
