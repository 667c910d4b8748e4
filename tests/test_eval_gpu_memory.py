"""The vLLM evaluation's share of the GPU, sized from the memory free at its start (opd_patches/eval/gpu_memory.py).

The rule runs on the CPU: device readings are passed in, and the model-side figures (KV cache, weights)
come from the real tiny embedded model, checked against what transformers itself allocates.
"""

import pytest
import torch

from opd_patches.eval import gpu_memory as gm

GIB = gm.GIB
H100 = int(79.18 * GIB)  # total memory an 80 GB H100 reports


def test_the_share_asked_for_is_free_when_vllm_compares():
    """vLLM refuses unless share x total is free once its own context exists: that must hold for any reading."""
    for free_gib in (78.6, 70.85, 40.0, 12.0):
        free = int(free_gib * GIB)
        share = gm.share(free, H100, needed=int(8 * GIB))
        assert 0 < share <= gm.DEFAULT_SHARE
        assert share * H100 <= free - gm.ENGINE_CONTEXT + 0.0001 * H100  # rounding to 4 places
    assert gm.share(int(78.6 * GIB), H100, needed=None) == gm.DEFAULT_SHARE  # an idle card: vLLM's default
    # what a fixed 0.9 asked for after the train half left 8.3 GiB held; the sized share starts
    assert 0.9 * H100 > int(70.85 * GIB) and gm.share(int(70.85 * GIB), H100, needed=int(8 * GIB)) < 0.9


def test_an_explicit_share_wins(monkeypatch):
    assert gm.share(int(2 * GIB), H100, needed=int(8 * GIB), explicit=0.5) == 0.5
    monkeypatch.setenv("OPD_EVAL_GPU_MEM", "0.45")
    assert gm.explicit_share() == 0.45
    assert gm.explicit_share(0.3) == 0.3  # the command-line flag over the variable
    monkeypatch.setenv("OPD_EVAL_GPU_MEM", "1.5")
    with pytest.raises(ValueError, match="OPD_EVAL_GPU_MEM"):
        gm.explicit_share()
    monkeypatch.delenv("OPD_EVAL_GPU_MEM")
    assert gm.explicit_share() is None
    share, how = gm.engine_share("m", 64, explicit=0.7, reader=lambda d: pytest.fail("read the device"))
    assert share == 0.7 and "explicitly" in how


def test_kv_bytes_match_what_the_model_allocates(embedded):
    """The KV estimate equals the bytes of the cache a real forward pass of the model fills."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(embedded["student"], dtype=torch.bfloat16)
    tokens = 37
    out = model(torch.zeros(1, tokens, dtype=torch.long), use_cache=True)
    cache = out.past_key_values
    allocated = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    config = gm.model_config(str(embedded["student"]))
    config["torch_dtype"] = "bfloat16"
    assert gm.kv_bytes(config, tokens) == allocated
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    needed = gm.needed_bytes(str(embedded["student"]), tokens)
    assert needed >= gm.ENGINE_OVERHEAD + gm.kv_bytes(gm.model_config(str(embedded["student"])), tokens)
    assert needed - gm.ENGINE_OVERHEAD >= params * 0.5  # the stored weights, whatever dtype they were saved in


def test_too_little_free_memory_is_refused_naming_free_needed_and_holders(embedded, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    needed = gm.needed_bytes(str(embedded["student"]), 4096)
    holders = [gm.Holder(4242, "python -m tools.bench", int(70 * GIB))]
    free = needed + gm.ENGINE_CONTEXT - 1
    reading = gm.Reading(0, free, H100, holders)
    with pytest.raises(gm.NotEnoughGPUMemory) as err:
        gm.engine_share(str(embedded["student"]), 4096, reader=lambda d: reading)
    line = str(err.value)
    assert "\n" not in line
    assert f"{free / GIB:.1f} GiB free" in line and f"{needed / GIB:.1f} GiB needed" in line
    assert "pid 4242 70.0 GiB (python -m tools.bench)" in line and "--gpu-memory-utilization" in line
    share, how = gm.engine_share(str(embedded["student"]), 4096,
                                 reader=lambda d: gm.Reading(0, free + 2, H100, holders))
    assert 0 < share < gm.DEFAULT_SHARE and "free at start" in how


def test_the_tightest_visible_device_sizes_a_tensor_parallel_engine(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    free = {"3": 70 * GIB, "5": 30 * GIB}
    seen = []

    def reader(device):
        seen.append(device)
        return gm.Reading(int(device), int(free[device]), H100)

    share, how = gm.engine_share("not-a-local-model", 4096, tensor_parallel=2, reader=reader)
    assert seen == ["3", "5"]
    assert share == gm.share(int(30 * GIB), H100, None) and "GPU 5" in how and "unknown" in how


def test_no_nvml_leaves_the_choice_to_vllm():
    def reader(device):
        raise ModuleNotFoundError("No module named 'pynvml'")

    share, how = gm.engine_share("m", 64, reader=reader)
    assert share == gm.DEFAULT_SHARE and "not readable" in how
