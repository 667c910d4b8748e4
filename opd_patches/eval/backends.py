"""Generation backends for evaluation: `hf` (transformers, any device) and `vllm` (when importable).

Both take chat-rendered prompt TEXTS and return one `Completion` per prompt; they tokenize the prompt
themselves WITHOUT adding special tokens (the chat template already holds the BOS a model wants, as
in VERL's own tokenization), and decode the response with special tokens skipped (`<think>` and
`</think>` are ordinary added tokens in R1-Distill tokenizers, so they stay in the text).

Seeds: every (question, sample) pair has its own seed (`sample_seed`). vLLM uses it per request,
so a sample does not depend on what else is in the batch. The HF backend seeds torch's global
generator with the first seed of each batch: reproducible for the same batches (same `--batch-size`,
same resume point), not bit-identical to vLLM.

`finish_reason` is "length" when the response hit `max_new_tokens` without an EOS (truncated), else
"stop".
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import time

from opd_patches.eval.completion import Completion

__all__ = ["Completion", "HFBackend", "make_backend", "sample_seed", "vllm_available"]

def sample_seed(seed: int, question_id: str, sample: int) -> int:
    digest = hashlib.sha256(f"{seed}:{question_id}:{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def vllm_available() -> bool:
    """vLLM installed and a GPU visible, found without a CUDA call in this process.

    Not `torch.cuda.is_available()`: it calls cudaGetDeviceCount, which marks the process so that a
    forked child fails with "Cannot re-initialize CUDA in forked subprocess" (vLLM's engine process,
    docs/evaluation.md); `torch.cuda.device_count()` asks NVML and leaves the process clean (torch's docs).
    """
    try:
        if "vllm" not in sys.modules and importlib.util.find_spec("vllm") is None:
            return False
        import torch
    except Exception:  # noqa: BLE001  (a broken install raises more than ImportError)
        return False
    return torch.cuda.device_count() > 0


def make_backend(name: str, model: str, max_model_len: int, batch_size: int | None = None, seed: int = 0,
                 gpu_memory: float | None = None):
    """`name` "auto" picks vllm when importable with a CUDA device, else hf. `gpu_memory`: vLLM's
    share of the GPU (default: sized from the memory free at its start)."""
    if name == "auto":
        name = "vllm" if vllm_available() else "hf"
    if name == "hf":
        return HFBackend(model, batch_size=batch_size)
    if name == "vllm":
        from opd_patches.eval.vllm_backend import VLLMBackend

        return VLLMBackend(model, max_model_len=max_model_len, batch_size=batch_size, seed=seed, gpu_memory=gpu_memory)
    raise ValueError(f"unknown backend {name!r}: hf, vllm or auto")


class HFBackend:
    """transformers `generate` on one device, left-padded batches of `batch_size` prompts."""

    name = "hf"

    def __init__(self, model: str, batch_size: int | None = None, device: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.torch = torch
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # bf16 on CUDA as vLLM serves R1-Distill; fp32 on the CPU, where bf16 is slow.
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(self.device).eval()
        try:
            gen = GenerationConfig.from_pretrained(model)
        except OSError:
            gen = GenerationConfig.from_model_config(self.model.config)
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_ids = list(dict.fromkeys(eos))
        if not self.eos_ids:
            raise ValueError(f"{model}: no eos_token_id in generation_config.json, config.json or the tokenizer")
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.batch_size = batch_size or (32 if self.device.type == "cuda" else 8)
        self.description = f"hf ({self.device.type}, {str(dtype).removeprefix('torch.')}, batch {self.batch_size})"

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def generate(self, prompts, max_new_tokens, temperature, top_p, seeds) -> list[Completion]:
        out = []
        for start in range(0, len(prompts), self.batch_size):
            end = start + self.batch_size
            out += self._batch(prompts[start:end], max_new_tokens, temperature, top_p, seeds[start])
        return out

    def measure_tokens_per_second(self, prompt: str, n_tokens: int = 16) -> float:
        """Decode throughput of one full batch (short context: real long responses decode slower)."""
        self._batch([prompt] * self.batch_size, 2, 1.0, 1.0, 0, min_new=2)  # warm-up
        start = time.perf_counter()
        self._batch([prompt] * self.batch_size, n_tokens, 1.0, 1.0, 0, min_new=n_tokens)
        return self.batch_size * n_tokens / (time.perf_counter() - start)

    def _batch(self, prompts, max_new_tokens, temperature, top_p, seed, min_new=0) -> list[Completion]:
        torch = self.torch
        ids = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        width = max(map(len, ids))
        room = self.max_positions - width
        if room < 1:
            raise ValueError(f"a prompt of {width} tokens leaves no room within max_position_embeddings {self.max_positions}")
        max_new = min(max_new_tokens, room)
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(ids), width), dtype=torch.long)
        for i, row in enumerate(ids):  # left padding: every prompt ends at the same position
            input_ids[i, width - len(row):] = torch.tensor(row)
            attention[i, width - len(row):] = 1
        greedy = temperature <= 0
        torch.manual_seed(seed)
        with torch.no_grad():
            seqs = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                max_new_tokens=max_new,
                min_new_tokens=min_new or None,
                do_sample=not greedy,
                temperature=None if greedy else temperature,
                top_p=None if greedy else top_p,
                top_k=None if greedy else 0,  # 0: no top-k cut, whatever generation_config.json says
                repetition_penalty=1.0,  # explicit, as vLLM's default; a model's config may set one
                eos_token_id=self.eos_ids,
                pad_token_id=self.pad_id,
            )
        results = []
        for row in seqs[:, width:].cpu().tolist():
            stop = next((j for j, t in enumerate(row) if t in self.eos_ids), None)
            tokens = row if stop is None else row[:stop]
            finish = "length" if stop is None and len(row) >= max_new else "stop"
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            results.append(Completion(text, len(tokens) + (stop is not None), finish))
        return results
