"""PNG plots: one evaluation's scores, scores per checkpoint, training curves.

    python -m opd_patches.eval.plot RUN_OR_SUMMARY ... [--out scores.png]
    python -m opd_patches.eval.plot --curves RUN/metrics.jsonl [--keys KEY ...] [--out curves.png]
    make plot RUN=outputs/k1          # both, into RUN/plots/

- `plot_summary`: one evaluation (`scores.png` beside its summary.json): pass@1 of the whole suite
  and of each source file, error bars = question-clustered SE.
- `plot_checkpoints`: every summary.json found under the given paths (files or folders, searched
  recursively; e.g. a run folder: `make select`'s `select/evals/global_step_N/<suite>/` and `make eval`'s
  `global_step_N/eval/<suite>/`), pass@1 +/- clustered SE against the training step (`summary["step"]`),
  one line per suite; one point per (suite, step), the selection's where both evaluated a step.
- `plot_curves`: a run's `metrics.jsonl` (`{"step": N, "data": {...}}` per line, VERL's metric names),
  one panel per key; default keys are those of `DEFAULT_CURVE_KEYS` present in the file plus any
  validation metric (`val-core/...`, `val-aux/...` means).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

from opd_patches.eval.summary import step_of

DEFAULT_CURVE_KEYS = (
    "actor/distillation/loss",
    "actor/distillation/teacher_mass",
    "actor/distillation/student_mass",
    "actor/distillation/overlap_ratio",
    "actor/grad_norm",
    "critic/score/mean",
    "response_length/mean",
    "response_length/clip_ratio",
)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def model_label(model: str, step: int | None = None) -> str:
    """What a plot calls a model: `<run> step N` for a checkpoint's export
    (`<run>/global_step_N/actor/huggingface`, whose own folder name says nothing), else its folder name."""
    path = Path(str(model))
    for parent in [path, *path.parents]:
        found = step_of(parent.name)
        if found is not None:
            return f"{parent.parent.name or parent.name} step {found if step is None else step}"
    return path.name + ("" if step is None else f" step {step}")


def _fit_title(ax, title: str, fontsize: float) -> None:
    """Set `title`, wrapped at spaces until the laid-out figure holds it (measured, not guessed)."""
    fig, width = ax.figure, len(title)
    while True:
        text = ax.set_title(textwrap.fill(title, width, break_on_hyphens=False), fontsize=fontsize)
        fig.tight_layout()
        box = text.get_window_extent(fig.canvas.get_renderer())
        if (fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1) or width <= 16:
            return
        width = int(width * 0.85)


def _err(se) -> float:
    return 0.0 if se is None or (isinstance(se, float) and math.isnan(se)) else float(se)


def plot_summary(summary: dict, path: Path) -> Path:
    plt = _pyplot()
    rows = [("all", summary)] + list(summary.get("per_source", {}).items())
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 + 1.2 * len(rows)), 3.6))
    xs = range(len(rows))
    ax.bar(xs, [r["pass_at_1"] for _, r in rows], yerr=[_err(r["se_clustered"]) for _, r in rows], capsize=6,
           color=["tab:blue"] + ["tab:gray"] * (len(rows) - 1))
    for x, (_, r) in zip(xs, rows):
        ax.annotate(f"{r['pass_at_1']:.3f}\n+/- {_err(r['se_clustered']):.3f}", (x, min(r["pass_at_1"] + _err(r["se_clustered"]), 0.85)),
                    textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    ax.set_xticks(list(xs), [f"{name}\n{r['n_questions']} q x {r['n_samples'] // max(r['n_questions'], 1)}" for name, r in rows])
    ax.set_ylim(0, 1)
    ax.set_ylabel("pass@1 (+/- clustered SE)")
    title = f"{summary['suite']}: {model_label(summary['model'], summary.get('step'))}"
    _fit_title(ax, title, fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def find_summaries(paths) -> list[dict]:
    found = []
    for p in map(Path, paths):
        files = sorted(p.rglob("summary.json")) if p.is_dir() else [p]
        for f in files:
            data = json.loads(f.read_text())
            if "pass_at_1" in data and "suite" in data:
                found.append({**data, "_path": str(f)})
    return found


SELECT_EVALS = "/select/evals/"  # make select's evaluations in a run folder (opd_patches/study/select.py)


def one_per_step(summaries: list[dict]) -> list[dict]:
    """One summary per (suite, step): `make select`'s over `make eval`'s, else the last found."""
    kept = {}
    for s in sorted(summaries, key=lambda s: SELECT_EVALS in Path(s["_path"]).as_posix()):
        kept[(s["suite"], s.get("step"), None if s.get("step") is not None else s["_path"])] = s
    return list(kept.values())


def plot_checkpoints(summaries: list[dict], path: Path) -> Path:
    if not summaries:
        raise ValueError("no evaluation summary.json found (run `make select` or `make eval` on the checkpoints first)")
    plt = _pyplot()
    by_suite = defaultdict(list)
    for s in one_per_step(summaries):
        by_suite[s["suite"]].append(s)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for suite, items in sorted(by_suite.items()):
        missing = [s["_path"] for s in items if s.get("step") is None]
        if missing and len(items) > 1:
            raise ValueError(f"summaries without a training step (pass --step to the eval): {missing}")
        items.sort(key=lambda s: s.get("step") or 0)
        steps = [s.get("step") or 0 for s in items]
        ax.errorbar(steps, [s["pass_at_1"] for s in items], yerr=[_err(s["se_clustered"]) for s in items],
                    marker="o", capsize=4, label=f"{suite} ({items[-1]['n_questions']} q)")
    ax.set_xlabel("training step")
    ax.set_ylabel("pass@1 (+/- question-clustered SE)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def read_metrics(path: Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut off by a killed run
    return rows


def plot_curves(metrics_path: Path, path: Path, keys=None) -> Path:
    rows = read_metrics(metrics_path)
    if not rows:
        raise ValueError(f"{metrics_path} holds no metrics lines")
    present = {k for r in rows for k in r.get("data", {})}
    if keys:
        unknown = [k for k in keys if k not in present]
        if unknown:
            raise KeyError(f"{metrics_path} has no {unknown}; it has e.g. {sorted(present)[:20]}")
    else:
        keys = [k for k in DEFAULT_CURVE_KEYS if k in present]
        keys += sorted(k for k in present if k.startswith(("val-core/", "val-aux/")) and "/mean@" in k)
        if not keys:
            raise KeyError(f"{metrics_path} has none of the default keys; pass --keys from {sorted(present)[:20]}")
    plt = _pyplot()
    cols = min(3, len(keys))
    nrows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 2.8 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        pts = [(r["step"], r["data"][key]) for r in rows if key in r.get("data", {})]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
        ax.set_title(key, fontsize=8)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle(str(metrics_path), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opd_patches.eval.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", help="summary.json files or folders holding them (e.g. a run folder)")
    ap.add_argument("--curves", type=Path, help="a run's metrics.jsonl: plot training curves instead")
    ap.add_argument("--keys", nargs="*", help="metric names for --curves")
    ap.add_argument("--out", type=Path, help="PNG path (default scores.png / training_curves.png)")
    args = ap.parse_args(argv)
    try:
        if args.curves:
            out = plot_curves(args.curves, args.out or Path("training_curves.png"), args.keys)
        else:
            if not args.paths:
                ap.error("give summary.json paths / folders, or --curves metrics.jsonl")
            out = plot_checkpoints(find_summaries(args.paths), args.out or Path("scores.png"))
    except (ValueError, KeyError, FileNotFoundError) as exc:
        print(f"[plot] error: {exc}", file=sys.stderr)
        return 2
    print(f"[plot] wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
