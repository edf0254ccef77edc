"""Checkpoints of a training run, for `hidup.train --checkpoint DIR --checkpoint-every N
[--resume]`. Each rank writes its own parameter shards, learning rate and random state as
DIR/step{S}-rank{R}.pt (through a temporary file, renamed when complete); when every rank has
written, each commits the step by rewriting DIR/latest.json and removes its older steps. A run
killed at any moment leaves the last committed step whole; resuming loads it and goes on, with
the same data per step as an uninterrupted run, so the losses are the same."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or made by a different run."""


@dataclass(frozen=True)
class RunId:
    """What a checkpoint must match to be resumed."""

    model: str
    strategy: str
    world: int
    micro_batches: int
    batch: int
    seed: int

    def describe(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self.__dict__.items())


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # ranks may share the folder
    write(tmp)
    os.replace(tmp, path)


def save(folder: Path, step: int, rank: int, executor, losses: list[float], run: RunId,
         barrier) -> None:
    """Every rank: write this rank's state after `step` steps; rank 0 commits it once all have
    (`barrier()` waits for every rank)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {"run": run.__dict__, "step": step, "losses": list(losses),
             "executor": executor.state_dict(), "rng": torch.get_rng_state()}
    _atomic(folder / f"step{step}-rank{rank}.pt", lambda tmp: torch.save(state, tmp))
    barrier()  # every rank's file is complete: commit (each rank, so that machines without a
    # shared filesystem each have the marker beside their own files)
    _atomic(folder / "latest.json",
            lambda tmp: tmp.write_text(json.dumps({"step": step, "run": run.__dict__})))
    for old in folder.glob(f"step*-rank{rank}.pt"):
        if not old.name.startswith(f"step{step}-"):
            old.unlink(missing_ok=True)
    barrier()


def load(folder: Path, rank: int, executor, run: RunId) -> tuple[int, list[float]]:
    """Restore this rank's state from the last committed step: (steps done, their losses)."""
    marker = folder / "latest.json"
    try:
        latest = json.loads(marker.read_text())
        step = int(latest["step"])
    except FileNotFoundError:
        raise CheckpointError(f"--resume: no checkpoint in {folder} (no latest.json); run with "
                              f"--checkpoint {folder} --checkpoint-every N first") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"--resume: {marker} is corrupt ({exc}); delete {folder} and "
                              f"start again") from None
    path = folder / f"step{step}-rank{rank}.pt"
    try:
        state = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"--resume: {path} is missing (the checkpoint of step {step} is "
                              f"incomplete); delete {folder} and start again") from None
    except Exception as exc:  # torch raises many kinds on a truncated or foreign file
        raise CheckpointError(f"--resume: {path} cannot be read ({type(exc).__name__}: {exc}); "
                              f"delete {folder} and start again") from None
    saved = RunId(**state["run"])
    if saved != run:
        raise CheckpointError(f"--resume: the checkpoint in {folder} is of another run "
                              f"({saved.describe()}); this run is {run.describe()}; use the "
                              f"same flags or another --checkpoint folder")
    executor.load_state_dict(state["executor"])
    torch.set_rng_state(state["rng"])
    return step, list(state["losses"])
