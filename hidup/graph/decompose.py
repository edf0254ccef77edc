"""Ops that capture rewrites into simpler ATen ops, so that each part gets sharding options of
its own and the collectives they need are the planner's to see and price.

`aten.batch_norm` in training (BatchNorm's forward in `train()` mode): the batch statistics are
means over every dim but the channels, so a batch split over ranks makes them Partial sums that
one small all-reduce completes (SyncBatchNorm's semantics: a data-parallel step equals one
device). The running statistics that eager BatchNorm writes in place become new values that the
step writes back into the buffers (`Graph.updates`).
"""
from __future__ import annotations

import torch
from torch._guards import detect_fake_mode

aten = torch.ops.aten


class Builder:
    """Inserts ATen calls before one FX node, each with its output's fake value as `val`."""

    def __init__(self, graph: torch.fx.Graph, before: torch.fx.Node, fake_mode):
        self.graph, self.before, self.fake_mode = graph, before, fake_mode

    def __call__(self, op, *args, **kwargs) -> torch.fx.Node:
        vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
        with self.fake_mode:
            val = op(*vals, **kwargs)
        with self.graph.inserting_before(self.before):
            node = self.graph.call_function(op, tuple(args), kwargs)
        node.meta["val"] = val
        for key in ("nn_module_stack", "autocast"):  # the module it came from
            if key in self.before.meta:  # (capture.layer_of) and its autocast block
                node.meta[key] = self.before.meta[key]
        return node


def _batch_norm(graph: torch.fx.Graph, node: torch.fx.Node, fake_mode) -> dict[str, torch.fx.Node]:
    """Replace one training batch_norm by its statistics and normalization; return {running
    buffer's placeholder name: the node of its new value}."""
    x, weight, bias, mean_buf, var_buf, _training, momentum, eps = node.args[:8]
    if not isinstance(momentum, (int, float)) or not isinstance(eps, (int, float)):
        raise ValueError(f"batch_norm {node.name}: momentum {momentum!r} and eps {eps!r} must be "
                         f"numbers (a BatchNorm with momentum=None averages over the batches "
                         f"seen, which HiDup does not run); give the module a momentum")
    val = x.meta["val"]
    channels = val.shape[1]
    dims = [0, *range(2, val.dim())]
    count = val.numel() // channels  # the elements behind each channel's statistics
    along = [channels] + [1] * (val.dim() - 2)  # a per-channel vector, broadcast over x
    b = Builder(graph, node, fake_mode)
    mean = b(aten.mean.dim, x, dims, True)
    centred = b(aten.sub.Tensor, x, mean)
    var = b(aten.mean.dim, b(aten.mul.Tensor, centred, centred), dims, True)
    out = b(aten.mul.Tensor, centred, b(aten.rsqrt.default, b(aten.add.Tensor, var, eps)))
    if weight is not None:
        out = b(aten.mul.Tensor, out, b(aten.view.default, weight, along))
    if bias is not None:
        out = b(aten.add.Tensor, out, b(aten.view.default, bias, along))
    written = {}
    for buf, stat, unbias in ((mean_buf, mean, 1.0), (var_buf, var, count / max(count - 1, 1))):
        if buf is None:
            continue
        new = b(aten.mul.Tensor, b(aten.view.default, stat, [channels]), momentum * unbias)
        written[buf.name] = b(aten.add.Tensor, b(aten.mul.Tensor, buf, 1.0 - momentum), new)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return written


CONSTANT_NUMEL = 1 << 20  # the largest constant evaluated at capture to recognise an index


def _constant(node, values: dict):
    """The value of an FX node that depends on no input, parameter or buffer (a tensor of at most
    CONSTANT_NUMEL elements, evaluated on the CPU), else None."""
    if not isinstance(node, torch.fx.Node):
        return node
    if node in values:
        return values[node]
    val, out = node.meta.get("val"), None
    if node.op == "call_function" and isinstance(val, torch.Tensor) and val.numel() <= CONSTANT_NUMEL:
        args = [_constant(a, values) if isinstance(a, torch.fx.Node) else a
                for a in node.args]
        if all(a is not None for a in args):
            kwargs = {k: v for k, v in node.kwargs.items() if k != "device"}
            try:
                out = node.target(*args, **kwargs)
            except Exception:
                out = None
    values[node] = out
    return out


def _counting_axis(index: torch.Tensor, size: int) -> int | None:
    """The one axis along which `index` is arange(size) (every other axis of length 1)."""
    if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int64, torch.int32) \
            or size < 2:
        return None
    axes = [a for a, n in enumerate(index.shape) if n != 1]
    if len(axes) != 1 or index.shape[axes[0]] != size:
        return None
    return axes[0] if torch.equal(index.flatten().cpu(), torch.arange(size)) else None


def _index_by_arange(graph: torch.fx.Graph, node: torch.fx.Node, values: dict) -> bool:
    """Replace `x[i0, i1, ...]` by a view of x where each i_d counts along dim d of x."""
    x, indices = node.args[:2]
    xval = x.meta["val"]
    if not indices or any(i is None for i in indices) or len(indices) > xval.dim():
        return False
    axes = []
    for d, index in enumerate(indices):
        axis = _counting_axis(_constant(index, values), xval.shape[d]) \
            if isinstance(index, torch.fx.Node) else None
        if axis is None:
            return False
        axes.append(axis + node.meta["val"].dim() - xval.dim() + len(indices)
                    - len(index.meta["val"].shape))  # the axis in the broadcast index shape
    if len(set(axes)) != len(axes):
        return False
    order = sorted(range(len(indices)), key=axes.__getitem__) + \
        list(range(len(indices), xval.dim()))
    b = Builder(graph, node, detect_fake_mode([xval]))
    out = x if order == list(range(xval.dim())) else b(aten.permute.default, x, order)
    out = b(aten.view.default, out, list(node.meta["val"].shape))
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    dead = [i for i in indices if not i.users]
    while dead:  # the constants that only this index read
        n = dead.pop()
        inputs = [a for a in n.all_input_nodes if a.op == "call_function"]
        graph.erase_node(n)
        dead += [a for a in inputs if not a.users and a not in dead]
    return True


def decompose(graph: torch.fx.Graph) -> dict[str, torch.fx.Node]:
    """Rewrite the ops above in an exported FX graph, in place; return {buffer placeholder
    name: the node of the value written into it}."""
    written: dict[str, torch.fx.Node] = {}
    values: dict = {}  # constants evaluated so far
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.batch_norm.default and len(node.args) > 5 and node.args[5]:
            fake_mode = detect_fake_mode([node.args[0].meta["val"]])
            written.update(_batch_norm(graph, node, fake_mode))
        elif node.target is aten.index.Tensor:
            _index_by_arange(graph, node, values)
    return written
