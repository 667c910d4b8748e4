"""The student/teacher pre-flight report (opd_patches/checks/preflight.py) on the embedded tiny models."""

import json
import shutil

import pytest

from opd_patches.checks import compat
from opd_patches.checks.preflight import PreflightError, first_difference, main, run_preflight, step0_warnings

FAST = {"prompts": 2, "max_new_tokens": 8, "topk": 8, "device": "cpu"}
FRACTIONS = ("topk_overlap", "shared_mass", "teacher_topk_mass", "student_mass_on_teacher_topk")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def other_template(embedded, tmp_path_factory):
    """A teacher copy whose chat template puts a blank line after the assistant header."""
    teacher = _copy(embedded["teacher"], tmp_path_factory.mktemp("tmpl") / "teacher")
    jinja = teacher / "chat_template.jinja"
    text = jinja.read_text()
    assert "<|im_start|>assistant\\n'" in text
    jinja.write_text(text.replace("<|im_start|>assistant\\n'", "<|im_start|>assistant\\n\\n'"))
    return teacher


def test_report_fields(embedded, tmp_path):
    out = tmp_path / "report.json"
    report = run_preflight(embedded["student"], embedded["teacher"], embedded["train"], out=out, **FAST)
    assert report["ok"] and report["vocab"]["checked"] and report["chat_template"]["identical"]
    assert report["chat_template"]["prompts_checked"] == 2
    step0 = report["step0"]
    assert step0["positions"] == sum(step0["response_lengths"]) > 0
    for key in FRACTIONS:
        assert 0.0 <= step0[key] <= 1.0 + 1e-6, (key, step0[key])
    for key in ("teacher_nll", "student_nll", "reverse_kl", "teacher_entropy"):
        assert step0[key] >= -1e-6, (key, step0[key])
    # The embedded teacher is random: near-uniform, flagged as a warning, not an error.
    assert any("near-uniform" in w for w in report["warnings"])
    assert json.loads(out.read_text())["step0"]["shared_mass"] == pytest.approx(step0["shared_mass"])


def test_self_distillation_is_perfect(embedded, tmp_path):
    """The student as its own teacher (a separate copy, loaded twice): identical distributions."""
    twin = _copy(embedded["student"], tmp_path / "twin")
    s = run_preflight(embedded["student"], twin, embedded["train"], **FAST)["step0"]
    assert s["topk_overlap"] == pytest.approx(1.0, abs=1e-6)
    assert s["shared_mass"] == pytest.approx(1.0, abs=1e-5)
    assert s["teacher_topk_mass"] == pytest.approx(s["student_mass_on_teacher_topk"], abs=1e-5)
    assert s["teacher_nll"] == pytest.approx(s["student_nll"], abs=1e-5)
    assert s["reverse_kl"] == pytest.approx(0.0, abs=1e-5)


def test_chat_template_mismatch(embedded, other_template, tmp_path):
    out = tmp_path / "report.json"
    with pytest.raises(PreflightError, match="chat template") as info:
        run_preflight(embedded["student"], other_template, embedded["train"], full=False, out=out)
    msg = str(info.value)
    assert "chat_template.jinja" in msg and "from character" in msg
    # Both renderings' snippets are quoted: the teacher's has the extra blank line.
    assert "assistant\\n'" in msg and "assistant\\n\\n'" in msg
    written = json.loads(out.read_text())
    assert written["ok"] is False and "chat template" in written["error"]


