"""Capture: an nn.Module and example inputs -> a Graph whose nodes carry shape, dtype, FLOPs and bytes.

We use `torch.export` (ATen-level graph, shapes from fake tensors, no hand rules for composite
modules such as nn.MultiheadAttention). The executor runs the same ATen ops node by node.
"""
from __future__ import annotations

import hashlib
import inspect
import io
import logging
import math
import operator
import sys
from contextlib import contextmanager, redirect_stderr
from dataclasses import replace

import torch
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from hidup.graph.decompose import decompose
from hidup.graph.flops import forward_flops
from hidup.graph.functional import functional, functional_view_writes, writes_in_place
from hidup.graph.nodes import Graph, Node, Ref, TensorMeta, fill  # noqa: F401 (the data model)
from hidup.graph.regions import inline_regions
from hidup.graph.tokens import per_token_regions


class CaptureError(ValueError):
    """A model could not be captured; the message names the node and op where known."""


_KIND = {InputKind.PARAMETER: "param", InputKind.BUFFER: "buffer", InputKind.USER_INPUT: "input",
         InputKind.CONSTANT_TENSOR: "buffer"}


def unpin_default_group() -> None:
    """Let `destroy_process_group()` free the default process group after torch.export ran.

    `torch.distributed.nn.functional` writes `group=group.WORLD` as its functions' default,
    evaluated when the module is first imported, and torch.export's tracer (torch._dynamo)
    imports it. Imported after `init_process_group`, ten defaults hold the default group past
    `destroy_process_group()`: gloo's worker threads then live until the interpreter finalizes,
    and one freeing a collective's tensors there can abort the process (std::terminate, "terminate
    called without an active exception", after a run that worked). To those functions None is
    the same default group, so each default that holds a process group becomes None."""
    module = sys.modules.get("torch.distributed.nn.functional")
    if module is None or not torch.distributed.is_available():
        return
    group_type = torch.distributed.ProcessGroup
    for fn in vars(module).values():
        if inspect.isfunction(fn) and any(isinstance(d, group_type) for d in fn.__defaults__ or ()):
            fn.__defaults__ = tuple(None if isinstance(d, group_type) else d
                                    for d in fn.__defaults__)


@contextmanager
def _torch_logs_quiet():
    """While torch exports: its loggers at ERROR, and what it prints on stderr held back, then
    passed on if the export succeeds. Where export fails it logs its guards and prints the graph
    it traced (tens of lines) before raising, and the failure's one line (capture's CaptureError)
    says what the user needs."""
    names = [name for name in logging.root.manager.loggerDict if name.split(".")[0] == "torch"]
    loggers = [logging.getLogger(name) for name in ["torch", *names]]
    levels = [lg.level for lg in loggers]
    held = io.StringIO()
    for lg in loggers:
        lg.setLevel(max(lg.getEffectiveLevel(), logging.ERROR))
    try:
        with redirect_stderr(held):
            yield
        sys.stderr.write(held.getvalue())
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def capture(model: torch.nn.Module, example_inputs: tuple) -> Graph:
    """Export `model(*example_inputs)` (which must return a scalar loss) to a Graph."""
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):  # no weights: no data
        example_inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x
                               for x in example_inputs)
    try:
        with _torch_logs_quiet():
            exported = torch.export.export(model, tuple(example_inputs))
    except Exception as exc:  # torch.export names the failing op in its own message
        raise CaptureError(f"torch.export failed for {type(model).__name__}: {exc}") from exc
    finally:
        unpin_default_group()
    sources = {spec.arg.name: (_KIND.get(spec.kind), spec.target or spec.arg.name)
               for spec in exported.graph_signature.input_specs}
    nodes: list[Node] = []
    loss = None
    try:
        inline_regions(exported.graph_module)
        written = decompose(exported.graph)
        written.update(functional_view_writes(exported.graph))
    except ValueError as exc:
        raise CaptureError(str(exc)) from exc
    writes = {node: buf for buf, node in written.items()}  # fx node -> the buffer it updates
    latest: dict[str, str] = {}  # a tensor an in-place op wrote -> the node holding its new value
    for fx_node in exported.graph.nodes:
        try:
            if fx_node.op == "placeholder":
                nodes.append(_placeholder(fx_node, sources))
            elif fx_node.op == "call_function" and _skipped(fx_node):
                continue
            elif fx_node.op == "call_function":
                node = _broadcast_item(fx_node) or _item(fx_node, latest) or \
                    _op_node(fx_node, latest)
                nodes.append(node)
                target = _written(fx_node) or writes.get(fx_node)
                if target is not None:
                    latest[target] = node.name
            elif fx_node.op == "output":
                loss = latest.get(_loss_name(fx_node), _loss_name(fx_node))
        except CaptureError:
            raise
        except Exception as exc:
            raise CaptureError(f"node {fx_node.name} ({fx_node.target}): {exc}") from exc
    nodes = _keep_row_dims(nodes)
    updates = tuple((n.name, latest[n.name]) for n in nodes
                    if n.kind == "buffer" and n.name in latest)
    constants = {spec.target: exported.constants[spec.target]
                 for spec in exported.graph_signature.input_specs
                 if spec.kind == InputKind.CONSTANT_TENSOR and spec.target in exported.constants}
    return per_token_regions(Graph(tuple(nodes), loss, _fingerprint(nodes), updates, constants))


