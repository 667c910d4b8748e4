"""Recipes compose over VERL's ppo_trainer and pass VERL's own validation, with the seed's values.

Composition uses Hydra's compose API on recipes/ exactly as run.sh does (same overrides), then
VERL's `validate_config` and the dataclass conversions that the trainer performs at start-up.
"""

from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config

import opd_patches  # noqa: F401  (registers the hf backend that the cpu device selects)
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
