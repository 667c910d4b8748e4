"""The report of `make run` (study/chain.py): `<out>/report.md`, `<out>/report.json` and the training curves
`<out>/report/training_curves.png`, from what the run folder holds:

- environment: the GPU and driver (nvidia-smi), else CPU; torch, verl, vllm, transformers; the git commit
  and whether the tree was dirty, now and as the run's manifest recorded it;
- the recipe's composed values (opd_patches.main's SUMMARY_KEYS, from the run's manifest.json);
- data provenance: sha256 of every dataset file, rows kept and removed by decontamination (data_report.json);
- the training curves over every launch (metrics.N.jsonl of earlier launches merged, the later launch's
  line winning for a step);
- the selection table and the final score against the student's, paired by question (select/selection.json);
- the evaluation's GPU memory share where the final evaluation recorded one; each stage's wall time.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from opd_patches.ops import receipts
from opd_patches.ops.manifest import git_state
from opd_patches.ops.manifest import versions as package_versions
from opd_patches.study import deadline as dl
from opd_patches.study import select
from opd_patches.study.progress import human

PACKAGES = ("torch", "verl", "vllm", "transformers")


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment(manifest: dict | None) -> dict:
    gpus = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    versions = package_versions(PACKAGES)
    return {"device": [g.strip() for g in gpus.splitlines()] if gpus else "CPU", "packages": versions,
            "git": git_state(),
            "run_git": (manifest or {}).get("git"), "run_packages": (manifest or {}).get("packages")}


def _select(config: dict, key: str):
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def composed(manifest: dict | None) -> dict:
    from opd_patches.main import SUMMARY_KEYS

    config = (manifest or {}).get("config") or {}
    return {key: _select(config, key) for key in SUMMARY_KEYS}


def _sha(path: Path) -> str | None:
    return receipts.sha256(path) if path.is_file() else None


def provenance(chain) -> dict:
    files = {}
    if chain.task:
        for name in ("train.parquet", "val.parquet"):
            path = chain.train_files.with_name(name)
            files[str(path)] = _sha(path)
        return {"files": files, "note": f"the {chain.task} task's own generated data (no data stages)"}
    inputs = chain.inputs_now.get("data", {})
    files[inputs.get("dapo", "DAPO")] = inputs.get("dapo_sha256")
    for path in sorted(chain.eval_dir.glob("*.jsonl")):
        files[str(path)] = _sha(path)
    for name in ("train.parquet", "val.parquet"):
        if (chain.data_dir / name).is_file():
            files[str(chain.data_dir / name)] = _sha(chain.data_dir / name)
    try:
        rep = json.loads((chain.data_dir / "data_report.json").read_text())
    except (OSError, ValueError):
        rep = {}
    return {"files": files, "counts": rep.get("counts"), "removed": rep.get("removed"),
            "decontamination": (rep.get("decontamination") or {}).get("rule")}


def merged_metrics(run_dir: Path, out: Path) -> Path | None:
    """Every launch's metrics (metrics.1.jsonl, ..., metrics.jsonl) as one file, one line per step."""
    def launch(p: Path) -> int:
        middle = p.name[len("metrics."):-len(".jsonl")]
        return int(middle) if middle.isdigit() else 1 << 30  # metrics.jsonl: the latest launch
    by_step = {}
    for path in sorted(run_dir.glob("metrics*.jsonl"), key=launch):
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
                by_step[int(row["step"])] = row
            except (ValueError, KeyError, TypeError):
                continue  # a line cut off by a kill
    if not by_step:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(by_step[s]) + "\n" for s in sorted(by_step)))
    return out


def curves(run_dir: Path, folder: Path) -> dict:
    metrics = merged_metrics(run_dir, folder / "metrics.jsonl")
    if metrics is None:
        return {"png": None, "steps": [], "note": "no metrics logged"}
    from opd_patches.eval.plot import plot_curves, read_metrics

    steps = [r["step"] for r in read_metrics(metrics)]
    try:
        png = plot_curves(metrics, folder / "training_curves.png")
    except (KeyError, ValueError) as exc:
        return {"png": None, "steps": steps, "note": str(exc)}
    return {"png": str(png), "steps": steps, "note": ""}


def memory_share(selection: dict | None) -> dict | None:
    chosen = ((selection or {}).get("final") or {}).get("chosen")
    if not chosen:
        return None
    try:
        s = json.loads((Path(chosen["eval"]) / "summary.json").read_text())
    except (OSError, ValueError, KeyError):
        return None
    return {"backend": s.get("backend"), "gpu_memory_utilization": s.get("gpu_memory_utilization")}


