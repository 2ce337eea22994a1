"""Resharding, the arithmetic that makes a checkpoint's world size not matter (checkpoint.py
writes and reads the files; docs/checkpoints.md). A rank's state is a list of FlatShards: ranges
of the model's parameters laid back to back, flat. `stage` builds, from a checkpoint's pieces of
each parameter, the values any layout gives this rank (its shard under N' ranks, or the whole).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist


class CheckpointError(Exception):
    """A checkpoint that cannot be used: raised on every rank, before anything is loaded."""


@dataclass
class FlatShard:
    """What one rank holds of one flat buffer (04-06), or of one whole parameter (01-03).

    params   [(name, numel)]: the parameters packed back to back from flat offset 0 (padding after)
    tensors  {"param": (start, t), "master": (start, t)}: this rank's tensors, t holding flat
             elements start .. start + t.numel(); "master" is the tensor `optim` updates
    owned    (lo, hi): the flat range this rank writes (another rank writes the rest)
    optim    the torch.optim optimizer whose state for the master tensor holds the moments
    """
    params: list
    tensors: dict
    owned: tuple
    optim: torch.optim.Optimizer = None


def flat_buffer_shards(names, params, flat_param, pieces, optim):
    """What 04 and 05 hold of one flat buffer: the whole buffer (every rank holds and loads it
    whole; none writes it) and, per piece of my shard (shard.ShardOptimizer.pieces), that part of it,
    its fp32 master and `optim`'s state for it, which I write and load."""
    layout = [(names[p], p.numel()) for p in params]
    return [FlatShard(layout, {"param": (0, flat_param)}, owned=(0, 0))] + [
        FlatShard([(names[p], p.numel())], {"param": (lo, flat_param[offset + lo:offset + hi]), "master": (lo, piece)},
                  owned=(lo, hi), optim=optim)
        for p, offset, lo, hi, piece in pieces]


def parts(params, a, b):
    """(name, lo, hi, flat) for each parameter's part of flat range [a, b): its elements lo..hi,
    which sit at flat offset `flat`. Padding belongs to no parameter."""
    offset = 0
    for name, numel in params:
        lo, hi = max(a - offset, 0), min(b - offset, numel)
        if lo < hi:
            yield name, lo, hi, offset + lo
        offset += numel


def shards(module, holder):
    """What holder(names) says this rank holds, and every parameter it leaves out."""
    names = {p: n for n, p in module.named_parameters()}  # a tied weight: its first name
    out = holder(names)
    packed = {n for s in out for n, _ in s.params}
    for p, n in names.items():  # parameters the strategy replicates and no optimizer updates
        if n not in packed:      # (frozen ones in 04, 05): rank 0 writes them, every rank loads
            out.append(FlatShard([(n, p.numel())], {"param": (0, p)}, (0, p.numel() * (dist.get_rank() == 0))))
    return out


def master_of(shard):
    """(start, master, separate): the tensor the optimizer updates, and whether it is a copy of
    the parameters (bf16) or the parameters themselves (fp32). None without an optimizer."""
    if "master" not in shard.tensors:
        return None
    (start, master), param = shard.tensors["master"], shard.tensors["param"][1]
    return start, master, master.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()


def check_cover(path, index, steps, shapes):
    """Refuse pieces {(name, kind): [(lo, hi, data)]} that do not cover each parameter of
    `shapes` exactly once, or one parameter's pieces at different optimizer steps."""
    numel = {n: torch.Size(shape).numel() for n, shape in shapes.items()}
    for (name, kind), ranges in index.items():  # exactly once: the ranges tile 0 .. numel
        ranges.sort(key=lambda r: r[0])
        ends = [0] + [hi for _, hi, _ in ranges]
        if [lo for lo, _, _ in ranges] != ends[:-1] or ends[-1] != numel.get(name):
            raise CheckpointError(f"{path}: {name} ({kind}) is not covered exactly once by the rank files")
    for name in numel:
        if (name, "param") not in index:
            raise CheckpointError(f"{path}: no rank file holds {name}")
    for name, counts in steps.items():
        if any(c.item() != counts[0].item() for c in counts):
            raise CheckpointError(f"{path}: {name} has pieces at different optimizer steps")


def check_shapes(path, module, shapes):
    """Refuse a checkpoint whose parameters {name: shape} are not `module`'s (a tied one may be
    named twice: DCP's files hold lm_head.weight beside wte.weight)."""
    ours = {n: list(p.shape) for n, p in module.named_parameters()}
    tied = {n for n, _ in module.named_parameters(remove_duplicate=False)} - ours.keys()
    differ = sorted(n for n in ours.keys() | (shapes.keys() - tied) if ours.get(n) != shapes.get(n))
    if differ:
        raise CheckpointError(f"{path} holds other parameters than this model: {', '.join(differ[:4])}")


