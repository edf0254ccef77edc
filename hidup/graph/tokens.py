"""Per-token regions: stretches of a graph that reorder the batch's rows and put them back, such
as a mixture-of-experts router that sorts its (token, expert) pairs by expert, runs the experts
on the sorted rows and scatters the results back to token order (`transformers`' Mixtral- and
Qwen-MoE-style layers).

Each op of such a region, taken alone, needs every row at once (a sort, a histogram of the
experts' rows, indices into the whole batch), so no op-level option lets a rank or a micro-batch
keep its own rows through it: without this pass they are gathered whole, on every rank, for each
layer. Taken together the region is per token: its output row for a token depends only on that
token's input rows. `per_token_regions` finds each such region and puts one node in its place
(op TOKENS), whose options (hidup.graph.ops.gating) run it on any part of the rows: a rank's, a
micro-batch's.

A region starts at a sort of rows (SORTS) and grows forward over every op that reads what it
made, until one value alone is left for the ops after it: its output. It grows back over the
integer values it reads (indices, expert ids), to the float values they are computed from, so
that it can be run on random rows. Factories it alone reads (arange) join it: their sizes are the
rows'. Run on part of the rows, each integer argument equal to a row count of its inputs (the
rows, or the rows times the experts each token picks) is scaled with them, unless it also equals
a dim of a weight it reads (the experts' count as a histogram's bins, where the captured rows
happen to be as many).

What makes this safe is a check, not a list of models: the region is run once on random inputs
of a few rows and once on their first half, and must give the first half of the rows alike, up
to rounding (and the dtype and shape captured, scaled); a region that fails stays as it was."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

import torch
from torch.utils import _pytree as pytree

from hidup.graph.flops import GROUPED_MM
from hidup.graph.nodes import Graph, Node, Ref, TensorMeta, fill

TOKENS = "hidup.tokens"  # the op of a region's node
SORTS = frozenset(("aten.sort.default", "aten.sort.stable", "aten.argsort.default",
                   "aten.argsort.stable"))
PROBE_ROWS = 8  # rows of the smallest input in the check's first run (half in its second)
_EXPANDED = 2 ** 22  # a whole input with more elements is checked with a broadcast random one
MAX_CANDIDATES = 4  # regions checked per sort, smallest first


@dataclass(frozen=True, eq=False)
class Region:
    """The ops of one per-token region, in graph order, and what it reads."""

    nodes: tuple[Node, ...]
    inputs: tuple[str, ...]  # the tensors it reads from outside, in its node's input order
    shapes: tuple[tuple[int, ...], ...]  # theirs, as captured
    rowwise: tuple[bool, ...]  # per input: split with the rows (else whole: weights)
    rows: int  # the smallest row count of its row-wise inputs, as captured
    flops: float  # its ops' forward FLOPs, as captured
    experts: tuple[bool, ...]  # per input: the experts' weights of a grouped matmul inside
    # per input: does the output's gradient reach it (an argmax's scores do not); set by the
    # check, and read by the graph through a detach before the region where it does not
    differentiable: tuple[bool, ...] = ()

    def fraction(self, in_shapes) -> float:
        """The part of the captured rows that inputs of these shapes hold."""
        i = self.rowwise.index(True)
        return in_shapes[i][0] / self.shapes[i][0]

    def experts_held(self, in_shapes, sent: bool = False) -> float:
        """The part of its experts' work that inputs of these shapes give a rank for its rows:
        the part of the experts they hold (each rank computes its experts' rows only), but 1
        where its rows are `sent` to their experts' ranks (each rank computes, on average, as
        many rows as it sends: hidup.graph.ops.dispatch)."""
        if sent:
            return 1.0
        return min((shape[0] / s[0] for shape, s, e in zip(in_shapes, self.shapes, self.experts)
                    if e), default=1.0)

    def flops_on(self, in_shapes, sent: bool = False) -> float:
        """Its ops' FLOPs on inputs of these shapes: its rows' part of the captured ones, of its
        experts' grouped matmuls only the part the rank computes (experts_held)."""
        held = self.experts_held(in_shapes, sent)
        return self.fraction(in_shapes) * (self.flops - self.expert_flops * (1.0 - held))

    @cached_property
    def expert_matmuls(self) -> tuple[Node, ...]:
        """Its grouped matmuls that read its experts' weights (the inputs `experts` marks)."""
        weights = {t for t, e in zip(self.inputs, self.experts) if e}
        return tuple(n for n in self.nodes if n.op in GROUPED_MM and n.inputs[1] in weights)

    @cached_property
    def expert_flops(self) -> float:
        """The captured FLOPs of its experts' grouped matmuls."""
        return sum(n.flops for n in self.expert_matmuls)

    def share(self, in_shapes, sent: bool = False) -> float:
        """The part of its captured work that inputs of these shapes make (what it keeps for its
        backward): its rows' part, times the part of its experts' work (experts_held)."""
        return self.fraction(in_shapes) * self.experts_held(in_shapes, sent)

    def scale(self, args, fraction: float):
        """Integer arguments equal to a row count (the rows times m) scaled by `fraction`, but
        those equal to a size of a whole input too: a weight's dim (the experts' count, as a
        histogram's bins) that the captured rows happen to equal is no row count. (Where such an
        argument is one after all, the region fails its check and stays as it was.)"""
        counts = self.row_counts
        return pytree.tree_map(
            lambda a: round(a * fraction) if type(a) is int and a in counts else a, args)

    @cached_property
    def shape_of(self) -> dict[str, tuple[int, ...]]:
        """The captured shape of each value it reads or makes, by name."""
        return {**dict(zip(self.inputs, self.shapes)), **{n.name: n.out.shape for n in self.nodes}}

    @cached_property
    def row_counts(self) -> frozenset[int]:
        """The integers `scale` takes for row counts: the rows times 1..64, but the dims of its
        whole (not row-wise) inputs, the weights'."""
        weights = {d for s, r in zip(self.shapes, self.rowwise) if not r for d in s}
        return frozenset(self.rows * m for m in range(1, 65)) - weights

    def __call__(self, *tensors, run=None):
        """The region's output for these inputs (their rows a part of the captured ones).
        `run(node, inputs, split)` may compute a node instead (None: the node runs itself);
        `split` maps the experts' weights split over ranks to this rank's expert count
        (hidup.graph.ops.gating runs their grouped matmuls on this rank's experts)."""
        fraction = self.fraction([t.shape for t in tensors])
        values = dict(zip(self.inputs, tensors))
        split = {t: x.shape[0] for t, x, e, s in zip(self.inputs, tensors, self.experts,
                                                     self.shapes) if e and x.shape[0] < s[0]}
        device = tensors[0].device
        for node in self.nodes:
            ins = [values[t] for t in node.inputs]
            out = run(node, ins, split) if run is not None else None
            if out is None:
                args, kwargs = (node.args, node.kwargs) if fraction == 1 else \
                    (self.scale(node.args, fraction), self.scale(node.kwargs, fraction))
                if "device" in kwargs:  # a factory makes its tensor where the region runs
                    kwargs = {**kwargs, "device": device}  # (not where the model was captured)
                out = _call(node, fill(args, ins), fill(kwargs, ins))
            values[node.name] = out
        return values[self.nodes[-1].name]

    def __repr__(self) -> str:  # what it computes, alike for the same ops on the same shapes
        return "Region(" + "; ".join(f"{n.op}{list(n.out.shape)}" for n in self.nodes) + ")"

    def __str__(self) -> str:
        return f"{len(self.nodes)} ops ({', '.join(dict.fromkeys(n.op for n in self.nodes))})"


