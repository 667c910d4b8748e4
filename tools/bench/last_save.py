"""Bench phase `lastsave`: a run's last save as the trainer waits for it, and what the host does meanwhile.

    python -m tools.bench --phase lastsave [--workdir DIR] [--rounds N]   (make bench PHASE=lastsave)

The last save of a run (final step or wall clock) is finished in the trainer's process (opd_patches/trainers/opd_sync.py): the
trainer waits for upstream's save (with opd.background_state_write: the state's host snapshot) and then for
the whole finish (ops/finish.py: the state's writes, the HF export built from them, its validation in a CPU
child, the hashes, the receipt). This phase makes exactly those two calls on the size's model (fp32 under
FSDP2, AdamW after one step, the embedded tokenizer), without Ray or vLLM:
- `lastsave/first`: the first save of the process (it page-locks the snapshot's memory, once per process);
- then `--rounds` saves as every later one (`with_finish`: the validating child started by the finish, as the
  trainer's last save does).
Each row: `time_s` the trainer's wait (ratio against the first `with_finish` round); the finish's parts and
the validation's stages (with the child's start and exit); over the finish, the host's peaks of dirty and
under-writeback page cache, file pages read again after eviction (`workingset_refault_file`), major faults
and block reads (/proc/meminfo, /proc/vmstat; Linux); `idle_validation_s`: the same export validated again by
a fresh child with nothing beside it. A note gives the disk's write rate (4 GiB written and fsynced; 64 MiB
at the cpu size). Every state is deleted after its row.
"""

import os
import shutil
import threading
import time
from pathlib import Path

from tools.bench import save
from tools.bench.measure import row
from opd_patches.ops import finish, state_writer
from opd_patches.patches import fsdp_save_checkpoint

MEMINFO = ("Dirty", "Writeback", "MemAvailable")
VMSTAT = ("workingset_refault_file", "pgmajfault", "pgpgin")


def _counters() -> dict:
    """Page-cache state and cumulative counters of the host (bytes for /proc/meminfo; {} off Linux)."""
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            if key in MEMINFO:
                out[key] = int(value.split()[0]) * 1024
        for line in Path("/proc/vmstat").read_text().splitlines():
            key, value = line.split()
            if key in VMSTAT:
                out[key] = int(value)
    except OSError:
        return {}
    return out


class _Sampler(threading.Thread):
    """Samples `_counters` until stopped: peaks of Dirty and Writeback, the lowest MemAvailable, counter deltas."""

    def __init__(self):
        super().__init__(name="lastsave-sampler", daemon=True)
        self.first, self.peaks, self.done = _counters(), {}, threading.Event()

    def run(self):
        while True:
            now = _counters()
            for key in ("Dirty", "Writeback"):
                self.peaks[key] = max(self.peaks.get(key, 0), now.get(key, 0))
            if "MemAvailable" in now:
                self.peaks["MemAvailable"] = min(self.peaks.get("MemAvailable", now["MemAvailable"]), now["MemAvailable"])
            if self.done.wait(0.25):
                return

    def stop(self) -> dict:
        self.done.set()
        self.join()
        last = _counters()
        out = {f"peak_{k.lower()}_gb": round(v / 1e9, 2) for k, v in self.peaks.items() if k != "MemAvailable"}
        if "MemAvailable" in self.peaks:
            out["min_memavailable_gb"] = round(self.peaks["MemAvailable"] / 1e9, 2)
        out.update({f"{k}_delta": last[k] - self.first[k] for k in VMSTAT if k in last and k in self.first})
        return out


def _disk_write_gbps(workdir: Path, gib: float) -> float:
    """Write `gib` GiB of zeros in 64 MiB writes, fsync, delete: the disk's sustained write rate."""
    path, block = workdir / "lastsave_disk_probe", bytes(64 << 20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, round(gib * 16))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    rate = gib * 2**30 / 1e9 / (time.perf_counter() - start)
    path.unlink()
    return rate


def _settle() -> None:
    """Let the previous round's writeback drain, so that each round starts from the same host state."""
    os.sync()
    time.sleep(2)


