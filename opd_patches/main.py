"""Training entry point: a recipe's config -> checks, run manifest -> upstream VERL's `run_ppo`.

    python -m opd_patches.main --config-path recipes --config-name k1 [overrides...]

(run.sh is the usual way in.) Between Hydra and VERL's own V1 trainer it only: takes the one-run
lock and checks that no other process holds the assigned GPUs (opd_patches/ops/lock.py; exit 75 when
refused, `opd.force=true` skips both), checks the disk and host memory the run will hold
(opd_patches/checks/resources.py), validates the project's `opd.*` keys (opd_patches/config.py) and
resolves them (teacher placement, attention, CPU compute dtype), checks model and data paths, loss
settings and student/teacher vocabularies, writes `manifest.json` into the run folder, routes metrics to
`metrics.jsonl` there, and makes every Ray process import opd_patches and get the resolved `opd` section. Training itself is upstream's `TaskRunnerV1` (with the colocated teacher:
the registered trainer mode `colocated_teacher`, a subclass of upstream's sync trainer).
"""

import json
import os
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

import opd_patches
from opd_patches import config as opd_config  # also registers recipes/base.yaml's `opd_defaults` node
from opd_patches.ops import manifest
from opd_patches.config import ConfigError
from opd_patches.checks import InputError

COLOCATED_MODE = "colocated_teacher"  # trainer mode of opd_patches/trainers/colocated_teacher.py
OPS_SYNC_MODE = "opd_sync"  # upstream's sync trainer + training operations (opd_patches/trainers/opd_sync.py)
LAUNCHED_AT = time.time()  # the wall clock (opd.wall_clock_s) counts from here
COLOCATED_AGENT_LOOP = "opd_patches.teacher.agent_loop.ColocatedTeacherAgentLoopManager"
VERL_CONFIG_PKG = "pkg://verl.trainer.config"  # run.sh's search path: VERL's ppo_trainer and its groups


