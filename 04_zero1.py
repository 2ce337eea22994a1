"""Lesson 04: ZeRO-1. Shard the optimizer: reduce-scatter -> AdamW on my shard -> all-gather.

In 01-03 every rank holds the whole optimizer (in bf16: 12 bytes per parameter of fp32 master
weights and Adam moments) and computes the same update. ZeRO-1 ("P_os", partition the optimizer
states: Rajbhandari et al. 2020; DeepSpeed's stage 1) splits that work: the trainable parameters
live in one flat buffer cut into N equal shards, and rank r keeps the optimizer state of shard r
and updates it alone. The all-reduce of 01 is a reduce-scatter followed by an all-gather (00):
ZeRO-1 pulls the two apart and puts the optimizer step between them (shard.py), so it sends
what 01 sends (2 Psi (N-1)/N elements per rank per step) and holds 12 Psi / N bytes of
optimizer state, not 12 Psi. After the reduce-scatter a rank sees only its shard of the
gradient: clipping's norm and fp16's found-inf flag are each one all-reduced scalar.

    python 04_zero1.py                                       # one process (world size 1)
    torchrun --nproc_per_node=2 04_zero1.py                  # 2 ranks on CPU (gloo)
    torchrun --nproc_per_node=2 04_zero1.py --precision bf16 # the ZeRO paper's accounting
    torchrun --nproc_per_node=4 04_zero1.py --device cuda    # 4 GPUs (nccl)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:29500 04_zero1.py         # 2 nodes, run on each
"""
import functools

import torch
import torch.distributed as dist

from bucket import BucketManager
from lessonkit import checkpoint, common, lifecycle, loss_scale, measure, optimizers
from model import get_batch
from shard import ZeROOptimizer, checkpoint_shards


# ----------------------------------------------------------------------------- the strategy
class ZeRO1Optimizer(ZeROOptimizer):
    """ZeRO-1: one bucket holds the whole gradient until step() reduce-scatters it. In bf16,
    micro-steps' gradients add up in fp32, never in bf16 (shard.py: that and all the rest)."""

    def __init__(self, params, optimizer_class=torch.optim.AdamW, grad_clip=0.0, find_unused_parameters=False,
                 **defaults):
        groups, frozen = optimizers.param_groups(params)  # the caller's groups, each parameter once
        self.params = [p for g in groups for p in g["params"]]
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # One flat buffer for the gradients: one bucket of 03 holding them all (no cap), padded to
        # a multiple of N so it splits into N equal shards (a reduce-scatter needs equal chunks).
        self.grad_buckets = BucketManager(self.params, float("inf"), launch=self._reduce_scatter,
                                          grads_as_views=True, pad_to=self.world_size,
                                          on_done=self._keep_my_shard)
        super().__init__(groups, frozen, optimizer_class, grad_clip, find_unused_parameters, **defaults)
        for p, bucket in self.grad_buckets.bucket_of.items():
            p.grad = bucket.view(p)  # the gradient kept whole: autograd adds into it in place

    @torch.no_grad()
    def step(self, closure=None, unscale=None):
        assert closure is None, "closures are not supported"
        # 1) reduce-scatter every bucket (here one), then wait: my shard of the global batch's
        # gradient (the bucket keeps my local gradient, divided by N). 05: during backward.
        self.grad_buckets.finish()
        self.step_and_all_gather(unscale)  # 2) AdamW on my shards  3) all-gather them
        self.grad_shards = [None] * len(self.grad_shards)  # my gradient slices live only in step()

    def zero_grad(self, set_to_none=True):
        """set_to_none=False: in place, every p.grad stays a view of its bucket, no copy."""
        if set_to_none:
            for p in self.params:
                p.grad = None
        else:
            for bucket in self.grad_buckets.buckets:
                bucket.buffer.zero_()
        self.grad_accumulation.reset()  # the next backward starts a new sum


# ----------------------------------------------------------------------------- training
def main(argv=None):
    args = common.parse_args(argv, description=__doc__)
    env = common.init_distributed(args)
    model = common.build_model(args, env)
    # weight decay on matrices and embeddings only (optimizers.decay_groups, as nanoGPT)
    optimizer = ZeRO1Optimizer(optimizers.decay_groups(model, args.weight_decay), torch.optim.AdamW,
                               grad_clip=args.grad_clip, **optimizers.adamw_kwargs(args))
    scaler = loss_scale.LossScaler(env.device, enabled=args.precision == "fp16", init_scale=args.loss_scale)
    run = measure.Run(args, env, "zero1", model, optimizer, loss_scaler=scaler)
    ckpt = checkpoint.Checkpointer(args, env, run.strategy, model,  # --checkpoint-dir
                                   functools.partial(checkpoint_shards, optimizer), loss_scaler=scaler)
    start = ckpt.resume()  # 0, or with --resume the step the newest checkpoint stopped at

    ### TRAINING SECTION BEGIN
    for step in range(start, args.steps):
        with run.step(step) as losses:
            optimizers.set_learning_rate(optimizer, args, step)  # --lr-schedule, first (as nanoGPT)
            for micro in range(args.grad_accum):
                x, y = get_batch(args, env, step, micro)
                loss = model(x, y) / args.grad_accum  # gradients accumulate in the buckets
                scaler.scale(loss).backward()  # the whole gradient, locally: no collective yet
                losses.append(loss)
            scaler.step(optimizer)  # 1) reduce-scatter  2) AdamW on my shards  3) all-gather
            scaler.update()
            optimizer.zero_grad(set_to_none=False)  # in place: the grads stay bucket views, no copy
        ckpt.maybe_save(step + 1)  # every --save-every steps (each rank its shard)
    ### TRAINING SECTION END

    run.finish()
    return run


if __name__ == "__main__":
    lifecycle.run_main(main)
