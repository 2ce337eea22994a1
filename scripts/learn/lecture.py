"""The lecture run: every lesson, 01 -> 08, at 2 ranks on CPU, in one launch, then one table.

    make lecture                                   # or: .venv/bin/python -m scripts.learn.lecture
    .venv/bin/python -m scripts.learn.lecture --steps 20 --n-layer 2     # any lesson flag passes through
    make lecture FIGURES=1                         # then regenerate the README's figures (make figures)
    make lecture LINK=1:50                         # on a simulated 1 Gb/s, 50 us link (--link: the ring)
    make lecture HYBRID=1                          # 06 against 08 at 4 ranks, two "nodes" on a slow link

One torchrun launch runs all the lessons back to back (scripts/perf/sweep.py: start-up is paid
once, about 6 s, instead of once per lesson). The lessons' own output (per-step lines, summaries, torchrun's
and the libraries' messages, every rank's) is captured; what is printed is one header line and
one table. It is shown only if the run fails.

Columns: the loss after K steps, with a check mark when it equals 01's to 4 decimals (in fp32
every lesson computes the same training as single-process training, to float round-off); the
median step time; rank 0's communication in the measured step, measured on its clock: from
each collective's issue to its completion (comm), and the part of it the rank sat blocked
waiting (exposed: what overlap did not hide); the ring bytes each rank issues per optimizer
step (what it asked for, times the ring factor) against the ZeRO paper's 2Psi (3Psi for ZeRO-3)
times (N-1)/N; the bytes each rank holds at rest, measured, by category, against the paper's
formula for that stage. The issued bytes include a few extras the formula leaves out (the
4-byte gradient-norm all-reduce, shard padding); they disappear at the printed precision.
06 runs twice, with and without prefetching the next unit's all-gather. 07's params, grads and
optim are what its device holds (my shard of the parameters, nothing else); the last two columns,
its host's bytes (masters, their gradients, Adam's moments): on this CPU-only machine, one memory.

With --link GBPS:LATENCY_US every lesson's collectives run on lesson 00's ring over a simulated
link (scripts/perf/ring_collectives.py): communication then costs what it would on that link, and the exposed
column shows what each lesson's idea buys: 01 waits for all of it after backward, 02 overlaps
per tensor, 03 in buckets, and 06's prefetch hides the next unit's gather behind compute.

--hybrid runs 06 and 08 only, at --nproc 4 by default, as two simulated nodes of nproc / 2 ranks
(--ranks-per-node; 08's shard group is the node) with --link inside a node and --inter-link
between them (default 10:5 and 0.5:100): 06's one ring crosses between nodes at two of its hops,
08's shard rings stay inside and only its replicate all-reduce crosses. Its table gives each
link's bytes per step (the busiest rank's: issued, on the wire, theory), the ranks that send
between nodes, the bytes rank 0 holds at rest, and the step time.
"""
import statistics
import subprocess
import sys

from scripts.perf.sweep import NO_PREFETCH
from scripts.runs import ROOT, Parser, at_least, available_lessons, device_and_host, launch, tool_main

CHECK, CROSS = "\u2713", "\u2717"


def run_sweep(nproc, steps, flags, lessons=None):
    """The lessons (default: all, and 06 without prefetch) in one torchrun launch on the CPU; return
    {lesson: report}. A failed run raises runs.LaunchFailed (tool_main: one line)."""
    lessons = lessons or [run for l in available_lessons() for run in ([l, NO_PREFETCH] if l == "06_zero3" else [l])]
    out = launch("scripts.perf.sweep", nproc, ["--lessons", *lessons,
                                               "--track-peak",  # no per-operation sampling: memory at rest
                                               "--steps", steps, "--log-every", max(steps, 1), *flags])
    return out["worlds"][str(nproc)]["reports"]