def _files(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def check_inputs(config: DictConfig) -> None:
    """Models and data refused before Ray starts (opd_patches/checks): each model a folder (or cached hub id)
    with config, weights and a tokenizer with a chat template; each train/val parquet in VERL's RL schema,
    every row checked, and the prompts VERL's length filter would drop counted with the student's tokenizer."""
    from opd_patches.checks import compat
    from opd_patches.checks.data import check_rl_parquet
    from opd_patches.checks.models import check_model

    models = [("actor_rollout_ref.model.path", config.actor_rollout_ref.model.path)]
    for key, teacher in config.distillation.teacher_models.items():
        models.append((f"distillation.teacher_models.{key}.model_path", teacher.model_path))
    for key, value in models:
        if value is None or value == "???":
            raise ConfigError(f"{key} is not set: pass it on the command line ({key}=...) or through run.sh.")
        check_model(value, key)
    data = config.data
    limit = data.get("max_prompt_length") if data.get("filter_overlong_prompts", True) else None
    tokenizer = compat.load_tokenizer(str(config.actor_rollout_ref.model.path))
    kwargs = data.get("apply_chat_template_kwargs") or {}
    kwargs = OmegaConf.to_container(kwargs, resolve=True) if isinstance(kwargs, DictConfig) else dict(kwargs)
    seen = set()
    for key in ("train_files", "val_files"):
        files = _files(data.get(key))
        if not files:
            raise ConfigError(f"data.{key} is not set: pass it on the command line (data.{key}=...) or through run.sh.")
        for f in files:
            path = os.path.expanduser(str(f))
            if path in seen:
                continue
            seen.add(path)
            started = time.time()
            report = check_rl_parquet(path, f"data.{key}", tokenizer, limit, kwargs)
            checked = "" if report["checked"] == report["rows"] else f" (first {report['checked']:,d} checked)"
            dropped = ""
            if report["too_long"]:
                dropped = (f"; {report['too_long']:,d} prompts are longer than data.max_prompt_length={limit} tokens "
                           "after the chat template: VERL drops them")
            print(f"[opd] data.{key}: {path}: {report['rows']:,d} rows{checked} in VERL's schema{dropped} "
                  f"({time.time() - started:.1f} s)", flush=True)


def _root_cause(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def check_distillation(config: DictConfig, run_dir: Path | None = None) -> None:
    """Loss settings and model compatibility (the pre-flight, below), checked before any worker starts."""
    from verl.utils.config import omega_conf_to_dataclass

    try:
        # Upstream's own validation (unknown loss_mode lists the registered ones; k1 needs PG; ...).
        loss = omega_conf_to_dataclass(config.distillation).distillation_loss
    except Exception as exc:  # Hydra wraps the dataclass errors; report the original
        raise ConfigError(f"distillation.distillation_loss: {_root_cause(exc)}") from exc
    compared = run_preflight(config, run_dir)
    if loss.loss_settings.use_topk:
        vocab = compared.get("vocab_size")
        if loss.topk is None or loss.topk <= 0 or (vocab and loss.topk > vocab):
            raise ConfigError(
                f"distillation.distillation_loss.topk={loss.topk}: a top-k loss needs 1 <= topk <= vocabulary size"
                f" ({vocab if vocab else 'unknown'})."
            )


def _first_train_file(config: DictConfig):
    files = config.data.get("train_files")
    files = [files] if isinstance(files, str) else list(files or [])
    return os.path.expanduser(str(files[0])) if files and str(files[0]).endswith(".parquet") else None


def run_preflight(config: DictConfig, run_dir: Path | None = None) -> dict:
    """The vocabulary check (always), then opd.preflight: cheap (chat template on a few real prompts;
    default), full (also the step-0 statistics: loads both models in the driver), off. Each model's
    tokenizer is loaded once for all of it. Writes preflight.json into the run folder (when given).
    Returns what the vocabulary check compared (compat.check_vocab)."""
    from opd_patches.checks import compat, preflight

    mode = opd_config.of(config).preflight
    student = str(config.actor_rollout_ref.model.path)
    teachers = {key: str(t.model_path) for key, t in config.distillation.teacher_models.items()}
    tokenizers = compat.load_tokenizers(student, *teachers.values())
    compared = {}
    for key, teacher in teachers.items():
        try:
            compared = compat.check_vocab(student, teacher, tokenizers)
        except compat.IncompatibleModels as exc:
            raise ConfigError(f"distillation.teacher_models.{key}.model_path: {exc}") from exc
        if mode == "off":
            continue
        out = None if run_dir is None else run_dir / ("preflight.json" if len(teachers) == 1 else f"preflight.{key}.json")
        try:
            report = preflight.run_preflight(student, teacher, _first_train_file(config), full=(mode == "full"),
                                             strict=False, out=out, tokenizers=tokenizers)
        except preflight.PreflightError as exc:
            raise ConfigError(f"distillation.teacher_models.{key}.model_path (pre-flight, report in {out}): {exc}") from exc
        print(preflight.format_report(report), flush=True)
    return compared


def apply_placement(config: DictConfig) -> None:
    """Translate `opd.teacher_placement` into upstream's distillation keys."""
    opd = opd_config.of(config)
    with open_dict(config):
        config.distillation.nnodes = int(config.trainer.nnodes)
        if opd.teacher_placement == "standalone":
            config.distillation.n_gpus_per_node = opd.teacher_gpus
            if config.trainer.v1.trainer_mode == "sync":  # same trainer + wall clock, receipts, resume, guard
                config.trainer.v1.trainer_mode = OPS_SYNC_MODE
            return
        # colocated: the teacher runs inside the actor's worker group (opd_patches/teacher), scheduled by
        # the trainer mode below; upstream creates no teacher pool, teacher servers or teacher client.
        mode = config.trainer.v1.trainer_mode
        if mode not in ("sync", COLOCATED_MODE):
            raise ConfigError(
                f"opd.teacher_placement=colocated runs the synchronous trainer mode {COLOCATED_MODE!r}; "
                f"trainer.v1.trainer_mode={mode} cannot host it (use opd.teacher_placement=standalone)."
            )
        config.trainer.v1.trainer_mode = COLOCATED_MODE
        if config.trainer.v1.get(COLOCATED_MODE) is None:
            config.trainer.v1[COLOCATED_MODE] = {}
        config.trainer.v1[COLOCATED_MODE].offload = opd.teacher_offload
        config.trainer.v1[COLOCATED_MODE].canary_every = opd.teacher_canary_every
        config.actor_rollout_ref.rollout.agent.agent_loop_manager_class = COLOCATED_AGENT_LOOP
        # Upstream still validates the (unused) teacher pool's size: name the actor's GPUs.
        config.distillation.n_gpus_per_node = int(config.trainer.n_gpus_per_node)


def apply_attention(config: DictConfig) -> None:
    """`opd.attn_implementation` -> upstream's `actor_rollout_ref.model.override_config.attn_implementation`
    (the student's update and log-prob passes; the colocated teacher reads the same key). auto:
    flash_attention_2 where flash-attn is installed, else torch_varlen on CUDA, else sdpa."""
    from opd_patches.attention import torch_varlen

    choice = opd_config.of(config).attn_implementation
    try:
        attn = torch_varlen.resolve(choice, str(config.trainer.device))
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    key = "actor_rollout_ref.model.override_config.attn_implementation"
    upstream = OmegaConf.select(config, key, default=None)
    if upstream is not None and upstream != attn:  # one key decides, never silently overridden
        raise ConfigError(f"{key}={upstream} but opd.attn_implementation={choice} resolves to {attn}: "
                          f"set opd.attn_implementation={upstream} instead.")
    if attn == torch_varlen.NAME:
        for sp in ("actor_rollout_ref.actor.ulysses_sequence_parallel_size",
                   "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"):
            if int(OmegaConf.select(config, sp, default=1) or 1) > 1:
                raise ConfigError(f"opd.attn_implementation={attn}: VERL's Ulysses sequence parallelism ({sp} > 1) "
                                  "runs only through flash_attention_2.")
    with open_dict(config):
        config.actor_rollout_ref.model.override_config.attn_implementation = attn


CPU_DTYPE_ROLES = ("actor", "ref")  # the FSDP training engines: the student (update, log-probs), the reference


def apply_cpu_dtype(config: DictConfig) -> None:
    """`opd.cpu_dtype` (CPU device only) -> upstream's
    `actor_rollout_ref.{actor,ref}.fsdp_config.mixed_precision.param_dtype`, which sets both the FSDP2
    MixedPrecisionPolicy's compute dtype and the engine's torch.autocast (none for fp32);
    `fsdp_config.dtype` is read by the Megatron engine only. auto: float32 unless bf16 is native here
    (opd_patches/platforms/cpu.py). The colocated teacher and the hf rollout compute in float32
    on the CPU whatever this says. Says once which dtype and why."""
    if str(config.trainer.device) != "cpu":
        return
    import torch
    from verl.utils.torch_dtypes import PrecisionType

    from opd_patches.platforms import cpu as cpu_platform

    choice = opd_config.of(config).cpu_dtype
    try:
        dtype, why = cpu_platform.compute_dtype(choice)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    value = PrecisionType.to_str(getattr(torch, dtype))  # upstream's spelling: fp32 | bf16
    for role in CPU_DTYPE_ROLES:
        key = f"actor_rollout_ref.{role}.fsdp_config.mixed_precision.param_dtype"
        upstream = OmegaConf.select(config, key, default=None)
        if upstream is not None and PrecisionType.to_dtype(upstream) != getattr(torch, dtype):
            raise ConfigError(f"{key}={upstream} but opd.cpu_dtype={choice} resolves to {dtype} ({why}): "
                              f"set opd.cpu_dtype instead.")
        fsdp = config.actor_rollout_ref[role].fsdp_config
        with open_dict(config):
            if fsdp.get("mixed_precision") is None:
                fsdp.mixed_precision = {}
            fsdp.mixed_precision.param_dtype = value
    print(f"[opd] CPU compute dtype: {dtype} ({why})", flush=True)


def apply_export(config: DictConfig) -> None:
    """`opd.background_export`: the save's finish builds the HF export from the state files
    (opd_patches/ops/state_export.py), so upstream's save leaves `hf_model` out of `save_contents`.
    Resolved to false (upstream exports) where there is no export to move or it cannot be built."""
    choice = opd_config.of(config).background_export
    checkpoint = config.actor_rollout_ref.actor.checkpoint
    contents = list(checkpoint.get("save_contents") or [])
    why = None
    if choice and "hf_model" in contents:
        from opd_patches.ops import state_export

        why = state_export.supported(str(config.actor_rollout_ref.actor.strategy),
                                     _architectures(str(config.actor_rollout_ref.model.path)))
        if why:
            print(f"[opd] opd.background_export: upstream writes the HF export during the save ({why})", flush=True)
    with open_dict(config):
        config.opd.background_export = bool(choice and "hf_model" in contents and why is None)
        if config.opd.background_export:
            checkpoint.save_contents = [c for c in contents if c != "hf_model"]


def _architectures(model_path: str):
    """The local model folder's `architectures`; None where unknown (a hub id)."""
    try:
        return json.loads((Path(os.path.expanduser(model_path)) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError):
        return None


def apply_old_log_prob(config: DictConfig) -> None:
    """`opd.skip_old_log_prob` (opd_patches/teacher/old_log_prob.py): says once which pass runs."""
    from opd_patches.teacher import old_log_prob

    try:
        print(old_log_prob.apply(config), flush=True)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def apply_speculation(config: DictConfig) -> None:
    """With upstream's `speculative_config` (checked in run(): opd_patches/checks/speculation.py), the engine logs
    statistics, so that each rollout server serves its draft counters (opd_patches/rollout/spec_metrics.py)."""
    from opd_patches.checks import speculation

    spec = OmegaConf.select(config, speculation.KEY, default=None)
    if spec is None:
        return
    with open_dict(config):
        config.actor_rollout_ref.rollout.disable_log_stats = False
    print(f"[opd] speculative decoding: {OmegaConf.to_container(spec) if OmegaConf.is_config(spec) else spec}; "
          "actor_rollout_ref.rollout.disable_log_stats=false (the acceptance is logged per step as rollout/spec_*)",
          flush=True)


def apply_logging(config: DictConfig) -> None:
    """`trainer.logger` always keeps VERL's `file` logger: metrics.jsonl in the run folder is what the run
    summary, `make plot` and studies read, whatever else (tensorboard, wandb) a user turns on."""
    loggers = config.trainer.get("logger")
    loggers = [loggers] if isinstance(loggers, str) else list(loggers or [])
    if "file" not in loggers:
        print(f"[opd] trainer.logger={loggers}: `file` added (metrics.jsonl in the run folder)", flush=True)
        with open_dict(config):
            config.trainer.logger = [*loggers, "file"]


def logger_env(run_dir: Path) -> dict:
    """Where VERL's other loggers write, for every Ray process: tensorboard into <run>/tensorboard, W&B into
    <run>/wandb and offline unless WANDB_MODE says otherwise (these machines need no account or network)."""
    return {"TENSORBOARD_DIR": os.environ.get("TENSORBOARD_DIR") or str(run_dir / "tensorboard"),
            "WANDB_DIR": os.environ.get("WANDB_DIR") or str(run_dir),
            "WANDB_MODE": os.environ.get("WANDB_MODE") or "offline"}


def configure_ray(config: DictConfig, run_dir: Path) -> None:
    """Environment for every Ray process; logical GPUs on the CPU platform. The `opd` section, resolved
    (the run folder, whether the update's entropy is a metric only), travels as one variable,
    opd_patches/config.py's OPD_CONFIG, which every worker-side reader parses once."""
    from opd_patches.teacher.old_log_prob import entropy_detached

    with open_dict(config):
        config.opd.run_dir = str(run_dir)
        # patches/entropy_from_logits.py: the update's entropy is a metric only
        config.opd.entropy_detached = entropy_detached(config)
    opd = opd_config.of(config)
    modules = ["opd_patches.registered"]  # its import calls opd_patches.register()
    if opd.teacher_placement == "colocated":
        modules.append("opd_patches.trainers.colocated_teacher")  # registers the trainer mode "colocated_teacher"
    else:
        modules.append("opd_patches.trainers.opd_sync")  # registers the trainer mode "opd_sync"
    env = {
        "VERL_USE_EXTERNAL_MODULES": ",".join(modules),
        "VERL_FILE_LOGGER_PATH": str(run_dir / "metrics.jsonl"),
        **logger_env(run_dir),
        opd_config.ENV: opd_config.dumps(opd),
    }
    for var in ("VERL_PLATFORM", "VERL_ENGINE_DEVICE", "PYTHONPATH"):
        if os.environ.get(var):
            env[var] = os.environ[var]
    with open_dict(config):
        ray_init = config.ray_kwargs.ray_init
        if ray_init.get("runtime_env") is None:
            ray_init.runtime_env = {}
        ray_init.runtime_env.env_vars = {**(ray_init.runtime_env.get("env_vars") or {}), **env}
        if os.environ.get("VERL_PLATFORM") == "cpu":
            gpus = config.trainer.n_gpus_per_node * config.trainer.nnodes
            if opd.teacher_placement == "standalone":  # colocated: no teacher pool
                gpus += config.distillation.n_gpus_per_node * config.distillation.nnodes
            # Ray must see as many (logical) GPUs as the placement groups ask for, and enough
            # logical CPUs for VERL's bundles ({"CPU": 3, "GPU": 1} each); otherwise it waits forever.
            ray_init.num_gpus = gpus
            if ray_init.get("num_cpus") is None:
                ray_init.num_cpus = max(16, 4 * gpus)


SUMMARY_KEYS = (
    "actor_rollout_ref.model.path",
    "distillation.teacher_models.teacher_model.model_path",
    "opd.teacher_placement",
    "trainer.v1.trainer_mode",
    "distillation.distillation_loss.loss_mode",
    "distillation.distillation_loss.topk",
    "distillation.distillation_loss.use_policy_gradient",
    "distillation.distillation_loss.use_task_rewards",
    "data.train_files",
    "data.train_batch_size",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.model.override_config.attn_implementation",
    "actor_rollout_ref.rollout.temperature",
    "data.max_response_length",
    "data.shuffle",
    "data.seed",
    "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.optim.lr_scheduler_type",
    "trainer.total_training_steps",
    "trainer.save_freq",
    "trainer.max_actor_ckpt_to_keep",
    "opd.wall_clock_s",
    "opd.reserve_s",
    "trainer.n_gpus_per_node",
    "trainer.default_local_dir",
)


def describe(config: DictConfig) -> str:
    """The composed values a user most often checks, one per line."""
    width = max(map(len, SUMMARY_KEYS))
    return "\n".join(f"  {key:<{width}}  {OmegaConf.select(config, key)}" for key in SUMMARY_KEYS)


def prepare(config: DictConfig) -> Path:
    """Everything main does between VERL's import and its start (paths are checked before: run()); returns
    the run folder."""
    if "opd" not in config:
        raise ConfigError("The config has no `opd` section: start from a recipe in recipes/ (see recipes/README.md).")
    opd_config.of(config)  # every opd.* key typed and checked before anything acts on one
    # The driver validates loss names and the platform too; run.sh's VERL_USE_EXTERNAL_MODULES already
    # registered them when verl was imported, a direct caller may not have set it (idempotent).
    opd_patches.register()
    apply_placement(config)
    apply_attention(config)
    apply_cpu_dtype(config)
    apply_old_log_prob(config)
    apply_export(config)
    apply_speculation(config)
    apply_logging(config)
    run_dir = Path(os.path.expanduser(config.trainer.default_local_dir)).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    with open_dict(config):
        config.trainer.default_local_dir = str(run_dir)
        config.opd.launched_at = LAUNCHED_AT
    check_distillation(config, run_dir)  # with the pre-flight, which writes its report into run_dir
    configure_ray(config, run_dir)
    print(f"[opd] composed config (full copy in {run_dir / 'manifest.json'}):\n{describe(config)}", flush=True)
    manifest.rotate(run_dir / "metrics.jsonl")
    manifest.rotate(run_dir / "run_summary.json")  # the summary read at the end must be this process's
    manifest.write(run_dir, config)
    return run_dir


def hold_run_lock(config: DictConfig) -> None:
    """One run per machine (opd_patches/ops/lock.py): refuse, before Ray starts, while another run holds
    the lock or another process holds memory on the assigned GPUs; opd.force=true skips both. Held
    until this process exits (the kernel also drops it when the process dies)."""
    import atexit

    from opd_patches.ops import lock

    gpus = [] if os.environ.get("VERL_PLATFORM") == "cpu" else None  # the CPU platform uses no GPU
    run_dir = Path(os.path.expanduser(str(config.trainer.default_local_dir))).resolve()
    held = lock.acquire(force=opd_config.of(config).force, gpus=gpus, run=run_dir)
    atexit.register(held.release)


def run(config: DictConfig) -> None:
    if not config.trainer.use_v1:
        raise ConfigError("trainer.use_v1=false: opd_patches builds on VERL's V1 trainer only.")
    opd_config.check_environment()
    opd_config.of(config)  # a mistyped opd.* key is refused before the lock or any check
    # Before prepare(): a refused run must not rotate the running one's files; before importing VERL: a
    # refusal or a mistyped path costs no import (VERL pulls in torch and ray: seconds of CPU).
    hold_run_lock(config)
    check_inputs(config)
    from opd_patches.checks import compilation, speculation
    from opd_patches.checks.resources import check_resources

    compilation.check(config)  # the rollout's CUDA graphs where they changed the samples: refused before Ray
    speculation.check(config)  # upstream's speculative_config where it cannot work: refused before Ray

    check_resources(config)  # disk for the kept states, host memory for the pinned and parked copies
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    run_dir = prepare(config)
    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    print(f"[opd] run folder: {run_dir}", flush=True)
    from opd_patches.ops import run_summary as summary

    try:
        run_ppo(config, task_runner_class=TaskRunnerV1)
    except Exception:
        ended = summary.read(run_dir)
        if ended is not None and ended["status"] == "non_finite":  # the guard's stop, not a crash
            print(summary.line(ended), file=sys.stderr, flush=True)
            sys.exit(summary.EXIT_CODES["non_finite"])
        raise
    print(f"[opd] finished: {manifest.summary(run_dir)}", flush=True)
    ended = summary.read(run_dir)
    if ended is not None:
        print(summary.line(ended), flush=True)


def searchpath_without_import(argv: list[str]) -> list[str]:
    """`argv` with run.sh's `pkg://verl.trainer.config` search path given as the same folder (file://).

    Hydra imports a pkg:// path's package to find its files: `import verl` (torch, ray, ...: seconds of
    CPU) before this process takes the run lock or checks a path. VERL's config files are the same
    either way; VERL itself is imported once those checks passed (run()). Unchanged when verl is not
    installed (Hydra then names the missing package)."""
    import importlib.util

    spec = importlib.util.find_spec("verl")  # a top-level package: located, not executed
    if spec is None or not spec.submodule_search_locations:
        return argv
    folder = Path(spec.submodule_search_locations[0]) / "trainer" / "config"
    return [a.replace(VERL_CONFIG_PKG, f"file://{folder}") if a.startswith("hydra.searchpath=") else a for a in argv]


@hydra.main(config_path=None, config_name=None, version_base=None)
def main(config: DictConfig) -> None:
    from opd_patches.ops import lock

    try:
        run(config)
    except ConfigError as exc:
        print(f"[opd] config error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except InputError as exc:  # a data file or model folder that cannot work (opd_patches/checks)
        print(f"[opd] refused: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except lock.BUSY as exc:  # another run or GPU process: exit 75 (try again later)
        print(f"[opd] refused: {exc}", file=sys.stderr, flush=True)
        sys.exit(lock.EXIT_BUSY)


if __name__ == "__main__":
    try:  # an unknown opd.* key on the command line: the nearest known one, not Hydra's append hint
        opd_config.check_overrides(sys.argv[1:])
    except ConfigError as exc:
        print(f"[opd] config error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.argv = searchpath_without_import(sys.argv)
    main()
