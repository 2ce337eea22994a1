"""ZeRO's sharded optimizer, 04's idea beside its lesson and shared by 05 (as bucket.py is 03's):
my shard of the flat parameters, the reduce-scatter that brings my shard of the gradient, the
optimizer step on my shard and the all-gather that brings everyone's update back.

ZeROOptimizer holds all of it; a subclass says when to reduce-scatter and what a step keeps. It
builds `grad_buckets`, 03's buckets padded to a multiple of N, with `_reduce_scatter` as their
launch (04: one bucket, in step(); 05: many, during backward, each freed), and writes `step()`
and `zero_grad()`.

A rank keeps optimizer state for its shard alone: fp32 master weights of the shard (in fp32 the
shard is its own master) and a real torch.optim optimizer over them (ShardOptimizer), so Adam's
moments exist for 1/N of the parameters. The optimizer sees one view of the masters per
parameter, in the caller's param groups, so weight decay, a frozen or unused parameter and an
lr_scheduler behave as in one process.
"""
import torch
import torch.distributed as dist

from lessonkit import ddp, optimizers, reshard


class ZeROOptimizer(torch.optim.Optimizer):
    """04's and 05's torch.optim.Optimizer, shaped like PyTorch's `ZeroRedundancyOptimizer(params,
    optimizer_class, **defaults)` and used where a loop used that and DDP: it reduces the gradients
    itself (ZeroRedundancyOptimizer leaves them to DDP's all-reduce). 04's and 05's arguments:

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

    def __init__(self, groups, frozen, optimizer_class, grad_clip=0.0, find_unused_parameters=False, **defaults):
        """groups, frozen: optimizers.param_groups(params). The subclass has set self.params,
        self.rank, self.world_size and self.grad_buckets."""
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
        # The optimizer on my shard only: fp32 masters and a torch.optim optimizer over them alone.
        self.shard_optimizer = ShardOptimizer(groups, shards, optimizer_class, grad_clip,
                                              find_unused_parameters, **defaults)
        super().__init__(self.shard_optimizer.masters, defaults)
        self.param_groups = self.shard_optimizer.param_groups  # what an lr_scheduler sets is what steps
        # In bf16, micro-steps' gradients add up in fp32, never in bf16: 4 bytes per parameter (05:
        # under no_sync(); otherwise its fp32 gradient shards hold the sum)
        self.grad_accumulation = ddp.FP32Accumulation(self.params)

    @torch.no_grad()
    def _reduce_scatter(self, bucket):
        """BucketManager's launch(bucket): start the reduce-scatter of a full bucket. It sends
        numel_padded (N-1)/N elements, half of 01's all-reduce of the same gradients, and leaves me
        my slice alone; with the all-gather, 01's bytes. (Divide first, then SUM, as in 01.)"""
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

    def _keep_my_shard(self, bucket):
        """BucketManager's on_done(bucket): keep my slice; the bucket stays whole (05 replaces
        this: it adds up micro-steps' slices and frees the bucket)."""
        self.grad_shards[bucket.index] = self.grad_shards_in_flight.pop(bucket.index)

    @torch.no_grad()
    def step_and_all_gather(self, unscale=None):
        """2) AdamW on my shards, in fp32, clipped by the global norm; fp16: unscaled there, and
        skipped on every rank if any rank's shards hold an inf or NaN. 3) All-gather every rank's
        updated shard into the flat buffers."""
        self.shard_optimizer.step(self.grad_shards, unscale)
        # In place: my shard already sits at its slot of the output, which NCCL and gloo allow. A
        # skipped step (fp16) all-gathers too, each shard unchanged (DeepSpeed returns before it: a
        # branch for a few steps in thousands). All buckets at once, then wait.
        works = []
        for flat_param, param_shard in zip(self.flat_params, self.param_shards):
            # ### BEGIN SOLUTION: 3) all-gather the parameters
            # GOAL: flat_param will hold every rank's updated slice (param_shard on each), on every
            #       rank, in the working precision; one async collective, its handle in works.
            works.append(dist.all_gather_into_tensor(flat_param, param_shard, async_op=True))
            # ### END SOLUTION
        for work in works:
            work.wait()

    def state_dict(self):
        return self.shard_optimizer.optim.state_dict()  # my shards' state

    def load_state_dict(self, state_dict):
        self.shard_optimizer.optim.load_state_dict(state_dict)


def checkpoint_shards(optimizer, names):
    """For lessonkit/checkpoint.py: what a ZeROOptimizer holds, per bucket."""
    return optimizer.shard_optimizer.checkpoint_shards(names, optimizer.flat_params)


