"""Attention for position methods: re-rotation, the generic parts kernel and the dense oracle."""
