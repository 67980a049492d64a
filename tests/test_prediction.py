"""OpenAI's Predicted Outputs (``SamplingParams.prediction``): the lookup drafters propose from the
predicted text too, so a reply that follows it is verified many tokens a step -- and the output is
plain decoding's whatever the prediction (a right one, a wrong one), for every proposer that looks
text up: n-gram, the cascade's guesses, ``--spec auto``'s n-gram arm."""
from __future__ import annotations

import pytest
import torch

from tokenleap.config import ConfigError, SamplingParams
from tokenleap.spec.bandit import BanditConfig
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.auto import AutoProposer
from tokenleap.spec.proposers.cascade import CascadeDraftProposer
from tokenleap.spec.proposers.draft_model import DraftModelProposer
from tokenleap.spec.proposers.ngram import NgramProposer

from conftest import ToyTokenizer, tiny_model

VOCAB = 96
PROMPT = [5, 9, 14, 3, 7, 21, 30, 4]


@pytest.fixture(scope="module")
def models():
    return (tiny_model("qwen2", seed=1, vocab=VOCAB, hidden=64, intermediate=128, layers=2),
            tiny_model("qwen2", seed=78, vocab=VOCAB))


def run(target, proposer, params):
    eng = Engine(target, ToyTokenizer(VOCAB, (2,)), max_len=160, proposer=proposer,
                 controller=ControllerConfig(max_k=6, fixed_k=6 if proposer is not None else None))
    *_, (seq, _) = eng.generate(PROMPT, params)
    return seq


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=60, ignore_eos=True),
                                    SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.8, seed=5)],
                         ids=["greedy", "seeded"])
def test_a_prediction_changes_what_is_drafted_not_the_output(models, params):
    target, draft = models
    plain = run(target, None, params).generated
    wrong = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    half = plain[:25] + wrong[:10] + plain[35:]  # a prediction the reply leaves and comes back to
    for prediction in (plain, wrong, half):
        predicted = SamplingParams(**{**params.__dict__, "prediction": tuple(prediction)})
        for proposer in (NgramProposer(4, 2), CascadeDraftProposer(draft, VOCAB, 160),
                         AutoProposer({"draft": DraftModelProposer(draft, VOCAB, 160), "ngram": NgramProposer(4, 2)},
                                      BanditConfig(max_k=6))):
            assert run(target, proposer, predicted).generated == plain, (proposer.name, prediction[:5])


def test_a_right_prediction_is_accepted_many_tokens_a_step(models):
    target, _ = models
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    plain = run(target, None, params).generated
    without = run(target, NgramProposer(4, 2), params)
    with_it = run(target, NgramProposer(4, 2), SamplingParams(max_tokens=60, ignore_eos=True, prediction=tuple(plain)))
    assert with_it.generated == plain
    # the first two tokens have no match yet; from there every step drafts the prediction's next 6, all kept
    assert with_it.stats.target_forwards <= 12 and with_it.stats.accepted_tokens >= 45
    assert without.stats.accepted_tokens + 20 < with_it.stats.accepted_tokens
    half = plain[:30] + [(t + 1) % VOCAB for t in plain[30:40]] + plain[40:]
    partly = run(target, NgramProposer(4, 2), SamplingParams(max_tokens=60, ignore_eos=True, prediction=tuple(half)))
    assert partly.generated == plain and without.stats.accepted_tokens < partly.stats.accepted_tokens


def test_prediction_must_be_token_ids():
    with pytest.raises(ConfigError, match="prediction"):
        SamplingParams(prediction=(1, -2))


def test_the_server_takes_openais_prediction_and_counts_its_tokens():
    import openai
    from tokenleap.serve.app import ServerConfig, create_app
    from tokenleap.serve.responses import prediction_tokens_kept
    from tokenleap.serve.scheduler import SchedulerConfig
    from serving_helpers import VOCAB as SERVE_VOCAB, ChatToyTokenizer, LiveServer, alone, paged_engine

    tok = ChatToyTokenizer(SERVE_VOCAB)
    messages = [{"role": "user", "content": "rewrite this"}]
    generated = alone(tok.encode(tok.apply_chat_template(messages)),
                      SamplingParams(max_tokens=40, ignore_eos=True)).generated
    config = ServerConfig(model_name="m", scheduler=SchedulerConfig(log_interval=0))
    with LiveServer(create_app(paged_engine("ngram"), config)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        kw = dict(model="m", messages=messages, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
        plain = c.chat.completions.create(**kw)
        text = plain.choices[0].message.content
        assert plain.usage.completion_tokens_details is None  # (no prediction: no prediction counts)
        for prediction in (text, [{"type": "text", "text": text[:30]}, {"type": "text", "text": text[30:]}], "zzzz"):
            r = c.chat.completions.create(**kw, prediction={"type": "content", "content": prediction})
            assert r.choices[0].message.content == text
            ids = tok.encode(prediction if isinstance(prediction, str) else text)
            details = r.usage.completion_tokens_details
            kept = prediction_tokens_kept(tuple(ids), generated)
            assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (kept, len(ids) - kept)
        assert prediction_tokens_kept((1, 2, 3, 9, 4), [1, 2, 7, 3, 4]) == 4  # in order, what the reply holds
        with pytest.raises(openai.BadRequestError):  # a prediction of another type is refused
            c.chat.completions.create(**kw, prediction={"type": "image", "content": "x"})
