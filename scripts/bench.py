"""Benchmark: each lesson against its PyTorch counterpart, interleaved in one run, 2 ranks.

    make bench            # or: .venv/bin/python scripts/bench.py [--rounds 3] [--steps 20]

Step times on a shared 2-core machine drift by +-25 % over minutes, so every round runs every
variant once, in the same order, and we report the median over rounds of each run's median
step time (warm-up steps dropped), the spread (min-max of the round medians), and each
lesson's ratio to its PyTorch counterpart measured in the same rounds.
"""
import argparse
import json
import os
import platform
import statistics

import torch

from runs import available_lessons, launch

COUNTERPART = {"01_vanilla_dp": "ddp", "02_async_allreduce": "ddp", "03_buckets": "ddp",
               "04_zero1": "zero_redundancy", "05_zero2": "fsdp2_noreshard", "06_zero3": "fsdp2"}
LABEL = {"ddp": "DDP", "zero_redundancy": "DDP + ZeroRedundancyOptimizer",
         "fsdp2_noreshard": "FSDP2 (reshard_after_forward=False)", "fsdp2": "FSDP2 fully_shard"}
CONFIGS = {
    # the lessons' default GPT: 809,728 parameters in 52 tensors
    "default": [],
    # many small parameters: 16 thin blocks, 196 tensors of ~2.7k elements: per-call latency dominates
    "many-small": ["--n-layer", "16", "--d-model", "32", "--n-head", "2", "--seq-len", "32",
                   "--global-batch", "32"],
}


# the many-small model is about per-call latency: 01-03 against DDP
CONFIG_LESSONS = {"many-small": ["01_vanilla_dp", "02_async_allreduce", "03_buckets"]}


def variants(lessons):
    out = []
    for lesson in lessons:
        ref = COUNTERPART[lesson]
        if ("torch", ref) not in out:
            out.append(("torch", ref))
        out.append(("lesson", lesson))
        if lesson == "06_zero3":
            out.append(("lesson-noprefetch", lesson))
    return out


def run_one(kind, name, nproc, steps, extra):
    # the measured step (the last) samples memory after every op: seconds; it is not timed
    args = ["--steps", steps, "--log-every", 10 ** 6, "--measure-step", steps - 1, "--peak-params", 0, *extra]
    if kind == "torch":
        report = launch("scripts/torch_reference", nproc, ["--impl", name, *args])
    else:
        report = launch(name, nproc, args + (["--prefetch", "0"] if kind == "lesson-noprefetch" else []))
    times = report["step_time_s"][3:-1]  # drop warm-up (first-touch allocation, lazy optimizer
    # state) and the measured last step
    return statistics.median(times), report


def table_for(config, todo, medians, info):
    """A markdown table: median step time, spread, ratio to the PyTorch counterpart, tokens/s."""
    psi = next(iter(info.values()))["n_params"]
    rows = [f"\n**{config}** (Psi = {psi:,} parameters)\n",
            "| run | median step (ms) | spread (ms) | vs PyTorch | tokens/s |", "|---|---:|---:|---:|---:|"]
    for v in todo:
        kind, name = v
        med = statistics.median(medians[v])
        ref = statistics.median(medians[("torch", COUNTERPART.get(name, name))]) if kind != "torch" else med
        label = LABEL[name] if kind == "torch" else name + (" --prefetch 0" if kind == "lesson-noprefetch" else "")
        tokens = info[v]["config"]["global_batch"] * info[v]["config"]["seq_len"]
        rows.append(f"| {label} | {1e3 * med:.1f} | {1e3 * min(medians[v]):.1f}-{1e3 * max(medians[v]):.1f} "
                    f"| {'' if kind == 'torch' else f'{med / ref:.2f}x'} | {tokens / med:,.0f} |")
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--lessons", nargs="+", default=None, help="e.g. 01_vanilla_dp 03_buckets")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args()
    lessons = a.lessons or available_lessons()
    results = {}
    for config in a.configs:
        todo = variants([l for l in lessons if l in CONFIG_LESSONS.get(config, lessons)])
        medians = {v: [] for v in todo}
        info = {}
        for r in range(a.rounds):
            for v in todo:
                t, report = run_one(*v, a.nproc, a.steps, CONFIGS[config])
                medians[v].append(t)
                info[v] = report
            print(f"[{config}] round {r + 1}/{a.rounds} done", flush=True)
        results[config] = (todo, medians, info)
        print(table_for(config, todo, medians, info), flush=True)  # as soon as it is known
    print(f"\n{a.nproc} ranks, CPU (gloo), {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, {a.rounds} interleaved rounds x {a.steps} steps")
    for config, (todo, medians, info) in results.items():
        print(table_for(config, todo, medians, info))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({c: {f"{k}:{n}": m for (k, n), m in med.items()} for c, (_, med, _) in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
