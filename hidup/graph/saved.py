"""What autograd keeps of an op's forward for its backward: which of its inputs and whether its
output (a linear keeps its input and weight, an add nothing, an exp its output), and the bytes of
what else it keeps: tensors of its own (softmax's output inside a loss, attention's log-sum-exp,
a dropout mask) and the copies autocast made of its inputs (a bf16 copy of a float32 weight).
The memory model holds all of them until the op's backward (hidup.planning.memory).

Found by running the op once on fake tensors (no data, no memory) under a saved-tensors hook,
its inputs at the dtypes the run computes them in (hidup.graph.dtypes), under the run's autocast:
a composite's inner ops as autocast runs them, such as a loss's log-softmax in float32 of bf16
logits. The tensors are on the run's device type where this process has that device, and
otherwise on the CPU, under the CPU's autocast policy (fake CUDA tensors cannot run autograd
without CUDA; `probe_device`). The probe requires a gradient
where the run's do (Graph.gradients: a product with a constant keeps only the constant), and
matching what autograd packs with the op's inputs and output (or views of them). The same run,
and its backward, counted by LiveStorages, give what the op holds only while it runs (its
scratch). Where the op cannot run so, every input and the output count as kept and nothing
else."""
from __future__ import annotations

import functools
import hashlib
import pickle
from pathlib import Path
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hidup.graph.cache import cache_folder, code_digest, write_entry
from hidup.graph.capture import Graph, Node, fill
from hidup.graph.dtypes import PRECISIONS, autocast_dtype


class Saves(NamedTuple):
    """What autograd keeps of one op's forward (at the node's whole shapes)."""

    reads: tuple[bool, ...]  # per input, then for the output: kept (itself or a view of it)
    copies: tuple[int, ...]  # per input: bytes of autocast's copy of it that is kept (0: none)
    own: int  # bytes of the tensors of its own it keeps (not its inputs, output or copies)
    alias: bool = False  # its output shares its first input's memory (at these dtypes, on a
    #   contiguous input): a view, or a composite that views where it can (reshape,
    #   contiguous, a cast to the dtype it has, dropout with p = 0)
    # bytes its forward, then its backward, holds only while it runs, beyond what it returns
    # and keeps: a composite's intermediates (a loss's backward holds the gradient of its
    # log-softmax while it makes the logits')
    scratch: tuple[int, int] = (0, 0)


def backward_reads(graph: Graph, node: Node) -> tuple[bool, ...]:
    """Per input of `node`, then for its output: does the node's derivative read it?"""
    return backward_saves(graph, node).reads


_PROBED: dict[tuple, Saves] = {}  # backward_saves' probes of ATen ops, by what they depend on


def backward_saves(graph: Graph, node: Node) -> Saves:
    """What autograd keeps of `node`'s forward. Cached per op, arguments, input shapes and
    dtypes, autocast and device (the layers repeat), for an ATen op for the whole process: a
    search's short copies of a model (hidup.planning.extrapolate) and other graphs of the same
    ops ask again."""
    by_node = graph.__dict__.setdefault("_backward_saves_of", {})
    if node.name not in by_node:
        metas = node.in_metas(graph)
        casts = graph.run.casts.get(node.name) if graph.run is not None else None
        dtypes = casts or tuple(m.dtype for m in metas)
        grads = tuple(t in graph.gradients for t in node.inputs)
        autocast = autocast_dtype(node, None if graph.run is None
                                  else PRECISIONS[graph.run.precision])
        device = probe_device(None if graph.run is None else graph.run.device_type)
        key = node.op, repr(node.args), repr(node.kwargs), node.out_index, \
            tuple((m.shape, m.dtype) for m in metas), dtypes, grads, autocast, device
        # an ATen op's arguments print whole; another's (a region's) may not: kept per graph
        aten = node.op.startswith("aten.")
        cache = _PROBED if aten else graph.__dict__.setdefault("_backward_saves", {})
        if key not in cache:
            probe = lambda: _probe(node, metas, dtypes, grads, autocast, device)  # noqa: E731
            cache[key] = _kept(key, probe) if aten else probe()
        by_node[node.name] = cache[key]
    return by_node[node.name]


# An ATen op's probe is also kept on disk (hidup.graph.cache, 'probes'), one file per key under
# a folder named by this module's code and torch's version: a process that lowers a model probes
# only the ops no process has probed before (49 probes took 1.8 s of a planner's run).
def _probe_file(key: tuple) -> Path | None:
    folder = cache_folder("probes")
    if folder is None:
        return None
    name = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
    return folder / _code() / f"{name}.pkl"


@functools.cache
def _code() -> str:
    """What the probes depend on: this module, the capture's argument filling, torch."""
    here = Path(__file__).parent
    return code_digest([here / "saved.py", here / "capture.py"])[:16]


