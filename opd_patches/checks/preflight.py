"""Pre-flight compatibility report for a student/teacher pair, before any training starts.

    python -m opd_patches.checks.preflight --student S --teacher T [--data train.parquet] [--prompts 4]
        [--max-new-tokens 32] [--topk 16] [--greedy] [--seed 0] [--cheap] [--out report.json]

Errors (`PreflightError`, exit status 2; the pair cannot be distilled token by token as configured):
1. vocabularies differ (`opd_patches.checks.compat.check_vocab`: token -> id map and config vocab_size);
2. chat templates differ: the same real prompts (the data parquet's `prompt` column, else a fixed math
   prompt) rendered with `apply_chat_template(..., add_generation_prompt=True)` by each tokenizer must
   be identical strings (the error names the first differing character and both renderings there),
   and both tokenizers must encode the rendering to the same ids.

Step-0 statistics (skipped with `--cheap`): the student samples a short response to each prompt
(transformers `generate`, temperature 1 with a fixed seed, or `--greedy`); on every position the
student visited (the rows that predict a response token) both models' full distributions are compared
in chunks of positions (never (T, V) for a long batch):
- `topk_overlap`: |teacher top-k ∩ student top-k| / k, mean over positions;
- `shared_mass`: sum_v min(p_S(v), p_T(v)) (1 - total variation), mean;
- `teacher_topk_mass`: the teacher's mass on its own top-k (what a top-k loss sees of the teacher);
- `student_mass_on_teacher_topk`: the student's mass on the teacher's top-k;
- `teacher_nll` / `student_nll`: mean -log p of the student's sampled tokens under each model;
- `reverse_kl`: mean KL(p_S || p_T) (what the k1 estimator estimates), `teacher_entropy`, `log_vocab`.
Suspicious values become warnings in the report (not errors): shared mass < 0.2, teacher NLL much
larger than the student's, a near-uniform teacher.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from opd_patches.checks import compat

FALLBACK_PROMPT = [
    {
        "role": "user",
        "content": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?\n"
        "Please reason step by step, and put your final answer within \\boxed{}.",
    }
]

# Warning thresholds (documented in the report's "thresholds").
SHARED_MASS_MIN = 0.2
NLL_RATIO_MAX = 2.0  # teacher NLL > ratio * student NLL + margin
NLL_MARGIN = 1.0  # nats
UNIFORM_FRACTION = 0.9  # teacher NLL or entropy >= this fraction of log V: near-uniform

SNIPPET = 40  # characters either side of a template difference


class PreflightError(compat.IncompatibleModels):
    """The student and teacher are incompatible as configured; the message says why and what differs."""


# ---------------------------------------------------------------- prompts


def load_prompts(data: str | Path | None, n: int) -> tuple[list[list[dict]], str]:
    """The first n chat prompts of a VERL parquet (`prompt`: a list of {role, content}), else the fallback."""
    if data is None:
        return [FALLBACK_PROMPT], "fixed math prompt"
    import pandas as pd

    frame = pd.read_parquet(str(data), columns=["prompt"])
    prompts = []
    for value in frame["prompt"].head(max(int(n), 1)):
        if isinstance(value, str):  # a plain-text prompt column
            prompts.append([{"role": "user", "content": value}])
        else:
            prompts.append([{"role": str(m["role"]), "content": str(m["content"])} for m in value])
    if not prompts:
        return [FALLBACK_PROMPT], f"fixed math prompt ({data} has no rows)"
    return prompts, f"{data} (first {len(prompts)} rows)"


# ---------------------------------------------------------------- cheap checks


def _template_source(tokenizer, path: str) -> str:
    local = compat._local(path)
    if local is not None and (local / "chat_template.jinja").exists():
        return str(local / "chat_template.jinja")
    return f"{path} (tokenizer_config.json chat_template)"


def _render(tokenizer, messages, who: str, path: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise PreflightError(
            f"the {who} {path} has no chat template (neither chat_template.jinja nor tokenizer_config.json "
            "chat_template): the prompts cannot be rendered as the other model sees them."
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def first_difference(a: str, b: str) -> int:
    """Index of the first differing character (len of the shorter string if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def check_chat_template(student: str, teacher: str, prompts: list[list[dict]], tokenizers: dict | None = None) -> dict:
    """Both tokenizers render (and encode) every prompt identically; raise PreflightError otherwise.
    `tokenizers`: {path: tokenizer} already loaded (compat.load_tokenizers), else loaded here."""
    tokenizers = tokenizers if tokenizers is not None else compat.load_tokenizers(student, teacher)
    s_tok, t_tok = tokenizers[student], tokenizers[teacher]
    for i, messages in enumerate(prompts):
        s_text = _render(s_tok, messages, "student", student)
        t_text = _render(t_tok, messages, "teacher", teacher)
        if s_text != t_text:
            pos = first_difference(s_text, t_text)
            lo = max(0, pos - SNIPPET)
            raise PreflightError(
                f"chat templates differ: prompt {i} renders differently from character {pos} on "
                f"(student {len(s_text)} chars, teacher {len(t_text)} chars).\n"
                f"  student chat template {_template_source(s_tok, student)}: ...{s_text[lo:pos + SNIPPET]!r}\n"
                f"  teacher chat template {_template_source(t_tok, teacher)}: ...{t_text[lo:pos + SNIPPET]!r}\n"
                "The teacher would score prompts rendered in the student's format. Give both models the same "
                "chat template (copy chat_template.jinja / tokenizer_config.json's chat_template) or pick a "
                "teacher trained with the student's template."
            )
        s_ids = s_tok(s_text, add_special_tokens=False)["input_ids"]
        t_ids = t_tok(t_text, add_special_tokens=False)["input_ids"]
        if s_ids != t_ids:
            pos = first_difference(s_ids, t_ids)
            raise PreflightError(
                f"tokenizers differ: prompt {i} (identical rendering) encodes to different ids from token {pos} on "
                f"(student {s_ids[pos:pos + 8]}, teacher {t_ids[pos:pos + 8]}): same vocabulary but different "
                "merges/normalisation. Distill only between models that share a tokenizer."
            )
    warnings = []
    if s_tok.eos_token != t_tok.eos_token:
        warnings.append(
            f"eos tokens differ (student {s_tok.eos_token!r}, teacher {t_tok.eos_token!r}): the student stops on its own "
            "eos; the teacher may not expect a response to end there."
        )
    return {
        "identical": True,
        "prompts_checked": len(prompts),
        "example_rendering": _render(s_tok, prompts[0], "student", student),
        "warnings": warnings,
    }


# ---------------------------------------------------------------- step-0 statistics


def _load_model(path: str, device, dtype):
    from transformers import AutoModelForCausalLM

    kwargs = {} if compat._local(path) else {"local_files_only": True}
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs)
    return model.to(device).eval()


