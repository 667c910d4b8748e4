"""Training operations end to end: the real VERL trainer on the tiny embedded models (CPU): one run,
killed and resumed, shared by the tests below (one shared run of the background pool, tests/background.py).

- killed: 5 steps requested, a save per step, 2 states kept, NaN injected into the step-5 loss (test-only
  key); SIGKILL of the whole process group once step 3 is logged while its background finish (export
  validation, hashing, receipt; opd.background_save) runs: the state is written, training has moved on,
  the receipt is not there yet. Its steps 1-3 are the uninterrupted run's;
- resumed: one byte of step 2's model shard flipped (same size), then the same command again -> step 2
  is rejected by the resume's sha256 check (naming the file), the run resumes from step 1 and recomputes
  steps 2 and 3: their samples (`opd/samples_digest`) and losses equal the killed process's, losses to
  1e-6 relative (they are bit-equal: the trainer orders each step's samples canonically and
  `rollout.full_determinism` makes the hf rollout batch-invariant; see OpsTrainerMixin._balance_batch).
  Step 2 reads the restored weights, step 3 also the restored optimizer state (Adam's moments of step
  1's update shape step 2's). It goes on to step 4 -> receipts, validation, pruning (exactly the newest 2
  validated states, the killed process's states counted too), the non-finite guard at step 5 (exit 3,
  nothing of step 5 saved);
- wall clock: WALL_CLOCK=WALL_S RESERVE=0 with 500 steps requested, the clock counted from the first step
  (test-only key; the launch anchor is tests/test_ops_budget_guard.py's) -> stops on its own at a step
  boundary with a validated complete export, exit 0. That run is topk_tail on upstream's paths
  (tests/flag_runs.py `upstream_paths`), shared with test_lean_topk.py and test_sampled_logprob.py.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from background import POOL, Spec, shared_run
from flag_runs import WALL_S
from opd_patches.ops import checkpoints, receipts
from opd_patches.ops import run_summary as summary
from opd_patches.study.guard import kill_session

REPO = Path(__file__).resolve().parents[1]
COMMON = [
    "recipe=k1", "+overlay=smoke", "trainer.total_training_steps=5", "trainer.save_freq=1",
    "trainer.max_actor_ckpt_to_keep=2", "trainer.resume_mode=auto", "opd.debug.inject_nan_step=5",
    # Batch-invariant hf rollout: each request generated alone, so a sample's tokens never depend on
    # which requests arrived together (opd_patches/rollout/hf.py).
    "actor_rollout_ref.rollout.full_determinism=true",
    # A window to kill in: the tiny export is validated by the trainer, its finish alone takes ~0.2 s.
    "opd.debug.finish_hold_s=5",
]
LOSSES = ("actor/loss", "actor/distillation/loss", "actor/pg_loss")
pytestmark = pytest.mark.slow


class Job:
    """./run.sh in its own session; kill_when(): SIGKILL the whole process group once it returns True."""

    def __init__(self, run_dir: Path, args: list[str], env: dict | None = None, kill_when=None, timeout: int = 900):
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = run_dir.parent / f"lock-{run_dir.name}-{time.monotonic_ns()}"  # independent of other runs' locks
        full_env = {**os.environ, "EMBEDDED": "1", "OUTPUT_DIR": str(run_dir), "PYTHON": sys.executable,
                    "PYTHONUNBUFFERED": "1", "OPD_LOCK_DIR": str(lock), **(env or {})}
        self.args, self.kill_when, self.code = args, kill_when, None
        self.log = open(run_dir.parent / f"{run_dir.name}.log", "a")
        self.proc = subprocess.Popen([str(REPO / "run.sh"), *args], cwd=REPO, env=full_env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        POOL.track(self.proc)  # a session that ends early (-x, Ctrl-C) leaves no training behind
        self.deadline = time.monotonic() + timeout

    def poll(self) -> bool:
        """True once finished (exit status in .code, -SIGKILL when killed)."""
        if self.code is not None:
            return True
        if self.proc.poll() is not None:
            self.code = self.proc.returncode
        elif self.kill_when is not None and self.kill_when():
            self.kill()
            self.code = -signal.SIGKILL
        elif time.monotonic() > self.deadline:
            self.kill()
            self.log.close()
            pytest.fail(f"run.sh {self.args} did not finish in time (log {self.log.name})")
        if self.code is not None:
            self.log.close()
        return self.code is not None

    def wait(self) -> int:
        while not self.poll():
            time.sleep(0.05)
        return self.code

    def kill(self):
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        # Ray processes of that session outside its process group, if any: killed too, until none is listed
        # (the study guard's sweep; 30 s at most).
        kill_session(self.proc.pid, timeout=30)


def metrics(run_dir: Path, name: str = "metrics.jsonl") -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / name).read_text().splitlines() if line.strip()]
    return {r["step"]: r["data"] for r in rows}


def logged_steps(run_dir: Path) -> set[int]:
    """Steps of metrics.jsonl's complete lines (read while the trainer writes it)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return {json.loads(line)["step"] for line in lines if line.strip()}


def log_text(run_dir: Path) -> str:
    return (run_dir.parent / f"{run_dir.name}.log").read_text(errors="replace")


SHARD = "actor/model_world_size_1_rank_0.pt"


