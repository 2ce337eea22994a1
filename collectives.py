"""`--collectives ring` and `--link GBPS:LATENCY_US`: the lessons' collectives on lesson 00's ring.

The lessons call dist.all_reduce, dist.reduce_scatter_tensor and dist.all_gather_into_tensor as
they would on any backend. Under `--collectives ring`, common.init_distributed swaps those names
(and torch 2.13's *_single aliases) for the functions below, once for the whole run: each one
runs lesson 00's Ring (point-to-point sends to the neighbours) on a communication thread of its
own, in issue order, as NCCL runs collectives on its stream. So:
- the bytes on the wire are the ring's, (N-1)/N of the tensor per pass, the ZeRO paper's count
  (gloo's own reduce-scatter is an all-reduce underneath: 1.5x to 2x that);
- `async_op=True` returns at once with a handle that behaves as torch.distributed's: wait()
  blocks until the result is in the output (and raises what the ring raised), is_completed()
  says whether it is; a blocking call is an async one waited at once;
- with `--link`, every send costs latency + bytes / bandwidth on that thread, not the rank's
  compute thread: communication the lesson overlaps with compute is hidden, as on a real link.
The ring sends over a process group of its own (the same ranks, other sockets), so what the
main thread runs on the default group (barriers, objects, broadcasts) never interleaves with it.
Sums are in the tensor's dtype, in the ring's order. Broadcast (start-up only) stays torch's.
"""
import importlib
import queue
import threading
import time

import torch
import torch.distributed as dist

# name in torch.distributed -> the Transport method that replaces it
_NAMES = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter_tensor",
          "reduce_scatter_single": "reduce_scatter_tensor", "all_gather_into_tensor": "all_gather_into_tensor",
          "all_gather_single": "all_gather_into_tensor"}
_originals = {}  # name -> torch's function, while the ring is installed
_transport = None


# ----------------------------------------------------------------------------- the link
class Link:
    """A simulated network link: one send of b bytes takes latency + 8 b / bandwidth seconds."""

    def __init__(self, gbps, latency_us):
        self.gbps, self.latency_us = gbps, latency_us

    @classmethod
    def parse(cls, text):
        """'GBPS:LATENCY_US' (gigabits per second, microseconds), e.g. '1:50'; ValueError if not."""
        try:
            gbps, latency = (float(x) for x in text.split(":"))
        except ValueError:
            raise ValueError(f"--link {text!r}: expected GBPS:LATENCY_US, e.g. 1:50 (1 Gb/s, 50 us)") from None
        if not (gbps > 0 and latency >= 0 and gbps < float("inf") and latency < float("inf")):
            raise ValueError(f"--link {text!r}: the bandwidth must be positive and the latency 0 or more")
        return cls(gbps, latency)

    def seconds(self, nbytes):
        return self.latency_us * 1e-6 + nbytes * 8 / (self.gbps * 1e9)

    def hold(self, nbytes, since):
        """Called after a send that began at `since` (perf_counter): wait out what the link charges."""
        left = since + self.seconds(nbytes) - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def __str__(self):
        return f"{self.gbps:g} Gb/s, {self.latency_us:g} us"


# ----------------------------------------------------------------------------- the handle
class RingWork:
    """What an async ring collective returns: torch.distributed's Work, as far as lessons use it."""

    def __init__(self):
        self._done, self._error = threading.Event(), None

    def wait(self, timeout=None):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        return self._done.is_set()

    def is_success(self):
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error


# ----------------------------------------------------------------------------- the transport
class Transport:
    """A ring over a twin of the default group, and the thread that runs its collectives in order."""

    def __init__(self, timeout):
        self.world = dist.group.WORLD
        self.group = dist.new_group(backend="gloo", timeout=timeout)  # every rank, in order: collective
        self.ring = importlib.import_module("00_collectives").Ring(self.group)
        self.queue, self.failed = queue.Queue(), None
        threading.Thread(target=self._serve, name="ring-collectives", daemon=True).start()

    def _serve(self):
        while True:
            fn, work = self.queue.get()
            if self.failed is None:
                try:
                    fn()
                except Exception as e:  # a lost peer, a timeout: this and every later call fail
                    self.failed = e
            work._error = self.failed
            work._done.set()

    def submit(self, fn, async_op):
        work = RingWork()
        self.queue.put((fn, work))
        if async_op:
            return work
        work.wait()
        return None

    def drain(self):
        """Wait until every collective issued so far has completed."""
        self.submit(lambda: None, async_op=False)

    # the collectives, each with torch.distributed's signature (comm_meter and the tests'
    # stream semantics read the arguments by these names)
    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        _check(group, op)

        def run():
            work = tensor if tensor.is_contiguous() else tensor.contiguous()
            chunks = work.view(-1).tensor_split(self.ring.world_size)
            self.ring._reduce_scatter(chunks)
            self.ring._all_gather(chunks)
            if op == dist.ReduceOp.AVG:
                work.div_(self.ring.world_size)
            if work is not tensor:
                tensor.copy_(work)
        return self.submit(run, async_op)

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        _check(group, op)
        _check_sizes(output, input, self.ring.world_size)

        def run():
            chunks = input.reshape(-1).clone().chunk(self.ring.world_size)  # the input is left as it was
            self.ring._reduce_scatter(chunks)
            mine = chunks[self.ring.rank]
            if op == dist.ReduceOp.AVG:
                mine.div_(self.ring.world_size)
            output.view(-1).copy_(mine)
        return self.submit(run, async_op)

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        _check(group, dist.ReduceOp.SUM)
        _check_sizes(input_tensor, output_tensor, self.ring.world_size)

        def run():
            chunks = output_tensor.view(-1).chunk(self.ring.world_size)
            chunks[self.ring.rank].copy_(input_tensor.reshape(-1))
            self.ring._all_gather(chunks)
        return self.submit(run, async_op)


def _check(group, op):
    if group not in (None, dist.group.WORLD):
        raise NotImplementedError("--collectives ring runs on the default group only")
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise NotImplementedError(f"--collectives ring sums or averages; {op} is not implemented")


def _check_sizes(shard, full, n):
    if full.numel() != n * shard.numel():
        raise ValueError(f"ring collective: a tensor of {full.numel()} elements is not {n} shards of {shard.numel()}")


# ----------------------------------------------------------------------------- the switch
def use(kind, link=None, timeout=None):
    """Make dist's collectives torch's own (`kind` 'torch') or the ring's ('ring', on `link`).
    Every rank calls it at the start of each lesson run (common.init_distributed), in the same
    order: the ring's group is made the first time, on every rank. Already in place, the ring
    stays as it is (a test's wrappers around it included); only its link changes."""
    global _transport
    if kind == "ring" and _originals and _transport.world is dist.group.WORLD:
        _transport.ring.link = link
        return _transport
    for name, fn in _originals.items():  # torch's, whatever was installed before
        setattr(dist, name, fn)
    _originals.clear()
    if kind == "torch":
        return None
    if _transport is None or _transport.world is not dist.group.WORLD:  # a new default group
        _transport = Transport(timeout)
    _transport.ring.link = link
    for name, method in _NAMES.items():
        if hasattr(dist, name):  # the *_single names exist from torch 2.13 on
            _originals[name] = getattr(dist, name)
            setattr(dist, name, getattr(_transport, method))
    return _transport


def drain():
    """Wait for the ring's collectives in flight (none when the ring is not in use)."""
    if _originals and _transport is not None:
        _transport.drain()
