"""Bug (b): a parameter gets no gradient on one rank, its bucket never fills, and the ranks hang.

    torchrun --nproc_per_node=2 -m scripts.learn.debug.unused_param_hang           # the bug: 5 s timeout
    torchrun --nproc_per_node=2 -m scripts.learn.debug.unused_param_hang --fixed   # the fix

A bucket's all-reduce starts when its last gradient arrives. Here an "expert" layer only runs on
rows that are routed to it, and rank 1's rows never are (an MoE expert with no tokens, a branch
taken by some batches only). On rank 0 the bucket fills and its all-reduce starts; on rank 1 it
never fills, so rank 1 launches nothing and goes on to the barrier that ends the step. Rank 0
waits in the all-reduce, rank 1 in the barrier: forever, without a timeout. This demo sets a
5 s timeout in init_process_group so it ends with gloo's error instead. The fix is bucket.py's
finish(): at the end of backward, launch every bucket not yet launched, with zeros for the
gradients that never came, so every rank issues the same collectives in the same order.
"""
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

FIXED = "--fixed" in sys.argv
dist.init_process_group("gloo", timeout=timedelta(seconds=5))
rank, world = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)
trunk, expert = nn.Linear(8, 8), nn.Linear(8, 8)
params = [*trunk.parameters(), *expert.parameters()]
flat = torch.zeros(sum(p.numel() for p in params))  # one bucket holding every gradient
offsets = torch.tensor([0] + [p.numel() for p in params]).cumsum(0).tolist()
pending, works = set(params), []


def on_grad_ready(p):  # post-accumulate hook: copy into the bucket; launch it once full
    i = next(i for i, q in enumerate(params) if q is p)
    flat[offsets[i]:offsets[i + 1]].copy_(p.grad.flatten())
    pending.discard(p)
    if not pending:
        works.append(dist.all_reduce(flat, async_op=True))


def finish():  # end of backward: wait for the bucket, write the averaged gradients back
    if FIXED and pending:  # the fix: launch the bucket anyway (zeros for the missing gradients)
        pending.clear()
        works.append(dist.all_reduce(flat, async_op=True))
    for w in works:
        w.wait()
    for i, p in enumerate(params):
        p.grad = flat[offsets[i]:offsets[i + 1]].view_as(p) / world


for p in params:
    p.register_post_accumulate_grad_hook(on_grad_ready)
x = torch.randn(4, 8) + (3.0 if rank == 0 else -3.0)
routed = x.mean(dim=1) > 0  # rows the router sends to the expert: all of rank 0's, none of rank 1's
h = trunk(x)
if routed.any():  # the expert runs on the routed rows only
    h = h.index_add(0, routed.nonzero().squeeze(1), expert(h[routed]))
h.pow(2).mean().backward()  # on rank 1 the expert is not in the graph: its hooks never fire
try:
    finish()
    dist.barrier()  # the end of the step: a checkpoint, a log line, the next step's first collective
    g0 = expert.weight.grad.clone()
    dist.broadcast(g0, src=0)
    same = torch.tensor([float(torch.equal(g0, expert.weight.grad))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"FIXED: every rank launched its bucket; the expert's averaged gradient (norm "
              f"{g0.norm():.4f}) is {'identical' if same.item() else 'DIFFERENT'} on every rank")
except RuntimeError as e:
    print(f"SYMPTOM: rank {rank} hung until the 5 s timeout: {str(e).splitlines()[0][-70:]}", flush=True)
    if rank == 0:
        print("CAUSE:   the expert got no gradient on rank 1, so rank 1's bucket never filled and "
              "was never launched, while rank 0 waits in that bucket's all-reduce")
        print("FIX:     at the end of backward launch every unlaunched bucket with zeros for missing "
              "gradients, as bucket.py's finish() does  (run with --fixed)")
sys.stdout.flush()
os._exit(0)  # skip teardown: after a timeout the group is broken
