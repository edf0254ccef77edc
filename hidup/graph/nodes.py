"""The graph's data model: tensors' shapes and dtypes (TensorMeta), the nodes of a captured
graph (Node: a parameter, buffer, user input or one ATen op call, its tensor arguments written as
Ref) and the Graph. hidup.graph.capture builds it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return getattr(torch, self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_float(self) -> bool:
        return getattr(torch, self.dtype).is_floating_point

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Ref:
    """Stands in a node's args for its `index`-th tensor input."""

    index: int


def fill(template, tensors):
    """Replace every Ref in a node's args/kwargs by the matching tensor."""
    return pytree.tree_map(lambda a: tensors[a.index] if isinstance(a, Ref) else a, template,
                           is_leaf=lambda a: isinstance(a, Ref))


@dataclass(frozen=True)
class Node:
    """One graph node: a parameter, a buffer, a user input, or one ATen op call."""

    name: str
    kind: str  # 'param' | 'buffer' | 'input' | 'op'
    op: str  # e.g. 'aten.linear.default'; '' for placeholders
    inputs: tuple[str, ...]  # producer names of the tensor inputs, in argument order
    out: TensorMeta
    flops: float = 0.0
    bytes: float = 0.0
    target: Any = field(default=None, compare=False, repr=False)
    args: tuple = field(default=(), compare=False, repr=False)  # tensors replaced by Ref
    kwargs: dict = field(default_factory=dict, compare=False, repr=False)
    source: str = ""  # parameter / buffer fully-qualified name, or the user input's name
    out_index: int | None = None  # which output of a multi-output op this node is
    autocast: str | None = None  # inside a model's autocast block: "off" or its dtype
    #   ("bfloat16"), run so whatever the run's autocast (hidup.graph.regions); None: the run's
    layer: str = field(default="", compare=False)  # the repeated block it belongs to: the module
    #   path up to its first number ("blocks.3" of "blocks.3.fc1"); "" outside any (layer_of)

    def in_metas(self, graph: Graph) -> tuple[TensorMeta, ...]:
        return tuple(graph.node(i).out for i in self.inputs)

    def __str__(self) -> str:
        ins = ", ".join(self.inputs)
        return f"{self.name} = {self.op or self.kind}({ins}) -> {self.out}"


@dataclass(frozen=True)
class Graph:
    nodes: tuple[Node, ...]
    loss: str
    fingerprint: str
    # (buffer, op): forward writes the op's value into the buffer (BatchNorm's running statistics,
    # counters), as eager's in-place ops do; the step writes it back
    updates: tuple[tuple[str, str], ...] = ()
    # tensors that forward makes from nothing (torch.export lifts them as constants), by source:
    # the step reads them as it reads buffers
    constants: dict = field(default_factory=dict, compare=False, repr=False)
    # the dtypes a run at a precision gives the values (hidup.graph.dtypes.RunDtypes; its op
    # nodes' dtypes are then the run's); None: as captured
    run: object = field(default=None, compare=False, repr=False)
    _index: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._index.update({n.name: n for n in self.nodes})

    def node(self, name: str) -> Node:
        return self._index[name]

    def consumers(self, name: str) -> list[Node]:
        return [n for n in self.nodes if name in n.inputs]

    @property
    def ops(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "op"]

    @property
    def params(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "param"]

    @property
    def user_inputs(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "input"]

    @cached_property
    def from_inputs(self) -> frozenset[str]:
        """The tensors computed from the user's inputs (the rest: from weights and constants)."""
        found = {n.name for n in self.user_inputs}
        for node in self.ops:
            if any(t in found for t in node.inputs):
                found.add(node.name)
        return frozenset(found)

    @cached_property
    def readers(self) -> dict[str, frozenset[str]]:
        """Per node, the ops that read it."""
        found: dict[str, set[str]] = {n.name: set() for n in self.nodes}
        for node in self.ops:
            for t in node.inputs:
                found[t].add(node.name)
        return {name: frozenset(names) for name, names in found.items()}

    @cached_property
    def gradients(self) -> frozenset[str]:
        """The tensors that get a gradient in training: float ones that depend on a parameter
        (other than through a detach) and that the loss depends on."""
        needs = {n.name for n in self.params if n.out.is_float}
        for node in self.ops:
            if node.out.is_float and node.op != "aten.detach.default" and \
                    any(t in needs for t in node.inputs):
                needs.add(node.name)
        grads = {self.loss} & needs
        for node in reversed(self.ops):
            if node.name in grads:
                grads.update(t for t in node.inputs if t in needs)
        return frozenset(grads)

    def __str__(self) -> str:
        return "\n".join(str(n) for n in self.nodes)
