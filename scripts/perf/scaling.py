"""Scaling: step time, bytes sent and bytes held per rank, against model size and world size.

    make scaling                                          # or: .venv/bin/python -m scripts.perf.scaling
    .venv/bin/python -m scripts.perf.scaling --sizes 1M 5M --worlds 1 2     # a subset
    .venv/bin/python -m scripts.perf.scaling --quick           # two tiny models, worlds 1 and 2, one launch,
                                                          # into runs/scaling-quick/ (a smoke test)
    .venv/bin/python -m scripts.perf.scaling --replot          # tables and plots again from scaling.json

For each world size, ONE torchrun launch of scripts/perf/sweep.py runs every lesson at every model
size, size by size with the lessons in reading order, so the lessons compared at one size run
within a minute or two of each other (step times on a shared 2-core machine drift +-25 % over
minutes). Every model trains on the same tokens per step (--global-batch 8 --seq-len 32), so a
longer step means more parameters, not more data.

Per run (a lesson at a size and a world size):
- step time: the median over the steps after WARMUP warm-up steps (Adam's lazy state, first
  touch of memory), the last step excluded: it is the measured one (collectives wrapped, memory
  walked after every operation in 06), whose time says nothing about the lesson;
- bytes sent per rank per optimizer step, issued: the payloads the lesson asked for in the
  measured step (comm_meter.CommMeter) times the ring factor, a count, next to the ZeRO paper's
  2 Psi (3 Psi for ZeRO-3) x (N-1)/N; and wire: what each rank's process wrote to its sockets
  (measured, /proc/self/io; gloo on Linux), the most of any rank;
- bytes held per rank at rest (params, grads, optimizer state), walked from the live tensors
  (memory_ledger.MemoryLedger), next to the paper's formula: on the device (07's device tier, its
  host tier in a column of its own); for 06 also peak_params, the most
  parameter bytes alive at once in the step (its shards plus the units gathered in flight;
  sampled after every operation, so only 06 pays for it: in 01-05 it equals params at rest).

Outputs: OUT/scaling.json (every number above, per run), OUT/scaling.md (the tables), and two
figures in --figures: scaling_model_size.png (against Psi, at world 2) and
scaling_world_size.png (against the world size, at the largest model). With 4 ranks on 2 cores
every core runs two ranks: read world 4's step times as oversubscribed, its bytes as exact.
"""
import json
import os
import platform
import statistics
import sys
import time

from scripts.runs import ROOT, Parser, at_least, available_lessons, launch, mib, tool_main, usable_cpus

# n_layer, d_model, n_head: Psi from about 1M to about 50M (exact counts printed from the model:
# a block holds 12 d^2 + 13 d parameters; the embeddings (64 + 32) d, the final norm 2 d)
SIZES = {"1M": (4, 128, 4), "5M": (6, 256, 4), "15M": (8, 384, 6), "50M": (10, 640, 10)}
QUICK_SIZES = {"tiny": (1, 32, 2), "small": (2, 64, 2)}
WORLDS = (1, 2, 4)
FLAGS = ["--global-batch", "8", "--seq-len", "32", "--log-every", str(10 ** 6)]
WARMUP = 2
NAMES = {"01_vanilla_dp": "01 DP", "02_async_allreduce": "02 async", "03_buckets": "03 buckets",
         "04_zero1": "04 ZeRO-1", "05_zero2": "05 ZeRO-2", "06_zero3": "06 ZeRO-3",
         "07_offload": "07 offload (memory: device)"}


def size_flags(size):
    n_layer, d_model, n_head = size
    return ["--n-layer", str(n_layer), "--d-model", str(d_model), "--n-head", str(n_head)]


