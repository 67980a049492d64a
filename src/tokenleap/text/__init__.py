"""Tokenizers and streaming detokenization."""
