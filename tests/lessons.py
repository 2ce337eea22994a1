"""The one place the tests learn how to drive each lesson's strategy class.

Every entry builds a trainer around a plain nn.Module whose forward(x, y) returns the loss:
    trainer.train_step(micro_batches) -> this rank's loss for the step (mean of micro-steps)
    trainer.full_parameters()         -> {name: full fp32 tensor}, identical on every rank
    handles(lesson, trainer)          -> (module, holder): what checkpoint.save and load take
(fp16: build's loss_scaler= puts a loss scaler in the loop, Scaled.) Tests use nothing else, so a lesson (or a student's version of it) plugs in here only. Which
files: graded.load_lesson, from this checkout or from the student edition named by DP_LESSONS.
"""
import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from lessonkit import checkpoint, optimizers
from graded import load_lesson


def _named_full(module):
    return {n: p.detach().float().clone() for n, p in module.named_parameters()}


class _Replicated:
    """01-03 and PyTorch's DDP: every rank holds the whole model and the whole optimizer."""

    def __init__(self, wrapper, module, grad_clip, lr, weight_decay=0.0, optimizer_class=None, optimizer_kwargs=None,
                 scaler=None):
        self.wrapper, self.module, self.scaler = wrapper, module, scaler or Scaled()
        self.opt = replicated_optimizer(optimizers.decay_groups(module, weight_decay), grad_clip,
                                        optimizer_class, optimizer_kwargs or adamw(lr))

    def train_step(self, micro_batches):
        total = 0.0
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with self._sync_context(last):
                loss = self.wrapper(x, y) / len(micro_batches)
                self.scaler.scale(loss).backward()
            total += loss.item()
        if hasattr(self.wrapper, "all_reduce_gradients"):  # 01: the loop calls it after backward
            self.wrapper.all_reduce_gradients()
        self.scaler.step(self.opt)
        self.opt.zero_grad()
        return total

    def _sync_context(self, last):
        # DDP's way, which 02 and 03 share: every micro-step but the last in no_sync() (01 has none)
        return contextlib.nullcontext() if last or not hasattr(self.wrapper, "no_sync") else self.wrapper.no_sync()

    def full_parameters(self):
        return _named_full(self.module)


@torch.no_grad()
def zero3_full_parameters(z):
    """{name: full fp32 tensor} of a ZeRO3 (06), on every rank: each unit's shards all-gathered
    into a new buffer (the unit's own stays freed) and cut at its parameters' offsets (08: over
    its shard group, whose G shards make the unit)."""
    full, group = {}, getattr(z, "shard_group", None)
    for u in z.units:
        flat = u.shard.new_empty(u.numel_padded)
        if u.shard_numel == u.numel_padded // dist.get_world_size(group):
            dist.all_gather_into_tensor(flat, u.shard, group=group)
        else:  # 07 --layout uneven: the unit whole on its owner
            dist.broadcast(flat.copy_(u.shard) if u.rank == u.owner else flat, src=u.owner)
        for p, offset in zip(u.params, u.offsets):
            full[p] = flat[offset:offset + p.numel()].view(p.shape).float().clone()
    return {name: full[p] for name, p in z.module.named_parameters()}


# ----------------------------------------------------------------------------- fp16: loss scaling
class Scaled:
    """The loop's loss scaler (fp16), any of three, or none (the identity): lessonkit's LossScaler
    (the lessons'), torch.amp.GradScaler (DDP's, one process's) or FSDP2's ShardedGradScaler (a
    GradScaler). scale(loss); step(opt, clip) unscales, clips (clip: a callable, or None when the
    optimizer clips itself), steps unless some rank found an inf or NaN, and updates the scale.
    `skipped`: the steps it skipped, 0-based, read the one way all three show it: the scale went
    down at that step's update."""

    def __init__(self, scaler=None):
        self.scaler, self.skipped, self.steps = scaler, [], 0

    def scale(self, loss):
        return loss if self.scaler is None else self.scaler.scale(loss)

    def step(self, opt, clip=None):
        s = self.scaler
        if s is None:
            if clip:
                clip()
            return opt.step()
        before = s.get_scale()
        if isinstance(s, torch.amp.GradScaler) and hasattr(opt, "master_grads"):
            # GradScaler unscales the .grad of opt.param_groups and refuses fp16 ones: a
            # MixedPrecisionAdamW's param_groups are its fp32 masters, so the fp16 gradients are
            # cast onto them first (tests/test_fp16.py drives DDP the same way)
            opt.master_grads()
        if clip and hasattr(s, "unscale_"):  # PyTorch's recipe: unscale, clip the true gradients, step
            s.unscale_(opt)
            clip()
            s.step(opt)
        elif clip:  # (a LossScaler without unscale_: the same recipe by hand)
            if s.unscale([p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]):
                clip()
                opt.step()
        else:  # (the kit's optimizers unscale inside step, before their own clipping: loss_scale.py)
            s.step(opt)
        s.update()
        if s.get_scale() < before:
            self.skipped.append(self.steps)
        self.steps += 1


