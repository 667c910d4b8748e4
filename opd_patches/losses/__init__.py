"""Distillation losses registered with VERL (`register_distillation_loss`) and their per-token maths.

- `tail_kl`: pure tensor maths of the top-k forward KL with a tail bucket (`tail_kl_per_token`).
- `forward_kl_topk_tail`: the registered loss of that name, plus the logits-processor hook that
  computes its tail term where the student logits are.
"""

from opd_patches.losses.tail_kl import tail_kl_per_token, tail_term_per_token, truncated_kl_per_token

__all__ = ["tail_kl_per_token", "tail_term_per_token", "truncated_kl_per_token"]
