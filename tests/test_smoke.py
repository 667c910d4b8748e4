"""End to end: `python -m tools.smoke` (what `make smoke` runs) on the embedded default.

One session-scoped run of the three recipes (conftest.smoke, about 80 s each on 2 cores) is shared by
every test here and by the colocated-teacher tests; the task-reward run uses the standalone teacher,
so both placements run end to end.
"""

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
from background import shared_run
from conftest import RECIPES, smoke_cli

pytestmark = pytest.mark.slow


def test_smoke_passes_for_both_recipes(smoke):
    proc, out = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "smoke.json").read_text())
    assert [r["recipe"] for r in results] == list(RECIPES) and all(r["ok"] for r in results)
    for r in results:
        v = r["validation"]
        assert v["max_abs_change_vs_initial"] > 0 and v["parameters"] > 0 and v["generated"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_step_saved_with_an_hf_export(smoke, recipe):
    run = smoke[1] / recipe
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    for step in (1, 2):
        hf = run / f"global_step_{step}" / "actor" / "huggingface"
        assert (hf / "model.safetensors").stat().st_size > 0 and (hf / "tokenizer.json").exists()


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_save_of_a_tiny_export_is_validated_in_process(smoke, recipe):
    """Step 1's tiny export is validated by the trainer before its background finish, the last save's by its
    finish; neither starts the CPU child (a real model's export goes there: tests/test_ops_finish.py)."""
    run = smoke[1] / recipe
    stages = {step: set(json.loads((run / f"global_step_{step}" / "receipt.json").read_text())["validation"]["seconds"])
              for step in (1, 2)}
    for step in (1, 2):
        assert {"finite", "generate"} <= stages[step] and "child start" not in stages[step], stages
    log = run.joinpath("run.log").read_text()
    assert log.count("; validation stages ") == 2 and "validation stages child start" not in log


@pytest.mark.parametrize("recipe", RECIPES)
def test_manifest_records_what_produced_the_run(smoke, recipe):
    m = json.loads((smoke[1] / recipe / "manifest.json").read_text())
    pin = (REPO / "verl_vendor" / "pin.toml").read_text()
    assert m["verl_wheel"]["sha256"] in pin and m["packages"]["verl"] == "0.9.1"
    assert m["packages"]["torch"] and m["packages"]["transformers"] == "5.9.0"
    assert re.fullmatch(r"[0-9a-f]{40}", m["git"]["commit"] or "")
    assert m["config"]["trainer"]["experiment_name"] == recipe
    assert m["config"]["trainer"]["default_local_dir"] == str(smoke[1] / recipe)
    assert "actor_rollout_ref.rollout.seed" in m["seeds"]


def test_metrics_jsonl_has_each_step_and_the_loss(smoke):
    for recipe, key in (("k1", "actor/distillation/loss"), ("topk", "actor/distillation/clamped_frac"),
                        ("topk_tail", "actor/distillation/tail_share")):
        rows = [json.loads(line) for line in (smoke[1] / recipe / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        assert all(key in r["data"] and "timing_s/step" in r["data"] for r in rows), recipe


@pytest.mark.parametrize("recipe", RECIPES)
def test_rollout_received_the_weights_of_every_step(smoke, recipe):
    log = (smoke[1] / recipe / "run.log").read_text()
    steps = {int(s) for s in re.findall(r"\[hf rollout\] replica 0: loaded \d+ tensors for step (\d+)", log)}
    assert {1, 2} <= steps, steps


def test_console_shows_the_composed_config(smoke):
    log = (smoke[1] / "topk" / "run.log").read_text()
    assert "[opd] composed config" in log
    assert re.search(r"distillation\.distillation_loss\.loss_mode\s+forward_kl_topk", log)
    assert re.search(r"distillation\.distillation_loss\.topk\s+16", log)


def test_tail_loss_is_never_negative_and_reports_its_parts(smoke):
    rows = [json.loads(line)["data"] for line in (smoke[1] / "topk_tail" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["actor/distillation/loss_min"] >= -1e-6  # no clamp, yet a true KL is >= 0
        assert 0.0 <= r["actor/distillation/tail_share"] <= 1.0
        assert {"actor/distillation/tail_loss", "actor/distillation/teacher_mass", "actor/distillation/student_mass"} <= r.keys()


# topk_tail with task rewards mixed in (coefficient 0.5), with upstream's standalone teacher (hf backend).
smoke_mixed = shared_run("smoke_mixed", smoke_cli(
    ["topk_tail"], "distillation.distillation_loss.use_task_rewards=true",
    "distillation.distillation_loss.distillation_loss_coef=0.5", "opd.teacher_placement=standalone"))


@pytest.fixture(scope="session")
def mixed(smoke_mixed):
    assert smoke_mixed.returncode == 0, smoke_mixed.log[-3000:]
    return smoke_mixed.out


def test_task_reward_mixing_scales_the_distillation_loss(mixed):
    manifest = json.loads((mixed / "topk_tail" / "manifest.json").read_text())
    assert manifest["config"]["trainer"]["v1"]["trainer_mode"] == "opd_sync"  # standalone: sync + ops mixin
    assert manifest["config"]["reward"]["custom_reward_function"]["path"] == "pkg://opd_patches.task.reward"
    rows = [json.loads(line)["data"] for line in (mixed / "topk_tail" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert "critic/score/mean" in r and "actor/pg_loss" in r  # the reward and policy-gradient path ran
        expected = r["actor/pg_loss"] + 0.5 * r["actor/distillation/loss"]
        assert r["actor/loss"] == pytest.approx(expected, rel=1e-4, abs=1e-7)
