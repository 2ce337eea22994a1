"""Bug (a): the gradient hook listens to the wrong event, so gradients are never averaged.

    torchrun --nproc_per_node=2 -m scripts.learn.debug.wrong_hook           # the bug
    torchrun --nproc_per_node=2 -m scripts.learn.debug.wrong_hook --fixed   # the fix

`p.register_hook(hook)` (a Tensor hook) fires when p's gradient has been COMPUTED, before it is
accumulated into p.grad. A hook there that averages p.grad finds p.grad still None (zero_grad()
sets it to None) or holding the previous micro-step's sum, so it averages nothing; autograd then
writes the local gradient into p.grad. Every rank steps with its own local gradient: nothing
crashes, the loss still falls, but the replicas drift apart and no longer match single-process
training on the global batch. The event that means "p.grad is final" is
`register_post_accumulate_grad_hook`, whose hook receives the parameter.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

FIXED = "--fixed" in sys.argv
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def make_model():
    torch.manual_seed(0)  # every rank, and the reference, start from the same weights
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def average_grad(param):  # the hook's work: param.grad becomes the mean over ranks
    if param.grad is not None:  # None: no gradient yet, nothing to average (the bug hides here)
        param.grad.div_(world)
        dist.all_reduce(param.grad)


model, reference = make_model(), make_model()  # reference: one process, the whole global batch
for p in model.parameters():
    if FIXED:  # after accumulation: p.grad is this backward's complete gradient
        p.register_post_accumulate_grad_hook(average_grad)
    else:      # BUG: before accumulation, p.grad is still None; the gradient lands after the hook
        p.register_hook(lambda grad, p=p: average_grad(p))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

g = torch.Generator().manual_seed(1)
for step in range(5):
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)  # the global batch
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)                # my share of it
    nn.functional.mse_loss(model(x[rows]), y[rows]).backward()              # hooks fire here
    opt.step()
    opt.zero_grad()
    nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()
    ref_opt.zero_grad()

# how far apart are the replicas, and how far from single-process training?
mine = torch.cat([p.detach().flatten() for p in model.parameters()])
rank0 = mine.clone()
dist.broadcast(rank0, src=0)
spread = torch.tensor([(mine - rank0).abs().max().item()])
dist.all_reduce(spread, op=dist.ReduceOp.MAX)
ref = torch.cat([p.detach().flatten() for p in reference.parameters()])
off = (mine - ref).abs().max().item()
if rank == 0:
    if spread.item() > 1e-6 or off > 1e-5:
        print(f"SYMPTOM: after 5 steps the replicas differ by {spread.item():.2e} (max |rank0 - rank r|) "
              f"and rank 0 differs from single-process training by {off:.2e}")
        print("CAUSE:   p.register_hook fires before the gradient is accumulated into p.grad: "
              "the hook found p.grad None and averaged nothing, then the local gradient landed")
        print("FIX:     p.register_post_accumulate_grad_hook(hook): hook(param) runs once param.grad is "
              "final  (run with --fixed)")
    else:
        print(f"FIXED: replicas identical (max diff {spread.item():.1e}), "
              f"single-process training matched to {off:.1e}")
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
