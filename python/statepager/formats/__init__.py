"""Stored forms of optimizer state (stored.py: fp32, bf16, q8, residual) and their codecs."""
