"""Export validation: is a saved Hugging Face export a usable model?

    python -m opd_patches.validate EXPORT_DIR [--initial MODEL_DIR] [--json OUT]

Checks, in order, and stops at the first failure with the reason:
config, tokenizer and generation config present; loads with `AutoModelForCausalLM`; parameter
count equals the count implied by its config; every weight finite; (with --initial) weights
differ from the initial model, i.e. training moved them; a short greedy generation runs.
Exit 0 and a JSON result when valid, exit 1 naming the failed check otherwise.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

GENERATE_TOKENS = 4


class ExportInvalid(Exception):
    """An export failed a check; the message names the check and the folder."""


def expected_parameter_count(config) -> int:
    """Parameters implied by a model config, counted on a meta-device instance (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _require(ok: bool, check: str, detail: str, export: Path) -> None:
    if not ok:
        raise ExportInvalid(f"{export}: {check}: {detail}")


def validate_export(export: Path, initial: Path | None = None) -> dict:
    """Validate one export folder; returns the measured facts or raises ExportInvalid."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    export = Path(export)
    _require(export.is_dir(), "exists", "no such folder", export)
    _require((export / "config.json").exists(), "config", "config.json missing", export)
    _require(
        any((export / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")),
        "tokenizer",
        "no tokenizer.json / tokenizer_config.json",
        export,
    )
    _require((export / "generation_config.json").exists(), "generation config", "generation_config.json missing", export)
    weights = sorted(p.name for p in export.glob("*.safetensors")) + sorted(p.name for p in export.glob("*.bin"))
    _require(bool(weights), "weights", "no *.safetensors or *.bin weight files (was hf_model in save_contents?)", export)

    config = AutoConfig.from_pretrained(export)
    try:
        model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    except Exception as exc:  # any loading error makes the export unusable
        raise ExportInvalid(f"{export}: load: {type(exc).__name__}: {exc}") from exc
    count = sum(p.numel() for p in model.parameters())
    expected = expected_parameter_count(config)
    _require(count == expected, "parameter count", f"{count:,} loaded, {expected:,} expected from config.json", export)
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    _require(not bad, "finite weights", f"non-finite values in {bad[:3]}", export)

    result = {"export": str(export), "parameters": count, "dtype": str(config.dtype), "weights": weights}
    if initial is not None:
        ref = AutoModelForCausalLM.from_pretrained(initial, dtype=torch.float32).state_dict()
        own = model.state_dict()
        _require(set(ref) == set(own), "same architecture as initial", f"parameter names differ from {initial}", export)
        delta = max((own[k] - ref[k]).abs().max().item() for k in own)
        _require(delta > 0, "trained", f"weights identical to the initial model {initial}", export)
        result["max_abs_change_vs_initial"] = delta

    tokenizer = AutoTokenizer.from_pretrained(export)
    GenerationConfig.from_pretrained(export)
    prompt = tokenizer("1 + 1 =", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=GENERATE_TOKENS, min_new_tokens=GENERATE_TOKENS, do_sample=False)
    new = out[0, prompt["input_ids"].shape[1] :]
    _require(new.numel() == GENERATE_TOKENS, "generate", f"{new.numel()} tokens generated", export)
    result["generated"] = tokenizer.decode(new)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="folder of the HF export (e.g. .../global_step_2/actor/huggingface)")
    parser.add_argument("--initial", type=Path, help="the model training started from; the export must differ")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    try:
        result = {"valid": True, **validate_export(args.export, args.initial)}
    except ExportInvalid as exc:
        result = {"valid": False, "reason": str(exc)}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(("export valid: " if result["valid"] else "export INVALID: ") + json.dumps(result))
    return 0 if result["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
