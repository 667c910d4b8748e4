"""`make run` = `python -m opd_patches.study.chain`: the real run in one resumable command.

    python -m opd_patches.study.chain --student S --teacher T --dapo FILE [--recipe topk]
        [--deadline TIME | --wall-clock S] [--out outputs/run] [--stage NAME] [--eval-sets "NAME=SOURCE ..."]
        [--eval-data DIR] [--proxy math500] [--final aime] [--select-args="..."] [HYDRA_OVERRIDE ...]
    python -m opd_patches.study.chain --task addition [...]    # the known-answer task, every stage on a CPU

Stages, in order (each also alone: `--stage NAME`, its earlier stages done first):
  data-eval  the evaluation sets (data/eval_sets.py) -> <out>/eval-data/*.jsonl
  data       the training data from the raw DAPO file, decontaminated against them (data/prepare.py) -> <out>/data/
  preflight  the student/teacher compatibility report (checks/preflight.py) -> <out>/preflight.json
  train      run.sh with the recipe, resumable, stopped in time for what follows (deadline.py) -> <out>/train/
  select     every kept export and the student on the proxy suite (select.py) -> <out>/train/select/evals/
  final      the chosen export and the student on the final suite, selection.json (select.py)
  report     <out>/report.md, report.json, report/training_curves.png (chain_report.py)
With `--task addition`: no data stages (the task's own parquet and models, .cache/addition), a few steps of
the recipe on the task, selection on addition_proxy, the final score on addition_final.

`<out>/chain.json` records the deadline (fixed at the first launch) and, per stage, the inputs it ran with
(cumulative: models, recipe, overrides, data, suites) and its wall time. A stage whose result exists for the
same inputs is skipped; a launch whose inputs differ from a recorded stage's is refused before anything
runs, naming each difference (its results would mix with the new ones). The report is written anew at
every launch.

A kill (SIGINT, SIGTERM, SIGHUP) stops the process tree of the stage running (Ray's included: the guard's
session, study/runner.py) and exits 130; the same command continues: training from its newest complete
state, toward the same deadline, evaluations where they stopped. Exit status: 0 done; 1 a stage failed
(its log is named); 2 bad input or changed inputs (one line); 75 the run lock is held; 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from opd_patches.ops import checkpoints, receipts
from opd_patches.study import deadline as dl
from opd_patches.study import runner, select
from opd_patches.study.chain_record import ChainError, check_recorded, decide, files_fingerprint, load, save, stage_done
from opd_patches.study.cli import STOP_SIGNALS, _interrupt
from opd_patches.study.progress import RunProgress, human
from opd_patches.study.spec import REPO

STAGES = ("data-eval", "data", "preflight", "train", "select", "final", "report")
TASK_STAGES = ("preflight", "train", "select", "final", "report")
TASKS = ("addition",)
# The task's default cut: a few steps, a save every other step, so that selection ranks several exports
# (recipes/overlay/learn.yaml keeps 10), small enough for a CPU.
TASK_OVERRIDES = ("+overlay=learn", "trainer.total_training_steps=6", "trainer.save_freq=2")
TASK_SUITES = ("addition_proxy", "addition_final")
# The chain sets these itself (the deadline, the run folder, resuming); given as overrides they would fight it.
OWN_KEYS = ("opd.wall_clock_s", "opd.reserve_s", "trainer.default_local_dir", "trainer.resume_mode")
# Question counts of the evaluation sets as published, for the estimate before `data-eval` has fetched them.
PUBLISHED_QUESTIONS = {"math500.jsonl": 500, "aime24.jsonl": 30, "aime25.jsonl": 30}


class StageFailed(RuntimeError):
    """A stage ran and failed; the message names its log; exit 1."""


def log(msg: str) -> None:
    print(f"[run] {msg}", flush=True)


def detect_device() -> str:
    """cpu | gpu, as run.sh's DEVICE=auto decides (a GPU that nvidia-smi lists)."""
    device = os.environ.get("DEVICE", "auto")
    if device != "auto":
        return "cpu" if device == "cpu" else "gpu"
    try:
        ok = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return "gpu" if ok else "cpu"


