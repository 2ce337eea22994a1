"""06-08's units: the parameters of some modules flattened into one buffer, padded to a multiple
of N and cut in N shards, of which a rank keeps one (06_zero3.py gathers, frees and reduces them).

`shard_units` builds them one at a time, so a model on the meta device never exists whole: each
unit gets its memory, its initial values (param_init_fn: those it would get in the whole model,
or rank 0's where it was built materialised), then keeps my shard and frees the rest before the
next unit is built. `meta_gpt` is the lessons' GPT built that way."""
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from lessonkit import pretrained
from model import GPT, init_parameters


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

    def zeros(self, dtype):
        """A zero gradient buffer for the whole unit: padding, frozen parts and unused parameters add 0."""
        return torch.zeros(self.numel_padded, dtype=dtype, device=self.flat_param.device)  # (07: not the host)

    def add_grad(self, offset, grad, reduce_dtype, sync=True):
        """A parameter's gradient (at `offset`) into the flat gradient: zeros in reduce_dtype (None:
        the gradient's) until then, as padding, frozen parts and unused parameters add 0; or, in a
        backward that does not synchronize (sync False: ddp.GradientSync), fp32 zeros, or the sum
        earlier such backwards left there (grad_to_reduce rounds it once)."""
        if self.flat_grad is None:
            self.flat_grad = self.zeros(reduce_dtype or grad.dtype if sync else torch.float32)
        self.flat_grad[offset:offset + grad.numel()].view_as(grad).add_(grad)

    def grad_to_reduce(self, dtype):
        """The flat gradient in `dtype` (an fp32 sum of several backwards: rounded once, here);
        zeros where no gradient reached the unit on this rank, which still takes part."""
        self.flat_grad = self.zeros(dtype) if self.flat_grad is None else self.flat_grad.to(dtype)
        return self.flat_grad

    def add_to_shards_grad(self, grad, unused=()):
        """My reduced gradient shard `grad` into each sharded parameter's .grad, added to what
        earlier micro-steps left there (in the .grad's dtype: fp32, never 2 bytes); a frozen or
        unused parameter, or one with no element in my shard, gets none: nothing to step."""
        for p, shard, (lo, hi) in zip(self.params, self.sharded, self.ranges):
            if p.requires_grad and hi > lo and p not in unused:
                g = grad[lo:hi].view_as(shard)  # (09 --zero3: a whole matrix, in its shape)
                shard.grad = g if shard.grad is None else shard.grad.add_(g)


def policy_dtypes(mp_policy):
    """(param_dtype, reduce_dtype) of FSDP2's MixedPrecisionPolicy (None: the parameters' own)."""
    if getattr(mp_policy, "output_dtype", None) is not None:
        raise NotImplementedError("ZeRO3 applies a MixedPrecisionPolicy's param_dtype and reduce_dtype, not output_dtype")
    param_dtype = getattr(mp_policy, "param_dtype", None)
    return param_dtype, getattr(mp_policy, "reduce_dtype", None) or param_dtype


def shard_units(module, units, param_dtype, param_init_fn, device, shard_group, replicas=1, place=None):
    """[Unit]: the root (every parameter not in a unit, a tied one too) first, then `units` in
    their order, each a module or a list of consecutive modules (FSDP2's fully_shard([...])),
    each cut over `shard_group`, of which `replicas` copies (08's) must make up the world."""
    shard_size, world = dist.get_world_size(shard_group), dist.get_world_size()
    if shard_size * replicas != world:  # else a gradient's sum is wrong
        raise ValueError(f"ZeRO3: shards over {shard_size} ranks x {replicas} replica(s) are not the world's {world} ranks")
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
    out = []
    shard_rank = dist.get_rank(shard_group)
    for index, (modules, params) in enumerate(groups):
        unit = Unit(index, modules, params, slots, device, shard_rank, shard_size)
        with torch.no_grad():
            if params[0].is_meta and param_init_fn is not None:
                for m in modules:
                    param_init_fn(m, prefix[m])  # the values it would get in the whole model
            elif not params[0].is_meta:  # ranks may start from different weights: rank 0's
                dist.broadcast(unit.flat_param, src=0)
        if place is not None:
            place(unit)  # (07 may place a unit whole on one rank, to measure why not)
        unit.keep_my_shard(param_dtype)  # and free the full unit before the next one
        out.append(unit)
    return out


def meta_gpt(config, seed, init_from=None):
    """The GPT of `config` on the meta device, and the param_init_fn that gives each unit the
    values it has in GPT(config, seed): its generators are drawn by the parameters' names. With
    init_from (--init-from FILE), the file's values instead (lessonkit/pretrained.py)."""
    with torch.device("meta"):  # shapes only: not one byte of parameters yet
        gpt = GPT(config, seed=None)  # fp32: the shards are the master weights
    weights = init_from and pretrained.load(init_from, gpt)

    def init(module, prefix):
        if weights:
            pretrained.copy_into(module, weights, prefix)
        else:
            init_parameters(module, seed, config.n_layer, prefix=prefix)

    def init_unit(module, prefix):  # called for one unit at a time, its memory in place
        if module is gpt:  # the root unit: GPT's own layers (lm_head.weight *is* wte.weight)
            for name in ("wte", "wpe", "ln_f"):
                init(getattr(gpt, name), name)
        else:
            init(module, prefix)
    return gpt, init_unit
