"""Lesson 09: Muon under ZeRO. Each rank owns whole matrices: reduce-scatter -> Muon -> all-gather.

Muon (`torch.optim.Muon`) replaces each weight matrix's momentum by a nearby orthogonal matrix,
a few Newton-Schulz iterations X <- aX + (bA + cA^2) X with A = X X^T, before it steps. A = X X^T
needs every row of the matrix. 04-06 cut one flat buffer into N equal shards wherever it falls, so
a shard holds pieces of matrices, and Muon cannot run on a piece (04-06 refuse it for that reason).

09 keeps 04's step and changes the layout. Every trainable parameter is owned whole by one rank,
and the flat buffer is laid out owner by owner, each owner's chunk padded to the largest. The
reduce-scatter then hands each owner the mean gradient of exactly its matrices, it orthogonalizes
them, and the all-gather brings everyone the new weights. Ownership balances Newton-Schulz's work,
which grows as m n min(m, n) per m x n matrix, not bytes. Bytes are 04's plus the padding. Muon
runs on the hidden layers' matrices and AdamW on embeddings (the tied head), norms and biases, as
Muon is used. Muon's "match_rms_adamw" scaling lets it share AdamW's --lr and --weight-decay.

    python 09_muon.py                                        # one process (world size 1)
    torchrun --nproc_per_node=2 09_muon.py                   # 2 ranks on CPU (gloo)
    torchrun --nproc_per_node=4 09_muon.py --precision bf16  # 4 ranks, bf16
    torchrun --nproc_per_node=4 09_muon.py --device cuda     # 4 GPUs (nccl)

PyTorch: `ZeroRedundancyOptimizer(params, torch.optim.Muon)` also owns whole parameters (balanced
by size) but leaves the gradients to DDP's all-reduce; FSDP2 + `torch.optim.Muon` gathers each
row-sharded matrix inside Newton-Schulz (docs/muon.md: how each compares with one process).
"""
import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from lessonkit import checkpoint, common, ddp, lifecycle, loss_scale, measure, optimizers
from lessonkit.reshard import FlatShard
from model import get_batch


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
class ZeROMuon(torch.optim.Optimizer):
    """A torch.optim.Optimizer shaped like `ZeroRedundancyOptimizer(params, ...)`, used where a loop
    used that (and DDP: 09 reduces itself). It shards by whole parameters: Muon on the groups with
    `use_muon`, `optimizer_class` on the others, each over the parameters I own.

    params          parameters or param groups (muon_groups); a group's options override the defaults
    optimizer_class the others' optimizer: AdamW (as Muon is used), or any torch.optim optimizer
    grad_clip       global-norm gradient clipping across all owners; 0 turns it off
    find_unused_parameters  as DDP's (04's docstring)
    muon_defaults   torch.optim.Muon's arguments (lr, momentum, adjust_lr_fn, ...)
    **defaults      optimizer_class's

    `param_groups` are the inner optimizers' (an lr scheduler schedules both). Rank 0's parameters
    are broadcast here. Call `step()` once per optimizer step, then `zero_grad()`. Micro-steps'
    bf16 (fp16) gradients add up in fp32 (ddp.FP32Accumulation), as in 01-04.
    """
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
        dtype, device = self.params[0].dtype, self.params[0].device
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
        start = self.rank * self.chunk
        self.param_chunk = self.flat_param[start:start + self.chunk]  # my chunk: whole matrices

        # My parameters' fp32 masters, each a whole tensor of its own shape (in fp32 a second view of
        # the parameter's memory: the optimizers' .grad on it must not replace p.grad, the buffer's view).
        self.masters = {p: self.flat_param[self.offset[p]:self.offset[p] + p.numel()].view_as(p)
                        if dtype == torch.float32 else optimizers.master_weights(p).view_as(p).clone()
                        for p in mine[self.rank]}
        inner = lambda use_muon: [{**{k: v for k, v in g.items() if k != "use_muon"},  # noqa: E731
                                   "params": [self.masters[p] for p in g["params"] if p in self.masters]}
                                  for g in groups if bool(g.get("use_muon")) == use_muon]
        muon_groups_, other_groups = inner(True), inner(False)
        self.muon = (torch.optim.Muon(muon_groups_, **(muon_defaults or {}))
                     if any(g["params"] for g in muon_groups_) else None)
        self.other = optimizer_class(other_groups, **defaults) if any(g["params"] for g in other_groups) else None
        self.optims = [o for o in (self.muon, self.other) if o is not None]
        super().__init__(list(self.masters.values()) or [torch.zeros(0, requires_grad=True)], {})
        self.param_groups = [g for o in self.optims for g in o.param_groups]  # what a scheduler sets steps
        self.used = optimizers.UsedParameters(self.params, device) if find_unused_parameters else None
        for p in self.params if self.used else ():
            p.register_post_accumulate_grad_hook(self.used.mark)
        self.grad_accumulation = ddp.FP32Accumulation(self.params)
        self.flops = None  # my optimizer step's FLOPs, counted by FlopCounterMode: Newton-Schulz's matmuls

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
        start = self.rank * self.chunk
        grad32 = grad_chunk.float()
        for p, master in self.masters.items():
            at = self.offset[p] - start
            master.grad = None if p in unused else grad32[at:at + p.numel()].view_as(p)
        if unscale is None or unscale([grad32]):  # fp16: an inf or NaN in any rank's chunk skips everywhere
            if self.grad_clip > 0:
                optimizers.clip_grad_norm_([m.grad for m in self.masters.values() if m.grad is not None],
                                           self.grad_clip, self.flat_param.device)
            # my Newton-Schulz work is the same every step (the shapes I own): counted in the first only
            with FlopCounterMode(display=False) if self.flops is None else contextlib.nullcontext() as counter:
                for optim in self.optims:
                    optim.step()
            self.flops = self.flops if counter is None else counter.get_total_flops()
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

    def state_dict(self):
        return [optim.state_dict() for optim in self.optims]  # my parameters' state: Muon's, AdamW's

    def load_state_dict(self, state_dict):
        for optim, state in zip(self.optims, state_dict, strict=True):
            optim.load_state_dict(state)

    def theory(self, args, report, gathered):
        """Into rank 0's report (measure.Run's): per rank, the bytes held (with AdamW beside Muon, as
        main() runs it), the elements owned and Newton-Schulz's FLOPs by formula beside what was
        measured; the ring bytes sent per step."""
        precision, n, padded = args.precision, self.world_size, self.world_size * self.chunk
        b, fp32_sum = (4, 0) if precision == "fp32" else (2, 4 * (args.grad_accum > 1))  # micro-steps' fp32 sum
        psi = sum(p.numel() for p in self.params)
        owners = []
        for r, measured in enumerate(gathered):
            ps = [p for p in self.params if self.owner[p] == r]
            adam = [p for p in ps if p not in self.muon_params]
            n_all, n_adam = sum(p.numel() for p in ps), sum(p.numel() for p in adam)
            owners.append({"params": b * padded, "grads": b * padded + fp32_sum * psi,  # both flat buffers, whole
                           # Muon's momentum (4 bytes), AdamW's two moments (8) and step count (4 per
                           # tensor), fp32 masters outside fp32 (4)
                           "optimizer": 4 * (n_all - n_adam) + 8 * n_adam + 4 * len(adam) + 4 * n_all * (precision != "fp32"),
                           "owned": n_all, "flops": sum(newton_schulz_flops(p.shape) for p in ps if p in self.muon_params),
                           "measured_optimizer": measured["memory"]["optimizer"], "measured_flops": measured["optimizer_flops"]})
        mine = owners[0]
        report["memory"]["theory"].update({k: mine[k] for k in ("params", "grads", "optimizer")}, peak_grads=mine["grads"],
                                          held_grads=mine["grads"] if args.grad_accum > 1 else None,
                                          master_weights=4 * mine["owned"] * (precision != "fp32"),
                                          total=mine["params"] + mine["grads"] + mine["optimizer"])
        # a reduce-scatter and an all-gather of the padded buffer (04's 2 Psi (N-1)/N, padding included),
        # clipping's squared norm and find_unused_parameters' flags all-reduced (an all-reduce: 2 (N-1)/N)
        small = 4 * ((self.grad_clip > 0) + (len(self.params) if self.used else 0))
        report["comm"]["theory_ring_bytes_per_step"] = (2 * padded * b + 2 * small) * (n - 1) / n
        report["owners"], report["padding"] = owners, padded - psi


