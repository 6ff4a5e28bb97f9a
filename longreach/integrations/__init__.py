"""Adapters to model libraries (transformers)."""
