"""Text: the tokenizer, streaming detokenization, chat templates."""
