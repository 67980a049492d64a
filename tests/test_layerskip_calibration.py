"""``--skip-layers auto``'s calibration on short texts: a text shorter than the verification it times, and
requests too short to choose layers by (which decode plainly until they are long enough)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from tokenleap.config import SamplingParams
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers import layerskip_search as ls
from tokenleap.spec.proposers.layerskip import CALIBRATION_MIN_TOKENS, layerskip_proposer

from conftest import ToyTokenizer
from test_layerskip import VOCAB, _engine, _generate, _model


def test_the_search_times_a_verification_longer_than_its_text():
    """A two-token text and a verification of max_k + 1 = 4 rows: the rows are timed all the same."""
    cfg = ls.SearchConfig(window=16, context=32, max_k=3, timing_repeats=1, min_agreement=0.0, patience=10)
    cal = ls.search(_model("int8"), [[5, 9]], cfg)
    assert set(cal.skip) < set(range(4)) and cal.positions == 1


def test_skip_auto_calibrates_once_a_request_is_long_enough_and_decodes_plainly_before(tmp_path):
    model = _model("int8")
    loaded = SimpleNamespace(model=model, tokenizer=ToyTokenizer(VOCAB, (2,)), source=str(tmp_path / "tiny"),
                             gguf_path=None, dtype=torch.float32, quant="int8")
    prompt = [11, 12, 11, 13]
    short, longer = (SamplingParams(max_tokens=n, ignore_eos=True) for n in (8, 40))
    logs: list[str] = []
    proposer = layerskip_proposer(loaded, "auto", tmp_path, log=logs.append)
    eng = Engine(model, ToyTokenizer(VOCAB, (2,)), max_len=64, proposer=proposer,
                 controller=ControllerConfig(max_k=4, fixed_k=3))
    assert len(prompt) + short.max_tokens < CALIBRATION_MIN_TOKENS <= len(prompt) + longer.max_tokens
    seq = _generate(eng, prompt, short)
    assert seq.generated == _generate(_engine(model, None), prompt, short).generated
    assert proposer.skip is None and not logs and seq.stats.draft_tokens == 0  # plain steps, nothing stored
    seq = _generate(eng, prompt, longer)
    assert seq.generated == _generate(_engine(model, None), prompt, longer).generated
    assert proposer.skip is not None and len(logs) == 1 and seq.stats.draft_tokens > 0
    assert list((tmp_path / "layerskip").glob("*.json"))
