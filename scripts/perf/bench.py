"""Benchmark: each lesson against its PyTorch counterpart, interleaved in one run, 2 ranks.

    make bench            # or: .venv/bin/python -m scripts.perf.bench [--rounds 3] [--steps 20]
    .venv/bin/python -m scripts.perf.bench --quick --lessons 03_buckets    # a tiny model, 1 round
    .venv/bin/python -m scripts.perf.bench --configs 10M --lessons 04_zero1 05_zero2 --collectives torch ring
                          # each lesson on torch's collectives and on the ring's, interleaved

Step times on a shared 2-core machine drift by +-25 % over minutes, so every round runs every
variant once, in the same order, and we report the median over rounds of each run's median
step time (warm-up steps dropped), the spread (min-max of the round medians), and each
lesson's ratio to its PyTorch counterpart measured in the same rounds, and to "local": the same
ranks training with no communication at all (each its own rows), the limit data parallelism
can reach on this machine ("/ limit").

Per run also: tokens/s; the bytes each rank's process wrote on the wire per step (gloo over
TCP, read from /proc on Linux: the one meter that sees DDP's and FSDP2's collectives too, which
run in C++ where comm_meter.CommMeter cannot see them); the model states each rank holds at rest
(params + grads + optimizer, memory_ledger.MemoryLedger), on the device: 07 holds the rest on
the host, a column of its own (on a CPU-only machine the two tiers are one memory, told apart by
role; FSDP2 + CPUOffloadPolicy's are not told apart, so its "held" is both tiers); and each
rank's peak resident memory (everything: activations, buffers, the runtime). Every rank's maximum.

Writes OUT/bench.md (the tables), OUT/bench.json (every number, every round) and OUT/bench.png
(ratio to PyTorch, tokens/s, bytes sent, bytes held, per lesson and config).
"""
import json
import os
import platform
import statistics
import sys

import torch

from scripts.runs import ROOT, Parser, at_least, available_lessons, device_and_host, grid_args, launch, mib, tool_main, usable_cpus

COUNTERPART = {"01_vanilla_dp": "ddp", "02_async_allreduce": "ddp", "03_buckets": "ddp",
               "04_zero1": "zero_redundancy", "05_zero2": "fsdp2_noreshard", "06_zero3": "fsdp2",
               "07_offload": "fsdp2_offload", "08_hybrid": "fsdp2_hsdp"}
LABEL = {"ddp": "DDP", "zero_redundancy": "DDP + ZeroRedundancyOptimizer",
         "fsdp2_noreshard": "FSDP2 (reshard_after_forward=False)", "fsdp2": "FSDP2 fully_shard",
         "fsdp2_offload": "FSDP2 + CPUOffloadPolicy", "fsdp2_hsdp": "FSDP2 HSDP (2-D mesh)",
         "local": "local (no communication)"}
CONFIGS = {
    # the lessons' default GPT: 809,728 parameters in 52 tensors
    "default": [],
    # many small parameters: 16 thin blocks, 196 tensors of ~2.7k elements: per-call latency dominates
    "many-small": ["--n-layer", "16", "--d-model", "32", "--n-head", "2", "--seq-len", "32",
                   "--global-batch", "32"],
    # about 10M parameters (10,721,280 in 76 tensors): more compute per byte sent than the
    # default, so there is more backward to hide the all-reduces behind
    "10M": ["--n-layer", "6", "--d-model", "384", "--seq-len", "128"],
}


# the many-small model is about per-call latency: 01-03 against DDP
CONFIG_LESSONS = {"many-small": ["01_vanilla_dp", "02_async_allreduce", "03_buckets"]}
# --quick: every config on a tiny model (its flags come last, so they win), 1 round: a smoke test
QUICK = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "16", "--global-batch", "8"]


def variants(lessons, collectives=("torch",)):
    """(kind, name) per run: the limit, then each lesson after its counterpart; "lesson" runs it on
    torch's collectives, "lesson-ring" on the ring's (--collectives ring)."""
    out = [("torch", "local")]
    for lesson in lessons:
        ref = COUNTERPART[lesson]
        if ("torch", ref) not in out:
            out.append(("torch", ref))
        out += [("lesson" if c == "torch" else "lesson-ring", lesson) for c in collectives]
        if lesson == "06_zero3" and "torch" in collectives:
            out.append(("lesson-noprefetch", lesson))
    return out


EXTRA = {"lesson": [], "lesson-noprefetch": ["--prefetch", "0"], "lesson-ring": ["--collectives", "ring"]}


def run_one(kind, name, nproc, steps, extra):
    # the measured step (the last) samples memory after every op: seconds; it is not timed
    args = ["--steps", steps, "--log-every", 10 ** 6, "--measure-step", steps - 1, "--peak-params", 0, *extra]
    if kind == "torch":
        grid = grid_args("08_hybrid", nproc, args) if name == "fsdp2_hsdp" else []  # 08's grid
        report = launch("scripts.perf.torch_reference", nproc, ["--impl", name, *args, *grid])
    else:
        report = launch(name, nproc, args + EXTRA[kind])
    times = report["step_time_s"][3:-1]  # drop warm-up (first-touch allocation, lazy optimizer
    # state) and the measured last step
    return statistics.median(times), report


