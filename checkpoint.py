"""Checkpoints that survive a crash and a change of world size, for every lesson.

The idea that makes the world size not matter: every piece of state is a contiguous range
[lo, hi) of ONE parameter's flattened values, of one kind: "param" (the working parameter, in its
working dtype), "master" (the fp32 master weights, only where they are a separate copy: bf16),
and the optimizer's per-element state ("exp_avg", "exp_avg_sq" for AdamW, with its step count).
Each rank writes the ranges it owns. Loading opens every rank's file (memory-mapped: a rank
reads the pages it copies), checks that the ranges of each parameter cover every element exactly
once, then fills whatever the NEW layout gives this rank: its shard under N' ranks, or the whole
parameter. So resuming at another world size is the same code as resuming at the same one. (So
DIR must be one directory that every rank sees: on several nodes, a shared filesystem.)

A strategy says what it holds with a function `checkpoint_shards(names) -> [FlatShard, ...]`
(01-03: optimizers.MixedPrecisionAdamW's method; 04, 05 and 06 each have theirs, at the end of
the lesson; 04's and 05's use flat_buffer_shards). On disk, DIR/step_000040/:
    rank{r}.pt   rank r's ranges and RNG state        (torch.save; read with weights_only=True)
    meta.json    rank 0: config, step, world size, layout (who wrote which range), parameters
                 (each rank's RNG state is in its own file: every rank draws its own numbers)
    COMPLETE     rank 0, after every rank's file is in place: no marker, no checkpoint
Every file is written to a temporary name and renamed (atomic on POSIX), so a crash during a
save leaves the previous complete checkpoint untouched. torch and the standard library only.
"""
import glob
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

FORMAT = 1
KEEP = 2  # complete checkpoints kept; older step directories are deleted after a save


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
    whole; none writes it) and, per piece of my shard (optimizers.shard_pieces), that part of it,
    its fp32 master and `optim`'s state for it, which I write and load."""
    layout = [(names[p], p.numel()) for p in params]
    return [FlatShard(layout, {"param": (0, flat_param)}, owned=(0, 0))] + [
        FlatShard([(names[p], p.numel())], {"param": (lo, flat_param[offset + lo:offset + hi]), "master": (lo, piece)},
                  owned=(lo, hi), optim=optim)
        for p, offset, lo, hi, piece in pieces]


def _pieces(params, a, b):
    """(name, lo, hi, flat) for each parameter's part of flat range [a, b): its elements lo..hi,
    which sit at flat offset `flat`. Padding belongs to no parameter."""
    offset = 0
    for name, numel in params:
        lo, hi = max(a - offset, 0), min(b - offset, numel)
        if lo < hi:
            yield name, lo, hi, offset + lo
        offset += numel


def _shards(module, holder):
    names = {p: n for n, p in module.named_parameters()}  # a tied weight: its first name
    shards = holder(names)
    packed = {n for s in shards for n, _ in s.params}
    for p, n in names.items():  # parameters the strategy replicates and no optimizer updates
        if n not in packed:      # (frozen ones in 04, 05): rank 0 writes them, every rank loads
            shards.append(FlatShard([(n, p.numel())], {"param": (0, p)}, (0, p.numel() * (dist.get_rank() == 0))))
    return shards


def _master(shard):
    """(start, master, separate): the tensor the optimizer updates, and whether it is a copy of
    the parameters (bf16) or the parameters themselves (fp32). None without an optimizer."""
    if "master" not in shard.tensors:
        return None
    start, master = shard.tensors["master"]
    param = shard.tensors["param"][1]
    return start, master, master.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------- save
