"""Lesson 06: ZeRO-3. Shard the parameters too: gather each unit just in time, free it after.

ZeRO-2 (05) still keeps every parameter on every rank: 2 Psi bytes in bf16, the one model state
it does not divide by N. ZeRO-3 (Rajbhandari et al. 2020, "P_os+g+p", PyTorch's FSDP) divides
it too. The model is cut into units (here each transformer block, plus a root unit holding the
tied embedding/output head, the position embedding and the final norm); each unit's parameters
are flattened into one buffer, padded to a multiple of N and split into N shards. At rest rank r
holds shard r of every unit and nothing else: its parameters, gradients and optimizer state are
all Psi / N. A unit's full parameters exist only while it computes:

    # 1) all-gather unit i           (issued one unit early: the prefetch, --prefetch 1)
    # 2) forward unit i
    # 3) free unit i's full parameters (keep my shard)
    # 4) all-gather unit i again for its backward (prefetched the same way, in reverse order)
    # 5) reduce-scatter unit i's gradients as soon as they are complete; free them
    # 6) AdamW on my shard (nothing to all-gather after it: the next forward gathers)

Each step gathers every parameter twice and reduce-scatters every gradient once: 3 Psi (N-1)/N
elements sent per rank, 1.5x what 01-05 send, for memory that shrinks with every rank added.
During the step a rank also holds the root (its layers run first and last, so it stays gathered
through each pass), the unit computing and, with prefetch, the next one.
Gradient accumulation cannot save communication here: no rank holds a unit's full parameters or
gradient between micro-steps, so every micro-step gathers and reduce-scatters (adding into my
grad shard): K micro-steps send 3 K Psi (N-1)/N.

    python 06_zero3.py                                       # one process (world size 1)
    torchrun --nproc_per_node=2 06_zero3.py                  # 2 ranks on CPU (gloo)
    torchrun --nproc_per_node=2 06_zero3.py --prefetch 0     # no prefetch: measure what it buys
    torchrun --nproc_per_node=2 06_zero3.py --precision bf16 # the ZeRO paper's accounting
    torchrun --nproc_per_node=4 06_zero3.py --device cuda    # 4 GPUs (nccl)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:29500 06_zero3.py         # 2 nodes, run on each

PyTorch: FSDP2 `fully_shard(block)` for each block, then `fully_shard(model)`, with
reshard_after_forward=True (FSDP1: ShardingStrategy.FULL_SHARD); DeepSpeed: ZeRO stage 3.
"""
import functools
import math

import torch
import torch.distributed as dist
import torch.nn as nn

import checkpoint
import common
import measure
from model import GPT, init_parameters


