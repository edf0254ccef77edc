"""What is done to a traced step (hidup.runtime.step) before and around its runs: `simplify` drops
what only the tracing needed; `with_hooks` calls a function between the graph nodes of consecutive
tasks (profiler labels, per-task clocks for calibration.ops); `inductor_segments` compiles the
computation between communication calls with Inductor and leaves every collective and wait in the
Program's order; `communication_order` reads that order back."""
from __future__ import annotations

import copy
import time

import torch
from torch.fx.passes.split_module import split_module

_aten = torch.ops.aten


def simplify(gm: torch.fx.GraphModule) -> None:
    """Drop what only the tracing needed, as every op left costs a call each step: views to the
    same shape, views of views (one view of the first input does), transposes of transposes, and
    values nothing reads (collectives and in-place updates always stay). (Detaches, which cut
    the per-node autograd graphs while recording, are not recorded: hidup.runtime.record.)"""
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        source = node.args[0] if node.args else None
        if node.target is _aten.view.default and _shape(node) == _shape(source):
            node.replace_all_uses_with(source)
            gm.graph.erase_node(node)
        elif node.target is _aten.view.default and _is(source, _aten.view.default) and \
                source.args[0].meta["val"].is_contiguous():
            node.args = (source.args[0],) + node.args[1:]
        elif node.target is _aten.t.default and _is(source, _aten.t.default):
            node.replace_all_uses_with(source.args[0])
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or _is_communication(n))
    _keep_until_waited(gm.graph)
    gm.recompile()


def _keep_until_waited(graph: torch.fx.Graph) -> None:
    """The generated code frees a value right after its last use; a collective's input is read
    by the communication thread until the collective is waited for, so it is used once more
    right after that wait (as async work in torch.distributed holds its tensors)."""
    issued = {}
    for node in list(graph.nodes):
        if not _is_communication(node):
            continue
        if node.target is torch.ops._c10d_functional.wait_tensor.default:
            source = issued.pop(node.args[0], None)
            if source is not None:
                with graph.inserting_after(node):
                    graph.call_function(_held, (source, node))
        else:
            issued[node] = node.args[0]


def _held(*values) -> None:
    """Nothing: its call keeps `values` alive up to here."""


def _is(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _shape(node) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def communication_order(gm: torch.nn.Module) -> list[str]:
    """The functional collectives and waits in the order the step calls them ('all_reduce',
    'wait_tensor', ...), looking into the stretches of a segmented (compiled) step."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            sub = gm.get_submodule(node.target)
            out += communication_order(getattr(sub, "gm", sub))
        elif _is_communication(node):
            out.append(node.target._opname.removesuffix("_out").rstrip("_"))  # in place
    return out


def with_hooks(gm: torch.fx.GraphModule, enter, leave) -> torch.fx.GraphModule:
    """A copy of the graph that calls `enter(task, standin)` before each run of nodes recorded in
    one task (and part: a collective's stand-in apart from its packing) and `leave(handle)` after
    it: profiler labels, or per-task timing for calibration."""
    out = copy.deepcopy(gm)
    graph, handle, current = out.graph, None, None
    for node in list(graph.nodes):
        custom = node.meta.get("custom", {})
        part = (custom.get("task"), bool(custom.get("standin"))) if node.op == "call_function" \
            else None
        if part == current:
            continue
        with graph.inserting_before(node):
            if handle is not None:
                graph.call_function(leave, (handle,))
            handle = graph.call_function(enter, part) if part is not None else None
        current = part
    out.recompile()
    return out


class TaskClock:
    """Per-task wall time of a graph run with `with_hooks` (on the CPU, where ops are synchronous):
    `seconds[(task, standin)]` lists each run of that part; `first` is when the first part
    started since it was last set to None, `last` when the latest part ended."""

    def __init__(self):
        self.seconds: dict[tuple[int, bool], list[float]] = {}
        self.first: float | None = None
        self.last: float | None = None

    def enter(self, task, standin):
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        return task, standin, now

    def leave(self, handle) -> None:
        task, standin, start = handle
        self.last = time.perf_counter()
        self.seconds.setdefault((task, standin), []).append(self.last - start)


def _is_communication(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", "") == "_c10d_functional"


def inductor_segments(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The step with the computation between two communication calls compiled by Inductor, each
    stretch on its own, and every collective and wait left where the Program put it: Inductor
    compiling the whole graph schedules a wait right after its collective, which undoes Duplex."""
    segment, marks = 0, {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if _is_communication(node):
            segment += 1
            marks[node] = segment
            segment += 1
        else:
            marks[node] = segment
    top = split_module(gm, None, lambda node: marks[node], keep_original_order=True)
    for name, sub in list(top.named_children()):
        if not any(_is_communication(n) for n in sub.graph.nodes):
            setattr(top, name, _Inductor(sub))
    return top


class _Inductor(torch.nn.Module):
    """One stretch of the step, compiled by Inductor on its first call (from its real inputs).
    Inductor compiles graphs that return a tuple: a stretch with one output returns it in one
    (split_module returns it bare; torch 2.13's tuple_return does the same, 2.11 has none)."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__()
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        self.bare = not isinstance(out.args[0], (tuple, list))
        if self.bare:
            out.args = ((out.args[0],),)
            gm.recompile()
        self.gm, self.run = gm, None

    def forward(self, *args):
        if self.run is None:
            from torch._inductor.compile_fx import compile_fx  # seconds to import: on use

            self.run = compile_fx(self.gm, list(args))
        result = self.run(*args)
        return result[0] if self.bare else result
