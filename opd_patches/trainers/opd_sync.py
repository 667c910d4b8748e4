"""Training operations on upstream's synchronous V1 trainer, and the trainer mode `opd_sync`.

`OpsTrainerMixin` goes in front of upstream's `PPOTrainerSync` (MRO) and adds, through methods
upstream's fit loop already calls:
- wall clock (`opd.wall_clock_s`, `opd.reserve_s`, `opd.wall_clock_margin`; budget.py): after each
  step, stop at this step boundary when the next step and its save no longer fit; the step just
  done is saved (state, HF export, validation, receipt) and the loop ends; exit 0;
- receipts (receipts.py, finish.py): after upstream's save (with `opd.background_export`, the finish
  first writes the HF export's weights from the state files: state_export.py), the HF export is validated in a CPU
  subprocess (`opd.validate_after_save`), every file hashed, then `global_step_N/receipt.json` is
  written last, atomically. With `opd.background_save` that finish runs in a subprocess while
  training goes on (at most one at a time); the last save of the process (final step, wall clock)
  finishes in-process, so the trainer waits for it. Metrics: upstream's `timing_s/save_checkpoint`
  is what the trainer waited; `opd/save_background_s` the background finish, logged at the step it ended;
- pruning (checkpoints.py, inside the finish): the newest `trainer.max_actor_ckpt_to_keep`
  *validated* states and the newest complete one are kept, counted over the disk (earlier
  processes' states included); upstream's own in-memory pruning is switched off for the save;
- resume (`trainer.resume_mode=auto`): from the newest *complete* state whose files match their
  receipt's sha256 (re-hashed once per resume, falling back to older states), not from upstream's
  `latest_checkpointed_iteration.txt` (written before the receipt; it can name an interrupted save);
  incomplete folders after it are removed; the tracker file is rewritten to the resumed step;
- non-finite guard (guard.py): NaN/inf teacher log-probs (checked before the update), loss or grad
  norm (after it) stop the run before anything of that step is saved; exit status 3;
- `<run>/run_summary.json` (summary.py) whenever the fit loop ends;
- the replay buffer's poll (`opd.replay_poll_s`): upstream's sync sampler sleeps a fixed period between
  looks at TransferQueue while the rollout runs (`ReplayBuffer.poll_interval`, no config key), so every
  generation takes a whole number of those periods (opd_patches/config.py, docs/learning.md).
- a dead rollout-side actor (liveness.py, `opd.liveness_check_s`): checked while the trainer waits for a
  step's samples; the run stops with the actors named instead of waiting for ever.

`opd_sync` (`trainer.v1.trainer_mode=opd_sync`, what opd_patches.main picks for the standalone
teacher) = `PPOTrainerSync` + this mixin; the colocated teacher's `colocated_teacher` mode uses the
mixin too, so both placements get every feature.
"""

import shutil
import tempfile
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

# As in opd_patches/trainers/colocated_teacher.py: the `cpu` platform must be registered before VERL's trainer
# module imports its engines.
from opd_patches.platforms import cpu as cpu_platform  # noqa: F401, I001
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from opd_patches import config as opd_config
from opd_patches.checks.speculation import KEY as SPEC_KEY
from opd_patches.ops import checkpoints, finish, liveness
from opd_patches.ops import nonfinite as guard
from opd_patches.ops import run_summary as summary
from opd_patches.ops.budget import WallClock
from opd_patches.rollout import spec_metrics
from opd_patches.patches import replay_poll_interval

NAME = "opd_sync"
TRACKER = "latest_checkpointed_iteration.txt"


class _WallClockSpent(Exception):
    """The clock ran out before this process's first step: nothing new to save."""