def table(reports, steps, nproc):
    first = next(iter(reports.values()))
    fmt = lambda b: f"{b / 2 ** 20:.3f}"  # noqa: E731  MiB
    cols = [("lesson", 21, "<"), ("loss", 8, ">"), ("", 1, "<"), ("step ms", 8, ">"), ("comm ms", 8, ">"),
            ("exposed", 8, ">"), ("issued", 7, ">"), ("theory", 7, ">"), ("params", 7, ">"), ("theory", 7, ">"),
            ("grads", 7, ">"), ("theory", 7, ">"), ("optim", 7, ">"), ("theory", 7, ">"),
            ("host", 7, ">"), ("theory", 7, ">")]  # (title, width, align)
    line = lambda cells: " ".join(f"{c:{a}{w}}" for c, (_, w, a) in zip(cells, cols)).rstrip()  # noqa: E731
    ref = round(reports[next(iter(reports))]["losses"][-1], 4)
    rows = []
    for lesson, r in reports.items():
        loss = r["losses"][-1]
        m, th, host = r["memory"]["per_rank"][0], r["memory"]["theory"], []
        if "host" in m:  # 07: what its device holds, by category; its host tier, all categories, beside
            tiers = r["memory"]["theory_tiers"]
            host = [fmt(device_and_host(m)[1]), fmt(sum(tiers["host"].values()))]
            m, th = m["device"], tiers["device"]
        ov = r["comm"]["overlap"] or {}
        name = lesson.replace("_zero3 --prefetch 0", "_no_prefetch")
        name += f"_G={r['config']['shard_group']}" if r["strategy"] == "hybrid" else ""  # 08's grid: G per node
        rows.append(line([name, f"{loss:.4f}",
                          CHECK if round(loss, 4) == ref else CROSS, f"{1e3 * statistics.median(r['step_time_s']):.1f}",
                          *(f"{ov[k]:.1f}" if k in ov else "n/a" for k in ("comm_ms", "exposed_ms")),
                          fmt(r["comm"]["issued_ring_bytes_per_step"]), fmt(r["comm"]["theory_ring_bytes_per_step"]),
                          fmt(m["params"]), fmt(th["params"]), fmt(m["grads"]), fmt(th["grads"]),
                          fmt(m["optimizer"]), fmt(th["optimizer"]), *host]))
    header = line([c for c, _, _ in cols])
    cfg = first["config"]
    link = f" on a simulated {cfg['link'].replace(':', ' Gb/s, ')} us link" if cfg.get("link") else ""
    title = (f"{nproc} ranks, {first['precision']}, {cfg['collectives']} collectives{link}, Psi = {first['n_params']:,}, "
             f"loss after {steps} steps ({CHECK} = 01's to 4 decimals); rank 0's communication in ms "
             f"(measured: issue to completion, and exposed); MiB per rank: issued per step, held at rest (07: on "
             f"its device, and on its host), each vs theory")
    return "\n".join([title, header, "-" * len(header), *rows])


