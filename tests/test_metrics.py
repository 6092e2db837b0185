"""Reporting without a training run: the CSV, event files read back by TensorBoard's own reader, the GIF
video summary, the progress line, and the console on a terminal versus a pipe."""

from __future__ import annotations

import csv
import errno
import io
import logging
import math
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tensorboard.backend.event_processing import plugin_event_accumulator
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboard.util import tensor_util

from impala import metrics
from impala.evaluate import write_test_results
from impala.metrics import (
    STATUS,
    ConsoleHandler,
    RecentRate,
    RunLog,
    duration,
    flags_markdown,
    progress_line,
    video_summary,
)


def _read(run_dir: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def test_scalars_go_to_tensorboard_and_csv_and_a_late_tag_widens_the_csv(tmp_path: Path) -> None:
    runlog = RunLog(tmp_path)
    runlog.scalars(40, {"charts/SPS": 100.0})
    runlog.scalars(80, {"charts/SPS": 200.0, "losses/total_loss": 1.5})  # first update finished late
    runlog.scalar("charts/episodic_return", 9.0, 80)
    runlog.close()

    with open(tmp_path / "logs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["40", "80"]
    assert rows[0]["losses/total_loss"] == ""
    assert float(rows[1]["losses/total_loss"]) == 1.5
    assert all("charts/episodic_return" not in r for r in rows)  # per-episode values stay out of the CSV

    accumulator = _read(tmp_path)
    assert [(e.step, e.value) for e in accumulator.Scalars("charts/SPS")] == [(40, 100.0), (80, 200.0)]
    assert [(e.step, e.value) for e in accumulator.Scalars("charts/episodic_return")] == [(80, 9.0)]


def test_game_points_keep_every_game_until_games_end_faster_than_their_rate_then_an_even_share() -> None:
    points = metrics.GamePoints(per_s=2.0, burst=10, now_s=0.0)
    assert list(points.pick(4, now_s=0.0)) == [0, 1, 2, 3]  # within the burst: every game
    assert points.pick(25, now_s=0.0) == [2, 6, 10, 14, 18, 22]  # the 6 points left, spread over the 25
    assert list(points.pick(3, now_s=0.4)) == []  # 0.8 of a point earned
    assert points.pick(3, now_s=1.0) == [0, 2]  # 2.0: two of three
    assert list(points.pick(1, now_s=2.0)) == [0] and list(points.pick(0, now_s=2.0)) == []
    assert list(points.pick(12, now_s=100.0)) == [0, 1, 3, 4, 5, 6, 7, 9, 10, 11]  # refilled to the burst, never above
    returns = np.arange(1_000.0)
    assert np.mean(returns[points.pick(1_000, now_s=1_000.0)]) == pytest.approx(np.mean(returns), abs=0.5)


def test_games_beyond_the_rate_are_counted_but_get_no_point_of_their_own(tmp_path: Path, monkeypatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(metrics, "GAME_POINTS_BURST", 8)
    monkeypatch.setattr(metrics, "GAME_POINTS_PER_S", 0.001)  # none earned while the test runs
    runlog = RunLog(tmp_path)
    with caplog.at_level(logging.INFO, logger="impala"):
        runlog.games([(float(i), 10 + i) for i in range(5)], 40)  # all five: a point each
        runlog.games([(float(i), 20 + i) for i in range(6)], 80)  # three points left for six games
        runlog.games([(1.0, 1)] * 6, 120)
    runlog.close()
    events = _read(tmp_path)
    returns = [(e.step, e.value) for e in events.Scalars("charts/episodic_return")]
    assert returns == [(40, 0.0), (40, 1.0), (40, 2.0), (40, 3.0), (40, 4.0), (80, 1.0), (80, 3.0), (80, 5.0)]
    lengths = [(e.step, e.value) for e in events.Scalars("charts/episodic_length")]
    assert lengths == [(40, 10), (40, 11), (40, 12), (40, 13), (40, 14), (80, 21), (80, 23), (80, 25)]
    assert len([r for r in caplog.records if "Games end faster than 0.001 a second" in r.getMessage()]) == 1


def test_csv_of_a_resumed_run_keeps_its_header_and_appends(tmp_path: Path) -> None:
    first = RunLog(tmp_path)
    first.scalars(40, {"a": 1.0, "b": 2.0})
    first.close()
    second = RunLog(tmp_path, purge_step=60)
    second.scalars(80, {"b": 3.0, "a": 4.0})
    second.close()
    with open(tmp_path / "logs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows == [{"step": "40", "a": "1.0", "b": "2.0"}, {"step": "80", "a": "4.0", "b": "3.0"}]


def test_a_resumed_csv_with_bytes_that_are_not_text_takes_rows_and_widens(tmp_path: Path) -> None:
    """A header damaged on disk costs its column's name, not the run."""
    (tmp_path / "logs.csv").write_bytes(b"step,charts/S\xffPS\n10,1.0\n")
    runlog = RunLog(tmp_path)
    runlog.scalars(20, {"charts/SPS": 2.0})
    runlog.scalars(30, {"charts/SPS": 3.0, "losses/total_loss": 0.5})
    runlog.close()
    with open(tmp_path / "logs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["losses/total_loss"]) for r in rows] == [("10", ""), ("20", ""), ("30", "0.5")]


def test_a_resumed_run_drops_the_events_and_rows_from_its_checkpoints_step_on(tmp_path: Path) -> None:
    """TensorBoard's merged view and the CSV agree, and a point logged again at the checkpoint's step (a resumed
    session evaluates the checkpoint's weights first) is not there twice."""
    first = RunLog(tmp_path)
    for step in (100, 200, 300):  # killed after logging 300, its last checkpoint at 200
        first.scalars(step, {"charts/SPS": float(step)})
    first.close()
    second = RunLog(tmp_path, purge_step=200)
    second.scalars(200, {"charts/SPS": 7.0})
    second.close()
    assert [(e.step, e.value) for e in _read(tmp_path).Scalars("charts/SPS")] == [(100, 100.0), (200, 7.0)]
    with open(tmp_path / "logs.csv", newline="") as f:
        assert [(row["step"], row["charts/SPS"]) for row in csv.DictReader(f)] == [("100", "100.0"), ("200", "7.0")]


def test_the_killed_sessions_points_past_the_checkpoint_leave_its_event_file_for_tensorboards_own_loader(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """TensorBoard's UI reads runs with its plugin loader (or its Rust data server), which take a run's first
    session start for its beginning: the killed session's points past the checkpoint showed beside the resumed
    ones there, one curve in plot mode but two in TensorBoard. They are dropped from its file; a record cut short
    at its end stays as it was, and a file with nothing to drop is not rewritten."""
    first = RunLog(tmp_path)
    for step in (100, 200, 300, 400):  # killed after logging 400, its last checkpoint at 200
        first.scalars(step, {"charts/SPS": float(step)})
    first.scalar("eval/episodic_return_mean", 9.0, 100)  # an evaluation's point at an earlier step, logged later
    first.close()
    (killed,) = tmp_path.glob("events.out.tfevents.*")
    with open(killed, "ab") as f:
        f.write(b"\x40\0\0\0\0\0\0\0cut")  # the kill cut its last record short
    with caplog.at_level(logging.INFO, logger="impala"):
        second = RunLog(tmp_path, purge_step=201)
    second.scalars(300, {"charts/SPS": -300.0})
    second.close()
    assert "TensorBoard: dropped 2 records from step 201 on" in caplog.text
    assert killed.read_bytes().endswith(b"\x40\0\0\0\0\0\0\0cut")
    ui = plugin_event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    ui.Reload()
    shown = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in ui.Tensors("charts/SPS")]
    assert shown == [(100, 100.0), (200, 200.0), (300, -300.0)]
    assert [e.step for e in ui.Tensors("eval/episodic_return_mean")] == [100]
    assert [(e.step, e.value) for e in _read(tmp_path).Scalars("charts/SPS")] == shown

    before = killed.stat()
    RunLog(tmp_path, purge_step=301).close()  # nothing at or past 301 in it
    assert killed.stat().st_ino == before.st_ino and killed.stat().st_mtime_ns == before.st_mtime_ns


def _write_rows(path: Path, steps: list[int], tail: str = "") -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "charts/SPS", "losses/total_loss"])
        writer.writerows([[step, 100.0 + step, ""] for step in steps])
        f.write(tail)


def test_a_resumed_run_drops_the_rows_written_after_its_checkpoint_and_a_row_cut_short(tmp_path: Path) -> None:
    # A session killed at once (kill -9): it logged up to step 500, its last checkpoint was at step 300, and the
    # kill cut its last line short. Without the purge, the resumed rows (from 300 on) would follow 500.
    _write_rows(tmp_path / "logs.csv", [100, 200, 300, 400, 500], tail="600,70")
    runlog = RunLog(tmp_path, purge_step=300)
    runlog.scalars(340, {"charts/SPS": 7.0})
    runlog.close()
    with open(tmp_path / "logs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["step"] for row in rows] == ["100", "200", "340"]
    assert rows[1] == {"step": "200", "charts/SPS": "300.0", "losses/total_loss": ""}
    assert rows[2] == {"step": "340", "charts/SPS": "7.0", "losses/total_loss": ""}
    assert not (tmp_path / "logs.csv.tmp").exists()


@pytest.mark.parametrize("purge", [True, False], ids=["resumed", "widened"])
def test_a_csv_the_csv_module_cannot_parse_is_kept_aside_and_a_new_one_begun(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, purge: bool) -> None:
    """A stray quote (a disk fault) makes the csv module read on to the end of the file, and past its field limit
    (128 KiB) it raises: a resume, or a new column later, must not end the run over its log."""
    _write_rows(tmp_path / "logs.csv", list(range(0, 2_000_000, 100)))  # 380 KB
    damaged = (tmp_path / "logs.csv").read_bytes().replace(b"\n500,", b'\n"500,', 1)
    (tmp_path / "logs.csv").write_bytes(damaged)
    with caplog.at_level(logging.WARNING, logger="impala"):
        runlog = RunLog(tmp_path, purge_step=300_000 if purge else None)
        runlog.scalars(300_000, {"charts/SPS": 7.0})
        runlog.scalars(300_100, {"charts/SPS": 8.0, "late/tag": 1.0})
        runlog.close()
    aside = (tmp_path / "logs.csv.unreadable").read_bytes()
    assert "logs.csv could not be read (csv: field larger than field limit" in caplog.text
    with open(tmp_path / "logs.csv", newline="") as f:
        rows = [(row["step"], row["charts/SPS"], row["late/tag"]) for row in csv.DictReader(f)]
    if purge:  # found at the start: every row since goes to the new file
        assert aside == damaged and rows == [("300000", "7.0", ""), ("300100", "8.0", "1.0")]
    else:  # found when a column came: the rows before are in the file kept aside
        assert aside == damaged + b"300000,7.0,\r\n" and rows == [("300100", "8.0", "1.0")]


@pytest.mark.parametrize("purge", [True, False], ids=["resumed", "widened"])
def test_a_stray_quote_short_of_the_field_limit_sets_the_csv_aside_rather_than_dropping_the_rows_after_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, purge: bool) -> None:
    """The same quote where less than 128 KiB follows it: the csv module read the rest of the file as one field of
    one row, which the purge then dropped as a row of the wrong length, and with it every row after the quote,
    those before the checkpoint too, logging "dropped 1 rows"."""
    _write_rows(tmp_path / "logs.csv", list(range(0, 300_000, 100)))
    damaged = (tmp_path / "logs.csv").read_bytes().replace(b"\n150000,", b'\n"150000,', 1)
    (tmp_path / "logs.csv").write_bytes(damaged)
    with caplog.at_level(logging.WARNING, logger="impala"):
        runlog = RunLog(tmp_path, purge_step=200_001 if purge else None)
        runlog.scalars(300_000, {"charts/SPS": 7.0, **({} if purge else {"late/tag": 1.0})})
        runlog.close()
    assert "logs.csv could not be read (csv: a quote that no field closes" in caplog.text
    aside = (tmp_path / "logs.csv.unreadable").read_bytes()
    assert aside == damaged  # every row kept, as it was
    with open(tmp_path / "logs.csv", newline="") as f:
        assert [row["step"] for row in csv.DictReader(f)] == ["300000"]


@pytest.mark.parametrize("widen", [False, True], ids=["purged", "widened"])
def test_a_long_runs_csv_is_purged_and_widened_without_holding_it_in_memory(tmp_path: Path, widen: bool) -> None:
    """A run of weeks has a logs.csv of hundreds of MB: read whole, its rows took some 12 times its size in
    memory at every resume (and kept resident by the trainer's malloc settings)."""
    with open(tmp_path / "logs.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", *(f"tag{i}" for i in range(20))])
        writer.writerows([step, *[1.2345678] * 20] for step in range(0, 2_000_000, 40))  # 10 MB
    tracemalloc.start()
    try:
        runlog = RunLog(tmp_path, purge_step=1_000_000)
        if widen:
            runlog.scalars(1_000_000, {"new/tag": 1.0})
        runlog.close()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * 2**20, peak  # 120 MB read whole
    with open(tmp_path / "logs.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert len(rows) == 1 + 25_000 + widen and rows[-1][0] == ("1000000" if widen else "999960")


def test_a_resumed_run_leaves_a_whole_csv_of_rows_before_its_checkpoint_untouched(tmp_path: Path) -> None:
    _write_rows(tmp_path / "logs.csv", [100, 200, 300])
    before = (tmp_path / "logs.csv").read_bytes()
    RunLog(tmp_path, purge_step=301).close()
    assert (tmp_path / "logs.csv").read_bytes() == before
    RunLog(tmp_path / "new", purge_step=300).close()  # no CSV yet: nothing to purge
    assert not (tmp_path / "new" / "logs.csv").exists()


def test_flags_are_written_as_a_markdown_table_and_as_hparams(tmp_path: Path) -> None:
    runlog = RunLog(tmp_path)
    runlog.flags({"env": "CartPole-v1", "learning_rate": 0.001, "xpid": None, "plot_xpids": ["a|b"]})
    runlog.close()
    accumulator = _read(tmp_path)

    text = accumulator.Tensors("flags/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text.splitlines()[:3] == ["| flag | value |", "|---|---|", "| env | `CartPole-v1` |"]
    assert "| plot_xpids | `['a\\|b']` |" in text  # a pipe would split the cell

    content = accumulator.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    assert start.session_start_info.hparams["learning_rate"].number_value == 0.001
    assert start.session_start_info.hparams["env"].string_value == "CartPole-v1"
    assert start.session_start_info.hparams["xpid"].string_value == "None"
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    assert {m.name.tag for m in experiment.experiment.metric_infos} == set(metrics.HPARAM_METRICS)
    assert "charts/episodic_return" not in accumulator.Tags()["scalars"]  # no placeholder metric values


def test_flags_markdown_has_one_row_per_flag() -> None:
    table = flags_markdown({"a": 1, "b": "x"})
    assert table == "| flag | value |\n|---|---|\n| a | `1` |\n| b | `x` |"


def test_video_is_an_animated_gif_image_summary(tmp_path: Path) -> None:
    frames = np.zeros((5, 6, 8, 3), np.uint8)
    for t in range(5):
        frames[t, :, t] = 255  # a white column moving right
    assert write_test_results(tmp_path, 123, [1.0, 3.0], frames, fps=10) == tmp_path / "test"

    assert [(e.step, e.value) for e in _read(tmp_path / "test").Scalars("test/episodic_return_mean")] == [(123, 2.0)]
    (image,) = _read(tmp_path / "test").Images("test/video")
    assert (image.step, image.width, image.height) == (123, 8, 6)
    gif = Image.open(io.BytesIO(image.encoded_image_string))
    assert gif.format == "GIF" and gif.n_frames == 5
    gif.seek(3)
    assert np.asarray(gif.convert("RGB"))[0, 3].tolist() == [255, 255, 255]


def test_video_summary_accepts_grey_frames_and_rejects_empty_ones() -> None:
    summary = video_summary("v", np.zeros((2, 4, 4), np.uint8), fps=15)
    assert summary.value[0].image.colorspace == 3
    with pytest.raises(ValueError):
        video_summary("v", np.zeros((0, 4, 4, 3), np.uint8), fps=15)


def test_progress_line_shows_percentage_speed_times_and_return() -> None:
    line = progress_line(step=25_000, total_steps=100_000, sps=1000.0, elapsed_s=25.0, mean_return=41.26, episodes=212)
    assert line == ("[#####---------------]  25.0%  step 25,000/100,000  SPS 1,000  elapsed 0:00:25  "
                    "left 0:01:15  return 41.3 (212 ep)")
    early = progress_line(step=0, total_steps=10, sps=0.0, elapsed_s=0.0, mean_return=math.nan, episodes=0)
    assert "left ?" in early and "return -" in early and "  0.0%" in early
    done = progress_line(step=12, total_steps=10, sps=5.0, elapsed_s=3661.0, mean_return=1.0, episodes=1)
    assert done.startswith("[" + "#" * 20 + "] 100.0%") and "elapsed 1:01:01" in done and "left 0:00:00" in done


def test_the_console_rate_spans_the_last_minute_so_two_or_three_updates_per_interval_read_as_one_speed() -> None:
    # A CPU learner: 1,024 agent steps per update, 2 or 3 updates in each 5-s interval (409.6 or 614.4 each).
    rate = RecentRate(0.0, 10_000)
    step, rates = 10_000, []
    for interval in range(1, 41):
        step += 1024 * (2 if interval % 2 else 3)
        rates.append(rate.add(5.0 * interval, step))
    assert rates[0] == pytest.approx(409.6)  # the first interval: all there is
    assert rates[2] == pytest.approx(1024 * 7 / 15)  # since the start, within the first minute
    assert rates[11:] == pytest.approx([512.0] * 29)  # from a minute on: the last 12 intervals, 6 of each kind
    assert len(rate._points) == 13  # what it keeps: a minute of points, not the run's
    paused = RecentRate(0.0, 0)
    paused.add(5.0, 500)
    assert paused.add(35.0, 500) == pytest.approx(500 / 35.0)  # a stall shows as a falling rate
    assert paused.add(65.0, 500) == 0.0  # and a minute of it as none


def test_duration_formats_hours_minutes_seconds() -> None:
    assert duration(0) == "0:00:00"
    assert duration(3725.9) == "1:02:05"
    assert duration(math.inf) == "?" and duration(math.nan) == "?"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _logger_with(handler: logging.Handler) -> logging.Logger:
    logger = logging.getLogger(f"impala-test-{id(handler)}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    return logger


def test_console_on_a_terminal_redraws_one_status_line(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    handler = ConsoleHandler()
    logger = _logger_with(handler)
    logger.info("10%", extra=STATUS)
    logger.info("20%", extra=STATUS)
    logger.info("saved a checkpoint")
    logger.info("30%", extra=STATUS)
    handler.end_status()
    assert terminal.getvalue() == ("\r10%\x1b[K" "\r20%\x1b[K"  # redrawn in place
                                   "\nsaved a checkpoint\n"  # a message leaves the status line as it was
                                   "\r30%\x1b[K" "\n")  # the last status stays on screen


def test_console_piped_gets_plain_lines_and_the_log_file_too(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pipe = io.StringIO()
    monkeypatch.setattr("sys.stdout", pipe)
    handler = ConsoleHandler()
    logger = _logger_with(handler)
    file_handler = logging.FileHandler(tmp_path / "out.log")
    file_handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(file_handler)
    logger.info("10%", extra=STATUS)
    logger.info("saved")
    logger.info("20%", extra=STATUS)
    handler.end_status()
    file_handler.close()
    assert pipe.getvalue() == "10%\nsaved\n20%\n"
    assert (tmp_path / "out.log").read_text() == "10%\nsaved\n20%\n"


def test_console_on_a_terminal_still_writes_plain_lines_to_the_log_file(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("sys.stdout", _Terminal())
    metrics.setup_console(tmp_path / "out.log")
    try:
        metrics.log.info("step 1", extra=STATUS)
        metrics.log.info("step 2", extra=STATUS)
    finally:
        metrics.close_console()
    lines = (tmp_path / "out.log").read_text().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == ["step 1", "step 2"]
    assert "\r" not in (tmp_path / "out.log").read_text()


class _Refusing(io.StringIO):
    """A stream that takes no more bytes: a full disk, or a pipe whose reader has gone."""

    def __init__(self, error: OSError) -> None:
        super().__init__()
        self.error = error

    def write(self, text: str) -> int:
        raise self.error

    def flush(self) -> None:
        raise self.error

    def close(self) -> None:  # as a file's close: it flushes first, and is closed even when that fails
        if not self.closed:
            super().close()
            raise self.error

    def __del__(self) -> None:  # dropped unclosed by a test: nothing to report when it is collected
        pass


def test_a_log_file_on_a_full_disk_is_reported_once_and_takes_lines_again_once_it_can(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    handler = metrics.LogFile(tmp_path / "out.log")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = _logger_with(handler)
    logger.info("before")
    working = handler.stream
    handler.stream = _Refusing(OSError(errno.ENOSPC, "No space left on device"))
    for i in range(5):
        logger.info("lost %d", i)
    handler.stream = working  # space again
    logger.info("after")
    handler.stream = _Refusing(OSError(errno.ENOSPC, "No space left on device"))
    handler.close()  # its last flush fails too: no exception at the end of a run
    assert (tmp_path / "out.log").read_text() == "before\nafter\n"
    err = capsys.readouterr().err
    assert err == (f"impala: could not write the log to {tmp_path / 'out.log'}: [Errno 28] No space left on device; "
                   "training goes on (reported once, until it is written again)\n"
                   f"impala: writing the log to {tmp_path / 'out.log'} again\n")


def test_a_log_file_deleted_moved_or_without_its_directory_is_opened_again_at_its_path(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = run_dir / "out.log"
    handler = metrics.LogFile(path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = _logger_with(handler)
    logger.info("first")
    path.rename(run_dir / "out.log.1")  # logrotate without copytruncate
    logger.info("second")
    path.unlink()
    logger.info("third")
    shutil.rmtree(run_dir)  # the run directory deleted: reported once, never raised to the caller
    logger.info("lost")
    logger.info("lost too")
    run_dir.mkdir()  # made again
    logger.info("fourth")
    handler.close()
    assert path.read_text() == "fourth\n"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith(f"impala: could not write the log to {path}: [Errno 2]")
    assert err[1] == f"impala: writing the log to {path} again"


def test_a_csv_deleted_or_moved_away_is_begun_again_with_its_header(tmp_path: Path) -> None:
    runlog = RunLog(tmp_path)
    runlog.scalars(40, {"charts/SPS": 100.0})
    (tmp_path / "logs.csv").rename(tmp_path / "logs.csv.old")
    runlog.scalars(80, {"charts/SPS": 200.0})
    (tmp_path / "logs.csv").unlink()
    runlog.scalars(120, {"charts/SPS": 300.0})
    runlog.close()
    assert (tmp_path / "logs.csv.old").read_text().splitlines() == ["step,charts/SPS", "40,100.0"]
    assert (tmp_path / "logs.csv").read_text().splitlines() == ["step,charts/SPS", "120,300.0"]


def test_a_console_whose_reader_went_away_is_reported_once(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture) -> None:
    logger = _logger_with(ConsoleHandler())
    monkeypatch.setattr("sys.stdout", _Refusing(BrokenPipeError(errno.EPIPE, "Broken pipe")))
    for i in range(5):
        logger.info("step %d", i)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not write the log to stdout: [Errno 32] Broken pipe" in err
    assert "Logging error" not in err and "Traceback" not in err
    monkeypatch.setattr("sys.stdout", io.StringIO())  # a reader again: said once, and a new failure told again
    logger.info("back")
    monkeypatch.setattr("sys.stdout", _Refusing(BrokenPipeError(errno.EPIPE, "Broken pipe")))
    logger.info("gone again")
    failed_again = ("impala: could not write the log to stdout: [Errno 32] Broken pipe; training goes on (reported "
                    "once, until it is written again)")
    assert capsys.readouterr().err.splitlines() == ["impala: writing the log to stdout again", failed_again]


class _BrokenWriter:
    """A SummaryWriter whose thread died on a full disk: every call raises (the same error, in TensorBoard)."""

    def __init__(self) -> None:
        self.calls = 0

    def add_scalar(self, *args: object) -> None:
        self.calls += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_tensorboard_after_a_full_disk_is_set_aside_then_tried_anew(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    runlog = RunLog(tmp_path)
    runlog.scalar("charts/SPS", 1.0, 10)
    runlog.writer.close()
    broken = runlog.writer = _BrokenWriter()  # type: ignore[assignment]
    with caplog.at_level(logging.ERROR, logger="impala"):
        for step in range(20, 100, 10):
            runlog.scalars(step, {"charts/SPS": float(step)})
        assert broken.calls == 1  # set aside after its first error, not called (and re-raising) at every scalar
        now[0] += metrics.TENSORBOARD_RETRY_S
        runlog.scalars(200, {"charts/SPS": 200.0})  # space again: a new writer, a new event file
        runlog.close()
    assert caplog.text.count("Could not write the TensorBoard event file") == 1
    assert [(e.step, e.value) for e in _read(tmp_path).Scalars("charts/SPS")] == [(10, 1.0), (200, 200.0)]
    with open(tmp_path / "logs.csv", newline="") as f:  # the CSV had space all along
        assert [row["step"] for row in csv.DictReader(f)] == [str(step) for step in (*range(20, 100, 10), 200)]


def _disk_for_tensorboard(monkeypatch: pytest.MonkeyPatch, full: bool) -> tuple[list[bool], list[float]]:
    """TensorBoard's file writes fail as on a full disk while `full[0]`, the file made and nothing written in it;
    `metrics.time.monotonic` reads `now[0]`. Returns (full, now), for the test to change."""
    from tensorboard.compat.tensorflow_stub.io import gfile

    is_full, now, real_write = [full], [1000.0], gfile.LocalFileSystem._write

    def write(self: object, filename: str, content: bytes, mode: str) -> None:
        if is_full[0]:
            open(filename, mode).close()
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, filename, content, mode)

    monkeypatch.setattr(gfile.LocalFileSystem, "_write", write)
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    return is_full, now


def test_tensorboard_on_a_disk_that_stays_full_is_tried_anew_without_a_traceback_and_comes_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        capfd: pytest.CaptureFixture) -> None:
    """TensorBoard's own writer on a full disk (its file writes fail, as the file system would fail them): the
    writer thread dies without a traceback on the console, a new writer tried while the disk is still full fails
    in its constructor and is tried again later (it ended the run before), and once there is space the curve
    goes on in a new event file; the empty files of the failed tries are not left behind."""
    full, now = _disk_for_tensorboard(monkeypatch, full=False)
    with caplog.at_level(logging.ERROR, logger="impala"):
        runlog = RunLog(tmp_path)
        runlog.scalar("charts/SPS", 1.0, 10)
        runlog.writer.flush()  # on disk before it fills
        full[0] = True
        runlog.scalar("charts/SPS", 2.0, 20)
        runlog._tensorboard(lambda writer: writer.flush())  # the thread fails on its write; the error comes here
        for retry in range(3):  # the disk stays full: each new writer fails as it starts
            now[0] += metrics.TENSORBOARD_RETRY_S
            runlog.scalars(30 + retry, {"charts/SPS": 3.0})
        full[0] = False
        now[0] += metrics.TENSORBOARD_RETRY_S
        runlog.scalars(200, {"charts/SPS": 200.0})
        runlog.close()
    assert caplog.text.count("Could not write the TensorBoard event file") == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    assert [(e.step, e.value) for e in _read(tmp_path).Scalars("charts/SPS")] == [(10, 1.0), (200, 200.0)]
    event_files = sorted(tmp_path.glob("events.out.tfevents.*"))
    assert len(event_files) == 2 and all(f.stat().st_size > 0 for f in event_files)  # the first and the one after


def test_a_run_log_begun_on_a_disk_too_full_for_its_first_event_is_made_and_purges_once_there_is_space(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A resumed session on a nearly full disk: the event file's first record fails in the writer's constructor.
    That is reported in one line, not a traceback that ends the start; the writer made once there is space
    carries the resume's purge, so the killed session's curve past the checkpoint is still dropped, and the
    session's flags, written once at its start."""
    previous = RunLog(tmp_path)  # the killed session: a checkpoint at step 20, events on to step 40
    for step in (10, 20, 30, 40):
        previous.scalar("charts/SPS", float(step), step)
    previous.close()
    full, now = _disk_for_tensorboard(monkeypatch, full=True)
    with caplog.at_level(logging.WARNING, logger="impala"):
        runlog = RunLog(tmp_path, purge_step=20)
        runlog.flags({"env": "CartPole-v1"}, 20)
        runlog.scalars(25, {"charts/SPS": 25.0})  # not yet time to try again: the CSV only
        full[0] = False
        now[0] += metrics.TENSORBOARD_RETRY_S
        runlog.scalars(50, {"charts/SPS": 50.0})
        runlog.close()
    assert caplog.text.count("Could not write the TensorBoard event file") == 1
    assert caplog.text.count("Writing the TensorBoard event file") == 1  # and a later failure is reported again
    accumulator = _read(tmp_path)
    assert [(e.step, e.value) for e in accumulator.Scalars("charts/SPS")] == [(10, 10.0), (50, 50.0)]
    assert [e.step for e in accumulator.Tensors("flags/text_summary")] == [20]
    assert "_hparams_/session_start_info" in accumulator.PluginTagToContent("hparams")
    assert all(f.stat().st_size > 0 for f in tmp_path.glob("events.out.tfevents.*"))  # the failed one removed


def test_a_csv_whose_widening_failed_on_a_full_disk_keeps_taking_rows_and_widens_once_it_can(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Widening rewrites the whole file (a second copy's worth of space): failing there costs that row its new
    column, not the row, and is tried again a while later, not at every row (each try rewrites the file)."""
    now = [1000.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    runlog = RunLog(tmp_path)
    runlog.scalars(10, {"charts/SPS": 1.0})
    replace, tries = runlog._replace_csv, []

    def full(header: object, rows: object) -> None:
        tries.append(header)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runlog, "_replace_csv", full)
    with caplog.at_level(logging.WARNING, logger="impala"):
        runlog.scalars(20, {"charts/SPS": 2.0, "eval/episodic_return_mean": 5.0})  # a first evaluation's tag
        assert "Could not write the new columns of logs.csv" in caplog.text
        runlog.scalars(30, {"charts/SPS": 3.0, "eval/episodic_return_mean": 5.5})
        assert len(tries) == 1  # not again so soon
        monkeypatch.setattr(runlog, "_replace_csv", replace)  # space again
        now[0] += metrics.TENSORBOARD_RETRY_S
        runlog.scalars(40, {"charts/SPS": 4.0, "eval/episodic_return_mean": 6.0})
        runlog.close()
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == [
        "Could not write the new columns of logs.csv", "Writing the new columns of logs.csv"]
    with open(tmp_path / "logs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["charts/SPS"], r["eval/episodic_return_mean"]) for r in rows] == [
        ("10", "1.0", ""), ("20", "2.0", ""), ("30", "3.0", ""), ("40", "4.0", "6.0")]


def test_a_csv_whose_file_fails_to_close_before_widening_takes_rows_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """On a full disk the file's last flush fails, and with it the close that widening starts with: the file is
    reopened as it is, the row appended without its new column, and the widening tried again later."""
    now = [1000.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    runlog = RunLog(tmp_path)
    runlog.scalars(10, {"charts/SPS": 1.0})
    runlog._csv_file.close()
    runlog._csv_file = _Refusing(OSError(errno.ENOSPC, "No space left on device"))
    with caplog.at_level(logging.ERROR, logger="impala"):
        runlog.scalars(20, {"charts/SPS": 2.0, "eval/episodic_return_mean": 5.0})
    assert "Could not write the new columns of logs.csv" in caplog.text
    runlog.scalars(30, {"charts/SPS": 3.0})
    now[0] += metrics.TENSORBOARD_RETRY_S
    runlog.scalars(40, {"charts/SPS": 4.0, "eval/episodic_return_mean": 6.0})
    runlog.close()
    with open(tmp_path / "logs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["eval/episodic_return_mean"]) for r in rows] == [
        ("10", ""), ("20", ""), ("30", ""), ("40", "6.0")]


def test_a_purge_that_failed_is_not_said_to_be_written_again_by_the_next_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The rows past the resumed step stay where the purge could not rewrite the file: a row appended after it
    does not make that right, so it must not read as a recovery."""
    _write_rows(tmp_path / "logs.csv", [100, 200, 300])

    def full(self: RunLog, header: object, rows: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RunLog, "_replace_csv", full)
    with caplog.at_level(logging.WARNING, logger="impala"):
        runlog = RunLog(tmp_path, purge_step=200)
        runlog.scalars(200, {"charts/SPS": 7.0})
        runlog.close()
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == [
        "Could not write logs.csv without its rows from the resumed step on (they stay)"]


def test_closing_the_logs_on_a_full_disk_reports_instead_of_raising(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    runlog = RunLog(tmp_path)
    runlog.scalars(10, {"charts/SPS": 1.0})
    runlog._csv_file.close()
    runlog._csv_file = _Refusing(OSError(errno.ENOSPC, "No space left on device"))  # its last flush fails
    with caplog.at_level(logging.ERROR, logger="impala"):
        runlog.close()  # the end of a run: no traceback, the run's exit code stays its own
    assert "Could not write logs.csv" in caplog.text and "No space left on device" in caplog.text