def _sample(model, tokenizer, prompt_ids, max_new_tokens: int, greedy: bool, seed: int):
    """The student's response ids (eos included when reached) for one prompt."""
    import torch

    torch.manual_seed(seed)
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, **sampling,
    )
    return out[0, len(prompt_ids):].tolist()


def _response_logprobs(model, seq, start: int, chunk_size: int):
    """Yield (positions slice, fp32 log-probs (n, V)) for the rows predicting seq[start:], chunk by chunk."""
    import torch

    from opd_patches.teacher.scoring import _logits_fn

    device = next(model.parameters()).device
    head = _logits_fn(model)
    ids = torch.tensor([seq], dtype=torch.long, device=device)
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0]
    rows = hidden[start - 1 : len(seq) - 1]  # row t predicts token t+1
    for lo in range(0, rows.shape[0], chunk_size):
        hi = min(lo + chunk_size, rows.shape[0])
        yield lo, hi, torch.log_softmax(head(rows[lo:hi]).float(), dim=-1)


def step0_stats(student_model, teacher_model, sequences, prompt_lengths, topk: int, chunk_size: int = 256) -> dict:
    """Compare both full distributions on every response position of `sequences` (prompt + response ids)."""
    import torch

    sums = dict.fromkeys(
        ("topk_overlap", "shared_mass", "teacher_topk_mass", "student_mass_on_teacher_topk",
         "teacher_nll", "student_nll", "reverse_kl", "teacher_entropy"), 0.0,
    )
    positions, vocab = 0, None
    with torch.inference_mode():
        for seq, start in zip(sequences, prompt_lengths):
            if len(seq) <= start:
                continue  # empty response
            targets = torch.tensor(seq[start:], dtype=torch.long)
            for (lo, hi, s_lp), (_, _, t_lp) in zip(
                _response_logprobs(student_model, seq, start, chunk_size),
                _response_logprobs(teacher_model, seq, start, chunk_size),
            ):
                if s_lp.shape[-1] != t_lp.shape[-1]:
                    raise PreflightError(
                        f"output widths differ: student lm_head gives {s_lp.shape[-1]} logits, teacher {t_lp.shape[-1]}."
                    )
                vocab = s_lp.shape[-1]
                k = min(topk, vocab)
                t_lp = t_lp.to(s_lp.device)
                tgt = targets[lo:hi].to(s_lp.device)[:, None]
                s_p, t_p = s_lp.exp(), t_lp.exp()
                t_top = t_lp.topk(k, dim=-1).indices
                s_top = s_lp.topk(k, dim=-1).indices
                overlap = (t_top[:, :, None] == s_top[:, None, :]).any(-1).sum(-1).double() / k
                sums["topk_overlap"] += overlap.sum().item()
                sums["shared_mass"] += torch.minimum(s_p, t_p).sum(-1).double().sum().item()
                sums["teacher_topk_mass"] += t_p.gather(-1, t_top).sum(-1).double().sum().item()
                sums["student_mass_on_teacher_topk"] += s_p.gather(-1, t_top).sum(-1).double().sum().item()
                sums["teacher_nll"] -= t_lp.gather(-1, tgt).double().sum().item()
                sums["student_nll"] -= s_lp.gather(-1, tgt).double().sum().item()
                kl = torch.where(s_p > 0, s_p * (s_lp - t_lp), torch.zeros_like(s_p)).sum(-1)
                sums["reverse_kl"] += kl.double().sum().item()
                ent = -torch.where(t_p > 0, t_p * t_lp, torch.zeros_like(t_p)).sum(-1)
                sums["teacher_entropy"] += ent.double().sum().item()
                positions += hi - lo
    stats = {key: (value / positions if positions else None) for key, value in sums.items()}
    stats.update(positions=positions, topk=topk, vocab=vocab, log_vocab=math.log(vocab) if vocab else None)
    return stats


