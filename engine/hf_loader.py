"""Loading a Hugging Face model directory: config.json, *.safetensors, tokenizer files."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from .config import ModelConfig
from .errors import UnsupportedModel


def read_hf_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise UnsupportedModel(f"{path} has no config.json")
    return ModelConfig.from_hf(json.loads(cfg_file.read_text()))


def read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the directory's safetensors shards, by their Hugging Face names."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModel(f"{path} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights
