"""What a run reports: TensorBoard scalars, a CSV of the same scalars, and the console.

Tags follow the CleanRL / Stable-Baselines3 grouping: `charts/`, `losses/`, `stats/`, `timing/`,
always against agent steps.
"""

from __future__ import annotations

import csv
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger("impala")


class RunLog:
    """TensorBoard event files and `logs.csv` in the run directory.

    `purge_step` (when resuming) drops events a killed run wrote after its last checkpoint, so the
    resumed curve continues the old one instead of overlapping it.
    """

    def __init__(self, run_dir: str | os.PathLike, purge_step: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.writer = SummaryWriter(log_dir=str(self.run_dir), purge_step=purge_step)
        self._csv_path = self.run_dir / "logs.csv"
        self._csv_file: Any = None
        self._csv: csv.DictWriter | None = None

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Write each `tag: value` at `step` to TensorBoard and one row to the CSV."""
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self._write_csv({"step": step, **values})

    def scalar(self, tag: str, value: float, step: int) -> None:
        """One TensorBoard scalar, not in the CSV (e.g. one per finished episode)."""
        self.writer.add_scalar(tag, value, step)

    def text(self, tag: str, text: str) -> None:
        self.writer.add_text(tag, text, 0)

    def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        clean = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in hparams.items()}
        self.writer.add_hparams(clean, dict(metrics), run_name=".")

    def _write_csv(self, row: dict[str, float]) -> None:
        if self._csv is None:
            fieldnames = list(row)
            if self._csv_path.exists() and self._csv_path.stat().st_size > 0:
                with open(self._csv_path, newline="") as f:
                    fieldnames = next(csv.reader(f), fieldnames)  # appending to a resumed run
                self._csv_file = open(self._csv_path, "a", newline="")  # noqa: SIM115 - open for the whole run
                self._csv = csv.DictWriter(self._csv_file, fieldnames, extrasaction="ignore")
            else:
                self._csv_file = open(self._csv_path, "w", newline="")  # noqa: SIM115 - open for the whole run
                self._csv = csv.DictWriter(self._csv_file, fieldnames, extrasaction="ignore")
                self._csv.writeheader()
        self._csv.writerow(row)
        self._csv_file.flush()

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        if self._csv_file is not None:
            self._csv_file.close()


def setup_console(log_file: str | os.PathLike | None = None) -> None:
    """Log `impala` messages to stdout and, when given, to `log_file` (appending)."""
    log.setLevel(logging.INFO)
    log.propagate = False
    formatter = logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
               for h in log.handlers):
        stream = logging.StreamHandler(sys.stdout)
        stream.setFormatter(formatter)
        log.addHandler(stream)
    if log_file is not None:
        file_handler = logging.FileHandler(log_file, mode="a")
        file_handler.setFormatter(formatter)
        log.addHandler(file_handler)


def close_console() -> None:
    for handler in list(log.handlers):
        if isinstance(handler, logging.FileHandler):
            handler.close()
            log.removeHandler(handler)