def evaluate(trainer, x, y):
    """An evaluation forward under no_grad, through what the trainer's loop calls."""
    model = trainer.wrapper if hasattr(trainer, "wrapper") else trainer.model
    with torch.no_grad():
        loss = model(x, y)
    from torch.distributed.fsdp import FSDPModule  # (imported where used: a second and a half, in every grading)
    if isinstance(model, FSDPModule):  # FSDP2 without resharding keeps what forward gathered
        model.reshard()
    return loss


def adamw(lr):
    return dict(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def replicated_optimizer(params, grad_clip, optimizer_class=None, optimizer_kwargs=None, adamw_kwargs=None):
    """What 01-03 and DDP step with: optimizers.MixedPrecisionAdamW (clipping; fp32 master
    weights for bf16 parameters), its AdamW swapped for `optimizer_class` (e.g. SGD) over the
    same master weights and param groups (their weight decay kept). torch.optim.Muon: on the
    groups with use_muon (09's muon_groups), AdamW (adamw_kwargs) on the others (MuonAndAdamW)."""
    if optimizer_class in (None, torch.optim.AdamW):
        return optimizers.MixedPrecisionAdamW(params, grad_clip, **(optimizer_kwargs or adamw(1e-2)))
    opt = optimizers.MixedPrecisionAdamW(params, grad_clip, **adamw(0.0))  # no state yet: replaced
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"], "use_muon": g.get("use_muon", False)}
              for g in opt.optim.param_groups]
    opt.optim = (MuonAndAdamW(groups, optimizer_kwargs, adamw_kwargs or adamw(1e-2)) if optimizer_class is MUON else
                 optimizer_class([{k: v for k, v in g.items() if k != "use_muon"} for g in groups], **optimizer_kwargs))
    return opt


MUON = getattr(torch.optim, "Muon", None)  # (PyTorch 2.9 and later)


class MuonAndAdamW:
    """Muon as it is used: torch.optim.Muon over the groups with use_muon, torch.optim.AdamW over
    the others, stepped together (single-process Muon, 09's reference)."""

    def __init__(self, groups, muon_kwargs, adamw_kwargs):
        strip = lambda use: [{k: v for k, v in g.items() if k != "use_muon"} for g in groups  # noqa: E731
                             if g["use_muon"] == use and g["params"]]
        self.optims = [o(strip(use), **kw) for o, use, kw in ((MUON, True, muon_kwargs), (torch.optim.AdamW, False, adamw_kwargs))
                       if strip(use)]
        self.param_groups = [g for o in self.optims for g in o.param_groups]

    def step(self):
        for o in self.optims:
            o.step()


def build(lesson, module, grad_clip=0.0, lr=1e-2, bucket_mb=25.0, weight_decay=0.0, **kw):
    """A trainer for `lesson` ("01".."09", or "ddp") around `module`, inside a process group.
    08 and fsdp2_hsdp: kw shard_group, G ranks per shard group (default: all).
    weight_decay: AdamW's, in optimizers.decay_groups (matrices and embeddings only), as main().
    reduce_every, all_reduce_every: "step" reduces (all-reduces) once a step (05-08 and FSDP2)."""
    wd = weight_decay
    opt_kw = {k: kw[k] for k in ("optimizer_class", "optimizer_kwargs") if k in kw}  # default: AdamW at lr
    # fp16: kw loss_scaler, the loop's (Scaled says which kinds); the trainer's .scaler.skipped then
    # lists the steps it skipped
    scaler = Scaled(kw.get("loss_scaler"))
    if lesson == "ddp":
        ddp = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_mb,
                                                  find_unused_parameters=kw.get("find_unused", False))
        return _Replicated(ddp, module, grad_clip, lr, weight_decay=wd, scaler=scaler, **opt_kw)
    if lesson == "01":
        dp = load_lesson("01_vanilla_dp").VanillaDP(module, find_unused_parameters=kw.get("find_unused", False))  # averages when called
        return _Replicated(dp, module, grad_clip, lr, weight_decay=wd, scaler=scaler, **opt_kw)
    if lesson == "02":
        dp = load_lesson("02_async_allreduce").AsyncAllReduceDP(module, find_unused_parameters=kw.get("find_unused", False))
        return _Replicated(dp, module, grad_clip, lr, weight_decay=wd, scaler=scaler, **opt_kw)
    if lesson == "03":
        dp = load_lesson("03_buckets").BucketedDP(module, bucket_cap_mb=bucket_mb,
                                                  find_unused_parameters=kw.get("find_unused", False))
        return _Replicated(dp, module, grad_clip, lr, weight_decay=wd, scaler=scaler, **opt_kw)
    if lesson in ("06", "07", "08"):  # as FSDP2: the caller's optimizer over the shards, clipping by the model
        strategy, extra = load_lesson("06_zero3").ZeRO3, {}  # (06 first: 07 and 08 import it)
        if lesson == "07":
            from torch.distributed.fsdp import CPUOffloadPolicy
            strategy, extra = load_lesson("07_offload").ZeRO3Offload, {"offload_policy": CPUOffloadPolicy(False),
                                                                       "layout": kw.get("layout", "even")}
        if lesson == "08":  # the R x G grid's two process groups (defaults: none, as HybridShard(module))
            hybrid = load_lesson("08_hybrid")
            groups = () if kw.get("defaults") else hybrid.hybrid_groups(kw.get("shard_group") or dist.get_world_size())
            strategy, extra = hybrid.HybridShard, dict(zip(("shard_group", "replicate_group"), groups))
        z = strategy(module, units=sharding_units(module, kw.get("chunk", 1)), prefetch=kw.get("prefetch", True),
                     find_unused_parameters=kw.get("find_unused", False),
                     mp_policy=kw.get("mp_policy"), **extra)  # mp_policy None: the parameters' dtype
        opt = kw.get("optimizer_class", torch.optim.AdamW)(optimizers.decay_groups(z, wd),
                                                           **kw.get("optimizer_kwargs", adamw(lr)))

        def step():
            scaler.step(opt, clip=(lambda: z.clip_grad_norm_(grad_clip)) if grad_clip > 0 else None)
            opt.zero_grad()
        return _FullySharded(z, step=step, full_parameters=lambda: zero3_full_parameters(z), opt=opt, scaler=scaler,
                             every=_every(kw))
    if lesson in ("fsdp2", "fsdp2_offload", "fsdp2_hsdp"):  # offload: CPUOffloadPolicy, as 07; hsdp: 08's grid
        return _fsdp2(module, grad_clip, lr, wd, scaler, offload=lesson == "fsdp2_offload",
                      hsdp=lesson == "fsdp2_hsdp", **kw)
    if lesson in ("04", "05"):  # kw optimizer_class / optimizer_kwargs: e.g. SGD, which sees gradient scale
        opt_class, opt_kwargs = kw.get("optimizer_class", torch.optim.AdamW), kw.get("optimizer_kwargs", adamw(lr))
        if lesson == "04":
            opt = load_lesson("04_zero1").ZeRO1Optimizer(optimizers.decay_groups(module, wd), opt_class, grad_clip=grad_clip,
                                                         find_unused_parameters=kw.get("find_unused", False),
                                                         **opt_kwargs)
            return _ShardedOptimizer(module, opt, scaler=scaler)
        opt = load_lesson("05_zero2").ZeRO2Optimizer(optimizers.decay_groups(module, wd), opt_class, bucket_cap_mb=bucket_mb,
                                                     bucket_order=module.parameters(),
                                                     find_unused_parameters=kw.get("find_unused", False),
                                                     grad_clip=grad_clip, **opt_kwargs)
        once = kw.get("reduce_every") == "step"  # no_sync() on every micro-step but the last
        return _ShardedOptimizer(module, opt, scaler=scaler,  # its reduce-scatters end inside backward
                                 sync=lambda last: contextlib.nullcontext() if last or not once else opt.no_sync())
    if lesson == "09" and kw.get("zero3"):  # --zero3 1: 06's units, laid out owner by owner; Muon clips itself
        lesson09, opt_class = load_lesson("09_muon"), kw.get("optimizer_class", torch.optim.AdamW)
        z = lesson09.ZeRO3Owners(module, units=sharding_units(module, kw.get("chunk", 1)), prefetch=kw.get("prefetch", True),
                                 find_unused_parameters=kw.get("find_unused", False), mp_policy=kw.get("mp_policy"))
        if opt_class is MUON:
            opt, clip = lesson09.UnitsMuon(z, lesson09.muon_groups(module, wd), grad_clip, muon_defaults=kw.get("optimizer_kwargs"),
                                           **kw.get("adamw_kwargs") or adamw(lr)), None
        else:
            opt = opt_class(optimizers.decay_groups(z, wd), **kw.get("optimizer_kwargs", adamw(lr)))
            clip = (lambda: z.clip_grad_norm_(grad_clip)) if grad_clip > 0 else None

        def step():
            scaler.step(opt, clip=clip)
            opt.zero_grad()
        return _FullySharded(z, step=step, full_parameters=lambda: zero3_full_parameters(z), opt=opt, scaler=scaler)
    if lesson == "09":  # Muon (optimizer_class) on muon_groups' matrices and AdamW on the rest; else the class on all
        lesson09, opt_class = load_lesson("09_muon"), kw.get("optimizer_class", torch.optim.AdamW)
        muon = opt_class is MUON
        groups = lesson09.muon_groups(module, wd) if muon else optimizers.decay_groups(module, wd)
        opt = lesson09.ZeROMuon(groups, torch.optim.AdamW if muon else opt_class, grad_clip=grad_clip,
                                find_unused_parameters=kw.get("find_unused", False),
                                muon_defaults=kw.get("optimizer_kwargs") if muon else None,
                                **(kw.get("adamw_kwargs") or adamw(lr)) if muon else kw.get("optimizer_kwargs", adamw(lr)))
        return _ShardedOptimizer(module, opt, scaler=scaler)
    if lesson == "zero_redundancy":
        return _zero_redundancy(module, grad_clip, lr, bucket_mb, kw.get("find_unused", False), wd, **opt_kw)
    if lesson == "fsdp2_noreshard":
        return _fsdp2_noreshard(module, grad_clip, lr, wd, scaler, **kw)
    raise KeyError(f"no adapter for lesson {lesson!r}")


