"""Lesson 00: the collectives themselves. Ring reduce-scatter, all-gather and all-reduce, written
with point-to-point sends, checked against torch.distributed's own, their bytes counted.

On N ranks, each holding a tensor of Psi elements cut into N chunks:
- reduce-scatter: rank r ends with chunk r summed over all ranks;
- all-gather: every rank ends with every rank's chunk;
- all-reduce: every rank ends with the whole sum: a reduce-scatter, then an all-gather.
The ring runs each as N - 1 steps; in each, every rank sends one chunk to its right neighbour:

    reduce-scatter, step s: send chunk (r - s - 1) mod N, add the received chunk (r - s - 2) mod N
    all-gather,     step s: send chunk (r - s) mod N, store the received chunk (r - s - 1) mod N

So a rank sends Psi (N-1)/N elements for a reduce-scatter or an all-gather and 2 Psi (N-1)/N for
an all-reduce (the ring factor): ZeRO (04, 05) replaces an all-reduce by the pair at no extra
traffic. Psi here is the lessons' GPT's parameter count, padded to a multiple of N.

    python 00_collectives.py                          # one process: nothing to send
    torchrun --nproc_per_node=2 00_collectives.py     # 2 ranks on CPU (gloo)
    torchrun --nproc_per_node=3 00_collectives.py     # any N: 3 is not a power of two

PyTorch: dist.reduce_scatter_tensor, dist.all_gather_into_tensor, dist.all_reduce (NCCL and gloo
pick their own algorithms; gloo's reduce-scatter on CPU is an all-reduce underneath, which the
wire bytes show).
"""
import json
import time

import torch
import torch.distributed as dist

from lessonkit import comm_meter, common, lifecycle
from model import GPT


# ----------------------------------------------------------------------------- the collectives
class Ring:
    """Ring collectives over point-to-point sends. `sent` counts the bytes this rank sends.

    The same ring carries 01-08's collectives under `--collectives ring` (scripts/perf/
    ring_collectives.py), so it also takes a process group (the transport's own sockets, or one
    of 08's groups: its ranks in the group's order), any length of tensor (the chunks then differ
    by at most one element: tensor_split), and a simulated link that makes each send cost what it
    would on a real one (Link, below; None: as fast as it goes)."""

    def __init__(self, group=None, link=None):
        self.group, self.link = group, link
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        # my neighbours as global ranks, which is what a send names (in 08's group [1, 3], rank 1's right is 3)
        ranks = range(self.world_size) if group is None else dist.get_process_group_ranks(group)
        self.right, self.left = ranks[(self.rank + 1) % self.world_size], ranks[(self.rank - 1) % self.world_size]
        self.sent = 0

    def _exchange(self, send, recv):
        """Send `send` to the right neighbour while receiving `recv` from the left one."""
        start = time.perf_counter()
        # Posted as one group, then both awaited. Not an isend and then a blocking recv: at
        # N = 2 right IS left, NCCL runs a rank's send and receive to one peer in order on one
        # stream, and a send larger than NCCL's buffers waits for the peer's receive, which
        # waits behind the peer's own send: a deadlock. NCCL needs a send and a receive that
        # must progress together grouped; gloo runs the same code. An empty chunk (a tensor
        # with fewer elements than ranks) is not sent, and its receiver expects none.
        ops = [dist.P2POp(op, t, peer, self.group)
               for op, t, peer in ((dist.isend, send, self.right), (dist.irecv, recv, self.left)) if t.numel()]
        for request in dist.batch_isend_irecv(ops) if ops else ():
            request.wait()
        self.sent += send.numel() * send.element_size()
        if self.link is not None and send.numel():  # the simulated link: latency + bytes / bandwidth
            self.link.hold(send.numel() * send.element_size(), since=start)

    def _reduce_scatter(self, chunks, incoming=None):
        """In place: afterwards chunks[r] holds chunk r summed over all ranks. Each arriving chunk
        lands in `incoming` first: a new buffer, or one the caller keeps (the ring transport does)."""
        n, r = self.world_size, self.rank
        if incoming is None:
            incoming = torch.empty_like(chunks[0])  # the largest chunk (tensor_split: the first)
        # ### BEGIN SOLUTION: ring reduce-scatter
        # GOAL: afterwards chunks[r] holds chunk r summed over all N ranks (other chunks may hold
        #       partial sums). Neighbour to neighbour only: N - 1 steps, every rank sending one chunk
        #       a step to its right, all at once: (N-1)/N of the tensor per rank in all.
        for s in range(n - 1):
            arriving = incoming[:chunks[(r - s - 2) % n].numel()]
            self._exchange(chunks[(r - s - 1) % n], arriving)
            chunks[(r - s - 2) % n].add_(arriving)
        # ### END SOLUTION

    def _all_gather(self, chunks):
        """In place: chunks[r] (mine) -> every chunks[i] holds rank i's."""
        n, r = self.world_size, self.rank
        # ### BEGIN SOLUTION: ring all-gather
        # GOAL: afterwards chunks[i] holds rank i's chunk, for every i, on every rank. Neighbour
        #       to neighbour only: N - 1 steps, every rank sending one chunk a step to its right.
        for s in range(n - 1):  # pass each chunk on, one hop a step
            self._exchange(chunks[(r - s) % n], chunks[(r - s - 1) % n])
        # ### END SOLUTION

    def reduce_scatter(self, full):
        """full: (N * c,) on every rank -> (c,): chunk r of the sum over ranks."""
        chunks = full.clone().chunk(self.world_size)  # my working copy, cut in N chunks of c elements
        self._reduce_scatter(chunks)
        return chunks[self.rank]

    def all_gather(self, mine):
        """mine: (c,) chunk r -> (N * c,): every rank's chunk, in rank order."""
        full = torch.empty(self.world_size * mine.numel(), dtype=mine.dtype, device=mine.device)
        chunks = full.chunk(self.world_size)
        chunks[self.rank].copy_(mine)
        self._all_gather(chunks)
        return full

    def all_reduce(self, full):
        """The sum over ranks, on every rank: reduce-scatter, then all-gather, on one copy of
        any length (N chunks that differ by at most one element)."""
        out = full.clone()
        chunks = out.view(-1).tensor_split(self.world_size)
        self._reduce_scatter(chunks)
        self._all_gather(chunks)
        return out


