"""The only places where upstream behaviour is patched at run time (VERL 0.9.1 and torch).

Each patch is small, idempotent, and guarded by tests/test_upstream_patches.py, which fails
loudly if the patched upstream function moves or changes shape, and by
tests/test_upstream_patches_accept.py: a patch accepts all that the original accepts (fed the
inputs of upstream's own tests, it returns what the original returns, or what "Accepts" says).

1. `cpu:gloo,cpu:gloo`: VERL builds the process-group backend as
   `f"cpu:gloo,{device}:{backend}"` (verl/utils/distributed.py); on the CPU platform that
   names the CPU twice and torch refuses it. We drop repeated `device:backend` entries.
   Accepts: every backend torch accepts reaches it as the same object (only strings that torch
   refuses as "Duplicate device type" change); positional, keyword and absent `backend` pass through.
   The same wrapper retries a single-rank env:// rendezvous whose MASTER_PORT was taken (EADDRINUSE):
   VERL's rank-0 worker picks a free port (bind to 0, close) seconds before torch listens on it, and
   another process's connection can take it meanwhile (seen once with two CPU runs side by side). With
   one rank nobody else dials that port, so a fresh one is as good; with several ranks it raises as before.
2. Top-k teachers served by the `hf` backend: `DistillationTeacherModelConfig.
   _validate_topk_logprobs` (verl/workers/config/distillation.py) accepts only vllm/sglang
   and raises NotImplementedError otherwise. The HF backend returns any number of
   prompt log-probs, so there is nothing to validate for it.
   Accepts: the original's outcome for every call except `hf` with use_topk and a topk (upstream:
   NotImplementedError; here: valid); the original alone reads `self.inference` otherwise.
3. The tail term of `forward_kl_topk_tail` needs the student logits, which exist only inside the
   actor's forward pass, where VERL calls `verl.trainer.distillation.fsdp.losses.
   compute_forward_kl_topk` for every top-k loss. We wrap that one function: it runs unchanged and,
   for the tail loss only, adds one more per-token output (`tail_losses`).
   Memory-lean mode: when `opd.lean_topk` is on (env OPD_LEAN_TOPK=1, losses/lean_topk.py), the same wrapper
   computes both top-k losses with the memory-lean exact kernel instead of calling the original;
   the outputs (keys, shapes, values, gradients) are the original's.
   Accepts: without a loss_mode it knows (upstream's tests pass a namespace with no loss_mode; any
   other loss), the original runs unchanged. In lean mode: the original's keys and shapes, values and
   gradients to fp32 rounding, in the dtypes of upstream's fp32 maths (as under the actor's autocast;
   `use_chunked_topk`, which upstream rounds to the logits' dtype, gets the fp32 values too).
4. Upstream's registered `forward_kl_topk` clamps negative per-token losses at 0 without saying how
   often; its registry entry is wrapped to also report `distillation/clamped_frac`.
   Accepts: exactly what the original accepts (it is called first, with the same arguments); returns
   its losses and metrics plus that one key.
5. Sampled-token log-probs without flash-attn: `verl.utils.torch_functional.logprobs_from_logits`
   falls back to `logprobs_from_logits_v2`, a Python loop over rows for bf16 (130x slower than one
   batched log_softmax on an H200). `logprobs_from_logits` reads `logprobs_from_logits_v2` from its
   module's globals on every call, so replacing that one module attribute reaches every
   `from ... import logprobs_from_logits` binding (the FSDP engine's included) and nothing else:
   flash-attn and NPU keep their paths. On (env OPD_FAST_LOGPROBS, key `opd.fast_logprobs`), it runs
   the exact chunked kernel of losses/sampled_logprob.py; off, the original.
   Accepts: off, the original. On, every (logits (..., V), labels (...)) the original takes, plus
   empty batches and IGNORE_INDEX labels (the original raises); fp32 values (fp64 for fp64): for bf16
   logits the original returns bf16-rounded values, CUDA autocast upstream fp32 as here. No double
   backward (create_graph), which the original's plain autograd would allow; no caller asks for it.
6. Old log-probs from the update (`opd.skip_old_log_prob`, teacher/old_log_prob.py): VERL 0.9.1 has no
   on-policy branch (old = current, detached, when one epoch and one mini-batch). `ActorRolloutRefWorker.
   init_model` binds `distillation_ppo_loss` from its module's globals; we wrap that one name: when the
   trainer marks the update batch, the loss gets `old_log_probs` = the forward's own log-probs, detached,
   and, when asked, the forward's entropy as the `actor/entropy` metric.
7. Entropy as a metric only: with the student pass skipped the update computes the entropy for
   `actor/entropy`; at entropy_coeff 0 it contributes 0 to the loss, so (env OPD_ENTROPY_DETACHED=1)
   `verl_F.entropy_from_logits` and its chunked twin run on detached logits: same values, no
   (T, V) autograd graph kept for a zero gradient. The FSDP engine reads them at construction. They
   run eager (torch.compiler.disable: VERL's torch.compile recompiled them per micro-batch length on
   the H200), under no_grad, the unchunked one in row chunks of ENTROPY_ROWS.
8. State files written in the background (`opd.background_state_write`, env OPD_ASYNC_STATE_WRITE=1,
   ops/state_writer.py): `FSDPCheckpointManager.save_checkpoint` calls `torch.save(obj, path)` through its
   module's global `torch`; for the duration of that one method the global names a module proxy whose
   `save` snapshots `obj` to host memory and queues it for a writer thread (every other attribute is
   torch's). Accepts: everything the original does; file objects (not paths) and tensor types other
   than Tensor/DTensor (FSDP1's ShardedTensor) are written at once, as the original would.
"""