def finish_processes(state: Path) -> list[int]:
    """Running background finishes of `state` (`python -m opd_patches.ops.finish ... --state STATE`)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")  # empty for a zombie
        except OSError:  # not a process, or gone meanwhile
            continue
        if b"opd_patches.ops.finish" in argv and str(state).encode() in argv:
            pids.append(int(entry.name))
    return pids


def _ops_runs(base: Path) -> dict:
    """The run killed while step 3's save finishes, then resumed after one byte of its step-2 shard was
    flipped (a shared run: in the background pool, tests/background.py)."""
    run = base / "run"
    seen = {}

    def finishing_step_3():
        pending = run / "global_step_3" / receipts.PENDING
        # the killed process's steps 1-3 are compared; the kill lands while step 3's finish process runs
        if pending.exists() and 3 in logged_steps(run) and (pids := finish_processes(run / "global_step_3")):
            seen["receipt_3_at_kill"] = (run / "global_step_3" / receipts.NAME).exists()
            seen["finish_at_kill"] = pids
            return True
        return False

    killed = Job(run, COMMON, kill_when=finishing_step_3).wait()
    # Only step 3's finish writes its receipt: once no such process runs, the state's listing is final.
    deadline = time.monotonic() + 60
    while left := finish_processes(run / "global_step_3"):
        if time.monotonic() > deadline:
            raise AssertionError(f"step 3's background finish {left} outlived the killed trainer by 60 s")
        time.sleep(0.05)
    seen["states_after_kill"] = [(s["step"], s["complete"]) for s in checkpoints.list_states(run)]
    shard = run / "global_step_2" / SHARD
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size: only the sha256 re-check sees it
    shard.write_bytes(bytes(data))
    return {"run": run, "killed": killed, "code": Job(run, COMMON).wait(), "seen": seen}


ops_runs = shared_run("ops_runs", lambda base: Spec(fn=_ops_runs), cost=2)


@pytest.fixture(scope="module")
def resumed(ops_runs):
    return ops_runs.value


def test_receipts_pruning_and_nan_guard(resumed):
    run, code = resumed["run"], resumed["code"]
    text = log_text(run)
    assert code == summary.EXIT_CODES["non_finite"], text[-3000:]
    s = summary.read(run)
    assert s["status"] == "non_finite" and s["steps_done"] == 4 and s["last_complete_step"] == 4, s
    assert s["step"] == 5 and s["quantity"] in LOSSES + ("actor/grad_norm",), s
    assert f"non-finite {s['quantity']}" in text and "at step 5" in text
    assert "TEST fault injection: teacher_logprobs set to NaN at step 5" in text
    # Exactly the newest two complete states, across the restart (steps 1, 2 of the killed process pruned).
    states = checkpoints.list_states(run)
    assert [(x["step"], x["complete"], x["validated"]) for x in states] == [(3, True, True), (4, True, True)]
    assert not (run / "global_step_5").exists()  # nothing of the poisoned step saved
    receipt = json.loads((run / "global_step_4" / "receipt.json").read_text())
    assert receipt["step"] == 4 and receipt["hf_export"] == "actor/huggingface"
    assert "actor/huggingface/model.safetensors" in receipt["files"] and "data.pt" in receipt["files"]
    checks = receipt["validation"]["checks"]
    assert {"parameter count", "dtype", "finite weights", "generate"} <= set(checks)
    # Each background finish is logged at the next step of its process (the killed process: steps 1 and
    # 2's; the resumed one: 2 and 3's; step 4's ended after the NaN stop: not logged).
    killed, again = metrics(run, "metrics.1.jsonl"), metrics(run)
    assert sorted(killed) == [1, 2, 3] and sorted(again) == [2, 3, 4], (sorted(killed), sorted(again))
    for rows, steps in ((killed, (2, 3)), (again, (3, 4))):
        assert all(rows[step]["opd/save_background_s"] > 0 and "timing_s/save_checkpoint" in rows[step]
                   for step in steps)


def test_kill_during_save_then_resume_continues(resumed):
    run, killed, seen = resumed["run"], resumed["killed"], resumed["seen"]
    assert killed == -signal.SIGKILL
    assert seen["finish_at_kill"] and seen["receipt_3_at_kill"] is False, seen  # killed while step 3's finish ran
    assert (2, True) in seen["states_after_kill"], seen
    assert (3, False) in seen["states_after_kill"], seen  # killed in the background finish: incomplete
    text = log_text(run)
    assert "receipt continue in the background" in text  # the save handed its finish to the background
    assert f"{run / 'global_step_2'} is not resumed from: sha256 differs from receipt: {SHARD}" in text
    assert f"resume: from the newest complete state {run / 'global_step_1'}" in text


def test_resumed_losses_equal_to_1e_6(resumed):
    """Steps 2 and 3 as the killed process computed them before the kill (the uninterrupted run)."""
    run = resumed["run"]
    want, got = metrics(run, "metrics.1.jsonl"), metrics(run)
    for step in (2, 3):
        # The same samples (content digest of the step's canonically ordered batch), then the same losses.
        assert got[step]["opd/samples_digest"] == want[step]["opd/samples_digest"], step
        for key in LOSSES + ("actor/grad_norm",):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-6, abs=1e-12), (step, key)


def test_wall_clock_stops_with_a_validated_export(upstream_paths):
    """The wall-clock stop, on the shared run of tests/conftest.py that also serves test_lean_topk.py and
    test_sampled_logprob.py (whose comparisons read its step 1 only)."""
    run, code, text = upstream_paths.out, upstream_paths.returncode, upstream_paths.log
    assert code == 0, text[-3000:]
    s = summary.read(run)
    assert s["status"] == "wall_clock" and 1 <= s["steps_done"] < 500, s
    assert s["last_complete_step"] == s["steps_done"], s  # the last step was saved, not lost to the clock
    newest = checkpoints.list_states(run)[-1]
    assert newest["step"] == s["steps_done"] and newest["complete"] and newest["validated"] is True
    assert f"stopping after step {s['steps_done']}: wall clock" in text
    assert summary.line(s) in text  # the driver's summary line
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["config"]["opd"]["wall_clock_s"] == WALL_S
