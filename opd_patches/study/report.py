"""The study report: `<out>/report.md`, `<out>/report.json`, `<out>/report.png`.

For each (suite, checkpoint label) and each arm, from the evaluations' generations.jsonl:
- pooled pass@1 over seeds (`stats.aggregate_seeds`: per question, all samples of all seeds) with its
  question-clustered SE, the per-seed pass@1 and the seed-to-seed spread (std, ddof=1);
- against the control arm, paired by question (`stats.paired_difference` on the pooled results):
  difference, its clustered SE, the two-sided p-value (paired t) and the verdict in words ("within
  noise" when |diff| < 2 SE or p >= 0.05); where both arms measured the teacher-KL, its difference paired by
  question the same way (`teacher_kl`: diff, SE, p; seeds averaged per question).
Seeds of one arm are pooled on the questions all of them cover (a seed with fewer is reported).
The chart has one panel per (suite, label): bars = pooled pass@1 +/- 2 clustered SE, dots = seeds.

References (the spec's `references`: models evaluated as they are, e.g. the student and its teacher) get
their own rows. When a spec has references, `<out>/summary.json` holds, for the first suite: each reference
by name (`pass_at_1`, `se_clustered`, `teacher_kl`) and under `arms` each arm's end (its highest evaluated
step, pooled over seeds) with `teacher_kl` at start (the reference `student`, else the first) and end, the
paired gain over the start (`gain`: diff, SE, p) and the `curve` (step, pass@1, SE, teacher-KL, from 0 =
the start), plus `steps` and `seeds`; `curves.png` plots the curves (`make learn`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from opd_patches.eval import stats
from opd_patches.eval.summary import load_records, results
from opd_patches.ops.receipts import atomic_write_json

RULE = ("pooled pass@1 = mean over questions of each question's mean over all samples of all seeds; SE = "
        "question-clustered (std of per-question means / sqrt(questions)); differences are paired by question "
        "against the control; p = two-sided paired t-test; \"within noise\" when |diff| < 2 SE or p >= 0.05")


def eval_results(out: Path, protocol_samples: int | None = None) -> dict | None:
    """{question: [0/1...]} of one evaluation folder (its summary must be complete), else None."""
    try:
        summary = json.loads((Path(out) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not summary.get("complete"):
        return None
    records, _ = load_records(Path(out) / "generations.jsonl")
    samples = (summary.get("protocol") or {}).get("samples") or protocol_samples
    if samples:  # the harness keeps lines of earlier, larger requests in the file
        records = [r for r in records if r["sample"] < samples]
    return results(records) if records else None


def finite(x):
    """x, or None where JSON has no number for it (nan, inf)."""
    return None if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))) else x


def json_block(d: dict, keys) -> dict:
    """The `keys` of a statistics result (eval/stats.py), nan and inf as None."""
    return {k: finite(d[k]) if isinstance(d[k], float) else d[k] for k in keys}


def arm_block(per_seed: dict) -> dict:
    """Pooled statistics of one arm: per_seed = {seed: results mapping}."""
    common = set.intersection(*(set(r) for r in per_seed.values()))
    dropped = {s: len(r) - len(common) for s, r in per_seed.items() if len(r) != len(common)}
    agg = stats.aggregate_seeds([{q: r[q] for q in r if q in common} for r in per_seed.values()])
    return {
        "pass_at_1": agg["mean"],
        "se": finite(agg["pooled"]["clustered_se"]),
        "n_questions": agg["pooled"]["n_questions"],
        "n_samples": agg["pooled"]["n_samples"],
        "per_seed": {str(s): m for s, m in zip(per_seed, agg["per_seed_means"])},
        "seed_std": finite(agg["seed_std"]),
        "questions_dropped_per_seed": dropped,
        "pooled_results": agg["pooled_results"],
    }


def build(spec, plans, jobs: list, job_results: dict) -> dict:
    """The report data. jobs: evaluate.EvalJob list; job_results: {id(job): run_job result}."""
    groups, references = {}, {}
    for job in jobs:
        res = eval_results(job.out)
        if res is None:
            continue
        if job.plan is None:
            p = stats.pass_at_1(res)
            references.setdefault(job.suite, {})[job.ref] = {
                "model": str(job.model), "pass_at_1": p["mean"], "se": finite(p["clustered_se"]),
                "n_questions": p["n_questions"], "teacher_kl": _kl(job.out).get("teacher_kl"), "results": res}
            continue
        g = groups.setdefault((job.suite, job.label), {})
        g.setdefault(job.plan.arm, {})[job.plan.seed] = {"results": res, "step": job.step, "kl": _kl(job.out)}
    out_groups = []
    arm_order = [a.name for a in spec.arms]
    for (suite, label), by_arm in groups.items():
        arms = {}
        for arm in arm_order:
            if arm in by_arm:
                seeds = by_arm[arm]
                block = arm_block({s: e["results"] for s, e in seeds.items()})
                block["steps"] = {str(s): e["step"] for s, e in seeds.items()}
                kls = [e["kl"]["teacher_kl"] for e in seeds.values() if e["kl"].get("teacher_kl") is not None]
                block["teacher_kl"] = sum(kls) / len(kls) if kls else None
                seeds_kl = [e["kl"]["per_question"] for e in seeds.values() if e["kl"].get("per_question")]
                shared = set.intersection(*(set(k) for k in seeds_kl)) if seeds_kl else set()
                # {question: [each seed's mean]} on the questions every seed with values covers, as for pass@1
                block["teacher_kl_per_question"] = {q: [k[q] for k in seeds_kl] for q in sorted(shared)} or None
                arms[arm] = block
        diffs = {}
        if spec.control in arms:
            ctrl = arms[spec.control]["pooled_results"]
            for arm, block in arms.items():
                if arm == spec.control:
                    continue
                d = stats.paired_difference(block["pooled_results"], ctrl, arm, spec.control)
                diffs[arm] = json_block(d, ("diff", "se", "t", "p_value", "verdict", "n_common", "p_method"))
                mine, ctrl_kl = block["teacher_kl_per_question"], arms[spec.control]["teacher_kl_per_question"]
                if mine and ctrl_kl and set(mine) & set(ctrl_kl):  # lower is better: no verdict in words
                    d = stats.paired_difference(mine, ctrl_kl, arm, spec.control, bounded=False)
                    diffs[arm]["teacher_kl"] = json_block(d, ("diff", "se", "t", "p_value", "n_common"))
                elif block["teacher_kl"] is not None and arms[spec.control]["teacher_kl"] is not None:
                    diffs[arm]["teacher_kl"] = {"missing": "an evaluation's summary.json has no per-question "
                                                           "teacher-KL: evaluate it again to pair it"}
        out_groups.append({"suite": suite, "checkpoint": label, "arms": arms, "diffs": diffs,
                           "missing_arms": [a for a in arm_order if a not in arms]})
    runs = [{"arm": p.arm, "seed": p.seed, "recipe": p.recipe, "run_dir": str(p.run_dir), **p.result} for p in plans]
    evals = [{"arm": j.plan.arm if j.plan else j.ref, "seed": j.plan.seed if j.plan else None, "checkpoint": j.label,
              "step": j.step, "suite": j.suite, "out": str(j.out), **job_results.get(id(j), {})} for j in jobs]
    return {
        "study": spec.name, "spec": str(spec.path), "control": spec.control, "seeds": spec.seeds,
        "budget": spec.budget, "eval": spec.eval, "rule": RULE,
        "arms": [{"name": a.name, "recipe": a.recipe, "overrides": a.overrides, "note": a.note} for a in spec.arms],
        "knobs": (spec.ablation or {}).get("knobs"),
        "runs": runs, "evaluations": evals, "groups": out_groups, "references": references,
    }


def _kl(folder: Path) -> dict:
    """The evaluation's teacher-KL block (`teacher_kl`: nats per response token; `per_question`: {question: its
    mean}), {} where it measured none."""
    try:
        return json.loads((Path(folder) / "summary.json").read_text()).get("teacher_kl") or {}
    except (OSError, ValueError):
        return {}


def _step(label: str, steps: dict) -> int | None:
    if label.startswith("step "):
        return int(label.split()[1])
    return max(steps.values()) if steps else None  # "last": the seeds' newest states


def learning_summary(data: dict) -> dict | None:
    """summary.json's content (see the module docstring), or None without references."""
    if not data["references"]:
        return None
    suite = next(iter(data["references"]))
    refs = data["references"][suite]
    start_name = "student" if "student" in refs else next(iter(refs))
    start = refs[start_name]
    out = {"study": data["study"], "suite": suite, "seeds": data["seeds"], "steps": data["budget"].get("steps"),
           "start": start_name, "rule": data["rule"],
           "teacher_kl_definition": "KL(student || teacher) per response token on fresh student samples at T=1, "
                                    "full vocabulary (opd_patches/eval/teacher_kl.py)"}
    for name, r in refs.items():
        out[name] = {"pass_at_1": r["pass_at_1"], "se_clustered": r["se"], "teacher_kl": r["teacher_kl"],
                     "n_questions": r["n_questions"], "model": r["model"]}
    arms = {}
    for g in data["groups"]:
        if g["suite"] != suite:
            continue
        for arm, b in g["arms"].items():
            step = _step(g["checkpoint"], b["steps"])
            arms.setdefault(arm, []).append((step, b))
    out["arms"] = {}
    for arm, points in arms.items():
        points.sort(key=lambda x: (x[0] is None, x[0]))
        end_step, end = points[-1]
        gain = stats.paired_difference(end["pooled_results"], start["results"], arm, start_name)
        curve = [{"step": 0, "pass_at_1": start["pass_at_1"], "se_clustered": start["se"], "teacher_kl": start["teacher_kl"]}]
        curve += [{"step": st, "pass_at_1": b["pass_at_1"], "se_clustered": b["se"], "teacher_kl": b["teacher_kl"]}
                  for st, b in points]
        kl0, kl1 = start["teacher_kl"], end["teacher_kl"]
        out["arms"][arm] = {
            "step": end_step, "pass_at_1": end["pass_at_1"], "se_clustered": end["se"], "per_seed": end["per_seed"],
            "pass_at_1_start": start["pass_at_1"],
            "gain": json_block(gain, ("diff", "se", "t", "p_value", "n_common")),
            "teacher_kl": {"start": kl0, "end": kl1,
                           "ratio": None if kl0 in (None, 0) or kl1 is None else kl1 / kl0},
            "curve": curve,
        }
    return out


