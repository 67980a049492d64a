"""Layer-skip speculation under continuous batching: drafts written into the shared paged cache
(inside the blocks the scheduler reserved for the step) leave every request's output equal to the
request run alone -- greedy and seeded, with and without preemption -- and every block given back."""
from __future__ import annotations

import pytest
import torch

from tokenleap.cache.paged import PagedKVCache
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.layerskip import LayerSkipProposer

from serving_helpers import CHUNK, MAX_LEN, VOCAB, ChatToyTokenizer, model, serve_workload_equals_alone


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("blocks", [128, 10])
def test_layerskip_batched_outputs_equal_alone(sampled, blocks):
    cache = PagedKVCache(model().config, blocks, MAX_LEN, torch.float32, block_size=16, num_slots=16)
    eng = Engine(model(), ChatToyTokenizer(VOCAB), max_len=MAX_LEN, prefill_chunk=CHUNK, cache=cache,
                 proposer=LayerSkipProposer(model(), frozenset({1})), controller=ControllerConfig(max_k=4))
    sched = serve_workload_equals_alone(eng, sampled)
    assert (sched.stats.preemptions > 0) == (blocks == 10)
    assert eng.totals.draft_tokens > 0 and eng.cache.num_used_blocks == 0
