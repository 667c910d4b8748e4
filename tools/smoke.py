"""The smoke check behind `make smoke`: two real training steps per recipe, then the export must validate.

    python -m tools.smoke [--recipes k1 topk topk_tail] [--out outputs/smoke] [--timeout 300]

For each recipe: `./run.sh recipe=R +overlay=smoke` on the embedded default (tiny student and
teacher, prompts built in code; CPU or GPU by run.sh's device detection) under a timeout, then
`validate_export` on the step-2 Hugging Face export against the initial student. Writes
`<out>/<recipe>/run.log` and `<out>/smoke.json`; exits non-zero naming the first failure.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from opd_patches.ops.validate import ExportInvalid, validate_export

REPO = Path(__file__).resolve().parents[1]
STEPS = 2


def run_recipe(recipe: str, out: Path, timeout: int, extra: list[str]) -> dict:
    run_dir = out / recipe
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)
    env = {**os.environ, "EMBEDDED": "1", "OUTPUT_DIR": str(run_dir), "PYTHON": sys.executable,
           "PYTHONUNBUFFERED": "1"}
    cmd = [str(REPO / "run.sh"), f"recipe={recipe}", "+overlay=smoke", *extra]
    print(f"[smoke] {recipe}: {' '.join(cmd)}  (log: {run_dir / 'run.log'})", flush=True)
    start = time.monotonic()
    with open(run_dir / "run.log", "w") as log:
        try:
            proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    result = {"recipe": recipe, "wall_s": round(time.monotonic() - start, 1), "run_dir": str(run_dir)}
    if code != 0:
        tail = (run_dir / "run.log").read_text(errors="replace").splitlines()[-15:]
        return {**result, "ok": False, "reason": f"run.sh exit {code} (timeout {timeout} s)", "log_tail": tail}
    export = run_dir / f"global_step_{STEPS}" / "actor" / "huggingface"
    try:
        validation = validate_export(export, initial=REPO / ".cache" / "embedded" / "student")
    except ExportInvalid as exc:
        return {**result, "ok": False, "reason": f"export invalid: {exc}"}
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if steps != list(range(1, STEPS + 1)):
        return {**result, "ok": False, "reason": f"metrics.jsonl logged steps {steps}, expected 1..{STEPS}"}
    return {**result, "ok": True, "validation": validation}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["k1", "topk", "topk_tail"])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "smoke")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per recipe")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every recipe")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    results = []
    for recipe in args.recipes:
        results.append(run_recipe(recipe, args.out, args.timeout, args.overrides))
        r = results[-1]
        print(f"[smoke] {recipe}: {'ok' if r['ok'] else 'FAILED: ' + r['reason']} ({r['wall_s']} s)", flush=True)
        if not r["ok"]:
            print("\n".join(r.get("log_tail", [])), file=sys.stderr)
            break
    (args.out / "smoke.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) and len(results) == len(args.recipes) else 1


if __name__ == "__main__":
    sys.exit(main())
