"""The ZeRO paper's Figure 1, measured: model states per rank of a 64-rank world, one rank
simulated in one process (--simulate-world, lessonkit/simulate.py), read from live tensors.

    make figure1        # about 35 minutes on 2 CPU cores: docs/results.md's "figure1" section

The paper: Psi = 7.5B parameters, N = 64, mixed precision (K = 12): 120 GB replicated, 31.4 GB
P_os, 16.6 GB P_os+g, 1.9 GB P_os+g+p, that is (2 + 2 + K) Psi, (2 + 2 + K/N) Psi,
(2 + (2 + K)/N) Psi and (2 + 2 + K) Psi / N bytes. Here:
- 06 (P_os+g+p) at the paper's size, a GPT of 24 layers, d 5120 (Psi = 7.55B), at N = 64 and 1024:
  06 builds the model a unit at a time, so a rank never holds more than its shards and one unit.
  At rest it keeps fp32 shards in any precision (the masters: 4 + 4 + 8 = 16 Psi / N, the paper's
  total), so it runs in fp32: bf16 would halve only the units in flight, and bf16 matrix products
  are slow on most CPUs. Its peak parameter bytes are its shards plus three units in flight: the
  root, the block computing and the one prefetched.
- 01 (replicated), 04 (P_os), 05 (P_os+g), in bf16, build the whole model before they shard it: 16 Psi bytes
  for 01 and at least 10 Psi while 04 and 05 start (fp32, then the bf16 copy), more than this
  machine holds at 7.5B. They run at the largest Psi that fits, 12 layers of d 2048 (0.6B), and their
  formula is applied to 7.5B beside the paper's.
"""
import math
import sys

import torch

from model import GPT, GPTConfig
from scripts.learn.results import machine, write_section
from scripts.runs import Parser, launch, tool_main

PAPER = {"01_vanilla_dp": 120.0, "04_zero1": 31.4, "05_zero2": 16.6, "06_zero3": 1.9}
STAGE = {"01_vanilla_dp": "replicated", "04_zero1": "P_os", "05_zero2": "P_os+g", "06_zero3": "P_os+g+p"}
BIG = ["--n-layer", "24", "--d-model", "5120", "--n-head", "40"]  # the paper's 7.5B: 7.55B
FITS = ["--n-layer", "12", "--d-model", "2048", "--n-head", "16"]  # 0.6B: 01 holds 16 Psi whole
# a tiny batch (one sequence of 8 tokens per rank), 2 steps: the second measured, once AdamW holds its moments
TINY = ["--vocab-size", "64", "--seq-len", "8", "--steps", "2", "--measure-step", "1"]
K, PAPER_PSI = 12, 7.5e9


def formula(lesson, psi, n):
    """The paper's model states per rank, bytes (Figure 1's columns), K = 12."""
    return {"01_vanilla_dp": (4 + K) * psi, "04_zero1": (4 + K / n) * psi, "05_zero2": (2 + (2 + K) / n) * psi,
            "06_zero3": (4 + K) * psi / n}[lesson]


def in_flight(shape, n):
    """06's parameter bytes in flight at most, fp32: the root unit (embeddings, final norm), the block
    computing and the one prefetched, each padded to a multiple of N (the lesson's docstring)."""
    with torch.device("meta"):
        argv = TINY + shape
        flags = {k.removeprefix("--").replace("-", "_"): int(v) for k, v in zip(argv[::2], argv[1::2])
                 if k in ("--vocab-size", "--seq-len", "--n-layer", "--d-model", "--n-head")}
        gpt = GPT(GPTConfig(**flags), seed=None)
    block = sum(p.numel() for p in gpt.blocks[0].parameters())
    root = sum(p.numel() for p in gpt.parameters()) - len(gpt.blocks) * block
    return 4 * sum(math.ceil(x / n) * n for x in (root, block, block))


def measure(lesson, shape, n):
    """Rank n - 1 of n, simulated: its report's model states at rest (params, grads, optimizer), Psi."""
    zero3 = lesson == "06_zero3"
    report = launch(lesson, 1, [*shape, *TINY, "--global-batch", n, "--simulate-world", n, "--simulate-rank", n - 1,
                                "--precision", "fp32" if zero3 else "bf16", "--peak-params", int(zero3)])
    mem = report["memory"]["per_rank"][0]
    return {"held": sum(mem[k] for k in ("params", "grads", "optimizer")), "psi": report["n_params"], "params": mem["params"],
            "theory": sum(report["memory"]["theory"][k] for k in ("params", "grads", "optimizer")),
            "peak_params": mem.get("peak_params"), "rss": mem.get("max_rss")}


def peak(m, shape, n):
    """06's peak parameter bytes in the step, measured (its shards plus in_flight), in GB; else blank."""
    return f"{m['peak_params'] / 1e9:.3f} ({(m['params'] + in_flight(shape, n)) / 1e9:.3f})" if m["peak_params"] else ""


def main(argv=None):
    p = Parser("figure1", description=__doc__)
    p.add_argument("--no-write", action="store_true", help="print, do not write docs/results.md")
    a = p.parse_args(argv)
    gb = 1e9
    rows = ["| lesson | stage | Psi | N | model states per rank, measured GB | formula GB | at 7.5B: formula GB | paper GB "
            "| peak parameters in a step, measured GB (shards + units in flight) | peak resident GB |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lesson, shape, worlds in (("01_vanilla_dp", FITS, [64]), ("04_zero1", FITS, [64]), ("05_zero2", FITS, [64]),
                                  ("06_zero3", BIG, [64, 1024])):
        for n in worlds:
            m = measure(lesson, shape, n)
            rows.append(f"| {lesson[:2]} | {STAGE[lesson]} | {m['psi'] / 1e9:.2f}B | {n} | {m['held'] / gb:.3f} | "
                        f"{formula(lesson, m['psi'], n) / gb:.3f} | {formula(lesson, PAPER_PSI, n) / gb:.2f} | "
                        f"{PAPER[lesson] if n == 64 else ''} | {peak(m, shape, n)} | {m['rss'] / gb:.1f} |")
            print(rows[-1], flush=True)
    body = "\n".join([
        "## The ZeRO paper's Figure 1, measured", "",
        f"Machine: {machine()}. `make figure1`: each lesson as rank N - 1 of N, simulated on the fake backend "
        "(`--simulate-world`), a tiny batch, model states at rest (parameters, gradients, optimizer state) summed "
        "from live tensors in the second step. 06 in fp32 (its shards are fp32 at rest in any precision: 16 bytes a "
        "parameter, the paper's total), the others in bf16. 01, 04 and 05 build the whole model first, so they run at "
        "the largest size this machine holds for 01; their formula at 7.5B is beside the paper's.", "", *rows])
    print(body)
    if not a.no_write:
        write_section("figure1", body)
    return 0


if __name__ == "__main__":
    sys.exit(tool_main("figure1", main))
