"""Checkpoints read from disk: Hugging Face directories and GGUF files, with their tokenizers."""
