"""The optimizer step on my shard, 04's idea beside its flat buffer, shared by 05 (as bucket.py
is 03's, shared by 05): what runs between a reduce-scatter and an all-gather.

A rank keeps optimizer state for its shard alone: fp32 master weights of the shard (in fp32 the
shard is its own master) and a real torch.optim optimizer over them, so Adam's moments exist for
1/N of the parameters. The optimizer sees one view of the masters per parameter, in the caller's
param groups, so weight decay, a frozen or unused parameter and an lr_scheduler behave as in one
process.
"""
import torch

from lessonkit import optimizers, reshard


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
