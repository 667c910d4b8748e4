"""The `cpu` platform: lets the real VERL trainer run on machines without an accelerator.

Selected with `VERL_PLATFORM=cpu` (run.sh sets it when no NVIDIA GPU is visible). Ray still
schedules workers on the resource named `GPU`: the launcher declares logical GPUs with
`+ray_kwargs.ray_init.num_gpus=N`, so VERL's placement logic runs unchanged.
"""

import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Optional

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

from opd_patches.config import CPU_DTYPES


class _CPUDeviceModule(ModuleType):
    """Stands in for `torch.cuda` where VERL calls `get_torch_device().<fn>()`."""

    def __init__(self):
        super().__init__("opd_patches.platforms.cpu_device")

    def __getattr__(self, name):
        # Memory queries, cache control and synchronisation have no meaning on the host.
        if name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
            return lambda *a, **k: 0
        if name == "mem_get_info":
            return lambda *a, **k: (0, 0)
        if name in ("is_available",):
            return lambda: True
        if name == "device_count":
            return lambda: 1
        if name == "current_device":
            return lambda: 0
        return getattr(torch.cpu, name, lambda *a, **k: None)

    def get_device_name(self, *a, **k):
        return "CPU"  # flops_counter looks the name up in its table; "CPU" is a known key

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def get_rng_state(self, *a, **k):
        return torch.get_rng_state()

    def set_rng_state(self, state, *a, **k):
        torch.set_rng_state(state)


_DEVICE_MODULE = _CPUDeviceModule()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """Host CPU as VERL's device; collectives over gloo."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        # Never auto-detected: the CPU path is chosen explicitly with VERL_PLATFORM=cpu.
        return False

    def current_device(self):
        # VERL moves modules with `.to(get_device_id())`; an int would mean cuda:<int>.
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: Optional[int] = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def selected() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"


COMPUTE_DTYPES = CPU_DTYPES  # opd.cpu_dtype's values
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16", "sve_bf16")  # x86 (AMX, AVX512), Arm (NEON, SVE)


def native_bf16() -> tuple[bool, str]:
    """Whether torch runs bf16 maths natively on this CPU, and why (for the launch line).

    Native: the CPU has bf16 dot-product instructions and oneDNN may use them (torch's bf16 matmuls go
    through oneDNN only then; otherwise they take a fallback far slower than fp32). oneDNN's check also
    sees an ISA cap such as ONEDNN_MAX_CPU_ISA, which every process of the run inherits alike."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    flags = [flag for flag in BF16_FLAGS if caps.get(flag)]
    if not flags:
        return False, "this CPU has no native bf16"
    try:
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        onednn = False
    if not onednn:
        why = f"this CPU has {flags[0]}, but oneDNN does not use it"
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
        return False, f"{why}: ISA capped at {cap}" if cap else why
    return True, f"native bf16 on this CPU: {flags[0]}"


def compute_dtype(choice) -> tuple[str, str]:
    """The training engines' compute dtype on the CPU for recipe value `choice` (opd.cpu_dtype), and why.
    auto: bfloat16 (upstream's mixed precision) where bf16 is native, else float32."""
    choice = "auto" if choice is None else str(choice)
    if choice not in COMPUTE_DTYPES:
        raise ValueError(f"opd.cpu_dtype={choice!r}: use one of {', '.join(COMPUTE_DTYPES)}.")
    if choice != "auto":
        return choice, f"opd.cpu_dtype={choice}"
    native, why = native_bf16()
    return ("bfloat16" if native else "float32"), why


if selected():
    # VERL registers its FSDP engine for cuda/npu only; the engine code itself is device-agnostic
    # (it asks the platform for the device), so look it up under "cuda".
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