def _write_atomic(path, write):
    """Write to a temporary name in the same directory, flush to disk, rename: a reader sees the
    old file or the whole new one, never half of it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)  # make the rename itself durable
    os.fsync(fd)
    os.close(fd)


def save(path, step, module, holder, meta):
    """Collective: every rank writes path/rank{r}.pt, rank 0 meta.json and then COMPLETE."""
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        if os.path.exists(os.path.join(path, "COMPLETE")):  # saving this step again: it is not
            os.remove(os.path.join(path, "COMPLETE"))        # complete until every file is new
    # One id for this save, in every file of it: a rank file from another save (another run, or
    # this step saved again) can have the same step and ranges, and must still be refused.
    # (uuid, not torch's generator: saving must not move the RNG a resumed run continues.)
    save_id = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(save_id, src=0)  # also the barrier: the directory exists
    save_id = save_id[0]
    entries = []
    for s in _shards(module, holder):
        kinds, state = {"param": s.tensors["param"]}, {}
        if _master(s) is not None:
            start, master, separate = _master(s)
            if separate:
                kinds["master"] = (start, master)
            state = s.optim.state.get(master, {})  # empty until the optimizer's first step
            kinds.update({k: (start, v) for k, v in state.items()  # exp_avg, exp_avg_sq
                          if k != "step" and torch.is_tensor(v) and v.numel() == master.numel()})
        for kind, (start, t) in kinds.items():
            flat = t.detach().reshape(-1)
            a, b = max(start, s.owned[0]), min(start + flat.numel(), s.owned[1])  # what I own of t
            for name, lo, hi, at in _pieces(s.params, a, b):
                entries.append(dict(name=name, kind=kind, lo=lo, hi=hi,
                                    step=state["step"].cpu() if kind in state else None,  # AdamW's count
                                    # a copy: saving a view would save its whole storage
                                    data=flat[at - start:at - start + hi - lo].to("cpu", copy=True)))
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None}
    _write_atomic(os.path.join(path, f"rank{rank}.pt"), lambda f: torch.save(
        {"format": FORMAT, "save_id": save_id, "rank": rank, "step": step, "entries": entries, "rng": rng}, f))
    layout = [[e["name"], e["kind"], e["lo"], e["hi"]] for e in entries]
    layouts = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, layout)  # also the barrier: every rank's file is in place
    if rank == 0:
        meta = {**meta, "format": FORMAT, "save_id": save_id, "step": step, "world_size": len(layouts),
                "torch": torch.__version__,
                "params": {n: list(p.shape) for n, p in module.named_parameters()},
                "aliases": _aliases(module)}
        # readable: the layout last, one range a line (json.loads gives back meta + layout)
        rows = ",\n".join(" [" + ",\n  ".join(json.dumps(r) for r in ranks) + "]" for ranks in layouts)
        text = json.dumps(meta, indent=1)[:-2] + ',\n "layout": [\n' + rows + "\n ]\n}\n"
        _write_atomic(os.path.join(path, "meta.json"), lambda f: f.write(text.encode()))
        _write_atomic(os.path.join(path, "COMPLETE"), lambda f: f.write(b"ok\n"))
        _prune(os.path.dirname(path))


def _aliases(module):
    """{other name: first name} for tied weights (GPT: lm_head.weight -> wte.weight)."""
    first = {p: n for n, p in module.named_parameters()}
    return {n: first[p] for n, p in module.named_parameters(remove_duplicate=False) if first[p] != n}


def _steps(root):
    found = [(int(m.group(1)), d) for d in glob.glob(os.path.join(glob.escape(root), "step_*"))
             if (m := re.fullmatch(r"step_(\d+)", os.path.basename(d)))]
    return [d for _, d in sorted(found)]


def latest(root):
    """The newest step directory with its COMPLETE marker, or None."""
    done = [d for d in _steps(root) if os.path.exists(os.path.join(d, "COMPLETE"))]
    return done[-1] if done else None


def _prune(root):
    """Keep the newest KEEP complete checkpoints; delete every step directory older than them."""
    steps = _steps(root)
    done = [d for d in steps if os.path.exists(os.path.join(d, "COMPLETE"))]
    if len(done) > KEEP:
        for d in steps[:steps.index(done[-KEEP])]:
            shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------- load
def read(path, check=None):
    """meta.json (first passed to check(meta), which may refuse it) and every rank's entries,
    validated: each parameter's ranges of each kind must cover its elements exactly once.
    Returns (meta, {(name, kind): [(lo, hi, data)]}, {name: AdamW step count})."""
    if not os.path.exists(os.path.join(path, "COMPLETE")):
        raise CheckpointError(f"{path} has no COMPLETE marker: an interrupted save, not a checkpoint")
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/meta.json is unreadable: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {meta.get('format')}; this code reads format {FORMAT}")
    if check is not None:
        check(meta)
    index, steps, meta["rng"] = {}, {}, []
    for r, layout in enumerate(meta["layout"]):
        file = os.path.join(path, f"rank{r}.pt")
        if not os.path.exists(file):
            raise CheckpointError(f"{file} is missing ({meta['world_size']} ranks saved this checkpoint)")
        try:  # weights_only: tensors and plain containers, never arbitrary code; mmap: read lazily;
            # map_location: to the CPU first, whatever device wrote it (N GPUs load on M, or a CPU)
            saved = torch.load(file, weights_only=True, mmap=True, map_location="cpu")
        except Exception as e:
            raise CheckpointError(f"{file} is unreadable (truncated or corrupt): {str(e).splitlines()[0]}") from None
        if saved.get("save_id") != meta.get("save_id") or saved["step"] != meta["step"] \
                or [[e["name"], e["kind"], e["lo"], e["hi"]] for e in saved["entries"]] != layout:
            raise CheckpointError(f"{file} does not belong to this checkpoint (another save wrote it)")
        meta["rng"].append(saved["rng"])
        for e in saved["entries"]:
            if e["data"].numel() != e["hi"] - e["lo"]:
                raise CheckpointError(f"{file}: {e['name']} ({e['kind']}) holds the wrong number of elements")
            index.setdefault((e["name"], e["kind"]), []).append((e["lo"], e["hi"], e["data"]))
            if e["step"] is not None:
                steps.setdefault(e["name"], []).append(e["step"])
    numel = {n: torch.Size(shape).numel() for n, shape in meta["params"].items()}
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
    return meta, index, {n: counts[0] for n, counts in steps.items()}


def _gather(index, name, kind, lo, hi):
    """Elements lo..hi of one parameter's state, from the pieces that hold them."""
    return torch.cat([d[max(lo, a) - a:min(hi, b) - a] for a, b, d in index[name, kind] if a < hi and b > lo])


