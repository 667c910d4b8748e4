"""Teacher log-probs of whole sequences, in the layout VERL's teacher loop writes to TransferQueue.

Upstream's standalone teacher (verl/experimental/teacher_loop/teacher_manager.py) asks vLLM for
`prompt_logprobs=k` over each sample's unpadded prompt+response and stores, per sample, an
(L, max(k, 1)) pair of tensors (`extract_prompt_logprobs` in verl/workers/rollout/vllm_rollout/utils.py):
- row i is the teacher's distribution predicting token i+1 (the first token has none);
- k == 0 (estimator losses such as k1): the log-prob of token i+1 itself, and its id;
- k > 0 (top-k losses): the k largest log-probs in descending order, and their ids;
- a dummy last row (log-prob 0.0, id 0), so that there is one row per input token;
- `teacher_logprobs` float32, `teacher_ids` int32; temperature 1.0 (plain log_softmax of the logits).

`score_sequences` computes exactly that with one forward pass per micro-batch and a chunked lm_head +
log_softmax: at most (chunk_size, V) fp32 logits exist at a time, never (T, V) for a whole batch. A
micro-batch is right-padded sequences with a mask, or, under a varlen attention (flash_attention_2 or
torch_varlen, opd.attn_implementation), one packed row with restarting position_ids as VERL's actor
packs them: no padded tokens computed, no mask.
"""

from collections.abc import Sequence

import torch

PACKED_ATTENTION = ("flash_attention_2", "flash_attention_3", "torch_varlen")  # take packed rows


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped longest-first so that each padded group (size x longest) fits in max_tokens.

    A sequence longer than max_tokens forms a group of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _logits_fn(model):
    """lm_head of a causal LM, refusing models whose logits are post-processed after it."""
    cfg = model.config
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(cfg, attr, None) not in (None, 1.0):
            raise NotImplementedError(f"teacher config sets {attr}={getattr(cfg, attr)}: not applied by the chunked head")
    return model.get_output_embeddings()


def _padded_forward(decoder, seqs, device, pad_token_id):
    """(hidden states of every position t < L-1, the token t+1 each predicts), sample-major."""
    lengths = [int(s.numel()) for s in seqs]
    ids = torch.full((len(seqs), max(lengths)), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), max(lengths)), dtype=torch.long)
    for row, (s, n) in enumerate(zip(seqs, lengths)):
        ids[row, :n] = s.to(torch.long).cpu()
        mask[row, :n] = 1
    ids, mask = ids.to(device), mask.to(device)
    # Right padding leaves every real position's causal context unchanged; a lone sequence
    # needs no mask at all.
    hidden = decoder(input_ids=ids, attention_mask=mask if len(seqs) > 1 else None).last_hidden_state
    # boolean indexing keeps the scored positions in sample-major order
    scored = mask[:, 1:].bool()
    return hidden[:, :-1][scored], ids[:, 1:][scored]


def _packed_forward(decoder, seqs, device, pad_token_id):
    """Same as _padded_forward, from one packed row (position ids restart at 0 at each sequence)."""
    ids = torch.cat([s.to(torch.long).cpu() for s in seqs]).to(device)
    pos = torch.cat([torch.arange(int(s.numel())) for s in seqs]).to(device)
    hidden = decoder(input_ids=ids[None], position_ids=pos[None]).last_hidden_state[0]
    scored = torch.ones_like(ids, dtype=torch.bool)
    scored[torch.cumsum(torch.tensor([int(s.numel()) for s in seqs]), 0).to(device) - 1] = False  # each last token
    return hidden[scored], ids.roll(-1)[scored]


@torch.inference_mode()
def score_sequences(
    model,
    sequences: Sequence[torch.Tensor],
    k: int,
    *,
    chunk_size: int = 2048,
    max_tokens: int = 16384,
    pad_token_id: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence: (logprobs (L, max(k,1)) float32, ids (L, max(k,1)) int32) on the CPU.

    model: a transformers causal LM (its decoder and lm_head are used), already on its device.
    sequences: 1-D token-id tensors (prompt + response, unpadded), any lengths >= 1.
    k: 0 for the next token's own log-prob, > 0 for the top-k.
    """
    device = next(model.parameters()).device
    decoder, head = model.get_decoder(), _logits_fn(model)
    width = max(k, 1)
    lengths = [int(s.numel()) for s in sequences]
    out_lp: list[torch.Tensor] = [None] * len(sequences)
    out_id: list[torch.Tensor] = [None] * len(sequences)

    packed = getattr(model.config, "_attn_implementation", None) in PACKED_ATTENTION
    for group in micro_batches(lengths, max_tokens):
        h, nxt = (_packed_forward if packed else _padded_forward)(
            decoder, [sequences[i] for i in group], device, pad_token_id)
        lp = torch.empty((h.shape[0], width), dtype=torch.float32, device=device)
        top = torch.empty((h.shape[0], width), dtype=torch.long, device=device)
        for start in range(0, h.shape[0], chunk_size):
            stop = min(start + chunk_size, h.shape[0])
            logp = torch.log_softmax(head(h[start:stop]).float(), dim=-1)
            if k == 0:
                top[start:stop] = nxt[start:stop, None]
                lp[start:stop] = logp.gather(-1, top[start:stop])
            else:
                lp[start:stop], top[start:stop] = logp.topk(k, dim=-1)
            del logp
        lp, top = lp.cpu(), top.to(torch.int32).cpu()
        offset = 0
        for i in group:
            n = lengths[i] - 1
            out_lp[i] = torch.cat([lp[offset : offset + n], torch.zeros((1, width), dtype=torch.float32)])
            out_id[i] = torch.cat([top[offset : offset + n], torch.zeros((1, width), dtype=torch.int32)])
            offset += n
    return out_lp, out_id
