"""Every supported family against transformers: tiny random models built by transformers from a
config (offline), saved as safetensors directories and loaded by tokenleap; logits, greedy output,
the bitwise one-row-vs-block rule, lossless speculation, sliding windows in both caches, RoPE
scaling. GGUF files of the same models are in test_architectures_gguf.py."""
from __future__ import annotations

import json

import pytest
import torch

from tokenleap.cache.contiguous import KVCache
from tokenleap.config import ConfigError, ModelConfig, SamplingParams
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.errors import ModelFormatError
from tokenleap.models.build import build_transformer
from tokenleap.models.checkpoint import load_checkpoint
from tokenleap.models.transformer import Segment
from tokenleap.cache.paged import PagedKVCache
from tokenleap.spec.proposers.draft_model import DraftModelProposer
from tokenleap.spec.proposers.ngram import NgramProposer

from conftest import ToyTokenizer

transformers = pytest.importorskip("transformers")

VOCAB, WINDOW = 96, 8
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, tie_word_embeddings=False)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
SPECS = {  # name -> (config class name, overrides)
    "llama": ("LlamaConfig", {}),
    "llama3.1": ("LlamaConfig", {"rope_scaling": LLAMA3, "rope_theta": 500000.0}),
    "llama-linear": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama-dynamic": ("LlamaConfig", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "llama-yarn": ("LlamaConfig", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32}}),
    "llama-hd12": ("LlamaConfig", {"head_dim": 12}),  # a head size the compiled attention does not take
    "llama-bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),  # o_proj and the MLP's too
    "qwen3-bias": ("Qwen3Config", {"attention_bias": True}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}),
    "phi3": ("Phi3Config", {}),
    "gemma3": ("Gemma3TextConfig", {"num_hidden_layers": 3, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
                                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                    "tie_word_embeddings": True}),
    "gemma3-linear": ("Gemma3TextConfig", {"sliding_window": WINDOW, "tie_word_embeddings": True,
                                           "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                           "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma3-softcap": ("Gemma3TextConfig", {"sliding_window": WINDOW, "final_logit_softcapping": 3.0,
                                            "attn_logit_softcapping": 2.0, "tie_word_embeddings": True,
                                            "layer_types": ["sliding_attention", "full_attention"]}),
}
PROMPT = [5, 9, 14, 3, 7, 9, 14, 3, 40, 41, 42, 5, 9, 14, 3, 7, 60, 61, 62, 63]  # 20 > WINDOW


def hf_model(name: str, seed: int = 0, spec: tuple[str, dict] | None = None):
    """A seeded random transformers model (float32, eager attention) with weights large enough that
    every part of the layer matters: norms away from their identity value, projections ~0.1.
    ``spec`` (config class name, overrides) replaces ``SPECS[name]``."""
    klass, over = spec or SPECS[name]
    cfg = getattr(transformers, klass)(**(BASE | over))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    gemma = klass.startswith("Gemma")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if pname.endswith("norm.weight"):
                p.copy_((0.0 if gemma else 1.0) + 0.2 * noise)
            else:
                p.copy_(0.12 * noise)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (transformers model, tokenleap model loaded from its saved safetensors directory)."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            ref = hf_model(name)
            d = tmp_path_factory.mktemp(name)
            ref.save_pretrained(d)
            ck = load_checkpoint(d, torch.float32)
            cache[name] = (ref, build_transformer(ck.config, ck.weights, torch.float32), d)
        return cache[name]

    return get


def run(model, cache, slot, tokens, start, row_exact=False):
    seg = [Segment(slot=slot, pos_start=start, length=len(tokens))]
    return model(torch.tensor(tokens), seg, cache, row_exact=row_exact).logits


def make_cache(kind: str, cfg: ModelConfig, max_len: int = 64, dtype: torch.dtype = torch.float32):
    if kind == "paged":
        return PagedKVCache(cfg, 40, max_len, dtype, block_size=4, num_slots=3)
    return KVCache(cfg, 3, max_len, dtype)


