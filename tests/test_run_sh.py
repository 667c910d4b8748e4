"""run.sh refuses bad input before anything expensive starts, naming what to fix."""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_sh(*args, **env):
    return subprocess.run([str(REPO / "run.sh"), *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=180, cwd=REPO)


def imported_modules(stderr: str) -> set[str]:
    """The modules a process run with PYTHONPROFILEIMPORTTIME=1 imported (its stderr)."""
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


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
def test_missing_model_path_is_named_before_verl_is_imported(tmp_path):
    out = run_sh("recipe=k1", DEVICE="cpu", STUDENT=str(tmp_path / "missing-student"), OUTPUT_DIR=str(tmp_path / "run"),
                 PYTHONPROFILEIMPORTTIME="1")  # stderr: one line per module the process imported
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"actor_rollout_ref.model.path={tmp_path / 'missing-student'}: no such file or directory" in out.stderr
    imported = imported_modules(out.stderr)
    assert "hydra" in imported and "verl" not in imported and "torch" not in imported  # composed, then refused


def test_verl_config_folder_composes_as_its_package(tmp_path):
    """run.sh's pkg://verl.trainer.config, handed to Hydra as that folder (main.searchpath_without_import):
    the same composed recipe."""
    from composed import SEARCH_PATH, compose_recipe
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from opd_patches.main import searchpath_without_import

    [folder] = searchpath_without_import([SEARCH_PATH])
    assert folder.startswith("hydra.searchpath=[file://") and folder.endswith("/verl/trainer/config]")
    assert searchpath_without_import(["+x=pkg://verl.trainer.config"]) == ["+x=pkg://verl.trainer.config"]  # only that key
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
        by_folder = compose(config_name="topk", overrides=[folder, "+device=cpu"])
    assert OmegaConf.to_container(by_folder) == OmegaConf.to_container(compose_recipe("topk", "+device=cpu"))
