"""The optimizer side the lessons share: AdamW with fp32 master weights for 01-03
(MixedPrecisionAdamW), the step on my shards that 04 and 05 run between their reduce-scatter and
their all-gather (ShardOptimizer), clipping across shards and find_unused_parameters (06 too),
the learning-rate schedule and nanoGPT's weight-decay groups.
"""
import math

import torch
import torch.distributed as dist

from lessonkit.reshard import FlatShard, flat_buffer_shards, parts


# ----------------------------------------------------------------------------- sharded optimizers (04-06)
def param_groups(params):
    """torch.optim's two forms, an iterable of parameters or of {"params": [...], options}
    dicts, as (groups: a list of dicts of trainable parameters, frozen: the others); each
    parameter once (a tied weight is one)."""
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    seen, out, frozen = set(), [], []
    for g in groups:
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        ps = [p for p in ps if id(p) not in seen and not seen.add(id(p))]
        out.append({**g, "params": [p for p in ps if p.requires_grad]})
        frozen += [p for p in ps if not p.requires_grad]
    return out, frozen


class ShardOptimizer:
    """The optimizer step on my shards, 04's and 05's: what runs between their reduce-scatter
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
        self.layouts, self.shards, self.starts = (list(x) for x in zip(*shards))
        self.grad_clip = grad_clip
        # in bf16 a copy, from the fp32 initial weights (a bf16 run starts where the fp32 run starts)
        self.masters = [shard if shard.dtype == torch.float32 else _master_shard(params, start, shard.numel())
                        for params, shard, start in shards]
        # per flat buffer, per parameter with elements lo .. hi in my shard: (p, its offset in the
        # buffer, lo, hi, their view in my master shard)
        self.pieces = [[(p, at - lo, lo, hi, master[at - start:at - start + hi - lo])
                        for p, lo, hi, at in parts([(p, p.numel()) for p in params], start, start + master.numel())]
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
        self.used = UsedParameters(params, self.shards[0].device) if find_unused_parameters else None
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
                clip_grad_norm_([x.grad for x in every_piece if x.grad is not None], self.grad_clip, self.shards[0].device)
            self.optim.step()
            for shard, master in zip(self.shards, self.masters):
                shard.copy_(master)  # (in fp32 the same tensor)
        for piece in every_piece:
            piece.grad = None  # the gradient shards live only during the step

    def checkpoint_shards(self, names, flat_params):
        """For lessonkit/checkpoint.py, per flat buffer: all of it (every rank holds and loads it
        whole), and per piece of my shard that part, its master and the optimizer's state for it."""
        return [s for params, flat_param, pieces in zip(self.layouts, flat_params, self.pieces)
                for s in flat_buffer_shards(names, params, flat_param, pieces, self.optim)]


def _master_shard(params, start, numel):
    """fp32 master weights for elements start .. start + numel of `params` laid back to back in one
    flat buffer (padding: 0), each from master_weights(p): all hand theirs over, so none stays held."""
    out = torch.zeros(numel, dtype=torch.float32, device=params[0].device)
    offset = 0
    for p in params:
        values = master_weights(p)
        lo, hi = max(start, offset), min(start + numel, offset + p.numel())
        if lo < hi:
            out[lo - start:hi - start] = values[lo - offset:hi - offset]
        offset += p.numel()
    return out


@torch.no_grad()
def clip_grad_norm_(grads, max_norm, device, group=None):
    """Global-norm clipping, as torch.nn.utils.clip_grad_norm_ over the whole model, of gradients
    sharded across the ranks of `group` (None: all): each rank sums the squares of its own shards
    (padding is zero: it adds nothing), one scalar all-reduce adds them up. Returns the total norm."""
    norm_sq = torch.zeros((), device=device)
    for g in grads:
        norm_sq += g.float().pow(2).sum()
    dist.all_reduce(norm_sq, group=group)  # (08: its shard group; each replica holds the same shards)
    norm = norm_sq.sqrt()
    clip_coef = (max_norm / (norm + 1e-6)).clamp(max=1.0).to(grads[0].device if grads else device)
    for g in grads:  # (07: gradients on the host, the norm's all-reduce on the device)
        g.mul_(clip_coef)
    return norm


class UsedParameters:
    """find_unused_parameters, DDP's flag, for 04-06: which parameters some rank's backward reached
    since the last step. mark(p) from p's gradient hook; unused() at the step (one small all-reduce,
    as DDP's, so only on request) gives the others, whose pieces then get no gradient: the optimizer
    skips them (no decay, no moment update), as one process skips a parameter whose .grad is None."""

    def __init__(self, params, device):
        self.index = {p: i for i, p in enumerate(params)}
        self.flags = torch.zeros(len(params), device=device)

    def mark(self, p):
        self.flags[self.index[p]] = 1

    def unused(self):
        dist.all_reduce(self.flags)
        out = {p for p, i in self.index.items() if self.flags[i] == 0}
        self.flags.zero_()
        return out


def master_weights(p):
    """The fp32 values to start p's master weights from, flat: the fp32 initial weights if
    build_model kept them (handed over once: the parameter lets go of them), else p's own."""
    init = p.__dict__.pop("fp32_init", None)
    return (p.detach() if init is None else init).float().reshape(-1)


