"""Model fixtures and independent references shared by the rollout and teacher tests
(test_hf_rollout.py, test_colocated_teacher.py): a sharpened copy of an embedded model, VERL's own
vLLM prompt-log-prob extractor and the vLLM output it reads."""

import ast
import importlib.util
import types
from pathlib import Path
from typing import Optional

import pytest

from conftest import sharpened


def sharp_path_fixture(which: str, seed: int, scope: str = "module"):
    """A fixture: the embedded `which` ("student"/"teacher") with its matrices re-drawn at std 0.3 (same
    architecture, tokenizer and configs), so greedy outputs and top-k orders are far from ties."""

    @pytest.fixture(scope=scope)
    def sharp_path(embedded, tmp_path_factory):
        return sharpened(embedded[which], tmp_path_factory.mktemp(f"sharp_{which}"), seed=seed)

    return sharp_path


def upstream_extractor():
    """VERL's `extract_prompt_logprobs`, taken verbatim from the installed verl.

    Its module imports vLLM at the top, which this CPU venv does not have, so the function's own
    source is compiled on its own (it only needs `Optional` and the `RequestOutput` annotation).
    """
    root = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
    tree = ast.parse((root / "workers/rollout/vllm_rollout/utils.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "extract_prompt_logprobs")
    ns = {"Optional": Optional, "RequestOutput": object}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "verl_extract_prompt_logprobs", "exec"), ns)
    return ns["extract_prompt_logprobs"]


def fake_vllm_output(logp, ids, k):
    """What vLLM returns for `prompt_logprobs=k`: None for token 0, then for each later prompt token a
    {token_id: Logprob(logprob, rank)} dict holding that token and (k > 0) the top-k tokens."""
    entries = [None]
    for j in range(1, len(ids)):
        row, tok = logp[j - 1], ids[j]
        rank = lambda t: int((row > row[t]).sum()) + 1  # noqa: E731  (vLLM's 1-based rank)
        d = {tok: types.SimpleNamespace(logprob=row[tok].item(), rank=rank(tok))}
        if k > 0:
            for t in row.topk(k).indices.tolist():
                d[t] = types.SimpleNamespace(logprob=row[t].item(), rank=rank(t))
        entries.append(d)
    return types.SimpleNamespace(prompt_logprobs=entries)
