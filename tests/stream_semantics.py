"""A CPU stand-in for NCCL's stream semantics, for the tests.

Under gloo an async collective is forgiving: its output often holds the result before wait()
returns, and its inputs may be changed or freed meanwhile without harm. NCCL punishes both: the
output is written by the GPU at some later time, and an input is read at some later time. While
`with StreamSemantics():` is active, every async collective issued through torch.distributed
behaves as NCCL allows, at worst:

- its output is garbage (NaN; an integer's minimum) from the call until its wait() returns: the
  real collective runs on private copies, and wait() copies the result in;
- at wait(), every input and output still holds what it held just after the call (not written,
  not freed), or wait() raises an AssertionError naming the collective, the tensor and where it
  was issued;
- a collective never waited for fails the context's exit;
- every call, blocking or not, is listed in `order` (its name, its group's name, its tensor's),
  so a test can hold that every rank issued the same collectives in the same order over all its
  process groups: NCCL runs each group's collectives on their own stream, and two ranks that
  issue two groups' collectives in opposite orders can wait on each other for ever (gloo, a
  context per group, never notices). Only the calls of the thread that entered the context are
  listed: --collectives ring's thread makes its point-to-point calls whenever it gets to them.
A blocking collective's output is filled with garbage first (not where the input lies inside
it): a byte it fails to write is NaN, not stale bytes that happen to be right.

Wrapped: all_reduce, reduce_scatter_tensor/_single, all_gather_into_tensor/_single, broadcast,
reduce, isend, irecv, batch_isend_irecv (and P2POp, which must still accept the wrapped isend/irecv).
It wraps whatever each name holds when entered, and comm_meter.CommMeter.measuring() entered
inside it wraps these wrappers in turn, so a lesson runs metered and checked at once.
"""
import functools
import inspect
import os
import sys
import threading

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lessonkit.comm_meter import group_name

# name -> (input arguments, output arguments); in-place collectives name the tensor in both
_ROLES = {
    "all_reduce": (("tensor",), ("tensor",)),
    "reduce_scatter_tensor": (("input",), ("output",)), "reduce_scatter_single": (("input",), ("output",)),
    "all_gather_into_tensor": (("input_tensor",), ("output_tensor",)),
    "all_gather_single": (("input_tensor",), ("output_tensor",)),
    "broadcast": None,  # the source's input, everyone else's output: _roles
    "reduce": None,  # everyone's input, the destination's output too: _roles
    "isend": (("tensor",), ()), "irecv": ((), ("tensor",)),
}
# frames _issued_at looks past: this module, the meter wrapping it, torch's own
_SKIP = (os.path.abspath(__file__), "comm_meter.py", os.path.join("torch", "distributed"),
         os.path.join("torch", "utils"), "functools.py", "contextlib.py")


def garbage_(t):
    """Fill t with what a buffer NCCL has not written yet may hold: NaN (floats), the minimum (ints)."""
    with torch.no_grad():
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(torch.iinfo(t.dtype).min)
    return t


def _bits(t):
    """t reinterpreted as integers of its width: NaN compares equal to the same NaN, bit for bit."""
    if not t.is_floating_point():
        return t
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _overlaps(a, b):
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.data_ptr() == sb.data_ptr() and sa.nbytes() > 0


def _describe(t):
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _issued_at():
    """file:line of the first caller outside this module, comm_meter and torch."""
    frame = sys._getframe(2)
    while frame is not None and any(s in frame.f_code.co_filename for s in _SKIP):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


