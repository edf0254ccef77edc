"""Start the ranks of a HiDup command on this machine, as torchrun does, and end in one line:
`python -m hidup.train --nproc-per-node N ...` runs `python -m hidup.train ...` N times with
torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
As under torchrun, the launcher hosts the ranks' rendezvous store (a TCPStore on a port the
system picks) and the ranks connect to it (TORCHELASTIC_USE_AGENT_STORE): no rank holds a store
that the others still need as it exits. A rank writes its one-line error to its own file
(hidup.cli.say); when a rank fails, the others are stopped and the launcher prints the line of
the rank that failed first and exits with that rank's code. Ctrl-C stops every rank the same
way (each finishes the file it is writing; a rank still starting Python or importing torch is
killed, as SIGINT there can print a fatal error and it has nothing to finish), prints one line
and exits 130."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from hidup.cli import ERROR_FILE, READY_FILE

STOP_WAIT = 30.0  # seconds a stopped rank gets to end before SIGKILL (torchrun's figure)


def ranks_on_this_machine() -> int:
    """Ranks sharing this machine's cores: all of an emulated cluster's (its hosts are one
    machine), else torchrun's local ones."""
    return int(os.environ.get("HIDUP_RANKS_PER_MACHINE") or os.environ.get("LOCAL_WORLD_SIZE")
               or 1)


def default_threads() -> int:
    """Intra-op CPU threads per rank so that the ranks on this machine fill its cores once."""
    return max(1, (os.cpu_count() or 1) // ranks_on_this_machine())


def launch(module: str, argv: list[str], nproc: int, prog: str) -> int:
    """Run `python -m module argv` on `nproc` ranks; return 0 when all succeed, else print the
    first failed rank's line (prefixed `prog: ` where the rank wrote none) and return its code."""
    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    procs = []
    with tempfile.TemporaryDirectory(prefix="hidup-launch-") as folder:
        errors = [Path(folder) / f"rank{rank}.err" for rank in range(nproc)]
        readies = [Path(folder) / f"rank{rank}.ready" for rank in range(nproc)]
        old = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        try:
            for rank in range(nproc):
                env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                           WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                           TORCHELASTIC_USE_AGENT_STORE="True",
                           **{ERROR_FILE: str(errors[rank]), READY_FILE: str(readies[rank])})
                # a session of its own, as under torchrun: Ctrl-C reaches the launcher only,
                # which passes it on once
                procs.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=env,
                                              start_new_session=True))
            failed = _first_failure(procs)
        finally:
            _stop(procs, readies)
            signal.signal(signal.SIGTERM, old)
        if failed is None:
            return 0
        rank, code = failed
        line = errors[rank].read_text().strip() if errors[rank].is_file() else ""
    if not line and code < 0:
        line, code = f"{prog}: rank {rank} was killed by {signal.Signals(-code).name}", 128 - code
    elif not line:
        line = f"{prog}: rank {rank} failed with exit code {code} (its output is above)"
    print(line, file=sys.stderr, flush=True)
    return code


def _first_failure(procs: list[subprocess.Popen]) -> tuple[int, int] | None:
    """Wait until every rank has ended, or one has failed: (its rank, its exit code)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None:
            return failed, codes[failed]
        if all(c == 0 for c in codes):
            return None
        time.sleep(0.05)


def _stop(procs: list[subprocess.Popen], readies: list[Path]) -> None:
    """Ranks still running get SIGINT (each ends as on Ctrl-C), SIGKILL after STOP_WAIT s; a rank
    that has not made its ready file yet is still starting (Python, its imports) and is killed at
    once."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C cannot cut this short
    try:
        for p, ready in zip(procs, readies):
            if p.poll() is None:
                if ready.exists():
                    p.send_signal(signal.SIGINT)
                else:
                    os.killpg(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + STOP_WAIT
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)  # the rank and anything it started
                p.wait()
    finally:
        signal.signal(signal.SIGINT, old)
