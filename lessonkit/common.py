"""What every lesson sets up before its algorithm: flags, the device and the process group, the GPT and
its data (model.py). Elsewhere: DDP's shape for 01-03 in ddp.py, the optimizers' in optimizers.py, exits in lifecycle.py."""
import argparse
import os
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lessonkit import loss_scale, pretrained, simulate
from lessonkit.lifecycle import WATCHDOG_S, env_int, fail, launched_world, restart_advice, say, start_heartbeat
from model import GPT, GPTConfig
from scripts.perf import ring_collectives

# torch 2.6 to 2.15: all_gather_into_tensor and reduce_scatter_tensor (in all) alias *_single since 2.13, which warns per call:
warnings.filterwarnings("ignore", message=".*is deprecated. Please use `torch.distributed.*")


# ----------------------------------------------------------------------------- flags
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line from rank 0, not a usage block from every rank
        fail(message)


def build_parser(description=""):
    # RawDescriptionHelpFormatter: --help prints the lesson's docstring as written, not reflowed
    p = _Parser(description=description, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data and model")
    g.add_argument("--steps", type=int, default=40, help="optimizer steps")
    g.add_argument("--seed", type=int, default=0, help="model initialisation and data")
    g.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, across all ranks and micro-steps")
    g.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (the model's context)")
    g.add_argument("--vocab-size", type=int, default=64, help="tokens in the synthetic language")
    g.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    g.add_argument("--d-model", type=int, default=128, help="width of the residual stream")
    g.add_argument("--n-head", type=int, default=4, help="attention heads (must divide --d-model)")
    g.add_argument("--activation-checkpointing", choices=["none", "block"], default="none",
                   help="block: keep each transformer block's input only, recompute the block in backward")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's decoupled weight decay, on matrices and embeddings, not on biases and norms")
    g.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant", help="cosine: from --lr to --lr/10 at the last step, after the warm-up")
    g.add_argument("--warmup-steps", type=int, default=0, metavar="K", help="raise the learning rate linearly over the first K steps")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    g.add_argument("--grad-clip", type=float, default=1.0, help="global-norm clip; 0 turns it off")
    g.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="bf16, fp16: 2-byte parameters, gradients, collectives; fp32 masters, moments (fp16: loss scaled)")
    g.add_argument("--loss-scale", type=loss_scale.power_of_two, default=None, metavar="S",
                   help="fp16: the loss scale it starts at, a power of two (default 65536, as torch.amp.GradScaler)")
    g = p.add_argument_group("communication")
    g.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap in MiB (03, 05)")
    g.add_argument("--prefetch", type=int, choices=[0, 1], default=1, help="06: all-gather the next unit while this one computes")
    g.add_argument("--zero3", type=int, choices=[0, 1], default=0, help="09: shard the parameters too (ZeRO-3 with Muon): 06's units, each laid out owner by owner")
    g.add_argument("--layout", choices=["even", "uneven"], default="even",
                   help="07: every unit cut evenly over all ranks, or each whole on one rank (the older layout)")
    g.add_argument("--chunk-mb", type=float, default=0.0, metavar="MB", help="07: blocks in forward order, whole, in chunks of <= MB MiB (fp32)")
    g.add_argument("--reduce-every", choices=["micro", "step"], default="micro", help="05-08: reduce-scatter at every micro-step, or once a step (no_sync)")
    g.add_argument("--all-reduce-every", choices=["micro", "step"], default="micro", help="08: all-reduce across replicas at every micro-step, or once")
    g.add_argument("--shard-group", type=int, default=None, metavar="G", help="08: shard over groups of G ranks (a node), "
                   "replicate across them; G divides the world size (default: --ranks-per-node, else torchrun's node)")
    g.add_argument("--collectives", choices=["torch", "ring"], default=None, help="torch (default): the backend's own "
                   "collectives; ring: lesson 00's ring of sends (ring_collectives.py), whose wire bytes are the ZeRO paper's")
    g.add_argument("--link", metavar="GBPS:LATENCY_US", default=None, help="a simulated link for the ring (implies --collectives "
                   "ring): each send costs latency + bytes / bandwidth, e.g. 1:50 (1 Gb/s, 50 us); with --inter-link, inside a node")
    g.add_argument("--inter-link", metavar="GBPS:LATENCY_US", default=None,
                   help="the link between simulated nodes (implies --collectives ring): a send to another node, e.g. 1:50")
    g.add_argument("--ranks-per-node", type=int, default=None, metavar="G",
                   help="with --inter-link: nodes of G consecutive ranks (default: --shard-group, 08's node)")
    g = p.add_argument_group("checkpoints (checkpoint.py)")
    g.add_argument("--checkpoint-dir", metavar="DIR", default=None, help="DIR/step_NNNNNN/: each rank's shard, meta.json, COMPLETE")
    g.add_argument("--save-every", type=int, default=0, metavar="K", help="save every K steps; 0 never")
    # --resume alone is True: a checkpoint must be there; --resume auto: if there is one
    g.add_argument("--resume", nargs="?", const=True, default=False, choices=["auto"], metavar="auto",
                   help="continue from the newest complete checkpoint in --checkpoint-dir, at any world size; "
                        "auto: from it if there is one, else from step 0 (a job script under torchrun --max-restarts)")
    g.add_argument("--init-from", metavar="FILE", default=None, help="start from a GPT state_dict's weights, not the seed's")
    g = p.add_argument_group("run-time and measurement")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA (nccl) when every rank on the node has a GPU, else CPU (gloo)")
    g.add_argument("--timeout", type=float, default=120.0, help="seconds before a lost rank fails the run")
    g.add_argument("--log-every", type=int, default=10, help="print the loss every K steps (rank 0)")
    g.add_argument("--measure-step", type=int, default=2, help="the step whose communication and memory are measured")
    g.add_argument("--peak-params", type=int, choices=[0, 1], default=1, help="sample parameter bytes after every op of the measured step (slow); 0 skips")
    g.add_argument("--report", metavar="PATH", default=None, help="write a JSON report (rank 0; its folder is made before the first step)")
    g.add_argument("--trace", metavar="DIR", default=None, help="profile the measured step: DIR/trace_rank{r}.json per rank, DIR/timeline.png")
    simulate.add_flags(g)  # --simulate-world N, --simulate-rank r (lessonkit/simulate.py)
    return p


def parse_args(argv=None, description=""):
    parser = build_parser(description)
    args, lesson = parser.parse_args(argv), description[7:9] if description.startswith("Lesson ") else ""  # "Lesson 07: ..."
    world = simulate.check(args, lesson, fail) or launched_world()  # --simulate-world N: N
    # a flag this lesson would ignore is refused (knobs pass); 00 trains nothing: it takes the GPT's shape, --seed, --link, run flags
    trains, a = "01 02 03 04 05 06 07 08 09", args
    untrained = [(f"--{k.replace('_', '-')}", trains, v != parser.get_default(k)) for k, v in vars(a).items() if k not in (
        "seed", "seq_len", "vocab_size", "n_layer", "d_model", "n_head", "link", "collectives", "device", "timeout",
        "report", "bucket_mb", "prefetch", "zero3", "layout", "chunk_mb", "shard_group", "reduce_every", "all_reduce_every")]
    for flag, owners, given in (("--layout", "07", a.layout != "even"), ("--chunk-mb", "07", a.chunk_mb != 0), ("--reduce-every",
                                "05 06 07 08", a.reduce_every != "micro"), ("--all-reduce-every", "08", a.all_reduce_every != "micro"),
                                ("--shard-group", "08", a.shard_group and not a.inter_link), ("--zero3", "09", a.zero3), *untrained):
        if lesson and given and lesson not in owners:
            fail(f"{flag} is for lesson{'s 01-09' if owners == trains else ('s ' if ' ' in owners else ' ') + owners} only: lesson {lesson} would ignore it")
    for name, least in [(n, 1) for n in ("steps", "global_batch", "grad_accum", "seq_len", "n_layer", "d_model", "n_head",
                                         "log_every")] + [("vocab_size", 2)] + [(n, 0) for n in ("weight_decay", "warmup_steps", "save_every", "chunk_mb", "seed")]:
        if not least <= getattr(args, name) < 2 ** 32:  # (--save-every 0: never; nan and inf fail too; seeds times 1,000,003 stay in 64 bits)
            fail(f"--{name.replace('_', '-')} must be {f'at least {least}' if least else '0 or positive'} and below 2^32, got {getattr(args, name)}")
    if lesson != "00" and args.global_batch % (world * args.grad_accum):  # (00's is not given: it trains nothing)
        fail(f"--global-batch {args.global_batch} must be divisible by world size {world} x --grad-accum {args.grad_accum}")
    if args.d_model % args.n_head:
        fail(f"--d-model {args.d_model} must be divisible by --n-head {args.n_head}")
    if not (0 < args.bucket_mb < float("inf") and all(0 <= x < float("inf") for x in (args.lr, args.grad_clip))
            and 1 <= args.timeout <= 86400):  # (--lr 0, as torch.optim allows: a step that moves no weight)
        fail("--bucket-mb must be positive, --lr and --grad-clip 0 or positive, --timeout 1 to 86400 seconds (finite numbers: not nan or inf)")
    if args.loss_scale is not None and args.precision != "fp16":
        fail(f"--loss-scale {args.loss_scale:g}: only fp16 scales its loss (use it with --precision fp16)")
    for flag in (f for f in ("report", "trace", "checkpoint_dir") if getattr(args, f) == ""):  # (once ignored: nothing written)
        fail(f"--{flag.replace('_', '-')} '': give a path")
    if bool(args.resume or args.save_every) != bool(args.checkpoint_dir):  # each needs the other
        fail(f"--checkpoint-dir {args.checkpoint_dir} alone saves and resumes nothing: add --save-every K (and --resume or "
             "--resume auto to continue from it)" if args.checkpoint_dir else "--resume and --save-every need --checkpoint-dir DIR")
    if args.save_every > args.steps:  # saved after every K-th step: none of --steps N would be
        fail(f"--save-every {args.save_every} is more than --steps {args.steps}: no checkpoint would be written")
    if args.report and os.path.isdir(args.report):
        fail(f"--report {args.report} is a directory: give the path of the JSON file to write")
    saves = args.checkpoint_dir if args.checkpoint_dir and (args.save_every or os.path.exists(args.checkpoint_dir)) else None
    report_dir = args.report and os.path.dirname(os.path.abspath(args.report))
    for flag, folder, named in (("--checkpoint-dir", saves, saves), ("--trace", args.trace, args.trace),
                                ("--report", report_dir, f"{args.report}: its directory {report_dir}")):
        try:  # made now where it will be written: one that cannot be fails here, not at a save or the run's end
            if folder:
                os.makedirs(folder, exist_ok=True)  # (a file there: FileExistsError)
        except OSError as e:
            fail(f"{flag} {named} " + ("is a file, not a directory" if isinstance(e, FileExistsError) else f"cannot be made: {e.strerror}"))
    args.measure_step = min(max(args.measure_step, 0), args.steps - 1)
    for flag, spec in ((f, s) for f, s in (("--link", args.link), ("--inter-link", args.inter_link)) if s is not None):
        if args.collectives == "torch":
            fail(f"{flag} simulates a link for the ring: use it with --collectives ring (or alone), not torch")
        try:
            ring_collectives.lesson_00().Link.parse(spec)
        except ValueError as e:
            fail(str(e).replace("--link", flag, 1))  # (Link.parse names --link)
    args.collectives = args.collectives or ("ring" if args.link or args.inter_link else "torch")
    node, g = args.ranks_per_node, args.shard_group
    if node is not None and g not in (None, node):
        fail(f"--ranks-per-node {node} and --shard-group {g} disagree: 08's node is its shard group (give one of the two)")
    if node is not None and args.inter_link is None:
        fail(f"--ranks-per-node {node} needs --inter-link: the ranks sit on nodes for a link between them")
    if args.inter_link and node is None and g is None:
        fail("--inter-link needs nodes: --ranks-per-node G (08: its --shard-group G is the node)")
    n = args.ranks_per_node = args.shard_group = g if node is None else node  # 08 shards inside a node
    if n is not None and (n < 1 or world % n):
        fail(f"--{'shard-group' if node is None else 'ranks-per-node'} {n} must be at least 1 and divide world size {world}")
    if args.layout == "uneven" and args.collectives == "ring":
        fail("--layout uneven broadcasts and reduces, which the ring does not carry: use --collectives torch")
    return args


# ----------------------------------------------------------------------------- processes
def choose_device(requested, ranks_here, gpus):
    """("cuda" or "cpu", why auto chose the CPU or None) for `--device requested`, `ranks_here` ranks on this node, `gpus`
    GPUs. NCCL wants a GPU per rank: `auto` takes CUDA only when every local rank has one; a `cuda` that cannot, ValueError."""
    if requested == "cpu":
        return "cpu", None
    if gpus >= max(ranks_here, 1):
        return "cuda", None
    if requested == "cuda":
        raise ValueError("--device cuda was asked for, but no CUDA GPU is available (use --device cpu)" if gpus == 0 else
                         f"--device cuda: {ranks_here} ranks on this node but only {gpus} GPUs; NCCL needs "
                         f"one GPU per rank (--nproc_per_node={gpus}, or --device cpu)")
    return "cpu", "no CUDA GPU here" if gpus == 0 else (f"{ranks_here} ranks on this node but only {gpus} GPU"
                                                        f"{'s' if gpus > 1 else ''}, and NCCL needs one per rank (--nproc_per_node={gpus} runs on the GPUs)")


@dataclass
class Dist:
    rank: int
    world_size: int
    device: torch.device
    backend: str
    simulated: bool = False  # --simulate-world: this process is the only one, whatever its rank
    master = property(lambda self: self.rank == 0 or self.simulated)


def init_distributed(args) -> Dist:
    """Join the process group: torchrun's environment if present, else a group of one; gloo on CPU, nccl on CUDA
    (cuda:LOCAL_RANK; choose_device), or in a group that exists (a test harness, sweep.py) its backend's device.
    The timeout makes a lost rank fail the others instead of hanging them. Sets args.device to what it chose."""
    if getattr(args, "simulate_world", None) and not dist.is_initialized():  # one process as rank r of N (simulate.py)
        return simulate.join(args, Dist)
    timeout, local_rank = timedelta(seconds=args.timeout), env_int("LOCAL_RANK", 0)
    ring = args.collectives == "ring"
    if dist.is_initialized():
        kind = "cuda" if dist.get_backend() == "nccl" else "cpu"
    else:
        try:
            ranks_here = env_int("LOCAL_WORLD_SIZE", 1)  # torchrun's; 1 for plain `python`
            kind, why = choose_device("cpu" if ring else args.device, ranks_here, torch.cuda.device_count())
        except ValueError as e:
            fail(str(e))
        for line in (why and f"device: cpu, as --device auto found {why}", restart_advice()):  # (advice: --max-restarts)
            if line and env_int("RANK", 0) == 0:
                say(line)
    if ring and "cuda" in (args.device, kind):  # (kind: a group made elsewhere on nccl)
        fail("--collectives ring sends over gloo on the CPU (--device cpu); on CUDA, NCCL's collectives are the wire")
    device, backend = (torch.device("cuda", local_rank), "nccl") if kind == "cuda" else (torch.device("cpu"), "gloo")
    if kind == "cuda":
        torch.cuda.set_device(device)  # before anything touches CUDA: else every rank makes a context on GPU 0
        if args.precision == "bf16" and torch.cuda.get_device_capability(device) < (8, 0):  # (not emulated)
            fail(f"--precision bf16: {torch.cuda.get_device_name(device)} has no bfloat16 support (use --precision fp16, or fp32)")
    if not dist.is_initialized() and "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group(backend, timeout=timeout, device_id=device if kind == "cuda" else None)
    elif not dist.is_initialized():  # plain `python 0N_x.py`: the same code path with a world of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    args.device = kind
    # torch's collectives or the ring's (scripts/perf/ring_collectives.py), set per run: sweep.py runs several in one group
    link, inter = (ring_collectives.lesson_00().Link.parse(spec) if spec else None for spec in (args.link, args.inter_link))
    ring_collectives.use(args.collectives, link, timeout, inter, args.ranks_per_node if args.inter_link else None)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if dist.get_world_size() > 1:
        start_heartbeat(dist.get_rank(), watch=backend == "nccl" or os.environ.get("DP_WATCHDOG") == "1",
                         after_s=min(WATCHDOG_S, args.timeout / 2))
    return Dist(dist.get_rank(), dist.get_world_size(), device, backend)


# ----------------------------------------------------------------------------- model and data
def model_config(args) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, n_layer=args.n_layer, d_model=args.d_model,
                     n_head=args.n_head, activation_checkpointing=getattr(args, "activation_checkpointing", "none"))


def working_dtype(args):
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision, torch.float32)


def build_model(args, env: Dist) -> GPT:
    """The GPT on this rank's device, in the working precision, identical on every rank. bf16, fp16 as FSDP2: initialised in
    fp32, kept on each parameter (`p.fp32_init`) until an optimizer makes its fp32 masters of them (optimizers.master_weights)."""
    model = GPT(model_config(args), seed=args.seed).to(env.device)
    pretrained.init_from(args.init_from, model)  # --init-from FILE: its weights, in fp32, before any rounding
    if working_dtype(args) != torch.float32:
        for p in model.parameters():
            p.fp32_init = p.detach().clone()
        model.to(working_dtype(args))
    return model


def n_params(module) -> int:  # Psi: unique parameters (the tied embedding/head counted once)
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
