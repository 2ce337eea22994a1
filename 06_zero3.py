"""Lesson 06: ZeRO-3. Shard the parameters too: gather each unit just in time, free it after.

ZeRO-2 (05) keeps every parameter on every rank; ZeRO-3 ("P_os+g+p": the parameters too; PyTorch's FSDP) divides
them too. The model is cut into units (each block, and a root: embeddings, final norm), each one
flat buffer cut into N shards (lessonkit/flat_units.py). Rank r keeps shard r of every unit;
the whole unit, which the module's parameters view, exists only while it computes:

    # 1) all-gather unit i           (issued one unit early: the prefetch, --prefetch 1)
    # 2) forward unit i
    # 3) free unit i's full parameters (keep my shard)
    # 4) all-gather unit i again for its backward (prefetched the same way, in reverse order)
    # 5) reduce-scatter unit i's gradients once its backward is over; free them
    # 6) the optimizer on my shards (nothing to all-gather after it: the next forward gathers)

Each step sends 3 Psi (N-1)/N elements per rank, 1.5x what 01-05 send. Every rank issues the
same collectives in the same order, whatever its data did (lessonkit/schedule.py).

    python 06_zero3.py                                       # one process (world size 1)
    torchrun --nproc_per_node=2 06_zero3.py                  # 2 ranks on CPU (gloo)
    torchrun --nproc_per_node=2 06_zero3.py --prefetch 0     # no prefetch: measure what it buys
    torchrun --nproc_per_node=4 06_zero3.py --device cuda    # 4 GPUs (nccl)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:29500 06_zero3.py         # 2 nodes, run on each

PyTorch: FSDP2 `fully_shard(block)` for each block, then `fully_shard(model)`; DeepSpeed: stage 3.
"""
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy  # FSDP2's own (param_dtype, reduce_dtype)

from lessonkit import checkpoint, common, ddp, flat_units, lifecycle, loss_scale, measure, optimizers
from lessonkit.schedule import UnitHooks
from model import get_batch


