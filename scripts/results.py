"""Rerun the learning results of RESULTS.md and draw their curves.

    python scripts/results.py pong                       # the README's default command, to its end
    python scripts/results.py breakout --minutes 120     # the same defaults on Breakout, stopped after 2 h
    python scripts/results.py cartpole --seeds 5         # the README's CartPole command, seeds 0..4
    python scripts/results.py pong --plot-only --savedir DIR --xpid NAME   # redraw from an existing run
    python scripts/results.py pong --compare DIR1 DIR2 --labels A B --out cmp.png   # existing runs side by side
    python scripts/results.py spaceinvaders --xpid si-linear --total_steps 1500000 --lr_schedule linear
    python scripts/results.py atari5                     # the five Atari-5 games, 10M steps each; rerun to resume
    python scripts/results.py atari5 --games Qbert --minutes 60   # one game for an hour (machines, sessions)
    python scripts/results.py atari5 --plot-only         # the Atari-5 table from the runs that exist, no training
    python scripts/results.py atari5 --keep docs/results/atari5   # and keep each game's row and curve in the repository

Flags this script does not know are passed on to `run.py` after the experiment's own (the last one wins).

Each run trains with `run.py` in SAVEDIR (default results/runs), then plays `--test_episodes` greedy
games with `run.py --mode test`, prints one summary line per run (final mean of the last 100 training
games, agent steps, wall time, greedy test mean) and writes a PNG of the return against agent steps and
against wall time (default docs/results/NAME.png); the wall time of a resumed run leaves out the pauses between
its sessions. With several seeds it also prints the spread.

`atari5` trains the README's default command on each Atari-5 game for 10M agent steps (XPID atari5-GAME),
one game after the other. Rerunning it skips the games that finished (and were tested), resumes the one
with a checkpoint and starts the rest. Each run's atari5.json records every session's wall time and
machine; the table (training and greedy returns, human-normalised scores, Atari-5's predicted Atari-57
median, CleanRL's published PPO beside ours, settings and sources) is printed and written to
SAVEDIR/atari5.md and SAVEDIR/atari5.json, and the five curves to SAVEDIR/atari5.png (or --out).
docs/atari5.md explains every number. A run directory lives on one machine; `--keep docs/results/atari5`
also keeps each game's row and curve there, in the repository, so that games trained on different machines
make one table and figure, and a game kept as finished is not trained again.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
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

from impala import atari5  # the repository root is on the path only now
from impala.config import OneLineErrorParser, UserError, whole_number
from impala.events import event_files, read_scalars
from impala.plotting import (
    CSV_RETURN_COLUMN,
    damaged_events_line,
    damaged_rows_line,
    figure_path_problem,
    save_figure,
    series_from_csv,
    smooth,
)
from impala.stopping import Terminated, sigterm_as_ctrl_c

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
# Atari-5: the README's default command (`python run.py --env GAME`) for 10M agent steps (40M frames).
ATARI5_STEPS = 10_000_000
ATARI5_FLAGS = ["--total_steps", str(ATARI5_STEPS)]
ATARI5_RECORD = "atari5.json"  # in each run directory: its sessions (wall time, machine) and greedy test
RETURN_TAG = "charts/episodic_return"
KEPT_CURVE_POINTS = 200  # a kept record's curve: the mean of the last 100 games at most this many times
LAST_GAMES = 100


def train(name: str, seed: int, savedir: Path, xpid: str, minutes: float | None, run_flags: list[str],
          experiment_flags: list[str] | None = None) -> int:
    """Run the experiment's command; with `minutes`, stop it with Ctrl-C's signal after that long.
    Returns run.py's exit code (130 when stopped that way)."""
    command = [sys.executable, "run.py", *(EXPERIMENTS[name] if experiment_flags is None else experiment_flags),
               *run_flags, "--seed", str(seed), "--savedir", str(savedir), "--xpid", xpid]
    print("$ " + " ".join(command[1:]), flush=True)
    process = subprocess.Popen(command, cwd=ROOT)
    try:
        process.wait(timeout=minutes * 60 if minutes else None)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)  # a stopped run writes its checkpoint and ends in order
        process.wait()
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: let the run save before we stop
        # The signal may have come to this process alone (`kill PID`): the run gets it too (a run that had it
        # already, from the terminal's Ctrl-C to the whole group, takes its first and ignores the second).
        process.send_signal(signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
        process.wait()
        raise
    return process.returncode


def greedy_test(savedir: Path, xpid: str, episodes: int) -> tuple[float, str]:
    """Test mode's mean return and its line on the games' lengths ("Games lasted A-B agent steps ..."), on the env
    the run trained (an --env given to the experiment wins over its own)."""
    command = [sys.executable, "run.py", "--mode", "test", "--savedir", str(savedir), "--xpid", xpid,  # its own env
               "--test_episodes", str(episodes)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:  # no checkpoint yet, for one: run.py's own line says why
        raise SystemExit(f"results: the greedy test of {xpid} failed: {done.stderr.strip() or done.returncode}")
    output = done.stdout
    match = re.search(r"Mean return over \d+ episodes?: (-?[\d.]+)", output)
    lengths = re.search(r"^Games lasted .*$", output, re.MULTILINE)
    if match is None or lengths is None:
        raise RuntimeError(f"no mean return or game lengths in the test output:\n{output}")
    return float(match.group(1)), lengths.group(0)


def episodes(run_dir: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every finished game of a run: agent step, return, and the seconds it had trained by then (from the run's
    first event, less the pauses between its sessions)."""
    scalars = read_scalars(run_dir, (RETURN_TAG,))
    if scalars.damaged:
        print(damaged_events_line(run_dir.name, scalars.damaged))
    points = scalars.points[RETURN_TAG]
    steps = np.array([point[0] for point in points], np.int64)
    walls = scalars.active_s(np.array([point[1] for point in points], np.float64))
    returns = np.array([point[2] for point in points], np.float64)
    order = np.argsort(steps, kind="stable")
    return steps[order], returns[order], walls[order]


def summary(run_dir: Path) -> dict:
    steps, returns, walls = episodes(run_dir)
    flags, meta = _read_json(run_dir / "flags.json"), _read_json(run_dir / "meta.json")  # {} where cut short
    return {"xpid": run_dir.name, "env": flags.get("env"), "games": len(returns), "final_step": meta.get("final_step"),
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

# ------------------------------------------------------------------------------------------------ Atari-5


def atari5_xpid(prefix: str, env_id: str, seed: int, seeds: int) -> str:
    """`atari5-BattleZone`, or `atari5-BattleZone-s1` with several seeds."""
    return f"{prefix}-{env_id.removesuffix('NoFrameskip-v4')}" + (f"-s{seed}" if seeds > 1 else "")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_text(path: Path, text: str, what: str) -> None:
    """Write `text` to `path` (`what` it is, for the message) atomically: a full disk leaves the previous file
    whole. A path that cannot take it (a directory, no permission, no space) is a UserError naming it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)  # never onto a directory: that is EISDIR
    except OSError as exc:
        raise UserError(f"cannot write {what} {path}: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def run_state(run_dir: Path, total_steps: int | None = None) -> str:
    """What a rerun does with `run_dir`: "finished" (trained to `total_steps`, else to its own: skip it), "resume"
    (a checkpoint to continue from: run.py resumes it given the same --xpid) or "new" (train from the start; run.py
    refuses a directory whose meta.json records a checkpoint that is gone)."""
    meta, flags = _read_json(run_dir / "meta.json"), _read_json(run_dir / "flags.json")
    target = total_steps if total_steps is not None else flags.get("total_steps", float("inf"))
    if (meta.get("final_step") or 0) >= target:  # a stop that came with the last update too: run.py trains it no
        return "finished"                        # further
    return "resume" if (run_dir / "model.tar").is_file() else "new"


def total_steps_given(flags: list[str]) -> int | None:
    """The last --total_steps of run.py's `flags` (as run.py reads them), or None where there is none or it is no
    whole number (run.py's own line then says so)."""
    value = None
    for index, token in enumerate(flags):
        if token == "--total_steps" and index + 1 < len(flags):
            value = flags[index + 1]
        elif token.startswith("--total_steps="):
            value = token.partition("=")[2]
    try:
        return whole_number(value) if value is not None else None
    except argparse.ArgumentTypeError:
        return None


def machine_description() -> str:
    """CPU model and usable cores, and the GPU if any, e.g. `AMD EPYC, 2 cores, cpu (no CUDA device)`."""
    from impala.bench import machine  # torch and the trainer: only when a run is recorded

    m = machine()
    return f"{m['cpu']}, {m['cores_usable']} cores, {m['device']}"


def record_session(run_dir: Path, wall_s: float, state_before: str, machine: str) -> None:
    """Add one training session (its wall time, machine, the step it reached) to the run's atari5.json."""
    path = run_dir / ATARI5_RECORD
    record = _read_json(path)
    record.setdefault("sessions", []).append({
        "ended": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "wall_s": round(wall_s, 1),
        "was": state_before, "machine": machine, "final_step": _read_json(run_dir / "meta.json").get("final_step")})
    if run_dir.is_dir():
        write_text(path, json.dumps(record, indent=2) + "\n", "the session record")


def save_session(args: argparse.Namespace, run_dir: Path, env_id: str, seed: int, wall_s: float, state_before: str,
                 machine: str, ending: bool) -> None:
    """Record a training session (`record_session`) and, with --keep, keep the game so far (a device call that ends
    here keeps it). A write that fails is a UserError, unless the script is `ending` anyway (Ctrl-C, SIGTERM, run.py's
    bad input): then it is one line on stderr, the other write is still tried, and the script keeps its exit code."""
    writes = [lambda: record_session(run_dir, wall_s, state_before, machine)]
    if args.keep and (run_dir / "meta.json").is_file():
        writes.append(lambda: keep(args.keep, kept_record(run_dir, env_id, seed)))
    for write in writes:
        try:
            write()
        except UserError as exc:
            if not ending:
                raise
            print(f"results.py: error: {exc}", file=sys.stderr, flush=True)


def run_atari5_game(args: argparse.Namespace, run_flags: list[str], env_id: str, seed: int, xpid: str,
                    kept: dict | None = None) -> None:
    """Train one game unless it finished (here, or on another machine: `kept`, its `--keep` record), then test it
    greedily once (the result is kept in atari5.json) and, with `--keep`, keep its record."""
    run_dir = args.savedir / xpid
    experiment_flags = ["--env", env_id, *ATARI5_FLAGS]
    wanted = total_steps_given([*experiment_flags, *run_flags])  # a --total_steps given trains a finished game on
    state = run_state(run_dir, wanted)
    if kept and kept.get("state") == "finished" and not run_dir.is_dir():
        print(f"{xpid}: finished on {kept.get('machine') or 'another machine'} (kept in {args.keep}), not trained "
              "again", flush=True)
        return
    if state == "finished":
        print(f"{xpid}: finished, not trained again", flush=True)
    else:
        print(f"{xpid}: {'resuming from its checkpoint' if state == 'resume' else 'new run'}", flush=True)
        machine, start, code = machine_description(), time.monotonic(), None
        try:
            code = train("atari5", seed, args.savedir, xpid, args.minutes, run_flags, experiment_flags)
        finally:  # on Ctrl-C and SIGTERM too (code None), once the run has stopped in order
            if code != 2:  # run.py's bad input: it changed nothing, and no session is recorded either
                save_session(args, run_dir, env_id, seed, time.monotonic() - start, state, machine,
                             ending=code is None or code == 143)
        if code in (2, 143):  # bad input fails every game alike; SIGTERM means stop
            raise SystemExit(code)
        if code not in (0, 130):  # 130: stopped by --minutes, resumable
            print(f"{xpid}: run.py exited with {code} (its out.log says why); going on with the next game", flush=True)
    record = _read_json(run_dir / ATARI5_RECORD)
    final_step = _read_json(run_dir / "meta.json").get("final_step")
    tested = (record.get("greedy_test_episodes"), record.get("greedy_test_step", final_step))  # (a record from
    if run_state(run_dir, wanted) == "finished" and tested != (args.test_episodes, final_step):  # before the step)
        record["greedy_test_mean"], record["greedy_test_lengths"] = greedy_test(args.savedir, xpid, args.test_episodes)
        record["greedy_test_episodes"], record["greedy_test_step"] = args.test_episodes, final_step
        write_text(run_dir / ATARI5_RECORD, json.dumps(record, indent=2) + "\n", "the greedy test's record")
    if args.keep and (run_dir / "meta.json").is_file():  # before the next game: a session may end during it
        keep(args.keep, kept_record(run_dir, env_id, seed))


def last_games_mean(run_dir: Path) -> tuple[float | None, int]:
    """Mean return of the run's last 100 full training games and how many games it played; from the event
    files, else the last `charts/mean_return_100` of logs.csv (with the game count unknown: 0)."""
    if any(run_dir.glob("events.out.tfevents.*")):
        _, returns, _ = episodes(run_dir)
        if len(returns):
            return float(returns[-LAST_GAMES:].mean()), len(returns)
    _, means = csv_means(run_dir)
    return (float(means[-1]) if len(means) else None), 0


def csv_means(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """logs.csv's rows that have a `charts/mean_return_100`: their agent steps and that mean (empty arrays if
    the run has no logs.csv or no game finished), in the order written; damaged rows left out, saying so, as
    plot mode does."""
    series, damaged = series_from_csv(run_dir / "logs.csv", (CSV_RETURN_COLUMN,))
    if damaged:
        print(damaged_rows_line(run_dir.name, damaged))
    means = series[CSV_RETURN_COLUMN]
    finite = np.isfinite(means.values)
    return means.steps[finite], means.values[finite]


def atari5_row(run_dir: Path, env_id: str, seed: int, kept: dict | None = None) -> dict:
    """One game's line of the table, from what its run directory holds (None where it holds nothing yet), or
    from its kept record (`--keep`) where the run directory does not exist (trained on another machine)."""
    if kept and not run_dir.is_dir():
        return {key: value for key, value in kept.items() if key not in KEPT_ONLY}
    game = atari5.game(env_id)
    meta, record = _read_json(run_dir / "meta.json"), _read_json(run_dir / ATARI5_RECORD)
    mean, games = last_games_mean(run_dir) if run_dir.is_dir() else (None, 0)
    greedy = record.get("greedy_test_mean")
    sessions = record.get("sessions", [])
    machines = sorted({s["machine"] for s in sessions})
    return {"game": game.name, "env": env_id, "xpid": run_dir.name, "seed": seed, "state": run_state(run_dir),
            "final_step": meta.get("final_step"), "games": games, f"mean_last_{LAST_GAMES}": mean,
            "greedy_test_mean": greedy, "greedy_test_episodes": record.get("greedy_test_episodes"),
            "greedy_test_lengths": record.get("greedy_test_lengths"),
            f"hns_last_{LAST_GAMES}": None if mean is None else atari5.normalised(env_id, mean),
            "hns_greedy": None if greedy is None else atari5.normalised(env_id, greedy),
            "random": game.random, "human": game.human, "cleanrl_ppo": game.cleanrl_ppo,
            "cleanrl_ppo_std": game.cleanrl_ppo_std, "cleanrl_hns": atari5.normalised(env_id, game.cleanrl_ppo),
            "wall_s": round(sum(s["wall_s"] for s in sessions), 1) if sessions else None,
            "sessions": len(sessions), "machine": "; ".join(machines) or None}


KEPT_ONLY = ("curve", "flags", "source")  # what a kept record holds beyond the table's row


def curve_points(run_dir: Path) -> list[list[float]]:
    """[agent step, mean of the last 100 games] after the last game at or before each of KEPT_CURVE_POINTS
    evenly spaced steps (from the event files, else logs.csv's `charts/mean_return_100`): the bold curve of the
    figure, small enough to keep in the repository."""
    steps, returns, _ = episodes(run_dir) if event_files(run_dir) else (np.empty(0),) * 3
    means = smooth(returns, LAST_GAMES)
    if not len(steps):
        steps, means = csv_means(run_dir)
    if not len(steps):
        return []
    grid = np.linspace(steps[0], steps[-1], KEPT_CURVE_POINTS)
    chosen = np.unique(np.searchsorted(steps, grid, side="right") - 1)
    return [[int(steps[i]), round(float(means[i]), 2)] for i in chosen]


def kept_record(run_dir: Path, env_id: str, seed: int) -> dict:
    """What `--keep` keeps of a run: its table row, its curve (`curve_points`) and flags, and where it ran."""
    row = atari5_row(run_dir, env_id, seed)
    return {**row, "curve": curve_points(run_dir), "flags": _read_json(run_dir / "flags.json"),
            "source": f"{run_dir} on {row['machine'] or 'an unrecorded machine'}"}


def keep(keep_dir: Path, record: dict) -> dict:
    """Write `record` to KEEP_DIR/XPID.json, unless the one there reached more agent steps (a finished game
    stays kept while the same name trains again elsewhere). Returns the record kept."""
    path = keep_dir / f"{record['xpid']}.json"
    kept = _read_json(path)
    if (kept.get("final_step") or 0) > (record["final_step"] or 0):
        print(f"{path}: kept as it is ({kept['final_step']:,} agent steps, this run {record['final_step'] or 0:,})")
        return kept
    write_text(path, json.dumps(record, indent=1) + "\n", "the kept record")
    return record


def atari5_medians(rows: list[dict]) -> dict[str, float | None]:
    """Atari-5's predicted Atari-57 median from our training and greedy scores (the mean over seeds of each
    game) and from CleanRL's; None while a game has no finished run yet (a run stopped early scores where it
    stopped: not the result)."""
    result: dict[str, float | None] = {"cleanrl": atari5.cleanrl_predicted_median()}
    for key, column in (("last_100", f"hns_last_{LAST_GAMES}"), ("greedy", "hns_greedy")):
        by_game = {g.env_id: [r[column] for r in rows if r["env"] == g.env_id and r[column] is not None
                              and r["state"] == "finished"] for g in atari5.GAMES}
        complete = all(by_game.values())
        result[key] = atari5.predicted_median({k: float(np.mean(v)) for k, v in by_game.items()}) if complete else None
    return result


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _hours(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 3600:.2f} h"


def atari5_settings(flags: dict, seeds: int = 1) -> list[tuple[str, str, str]]:
    """(setting, ours, CleanRL's) lines; ours from a run's flags.json (`?` where it does not say)."""
    f = {k: flags.get(k, "?") for k in ("total_steps", "num_actors", "envs_per_actor", "unroll_length",
                                         "batch_size", "policy_loss", "ppo_clip", "vtrace_lambda", "epochs",
                                         "minibatches", "optimizer", "learning_rate", "lr_schedule", "entropy_cost",
                                         "baseline_cost", "discounting", "grad_norm_clipping", "reward_clipping",
                                         "episodic_life", "model")}
    steps = f["total_steps"]
    steps_frames = f"{steps:,} ({steps * 4 / 1e6:g}M frames)" if isinstance(steps, int) else "?"
    return [
        ("agent steps per game", f"{steps_frames}, {seeds} seed{'s' if seeds > 1 else ''}",
         "10,000,000 (40M frames), 3 seeds"),
        ("environments", (f"{f['num_actors']} actors x {f['envs_per_actor']} envs, ALE *NoFrameskip-v4: frame skip 4, "
         "no sticky actions, up to 30 no-ops, 108k frames per game"), "8 envpool *-v5 envs (envpool's Atari defaults)"),
        ("data per update", f"unroll {f['unroll_length']} x batch {f['batch_size']}", "128 steps x 8 envs = 1,024"),
        ("loss", f"{f['policy_loss']} (clip {f['ppo_clip']}), V-trace lambda {f['vtrace_lambda']}",
         "PPO clip 0.1, GAE lambda 0.95, no value clipping"),
        ("epochs x minibatches", f"{f['epochs']} x {f['minibatches']}", "4 x 4"),
        ("optimiser", f"{f['optimizer']} lr {f['learning_rate']}, {f['lr_schedule']}", "Adam lr 2.5e-4, linear to 0"),
        ("entropy, value cost", f"{f['entropy_cost']}, {f['baseline_cost']}", "0.01, 0.5"),
        ("discount", f"{f['discounting']}", "0.99"),
        ("gradient-norm clip", f"{f['grad_norm_clipping']}", "0.5"),
        ("rewards for learning", f"clipping {f['reward_clipping']}", "clipped (envpool reward_clip=True)"),
        ("episodic life", f"{f['episodic_life']}", "True (envpool episodic_life=True)"),
        ("network", f"{f['model']}", "Nature CNN"),
        ("score reported", f"mean of the last {LAST_GAMES} full training games; greedy: full games after training",
         "charts/avg_episodic_return (last full game of each of the 8 envs, averaged), mean +- std over seeds"),
    ]


def format_atari5(rows: list[dict], flags: dict) -> str:
    """The Atari-5 table in Markdown: per game, our scores beside CleanRL's, then the predicted medians,
    the settings side by side and where every reference number comes from."""
    lines = [(f"| game | agent steps | mean of last {LAST_GAMES} training games | greedy test (games) | "
             "human-normalised % (training / greedy) | CleanRL PPO 10M | CleanRL human-normalised % | "
             "random | human | wall time | machine |"), "|" + "---|" * 11]
    for r in rows:
        greedy = "-" if r["greedy_test_mean"] is None else f"{r['greedy_test_mean']:,.1f} ({r['greedy_test_episodes']})"
        name = f"{r['game']} (seed {r['seed']})" if len(rows) > len(atari5.GAMES) else r["game"]
        lines.append(
            f"| {name} | "
            f"{_number(r['final_step'], 0)} | {_number(r[f'mean_last_{LAST_GAMES}'])} | {greedy} | "
            f"{_number(r[f'hns_last_{LAST_GAMES}'])} / {_number(r['hns_greedy'])} | "
            f"{r['cleanrl_ppo']:,.2f} +- {r['cleanrl_ppo_std']:,.2f} | {r['cleanrl_hns']:.1f} | "
            f"{r['random']:g} | {r['human']:g} | {_hours(r['wall_s'])} | {r['machine'] or '-'} |")
    medians = atari5_medians(rows)
    lines += ["", (f"Atari-5 predicted Atari-57 median human-normalised score: ours {_number(medians['last_100'])}% "
              f"(training, last {LAST_GAMES} games), {_number(medians['greedy'])}% (greedy test); CleanRL PPO "
              f"{_number(medians['cleanrl'])}%. '-': not every game has a finished run yet. The paper's cross-validated "
              f"error of the prediction: {atari5.RELATIVE_ERROR_PERCENT}%."), "",
              "| setting | ours | CleanRL ppo_atari_envpool_xla_jax |", "|---|---|---|"]
    seeds = max(1, len(rows) // len(atari5.GAMES))
    lines += [f"| {name} | {ours} | {theirs} |" for name, ours, theirs in atari5_settings(flags, seeds)]
    lines += ["", f"Atari-5: {atari5.PAPER}.", f"Random and human scores: {atari5.REFERENCE_SCORES_SOURCE}.",
              f"Regression weights: {atari5.WEIGHTS_SOURCE}.", f"CleanRL: {atari5.CLEANRL_SOURCE}."]
    return "\n".join(lines) + "\n"


def atari5_figure(runs: list[tuple[str, Path]], kept: dict[str, dict] | None = None) -> Figure:
    """One panel per game, from `runs` (env id, run directory): every training game's return faint and the
    mean of the last 100 bold, against agent steps, one colour per seed, with CleanRL's PPO at 10M steps
    (dashed) and random play (dotted). A run directory that does not exist is drawn from its kept record in
    `kept` (by run name), its bold curve alone. A game not run yet has an empty panel."""
    kept = kept or {}
    fig = Figure(figsize=(4 * len(atari5.GAMES), 3.8), layout="constrained")
    for axes, game in zip(fig.subplots(1, len(atari5.GAMES)), atari5.GAMES, strict=True):
        run_dirs = [run_dir for env_id, run_dir in runs if env_id == game.env_id
                    and (run_dir.is_dir() or kept.get(run_dir.name, {}).get("curve"))]
        for seed, run_dir in enumerate(run_dirs):
            if not run_dir.is_dir():
                steps, means = np.array(kept[run_dir.name]["curve"]).T
                axes.plot(steps, means, color=f"C{seed}", linewidth=2, marker=".", label=f"{run_dir.name} (kept)")
                continue
            steps, returns, _ = episodes(run_dir)
            axes.plot(steps, returns, color=f"C{seed}", alpha=0.15, linewidth=0.6)
            axes.plot(steps, smooth(returns, LAST_GAMES), color=f"C{seed}", linewidth=2, label=run_dir.name)
        axes.axhline(game.cleanrl_ppo, color="black", linestyle="--", label="CleanRL PPO at 10M")
        axes.axhline(game.random, color="gray", linestyle=":", label="random")
        axes.set_title(game.name)
        axes.set_xlim(0, ATARI5_STEPS)
        axes.set_xlabel("agent steps")
        axes.xaxis.set_major_formatter(EngFormatter())
        axes.grid(alpha=0.3)
    fig.axes[0].set_ylabel(f"return per game (bold: mean of the last {LAST_GAMES})")
    for axes in fig.axes:
        axes.legend(loc="best", fontsize="small")
    fig.suptitle("Atari-5 with the default command")
    return fig


def atari5_experiment(args: argparse.Namespace, run_flags: list[str]) -> int:
    """Train (unless --plot-only) and test each game in turn, then print and write the table."""
    prefix = args.xpid or "atari5"
    runs = [(g.env_id, seed, atari5_xpid(prefix, g.env_id, seed, args.seeds))
            for g in atari5.GAMES for seed in range(args.seeds)]
    kept = {xpid: record for _, _, xpid in runs if args.keep and (record := _read_json(args.keep / f"{xpid}.json"))}
    if args.plot_only and not kept and not any((args.savedir / xpid / "meta.json").is_file() for _, _, xpid in runs):
        raise UserError(f"--plot-only: no Atari-5 run in {args.savedir}" + (" or kept in --keep" if args.keep else "")
                        + "; train them first")
    if not args.plot_only:
        for env_id, seed, xpid in runs:
            if not args.games or env_id in args.games:
                run_atari5_game(args, run_flags, env_id, seed, xpid, kept.get(xpid))
    if args.keep:  # --plot-only too: what the run directories here hold now
        for env_id, seed, xpid in runs:
            if (args.savedir / xpid / "meta.json").is_file():
                kept[xpid] = keep(args.keep, kept_record(args.savedir / xpid, env_id, seed))
    rows = [atari5_row(args.savedir / xpid, env_id, seed, kept.get(xpid)) for env_id, seed, xpid in runs]
    flags = next((_read_json(args.savedir / xpid / "flags.json") for _, _, xpid in runs
                  if (args.savedir / xpid / "flags.json").is_file()),
                 next((record["flags"] for record in kept.values() if record.get("flags")), {}))
    table = format_atari5(rows, flags)
    print(table, flush=True)
    write_text(args.savedir / f"{prefix}.md", table, "the Atari-5 table")
    write_text(args.savedir / f"{prefix}.json", json.dumps(
        {"rows": rows, "predicted_median": atari5_medians(rows), "flags": flags,
         "sources": {"paper": atari5.PAPER, "reference_scores": atari5.REFERENCE_SCORES_SOURCE,
                     "weights": atari5.WEIGHTS_SOURCE, "cleanrl": atari5.CLEANRL_SOURCE}}, indent=2) + "\n",
               "the Atari-5 table")
    out = args.out or args.savedir / f"{prefix}.png"  # beside the table
    save_figure(atari5_figure([(env_id, args.savedir / xpid) for env_id, _, xpid in runs], kept), out, "--out",
                dpi=100)
    print(f"Wrote {args.savedir / f'{prefix}.md'}, {args.savedir / f'{prefix}.json'} and {out}")
    return 0


def main() -> int:
    """The script; bad input (a flag, a run that is not there, a figure, table or record that cannot be written: the
    runs are kept) is one line, `results.py: error: ...`, and exit code 2."""
    try:
        return _main()
    except UserError as exc:
        print(f"results.py: error: {exc}", file=sys.stderr)
        sys.exit(2)


def _main() -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=sorted([*EXPERIMENTS, "atari5"]))
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1, one run each")
    parser.add_argument("--minutes", type=float, default=None, help="stop each run after this long")
    parser.add_argument("--savedir", type=Path, default=ROOT / "results" / "runs")
    parser.add_argument("--xpid", default=None, help="run name (default: EXPERIMENT, or EXPERIMENT-sN per seed)")
    parser.add_argument("--test_episodes", type=int, default=10)
    parser.add_argument("--plot-only", action="store_true", help="do not train: summarise and plot existing runs")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default docs/results/EXPERIMENT.png; atari5: SAVEDIR/atari5.png)")
    parser.add_argument("--compare", type=Path, nargs="+", default=None, metavar="RUN_DIR",
                        help="do not train or test: summarise these run directories and plot them together")
    parser.add_argument("--labels", nargs="+", default=None, help="--compare: a legend label per run directory")
    parser.add_argument("--games", nargs="+", default=None, metavar="GAME",
                        help="atari5: train only these games (e.g. Qbert or QbertNoFrameskip-v4); the table has all five")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="atari5: keep each run's table row and curve in DIR/XPID.json (e.g. docs/results/atari5, "
                             "committed): a game kept as finished is not trained again, and the table and figure "
                             "take it from there where its run directory is not on this machine")
    args, run_flags = parser.parse_known_args()
    args.savedir = args.savedir.expanduser().absolute()  # run.py runs in the repository, this script where it was started
    if args.keep is not None and args.keep.exists() and not args.keep.is_dir():  # before hours of training
        parser.error(f"--keep {args.keep} is a file; name a directory (made where it does not exist)")
    for name in ("seeds", "test_episodes"):  # no seed would overwrite the figure with an empty one
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.minutes is not None and not args.minutes > 0:
        parser.error(f"--minutes must be > 0, got {args.minutes}")
    if args.games:
        by_name = {g.env_id.removesuffix("NoFrameskip-v4").lower(): g.env_id for g in atari5.GAMES}
        unknown = [g for g in args.games if g.removesuffix("NoFrameskip-v4").lower() not in by_name]
        if args.experiment != "atari5" or unknown:
            parser.error(f"--games takes Atari-5 games ({', '.join(by_name.values())}) with atari5 only; "
                         f"got {' '.join(unknown or args.games)}")
        args.games = {by_name[g.removesuffix("NoFrameskip-v4").lower()] for g in args.games}
    if run_flags and (args.compare or args.plot_only):
        parser.error(f"unknown flags {' '.join(run_flags)}: run.py's flags are for training runs only")
    if args.experiment != "atari5" and args.keep:
        parser.error("--keep is for atari5 only")
    if args.out is not None and (problem := figure_path_problem(args.out, "--out")):  # before hours of training
        parser.error(problem)
    if args.experiment == "atari5":
        if args.compare:
            parser.error("atari5 takes no --compare: rerun it with --plot-only for the table")
        return atari5_experiment(args, run_flags)
    if args.compare:
        if args.labels and len(args.labels) != len(args.compare):
            parser.error(f"--labels needs one label per run directory ({len(args.compare)})")
        if missing := [str(run_dir) for run_dir in args.compare if not (run_dir / "meta.json").is_file()]:
            parser.error(f"--compare: not a run directory (no meta.json): {' '.join(missing)}")
        for run_dir in args.compare:
            print(json.dumps(summary(run_dir)), flush=True)
        out = args.out or ROOT / "docs" / "results" / f"{args.experiment}_compare.png"
        save_figure(figure(args.compare, f"{EXPERIMENTS[args.experiment][1]}: runs compared", args.labels), out,
                    "--out", dpi=100)
        print(f"Wrote {out}")
        return 0

    env = EXPERIMENTS[args.experiment][1]
    names = [args.xpid] if args.xpid and args.seeds == 1 else [
        (args.xpid or args.experiment) + (f"-s{seed}" if args.seeds > 1 else "") for seed in range(args.seeds)]
    rows = []
    for seed, xpid in enumerate(names):
        start = time.monotonic()
        code = None if args.plot_only else train(args.experiment, seed, args.savedir, xpid, args.minutes, run_flags)
        if code in (2, 143):  # bad input, which run.py has named in its line; SIGTERM means stop
            return code
        if not (args.savedir / xpid / "meta.json").is_file():
            if code is None:
                parser.error(f"--plot-only: no run {xpid} in {args.savedir}; train it first")
            print(f"results: run.py exited with {code} before it started run {xpid}", file=sys.stderr)
            return code or 1
        row = summary(args.savedir / xpid)
        if not args.plot_only:
            row["process_wall_s"] = round(time.monotonic() - start, 1)
        if args.plot_only and not (args.savedir / xpid / "model.tar").is_file():  # still before its first one
            print(f"results: run {xpid} has no checkpoint yet: no greedy test", file=sys.stderr)
            row["greedy_test_mean"] = row["greedy_test_lengths"] = None
        else:
            row["greedy_test_mean"], row["greedy_test_lengths"] = greedy_test(args.savedir, xpid, args.test_episodes)
        rows.append(row)
        print(json.dumps(row), flush=True)
    finals = np.array([r[f"mean_last_{LAST_GAMES}"] for r in rows if r[f"mean_last_{LAST_GAMES}"] is not None])
    if len(finals) > 1:
        print(f"{args.experiment}: mean of the last {LAST_GAMES} games per seed "
              f"{', '.join(f'{v:.1f}' for v in finals)}; min {finals.min():.1f}, max {finals.max():.1f}, "
              f"mean {finals.mean():.1f} +- {finals.std():.1f}")
    out = args.out or ROOT / "docs" / "results" / f"{args.experiment}.png"
    save_figure(figure([args.savedir / n for n in names], f"{env}: {', '.join(names)}"), out, "--out", dpi=100)
    print(f"Wrote {out}")
    return 0


if __name__ == "__main__":
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # a shell's background job: Ctrl-C stops it all the same
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with sigterm_as_ctrl_c():
            sys.exit(main())
    except KeyboardInterrupt as stopped:  # the run saved its checkpoint; the same command resumes it
        terminated = isinstance(stopped, Terminated)
        print(f"results: stopped by {'SIGTERM' if terminated else 'Ctrl-C'}; the same command resumes the run",
              file=sys.stderr)
        sys.exit(128 + (signal.SIGTERM if terminated else signal.SIGINT))