# ----------------------------------------------------------------------------- optimizer
def learning_rate(args, step):
    """The learning rate of optimizer step `step` (nanoGPT's schedule): a linear warm-up over
    --warmup-steps, then --lr (constant) or a cosine from --lr down to --lr / 10 at the last step."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / (args.warmup_steps + 1)
    if args.lr_schedule == "constant":
        return args.lr
    progress = (step - args.warmup_steps) / max(1, args.steps - 1 - args.warmup_steps)
    return args.lr / 10 + (args.lr - args.lr / 10) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def set_learning_rate(optimizer, args, step):
    """Set every param group's lr for this step; stateless, so a resumed run picks it up as is."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(args, step)


def decay_groups(module, weight_decay):
    """nanoGPT's two param groups: weight decay on every parameter of two or more dimensions
    (matrices, embeddings), none on biases and norms (no reason to pull a gain to 0, or a bias). Over
    the module's parameters, each once, frozen ones too (04 and 05 make them the same on every rank)."""
    params = list({id(p): p for p in module.parameters()}.values())
    decayed = [len(getattr(p, "full_shape", p.shape)) >= 2 for p in params]  # (06's flat shards: their full shape)
    return [{"params": [p for p, d in zip(params, decayed) if d], "weight_decay": weight_decay},
            {"params": [p for p, d in zip(params, decayed) if not d], "weight_decay": 0.0}]


def adamw_kwargs(args):
    # weight decay: per param group (decay_groups), 0 outside them. foreach=True: one multi-tensor
    # kernel per Adam operation, not torch's CPU default, a loop over the tensors: bitwise the same
    # results, a little faster on models of many small tensors (docs/profiling.md).
    return dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=True)


class MixedPrecisionAdamW:
    """AdamW with global-norm clipping and, for bf16 or fp16 parameters, fp32 master weights. Used
    replicated by 01-03. fp32: AdamW runs on the parameters themselves. bf16, fp16: on fp32 copies,
    rounded into the parameters after the step. Moments are fp32: 12 bytes per parameter, as in ZeRO."""
    unscale_in_step = True  # fp16: LossScaler.step calls step(unscale=) (lessonkit/loss_scale.py)

    def __init__(self, params, grad_clip=0.0, **adamw_kwargs):
        groups, _ = param_groups(params)  # parameters, or torch.optim's param groups
        self.params = [p for g in groups for p in g["params"]]
        self.grad_clip, self.cast = grad_clip, False  # cast: master_grads() ran since the last step
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        self.master = [master_weights(p).view_as(p).clone() for p in self.params] if self.mixed else self.params
        master_of = dict(zip(self.params, self.master))
        self.optim = torch.optim.AdamW([{**g, "params": [master_of[p] for p in g["params"]]} for g in groups],
                                       **adamw_kwargs)

    @property
    def param_groups(self):  # the AdamW's, for learning-rate schedules
        return self.optim.param_groups

    def master_grads(self):
        """The fp32 gradients AdamW steps with: every p.grad cast anew into its master's .grad. A loop
        with torch.amp.GradScaler calls it before scaler.unscale_(optimizer); step() casts otherwise."""
        for p, m in zip(self.params, self.master) if self.mixed else ():
            m.grad = None if p.grad is None else p.grad.float()
        self.cast = True
        return [m.grad for m in self.master if m.grad is not None]

    @torch.no_grad()
    def step(self, unscale=None):
        """unscale (fp16: LossScaler.step's) divides the fp32 gradients by the loss scale, before clipping;
        False: an inf or NaN on some rank, so every rank skips the step."""
        grads = [m.grad for m in self.master if m.grad is not None] if self.cast else self.master_grads()
        if unscale is None or unscale(grads):
            if self.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.master, self.grad_clip, foreach=True)
            self.optim.step()
        for p, m in zip(self.params, self.master) if self.mixed else ():
            p.copy_(m)  # (as it was, if skipped); the cast goes, however the loop drops p.grad (a step
            m.grad = None  # GradScaler skips never gets here: its loop's master_grads() casts anew)
        self.cast = False

    def zero_grad(self, set_to_none=True):
        """As torch.optim's: set_to_none (the default) drops every gradient, so AdamW skips a parameter
        that gets none next step; False zeroes them in place (03's bucket views stay views)."""
        for p, m in zip(self.params, self.master):
            p.grad = None if set_to_none or p.grad is None else p.grad.zero_()  # (zero_: the same tensor)
            if m is not p:
                m.grad = None  # p.grad's fp32 cast (master_grads)
        self.cast = False


def checkpoint_shards(optimizer, names):
    """For checkpoint.py, what a MixedPrecisionAdamW holds (01-03): every trainable parameter
    whole, with its master (itself in fp32) and AdamW's state for it. Replicated: rank 0 writes."""
    mine = dist.get_rank() == 0
    return [FlatShard([(names[p], p.numel())], {"param": (0, p), "master": (0, m)},
                      owned=(0, p.numel() if mine else 0), optim=optimizer.optim)
            for p, m in zip(optimizer.params, optimizer.master)]
