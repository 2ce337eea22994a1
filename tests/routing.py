"""A model whose data decides what runs: RoutedNet, for find_unused_parameters and its kin.

Each block (a ZeRO-3/FSDP unit: lessons.sharding_units takes `blocks`) may be skipped whole, and
holds "experts" (an MoE's experts, or any branch some batches skip) that may be skipped one by
one; the root holds one more. Which rows use what is a mask that travels with its rows, as extra
columns of x, so every strategy's batch split hands each rank (and micro-step) its own routing
and single-process training on the whole batch applies each row's. A module no row of a batch
uses does not run at all there (its parameters get no gradient on that rank), or, with
`run_unused`, runs and its output is dropped (backward never reaches it).

routed_train / routed_reference: as toy.toy_train / toy_reference; `route(step, chunks)` draws,
per step, each routed module's use on all, some or none of the batch's chunks (chunk = one
rank's micro-batch), so a module used on some ranks and not others comes up every step.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from toy import train_my_rows

VOCAB, SEQ, WIDTH, BATCH = 11, 5, 6, 72  # 72 rows: 1-4 ranks x 1-3 micro-steps divide it
EXPERTS = (2, 2, 1)  # per block; block 1 has no dense layer: skip its experts and it gets no gradient


class Block(nn.Module):
    def __init__(self, n_experts, dense=True, run_unused=False):
        super().__init__()
        self.dense = nn.Linear(WIDTH, WIDTH) if dense else None
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(n_experts))
        self.run_unused = run_unused

    def forward(self, h, route):  # route: (rows, n_experts) bool
        if self.dense is not None:
            h = h + torch.tanh(self.dense(h))
        for expert, use in zip(self.experts, route.unbind(1)):
            h = routed(lambda h: h + torch.tanh(expert(h)), h, use, self.run_unused)
        return h


def routed(f, h, use, run_unused=False):
    """f(h) on the rows `use` marks, h elsewhere. No row: f does not run (or runs, dropped)."""
    if not use.any():
        if run_unused:
            f(h)  # computed, never used: backward does not reach it
        return h
    return f(h) if use.all() else torch.where(use.view(-1, 1, 1), f(h), h)


def block_slots(experts=EXPERTS):
    """The route column of each block (its experts' columns follow it; column 0: the root's)."""
    return [1 + sum(1 + n for n in experts[:i]) for i in range(len(experts))]


class RoutedNet(nn.Module):
    """An embedding tied to the head and a routed expert in the root, then routed blocks."""

    def __init__(self, experts=EXPERTS, run_unused=False, route_blocks=True):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.expert = nn.Linear(WIDTH, WIDTH)  # the root's own routed parameters
        self.blocks = nn.ModuleList(Block(n, dense=i != 1, run_unused=run_unused) for i, n in enumerate(experts))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.experts, self.run_unused, self.route_blocks = tuple(experts), run_unused, route_blocks

    def slots(self):  # routed modules per row: the root's expert, then each block and its experts
        return 1 + sum(1 + n for n in self.experts)

    def forward(self, x, y):
        tokens, route = x[:, :SEQ], x[:, SEQ:].bool()
        h = routed(lambda h: h + torch.tanh(self.expert(h)), self.emb(tokens), route[:, 0], self.run_unused)
        for block, at, n in zip(self.blocks, block_slots(self.experts), self.experts):
            use = route[:, at] | (not self.route_blocks)  # a row that skips a block skips its experts
            h = routed(lambda h: block(h, route[:, at + 1:at + 1 + n] & use[:, None]), h, use, self.run_unused)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def make_routed(seed=0, **kw):
    torch.manual_seed(seed)
    return RoutedNet(**kw)


def route(step, chunks, slots):
    """(chunks, slots) bool: per routed module, used by all chunks, by some (not all), or by none,
    drawn per step (a fixed seed: every rank draws the same)."""
    g = torch.Generator().manual_seed(2016 + step)  # 4 steps at 2-4 ranks cover every case (tested)
    kind = torch.randint(3, (slots,), generator=g)  # 0: all, 1: some, 2: none
    some = torch.rand(chunks, slots, generator=g) < 0.5
    if chunks > 1:  # "some" means at least one chunk and not every one
        some[0] |= ~some.any(0)
        some[-1] &= ~some.all(0)
    return torch.where(kind == 0, True, torch.where(kind == 1, some, False))


def routed_batch(step, chunks, slots):
    """The whole batch: x = (tokens | route columns), y; chunk c is rows c*BATCH/chunks ..."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = route(step, chunks, slots).repeat_interleave(BATCH // chunks, dim=0)
    return torch.cat([tokens[:, :-1], mask.long()], dim=1), tokens[:, 1:]


def routed_train(build, lesson, steps=4, grad_accum=1, model_kw=None, **kw):
    """In a spawned rank: train RoutedNet with `lesson`'s strategy (lessons.build(..., **kw))."""
    world = dist.get_world_size()
    model = make_routed(**(model_kw or {}))
    trainer = build(lesson, model, **kw)
    return train_my_rows(trainer, lambda step: routed_batch(step, world * grad_accum, model.slots()),
                         steps, grad_accum)


def routed_reference(world, grad_accum=1, steps=4, lr=1e-2, model_kw=None, find_unused=True):
    """Single process, the whole batch with the routing of `world` x `grad_accum` chunks. With
    find_unused=False, as a strategy without find_unused_parameters: a parameter no row used
    counts as used, with a zero gradient (AdamW then moves it, by its moments)."""
    from lessonkit import optimizers
    from lessons import adamw
    model = make_routed(**(model_kw or {}))
    opt = optimizers.MixedPrecisionAdamW(model.parameters(), **adamw(lr))
    losses = []
    for step in range(steps):
        loss = model(*routed_batch(step, world * grad_accum, model.slots()))
        loss.backward()
        for p in model.parameters():
            if p.grad is None and not find_unused:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()  # a parameter no row used keeps grad None: AdamW skips it
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def used_by_rank(step, world, grad_accum=1, experts=EXPERTS):
    """(world, slots) bool: which routed modules each rank runs at `step` (in any micro-step;
    an expert only where its block runs too), as routed_train routes them."""
    slots = 1 + sum(1 + n for n in experts)
    use = route(step, world * grad_accum, slots)
    for at, n in zip(block_slots(experts), experts):  # a row that skips a block skips its experts
        use[:, at + 1:at + 1 + n] &= use[:, at:at + 1]
    return use.view(world, grad_accum, slots).any(1)
