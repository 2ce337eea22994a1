"""Measurement of one lesson's run, observed from outside the lesson: Run times every step, logs
one line from rank 0, measures `--measure-step` (its collectives with comm_meter.CommMeter, the
bytes held with memory_ledger.MemoryLedger) and writes the summary and the JSON report, each
measurement beside its formula from theory.py. The other steps run with nothing patched. `--trace DIR`
(the profiler, the overlap on CUDA, the step's chart) is scripts/perf/timelines.Trace.
"""
import json
import statistics
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from lessonkit import common, summary
from lessonkit.comm_meter import CommMeter
from lessonkit.memory_ledger import MemoryLedger, MicroSteps, Peaks, max_rss
from scripts.perf import ring_collectives
from lessonkit.theory import (HYBRID, buckets_in_flight, theory_activations, theory_links, theory_memory,
                              theory_ring_bytes, theory_tiers)


# ----------------------------------------------------------------------------- the run
class Run:
    """Per-step timing, rank-0 logging, measurement of one chosen step, summary and report."""

    def __init__(self, args, env, strategy, model, optimizer, holders=(), loss_scaler=None, theory=None):
        self.args, self.env, self.strategy = args, env, strategy
        self.loss_scaler, self.theory = loss_scaler, theory  # fp16's scale and skipped steps: the report; theory: 09's
        self.model, self.optimizer = model, optimizer
        self.psi = common.n_params(model) if not hasattr(model, "n_params") else model.n_params
        self.ledger = MemoryLedger(model, [*holders, optimizer])
        # what a holder counts itself (07's copies each way): read around the measured step, folded after others
        self.counted = [h for h in holders if hasattr(h, "counters")]
        self.copies = self.wire = None  # (wire: under --collectives ring, per process group)
        self.cuda = env.device.type == "cuda"
        self.comm = CommMeter(env.world_size, cpu_timed=env.backend == "gloo" and not self.cuda)
        # --peak-params 1 samples memory after every op of the measured step: its compute slows
        # several-fold and its communication looks hidden (02 on a 0.25 Gb/s link: 80%; 20% in a
        # plain step). The overlap is then timed in the next step, by a meter of its own.
        self.timing = (CommMeter(env.world_size, cpu_timed=True)
                       if self.comm.cpu_timed and getattr(args, "peak_params", 1) else self.comm)
        self.timed_step = self.params_timeline = self.trace = None  # timed_step: the step self.timing measured
        self.cuda_step_peak = self.peak_params = self.peak_grads = self.peak_activations = self.held_grads = None
        if getattr(args, "trace", None):  # a tool's, imported only then (it draws with matplotlib)
            from scripts.perf.timelines import Trace
            self.trace = Trace(self)
        self.losses, self.step_times, self.memory = [], [], None
        # A resumed run (--resume) starts at the checkpoint's step: it then measures the first
        # step at or after --measure-step that it runs, and its losses start at resumed_from.
        self.resumed_from, self.measure_step = None, args.measure_step
        self.tokens_per_step = args.global_batch * args.seq_len

    @contextmanager
    def step(self, step):
        """Wrap one optimizer step. Yields a list the lesson appends its micro-step losses to."""
        if not self.step_times and step > 0:  # the first step of a resumed run
            self.resumed_from, self.measure_step = step, max(step, self.args.measure_step)
        measure = step == self.measure_step
        micro_losses = MicroSteps(self.ledger) if measure and self.args.grad_accum > 1 else []
        self._sync()
        torch.cuda.reset_peak_memory_stats() if measure and self.cuda else None
        t0 = time.perf_counter()
        if measure:
            trace = self.trace.measuring() if self.trace else nullcontext()
            before, wire = [h.counters() for h in self.counted], ring_collectives.wire_bytes()
            with trace, self.comm.measuring(), self._memory_probe():
                yield micro_losses
                self._sync()  # inside the window: the GPU's work of this step is in it
            after, self.wire = [h.counters() for h in self.counted], ring_collectives.wire_bytes()
            if wire is not None:  # what each process group's ring collectives wrote in this step
                self.wire = {name: b - wire.get(name, 0) for name, b in self.wire.items()}
            self.copies = {k: sum(a[k] - b[k] for a, b in zip(after, before)) for k in (before[0] if before else ())} or None
            self.cuda_step_peak = torch.cuda.max_memory_allocated() if self.cuda else None
            self.held_grads = getattr(micro_losses, "held_grads", None)
        else:  # with --peak-params 1, the step after the measured one times the overlap
            timed = self.timing is not self.comm and step == self.measure_step + 1
            self.timed_step = step if timed else self.timed_step
            with self.timing.measuring() if timed else nullcontext():
                yield micro_losses
                self._sync()
            for holder in self.counted:  # the GPU idle (_sync above): 07 adds its CUDA events up
                holder.counters()
        self.step_times.append(time.perf_counter() - t0)
        # The logged loss is the global mean: every rank's, averaged (outside the meter).
        loss = torch.stack([l.detach().float() for l in micro_losses]).sum()
        dist.all_reduce(loss)
        self.losses.append(loss.item() / self.env.world_size)
        if self.env.master and (step % self.args.log_every == 0 or step == self.args.steps - 1):
            self._log(step)

    def _sync(self):
        """Wait for the step's communication: on CUDA the GPU's (the CPU only queues kernels and NCCL's), under
        --collectives ring the ring's thread. Before and after the measured step: its window holds all it sent."""
        if self.cuda:
            torch.cuda.synchronize()
        ring_collectives.drain()

    @contextmanager
    def _memory_probe(self):
        """At rest = just before optimizer.step(), when params, grads and optimizer state are
        all alive; peak_params = the most parameter bytes alive after any operation, peak_grads
        the most gradient bytes after any operation of backward. With a loss scaler, at its
        step(optimizer), the same moment, which comes also when fp16 skips optimizer.step()."""
        stepper = self.loss_scaler or self.optimizer  # (scaler.step(optimizer): the lessons' loop)
        original, probe = stepper.step, Peaks(self.ledger)

        def step_with_sample(*a, **k):
            self.memory = self.ledger.measure()
            probe.optimizer_begins()
            return original(*a, **k)

        stepper.step = step_with_sample
        # --peak-params 0: sampling after every operation costs about 2 ms each, seconds for
        # 01-03's step; peak_params, peak_grads and the timeline are then None, the rest as before
        track = getattr(self.args, "peak_params", 1)
        try:
            with probe if track else nullcontext():
                probe.sample() if track else None
                yield
        finally:
            stepper.step = original
        if track:
            self.peak_params, self.peak_grads, self.peak_activations = probe.peak, probe.peak_grads, probe.peak_activations
            self.params_timeline = {"ops": probe.ops, "samples": probe.timeline}

    def _log(self, step):
        t = self.step_times[-1]
        if self.env.simulated:  # (lessonkit/simulate.py: the other ranks' data never came)
            return print(f"step {step:4d}/{self.args.steps} | simulated: no loss or time | {_memory_now(self.env)}")
        print(f"step {step:4d}/{self.args.steps} | loss {self.losses[-1]:.4f} | {t * 1e3:7.1f} ms | "
              f"{self.tokens_per_step / t:9,.0f} tok/s | {_memory_now(self.env)}", flush=True)

    # ------------------------------------------------------------------ summary and report
    def finish(self):
        """Gather every rank's measurements to rank 0, print the summary, write the report."""
        measured = {"memory": {**(self.memory or {}), "peak_params": self.peak_params, "peak_grads": self.peak_grads,
                               "peak_activations": self.peak_activations, "held_grads": self.held_grads},
                    "ops": self.comm.ops, "calls": self.comm.calls, "ring_bytes": self.comm.ring_bytes(),
                    "groups": {name: {**g, "ring_bytes": self.comm.ring_bytes(name), "wire_bytes": (self.wire or {}).get(name)}
                               for name, g in self.comm.groups.items()},
                    "wire_bytes": self.comm.wire_bytes,
                    "overlap": self.timing.overlap() or (self.trace and self.trace.gpu_overlap),
                    "timeline": self.trace and self.trace.timeline(),  # --trace: the chart's, per rank
                    "copies": self.copies,  # 07's host <-> device copies in the measured step
                    "optimizer_flops": getattr(self.optimizer, "flops", None)}  # 09's, counted (FlopCounterMode)
        if self.env.master:  # rank 0's parameter bytes over the measured step
            measured["params_timeline"] = self.params_timeline
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
            summary.print_summary(report)
            if self.args.report:
                with open(self.args.report, "w") as f:
                    json.dump(report, f, indent=1)
            if self.trace:
                self.trace.plot([g["timeline"] for g in gathered], report["strategy"])
        return gathered

    def report(self, gathered):
        a, n = self.args, self.env.world_size
        shard = getattr(a, "shard_group", None) or n  # 08: the states are sharded over G ranks, not N
        every = {"reduce_every": a.reduce_every, "all_reduce_every": a.all_reduce_every}  # (05-08, 08)
        mem_theory = theory_memory(self.strategy, self.psi, shard if self.strategy in HYBRID else n, a.precision,
                                   self._grad_buckets_in_flight(), a.grad_accum, a.reduce_every)
        report = {
            "strategy": self.strategy, "world_size": n, "rank": self.env.rank, "backend": self.env.backend,
            "device": self.env.device.type, "precision": a.precision, "n_params": self.psi,
            "config": vars(a), "losses": self.losses, "step_time_s": self.step_times,
            "resumed_from": self.resumed_from,  # losses[i] is step resumed_from + i (None: from 0)
            "loss_scale": self.loss_scaler and self.loss_scaler.report(),  # fp16 (loss_scale.py); else None
            "median_step_time_s": statistics.median(self.step_times),
            "tokens_per_s": self.tokens_per_step / statistics.median(self.step_times),
            "comm": {"measured_step": self.measure_step, "per_rank": [g["ops"] for g in gathered], "ops": gathered[0]["ops"],
                     "calls": gathered[0]["calls"],  # rank 0's, in issue order: [kind, payload bytes]
                     # issued: the payloads the lesson asked for, times the ring factor (a count,
                     # not a measurement); wire: what each rank's process wrote to its sockets
                     "issued_ring_bytes_per_step": gathered[0]["ring_bytes"],
                     "theory_ring_bytes_per_step": theory_ring_bytes(self.strategy, self.psi, n, a.precision,
                                                                       a.grad_accum, shard, **every),
                     # bytes each rank's process actually wrote (gloo on Linux; None elsewhere:
                     # NCCL moves its bytes over NVLink/InfiniBand, not the process's writes)
                     "wire_bytes_per_rank": [g["wire_bytes"] for g in gathered],
                     # rank 0's; CommMeter.overlap gives the definition, timelines.gpu_overlap on CUDA
                     # (None there without --trace: unavailable, not zero)
                     "overlap": gathered[0]["overlap"],
                     "overlap_step": self.measure_step if self.timing is self.comm else self.timed_step,  # None: untimed
                     "overlap_per_rank": [g["overlap"] for g in gathered]},
            "copies_per_rank": [g["copies"] for g in gathered] if gathered[0]["copies"] else None,
            "memory": {"per_rank": [g["memory"] for g in gathered], "theory": mem_theory,
                       "theory_activations": {mode: theory_activations(
                           a.global_batch // n // a.grad_accum, a.seq_len, a.d_model, a.n_head, a.n_layer,
                           a.vocab_size, a.precision, mode) for mode in ("none", "block")},
                       **({"theory_tiers": theory_tiers(self.psi, n, a.precision)} if self.strategy == "offload" else {}),
                       "params_timeline": gathered[0].get("params_timeline")},
        }
        if self.theory:  # 09: each rank owns whole parameters, its own share: its layout's formulas
            self.theory(report, gathered)
        if self.strategy == "hybrid" or getattr(a, "inter_link", None):  # 08, or nodes: each link beside its formula
            report["comm"]["per_link"] = self._per_link(gathered, shard, every)
        return report

    def _per_link(self, gathered, shard, every):
        """{"intra" (inside a node), "inter" (between nodes): rank 0's group on that link, its size,
        ops, bytes issued, theory and wire (None unless --collectives ring), and "per_rank", each
        rank's}. 08's shard group is a node and its replicate ring runs between nodes; 01-07's one
        ring: a rank's sends cross where its right neighbour sits on another node (--ranks-per-node)."""
        a, n, ring = self.args, self.env.world_size, self.args.collectives == "ring"
        if self.strategy == "hybrid":
            theory = theory_links(self.psi, shard, n, a.precision, a.grad_accum, **every)
            on = lambda rank: {"intra": "shard", "inter": "replicate"}  # noqa: E731  (the groups' names)
        else:
            total = theory_ring_bytes(self.strategy, self.psi, n, a.precision, a.grad_accum, **every)
            theory = {"intra": total, "inter": total}  # on whichever link my hop takes
            on = lambda rank: {ring_collectives.hop(rank, (rank + 1) % n, a.ranks_per_node): "world"}  # noqa: E731
        out = {}
        for link in ("intra", "inter"):
            each = []
            for rank, measured in enumerate(gathered):
                name = on(rank).get(link)
                g = measured["groups"].get(name, {})
                each.append({"group": name, "ranks": g.get("size"), "ops": g.get("ops", {}),
                             "issued_ring_bytes_per_step": g.get("ring_bytes", 0),
                             "theory_ring_bytes_per_step": theory[link] if name else 0,
                             "wire_bytes_per_step": (g.get("wire_bytes") or 0) if ring else None})
            out[link] = {**each[0], "per_rank": each}
        return out

    def _grad_buckets_in_flight(self):
        """What 05's gradient buckets (alive in flight only) hold in backward beside the gradients (theory.buckets_in_flight)."""
        for root in self.ledger.roots:
            for m in (root, *getattr(root, "__dict__", {}).values()):
                if hasattr(m, "max_in_flight") and not getattr(m, "grads_as_views", True) and m.buckets:
                    largest = max(p.numel() * p.element_size() for b in m.buckets for p in b.params)
                    return buckets_in_flight([b.nbytes() for b in m.buckets], m.max_in_flight, largest)
        return 0


def _memory_now(env):
    if env.device.type == "cuda":
        return f"peak alloc {torch.cuda.max_memory_allocated() / 2 ** 20:.1f} MiB"
    return f"peak rss {max_rss() / 2 ** 20:.0f} MiB"
