"""Bench phase `layout`: the student's forward + backward on the same tokens in VERL's two input layouts.

    python -m tools.bench --phase layout        (make bench PHASE=layout)

VERL's actor (`actor_rollout_ref.model.use_remove_padding=true`, the recipes' setting) packs a
micro-batch's sequences into one row with restarting `position_ids` and no attention mask (the layout
flash-attn's varlen kernel wants). Under sdpa, transformers turns such a row into a block-diagonal
causal mask, and a masked sdpa call cannot use the causal flash kernel. This phase times the decoder
(grad checkpointing on, bf16, the size's model) on one micro-batch of `micro_seqs` sequences of
`seq_len` tokens:
- `layout/batched`: (micro_seqs, seq_len), no mask: the per-sequence causal kernel (reference);
- `layout/packed`: (1, micro_seqs * seq_len) with restarting position_ids: VERL's rmpad layout;
- `layout/padded`: (micro_seqs, seq_len) with an attention mask that pads the last `PAD` tokens of the
  last sequence: VERL's `use_remove_padding=false` layout (a non-trivial padding mask);
- `layout/packed_varlen`: the packed row under `torch_varlen` (opd_patches/attention/torch_varlen.py):
  no mask, PyTorch's varlen kernel on CUDA (what `opd.attn_implementation=auto` picks without flash-attn);
- `attention/varlen`: the attention op alone, fwd + bwd, at the size's heads and head dim: `torch_varlen`
  on the packed (T, H, D) tensors against batched causal sdpa (reference), with the max abs differences
  of outputs and of q/k/v gradients, and which path ran (`kernel`: varlen_attn, or the per-sequence
  sdpa fallback where the kernel cannot run, e.g. the CPU).
The hidden states are compared with the batched row's on the tokens every layout keeps (max abs
difference), so each row is known to compute the same function. The lm_head and loss are left out: they do not depend on the layout.
"""

import torch

from opd_patches.attention import torch_varlen
from tools.bench.kernels import build_model
from tools.bench.measure import measure, row


PAD = 64  # padded tokens at the end of the last sequence in `layout/padded`


def _decoder_step(decoder, ids, position_ids, attention_mask=None):
    h = decoder(input_ids=ids, position_ids=position_ids, attention_mask=attention_mask).last_hidden_state
    h.float().pow(2).mean().backward()
    return h.detach()


