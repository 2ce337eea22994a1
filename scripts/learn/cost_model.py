"""What each data-parallel stage costs at scale, on paper: compute, communication, overlap, memory.

One training step of a dense transformer on N GPUs, for DP, ZeRO-1, ZeRO-2, ZeRO-3 (with and
without prefetch) and HSDP (08: ZeRO-3 inside shard groups of G GPUs, an all-reduce across the
R = N / G replicas), scheduled as the lessons schedule it. Pure arithmetic; scripts/learn/at_scale.py
is the command line, calibrates it on this machine and checks it against published numbers.

    compute     FLOPs per token = 6 (Psi - lookup-only params) + 12 L d s, at efficiency x peak
    collective  alpha-beta ring, bus-bandwidth convention, two levels (NVLink inside a node, NIC across)
    overlap     a main thread beside a communication thread running collectives in issue order
                (simulate): buckets, units, gradients as 02, 03, 05, 06 issue them; on a CPU
                rank the ring's own work shares the compute's core, the link's time hides;
                HSDP's all-reduce across replicas on a second stream, once its reduce-scatter is done
    memory      theory.py's model states + Korthikanti et al. 2022's activations + working buffers
    offload     07: my shard up and my gradient shard down over PCIe beside the compute, the
                optimizer on the host's CPU; the device keeps only my shard in bf16
"""
from dataclasses import dataclass

from lessonkit.theory import RING_FACTOR, STATE_BYTES, theory_memory

# ----------------------------------------------------------------------------- inputs
OPS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class Model:
    name: str
    params: float        # Psi, unique parameters
    layers: int          # L transformer blocks
    hidden: int          # d (h in Korthikanti et al.)
    heads: int           # a
    vocab: int           # V
    lookup: float = 0    # parameters only looked up, never multiplied (an untied token embedding): no FLOPs
    root: float = 0      # parameters outside the blocks (embeddings, head, final norm): ZeRO-3's root unit


def llama(name, params, layers, hidden, heads, vocab=128_256):
    """Untied embedding and head (2 V d outside the blocks), the embedding only looked up."""
    return Model(name, params, layers, hidden, heads, vocab, lookup=vocab * hidden, root=2 * vocab * hidden + hidden)


def gpt(name, params, layers, hidden, heads, vocab, seq):
    """The lessons' GPT (model.py): tied embedding/head, learned positions (looked up only)."""
    return Model(name, params, layers, hidden, heads, vocab, lookup=seq * hidden,
                 root=(vocab + seq) * hidden + 2 * hidden)


# Llama 3.1 (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3; parameter counts from the
# released config.json: 8,030,261,248 / 70,553,706,496 / 405,853,388,800).
MODELS = {
    "llama3-8b": llama("Llama 3.1 8B", 8.030e9, 32, 4096, 32),
    "llama3-70b": llama("Llama 3.1 70B", 70.55e9, 80, 8192, 64),
    "llama3-405b": llama("Llama 3.1 405B", 405.85e9, 126, 16384, 128),
    # The ZeRO paper's running example (Table 1: Psi = 7.5B). The table needs Psi only; the shape
    # here (GPT-2 vocabulary, 12 L d^2 ~ 7.25B in the blocks) is ours, for the time estimates.
    "zero-7.5b": gpt("ZeRO paper 7.5B", 7.5e9, 64, 3072, 24, 50_257, 1024),
}


@dataclass(frozen=True)
class GPU:
    name: str
    flops: float         # peak dense BF16 tensor FLOP/s (no sparsity)
    memory: float        # bytes
    mem_bw: float        # bytes/s, what the optimizer step streams at


@dataclass(frozen=True)
class Link:
    """One level of the network, as NCCL sees it: achieved bus bandwidth per collective (bytes/s,
    per GPU) and the latency of one ring step (s). The lessons' ring on a CPU adds the transport's
    own work, measured per collective as [(tensor bytes, s), ...] (None on GPUs): `own` beside the
    link (Python, adds, copies, a wake-up), `copy` the loopback transfer, which a simulated link's
    time covers. That work takes the rank's core; the link's time does not."""
    busbw: dict
    latency: dict
    own: dict = None
    copy: dict = None


