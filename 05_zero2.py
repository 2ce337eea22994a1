"""Lesson 05: ZeRO-2. Shard the gradients too: buckets reduce-scatter during backward.

ZeRO-1 (04) still holds the whole gradient on every rank, though each rank uses 1/N of it.
ZeRO-2 ("P_os+g": the gradients partitioned too) never does: backward fills 03's buckets, each
full bucket is reduce-scattered at once, while backward goes on, and a rank keeps only its slice
of each bucket's averaged gradient. A bucket's full buffer is freed once its reduce-scatter is
done, so gradients take 2 Psi / N bytes in bf16 plus the buckets in flight (the summary prints
the peak beside that bound; the default GPT is two buckets: --bucket-mb 0.25 makes it many).
The step and its all-gather are 04's, bucket by bucket: 2 Psi (N-1)/N elements per rank per step.

With --grad-accum K it reduce-scatters at every micro-step (as DeepSpeed stage 2 and FSDP2 do by
default) and adds my slice into my gradient shard: K reduce-scatters a step, not one. In bf16,
micro-steps' gradients add up in fp32, never in bf16: the shard they add into is fp32.

    python 05_zero2.py                                       # one process (world size 1)
    torchrun --nproc_per_node=2 05_zero2.py                  # 2 ranks on CPU (gloo)
    torchrun --nproc_per_node=2 05_zero2.py --bucket-mb 0.25 # many buckets: the peak stays low
    torchrun --nproc_per_node=4 05_zero2.py --device cuda    # 4 GPUs (nccl)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:29500 05_zero2.py         # 2 nodes, run on each

PyTorch: FSDP2 `fully_shard(model, reshard_after_forward=False)` (the same communication; its
parameters are sharded at rest, too); DeepSpeed: ZeRO stage 2.
"""
import functools

import torch
import torch.distributed as dist

from bucket import BucketManager
from lessonkit import checkpoint, common, ddp, lifecycle, loss_scale, measure, optimizers
from model import get_batch
from shard import ZeROOptimizer, checkpoint_shards


# ----------------------------------------------------------------------------- the strategy
class ZeRO2Optimizer(ddp.GradientSync, ZeROOptimizer):
    """ZeRO-2: 03's buckets, each reduce-scattered during backward as soon as it is full, then
    freed (shard.py: the arguments, the shards, the step and the collectives). Beside 04's:

    bucket_cap_mb     the bucket size, as in 03 and DDP
    first_bucket_cap_mb  bucket 0's, as in 03 and DDP (1 MiB): its reduce-scatter starts early
    bucket_order      `model.parameters()`: buckets follow it backwards, so bucket 0 holds the last
                      layers, whose gradients come first (03). None: `params`' order (matrices first).

    Each backward ends by waiting for its reduce-scatters (a callback queued with the autograd
    engine, inside loss.backward()).
    """

    def __init__(self, params, optimizer_class=torch.optim.AdamW, bucket_cap_mb=25.0, grad_clip=0.0,
                 find_unused_parameters=False, first_bucket_cap_mb=1.0, bucket_order=None, **defaults):
        groups, frozen = optimizers.param_groups(params)  # the caller's groups, each parameter once
        self.params = [p for g in groups for p in g["params"]]
        if bucket_order is not None:  # (the param groups keep their own order for the optimizer)
            position = {id(p): i for i, p in enumerate(bucket_order)}
            self.params.sort(key=lambda p: position.get(id(p), len(position)))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # 03's buckets, reduce-scattered during backward; a full-size buffer lives only while it
        # fills and is in flight, at most two in flight (DeepSpeed's overlap_comm): before a third
        # starts, the oldest is waited for and freed. Bucket 0: 1 MiB (03), to start early.
        self.grad_buckets = BucketManager(self.params, bucket_cap_mb, launch=self._reduce_scatter,
                                          grads_as_views=False, pad_to=self.world_size,
                                          on_done=self._keep_my_shard, max_in_flight=2,
                                          first_bucket_cap_mb=first_bucket_cap_mb)  # bucket 0: starts early
        super().__init__(groups, frozen, optimizer_class, grad_clip, find_unused_parameters, **defaults)
        # Fires during backward once p.grad is complete (a tied weight's: both uses summed).
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p):
        if self.require_backward_grad_sync:  # (else p.grad keeps the sum: FP32Accumulation's in bf16)
            ddp.at_end_of_backward(self, self.grad_buckets.finish)  # at its end: launch the rest, wait for all
            self.grad_buckets.ready(p)

    @torch.no_grad()
    def _keep_my_shard(self, bucket):
        """BucketManager's on_done(bucket): keep my slice, drop the full-size buffer."""
        # ### BEGIN SOLUTION: keep my slice, free the bucket
        # GOAL: self.grad_shards[bucket.index] holds my slice of this step's gradient summed over the
        #       micro-steps so far (later micro-steps accumulate in fp32); nothing of this bucket is
        #       left in flight and its full-size buffer is released.
        grad_shard = self.grad_shards_in_flight.pop(bucket.index)
        if self.grad_shards[bucket.index] is None:
            self.grad_shards[bucket.index] = grad_shard
        else:  # a later micro-step: accumulate in my shard (see the docstring), in fp32 as FSDP2
            # and DeepSpeed do: a bf16 sum keeps 8 bits, so each addition would round away up to
            # 2^-9 of the total, more with every micro-step. (In fp32 mode .float() is a no-op.)
            self.grad_shards[bucket.index] = self.grad_shards[bucket.index].float().add_(grad_shard)
        bucket.buffer = None  # freed: the next bucket to fill gets the memory back
        # ### END SOLUTION

    @torch.no_grad()
    def step(self, closure=None, unscale=None):
        assert closure is None, "closures are not supported"
        assert None not in self.grad_shards, "step() before any backward since zero_grad()"
        # 1) the reduce-scatters ran during backward: my gradient shards are ready.
        self.step_and_all_gather(unscale)  # 2) AdamW on my shards  3) all-gather, bucket by bucket

    def zero_grad(self, set_to_none=True):  # either way: the gradients are my shards, not p.grad
        self.grad_shards = [None] * len(self.grad_shards)  # the next backward's slices start them
        self.grad_accumulation.reset()  # (as 04)


