"""The colocated teacher (opd_patches/teacher): its fields match upstream's teacher loop, end to end.

Expectations are computed independently of the code under test: from a plain full forward pass of
the teacher over each unpadded sequence (`model(ids).logits`), turned into upstream's layout by
VERL's own vLLM prompt-log-prob extractor on the equivalent vLLM output and then by the teacher
loop's own tensor conversion (`AsyncTeacherLLMServerManager.compute_teacher_logprobs_single`).

The embedded teacher is freshly initialised and near-uniform, which makes top-k order comparisons
toothless (near ties); the layout tests use `sharp`, the teacher with its matrices re-drawn at a
larger scale (fixed seed), so the top-k are well separated.
"""

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from omegaconf import open_dict
from tensordict import TensorDict
from transformers import AutoModelForCausalLM
from verl.trainer.ppo.v1 import AgentLoopManagerTQ, get_trainer_cls
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync


import composed
from fresh_verl import facts
from model_refs import fake_vllm_output, sharp_path_fixture, upstream_extractor
from opd_patches.teacher import scoring
from opd_patches.trainers import colocated_teacher  # noqa: F401  (registers "colocated_teacher")
from opd_patches.teacher.agent_loop import ColocatedTeacherAgentLoopManager, without_teacher_server
from opd_patches.teacher.worker import ColocatedTeacher, ColocatedTeacherWorker

REPO = Path(__file__).resolve().parents[1]
LENGTHS = [1, 2, 6, 11, 12, 23, 23, 40]  # lone token, several equal lengths, longer than one chunk
LP_TOL = 1e-5


# ---- fixtures and independent references ---------------------------------------------------------
@pytest.fixture(scope="module")
def assets(embedded):
    return embedded  # conftest: the embedded models, built once


sharp_path = sharp_path_fixture("teacher", seed=321)


@pytest.fixture(scope="module")
def sharp(sharp_path):
    return AutoModelForCausalLM.from_pretrained(sharp_path).eval()


@pytest.fixture(scope="module")
def sequences(sharp):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, sharp.config.vocab_size, (n,), generator=g) for n in LENGTHS]


@torch.no_grad()
def upstream_fields(model, seq: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher_logprobs, teacher_ids) of one sample as upstream's teacher loop puts them into
    TransferQueue: direct forward -> vLLM extractor -> the teacher manager's tensor conversion."""
    ids = seq.tolist()
    logp = torch.log_softmax(model(input_ids=seq[None]).logits[0].float(), dim=-1)
    extra = {}
    upstream_extractor()(fake_vllm_output(logp, ids, k), k, extra)
    # verl/experimental/teacher_loop/teacher_manager.py, compute_teacher_logprobs_single:
    teacher_ids = torch.tensor(extra["prompt_ids"], dtype=torch.int32)
    teacher_logprobs = torch.tensor(extra["prompt_logprobs"])
    assert teacher_ids.shape[0] == teacher_logprobs.shape[0] == len(ids)
    return teacher_logprobs, teacher_ids


def assert_same_fields(ours, theirs):
    (lp, ids), (ref_lp, ref_ids) = ours, theirs
    assert lp.dtype == ref_lp.dtype == torch.float32 and ids.dtype == ref_ids.dtype == torch.int32
    assert lp.shape == ref_lp.shape and ids.shape == ref_ids.shape
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(lp, ref_lp, atol=LP_TOL, rtol=LP_TOL)  # fp32; padding changes the summation order


def compose_recipe(recipe, teacher_path, *overrides):
    config = composed.compose_recipe(
        recipe,
        "+device=cpu",
        "actor_rollout_ref.model.path=/models/student",
        f"distillation.teacher_models.teacher_model.model_path={teacher_path}",
        "distillation.n_gpus_per_node=1",
        "distillation.nnodes=1",
        *overrides,
    )
    return config


