"""The `kernels` phase: actor-update loss paths, standalone (logits -> loss -> grad) and inside a model
fwd+bwd, each next to a plain-PyTorch reference of the same maths, measured in the same process.

Real paths are the functions VERL's actor calls (verl 0.9.1, fsdp strategy):
- `k1_pg`: `verl.utils.torch_functional.logprobs_from_logits` -> `kl_penalty(..., "k1")` -> upstream's
  vanilla policy loss (the `k1` recipe's update);
- `topk_default` / `topk_chunked`: upstream's fsdp `compute_forward_kl_topk` (the unwrapped original;
  `use_chunked_topk` false / true with its default chunk) then the registered loss's clamp at 0;
- `topk_tail`: our wrapper with the lean mode off (upstream's function + the tail term);
- `lean_topk`, `lean_topk_tail`: our wrapper with the lean mode on (losses/lean_topk.py), its O(T*V)
  part by opd.lean_topk_kernel=auto (the Triton kernels of losses/lean_topk_triton.py on CUDA, torch on
  the CPU); `lean_topk_torch`, `lean_topk_tail_torch`: the same with the torch path forced;
- `lean_fused_tail`: LeanTopKFromHidden (hidden states + lm_head weight; not hooked into VERL);
- `logprob_upstream` / `logprob_patched`: `logprobs_from_logits` alone (the sampled-token log-prob of
  every update) with the fallback patch off (upstream's per-row v2 without flash-attn) / on
  (losses/sampled_logprob.py); reference `ref_logprob`, the naive fp32 log_softmax + gather. With
  flash-attn installed both rows run flash-attn's kernel (the patch only replaces the fallback).
References (plain PyTorch, docs/performance.md): full fp32 log_softmax + gather (+ masked logsumexp for
the tail). Each reference is measured once and shared by the rows that use it.
On CUDA with bf16 the losses run under torch.autocast(bf16), as in VERL's actor forward (there
log_softmax runs in fp32). The model part: random-weight Qwen2 of the size, gradient checkpointing,
sdpa, `micro_seqs` equal-length sequences per micro-batch, no optimizer step; its `update/floor` row is
the plain-PyTorch update with the step: reference fwd + bwd (`FLOOR_REF`) over the step's micro-batches,
gradients accumulated, then one AdamW step (`fused=True` on CUDA, the fastest kernel; PyTorch's default
elsewhere), next to the same without the optimizer step.
"""

import contextlib
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from opd_patches import config
from tools.bench.measure import measure, row

TOPK_MODES = {  # row -> (loss_mode, opd.lean_topk, use_chunked_topk, clamp at 0 like the registered loss)
    "topk_default": ("forward_kl_topk", False, False),
    "topk_chunked": ("forward_kl_topk", False, True),
    "topk_tail": ("forward_kl_topk_tail", False, False),
    "lean_topk": ("forward_kl_topk", True, False),
    "lean_topk_tail": ("forward_kl_topk_tail", True, False),
    "lean_topk_torch": ("forward_kl_topk", True, False),
    "lean_topk_tail_torch": ("forward_kl_topk_tail", True, False),
}
LEAN_KERNEL = {"lean_topk_torch": "torch", "lean_topk_tail_torch": "torch"}  # row -> opd.lean_topk_kernel (else auto)
FLOOR_REF = "ref_topk"  # the floor's loss: the dense recipe's maths (truncated top-k KL)
REF_OF = {"logprob_upstream": "ref_logprob", "logprob_patched": "ref_logprob",
          "k1_pg": "ref_k1", "topk_default": "ref_topk", "topk_chunked": "ref_topk", "lean_topk": "ref_topk",
          "topk_tail": "ref_tail", "lean_topk_tail": "ref_tail", "lean_fused_tail": "ref_tail",
          "lean_topk_torch": "ref_topk", "lean_topk_tail_torch": "ref_tail"}


