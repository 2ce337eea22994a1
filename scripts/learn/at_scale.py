"""At scale, on paper: step time, communication, overlap, throughput and memory per GPU, every stage.

    python -m scripts.learn.at_scale --model llama3-8b --cluster h100 --world 8 128 --batch 2 --seq 8192 --ckpt selective
    python -m scripts.learn.at_scale --model llama3-70b --world 64 --batch 1 --seq 8192 --ckpt full   # does it fit?
    python -m scripts.learn.at_scale --params 7.5B --layers 64 --hidden 3072 --heads 24 --vocab 50257 --world 64
    python -m scripts.learn.at_scale --check-published    # ZeRO Table 1, torchtitan, nccl-tests: model vs paper
    python -m scripts.learn.at_scale --calibrate          # this machine: predict the lessons' own step times

The model is scripts/learn/cost_model.py. Cluster flags override the preset: --peak-tflops,
--memory-gb, --intra-gbps/--intra-us (NVLink), --inter-gbps/--inter-us (NIC, per GPU),
--gpus-per-node. Bandwidths are achieved bus bandwidths (GB/s, 10^9 bytes), memory in GB.
"""
import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace

from scripts.learn.cost_model import (CLUSTERS, GPU, LESSONS, MODELS, OPS, STAGES, Cluster, Link, Workload,
                                      collective_time, gpt, llama, step)
from scripts.learn.zero_calc import count, parse_count
from theory import RING_FACTOR

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "runs", "at_scale")
GB, GIB = 1e9, 2 ** 30


# ----------------------------------------------------------------------------- the table
def table(w, cluster, worlds, stages):
    g = cluster.gpu
    lines = [f"{w.model.name} (Psi = {count(w.model.params)}) on {g.name}, {cluster.gpus_per_node} per node: "
             f"local batch {w.batch} x {w.seq} tokens, {w.ckpt} checkpointing, {w.precision}, "
             f"efficiency {cluster.efficiency:.0%} of {g.flops / 1e12:.0f} TFLOP/s",
             f"{'GPUs':>6} {'stage':<17}{'compute':>9}{'optim':>7}{'AR':>7}{'RS':>7}{'AG':>7}{'hidden':>8}"
             f"{'exposed':>8}{'step':>8}{'tok/s/GPU':>10}{'MFU':>6}  memory GB (states+act+buf)  fits {g.memory / GB:.0f} GB",
             f"{'':>6} {'':<17}{'ms':>9}{'ms':>7}{'ms':>7}{'ms':>7}{'ms':>7}{'ms':>8}{'ms':>8}{'ms':>8}"]
    for n in worlds:
        for name in stages:
            r = step(w, STAGES[name], n, cluster)
            c, mem = r["comm"], r["memory"]
            lines.append(
                f"{n:>6} {name:<17}{r['compute_s'] * 1e3:>9.0f}{r['optimizer_s'] * 1e3:>7.0f}"
                + "".join(f"{c[op]['s'] * 1e3:>7.0f}" for op in OPS)
                + f"{r['hidden_s'] * 1e3:>8.0f}{r['exposed_s'] * 1e3:>8.0f}{r['step_s'] * 1e3:>8.0f}"
                f"{r['tokens_per_s']:>10,.0f}{r['mfu']:>6.0%}  {mem['total'] / GB:>7.1f} = {mem['states'] / GB:.1f}"
                f"+{mem['activations'] / GB:.1f}+{mem['buffers'] / GB:.1f}  {'yes' if mem['total'] <= g.memory else 'NO'}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- published numbers
# torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (pytorch/torchtitan, Dec 2024): Llama
# 3.1 8B, FSDP, local batch 2, seq 8192, selective activation checkpointing, bf16 (no compile, no
# Float8); "8 NVIDIA H100 GPUs [per host] fully connected with NVLink", "96GB HBM2e with 2.4 TB/sec",
# "400 Gb/s per GPU" RDMA, 500 W. Table 1 (8 GPUs): 5,762 TPS/GPU, 82.4 GiB; Table 3 (128): 5,605, 67.0 GiB.
TITAN = replace(CLUSTERS["h100"], gpu=GPU("H100 HBM2e 96GB (torchtitan)", 989e12, 96e9, 2.4e12))
TITAN_RUN = Workload(MODELS["llama3-8b"], batch=2, seq=8192, ckpt="selective", reduce_bytes=4)  # fp32 reduce


def published():
    """(what, model, published, tolerance) rows, each tolerance justified beside it."""
    rows = []
    # ZeRO paper (Rajbhandari et al. 2020), section 5 / Table 1: 7.5B, N_d = 64, model states per
    # device. Printed to 3 significant digits (1.875 -> 1.88): 0.5% covers the rounding, no more.
    zero = Workload(MODELS["zero-7.5b"], 1, 1024)
    for name, paper in (("dp", 120), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.88)):
        rows.append((f"ZeRO Table 1, 7.5B, 64 GPUs, {name} model states GB",
                     step(zero, STAGES[name], 64, TITAN)["memory"]["states"] / GB, paper, 0.005))
    # torchtitan: throughput. 20%: their GPU's peak is unknown ("between SXM and NVL": 989 and 835
    # TFLOP/s, 16% apart) and we use SXM's, with our one EFFICIENCY for every prediction.
    r8, r128 = (step(TITAN_RUN, STAGES["zero3"], n, TITAN) for n in (8, 128))
    rows.append(("torchtitan Llama 3.1 8B FSDP, 8 GPUs, tokens/s/GPU", r8["tokens_per_s"], 5762, 0.20))
    rows.append(("torchtitan Llama 3.1 8B FSDP, 128 GPUs, tokens/s/GPU", r128["tokens_per_s"], 5605, 0.20))
    # the ratio tests the communication side alone (peak and efficiency cancel): 128 GPUs lose 2.7%.
    # 5%: each figure is one logged iteration (the 90th), run-to-run noise of a few percent.
    rows.append(("torchtitan 128 / 8 GPUs throughput", r128["tokens_per_s"] / r8["tokens_per_s"], 5605 / 5762, 0.05))
    # memory 8 -> 128 GPUs: what the model states' 16 Psi / N gives back (activations stay).
    # 15%: the readings are the allocator's peak (fragmentation, ~1 GiB either way) and rounded.
    rows.append(("torchtitan memory saved 8 -> 128 GPUs, GiB",
                 (r8["memory"]["total"] - r128["memory"]["total"]) / GIB, 82.4 - 67.0, 0.15))
    # nccl-tests busBw, reduce-scatter / all-gather, 8 H100s over NVLink: ~370 GB/s (S. Jeaugey,
    # NVIDIA/nccl-tests issue #212). 10%: "~20%" protocol overhead is stated to one digit.
    size = 8 * GIB  # large: latency negligible, as at nccl-tests' peak
    for op in ("reduce_scatter", "all_gather"):
        busbw = RING_FACTOR[op](8) * size / collective_time(op, size, 8, CLUSTERS["h100"])
        rows.append((f"nccl-tests {op} busbw, 8 x H100 NVLink, GB/s", busbw / GB, 370, 0.10))
    return rows


