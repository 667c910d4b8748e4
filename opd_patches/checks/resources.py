"""Disk and host memory a run will hold, checked before Ray starts: `check_resources(config)`.

Disk, on the filesystem of the run folder (`trainer.default_local_dir`; run.sh: OUTPUT_DIR):
    need = max(one state, states x state size - what the complete states already there hold)
    states = kept + 1 in flight, or the run's saves where fewer (total_training_steps / save_freq, rounded up)
- a state (`global_step_N/`, opd_patches/ops/checkpoints.py) holds per `actor.checkpoint.save_contents`:
  `model` (the parameters in `fsdp_config.model_dtype`), `optimizer` (AdamW's two moments in the same dtype)
  and `hf_model` (the HF export: state_export.py and upstream both write the weights in the state's dtype);
  `extra`, configs and tokenizer files are small and not counted;
- kept: the newest `trainer.max_actor_ckpt_to_keep` validated states (the newest complete one among them);
  with `opd.validate_after_save: false` only the newest complete one. A save's finish prunes only once the
  next state is complete, so one more is on disk meanwhile. A state whose validation failed is kept beside
  them while it is the newest complete one: not counted. `max_actor_ckpt_to_keep: null` keeps every save;
- a resume: the complete states that pruning keeps are already on disk and lower the need, never below one
  state (the save in flight is written before anything is pruned).

Host memory (this host's GPU processes, i.e. `trainer.n_gpus_per_node` of them), against `available_memory`:
- `opd.background_state_write` (FSDP2): each process keeps a snapshot of its shard of the model and optimizer
  state (state_writer.py). On CUDA it is page-locked through torch's caching host allocator, which rounds
  every block up to a power of two: counted per tensor shard (`shard_bytes`);
- `opd.teacher_offload` (colocated teacher): each process parks the whole teacher in one host buffer
  (teacher/worker.py; page-locked, so rounded likewise, on CUDA; float32 on the CPU platform);
- `fsdp_config.param_offload` / `optimizer_offload`: the actor's parameters / optimizer moments in host memory.
What else the run's processes hold (Ray, the rollout engine, data) is not counted: passing is necessary,
not sufficient. Other hosts of a multi-node run are not seen from here.

Parameter counts come from each model's config.json on the meta device (opd_patches.ops.validate: exact, no
weights read). A model given as a hub id whose config.json is not in the local cache is not checked (one
line says so). A refusal is an InputError (exit 2) naming the need, the free figure, the folder or memory
source, and the keys that lower it; `opd.force=true` (run.sh: FORCE=1, which also passes the run lock)
prints it and starts anyway. Passing prints one line with the figures.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from opd_patches import config as opd_config
from opd_patches.checks import InputError

DTYPE_BYTES = {"fp32": 4, "float32": 4, "float": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2}
ADAMW_MOMENTS = 2  # exp_avg and exp_avg_sq, each in the parameters' dtype
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


def human(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def dtype_bytes(name) -> int:
    """Bytes of one element of a config's dtype name (VERL's `fp32`/`bf16` or torch's); 4 when unknown."""
    return DTYPE_BYTES.get(str(name).removeprefix("torch.").lower(), 4)


