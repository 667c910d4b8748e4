"""The rollout engine's compilation settings (opd_patches/checks/compilation.py): CUDA-graph modes whose samples
were not the model's are refused before Ray starts."""

import composed
import launch
import pytest

from opd_patches.checks import InputError, compilation

MODE = f"{compilation.COMPILATION}.cudagraph_mode"


def compose(*overrides, device="gpu"):
    return composed.compose_placeholder("topk", *overrides, device=device)


@pytest.mark.parametrize("value", ["FULL", "full"])
def test_full_graphs_for_every_batch_are_refused_naming_the_key_and_the_fix(value):
    with pytest.raises(InputError, match=rf"^{MODE}=FULL: full CUDA graphs over mixed prefill-decode batches .* use "
                                         rf"FULL_AND_PIECEWISE with {compilation.COMPILATION}.mode=3 \(the GPU profile's\), "
                                         r"or FULL_DECODE_ONLY$"):
        compilation.check(compose(f"{MODE}={value}"))
    as_json = f"{compilation.COMPILATION}='{{\"mode\": 0, \"cudagraph_mode\": \"FULL\"}}'"  # VERL takes a JSON string too
    with pytest.raises(InputError, match=r"cudagraph_mode=FULL"):
        compilation.check(compose(as_json))


def test_the_gpu_profiles_graphs_and_the_decode_only_ones_pass():
    assert compilation.setting(compose().actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config,
                               "cudagraph_mode") == "FULL_AND_PIECEWISE"
    compilation.check(compose())
    compilation.check(compose(f"{compilation.COMPILATION}.mode=0", f"{MODE}=FULL_DECODE_ONLY"))
    compilation.check(compose(device="cpu"))  # no vLLM settings at all
    assert compilation.setting('{"mode": 0}') == 0 and compilation.setting(None) is None
    assert compilation.setting("not json") is None


def test_run_sh_refuses_full_graphs_in_one_line_before_ray(tmp_path, embedded):
    last = launch.refused(tmp_path, embedded, f"+{MODE}=FULL", recipe="topk")
    assert last.startswith(f"[opd] refused: {MODE}=FULL: full CUDA graphs"), last
