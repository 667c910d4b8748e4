"""`torch_varlen`: packed-sequence attention on PyTorch's built-in varlen kernel, for hosts without flash-attn.

With `actor_rollout_ref.model.use_remove_padding=true` VERL packs a micro-batch into one row whose
`position_ids` restart at 0 at each sequence, with no attention mask. Under `sdpa` transformers turns
that row into an (L, L) block-diagonal mask, which no fused causal kernel takes (far slower than a
varlen kernel, docs/performance.md). This attention implementation, registered in transformers'
own `AttentionInterface` and `AttentionMaskInterface` (no upstream edit), instead:
- builds no mask for causal rows without padding or cache (the mask function returns None);
- derives the sequence boundaries (cu_seqlens) from `position_ids` (a sequence starts where the
  position is 0, and at every row start), as transformers' flash-attn path does;
- runs `torch.nn.attention.varlen.varlen_attn` (causal: `window_size=(-1, 0)`) where it can run
  (CUDA, bf16/fp16), else exact per-sequence causal sdpa (the CPU build raises NotImplementedError);
- hands everything else (padding masks, KV caches, dropout) to transformers' sdpa, unchanged.

`resolve(choice, device)` is the recipe key `opd.attn_implementation` (opd_patches/main.py): auto ->
flash_attention_2 where flash-attn is installed, else `torch_varlen` on CUDA, else sdpa.
"""

import importlib.util
import inspect
import weakref

import torch

from opd_patches.config import ATTN_IMPLEMENTATIONS

NAME = "torch_varlen"
CHOICES = ATTN_IMPLEMENTATIONS  # opd.attn_implementation's values (NAME among them)


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve(choice, device: str) -> str:
    """The attention implementation for recipe value `choice` on device type `device` (cuda | cpu)."""
    choice = "auto" if choice is None else str(choice)
    if choice not in CHOICES:
        raise ValueError(f"opd.attn_implementation={choice!r}: use one of {', '.join(CHOICES)}.")
    if choice == "auto":
        if device == "cuda":
            return "flash_attention_2" if flash_attn_installed() else NAME
        return "sdpa"
    if choice == "flash_attention_2" and not flash_attn_installed():
        raise ValueError(
            "opd.attn_implementation=flash_attention_2 but flash-attn is not installed: install it, or use "
            f"auto ({NAME} on CUDA without flash-attn).")
    return choice


def _load_kernel():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


_KERNEL = _load_kernel()


def kernel_for(query: torch.Tensor):
    """The varlen kernel if it can run on `query` (flash kernels: CUDA, half precision), else None."""
    if _KERNEL is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        return _KERNEL
    return None


def call_kernel(kernel, q, k, v, cu_seqlens, max_len: int, scale):
    """Causal varlen attention of packed (T, H, D) tensors, k/v (T, H_kv, D), on either signature:
    torch 2.11's (no GQA flag: the KV heads are repeated) or later ones with `enable_gqa`."""
    groups = q.shape[1] // k.shape[1]
    extra = {}
    if groups > 1:
        if "enable_gqa" in inspect.signature(kernel).parameters:
            extra["enable_gqa"] = True
        else:  # query head h reads KV head h // groups, as transformers' repeat_kv
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return kernel(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale, window_size=(-1, 0), **extra)


def per_sequence_sdpa(q, k, v, cu_seqlens, scale):
    """The exact fallback: causal sdpa on each sequence of the packed (T, H, D) tensors."""
    outs = []
    bounds = cu_seqlens.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:]):
        seq = [t[start:stop].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # (1, H, n, D)
        o = torch.nn.functional.scaled_dot_product_attention(
            *seq, is_causal=True, scale=scale, enable_gqa=seq[0].shape[1] != seq[1].shape[1])
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def cu_seqlens_from_position_ids(position_ids, batch: int, length: int, device) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32 (N+1,), longest length) of the flattened (batch, length) tokens: a sequence
    starts at every row start and wherever the position is 0 (VERL's packing, its bucket padding too)."""
    starts = torch.zeros(batch, length, dtype=torch.bool, device=device)
    if position_ids is not None:
        pos = position_ids[0] if position_ids.dim() == 3 else position_ids  # mRoPE (3, B, L): text row
        starts |= pos.expand(batch, length) == 0
    starts[:, 0] = True
    idx = starts.reshape(-1).nonzero().flatten()
    cu = torch.cat([idx, idx.new_tensor([batch * length])]).to(torch.int32)
    return cu, int(cu.diff().max())


# The boundaries of one forward, computed at its first layer and reused by the others (and by the
# recomputation under gradient checkpointing): every layer gets the same position_ids tensor.
_last = (None, None, None)


def _boundaries(position_ids, batch, length, device):
    global _last
    if position_ids is None:
        return cu_seqlens_from_position_ids(None, batch, length, device)
    # inference tensors (the teacher's scoring) have no version counter
    key = (-1 if position_ids.is_inference() else position_ids._version, batch, length)
    ref, cached_key, value = _last
    if ref is not None and ref() is position_ids and cached_key == key:
        return value
    value = cu_seqlens_from_position_ids(position_ids, batch, length, device)
    _last = (weakref.ref(position_ids), key, value)
    return value


_announced = set()


def _announce(path: str, q: torch.Tensor) -> None:
    """One line per process and path taken (the logs then show which kernel served the packed forwards)."""
    key = (path, q.dtype, q.device.type)
    if key not in _announced:
        _announced.add(key)
        print(f"[opd] {NAME}: {path} ({q.dtype}, {q.device.type}, {q.shape[1]} heads)", flush=True)


def torch_varlen_attention_forward(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, sliding_window=None,
    is_causal=None, position_ids=None, **kwargs,
):
    """transformers attention interface: query (B, H, L, D), key/value (B, H_kv, L, D) -> ((B, L, H, D), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is not None or query.shape[2] != key.shape[2] or dropout > 0.0 or not causal:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if sliding_window is not None:
        raise NotImplementedError(
            f"{NAME}: sliding-window layers are not supported; set opd.attn_implementation=sdpa for this model.")
    batch, heads, length, dim = query.shape
    cu, max_len = _boundaries(position_ids, batch, length, query.device)
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value))
    kernel = kernel_for(q)
    _announce("varlen kernel" if kernel else "per-sequence sdpa", q)
    out = call_kernel(kernel, q, k, v, cu, max_len, scaling) if kernel else per_sequence_sdpa(q, k, v, cu, scaling)
    return out.view(batch, length, heads, dim), None


def torch_varlen_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
    """transformers mask interface: None (no mask built) for rows without padding or cache, packed ones
    included; otherwise transformers' sdpa mask, which the attention hands to sdpa."""
    no_cache = q_length == kv_length and isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0
    if no_cache and (attention_mask is None or bool(attention_mask[:, -kv_length:].all())):
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Register `torch_varlen` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, torch_varlen_attention_forward)
    AttentionMaskInterface.register(NAME, torch_varlen_mask)
