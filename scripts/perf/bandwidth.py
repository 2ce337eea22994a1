"""Bandwidth of all-reduce, reduce-scatter and all-gather on this machine, by message size.

    torchrun --nproc_per_node=2 -m scripts.perf.bandwidth                 # 1 KiB ... 64 MiB, a table
    torchrun --nproc_per_node=2 -m scripts.perf.bandwidth --quick --report bw.json
    torchrun --nproc_per_node=2 -m scripts.perf.bandwidth --ring          # and the lessons' ring beside gloo

Conventions (those of nccl-tests, so numbers compare with what GPU papers quote):
- size S = bytes of the full tensor: the all-reduce's tensor, the reduce-scatter's input, the
  all-gather's output. Each rank holds S/N of the reduce-scatter's output and all-gather's input.
- algorithm bandwidth algbw = S / time.
- bus bandwidth busbw = algbw x what a ring sends per rank per byte of S: 2(N-1)/N for all-reduce,
  (N-1)/N for reduce-scatter and all-gather. It is the speed of the busiest link, comparable
  across collectives and world sizes, and ideally the link's own bandwidth.
- time = for each repetition the slowest rank's time (ranks start together after a barrier),
  median over repetitions.
"ring" (--ring) is the transport the lessons use under `--collectives ring` (scripts/perf/ring_collectives.py):
lesson 00's Ring, run on the communication thread over the twin gloo group, called by the same
names and signatures as torch's (dist.all_reduce, ...), so its time includes the hop to that
thread and back and the transport's copies, as a lesson sees them.
Also measured: wire bytes, what each rank's process actually wrote while the collective ran
(Linux /proc/self/io, see comm_meter.bytes_written). A ring needs the busbw factor x S; a backend
that sends more than that shows it here, whatever its timing.

    torchrun --nproc_per_node=2 -m scripts.perf.bandwidth --parts          # what the ring's time is made of

--parts times the ring's pieces alone, per size: the hop to its thread, one exchange with the
neighbours, and the local work on S/N bytes (see parts()). A reduce-scatter is about a hop,
N - 1 exchanges and adds and a copy; an all-gather a hop, N - 1 exchanges and a copy.

    torchrun --nproc_per_node=2 -m scripts.perf.bandwidth --contention     # can overlap pay here?

--contention asks whether a collective in flight steals the compute it is meant to hide behind
(gloo moves the bytes on a thread of its own, which needs a core). Per size: a compute about as
long as the all-reduce (matmuls, this rank's one thread) timed alone; the all-reduce alone; and
the two at once, the all-reduce issued async just before the compute and waited on after it.
With a core to spare the pair takes max(compute, comm) and the compute does not slow down; with
none it takes up to their sum and the compute slows by what the communication thread took.
"""
import json
import statistics
import time

import torch
import torch.distributed as dist

from scripts.perf import ring_collectives
from lessonkit import common, lifecycle
from lessonkit.comm_meter import bytes_written
from lessonkit.theory import RING_FACTOR
from scripts.runs import Parser

KIB = 2 ** 10
SIZES = [KIB * 4 ** i for i in range(9)]         # 1 KiB, 4 KiB, ..., 64 MiB
QUICK_SIZES = [KIB, 64 * KIB, 4 * KIB * KIB]     # 1 KiB, 64 KiB, 4 MiB


