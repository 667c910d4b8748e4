"""The one-run lock and the GPU preflight (opd_patches/ops/lock.py, gpu.py).

Holders run in forked processes (a real second process, without re-importing verl); the GPU decision
logic runs on canned nvidia-smi output (this machine has no GPU); the end-to-end check runs run.sh.
"""

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opd_patches.ops import gpu, lock
from test_run_sh import imported_modules

REPO = Path(__file__).resolve().parents[1]
FORK = multiprocessing.get_context("fork")
UUID0, UUID1 = "GPU-0e2150c1-15aa-cf9c-ccc0-fe804a020b61", "GPU-7d3a9f00-1111-2222-3333-444455556666"
GPUS_CSV = f"0, {UUID0}\n1, {UUID1}\n"
# Real output format seen on an H200 (`--format=csv,noheader,nounits`), plus a name with a comma and [N/A].
APPS_CSV = f"{UUID0}, 436, /opt/torch/.venv/bin/python3, 4614\n{UUID1}, 512, python -c x,y, [N/A]\n"


@pytest.fixture(autouse=True)
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OPD_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.delenv("OPD_LOCK_HELD", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return tmp_path / "locks"


def _hold(ready):
    with lock.acquire(gpus=[], run="outputs/k1", command="./run.sh recipe=k1"):
        ready.set()
        time.sleep(300)  # until the test kills it (no shared Event to wait on: a killed waiter deadlocks it)


@pytest.fixture
def holder():
    """Start a second process that holds the lock; returns its Process (killed at teardown)."""
    procs = []

    def start():
        ready = FORK.Event()
        proc = FORK.Process(target=_hold, args=(ready,), daemon=True)
        proc.start()
        assert ready.wait(30), "the holder process did not take the lock"
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.join(10)


def in_child(fn, env=None):
    """Run fn() in a forked process with env changes; returns its exit code (0: fn returned)."""
    def body():
        for key, value in (env or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        try:
            fn()
        except lock.BUSY:
            os._exit(lock.EXIT_BUSY)
        os._exit(0)

    proc = FORK.Process(target=body)
    proc.start()
    proc.join(60)
    return proc.exitcode


def test_busy_lock_is_refused_naming_the_holder(holder):
    proc = holder()
    assert lock.is_held()
    with pytest.raises(lock.LockBusy) as err:
        lock.acquire(gpus=[])
    msg = str(err.value)
    for part in (f"pid {proc.pid}", "outputs/k1", "./run.sh recipe=k1", "started ", "opd.force=true / FORCE=1",
                 str(lock.lock_path())):
        assert part in msg, (part, msg)
    assert "OPD_LOCK_HELD" not in os.environ
    assert lock.main([]) == lock.EXIT_BUSY  # `python -m opd_patches.ops.lock`


def test_lock_of_a_killed_process_is_free(holder):
    proc = holder()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert lock.holder()["pid"] == proc.pid  # the dead holder's content is still in the file...
    assert not lock.is_held()  # ...but the kernel dropped its flock
    with lock.acquire(gpus=[], run="second") as held:
        assert held.held and lock.holder()["pid"] == os.getpid() and lock.holder()["run"] == "second"
        assert os.environ["OPD_LOCK_HELD"] == held.token
    assert lock.holder() == {} and "OPD_LOCK_HELD" not in os.environ and not lock.is_held()


def test_children_pass_with_the_holders_token_only():
    with lock.acquire(gpus=[]) as held:
        def child():
            inherited = lock.acquire(gpus=[])
            assert inherited.inherited and not inherited.held and inherited.token == held.token

        assert in_child(child) == 0  # inherits OPD_LOCK_HELD
        assert in_child(lambda: lock.acquire(gpus=[]), env={"OPD_LOCK_HELD": None}) == lock.EXIT_BUSY
        assert in_child(lambda: lock.acquire(gpus=[]), env={"OPD_LOCK_HELD": "otherhost:1:deadbeef"}) == lock.EXIT_BUSY
    assert lock.main([]) == 0


def test_a_stale_token_is_ignored(capsys, monkeypatch):
    monkeypatch.setenv("OPD_LOCK_HELD", "host:1:deadbeef")  # e.g. exported by a parent that has ended
    with lock.acquire(gpus=[]) as held:
        assert held.held and held.token != "host:1:deadbeef"
    assert "ignoring OPD_LOCK_HELD" in capsys.readouterr().err


def test_force_overrides_the_lock_and_the_gpu_check(holder):
    holder()

    def no_query():
        raise AssertionError("forced: the GPU must not be queried")

    forced = lock.acquire(force=True, gpu_query=no_query)
    assert not forced.held and forced.token.startswith("forced:") and os.environ["OPD_LOCK_HELD"] == forced.token
    # a forced parent's children pass too, and skip the GPU check (the parent chose to force)
    assert in_child(lambda: lock.acquire(gpu_query=no_query)) == 0
    forced.release()
    assert "OPD_LOCK_HELD" not in os.environ


def test_force_takes_a_free_lock():
    with lock.acquire(force=True) as held:
        assert held.held and held.token.startswith("forced:") and lock.is_held()
    assert not lock.is_held()


def test_unwritable_lock_dir_is_named(monkeypatch, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("OPD_LOCK_DIR", str(tmp_path / "file" / "sub"))
    with pytest.raises(OSError, match="set OPD_LOCK_DIR to a writable folder"):
        lock.acquire(gpus=[])


# ---- GPU preflight ---------------------------------------------------------------------------


def canned(gpus=GPUS_CSV, apps=APPS_CSV):
    return lambda: (gpu.parse_gpus(gpus), gpu.parse_apps(apps))


def test_nvidia_smi_parsers():
    assert gpu.parse_gpus(GPUS_CSV) == [{"index": "0", "uuid": UUID0}, {"index": "1", "uuid": UUID1}]
    assert gpu.parse_apps(APPS_CSV) == [
        {"uuid": UUID0, "pid": 436, "name": "/opt/torch/.venv/bin/python3", "used_mib": 4614},
        {"uuid": UUID1, "pid": 512, "name": "python -c x,y", "used_mib": None},
    ]
    assert gpu.parse_apps("") == [] and gpu.parse_apps("No running processes found\n") == []


def test_busy_gpu_is_refused_naming_pid_process_and_memory():
    with pytest.raises(gpu.GpuBusy) as err:
        gpu.check(query=canned(), wait_s=0)
    msg = str(err.value)
    assert f"GPU 0 ({UUID0}): pid 436 (/opt/torch/.venv/bin/python3) holds 4614 MiB" in msg
    assert "pid 512 (python -c x,y) holds an unknown amount of memory" in msg
    assert "opd.force=true / FORCE=1" in msg and "CUDA_VISIBLE_DEVICES" in msg


@pytest.mark.parametrize("visible, pids", [
    (None, [436, 512]),          # unset: every GPU may be used
    ("1", [512]),
    (UUID0[:12], [436]),         # a UUID prefix, as CUDA accepts
    ("1,0", [436, 512]),
    ("", []),                    # no visible GPU
    ("-1", []),
    ("7", []),                   # no such GPU: reported, not checked
])
def test_cuda_visible_devices_decides_the_assigned_gpus(monkeypatch, visible, pids):
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert sorted(p.pid for p in gpu.busy(query=canned(), own_pids=())) == pids


def _own_and_parent_are_free() -> None:
    apps = f"{UUID0}, {os.getpid()}, pytest, 100\n{UUID0}, {os.getppid()}, parent study, 100\n"
    assert gpu.busy(query=canned(apps=apps)) == []
    assert gpu.check(query=canned(apps=apps), wait_s=0) == "assigned GPUs are free"


def test_own_process_and_ancestors_do_not_count():
    """Checked in a child of this process, whose parent (pytest) is a real ancestor whatever started
    pytest: init (pid 1) never counts, and a pytest orphaned under it (nohup ... &) has no other parent."""
    child = multiprocessing.get_context("spawn").Process(target=_own_and_parent_are_free)
    child.start()
    child.join(120)
    assert child.exitcode == 0


def test_waits_for_a_finishing_run_to_release_the_gpu():
    answers = iter([APPS_CSV, APPS_CSV, ""])  # the previous run's workers exit after two polls
    query = lambda: (gpu.parse_gpus(GPUS_CSV), gpu.parse_apps(next(answers)))  # noqa: E731
    assert gpu.check(query=query, wait_s=60, poll_s=0) == "assigned GPUs are free (after waiting)"


def test_a_busy_gpu_releases_the_lock_it_took():
    with pytest.raises(gpu.GpuBusy):
        lock.acquire(gpu_query=canned(), gpu_wait_s=0)
    assert not lock.is_held() and "OPD_LOCK_HELD" not in os.environ
    with lock.acquire(gpu_query=canned(apps="")) as held:  # free GPUs: the lock is held
        assert held.held


def test_real_query_on_a_machine_without_gpu(capsys):
    if gpu.nvidia_smi_query() is not None:
        pytest.skip("this machine has an NVIDIA GPU; the canned tests cover the decision")
    assert gpu.busy() is None
    with lock.acquire() as held:  # gpus=None: the real query, which finds no GPU
        assert held.held
    assert "GPU preflight skipped" in capsys.readouterr().out


# ---- end to end: run.sh ----------------------------------------------------------------------


def _run_sh(tmp_path, **env):
    env = {**os.environ, "DEVICE": "cpu", "OUTPUT_DIR": str(tmp_path / "run"), "PYTHON": sys.executable, **env}
    env.pop("OPD_LOCK_HELD", None)  # a separate launch, not a child of the holder
    return subprocess.run([str(REPO / "run.sh"), "recipe=k1", "+overlay=smoke"], env=env, capture_output=True,
                          text=True, timeout=300, cwd=REPO)


@pytest.mark.slow
def test_run_sh_refuses_while_the_lock_is_held_and_force_passes(tmp_path, embedded):
    with lock.acquire(gpus=[], run="held-by-the-test", command="pytest"):
        start = time.monotonic()
        out = _run_sh(tmp_path, EMBEDDED="1", PYTHONPROFILEIMPORTTIME="1")
        assert out.returncode == lock.EXIT_BUSY, out.stderr[-3000:]
        assert "[opd] refused: another run holds the lock" in out.stderr and "held-by-the-test" in out.stderr
        assert "hydra" in imported_modules(out.stderr) and "verl" not in imported_modules(out.stderr)  # ~8 s saved
        assert "ray init" not in out.stdout + out.stderr  # refused before Ray starts...
        assert not (tmp_path / "run" / "manifest.json").exists()  # ...and before the run folder is written
        print(f"refusal took {time.monotonic() - start:.1f} s")
        # FORCE=1 passes the lock: the run gets as far as the next check (a missing student: exit 2).
        out = _run_sh(tmp_path, FORCE="1", STUDENT=str(tmp_path / "no-student"))
        assert out.returncode == 2, out.stderr[-3000:]
        assert "no such file or directory" in out.stderr and "forced" in out.stderr
