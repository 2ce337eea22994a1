"""The main demonstration: every lesson at 2 ranks on CPU, then one table.

    make demo                       # or: .venv/bin/python -m scripts.learn.demo --nproc 2
    .venv/bin/python -m scripts.learn.demo --precision bf16 --steps 20
    .venv/bin/python -m scripts.learn.demo --precision fp16    # every lesson in fp16, the loss scaled
"""
import statistics
import sys

from scripts.runs import Parser, at_least, available_lessons, device_and_host, grid_args, launch, mib, tool_main


def main():
    p = Parser("demo", description=__doc__)
    p.add_argument("--nproc", type=at_least(1), default=2)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--steps", type=at_least(1), default=40)
    a = p.parse_args()
    rows = collect(a.nproc, a.precision, a.steps, echo=True)
    print(f"\n{caption(a.nproc, a.precision, a.steps)}")
    print("\n".join(table(rows)))


def collect(nproc, precision, steps, echo=False):
    """Every lesson at `nproc` CPU ranks: one row each, of what its report says."""
    rows = []
    for lesson in available_lessons():
        grid = grid_args(lesson, nproc)  # 08: two "nodes" of nproc / 2 ranks
        if echo:
            print(f"\n=== {lesson}: torchrun --nproc_per_node={nproc} {lesson}.py "
                  f"--precision {precision} --steps {steps} {' '.join(grid)}".rstrip(), flush=True)
        r = launch(lesson, nproc, ["--precision", precision, "--steps", steps, *grid], echo=echo)
        m, th = r["memory"]["per_rank"][0], r["memory"]["theory"]
        device, host = device_and_host(m)
        theory, theory_host, peak = th["total"], None, m["peak_params"]
        if host is not None:  # 07: its device tier, beside the formula for that tier
            tiers = r["memory"]["theory_tiers"]
            theory, theory_host = sum(tiers["device"].values()), sum(tiers["host"].values())
            peak -= m["host"]["params"]  # its host shards live through the whole step; the rest is the device's
        rows.append((f"{lesson} G={grid[1]}" if grid else lesson, r["losses"][-1],
                     1e3 * statistics.median(r["step_time_s"]),
                     r["comm"]["issued_ring_bytes_per_step"], r["comm"]["theory_ring_bytes_per_step"],
                     device, theory, peak, host, theory_host))
    return rows


def caption(nproc, precision, steps):
    return (f"{nproc} ranks, {precision}, {steps} steps; MiB per rank; issued: per step, asked for x ring factor; "
            "device: params + grads + optimizer at rest (measured); peak params: the most parameter bytes "
            "during the step; host: 07's host tier; 08 as two nodes of G ranks")


def table(rows):
    header = f"{'lesson':<20} {'final loss':>10} {'step ms':>8} {'issued':>7} {'theory':>7} " \
             f"{'device':>7} {'theory':>7} {'peak params':>11} {'host':>7} {'theory':>7}"
    lines = [header, "-" * len(header)]
    for lesson, loss, ms, *nbytes, host, theory_host in rows:
        cells = " ".join(f"{mib(b):>{w}.2f}" for b, w in zip(nbytes, (7, 7, 7, 7, 11)))
        tier = "" if host is None else f" {mib(host):>7.2f} {mib(theory_host):>7.2f}"
        lines.append(f"{lesson:<20} {loss:>10.4f} {ms:>8.1f} {cells}{tier}")
    return lines


if __name__ == "__main__":
    sys.exit(tool_main("demo", main))
