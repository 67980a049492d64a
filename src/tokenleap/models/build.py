"""Turn a checkpoint's weights into a ready ``Transformer`` in the requested dtype."""
from __future__ import annotations

import torch

from tokenleap.config import ModelConfig
from tokenleap.errors import ModelFormatError
from tokenleap.models.changes import modules_changed
from tokenleap.models.linear import Linear
from tokenleap.models.transformer import Transformer


_WRAPPER_PREFIXES = ("model.language_model.", "language_model.model.")  # Gemma 3's multimodal checkpoints
_WRAPPER_DROPPED = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


def split_fused_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights under the names ``Transformer`` uses: Phi-3's fused ``qkv_proj`` / ``gate_up_proj``
    split into q/k/v and gate/up (row slices, values unchanged; ``fuse_projections_`` may join
    them again for the kernels); Gemma 3's multimodal names reduced to the text model's."""
    out: dict[str, torch.Tensor] = {}
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    for name, w in weights.items():
        if name.startswith(_WRAPPER_DROPPED):
            continue
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name[len(prefix):]
        if name == "language_model.lm_head.weight":
            name = "lm_head.weight"
        if ".self_attn.qkv_proj." in name:
            parts = w.split([q_rows, kv_rows, kv_rows])  # [q | k | v] rows
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[name.replace("qkv_proj", proj)] = part
        elif ".mlp.gate_up_proj." in name:
            gate, up = w.chunk(2)  # [gate | up] rows
            out[name.replace("gate_up_proj", "gate_proj")], out[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            out[name] = w
    return out


def check_layout(config: ModelConfig, shapes: dict[str, tuple[int, ...]], model: Transformer | None = None) -> None:
    """A ``ModelFormatError`` unless ``shapes`` (HF names, fused tensors split) are exactly the tensors
    of ``config``'s model, each of its shape (a tied LM head and rotary buffers aside). Cheap (the
    model is laid out on the meta device, or ``model`` is that layout already): a GGUF is checked so
    before its conversion is written."""
    if model is None:
        with torch.device("meta"):
            model = Transformer(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes = {k: tuple(v) for k, v in shapes.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        shapes.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise ModelFormatError(f"checkpoint does not match the {config.architecture} layout: "
                               f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ModelFormatError(f"tensor {name} has shape {shapes[name]}, expected {shape} by the model's "
                                   "config: the weights and the config (config.json, or a GGUF's metadata) disagree")


def build_transformer(config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> Transformer:
    """Create the model without allocating random weights, then adopt ``weights`` (HF names)."""
    weights = split_fused_weights(config, weights)
    with torch.device("meta"):
        model = Transformer(config)
    check_layout(config, {k: tuple(v.shape) for k, v in weights.items()}, model)
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    state = {k: v.to(dtype) for k, v in weights.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_rotary()
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def float32_activations_(model: Transformer) -> Transformer:
    """Keep the bf16 weight matrices but compute in float32: norms, biases (and so activations and
    the KV cache, which follow the norms' dtype) become float32. For CPUs without native bf16 math,
    where tokenleap's bf16 product converts each weight to float32 anyway: no casts between layers,
    and the layers can run as one compiled call each (``fused_layer``)."""
    for name, p in model.named_parameters():
        if p.dtype == torch.bfloat16 and (p.dim() == 1 or name.endswith("bias")):
            p.data = p.data.float()
    modules_changed()  # .data bypasses the modules' own tracking; the backend follows the new dtype
    return model


def pack_bf16_weights_(model: Transformer) -> int:
    """Pack every bf16 ``Linear`` into the kernel's layout now (so the packed copies can go on huge
    pages) and drop each float weight the packed copy replaces -- all but the LM head and weights
    shared with another module (a tied head is the embedding). Returns the layers released."""
    shared = {model.model.embed_tokens.weight.data_ptr()}
    released = 0
    for m in model.modules():
        if isinstance(m, Linear) and m.weight.dtype == torch.bfloat16 and m._bf16_kernel():
            if m is not model.lm_head and m.weight.data_ptr() not in shared:
                released += m.release_float_weight()
    return released
