"""Recipes compose over VERL's ppo_trainer and pass VERL's own validation, with the seed's values; the
project's own `opd.*` keys are typed and validated once (opd_patches/config.py) and reach the workers.

Composition uses Hydra's compose API on recipes/ exactly as run.sh does (same overrides), then
VERL's `validate_config` and the dataclass conversions that the trainer performs at start-up.
"""

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config

import opd_patches  # noqa: F401  (registers the hf backend that the cpu device selects)
from opd_patches import config as opd_config
from opd_patches import main

import composed

REPO = Path(__file__).resolve().parents[1]
RECIPES = ("k1", "topk", "topk_tail")
DEVICES = ("cpu", "gpu", "gpu-hf")


def compose_recipe(recipe, *overrides, device="cpu"):
    return composed.compose_recipe(
        recipe,
        "actor_rollout_ref.model.path=/models/student",
        "distillation.teacher_models.teacher_model.model_path=/models/teacher",
        "data.train_files=/data/train.parquet",
        "data.val_files=/data/val.parquet",
        f"+device={device}",
        *overrides,
    )


def validate(config):
    """What the trainer checks before training: placement, VERL's validation, typed configs."""
    main.apply_placement(config)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    distillation = omega_conf_to_dataclass(config.distillation)
    omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    return distillation


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_validates(recipe, device):
    config = compose_recipe(recipe, device=device)
    distillation = validate(config)
    assert distillation.enabled
    assert not need_critic(config) and not need_reference_policy(config)
    assert config.trainer.use_v1 is True
    assert config.distillation.n_gpus_per_node == 1 and config.distillation.nnodes == 1


def test_k1_is_the_seed_baseline():
    c = compose_recipe("k1")
    loss = c.distillation.distillation_loss
    assert (loss.loss_mode, loss.use_policy_gradient, loss.use_task_rewards) == ("k1", True, False)
    assert (c.data.train_batch_size, c.actor_rollout_ref.rollout.n) == (2, 4)
    assert c.actor_rollout_ref.actor.optim.lr == 1e-6
    assert c.actor_rollout_ref.actor.optim.lr_scheduler_type == "constant"
    assert c.data.max_response_length == 7168 and c.actor_rollout_ref.rollout.temperature == 1.0
    assert c.data.shuffle is False
    assert (c.trainer.save_freq, c.trainer.max_actor_ckpt_to_keep, c.trainer.total_training_steps) == (20, 3, 2200)
    assert "hf_model" in c.actor_rollout_ref.actor.checkpoint.save_contents
    assert validate(c).distillation_loss.loss_settings.use_estimator


def test_topk_is_the_seed_candidate():
    c = compose_recipe("topk")
    loss = c.distillation.distillation_loss
    assert (loss.loss_mode, loss.topk, loss.use_policy_gradient, loss.use_task_rewards) == (
        "forward_kl_topk", 16, False, False)
    assert (c.data.train_batch_size, c.actor_rollout_ref.rollout.n) == (8, 4)
    assert c.actor_rollout_ref.actor.optim.lr == 1e-5
    assert c.actor_rollout_ref.actor.optim.lr_scheduler_type == "constant"
    assert c.data.shuffle is True and c.data.seed is not None
    assert (c.trainer.save_freq, c.trainer.max_actor_ckpt_to_keep, c.trainer.total_training_steps) == (50, 3, 2200)
    assert validate(c).distillation_loss.loss_settings.use_topk