def handles(lesson, trainer):
    """(module, holder): the plain model and what describes it to lessonkit/checkpoint.py, as each
    lesson's main() gives its Checkpointer (01-08)."""
    if lesson in ("06", "07", "08") or hasattr(getattr(trainer, "model", None), "units"):  # (and 09 --zero3 1): 08's, or the kit's
        shards = load_lesson("08_hybrid").checkpoint_shards if lesson == "08" else checkpoint.unit_shards
        return trainer.model.module, functools.partial(shards, trainer.model, trainer.opt)
    if lesson in ("04", "05", "09"):  # the lesson's function, of its optimizer
        name = {"04": "04_zero1", "05": "05_zero2", "09": "09_muon"}[lesson]
        return trainer.model, functools.partial(load_lesson(name).checkpoint_shards, trainer.opt)
    return trainer.module, functools.partial(optimizers.checkpoint_shards, trainer.opt)  # 01-03: their optimizer's


# ----------------------------------------------------------------------------- fully sharded (06, FSDP2)
def sharding_units(module, chunk=1):
    """ZeRO-3/FSDP2 units: a GPT's blocks; otherwise every child module that shares no parameter
    with another child (a tied embedding/head stays in the root, as FSDP places it). chunk > 1:
    every `chunk` consecutive ones a list, one unit (07's --chunk-mb; FSDP2's fully_shard([..]))."""
    if hasattr(module, "blocks"):
        units = list(module.blocks)
    else:
        holders = {}
        for child in module.children():
            for p in child.parameters():
                holders[p] = holders.get(p, 0) + 1
        units = [c for c in module.children()
                 if any(True for _ in c.parameters()) and all(holders[p] == 1 for p in c.parameters())]
    return units if chunk == 1 else [units[i:i + chunk] for i in range(0, len(units), chunk)]


