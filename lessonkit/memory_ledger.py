"""Memory, observed from outside the lessons: MemoryLedger walks the tensors a strategy and its
optimizer actually hold and sums their storages (each storage once), by category; sampled after
every tensor operation of the measured step (Peaks) it finds the most parameter bytes alive at
once, the most gradient bytes alive during backward and the most activation bytes (what forward
computed and backward has not yet used); max_rss is the whole process.
"""
import resource
import sys
import weakref

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CATEGORIES = ("params", "grads", "optimizer", "other")


class MemoryLedger:
    """Bytes held per category, from the tensors reachable from the model, the strategy object
    and the optimizer, each storage counted once (views of one flat buffer count once).

    Classification: model parameters -> params; any `.grad` -> grads; optimizer state and
    optimizer-owned parameters (fp32 master weights) -> optimizer; other tensors held by the
    strategy -> by the attribute's name ("grad" -> grads, "master" -> optimizer, "param" ->
    params), else "other". Freed storages (ZeRO-3's `resize_(0)`) count as zero bytes.
    `master_weights` is the part of `optimizer` that the optimizers update (fp32 master weights
    in bf16 mode; 0 in fp32 mode, where they update the parameters themselves).
    """

    def __init__(self, model, roots):
        self.model, self.roots = model, roots

    def tensors(self):
        """Yield (category, tensor) for everything held; params first so views dedup to them."""
        params = list(self.model.parameters())
        found = [("params", p) for p in params] + [("grads", p.grad) for p in params if p.grad is not None]
        self._updated, seen = [], set()  # _updated: the tensors every optimizer found updates
        for root in self.roots:
            self._walk(root, "other", found, seen, depth=0)
        # then a wrapper module's own attributes (06's units, their gradients in flight), keeping
        # only what their names say (grads, params, master weights): nothing found above changes
        for root in self.roots:
            for k, v in vars(root).items() if isinstance(root, nn.Module) else ():
                if not k.startswith("_"):
                    self._walk(v, _category(k, None), found, seen, depth=1)
        return [(category, t) for category, t in found if category is not None]

    def _walk(self, obj, category, found, seen, depth):
        if id(obj) in seen or depth > 8:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append((category, obj))
            if obj.grad is not None:
                found.append(("grads", obj.grad))
        elif isinstance(obj, torch.optim.Optimizer):
            updated = [p for group in obj.param_groups for p in group["params"]]
            self._updated += updated
            for t in updated + [t for state in obj.state.values() for t in state.values()]:
                self._walk(t, "optimizer", found, seen, depth + 1)
            for k, v in vars(obj).items():  # 04/05's buffers; a wrapped optimizer (ZeroRedundancyOptimizer.optim)
                if k not in ("param_groups", "state", "defaults") and not k.startswith("_"):
                    self._walk(v, _category(k, category), found, seen, depth + 1)
        elif isinstance(obj, nn.Module):
            for t in list(obj.parameters()) + list(obj.buffers()):
                self._walk(t, "params", found, seen, depth + 1)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                # a non-string key (a parameter, say) names no category; str() of a tensor would
                # print it, reading its memory, which ZeRO-3 (06) may have freed
                self._walk(v, _category(k if isinstance(k, str) else "", category), found, seen, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                self._walk(v, category, found, seen, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__ not in (
                "torch.distributed.distributed_c10d", "torch._C._distributed_c10d"):
            for k, v in vars(obj).items():
                self._walk(v, _category(k, category), found, seen, depth + 1)

    def measure(self):
        """{category: bytes, "master_weights": bytes}; where a root tells its device tier (07's
        device_tier()), also "device" and "host": {category: bytes} in each. A tensor is the
        device's if it is on an accelerator or in that tier (on a CPU-only machine, its role)."""
        totals = {**dict.fromkeys(CATEGORIES, 0), "master_weights": 0}  # master_weights: in optimizer
        tensors, counted = self.tensors(), set()
        updated = {_storage_key(t) for t in self._updated}
        tiered = [r for r in self.roots if hasattr(r, "device_tier")]
        device = {_storage_key(t) for r in tiered for t in r.device_tier()}
        tiers = {"device": dict.fromkeys(CATEGORIES, 0), "host": dict.fromkeys(CATEGORIES, 0)}
        for category, t in tensors:
            key = _storage_key(t)
            nbytes = 0 if key is None else _local(t).untyped_storage().nbytes()
            if nbytes == 0 or key in counted:
                continue
            counted.add(key)
            totals[category] += nbytes
            tiers["device" if t.device.type != "cpu" or key in device else "host"][category] += nbytes
            if category == "optimizer" and key in updated:
                totals["master_weights"] += nbytes
        return {**totals, **(tiers if tiered else {})}


def _local(t):
    return t.to_local() if type(t).__name__ == "DTensor" else t  # FSDP2's parameters: the local shard


def _storage_key(t):
    t = _local(t)
    return None if t.device.type == "meta" else (t.untyped_storage().data_ptr(), t.device)


def _category(name, inherited):
    name = name.lower()
    if "grad" in name:
        return "grads"
    if "master" in name or "optim" in name or "exp_avg" in name:
        return "optimizer"
    if "param" in name:
        return "params"
    return inherited


class Peaks(TorchDispatchMode):
    """Samples the bytes held after every tensor operation of the measured step: `peak` is the
    most parameter bytes, `peak_grads` the most gradient bytes during backward (inside
    loss.backward(): the hooks and the callbacks it runs included).

    Also keeps the series: `timeline` holds [op index, parameter bytes, phase, op name] at every
    operation after which the bytes or the phase (forward, backward, optimizer) changed."""

    def __init__(self, ledger):
        super().__init__()
        self.ledger, self.peak, self.peak_grads = ledger, 0, 0
        self.ops, self.in_optimizer, self.timeline = 0, False, []
        # activations: the storages forward creates (grad mode on, from the model's forward to the
        # start of backward) and backward recomputes (grad mode on inside backward: checkpointing),
        # each counted from the operation that made it until it is freed; the most alive at once
        self.in_forward, self.activations, self.peak_activations, self.born = False, 0, 0, {}

    def __enter__(self):
        begin = lambda *_: setattr(self, "in_forward", True)  # noqa: E731
        self.forward_hook = self.ledger.model.register_forward_pre_hook(begin)
        return super().__enter__()

    def __exit__(self, *exc):
        self.forward_hook.remove()
        return super().__exit__(*exc)

    def _count_activations(self, args, kwargs, out):
        in_backward = torch._C._current_graph_task_id() != -1
        self.in_forward = self.in_forward and not in_backward
        if not (torch.is_grad_enabled() and (self.in_forward or in_backward)):
            return  # backward's gradients (grad mode off), the optimizer, anything after backward
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)}
        for t in tree_flatten(out)[0]:
            storage = t.untyped_storage() if torch.is_tensor(t) else None
            key = storage and storage.data_ptr()
            if not key or key in inputs or key in self.born:  # a view, in place, or seen
                continue
            self.born[key] = storage.nbytes()
            self.activations += storage.nbytes()
            self.peak_activations = max(self.peak_activations, self.activations)
            weakref.finalize(storage, self._freed, key)

    def _freed(self, key):
        self.activations -= self.born.pop(key)

    def sample(self, name="start"):
        held = self.ledger.measure()
        params = held["params"]
        self.peak = max(self.peak, params)
        phase = ("optimizer" if self.in_optimizer else
                 "backward" if torch._C._current_graph_task_id() != -1 else "forward")
        if phase == "backward":
            self.peak_grads = max(self.peak_grads, held["grads"])
        if not self.timeline or self.timeline[-1][1:3] != [params, phase]:
            self.timeline.append([self.ops, params, phase, name])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        self.sample(str(func))
        self._count_activations(args, kwargs, out)
        return out

    def optimizer_begins(self):
        """From optimizer.step() to the end of the step is the optimizer's phase, and so is what
        ran between the last backward and it (clipping, say)."""
        if any(s[2] == "backward" for s in self.timeline):
            for s in reversed(self.timeline):
                if s[2] != "forward":
                    break
                s[2] = "optimizer"
        self.in_optimizer = True


class MicroSteps(list):
    """The list the measured step's micro-step losses go in (measure.Run.step yields it): at the
    first, after that micro-step's backward, `held_grads` is the gradient bytes held until the
    next one: what 05-08's --reduce-every trades against bytes sent."""

    def __init__(self, ledger):
        super().__init__()
        self.ledger, self.held_grads = ledger, None

    def append(self, loss):
        super().append(loss)
        if len(self) == 1:
            self.held_grads = self.ledger.measure()["grads"]


def max_rss():
    """Peak resident set size of this process, bytes (getrusage: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
