"""Model classes by Hugging Face architecture name, and building one from a checkpoint's weights."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..errors import UnsupportedModel
from .llama import LlamaForCausalLM, RotaryEmbedding, pack_weights
from .packed_linear import pack_linears, packed_bytes

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def build_model(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device, batch_hint: int = 256
) -> LlamaForCausalLM:
    """`instantiate`, then on the device in the dtype; on the CPU the linear layers' weights are then packed for
    oneDNN (`packed_linear.py`)."""
    model = instantiate(cfg, weights)
    model.model.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if device.type == "cpu":
        pack_linears(model, batch_hint)
    return model


def instantiate(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """The model without random init (on the meta device), the checkpoint's tensors as its parameters."""
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.architecture](cfg)
    load_weights(model, weights)
    return model


def count_weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes the weights take: parameters (tied ones once) and packed copies."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) + packed_bytes(model)


def load_weights(model: LlamaForCausalLM, weights: dict[str, torch.Tensor]) -> None:
    """Replace every parameter; a checkpoint whose names or shapes differ is refused and nothing changes."""
    cfg = model.config
    packed = pack_weights(weights, cfg)
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in weights
    if tied:
        packed.pop("lm_head.weight", None)
    expected = {k: p.shape for k, p in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    missing = sorted(expected.keys() - packed.keys())
    unexpected = sorted(packed.keys() - expected.keys())
    wrong = sorted(k for k in expected.keys() & packed.keys() if packed[k].shape != expected[k])
    if missing or unexpected or wrong:
        raise UnsupportedModel(
            f"checkpoint does not fit {cfg.architecture}: missing {missing[:3]}, unexpected {unexpected[:3]}, "
            f"wrong shape {[(k, tuple(packed[k].shape), tuple(expected[k])) for k in wrong[:3]]}"
        )
    ref = next(model.parameters())
    if ref.device.type != "meta":
        packed = {k: v.to(device=ref.device, dtype=ref.dtype) for k, v in packed.items()}
    model.load_state_dict(packed, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
