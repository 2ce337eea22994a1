"""--simulate-world N (--simulate-rank r): one process runs a lesson as rank r of a world of N, on
PyTorch's fake process-group backend (torch.testing._internal.distributed.fake_pg, as torchtitan's
COMM_MODE=fake_backend). Every collective is issued, counted by the meter, and returns at once
without moving a byte, so every tensor rank r would allocate is allocated and measured, at any N, on
one machine: the ZeRO paper's Figure 1 measured (docs/measurement.md). What the other ranks would
have sent never arrives: the parameters, losses and step times are not results, and the summary
says so first and prints none of them.
"""
import os

import torch
import torch.distributed as dist

from model import GPT, GPTConfig

# the lessons that build the whole model before they shard it (06-08 build it a unit at a time)
WHOLE = ("01", "02", "03", "04", "05", "09")


def add_flags(g):
    g.add_argument("--simulate-world", type=int, default=None, metavar="N", help="run as one rank of a world of N, "
                   "alone, on the fake backend: collectives counted, no data moved (what a rank holds at scale)")
    g.add_argument("--simulate-rank", type=int, default=0, metavar="R", help="with --simulate-world: which rank (0)")


def check(args, lesson, fail):
    """The world size a simulated run stands for (None: not simulated). Refused, by `fail` (common's):
    what needs the other ranks' data, and a whole model this machine cannot hold."""
    n, r = args.simulate_world, args.simulate_rank
    if n is None:
        return r and fail("--simulate-rank needs --simulate-world N")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        fail("--simulate-world N runs one process as one of N ranks: start it with python, not torchrun")
    if not (1 <= n <= 2 ** 20 and 0 <= r < n):
        fail(f"--simulate-world {n} --simulate-rank {r}: the world is 1 to 2^20 ranks and the rank 0 to N - 1")
    for flag, given in (("--checkpoint-dir", args.checkpoint_dir), ("--trace", args.trace),
                        ("--collectives ring (--link)", args.collectives == "ring" or args.link or args.inter_link)):
        if given:
            fail(f"{flag} with --simulate-world: a simulated world moves no data, so there is nothing to save or time")
    if lesson in WHOLE:
        with torch.device("meta"):
            config = GPTConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, n_layer=args.n_layer,
                               d_model=args.d_model, n_head=args.n_head)
            psi = sum(p.numel() for p in GPT(config, seed=None).parameters())
        need, have = 4 * psi * (1 if args.precision == "fp32" else 2.5), available_bytes()
        if need > have:  # its fp32 initialisation (bf16, fp16: and the working copy): before any shard exists
            fail(f"lesson {lesson} builds the whole model before it shards it, about {need / 1e9:.1f} GB at Psi = "
                 f"{psi:,}, and this machine has {have / 1e9:.1f} GB free: 06-08 build it a unit at a time")
    return n


def available_bytes():
    try:
        with open("/proc/meminfo") as f:  # (Linux; elsewhere no limit is checked)
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return float("inf")


def join(args, dist_class):
    """Rank r of N, alone: the fake backend's process group, on the CPU or this machine's first GPU."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # (PyTorch's own test utility)
    device = torch.device("cuda", 0) if args.device == "cuda" or args.device == "auto" and torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=args.simulate_rank, world_size=args.simulate_world)
    args.device = device.type
    return dist_class(args.simulate_rank, args.simulate_world, device, "fake", simulated=True)