def run_worlds(worlds, sizes, lessons, flags, track_peak):
    """One torchrun launch of max(worlds) ranks: every lesson at every size at each world size
    (scripts/perf/sweep.py re-forms the group for the smaller ones); {(world, lesson, size): (report, s)}."""
    runs = {f"{lesson} {' '.join(size_flags(dims))}": (lesson, label)
            for label, dims in sizes.items() for lesson in lessons}
    tracked = [name for name, (lesson, _) in runs.items() if lesson in track_peak]
    argv = [*flags, "--worlds", *worlds, "--lessons", *runs, "--track-peak", *tracked]
    out = launch("scripts.perf.sweep", max(worlds), argv)
    return {(world, *runs[name]): (report, out["worlds"][str(world)]["seconds"][name])
            for world in worlds for name, report in out["worlds"][str(world)]["reports"].items()}


def row(lesson, size, world, report, seconds):
    """The numbers kept for one run: every rank's maximum where ranks differ (padding)."""
    per_rank, states = report["memory"]["per_rank"], ("params", "grads", "optimizer")
    tiered = "host" in per_rank[0]  # 07: what its device holds, and its host tier beside
    held = {k: max((m["device"] if tiered else m)[k] for m in per_rank) for k in (*states, "other")}
    held["total"] = sum(held[k] for k in states)
    theory = report["memory"]["theory_tiers"]["device"] if tiered else report["memory"]["theory"]
    timed = report["step_time_s"][WARMUP:-1]
    wire = [w for w in report["comm"]["wire_bytes_per_rank"] if w is not None]
    peaks = [m["peak_params"] for m in per_rank if m.get("peak_params") is not None]
    return {
        "lesson": lesson, "size": size, "world_size": world, "n_params": report["n_params"],
        "precision": report["precision"], "step_time_s": statistics.median(timed), "timed_steps_s": timed,
        "tokens_per_s": report["config"]["global_batch"] * report["config"]["seq_len"] / statistics.median(timed),
        "issued_ring_bytes_per_step": report["comm"]["issued_ring_bytes_per_step"],
        "theory_ring_bytes_per_step": report["comm"]["theory_ring_bytes_per_step"],
        "wire_bytes_per_step": max(wire) if wire else None,
        "memory": held, "theory_memory": {**{k: theory[k] for k in states}, "total": sum(theory[k] for k in states)},
        "host": max(sum(m["host"][k] for k in states) for m in per_rank) if tiered else None,
        "theory_host": sum(report["memory"]["theory_tiers"]["host"].values()) if tiered else None,
        "peak_params": max(peaks) if peaks else None,
        "losses": report["losses"], "wall_s": seconds,
    }


def tables(result):
    """Markdown: one table per world size, lessons grouped by model size."""
    out = [f"Scaling: {result['meta']['summary']}\n",
           "Step = median step time; issued = per rank per optimizer step, the payloads the lesson asked "
           "for times the ring factor, a count (theory); wire = what a rank's process wrote to its sockets, "
           "measured, the most of any rank (gloo's reduce-scatter is an all-reduce underneath, so 04-06 "
           "write more than theory); held = bytes per rank at rest, measured (theory): on the device, which "
           "for 07 is its device tier, its host's in host MiB (on a CPU-only machine, one memory); "
           "peak params: the most parameter bytes alive at once in the step (06 only). MiB = 2^20 bytes.\n"]
    for world in result["worlds"]:
        rows = [r for r in result["rows"] if r["world_size"] == world]
        if not rows:
            continue
        out += [f"\n**world size {world}**\n",
                "| size | Psi | lesson | step (ms) | tokens/s | issued MiB (theory) | wire MiB | params MiB "
                "| grads MiB | optimizer MiB | held MiB (theory) | host MiB (theory) | peak params MiB |",
                "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            m, th, wire = r["memory"], r["theory_memory"], r["wire_bytes_per_step"]
            host = "" if r.get("host") is None else f"{mib(r['host']):.2f} ({mib(r['theory_host']):.2f})"
            out.append(f"| {r['size']} | {r['n_params']:,} | {r['lesson']} | {1e3 * r['step_time_s']:.1f} "
                       f"| {r['tokens_per_s']:,.0f} | {mib(r['issued_ring_bytes_per_step']):.2f} "
                       f"({mib(r['theory_ring_bytes_per_step']):.2f}) "
                       f"| {'n/a' if wire is None else f'{mib(wire):.2f}'} | {mib(m['params']):.2f} "
                       f"| {mib(m['grads']):.2f} | {mib(m['optimizer']):.2f} | {mib(m['total']):.2f} "
                       f"({mib(th['total']):.2f}) | {host} | "
                       + (f"{mib(r['peak_params']):.2f} |" if r["peak_params"] is not None else "|"))
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- figures
COLORS = {"01_vanilla_dp": "#4C72B0", "02_async_allreduce": "#64B5CD", "03_buckets": "#8172B3",
          "04_zero1": "#DD8452", "05_zero2": "#55A868", "06_zero3": "#C44E52", "07_offload": "#937860"}
# 01-03 send and hold the same bytes: shrinking markers keep every lesson visible where lines coincide
MARKERS = {"01_vanilla_dp": ("o", 11), "02_async_allreduce": ("s", 8), "03_buckets": ("^", 6),
           "04_zero1": ("D", 7), "05_zero2": ("v", 7), "06_zero3": ("P", 8), "07_offload": ("X", 8)}


def _axes(n, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 12, "axes.spines.top": False, "axes.spines.right": False,
                         "axes.grid": True, "grid.alpha": 0.3})
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 4.6))
    fig.suptitle(title)
    return plt, fig, axes


