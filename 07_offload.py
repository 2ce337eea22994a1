"""Lesson 07: ZeRO-Offload. The master weights, gradients and optimizer step in host memory.

06 holds (4 + 4 + 8) Psi / N bytes per rank on the accelerator: fp32 master shards, their
gradients and Adam's moments, where memory is scarce and the host beside it has several times
more. ZeRO-Offload (Ren et al. 2021) and FSDP2's CPUOffloadPolicy move those to the host and
step there; the device keeps my shard in the working precision and a unit while gathered.
07 is 06 (its units, hooks and collectives, imported) plus two copies per unit:

    # 0) my shard, host -> device: every unit's at each forward (each micro-step), on a copy
    #    stream, so they run while the first units compute; a unit's all-gather waits for its own
    # 1)-5) as 06: gather, forward, free, gather again, backward, reduce-scatter
    # 5b) my gradient shard, device -> host, once its reduce-scatter is done (copy stream)
    # 6) the optimizer steps on the host: fp32 masters and moments

On CUDA the host tier is pinned memory, the copies overlap the kernels, and the summary says
how much copy time was hidden; on a CPU-only machine both tiers are one memory, and it says so.
`--chunk-mb MB` packs blocks into larger units (FSDP2's fully_shard([...])).

    python 07_offload.py                                       # one process (world size 1)
    torchrun --nproc_per_node=2 07_offload.py                  # 2 ranks on CPU (gloo)
    torchrun --nproc_per_node=2 07_offload.py --chunk-mb 1.6   # two blocks a unit
    torchrun --nproc_per_node=4 07_offload.py --device cuda    # 4 GPUs (nccl), pinned host memory

PyTorch: FSDP2 `fully_shard(block, offload_policy=CPUOffloadPolicy(pin_memory=True))`;
DeepSpeed: ZeRO-Offload (`offload_optimizer: {device: cpu}`).
"""
import functools
import importlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy  # FSDP2's own (pin_memory)

from lessonkit import checkpoint, common, lifecycle, loss_scale, measure, optimizers
from model import get_batch

zero3 = importlib.import_module("06_zero3")  # 07 is 06 plus offload: its units, hooks and schedule