def run_phase(size, args) -> dict:
    from verl.utils.checkpoint import fsdp_checkpoint_manager as module
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    from opd_patches.ops import receipts

    device = size.device
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    runs = workdir / "bench_lastsave"
    shutil.rmtree(runs, ignore_errors=True)
    runs.mkdir()
    save._process_group(device, workdir)
    model, optim = save._model(size, device)
    save._step(model, optim, device, model.config.vocab_size)
    params = sum(p.numel() for p in model.parameters())
    tokenizer = _tokenizer(size)
    gen = runs / "generation_config"  # upstream saves the generation config of the model's name_or_path
    from transformers import GenerationConfig

    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(gen)
    model.config._name_or_path = str(gen)
    manager = FSDPCheckpointManager(model, optim, processing_class=tokenizer,
                                    checkpoint_config=save._contents("model", "optimizer", "extra"))
    rounds = ["first", *["with_finish"] * args.rounds]
    rows, ref, state_gb = [], None, None
    pinned, state_writer.PINNED = state_writer.PINNED, device == "cuda"
    for step, variant in enumerate(rounds, start=1):
        state = runs / f"global_step_{step}"
        _settle()
        sampler = _Sampler()
        sampler.start()
        save._sync(device)
        start = time.perf_counter()
        with fsdp_save_checkpoint.deferred_saves(module, state_writer._Writer()):
            manager.save_checkpoint(str(state / "actor"), global_step=step)
        save._sync(device)
        called = time.perf_counter() - start
        out = finish.finish(state, step, validate=True, expected_params=params, build_export=True)
        waited = time.perf_counter() - start
        host = sampler.stop()
        if "error" in out:
            raise RuntimeError(f"lastsave round {variant}: the finish failed: {out['error']}")
        validation = out["validation"]
        idle = finish.validate_export(state / receipts.HF_EXPORT, params, 600)
        ref = waited if ref is None and variant == "with_finish" else ref
        name = f"lastsave/{variant}" if variant == "first" else f"lastsave/{variant}#{step - 1}"
        rows.append(row(name, {"time_s": waited, "peak_gib": None}, ref and {"time_s": ref, "peak_gib": None}, 0,
                        upstream_call_s=called, **{k: round(out[k], 3) for k in
                                                   ("write_wait_s", "export_s", "validate_s", "hash_s", "state_hashed_s")},
                        validation_ok=validation["ok"], validation_s=validation.get("seconds"),
                        idle_validation_ok=idle["ok"], idle_validation_s=idle.get("seconds"), **host))
        print(f"[bench] {name}: waited {waited:.1f} s (upstream's call {called:.1f} s, finish {out['seconds']:.1f} s: "
              f"export {out['export_s']:.1f}, validation {out['validate_s']:.1f} {validation.get('seconds')}, "
              f"state hashed by {out['state_hashed_s']:.1f}); idle validation {idle.get('seconds')}; host {host}",
              flush=True)
        state_gb = state_gb or save._bytes(state) / 1e9
        shutil.rmtree(state)
    state_writer.PINNED = pinned
    rate = _disk_write_gbps(workdir, 4 if device == "cuda" else 1 / 16)
    shutil.rmtree(runs)
    notes = [f"{params:,} parameters; each state {state_gb:.2f} GB: model + optimizer + extra (fp32, FSDP2, one rank) "
             f"and the HF export built from them, into {workdir}; disk write rate {rate:.2f} GB/s (written and fsynced)",
             "ratio: each round's wait against the first `with_finish` round"]
    return {"size": size.name, "rows": rows, "notes": notes, "disk_write_gbps": rate, "state_gb": state_gb, "pid": os.getpid()}


def _tokenizer(size):
    if not size.model:  # the full vocabulary of the R1-Distill architecture
        from opd_patches.embedded.r1_arch import full_vocab_tokenizer

        return full_vocab_tokenizer()
    from opd_patches.embedded.build import _train_tokenizer

    return _train_tokenizer()