import functools
import os

import torch
import torch.distributed

_MARK = "_opd_patched"
ENTROPY_ROWS = 4096  # patch 7: rows per chunk of the metric-only entropy (a 4096 x 151,936 bf16 softmax: 1.2 GB)
_ANNOUNCED = set()  # loss modes / kernels that announced their path in this process


def dedupe_backend(backend):
    """'cpu:gloo,cpu:gloo' -> 'cpu:gloo'. Only repeated `device:backend` entries are dropped, which torch
    refuses ("Duplicate device type"), so every value torch accepts comes back as the same object."""
    if not isinstance(backend, str) or "," not in backend:
        return backend
    parts = backend.split(",")
    unique = list(dict.fromkeys(parts))
    if len(unique) == len(parts) or not all(":" in part for part in parts):
        return backend
    return ",".join(unique)


PORT_RETRIES = 3


def _single_rank_env(args, kwargs) -> bool:
    """A one-rank group rendezvousing through MASTER_ADDR/MASTER_PORT (init_method None or env://, no store)."""
    init_method = kwargs.get("init_method", args[1] if len(args) > 1 else None)
    if kwargs.get("store") is not None or init_method not in (None, "env://"):
        return False
    world_size = kwargs.get("world_size", args[3] if len(args) > 3 else -1)
    if world_size in (-1, None):
        world_size = os.environ.get("WORLD_SIZE")
    return str(world_size) == "1"


def _patch_init_process_group():
    original = torch.distributed.init_process_group
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = dedupe_backend(kwargs["backend"])
        elif args:
            args = (dedupe_backend(args[0]),) + args[1:]
        for attempt in range(PORT_RETRIES + 1):
            try:
                return original(*args, **kwargs)
            except torch.distributed.DistNetworkError as exc:
                if attempt == PORT_RETRIES or "EADDRINUSE" not in str(exc) or not _single_rank_env(args, kwargs):
                    raise
                from verl.single_controller.base.worker import WorkerHelper  # how VERL picked the taken one

                taken, os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT"), str(WorkerHelper._get_free_port())
                print(f"[opd] MASTER_PORT {taken} was taken before torch listened on it; single rank: "
                      f"retrying on {os.environ['MASTER_PORT']}", flush=True)

    setattr(init_process_group, _MARK, True)
    torch.distributed.init_process_group = init_process_group