def compose(recipe: str, overrides: list[str], device: str):
    """The recipe as run.sh composes it (Hydra, VERL's ppo_trainer on the search path), to read the
    composed budget and to refuse a bad override before any stage runs."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from opd_patches import config  # noqa: F401  (registers recipes/base.yaml's opd_defaults node)

    hydra_device = "cpu" if device == "cpu" else ("gpu" if importlib.util.find_spec("vllm") else "gpu-hf")
    try:
        with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
            return hydra_compose(config_name=recipe, overrides=["hydra.searchpath=[pkg://verl.trainer.config]",
                                                                 f"+device={hydra_device}", *overrides])
    except Exception as exc:  # Hydra's composition and override-parsing errors have no common base
        raise ChainError(f"recipe {recipe} with overrides {' '.join(overrides) or '(none)'} does not compose: "
                         f"{str(exc).splitlines()[0]}") from None


class Chain:
    def __init__(self, args):
        self.args = args
        self.task = args.task
        self.out = Path(args.out or REPO / "outputs" / ("run" if not self.task else f"run-{self.task}")).resolve()
        self.stages = TASK_STAGES if self.task else STAGES
        self.device = detect_device()
        self.overrides = list(args.overrides)
        self.select_args = shlex.split(args.select_args or "")
        self.proxy = args.proxy or (TASK_SUITES[0] if self.task else "math500")
        self.final = args.final or (TASK_SUITES[1] if self.task else "aime")
        self.run_dir = self.out / "train"
        self.logs = self.out / "logs"
        self.eval_dir = Path(args.eval_data).resolve() if args.eval_data else self.out / "eval-data"
        self.data_dir = self.out / "data"
        if self.task:
            assets = REPO / ".cache" / self.task
            self.student, self.teacher = str(assets / "student"), str(assets / "teacher")
            self.train_files = assets / "data" / "train.parquet"
        else:
            self.student, self.teacher = args.student, args.teacher
            self.train_files = self.data_dir / "train.parquet"
        self.state: dict = {}
        self.inputs_now: dict[str, dict] = {}
        self.config = None
        self.estimate: dict = {}

    # ---- inputs ---------------------------------------------------------------------------------------
    def check_arguments(self) -> None:
        a = self.args
        if self.task:
            given = [flag for flag, v in (("STUDENT", a.student), ("TEACHER", a.teacher), ("DAPO", a.dapo)) if v]
            if given:
                raise ChainError(f"TASK={self.task} brings its own models and data; {', '.join(given)} would be ignored: leave it out")
        else:
            missing = [flag for flag, v in (("STUDENT", a.student), ("TEACHER", a.teacher), ("DAPO", a.dapo)) if not v]
            if missing:
                raise ChainError(f"{', '.join(missing)} not given: make run STUDENT=<model> TEACHER=<model> DAPO=<raw "
                                 "dapo-math-17k.parquet> [DEADLINE=...] (or TASK=addition for the known-answer task)")
            if not Path(a.dapo).expanduser().is_file():
                raise ChainError(f"DAPO={a.dapo}: no such file")
        if a.stage and a.stage not in self.stages:
            raise ChainError(f"STAGE={a.stage}: choose one of {', '.join(self.stages)}")
        if not (REPO / "recipes" / f"{a.recipe}.yaml").is_file() or a.recipe == "base":
            raise ChainError(f"RECIPE={a.recipe}: no such recipe in recipes/")
        own = [o for o in self.overrides if o.lstrip("+~").split("=")[0] in OWN_KEYS]
        if own:
            raise ChainError(f"override {own[0]}: the chain sets it (the deadline: DEADLINE= / WALL_CLOCK=; the run folder: OUT=)")
        for flag in ("--student", "--proxy", "--final"):
            if flag in self.select_args or any(s.startswith(flag + "=") for s in self.select_args):
                raise ChainError(f"SELECT_ARGS {flag}: the chain sets it (the student: STUDENT=; suites: --proxy/--final)")

    def train_overrides(self) -> list[str]:
        return [*(TASK_OVERRIDES if self.task else ()), *self.overrides]

    def inputs(self) -> dict[str, dict]:
        """Each stage's inputs, cumulative (a stage depends on every earlier one's)."""
        a = self.args
        per = {"data-eval": {"task": self.task}}
        if not self.task:
            if a.eval_data:
                per["data-eval"] = {"eval_data": str(self.eval_dir), "eval_data_files": self._eval_files_digest()}
            else:
                per["data-eval"] = {"eval_sets": a.eval_sets}
            dapo = Path(a.dapo).expanduser().resolve()
            per["data"] = {"dapo": str(dapo), "dapo_sha256": receipts.sha256(dapo)}
        per["preflight"] = {"student": self.student, "student_files": files_fingerprint(self.student),
                            "teacher": self.teacher, "teacher_files": files_fingerprint(self.teacher)}
        per["train"] = {"recipe": a.recipe, "overrides": self.train_overrides()}
        per["select"] = {"proxy": self.proxy, "select_args": self.select_args}
        per["final"] = {"final": self.final}
        per["report"] = {}
        out, acc = {}, {"task": self.task}
        for stage in STAGES:
            acc = {**acc, **per.get(stage, {})}
            if stage in self.stages:
                out[stage] = dict(acc)
        return out

    def _eval_files_digest(self) -> dict:
        return {p.name: receipts.sha256(p) for p in sorted(self.eval_dir.glob("*.jsonl"))}

    # ---- the estimate -----------------------------------------------------------------------------------
    def _suite_cost(self, suite: str, sel) -> dict:
        from opd_patches.eval.suites import load_protocol, load_questions

        protocol = load_protocol(suite)
        try:
            n = len(load_questions(protocol, self.eval_dir if not self.task else Path("."), sel.limit))
        except (OSError, ValueError):  # the sets are not fetched yet
            n = sum(PUBLISHED_QUESTIONS.get(f, 500) for f in protocol.get("files") or [])
            n = min(n, sel.limit) if sel.limit else n
        return {"questions": n, "samples": sel.samples or protocol["samples"],
                "max_new_tokens": sel.max_new_tokens or protocol["max_new_tokens"]}

    def cache_dir(self, sel) -> Path:
        return Path(sel.cache).expanduser().resolve() if sel.cache else select.DEFAULT_CACHE

    def make_estimate(self) -> dict:
        """Seconds that selection and the final score need (deadline.py), from this launch's settings."""
        sel = select.parser().parse_args([str(self.run_dir), *self.select_args])
        t = self.config.trainer
        keep = dl.kept_exports(int(t.max_actor_ckpt_to_keep), int(t.total_training_steps), int(t.save_freq or 0))
        evals = dl.after_training(self._suite_cost(self.proxy, sel), self._suite_cost(self.final, sel), keep)
        student = str(Path(self.student).expanduser().resolve())
        cached = [p for p in self.cache_dir(sel).glob("*/*/summary.json") if _summary_model(p) == student]
        rate = dl.throughput(self.device, [*sorted(self.run_dir.glob("select/evals/*/*/summary.json")), *cached])
        seconds = dl.seconds_needed(evals, rate["tokens_per_s"], rate["startup_s"])
        return {"seconds": round(seconds, 1), **rate, "keep": keep,
                "evaluations": [{**e.__dict__, "tokens": e.tokens} for e in evals]}

    def print_estimate(self) -> None:
        e = self.estimate
        parts = "; ".join(f"{x['what']}: {x['count']} x {x['questions']} questions x {x['samples']} samples x "
                          f"{x['max_new_tokens']} tokens" for x in e["evaluations"])
        log(f"estimate after training: {parts} = {sum(x['tokens'] for x in e['evaluations']):,d} tokens at the cap, "
            f"at {e['tokens_per_s']:,.0f} tokens/s ({e['source']}) + {e['startup_s']:.0f} s start-up each: "
            f"~{human(e['seconds'])} for selection and the final score")
        d = self.state.get("deadline")
        if d:
            log(f"deadline {dl.iso(d['deadline'])} (fixed at the first launch from {d['given']}); training stops by "
                f"{dl.iso(d['deadline'] - e['seconds'])} ({human(d['deadline'] - e['seconds'] - time.time())} from now)")
        else:
            log("no deadline (DEADLINE= / WALL_CLOCK=): training runs its trainer.total_training_steps")

    # ---- stages -----------------------------------------------------------------------------------------
    def result_exists(self, stage: str) -> bool:
        if stage == "data-eval":
            from opd_patches.eval.suites import load_protocol

            need = {f for s in (self.proxy, self.final) for f in load_protocol(s).get("files") or []}
            return all((self.eval_dir / f).is_file() for f in need)
        if stage == "data":
            return (self.data_dir / "data_report.json").is_file() and self.train_files.is_file()
        if stage == "preflight":
            return (self.out / "preflight.json").is_file()
        if stage == "train":
            return runner.status(self.train_plan([]), self.budget())["state"] == "complete"
        if stage == "select":
            try:
                plan = self.select_plan()
            except ChainError:
                return False
            from opd_patches.study import evaluate

            jobs = [plan.job(plan.proxy, c) for c in plan.eligible] + [plan.job(plan.proxy)]
            return all(evaluate.is_done(j, plan.eval_spec) for j in jobs)
        if stage == "final":
            try:
                data = json.loads((self.run_dir / select.FOLDER / "selection.json").read_text())
                plan = self.select_plan()
            except (OSError, ValueError):
                return False
            return (data["final"]["chosen"] is not None and data["final"]["student"] is not None
                    and sorted(r["step"] for r in data["ranking"]) == [c["step"] for c in plan.eligible])
        return False  # the report: written anew every time

    def child(self, stage: str, cmd: list[str]) -> None:
        """A stage's command under the guard (its whole session stopped with the chain), output in logs/."""
        path = self.logs / f"{stage}.log"
        shown = ["python", *cmd[1:]] if cmd[0] == sys.executable else cmd
        log(f"{stage}: {' '.join(shown)} (log {path})")
        code = runner.run_child(cmd, {**os.environ, "PYTHONUNBUFFERED": "1"}, path)
        if code != 0:
            tail = " | ".join(path.read_text(errors="replace").splitlines()[-4:])
            raise StageFailed(f"{stage}: exit {code}; log {path}: {tail}")

    def stage_data_eval(self) -> None:
        if self.args.eval_data:
            if not self.result_exists("data-eval"):
                raise StageFailed(f"data-eval: EVAL_DATA={self.eval_dir} lacks the files of {self.proxy} or {self.final}")
            return
        self.child("data-eval", [sys.executable, "-m", "opd_patches.data.eval_sets", *shlex.split(self.args.eval_sets),
                                 "--out", str(self.eval_dir)])

    def stage_data(self) -> None:
        self.child("data", [sys.executable, "-m", "opd_patches.data", str(Path(self.args.dapo).expanduser().resolve()),
                            "--out", str(self.data_dir), "--eval-sets", str(self.eval_dir)])

    def stage_preflight(self) -> None:
        self.child("preflight", [sys.executable, "-m", "opd_patches.checks.preflight", "--student", self.student,
                                 "--teacher", self.teacher, "--data", str(self.train_files),
                                 "--out", str(self.out / "preflight.json")])

    def budget(self) -> dict:
        return {"steps": int(self.config.trainer.total_training_steps)} if self.config is not None else {}

    def train_plan(self, clock: list[str]) -> runner.RunPlan:
        env = {"EMBEDDED": self.task} if self.task else {"STUDENT": self.student, "TEACHER": self.teacher,
                                                          "TRAIN_FILES": str(self.train_files)}
        overrides = ["trainer.resume_mode=auto", f"trainer.experiment_name={self.out.name}", *self.train_overrides(), *clock]
        return runner.RunPlan("run", 0, self.args.recipe, overrides, env, self.run_dir)

    def stage_train(self) -> str:
        clock, wall = [], None
        d = self.state.get("deadline")
        if d:
            try:
                wall, reserve = dl.training_window(d["deadline"], self.estimate["seconds"])
            except dl.DeadlineError as exc:
                if checkpoints.newest_validated(self.run_dir) is not None:
                    log(f"train: {exc}; selection goes on with the exports saved so far")
                    return "stopped by the deadline before this launch"
                raise StageFailed(f"train: {exc}, and no validated export exists to select from") from None
            clock = [f"opd.wall_clock_s={wall:.0f}", f"opd.reserve_s={reserve:.0f}"]
        # make exports its command-line variables: run.sh would read these as its own clock, beside the chain's
        for name in ("WALL_CLOCK", "RESERVE"):
            os.environ.pop(name, None)
        plan = self.train_plan(clock)
        st = runner.status(plan, self.budget())
        log(f"train: {'resuming' if st['state'] == 'partial' else 'first launch'} ({st['detail']}) in {self.run_dir}; "
            f"log {self.run_dir / 'run.log'}")
        progress = _ThisLaunch(self.run_dir, lambda: RunProgress(self.run_dir, "train", self.budget().get("steps"), wall))
        code = runner.launch(plan, progress)
        st = runner.status(plan, self.budget())
        if st["state"] != "complete":
            raise StageFailed(f"train: exit {code}, {st['state']} ({st['detail']}); log {self.run_dir / 'run.log'}")
        return st["detail"]

    def select_plan(self) -> select.Plan:
        argv = [str(self.run_dir), "--proxy", self.proxy, "--final", self.final, "--student", self.student,
                *([] if self.task else ["--data-dir", str(self.eval_dir)]), *self.select_args]
        try:
            return select.prepare(select.parser().parse_args(argv))
        except select.SelectError as exc:
            raise ChainError(f"select: {exc}") from None

    def stage_select(self) -> None:
        plan = self.select_plan()
        n = len(plan.eligible)
        log(f"select: {n} exports (steps {', '.join(str(c['step']) for c in plan.eligible)}) and the student on {plan.proxy}"
            + "".join(f"; skipped step {s['step']}: {s['reason']}" for s in plan.skipped))
        blocks = [select.evaluate_one(plan, plan.job(plan.proxy, c), f"proxy {i}/{n} step {c['step']} ({plan.proxy})")
                  for i, c in enumerate(plan.eligible, 1)]
        blocks.append(select.evaluate_one(plan, plan.job(plan.proxy), f"student ({plan.proxy})"))
        if any(b is None for b in blocks):
            raise StageFailed("select: an evaluation failed (its log is named above); the same command retries it")

    def stage_final(self) -> None:
        if select.run(self.select_plan()) != 0:
            raise StageFailed("final: an evaluation failed (its log is named above); the same command retries it")

    def stage_report(self) -> None:
        from opd_patches.study import chain_report

        paths = chain_report.write(self)
        log(f"report: {paths['md']}, {paths['json']}" + (f", {paths['curves']}" if paths.get("curves") else ""))

    # ---- the chain ---------------------------------------------------------------------------------------
    def prerequisites(self, stage: str) -> None:
        """For a stage run alone: every earlier stage done with these inputs (the report needs none)."""
        if stage == "report":
            return
        for earlier in self.stages[: self.stages.index(stage)]:
            if decide(self.state.get("stages", {}).get(earlier), self.inputs_now[earlier], True) != "skip":
                raise ChainError(f"STAGE={stage} needs stage {earlier} done first: make run STAGE={earlier} (or the whole chain)")

    def prepare(self) -> None:
        """Inputs checked against the record, the deadline fixed and the estimate printed, before any stage runs."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.state = load(self.out)
        if self.task:  # the task's models and data, built once (cached in .cache/<task>) as run.sh would
            self.child("task", [sys.executable, "-m", "opd_patches.embedded", "--task", self.task,
                                "--out", str(REPO / ".cache" / self.task)])
        self.inputs_now = self.inputs()
        check_recorded(self.state, self.inputs_now, self.out)
        stored = None if self.args.new_deadline else self.state.get("deadline")
        self.state["deadline"] = dl.fix_deadline(stored, self.args.deadline, self.args.wall_clock, time.time())
        self.config = compose(self.args.recipe, self.train_overrides(), self.device)
        self.state.setdefault("launches", []).append(time.time())
        save(self.out, self.state)
        log(f"{self.out}: stages {', '.join(self.stages)}" + (f" (only {self.args.stage})" if self.args.stage else "")
            + f"; recipe {self.args.recipe}; device {self.device}")
        self.estimate = self.make_estimate()
        self.print_estimate()

    def run(self) -> int:
        todo = [self.args.stage] if self.args.stage else list(self.stages)
        if self.args.stage:
            self.prerequisites(self.args.stage)
        for stage in todo:
            inputs = self.inputs_now[stage]
            if decide(self.state.get("stages", {}).get(stage), inputs, self.result_exists(stage)) == "skip":
                log(f"{stage}: done for these inputs, skipped")
                continue
            if stage == "train":  # what is measured by now (earlier stages' data) sharpens the reserve
                self.estimate = self.make_estimate()
                self.state.setdefault("estimates", []).append({"at": time.time(), **self.estimate})
            started, note = time.time(), ""
            if stage != "train":  # which says whether it starts or resumes
                log(f"{stage}: starting")
            try:
                note = getattr(self, "stage_" + stage.replace("-", "_"))() or ""
            except BaseException:
                stage_done(self.state, stage, inputs, started, finished=False)
                save(self.out, self.state)
                raise
            stage_done(self.state, stage, inputs, started, finished=stage != "report", note=note)
            save(self.out, self.state)
            log(f"{stage}: done ({human(time.time() - started)})")
        return 0


class _ThisLaunch:
    """The training's progress lines from what this launch logs: an earlier launch's metrics.jsonl is read
    only once opd_patches.main has set it aside (it writes manifest.json right after), else a resumed run
    would first be reported at the earlier launch's last step."""

    def __init__(self, run_dir: Path, make):
        self.manifest, self.make, self.progress = run_dir / "manifest.json", make, None
        self.since = time.time() if (run_dir / "metrics.jsonl").exists() else None

    def poll(self):
        if self.progress is None:
            try:
                fresh = self.since is None or self.manifest.stat().st_mtime >= self.since
            except OSError:
                fresh = False
            if not fresh:
                return None
            self.progress = self.make()
        return self.progress.poll()


