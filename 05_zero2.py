"""Lesson 05: ZeRO-2. Shard the gradients too: buckets reduce-scatter during backward.

ZeRO-1 (04) still holds the whole gradient on every rank, though each rank uses 1/N of it.
ZeRO-2 (Rajbhandari et al. 2020, "P_os+g") never does: backward fills 03's buckets, each full
bucket is reduce-scattered at once, while backward goes on, and a rank keeps only its slice of
each bucket's averaged gradient. A bucket's full buffer is freed once its reduce-scatter is
done, so gradients take 2 Psi / N bytes plus the buckets in flight (the summary prints the peak
beside that bound; the default GPT is two buckets: --bucket-mb 0.25 makes it many). The step
and its all-gather are 04's, bucket by bucket: 2 Psi (N-1)/N elements per rank per step.

With --grad-accum K it reduce-scatters at every micro-step (as DeepSpeed stage 2 and FSDP2 do by
default) and adds my slice into my gradient shard: K reduce-scatters a step. In bf16, micro-steps'
gradients add up in fp32, never in bf16: the shard they add into is fp32.

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
from shard import ShardOptimizer


# ----------------------------------------------------------------------------- the strategy
class ZeRO2Optimizer(ddp.GradientSync, torch.optim.Optimizer):
    """A torch.optim.Optimizer shaped like PyTorch's `ZeroRedundancyOptimizer(params,
    optimizer_class, **defaults)`, used where a loop used that (and DDP: it reduces itself).

    params            the model's parameters; the trainable ones are moved into flat buffers (one
                      per bucket) that they view from then on (frozen ones stay where they are)
    optimizer_class   any torch.optim optimizer (AdamW, Adam, SGD, ...), run over my shard only
    bucket_cap_mb     the bucket size, as in 03 and DDP
    first_bucket_cap_mb  bucket 0's, as in 03 and DDP (1 MiB): its reduce-scatter starts early
    bucket_order      `model.parameters()`: buckets follow it backwards, so bucket 0 holds the last
                      layers, whose gradients come first (03). None: `params`' order (matrices first).
    grad_clip         global-norm gradient clipping across all shards; 0 turns it off
    find_unused_parameters  as DDP's: a parameter no rank's backward reached is left alone by the
                      optimizer, as one process leaves it (costs a small all-reduce per step)
    **defaults        the optimizer's own arguments (lr, betas, momentum, ...)

    `param_groups`, `state_dict()` and `load_state_dict()` are the inner optimizer's (this rank's
    shard only: lessonkit/checkpoint.py saves the whole run). Rank 0's parameters are broadcast
    here, so ranks may start from different weights. Call `step()` once per optimizer step, after
    the last micro-step's backward, then `zero_grad()`. Each backward ends by waiting for its
    reduce-scatters (a callback queued with the autograd engine, inside loss.backward()).
    """
    unscale_in_step = True  # fp16: LossScaler.step calls step(unscale=) (lessonkit/loss_scale.py)

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
        self.grad_shards = [None] * len(self.grad_buckets.buckets)  # my slice of each bucket's gradient
        self.grad_shards_in_flight = {}  # bucket index -> reduce-scatter output
        self.flat_params, self.param_shards, shards = [], [], []
        with torch.no_grad():
            for bucket in self.grad_buckets.buckets:
                # Each bucket's parameters view one flat buffer with the bucket's layout and
                # padding (the padding stays zero, and so do its gradient and its update).
                flat_param = torch.zeros(bucket.numel_padded, dtype=bucket.dtype, device=bucket.device)
                for p in bucket.params:
                    view = bucket.view(p, flat_param)
                    view.copy_(p)
                    p.data = view  # the model now computes with the flat buffers
                # Ranks may start from different random weights: make rank 0's the truth.
                dist.broadcast(flat_param, src=0)
                # My shard: slice `rank` of this bucket, updated by me only.
                # ### BEGIN SOLUTION: my shard of the flat buffer
                # GOAL: param_shard is this rank's slice (slice number self.rank, numel_padded / N
                #       elements) of flat_param, sharing its memory: updating it updates the parameters.
                shard_numel = bucket.numel_padded // self.world_size
                start = self.rank * shard_numel
                param_shard = flat_param[start:start + shard_numel]  # (numel_padded / N,), a view
                # ### END SOLUTION
                self.flat_params.append(flat_param)  # (numel_padded,)
                self.param_shards.append(param_shard)
                shards.append((bucket.params, param_shard, start))
            for p in frozen:  # not trained, but it must still be the same on every rank
                dist.broadcast(p.data, src=0)
        # The optimizer on my shard only (shard.py): fp32 masters and a torch.optim optimizer
        # over them alone, in the caller's param groups.
        self.shard_optimizer = ShardOptimizer(groups, shards, optimizer_class, grad_clip,
                                              find_unused_parameters, **defaults)
        super().__init__(self.shard_optimizer.masters, defaults)
        self.param_groups = self.shard_optimizer.param_groups  # what an lr_scheduler sets is what steps
        self.grad_accumulation = ddp.FP32Accumulation(self.params)  # (under no_sync(): as 04)
        # Fires during backward once p.grad is complete (a tied weight's: both uses summed).
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p):
        if self.require_backward_grad_sync:  # (else p.grad keeps the sum, in fp32 where it has 2 bytes)
            ddp.at_end_of_backward(self, self.grad_buckets.finish)  # at its end: launch the rest, wait for all
            self.grad_buckets.ready(p)

    @torch.no_grad()
    def _reduce_scatter(self, bucket):
        """BucketManager's launch(bucket): start the reduce-scatter of a full bucket."""
        # 1) reduce-scatter the bucket's gradient, averaged, during backward (which goes on).
        # (Divide first, then SUM, as in 01.)
        # ### BEGIN SOLUTION: 1) reduce-scatter a full bucket
        # GOAL: start, without blocking, the collective that leaves my slice (numel_padded / N
        #       elements) of the bucket's global-batch mean gradient in a new tensor of the bucket's
        #       dtype and device, kept in self.grad_shards_in_flight[bucket.index]; return its handle.
        bucket.buffer.div_(self.world_size)
        grad_shard = torch.empty(bucket.numel_padded // self.world_size, dtype=bucket.dtype,
                                 device=bucket.device)  # (numel_padded / N,)
        self.grad_shards_in_flight[bucket.index] = grad_shard
        return dist.reduce_scatter_tensor(grad_shard, bucket.buffer, async_op=True)
        # ### END SOLUTION

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

        # 2) AdamW on my shards (shard.py), in fp32, clipped by the global norm; fp16: unscaled
        # there, and skipped on every rank if any rank's shards hold an inf or NaN.
        self.shard_optimizer.step(self.grad_shards, unscale)

        # 3) per bucket: all-gather every rank's updated shard into its flat buffer, in place as
        # in 04; all buckets at once, then wait. (A skipped step too, as 04: each shard is unchanged.)
        works = []
        for flat_param, param_shard in zip(self.flat_params, self.param_shards):
            # ### BEGIN SOLUTION: 3) all-gather the parameters
            # GOAL: flat_param will hold every rank's updated slice (param_shard on each), on every
            #       rank, in the working precision; one async collective, its handle in works.
            works.append(dist.all_gather_into_tensor(flat_param, param_shard, async_op=True))
            # ### END SOLUTION
        for work in works:
            work.wait()

    def zero_grad(self, set_to_none=True):  # either way: the gradients are my shards, not p.grad
        self.grad_shards = [None] * len(self.grad_shards)  # the next backward's slices start them

    def state_dict(self):
        return self.shard_optimizer.optim.state_dict()  # my shards' state

    def load_state_dict(self, state_dict):
        self.shard_optimizer.optim.load_state_dict(state_dict)


# ----------------------------------------------------------------------------- checkpoints
def checkpoint_shards(optimizer, names):
    """For lessonkit/checkpoint.py: what the optimizer holds, per bucket."""
    return optimizer.shard_optimizer.checkpoint_shards(names, optimizer.flat_params)


# ----------------------------------------------------------------------------- training
def main(argv=None):
    args = common.parse_args(argv, description=__doc__)
    env = common.init_distributed(args)
    model = common.build_model(args, env)
    optimizer = ZeRO2Optimizer(optimizers.decay_groups(model, args.weight_decay),  # (weight decay: matrices only)
                               torch.optim.AdamW, bucket_cap_mb=args.bucket_mb, grad_clip=args.grad_clip,
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
                optimizer.set_requires_gradient_sync(args.reduce_every == "micro" or micro == args.grad_accum - 1)  # step: 1) at the last
                x, y = get_batch(args, env, step, micro)
                loss = model(x, y) / args.grad_accum
                scaler.scale(loss).backward()  # 1) each bucket is reduce-scattered as soon as it is
                losses.append(loss)  # full, every micro-step (no full gradient is kept); waited for at its end
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