def engine(model, proposer=None, cache=None):
    return Engine(model, ToyTokenizer(VOCAB, (2,)), max_len=64, proposer=proposer, cache=cache,
                  controller=ControllerConfig(max_k=4, fixed_k=None if proposer is None else 3))


def generate(eng, prompt, n):
    """n greedy tokens; EOS is masked until then, as transformers' min_new_tokens does."""
    *_, (seq, _) = eng.generate(prompt, SamplingParams(max_tokens=n, min_tokens=n))
    return seq.generated


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
@pytest.mark.parametrize("name", list(SPECS))
def test_logits_match_transformers(saved, name, cache_kind):
    ref, ours, _ = saved(name)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]  # [20, vocab]
    cache = make_cache(cache_kind, ours.config)
    slot = cache.allocate()
    got = run(ours, cache, slot, PROMPT[:12], 0)  # prefill: all rows at once
    torch.testing.assert_close(got, want[:12], rtol=1e-4, atol=1e-4)
    got = run(ours, cache, slot, PROMPT[12:15], 12, row_exact=True)  # a verification block
    torch.testing.assert_close(got, want[12:15], rtol=1e-4, atol=1e-4)
    for t in range(15, len(PROMPT)):  # decode, past the window
        torch.testing.assert_close(run(ours, cache, slot, [PROMPT[t]], t)[0], want[t], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["llama3.1", "qwen3", "mistral", "phi3", "gemma3"])
def test_greedy_output_equals_transformers_generate(saved, name):
    ref, ours, _ = saved(name)
    n = 24  # prompt + output well past the sliding window
    with torch.no_grad():
        out = ref.generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
    want = out[0, len(PROMPT):].tolist()
    assert generate(engine(ours), PROMPT, n) == want
    cache = PagedKVCache(ours.config, 40, 64, torch.float32, block_size=4, num_slots=2)
    assert generate(engine(ours, cache=cache), PROMPT, n) == want


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
@pytest.mark.parametrize("name", ["llama3.1", "qwen3", "mistral", "phi3", "gemma3", "gemma3-softcap"])
def test_one_row_equals_row_of_block_bitwise(saved, name, cache_kind):
    _, ours, _ = saved(name)
    cache = make_cache(cache_kind, ours.config)
    prompt, block = PROMPT[:13], [21, 22, 23, 24, 25]
    a = cache.allocate()
    run(ours, cache, a, prompt, 0)
    block_logits = run(ours, cache, a, block, len(prompt), row_exact=True)
    b = cache.allocate()
    run(ours, cache, b, prompt, 0)
    for i, tok in enumerate(block):
        step = run(ours, cache, b, [tok], len(prompt) + i, row_exact=True)
        assert torch.equal(step[0], block_logits[i]), f"row {i} differs"


@pytest.mark.parametrize("name", ["llama3.1", "qwen3", "mistral", "phi3", "gemma3"])
def test_speculation_is_lossless(saved, name):
    _, ours, _ = saved(name)
    want = generate(engine(ours), PROMPT, 30)
    assert generate(engine(ours, NgramProposer(3, 1)), PROMPT, 30) == want
    assert generate(engine(ours, DraftModelProposer(ours, VOCAB, 64)), PROMPT, 30) == want
    paged = PagedKVCache(ours.config, 40, 64, torch.float32, block_size=4, num_slots=2)
    assert generate(engine(ours, NgramProposer(3, 1), cache=paged), PROMPT, 30) == want


def test_sliding_window_changes_the_output(saved):
    """The window test can fail: without the window the same weights give different logits."""
    ref, ours, d = saved("mistral")
    raw = json.loads((d / "config.json").read_text())
    raw["sliding_window"] = None
    wide = build_transformer(ModelConfig.from_hf_dict(raw), load_checkpoint(d, torch.float32).weights, torch.float32)
    cache = KVCache(ours.config, 1, 64, torch.float32)
    windowed = run(ours, cache, cache.allocate(), PROMPT, 0)
    cache = KVCache(wide.config, 1, 64, torch.float32)
    full = run(wide, cache, cache.allocate(), PROMPT, 0)
    torch.testing.assert_close(windowed[:WINDOW], full[:WINDOW], rtol=1e-5, atol=1e-5)  # no effect before
    assert (windowed[WINDOW:] - full[WINDOW:]).abs().max() > 1e-2


