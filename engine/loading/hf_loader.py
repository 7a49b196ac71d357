"""Loading a Hugging Face model directory: config.json, *.safetensors, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..config import ModelConfig
from ..errors import UnsupportedModel


# Buffers older transformers saved with the weights, which transformers (and vLLM) ignore when loading.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def read_hf_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise UnsupportedModel(f"{path} has no config.json")
    config = json.loads(cfg_file.read_text())
    if not isinstance(config, dict):
        raise UnsupportedModel(f"{cfg_file} is not a JSON object")
    model_config = ModelConfig.from_hf(config)
    if not (path / "tokenizer.json").is_file():  # checked before any weight loads
        raise UnsupportedModel(f"{path} has no tokenizer.json (lmgate reads the fast tokenizer's file)")
    return model_config


def read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the directory's safetensors shards, by their Hugging Face names: those its
    model.safetensors.index.json names where it has one (a repository may also hold other files, such as
    Mistral's consolidated.safetensors or an adapter's), else every *.safetensors file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModel(f"{path} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        # Mapped, not read: ranks that move their weights to a device, or to another dtype, copy only what
        # they keep (build_model copies what would still read the file).
        weights.update((name, t) for name, t in load_file(str(file)).items() if not name.endswith(IGNORED_SUFFIXES))
    return weights
