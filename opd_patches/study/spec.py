"""The study spec: a small YAML file, validated into a `Spec` with errors that name the key.

    name: k1_vs_topk                  # study name (default: the file's stem); folder-safe
    recipe: k1                        # base recipe of every arm (a file in recipes/)
    env: {EMBEDDED: "1"}              # run.sh variables (STUDENT, TEACHER, TRAIN_FILES, DEVICE, N_GPUS, ...)
    overrides: [+overlay=smoke]       # Hydra overrides for every arm (before the arm's own)
    arms:                             # name -> Hydra overrides; `recipe=NAME` switches the arm's recipe
      k1: []
      topk: [recipe=topk]
    control: k1                       # the arm the others are compared with (default: the first arm)
    # ablate: {control: k1, treatment: topk}   # instead of `arms`: control, control + each knob, treatment
    seeds: [1, 2]                     # each seed sets SEED_KEYS (data order, rollout sampling, actor)
    references: {student: .cache/addition/student}   # models evaluated as they are, beside the arms
    budget: {steps: 2}                # and/or {wall_clock_s: 3600, reserve_s: 600}
    parallel: 1                       # runs trained side by side (each starts its own Ray; CPU studies:
                                      #   one run leaves part of the cores idle; on one GPU keep 1)
    eval:
      suites: [math500]               # eval suite names or protocol .yaml paths
      checkpoints: last               # last | every | [20, 40]  (complete states on disk)
      limit: 3                        # optional: first N questions; samples, max_new_tokens, temperature,
      samples: 2                      #   top_p, seed, backend (auto|hf|vllm), data_dir, args: [extra CLI]
      max_new_tokens: 16
      teacher_kl: .cache/addition/teacher   # optional: also each model's teacher-KL (opd_patches/eval/teacher_kl.py)
      kl_samples: 1                   #   with this many fresh samples per question
      during_training: false          # true: evaluate the references and each saved state while the study
                                      #   trains on (a CPU study leaves a core idle; not on one GPU)

Relative model paths (references, teacher_kl) are taken from the repository root.

Conventions: the study sets `trainer.default_local_dir` (its own run folders) and the seed keys (last, so
they win over any recipe or arm value: an arm that sets one is warned about); `OUTPUT_DIR` and `RECIPE`
are not accepted in `env`. Every error is a `SpecError` whose message starts with the spec file and key.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
# The keys a study seed sets. data.seed: the sampler's shuffle order (only with data.shuffle=true);
# rollout.seed: VERL's rollout sampling seed (vLLM's seed; our hf rollout's per-sample generators);
# actor.data_loader_seed: mini-batch construction; actor.fsdp_config.seed: the engine's seed (used by
# full-determinism mode). The student's weights are a fixed checkpoint, so there is no init seed.
SEED_KEYS = (
    "data.seed",
    "actor_rollout_ref.rollout.seed",
    "actor_rollout_ref.actor.data_loader_seed",
    "actor_rollout_ref.actor.fsdp_config.seed",
)
TOP_KEYS = ("name", "recipe", "env", "overrides", "arms", "control", "ablate", "seeds", "references", "budget", "eval",
            "parallel")
BUDGET_KEYS = ("steps", "wall_clock_s", "reserve_s")
EVAL_KEYS = ("suites", "checkpoints", "limit", "samples", "max_new_tokens", "temperature", "top_p", "seed",
             "backend", "data_dir", "args", "teacher_kl", "kl_samples", "during_training")
STUDY_SET = ("trainer.default_local_dir",)  # keys only the study may set
ENV_REFUSED = {"OUTPUT_DIR": "the study puts each run in <out>/runs/<arm>/seed<S>",
               "RECIPE": "use `recipe: NAME` or `recipe=NAME` in an arm's overrides"}


class SpecError(ValueError):
    """A study spec that cannot work; the message names the file and key."""


@dataclass
class Arm:
    name: str
    recipe: str
    overrides: list[str]  # the arm's own overrides (without recipe=), after the spec's common ones
    note: str = ""        # e.g. which knob an ablation arm changes


@dataclass
class Spec:
    path: Path
    name: str
    recipe: str
    env: dict
    overrides: list[str]
    arms: list[Arm]
    control: str
    seeds: list[int]
    budget: dict
    eval: dict
    references: dict = field(default_factory=dict)  # name -> model folder, evaluated as is
    ablation: dict | None = None  # the arms module's output when `ablate` was used
    warnings: list[str] = field(default_factory=list)
    parallel: int = 1  # runs trained side by side

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)

    def budget_overrides(self) -> list[str]:
        out = []
        if self.budget.get("steps") is not None:
            out.append(f"trainer.total_training_steps={self.budget['steps']}")
        if self.budget.get("wall_clock_s") is not None:
            out.append(f"opd.wall_clock_s={self.budget['wall_clock_s']}")
        if self.budget.get("reserve_s") is not None:
            out.append(f"opd.reserve_s={self.budget['reserve_s']}")
        return out


def seed_overrides(seed: int) -> list[str]:
    return [f"{key}={seed}" for key in SEED_KEYS]


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.yaml") if p.stem != "base")


def _err(path, key, msg) -> SpecError:
    return SpecError(f"{path}: `{key}`: {msg}")


def check_recipe(path, key, name) -> str:
    if not isinstance(name, str) or name == "base" or not (RECIPES / f"{name}.yaml").is_file():
        raise _err(path, key, f"unknown recipe {name!r}; choose one of {', '.join(recipe_names())} (files in {RECIPES})")
    return name


def _override_list(path, key, value) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float, bool)) for v in value):
        raise _err(path, key, f"must be a list of Hydra overrides like `data.train_batch_size=8`, got {value!r}")
    out = [str(v) for v in value]
    for o in out:
        if "=" not in o and not o.startswith("~"):
            raise _err(path, key, f"{o!r} is not a Hydra override (KEY=VALUE, +KEY=VALUE or ~KEY)")
        bare = o.split("=", 1)[0].lstrip("+~")
        if bare in STUDY_SET:
            raise _err(path, key, f"{bare} is set by the study (each run's folder); remove it")
    return out


def split_recipe(path, key, overrides: list[str], default: str) -> tuple[str, list[str]]:
    """(recipe, overrides without recipe=...): `recipe=NAME` picks the recipe as on run.sh's command line."""
    recipe, rest = default, []
    for o in overrides:
        if o.startswith("recipe="):
            recipe = check_recipe(path, key, o.split("=", 1)[1])
        else:
            rest.append(o)
    return recipe, rest


