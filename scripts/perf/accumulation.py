"""Gradient accumulation with a collective per micro-step or once a step, measured (make accumulation).

    make accumulation          # 05-08 at 4 ranks on CPU, K = 1, 2, 4, 8 micro-steps (about 3 minutes)

1. Memory against bytes: each of 05-08 with --reduce-every micro and step (08 also with
   --all-reduce-every step), for each K: the bytes a rank issues per optimizer step (08: per
   link) and the gradient bytes it holds between micro-steps, each beside theory.py's formula.
2. The slow link: 08 as 2 simulated nodes of 2 ranks (--inter-link), with the cross-replica
   all-reduce at every micro-step or once a step: the step time, and the cost model's
   recommendation (cost_model.accumulation_choice) checked against it: the choice it makes is
   the faster one measured, and the time it says that saves is within --tolerance of the time
   measured saved (both as a share of that saving).

Writes docs/results.md's "accumulation" section and docs/figures/accumulation.png; exits 1 where
a check fails. Every flag it does not know goes to the lessons (e.g. --n-layer 2).
"""
import os
import statistics
import sys

from lessonkit import common
from scripts.learn import cost_model
from scripts.learn.results import machine, write_section
from scripts.runs import ROOT, Parser, launch, mib, tool_main

LESSONS = ("05_zero2", "06_zero3", "07_offload", "08_hybrid")
FIGURE = os.path.join(ROOT, "docs", "figures", "accumulation.png")


def runs(ks):
    """{run name (sweep.py's: a lesson and its flags): (lesson, K, choice)}."""
    out = {}
    for lesson in LESSONS:
        for k in ks:
            choices = ["micro"] + (["step"] if k > 1 else []) + (["all-reduce step"] if k > 1 and lesson == "08_hybrid" else [])
            for choice in choices:
                flag = "--all-reduce-every step" if choice == "all-reduce step" else f"--reduce-every {choice}"
                out[f"{lesson} --grad-accum {k} {flag}"] = (lesson, k, choice)
    return out


def sweep(names, flags, nproc):
    out = launch("scripts.perf.sweep", nproc, [*flags, "--track-peak", "--lessons", *names])
    world = out["worlds"][str(nproc)]
    return world["reports"], world["seconds"]


def table(reports, named):
    rows = ["|lesson|K|reduce|issued MiB/step|theory|held between micro-steps, MiB|theory|", "|---|---:|---|---:|---:|---:|---:|"]
    points, wrong = [], []
    for name, (lesson, k, choice) in named.items():
        r = reports[name]
        comm, mem = r["comm"], r["memory"]
        issued, theory = comm["issued_ring_bytes_per_step"], comm["theory_ring_bytes_per_step"]
        if "per_link" in comm:  # 08: the link between nodes is the one the choice is about
            inter = comm["per_link"]["inter"]
            issued, theory = inter["issued_ring_bytes_per_step"], inter["theory_ring_bytes_per_step"]
        held, held_theory = mem["per_rank"][0]["held_grads"], mem["theory"]["held_grads"]
        cell = lambda x: "-" if x is None else f"{mib(x):.3f}"  # noqa: E731  (K = 1: no micro-step to hold across)
        rows.append(f"|{lesson}{', between nodes' if 'per_link' in comm else ''}|{k}|{choice}|{mib(issued):.3f}|"
                    f"{mib(theory):.3f}|{cell(held)}|{cell(held_theory)}|")  # (no spaces: a row of numbers is not prose)
        points.append((lesson, k, choice, held, issued))
        if abs(issued - theory) > 0.02 * theory + 1024:  # padding: a few elements per unit
            wrong.append(f"{name}: issued {issued:.0f} B, theory {theory:.0f} B")
    return rows, points, wrong


