"""The project's own configuration: every `opd.*` key, typed, with its one default, validated once.

    opd = config.of(cfg)      # the driver (and whoever holds the composed DictConfig): typed, validated
    opd = config.current()    # a Ray worker: the driver's resolved copy (env OPD_CONFIG), parsed once

Defaults: `OpdConfig` below holds every default and the key's user-facing comment. recipes/base.yaml does
not restate them: its defaults list pulls in the ConfigStore node `opd_defaults` (registered when this
module is imported, from these dataclasses), so Hydra composes `opd:` from here and recipes, overlays and
the command line override keys as before (`opd.force=true`, no `+`). The node is a plain dict, not the
structured dataclass: Hydra's own type errors and struct errors would stop composition with messages
that name no fix, while `load` below refuses each bad key or value with one line. A composing process
must import this module first (opd_patches.main and opd_patches.study do; so do the tests' helpers).

Validation (`load`): an unknown key names the nearest known one; a removed or renamed key (`RENAMED`)
names its replacement; a wrong type or value names the key and the values it takes. main.py validates
before the run lock is taken (a typo costs no wait), resolves what depends on the rest of the config
(`background_export`, `entropy_detached`, `launched_at`, `run_dir`), and serializes the result once
into the environment variable OPD_CONFIG (JSON) of every Ray process. Outside a run (no OPD_CONFIG)
`current()` gives the defaults; tests change it in-process with `override(...)`.

Plain frozen dataclasses, not VERL's `BaseConfig` / `omega_conf_to_dataclass`: the driver validates
before it imports VERL (verl pulls in torch and Ray: seconds of CPU before a refusal), and the Ray
workers' readers sit in loss and patch modules that must not depend on the driver's config tree.
"""

import contextlib
import dataclasses
import difflib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

ENV = "OPD_CONFIG"  # the resolved config, JSON, in every Ray process of a run (set by opd_patches.main)
NODE = "opd_defaults"  # the ConfigStore node in recipes/base.yaml's defaults list

PLACEMENTS = ("standalone", "colocated")
PREFLIGHT_MODES = ("off", "cheap", "full")
LEAN_TOPK_KERNELS = ("auto", "triton", "torch")  # auto: triton where lean_topk_triton.available, else torch
ATTN_IMPLEMENTATIONS = ("auto", "flash_attention_2", "torch_varlen", "sdpa", "eager")
CPU_DTYPES = ("auto", "float32", "bfloat16")
SKIP_OLD_LOG_PROB = ("auto", True, False)
INJECT_INTO = ("loss", "teacher")

# Keys that existed and no longer do: old dotted name under `opd.` -> what to use instead.
RENAMED = {
    "overlap": "it was never shipped (docs/bench.md, decode beside training); drop the key",
    "debug.validate_in_child": "the last save's finish starts its validating child itself (docs/performance.md); drop the key",
}