def test_vocab_mismatch_raises_via_compat(embedded, tmp_path):
    teacher = _copy(embedded["teacher"], tmp_path / "teacher")
    cfg = json.loads((teacher / "config.json").read_text())
    cfg["vocab_size"] += 64
    (teacher / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(compat.IncompatibleModels, match="vocab_size differs") as info:
        run_preflight(embedded["student"], teacher, full=False)
    assert isinstance(info.value, PreflightError)


def test_unavailable_model(embedded):
    with pytest.raises(PreflightError, match="not available locally"):
        run_preflight(embedded["student"], "no-such-org/no-such-model", full=False)
    report = run_preflight(embedded["student"], "no-such-org/no-such-model", full=False, strict=False)
    assert report["ok"] and "not available locally" in report["skipped"]


def test_cli(embedded, other_template, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["--student", str(embedded["student"]), "--teacher", str(embedded["teacher"]),
            "--data", str(embedded["train"]), "--prompts", "1", "--max-new-tokens", "4", "--topk", "4",
            "--device", "cpu", "--out", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["step0"]["positions"] > 0
    assert "shared mass" in capsys.readouterr().out
    assert main(["--student", str(embedded["student"]), "--teacher", str(other_template), "--cheap"]) == 2
    assert "chat templates differ" in capsys.readouterr().err


def test_helpers():
    assert first_difference("abc", "abd") == 2
    assert first_difference("ab", "abc") == 2
    assert first_difference([1, 2], [1, 3]) == 1
    good = {"positions": 10, "shared_mass": 0.8, "teacher_nll": 1.0, "student_nll": 0.9, "teacher_entropy": 1.0,
            "log_vocab": 10.0}
    assert step0_warnings(good) == []
    w = step0_warnings({**good, "shared_mass": 0.1, "teacher_nll": 9.5})
    assert len(w) == 3 and "shared" in w[0] and "much larger" in w[1] and "near-uniform" in w[2]
    assert "no response tokens" in step0_warnings({"positions": 0})[0]


def test_step0_agrees_with_teacher_scoring(embedded):
    """Same row convention as the trainer's teacher scorer (score_sequences, upstream's layout)."""
    import torch
    from transformers import AutoModelForCausalLM

    from opd_patches.checks.preflight import step0_stats
    from opd_patches.teacher.scoring import score_sequences

    student = AutoModelForCausalLM.from_pretrained(embedded["student"]).eval()
    teacher = AutoModelForCausalLM.from_pretrained(embedded["teacher"]).eval()
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 448, (n,), generator=gen).tolist() for n in (12, 20)]
    starts = [5, 9]
    s = step0_stats(student, teacher, seqs, starts, topk=8, chunk_size=4)  # several chunks per sequence
    lp0, _ = score_sequences(teacher, [torch.tensor(x) for x in seqs], k=0)
    lpk, _ = score_sequences(teacher, [torch.tensor(x) for x in seqs], k=8)
    # Row t predicts token t+1: the response tokens seq[start:] are predicted by rows start-1 .. L-2.
    rows0 = torch.cat([lp[st - 1 : len(x) - 1, 0] for lp, st, x in zip(lp0, starts, seqs)])
    rowsk = torch.cat([lp[st - 1 : len(x) - 1] for lp, st, x in zip(lpk, starts, seqs)])
    assert s["positions"] == rows0.numel() == 7 + 11
    assert s["teacher_nll"] == pytest.approx(-rows0.double().mean().item(), abs=1e-5)
    assert s["teacher_topk_mass"] == pytest.approx(rowsk.double().exp().sum(-1).mean().item(), abs=1e-5)


# ---- integration into opd_patches.main (opd.preflight); skipped until main.run_preflight exists.


def _composed(embedded, tmp_path, *overrides, teacher=None):
    from composed import compose_recipe

    return compose_recipe(
        "topk",
        f"actor_rollout_ref.model.path={embedded['student']}",
        f"distillation.teacher_models.teacher_model.model_path={teacher or embedded['teacher']}",
        f"data.train_files={embedded['train']}", f"data.val_files={embedded['val']}",
        f"trainer.default_local_dir={tmp_path / 'run'}", "+device=cpu", *overrides,
    )


@pytest.fixture
def main_module():
    from opd_patches import main as m

    if not hasattr(m, "run_preflight"):
        pytest.skip("opd.preflight integration not applied to opd_patches.main")
    return m


def test_prepare_writes_cheap_preflight(embedded, tmp_path, main_module):
    run_dir = main_module.prepare(_composed(embedded, tmp_path))
    report = json.loads((run_dir / "preflight.json").read_text())
    assert report["ok"] and report["mode"] == "cheap" and "step0" not in report
    assert report["chat_template"]["identical"]


def test_prepare_full_and_off(embedded, tmp_path, main_module):
    run_dir = main_module.prepare(_composed(embedded, tmp_path, "opd.preflight=full"))
    assert json.loads((run_dir / "preflight.json").read_text())["step0"]["positions"] > 0
    (run_dir / "preflight.json").unlink()
    main_module.prepare(_composed(embedded, tmp_path, "opd.preflight=off"))
    assert not (run_dir / "preflight.json").exists()
    with pytest.raises(main_module.ConfigError, match="opd.preflight='fast'"):
        main_module.prepare(_composed(embedded, tmp_path, "opd.preflight=fast"))


def test_prepare_refuses_template_mismatch(embedded, other_template, tmp_path, main_module):
    with pytest.raises(main_module.ConfigError, match=r"teacher_model\.model_path \(pre-flight.*chat templates differ"):
        main_module.prepare(_composed(embedded, tmp_path, teacher=other_template))
