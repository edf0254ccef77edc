"""Every rank of a Program in one process, each on a thread of its own, their collectives
exchanged in memory: a check of a plan's numerics (loss and gradients against one device) with
no process, process group or trace per rank. Each rank runs the executor's untraced step
(hidup.runtime.step: the Program's tasks one by one as Python, as the traced step records them);
its collectives go to an `Exchange` instead of a process group. What this leaves out, and the
tests run on real gloo ranks: the process groups themselves, the DeviceMesh, and the traced
(recorded) step.

    results = run_local(graph, strategy, program, params, buffers, inputs)
    results[r].loss, results[r].grads  # rank r's loss and gradient shards, by parameter node
    results[r].buffers                 # and its buffers after the step
    whole = assemble(strategy, program, node, [r.grads[node] for r in results], shape)
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from hidup.graph.capture import Graph
from hidup.program.tasks import Program
from hidup.runtime.layout import param_shard
from hidup.strategy import Strategy

TIMEOUT_S = 120.0  # a rank waits this long for its group's other ranks, then gives up


class PeerFailed(RuntimeError):
    """Another rank of the local world failed, or did not reach a collective in time."""


class Exchange:
    """The collectives of ranks on threads of one process. The n-th collective a rank issues
    in a group (its ranks, in order) meets the n-th of each other rank of that group, as on a
    process group; once all have put their value, each gets its result."""

    def __init__(self):
        self._lock = threading.Condition()
        self._issued: dict[tuple, int] = {}  # (group, rank) -> collectives issued so far
        self._values: dict[tuple, dict[int, torch.Tensor]] = {}  # (group, n) -> rank -> value
        self._results: dict[tuple, list[torch.Tensor]] = {}
        self.failed: BaseException | None = None

    def issue(self, kind: str, x: torch.Tensor | list[torch.Tensor], group: tuple[int, ...],
              rank: int, op: str = "sum") -> tuple:
        """Put `rank`'s value of one collective (for 'all_to_all_v', its chunk for each rank of
        the group, in order, any sizes); its handle for `wait`."""
        with self._lock:
            n = self._issued.get((group, rank), 0)
            self._issued[(group, rank)] = n + 1
            values = self._values.setdefault((group, n), {})
            values[rank] = [c.detach().clone() for c in x] if isinstance(x, list) else \
                x.detach().clone()
            if len(values) == len(group):
                self._results[(group, n)] = _combine(kind, [values[r] for r in group], op)
                del self._values[(group, n)]
                self._lock.notify_all()
        return group, n, group.index(rank)

    def rows(self, chunks: list[torch.Tensor], rows: list[int], *, group: tuple[int, ...],
             rank: int) -> list[torch.Tensor]:
        """hidup.graph.ops.dispatch's exchange over the ranks `group`: chunk i (any number of
        rows) to the group's i-th rank; what came from each (`rows`: their sizes, which the
        counts sent before told)."""
        return self.wait(self.issue("all_to_all_v", chunks, group, rank))

    def wait(self, handle: tuple) -> torch.Tensor:
        """This rank's result of the collective `handle` names, once every rank has put its
        value."""
        group, n, place = handle
        with self._lock:
            if not self._lock.wait_for(lambda: (group, n) in self._results or self.failed,
                                       timeout=TIMEOUT_S):
                raise PeerFailed(f"ranks {group}: collective {n} still misses a rank's value "
                                 f"after {TIMEOUT_S:.0f} s")
            if self.failed is not None:
                raise PeerFailed(f"another rank failed: {self.failed!r}")
            return self._results[(group, n)][place]

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            self.failed = self.failed or exc
            self._lock.notify_all()


def _combine(kind: str, xs: list[torch.Tensor], op: str) -> list[torch.Tensor]:
    """Each rank's result of collective `kind` on the ranks' values `xs` (in group order), laid
    out as hidup.runtime.collectives.issue's functional collectives lay them out (dim 0)."""
    n = len(xs)
    if kind == "all_reduce":
        stacked = torch.stack(xs)
        total = {"sum": stacked.sum, "max": lambda dim: stacked.amax(dim),
                 "min": lambda dim: stacked.amin(dim)}[op](0)
        return [total.clone() for _ in xs]
    if kind == "all_gather":
        whole = torch.cat(xs)
        return [whole.clone() for _ in xs]
    if kind == "reduce_scatter":
        return [c.clone() for c in torch.stack(xs).sum(0).chunk(n)]
    if kind == "all_to_all":
        return [torch.cat([x.chunk(n)[i] for x in xs]) for i in range(n)]
    if kind == "all_to_all_v":  # each rank's list of chunks, one per rank: the i-th rank's from each
        return [[x[i] for x in xs] for i in range(n)]
    raise ValueError(f"unknown collective {kind!r}")


