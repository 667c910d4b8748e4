"""Ablation arms: from a control and a treatment recipe, the arms that change one knob at a time.

    python -m opd_patches.study.arms --control k1 --treatment topk [--overrides +overlay=smoke ...] [--json]

Both recipes are composed with Hydra's compose API over recipes/ with pkg://verl.trainer.config on
the search path (as run.sh does; no Ray), flattened to dotted keys with interpolations kept unresolved
(`ppo_mini_batch_size: ${data.train_batch_size}` is the same text in both, so it follows the batch size
without being a difference of its own), and diffed. Differing keys are grouped into *knobs*: the keys
that must change together to stay a valid configuration (`KNOBS`, first matching row wins; a key no row
matches is a knob of its own; `BOOKKEEPING` keys are not knobs). The arms are

    control,  control + each knob (one at a time),  treatment

and every arm is composed and checked with upstream's own validation (the distillation dataclass,
e.g. "k1 needs policy gradient", "topk must be specified when use_topk is True", and
`validate_config`) plus the batch divisibility, so a knob that would leave an invalid config is
reported, not run. Override values come from the treatment; a key only the treatment has is added
with `+key=...`, a key only the control has is removed with `~key`.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import json
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
SEARCHPATH = "hydra.searchpath=[pkg://verl.trainer.config]"
# Placeholders so that upstream's validation (which requires model paths) can run on a bare recipe.
PLACEHOLDERS = ("actor_rollout_ref.model.path=/study/placeholder/student",
                "distillation.teacher_models.teacher_model.model_path=/study/placeholder/teacher",
                "+device=cpu")

# knob -> (key patterns (fnmatch on dotted keys), why they move together). Order matters: first match wins.
KNOBS: dict[str, tuple[tuple[str, ...], str]] = {
    "task_rewards": (("distillation.distillation_loss.use_task_rewards", "distillation.distillation_loss.distillation_loss_coef"),
                     "task-reward mixing: the flag and the coefficient that scales the distillation loss"),
    "loss": (("distillation.distillation_loss.loss_mode", "distillation.distillation_loss.use_policy_gradient",
              "distillation.distillation_loss.topk", "distillation.distillation_loss.policy_loss_mode",
              "distillation.distillation_loss.*"),
             "the loss: k1 needs use_policy_gradient=true, a top-k loss needs topk set; PG picks a policy_loss_mode"),
    "batch": (("data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size",
               "actor_rollout_ref.actor.ppo_micro_batch_size*"),
              "prompts per step: the mini-batch (one optimizer step per training step) must divide it"),
    "lr": (("actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.optim.lr_*", "actor_rollout_ref.actor.optim.*warmup*",
            "actor_rollout_ref.actor.optim.min_lr_ratio", "actor_rollout_ref.actor.optim.num_cycles"),
           "learning rate with its schedule"),
    "optimizer": (("actor_rollout_ref.actor.optim.*",), "other optimizer settings (weight decay, betas, ...)"),
    "data_order": (("data.shuffle", "data.seed"), "shuffling and the seed of the shuffle order"),
    "samples_per_prompt": (("actor_rollout_ref.rollout.n",), "samples per prompt"),
    "response_length": (("data.max_response_length", "actor_rollout_ref.rollout.response_length"), "the response cap"),
    "teacher": (("distillation.teacher_models.*",), "the teacher model and its inference settings"),
}
# Differences that change no learning: names and checkpoint bookkeeping (a study sets these uniformly).
BOOKKEEPING = ("trainer.experiment_name", "trainer.project_name", "trainer.save_freq", "trainer.test_freq",
               "trainer.default_local_dir", "trainer.max_actor_ckpt_to_keep", "trainer.logger")
ABSENT = object()


def knob_of(key: str) -> str:
    """The knob a dotted key belongs to (its own name when no row of KNOBS matches)."""
    for knob, (patterns, _) in KNOBS.items():
        if any(fnmatch.fnmatchcase(key, p) for p in patterns):
            return knob
    return key


def compose(recipe: str, overrides=()):
    """The composed (unresolved) config of a recipe plus overrides, as run.sh would build it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from opd_patches import config  # noqa: F401  (registers recipes/base.yaml's opd_defaults node)

    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        return hydra_compose(config_name=recipe, overrides=[SEARCHPATH, *overrides])


def flatten(node, prefix: str = "") -> dict:
    """{dotted key: leaf value} of a plain container (interpolation strings kept as text)."""
    if isinstance(node, dict):
        if not node and prefix:
            return {prefix: {}}
        out = {}
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def _container(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=False)


def diff(control: dict, treatment: dict, exclude=()) -> dict:
    """{key: (control value | ABSENT, treatment value | ABSENT)} of differing flat keys."""
    out = {}
    for key in sorted(set(control) | set(treatment)):
        if key in exclude or key in BOOKKEEPING:
            continue
        a, b = control.get(key, ABSENT), treatment.get(key, ABSENT)
        if a != b:
            out[key] = (a, b)
    return out


_BARE = re.compile(r"^[A-Za-z0-9_./:\-]+$")