def gather(index, name, kind, lo, hi):
    """Elements lo..hi of one parameter's state, from the pieces that hold them."""
    return torch.cat([d[max(lo, a) - a:min(hi, b) - a] for a, b, d in index[name, kind] if a < hi and b > lo])


def whole(meta, index, steps):
    """A checkpoint's state as no layout shows it ((meta, index, steps) from checkpoint.read):
    {(name, what): tensor of the parameter's shape}, what = "weights" (its trained values: the fp32
    masters where the writer kept them apart, else the parameters), each optimizer state kind
    ("exp_avg", ...), and "step". Checkpoints of one state are equal here, whatever wrote them."""
    out = {}
    for name, shape in meta["params"].items():
        kinds = sorted(k for n, k in index if n == name and k != ("param" if (name, "master") in index else "master"))
        for kind in kinds:
            values = gather(index, name, kind, 0, torch.Size(shape).numel()).view(shape)
            out[name, "weights" if kind in ("param", "master") else kind] = values
        if name in steps:
            out[name, "step"] = steps[name]
    return out


def _fill(t, start, params, index, kind_of):
    """A new tensor like t (flat elements start ..), filled from the checkpoint; padding zero."""
    new = torch.zeros(t.numel(), dtype=t.dtype, device=t.device)
    for name, lo, hi, at in parts(params, start, start + t.numel()):
        if (name, kind_of(name)) not in index:
            raise CheckpointError(f"the checkpoint has no {kind_of(name)} for {name}")
        new[at - start:at - start + hi - lo] = gather(index, name, kind_of(name), lo, hi)
    return new.view_as(t)


def stage(shards, index, steps):
    """Every value this rank will hold under the new layout, built without touching a live
    tensor: [(live tensor, new value)] and [(optimizer, master, new state or None)]."""
    copies, states = [], []
    for s in shards:
        start, param = s.tensors["param"]
        # where the parameter is the optimizer's fp32 master itself (06-08, and fp32 runs), a checkpoint
        # written with separate masters (01-05 in bf16 or fp16) gives it the masters, not their rounding
        own_master = master_of(s) is not None and not master_of(s)[2]
        copies.append((param, _fill(param, start, s.params, index,
                                    lambda n: "master" if own_master and (n, "master") in index else "param")))
        if master_of(s) is None:
            continue
        start, master, separate = master_of(s)
        if separate:  # bf16: the fp32 masters (in fp32 the master IS the parameter, filled above)
            copies.append((master, _fill(master, start, s.params, index,
                                         lambda n: "master" if (n, "master") in index else "param")))
        names = [n for n, *_ in parts(s.params, start, start + master.numel())]
        kinds = sorted({k for (n, k) in index if n in names or not names} - {"param", "master"})
        if not kinds:  # never stepped: 01-03's parameter that has had no gradient yet
            states.append((s.optim, master, None))
            continue
        # AdamW counts steps per tensor (a shard of padding only takes any parameter's count); SGD and
        # Muon do not (09: Muon's parameters beside AdamW's, whose counts are in `steps`)
        counted = [steps[n] for n in names if n in steps] or ([] if names else list(steps.values()))
        state = {"step": counted[0].clone()} if counted else {}
        for kind in kinds:  # exp_avg, exp_avg_sq, momentum_buffer: created here as torch creates them, lazily
            state[kind] = _fill(master, start, s.params, index, lambda n: kind)
        states.append((s.optim, master, state))
    return copies, states


def unit_shards(model, optimizer, names):
    """For checkpoint.py, per parameter of `model` (06-08's ZeRO3): its elements in my shards, which
    are its master weights too, and `optimizer`'s state for them (09's two: the one stepping it). I
    write and load just those."""
    out = []
    for u in model.units:
        for p, shard, offset, (lo, hi) in zip(u.params, u.sharded, u.offsets, u.ranges):
            first = u.start + lo - offset  # the element of p my shard starts at
            stepped = p.requires_grad and hi > lo
            tensors = {"param": (first, shard), **({"master": (first, shard)} if stepped else {})}
            out.append(FlatShard([(names[p], p.numel())], tensors, owned=(first, first + hi - lo),
                                 optim=getattr(optimizer, "optimizer_of", lambda t: optimizer)(shard) if stepped else None))
    return out