def test_llama3_rope_scaling_is_applied(saved):
    """The bug issue 21 leads with: a Llama 3.1 config's rope_scaling used to be ignored."""
    _, ours, d = saved("llama3.1")
    cfg = ours.config
    assert cfg.rope_scaling_dict["rope_type"] == "llama3" and cfg.rope_scaling_dict["factor"] == 8.0
    raw = json.loads((d / "config.json").read_text())
    raw.pop("rope_scaling", None)
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    plain = build_transformer(ModelConfig.from_hf_dict(raw), load_checkpoint(d, torch.float32).weights,
                              torch.float32)
    assert not torch.equal(plain.rotary.cos, ours.rotary.cos)
    got = [run(m, KVCache(cfg, 1, 64, torch.float32), 0, PROMPT, 0) for m in (ours, plain)]
    assert (got[0] - got[1]).abs().max() > 1e-3


def test_a_rope_scaling_added_beside_rope_parameters_is_applied(saved):
    """A transformers 5 config holds ``rope_parameters``; a model card's recipe adds ``rope_scaling``
    beside it, which transformers reads in their place (the base frequency kept); longrope is refused."""
    _, _, d = saved("llama3.1")
    raw = json.loads((d / "config.json").read_text())
    raw.pop("rope_scaling", None)
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    cfg = ModelConfig.from_hf_dict({**raw, "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert cfg.rope_scaling_dict == {"rope_type": "linear", "factor": 4.0} and cfg.rope_theta == 500000.0
    assert ModelConfig.from_hf_dict({**raw, "rope_scaling": None}).rope_scaling == ()
    with pytest.raises(ConfigError, match="longrope"):
        ModelConfig.from_hf_dict({**raw, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0],
                                                          "long_factor": [1.0]}})


def test_rope_scaling_extends_the_context_as_vllm_derives_it(saved):
    """Linear and dynamic scaling multiply max_position_embeddings (128 here), YaRN its original
    positions (32 x 4); Llama 3's and Gemma 3's already count theirs. Past 128 positions the linear
    model's logits are still transformers' (which sets no limit)."""
    contexts = {name: saved(name)[1].config.max_context for name in ("llama-linear", "llama-dynamic", "llama-yarn",
                                                                     "llama3.1", "gemma3-linear", "llama")}
    assert contexts == {"llama-linear": 512, "llama-dynamic": 256, "llama-yarn": 128, "llama3.1": 128,
                        "gemma3-linear": 128, "llama": 128}
    ref, ours, _ = saved("llama-linear")
    eng = Engine(ours, ToyTokenizer(VOCAB, (2,)), max_len=400)
    assert eng.max_len == 400
    prompt = (PROMPT * 10)[:180]
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0]  # [180, vocab]
    cache = KVCache(ours.config, 1, 400, torch.float32)
    torch.testing.assert_close(run(ours, cache, cache.allocate(), prompt, 0), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["llama3.1", "llama-linear", "llama-yarn", "llama-dynamic", "gemma3", "gemma3-linear"])
def test_rope_tables_equal_transformers(saved, name):
    ref, ours, _ = saved(name)
    pos = torch.arange(100)[None]
    x = torch.zeros(1, 100, 16)
    rot = ref.model.rotary_emb
    if name.startswith("gemma"):
        cos, sin = rot(x, pos, layer_type="full_attention")
        lcos, lsin = rot(x, pos, layer_type="sliding_attention")
        torch.testing.assert_close(ours.rotary_local.cos[:100], lcos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.rotary_local.sin[:100], lsin[0], rtol=0, atol=1e-6)
    else:
        cos, sin = rot(x, pos)
    torch.testing.assert_close(ours.rotary.cos[:100], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.rotary.sin[:100], sin[0], rtol=0, atol=1e-6)