def _call(node: Node, args, kwargs):
    """The node's op on these arguments. A histogram of integers (what a router counts its
    experts' rows with on a GPU) is counted on a float copy where the tensor's device has no
    integer kernel (the CPU's), and given back in the integer dtype: the same counts."""
    x = args[0] if args else None
    if node.op == "aten.histc.default" and isinstance(x, torch.Tensor) and \
            not x.dtype.is_floating_point and x.device.type == "cpu":
        args = (x.float(), *args[1:])
        return node.target(*args, **kwargs).to(x.dtype)
    out = node.target(*args, **kwargs)
    return out[node.out_index] if node.out_index is not None else out


def run_region(region: Region, *tensors):
    """The TOKENS node's target: its Region run on the tensors (the node's args)."""
    return region(*tensors)


def per_token_regions(graph: Graph) -> Graph:
    """`graph` with each per-token region replaced by one TOKENS node named as its output (the
    same graph where it has none)."""
    tried: set[str] = set()  # sorts that start no region
    while True:
        seed = next((n for n in graph.ops if n.op in SORTS and n.name not in tried), None)
        if seed is None:
            return graph
        readers = graph.readers
        region = next(filter(None, (_checked(graph, r) for r in _grow(graph, seed, readers))),
                      None)
        if region is None:
            tried.add(seed.name)
        else:
            graph = _replace(graph, region, readers)


