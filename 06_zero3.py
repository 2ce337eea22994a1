"""Lesson 06: ZeRO-3. Shard the parameters too: gather each unit just in time, free it after.

ZeRO-2 (05) still keeps every parameter on every rank; ZeRO-3 (Rajbhandari et al. 2020,
"P_os+g+p"; PyTorch's FSDP) divides them too. The model is cut into units (each block, and a
root unit: embeddings, final norm), each one flat buffer padded to a multiple of N and cut into
N shards. Rank r keeps shard r of every unit; a unit is whole only while it computes:

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
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy  # FSDP2's own (param_dtype, reduce_dtype)

from lessonkit import checkpoint, common, lifecycle, loss_scale, measure, optimizers, schedule
from model import GPT, get_batch, init_parameters


# ----------------------------------------------------------------------------- the strategy
class Unit:
    """Some parameters flattened into one buffer, padded to a multiple of N, cut in N shards.

    shard       (numel_padded / N,)  my slice, in the parameters' own dtype: all I keep at rest,
                                     and the master weights the optimizer updates
    sharded     [nn.Parameter]       per parameter, its elements in my slice (maybe none): views
                                     of `shard`, the parameters ZeRO3.parameters() gives out
    flat_param  (numel_padded,)      the whole unit in param_dtype; alive only while gathered
    params      [nn.Parameter]       the module's parameters, full shape: views of flat_param
    flat_grad   (numel_padded,)      the unit's full gradient in reduce_dtype, until reduce-scattered
    A unit is also its own gradient bucket: its reduce-scatter's shards must line up with its
    parameter shards, so bucket.py's buckets, cut by size across units, do not fit here.
    """

    def __init__(self, index, modules, params, slots, device, rank, world_size):
        self.index, self.modules, self.rank = index, modules, rank  # (07 --chunk-mb: several modules)
        numel = sum(p.numel() for p in params)
        self.numel_padded = math.ceil(numel / world_size) * world_size
        self.shard_numel = self.numel_padded // world_size
        self.start = rank * self.shard_numel  # my slice: [start, start + shard_numel)
        # the whole unit, once, to initialise it: keep_my_shard keeps my slice and frees it
        device = device or params[0].device
        self.flat_param = torch.zeros(self.numel_padded, dtype=params[0].dtype, device=device)  # padding: 0
        self.params, self.offsets, offset = [], [], 0
        for old in params:
            # The version-counter trap: autograd stamps each weight it saves for backward with its
            # tensor's version counter, and gathering a freed unit again is an in-place write. A
            # parameter that is a view of flat_param shares its counter, and backward would fail
            # ("modified by an inplace operation"); assigning `.data` gives p flat_param's memory
            # but a counter of its own. Sound: what we write back is bit for bit what autograd
            # saved. (FSDP2: _unsafe_preserve_version_counter. A new Parameter for every tensor:
            # a meta tensor's .data cannot be made real.)
            p = nn.Parameter(torch.empty(0, dtype=old.dtype, device=device), old.requires_grad)
            p.data = self.flat_param[offset:offset + old.numel()].view(old.shape)
            if not old.is_meta:
                p.data.copy_(old.data)  # a materialised module keeps its values
            for module_, attr in slots[old]:  # everywhere it was: a tied weight is in two places
                setattr(module_, attr, p)
            self.params.append(p)
            self.offsets.append(offset)
            offset += old.numel()
        self.trainable = [p for p in self.params if p.requires_grad]

    def keep_my_shard(self, param_dtype):
        """Keep my slice of the initialised unit; from now on the whole unit exists only while
        gathered, in param_dtype."""
        start = self.start
        self.shard = self.flat_param[start:start + self.shard_numel].clone()
        self.sharded, self.ranges = [], []
        for p, offset in zip(self.params, self.offsets):
            lo, hi = (min(max(x - start, 0), self.shard_numel) for x in (offset, offset + p.numel()))
            shard = nn.Parameter(self.shard[lo:hi], p.requires_grad)
            shard.full_shape = p.shape  # flat, but a matrix's shard: weight decay (optimizers.decay_groups)
            self.sharded.append(shard)
            self.ranges.append((lo, hi))
        self.flat_param.untyped_storage().resize_(0)  # the whole unit: gone until gathered
        if param_dtype not in (None, self.shard.dtype):  # gathered in another dtype than kept
            self.flat_param = torch.empty(self.numel_padded, dtype=param_dtype, device=self.shard.device)
            for p, offset in zip(self.params, self.offsets):
                p.data = self.flat_param[offset:offset + p.numel()].view(p.shape)
            self.flat_param.untyped_storage().resize_(0)
        self.flat_grad = self.grad_shard = self.gather_work = None
        self.reduced = False  # its gradients reduce-scattered in this backward


class ZeRO3(nn.Module):
    """Fully sharded data parallelism, used where a loop used FSDP2's `fully_shard`.

    module         a plain nn.Module; its parameters may be on the meta device (no memory)
    units          submodules gathered, freed and reduced one at a time, listed in the order
                   forward runs them (a rank's data may skip any); forward may also call one
                   twice or in another order, the same on every rank, as FSDP2 requires; every
                   other parameter (a tied one too) is the root's. A unit may be a list of
                   consecutive modules, gathered and reduced together (FSDP2's fully_shard([..]))
    mp_policy      FSDP2's MixedPrecisionPolicy: its param_dtype and reduce_dtype
    param_init_fn  param_init_fn(submodule, prefix) initialises one unit of a meta module in
                   place once its memory exists; prefix is its name ("" for the root)
    prefetch       issue the next unit's all-gather while the current one computes
    device         where a meta module is materialised (default: where its parameters are)
    find_unused_parameters  a parameter no rank's backward reached gets no gradient (the
                   optimizer skips it, as FSDP2 and one process do), known from a small
                   all-reduce per backward (DDP's flag); False: it gets zeros, no all-reduce,
                   for a model whose every parameter is used in every backward (main's GPT)
    shard_group    the ranks each unit is cut over (None: all of them; 08 passes its "node")

    `parameters()` are my shards (flat, under the module's names): build any optimizer over them.
    `loss.backward()` leaves each shard's averaged gradient in its fp32 `.grad`: In bf16, micro-steps'
    gradients add up in fp32, never in bf16. `clip_grad_norm_(max_norm)` clips across all shards.
    """

    def __init__(self, module, units=(), mp_policy=None, param_init_fn=None, prefetch=True, device=None,
                 find_unused_parameters=True, shard_group=None):
        if getattr(mp_policy, "output_dtype", None) is not None:
            raise NotImplementedError("ZeRO3 applies a MixedPrecisionPolicy's param_dtype and reduce_dtype, not output_dtype")
        super().__init__()
        self.module, self.prefetch = module, prefetch
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.shard_group = shard_group  # the collectives on parameters and gradients run over it
        if dist.get_world_size(shard_group) * self._replicas() != self.world_size:  # else a gradient's sum is wrong
            raise ValueError(f"{type(self).__name__}: shards over {dist.get_world_size(shard_group)} ranks x "
                             f"{self._replicas()} replica(s) are not the world's {self.world_size} ranks")
        self.param_dtype = getattr(mp_policy, "param_dtype", None)
        self.reduce_dtype = getattr(mp_policy, "reduce_dtype", None) or self.param_dtype
        slots = {}  # parameter -> every (module, attribute name) holding it
        for m in module.modules():
            for attr, p in m._parameters.items():
                if p is not None:  # (Linear(bias=False) registers its bias as None)
                    slots.setdefault(p, []).append((m, attr))
        prefix = {m: name for name, m in module.named_modules()}
        # a unit (its modules) without parameters has nothing to gather or reduce: it stays plain
        groups = [(ms, list(dict.fromkeys(p for m in ms for p in m.parameters())))
                  for ms in ([u] if isinstance(u, nn.Module) else list(u) for u in units)]
        groups = [(ms, params) for ms, params in groups if params]
        taken = {p for _, params in groups for p in params}
        groups.insert(0, ([module], [p for p in module.parameters() if p not in taken]))  # the root
        if not groups[0][1]:  # the root's hooks drive the schedule, so it needs a parameter
            raise ValueError("ZeRO3: every parameter is in a unit, so the root has none: leave one module out of units")
        self.units = []  # the root is unit 0, then the units in forward order
        shard_rank, shard_size = dist.get_rank(shard_group), dist.get_world_size(shard_group)
        for index, (modules, params) in enumerate(groups):
            unit = Unit(index, modules, params, slots, device, shard_rank, shard_size)
            with torch.no_grad():
                if params[0].is_meta and param_init_fn is not None:
                    for m in modules:
                        param_init_fn(m, prefix[m])  # the values it would get in the whole model
                elif not params[0].is_meta:  # ranks may start from different weights: rank 0's
                    dist.broadcast(unit.flat_param, src=0)
            self._place(unit)  # (07 may place a unit whole on one rank, to measure why not)
            unit.keep_my_shard(self.param_dtype)  # and free the full unit before the next one
            self.units.append(unit)
        self.shard_of = {p: s for u in self.units for p, s in zip(u.params, u.sharded)}
        self.grads_in_flight = []  # (unit, work, grad_shard): reduce-scatters not yet waited for
        # the order forward calls the units in, learned (lessonkit/schedule.py); the unit forward
        # is in, the one backward is in, the ones a recompute gathered
        self.schedule = schedule.Schedule(range(1, len(self.units)))
        self.current = self.open = None
        self.recomputing = set()
        trainable = [p for u in self.units for p in u.trainable]
        self.used = optimizers.UsedParameters(trainable, self.units[0].shard.device) if find_unused_parameters else None
        hook = functools.partial
        for unit in self.units:
            for m in unit.modules:
                m.register_forward_pre_hook(hook(self._pre_forward, unit))
                m.register_forward_hook(hook(self._post_forward, unit))
                if unit.index > 0:  # the root's backward pre-hook is set in _post_forward
                    m.register_full_backward_pre_hook(hook(self._pre_backward, unit))
                    m.register_full_backward_hook(hook(self._post_backward, unit))
            for p, offset in zip(unit.params, unit.offsets):
                if p.requires_grad:  # fires once p.grad is complete (a tied weight's: both uses)
                    p.register_post_accumulate_grad_hook(hook(self._grad_ready, unit, offset))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):
        """My shards, under the names of the module's parameters (a tied weight once)."""
        for name, p in self.module.named_parameters():
            yield name, self.shard_of[p]

    # ------------------------------------------------------------------ gather and free
    def _unshard(self, unit, wait=True):
        """All-gather `unit` into its flat buffer, unless it is there or on its way."""
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

    def _replicas(self):  # each shard's copies, on other ranks (08's replicate group; 06: none)
        return 1

    def _place(self, unit):  # 06 cuts every unit evenly over all ranks (Unit's start, shard_numel)
        pass

    def _gather_input(self, unit, dtype):  # (07 keeps a copy of it on the device instead)
        return unit.shard.to(dtype)  # (fp32: the shard itself)

    def _reshard(self, unit):
        """Free `unit`'s full parameters; my shard stays."""
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

    def _catch_up(self, skipped, then, backward=False):
        """Units in the schedule this rank's data skipped (a block routed around, a backward that
        never reached one) are gathered, freed and, in backward, reduced all the same, as where
        they ran; each prefetches its successor, as it would have. `then`: the unit after them."""
        for index, after in zip(skipped, skipped[1:] + [then]):
            unit = self.units[index]
            self._unshard(unit)
            self._prefetch(after)
            self._reshard(unit)
            if backward:
                self._end_use(unit)

    # ------------------------------------------------------------------ forward: 1) 2) 3)
    def _pre_forward(self, unit, module, args):
        if torch._C._current_graph_task_id() != -1:  # inside backward: a checkpoint's recompute
            if self.open in (None, self.units[0]) and self.schedule.ahead(unit.index):
                self._pre_backward(unit, module, None)  # the unit's backward begins with it
            elif unit.flat_param.untyped_storage().size() == 0:  # a checkpoint around several
                self.recomputing.add(unit)  # units: this one before its backward, an extra gather
            self._unshard(unit)  # (FSDP2 skips its forward hooks here too)
            return
        if unit.index == 0:
            self._start_forward()
        elif unit is self.current:  # the next module of a unit of several
            return
        else:
            self._close_forward()
            self._catch_up(self.schedule.forward(unit.index), then=unit.index)
        self.current = unit
        self._unshard(unit)  # 1) all-gather (or wait for the prefetch issued one unit earlier)
        self._prefetch(self.schedule.next_forward())

    def _start_forward(self):  # (07 starts its uploads here)
        self.schedule.start_forward()
        self.current = None

    def _close_forward(self):  # a unit of several modules whose last one this rank skipped
        if self.current is not None and self.current.index > 0:
            self._reshard(self.current)
            self.current = None

    def _post_forward(self, unit, module, args, output):
        if torch._C._current_graph_task_id() != -1:  # a recompute: free what it gathered
            if unit in self.recomputing and module is unit.modules[-1]:
                self.recomputing.discard(unit)
                self._reshard(unit)
            return
        # 3) free. The root too: its layers run first and last in forward, so it stays gathered
        # through forward, then, like every unit, is gathered again for backward: 3 Psi a step,
        # as in the paper. (FSDP2 keeps its root: a small unit, gathered once.)
        if module is not unit.modules[-1]:  # (a unit of several modules: freed after its last)
            return
        self._reshard(unit)
        if unit.index > 0:
            self.current = None
        else:  # forward is over: a unit of several whose last module was skipped here is freed,
            self._close_forward()  # and the units after the last one run here are gathered too
            self._catch_up(self.schedule.end_forward(), then=None)
            # the root's inputs are token ids, with no gradient to hook: hook its outputs'
            outputs = output if isinstance(output, (tuple, list)) else [output]
            outputs = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda grad: self._pre_backward(unit, module, grad), mode="any")

    # ------------------------------------------------------------------ backward: 4) 5)
    def _pre_backward(self, unit, module, grad_output):
        if unit is self.open:
            return  # the next module of the unit backward is in
        if unit.index == 0:  # backward starts at the root: clean up once it is over
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward_final)
            self.open = unit
        else:
            self._close_backward()
            self._catch_up(self.schedule.backward(unit.index), then=unit.index, backward=True)
            self.open = unit
        self._unshard(unit)  # 4) all-gather again: backward needs the weights forward used
        self._prefetch(self.schedule.next_backward())

    def _post_backward(self, unit, module, grad_input, grad_output):
        # Gradients w.r.t. the unit's inputs exist: this call's backward is over (autograd runs
        # the parameters' gradient hooks first). (If no input needs a gradient, torch calls this
        # *before* the unit's backward: then the next unit's backward, or its end, closes it.)
        if unit is self.open and module is unit.modules[0] and any(g is not None for g in grad_input):
            self._close_backward()

    def _close_backward(self):
        if self.open is not None and self.open.index > 0:
            unit, self.open = self.open, self.units[0]  # back to the root, which stays gathered
            self._reshard(unit)
            self._end_use(unit)

    def _end_use(self, unit):  # one of its calls' backward is over: 5) after the last
        if self.schedule.last_use(unit.index) and unit.trainable:  # the same on every rank
            self._reduce_scatter(unit)

    # ------------------------------------------------------------------ gradients
    @torch.no_grad()
    def _grad_ready(self, unit, offset, p):
        """Post-accumulate-grad hook: p's gradient for this backward is complete."""
        assert not unit.reduced, "a parameter used outside its unit's forward must belong to the root unit"
        if self.used:
            self.used.mark(p)
        if unit.flat_grad is None:  # zeros: padding, frozen parts and unused parameters add 0
            unit.flat_grad = torch.zeros(unit.numel_padded, dtype=self.reduce_dtype or p.grad.dtype,
                                         device=p.grad.device)
        unit.flat_grad[offset:offset + p.numel()].view_as(p.grad).copy_(p.grad)  # (in reduce_dtype)
        p.grad = None  # the full gradient is not kept

    def _reduce_scatter(self, unit):
        self._wait_reduce_scatters()  # the previous unit's: at most two full gradients alive
        if unit.flat_grad is None:  # no gradient reached this unit here: it still takes part
            unit.flat_grad = torch.zeros(unit.numel_padded, dtype=self.reduce_dtype or unit.flat_param.dtype,
                                         device=unit.shard.device)
        # 5) averaged over the global batch: each rank's loss is the mean over its rows, so the
        # global gradient is the SUM over ranks divided by N (divide first, as in 01; N is every
        # rank, also where 08 sums over its shard group here and over the replicas after).
        # ### BEGIN SOLUTION: reduce-scatter a unit's gradient
        # GOAL: start, without blocking, the collective that leaves my shard_numel elements of the
        #       unit's global-batch mean gradient in a new tensor; record (unit, work, grad_shard) in
        #       self.grads_in_flight for the end of backward.
        unit.flat_grad.div_(self.world_size)
        grad_shard = unit.flat_grad.new_empty(unit.shard_numel)  # (numel_padded / N,)
        work = dist.reduce_scatter_tensor(grad_shard, unit.flat_grad, group=self.shard_group, async_op=True)
        self.grads_in_flight.append((unit, work, grad_shard))
        # ### END SOLUTION
        unit.reduced = True

    def _wait_reduce_scatters(self):
        for unit, work, grad_shard in self.grads_in_flight:
            work.wait()
            unit.grad_shard, unit.flat_grad = grad_shard, None  # 5) free the full gradient
        self.grads_in_flight = []

    @torch.no_grad()
    def _post_backward_final(self):
        """Queued with the autograd engine: runs once backward is over, inside loss.backward()."""
        self._close_backward()
        self._catch_up(self.schedule.end_backward(), then=None, backward=True)  # entries it never reached here
        root, self.open = self.units[0], None
        self._reshard(root)
        if root.trainable:
            self._reduce_scatter(root)  # the root's last: its embedding's gradient comes last
        self._wait_reduce_scatters()
        unused = self.used.unused() if self.used else ()
        for unit in self.units:
            if unit.grad_shard is not None:  # into my shards' .grad, in their dtype (fp32):
                grad = self._reduced_grad(unit)  # micro-steps add up there, not in 2 bytes
                for p, shard, (lo, hi) in zip(unit.params, unit.sharded, unit.ranges):
                    if p.requires_grad and hi > lo and p not in unused:  # (nothing to step: no grad)
                        shard.grad = grad[lo:hi] if shard.grad is None else shard.grad.add_(grad[lo:hi])
                unit.grad_shard = None
            unit.reduced = False

    def _reduced_grad(self, unit):  # (07: on its way to the host)
        return unit.grad_shard.to(unit.shard.dtype)

    # ------------------------------------------------------------------ around the optimizer
    def clip_grad_norm_(self, max_norm):
        """Global-norm clipping over every rank's gradient shards; returns the total norm."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        return optimizers.clip_grad_norm_(grads, max_norm, self.units[0].shard.device, self.shard_group)


# ----------------------------------------------------------------------------- training
def build_model(args, env, strategy=None, pack=list, **kwargs):
    """The GPT of `args` under ZeRO-3 (`strategy`: ZeRO3, or 07's subclass, with its `kwargs`;
    `pack(blocks)`: the units, a block each, or 07's chunks), built on the meta device and
    materialised, initialised and sharded one unit at a time: its weights equal GPT(cfg, seed)'s,
    yet no rank ever held them."""
    with torch.device("meta"):  # shapes only: not one byte of parameters yet
        gpt = GPT(common.model_config(args), seed=None)  # fp32: the shards are the master weights

    def init_unit(module, prefix):  # ZeRO3 calls it for one unit at a time, memory in place
        if module is gpt:  # the root unit: GPT's own layers (lm_head.weight *is* wte.weight)
            for name in ("wte", "wpe", "ln_f"):
                init_parameters(getattr(gpt, name), args.seed, args.n_layer, prefix=name)
        else:  # a block gets the values it gets in GPT(cfg, seed): its generators are by name
            init_parameters(module, args.seed, args.n_layer, prefix=prefix)

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
    # fp16: dynamic loss scaling, ShardedGradScaler's calls (lessonkit/loss_scale.py); other precisions: the identity
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