# Environment variables that carried single keys to the workers before OPD_CONFIG: a run refuses them, as
# a shell that still exports one would otherwise be ignored without a word.
REMOVED_ENV = {
    "OPD_LEAN_TOPK": "opd.lean_topk", "OPD_LEAN_TOPK_KERNEL": "opd.lean_topk_kernel",
    "OPD_FAST_LOGPROBS": "opd.fast_logprobs", "OPD_ENTROPY_DETACHED": "opd.skip_old_log_prob",
    "OPD_ASYNC_STATE_WRITE": "opd.background_state_write", "OPD_PROFILE_UPDATE": "opd.debug.profile_update",
}


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and what to do."""


# ---- field kinds: the type, the allowed values and the phrase that says them -----------------------


def _flag(default):
    return field(default=default, metadata={"use": "true or false", "ok": lambda v: isinstance(v, bool)})


def _choice(default, choices):
    return field(default=default, metadata={
        "use": "one of " + ", ".join(str(c).lower() if isinstance(c, bool) else c for c in choices),
        "ok": lambda v: any(type(v) is type(c) and v == c for c in choices)})


def _number(default, *, low, strict=False, integer=False, optional=False, what="seconds"):
    kind = "an integer" if integer else "a number"
    bound = f"{'>' if strict else '>='} {low}"
    use = f"{kind} {bound}" + (f" ({what})" if what else "") + (", or null" if optional else "")

    def ok(v):
        if v is None:
            return optional
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
            return False
        return v > low if strict else v >= low

    return field(default=default, metadata={"use": use, "ok": ok, "float": not integer})


def _steps(default):
    def ok(v):
        return v is None or (isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool)
                                                                   and x >= 1 for x in v))

    return field(default=default, metadata={"use": "a list of step numbers (>= 1), or null", "ok": ok, "tuple": True})


def _set_by_main(default):
    """Written by opd_patches.main at launch (a value given in a recipe is replaced)."""
    return field(default=default, metadata={"use": "set by opd_patches.main", "ok": lambda v: True, "by_main": True})


@dataclass(frozen=True)
class DebugConfig:
    """`opd.debug.*`: switches for tests and the bench, never for a training run."""

    # TEST ONLY: at this step overwrite the teacher log-probs with NaN; the non-finite guard must stop
    # the run (inject_nan_into=loss: caught in the loss/grad norm; teacher: caught in the teacher output).
    inject_nan_step: Optional[int] = _number(None, low=1, integer=True, optional=True, what="a training step")
    inject_nan_into: str = _choice("loss", INJECT_INTO)
    # BENCH ONLY: save after these steps only (a list; null: upstream's save_freq decides). make bench
    # PHASE=step sets save_freq=1 and [1]: one save whose stall shows in the next step, one state on disk.
    save_steps: Optional[tuple] = _steps(None)
    # BENCH ONLY: torch.profiler over the N-th actor update of the launch (opd_patches/hooks/profile_update.py);
    # tables in the run folder (profile_update_rank<r>.txt). null: off.
    profile_update: Optional[int] = _number(None, low=1, integer=True, optional=True,
                                            what="the update's number, 1 = the first")
    # TEST ONLY: opd.wall_clock_s counts from this process's first step, not from the launch (tests/test_ops_e2e.py).
    wall_clock_from_first_step: bool = _flag(False)
    # TEST ONLY: a background finish waits this many seconds before hashing and writing the receipt, so that
    # a test can kill the run inside that window (tests/test_ops_e2e.py; a tiny export's finish is too quick).
    finish_hold_s: Optional[float] = _number(None, low=0, optional=True)


@dataclass(frozen=True)
class OpdConfig:
    """`opd.*`: the project's keys (recipes/base.yaml composes them from here; docs/training.md)."""

    # Where the teacher runs. standalone: upstream's teacher servers on their own GPU pool
    # (distillation.n_gpus_per_node x nnodes). colocated: a forward-only teacher inside the actor's
    # worker group, on the actor's GPUs (opd_patches/teacher; trainer.v1.trainer_mode=colocated_teacher).
    teacher_placement: str = _choice("colocated", PLACEMENTS)
    # GPUs of the standalone teacher pool on each node.
    teacher_gpus: int = _number(1, low=1, integer=True, what="GPUs")
    # colocated only: park the teacher in host memory between steps (on the GPU only while it scores).
    teacher_offload: bool = _flag(True)
    # colocated only: rescan the teacher canary (a fixed sequence scored at start-up) every N scoring
    # calls and stop on drift or a near-uniform teacher (opd_patches/teacher/canary.py); 0: never.
    teacher_canary_every: int = _number(1, low=0, integer=True, what="scoring calls; 0: never")
    # Student/teacher pre-flight before Ray starts (opd_patches/checks/preflight.py), report in <run>/preflight.json.
    # cheap: vocabulary + chat template on a few training prompts (no weights loaded); full: also the
    # step-0 statistics (loads both models in the driver: slow for 1.5B models on the CPU); off.
    preflight: str = _choice("cheap", PREFLIGHT_MODES)
    # true: start even while another run holds the one-run lock (${OPD_LOCK_DIR:-~/.cache/opd}/run.lock)
    # or another process holds memory on the assigned GPUs (opd_patches/ops/lock.py), or the run folder's disk
    # or the host's memory looks too small for the run (opd_patches/checks/resources.py). run.sh: FORCE=1.
    force: bool = _flag(False)
    # Top-k losses (forward_kl_topk, forward_kl_topk_tail) through the memory-lean exact kernel
    # (opd_patches/losses/lean_topk.py): upstream's values and gradients without its (T, V) fp32
    # log-softmax and gradient. On: in the update it holds well under half of upstream's peak memory, in
    # less time with the Triton kernels and in about the same with the torch path alone (docs/performance.md).
    lean_topk: bool = _flag(True)
    # Its O(T*V) part: auto (fused Triton kernels where they can run, i.e. CUDA; else the chunked torch
    # path) | triton | torch.
    lean_topk_kernel: str = _choice("auto", LEAN_TOPK_KERNELS)
    # Sampled-token log-probs (every actor update and old_log_prob) through the exact chunked kernel
    # (opd_patches/losses/sampled_logprob.py) where upstream would fall back to its per-row loop (no
    # flash-attn installed; that loop is far slower, docs/performance.md). Same values (fp32 maths, as
    # under CUDA autocast). Not used when flash-attn is installed.
    fast_logprobs: bool = _flag(True)
    # The student's old-log-prob pass before each update (opd_patches/teacher/old_log_prob.py; the teacher
    # still scores). auto: skipped where provably the same run: pure forward KL (no policy gradient, no task
    # rewards: no loss reads old log-probs) and one update per batch (ppo_epochs 1, one mini-batch: old =
    # the update forward's own log-probs, detached); actor/entropy then comes from the update's forward.
    # true: the same, refused where it would change the run; false: always run it. Colocated teacher only.
    skip_old_log_prob: Any = _choice("auto", SKIP_OLD_LOG_PROB)
    # Attention of every training-engine forward (the student's update and log-prob passes, the colocated
    # teacher): auto = flash_attention_2 where flash-attn is installed, else torch_varlen on CUDA (PyTorch's
    # built-in varlen kernel on VERL's packed rows, opd_patches/attention/torch_varlen.py; masked sdpa over
    # the packed row is far slower, docs/performance.md), else sdpa (CPU) | flash_attention_2 |
    # torch_varlen | sdpa | eager.
    # Sets actor_rollout_ref.model.override_config.attn_implementation (opd_patches/main.py). vLLM: unaffected.
    attn_implementation: str = _choice("auto", ATTN_IMPLEMENTATIONS)
    # CPU device only: compute dtype of the FSDP training engines (the student's update and log-prob passes,
    # the reference). auto: float32 where bf16 is not native here (no AVX512_BF16/AMX/Arm BF16, or oneDNN
    # kept off them, e.g. by ONEDNN_MAX_CPU_ISA), as torch's bf16 matmuls then take a fallback many times
    # slower than fp32; else bfloat16 (upstream's mixed precision, the faster one there) | float32 | bfloat16.
    # Sets actor_rollout_ref.{actor,ref}.fsdp_config.mixed_precision.param_dtype (opd_patches/main.py);
    # the colocated teacher and the hf rollout compute in float32 on the CPU whatever this says.
    cpu_dtype: str = _choice("auto", CPU_DTYPES)
    # Seconds between the trainer's looks at TransferQueue while the rollout fills it; upstream's sync replay
    # buffer sleeps a fixed period instead, rounding each generation up to whole periods.
    replay_poll_s: float = _number(0.05, low=0, strict=True)
    # Seconds of waiting for a step's samples between checks that the rollout servers, agent-loop and
    # reward workers are alive (opd_patches/ops/liveness.py): a dead one stops the run, naming it, instead of
    # a wait without end (Ray's memory monitor kills workers when the host runs out of memory).
    liveness_check_s: float = _number(30.0, low=0, strict=True)
    # ---- training operations (opd_patches/ops; docs/training.md "Wall clock, checkpoints, resume") ----
    # Wall clock in seconds from launch (null: none). The trainer stops at a step boundary when the next
    # step and its save (measured, times wall_clock_margin) no longer fit before wall_clock_s - reserve_s,
    # saves that step (state + HF export + validation + receipt) and exits 0. run.sh: WALL_CLOCK=, RESERVE=.
    wall_clock_s: Optional[float] = _number(None, low=0, strict=True, optional=True)
    reserve_s: float = _number(1200.0, low=0)
    wall_clock_margin: float = _number(1.5, low=1, what="times the measured step and save")
    # After each save, validate the HF export in a CPU subprocess and record the result in the receipt
    # (global_step_N/receipt.json). Kept states: the newest trainer.max_actor_ckpt_to_keep *validated*
    # ones plus the newest complete one (pruned by opd_patches, across restarts; upstream's own pruning
    # is switched off). false: nothing is validated, so only the newest complete state is kept.
    validate_after_save: bool = _flag(True)
    validate_timeout_s: float = _number(1800.0, low=0, strict=True)
    # Save in two parts: the trainer waits only for upstream's state + HF export write, and the export
    # validation, sha256 of every file and receipt run in a subprocess beside the next steps
    # (opd_patches/ops/finish.py); the state is complete only once that receipt exists. That moves
    # validation and sha256, most of a save's time, off the training (docs/performance.md). The last save
    # (final step, wall clock) is always waited for. false: every save blocks until its receipt is written.
    background_save: bool = _flag(True)
    # Upstream's state write (model/optimizer/extra torch.save per rank) from a thread of each worker: the
    # save copies the state to host memory and returns; the finish above waits for the files before hashing
    # them (opd_patches/ops/state_writer.py). The copy takes a fraction of the write's time (more at the
    # first save, which pins the host memory; docs/performance.md). Costs one state's size of page-locked
    # host memory per GPU process. false: upstream writes before the trainer goes on.
    background_state_write: bool = _flag(True)
    # The HF export's weights written by the finish above from the saved state files (a CPU subprocess;
    # opd_patches/ops/state_export.py: the same files as upstream's export) instead of inside upstream's
    # save, where gathering and writing them is waited for (docs/bench/history.md). opd_patches.main then
    # drops hf_model from actor.checkpoint.save_contents. FSDP2 causal LMs only (otherwise upstream
    # exports, said at launch, and main resolves this to false). false: upstream's save writes the export
    # while the trainer waits.
    background_export: bool = _flag(True)
    debug: DebugConfig = field(default_factory=DebugConfig)
    # Set by opd_patches.main: epoch seconds of the launch, the wall clock's origin.
    launched_at: Optional[float] = _set_by_main(None)
    # Set by opd_patches.main: the run folder (trainer.default_local_dir), where worker-side reports go.
    run_dir: Optional[str] = _set_by_main(None)
    # Set by opd_patches.main: the update computes the entropy only as a metric (a skipped old-log-prob
    # pass at entropy_coeff 0), so every worker runs it detached (opd_patches/patches/entropy_from_logits.py).
    entropy_detached: bool = _set_by_main(False)