def step0_warnings(stats: dict) -> list[str]:
    if not stats.get("positions"):
        return ["the student produced no response tokens: no step-0 statistics (raise --max-new-tokens?)"]
    warnings = []
    if stats["shared_mass"] < SHARED_MASS_MIN:
        warnings.append(
            f"shared probability mass {stats['shared_mass']:.3f} < {SHARED_MASS_MIN}: the teacher and student "
            "distributions barely overlap on the student's own samples (a top-k loss sees little of the student's mass)."
        )
    if stats["teacher_nll"] > NLL_RATIO_MAX * stats["student_nll"] + NLL_MARGIN:
        warnings.append(
            f"teacher NLL of the student's samples {stats['teacher_nll']:.3f} is much larger than the student's own "
            f"{stats['student_nll']:.3f} (> {NLL_RATIO_MAX:g}x + {NLL_MARGIN:g} nat): the teacher finds the student's "
            "text very unlikely (different format, template or domain?)."
        )
    log_v = stats["log_vocab"]
    if stats["teacher_nll"] >= UNIFORM_FRACTION * log_v or stats["teacher_entropy"] >= UNIFORM_FRACTION * log_v:
        warnings.append(
            f"near-uniform teacher: NLL {stats['teacher_nll']:.3f}, entropy {stats['teacher_entropy']:.3f} vs "
            f"log V = {log_v:.3f} (>= {UNIFORM_FRACTION:g} log V): untrained or weightless teacher?"
        )
    return warnings


def _device_dtype(device: str | None, dtype: str | None):
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype in (None, "auto"):
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        dt = getattr(torch, dtype)
    return dev, dt


# ---------------------------------------------------------------- the report


