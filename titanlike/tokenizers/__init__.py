"""Tokenizer formats beyond HF json (loaded lazily by titanlike.tokenizer.build_tokenizer, which is the entry point).

Each module needs its own optional package (tiktoken, sentencepiece) only when that format is used.
"""
