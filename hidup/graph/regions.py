"""`torch.no_grad()` and `torch.autocast(...)` blocks inside a model's forward, as torch.export
writes them: a higher-order op (`wrap_with_set_grad_enabled`, `wrap_with_autocast`) that calls a
submodule holding the block's ops. Capture inlines each block's ops into the graph, so that they
are ops like any other (each with its own sharding options), and keeps what the block changed:

- a block with gradients off: its outputs are detached (no gradient flows back through them);
- an autocast block: each of its ops is tagged `meta["autocast"]`, "off" or the block's dtype
  ("bfloat16"), which the executor runs it under instead of the run's own autocast.

(Transformers' rotary embeddings compute under `torch.no_grad()` and, in some versions, under
`torch.autocast(enabled=False)`.)"""
from __future__ import annotations

import operator

import torch

aten = torch.ops.aten
SET_GRAD = "wrap_with_set_grad_enabled"
AUTOCAST = "wrap_with_autocast"


def _kind(node: torch.fx.Node) -> str | None:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    return node.target.name() if node.target.name() in (SET_GRAD, AUTOCAST) else None


def inline_regions(gm: torch.fx.GraphModule) -> int:
    """Inline every no_grad / autocast block of `gm` (blocks inside blocks too), in place;
    returns how many were inlined."""
    count = 0
    for node in list(gm.graph.nodes):
        kind = _kind(node)
        if kind is None:
            continue
        # args: (enabled, sub, *operands) / (device, dtype, enabled, cache, sub, *operands)
        at = 1 if kind == SET_GRAD else 4
        getter, operands = node.args[at], node.args[at + 1:]
        sub = getattr(gm, getter.target)
        count += inline_regions(sub) + 1
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        with gm.graph.inserting_before(node):
            marker = gm.graph.call_function(operator.add, (0, 0))  # where the block starts
            outs = gm.graph.graph_copy(sub.graph, dict(zip(placeholders, operands)))
        first_new = marker.next
        gm.graph.erase_node(marker)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        if kind == AUTOCAST:
            _, dtype, enabled, _ = node.args[:4]
            mode = str(dtype).removeprefix("torch.") if enabled else "off"
            block = first_new
            while block is not node:  # inner blocks keep their own tag
                block.meta.setdefault("autocast", mode)
                block = block.next
        elif not node.args[0]:  # gradients off: nothing flows back through the outputs
            outs = [_detached(gm.graph, node, out) for out in outs]
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise ValueError(f"{node.name} ({kind}) is used by {user.name} ({user.target}), "
                                 f"not by indexing its outputs")
            user.replace_all_uses_with(outs[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not getter.users:
            gm.graph.erase_node(getter)
            if all(n.target != getter.target for n in gm.graph.nodes if n.op == "get_attr"):
                delattr(gm, getter.target)  # no other block calls the same submodule
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _detached(graph: torch.fx.Graph, before: torch.fx.Node, out):
    """`out.detach()` where it is a floating-point tensor, else `out` as it is."""
    val = out.meta.get("val") if isinstance(out, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not val.is_floating_point():
        return out
    with graph.inserting_before(before):
        node = graph.call_function(aten.detach.default, (out,))
    node.meta["val"] = val.detach()
    if "autocast" in out.meta:
        node.meta["autocast"] = out.meta["autocast"]
    return node