def _meta(fx_node) -> TensorMeta:
    val = fx_node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise CaptureError(f"node {fx_node.name} ({fx_node.target}) does not produce a tensor "
                           f"(got {type(val).__name__})")
    return TensorMeta(tuple(int(s) for s in val.shape), str(val.dtype).removeprefix("torch."))


def _placeholder(fx_node, sources) -> Node:
    kind, source = sources[fx_node.name]
    if kind is None:
        raise CaptureError(f"input {fx_node.name}: unsupported input kind")
    return Node(fx_node.name, kind, "", (), _meta(fx_node), source=source)


def _skipped(fx_node) -> bool:
    """Checks that return nothing, and multi-output ops (each getitem becomes a node of its own)."""
    val = fx_node.meta.get("val")
    return _is_broadcast(fx_node) or isinstance(val, (tuple, list)) or (
        val is None and not fx_node.users)


def _item(fx_node, latest: dict[str, str]) -> Node | None:
    """`op(...)[i]` of a multi-output op: a node that calls the op and keeps output i."""
    if fx_node.target is not operator.getitem:
        return None
    source, index = fx_node.args
    return _op_node(source, latest, fx_node, index)


def _written(fx_node) -> str | None:
    """The tensor an in-place op (`add_`, `index_put_`, `detach_`...) writes, if it is one (a
    write into a view is made functional before: hidup.graph.functional)."""
    return fx_node.args[0].name if writes_in_place(fx_node) else None


def _op_node(fx_node, latest: dict[str, str], item=None, index: int | None = None
             ) -> Node:
    inputs: list[str] = []

    def to_ref(a):
        if isinstance(a, torch.fx.Node):
            inputs.append(latest.get(a.name, a.name))
            return Ref(len(inputs) - 1)
        return a

    args = pytree.tree_map(to_ref, tuple(fx_node.args))
    kwargs = pytree.tree_map(to_ref, dict(fx_node.kwargs))
    out = _meta(item or fx_node)
    in_metas = [_meta(a) for a in pytree.tree_leaves((fx_node.args, fx_node.kwargs))
                if isinstance(a, torch.fx.Node)]
    target = functional(fx_node.target) if _written(fx_node) is not None else fx_node.target
    op = str(target)
    flops = forward_flops(op, [m.shape for m in in_metas], out.shape, args)
    nbytes = sum(m.nbytes for m in in_metas) + out.nbytes
    return Node((item or fx_node).name, "op", op, tuple(inputs), out, flops, nbytes,
                target, args, kwargs, out_index=index, autocast=fx_node.meta.get("autocast"),
                layer=layer_of(fx_node))


