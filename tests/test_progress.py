"""The progress line of long commands (hidup.cli.progress): on a terminal one line of stderr,
rewritten in place and cleared at the end; nothing where stderr is not a terminal or with -v;
the search says which programme and op it is at."""
import io
import logging

from hidup.cli.progress import LOG, progress, status_line


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_line_is_rewritten_in_place_then_cleared():
    tty = Terminal()
    with status_line(stream=tty):
        progress("capturing gpt:small, batch 8")
        progress("search on 8 GPUs, k=2: op", 3, 40)
    text = tty.getvalue()
    assert text.startswith("\r") and "capturing gpt:small, batch 8" in text
    assert text.endswith("\r") and "\n" not in text  # cleared: the next output starts clean
    assert LOG.handlers == [] and LOG.propagate  # as before the command


def test_an_info_log_does_not_carry_the_progress_records(caplog):
    """A command logging at INFO (experiments.paper, -v) gets no line per op of the search."""
    with caplog.at_level(logging.INFO):
        progress("search on 8 GPUs, k=2: op", 3, 40)
    assert not [r for r in caplog.records if r.name == "hidup.progress"]


def test_nothing_is_rewritten_off_a_terminal_or_with_verbose():
    for stream, verbose in ((io.StringIO(), False), (Terminal(), True)):
        with status_line(verbose, stream):
            progress("search on 8 GPUs, k=2: op", 3, 40)
        assert stream.getvalue() == ""


def test_the_search_says_its_programme_and_op(caplog):
    from hidup.models import capture_model, get_model
    from hidup.planning.profile_file import load_profile
    from hidup.planning.programme import Search, SearchOptions

    graph = capture_model(get_model("mlp:tiny", gpus=2), 8)
    with caplog.at_level(logging.DEBUG, logger="hidup.progress"):
        Search(graph, 2, load_profile("v100-1x4-nvlink"), SearchOptions(k=2)).run()
    said = [r.getMessage() for r in caplog.records if r.name == "hidup.progress"]
    n = len(graph.ops)
    assert said[0] == f"search on 2 GPUs, k=2: op 1 of {n}"
    assert said[-1] == f"search on 2 GPUs, k=2: op {n} of {n}"