def label_of(kind, name):
    return LABEL[name] if kind == "torch" else " ".join([name, *EXTRA[kind]])


def summarize(todo, medians, info):
    """One config's numbers, per run (variant): the table's, the JSON's and the plot's."""
    runs = []
    for v in todo:
        kind, name = v
        report, ref = info[v], ("torch", COUNTERPART.get(name, name))
        med = statistics.median(medians[v])
        per_rank = report["memory"]["per_rank"]
        wire = [w for w in report["comm"]["wire_bytes_per_rank"] if w is not None]
        runs.append({
            "run": label_of(kind, name), "kind": kind, "name": name,
            "counterpart": None if kind == "torch" else LABEL[ref[1]],
            "round_medians_s": medians[v], "median_s": med,
            "spread_s": [min(medians[v]), max(medians[v])],
            # ratio of the medians, and each round's ratio (same round: the same minutes)
            "vs_pytorch": None if kind == "torch" else med / statistics.median(medians[ref]),
            "vs_pytorch_rounds": None if kind == "torch" else [a / b for a, b in zip(medians[v], medians[ref])],
            "vs_limit": med / statistics.median(medians[("torch", "local")]),
            # the ring's collectives against torch's, same lesson, same rounds
            "vs_torch_collectives": None if kind != "lesson-ring" or ("lesson", name) not in medians else
            med / statistics.median(medians["lesson", name]),
            "vs_torch_collectives_rounds": None if kind != "lesson-ring" or ("lesson", name) not in medians else
            [a / b for a, b in zip(medians[v], medians["lesson", name])],
            "tokens_per_s": report["config"]["global_batch"] * report["config"]["seq_len"] / med,
            "wire_bytes_per_step": max(wire) if wire else None,
            # what the lesson's own collectives add up to, ring-counted (PyTorch's are not seen: C++)
            "ring_bytes_per_step": None if kind == "torch" else report["comm"]["issued_ring_bytes_per_step"],
            "theory_ring_bytes_per_step": report["comm"]["theory_ring_bytes_per_step"],
            # on the device; 07 keeps the rest on the host (None: no host tier measured)
            "state_bytes": max(device_and_host(m)[0] for m in per_rank),
            "host_state_bytes": max(device_and_host(m)[1] for m in per_rank) if "host" in per_rank[0] else None,
            "max_rss": max((m.get("max_rss") or 0) for m in per_rank) or None,
        })
    return {"n_params": next(iter(info.values()))["n_params"], "runs": runs}