def check_published():
    rows = published()
    print(f"{'check':<58}{'model':>10}{'published':>11}{'error':>8}{'tolerance':>11}")
    bad = 0
    for what, model, paper, tol in rows:
        err = model / paper - 1
        bad += abs(err) > tol
        print(f"{what:<58}{model:>10.4g}{paper:>11.4g}{err:>+8.1%}{tol:>10.1%}{'' if abs(err) <= tol else '  OFF'}")
    print(f"{len(rows) - bad} of {len(rows)} within tolerance")
    return 1 if bad else 0


# ----------------------------------------------------------------------------- calibration (this machine)
# The lessons' small GPT in its communication-visible regime: 3.2M parameters, few tokens per rank.
CAL_FLAGS = ["--n-layer", "4", "--d-model", "256", "--n-head", "4", "--seq-len", "32", "--global-batch", "8",
             "--steps", "12", "--precision", "fp32", "--log-every", "100", "--peak-params", "0"]
CAL_WORLDS = (2, 4)
CAL_SIZES = [64 * 2 ** 10, 2 ** 20, 4 * 2 ** 20, 16 * 2 ** 20]


def cal_model():
    from model import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=64, seq_len=32, n_layer=4, d_model=256, n_head=4)
    net = GPT(cfg)
    psi = sum(p.numel() for p in net.parameters())
    return net, cfg, gpt("lessons' GPT", psi, cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab_size, cfg.seq_len)


def measure_compute(batch, reps=15):
    """FLOP/s of the small GPT's forward + backward on one thread, and the optimizer's streaming
    rate (bytes/s, ADAM_BYTES per parameter) from clip + AdamW(foreach) as the lessons step."""
    import torch
    from scripts.learn.cost_model import ADAM_BYTES, flops_per_token
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net, cfg, m = cal_model()
    x = torch.randint(cfg.vocab_size, (batch, cfg.seq_len))
    opt = torch.optim.AdamW(net.parameters(), foreach=True)
    fb, op = [], []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        net(x, x).backward()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad()
        if i >= 3:  # warm-up: allocator, Adam's state
            fb.append(t1 - t0)
            op.append(time.perf_counter() - t1)
    return m, flops_per_token(m, cfg.seq_len) * batch * cfg.seq_len / statistics.median(fb), \
        ADAM_BYTES["fp32"] * m.params / statistics.median(op)


