"""Bandwidth of all-reduce, reduce-scatter and all-gather on this machine, by message size.

    torchrun --nproc_per_node=2 scripts/bandwidth.py                 # 1 KiB ... 64 MiB, a table
    torchrun --nproc_per_node=2 scripts/bandwidth.py --quick --report bw.json

Conventions (those of nccl-tests, so numbers compare with what GPU papers quote):
- size S = bytes of the full tensor: the all-reduce's tensor, the reduce-scatter's input, the
  all-gather's output. Each rank holds S/N of the reduce-scatter's output and all-gather's input.
- algorithm bandwidth algbw = S / time.
- bus bandwidth busbw = algbw x what a ring sends per rank per byte of S: 2(N-1)/N for all-reduce,
  (N-1)/N for reduce-scatter and all-gather. It is the speed of the busiest link, comparable
  across collectives and world sizes, and ideally the link's own bandwidth.
- time = for each repetition the slowest rank's time (ranks start together after a barrier),
  median over repetitions.
Also measured: wire bytes, what each rank's process actually wrote while the collective ran
(Linux /proc/self/io, see measure.bytes_written). A ring needs the busbw factor x S; a backend
that sends more than that shows it here, whatever its timing.
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import common  # noqa: E402
from measure import RING_FACTOR, bytes_written  # noqa: E402

KIB = 2 ** 10
SIZES = [KIB * 4 ** i for i in range(9)]         # 1 KiB, 4 KiB, ..., 64 MiB
QUICK_SIZES = [KIB, 64 * KIB, 4 * KIB * KIB]     # 1 KiB, 64 KiB, 4 MiB


def repetitions(size, quick):
    """Enough to take a median, few where one call takes a tenth of a second or more."""
    reps = 20 if size <= 256 * KIB else 8 if size <= 4 * KIB * KIB else 3
    return max(3, reps // 2) if quick else reps


def collective(op, full, shard):
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, full)
    return lambda: dist.all_gather_into_tensor(full, shard)


def measure(op, size, reps):
    n = dist.get_world_size()
    full = torch.ones(size // 4)  # fp32
    shard = torch.ones(size // 4 // n)
    run = collective(op, full, shard)
    for _ in range(2):  # warm-up: connections, buffers
        run()
    times, wire = [], 0
    for _ in range(reps):
        dist.barrier()
        w0, t0 = bytes_written(), time.perf_counter()
        run()
        t = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
        wire += bytes_written() - w0 if w0 is not None else 0
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the collective is done when the slowest is
        times.append(t.item())
    time_s = statistics.median(times)
    wires = [None] * n
    dist.all_gather_object(wires, wire / reps if bytes_written() is not None else None)
    algbw = size / time_s
    return {"op": op, "bytes": size, "reps": reps, "time_s": time_s, "algbw": algbw,
            "busbw": algbw * RING_FACTOR[op](n), "ring_bytes_per_rank": RING_FACTOR[op](n) * size,
            "wire_bytes_per_rank": wires}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="three sizes, fewer repetitions (tests)")
    p.add_argument("--sizes", type=int, nargs="+", help="bytes (multiples of 4 x world size)")
    p.add_argument("--report", help="write the results as JSON (rank 0)")
    p.add_argument("--device", choices=["cpu"], default="cpu", help="gloo on CPU (the only one measured here)")
    a = p.parse_args()
    env = common.init_distributed(common.parse_args(["--device", a.device]))
    sizes = a.sizes or (QUICK_SIZES if a.quick else SIZES)
    if any(s % (4 * env.world_size) for s in sizes):
        common.fail(f"every size must be a multiple of 4 x {env.world_size} bytes")
    results = []
    for size in sizes:
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            r = measure(op, size, repetitions(size, a.quick))
            results.append(r)
            if env.master:
                wire = r["wire_bytes_per_rank"][0]
                print(f"{op:>15} {size / KIB:>9.0f} KiB | {r['time_s'] * 1e3:8.3f} ms | "
                      f"algbw {r['algbw'] / 1e9:6.3f} GB/s | busbw {r['busbw'] / 1e9:6.3f} GB/s | "
                      f"wire {'n/a' if wire is None else f'{wire / size:.3f} S'} "
                      f"(ring {r['ring_bytes_per_rank'] / size:.3f} S)", flush=True)
    if env.master and a.report:
        with open(a.report, "w") as f:
            json.dump({"world_size": env.world_size, "backend": env.backend, "torch": torch.__version__,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    common.run_main(main)
