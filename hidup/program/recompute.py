"""Activation checkpointing in the Program, for hidup.program.lowering.Lowering: in a layer of
Strategy.recompute, the forward of each op recomputed keeps nothing for the backward, and right
before the layer's first backward task of a micro-batch its ops run again ('recompute' tasks, in
forward order, with the conversions the layer's own ops read), writing the same value keys; the
backward reads those. Its ops held once per step after a join of the micro-batches (a router's
sort) run again once, before the first backward of those, from the join kept from the forward.
A weight freed after the forward is read as gathered again for the backward.

The executor runs a forward task whose (node, micro-batch) has a recompute task without autograd
(hidup.runtime.step); the memory model frees its output after its last read in the forward and
counts the recomputed value as a new one (hidup.planning.memory); the estimate and the simulator
time a recompute task as its forward (hidup.planning.costs.kernel_key)."""
from __future__ import annotations

import torch

from hidup.graph import ops
from hidup.graph.capture import Node
from hidup.graph.placement import plain_option, same
from hidup.graph.saved import backward_reads
from hidup.program.tasks import Compute, vkey

RECOMPUTE = "recompute"  # the phase of a recomputed forward task and of its conversions


def nondeterministic(node: Node) -> bool:
    """Does the op draw random numbers (dropout)? Run again, it would draw others. An op that
    may (its schema is tagged so) but whose dropout probability is 0 or whose `train` is False
    (eval-mode dropout, attention without dropout) draws none; an argument the call leaves out
    has its schema's default (attention's dropout_p: 0, which a captured graph does not
    write)."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    arguments = schema.arguments if schema else ()
    given = {a.name: a.default_value for a in arguments if a.has_default_value()}
    given.update(zip((a.name for a in arguments), node.args))
    given.update(node.kwargs)
    chance = [given[name] for name in ("p", "dropout_p") if name in given]
    return not (given.get("train") is False or chance and all(
        isinstance(c, (int, float)) and c == 0 for c in chance))


class Recomputation:
    """Lowering's activation-checkpointing part. It reads the Lowering's g, s, has_grad, once,
    mbs_split, regather and uses, and calls its add, wait_for, in_keys, kernel, gather_for,
    gathered_key, mb_converted and convert_for_consumers."""

    def plan_recompute(self) -> None:
        """Which ops each recomputed layer runs again: {layer: [nodes in forward order]}; and
        in a layer recomputed selectively, the compute-heavy ops whose outputs are kept: those
        whose derivative reads only their inputs (matmuls; `again`: their backward
        differentiates them again from their recomputed inputs), and those whose derivative
        reads their output too (attention), run once as ordinary ops, keeping what their
        backward reads (their inputs, their output, what they save of their own)."""
        self.recomputed: dict[str, list[Node]] = {}
        self.again: set[str] = set()
        for node in self.g.ops:
            layer = node.layer
            if layer not in self.s.recompute and layer not in self.s.selective or \
                    not self.recomputable(node):
                continue
            if layer in self.s.selective and self.heavy(node):
                if not backward_reads(self.g, node)[-1]:  # a matmul: its output kept, and
                    self.again.add(node.name)  # its backward differentiates it again
                # else (attention) an ordinary op: its forward keeps what its backward reads
            else:
                self.recomputed.setdefault(layer, []).append(node)
        self.layer_of = {n.name: layer for layer, nodes in self.recomputed.items()
                         for n in nodes}
        self.layer_of.update({name: self.g.node(name).layer for name in self.again})
        self.recomputed_at: set[tuple[str, int | None]] = set()

    def recomputable(self, node: Node) -> bool:
        """An op whose backward runs, drawing no random numbers, not the loss, and run per
        micro-batch or once per step after a join of them (the joined value, kept from the
        forward, is what its recomputation reads: Lowering.after_join), reading no micro-batch
        sliced from a value held once per step (made again only by the forward's slice)."""
        mb_in = self.mbs_split.options[node.name].inputs
        return (node.name in self.has_grad and node.name != self.g.loss
                and (node.name not in self.once or node.name in self.after_join)
                and not nondeterministic(node)
                and not any(self.mb_converted(t, q) and not self.joined(t, q)
                            for t, q in zip(node.inputs, mb_in)))

    def heavy(self, node: Node) -> bool:
        """Does selective recomputation keep the op's output: a compute-heavy op (at least 16 FLOPs
        per output element: a matmul, attention)?"""
        return node.flops >= 16 * max(node.out.numel, 1)

    def recompute_before(self, node: Node, m: int | None) -> None:
        """Before node's backward for micro-batch m: its layer's forward again, once; for m None
        (an op once per step, after a join) the layer's ops once per step, before its first
        backward of them, else the layer's ops of each micro-batch, before its first of those."""
        layer = self.layer_of.get(node.name)
        if layer is None or (layer, m) in self.recomputed_at:
            return
        self.recomputed_at.add((layer, m))
        for n in self.recomputed.get(layer, ()):
            if (n.name in self.once) == (m is None):
                self.recompute_node(n, m, layer)

    def recompute_node(self, node: Node, m: int | None, layer: str) -> None:
        opt = self.s.options[node.name]
        self.gather_for(node.inputs, "bwd")
        keys = tuple(self.gathered_key(t, "bwd") if t in self.regather and same(p, self.whole(t))
                     else key
                     for t, p, key in zip(node.inputs, opt.inputs, self.in_keys(node, m)))
        for key in keys:
            self.wait_for(key)
        ins, out, flops, nbytes, partial, _ = self.kernel(node)
        reads, keeps = self.saves(node, keys, ins)
        self.add(Compute(len(self.tasks), node.name, node.op, RECOMPUTE, m, flops, nbytes, ins,
                         out, keys, (vkey(node.name, opt.output, m),), opt, partial,
                         reads=reads, keeps=keeps, alias=self.aliases(node),
                         scratch=self.scratch(node, ins, backward=False),
                         inner=ops.inner_collectives(node, plain_option(opt), ins)))
        inside = {p for consumer, i, p in self.uses[node.name]
                  if consumer is not None and self.layer_of.get(consumer.name) == layer
                  and not self.mb_converted(node.name,  # a join's reader reads the kept join
                                            self.mbs_split.options[consumer.name].inputs[i])}
        # what the layer's recomputed ops read converted
        self.convert_for_consumers(node.name, m, phase=RECOMPUTE, only=inside)


def dropped(program) -> frozenset[int]:
    """The tasks of a Program that the executor's traced step drops as dead code, which neither
    run nor are issued: its recomputations whose output nothing reads (kept with the program)."""
    if "_dropped" not in program.__dict__:
        program.__dict__["_dropped"] = unread_recomputations(program.tasks) if any(
            getattr(t, "phase", "") == RECOMPUTE for t in program.tasks) else frozenset()
    return program.__dict__["_dropped"]


def unread_recomputations(tasks) -> frozenset[int]:
    """The ids of the recompute tasks whose output no later task reads: what a backward reads of
    its forward (Compute.reads: a linear its input and weight, an add nothing), what any other
    task reads, and what the recompute tasks that are read themselves read (found from the last
    task back). The executor's traced step drops them as dead code (an add closing a layer, or a
    matmul whose output only such an add read), so they take no time."""
    latest: dict[tuple[str, int | None], Compute] = {}
    forward_of: dict[int, Compute | None] = {}
    for t in tasks:
        if isinstance(t, Compute) and t.phase in ("fwd", RECOMPUTE):
            latest[t.node, t.mb] = t
        elif isinstance(t, Compute) and t.phase == "bwd":
            forward_of[t.id] = latest.get((t.node, t.mb))
    live: set[str] = set()
    unread = set()
    for t in reversed(tasks):
        outputs = [key for key in getattr(t, "outputs", ()) if key]
        if isinstance(t, Compute) and t.phase == RECOMPUTE and not live.intersection(outputs):
            unread.add(t.id)
            continue
        live.difference_update(outputs)
        live.update(_read(t, forward_of.get(getattr(t, "id", None))))
    return frozenset(unread)


def _read(task, forward: Compute | None) -> tuple[str, ...]:
    """The value keys a task reads: a backward that does not differentiate again, its output's
    gradient and what its derivative reads of the forward's inputs and output."""
    inputs = getattr(task, "inputs", ())
    if not (isinstance(task, Compute) and task.phase == "bwd" and inputs) or task.again \
            or forward is None or forward.reads is None:
        return inputs
    reads = forward.reads
    return derivative_reads(inputs, reads) + ((forward.outputs[0],) if reads[-1] else ())


def derivative_reads(inputs: tuple[str, ...], reads: tuple[bool, ...]) -> tuple[str, ...]:
    """Of a backward's input keys (its output's gradient, then its forward's inputs), those its
    derivative reads (`reads`: Compute.reads of the forward, one per input, then its output)."""
    return inputs[:1] + tuple(key for key, read in zip(inputs[1:], reads) if read)