def config_folder(path) -> Path | None:
    """The folder holding model `path`'s config.json: the local folder, or a hub id's cached snapshot;
    None for a hub id whose config.json is not cached."""
    from opd_patches.checks.models import looks_like_hub_id

    text = str(path)
    if not looks_like_hub_id(text):
        folder = Path(os.path.expanduser(text))
        return folder if (folder / "config.json").is_file() else None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(text, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def parameter_count(folder: Path) -> int:
    """Parameters of the model whose config.json is in `folder` (meta device: no weights read)."""
    from transformers import AutoConfig

    from opd_patches.ops.validate import expected_parameter_count

    return expected_parameter_count(AutoConfig.from_pretrained(folder))


def parameter_shapes(folder: Path) -> list[tuple[int, ...]]:
    """The shape of every parameter (tied ones once) of `folder`'s model, built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return [tuple(p.shape) for p in model.parameters()]


def pinned_block(nbytes: int) -> int:
    """Host bytes a page-locked allocation of `nbytes` takes: torch's caching host allocator rounds up to a power
    of two."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def shard_bytes(shapes, world: int, ranks, element_bytes: int, pinned: bool) -> int:
    """Host bytes of `ranks`' local shards of tensors `shapes` under FSDP2 (each tensor split along dim 0 as
    torch.chunk splits it over `world` ranks), each shard one allocation (rounded when `pinned`)."""
    total = 0
    for shape in shapes:
        rows = shape[0] if shape else 1
        rest = math.prod(shape[1:]) if shape else 1
        chunk = -(-rows // world)
        for r in ranks:
            nbytes = max(0, min(chunk, rows - r * chunk)) * rest * element_bytes
            total += pinned_block(nbytes) if pinned else nbytes
    return total


def state_parts(params: int, element_bytes: int, contents) -> dict[str, int]:
    """Bytes of one saved state by part: trainer state (model + optimizer) and HF export, per save_contents."""
    contents = set(contents)
    state = params * element_bytes * (("model" in contents) + ADAMW_MOMENTS * ("optimizer" in contents))
    return {"trainer state": state, "HF export": params * element_bytes * ("hf_model" in contents)}


def free_disk(path: Path) -> tuple[int, Path]:
    """Bytes an unprivileged writer may still use on `path`'s filesystem, and the folder asked (the nearest
    existing one: the run folder may not exist yet)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free, probe


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def available_memory() -> tuple[int, str]:
    """Host memory new allocations get without swapping, and where the figure comes from.

    MemAvailable (/proc/meminfo), not MemTotal minus a margin: it leaves out what other processes hold and
    counts reclaimable page cache (which the state writes fill) as available, and page-locked memory must be
    real memory. Inside a memory cgroup (a container) /proc/meminfo describes the whole machine, so the
    cgroup's limit minus its usage (less its inactive file cache, as Ray's memory monitor counts it) is used
    when smaller."""
    avail = None
    for line in MEMINFO.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            avail = int(line.split()[1]) * 1024
    source = "MemAvailable"
    v1 = CGROUP / "memory"
    for limit, usage, stat, inactive in (
            (CGROUP / "memory.max", CGROUP / "memory.current", CGROUP / "memory.stat", "inactive_file"),
            (v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes", v1 / "memory.stat", "total_inactive_file")):
        cap, used = _read_int(limit), _read_int(usage)
        if cap is None or used is None or (avail is not None and cap >= avail + used):
            continue  # no limit ("max"), or one above what the machine has
        left = max(0, cap - max(0, used - _stat(stat, inactive)))
        if avail is None or left < avail:
            avail, source = left, "the memory cgroup's limit less its usage"
        break
    return int(avail or 0), source


def _select(config, key, default=None):
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, key, default=default)
    return default if value is None else value


def states_at_peak(config) -> tuple[int, str]:
    """How many states the run folder holds at most (the in-flight one included), and why."""
    keep = _select(config, "trainer.max_actor_ckpt_to_keep")
    steps, freq = _select(config, "trainer.total_training_steps"), int(_select(config, "trainer.save_freq", -1))
    # upstream saves every save_freq steps and at the last one; a wall-clock stop at step s makes s // freq + 1
    saves = (-(-int(steps) // freq) if freq > 0 else 1) if steps else None
    why = f"trainer.total_training_steps={steps}, trainer.save_freq={freq}"
    only = opd_config.of(config).debug.save_steps
    if only is not None:  # the bench's saves: these steps only
        saves, why = len(only), f"opd.debug.save_steps={list(only)}"
    if keep is None or int(keep) <= 0:  # no pruning: every save stays
        return (saves or 1), f"every save kept (trainer.max_actor_ckpt_to_keep={keep}; {why})"
    kept = int(keep) if opd_config.of(config).validate_after_save else 1
    if saves is not None and saves < kept + 1:
        return saves, f"the run's {saves} save{'s' * (saves != 1)} ({why})"
    return kept + 1, f"{kept} kept + 1 in flight"


def _disk(config, run_dir: Path, params: int, free: tuple[int, Path]) -> tuple[str, str | None]:
    """(the figures, the refusal or None) for the run folder's filesystem."""
    from opd_patches.ops import checkpoints, receipts

    contents = list(_select(config, "actor_rollout_ref.actor.checkpoint.save_contents", []))
    element = dtype_bytes(_select(config, "actor_rollout_ref.actor.fsdp_config.model_dtype", "fp32"))
    parts = state_parts(params, element, contents)
    per_state = sum(parts.values())
    states, why = states_at_peak(config)
    keep = _select(config, "trainer.max_actor_ckpt_to_keep")
    found = checkpoints.list_states(run_dir)
    pruned = {s["step"] for s in checkpoints.plan_prune(found, int(keep))} if keep and int(keep) > 0 else set()
    survivors = [s for s in found if s["complete"] and s["step"] not in pruned]  # what a resume keeps
    there = sum(f["bytes"] for s in survivors for f in receipts.read(s["path"], s["step"])["files"].values())
    need = max(per_state, states * per_state - there)
    detail = (f"{states} state{'s' * (states != 1)}: {why}; {human(per_state)} each = "
              + " + ".join(f"{k} {human(v)}" for k, v in parts.items() if v) + f" for {params:,} parameters")
    if there:
        detail += f"; less {human(there)} already in {len(survivors)} complete state{'s' * (len(survivors) != 1)}"
    line = f"disk {human(free[0])} free at {free[1]}, needs {human(need)} ({detail})"
    if need <= free[0]:
        return line, None
    return line, (f"trainer.default_local_dir={run_dir}: its filesystem has {human(free[0])} free (at {free[1]}), "
                  f"the run needs {human(need)} ({detail}). Lower trainer.max_actor_ckpt_to_keep (each kept state is "
                  f"{human(per_state)}), free space there, or write the run to another filesystem (run.sh: "
                  "OUTPUT_DIR=...; else trainer.default_local_dir=...).")


def _memory(config, student: Path, params: int, teacher: tuple[int, str] | None,
            avail: tuple[int, str]) -> tuple[str, str | None]:
    """(the figures, the refusal or None) for this host's memory; teacher: (parameters, dtype) when parked."""
    fsdp = "actor_rollout_ref.actor.fsdp_config"
    element = dtype_bytes(_select(config, f"{fsdp}.model_dtype", "fp32"))
    gpus, nodes = int(_select(config, "trainer.n_gpus_per_node", 1)), int(_select(config, "trainer.nnodes", 1))
    pinned = str(_select(config, "trainer.device", "cuda")) == "cuda"
    parts = []  # (what, bytes, the setting that removes it)
    fsdp2 = _select(config, "actor_rollout_ref.actor.strategy") == "fsdp2"  # FSDP1's files are written in place
    if opd_config.of(config).background_state_write and fsdp2:
        shards = shard_bytes(parameter_shapes(student), gpus * nodes, range(gpus), element, pinned)
        parts.append(("state snapshot", (1 + ADAMW_MOMENTS) * shards,  # parameters + moments, one block per shard
                      "opd.background_state_write=false (saves then wait for the disk)"))
    if teacher is not None:
        teacher_params, dtype = teacher
        nbytes = teacher_params * (dtype_bytes(dtype) if pinned else 4)  # the CPU platform's teacher: float32
        parts.append(("parked teacher", gpus * (pinned_block(nbytes) if pinned else nbytes),
                      "opd.teacher_offload=false (the teacher then stays in GPU memory)"))
    share = params * element // nodes
    if _select(config, f"{fsdp}.param_offload", False):
        parts.append(("actor parameters offloaded", share, f"{fsdp}.param_offload=false"))
    if _select(config, f"{fsdp}.optimizer_offload", False):
        parts.append(("actor optimizer offloaded", ADAMW_MOMENTS * share, f"{fsdp}.optimizer_offload=false"))
    need = sum(b for _, b, _ in parts)
    detail = ", ".join(f"{what} {human(b)}" for what, b, _ in parts) or "nothing pinned or parked"
    line = f"host memory {human(avail[0])} available ({avail[1]}), needs {human(need)} ({detail})"
    if need <= avail[0]:
        return line, None
    keys = " and/or ".join(key for _, b, key in parts if b)
    return line, (f"host memory: {gpus} GPU process{'es' * (gpus != 1)} on this host would hold {human(need)} "
                  f"({detail}), {human(avail[0])} is available ({avail[1]}). To lower it, set {keys}.")


def check_resources(config, free=free_disk, memory=available_memory, log=print) -> str | None:
    """Refuse (InputError) a run whose states do not fit its folder's filesystem or whose pinned and parked
    copies do not fit this host's memory (module docstring); returns the line printed when it passes (None
    when not checked). `free(path)` and `memory()` read the machine (parameters for tests)."""
    student_key = "actor_rollout_ref.model.path"
    paths = {student_key: _select(config, student_key)}
    teachers = _select(config, "distillation.teacher_models", {}) or {}
    parked = (opd_config.of(config).teacher_placement == "colocated"
              and opd_config.of(config).teacher_offload and len(teachers) == 1)
    if parked:
        teacher_key = f"distillation.teacher_models.{next(iter(teachers))}"
        paths[f"{teacher_key}.model_path"] = _select(config, f"{teacher_key}.model_path")
    folders = {key: config_folder(path) for key, path in paths.items()}
    missing = [f"{key}={paths[key]}" for key, folder in folders.items() if folder is None]
    if missing:
        log(f"[opd] resources: not checked: no local config.json for {', '.join(missing)} (a hub id not in the "
            "local cache)", flush=True)
        return None
    counts = {}
    for key, folder in folders.items():
        try:
            counts[key] = parameter_count(folder)
        except Exception as exc:  # noqa: BLE001 - an architecture transformers cannot build here: the run says why
            log(f"[opd] resources: not checked: {key}={paths[key]}: no model built from its config.json "
                f"({type(exc).__name__}: {exc})", flush=True)
            return None
    params = counts[student_key]
    teacher = None
    if parked:  # its dtype: upstream's teacher inference dtype (the rollout's unless set)
        teacher = (counts[f"{teacher_key}.model_path"], _select(config, f"{teacher_key}.inference.dtype", "bfloat16"))
    run_dir = Path(os.path.expanduser(str(_select(config, "trainer.default_local_dir")))).resolve()
    disk_line, disk_refusal = _disk(config, run_dir, params, free(run_dir))
    memory_line, memory_refusal = _memory(config, folders[student_key], params, teacher, memory())
    refusals = [r for r in (disk_refusal, memory_refusal) if r]
    if refusals:
        message = " Also, ".join(refusals)
        if not opd_config.of(config).force:
            raise InputError(f"{message} opd.force=true (run.sh: FORCE=1) starts anyway.")
        log(f"[opd] resources: opd.force=true, starting anyway: {message}", flush=True)
    line = f"[opd] resources: {disk_line}; {memory_line}"
    log(line, flush=True)
    return line
