"""`opd.skip_old_log_prob` (opd_patches/teacher/old_log_prob.py): no student forward the loss does not use.

1. Config: which mode each recipe resolves to, and every refusal of `true` names the key and the reason.
2. Engine (VERL's real FSDP2 engine, the machinery of test_loss_invariance.py): k1 with old log-probs
   from the update's own forward (the patched `distillation_ppo_loss` that `init_model` binds) gives
   the same loss and gradients as k1 with upstream's old-log-prob pass, on one and on several
   micro-batches; the update's entropy metric equals the pass's `actor/entropy`.
3. The guard of the patch: the upstream names it wraps still exist and have the shape it assumes.
4. End to end (slow): the real 2-step CPU trainer, k1 and topk_tail with the key on (the shared smoke run,
   auto) and off (the bench's runs, tests/flag_runs.py): the same per-step losses and gradient norms, and the
   pass's time gone.
"""

import inspect
import json
import os
import subprocess
import sys
from functools import partial

import pytest
import torch
from fresh_verl import facts
from test_config import compose_recipe
# fixtures; topk_path is autouse: upstream's top-k path unless a test asks for another
from test_loss_invariance import (  # noqa: F401
    N_SEQ,
    RECIPE_OF,
    Setup,
    batches,
    compose,
    engine,
    forward_only,
    make_sequences,
    metric_values,
    model_dir,
    platform,
    process_group,
    run,
    to_batch,
    topk_path,
)

import opd_patches
from opd_patches import config as opd_config
from opd_patches.main import ConfigError, apply_old_log_prob
from opd_patches.teacher import old_log_prob as olp

opd_patches.register()


# ---- 1. config ---------------------------------------------------------------------------------


def resolved(recipe, *overrides):
    config = compose_recipe(recipe, *overrides)
    return olp.resolve(config)[0]


@pytest.mark.parametrize("recipe, mode", [("k1", olp.FROM_UPDATE), ("topk", olp.SKIP), ("topk_tail", olp.SKIP)])
def test_recipes_resolve_auto(recipe, mode):
    assert compose_recipe(recipe).opd.skip_old_log_prob == "auto"
    assert resolved(recipe) == mode
    assert resolved(recipe, "opd.skip_old_log_prob=true") == mode
    assert resolved(recipe, "opd.skip_old_log_prob=false") == olp.COMPUTE


REFUSALS = [
    ("k1", ["actor_rollout_ref.actor.ppo_epochs=2"], "ppo_epochs=2"),
    ("k1", ["actor_rollout_ref.actor.ppo_mini_batch_size=1"], "ppo_mini_batch_size=1"),
    ("topk", ["distillation.distillation_loss.use_task_rewards=true", "actor_rollout_ref.actor.ppo_epochs=2"],
     "use_task_rewards"),
    ("topk", ["algorithm.use_kl_in_reward=true"], "use_kl_in_reward"),
    ("topk", ["algorithm.adv_estimator=optimal_token_baseline"], "adv_estimator"),
    ("topk", ["algorithm.rollout_correction.rollout_is=token"], "rollout_is"),
    ("k1", ["algorithm.rollout_correction.bypass_mode=true"], "bypass_mode"),
    ("topk", ["opd.teacher_placement=standalone"], "teacher_placement"),
]


@pytest.mark.parametrize("recipe, overrides, named", REFUSALS)
def test_true_is_refused_where_not_identical_and_auto_falls_back(recipe, overrides, named):
    assert resolved(recipe, *overrides) == olp.COMPUTE  # auto
    config = compose_recipe(recipe, *overrides, "opd.skip_old_log_prob=true")
    with pytest.raises(ConfigError, match=rf"opd.skip_old_log_prob=true would change the run: .*{named}"):
        apply_old_log_prob(config)


def test_bad_value_names_the_key():
    with pytest.raises(ConfigError, match="opd.skip_old_log_prob='sometimes'"):
        apply_old_log_prob(compose_recipe("k1", "opd.skip_old_log_prob=sometimes"))


