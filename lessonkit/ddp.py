"""DistributedDataParallel's shape, which 02 and 03 share so that a loop written for DDP runs
them unchanged (Replicated; 01 takes only its base, Replicas), no_sync() (GradientSync, 05-08's
too), 02's wait at the end of backward for 03's buckets and 05's reduce-scatters (at_end_of_backward), and
the fp32 sum of bf16 (fp16) micro-step gradients that 01-04 accumulate into (FP32Accumulation). The
collectives here are bookkeeping: the broadcast of rank 0's weights when a strategy is built,
and find_unused_parameters' flags.
"""
import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from lessonkit.optimizers import UsedParameters


class Replicas(nn.Module):
    """What every replicated strategy (01-03) needs: `.module`, rank 0's weights broadcast when
    built, calling it runs the module, find_unused_parameters' flags, and the fp32 sum of bf16
    micro-step gradients (grad_accumulation; reset() once the gradients are synchronized).

    find_unused_parameters  as DDP's. A parameter some rank's forward skipped (an MoE expert that
        got no tokens there) has no gradient on that rank: it still takes part in the collective,
        with zeros, its share of the mean, so every rank gets the averaged gradient. False: a
        parameter no rank used then gets a zero gradient (which AdamW's weight decay still moves).
        True: one more small all-reduce per step (DDP's too) finds those, and they keep grad None,
        so the optimizer leaves them alone, as in one process (unused_everywhere)."""

    def __init__(self, module, find_unused_parameters=False):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.used = UsedParameters(trainable, trainable[0].device) if find_unused_parameters and trainable else None
        # Built before the lesson registers its hooks, so that a syncing backward's hook finds
        # p.grad already holding the fp32 sum of the micro-steps, rounded once.
        self.grad_accumulation = FP32Accumulation(trainable)
        # Ranks may start from different random weights: make rank 0's the truth, as DDP does
        # when it is built.
        with torch.no_grad():
            for tensor in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(tensor, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def unused_everywhere(self, with_grad_here):
        """find_unused_parameters=True: the trainable parameters that have a gradient on no rank,
        given those that have one on this rank (one all-reduce of a flag per parameter; every rank
        must call it at the same point of its collectives). False: none, and no collective."""
        if self.used is None:
            return set()
        for p in with_grad_here:
            self.used.mark(p)
        return self.used.unused()


class GradientSync:
    """Gradient accumulation without a collective per micro-step: a backward with
    `require_backward_grad_sync` False only accumulates, and the next one with it True reduces
    the sum once. Set by DDP's `no_sync()` (a context) or FSDP2's `set_requires_gradient_sync`
    (02, 03; 05-08 with --reduce-every step). For the sharded lessons the trade is memory: the
    whole gradient is held between micro-steps where 2 Psi / N would do (05: in p.grad, with its
    fp32 sum; 06-08: each unit's fp32 sum), for K - 1 fewer reduce-scatters a step."""
    require_backward_grad_sync = True

    def set_requires_gradient_sync(self, requires_gradient_sync, recurse=True):
        self.require_backward_grad_sync = requires_gradient_sync

    @contextlib.contextmanager
    def no_sync(self):
        """As DDP's: backward passes inside only accumulate; the next one outside synchronizes."""
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = True


class Replicated(Replicas, GradientSync):
    """DistributedDataParallel's interface (02, 03): Replicas, and synchronization inside
    loss.backward() itself: `require_backward_grad_sync` and `no_sync()` (GradientSync),
    and at_end_of_backward(fn) (below), skipped in a no_sync() backward."""

    def at_end_of_backward(self, fn):
        if self.require_backward_grad_sync:
            at_end_of_backward(self, fn)
            # the gradients this backward synchronizes are the optimizer step's: the next
            # backward starts a new sum
            at_end_of_backward(self.grad_accumulation, self.grad_accumulation.reset)


def at_end_of_backward(owner, fn):
    """Call from a gradient hook: fn() runs once this backward is over, inside loss.backward(),
    once per backward for each owner: 02's queued callback (02_async_allreduce.py says why)."""
    backward = torch._C._current_graph_task_id()  # -1 outside a backward
    if getattr(owner, "_end_of_backward_queued", None) == backward:
        return
    owner._end_of_backward_queued = backward
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class FP32Accumulation:
    """Gradient accumulation (--grad-accum K > 1) of bf16 (or fp16) gradients, in fp32: every lesson's
    convention (01-04 here, and 05 under no_sync(); 05-08 otherwise add up their fp32 gradient shards). Autograd adds each
    micro-step's gradient into the bf16 p.grad, and a bf16 sum keeps 8 significant bits: every
    addition rounds away up to 2^-9 of the total, and a small micro-step's gradient can vanish
    whole. So from a parameter's second gradient on, each one is added into an fp32 accumulator
    instead, and p.grad is set to that sum rounded once: p.grad always holds bf16(fp32 sum so
    far), which the collective then moves. (Megatron-LM's main_grad does the same:
    accumulate_allreduce_grads_in_fp32.) The accumulators are memory: 4 bytes per parameter,
    kept once a step needed them (as main_grad is), besides the 2 of p.grad. fp32 parameters and
    one backward per step (K = 1) never get one, and are untouched. reset() once an optimizer
    step has consumed the gradients (Replicated: after a syncing backward; 04: zero_grad())."""

    def __init__(self, params):
        self.grad_accumulators = {}  # p -> fp32 tensor shaped like p
        self.arrived, self.summing = set(), set()  # since reset(): p got a gradient; p's is in fp32
        for p in params:
            if p.requires_grad and p.dtype != torch.float32:
                # register_hook fires before autograd adds the incoming gradient into p.grad, and
                # is passed it alone: the one place to see a micro-step's gradient unrounded
                p.register_hook(functools.partial(self._arriving, p))
                p.register_post_accumulate_grad_hook(self._accumulated)

    @torch.no_grad()
    def _arriving(self, p, grad):
        if p not in self.arrived or p.grad is None:  # the first: autograd stores it exactly
            self.arrived.add(p)
            self.summing.discard(p)
            return
        acc = self.grad_accumulators.get(p)
        if acc is None:
            acc = self.grad_accumulators[p] = torch.zeros_like(p, dtype=torch.float32)
        if p not in self.summing:  # p.grad holds the first gradient, exactly
            acc.copy_(p.grad)
            self.summing.add(p)
        acc.add_(grad)

    @torch.no_grad()
    def _accumulated(self, p):  # autograd has added in bf16: replace that with one rounding
        if p in self.summing:
            p.grad.copy_(self.grad_accumulators[p])

    def reset(self):
        self.arrived.clear()
        self.summing.clear()