# ----------------------------------------------------------------------------- the strategy
class Unit:
    """Some parameters flattened into one buffer, padded to a multiple of N, cut in N shards.

    flat_param    (numel_padded,)      the whole unit, working precision; alive only while gathered
    param_shard   (numel_padded / N,)  my slice of it, working precision; always alive
    master_shard  (k,) fp32            AdamW's weights: the trainable part of my slice (k <= shard)
    grad_shard    (numel_padded / N,)  my slice of the averaged gradient, from backward to step()
    flat_grad     (numel_padded,)      the unit's full gradient, only until it is reduce-scattered
    A unit is also its own gradient bucket: its reduce-scatter's shards must line up with its
    parameter shards, so bucket.py's buckets, cut by size across units, do not fit here.
    """

    def __init__(self, index, module, params, slots, device, rank, world_size):
        self.index, self.module = index, module
        # Trainable parameters first, frozen ones last: the trainable part of any shard is then a
        # prefix of it, so AdamW gets one tensor per unit and never sees a frozen weight.
        params = [p for p in params if p.requires_grad] + [p for p in params if not p.requires_grad]
        self.dtype, device = params[0].dtype, device or params[0].device
        numel = sum(p.numel() for p in params)
        self.numel_padded = math.ceil(numel / world_size) * world_size
        # A meta module is initialised in fp32 and cast after (keep_my_shard), so that bf16's
        # master weights start from the fp32 initial weights, as common.build_model's do.
        dtype = torch.float32 if params[0].is_meta else self.dtype
        self.flat_param = torch.zeros(self.numel_padded, dtype=dtype, device=device)  # padding: 0
        self.sources = params  # where a materialised module's fp32 initial weights may be
        self.params, self.offsets, self.replaced, offset = [], [], {}, 0
        for old in params:
            # NOTE (the version-counter trap). Autograd saves the weights a backward needs and
            # stamps each with its tensor's version counter, which every in-place write bumps. We
            # free the buffer after forward and all-gather it again before backward: an in-place
            # write. Were the parameter a view of flat_param (nn.Parameter(view) is one) it would
            # share flat_param's counter, and backward would fail: "modified by an inplace
            # operation". Assigning `.data` instead gives the parameter flat_param's memory but
            # its own counter, so the collectives write through flat_param and leave the
            # parameter's counter alone. That is sound, not a trick: what we write back is bit
            # for bit what autograd saved (the same shards; the optimizer changes them only after
            # backward). FSDP2 tells autograd the same with _unsafe_preserve_version_counter.
            # (A new Parameter for every tensor, as a meta tensor's .data cannot be made real.)
            p = nn.Parameter(torch.empty(0, dtype=dtype, device=device), old.requires_grad)
            p.data = self.flat_param[offset:offset + old.numel()].view(old.shape)
            if not old.is_meta:
                p.data.copy_(old.data)  # a materialised module keeps its values
            for module_, attr in slots[old]:  # everywhere it was: a tied weight is in two places
                setattr(module_, attr, p)
            self.params.append(p)
            self.replaced[old] = p
            self.offsets.append(offset)
            offset += old.numel()
        self.trainable = [p for p in self.params if p.requires_grad]
        self.n_trainable = sum(p.numel() for p in self.trainable)
        self.shard_numel, self.rank = self.numel_padded // world_size, rank

    def keep_my_shard(self):
        start = self.rank * self.shard_numel
        k = min(max(self.n_trainable - start, 0), self.shard_numel)  # my trainable elements
        # fp32 master weights for them: in bf16 mode a copy of the fp32 initial weights (from a
        # meta module initialised in fp32, then cast to bf16 here; or common.master_weights);
        # in fp32 mode my shard itself, so nothing is duplicated.
        if self.flat_param.dtype != self.dtype:
            master = self.flat_param[start:start + k].clone()
            working = self.flat_param.to(self.dtype)
            for p, offset in zip(self.params, self.offsets):
                p.data = working[offset:offset + p.numel()].view(p.shape)
            self.flat_param = working
        elif self.dtype != torch.float32:
            master = common.master_shard(self.sources, start, k)
        self.param_shard = self.flat_param[start:start + self.shard_numel].clone()
        if self.dtype == torch.float32:
            master = self.param_shard[:k]
        self.master_shard = master if k else None
        self.sources = None
        # what the optimizer steps: one view of my master shard per parameter, as in 04
        self.pieces = common.shard_pieces(self.trainable, start, master) if k else []
        self.grad_shard = self.flat_grad = self.gather_work = None
        self.pending, self.reduced = len(self.trainable), False  # gradients still to come
        self.flat_param.untyped_storage().resize_(0)  # from now on it exists only while gathered


