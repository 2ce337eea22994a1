"""Measurement, observed from outside the lessons: communication, memory, time, the report.

- CommMeter wraps the torch.distributed collectives while a chosen step runs and counts each
  call and its payload. The lessons call `dist.all_reduce(...)` as usual and never report
  their own traffic.
- MemoryLedger walks the tensors a strategy and its optimizer actually hold and sums their
  storages (each storage once), by category. Sampled after every tensor operation of the
  measured step, it also finds the most parameter bytes alive at once (`peak_params`).
- Run times every step, logs one line from rank 0, and writes the summary and JSON report,
  each measurement beside its formula from theory.py.
Only `--measure-step` is measured, so the other steps run with nothing patched.
"""
import inspect
import json
import resource
import statistics
import sys
import time
import weakref
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import common
from theory import RING_FACTOR, theory_memory, theory_ring_bytes

# ----------------------------------------------------------------------------- communication
# name in torch.distributed -> (kind, name of the argument holding the full-size tensor); the
# *_single names exist from torch 2.13 on, where the lessons' *_tensor names call them
_COLLECTIVES = {
    "all_reduce": ("all_reduce", "tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"), "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_gather_single": ("all_gather", "output_tensor"), "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "broadcast": ("broadcast", "tensor"),
}
_UNMETERED = ["all_gather", "reduce_scatter", "reduce", "all_to_all_single", "gather", "scatter"]


