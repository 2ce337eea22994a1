"""The ZeRO paper's formulas the runs are held to: what each stage holds per rank, sends per step.

Used by the report (measure.py prints each measurement beside its formula), the notebooks and the
tests; the Tables 1 and 2 calculator (any K) is scripts/learn/zero_calc.py. Rajbhandari et al.
2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models": section 3.1 (bytes
per parameter), Figure 1 and Table 1 (model states per device), section 7 (communication volume).
"""


# ----------------------------------------------------------------------------- per stage
# bytes per parameter of each model state (ZeRO paper, section 3.1): fp32 training keeps fp32
# parameters, gradients and two Adam moments; mixed precision (bf16 or fp16, the paper's) keeps
# 2-byte parameters and gradients plus K = 12 bytes of fp32 optimizer state (master weights and
# two moments). MIXED: the precisions that mean that, wherever a lesson asks.
MIXED = ("bf16", "fp16")
STATE_BYTES = {"fp32": {"params": 4, "grads": 4, "optimizer": 8},
               **{precision: {"params": 2, "grads": 2, "optimizer": 12} for precision in MIXED}}
# which states each stage divides by N
SHARDED = {"vanilla_dp": (), "async_allreduce": (), "buckets": (),
           "zero1": ("optimizer",), "zero2": ("optimizer", "grads"), "muon": ("optimizer",),  # 09: by owner
           "zero3": ("optimizer", "grads", "params"), "offload": ("optimizer", "grads", "params"),
           "hybrid": ("optimizer", "grads", "params"),  # 08: over its shard group (world = G there)
           # PyTorch's counterparts, run by scripts/torch_reference.py for the benchmark
           "torch_ddp": (), "torch_zero_redundancy": ("optimizer",),
           "torch_fsdp2_noreshard": ("optimizer", "grads"),
           "torch_fsdp2": ("optimizer", "grads", "params"),
           "torch_fsdp2_offload": ("optimizer", "grads", "params"), "torch_local": (),
           "torch_fsdp2_hsdp": ("optimizer", "grads", "params")}
# sharded over a shard group of G ranks and replicated across R = N / G of them: 08 and FSDP2's HSDP
HYBRID = ("hybrid", "torch_fsdp2_hsdp")
# the lessons that keep whole gradients and add bf16 (fp16) micro-steps into a whole fp32 accumulator
# (05-08 add into their fp32 gradient shards instead; 05 under no_sync() does this too: theory_memory)
ACCUMULATE_FP32 = ("vanilla_dp", "async_allreduce", "buckets", "zero1")


def theory_memory(strategy, psi, world, precision, in_flight=0, grad_accum=1, reduce_every="micro"):
    """Bytes per rank for each model state, ZeRO paper Figure 1 / Table 1; `peak_grads`, the
    most gradient bytes alive during backward: `in_flight` bytes (buckets_in_flight) on top of the
    gradients at rest; and `held_grads`, between micro-steps (--grad-accum K > 1): what 05-08's
    --reduce-every trades for bytes sent (theory_ring_bytes)."""
    once = reduce_every == "step" and strategy in ("zero2", "zero3", "offload", "hybrid")  # no_sync's whole gradient
    tiers = theory_tiers(psi, world, precision)  # (07's: its device keeps the working precision)
    if "params" in SHARDED[strategy]:  # 06, 07 and FSDP2 (offloaded or not): FSDP2's convention, bf16
        precision = "fp32"  # only in flight; at rest fp32 shards (the master weights), fp32 gradient shards, 2 moments
    out = {k: psi * b / world if k in SHARDED[strategy] else psi * b for k, b in STATE_BYTES[precision].items()}
    if strategy == "offload":  # 07: both tiers
        out = {k: tiers["device"][k] + tiers["host"][k] for k in out}
    fp32_sum = precision in MIXED and grad_accum > 1 and (strategy in ACCUMULATE_FP32 or once and strategy == "zero2")
    if fp32_sum:  # ddp.FP32Accumulation (05 under no_sync too)
        out["grads"] += 4 * psi  # the fp32 sum of the micro-steps, beside the bf16 gradient it rounds into
    out["peak_params"] = out["params"]  # ZeRO-3 adds the gathered units in flight
    # 01-04 and 03's buckets: the whole gradient. ZeRO-2: my slices of the buckets (kept, or
    # arriving from a reduce-scatter) plus the full-size buckets in flight; with micro-steps, also
    # the fp32 slices kept from the earlier ones (05's docstring). ZeRO-3: no formula here (its
    # units' gradients in flight), a measurement.
    whole = STATE_BYTES[precision]["grads"] * psi + 4 * psi * fp32_sum  # p.grad (05: and its fp32 sum)
    out["peak_grads"] = None if "params" in SHARDED[strategy] else out["grads"] + in_flight + (
        4 * psi / world if grad_accum > 1 and "grads" in SHARDED[strategy] and not once else whole if once else 0)
    if precision in MIXED and grad_accum > 1 and strategy == "zero2" and not once:  # at rest, between micro-steps:
        out["grads"] = 4 * psi / world  # my slices in fp32 (05's docstring), counted in peak_grads above
    # between micro-steps: the whole gradient (01-04; 05 under no_sync; 06-08's fp32 sum), else fp32 shards
    out["held_grads"] = None if grad_accum == 1 else (
        out["grads"] if "grads" not in SHARDED[strategy] else (whole if strategy == "zero2" else 4 * psi) if once
        else 4 * psi / world)
    # of the optimizer state, the fp32 master weights: 4 of the K = 12 bytes in bf16; in fp32 the
    # optimizer updates the parameters themselves
    master = 4 * psi if precision in MIXED else 0
    out["master_weights"] = master / world if "optimizer" in SHARDED[strategy] else master
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def theory_tiers(psi, world, precision):
    """ZeRO-Offload's model states per rank (07), by tier: the device keeps my parameter shard in
    the working precision; the host my fp32 master shard (the parameters the optimizer steps, as
    06's shards are), its fp32 gradient and Adam's two moments: 12 Psi / N of master and moments."""
    return {"device": {"params": STATE_BYTES[precision]["params"] * psi / world, "grads": 0, "optimizer": 0},
            "host": {"params": 4 * psi / world, "grads": 4 * psi / world, "optimizer": 8 * psi / world}}


