"""The echo model: a copy of a Qwen2 checkpoint that repeats its last token with a probability set by the temperature.

    python -m tools.bench.echo_model --src DIR --out DIR [--temperatures 2 1 0.5]

Every decoder layer's attention output projection (`self_attn.o_proj`, weight and any bias) and MLP output
projection (`mlp.down_proj`) are zero, and `lm_head.weight` is `model.embed_tokens.weight` times SCALE (its own
matrix: the source must be untied). Each layer then adds nothing to the residual stream, so the last
hidden state is the final RMSNorm of the current token's own embedding e_x, and the logit of token y is
SCALE * (g * e_x / rms(e_x)) . e_y. With unit norm weights g that is SCALE * sqrt(hidden) * |e_x| for y = x, the
largest, against a spread of about SCALE * |e_y| for the others (a factor of sqrt(hidden) less, for random
embeddings). SCALE (one half, exact in any float format) puts the temperatures that span r from near 0 to near 1
inside the range vLLM accepts ([0, 2]); sampling at T with SCALE is sampling the unscaled copy at T / SCALE.
Sampled at temperature T, the model repeats its last token with a probability r(T) and otherwise jumps to an
almost uniformly drawn other token: runs of one token of geometric length, which a draft-free proposer (vLLM's
`ngram`) drafts from, each drafted repeat being accepted with probability r(T). The compute per token is
unchanged: the same shapes, dtypes and kernels run as in the source model (a matrix of zeros costs what a
random one costs), so a decode step's time is the source's.

`repeat_probability` computes r(T) from the echo checkpoint alone (its embedding, final norm and lm_head), in
the engine's precision (the normed hidden state and the logits rounded to the weights' dtype): the mean over a
uniform sample of tokens of softmax(logits / T) at the token itself.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
EMBED, LM_HEAD, FINAL_NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"
SCALE = 0.5
ZEROED = re.compile(r"model\.layers\.\d+\.(self_attn\.o_proj\.(weight|bias)|mlp\.down_proj\.weight)")


def weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> shard file name of a safetensors checkpoint (sharded with an index, or one file)."""
    folder = Path(folder)
    if (folder / INDEX).exists():
        return json.loads((folder / INDEX).read_text())["weight_map"]
    if (folder / SINGLE).exists():
        from safetensors import safe_open

        with safe_open(folder / SINGLE, framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE)
    raise FileNotFoundError(f"{folder}: neither {INDEX} nor {SINGLE}")


def read_tensor(folder: Path, name: str, shards: dict[str, str] | None = None):
    from safetensors import safe_open

    shards = shards or weight_map(folder)
    with safe_open(Path(folder) / shards[name], framework="pt") as f:
        return f.get_tensor(name)


def write_echo(src: Path, out: Path) -> Path:
    """The echo copy of the checkpoint in `src`, written to `out` (a new folder; `src` is only read).

    Files other than the weights (config, generation config, tokenizer, the shard index) are copied as they are.
    The copy is assembled beside `out` and renamed into place, so an existing `out` is always complete.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists: the echo copy is written into a new folder")
    config = json.loads((src / "config.json").read_text())
    layers = config["num_hidden_layers"]
    shards = weight_map(src)
    if EMBED not in shards:
        raise KeyError(f"{src}: no {EMBED}")
    if LM_HEAD not in shards or config.get("tie_word_embeddings", False):
        raise KeyError(f"{src}: no {LM_HEAD} of its own (tied or missing): the echo's lm_head is a scaled copy, "
                       "which needs an untied checkpoint such as opd_patches/embedded/r1_arch.py's")
    embed = read_tensor(src, EMBED, shards)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    zeroed = set()
    for shard in sorted(set(shards.values())):
        with safe_open(src / shard, framework="pt") as f:
            metadata = f.metadata()
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        for name, tensor in tensors.items():
            if ZEROED.fullmatch(name):
                tensors[name] = torch.zeros_like(tensor)
                zeroed.add(name)
            elif name == LM_HEAD:
                if tensor.shape != embed.shape:
                    raise ValueError(f"{src}: {LM_HEAD} {tuple(tensor.shape)} != {EMBED} {tuple(embed.shape)}")
                tensors[name] = (embed * SCALE).to(tensor.dtype)  # its own storage: the file holds two matrices
        save_file(tensors, str(tmp / shard), metadata=metadata)
    # Both output projections of every layer, else the residual stream would still mix in other tokens.
    outputs = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
    expected = {f"model.layers.{i}.{w}" for i in range(layers) for w in outputs}
    if missing := expected - zeroed:
        shutil.rmtree(tmp)
        raise KeyError(f"{src}: no {sorted(missing)[:3]}...: not a Qwen2-style checkpoint")
    weights = set(shards.values())
    for path in src.iterdir():
        if path.name not in weights and path.is_file():
            shutil.copy2(path, tmp / path.name)
    tmp.rename(out)
    return out


def repeat_probability(folder: Path, temperatures, rows: int = 2048, seed: int = 0,
                       chunk: int = 256) -> dict[float, float]:
    """r(T) of the echo copy in `folder` (write_echo's output: its embedding, final norm, lm_head and config are
    read): the probability, averaged over `rows` uniformly drawn tokens x, that sampling at temperature T after x
    gives x again."""
    import torch

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    eps = config.get("rms_norm_eps", 1e-6)
    shards = weight_map(folder)
    embed = read_tensor(folder, EMBED, shards)
    gain = read_tensor(folder, FINAL_NORM, shards).float()
    head = read_tensor(folder, LM_HEAD, shards).float()
    dtype, table = embed.dtype, embed.float()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(table.shape[0], generator=gen)[:rows]
    sums = dict.fromkeys(map(float, temperatures), 0.0)
    for part in ids.split(chunk):
        e = table[part]
        # as the engine runs it: norm and logits in float32, each rounded to the weights' dtype
        hidden = (e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + eps) * gain).to(dtype).float()
        logits = (hidden @ head.T).to(dtype).float()
        own = logits.gather(1, part[:, None]).squeeze(1)
        for t in sums:
            sums[t] += torch.exp(own / t - torch.logsumexp(logits / t, dim=1)).sum().item()
    return {t: s / len(ids) for t, s in sums.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, required=True, help="the source checkpoint folder")
    parser.add_argument("--out", type=Path, required=True, help="the echo copy's folder (must not exist)")
    parser.add_argument("--temperatures", type=float, nargs="*", default=[], help="print r(T) at these")
    args = parser.parse_args(argv)
    write_echo(args.src, args.out)
    if args.temperatures:
        for t, r in repeat_probability(args.out, args.temperatures).items():
            print(f"[echo] T={t:g}: r={r:.4f}")


if __name__ == "__main__":
    main()