def hydra_value(value) -> str:
    """A value in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if text.startswith("${") and text.endswith("}"):
        return text  # an interpolation is written as is
    if _BARE.match(text) and text.lower() not in ("null", "true", "false") and not _is_number(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def override_for(key: str, control_value, treatment_value) -> str:
    if treatment_value is ABSENT:
        return f"~{key}"
    return f"{'+' if control_value is ABSENT else ''}{key}={hydra_value(treatment_value)}"


def group(differences: dict) -> dict:
    """{knob: {key: (control, treatment)}}, knobs in KNOBS order, then single-key knobs by name."""
    knobs: dict = {}
    for key, pair in differences.items():
        knobs.setdefault(knob_of(key), {})[key] = pair
    order = list(KNOBS)
    return dict(sorted(knobs.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0])))


def check_valid(cfg) -> str | None:
    """None when upstream accepts the composed config, else the reason (validation output silenced)."""
    os.environ.setdefault("VERL_PLATFORM", "cpu")
    import opd_patches

    opd_patches.register()  # the project's losses: loss_mode names are checked against them
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            omega_conf_to_dataclass(cfg.distillation)
            validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
        batch = OmegaConf.select(cfg, "data.train_batch_size")
        mini = OmegaConf.select(cfg, "actor_rollout_ref.actor.ppo_mini_batch_size")
        if batch and mini and int(batch) % int(mini):
            return f"data.train_batch_size={batch} is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size={mini}"
    except BaseException as exc:  # Hydra wraps the dataclass errors; report the innermost message
        while exc.__cause__ is not None:
            exc = exc.__cause__
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
    return None


def ablation(control: str, treatment: str, overrides=(), exclude=(), compose=None, validate: bool = True) -> dict:
    """The one-knob-at-a-time arms of control -> treatment (with common `overrides` applied to both).

    Returns {"control", "treatment", "knobs": {knob: {"keys": {key: [control, treatment]}, "overrides": [...],
    "why": str}}, "arms": [{"name", "recipe", "overrides", "note", "valid": None|str}]}. `exclude` drops keys
    from the diff (a study excludes its seed keys: it sets them itself).
    """
    compose = compose or globals()["compose"]
    base = list(overrides)
    flat_c = flatten(_container(compose(control, base)))
    flat_t = flatten(_container(compose(treatment, base)))
    knobs = {}
    for knob, keys in group(diff(flat_c, flat_t, exclude=exclude)).items():
        knobs[knob] = {
            "keys": {k: [None if a is ABSENT else a, None if b is ABSENT else b] for k, (a, b) in keys.items()},
            "overrides": [override_for(k, a, b) for k, (a, b) in keys.items()],
            "why": KNOBS[knob][1] if knob in KNOBS else "a key of its own",
        }
    arms = [{"name": control, "recipe": control, "overrides": [], "note": "control"}]
    for knob, info in knobs.items():
        arms.append({"name": f"{control}+{_safe(knob)}", "recipe": control, "overrides": info["overrides"],
                     "note": f"control + {knob}"})
    arms.append({"name": treatment if treatment != control else f"{treatment}-treatment", "recipe": treatment,
                 "overrides": [], "note": "treatment"})
    for arm in arms:
        arm["valid"] = None
        if validate:
            arm["valid"] = check_valid(compose(arm["recipe"], [*PLACEHOLDERS, *base, *arm["overrides"]]))
    bad = [a for a in arms if a["valid"]]
    if validate and bad:
        raise ValueError("ablation arms that upstream refuses (a knob of KNOBS is missing a key it needs): "
                         + "; ".join(f"{a['name']}: {a['valid']}" for a in bad))
    return {"control": control, "treatment": treatment, "common_overrides": base, "knobs": knobs, "arms": arms}


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def format_table(result: dict) -> str:
    lines = [f"knobs: {result['control']} -> {result['treatment']}"]
    for knob, info in result["knobs"].items():
        lines.append(f"  {knob}  ({info['why']})")
        for key, (a, b) in info["keys"].items():
            lines.append(f"      {key}: {a!r} -> {b!r}")
    lines.append("arms:")
    for arm in result["arms"]:
        ov = " ".join(arm["overrides"]) or "(none)"
        lines.append(f"  {arm['name']:<24} recipe={arm['recipe']}  {ov}   [{arm['note']}]")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opd_patches.study.arms", description=__doc__.split("\n\n")[0])
    ap.add_argument("--control", required=True, help="control recipe (e.g. k1)")
    ap.add_argument("--treatment", required=True, help="treatment recipe (e.g. topk)")
    ap.add_argument("--overrides", nargs="*", default=[], help="Hydra overrides applied to both (e.g. +overlay=smoke)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    for name in (args.control, args.treatment):
        if name == "base" or not (RECIPES / f"{name}.yaml").is_file():
            known = sorted(p.stem for p in RECIPES.glob("*.yaml") if p.stem != "base")
            print(f"[arms] unknown recipe {name!r}; choose one of {', '.join(known)}", file=sys.stderr)
            return 2
    try:
        result = ablation(args.control, args.treatment, args.overrides)
    except ValueError as exc:
        print(f"[arms] error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1, default=str) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
