"""What every command line of HiDup shares: a bad flag is one line on stderr that names the value
and the rule (argparse's message, or the command's own), then exit code 2; Ctrl-C is one line,
`PROG: interrupted`, then exit code 130. Rates and times on a command line are read by
`parse_rate` and `parse_seconds`, the same for every command."""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

# Set by hidup.runtime.launch for each rank it starts: the file where the rank writes its one-line
# error (the launcher prints the line of the rank that failed first, once).
ERROR_FILE = "HIDUP_ERROR_FILE"
# Also set by the launcher: the file a rank creates once its imports are done and Ctrl-C ends it in
# one line (end_on_interrupt). A rank without it is still starting Python (where SIGINT prints a
# "Fatal Python error") or importing torch; the launcher kills such a rank instead (it has no
# file to finish).
READY_FILE = "HIDUP_READY_FILE"


SAY_GRACE_S = 3.0  # how long a silent rank waits before it goes on to exit


def say(line: str, every_rank: bool = False) -> None:
    """Print a command's one-line error on stderr: once, by rank 0, when torchrun started many
    ranks (every rank meets the same error), unless `every_rank` (a rank's own trouble); a rank
    started by hidup.runtime.launch writes it to its error file instead."""
    path = os.environ.get(ERROR_FILE)
    if path:
        Path(path).write_text(line + "\n")
    elif every_rank or os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
    else:  # give rank 0 the time to say it: torchrun stops every rank once one has exited
        time.sleep(SAY_GRACE_S)


_interrupted: list[bool] = []  # Ctrl-C came (and was said) in this process


def end_on_interrupt(prog: str, importing: bool = False) -> None:
    """From now on Ctrl-C (SIGINT) prints `PROG: interrupted` once and raises SystemExit(130):
    no traceback, and `finally` blocks still run.

    `importing` (a command's first line, before it imports torch): Ctrl-C is said at once but
    takes effect at the next call, which the command's argument parser makes after the imports.
    An exception raised inside an import can be swallowed (torch's C extension imports numpy
    that way and goes on without it) or abort the process (torch.distributed's C++ set-up cannot
    pass it on). A rank started by the launcher makes its ready file at that next call."""
    if _interrupted:
        raise SystemExit(130)

    def handler(signum, frame):
        if not _interrupted:
            _interrupted.append(True)
            say(f"{prog}: interrupted")
            sys.unraisablehook = _raise_again
        if not importing:
            raise SystemExit(130)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)
        ready = os.environ.get(READY_FILE)
        if ready and not importing:
            Path(ready).touch()


def _raise_again(unraisable) -> None:
    """The SystemExit of a Ctrl-C that landed in a callback Python cannot raise from (a weakref's,
    a destructor's) is not printed but delivered again, from another thread a moment later: the
    handler then raises it in the main thread's next line (raise_signal here would run the handler
    inside this hook, where it would be lost again). A second such landing delivers it again."""
    if isinstance(unraisable.exc_value, (SystemExit, KeyboardInterrupt)):
        again = threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGINT))
        again.daemon = True
        again.start()
    else:
        sys.__unraisablehook__(unraisable)


def exit_main(main) -> None:
    """`sys.exit(main())` for a command whose ranks may be interrupted mid-step: after Ctrl-C the
    process ends at once (os._exit, once stdout and stderr are flushed) rather than through
    torch's C++ teardown, which warns of every collective the interrupt left in flight. A rank
    under the launcher (RANK set) ends so too, with main()'s code."""
    try:
        code = main()
    except SystemExit:
        if not _interrupted:
            raise
    if _interrupted:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    if "RANK" in os.environ:  # a rank under the launcher: its work is done and flushed; torch's
        # C++ teardown at exit may still abort ("terminate called without an active
        # exception"), which would replace this exit code (a stopped run's 4) with the abort's
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if code is None else code if isinstance(code, int) else 1)  # as sys.exit
    sys.exit(code)