@pytest.mark.parametrize("recipe", RECIPES)
def test_only_the_device_overlay_differs_between_cpu_and_gpu(recipe):
    def flat(cfg, prefix=""):
        out = {}
        for k, v in cfg.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    cpu = flat(OmegaConf.to_container(compose_recipe(recipe, device="cpu")))
    gpu = flat(OmegaConf.to_container(compose_recipe(recipe, device="gpu")))
    overlay_keys = set()
    for device in DEVICES:
        overlay = OmegaConf.load(REPO / "recipes" / "device" / f"{device}.yaml")
        overlay_keys |= set(flat(OmegaConf.to_container(overlay)))
    differing = {k for k in cpu.keys() | gpu.keys() if cpu.get(k) != gpu.get(k)}
    # Interpolations that follow the rollout name (the teacher's inference engine) count as overlay.
    follows_overlay = {"distillation.teacher_models.teacher_model.inference.name"}
    assert differing, "cpu and gpu compositions should differ in the device keys"
    assert differing <= overlay_keys | follows_overlay, differing - overlay_keys - follows_overlay


@pytest.mark.parametrize("recipe", RECIPES)
def test_smoke_overlay(recipe):
    c = compose_recipe(recipe, "+overlay=smoke")
    validate(c)
    assert c.trainer.total_training_steps == 2 and c.trainer.save_freq == 1
    assert c.trainer.resume_mode == "disable"
    assert "hf_model" in c.actor_rollout_ref.actor.checkpoint.save_contents
    # The loss settings stay the recipe's own.
    assert c.distillation.distillation_loss.loss_mode == compose_recipe(recipe).distillation.distillation_loss.loss_mode


def test_upstream_refuses_k1_without_policy_gradient():
    """The k1 recipe's PG flag is load-bearing: upstream validation rejects k1 as a direct loss."""
    c = compose_recipe("k1", "distillation.distillation_loss.use_policy_gradient=false")
    with pytest.raises(Exception, match="Directly backpropagating k1 loss"):  # Hydra wraps the ValueError
        validate(c)


def test_placement_errors_name_the_key():
    c = compose_recipe("k1", "opd.teacher_placement=elsewhere")
    with pytest.raises(main.ConfigError, match="opd.teacher_placement"):
        main.apply_placement(c)
    c = compose_recipe("k1", "opd.teacher_placement=colocated", "trainer.v1.trainer_mode=separate_async")
    with pytest.raises(main.ConfigError, match="colocated"):
        main.apply_placement(c)


@pytest.mark.parametrize("recipe", RECIPES)
def test_colocated_placement_selects_the_colocated_teacher(recipe, tmp_path, monkeypatch):
    c = compose_recipe(recipe, "opd.teacher_placement=colocated", "opd.teacher_offload=false",
                       "opd.teacher_canary_every=3")
    validate(c)
    assert c.trainer.v1.trainer_mode == "colocated_teacher" and c.trainer.v1.colocated_teacher.offload is False
    assert c.trainer.v1.colocated_teacher.canary_every == 3
    assert c.actor_rollout_ref.rollout.agent.agent_loop_manager_class == main.COLOCATED_AGENT_LOOP
    assert c.distillation.n_gpus_per_node == c.trainer.n_gpus_per_node  # no pool of its own
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    main.configure_ray(c, tmp_path)
    ray_init = c.ray_kwargs.ray_init
    assert ray_init.num_gpus == 1  # the student's GPU only
    assert ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES == "opd_patches.registered,opd_patches.trainers.colocated_teacher"


def test_missing_inputs_are_reported_by_key(tmp_path, embedded):
    """opd_patches.main.check_inputs names the key of a missing model or data file (the checks themselves:
    tests/test_inputs.py)."""
    from opd_patches.checks import InputError

    c = compose_recipe("k1")
    with pytest.raises(InputError, match=r"actor_rollout_ref\.model\.path=/models/student"):
        main.check_inputs(c)
    c = compose_recipe(
        "k1",
        f"actor_rollout_ref.model.path={embedded['student']}",
        f"distillation.teacher_models.teacher_model.model_path={embedded['teacher']}",
        f"data.train_files={embedded['train']}",
        f"data.val_files={tmp_path / 'nope.parquet'}",
    )
    with pytest.raises(InputError, match=r"data\.val_files=.*nope\.parquet: no such file"):
        main.check_inputs(c)
    with open_dict(c):
        c.data.val_files = str(embedded["val"])
    main.check_inputs(c)
    # A hub id ("org/name") must be in the local cache: these machines cannot download.
    with open_dict(c):
        c.distillation.teacher_models.teacher_model.model_path = "nobody/not-cached"
    with pytest.raises(InputError, match=r"teacher_model\.model_path=nobody/not-cached: .*local Hugging Face cache"):
        main.check_inputs(c)


