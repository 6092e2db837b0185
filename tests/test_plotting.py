"""Plot mode on runs whose returns are known: written with SummaryWriter (or only a logs.csv), then read
back, smoothed, drawn with the run names in the legend, and saved as a PNG from the command line."""

from __future__ import annotations

import csv
import errno
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread
from torch.utils.tensorboard import SummaryWriter

import run
from impala import plotting
from impala.config import UserError, parse_config

REPO = Path(__file__).resolve().parent.parent


def _event_run(savedir: Path, name: str, returns: list[float], steps: list[int], env: str = "CartPole-v1") -> None:
    run_dir = savedir / name
    run_dir.mkdir(parents=True)
    (run_dir / "flags.json").write_text(json.dumps({"env": env}))
    with SummaryWriter(str(run_dir)) as writer:
        for step, value in zip(steps, returns):
            writer.add_scalar(plotting.RETURN_TAG, value, step)


@pytest.fixture
def savedir(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    steps = list(range(0, 20_000, 40))
    fast = [min(500.0, 20 + s / 40) + rng.normal(0, 10) for s in steps]
    slow = [20 + s / 400 + rng.normal(0, 10) for s in steps]
    _event_run(tmp_path, "fast", fast, steps)
    _event_run(tmp_path, "slow", slow, steps)
    csv_only = tmp_path / "csv-only"
    csv_only.mkdir()
    with open(csv_only / "logs.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "charts/SPS", plotting.CSV_RETURN_COLUMN])
        writer.writerows([[80, 1000, ""], [40, 1000, 10.0], [120, 1000, 30.0]])
    (tmp_path / "latest").symlink_to("fast")
    return tmp_path


def test_smooth_is_a_rolling_mean_over_what_exists_so_far() -> None:
    assert plotting.smooth(np.array([1.0, 2.0, 3.0, 4.0]), 2).tolist() == [1.0, 1.5, 2.5, 3.5]
    assert plotting.smooth(np.array([1.0, 3.0]), 1).tolist() == [1.0, 3.0]
    assert plotting.smoothing_window(5) == 1 and plotting.smoothing_window(500) == 50
    assert plotting.smoothing_window(100_000) == plotting.MAX_SMOOTHING_EPISODES


def test_curves_come_from_event_files_or_the_csv(savedir: Path) -> None:
    fast = plotting.load_curve(savedir, "fast")
    assert len(fast.steps) == 500 and fast.steps[0] == 0 and fast.steps[-1] == 19_960
    assert fast.env == "CartPole-v1"
    from_csv = plotting.load_curve(savedir, "csv-only")
    assert from_csv.steps.tolist() == [40, 120] and from_csv.returns.tolist() == [10.0, 30.0]  # sorted, blanks out
    assert from_csv.env is None


def test_damaged_rows_of_a_logs_csv_are_left_out_saying_so_and_the_rest_plotted(
        savedir: Path, capsys: pytest.CaptureFixture) -> None:
    (savedir / "csv-only" / "logs.csv").write_bytes(
        b"step,charts/SPS,charts/mean_return_100\n"
        b"40,1000,10.0\n"
        b"80,1000,abc\n"  # a value that is not a number
        b"xx,1000,5\n"  # nor a step
        b"120,1000,\xff\xfe\n"  # bytes that are not text
        b"12345678901234567890123,1000,5\n"  # digits run together: a step no int64 holds
        b"140,1000,-1e308\n"  # and a value no axis can lay out beside another
        b"160,1000,30.0\n"
        b"200,1000,nan\n"  # no game finished yet: not damage
        b"240,10")  # a kill cut the last row short: no return in it, not damage either
    (savedir / "csv-only" / "flags.json").write_text("[1, 2]")  # JSON, but not the flags' object
    curve = plotting.load_curve(savedir, "csv-only")
    assert curve.steps.tolist() == [40, 160] and curve.returns.tolist() == [10.0, 30.0]
    assert curve.env is None
    damaged = ("Run csv-only: left out 5 damaged row(s) of its logs.csv (line(s) 3, 4, 5, 6, 7): a step or value "
               "that is not a number or out of range, or bytes that are not text")
    assert capsys.readouterr().out == damaged + "\n"
    out = savedir / "csv-only.png"
    assert run.main(["--mode", "plot", "--savedir", str(savedir), "--xpid", "csv-only", "--plot_out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == damaged and out.read_bytes()[:4] == b"\x89PNG"


def test_a_run_with_nothing_readable_is_one_line_and_exit_2_when_named_and_left_out_of_every_run(
        savedir: Path, capsys: pytest.CaptureFixture) -> None:
    (savedir / "csv-only" / "logs.csv").write_bytes(b"\xff\xfe\x00garbage\n10,abc\n")
    out = savedir / "one.png"
    assert run.main(["--mode", "plot", "--savedir", str(savedir), "--xpid", "csv-only", "--plot_out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"run.py: error: run 'csv-only' in {savedir} has no finished episode to plot yet\n"
    assert not out.exists()
    out = savedir / "all.png"
    assert run.main(["--mode", "plot", "--savedir", str(savedir), "--plot_out", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.err == "" and out.read_bytes()[:4] == b"\x89PNG"
    assert printed.out.splitlines() == [
        ("Run csv-only: left out 2 damaged row(s) of its logs.csv (line(s) 1, 2): a step or value that is not a "
         "number or out of range, or bytes that are not text"),
        f"Left out: run 'csv-only' in {savedir} has no finished episode to plot yet",
        f"Wrote {out}: episodic return of fast, slow against agent steps"]


def test_every_run_is_found_but_not_the_latest_link(savedir: Path) -> None:
    assert plotting.find_runs(savedir) == ["csv-only", "fast", "slow"]


def test_legend_names_the_runs_and_the_bold_lines_are_smoothed(savedir: Path) -> None:
    curves = [plotting.load_curve(savedir, name) for name in ("fast", "slow")]
    axes = plotting.returns_figure(curves).axes[0]
    assert [t.get_text() for t in axes.get_legend().get_texts()] == ["fast", "slow"]
    assert axes.get_xlabel() == "agent steps" and "CartPole-v1" in axes.get_title()
    raw, smoothed = axes.get_lines()[:2]
    assert np.std(np.diff(smoothed.get_ydata())) < np.std(np.diff(raw.get_ydata()))
    assert smoothed.get_ydata()[-1] > 400  # the fast run's curve reaches its plateau


def test_many_runs_keep_every_name_in_a_legend_beside_the_axes_and_a_colour_each(tmp_path: Path) -> None:
    """Thirty runs with evaluations: the legend inside the axes squeezed them to nothing (constrained layout gave
    up, with a warning) and cut its last names off, and colours repeated after ten."""
    steps = np.arange(0, 1000, 100)
    curves = [plotting.Curve(f"run{i}", steps, np.full(len(steps), float(i)), "CartPole-v1",
                             evaluation=plotting.Series(steps[::3], None, np.full(4, float(i)))) for i in range(30)]
    figure = plotting.returns_figure(curves)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "constrained_layout not applied because axes sizes collapsed to zero"
        plotting.save_figure(figure, tmp_path / "many.png", "--plot_out", dpi=50)
    (legend,) = figure.legends
    names = [t.get_text() for t in legend.get_texts()]
    assert len(names) == 60 and names[-1] == "run29: evaluation"
    assert figure.axes[0].get_legend() is None
    bold = [line for line in figure.axes[0].get_lines() if line.get_linewidth() == 2]
    assert len({tuple(line.get_color()) for line in bold}) == 30


def test_plot_mode_writes_a_png_of_several_runs(savedir: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cmp" / "returns.png"
    config = parse_config(["--mode", "plot", "--savedir", str(savedir), "--xpid", "fast", "slow",
                           "--plot_out", str(out)])
    assert config.plot_xpids == ("fast", "slow") and config.xpid is None
    assert plotting.plot(config) == out
    image = imread(out)
    assert image.shape[0] >= 400 and image.shape[1] >= 600
    assert f"Wrote {out}: episodic return of fast, slow against agent steps" in capsys.readouterr().out


def test_plot_mode_defaults_to_every_run_and_savedir_returns_png(savedir: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    out = savedir / "returns.png"
    assert plotting.plot(parse_config(["--mode", "plot", "--savedir", str(savedir)])) == out
    assert out.read_bytes()[:4] == b"\x89PNG"
    # Every run of SAVEDIR, not only `latest` (csv-only too, unless a test before damaged its rows).
    assert re.search(rf"Wrote {re.escape(str(out))}: episodic return of (csv-only, )?fast, slow against agent steps",
                     capsys.readouterr().out)


def test_a_run_directory_whose_name_is_not_utf8_is_left_out_of_every_run_saying_so(
        savedir: Path, capsys: pytest.CaptureFixture) -> None:
    _event_run(savedir, "renamed", [1.0, 2.0], [40, 80])
    (savedir / "renamed").rename(savedir / "by\udcffhand")  # bytes 0xff in its name, as Python lists it
    assert plotting.plot(parse_config(["--mode", "plot", "--savedir", str(savedir)])) == savedir / "returns.png"
    out = capsys.readouterr().out  # once a UnicodeEncodeError's traceback from the legend
    assert f"Left out: run b'by\\xffhand' in {savedir}: its name is not UTF-8 text; rename it to plot it\n" in out
    assert re.search(r"episodic return of (csv-only, )?fast, slow against", out), out


@pytest.mark.parametrize(("name", "pattern"), [
    ("cmp.txt", r"the file's extension gives the plot's format; use one of .*\.png"),
    ("cmp", r"the file's extension gives the plot's format"),  # matplotlib would write cmp.png instead
    ("a_dir", r"is a directory; pass a file path such as .*a_dir/returns.png"),
])
def test_a_plot_path_that_names_no_format_is_refused_and_nothing_written(
        savedir: Path, tmp_path: Path, name: str, pattern: str) -> None:
    outdir = tmp_path / "plots"
    (outdir / "a_dir").mkdir(parents=True)
    with pytest.raises(UserError, match=pattern):
        plotting.plot(parse_config(["--mode", "plot", "--savedir", str(savedir), "--plot_out", str(outdir / name)]))
    assert [p.name for p in outdir.iterdir()] == ["a_dir"] and not any((outdir / "a_dir").iterdir())


def test_a_plot_that_cannot_be_written_leaves_the_previous_one_whole(savedir: Path, monkeypatch: pytest.MonkeyPatch
                                                                      ) -> None:
    out = savedir / "cmp.png"
    config = parse_config(["--mode", "plot", "--savedir", str(savedir), "--plot_out", str(out)])
    plotting.plot(config)
    before = out.read_bytes()

    def full_disk(self: Figure, fname: object, **kwargs: object) -> None:
        Path(str(fname)).write_bytes(b"\x89PNG half")  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    with pytest.raises(UserError, match=r"cannot write the plot .*cmp.png: No space left on device"):
        plotting.plot(config)
    assert out.read_bytes() == before and not list(savedir.glob(".cmp.png.tmp-*"))


def test_a_plot_under_a_file_or_a_link_to_nowhere_says_so(savedir: Path) -> None:
    """Once "File exists", mkdir's words for a file where a directory should be."""
    checkpoint = savedir / "model.tar"
    checkpoint.write_bytes(b"weights")
    (savedir / "nowhere").symlink_to(savedir / "nowhere")  # a link to itself
    for out in (checkpoint / "cmp.png", savedir / "nowhere" / "cmp.png"):
        config = parse_config(["--mode", "plot", "--savedir", str(savedir), "--plot_out", str(out)])
        with pytest.raises(UserError, match=r"^cannot write the plot .*cmp.png: a part of its directory's path is not "
                                            r"a directory \(a file, or a link that leads to none\)$"):
            plotting.plot(config)
    assert checkpoint.read_bytes() == b"weights"


def test_a_format_whose_writer_this_machine_lacks_is_one_line(savedir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib lists .pgf among its formats, but writes it with LaTeX: without it, one line, no file."""
    monkeypatch.setenv("PATH", str(savedir))  # no xelatex on it
    out = savedir / "cmp.pgf"
    config = parse_config(["--mode", "plot", "--savedir", str(savedir), "--plot_out", str(out)])
    with pytest.raises(UserError, match=r"^cannot write the plot .*cmp.pgf as pgf: .*xelatex.*; choose another "
                                        r"extension, such as .png$"):
        plotting.plot(config)
    assert not out.exists() and not list(savedir.glob(".cmp.pgf.tmp-*"))


def test_a_resumed_runs_purged_events_are_plotted_without_a_word_on_stderr(tmp_path: Path) -> None:
    """A resume drops the events a killed session wrote past its checkpoint (TensorBoard's purge), which the
    reader announces as a warning: the run's own doing, not the user's to read before every plot."""
    run_dir = tmp_path / "resumed"
    run_dir.mkdir()
    (run_dir / "flags.json").write_text(json.dumps({"env": "CartPole-v1"}))
    with SummaryWriter(str(run_dir)) as writer:  # killed at step 300, its checkpoint at step 200
        for step in (100, 200, 300):
            writer.add_scalar(plotting.RETURN_TAG, float(step), step)
    with SummaryWriter(str(run_dir), purge_step=200) as writer:
        for step in (200, 400):
            writer.add_scalar(plotting.RETURN_TAG, -float(step), step)
    result = subprocess.run([sys.executable, "run.py", "--mode", "plot", "--savedir", str(tmp_path), "--xpid",
                             "resumed", "--plot_out", str(tmp_path / "r.png")], cwd=REPO, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    curve = plotting.load_curve(tmp_path, "resumed")
    assert curve.steps.tolist() == [100, 200, 400] and curve.returns.tolist() == [100.0, -200.0, -400.0]


def test_the_latest_run_is_drawn_under_its_own_name(savedir: Path) -> None:
    assert plotting.load_curve(savedir, "latest").name == "fast"  # an older version's symlink
    (savedir / "latest").unlink()
    (savedir / "latest").write_text("slow\n")  # the file a run writes now
    assert plotting.load_curve(savedir, "latest").name == "slow"


def test_a_missing_run_names_the_runs_that_exist(savedir: Path) -> None:
    with pytest.raises(UserError, match=r"no run 'nope' .*runs there: csv-only, fast, slow"):
        plotting.plot(parse_config(["--mode", "plot", "--savedir", str(savedir), "--xpid", "fast", "nope"]))


def test_command_line_plots_several_runs_and_other_modes_take_one_xpid(savedir: Path) -> None:
    out = savedir / "cli.png"
    done = subprocess.run([sys.executable, "run.py", "--mode", "plot", "--savedir", str(savedir),
                           "--xpid", "fast", "slow", "--plot_out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:4] == b"\x89PNG" and "fast, slow" in done.stdout
    refused = subprocess.run([sys.executable, "run.py", "--mode", "test", "--xpid", "fast", "slow"],
                             cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0 and "--xpid takes one name" in refused.stderr


def _evaluated_run(savedir: Path, name: str, start_s: float) -> None:
    """Training returns every 100 steps and 1 s, evaluations every 1,000 steps, starting at wall time `start_s`."""
    run_dir = savedir / name
    run_dir.mkdir(parents=True)
    (run_dir / "flags.json").write_text(json.dumps({"env": "CartPole-v1"}))
    with SummaryWriter(str(run_dir)) as writer:
        for i in range(50):
            writer.add_scalar(plotting.RETURN_TAG, 20.0 + i, 100 * i, walltime=start_s + i)
            if i % 10 == 5:
                writer.add_scalar(plotting.EVAL_TAG, 100.0 + i, 100 * i, walltime=start_s + i + 0.5)


def test_evaluations_are_drawn_with_the_training_return_against_steps_or_wall_time(tmp_path: Path) -> None:
    _evaluated_run(tmp_path, "a", start_s=1_000_000.0)
    _evaluated_run(tmp_path, "b", start_s=2_000_000.0)
    curve = plotting.load_curve(tmp_path, "a")
    assert curve.evaluation.steps.tolist() == [500, 1500, 2500, 3500, 4500]
    assert curve.evaluation.values.tolist() == [105.0, 115.0, 125.0, 135.0, 145.0]
    assert curve.times[0] == 0 and curve.evaluation.times.tolist() == [5.5, 15.5, 25.5, 35.5, 45.5]
    curves = [curve, plotting.load_curve(tmp_path, "b")]
    axes = plotting.returns_figure(curves, x="time").axes[0]
    assert [t.get_text() for t in axes.get_legend().get_texts()] == ["a", "a: evaluation", "b", "b: evaluation"]
    assert "hours of training" in axes.get_xlabel()
    raw, _, evaluation = axes.get_lines()[:3]
    assert raw.get_xdata()[-1] == pytest.approx(49 / 3600)  # each run from its own first point, in hours
    assert evaluation.get_xdata().tolist() == pytest.approx([t / 3600 for t in (5.5, 15.5, 25.5, 35.5, 45.5)])
    assert evaluation.get_linestyle() == "--"
    steps_axes = plotting.returns_figure(curves).axes[0]
    assert steps_axes.get_lines()[2].get_xdata().tolist() == [500, 1500, 2500, 3500, 4500]
    out = tmp_path / "time.png"
    plotting.plot(parse_config(["--mode", "plot", "--savedir", str(tmp_path), "--xpid", "a", "b",
                                "--plot_x", "time", "--plot_out", str(out)]))
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_wall_time_needs_event_files(savedir: Path, capsys: pytest.CaptureFixture) -> None:
    """A run named without event files is refused; of every run in SAVEDIR, it is left out, saying so."""
    with pytest.raises(UserError, match=r"csv-only have no TensorBoard event files.*--plot_x steps"):
        plotting.plot(parse_config(["--mode", "plot", "--savedir", str(savedir), "--xpid", "fast", "csv-only",
                                    "--plot_x", "time"]))
    out = plotting.plot(parse_config(["--mode", "plot", "--savedir", str(savedir), "--plot_x", "time"]))
    assert capsys.readouterr().out.splitlines() == [
        f"Left out: run 'csv-only' in {savedir} has no TensorBoard event files, so no wall times",
        f"Wrote {out}: episodic return of fast, slow against hours of training"]


def test_a_return_that_is_no_number_is_left_out_not_the_rolling_mean_after_it(tmp_path: Path) -> None:
    """One NaN or infinite return among a run's games (a logged game of a broken env) blanked the bold line from it
    on: the mean of every window that held it."""
    returns = [float(i) for i in range(100)]
    returns[5], returns[50] = float("nan"), float("inf")
    _event_run(tmp_path, "odd", returns, list(range(0, 10_000, 100)))
    curve = plotting.load_curve(tmp_path, "odd")
    assert len(curve.returns) == 98 and 5 not in curve.returns and np.isfinite(curve.returns).all()
    smoothed = plotting.returns_figure([curve]).axes[0].get_lines()[1].get_ydata()
    assert np.isfinite(smoothed).all()


def test_run_names_are_shown_as_written_in_the_legend(tmp_path: Path) -> None:
    """A `$` opened a formula (a name with `$^$` failed the whole plot with mathtext's traceback) and a name that
    begins with `_` was left out of the legend, as matplotlib does for such labels."""
    for name in ("lr$1e-3$", "bad$^$", "_hidden"):
        _event_run(tmp_path, name, [1.0, 2.0], [0, 100])
    out = plotting.plot(parse_config(["--mode", "plot", "--savedir", str(tmp_path)]))
    assert imread(out).shape[0] > 0
    curves = [plotting.load_curve(tmp_path, name) for name in ("lr$1e-3$", "bad$^$", "_hidden")]
    figure = plotting.returns_figure(curves)
    figure.canvas.draw()  # where a formula would fail
    shown = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert shown == [r"lr\$1e-3\$", r"bad\$^\$", "_hidden"]


def test_a_run_named_twice_or_as_latest_too_is_drawn_once(savedir: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture) -> None:
    drawn: list[list[str]] = []
    figure = plotting.returns_figure
    monkeypatch.setattr(plotting, "returns_figure", lambda curves, **kwargs: drawn.append(
        [c.name for c in curves]) or figure(curves, **kwargs))
    out = plotting.plot(parse_config(["--mode", "plot", "--savedir", str(savedir), "--xpid", "latest", "fast",
                                      "slow", "slow"]))
    assert drawn == [["fast", "slow"]]
    assert capsys.readouterr().out == f"Wrote {out}: episodic return of fast, slow against agent steps\n"


def test_a_logs_csv_set_aside_is_named_where_a_run_is_plotted_from_its_csv(savedir: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    (savedir / "csv-only" / "logs.csv.unreadable").write_text("step,charts/mean_return_100\n10,\"5\n")
    plotting.load_curve(savedir, "csv-only")
    assert capsys.readouterr().out == ("Run csv-only: not plotted: logs.csv.unreadable, its logs.csv set aside as "
                                       "damaged when the run resumed (kept as it was, for a hand to mend)\n")


def test_results_script_compares_run_directories_of_different_savedirs(tmp_path: Path) -> None:
    """`scripts/results.py --compare`: one summary line per run (mean of its last 100 games) and one PNG."""
    steps = list(range(0, 30_000, 100))
    for name, offset in (("a/linear", 0.0), ("b/constant", 5.0)):
        _event_run(tmp_path, name, [offset + i % 10 for i in range(len(steps))], steps, env="PongNoFrameskip-v4")
        (tmp_path / name / "meta.json").write_text(json.dumps({"final_step": steps[-1], "command": "run.py"}))
    out = tmp_path / "cmp.png"
    done = subprocess.run([sys.executable, "scripts/results.py", "pong", "--compare", str(tmp_path / "a/linear"),
                           str(tmp_path / "b/constant"), "--labels", "linear lr", "constant lr", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(r["xpid"], r["mean_last_100"], r["games"]) for r in rows] == [("linear", 4.5, 300), ("constant", 9.5, 300)]
    assert out.read_bytes()[:4] == b"\x89PNG"
    refused = subprocess.run([sys.executable, "scripts/results.py", "pong", "--compare", str(tmp_path / "a/linear"),
                              "--labels", "one", "two"], cwd=REPO, capture_output=True, text=True, timeout=60,
                             check=False)
    assert refused.returncode == 2 and "one label per run directory" in refused.stderr


def test_results_script_without_a_run_to_read_says_so_in_a_line_and_exits_2(tmp_path: Path) -> None:
    """A run that --plot-only or --compare names but that is not there, and a training run refused for its flags:
    one line and exit code 2, not a traceback from reading a run directory that does not exist."""
    (tmp_path / "empty").mkdir()
    cases = [(["pong", "--plot-only", "--savedir", str(tmp_path), "--xpid", "missing"],
              f"--plot-only: no run missing in {tmp_path}; train it first"),
             (["pong", "--compare", str(tmp_path / "empty"), str(tmp_path / "nowhere")],
              f"--compare: not a run directory (no meta.json): {tmp_path / 'empty'} {tmp_path / 'nowhere'}"),
             (["cartpole", "--savedir", str(tmp_path), "--xpid", "refused", "--bogus", "3"],
              "run.py: error: unrecognized arguments: --bogus 3"),
             # Each once a traceback, or a table of dashes written for runs that are not there:
             (["cartpole", "--savedir", str(tmp_path), "--out", str(tmp_path / "r.xyz")],
              f"results.py: error: --out {tmp_path / 'r.xyz'}: the file's extension gives the plot's format; use "),
             (["atari5", "--plot-only", "--savedir", str(tmp_path / "none")],
              f"results.py: error: --plot-only: no Atari-5 run in {tmp_path / 'none'}; train them first"),
             (["cartpole", "--seeds", "0"], "results.py: error: --seeds must be >= 1, got 0")]
    for argv, line in cases:
        done = subprocess.run([sys.executable, "scripts/results.py", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == 2, done.stderr
        assert line in done.stderr.strip().splitlines()[-1], done.stderr
        assert "Traceback" not in done.stderr
        if argv[0] != "cartpole" or "--bogus" not in argv:  # the training run's own line comes after results'
            assert done.stderr.count("\n") == 1, done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["empty"]  # nothing written


def test_results_script_redraws_a_run_still_before_its_first_checkpoint_and_without_its_flags(tmp_path: Path) -> None:
    """--plot-only of a run killed (or still training) before its first checkpoint: the summary and the figure,
    no greedy test (there is nothing to play); a flags.json a kill left out is no traceback either."""
    _event_run(tmp_path, "early", [1.0, 2.0, 3.0], [100, 200, 300], env="PongNoFrameskip-v4")
    (tmp_path / "early" / "flags.json").unlink()
    (tmp_path / "early" / "meta.json").write_text(json.dumps({"command": "run.py"}))
    out = tmp_path / "early.png"
    done = subprocess.run([sys.executable, "scripts/results.py", "pong", "--plot-only", "--savedir", str(tmp_path),
                           "--xpid", "early", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "results: run early has no checkpoint yet: no greedy test\n"
    row = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert (row["games"], row["mean_last_100"], row["env"], row["greedy_test_mean"]) == (3, 2.0, None, None)
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_results_script_passes_unknown_flags_to_the_training_run(tmp_path: Path) -> None:
    """`scripts/results.py cartpole --total_steps N`: the run it starts trains to N and records the flag."""
    done = subprocess.run([sys.executable, "scripts/results.py", "cartpole", "--total_steps", "3000", "--savedir",
                           str(tmp_path), "--xpid", "short", "--test_episodes", "1", "--out", str(tmp_path / "s.png")],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    flags = json.loads((tmp_path / "short" / "flags.json").read_text())
    assert flags["total_steps"] == 3000 and flags["lr_schedule"] == "linear"
    assert 3000 <= json.loads((tmp_path / "short" / "meta.json").read_text())["final_step"] < 300_000
    refused = subprocess.run([sys.executable, "scripts/results.py", "cartpole", "--plot-only", "--total_steps", "9"],
                             cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2 and "unknown flags --total_steps 9" in refused.stderr