def fit_link(results, n):
    """Least squares, relative: time = steps x alpha + RING_FACTOR x S / busbw, per collective."""
    import numpy as np
    link = {"busbw": {}, "latency": {}}
    for op in OPS:
        pts = [(r["bytes"], r["time_s"]) for r in results if r["op"] == op]
        steps = 2 * (n - 1) if op == "all_reduce" else n - 1
        a = np.array([[steps / t, RING_FACTOR[op](n) * s / t] for s, t in pts])  # rows scaled by 1/t
        (alpha, inv_bw), *_ = np.linalg.lstsq(a, np.ones(len(pts)), rcond=None)
        link["latency"][op], link["busbw"][op] = max(alpha, 0.0), 1 / inv_bw
    return Link(link["busbw"], link["latency"])


def calibrate():
    from scripts.runs import launch
    os.makedirs(OUT, exist_ok=True)
    cores, t0 = os.cpu_count(), time.time()
    lessons = list(LESSONS)
    print(f"measuring: compute (1 thread), gloo at {CAL_WORLDS} ranks, lessons {', '.join(lessons)} ...", flush=True)
    cal = {"machine": machine(), "flags": CAL_FLAGS, "worlds": {}}
    sweep = launch("scripts.perf.sweep", max(CAL_WORLDS),
                   [*CAL_FLAGS, "--worlds", *map(str, CAL_WORLDS), "--lessons", *lessons, "--track-peak"])
    for n in CAL_WORLDS:
        batch = 8 // n
        m, flops, mem_bw = measure_compute(batch)
        bw = launch("scripts.perf.bandwidth", n, ["--sizes", *map(str, CAL_SIZES)])["results"]
        hidden = [r["hidden"] for r in launch("scripts.perf.bandwidth", n, ["--contention", "--sizes",
                                                                             *map(str, CAL_SIZES[1:])])["results"]]
        reports = sweep["worlds"][str(n)]["reports"]
        cal["worlds"][str(n)] = {
            "batch": batch, "params": m.params, "flops_per_s": flops, "optimizer_bytes_per_s": mem_bw,
            "bandwidth": bw, "overlap_hidden": hidden,
            "measured_step_s": {name: statistics.median(reports[name]["step_time_s"][2:]) for name in lessons}}
    cal["seconds"] = time.time() - t0
    cal["rows"] = predict(cal, cores)
    with open(os.path.join(OUT, "calibration.json"), "w") as f:
        json.dump(cal, f, indent=1)
    print(calibration_table(cal))
    print(f"({cal['seconds']:.0f} s; written to {os.path.relpath(OUT, ROOT)}/calibration.json)")


def cpu_cluster(world, cores):
    """This machine as a "cluster": one node of `world` ranks. Ranks beyond the cores share them,
    so each computes at cores / world of the one-thread rate; measured rates, efficiency 1."""
    n, share = world["n"], min(1.0, cores / world["n"])
    link = fit_link(world["bandwidth"], n)
    gpu = GPU("CPU thread", world["flops_per_s"] * share, 0, world["optimizer_bytes_per_s"] * share)
    overlap = min(1.0, max(0.0, statistics.median(world["overlap_hidden"])))
    return Cluster(gpu, n, link, link, efficiency=1.0, overlap=overlap)


def predict(cal, cores):
    rows = []
    for key, world in cal["worlds"].items():
        n = int(key)
        cluster = cpu_cluster({**world, "n": n}, cores)
        m = gpt("lessons' GPT", world["params"], 4, 256, 4, 64, 32)
        w = Workload(m, batch=world["batch"], seq=32, precision="fp32", tensors=12 * 4 + 4)
        for name, measured in world["measured_step_s"].items():
            predicted = step(w, LESSONS[name], n, cluster)["step_s"]
            rows.append({"lesson": name, "ranks": n, "measured_ms": measured * 1e3, "predicted_ms": predicted * 1e3,
                         "error": predicted / measured - 1})
    return rows


def calibration_table(cal):
    m = cal["machine"]
    lines = [f"{m['cores']}-core CPU, torch {m['torch']}, gloo, 1 thread per rank; lessons at {' '.join(CAL_FLAGS[:10])}",
             f"{'lesson':<24}{'ranks':>6}{'measured ms':>13}{'predicted ms':>14}{'error':>8}"]
    for r in cal["rows"]:
        lines.append(f"{r['lesson']:<24}{r['ranks']:>6}{r['measured_ms']:>13.1f}{r['predicted_ms']:>14.1f}{r['error']:>+8.0%}")
    for key, w in cal["worlds"].items():
        link = fit_link(w["bandwidth"], int(key))
        lines.append(f"{key} ranks: {w['flops_per_s'] / 1e9:.1f} GFLOP/s per thread, optimizer "
                     f"{w['optimizer_bytes_per_s'] / 1e9:.1f} GB/s, hidden {statistics.median(w['overlap_hidden']):.0%}; "
                     + ", ".join(f"{op} {link.latency[op] * 1e6:.0f} us/step {link.busbw[op] / 1e9:.2f} GB/s" for op in OPS))
    return "\n".join(lines)


