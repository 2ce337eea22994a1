"""Checkpoints that survive a crash and a change of world size, for every lesson (docs/checkpoints.md).
Each rank writes what it owns as ranges [lo, hi) of ONE parameter's flat values, of one kind ("param",
"master", or its optimizer's state: AdamW's "exp_avg", "exp_avg_sq" and step, SGD's "momentum_buffer");
loading fills what the NEW layout gives this rank (reshard.py). A strategy says what it holds with
`checkpoint_shards(names) -> [FlatShard, ...]`."""
import glob
import json
import os
import re
import shutil
import uuid

import torch
import torch.distributed as dist

from lessonkit import dcp, lifecycle, reshard
from lessonkit.reshard import CheckpointError

FORMAT, KEEP = 1, 2  # the files' format; complete checkpoints kept (older ones deleted after a save)
FlatShard, flat_buffer_shards, unit_shards = reshard.FlatShard, reshard.flat_buffer_shards, reshard.unit_shards


# ----------------------------------------------------------------------------- save
def _write_atomic(path, write):
    """Write a temporary file, fsync, rename, fsync the directory: readers see the old or the whole new file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def save(path, step, module, holder, meta):
    """Collective: every rank writes path/rank{r}.pt, rank 0 meta.json and then COMPLETE."""
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        if os.path.exists(os.path.join(path, "COMPLETE")):  # saving this step again: it is not
            os.remove(os.path.join(path, "COMPLETE"))        # complete until every file is new
    # One id per save, in all its files: another save's rank file (another run, this step saved again)
    # can have the same step and ranges. (uuid: saving must not move the RNG a resumed run continues.)
    save_id = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(save_id, src=0)  # also the barrier: the directory exists
    entries = []
    for s in reshard.shards(module, holder):
        kinds, state = {"param": s.tensors["param"]}, {}
        if reshard.master_of(s) is not None:
            start, master, separate = reshard.master_of(s)
            kinds.update({"master": (start, master)} if separate else {})
            state = s.optim.state.get(master, {})  # empty until the optimizer's first step
            kinds.update({k: (start, v) for k, v in state.items()  # exp_avg, exp_avg_sq; SGD's momentum_buffer
                          if k != "step" and torch.is_tensor(v) and v.numel() == master.numel()})
        for kind, (start, t) in kinds.items():
            flat = t.detach().reshape(-1)
            a, b = max(start, s.owned[0]), min(start + flat.numel(), s.owned[1])  # what I own of t
            for name, lo, hi, at in reshard.parts(s.params, a, b):
                entries.append(dict(name=name, kind=kind, lo=lo, hi=hi,
                                    step=state["step"].cpu() if kind in state and "step" in state else None,  # AdamW's
                                    # a copy: saving a view would save its whole storage
                                    data=flat[at - start:at - start + hi - lo].to("cpu", copy=True)))
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None}
    _write_atomic(os.path.join(path, f"rank{rank}.pt"), lambda f: torch.save(
        {"format": FORMAT, "save_id": save_id[0], "rank": rank, "step": step, "entries": entries, "rng": rng}, f))
    first = {p: n for n, p in module.named_parameters()}  # aliases: tied names (lm_head -> wte)
    aliases = {n: first[p] for n, p in module.named_parameters(remove_duplicate=False) if first[p] != n}
    dcp.save(path, entries, {n: tuple(p.shape) for n, p in module.named_parameters()}, aliases)  # PyTorch's format too
    layouts = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, _layout(entries))  # a barrier too
    if rank == 0:
        meta = {**meta, "format": FORMAT, "save_id": save_id[0], "step": step, "world_size": len(layouts), "aliases": aliases,
                "torch": torch.__version__, "params": {n: list(p.shape) for n, p in module.named_parameters()}}
        # readable: the layout last, one range a line (json.loads gives back meta + layout)
        rows = ",\n".join(" [" + ",\n  ".join(json.dumps(r) for r in ranks) + "]" for ranks in layouts)
        text = json.dumps(meta, indent=1)[:-2] + ',\n "layout": [\n' + rows + "\n ]\n}\n"
        _write_atomic(os.path.join(path, "meta.json"), lambda f: f.write(text.encode()))
        _write_atomic(os.path.join(path, "COMPLETE"), lambda f: f.write(b"ok\n"))
        _prune(os.path.dirname(path))


def _layout(entries):
    """A rank file's entries as meta.json's layout lists them: [name, kind, lo, hi] each."""
    return [[e["name"], e["kind"], e["lo"], e["hi"]] for e in entries]


def _steps(root, complete=False):
    """The step directories under root, oldest first (complete: only those with the marker)."""
    found = sorted((int(m.group(1)), d) for d in glob.glob(os.path.join(glob.escape(root), "step_*"))
                   if (m := re.fullmatch(r"step_(\d+)", os.path.basename(d))))
    return [d for _, d in found if not complete or os.path.exists(os.path.join(d, "COMPLETE")) or dcp.foreign(d)]


def latest(root):
    """The newest step directory with its COMPLETE marker, or None."""
    return (_steps(root, complete=True) or [None])[-1]


def _prune(root):
    """Keep the newest KEEP complete checkpoints; delete every step directory older than them."""
    steps, done = _steps(root), _steps(root, complete=True)
    if len(done) > KEEP:
        for d in steps[:steps.index(done[-KEEP])]:
            shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------- load
def read(path, check=None):
    """meta.json (first passed to check(meta), which may refuse it) and every rank's entries,
    validated: each parameter's ranges of each kind must cover its elements exactly once.
    Returns (meta, {(name, kind): [(lo, hi, data)]}, {name: AdamW's step count; SGD keeps none})."""
    if dcp.foreign(path):  # written by PyTorch's DCP alone (FSDP2's): dcp.py reads it
        return dcp.read(path, check)
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
        if (saved.get("save_id"), saved["step"], _layout(saved["entries"])) != (meta.get("save_id"), meta["step"], layout):
            raise CheckpointError(f"{file} does not belong to this checkpoint (another save wrote it)")
        meta["rng"].append(saved["rng"])
        for e in saved["entries"]:
            if e["data"].numel() != e["hi"] - e["lo"]:
                raise CheckpointError(f"{file}: {e['name']} ({e['kind']}) holds the wrong number of elements")
            index.setdefault((e["name"], e["kind"]), []).append((e["lo"], e["hi"], e["data"]))
            if e["step"] is not None:
                steps.setdefault(e["name"], []).append(e["step"])
    reshard.check_cover(path, index, steps, meta["params"])
    return meta, index, {n: counts[0] for n, counts in steps.items()}


def load(path, module, holder, check=None):
    """Collective: validate on every rank, agree, only then copy: refused everywhere or loaded whole. Returns meta."""
    error = None
    try:
        meta, index, steps = read(path, check)  # check: the caller's refusals (lesson, model, ...)
        reshard.check_shapes(path, module, meta["params"])
        copies, states = reshard.stage(reshard.shards(module, holder), index, steps)
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
    rng = meta["rng"][dist.get_rank()] if dist.get_rank() < len(meta["rng"]) else None
    if rng is not None:  # the lessons draw no random numbers; restored for code that does
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_initialized():
            torch.cuda.set_rng_state(rng["cuda"])
    return meta


# ----------------------------------------------------------------------------- the lessons' flags
class Checkpointer:
    """--checkpoint-dir DIR, --save-every K, --resume for one lesson's training loop.

    strategy  the lesson's strategy name ("zero1"), saved: any lesson resumes any lesson's checkpoint
    module    the plain model (names and shapes: GPT's, so a checkpoint consolidates into GPT)
    holder    checkpoint_shards(names) -> [FlatShard]: what this rank holds
    loss_scaler  fp16's (loss_scale.py): its state_dict saved in meta.json, loaded on resume
    """

    # the model's shape and precision, and the data stream (step k's batch: a function of the seed and
    # the global batch), so a resumed run equals one that never stopped. --lr, --grad-clip etc. may change.
    MUST_MATCH = ("precision", "vocab_size", "seq_len", "n_layer", "d_model", "n_head", "seed", "global_batch")

    def __init__(self, args, env, strategy, module, holder, loss_scaler=None):
        self.args, self.env, self.strategy, self.module, self.holder = args, env, strategy, module, holder
        self.loss_scaler = loss_scaler if loss_scaler is not None and loss_scaler.enabled else None
        self.say = (lambda line: print(line, flush=True)) if env.master else (lambda line: None)  # rank 0 speaks

    def resume(self):
        """With --resume: load the newest complete checkpoint, return its step (the next to run; the data is
        indexed by step); else 0. auto: the same if there is one, else 0: a job's first run and its restarts."""
        a = self.args
        if not a.resume:
            if a.save_every and _steps(a.checkpoint_dir):  # --resume would later mix two runs' files
                torn = [os.path.basename(d) for d in _steps(a.checkpoint_dir)] if latest(a.checkpoint_dir) is None else []
                raise CheckpointError(f"--checkpoint-dir {a.checkpoint_dir} " + (  # (torn: --resume finds nothing)
                    f"holds only incomplete checkpoints ({', '.join(torn)}: interrupted saves): delete them"
                    if torn else "already holds checkpoints: add --resume to continue from them") + " or choose another directory")
            return 0
        found = [latest(a.checkpoint_dir)]  # (an interrupted save has no COMPLETE: the one before it)
        dist.broadcast_object_list(found, src=0)  # rank 0's: no rank starts fresh while others load
        self.path = found[0]
        if self.path is None and a.resume == "auto":
            self.say(f"--resume auto: no complete checkpoint in {a.checkpoint_dir}: starting at step 0")
            return 0
        if self.path is None:
            raise CheckpointError(f"--resume: no complete checkpoint in {a.checkpoint_dir}")
        meta = load(self.path, self.module, self.holder, check=self._check)
        if meta["step"] >= a.steps:  # (_check let it through) --resume auto: a job that finished, restarted
            self.say(f"--resume auto: {self.path} is at step {meta['step']}, --steps {a.steps}: the run has "
                     "finished, nothing left to do")
            lifecycle.exit_process(0)
        if self.loss_scaler is not None and meta["loss_scale"]:  # the scale, growth tracker, skipped steps
            self.loss_scaler.load_state_dict(meta["loss_scale"])
        by = "" if meta["strategy"] == self.strategy else f" (written by {meta['strategy']}, read by {self.strategy})"
        self.say(f"resumed from {self.path}: step {meta['step']}, saved at world size {meta['world_size']}, "
                 f"now {self.env.world_size}{by}")
        return meta["step"]

    def _check(self, meta):  # the lesson that wrote it need not match (its layout is its own), its optimizer must
        ours = {k: getattr(self.args, k) for k in self.MUST_MATCH}
        theirs = {k: meta["config"].get(k, ours[k]) for k in self.MUST_MATCH}  # (DCP's own files: no flags saved)
        differ = [f"{k} {theirs[k]} (checkpoint) != {ours[k]} (this run)" for k in ours if ours[k] != theirs[k]]
        if "muon" in (meta["strategy"], self.strategy) and meta["strategy"] != self.strategy:  # 09: Muon's, not AdamW's
            differ.append(f"its optimizer state is {meta['strategy']}'s, this run's {self.strategy}'s (09 steps Muon)")
        if differ:
            raise CheckpointError(f"{self.path} does not match this run: {'; '.join(differ)}")
        if meta["step"] >= self.args.steps and self.args.resume != "auto":
            raise CheckpointError(f"the newest checkpoint is at step {meta['step']}: nothing left to do with --steps {self.args.steps}")

    def maybe_save(self, step):
        """After `step` optimizer steps: save every --save-every steps (the last one too, if due)."""
        a = self.args
        if a.save_every and step % a.save_every == 0:
            path = os.path.join(a.checkpoint_dir, f"step_{step:06d}")
            meta = {"strategy": self.strategy, "precision": a.precision, "config": vars(a),
                    # the data of step k is global_batch(seed, k, ...) whatever the world size
                    "data": {"next_step": step, "seed": a.seed, "global_batch": a.global_batch},
                    "loss_scale": self.loss_scaler and self.loss_scaler.state_dict()}  # fp16; else None
            save(path, step, self.module, self.holder, meta)
            self.say(f"checkpoint {path} saved (world size {self.env.world_size})")