# ----------------------------------------------------------------------------- checkpoints
def checkpoint_shards(optimizer, names):
    """For lessonkit/checkpoint.py: every parameter whole (every rank holds and loads it); its
    owner writes it with its fp32 master and its optimizer's state (Muon's momentum or AdamW's)."""
    optim_of = {id(m): o for o in optimizer.optims for g in o.param_groups for m in g["params"]}
    out = []
    for p in optimizer.params:
        tensors, owned, optim = {"param": (0, p.data)}, (0, 0), None
        if p in optimizer.masters:
            master = optimizer.masters[p]
            tensors["master"], owned, optim = (0, master), (0, p.numel()), optim_of[id(master)]
        out.append(FlatShard([(names[p], p.numel())], tensors, owned, optim))
    return out


# ----------------------------------------------------------------------------- training
def main(argv=None):
    args = common.parse_args(argv, description=__doc__)
    env = common.init_distributed(args)
    model = common.build_model(args, env)
    optimizer = ZeROMuon(muon_groups(model, args.weight_decay), torch.optim.AdamW, grad_clip=args.grad_clip,
                         # match_rms_adamw: Muon's step scaled to AdamW's size, so both take --lr
                         muon_defaults=dict(lr=args.lr, adjust_lr_fn="match_rms_adamw"), **optimizers.adamw_kwargs(args))
    scaler = loss_scale.LossScaler(env.device, enabled=args.precision == "fp16", init_scale=args.loss_scale)
    run = measure.Run(args, env, "muon", model, optimizer, loss_scaler=scaler,
                      theory=functools.partial(optimizer.theory, args))
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