class _FullySharded:
    """06 and PyTorch's FSDP2: parameters, gradients and optimizer state all sharded. `every`:
    {"reduce_every", "all_reduce_every"}, "step" to reduce (all-reduce) at the last micro-step only,
    by FSDP2's set_requires_gradient_sync and set_requires_all_reduce, which 06-08 share."""

    def __init__(self, model, step, full_parameters, opt=None, scaler=None, every=None):
        self.model, self.step, self.full_parameters, self.opt = model, step, full_parameters, opt
        self.scaler, self.every = scaler or Scaled(), every or {}

    def train_step(self, micro_batches):
        total = 0.0
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            if self.every.get("reduce_every") == "step":
                self.model.set_requires_gradient_sync(last)
            if self.every.get("all_reduce_every") == "step" and hasattr(self.model, "set_requires_all_reduce"):
                self.model.set_requires_all_reduce(last)  # (08's and FSDP2's: 06 and 07 have no replicas)
            loss = self.model(x, y) / len(micro_batches)
            self.scaler.scale(loss).backward()  # each micro-step reduce-scatters: no full gradient is ever kept
            total += loss.item()
        self.step()
        return total


@contextlib.contextmanager
def _fsdp2_sync(module, sync):
    """FSDP2's no_sync(): its set_requires_gradient_sync(False) for one micro-step (sync False)."""
    module.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def _every(kw):
    return {k: kw[k] for k in ("reduce_every", "all_reduce_every") if k in kw}


# whether this torch's FSDP2 can reduce-scatter zeros for a parameter a rank's backward did not
# reach (set_reduce_scatter_unused_params: torch 2.13 can, 2.11 cannot); where it cannot, it runs
# only what every rank uses alike (tests/fuzz.py, runs_of)
@functools.cache
def fsdp2_reduces_unused():
    from torch.distributed.fsdp import FSDPModule
    return hasattr(FSDPModule, "set_reduce_scatter_unused_params")


def _fsdp2_options(module, kw):
    """build's kw for FSDP2: mp_policy (a MixedPrecisionPolicy); find_unused: reduce-scatter
    zeros for a parameter this rank's backward did not reach (set_reduce_scatter_unused_params),
    so a unit's reduce-scatter matches on every rank. Unlike DDP's, a parameter no rank reached
    then gets a zero gradient, not None (AdamW moves it): a caller wanting DDP's semantics drops
    those (tests/fuzz.py does). The optimizer: optimizer_class/optimizer_kwargs, AdamW at lr."""
    if kw.get("find_unused", False) and fsdp2_reduces_unused():
        module.set_reduce_scatter_unused_params(True)
    return kw.get("optimizer_class", torch.optim.AdamW), kw.get("optimizer_kwargs")