@contextmanager
def interrupt_held():
    """Ctrl-C within the block takes effect when the block is done (a file being written is
    finished first)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if got and callable(old):
            old(signal.SIGINT, None)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (printed once: by rank 0 when torchrun started many); parsing
    the process's own command line (args None) makes Ctrl-C end it in one line too."""

    def parse_args(self, args=None, namespace=None):
        if args is None:
            end_on_interrupt(self.prog)
        return super().parse_args(args, namespace)

    def error(self, message):
        say(f"{self.prog}: error: {message}; see --help")
        raise SystemExit(2)

    def at_least_one(self, args, *flags: str) -> None:
        """A one-line error for the first of `flags` (attribute names of `args`) given below 1:
        '--FLAG must be at least 1, got VALUE'; a flag left at None is not given."""
        for flag in flags:
            value = getattr(args, flag)
            if value is not None and value < 1:
                self.error(f"--{flag.replace('_', '-')} must be at least 1, got {value}")


_RATE = re.compile(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(?:bit(?:/s)?|bps)")
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """A link rate in bits per second with its unit ('9.71gbit', '100mbit', '10gbps',
    '1gbit/s') -> bytes per second. A bare number is refused: bits or bytes, per second or not,
    it is ambiguous (every command that takes a rate reads it with this)."""
    m = _RATE.fullmatch(str(text).strip().lower())
    value = float(m.group(1)) * _PREFIX[m.group(2)] if m else math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"bandwidth {text!r}: give a positive rate in bits per second with its "
                         f"unit: NUMBER then bit, kbit, mbit, gbit or tbit (or kbps ... tbps), "
                         f"e.g. 100mbit, 10gbit, 9.71gbps")
    return value / 8


def parse_seconds(text: str) -> float:
    """'1ms' / '200us' / '0' / '0.5s' -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"latency {text!r}: give a time like 0, 200us, 1ms or 0.01s")
    return float(m.group(1)) * {"s": 1, "ms": 1e-3, "us": 1e-6, None: 1}[m.group(2)]


def parse_mesh(text: str, gpus: int, error) -> tuple[int, ...]:
    """'8x8' -> (8, 8), '8x2x4' -> (8, 2, 4), checked against the world size;
    `error(message)` otherwise."""
    try:
        shape = tuple(int(n) for n in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) not in (2, 3):
        error(f"--mesh {text}: give MACHINESxGPUS (e.g. 8x8) or MACHINESxBLOCKSxGPUS (8x2x4: "
              f"each machine's GPUs in 2 blocks of 4)")
    if min(shape) < 1 or math.prod(shape) != gpus:
        error(f"--mesh {text}: {' x '.join(map(str, shape))} is not the {gpus} GPUs of --gpus; "
              f"give a mesh whose product is {gpus} (e.g. {max(1, gpus // 8)}x{min(gpus, 8)})")
    return shape


RECOMPUTE_HELP = ("activation checkpointing: 'auto' recomputes in the backward the fewest first "
                  "layers that make a plan fit the device's memory, where it does not fit "
                  "otherwise, selectively (the matmuls' and attention's outputs kept) or "
                  "whole; 'none' never; "
                  "'all', N (the first N layers) or layer names joined by commas (e.g. "
                  "blocks.0,blocks.1) in every plan, whole, or after 'selective:' selectively "
                  "('selective': every layer) (default: auto)")


def number(x: float, digits: int = 4) -> str:
    """x to `digits` significant digits, written out in full where it has more digits before
    the point (72450, never 7.245e+04): how reports print times and sizes."""
    return f"{x:.0f}" if abs(x) >= 10 ** digits else f"{x:.{digits}g}"


def command_logs(prog: str, *own: str) -> None:
    """Log lines on stderr as `prog: message`: the command's own (the loggers `own`: its module,
    its package) from INFO, the library's from WARNING (its INFO lines say what each plan
    ranked, dozens a run)."""
    logging.basicConfig(level=logging.WARNING, format=f"{prog}: %(message)s")
    for name in own:
        logging.getLogger(name).setLevel(logging.INFO)
