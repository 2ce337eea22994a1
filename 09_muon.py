"""Lesson 09: Muon under ZeRO. Each rank owns whole matrices: reduce-scatter -> Muon -> all-gather.

Muon (`torch.optim.Muon`) replaces each weight matrix's momentum by a nearby orthogonal matrix,
a few Newton-Schulz iterations X <- aX + (bA + cA^2) X with A = X X^T, before it steps. A = X X^T
needs every row of the matrix. 04-06 cut flat buffers into N equal shards wherever they fall, so a
shard holds pieces of matrices, and Muon cannot run on a piece (04 and 05 refuse it, torch 06's).

09 keeps 04's step and changes the layout. Every trainable parameter is owned whole by one rank,
and the flat buffer is laid out owner by owner, each owner's chunk padded to the largest. The
reduce-scatter then hands each owner the mean gradient of exactly its matrices, it orthogonalizes
them, and the all-gather brings everyone the new weights. Ownership balances Newton-Schulz's work,
which grows as m n min(m, n) per m x n matrix, not bytes. Bytes are 04's plus the padding. Muon
runs on the hidden layers' matrices and AdamW on embeddings (the tied head), norms and biases, as
Muon is used. Muon's "match_rms_adamw" scaling lets it share AdamW's --lr and --weight-decay.
ZeRO-3 with Muon (--zero3 1): 06's units, each laid out owner by owner, so my shards are whole.

    python 09_muon.py                                        # one process (world size 1)
    torchrun --nproc_per_node=2 09_muon.py                   # 2 ranks on CPU (gloo)
    torchrun --nproc_per_node=4 09_muon.py --device cuda     # 4 GPUs (nccl)
    torchrun --nproc_per_node=3 09_muon.py --zero3 1         # the parameters sharded too

PyTorch: `ZeroRedundancyOptimizer(params, torch.optim.Muon)` owns whole parameters too (by size);
FSDP2 + `torch.optim.Muon` gathers row-sharded matrices inside Newton-Schulz (docs/muon.md).
"""
import functools
import importlib

import torch
import torch.distributed as dist
import torch.nn as nn

from lessonkit import checkpoint, common, ddp, lifecycle, loss_scale, measure, optimizers
from lessonkit.reshard import FlatShard
from lessonkit.theory import STATE_BYTES, owners_theory
from model import get_batch

zero3 = importlib.import_module("06_zero3")  # --zero3 1: 06's units, gathered and freed as there


