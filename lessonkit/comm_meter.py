"""Communication, counted from outside the lessons: CommMeter wraps the torch.distributed
collectives while a chosen step runs and counts each call and its payload (the lessons call
`dist.all_reduce(...)` as usual and never report their own traffic); what the process wrote on
the wire (bytes_written); the overlap of communication and compute, on the CPU clock (gloo).
`--trace DIR` (scripts/perf/timelines.py) charts these spans, and measures overlap on CUDA.
"""
import inspect
import time
from contextlib import contextmanager

import torch.distributed as dist

from lessonkit.theory import RING_FACTOR

# name in torch.distributed -> (kind, name of the argument holding the full-size tensor); the
# *_single names exist from torch 2.13 on, where the lessons' *_tensor names call them
_COLLECTIVES = {
    "all_reduce": ("all_reduce", "tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"), "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_gather_single": ("all_gather", "output_tensor"), "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "broadcast": ("broadcast", "tensor"), "reduce": ("reduce", "tensor"),  # (07's uneven layout)
}
_UNMETERED = ["all_gather", "reduce_scatter", "all_to_all_single", "gather", "scatter"]


class CommMeter:
    """Counts collectives issued through torch.distributed while `with meter.measuring():`.

    cpu_timed: the collectives run on the CPU (gloo), so a call and its wait() return when the
    communication is done and timing them on the CPU clock means something. With NCCL they only
    queue work on the GPU, so overlap, timeline and wire bytes are then None (unavailable); the
    GPU's own kernel times give the overlap instead (timelines.gpu_overlap, with --trace)."""

    def __init__(self, world_size, cpu_timed=True):
        self.world, self.cpu_timed = world_size, cpu_timed
        # per process group, by its name ("world", or 08's "shard" and "replicate"): its size and
        # {kind: {"calls", "bytes"}} (a collective's ring factor is its group's, not the world's)
        self.groups = {}
        self.calls = []  # [kind, payload bytes] per call, in issue order: e.g. no bucket is the whole gradient
        self.wire_bytes = None  # what this process wrote while measuring (Linux, gloo): see bytes_written
        # Overlap, timed in the wrappers (perf_counter seconds): a collective's span runs from the
        # call (issue) to its completion; for an async one, completion = when its wait() returns,
        # an upper bound (gloo may finish earlier on its own threads; nothing cheaper observes it).
        # `blocked` holds the intervals the calling thread spent inside a blocking collective or
        # a wait(): communication it did not hide behind compute.
        self.spans, self.blocked, self.window = [], [], None

    def _record(self, kind, tensor, group=None):
        nbytes = tensor.numel() * tensor.element_size()
        name = group_name(group)
        size = self.world if name == "world" else dist.get_world_size(group)
        entry = self.groups.setdefault(name, {"size": size, "ops": {}})["ops"].setdefault(kind, {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += nbytes
        self.calls.append([kind, nbytes])

    @property
    def ops(self):
        """{kind: {"calls", "bytes"}}, over every group."""
        out = {}
        for g in self.groups.values():
            for kind, v in g["ops"].items():
                entry = out.setdefault(kind, {"calls": 0, "bytes": 0})
                entry["calls"] += v["calls"]
                entry["bytes"] += v["bytes"]
        return out

    @contextmanager
    def measuring(self):
        originals = {}

        def wrap(name, kind, arg):
            fn = getattr(dist, name)
            signature = inspect.signature(fn)

            def metered(*args, **kwargs):
                bound = signature.bind(*args, **kwargs)
                self._record(kind, bound.arguments[arg], bound.arguments.get("group"))
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

    def ring_bytes(self, group=None):
        """Issued bytes times the ring factor at each collective's group size: over every group,
        or over the one named `group`."""
        return sum(RING_FACTOR[k](g["size"]) * v["bytes"] for name, g in self.groups.items()
                   if group in (None, name) for k, v in g["ops"].items())

    def overlap(self):
        """comm = union of the collectives' spans within the measured step; exposed = union of
        the intervals the calling thread was blocked on them; hidden share = 1 - exposed / comm.
        A collective still in flight when the step ends (none is in these lessons: each step
        waits its own) would count up to the step's end, its later wait() outside the step."""
        if self.window is None or not self.cpu_timed:
            return None
        start, end = self.window
        spans = [(max(a, start), min(end if b is None else b, end)) for _, a, b in self.spans]
        blocked = [(max(a, start), min(b, end)) for a, b in self.blocked]
        comm, exposed = union(spans), union(blocked)
        return {"comm_ms": comm * 1e3, "exposed_ms": exposed * 1e3,
                "hidden_share": 1 - exposed / comm if comm > 0 else 0.0}


def union(intervals):
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


def group_name(group):
    """A process group's name in the counts: "world" for the default group, else its group_desc
    (new_group(group_desc=...): 08's "shard" and "replicate")."""
    return "world" if group in (None, dist.group.WORLD) else getattr(group, "group_desc", "group")


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
        raise RuntimeError(f"dist.{name} is not metered; add it to comm_meter._COLLECTIVES")
    return refuse