@dataclass(frozen=True)
class Host:
    """What 07 (offload) uses beside each GPU: PCIe, bytes/s each way, and the CPU's AdamW,
    parameters/s, that GPU's share of the host's cores; a copy costs pcie_latency + bytes / pcie
    (an alpha-beta link, as the collectives': the alpha, a copy's launch and DMA set-up, assumed)."""
    pcie: float
    adam: float
    pcie_latency: float = 10e-6


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int
    intra: Link
    inter: Link
    efficiency: float = 0.40  # achieved / peak FLOP/s of the model's compute (see EFFICIENCY)
    overlap: float = 1.0      # share of a collective that hides behind compute beside it (GPUs: 1)
    core_share: float = None  # a CPU rank: while its compute runs, the transport's work (the links'
    # cpu part) gets this share of a core; None: a core of its own (GPUs: the NIC, NVLink)
    host: Host = None         # for offload (07)


# Datasheets (dense BF16, no sparsity; memory; memory bandwidth): NVIDIA H100 Tensor Core GPU
# datasheet (SXM5: 989 TFLOPS, 80 GB HBM3, 3.35 TB/s); NVIDIA H200 datasheet (989 TFLOPS, 141 GB
# HBM3e, 4.8 TB/s); NVIDIA A100 datasheet (SXM 80GB: 312 TFLOPS, 2,039 GB/s).
GPUS = {"h100": GPU("H100 SXM5 80GB", 989e12, 80e9, 3.35e12),
        "h200": GPU("H200 SXM 141GB", 989e12, 141e9, 4.8e12),
        "a100": GPU("A100 SXM 80GB", 312e12, 80e9, 2.039e12)}
# Line rates per GPU, one direction: NVLink 4 (H100/H200) 900 GB/s bidirectional -> 450; NVLink 3
# (A100) 600 -> 300; InfiniBand NDR 400 Gb/s and HDR 200 Gb/s, one NIC per GPU (DGX H100 / A100:
# 8 per node) -> 50 and 25 GB/s.
LINE_RATE = {"nvlink4": 450e9, "nvlink3": 300e9, "ndr400": 50e9, "hdr200": 25e9}
# NCCL's bus bandwidth is ~80% of line rate: "450GB/s is the line rate. With the protocol overhead
# (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s" (S. Jeaugey, NCCL maintainer,
# NVIDIA/nccl-tests issue #212). NVLink SHARP all-reduce is faster (~480 GB/s); not modelled.
BUS_EFFICIENCY = 0.8
# Latency of one ring step, Simple protocol: NCCL's own tuning model (src/graph/tuning.cc, hwLat,
# Ring/Simple): 3.4 us over NVLink, 14 us over the network.
RING_STEP_LATENCY = {"nvlink4": 3.4e-6, "nvlink3": 3.4e-6, "ndr400": 14e-6, "hdr200": 14e-6}
# One fixed share of peak FLOP/s for every prediction, not fitted per row: Llama 3 reports 38-43%
# BF16 MFU on 8K-16K H100s (Dubey et al. 2024, Table 4), pipeline bubbles and tensor-parallel
# communication included; 0.40 is the round number in that range.
EFFICIENCY = 0.40


# Measured on one H100 with make gpu-check: 07 copied 113.5 MiB up in
# 2.3 ms over PCIe Gen5 x16, ~52 GB/s (64 GB/s line rate); its CPU AdamW (torch's foreach, 16
# cores) stepped 29.7M parameters in ~33 ms, ~0.9e9 parameters/s, taken here as one GPU's share
# of its host. A100: PCIe Gen4 x16, half the line rate; the same CPU. A copy's alpha, 10 us (Host's
# default), is not measured: a cudaMemcpyAsync's launch and set-up. Assumptions, not datasheets.
HOSTS = {"gen5": Host(pcie=52e9, adam=0.9e9), "gen4": Host(pcie=26e9, adam=0.9e9)}


def nccl_link(kind):
    return Link({op: BUS_EFFICIENCY * LINE_RATE[kind] for op in OPS}, {op: RING_STEP_LATENCY[kind] for op in OPS})


