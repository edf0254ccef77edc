"""The docs' command outputs, kept true. In README.md and docs/*.md, a fenced block right after a
line

    <!-- output of: COMMAND -->

is what COMMAND prints on stdout, run from the repository's root (`python` is this interpreter);
where the command prints markdown (a table), the lines between the mark and a line
`<!-- end of output -->` hold it instead, rendered;
`<!-- output of (checked): COMMAND -->` marks one that the tests re-run and compare
(tests/test_docs.py: the fast ones). This command re-runs the blocks' commands:

    python -m experiments.docs_blocks            # compare every block, list those that differ
    python -m experiments.docs_blocks --checked  # only the checked ones (what the tests do)
    python -m experiments.docs_blocks --write    # rewrite the blocks with what is printed now

A block's prose around it must not repeat its figures: they are the block's own."""
from __future__ import annotations

import difflib
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hidup.cli import Parser

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"^<!-- output of( \(checked\))?: (.+) -->\s*$")
END = "<!-- end of output -->"


@dataclass(frozen=True)
class Block:
    """One command's output block in a page: its lines [first, last) hold the output."""

    page: Path
    command: str
    checked: bool
    first: int  # the output's first line (after the opening fence, if fenced)
    last: int  # the closing fence's line, or the end mark's
    text: str  # what the block holds now

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.first} `{self.command}`"


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every page of docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The marked blocks of one page; a ValueError where a mark has no fenced block after it."""
    lines = page.read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        mark = MARK.match(line)
        if not mark:
            continue
        fenced = i + 1 < len(lines) and lines[i + 1].startswith("```")
        first = i + 2 if fenced else i + 1
        end = next((j for j in range(first, len(lines))
                    if (lines[j].startswith("```") if fenced else lines[j] == END)), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: '{line.strip()}' is followed neither by a fenced "
                             f"block (```) nor by lines closed with '{END}'; put the command's "
                             f"output right after it")
        found.append(Block(page, mark.group(2), bool(mark.group(1)), first, end,
                           "\n".join(lines[first:end])))
    return found


def run(command: str, timeout: float = 1800) -> str:
    """What `command` prints on stdout, run from the repository's root (trailing spaces and
    blank lines at its end dropped, as a page holds them)."""
    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        raise RuntimeError(f"`{command}` exited {done.returncode}: {tail[0]}")
    return "\n".join(line.rstrip() for line in done.stdout.rstrip().splitlines())


def rewrite(block: Block, output: str) -> None:
    """Put `output` in the block's place in its page."""
    lines = block.page.read_text().splitlines()
    lines[block.first:block.last] = output.splitlines()
    block.page.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = Parser(prog="python -m experiments.docs_blocks",
               description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--checked", action="store_true",
                   help="only the blocks marked '(checked)' (the fast ones the tests re-run)")
    p.add_argument("--write", action="store_true",
                   help="rewrite each block with what its command prints now (default: "
                        "compare, and list the blocks that differ)")
    p.add_argument("--match", default="",
                   help="only the blocks whose command contains this text")
    args = p.parse_args(argv)
    todo = [b for page in pages() for b in blocks(page)
            if (b.checked or not args.checked) and args.match in b.command]
    differ = 0
    # from the last block up, so that rewriting one leaves the line numbers of those above
    for block in sorted(todo, key=lambda b: (str(b.page), -b.first)):
        start = time.perf_counter()
        print(f"{block} ...", file=sys.stderr, flush=True)
        output = run(block.command)
        took = time.perf_counter() - start
        if output == block.text:
            print(f"same      {block} ({took:.0f} s)")
        elif args.write:
            rewrite(block, output)
            print(f"rewritten {block} ({took:.0f} s)")
        else:
            differ += 1
            print(f"differs   {block} ({took:.0f} s)")
            sys.stdout.writelines(difflib.unified_diff(
                (block.text + "\n").splitlines(True), (output + "\n").splitlines(True),
                "page", "command", n=0))
    print(f"{len(todo)} blocks, {differ} differ" if not args.write else f"{len(todo)} blocks")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
