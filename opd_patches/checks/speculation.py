"""Speculative decoding of the rollout, set through upstream's key and checked before Ray starts.

    +actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config='{method: ngram, num_speculative_tokens: 4, prompt_lookup_max: 4, prompt_lookup_min: 2}'

VERL hands the mapping to vLLM unchanged. vLLM drafts tokens and verifies them against the student's own
distribution (a drafted token is kept with the student's probability of it; on a rejection the token is drawn
from the student's distribution without it), so the samples keep that distribution whatever the drafts.
The draft-free methods (`DRAFT_FREE`) need no second model. Refused here, each in one line: a rollout
other than vLLM (the `hf` rollout of `+device=cpu` and `+device=gpu-hf`), a value that is not a mapping
with a method, a method the installed vLLM does not know, `suffix` without arctic-inference (the
package vLLM's suffix proposer imports), and vLLM's batch-size schedule (`num_speculative_tokens_per_batch_size`,
speculation only while few sequences remain) under a compilation mode other than VLLM_COMPILE (3): vLLM turns
full CUDA graphs into piecewise ones for a schedule, and piecewise graphs exist only under that mode, so under
mode 0 every step, speculative or not, would run without CUDA graphs. Also refused: `ngram_gpu`
under mode 0. vLLM 0.24's GPU proposer gives its matching kernel a VLLM_COMPILE config of its own, but the
torch.compile wrapper reads the engine's config (`NgramGPUKernel` in vllm/v1/spec_decode/ngram_proposer_gpu.py,
`TorchCompileWithNoGuardsWrapper` in vllm/compilation/wrapper.py), whose mode 0 has no backend, so the engine
fails at start.
"""

from __future__ import annotations

import importlib.util
import typing

from omegaconf import DictConfig, OmegaConf

from opd_patches.checks import InputError
from opd_patches.checks.compilation import COMPILATION, VLLM_COMPILE, setting

KEY = "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config"
DRAFT_FREE = ("ngram", "ngram_gpu", "suffix")
EXAMPLE = "{method: ngram, num_speculative_tokens: 4, prompt_lookup_max: 4, prompt_lookup_min: 2}"


def installed_methods() -> tuple[str, set[str]] | None:
    """(vLLM's version, the methods its SpeculativeConfig accepts), or None without vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return None
    import vllm
    from vllm.config.speculative import SpeculativeMethod

    return vllm.__version__, set(typing.get_args(SpeculativeMethod))  # nested Literals come flattened


def check(config: DictConfig) -> dict | None:
    """The speculative config of a run (None when unset), refused with InputError where it cannot work."""
    spec = OmegaConf.select(config, KEY, default=None)
    if spec is None:
        return None
    spec = OmegaConf.to_container(spec, resolve=True) if OmegaConf.is_config(spec) else spec
    if not isinstance(spec, dict) or not spec.get("method"):
        raise InputError(f"{KEY}: expected a mapping with a method, e.g. +{KEY}='{EXAMPLE}'; got {spec!r}")
    method, rollout = spec["method"], OmegaConf.select(config, "actor_rollout_ref.rollout.name")
    if rollout != "vllm":
        raise InputError(f"{KEY}: speculative decoding runs in the vLLM rollout; this run's rollout is {rollout!r} "
                         "(+device=cpu and +device=gpu-hf use the hf rollout): drop the key or run with +device=gpu")
    found = installed_methods()
    if found is None:
        raise InputError(f"{KEY}: the vLLM rollout needs vLLM installed (make install PROFILE=gpu)")
    version, known = found
    if method not in known:
        raise InputError(f"{KEY}: the installed vLLM {version} does not know method {method!r}; the draft-free "
                         f"ones it knows: {', '.join(m for m in DRAFT_FREE if m in known)}")
    if method == "suffix" and importlib.util.find_spec("arctic_inference") is None:
        raise InputError(f"{KEY}: method 'suffix' needs arctic-inference, which vLLM's suffix proposer imports "
                         "(PyPI has only its source, built with --no-build-isolation: docs/speculation.md, "
                         "Installing suffix)")
    mode = setting(OmegaConf.select(config, COMPILATION, default=None))
    if method == "ngram_gpu" and mode in (0, "NONE"):
        raise InputError(f"{KEY}: method 'ngram_gpu' compiles its matching kernel with the engine's compilation "
                         f"mode, and under mode 0 (this run's {COMPILATION}.mode) vLLM's engine fails at start "
                         f"('No compilation mode is set.'): add {COMPILATION}.mode={VLLM_COMPILE}, or use method ngram")
    if spec.get("num_speculative_tokens_per_batch_size") is not None:
        if mode is not None and mode not in (VLLM_COMPILE, "VLLM_COMPILE"):
            raise InputError(f"{KEY}: num_speculative_tokens_per_batch_size makes vLLM use piecewise CUDA graphs, "
                             f"which need its compilation mode {VLLM_COMPILE} (VLLM_COMPILE, torch.compile); this "
                             f"run's {COMPILATION}.mode is {mode!r}, so no step would run under a CUDA graph: add "
                             f"{COMPILATION}.mode={VLLM_COMPILE}, or drop the schedule")
    return spec
