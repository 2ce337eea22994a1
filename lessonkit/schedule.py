"""When 06-08 gather, free and reduce each unit: the order the units run in, learned from forward,
so every rank issues the same collectives in the same order whatever its data did (Schedule), and
the module hooks that follow it (UnitHooks; docs/drop_in.md, "Model shapes 06-08 train").

It starts as the listed order. A call further on in it means this rank skipped the units between:
`forward` returns them, to gather and free all the same. A call it does not have next (a unit
called again, or out of order) is made on demand, as FSDP2 makes every call, and the schedule
becomes that forward's calls. Backward runs the entries in reverse (`last_use`: a unit's last)."""
import collections
import functools

import torch


class Schedule:
    def __init__(self, units):
        self.order, self.todo, self.back = list(units), [], 0

    def start_forward(self):
        self.ran, self.called, self.at, self.learn = [], [], 0, False

    def forward(self, index):
        """Forward calls unit `index`: the units before it in the schedule this rank skipped."""
        self.called.append(index)
        rest = self.order[self.at:]
        if index in rest:
            skipped = rest[:rest.index(index)]
            self.at += len(skipped) + 1
        else:  # called again, or out of the order: on demand, as FSDP2; learned at the end
            skipped, self.learn = [], True
        self.ran += skipped + [index]
        return skipped

    def next_forward(self):
        return self.order[self.at] if self.at < len(self.order) else None

    def end_forward(self):
        """The units of the schedule this forward did not reach; backward's entries are set."""
        skipped, self.order = self.order[self.at:], self.called if self.learn else self.order
        self.ran += skipped
        self.todo, self.back, self.uses = self.ran[::-1], 0, collections.Counter(self.ran)
        return skipped

    def backward(self, index):
        """Backward reaches unit `index`: the entries before it this rank's backward skipped."""
        if not self.ahead(index):
            raise RuntimeError(f"ZeRO3: unit {index}'s backward ran out of the reverse order of its forward calls")
        skipped = self.todo[self.back:self.todo.index(index, self.back)]
        self.back += len(skipped) + 1
        return skipped

    def ahead(self, index):
        return index in self.todo[self.back:]

    def next_backward(self):
        return self.todo[self.back] if self.back < len(self.todo) else None

    def end_backward(self):
        skipped, self.back = self.todo[self.back:], len(self.todo)
        return skipped

    def last_use(self, index):
        """One of unit `index`'s entries is done in backward: was it its last?"""
        self.uses[index] -= 1
        return self.uses[index] == 0