def run_preflight(
    student: str,
    teacher: str,
    data: str | Path | None = None,
    *,
    prompts: int = 4,
    max_new_tokens: int = 32,
    topk: int = 16,
    greedy: bool = False,
    seed: int = 0,
    full: bool = True,
    strict: bool = True,
    device: str | None = None,
    dtype: str | None = None,
    chunk_size: int = 256,
    out: str | Path | None = None,
    tokenizers: dict | None = None,
) -> dict:
    """The pre-flight report (a JSON-able dict); raises PreflightError on an incompatibility.

    full=False runs only the cheap checks (vocabulary, chat template; no model weights loaded).
    strict=False returns a report with `skipped` instead of raising when a model is not available locally
    (a hub id not in the cache); strict=True raises PreflightError then.
    out: also write the report there (written with `ok: false` and the error before raising).
    tokenizers: {path: tokenizer} already loaded (compat.load_tokenizers; main.py shares them with its own
    checks); else each model's tokenizer is loaded here, once.
    """
    student, teacher = str(student), str(teacher)
    t0 = time.perf_counter()
    report: dict = {
        "student": student, "teacher": teacher, "data": str(data) if data is not None else None, "ok": False,
        "mode": "full" if full else "cheap", "warnings": [], "timing_s": {},
        "settings": {"prompts": prompts, "max_new_tokens": max_new_tokens, "topk": topk, "greedy": greedy, "seed": seed},
        "thresholds": {"shared_mass_min": SHARED_MASS_MIN, "nll_ratio_max": NLL_RATIO_MAX, "nll_margin": NLL_MARGIN,
                       "uniform_fraction": UNIFORM_FRACTION},
    }
    try:
        tokenizers = tokenizers if tokenizers is not None else compat.load_tokenizers(student, teacher)
        try:
            report["vocab"] = compat.check_vocab(student, teacher, tokenizers)
        except compat.IncompatibleModels as exc:
            raise PreflightError(f"vocabulary mismatch: {exc}") from exc
        if not report["vocab"].get("checked"):
            if strict:
                raise PreflightError(f"cannot run the pre-flight: {report['vocab']['reason']}")
            report.update(ok=True, skipped=report["vocab"]["reason"])
            return report
        messages, source = load_prompts(data, prompts)
        report["prompt_source"] = source
        report["chat_template"] = check_chat_template(student, teacher, messages, tokenizers)
        report["warnings"] += report["chat_template"].pop("warnings")
        report["timing_s"]["cheap"] = round(time.perf_counter() - t0, 3)
        if full:
            t1 = time.perf_counter()
            dev, dt = _device_dtype(device, dtype)
            tok = tokenizers[student]
            s_model = _load_model(student, dev, dt)
            t_model = s_model if Path(student).expanduser().resolve() == Path(teacher).expanduser().resolve() \
                else _load_model(teacher, dev, dt)
            report["timing_s"]["load"] = round(time.perf_counter() - t1, 3)
            t2 = time.perf_counter()
            sequences, starts, lengths = [], [], []
            for i, m in enumerate(messages):
                p_ids = tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)["input_ids"]
                r_ids = _sample(s_model, tok, p_ids, max_new_tokens, greedy, seed + i)
                sequences.append(p_ids + r_ids)
                starts.append(len(p_ids))
                lengths.append(len(r_ids))
            report["timing_s"]["generate"] = round(time.perf_counter() - t2, 3)
            t3 = time.perf_counter()
            stats = step0_stats(s_model, t_model, sequences, starts, topk, chunk_size)
            stats.update(device=str(dev), dtype=str(dt).replace("torch.", ""), response_lengths=lengths,
                         example_response=tok.decode(sequences[0][starts[0]:]))
            report["step0"] = stats
            report["warnings"] += step0_warnings(stats)
            report["timing_s"]["score"] = round(time.perf_counter() - t3, 3)
        report["ok"] = True
        return report
    except PreflightError as exc:
        report["error"] = str(exc)
        raise
    finally:
        report["timing_s"]["total"] = round(time.perf_counter() - t0, 3)
        if out is not None:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(report, indent=2, default=str) + "\n")


def format_report(report: dict) -> str:
    """A short human-readable summary."""
    lines = [f"[preflight] student {report['student']}", f"[preflight] teacher {report['teacher']}"]
    if report.get("skipped"):
        lines.append(f"[preflight] skipped: {report['skipped']}")
        return "\n".join(lines)
    vocab = report.get("vocab", {})
    lines.append(f"  vocabulary      identical ({vocab.get('tokens')} tokens, vocab_size {vocab.get('vocab_size')})")
    ct = report.get("chat_template", {})
    lines.append(f"  chat template   identical on {ct.get('prompts_checked')} prompt(s) from {report.get('prompt_source')}")
    s = report.get("step0")
    if s and s.get("positions"):
        lines += [
            f"  step 0          {s['positions']} student-sampled positions, k={s['topk']}, V={s['vocab']} ({s['device']}, {s['dtype']})",
            f"    top-k overlap (teacher vs student)   {s['topk_overlap']:.3f}",
            f"    shared mass  sum min(pS, pT)         {s['shared_mass']:.3f}",
            f"    teacher mass on its top-k            {s['teacher_topk_mass']:.3f}",
            f"    student mass on teacher's top-k      {s['student_mass_on_teacher_topk']:.3f}",
            f"    NLL of student samples  teacher {s['teacher_nll']:.3f}  student {s['student_nll']:.3f}"
            f"  (log V = {s['log_vocab']:.3f})",
            f"    KL(student || teacher)               {s['reverse_kl']:.3f}",
        ]
    elif report.get("mode") == "cheap":
        lines.append("  step 0          not computed (cheap mode)")
    for w in report.get("warnings", []):
        lines.append(f"  WARNING: {w}")
    lines.append(f"[preflight] ok ({report['timing_s'].get('total', 0):.1f} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opd_patches.checks.preflight", description=__doc__.split("\n\n")[0])
    parser.add_argument("--student", required=True)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--data", default=None, help="VERL parquet with a `prompt` column (default: a fixed math prompt)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--topk", type=int, default=16)
    parser.add_argument("--greedy", action="store_true", help="greedy decoding instead of temperature 1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cheap", action="store_true", help="vocabulary and chat template only (no model weights)")
    parser.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", help="float32 / bfloat16 / auto (bf16 on CUDA)")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    try:
        report = run_preflight(
            args.student, args.teacher, args.data, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
            topk=args.topk, greedy=args.greedy, seed=args.seed, full=not args.cheap, device=args.device,
            dtype=args.dtype, out=args.out,
        )
    except PreflightError as exc:
        print(f"[preflight] error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(format_report(report), flush=True)
    if args.out:
        print(f"[preflight] report written to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