def autocast(size):
    if size.device == "cuda" and size.dtype == "bfloat16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def teacher_data(n_tokens, vocab, k, device, seed):
    """Per-token inputs of the losses: a peaked random teacher's top-k, sampled labels, old log-probs."""
    gen = torch.Generator(device=device).manual_seed(seed)
    data = {"ids": [], "lp": []}
    for a in range(0, n_tokens, 4096):  # chunked: the full (T, V) fp32 teacher would dwarf the losses
        b = min(a + 4096, n_tokens)
        lp, ids = torch.log_softmax(torch.randn(b - a, vocab, generator=gen, device=device) * 3, -1).topk(k, -1)
        data["ids"].append(ids)
        data["lp"].append(lp)
    data = {key: torch.cat(v) for key, v in data.items()}
    data["labels"] = torch.randint(0, vocab, (n_tokens,), generator=gen, device=device)
    data["teacher_tok"] = torch.randn(n_tokens, generator=gen, device=device) - 5
    data["old_lp"] = torch.randn(n_tokens, generator=gen, device=device) - 5
    return data


def _nested(x):
    return torch.nested.nested_tensor_from_jagged(x, torch.tensor([0, x.shape[0]], device=x.device))


def _loss_config(mode, chunked, size):
    return SimpleNamespace(distillation_loss=SimpleNamespace(
        loss_mode=mode, log_prob_min_clamp=-10.0, use_chunked_topk=chunked,
        chunked_topk_chunk_size=size.upstream_chunk))


# ---- losses from (T, V) logits: real paths ---------------------------------------------------------


def loss_k1_pg(logits, d, size):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn, kl_penalty
    from verl.utils.torch_functional import logprobs_from_logits
    from verl.workers.config import DistillationLossConfig

    cfg = DistillationLossConfig(loss_mode="k1", topk=None, use_policy_gradient=True)
    n = logits.shape[0]
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=n, global_batch_size=1, loss_scale_factor=None)
    lp = logprobs_from_logits(logits, d["labels"])[None]
    adv = -kl_penalty(logprob=lp, ref_logprob=d["teacher_tok"][None], kl_penalty="k1").detach()
    loss, _ = get_policy_loss_fn("vanilla")(
        old_log_prob=d["old_lp"][None], log_prob=lp, advantages=adv,
        response_mask=torch.ones_like(lp, dtype=torch.bool), loss_agg_mode="token-mean", config=cfg)
    return loss


def loss_logprob(fast, logits, d, size):
    from verl.utils.torch_functional import logprobs_from_logits

    with config.override(fast_logprobs=fast):
        lp = logprobs_from_logits(logits, d["labels"])
    return (lp.float() * d["old_lp"]).mean()  # a fixed per-token weight: a non-uniform gradient


def loss_topk(name, logits, d, size):
    from verl.trainer.distillation.fsdp import losses as fsdp_losses

    mode, lean, chunked = TOPK_MODES[name]
    # LeanTopK picks its kernel in forward and keeps it for backward (which runs outside these contexts).
    with config.override(lean_topk=lean, lean_topk_kernel=LEAN_KERNEL.get(name, "auto")):
        out = fsdp_losses.compute_forward_kl_topk(
            logits[None], _nested(d["lp"]), _nested(d["ids"]), _loss_config(mode, chunked, size), "thd")
    per_token = out["distillation_losses"]
    per_token = per_token + out["tail_losses"] if "tail_losses" in out else per_token.clamp_min(0.0)
    return per_token.mean()


def loss_lean_fused(hidden, weight, d, size):
    from opd_patches.losses.lean_topk import lean_topk_from_hidden

    out = lean_topk_from_hidden(hidden, weight, d["ids"], d["lp"], clamp=-10.0, with_tail=True, chunk=size.lean_chunk)
    return (out["distillation_losses"] + out["tail_losses"]).mean()


# ---- plain-PyTorch references ----------------------------------------------------------------------


def ref_k1(logits, d, size):
    lp = torch.log_softmax(logits.float(), -1).gather(-1, d["labels"][:, None])[:, 0]
    adv = -(lp - d["teacher_tok"]).detach()
    ratio = torch.exp(lp - d["old_lp"])
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()


def _ref_topk_parts(logits, d):
    ls = torch.log_softmax(logits.float(), -1)
    s, t = ls.gather(-1, d["ids"]).clamp_min(-10.0), d["lp"].clamp_min(-10.0)
    return ls, (t.exp() * (t - s)).sum(-1)


def ref_topk(logits, d, size):
    return _ref_topk_parts(logits, d)[1].clamp_min(0.0).mean()


def ref_tail(logits, d, size):
    ls, trunc = _ref_topk_parts(logits, d)
    student_tail = ls.scatter(-1, d["ids"], float("-inf")).logsumexp(-1).clamp(min=-1e4)
    teacher_tail = torch.log(-torch.expm1(d["lp"].logsumexp(-1).clamp(max=0)))
    return (trunc + teacher_tail.exp() * (teacher_tail - student_tail)).mean()