def _fsdp2(module, grad_clip, lr, wd, scaler, offload=False, hsdp=False, **kw):
    """PyTorch's own ZeRO-3: fully_shard each unit, then the root, on an explicit CPU mesh
    (offload: with CPUOffloadPolicy, unpinned: no GPU here; hsdp: a 2-D R x G mesh, kw
    shard_group = G, FSDP2's HSDP: replicate over its first dimension, shard over its second)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    world, g = dist.get_world_size(), kw.get("shard_group") or dist.get_world_size()
    mesh = (init_device_mesh("cpu", (world // g, g), mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh("cpu", (world,)))
    policy = kw.get("mp_policy") or MixedPrecisionPolicy()
    options = dict(mesh=mesh, reshard_after_forward=True, mp_policy=policy,
                   **({"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}))
    for unit in sharding_units(module, kw.get("chunk", 1)):
        fully_shard(unit, **options)
    fully_shard(module, **options)
    opt_class, opt_kwargs = _fsdp2_options(module, kw)
    opt = opt_class(optimizers.decay_groups(module, wd), **(opt_kwargs or adamw(lr)))

    def step():
        scaler.step(opt, clip=_clipper(module, grad_clip))
        opt.zero_grad()

    def full_parameters():  # the parameters are DTensor shards
        return {n: p.full_tensor().detach().float().clone() for n, p in module.named_parameters()}
    return _FullySharded(module, step, full_parameters, opt=opt, scaler=scaler, every=_every(kw))


# ----------------------------------------------------------------------------- sharded optimizer (04, 05)
class _ShardedOptimizer:
    """04, 05 and their PyTorch counterparts: the strategy is (or includes) the optimizer.

    before_step()     e.g. PyTorch's clipping, which ZeroRedundancyOptimizer does not do itself
                      (None: the optimizer clips, as 04's and 05's do)
    sync(last)        a context per micro-step (DDP's no_sync on all but the last)
    scaler            a Scaled (fp16)
    """

    def __init__(self, model, opt, before_step=None, sync=None, full_parameters=None, scaler=None):
        self.model, self.opt, self.scaler = model, opt, scaler or Scaled()
        self.before_step = before_step
        self.sync = sync or (lambda last: contextlib.nullcontext())
        self._full = full_parameters

    def train_step(self, micro_batches):
        total = 0.0
        for i, (x, y) in enumerate(micro_batches):
            with self.sync(i == len(micro_batches) - 1):
                loss = self.model(x, y) / len(micro_batches)
                self.scaler.scale(loss).backward()
            total += loss.item()
        self.scaler.step(self.opt, clip=self.before_step)
        self.opt.zero_grad()
        return total

    def full_parameters(self):
        if self._full is not None:
            return self._full()
        module = getattr(self.model, "module", self.model)  # under DDP, the wrapped module
        return _named_full(module)


def _clipper(module, grad_clip):
    trainable = [p for p in module.parameters() if p.requires_grad]
    return (lambda: torch.nn.utils.clip_grad_norm_(trainable, grad_clip)) if grad_clip > 0 else None


def _zero_redundancy(module, grad_clip, lr, bucket_mb, find_unused, wd, optimizer_class=torch.optim.AdamW,
                     optimizer_kwargs=None):
    """PyTorch's ZeRO-1: DDP all-reduces the gradients, ZeroRedundancyOptimizer shards AdamW (or
    optimizer_class). It keeps no fp32 master weights: a bf16 counterpart for 04 is not this."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    ddp = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_mb, find_unused_parameters=find_unused)
    opt = ZeroRedundancyOptimizer(optimizers.decay_groups(module, wd), optimizer_class=optimizer_class,
                                  **(optimizer_kwargs or adamw(lr)))
    return _ShardedOptimizer(ddp, opt, before_step=_clipper(module, grad_clip),  # every rank has the full gradient
                             sync=lambda last: contextlib.nullcontext() if last else ddp.no_sync())


def _fsdp2_noreshard(module, grad_clip, lr, wd, scaler, **kw):
    """PyTorch's ZeRO-2: FSDP2 keeping the parameters gathered between forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    fully_shard(module, mesh=init_device_mesh("cpu", (dist.get_world_size(),)), reshard_after_forward=False,
                mp_policy=kw.get("mp_policy") or MixedPrecisionPolicy())
    opt_class, opt_kwargs = _fsdp2_options(module, kw)
    opt = opt_class(optimizers.decay_groups(module, wd), **(opt_kwargs or adamw(lr)))
    # clip_grad_norm_ over DTensor gradient shards all-reduces the norm across ranks
    return _ShardedOptimizer(module, opt, before_step=_clipper(module, grad_clip), scaler=scaler,
                             sync=lambda last: _fsdp2_sync(module, last or kw.get("reduce_every") != "step"),
                             full_parameters=lambda: {n: p.full_tensor().detach().float().clone()
                                                      for n, p in module.named_parameters()})

