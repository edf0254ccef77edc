"""The exact plan for plain SPMD (k = 1): the search's own cost model (hidup.planning.programme) as an
integer programme, solved to optimality by HiGHS (scipy.optimize.milp).

With one micro-batch the programme's cost of a plan is linear in its choices:
  sum over nodes of the chosen option's computation, optimizer update and gradient reductions
  + sum over (tensor, placement it is read at) of that conversion, charged once, from the
    tensor's home (its producer's output, or a parameter's or input's first consumer's choice)
  + sum over tensors whose replicated value's gradient is a Partial sum (a consumer reads it at
    R and outputs no R) of its reduction (Search.partial_grad_cost, by the tensor's home), once
Variables: x[v, o] = 1 when node v takes option o (one per node); q[t, h, p, j] >= home[t, h] +
reads[j, t, p] - (reads of t at p by consumers before j) - 1 pays conversion h -> p at consumer
j, the first to read t at p (as the programme charges it); g[t, h] >= home[t, h] + partial[j, t]
- 1 for every consumer j pays the gradient's reduction. A consumer that reads t as a Partial
sum needs t's home to be that Partial. The memory the programme counts is held to the limit.
With Duplex (k > 1) the stage model's max(D, m), and its debt reset only where a node
communicates, are not linear; tests/test_search.py checks the programme there against the
unbounded programme on a graph where that runs."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from hidup.graph.placement import Partial
from hidup.strategy import Strategy, fitting_options
from hidup.program.tasks import LoweringError


@dataclass(frozen=True)
class ExactResult:
    strategy: Strategy
    cost: float  # the programme's cost of the plan (s; objective 'comm': bytes)
    bound: float  # a proven lower bound on every plan's cost: = cost when `optimal`
    optimal: bool
    seconds: float
    variables: int


class _Model:
    """Columns (cost, integer, upper bound) and sparse rows (lower <= a.x <= upper)."""

    def __init__(self):
        self.cost: list[float] = []
        self.integer: list[int] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def var(self, cost=0.0, integer=False, lower=0.0, upper=1.0) -> int:
        self.cost.append(cost)
        self.integer.append(int(integer))
        self.lower.append(lower)
        self.upper.append(upper)
        return len(self.cost) - 1

    def row(self, terms: list[tuple[float, dict[int, float]]], lower=-math.inf, upper=math.inf):
        """sum of coef * expression over `terms` between lower and upper."""
        merged: dict[int, float] = {}
        for coef, expr in terms:
            for i, a in expr.items():
                merged[i] = merged.get(i, 0.0) + coef * a
        self.rows.append((merged, lower, upper))

    def solve(self, time_limit: float):
        # scipy's optimizer is imported here, where a proof is asked for (--exact): it takes
        # a third of a second that every command planning without one would pay at start
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        r, c, v = [], [], []
        for i, (expr, _, _) in enumerate(self.rows):
            for j, a in expr.items():
                r.append(i)
                c.append(j)
                v.append(a)
        a = coo_matrix((v, (r, c)), shape=(len(self.rows), len(self.cost))).tocsr()
        res = milp(np.array(self.cost),
                   constraints=LinearConstraint(a, [lo for _, lo, _ in self.rows],
                                                [hi for _, _, hi in self.rows]),
                   integrality=np.array(self.integer),
                   bounds=Bounds(np.array(self.lower), np.array(self.upper)),
                   options={"time_limit": time_limit, "mip_rel_gap": 0.0})
        return res


def exact_plan(search, name: str = "exact", time_limit: float = 60.0) -> ExactResult:
    """The cheapest plan of `search` (a hidup.planning.programme.Search with k = 1) under its own
    cost model, proven optimal unless `time_limit` seconds run out (then the best found and a
    lower bound)."""
    if search.k != 1:
        raise ValueError(f"exact plan: k = {search.k}; the integer programme states the k = 1 "
                         f"cost model only (Duplex's stage model is not linear)")
    started = time.perf_counter()
    g, model = search.g, _Model()
    comm = search.objective == "comm"
    unit = 2.0**-20 if comm else 1e6  # MiB or microseconds: HiGHS's tolerances suit O(1)
    x: dict[str, list[tuple[int, object]]] = {}  # node -> [(column, option)]
    costs = {}
    for node in g.ops:
        cols = []
        for opt in fitting_options(g, node, search.world):
            try:
                cost = search.node_cost(node, opt)
            except LoweringError:
                continue
            reads_partial_input = any(t in search.placeholders and isinstance(p, Partial)
                                      for t, p in zip(node.inputs, opt.inputs))
            own = cost.compute + cost.update + cost.grads / search.k
            col = model.var(own * unit, integer=True, upper=0.0 if reads_partial_input else 1.0)
            cols.append((col, opt))
            costs[col] = cost
        if not cols:
            raise ValueError(f"exact plan: node {node.name} ({node.op}) has no option that "
                             f"divides evenly")
        x[node.name] = cols
        model.row([(1.0, {col: 1.0 for col, _ in cols})], 1.0, 1.0)
    readers: dict[str, list[tuple[str, int]]] = {}  # tensor -> [(consumer, input slot)]
    for node in g.ops:
        for slot, t in enumerate(node.inputs):
            readers.setdefault(t, []).append((node.name, slot))
    for t, reads in readers.items():
        _conversions(search, model, x, t, reads, unit)
    if not math.isinf(search.memory):
        model.row([(1.0, {col: costs[col].memory / 2**30 for cols in x.values()
                          for col, _ in cols})], upper=search.memory / 2**30)
    res = model.solve(time_limit)
    if res.x is None:
        raise ValueError(f"exact plan: no plan fits in {search.memory / 2**30:.3g} GiB per "
                         f"device ({res.message})")
    options = {n: next(opt for col, opt in cols if res.x[col] > 0.5) for n, cols in x.items()}
    strategy = search.plan(options, name)
    optimal = res.status == 0
    bound = getattr(res, "mip_dual_bound", None)
    bound = (res.fun if optimal or bound is None else bound) / unit
    return ExactResult(strategy, search.price(strategy), bound, optimal,
                       time.perf_counter() - started, len(model.cost))


def _conversions(search, model: _Model, x, t: str, reads, unit: float) -> None:
    """Rows and columns that charge tensor t's conversions once per placement it is read at, at
    the first consumer that reads it there (as the programme does)."""
    if t in search.placeholders:  # its home is what its first consumer's first slot reads
        first, slot = reads[0]
        home: dict = {}
        for col, opt in x[first]:
            home.setdefault(opt.inputs[slot], {})[col] = 1.0
    else:
        home = {}
        for col, opt in x[t]:
            home.setdefault(opt.output, {})[col] = 1.0
    wants: dict = {}  # placement -> [(consumer, expression of it reading t there)], in order
    partial = []  # per consumer, the expression of it making t's gradient a Partial sum
    for consumer in dict.fromkeys(c for c, _ in reads):
        slots = [s for c, s in reads if c == consumer]
        per: dict = {}
        for col, opt in x[consumer]:
            for p in {opt.inputs[s] for s in slots}:
                per.setdefault(p, {})[col] = 1.0
        for p, expr in per.items():
            wants.setdefault(p, []).append((consumer, expr))
        if t in search.reduced:
            expr = {col: 1.0 for col, opt in x[consumer]
                    if any(opt.partial_gradient(opt.inputs[s]) for s in slots)}
            if expr:
                partial.append(expr)
    for h in home:  # t's replicated gradient made whole once, where the first consumer to
        cost = search.partial_grad_cost(t, h) if partial else 0.0  # make it Partial reads it
        if cost <= 0:
            continue
        q = model.var(cost * unit)
        for expr in partial:  # q >= home h + a consumer that makes it Partial - 1
            model.row([(1.0, {q: 1.0}), (-1.0, home[h]), (-1.0, expr)], lower=-1.0)
    for p, readers in wants.items():
        if isinstance(p, Partial):  # read as a Partial sum: only where it is one
            for _, expr in readers:
                model.row([(1.0, home.get(p, {})), (-1.0, expr)], lower=0.0)
            continue
        for h in home:
            cost = search.conversion_cost(t, h, p) if h != p else 0.0
            if cost <= 0:
                continue
            earlier: dict[int, float] = {}
            for consumer, expr in readers:  # q >= home h + reads here - read before - 1
                q = model.var(cost * unit)
                model.row([(1.0, {q: 1.0}), (-1.0, home[h]), (-1.0, expr), (1.0, earlier)],
                          lower=-1.0)
                for col in expr:
                    earlier[col] = earlier.get(col, 0.0) + 1.0
