"""Rerun the learning results of RESULTS.md and draw their curves.

    python scripts/results.py pong                       # the README's default command, to its end
    python scripts/results.py breakout --minutes 120     # the same defaults on Breakout, stopped after 2 h
    python scripts/results.py cartpole --seeds 5         # the README's CartPole command, seeds 0..4
    python scripts/results.py pong --plot-only --savedir DIR --xpid NAME   # redraw from an existing run
    python scripts/results.py pong --compare DIR1 DIR2 --labels A B --out cmp.png   # existing runs side by side
    python scripts/results.py spaceinvaders --xpid si-linear --total_steps 1500000 --lr_schedule linear

Flags this script does not know are passed on to `run.py` after the experiment's own (the last one wins).

Each run trains with `run.py` in SAVEDIR (default results/runs), then plays `--test_episodes` greedy
games with `run.py --mode test`, prints one summary line per run (final mean of the last 100 training
games, agent steps, wall time, greedy test mean) and writes a PNG of the return against agent steps and
against wall time (default docs/results/NAME.png). With several seeds it also prints the spread.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from impala.plotting import smooth  # the repository root is on the path only now

# The commands behind the results; flags not named here are run.py's defaults.
EXPERIMENTS = {
    "pong": ["--env", "PongNoFrameskip-v4"],
    "breakout": ["--env", "BreakoutNoFrameskip-v4"],
    "spaceinvaders": ["--env", "SpaceInvadersNoFrameskip-v4"],
    "cartpole": ["--env", "CartPole-v1", "--num_actors", "2", "--envs_per_actor", "4", "--unroll_length", "5",
                 "--batch_size", "8", "--learning_rate", "0.001", "--entropy_cost", "0.01",
                 "--total_steps", "300000", "--policy_loss", "impala", "--optimizer", "rmsprop", "--epsilon", "0.01",
                 "--grad_norm_clipping", "40", "--epochs", "1", "--minibatches", "1", "--vtrace_lambda", "1", "--lr_schedule", "linear"],
}
RETURN_TAG = "charts/episodic_return"
LAST_GAMES = 100


def train(name: str, seed: int, savedir: Path, xpid: str, minutes: float | None, run_flags: list[str]) -> None:
    """Run the experiment's command; with `minutes`, stop it with Ctrl-C's signal after that long."""
    command = [sys.executable, "run.py", *EXPERIMENTS[name], *run_flags, "--seed", str(seed),
               "--savedir", str(savedir), "--xpid", xpid]
    print("$ " + " ".join(command[1:]), flush=True)
    process = subprocess.Popen(command, cwd=ROOT)
    try:
        process.wait(timeout=minutes * 60 if minutes else None)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)  # a stopped run writes its checkpoint and ends in order
        process.wait()


def greedy_test(env: str, savedir: Path, xpid: str, episodes: int) -> float:
    command = [sys.executable, "run.py", "--mode", "test", "--env", env, "--savedir", str(savedir), "--xpid", xpid,
               "--test_episodes", str(episodes)]
    output = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    match = re.search(r"Mean return over \d+ episodes: (-?[\d.]+)", output)
    if match is None:
        raise RuntimeError(f"no mean return in the test output:\n{output}")
    return float(match.group(1))


def episodes(run_dir: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every finished game of a run: agent step, return, and wall seconds since the run's first event."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    events = accumulator.Scalars(RETURN_TAG)
    first_wall = min(accumulator.Scalars(tag)[0].wall_time for tag in accumulator.Tags()["scalars"])
    steps = np.array([e.step for e in events], np.int64)
    returns = np.array([e.value for e in events], np.float64)
    walls = np.array([e.wall_time - first_wall for e in events], np.float64)
    order = np.argsort(steps, kind="stable")
    return steps[order], returns[order], walls[order]


def summary(run_dir: Path) -> dict:
    steps, returns, walls = episodes(run_dir)
    flags = json.loads((run_dir / "flags.json").read_text())
    meta = json.loads((run_dir / "meta.json").read_text())
    return {"xpid": run_dir.name, "env": flags["env"], "games": len(returns), "final_step": meta.get("final_step"),
            "last_episode_step": int(steps[-1]) if len(steps) else None, "wall_s": float(walls[-1]) if len(walls) else None,
            f"mean_last_{LAST_GAMES}": float(returns[-LAST_GAMES:].mean()) if len(returns) else None,
            "command": meta.get("command")}


def figure(run_dirs: list[Path], title: str, labels: list[str] | None = None) -> Figure:
    """Return against agent steps (left) and wall time (right): raw games faint, mean of the last 100 bold."""
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    by_steps, by_wall = fig.subplots(1, 2, sharey=True)
    curves = [episodes(run_dir) for run_dir in run_dirs]
    longest_s = max((float(walls[-1]) for _, _, walls in curves if len(walls)), default=0.0)
    unit, seconds = ("hours", 3600) if longest_s > 7200 else ("minutes", 60)
    for i, (run_dir, (steps, returns, walls)) in enumerate(zip(run_dirs, curves)):
        mean = smooth(returns, LAST_GAMES)
        for axes, x in ((by_steps, steps), (by_wall, walls / seconds)):
            axes.plot(x, returns, color=f"C{i % 10}", alpha=0.15, linewidth=0.6)
            axes.plot(x, mean, color=f"C{i % 10}", linewidth=2, label=labels[i] if labels else run_dir.name)
    by_steps.set_xlabel("agent steps")
    by_steps.xaxis.set_major_formatter(EngFormatter())
    by_wall.set_xlabel(f"wall time ({unit})")
    by_steps.set_ylabel(f"return per game (bold: mean of the last {LAST_GAMES})")
    for axes in (by_steps, by_wall):
        axes.grid(alpha=0.3)
    by_steps.legend(loc="best")
    fig.suptitle(title)
    return fig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=sorted(EXPERIMENTS))
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1, one run each")
    parser.add_argument("--minutes", type=float, default=None, help="stop each run after this long")
    parser.add_argument("--savedir", type=Path, default=ROOT / "results" / "runs")
    parser.add_argument("--xpid", default=None, help="run name (default: EXPERIMENT, or EXPERIMENT-sN per seed)")
    parser.add_argument("--test_episodes", type=int, default=10)
    parser.add_argument("--plot-only", action="store_true", help="do not train: summarise and plot existing runs")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default docs/results/EXPERIMENT.png)")
    parser.add_argument("--compare", type=Path, nargs="+", default=None, metavar="RUN_DIR",
                        help="do not train or test: summarise these run directories and plot them together")
    parser.add_argument("--labels", nargs="+", default=None, help="--compare: a legend label per run directory")
    args, run_flags = parser.parse_known_args()
    if run_flags and (args.compare or args.plot_only):
        parser.error(f"unknown flags {' '.join(run_flags)}: run.py's flags are for training runs only")
    if args.compare:
        if args.labels and len(args.labels) != len(args.compare):
            parser.error(f"--labels needs one label per run directory ({len(args.compare)})")
        for run_dir in args.compare:
            print(json.dumps(summary(run_dir)), flush=True)
        out = args.out or ROOT / "docs" / "results" / f"{args.experiment}_compare.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        figure(args.compare, f"{EXPERIMENTS[args.experiment][1]}: runs compared", args.labels).savefig(out, dpi=100)
        print(f"Wrote {out}")
        return 0

    env = EXPERIMENTS[args.experiment][1]
    names = [args.xpid] if args.xpid and args.seeds == 1 else [
        (args.xpid or args.experiment) + (f"-s{seed}" if args.seeds > 1 else "") for seed in range(args.seeds)]
    rows = []
    for seed, xpid in enumerate(names):
        start = time.monotonic()
        if not args.plot_only:
            train(args.experiment, seed, args.savedir, xpid, args.minutes, run_flags)
        row = summary(args.savedir / xpid)
        if not args.plot_only:
            row["process_wall_s"] = round(time.monotonic() - start, 1)
        row["greedy_test_mean"] = greedy_test(env, args.savedir, xpid, args.test_episodes)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if len(rows) > 1:
        finals = np.array([r[f"mean_last_{LAST_GAMES}"] for r in rows])
        print(f"{args.experiment}: mean of the last {LAST_GAMES} games per seed "
              f"{', '.join(f'{v:.1f}' for v in finals)}; min {finals.min():.1f}, max {finals.max():.1f}, "
              f"mean {finals.mean():.1f} +- {finals.std():.1f}")
    out = args.out or ROOT / "docs" / "results" / f"{args.experiment}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    figure([args.savedir / n for n in names], f"{env}: {', '.join(names)}").savefig(out, dpi=100)
    print(f"Wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
