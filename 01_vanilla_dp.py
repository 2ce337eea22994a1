"""Lesson 01: vanilla data parallelism. After backward, all-reduce every gradient.

Every rank holds the whole model and the whole optimizer, runs forward and backward on its own
slice of the global batch, and then averages the gradients across ranks, one blocking
all-reduce per parameter. After that every rank holds the gradient of the global batch and
takes the same optimizer step, so the replicas never drift apart.

Used like PyTorch's `DistributedDataParallel`: wrap the model, build any torch.optim optimizer
over `model.parameters()`, and the loop stays the one written for DDP. The all-reduce runs at
the end of `loss.backward()`, as DDP's does; `with model.no_sync():` skips it for the micro-steps
of gradient accumulation (DDP's `require_backward_grad_sync` is the flag behind it). In bf16,
micro-steps' gradients add up in fp32, never in bf16: ddp.Replicated keeps their fp32 sum, and
p.grad holds it rounded once, which is what the all-reduce moves (a bf16 running sum keeps 8
significant bits: a small micro-step's gradient can vanish in it whole).

    python 01_vanilla_dp.py                                  # one process (world size 1)
    torchrun --nproc_per_node=2 01_vanilla_dp.py             # 2 ranks on CPU (gloo)
    torchrun --nproc_per_node=4 01_vanilla_dp.py --device cuda   # 4 GPUs (nccl)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:29500 01_vanilla_dp.py    # 2 nodes, run on each
"""
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

import checkpoint
import common
import ddp
import lifecycle
import measure
import optimizers
from model import get_batch


# ----------------------------------------------------------------------------- the strategy
class VanillaDP(ddp.Replicated):
    """Replicate `module`; at the end of every backward, `all_reduce_gradients()` averages every
    gradient. Shaped like `DistributedDataParallel(module)` (ddp.Replicated: `.module`,
    `no_sync()`, `require_backward_grad_sync`)."""

    def __init__(self, module: nn.Module, find_unused_parameters: bool = False):
        super().__init__(module, find_unused_parameters)  # (ddp.Replicated says what the flag does)
        # "After backward", without a call in the loop: a backward's first gradient queues
        # all_reduce_gradients to run once that backward is over, inside loss.backward(), as
        # DDP does (not in a no_sync() backward, which only accumulates).
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda p: self.at_end_of_backward(self.all_reduce_gradients))

    @torch.no_grad()
    def all_reduce_gradients(self):
        # Each rank's loss is the mean over its own rows; the global loss is the mean of those
        # means, so the global gradient is the SUM of the ranks' gradients divided by N.
        # (Dividing first, as DDP does, works on every backend, where older gloo had no
        # ReduceOp.AVG; in fp16 it would also keep the sum from overflowing, a concern bf16,
        # with fp32's range, does not have.)
        # model.parameters() yields a tied parameter once, so it is reduced once.
        # Collectives are matched by the order they are issued, so every rank must all-reduce the
        # same parameters in the same order whatever its data did. A parameter this rank's forward
        # skipped (an MoE expert with no tokens here) has no gradient here but may have one on
        # another rank: it takes part with zeros, its share of the mean. Only a parameter no rank
        # has a gradient for (find_unused_parameters: one all-reduce of flags tells) is left out.
        params = [p for p in self.module.parameters() if p.requires_grad]  # frozen: never any
        unused = self.unused_everywhere([p for p in params if p.grad is not None])
        # ### BEGIN SOLUTION: average the gradients
        # GOAL: afterwards every rank's p.grad holds the global-batch mean gradient, in place, for
        #       every parameter not in `unused` (a rank without a gradient for it takes part with
        #       zeros); one collective per parameter, blocking, in the same order on every rank.
        for p in params:
            if p in unused:  # no rank has a gradient: it stays None and the optimizer skips it
                continue
            if p.grad is None:  # another rank used it: this rank's share of the sum is zero
                p.grad = torch.zeros_like(p)
            p.grad.div_(self.world_size)
            dist.all_reduce(p.grad)  # blocking: communication starts only after backward ends
        # ### END SOLUTION


# ----------------------------------------------------------------------------- training
def main(argv=None):
    args = common.parse_args(argv, description=__doc__)
    env = common.init_distributed(args)
    model = VanillaDP(common.build_model(args, env))
    # weight decay on matrices and embeddings only (optimizers.decay_groups, as nanoGPT)
    optimizer = optimizers.MixedPrecisionAdamW(optimizers.decay_groups(model, args.weight_decay), args.grad_clip,
                                           **optimizers.adamw_kwargs(args))
    run = measure.Run(args, env, "vanilla_dp", model.module, optimizer, holders=[model])
    ckpt = checkpoint.Checkpointer(args, env, run.strategy, model.module,  # --checkpoint-dir
                                   functools.partial(optimizers.checkpoint_shards, optimizer))
    start = ckpt.resume()  # 0, or with --resume the step the newest checkpoint stopped at

    ### TRAINING SECTION BEGIN
    for step in range(start, args.steps):
        with run.step(step) as losses:
            for micro in range(args.grad_accum):
                x, y = get_batch(args, env, step, micro)
                # Only the last micro-step's backward averages (nanoGPT toggles DDP's flag the
                # same way rather than wrap the other micro-steps in `with model.no_sync():`).
                model.require_backward_grad_sync = micro == args.grad_accum - 1
                loss = model(x, y) / args.grad_accum  # gradients accumulate in .grad
                loss.backward()  # ... and, at the last micro-step, all_reduce_gradients() at its end
                losses.append(loss)
            optimizers.set_learning_rate(optimizer, args, step)  # --lr-schedule
            optimizer.step()
            optimizer.zero_grad()
        ckpt.maybe_save(step + 1)  # every --save-every steps (rank 0 writes the replicated state)
    ### TRAINING SECTION END

    run.finish()
    return run


if __name__ == "__main__":
    lifecycle.run_main(main)
