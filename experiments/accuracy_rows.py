"""What experiments.accuracy measures of one configuration (model x strategy x Duplex on a
cluster): its Row, and reading the Rows back from the accuracy.csv a run wrote."""
from __future__ import annotations

import csv
import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import get_type_hints


@dataclass
class Row:
    model: str
    strategy: str
    k: int
    bandwidth: str
    hosts: int
    ranks_per_host: int
    predicted_ms: float
    measured_ms: float
    predicted_computation_ms: float
    predicted_communication_ms: float
    predicted_overlap: float
    kernels_measured: float  # share of the Program's kernels with a measured time
    measured_low_ms: float = math.nan  # the fastest and slowest of the rounds' measurements
    measured_high_ms: float = math.nan
    drift: float = math.nan  # the machine's speed probe around the run / around the kernels'
    #   calibration, median over rounds (1.1: the machine was 10% slower when it ran)

    @property
    def spread(self) -> float:
        """How far apart the rounds measured the same configuration (slowest / fastest - 1)."""
        return self.measured_high_ms / self.measured_low_ms - 1.0

    @property
    def error(self) -> float:
        return self.predicted_ms / self.measured_ms - 1.0

    @property
    def error_at_run_speed(self) -> float:
        """The error had the kernels been timed at the speed the machine had when this ran
        (the prediction scaled by the drift): what is left once the machine's drift is out."""
        return self.predicted_ms * self.drift / self.measured_ms - 1.0

    @property
    def cluster(self) -> str:
        return f"{self.hosts}x{self.ranks_per_host} {self.bandwidth}"


def read_rows(folder: Path) -> list[Row]:
    """The configurations an earlier run wrote to `folder`/accuracy.csv."""
    path = folder / "accuracy.csv"
    if not path.is_file():
        raise ValueError(f"--combine {folder}: no accuracy.csv there; give folders an "
                         f"experiments.accuracy run wrote (its --out)")
    columns = get_type_hints(Row)  # str, int or float: each converts its column's text
    needed = {f.name for f in fields(Row) if f.default is MISSING}  # older runs lack the rest
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = sorted(needed - set(reader.fieldnames or ()))
        if missing:
            raise ValueError(f"--combine {folder}: accuracy.csv lacks the columns {missing}; "
                             f"re-run that experiment with this version to write them")
        try:
            return [Row(**{name: kind(line[name]) for name, kind in columns.items()
                           if name in line}) for line in reader]
        except ValueError as exc:
            raise ValueError(f"--combine {folder}: line {reader.line_num} of accuracy.csv: "
                             f"{exc}") from None
