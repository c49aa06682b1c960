"""Tests of how models are seen: the protocol, discovery, HF and litgpt models, LoRA."""