class ShardOptimizer:
    """The optimizer step on my shards, in one call: step(grad_shards).

    groups    the caller's param groups (param_groups(params)), their options kept
    shards    per flat buffer: (its parameters, laid back to back from offset 0; my shard of it,
              a view of the buffer; where my shard starts in it)
    optimizer_class, **defaults   any torch.optim optimizer and its arguments
    grad_clip global-norm clipping across all shards; 0 turns it off
    find_unused_parameters  as DDP's: a parameter no rank's backward reached is skipped, as one
              process skips a parameter whose .grad is None (UsedParameters)

    `pieces`: one view of the masters per parameter, as FSDP2's optimizer sees one tensor per
    parameter (the module docstring says why).
    """

    def __init__(self, groups, shards, optimizer_class, grad_clip=0.0, find_unused_parameters=False, **defaults):
        optimizers.refuse_matrix_optimizer(optimizer_class)  # Muon needs whole matrices: 09
        self.layouts, self.shards, self.starts = (list(x) for x in zip(*shards))
        self.grad_clip = grad_clip
        # in bf16 a copy, from the fp32 initial weights (a bf16 run starts where the fp32 run starts)
        self.masters = [shard if shard.dtype == torch.float32 else _master_shard(params, start, shard.numel())
                        for params, shard, start in shards]
        # per flat buffer, per parameter with elements lo .. hi in my shard: (p, its offset in the
        # buffer, lo, hi, their view in my master shard)
        self.pieces = [[(p, at - lo, lo, hi, master[at - start:at - start + hi - lo])
                        for p, lo, hi, at in reshard.parts([(p, p.numel()) for p in params], start, start + master.numel())]
                       for params, start, master in zip(self.layouts, self.starts, self.masters)]
        of = {}
        for p, *_, piece in (x for pieces in self.pieces for x in pieces):
            of.setdefault(p, []).append(piece)
        inner = [{**g, "params": [x for p in g["params"] for x in of.get(p, [])]} for g in groups]
        if not of:  # a rank holding no piece at all: torch.optim refuses an empty list
            inner[0]["params"] = [torch.zeros(0, requires_grad=True)]
        self.optim = optimizer_class(inner, **defaults)
        self.param_groups = self.optim.param_groups  # what an lr_scheduler sets is what steps
        params = [p for g in groups for p in g["params"]]
        self.used = optimizers.UsedParameters(params, self.shards[0].device) if find_unused_parameters else None
        for p in params if self.used else ():  # fires once p's gradient is complete
            p.register_post_accumulate_grad_hook(self.used.mark)

    @torch.no_grad()
    def step(self, grad_shards, unscale=None):
        """grad_shards: per flat buffer, my shard of its global-batch mean gradient, any dtype; each
        piece gets its slice in fp32 as .grad (None if unused). fp16: unscale (LossScaler's) divides
        them by the scale, or says False (an inf or NaN in some rank's shard): every rank skips the
        step, changing nothing. Else: clipped over every rank's shards, stepped, cast into my shards."""
        unused = self.used.unused() if self.used else ()
        grad_shards = [g.float() for g in grad_shards]  # (a no-op in fp32)
        for pieces, grad_shard, start in zip(self.pieces, grad_shards, self.starts):
            for p, offset, lo, hi, piece in pieces:
                piece.grad = None if p in unused else grad_shard[offset + lo - start:offset + hi - start]
        every_piece = [piece for pieces in self.pieces for *_, piece in pieces]
        if unscale is None or unscale(grad_shards):  # (in place: the pieces' .grad are views of them)
            if self.grad_clip > 0:
                optimizers.clip_grad_norm_([x.grad for x in every_piece if x.grad is not None], self.grad_clip, self.shards[0].device)
            self.optim.step()
            for shard, master in zip(self.shards, self.masters):
                shard.copy_(master)  # (in fp32 the same tensor)
        for piece in every_piece:
            piece.grad = None  # the gradient shards live only during the step

    def checkpoint_shards(self, names, flat_params):
        """For lessonkit/checkpoint.py, per flat buffer: all of it (every rank holds and loads it
        whole), and per piece of my shard that part, its master and the optimizer's state for it."""
        return [s for params, flat_param, pieces in zip(self.layouts, flat_params, self.pieces)
                for s in reshard.flat_buffer_shards(names, params, flat_param, pieces, self.optim)]


def _master_shard(params, start, numel):
    """fp32 master weights for elements start .. start + numel of `params` laid back to back in one
    flat buffer (padding: 0), each from master_weights(p), which hands over (and forgets) p's fp32
    copy: no whole-model fp32 copy stays held beside my shard's."""
    out = torch.zeros(numel, dtype=torch.float32, device=params[0].device)
    offset = 0
    for p in params:
        values = optimizers.master_weights(p)
        lo, hi = max(start, offset), min(start + numel, offset + p.numel())
        if lo < hi:
            out[lo - start:hi - start] = values[lo - offset:hi - offset]
        offset += p.numel()
    return out