def bare_worker(recipe, teacher_path, *overrides) -> ColocatedTeacherWorker:
    """The worker's own state for the teacher, without Ray, FSDP or a process group."""
    config = compose_recipe(recipe, teacher_path, *overrides)
    worker = ColocatedTeacherWorker.__new__(ColocatedTeacherWorker)
    worker.config, worker.distillation_config, worker.role = config.actor_rollout_ref, config.distillation, "actor_rollout"
    worker._rank = 0
    return worker


def as_transferqueue_batch(seqs) -> TensorDict:
    """`input_ids` as TransferQueue hands a batch to a worker method: jagged, one row per sample."""
    return TensorDict({"input_ids": torch.nested.as_nested_tensor(list(seqs), layout=torch.jagged)}, batch_size=[len(seqs)])


# ---- 1. the scoring maths, against upstream's layout ---------------------------------------------
@pytest.mark.parametrize("max_tokens", [10_000, 45])  # one padded micro-batch; several (and lone) ones
@pytest.mark.parametrize("chunk_size", [5, 2048])
@pytest.mark.parametrize("k", [0, 4])
def test_scores_equal_upstream_teacher_fields(sharp, sequences, k, chunk_size, max_tokens):
    lps, ids = scoring.score_sequences(sharp, sequences, k, chunk_size=chunk_size, max_tokens=max_tokens)
    for seq, lp, i in zip(sequences, lps, ids, strict=True):
        assert_same_fields((lp, i), upstream_fields(sharp, seq, k))


def test_row_i_is_the_distribution_of_token_i_plus_1(sharp, sequences):
    """Alignment spelled out: K=1 row i holds token i+1 and its log-prob; the last row is a dummy."""
    seq = sequences[-1]
    (lp,), (ids,) = scoring.score_sequences(sharp, [seq], 0)
    with torch.no_grad():
        logp = torch.log_softmax(sharp(input_ids=seq[None]).logits[0].float(), dim=-1)
    assert ids[:-1, 0].tolist() == seq[1:].tolist()
    torch.testing.assert_close(lp[:-1, 0], logp[:-1].gather(-1, seq[1:, None])[:, 0], atol=LP_TOL, rtol=0)
    assert lp[-1].tolist() == [0.0] and ids[-1].tolist() == [0]


def test_micro_batches_respect_the_token_budget():
    lengths = [5, 3, 9, 1, 9, 30]
    groups = scoring.micro_batches(lengths, max_tokens=20)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 20
    assert [5] in groups  # longer than the budget: alone


def test_lm_head_is_never_applied_to_more_than_a_chunk(sharp, sequences):
    """The chunked head sees at most chunk_size positions at a time, never a whole (T, V) batch."""
    seen = []
    handle = sharp.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(o.shape[0]))
    try:
        scoring.score_sequences(sharp, sequences, 4, chunk_size=7)
    finally:
        handle.remove()
    assert max(seen) <= 7 and sum(seen) == sum(n - 1 for n in LENGTHS)


# ---- 2. the worker: config -> teacher, TransferQueue batch -> fields ------------------------------
@pytest.mark.parametrize("recipe,k", [("k1", 0), ("topk", 16)])
def test_worker_method_returns_upstream_fields(sharp_path, sharp, sequences, recipe, k):
    worker = bare_worker(recipe, sharp_path)
    worker.init_colocated_teacher(offload=True, chunk_size=8, max_token_len=64)
    assert worker.teacher.k == k and worker.teacher.model.dtype == torch.float32  # fp32 on the CPU

    out = worker.compute_teacher_logprobs(as_transferqueue_batch(sequences))
    assert set(out.keys()) == {"teacher_logprobs", "teacher_ids"} and out.batch_size == torch.Size([len(sequences)])
    for seq, lp, ids in zip(sequences, out["teacher_logprobs"].unbind(), out["teacher_ids"].unbind(), strict=True):
        assert_same_fields((lp, ids), upstream_fields(sharp, seq, k))


