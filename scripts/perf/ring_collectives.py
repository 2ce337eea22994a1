"""`--collectives ring`, `--link GBPS:LATENCY_US` and `--inter-link`: the lessons' collectives on lesson 00's ring.

Under `--collectives ring`, common.init_distributed swaps dist.all_reduce, reduce_scatter_tensor
and all_gather_into_tensor (and torch 2.13's *_single aliases) for the Transport's methods: each
runs lesson 00's Ring on a communication thread, in issue order, as NCCL runs collectives on its
stream. The default group's ring runs over a gloo group of its own (the default group's barriers
and objects never interleave); a sub-group's (08's shard and replicate groups) over the sub-group
itself, which nothing else uses. Every rank issues the same sequence of groups, so one thread
running them in order cannot deadlock.
- The bytes on the wire are the ring's, (N-1)/N of the tensor per pass, the ZeRO paper's count
  (gloo's reduce-scatter is an all-reduce underneath: 1.5x that for 04 and 05, 4/3x for 06).
- `async_op=True` returns a handle at once: wait() blocks until the output holds the result (or
  raises what the ring raised), is_completed() says whether it does.
- With `--link`, every send costs latency + bytes / bandwidth (00's Link) on that thread, not on
  compute: what a lesson overlaps is hidden, as on a real link. Broadcast (start-up) stays torch's.
- With `--inter-link` the ranks sit on simulated nodes of `--ranks-per-node` consecutive ranks
  (08: its shard group): a send to a rank on another node costs the inter link, one inside the
  node `--link`. A rank sends to one neighbour throughout a ring collective, so each collective
  runs on one link, and the bytes it writes (/proc/self/io, before and after) are that link's:
  wire_bytes(), per process group.
"""
import importlib
import queue
import threading

import torch
import torch.distributed as dist

from lessonkit.comm_meter import bytes_written, group_name

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
    """A ring per process group (the default group's over a twin of it), and the thread that runs
    their collectives in order, each on the link its hop takes."""

    def __init__(self, timeout):
        self.world = dist.group.WORLD
        self.group = dist.new_group(backend="gloo", timeout=timeout)  # every rank, in order: collective
        self.ring = lesson_00().Ring(self.group)
        self.rings = {}  # a sub-group -> its Ring, made at its first collective
        self.links, self.ranks_per_node = {"intra": None, "inter": None}, None  # (use)
        self.wire = {}  # process group's name -> bytes its collectives wrote (on this thread)
        self.queue, self.failed = queue.Queue(), None
        self.buffers = {}  # dtype -> the ring's receive buffer, kept (receive_buffer)
        threading.Thread(target=self._serve, name="ring-collectives", daemon=True).start()

    def ring_of(self, group):
        if group in (None, dist.group.WORLD):
            return self.ring
        if group not in self.rings:
            self.rings[group] = lesson_00().Ring(group)
        return self.rings[group]

    def _serve(self):
        while True:
            fn, work, ring, name = self.queue.get()
            if fn is None:  # replaced by another default group's transport (use)
                return
            if self.failed is None:
                try:
                    if ring is not None:  # the link my hop takes: to my right neighbour, on my node or another
                        ring.link = self.links[hop(dist.get_rank(), ring.right, self.ranks_per_node)]
                    before = ring and bytes_written()  # (None: drain's no-op, or no /proc)
                    fn()
                    if before is not None:
                        self.wire[name] = self.wire.get(name, 0) + bytes_written() - before
                except Exception as e:  # a lost peer, a timeout: this and every later call fail
                    self.failed = e
            work._error = self.failed
            work._done.set()

    def submit(self, fn, async_op, group=None, ring=None):
        work = RingWork()
        self.queue.put((fn, work, ring, group_name(group)))
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
        ring = self.ring_of(group)
        _check(op)

        def run():
            work = tensor if tensor.is_contiguous() else tensor.contiguous()
            chunks = work.view(-1).tensor_split(ring.world_size)
            ring._reduce_scatter(chunks, self.receive_buffer(chunks))
            ring._all_gather(chunks)
            if op == dist.ReduceOp.AVG:
                work.div_(ring.world_size)
            if work is not tensor:
                tensor.copy_(work)
        return self.submit(run, async_op, group, ring)

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        ring = self.ring_of(group)
        _check(op, output, input, ring.world_size)

        def run():
            n, r = ring.world_size, ring.rank
            # The ring adds into every chunk but r - 1 (it only sends that one): chunk r in the
            # output, the others in copies, the input left as it was. (A clone of the whole input
            # doubled the time at 41 MiB, the 10M model's gradient: 34 ms against 17.)
            chunks = list(input.reshape(-1).chunk(n))
            chunks[r] = output.view(-1).copy_(chunks[r])
            for i in set(range(n)) - {r, (r - 1) % n}:
                chunks[i] = chunks[i].clone()
            ring._reduce_scatter(chunks, self.receive_buffer(chunks))
            if op == dist.ReduceOp.AVG:
                output.div_(n)
        return self.submit(run, async_op, group, ring)

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        ring = self.ring_of(group)
        _check(dist.ReduceOp.SUM, input_tensor, output_tensor, ring.world_size)

        def run():
            chunks = output_tensor.view(-1).chunk(ring.world_size)
            chunks[ring.rank].copy_(input_tensor.reshape(-1))  # in place (04, 05): copy_ skips it
            ring._all_gather(chunks)
        return self.submit(run, async_op, group, ring)


