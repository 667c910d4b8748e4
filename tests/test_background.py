"""The shared-run pool (tests/background.py) on trivial subprocesses: start order, job slots, results,
timeouts and the end-of-session kill."""

import sys
import time

import pytest

from background import Pool, Spec


def sleeper(seconds, code=0):
    """A run that records when it started and ended (monotonic ns) in its folder."""
    script = ("import sys, time, pathlib; out = pathlib.Path(sys.argv[1]); (out / 'start').write_text(str(time.monotonic_ns()));"
              f"time.sleep({seconds}); (out / 'end').write_text(str(time.monotonic_ns())); print('done'); sys.exit({code})")
    return lambda out: Spec(argv=[sys.executable, "-c", script, str(out)], timeout=30)


def window(result):
    return int((result.out / "start").read_text()), int((result.out / "end").read_text())


def test_heaviest_then_longest_first_at_most_jobs_at_once_and_results(tmp_path, monkeypatch):
    monkeypatch.setenv("OPD_TEST_JOBS", "2")
    pool = Pool()
    pool.declare("a", sleeper(0.5), weight=1, cost=1)
    pool.declare("b", sleeper(0.5, code=3), weight=1, cost=3)
    pool.declare("c", sleeper(0.5), weight=2, cost=2)
    ready = []
    order = pool.order(["a", "b", "c", "a"])
    assert order == ["c", "b", "a"]
    pool.start(order, tmp_path, lambda: ready.append(True))
    a, b, c = pool.get("a"), pool.get("b"), pool.get("c")
    assert ready == [True]
    assert (a.returncode, b.returncode, c.returncode) == (0, 3, 0) and "done" in a.log and a.stdout == a.log
    # b (cost 3) and a share the two slots; c takes both, so it never overlaps another run (it is first in
    # line, but get("a") above may have put a ahead of it).
    (a0, a1), (b0, b1), (c0, c1) = window(a), window(b), window(c)
    assert a0 < b1 and b0 < a1
    assert c0 >= max(a1, b1) or c1 <= min(a0, b0)
    pool.close()


def test_timeout_kills_the_run_and_close_kills_what_runs(tmp_path):
    pool = Pool()
    pool.declare("slow", lambda out: Spec(argv=[sys.executable, "-c", "import time; time.sleep(60)"], timeout=1), 1, 1)
    pool.declare("left", lambda out: Spec(argv=[sys.executable, "-c", "import time; time.sleep(60)"], timeout=60), 1, 1)
    pool.start(["slow", "left"], tmp_path, None)
    start = time.monotonic()
    assert pool.get("slow").returncode is None and time.monotonic() - start < 30
    while "left" not in pool.procs:
        time.sleep(0.05)
    proc = pool.procs["left"]
    pool.close()
    assert proc.poll() is not None  # killed, not left behind


def test_an_undeclared_or_twice_declared_run_is_refused(tmp_path):
    pool = Pool()
    pool.declare("x", sleeper(0), 1, 1)
    with pytest.raises(ValueError, match="declared twice"):
        pool.declare("x", sleeper(0), 1, 1)
    with pytest.raises(KeyError, match="no shared run 'y'"):
        pool.get("y")


def test_fn_runs_and_errors_are_reported(tmp_path):
    pool = Pool()
    pool.declare("value", lambda out: Spec(fn=lambda out: out.name), 1, 1)
    pool.declare("boom", lambda out: Spec(fn=lambda out: 1 / 0), 1, 1)
    pool.start(["value", "boom"], tmp_path, None)
    assert pool.get("value").value == "value"
    assert isinstance(pool.get("boom").error, ZeroDivisionError)
    pool.close()


def test_close_kills_what_a_runs_fn_started_and_tracked(tmp_path):
    import subprocess

    pool = Pool()
    started = []

    def fn(out):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        pool.track(proc)
        started.append(proc)
        proc.wait()

    pool.declare("parent", lambda out: Spec(fn=fn), 1, 1)
    pool.start(["parent"], tmp_path, None)
    deadline = time.monotonic() + 30
    while not started and time.monotonic() < deadline:
        time.sleep(0.05)
    pool.close()
    assert started and started[0].poll() is not None  # killed, not left behind
