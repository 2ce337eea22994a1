"""DistributedDataParallel's shape, which 01-03 share so that a loop written for DDP runs them
unchanged (Replicated), and the end-of-backward callback DDP's reducer finishes its all-reduces
with (at_end_of_backward; 05's reduce-scatters too). The collectives here are bookkeeping: the
broadcast of rank 0's weights when a strategy is built, and find_unused_parameters' flags.
"""
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from optimizers import UsedParameters


class Replicated(nn.Module):
    """DistributedDataParallel's interface: `.module`, rank 0's weights broadcast when built,
    calling it runs the module, `require_backward_grad_sync` and `no_sync()` (gradient
    accumulation), and at_end_of_backward(fn) (below), skipped in a no_sync() backward.

    find_unused_parameters  as DDP's. A parameter some rank's forward skipped (an MoE expert that
        got no tokens there) has no gradient on that rank: it still takes part in the collective,
        with zeros, its share of the mean, so every rank gets the averaged gradient. False: a
        parameter no rank used then gets a zero gradient (which AdamW's weight decay still moves).
        True: one more small all-reduce per step (DDP's too) finds those, and they keep grad None,
        so the optimizer leaves them alone, as in one process (unused_everywhere)."""

    def __init__(self, module, find_unused_parameters=False):
        super().__init__()
        self.module = module
        self.require_backward_grad_sync = True
        self.world_size = dist.get_world_size()
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.used = UsedParameters(trainable, trainable[0].device) if find_unused_parameters and trainable else None
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

    def unused_everywhere(self, with_grad_here):
        """find_unused_parameters=True: the trainable parameters that have a gradient on no rank,
        given those that have one on this rank (one all-reduce of a flag per parameter; every rank
        must call it at the same point of its collectives). False: none, and no collective."""
        if self.used is None:
            return set()
        for p in with_grad_here:
            self.used.mark(p)
        return self.used.unused()


def at_end_of_backward(owner, fn):
    """Call from a gradient hook: fn() runs once this backward is over, inside loss.backward(),
    once per backward for each owner. (The autograd engine's callback queue, as DDP's reducer
    and FSDP use, so the training loop needs no call of its own after backward.) "Once per
    backward" is keyed by the backward's own id, not a flag cleared when fn runs: a backward that
    raised never runs its callbacks, and a flag left set would skip every later synchronization."""
    backward = torch._C._current_graph_task_id()  # -1 outside a backward
    if getattr(owner, "_end_of_backward_queued", None) == backward:
        return
    owner._end_of_backward_queued = backward

    def run():
        fn()
    torch.autograd.Variable._execution_engine.queue_callback(run)
