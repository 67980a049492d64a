"""Layer-skip speculation under continuous batching: drafts written into the shared paged cache
(inside the blocks the scheduler reserved for the step) leave every request's output equal to the
request run alone -- greedy and seeded, with and without preemption -- and every block given back."""
from __future__ import annotations

import pytest
import torch

from tokenleap.cache.paged import PagedKVCache
from tokenleap.config import SamplingParams
from tokenleap.serve.scheduler import Request, Scheduler, SchedulerConfig
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.layerskip import LayerSkipProposer

from serving_helpers import CHUNK, MAX_LEN, VOCAB, ChatToyTokenizer, alone, model, workload


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("blocks", [128, 10])
def test_layerskip_batched_outputs_equal_alone(sampled, blocks):
    cache = PagedKVCache(model().config, blocks, MAX_LEN, torch.float32, block_size=16, num_slots=16)
    eng = Engine(model(), ChatToyTokenizer(VOCAB), max_len=MAX_LEN, prefill_chunk=CHUNK, cache=cache,
                 proposer=LayerSkipProposer(model(), frozenset({1})), controller=ControllerConfig(max_k=4))
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=16, log_interval=0))
    jobs, sinks = [], []
    for i, (prompt, n) in enumerate(workload(12, seed=1)):
        extra = dict(temperature=0.8, top_p=0.95, seed=1000 + i) if sampled else {}
        params = SamplingParams(max_tokens=n, ignore_eos=True, **extra)
        sink = []
        sched.submit([Request(eng.create(prompt, params), sink.append)])
        jobs.append((prompt, params))
        sinks.append(sink)
    sched.run_until_idle()
    for (prompt, params), sink in zip(jobs, sinks):
        assert [t for o in sink for t in o.token_ids] == alone(prompt, params).generated, prompt
    assert (sched.stats.preemptions > 0) == (blocks == 10)
    assert eng.totals.draft_tokens > 0 and eng.cache.num_used_blocks == 0