class CommMeter:
    """Counts collectives issued through torch.distributed while `with meter.measuring():`.

    cpu_timed: the collectives run on the CPU (gloo), so a call and its wait() return when the
    communication is done and timing them on the CPU clock means something. With NCCL they only
    queue work on the GPU, so overlap, timeline and wire bytes are then None (unavailable); the
    GPU's own kernel times give the overlap instead (gpu_overlap, with --trace)."""

    def __init__(self, world_size, cpu_timed=True):
        self.world, self.cpu_timed = world_size, cpu_timed
        self.ops = {}
        self.wire_bytes = None  # what this process wrote while measuring (Linux, gloo): see bytes_written
        # Overlap, timed in the wrappers (perf_counter seconds): a collective's span runs from the
        # call (issue) to its completion; for an async one, completion = when its wait() returns,
        # an upper bound (gloo may finish earlier on its own threads; nothing cheaper observes it).
        # `blocked` holds the intervals the calling thread spent inside a blocking collective or
        # a wait(): communication it did not hide behind compute.
        self.spans, self.blocked, self.window = [], [], None

    def _record(self, kind, tensor):
        entry = self.ops.setdefault(kind, {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += tensor.numel() * tensor.element_size()

    @contextmanager
    def measuring(self):
        originals = {}

        def wrap(name, kind, arg):
            fn = getattr(dist, name)
            signature = inspect.signature(fn)

            def metered(*args, **kwargs):
                bound = signature.bind(*args, **kwargs)
                self._record(kind, bound.arguments[arg])
                t0 = time.perf_counter()
                work = fn(*args, **kwargs)
                if work is None or not bound.arguments.get("async_op"):
                    t1 = time.perf_counter()
                    self.spans.append([kind, t0, t1])
                    self.blocked.append([t0, t1])
                    return work
                span = [kind, t0, None]  # completed by _TimedWork.wait, or at the step's end
                self.spans.append(span)
                return _TimedWork(work, span, self.blocked)
            return fn, metered

        for name, (kind, arg) in _COLLECTIVES.items():
            if not hasattr(dist, name):  # an older torch
                continue
            originals[name], metered = wrap(name, kind, arg)
            setattr(dist, name, metered)
        for name in _UNMETERED:  # a lesson calling one of these would go uncounted: refuse
            originals[name] = getattr(dist, name)
            setattr(dist, name, _unmetered(name))
        written = bytes_written() if self.cpu_timed else None
        start = time.perf_counter()
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
            self.window = (start, time.perf_counter())
        if written is not None:  # the step is over, so every collective it issued has completed
            self.wire_bytes = bytes_written() - written

    def ring_bytes(self):
        return sum(RING_FACTOR[k](self.world) * v["bytes"] for k, v in self.ops.items())

    def overlap(self):
        """comm = union of the collectives' spans within the measured step; exposed = union of
        the intervals the calling thread was blocked on them; hidden share = 1 - exposed / comm.
        A collective still in flight when the step ends (06 prefetching the next step's first
        unit) counts up to the step's end; its later wait() lies outside the step."""
        if self.window is None or not self.cpu_timed:
            return None
        start, end = self.window
        spans = [(max(a, start), min(end if b is None else b, end)) for _, a, b in self.spans]
        blocked = [(max(a, start), min(b, end)) for a, b in self.blocked]
        comm, exposed = _union(spans), _union(blocked)
        return {"comm_ms": comm * 1e3, "exposed_ms": exposed * 1e3,
                "hidden_share": 1 - exposed / comm if comm > 0 else 0.0}

    def timeline(self):
        """Spans in ms from the start of the measured step, for the chart: [kind, start, end]."""
        if self.window is None or not self.cpu_timed:
            return None
        start, end = self.window
        ms = lambda t: (min(t, end) - start) * 1e3
        return {"step_ms": ms(end),
                "comm": [[k, ms(a), ms(end if b is None else b)] for k, a, b in self.spans if a < end],
                "blocked": [[ms(a), ms(b)] for a, b in self.blocked if a < end]}


def gpu_overlap(trace_path):
    """Overlap on a GPU, from a torch.profiler trace of the measured step: comm = the time NCCL
    kernels ran, exposed = the part of it with no other kernel running beside them (the GPU's
    compute did not hide it), hidden share = 1 - exposed / comm. None if the trace has none."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("cat") == "kernel" and "dur" in e]
    comm = [(a, b) for name, a, b in kernels if "nccl" in name.lower()]
    compute = [(a, b) for name, a, b in kernels if "nccl" not in name.lower()]
    if not comm:
        return None
    total = _union(comm)
    hidden = total + _union(compute) - _union(comm + compute)  # |comm & compute|
    return {"comm_ms": total / 1e3, "exposed_ms": (total - hidden) / 1e3,  # trace times are in us
            "hidden_share": hidden / total, "source": "GPU kernel times (profiler)"}


def _union(intervals):
    """Total length covered by a set of [a, b] intervals."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


class _TimedWork:
    """An async collective's Work, passed through, whose wait() records its completion time and
    the time the caller spent blocked in it. Only collectives issued in the measured step get one."""

    def __init__(self, work, span, blocked):
        self._work, self._span, self._blocked = work, span, blocked

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self._work.wait(*args, **kwargs)
        t1 = time.perf_counter()
        if self._span[2] is None:
            self._span[2] = t1
        self._blocked.append([t0, t1])
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def bytes_written():
    """Bytes this process has written so far, all threads (Linux /proc/self/io `wchar`), or None.
    gloo sends over TCP with write calls, so on CPU this counts what actually went on the wire,
    whatever algorithm the backend chose (the ops above count what the lesson asked for)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except (OSError, StopIteration, ValueError):
        return None


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
    `master_weights` is the part of `optimizer` that the optimizers update (fp32 master weights
    in bf16 mode; 0 in fp32 mode, where they update the parameters themselves).
    """

    def __init__(self, model, roots):
        self.model, self.roots = model, roots

    def tensors(self):
        """Yield (category, tensor) for everything held; params first so views dedup to them."""
        found = []
        self._updated = []  # the tensors every optimizer found updates (its param_groups)
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
            self._updated += [p for group in obj.param_groups for p in group["params"]]
            for group in obj.param_groups:
                for p in group["params"]:
                    self._walk(p, "optimizer", found, seen, depth + 1)
            for state in obj.state.values():
                for t in state.values():
                    self._walk(t, "optimizer", found, seen, depth + 1)
            for k, v in vars(obj).items():
                if isinstance(v, torch.optim.Optimizer):  # a wrapped inner one (ZeroRedundancyOptimizer.optim)
                    self._walk(v, "optimizer", found, seen, depth + 1)
                elif k not in ("param_groups", "state", "defaults") and not k.startswith("_"):
                    self._walk(v, _category(k, category), found, seen, depth + 1)  # 04/05's buffers
        elif isinstance(obj, nn.Module):
            for t in list(obj.parameters()) + list(obj.buffers()):
                self._walk(t, "params", found, seen, depth + 1)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                # a non-string key (a parameter, say) names no category; str() of a tensor would
                # print it, reading its memory, which ZeRO-3 (06) may have freed
                self._walk(v, _category(k if isinstance(k, str) else "", category), found, seen, depth + 1)
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
        tensors = self.tensors()
        updated = {_storage_key(t) for t in self._updated}
        totals["master_weights"] = 0  # included in "optimizer"
        for category, t in tensors:
            if type(t).__name__ == "DTensor":  # FSDP2's parameters: count the local shard
                t = t.to_local()
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (storage.data_ptr(), t.device)
            if storage.nbytes() == 0 or key in counted:
                continue
            counted.add(key)
            totals[category] += storage.nbytes()
            if category == "optimizer" and key in updated:
                totals["master_weights"] += storage.nbytes()
        return totals


def _storage_key(t):
    if type(t).__name__ == "DTensor":
        t = t.to_local()
    return None if t.device.type == "meta" else (t.untyped_storage().data_ptr(), t.device)


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
    """Samples the parameter bytes alive after every tensor operation of the measured step.

    Also keeps the series: `timeline` holds [op index, parameter bytes, phase, op name] at every
    operation after which the bytes or the phase (forward, backward, optimizer) changed."""

    def __init__(self, ledger):
        super().__init__()
        self.ledger, self.peak = ledger, 0
        self.ops, self.in_optimizer, self.timeline = 0, False, []

    def sample(self, name="start"):
        params = self.ledger.measure()["params"]
        self.peak = max(self.peak, params)
        phase = ("optimizer" if self.in_optimizer else
                 "backward" if torch._C._current_graph_task_id() != -1 else "forward")
        if not self.timeline or self.timeline[-1][1:3] != [params, phase]:
            self.timeline.append([self.ops, params, phase, name])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        self.sample(str(func))
        return out

    def optimizer_begins(self):
        """From optimizer.step() to the end of the step is the optimizer's phase, and so is what
        ran between the last backward and it (clipping, say)."""
        if any(s[2] == "backward" for s in self.timeline):
            for s in reversed(self.timeline):
                if s[2] != "forward":
                    break
                s[2] = "optimizer"
        self.in_optimizer = True


class PeakAlive(TorchDispatchMode):
    """The most bytes held at once by tensors created while it is active, sampled after every
    tensor operation (each storage once; a freed storage counts zero). Observes a construction
    from outside, e.g. ZeRO-3 (06) materialising a model one unit at a time: everything it
    allocates counts, shards, full units and the initialiser's temporaries alike."""

    def __init__(self):
        super().__init__()
        self.alive, self.peak = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (list, tuple)) else [out]):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.alive.append(weakref.ref(t))
        self.alive = [r for r in self.alive if r() is not None]
        storages = {}
        for r in self.alive:
            t = r()
            if t is not None and t.untyped_storage().nbytes():
                storages[(t.untyped_storage().data_ptr(), t.device)] = t.untyped_storage().nbytes()
        self.peak = max(self.peak, sum(storages.values()))
        return out


