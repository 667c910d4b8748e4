"""How much of the GPU the vLLM evaluation engine asks for, sized from what is free when it starts.

vLLM takes `gpu_memory_utilization` as a share of the card's total memory and refuses to start when
less than that share is free. A fixed share fails wherever something else still holds memory (a
training run that has just ended, a second engine, another user), although the evaluation of one
small model needs far less. So the share is read from the device at the engine's start:

    share = min(DEFAULT_SHARE, (free - ENGINE_CONTEXT) / total)

ENGINE_CONTEXT covers the CUDA context that vLLM's engine process creates before it compares, so the
share it asks for is still free when it looks. An explicit share (`--gpu-memory-utilization`, or
`$OPD_EVAL_GPU_MEM`) wins. Before the engine starts, the free memory is compared with what one sequence
of the protocol's length needs (the weights, the KV cache of `max_model_len` tokens, and the engine's
own activations, sampler and CUDA graphs, `ENGINE_OVERHEAD`); below that the evaluation stops with one
line naming free, needed and the processes holding the rest, instead of a vLLM traceback minutes later.

Everything is read through NVML (`pynvml`, which vLLM depends on): a CUDA call in this process would
break vLLM's forked engine process (see `opd_patches.eval.vllm_backend`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1024**3
DEFAULT_SHARE = 0.9  # vLLM's own default
ENGINE_CONTEXT = int(1.5 * GIB)  # the engine process's CUDA context, and the driver's reserve that NVML counts as free and CUDA does not
ENGINE_OVERHEAD = 3 * GIB  # profile-run activations, the sampler's logits and the decode graphs of a small model
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class NotEnoughGPUMemory(RuntimeError):
    """Less is free on the device than one sequence of the protocol needs."""


@dataclass
class Holder:
    pid: int
    name: str
    used: int  # bytes


@dataclass
class Reading:
    index: int  # NVML index of the device
    free: int
    total: int
    holders: list[Holder] = field(default_factory=list)


def visible_devices(count: int = 1) -> list[str]:
    """The first `count` devices this process would use, as NVML indices or UUIDs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(count)]
    return names[:count]


def process_name(pid: int) -> str:
    """The command line of `pid`, shortened (a process of another container or user has none here)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "(another container or user)"
    return " ".join(a.decode(errors="replace") for a in argv if a)[:120] or "?"


def read(device: str) -> Reading:
    """Free and total memory of one device, with the processes that hold memory on it (NVML)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = (pynvml.nvmlDeviceGetHandleByIndex(int(device)) if device.isdigit()
                  else pynvml.nvmlDeviceGetHandleByUUID(device))
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        holders = [Holder(p.pid, process_name(p.pid), int(p.usedGpuMemory or 0)) for p in procs]
        return Reading(pynvml.nvmlDeviceGetIndex(handle), int(info.free), int(info.total), holders)
    finally:
        pynvml.nvmlShutdown()


def model_config(model: str) -> dict | None:
    """The model's config.json as a dict (a local folder, or a hub id already in the local cache)."""
    path = Path(model) / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model, local_files_only=True).to_dict()
    except Exception:  # noqa: BLE001  (not resolvable offline: no estimate, vLLM decides)
        return None


def weight_bytes(model: str) -> int | None:
    """Bytes of the stored weights: the safetensors files of a local folder, else none known."""
    files = list(Path(model).glob("*.safetensors")) if Path(model).is_dir() else []
    return sum(f.stat().st_size for f in files) if files else None


def kv_bytes(config: dict, tokens: int) -> int:
    """Key and value cache of `tokens` tokens in every layer, in the model's dtype."""
    text = config.get("text_config") or config
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    kv_heads = text.get("num_key_value_heads") or heads
    dtype = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return 2 * text["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 2) * tokens


def needed_bytes(model: str, max_model_len: int, tensor_parallel: int = 1) -> int | None:
    """What one device needs for one sequence of `max_model_len` tokens; None when it cannot be told."""
    config = model_config(model)
    weights = weight_bytes(model)
    if config is None or weights is None:
        return None
    return (weights + kv_bytes(config, max_model_len)) // tensor_parallel + ENGINE_OVERHEAD


def share(free: int, total: int, needed: int | None, explicit: float | None = None) -> float:
    """The `gpu_memory_utilization` to ask for; raises NotEnoughGPUMemory below `needed`."""
    if explicit is not None:
        return explicit
    if needed is not None and free - ENGINE_CONTEXT < needed:
        raise NotEnoughGPUMemory(f"{free / GIB:.1f} GiB free, {needed / GIB:.1f} GiB needed")
    return round(min(DEFAULT_SHARE, (free - ENGINE_CONTEXT) / total), 4)


def explicit_share(value: float | str | None = None) -> float | None:
    """The user's share: the argument, else $OPD_EVAL_GPU_MEM, else None (size it from free memory)."""
    raw = value if value is not None else os.environ.get("OPD_EVAL_GPU_MEM")
    if raw is None or raw == "":
        return None
    got = float(raw)
    if not 0 < got <= 1:
        raise ValueError(f"gpu memory share {raw!r} (--gpu-memory-utilization / OPD_EVAL_GPU_MEM): a number in (0, 1]")
    return got


def engine_share(model: str, max_model_len: int, tensor_parallel: int = 1, explicit: float | None = None,
                 reader=read) -> tuple[float, str]:
    """The share for the engine's start on the devices it will use, and one line saying how it was chosen."""
    if explicit is not None:
        return explicit, f"gpu_memory_utilization {explicit} (set explicitly)"
    try:
        readings = [reader(d) for d in visible_devices(tensor_parallel)]
    except Exception as exc:  # noqa: BLE001  (no NVML here: vLLM's own check still applies)
        return DEFAULT_SHARE, f"gpu_memory_utilization {DEFAULT_SHARE} (free memory not readable: {exc!r})"
    tightest = min(readings, key=lambda r: r.free / r.total)
    needed = needed_bytes(model, max_model_len, tensor_parallel)
    try:
        got = share(tightest.free, tightest.total, needed)
    except NotEnoughGPUMemory as exc:
        others = ", ".join(f"pid {h.pid} {h.used / GIB:.1f} GiB ({h.name})" for h in tightest.holders) or "none listed"
        raise NotEnoughGPUMemory(
            f"GPU {tightest.index}: {exc} for one {max_model_len:,}-token sequence of {model} (weights, KV cache, "
            f"engine); held by: {others}. Free the GPU or pass --gpu-memory-utilization to override.") from None
    need = "unknown" if needed is None else f"{needed / GIB:.1f} GiB"
    return got, (f"gpu_memory_utilization {got} of {tightest.total / GIB:.1f} GiB (GPU {tightest.index}: "
                 f"{tightest.free / GIB:.1f} GiB free at start, one sequence needs {need})")
