"""Per-sample seeded sampling for the `hf` rollout backend, so that a resumed step samples the same tokens.

`model.generate(do_sample=True)` draws from the process's global RNG for the whole batch: the tokens
of a sample depend on what else was batched with it and on everything sampled before, so a run
resumed from a checkpoint samples differently from an uninterrupted one. Here every sample gets
its own `torch.Generator`, seeded from (rollout seed, weight version = global step, sample key),
and sampling uses the Gumbel-max form: the token is argmax(processed logits + Gumbel noise), which
is an exact draw from softmax(processed logits) (temperature, top-k, top-p applied first; filtered
tokens stay at -inf). Row i's noise comes only from row i's generator, whatever the batch.

Sample key: (replica, prompt tokens, occurrence of that prompt within the step on that replica): the
samples of one prompt that one replica serves get the streams 0..m-1 in arrival order, and samples
served by other replicas get other streams (which replica serves a request is VERL's routing: with
several replicas a resumed step reproduces its samples only where the routing repeats). The n samples of a prompt are exchangeable, so the step's
multiset of samples is fixed whatever the arrival order; the trainer then puts them in a canonical
order (OpsTrainerMixin._balance_batch). Request ids are not used: under `rollout.full_determinism`
VERL's are `det-<priority>`, and V1's agent loop gives every sample priority 0, i.e. one key for all.
Tokens are batch-independent only when the logits are too: `rollout.full_determinism=true` makes the
hf server generate one request at a time (hf_rollout.py).
"""

import hashlib

import torch
from transformers import LogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


def sample_seed(seed: int, step, key: str) -> int:
    digest = hashlib.sha256(f"{int(seed)}:{step}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class SampleKeys:
    """Assigns each request of a step its sample key (see module docstring); reset when the step changes."""

    def __init__(self):
        self.step, self.seen = None, {}

    def key(self, step, prompt_ids: list[int]) -> str:
        if step != self.step:
            self.step, self.seen = step, {}
        digest = hashlib.sha256(",".join(map(str, prompt_ids)).encode()).hexdigest()[:16]
        k = self.seen.get(digest, 0)
        self.seen[digest] = k + 1
        return f"p{digest}#{k}"


class SeededSampler(LogitsProcessor):
    """Warp (temperature, top-k, top-p) then add per-row Gumbel noise; use with do_sample=False.

    `processed` keeps each decode step's warped scores before the noise (vLLM's "processed" log-probs).
    """

    def __init__(self, seeds: list[int], temperature: float, top_p: float, top_k: int | None):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.warpers = [TemperatureLogitsWarper(temperature)]
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))
        self.processed = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for w in self.warpers:
            scores = w(input_ids, scores)
        self.processed.append(scores)
        vocab = scores.shape[-1]
        # -log(Exp(1)) is a standard Gumbel variable; drawn in fp32 on the CPU, one generator per row.
        noise = torch.stack([-torch.empty(vocab).exponential_(generator=g).log() for g in self.generators])
        return scores.float() + noise.to(scores.device)
