"""run.sh launched on the embedded tiny models for a run that must be refused before Ray starts."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def refused(tmp_path, embedded, *overrides, recipe="k1", **env) -> str:
    """run.sh `recipe=RECIPE +overlay=smoke OVERRIDES` on a CPU with `env` over the embedded models' paths (a None
    value unsets the variable): asserts exit 2, no traceback and no Ray session folder; the last stderr line."""
    ray_tmp = tmp_path / "ray"  # Ray would create its session folder here: it must stay absent
    full = {**os.environ, "DEVICE": "cpu", "OUTPUT_DIR": str(tmp_path / "run"), "PYTHON": sys.executable,
            "RAY_TMPDIR": str(ray_tmp), "STUDENT": str(embedded["student"]), "TEACHER": str(embedded["teacher"]),
            "TRAIN_FILES": str(embedded["train"]), "VAL_FILES": str(embedded["val"]), **env}
    full = {k: v for k, v in full.items() if v is not None}
    full.pop("OPD_LOCK_HELD", None)
    out = subprocess.run([str(REPO / "run.sh"), f"recipe={recipe}", "+overlay=smoke", *overrides], env=full,
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    text = out.stdout + out.stderr
    assert out.returncode == 2 and "Traceback" not in text, text[-3000:]
    assert not ray_tmp.exists() and "ray init" not in text.lower()
    return out.stderr.strip().splitlines()[-1]