def layer_of(fx_node) -> str:
    """The repeated block (a child of an nn.ModuleList or nn.Sequential) whose forward called
    the op: the innermost module's path up to its first number, 'layers.3' of
    'layers.3.mlp.experts.2' ("" for an op outside any such block, or with no module
    recorded). Activation checkpointing is decided per such block."""
    stack = fx_node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ""


def _is_broadcast(fx_node) -> bool:
    return fx_node.op == "call_function" and fx_node.target == torch.ops.aten.broadcast_tensors.default


def _broadcast_item(fx_node) -> Node | None:
    """`broadcast_tensors(xs)[i]` is `expand(xs[i], shape)`: so every node has one output."""
    if fx_node.target is not operator.getitem or not _is_broadcast(fx_node.args[0]):
        return None
    source = fx_node.args[0].args[0][fx_node.args[1]]
    out = _meta(fx_node)
    return Node(fx_node.name, "op", "aten.expand.default", (source.name,), out, float(out.numel),
                float(_meta(source).nbytes + out.nbytes), torch.ops.aten.expand.default,
                (Ref(0), list(out.shape)), layer=layer_of(fx_node))


_VIEWS = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")


def _keep_row_dims(nodes: list[Node]) -> list[Node]:
    """`view(linear(reshape(x, (a*b, k))), (a, b, n))`, as nn.MultiheadAttention writes its output
    projection, becomes a linear over (a, b, k): the same numbers, and b (the batch) can be split."""
    by_name = {n.name: n for n in nodes}
    users: dict[str, list[Node]] = {}
    for n in nodes:
        for i in set(n.inputs):
            users.setdefault(i, []).append(n)
    new: dict[str, Node] = {}
    for lin in nodes:
        if lin.op != "aten.linear.default" or len(users.get(lin.name, ())) != 1:
            continue
        flat, back = by_name[lin.inputs[0]], users[lin.name][0]
        if flat.op not in _VIEWS or len(users[flat.name]) != 1 or back.op not in _VIEWS:
            continue
        lead = _leading_dims(by_name[flat.inputs[0]].out.shape, flat.out.shape)
        if lead is None or back.out.shape != lead + lin.out.shape[-1:]:
            continue
        shape = lead + flat.out.shape[-1:]
        new[flat.name] = replace(flat, out=replace(flat.out, shape=shape), args=(Ref(0), list(shape)))
        new[lin.name] = replace(lin, out=replace(lin.out, shape=back.out.shape))
    return [new.get(n.name, n) for n in nodes]


def _leading_dims(x: tuple[int, ...], flat: tuple[int, ...]) -> tuple[int, ...] | None:
    """The leading dims of x (two or more) merged into flat's first dim, if flat is 2-d."""
    if len(flat) != 2:
        return None
    for k in range(2, len(x)):
        if math.prod(x[:k]) == flat[0] and math.prod(x[k:]) == flat[1]:
            return x[:k]
    return None


def _loss_name(fx_node) -> str:
    outs = pytree.tree_leaves(fx_node.args)
    if len(outs) != 1 or not isinstance(outs[0], torch.fx.Node):
        raise CaptureError(f"the model must return exactly one tensor (the loss), got {len(outs)}")
    val = outs[0].meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 0:
        raise CaptureError(f"the model must return a scalar loss; {outs[0].name} has shape "
                           f"{tuple(getattr(val, 'shape', ()))}")
    return outs[0].name


def _fingerprint(nodes: list[Node]) -> str:
    text = "\n".join(f"{n.name}|{n.kind}|{n.op}|{n.inputs}|{n.out}|{n.source}|{n.out_index}"
                     + ("" if n.autocast is None else f"|{n.autocast}") for n in nodes)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
