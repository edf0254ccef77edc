"""The micro-batch layout of a tensor on a rank: which piece of a whole tensor holds micro-batch
mb on this rank (`shard_of`: the micro-batch's part first, then the mesh's split of it), and a
micro-batch's part of a tensor and its inverse (`mb_part`, `mb_join`). The compiled step
(hidup.runtime.step), the executor and the Trainer cut their tensors so."""
from __future__ import annotations

import torch

from hidup.graph.placement import Placement, Shard
from hidup.strategy import Mesh


def shard_of(full: torch.Tensor, placement: Placement, mb_placement: Placement, k: int,
             mb: int | None, rank: int, world: int, rank_blocks: bool = False) -> torch.Tensor:
    """This rank's piece of micro-batch `mb` of a whole tensor: the micro-batch's part first, then
    the mesh's split of it. The part is the whole's k-th block, or with `rank_blocks` the mb-th
    piece of each rank's block (so that a rank's micro-batches, joined, are its shard)."""
    x = full
    if isinstance(mb_placement, Shard) and mb is not None and k > 1:
        x = mb_part(x, mb_placement.dim, k, mb, world if rank_blocks else 1)
    if isinstance(placement, Shard) and world > 1:
        x = x.chunk(world, dim=placement.dim)[rank]
    return x.contiguous()


def param_shard(full: torch.Tensor, strategy, node: str, rank: int, per_machine: int
                ) -> torch.Tensor:
    """World rank `rank`'s stored shard of parameter `node` (whole: `full`): its piece of the
    parameter's storage placements (Strategy.storage, one per mesh axis), on a mesh of
    `per_machine` ranks per row."""
    world = per_machine * strategy.parts
    return piece(full, strategy.storage(node, world), strategy.mesh or Mesh.line(world), rank)


def piece(full: torch.Tensor, placements, mesh: Mesh, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece of a whole tensor placed as `placements` (one per axis of `mesh`),
    as DTensor places it: split along each axis in the mesh's order, the rank's coordinate on
    that axis choosing its chunk (a dim split on two axes: the outer axis' chunks split again by
    the inner one's)."""
    x = full
    for axis, p, coord in zip(mesh.names, placements, mesh.coords(rank)):
        if isinstance(p, Shard) and mesh.size(axis) > 1:
            x = x.chunk(mesh.size(axis), dim=p.dim)[coord]
    return x.contiguous()


def whole_shape(shape, placements, mesh: Mesh) -> tuple[int, ...]:
    """The whole tensor's shape of which a piece of `shape` is placed as `placements`."""
    out = list(shape)
    for axis, p in zip(mesh.names, placements):
        if isinstance(p, Shard):
            out[p.dim] *= mesh.size(axis)
    return tuple(out)


def mb_part(whole: torch.Tensor, dim: int, k: int, mb: int, blocks: int) -> torch.Tensor:
    """Micro-batch mb's part of `whole` along dim: the mb-th of k pieces of each of `blocks`
    blocks, one after another."""
    return torch.cat([b.chunk(k, dim=dim)[mb] for b in whole.chunk(blocks, dim=dim)], dim=dim)


def mb_join(parts: list[torch.Tensor], dim: int, blocks: int) -> torch.Tensor:
    """The whole of which `parts` are the micro-batches' (mb_part's inverse)."""
    pieces = [p.chunk(blocks, dim=dim) for p in parts]
    return torch.cat([piece[b] for b in range(blocks) for piece in pieces], dim=dim)
