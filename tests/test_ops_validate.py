"""Export validation (opd_patches/ops/validate.py): expected parameter count, dtype, run/state folders, CLI."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from opd_patches.ops import validate
from opd_patches.ops import receipts

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(embedded, tmp_path_factory):
    """A run folder whose step 2 is complete (the embedded student as its export), step 3 incomplete."""
    run = tmp_path_factory.mktemp("run")
    for step in (2, 3):
        export = run / f"global_step_{step}" / "actor" / "huggingface"
        shutil.copytree(embedded["student"], export)
    receipts.write(run / "global_step_2", 2, None)
    return run


def test_expected_count_and_dtype(embedded):
    student = embedded["student"]
    result = validate.validate_export(student, expected_params=validate.expected_parameters_for(student), dtype="float32")
    assert result["checks"]["parameter count"] == result["parameters"]
    assert result["stored_dtype"] == "float32" and "generate" in result["checks"]
    with pytest.raises(validate.ExportInvalid, match="parameter count: .* expected \\(given\\)") as exc:
        validate.validate_export(student, expected_params=result["parameters"] + 1)
    assert "load" in exc.value.checks and "parameter count" not in exc.value.checks
    with pytest.raises(validate.ExportInvalid, match="dtype: stored as float32, expected bfloat16"):
        validate.validate_export(student, dtype="bfloat16")


def test_loads_in_the_stored_dtype_unless_told(embedded, tmp_path):
    """A bf16 export is checked in bf16 (what vLLM loads), float32 on request; each stage is timed; the
    comparison with the (float32) initial model works across the two dtypes."""
    import torch
    from transformers import AutoModelForCausalLM

    export = tmp_path / "bf16"
    shutil.copytree(embedded["student"], export)
    model = AutoModelForCausalLM.from_pretrained(embedded["student"], dtype=torch.bfloat16)
    model.save_pretrained(export)
    result = validate.validate_export(export, initial=embedded["student"], dtype="bfloat16")
    assert result["loaded_as"] == result["stored_dtype"] == "bfloat16"
    assert set(result["seconds"]) == {"files", "load", "finite", "initial", "generate"}
    assert result["max_abs_change_vs_initial"] > 0  # the bf16 rounding of the float32 initial weights
    upcast = validate.validate_export(export, load_dtype="float32")
    assert upcast["loaded_as"] == "float32" and upcast["parameters"] == result["parameters"]


def test_known_student_count():
    # The table answers without a download; the figure is R1-Distill-Qwen-1.5B's (untied embeddings).
    assert validate.expected_parameters_for("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B") == 1_777_088_000


def test_r1_architecture_config_derives_the_same_count():
    r1_arch = pytest.importorskip("opd_patches.embedded.r1_arch")
    count = validate.expected_parameter_count(r1_arch.r1_distill_config())  # meta device: no memory
    assert count == validate.KNOWN_PARAMETER_COUNTS["DeepSeek-R1-Distill-Qwen-1.5B"] == 1_777_088_000


def test_resolve_run_and_state_folders(run_dir):
    assert validate.resolve_export(run_dir) == run_dir / "global_step_2" / "actor" / "huggingface"  # newest complete
    assert validate.resolve_export(run_dir / "global_step_3") == run_dir / "global_step_3" / "actor" / "huggingface"
    export = run_dir / "global_step_3" / "actor" / "huggingface"
    assert validate.resolve_export(export) == export


@pytest.mark.fresh_process
def test_cli_on_a_run_folder(run_dir, embedded, tmp_path):
    out = tmp_path / "v.json"
    proc = subprocess.run([sys.executable, "-m", "opd_patches.ops.validate", str(run_dir), "--expected-from",
                           str(embedded["student"]), "--json", str(out)], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["valid"] and result["export"].endswith("global_step_2/actor/huggingface")
    (run_dir / "global_step_3" / "actor" / "huggingface" / "generation_config.json").unlink()
    proc = subprocess.run([sys.executable, "-m", "opd_patches.ops.validate", str(run_dir / "global_step_3"), "--json",
                           str(out)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 1 and "generation config" in json.loads(out.read_text())["reason"]
