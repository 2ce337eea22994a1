"""DistributedDataParallel's shape, which 01-03 share so that a loop written for DDP runs them
unchanged (Replicated), and the end-of-backward callback DDP's reducer finishes its all-reduces
with (at_end_of_backward; 05's reduce-scatters too). The one collective here is bookkeeping: the
broadcast of rank 0's weights when a strategy is built.
"""
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn


class Replicated(nn.Module):
    """DistributedDataParallel's interface: `.module`, rank 0's weights broadcast when built,
    calling it runs the module, `require_backward_grad_sync` and `no_sync()` (gradient
    accumulation), and at_end_of_backward(fn) (below), skipped in a no_sync() backward."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.require_backward_grad_sync = True
        self.world_size = dist.get_world_size()
        # Ranks may start from different random weights: make rank 0's the truth, as DDP does
        # when it is built.
        with torch.no_grad():
            for tensor in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(tensor, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """As DDP's: backward passes inside only accumulate; the next one outside synchronizes."""
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = True

    def at_end_of_backward(self, fn):
        if self.require_backward_grad_sync:
            at_end_of_backward(self, fn)


def at_end_of_backward(owner, fn):
    """Call from a gradient hook: fn() runs once this backward is over, inside loss.backward(),
    once per backward for each owner. (The autograd engine's callback queue, as DDP's reducer
    and FSDP use, so the training loop needs no call of its own after backward.)"""
    if getattr(owner, "_end_of_backward_queued", False):
        return
    owner._end_of_backward_queued = True

    def run():
        owner._end_of_backward_queued = False
        fn()
    torch.autograd.Variable._execution_engine.queue_callback(run)