def _kept(key: tuple, probe) -> Saves:
    """The probe of `key` kept on disk (with the key it was made for), else `probe()`, then
    kept there."""
    path = _probe_file(key)
    if path is None:
        return probe()
    try:
        kept_key, saves = pickle.loads(path.read_bytes())
        if kept_key == repr(key):
            return Saves(*saves)
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError):
        pass  # none yet, or unreadable: probe again
    saves = probe()
    write_entry(path, lambda f: pickle.dump((repr(key), tuple(saves)), f))
    return saves


def probe_device(device_type: str | None) -> str:
    """Where the probe runs a run's ops: on its device type where this process has one (a
    CUDA run probed on a GPU gets CUDA's kernels and autocast policy), else on the CPU."""
    if device_type == "cuda" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _probe(node: Node, metas, dtypes, grads: tuple[bool, ...],
           autocast: torch.dtype | None, device: str = "cpu") -> Saves:
    every = Saves((True,) * (len(metas) + 1), (0,) * len(metas), 0)
    if node.target is None or not node.out.is_float:
        return every
    packed: list[torch.Tensor] = []
    try:
        with FakeTensorMode(), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                lambda x: packed.append(x) or x, lambda x: x):
            ins = [torch.empty(m.shape, dtype=getattr(torch, d), device=device)
                   for m, d in zip(metas, dtypes)]
            ins = [x.requires_grad_() if g and x.is_floating_point() else x  # as in the run:
                   for x, g in zip(ins, grads)]  # a mul by a constant keeps only the constant
            with LiveStorages() as live, torch.autocast(device, dtype=autocast,
                                                        enabled=autocast is not None):
                out = node.target(*fill(node.args, ins), **fill(node.kwargs, ins))
                if node.out_index is not None:
                    out = out[node.out_index]
            if not isinstance(out, torch.Tensor):
                return every
            forward_scratch = live.peak - live.now()
            held = {id(_root(x)): _root(x) for x in packed}
            copies = [str(x.dtype).removeprefix("torch.") != m.dtype
                      for x, m in zip(ins, metas)]  # autocast's copy, not the value itself
            reads = tuple(id(x) in held and not c for x, c in zip(ins, copies)) + \
                (id(_root(out)) in held,)
            kept = tuple(x.untyped_storage().nbytes() if c and id(x) in held else 0
                         for x, c in zip(ins, copies))
            mine = {id(x) for x in ins} | {id(_root(out))}
            own = sum(x.untyped_storage().nbytes() for i, x in held.items() if i not in mine)
            alias = bool(ins) and StorageWeakRef(out.untyped_storage()) == \
                StorageWeakRef(ins[0].untyped_storage())
            scratch = forward_scratch, _backward_scratch(out, ins)
    except Exception:  # an op fake tensors cannot run: count every input and its output
        return every
    return Saves(reads, kept, int(own), alias, scratch)


def _backward_scratch(out: torch.Tensor, ins: list[torch.Tensor]) -> int:
    """The most bytes `out`'s backward holds beyond the gradients it returns."""
    wrt = [x for x in ins if x.requires_grad]
    if not out.requires_grad or not wrt:
        return 0
    grad_out = torch.empty_like(out)
    with LiveStorages() as live:
        grads = torch.autograd.grad(out, wrt, grad_out, allow_unused=True)
    returned = live.now()  # the gradients, still held here
    del grads
    return max(0, live.peak - returned)


class LiveStorages(TorchDispatchMode):
    """Bytes of the storages the ops run under it return (real or fake tensors), counted from
    the op that made each until torch frees it, and their most at any op's end (`peak`).
    `held` tensors count from the start. Kernels' scratch inside one op is not seen."""

    def __init__(self, held=()):
        super().__init__()
        self.live: dict[StorageWeakRef, int] = {}  # storage: bytes (a weak reference keeps a
        #   storage's identity, so a freed one is never mistaken for a new one)
        self.total = 0  # the live bytes, or more: freed storages leave at the next sweep
        self.peak = 0
        for t in held:
            self._track(t)
        self.start = self.peak = self.now()

    def now(self) -> int:
        """The bytes live now."""
        for ref, nbytes in list(self.live.items()):
            if ref.expired():
                del self.live[ref]
                self.total -= nbytes
        return self.total

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        ref = StorageWeakRef(storage)
        if nbytes == 0 or ref in self.live:  # known (a freed one is never looked up again)
            return
        self.live[ref] = nbytes
        self.total += nbytes
        if self.total > self.peak:
            self.peak = max(self.peak, self.now())  # only an exact count can raise it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out


def _root(x: torch.Tensor) -> torch.Tensor:
    """The tensor a view views (a saved weight is often its transpose), else itself."""
    return x._base if x._base is not None else x
