"""Measurement, observed from outside the lessons: communication, memory, time, the report.

- CommMeter wraps the torch.distributed collectives while a chosen step runs and counts each
  call and its payload. The lessons call `dist.all_reduce(...)` as usual and never report
  their own traffic.
- MemoryLedger walks the tensors a strategy and its optimizer actually hold and sums their
  storages (each storage once), by category. Sampled after every tensor operation of the
  measured step, it also finds the most parameter bytes alive at once (`peak_params`).
- Run times every step, logs one line from rank 0, and writes the summary and JSON report.
Only `--measure-step` is measured, so the other steps run with nothing patched.
"""
import json
import resource
import statistics
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import common

# ----------------------------------------------------------------------------- theory
# bytes per parameter of each model state (ZeRO paper, section 3.1): fp32 training keeps fp32
# parameters, gradients and two Adam moments; bf16 mixed precision keeps bf16 parameters and
# gradients plus K = 12 bytes of fp32 optimizer state (master weights and two moments).
STATE_BYTES = {"fp32": {"params": 4, "grads": 4, "optimizer": 8},
               "bf16": {"params": 2, "grads": 2, "optimizer": 12}}
# which states each stage divides by N
SHARDED = {"vanilla_dp": (), "async_allreduce": (), "buckets": (),
           "zero1": ("optimizer",), "zero2": ("optimizer", "grads"),
           "zero3": ("optimizer", "grads", "params")}
STAGE = {"vanilla_dp": 0, "async_allreduce": 0, "buckets": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def theory_memory(strategy, psi, world, precision):
    """Bytes per rank for each model state, ZeRO paper Figure 1 / Table 1."""
    out = {}
    for key, b in STATE_BYTES[precision].items():
        out[key] = psi * b / world if key in SHARDED[strategy] else psi * b
    out["peak_params"] = out["params"]  # ZeRO-3 adds the gathered units in flight
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


# ring factor: bytes one rank sends, per byte of the full-size tensor
RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n,
               "all_gather": lambda n: (n - 1) / n,
               "broadcast": lambda n: (n - 1) / n}


def theory_ring_bytes(strategy, psi, world, precision):
    """ZeRO paper section 7: 2 Psi elements per rank per step for DP, ZeRO-1 and ZeRO-2 (an
    all-reduce, or a reduce-scatter plus an all-gather), 3 Psi for ZeRO-3; times (N-1)/N."""
    elems = 3 * psi if strategy == "zero3" else 2 * psi
    return elems * (world - 1) / world * STATE_BYTES[precision]["params"]


# ----------------------------------------------------------------------------- communication
# name in torch.distributed -> (kind, index of the full-size tensor among the arguments)
_COLLECTIVES = {
    "all_reduce": ("all_reduce", 0),
    "reduce_scatter_single": ("reduce_scatter", 1), "reduce_scatter_tensor": ("reduce_scatter", 1),
    "all_gather_single": ("all_gather", 0), "all_gather_into_tensor": ("all_gather", 0),
    "broadcast": ("broadcast", 0),
}
_UNMETERED = ["all_gather", "reduce_scatter", "reduce", "all_to_all_single", "gather", "scatter"]


