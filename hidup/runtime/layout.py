"""The micro-batch layout of a tensor on a rank: which piece of a whole tensor holds micro-batch
mb on this rank (`shard_of`: the micro-batch's part first, then the mesh's split of it), and a
micro-batch's part of a tensor and its inverse (`mb_part`, `mb_join`). The compiled step
(hidup.runtime.step), the executor and the Trainer cut their tensors so."""
from __future__ import annotations

import torch

from hidup.graph.placement import Placement, Shard, is_flat, plain
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
    """World rank `rank`'s stored shard of parameter `node` (whole: `full`): its row's piece (the
    strategy's home over a row's `per_machine` ranks), and where the strategy stores it over the
    mesh's dp axis too, its part's share of that piece; a flat home is
    over every rank."""
    world = per_machine * strategy.parts
    home = strategy.home(node)
    if is_flat(home):  # over every rank
        return shard_of(full, plain(home), None, 1, None, rank, world).contiguous()
    mesh = strategy.mesh or Mesh.line(world)
    x = shard_of(full, strategy.home(node), None, 1, None, mesh.position(rank, strategy.dp)[1],
                 per_machine)
    if node in strategy.across and strategy.mesh:  # its place along the storage's axes
        axes = strategy.across_axes
        x = x.chunk(mesh.size(axes), dim=strategy.across[node])[mesh.index(rank, axes)]
    return x.contiguous()


def mb_part(whole: torch.Tensor, dim: int, k: int, mb: int, blocks: int) -> torch.Tensor:
    """Micro-batch mb's part of `whole` along dim: the mb-th of k pieces of each of `blocks`
    blocks, one after another."""
    return torch.cat([b.chunk(k, dim=dim)[mb] for b in whole.chunk(blocks, dim=dim)], dim=dim)


def mb_join(parts: list[torch.Tensor], dim: int, blocks: int) -> torch.Tensor:
    """The whole of which `parts` are the micro-batches' (mb_part's inverse)."""
    pieces = [p.chunk(blocks, dim=dim) for p in parts]
    return torch.cat([piece[b] for b in range(blocks) for piece in pieces], dim=dim)
