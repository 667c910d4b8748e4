"""Speculative decoding through upstream's key (opd_patches/checks/speculation.py): refused before Ray starts
where it cannot work."""

import importlib.util

import composed
import launch
import pytest

from opd_patches.checks import InputError, speculation

NGRAM = f"+{speculation.KEY}={{method: ngram, num_speculative_tokens: 4, prompt_lookup_max: 4, prompt_lookup_min: 2}}"


def compose(*overrides, device="cpu"):
    return composed.compose_placeholder("topk", *overrides, device=device)


def test_the_documented_override_composes_and_reaches_upstreams_key():
    assert speculation.check(compose()) is None  # unset: nothing to check
    config = compose(NGRAM, "actor_rollout_ref.rollout.name=vllm")
    spec = config.actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config
    assert dict(spec) == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.mark.parametrize("device", ["cpu", "gpu-hf"])
def test_the_hf_rollout_is_refused_naming_the_key_and_the_fix(device):
    with pytest.raises(InputError, match=r"speculative_config: speculative decoding runs in the vLLM rollout; "
                                         r"this run's rollout is 'hf'.*run with \+device=gpu$"):
        speculation.check(compose(NGRAM, device=device))


def test_a_value_without_a_method_is_refused_with_an_example():
    with pytest.raises(InputError, match=r"expected a mapping with a method, e.g. \+actor_rollout_ref"):
        speculation.check(compose(f"+{speculation.KEY}=ngram", "actor_rollout_ref.rollout.name=vllm"))
    with pytest.raises(InputError, match="expected a mapping with a method"):
        speculation.check(compose(f"+{speculation.KEY}={{num_speculative_tokens: 4}}", "actor_rollout_ref.rollout.name=vllm"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here: the GPU host's case")
def test_the_vllm_rollout_without_vllm_is_refused():
    with pytest.raises(InputError, match=r"the vLLM rollout needs vLLM installed \(make install PROFILE=gpu\)"):
        speculation.check(compose(NGRAM, "actor_rollout_ref.rollout.name=vllm"))


def test_a_method_the_installed_vllm_does_not_know_is_refused_naming_the_ones_it_does(monkeypatch):
    """vLLM's SpeculativeConfig method list, as installed_methods reads it on a GPU host (no vLLM here)."""
    monkeypatch.setattr(speculation, "installed_methods", lambda: ("0.24.0", {"ngram", "suffix", "eagle"}))
    with pytest.raises(InputError, match=r"the installed vLLM 0.24.0 does not know method 'ngram_gpu'; "
                                         r"the draft-free ones it knows: ngram, suffix$"):
        speculation.check(compose(NGRAM.replace("ngram", "ngram_gpu", 1), "actor_rollout_ref.rollout.name=vllm"))
    spec = speculation.check(compose(NGRAM, "actor_rollout_ref.rollout.name=vllm"))
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 4


@pytest.mark.skipif(importlib.util.find_spec("arctic_inference") is not None, reason="arctic-inference is installed")
def test_suffix_without_arctic_inference_is_refused(monkeypatch):
    monkeypatch.setattr(speculation, "installed_methods", lambda: ("0.24.0", {"ngram", "suffix"}))
    with pytest.raises(InputError, match=r"method 'suffix' needs arctic-inference"):
        speculation.check(compose(f"+{speculation.KEY}={{method: suffix}}", "actor_rollout_ref.rollout.name=vllm"))


def test_a_batch_size_schedule_under_mode_0_is_refused_and_allowed_under_the_gpu_profiles_mode_3(monkeypatch):
    """vLLM 0.24 turns full CUDA graphs into piecewise ones for a schedule, and piecewise graphs need its
    compilation mode 3: under mode 0 no step would run under a CUDA graph."""
    monkeypatch.setattr(speculation, "installed_methods", lambda: ("0.24.0", {"ngram"}))
    tail = (f"+{speculation.KEY}={{method: ngram, num_speculative_tokens: 4, prompt_lookup_max: 4, prompt_lookup_min: 2, "
            "num_speculative_tokens_per_batch_size: [[1, 8, 4], [9, 1024, 0]]}")
    mode_0 = f"{speculation.COMPILATION}.mode=0"
    with pytest.raises(InputError, match=r"num_speculative_tokens_per_batch_size makes vLLM use piecewise CUDA graphs.*"
                                         r"mode is 0, so no step would run under a CUDA graph: add "
                                         r"actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.mode=3"):
        speculation.check(compose(tail, mode_0, device="gpu"))
    assert speculation.check(compose(tail, device="gpu"))["num_speculative_tokens_per_batch_size"] == [[1, 8, 4], [9, 1024, 0]]
    for mode in ("3", "VLLM_COMPILE", "vllm_compile"):  # vLLM takes the number or the name
        spec = speculation.check(compose(tail, f"{speculation.COMPILATION}.mode={mode}", device="gpu"))
        assert spec["num_speculative_tokens_per_batch_size"] == [[1, 8, 4], [9, 1024, 0]]
    as_json = f"{speculation.COMPILATION}='{{\"mode\": 3, \"cudagraph_mode\": \"PIECEWISE\"}}'"  # VERL takes a JSON string too
    assert speculation.check(compose(tail, as_json, device="gpu"))["method"] == "ngram"
    assert speculation.check(compose(NGRAM, mode_0, device="gpu"))["method"] == "ngram"  # no schedule: mode 0 is fine


def test_ngram_gpu_under_mode_0_is_refused_and_allowed_under_the_gpu_profiles_mode_3(monkeypatch):
    """vLLM 0.24's ngram_gpu proposer compiles its kernel under the engine's compilation mode; mode 0 has none."""
    monkeypatch.setattr(speculation, "installed_methods", lambda: ("0.24.0", {"ngram", "ngram_gpu"}))
    gpu = NGRAM.replace("ngram", "ngram_gpu", 1)
    with pytest.raises(InputError, match=r"method 'ngram_gpu' compiles its matching kernel.*under mode 0.*fails at "
                                         r"start \('No compilation mode is set.'\): add actor_rollout_ref.rollout."
                                         r"engine_kwargs.vllm.compilation_config.mode=3, or use method ngram$"):
        speculation.check(compose(gpu, f"{speculation.COMPILATION}.mode=0", device="gpu"))
    assert speculation.check(compose(gpu, device="gpu"))["method"] == "ngram_gpu"
    for mode in ("3", "VLLM_COMPILE"):
        assert speculation.check(compose(gpu, f"{speculation.COMPILATION}.mode={mode}", device="gpu"))["method"] == "ngram_gpu"


def test_run_sh_refuses_the_override_on_a_cpu_in_one_line_before_ray(tmp_path, embedded):
    """The README's override on a CPU run: exit 2, one line naming the key, Ray never started."""
    last = launch.refused(tmp_path, embedded, NGRAM, recipe="topk")
    assert last.startswith(f"[opd] refused: {speculation.KEY}: speculative decoding runs in the vLLM rollout"), last
