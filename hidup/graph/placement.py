"""Placements of a tensor over a 1-D device mesh: DTensor's own types (Shard(d): split in equal
contiguous chunks along d, rank r holding chunk r; Replicate: whole on every rank; Partial: a
partial sum on every rank, the tensor their sum), written as DTensor writes them: 'S(0)', 'R',
'P(sum)'.

On a 2-D mesh (machines x a machine's ranks) a plan's placements are over a machine's ranks, the
machines splitting the batch. An op may instead run over every rank of the mesh flattened: its
placements are then the `flat` ones ('S(0)@all', 'R@all', 'P(sum)@all'), DTensor's [S(0), S(0)],
[R, R] and [P, P]. They are DTensor's types (isinstance works) but never equal to the placements
over a machine: a tensor held over a machine and the same over every rank are different values."""
from __future__ import annotations

import re
from dataclasses import dataclass

from torch.distributed.tensor.placement_types import Partial, Replicate, Shard


Placement = Shard | Replicate | Partial  # Partial: a sum (DTensor's other reduce ops are dropped
#   where DTensor's options come in: hidup.graph.dtensor)
R = Replicate()
P = Partial()

_SHARD = re.compile(r"S\((-?\d+)\)")
ALL = "@all"  # how a placement over every rank of a 2-D mesh is written


class FlatShard(Shard):
    """Shard(d) over every rank of a 2-D mesh (flattened, rank r holding chunk r)."""

    def __eq__(self, other) -> bool:
        return type(other) is FlatShard and other.dim == self.dim

    def __hash__(self) -> int:
        return hash((ALL, self.dim))

    def __str__(self) -> str:
        return f"S({self.dim}){ALL}"

    __repr__ = __str__


class FlatReplicate(Replicate):
    """Replicate over every rank of a 2-D mesh."""

    def __eq__(self, other) -> bool:
        return type(other) is FlatReplicate

    def __hash__(self) -> int:
        return hash((ALL, "R"))

    def __str__(self) -> str:
        return f"R{ALL}"

    __repr__ = __str__


class FlatPartial(Partial):
    """A partial sum over every rank of a 2-D mesh."""

    def __eq__(self, other) -> bool:
        return type(other) is FlatPartial and other.reduce_op == self.reduce_op

    def __hash__(self) -> int:
        return hash((ALL, "P"))

    def __str__(self) -> str:
        return f"P(sum){ALL}"

    __repr__ = __str__


def same(a: Placement | None, b: Placement | None) -> bool:
    """a == b, fast: DTensor's placement types take microseconds to find that two of different
    types differ (their C++ __eq__ fails to convert the other), so the types are compared first
    (a flat placement is never equal to one over a machine, as its __eq__ says)."""
    return a is b or type(a) is type(b) and a == b


def is_r(p: Placement | None) -> bool:
    """p == R (replicated over a machine's ranks; a flat R is not), fast."""
    return type(p) is Replicate


def is_whole(p: Placement | None) -> bool:
    """plain(p) == R: replicated, over a machine's ranks or over every rank."""
    return type(p) is Replicate or type(p) is FlatReplicate


def is_flat(p: Placement) -> bool:
    """Is p a placement over every rank of a 2-D mesh? (By its exact type: DTensor's placement
    types answer isinstance through a slow metaclass hook, and the search asks this a lot.)"""
    return type(p) in _FLAT_TYPES


_FLAT_TYPES = frozenset((FlatShard, FlatReplicate, FlatPartial))


def flat(p: Placement) -> Placement:
    """p (over a 1-D mesh) as the same placement over every rank of a 2-D mesh."""
    if is_flat(p):
        return p
    return FlatShard(p.dim) if isinstance(p, Shard) else FlatPartial() \
        if isinstance(p, Partial) else FlatReplicate()


def plain(p: Placement) -> Placement:
    """A flat placement as the placement over a 1-D mesh it is (others as they are)."""
    if not is_flat(p):
        return p
    return Shard(p.dim) if isinstance(p, Shard) else P if isinstance(p, Partial) else R


def flat_option(o: "ShardingOption") -> "ShardingOption":
    """A 1-D option run over every rank of a 2-D mesh."""
    return ShardingOption(tuple(map(flat, o.inputs)), flat(o.output))


def plain_option(o: "ShardingOption") -> "ShardingOption":
    """A flat option as the 1-D option it is."""
    return ShardingOption(tuple(map(plain, o.inputs)), plain(o.output))


def option_is_flat(o: "ShardingOption") -> bool:
    return is_flat(o.output)


def parse_placement(text: str) -> Placement:
    """Inverse of `str(placement)`: 'S(1)', 'R' or 'P(sum)' ('P' in plans saved before), each
    with '@all' where it is over every rank of a 2-D mesh."""
    text = text.strip()
    if text.endswith(ALL):
        return flat(parse_placement(text[:-len(ALL)]))
    if text == "R":
        return R
    if text in ("P", "P(sum)"):
        return P
    match = _SHARD.fullmatch(text)
    if match is None:
        raise ValueError(f"placement {text!r} is not one of 'S(d)', 'R', 'P(sum)' (each may "
                         f"end in '{ALL}')")
    return Shard(int(match.group(1)))


def is_shard(p: Placement) -> bool:
    return isinstance(p, Shard)


@dataclass(frozen=True)
class ShardingOption:
    """How one op runs sharded: the placement each tensor input must have, and the output's."""

    inputs: tuple[Placement, ...]
    output: Placement

    def __str__(self) -> str:
        return f"({', '.join(map(str, self.inputs))}) -> {self.output}"

    def partial_gradient(self, read: Placement) -> bool:
        """Does this op make the gradient of an input it reads as `read` a Partial sum on each
        rank? It does where it reads the input replicated and makes a split or Partial output
        (a column-parallel matmul): each rank differentiates only its part."""
        return is_whole(read) and not is_whole(self.output)


def parse_option(text: str) -> ShardingOption:
    """Inverse of `str(option)`, e.g. '(S(0), R) -> S(0)'."""
    try:
        ins, out = text.split("->")
        ins = ins.strip()
        if not (ins.startswith("(") and ins.endswith(")")):
            raise ValueError
        body = ins[1:-1].strip()
        inputs = tuple(parse_placement(p) for p in body.split(",")) if body else ()
        return ShardingOption(inputs, parse_placement(out))
    except ValueError as exc:
        raise ValueError(f"sharding option {text!r} is not of the form '(S(0), R) -> S(0)'") from exc


FLAT_R = FlatReplicate()
