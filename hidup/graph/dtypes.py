"""The dtype of every value as a run at a given precision gives it, found by torch itself.

Under bf16 mixed precision each op runs under `torch.autocast`: matmuls and attention compute in
bfloat16, softmax, norms and losses in float32, the rest in the dtypes type promotion gives. Which
op does what is autocast's own policy (its kernels for the run's device), not a list kept here:
`run_dtypes` runs every op of the graph once on fake tensors (no data, no memory) with autocast
on for the device and records the dtype of its output and the dtype each input is cast to. A
CUDA run's policy is read on the CPU too: fake CUDA tensors reach autocast's CUDA kernels without
a GPU (no autograd is involved).

Parameters keep their captured dtype (float32) as master weights, their gradients and the
optimizer's state too; the value an op computes with is autocast's copy. Where every op that
reads a parameter computes with a bf16 copy, the run gathers the parameter in bf16 (as FSDP2's
MixedPrecisionPolicy(param_dtype=bf16) does) and reduces its gradient in float32
(reduce_dtype=float32): `RunDtypes.compute` holds those parameters' compute dtype."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from hidup.graph.capture import Graph, Node, TensorMeta, fill

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}  # a run's precision -> its autocast dtype


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)} "
                         f"(bf16: mixed precision under torch.autocast, float32 master weights)")
    return precision


@dataclass(frozen=True)
class RunDtypes:
    """What a run at `precision` on `device_type` gives each value."""

    precision: str
    device_type: str
    # op node -> the dtype each of its inputs is computed with (autocast's copy where it casts)
    casts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # parameter node -> the dtype every op reading it computes it in, where that is not its own
    # (the run gathers it so; its gradient is reduced at the parameter's dtype)
    compute: dict[str, str] = field(default_factory=dict)


def run_dtypes(graph: Graph, precision: str, device_type: str = "cuda") -> Graph:
    """`graph` with each op's output dtype as a run at `precision` gives it (autocast's policy
    for `device_type`) and its `run` (RunDtypes) set; the graph itself where precision is fp32
    and nothing of the model's runs under an autocast block of its own. Made once per graph,
    precision and device (the planner, the simulator and the tables ask again)."""
    check_precision(precision)
    if graph.run is not None and (graph.run.precision, graph.run.device_type) == \
            (precision, device_type):
        return graph
    if PRECISIONS[precision] is None and all(n.autocast is None for n in graph.nodes):
        return graph
    made = graph.__dict__.setdefault("_run_dtypes", {})
    if (precision, device_type) not in made:
        made[precision, device_type] = _typed(graph, precision, device_type)
    return made[precision, device_type]


def _typed(graph: Graph, precision: str, device_type: str) -> Graph:
    """run_dtypes' graph, made: each op probed once per distinct call (the layers repeat)."""
    dtype = PRECISIONS[precision]
    outs: dict[str, TensorMeta] = {}
    casts: dict[str, tuple[str, ...]] = {}
    cache: dict[tuple, tuple] = {}
    for node in graph.nodes:
        if node.kind != "op":
            outs[node.name] = node.out
            continue
        metas = tuple(outs[t] for t in node.inputs)
        key = (node.op, repr(node.args), repr(node.kwargs), node.out_index, node.autocast,
               tuple((m.shape, m.dtype) for m in metas))
        if key not in cache:
            cache[key] = _probe(node, metas, autocast_dtype(node, dtype), device_type)
        out_dtype, cast = cache[key]
        outs[node.name] = replace(node.out, dtype=out_dtype or node.out.dtype)
        casts[node.name] = cast or tuple(m.dtype for m in metas)
    nodes = tuple(replace(n, out=outs[n.name]) if n.kind == "op" else n for n in graph.nodes)
    run = RunDtypes(precision, device_type, casts, _compute(graph, casts))
    return replace(graph, nodes=nodes, run=run, _index={})


def autocast_dtype(node: Node, dtype: torch.dtype | None) -> torch.dtype | None:
    """The autocast dtype node runs under: its own block's, or the run's `dtype` (None: off)."""
    if node.autocast is None:
        return dtype
    return None if node.autocast == "off" else getattr(torch, node.autocast)


def _compute(graph: Graph, casts: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Per parameter, the one dtype all its readers compute it in, where not its own."""
    seen: dict[str, set[str]] = {n.name: set() for n in graph.params}
    for node in graph.ops:
        for t, d in zip(node.inputs, casts[node.name]):
            if t in seen:
                seen[t].add(d)
    return {t: next(iter(ds)) for t, ds in seen.items()
            if len(ds) == 1 and next(iter(ds)) != graph.node(t).out.dtype}


class _Casts(TorchDispatchMode):
    """Records the copies autocast makes of an op's inputs (aten._to_copy of a tensor)."""

    def __init__(self):
        super().__init__()
        self.copies: dict[int, torch.dtype] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor):
            self.copies.setdefault(id(args[0]), out.dtype)
        return out


def _probe(node: Node, metas, dtype, device_type: str) -> tuple[str | None, tuple[str, ...]]:
    """(output dtype, dtype each input is computed in) of one op under autocast at `dtype` (None:
    off) on `device_type`; (None, ()) where fake tensors cannot run it (its dtypes stay)."""
    if node.target is None:
        return None, ()
    device = torch.device(device_type)
    was_on, was_dtype = torch.is_autocast_enabled(device_type), \
        torch.get_autocast_dtype(device_type)
    mode = _Casts()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            ins = [torch.empty(m.shape, dtype=getattr(torch, m.dtype), device=device)
                   for m in metas]
            # set directly: the context manager refuses CUDA where torch has no CUDA runtime
            torch.set_autocast_enabled(device_type, dtype is not None)
            if dtype is not None:
                torch.set_autocast_dtype(device_type, dtype)
            with mode:
                out = node.target(*fill(_on(node.args, device), ins),
                                  **fill(_on(node.kwargs, device), ins))
    except Exception:  # an op fake tensors cannot run: its captured dtypes
        return None, ()
    finally:
        torch.set_autocast_enabled(device_type, was_on)
        torch.set_autocast_dtype(device_type, was_dtype)
        torch.clear_autocast_cache()
    if node.out_index is not None:
        out = out[node.out_index]
    if not isinstance(out, torch.Tensor):
        return None, ()
    cast = tuple(str(mode.copies.get(id(x), x.dtype)).removeprefix("torch.") for x in ins)
    return str(out.dtype).removeprefix("torch."), cast


def _on(args, device: torch.device):
    """A node's arguments with any device argument moved to `device` (factory ops)."""
    return pytree.tree_map(lambda a: device if isinstance(a, torch.device) else a, args)