class _Flight:
    """One async call in flight: its real works, what its tensors must still hold, and the
    results to copy into the caller's outputs once every work is waited for."""

    def __init__(self, name, works, watched, copies, where):
        self.name, self.works, self.copies, self.where = name, list(works), copies, where
        # (role, tensor, bits just after the call, storage bytes, version counter)
        self.watched = [(role, t, t.detach().clone(), t.untyped_storage().nbytes(), _version(t))
                        for role, t in watched]
        self.waited = 0
        # named by its full-size tensor, as comm_meter counts it (an all-gather's output, ...)
        self.shape = _describe(max((t for _, t in watched), key=torch.Tensor.numel)) if watched else "()"

    def label(self):
        return f"dist.{self.name} on {self.shape}, issued at {self.where}"

    def finish(self):
        problems = []
        for role, t, before, nbytes, version in self.watched:
            now = t.untyped_storage().nbytes()
            if now != nbytes:
                problems.append(f"its {role} {_describe(t)} was freed or resized ({nbytes} -> {now} bytes)")
            elif _version(t) != version or not torch.equal(_bits(t), _bits(before)):
                problems.append(f"its {role} {_describe(t)} was written to")
        if problems:
            raise AssertionError(f"{self.label()}: before its wait() returned, {'; '.join(problems)}. "
                                 "On NCCL the collective reads its inputs and writes its outputs until "
                                 "then: an undefined result, or a use after free.")
        with torch.no_grad():
            for user, private in self.copies:
                user.copy_(private)


def _version(t):
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


class _Work:
    """The handle the caller gets: wait() completes the real work, checks and delivers."""

    def __init__(self, owner, flight, work):
        self._owner, self._flight, self._work, self._done = owner, flight, work, False

    def wait(self, *args, **kwargs):
        if self._done:
            return True
        out = self._work.wait(*args, **kwargs)
        self._done = True
        self._flight.waited += 1
        if self._flight.waited == len(self._flight.works):
            self._owner.in_flight.remove(self._flight)
            self._flight.finish()
        return out

    def is_completed(self):
        return self._done  # the result is only readable after wait(), as in this model of NCCL

    def get_future(self):
        raise NotImplementedError("StreamSemantics does not model Work.get_future(): use wait()")

    def __getattr__(self, name):
        return getattr(self._work, name)