# ----------------------------------------------------------------------------- what a send costs
class Link:
    """A network link as the alpha-beta model sees it (and scripts/learn/cost_model.py): a send of
    b bytes takes latency + 8 b / bandwidth seconds. So a ring pass over N ranks of S bytes costs
    (N - 1) (latency + S/N / bandwidth): latency grows with N, the bytes term does not. `--link
    GBPS:LATENCY_US` simulates one: each send is held until the link would have carried it."""

    def __init__(self, gbps, latency_us):
        self.gbps, self.latency_us = gbps, latency_us

    @classmethod
    def parse(cls, text):
        """'GBPS:LATENCY_US' (gigabits per second, microseconds), e.g. '1:50'; ValueError if not."""
        try:
            gbps, latency = (float(x) for x in text.split(":"))
        except ValueError:
            raise ValueError(f"--link {text!r}: expected GBPS:LATENCY_US, e.g. 1:50 (1 Gb/s, 50 us)") from None
        if not (1e-3 <= gbps < float("inf") and 0 <= latency <= 1e6):  # (slower: a send can outlast any run)
            raise ValueError(f"--link {text!r}: the bandwidth must be 0.001 Gb/s or more and the latency 0 to 1000000 us (1 s)")
        return cls(gbps, latency)

    def seconds(self, nbytes):
        return self.latency_us * 1e-6 + nbytes * 8 / (self.gbps * 1e9)

    def hold(self, nbytes, since):
        """After a send that began at `since` (perf_counter): wait out what the link charges."""
        time.sleep(max(0.0, since + self.seconds(nbytes) - time.perf_counter()))


# ----------------------------------------------------------------------------- checked and counted
def measured(fn):
    """fn() with the bytes this process wrote on the wire while it ran (None off Linux), and its seconds."""
    dist.barrier()
    before, start = comm_meter.bytes_written(), time.perf_counter()
    out = fn()
    seconds, after = time.perf_counter() - start, comm_meter.bytes_written()
    return out, None if before is None else after - before, seconds