def attention_check(config, n, t, device, dtype, repeats) -> dict:
    """The `attention/varlen` row: torch_varlen on n packed sequences of t tokens vs batched causal sdpa,
    forward + backward, same inputs and output weights; max abs differences of outputs and gradients."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    gen = torch.Generator(device=device).manual_seed(7)
    q, k, v = (torch.randn(n, h, t, dim, generator=gen, device=device, dtype=dtype).requires_grad_()
               for h in (heads, kv, kv))
    w = torch.randn(n, t, heads, dim, generator=gen, device=device, dtype=dtype)
    module = torch.nn.Module()
    module.is_causal = True
    pos = torch.arange(t, device=device).repeat(n)[None]
    packed = [x.detach().transpose(1, 2).reshape(1, n * t, x.shape[1], dim).transpose(1, 2).requires_grad_()
              for x in (q, k, v)]

    def varlen():
        out, _ = torch_varlen.torch_varlen_attention_forward(module, *packed, None, scaling=dim**-0.5, position_ids=pos)
        grads = torch.autograd.grad((out.reshape(n, t, heads, dim) * w).sum(), packed)
        return out.reshape(n, t, heads, dim), [g.transpose(1, 2).reshape(n, t, -1, dim).transpose(1, 2) for g in grads]

    def batched():
        # KV heads repeated, as transformers' sdpa path does, so the causal flash kernel runs
        kr, vr = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=dim**-0.5)
        out = out.transpose(1, 2)
        return out, torch.autograd.grad((out * w).sum(), (q, k, v))

    (o1, g1), (o2, g2) = varlen(), batched()
    diffs = {"out_max_abs_diff": float((o1.detach().float() - o2.detach().float()).abs().max())}
    for name, a, b in zip("qkv", g1, g2):
        diffs[f"grad_{name}_max_abs_diff"] = float((a.float() - b.float()).abs().max())
    kernel = torch_varlen.kernel_for(packed[0])
    timed = {"varlen": measure(varlen, device, repeats), "batched": measure(batched, device, repeats)}
    return row("attention/varlen", timed["varlen"], timed["batched"], n * t, heads=heads, kv_heads=kv, head_dim=dim,
               path="varlen_attn" if kernel else "per-sequence sdpa", **diffs)


def run_phase(size, args) -> dict:
    device = torch.device(size.device)
    model = build_model(size, seed=0)
    model.gradient_checkpointing_enable()
    model.train()
    decoder = model.get_decoder()
    n, t = size.micro_seqs, size.seq_len
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (n, t), generator=gen).to(device)
    pos = torch.arange(t, device=device).expand(n, t)
    mask = torch.ones(n, t, dtype=torch.long, device=device)
    mask[-1, -PAD:] = 0
    keep = mask.reshape(-1).bool()
    layouts = {
        "batched": (ids, pos),
        "packed": (ids.reshape(1, n * t), pos.reshape(1, n * t)),
        "padded": (ids, pos, mask),
    }
    with torch.autocast(device.type, dtype=getattr(torch, size.dtype), enabled=device.type == "cuda"):
        hidden = {k: _decoder_step(decoder, *v).reshape(n * t, -1) for k, v in layouts.items()}
        decoder.zero_grad(set_to_none=True)
        timed = {k: measure(lambda v=v: _decoder_step(decoder, *v), device, size.repeats) for k, v in layouts.items()}
        # VERL's packed row again, under torch_varlen (the registered name, as a training worker loads it)
        torch_varlen.register()
        model.set_attn_implementation(torch_varlen.NAME)
        hidden["packed_varlen"] = _decoder_step(decoder, *layouts["packed"]).reshape(n * t, -1)
        decoder.zero_grad(set_to_none=True)
        timed["packed_varlen"] = measure(lambda: _decoder_step(decoder, *layouts["packed"]), device, size.repeats)
        model.set_attn_implementation("sdpa")
        layouts["packed_varlen"] = layouts["packed"]
    diff = {k: float((h[keep].float() - hidden["batched"][keep].float()).abs().max()) for k, h in hidden.items()}
    rows = [row(f"layout/{k}", timed[k], timed["batched"], n * t, hidden_max_abs_diff=diff[k]) for k in layouts]
    for r in rows:
        print(f"[bench] {r['name']}: {r['time_s']:.3f} s (x{r['ratio']:.2f} of batched)", flush=True)
    att = attention_check(model.config, n, t, device, getattr(torch, size.dtype), size.repeats)
    rows.append(att)
    print(f"[bench] attention/varlen ({att['path']}): {att['time_s'] * 1e3:.2f} ms fwd+bwd vs batched causal sdpa "
          f"{att['ref_time_s'] * 1e3:.2f} ms (x{att['ratio']:.2f}); max abs diff out {att['out_max_abs_diff']:.3g}, "
          f"grad q/k/v {att['grad_q_max_abs_diff']:.3g}/{att['grad_k_max_abs_diff']:.3g}/"
          f"{att['grad_v_max_abs_diff']:.3g}", flush=True)
    notes = [f"decoder fwd+bwd, grad checkpointing, {size.dtype}, one micro-batch of {n} x {t} tokens; "
             f"attn_implementation={model.config._attn_implementation}; packed = VERL's use_remove_padding "
             f"layout (one row, restarting position_ids, no mask), packed_varlen = the same under torch_varlen; "
             f"padded = use_remove_padding=false (attention mask, "
             f"last {PAD} tokens padded); hidden max abs diff vs batched on kept tokens: "
             + ", ".join(f"{k} {v:.3g}" for k, v in diff.items())]
    return {"size": size.name, "rows": rows, "notes": notes}