class UnitHooks:
    """The hooks that call 06's ZeRO3 verbs on each unit at its time: `_unshard` (all-gather)
    before its forward and before its backward, prefetching the schedule's next unit; `_reshard`
    (free) after each; `_reduce_scatter` after its last use in backward; `_backward_over` when
    backward is over, inside loss.backward(). The bookkeeping is here, not in 06:
    - a unit this rank's data skipped is gathered and freed (reduced, in backward) all the same;
    - a unit of several modules is freed after its last module, or when forward moves on;
    - forward hooks that fire inside backward are an activation checkpoint's recompute, told
      apart as FSDP2 does (the autograd graph task id): one around a unit starts that unit's
      backward, one around several gathers each for its recompute and frees it after."""

    def register_hooks(self):
        self.schedule = Schedule(range(1, len(self.units)))  # unit 0, the root, runs first and last
        self.current = self.open = None  # the units forward and backward are in
        self.recomputing = set()  # the units a checkpoint's recompute gathered
        hook = functools.partial
        for unit in self.units:
            for m in unit.modules:
                m.register_forward_pre_hook(hook(self._pre_forward, unit))
                m.register_forward_hook(hook(self._post_forward, unit))
                if unit.index > 0:  # the root's backward pre-hook is set in _post_forward
                    m.register_full_backward_pre_hook(hook(self._pre_backward, unit))
                    m.register_full_backward_hook(hook(self._post_backward, unit))

    # ------------------------------------------------------------------ 07's and 08's extension points
    def _replicas(self):  # each shard's copies, on other ranks (08's replicate group; 06: none)
        return 1

    def _place(self, unit):  # 06 cuts every unit evenly over all ranks (07 may place one whole)
        pass

    def _gather_input(self, unit, dtype):  # what the all-gather sends (07: a copy on the device)
        return unit.shard.to(dtype)  # (fp32: the shard itself)

    def _reduced_grad(self, unit):  # my reduced gradient shard, fp32 (07: on its way to the host)
        return unit.grad_shard.to(unit.shard.dtype)

    # ------------------------------------------------------------------ skipped units
    def _catch_up(self, skipped, then, backward=False):
        """Units of the schedule this rank skipped, in its order: each prefetches its successor,
        as it would have. `then`: the unit after them."""
        for index, after in zip(skipped, skipped[1:] + [then]):
            unit = self.units[index]
            self._unshard(unit)
            self._prefetch(after)
            self._reshard(unit)
            if backward:
                self._end_use(unit)

    # ------------------------------------------------------------------ forward: 1) 2) 3)
    def _pre_forward(self, unit, module, args):
        if torch._C._current_graph_task_id() != -1:  # inside backward: a checkpoint's recompute
            if self.open in (None, self.units[0]) and self.schedule.ahead(unit.index):
                self._pre_backward(unit, module, None)  # the unit's backward begins with it
            elif unit.flat_param.untyped_storage().size() == 0:  # a checkpoint around several
                self.recomputing.add(unit)  # units: this one before its backward, an extra gather
            self._unshard(unit)  # (FSDP2 skips its forward hooks here too)
            return
        if unit.index == 0:
            self._start_forward()
        elif unit is self.current:  # the next module of a unit of several
            return
        else:
            self._close_forward()
            self._catch_up(self.schedule.forward(unit.index), then=unit.index)
        self.current = unit
        self._unshard(unit)  # 1) all-gather (or wait for the prefetch issued one unit earlier)
        self._prefetch(self.schedule.next_forward())

    def _start_forward(self):  # (07 starts its uploads here)
        self.schedule.start_forward()
        self.current = None

    def _close_forward(self):  # a unit of several modules whose last one this rank skipped
        if self.current is not None and self.current.index > 0:
            self._reshard(self.current)
            self.current = None

    def _post_forward(self, unit, module, args, output):
        if torch._C._current_graph_task_id() != -1:  # a recompute: free what it gathered
            if unit in self.recomputing and module is unit.modules[-1]:
                self.recomputing.discard(unit)
                self._reshard(unit)
            return
        if module is not unit.modules[-1]:  # (a unit of several modules: freed after its last)
            return
        self._reshard(unit)  # 3) free (the root too: 06's docstring says why)
        if unit.index > 0:
            self.current = None
        else:  # forward is over: a unit of several whose last module was skipped here is freed,
            self._close_forward()  # and the units after the last one run here are gathered too
            self._catch_up(self.schedule.end_forward(), then=None)
            # the root's inputs are token ids, with no gradient to hook: hook its outputs'
            outputs = output if isinstance(output, (tuple, list)) else [output]
            outputs = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda grad: self._pre_backward(unit, module, grad), mode="any")

    # ------------------------------------------------------------------ backward: 4) 5)
    def _pre_backward(self, unit, module, grad_output):
        if unit is self.open:
            return  # the next module of the unit backward is in
        if unit.index == 0:  # backward starts at the root: finish once it is over (02's callback)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self.open = unit
        else:
            self._close_backward()
            self._catch_up(self.schedule.backward(unit.index), then=unit.index, backward=True)
            self.open = unit
        self._unshard(unit)  # 4) all-gather again: backward needs the weights forward used
        self._prefetch(self.schedule.next_backward())

    def _post_backward(self, unit, module, grad_input, grad_output):
        # the inputs' gradients exist: this call's backward is over (if no input needs one, torch
        # calls this before it: then the next unit's backward, or backward's end, closes it)
        if unit is self.open and module is unit.modules[0] and any(g is not None for g in grad_input):
            self._close_backward()

    def _close_backward(self):
        if self.open is not None and self.open.index > 0:
            unit, self.open = self.open, self.units[0]  # back to the root, which stays gathered
            self._reshard(unit)
            self._end_use(unit)

    def _end_use(self, unit):  # one of its calls' backward is over: 5) after the last
        if self.schedule.last_use(unit.index) and unit.trainable:  # the same on every rank
            self._reduce_scatter(unit)  # (or, while it keeps gradients whole, not: ddp.GradientSync)
            unit.reduced = True

    @torch.no_grad()
    def _end_backward(self):
        self._close_backward()
        self._catch_up(self.schedule.end_backward(), then=None, backward=True)  # entries it never reached here
        self.open = None
        self._backward_over()
