"""The collectives of the compiled step (hidup.runtime.step): `issue` starts one functional
collective (torch.ops._c10d_functional) over a process group, `PACKING` lays a local value out
for each kind and back, and `stand_in` makes a collective's result from this rank's own piece
(calibration: no communication)."""
from __future__ import annotations

import torch

_C = torch.ops._c10d_functional


def issue(kind: str, x: torch.Tensor, world: int, group: str) -> torch.Tensor:
    """Issue the functional collective `kind` on `x` over the group named `group` of `world`
    ranks; its result is ready after `wait_tensor`."""
    if kind == "all_reduce":
        return _C.all_reduce(x, "sum", group)
    if kind == "all_gather":  # into a buffer of its own: the functional all_gather_into_tensor
        # (gloo's coalesced all-gather) corrupts the heap when two are in flight, as under Duplex
        # (torch 2.13; tests/test_execute.py)
        out = x.new_empty((x.shape[0] * world,) + tuple(x.shape[1:]))
        return _C.all_gather_into_tensor_out(x, world, group, out=out)
    if kind == "reduce_scatter":
        return _C.reduce_scatter_tensor(x, "sum", world, group)
    if kind == "all_to_all":
        return _C.all_to_all_single(x, [x.shape[0] // world] * world,
                                    [x.shape[0] // world] * world, group)
    raise ValueError(f"unknown collective {kind!r}")


def stand_in(kind: str, x: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """A collective's result built from this rank's own piece, with the right shape and valid
    values (token ids stay in range): all-gather repeats it, reduce-scatter cuts it."""
    if kind == "all_gather":
        return x.repeat((world,) + (1,) * (x.dim() - 1))
    if kind == "reduce_scatter":
        return x.chunk(world)[rank].clone()
    return x.clone()


def _along_dim0(x, task, world):
    return x.movedim(task.src.dim if task.kind == "all_gather" else task.dst.dim, 0).contiguous()


def _back_from_dim0(y, task, world):
    return y.movedim(0, task.src.dim if task.kind == "all_gather" else task.dst.dim).contiguous()


def _stack_chunks(x, task, world):
    return torch.stack(x.chunk(world, dim=task.dst.dim)).contiguous()


def _cat_received(y, task, world):
    return torch.cat(y.unbind(0), dim=task.src.dim).contiguous()


# kind -> (pack the local value into the collective's layout, unpack its result)
PACKING = {"all_reduce": (lambda x, task, world: x.contiguous(), lambda y, task, world: y),
           "all_gather": (_along_dim0, _back_from_dim0),
           "reduce_scatter": (_along_dim0, _back_from_dim0),
           "all_to_all": (_stack_chunks, _cat_received)}