# ----------------------------------------------------------------------------- the strategy
class ZeRO3Offload(zero3.ZeRO3):
    """06's ZeRO3 with my shards' master weights, gradients and optimizer state on the host, used
    where a loop used FSDP2's `fully_shard(..., offload_policy=CPUOffloadPolicy())`.

    offload_policy  FSDP2's CPUOffloadPolicy: its pin_memory (where there is a GPU to pin for)
    everything else as 06's ZeRO3

    `parameters()` are my shards on the host, fp32: an optimizer built over them steps on the
    host. Per unit the device keeps `device_params`, my shard in param_dtype, which its
    all-gather sends. `copied` counts the bytes and seconds of the copies each way.
    """

    def __init__(self, module, units=(), mp_policy=None, offload_policy=None, layout="even", **kwargs):
        self.layout = layout  # "uneven": each unit whole on one rank (see _place), to measure why not
        super().__init__(module, units, mp_policy, **kwargs)
        device = self.units[0].shard.device
        self.pin = getattr(offload_policy, "pin_memory", True) and device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # copies, bytes and seconds each way; exposed_s: the copy time nothing else ran beside
        self.copied = dict.fromkeys(("h2d_n", "d2h_n", "h2d_bytes", "d2h_bytes", "h2d_s", "d2h_s", "exposed_s"), 0)
        self.timed = []  # (what, start, end): CUDA events not yet added up
        for unit in self.units:
            # the device keeps my shard in param_dtype only: what the all-gather sends
            unit.device_params = unit.shard.to(self.param_dtype or unit.shard.dtype)  # (shard_numel,)
            host = torch.empty(unit.shard.shape, dtype=unit.shard.dtype, pin_memory=self.pin)
            unit.shard = host.copy_(unit.shard)  # the fp32 master weights, on the host
            for i, (old, (lo, hi)) in enumerate(zip(unit.sharded, unit.ranges)):
                unit.sharded[i] = nn.Parameter(host[lo:hi], old.requires_grad)  # the optimizer's
                unit.sharded[i].full_shape = old.full_shape
            unit.upload = unit.download = None
        self.shard_of = {p: s for u in self.units for p, s in zip(u.params, u.sharded)}

    def device_tier(self):
        """For the ledger: the tensors the accelerator holds (all else is the host's); on a
        CPU-only machine both are this memory, told apart by role."""
        return [t for u in self.units for t in (u.device_params, u.flat_param, u.flat_grad) if t is not None]

    # ------------------------------------------------------------------ the older, uneven layout
    def _place(self, unit):
        """--layout uneven: unit i whole on rank i mod N, as chunks went to ranks in ZeRO-Offload's
        first layouts (and ColossalAI's before its even chunks): its owner alone keeps, copies
        and steps it, broadcasts it to the others (1) and has its gradient reduced to it (5). The
        rank owning the most copies and steps the most, and every other rank waits for it."""
        unit.owner = unit.index % self.world_size
        if self.layout == "uneven":
            unit.start, unit.shard_numel = 0, unit.numel_padded if self.rank == unit.owner else 0

    def _unshard(self, unit, wait=True):
        if self.layout == "even" or unit.flat_param.untyped_storage().size() > 0:
            return super()._unshard(unit, wait)  # (06's waits for a broadcast on its way too)
        unit.flat_param.untyped_storage().resize_(unit.flat_param.numel() * unit.flat_param.element_size())
        if self.rank == unit.owner:
            unit.flat_param.copy_(self._gather_input(unit, unit.flat_param.dtype))
        unit.gather_work = dist.broadcast(unit.flat_param, src=unit.owner, async_op=True)
        super()._unshard(unit, wait)

    def _reduce_scatter(self, unit):
        if self.layout == "even" or not self.require_backward_grad_sync:
            return super()._reduce_scatter(unit)
        self._wait_reduce_scatters()
        grad = unit.grad_to_reduce(self.reduce_dtype or unit.flat_param.dtype)
        work = dist.reduce(grad.div_(self.world_size), dst=unit.owner, async_op=True)  # the mean, to its owner
        self.grads_in_flight.append((unit, work, grad if self.rank == unit.owner else grad[:0]))

    # ------------------------------------------------------------------ the copies
    def _copy(self, direction, dst, src):
        """dst.copy_(src), counted; returns what marks its end. On CUDA it runs on the copy
        stream, asynchronously (pinned host memory); on the CPU it is a plain copy. Counted:
        the host tensor's bytes, what crosses the bus (the device converts the dtype)."""
        host = src if direction == "h2d" else dst
        self.copied[f"{direction}_n"] += 1  # one a unit (a chunk) each way
        self.copied[f"{direction}_bytes"] += host.numel() * host.element_size()
        if self.copy_stream is None:
            t0 = time.perf_counter()
            dst.copy_(src)
            for key in (f"{direction}_s", "exposed_s"):  # the CPU copies, and does nothing else
                self.copied[key] += time.perf_counter() - t0
            return None
        # after all the current stream has queued (whatever last wrote src or read dst), then
        # without blocking the CPU; an event after it marks its end
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.copy_stream):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
        self.timed.append((direction, start, end))
        return end

    def _exposed(self, copy_end):
        """CUDA: the time from now on the compute stream (what it has queued done) to copy_end,
        if later: how long a copy kept what waits for it waiting."""
        now = torch.cuda.Event(enable_timing=True)
        now.record()
        self.timed.append(("exposed", now, copy_end))

    def counters(self):
        """What `copied` holds now, the CUDA copies' times added up (call it with the GPU idle)."""
        for what, start, end in self.timed:
            self.copied[f"{what}_s"] += max(start.elapsed_time(end), 0) / 1e3
        self.timed = []
        return dict(self.copied)

    # ------------------------------------------------------------------ 0) host -> device
    def _start_forward(self):  # forward begins: start every unit's upload now
        # At every forward (each micro-step), not only after the optimizer's step: whatever
        # changed the host shard (the optimizer, a resume, the caller) is then on the device
        # at its next use. (A shard's version counter would tell a changed one, but an
        # in-place write through `.data`, as some optimizers make, does not move it. FSDP2
        # copies at every all-gather, twice a step.)
        # ### BEGIN SOLUTION: upload every unit's shard
        # GOAL: every unit's device_params starts receiving its host shard (fp32, cast to
        #       device_params' dtype) through the counted copy above, and u.upload keeps what it
        #       returns (the copy's end, which the unit's all-gather waits for).
        for u in self.units:
            u.upload = self._copy("h2d", u.device_params, u.shard)  # fp32 up, cast on the device
        # ### END SOLUTION
        super()._start_forward()

    def _gather_input(self, unit, dtype):
        """06's: what the all-gather sends, my shard on the device, once its upload has landed."""
        if unit.upload is not None:
            self._exposed(unit.upload)  # the gather (and all computing after it) waits this long
            torch.cuda.current_stream().wait_event(unit.upload)  # the GPU waits, not the CPU
            unit.upload = None
        return unit.device_params.to(dtype)

    # ------------------------------------------------------------------ 5b) device -> host
    def _wait_reduce_scatters(self):
        done = [unit for unit, _, _ in self.grads_in_flight]
        super()._wait_reduce_scatters()  # unit.grad_shard: my gradient shard, on the device
        for unit in done:
            # ### BEGIN SOLUTION: download a gradient shard
            # GOAL: unit.grad_shard becomes a new host tensor (pinned if self.pin) of its shape and
            #       dtype, filling through the counted copy above (unit.download: what it returns); on
            #       CUDA the device tensor, dropped here, must not be reused before the copy stream
            #       read it.
            on_host = torch.empty(unit.grad_shard.shape, dtype=unit.grad_shard.dtype, pin_memory=self.pin)
            unit.download = self._copy("d2h", on_host, unit.grad_shard)
            if self.copy_stream is not None:  # dropped below, its memory reused by the current
                unit.grad_shard.record_stream(self.copy_stream)  # stream only once the copy is done
            unit.grad_shard = on_host  # nothing of the gradient stays on the device
            # ### END SOLUTION

    def _reduced_grad(self, unit):
        """06's, at the end of backward: my gradient shard, on the host once it landed."""
        if unit.download is not None:
            self._exposed(unit.download)  # backward's compute is done: the optimizer waits this long
            # the CPU reads it next: wait for the copy itself (and, the copy stream running in
            # order, for every upload queued before it: the optimizer may then write the shards)
            unit.download.synchronize()
            unit.download = None
        return super()._reduced_grad(unit)

    def clip_grad_norm_(self, max_norm):
        """As 06's, with the norm's one all-reduce on the device (NCCL moves no host tensors)."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        return optimizers.clip_grad_norm_(grads, max_norm, self.units[0].device_params.device)


# ----------------------------------------------------------------------------- training
def chunks(mb, blocks):
    """--chunk-mb: the blocks packed whole, in the order forward runs them, into chunks of at most
    `mb` MiB of fp32 weights (a larger block a chunk of its own; 0: one block a chunk, 06's units).
    A chunk is one unit: gathered, freed, reduce-scattered and copied as one."""
    out, room = [], 0
    for block in blocks:
        size = 4 * sum(p.numel() for p in block.parameters())  # (on the meta device: shapes only)
        if size > room or not out:  # (a first block without parameters starts a chunk too)
            out.append([])
            room = mb * 2 ** 20
        out[-1].append(block)
        room -= size
    return out


def build_model(args, env):
    """06's GPT under ZeRO-3, its blocks in chunks, with my shards offloaded to the host."""
    return zero3.build_model(args, env, ZeRO3Offload, pack=functools.partial(chunks, args.chunk_mb),
                             offload_policy=CPUOffloadPolicy(pin_memory=True),
                             layout=args.layout)  # --layout uneven: the older one, measured


def main(argv=None):
    args = common.parse_args(argv, description=__doc__)
    env = common.init_distributed(args)
    model = build_model(args, env)
    # any optimizer, over my shards on the host: it steps there (foreach: one kernel per op)
    optimizer = torch.optim.AdamW(optimizers.decay_groups(model, args.weight_decay), **optimizers.adamw_kwargs(args))
    scaler = loss_scale.LossScaler(env.device, enabled=args.precision == "fp16", init_scale=args.loss_scale)
    run = measure.Run(args, env, "offload", model.module, optimizer, holders=[model], loss_scaler=scaler)
    ckpt = checkpoint.Checkpointer(args, env, run.strategy, model.module,  # --checkpoint-dir
                                   functools.partial(checkpoint.unit_shards, model, optimizer), loss_scaler=scaler)
    start = ckpt.resume()  # 0, or with --resume the step the newest checkpoint stopped at

    ### TRAINING SECTION BEGIN
    for step in range(start, args.steps):
        with run.step(step) as losses:
            optimizers.set_learning_rate(optimizer, args, step)  # --lr-schedule, first (as nanoGPT)
            for micro in range(args.grad_accum):
                model.set_requires_gradient_sync(args.reduce_every == "micro" or micro == args.grad_accum - 1)  # as 06
                x, y = get_batch(args, env, step, micro)
                loss = model(x, y) / args.grad_accum  # 0) upload 1) gather 2) forward 3) free
                scaler.scale(loss).backward()  # 4) gather 5) reduce-scatter 5b) download into my shards' .grad
                losses.append(loss)
            scaler.unscale_(optimizer)  # fp16: my shards' fp32 .grad / S, on the host, before clipping (as 06)
            if args.grad_clip > 0:
                model.clip_grad_norm_(args.grad_clip)  # one scalar all-reduce, on the device
            scaler.step(optimizer)  # 6) AdamW on my shards, on the host (fp16: skipped on every rank or none)
            scaler.update()
            optimizer.zero_grad()
        ckpt.maybe_save(step + 1)  # every --save-every steps (each rank its shard)
    ### TRAINING SECTION END

    run.finish()
    return run


if __name__ == "__main__":
    lifecycle.run_main(main)
