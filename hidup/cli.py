"""What every command line of HiDup shares: a bad flag is one line on stderr that names the value
and the rule (argparse's message, or the command's own), then exit code 2."""
from __future__ import annotations

import argparse
import os
import sys


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (printed once: by rank 0 when torchrun started many)."""

    def error(self, message):
        if os.environ.get("RANK", "0") == "0":
            print(f"{self.prog}: error: {message}; see --help", file=sys.stderr)
        raise SystemExit(2)
