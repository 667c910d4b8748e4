"""The kernels bench's `update/floor` row: the plain-PyTorch update with an AdamW step (fused on CUDA),
at a tiny CPU size, next to the rows of the real paths (tools/bench/kernels.py)."""

import dataclasses

import torch

from tools.bench import kernels
from tools.bench.sizes import SIZES


def test_update_rows_end_with_the_floor(monkeypatch):
    size = dataclasses.replace(SIZES["cpu"], n_seqs=3, seq_len=32, micro_seqs=2, repeats=2)
    steps = []
    real_step = torch.optim.AdamW.step

    def counted(self, *args, **kwargs):  # the real step, counted with the gradients it saw
        steps.append(sum(p.grad is not None for g in self.param_groups for p in g["params"]))
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counted)
    notes = []
    rows = kernels.in_model(size, ["k1_pg", "topk_default"], notes)
    assert [r["name"] for r in rows] == ["update/k1_pg", "update/topk_default", "update/floor"]
    floor = rows[-1]
    assert floor["optimizer"] == "AdamW(fused=False)" and floor["reference"].startswith(kernels.FLOOR_REF)
    assert floor["time_s"] > 0 and floor["ref_time_s"] > 0 and floor["tokens"] == 3 * 32
    n_params = len(list(kernels.build_model(size).parameters()))
    assert steps == [n_params] * (1 + size.repeats)  # warm-up + timed runs, each over every parameter's gradient
    assert any("update/floor" in n for n in notes)
