"""`opd.cpu_dtype` (recipes/device/cpu.yaml, opd_patches/main.py `apply_cpu_dtype`): the CPU's training engine
computes in float32 where bf16 is not native, in upstream's bf16 mixed precision where it is.

The recipe is composed as run.sh composes it, the key applied as opd_patches.main does, and a real VERL
FSDP2 engine (`FSDPEngineWithLMHead` over a single-rank gloo group) built from the resulting dataclass
configs, as `ActorRolloutRefWorker.init_model` builds the actor's; the test reads the dtype the engine's
linear layers compute in during a forward (FSDP2's MixedPrecisionPolicy casts the parameters) and the
dtype of the engine's autocast. Native bf16 is decided by the machine, so both answers of
`cpu_platform.native_bf16` are given in turn; a fresh process with oneDNN capped below bf16 checks the
real detection.
"""

import os
import platform
import subprocess
import sys

import pytest
import torch
from dist_group import single_rank_gloo

from opd_patches.platforms import cpu as cpu_platform

import composed


def compose(*overrides, device="cpu", model="/models/student"):
    return composed.compose_recipe(
        "topk",
        f"actor_rollout_ref.model.path={model}",
        "distillation.teacher_models.teacher_model.model_path=/models/teacher",
        "data.train_files=/data/train.parquet",
        "data.val_files=/data/val.parquet",
        f"+device={device}",
        *overrides,
    )


def applied(config, native: bool, monkeypatch):
    """What opd_patches.main does to the composed config (attention: sdpa on the CPU), on a CPU with or
    without native bf16."""
    from opd_patches.main import apply_attention, apply_cpu_dtype

    monkeypatch.setattr(cpu_platform, "native_bf16", lambda: (native, "given by the test"))
    apply_attention(config)
    apply_cpu_dtype(config)
    return config


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    from verl.plugin.platform import platform_manager

    previous = platform_manager._current_platform
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        # As opd_patches/platforms/cpu.py sets it in a run: VERL registers its FSDP engine under cuda.
        mp.setenv("VERL_ENGINE_DEVICE", "cuda")
        platform_manager._current_platform = cpu_platform.PlatformCPU()
        torch.set_num_threads(int(os.environ.get("OPD_TEST_THREADS") or 1))
        try:
            with single_rank_gloo(tmp_path_factory):
                yield
        finally:
            torch.set_num_threads(threads)
            platform_manager._current_platform = previous


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("student")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         architectures=["Qwen2ForCausalLM"])
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def build_engine(config):
    """The actor's engine, as `ActorRolloutRefWorker.init_model` and `TrainingWorker.__init__` build it."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry

    model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    actor_config.model_config = model_config
    engine_config = actor_config.engine
    engine_config.use_remove_padding = model_config.use_remove_padding
    engine_config.use_fused_kernels = model_config.use_fused_kernels
    engine = EngineRegistry.new(model_type="language_model", backend=engine_config.strategy,
                                model_config=model_config, engine_config=engine_config,
                                optimizer_config=actor_config.optim, checkpoint_config=actor_config.checkpoint)
    engine.initialize()
    return engine


def forward_dtypes(engine):
    """(dtype the MLP's down projection computes in, the engine's autocast dtype) over one forward."""
    seen = []
    layer = engine.module.model.layers[0].mlp.down_proj
    handle = layer.register_forward_hook(lambda m, args, out: seen.append((m.weight.dtype, out.dtype)))
    try:
        with torch.no_grad():
            engine.module(input_ids=torch.arange(8)[None], use_cache=False)
    finally:
        handle.remove()
    (weight, out), = seen
    assert weight == out
    return out, engine._autocast_dtype  # upstream's forward_step autocasts to this (none for float32)


@pytest.mark.parametrize("native, expected", [(False, torch.float32), (True, torch.bfloat16)])
def test_engine_computes_in_the_resolved_dtype(process_group, model_dir, monkeypatch, native, expected):
    config = compose("+actor_rollout_ref.model.load_tokenizer=false",  # no tokenizer in the tiny model folder
                     "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false", model=model_dir)
    engine = build_engine(applied(config, native, monkeypatch))
    assert forward_dtypes(engine) == (expected, expected)
    # The weights themselves stay float32 either way (upstream's model_dtype for training).
    assert {p.dtype for p in engine.module.parameters()} == {torch.float32}


def test_reference_follows_and_gpu_is_untouched(monkeypatch):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.torch_dtypes import PrecisionType

    config = applied(compose(), False, monkeypatch)
    for role in ("actor", "ref"):  # the engine config each role's worker builds its FSDP engine from
        engine = omega_conf_to_dataclass(config.actor_rollout_ref[role].fsdp_config)
        assert PrecisionType.to_dtype(engine.mixed_precision["param_dtype"]) == torch.float32
    gpu = compose(device="gpu")
    before = {role: gpu.actor_rollout_ref[role].fsdp_config.copy() for role in ("actor", "ref")}
    applied(gpu, False, monkeypatch)
    for role, fsdp in before.items():  # upstream's bf16 mixed precision on the GPU, as configured
        assert gpu.actor_rollout_ref[role].fsdp_config == fsdp and fsdp.get("mixed_precision") is None


def test_explicit_choice_and_conflicts(monkeypatch):
    from opd_patches.main import ConfigError

    for native in (False, True):
        for choice in ("float32", "bfloat16"):
            config = applied(compose(f"opd.cpu_dtype={choice}"), native, monkeypatch)
            assert config.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == \
                {"float32": "fp32", "bfloat16": "bf16"}[choice]
    with pytest.raises(ConfigError, match="opd.cpu_dtype='fp16'"):
        applied(compose("opd.cpu_dtype=fp16"), False, monkeypatch)
    # One key decides: upstream's key set to something else is refused, not silently overridden.
    with pytest.raises(ConfigError, match="set opd.cpu_dtype instead"):
        applied(compose("+actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=bf16"), False, monkeypatch)
    agreeing = applied(compose("+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=float32"),
                       False, monkeypatch)
    assert agreeing.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "fp32"


@pytest.mark.fresh_process
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 ISA cap")
def test_auto_is_float32_when_onednn_is_capped_below_bf16():
    """A CPU without native bf16, as far as torch can tell: oneDNN capped at AVX2 (bf16 matmuls then take
    torch's slow fallback, whatever the hardware)."""
    code = ("from opd_patches.platforms import cpu as cpu_platform; "
            "print(*cpu_platform.compute_dtype('auto'), sep='|')")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    dtype, why = out.stdout.strip().splitlines()[-1].split("|")
    assert dtype == "float32", why