def main(argv=None):
    # the shared flags it uses (--seed, --n-layer, ... for Psi, --link, --report); those of
    # training (--steps, --global-batch, --precision, ...) are refused: nothing is trained here
    args = common.parse_args(argv, description=__doc__)
    if args.collectives == "ring" and not args.link:  # its ring runs beside torch's, to compare
        lifecycle.fail("00 compares its own ring with torch's collectives: --collectives ring is for 01-08 "
                       "(--link slows 00's ring)")
    link, args.collectives = Link.parse(args.link) if args.link else None, "torch"  # torch's stay torch's
    env = common.init_distributed(args)
    n, r = env.world_size, env.rank
    with torch.device("meta"):
        psi = common.n_params(GPT(common.model_config(args), seed=None))
    numel = -(-psi // n) * n  # padded to a multiple of N, as 04-06 pad their flat buffers
    # Small integers: every sum is exact in fp32 in any order, so the ring's answer and
    # torch's must be equal bit for bit, whatever order each adds in.
    g = torch.Generator().manual_seed(args.seed + r)
    x = torch.randint(-8, 8, (numel,), generator=g).float().to(env.device)
    ring, out = Ring(link=link), {}
    checks = {  # ours, torch's
        "reduce_scatter": (lambda: ring.reduce_scatter(x), lambda: _reduce_scatter(x, n)),
        "all_gather": (lambda: ring.all_gather(x[:numel // n]),
                       lambda: _all_gather(x[:numel // n], numel)),
        "all_reduce": (lambda: ring.all_reduce(x), lambda: _all_reduce(x)),
    }
    for kind, (ours, theirs) in checks.items():
        ring.sent = 0
        mine, wire, seconds = measured(ours)
        want, torch_wire, _ = measured(theirs)
        passes = 2 if kind == "all_reduce" else 1
        out[kind] = {"equal_to_torch": bool(torch.equal(mine, want)), "sent_bytes": ring.sent,
                     "wire_bytes": wire, "torch_wire_bytes": torch_wire,
                     "ring_bytes": passes * (n - 1) * numel // n * 4, "seconds": seconds,
                     "link_seconds": link and passes * (n - 1) * link.seconds(numel // n * 4)}
    gathered = [None] * n
    dist.all_gather_object(gathered, out)
    if env.master:
        print(f"Psi = {psi:,} fp32 elements (padded to {numel:,}), {n} rank{'s' if n > 1 else ''}; bytes sent per rank")
        for kind in checks:
            o = out[kind]
            wire = "n/a" if o["wire_bytes"] is None else f"{o['wire_bytes'] / 2 ** 20:.3f}"
            torch_wire = "n/a" if o["torch_wire_bytes"] is None else f"{o['torch_wire_bytes'] / 2 ** 20:.3f}"
            print(f"  {kind:>14}: ours {o['sent_bytes'] / 2 ** 20:.3f} MiB (theory {o['ring_bytes'] / 2 ** 20:.3f}, "
                  f"on the wire {wire}) | torch's on the wire {torch_wire} MiB | "
                  f"{'equal' if all(g[kind]['equal_to_torch'] for g in gathered) else 'DIFFERENT'} on every rank"
                  + (f" | ours {o['seconds'] * 1e3:.1f} ms (the link's (N-1)(latency + S/N/bandwidth) per pass: "
                     f"{o['link_seconds'] * 1e3:.1f})" if link and n > 1 else ""))
        if args.report:
            with open(args.report, "w") as f:
                json.dump({"strategy": "collectives", "world_size": n, "backend": env.backend,
                           "device": str(env.device), "n_params": psi, "numel": numel, "config": vars(args),
                           "comm": {"per_rank": gathered}}, f, indent=1)
    return gathered


def _reduce_scatter(full, n):
    mine = torch.empty(full.numel() // n, device=full.device)
    dist.reduce_scatter_tensor(mine, full)
    return mine


def _all_gather(mine, numel):
    full = torch.empty(numel, device=mine.device)
    dist.all_gather_into_tensor(full, mine)
    return full


def _all_reduce(x):
    y = x.clone()
    dist.all_reduce(y)
    return y


if __name__ == "__main__":
    lifecycle.run_main(main)