class StreamSemantics:
    """`with StreamSemantics() as s:` run code under NCCL's rules (module docstring). After it,
    s.checked counts the async collectives checked, s.poisoned the blocking ones, and s.order
    lists every call (first_difference compares ranks' lists)."""

    def __init__(self):
        self.in_flight, self.checked, self.poisoned, self.order = [], 0, 0, []
        self._thread = threading.get_ident()
        self._originals = {}

    # ------------------------------------------------------------------ install and remove
    def __enter__(self):
        for name in _ROLES:
            if hasattr(dist, name):  # the *_single names exist from torch 2.13 on
                self._install(name, self._collective(name, getattr(dist, name)))
        self._install("batch_isend_irecv", self._batch(dist.batch_isend_irecv))
        self._install("P2POp", _p2p_op_class(dist.P2POp, {self._wrapper("isend"): c10d.isend,
                                                          self._wrapper("irecv"): c10d.irecv}))
        return self

    def __exit__(self, kind, value, tb):
        left, self.in_flight = self.in_flight, []
        for flight in left:  # let gloo finish them, so the process group stays usable
            for work in flight.works:
                work.wait()
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals = {}
        if left and kind is None:
            raise AssertionError("async collectives never waited for (on NCCL their outputs may never "
                                 "be written, and their buffers are reused while still in flight): "
                                 + "; ".join(f.label() for f in left))
        return False

    def _install(self, name, wrapper):
        self._originals[name] = getattr(dist, name)
        setattr(dist, name, wrapper)

    def _wrapper(self, name):
        return getattr(dist, name) if name in self._originals else None

    # ------------------------------------------------------------------ the wrappers
    def _collective(self, name, fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)  # keeps the signature, which CommMeter binds arguments to
        def checked(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            inputs, outputs = _roles(name, bound.arguments)
            self._issued(name, bound.arguments.get("group"), [bound.arguments[n] for n in inputs + outputs])
            asynchronous = name in ("isend", "irecv") or bound.arguments.get("async_op", False)
            if not asynchronous:
                for o in outputs:
                    if o not in inputs and not any(_overlaps(bound.arguments[o], bound.arguments[i]) for i in inputs):
                        garbage_(bound.arguments[o])
                        self.poisoned += 1
                return fn(*args, **kwargs)
            # the real collective reads copies of the inputs as they are now and writes a private
            # output; the caller's output turns to garbage until wait() (in place: the same tensor)
            private = {n: bound.arguments[n].detach().clone() for n in inputs}
            for n in outputs:
                if n not in private:
                    private[n] = garbage_(torch.empty_like(bound.arguments[n]))
            real = signature.bind(*args, **kwargs)
            real.arguments.update(private)
            work = fn(*real.args, **real.kwargs)
            if work is None:  # this rank is not in the group: nothing happened
                return None
            for n in outputs:
                garbage_(bound.arguments[n])
            watched = [("tensor" if n in inputs and n in outputs else "input" if n in inputs else "output",
                        bound.arguments[n]) for n in dict.fromkeys(inputs + outputs)]
            copies = [(bound.arguments[n], private[n]) for n in outputs]
            return self._launched(name, [work], watched, copies)[0]
        return checked

    def _batch(self, fn):
        @functools.wraps(fn)
        def checked(p2p_op_list):
            self._issued("batch_isend_irecv", p2p_op_list[0].group, [op.tensor for op in p2p_op_list])
            ops, watched, copies = [], [], []
            for op in p2p_op_list:
                mine = object.__new__(type(op))  # a copy (P2POp's __new__ defeats copy.copy)
                mine.__dict__.update(op.__dict__)
                if op.op is c10d.isend:
                    mine.tensor = op.tensor.detach().clone()
                    watched.append(("input", op.tensor))
                else:
                    mine.tensor = garbage_(torch.empty_like(op.tensor))
                    watched.append(("output", op.tensor))
                    copies.append((op.tensor, mine.tensor))
                ops.append(mine)
            works = fn(ops)
            for user, _ in copies:
                garbage_(user)
            return self._launched("batch_isend_irecv", works, watched, copies)
        return checked

    def _issued(self, name, group, tensors):
        if threading.get_ident() == self._thread:
            self.order.append(_call(name, group, tensors))

    def _launched(self, name, works, watched, copies):
        self.checked += 1
        flight = _Flight(name, works, watched, copies, _issued_at())
        if not works:  # nothing to wait for (a rank outside the group)
            flight.finish()
            return []
        self.in_flight.append(flight)
        return [_Work(self, flight, w) for w in works]


def _call(name, group, tensors):
    """A call as every rank should list it: the collective, its group by name (comm_meter's:
    "world", or 08's "shard" and "replicate", which name a different group on each node but the
    same role) and its largest tensor."""
    return name, group_name(group), _describe(max(tensors, key=torch.Tensor.numel)) if tensors else "()"


def first_difference(orders):
    """Where ranks' `order` lists part (None if nowhere): the index and each rank's call there."""
    for i, calls in enumerate(zip(*orders)):
        if len(set(calls)) > 1:
            return i, calls
    lengths = [len(o) for o in orders]
    return (min(lengths), f"lengths {lengths}") if len(set(lengths)) > 1 else None


def _roles(name, arguments):
    if _ROLES[name] is not None:
        return tuple(_ROLES[name][0]), tuple(_ROLES[name][1])
    root = "src" if name == "broadcast" else "dst"
    group, in_group = arguments.get("group"), arguments.get(f"group_{root}")
    me = dist.get_rank(group) if in_group is not None else dist.get_rank()
    root = in_group if in_group is not None else arguments.get(root)
    if name == "broadcast":
        return (("tensor",), ()) if me == root else ((), ("tensor",))
    return (("tensor",), ("tensor",) if me == root else ())  # reduce


def _p2p_op_class(P2POp, unwrap):
    """P2POp accepts only torch's own isend/irecv: hand it those for our wrappers."""
    class CheckedP2POp(P2POp):
        def __new__(cls, op, *args, **kwargs):
            return P2POp.__new__(cls, unwrap.get(op, op), *args, **kwargs)

        def __init__(self, op, *args, **kwargs):
            super().__init__(unwrap.get(op, op), *args, **kwargs)
    CheckedP2POp.__name__ = CheckedP2POp.__qualname__ = "P2POp"
    return CheckedP2POp
