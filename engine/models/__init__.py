"""Model classes by Hugging Face architecture name, and building one from a checkpoint's weights."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import cast

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import UnsupportedModel
from .fused_decode import FusedDecode
from .llama import LlamaForCausalLM, RotaryEmbedding, hf_weight_shapes, pack_weights
from .packed_linear import PackedLinear
from .panel_linear import PanelLinear, cpu_linears
from .quantized_linear import GGUFBlocks, GGUFStack, QuantizedEmbedding, QuantizedLinear

log = logging.getLogger(__name__)

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def build_model(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor | GGUFBlocks],
    dtype: torch.dtype,
    device: torch.device,
    batch_hint: int = 256,
    quantized: bool = False,
    int8_activations: bool = False,
    private: bool = False,
) -> LlamaForCausalLM:
    """`instantiate`, then on the device in the dtype; on the CPU each linear layer then runs the fastest way
    the machine has (`panel_linear.cpu_linears`), and decode steps run all layers in one call where the layers
    allow (`fused_decode.py`). `quantized`: GGUF blocks stay blocks (`quantized_linear.py`; the caller checked
    the kernels run here); else the blocks are expanded to float first. `int8_activations`: every step rounds
    x to int8 for the layers whose blocks allow it (`QuantizedLinear`). `private`: nothing else writes
    `weights` (received pushes), so the model may keep them as they are; else what it still shares with
    them is copied (`own_memory`)."""
    if not quantized:
        weights = expand_blocks(weights)
    model = instantiate(cfg, weights)
    model.model.rotary_emb = RotaryEmbedding(
        cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_freq_factors
    )
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if device.type == "cpu":
        cpu_linears(model, batch_hint)  # packed layers are copies: what is shared still is copied next
        if private:
            model.owns_memory = False
        else:
            own_memory(model, weights)
    if quantized:
        layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        for layer in layers:
            layer.int8_activations = int8_activations
        if int8_activations and not layers:
            log.warning("--int8-activations: this model has no quantized matrices, activations stay float32")
    if device.type == "cpu":
        model.fused_decode = FusedDecode.build(model)  # takes the layers' int8_activations
    return model


def instantiate(cfg: ModelConfig, weights: Mapping[str, torch.Tensor | GGUFBlocks]) -> LlamaForCausalLM:
    """The model without random init (on the meta device), the checkpoint's tensors as its parameters."""
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.architecture](cfg)
    load_weights(model, weights)
    return model


