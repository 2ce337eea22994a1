"""The differential fuzzer's models and data (tests/fuzz.py draws the specs with Hypothesis).

FuzzNet is built from a JSON-able spec: an embedding (tied to the output head, or not; frozen,
when not tied), an optional routed "expert" in the root, then blocks (ZeRO-3/FSDP2 units:
lessons.sharding_units takes `blocks`), each with an optional dense layer and routed experts,
optionally routed whole, and frozen: not at all, its dense layer's first Linear, or all of it;
and optionally a parameter no forward ever uses. Forward calls the blocks in `calls` (default:
each once, in order; a block may be called twice, or the blocks in another order), with
checkpoints placed inside each block, around each call or around two calls at a time, and one
block under no_grad in the steps its flag column says. Widths are small (1-13), mostly odd or prime,
so no world size divides Ψ.

Routing as in tests/routing.py (whose `routed` applies it): which rows use a routed module is a
mask that travels with its rows, as extra columns of x, so every strategy's split of the batch
hands each rank (and micro-step) its own routing, and single-process training on the whole
batch applies each row's. A module no row of a chunk uses does not run there (its parameters
get no gradient on that rank), or, with `run_unused`, runs and its output is dropped.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from routing import routed


def mlp(d, hidden):
    return nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, d))


class Block(nn.Module):
    """h + dense(h) (if hidden > 0), then each expert on the rows routed to it."""

    def __init__(self, d, hidden, experts, frozen, run_unused, recompute=False):
        super().__init__()
        self.recompute = recompute  # as model.py's Block under --activation-checkpointing block
        self.dense = mlp(d, hidden) if hidden else None
        self.experts = nn.ModuleList(mlp(d, e) for e in experts)
        if frozen == "first":
            self.dense[0].requires_grad_(False)
        elif frozen == "all":  # a unit with nothing to train
            self.requires_grad_(False)
        self.run_unused = run_unused

    def forward(self, h, route):  # route: (rows, n_experts) bool
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self.compute, h, route, use_reentrant=False)
        return self.compute(h, route)

    def compute(self, h, route):
        if self.dense is not None:
            h = h + self.dense(h)
        for expert, use in zip(self.experts, route.unbind(1)):
            h = routed(lambda h: h + expert(h), h, use, self.run_unused)
        return h


class FuzzNet(nn.Module):
    def __init__(self, spec):
        super().__init__()
        d, vocab = spec["d"], spec["vocab"]
        self.spec = spec
        self.emb = nn.Embedding(vocab, d)
        self.root_expert = mlp(d, spec["root_expert"]) if spec["root_expert"] else None
        # spec["checkpoint"]: True (or "inside"): each block checkpoints itself (model.py's
        # --activation-checkpointing block); "around", "around_pairs": placed by forward
        self.blocks = nn.ModuleList(Block(d, b["hidden"], b["experts"], b["frozen"], spec["run_unused"],
                                          spec.get("checkpoint") in (True, "inside")) for b in spec["blocks"])
        self.head = nn.Linear(d, vocab, bias=False)
        if spec["tied"]:
            self.head.weight = self.emb.weight  # as GPT-2
        elif spec["frozen_emb"]:
            self.emb.requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(spec["unused"])) if spec["unused"] else None  # never used

    def forward(self, x, y):
        seq, n = y.shape[1], n_slots(self.spec)
        route = x[:, seq:seq + n].bool()  # (rows, slots), in routing_slots' order
        # in this step, the block (if any) called under no_grad: the flag column after the routes
        no_grad = self.spec.get("no_grad_block") if x.shape[1] > seq + n and x[0, seq + n] else None
        h = self.emb(x[:, :seq])
        if self.root_expert is not None:
            h = routed(lambda h: h + self.root_expert(h), h, route[:, 0], self.spec["run_unused"])
        calls = self.spec.get("calls") or list(range(len(self.blocks)))
        # a checkpoint the model places around each block call, or around two calls at a time
        size = {"around": 1, "around_pairs": 2}.get(self.spec.get("checkpoint"))
        groups = [calls[i:i + size] for i in range(0, len(calls), size)] if size else [calls]

        def run(group, h):
            for i in group:
                if i == no_grad:  # as a frozen step: no gradient reaches the block, h's passes by
                    with torch.no_grad():
                        delta = self.call(i, h, route) - h
                    h = h + delta
                else:
                    h = self.call(i, h, route)
            return h
        for group in groups:
            if size and torch.is_grad_enabled():
                h = checkpoint(lambda h, group=group: run(group, h), h, use_reentrant=False)
            else:
                h = run(group, h)
        return F.cross_entropy(self.head(h).float().flatten(0, 1), y.flatten())

    def call(self, i, h, route):
        """Block i on h, routed by its columns of `route`."""
        block, b, at = self.blocks[i], self.spec["blocks"][i], block_slot(self.spec, i)
        n = len(b["experts"])
        if b["routed"]:  # the whole block (a unit), then its experts, on the block's rows only:
            # else one process would run an expert on rows the block then drops, and give it
            # a zero gradient where no rank's backward reaches it (a gradient, not None)
            use = route[:, at:at + 1]
            return routed(lambda h: block(h, route[:, at + 1:at + 1 + n] & use), h, use[:, 0], self.spec["run_unused"])
        return block(h, route[:, at:at + n])


def block_slot(spec, i):
    """The first routing column of block i (its own, if routed whole, then its experts')."""
    return (1 if spec["root_expert"] else 0) + sum(b["routed"] + len(b["experts"]) for b in spec["blocks"][:i])


def routing_slots(spec):
    """The routed modules, one mask column each: the root's expert, then per block the block
    itself (if routed whole) and its experts. [(name, module path, whole unit?)]"""
    slots = [("root_expert", "root_expert", False)] if spec["root_expert"] else []
    for i, b in enumerate(spec["blocks"]):
        if b["routed"]:
            slots.append((f"block {i}", f"blocks.{i}", True))
        slots += [(f"block {i} expert {e}", f"blocks.{i}.experts.{e}", False) for e in range(len(b["experts"]))]
    return slots


def n_slots(spec):
    return len(routing_slots(spec))


def make_model(spec, seed, dtype=None):
    """FuzzNet with the weights `seed` gives it. dtype (torch.bfloat16 or torch.float16): as
    common.build_model's bf16 and fp16, the parameters in that dtype with their fp32 initial
    weights kept (`p.fp32_init`) for the optimizer's master weights (01-05); 06 and FSDP2 instead
    take the fp32 model and a MixedPrecisionPolicy."""
    torch.manual_seed(seed)
    model = FuzzNet(spec)
    if dtype not in (None, torch.float32):
        for p in model.parameters():
            p.fp32_init = p.detach().clone()
        model.to(dtype)
    return model


def global_batch(case, step):
    """(x, y) of the whole step: world x accum chunks of `rows` rows, chunk c = rank c // accum's
    micro-step c % accum; x = tokens | one 0/1 column per routing slot (case["routes"][step][slot]
    is a bitmask over the chunks) | with a no_grad block, whether it runs under no_grad this step."""
    chunks, rows, seq = case["world"] * case["accum"], case["rows"], case["seq"]
    g = torch.Generator().manual_seed(case["seed"] * 1000 + step)
    tokens = torch.randint(case["model"]["vocab"], (chunks * rows, seq + 1), generator=g)
    masks = [[(bits >> c) & 1 for bits in case["routes"][step]] for c in range(chunks)]  # (chunks, slots)
    if case["model"].get("no_grad_block") is not None:  # one more column: the block runs under no_grad
        masks = [m + [int(case["no_grad_steps"][step])] for m in masks]
    route = torch.tensor(masks, dtype=torch.long).reshape(chunks, -1).repeat_interleave(rows, dim=0)
    return torch.cat([tokens[:, :-1], route], dim=1), tokens[:, 1:]


def micro_batches(case, step, rank):
    """This rank's micro-batches of global_batch(case, step)."""
    x, y = global_batch(case, step)
    rows, accum = case["rows"], case["accum"]
    at = rank * accum * rows
    return [(x[at + m * rows:at + (m + 1) * rows], y[at + m * rows:at + (m + 1) * rows]) for m in range(accum)]