# ---- validation ------------------------------------------------------------------------------------


def _section(f) -> bool:
    return isinstance(f.type, type) and dataclasses.is_dataclass(f.type)


def _known(cls, prefix="") -> list[str]:
    out = []
    for f in fields(cls):
        out.append(prefix + f.name)
        if _section(f):
            out += _known(f.type, prefix + f.name + ".")
    return out


KNOWN = _known(OpdConfig)


def _unknown(path: str) -> ConfigError:
    if path in RENAMED:
        return ConfigError(f"opd.{path} no longer exists: {RENAMED[path]}.")
    near = difflib.get_close_matches(path, KNOWN, n=1, cutoff=0.5)
    hint = f"did you mean opd.{near[0]}?" if near else "see opd_patches/config.py for the keys"
    return ConfigError(f"opd.{path} is not a key: {hint}")


def _show(value) -> str:
    """A value as a recipe spells it (null, true, 'text')."""
    try:
        return json.dumps(value) if value is None or isinstance(value, (bool, int, float, list)) else repr(value)
    except TypeError:
        return repr(value)


def _build(cls, values: dict, prefix: str):
    by_name = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in values.items():
        path = prefix + str(key)
        if key not in by_name:
            raise _unknown(path)
        f = by_name[key]
        if _section(f):
            if value is None:
                value = {}
            if not isinstance(value, dict):
                keys = ", ".join(n.name for n in fields(f.type))
                raise ConfigError(f"opd.{path}={_show(value)}: a section of keys ({keys}).")
            kwargs[key] = _build(f.type, value, path + ".")
            continue
        meta = f.metadata
        if not meta["ok"](value):
            raise ConfigError(f"opd.{path}={_show(value)}: use {meta['use']}.")
        if meta.get("float") and value is not None:
            value = float(value)
        if meta.get("tuple") and value is not None:
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)