def _number(path, key, value, kind=(int, float), positive=True):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kind) or (positive and value <= 0):
        what = "a positive " + ("integer" if kind is int else "number") if positive else f"a {kind}"
        raise _err(path, key, f"must be {what}, got {value!r}")
    return value


def _section(path, key: str, raw, known, shape: str) -> dict:
    """`raw`, a mapping of known keys only; otherwise the error names the key (`shape`: what it should be)."""
    if not isinstance(raw, dict):
        raise _err(path, key, f"must be a mapping {shape}")
    for k in raw:
        if k not in known:
            raise _err(path, f"{key}.{k}", f"unknown key; known: {', '.join(known)}")
    return raw


def _budget(path, raw) -> dict:
    _section(path, "budget", raw, BUDGET_KEYS, "{steps: N} and/or {wall_clock_s: S, reserve_s: R}")
    out = {"steps": _number(path, "budget.steps", raw.get("steps"), int),
           "wall_clock_s": _number(path, "budget.wall_clock_s", raw.get("wall_clock_s")),
           "reserve_s": _number(path, "budget.reserve_s", raw.get("reserve_s"), positive=False)}
    if out["reserve_s"] is not None and out["reserve_s"] < 0:
        raise _err(path, "budget.reserve_s", f"must be >= 0, got {out['reserve_s']!r}")
    if out["steps"] is None and out["wall_clock_s"] is None:
        raise _err(path, "budget", "give steps and/or wall_clock_s (a run without a budget trains for the recipe's "
                                   "total_training_steps, 2200 by default)")
    return out


