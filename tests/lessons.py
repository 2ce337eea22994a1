"""The one place the tests learn how to drive each lesson's strategy class.

Every entry builds a trainer around a plain nn.Module whose forward(x, y) returns the loss:
    trainer.train_step(micro_batches) -> this rank's loss for the step (mean of micro-steps)
    trainer.full_parameters()         -> {name: full fp32 tensor}, identical on every rank
Tests use nothing else, so a lesson (or a student's version of it) plugs in here only.
"""
import torch
import torch.distributed as dist
import torch.nn as nn

import common
from harness import load_lesson


def _named_full(module):
    return {n: p.detach().float().clone() for n, p in module.named_parameters()}


class _Replicated:
    """01-03 and PyTorch's DDP: every rank holds the whole model and the whole optimizer."""

    def __init__(self, wrapper, module, grad_clip, lr, sync):
        self.wrapper, self.module, self.sync = wrapper, module, sync
        self.opt = common.MixedPrecisionAdamW(module.parameters(), grad_clip, **adamw(lr))

    def train_step(self, micro_batches):
        total = 0.0
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with self._sync_context(last):
                loss = self.wrapper(x, y) / len(micro_batches)
                loss.backward()
            total += loss.item()
        if self.sync is not None:
            self.sync(self.wrapper)
        self.opt.step()
        self.opt.zero_grad()
        return total

    def _sync_context(self, last):
        import contextlib
        if isinstance(self.wrapper, nn.parallel.DistributedDataParallel) and not last:
            return self.wrapper.no_sync()
        if hasattr(self.wrapper, "require_backward_grad_sync"):
            self.wrapper.require_backward_grad_sync = last
        return contextlib.nullcontext()

    def full_parameters(self):
        return _named_full(self.module)


def adamw(lr):
    return dict(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def build(lesson, module, grad_clip=0.0, lr=1e-2, bucket_mb=25.0, **kw):
    """A trainer for `lesson` ("01".."06", or "ddp") around `module`, inside a process group."""
    if lesson == "ddp":
        ddp = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_mb,
                                                  find_unused_parameters=kw.get("find_unused", False))
        return _Replicated(ddp, module, grad_clip, lr, sync=None)
    if lesson == "01":
        dp = load_lesson("01_vanilla_dp").VanillaDP(module)
        return _Replicated(dp, module, grad_clip, lr, sync=lambda w: w.all_reduce_gradients())
    raise KeyError(f"no adapter for lesson {lesson!r}")
