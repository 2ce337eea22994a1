"""The summary a lesson prints at the end of its run, read from its report (measure.py): every
measurement beside its formula (theory.py), rank 0's unless it says otherwise."""
import contextlib
import io
import re

from lessonkit.theory import STATE_BYTES


def print_summary(r):
    """The run's summary, from its report: each measurement beside its formula."""
    rank = r["config"].get("simulate_rank") if r["config"].get("simulate_world") else None
    if rank is not None:  # one rank of N, alone (lessonkit/simulate.py): its lines are rank r's, and no loss or time
        print(f"simulated: rank {rank} of {r['world_size']}, alone, on PyTorch's fake backend: every collective issued and "
              f"counted, none moved data; no loss or step time is a result, the bytes held and issued are rank {rank}'s", flush=True)
        with contextlib.redirect_stdout(io.StringIO()) as out:
            _print_summary(r, simulated=True)
        return print(re.sub(r"rank 0(?! ?\d)", f"rank {rank}", out.getvalue()), end="", flush=True)
    _print_summary(r)


def _print_summary(r, simulated=False):
    mib = 2 ** 20
    comm = r["comm"]
    print(f"summary {r['strategy']} | world {r['world_size']} {r['backend']} {r['precision']} | Psi = {r['n_params']:,} params"
          + ("" if simulated else f" | final loss {r['losses'][-1]:.4f} | median step {r['median_step_time_s'] * 1e3:.1f} ms"))
    if r.get("loss_scale"):  # fp16: dynamic loss scaling (loss_scale.py)
        ls = r["loss_scale"]
        print(f"  loss scale: {ls['init_scale']:.10g} at the start, {ls['final_scale']:.10g} at the end | steps "
              f"skipped on every rank (an inf or NaN on some rank): {len(ls['skipped_steps'])} {ls['skipped_steps']}")
    ops = ", ".join(f"{k} x{v['calls']} ({v['bytes'] / mib:.2f} MiB)" for k, v in comm["ops"].items())
    print(f"  comm per rank per step (step {comm['measured_step']}): {ops or 'none'}")
    wire = comm["wire_bytes_per_rank"][0]
    wire = "n/a" if wire is None else f"{wire / mib:.3f} MiB"
    cfg = r["config"]
    link = "".join(f" {where}a {{:g}} Gb/s, {{:g}} us link".format(*map(float, cfg[key].split(":")))
                   for key, where in (("link", "on "), ("inter_link", f"and between nodes of {cfg.get('ranks_per_node')} ranks, "))
                   if cfg.get(key))
    print(f"  bytes sent per rank (rank 0), {cfg['collectives']} collectives{link}: "
          f"issued {comm['issued_ring_bytes_per_step'] / mib:.3f} MiB (asked for x ring factor) | "
          f"wire {wire} (written to the sockets) | theory {comm['theory_ring_bytes_per_step'] / mib:.3f} MiB")
    if "per_link" in comm:  # 08: inside the shard group (a node) and across the replicas; 01-07 on nodes
        links = comm["per_link"]
        print("  per link (rank 0), MiB per step: " + " | ".join(_link(link, v, mib) for link, v in links.items()))
        issued = {link: [e["issued_ring_bytes_per_step"] / mib for e in v["per_rank"]] for link, v in links.items()}
        if any(len(set(each)) > 1 for each in issued.values()):  # 01-07: the ranks whose hop crosses nodes
            print("  per link, issued MiB per step, rank by rank: " + " | ".join(
                f"{link} " + " ".join(f"{b:.3f}" for b in each) for link, each in issued.items()))
    ov = comm.get("overlap")
    if simulated:
        pass  # (no data moved: nothing to overlap)
    elif r["world_size"] == 1:  # (its collectives, over a group of one, copy at most: none to hide)
        print("  overlap: n/a at world 1 (no other rank: nothing crosses a wire)")
    elif ov is not None and ov.get("source"):
        print(f"  overlap rank 0: NCCL kernels {ov['comm_ms']:.1f} ms | exposed {ov['exposed_ms']:.1f} ms "
              f"(no compute kernel beside them) | hidden {ov['hidden_share']:.0%}")
    elif ov is not None:
        print(f"  overlap rank 0, step {comm['overlap_step']}: comm {ov['comm_ms']:.1f} ms (issue to completion) | "
              f"exposed {ov['exposed_ms']:.1f} ms (blocked in wait) | hidden {ov['hidden_share']:.0%}")
    elif comm["overlap_step"] is None:  # --peak-params 1, and the measured step was the last
        print(f"  overlap: not timed (step {comm['measured_step']} sampled memory after every operation, "
              "which slows its compute, and no step followed it; --peak-params 0 times it in that step)")
    elif r["backend"] == "nccl":
        print("  overlap: unavailable on NCCL from the CPU clock (--trace DIR measures it from GPU kernel times)")
    m, th = r["memory"]["per_rank"][0], r["memory"]["theory"]
    row = " | ".join(f"{k} {m.get(k, 0) / mib:.2f} (theory {th[k] / mib:.2f})"
                     for k in ("params", "grads", "optimizer"))
    if m.get("peak_params") is not None:  # None when not tracked
        # ZeRO-3 adds the units gathered in flight to its shards; no formula, a measurement
        row += f" | peak_params {m['peak_params'] / mib:.2f} during the step"
    print(f"  memory rank 0, MiB at rest: {row}"
          + (f" | other {m['other'] / mib:.2f}" if m.get("other") else ""), flush=True)
    before, skipped = comm["measured_step"], (r.get("loss_scale") or {}).get("skipped_steps", [])
    if r.get("resumed_from") is None and set(range(before)) <= set(skipped):  # AdamW's state is made lazily
        print("  (optimizer: AdamW makes its moments at its first step, and " + (f"fp16 skipped every step before step "
              f"{before}" if before else "step 0 measures before it") + ": a later --measure-step shows them)")
    if m.get("peak_grads") is not None:  # ZeRO-2: my slices plus the buckets in flight; 01-04 all of it
        flight = " + buckets in flight" if (th["peak_grads"] or 0) > th["grads"] else ""  # (05's; 03's are the gradients)
        bound = th["peak_grads"] and f" (theory {th['peak_grads'] / mib:.2f}: at rest{flight})"
        whole = STATE_BYTES[r["precision"]]["grads"] * r["n_params"] / mib  # as backward makes it (06-08 keep fp32 shards)
        print(f"  gradients rank 0, MiB: peak during backward {m['peak_grads'] / mib:.2f}{bound or ''} | "
              f"the whole gradient {whole:.2f}" + (f" ({r['precision']})" if r["precision"] != "fp32" else ""), flush=True)
    if m.get("held_grads") is not None:  # --grad-accum K > 1: what --reduce-every (05-08) trades for bytes
        every = "".join(f" --{k.replace('_', '-')} {cfg[k]}" for k in ("reduce_every", "all_reduce_every") if cfg.get(k, "micro") != "micro")
        print(f"  gradients rank 0, MiB: held between micro-steps {m['held_grads'] / mib:.2f} (theory {th['held_grads'] / mib:.2f})"
              f" with --grad-accum {cfg['grad_accum']}{every or ''}", flush=True)
    if m.get("peak_activations") is not None:  # what forward computed, alive until backward used it
        mode, th_act = r["config"]["activation_checkpointing"], r["memory"]["theory_activations"]
        print(f"  activations rank 0, MiB: peak {m['peak_activations'] / mib:.2f} (theory "
              f"{th_act[mode] / mib:.2f}) with --activation-checkpointing {mode} | theory "
              + " | ".join(f"{k} {v / mib:.2f}" for k, v in th_act.items() if k != mode), flush=True)
    if "host" in m:  # 07: by tier, beside theory_tiers
        for tier in ("device", "host"):
            print(f"  memory rank 0 on the {tier}, MiB: " + " | ".join(
                f"{k} {m[tier][k] / mib:.2f} (theory {r['memory']['theory_tiers'][tier][k] / mib:.2f})"
                for k in ("params", "grads", "optimizer"))
                + ("" if r["device"] == "cuda" else " (on this CPU-only machine, one memory)"), flush=True)
    c = (r.get("copies_per_rank") or [None])[0]
    if c:  # 07: the measured step's copies (CUDA: their time from events on the copy stream)
        print(f"  copies rank 0: host->device {c['h2d_bytes'] / mib:.2f} MiB in {c['h2d_n']} copies, {c['h2d_s'] * 1e3:.1f} ms | "
              f"device->host {c['d2h_bytes'] / mib:.2f} MiB in {c['d2h_n']} copies, {c['d2h_s'] * 1e3:.1f} ms | "
              + copies_hidden(c, r["device"]), flush=True)
        each = [x["h2d_bytes"] for x in r["copies_per_rank"]]
        if max(each) > min(each):  # 07 --layout uneven: the busiest rank sets everyone's pace
            print(f"  copies per rank, host->device MiB: {' | '.join(f'{b / mib:.2f}' for b in each)} (uneven: rank "
                  f"{each.index(max(each))} copies {max(each) / (sum(each) / len(each)):.2f}x the even share, and "
                  "steps as much more on its host)", flush=True)
    if r.get("owners"):  # 09: whole parameters per owner; its share of the work and of the state
        print("  owners (09), per rank: elements owned | optimizer MiB measured (formula) | Newton-Schulz GFLOP "
              "counted in the first step (formula): " + " | ".join(f"rank {i} {o['owned']:,} {o['measured_optimizer'] / mib:.2f} ({o['optimizer'] / mib:.2f}) "
                                         f"{(o['measured_flops'] or 0) / 1e9:.3f} ({o['flops'] / 1e9:.3f})"
                                         for i, o in enumerate(r["owners"]) if not simulated or i == r["config"]["simulate_rank"]), flush=True)
        flops = [o["flops"] for o in r["owners"]]
        print(f"  layout (09): padding {r['padding']:,} elements ({r['padding'] / r['n_params']:.1%} of Psi, held and sent "
              f"by every rank) | Newton-Schulz imbalance: the busiest rank does {max(flops) / (sum(flops) / len(flops) or 1):.2f}x "
              "the mean" + (f" | over 06's even units: {r['extra_over_06'] / mib:.3f} MiB more sent a step, the "
                            "padding's 3 K b (N-1)/N" if "extra_over_06" in r else ""), flush=True)
    if m.get("cuda_step_peak") is not None:  # everything the step allocated: activations too
        states = ("params", "grads", "optimizer")  # 07: its device tier's alone, the GPU's share
        tier = r["memory"]["theory_tiers"]["device"] if "host" in m else None
        held = sum((m["device"] if tier else m).get(k, 0) for k in states)
        theory = sum(tier[k] for k in states) if tier else th["total"]
        act = m.get("peak_activations") is not None and f" | activations {m['peak_activations'] / mib:.2f} (above)"
        print(f"  GPU rank 0, MiB: peak allocated in the measured step {m['cuda_step_peak'] / mib:.2f} | "
              f"model states at rest{' on the device' if tier else ''} {held / mib:.2f} (theory {theory / mib:.2f})"
              f"{act or ''}", flush=True)


def _link(name, v, mib):
    """One link's bytes, rank 0's: issued, on the wire (--collectives ring), theory."""
    group = f"{v['group']} group of {v['ranks']}" if v["group"] else "none of its hops"
    wire = "" if v["wire_bytes_per_step"] is None else f" wire {v['wire_bytes_per_step'] / mib:.3f}"
    return (f"{name} ({group}) issued {v['issued_ring_bytes_per_step'] / mib:.3f}{wire} "
            f"theory {v['theory_ring_bytes_per_step'] / mib:.3f}")


def copies_hidden(c, device):
    """07's copies (one rank's counters): how much of their time ran beside other work."""
    if device != "cuda":
        return "exposed: all (plain copies on the CPU: nothing runs beside them)"
    total = c["h2d_s"] + c["d2h_s"]
    hidden = 1 - c["exposed_s"] / total if total else 0
    return (f"exposed {c['exposed_s'] * 1e3:.1f} ms (a gather waited for an upload, or the optimizer "
            f"for a download) | hidden {hidden:.0%}")
