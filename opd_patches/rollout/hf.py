"""The `hf` rollout backend: token-in/token-out generation with transformers, for hosts without vLLM.

Selected with `actor_rollout_ref.rollout.name=hf` (student rollout) or
`distillation.teacher_models.<key>.inference.name=hf` (teacher scoring). Three pieces, each in
the place VERL expects one:

- `HFServer`, a Ray actor per replica, standing where vLLM's `vLLMHttpServer` stands: the agent
  loop calls `generate(prompt_ids, sampling_params, request_id)`. Concurrent requests are
  gathered into batches (one per distinct sampling setting) and run with `model.generate`;
  under `rollout.full_determinism` one at a time (batch-invariant logits, hence resumable samples).
  A request with `prompt_logprobs=k` is scored by one forward pass and answered in vLLM's
  layout (row i = distribution of token i+1, a dummy last row).
- `HFReplica`, registered in `RolloutReplicaRegistry`, places one server beside its workers
  (on their GPU when there is one).
- `HFServerAdapter`, registered as the `("hf", "async")` rollout class, lives in the training
  worker and pushes the actor's weights to its server after every update.

It is a smoke/test backend: correct, batched, but HF generate is far slower than vLLM (each decode
step an eager forward driven from Python: no CUDA graphs, paged KV cache or continuous batching).
"""

import asyncio
import logging
import os
from collections import defaultdict
from typing import Any, Optional

import ray
import torch
from transformers import LogitsProcessorList
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from opd_patches.ops.seeded_sampling import SampleKeys, SeededSampler, sample_seed

logger = logging.getLogger(__name__)

# Positions scored per lm_head call when computing prompt log-probs: bounds the (chunk, V) fp32
# tensor instead of materialising (T, V) for a whole sequence.
LOGPROB_CHUNK = 1024
# The server runs a batch once no request arrived for BATCH_WINDOW_S (or max_num_seqs are waiting, or
# BATCH_MAX_WAIT_S passed since the first): the agent loop sends a step's requests over several hundred
# milliseconds, and a fixed window cuts them into several generate() calls that together cost far more
# CPU than one call for all of them (docs/learning.md).
BATCH_WINDOW_S = 0.02
BATCH_MAX_WAIT_S = 1.0


def server_name(replica_rank: int, node_rank: int = 0, role: str = "", suffix: str = "") -> str:
    return f"hf_server{role}_{replica_rank}_{node_rank}{suffix}"


def _model_path(model_config) -> str:
    path = getattr(model_config, "local_path", None) or model_config["path"]
    if isinstance(path, str) and not os.path.exists(path):
        from verl.utils.fs import copy_to_local

        path = copy_to_local(path)
    return path