def buckets_in_flight(bucket_bytes, max_in_flight, largest_grad):
    """The full-size gradient bytes a bucketed ZeRO-2 (05, bucket.BucketManager with buffers
    allocated at a bucket's first gradient and freed once its reduce-scatter is done) can hold
    during backward besides its slices: `max_in_flight` consecutive buckets in flight (None: all
    until the end of backward), the one filling and the next, which a gradient arriving ahead of
    bucket order starts; and one p.grad between autograd and its hook (`largest_grad`, bytes).
    `bucket_bytes`: each bucket's padded bytes, in bucket order."""
    window = len(bucket_bytes) if max_in_flight is None else max_in_flight + 2
    return max(sum(bucket_bytes[i:i + window]) for i in range(len(bucket_bytes))) + largest_grad


# ring factor: bytes one rank sends, per byte of the full-size tensor
RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n,
               "all_gather": lambda n: (n - 1) / n,
               "broadcast": lambda n: (n - 1) / n,  # a pipelined chain: each rank but the last
               "reduce": lambda n: (n - 1) / n}     # sends the whole tensor once (the root none)


def theory_ring_bytes(strategy, psi, world, precision, grad_accum=1, shard=None, reduce_every="micro",
                      all_reduce_every="micro"):
    """ZeRO paper section 7: 2 Psi elements per rank per step for DP, ZeRO-1 and ZeRO-2 (an
    all-reduce, or a reduce-scatter plus an all-gather), 3 Psi for ZeRO-3; times (N-1)/N.
    With K micro-steps, ZeRO-2 reduce-scatters at each ((K + 1) Psi) and ZeRO-3 gathers and
    reduce-scatters at each (3 K Psi), unless --reduce-every step (no_sync) reduce-scatters once:
    2 Psi and (2 K + 1) Psi. 08 (hybrid, `shard` = G ranks per group): theory_links, added."""
    k = grad_accum
    if strategy in HYBRID:
        return sum(theory_links(psi, shard, world, precision, k, reduce_every, all_reduce_every).values())
    rs = 1 if reduce_every == "step" else k  # reduce-scatters a step
    elems = {"zero2": (rs + 1) * psi, "zero3": (2 * k + rs) * psi, "offload": (2 * k + rs) * psi,
             "torch_fsdp2": 3 * k * psi, "torch_fsdp2_offload": 3 * k * psi, "torch_fsdp2_noreshard": (k + 1) * psi,
             "torch_local": 0}.get(strategy, 2 * psi)
    return elems * (world - 1) / world * STATE_BYTES[precision]["params"]


def theory_links(psi, shard, world, precision, grad_accum=1, reduce_every="micro", all_reduce_every="micro"):
    """08's two links, bytes per rank per step, G = `shard` ranks per shard group, R = N / G
    replicas: intra, ZeRO-3 inside the group, (2 K + K') Psi (G-1)/G with K' reduce-scatters (K, or
    1 with --reduce-every step); inter, a ring all-reduce of my gradient shard across the replicas
    K'' times, 2 K'' (Psi/G) (R-1)/R (K, or 1 with either flag at step)."""
    g, r, b, k = shard, world // shard, STATE_BYTES[precision]["params"], grad_accum
    rs = 1 if reduce_every == "step" else k
    ar = 1 if "step" in (reduce_every, all_reduce_every) else k
    return {"intra": (2 * k + rs) * psi * (g - 1) / g * b, "inter": 2 * ar * psi / g * (r - 1) / r * b}


