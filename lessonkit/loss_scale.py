"""Dynamic loss scaling for `--precision fp16`, written once for every lesson: LossScaler, with
torch.amp.GradScaler's defaults, semantics and calls.

Why scale: fp16's smallest normal number is 2^-14, and a loss averaged over many tokens has
smaller gradients, which backward rounds to 0. The loss times S (a power of two) lifts every
gradient by S; the optimizer divides by S again in fp32, exactly. Too large an S overflows (an
inf or NaN): the step is skipped everywhere, nothing changed, and S halves; after
`growth_interval` clean steps S doubles. (bf16 has fp32's exponent range and needs none of it.)

    scaler.scale(loss).backward()   # loss x S: every gradient x S
    scaler.step(optimizer)          # unscale in fp32; an inf or NaN on any rank: skip, everywhere
    scaler.update()                 # S / 2 after a skipped step, S x 2 after growth_interval clean ones

fp16 gradients are not unscaled in fp16 (they would underflow again): an optimizer with fp32
gradients of its own (MixedPrecisionAdamW's masters; 04's and 05's shards) sets `unscale_in_step
= True`, and its step(unscale=fn) calls fn on them before clipping, changing nothing when fn
returns False. 06-08's shards are fp32 already: their loop is FSDP2's with ShardedGradScaler
(`scaler.unscale_(optimizer)`, clipping, `scaler.step`, `scaler.update`).

The found-inf flag is all-reduced over the world (one element, SUM), as ShardedGradScaler's: an
inf in rank 1's gradient shard is invisible to rank 0, and a rank that steps while another skips
leaves the shards (or replicas) apart for good. Checkpoints keep the scale, growth tracker and
skipped steps (meta.json's "loss_scale"). Disabled (every precision but fp16) it is the identity.
"""
import argparse
import math

import torch
import torch.distributed as dist

# torch.amp.GradScaler's defaults, named once
INIT_SCALE, GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL = 2.0 ** 16, 2.0, 0.5, 2000


def power_of_two(text):
    """--loss-scale's type (common.py): S = 2^k, so that x S and x 1/S are exact; -126 <= k <= 127,
    so that S and 1/S are finite fp32 numbers (the scale is an fp32 tensor; unscaling multiplies by 1/S)."""
    try:
        value = float(text)
    except ValueError:  # (one message for every bad value)
        value = math.nan
    k = math.frexp(value)[1] - 1 if math.isfinite(value) and value > 0 else None  # value = 2^k, if a power of two
    if k is None or value != 2.0 ** k or not -126 <= k <= 127:
        raise argparse.ArgumentTypeError(f"a power of two from 2^-126 to 2^127, such as 65536 or 1048576, got {text}")
    return value


class LossScaler:
    """GradScaler's calls (scale, step, update) and state (scale, growth tracker), plus what the
    report prints: the steps it skipped. `device`: where the found-inf flag lives (the process
    group's: CUDA for NCCL). Without a process group (a single-process reference) the flag is
    this process's alone."""

    def __init__(self, device, enabled=True, init_scale=None, growth_factor=GROWTH_FACTOR,
                 backoff_factor=BACKOFF_FACTOR, growth_interval=GROWTH_INTERVAL):
        self.device, self.enabled = torch.device(device), enabled
        # S, a power of two (x S and x 1/S are exact); None: GradScaler's, INIT_SCALE (a lesson's --loss-scale)
        self.init_scale = self.loss_scale = float(INIT_SCALE if init_scale is None else init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.growth_tracker = 0  # clean steps in a row since S last changed
        self.steps, self.skipped_steps = 0, []  # optimizer steps seen (update() calls); those skipped
        self.found_inf = False  # this step's verdict, every rank's
        self.unscaled = False  # unscale_() called since the last update(): step() keeps its verdict

    def scale(self, loss):
        return loss * self.loss_scale if self.enabled else loss

    def get_scale(self):
        return self.loss_scale if self.enabled else 1.0

    def step(self, optimizer):
        """optimizer.step(), unless some rank found an inf or NaN among its gradients. The kit's
        optimizers (`unscale_in_step`: 01-03's MixedPrecisionAdamW, 04's and 05's) cast to fp32
        first and call unscale() with their fp32 gradients (step(unscale=)), skipping the step
        when it returns False; any torch.optim optimizer over fp32 parameters is handled as
        GradScaler does: its parameters' own .grad are unscaled in place (unscale_, unless the
        loop called it already)."""
        if not self.enabled:
            return optimizer.step()
        if getattr(optimizer, "unscale_in_step", False):  # the protocol (the module docstring)
            return optimizer.step(unscale=self.unscale)
        self.unscale_(optimizer)
        if not self.found_inf:
            return optimizer.step()

    def unscale_(self, optimizer):
        """GradScaler.unscale_: divide the fp32 .grad of `optimizer`'s parameters by S in place and
        take every rank's verdict, once per step; the loop clips after it, on the true gradients."""
        if self.enabled and not self.unscaled:
            if getattr(optimizer, "unscale_in_step", False):
                raise RuntimeError("this optimizer unscales inside step(), before its own clipping: call step() only")
            self.unscale([p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None])

    @torch.no_grad()
    def unscale(self, grads):
        """Divide fp32 gradients by S in place; True if they are finite on every rank (step),
        False if an inf or NaN is on any (skip, recorded in skipped_steps)."""
        found_inf = torch.zeros(1, device=self.device)
        for g in grads:
            found_inf += (~torch.isfinite(g)).any()  # over the gradients this rank holds
            g.mul_(1.0 / self.loss_scale)  # exact: 1/S is a power of two (an inf stays one: skipped anyway)
        if dist.is_initialized():  # every rank must take the same decision (the docstring says why)
            dist.all_reduce(found_inf)
        self.found_inf, self.unscaled = found_inf.item() > 0, True
        if self.found_inf:
            self.skipped_steps.append(self.steps)
        return not self.found_inf

    def update(self):
        """GradScaler.update: after a skipped step S x backoff_factor; after growth_interval clean
        steps in a row S x growth_factor (unless that overflows fp32); either way the count restarts."""
        if not self.enabled:
            return
        self.steps += 1
        if self.found_inf:
            self.loss_scale *= self.backoff_factor
            self.growth_tracker = 0
        elif self.growth_tracker + 1 == self.growth_interval:
            grown = self.loss_scale * self.growth_factor
            self.loss_scale = grown if grown <= torch.finfo(torch.float32).max else self.loss_scale
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
        self.found_inf = self.unscaled = False

    def state_dict(self):
        """GradScaler.state_dict's keys, plus the scale the run started at, the steps seen and those
        skipped (the report's: a resumed run reports the whole run, whatever --loss-scale it was given)."""
        return {"init_scale": self.init_scale, "scale": self.loss_scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": self.growth_tracker, "steps": self.steps, "skipped_steps": list(self.skipped_steps)}

    def load_state_dict(self, state):
        self.init_scale = float(state.get("init_scale", self.init_scale))  # (saved since --loss-scale)
        self.loss_scale, self.growth_tracker = float(state["scale"]), int(state["_growth_tracker"])
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval, self.steps = state["growth_interval"], state["steps"]
        self.skipped_steps = list(state["skipped_steps"])

    def report(self):
        """For the run's report (measure.Run): None unless enabled."""
        if not self.enabled:
            return None
        return {"init_scale": self.init_scale, "final_scale": self.loss_scale,
                "growth_interval": self.growth_interval, "skipped_steps": list(self.skipped_steps)}
