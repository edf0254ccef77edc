"""Routed experts by all-to-all (expert parallelism as DeepSpeed-MoE and torchtitan run it): each
rank holds its own tokens' rows, sorted by expert, and experts / world of the experts; a grouped
matmul sends every row to the rank of its expert, that rank multiplies the rows it received by
its experts' weights, and sends the products back. A rank's traffic is the rows it routes, not
the whole batch's (as the all-reduce of a Partial expert output moves).

How many rows go where depends on the routing, so the exchange sizes are read from `offs` while
the step runs: `hidup::experts_a2a` and its backward are ops of their own, opaque to the traced
step (as `hidup::experts_mm`), that run their collectives inside themselves, blocking, over the
ranks the experts split over. That group is named by a string: a process group's name, or a
name `register_group` gave to another exchange (the local world's threads, calibration's
stand-in).

Forward: the experts' row counts (one small all-to-all), the rows, the products back (two).
Backward: the counts, the rows and their gradients (the rows are not kept from the forward:
sent again), the rows' gradients back. Each (kind, bytes) is in `collectives`, for the
Program."""
from __future__ import annotations

import weakref
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from hidup.graph.ops.grouped import differentiable

# chunks[i] goes to the group's i-th rank; `rows[i]`: how many rows come from its i-th rank;
# returns what came from each rank, in group order
Exchange = Callable[[list[torch.Tensor], list[int]], list[torch.Tensor]]
COUNT_BYTES = 8  # an expert's row count, int64

_GROUPS: dict[str, tuple[weakref.ref, Callable]] = {}


def register_group(name: str, owner: object, exchange: Callable) -> str:
    """Name an exchange that is not a process group, `exchange(owner, chunks, rows)`, for as long
    as `owner` lives (the local world's threads: their hidup.runtime.local_world.Exchange);
    `name` is what the ops take for `group`."""
    _GROUPS[name] = weakref.ref(owner), exchange
    for gone in [k for k, (ref, _) in _GROUPS.items() if ref() is None]:
        del _GROUPS[gone]
    return name


def _exchange(group: str) -> Exchange:
    """The exchange of the group named `group`: a registered one, or the process group's."""
    ref, exchange = _GROUPS.get(group, (lambda: None, None))
    owner = ref()
    if owner is not None:
        return partial(exchange, owner)
    pg = dist.distributed_c10d._resolve_process_group(group)

    def over_process_group(chunks: list[torch.Tensor], rows: list[int]) -> list[torch.Tensor]:
        x = torch.cat(chunks).contiguous()
        out = x.new_empty((sum(rows), *x.shape[1:]))
        dist.all_to_all_single(out, x, rows, [c.shape[0] for c in chunks], group=pg)
        return list(out.split(rows))
    return over_process_group


def stand_in(_, chunks: list[torch.Tensor], rows: list[int]) -> list[torch.Tensor]:
    """Calibration's exchange: every rank routes as this one, so what comes from rank i is what
    this rank sends it (the shapes and the work of a real exchange where routing is even)."""
    return [c.clone() for c in chunks]


STAND_IN = register_group("hidup:stand-in", stand_in, stand_in)


