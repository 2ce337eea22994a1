"""Dynamic loss scaling for `--precision fp16`, written once for every lesson: LossScaler, with
torch.amp.GradScaler's defaults, semantics and calls.

Why scale. fp16 has 5 exponent bits: its smallest normal number is 2^-14 (subnormals reach
2^-24, with fewer and fewer significant bits), and the gradients of a loss averaged over many
tokens are often smaller, so backward rounds them to 0. Multiply the loss by S, a power of two,
and backward multiplies every gradient by S, lifting them into fp16's range; the optimizer
divides them by S again in fp32, where x 2^-k is exact. Too large an S overflows (fp16's largest
is 65504): some gradient becomes inf or NaN. Then the step is skipped, parameters, moments and
AdamW's step count untouched, and S halved; after `growth_interval` clean steps in a row S
doubles. So S settles just under the point of overflow. (bf16 has fp32's 8 exponent bits and
needs none of this: its gradients lose precision, not range.)

The loop, GradScaler's:

    scaler.scale(loss).backward()   # loss x S: every gradient x S
    scaler.step(optimizer)          # unscale in fp32; an inf or NaN on any rank: skip, everywhere
    scaler.update()                 # S / 2 after a skipped step, S x 2 after growth_interval clean ones

Unscaled where: GradScaler refuses to unscale fp16 gradients ("Attempting to unscale FP16
gradients"): divided by S in fp16, they would underflow again. So the optimizer first casts them
to its fp32 gradients (optimizers.MixedPrecisionAdamW: its master weights' .grad, as DeepSpeed's
fp16 optimizer; 04's and 05's: my gradient shards, optimizers.ShardOptimizer), then hands those
to unscale(): they are found finite or not and divided by S there, before clipping (which must
see the true norm). The protocol, explicit: such an optimizer's class sets `unscale_in_step =
True`, and its step(unscale=fn) calls fn(its fp32 gradients) before clipping and, when fn returns
False, changes nothing (parameters, masters, moments, step count).

06-08 need no protocol: their shards are fp32 and the master weights (FSDP2's convention), their
optimizer is any torch.optim one, and their loop is FSDP2's with ShardedGradScaler, which clips
between backward and step: `scaler.scale(loss).backward()`, `scaler.unscale_(optimizer)` (the
shards' fp32 .grad divided by S in place, and every rank's verdict taken), clipping,
`scaler.step(optimizer)` (skipped on that verdict), `scaler.update()`.

Why the found-inf flag is global. Every rank must take the same decision: a rank that steps
while another skips leaves the replicas (01-03) apart for good, or the shards (04-08) at
different steps. In 01-03 every rank already holds the same all-reduced gradients, so an inf on
one rank has reached all of them (inf plus anything is inf or NaN): that is why GradScaler, under
DDP, needs no collective of its own. Where gradients are sharded, a rank sees only its shard: an
inf in rank 1's shard is invisible to rank 0. Like clipping, which needs the norm over every
shard (optimizers.clip_grad_norm_), the check must then be global, which is why PyTorch has a
ShardedGradScaler (FSDP) that all-reduces its flag. This scaler, one for every lesson, always
does: one 1-element all-reduce per step (SUM: the number of ranks that found one; the ring
carries SUM), measured with the lesson's other collectives. Over the whole world, in 08 too:
its replicas hold the same shards, but the rule that needs no argument is every rank's verdict.

Checkpoints keep it (checkpoint.Checkpointer: meta.json's "loss_scale", state_dict()): a
resumed run continues with the scale, growth tracker and skipped steps it stopped with.

Disabled (every precision but fp16) it is the identity: scale(loss) is loss, step(optimizer) is
optimizer.step(), update() does nothing, and no collective runs.
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