class ZeRO3:
    """Fully sharded data parallelism: parameters, gradients and optimizer state all sharded.

    module           a plain nn.Module; its parameters may be on the meta device (no memory)
    optimizer_class  a torch.optim optimizer, run over this rank's master shards only
    units            submodules gathered, freed and reduced one at a time, listed in the order
                     forward runs them; every other parameter (a tied one too) is the root's
    param_init_fn    param_init_fn(submodule, prefix) initialises one unit of a meta module in
                     place once its memory exists; prefix is its name ("" for the root)
    grad_clip        global-norm gradient clipping across all shards; 0 turns it off
    param_groups     [{"params": [module's parameters], options}]: the optimizer's groups, as
                     torch.optim takes them (e.g. weight decay for some); default: one group
    find_unused_parameters  as DDP's and 04's: a parameter no rank's backward reached is left alone
    prefetch         issue the next unit's all-gather while the current one computes
    device           where a meta module is materialised (default: where its parameters are)
    **defaults       the optimizer's own arguments (lr, betas, ...)

    A meta module is materialised, initialised and sharded one unit at a time, so no rank holds
    more than one full unit besides its shards; a materialised one takes rank 0's values.
    Call it as the model, then `step()` after the last micro-step's backward, then `zero_grad()`.
    """

    fill_nan_before_gather = False  # tests: a byte an all-gather fails to write then shows as NaN

    def __init__(self, module, optimizer_class=torch.optim.AdamW, units=(), param_init_fn=None,
                 grad_clip=0.0, prefetch=True, device=None, param_groups=None, find_unused_parameters=False,
                 **defaults):
        self.module, self.grad_clip, self.prefetch = module, grad_clip, prefetch
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        slots = {}  # parameter -> every (module, attribute name) holding it
        for m in module.modules():
            for attr, p in m._parameters.items():
                if p is not None:  # (Linear(bias=False) registers its bias as None)
                    slots.setdefault(p, []).append((m, attr))
        prefix = {m: name for name, m in module.named_modules()}
        groups = [(m, list(m.parameters())) for m in units]
        taken = {p for _, params in groups for p in params}
        groups.insert(0, (module, [p for p in module.parameters() if p not in taken]))  # the root
        self.units = []  # the root is unit 0, then the units in forward order
        for index, (m, params) in enumerate(groups):
            unit = Unit(index, m, params, slots, device, self.rank, self.world_size)
            with torch.no_grad():
                if params[0].is_meta and param_init_fn is not None:
                    param_init_fn(m, prefix[m])  # the values it would get in the whole model
                elif not params[0].is_meta:  # ranks may start from different weights: rank 0's
                    dist.broadcast(unit.flat_param, src=0)
            unit.keep_my_shard()  # and free the full unit before materialising the next one
            self.units.append(unit)
        self.grads_in_flight = []  # (unit, work, grad_shard): reduce-scatters not yet waited for
        # A real torch.optim optimizer over my shards, in the caller's groups, of the new
        # parameters that replaced theirs (Unit), stepping one piece of my shard per parameter.
        replaced = {old: new for u in self.units for old, new in u.replaced.items()}
        groups, _ = common.param_groups(param_groups or [{"params": list(replaced)}])
        groups = [{**g, "params": [replaced[p] for p in g["params"]]} for g in groups]
        self.optim = optimizer_class(common.piece_groups(groups, [x for u in self.units for x in u.pieces]),
                                     **defaults)
        trainable = [p for u in self.units for p in u.trainable]
        self.used = common.UsedParameters(trainable, self.units[0].flat_param.device) if find_unused_parameters else None
        for unit in self.units:
            hook = functools.partial
            unit.module.register_forward_pre_hook(hook(self._pre_forward, unit))
            unit.module.register_forward_hook(hook(self._post_forward, unit))
            if unit.index > 0:  # the root's backward pre-hook is set in _post_forward
                unit.module.register_full_backward_pre_hook(hook(self._pre_backward, unit))
                unit.module.register_full_backward_hook(hook(self._post_backward, unit))
            for p, start in zip(unit.params, unit.offsets):
                if p.requires_grad:  # fires once p.grad is complete (a tied weight's: both uses)
                    p.register_post_accumulate_grad_hook(hook(self._grad_ready, unit, start))

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------------ gather and free
    def _unshard(self, unit, wait=True):
        """All-gather `unit` into its flat buffer, unless it is there or on its way."""
        flat_param = unit.flat_param
        # ### BEGIN SOLUTION: gather a unit
        # TODO: if flat_param's storage is freed (size 0), give it numel x element_size bytes
        #       again, fill it with NaN when self.fill_nan_before_gather (the tests' poison), and
        #       start an async dist.all_gather_into_tensor of unit.param_shard into it, kept in
        #       unit.gather_work. Then, if `wait`, wait for unit.gather_work and set it to None.
        if flat_param.untyped_storage().size() == 0:
            flat_param.untyped_storage().resize_(flat_param.numel() * flat_param.element_size())
            if self.fill_nan_before_gather:
                flat_param.fill_(float("nan"))
            unit.gather_work = dist.all_gather_into_tensor(flat_param, unit.param_shard, async_op=True)
        if wait and unit.gather_work is not None:
            unit.gather_work.wait()
            unit.gather_work = None
        # ### END SOLUTION

    def _reshard(self, unit):
        """Free `unit`'s full parameters; my shard stays."""
        # ### BEGIN SOLUTION: free a unit
        # TODO: wait for unit.gather_work first if one is pending (and set it to None), then
        #       free unit.flat_param's memory by resizing its untyped storage to 0 bytes.
        if unit.gather_work is not None:  # never free memory a collective is writing into
            unit.gather_work.wait()
            unit.gather_work = None
        unit.flat_param.untyped_storage().resize_(0)
        # ### END SOLUTION

    def _prefetch(self, index):  # forward runs the root, 1, 2, ...; backward the root, ..., 2, 1
        if self.prefetch and 0 < index < len(self.units):
            self._unshard(self.units[index], wait=False)  # overlaps with the current unit

    def _pre_forward(self, unit, module, args):
        self._unshard(unit)  # 1) all-gather (or wait for the prefetch issued one unit earlier)
        self._prefetch(unit.index + 1)

    def _post_forward(self, unit, module, args, output):
        # 3) free. The root too: its layers run first and last in forward, so it stays gathered
        # through forward, then, like every unit, is gathered again for backward: 3 Psi a step,
        # as in the paper. (FSDP2 keeps its root: a small unit, gathered once.)
        self._reshard(unit)
        if unit.index == 0:  # the root's inputs are token ids, with no gradient to hook: hook
            outputs = output if isinstance(output, (tuple, list)) else [output]  # its outputs'
            outputs = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda grad: self._pre_backward(unit, module, grad), mode="any")

    def _pre_backward(self, unit, module, grad_output):
        if unit.index == 0:  # backward starts at the root: clean up once it is over
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward_final)
        self._unshard(unit)  # 4) all-gather again: backward needs the weights forward used
        self._prefetch(len(self.units) - 1 if unit.index == 0 else unit.index - 1)

    def _post_backward(self, unit, module, grad_input, grad_output):
        # Gradients w.r.t. the unit's inputs exist: its backward is over, free it. (If no input
        # needs a gradient, torch calls this *before* the unit's backward: leave it to the end.)
        if any(g is not None for g in grad_input):
            self._reshard(unit)

    # ------------------------------------------------------------------ gradients
    @torch.no_grad()
    def _grad_ready(self, unit, start, p):
        """Post-accumulate-grad hook: p's gradient for this backward is complete."""
        assert not unit.reduced, "a parameter used by two units must belong to the root unit"
        if self.used:
            self.used.mark(p)
        if unit.flat_grad is None:  # zeros: padding, frozen parts and unused parameters add 0
            unit.flat_grad = torch.zeros(unit.numel_padded, dtype=p.grad.dtype, device=p.grad.device)
        unit.flat_grad[start:start + p.numel()].view_as(p.grad).copy_(p.grad)
        p.grad = None  # the full gradient is not kept
        unit.pending -= 1
        if unit.pending == 0:
            self._reduce_scatter(unit)  # 5) as soon as the unit's gradients are complete

    def _reduce_scatter(self, unit):
        self._wait_reduce_scatters()  # the previous unit's: at most two full gradients alive
        if unit.flat_grad is None:  # no gradient reached this unit here: it still takes part
            unit.flat_grad = torch.zeros(unit.numel_padded, dtype=unit.param_shard.dtype,
                                         device=unit.param_shard.device)
        # 5) averaged over the global batch: each rank's loss is the mean over its rows, so the
        # global gradient is the SUM over ranks divided by N (divide first, as in 01).
        # ### BEGIN SOLUTION: reduce-scatter a unit's gradient
        # TODO: divide unit.flat_grad (numel_padded,) by self.world_size in place, start an
        #       async dist.reduce_scatter_tensor of it into a new grad_shard shaped like
        #       unit.param_shard, and append (unit, work, grad_shard) to self.grads_in_flight.
        unit.flat_grad.div_(self.world_size)
        grad_shard = torch.empty_like(unit.param_shard)  # (numel_padded / N,)
        work = dist.reduce_scatter_tensor(grad_shard, unit.flat_grad, async_op=True)
        self.grads_in_flight.append((unit, work, grad_shard))
        # ### END SOLUTION
        unit.reduced = True

    def _wait_reduce_scatters(self):
        for unit, work, grad_shard in self.grads_in_flight:
            work.wait()
            # Micro-steps add up in my shard: no rank ever keeps a unit's full gradient. In fp32,
            # as in 05: a bf16 sum would round at every micro-step (fp32 mode: .float() is a no-op).
            unit.grad_shard = grad_shard if unit.grad_shard is None else unit.grad_shard.float().add_(grad_shard)
            unit.flat_grad = None  # 5) free the full gradient
        self.grads_in_flight = []

    def _post_backward_final(self):
        """Queued with the autograd engine: runs once backward is over."""
        for unit in self.units:  # a unit some gradient never reached (an unused parameter) ...
            if unit.trainable and not unit.reduced:
                self._reduce_scatter(unit)  # ... is reduced now, in the same order on every rank
        self._wait_reduce_scatters()
        for unit in self.units:
            self._reshard(unit)  # the root, and any unit whose post-backward hook did not fire
            unit.pending, unit.reduced = len(unit.trainable), False

    # ------------------------------------------------------------------ optimizer
    @torch.no_grad()
    def step(self):
        # 6) AdamW on my shards, in fp32 (bf16 gradients are cast up first, as 01-05 do)
        units, unused = [u for u in self.units if u.master_shard is not None], self.used.unused() if self.used else ()
        for u in units:
            grad = (u.grad_shard if u.grad_shard is not None else torch.zeros_like(u.param_shard)).float()
            common.grads_into_pieces(u.pieces, grad, self.rank * u.shard_numel, unused)
        pieces = [piece for u in units for *_, piece in u.pieces]
        if self.grad_clip > 0:
            self.clip_grad_norm_([piece.grad for piece in pieces if piece.grad is not None])
        self.optim.step()
        for u in units:  # round into my bf16 shard (in fp32 mode the same memory: a no-op)
            u.param_shard[:u.master_shard.numel()].copy_(u.master_shard)
        for piece in pieces:
            piece.grad = None
        # No all-gather here, unlike 04 and 05: the next forward gathers each unit when it runs.

    def clip_grad_norm_(self, grads):
        """Global-norm clipping, as torch.nn.utils.clip_grad_norm_ but over all ranks' shards:
        each rank sums the squares of its own shards; one scalar all-reduce adds them up."""
        norm_sq = sum(g.float().pow(2).sum() for g in grads)  # padding is zero: adds nothing
        dist.all_reduce(norm_sq)
        clip_coef = (self.grad_clip / (norm_sq.sqrt() + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(clip_coef)

    def zero_grad(self):
        for u in self.units:
            u.grad_shard = None

    def checkpoint_shards(self, names):
        """For checkpoint.py, per unit: my shard (loaded whole; I write its frozen part, after
        the trainable prefix), and per trainable parameter its part of my shard, with its
        master and the optimizer's state for it."""
        shards = []
        for u in self.units:
            start, k = self.rank * u.shard_numel, 0 if u.master_shard is None else u.master_shard.numel()
            shards.append(checkpoint.FlatShard([(names[p], p.numel()) for p in u.params],
                                               {"param": (start, u.param_shard)},
                                               owned=(start + k, start + u.shard_numel)))
            shards += [checkpoint.FlatShard([(names[p], p.numel())],
                                            {"param": (lo, u.param_shard[offset + lo - start:offset + hi - start]),
                                             "master": (lo, piece)}, owned=(lo, hi), optim=self.optim)
                       for p, offset, lo, hi, piece in u.pieces]
        return shards

    @torch.no_grad()
    def full_parameters(self):
        """{name: full fp32 tensor}, named as module.named_parameters() names them, on every
        rank: for checkpoints and tests. (Gathered into new buffers; the shards stay as they are.)"""
        full = {}
        for u in self.units:
            flat = torch.empty(u.numel_padded, dtype=u.param_shard.dtype, device=u.param_shard.device)
            dist.all_gather_into_tensor(flat, u.param_shard)
            for p, start in zip(u.params, u.offsets):
                full[p] = flat[start:start + p.numel()].view(p.shape).float().clone()
        return {name: full[p] for name, p in self.module.named_parameters()}


# ----------------------------------------------------------------------------- training
def build_model(args, env):
    """The GPT of `args` under ZeRO-3, built on the meta device and materialised, initialised and
    sharded one unit at a time: its weights equal GPT(cfg, seed)'s, yet no rank ever held them."""
    with torch.device("meta"):  # shapes only: not one byte of parameters yet
        gpt = GPT(common.model_config(args), seed=None).to(common.working_dtype(args))

    def init_unit(module, prefix):  # ZeRO3 calls it for one unit at a time, memory in place
        if module is gpt:  # the root unit: GPT's own layers (lm_head.weight *is* wte.weight)
            for name in ("wte", "wpe", "ln_f"):
                init_parameters(getattr(gpt, name), args.seed, args.n_layer, prefix=name)
        else:  # a block gets the values it gets in GPT(cfg, seed): its generators are by name
            init_parameters(module, args.seed, args.n_layer, prefix=prefix)

    return ZeRO3(gpt, torch.optim.AdamW, units=list(gpt.blocks), param_init_fn=init_unit,
                 grad_clip=args.grad_clip, prefetch=bool(args.prefetch), device=env.device,
                 param_groups=common.decay_groups(gpt, args.weight_decay), **common.adamw_kwargs(args))


def main(argv=None):
    args = common.parse_args(argv, description=__doc__)
    env = common.init_distributed(args)
    with measure.PeakAlive() as init_memory:  # observed from outside: bytes held while building
        model = build_model(args, env)
    run = measure.Run(args, env, "zero3", model.module, model, holders=[model])
    run.init_peak = init_memory.peak
    run.full_parameters = model.full_parameters  # the parameters are sharded: gather to compare
    ckpt = checkpoint.Checkpointer(args, env, "zero3", model.module, model)  # --checkpoint-dir
    start = ckpt.resume()  # 0, or with --resume the step the newest checkpoint stopped at

    ### TRAINING SECTION BEGIN
    for step in range(start, args.steps):
        with run.step(step) as losses:
            for micro in range(args.grad_accum):
                x, y = common.get_batch(args, env, step, micro)
                loss = model(x, y) / args.grad_accum  # 1) gather 2) forward 3) free, unit by unit
                loss.backward()  # 4) gather again 5) reduce-scatter into my grad shard, unit by unit
                losses.append(loss)
            common.set_learning_rate(model.optim, args, step)  # --lr-schedule
            model.step()  # 6) AdamW on my shard
            model.zero_grad()
        ckpt.maybe_save(step + 1)  # every --save-every steps (each rank its shard)
    ### TRAINING SECTION END

    run.finish()
    return run


if __name__ == "__main__":
    common.run_main(main)