def count_weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes the weights take: parameters (tied ones once), packed copies and quantized blocks (shared ones
    once)."""
    blocks = {b.data_ptr(): b.nbytes for b in quantized_blocks(model)}
    packed = sum(m.packed_bytes for m in model.modules() if isinstance(m, (PackedLinear, PanelLinear)))
    return sum(p.numel() * p.element_size() for p in model.parameters()) + packed + sum(blocks.values())


def quantized_blocks(model: LlamaForCausalLM) -> list[torch.Tensor]:
    """Every block tensor of the quantized layers (a tied head's are its embedding's)."""
    return [p.blocks for m in model.modules() if isinstance(m, QuantizedLinear) for p in m.parts] + [
        m.blocks for m in model.modules() if isinstance(m, QuantizedEmbedding)
    ]


def expand_blocks(weights: Mapping[str, torch.Tensor | GGUFBlocks]) -> dict[str, torch.Tensor]:
    """Every quantized matrix as float32 (a float model, tensor parallelism)."""
    return {k: v.dequantize() if isinstance(v, (GGUFBlocks, GGUFStack)) else v for k, v in weights.items()}


def own_memory(model: nn.Module, weights: Mapping[str, torch.Tensor | GGUFBlocks]) -> None:
    """Copy the tensors the model still shares with `weights` (a safetensors file's, mapped, whose dtype is the
    served one): a file written over in place would change the model, and one cut short kill the process."""
    mapped = {w.untyped_storage().data_ptr() for w in weights.values() if isinstance(w, torch.Tensor)}
    for module in model.modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor.untyped_storage().data_ptr() in mapped:
                if isinstance(tensor, nn.Parameter):
                    tensor.data = tensor.data.clone()  # a tied head shares the Parameter, so follows it
                else:
                    module.register_buffer(
                        name, tensor.clone(), persistent=name not in module._non_persistent_buffers_set
                    )


def load_weights(model: LlamaForCausalLM, weights: Mapping[str, torch.Tensor | GGUFBlocks]) -> None:
    """Replace every parameter; a checkpoint whose names or shapes differ is refused and nothing changes."""
    cfg = model.config
    packed = pack_weights(dict(weights), cfg)  # pack_weights takes a dict (and copies it itself)
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
    blocks = {k: v for k, v in packed.items() if isinstance(v, (GGUFBlocks, GGUFStack))}
    tensors = {k: v for k, v in packed.items() if isinstance(v, torch.Tensor)}  # all the others (pack_weights)
    for name, weight in blocks.items():
        _quantize_module(model, name.removesuffix(".weight"), weight, tensors)
    ref = next(model.parameters())
    if ref.device.type != "meta":
        tensors = {k: v.to(device=ref.device, dtype=ref.dtype) for k, v in tensors.items()}
    model.load_state_dict(tensors, strict=False, assign=True)
    if tied and isinstance(model.model.embed_tokens, QuantizedEmbedding):
        embed = model.model.embed_tokens
        head = QuantizedLinear(GGUFBlocks(embed.blocks, embed.qtype, cfg.hidden_size))
        setattr(model, "lm_head", head)  # lm_head is typed as the nn.Linear it is built as, which this replaces
    elif tied:
        model.lm_head.weight = model.model.embed_tokens.weight


def can_load_in_place(model: LlamaForCausalLM) -> bool:
    """Whether every weight is a float tensor of the model's own (no GGUF blocks), so that new float values can
    be written into it (`load_in_place`)."""
    return not any(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in model.modules())


def load_in_place(model: LlamaForCausalLM, weights: dict[str, torch.Tensor | GGUFBlocks]) -> None:
    """New values for every weight, by Hugging Face name (checked against the model's shapes by the caller),
    written into the tensors the model serves, packed layouts packed again: no second model is built, and
    what holds the tensors (the fused decode step, CUDA graphs) reads the new values. A layer at a time, so
    the temporaries are one layer's. Only while no step runs; a model `can_load_in_place`, of the same config."""
    cfg = model.config
    floats = expand_blocks(weights)
    check_fit(floats, cfg)
    layers: dict[str, dict[str, torch.Tensor | GGUFBlocks]] = {}
    for name, tensor in floats.items():
        prefix = name.split(".", 3)[2] if name.startswith("model.layers.") else ""
        layers.setdefault(prefix, {})[name] = tensor
    for group in layers.values():
        packed = cast("dict[str, torch.Tensor]", pack_weights(group, cfg))  # floats in, floats out (cat_rows)
        for name, tensor in packed.items():
            path, _, attr = name.rpartition(".")
            module = model.get_submodule(path)
            if isinstance(module, (PanelLinear, PackedLinear)) and attr == "weight":
                module.load_(tensor)
            else:
                getattr(module, attr).copy_(tensor)


def check_fit(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Refuses (UnsupportedModel) weights other than those of `cfg`'s shape by Hugging Face name, before any is
    written. A tied head may be left out."""
    expected = hf_weight_shapes(cfg)
    found = {name: tuple(t.shape) for name, t in weights.items()}
    if cfg.tie_word_embeddings or "lm_head.weight" not in found:
        expected.pop("lm_head.weight")
        found.pop("lm_head.weight", None)
    if found != expected:
        misfit = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
        raise UnsupportedModel(f"checkpoint does not fit {cfg.architecture}: {misfit[:3]} differ in name or shape")


def _quantize_module(model: LlamaForCausalLM, path: str, weight: GGUFBlocks | GGUFStack, packed: dict) -> None:
    """The linear layer or embedding at `path` replaced by one over `weight`'s blocks (its bias taken along)."""
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    if isinstance(getattr(parent, attr), nn.Embedding):
        assert isinstance(weight, GGUFBlocks)  # a GGUFStack is only ever a packed projection (cat_rows)
        setattr(parent, attr, QuantizedEmbedding(weight))
    else:
        setattr(parent, attr, QuantizedLinear(weight, packed.pop(f"{path}.bias", None)))
