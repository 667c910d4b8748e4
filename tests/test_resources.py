"""The launch's disk and host-memory pre-flight (opd_patches/checks/resources.py): its sizes against references
built independently (a published parameter count, models built with transformers, a state written with
torch.save), refusals on the real filesystem and memory of this machine, the keys the messages name."""

import json
import re

import pytest
import torch

from opd_patches.embedded import r1_arch
from opd_patches.checks import InputError
from opd_patches.checks import resources
from opd_patches.ops import receipts

from composed import compose_recipe

HUGE = {"vocab_size": 2**30, "hidden_size": 2**15}  # ~7e13 parameters: more than any disk or memory here holds


def qwen2_folder(path, **fields):
    """A folder holding only a Qwen2 config.json (what the check reads: no weights, no tokenizer)."""
    from transformers import Qwen2Config

    Qwen2Config(**fields).save_pretrained(path)
    return path


def tiny(**extra):
    return {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 96, **extra}


def config_for(student, teacher, run_dir, *overrides, recipe="topk", device="gpu"):
    return compose_recipe(recipe, f"actor_rollout_ref.model.path={student}",
                          f"distillation.teacher_models.teacher_model.model_path={teacher}",
                          f"trainer.default_local_dir={run_dir}", f"+device={device}", *overrides)