def hybrid_flags(nproc, flags):
    """--hybrid's lessons and flags: 06 and 08 on nodes of nproc / 2, on --link and --inter-link
    (10:5 and 0.5:100 unless the flags name either)."""
    links = [] if {"--link", "--inter-link"} & set(flags) else ["--link", "10:5", "--inter-link", "0.5:100"]
    node = [] if "--ranks-per-node" in flags else ["--ranks-per-node", str(max(nproc // 2, 1))]
    return ["06_zero3", "08_hybrid"], [*flags, *links, *node]


def hybrid_table(reports, steps, nproc):
    """06 against 08 on the same ranks and nodes: each link's bytes, the memory, the step."""
    fmt = lambda b: f"{b / 2 ** 20:.3f}"  # noqa: E731  MiB
    cols = [("lesson", 10, "<"), ("loss", 7, ">"), ("step ms", 8, ">"), ("comm ms", 8, ">"), ("exposed", 8, ">"),
            ("intra", 7, ">"), ("wire", 7, ">"), ("theory", 7, ">"), ("inter", 7, ">"), ("wire", 7, ">"),
            ("theory", 7, ">"), ("ranks", 8, ">"), ("params", 7, ">"), ("theory", 7, ">"), ("states", 7, ">"),
            ("theory", 7, ">")]  # (title, width, align)
    line = lambda cells: " ".join(f"{c:{a}{w}}" for c, (_, w, a) in zip(cells, cols)).rstrip()  # noqa: E731
    rows = []
    for lesson, r in reports.items():
        links, m, th = r["comm"]["per_link"], r["memory"]["per_rank"][0], r["memory"]["theory"]
        each = {}
        for link, v in links.items():  # the busiest rank's bytes on each link
            e = max(v["per_rank"], key=lambda e: e["issued_ring_bytes_per_step"])
            each[link] = [fmt(e[f"{k}_per_step"] or 0) for k in ("issued_ring_bytes", "wire_bytes", "theory_ring_bytes")]
        crossing = [str(i) for i, e in enumerate(links["inter"]["per_rank"]) if e["issued_ring_bytes_per_step"]]
        ov = r["comm"]["overlap"] or {}
        rows.append(line([lesson, f"{r['losses'][-1]:.4f}", f"{1e3 * statistics.median(r['step_time_s']):.1f}",
                          *(f"{ov[k]:.1f}" if k in ov else "n/a" for k in ("comm_ms", "exposed_ms")),
                          *each["intra"], *each["inter"], ",".join(crossing) or "none",
                          fmt(m["params"]), fmt(th["params"]),
                          fmt(sum(m[k] for k in ("params", "grads", "optimizer"))), fmt(th["total"])]))
    header = line([c for c, _, _ in cols])
    cfg = next(iter(reports.values()))["config"]
    link = lambda spec: spec and spec.replace(":", " Gb/s, ") + " us" or "loopback (no simulated link)"  # noqa: E731
    title = (f"{nproc} ranks as {nproc // cfg['ranks_per_node']} simulated nodes of {cfg['ranks_per_node']}, "
             f"{cfg['precision']}, ring collectives on {link(cfg['link'])} inside a node and {link(cfg['inter_link'])} "
             f"between nodes, Psi = {next(iter(reports.values()))['n_params']:,}, loss after {steps} steps, median "
             f"step; rank 0's communication in ms (measured step: issue to completion, and exposed); MiB per step "
             f"on each link, the busiest rank's (issued, on the wire, theory), and the ranks that send between "
             f"nodes; MiB rank 0 holds at rest: parameters, and all model states, each vs theory")
    return "\n".join([title, header, "-" * len(header), *rows])


def main():
    p = Parser("lecture", description=__doc__)
    p.add_argument("--nproc", type=at_least(1), default=None, help="ranks (CPU, gloo; default 2, --hybrid 4)")
    p.add_argument("--steps", type=at_least(1), default=80, help="K, optimizer steps per lesson")
    p.add_argument("--hybrid", action="store_true",
                   help="06 against 08 on two simulated nodes (--link inside, --inter-link between)")
    p.add_argument("--figures", action="store_true",
                   help="afterwards, regenerate the README's figures (scripts/perf/figures.py, about 1.5 minutes)")
    a, flags = p.parse_known_args()  # the rest goes to every lesson (e.g. --n-layer 2)
    if a.hybrid:
        nproc = a.nproc or 4
        lessons, flags = hybrid_flags(nproc, flags)
        print(hybrid_table(run_sweep(nproc, a.steps, flags, lessons), a.steps, nproc), flush=True)
    else:
        reports = run_sweep(a.nproc or 2, a.steps, flags)
        print(table(reports, a.steps, a.nproc or 2), flush=True)
    if a.figures:
        # the full set, as `make figures` draws them: the README's text describes those (1-8 ranks)
        subprocess.run([sys.executable, "-m", "scripts.perf.figures"], cwd=ROOT, check=True)


if __name__ == "__main__":
    sys.exit(tool_main("lecture", main))
