"""Python's cyclic garbage collector paused around work that makes many objects and no cycles
(the search), or that is timed (calibration's kernel timings: a collection's pass over a
process's live objects can take a quarter of a second, which would land on whichever kernel was
running)."""
from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def no_gc(collect: bool = False):
    """The collector paused inside the block (after one collection first, with `collect`), and
    running again after it where it ran before."""
    if collect:
        gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
