"""Timing and peak memory, the way the floors of docs/performance.md were measured: one warm-up, then wall time
around fully synchronised runs; peak = torch.cuda.max_memory_allocated after a reset (CUDA only)."""

import gc
import statistics
import time

import torch

GIB = 2**30


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, device, repeats=1, warmup_fn=None) -> dict:
    """{"time_s": median seconds of fn(), "peak_gib": peak allocated during the timed runs (None on CPU),
    "resident_gib": allocated before them}. warmup_fn (default fn) runs once first, untimed."""
    device = torch.device(device)
    (warmup_fn or fn)()
    _sync(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = base_gib = None
    if device.type == "cuda":
        peak, base_gib = torch.cuda.max_memory_allocated(device) / GIB, base / GIB
    return {"time_s": statistics.median(times), "peak_gib": peak, "resident_gib": base_gib}


def row(name, real, ref, tokens, **extra) -> dict:
    """One result row: the real path, its reference, their ratios and throughput."""
    ratio = real["time_s"] / ref["time_s"] if ref and ref["time_s"] else None
    peak_ratio = (real["peak_gib"] / ref["peak_gib"]) if ref and real["peak_gib"] and ref["peak_gib"] else None
    return {
        "name": name, "tokens": tokens,
        "time_s": real["time_s"], "tok_per_s": tokens / real["time_s"], "peak_gib": real["peak_gib"],
        "ref_time_s": ref["time_s"] if ref else None, "ref_peak_gib": ref["peak_gib"] if ref else None,
        "ratio": ratio, "peak_ratio": peak_ratio, **extra,
    }