def table_for(config, summary):
    """A markdown table: median step time, spread, ratio to the PyTorch counterpart, tokens/s,
    bytes sent and held per rank."""
    rows = [f"\n**{config}** (Psi = {summary['n_params']:,} parameters)\n",
            "| run | median step (ms) | spread (ms) | / limit | vs PyTorch | tokens/s | sent MiB/rank/step "
            "| held MiB/rank | host MiB/rank | peak RSS MiB/rank |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["runs"]:
        lo, hi = r["spread_s"]
        sent = "" if r["wire_bytes_per_step"] is None else f"{mib(r['wire_bytes_per_step']):.2f}"
        rss = "" if r["max_rss"] is None else f"{mib(r['max_rss']):.0f}"
        host = "" if r.get("host_state_bytes") is None else f"{mib(r['host_state_bytes']):.2f}"
        ratio = "" if r["vs_pytorch"] is None else f"{r['vs_pytorch']:.2f}x"
        rows.append(f"| {r['run']} | {1e3 * r['median_s']:.1f} | {1e3 * lo:.1f}-{1e3 * hi:.1f} "
                    f"| {r['vs_limit']:.2f}x | {ratio} "
                    f"| {r['tokens_per_s']:,.0f} | {sent} | {mib(r['state_bytes']):.2f} | {host} | {rss} |")
    ring = [r for r in summary["runs"] if r.get("vs_torch_collectives")]
    if ring:
        rows.append("\n| lesson | ring / torch collectives | per round |\n|---|---:|---|")
        rows += [f"| {r['name']} | {r['vs_torch_collectives']:.3f}x | "
                 f"{', '.join(f'{x:.3f}' for x in r['vs_torch_collectives_rounds'])} |" for r in ring]
    return "\n".join(rows)


def plot(results, path):
    """Per config, one row of bar charts: ratio to the limit (local), to PyTorch (whiskers: the rounds' ratios),
    tokens/s, bytes sent per rank per step, model states held, peak RSS."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("step time / local's (the limit)", lambda r: r["vs_limit"]),
              ("step time / PyTorch's", lambda r: r["vs_pytorch"]),
              ("tokens/s", lambda r: r["tokens_per_s"]),
              ("sent MiB per rank per step (wire)", lambda r: r["wire_bytes_per_step"] and mib(r["wire_bytes_per_step"])),
              ("held MiB per rank (params+grads+optim; 07: device)", lambda r: mib(r["state_bytes"])),
              ("peak RSS MiB per rank", lambda r: r["max_rss"] and mib(r["max_rss"]))]
    heights = [0.32 * len(s["runs"]) + 1.2 for s in results.values()]
    fig, axes = plt.subplots(len(results), len(panels), figsize=(4 * len(panels) + 2.5, sum(heights)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for (config, summary), row in zip(results.items(), axes):
        runs = summary["runs"][::-1]  # top to bottom in the table's order
        y = range(len(runs))
        colors = ["#AAAAAA" if r["kind"] == "torch" else "#4C72B0" for r in runs]
        for col, (ax, (title, value)) in enumerate(zip(row, panels)):
            vals = [value(r) or 0 for r in runs]
            ax.barh(y, vals, color=colors)
            if col == 1:  # whiskers: the spread of the per-round ratios
                for i, r in enumerate(runs):
                    if r["vs_pytorch_rounds"]:
                        ax.plot([min(r["vs_pytorch_rounds"]), max(r["vs_pytorch_rounds"])], [i, i], "k-", lw=1.5)
            if col <= 1:  # the two ratios: 1 is the limit, or PyTorch
                ax.axvline(1, color="k", lw=1, ls=":")
            ax.set_yticks(list(y), [r["run"] for r in runs] if col == 0 else [""] * len(runs), fontsize=9)
            ax.set_title(title if config == next(iter(results)) else "", fontsize=10)
            ax.tick_params(axis="x", labelsize=8)
            ax.grid(axis="x", alpha=0.3)
        row[0].set_ylabel(f"{config}\nPsi = {summary['n_params']:,}", fontsize=10)
    fig.suptitle("Lessons (blue) against their PyTorch counterparts (grey), 2 ranks, CPU (gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = Parser("bench", description=__doc__)
    p.add_argument("--rounds", type=at_least(1), default=3)
    p.add_argument("--steps", type=at_least(1), default=20)
    p.add_argument("--nproc", type=at_least(1), default=2)
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--lessons", nargs="+", default=None, choices=available_lessons(), metavar="LESSON",
                   help="e.g. 01_vanilla_dp 03_buckets")
    p.add_argument("--collectives", nargs="+", choices=["torch", "ring"], default=["torch"],
                   help="run each lesson on torch's collectives, the ring's (--collectives ring), or both")
    p.add_argument("--quick", action="store_true", help="a tiny model, 1 round of 6 steps: a smoke test")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench"),
                   help="where bench.md, bench.json and bench.png go")
    p.add_argument("--json", default=None, help="also write the JSON here")
    a = p.parse_args()
    if a.quick:
        a.rounds, a.steps = 1, 6
    if a.steps < 5:
        p.error("--steps must be at least 5: 3 warm-up steps, one timed, the measured last one")
    p.folder("--out", a.out)
    lessons = a.lessons or available_lessons()
    results = {}
    for config in a.configs:
        todo = variants([l for l in lessons if l in CONFIG_LESSONS.get(config, lessons)], a.collectives)
        if not todo:
            continue
        medians = {v: [] for v in todo}
        info = {}
        for r in range(a.rounds):
            for v in todo:
                t, report = run_one(*v, a.nproc, a.steps, CONFIGS[config] + (QUICK if a.quick else []))
                medians[v].append(t)
                info[v] = report
            print(f"[{config}] round {r + 1}/{a.rounds} done", flush=True)
        results[config] = summarize(todo, medians, info)
        print(table_for(config, results[config]), flush=True)  # as soon as it is known
    header = (f"{a.nproc} ranks, CPU (gloo), {platform.processor() or platform.machine()}, "
              f"{usable_cpus()} cores, torch {torch.__version__}, {a.rounds} interleaved rounds x {a.steps} steps"
              + (" (--quick: a tiny model)" if a.quick else ""))
    md = header + "\n" + "\n".join(table_for(c, s) for c, s in results.items()) + "\n"
    print("\n" + md)
    with open(os.path.join(a.out, "bench.md"), "w") as f:
        f.write(md)
    doc = {"meta": {"header": header, "nproc": a.nproc, "rounds": a.rounds, "steps": a.steps, "quick": a.quick,
                    "timed_steps": f"3..{a.steps - 2}", "torch": torch.__version__, "cores": usable_cpus()},
           "configs": {c: {**s, "flags": CONFIGS[c] + (QUICK if a.quick else [])} for c, s in results.items()}}
    for path in [os.path.join(a.out, "bench.json")] + ([a.json] if a.json else []):
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
    if results:
        plot(results, os.path.join(a.out, "bench.png"))
    print(f"wrote {os.path.relpath(a.out, ROOT)}/bench.md, bench.json, bench.png")


if __name__ == "__main__":
    sys.exit(tool_main("bench", main))