def _fill(t, start, params, index, kind_of):
    """A new tensor like t (flat elements start ..), filled from the checkpoint; padding zero."""
    new = torch.zeros(t.numel(), dtype=t.dtype, device=t.device)
    for name, lo, hi, at in _pieces(params, start, start + t.numel()):
        kind = kind_of(name)
        if (name, kind) not in index:
            raise CheckpointError(f"the checkpoint has no {kind} for {name}")
        new[at - start:at - start + hi - lo] = _gather(index, name, kind, lo, hi)
    return new.view_as(t)


def _stage(shards, index, steps):
    """Every value this rank will hold under the new layout, built without touching a live
    tensor: [(live tensor, new value)] and [(optimizer, master, new state or None)]."""
    copies, states = [], []
    for s in shards:
        copies.append((s.tensors["param"][1], _fill(s.tensors["param"][1], s.tensors["param"][0], s.params,
                                                      index, lambda n: "param")))
        if _master(s) is None:
            continue
        start, master, separate = _master(s)
        if separate:  # bf16: the fp32 masters (in fp32 the master IS the parameter, filled above)
            copies.append((master, _fill(master, start, s.params, index,
                                         lambda n: "master" if (n, "master") in index else "param")))
        names = [n for n, *_ in _pieces(s.params, start, start + master.numel())]
        kinds = sorted({k for (n, k) in index if n in names or not names} - {"param", "master"})
        if not kinds:  # never stepped: 01-03's parameter that has had no gradient yet
            states.append((s.optim, master, None))
            continue
        # AdamW counts steps per tensor (a shard of padding only takes any parameter's count)
        state = {"step": ([steps[n] for n in names if n in steps] or list(steps.values()))[0].clone()}
        for kind in kinds:  # exp_avg, exp_avg_sq: created here as torch creates them, lazily
            state[kind] = _fill(master, start, s.params, index, lambda n: kind)
        states.append((s.optim, master, state))
    return copies, states


def load(path, module, holder, check=None):
    """Collective: validate everything on every rank, agree, and only then copy into the live
    tensors, so a bad checkpoint is refused on every rank and never half-loaded. Returns meta."""
    error = None
    try:
        meta, index, steps = read(path, check)  # check: the caller's refusals (lesson, model, ...)
        shapes = {n: list(p.shape) for n, p in module.named_parameters()}
        differ = sorted(n for n in shapes.keys() | meta["params"].keys() if shapes.get(n) != meta["params"].get(n))
        if differ:
            raise CheckpointError(f"{path} holds other parameters than this model: {', '.join(differ[:4])}")
        copies, states = _stage(_shards(module, holder), index, steps)
    except Exception as e:  # any rank's problem is every rank's: agree before copying anything
        error = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if any(errors):
        raise CheckpointError(next(e for e in errors if e))
    with torch.no_grad():  # validated and staged: from here on nothing can fail half way
        for live, new in copies:
            live.copy_(new)
        for optim, master, state in states:
            optim.state.pop(master, None)
            if state is not None:
                optim.state[master] = state
    rank = dist.get_rank()
    if rank < len(meta["rng"]):  # the lessons draw no random numbers; restored for code that does
        torch.set_rng_state(meta["rng"][rank]["cpu"])
        if meta["rng"][rank]["cuda"] is not None and torch.cuda.is_initialized():
            torch.cuda.set_rng_state(meta["rng"][rank]["cuda"])
    return meta


