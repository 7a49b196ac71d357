"""Models built on the spot, for the GPU tests and `make bench-gpu`: the lent GPU machine has no embedded
model (and no network), so a Hugging Face directory gets random weights and a tokenizer made here.

The tokenizer is a real byte-level BPE without merges: every byte is a token, so any text encodes, and
filler tokens bring its vocabulary to the model's, so every id the model can sample decodes."""

from __future__ import annotations

import json
import os

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(path: str, vocab_size: int) -> None:
    """tokenizer.json and tokenizer_config.json with exactly `vocab_size` ids: the specials, the 256 byte
    tokens, then fillers."""
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in ByteLevel.alphabet():
        vocab.setdefault(char, len(vocab))
    while len(vocab) < vocab_size:
        vocab[f"<filler{len(vocab)}>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIALS))
    os.makedirs(path, exist_ok=True)
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}, f)


def write_model(
    path: str, config: transformers.PretrainedConfig, dtype: torch.dtype, seed: int = 0, scale: float = 0.02
) -> None:
    """A model of `config` with normal(0, scale) weights (norms at 1) and the tokenizer above, as a directory
    lmgate and transformers both load."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, scale)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, config.vocab_size)