class OpsTrainerMixin:
    """Wall clock, receipts, pruning, resume from complete states and a non-finite guard for a sync trainer."""

    # Upstream keys its sync-vs-async behaviour (replay buffer, refills, TransferQueue checkpoints) on
    # `trainer_mode == "sync"`; the modes using this mixin are sync whatever their registered name.
    @property
    def trainer_mode(self) -> str:
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        pass  # upstream's __init__ assigns the configured name

    def __init__(self, config: DictConfig):
        super().__init__(config)
        opd = opd_config.of(config)  # typed; opd_patches.main resolved it (e.g. background_export)
        if config.actor_rollout_ref.actor.get("checkpoint", {}).get("async_save", False):
            raise ValueError("actor_rollout_ref.actor.checkpoint.async_save=true: receipts need synchronous saves; "
                             "set it to false.")
        self.ops_run_dir = Path(config.trainer.default_local_dir)
        self.ops_clock = WallClock(
            opd.wall_clock_s, reserve_s=opd.reserve_s, margin=opd.wall_clock_margin,
            # a trainer built without opd_patches.main (no launch time recorded) counts from its construction
            launched_at=opd.launched_at if opd.launched_at is not None else time.time(),
        )
        # vLLM's draft counters are read around each step when the rollout speculates (rollout/spec_metrics.py)
        self.ops_speculates = OmegaConf.select(config, SPEC_KEY, default=None) is not None
        self._ops_spec_warned = False
        self.ops_validate = opd.validate_after_save
        self.ops_validate_timeout = opd.validate_timeout_s
        self.ops_background = opd.background_save
        # opd_patches.main took hf_model out of upstream's save_contents: the finish writes the export
        self.ops_build_export = opd.background_export
        self._ops_finishing = None  # the background finish in flight: dict(proc, result, state, started, waited)
        self._ops_save_metrics = {}
        self._ops_tmp = None
        debug = opd.debug  # TEST and BENCH ONLY switches (opd_patches/config.py DebugConfig)
        self.ops_inject_step = debug.inject_nan_step
        self.ops_inject_into = debug.inject_nan_into
        # TEST ONLY: the wall clock counts from the first step instead of the launch, so that a test's
        # clock does not depend on how long start-up took on a loaded machine.
        self.ops_clock_from_first_step = debug.wall_clock_from_first_step
        self.ops_finish_hold_s = debug.finish_hold_s or 0.0  # null: no hold
        self.ops_save_steps = None if debug.save_steps is None else set(debug.save_steps)
        self._ops_stop_reason = None
        self._ops_saved_step = None
        self._ops_last_done = 0
        self._ops_step_started = None
        self._ops_steps_this_process = 0
        self._ops_expected_params = None
        # Upstream's ReplayBuffer takes poll_interval (seconds) only as a constructor argument that its builder
        # never passes; the attribute is what its wait reads (opd_patches/patches/replay_poll_interval.py).
        replay_poll_interval.apply(self.replay_buffer, opd.replay_poll_s)
        liveness.install(self.replay_buffer, lambda: liveness.rollout_actors(self), opd.liveness_check_s)

    # ---- resume ---------------------------------------------------------------------------
    def _load_checkpoint(self):
        """resume_mode=auto: resume from the newest complete state (receipt), whatever the tracker file says."""
        if self.config.trainer.resume_mode != "auto":
            return super()._load_checkpoint()
        newest = checkpoints.resume_point(self.ops_run_dir)  # re-hashes against the receipt
        if newest is None:
            leftovers = [s["step"] for s in checkpoints.list_states(self.ops_run_dir)]
            if leftovers:
                print(f"[opd] resume: no complete state (no valid receipt) in {self.ops_run_dir}; state folders "
                      f"{leftovers} are not resumed from; training starts from step 0.", flush=True)
            mode, path = "disable", None
        else:
            step = int(newest.name.split("_")[-1])
            dropped = checkpoints.discard_after(self.ops_run_dir, step)
            note = f"; removed incomplete state folders {dropped}" if dropped else ""
            print(f"[opd] resume: from the newest complete state {newest}{note}", flush=True)
            mode, path = "resume_path", str(newest)
        saved = (self.config.trainer.resume_mode, self.config.trainer.get("resume_from_path"))
        with open_dict(self.config):
            self.config.trainer.resume_mode, self.config.trainer.resume_from_path = mode, path
        try:
            super()._load_checkpoint()
        finally:
            with open_dict(self.config):
                self.config.trainer.resume_mode, self.config.trainer.resume_from_path = saved
        if newest is not None:  # keep upstream's tracker truthful for other tools
            (self.ops_run_dir / TRACKER).write_text(str(self.global_steps))

    # ---- saving -----------------------------------------------------------------------------
    def _save_checkpoint(self):
        if self.ops_save_steps is not None and self.global_steps not in self.ops_save_steps:
            print(f"[opd] opd.debug.save_steps: no save after step {self.global_steps}", flush=True)
            return
        start = time.monotonic()
        self._ops_collect(wait=True)  # one finish at a time: pruning never overlaps a save
        step = self.global_steps
        state = self.ops_run_dir / f"global_step_{step}"
        keep = self.config.trainer.get("max_actor_ckpt_to_keep")
        with open_dict(self.config):
            self.config.trainer.max_actor_ckpt_to_keep = None  # upstream prunes from memory only: ours in finish
        try:
            super()._save_checkpoint()
        finally:
            with open_dict(self.config):
                self.config.trainer.max_actor_ckpt_to_keep = keep
        self._ops_saved_step = step
        args = dict(validate=self.ops_validate, expected_params=self._ops_expected() if self.ops_validate else None,
                    timeout_s=self.ops_validate_timeout, keep=keep, build_export=self.ops_build_export)
        # The last save of this process (final step or wall clock) is waited for: its receipt must exist at exit.
        last = self._ops_stop_reason is not None or step >= self.total_training_steps
        if self.ops_background and not last:
            if self.ops_validate and not self.ops_build_export:
                args["validation"] = finish.validated_here(state, args["expected_params"], self.ops_validate_timeout)
            if self._ops_tmp is None:
                self._ops_tmp = tempfile.mkdtemp(prefix="opd-finish-")
            result = Path(self._ops_tmp) / f"step_{step}.json"
            result.unlink(missing_ok=True)
            self._ops_finishing = dict(proc=finish.launch(state, step, result, hold_s=self.ops_finish_hold_s, **args),
                                       result=result, state=state,
                                       started=time.monotonic(), started_at=time.time(), waited=time.monotonic() - start)
            waited_for, later = ("", "HF export, ") if self.ops_build_export else (" and HF export", "")
            if args.get("validation") is not None:
                waited_for, later = waited_for + ", the tiny export's validation", ""
            else:
                later += "export validation, "
            print(f"[opd] saved step {step}: the trainer waited {self._ops_finishing['waited']:.1f} s (upstream's save: "
                  f"state, or its host snapshot with opd.background_state_write{waited_for}; any earlier finish); "
                  f"{later}hashing and receipt continue in the background", flush=True)
            return
        out = finish.finish(state, step, **args)
        self._ops_report(out, waited=time.monotonic() - start, background=False)

    def _ops_collect(self, wait: bool) -> None:
        """Report the background finish once it has ended (wait: block until it has)."""
        f = self._ops_finishing
        if f is None:
            return
        out = finish.collect(f["proc"], f["result"], f["state"], wait)
        if out is None:
            return
        self._ops_finishing = None
        # From launch to the receipt (the finish's own clock: collecting may come a step later).
        ended = out.get("ended_at") or time.time()
        self._ops_report(out, waited=f["waited"], background=True, background_s=max(0.0, ended - f["started_at"]))

    def _ops_report(self, out: dict, waited: float, background: bool, background_s: float = 0.0) -> None:
        if "error" in out:  # the finish process died or failed: the state stays incomplete
            print(f"[opd] WARNING: {out['error']}", flush=True)
            return
        step, validation, removed = out["step"], out["validation"], out["pruned"]
        self.ops_clock.record_save(waited + background_s)
        if background:
            self._ops_save_metrics["opd/save_background_s"] = background_s
        ok = None if validation is None else validation["ok"]
        how = f"{waited:.1f} s waited + {background_s:.1f} s in the background" if background else f"{waited:.1f} s"
        print(f"[opd] saved step {step}: receipt written, export validation "
              f"{ {True: 'ok', False: 'FAILED', None: 'skipped'}[ok] }, {how} (state write {out['write_wait_s']:.1f} s, "
              f"export {out['export_s']:.1f} s, validation {out['validate_s']:.1f} s, hashing {out['hash_s']:.1f} s after it; "
              f"the state's other files hashed beside them by {out.get('state_hashed_s', 0.0):.1f} s)"
              + _stages(validation)
              + (f"; pruned steps {removed}" if removed else ""), flush=True)
        if ok is False:
            print(f"[opd] WARNING: the step-{step} export failed validation: {validation['error']}; "
                  "it does not count as a kept state", flush=True)

    def _ops_expected(self):
        if self._ops_expected_params is None:
            from opd_patches.ops.validate import expected_parameters_for

            try:
                self._ops_expected_params = expected_parameters_for(str(self.config.actor_rollout_ref.model.path))
            except Exception:  # unreadable config: fall back to the export's own config
                self._ops_expected_params = 0
        return self._ops_expected_params or None

    # ---- step boundaries ----------------------------------------------------------------------
    def on_step_begin(self):
        if self._ops_steps_this_process == 0:
            if self.ops_clock_from_first_step:
                self.ops_clock.launched_at = time.time()
            spent, why = self.ops_clock.exhausted_before_start()
            if spent:
                raise _WallClockSpent(why)
        self._ops_step_started = time.monotonic()
        return super().on_step_begin()

    def step(self, metrics: dict, timing_raw: dict):
        servers = self._ops_spec_servers()
        before = spec_metrics.read(servers) if servers else None
        batch = super().step(metrics, timing_raw)
        if servers:
            figures = spec_metrics.step_metrics(before, spec_metrics.read(servers))
            metrics.update(figures)
            if not figures and not self._ops_spec_warned:
                self._ops_spec_warned = True
                print(f"[opd] WARNING: vLLM's speculation counters could not be read from {servers} (/metrics); "
                      "steps go on without rollout/spec_* figures", flush=True)
        guard.check_metrics(metrics, self.global_steps)  # before any save of this step
        self._ops_last_done = self.global_steps
        self._ops_steps_this_process += 1
        self.ops_clock.record_step(time.monotonic() - self._ops_step_started)
        self._ops_collect(wait=False)
        if self.global_steps < self.total_training_steps:
            freq = self.config.trainer.save_freq
            scheduled = freq > 0 and self.global_steps % freq == 0
            flight = None if self._ops_finishing is None else time.monotonic() - self._ops_finishing["started"]
            stop, why = self.ops_clock.should_stop(pending_save=scheduled, in_flight_s=flight)
            if stop:
                self._ops_stop_reason = why
        return batch

    def _ops_spec_servers(self) -> list[str]:
        """The rollout servers' addresses when the rollout speculates (their counters: rollout/spec_metrics.py)."""
        if not self.ops_speculates:
            return []
        servers = list(getattr(getattr(self, "llm_server_manager", None), "server_addresses", None) or [])
        if not servers and not self._ops_spec_warned:
            self._ops_spec_warned = True
            print("[opd] WARNING: the rollout speculates but its servers' addresses are unknown: no rollout/spec_* "
                  "figures", flush=True)
        return servers

    def on_step_end(self):
        if self._ops_stop_reason is None:
            super().on_step_end()
        else:
            # Stopping at this boundary: make sure this step is saved; no weight sync (nothing samples again).
            if self._ops_saved_step != self.global_steps:
                self._save_checkpoint()
            self.total_training_steps = self.global_steps  # upstream's loop ends after logging this step
            print(f"[opd] stopping after step {self.global_steps}: {self._ops_stop_reason}", flush=True)
        if self._ops_save_metrics:  # upstream merges these into this step's logged metrics
            self._pending_sync_metrics = {**(getattr(self, "_pending_sync_metrics", None) or {}), **self._ops_save_metrics}
            self._ops_save_metrics = {}

    # ---- sample order ------------------------------------------------------------------------------
    def _balance_batch(self, batch, metrics, *args, **kwargs):
        """Put the step's samples in a canonical order before upstream's balancing (and micro-batching).

        Upstream's replay buffer hands the samples over in the order their rollouts finished (an async
        race), and that order becomes the order of the tokens in the packed micro-batches: fp32 sums
        over them (loss, weight gradients) then differ in their last bits between two identical runs,
        and Adam's early, nearly sign-like updates grow that into visible loss differences within a
        few steps. Sorting by content (a sha256 of prompt length + prompt and response token ids; uids
        are random uuid4s) makes the order a function of the samples alone. `opd/samples_digest` (48
        bits of a sha256 over the ordered samples) lets a resumed run be compared with an uninterrupted one.
        """
        import hashlib

        import torch
        import transfer_queue as tq

        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["input_ids"])
        hashes = [
            hashlib.sha256(f"{tag.get('prompt_len')}:".encode() + ids.to(torch.int64).numpy().tobytes()).digest()
            for tag, ids in zip(batch.tags, data["input_ids"].unbind(), strict=True)
        ]
        order = sorted(range(len(hashes)), key=hashes.__getitem__)
        batch.reorder(order)
        digest = hashlib.sha256(b"".join(hashes[i] for i in order)).hexdigest()
        metrics["opd/samples_digest"] = float(int(digest[:12], 16))  # 48 bits: exact in a float64
        return super()._balance_batch(batch, metrics, *args, **kwargs)

    # ---- teacher output check and fault injection ---------------------------------------------------
    def _compute_advantage(self, batch, metrics):
        inject = self.ops_inject_step is not None and int(self.ops_inject_step) == self.global_steps
        if inject and self.ops_inject_into == "teacher":
            self._ops_poison_teacher(batch)
        self._ops_check_teacher(batch)
        if inject and self.ops_inject_into == "loss":
            self._ops_poison_teacher(batch)
        return super()._compute_advantage(batch, metrics)

    def _ops_teacher_logprobs(self, batch):
        import transfer_queue as tq

        if not self.config.get("distillation", {}).get("enabled", False):
            return None
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["teacher_logprobs"])
        return data["teacher_logprobs"] if "teacher_logprobs" in data.keys() else None

    def _ops_check_teacher(self, batch):
        try:
            values = self._ops_teacher_logprobs(batch)
        except Exception as exc:  # a layout without the field: say so once, the loss/grad-norm checks remain
            if not getattr(self, "_ops_teacher_check_off", False):
                self._ops_teacher_check_off = True
                print(f"[opd] WARNING: teacher output check unavailable ({type(exc).__name__}: {exc}); "
                      "loss and grad-norm checks remain.", flush=True)
            return
        if values is not None:
            guard.check_tensor(values, self.global_steps, "teacher output (teacher_logprobs)")

    def _ops_poison_teacher(self, batch):
        """TEST ONLY (opd.debug.inject_nan_step): overwrite this step's teacher log-probs with NaN."""
        import torch
        import transfer_queue as tq
        from verl.utils import tensordict_utils as tu

        values = self._ops_teacher_logprobs(batch)
        if values is None:
            raise RuntimeError("opd.debug.inject_nan_step: no teacher_logprobs to poison (distillation disabled?)")
        poisoned = torch.nested.as_nested_tensor(
            [torch.full_like(t, float("nan")) for t in values.unbind()], layout=torch.jagged
        )
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                        fields=tu.get_tensordict({"teacher_logprobs": poisoned}))
        print(f"[opd] TEST fault injection: teacher_logprobs set to NaN at step {self.global_steps} "
              f"({self.ops_inject_into} check)", flush=True)

    # ---- the loop ------------------------------------------------------------------------------
    def fit(self, agent_loop_manager):
        requested = self.total_training_steps
        try:
            try:
                super().fit(agent_loop_manager)
            finally:  # a save still finishing in the background (e.g. before a non-finite stop) ends first
                self._ops_collect(wait=True)
                if self._ops_tmp is not None:
                    shutil.rmtree(self._ops_tmp, ignore_errors=True)
        except _WallClockSpent as exc:
            status, reason = "wall_clock", str(exc)
        except guard.NonFiniteError as exc:
            self._ops_summary("non_finite", str(exc), requested, quantity=exc.quantity, step=exc.step)
            raise
        except BaseException as exc:
            try:
                self._ops_summary("error", f"{type(exc).__name__}: {exc}", requested)
            except Exception:  # e.g. the disk is full: the original error matters more
                pass
            raise
        else:
            if self._ops_stop_reason is not None:
                status, reason = "wall_clock", self._ops_stop_reason
            else:
                status, reason = "finished", f"reached trainer.total_training_steps={requested}"
        self._ops_summary(status, reason, requested)

    def _ops_summary(self, status, reason, requested, **extra):
        s = summary.write(self.ops_run_dir, status, self._ops_last_done, reason, requested_steps=requested,
                          step_s=[round(x, 2) for x in self.ops_clock.steps],
                          save_s=[round(x, 2) for x in self.ops_clock.saves], **extra)
        print(summary.line(s), flush=True)


def _stages(validation: dict | None) -> str:
    """The validation's own stages (validate.py `seconds`), for the save line."""
    stages = (validation or {}).get("seconds") or {}
    return f"; validation stages {', '.join(f'{k} {v:.1f} s' for k, v in stages.items())}" if stages else ""


@register_trainer(NAME)
class OpdSyncTrainer(OpsTrainerMixin, PPOTrainerSync):
    """Upstream's synchronous trainer + training operations (the standalone teacher's mode)."""