def ref_logprob(logits, d, size):
    lp = torch.log_softmax(logits.float(), -1).gather(-1, d["labels"][:, None])[:, 0]
    return (lp * d["old_lp"]).mean()


REFS = {"ref_logprob": ref_logprob, "ref_k1": ref_k1, "ref_topk": ref_topk, "ref_tail": ref_tail}


def real_loss(name):
    if name == "k1_pg":
        return loss_k1_pg
    if name.startswith("logprob_"):
        return partial(loss_logprob, name == "logprob_patched")
    return partial(loss_topk, name)


# ---- the two measurements --------------------------------------------------------------------------


def _micro_batches(size):
    return [min(size.micro_seqs, size.n_seqs - a) for a in range(0, size.n_seqs, size.micro_seqs)]


def _timer(step, device, repeats):
    """run(loss_fn, fused) = measure() of step(loss_fn, fused) over every micro-batch, warmed up on the first."""
    def run(loss_fn, fused=False):
        return measure(partial(step, loss_fn, fused), device, repeats, warmup_fn=partial(step, loss_fn, fused, 1))

    return run


def _rows(kind, names, run, ref_of, size, grad_error=None):
    """One row per name: the real path timed by run(), its reference (each measured once), printed.
    ref_of(name) -> (reference name, its loss fn, fused); grad_error(name) -> extra row field or None."""
    refs, rows = {}, []
    for name in names:
        fused = name == "lean_fused_tail"
        real = run(loss_lean_fused if fused else real_loss(name), fused)
        ref_name, ref_fn, ref_fused = ref_of(name)
        if ref_name not in refs:
            refs[ref_name] = run(ref_fn, ref_fused)
        ref = refs[ref_name]
        extra = {} if grad_error is None else {"grad_max_abs_err": grad_error(name)}
        rows.append(row(f"{kind}/{name}", real, ref, size.tokens, reference=REF_OF[name], **extra))
        print(f"[bench] {kind}/{name}: {real['time_s']:.3f} s (ref {ref['time_s']:.3f} s)", flush=True)
    return rows


def standalone(size, names, notes):
    """logits leaf (T_mb, V) -> loss -> backward, over one step's micro-batches."""
    from tools.bench.sizes import qwen2_config

    config = qwen2_config(size)
    vocab = config.vocab_size
    dtype, device = getattr(torch, size.dtype), torch.device(size.device)
    mbs = _micro_batches(size)
    n_max = max(mbs) * size.seq_len
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(n_max, vocab, generator=gen, device=device) * 2).to(dtype).requires_grad_(True)
    hidden = torch.randn(n_max, config.hidden_size, generator=gen, device=device).to(dtype).requires_grad_(True)
    weight = (torch.randn(vocab, hidden.shape[1], generator=gen, device=device) * 0.05).to(dtype).requires_grad_(True)
    d = teacher_data(n_max, vocab, size.topk, device, seed=1)

    def step(loss_fn, fused, n_micro=None):
        for m in mbs[:n_micro]:
            n = m * size.seq_len
            dd = {k: v[:n] for k, v in d.items()}
            with autocast(size):
                loss = loss_fn(hidden[:n], weight, dd, size) if fused else loss_fn(logits[:n], dd, size)
            loss.backward()
            logits.grad = hidden.grad = weight.grad = None

    def grad_error(name):
        """Max |d loss / d logits| difference from the reference on the first micro-batch (untimed)."""
        if name == "lean_fused_tail":
            return None
        loss_fn, ref_fn = real_loss(name), REFS[REF_OF[name]]
        n = mbs[0] * size.seq_len
        dd = {k: v[:n] for k, v in d.items()}
        grads = []
        for fn in (loss_fn, ref_fn):
            with autocast(size):
                fn(logits[:n], dd, size).backward()
            grads.append(logits.grad[:n])
            logits.grad = None
        return max((grads[0][a:a + 2048].float() - grads[1][a:a + 2048].float()).abs().max().item()
                   for a in range(0, n, 2048))

    def ref_of(name):  # the fused row's reference takes (hidden, weight) too
        if name == "lean_fused_tail":
            return "ref_tail_fused", lambda h, w, dd, s: ref_tail(F.linear(h, w), dd, s), True
        return REF_OF[name], REFS[REF_OF[name]], False

    rows = _rows("loss", names, _timer(step, device, size.repeats), ref_of, size, grad_error)
    notes.append(f"loss rows: a (T_mb, {vocab}) {size.dtype} logits leaf, micro-batches {mbs} x {size.seq_len} "
                 "tokens; peaks include the resident logits leaf and inputs; grad_max_abs_err: the largest "
                 "logit-gradient difference from the reference on the first micro-batch")
    return rows


