"""Shared fixtures: the embedded tiny models (built once, cached in .cache/) and the end-to-end runs
that several tests read (tests/background.py: started in the background right after collection).

OMP_NUM_THREADS: 1 unless set, for the test process and every process it starts (torch reads it at import;
Ray's workers get 1 anyway): the suite runs two end-to-end runs and its own tests at once on 2 cores, and
two processes of 2 threads each spin against each other (two evaluations of the `addition` suite side by
side: 40.9 s with 2 threads each, 14.9 s with 1; one alone: 12.9 s / 13.5 s). OPD_TEST_THREADS=N: torch
intra-op threads of the test process (the numerical tolerances hold for any count). OPD_TEST_JOBS=N: job slots of the end-to-end runs (tests/background.py; default 2: memory).
"""

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from background import POOL, Spec, shared_run
from flag_runs import LOGGERS, UPSTREAM_PATHS, bench_run_dir, bench_step_spec, wall_clock_run

REPO = Path(__file__).resolve().parents[1]
RECIPES = ("k1", "topk", "topk_tail")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # see the docstring: oversubscription, not compute
# As in every Ray process of a run: importing verl registers opd_patches (opd_patches/registered.py).
os.environ["VERL_USE_EXTERNAL_MODULES"] = "opd_patches.registered"
# As run.sh on a machine without a GPU. VERL fixes its platform when its trainer or engines are first
# imported: set here, once, before any test module is imported (no test module sets it; one importing
# opd_patches.trainers.opd_sync at collection would otherwise fix VERL on cuda for the rest of the session).
os.environ["VERL_PLATFORM"] = "cpu"


@pytest.fixture(scope="session", autouse=True)
def private_run_lock(tmp_path_factory):
    """Training started by tests takes the one-run lock (opd_patches/ops/lock.py) in a folder of its own,
    so a user's own run does not block the suite and the suite does not block it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPD_LOCK_DIR", str(tmp_path_factory.mktemp("opd-lock")))
        mp.delenv("OPD_LOCK_HELD", raising=False)
        yield


def ray_env_of(run_dir, **opd):
    """The env vars `opd_patches.main.configure_ray` hands every Ray process for these `opd.*` keys
    (colocated teacher, one GPU); raises its ConfigError for a bad value."""
    from omegaconf import OmegaConf

    from opd_patches.main import configure_ray

    config = OmegaConf.create({
        "opd": {"teacher_placement": "colocated", **opd},
        "ray_kwargs": {"ray_init": {}}, "trainer": {"n_gpus_per_node": 1, "nnodes": 1},
    })
    configure_ray(config, run_dir)
    return config.ray_kwargs.ray_init.runtime_env.env_vars


@pytest.fixture
def opd_override():
    """`opd_override(lean_topk=False)`: opd_patches.config.current() with these keys changed until the test
    ends (config.override, as a call instead of a block)."""
    import contextlib

    from opd_patches import config

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(config.override(**changes))


def worker_config_of(run_dir, **opd):
    """The config a Ray worker reads (opd_patches.config.current()) when the driver got these `opd.*` keys."""
    from opd_patches import config

    return config.loads(ray_env_of(run_dir, **opd)[config.ENV])


_EMBEDDED: list = []
_EMBEDDED_LOCK = threading.Lock()


def build_embedded():
    """Built once per session, also before the first background run (concurrent run.sh launches with
    EMBEDDED=1 would otherwise build the same folder at once)."""
    with _EMBEDDED_LOCK:
        if not _EMBEDDED:
            from opd_patches.embedded.build import build

            _EMBEDDED.append(build(REPO / ".cache" / "embedded"))
        return _EMBEDDED[0]


@pytest.fixture(scope="session")
def embedded():
    """Paths of the tiny student, teacher, tokenizer and prompt parquet files that run.sh also uses."""
    return build_embedded()


def pytest_configure(config):
    threads = os.environ.get("OPD_TEST_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: start only the runs of the selected tests
def pytest_collection_modifyitems(session, config, items):
    """Start the shared runs the selected tests need, longest first, and move the tests that read
    them to the end (in that order), so that the other tests run meanwhile."""
    uses = {id(item): [n for n in item.fixturenames if n in POOL.specs] for item in items}
    order = POOL.order(n for names in uses.values() for n in names)
    if not order or config.option.collectonly:
        return
    rank = {n: i for i, n in enumerate(order)}
    items.sort(key=lambda item: min((rank[n] for n in uses[id(item)]), default=-1))
    POOL.start(order, config._tmp_path_factory.mktemp("shared_runs"), build_embedded)
    # SIGTERM (a CI timeout) ends the session like Ctrl-C, so pytest_sessionfinish kills the runs.
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_sessionfinish(session, exitstatus):
    POOL.close()


def pytest_terminal_summary(terminalreporter):
    lines = POOL.report()
    if lines:
        terminalreporter.section("shared end-to-end runs (start, wall)")
        for line in lines:
            terminalreporter.write_line(line)


def sharpened(src, out, seed):
    """A copy of model folder `src` in `out` with its matrices re-drawn at std 0.3 (fixed seed).

    The embedded models are near-uniform, so greedy decoding just repeats a token and token-level
    comparisons prove nothing; sharp weights make outputs depend on the whole context.
    """
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3, generator=gen)
    model.save_pretrained(out)
    for f in Path(src).iterdir():  # tokenizer files, generation_config.json
        if f.is_file() and not (Path(out) / f.name).exists():
            shutil.copy(f, Path(out) / f.name)
    return Path(out)


def smoke_cli(recipes, *overrides, timeout=600):
    """`python -m tools.smoke` (what `make smoke` runs) for `recipes`, into the run's folder."""
    def spec(out):
        return Spec(argv=[sys.executable, "-m", "tools.smoke", "--recipes", *recipes, "--out", str(out),
                          "--timeout", str(timeout), *overrides],  # overrides after an option: not recipes
                    timeout=timeout * len(recipes) + 300)
    return spec