def _eval(path, raw) -> dict:
    _section(path, "eval", raw, EVAL_KEYS, "with at least `suites: [math500]`")
    suites = raw.get("suites")
    if isinstance(suites, str):
        suites = [suites]
    if not suites or not isinstance(suites, list) or not all(isinstance(s, str) and s for s in suites):
        raise _err(path, "eval.suites", f"must be a non-empty list of suite names or protocol .yaml paths, got {suites!r}")
    from opd_patches.eval.suites import load_protocol

    for s in suites:
        try:
            load_protocol(s)
        except ValueError as exc:
            raise _err(path, "eval.suites", str(exc)) from exc
    if len({suite_folder(s) for s in suites}) != len(suites):
        raise _err(path, "eval.suites", f"two suites share a folder name: {suites}")
    ckpts = raw.get("checkpoints", "last")
    if not (ckpts in ("last", "every") or (isinstance(ckpts, list) and ckpts and
                                            all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in ckpts))):
        raise _err(path, "eval.checkpoints", f"must be `last`, `every` or a list of steps like [20, 40], got {ckpts!r}")
    backend = raw.get("backend", "auto")
    if backend not in ("auto", "hf", "vllm"):
        raise _err(path, "eval.backend", f"must be auto, hf or vllm, got {backend!r}")
    data_dir = raw.get("data_dir")
    if data_dir is not None:
        data_dir = str(Path(os.path.expandvars(str(data_dir))).expanduser())
    return {
        "suites": suites,
        "checkpoints": sorted(set(ckpts)) if isinstance(ckpts, list) else ckpts,
        "limit": _number(path, "eval.limit", raw.get("limit"), int),
        "samples": _number(path, "eval.samples", raw.get("samples"), int),
        "max_new_tokens": _number(path, "eval.max_new_tokens", raw.get("max_new_tokens"), int),
        "temperature": _number(path, "eval.temperature", raw.get("temperature"), positive=False),
        "top_p": _number(path, "eval.top_p", raw.get("top_p")),
        "seed": _number(path, "eval.seed", raw.get("seed"), int, positive=False),
        "backend": backend,
        "data_dir": data_dir,
        "args": _str_list(path, "eval.args", raw.get("args")),
        "teacher_kl": None if raw.get("teacher_kl") is None else model_path(raw["teacher_kl"]),
        "kl_samples": _number(path, "eval.kl_samples", raw.get("kl_samples"), int),
        "during_training": _flag(path, "eval.during_training", raw.get("during_training", False)),
    }


def _flag(path, key, value) -> bool:
    if not isinstance(value, bool):
        raise _err(path, key, f"must be true or false, got {value!r}")
    return value


def model_path(value) -> str:
    """A model folder from a spec: env vars and ~ expanded, relative to the repository root; a hub id
    (org/name that is no folder here) as is."""
    text = os.path.expanduser(os.path.expandvars(str(value)))
    local = Path(text) if os.path.isabs(text) else REPO / text
    return str(local) if local.exists() or text.startswith((".", "/")) or text.count("/") != 1 else text


def _references(path, raw) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(k, str) and NAME_RE.match(k) and isinstance(v, str)
                                            for k, v in raw.items()):
        raise _err(path, "references", f"must map folder-safe names to model folders, e.g. {{student: PATH}}, got {raw!r}")
    return {k: model_path(v) for k, v in raw.items()}


def _str_list(path, key, value) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
        raise _err(path, key, f"must be a list of command-line words, e.g. [--batch-size, '8'], got {value!r}")
    return [str(v) for v in value]


def suite_folder(suite: str) -> str:
    """The folder name of a suite's evaluations: the name, or a protocol file's stem."""
    return Path(suite).stem if suite.endswith((".yaml", ".yml")) else suite


def _env(path, raw) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _err(path, "env", f"must map run.sh variables to values, got {raw!r}")
    out = {}
    for k, v in raw.items():
        if k in ENV_REFUSED:
            raise _err(path, f"env.{k}", ENV_REFUSED[k])
        if not isinstance(v, (str, int, float, bool)):
            raise _err(path, f"env.{k}", f"must be a string or number, got {v!r}")
        v = str(int(v) if isinstance(v, bool) else v)
        out[str(k)] = os.path.expanduser(os.path.expandvars(v))
    return out