def _grow(graph: Graph, seed: Node, readers):
    """The candidate regions that start at `seed`, smallest first (at most MAX_CANDIDATES, all
    in the seed's layer): every op after it that reads what it made, up to an op whose value
    alone the ops outside read."""
    ops = graph.ops
    start = next(i for i, n in enumerate(ops) if n.name == seed.name)
    inside: set[str] = set()
    tried = 0
    for node in ops[start:]:
        if node.layer != seed.layer or tried == MAX_CANDIDATES:
            return  # a region stays inside its repeated block
        if node.name == seed.name or any(t in inside for t in node.inputs) or \
                node.op in SORTS and node.inputs == seed.inputs:
            inside.add(node.name)
        else:
            continue
        live = {t for t in inside if readers[t] - inside}
        if live == {node.name} and node.out.shape and node.op not in SORTS:
            region = _region(graph, _pulled_in(graph, inside, readers), node.name)
            if region is not None:
                tried += 1
                yield region


def _pulled_in(graph: Graph, inside: set[str], readers) -> set[str]:
    """The region with the integer values it reads computed inside it, back to float ones, and
    the factories only it reads."""
    grown, todo = set(inside), list(inside)
    while todo:
        for t in graph.node(todo.pop()).inputs:
            producer = graph.node(t)
            if t in grown or producer.kind != "op":
                continue
            if producer.inputs and not producer.out.is_float or \
                    not producer.inputs and readers[t] <= grown:
                grown.add(t)
                todo.append(t)
    return grown


def _region(graph: Graph, inside: set[str], output: str) -> Region | None:
    nodes = tuple(n for n in graph.ops if n.name in inside)
    if nodes[-1].name != output:
        return None
    reads = tuple(dict.fromkeys(t for n in nodes for t in n.inputs if t not in inside))
    rowwise = tuple(t in graph.from_inputs for t in reads)
    shapes = tuple(graph.node(t).out.shape for t in reads)
    if not any(rowwise) or any(r and not s for s, r in zip(shapes, rowwise)):
        return None
    rows = min(s[0] for s, r in zip(shapes, rowwise) if r)
    if any(r and s[0] % rows for s, r in zip(shapes, rowwise)):
        return None
    experts = tuple(
        not r and len(s) == 3 and any(n.op in GROUPED_MM and n.inputs[1:2] == (t,) and
                                      len(n.inputs) == 3 for n in nodes)
        for t, s, r in zip(reads, shapes, rowwise))
    return Region(nodes, reads, shapes, rowwise, rows, sum(n.flops for n in nodes), experts)


_CHECKED: dict[tuple, tuple | None] = {}  # a model's repeated layers are checked once


def _checked(graph: Graph, region: Region) -> Region | None:
    """`_check`, once per region of the same ops on the same shapes."""
    key = (repr(region), region.shapes, region.rowwise,
           tuple(graph.node(t).out.dtype for t in region.inputs))
    if key not in _CHECKED:
        found = _check(graph, region)
        _CHECKED[key] = None if found is None else found.differentiable
    differentiable = _CHECKED[key]
    return None if differentiable is None else replace(region, differentiable=differentiable)


