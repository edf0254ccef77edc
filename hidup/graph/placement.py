"""Placements of a tensor over a 1-D device mesh: DTensor's own types (Shard(d): split in equal
contiguous chunks along d, rank r holding chunk r; Replicate: whole on every rank; Partial: a
partial sum on every rank, the tensor their sum), written as DTensor writes them: 'S(0)', 'R',
'P(sum)'."""
from __future__ import annotations

import re
from dataclasses import dataclass

from torch.distributed.tensor.placement_types import Partial, Replicate, Shard


Placement = Shard | Replicate | Partial  # Partial: a sum (DTensor's other reduce ops are dropped
#   where DTensor's options come in: hidup.graph.dtensor)
R = Replicate()
P = Partial()

_SHARD = re.compile(r"S\((-?\d+)\)")


def parse_placement(text: str) -> Placement:
    """Inverse of `str(placement)`: 'S(1)', 'R' or 'P(sum)' ('P' in plans saved before)."""
    text = text.strip()
    if text == "R":
        return R
    if text in ("P", "P(sum)"):
        return P
    match = _SHARD.fullmatch(text)
    if match is None:
        raise ValueError(f"placement {text!r} is not one of 'S(d)', 'R', 'P(sum)'")
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
        return read == R and self.output != R


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