class _Routes:
    """Where this rank's rows go and what comes back: `offs` (where each of the world's experts'
    rows end, the rows sorted by expert) split by rank, and the counts the ranks send here."""

    def __init__(self, offs: torch.Tensor, local: int, exchange: Exchange):
        ends = [0, *offs.tolist()]
        self.world, self.local = (len(ends) - 1) // local, local
        cut = ends[::local]  # where the rows of each rank's experts begin
        self.sent = [b - a for a, b in zip(cut, cut[1:])]
        self.used = cut[-1]
        counts = torch.tensor([b - a for a, b in zip(ends, ends[1:])], dtype=torch.int64,
                              device=offs.device)
        got = exchange(list(counts.split(local)), [local] * self.world)
        self.counts = [c.tolist() for c in got]  # [source][my expert]: rows
        self.received = [sum(c) for c in self.counts]

    def send(self, x: torch.Tensor, exchange: Exchange) -> list[torch.Tensor]:
        """x's routed rows sent to their experts' ranks: what came from each rank."""
        return exchange(list(x[:self.used].split(self.sent)), self.received)

    def by_expert(self, got: list[torch.Tensor]) -> list[torch.Tensor]:
        """Received rows regrouped: for each of my experts, its rows from every rank."""
        pieces = [chunk.split(c) for chunk, c in zip(got, self.counts)]
        return [torch.cat([p[e] for p in pieces]) for e in range(self.local)]

    def by_source(self, per_expert: list[torch.Tensor]) -> list[torch.Tensor]:
        """The inverse of by_expert: for each rank, its rows' results in the order it sent."""
        pieces = [y.split([c[e] for c in self.counts]) for e, y in enumerate(per_expert)]
        return [torch.cat([pieces[e][s] for e in range(self.local)])
                for s in range(self.world)]

    def back(self, chunks: list[torch.Tensor], like: torch.Tensor, width: int,
             exchange: Exchange) -> torch.Tensor:
        """Results sent back to the ranks the rows came from: this rank's rows' results, zero
        after its last routed row (as a grouped matmul's)."""
        out = like.new_zeros(like.shape[0], width)
        got = exchange(chunks, self.sent)
        if self.used:
            out[:self.used] = torch.cat(got)
        return out


def forward(x, weight, offs, exchange: Exchange) -> torch.Tensor:
    routes = _Routes(offs, weight.shape[0], exchange)
    rows = routes.by_expert(routes.send(x, exchange))
    products = [r @ weight[e] for e, r in enumerate(rows)]
    return routes.back(routes.by_source(products), x, weight.shape[2], exchange)


def backward(x, weight, offs, grad, exchange: Exchange) -> tuple[torch.Tensor, torch.Tensor]:
    routes = _Routes(offs, weight.shape[0], exchange)
    rows = routes.by_expert(routes.send(x, exchange))
    grads = routes.by_expert(routes.send(grad.to(x.dtype), exchange))
    grad_weight = torch.empty_like(weight)  # laid out as the weight (the fake's, below)
    grad_weight.copy_(torch.stack([r.T @ g for r, g in zip(rows, grads)]))
    grad_rows = [g @ weight[e].T for e, g in enumerate(grads)]
    return routes.back(routes.by_source(grad_rows), x, x.shape[1], exchange), grad_weight


@torch.library.custom_op("hidup::experts_a2a", mutates_args=())
def experts_a2a(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                group: str) -> torch.Tensor:
    """This rank's rows (sorted by expert; offs over every rank's experts) times their experts'
    weights, the rows sent to the ranks of `group` that hold them (weight: this rank's experts,
    the i-th rank of the group holding the i-th block); zero after the last routed row."""
    return forward(input, weight, offs, _exchange(group))


@experts_a2a.register_fake
def _(input, weight, offs, group):
    return input.new_empty(input.shape[0], weight.shape[2])


@torch.library.custom_op("hidup::experts_a2a_backward", mutates_args=())
def experts_a2a_backward(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                         group: str, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows' gradient; this rank's experts' weights' gradient, from every rank's rows)."""
    return backward(input, weight, offs, grad, _exchange(group))


@experts_a2a_backward.register_fake
def _(input, weight, offs, group, grad):  # the strides the real op gives, which a traced step
    return input.new_empty(input.shape), torch.empty_like(weight)  # bakes into its views


differentiable(experts_a2a, experts_a2a_backward)


def collectives(rows: int, width_in: int, width_out: int, itemsize: int, experts: int,
                backward: bool) -> tuple[tuple[str, int], ...]:
    """The all-to-alls of one grouped matmul over `rows` routed rows of this rank (width_in
    features in, width_out out, `itemsize` bytes each) and `experts` of the world's experts,
    forward or backward, as (kind, bytes of this rank's whole tensor); the counts first."""
    counts = ("all_to_all", experts * COUNT_BYTES)
    if backward:
        return (counts, ("all_to_all", rows * width_in * itemsize),
                ("all_to_all", rows * width_out * itemsize),
                ("all_to_all", rows * width_in * itemsize))
    return (counts, ("all_to_all", rows * width_in * itemsize),
            ("all_to_all", rows * width_out * itemsize))
