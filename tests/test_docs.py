"""The docs say what their commands print: every block marked `<!-- output of (checked): CMD -->`
in README.md and docs/ is re-run and must be what CMD prints now, character for character
(experiments.docs_blocks; the slow blocks are refreshed with its --write)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from experiments import docs_blocks

BLOCKS = [b for page in docs_blocks.pages() for b in docs_blocks.blocks(page)]


def test_the_marks_hold_blocks_and_the_main_job_is_checked():
    assert BLOCKS and all(b.text.strip() for b in BLOCKS), [str(b) for b in BLOCKS]
    assert any(b.checked and b.command == "python -m simulator.predict" and
               b.page.name == "README.md" for b in BLOCKS)


CHECKED = [b for b in BLOCKS if b.checked]


@pytest.fixture(scope="module")
def printed():
    """What each checked block's command prints (by command), the commands run two at a time
    from the first test that asks (each is a process of its own, or two ranks, much of it
    single-threaded Python)."""
    with ThreadPoolExecutor(2) as pool:
        yield {c: pool.submit(docs_blocks.run, c, timeout=600)
               for c in dict.fromkeys(b.command for b in CHECKED)}


@pytest.mark.parametrize("block", CHECKED, ids=str)
def test_a_checked_block_is_what_its_command_prints(block, printed):
    assert printed[block.command].result() == block.text, (
        f"{block} differs from what the command prints: run python -m experiments.docs_blocks "
        f"--write --match '{block.command}' and read the change")


def test_a_mark_without_a_block_is_refused(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n<!-- output of: python -m simulator.predict -->\nno block\n")
    with pytest.raises(ValueError, match=r"page.md:2: .* is followed neither by a fenced block"):
        docs_blocks.blocks(page)
    page.write_text("<!-- output of: python -m x -->\n| a |\n| --- |\n<!-- end of output -->\n")
    (table,) = docs_blocks.blocks(page)  # markdown, rendered: up to the end mark
    assert not table.checked and table.text == "| a |\n| --- |"
    page.write_text("<!-- output of (checked): python -m x -->\n```\nout\n```\n")
    (block,) = docs_blocks.blocks(page)
    assert block.checked and block.command == "python -m x" and block.text == "out"
    docs_blocks.rewrite(block, "new\nlines")
    assert page.read_text() == "<!-- output of (checked): python -m x -->\n```\nnew\nlines\n```\n"
