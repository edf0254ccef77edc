"""Checkpoints of a training run, for `hidup.train --checkpoint DIR --checkpoint-every N
[--resume]`, through the Trainer's torch.distributed.checkpoint state (hidup.runtime.trainer):
every rank writes its shards of the parameters and optimizer states into DIR/step{S}/ (with the
schedule, the losses so far and rank 0's random state in the state's extra); when every rank has
written, DIR/latest.json is rewritten (through a temporary file, renamed when complete) to name
step S, and older step folders are removed. A run killed at any moment leaves the last committed
step whole. Resuming loads it into any plan, micro-batch count and world size (the tensors are
resharded), so only the model, the batch, the seed and the optimizer must match; the data of
each step is the same as in an uninterrupted run, so are the losses."""
from __future__ import annotations

import base64
import json
import os
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

FORMAT = 2  # 1: per-rank files DIR/step{S}-rank{R}.pt that only the same plan could resume


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or made by a different run."""


@dataclass(frozen=True)
class RunId:
    """What a checkpoint must match to be resumed (the strategy, micro-batches and world size
    may change)."""

    model: str
    batch: int
    seed: int
    optimizer: str

    def describe(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self.__dict__.items())


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # ranks may share the folder
    write(tmp)
    os.replace(tmp, path)


@contextmanager
def _one_process_quietly():
    """torch.distributed.checkpoint warns that it assumes one process where there is no process
    group: that is what a 1-rank run means."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable "
                                                  "or uninitialized")
        yield


def _first_of_node() -> bool:
    """One rank per machine tidies the folder (ranks of a machine share it)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def save(folder: Path, step: int, trainer, losses: list[float], run: RunId, barrier,
         about: dict | None = None) -> None:
    """Every rank: write the run's state after `step` steps into folder/step{step}/ and commit
    it in folder/latest.json once every rank has (`barrier()` waits for all). `about`: what
    else latest.json records (the strategy, world size, ...: not checked on resume)."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"step{step}"
    if _first_of_node():  # what a run killed while writing this step may have left
        shutil.rmtree(target, ignore_errors=True)
    barrier()
    rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
    extra = [{"format": FORMAT, "step": step, "losses": [float(x) for x in losses], "rng": rng,
              "run": run.__dict__}]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(extra, 0)  # rank 0's (the ranks' are equal)
    trainer.extra_state = extra[0]
    with _one_process_quietly():
        trainer.save_checkpoint(target)
    barrier()  # every rank's shards are complete: commit (each rank writes the same marker)
    marker = {"format": FORMAT, "step": step, "folder": target.name, "run": run.__dict__,
              **(about or {})}
    _atomic(folder / "latest.json", lambda tmp: tmp.write_text(json.dumps(marker)))
    if _first_of_node():
        for old in folder.glob("step*"):
            if old.is_dir() and old.name != target.name:
                shutil.rmtree(old, ignore_errors=True)
    barrier()


def load(folder: Path, trainer, run: RunId) -> tuple[int, list[float]]:
    """Restore the run's state from the last committed step into `trainer` (any plan and world
    size) and the random state: (steps done, their losses)."""
    marker = folder / "latest.json"
    try:
        latest = json.loads(marker.read_text())
        step = int(latest["step"])
        saved = latest["run"]
    except FileNotFoundError:
        raise CheckpointError(f"--resume: no checkpoint in {folder} (no latest.json); run with "
                              f"--checkpoint {folder} --checkpoint-every N first") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"--resume: {marker} is corrupt ({exc}); delete {folder} and "
                              f"start again") from None
    if latest.get("format") != FORMAT:
        raise CheckpointError(f"--resume: the checkpoint in {folder} was written by an older "
                              f"hidup.train (one file per rank), which this one cannot read; "
                              f"delete {folder} and start again")
    try:
        saved = RunId(**saved)
    except TypeError as exc:
        raise CheckpointError(f"--resume: {marker} is corrupt ({exc}); delete {folder} and "
                              f"start again") from None
    if saved != run:
        raise CheckpointError(f"--resume: the checkpoint in {folder} is of another run "
                              f"({saved.describe()}); this run is {run.describe()}; use the "
                              f"same --model, --batch, --seed and --optimizer (the strategy, "
                              f"micro-batches and ranks may change), or another --checkpoint "
                              f"folder")
    path = folder / latest.get("folder", f"step{step}")
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"--resume: {path / '.metadata'} is missing (the checkpoint of "
                              f"step {step} is incomplete); delete {folder} and start again")
    try:
        with _one_process_quietly():
            trainer.load_checkpoint(path)
    except Exception as exc:  # many kinds, on a damaged file (the first rank's own error)
        said = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        raise CheckpointError(f"--resume: {path} cannot be read ({type(exc).__name__}: "
                              f"{said[:200]}); delete {folder} and start again") from None
    extra = trainer.extra_state
    if extra.get("step") != step:
        raise CheckpointError(f"--resume: {path} holds step {extra.get('step')}, latest.json "
                              f"says {step}; delete {folder} and start again")
    rng = torch.frombuffer(bytearray(base64.b64decode(extra["rng"])), dtype=torch.uint8)
    torch.set_rng_state(rng.clone())
    return step, list(extra["losses"])
