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

from lessonkit import checkpoint, common, ddp, lifecycle, loss_scale, measure, optimizers, reshard
from model import get_batch


# ----------------------------------------------------------------------------- the strategy
class ZeRO1Optimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer shaped like PyTorch's `ZeroRedundancyOptimizer(params,
    optimizer_class, **defaults)`, used where a loop used that (and DDP: 04 reduces itself).

    params            the model's parameters; the trainable ones are moved into one flat buffer
                      that they view from then on (frozen ones stay where they are)
    optimizer_class   any torch.optim optimizer (AdamW, Adam, SGD, ...), run over my shard only
    grad_clip         global-norm gradient clipping across all shards; 0 turns it off
    find_unused_parameters  as DDP's: a parameter no rank's backward reached is left alone by the
                      optimizer, as one process leaves it (costs a small all-reduce per step)
    **defaults        the optimizer's own arguments (lr, betas, momentum, ...)

    `param_groups` are the inner optimizer's, so torch.optim.lr_scheduler schedules it;
    `state_dict()` / `load_state_dict()` are the inner optimizer's too: this rank's shard only
    (lessonkit/checkpoint.py saves and resumes the whole run, at any world size). Rank 0's parameters are
    broadcast here, so ranks may start from different weights. Call `step()` once per optimizer
    step, after the last micro-step's backward, then `zero_grad()`.

    In bf16, micro-steps' gradients add up in fp32, never in bf16 (fp16 likewise): the flat buffer
    holds their fp32 sum (ddp.FP32Accumulation, as 01-03) rounded once, which the reduce-scatter
    moves.
    """
    unscale_in_step = True  # fp16: LossScaler.step calls step(unscale=) (lessonkit/loss_scale.py)

    def __init__(self, params, optimizer_class=torch.optim.AdamW, grad_clip=0.0, find_unused_parameters=False,
                 **defaults):
        groups, frozen = optimizers.param_groups(params)  # the caller's groups, each parameter once
        self.params = [p for g in groups for p in g["params"]]
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        dtype, device = self.params[0].dtype, self.params[0].device
        assert all(p.dtype == dtype for p in self.params), "one working precision for all parameters"

        # One flat buffer for the parameters, one for their gradients, padded to a multiple of N
        # so they split into N equal shards (a reduce-scatter needs equal chunks). The padding
        # is viewed by no parameter, so it stays zero, and so do its gradient and its update.
        numel = sum(p.numel() for p in self.params)
        self.numel_padded = math.ceil(numel / self.world_size) * self.world_size
        shard_numel = self.numel_padded // self.world_size
        self.flat_param = torch.zeros(self.numel_padded, dtype=dtype, device=device)  # (numel_padded,)
        self.flat_grad = torch.zeros_like(self.flat_param)                            # (numel_padded,)
        with torch.no_grad():
            offset = 0
            for p in self.params:
                view = self.flat_param[offset:offset + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view  # the model now computes with the flat buffer
                # autograd accumulates into an existing .grad in place: into the flat buffer
                p.grad = self.flat_grad[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            self.grad_views = [p.grad for p in self.params]
            # Ranks may start from different random weights: make rank 0's the truth.
            dist.broadcast(self.flat_param, src=0)
            for p in frozen:  # not trained, but it must still be the same on every rank
                dist.broadcast(p.data, src=0)

        # My shard: slice `rank` of the flat buffer, updated by me only.
        # ### BEGIN SOLUTION: my shard of the flat buffer
        # GOAL: self.param_shard is this rank's slice (slice number self.rank, shard_numel elements) of
        #       self.flat_param, sharing its memory: updating the shard updates the parameters.
        start = self.rank * shard_numel
        self.param_shard = self.flat_param[start:start + shard_numel]  # (numel_padded / N,), a view
        # ### END SOLUTION
        # The optimizer on my shard only: fp32 master weights of it (in fp32 mode the shard is
        # its own master) and a real torch.optim optimizer over them, so Adam moments exist for
        # my shard alone, in the caller's param groups (weight decay on matrices only, say).
        self.shard_optimizer = ShardOptimizer(groups, [(self.params, self.param_shard, start)], optimizer_class,
                                              grad_clip, find_unused_parameters, **defaults)
        super().__init__(self.shard_optimizer.masters, defaults)
        self.param_groups = self.shard_optimizer.param_groups  # what an lr_scheduler sets is what steps
        # in bf16 (fp16), from a parameter's second micro-step on: an fp32 sum, 4 bytes per parameter
        self.grad_accumulation = ddp.FP32Accumulation(self.params)

    @torch.no_grad()
    def step(self, closure=None, unscale=None):
        assert closure is None, "closures are not supported"
        self._gradients_into_flat_buffer()
        # 1) reduce-scatter the flat gradient, averaged: afterwards I hold the global batch's
        # gradient for my shard and nothing else. An all-reduce and then a slice would give the
        # same numbers but send 2 Psi (N-1)/N elements, and the all-gather in 3) another
        # Psi (N-1)/N: 50% more than 01. A reduce-scatter sends Psi (N-1)/N, so 1) + 3) cost
        # exactly one all-reduce. (Divide first, then SUM, as in 01.)
        # ### BEGIN SOLUTION: 1) reduce-scatter the gradient
        # GOAL: grad_shard, shaped like self.param_shard, holds my slice of the global-batch mean of
        #       self.flat_grad; one collective that sends (N-1)/N of the buffer per rank (half what
        #       an all-reduce sends).
        self.flat_grad.div_(self.world_size)
        grad_shard = torch.empty_like(self.param_shard)  # (numel_padded / N,)
        dist.reduce_scatter_tensor(grad_shard, self.flat_grad)
        # ### END SOLUTION

        # 2) AdamW on my shard, in fp32 (bf16 and fp16 gradients are cast up first, as 01-03 do),
        # clipped by the global norm; it leaves the updated weights in my shard of the flat buffer.
        # fp16: unscale (the loss scaler's) divides my fp32 shard by the scale before clipping, and
        # if any rank's shard holds an inf or NaN every rank skips this step, its shard untouched.
        self.shard_optimizer.step([grad_shard], unscale)

        # 3) all-gather every rank's updated shard into the flat buffer, so every parameter view
        # is current. In place: my shard already sits at its slot of the output, which NCCL and
        # gloo allow. A skipped step (fp16) all-gathers too: every shard is unchanged, so each
        # parameter gets back the value it has, on every rank. Not worth a branch: the same
        # collectives every step (the bytes the summary counts), one wasted all-gather per
        # skipped step, a few in thousands. (DeepSpeed returns before it.)
        # ### BEGIN SOLUTION: 3) all-gather the parameters
        # GOAL: afterwards self.flat_param holds every rank's updated slice (self.param_shard on
        #       each), on every rank, in the working precision; one collective.
        dist.all_gather_into_tensor(self.flat_param, self.param_shard)
        # ### END SOLUTION

    def zero_grad(self, set_to_none=True):
        """In place, every p.grad stays a view of the flat buffer. set_to_none (PyTorch's
        default) drops them; the next step() then copies what backward made into the buffer."""
        if set_to_none:
            for p in self.params:
                p.grad = None
        else:
            self.flat_grad.zero_()
        self.grad_accumulation.reset()  # the next backward starts a new sum

    def _gradients_into_flat_buffer(self):
        for p, view in zip(self.params, self.grad_views):
            if p.grad is None:  # no gradient this step (set_to_none, then unused): zeros
                view.zero_()
            elif p.grad._base is not self.flat_grad:  # a fresh tensor from autograd
                view.copy_(p.grad)
            p.grad = view

    def state_dict(self):
        return self.shard_optimizer.optim.state_dict()  # my shard's state

    def load_state_dict(self, state_dict):
        self.shard_optimizer.optim.load_state_dict(state_dict)


# ----------------------------------------------------------------------------- the step on my shard
class ShardOptimizer:
    """The optimizer step on my shards, 04's (and 05's): what runs between their reduce-scatter
    and their all-gather, in one call, step(grad_shards).

    groups    the caller's param groups (param_groups(params)), their options kept
    shards    per flat buffer: (its parameters, laid back to back from offset 0; my shard of it,
              a view of the buffer; where my shard starts in it)
    optimizer_class, **defaults   any torch.optim optimizer and its arguments
    grad_clip global-norm clipping across all shards; 0 turns it off
    find_unused_parameters  as DDP's: a parameter no rank's backward reached is skipped, as one
              process skips a parameter whose .grad is None (UsedParameters)

    It holds fp32 master weights of my shards (in fp32 the shards are their own), and a real
    torch.optim optimizer over them, so Adam's moments exist for my shards only. It steps one view
    of the masters per parameter (`pieces`), in the caller's groups, as FSDP2's sees one tensor
    per parameter: weight decay on some only, and a parameter without a gradient, as in one process.
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
    flat buffer (padding: 0), each from master_weights(p): all hand theirs over, so none stays held."""
    out = torch.zeros(numel, dtype=torch.float32, device=params[0].device)
    offset = 0
    for p in params:
        values = optimizers.master_weights(p)
        lo, hi = max(start, offset), min(start + numel, offset + p.numel())
        if lo < hi:
            out[lo - start:hi - start] = values[lo - offset:hi - offset]
        offset += p.numel()
    return out


# ----------------------------------------------------------------------------- checkpoints
def checkpoint_shards(optimizer, names):
    """For lessonkit/checkpoint.py: what a ZeRO1Optimizer holds, one flat buffer."""
    return optimizer.shard_optimizer.checkpoint_shards(names, [optimizer.flat_param])


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
                scaler.scale(loss).backward()  # gradients accumulate locally, in the flat buffer
                losses.append(loss)  # (bf16, fp16: in fp32)
            # ZeRO-1 keeps the full gradient, so it communicates once per optimizer step (fp16:
            # unscaled in my shard, in fp32; an inf or NaN in any rank's shard: every rank skips 2)):
            scaler.step(optimizer)  # 1) reduce-scatter  2) AdamW on my shard  3) all-gather
            scaler.update()
            optimizer.zero_grad(set_to_none=False)  # in place: the grads stay views, no copy
        ckpt.maybe_save(step + 1)  # every --save-every steps (each rank its shard)
    ### TRAINING SECTION END

    run.finish()
    return run


if __name__ == "__main__":
    lifecycle.run_main(main)
