"""The part of a save after upstream has written the state: HF export, its validation, hash, receipt, prune.

    python -m opd_patches.ops.finish finish --state RUN/global_step_N --step N [--validate] [--build-export]
        [--expected-params P] [--timeout-s T] [--keep K] [--result OUT.json] [--parent-pid PID]
        [--validation-json JSON (done by the trainer)] [--hold-s S (tests)]
    python -m opd_patches.ops.finish validate EXPORT [opd_patches.ops.validate's options]   (what the CPU child runs)

With `opd.background_save: true` (opd_patches/config.py) the trainer starts this as a subprocess right
after upstream's save and trains on; otherwise it calls `finish()` in-process. Either way the order
is the same: the end of the state files' background writes (state_writer.py; the model files only, when the
export is built here), the HF export's weights built from those files (`opd.background_export`, state_export.py), export validation
(`opd_patches.ops.validate` in a CPU-only child process, started when the finish starts so that its imports run
beside the writes and the export's build; the child leaves with os._exit once its answer is written; a tiny
export in-process, and before a background finish by the trainer itself, so that the finish process imports
neither torch nor transformers), the sha256 of every file (the state's outside the export hashed by a thread beside the export's build and
validation, once every write has ended; the export's own beside its validation), the receipt written last
(receipts.py: only now is the state complete), then pruning (checkpoints.py; only here, over
completed states, one finish at a time). A state file whose write failed leaves the state without a
receipt (the result names it under "error").

A background finish dies with the trainer (`--parent-pid`: Linux parent-death signal, and an exit
when that parent is already gone), and its validator dies with it: a SIGKILL of the training leaves
the state without a receipt (incomplete, never resumed from), never a receipt written later by an
orphan. `receipt.json.pending` marks the window for listings and tests.
"""

import argparse
import ctypes
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from opd_patches.ops import checkpoints, export, receipts

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None) -> None:
    """Get SIGKILL when the parent dies (Linux); exit at once if it already has (re-parented)."""
    if not parent_pid:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the ppid check below still covers a dead parent at start
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


# An export this small (the tiny test models) is validated in this process: the child's start-up (importing
# torch and transformers) costs far more than the check, and its memory is no concern.
IN_PROCESS_BYTES = 64 * 2**20


def tiny(export: Path) -> bool:
    """Whether the export's weights (0 < bytes <= IN_PROCESS_BYTES) are validated in-process."""
    weights = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in Path(export).glob(pattern))
    return 0 < weights <= IN_PROCESS_BYTES


TIMES = "[validator times] "  # the child's last line: when it was ready and when its answer was written