def _lines(ax, rows, x, y, lessons, theory=None, **kw):
    for lesson in lessons:
        pts = sorted((x(r), y(r)) for r in rows if r["lesson"] == lesson and y(r) is not None)
        marker, size = MARKERS.get(lesson, ("o", 7))
        if pts:
            ax.plot(*zip(*pts), "-", marker=marker, ms=size, color=COLORS.get(lesson),
                    label=NAMES.get(lesson, lesson), **kw)
        if theory:
            pts = sorted((x(r), theory(r)) for r in rows if r["lesson"] == lesson)
            ax.plot(*zip(*pts), ":", color=COLORS.get(lesson), lw=1.5)


def _log_axes(axes, logy):
    from matplotlib.ticker import EngFormatter, FuncFormatter, NullFormatter
    for ax, log in zip(axes, logy):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 1M, 10M
        ax.xaxis.set_minor_formatter(NullFormatter())
        if log:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())


def plot_model_size(result, world, path):
    rows = [r for r in result["rows"] if r["world_size"] == world]
    lessons = [l for l in result["lessons"] if any(r["lesson"] == l for r in rows)]
    plt, fig, (a, b, c) = _axes(3, f"Against model size, {world} ranks, CPU (gloo), {result['meta']['precision']}")
    psi = lambda r: r["n_params"]
    _lines(a, rows, psi, lambda r: 1e3 * r["step_time_s"], lessons)
    a.set(xlabel="parameters (Psi)", ylabel="median step time (ms)", title="step time")
    _lines(b, rows, psi, lambda r: mib(r["issued_ring_bytes_per_step"]), lessons,
           theory=lambda r: mib(r["theory_ring_bytes_per_step"]))
    b.set(xlabel="parameters (Psi)", ylabel="MiB per rank per step",
          title="bytes issued (dotted: 2Psi or 3Psi x (N-1)/N)" if world > 1 else "bytes issued (none at world 1)")
    _lines(c, rows, psi, lambda r: mib(r["memory"]["total"]), lessons, theory=lambda r: mib(r["theory_memory"]["total"]))
    c.set(xlabel="parameters (Psi)", ylabel="MiB per rank", title="model states on the device (dotted: ZeRO)")
    _log_axes((a, b, c), (True, world > 1, True))  # at world 1 nothing is sent: no logarithm
    psis = sorted({r["n_params"] for r in rows})
    for ax in (a, b, c):  # a tick at every model measured
        ax.set_xticks(psis, [f"{p / 1e6:.2g}M" if p >= 1e5 else f"{p / 1e3:.3g}k" for p in psis])
    a.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_world_size(result, size, path):
    rows = [r for r in result["rows"] if r["size"] == size]
    lessons = [l for l in result["lessons"] if any(r["lesson"] == l for r in rows)]
    psi = rows[0]["n_params"]
    plt, fig, (a, b, c) = _axes(3, f"Against world size, Psi = {psi:,} ({size}), CPU (gloo), "
                                   f"{result['meta']['precision']}")
    n = lambda r: r["world_size"]
    _lines(a, rows, n, lambda r: 1e3 * r["step_time_s"], lessons)
    a.set(xlabel="ranks (2 cores: 4 ranks share them)", ylabel="median step time (ms)", title="step time")
    _lines(b, rows, n, lambda r: mib(r["issued_ring_bytes_per_step"]), lessons,
           theory=lambda r: mib(r["theory_ring_bytes_per_step"]))
    b.set(xlabel="ranks", ylabel="MiB per rank per step", title="bytes issued (dotted: theory)")
    _lines(c, rows, n, lambda r: mib(r["memory"]["total"]), lessons, theory=lambda r: mib(r["theory_memory"]["total"]))
    # ZeRO-3 holds its shards at rest, and during the step the units gathered in flight
    peak = [r for r in rows if r["lesson"] == "06_zero3" and r["peak_params"] is not None]
    if peak:
        pts = sorted((n(r), mib(r["memory"]["total"] - r["memory"]["params"] + r["peak_params"])) for r in peak)
        c.plot(*zip(*pts), "s--", color=COLORS["06_zero3"], alpha=0.6, label="06 during the step (gathered units)")
        c.legend(fontsize=9)
    c.set(xlabel="ranks", ylabel="MiB per rank", title="model states on the device (dotted: ZeRO)", ylim=(0, None))
    for ax in (a, b, c):
        ax.set_xticks(sorted({n(r) for r in rows}))
    a.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result, out, figures):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "scaling.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = tables(result)
    with open(os.path.join(out, "scaling.md"), "w") as f:
        f.write(md)
    os.makedirs(figures, exist_ok=True)
    worlds = sorted({r["world_size"] for r in result["rows"]})
    sizes = [s for s in result["sizes"] if any(r["size"] == s for r in result["rows"])]
    written = []
    if len(sizes) > 1:  # at world 2, else the largest world run
        world = 2 if 2 in worlds else worlds[-1]
        written.append(os.path.join(figures, "scaling_model_size.png"))
        plot_model_size(result, world, written[-1])
    if len(worlds) > 1:  # at the largest size run at every world size
        size = [s for s in sizes if {r["world_size"] for r in result["rows"] if r["size"] == s} == set(worlds)]
        if size:
            written.append(os.path.join(figures, "scaling_world_size.png"))
            plot_world_size(result, size[-1], written[-1])
    return md, written