def build(chain) -> dict:
    try:
        manifest = json.loads((chain.run_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = None
    try:
        selection = json.loads((chain.run_dir / select.FOLDER / "selection.json").read_text())
    except (OSError, ValueError):
        selection = None
    stages = [{"stage": s, "wall_s": r.get("wall_s"), "launches": r.get("launches"), "done": bool(r.get("finished_at")),
               "note": r.get("note", "")} for s, r in chain.state.get("stages", {}).items()]
    return {"out": str(chain.out), "written_at": time.time(), "task": chain.task, "recipe": chain.args.recipe,
            "overrides": chain.train_overrides(), "deadline": chain.state.get("deadline"),
            "estimate": chain.estimate, "launches": chain.state.get("launches", []),
            "environment": environment(manifest), "composed": composed(manifest), "data": provenance(chain),
            "curves": curves(chain.run_dir, chain.out / "report"), "selection": selection,
            "memory": memory_share(selection), "stages": stages}


def _f(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(data: dict) -> str:
    env = data["environment"]
    device = env["device"] if isinstance(env["device"], str) else "; ".join(env["device"])
    git = env["git"]
    lines = [f"# Run `{data['out']}`", "",
             f"Recipe `{data['recipe']}`" + (f" on the `{data['task']}` task" if data["task"] else "")
             + f"; overrides: `{' '.join(data['overrides']) or '(none)'}`.", ""]
    d = data["deadline"]
    if d:
        e = data["estimate"] or {}
        lines += [f"Deadline {dl.iso(d['deadline'])} (from {d['given']}, fixed at the first launch "
                  f"{dl.iso(d['first_launch'])}); selection and the final score were given ~{human(e.get('seconds'))} "
                  f"({_f(e.get('tokens_per_s'), ',.0f')} tokens/s, {e.get('source', '?')}).", ""]
    lines += ["## Environment", "", f"- device: {device}",
              "- packages: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in env["packages"].items()),
              f"- git: {git['commit']}{' (dirty)' if git['dirty'] else ''}"]
    if env.get("run_git") and env["run_git"] != git:
        rg = env["run_git"]
        lines.append(f"- git of the training (manifest): {rg.get('commit')}{' (dirty)' if rg.get('dirty') else ''}")
    lines += ["", "## Composed recipe", "", "| key | value |", "|---|---|"]
    lines += [f"| `{k}` | `{v}` |" for k, v in data["composed"].items()]
    prov = data["data"]
    lines += ["", "## Data", ""]
    if prov.get("note"):
        lines += [prov["note"] + ".", ""]
    lines += ["| file | sha256 |", "|---|---|"] + [f"| `{p}` | `{s or 'missing'}` |" for p, s in prov["files"].items()]
    if prov.get("counts"):
        c, r = prov["counts"], prov.get("removed") or {}
        lines += ["", "Rows: " + ", ".join(f"{k} {v:,d}" for k, v in c.items())
                  + f"; removed: {r.get('duplicate', 0):,d} duplicates, {r.get('contaminated', 0):,d} by decontamination"
                  + (f" ({prov['decontamination']})" if prov.get("decontamination") else "") + "."]
    cv = data["curves"]
    lines += ["", "## Training", ""]
    if cv["png"]:
        rel = Path(cv["png"]).relative_to(Path(data["out"])).as_posix()
        lines += [f"Steps logged: {cv['steps'][0]}..{cv['steps'][-1]} ({len(cv['steps'])}).", "", f"![training curves]({rel})"]
    else:
        lines.append(f"No curves: {cv['note']}.")
    sel = data["selection"]
    lines += ["", "## Selection", ""]
    if sel:
        body = select.markdown(sel).split("\n", 1)[1].replace("\n## ", "\n### ")
        lines.append(body.strip())
        fin = sel["final"]
        c, s, v = fin["chosen"], fin["student"], fin["chosen_vs_student"]
        lines += ["", "## Final score", ""]
        if c and s and v:
            lines += [f"Step {c['step']} on `{sel['final_suite']['suite']}`: pass@1 {c['pass_at_1']:.3f} +/- {_f(c['se'])} "
                      f"(question-clustered SE, {c['n_questions']} questions); the student: {s['pass_at_1']:.3f} +/- "
                      f"{_f(s['se'])}; difference, paired by question: {v['diff']:+.3f} +/- {_f(v['se'])} ({v['verdict']})."]
        else:
            lines.append("Not complete: an evaluation of the final suite is missing.")
    else:
        lines.append("No selection yet (select/selection.json).")
    mem = data["memory"]
    if mem:
        share = mem["gpu_memory_utilization"]
        lines += ["", f"Evaluation backend: {mem['backend']}; GPU memory share: "
                  + (f"{share:g}" if share is not None else "not recorded (no GPU engine)") + "."]
    lines += ["", "## Stages", "", "| stage | wall time | launches | done | note |", "|---|---|---|---|---|"]
    lines += [f"| {s['stage']} | {human(s['wall_s'])} | {s['launches']} | {'yes' if s['done'] else 'no'} | {s['note']} |"
              for s in data["stages"]]
    return "\n".join(lines) + "\n"


def write(chain) -> dict:
    data = build(chain)
    receipts.atomic_write_json(chain.out / "report.json", data)
    tmp = chain.out / "report.md.tmp"
    tmp.write_text(markdown(data))
    tmp.replace(chain.out / "report.md")
    return {"md": chain.out / "report.md", "json": chain.out / "report.json", "curves": data["curves"]["png"]}