# Each folder keeps <recipe>/{metrics.jsonl, run.log, manifest.json, global_step_N/...}; a new check
# of these runs requests the fixture (see tests/background.py).
# Every recipe, colocated teacher.
smoke_run = shared_run("smoke_run", smoke_cli(RECIPES), cost=3)
# The defaults' counterparts (tests/flag_runs.py). The bench's step phase trains k1 and topk_tail with the
# student's old-log-prob pass on (the default skips it: test_skip_old_log_prob.py); topk_tail with every
# fast path off as well is `upstream_paths` (test_lean_topk.py, test_sampled_logprob.py), which also
# carries the wall-clock stop of test_ops_e2e.py.
bench_step_run = shared_run("bench_step_run", bench_step_spec, weight=2, cost=1.2)  # two trainings at once
# Also the loggers users turn on: `file` must be added back, tensorboard and W&B (offline) write into the run
# folder (tests/test_logging.py).
upstream_paths = shared_run("upstream_paths", wall_clock_run("topk_tail", *UPSTREAM_PATHS, LOGGERS))


@pytest.fixture(scope="session")
def k1_skip_off(bench_step_run) -> Path:
    """The run folder of k1 with the old-log-prob pass on (metrics.jsonl, run.log)."""
    return bench_run_dir(bench_step_run, "k1")


@pytest.fixture(scope="session")
def topk_tail_skip_off(bench_step_run) -> Path:
    """topk_tail with the pass on, every other fast path on (the default)."""
    return bench_run_dir(bench_step_run, "topk_tail")


@pytest.fixture(scope="session")
def smoke(smoke_run):
    """The smoke run of every recipe (the default, colocated teacher): (process-like result, out dir)."""
    return smoke_run, smoke_run.out
