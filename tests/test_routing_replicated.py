"""01-03 when the data routes around parameters: an expert some ranks use in a step and others do
not, one no rank uses (in some steps, or ever), used only in an earlier micro-step; against one
process on the whole batch and against DDP(find_unused_parameters=True), in the same loop."""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lessonkit import optimizers
from harness import spawn
from lessons import adamw, build
from tolerances import TOL

VOCAB, WIDTH, BATCH, STEPS, ACCUM = 13, 6, 12, 5, 2  # 12 rows: 2 and 3 ranks x 2 micro-steps


def routes(rank, step, micro):
    """Which of the four experts this chunk of the batch goes through."""
    return [True,                                       # every rank, every step
            (rank + step + micro) % 2 == 0,              # some ranks; at world 1 some micro-steps
            step % 3 == 1 and rank == 0 and micro == 0,  # rank 0's first micro-step only; else no rank
            False]                                      # never: keeps grad None on every rank


class Routed(nn.Module):
    """A tied embedding/head, a frozen layer and four experts on the residual stream. forward
    counts its calls, so under a trainer it knows its step and micro-step; routes() says which
    experts the chunk uses."""

    def __init__(self, rank=0):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.rank, self.calls = rank, 0

    def forward(self, x, y, route=None):
        if route is None:
            route = routes(self.rank, self.calls // ACCUM, self.calls % ACCUM)
            self.calls += 1
        h = torch.tanh(self.frozen(self.emb(x)))
        for expert, used in zip(self.experts, route):
            if used:
                h = h + torch.tanh(expert(h))
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def batch(step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(VOCAB, (BATCH, 4), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference(world, set_to_none):
    """One process, the whole batch: each (rank, micro-step) chunk through its own route."""
    model = Routed()
    opt = optimizers.MixedPrecisionAdamW(optimizers.decay_groups(model, 0.1), **adamw(1e-2))
    rows = BATCH // world // ACCUM
    for step in range(STEPS):
        x, y = batch(step)
        loss = sum(model(x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows],
                         route=routes(i // ACCUM, step, i % ACCUM)) for i in range(world * ACCUM))
        (loss / (world * ACCUM)).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(lesson, set_to_none, **kw):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Routed(rank)
    trainer = build(lesson, model, lr=1e-2, weight_decay=0.1, find_unused=True, **kw)
    trainer.opt.zero_grad = functools.partial(trainer.opt.zero_grad, set_to_none=set_to_none)
    rows = BATCH // world // ACCUM
    for step in range(STEPS):
        x, y = batch(step)
        mine = [(x[(rank * ACCUM + m) * rows:(rank * ACCUM + m + 1) * rows],
                 y[(rank * ACCUM + m) * rows:(rank * ACCUM + m + 1) * rows]) for m in range(ACCUM)]
        trainer.train_step(mine)
    return trainer.full_parameters()


def suite(world):
    runs = {}
    for set_to_none in (True, False):
        for lesson, kw in [("ddp", {}), ("01", {}), ("02", {}), ("03", {}), ("03", {"bucket_mb": 1e-4})]:
            runs[lesson, str(kw), set_to_none] = train(lesson, set_to_none, **kw)
    return runs


@pytest.mark.parametrize("world", [2, 3])
def test_an_expert_some_ranks_skip_trains_as_in_one_process_on_every_rank(world):
    results = spawn(world, suite, world)
    for set_to_none in (True, False):
        want = reference(world, set_to_none)
        for key in results[0]:
            if key[2] != set_to_none:
                continue
            for rank, out in enumerate(results):
                for name, p in want.items():
                    torch.testing.assert_close(out[key][name], p, **TOL, msg=f"{key} rank {rank}: {name}")
    # the expert no rank ever used was never stepped: weight decay would have moved it
    torch.testing.assert_close(want["experts.3.weight"], Routed().experts[3].weight.detach(), rtol=0, atol=0)


class _Raise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed on purpose")


def test_a_backward_that_raised_does_not_stop_the_end_of_backward_callback():
    # 02, 03 and 05 synchronize in a callback a backward's first gradient hook queues, once per
    # backward (ddp.at_end_of_backward). A backward that raised never runs its callbacks; "once"
    # is keyed by the backward's own id, so the next backward queues its own (DDP's reducer
    # resets at the next forward). A flag cleared by the callback would stay set: never again.
    import types

    from lessonkit import ddp
    owner, calls = types.SimpleNamespace(), []
    w, v = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    w.register_post_accumulate_grad_hook(lambda p: ddp.at_end_of_backward(owner, lambda: calls.append(1)))
    raising = _Raise.apply(v)  # made first, so its backward runs after w's gradient (and hook)
    with pytest.raises(RuntimeError, match="backward failed on purpose"):
        (raising.sum() + (w * 2).sum()).backward()
    assert calls == []  # queued, then dropped with the failed backward
    (w * 2).sum().backward()
    assert calls == [1]
    (w * 3).sum().backward()
    assert calls == [1, 1]
