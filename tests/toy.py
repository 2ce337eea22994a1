"""A toy model with every edge case of design.md, and the loop that trains it.

ToyNet: an embedding tied to the output head, a frozen layer, a parameter that never gets a
gradient, and 119 trainable elements (prime: no world size divides it).
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, BATCH, SEQ = 11, 12, 5  # 12 rows: 1, 2 and 4 ranks x 3 micro-steps divide it


class ToyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.frozen = nn.Linear(6, 7)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(7, 6)
        self.unused = nn.Parameter(torch.randn(1, 5))  # never used in forward: no gradient; 2-D: decayed
        self.head = nn.Linear(6, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied, as in GPT-2

    def forward(self, x, y):
        h = self.hidden(torch.tanh(self.frozen(self.emb(x))))
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def toy_batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def make_toy(seed=0):
    torch.manual_seed(seed)
    return ToyNet()


def toy_train(build, lesson, steps=4, grad_accum=1, different_init=False, **kw):
    """In a spawned rank: train ToyNet with `lesson`'s strategy; ranks may start different."""
    trainer = build(lesson, make_toy(seed=dist.get_rank() if different_init else 0), **kw)
    return train_my_rows(trainer, toy_batch, steps, grad_accum)


def train_my_rows(trainer, batch, steps, grad_accum):
    """The loop every toy trains in, in a spawned rank: each step's whole batch from batch(step),
    this rank's rows of it in grad_accum micro-batches; the global mean loss of each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        x, y = batch(step)
        rows = x.shape[0] // world
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        micro = rows // grad_accum
        batches = [(x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]) for i in range(grad_accum)]
        loss = torch.tensor(trainer.train_step(batches))
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return {"losses": losses, "params": trainer.full_parameters()}


def toy_reference(steps=4, grad_clip=0.0, lr=1e-2, weight_decay=0.0, **_):
    """Single process, whole batch, the same optimizer: the answer every lesson must give."""
    from lessonkit import optimizers
    from lessons import adamw
    model = make_toy(seed=0)
    opt = optimizers.MixedPrecisionAdamW(optimizers.decay_groups(model, weight_decay), grad_clip, **adamw(lr))
    return train_whole_batch(model, opt, steps)


def toy_sgd_reference(steps=4, lr=0.5):
    """toy_reference with plain SGD: unlike Adam it sees the gradient's scale (a missing 1/N)."""
    model = make_toy(seed=0)
    return train_whole_batch(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr), steps)


def train_whole_batch(model, opt, steps):
    """One process, the whole batch each step: losses and final parameters."""
    losses = []
    for step in range(steps):
        loss = model(*toy_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