def _patch_topk_validation():
    # Imported here, as in every patch: importing this module must not import verl, whose own import
    # registers opd_patches (VERL_USE_EXTERNAL_MODULES) and so calls apply() on this module.
    from verl.workers.config.distillation import DistillationTeacherModelConfig

    original = DistillationTeacherModelConfig._validate_topk_logprobs
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def _validate_topk_logprobs(self, use_topk, topk):
        # Only the one case upstream refuses changes; the original makes its own early returns and
        # errors first (no top-k, topk missing) and is the one to read `self.inference`.
        if use_topk and topk is not None and self.inference.name == "hf":
            return None
        return original(self, use_topk, topk)

    setattr(_validate_topk_logprobs, _MARK, True)
    DistillationTeacherModelConfig._validate_topk_logprobs = _validate_topk_logprobs


def _patch_topk_logits_processor():
    import verl.trainer.distillation.fsdp.losses as fsdp_losses
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor

    from opd_patches.losses import lean_topk
    from opd_patches.losses.forward_kl_topk_tail import NAME, tail_outputs

    original = fsdp_losses.compute_forward_kl_topk
    if getattr(original, _MARK, False):
        return

    def aligned(teacher_topk_log_probs, teacher_topk_ids):
        # Align the teacher tensors with the logits exactly as the original does (packed, SP-sliced).
        assert teacher_topk_log_probs.is_nested and teacher_topk_ids.is_nested  # as the original
        logprobs, ids = teacher_topk_log_probs.values().unsqueeze(0), teacher_topk_ids.values().unsqueeze(0)
        if get_ulysses_sequence_parallel_world_size() > 1:
            logprobs, ids = slice_input_tensor(logprobs, dim=1), slice_input_tensor(ids, dim=1)
        return logprobs, ids

    @functools.wraps(original)
    def compute_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format):
        # The original never reads loss_mode (upstream's tests pass a namespace without it): no mode
        # means not one of ours, so the original runs unchanged.
        mode = getattr(getattr(config, "distillation_loss", None), "loss_mode", None)
        if lean_topk.enabled() and mode in lean_topk.LOSS_MODES:
            # Memory-lean mode (losses/lean_topk.py): the same outputs, no (T, V) fp32 tensors.
            logprobs, ids = aligned(teacher_topk_log_probs, teacher_topk_ids)
            assert logprobs.shape[:2] == ids.shape[:2] == student_logits.shape[:2]
            if mode not in _ANNOUNCED:  # once per process and loss: say which path trains
                print(f"[opd] {mode}: memory-lean top-k kernel (opd.lean_topk)", flush=True)
                _ANNOUNCED.add(mode)
            return lean_topk.topk_outputs(student_logits, ids, logprobs, config.distillation_loss, with_tail=mode == NAME)
        outputs = original(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format)
        if mode != NAME:
            return outputs
        logprobs, ids = aligned(teacher_topk_log_probs, teacher_topk_ids)
        return {**outputs, **tail_outputs(student_logits, ids, logprobs)}

    setattr(compute_forward_kl_topk, _MARK, True)
    fsdp_losses.compute_forward_kl_topk = compute_forward_kl_topk


def _patch_forward_kl_topk_metrics():
    from verl.trainer.distillation import losses as distill_losses
    from verl.workers.utils.padding import no_padding_2_padding

    from opd_patches.losses.forward_kl_topk_tail import clamp_fraction, response_mask_of

    original = distill_losses.DISTILLATION_LOSS_REGISTRY["forward_kl_topk"]
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def compute_forward_kl_topk(config, distillation_config, model_output, data):
        losses, metrics = original(config, distillation_config, model_output, data)
        truncated = no_padding_2_padding(model_output["distillation_losses"], data).detach()
        metrics["distillation/clamped_frac"] = clamp_fraction(truncated, response_mask_of(data))
        return losses, metrics

    setattr(compute_forward_kl_topk, _MARK, True)
    distill_losses.DISTILLATION_LOSS_REGISTRY["forward_kl_topk"] = compute_forward_kl_topk


