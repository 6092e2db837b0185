"""scripts/log_windows.py on logs.csv files written the way run.py writes them, against sums worked by hand."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("log_windows", REPO / "scripts" / "log_windows.py")
assert spec is not None and spec.loader is not None
log_windows = importlib.util.module_from_spec(spec)
spec.loader.exec_module(log_windows)

HEADER = ["step", "charts/SPS", "losses/entropy_loss", "stats/ppo_clip_fraction", "stats/grad_norm",
          "losses/baseline_loss", "stats/policy_lag", "charts/mean_return_100"]


def _run(tmp_path: Path, flags: dict, rows: list[list[object]]) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "flags.json").write_text(json.dumps(flags))
    with open(run_dir / "logs.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(HEADER)
        writer.writerows(rows)
    return run_dir


def test_ppo_windows_average_each_column_take_the_last_return_and_turn_the_entropy_loss_into_nats(
        tmp_path: Path) -> None:
    # entropy_cost 0.01: an entropy loss of -0.028 is 2.8 nats per step
    rows = [[1024, 400, -0.028, 0.1, 0.3, 0.02, 2, ""],
            [2048, 400, -0.026, 0.2, 0.5, 0.04, 2, -20.0],
            [3072, 400, -0.020, 0.3, 0.7, 0.06, 1, -18.0],  # the second window: steps 3000-5999
            [4096, 400, -0.018, 0.5, 0.9, 0.08, 3, ""]]
    run_dir = _run(tmp_path, {"policy_loss": "ppo", "entropy_cost": 0.01, "unroll_length": 32,
                              "batch_size": 32, "minibatches": 8}, rows)
    first, second = log_windows.windows(run_dir, 3000)
    assert (first["start"], first["end"], second["start"], second["end"]) == (0, 3000, 3000, 6000)
    assert first["return"] == -20.0 and second["return"] == -18.0  # the last row of the window that has one
    assert math.isclose(first["entropy"], 2.7) and math.isclose(second["entropy"], 1.9)
    assert math.isclose(first["clip fraction"], 0.15) and math.isclose(second["clip fraction"], 0.4)
    assert math.isclose(first["gradient norm"], 0.4) and math.isclose(second["baseline loss"], 0.07)
    assert first["policy lag"] == 2.0 and second["policy lag"] == 2.0


def test_the_impala_loss_sums_a_gradient_steps_entropy_so_it_is_divided_by_its_samples(tmp_path: Path) -> None:
    # IMPALA's loss: entropy_cost 0.0006 x the sum over a gradient step of T x B / minibatches = 5 x 8 / 2 = 20 steps
    rows = [[40, 100, -0.0006 * 20 * 0.5, "", 10.0, 1.0, 0, 9.0]]
    run_dir = _run(tmp_path, {"policy_loss": "impala", "entropy_cost": 0.0006, "unroll_length": 5,
                              "batch_size": 8, "minibatches": 2}, rows)
    (line,) = log_windows.windows(run_dir, 500_000)
    assert math.isclose(line["entropy"], 0.5)
    assert math.isnan(line["clip fraction"])  # no PPO: nothing logged, nothing made up
    assert "| 0-0.5M | 9.0 | 0.500 | nan | 10.000 | 1.000 | 0.000 |" in log_windows.format_table(run_dir, [line])



def test_more_minibatches_than_unrolls_cut_a_batch_into_its_unrolls(tmp_path: Path) -> None:
    # --minibatches 8 of B = 4 unrolls: 4 gradient steps of one unroll, T = 5 steps each
    rows = [[40, 100, -0.0006 * 5 * 0.5, "", 10.0, 1.0, 0, 9.0]]
    run_dir = _run(tmp_path, {"policy_loss": "impala", "entropy_cost": 0.0006, "unroll_length": 5,
                              "batch_size": 4, "minibatches": 8}, rows)
    (line,) = log_windows.windows(run_dir, 500_000)
    assert math.isclose(line["entropy"], 0.5)


def test_a_directory_that_is_not_a_run_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "log_windows.py"), str(tmp_path)],
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"log_windows: error: {tmp_path} has no logs.csv and flags.json (not a run directory?)"]


def test_rows_cut_short_or_garbled_are_left_out_and_damaged_flags_are_one_line(tmp_path: Path) -> None:
    """A kill cuts the last row short, a disk fault garbles bytes: the rest of the table still comes out."""
    rows = [[1024, 400, -0.028, 0.1, 0.3, 0.02, 2, -20.0], [2048, 400, -0.026, "x", 0.5, 0.04, 2, -19.0]]
    run_dir = _run(tmp_path, {"policy_loss": "ppo", "entropy_cost": 0.01}, rows)
    with open(run_dir / "logs.csv", "ab") as f:
        f.write(b"30\xff72,400,-0.5\n20")  # a garbled step, and a row cut short after its step
    (line,) = log_windows.windows(run_dir, 500_000)
    assert line["return"] == -19.0 and math.isclose(line["clip fraction"], 0.1)  # "x" is no number: left out
    assert math.isclose(line["entropy"], 2.7)  # the row of step 20 has no entropy: it counts for nothing
    for flags in ("{not json", "{}"):
        (run_dir / "flags.json").write_text(flags)
        done = subprocess.run([sys.executable, str(REPO / "scripts" / "log_windows.py"), str(run_dir)],
                              check=False, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        assert len(done.stderr.splitlines()) == 1 and "flags.json is not a run's flags" in done.stderr, done.stderr
