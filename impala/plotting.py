"""Plot mode: episodic return against agent steps (or wall time) for one or several runs, to a PNG.

    python run.py --mode plot --savedir runs --xpid A B        # or: python -m impala.plotting --xpid A B
    python run.py --mode plot --savedir runs --plot_out cmp.png  # every run in SAVEDIR
    python run.py --mode plot --xpid A B --plot_x time         # against hours of training

Returns come from each run's TensorBoard event files (`charts/episodic_return`, one point per finished
episode, or an even share of them where games end fast: `metrics.GamePoints`), or, for a run without them, from
`logs.csv` (`charts/mean_return_100`). Each run is drawn faintly as recorded and boldly as a rolling mean, so
that runs can be compared without TensorBoard. Evaluations while training (`eval/episodic_return_mean`: full
games, no episodic life) are drawn in the same colour, dashed with a marker per evaluation.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

from impala.config import (
    LATEST_NAME,
    Config,
    UserError,
    first_line,
    is_utf8,
    parse_config,
    run_path,
    say,
    shown_bytes,
)
from impala.events import event_files, read_scalars

RETURN_TAG = "charts/episodic_return"
EVAL_TAG = "eval/episodic_return_mean"
CSV_RETURN_COLUMN = "charts/mean_return_100"
MAX_SMOOTHING_EPISODES = 100  # the usual "mean of the last 100 episodes"


@dataclass
class Series:
    """[N] agent steps, seconds of training since the run's first point (pauses between sessions left out; None
    from a CSV) and values, by step."""

    steps: np.ndarray
    times: np.ndarray | None
    values: np.ndarray

    @staticmethod
    def empty() -> Series:
        return Series(np.empty(0, np.int64), None, np.empty(0))

    def sorted(self) -> Series:
        order = np.argsort(self.steps, kind="stable")
        return Series(self.steps[order], None if self.times is None else self.times[order], self.values[order])


@dataclass
class Curve:
    """One run's returns: `steps` and `returns` are [N] arrays sorted by agent step; `evaluation` holds the
    evaluations while training (empty without them)."""

    name: str
    steps: np.ndarray
    returns: np.ndarray
    env: str | None = None
    times: np.ndarray | None = None  # [N] seconds of training (Series.times); None for a run with only a logs.csv
    evaluation: Series | None = None


def plot(config: Config) -> Path:
    """Write the returns of `config.plot_xpids` (else XPID, else every run in SAVEDIR) to a PNG; returns its path.

    Raises UserError for a run named that does not exist or has no finished episode yet; of every run in SAVEDIR,
    those with nothing to plot are left out, saying so.
    """
    savedir = Path(config.savedir).expanduser()
    named = list(config.plot_xpids) or ([config.xpid] if config.xpid else [])
    names = named or find_runs(savedir)
    if not names:
        raise UserError(f"no runs to plot in {savedir}; train one first or pass --savedir DIR")
    curves = [load_curve(savedir, name) for name in named] if named else _every_curve(savedir, names)
    curves = list({curve.name: curve for curve in curves}.values())  # `latest` and the run it names: one curve
    if config.plot_x == "time" and (without := [c.name for c in curves if c.times is None]):
        if named or len(without) == len(curves):
            raise UserError(f"run(s) {', '.join(without)} have no TensorBoard event files, so no wall times: "
                            "plot them with --plot_x steps")
        for name in without:  # of every run in SAVEDIR, as a run with nothing to plot is
            say(f"Left out: run {name!r} in {savedir} has no TensorBoard event files, so no wall times")
        curves = [c for c in curves if c.times is not None]
    names = [curve.name for curve in curves]
    out = Path(config.plot_out).expanduser() if config.plot_out else savedir / "returns.png"
    save_figure(returns_figure(curves, x=config.plot_x), out, "--plot_out", dpi=120)
    say(f"Wrote {out}: episodic return of {', '.join(names)} against "
        f"{'agent steps' if config.plot_x == 'steps' else 'hours of training'}")
    return out


def figure_path_problem(out: Path, flag: str) -> str | None:
    """Why `out` (given as `flag`) cannot take a figure, or None: a directory, or an extension that names no
    format matplotlib writes (it would append .png, or refuse with a traceback)."""
    formats = Figure().canvas.get_supported_filetypes()
    if out.is_dir():
        return f"{flag} {out} is a directory; pass a file path such as {out / 'returns.png'}"
    if out.suffix[1:].lower() not in formats:
        return (f"{flag} {out}: the file's extension gives the plot's format; use one of "
                f"{', '.join('.' + f for f in sorted(formats))}")
    return None


def save_figure(figure: Figure, out: Path, flag: str, dpi: int) -> None:
    """Write `figure` to `out` (given as `flag`), in the format its extension names, atomically: a full disk
    leaves the previous file whole. A path that cannot take it, or a format this machine cannot write, is a
    UserError."""
    if problem := figure_path_problem(out, flag):
        raise UserError(problem)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(tmp, dpi=dpi, format=out.suffix[1:].lower())
        os.replace(tmp, out)
    except (FileExistsError, NotADirectoryError):  # mkdir's "File exists" for a file where a directory should be
        raise UserError(f"cannot write the plot {out}: a part of its directory's path is not a directory (a file, or "
                        "a link that leads to none)") from None
    except OSError as exc:
        raise UserError(f"cannot write the plot {out}: {exc.strerror or exc}") from None
    except RuntimeError as exc:  # a format whose writer needs a program this machine lacks (.pgf: LaTeX)
        raise UserError(f"cannot write the plot {out} as {out.suffix[1:].lower()}: {first_line(exc)[:200]}; "
                        "choose another extension, such as .png") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def find_runs(savedir: Path) -> list[str]:
    """Names of the runs in `savedir` (directories with event files or logs.csv), `latest` excepted."""
    if not savedir.is_dir():
        return []
    return sorted(p.name for p in savedir.iterdir()
                  if p.is_dir() and not p.is_symlink() and (bool(event_files(p))
                                                             or (p / "logs.csv").is_file()))


def _every_curve(savedir: Path, names: Sequence[str]) -> list[Curve]:
    """The curves of the runs `names` found in `savedir` that have one. A run with nothing to plot (just started,
    or its logs.csv damaged throughout) is left out, saying why, rather than stopping the plot of every other run;
    UserError when none is left."""
    curves = []
    for name in names:
        if not is_utf8(name):  # a directory renamed by hand: its name would fail the legend and every line
            say(f"Left out: run {shown_bytes(name)} in {savedir}: its name is not UTF-8 text; rename it to plot it")
            continue
        try:
            curves.append(load_curve(savedir, name))
        except UserError as exc:
            say(f"Left out: {exc}")
    if not curves:
        shown = ", ".join(name if is_utf8(name) else shown_bytes(name) for name in names)
        raise UserError(f"none of the runs in {savedir} ({shown}) has a finished episode to plot yet")
    return curves


def load_curve(savedir: Path, name: str) -> Curve:
    """The returns of run `name`; UserError naming the runs that do exist when it is missing or empty."""
    run_dir = run_path(savedir, name)
    if not run_dir.is_dir():
        existing = find_runs(savedir)
        raise UserError(f"no run {name!r} in {savedir} (runs there: {', '.join(existing) or 'none'})")
    if name == LATEST_NAME:  # the run it names, in the legend and the lines below
        name = run_dir.resolve().name
    series, damaged_events = _series_from_events(run_dir, (RETURN_TAG, EVAL_TAG))
    if damaged_events:
        say(damaged_events_line(name, damaged_events))
    if len(series[RETURN_TAG].steps) == 0 and len(series[EVAL_TAG].steps) == 0:
        from_csv, damaged = series_from_csv(run_dir / "logs.csv", (CSV_RETURN_COLUMN, EVAL_TAG))
        series = {RETURN_TAG: from_csv[CSV_RETURN_COLUMN], EVAL_TAG: from_csv[EVAL_TAG]}
        if damaged:
            say(damaged_rows_line(name, damaged))
        if aside := sorted(p.name for p in run_dir.glob("logs.csv.unreadable*")):
            say(f"Run {name}: not plotted: {', '.join(aside)}, its logs.csv set aside as damaged when the run "
                "resumed (kept as it was, for a hand to mend)")
    returns, evaluation = series[RETURN_TAG].sorted(), series[EVAL_TAG].sorted()
    if len(returns.steps) == 0 and len(evaluation.steps) == 0:
        raise UserError(f"run {name!r} in {savedir} has no finished episode to plot yet")
    return Curve(name, returns.steps, returns.values, _env_of(run_dir), returns.times, evaluation)


def _series_from_events(run_dir: Path, tags: Sequence[str]) -> tuple[dict[str, Series], list[tuple[Path, int]]]:
    """Each tag's points, with the seconds the run had trained since the first point of any of `tags` (the pauses
    between its sessions left out), and the records of the event files that could not be read (file, byte offset;
    each ended its file's points)."""
    scalars = read_scalars(run_dir, tuple(tags))
    start = min((point[1] for points in scalars.points.values() for point in points), default=0.0)

    def seconds(points: list[tuple[int, float, float]]) -> np.ndarray:
        return scalars.active_s(np.array([p[1] for p in points])) - scalars.active_s(np.array([start]))[0]

    def numbers(points: list[tuple[int, float, float]]) -> Series:
        """The points whose value is a number in range: one NaN would blank the rolling mean from there on."""
        points = [p for p in points if math.isfinite(p[2]) and abs(p[2]) <= MAX_VALUE]
        if not points:
            return Series.empty()
        return Series(np.array([p[0] for p in points], np.int64), seconds(points),
                      np.array([p[2] for p in points], np.float64))

    return {tag: numbers(points) for tag, points in scalars.points.items()}, scalars.damaged


def damaged_events_line(name: str, damaged: Sequence[tuple[Path, int]]) -> str:
    """One line on the records of a run's event files that could not be read."""
    where = "; ".join(f"{path.name} from byte {offset:,}" for path, offset in damaged)
    return (f"Run {name}: left out the rest of {len(damaged)} event file(s) after a record that could not be read "
            f"(damaged, or cut short by a kill): {where}")


MAX_STEP = 2**63 - 1  # a step the int64 curves can hold
MAX_VALUE = 1e100  # beyond it a logged number is garbage, not a return or a loss: no axis can lay out such a range


def damaged_rows_line(name: str, damaged: Sequence[int]) -> str:
    """One line on the rows of a run's logs.csv left out as damaged (their line numbers)."""
    shown = ", ".join(map(str, damaged[:5])) + (", ..." if len(damaged) > 5 else "")
    return (f"Run {name}: left out {len(damaged)} damaged row(s) of its logs.csv (line(s) {shown}): a step or value "
            "that is not a number or out of range, or bytes that are not text")


def series_from_csv(path: Path, columns: Sequence[str]) -> tuple[dict[str, Series], list[int]]:
    """Each of `columns`' points in logs.csv `path` (none without the file), and the numbers of the lines left out
    as damaged: a step or a value that is not a number (bytes that are not UTF-8 read as U+FFFD), a step outside
    [0, 2^63) or a value beyond +-MAX_VALUE (numbers run together), a row the csv module cannot read. A kill can cut the last row short and a disk fault can garble any: such a row is
    left out, not allowed to stop the plot of this run and of every run plotted with it. An empty value, or
    one that is not finite, is a row without that number (no game finished yet), not damage."""
    points: dict[str, tuple[list[int], list[float]]] = {column: ([], []) for column in columns}
    damaged: list[int] = []
    if path.is_file():
        try:
            with open(path, newline="", encoding="utf-8", errors="replace") as f:
                reader = csv.DictReader(f)
                if reader.fieldnames is not None and "step" not in reader.fieldnames:
                    damaged.append(1)  # the header: every row would be left out too, for want of a step
                while True:
                    try:
                        row = next(reader)
                    except StopIteration:
                        break
                    except csv.Error:  # raised before `line_num` counts the row's first line
                        damaged.append(reader.line_num + 1)
                        continue
                    try:
                        step = int(float(row.get("step") or ""))
                        numbers = {column: float(row[column]) for column in columns if row.get(column)}
                    except (ValueError, OverflowError):  # not a number; an infinite step
                        damaged.append(reader.line_num)
                        continue
                    if not 0 <= step <= MAX_STEP or any(abs(v) > MAX_VALUE for v in numbers.values()):
                        damaged.append(reader.line_num)  # digits run together or garbled: no step, no return
                        continue
                    for column, value in numbers.items():
                        if math.isfinite(value):
                            points[column][0].append(step)
                            points[column][1].append(value)
        except OSError as exc:
            raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    return {column: Series(np.array(steps, np.int64), None, np.array(values, np.float64))
            for column, (steps, values) in points.items()}, damaged


def _env_of(run_dir: Path) -> str | None:
    """The env in the run's flags.json; None where the file is missing, damaged, or holds no env name."""
    try:
        flags = json.loads((run_dir / "flags.json").read_text())
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    env = flags.get("env") if isinstance(flags, dict) else None
    return env if isinstance(env, str) else None


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Rolling mean over the last `window` values ([N] -> [N]); the first points average what exists so far."""
    if window <= 1 or len(values) == 0:
        return values.astype(np.float64)
    cumulative = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
    index = np.arange(1, len(values) + 1)
    start = np.maximum(0, index - window)
    return (cumulative[index] - cumulative[start]) / (index - start)


def smoothing_window(num_points: int) -> int:
    """A tenth of the points, at most 100 episodes: smooth enough to read, short runs keep their shape."""
    return max(1, min(MAX_SMOOTHING_EPISODES, num_points // 10))


def returns_figure(curves: Sequence[Curve], colors: Mapping[str, str] | None = None, x: str = "steps") -> Figure:
    """A figure of every curve, raw and smoothed, and its evaluations, with the run names in the legend.

    `x`: "steps" (agent steps) or "time" (hours of training since each run's first point; every curve needs
    `times`). Uses matplotlib's object API with the Agg canvas: no display, no global backend change.
    """
    entries = sum(bool(len(c.returns)) + (c.evaluation is not None and bool(len(c.evaluation.steps)))
                  for c in curves)
    columns = math.ceil(entries / LEGEND_ROWS)  # beside the axes when there are many entries, else inside
    outside = entries > LEGEND_INSIDE
    figure = Figure(figsize=(8 + 3.5 * columns if outside else 8, max(5.0, 0.2 * min(entries, LEGEND_ROWS) + 1)),
                    layout="constrained")
    axes = figure.add_subplot()
    envs = {c.env for c in curves}
    handles, labels = [], []  # given to the legend as they are: a run named `_x` is not left out of it
    for i, curve in enumerate(curves):
        color = (colors or {}).get(curve.name, _color(i, len(curves)))
        label = _text(curve.name if len(envs) == 1 or curve.env is None else f"{curve.name} ({curve.env})")
        if len(curve.returns):
            xs = curve.steps if x == "steps" or curve.times is None else curve.times / 3600
            window = smoothing_window(len(curve.returns))
            axes.plot(xs, curve.returns, color=color, alpha=0.2, linewidth=0.8)
            handles += axes.plot(xs, smooth(curve.returns, window), color=color, linewidth=2)
            labels.append(label)
        evaluation = curve.evaluation
        if evaluation is not None and len(evaluation.steps):
            xs = evaluation.steps if x == "steps" or evaluation.times is None else evaluation.times / 3600
            handles += axes.plot(xs, evaluation.values, color=color, linestyle="--", marker="o", markersize=3,
                                 linewidth=1.2)
            labels.append(f"{label}: evaluation")
    single_env = next(iter(envs)) if len(envs) == 1 else None
    axes.set_title("Episodic return" + (f": {_text(single_env)}" if single_env else ""))
    axes.set_xlabel("agent steps" if x == "steps" else "hours of training since the run's first point")
    axes.set_ylabel("episodic return (bold: rolling mean; dashed: evaluations)")
    if x == "steps":
        axes.xaxis.set_major_formatter(EngFormatter())
    axes.grid(alpha=0.3)
    if outside:
        figure.legend(handles, labels, loc="outside right upper", ncols=columns, fontsize="small")
    else:
        axes.legend(handles, labels, loc="best")
    return figure


def _text(name: str) -> str:
    """A run's or env's name as matplotlib shows it, character for character: `$` opens no formula."""
    return name.replace("$", r"\$")


LEGEND_INSIDE = 12  # legend entries the axes hold; more go beside them, LEGEND_ROWS to a column
LEGEND_ROWS = 30


def _color(index: int, count: int) -> tuple[float, ...] | str:
    """Curve `index` of `count`: matplotlib's ten colours, its twenty of tab20 for up to twenty curves, evenly
    spaced along turbo beyond (no two runs of a big plot share a colour)."""
    if count <= 10:
        return f"C{index}"
    if count <= 20:
        return colormaps["tab20"](index)
    return colormaps["turbo"](index / (count - 1))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m impala.plotting [--savedir DIR] [--xpid A B ...] [--plot_out PNG]`."""
    try:
        plot(parse_config(["--mode", "plot", *(sys.argv[1:] if argv is None else argv)]))
    except UserError as exc:
        print(f"impala.plotting: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
