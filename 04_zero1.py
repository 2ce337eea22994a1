"""Lesson 04: ZeRO-1. Shard the optimizer: reduce-scatter -> AdamW on my shard -> all-gather.

In 01-03 every rank holds the whole optimizer (in bf16: 12 bytes per parameter of fp32 master
weights and Adam moments) and computes the same update. ZeRO-1 (Rajbhandari et al. 2020,
"P_os") splits that work instead: the trainable parameters live in one flat buffer cut into N
equal shards, and rank r keeps the optimizer state of shard r and updates shard r only.

The all-reduce of 01 is a reduce-scatter followed by an all-gather (00). ZeRO-1 pulls the two
apart and puts the optimizer step between them, so it sends what 01 sends, 2 Psi (N-1)/N
elements per rank per step, and holds 12 Psi / N bytes of optimizer state instead of 12 Psi.
After the reduce-scatter a rank sees only its shard of the gradient: clipping's norm and fp16's
found-inf flag are each one all-reduced scalar.

    python 04_zero1.py                                       # one process (world size 1)
    torchrun --nproc_per_node=2 04_zero1.py                  # 2 ranks on CPU (gloo)
    torchrun --nproc_per_node=2 04_zero1.py --precision bf16 # the ZeRO paper's accounting
    torchrun --nproc_per_node=4 04_zero1.py --device cuda    # 4 GPUs (nccl)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:29500 04_zero1.py         # 2 nodes, run on each

PyTorch: `torch.distributed.optim.ZeroRedundancyOptimizer` (which shards the optimizer state
but leaves gradients to DDP's all-reduce); DeepSpeed: ZeRO stage 1.
"""
import functools
import math

import torch
import torch.distributed as dist

from bucket import BucketManager
from lessonkit import checkpoint, common, ddp, lifecycle, loss_scale, measure, optimizers
from model import get_batch
from shard import ShardOptimizer


# ----------------------------------------------------------------------------- the strategy
class ZeRO1Optimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer shaped like PyTorch's `ZeroRedundancyOptimizer(params,
    optimizer_class, **defaults)`, used where a loop used that (and DDP: it reduces itself).

    params            the model's parameters; the trainable ones are moved into flat buffers (one
                      per bucket) that they view from then on (frozen ones stay where they are)
    optimizer_class   any torch.optim optimizer (AdamW, Adam, SGD, ...), run over my shard only
    grad_clip         global-norm gradient clipping across all shards; 0 turns it off
    find_unused_parameters  as DDP's: a parameter no rank's backward reached is left alone by the
                      optimizer, as one process leaves it (costs a small all-reduce per step)
    **defaults        the optimizer's own arguments (lr, betas, momentum, ...)

    `param_groups`, `state_dict()` and `load_state_dict()` are the inner optimizer's (this rank's
    shard only: lessonkit/checkpoint.py saves the whole run). Rank 0's parameters are broadcast
    here, so ranks may start from different weights. Call `step()` once per optimizer step, after
    the last micro-step's backward, then `zero_grad()`.
    """
    unscale_in_step = True  # fp16: LossScaler.step calls step(unscale=) (lessonkit/loss_scale.py)

    def __init__(self, params, optimizer_class=torch.optim.AdamW, grad_clip=0.0, find_unused_parameters=False,
                 **defaults):
        groups, frozen = optimizers.param_groups(params)  # the caller's groups, each parameter once
        self.params = [p for g in groups for p in g["params"]]
        assert len({p.dtype for p in self.params}) == 1, "one working precision for all parameters"
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # One flat buffer for the parameters, one for their gradients: one bucket of 03 holding
        # them all (no cap), padded to a multiple of N so it splits into N equal shards (a
        # reduce-scatter needs equal chunks), reduce-scattered in step(). (05: many, in backward.)
        self.grad_buckets = BucketManager(self.params, math.inf, launch=self._reduce_scatter,
                                          grads_as_views=True, pad_to=self.world_size,
                                          on_done=self._keep_my_shard)
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
                    p.grad = bucket.view(p)  # the gradient kept whole: autograd adds into it in place
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
        # In bf16, micro-steps' gradients add up in fp32, never in bf16: 4 bytes per parameter
        self.grad_accumulation = ddp.FP32Accumulation(self.params)

    @torch.no_grad()
    def _reduce_scatter(self, bucket):
        """BucketManager's launch(bucket): start the reduce-scatter of a full bucket."""
        # 1) reduce-scatter the bucket's gradient, averaged, in step(), once backward is over.
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
        """BucketManager's on_done(bucket): keep my slice (the bucket stays whole for the next step)."""
        self.grad_shards[bucket.index] = self.grad_shards_in_flight.pop(bucket.index)

    @torch.no_grad()
    def step(self, closure=None, unscale=None):
        assert closure is None, "closures are not supported"
        # 1) reduce-scatter every bucket (here one), then wait: I hold my shard of the global
        # batch's gradient, nothing else. It sends Psi (N-1)/N elements, half an all-reduce (which
        # then a slice would waste): with the all-gather in 3), exactly one all-reduce, 01's bytes.
        self.grad_buckets.finish()

        # 2) AdamW on my shards (shard.py), in fp32, clipped by the global norm; fp16: unscaled
        # there, and skipped on every rank if any rank's shards hold an inf or NaN.
        self.shard_optimizer.step(self.grad_shards, unscale)
        self.grad_shards = [None] * len(self.grad_shards)  # my gradient slices live only in step()

        # 3) all-gather every rank's updated shard into the flat buffer, in place: my shard
        # already sits at its slot of the output, which NCCL and gloo allow. A skipped step (fp16)
        # all-gathers too, each shard unchanged (DeepSpeed returns before it: a branch for a few
        # steps in thousands).
        works = []
        for flat_param, param_shard in zip(self.flat_params, self.param_shards):
            # ### BEGIN SOLUTION: 3) all-gather the parameters
            # GOAL: flat_param will hold every rank's updated slice (param_shard on each), on every
            #       rank, in the working precision; one async collective, its handle in works.
            works.append(dist.all_gather_into_tensor(flat_param, param_shard, async_op=True))
            # ### END SOLUTION
        for work in works:
            work.wait()

    def zero_grad(self, set_to_none=True):
        """set_to_none=False: in place, every p.grad stays a view of its bucket, no copy."""
        if set_to_none:
            for p in self.params:
                p.grad = None
        else:
            for bucket in self.grad_buckets.buckets:
                bucket.buffer.zero_()
        self.grad_accumulation.reset()  # the next backward starts a new sum

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
    optimizer = ZeRO1Optimizer(optimizers.decay_groups(model, args.weight_decay),  # (weight decay: matrices only)
                               torch.optim.AdamW, grad_clip=args.grad_clip, **optimizers.adamw_kwargs(args))
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
                loss = model(x, y) / args.grad_accum
                scaler.scale(loss).backward()  # the whole gradient accumulates locally, in the flat buffer
                losses.append(loss)  # (bf16, fp16: in fp32)
            # (fp16: unscaled in my shards, in fp32; an inf or NaN in any rank's shards: every rank skips 2))
            scaler.step(optimizer)  # 1) reduce-scatter  2) AdamW on my shards  3) all-gather
            scaler.update()
            optimizer.zero_grad(set_to_none=False)  # in place: the grads stay views, no copy
        ckpt.maybe_save(step + 1)  # every --save-every steps (each rank its shard)
    ### TRAINING SECTION END

    run.finish()
    return run


if __name__ == "__main__":
    lifecycle.run_main(main)