def _patch_logprobs_fallback():
    import verl.utils.torch_functional as verl_F

    from opd_patches.losses import sampled_logprob

    original = verl_F.logprobs_from_logits_v2
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def logprobs_from_logits_v2(logits, labels):
        if not sampled_logprob.enabled():
            return original(logits, labels)
        if "sampled_logprob" not in _ANNOUNCED:  # once per process: say which path computes log-probs
            print("[opd] sampled-token log-probs: chunked exact kernel (opd.fast_logprobs)", flush=True)
            _ANNOUNCED.add("sampled_logprob")
        return sampled_logprob.sampled_logprobs(logits, labels)

    setattr(logprobs_from_logits_v2, _MARK, True)
    verl_F.logprobs_from_logits_v2 = logprobs_from_logits_v2


def _patch_old_log_probs_from_update():
    import verl.workers.engine_workers as workers
    from verl.utils import tensordict_utils as tu

    from opd_patches.teacher import old_log_prob

    original = workers.distillation_ppo_loss
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def distillation_ppo_loss(config, distillation_config, model_output=None, data=None, **kwargs):
        if kwargs.get("student_logits") is not None or data is None:  # the logits processor: unchanged
            return original(config, distillation_config, model_output=model_output, data=data, **kwargs)
        if tu.get_non_tensor_data(data=data, key=old_log_prob.UPDATE_FLAG, default=False):
            data = old_log_prob.with_current_as_old(model_output, data)
        loss, metrics = original(config, distillation_config, model_output=model_output, data=data, **kwargs)
        if tu.get_non_tensor_data(data=data, key=old_log_prob.ENTROPY_FLAG, default=False):
            metrics["actor/entropy"] = old_log_prob.entropy_metric(config, model_output, data)
        return loss, metrics

    setattr(distillation_ppo_loss, _MARK, True)
    workers.distillation_ppo_loss = distillation_ppo_loss


# VERL's engine wraps the entropy in torch.compile(dynamic=True) (engine/fsdp/transformer_impl.py:184); on
# the H200 dynamo specialised it on each micro-batch's token count and recompiled (about 4 s each, up to its
# recompile limit of 8) inside the update. This metric-only pass runs eager: dynamo stops at this function
# (torch.compile unwraps a disabled function handed to it directly, hence the call one level down).
@torch.compiler.disable
def _metric_entropy(original, name, logits, args, kwargs):
    with torch.no_grad():
        logits = logits.detach()
        if name == "entropy_from_logits" and logits.dim() == 2 and logits.shape[0] > ENTROPY_ROWS:
            # row-wise maths: chunks give the same values without a (T, V) softmax at once
            return torch.cat([original(c) for c in logits.split(ENTROPY_ROWS)])
        return original(logits, *args, **kwargs)


def _patch_entropy_detached():
    import os

    import verl.utils.torch_functional as verl_F

    if os.environ.get("OPD_ENTROPY_DETACHED") != "1":
        return
    for name in ("entropy_from_logits", "entropy_from_logits_with_chunking"):
        original = getattr(verl_F, name)
        if getattr(original, _MARK, False):
            continue

        def detached(logits, *args, _original=original, _name=name, **kwargs):
            return _metric_entropy(_original, _name, logits, args, kwargs)

        functools.update_wrapper(detached, original)
        setattr(detached, _MARK, True)
        setattr(verl_F, name, detached)


def _patch_state_write():
    from opd_patches.ops import state_writer

    if not state_writer.enabled():
        return
    from verl.utils.checkpoint import fsdp_checkpoint_manager as module

    original = module.FSDPCheckpointManager.save_checkpoint
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def save_checkpoint(self, *args, **kwargs):
        with state_writer.deferred_saves(module):
            return original(self, *args, **kwargs)

    setattr(save_checkpoint, _MARK, True)
    module.FSDPCheckpointManager.save_checkpoint = save_checkpoint


def apply():
    _patch_init_process_group()
    _patch_topk_validation()
    _patch_topk_logits_processor()
    _patch_forward_kl_topk_metrics()
    _patch_logprobs_fallback()
    _patch_old_log_probs_from_update()
    _patch_entropy_detached()
    _patch_state_write()