def machine():
    import platform
    import torch
    return {"cores": os.cpu_count(), "torch": torch.__version__.split("+")[0], "cpu": platform.processor() or platform.machine()}


# ----------------------------------------------------------------------------- command line
class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        sys.exit(f"at_scale: error: {message}")


def positive(kind):
    def parse(text):
        try:
            x = kind(parse_count(text) if kind is float else text)
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"not a number: {text!r}")
        if x <= 0:
            raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
        return x
    return parse


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check-published", action="store_true", help="model vs published numbers; exit 1 if any is off")
    p.add_argument("--calibrate", action="store_true", help="measure this machine, predict the lessons (minutes)")
    p.add_argument("--model", default="llama3-8b", help=f"preset: {', '.join(MODELS)}")
    p.add_argument("--cluster", default="h100", help=f"preset: {', '.join(CLUSTERS)}")
    p.add_argument("--world", type=positive(int), nargs="+", default=[8, 64, 512], help="GPUs")
    p.add_argument("--stage", nargs="+", default=list(STAGES), help=f"of {', '.join(STAGES)}")
    p.add_argument("--batch", type=positive(int), default=2, help="local batch, sequences per GPU")
    p.add_argument("--seq", type=positive(int), default=8192, help="tokens per sequence")
    p.add_argument("--ckpt", choices=["none", "selective", "full"], default="selective", help="activation checkpointing")
    for flag in ("params", "layers", "hidden", "heads", "vocab"):
        p.add_argument(f"--{flag}", type=positive(float if flag == "params" else int), help="override the model preset")
    for flag in ("peak-tflops", "memory-gb", "intra-gbps", "intra-us", "inter-gbps", "inter-us", "efficiency"):
        p.add_argument(f"--{flag}", type=positive(float), help="override the cluster preset")
    p.add_argument("--gpus-per-node", type=positive(int), help="override the cluster preset")
    a = p.parse_args(argv)
    if a.check_published:
        return check_published()
    if a.calibrate:
        return calibrate()
    if a.model not in MODELS or a.cluster not in CLUSTERS:
        p.error(f"unknown preset {a.model if a.model not in MODELS else a.cluster!r}: models "
                f"{', '.join(MODELS)}; clusters {', '.join(CLUSTERS)}")
    if unknown := [s for s in a.stage if s not in STAGES]:
        p.error(f"unknown stage {unknown[0]!r}: one of {', '.join(STAGES)}")
    m = MODELS[a.model]
    shape = {k: getattr(a, k) for k in ("params", "layers", "hidden", "heads", "vocab") if getattr(a, k) is not None}
    if shape:  # a Llama-shaped model (untied embedding and head) with these numbers
        m = llama(**{"name": "custom", **{k: getattr(m, k) for k in ("params", "layers", "hidden", "heads", "vocab")},
                     **shape})
    c = CLUSTERS[a.cluster]
    gpu = replace(c.gpu, flops=(a.peak_tflops or c.gpu.flops / 1e12) * 1e12, memory=(a.memory_gb or c.gpu.memory / GB) * GB)
    c = replace(c, gpu=gpu, gpus_per_node=a.gpus_per_node or c.gpus_per_node, efficiency=a.efficiency or c.efficiency,
                intra=override(c.intra, a.intra_gbps, a.intra_us), inter=override(c.inter, a.inter_gbps, a.inter_us))
    if c.efficiency > 1:
        p.error(f"--efficiency is a share of peak, at most 1: got {c.efficiency:g}")
    if bad := [n for n in a.world if n > c.gpus_per_node and n % c.gpus_per_node]:
        p.error(f"--world {bad[0]} is not a whole number of {c.gpus_per_node}-GPU nodes")
    if m.root >= m.params:
        p.error(f"--params {m.params:g} is smaller than the embeddings alone ({m.root:g})")
    print(table(Workload(m, a.batch, a.seq, a.ckpt), c, a.world, a.stage))
    return 0


def override(link, gbps, us):
    return Link({op: gbps * GB for op in OPS} if gbps else link.busbw, {op: us * 1e-6 for op in OPS} if us else link.latency)


if __name__ == "__main__":
    sys.exit(main())