CLUSTERS = {"h100": Cluster(GPUS["h100"], 8, nccl_link("nvlink4"), nccl_link("ndr400"), EFFICIENCY, host=HOSTS["gen5"]),
            "h200": Cluster(GPUS["h200"], 8, nccl_link("nvlink4"), nccl_link("ndr400"), EFFICIENCY, host=HOSTS["gen5"]),
            "a100": Cluster(GPUS["a100"], 8, nccl_link("nvlink3"), nccl_link("hdr200"), EFFICIENCY, host=HOSTS["gen4"])}


@dataclass(frozen=True)
class Workload:
    model: Model
    batch: int                 # local batch: sequences per GPU per step
    seq: int
    ckpt: str = "none"         # activation checkpointing: none, selective, full
    precision: str = "bf16"    # bf16: ZeRO's mixed precision (2 + 2 + 12 bytes); fp32: the lessons' default
    reduce_bytes: int = 0      # bytes per gradient element on the wire; 0: as the parameters (2 or 4)
    bucket_mb: float = 25.0    # the lessons' and DDP's bucket cap (MiB)
    first_bucket_mb: float = 0  # a smaller first bucket (03, 05 and DDP: 1 MiB); 0: as the others
    bucket_bytes: tuple = ()   # the buckets as bucket.py cuts them, in launch order (empty: by size alone)
    tensors: int = 0           # lessons 01 and 02 all-reduce each gradient tensor: how many there are
    tensor_bytes: tuple = ()   # and their sizes, in the order backward makes them (empty: all equal)


# How each stage communicates. zero: which states are sharded (theory.py's stage); reduce: the
# gradient collective; overlap: launched bucket by bucket during backward (03, 05, 06) or after
# backward (01, 04); gather: "step" = all-gather the updated parameters after the optimizer step
# (ZeRO-1/2), "units" = all-gather each unit before its forward and again before its backward (06).
@dataclass(frozen=True)
class Stage:
    zero: int
    reduce: str
    overlap: bool = True
    gather: str = ""
    prefetch: bool = False
    per_tensor: bool = False   # one collective per gradient tensor (01, 02), else per bucket / unit
    in_flight: int = 0         # at most this many reduces in flight: the next waits for the oldest (0: any)
    norm_all_reduce: bool = False  # clipping sharded gradients: one scalar all-reduce after backward
    offload: bool = False      # 07: ZeRO-3 with the optimizer on the host (cluster.host)
    shard_group: int = 0       # 08 (HSDP): ZeRO-3 inside groups of this many GPUs, replicated across them (0: all N)


STAGES = {"dp": Stage(0, "all_reduce"),
          "zero1": Stage(1, "reduce_scatter", gather="step"),   # DeepSpeed stage 1, overlap_comm
          "zero2": Stage(2, "reduce_scatter", gather="step"),
          "zero3": Stage(3, "reduce_scatter", gather="units", prefetch=True),
          "zero3-noprefetch": Stage(3, "reduce_scatter", gather="units", prefetch=False),
          "zero3-offload": Stage(3, "reduce_scatter", gather="units", prefetch=True, offload=True),
          # FSDP2 over a 2-D mesh: a shard group is one node of the presets (8 GPUs); replace() sets another G
          "hsdp": Stage(3, "reduce_scatter", gather="units", prefetch=True, shard_group=8)}
# the lessons themselves, for the calibrations on this machine: 01 all-reduces every gradient after
# backward, 02 each one from its hook (async), 03 by bucket; 04-06 clip over shards (a scalar
# all-reduce); 05 keeps two reduce-scatters in flight, 06 one (it waits for the last unit's first)
LESSONS = {"01_vanilla_dp": Stage(0, "all_reduce", overlap=False, per_tensor=True),
           "02_async_allreduce": Stage(0, "all_reduce", per_tensor=True),
           "03_buckets": STAGES["dp"],
           "04_zero1": Stage(1, "reduce_scatter", overlap=False, gather="step", norm_all_reduce=True),
           "05_zero2": Stage(2, "reduce_scatter", gather="step", in_flight=2, norm_all_reduce=True),
           "06_zero3": Stage(3, "reduce_scatter", gather="units", prefetch=True, in_flight=1, norm_all_reduce=True),
           "06_zero3 --prefetch 0": Stage(3, "reduce_scatter", gather="units", in_flight=1, norm_all_reduce=True),
           "08_hybrid --shard-group 2": Stage(3, "reduce_scatter", gather="units", prefetch=True, in_flight=1,
                                              norm_all_reduce=True, shard_group=2)}
