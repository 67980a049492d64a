"""Trained draft heads: a small network beside the target that drafts from its hidden states."""
