"""06-08 as drop-ins for FSDP2 on the model shapes FSDP2 trains: a checkpoint the model places
around a unit (or around several), a unit called twice in one forward, units called in another
order than listed, a unit run under no_grad in some steps, an evaluation forward between steps,
and the constructors called with their defaults. Each must train as one process on the whole
batch does, on every rank, and gather what the schedule says (lessonkit/schedule.py)."""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.utils.checkpoint import checkpoint

from graded import load_lesson
from harness import launches
from lessons import adamw
from tolerances import TOL

STEPS, ROWS, SEQ, VOCAB, D = 3, 2, 5, 13, 6
# shape -> (the blocks forward calls, in order; all-gathers per step once the order is learned:
# root + each call, forward and backward; with prefetch and without)
SHAPES = {
    "around": ([0, 1, 2], 8, 8),           # checkpoint(block, h): recomputed inside its own backward
    "around_several": ([0, 1, 2], 8, 9),   # checkpoint over blocks 0 and 1: 0 recomputed before its
                                           # backward, gathered once more unless prefetched already
    "reused": ([0, 1, 2, 0], 10, 10),      # block 0 twice: gathered for each call, reduced once
    "reordered": ([2, 0, 1], 8, 8),        # listed 0, 1, 2; called 2, 0, 1
    "no_grad": ([0, 1, 2], 8, 8),          # block 1 under no_grad in odd steps: no gradient, as one process
}


class Net(nn.Module):
    def __init__(self, shape):
        super().__init__()
        torch.manual_seed(0)
        self.shape, self.calls, self.step = shape, SHAPES[shape][0], 0
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, 7), nn.Tanh(), nn.Linear(7, D)) for _ in range(3))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x, y):
        h = self.emb(x)
        if self.shape == "around_several":
            h = checkpoint(lambda h: self.blocks[1](self.blocks[0](h)), h, use_reentrant=False)
            h = self.blocks[2](h)
        for i in self.calls if self.shape != "around_several" else ():
            if self.shape == "around":
                h = h + checkpoint(self.blocks[i], h, use_reentrant=False)
            elif self.shape == "no_grad" and i == 1 and self.step % 2:
                with torch.no_grad():
                    h = h + self.blocks[i](h)
            else:
                h = h + self.blocks[i](h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def batch(step, world, rank=None):
    """The step's global batch, or rank `rank`'s rows of it."""
    tokens = torch.randint(VOCAB, (ROWS * world, SEQ + 1), generator=torch.Generator().manual_seed(step))
    rows = slice(None) if rank is None else slice(rank * ROWS, (rank + 1) * ROWS)
    return tokens[rows, :-1], tokens[rows, 1:]


def train(model, net, params, world, rank=None):
    """The loop a user writes for FSDP2: AdamW with weight decay (a zero gradient moves a weight,
    no gradient leaves it), an evaluation forward after each step. Returns the losses."""
    opt = torch.optim.AdamW(params, **{**adamw(1e-2), "weight_decay": 0.1})
    losses = []
    for step in range(STEPS):
        net.step = step
        loss = model(*batch(step, world, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model(*batch(step + 100, world, rank))
        losses.append(loss.item())
    return losses


def one_process(shape, world):
    net = Net(shape)
    losses = train(net, net, net.parameters(), world)
    return {"losses": torch.tensor(losses), "params": {n: p.detach().clone() for n, p in net.named_parameters()}}


def strategy(lesson, net, prefetch):
    """The lesson's class, with its defaults but for prefetch (08: its grid over one-rank shard
    groups, every rank a replica, and with its defaults: no grid)."""
    units = list(net.blocks)
    if lesson == "06":
        return load_lesson("06_zero3").ZeRO3(net, units=units, prefetch=prefetch)
    if lesson == "07":
        return load_lesson("07_offload").ZeRO3Offload(net, units=units, prefetch=prefetch,
                                                      offload_policy=CPUOffloadPolicy(pin_memory=False))
    hybrid = load_lesson("08_hybrid")
    groups = hybrid.hybrid_groups(1) if lesson == "08" else (None, None)
    return hybrid.HybridShard(net, units=units, prefetch=prefetch, shard_group=groups[0], replicate_group=groups[1])


def counted(name, counts):
    real = getattr(dist, name)

    @functools.wraps(real)
    def call(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return real(*args, **kwargs)
    return call


def suite(world):
    from lessons import zero3_full_parameters
    rank, out = dist.get_rank(), {"runs": {}}
    try:  # a replicate group over the world, with the default shard group (the world too)
        load_lesson("08_hybrid").HybridShard(Net("around"), units=[], replicate_group=dist.group.WORLD)
    except ValueError as e:
        out["refused"] = str(e)
    for shape in SHAPES:
        for lesson in ("06", "07", "08", "08_defaults"):
            for prefetch in (True, False):
                net = Net(shape)
                z = strategy(lesson, net, prefetch)
                counts = {}
                real = dist.all_gather_into_tensor, dist.reduce_scatter_tensor
                dist.all_gather_into_tensor = counted("all_gather_into_tensor", counts)
                dist.reduce_scatter_tensor = counted("reduce_scatter_tensor", counts)
                try:
                    losses = train(z, net, z.parameters(), world, rank)
                    counts.clear()  # the last step alone: the order learned
                    net.step = STEPS - 1
                    z(*batch(0, world, rank)).backward()
                finally:
                    dist.all_gather_into_tensor, dist.reduce_scatter_tensor = real
                for p in z.parameters():
                    p.grad = None
                out["runs"][shape, lesson, prefetch] = {"losses": torch.tensor(losses), "params": zero3_full_parameters(z),
                                                "counts": counts}
    return out


results = launches(suite)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_shape_trains_as_one_process_on_every_rank(world, shape):
    want, ranks = one_process(shape, world), results(world)
    for rank, ran in enumerate(ranks):
        for (s, lesson, prefetch), got in ran["runs"].items():
            if s != shape:
                continue
            where = f"rank {rank}, {lesson}, prefetch {prefetch}"
            losses = sum(r["runs"][s, lesson, prefetch]["losses"] for r in ranks) / world  # the global batch's
            torch.testing.assert_close(losses, want["losses"], **TOL, msg=where)
            for name, p in want["params"].items():
                torch.testing.assert_close(got["params"][name], p, **TOL, msg=f"{where}: {name}")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_call_gathers_its_unit_and_each_unit_reduces_once(shape):
    _, with_prefetch, without = SHAPES[shape]
    for (s, lesson, prefetch), got in results(2)[0]["runs"].items():
        if s == shape:
            gathers = got["counts"]["all_gather_into_tensor"]
            assert gathers == (with_prefetch if prefetch else without), (lesson, prefetch, got["counts"])
            assert got["counts"]["reduce_scatter_tensor"] == 4, (lesson, prefetch, got["counts"])


def test_groups_that_do_not_make_the_world_are_refused():
    assert "are not the world's 2 ranks" in results(2)[0]["refused"]