def test_apply_sets_the_upstream_keys(capsys):
    config = compose_recipe("topk")
    apply_old_log_prob(config)
    assert config.trainer.v1.colocated_teacher.old_log_prob == olp.SKIP
    assert config.actor_rollout_ref.actor.calculate_entropy is True
    assert config.actor_rollout_ref.actor.fsdp_config.entropy_from_logits_with_chunking is True
    assert config.algorithm.rollout_correction is None
    assert olp.entropy_detached(config)
    assert "[opd] old log-probs: skip" in capsys.readouterr().out
    off = compose_recipe("topk", "opd.skip_old_log_prob=false")
    apply_old_log_prob(off)
    assert off.trainer.v1.colocated_teacher.old_log_prob == olp.COMPUTE
    assert off.algorithm.rollout_correction is not None and not olp.entropy_detached(off)


# ---- 2. engine: k1's old log-probs from the update == upstream's pass ----------------------------


@pytest.fixture(scope="module")
def setups(model_dir):
    """test_loss_invariance's configs, with the attention main.py resolves on the CPU (sdpa)."""
    extra = ["+actor_rollout_ref.model.override_config.attn_implementation=sdpa"]
    return {mode: Setup(compose(recipe, model_dir, extra)) for mode, recipe in RECIPE_OF.items()}


def patched_loss_fn(setup):
    """What ActorRolloutRefWorker.init_model binds: engine_workers' (patched) distillation_ppo_loss."""
    import verl.workers.engine_workers as workers

    assert getattr(workers.distillation_ppo_loss, "_opd_patched", False)
    return partial(workers.distillation_ppo_loss, config=setup.actor_config, distillation_config=setup.distillation_config)


class Variant:
    """A Setup with another loss function and extra non-tensor keys on the update batch."""

    def __init__(self, setup, loss_fn, **flags):
        self.__dict__.update(setup.__dict__)
        self.loss_fn, self.flags = loss_fn, flags


def run_with(engine, variant, samples, split):
    from verl.utils import tensordict_utils as tu

    import test_loss_invariance as inv

    original = inv.to_batch

    def to_batch_with_flags(s, setup, sp):
        td = original(s, setup, sp)
        tu.assign_non_tensor(td, **variant.flags)
        return td

    inv.to_batch = to_batch_with_flags
    try:
        return run(engine, variant, samples, split)
    finally:
        inv.to_batch = original


@pytest.fixture(scope="module")
def k1_pass(engine, setups, batches):
    """k1 samples whose old_log_probs are upstream's pass (the engine's no-grad forward of the same
    weights, sliced to the response as trainer_base does), and the same samples without them."""
    setup = setups["k1"]
    _, log_probs = forward_only(engine, setup, make_sequences())
    with_old, without = [], []
    for sample, lp in zip(batches["k1"], log_probs, strict=True):
        r = sample["responses"].shape[0]
        with_old.append({**sample, "old_log_probs": lp[-r - 1 : -1].float()})
        without.append({k: v for k, v in sample.items() if k != "old_log_probs"})
    return with_old, without


@pytest.mark.parametrize("split", [("static", N_SEQ), ("dynamic", 30)])
def test_k1_old_from_update_equals_the_pass(engine, setups, k1_pass, split):
    setup = setups["k1"]
    with_old, without = k1_pass
    flags = {olp.UPDATE_FLAG: True, olp.ENTROPY_FLAG: True, "calculate_entropy": True}
    ref_loss, ref_grad, ref_out, _ = run_with(engine, Variant(setup, patched_loss_fn(setup)), with_old, split)
    loss, grad, out, _ = run_with(engine, Variant(setup, patched_loss_fn(setup), **flags), without, split)
    assert len(out["loss"]) == len(ref_out["loss"]) and (split[0] == "static" or len(out["loss"]) > 1)
    assert ref_grad.abs().max() > 0 and ref_loss != 0
    # The pass packs all sequences into one forward; the update packs each micro-batch: fp32 rounding
    # then moves the pass's log-probs by ~1e-7 (its ratio is 1 +- that), ours give exactly 1. Measured:
    # equal on one micro-batch, within 1.2e-6 of the largest gradient entry on the dynamic split.
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-8)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5 * ref_grad.abs().max().item())
    # Ratio exactly 1 from the update; the pass's PPO statistics are ~0 too (the same weights).
    assert all(v == 0.0 for v in metric_values(out, "distillation/ppo_kl"))
    assert all(v == 0.0 for v in metric_values(out, "distillation/pg_clipfrac"))
    assert max(abs(v) for v in metric_values(ref_out, "distillation/ppo_kl")) < 1e-6