def prompt_logprobs(model, input_ids: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Per-position teacher log-probs of one sequence, in the layout VERL reads from vLLM.

    Row i describes the distribution predicting token i+1: for k == 0 the log-prob of that
    token and its id; for k > 0 the top-k log-probs (descending) and their ids. A dummy row
    of zeros is appended so that the result has one row per input token. The maths is the
    colocated teacher's (opd_patches/teacher/scoring.py), so both teacher paths agree.
    """
    from opd_patches.teacher.scoring import score_sequences

    (lps,), (ids,) = score_sequences(model, [input_ids], k, chunk_size=LOGPROB_CHUNK, max_tokens=input_ids.numel())
    return lps.tolist(), ids.tolist()


class HFServer:
    """One replica's model, serving `generate` to VERL's agent loop and teacher loop."""

    def __init__(self, config, model_config, replica_rank: int, cuda_visible_devices: Optional[str] = None):
        from transformers import AutoModelForCausalLM, GenerationConfig

        from verl.utils.device import get_device_name

        if cuda_visible_devices is not None and get_device_name() == "cuda":
            # Share the training worker's GPU: Ray gave this actor no GPU of its own.
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        self.config = config
        self.replica_rank = replica_rank
        self.device = torch.device("cuda", 0) if get_device_name() == "cuda" else torch.device("cpu")
        # bf16 on the host CPU is slow and needlessly lossy for the tiny test models.
        dtype = getattr(torch, config.dtype) if self.device.type == "cuda" else torch.float32
        path = _model_path(model_config)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        gen = GenerationConfig.from_model_config(self.model.config)
        try:
            gen = GenerationConfig.from_pretrained(path)
        except OSError:
            pass
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else (self.eos_ids or [0])[0]
        self.processed_logprobs = str(getattr(config, "logprobs_mode", "raw_logprobs")).startswith("processed")
        self.global_steps = None
        self.awake = True
        self._queue: list[tuple[dict, asyncio.Future]] = []
        self._draining = False
        self._lock = asyncio.Lock()
        # Per-sample RNG streams (opd_patches/ops/seeded_sampling.py): a resumed step samples the same tokens.
        self._sample_keys = SampleKeys()
        self.seed = int(getattr(config, "seed", 0) or 0)
        self.batch_invariant = bool(getattr(config, "full_determinism", False))

    def get_server_address(self):
        return f"hf-replica-{self.replica_rank}", 0

    # ---- generation -----------------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data=None,
        video_data=None,
        **kwargs,
    ) -> TokenOutput:
        if image_data is not None or video_data is not None:
            raise NotImplementedError("The hf rollout backend serves text-only models.")
        request = {"prompt_ids": [int(t) for t in prompt_ids], **self._resolve(dict(sampling_params), len(prompt_ids))}
        # The replica is part of the key: the samples of one prompt that other replicas serve must
        # get other streams (each replica counts occurrences on its own).
        key = f"r{self.replica_rank}:{self._sample_keys.key(self.global_steps, request['prompt_ids'])}"
        request["sample_seed"] = sample_seed(self.seed, self.global_steps, key)
        future = asyncio.get_running_loop().create_future()
        self._queue.append((request, future))
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    def _resolve(self, params: dict, prompt_len: int) -> dict:
        """Sampling parameters as vLLM would apply them (max_tokens bounded by the context)."""
        cfg = self.config
        # As VERL's vLLM server: max_model_len defaults to the model's max_position_embeddings.
        room = (cfg.max_model_len or self.model.config.max_position_embeddings) - prompt_len
        max_tokens = params.pop("max_tokens", params.pop("max_new_tokens", None))
        if max_tokens is None:
            max_tokens = min(cfg.response_length, cfg.prompt_length + cfg.response_length - prompt_len)
        if room < 1:
            raise ValueError(f"Prompt length {prompt_len} leaves no room to generate within max_model_len.")
        temperature = float(params.get("temperature", 1.0))
        top_k = int(params.get("top_k", -1) or -1)
        return {
            "max_tokens": max(1, min(int(max_tokens), room)),
            "temperature": temperature,
            "top_p": float(params.get("top_p", 1.0)),
            "top_k": top_k if top_k > 0 else None,
            "logprobs": bool(params.get("logprobs")),
            "prompt_logprobs": params.get("prompt_logprobs"),
            "ignore_eos": bool(params.get("ignore_eos", cfg.ignore_eos)),
            "repetition_penalty": float(params.get("repetition_penalty", cfg.repetition_penalty)),
            "stop_token_ids": tuple(params.get("stop_token_ids") or ()),
        }

    async def _drain(self):
        try:
            while self._queue:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + BATCH_MAX_WAIT_S
                while True:
                    seen = len(self._queue)
                    await asyncio.sleep(BATCH_WINDOW_S)
                    if len(self._queue) == seen or len(self._queue) >= self.config.max_num_seqs or loop.time() >= deadline:
                        break
                batch, self._queue = self._queue[: self.config.max_num_seqs], self._queue[self.config.max_num_seqs :]
                groups = defaultdict(list)
                for req, fut in batch:
                    key = tuple((k, v) for k, v in req.items() if k not in ("prompt_ids", "max_tokens", "sample_seed"))
                    groups[key].append((req, fut))
                # full_determinism (VERL's batch-invariance switch, as VLLM_BATCH_INVARIANT for vLLM): one
                # request per generate(), so that a sample's logits do not depend on which requests happened
                # to arrive together (batch size and padding change the float reductions' order).
                chunks = [[it] for items in groups.values() for it in items] if self.batch_invariant else groups.values()
                for items in chunks:
                    async with self._lock:
                        try:
                            outs = await asyncio.to_thread(self._run_group, [r for r, _ in items])
                        except Exception as exc:  # surface the error in every waiting request
                            for _, fut in items:
                                fut.set_exception(exc)
                            continue
                    for (_, fut), out in zip(items, outs, strict=True):
                        fut.set_result(out)
        finally:
            self._draining = False

    @torch.no_grad()
    def _run_group(self, reqs: list[dict]) -> list[TokenOutput]:
        if not self.awake:
            raise RuntimeError("hf rollout server asked to generate while asleep (weights offloaded)")
        p = reqs[0]
        extra = {"global_steps": self.global_steps}
        if p["prompt_logprobs"] is not None:
            outs = []
            for r in reqs:
                ids = torch.tensor(r["prompt_ids"], device=self.device)
                lps, tops = prompt_logprobs(self.model, ids, int(r["prompt_logprobs"]))
                # vLLM also returns max_tokens generated tokens; the teacher loop ignores them.
                nxt = self.model(input_ids=ids[None]).logits[0, -1].argmax().item()
                outs.append(
                    TokenOutput(
                        token_ids=[nxt],
                        stop_reason="completed",
                        extra_fields={**extra, "prompt_logprobs": lps, "prompt_ids": tops},
                    )
                )
            return outs
        return self._sample(reqs, extra)

    def _sample(self, reqs: list[dict], extra: dict) -> list[TokenOutput]:
        p = reqs[0]
        width = max(len(r["prompt_ids"]) for r in reqs)
        # Left padding keeps every prompt's last token at the same position for decoding.
        input_ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            n = len(r["prompt_ids"])
            input_ids[i, width - n :] = torch.tensor(r["prompt_ids"])
            attention[i, width - n :] = 1
        # As in vLLM, ignore_eos disregards only the EOS tokens: explicit stop_token_ids still stop.
        stop_ids = list(dict.fromkeys(([] if p["ignore_eos"] else self.eos_ids) + list(p["stop_token_ids"])))
        greedy = p["temperature"] <= 0
        max_new = max(r["max_tokens"] for r in reqs)
        # Sampling draws from per-sample generators (Gumbel-max), hence do_sample=False with the sampler.
        sampler = None if greedy else SeededSampler([r["sample_seed"] for r in reqs], p["temperature"], p["top_p"], p["top_k"])
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention.to(self.device),
            max_new_tokens=max_new,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            logits_processor=None if greedy else LogitsProcessorList([sampler]),
            eos_token_id=stop_ids or None,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            # Explicit, so that a repetition_penalty in the model's generation_config.json is not applied
            # behind VERL's back (vLLM uses the request's value, default 1.0).
            repetition_penalty=p["repetition_penalty"],
            output_logits=p["logprobs"] and not self.processed_logprobs,
            output_scores=p["logprobs"] and self.processed_logprobs and greedy,
        )
        new = out.sequences[:, width:].cpu()
        logp = None
        if p["logprobs"]:
            # rollout.logprobs_mode as in vLLM: processed = after temperature/top-k/top-p (generate's
            # scores, filtered tokens at -inf), raw = the model's own distribution (its logits).
            if not self.processed_logprobs:
                steps = out.logits
            else:  # the sampler's scores exclude its noise
                steps = out.scores if sampler is None else sampler.processed
            logits = torch.stack(steps, dim=1).float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, new[:, : logits.shape[1], None].to(logits.device))
            logp = logp[..., 0].cpu()
        results = []
        for i, r in enumerate(reqs):
            toks = new[i, : r["max_tokens"]].tolist()
            for j, t in enumerate(toks):
                if t in stop_ids:
                    toks = toks[: j + 1]
                    break
            results.append(
                TokenOutput(
                    token_ids=toks,
                    log_probs=logp[i, : len(toks)].tolist() if logp is not None else None,
                    stop_reason="completed",
                    extra_fields=dict(extra),
                )
            )
        return results

    # ---- weights and memory ---------------------------------------------------------------
    async def update_weights(self, named_tensors: dict[str, torch.Tensor], global_steps: Optional[int] = None):
        async with self._lock:
            own = self.model.state_dict()
            unknown = sorted(set(named_tensors) - set(own))
            if unknown:
                raise KeyError(f"hf rollout: weights not in the rollout model: {unknown[:5]}")
            missing = set(own) - set(named_tensors)
            tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
            if missing - tied:
                raise KeyError(f"hf rollout: weight update lacks {sorted(missing - tied)[:5]}")
            self.model.load_state_dict(named_tensors, strict=False)
            if global_steps is not None:
                self.global_steps = global_steps
        # Tests read this line to see that every step's weights reached the rollout.
        print(f"[hf rollout] replica {self.replica_rank}: loaded {len(named_tensors)} tensors "
              f"for step {global_steps}", flush=True)
        return len(named_tensors)

    async def wake_up(self, tags: list[str] | None = None):
        if not self.awake:
            self.model.to(self.device)
            self.awake = True

    async def sleep(self):
        # On a GPU shared with training, hand the memory back between rollouts.
        if self.device.type == "cuda" and self.config.free_cache_engine:
            async with self._lock:
                self.model.to("cpu")
                torch.cuda.empty_cache()
                self.awake = False

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    async def state_dict_checksum(self) -> float:
        """Sum of all parameters: lets tests check that weight updates arrived."""
        return float(sum(p.double().sum().item() for p in self.model.parameters()))

    async def wait_for_requests_to_drain(self):
        while self._queue or self._draining:
            await asyncio.sleep(BATCH_WINDOW_S)

    # Nothing to do for a cache-less backend; present because VERL calls them on every replica.
    async def clear_kv_cache(self):
        pass

    async def release_kv_cache(self):
        pass

    async def resume_kv_cache(self):
        pass

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False):
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self):
        pass

    async def start_profile(self, **kwargs):
        pass

    async def stop_profile(self):
        pass


class HFReplica(RolloutReplica):
    """Places one `HFServer` on the node (and GPU) of the replica's first worker."""

    async def launch_servers(self):
        from verl.plugin.platform import get_platform
        from verl.utils.device import get_resource_name

        if self.world_size != 1:
            raise ValueError(
                "The hf rollout backend runs one model per replica: set tensor_model_parallel_size, "
                f"data_parallel_size and pipeline_model_parallel_size to 1 (world size is {self.world_size})."
            )
        node_id, device = await self.workers[0].__ray_call__.remote(
            lambda self: (
                ray.get_runtime_context().get_node_id(),
                ray.get_runtime_context().get_accelerator_ids()[get_resource_name()][0],
            )
        )
        role = "_teacher" if self.is_teacher_model else "_reward" if self.is_reward_model else ""
        server = (
            ray.remote(HFServer)
            .options(
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_id, soft=False
                ),
                runtime_env={"env_vars": {v: "1" for v in get_platform().ray_noset_envvars()}},
                name=server_name(self.replica_rank, 0, role, self.name_suffix),
                max_concurrency=self.max_concurrency,
                num_cpus=0,
            )
            .remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank,
                    cuda_visible_devices=str(device))
        )
        address, port = await server.get_server_address.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{address}:{port}"


class HFServerAdapter(BaseRollout):
    """Inside the training worker: pushes the actor's weights to this rank's `HFServer`."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", 0))
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.is_leader = rank % world == 0
        self._server = None

    @property
    def server(self):
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        if self.is_leader and "weights" in tags:
            await self.server.wake_up.remote(tags)

    async def release(self):
        if self.is_leader:
            await self.server.sleep.remote()

    async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps=None, **kwargs):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"hf rollout receives full named tensors, not {wire_format!r}")
        state = {}
        for name, tensor in weights:
            if hasattr(tensor, "full_tensor"):  # a DTensor shard: every rank must join the gather
                tensor = tensor.full_tensor()
            if self.is_leader:
                state[name] = tensor.detach().to("cpu", copy=True)
        if self.is_leader:
            await self.server.update_weights.remote(state, global_steps)