def slow_link(flags, nproc, ks, inter, steps, tolerance):
    """08 on 2 nodes of nproc/2 ranks, --inter-link `inter`: the median step time of each choice
    per K, and the cost model's (what it picks, the seconds it says that saves)."""
    link = ["--inter-link", inter, "--ranks-per-node", str(nproc // 2), "--peak-params", "0", "--steps", str(steps)]
    named = {f"08_hybrid --grad-accum {k} --all-reduce-every {c}": (k, c) for k in ks for c in ("micro", "step")}
    reports, _ = sweep(list(named), [*flags, *link], nproc)
    times = {named[n]: statistics.median(r["step_time_s"][1:] or r["step_time_s"]) for n, r in reports.items()}
    by = {named[n]: r for n, r in reports.items()}
    gbps, us = map(float, inter.split(":"))
    rows = ["|K|all-reduce every micro-step, ms|once a step, ms|measured saving, ms|model's choice|model's saving, ms|",
            "|---:|---:|---:|---:|---|---:|"]
    wrong = []
    for k in ks:
        r = by[k, "micro"]
        units = r["comm"]["per_link"]["inter"]["ops"]["all_reduce"]["calls"] // k  # one per unit a micro-step
        pick = cost_model.accumulation_choice(r["n_params"], nproc, nproc // 2, k, r["precision"], 0,
                                              cost_model.simulated_link(gbps, us), units)
        measured = times[k, "micro"] - times[k, "step"]
        rows.append(f"|{k}|{times[k, 'micro'] * 1e3:.0f}|{times[k, 'step'] * 1e3:.0f}|{measured * 1e3:.0f}|"
                    f"{pick['all_reduce_every']}|{pick['saved_s'] * 1e3:.0f}|")
        if k == 1:  # one micro-step: the two are one program
            continue
        if times[k, pick["all_reduce_every"]] > min(times[k, "micro"], times[k, "step"]) + tolerance * pick["saved_s"]:
            wrong.append(f"K={k}: the model picked {pick['all_reduce_every']}, measured slower")  # (beyond the noise allowed)
        if not abs(measured - pick["saved_s"]) <= tolerance * pick["saved_s"]:
            wrong.append(f"K={k}: saving measured {measured * 1e3:.0f} ms, the model {pick['saved_s'] * 1e3:.0f} ms")
    return rows, times, wrong


# The model counts every skipped all-reduce whole; the runs hide some of each beside backward's
# compute, and 4 ranks on 2 cores add the ring's own work (at_scale.py calibrates that part)
TOLERANCE = 0.5


def figure(points, times, ks, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for lesson in ("05_zero2", "06_zero3", "08_hybrid"):  # (07 is 06's bytes and memory: drawn over it)
        for choice, marker in (("micro", "o"), ("step", "s"), ("all-reduce step", "^")):
            xs = [(mib(h), mib(i), k) for l, k, c, h, i in points if l == lesson and c == choice and h is not None]
            if xs:
                a.plot([x for x, _, _ in xs], [y for _, y, _ in xs], marker=marker, linestyle="-",
                       label=f"{'06, 07' if lesson == '06_zero3' else lesson[:2]} {choice}")
                for x, y, k in xs:
                    a.annotate(f"K={k}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    a.set(xlabel="gradient MiB held between micro-steps (rank 0)", ylabel="MiB issued per step (08: between nodes)",
          title="memory against bytes, 4 ranks")
    a.legend(fontsize=7)
    for choice in ("micro", "step"):
        b.plot(ks, [times[k, choice] * 1e3 for k in ks], marker="o", label=f"--all-reduce-every {choice}")
    b.set(xlabel="micro-steps K", ylabel="step ms", title="08, 2 nodes x 2 ranks, a slow link between")
    b.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def main():
    p = Parser("accumulation", description=__doc__)
    p.add_argument("--nproc", type=int, default=4, help="ranks (even: 08 runs as 2 nodes)")
    p.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8], help="the K to run")
    p.add_argument("--inter-link", default="0.02:200", help="the simulated link between the 2 nodes, GBPS:LATENCY_US")
    p.add_argument("--steps", type=int, default=6, help="steps per run on the slow link (the first not timed)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help="how far the measured saving may be from the model's, a share")
    p.add_argument("--no-write", action="store_true", help="print, do not write docs/results.md")
    p.add_argument("--figure", default=FIGURE, help="where to draw the figure")
    a, flags = p.parse_known_args()
    unknown = common.build_parser().parse_known_args(flags)[1]  # the lessons' flags, checked before any run
    if unknown or a.nproc < 2 or a.nproc % 2 or min(a.micro) < 1:
        p.error(f"unrecognized arguments: {' '.join(unknown)}" if unknown else
                f"--nproc {a.nproc} must be even (08 runs as 2 nodes), and --micro at least 1")
    flags = ["--steps", "2", "--measure-step", "1", "--global-batch", str(a.nproc * max(a.micro)),
             "--n-layer", "2", "--d-model", "64", "--log-every", "100", *flags]
    named = runs(a.micro)
    reports, _ = sweep(list(named), flags, a.nproc)
    rows, points, wrong = table(reports, named)
    link_rows, times, link_wrong = slow_link(flags, a.nproc, a.micro, a.inter_link, a.steps, a.tolerance)
    psi = next(iter(reports.values()))["n_params"]
    body = "\n".join([
        "## Gradient accumulation: a collective per micro-step or once a step", "",
        f"Machine: {machine()}. `make accumulation`: {a.nproc} ranks on CPU, fp32, Psi = {psi:,}, "
        f"08 as 2 nodes of {a.nproc // 2}.", "", *rows, "",
        f"08 on a simulated {a.inter_link.replace(':', ' Gb/s, ')} us link between the nodes (--inter-link), "
        "median step time; the cost model's choice and the time it says that saves:", "", *link_rows])
    print(body)
    for kind, lines in (("bytes", wrong), ("time", link_wrong)):
        for line in lines:
            print(f"check failed ({kind}): {line}")
    figure(points, times, a.micro, a.figure)
    if not a.no_write:
        write_section("accumulation", body)
    print(f"wrote {'' if a.no_write else 'docs/results.md and '}{os.path.relpath(a.figure, ROOT)}")
    return 1 if wrong or link_wrong else 0


if __name__ == "__main__":
    sys.exit(tool_main("accumulation", main))