class CommMeter:
    """Counts collectives issued through torch.distributed while `with meter.measuring():`."""

    def __init__(self, world_size):
        self.world = world_size
        self.ops = {}

    def _record(self, kind, tensor):
        entry = self.ops.setdefault(kind, {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += tensor.numel() * tensor.element_size()

    @contextmanager
    def measuring(self):
        originals = {}

        def wrap(name, kind, index):
            fn = getattr(dist, name)

            def metered(*args, **kwargs):
                tensor = args[index] if len(args) > index else next(iter(kwargs.values()))
                self._record(kind, tensor)
                return fn(*args, **kwargs)
            return fn, metered

        for name, (kind, index) in _COLLECTIVES.items():
            originals[name], metered = wrap(name, kind, index)
            setattr(dist, name, metered)
        for name in _UNMETERED:  # a lesson calling one of these would go uncounted: refuse
            originals[name] = getattr(dist, name)
            setattr(dist, name, _unmetered(name))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    def ring_bytes(self):
        return sum(RING_FACTOR[k](self.world) * v["bytes"] for k, v in self.ops.items())


def _unmetered(name):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"dist.{name} is not metered; add it to measure._COLLECTIVES")
    return refuse


# ----------------------------------------------------------------------------- memory
CATEGORIES = ("params", "grads", "optimizer", "other")


class MemoryLedger:
    """Bytes held per category, from the tensors reachable from the model, the strategy object
    and the optimizer, each storage counted once (views of one flat buffer count once).

    Classification: model parameters -> params; any `.grad` -> grads; optimizer state and
    optimizer-owned parameters (fp32 master weights) -> optimizer; other tensors held by the
    strategy -> by the attribute's name ("grad" -> grads, "master" -> optimizer, "param" ->
    params), else "other". Freed storages (ZeRO-3's `resize_(0)`) count as zero bytes.
    """

    def __init__(self, model, roots):
        self.model, self.roots = model, roots

    def tensors(self):
        """Yield (category, tensor) for everything held; params first so views dedup to them."""
        found = []
        for p in self.model.parameters():
            found.append(("params", p))
        for p in self.model.parameters():
            if p.grad is not None:
                found.append(("grads", p.grad))
        seen = set()
        for root in self.roots:
            self._walk(root, "other", found, seen, depth=0)
        return found

    def _walk(self, obj, category, found, seen, depth):
        if id(obj) in seen or depth > 8:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append((category, obj))
            if obj.grad is not None:
                found.append(("grads", obj.grad))
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for p in group["params"]:
                    self._walk(p, "optimizer", found, seen, depth + 1)
            for state in obj.state.values():
                for t in state.values():
                    self._walk(t, "optimizer", found, seen, depth + 1)
        elif isinstance(obj, nn.Module):
            for t in list(obj.parameters()) + list(obj.buffers()):
                self._walk(t, "params", found, seen, depth + 1)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                self._walk(v, _category(str(k), category), found, seen, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                self._walk(v, category, found, seen, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__ not in (
                "torch.distributed.distributed_c10d", "torch._C._distributed_c10d"):
            for k, v in vars(obj).items():
                self._walk(v, _category(k, category), found, seen, depth + 1)

    def measure(self):
        totals = dict.fromkeys(CATEGORIES, 0)
        counted = set()
        for category, t in self.tensors():
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (storage.data_ptr(), t.device)
            if storage.nbytes() == 0 or key in counted:
                continue
            counted.add(key)
            totals[category] += storage.nbytes()
        return totals


def _category(name, inherited):
    name = name.lower()
    if "grad" in name:
        return "grads"
    if "master" in name or "optim" in name or "exp_avg" in name:
        return "optimizer"
    if "param" in name:
        return "params"
    return inherited


class _PeakParams(TorchDispatchMode):
    """Samples the parameter bytes alive after every tensor operation of the measured step."""

    def __init__(self, ledger):
        super().__init__()
        self.ledger, self.peak = ledger, 0

    def sample(self):
        self.peak = max(self.peak, self.ledger.measure()["params"])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out


# ----------------------------------------------------------------------------- the run
class Run:
    """Per-step timing, rank-0 logging, measurement of one chosen step, summary and report."""

    def __init__(self, args, env, strategy, model, optimizer, holders=()):
        self.args, self.env, self.strategy = args, env, strategy
        self.model, self.optimizer = model, optimizer
        self.psi = common.n_params(model) if not hasattr(model, "n_params") else model.n_params
        self.ledger = MemoryLedger(model, [*holders, optimizer])
        self.comm = CommMeter(env.world_size)
        self.losses, self.step_times, self.memory = [], [], None
        self.peak_params = None
        self.tokens_per_step = args.global_batch * args.seq_len

    @contextmanager
    def step(self, step):
        """Wrap one optimizer step. Yields a list the lesson appends its micro-step losses to."""
        micro_losses = []
        measure = step == self.args.measure_step
        if self.env.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if measure:
            with self.comm.measuring(), self._memory_probe():
                yield micro_losses
        else:
            yield micro_losses
        if self.env.device.type == "cuda":
            torch.cuda.synchronize()
        self.step_times.append(time.perf_counter() - t0)
        # The logged loss is the global mean: every rank's, averaged (outside the meter).
        loss = torch.stack([l.detach().float() for l in micro_losses]).sum()
        dist.all_reduce(loss)
        self.losses.append(loss.item() / self.env.world_size)
        if self.env.master and (step % self.args.log_every == 0 or step == self.args.steps - 1):
            self._log(step)

    @contextmanager
    def _memory_probe(self):
        """At rest = just before optimizer.step(), when params, grads and optimizer state are
        all alive; peak_params = the most parameter bytes alive after any operation."""
        original = self.optimizer.step

        def step_with_sample(*a, **k):
            self.memory = self.ledger.measure()
            return original(*a, **k)

        self.optimizer.step = step_with_sample
        probe = _PeakParams(self.ledger)
        try:
            with probe:
                probe.sample()
                yield
        finally:
            self.optimizer.step = original
        self.peak_params = probe.peak

    def _log(self, step):
        t = self.step_times[-1]
        print(f"step {step:4d}/{self.args.steps} | loss {self.losses[-1]:.4f} | {t * 1e3:7.1f} ms | "
              f"{self.tokens_per_step / t:9,.0f} tok/s | {_memory_now(self.env)}", flush=True)

    # ------------------------------------------------------------------ summary and report
    def finish(self):
        """Gather every rank's measurements to rank 0, print the summary, write the report."""
        measured = {"memory": {**(self.memory or {}), "peak_params": self.peak_params},
                    "ops": self.comm.ops, "ring_bytes": self.comm.ring_bytes()}
        if self.env.device.type == "cuda":
            measured["memory"]["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
        gathered = [None] * self.env.world_size
        dist.all_gather_object(gathered, measured)
        self.final_report = None
        if self.env.master:
            report = self.final_report = self.report(gathered)
            self._summary(report)
            if self.args.report:
                with open(self.args.report, "w") as f:
                    json.dump(report, f, indent=1)
        return gathered

    def report(self, gathered):
        a, n = self.args, self.env.world_size
        mem_theory = theory_memory(self.strategy, self.psi, n, a.precision)
        return {
            "strategy": self.strategy, "world_size": n, "backend": self.env.backend,
            "device": self.env.device.type, "precision": a.precision, "n_params": self.psi,
            "config": vars(a), "losses": self.losses, "step_time_s": self.step_times,
            "median_step_time_s": statistics.median(self.step_times),
            "tokens_per_s": self.tokens_per_step / statistics.median(self.step_times),
            "comm": {"measured_step": a.measure_step, "per_rank": [g["ops"] for g in gathered],
                     "ops": gathered[0]["ops"],
                     "ring_bytes_per_step": gathered[0]["ring_bytes"],
                     "theory_ring_bytes_per_step": theory_ring_bytes(self.strategy, self.psi, n, a.precision)},
            "memory": {"per_rank": [g["memory"] for g in gathered], "theory": mem_theory},
        }

    def _summary(self, r):
        mib = 2 ** 20
        comm = r["comm"]
        print(f"summary {r['strategy']} | world {r['world_size']} {r['backend']} {r['precision']} | "
              f"Psi = {r['n_params']:,} params | final loss {r['losses'][-1]:.4f} | "
              f"median step {r['median_step_time_s'] * 1e3:.1f} ms")
        ops = ", ".join(f"{k} x{v['calls']} ({v['bytes'] / mib:.2f} MiB)" for k, v in comm["ops"].items())
        print(f"  comm per rank per step (step {comm['measured_step']}): {ops or 'none'}")
        print(f"  ring bytes sent per rank: measured {comm['ring_bytes_per_step'] / mib:.3f} MiB"
              f" | theory {comm['theory_ring_bytes_per_step'] / mib:.3f} MiB")
        m, th = r["memory"]["per_rank"][0], r["memory"]["theory"]
        row = " | ".join(f"{k} {m.get(k, 0) / mib:.2f} (theory {th[k] / mib:.2f})"
                         for k in ("params", "grads", "optimizer", "peak_params"))
        print(f"  memory rank 0, MiB at rest: {row}"
              + (f" | other {m['other'] / mib:.2f}" if m.get("other") else ""), flush=True)


def _memory_now(env):
    if env.device.type == "cuda":
        return f"peak alloc {torch.cuda.max_memory_allocated() / 2 ** 20:.1f} MiB"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return f"peak rss {rss / 1024:.0f} MiB"