# ---- the typed opd.* configuration (opd_patches/config.py) ---------------------------------------


def test_the_recipes_compose_the_dataclass_defaults():
    """recipes/base.yaml restates no default: the composed `opd` section is OpdConfig's, device overlays aside."""
    assert opd_config.of(compose_recipe("k1", device="gpu")) == opd_config.OpdConfig()
    cpu = opd_config.of(compose_recipe("topk"))
    assert cpu == opd_config.OpdConfig(background_export=False)  # cpu.yaml's one opd key
    assert opd_config.of(compose_recipe("k1", "opd.force=true", "opd.debug.save_steps=[2,4]")).force is True


@pytest.mark.parametrize("override, line", [
    ("opd.teacher_gpus=two", "opd.teacher_gpus='two': use an integer >= 1"),
    ("opd.teacher_canary_every=-1", "opd.teacher_canary_every=-1: use an integer >= 0"),
    ("opd.force=yes", "opd.force='yes': use true or false."),
    ("opd.lean_topk=null", "opd.lean_topk=null: use true or false."),
    ("opd.lean_topk_kernel=cuda", "opd.lean_topk_kernel='cuda': use one of auto, triton, torch."),
    ("opd.skip_old_log_prob=sometimes", "opd.skip_old_log_prob='sometimes': use one of auto, true, false."),
    ("opd.preflight=fast", "opd.preflight='fast': use one of off, cheap, full."),
    ("opd.reserve_s=-5", "opd.reserve_s=-5: use a number >= 0 (seconds)."),
    ("opd.wall_clock_s=0", "opd.wall_clock_s=0: use a number > 0 (seconds), or null."),
    ("opd.wall_clock_margin=0.5", "opd.wall_clock_margin=0.5: use a number >= 1"),
    ("opd.replay_poll_s=true", "opd.replay_poll_s=true: use a number > 0 (seconds)."),
    ("opd.debug.save_steps=[0]", "opd.debug.save_steps=[0]: use a list of step numbers (>= 1), or null."),
    ("opd.debug.inject_nan_into=grad", "opd.debug.inject_nan_into='grad': use one of loss, teacher."),
    ("opd.debug.profile_update=0", "opd.debug.profile_update=0: use an integer >= 1"),
    ("opd.debug=3", "opd.debug=3: a section of keys"),
    ("+opd.forse=true", "opd.forse is not a key: did you mean opd.force?"),
    ("+opd.debug.profle_update=2", "opd.debug.profle_update is not a key: did you mean opd.debug.profile_update?"),
    ("+opd.overlap=true", "opd.overlap no longer exists: it was never shipped"),
])
def test_each_bad_key_or_value_is_refused_with_one_line(override, line):
    with pytest.raises(opd_config.ConfigError) as err:
        opd_config.of(compose_recipe("k1", override))
    assert str(err.value).startswith(line) and "\n" not in str(err.value), str(err.value)


def test_every_renamed_key_names_its_replacement():
    for old, replacement in opd_config.RENAMED.items():
        with pytest.raises(opd_config.ConfigError, match=rf"^opd\.{old} no longer exists: "):
            opd_config.load({old: 1} if "." not in old else {old.split(".")[0]: {old.split(".")[1]: 1}})
        assert replacement