def test_worker_refuses_several_teachers(sharp_path):
    worker = bare_worker("k1", sharp_path, "distillation.n_gpus_per_node=2")
    models = worker.distillation_config.teacher_models
    with open_dict(models):
        for name, key in (("first", "a"), ("second", "b")):  # upstream drops `teacher_model` then
            models[name] = copy.deepcopy(models.teacher_model)
            models[name].key, models[name].num_replicas = key, 1
    with pytest.raises(NotImplementedError, match="one teacher"):
        worker.init_colocated_teacher()


# ---- 3. offload ----------------------------------------------------------------------------------
def test_offload_onload_keeps_outputs_identical(sharp_path, sequences):
    """With offload the model is onloaded for each call (the canary and the scoring run on the device)
    and points back to its host copy after it; results are bitwise those of a teacher that never
    moves, call after call."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.float32
    resident = ColocatedTeacher(str(sharp_path), k=4, device=device, dtype=dtype, offload=False)
    parked = ColocatedTeacher(str(sharp_path), k=4, device=device, dtype=dtype, offload=True)
    assert next(parked.model.parameters()).device.type == "cpu"

    moves = []
    for name in ("_onload", "_offload"):
        method = getattr(parked, name)
        setattr(parked, name, lambda method=method, name=name: (moves.append(name), method())[1])
    parked.model.get_decoder().register_forward_pre_hook(lambda m, args: moves.append(next(m.parameters()).device))
    reference = resident.score(sequences)
    for _ in range(2):
        again = parked.score(sequences)
        assert next(parked.model.parameters()).device.type == "cpu"
        for a, b in zip(reference, again, strict=True):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y)
    # per call: onload, the canary rescan's forward, the scoring forward(s) on the device, offload
    calls = " ".join(m if isinstance(m, str) else "fwd" for m in moves).split("_offload")
    assert len(calls) == 3 and calls[-1] == "" and all(c.strip().startswith("_onload fwd") for c in calls[:2])
    assert all(m == device for m in moves if not isinstance(m, str))
    # every tensor points back into the one flat (page-locked on accelerators) host buffer, at its slot
    host, layout = parked._host, parked._layout
    assert parked._device_buffer is None
    assert [t.data_ptr() - host.data_ptr() for _, t in parked._tensors()] == [off for off, _ in layout]
    assert next(resident.model.parameters()).device == device


# ---- 4. plumbing that keeps upstream's teacher servers out -------------------------------------
def test_agent_loop_workers_see_no_teacher(assets):
    config = compose_recipe("topk", assets["teacher"])
    quiet = without_teacher_server(config)
    assert quiet.distillation.enabled is False and config.distillation.enabled is True  # a copy
    assert issubclass(ColocatedTeacherAgentLoopManager, AgentLoopManagerTQ)
    assert issubclass(get_trainer_cls("colocated_teacher"), PPOTrainerSync)


@pytest.mark.parametrize("env,mode", [("registered", None), ("colocated", "ColocatedTeacherTrainer")])
@pytest.mark.fresh_process
def test_trainer_mode_registered_through_the_env_var(env, mode):
    """`colocated_teacher` exists in processes whose VERL_USE_EXTERNAL_MODULES names its module (main.py
    adds it for colocated runs). opd_patches alone does not import it: VERL's trainer imports its engines,
    which fix VERL's platform at import time."""
    seen = facts(env)
    assert seen["modes"].get("colocated_teacher", [None])[0] == mode
    assert seen["platform_fixed"] == (mode is not None)


# ---- 5. end to end: two training steps on one logical GPU, no teacher pool -----------------------
# The colocated teacher is the recipes' default, so the shared smoke run (conftest.smoke) is this run.
E2E = {"k1": "actor/distillation/loss", "topk": "actor/distillation/teacher_mass",
       "topk_tail": "actor/distillation/tail_share"}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(E2E))
