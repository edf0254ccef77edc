"""Where the experiments write. By default into a scratch folder, out/EXPERIMENT (git-ignored),
never into experiments/results/: that folder holds the committed full-size results the docs
shows. Refreshing them takes an explicit `--out experiments/results/...`, and never a --quick run
(tiny models, fewer points)."""
from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"  # committed: the figures in docs/


def default_out(experiment: str) -> Path:
    """The scratch folder of an experiment, relative to where the command runs."""
    return Path("out") / experiment


def committed(path: Path) -> bool:
    """Whether `path` is (or is inside) the committed results folder."""
    return Path(path).resolve().is_relative_to(RESULTS)


def refuse_quick_into_results(ap, out: Path, quick: bool, experiment: str) -> None:
    """A --quick run into experiments/results/ stops with one line (ap.error: exit 2)."""
    if quick and committed(out):
        ap.error(f"--out {out}: a --quick run (reduced size) must not overwrite the "
                 f"committed full-size results in experiments/results/; leave out --out (it "
                 f"writes to {default_out(experiment)}/, git-ignored) or give another folder")


def note(out: Path, experiment: str) -> str:
    """One line after a run: where the files went and how the committed ones are refreshed."""
    if committed(out):
        return f"refreshed committed results in {out}/ (check `git diff --stat` before committing)"
    return (f"{out}/ is scratch (not the figures in docs/); the committed results are refreshed "
            f"with a full run and --out experiments/results/{experiment}")


def pyplot():
    """matplotlib's pyplot, drawing to files (Agg), its own log quiet: building its font cache
    on a first run logs lines that say nothing about the figure."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.ERROR)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
