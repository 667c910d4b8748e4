"""Bad inputs are refused at the door (opd_patches/checks): each bad file is built here, the refusal must
name the file (and row and column), and the launches exit 2 with no traceback and no Ray started.

The checks themselves are called in this process (fast); three real `run.sh` launches prove the contract
end to end: a raw-download parquet, a missing model, EMBEDDED beside explicit paths."""

import json
from pathlib import Path

import launch
import pandas as pd
import pytest

from opd_patches.checks import InputError
from opd_patches.checks.data import check_eval_jsonl, check_rl_parquet
from opd_patches.checks.models import check_model



def good_row(problem="What is 1 + 1?", answer="2"):
    return {"data_source": "math", "prompt": [{"role": "user", "content": problem}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer}}


def write(tmp_path, rows, name="train.parquet"):
    path = tmp_path / name
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


def test_a_good_file_passes_and_counts_rows(tmp_path):
    report = check_rl_parquet(write(tmp_path, [good_row(), good_row("What is 2 + 2?", "4")]), "data.train_files")
    assert report == {"rows": 2, "checked": 2, "too_long": None}


@pytest.mark.parametrize("rows, match", [
    ([{"prompt": "What is 1 + 1?", "data_source": "math"}], r"no column reward_model.*make data SRC="),
    ([{**good_row(), "prompt": "What is 1 + 1?"}], r"row 0, column prompt: a plain string"),
    ([good_row(), {**good_row(), "prompt": []}], r"row 1, column prompt: an empty list"),
    ([good_row(), good_row(), {**good_row(), "prompt": [{"role": "user"}]}], r"row 2, column prompt: message 0"),
    ([{**good_row(), "reward_model": {"style": "rule", "ground_truth": ""}}], r"row 0, column reward_model:.*no ground_truth"),
    ([{**good_row(), "data_source": ""}], r"row 0, column data_source"),
])
def test_bad_rows_are_named_by_file_row_and_column(tmp_path, rows, match):
    path = write(tmp_path, rows)
    with pytest.raises(InputError, match=match) as err:
        check_rl_parquet(path, "data.train_files")
    assert f"data.train_files={path}" in str(err.value)


def test_empty_csv_and_missing_files_are_refused(tmp_path):
    empty = tmp_path / "empty.parquet"
    pd.DataFrame({"prompt": pd.Series([], dtype=object), "data_source": pd.Series([], dtype=str),
                  "reward_model": pd.Series([], dtype=object)}).to_parquet(empty)
    with pytest.raises(InputError, match="has no rows"):
        check_rl_parquet(empty, "data.val_files")
    csv = tmp_path / "train.parquet"
    csv.write_text("prompt,answer\nWhat is 1 + 1?,2\n")
    with pytest.raises(InputError, match="not a readable parquet file"):
        check_rl_parquet(csv, "data.train_files")
    with pytest.raises(InputError, match="no such file"):
        check_rl_parquet(tmp_path / "nope.parquet", "data.train_files")


def test_prompts_over_the_length_limit_are_counted_and_all_over_is_refused(tmp_path, embedded):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded["student"])
    path = write(tmp_path, [good_row(), good_row("What is " + " + ".join(["1"] * 60) + "?")])
    assert check_rl_parquet(path, "data.train_files", tok, 40)["too_long"] == 1
    with pytest.raises(InputError, match="all 2 prompts.*data.max_prompt_length=5"):
        check_rl_parquet(path, "data.train_files", tok, 5)


def test_model_folders_are_checked(tmp_path, embedded):
    assert check_model(embedded["student"], "STUDENT") == Path(embedded["student"])
    with pytest.raises(InputError, match=r"STUDENT=/no/such/model: no such file"):
        check_model("/no/such/model", "STUDENT")
    with pytest.raises(InputError, match=r"TEACHER=nobody/no-such-model: .*not in the local Hugging Face cache"):
        check_model("nobody/no-such-model", "TEACHER")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    with pytest.raises(InputError, match=r"lacks weights .*a tokenizer"):
        check_model(partial, "MODEL")
    import shutil

    no_template = shutil.copytree(embedded["student"], tmp_path / "no-template")
    cfg = json.loads((no_template / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in ("chat_template.jinja", "chat_template.json"):
        (no_template / f).unlink(missing_ok=True)
    with pytest.raises(InputError, match="no chat template"):
        check_model(no_template, "STUDENT")


def test_eval_jsonl_lines_are_checked(tmp_path):
    path = tmp_path / "suite.jsonl"
    path.write_text('{"id": "a", "problem": "1+1?", "answer": "2"}\nnot json\n')
    with pytest.raises(InputError, match=r"suite.jsonl:2: not a JSON object"):
        check_eval_jsonl(path)
    path.write_text('{"id": "a", "problem": "1+1?"}\n')
    with pytest.raises(InputError, match=r"suite.jsonl:1: no answer"):
        check_eval_jsonl(path)




@pytest.mark.slow
def test_run_sh_refuses_bad_inputs_before_ray(tmp_path, embedded):
    raw = write(tmp_path, [{"prompt": "What is 1 + 1?", "solution": "2"}], "raw.parquet")
    last = launch.refused(tmp_path, embedded, TRAIN_FILES=str(raw), VAL_FILES=str(raw))
    assert f"data.train_files={raw}" in last and "make data SRC=" in last
    last = launch.refused(tmp_path, embedded, TEACHER=str(tmp_path / "missing-teacher"))
    assert f"distillation.teacher_models.teacher_model.model_path={tmp_path / 'missing-teacher'}" in last
    last = launch.refused(tmp_path, embedded, EMBEDDED="1")
    assert "EMBEDDED=1" in last and "STUDENT TEACHER TRAIN_FILES VAL_FILES" in last


def test_make_data_sources_are_checked(tmp_path):
    from opd_patches.data import files, prepare

    src = tmp_path / "raw.jsonl"
    src.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?", "answer": \n')
    assert prepare.main([str(src), "--out", str(tmp_path / "out"), "--no-decontaminate"]) == 2
    with pytest.raises(InputError, match=r"raw.jsonl:2: not a JSON object"):
        files.read_rows(src)
    fake = tmp_path / "raw.parquet"
    fake.write_text("problem,answer\n1+1?,2\n")
    with pytest.raises(InputError, match=r"raw.parquet: not a readable parquet file"):
        files.read_rows(fake)


def test_make_eval_of_a_missing_model_is_refused_and_leaves_nothing(tmp_path, capsys):
    from opd_patches.eval.cli import main as eval_main

    out = tmp_path / "eval"
    assert eval_main(["--model", str(tmp_path / "missing"), "--suite", "embedded", "--out", str(out)]) == 2
    assert f"MODEL={tmp_path / 'missing'}: no such file" in capsys.readouterr().err
    assert not (out / "eval_config.json").exists()