class Validator:
    """opd_patches.ops.validate in a CPU-only child (never contends with training memory), started with the finish,
    before the export is there: the child imports torch and transformers (several seconds, more on a busy host)
    beside the writes and the export's build, then waits on its stdin until `result()` sends "go"."""

    def __init__(self, export: Path, expected_params: int | None):
        self.export = export
        self._tmp = tempfile.TemporaryDirectory()
        self.out = Path(self._tmp.name) / "validation.json"
        cmd = [sys.executable, "-m", "opd_patches.ops.finish", "validate", "--parent-pid", str(os.getpid()),
               "--wait-go", "--json", str(self.out)]
        if expected_params:
            cmd += ["--expected-params", str(expected_params)]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)

    def result(self, timeout_s: float) -> dict:
        """The receipt's `validation` of the export; the child has ended when this returns. Its `seconds` add the
        child's own overheads: `child start` (from "go" until the child had imported and read it; 0 when it was
        waiting) and `child exit`."""
        sent = time.time()
        try:
            output, _ = self.proc.communicate(f"go {self.export}\n", timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.cancel()
            return {"ok": False, "checks": {}, "error": f"validation timed out after {timeout_s:g} s"}
        returned = time.time()
        try:
            if not self.out.exists():
                tail = (output or "").strip().splitlines()[-3:]
                return {"ok": False, "checks": {}, "error": f"validator exit {self.proc.returncode}: {' | '.join(tail)}"}
            validation = _receipt_validation(json.loads(self.out.read_text()))
            times = [json.loads(line[len(TIMES):]) for line in output.splitlines() if line.startswith(TIMES)]
            if times and validation["seconds"] is not None:
                validation["seconds"] = {"child start": round(max(0.0, times[-1]["ready_at"] - sent), 3),
                                         **validation["seconds"],
                                         "child exit": round(max(0.0, returned - times[-1]["ended_at"]), 3)}
            return validation
        finally:
            self._tmp.cleanup()

    def cancel(self) -> None:
        """End the child if it still runs (a finish that failed before its validation); idempotent."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        self._tmp.cleanup()


def validate_export(export: Path, expected_params: int | None, timeout_s: float) -> dict:
    """The receipt's `validation` of `export`: in the CPU-only child (Validator), or here for a tiny export."""
    if tiny(export):
        from opd_patches.ops import validate

        return _receipt_validation(validate.check(Path(export), expected_params=expected_params))
    return Validator(export, expected_params).result(timeout_s)


def large(expected_params: int | None) -> bool:
    """Whether an export of `expected_params` parameters (validate.expected_parameters_for), not yet written, will
    be over IN_PROCESS_BYTES at 2 bytes each (bfloat16, the smallest stored dtype). False when unknown: the
    validation then decides once the export is there."""
    return bool(expected_params) and 2 * int(expected_params) > IN_PROCESS_BYTES


def validated_here(state: Path, expected_params: int | None, timeout_s: float) -> dict | None:
    """The validation of `state`'s tiny export, done in this process before its background finish starts (that
    process then imports neither torch nor transformers, each more CPU than the check, docs/bench/history.md);
    None for any other export (the finish validates it). Leaves this process's torch random state as it was."""
    hf = Path(state) / receipts.HF_EXPORT
    if not tiny(hf):
        return None
    import torch

    export.make_portable(hf)  # validated as the finish would: after it (idempotent there)
    with torch.random.fork_rng(devices=[]):
        return validate_export(hf, expected_params, timeout_s)


def _receipt_validation(result: dict) -> dict:
    return {"ok": bool(result["valid"]), "checks": result.get("checks", {}), "error": result.get("reason"),
            "parameters": result.get("parameters"), "stored_dtype": result.get("stored_dtype"),
            "loaded_as": result.get("loaded_as"), "seconds": result.get("seconds")}


# The files the HF export is built from (state_export.py): the export starts once these are on disk, while
# the optimizer's (twice their size) are still being written.
EXPORT_INPUTS = "model_world_size_*"


class _StateHasher(threading.Thread):
    """Hashes the state's files outside the HF export once their background writes have ended, beside the
    export's build and validation (which read only the model files and the export)."""

    def __init__(self, state: Path, timeout_s: float):
        super().__init__(name="state-sha256", daemon=True)
        self.state, self.timeout_s = state, timeout_s
        self.files, self.error, self.ended = None, None, None

    def run(self):
        try:
            receipts.wait_for_writes(self.state, self.timeout_s)
            self.files = receipts.hash_files(self.state, receipts.state_files(self.state, outside=receipts.HF_EXPORT))
        except BaseException as exc:  # noqa: BLE001 - reported by finish(), never lost
            self.error = exc
        self.ended = time.monotonic()


def finish(state: Path, step: int, validate: bool = True, expected_params: int | None = None,
           timeout_s: float = 1800, keep: int | None = None, build_export: bool = False,
           validation: dict | None = None, hold_s: float = 0.0) -> dict:
    """(Build the HF export,) validate, hash, write the receipt, prune; returns what happened with the
    seconds each part took. build_export: the weights come from the state files (state_export.py).
    validation: the export's, already done (`validated_here`); it goes into the receipt as it is.
    hold_s: TEST ONLY (opd.debug.finish_hold_s) wait before hashing: a window to kill the run in.

    Side by side (at 1.5B each stage takes tens of seconds, docs/performance.md): the state's
    files outside the export are hashed by a thread as soon as all writes have ended, while the export is
    built (it waits only for the model files) and validated; the export's own files are hashed beside its
    validation. The receipt still comes after every write, the validation and every hash."""
    state = Path(state)
    # The validating child imports beside the writes and the export's build (`Validator`).
    warm = (Validator(state / receipts.HF_EXPORT, expected_params)
            if validate and validation is None and large(expected_params) else None)
    try:
        return _finish(state, step, validate, expected_params, timeout_s, keep, build_export, validation, hold_s, warm)
    finally:
        if warm is not None:
            warm.cancel()


def _finish(state: Path, step: int, validate: bool, expected_params: int | None, timeout_s: float, keep: int | None,
            build_export: bool, validation: dict | None, hold_s: float, warm: Validator | None) -> dict:
    t0 = time.monotonic()
    hasher = _StateHasher(state, timeout_s)
    hasher.start()
    try:
        receipts.wait_for_writes(state, timeout_s, pattern=EXPORT_INPUTS if build_export else "*")
    except (OSError, TimeoutError) as exc:
        hasher.join()
        return {"step": int(step), "error": str(exc), "ended_at": time.time()}
    t_written = time.monotonic()
    if build_export:
        from opd_patches.ops import state_export  # imports torch + VERL: only here

        try:
            state_export.write_export(state / "actor")
        except Exception as exc:  # the state stays without a receipt: incomplete, never resumed from
            hasher.join()
            return {"step": int(step), "error": f"building the HF export of {state} failed: {exc!r}",
                    "ended_at": time.time()}
    t_exported = time.monotonic()
    export.make_portable(state / receipts.HF_EXPORT)  # before validation and hashing: what users load
    # The export's files are hashed beside its validation (which only reads them): the last save of a run
    # waits for both, and one after the other their times add up (docs/performance.md).
    with ThreadPoolExecutor(1, thread_name_prefix="export-sha256") as pool:
        hf_hashing = pool.submit(receipts.hash_files, state, receipts.state_files(state, under=receipts.HF_EXPORT))
        if warm is not None:
            validation = warm.result(timeout_s)
        elif validation is None and validate:
            validation = validate_export(state / receipts.HF_EXPORT, expected_params, timeout_s)
        time.sleep(hold_s)
        t1 = time.monotonic()
        hf_files = hf_hashing.result()
    hasher.join()
    if hasher.error is not None:
        return {"step": int(step), "error": str(hasher.error), "ended_at": time.time()}
    files = dict(sorted({**hasher.files, **hf_files}.items()))
    missed = set(receipts.state_files(state)) - set(files)  # nothing else writes here; checked, not assumed
    if missed:
        files = dict(sorted({**files, **receipts.hash_files(state, sorted(missed))}.items()))
    t2 = time.monotonic()
    try:
        receipts.write(state, step, validation, files=files)
    except OSError as exc:
        raise OSError(exc.errno, f"writing the receipt of {state} failed ({exc.strerror or exc}); the state stays "
                      "incomplete and the previous complete states are intact. Free disk space and relaunch "
                      "to resume.") from exc
    (state / receipts.PENDING).unlink(missing_ok=True)
    removed = checkpoints.prune(state.parent, keep) if keep else []
    # hash_s: what the hashing added after the validation had ended
    return {"step": int(step), "validation": validation, "pruned": removed, "write_wait_s": t_written - t0,
            "export_s": t_exported - t_written, "validate_s": t1 - t_exported, "hash_s": t2 - t1,
            "state_hashed_s": hasher.ended - t0, "seconds": time.monotonic() - t0, "ended_at": time.time()}


def launch(state: Path, step: int, result: Path, **kwargs) -> subprocess.Popen:
    """Start `finish` in a subprocess tied to this process (see the module docstring)."""
    state = Path(state)
    receipts.atomic_write_json(state / receipts.PENDING, {
        "pid": os.getpid(), "step": int(step),
        "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")})
    cmd = [sys.executable, "-m", "opd_patches.ops.finish", "finish", "--state", str(state), "--step", str(step),
           "--result", str(result), "--parent-pid", str(os.getpid()), "--timeout-s", str(kwargs.get("timeout_s", 1800))]
    if kwargs.get("validate", True):
        cmd.append("--validate")
    if kwargs.get("expected_params"):
        cmd += ["--expected-params", str(kwargs["expected_params"])]
    if kwargs.get("keep"):
        cmd += ["--keep", str(kwargs["keep"])]
    if kwargs.get("build_export"):
        cmd.append("--build-export")
    if kwargs.get("hold_s"):
        cmd += ["--hold-s", str(kwargs["hold_s"])]
    if kwargs.get("validation") is not None:
        cmd += ["--validation-json", json.dumps(kwargs["validation"])]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)