def test_k1_without_old_log_probs_and_without_the_flag_fails(engine, setups, k1_pass):
    """The patch only acts on the trainer's mark: an unmarked batch without old_log_probs is upstream's error."""
    setup = setups["k1"]
    with pytest.raises(KeyError, match="old_log_probs"):
        run_with(engine, Variant(setup, patched_loss_fn(setup)), k1_pass[1], ("static", N_SEQ))


@pytest.mark.parametrize("mode, topk_path", [("k1", "upstream"), ("forward_kl_topk", "upstream"),
                                             ("forward_kl_topk", "lean")], indirect=["topk_path"])
def test_entropy_metric_from_the_update_equals_the_pass(engine, setups, batches, k1_pass, mode, topk_path):
    """trainer_base._compute_old_log_prob's actor/entropy: agg_loss of the pass's entropy (token-mean
    over the batch); the update's micro-batch parts add up to it."""
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    setup = setups[mode]
    samples = k1_pass[1] if mode == "k1" else batches[mode]
    data = to_batch(make_sequences(), setup, ("static", N_SEQ))
    tu.assign_non_tensor(data, distillation_use_topk=False, distillation_only=False, calculate_entropy=True)
    with engine.eval_mode(), torch.no_grad():
        passed = engine.forward_backward_batch(data, None, forward_only=True)
    entropy = no_padding_2_padding(passed["model_output"]["entropy"], data)
    mask = data["response_mask"].to_padded_tensor(0).bool()
    expected = agg_loss(loss_mat=entropy, loss_mask=mask, loss_agg_mode=setup.actor_config.loss_agg_mode).item()

    flags = {olp.UPDATE_FLAG: mode == "k1", olp.ENTROPY_FLAG: True, "calculate_entropy": True}
    _, grad, out, _ = run_with(engine, Variant(setup, patched_loss_fn(setup), **flags), samples, ("dynamic", 30))
    parts = metric_values(out, "actor/entropy")
    assert len(parts) > 1 and sum(parts) == pytest.approx(expected, rel=1e-5)
    plain = Variant(setup, patched_loss_fn(setup), **{olp.UPDATE_FLAG: mode == "k1"})
    _, ref_grad, _, _ = run_with(engine, plain, samples, ("dynamic", 30))
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)  # entropy_coeff 0: not part of the loss
    assert bool(topk_path.lean_calls) == (topk_path.name == "lean" and mode != "k1")  # the path asked for ran


# ---- 3. guard: what the patches assume about upstream ---------------------------------------------


def test_guard_upstream_shapes():
    import verl.utils.torch_functional as verl_F
    import verl.workers.engine_workers as workers
    from verl.trainer.distillation import losses
    from verl.trainer.ppo.v1 import trainer_base
    from verl.workers.engine.fsdp import transformer_impl

    # init_model binds the module-level name (patched) into the actor's loss function.
    init_src = inspect.getsource(workers.ActorRolloutRefWorker.init_model)
    assert "partial(\n                    distillation_ppo_loss," in init_src
    assert workers.distillation_ppo_loss.__wrapped__ is losses.distillation_ppo_loss
    params = list(inspect.signature(losses.distillation_ppo_loss).parameters)
    assert params[:4] == ["config", "distillation_config", "model_output", "data"] and "student_logits" in params
    # The readers of old_log_probs the loss patch feeds: both read data["old_log_probs"].
    assert 'data["old_log_probs"]' in inspect.getsource(losses.distillation_loss)
    assert '"old_log_probs"' in inspect.getsource(__import__("verl.workers.utils.losses", fromlist=["x"]).ppo_loss)
    # The pass the trainer skips, and the keys it writes.
    src = inspect.getsource(trainer_base.PPOTrainer._compute_old_log_prob)
    assert 'data.select("old_log_probs", "entropy")' in src and '"actor/entropy"' in src
    # The update's entropy switch, and the engine reading the entropy functions at construction.
    assert "self.config.actor_rollout_ref.actor.calculate_entropy" in inspect.getsource(trainer_base.PPOTrainer._update_actor)
    init = inspect.getsource(transformer_impl.FSDPEngine.__init__)
    assert "verl_F.entropy_from_logits_with_chunking" in init and "verl_F.entropy_from_logits\n" in init
    assert callable(verl_F.entropy_from_logits) and callable(verl_F.entropy_from_logits_with_chunking)


