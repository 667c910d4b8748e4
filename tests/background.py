"""End-to-end runs shared by tests and started in the background as soon as pytest knows its tests.

A trainer run costs a minute or more of mostly waiting (Ray start-up, process spawns, saves), so the
suite declares each run once, starts the ones its selected tests need right after collection (at most
OPD_TEST_JOBS job slots at a time, default 2, in the order the tests will ask for them) and moves the tests that
read them to the end of the session: the fast tests and the other runs fill the waiting time.

Attach a new end-to-end check to an existing run by requesting its fixture: tests/conftest.py has
`smoke` (every recipe: `<out>/<recipe>/` keeps metrics.jsonl, run.log, manifest.json, global_step_N/ with
receipts and HF exports), `upstream_paths` (topk_tail on upstream's paths, its folder as one of those) and
`bench_step_run` (k1 and topk_tail, two steps each, the old-log-prob pass on: `k1_skip_off` /
`topk_tail_skip_off` give their run folders); test modules declare their own (test_smoke.py `smoke_mixed`,
test_colocated_scaleout.py, test_eval.py, test_study_e2e.py, test_ops_e2e.py). Declare a new run in a test module with

    my_run = shared_run("my_run", lambda out: Spec(argv=[...]))         # a subprocess, log in out/run.log
    my_run = shared_run("my_run", lambda out: Spec(fn=callable_of_out))  # any orchestration, in a thread

and request `my_run` in the tests: it gives a `Result` (returncode, out, log text; or fn's value).
"""

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parents[1]
# A run's opd.* keys come from its recipe and overrides (main.configure_ray passes them to Ray as
# OPD_CONFIG); one exported in the test process's own environment is not handed on. In-process tests
# change the config with opd_patches.config.override, which no subprocess sees.
# Ray's own start-up deadline: on a loaded 2-core machine several clusters starting at once can miss
# it before any project code runs; such a run is started once more.
RAY_START_TIMEOUT = "The current node timed out during startup"
NOT_INHERITED = ("OPD_CONFIG",)
POLL_S = 0.5


@dataclass
class Spec:
    """What a run does. argv: a subprocess in its own session (cwd REPO, env added to os.environ,
    stdout+stderr to out/run.log), killed with its process group after `timeout` s; fn: a function of
    the run folder, called in a thread. prepare(out): called first (e.g. to build a model folder).
    """

    argv: list[str] | None = None
    env: dict = field(default_factory=dict)
    timeout: float = 900
    fn: Callable[[Path], Any] | None = None
    prepare: Callable[[Path], Any] | None = None


@dataclass
class Result:
    returncode: int | None  # None: timed out (killed)
    out: Path
    log: str = ""
    value: Any = None
    wall_s: float = 0.0
    started_s: float = 0.0  # seconds after the pool started
    error: BaseException | None = None

    @property
    def stdout(self) -> str:  # subprocess.CompletedProcess-like: stdout and stderr are merged in the log
        return self.log

    stderr = ""