def hop(rank, right, ranks_per_node):
    """The link a send from `rank` to `right` (global ranks) takes: "inter" between two simulated
    nodes of `ranks_per_node` consecutive ranks, else (or with no nodes: None) "intra"."""
    return "inter" if ranks_per_node and rank // ranks_per_node != right // ranks_per_node else "intra"


def _check(op, shard=None, full=None, n=1):
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise NotImplementedError(f"--collectives ring sums or averages, not {op}")
    if shard is not None and full.numel() != n * shard.numel():
        raise ValueError(f"ring collective: a tensor of {full.numel()} elements is not {n} shards of {shard.numel()}")


# ----------------------------------------------------------------------------- the switch
def use(kind, link=None, timeout=None, inter_link=None, ranks_per_node=None):
    """Make dist's collectives torch's own (`kind` 'torch') or the ring's ('ring', on `link`; a
    hop between nodes of `ranks_per_node` ranks on `inter_link`). Every rank calls it at the start
    of each lesson run (common.init_distributed), in the same order: the ring's group is made the
    first time, on every rank. Already in place, the ring stays as it is (a test's wrappers around
    it included); only its links change."""
    global _transport
    if kind == "ring" and _originals and _transport.world is dist.group.WORLD:
        _transport.links, _transport.ranks_per_node = {"intra": link, "inter": inter_link}, ranks_per_node
        return _transport
    for name, fn in _originals.items():  # torch's, whatever was installed before
        setattr(dist, name, fn)
    _originals.clear()
    if kind == "torch":
        return None
    if _transport is None or _transport.world is not dist.group.WORLD:  # a new default group
        if _transport is not None:
            _transport.queue.put((None, None, None, None))  # the old one's thread ends
        _transport = Transport(timeout)
    _transport.links, _transport.ranks_per_node = {"intra": link, "inter": inter_link}, ranks_per_node
    for name, method in _NAMES.items():
        if hasattr(dist, name):  # the *_single names exist from torch 2.13 on
            _originals[name] = getattr(dist, name)
            setattr(dist, name, getattr(_transport, method))
    return _transport


def drain():
    """Wait for the ring's collectives in flight (none when the ring is not in use)."""
    if _originals and _transport is not None:
        _transport.drain()


def wire_bytes():
    """{process group's name: the bytes its ring collectives have written so far}, or None when
    the ring is not in use. Read it with nothing in flight (after drain)."""
    return dict(_transport.wire) if _originals and _transport is not None else None
