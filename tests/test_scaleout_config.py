"""Multi-node configuration: every recipe composes and validates for 2 nodes x 8 GPUs (nothing started).

What a launch on N nodes x M GPUs checks before any worker exists: Hydra composition with run.sh's
overrides plus `trainer.nnodes` / `trainer.n_gpus_per_node`, the project's placement, VERL's own
`validate_config`, the typed actor and rollout configs (the actor's `validate(n_gpus, train_batch_size)`
is what upstream's workers call), and the Ray environment every process on every node receives. A key
that breaks multi-node launches fails here. docs/scale-out.md has the commands.
"""

import math

import pytest
from omegaconf import OmegaConf
from test_config import compose_recipe, validate
from verl.utils.config import omega_conf_to_dataclass

from opd_patches import main

NODES, GPUS = 2, 8
WORLD = NODES * GPUS


def compose_multinode(recipe, *overrides):
    return compose_recipe(recipe, f"trainer.nnodes={NODES}", f"trainer.n_gpus_per_node={GPUS}", *overrides,
                          device="gpu")


@pytest.mark.parametrize("recipe", ["k1", "topk", "topk_tail"])
def test_recipe_validates_on_two_nodes_of_eight(recipe, tmp_path):
    config = compose_multinode(recipe)
    validate(config)
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (NODES, GPUS)
    # Colocated teacher: no teacher pool; the teacher shards its scoring over the actor's 16 ranks.
    assert config.opd.teacher_placement == "colocated"
    assert config.trainer.v1.trainer_mode == "colocated_teacher"
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    actor.validate(n_gpus=WORLD, train_batch_size=config.data.train_batch_size)
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    assert rollout.tensor_model_parallel_size == 1  # one vLLM replica per GPU: 16 replicas
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("VERL_PLATFORM", raising=False)  # a GPU launch: Ray counts the nodes' real GPUs
        main.configure_ray(config, tmp_path)
    env = config.ray_kwargs.ray_init.runtime_env.env_vars
    assert "opd_patches.trainers.colocated_teacher" in env["VERL_USE_EXTERNAL_MODULES"].split(",")
    assert env["VERL_FILE_LOGGER_PATH"] == str(tmp_path / "metrics.jsonl")
    assert OmegaConf.select(config, "ray_kwargs.ray_init.num_gpus") is None  # a cluster brings its own GPUs


@pytest.mark.parametrize("recipe, padding", [("topk", 0), ("k1", WORLD - 8)])
def test_seed_batches_on_sixteen_ranks(recipe, padding):
    """Upstream pads each step's batch up to a multiple of lcm(data-parallel size, mini-batch samples)
    (trainer_base._get_required_batch_multiple): the seed's topk batch (8 x 4 = 32) splits evenly over 16
    ranks; k1's (2 x 4 = 8) gets 8 padding sequences, so scale k1's batch with the GPU count."""
    config = compose_multinode(recipe)
    samples = config.data.train_batch_size * config.actor_rollout_ref.rollout.n
    mini = config.actor_rollout_ref.actor.ppo_mini_batch_size * config.actor_rollout_ref.rollout.n
    multiple = math.lcm(WORLD, mini)
    assert -(-samples // multiple) * multiple - samples == padding


def test_standalone_teacher_pool_spans_the_nodes():
    config = compose_multinode("topk", "opd.teacher_placement=standalone", "opd.teacher_gpus=2")
    validate(config)
    assert (config.distillation.nnodes, config.distillation.n_gpus_per_node) == (NODES, 2)
