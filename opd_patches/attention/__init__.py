"""Attention implementations registered with transformers (opd.attn_implementation): `torch_varlen`."""
