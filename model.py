"""The small GPT every lesson trains, and the data it learns from (at the end).

Pre-norm decoder blocks with causal self-attention, learned positions, no dropout, and the token
embedding tied to the output head as in GPT-2 (so the model has one fewer (V, d) matrix than it
has uses of one: the classic shared-parameter case every data-parallel library must handle).

Initialisation is deterministic per parameter: each parameter draws from its own generator,
seeded by the run's seed and the parameter's name. So any subset of the model (one transformer
block, say) can be initialised on its own and gets exactly the values it would get in the full
model; ZeRO-3 (06) relies on this to build the model one unit at a time.
"""
import functools
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int = 64
    seq_len: int = 64
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    activation_checkpointing: str = "none"  # "block": each block recomputed in backward


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.recompute = cfg.activation_checkpointing == "block"

    def forward(self, x):
        if self.recompute and torch.is_grad_enabled():
            # Keep only x: backward runs compute(x) again to rebuild what it needs (non-reentrant:
            # autograd and hooks as usual). The block's own hooks (06's gather and free) run once,
            # around this call; the recomputation happens inside the block's backward.
            return checkpoint(self.compute, x, use_reentrant=False)
        return self.compute(x)

    def compute(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int | None = 0):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_weights()
        if seed is not None:  # seed=None leaves parameters uninitialised (meta-device builds)
            init_parameters(self, seed, cfg.n_layer)

    def tie_weights(self):
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        # The loss is computed in fp32 whatever the working precision.
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, n_layer: int, prefix: str = ""):
    """Initialise every parameter of `module` from a generator seeded by (seed, full name).

    `prefix` is the module's name inside the GPT ("blocks.2" for block 2), so a block
    initialised alone gets the same values as it gets in the whole model.
    """
    for name, p in module.named_parameters(prefix=prefix):
        if name.endswith("bias"):
            value = torch.zeros(p.shape)
        elif ".ln_" in name or name.startswith("ln_"):
            value = torch.ones(p.shape)
        else:
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            # GPT-2 scales the residual projections by depth so the residual stream stays O(1).
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
            value = torch.randn(p.shape, generator=g) * std
        p.copy_(value)  # generated in fp32 on the CPU, then cast/moved: same values everywhere


# ----------------------------------------------------------------------------- the data
@functools.lru_cache(maxsize=4)
def _successors(seed, vocab_size, k=4):
    """The data's rule: each token is followed by one of k fixed successors, equally likely."""
    g = torch.Generator().manual_seed(seed + 12345)
    return torch.stack([torch.randperm(vocab_size, generator=g)[:k] for _ in range(vocab_size)])


def global_batch(seed, step, batch, seq_len, vocab_size):
    """The whole global batch of step `step`: (batch, seq_len + 1) tokens, the same on every
    rank and at every world size. The best possible loss is ln(4), the entropy of the rule."""
    succ = _successors(seed, vocab_size)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab_size, (batch,), generator=g)
    choice = torch.randint(succ.shape[1], (batch, seq_len), generator=g)
    for t in range(seq_len):
        tokens[:, t + 1] = succ[tokens[:, t], choice[:, t]]
    return tokens


_rows = (None, None)  # (which step of which run, this rank's rows of it on the device)


def get_batch(args, env, step, micro):
    """Rank r of N takes rows r*B/N .. (r+1)*B/N of the global batch, split into micro-steps.

    A step's rows are made and moved to the device once, at its first micro-step; on CUDA from
    pinned memory with non_blocking=True, so the CPU queues the copy and goes on."""
    global _rows
    per_rank = args.global_batch // env.world_size
    key = (args.seed, step, args.global_batch, args.seq_len, args.vocab_size, env.rank, env.world_size, env.device)
    if _rows[0] != key:
        tokens = global_batch(args.seed, step, args.global_batch, args.seq_len, args.vocab_size)
        mine = tokens[env.rank * per_rank:(env.rank + 1) * per_rank]
        if env.device.type == "cuda":
            mine = mine.pin_memory().to(env.device, non_blocking=True)
        _rows = (key, mine)
    per_micro = per_rank // args.grad_accum
    rows = _rows[1][micro * per_micro:(micro + 1) * per_micro]
    return rows[:, :-1], rows[:, 1:]