def load(values=None) -> OpdConfig:
    """The typed config for an `opd:` section (DictConfig, dict or None); keys not given keep their default.
    Raises ConfigError (one line: the key and what to do) for an unknown, removed or mistyped key."""
    if values is None:
        values = {}
    elif not isinstance(values, dict):
        from omegaconf import DictConfig, OmegaConf

        if not isinstance(values, DictConfig):
            raise ConfigError(f"opd={values!r}: a section of keys (start from a recipe in recipes/).")
        values = OmegaConf.to_container(values, resolve=True)
    return _build(OpdConfig, values, "")


def of(config) -> OpdConfig:
    """The typed `opd` section of a composed config (the driver, the trainer)."""
    return load(config.get("opd"))


def check_overrides(argv) -> None:
    """Command-line overrides of `opd.*` keys that Hydra would refuse with its own message (a key that
    does not exist), refused here with the nearest known key or the replacement of a renamed one."""
    for arg in argv:
        name = arg.split("=", 1)[0].lstrip("+~") if "=" in arg else ""
        if name.startswith("opd.") and name[4:] not in KNOWN:
            raise _unknown(name[4:])


def check_environment(environ=None) -> None:
    """Refuse a removed per-key variable (REMOVED_ENV) in the launching environment, naming its key."""
    environ = os.environ if environ is None else environ
    for var, key in REMOVED_ENV.items():
        if environ.get(var):
            raise ConfigError(f"{var} is no longer read: set the recipe key {key} instead (unset {var}).")


