"""Sampling: one denoising loop (decode.py) with pluggable unmasking and cache policies."""