def _check(graph: Graph, region: Region) -> Region | None:
    """Run on random rows, and on their first half: the first half alike (the region, with
    which of its inputs the output's gradient reaches; None where it is no region)."""
    gen = torch.Generator().manual_seed(0)
    fraction = PROBE_ROWS / region.rows
    if fraction > 1 or region.rows % PROBE_ROWS:
        return None
    probe = [_random(graph.node(t).out, gen, fraction if r else None)
             for t, r in zip(region.inputs, region.rowwise)]
    half = [x[:x.shape[0] // 2] if r else x for x, r in zip(probe, region.rowwise)]
    out_meta = region.nodes[-1].out
    asked = [x.dtype.is_floating_point and (r or x.numel() <= _EXPANDED)
             for x, r in zip(probe, region.rowwise)]  # a large weight is read by a matmul
    try:
        with torch.no_grad():
            part = region(*half, run=_grouped_rows)
        probe = [x.detach().requires_grad_(a) for x, a in zip(probe, asked)]
        full = region(*probe, run=_grouped_rows)
        floats = [x for x in probe if x.requires_grad]
        reached = torch.autograd.grad(full.float().sum(), floats, allow_unused=True) \
            if full.requires_grad and floats else [None] * len(floats)
        full = full.detach()
    except Exception:
        return None
    found = iter(g is not None for g in reached)
    differentiable = tuple(next(found) if a else x.dtype.is_floating_point
                           for x, a in zip(probe, asked))
    want = tuple(int(s * fraction) if i == 0 else s for i, s in enumerate(out_meta.shape))
    if tuple(full.shape) != want or str(full.dtype).removeprefix("torch.") != out_meta.dtype \
            or full.shape[0] % 2 or tuple(part.shape) != (full.shape[0] // 2, *full.shape[1:]):
        return None
    first = full[:full.shape[0] // 2].double()  # alike up to rounding: a matmul's sums may run
    #   in another order on fewer rows
    alike = torch.allclose(first, part.double(), rtol=1e-3,
                           atol=1e-4 * float(first.abs().max()) if first.numel() else 0.0)
    return replace(region, differentiable=differentiable) if alike else None


def _grouped_rows(node: Node, ins, split):
    """A grouped matmul of the check, expert by expert, as the op's schema defines it (the rows
    that offs gives each expert times its weight, zero after the last); None for other nodes
    (they run themselves). The op's own backward would make the whole weight's gradient even
    where the check does not ask for it (for a full-size model's experts, gigabytes of zeros),
    and a product by a broadcast probe weight (`_random`: one number per expert) would copy the
    whole weight; such a product is the rows' sums times that number."""
    if node.op not in GROUPED_MM or len(ins) != 3 or ins[0].dim() != 2 or ins[1].dim() != 3:
        return None
    x, weight, offs = ins
    ends = [0, *offs.tolist()]
    spans = list(enumerate(zip(ends, ends[1:])))
    if weight.stride()[1:] == (0, 0):
        rows = [(x[a:b].sum(1, keepdim=True) * weight[e, :1, :1]).expand(-1, weight.shape[2])
                for e, (a, b) in spans]
    else:
        rows = [x[a:b] @ weight[e] for e, (a, b) in spans]
    rows.append(x.new_zeros(x.shape[0] - ends[-1], weight.shape[2]))
    return torch.cat(rows)


def _random(meta: TensorMeta, gen, fraction: float | None) -> torch.Tensor:
    """A random tensor of `meta`, its rows scaled by `fraction` (None: a whole input, broadcast
    from its first dim where it is large)."""
    shape = list(meta.shape)
    if fraction is not None and shape:
        shape[0] = int(shape[0] * fraction)
    dtype = getattr(torch, meta.dtype)
    small = [s if i == 0 else 1 for i, s in enumerate(shape)] \
        if fraction is None and math.prod(shape) > _EXPANDED else shape
    if dtype.is_floating_point:
        x = torch.randn(small, generator=gen).to(dtype)
    elif dtype == torch.bool:
        x = torch.rand(small, generator=gen) > 0.5
    else:
        x = torch.randint(0, 2, small, generator=gen, dtype=dtype)
    return x.expand(shape)


def _replace(graph: Graph, region: Region, readers) -> Graph:
    """The graph with the region's ops replaced by its TOKENS node, named as its output (an op
    it computes again for itself that others read stays for them)."""
    last = region.nodes[-1]
    detached = [Node(f"{t}_detached", "op", "aten.detach.default", (t,), graph.node(t).out,
                     target=torch.ops.aten.detach.default, args=(Ref(0),), layer=last.layer)
                for t, d in zip(region.inputs, region.differentiable)
                if graph.node(t).out.is_float and not d]
    renamed = {n.inputs[0]: n.name for n in detached}
    node = Node(last.name, "op", TOKENS, tuple(renamed.get(t, t) for t in region.inputs),
                last.out, flops=region.flops, bytes=sum(n.bytes for n in region.nodes),
                target=run_region, args=(region, *(Ref(i) for i in range(len(region.inputs)))),
                layer=last.layer)
    inside = {n.name for n in region.nodes}
    gone = {n for n in inside if readers[n] <= inside}
    nodes = []
    for n in graph.nodes:
        if n.name == last.name:
            nodes += [*detached, node]
        elif n.name not in gone:
            nodes.append(n)
    return replace(graph, nodes=tuple(nodes), _index={})