def test_dynamic_rope_past_the_original_length_is_per_position():
    """NTK scaling past max_position_embeddings: position p uses the base of a length-(p + 1) sequence,
    what transformers computes decoding token by token; a row's table never depends on the block."""
    cfg = ModelConfig.from_hf_dict(BASE | {"model_type": "llama", "max_position_embeddings": 32,
                                           "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    ref_cfg = transformers.LlamaConfig(**(BASE | {"max_position_embeddings": 32,
                                                  "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}))
    from tokenleap.models.rope import rotaries
    rot = rotaries(cfg)[0]
    assert rot.cos.shape[0] == 64
    hf_rot = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(ref_cfg)
    for p in (0, 31, 32, 45, 63):  # one-token steps, as transformers decodes
        cos, sin = hf_rot(torch.zeros(1, 1, 16), torch.tensor([[p]]))
        torch.testing.assert_close(rot.cos[p], cos[0, 0], rtol=0, atol=2e-6)
        torch.testing.assert_close(rot.sin[p], sin[0, 0], rtol=0, atol=2e-6)


@pytest.mark.parametrize("scaling", [{"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                      "original_max_position_embeddings": 32},
                                     {"type": "mrope", "mrope_section": [2, 3, 3]}, {"rope_type": "su", "factor": 2}])
def test_unsupported_rope_scaling_is_refused_from_hf(tmp_path, scaling):
    raw = BASE | {"model_type": "llama", "rope_scaling": scaling}
    with pytest.raises(ConfigError, match="not supported"):
        ModelConfig.from_hf_dict(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelFormatError, match="rope scaling .* not supported"):
        load_checkpoint(tmp_path, torch.float32)


def test_config_round_trips_through_hf_dict(saved):
    for name in SPECS:
        cfg = saved(name)[1].config
        assert ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg, name
    gemma = saved("gemma3")[1].config
    assert (gemma.architecture, gemma.sliding_window, gemma.rope_local_base_freq) == ("gemma3", WINDOW, 10000.0)
    assert [gemma.is_sliding(i) for i in range(3)] == [True, False, True] and gemma.rope_theta == 1e6
    assert saved("mistral")[1].config.is_sliding(1) and not saved("qwen3")[1].config.is_sliding(0)


def test_gemma3_multimodal_wrapper_config_reads_its_text_config():
    text = transformers.Gemma3TextConfig(**(BASE | SPECS["gemma3"][1])).to_dict()
    cfg = ModelConfig.from_hf_dict({"model_type": "gemma3", "text_config": text, "eos_token_id": [1, 106]})
    assert cfg.architecture == "gemma3" and cfg.num_hidden_layers == 3 and cfg.query_pre_attn_scalar == 24
    # a published 4B config: its text_config names only what differs from Gemma3TextConfig's defaults,
    # which transformers fills in (vocabulary, heads, head size, ...)
    sparse = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
              "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
    cfg = ModelConfig.from_hf_dict({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                                    "eos_token_id": [1, 106], "text_config": sparse})
    full = transformers.Gemma3TextConfig(**{k: v for k, v in sparse.items() if k != "model_type"})
    assert (cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size,
            cfg.query_pre_attn_scalar, cfg.max_position_embeddings, cfg.eos_token_ids) == (
        full.vocab_size, full.num_attention_heads, full.num_key_value_heads, full.head_dim, 2560,
        full.query_pre_attn_scalar, full.max_position_embeddings, (1, 106))
    assert cfg.vocab_size == 262_208 and cfg.num_attention_heads == 8  # (not taken from the test's reference only)


def test_fast_paths_kept_for_plain_layers_declined_for_others(saved):
    from tokenleap.models.fused_layer import layer_plan

    for name, plain in (("llama3.1", True), ("phi3", True), ("qwen3", False), ("mistral", False),
                        ("gemma3", False)):
        blocks = saved(name)[1].model.layers
        assert all(b.plain == plain for b in blocks), name
        if not plain:
            assert all(layer_plan(b) is None for b in blocks), name


def _variant(d, mode: str):
    """The saved model loaded as the CLI would for ``mode``: int8 / int4 weights, or bf16 weights with
    float32 activations (``--dtype bfloat16`` on a CPU without native bf16 math)."""
    from tokenleap.models.build import float32_activations_
    from tokenleap.models.quant import fuse_projections_, quantize_

    ck = load_checkpoint(d, torch.float32)
    if mode == "bf16":
        return float32_activations_(build_transformer(ck.config, ck.weights, torch.bfloat16))
    if mode == "bf16-native":  # bf16 activations too (CPUs with native bf16 math)
        return build_transformer(ck.config, ck.weights, torch.bfloat16)
    model = build_transformer(ck.config, ck.weights, torch.float32)
    quantize_(model, mode)
    fuse_projections_(model)
    return model


@pytest.mark.parametrize("mode", ["int8", "int4", "bf16", "bf16-native"])
@pytest.mark.parametrize("name", ["qwen3", "mistral", "gemma3", "llama-bias"])
def test_quantized_and_bf16_models_keep_rows_exact(saved, name, mode):
    model = _variant(saved(name)[2], mode)
    ref = saved(name)[1]
    cache, ref_cache = make_cache("paged", model.config, dtype=model.dtype), make_cache("paged", ref.config)
    got, want = run(model, cache, cache.allocate(), PROMPT, 0), run(ref, ref_cache, ref_cache.allocate(), PROMPT, 0)
    bound = 0.35 if mode == "int4" else 0.1  # (int4's error on random weights is large)
    assert ((got.float() - want).norm() / want.norm()).item() < bound  # the float model's (biases included)
    for kind in ("contiguous", "paged"):
        cache = make_cache(kind, model.config, dtype=model.dtype)
        a, b = cache.allocate(), cache.allocate()
        run(model, cache, a, PROMPT[:13], 0)
        block = run(model, cache, a, [21, 22, 23, 24, 25], 13, row_exact=True)
        run(model, cache, b, PROMPT[:13], 0)
        for i, tok in enumerate([21, 22, 23, 24, 25]):
            assert torch.equal(run(model, cache, b, [tok], 13 + i, row_exact=True)[0], block[i]), (kind, i)
    want = generate(engine(model), PROMPT, 24)
    assert generate(engine(model, NgramProposer(3, 1)), PROMPT, 24) == want


def test_multimodal_gemma3_weight_names_are_reduced_to_the_text_model():
    from tokenleap.models.build import split_fused_weights

    cfg = ModelConfig.from_hf_dict(BASE | {"model_type": "gemma3_text"})
    w = torch.zeros(2)
    out = split_fused_weights(cfg, {"model.language_model.layers.0.input_layernorm.weight": w,
                                    "language_model.model.norm.weight": w, "language_model.lm_head.weight": w,
                                    "model.vision_tower.encoder.x.weight": w, "multi_modal_projector.y": w})
    assert set(out) == {"model.layers.0.input_layernorm.weight", "model.norm.weight", "lm_head.weight"}


LEGACY = {  # config.json files as the hub ships them (transformers 4 format), shapes shrunk
    "llama3.2": {"model_type": "llama", "rope_theta": 500000.0, "rope_scaling": {
        "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 32,
        "rope_type": "llama3"}, "tie_word_embeddings": True},
    "gemma3-270m": {"model_type": "gemma3_text", "attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
                    "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0,
                    "sliding_window": 8, "_sliding_window_pattern": 6, "num_hidden_layers": 6,
                    "use_bidirectional_attention": False, "layer_types": None},
    "gemma3-4b-text": {"model_type": "gemma3_text", "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                       "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 8},
    "phi3-mini-4k": {"model_type": "phi3", "rope_scaling": None, "sliding_window": 2047,
                     "original_max_position_embeddings": 128},
    "qwen3": {"model_type": "qwen3", "rope_scaling": None, "use_sliding_window": False, "sliding_window": None,
              "max_window_layers": 28},
}


@pytest.mark.parametrize("name", list(LEGACY))
def test_hub_style_configs_read_as_transformers_reads_them(name):
    raw = BASE | {"max_position_embeddings": 128} | LEGACY[name]
    cfg = ModelConfig.from_hf_dict(raw)
    ref = transformers.AutoConfig.for_model(**raw)
    glob = ref.rope_parameters.get("full_attention", ref.rope_parameters)
    assert cfg.rope_theta == glob["rope_theta"]
    assert cfg.rope_scaling_dict.get("rope_type", "default") == glob["rope_type"]
    assert cfg.rope_scaling_dict.get("factor") == glob.get("factor")
    assert cfg.sliding_window == getattr(ref, "sliding_window", None)
    types = getattr(ref, "layer_types", None)
    if cfg.sliding_window is not None and types:
        assert [cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)] == [t == "sliding_attention" for t in types]
    if name.startswith("gemma3"):
        assert cfg.rope_local_base_freq == ref.rope_parameters["sliding_attention"]["rope_theta"]
        assert cfg.query_pre_attn_scalar == ref.query_pre_attn_scalar


def _logits_of_dir(d):
    ck = load_checkpoint(d, torch.float32)
    ours = build_transformer(ck.config, ck.weights, torch.float32)
    cache = KVCache(ours.config, 1, 64, torch.float32)
    return ours, run(ours, cache, cache.allocate(), PROMPT, 0)


def test_a_tied_config_beside_a_stored_head_of_its_own_uses_that_head(tmp_path):
    """A config.json left saying ``tie_word_embeddings`` over a checkpoint whose lm_head differs from
    the embeddings (a merge's or fine-tune's): transformers keeps the stored head, and so does tokenleap."""
    hf_model("llama").save_pretrained(tmp_path)  # (untied: lm_head random, not the embeddings)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"tie_word_embeddings": True}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]  # [20, vocab]
    ours, got = _logits_of_dir(tmp_path)
    assert not ours.config.tie_word_embeddings
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("klass,over", [("MistralConfig", {"attention_bias": True, "sliding_window": WINDOW}),
                                        ("Phi3Config", {"attention_bias": True}),
                                        ("Qwen2Config", {"attention_bias": False})])
def test_attention_bias_is_what_the_family_fixes_not_the_config_field(tmp_path, klass, over):
    """transformers gives Qwen2's q/k/v a bias and Mistral's / Phi-3's none, whatever
    ``attention_bias`` says; a checkpoint saved that way loads and computes the same here."""
    ref = hf_model("", spec=(klass, over))
    ref.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["attention_bias"] == over["attention_bias"]
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]  # [20, vocab]
    torch.testing.assert_close(_logits_of_dir(tmp_path)[1], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type,scaling,match", [
    ("phi3", {"rope_type": "linear", "factor": 2.0}, "Phi-3"),
    ("phi3", {"type": "yarn", "factor": 2.0}, "Phi-3"),
    ("llama", {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32}, "low_freq_factor"),
])
def test_rope_scaling_transformers_refuses_is_refused(model_type, scaling, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict(BASE | {"model_type": model_type, "rope_scaling": scaling})


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3_text"])
def test_fields_a_config_leaves_out_take_transformers_defaults(model_type):
    raw = {"model_type": model_type, "vocab_size": VOCAB, "hidden_size": 512, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 32, "head_dim": 16}  # (Qwen2's default: 32 KV heads)
    cfg, ref = ModelConfig.from_hf_dict(raw), transformers.AutoConfig.for_model(**raw)
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.num_key_value_heads, cfg.sliding_window) == (
        ref.max_position_embeddings, ref.rms_norm_eps, ref.num_key_value_heads, getattr(ref, "sliding_window", None))
