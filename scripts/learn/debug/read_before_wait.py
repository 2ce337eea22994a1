"""Bug (c): a gradient read before its async all-reduce has finished.

    torchrun --nproc_per_node=2 -m scripts.learn.debug.read_before_wait           # the bug
    torchrun --nproc_per_node=2 -m scripts.learn.debug.read_before_wait --fixed   # the fix

`work = dist.all_reduce(t, async_op=True)` returns at once; the collective runs in the
background and writes its result into t in place, piece by piece. Until `work.wait()` returns, t
holds this rank's own gradient, or a mix of it and the reduced one. Code that reads it earlier
(a gradient-norm clip, a logging line, the optimizer step) reads a value that differs between
ranks and from the true global gradient, and only sometimes: it depends on timing.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

FIXED = "--fixed" in sys.argv
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)
layer = nn.Linear(1024, 2048)  # 2M gradient elements: 8 MB, a few ms to all-reduce on CPU
x = torch.randn(16, 1024) * (rank + 1)  # each rank's rows differ, so local != global gradient
stale = []
for trial in range(5):
    layer.weight.grad = None
    layer(x).pow(2).mean().backward()
    grad = layer.weight.grad
    grad.div_(world)
    work = dist.all_reduce(grad, async_op=True)
    if FIXED:
        work.wait()  # the fix: nothing reads the gradient before its collective is done
    norm_read = grad.norm().item()  # what a clip or a log line would use
    work.wait()  # (the broken code waits too, later: e.g. just before optimizer.step())
    norm_true = grad.norm().item()
    stale.append(abs(norm_read - norm_true) > 1e-6 * norm_true)
    if rank == 0 and trial == 0:
        print(f"rank 0, trial 0: gradient norm read {norm_read:.6f}, after wait() {norm_true:.6f}")

# count, over all ranks, the reads that saw something other than the reduced gradient
n = torch.tensor([float(sum(stale))])
dist.all_reduce(n)
if rank == 0:
    if n.item() > 0:
        print(f"SYMPTOM: {int(n.item())} of {5 * world} reads (5 per rank) saw a gradient that was "
              f"not yet all-reduced (a norm that differs from the one after wait())")
        print("CAUSE:   all_reduce(async_op=True) returns before the collective runs; the tensor "
              "holds the local or a half-reduced value until work.wait() returns")
        print("FIX:     call work.wait() on every handle before anything reads the gradient  "
              "(run with --fixed)")
    else:
        print(f"FIXED: all {5 * world} reads saw the all-reduced gradient")
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
