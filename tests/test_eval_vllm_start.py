"""The vLLM evaluation backend starts its engine in a clean process with the spawn start method (issue 13).

On a GPU the engine died at start-up with "Cannot re-initialize CUDA in forked subprocess": vLLM forks
its engine process unless `VLLM_WORKER_MULTIPROC_METHOD=spawn`, and a parent that made any CUDA call
(even `torch.cuda.is_available()`) leaves its forked children unable to use CUDA. A CPU-only torch never
touches CUDA, so a fresh interpreter records instead: the `torch.cuda` entry points that would start
CUDA are wrapped to log their calls, a stand-in `vllm` module's `LLM` logs those calls and the start
method vLLM would use (its env variable, the multiprocessing context it names) when it is built, and
the real command line (`opd_patches.eval.cli.main`) drives it on the tiny embedded model. A fresh
process, because import-time calls (of anything `opd_patches.eval` imports) count too. On 46e81fe
(the commit that crashed) the engine was built under "fork" after `torch.cuda.is_available()` (VERL's
import through `import opd_patches`, and `vllm_available` for `--backend auto`).
"""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest


# The torch.cuda functions that call into the CUDA runtime (cuInit / cudaGetDeviceCount / a context).
# Not device_count: it asks NVML first and, per torch's docs, leaves a process safe to fork.
CUDA_ENTRY_POINTS = ("is_available", "init", "_lazy_init", "current_device", "set_device", "get_device_name",
                     "get_device_properties", "get_device_capability", "mem_get_info", "synchronize",
                     "memory_allocated", "empty_cache", "is_bf16_supported")

SCRIPT = r"""
import json, multiprocessing, os, sys, types
import torch

record_path, gpus, entry_points, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4:]
calls = []

def recorder(name, real):
    def wrapped(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)
    return wrapped

for name in entry_points:
    if hasattr(torch.cuda, name):
        setattr(torch.cuda, name, recorder(name, getattr(torch.cuda, name)))
torch.cuda.device_count = lambda: gpus  # the NVML count a GPU host reports

class LLM:
    def __init__(self, model, **kwargs):
        from transformers import AutoTokenizer
        method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # vLLM's default is fork
        record = {"cuda_calls_before_engine": list(calls), "env": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
                  "context": multiprocessing.get_context(method).get_start_method(), "kwargs": sorted(kwargs)}
        with open(record_path, "w") as fh:
            json.dump(record, fh)
        if method == "fork" and calls:  # what the real engine process then did on a GPU
            raise RuntimeError("Cannot re-initialize CUDA in forked subprocess (stand-in vLLM engine)")
        self.tokenizer = AutoTokenizer.from_pretrained(model)

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, inputs, params, use_tqdm=False):
        out = types.SimpleNamespace(text="so \\boxed{4}", token_ids=[1, 2, 3], finish_reason="stop")
        return [types.SimpleNamespace(outputs=[out]) for _ in inputs]

class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

vllm = types.ModuleType("vllm")
vllm.LLM, vllm.SamplingParams = LLM, SamplingParams
sys.modules["vllm"] = vllm

from opd_patches.eval.cli import main
raise SystemExit(main(argv))
"""


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """A two-question protocol file and its question file (works on any commit of the harness)."""
    root = tmp_path_factory.mktemp("suite")
    (root / "qs.jsonl").write_text("".join(json.dumps({"id": f"q{i}", "problem": f"What is {i}+{4 - i}?", "answer": "4"}) + "\n"
                                           for i in range(2)))
    (root / "two.yaml").write_text("name: two\nfiles: [qs.jsonl]\nsamples: 1\nmax_new_tokens: 8\nseed: 0\n"
                                   "temperature: 0.6\ntop_p: 0.95\n")
    return root


def _run(embedded, suite, tmp_path, backend, gpus=1):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    record = tmp_path / "engine.json"
    argv = ["--model", str(embedded["student"]), "--suite", str(suite / "two.yaml"), "--data-dir", str(suite),
            "--out", str(tmp_path / "out"), "--backend", backend]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(record), str(gpus), ",".join(CUDA_ENTRY_POINTS), *argv],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return proc, (json.loads(record.read_text()) if record.exists() else None)


@pytest.mark.fresh_process
@pytest.mark.parametrize("backend", ["vllm", "auto"])
def test_engine_starts_with_spawn_and_no_cuda_call_before_it(embedded, suite, tmp_path, backend):
    proc, engine = _run(embedded, suite, tmp_path, backend)
    assert engine is not None, f"the vLLM engine was never built:\n{proc.stdout}\n{proc.stderr}"
    assert (engine["env"], engine["context"]) == ("spawn", "spawn"), f"engine built under start method {engine}"
    assert engine["cuda_calls_before_engine"] == [], (
        f"the evaluation process called torch.cuda {engine['cuda_calls_before_engine']} before vLLM started its engine")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["backend"].startswith("vllm") and summary["pass_at_1"] == 1.0 and summary["n_samples"] == 2


def test_a_start_method_the_user_set_is_kept(monkeypatch):
    import types

    from opd_patches.eval import vllm_backend

    seen = []

    class LLM:
        def __init__(self, model, **kwargs):
            seen.append(os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"))

        def get_tokenizer(self):
            return None

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=dict))
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    vllm_backend.VLLMBackend("m", max_model_len=64)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")
    vllm_backend.VLLMBackend("m", max_model_len=64)
    assert seen == ["fork", "spawn"]


@pytest.mark.parametrize("gpus, installed, expected", [(1, True, True), (0, True, False), (1, False, False)])
def test_auto_asks_nvml_not_cuda(monkeypatch, gpus, installed, expected):
    import torch

    from opd_patches.eval import backends

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("is_available poisons fork"))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(backends.importlib.util, "find_spec", lambda name: object() if installed else None)
    assert backends.vllm_available() is expected


def test_spawned_children_do_not_rerun_the_command_line():
    """spawn imports the parent's main module in each child as `__mp_main__`: it must not start an evaluation."""
    namespace = runpy.run_module("opd_patches.eval", run_name="__mp_main__")
    assert callable(namespace["main"])


def test_engine_compiles_as_the_training_rollout(monkeypatch):
    """The evaluation engine takes recipes/device/gpu.yaml's compilation settings, each engine its own copy
    (vLLM fills in the mapping it is given)."""
    import types

    import yaml

    from opd_patches.eval import vllm_backend

    seen = []

    class LLM:
        def __init__(self, model, **kwargs):
            seen.append(kwargs.get("compilation_config"))
            kwargs["compilation_config"]["filled_in"] = True

        def get_tokenizer(self):
            return None

    gpu = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes/device/gpu.yaml").read_text())
    rollout = gpu["actor_rollout_ref"]["rollout"]["engine_kwargs"]["vllm"]["compilation_config"]
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=dict))
    vllm_backend.VLLMBackend("m", max_model_len=64)
    vllm_backend.VLLMBackend("m", max_model_len=64)
    assert seen == [{**rollout, "filled_in": True}] * 2 and vllm_backend.ROLLOUT_COMPILATION == rollout
