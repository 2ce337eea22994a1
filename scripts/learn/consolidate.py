"""Turn any lesson's checkpoint into one plain state_dict, loadable without torch.distributed.

    python -m scripts.learn.consolidate runs/ckpt model.pt               # its newest complete checkpoint
    python -m scripts.learn.consolidate runs/ckpt/step_000040 model.pt   # that one

What DeepSpeed's zero_to_fp32.py does for ZeRO checkpoints: every rank's pieces put back together,
the padding gone, in fp32 (a bf16 run's fp32 master weights, of which its bf16 weights are the
rounding), tied names both present (wte.weight and lm_head.weight). Then, in any process:

    model = GPT(GPTConfig(...)); model.load_state_dict(torch.load("model.pt"))
"""
import os
import re
import sys

import torch

from lessonkit import checkpoint, reshard
from scripts.runs import Parser


def consolidate(path):
    """One plain {name: fp32 tensor} state_dict, tied names included, padding gone: loadable by
    model.GPT(...).load_state_dict(sd) without torch.distributed. The fp32 master values where
    the checkpoint has them (bf16: the truth; the working bf16 weights are them rounded)."""
    meta, index, steps = checkpoint.read(path)
    sd = {name: t.float().clone() for (name, what), t in reshard.whole(meta, index, steps).items() if what == "weights"}
    for alias, name in meta["aliases"].items():
        sd[alias] = sd[name]
    return sd


def main(argv=None):
    p = Parser("consolidate", description=__doc__)
    p.add_argument("checkpoint", help="a --checkpoint-dir (its newest complete step) or one step_NNNNNN directory")
    p.add_argument("out", help="where to write the state_dict (torch.save)")
    a = p.parse_args(argv)
    path = a.checkpoint.rstrip("/")
    if not re.fullmatch(r"step_\d+", os.path.basename(path)):
        path = checkpoint.latest(path)
        if path is None:
            sys.exit(f"error: no complete checkpoint in {a.checkpoint}")
    try:
        sd = consolidate(path)
        meta, _, _ = checkpoint.read(path)
    except checkpoint.CheckpointError as e:
        sys.exit(f"error: {e}")
    try:
        torch.save(sd, a.out)
    except (OSError, RuntimeError) as e:  # (torch's writer raises RuntimeError for a missing directory)
        sys.exit(f"error: cannot write {a.out}: {str(e).splitlines()[0]}")
    c = meta["config"]
    model = ", ".join(f"{k}={c[k]}" for k in ("vocab_size", "seq_len", "n_layer", "d_model", "n_head")) if c else \
        "...its model's shape (a DCP checkpoint from elsewhere does not say it)"
    n = sum(t.numel() for name, t in sd.items() if name not in meta["aliases"])
    print(f"{a.out}: {len(sd)} fp32 tensors, {n:,} parameters, from {path} ({meta['strategy']}, "
          f"{meta['world_size']} ranks, step {meta['step']}, {meta['precision']})\n"
          f"load it with: GPT(GPTConfig({model})).load_state_dict(torch.load({a.out!r}))")
    return path


if __name__ == "__main__":
    main()