def main():
    p = Parser("scaling", description=__doc__)
    p.add_argument("--sizes", nargs="+", default=None, help=f"model sizes, of {' '.join(SIZES)} (default: all)")
    p.add_argument("--worlds", type=at_least(1), nargs="+", default=list(WORLDS), help="world sizes (default: 1 2 4)")
    p.add_argument("--lessons", nargs="+", default=None, help="default: every lesson")
    p.add_argument("--steps", type=at_least(1), default=6,
                   help=f"steps per run: {WARMUP} warm-up, the timed ones, the measured last one")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--track-peak", nargs="*", default=["06_zero3"], metavar="LESSON",
                   help="lessons whose peak_params is sampled (~2 ms per operation of the measured step)")
    p.add_argument("--quick", action="store_true", help="two tiny models, worlds 1 and 2, 4 steps")
    p.add_argument("--out", default=None, help="scaling.json and scaling.md (default runs/scaling, "
                   "runs/scaling-quick with --quick)")
    p.add_argument("--figures", default=None, help="where the PNG files go (default docs/figures; with "
                   "--quick, OUT: a smoke test does not overwrite the README's figures)")
    p.add_argument("--replot", action="store_true", help="no runs: tables and figures from OUT/scaling.json")
    a = p.parse_args()
    a.out = a.out or os.path.join(ROOT, "runs", "scaling-quick" if a.quick else "scaling")
    a.figures = a.figures or (a.out if a.quick else os.path.join(ROOT, "docs", "figures"))
    if a.replot:
        saved = os.path.join(a.out, "scaling.json")
        if not os.path.isfile(saved):
            p.error(f"--replot: there is no {saved}: run make scaling first (or give --out its folder)")
        with open(saved) as f:
            result = json.load(f)
        for r in result["rows"]:  # a scaling.json written before the key said what it counts
            if "ring_bytes_per_step" in r:
                r["issued_ring_bytes_per_step"] = r.pop("ring_bytes_per_step")
        md, written = write_outputs(result, a.out, a.figures)
        print(md + "\n" + "\n".join(f"wrote {os.path.relpath(w, ROOT)}" for w in written))
        return
    catalogue = QUICK_SIZES if a.quick else SIZES
    if a.quick:
        a.worlds, a.steps = [w for w in a.worlds if w <= 2], min(a.steps, 4)
        if not a.worlds:
            p.error("--quick runs worlds 1 and 2 only: give --worlds 1 or 2, or leave out --quick")
    sizes = {s: catalogue[s] for s in (a.sizes or catalogue) if s in catalogue}
    if a.sizes and len(sizes) != len(a.sizes):
        p.error(f"--sizes: choose from {' '.join(catalogue)}")
    if a.steps < WARMUP + 2:
        p.error(f"--steps must be at least {WARMUP + 2}: warm-up, one timed step, the measured one")
    p.folder("--out", a.out)
    p.folder("--figures", a.figures)
    lessons = a.lessons or available_lessons()
    flags = [*FLAGS, "--steps", str(a.steps), "--measure-step", str(a.steps - 1), "--precision", a.precision]
    result = {"meta": {"torch": _torch_version(), "cores": usable_cpus(),
                       "machine": platform.processor() or platform.machine(), "precision": a.precision,
                       "steps": a.steps, "warmup": WARMUP, "flags": flags,
                       "summary": f"CPU (gloo), {usable_cpus()} cores, torch {_torch_version()}, {a.precision}, "
                                  f"global batch 8 x seq 32, median of steps {WARMUP}..{a.steps - 2} of {a.steps}"},
              "sizes": {s: {"n_layer": d[0], "d_model": d[1], "n_head": d[2]} for s, d in sizes.items()},
              "lessons": lessons, "worlds": sorted(a.worlds), "rows": []}
    t_all = time.time()
    # A launch per world size: each starts from fresh processes, and a failure at 4 ranks keeps
    # what 1 and 2 measured. --quick saves a start-up: one launch, re-formed for each size.
    for worlds in [sorted(a.worlds)] if a.quick else [[w] for w in sorted(a.worlds)]:
        t0 = time.time()
        print(f"world {' and '.join(map(str, worlds))}: {len(lessons)} lessons x {len(sizes)} sizes, "
              "one launch ...", flush=True)
        runs = run_worlds(worlds, sizes, lessons, flags, a.track_peak)
        for world in worlds:
            for label in sizes:
                for lesson in lessons:
                    result["rows"].append(row(lesson, label, world, *runs[(world, lesson, label)]))
                    result["sizes"][label]["n_params"] = result["rows"][-1]["n_params"]  # Psi, exact
        print(f"  done in {time.time() - t0:.0f} s", flush=True)
        write_outputs(result, a.out, a.figures)  # after every launch: a failure later keeps it
    result["meta"]["seconds"] = time.time() - t_all
    md, written = write_outputs(result, a.out, a.figures)
    print(md)
    print(f"wrote {os.path.relpath(a.out, ROOT)}/scaling.json, scaling.md; "
          + ", ".join(os.path.relpath(w, ROOT) for w in written) + f" ({time.time() - t_all:.0f} s)")


def _torch_version():
    from importlib.metadata import version
    return version("torch")  # without importing torch here (3 s)


if __name__ == "__main__":
    sys.exit(tool_main("scaling", main))