def repetitions(size, quick):
    """Enough for a median that holds on a shared machine: 20, 10 from 1 MiB (calls of ms to 0.1 s)."""
    reps = 20 if size <= 256 * KIB else 10
    return max(3, reps // 2) if quick else reps


def collective(op, full, shard, api=dist):
    """One call of `op`, on torch.distributed's collectives or on anything with their names (the ring's)."""
    if op == "all_reduce":
        return lambda: api.all_reduce(full)
    if op == "reduce_scatter":
        return lambda: api.reduce_scatter_tensor(shard, full)
    return lambda: api.all_gather_into_tensor(full, shard)


def ring_transport():
    """What `--collectives ring` installs as dist.all_reduce & co. (collectives.Transport), called
    directly: this script's own barriers and MAX all-reduces stay torch's."""
    transport = ring_collectives.use("ring")  # the twin group and its thread: made once, on every rank
    ring_collectives.use("torch")             # dist's names back to torch's; the transport lives on
    return transport


def measure(op, size, reps, impls=("gloo",)):
    """One result per impl. The impls take turns, one call each per repetition, so whatever the
    shared machine does meanwhile falls on all of them alike."""
    n = dist.get_world_size()
    full = torch.ones(size // 4)  # fp32
    shard = torch.ones(size // 4 // n)
    runs = {impl: collective(op, full, shard, dist if impl == "gloo" else ring_transport()) for impl in impls}
    for run in runs.values():
        for _ in range(2):  # warm-up: connections, buffers
            run()
    times, wire = {impl: [] for impl in impls}, dict.fromkeys(impls, 0)
    for _ in range(reps):
        for impl, run in runs.items():
            dist.barrier()
            w0, t0 = bytes_written(), time.perf_counter()
            run()
            t = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
            wire[impl] += bytes_written() - w0 if w0 is not None else 0
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the collective is done when the slowest is
            times[impl].append(t.item())
    results = []
    for impl in impls:
        time_s = statistics.median(times[impl])
        wires = [None] * n
        dist.all_gather_object(wires, wire[impl] / reps if bytes_written() is not None else None)
        algbw = size / time_s
        results.append({"op": op, "impl": impl, "bytes": size, "reps": reps, "time_s": time_s, "algbw": algbw,
                        "busbw": algbw * RING_FACTOR[op](n), "ring_bytes_per_rank": RING_FACTOR[op](n) * size,
                        "wire_bytes_per_rank": wires})
    return results


def ring_table(results, n):
    """Markdown: per size, each collective's time (ms) on gloo and on the ring, and ring / gloo."""
    t = {(r["op"], r["impl"], r["bytes"]): r["time_s"] * 1e3 for r in results if "op" in r}
    ops = ("all_reduce", "reduce_scatter", "all_gather")
    rows = [f"\n{n} ranks, ms per call (slowest rank, median); ring / gloo below 1: the ring is faster\n",
            "| size | " + " | ".join(f"{op} gloo | ring | ring / gloo" for op in ops) + " |",
            "|---:|" + "---:|" * 3 * len(ops)]
    for size in sorted({b for _, _, b in t}):
        name = f"{size / KIB ** 2:.3g} MiB" if size >= KIB ** 2 else f"{size / KIB:.3g} KiB"
        rows.append(f"| {name} | " + " | ".join(f"{t[op, 'gloo', size]:.2f} | {t[op, 'ring', size]:.2f} | "
                                                 f"{t[op, 'ring', size] / t[op, 'gloo', size]:.2f}" for op in ops) + " |")
    return "\n".join(rows)


def parts(size, reps):
    """What a ring collective of `size` bytes is made of, each part timed alone (median, slowest
    rank): the hop to the communication thread and back (an empty job), one exchange with the
    neighbours (Ring._exchange: S/N bytes sent right and received from the left, both awaited;
    a pass is N - 1 of them) and the local work on S/N bytes: the reduce-scatter's add, and a
    copy (into its output; the all-gather's input, unless in place)."""
    transport, n = ring_transport(), dist.get_world_size()
    send, recv = torch.ones(size // 4 // n), torch.ones(size // 4 // n)
    jobs = {"hop": lambda: transport.submit(lambda: None, async_op=False),
            "exchange": lambda: transport.ring._exchange(send, recv),
            "add": lambda: recv.add_(send), "copy": lambda: recv.copy_(send)}
    times = {name: [] for name in jobs}
    for _ in range(reps + 2):  # 2 warm-up rounds, not kept
        for name, job in jobs.items():
            dist.barrier()
            t0 = time.perf_counter()
            job()
            t = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name].append(t.item())
    return {"bytes": size, "parts_s": {name: statistics.median(t[2:]) for name, t in times.items()}}


def contention(size, reps):
    """Medians (s) over `reps`, slowest rank each time: compute alone, all-reduce alone, and
    both at once (total, and the compute's own time within it)."""
    full, a = torch.ones(size // 4), torch.randn(128, 128)

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        inner = fn()
        t = torch.tensor([time.perf_counter() - t0, inner or 0.0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def compute(k):
        for _ in range(k):
            a @ a

    def both(k):
        work = dist.all_reduce(full, async_op=True)
        t0 = time.perf_counter()
        compute(k)
        inner = time.perf_counter() - t0
        work.wait()
        return inner

    comm = statistics.median(timed(lambda: dist.all_reduce(full))[0] for _ in range(reps))
    unit = statistics.median(timed(lambda: compute(10))[0] for _ in range(reps)) / 10
    k = max(1, round(comm / unit))  # a compute as long as the all-reduce
    alone = statistics.median(timed(lambda: compute(k))[0] for _ in range(reps))
    pairs = [timed(lambda: both(k)) for _ in range(reps)]
    total, inner = (statistics.median(x) for x in zip(*pairs))
    return {"bytes": size, "comm_s": comm, "compute_s": alone, "together_s": total, "compute_within_s": inner,
            # 1: the pair took max(comm, compute), fully hidden; 0: their sum, nothing hidden
            "hidden": (comm + alone - total) / min(comm, alone), "compute_slowdown": inner / alone}


def main():
    p = Parser("bandwidth", description=__doc__)
    p.add_argument("--quick", action="store_true", help="three sizes, fewer repetitions (tests)")
    p.add_argument("--sizes", type=int, nargs="+", help="bytes (multiples of 4 x world size)")
    p.add_argument("--report", help="write the results as JSON (rank 0)")
    p.add_argument("--device", choices=["cpu"], default="cpu", help="gloo on CPU (the only one measured here)")
    p.add_argument("--contention", action="store_true", help="compute alone, all-reduce alone, both at once")
    p.add_argument("--parts", action="store_true", help="the ring's parts, each timed alone: thread hop, "
                   "one exchange, add, copy")
    p.add_argument("--ring", action="store_true", help="also time the ring the lessons use under --collectives ring "
                   "(lesson 00's point-to-point ring, on scripts/perf/ring_collectives.py's communication thread)")
    a = p.parse_args()
    env = common.init_distributed(common.parse_args(["--device", a.device]))
    sizes = a.sizes or (QUICK_SIZES if a.quick else SIZES)
    if any(s <= 0 or s % (4 * env.world_size) for s in sizes):  # (0 bytes: no time to divide by)
        lifecycle.fail(f"every size must be a positive multiple of 4 x {env.world_size} bytes, got {' '.join(map(str, sizes))}")
    results = []
    if a.contention:
        torch.set_num_threads(1)  # one thread per rank, as the lessons run
        for size in [s for s in sizes if s >= 64 * KIB]:
            r = contention(size, repetitions(size, a.quick))
            results.append(r)
            if env.master:
                print(f"all_reduce {size / KIB:>9.0f} KiB | alone {r['comm_s'] * 1e3:7.2f} ms | compute alone "
                      f"{r['compute_s'] * 1e3:7.2f} ms | both {r['together_s'] * 1e3:7.2f} ms | hidden "
                      f"{r['hidden']:5.0%} | compute slowed {r['compute_slowdown']:.2f}x", flush=True)
        sizes = []
    if a.parts:
        for size in sizes:
            r = parts(size, repetitions(size, a.quick))
            results.append(r)
            if env.master:
                print(f"ring parts {size / KIB:>9.0f} KiB | " + " | ".join(
                    f"{name} {t * 1e3:.3f} ms" for name, t in r["parts_s"].items()), flush=True)
        sizes = []
    for size in sizes:
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            for r in measure(op, size, repetitions(size, a.quick), ("gloo", "ring") if a.ring else ("gloo",)):
                results.append(r)
                if env.master:
                    wire = r["wire_bytes_per_rank"][0]
                    print(f"{op:>15} {r['impl']:>4} {size / KIB:>9.0f} KiB | {r['time_s'] * 1e3:8.3f} ms | "
                          f"algbw {r['algbw'] / 1e9:6.3f} GB/s | busbw {r['busbw'] / 1e9:6.3f} GB/s | "
                          f"wire {'n/a' if wire is None else f'{wire / size:.3f} S'} "
                          f"(ring {r['ring_bytes_per_rank'] / size:.3f} S)", flush=True)
    if env.master and a.ring:
        print(ring_table(results, env.world_size))
    if env.master and a.report:
        with open(a.report, "w") as f:
            json.dump({"world_size": env.world_size, "backend": env.backend, "torch": torch.__version__,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    lifecycle.run_main(main)
