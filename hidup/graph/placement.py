"""Placements of a tensor over a 1-D device mesh, in PyTorch DTensor's vocabulary."""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """The tensor is split in equal contiguous chunks along `dim` (rank r holds chunk r)."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a partial sum; the tensor is the sum over ranks."""

    def __str__(self) -> str:
        return "P"


Placement = Shard | Replicate | Partial
R = Replicate()
P = Partial()

_SHARD = re.compile(r"S\((-?\d+)\)")


def parse_placement(text: str) -> Placement:
    """Inverse of `str(placement)`: 'S(1)', 'R' or 'P'."""
    text = text.strip()
    if text == "R":
        return R
    if text == "P":
        return P
    match = _SHARD.fullmatch(text)
    if match is None:
        raise ValueError(f"placement {text!r} is not one of 'S(d)', 'R', 'P'")
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
