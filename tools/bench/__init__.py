"""`make bench`: performance phases at the R1-Distill-Qwen-1.5B size (GPU) or a reduced size (CPU).

    python -m tools.bench --phase kernels|teacher|step [--size full|cpu] [--out bench.json]

Each phase measures the project's real code path next to a plain-PyTorch reference of the same
computation, in the same process (ratios, not absolute figures, are what compares across machines),
with the peak accelerator memory of each measurement (torch.cuda.max_memory_allocated, reset before
each; on the CPU "n/a"). Phases run separately and merge into one JSON file (results.py); a table goes
to stdout. Phases live in PHASES (run.py): a phase is `fn(size: Size, args) -> dict` returning
{"rows": [...], **extra}; the lead's `step` phase registers there.
"""