def run_detached(code: str) -> None:
    """Run `code` (ending in print('ok')) in a fresh process whose config says the update's entropy is a metric
    only (entropy_detached), as a skipping run's Ray workers get it."""
    env = {**os.environ, **opd_config.env(entropy_detached=True)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


@pytest.mark.fresh_process
def test_entropy_detached_in_a_fresh_process():
    """With entropy_detached in the run's config (main resolves it for every Ray process), the entropy keeps no graph and has the
    original's values (a colocated run's Ray process: tests/fresh_verl.py)."""
    assert facts("colocated")["entropy_detached"] == {"entropy_from_logits": True, "entropy_from_logits_with_chunking": True}


# ---- 4. end to end: the real trainer, key on (the smoke run: auto) and off ------------------------


@pytest.fixture(scope="module")
def runs_off(k1_skip_off, topk_tail_skip_off):
    """The shared runs of k1 and topk_tail with the pass on (tests/conftest.py), metrics rows per recipe."""
    rows = {}
    for recipe, run in (("k1", k1_skip_off), ("topk_tail", topk_tail_skip_off)):
        metrics = run / "metrics.jsonl"
        assert metrics.exists(), (run / "run.log").read_text(errors="replace")[-3000:]
        rows[recipe] = [json.loads(line)["data"] for line in metrics.read_text().splitlines()]
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["k1", "topk_tail"])
def test_end_to_end_same_losses_and_grad_norms(smoke, runs_off, recipe):
    proc, out = smoke
    run_dir = out / recipe
    assert "[opd] old log-probs: " + {"k1": olp.FROM_UPDATE, "topk_tail": olp.SKIP}[recipe] in (run_dir / "run.log").read_text()
    on = [json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    off = runs_off[recipe]
    assert len(on) == len(off) == 2
    for step, (a, b) in enumerate(zip(on, off, strict=True), start=1):
        assert a["response_length/mean"] == b["response_length/mean"], step  # same rollouts
        for key in ("actor/distillation/loss", "actor/loss", "actor/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (recipe, step, key, a[key], b[key])
        # The pass's entropy is computed on the whole batch's logits as the CPU autocast leaves them; the
        # update's in fp32 chunks (entropy_from_logits_with_chunking): equal up to bf16 rounding.
        assert a["actor/entropy"] == pytest.approx(b["actor/entropy"], rel=2e-2), (recipe, step)
        assert "timing_s/teacher" in a and not any(k.startswith("rollout_corr/") for k in a)


@pytest.mark.fresh_process
def test_entropy_detached_never_compiles_and_chunks_exactly():
    """VERL wraps the entropy in torch.compile(dynamic=True); on the H200 dynamo recompiled our metric-only
    wrapper for every micro-batch length (recompile_limit hit inside the update). It must run eager, with
    the values of the original, chunked or not."""
    code = (
        "import torch, opd_patches.registered, verl.utils.torch_functional as F\n"
        "from opd_patches.patches import entropy_from_logits as up\n"
        "up.ENTROPY_ROWS = 3\n"
        "graphs = []\n"
        "def backend(gm, example_inputs):\n"
        "    graphs.append(gm)\n"
        "    return gm.forward\n"
        "for name in ('entropy_from_logits', 'entropy_from_logits_with_chunking'):\n"
        "    f = getattr(F, name)\n"
        "    compiled = torch.compile(f, dynamic=True, backend=backend)\n"
        "    for rows in (2, 7, 11):\n"
        "        z = torch.randn(rows, 13, requires_grad=True)\n"
        "        got = compiled(z)\n"
        "        assert not got.requires_grad and got.shape == (rows,)\n"
        "        ref = f.__wrapped__(z.detach())\n"
        "        assert torch.allclose(got, ref, rtol=0, atol=1e-6), (name, rows)\n"
        "assert graphs == [], f'{len(graphs)} graph(s) compiled'\n"
        "print('ok')"
    )
    run_detached(code)
