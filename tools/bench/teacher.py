"""The `teacher` phase: the colocated worker's scoring (`opd_patches.teacher.scoring.score_sequences`,
sampled-token k=0 and top-k) against a plain-PyTorch forward + chunked top-k reference (docs/performance.md:
`ref_teacher_seqs` sequences per forward, lm_head + fp32 log_softmax + topk per `ref_teacher_chunk`
tokens), on one step's sequences (random token ids), random-weight model of the size, eval mode.
"""

import torch

from tools.bench.kernels import build_model
from tools.bench.measure import measure, row


@torch.inference_mode()
def reference_scoring(model, seqs, k, size):
    """Plain forward + chunked lm_head/log_softmax/top-k; results gathered to the CPU at the end."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    outs = []
    for a in range(0, len(seqs), size.ref_teacher_seqs):
        ids = torch.stack(seqs[a : a + size.ref_teacher_seqs]).to(size.device)  # equal lengths: no padding
        h = decoder(input_ids=ids).last_hidden_state[:, :-1].reshape(-1, model.config.hidden_size)
        nxt = ids[:, 1:].reshape(-1)
        for c in range(0, h.shape[0], size.ref_teacher_chunk):
            logp = torch.log_softmax(head(h[c : c + size.ref_teacher_chunk]).float(), -1)
            if k == 0:
                outs.append(logp.gather(-1, nxt[c : c + size.ref_teacher_chunk, None]))
            else:
                outs.append(logp.topk(k, -1).values)
    return torch.cat(outs).cpu()


def colocated_row(model, seqs, size, ref):
    """ColocatedTeacher.score with offload and the canary on (the trainer's settings) vs the reference."""
    import tempfile

    from opd_patches.teacher.worker import ColocatedTeacher

    device = torch.device(size.device)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        teacher = ColocatedTeacher(tmp, k=size.topk, device=device, dtype=getattr(torch, size.dtype), offload=True,
                                   chunk_size=size.teacher_chunk, max_tokens=size.teacher_max_tokens, canary_every=1)
    model.to("cpu")  # only the worker's copy on the device, as in training
    r = measure(lambda n=None: teacher.score(seqs[:n]), device, size.repeats, warmup_fn=lambda: teacher.score(seqs[:2]))
    parts = call_parts(teacher, device)
    model.to(device)
    f = measure(lambda: ref(k=size.topk), device, size.repeats)
    print(f"[bench] teacher/colocated_k{size.topk}: {r['time_s']:.3f} s (ref {f['time_s']:.3f} s); parts "
          + ", ".join(f"{k} {v:.3f} s" for k, v in parts.items()), flush=True)
    return row(f"teacher/colocated_k{size.topk}", r, f, size.tokens, parts_s=parts)


def call_parts(teacher, device, repeats=3) -> dict:
    """Median seconds of the whole call's non-scoring parts: onload, canary rescan, offload."""
    import statistics
    import time

    from tools.bench.measure import _sync

    def timed(fn):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - start

    got = {"onload": [], "canary": [], "offload": []}
    for _ in range(repeats):
        got["onload"].append(timed(teacher._onload))
        got["canary"].append(timed(lambda: teacher.canary.check(teacher.model)))
        got["offload"].append(timed(teacher._offload))
    return {k: statistics.median(v) for k, v in got.items()}


def run_phase(size, args) -> dict:
    from opd_patches.teacher.scoring import score_sequences

    device = torch.device(size.device)
    model = build_model(size, seed=1).eval()
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, model.config.vocab_size, (size.seq_len,), generator=gen) for _ in range(size.n_seqs)]
    rows = []
    for k in (0, size.topk):
        def real(n=None, k=k):
            score_sequences(model, seqs[:n], k, chunk_size=size.teacher_chunk, max_tokens=size.teacher_max_tokens)

        def ref(n=None, k=k):
            reference_scoring(model, seqs[:n], k, size)

        r = measure(real, device, size.repeats, warmup_fn=lambda: real(2))
        f = measure(ref, device, size.repeats, warmup_fn=lambda: ref(2))
        rows.append(row(f"teacher/score_k{k}", r, f, size.tokens))
        print(f"[bench] teacher/score_k{k}: {r['time_s']:.3f} s (ref {f['time_s']:.3f} s)", flush=True)
    rows.append(colocated_row(model, seqs, size, ref))
    notes = [f"{size.n_seqs} x {size.seq_len} tokens; score_sequences(chunk_size={size.teacher_chunk}, "
             f"max_tokens={size.teacher_max_tokens}); reference {size.ref_teacher_seqs} seqs/forward, "
             f"chunk {size.ref_teacher_chunk}; both include the copy of results to the CPU",
             "teacher/colocated_k*: the worker's whole call (ColocatedTeacher.score: onload from host "
             "memory, canary rescan, scoring, offload), i.e. what timing_s/teacher holds per rank"]
    return {"size": size.name, "rows": rows, "notes": notes}