# ----------------------------------------------------------------------------- who owns what
def muon_groups(module, weight_decay):
    """Muon's groups, as Muon is used: the hidden layers' matrices (use_muon), and AdamW's for the
    rest, nanoGPT's decay groups (optimizers.decay_groups): embeddings, the tied head, norms, biases."""
    params = list({id(p): p for p in module.parameters()}.values())
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    matrices = [p for p in params if p.ndim == 2 and id(p) not in embeddings]
    rest = [p for p in params if p.ndim != 2 or id(p) in embeddings]
    return [{"params": matrices, "use_muon": True, "weight_decay": weight_decay},
            {"params": [p for p in rest if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}]


def newton_schulz_flops(shape, ns_steps=5):
    """The multiply-adds x 2 of Newton-Schulz on an m x n matrix, as torch.optim.Muon runs it (on the
    wide way round, a = min(m, n), b = max(m, n)): per iteration A = X X^T (2 a^2 b), A A (2 a^3)
    and B X (2 a^2 b)."""
    a, b = min(shape), max(shape)
    return ns_steps * (4 * a * a * b + 2 * a ** 3)


def owners(params, muon, world):
    """Each parameter's owner. Matrices first, largest Newton-Schulz cost first, each to the rank
    with the least work so far (a greedy balance, within the largest matrix of even); then the
    rest, largest first, each to the rank with the fewest elements, to keep the padding small.
    Every rank computes the same answer from the same shapes: no communication."""
    # ### BEGIN SOLUTION: owners, balanced by Newton-Schulz work
    # GOAL: owner[p] is a rank for every p in params, computed alike on every rank: the matrices
    #       (in `muon`) costliest first, each to the rank with the least Newton-Schulz work so far
    #       (ties: fewest elements); then the others, largest first, to the rank with fewest elements.
    work, size, owner = [0] * world, [0] * world, {}
    matrices = sorted((p for p in params if p in muon), key=lambda p: -newton_schulz_flops(p.shape))
    for p in matrices + sorted((p for p in params if p not in muon), key=lambda p: -p.numel()):
        r = min(range(world), key=lambda r: (work[r], size[r]) if p in muon else (size[r], work[r]))
        owner[p] = r
        work[r] += newton_schulz_flops(p.shape) if p in muon else 0
        size[r] += p.numel()
    # ### END SOLUTION
    return owner


# ----------------------------------------------------------------------------- the strategy
class ZeROMuon(optimizers.MuonAndAdamW):
    """Shaped like `ZeroRedundancyOptimizer(params, optimizer_class, **defaults)`, used where a loop
    used that (and DDP: 09 reduces itself), sharded by whole parameters: Muon (`muon_defaults`) on
    the groups with `use_muon`, `optimizer_class` (AdamW) on the others, over the ones I own.
    `grad_clip`: global-norm clipping (0: off); `find_unused_parameters` as DDP's. Rank 0's
    parameters are broadcast here. Micro-steps' bf16 gradients add up in fp32, as in 01-04."""
    unscale_in_step = True  # fp16: LossScaler.step calls step(unscale=) (lessonkit/loss_scale.py)

    def __init__(self, params, optimizer_class=torch.optim.AdamW, grad_clip=0.0, find_unused_parameters=False,
                 muon_defaults=None, **defaults):
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError(f"09 needs torch.optim.Muon (PyTorch 2.9 or later); this is torch {torch.__version__}")
        groups, frozen = optimizers.param_groups(params)
        self.params = [p for g in groups for p in g["params"]]
        muon = {p for g in groups if g.get("use_muon") for p in g["params"]}
        if any(p.ndim != 2 for p in muon):
            raise ValueError("use_muon groups hold 2-D matrices only: Muon orthogonalizes matrices")
        self.rank, self.world_size, self.grad_clip, self.muon_params = dist.get_rank(), dist.get_world_size(), grad_clip, muon
        (dtype, device), *others = {(p.dtype, p.device) for p in self.params}  # (list: at least one)
        if others:  # one flat buffer has one dtype (04-05: a bucket each); a cast would be silent
            raise ValueError(f"09 keeps every parameter in one flat buffer: one dtype and device, not {1 + len(others)}")
        self.owner = owners(self.params, muon, self.world_size)

        # The flat buffers, owner by owner: rank r's parameters back to back in chunk r, every chunk
        # padded to the largest, `chunk` elements, so a reduce-scatter's equal shards are the chunks.
        mine = [[p for p in self.params if self.owner[p] == r] for r in range(self.world_size)]
        self.chunk = max(sum(p.numel() for p in ps) for ps in mine)
        self.flat_param = torch.zeros(self.world_size * self.chunk, dtype=dtype, device=device)
        self.flat_grad = torch.zeros_like(self.flat_param)
        self.offset = {}
        with torch.no_grad():
            # ### BEGIN SOLUTION: the flat buffers, owner by owner
            # GOAL: rank r's parameters (mine[r], in order) sit back to back from element r * self.chunk
            #       on: self.offset[p] is p's first element, p's values are copied there, and p.data
            #       and p.grad are views of self.flat_param and self.flat_grad there.
            for r, owned in enumerate(mine):
                at = r * self.chunk
                for p in owned:
                    self.offset[p] = at
                    view = self.flat_param[at:at + p.numel()].view_as(p)
                    view.copy_(p)
                    p.data = view  # the model computes with the flat buffer, as in 04
                    p.grad = self.flat_grad[at:at + p.numel()].view_as(p)
                    at += p.numel()
            # ### END SOLUTION
            self.grad_views = [p.grad for p in self.params]
            dist.broadcast(self.flat_param, src=0)  # rank 0's weights are the truth
            for p in frozen:
                dist.broadcast(p.data, src=0)
        self.param_chunk = self.flat_param[self.rank * self.chunk:(self.rank + 1) * self.chunk]  # mine: whole matrices

        # My parameters' fp32 masters, each a whole tensor of its own shape (in fp32 a second view of
        # the parameter's memory: the optimizers' .grad on it must not replace p.grad, the buffer's view).
        self.masters = {p: self.flat_param[self.offset[p]:self.offset[p] + p.numel()].view_as(p)
                        if dtype == torch.float32 else optimizers.master_weights(p).view_as(p).clone()
                        for p in mine[self.rank]}
        super().__init__([{**g, "params": [self.masters[p] for p in g["params"] if p in self.masters]} for g in groups],
                         optimizer_class, muon_defaults, **defaults)  # Muon and AdamW over my masters
        self.used = optimizers.UsedParameters(self.params, device) if find_unused_parameters else None
        for p in self.params if self.used else ():
            p.register_post_accumulate_grad_hook(self.used.mark)
        self.grad_accumulation = ddp.FP32Accumulation(self.params)

    @torch.no_grad()
    def step(self, closure=None, unscale=None):
        assert closure is None, "closures are not supported"
        for p, view in zip(self.params, self.grad_views):  # what backward made, into the flat buffer (04)
            if p.grad is None:
                view.zero_()
            elif p.grad._base is not self.flat_grad:
                view.copy_(p.grad)
            p.grad = view
        # 1) reduce-scatter, averaged: chunk r is rank r's parameters, so I receive the global
        # batch's gradient of exactly the matrices I own, whole.
        self.flat_grad.div_(self.world_size)
        grad_chunk = torch.empty_like(self.param_chunk)  # (chunk,)
        dist.reduce_scatter_tensor(grad_chunk, self.flat_grad)

        # 2) Muon and AdamW on what I own, in fp32, clipped by the global norm (one scalar all-reduce).
        unused = self.used.unused() if self.used else ()
        grad32 = grad_chunk.float()
        for p, master in self.masters.items():
            at = self.offset[p] - self.rank * self.chunk  # (my chunk's first element: 0 in grad32)
            master.grad = None if p in unused else grad32[at:at + p.numel()].view_as(p)
        if unscale is None or unscale([grad32]):  # fp16: an inf or NaN in any rank's chunk skips everywhere
            if self.grad_clip > 0:
                optimizers.clip_grad_norm_([m.grad for m in self.masters.values() if m.grad is not None],
                                           self.grad_clip, self.flat_param.device)
            super().step()
            for p, master in self.masters.items():
                if master.dtype != p.dtype:
                    p.copy_(master)  # bf16: rounded into my chunk of the flat buffer
        for master in self.masters.values():
            master.grad = None

        # 3) all-gather the chunks: every rank gets every owner's updated matrices.
        dist.all_gather_into_tensor(self.flat_param, self.param_chunk)

    def zero_grad(self, set_to_none=True):
        """As 04's: in place, every p.grad stays a view of the flat buffer."""
        if set_to_none:
            for p in self.params:
                p.grad = None
        else:
            self.flat_grad.zero_()
        self.grad_accumulation.reset()

    def theory(self, args, report, gathered):
        """The formulas of this layout: 2-byte flat buffers in bf16 (4 in fp32), whole, with the fp32
        sum of bf16 micro-steps; fp32 masters of what I own in bf16; a reduce-scatter and an
        all-gather of the padded buffer a step (04's 2 Psi (N-1)/N, padding included)."""
        b, n, padded = STATE_BYTES[args.precision]["params"], self.world_size, self.world_size * self.chunk
        psi = sum(p.numel() for p in self.params)
        grads = b * padded + 4 * psi * (b == 2 and args.grad_accum > 1)  # both flat buffers are whole
        whole = {"params": b * padded, "grads": grads, "peak_grads": grads}
        small = 4 * ((self.grad_clip > 0) + (len(self.params) if self.used else 0))  # clipping's norm, unused flags
        owners_theory(args, report, gathered, self.owner, self.muon_params, newton_schulz_flops, [whole] * n, 4 * (b == 2),
                     ring=(2 * padded * b + 2 * small) * (n - 1) / n, padding=padded - psi)


# ----------------------------------------------------------------------------- ZeRO-3 with Muon
class ZeRO3Owners(zero3.ZeRO3):
    """--zero3 1: 06's ZeRO-3 (`fully_shard`'s place) with each unit laid out owner by owner, as
    ZeROMuon lays out the whole model: my shard of a unit is the whole matrices I own in it, so
    06's reduce-scatter hands me their whole gradients and Muon steps them where they are. The
    cost: each unit's chunks are padded to its largest, and 06 gathers and reduces the padding
    too, 3 K times a step (K micro-steps) where 04's layout sends it twice."""

    def __init__(self, module, units=(), **kwargs):
        super().__init__(module, units, **kwargs)
        for unit in self.units:  # my shards of whole parameters take their shapes (Muon needs 2-D)
            for i, (p, (lo, hi)) in enumerate(zip(unit.params, unit.ranges)):
                if hi > lo:
                    unit.sharded[i] = nn.Parameter(unit.shard[lo:hi].view(p.shape), p.requires_grad)
        self.shard_of = {p: s for u in self.units for p, s in zip(u.params, u.sharded)}

    def _place(self, unit):
        """Before 06 keeps my shard: lay the unit out again, owner by owner (owners(), per unit)."""
        muon = set(muon_groups(self.module, 0.0)[0]["params"]) & set(unit.params)  # (the unit's are in the module now)
        owner = owners(unit.params, muon, self.world_size)
        mine = [[p for p in unit.params if owner[p] == r] for r in range(self.world_size)]
        chunk = max(sum(p.numel() for p in ps) for ps in mine)
        flat, offset = unit.flat_param.new_zeros(self.world_size * chunk), {}
        with torch.no_grad():
            for r, ps in enumerate(mine):
                at = r * chunk
                for p in ps:
                    offset[p] = at
                    flat[at:at + p.numel()].copy_(p.flatten())
                    p.data = flat[at:at + p.numel()].view_as(p)  # (06's version-counter trap: .data)
                    at += p.numel()
        unit.even_padded, unit.owner_of, unit.muon = unit.numel_padded, owner, muon  # (06's: for the report)
        unit.flat_param, unit.offsets = flat, [offset[p] for p in unit.params]
        unit.numel_padded, unit.shard_numel, unit.start = self.world_size * chunk, chunk, self.rank * chunk


class UnitsMuon(optimizers.MuonAndAdamW):
    """--zero3 1's optimizer: Muon and AdamW over my shards (whole), which 06's backward fills with
    their mean gradients; step() unscales (fp16) and clips them first, as ZeROMuon's."""
    unscale_in_step = True

    def __init__(self, model, groups, grad_clip=0.0, **kwargs):
        self.model, self.grad_clip = model, grad_clip
        super().__init__([{**g, "params": [model.shard_of[p] for p in g["params"] if model.shard_of[p].numel()]}
                          for g in groups], **kwargs)

    @torch.no_grad()
    def step(self, closure=None, unscale=None):
        if unscale is None or unscale([p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]):
            if self.grad_clip > 0:
                self.model.clip_grad_norm_(self.grad_clip)  # 06's: one scalar all-reduce
            super().step()

    def theory(self, args, report, gathered):
        """06's layout's formulas, with owners' chunks: my fp32 shards (every unit's chunk) and their
        fp32 gradients (the units where I own one), no separate masters; two all-gathers and a
        reduce-scatter of each padded unit a micro-step (06's 3 K Psi (N-1)/N, padding included)."""
        b, n, units = STATE_BYTES[args.precision]["params"], dist.get_world_size(), self.model.units
        held = [{"params": 4 * sum(u.shard_numel for u in units),
                 "grads": 4 * sum(u.shard_numel for u in units if any(u.owner_of[p] == r for p in u.trainable))}
                for r in range(n)]
        padded, even = (sum(getattr(u, k) for u in units) for k in ("numel_padded", "even_padded"))
        small = 4 * (self.grad_clip > 0)
        owners_theory(args, report, gathered, {p: u.owner_of[p] for u in units for p in u.trainable}, {p for u in units for p in u.muon}, newton_schulz_flops, held, 0,
                     ring=(3 * args.grad_accum * padded * b + 2 * small) * (n - 1) / n,
                     padding=padded - sum(p.numel() for u in units for p in u.params),
                     extra_over_06=3 * args.grad_accum * (padded - even) * b * (n - 1) / n)


# ----------------------------------------------------------------------------- checkpoints
def checkpoint_shards(optimizer, names):
    """For lessonkit/checkpoint.py: every parameter whole (every rank holds and loads it); its
    owner writes it with its fp32 master and its optimizer's state (Muon's momentum or AdamW's)."""
    out = []
    for p in optimizer.params:
        tensors, owned, optim = {"param": (0, p.data)}, (0, 0), None
        if p in optimizer.masters:
            master = optimizer.masters[p]
            tensors["master"], owned, optim = (0, master), (0, p.numel()), optimizer.optimizer_of(master)
        out.append(FlatShard([(names[p], p.numel())], tensors, owned, optim))
    return out


# ----------------------------------------------------------------------------- training
def build(args, env):
    """(module, model, optimizer, holders, checkpoint holder): 04's layout owner by owner, or with
    --zero3 1, 06's units each laid out so (its parameters sharded too)."""
    muon = dict(muon_defaults=dict(lr=args.lr, adjust_lr_fn="match_rms_adamw"),  # Muon's step at AdamW's size:
                **optimizers.adamw_kwargs(args))                                  # both take --lr
    if args.zero3:
        model = zero3.build_model(args, env, ZeRO3Owners)
        optimizer = UnitsMuon(model, muon_groups(model.module, args.weight_decay), args.grad_clip, **muon)
        return model.module, model, optimizer, [model], functools.partial(checkpoint.unit_shards, model, optimizer)
    model = common.build_model(args, env)
    optimizer = ZeROMuon(muon_groups(model, args.weight_decay), torch.optim.AdamW, grad_clip=args.grad_clip, **muon)
    return model, model, optimizer, [], functools.partial(checkpoint_shards, optimizer)


def main(argv=None):
    args = common.parse_args(argv, description=__doc__)
    env = common.init_distributed(args)
    module, model, optimizer, holders, shards = build(args, env)
    scaler = loss_scale.LossScaler(env.device, enabled=args.precision == "fp16", init_scale=args.loss_scale)
    run = measure.Run(args, env, "muon", module, optimizer, holders=holders, loss_scaler=scaler,
                      theory=functools.partial(optimizer.theory, args))
    ckpt = checkpoint.Checkpointer(args, env, run.strategy, module, shards, loss_scaler=scaler)  # --checkpoint-dir
    start = ckpt.resume()  # 0, or with --resume the step the newest checkpoint stopped at

    ### TRAINING SECTION BEGIN
    for step in range(start, args.steps):
        with run.step(step) as losses:
            optimizers.set_learning_rate(optimizer, args, step)  # --lr-schedule, first (as nanoGPT)
            for micro in range(args.grad_accum):
                x, y = get_batch(args, env, step, micro)
                loss = model(x, y) / args.grad_accum
                scaler.scale(loss).backward()  # gradients accumulate locally, in the flat buffer
                losses.append(loss)
            scaler.step(optimizer)  # 1) reduce-scatter  2) Muon and AdamW on what I own  3) all-gather
            scaler.update()
            optimizer.zero_grad(set_to_none=False)
        ckpt.maybe_save(step + 1)  # every --save-every steps (each owner its parameters)
    ### TRAINING SECTION END

    run.finish()
    return run


if __name__ == "__main__":
    lifecycle.run_main(main)
