"""Studies: compare recipes over seeds, one command (`make study SPEC=...`, `python -m opd_patches.study`).

    spec.py      the YAML spec, validated (errors name the key)
    arms.py      ablation arms: control, control + one knob at a time, treatment (knob table KNOBS)
    runner.py    one training run per (arm, seed) through run.sh, in its own session; completeness
    progress.py  live progress lines from a run's metrics.jsonl (step, elapsed, ETA)
    evaluate.py  which checkpoints to evaluate, the evaluation harness per checkpoint and suite
    report.py    pooled pass@1, paired differences vs the control, report.md / report.json / report.png
    cli.py       the study itself: lock, runs, evaluations, report
    select.py    `make select`: one run's checkpoint chosen on a proxy suite, scored on the final suite
    chain.py     `make run`: data, pre-flight, training, selection, final score, report in one resumable command
    chain_record.py  `make run`'s record (chain.json): each stage's inputs, the refusal of changed ones, skipping
    deadline.py  the deadline of `make run`: when training stops so that selection and the final score fit
    chain_report.py  `make run`'s report.md / report.json

Nothing here is imported by training processes.
"""
