"""Per-window averages of a run's logs.csv: the tables RESULTS.md gives beside its curves.

    python scripts/log_windows.py results/runs/atari5-DoubleDunk                 # 0.5M-step windows
    python scripts/log_windows.py RUN_A RUN_B --window 1000000                   # two runs, one table each

For each window of agent steps: the mean of the last 100 training games at the window's last row, and the
window's means of the policy's entropy (nats per step), PPO's clip fraction, the gradient norm before clipping,
the baseline loss and the policy lag (in updates). The entropy comes from `losses/entropy_loss`, which the
learner logs as entropy_cost x sum(pi log pi), averaged over an update's gradient steps: per step for the PPO
loss, summed over a gradient step's samples for the IMPALA loss (flags.json says which, and the sizes).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

COLUMNS = {  # logs.csv column -> table heading; averaged over each window
    "losses/entropy_loss": "entropy",
    "stats/ppo_clip_fraction": "clip fraction",
    "stats/grad_norm": "gradient norm",
    "losses/baseline_loss": "baseline loss",
    "stats/policy_lag": "policy lag",
}
RETURN = "charts/mean_return_100"


def samples_per_entropy_term(flags: dict) -> float:
    """How many steps' pi log pi one logged entropy loss sums: 1 for PPO (a mean), else a gradient step's (of whole
    unrolls: at most one minibatch per unroll, as `learner.gradient_steps` counts them)."""
    if flags.get("policy_loss", "ppo") == "ppo":
        return 1.0
    return flags["unroll_length"] * flags["batch_size"] / max(1, min(flags.get("minibatches", 1), flags["batch_size"]))


class DamagedRun(Exception):
    """A run directory whose flags.json cannot be read as a run's: one line, exit code 2."""


def _number(text: str | None) -> float | None:
    """`text` as a finite number, or None: empty, not a number (a row cut short by a kill, bytes garbled)."""
    try:
        value = float(text or "")
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def windows(run_dir: Path, window: int) -> list[dict[str, float]]:
    """One dict per window that has rows: `start`, `end` (agent steps), `return` and COLUMNS' headings. Rows
    whose step is not a number are left out, and values that are not numbers."""
    try:
        flags = json.loads((run_dir / "flags.json").read_text(errors="replace"))
        per_entropy = float(flags["entropy_cost"]) * samples_per_entropy_term(flags)
    except (ValueError, KeyError, TypeError) as exc:
        raise DamagedRun(f"{run_dir / 'flags.json'} is not a run's flags ({type(exc).__name__}: {exc})") from None
    groups: dict[int, list[dict[str, str]]] = {}
    with open(run_dir / "logs.csv", newline="", errors="replace") as f:
        for row in csv.DictReader(line.replace("\0", "") for line in f):
            step = _number(row.get("step"))
            if step is not None:
                groups.setdefault(int(step) // window, []).append(row)
    table = []
    for index in sorted(groups):
        rows = groups[index]
        returns = [v for r in rows if (v := _number(r.get(RETURN))) is not None]
        line = {"start": index * window, "end": (index + 1) * window, "return": returns[-1] if returns else math.nan}
        for column, heading in COLUMNS.items():
            values = [v for r in rows if (v := _number(r.get(column))) is not None]
            line[heading] = sum(values) / len(values) if values else math.nan
        line["entropy"] = -line["entropy"] / per_entropy if per_entropy else math.nan  # no entropy cost: unknown
        table.append(line)
    return table


def format_table(run_dir: Path, table: list[dict[str, float]]) -> str:
    headings = ["agent steps", "mean of the last 100 games", *COLUMNS.values()]
    lines = [f"{run_dir}", "", "| " + " | ".join(headings) + " |", "|" + "---|" * len(headings)]
    for line in table:
        cells = [f"{line['start'] / 1e6:g}-{line['end'] / 1e6:g}M", f"{line['return']:,.1f}",
                 *(f"{line[h]:.3f}" for h in COLUMNS.values())]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", metavar="RUN_DIR")
    parser.add_argument("--window", type=int, default=500_000, help="agent steps per window")
    args = parser.parse_args()
    if args.window <= 0:
        parser.error(f"--window must be positive, got {args.window}")
    for run_dir in args.runs:
        if not (run_dir / "logs.csv").is_file() or not (run_dir / "flags.json").is_file():
            print(f"log_windows: error: {run_dir} has no logs.csv and flags.json (not a run directory?)", file=sys.stderr)
            return 2
    try:
        tables = [format_table(run_dir, windows(run_dir, args.window)) for run_dir in args.runs]
    except DamagedRun as exc:
        print(f"log_windows: error: {exc}", file=sys.stderr)
        return 2
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
