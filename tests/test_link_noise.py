"""experiments.link_noise: its summary line's arithmetic and its flags' errors."""
from __future__ import annotations

import pytest

from experiments.link_noise import parse_args, summary


def test_the_summary_gives_the_round_means_spread_and_the_stalls_share():
    line = summary(4096, [0.001, 0.003], [0.0005, 0.0005, 0.001, 0.020])
    assert "round means 1.00-3.00 ms (cv 50%)" in line
    assert "calls median 0.75" in line and "max 20.0 ms" in line
    assert "1 of 4 over 10 ms, 91% of the time" in line  # 20 of 22 ms


def test_bad_flags_say_what_is_allowed(capsys):
    for argv, words in ((["--rounds", "0"], "--rounds 0: must be at least 1"),
                        (["--sizes", "2"], "--sizes 2: a size is at least 4 bytes"),
                        (["--pause", "-1"], "--pause -1.0: must be 0 or more")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert words in capsys.readouterr().err