@dataclass(frozen=True)
class RankResult:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]  # parameter node -> this rank's gradient shard
    buffers: list[torch.Tensor]  # its buffers after the step (forward's updates written in)


def run_local(graph: Graph, strategy: Strategy, program: Program,
              params: dict[str, torch.Tensor], buffers: list[torch.Tensor],
              inputs: list[torch.Tensor]) -> list[RankResult]:
    """One step without update of every rank of `program`, each on a thread: `params` whole by
    parameter node (each rank takes its shard), `buffers` and `inputs` whole in the graph's
    order. Each rank's loss and gradient shards; a rank's error is raised here. Each op runs on
    its rank's thread alone (torch's intra-op threads set to one meanwhile), so a rank computes
    what a rank process of one thread computes, bit for bit."""
    from hidup.runtime.step import StepSpec, untraced_step

    exchange, world = Exchange(), program.world
    per_machine = program.row
    results: list[RankResult | None] = [None] * world
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            spec = StepSpec(graph, strategy, program, rank, {}, exchange=exchange)
            shards = [param_shard(params[n.name], strategy, n.name, rank, per_machine).clone()
                      for n in graph.params]
            step = untraced_step(spec, len(shards), len(buffers), update=False)
            mine = [b.clone() for b in buffers]
            with torch.no_grad():
                out = step(*shards, *mine, *inputs, torch.tensor(0.0))
            results[rank] = RankResult(out[0], dict(zip(program.param_grads, out[1:])), mine)
        except BaseException as exc:  # noqa: BLE001 (each rank's error goes to the caller)
            errors.append(exc)
            exchange.fail(exc)

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}")
               for r in range(world)]
    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(intra_op)
    if errors:
        first = next((e for e in errors if not isinstance(e, PeerFailed)), errors[0])
        raise first
    return results


def assemble(strategy: Strategy, program: Program, node: str, shards: list[torch.Tensor],
             shape: tuple[int, ...]) -> torch.Tensor:
    """Parameter `node`'s whole tensor (of `shape`) from every rank's shard of it (in rank
    order), each element from the first rank that holds it; where two ranks hold one, they must
    agree (a ValueError says where they do not)."""
    index = torch.arange(int(torch.Size(shape).numel())).reshape(shape)
    whole = torch.empty(int(index.numel()), dtype=shards[0].dtype)
    seen = torch.zeros(int(index.numel()), dtype=torch.bool)
    for rank, shard in enumerate(shards):
        held = param_shard(index, strategy, node, rank, program.row).reshape(-1)
        values = shard.reshape(-1)
        again = seen[held]
        if again.any():  # a replica: the same values, up to the order of a sum's terms
            mine, theirs = values[again], whole[held][again]
            if float((mine - theirs).norm()) > 1e-6 * max(float(theirs.norm()), 1e-30):
                raise ValueError(f"parameter {node}: rank {rank}'s copy differs from an "
                                 f"earlier rank's")
        whole[held] = values
        seen[held] = True
    if not seen.all():
        raise ValueError(f"parameter {node}: no rank holds {int((~seen).sum())} of its elements")
    return whole.reshape(shape)