def summary_table(summ: dict) -> str:
    """The table `make learn` prints: the start, each arm's end, the other references."""
    rows = [f"{'model':<12} {'step':>5} {'pass@1':>8} {'+/- SE':>7} {'gain vs ' + summ['start']:>16} {'teacher-KL':>11}"]
    def line(name, step, p, se, gain, kl):
        return f"{name:<12} {step:>5} {p:>8.3f} {se or 0:>7.3f} {gain:>16} {'-' if kl is None else format(kl, '.4f'):>11}"
    refs = [k for k, v in summ.items() if isinstance(v, dict) and "model" in v]
    s0 = summ[summ["start"]]
    rows.append(line(summ["start"], 0, s0["pass_at_1"], s0["se_clustered"], "", s0["teacher_kl"]))
    for arm, a in summ["arms"].items():
        g = a["gain"]
        rows.append(line(arm, a["step"], a["pass_at_1"], a["se_clustered"], f"{g['diff']:+.3f} ({g['se'] or 0:.3f})",
                         a["teacher_kl"]["end"]))
    for name in refs:
        if name != summ["start"]:
            r = summ[name]
            rows.append(line(name, "-", r["pass_at_1"], r["se_clustered"], "", r["teacher_kl"]))
    return "\n".join(rows)


def curves_chart(summ: dict, path: Path) -> Path | None:
    from opd_patches.eval.plot import _pyplot

    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for arm, a in summ["arms"].items():
        xs = [c["step"] for c in a["curve"]]
        ax1.errorbar(xs, [c["pass_at_1"] for c in a["curve"]], yerr=[2 * (c["se_clustered"] or 0) for c in a["curve"]],
                     marker="o", ms=3, capsize=2, label=arm)
        kl = [(c["step"], c["teacher_kl"]) for c in a["curve"] if c["teacher_kl"] is not None]
        if kl:
            ax2.plot(*zip(*kl), marker="o", ms=3, label=arm)
    for name, v in summ.items():
        if isinstance(v, dict) and "model" in v and name != summ["start"]:
            ax1.axhline(v["pass_at_1"], ls="--", color="gray", lw=1)
            ax1.text(0, v["pass_at_1"], f" {name}", va="bottom", fontsize=8, color="gray")
    ax1.set_xlabel("step")
    ax1.set_ylabel(f"held-out pass@1 ({summ['suite']})")
    ax1.set_ylim(0, 1)
    ax1.legend(fontsize=8)
    ax2.set_xlabel("step")
    ax2.set_ylabel("teacher-KL (nats/token)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"study {summ['study']}: pooled over seeds {summ['seeds']}; error bars 2 clustered SE", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _f(x, fmt=".3f"):
    return "-" if x is None else format(x, fmt)


def markdown(data: dict, chart: str | None) -> str:
    budget = ", ".join(f"{k} {v}" for k, v in data["budget"].items() if v is not None)
    ck = data["eval"]["checkpoints"]
    lines = [f"# Study `{data['study']}`", "",
             f"Spec `{data['spec']}`; control arm **{data['control']}**; seeds {', '.join(map(str, data['seeds']))}; "
             f"budget per run: {budget}; checkpoints: {ck if isinstance(ck, str) else ', '.join(map(str, ck))}.", "",
             f"Statistics: {data['rule']}.", "", "## Arms", "", "| arm | recipe | overrides | note |", "|---|---|---|---|"]
    for a in data["arms"]:
        lines.append(f"| {a['name']} | {a['recipe']} | {'<br>'.join(f'`{o}`' for o in a['overrides']) or '-'} | {a['note'] or '-'} |")
    lines += ["", "## Runs", "", "| arm | seed | state | detail |", "|---|---|---|---|"]
    for r in data["runs"]:
        lines.append(f"| {r['arm']} | {r['seed']} | {r.get('state', '?')} | {r.get('detail', '')} |")
    for suite, refs in data.get("references", {}).items():
        lines += ["", f"## References on {suite}", "", "| model | pass@1 | SE | teacher-KL | folder |", "|---|---|---|---|---|"]
        lines += [f"| {n} | {r['pass_at_1']:.3f} | {_f(r['se'])} | {_f(r['teacher_kl'], '.4f')} | `{r['model']}` |"
                  for n, r in refs.items()]
    for g in data["groups"]:
        arms = g["arms"]
        n = next(iter(arms.values()))
        kl = any(b.get("teacher_kl") is not None for b in arms.values())  # a column only where measured
        lines += ["", f"## {g['suite']}, checkpoint {g['checkpoint']}", "",
                  f"{n['n_questions']} questions; samples pooled over seeds.", "",
                  f"| arm | pass@1 | SE | per seed | seed std |{' teacher-KL |' if kl else ''} diff vs {data['control']} | "
                  "SE diff | p | verdict |", "|---|---|---|---|---|" + ("---|" if kl else "") + "---|---|---|---|"]
        for arm, b in arms.items():
            seeds = ", ".join(f"{s}: {m:.3f}" for s, m in b["per_seed"].items())
            d = g["diffs"].get(arm)
            if d:
                verdict = d["verdict"].split(" (")[0]
                tail = f"{d['diff']:+.3f} | {_f(d['se'])} | {_f(d['p_value'], '.3g')} | {verdict} |"
            else:
                tail = "(control) | | | |" if arm == data["control"] else "- | - | - | no control results |"
            kl_cell = f"{_f(b.get('teacher_kl'), '.4f')} | " if kl else ""
            lines.append(f"| {arm} | {b['pass_at_1']:.3f} | {_f(b['se'])} | {seeds} | {_f(b['seed_std'])} | {kl_cell}{tail}")
        if g["missing_arms"]:
            lines.append(f"\nNo complete evaluation for: {', '.join(g['missing_arms'])}.")
        if g["diffs"]:
            lines += ["", "In words:"]
            lines += [f"- {arm} vs {data['control']}: {d['verdict']}" for arm, d in g["diffs"].items()]
            for arm, d in g["diffs"].items():
                kl = d.get("teacher_kl")
                if kl:
                    lines.append(f"- {arm} vs {data['control']}, teacher-KL (lower is closer to the teacher): " + (
                        f"not paired: {kl['missing']}" if "missing" in kl else
                        f"{_f(kl['diff'], '+.4f')}, SE {_f(kl['se'], '.4f')}, p {_f(kl['p_value'], '.3g')}"))
    if not data["groups"]:
        lines += ["", "No complete evaluation yet."]
    failed = [e for e in data["evaluations"] if e.get("state") in ("failed", "missing")]
    if failed:
        lines += ["", "## Evaluations not available", ""]
        lines += [f"- {e['arm']} seed {e['seed']} {e['checkpoint']} {e['suite']}: {e['state']}: {e.get('detail', '')}" for e in failed]
    if chart:
        lines += ["", f"![pass@1 per arm]({chart})"]
    if data.get("references") and data["groups"]:
        lines += ["", "![pass@1 and teacher-KL against the step](curves.png)"]
    return "\n".join(lines) + "\n"


def chart(data: dict, path: Path) -> Path | None:
    if not data["groups"]:
        return None
    from opd_patches.eval.plot import _pyplot

    plt = _pyplot()
    groups = data["groups"]
    width = max(4.5, 1.1 * max(len(g["arms"]) for g in groups) + 1.2)
    fig, axes = plt.subplots(1, len(groups), figsize=(width * len(groups), 3.8), squeeze=False)
    for ax, g in zip(axes[0], groups):
        names = list(g["arms"])
        means = [g["arms"][a]["pass_at_1"] for a in names]
        errs = [2 * (g["arms"][a]["se"] or 0.0) for a in names]
        colors = ["tab:gray" if a == data["control"] else "tab:blue" for a in names]
        ax.bar(range(len(names)), means, yerr=errs, capsize=5, color=colors, alpha=0.8)
        for x, a in enumerate(names):
            seeds = list(g["arms"][a]["per_seed"].values())
            ax.scatter([x] * len(seeds), seeds, color="black", s=12, zorder=3)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
        ax.set_ylim(0, max(0.05, min(1.0, max(m + e for m, e in zip(means, errs)) * 1.25)))
        ax.set_ylabel("pass@1")
        ax.set_title(f"{g['suite']} ({g['checkpoint']})", fontsize=9)
    fig.suptitle(f"study {data['study']}\npooled pass@1 +/- 2 clustered SE; dots: seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(out: Path, data: dict) -> dict:
    """report.json (without per-question rows), report.png, report.md; returns the paths."""
    out = Path(out)
    png = chart(data, out / "report.png")
    slim = {**data, "groups": [{**g, "arms": {a: {k: v for k, v in b.items() if k != "pooled_results"}
                                                for a, b in g["arms"].items()}} for g in data["groups"]],
            "references": {suite: {n: {k: v for k, v in r.items() if k != "results"} for n, r in refs.items()}
                           for suite, refs in data["references"].items()}}
    summ = learning_summary(data)
    extra = {}
    if summ is not None:
        atomic_write_json(out / "summary.json", summ)
        extra = {"summary": out / "summary.json", "table": summary_table(summ)}
        if summ["arms"]:
            extra["curves"] = curves_chart(summ, out / "curves.png")
    atomic_write_json(out / "report.json", slim)
    md = out / "report.md"
    tmp = md.with_name("report.md.tmp")
    tmp.write_text(markdown(data, png.name if png else None))
    tmp.replace(md)
    return {"md": md, "json": out / "report.json", "png": png, **extra}
