"""Bench phase `layout`: the student's forward + backward on the same tokens in VERL's two input layouts.

    python -m opd_patches.bench --phase layout        (make bench PHASE=layout)

VERL's actor (`actor_rollout_ref.model.use_remove_padding=true`, the recipes' setting) packs a
micro-batch's sequences into one row with restarting `position_ids` and no attention mask (the layout
flash-attn's varlen kernel wants). Under sdpa, transformers turns such a row into a block-diagonal
causal mask, and a masked sdpa call cannot use the causal flash kernel. This phase times the decoder
(grad checkpointing on, bf16, the size's model) on one micro-batch of `micro_seqs` sequences of
`seq_len` tokens:
- `layout/batched`: (micro_seqs, seq_len), no mask: the per-sequence causal kernel (reference);
- `layout/packed`: (1, micro_seqs * seq_len) with restarting position_ids: VERL's rmpad layout;
- `layout/padded`: (micro_seqs, seq_len) with an attention mask that pads the last `PAD` tokens of the
  last sequence: VERL's `use_remove_padding=false` layout (a non-trivial padding mask).
The hidden states are compared with the batched row's on the tokens every layout keeps (max abs
difference), so each row is known to compute the same function. The lm_head and loss are left out: they do not depend on the layout.
"""

import torch

from opd_patches.bench.kernels import build_model
from opd_patches.bench.measure import measure, row


PAD = 64  # padded tokens at the end of the last sequence in `layout/padded`


def _decoder_step(decoder, ids, position_ids, attention_mask=None):
    h = decoder(input_ids=ids, position_ids=position_ids, attention_mask=attention_mask).last_hidden_state
    h.float().pow(2).mean().backward()
    return h.detach()


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
    diff = {k: float((h[keep].float() - hidden["batched"][keep].float()).abs().max()) for k, h in hidden.items()}
    rows = [row(f"layout/{k}", timed[k], timed["batched"], n * t, hidden_max_abs_diff=diff[k]) for k in layouts]
    for r in rows:
        print(f"[bench] {r['name']}: {r['time_s']:.3f} s (x{r['ratio']:.2f} of batched)", flush=True)
    notes = [f"decoder fwd+bwd, grad checkpointing, {size.dtype}, one micro-batch of {n} x {t} tokens; "
             f"attn_implementation={model.config._attn_implementation}; packed = VERL's use_remove_padding "
             f"layout (one row, restarting position_ids, no mask); padded = use_remove_padding=false (attention mask, "
             f"last {PAD} tokens padded); hidden max abs diff vs batched on kept tokens: "
             + ", ".join(f"{k} {v:.3g}" for k, v in diff.items())]
    return {"size": size.name, "rows": rows, "notes": notes}