STRATEGY = {0: "vanilla_dp", 1: "zero1", 2: "zero2", 3: "zero3"}  # theory.theory_memory's names


def shard_size(stage, world):
    """G: the GPUs a unit is sharded over (08's shard group; all N but for HSDP, at most N)."""
    return min(stage.shard_group or world, world)


def groups(stage, world, cluster):
    """08's grid on the cluster, {"intra": (ranks, ranks per node), "inter": (...)}: the shard
    group, G consecutive ranks, and the replicate group, every G-th rank (R = N / G), each with
    how many of its ranks share a node (torchrun numbers a node's GPUs consecutively). The keys
    are 08's report's: a shard group of more than a node also crosses the NICs. Not HSDP: N, R = 1."""
    g, shard = min(world, cluster.gpus_per_node), shard_size(stage, world)
    if world % shard or (shard % g and g % shard):
        raise ValueError(f"a shard group of {shard} GPUs does not tile {world} GPUs, {g} per node")
    return {"intra": (shard, min(shard, g)), "inter": (world // shard, max(1, g // shard))}


# ----------------------------------------------------------------------------- compute
def flops_per_token(m, seq):
    """Training FLOPs per token, forward + backward, no recomputation (PaLM, Chowdhery et al. 2022,
    appendix B; torchtitan's MFU): a multiplied weight costs 2 FLOPs per token forward and 4
    backward -> 6 (Psi - lookup). Attention scores: Q K^T and softmax(.) V each take 2 s d FLOPs per
    token per layer forward, 4 s d; backward twice that -> 12 L d s (causal masking not halved)."""
    return 6 * (m.params - m.lookup) + 12 * m.layers * m.hidden * seq


def recompute_flops_per_token(m, seq, ckpt):
    """Selective (Korthikanti et al. 2022): the attention core's forward again, 4 L d s. Full:
    the whole forward again, 2 (Psi - lookup) + 4 L d s."""
    core = 4 * m.layers * m.hidden * seq
    return {"none": 0, "selective": core, "full": 2 * (m.params - m.lookup) + core}[ckpt]


# ----------------------------------------------------------------------------- communication
def ring_parts(op, size, n, link):
    """One ring over n ranks of a tensor of `size` bytes, as (own, copy, wire) seconds. wire: n - 1
    steps (2 (n - 1) for all-reduce), each costing the link's latency, plus RING_FACTOR x size
    bytes at the bus bandwidth. own and copy, where the link carries them (a CPU ring): the
    transport's work beside the link, and the loopback copy, which runs during the link's time."""
    if n <= 1 or size <= 0:
        return 0.0, 0.0, 0.0
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    wire = steps * link.latency[op] + RING_FACTOR[op](n) * size / link.busbw[op]
    own, copy = (interpolate((table or {}).get(op), size) for table in (link.own, link.copy))
    return own, copy, wire


def ring_time(op, size, n, link):
    own, copy, wire = ring_parts(op, size, n, link)
    return own + max(copy, wire)


def interpolate(points, x):
    """Piecewise linear through measured [(x, y), ...] (sorted by x): the first y below them,
    the last segment's line beyond them; 0 without points."""
    if not points:
        return 0.0
    if x <= points[0][0] or len(points) == 1:
        return points[0][1]
    (x0, y0), (x1, y1) = next((a, b) for a, b in zip(points, points[1:]) if x <= b[0]) if x <= points[-1][0] \
        else points[-2:]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def collective_parts(op, size, world, cluster, per_node=0):
    """Two levels, for world = g GPUs per node x m nodes (g = per_node, or as many as a node holds,
    for a group with fewer ranks per node: 08's replicate group): the op inside each node over the full
    tensor at NVLink speed, then across the m nodes on 1/g of it, the g rails in parallel at NIC
    speed (reduce-scatter: intra then inter; all-gather: inter then intra; all-reduce: both):
        t = ring(op, S, g, intra) + ring(op, S / g, m, inter)
    NCCL picks rings, trees or NVLS by size and scale; the bytes at the bottleneck are these.
    As ring_parts' (own, copy, wire), the two levels one after the other."""
    g = per_node or min(world, cluster.gpus_per_node)
    intra, inter = ring_parts(op, size, g, cluster.intra), ring_parts(op, size / g, world // g, cluster.inter)
    if not any(inter):
        return intra
    if not any(intra):
        return inter
    return 0.0, 0.0, ring_time(op, size, g, cluster.intra) + ring_time(op, size / g, world // g, cluster.inter)


def collective_time(op, size, world, cluster):
    own, copy, wire = collective_parts(op, size, world, cluster)
    return own + max(copy, wire)


# ----------------------------------------------------------------------------- gradient accumulation
def simulated_link(gbps, latency_us):
    """A Link as the lessons' --link and --inter-link simulate one: each send costs latency + bytes / bandwidth."""
    ops = tuple(RING_FACTOR)
    return Link({op: gbps * 1e9 / 8 for op in ops}, {op: latency_us * 1e-6 for op in ops})


def accumulation_choice(psi, world, shard, micro, precision, free_bytes, inter, units=1):
    """05-08's --reduce-every and 08's --all-reduce-every for K = `micro` micro-steps, G = `shard`.
    All-reduce across replicas once: the K - 1 all-reduces of my gradient shard (Psi / G elements)
    it skips cost no memory (my group's fp32 sum takes the place of the fp32 .grad it becomes), so
    always, where there are replicas; `saved_s`: those all-reduces' time on the `inter` link.
    Reduce-scatter once: (K - 1) Psi (G - 1) / G elements fewer, for the whole gradient held in fp32
    between micro-steps (4 Psi in place of 4 Psi / G): only where that fits in `free_bytes`.
    `units`: the all-reduces a micro-step issues (one per unit, of about equal size)."""
    replicas, b = world // shard, STATE_BYTES[precision]["grads"]
    each = ring_time("all_reduce", b * psi / shard / units, replicas, inter)
    saved = (micro - 1) * units * each if replicas > 1 else 0.0
    extra = 4 * psi - 4 * psi / shard
    return {"all_reduce_every": "step" if micro > 1 and replicas > 1 else "micro", "saved_s": saved,
            "reduce_every": "step" if micro > 1 and extra <= free_bytes else "micro", "extra_held_bytes": extra}


# ----------------------------------------------------------------------------- memory
def activation_bytes(w):
    """Per GPU. Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models", section 4: per layer 34 s b h + 5 a s^2 b bytes (16-bit, no recomputation); selective
    recomputation drops the 5 a s^2 b of attention scores (so does FlashAttention); full keeps each
    layer's input (2 s b h) plus one layer's activations while it is recomputed. Plus fp32 logits
    for the loss, 4 s b V. (GPT blocks; Llama's SwiGLU MLP holds ~15% more.) fp32: twice."""
    m, s, b, h, a = w.model, w.seq, w.batch, w.model.hidden, w.model.heads
    full_layer = 34 * s * b * h + 5 * a * s * s * b
    per_model = {"none": m.layers * full_layer, "selective": m.layers * 34 * s * b * h,
                 "full": m.layers * 2 * s * b * h + full_layer}[w.ckpt]
    return per_model * (2 if w.precision == "fp32" else 1) + 4 * s * b * m.vocab


def _elem(w):
    return 4 if w.precision == "fp32" else 2


def _units(m):
    """ZeRO-3's units (06, FSDP2): the root (embeddings, head) and one per block."""
    return [m.root] + [(m.params - m.root) / m.layers] * m.layers


def memory(w, stage, world):
    """Bytes per GPU: model states (theory.py), activations, working buffers (two buckets in
    flight; ZeRO-3: the units gathered at once, current + prefetched, and one unit's gradient).
    HSDP: ZeRO-3's over its shard group, (4 + 4 + 8) Psi / G (theory.py's "hybrid")."""
    psi, elem, grad = w.model.params, _elem(w), w.reduce_bytes or _elem(w)
    strategy = "hybrid" if stage.shard_group else STRATEGY[stage.zero]
    states = theory_memory(strategy, psi, shard_size(stage, world), w.precision)["total"]
    if stage.offload:  # 07: the device keeps my shard in the working precision; the host the rest
        states = elem * psi / world
    if stage.gather == "units":
        biggest = max(_units(w.model))
        buffers = (2 if stage.prefetch else 1) * biggest * elem + biggest * grad
    else:
        buffers = min(2 * w.bucket_mb * 2 ** 20, psi * grad)
    out = {"states": states, "activations": activation_bytes(w), "buffers": buffers}
    out["total"] = sum(out.values())
    if stage.offload:  # in host memory: fp32 masters, their gradients, two moments
        out["host"] = 16 * psi / world
    return out


def offload_copies(w, world, host, fwd, bwd, share):
    """07's copies over PCIe, in seconds: (up, down, exposed). Up: every unit's fp32 master shard
    (cast on the device, as FSDP2's offload), queued at forward's start in unit order, a unit's
    forward waiting for its own; down: each block's gradient shard once its backward is over, the
    root's (the embedding) last, after backward. H2D and D2H are separate engines; the copies run
    beside the compute, not on its time."""
    sizes = [u / world for u in _units(w.model)]
    up = [host.pcie_latency + n * 4 / host.pcie for n in sizes]  # fp32 crosses: cast on the device
    down = [host.pcie_latency + n * (w.reduce_bytes or _elem(w)) / host.pcie for n in sizes]
    copied = done = 0.0
    for i, s in enumerate(up):  # forward, unit by unit
        copied += s
        done = max(done, copied) + fwd * share[i]
    exposed = done - fwd
    done = copied = 0.0
    for i in [0] + list(range(len(sizes) - 1, 0, -1)):  # backward: the head first, the root's reduce last
        done += bwd * share[i]
        if i:
            copied = max(copied, done) + down[i]
    exposed += max(copied, done) + down[0] - done
    return sum(up), sum(down), exposed


# ----------------------------------------------------------------------------- one step
def simulate(program, share=None):
    """Run one rank's main thread beside its communication streams, each running collectives one
    after another in issue order (NCCL's streams; the lessons' ring thread). program: ("compute",
    s), ("issue", key, own, copy, wire[, stream[, after]]) or ("wait", key); a collective with
    `after` starts once that one is done (a stream waiting on another's event; stream 0 unless
    named). A collective works `own` seconds, then `copy` seconds while it waits `wire` on the
    link. share: while the compute runs, a collective's work (own, copy) runs at this rate; the
    compute keeps its pace (None: no sharing). Returns (end, seconds the main thread was blocked)."""
    t = blocked = 0.0
    i, left, waiting = 0, None, None    # main: next op, compute left, key it is blocked on
    queues, cur, done, after = {}, {}, {}, {}  # per stream: issued, not started; [key, own, copy, wire] running
    while True:
        while left is None and waiting is None and i < len(program):
            op, *a = program[i]
            i += 1
            if op == "compute" and a[0] > 0:
                left = a[0]
            elif op == "issue":
                queues.setdefault(a[4] if len(a) > 4 else 0, []).append(list(a[:4]))
                after[a[0]] = a[5] if len(a) > 5 else None
            elif op == "wait" and a[0] not in done:
                waiting = a[0]
        for s, queue in queues.items():
            if cur.get(s) is None and queue and (after[queue[0][0]] is None or after[queue[0][0]] in done):
                cur[s] = queue.pop(0)
        free = [s for s, c in cur.items() if c is not None and max(c[1:]) <= 0]
        for s in free:  # done (or free: a world of one)
            done[cur[s][0]] = t
            waiting, cur[s] = None if waiting == cur[s][0] else waiting, None
        if free:
            continue
        running = [c for c in cur.values() if c is not None]
        if not running and left is None:
            return t, blocked
        rate = share if share is not None and left is not None else 1.0  # of the collective's work
        ends = [c[1] / rate if c[1] > 0 else min(x for x in (c[2] / rate, c[3]) if x > 0) for c in running]
        dt = min([*ends, *([left] if left is not None else [])])
        t += dt
        blocked += dt if waiting is not None else 0.0
        if left is not None:
            left = None if dt == left else left - dt
        for c, e in zip(running, ends):
            if c[1] > 0:
                c[1] = 0.0 if dt == e else c[1] - dt * rate
            else:
                c[2] = 0.0 if dt * rate >= c[2] else c[2] - dt * rate
                c[3] = 0.0 if dt >= c[3] else c[3] - dt


ADAM_BYTES = {"bf16": 30, "fp32": 28}  # AdamW per parameter it updates: reads weight, grad, 2
# moments (16), writes weight and 2 moments (12), and in bf16 the bf16 working copy (2)


def step(w, stage, world, cluster):
    """Predict one optimizer step on `world` GPUs: compute, each collective, what hides, memory."""
    m, elem, shard, grid = w.model, _elem(w), shard_size(stage, world), groups(stage, world, cluster)
    grad = w.reduce_bytes or elem
    tokens = w.batch * w.seq
    rate = cluster.gpu.flops * cluster.efficiency
    model_flops = flops_per_token(m, w.seq) * tokens
    fwd = model_flops / 3 / rate
    bwd = (2 * model_flops / 3 + recompute_flops_per_token(m, w.seq, w.ckpt) * tokens) / rate
    params = _units(m)  # in forward order; a unit's compute is its share of the FLOPs
    head = 6 * (m.root - m.lookup) / flops_per_token(m, w.seq)  # the root's compute: the head's matmul
    share = [head] + [(1 - head) / m.layers] * m.layers
    opt = ADAM_BYTES[w.precision] * (m.params / shard if stage.zero else m.params) / cluster.gpu.mem_bw
    if stage.offload:  # 07: AdamW on the host's CPU, my shard's parameters
        opt = m.params / world / cluster.host.adam
    comm = {op: {"calls": 0, "bytes": 0.0, "s": 0.0} for op in OPS}
    times = {}  # (op, size, group) -> (own, copy, wire) s: a big model's DP step has thousands of equal buckets
    program, pending, replicas = [], [], []  # the main thread's; reduces not yet waited for (key, bytes); 08's 5b)
    per_link = {"intra": 0.0, "inter": 0.0}  # bytes each rank sends per step in each group (08's per_link)
    wires = {"nvlink": 0.0, "nic": 0.0}  # and on each level of the network (collective_parts' two rings)
    # HSDP's all-reduce runs on a stream of its own (FSDP2's; 08's replicate group, its own gloo
    # thread), beside the shard group's collectives where the two use different links: a shard
    # group of one node (NVLink), a replicate group of one GPU per node (the NICs); else one queue
    beside = 1 if shard == cluster.gpus_per_node else 0

    def compute(s):
        program.append(("compute", s))

    def issue(op, size, group="intra", after=None):
        n, per_node = grid[group]
        if (op, size, group) not in times:
            times[op, size, group] = collective_parts(op, size, n, cluster, per_node) if n > 1 else (0.0, 0.0, 0.0)
        own, copy, wire = times[op, size, group]
        c = comm[op]
        c["calls"], c["bytes"], c["s"] = c["calls"] + 1, c["bytes"] + size, c["s"] + own + max(copy, wire)
        per_link[group] += RING_FACTOR[op](n) * size
        wires["nvlink"] += RING_FACTOR[op](per_node) * size
        wires["nic"] += RING_FACTOR[op](n // per_node) * size / per_node
        program.append(("issue", len(program), own, copy, wire, beside if group == "inter" else 0, after))
        return program[-1][1]

    def wait(key):
        program.append(("wait", key))

    def reduce(size):  # with a cap on the reduces in flight, first wait for the oldest
        while stage.in_flight and len(pending) >= stage.in_flight:
            settle(*pending.pop(0))
        pending.append((issue(stage.reduce, size), size))
        if grid["inter"][0] > 1 and not stage.in_flight:  # FSDP2: once the reduce-scatter is done
            replicas.append(issue("all_reduce", size / shard, "inter", after=pending[-1][0]))

    def settle(key, size):  # 08: wait for a reduce-scatter, then all-reduce my shard across replicas
        wait(key)
        if grid["inter"][0] > 1 and stage.in_flight:
            replicas.append(issue("all_reduce", size / shard, "inter"))

    # forward: ZeRO-3 gathers each unit first (issued one unit early with prefetch)
    if stage.gather == "units":
        gathers = {0: issue("all_gather", params[0] * elem)}
        for i in range(len(params)):
            if i not in gathers:
                gathers[i] = issue("all_gather", params[i] * elem)
            wait(gathers[i])
            if stage.prefetch and i + 1 < len(params):
                gathers[i + 1] = issue("all_gather", params[i + 1] * elem)
            compute(fwd * share[i])
    else:
        compute(fwd)
    # backward: ZeRO-3 gathers every unit again, as 06 does (the root first: the head's backward),
    # then the blocks last to first, and reduce-scatters each unit's gradient after its backward
    # (the root's last: the embedding's gradient is complete at the very end); 01-05 reduce
    # buckets as backward fills them (03, 05), each gradient as it is ready (02), or everything
    # once backward is over (01, 04)
    if stage.gather == "units":
        order, gathers = [0] + list(range(m.layers, 0, -1)), {}
        for k, i in enumerate(order):
            if i not in gathers:  # no prefetch (or the root, first): gathered when needed
                gathers[i] = issue("all_gather", params[i] * elem)
            wait(gathers[i])
            if stage.prefetch and k + 1 < len(order):
                gathers[order[k + 1]] = issue("all_gather", params[order[k + 1]] * elem)
            compute(bwd * share[i])
            if i:
                reduce(params[i] * grad)
        reduce(params[0] * grad)
    else:
        total = m.params * grad
        if stage.per_tensor:
            sizes = list(w.tensor_bytes) or [total / w.tensors] * w.tensors
        elif stage.overlap and w.bucket_bytes:
            sizes = list(w.bucket_bytes)
        elif stage.overlap:
            first = min(total, (w.first_bucket_mb or w.bucket_mb) * 2 ** 20)
            cap = w.bucket_mb * 2 ** 20
            sizes = [first] + [cap] * int((total - first) // cap) + [(total - first) % cap]
        else:
            sizes = [total]
        if not stage.overlap:
            compute(bwd)
        whole = sum(sizes)  # once: a big model's DP step has thousands of buckets
        for size in [s for s in sizes if s > 0]:
            if stage.overlap:  # a bucket is full when backward has produced its bytes (uniformly)
                compute(bwd * size / whole)
            reduce(size)
    for key, size in pending:  # backward ends waiting for every reduce (HSDP: and all-reduce)
        settle(key, size)
    for key in replicas:
        wait(key)
    # clipping sharded gradients takes one scalar all-reduce for the global norm; the optimizer
    # on what this GPU updates; then ZeRO-1/2 gather the updated parameters
    if stage.norm_all_reduce:
        wait(issue("all_reduce", 4))
    compute(opt)
    if stage.gather == "step":
        wait(issue("all_gather", m.params * elem))
    end, blocked = simulate(program, cluster.core_share)
    comm_s = sum(c["s"] for c in comm.values())
    # the simulation runs a collective at full speed beside compute; where it does not
    # (cluster.overlap < 1: a CPU with no core to spare), only that share of the hiding happens
    exposed = cluster.overlap * blocked + (1 - cluster.overlap) * comm_s
    compute_s = fwd + bwd
    step_s = end - blocked + exposed  # compute, optimizer, exposed
    up = down = copies_exposed = 0.0
    if stage.offload:
        up, down, copies_exposed = offload_copies(w, world, cluster.host, fwd, bwd, share)
        step_s += copies_exposed
    return {"stage": stage, "world": world, "compute_s": compute_s, "forward_s": fwd, "backward_s": bwd,
            "optimizer_s": opt, "comm": comm, "comm_s": comm_s, "exposed_s": exposed,
            "hidden_s": max(0.0, comm_s - exposed), "step_s": step_s,
            "tokens_per_s": tokens / step_s,  # per GPU
            "mfu": model_flops / step_s / cluster.gpu.flops,
            "memory": memory(w, stage, world), "per_link": per_link, "wires": wires,
            "copies": {"up_s": up, "down_s": down, "exposed_s": copies_exposed}}  # 07's; zero otherwise
