"""Tiering: prefix keys, the RAM tier, the safetensors disk tier and the manager (torch, no vLLM)."""