def test_unknown_key_on_the_command_line_names_the_nearest_before_hydra(tmp_path):
    """Hydra itself would only say 'To append to your config use +opd.forse=true'."""
    with pytest.raises(opd_config.ConfigError, match=r"opd.wall_clok_s is not a key: did you mean opd.wall_clock_s\?"):
        opd_config.check_overrides(["recipe=k1", "opd.wall_clok_s=100"])
    opd_config.check_overrides(["opd.wall_clock_s=100", "opd.debug.save_steps=[1]", "trainer.nnodes=1"])
    cmd = [sys.executable, "-m", "opd_patches.main", "--config-path", str(REPO / "recipes"), "--config-name", "k1",
           "opd.forse=true"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "[opd] config error: opd.forse is not a key: did you mean opd.force?"


def test_a_removed_environment_variable_is_refused_naming_its_key():
    with pytest.raises(opd_config.ConfigError, match="OPD_LEAN_TOPK is no longer read: set the recipe key opd.lean_topk "):
        opd_config.check_environment({"OPD_LEAN_TOPK": "0", "OPD_LOCK_DIR": "/tmp"})
    opd_config.check_environment({"OPD_LOCK_DIR": "/tmp", "OPD_CONFIG": "{}"})


WORKER = """
import json
from dataclasses import asdict
from opd_patches import config
from opd_patches.losses import lean_topk, sampled_logprob
print(json.dumps({"config": asdict(config.current()), "lean": lean_topk.enabled(),
                  "kernel": lean_topk.kernel_choice(), "fast": sampled_logprob.enabled()}))
"""


def _worker(env_vars):
    env = {k: v for k, v in os.environ.items() if k != opd_config.ENV}
    proc = subprocess.run([sys.executable, "-c", WORKER], env={**env, **env_vars}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.fresh_process
def test_the_drivers_config_reaches_a_worker_and_its_readers(tmp_path, monkeypatch):
    """The driver serializes the validated config once (OPD_CONFIG in Ray's runtime env); a fresh process with
    that environment parses the same dataclass, and the recipe keys reach the loss modules' switches."""
    c = compose_recipe("topk", "opd.lean_topk=false", "opd.lean_topk_kernel=torch", "opd.fast_logprobs=false",
                       "opd.wall_clock_s=3600", "opd.debug.save_steps=[1,3]")
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    main.configure_ray(c, tmp_path)
    env_vars = dict(c.ray_kwargs.ray_init.runtime_env.env_vars)
    driver = opd_config.of(c)
    assert driver.run_dir == str(tmp_path) and driver.debug.save_steps == (1, 3)
    seen = _worker({opd_config.ENV: env_vars[opd_config.ENV]})
    assert opd_config.load(seen["config"]) == driver
    assert (seen["lean"], seen["kernel"], seen["fast"]) == (False, "torch", False)
    # outside a run (no variable): the defaults
    alone = _worker({})
    assert opd_config.load(alone["config"]) == opd_config.OpdConfig()
    assert (alone["lean"], alone["kernel"], alone["fast"]) == (True, "auto", True)


def test_override_changes_the_process_config_for_a_block_only():
    from opd_patches.losses import lean_topk

    before = opd_config.current()
    with opd_config.override(lean_topk=not before.lean_topk, debug={"profile_update": 2}) as changed:
        assert lean_topk.enabled() is (not before.lean_topk) and opd_config.current() is changed
        assert changed.debug.profile_update == 2 and changed.debug.inject_nan_into == before.debug.inject_nan_into
    assert opd_config.current() is before
    with pytest.raises(opd_config.ConfigError, match="opd.lean_topk='no'"):
        with opd_config.override(lean_topk="no"):
            pass
    assert opd_config.current() is before


def test_the_serialized_value_round_trips():
    opd = opd_config.load({"reserve_s": 10, "debug": {"save_steps": [2], "finish_hold_s": 1}, "launched_at": 5.0})
    assert opd_config.loads(opd_config.dumps(opd)) == opd and isinstance(opd.reserve_s, float)
    assert json.loads(opd_config.dumps(opd)) == json.loads(json.dumps(asdict(opd)))
    with pytest.raises(opd_config.ConfigError, match="OPD_CONFIG is not JSON"):
        opd_config.loads("lean_topk=0")
