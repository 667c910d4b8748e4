"""The part of a save after upstream's state write (opd_patches/ops/finish.py): export validation, hashing,
receipt, pruning, in-process or as a background subprocess tied to the trainer. Synthetic state folders
(tests/test_ops_checkpoints.py's layout); the real trainer's background saves: tests/test_ops_e2e.py.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import types

import pytest

from opd_patches.ops import checkpoints, finish, receipts
from test_ops_checkpoints import make_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def listing(run):
    return [(s["step"], s["complete"], s["validated"]) for s in checkpoints.list_states(run)]


@pytest.mark.fresh_process
def test_failed_validation_is_recorded_and_never_displaces_the_last_validated_state(tmp_path):
    make_state(tmp_path, 1)
    bad = make_state(tmp_path, 2, complete=False)  # its export has no config.json: validation fails
    out = finish.finish(bad, 2, validate=True, expected_params=None, timeout_s=600, keep=1)
    validation = json.loads((bad / receipts.NAME).read_text())["validation"]
    assert validation["ok"] is False and "config.json missing" in validation["error"], validation
    assert out["validation"] == validation and out["pruned"] == []
    # keep=1 counts validated states: 1 stays (the run's result), 2 stays (the newest complete: resume point).
    assert listing(tmp_path) == [(1, True, True), (2, True, False)]


@pytest.mark.fresh_process
def test_a_large_export_is_validated_in_a_child_a_tiny_one_in_process(tmp_path, embedded, monkeypatch):
    """Exports over IN_PROCESS_BYTES (every real model) go to the CPU-only child; the same answer either way,
    good and bad (the tiny student with a planted wrong parameter count)."""
    calls, here = [], threading.get_ident()
    real_popen = subprocess.Popen

    def counted(*a, **k):  # subprocess.Popen is process-wide: the pool's threads call it too (ps, run.sh)
        if threading.get_ident() == here:
            calls.append(a[0])
        return real_popen(*a, **k)

    monkeypatch.setattr(finish.subprocess, "Popen", counted)
    export = embedded["student"]
    answers, limits = {}, (finish.IN_PROCESS_BYTES, 0)
    for limit in limits:
        monkeypatch.setattr(finish, "IN_PROCESS_BYTES", limit)
        good = finish.validate_export(export, None, 600)
        bad = finish.validate_export(export, good["parameters"] + 1, 600)
        answers[limit] = (good, bad)
    assert len(calls) == 2 and all("validate" in c for c in calls)  # only the limit-0 pair went to the child
    (good_in, bad_in), (good_child, bad_child) = answers[limits[0]], answers[0]
    timed_in, timed_child = good_in.pop("seconds"), good_child.pop("seconds")
    assert good_in == good_child and good_in["ok"] is True
    # the child's answer also times its own start (from "go") and exit around the same stages
    assert list(timed_child) == ["child start", *timed_in, "child exit"]
    assert bad_in["ok"] is bad_child["ok"] is False and "parameter count" in bad_child["error"]
    assert bad_in["checks"] == bad_child["checks"]


@pytest.mark.fresh_process
def test_the_validator_starts_with_the_finish_and_ends_with_it(tmp_path, embedded, monkeypatch):
    """A large export's validator is started before the export exists (its imports beside the writes and the
    build), validates once told to, and is ended when the finish fails before its validation."""
    import shutil

    from opd_patches.ops.validate import expected_parameters_for

    assert finish.large(10**9) and not finish.large(10**6)  # 2 GB and 2 MB of bfloat16 against 64 MiB
    monkeypatch.setattr(finish, "IN_PROCESS_BYTES", 0)
    assert finish.large(10**6) and not finish.large(None)  # no count: unknown, started when the export is there
    params = expected_parameters_for(str(embedded["student"]))
    started = []
    real = finish.Validator

    class Seen(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            started.append(self)

    monkeypatch.setattr(finish, "Validator", Seen)
    state = make_state(tmp_path, 1, complete=False)
    shutil.rmtree(state / receipts.HF_EXPORT)
    shutil.copytree(embedded["student"], state / receipts.HF_EXPORT)
    out = finish.finish(state, 1, validate=True, expected_params=params, timeout_s=600)
    assert len(started) == 1 and started[0].proc.returncode == 0
    assert out["validation"]["ok"] is True and out["validation"]["parameters"] > 0, out
    assert json.loads((state / receipts.NAME).read_text())["validation"] == out["validation"]

    failing = make_state(tmp_path, 2, complete=False)
    monkeypatch.setattr(finish.receipts, "wait_for_writes", lambda *a, **k: (_ for _ in ()).throw(TimeoutError("writes")))
    out = finish.finish(failing, 2, validate=True, expected_params=10**6, timeout_s=600)
    assert out["error"] == "writes" and len(started) == 2
    assert started[1].proc.poll() is not None  # not left running after the finish


def test_a_tiny_export_is_validated_by_the_trainer_and_its_finish_imports_no_torch(tmp_path, embedded, monkeypatch):
    """finish.validated_here (the trainer, before a background finish): the tiny export's validation, the
    caller's torch random state untouched (training goes on after it); the finish process handed it writes it
    into the receipt without importing torch. A large export is left to the finish."""
    import shutil

    import torch

    state = make_state(tmp_path, 1, complete=False)
    shutil.rmtree(state / receipts.HF_EXPORT)
    shutil.copytree(embedded["student"], state / receipts.HF_EXPORT)
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    validation = finish.validated_here(state, None, 600)
    assert torch.equal(torch.rand(3), want)
    assert validation["ok"] is True and validation["parameters"] > 0, validation
    code = "import sys; from opd_patches.ops import finish; finish.main(sys.argv[1:]); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code, "finish", "--state", str(state), "--step", "1", "--validate",
                          "--validation-json", json.dumps(validation)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[-1] == "False", out.stdout[-2000:] + out.stderr[-2000:]
    assert json.loads((state / receipts.NAME).read_text())["validation"] == validation
    monkeypatch.setattr(finish, "IN_PROCESS_BYTES", 0)
    assert finish.validated_here(state, None, 600) is None


def test_background_finish_writes_the_receipt_last_then_prunes(tmp_path):
    make_state(tmp_path, 1)
    make_state(tmp_path, 2)
    state = make_state(tmp_path, 3, complete=False)
    result = tmp_path / "result.json"
    proc = finish.launch(state, 3, result, validate=False, keep=1)
    pending = json.loads((state / receipts.PENDING).read_text())
    assert pending["pid"] == os.getpid() and pending["step"] == 3
    if proc.poll() is None:  # the window: listed as incomplete, saying why
        assert "background finish" in checkpoints.list_states(tmp_path)[-1]["reason"]
    out = finish.collect(proc, result, state, wait=True)
    assert proc.returncode == 0 and out["step"] == 3 and out["validation"] is None, out
    assert not (state / receipts.PENDING).exists() and receipts.verify(state) == []
    assert receipts.PENDING not in json.loads((state / receipts.NAME).read_text())["files"]
    # Pruned after the receipt: 2 = the newest validated (kept), 3 = the newest complete (not validated).
    assert out["pruned"] == [1] and listing(tmp_path) == [(2, True, True), (3, True, None)]


def test_a_finish_that_dies_leaves_the_state_incomplete(tmp_path):
    state = make_state(tmp_path, 4, complete=False)
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(9)"])
    out = finish.collect(proc, tmp_path / "absent.json", state, wait=True)
    assert "exited 9 without a result" in out["error"] and "no receipt" in out["error"]
    assert listing(tmp_path) == [(4, False, None)]


CHILD = ("import os, time; from opd_patches.ops.finish import die_with_parent; "
         "die_with_parent(os.getppid()); print('ready', flush=True); time.sleep(120)")
PARENT = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', sys.argv[1]]); "
          "print(c.pid, flush=True); time.sleep(120)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie has died
    except FileNotFoundError:
        return False


def test_finish_process_dies_with_the_trainer():
    """SIGKILL of the trainer kills its finish (and a finish's validator): no orphan writes a receipt later."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True, cwd=REPO)
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "ready" and _alive(child)
    parent.kill()
    parent.wait(30)
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(child):
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the child outlived its killed parent")
    # Started after its parent is already gone (re-parented): exits at once.
    gone = subprocess.run([sys.executable, "-c", "from opd_patches.ops.finish import die_with_parent; "
                           "die_with_parent(1); print('ran on')"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert gone.returncode == 1 and "ran on" not in gone.stdout


def test_state_files_hash_beside_the_export_and_the_receipt_waits_for_every_write(tmp_path, monkeypatch):
    """The finish hashes the state's files outside the HF export in a thread (beside the export's build and
    validation): its receipt equals a sequential inventory of the folder, and a file still being written
    when the finish starts (a `.writing` marker, state_writer.py) enters it with its final content, hashed by
    that thread once it has waited for the write."""
    state = make_state(tmp_path, 3, complete=False)
    optim = state / "actor" / "optim_world_size_1_rank_0.pt"
    (state / "actor" / (optim.name + receipts.WRITING)).write_text("1")
    hasher = "state-sha256"  # finish._StateHasher's thread
    hasher_waits, hashed_by = threading.Event(), []

    def poll_sleep(seconds):  # receipts.wait_for_writes sleeps only while it sees a `.writing` marker
        if threading.current_thread().name == hasher:
            hasher_waits.set()
        time.sleep(seconds)

    def hash_files(state_dir, rels, *args, **kwargs):
        hashed_by.extend((threading.current_thread().name, rel) for rel in rels)
        return real_hash_files(state_dir, rels, *args, **kwargs)

    real_hash_files = receipts.hash_files
    monkeypatch.setattr(receipts, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=poll_sleep))
    monkeypatch.setattr(receipts, "hash_files", hash_files)

    def late_write():  # the writer thread, once the hasher waits on it: content first, then the marker goes
        if hasher_waits.wait(60):
            optim.write_bytes(os.urandom(3 << 20))
            (state / "actor" / (optim.name + receipts.WRITING)).unlink()

    writer = threading.Thread(target=late_write)
    writer.start()
    out = finish.finish(state, 3, validate=False, timeout_s=60)
    writer.join()
    assert hasher_waits.is_set(), "the state's hashing thread never waited for the write in progress"
    files = json.loads((state / receipts.NAME).read_text())["files"]
    assert files == receipts.inventory(state)  # the same files, sizes and sha256 as hashing one after another
    rel = optim.relative_to(state).as_posix()
    assert files[rel]["sha256_blocks"] == real_hash_files(state, [rel], workers=1)[rel]["sha256_blocks"]
    assert (hasher, rel) in hashed_by  # by the thread that waited, not picked up afterwards as a missed file
    assert any(name.startswith(receipts.HF_EXPORT + "/") for name in files)
    assert 0 < out["state_hashed_s"] <= out["seconds"]


def test_a_failed_state_write_leaves_no_receipt_even_with_the_export_built_first(tmp_path, monkeypatch):
    """With `build_export` the export starts once the model files are written; a failed optimizer write still
    keeps the state incomplete (the hashing thread's wait reports it), after the export was built."""
    from opd_patches.ops import state_export

    built = []
    monkeypatch.setattr(state_export, "write_export", lambda actor: built.append(actor))  # the fake shards cannot merge
    state = make_state(tmp_path, 4, complete=False)
    (state / "actor" / ("optim_world_size_1_rank_0.pt" + receipts.FAILED)).write_text("OSError: disk full")
    out = finish.finish(state, 4, validate=False, timeout_s=60, build_export=True)
    assert built == [state / "actor"] and "disk full" in out["error"] and not (state / receipts.NAME).exists()