def test_two_steps_with_the_colocated_teacher(smoke, recipe):
    proc, out = smoke
    run_dir = out / recipe
    log = (run_dir / "run.log").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + log[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert E2E[recipe] in r["data"] and "timing_s/teacher" in r["data"], sorted(r["data"])
    if recipe == "topk":
        assert all(0 < r["data"]["actor/distillation/teacher_mass"] <= 1 for r in rows)
    assert (run_dir / "global_step_2" / "actor" / "huggingface" / "model.safetensors").exists()

    config = json.loads((run_dir / "manifest.json").read_text())["config"]
    assert config["trainer"]["v1"]["trainer_mode"] == "colocated_teacher"
    # One logical GPU for everything: Ray saw num_gpus=1 and only the student's rollout server started.
    assert set(re.findall(r"'num_gpus': (\d+)", log)) == {"1"}
    assert len(set(re.findall(r"HFServer pid=(\d+)", log))) == 1
    k = 0 if recipe == "k1" else 16
    assert re.search(rf"\[colocated teacher\] rank 0: loaded .*teacher \(k={k}, torch.float32, offload=True\)", log)


# ---- 6. the teacher canary -----------------------------------------------------------------------
from opd_patches.teacher.canary import TeacherCanaryError  # noqa: E402


def canary_teacher(path, canary_every=1, offload=True):
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    teacher = ColocatedTeacher(str(path), k=0, device=device, dtype=torch.float32, offload=offload,
                               canary_every=canary_every)
    checks = []
    real_check = teacher.canary.check
    teacher.canary.check = lambda model: (checks.append(real_check(model)), checks[-1])[1]
    return teacher, checks


def test_canary_passes_on_an_unchanged_teacher_across_offload_cycles(sharp_path, sequences):
    teacher, checks = canary_teacher(sharp_path)
    c = teacher.canary
    assert c.reference.numel() >= 8 and torch.isfinite(c.reference).all()
    assert c.reference_mean < -c.log_v - 0.1  # a sharp teacher is far from uniform
    for _ in range(3):
        teacher.score(sequences)
        assert next(teacher.model.parameters()).device.type == "cpu"
    assert len(checks) == 3 and max(checks) <= c.tolerance


@pytest.mark.parametrize("every,expected", [(2, 2), (0, 0)])
def test_canary_every_n_calls(sharp_path, sequences, every, expected):
    teacher, checks = canary_teacher(sharp_path, canary_every=every, offload=False)
    for _ in range(4):
        teacher.score(sequences[:2])
    assert len(checks) == expected


def test_canary_trips_when_weights_are_zeroed_after_the_reference(sharp_path, sequences):
    teacher, _ = canary_teacher(sharp_path)
    with torch.no_grad():
        for p in teacher.model.parameters():
            p.zero_()
    assert float(teacher.canary.scan(teacher.model).mean()) == pytest.approx(-teacher.canary.log_v, abs=1e-5)
    with pytest.raises(TeacherCanaryError, match=r"rescan: mean log-prob .* -log V .*near-uniform"):
        teacher.score(sequences)


def test_canary_trips_when_weights_drift(sharp_path, sequences):
    teacher, _ = canary_teacher(sharp_path)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        w = teacher.model.get_decoder().layers[0].mlp.down_proj.weight
        w.add_(torch.randn(w.shape, generator=gen) * 0.05)
    with pytest.raises(TeacherCanaryError, match=r"moved by up to .* nats .*tolerance 0\.001.*weights changed"):
        teacher.score(sequences)


def test_canary_trips_on_non_finite_scores(sharp_path, sequences):
    teacher, _ = canary_teacher(sharp_path)
    with torch.no_grad():
        teacher.model.get_output_embeddings().weight[0, 0] = float("nan")
    with pytest.raises(TeacherCanaryError, match="not finite"):
        teacher.score(sequences)


def test_canary_refuses_a_weightless_teacher_at_start_up(sharp_path, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(sharp_path)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.save_pretrained(tmp_path)
    for f in Path(sharp_path).iterdir():  # tokenizer files
        if f.is_file() and not (tmp_path / f.name).exists():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(TeacherCanaryError, match=r"at start-up: mean log-prob .* within .* -log V = -6\.10"):
        ColocatedTeacher(str(tmp_path), k=0, device=torch.device("cpu"), dtype=torch.float32)