# ----------------------------------------------------------------------------- the run
class Run:
    """Per-step timing, rank-0 logging, measurement of one chosen step, summary and report."""

    # Sampling the parameter bytes after every operation of the measured step (peak_params and
    # its timeline) costs about 2 ms per operation, seconds for 01-03's step. A caller that needs
    # neither (scripts/sweep.py, for the lessons whose peak it does not plot) may turn it off:
    # peak_params and the timeline are then None; everything else is measured as before.
    track_peak_params = True

    def __init__(self, args, env, strategy, model, optimizer, holders=()):
        self.args, self.env, self.strategy = args, env, strategy
        self.model, self.optimizer = model, optimizer
        self.psi = common.n_params(model) if not hasattr(model, "n_params") else model.n_params
        self.ledger = MemoryLedger(model, [*holders, optimizer])
        self.cuda = env.device.type == "cuda"
        self.comm = CommMeter(env.world_size, cpu_timed=env.backend == "gloo" and not self.cuda)
        self.gpu_overlap = self.cuda_step_peak = None
        self.losses, self.step_times, self.memory = [], [], None
        self.peak_params = None
        self.init_peak = None  # optional: bytes held at once while the strategy was built (06)
        # A resumed run (--resume) starts at the checkpoint's step: it then measures the first
        # step at or after --measure-step that it runs, and its losses start at resumed_from.
        self.resumed_from, self.measure_step = None, args.measure_step
        self.tokens_per_step = args.global_batch * args.seq_len

    @contextmanager
    def step(self, step):
        """Wrap one optimizer step. Yields a list the lesson appends its micro-step losses to."""
        micro_losses = []
        if not self.step_times and step > 0:  # the first step of a resumed run
            self.resumed_from, self.measure_step = step, max(step, self.args.measure_step)
        measure = step == self.measure_step
        self._sync()
        if measure and self.cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if measure:
            with self._profiler(), self.comm.measuring(), self._memory_probe():
                yield micro_losses
                self._sync()  # inside the window: the GPU's work of this step is in it
            if self.cuda:
                self.cuda_step_peak = torch.cuda.max_memory_allocated()
        else:
            yield micro_losses
            self._sync()
        self.step_times.append(time.perf_counter() - t0)
        # The logged loss is the global mean: every rank's, averaged (outside the meter).
        loss = torch.stack([l.detach().float() for l in micro_losses]).sum()
        dist.all_reduce(loss)
        self.losses.append(loss.item() / self.env.world_size)
        if self.env.master and (step % self.args.log_every == 0 or step == self.args.steps - 1):
            self._log(step)

    def _sync(self):
        """On CUDA, wait for the GPU: kernels and NCCL collectives only queue work on the CPU."""
        if self.cuda:
            torch.cuda.synchronize()

    @contextmanager
    def _profiler(self):
        """--trace DIR: torch.profiler over the measured step, a Chrome/Perfetto trace per rank."""
        trace_dir = getattr(self.args, "trace", None)
        if not trace_dir:
            yield
            return
        import os
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.env.device.type == "cuda" else [])
        os.makedirs(trace_dir, exist_ok=True)
        with profile(activities=activities) as prof:
            yield
        path = os.path.join(trace_dir, f"trace_rank{self.env.rank}.json")
        prof.export_chrome_trace(path)
        if self.cuda:  # the CPU clock cannot see NCCL overlap: the GPU's kernel times can
            self.gpu_overlap = gpu_overlap(path)

    @contextmanager
    def _memory_probe(self):
        """At rest = just before optimizer.step(), when params, grads and optimizer state are
        all alive; peak_params = the most parameter bytes alive after any operation."""
        original = self.optimizer.step

        def step_with_sample(*a, **k):
            self.memory = self.ledger.measure()
            probe.optimizer_begins()
            return original(*a, **k)

        self.optimizer.step = step_with_sample
        probe = _PeakParams(self.ledger)
        track = self.track_peak_params and getattr(self.args, "peak_params", 1)
        try:
            with probe if track else nullcontext():
                if track:
                    probe.sample()
                yield
        finally:
            self.optimizer.step = original
        self.peak_params = probe.peak if track else None
        self.params_timeline = {"ops": probe.ops, "samples": probe.timeline} if track else None

    def _log(self, step):
        t = self.step_times[-1]
        print(f"step {step:4d}/{self.args.steps} | loss {self.losses[-1]:.4f} | {t * 1e3:7.1f} ms | "
              f"{self.tokens_per_step / t:9,.0f} tok/s | {_memory_now(self.env)}", flush=True)

    # ------------------------------------------------------------------ summary and report
    def finish(self):
        """Gather every rank's measurements to rank 0, print the summary, write the report."""
        measured = {"memory": {**(self.memory or {}), "peak_params": self.peak_params},
                    "ops": self.comm.ops, "ring_bytes": self.comm.ring_bytes(),
                    "wire_bytes": self.comm.wire_bytes, "overlap": self.comm.overlap() or self.gpu_overlap,
                    "timeline": self.comm.timeline() if getattr(self.args, "trace", None) else None}
        if self.env.master:  # rank 0's parameter bytes over the measured step
            measured["params_timeline"] = getattr(self, "params_timeline", None)
        if self.init_peak is not None:
            measured["memory"]["init_peak"] = self.init_peak
        if self.cuda:  # what the caching allocator handed out: over the run, and in the measured step
            measured["memory"]["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
            measured["memory"]["cuda_step_peak"] = self.cuda_step_peak
        # the process's peak resident memory: everything (activations, buffers, the runtime), for
        # the benchmark's "peak bytes per rank"; in a sweep, the highest of its runs so far
        measured["memory"]["max_rss"] = max_rss()
        gathered = [None] * self.env.world_size
        dist.all_gather_object(gathered, measured)
        self.final_report = None
        if self.env.master:
            report = self.final_report = self.report(gathered)
            self._summary(report)
            if self.args.report:
                with open(self.args.report, "w") as f:
                    json.dump(report, f, indent=1)
            if getattr(self.args, "trace", None) and None not in [g["timeline"] for g in gathered]:
                plot_timeline([g["timeline"] for g in gathered], report["strategy"],
                              f"{self.args.trace}/timeline.png")
        return gathered

    def report(self, gathered):
        a, n = self.args, self.env.world_size
        mem_theory = theory_memory(self.strategy, self.psi, n, a.precision)
        return {
            "strategy": self.strategy, "world_size": n, "backend": self.env.backend,
            "device": self.env.device.type, "precision": a.precision, "n_params": self.psi,
            "config": vars(a), "losses": self.losses, "step_time_s": self.step_times,
            "resumed_from": self.resumed_from,  # losses[i] is step resumed_from + i (None: from 0)
            "median_step_time_s": statistics.median(self.step_times),
            "tokens_per_s": self.tokens_per_step / statistics.median(self.step_times),
            "comm": {"measured_step": self.measure_step, "per_rank": [g["ops"] for g in gathered],
                     "ops": gathered[0]["ops"],
                     "ring_bytes_per_step": gathered[0]["ring_bytes"],
                     "theory_ring_bytes_per_step": theory_ring_bytes(self.strategy, self.psi, n, a.precision,
                                                                       a.grad_accum),
                     # bytes each rank's process actually wrote (gloo on Linux; None elsewhere:
                     # NCCL moves its bytes over NVLink/InfiniBand, not the process's writes)
                     "wire_bytes_per_rank": [g["wire_bytes"] for g in gathered],
                     # rank 0's; CommMeter.overlap gives the definition, gpu_overlap on CUDA
                     # (None there without --trace: unavailable, not zero)
                     "overlap": gathered[0]["overlap"],
                     "overlap_per_rank": [g["overlap"] for g in gathered]},
            "memory": {"per_rank": [g["memory"] for g in gathered], "theory": mem_theory,
                       "params_timeline": gathered[0].get("params_timeline")},
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
        ov = comm.get("overlap")
        if ov is not None and ov.get("source"):
            print(f"  overlap rank 0: NCCL kernels {ov['comm_ms']:.1f} ms | exposed {ov['exposed_ms']:.1f} ms "
                  f"(no compute kernel beside them) | hidden {ov['hidden_share']:.0%}")
        elif ov is not None:
            print(f"  overlap rank 0: comm {ov['comm_ms']:.1f} ms (issue to completion) | exposed "
                  f"{ov['exposed_ms']:.1f} ms (blocked in wait) | hidden {ov['hidden_share']:.0%}")
        elif r["backend"] == "nccl":
            print("  overlap: unavailable on NCCL from the CPU clock (--trace DIR measures it from GPU kernel times)")
        m, th = r["memory"]["per_rank"][0], r["memory"]["theory"]
        row = " | ".join(f"{k} {m.get(k, 0) / mib:.2f} (theory {th[k] / mib:.2f})"
                         for k in ("params", "grads", "optimizer"))
        if m.get("peak_params") is not None:  # None when not tracked
            # ZeRO-3 adds the units gathered in flight to its shards; no formula, a measurement
            row += f" | peak_params {m['peak_params'] / mib:.2f} during the step"
        print(f"  memory rank 0, MiB at rest: {row}"
              + (f" | other {m['other'] / mib:.2f}" if m.get("other") else "")
              + (f" | init peak {m['init_peak'] / mib:.2f}" if m.get("init_peak") else ""), flush=True)
        if m.get("cuda_step_peak") is not None:  # everything the step allocated: activations too
            held = sum(m.get(k, 0) for k in ("params", "grads", "optimizer"))
            print(f"  GPU rank 0, MiB: peak allocated in the measured step {m['cuda_step_peak'] / mib:.2f} | "
                  f"model states at rest {held / mib:.2f} (theory {th['total'] / mib:.2f})", flush=True)


def plot_timeline(timelines, strategy, path):
    """The measured step per rank: communication spans (issue to completion), the intervals the
    main thread was blocked on them, and compute = the rest of the main thread's time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"all_reduce": "tab:blue", "reduce_scatter": "tab:orange", "all_gather": "tab:green",
              "broadcast": "tab:purple"}
    fig, ax = plt.subplots(figsize=(11, 1.2 + 1.1 * len(timelines)))
    labelled = set()

    def bar(y, a, b, h, color, label):
        ax.broken_barh([(a, max(b - a, 1e-3))], (y, h), facecolors=color, alpha=0.6 if "comm" in label else 1,
                       label=None if label in labelled else label)
        labelled.add(label)

    for rank, tl in enumerate(timelines):
        y = rank * 1.1
        bar(y + 0.55, 0, tl["step_ms"], 0.4, "lightgray", "main thread: compute")
        for a, b in tl["blocked"]:
            bar(y + 0.55, a, b, 0.4, "tab:red", "main thread: blocked in collective / wait()")
        for kind, a, b in tl["comm"]:
            bar(y + 0.05, a, b, 0.4, colors.get(kind, "tab:gray"), f"comm in flight: {kind}")
    ax.set_yticks([r * 1.1 + 0.5 for r in range(len(timelines))], [f"rank {r}" for r in range(len(timelines))])
    ax.set_xlabel("time since the measured step began (ms)")
    ax.set_title(f"{strategy}: compute vs communication over the measured step")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _memory_now(env):
    if env.device.type == "cuda":
        return f"peak alloc {torch.cuda.max_memory_allocated() / 2 ** 20:.1f} MiB"
    return f"peak rss {max_rss() / 2 ** 20:.0f} MiB"


def max_rss():
    """Peak resident set size of this process, bytes (getrusage: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
