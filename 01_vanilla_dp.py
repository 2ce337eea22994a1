"""Lesson 01: vanilla data parallelism. After backward, all-reduce every gradient.

Every rank holds the whole model and the whole optimizer, runs forward and backward on its own
slice of the global batch, then averages the gradients across ranks, one blocking all-reduce
per parameter. Every rank then holds the global batch's gradient and takes the same step, so
the replicas never drift apart. The loop makes that call itself, on the page:

    for micro in range(K): (model(x, y) / K).backward()    # gradients accumulate in .grad
    model.all_reduce_gradients()                           # now every rank has the global mean
    optimizer.step()

A loop written for PyTorch's `DistributedDataParallel` needs that one line more; 02 moves it
inside `loss.backward()`, as DDP does. --precision bf16 and fp16 run the same algorithm on
2-byte gradients: fp32 master weights (lessonkit/optimizers.py), loss scaling for fp16
(lessonkit/loss_scale.py). In bf16, micro-steps' gradients add up in fp32, never in bf16
(lessonkit/ddp.py): a bf16 running sum would lose a small micro-step's gradient whole.

    python 01_vanilla_dp.py                                  # one process (world size 1)
    torchrun --nproc_per_node=2 01_vanilla_dp.py             # 2 ranks on CPU (gloo)
    torchrun --nproc_per_node=4 01_vanilla_dp.py --device cuda   # 4 GPUs (nccl)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:29500 01_vanilla_dp.py    # 2 nodes, run on each

PyTorch: `torch.nn.parallel.DistributedDataParallel` (without its overlap: 02, 03).
"""
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from lessonkit import checkpoint, common, ddp, lifecycle, loss_scale, measure, optimizers
from model import get_batch


# ----------------------------------------------------------------------------- the strategy
class VanillaDP(ddp.Replicas):
    """Replicate `module` (ddp.Replicas: `.module`, rank 0's weights broadcast, calling it runs the
    module); `all_reduce_gradients()`, called after backward, averages every gradient."""

    def __init__(self, module: nn.Module, find_unused_parameters: bool = False):
        super().__init__(module, find_unused_parameters)  # (ddp.Replicas says what the flag does)

    @torch.no_grad()
    def all_reduce_gradients(self):
        # Each rank's loss is the mean over its own rows; the global loss is the mean of those
        # means, so the global gradient is the SUM of the ranks' gradients divided by N.
        # (Dividing first, as DDP does, works on every backend, where older gloo had no
        # ReduceOp.AVG; in fp16 it also keeps the sum from overflowing, a concern bf16, with
        # fp32's range, does not have.)
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
        self.grad_accumulation.reset()  # these gradients are the step's: the next backward starts anew


# ----------------------------------------------------------------------------- training
def main(argv=None):
    args = common.parse_args(argv, description=__doc__)
    env = common.init_distributed(args)
    model = VanillaDP(common.build_model(args, env))
    # weight decay on matrices and embeddings only (optimizers.decay_groups, as nanoGPT)
    optimizer = optimizers.MixedPrecisionAdamW(optimizers.decay_groups(model, args.weight_decay), args.grad_clip,
                                           **optimizers.adamw_kwargs(args))
    # fp16: dynamic loss scaling, GradScaler's calls (lessonkit/loss_scale.py); other precisions: the identity
    scaler = loss_scale.LossScaler(env.device, enabled=args.precision == "fp16", init_scale=args.loss_scale)
    run = measure.Run(args, env, "vanilla_dp", model.module, optimizer, holders=[model], loss_scaler=scaler)
    ckpt = checkpoint.Checkpointer(args, env, run.strategy, model.module,  # --checkpoint-dir
                                   functools.partial(optimizers.checkpoint_shards, optimizer), loss_scaler=scaler)
    start = ckpt.resume()  # 0, or with --resume the step the newest checkpoint stopped at

    ### TRAINING SECTION BEGIN
    for step in range(start, args.steps):
        with run.step(step) as losses:
            optimizers.set_learning_rate(optimizer, args, step)  # --lr-schedule, first (as nanoGPT)
            for micro in range(args.grad_accum):
                x, y = get_batch(args, env, step, micro)
                loss = model(x, y) / args.grad_accum  # gradients accumulate in .grad
                scaler.scale(loss).backward()
                losses.append(loss)
            model.all_reduce_gradients()  # after backward: every rank now holds the global-batch mean
            scaler.step(optimizer)  # fp16: unscaled in fp32; an inf or NaN on any rank: every rank skips it
            scaler.update()  # fp16: the scale halves after a skipped step, doubles after 2000 clean ones
            optimizer.zero_grad()
        ckpt.maybe_save(step + 1)  # every --save-every steps (rank 0 writes the replicated state)
    ### TRAINING SECTION END

    run.finish()
    return run


if __name__ == "__main__":
    lifecycle.run_main(main)
