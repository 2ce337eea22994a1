"""PyTorch's own counterparts of the lessons, on the same flags, data, loop and report, so the
benchmark compares like with like.

    torchrun --nproc_per_node=2 -m scripts.perf.torch_reference --impl ddp
    --impl ddp | zero_redundancy (DDP + ZeroRedundancyOptimizer) | fsdp2_noreshard | fsdp2
           | fsdp2_offload (FSDP2 + CPUOffloadPolicy, pinned where there is a GPU: 07's counterpart)
           | fsdp2_hsdp (FSDP2 over a 2-D R x G mesh, G = --shard-group: 08's counterpart)
           | local (no communication at all: each rank trains its own rows, the limit of data
             parallelism on this machine)

fp32, and for FSDP2's (06-08's counterparts) also --precision bf16, as 06-08 run it: fp32 shards,
gathered, computed and reduce-scattered in bf16 (MixedPrecisionPolicy(param_dtype=bf16)).
"""
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from lessonkit import common
from model import GPT, get_batch
from lessonkit import lifecycle, measure, optimizers

IMPLS = ("ddp", "zero_redundancy", "fsdp2_noreshard", "fsdp2", "fsdp2_offload", "fsdp2_hsdp", "local")
# 06-08's counterparts in bf16 too (a MixedPrecisionPolicy over fp32 shards, as those lessons keep);
# not 05's (fsdp2_noreshard), whose fp32 shards are not 05's layout (bf16 parameters, fp32 masters)
BF16 = ("fsdp2", "fsdp2_offload", "fsdp2_hsdp")


class _ClippedStep:
    """optimizer.step() with the same global-norm clipping as the lessons."""

    def __init__(self, optimizer, params, grad_clip):
        self.optimizer, self.params, self.grad_clip = optimizer, params, grad_clip

    def step(self):
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad()


def build(impl, model, args, env):
    """Wrap `model` as PyTorch does it; returns (module to call, optimizer with step/zero_grad)."""
    if impl in ("ddp", "local"):
        wrapped = DDP(model, bucket_cap_mb=args.bucket_mb) if impl == "ddp" else model
        return wrapped, optimizers.MixedPrecisionAdamW(optimizers.decay_groups(model, args.weight_decay), args.grad_clip,
                                                   **optimizers.adamw_kwargs(args))
    if impl == "zero_redundancy":
        wrapped = DDP(model, bucket_cap_mb=args.bucket_mb)
        opt = ZeroRedundancyOptimizer(optimizers.decay_groups(model, args.weight_decay), torch.optim.AdamW,
                                      **optimizers.adamw_kwargs(args))
        return wrapped, _ClippedStep(opt, list(model.parameters()), args.grad_clip)
    g = args.shard_group or env.world_size  # HSDP: shard over G ranks, replicate over R = N / G
    mesh = (init_device_mesh(env.device.type, (env.world_size // g, g), mesh_dim_names=("replicate", "shard"))
            if impl == "fsdp2_hsdp" else init_device_mesh(env.device.type, (env.world_size,)))
    reshard = impl != "fsdp2_noreshard"
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.precision == "bf16" else None)}
    if impl == "fsdp2_offload":  # pinned host memory needs a GPU to pin for (07 pins only there too)
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **kw)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **kw)
    opt = torch.optim.AdamW(optimizers.decay_groups(model, args.weight_decay), **optimizers.adamw_kwargs(args))
    return model, _ClippedStep(opt, list(model.parameters()), args.grad_clip)


def main(argv=None):
    parser = common.build_parser(__doc__)
    parser.add_argument("--impl", choices=IMPLS, default="ddp")
    argv = sys.argv[1:] if argv is None else argv
    impl = parser.parse_known_args(argv)[0].impl
    rest = [a for a in argv if a not in ("--impl", impl)]
    args = common.parse_args(rest, description=__doc__)
    if args.precision != "fp32" and (impl not in BF16 or args.precision != "bf16"):
        lifecycle.fail(f"--precision {args.precision}: the PyTorch references run in fp32, and FSDP2's "
                       f"({', '.join(BF16)}) in bf16 too")
    if args.collectives != "torch":  # DDP, ZeroRedundancyOptimizer and FSDP2 call the process group themselves
        lifecycle.fail("the PyTorch references run on torch's collectives only (no --collectives ring, no --link)")
    env = common.init_distributed(args)
    # FSDP2 keeps fp32 shards and casts what it gathers (as 06-08): the model starts in fp32
    model = GPT(common.model_config(args), seed=args.seed).to(env.device) if impl in BF16 else \
        common.build_model(args, env)
    psi = common.n_params(model)
    wrapped, optimizer = build(impl, model, args, env)
    model.n_params = psi  # FSDP2 swaps in DTensor shards; Psi is the unsharded count
    run = measure.Run(args, env, f"torch_{impl}", model, optimizer, holders=[wrapped])
    for step in range(args.steps):
        with run.step(step) as losses:
            for micro in range(args.grad_accum):
                x, y = get_batch(args, env, step, micro)
                last = micro == args.grad_accum - 1
                if isinstance(wrapped, DDP):
                    wrapped.require_backward_grad_sync = last
                elif hasattr(wrapped, "set_requires_gradient_sync"):
                    wrapped.set_requires_gradient_sync(last)
                loss = wrapped(x, y) / args.grad_accum
                loss.backward()
                losses.append(loss)
            optimizer.step()
            optimizer.zero_grad()
    run.finish()
    return run


if __name__ == "__main__":
    lifecycle.run_main(main)
