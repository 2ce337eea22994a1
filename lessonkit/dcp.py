"""The lessons' checkpoints in PyTorch's own format too: torch.distributed.checkpoint (DCP), as
FSDP2 and torchtitan write it (docs/checkpoints.md). checkpoint.save hands this module the ranges
each rank owns; each rank writes only those, and the planner, not a gather, places them in the
whole tensors. The names are `get_state_dict`'s: model.<name> (the trained values: the fp32 masters
where kept), optim.state.<name>.<exp_avg, exp_avg_sq, step, ...>. So PyTorch's tools read a
lessons' checkpoint (format_utils.dcp_to_torch_save; dcp.load into FSDP2), and read() turns a DCP
checkpoint that FSDP2 wrote into the ranges checkpoint.py loads, at any world size.

A flat range [lo, hi) of a parameter is no rectangle of its shape; it is at most two partial rows
and a block of whole rows, at each dimension (chunks): each one a chunk of DCP's metadata.

torch.distributed.checkpoint is imported where it is used: it takes a second, which a run that
writes no checkpoint, every process of it, would pay at start."""
import math
import os

import torch

from lessonkit import reshard
from lessonkit.reshard import CheckpointError


def chunks(shape, lo, hi):
    """[(offsets, sizes)]: rectangles of `shape` covering its flat elements lo .. hi, in order."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    (r0, a), (r1, b) = divmod(lo, inner), divmod(hi, inner)
    if r0 == r1:  # inside one slice of the first dimension
        return [((r0, *o), (1, *s)) for o, s in chunks(shape[1:], a, b)]
    out = [((r0, *o), (1, *s)) for o, s in chunks(shape[1:], a, inner)] if a else []
    whole = r0 + (a > 0)
    if r1 > whole:
        out.append(((whole, *[0] * (len(shape) - 1)), (r1 - whole, *shape[1:])))
    return out + [((r1, *o), (1, *s)) for o, s in chunks(shape[1:], 0, b)]


def fqn(name, kind):
    return f"model.{name}" if kind in ("param", "master") else f"optim.state.{name}.{kind}"


def _ranges_planner(pieces):
    """DCP's default planner, given this rank's pieces {(fqn, offsets): (tensor, full shape)}
    instead of whole tensors."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    class RangesPlanner(DefaultSavePlanner):
        def create_local_plan(self):
            items = [WriteItem(index=MetadataIndex(key, torch.Size(offsets)),
                               type=WriteItemType.SHARD if size else WriteItemType.TENSOR,
                               tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), t.shape),
                                                           properties=TensorProperties.create_from_tensor(t),
                                                           size=torch.Size(size)))
                     for (key, offsets), (t, size) in pieces.items()]
            mappings = {key: tuple(key.split(".", 1)) if key.startswith("model.") else
                        ("optim", "state", key[len("optim.state."):].rsplit(".", 1)[0], key.rsplit(".", 1)[1])
                        for key, _ in pieces}
            self.plan = SavePlan(items, planner_data=mappings)
            return self.plan

        def resolve_data(self, write_item):
            return pieces[write_item.index.fqn, tuple(write_item.index.offset)][0]
    return RangesPlanner()


def save(path, entries, shapes, aliases):
    """Collective: write this rank's `entries` (checkpoint.py's: name, kind, lo, hi, step, data) into
    `path` as DCP; the trained values are the fp32 masters where a parameter has them."""
    with_master = {e["name"] for e in entries if e["kind"] == "master"}
    pieces = {}
    for e in entries:
        if e["kind"] == "param" and e["name"] in with_master:
            continue  # (its 2-byte rounding: the master is the state)
        for name in [e["name"], *[a for a, n in aliases.items() if n == e["name"]]]:  # tied: both names
            shape, at = shapes[e["name"]], e["lo"]
            for offsets, sizes in chunks(shape, e["lo"], e["hi"]):
                n = math.prod(sizes)
                pieces[fqn(name, e["kind"]), offsets] = (e["data"][at - e["lo"]:at - e["lo"] + n].view(sizes), shape)
                at += n
            if e["step"] is not None:
                pieces[f"optim.state.{name}.step", ()] = (e["step"].reshape(()), ())
    import torch.distributed.checkpoint as dcp
    dcp.save({}, checkpoint_id=path, planner=_ranges_planner(pieces))


def foreign(path):
    """Whether `path` is a DCP checkpoint that the lessons did not write (no meta.json): FSDP2's, say.
    DCP writes its .metadata once every rank's data is written: it is the mark of a complete one."""
    return os.path.exists(os.path.join(path, ".metadata")) and not any(  # (the lessons' own: rank0.pt first, meta.json last)
        os.path.exists(os.path.join(path, f)) for f in ("meta.json", "rank0.pt"))


def read(path, check=None):
    """A DCP checkpoint (FSDP2's get_state_dict through dcp.save, or the lessons') as checkpoint.read
    returns one: (meta, {(name, kind): [(lo, hi, data)]}, {name: step}), its step the optimizer's
    count, its model's shape the only thing `check`able. Every rank reads it whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    sd = {}
    try:
        _load_state_dict(sd, storage_reader=dcp.FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    except Exception as e:
        raise CheckpointError(f"{path}: a DCP checkpoint that cannot be read: {str(e).strip().splitlines()[0]}") from None
    model, state = sd.get("model", {}), sd.get("optim", {}).get("state", {})
    if not model:
        raise CheckpointError(f"{path}: a DCP checkpoint without model.* tensors (get_state_dict's names)")
    index = {(n, "param"): [(0, t.numel(), t.reshape(-1))] for n, t in model.items()}
    steps = {}
    for n, kinds in state.items():
        for kind, t in kinds.items():
            if kind == "step":
                steps[n] = torch.as_tensor(t, dtype=torch.float32)
            elif torch.is_tensor(t) and t.numel() == model[n].numel():
                index[n, kind] = [(0, t.numel(), t.reshape(-1).float())]
    step = int(next(iter(steps.values())).item()) if steps else 0
    writers = len([f for f in os.listdir(path) if f.endswith(".distcp")])
    meta = {"strategy": "DCP", "step": step, "world_size": writers, "config": {}, "rng": [], "aliases": {},
            "precision": str(next(iter(model.values())).dtype).replace("torch.", ""), "loss_scale": None,
            "params": {n: list(t.shape) for n, t in model.items()}}
    if check is not None:
        check(meta)
    reshard.check_cover(path, index, {n: [c] for n, c in steps.items()}, meta["params"])
    return meta, index, steps
