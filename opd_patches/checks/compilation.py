"""The rollout engine's compilation settings (upstream's key, handed to vLLM unchanged), checked before Ray.

    actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.cudagraph_mode=FULL_AND_PIECEWISE

Refused: `cudagraph_mode` FULL. It captures full CUDA graphs for every batch, mixed prefill-decode batches
included, which FlashAttention 3 allows (`AttentionCGSupport.ALWAYS` in vllm/v1/attention/backends/flash_attn.py);
under vLLM 0.24 and compilation mode 0 the samples of such an engine were not the model's (docs/speculation.md,
the exactness check `python -m tools.spec_exactness --spec none --spec-compilation '{"mode": 0,
"cudagraph_mode": "FULL"}'`). Mode 3 captures the same full graphs for those batches, so it is refused there
too. FULL_AND_PIECEWISE (the GPU profile's, under mode 3) runs those batches through piecewise graphs whose
attention stays outside the graph, and FULL_DECODE_ONLY runs them eager; the same check passed both.
"""

from __future__ import annotations

import json

from omegaconf import DictConfig, OmegaConf

from opd_patches.checks import InputError

COMPILATION = "actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config"
VLLM_COMPILE = 3  # vLLM's CompilationMode.VLLM_COMPILE
FULL = ("FULL", 2)  # vLLM's CUDAGraphMode.FULL, by name or value


def setting(compilation, key="mode"):
    """The `mode` (or another `key`) of the rollout's compilation_config (a mapping, or the JSON string VERL also
    takes), upper-cased where vLLM's name is given; None where unset (vLLM's default then: VLLM_COMPILE unless
    eager; for `cudagraph_mode`, vLLM's choice for the mode)."""
    if isinstance(compilation, str):
        try:
            compilation = json.loads(compilation)
        except ValueError:
            return None
    if OmegaConf.is_config(compilation):
        compilation = OmegaConf.to_container(compilation, resolve=True)
    value = compilation.get(key) if isinstance(compilation, dict) else None
    return value.upper() if isinstance(value, str) else value


def check(config: DictConfig) -> None:
    """Refuses, with InputError, a rollout compilation_config whose CUDA graphs changed the samples."""
    compilation = OmegaConf.select(config, COMPILATION, default=None)
    if setting(compilation, "cudagraph_mode") in FULL:
        raise InputError(f"{COMPILATION}.cudagraph_mode=FULL: full CUDA graphs over mixed prefill-decode batches "
                         "gave samples that were not the student's (vLLM 0.24, docs/speculation.md): use "
                         f"FULL_AND_PIECEWISE with {COMPILATION}.mode=3 (the GPU profile's), or FULL_DECODE_ONLY")
