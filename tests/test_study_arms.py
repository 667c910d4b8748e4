"""Ablation arms (opd_patches/study/arms.py): the knob table, Hydra values, and k1 -> topk composed for
real over recipes/ + pkg://verl.trainer.config: four knobs, six arms, each accepted by upstream's own
validation, while a knob split apart (loss_mode alone) is refused, which is why its keys form one knob.
"""

import json

import pytest
import yaml

from opd_patches.study import arms
from opd_patches.study.spec import load

LOSS = "distillation.distillation_loss."


@pytest.mark.parametrize("key, knob", [
    (LOSS + "loss_mode", "loss"), (LOSS + "use_policy_gradient", "loss"), (LOSS + "topk", "loss"),
    (LOSS + "policy_loss_mode", "loss"), (LOSS + "use_task_rewards", "task_rewards"),
    ("data.train_batch_size", "batch"), ("actor_rollout_ref.actor.ppo_mini_batch_size", "batch"),
    ("actor_rollout_ref.actor.optim.lr", "lr"), ("actor_rollout_ref.actor.optim.lr_scheduler_type", "lr"),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps", "lr"), ("actor_rollout_ref.actor.optim.weight_decay", "optimizer"),
    ("data.shuffle", "data_order"), ("data.seed", "data_order"), ("actor_rollout_ref.rollout.n", "samples_per_prompt"),
    ("actor_rollout_ref.rollout.temperature", "actor_rollout_ref.rollout.temperature"),  # no row: its own knob
])
def test_knob_table(key, knob):
    assert arms.knob_of(key) == knob


def test_diff_skips_bookkeeping_and_keeps_interpolations():
    a = {"trainer.save_freq": 20, "trainer.experiment_name": "k1", "x.mini": "${data.train_batch_size}", "data.seed": None}
    b = {"trainer.save_freq": 50, "trainer.experiment_name": "topk", "x.mini": "${data.train_batch_size}", "data.seed": 42,
         "y.new": 1}
    d = arms.diff(a, b)
    assert d == {"data.seed": (None, 42), "y.new": (arms.ABSENT, 1)}
    assert arms.diff(a, b, exclude=("data.seed",)) == {"y.new": (arms.ABSENT, 1)}
    assert arms.override_for("y.new", arms.ABSENT, 1) == "+y.new=1"
    assert arms.override_for("data.seed", 1, arms.ABSENT) == "~data.seed"


@pytest.mark.parametrize("value, text", [
    (None, "null"), (True, "true"), (1e-05, "1e-05"), (8, "8"), ("forward_kl_topk", "forward_kl_topk"),
    ("${data.train_batch_size}", "${data.train_batch_size}"), ("a b", "'a b'"), ("true", "'true'"), ("12", "'12'"),
    ([1, "x"], "[1,x]"), ({"a": 1}, "{a:1}"),
])
def test_hydra_values(value, text):
    assert arms.hydra_value(value) == text


@pytest.fixture(scope="module")
def k1_topk():
    return arms.ablation("k1", "topk")


@pytest.mark.slow
def test_k1_vs_topk_arms(k1_topk):
    r = k1_topk
    assert list(r["knobs"]) == ["loss", "batch", "lr", "data_order"]
    assert r["knobs"]["loss"]["keys"] == {LOSS + "loss_mode": ["k1", "forward_kl_topk"], LOSS + "topk": [None, 16],
                                          LOSS + "use_policy_gradient": [True, False]}
    assert r["knobs"]["batch"]["overrides"] == ["data.train_batch_size=8"]
    assert r["knobs"]["lr"]["overrides"] == ["actor_rollout_ref.actor.optim.lr=1e-05"]
    assert r["knobs"]["data_order"]["overrides"] == ["data.seed=42", "data.shuffle=true"]
    assert [(a["name"], a["recipe"]) for a in r["arms"]] == [
        ("k1", "k1"), ("k1+loss", "k1"), ("k1+batch", "k1"), ("k1+lr", "k1"), ("k1+data_order", "k1"), ("topk", "topk")]
    assert all(a["valid"] is None for a in r["arms"])  # upstream accepts every arm
    assert r["arms"][1]["overrides"] == r["knobs"]["loss"]["overrides"]


@pytest.mark.slow
def test_split_knob_is_refused(k1_topk):
    # loss_mode without topk / policy-gradient flag: upstream refuses, so they must change together
    alone = arms.compose("k1", [*arms.PLACEHOLDERS, LOSS + "loss_mode=forward_kl_topk"])
    assert "topk must be specified" in arms.check_valid(alone)
    no_pg = arms.compose("k1", [*arms.PLACEHOLDERS, LOSS + "use_policy_gradient=false"])
    assert arms.check_valid(no_pg) is not None
    odd = arms.compose("k1", [*arms.PLACEHOLDERS, "data.train_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size=2"])
    assert "not a multiple" in arms.check_valid(odd)


@pytest.mark.slow
def test_spec_ablate_and_cli(tmp_path, k1_topk, capsys):
    spec_path = tmp_path / "ab.yaml"
    spec_path.write_text(yaml.safe_dump({
        "overrides": ["+overlay=smoke"], "ablate": {"control": "k1", "treatment": "topk"}, "seeds": [1],
        "budget": {"steps": 2}, "eval": {"suites": ["math500"]}}))
    spec = load(spec_path)
    # the smoke overlay sets the batch in both (no batch knob); the study's seeds are no knob (data.seed)
    assert [a.name for a in spec.arms] == ["k1", "k1+loss", "k1+lr", "k1+data_order", "topk"]
    assert spec.arm("k1+data_order").overrides == ["data.shuffle=true"] and spec.control == "k1"
    # The CLI's function in this process (VERL already imported here: a fresh one would import it again).
    # Shared end-to-end runs work in threads of this process meanwhile: their lines may surround the JSON
    # in the captured output (never split it: it is printed in one write), so it is read from its first line.
    capsys.readouterr()
    assert arms.main(["--control", "k1", "--treatment", "topk", "--json"]) == 0
    out = capsys.readouterr().out
    printed, _ = json.JSONDecoder().raw_decode(out, out.index("{\n"))
    assert [a["name"] for a in printed["arms"]] == [a["name"] for a in k1_topk["arms"]]
