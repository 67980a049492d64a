"""Our Transformer against Hugging Face transformers, and batch invariance of its rows."""
from __future__ import annotations

import pytest
import torch

from tokenleap.cache.contiguous import KVCache
from tokenleap.models.build import build_transformer
from tokenleap.models.transformer import Segment

from conftest import assert_block_rows_equal_steps, random_weights, tiny_config, tiny_model

transformers = pytest.importorskip("transformers")


def hf_model(cfg, weights):
    d = cfg.to_hf_dict()
    klass = transformers.Qwen2ForCausalLM if cfg.architecture == "qwen2" else transformers.LlamaForCausalLM
    conf = (transformers.Qwen2Config if cfg.architecture == "qwen2" else transformers.LlamaConfig)(**d)
    conf._attn_implementation = "eager"
    m = klass(conf).eval()
    missing, unexpected = m.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return m


def run(model, cache, slot, tokens, start, row_exact=False):
    seg = [Segment(slot=slot, pos_start=start, length=len(tokens))]
    return model(torch.tensor(tokens), seg, cache, row_exact=row_exact).logits


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", False), ("llama", True)])
def test_logits_match_transformers_prefill_decode_truncate(arch, tie):
    cfg = tiny_config(arch, tie=tie)
    weights = random_weights(cfg, seed=3)
    ours = build_transformer(cfg, weights, torch.float32)
    ref = hf_model(cfg, weights)
    ids = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]  # [12, vocab]
    cache = KVCache(cfg, num_slots=2, max_len=64, dtype=torch.float32)
    slot = cache.allocate()
    got = run(ours, cache, slot, ids[:8].tolist(), 0)
    torch.testing.assert_close(got, want[:8], rtol=1e-5, atol=1e-5)
    for t in range(8, 12):  # step by step with the cache
        torch.testing.assert_close(run(ours, cache, slot, [int(ids[t])], t)[0], want[t], rtol=1e-5, atol=1e-5)
    # roll back 3 positions and append different tokens
    cache.truncate(slot, 9)
    other = [5, 7, 11]
    got = run(ours, cache, slot, other, 9)
    with torch.no_grad():
        want2 = ref(torch.cat([ids[:9], torch.tensor(other)])[None]).logits[0, 9:]
    torch.testing.assert_close(got, want2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_step_equals_row_of_block_bitwise(dtype):
    model = tiny_model("qwen2", seed=5, dtype=dtype, hidden=128, intermediate=256)
    assert_block_rows_equal_steps(model, dtype)


def test_rows_do_not_depend_on_other_sequences_in_the_batch():
    model = tiny_model("llama", seed=9, hidden=128, intermediate=256)
    cfg = model.config
    cache = KVCache(cfg, 3, 64, torch.float32)
    s0, s1 = cache.allocate(), cache.allocate()
    run(model, cache, s0, [3, 4, 5, 6], 0)
    run(model, cache, s1, [9, 8, 7], 0)
    alone = run(model, cache, s0, [10, 11], 4, row_exact=True)
    cache.truncate(s0, 4)
    segs = [Segment(s1, 3, 3, row_start=0), Segment(s0, 4, 2, row_start=3)]
    out = model(torch.tensor([1, 2, 3, 10, 11]), segs, cache, row_exact=True).logits
    assert torch.equal(out[3:], alone)
