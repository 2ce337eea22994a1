"""The optimizer side the lessons share: AdamW with fp32 master weights for 01-03
(MixedPrecisionAdamW), clipping across shards and find_unused_parameters (04-08), the
learning-rate schedule, nanoGPT's weight-decay groups and Muon beside AdamW (09). (04's
ShardOptimizer is in shard.py.)
"""
import contextlib
import math

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from lessonkit.reshard import FlatShard


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


def refuse_matrix_optimizer(optimizer_class):
    """04-05 step flat shards, cut wherever the buffer's N-th falls: refuse an optimizer that needs
    whole matrices (torch.optim.Muon orthogonalizes each), before torch fails on a 1-D shard."""
    if "muon" in getattr(optimizer_class, "__name__", "").lower():
        raise ValueError(f"{optimizer_class.__name__} orthogonalizes whole matrices, and a flat shard holds pieces "
                         "of them: use 09_muon.py's ZeROMuon, which gives each rank whole matrices")


class MuonAndAdamW(torch.optim.Optimizer):
    """Muon as it is used (09): torch.optim.Muon over the groups marked `use_muon`, optimizer_class
    (AdamW) over the others, as one optimizer: `param_groups` are both's (a scheduler sets both),
    `state_dict()` both's, `optimizer_of(t)` the one stepping t. The first step's FLOPs, counted
    by FlopCounterMode (the matmuls are Newton-Schulz's), are `flops`: every step does the same."""

    def __init__(self, groups, optimizer_class=torch.optim.AdamW, muon_defaults=None, **defaults):
        split = lambda use: [{k: v for k, v in g.items() if k != "use_muon"}  # noqa: E731
                             for g in groups if bool(g.get("use_muon")) == use]
        self.optims = [cls(gs, **kw) for cls, gs, kw in ((torch.optim.Muon, split(True), muon_defaults or {}),
                                                         (optimizer_class, split(False), defaults))
                       if any(g["params"] for g in gs)]
        super().__init__([p for g in groups for p in g["params"]] or [torch.zeros(0, requires_grad=True)], {})
        self.param_groups = [g for o in self.optims for g in o.param_groups]
        self.flops = None

    @torch.no_grad()
    def step(self, closure=None):
        with FlopCounterMode(display=False) if self.flops is None else contextlib.nullcontext() as counter:
            for optim in self.optims:
                optim.step()
        self.flops = self.flops if counter is None else counter.get_total_flops()

    def optimizer_of(self, tensor):
        return next(o for o in self.optims for g in o.param_groups for p in g["params"] if p is tensor)

    def state_dict(self):
        return [optim.state_dict() for optim in self.optims]

    def load_state_dict(self, state_dict):
        for optim, state in zip(self.optims, state_dict, strict=True):
            optim.load_state_dict(state)


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