def _summary_model(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("model")
    except (OSError, ValueError):
        return None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m opd_patches.study.chain", description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for the training (run.sh), e.g. trainer.total_training_steps=100")
    ap.add_argument("--task", choices=TASKS, help="the known-answer task instead of STUDENT/TEACHER/DAPO")
    ap.add_argument("--student", help="the student model (folder or hub id)")
    ap.add_argument("--teacher", help="the teacher model (folder or hub id)")
    ap.add_argument("--dapo", help="the raw DAPO-Math-17k file (data/dapo-math-17k.parquet)")
    ap.add_argument("--recipe", default="topk", help="a recipe of recipes/ (default topk)")
    ap.add_argument("--deadline", help="when everything must be done: ISO 8601 or epoch seconds (fixed at the first launch)")
    ap.add_argument("--wall-clock", type=float, help="seconds from the first launch (fixed then as the deadline)")
    ap.add_argument("--new-deadline", action="store_true", help="replace the deadline fixed at the first launch")
    ap.add_argument("--out", help="the run's folder (default outputs/run; with --task: outputs/run-<task>)")
    ap.add_argument("--stage", help=f"run one stage alone: {', '.join(STAGES)}")
    from opd_patches.data.eval_sets import EXAMPLE

    ap.add_argument("--eval-sets", default=EXAMPLE, help="NAME=SOURCE pairs for data-eval (make data-eval's EVAL_SETS)")
    ap.add_argument("--eval-data", help="an evaluation data folder already filled (data-eval then only checks it)")
    ap.add_argument("--proxy", help="the suite that ranks the exports (default math500; task: addition_proxy)")
    ap.add_argument("--final", help="the suite that scores the choice (default aime; task: addition_final)")
    ap.add_argument("--select-args", help="more options of make select, e.g. --select-args=\"--samples 2 --backend hf\"")
    ap.add_argument("--force", action="store_true", help="start although another run holds the lock (opd.force)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    chain = Chain(args)
    from opd_patches.ops import lock

    try:
        chain.check_arguments()
        for sig in STOP_SIGNALS:
            signal.signal(sig, _interrupt)
        chain.prepare()
        with lock.acquire(force=args.force, gpus=[] if chain.device == "cpu" else None, run=chain.out,
                          command=" ".join(sys.argv)):
            return chain.run()
    except lock.BUSY as exc:
        print(f"[run] refused: {exc}", file=sys.stderr, flush=True)
        return lock.EXIT_BUSY
    except (ChainError, dl.DeadlineError, runner.StudyError) as exc:
        print(f"[run] error: {exc}", file=sys.stderr, flush=True)
        return 2
    except StageFailed as exc:
        print(f"[run] failed: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt as exc:
        log(f"interrupted ({exc or 'SIGINT'}); the process tree it started was stopped; the same command continues")
        return 130

if __name__ == "__main__":
    sys.exit(main())