class Pool:
    def __init__(self):
        self.specs: dict[str, Callable[[Path], Spec]] = {}
        self.costs: dict[str, tuple[int, float]] = {}  # name -> (job slots, relative cost)
        self.results: dict[str, Result] = {}
        self.queue: list[str] = []
        self.running: dict[str, tuple[int, threading.Thread]] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.tracked: list[subprocess.Popen] = []  # started by a run's fn (track()): killed by close() too
        self.lock = threading.Condition()
        # Two trainings at a time by default: each CPU training holds a Ray cluster of ~5-6 GB (24 GiB here;
        # five at once met Ray's OOM killer, at 95%), and one alone keeps only about one of the 2 cores busy.
        # Every end-to-end training of the suite is a shared run, so this bounds them all.
        self.jobs = max(1, int(os.environ.get("OPD_TEST_JOBS") or 2))
        self.base: Path | None = None
        self.ready: Callable[[], Any] | None = None  # run once before the first job (the embedded models)
        self.thread: threading.Thread | None = None
        self.closed = False
        self.t0 = time.monotonic()  # reset when the scheduler starts (start)

    def declare(self, name: str, make_spec: Callable[[Path], Spec], weight: int, cost: float) -> None:
        if name in self.specs:
            raise ValueError(f"shared run {name!r} is declared twice")
        self.specs[name], self.costs[name] = make_spec, (weight, cost)

    def order(self, names) -> list[str]:
        """Heaviest first (a run taking every slot starts only when all are free: at the start; queued
        behind lighter runs it would wait for the last of them and run alone at the end), then longest
        first (with a few job slots, that finishes the whole set soonest)."""
        return sorted(set(names), key=lambda n: (-self.costs[n][0], -self.costs[n][1], n))

    def start(self, names: list[str], base: Path, ready: Callable[[], Any]) -> None:
        """Queue `names` (in this order) and start the scheduler thread."""
        with self.lock:
            self.base, self.ready = base, ready
            self.queue += [n for n in names if n not in self.queue and n not in self.results]
            if self.thread is None:
                self.t0 = time.monotonic()
                self.thread = threading.Thread(target=self._schedule, name="shared-runs", daemon=True)
                self.thread.start()

    def get(self, name: str) -> Result:
        """The finished run `name`, queued now (first in line) if collection did not queue it."""
        with self.lock:
            if name not in self.specs:
                raise KeyError(f"no shared run {name!r}: declare it with shared_run()")
            if name not in self.results and name not in self.running:
                if name in self.queue:
                    self.queue.remove(name)
                self.queue.insert(0, name)
                if self.thread is None:
                    raise RuntimeError("the shared-run pool was not started (tests/conftest.py starts it)")
            while name not in self.results:
                self.lock.wait(POLL_S)
            return self.results[name]

    def report(self) -> list[str]:
        """One line per finished run: when it started and how long it took (the pool is the suite's
        critical path on 2 cores, so this is where `make test`'s minutes go)."""
        with self.lock:
            done = sorted(self.results.items(), key=lambda kv: kv[1].started_s)
        return [f"{r.started_s:7.0f} s +{r.wall_s:6.0f} s  {name}" + ("" if r.returncode == 0 else f"  (exit {r.returncode})")
                for name, r in done]

    def track(self, proc: subprocess.Popen) -> None:
        """A process (leader of its own group) that a run's fn started: close() kills its group if it still runs."""
        with self.lock:
            self.tracked.append(proc)

    def close(self) -> None:
        """End of session: kill what still runs (a run nobody waited for, e.g. after -x)."""
        with self.lock:
            self.closed = True
            self.queue.clear()
            procs = list(self.procs.values()) + [p for p in self.tracked if p.poll() is None]
        for proc in procs:
            _kill_group(proc)

    # ---- scheduler ----------------------------------------------------------------------------------
    def _schedule(self) -> None:
        try:
            if self.ready is not None:
                self.ready()
        except BaseException as exc:  # every run would fail the same way: report it on each
            with self.lock:
                for name in self.specs:
                    self.results.setdefault(name, Result(None, self.base, error=exc))
                self.lock.notify_all()
            return
        while True:
            with self.lock:
                if self.closed:
                    return
                busy = sum(w for w, _ in self.running.values())
                for name in list(self.queue):
                    weight = self._weight(name)
                    if busy == 0 or busy + weight <= self.jobs:  # a heavy run still starts alone
                        self.queue.remove(name)
                        t = threading.Thread(target=self._run, args=(name,), name=f"run-{name}", daemon=True)
                        self.running[name] = (weight, t)
                        busy += weight
                        t.start()
                self.lock.wait(POLL_S)

    def _weight(self, name: str) -> int:
        return self.costs[name][0]

    def _run(self, name: str) -> None:
        out = self.base / name
        out.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        result = Result(None, out, started_s=start - self.t0)
        try:
            spec = self.specs[name](out)
            if spec.prepare is not None:
                spec.prepare(out)
            if spec.fn is not None:
                result.value = spec.fn(out)
                result.returncode = 0
            else:
                result.returncode = self._subprocess(name, spec, out)
                result.log = (out / "run.log").read_text(errors="replace")
                if result.returncode != 0 and RAY_START_TIMEOUT in result.log:  # the machine, not the code
                    (out / "run.log").rename(out / "run.ray-start-timeout.log")
                    result.returncode = self._subprocess(name, spec, out)
                    result.log = (out / "run.log").read_text(errors="replace")
        except BaseException as exc:
            result.error = exc
        result.wall_s = time.monotonic() - start
        with self.lock:
            self.results[name] = result
            self.running.pop(name, None)
            self.procs.pop(name, None)
            self.lock.notify_all()

    def _subprocess(self, name: str, spec: Spec, out: Path) -> int | None:
        # Each run takes the one-run lock (opd_patches/ops/lock.py) in a folder of its own.
        env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
        env.update({"OPD_LOCK_DIR": str(out / "lock"), "PYTHONUNBUFFERED": "1", **spec.env})
        env.pop("OPD_LOCK_HELD", None)
        with open(out / "run.log", "w") as log:
            proc = subprocess.Popen(spec.argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            with self.lock:
                self.procs[name] = proc
            try:
                return proc.wait(timeout=spec.timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass


POOL = Pool()


def shared_run(name: str, make_spec: Callable[[Path], Spec], weight: int = 1, cost: float = 1.0):
    """Declare run `name` and return its session fixture (assign it to a module-level name of that
    name). weight: job slots it takes (a run that trains two at once: 2); cost: its duration in
    trainer runs (~1 for a two-step smoke recipe), for the start order."""
    POOL.declare(name, make_spec, weight, cost)

    @pytest.fixture(scope="session", name=name)
    def _fixture() -> Result:
        result = POOL.get(name)
        if result.error is not None:
            raise RuntimeError(f"shared run {name!r} failed to run (folder {result.out})") from result.error
        return result

    return _fixture