def consolidate(path):
    """One plain {name: fp32 tensor} state_dict, tied names included, padding gone: loadable by
    model.GPT(...).load_state_dict(sd) without torch.distributed. The fp32 master values where
    the checkpoint has them (bf16: the truth; the working bf16 weights are them rounded)."""
    meta, index, _ = read(path)
    sd = {}
    for name, shape in meta["params"].items():
        kind = "master" if (name, "master") in index else "param"
        sd[name] = _gather(index, name, kind, 0, torch.Size(shape).numel()).float().view(shape).clone()
    for alias, name in meta["aliases"].items():
        sd[alias] = sd[name]
    return sd


# ----------------------------------------------------------------------------- the lessons' flags
class Checkpointer:
    """--checkpoint-dir DIR, --save-every K, --resume for one lesson's training loop.

    strategy  the lesson's strategy name ("zero1"): a checkpoint of another lesson is refused
    module    the plain model (names and shapes: GPT's, so a checkpoint consolidates into GPT)
    holder    checkpoint_shards(names) -> [FlatShard]: what this rank holds (a method or a function)
    """

    # the model's shape and precision, and the data stream (step k's batch is a function of the
    # seed and the global batch): a resumed run must continue the same stream to equal one
    # that never stopped. --lr, --grad-clip, --grad-accum, --bucket-mb may change.
    MUST_MATCH = ("precision", "vocab_size", "seq_len", "n_layer", "d_model", "n_head",
                  "seed", "global_batch")

    def __init__(self, args, env, strategy, module, holder):
        self.args, self.env, self.strategy, self.module, self.holder = args, env, strategy, module, holder

    def resume(self):
        """With --resume: load the newest complete checkpoint and return its step, the next step
        to run (the data is indexed by step, so that is also the position in the data); else 0."""
        a = self.args
        if not a.resume:
            if a.save_every and _steps(a.checkpoint_dir):  # --resume would later mix two runs' files
                raise CheckpointError(f"--checkpoint-dir {a.checkpoint_dir} already holds checkpoints: "
                                      "add --resume to continue from them, or choose another directory")
            return 0
        path = latest(a.checkpoint_dir)
        if path is None:
            raise CheckpointError(f"--resume: no complete checkpoint in {a.checkpoint_dir}")
        self.path = path
        meta = load(path, self.module, self.holder, check=self._check)
        if self.env.master:
            print(f"resumed from {path}: step {meta['step']}, saved at world size {meta['world_size']}, "
                  f"now {self.env.world_size}", flush=True)
        return meta["step"]

    def _check(self, meta):
        ours = {"strategy": self.strategy, **{k: getattr(self.args, k) for k in self.MUST_MATCH}}
        theirs = {"strategy": meta["strategy"], **{k: meta["config"].get(k) for k in self.MUST_MATCH}}
        differ = [f"{k} {theirs[k]} (checkpoint) != {ours[k]} (this run)" for k in ours if ours[k] != theirs[k]]
        if differ:
            raise CheckpointError(f"{self.path} does not match this run: {'; '.join(differ)}")
        if meta["step"] >= self.args.steps:
            raise CheckpointError(f"the newest checkpoint is at step {meta['step']}: nothing left to do "
                                  f"with --steps {self.args.steps}")

    def maybe_save(self, step):
        """After `step` optimizer steps: save every --save-every steps (the last one too, if due)."""
        a = self.args
        if a.save_every and step % a.save_every == 0:
            path = os.path.join(a.checkpoint_dir, f"step_{step:06d}")
            meta = {"strategy": self.strategy, "precision": a.precision, "config": vars(a),
                    # the data of step k is global_batch(seed, k, ...) whatever the world size
                    "data": {"next_step": step, "seed": a.seed, "global_batch": a.global_batch}}
            save(path, step, self.module, self.holder, meta)
            if self.env.master:
                print(f"checkpoint {path} saved (world size {self.env.world_size})", flush=True)
