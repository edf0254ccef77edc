"""Recording a function's ATen ops into an FX graph, on fake tensors: what `make_fx(f,
tracing_mode="fake")` gives for the steps HiDup traces (the same ops in the same order, with each
node's `meta['val']` and the `meta['custom']` of `torch.fx.traceback.annotate`), at about twice
its speed (`python -m experiments.record_time`, megatron with k = 2, rank 0 of 2: gpt:tiny 0.25 s
against 0.52 s, gpt:small 0.45 s against 0.94 s; docs/design.md).

make_fx is general: it tracks every tensor through proxies, snapshots each value's metadata,
records stack traces and handles tensor subclasses and symbolic shapes. A training step needs
none of that: its inputs are plain tensors of static shapes, so a dispatch mode above the fake
tensors that writes one graph node per ATen call, keyed by the tensor each call returns, is the
whole job. What it leaves out, and why nothing is lost:
- `prim.device` queries (2,047 of the 3,039 calls of gpt:tiny's megatron step, k = 2) record
  nothing, as in make_fx.
- A `detach` is not recorded: its result stands for its input (the detaches cut the step's
  per-node autograd graphs while recording; the recorded graph runs without autograd).
- A constant made inside (`torch.tensor(...)`) is copied where the graph reads it, as make_fx
  copies it, so that nothing the step does to it lasts to the next step.
- Composite ops that autograd would have split up are split the same way make_fx splits them,
  so the graph holds the same kernels.
The autocast cache is off while recording, as in make_fx (a cached cast of a weight would be a
tensor no recorded op made)."""
from __future__ import annotations

import operator

import torch
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, autograd_would_have_decomposed

_DEVICE = torch.ops.prim.device.default
_DETACH = torch.ops.aten.detach.default
_LIFT, _LIFT_COPY = torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default
_NOT_SPLIT = (torch.ops.aten.size.default, torch.ops.aten.stride.default,
              torch.ops.aten.storage_offset.default)


class _Recorder(TorchDispatchMode):
    """Writes each ATen call it sees as a node of `graph`; `node_of` finds the node that made a
    tensor (by identity: every recorded tensor is kept alive, so no id is reused)."""

    def __init__(self, graph: torch.fx.Graph, root: torch.nn.Module):
        super().__init__()
        self.graph, self.root = graph, root
        self.node_of: dict[int, torch.fx.Node] = {}
        self.alive: list[torch.Tensor] = []
        self.constants = 0
        self.split: dict[tuple, bool] = {}  # (op, device type): split up as autograd would

    def bind(self, tensor: torch.Tensor, node: torch.fx.Node) -> None:
        self.node_of[id(tensor)] = node
        self.alive.append(tensor)

    def value(self, x):
        """An argument as the graph passes it: a tensor by the node that made it (a tensor no
        recorded op made is a constant: `torch.tensor(...)` inside the step), a list of them
        item by item, anything else as it is."""
        if isinstance(x, torch.Tensor):
            node = self.node_of.get(id(x))
            return node if node is not None else self.constant(x)
        if isinstance(x, (list, tuple)):
            return type(x)(self.value(item) for item in x)
        return x

    def constant(self, x: torch.Tensor) -> torch.fx.Node:
        real = x.constant if isinstance(x, FakeTensor) else x
        if real is None:
            raise RuntimeError(f"recording the step met a tensor of shape {tuple(x.shape)} "
                               f"({x.dtype}) that is neither an input nor made by an op of "
                               f"the step: a step may only read its arguments")
        name = f"_tensor_constant{self.constants}"
        self.constants += 1
        setattr(self.root, name, real)
        node = self.graph.get_attr(name)
        node.meta["val"] = x
        self.bind(x, node)
        return node

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE:
            return func(*args, **kwargs)
        if self.splits(func, args, kwargs):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if func is _DETACH:
            self.bind(out, self.value(args[0]))
            return out
        node = self.graph.call_function(_LIFT_COPY if func is _LIFT else func, self.value(args),
                                        {k: self.value(v) for k, v in kwargs.items()})
        self.mark(node, out)
        if isinstance(out, torch.Tensor):
            self.bind(out, node)
        elif isinstance(out, (tuple, list)):
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    part = self.graph.call_function(operator.getitem, (node, i))
                    self.mark(part, item)
                    self.bind(item, part)
        return out

    def splits(self, func, args, kwargs) -> bool:
        """Whether `func` is a composite op that autograd would have split into its parts here
        (it reaches this mode whole where autograd is off), as make_fx asks."""
        if func in _NOT_SPLIT:
            return False
        first = next((x for arg in (*args, *kwargs.values())
                      for x in (arg if isinstance(arg, (list, tuple)) else (arg,))
                      if isinstance(x, torch.Tensor)), None)
        key = (func, None if first is None else first.device.type)
        if key not in self.split:
            self.split[key] = autograd_would_have_decomposed(func, [first])
        return self.split[key]

    @staticmethod
    def mark(node: torch.fx.Node, value) -> None:
        node.meta["val"] = value
        custom = fx_traceback.current_meta.get("custom")
        if custom:
            node.meta["custom"] = dict(custom)


def record(fn, *args) -> torch.fx.GraphModule:
    """`fn(*args)` recorded: one placeholder per argument (tensors are replaced by fake ones of
    the same shape, dtype, device and requires_grad; nothing is computed), one node per ATen op
    it calls, and its returned tensors (a tensor, or a list or tuple of them) as the output."""
    root, graph, mode = torch.nn.Module(), torch.fx.Graph(), FakeTensorMode(
        allow_fallback_kernels=True)
    recorder = _Recorder(graph, root)
    fakes = []
    for i, arg in enumerate(args):
        node = graph.placeholder(f"arg{i}")
        if isinstance(arg, torch.Tensor):
            arg = mode.from_tensor(arg)
            node.meta["val"] = arg
            recorder.bind(arg, node)
        fakes.append(arg)
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        with mode, recorder:
            out = fn(*fakes)
    finally:
        torch.set_autocast_cache_enabled(cache)
    graph.output(recorder.value(out))
    return torch.fx.GraphModule(root, graph)
