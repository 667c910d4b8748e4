"""The rollout engine's compilation settings (opd_patches/checks/compilation.py): CUDA-graph modes whose samples
were not the model's are refused before Ray starts."""

import os
import subprocess
import sys
from pathlib import Path

import composed
import pytest

from opd_patches.checks import InputError, compilation

REPO = Path(__file__).resolve().parents[1]
MODE = f"{compilation.COMPILATION}.cudagraph_mode"


def compose(*overrides, device="gpu"):
    return composed.compose_recipe("topk", "actor_rollout_ref.model.path=/models/student",
                                   "distillation.teacher_models.teacher_model.model_path=/models/teacher",
                                   "data.train_files=/data/train.parquet", "data.val_files=/data/val.parquet",
                                   f"+device={device}", *overrides)


@pytest.mark.parametrize("value", ["FULL", "full"])
def test_full_graphs_for_every_batch_are_refused_naming_the_key_and_the_fix(value):
    with pytest.raises(InputError, match=rf"^{MODE}=FULL: full CUDA graphs over mixed prefill-decode batches .* use "
                                         r"FULL_DECODE_ONLY \(the GPU profile's\), or FULL_AND_PIECEWISE with "
                                         rf"{compilation.COMPILATION}.mode=3$"):
        compilation.check(compose(f"{MODE}={value}"))
    as_json = f"{compilation.COMPILATION}='{{\"mode\": 0, \"cudagraph_mode\": \"FULL\"}}'"  # VERL takes a JSON string too
    with pytest.raises(InputError, match=r"cudagraph_mode=FULL"):
        compilation.check(compose(as_json))


def test_the_gpu_profiles_graphs_and_the_piecewise_ones_pass():
    assert compilation.setting(compose().actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config,
                               "cudagraph_mode") == "FULL_DECODE_ONLY"
    compilation.check(compose())
    compilation.check(compose(f"{compilation.COMPILATION}.mode=3", f"{MODE}=FULL_AND_PIECEWISE"))
    compilation.check(compose(device="cpu"))  # no vLLM settings at all
    assert compilation.setting('{"mode": 0}') == 0 and compilation.setting(None) is None
    assert compilation.setting("not json") is None


def test_run_sh_refuses_full_graphs_in_one_line_before_ray(tmp_path, embedded):
    ray_tmp = tmp_path / "ray"
    env = {**os.environ, "DEVICE": "cpu", "OUTPUT_DIR": str(tmp_path / "run"), "PYTHON": sys.executable,
           "RAY_TMPDIR": str(ray_tmp), "STUDENT": str(embedded["student"]), "TEACHER": str(embedded["teacher"]),
           "TRAIN_FILES": str(embedded["train"]), "VAL_FILES": str(embedded["val"])}
    env.pop("OPD_LOCK_HELD", None)
    out = subprocess.run([str(REPO / "run.sh"), "recipe=topk", "+overlay=smoke", f"+{MODE}=FULL"], env=env,
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
    assert not ray_tmp.exists()
    assert out.stderr.strip().splitlines()[-1].startswith(f"[opd] refused: {MODE}=FULL: full CUDA graphs"), out.stderr[-2000:]
