"""The `make patch` base (tag opd-base) is recorded by every install, explicit or implicit.

A newcomer's first command is often `make smoke`, which installs through the $(DEPS) prerequisite;
`make patch` later needs the tag. `make -n` prints what make would run for a missing venv.
"""

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("target", ["install", "smoke", "test", "patch"])
def test_an_implicit_install_records_the_patch_base(tmp_path, target):
    out = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}", "PROFILE=cpu"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    install = next(i for i, line in enumerate(lines) if "pip install" in line and "-r requirements/cpu.txt" in line)
    record = [i for i, line in enumerate(lines) if "patch.py record-base" in line]
    assert record and record[0] > install, out.stdout  # tagged after the install it belongs to
    if target == "patch":  # and before the patch is written against it
        assert record[0] < next(i for i, line in enumerate(lines) if "patch.py write" in line)
