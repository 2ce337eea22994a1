"""Hidden tests of 00_collectives: the ring at 5 ranks, on chunks of 1 and 7 elements, fp64 and
int64, against torch.distributed's results and the (N-1) chunks each rank must send."""
import torch
import torch.distributed as dist

import harness
from graded import load_lesson
from harness import spawn

CASES = [(1, torch.float64), (7, torch.float32), (5, torch.int64)]  # (chunk elements, dtype)


def ring_cases():
    """In a rank: each case's (ring == torch for reduce-scatter, all-gather, all-reduce; bytes sent)."""
    ring = load_lesson("00_collectives").Ring()
    n, r = dist.get_world_size(), dist.get_rank()
    out = []
    for c, dtype in CASES:
        g = torch.Generator().manual_seed(100 * r + c)
        x = torch.randint(-8, 8, (n * c,), generator=g).to(dtype)  # small integers: exact sums
        total = x.clone()
        dist.all_reduce(total)
        gathered = [torch.empty(c, dtype=dtype) for _ in range(n)]
        dist.all_gather(gathered, x[:c])
        sent = []
        ring.sent = 0
        rs = ring.reduce_scatter(x)
        sent.append(ring.sent)
        ring.sent = 0
        ag = ring.all_gather(x[:c].clone())
        sent.append(ring.sent)
        ring.sent = 0
        ar = ring.all_reduce(x)
        sent.append(ring.sent)
        out.append({"equal": [torch.equal(rs, total.chunk(n)[r]), torch.equal(ag, torch.cat(gathered)),
                              torch.equal(ar, total)],
                    "sent": sent, "chunk_bytes": c * x.element_size()})
    return out


@harness.once
def results(world):
    return spawn(world, ring_cases, timeout=120)


def test_ring_equals_torch_at_5_ranks_on_tiny_chunks_and_other_dtypes():
    for rank, cases in enumerate(results(5)):
        for (c, dtype), case in zip(CASES, cases):
            assert case["equal"] == [True, True, True], (rank, c, dtype)


def test_each_rank_sends_n_minus_1_chunks_per_pass_at_5_ranks():
    for cases in results(5):
        for case in cases:
            assert case["sent"] == [4 * case["chunk_bytes"], 4 * case["chunk_bytes"], 8 * case["chunk_bytes"]]
