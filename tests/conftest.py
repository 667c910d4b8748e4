"""Shared fixtures: the embedded tiny models (built once, cached in .cache/) and the smoke run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPES = ("k1", "topk", "topk_tail")
# As in every Ray process of a run: importing verl registers opd_patches (opd_patches/registered.py).
os.environ["VERL_USE_EXTERNAL_MODULES"] = "opd_patches.registered"


@pytest.fixture(scope="session", autouse=True)
def private_run_lock(tmp_path_factory):
    """Training started by tests takes the one-run lock (opd_patches/ops/lock.py) in a folder of its own,
    so a user's own run does not block the suite and the suite does not block it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPD_LOCK_DIR", str(tmp_path_factory.mktemp("opd-lock")))
        mp.delenv("OPD_LOCK_HELD", raising=False)
        yield


def ray_env_of(run_dir, **opd):
    """The env vars `opd_patches.main.configure_ray` hands every Ray process for these `opd.*` keys
    (colocated teacher, one GPU); raises its ConfigError for a bad value."""
    from omegaconf import OmegaConf

    from opd_patches.main import configure_ray

    config = OmegaConf.create({
        "opd": {"teacher_placement": "colocated", **opd},
        "ray_kwargs": {"ray_init": {}}, "trainer": {"n_gpus_per_node": 1, "nnodes": 1},
    })
    configure_ray(config, run_dir)
    return config.ray_kwargs.ray_init.runtime_env.env_vars


@pytest.fixture(scope="session")
def embedded():
    """Paths of the tiny student, teacher, tokenizer and prompt parquet files that run.sh also uses."""
    from opd_patches.embedded.build import build

    return build(REPO / ".cache" / "embedded")


def sharpened(src, out, seed):
    """A copy of model folder `src` in `out` with its matrices re-drawn at std 0.3 (fixed seed).

    The embedded models are near-uniform, so greedy decoding just repeats a token and token-level
    comparisons prove nothing; sharp weights make outputs depend on the whole context.
    """
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3, generator=gen)
    model.save_pretrained(out)
    for f in Path(src).iterdir():  # tokenizer files, generation_config.json
        if f.is_file() and not (Path(out) / f.name).exists():
            shutil.copy(f, Path(out) / f.name)
    return Path(out)


@pytest.fixture(scope="session")
def smoke(tmp_path_factory):
    """`python -m opd_patches.smoke` for every recipe (the default, colocated teacher): (process, out dir)."""
    out = tmp_path_factory.mktemp("smoke")
    proc = subprocess.run(
        [sys.executable, "-m", "opd_patches.smoke", "--out", str(out), "--timeout", "400", "--recipes", *RECIPES],
        cwd=REPO, capture_output=True, text=True, timeout=1000,
    )
    return proc, out


