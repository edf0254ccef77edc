"""What a long command is doing now, on one line of stderr that it rewrites in place.

Library code says its stage with `progress("search over 64 GPUs: op", 120, 410)`: a DEBUG record
of the `hidup.progress` logger, which costs next to nothing where no one listens (and stays out
of a command's INFO log: there is one per op of each search). A command shows those records
with `status_line(verbose)`: on a terminal, one line that each record rewrites (the seconds
since the command began, the stage, how far), cleared when the command is done; with -v (or
when stderr is not a terminal) nothing is rewritten, and a DEBUG log (simulator.predict -vv)
prints them as any other line. Nothing goes to stdout, which scripts parse."""
from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager

LOG = logging.getLogger("hidup.progress")
REFRESH_S = 0.1  # the least time between two rewrites of the line (the last is always shown)


def progress(what: str, done: int | None = None, total: int | None = None) -> None:
    """Say the stage a long piece of work is at (`what`), and how far (`done` of `total`)."""
    if LOG.isEnabledFor(logging.DEBUG):
        LOG.debug("%s %d of %d" if total else "%s", what, *((done, total) if total else ()))


class StatusLine:
    """One line on a stream, rewritten in place: the seconds since it began, then the text."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.start, self.width, self.shown = time.perf_counter(), 0, 0.0

    def write(self, text: str, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.shown < REFRESH_S:
            return
        line = f"{now - self.start:6.1f} s  {text}"
        self.stream.write("\r" + line.ljust(self.width))
        self.stream.flush()
        self.width, self.shown = len(line), now

    def end(self, text: str | None = None) -> None:
        """Clear the line, or leave `text` on it, and go to the next line only with text."""
        if text is None:
            self.stream.write("\r" + " " * self.width + "\r")
        else:
            self.stream.write("\r" + text.ljust(self.width) + "\n")
        self.stream.flush()
        self.width = 0


class _Handler(logging.Handler):
    def __init__(self, line: StatusLine):
        super().__init__(logging.DEBUG)
        self.line = line

    def emit(self, record: logging.LogRecord) -> None:
        self.line.write(record.getMessage())


@contextmanager
def status_line(verbose: bool = False, stream=None):
    """Show `progress` records on one rewritten line of `stream` (stderr) while the block runs,
    where that stream is a terminal and the command is not verbose (-v logs them instead)."""
    stream = stream or sys.stderr
    if verbose or not stream.isatty():
        yield
        return
    line = StatusLine(stream)
    handler = _Handler(line)
    level, propagate = LOG.level, LOG.propagate
    LOG.addHandler(handler)
    LOG.setLevel(logging.DEBUG)
    LOG.propagate = False
    try:
        yield
    finally:
        LOG.removeHandler(handler)
        LOG.setLevel(level)
        LOG.propagate = propagate
        line.end()
