"""Benchmark sizes: `full` = one seed-run step at the real architecture on one GPU; `cpu` = a quick check.

full: R1-Distill-Qwen-1.5B architecture (opd_patches/embedded/r1_arch.py), random bf16 weights, sdpa,
32 sequences x 5,200 tokens (166,400 tokens: one step of the `topk` recipe, 8 prompts x 4), top-16.
The student update packs 3 sequences per micro-batch (15,600 tokens: what the recipes'
ppo_max_token_len_per_gpu=16384 admits); the teacher scores with score_sequences' own defaults.
cpu: a tiny Qwen2 in fp32 that finishes a phase quickly on a small CPU host (docs/performance.md).
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Size:
    name: str
    model: dict = field(default_factory=dict)  # Qwen2Config overrides; empty: r1_distill_config()
    dtype: str = "bfloat16"
    device: str = "cuda"
    n_seqs: int = 32
    seq_len: int = 5200
    micro_seqs: int = 3  # sequences per student micro-batch (update)
    topk: int = 16
    upstream_chunk: int = 4096  # upstream's chunked_topk_chunk_size default
    lean_chunk: int = 2048
    teacher_chunk: int = 2048  # score_sequences' chunk_size default
    teacher_max_tokens: int = 16384  # score_sequences' max_tokens default
    ref_teacher_seqs: int = 2  # the plain reference's sequences per forward (docs/performance.md)
    ref_teacher_chunk: int = 4096
    repeats: int = 1  # timed repeats after one warm-up (median)

    @property
    def tokens(self) -> int:
        return self.n_seqs * self.seq_len


SIZES = {
    "full": Size("full"),
    "cpu": Size(
        "cpu",
        model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096, tie_word_embeddings=False),
        dtype="float32", device="cpu", n_seqs=4, seq_len=128, micro_seqs=2, topk=16,
        upstream_chunk=128, lean_chunk=128, teacher_chunk=128, teacher_max_tokens=256,
        ref_teacher_seqs=2, ref_teacher_chunk=256, repeats=3,
    ),
}


def qwen2_config(size: Size):
    """The model config of a size: the R1-Distill-1.5B architecture or the size's overrides."""
    if not size.model:
        from opd_patches.embedded.r1_arch import r1_distill_config

        return r1_distill_config()
    from transformers import Qwen2Config

    return Qwen2Config(**size.model, dtype=size.dtype)
