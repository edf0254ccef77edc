"""What an op's derivative reads: which of its inputs and whether its output autograd keeps from
the forward for the backward (a linear keeps its input and weight, an add nothing, an exp its
output). The memory model holds only those for the backward (hidup.planning.memory).

Found by running the op once on fake CPU tensors (no data, no memory; the CPU's kernels, so
attention is the fused kernel that keeps its inputs and output) under a saved-tensors hook and
matching what autograd packs with the op's inputs and output (or views of them). Tensors the op
keeps of its own (softmax's, a dropout mask, attention's log-sum-exp) are not its inputs or
output and are not counted. Where the op cannot run so, every input and the output
count as read."""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from hidup.graph.capture import Graph, Node, Ref


def backward_reads(graph: Graph, node: Node) -> tuple[bool, ...]:
    """Per input of `node`, then for its output: does the node's derivative read it? Cached
    per op, arguments and input shapes (the layers repeat)."""
    by_node = graph.__dict__.setdefault("_backward_reads_of", {})
    if node.name not in by_node:
        metas = node.in_metas(graph)
        key = node.op, repr(node.args), repr(node.kwargs), node.out_index, \
            tuple((m.shape, m.dtype) for m in metas)
        cache = graph.__dict__.setdefault("_backward_reads", {})
        if key not in cache:
            cache[key] = _probe(node, metas)
        by_node[node.name] = cache[key]
    return by_node[node.name]


def _probe(node: Node, metas) -> tuple[bool, ...]:
    every = (True,) * (len(metas) + 1)
    if node.target is None or not node.out.is_float:
        return every

    def place(a):
        return ins[a.index] if isinstance(a, Ref) else a
    packed: list[torch.Tensor] = []
    try:
        with FakeTensorMode(), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                lambda x: packed.append(x) or x, lambda x: x):
            ins = [torch.empty(m.shape, dtype=getattr(torch, m.dtype)) for m in metas]
            ins = [x.requires_grad_() if x.is_floating_point() else x for x in ins]
            out = node.target(*pytree.tree_map(place, node.args),
                              **pytree.tree_map(place, node.kwargs))
    except Exception:  # an op fake tensors cannot run: count everything as read
        return every
    if node.out_index is not None:
        out = out[node.out_index]
    if not isinstance(out, torch.Tensor):
        return every
    held = {id(_root(x)) for x in packed}
    return tuple(id(x) in held for x in ins) + (id(_root(out)) in held,)


def _root(x: torch.Tensor) -> torch.Tensor:
    """The tensor a view views (a saved weight is often its transpose), else itself."""
    return x._base if x._base is not None else x
