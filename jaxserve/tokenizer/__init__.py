"""The tokenizers wrapper, chat templates, incremental detokenizing, and the GGUF tokenizer rebuild."""
