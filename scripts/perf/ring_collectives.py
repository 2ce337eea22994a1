"""`--collectives ring` and `--link GBPS:LATENCY_US`: the lessons' collectives on lesson 00's ring.

Under `--collectives ring`, common.init_distributed swaps dist.all_reduce, reduce_scatter_tensor
and all_gather_into_tensor (and torch 2.13's *_single aliases) for the Transport's methods: each
runs lesson 00's Ring on a communication thread, in issue order, as NCCL runs collectives on its
stream, over a gloo group of its own (the default group's barriers and objects never interleave).
- The bytes on the wire are the ring's, (N-1)/N of the tensor per pass, the ZeRO paper's count
  (gloo's reduce-scatter is an all-reduce underneath: 1.5x that for 04 and 05, 4/3x for 06).
- `async_op=True` returns a handle at once: wait() blocks until the output holds the result (or
  raises what the ring raised), is_completed() says whether it does.
- With `--link`, every send costs latency + bytes / bandwidth (00's Link) on that thread, not on
  compute: what a lesson overlaps is hidden, as on a real link. Broadcast (start-up) stays torch's.
"""
import importlib
import queue
import threading

import torch
import torch.distributed as dist

# name in torch.distributed -> the Transport method that replaces it
_NAMES = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter_tensor",
          "reduce_scatter_single": "reduce_scatter_tensor", "all_gather_into_tensor": "all_gather_into_tensor",
          "all_gather_single": "all_gather_into_tensor"}
_originals = {}  # name -> torch's function, while the ring is installed
_transport = None


def lesson_00():
    """Lesson 00 (a name Python's import statement cannot spell): its Ring and its Link."""
    return importlib.import_module("00_collectives")


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


# ----------------------------------------------------------------------------- the transport
class Transport:
    """A ring over a twin of the default group, and the thread that runs its collectives in order."""

    def __init__(self, timeout):
        self.world = dist.group.WORLD
        self.group = dist.new_group(backend="gloo", timeout=timeout)  # every rank, in order: collective
        self.ring = lesson_00().Ring(self.group)
        self.queue, self.failed = queue.Queue(), None
        self.buffers = {}  # dtype -> the ring's receive buffer, kept (receive_buffer)
        threading.Thread(target=self._serve, name="ring-collectives", daemon=True).start()

    def _serve(self):
        while True:
            fn, work = self.queue.get()
            if fn is None:  # replaced by another default group's transport (use)
                return
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

    def receive_buffer(self, chunks):
        """Where the reduce-scatter receives, kept between calls: a new one of 32 MiB or more is
        fresh pages each call (64 MiB at 2 ranks: 39 ms with a new one, 22 with this one)."""
        like = chunks[0]  # the largest
        buffer = self.buffers.get(like.dtype)
        if buffer is None or buffer.numel() < like.numel():
            buffer = self.buffers[like.dtype] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        return buffer[:like.numel()]

    def drain(self):
        """Wait until every collective issued so far has completed."""
        self.submit(lambda: None, async_op=False)

    # each with torch.distributed's signature: comm_meter and the tests read arguments by name
    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        _check(group, op)

        def run():
            work = tensor if tensor.is_contiguous() else tensor.contiguous()
            chunks = work.view(-1).tensor_split(self.ring.world_size)
            self.ring._reduce_scatter(chunks, self.receive_buffer(chunks))
            self.ring._all_gather(chunks)
            if op == dist.ReduceOp.AVG:
                work.div_(self.ring.world_size)
            if work is not tensor:
                tensor.copy_(work)
        return self.submit(run, async_op)

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        _check(group, op, output, input, self.ring.world_size)

        def run():
            n, r = self.ring.world_size, self.ring.rank
            # The ring adds into every chunk but r - 1 (it only sends that one): chunk r in the
            # output, the others in copies, the input left as it was. (A clone of the whole input
            # doubled the time at 41 MiB, the 10M model's gradient: 34 ms against 17.)
            chunks = list(input.reshape(-1).chunk(n))
            chunks[r] = output.view(-1).copy_(chunks[r])
            for i in set(range(n)) - {r, (r - 1) % n}:
                chunks[i] = chunks[i].clone()
            self.ring._reduce_scatter(chunks, self.receive_buffer(chunks))
            if op == dist.ReduceOp.AVG:
                output.div_(n)
        return self.submit(run, async_op)

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        _check(group, dist.ReduceOp.SUM, input_tensor, output_tensor, self.ring.world_size)

        def run():
            chunks = output_tensor.view(-1).chunk(self.ring.world_size)
            chunks[self.ring.rank].copy_(input_tensor.reshape(-1))  # in place (04, 05): copy_ skips it
            self.ring._all_gather(chunks)
        return self.submit(run, async_op)


def _check(group, op, shard=None, full=None, n=1):
    if group not in (None, dist.group.WORLD) or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise NotImplementedError(f"--collectives ring sums or averages over the default group only, not {op}")
    if shard is not None and full.numel() != n * shard.numel():
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
        if _transport is not None:
            _transport.queue.put((None, None))  # the old one's thread ends
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
