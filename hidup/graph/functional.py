"""In-place ops made functional at capture, so that every node of a Graph makes a new value.

An in-place op on a tensor (`x.add_(y)`) becomes its out-of-place twin (`functional`), whose
later readers read the new value (capture's bookkeeping). An in-place op on a view of another
tensor (`shifted[..., 1:] = ids[..., :-1]`, `buf[..., :n].copy_(a)`: a slice, then `copy_`)
becomes, as PyTorch's own functionalization writes it, the twin on the view's value, then that
value scattered back into the tensor the view was taken from (`slice_scatter`, `select_scatter`,
`diagonal_scatter`, `as_strided_scatter`; through each view of a chain), and every later reader
of that tensor reads the scattered one (`functional_view_writes`)."""
from __future__ import annotations

import torch
from torch._guards import detect_fake_mode

from hidup.graph.decompose import Builder

aten = torch.ops.aten

# a view op -> the op that writes a value of the view's shape back into the viewed tensor, with
# the view op's own arguments after (base, value)
SCATTER = {aten.slice.Tensor: aten.slice_scatter.default,
           aten.select.int: aten.select_scatter.default,
           aten.diagonal.default: aten.diagonal_scatter.default,
           aten.as_strided.default: aten.as_strided_scatter.default}
WHOLE = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default)
#   views of every element, in another shape: written back by viewing the value in the
#   viewed tensor's shape


class FunctionalError(ValueError):
    """An in-place write capture cannot make functional (the message names the node and op)."""


def functional(target):
    """The out-of-place twin of an in-place ATen op (`aten.add_.Tensor` -> `aten.add.Tensor`)."""
    packet = target.overloadpacket.__name__
    twin = getattr(getattr(aten, packet.removesuffix("_"), None), target._overloadname, None)
    if twin is None:
        raise FunctionalError(f"in-place op {target} has no out-of-place twin; write that part "
                              f"of forward without the in-place op")
    return twin


def writes_in_place(node: torch.fx.Node) -> bool:
    """Does the op write into its first argument (`add_`, `copy_`, `index_put_`, `fill_`...)?"""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments or not node.args:
        return False
    info = schema.arguments[0].alias_info
    return info is not None and info.is_write and not schema.arguments[0].kwarg_only \
        and isinstance(node.args[0], torch.fx.Node)


def is_view(node: torch.fx.Node) -> bool:
    """Does the op return a view of its first argument (its result aliases it)?"""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and bool(schema.returns) and \
        schema.returns[0].alias_info is not None and not writes_in_place(node)


def functional_view_writes(graph: torch.fx.Graph) -> dict[str, torch.fx.Node]:
    """Rewrite, in place, every in-place op of an exported FX graph that writes into a view:
    the twin on the view, scattered back through the chain of views into the viewed tensor,
    whose later readers read that. Return {buffer placeholder name: the node of the value
    written into it} for writes into a view of a buffer (capture writes them back, as
    Graph.updates). Fails with FunctionalError where a view is read after a write into the
    tensor it views (aliasing no functional graph keeps) or made by a view op with no scatter."""
    written: dict[str, torch.fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or not writes_in_place(node) or not is_view(node.args[0]):
            continue
        chain = [node.args[0]]  # the views, innermost first, down to the viewed tensor
        while is_view(chain[-1]):
            chain.append(chain[-1].args[0])
        base, views = chain[-1], chain[:-1]
        _check(graph, node, base, views)
        build = Builder(graph, node, detect_fake_mode([node.args[0].meta["val"]]))
        value = _copied(build, node) if node.target is aten.copy_.default else \
            build(functional(node.target), *node.args, **node.kwargs)
        node.replace_all_uses_with(value)  # a reader of what the in-place op returned: the view
        for view in views:  # innermost first: the new value of each level
            parent = view.args[0]
            value = build(aten.view.default, value,
                          list(parent.meta["val"].shape)) if view.target in WHOLE else \
                build(SCATTER[view.target], parent, value, *view.args[1:],
                      **view.kwargs)
        order = {n: i for i, n in enumerate(graph.nodes)}
        base.replace_all_uses_with(value, delete_user_cb=lambda user: order[user] > order[node])
        graph.erase_node(node)
        if base.op == "placeholder":
            written[base.name] = value
    return written


def _copied(build: Builder, node: torch.fx.Node) -> torch.fx.Node:
    """What `view.copy_(src)` leaves in the view: src in the view's dtype, broadcast to its
    shape (aten.copy itself has no derivative)."""
    view, src = node.args[0].meta["val"], node.args[1]
    if not isinstance(src, torch.fx.Node):
        raise FunctionalError(f"node {node.name}: copy_ from {src!r}, not a tensor")
    if src.meta["val"].dtype != view.dtype:
        src = build(aten._to_copy.default, src, dtype=view.dtype)
    if tuple(src.meta["val"].shape) != tuple(view.shape):
        src = build(aten.expand.default, src, list(view.shape))
    return src


def _check(graph: torch.fx.Graph, node: torch.fx.Node, base: torch.fx.Node, views) -> None:
    """The write can be made functional: each view has a scatter, and no view of the written
    tensor made before the write is read after it."""
    for view in views:
        if view.target not in SCATTER and view.target not in WHOLE:
            raise FunctionalError(
                f"node {node.name}: {node.target} writes into {view.name}, a view "
                f"({view.target}) that capture cannot write back into {base.name}; write that "
                f"part of forward out of place")
    order = {n: i for i, n in enumerate(graph.nodes)}
    stale = [u for v in (base, *views) for u in v.users
             if u is not node and is_view(u) and order[u] < order[node]
             and any(order[r] > order[node] for r in u.users)]
    if stale:
        raise FunctionalError(
            f"node {node.name}: {node.target} writes into a view of {base.name} that "
            f"{stale[0].name} ({stale[0].target}), a view made before the write, is read after; "
            f"take that view after the write, or write that part of forward out of place")
