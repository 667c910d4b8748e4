"""The vLLM evaluation backend (GPU hosts with vLLM installed; `opd_patches.eval.backends` picks it).

One offline `vllm.LLM` engine; `generate` submits every prompt of a chunk at once (vLLM schedules its
own continuous batches) with one `SamplingParams` per prompt carrying that sample's seed, so results do
not depend on batching or on where a resumed run restarted. The harness hands it chunks of
`batch_size` (default 1,024) prompts and writes each chunk's results before the next, which bounds what
an interruption loses. Prompts go in as token ids (no special tokens added: the chat template has the
BOS), as in VERL's vLLM rollout. `tensor_parallel_size` is `$OPD_EVAL_TP` (default 1);
`gpu_memory_utilization` is sized from the memory free at the engine's start
(`opd_patches.eval.gpu_memory`), unless given (`--gpu-memory-utilization`, `$OPD_EVAL_GPU_MEM`).
Compilation as the training rollout's (`ROLLOUT_COMPILATION` = recipes/device/gpu.yaml's: vLLM's torch.compile
mode with full graphs for decode and piecewise ones for mixed batches), pinned so that a newer vLLM's default
does not change what is evaluated.

With `--verifier`, the judge's engine starts after the evaluated model's is deleted; vLLM does not
always hand all GPU memory back within one process, and the judge's share is sized from what is left.

Start method: vLLM runs its engine core in a child process, forked unless
`VLLM_WORKER_MULTIPROC_METHOD=spawn`, and forces spawn itself only when `torch.cuda.is_initialized()`.
A process that merely called `torch.cuda.is_available()` (cudaGetDeviceCount) is not "initialized" but
its forked children cannot use CUDA: the engine died with "Cannot re-initialize CUDA in forked
subprocess" (docs/evaluation.md). So the backend sets `VLLM_WORKER_MULTIPROC_METHOD=spawn` before vLLM is
imported, unless the user set the variable; spawn re-imports the main module in the child, so a
script that builds this backend needs the `if __name__ == "__main__":` guard (`python -m
opd_patches.eval` has it). The evaluation process itself makes no CUDA call before the engine starts
(`backends.vllm_available` asks NVML); tests/test_eval_vllm_start.py checks both on CPU with a
stand-in `vllm` module. Otherwise not exercised by the CPU test suite (no vLLM there).
"""

from __future__ import annotations

import os

from opd_patches.eval.completion import Completion
from opd_patches.eval.gpu_memory import engine_share as gpu_memory_share
from opd_patches.eval.gpu_memory import explicit_share

START_METHOD_VAR = "VLLM_WORKER_MULTIPROC_METHOD"
ROLLOUT_COMPILATION = {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}  # = recipes/device/gpu.yaml


class VLLMBackend:
    name = "vllm"

    def __init__(self, model: str, max_model_len: int, batch_size: int | None = None, seed: int = 0,
                 gpu_memory: float | None = None):
        os.environ.setdefault(START_METHOD_VAR, "spawn")  # before vLLM reads its env: see the docstring
        tp = int(os.environ.get("OPD_EVAL_TP", "1"))
        share, how = gpu_memory_share(model, max_model_len, tp, explicit_share(gpu_memory))
        print(f"[eval] vllm: {how}", flush=True)
        from vllm import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        self.llm = LLM(
            model=model,
            dtype="auto",
            seed=seed,
            max_model_len=max_model_len,
            tensor_parallel_size=tp,
            gpu_memory_utilization=share,
            enable_prefix_caching=True,  # the samples of one question share their prompt
            compilation_config=dict(ROLLOUT_COMPILATION),  # a copy: vLLM fills in what it is given
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.batch_size = batch_size or 1024
        self.gpu_memory_utilization = share
        self.description = f"vllm (tensor parallel {tp}, chunks of {self.batch_size}, {how})"

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def generate(self, prompts, max_new_tokens, temperature, top_p, seeds) -> list[Completion]:
        params = [
            self.SamplingParams(n=1, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=s,
                                skip_special_tokens=True)
            for s in seeds
        ]
        inputs = [{"prompt_token_ids": self.tokenizer(p, add_special_tokens=False).input_ids} for p in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        results = []
        for out in outputs:  # vLLM returns outputs in input order
            c = out.outputs[0]
            results.append(Completion(c.text, len(c.token_ids), "length" if c.finish_reason == "length" else "stop"))
        return results