# ---- the resolved config in every process ---------------------------------------------------------


def dumps(opd: OpdConfig) -> str:
    """The value of OPD_CONFIG for this config (JSON)."""
    return json.dumps(asdict(opd), sort_keys=True)


def loads(text: str) -> OpdConfig:
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{ENV} is not JSON ({exc}): opd_patches.main sets it; unset it outside a run.") from None
    return load(values)


def env(opd: OpdConfig | None = None, **changes) -> dict:
    """{OPD_CONFIG: ...} for a process to start with `opd` (default: the defaults) and `changes`."""
    return {ENV: dumps(_changed(opd or OpdConfig(), changes))}


_CURRENT: OpdConfig | None = None


def current() -> OpdConfig:
    """This process's config: OPD_CONFIG as the driver resolved it (parsed once), else the defaults."""
    global _CURRENT
    if _CURRENT is None:
        text = os.environ.get(ENV)
        _CURRENT = loads(text) if text else OpdConfig()
    return _CURRENT


def _changed(opd: OpdConfig, changes: dict) -> OpdConfig:
    values = asdict(opd)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = {**values[key], **value}
        else:
            values[key] = value
    return load(values)


@contextlib.contextmanager
def override(**changes):
    """Tests: `current()` with these keys changed (a section as a dict: debug={"profile_update": 2}) inside
    the block, validated as a recipe's would be; the previous value comes back after it."""
    global _CURRENT
    saved = _CURRENT
    _CURRENT = _changed(current(), changes)
    try:
        yield _CURRENT
    finally:
        _CURRENT = saved


def hydra_node() -> dict:
    """The defaults as the plain dict that recipes/base.yaml composes (`opd:` section)."""
    values = asdict(OpdConfig())
    return {"opd": json.loads(json.dumps(values))}  # tuples as lists, as YAML has them


def _register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=NODE, node=hydra_node())


_register()