# ----------------------------------------------------------------------------- the strategy
class ZeRO3(UnitHooks, ddp.GradientSync, nn.Module):
    """Fully sharded data parallelism, used where a loop used FSDP2's `fully_shard`: `module`
    (maybe on the meta device, initialised a unit at a time by `param_init_fn(submodule, prefix)`,
    on `device`), `units` (submodules or lists of them, in forward's order, each gathered, freed
    and reduced as one; the rest is the root's), FSDP2's MixedPrecisionPolicy, `prefetch` (the
    next unit's all-gather while this one computes), `shard_group` (08: a node's ranks), and
    DDP's `find_unused_parameters` (a parameter no rank's backward reached gets no gradient).
    `parameters()` are my shards, flat, under the module's names: build any optimizer over them;
    `loss.backward()` leaves each shard's averaged gradient in its fp32 `.grad`.
    """

    def __init__(self, module, units=(), mp_policy=None, param_init_fn=None, prefetch=True, device=None,
                 find_unused_parameters=True, shard_group=None):
        super().__init__()
        self.param_dtype, self.reduce_dtype = flat_units.policy_dtypes(mp_policy)  # (refused first)
        self.module, self.prefetch = module, prefetch
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.shard_group = shard_group  # the collectives on parameters and gradients run over it
        # the root (unit 0: every parameter in no unit) and the units, in forward order, each built,
        # initialised and cut in turn, so a meta module never exists whole (lessonkit/flat_units.py)
        self.units = flat_units.shard_units(module, units, self.param_dtype, param_init_fn, device,
                                            shard_group, self._replicas(), place=self._place)
        self.shard_of = {p: s for u in self.units for p, s in zip(u.params, u.sharded)}
        self.grads_in_flight = []  # (unit, work, grad_shard): reduce-scatters not yet waited for
        trainable = [p for u in self.units for p in u.trainable]
        self.used = optimizers.UsedParameters(trainable, self.units[0].shard.device) if find_unused_parameters else None
        self.register_hooks()  # each unit's module hooks, in forward's order (lessonkit/schedule.py)
        for unit in self.units:
            for p, offset in zip(unit.params, unit.offsets):
                if p.requires_grad:  # fires once p.grad is complete (a tied weight's: both uses)
                    p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, unit, offset))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):
        """My shards, under the names of the module's parameters (a tied weight once)."""
        for name, p in self.module.named_parameters():
            yield name, self.shard_of[p]

    # ------------------------------------------------------------------ gather and free
    # UnitHooks (lessonkit/schedule.py) calls these at each unit's time: _unshard before its forward
    # and again before its backward, each prefetching the next unit, _reshard after each, and
    # _reduce_scatter after its last use in backward. The root unit too: its layers run first and
    # last in forward, so it stays gathered through forward and is gathered again for backward:
    # 3 Psi a step, as in the paper. (FSDP2 keeps its root, a small unit, gathered once.)
    def _unshard(self, unit, wait=True):
        """1) and 4): all-gather `unit` into its flat buffer, unless it is there or on its way."""
        flat_param = unit.flat_param
        # ### BEGIN SOLUTION: gather a unit
        # GOAL: a freed flat_param gets its full memory back and starts filling, without blocking,
        #       with every rank's shard in flat_param's dtype (pending work: unit.gather_work). With
        #       `wait` set, flat_param is complete when this returns and nothing is pending.
        if flat_param.untyped_storage().size() == 0:
            flat_param.untyped_storage().resize_(flat_param.numel() * flat_param.element_size())
            my_shard = self._gather_input(unit, flat_param.dtype)  # my shard in param_dtype
            unit.gather_work = dist.all_gather_into_tensor(flat_param, my_shard, group=self.shard_group, async_op=True)
        if wait and unit.gather_work is not None:
            unit.gather_work.wait()
            unit.gather_work = None
        # ### END SOLUTION

    def _reshard(self, unit):
        """3) and after 4): free `unit`'s full parameters; my shard stays."""
        # ### BEGIN SOLUTION: free a unit
        # GOAL: afterwards unit.flat_param's memory is released (its storage, not just this tensor),
        #       and never while a collective may still be writing into it.
        if unit.gather_work is not None:  # never free memory a collective is writing into
            unit.gather_work.wait()
            unit.gather_work = None
        unit.flat_param.untyped_storage().resize_(0)
        # ### END SOLUTION

    def _prefetch(self, index):  # the schedule's next unit (None: nothing left)
        if self.prefetch and index is not None:
            self._unshard(self.units[index], wait=False)  # overlaps with the current unit

    # ------------------------------------------------------------------ gradients
    @torch.no_grad()
    def _grad_ready(self, unit, offset, p):
        """Post-accumulate-grad hook: p's gradient for this backward is complete."""
        assert not unit.reduced, "a parameter used outside its unit's forward must belong to the root unit"
        if self.used:
            self.used.mark(p)
        unit.add_grad(offset, p.grad, self.reduce_dtype, self.require_backward_grad_sync)  # (in reduce_dtype)
        p.grad = None  # the full gradient is not kept

    def _reduce_scatter(self, unit):
        """5) once the unit's backward is over, for its last call (a unit called twice: after both)."""
        if not self.require_backward_grad_sync:  # its whole gradient stays, for the next backward's sum
            return
        self._wait_reduce_scatters()  # the previous unit's: at most two full gradients alive
        unit.grad_to_reduce(self.reduce_dtype or unit.flat_param.dtype)
        # 5) the global-batch mean: divide by N, every rank (08 sums over the replicas after), then SUM
        # ### BEGIN SOLUTION: reduce-scatter a unit's gradient
        # GOAL: start, without blocking, the collective that leaves my shard_numel elements of the
        #       unit's global-batch mean gradient in a new tensor; record (unit, work, grad_shard) in
        #       self.grads_in_flight for the end of backward.
        unit.flat_grad.div_(self.world_size)
        grad_shard = unit.flat_grad.new_empty(unit.shard_numel)  # (numel_padded / N,)
        work = dist.reduce_scatter_tensor(grad_shard, unit.flat_grad, group=self.shard_group, async_op=True)
        self.grads_in_flight.append((unit, work, grad_shard))
        # ### END SOLUTION

    def _wait_reduce_scatters(self):
        for unit, work, grad_shard in self.grads_in_flight:
            work.wait()
            unit.grad_shard, unit.flat_grad = grad_shard, None  # 5) free the full gradient
        self.grads_in_flight = []

    @torch.no_grad()
    def _backward_over(self):
        """Backward is over (UnitHooks queued the call, as 02 does): the root's turn, then .grad."""
        root = self.units[0]
        self._reshard(root)
        if root.trainable:
            self._reduce_scatter(root)  # the root's last: its embedding's gradient comes last
        self._wait_reduce_scatters()
        unused = self.used.unused() if self.used and any(u.grad_shard is not None for u in self.units) else ()  # (kept sums: marks stay)
        for unit in self.units:
            if unit.grad_shard is not None:  # In bf16, micro-steps' gradients add up in fp32, never in bf16:
                unit.add_to_shards_grad(self._reduced_grad(unit), unused)  # in my shards' fp32 .grad
                unit.grad_shard = None
            unit.reduced = False

    # ------------------------------------------------------------------ around the optimizer
    def clip_grad_norm_(self, max_norm):
        """Global-norm clipping over every rank's gradient shards; returns the total norm."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        return optimizers.clip_grad_norm_(grads, max_norm, self.units[0].shard.device, self.shard_group)


# ----------------------------------------------------------------------------- training
def build_model(args, env, strategy=None, pack=list, **kwargs):
    """The GPT of `args` under `strategy` (ZeRO3, 07's or 08's, with its `kwargs`), a unit per block
    (`pack`: 07's chunks): built unit by unit, its weights GPT(cfg, seed)'s, yet never whole."""
    gpt, init_unit = flat_units.meta_gpt(common.model_config(args), args.seed, args.init_from)  # shapes only, yet
    # --precision bf16 or fp16: gather, compute and reduce-scatter in it (the ZeRO paper's 2 bytes)
    policy = MixedPrecisionPolicy(param_dtype=common.working_dtype(args))
    return (strategy or ZeRO3)(gpt, units=pack(gpt.blocks), mp_policy=policy, param_init_fn=init_unit,
                               prefetch=bool(args.prefetch), device=env.device,
                               find_unused_parameters=False, **kwargs)  # the GPT uses every parameter


def main(argv=None):
    args = common.parse_args(argv, description=__doc__)
    env = common.init_distributed(args)
    model = build_model(args, env)
    # any optimizer, over my shards, as over FSDP2's (weight decay: the matrices' shards only)
    optimizer = torch.optim.AdamW(optimizers.decay_groups(model, args.weight_decay), **optimizers.adamw_kwargs(args))
    scaler = loss_scale.LossScaler(env.device, enabled=args.precision == "fp16", init_scale=args.loss_scale)
    run = measure.Run(args, env, "zero3", model.module, optimizer, holders=[model], loss_scaler=scaler)
    ckpt = checkpoint.Checkpointer(args, env, run.strategy, model.module,  # --checkpoint-dir
                                   functools.partial(checkpoint.unit_shards, model, optimizer), loss_scaler=scaler)
    start = ckpt.resume()  # 0, or with --resume the step the newest checkpoint stopped at

    ### TRAINING SECTION BEGIN
    for step in range(start, args.steps):
        with run.step(step) as losses:
            optimizers.set_learning_rate(optimizer, args, step)  # --lr-schedule, first (as nanoGPT)
            for micro in range(args.grad_accum):
                model.set_requires_gradient_sync(args.reduce_every == "micro" or micro == args.grad_accum - 1)  # step: 5) at the last
                x, y = get_batch(args, env, step, micro)
                loss = model(x, y) / args.grad_accum  # 1) gather 2) forward 3) free, unit by unit
                scaler.scale(loss).backward()  # 4) gather again 5) reduce-scatter into my shards' .grad, unit by unit
                losses.append(loss)
            scaler.unscale_(optimizer)  # fp16: my shards' fp32 .grad / S before clipping; found-inf from every rank
            if args.grad_clip > 0:
                model.clip_grad_norm_(args.grad_clip)  # one scalar all-reduce
            scaler.step(optimizer)  # 6) AdamW on my shards (fp16: skipped on every rank if some rank found an inf)
            scaler.update()
            optimizer.zero_grad()
        ckpt.maybe_save(step + 1)  # every --save-every steps (each rank its shard)
    ### TRAINING SECTION END

    run.finish()
    return run


if __name__ == "__main__":
    lifecycle.run_main(main)