def _arms(path, raw, recipe: str) -> list[Arm]:
    if not isinstance(raw, dict) or not raw:
        raise _err(path, "arms", "must map arm names to override lists, e.g. {k1: [], topk: [recipe=topk]}")
    arms = []
    for name, overrides in raw.items():
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise _err(path, f"arms.{name}", "arm names are folder names: letters, digits, _ . + - (not starting with . - +)")
        arm_recipe, rest = split_recipe(path, f"arms.{name}", _override_list(path, f"arms.{name}", overrides), recipe)
        arms.append(Arm(name, arm_recipe, rest))
    return arms


def load(path: Path, compose=None) -> Spec:
    """Read and validate a spec file. `compose` (tests) replaces the arms module's config composer."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such study spec (a YAML file; example: recipes/studies/k1_vs_topk.yaml)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: a study spec is a YAML mapping (keys: {', '.join(TOP_KEYS)})")
    for k in raw:
        if k not in TOP_KEYS:
            raise _err(path, k, f"unknown key; known: {', '.join(TOP_KEYS)}")
    name = str(raw.get("name") or path.stem)
    if not NAME_RE.match(name):
        raise _err(path, "name", f"{name!r} must be folder-safe: letters, digits, _ . + -")
    recipe = check_recipe(path, "recipe", raw.get("recipe", "k1"))
    common_recipe, overrides = split_recipe(path, "overrides", _override_list(path, "overrides", raw.get("overrides")), recipe)
    if common_recipe != recipe:
        raise _err(path, "overrides", "set the base recipe with `recipe:`, not recipe= in the common overrides")
    seeds = raw.get("seeds")
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        seeds = [seeds]
    if (not isinstance(seeds, list) or not seeds
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
        raise _err(path, "seeds", f"must be a non-empty list of non-negative integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise _err(path, "seeds", f"repeats a seed: {seeds}")
    ablation = None
    if raw.get("ablate") is not None:
        if raw.get("arms") is not None:
            raise _err(path, "ablate", "give either `arms` or `ablate`, not both")
        ab = raw["ablate"]
        if not isinstance(ab, dict) or set(ab) != {"control", "treatment"}:
            raise _err(path, "ablate", f"must be {{control: RECIPE, treatment: RECIPE}}, got {ab!r}")
        from opd_patches.study import arms as arms_mod

        control_recipe = check_recipe(path, "ablate.control", ab["control"])
        treatment_recipe = check_recipe(path, "ablate.treatment", ab["treatment"])
        try:  # the study sets the seeds itself: they are no knob
            ablation = arms_mod.ablation(control_recipe, treatment_recipe, overrides, exclude=SEED_KEYS, compose=compose)
        except Exception as exc:  # Hydra composition errors, arms upstream refuses
            raise _err(path, "ablate", str(exc)) from exc
        arms = [Arm(a["name"], a["recipe"], a["overrides"], a["note"]) for a in ablation["arms"]]
        control = raw.get("control") or arms[0].name
    else:
        arms = _arms(path, raw.get("arms"), recipe)
        control = raw.get("control") or arms[0].name
    if control not in [a.name for a in arms]:
        raise _err(path, "control", f"{control!r} is not an arm; arms: {', '.join(a.name for a in arms)}")
    warnings = []
    for a in arms:
        for o in a.overrides:
            key = o.split("=", 1)[0].lstrip("+~")
            if key in SEED_KEYS:
                warnings.append(f"arm {a.name}: {o} is replaced by the study seed ({key}=<seed>)")
    refs = _references(path, raw.get("references"))
    clash = sorted(set(refs) & {a.name for a in arms})
    if clash:
        raise _err(path, "references", f"{clash} also name arms; give references other names")
    if "budget" not in raw:
        raise _err(path, "budget", "missing: give {steps: N} and/or {wall_clock_s: S}")
    if "eval" not in raw:
        raise _err(path, "eval", "missing: give at least {suites: [math500]}")
    return Spec(path=path, name=name, recipe=recipe, env=_env(path, raw.get("env")), overrides=overrides, arms=arms,
                control=control, seeds=list(seeds), budget=_budget(path, raw["budget"]), eval=_eval(path, raw["eval"]),
                references=refs, ablation=ablation, warnings=warnings,
                parallel=_number(path, "parallel", raw.get("parallel", 1), int))
