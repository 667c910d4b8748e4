"""run.sh refuses bad input before anything expensive starts, naming what to fix."""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_sh(*args, **env):
    return subprocess.run([str(REPO / "run.sh"), *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=180, cwd=REPO)


def test_unknown_recipe_lists_the_known_ones():
    out = run_sh("recipe=nope")
    assert out.returncode == 2
    assert "unknown recipe 'nope'" in out.stderr and "k1" in out.stderr and "topk" in out.stderr


def test_base_is_not_a_recipe():
    assert run_sh("recipe=base").returncode == 2


def test_unknown_device():
    out = run_sh("recipe=k1", DEVICE="tpu")
    assert out.returncode == 2 and "DEVICE=tpu" in out.stderr


@pytest.mark.fresh_process
def test_missing_model_path_is_named(tmp_path):
    out = run_sh("recipe=k1", DEVICE="cpu", STUDENT=str(tmp_path / "missing-student"), OUTPUT_DIR=str(tmp_path / "run"))
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"actor_rollout_ref.model.path={tmp_path / 'missing-student'}: no such file or directory" in out.stderr
