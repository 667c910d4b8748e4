"""The colocated teacher: a forward-only teacher model inside the actor's worker group.

`ColocatedTeacherWorker` is upstream's `ActorRolloutRefWorker` plus one forward-only teacher model
per rank (a plain transformers replica: data parallel like the actor, no sharding) and the method
`compute_teacher_logprobs`, registered exactly like upstream's `compute_log_prob`: the trainer passes
a TransferQueue `KVBatchMeta`, VERL's dispatch splits it over the actor's data-parallel ranks,
`tqbridge` fetches each rank's samples as a TensorDict, and the returned fields (`teacher_logprobs`,
`teacher_ids`, in the layout of scoring.py) are written back into TransferQueue for the same samples,
where upstream's losses read them.
"""

import os
from typing import Optional

import torch
from tensordict import TensorDict
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.device import get_device_id, get_device_name
from verl.workers.config import DistillationConfig
from verl.workers.engine_workers import ActorRolloutRefWorker

from opd_patches.teacher.canary import TeacherCanary, TeacherCanaryError  # noqa: F401  (re-exported)
from opd_patches.teacher.scoring import score_sequences


def worker_device() -> torch.device:
    name = get_device_name()
    return torch.device("cpu") if name == "cpu" else torch.device(name, get_device_id())