# ----------------------------------------------------------------------------- training
def main(argv=None):
    args = common.parse_args(argv, description=__doc__)
    env = common.init_distributed(args)
    model = common.build_model(args, env)
    # weight decay on matrices and embeddings only (optimizers.decay_groups, as nanoGPT)
    optimizer = ZeRO2Optimizer(optimizers.decay_groups(model, args.weight_decay), torch.optim.AdamW,
                               bucket_cap_mb=args.bucket_mb, grad_clip=args.grad_clip,
                               bucket_order=model.parameters(),  # bucket 0 = the last layers: fills first
                               **optimizers.adamw_kwargs(args))
    scaler = loss_scale.LossScaler(env.device, enabled=args.precision == "fp16", init_scale=args.loss_scale)
    run = measure.Run(args, env, "zero2", model, optimizer, loss_scaler=scaler)
    ckpt = checkpoint.Checkpointer(args, env, run.strategy, model,  # --checkpoint-dir
                                   functools.partial(checkpoint_shards, optimizer), loss_scaler=scaler)
    start = ckpt.resume()  # 0, or with --resume the step the newest checkpoint stopped at

    ### TRAINING SECTION BEGIN
    for step in range(start, args.steps):
        with run.step(step) as losses:
            optimizers.set_learning_rate(optimizer, args, step)  # --lr-schedule, first (as nanoGPT)
            for micro in range(args.grad_accum):
                # --reduce-every step: reduce-scatter at the last micro-step only (docs/flags.md)
                optimizer.set_requires_gradient_sync(args.reduce_every == "micro" or micro == args.grad_accum - 1)
                x, y = get_batch(args, env, step, micro)
                loss = model(x, y) / args.grad_accum
                scaler.scale(loss).backward()  # 1) each bucket is reduce-scattered as soon as it is
                losses.append(loss)  # full (when syncing), then freed; waited for at backward's end
            # (fp16: unscaled in my shards, in fp32; an inf or NaN in any rank's shards: every rank skips 2))
            scaler.step(optimizer)  # 2) AdamW on my shards  3) all-gather, bucket by bucket
            scaler.update()
            optimizer.zero_grad()
        ckpt.maybe_save(step + 1)  # every --save-every steps (each rank its shard)
    ### TRAINING SECTION END

    run.finish()
    return run


if __name__ == "__main__":
    lifecycle.run_main(main)