# ----------------------------------------------------------------------------- 09: whole parameters per owner
def owners_theory(args, report, gathered, owner, muon, flops, held, master_bytes, ring, padding, **extra):
    """09's formulas, into rank 0's report (measure.Run's theory=): each rank owns whole parameters,
    `owner[p]` (p trainable), its own share. Per rank the elements owned, the optimizer state (Muon's momentum 4
    bytes, AdamW's two moments 8 and a step count of 4 per tensor, `master_bytes` of fp32 master)
    and the Newton-Schulz FLOPs (`flops(shape)` of each matrix in `muon`) beside what was measured;
    `held[r]`, rank r's {params, grads} bytes; `ring`, the bytes a rank sends per step."""
    out = []
    for r, measured in enumerate(gathered):
        owned = [p for p in owner if owner[p] == r]
        adam = [p for p in owned if p not in muon]
        n_all, n_adam = sum(p.numel() for p in owned), sum(p.numel() for p in adam)
        out.append({**held[r], "owned": n_all, "measured_optimizer": measured["memory"]["optimizer"],
                    "optimizer": 4 * (n_all - n_adam) + 8 * n_adam + 4 * len(adam) + master_bytes * n_all,
                    "flops": sum(flops(p.shape) for p in owned if p in muon),
                    "measured_flops": measured["optimizer_flops"]})
    mine = out[report["rank"]]  # (the report's rank: 0, or --simulate-rank r)
    report["memory"]["theory"].update({k: mine[k] for k in ("params", "grads", "optimizer")},
                                      held_grads=mine["grads"] if args.grad_accum > 1 else None, peak_grads=mine.get("peak_grads"),
                                      master_weights=master_bytes * mine["owned"],
                                      total=mine["params"] + mine["grads"] + mine["optimizer"])
    report["comm"]["theory_ring_bytes_per_step"] = ring
    report.update(owners=out, padding=padding, **extra)


# ----------------------------------------------------------------------------- activations
def theory_activations(rows, seq, d_model, n_head, n_layer, vocab, precision, checkpointing="none"):
    """The most activation bytes alive at once in one micro-step of model.py's GPT on one rank
    (`rows` sequences of `seq` tokens), counted from the tensors its operations create (B rows,
    T tokens, C width, H heads, V vocabulary, L blocks; b bytes per element in the working
    precision).

    A block without checkpointing keeps, until backward uses them: LayerNorm's outputs (2 BTC)
    and their means and reciprocal stds (4 BT), the qkv projection (3 BTC: q, k and v are views of
    it), attention's output (BTC) and log-sum-exp (BHT, fp32: flash attention keeps no T x T
    scores), the first residual sum (BTC), the MLP's hidden layer before and after GELU (8 BTC),
    and its output (BTC, the next block's input): 16 BTC + 4 BT elements + 4 BHT bytes. (Korthikanti
    et al. 2022 count 34 BTC bytes at 2 bytes per element, plus 5 BHT^2 for attention scores and
    dropout masks; without dropout and with flash attention, 16 elements remain.) Around the
    blocks: the embeddings' sum and ln_f (2 BTC + 2 BT), the positions (T) and targets (BT, a
    copy: the batch's rows are views) in int64, and at the loss the logits, their fp32 copy (in
    bf16) and the log-softmax (BTV each), all at once.

    With "block" checkpointing forward keeps each block's input only ((L + 2) BTC in all); in
    backward the last block is recomputed beside the L inputs still needed, up to (not including)
    its output, 15 BTC + 4 BT elements + 4 BHT bytes: whichever of the two is larger.
    """
    b = STATE_BYTES[precision]["params"]
    btc, bt, bht, btv = rows * seq * d_model, rows * seq, rows * n_head * seq, rows * seq * vocab
    block = (16 * btc + 4 * bt) * b + 4 * bht
    loss = btv * b + (4 * btv if b != 4 else 0) + 4 * btv + 8  # (+8: the loss and its weight, fp32)
    ints = 8 * seq + 8 * bt
    if checkpointing == "none":
        return n_layer * block + (2 * btc + 2 * bt) * b + ints + loss
    return max((n_layer + 2) * btc * b + 2 * bt * b + ints + loss,
               (n_layer + 15) * btc * b + 4 * bt * b + 4 * bht + 8 * seq + 8)
