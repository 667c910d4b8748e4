"""The teacher-KL of a student: how far its own samples' next-token distributions are from the teacher's.

Definition (one estimator for every report of this project; not any training loss):

    teacher_kl = sum over sampled responses y ~ p_S(. | x) and their positions t of
                 KL(p_S(. | x, y_<t) || p_T(. | x, y_<t))        (nats; exact over the full vocabulary)
                 / number of those positions

i.e. the reverse KL per response token at the states the student visits, the divergence on-policy
distillation drives to 0 (K1's per-token advantage is its one-sample estimate; the top-k losses bound a
forward KL at the same states). Both distributions at temperature 1 from the models' raw logits; the
positions are the response's tokens up to and including its EOS; prompts are the suite's, rendered as in
evaluation (opd_patches/task/prompt.py). Samples: `samples` per question at temperature 1.0, top_p 1.0, drawn
batch by batch (BATCH sequences) from one generator seeded by the batch's first (question, sample) seed
(`sample_seed`), as the hf evaluation backend does: reproducible for the same questions and settings. `se_clustered`: the std of the
per-question means over sqrt(questions), as for pass@1. Both models must share the tokenizer; logits
beyond the tokenizer's length (a padded vocabulary) are dropped before the softmax.

HF transformers on one device (the CPU, or the first GPU): meant for the known-answer task's tiny models;
for a 1.5B model keep `questions` small (HF decoding is slow there).
"""

from __future__ import annotations

import math

from opd_patches.task import prompt as prompt_template
from opd_patches.eval.backends import sample_seed

BATCH = 64  # sequences per generate/forward call


def _load(path: str, device, torch):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


def measure(student: str, teacher: str, questions: list[dict], samples: int = 1, max_new_tokens: int = 48,
            seed: int = 0) -> dict:
    """{"teacher_kl", "se_clustered", "n_questions", "per_question" (each question's mean), "n_samples", "n_tokens",
    "definition"} (see module doc)."""
    import torch
    from transformers import AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(student)
    s_model, t_model = _load(student, device, torch), _load(teacher, device, torch)
    vocab = len(tok)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    jobs = [(q, k) for q in questions for k in range(samples)]
    per_question: dict[str, list[float]] = {}  # id -> [kl sum, tokens]
    for start in range(0, len(jobs), BATCH):
        chunk = jobs[start:start + BATCH]
        prompts = [tok(prompt_template.render(tok, q["problem"]), add_special_tokens=False).input_ids for q, _ in chunk]
        width = max(map(len, prompts))
        ids = torch.full((len(chunk), width), pad)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: the responses start at the same column
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        gen = torch.Generator(device=device).manual_seed(sample_seed(seed, chunk[0][0]["id"], chunk[0][1]))
        with torch.no_grad():
            seqs, resp_mask = _sample(s_model, ids.to(device), mask.to(device), gen, max_new_tokens, eos, pad, vocab)
            full_mask = torch.cat([mask.to(device), resp_mask], dim=1)
            kl = _kl(s_model, t_model, seqs, full_mask, width, vocab)  # (B, new tokens)
        kl = (kl * resp_mask).sum(-1).tolist()
        n = resp_mask.sum(-1).tolist()
        for (q, _), k_sum, k_n in zip(chunk, kl, n):
            acc = per_question.setdefault(q["id"], [0.0, 0.0])
            acc[0] += k_sum
            acc[1] += k_n
    total = sum(v[0] for v in per_question.values())
    tokens = sum(v[1] for v in per_question.values())
    means = [v[0] / v[1] for v in per_question.values() if v[1]]
    se = None
    if len(means) > 1:
        mu = sum(means) / len(means)
        se = math.sqrt(sum((m - mu) ** 2 for m in means) / (len(means) - 1) / len(means))
    return {"teacher_kl": total / max(tokens, 1.0), "se_clustered": se, "n_questions": len(per_question),
            "per_question": {q: v[0] / v[1] for q, v in per_question.items() if v[1]},
            "n_samples": len(jobs), "n_tokens": int(tokens), "samples": samples, "max_new_tokens": max_new_tokens,
            "seed": seed, "teacher": str(teacher),
            "definition": "KL(student || teacher) per response token on the student's own samples (T=1), full vocabulary"}


def _sample(model, ids, mask, gen, max_new_tokens: int, eos: int, pad: int, vocab: int):
    """Plain ancestral sampling at T=1 with a KV cache; (sequences, response mask)."""
    import torch

    rows = ids.shape[0]
    out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1, :vocab]
    done = torch.zeros(rows, dtype=torch.bool, device=ids.device)
    tokens, keep = [], []
    attn = mask
    for _ in range(max_new_tokens):
        probs = torch.softmax(logits.float(), dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen)[:, 0]
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        keep.append(~done)
        tokens.append(nxt)
        done = done | (nxt == eos)
        if bool(done.all()):
            break
        attn = torch.cat([attn, (~done | (nxt == eos)).long()[:, None]], dim=1)
        out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=_positions(attn)[:, -1:],
                    past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1, :vocab]
    resp = torch.stack(tokens, dim=1)
    return torch.cat([ids, resp], dim=1), torch.stack(keep, dim=1).long()


def _positions(mask):
    """Position ids of a left-padded batch (as generate() makes them): 0 at each row's first real token."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _kl(s_model, t_model, seqs, mask, prompt_width: int, vocab: int):
    """Per response position: KL(p_S || p_T) of the distribution that predicted that token."""
    import torch

    pos = slice(prompt_width - 1, seqs.shape[1] - 1)  # logits at i predict token i+1
    kw = {"input_ids": seqs, "attention_mask": mask, "position_ids": _positions(mask)}
    s_lp = torch.log_softmax(s_model(**kw).logits[:, pos, :vocab].float(), dim=-1)
    t_lp = torch.log_softmax(t_model(**kw).logits[:, pos, :vocab].float(), dim=-1)
    return (s_lp.exp() * (s_lp - t_lp)).sum(-1)