def collect(proc: subprocess.Popen, result: Path, state: Path, wait: bool) -> dict | None:
    """The finished background result (None while it runs); a failed finish is reported, not raised."""
    if proc.poll() is None and not wait:
        return None
    code = proc.wait()
    try:
        return json.loads(Path(result).read_text())
    except (OSError, ValueError):
        return {"step": None, "error": f"background finish of {state} exited {code} without a result; "
                f"the state stays incomplete ({receipts.problem(state)})"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["validate"]:  # opd_patches.ops.validate, tied to the finishing process
        parser = argparse.ArgumentParser(prog="finish validate")
        parser.add_argument("--parent-pid", type=int)
        parser.add_argument("--wait-go", action="store_true",
                            help="import, then wait for 'go EXPORT' on stdin (Validator); EXPORT is validated")
        args, rest = parser.parse_known_args(argv[1:])
        die_with_parent(args.parent_pid)
        from opd_patches.ops import validate

        if args.wait_go:
            from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401 - the lazy imports

            line = sys.stdin.readline().strip()
            if not line.startswith("go "):  # the finish gave up before its validation
                return 3
            rest = [line[3:], *rest]
        ready = time.time()
        code = validate.main(rest)
        print(TIMES + json.dumps({"ready_at": ready, "ended_at": time.time()}), flush=True)
        # The answer is written: leave without tearing down torch and a 1.5 B model (docs/performance.md).
        sys.stderr.flush()
        os._exit(code)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("finish", help="validate, hash, write the receipt, prune")
    f.add_argument("--state", type=Path, required=True)
    f.add_argument("--step", type=int, required=True)
    f.add_argument("--validate", action="store_true")
    f.add_argument("--expected-params", type=int)
    f.add_argument("--timeout-s", type=float, default=1800)
    f.add_argument("--keep", type=int)
    f.add_argument("--build-export", action="store_true", help="write the HF export's weights from the state files")
    f.add_argument("--validation-json", type=json.loads, help="the export's validation, already done (JSON)")
    f.add_argument("--hold-s", type=float, default=0.0, help="TEST ONLY: wait before hashing (opd.debug.finish_hold_s)")
    f.add_argument("--result", type=Path, help="write the result here (JSON)")
    f.add_argument("--parent-pid", type=int, help="die with this process (the trainer)")
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    if not args.state.is_dir():
        print(f"--state {args.state}: no such state folder", file=sys.stderr)
        return 2
    out = finish(args.state, args.step, args.validate, args.expected_params, args.timeout_s, args.keep,
                 build_export=args.build_export, validation=args.validation_json, hold_s=args.hold_s)
    if args.result:
        receipts.atomic_write_json(args.result, out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