def test_r1_distill_count_from_its_config_alone(tmp_path):
    folder = qwen2_folder(tmp_path / "r1", **r1_arch.R1_DISTILL_1_5B)
    assert resources.parameter_count(folder) == 1_777_088_000  # DeepSeek-R1-Distill-Qwen-1.5B's published count


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_count_equals_a_model_built_with_its_weights(tmp_path, tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields = tiny(tie_word_embeddings=tied)
    built = Qwen2ForCausalLM(Qwen2Config(**fields))  # real weights, on the CPU
    assert resources.parameter_count(qwen2_folder(tmp_path, **fields)) == sum(p.numel() for p in built.parameters())
    assert sorted(resources.parameter_shapes(tmp_path)) == sorted(tuple(p.shape) for p in built.parameters())


def test_state_size_matches_files_torch_writes(tmp_path):
    """A trainer state as upstream saves it (model + AdamW state after a step) and the export: the estimate is
    within the files' pickling overhead of what torch.save and save_pretrained write."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**tiny(vocab_size=4096, tie_word_embeddings=False)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    torch.save(optimizer.state_dict(), tmp_path / "optim.pt")
    model.save_pretrained(tmp_path / "hf")
    written = {"trainer state": (tmp_path / "model.pt").stat().st_size + (tmp_path / "optim.pt").stat().st_size,
               "HF export": (tmp_path / "hf" / "model.safetensors").stat().st_size}
    params = sum(p.numel() for p in model.parameters())
    estimate = resources.state_parts(params, 4, ["model", "optimizer", "extra", "hf_model"])
    for part, size in written.items():
        assert estimate[part] <= size <= estimate[part] * 1.05 + 64 * 1024, (part, estimate[part], size)
    assert resources.state_parts(params, 4, ["model", "optimizer"])["HF export"] == 0


def test_pinned_shards_hand_computed():
    # a (10, 3) fp32 tensor over 4 ranks: torch.chunk rows 3, 3, 3, 1 -> 36, 36, 36, 12 bytes -> blocks 64, 64, 64, 16
    assert resources.shard_bytes([(10, 3)], 4, range(4), 4, pinned=True) == 208
    assert resources.shard_bytes([(10, 3)], 4, range(4), 4, pinned=False) == 120
    assert resources.shard_bytes([(10, 3)], 4, [3], 4, pinned=True) == 16  # another host's rank
    # (2, 3) over 4 ranks: rows 1, 1, 0, 0 -> 12 bytes on ranks 0 and 1 -> blocks 16, 16; ranks 2 and 3 hold nothing
    assert resources.shard_bytes([(2, 3)], 4, range(4), 4, pinned=True) == 32
    assert resources.pinned_block(2**20) == 2**20 and resources.pinned_block(2**20 + 1) == 2**21


def test_the_embedded_models_pass_and_the_line_names_the_figures(embedded, tmp_path):
    lines = []
    for recipe, device in (("k1", "cpu"), ("topk", "gpu")):
        line = resources.check_resources(config_for(embedded["student"], embedded["teacher"], tmp_path / recipe,
                                                    recipe=recipe, device=device), log=lambda *a, **k: None)
        lines.append(line)
        assert re.match(r"\[opd\] resources: disk [\d.]+ [kMG]B free at .*, needs [\d.]+ [kMG]B \(.*\); "
                        r"host memory [\d.]+ [kMG]B available \(.*\), needs [\d.]+ [kMG]B \(state snapshot .*, "
                        r"parked teacher .*\)$", line), line
    assert lines[0] != lines[1]  # the GPU snapshot is page-locked (rounded), the CPU teacher float32


def test_disk_refused_on_this_filesystem_naming_figures_folder_and_keys(tmp_path, embedded):
    student = qwen2_folder(tmp_path / "huge", **tiny(**HUGE))
    run_dir = tmp_path / "run" / "not-yet"
    config = config_for(student, embedded["teacher"], run_dir, "opd.background_state_write=false")
    with pytest.raises(InputError) as err:
        resources.check_resources(config, log=lambda *a, **k: None)
    message = str(err.value)
    assert re.match(rf"trainer\.default_local_dir={re.escape(str(run_dir))}: its filesystem has [\d.]+ [kMG]B free "
                    rf"\(at {re.escape(str(tmp_path))}\), the run needs [\d.]+ GB \(", message), message
    for key in ("trainer.max_actor_ckpt_to_keep", "OUTPUT_DIR=", "trainer.default_local_dir=", "opd.force=true"):
        assert key in message
    assert "4 states: 3 kept + 1 in flight" in message and "\n" not in message


def test_memory_refused_naming_the_keys_that_lower_it(tmp_path, embedded):
    teacher = qwen2_folder(tmp_path / "huge", **tiny(**HUGE))  # the student is tiny: the disk has room
    config = config_for(embedded["student"], teacher, tmp_path / "run")
    with pytest.raises(InputError) as err:
        resources.check_resources(config, log=lambda *a, **k: None)
    message = str(err.value)
    _, source = resources.available_memory()
    assert re.match(r"host memory: 1 GPU process on this host would hold [\d.]+ GB \(state snapshot [\d.]+ [kMG]B, "
                    rf"parked teacher [\d.]+ GB\), [\d.]+ [kMG]B is available \({source}\)\.", message), message
    assert "opd.background_state_write=false" in message and "opd.teacher_offload=false" in message
    # without the parked teacher the rest fits
    config = config_for(embedded["student"], teacher, tmp_path / "run", "opd.teacher_offload=false")
    assert "parked teacher" not in resources.check_resources(config, log=lambda *a, **k: None)


def test_force_starts_anyway_and_says_why(tmp_path, embedded):
    teacher = qwen2_folder(tmp_path / "huge", **tiny(**HUGE))
    printed = []
    config = config_for(embedded["student"], teacher, tmp_path / "run", "opd.force=true")
    resources.check_resources(config, log=lambda line, **k: printed.append(line))
    assert printed[0].startswith("[opd] resources: opd.force=true, starting anyway: host memory:")
    assert printed[1].startswith("[opd] resources: disk ")


def fake_state(run_dir, step, nbytes, ok=True):
    state = run_dir / f"global_step_{step}"
    (state / "actor").mkdir(parents=True)
    (state / "actor" / "model.pt").write_bytes(b"\0" * nbytes)
    receipts.write(state, step, {"ok": ok, "checks": {}, "error": None})


def test_a_resume_lowers_the_need_by_the_states_it_keeps(tmp_path, embedded):
    run_dir = tmp_path / "run"
    config = config_for(embedded["student"], embedded["teacher"], run_dir)
    free = lambda path: (10**15, path)  # noqa: E731 - room for any need: the need is what is read here

    def need(line):
        return re.search(r"needs ([\d.]+ [kMG]B) \(", line).group(1)

    fresh = resources.check_resources(config, free=free, log=lambda *a, **k: None)
    params = resources.parameter_count(embedded["student"])
    per_state = sum(resources.state_parts(params, 4, ["model", "optimizer", "hf_model"]).values())
    assert need(fresh) == resources.human(4 * per_state)
    for step in (10, 20):
        fake_state(run_dir, step, per_state)
    resumed = resources.check_resources(config, free=free, log=lambda *a, **k: None)
    assert need(resumed) == resources.human(2 * per_state) and "already in 2 complete states" in resumed
    for step in (30, 40, 50):  # more than are kept: pruning removes the oldest; never below one state in flight
        fake_state(run_dir, step, 3 * per_state)
    assert need(resources.check_resources(config, free=free, log=lambda *a, **k: None)) == resources.human(per_state)


def test_fewer_saves_than_kept_states_bound_the_need(tmp_path, embedded):
    config = config_for(embedded["student"], embedded["teacher"], tmp_path / "run",
                        "trainer.total_training_steps=2", "trainer.save_freq=1")
    line = resources.check_resources(config, log=lambda *a, **k: None)
    assert "2 states: the run's 2 saves (trainer.total_training_steps=2, trainer.save_freq=1)" in line
    config = config_for(embedded["student"], embedded["teacher"], tmp_path / "run", "opd.validate_after_save=false")
    assert "2 states: 1 kept + 1 in flight" in resources.check_resources(config, log=lambda *a, **k: None)


def test_an_uncached_hub_id_is_skipped_with_one_line(tmp_path, embedded):
    printed = []
    config = config_for("nobody-here/no-such-model", embedded["teacher"], tmp_path / "run")
    assert resources.check_resources(config, log=lambda line, **k: printed.append(line)) is None
    assert printed == ["[opd] resources: not checked: no local config.json for "
                       "actor_rollout_ref.model.path=nobody-here/no-such-model (a hub id not in the local cache)"]


def test_memory_figure_is_memavailable_or_a_smaller_cgroup_limit():
    available, source = resources.available_memory()
    meminfo = dict(line.split(":", 1) for line in resources.MEMINFO.read_text().splitlines())
    mem_available = int(meminfo["MemAvailable"].split()[0]) * 1024
    if source == "MemAvailable":
        assert abs(available - mem_available) < 0.1 * mem_available + 2**28  # read a moment apart
    else:
        assert available <= mem_available + 2**28


@pytest.mark.slow
def test_run_sh_refuses_before_ray_with_exit_2(tmp_path, embedded):
    """A real launch: the teacher's config.json says it is far larger than this host's memory (its files are the
    tiny teacher's: every input check before this one passes); run.sh exits 2 with the message, Ray never starts."""
    import shutil
    from pathlib import Path

    import launch

    teacher = Path(shutil.copytree(embedded["teacher"], tmp_path / "teacher"))
    config = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**config, **HUGE}))
    last = launch.refused(tmp_path, embedded, TEACHER=str(teacher))
    assert last.startswith("[opd] refused: host memory: 1 GPU process on this host would hold "), last
    assert "opd.teacher_offload=false" in last and "opd.force=true (run.sh: FORCE=1) starts anyway." in last