class ColocatedTeacher:
    """One forward-only teacher replica; parked in host memory between uses when `offload`.

    Its canary (canary.py) is taken on the device at load time (refusing a near-uniform, i.e.
    weightless, teacher) and rescanned on the device, right after the onload, before every
    `canary_every`-th `score` (0: never).
    """

    def __init__(
        self,
        model_path: str,
        k: int,
        device: torch.device,
        dtype: torch.dtype,
        offload: bool = True,
        chunk_size: int = 2048,
        max_tokens: int = 16384,
        attn_implementation: str = "sdpa",
        canary_every: int = 1,
    ):
        from transformers import AutoModelForCausalLM

        if not os.path.exists(model_path):
            from verl.utils.fs import copy_to_local

            model_path = copy_to_local(model_path)  # hdfs:// and hub ids, as upstream resolves model paths
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation=attn_implementation
        ).eval()
        self.model.requires_grad_(False)
        self.k, self.device, self.offload = k, device, offload
        self.chunk_size, self.max_tokens = chunk_size, max_tokens
        self.canary_every, self.calls = int(canary_every), 0
        # The host copy of every tensor lives in one flat page-locked buffer (pinned on accelerators),
        # so an onload is one device allocation and one asynchronous copy (a 1.5B bf16 teacher: 3.5 GB
        # per step). The teacher never changes, so an offload only drops the device buffer: nothing is
        # copied back.
        self._layout, self._host = _flat_host_copy(list(self._tensors()), device)
        self._device_buffer = None
        self._onload()
        try:
            self.canary = TeacherCanary(self.model, tokenizer=_tokenizer(model_path))
        finally:
            if offload:
                self._offload()
            else:
                self._host = None  # resident for good: no host copy needed

    def _tensors(self):
        yield from self.model.named_parameters()
        yield from self.model.named_buffers()

    def _point_at(self, buffer: torch.Tensor) -> None:
        for (_, t), (offset, nbytes) in zip(self._tensors(), self._layout):
            t.data = buffer[offset : offset + nbytes].view(t.dtype).view(t.shape)

    def _onload(self) -> None:
        # From page-locked memory this copy is asynchronous; the forward that follows is queued on the
        # same stream, so it waits for it.
        self._device_buffer = self._host.to(self.device, non_blocking=True)
        self._point_at(self._device_buffer)

    def _offload(self) -> None:
        self._point_at(self._host)
        self._device_buffer = None
        # Hand the freed blocks back for the rollout engine's wake-up. No gc.collect (upstream's
        # aggressive_empty_cache runs up to three): nothing here is held by a reference cycle, and each
        # collection costs a large fraction of a second in a trainer process.
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def score(self, sequences: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self.offload:
            self._onload()
        try:
            self.calls += 1
            if self.canary_every > 0 and self.calls % self.canary_every == 0:
                self.canary.check(self.model)
            return score_sequences(
                self.model, sequences, self.k, chunk_size=self.chunk_size, max_tokens=self.max_tokens
            )
        finally:
            if self.offload:
                self._offload()


def _flat_host_copy(named: list, device: torch.device, align: int = 256) -> tuple[list, torch.Tensor]:
    """One flat uint8 host buffer holding every tensor (page-locked on CUDA) and each tensor's
    (byte offset, byte count) in it, offsets aligned to `align` bytes so every dtype view is aligned."""
    layout, total = [], 0
    for _, t in named:
        nbytes = t.numel() * t.element_size()
        layout.append((total, nbytes))
        total += -(-nbytes // align) * align
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for (_, t), (offset, nbytes) in zip(named, layout):
        host[offset : offset + nbytes].view(t.dtype).view(t.shape).copy_(t.detach())
    return layout, host


def _tokenizer(model_path: str):
    """The teacher's tokenizer for the canary text; None (fixed ids instead) where it has none."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    except Exception:
        return None


def teacher_width(distillation: DistillationConfig) -> int:
    """Upstream's `prompt_logprobs` request: top-k for top-k losses, 0 (the token's own) otherwise."""
    loss = distillation.distillation_loss
    return int(loss.topk) if loss.loss_settings.use_topk else 0


class ColocatedTeacherWorker(ActorRolloutRefWorker):
    """ActorRolloutRefWorker that also holds a forward-only teacher and scores batches with it."""

    teacher: Optional[ColocatedTeacher] = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_colocated_teacher(
        self,
        offload: bool = True,
        chunk_size: int = 2048,
        max_token_len: Optional[int] = None,
        canary_every: int = 1,
    ):
        """Load the teacher of `distillation.teacher_models` on this rank (after init_model)."""
        assert "actor" in self.role, "the colocated teacher lives beside the actor"
        distillation: DistillationConfig = omega_conf_to_dataclass(self.distillation_config)
        if len(distillation.teacher_models) != 1:
            raise NotImplementedError(
                f"the colocated teacher serves one teacher; got {sorted(distillation.teacher_models)} "
                "(multi-teacher routing needs opd.teacher_placement=standalone)"
            )
        teacher = next(iter(distillation.teacher_models.values()))
        device = worker_device()
        dtype = getattr(torch, teacher.inference.dtype) if device.type != "cpu" else torch.float32
        attn = (self.config.model.get("override_config", {}) or {}).get("attn_implementation", "sdpa")
        from opd_patches.hooks import profile_update

        profile_update.install(self)  # opd.debug.profile_update (bench only): a no-op unless asked for
        self.teacher = ColocatedTeacher(
            teacher.model_path,
            k=teacher_width(distillation),
            device=device,
            dtype=dtype,
            offload=offload,
            chunk_size=chunk_size,
            max_tokens=max_token_len or self.config.rollout.log_prob_max_token_len_per_gpu or 16384,
            attn_implementation=attn,
            canary_every=canary_every,
        )
        print(
            f"[colocated teacher] rank {self.rank}: loaded {teacher.model_path} (k={self.teacher.k}, {dtype}, "
            f"offload={offload}) on {device}",
            flush=True,
        )
        c = self.teacher.canary
        print(
            f"[colocated teacher] rank {self.rank}: canary reference mean log-prob {c.reference_mean:.4f} over "
            f"{c.reference.numel()} tokens, log V = {c.log_v:.4f} (V={c.vocab_size}), tolerance {c.tolerance:g}, "
            f"rescan every {canary_every} scoring call(s)" + (" (disabled)" if canary_every <= 0 else ""),
            flush=True,
        )

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_teacher_logprobs(self, data: TensorDict) -> TensorDict:
        """`teacher_logprobs` / `teacher_ids` for every sample's `input_ids` (prompt + response)."""
        assert self.teacher is not None, "call init_colocated_teacher first"
        input_ids = data["input_ids"]
        sequences = list(input_ids.unbind(0))
        logprobs, ids = self.teacher.score(sequences)
        dump = os.environ.get("OPD_TEACHER_DUMP_DIR")
        if dump:  # debugging and tests/test_colocated_scaleout.py: this rank's inputs and outputs, per call
            self._dump_calls = getattr(self, "_dump_calls", 0) + 1
            torch.save(
                {"rank": self.rank, "world_size": self.world_size, "k": self.teacher.k,
                 "input_ids": [s.clone() for s in sequences], "teacher_logprobs": logprobs, "teacher_ids": ids},
                os.path.join(dump, f"teacher_rank{self.rank}_call{self._dump_calls}.pt"),
            )
        return TensorDict(
            {
                "teacher_logprobs": torch.nested.as_nested_tensor(logprobs, layout=torch.jagged),
                "teacher_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
            },
            batch_size=[len(sequences)],
        )