def build_model(size, seed=0):
    from transformers import Qwen2ForCausalLM

    from tools.bench.sizes import qwen2_config

    config = qwen2_config(size)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]), torch.device(size.device):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(getattr(torch, size.dtype))
    return model


def in_model(size, names, notes):
    """Model fwd (gradient checkpointing) -> loss -> backward, over one step's micro-batches."""
    device = torch.device(size.device)
    model = build_model(size)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vocab = model.config.vocab_size
    mbs = _micro_batches(size)
    n_max = max(mbs) * size.seq_len
    gen = torch.Generator(device=device).manual_seed(2)
    input_ids = torch.randint(0, vocab, (max(mbs), size.seq_len), generator=gen, device=device)
    d = teacher_data(n_max, vocab, size.topk, device, seed=3)

    def step(loss_fn, fused, n_micro=None, optimizer=None):
        for m in mbs[:n_micro]:
            if optimizer is None:  # no step to feed: a fresh gradient per micro-batch
                model.zero_grad(set_to_none=True)
            n = m * size.seq_len
            dd = {k: v[:n] for k, v in d.items()}
            with autocast(size):
                if fused:
                    hidden = model.model(input_ids=input_ids[:m]).last_hidden_state.reshape(n, -1)
                    loss = loss_fn(hidden, model.lm_head.weight, dd, size)
                else:
                    logits = model(input_ids=input_ids[:m], use_cache=False).logits.reshape(n, vocab)
                    loss = loss_fn(logits, dd, size)
            loss.backward()
        if optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=True)

    run = _timer(step, device, size.repeats)
    rows = _rows("update", names, run, lambda name: (REF_OF[name], REFS[REF_OF[name]], False), size)
    rows.append(floor_row(model, step, size, run))
    k1 = next((r for r in rows if r["name"] == "update/k1_pg"), None)
    if k1 and k1["peak_gib"]:
        for r in rows:
            r["peak_vs_k1"] = r["peak_gib"] / k1["peak_gib"]
        notes.append("update rows carry peak_vs_k1 (target for topk_tail / lean: <= 1.10)")
    notes.append(f"update rows: {model.num_parameters():,}-parameter Qwen2, grad checkpointing, sdpa, "
                 f"micro-batches {mbs} x {size.seq_len} tokens, no optimizer step (but update/floor: {FLOOR_REF} "
                 "+ AdamW step, its reference the same without the step)")
    del model
    return rows


def floor_row(model, step, size, run) -> dict:
    """`update/floor`: the plain-PyTorch update, reference fwd + bwd + one AdamW step over accumulated
    gradients; its reference column is the same without the step (their difference: the optimizer)."""
    device = torch.device(size.device)
    fused = device.type == "cuda"  # PyTorch's fused AdamW kernel exists on CUDA only
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=fused or None)
    with_step = measure(partial(step, REFS[FLOOR_REF], False, optimizer=optimizer), device, size.repeats,
                        warmup_fn=partial(step, REFS[FLOOR_REF], False, 1, optimizer))  # warm-up: the state
    ref = run(REFS[FLOOR_REF])
    print(f"[bench] update/floor: {with_step['time_s']:.3f} s (without the step {ref['time_s']:.3f} s)", flush=True)
    return row("update/floor", with_step, ref, size.tokens, reference=f"{FLOOR_REF} without the optimizer step",
               optimizer=f"AdamW(fused={fused})")


ALL = ["logprob_upstream", "logprob_patched", "k1_pg", "topk_default", "topk_chunked", "topk_tail",
       "lean_topk", "lean_topk_tail", "lean_topk_torch", "lean_topk_tail_torch", "lean_fused_tail"]


def run_phase(size, args) -> dict:
    names = list(getattr(args, "variants", None) or ALL)
    notes = []
    rows = standalone(size, names, notes)
    if not getattr(args, "no_model", False):
        rows += in_model(size, names, notes)
    return {"size": size.name, "rows": rows, "notes": notes}
