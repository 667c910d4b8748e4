"""Export validation: is a saved Hugging Face export a usable model?

    python -m opd_patches.ops.validate PATH [--initial MODEL_DIR] [--expected-params N | --expected-from MODEL]
                                        [--dtype float32] [--load-dtype float32] [--json OUT]

PATH is an export folder (`.../global_step_N/actor/huggingface`), a state folder (`global_step_N`)
or a run folder (its newest complete state, else its newest state folder).

Checks, in order, and stops at the first failure with the reason:
config, tokenizer and generation config present; weight files present; stored dtype (one floating
dtype for every tensor, equal to --dtype when given); loads with `AutoModelForCausalLM`; parameter
count equals the expected one (--expected-params; or the count known for the model named by
--expected-from, 1,777,088,000 for DeepSeek-R1-Distill-Qwen-1.5B, else derived from that model's
config; default: derived from the export's own config); every weight finite; (with --initial)
weights differ from the initial model, i.e. training moved them; a short greedy generation runs.
Exit 0 and a JSON result when valid, exit 1 naming the failed check otherwise. The result's
`checks` maps each check passed to what was measured (the trainer stores it in the receipt), `seconds`
what each stage took.

The model is loaded in the dtype its tensors are stored in (--load-dtype overrides; float32 for .bin
exports), as vLLM and the evaluation load it: an upcast to float32 doubles the bytes every check reads.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

GENERATE_TOKENS = 4
# Parameter counts of known students, by the last component of their hub id or folder name.
KNOWN_PARAMETER_COUNTS = {"DeepSeek-R1-Distill-Qwen-1.5B": 1_777_088_000}
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class ExportInvalid(Exception):
    """An export failed a check; the message names the check and the folder; `checks` = those passed."""

    def __init__(self, message: str, checks: dict | None = None):
        super().__init__(message)
        self.checks = dict(checks or {})


def expected_parameter_count(config) -> int:
    """Parameters implied by a model config, counted on a meta-device instance (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def expected_parameters_for(model: str) -> int:
    """Expected count for a student given by hub id or folder: the known figure, else its config's count."""
    from transformers import AutoConfig

    name = str(model).rstrip("/").split("/")[-1]
    if name in KNOWN_PARAMETER_COUNTS:
        return KNOWN_PARAMETER_COUNTS[name]
    return expected_parameter_count(AutoConfig.from_pretrained(model))


def resolve_export(path: Path) -> Path:
    """An export folder from an export, state (global_step_N) or run folder."""
    path = Path(path)
    if (path / "config.json").exists() or not path.is_dir():
        return path
    if (path / "actor" / "huggingface").is_dir():
        return path / "actor" / "huggingface"
    from opd_patches.ops import checkpoints

    state = checkpoints.newest_complete(path)
    if state is None:
        states = checkpoints.list_states(path)
        state = states[-1]["path"] if states else None
    return path if state is None else state / "actor" / "huggingface"


def stored_dtypes(export: Path) -> set[str]:
    """Dtypes of the tensors stored in the export's safetensors files (empty for .bin exports)."""
    from safetensors import safe_open

    found = set()
    for f in sorted(export.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            found |= {st.get_slice(k).get_dtype() for k in st.keys()}
    return found


class _Checks:
    def __init__(self, export: Path):
        self.export, self.passed = export, {}

    def require(self, ok: bool, check: str, detail: str, measured=True) -> None:
        if not ok:
            raise ExportInvalid(f"{self.export}: {check}: {detail}", self.passed)
        self.passed[check] = measured


def validate_export(
    export: Path, initial: Path | None = None, expected_params: int | None = None, dtype: str | None = None,
    load_dtype: str | None = None,
) -> dict:
    """Validate one export folder; returns the measured facts (with `checks` and `seconds`) or raises
    ExportInvalid. load_dtype: the dtype to load in (default: the stored one, float32 for .bin files)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    export = Path(export)
    c = _Checks(export)
    seconds, t = {}, time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal t
        now = time.perf_counter()
        seconds[stage] = round(now - t, 3)
        t = now

    c.require(export.is_dir(), "exists", "no such folder")
    c.require((export / "config.json").exists(), "config", "config.json missing")
    c.require(
        any((export / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")),
        "tokenizer",
        "no tokenizer.json / tokenizer_config.json",
    )
    c.require((export / "generation_config.json").exists(), "generation config", "generation_config.json missing")
    weights = sorted(p.name for p in export.glob("*.safetensors")) + sorted(p.name for p in export.glob("*.bin"))
    c.require(bool(weights), "weights", "no *.safetensors or *.bin weight files (was hf_model in save_contents?)", weights)

    stored = stored_dtypes(export)
    if stored:
        names = {FLOAT_DTYPES.get(d, d) for d in stored}
        c.require(len(stored) == 1 and stored <= set(FLOAT_DTYPES), "dtype", f"stored tensor dtypes {sorted(names)}: "
                  "expected one floating dtype")
        c.require(dtype is None or names == {dtype}, "dtype", f"stored as {sorted(names)[0]}, expected {dtype}",
                  sorted(names)[0])

    config = AutoConfig.from_pretrained(export)
    stored_name = FLOAT_DTYPES[next(iter(stored))] if stored else None  # one floating dtype: checked above
    load_dtype = load_dtype or stored_name or "float32"
    lap("files")
    try:
        model = AutoModelForCausalLM.from_pretrained(export, dtype=getattr(torch, load_dtype))
    except Exception as exc:  # any loading error makes the export unusable
        raise ExportInvalid(f"{export}: load: {type(exc).__name__}: {exc}", c.passed) from exc
    c.passed["load"] = True
    lap("load")
    count = sum(p.numel() for p in model.parameters())
    source = "given" if expected_params is not None else "from config.json"
    expected = int(expected_params) if expected_params is not None else expected_parameter_count(config)
    c.require(count == expected, "parameter count", f"{count:,} loaded, {expected:,} expected ({source})", count)
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    c.require(not bad, "finite weights", f"non-finite values in {bad[:3]}")
    lap("finite")

    result = {"export": str(export), "parameters": count, "dtype": str(config.dtype), "weights": weights}
    if stored:
        result["stored_dtype"] = stored_name
    if initial is not None:
        ref = AutoModelForCausalLM.from_pretrained(initial, dtype=torch.float32).state_dict()
        own = model.state_dict()
        c.require(set(ref) == set(own), "same architecture as initial", f"parameter names differ from {initial}")
        delta = max((own[k].float() - ref[k]).abs().max().item() for k in own)
        c.require(delta > 0, "trained", f"weights identical to the initial model {initial}", delta)
        result["max_abs_change_vs_initial"] = delta
        lap("initial")

    tokenizer = AutoTokenizer.from_pretrained(export)
    GenerationConfig.from_pretrained(export)
    prompt = tokenizer("1 + 1 =", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=GENERATE_TOKENS, min_new_tokens=GENERATE_TOKENS, do_sample=False)
    new = out[0, prompt["input_ids"].shape[1] :]
    result["generated"] = tokenizer.decode(new)
    c.require(new.numel() == GENERATE_TOKENS, "generate", f"{new.numel()} tokens generated", result["generated"])
    lap("generate")
    result["checks"], result["loaded_as"], result["seconds"] = c.passed, load_dtype, seconds
    return result


def check(export: Path, initial: Path | None = None, expected_params: int | None = None, dtype: str | None = None,
          expected_from: str | None = None, load_dtype: str | None = None) -> dict:
    """`validate_export` as one JSON-able answer: {"valid": True, ...facts} or {"valid": False, "reason", "checks"}."""
    try:
        expected = expected_parameters_for(expected_from) if expected_from else expected_params
        return {"valid": True, **validate_export(export, initial, expected, dtype, load_dtype)}
    except ExportInvalid as exc:
        return {"valid": False, "reason": str(exc), "checks": exc.checks}
    except Exception as exc:  # e.g. an unreadable --expected-from config: still one answer
        return {"valid": False, "reason": f"{export}: {type(exc).__name__}: {exc}", "checks": {}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="export, state (global_step_N) or run folder")
    parser.add_argument("--initial", type=Path, help="the model training started from; the export must differ")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--expected-params", type=int, help="parameter count the export must have")
    group.add_argument("--expected-from", help="student (hub id or folder) whose parameter count the export must have")
    parser.add_argument("--dtype", help="dtype every stored tensor must have (e.g. float32, bfloat16)")
    parser.add_argument("--load-dtype", choices=sorted(set(FLOAT_DTYPES.values())),
                        help="load the model in this dtype (default: the stored one)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    export = resolve_export(args.export)
    result = check(export, args.initial, args.expected_params, args.dtype, expected_from=args.expected_from,
                   load_dtype=args.load_dtype)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(("export valid: " if result["valid"] else "export INVALID: ") + json.dumps(result))
    return 0 if result["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
