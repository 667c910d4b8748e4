"""Metrics go where users look (opd_patches.main.apply_logging / logger_env), on a real run that lists
`trainer.logger=[console,tensorboard,wandb]` (the `upstream_paths` shared run: no `file` logger named).

- metrics.jsonl is still written into the run folder (`file` added back, said at launch);
- tensorboard's event file is in <run>/tensorboard, and tensorboard's own reader finds the loss of every
  step that metrics.jsonl logged, with the same value;
- W&B ran offline into <run>/wandb (no account, no network): its offline run folder and record file exist
  and the record file names the logged loss. (wandb 0.31 ships no Python reader for that file, so its
  values are not read back here.)
"""

import json

import pytest

LOSS = "actor/loss"
pytestmark = pytest.mark.slow


def test_metrics_jsonl_is_kept(upstream_paths):
    assert "`file` added (metrics.jsonl in the run folder)" in upstream_paths.log
    rows = [json.loads(line) for line in (upstream_paths.out / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(LOSS in r["data"] for r in rows)


def test_tensorboard_events_hold_each_steps_loss(upstream_paths):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = upstream_paths.out / "tensorboard"
    assert list(folder.glob("events.out.tfevents.*")), f"no event file in {folder}"
    acc = EventAccumulator(str(folder))
    acc.Reload()
    logged = {e.step: e.value for e in acc.Scalars(LOSS)}
    rows = [json.loads(line) for line in (upstream_paths.out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(logged) == [r["step"] for r in rows]
    for r in rows:
        assert logged[r["step"]] == pytest.approx(r["data"][LOSS], rel=1e-6)


def test_wandb_ran_offline_into_the_run_folder(upstream_paths):
    runs = list((upstream_paths.out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, f"expected one offline run in {upstream_paths.out / 'wandb'}: {runs}"
    records = list(runs[0].glob("*.wandb"))
    assert records and LOSS.encode() in records[0].read_bytes()
