"""What a run reports: TensorBoard scalars, a CSV of the same scalars, and the console.

Tags follow the CleanRL / Stable-Baselines3 grouping, always against agent steps:

    charts/   episodic_return, episodic_length, SPS, learning_rate, frames, episodes, mean_return_100
    losses/   total_loss, pg_loss, baseline_loss, entropy_loss
    stats/    grad_norm, policy_lag, rho_mean, rho_clipped_fraction, ppo_clip_fraction, full_queue_size, free_queue_size,
              ..., inference_actors_per_batch, inference_busy_share (--inference central)
    timing/   wait_batch_ms, host_to_device_ms (stack_ms of it), update_lock_wait_ms, forward_backward_ms, publish_ms,
              vote_ms (torchrun), inference_batch_ms, inference_forward_ms, inference_slots_ms (--inference central)
    actors/   slot_wait_share, policy_share, env_share, write_share (where the local actors' time went)
    eval/     episodic_return_mean, episodic_return_std, episode_length_mean, games_cut, cpu_s (while training)
    test/     episodic_return_mean and video (test mode's --video, in RUN_DIR/test: a TensorBoard run of its own)
    flags     the run's flags as a markdown table (TEXT tab) and as hparams (HPARAMS tab)

The console gets one progress line per log interval: redrawn in place on a terminal, a plain log line
anywhere else (a pipe, a file, CI, `docker logs`); `out.log` always gets plain lines.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import io
import logging
import logging.handlers
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import Summary, hparams

from impala.events import purge_events

log = logging.getLogger("impala")

# Pass as `extra=STATUS` to log a progress line: a terminal redraws it in place instead of scrolling.
STATUS = {"status": True}

NEW_COLUMNS = "the new columns of logs.csv"  # what a failed widening reports
PURGE = "logs.csv without its rows from the resumed step on (they stay)"  # what a failed purge reports
PURGE_EVENTS = "the event files without their points from the resumed step on (they stay)"
TENSORBOARD_RETRY_S = 60.0  # after a failed TensorBoard write (a full disk), how long until a new writer is tried
# Games with a TensorBoard point of their own (charts/episodic_return and episodic_length, about 124 bytes a game):
# on average at most this many a second, and at most this many at once (see `GamePoints`).
GAME_POINTS_PER_S = 20.0
GAME_POINTS_BURST = 1200

# The scalar tags the HPARAMS tab shows beside each run's flags (TensorBoard reads their values from
# the scalars of the same run, so nothing extra is written for them).
HPARAM_METRICS = ("charts/episodic_return", "charts/mean_return_100", "charts/SPS")


def quiet_event_writer_threads() -> None:
    """No traceback on the console from TensorBoard's writer thread when its write fails (a full disk): the thread
    dies, keeps the error and raises it again at the writer's next call, where `RunLog` reports it in one line.
    Every other thread's uncaught exception goes to the hook as before."""
    previous = threading.excepthook
    if getattr(previous, "quiets_event_writers", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            previous(args)

    hook.quiets_event_writers = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def remove_empty_files(paths: Iterable[Path]) -> None:
    """Delete those of `paths` that are empty: event files a writer began on a full disk and could put nothing in."""
    for path in paths:
        with contextlib.suppress(OSError):
            if path.stat().st_size == 0:
                path.unlink()


def _step_below(text: str, limit: int) -> bool:
    try:
        return float(text) < limit
    except ValueError:  # not a number: a row garbled by a kill
        return False


def _complete_rows(file: Iterable[str], cut: bool) -> Iterator[list[str]]:
    """The CSV rows of `file`, but for its last where a kill cut that line short (`cut`: no newline at its end).
    Raises csv.Error for a field across lines: a stray quote (a garbled byte) that made the rows after it one field,
    which no row of numbers has."""
    previous = None
    for row in csv.reader(file):
        _check_one_line(row)
        if previous is not None:
            yield previous
        previous = row
    if previous is not None and not cut:
        yield previous


def _check_one_line(fields: Iterable[object]) -> None:
    """Raise csv.Error for a row with a field across lines: no row of numbers has one."""
    if any(isinstance(field, str) and ("\n" in field or "\r" in field) for field in fields):
        raise csv.Error("a quote that no field closes joins the lines after it into one field")


def _one_line_rows(rows: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """`rows` (a DictReader's), checked by `_check_one_line`."""
    for row in rows:
        _check_one_line(row.values())
        yield row


def _is_open_file(path: Path, file: io.IOBase) -> bool:
    """Whether `path` is still the file that `file` has open (not deleted, moved away or replaced); True where that
    cannot be told (a stat that fails otherwise: the write that follows reports what is wrong)."""
    try:
        at_path = path.stat()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        opened = os.fstat(file.fileno())
    except (OSError, ValueError):  # no descriptor, or closed
        return True
    return (at_path.st_dev, at_path.st_ino) == (opened.st_dev, opened.st_ino)


def move_aside(path: Path) -> Path:
    """Rename `path` to PATH.unreadable (-1, -2, ... where that exists), never over another file; returns the
    new name."""
    aside = path.with_name(path.name + ".unreadable")
    number = 0
    while aside.exists():
        number += 1
        aside = path.with_name(f"{path.name}.unreadable-{number}")
    os.replace(path, aside)
    return aside


class RunLog:
    """TensorBoard event files and `logs.csv` in the run directory.

    `purge_step` (when resuming: the step after the checkpoint's) drops events and CSV rows from that step on, as
    TensorBoard does: those a killed run wrote after its last checkpoint, so that the resumed curve continues the
    old one instead of overlapping it. What was logged at the checkpoint's own step stays (the games that ended
    while its session stopped, its last progress row). Not thread-safe: one thread (the monitor) writes. A
    storage error while training (a full disk) is logged once per file and never ends the run: the scalars are
    lost, the training is not. TensorBoard comes back by itself once there is space again: a writer that failed
    is set aside and a new one (a new event file) tried every TENSORBOARD_RETRY_S.
    """

    def __init__(self, run_dir: str | os.PathLike, purge_step: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        quiet_event_writer_threads()
        self._csv_path = self.run_dir / "logs.csv"
        self._csv_file: Any = None
        self._csv: csv.DictWriter | None = None
        self._failed: set[str] = set()  # files a write failed for, reported once each
        self.writer: SummaryWriter | None = None
        self._tensorboard_failed_at: float | None = None  # when the writer last failed (monotonic s)
        self._purge_step = purge_step  # for the first writer made: its event file carries the purge
        self._flags: Callable[[SummaryWriter], None] | None = None  # writes the run's flags (`flags`)
        self._unwritten_flags: Callable[[SummaryWriter], None] | None = None  # `flags` that found no writer
        self._widen_after = 0.0  # when logs.csv's header may next be widened (monotonic s), after a failed try
        self._game_points = GamePoints(GAME_POINTS_PER_S, GAME_POINTS_BURST, time.monotonic())
        self._game_points_thinned = False  # told once
        if purge_step is not None:
            self._purge_events(purge_step)  # before this session's file is begun
        self._open_writer()  # a disk too full even for its first record: reported, and tried again later
        if purge_step is not None:
            self._purge_csv(purge_step)

    def _purge_events(self, purge_step: int) -> None:
        """Drop the earlier sessions' TensorBoard points at and after `purge_step` from their event files
        (`events.purge_events`); a file that cannot be rewritten is reported and kept as it is."""
        try:
            dropped = purge_events(self.run_dir, purge_step)
        except OSError as exc:
            self._report(PURGE_EVENTS, exc)
            return
        if dropped:
            log.info("TensorBoard: dropped %d records from step %d on, logged after the checkpoint this run resumes "
                     "from", dropped, purge_step)

    def _purge_csv(self, purge_step: int) -> None:
        """Drop the CSV rows at and after `purge_step` (the step after that of the checkpoint a resumed run starts
        from), as TensorBoard drops its events there, and a last row that a kill cut short: after a `kill -9` or a
        power cut the previous session's rows went on past its last checkpoint, and the resumed rows would start
        again below them. Replaced atomically, and only when something is dropped; a file that cannot be read or
        replaced is reported and kept as it is."""
        try:
            with open(self._csv_path, "rb") as raw:  # a last line without its newline was cut short
                cut = raw.seek(0, os.SEEK_END) > 0 and raw.seek(-1, os.SEEK_END) >= 0 and raw.read(1) != b"\n"
        except FileNotFoundError:
            return
        except OSError as exc:
            self._report(PURGE, exc)
            return
        try:  # streamed, twice where something is dropped: a run of weeks has a logs.csv of hundreds of MB
            with open(self._csv_path, newline="", errors="replace") as f:
                rows = _complete_rows(f, cut)
                header = next(rows, None)
                if header is None or "step" not in header:
                    return
                column = header.index("step")

                def kept(row: list[str]) -> bool:
                    return len(row) == len(header) and _step_below(row[column], purge_step)

                dropped = sum(not kept(row) for row in rows)
            if not dropped and not cut:
                return
            with open(self._csv_path, newline="", errors="replace") as f:
                rows = _complete_rows(f, cut)
                next(rows)
                self._replace_csv(header, (row for row in rows if kept(row)))
        except csv.Error as exc:
            self._set_csv_aside(exc)
            return
        except OSError as exc:
            self._report(PURGE, exc)
            return
        log.info("logs.csv: dropped %d rows from step %d on, logged after the checkpoint this run resumes from",
                 dropped, purge_step)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Write each `tag: value` at `step` to TensorBoard and one row to the CSV."""
        for tag, value in values.items():
            self.scalar(tag, value, step)
        try:
            self._write_csv({"step": step, **values})
        except OSError as exc:
            self._report("logs.csv", exc)
        else:
            self._recovered("logs.csv")

    def scalar(self, tag: str, value: float, step: int) -> None:
        """One TensorBoard scalar, not in the CSV."""
        self._tensorboard(lambda writer: writer.add_scalar(tag, value, step))

    def games(self, games: Sequence[tuple[float, int]], step: int) -> None:
        """A point at `step` in charts/episodic_return and charts/episodic_length for each of `games` (return,
        length) that `GamePoints` keeps: all of them unless games end faster than GAME_POINTS_PER_S."""
        kept = self._game_points.pick(len(games), time.monotonic())
        if len(kept) < len(games) and not self._game_points_thinned:
            self._game_points_thinned = True
            log.info("Games end faster than %g a second: charts/episodic_return and episodic_length show an even "
                     "share of them from here (charts/mean_return_100 and charts/episodes count every game)",
                     self._game_points.per_s)
        for index in kept:
            episode_return, episode_length = games[index]
            self.scalar("charts/episodic_return", episode_return, step)
            self.scalar("charts/episodic_length", episode_length, step)

    def _tensorboard(self, write: Callable[[SummaryWriter], object]) -> bool:
        """`write(writer)`, unless the writer failed and it is not yet time to try a new one; whether it wrote.

        A failed write leaves a SummaryWriter broken for good (its thread has died on the error, and every later
        call raises that same exception again, its traceback a few frames longer each time: memory a run of days
        on a full disk would not give back). So the writer is set aside, and a new one tried later.
        """
        failed_at = self._tensorboard_failed_at
        if failed_at is not None and (time.monotonic() - failed_at < TENSORBOARD_RETRY_S or not self._open_writer()):
            return False
        assert self.writer is not None, "made, or the writer failed"
        try:
            if self._unwritten_flags is not None:  # the session's flags, once: first in the writer made after
                self._unwritten_flags(self.writer)
                self._unwritten_flags = None
            write(self.writer)
        except OSError as exc:
            self._report("the TensorBoard event file", exc)
            self._tensorboard_failed_at = time.monotonic()
            with contextlib.suppress(OSError):
                self.writer.close()  # raises the same error; what matters is that its file is closed
            return False
        self._recovered("the TensorBoard event file")
        return True

    def _open_writer(self) -> bool:
        """A new SummaryWriter (a new event file); False where its first record, written by the constructor, failed
        (no space), and then that file is removed and the failure's time kept for the next try."""
        try:
            self.writer = SummaryWriter(log_dir=str(self.run_dir), purge_step=self._purge_step)
        except OSError as exc:
            self._report("the TensorBoard event file", exc)
            self._tensorboard_failed_at = time.monotonic()
            remove_empty_files(self.run_dir.glob(f"events.out.tfevents.*.{os.getpid()}.*"))  # that file
            return False
        self._tensorboard_failed_at = self._purge_step = None
        return True

    def _report(self, what: str, exc: OSError) -> None:
        if what not in self._failed:
            self._failed.add(what)
            log.error("Could not write %s in %s: %s; training goes on (reported once, until it is written again)",
                      what, self.run_dir, exc)

    def _recovered(self, what: str) -> None:
        """Say that `what` is written again after a failure, which a new failure then reports again."""
        if what in self._failed:
            self._failed.discard(what)
            log.warning("Writing %s in %s again", what, self.run_dir)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        """Markdown text in TensorBoard's TEXT tab."""
        self._tensorboard(lambda writer: writer.add_text(tag, text, step))

    def flags(self, flags: Mapping[str, Any], step: int = 0) -> None:
        """The run's flags as a markdown table (tag `flags`) and as hparams, at the start of a run.

        Unlike `SummaryWriter.add_hparams`, this writes into the run's own event file and adds no scalars:
        the HPARAMS tab reads the metrics in `HPARAM_METRICS` from the run's scalars.
        """
        markdown = flags_markdown(flags)
        clean = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in flags.items()}
        summaries = hparams(clean, {tag: 0.0 for tag in HPARAM_METRICS})

        def write(writer: SummaryWriter) -> None:
            writer.add_text("flags", markdown, step)
            for summary in summaries:
                writer._get_file_writer().add_summary(summary, step)

        self._flags = write
        if not self._tensorboard(write):  # a disk too full at the start: written by the next writer made
            self._unwritten_flags = write

    def begin_anew(self) -> None:
        """Begin a TensorBoard event file (with the flags) again, in a run directory made again: the writer's file was
        in the directory that went. (logs.csv begins again by itself: `_write_csv`.)"""
        if self.writer is not None and self._tensorboard_failed_at is None:
            with contextlib.suppress(OSError):
                self.writer.close()
        self._failed.clear()
        self._unwritten_flags = self._flags
        self._open_writer()

    def _write_csv(self, row: dict[str, float]) -> None:
        if self._csv_file is not None and not _is_open_file(self._csv_path, self._csv_file):
            with contextlib.suppress(OSError):  # deleted or moved away, or its run directory made again
                self._csv_file.close()
            self._csv_file = self._csv = None
        if self._csv is None:
            self._reopen_csv(list(row))
        assert self._csv is not None
        if any(key not in self._csv.fieldnames for key in row) and time.monotonic() >= self._widen_after:
            # A tag first seen now (no episode or update finished before the first row): widen the
            # header rather than drop the column for the rest of the run.
            try:
                self._widen_csv([*self._csv.fieldnames, *(k for k in row if k not in self._csv.fieldnames)])
            except OSError as exc:
                # Widening rewrites the whole file: a disk without room for a second copy takes the row without
                # its new columns, and the widening is tried again in a while, not at every row.
                self._report(NEW_COLUMNS, exc)
                self._widen_after = time.monotonic() + TENSORBOARD_RETRY_S
                self._reopen_csv(list(row))
            else:
                self._recovered(NEW_COLUMNS)
        assert self._csv is not None
        self._csv.writerow(row)  # columns the header lacks are left out (`extrasaction="ignore"`)
        self._csv_file.flush()

    def _reopen_csv(self, fieldnames: list[str]) -> None:
        """Open logs.csv to append, with its own header (a resumed run's), or a new one of `fieldnames`."""
        header = self._csv_header()
        self._open_csv(header or fieldnames, append=header is not None)

    def _open_csv(self, fieldnames: Sequence[str], append: bool) -> None:
        self._csv_file = open(self._csv_path, "a" if append else "w", newline="")  # noqa: SIM115 - open for the run
        self._csv = csv.DictWriter(self._csv_file, list(fieldnames), extrasaction="ignore")
        if not append:
            self._csv.writeheader()

    def _widen_csv(self, fieldnames: list[str]) -> None:
        # Let go of the file first: if its close or the rewrite fails, the next row reopens the file as it is and
        # tries again.
        file, self._csv_file, self._csv = self._csv_file, None, None
        file.close()
        try:
            with open(self._csv_path, newline="", errors="replace") as f:  # streamed, as in `_purge_csv`
                self._replace_csv(fieldnames, ([row.get(key) or "" for key in fieldnames]
                                               for row in _one_line_rows(csv.DictReader(f))))
        except csv.Error as exc:
            self._set_csv_aside(exc)
            self._open_csv(fieldnames, append=False)
            return
        self._open_csv(fieldnames, append=True)

    def _csv_header(self) -> list[str] | None:
        """The columns of the logs.csv there is, or None where there is none (or it was set aside)."""
        if not self._csv_path.exists() or self._csv_path.stat().st_size == 0:
            return None
        try:
            with open(self._csv_path, newline="", errors="replace") as f:
                header = next(csv.reader(f), None)
        except csv.Error as exc:
            self._set_csv_aside(exc)
            return None
        return header or None

    def _set_csv_aside(self, exc: csv.Error) -> None:
        """A logs.csv the csv module cannot parse (a stray quote from a disk fault makes it read on to the end of
        the file, past its field limit) is kept whole as logs.csv.unreadable (-1, -2, ...), and a new one begun."""
        aside = move_aside(self._csv_path)
        log.warning("%s could not be read (csv: %s); moved to %s, and the run writes a new one", self._csv_path, exc,
                    aside.name)

    def _replace_csv(self, header: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
        """logs.csv replaced by `header` and `rows`, atomically: a failure leaves the old file whole."""
        tmp = self._csv_path.with_suffix(".csv.tmp")
        try:
            with open(tmp, "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(header)
                writer.writerows(rows)
            os.replace(tmp, self._csv_path)
        finally:
            tmp.unlink(missing_ok=True)

    def close(self) -> None:
        if self._tensorboard_failed_at is None and self.writer is not None:
            try:
                self.writer.close()
            except OSError as exc:
                self._report("the TensorBoard event file", exc)
        if self._csv_file is not None:
            try:
                self._csv_file.close()  # its last flush may find the disk full
            except OSError as exc:
                self._report("logs.csv", exc)
            self._csv_file = self._csv = None


class GamePoints:
    """Which of the games that just ended get a TensorBoard point of their own: every one while games end at most
    `per_s` a second on average (a token bucket of `burst` points), else as many as the bucket holds, spread evenly
    over them (each the middle one of its share).

    One point per game is what a chart of returns wants, and what an Atari run mostly gets (Pong ends a few games a
    second even on a GPU machine); a fast toy env ends thousands a second (CartPole at random: 100-140 KB of events
    a second, some 10 GB a day), which TensorBoard then reads for minutes to draw 1,000 of them. Spread evenly over
    the games in the order they came, the kept ones are a sample of all, not of the first actor's.
    """

    def __init__(self, per_s: float, burst: int, now_s: float) -> None:
        self.per_s, self.burst = per_s, burst
        self._tokens, self._at_s = float(burst), now_s

    def pick(self, count: int, now_s: float) -> range | list[int]:
        """The indices, in order, of the `count` games ended since the last call that get a point."""
        self._tokens = min(float(self.burst), self._tokens + (now_s - self._at_s) * self.per_s)
        self._at_s = now_s
        keep = min(count, int(self._tokens))
        self._tokens -= keep
        return range(count) if keep == count else [(2 * index + 1) * count // (2 * keep) for index in range(keep)]


def flags_markdown(flags: Mapping[str, Any]) -> str:
    """`| flag | value |` markdown table, one row per flag, in the given order."""
    rows = ["| flag | value |", "|---|---|"]
    for name, value in flags.items():
        shown = str(value).replace("|", "\\|")
        rows.append(f"| {name} | `{shown}` |")
    return "\n".join(rows)


def video_summary(tag: str, frames: np.ndarray, fps: float) -> Summary:
    """A TensorBoard image summary holding `frames` ([T, H, W, 3] or [T, H, W] uint8) as an animated GIF, in the
    IMAGES tab: what `SummaryWriter.add_video` writes, encoded with Pillow (installed with matplotlib), where
    add_video needs moviepy, a dependency for this one call."""
    from PIL import Image

    frames = np.asarray(frames)
    if frames.ndim == 3:
        frames = np.repeat(frames[..., None], 3, axis=-1)
    if frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
        raise ValueError(f"video frames must be [T, H, W, 3] or [T, H, W] with T >= 1, got {frames.shape}")
    images = [Image.fromarray(frame.astype(np.uint8), "RGB") for frame in frames]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:],
                   duration=max(20, round(1000 / fps)), loop=0)
    _, height, width, channels = frames.shape
    image = Summary.Image(height=height, width=width, colorspace=channels, encoded_image_string=buffer.getvalue())
    return Summary(value=[Summary.Value(tag=tag, image=image)])


# ------------------------------------------------------------------------------- interval stats


LOSS_TAGS = {"total_loss": "losses/total_loss", "pg_loss": "losses/pg_loss", "baseline_loss": "losses/baseline_loss",
             "entropy_loss": "losses/entropy_loss", "learning_rate": "charts/learning_rate",
             "grad_norm": "stats/grad_norm", "rho_mean": "stats/rho_mean",
             "rho_clipped_fraction": "stats/rho_clipped_fraction", "ppo_clip_fraction": "stats/ppo_clip_fraction"}


class IntervalStats:
    """What the learners record per update, summed until the monitor takes the means of a log interval,
    and the returns of the last 100 games.

    Not locked: learner threads add and the monitor takes under the run's update lock; `add_episode` and
    `mean_return_100` are the monitor's alone.
    """

    def __init__(self) -> None:
        self.episode_returns: collections.deque[float] = collections.deque(maxlen=100)
        self._reset()

    def _reset(self) -> None:
        self._sums: dict[str, float] = collections.defaultdict(float)
        self._count = 0
        self._policy_lag_sum = 0.0
        self._timing_sums_s: dict[str, float] = collections.defaultdict(float)  # per learner phase
        self._timing_count = 0

    def add_timings(self, timings_s: Mapping[str, float]) -> None:
        """One update's phase times, in seconds (skipped updates took time too)."""
        for phase, seconds in timings_s.items():
            self._timing_sums_s[phase] += seconds
        self._timing_count += 1 if timings_s else 0

    def add_update(self, stats: Mapping[str, float], policy_lag: float) -> None:
        """One applied update's stats (`learner.update`) and its mean policy lag in updates."""
        for key, value in stats.items():
            self._sums[key] += value
        self._count += 1
        self._policy_lag_sum += policy_lag

    def take(self) -> tuple[dict[str, float], dict[str, float]]:
        """(loss and update scalars, timing scalars): the means since the last call, which are reset."""
        sums, count, lag = self._sums, self._count, self._policy_lag_sum
        timing_sums, timing_count = self._timing_sums_s, self._timing_count
        self._reset()
        update_scalars = {}
        if count:
            update_scalars = {tag: sums[key] / count for key, tag in LOSS_TAGS.items()}
            update_scalars["stats/policy_lag"] = lag / count  # in learner updates
        timings = {f"timing/{phase}_ms": 1000.0 * seconds / timing_count for phase, seconds in timing_sums.items()}
        return update_scalars, timings

    def add_episode(self, episode_return: float) -> None:
        self.episode_returns.append(episode_return)

    def mean_return_100(self) -> float:
        """Mean return of the last 100 games; NaN before the first."""
        returns = self.episode_returns
        return sum(returns) / len(returns) if returns else float("nan")


# --------------------------------------------------------------------------------------- console


class RecentRate:
    """Agent steps per second over about the last `window_s` seconds: the console's SPS and time left.

    Where one update takes seconds (a CPU learner), a log interval holds two updates or three, and its own
    rate jumps between two values (409 and 614 on 2 cores, with 5-s intervals and batches of 1,024 steps);
    the rate over a minute of intervals does not. TensorBoard's `charts/SPS` stays the interval's own.
    """

    def __init__(self, start_s: float, start_step: int, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._points: collections.deque[tuple[float, int]] = collections.deque([(start_s, start_step)])

    def add(self, time_s: float, step: int) -> float:
        """Record `step` at `time_s`; the rate since the oldest point kept, the newest one at least `window_s`
        back (or the start, within the first `window_s`)."""
        self._points.append((time_s, step))
        while len(self._points) > 2 and time_s - self._points[1][0] >= self.window_s:
            self._points.popleft()
        since_s, since_step = self._points[0]
        return (step - since_step) / (time_s - since_s) if time_s > since_s else 0.0


def progress_line(step: int, total_steps: int, sps: float, elapsed_s: float, mean_return: float,
                  episodes: int) -> str:
    """One human-readable progress line, e.g.
    `[#####---------------]  25.0%  step 25,000/100,000  SPS 3,120  elapsed 0:00:08  left 0:00:24  return 41.3 (212 ep)`.
    """
    fraction = min(1.0, step / total_steps) if total_steps > 0 else 1.0
    filled = round(20 * fraction)
    remaining_s = (total_steps - step) / sps if sps > 0 else math.inf
    shown_return = f"{mean_return:.1f}" if math.isfinite(mean_return) else "-"
    return (f"[{'#' * filled}{'-' * (20 - filled)}] {100 * fraction:5.1f}%  step {step:,}/{total_steps:,}  "
            f"SPS {sps:,.0f}  elapsed {duration(elapsed_s)}  left {duration(max(0.0, remaining_s))}  "
            f"return {shown_return} ({episodes:,} ep)")


def duration(seconds: float) -> str:
    """`H:MM:SS`, or `?` when unknown (infinite or NaN)."""
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _ReportsFailuresOnce:
    """For a log handler whose stream stops taking lines (a full disk under out.log, a closed pipe or terminal
    under stdout): one line on stderr the first time, instead of logging's traceback for every line after it,
    and the next records are still tried, so they land again once the stream takes them."""

    _failed_once = False
    _erred = False  # in the record being written

    def emit(self, record: logging.LogRecord) -> None:
        self._erred = False
        self._write(record)
        if self._failed_once and not self._erred:  # written again: a later failure is reported again
            self._failed_once = False
            self._tell(f"writing the log to {self._destination()} again")

    def _write(self, record: logging.LogRecord) -> None:
        """The handler's own emit, which calls `handleError` where the write fails."""
        super().emit(record)  # type: ignore[misc]

    def handleError(self, record: logging.LogRecord) -> None:
        self._erred = True
        if self._failed_once:
            return
        self._failed_once = True
        self._tell(f"could not write the log to {self._destination()}: {sys.exc_info()[1]}; training goes on "
                   "(reported once, until it is written again)")

    def _destination(self) -> str:
        return getattr(self, "baseFilename", "stdout")  # a FileHandler's path, else the console

    @staticmethod
    def _tell(line: str) -> None:
        with contextlib.suppress(Exception):  # stderr may be gone as well
            sys.stderr.write(f"impala: {line}\n")
            sys.stderr.flush()


class LogFile(_ReportsFailuresOnce, logging.handlers.WatchedFileHandler):
    """out.log: every record as a plain line, appended; the file at its path opened again where it is another than
    the one written (moved away by logrotate, deleted, or its run directory made again)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path, mode="a")

    def _write(self, record: logging.LogRecord) -> None:
        try:
            super()._write(record)
        except OSError:  # opening the path again failed (its directory gone): a failed write, not the caller's error
            self.handleError(record)

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # its last flush, on a full disk: reported already, or not worth a traceback at the end
            pass


class ConsoleHandler(_ReportsFailuresOnce, logging.Handler):
    """Writes records to the current `sys.stdout` (looked up per record, so a redirected stdout is honoured).

    On a terminal a record logged with `extra=STATUS` replaces the previous status line in place
    (carriage return, clear to end of line, cut to the terminal width); any other record first leaves
    the status line as it stands (so the scrollback reads like the log file) and the next status starts
    a new line. Anywhere else every record is a plain line, so logs that are piped or collected (CI,
    Docker) hold no carriage returns or escape codes.
    """

    def __init__(self) -> None:
        super().__init__()
        self._status: str | None = None

    def _write(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stdout
            text = self.format(record)
            if not _is_terminal(stream):
                stream.write(text + "\n")
            elif getattr(record, "status", False):
                width = shutil.get_terminal_size().columns - 1  # a wrapped line could not be redrawn
                self._status = text[:width]
                stream.write("\r" + self._status + "\x1b[K")
            else:
                if self._status is not None:
                    stream.write("\n")
                    self._status = None
                stream.write(text + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's contract: report through handleError, never raise
            self.handleError(record)

    def end_status(self) -> None:
        """Leave the last status line on screen and move below it."""
        with self.lock:  # type: ignore[union-attr]  # created by Handler.__init__
            if self._status is not None and _is_terminal(sys.stdout):
                sys.stdout.write("\n")
                sys.stdout.flush()
            self._status = None


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or file-like stream without isatty
        return False


class _EarlyRecords(logging.Handler):
    """What a run logs before its out.log can be opened (the run directory is made and checked while the run is
    built: a checkpoint kept aside, CSV rows dropped), for `setup_console` to write there first."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def setup_console(log_file: str | os.PathLike | None = None, keep_for_log_file: bool = False) -> None:
    """Log `impala` messages to stdout and, when given, to `log_file` (appending, always plain lines), which
    first gets what was logged since a call with `keep_for_log_file` (the records are dropped where this call
    names no file)."""
    log.setLevel(logging.INFO)
    log.propagate = False
    formatter = logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    if not any(isinstance(h, ConsoleHandler) for h in log.handlers):
        console = ConsoleHandler()
        console.setFormatter(formatter)
        log.addHandler(console)
    early = [h for h in log.handlers if isinstance(h, _EarlyRecords)]
    for handler in early:
        log.removeHandler(handler)
    if keep_for_log_file:
        log.addHandler(_EarlyRecords())
    if log_file is not None:
        file_handler = LogFile(log_file)
        file_handler.setFormatter(formatter)
        for record in (record for handler in early for record in handler.records):
            file_handler.handle(record)
        log.addHandler(file_handler)


def close_console() -> None:
    """End the status line and close the log files (dropping records kept for one); the stdout handler stays for
    later runs."""
    for handler in list(log.handlers):
        if isinstance(handler, ConsoleHandler):
            handler.end_status()
        elif isinstance(handler, logging.FileHandler | _EarlyRecords):
            handler.close()
            log.removeHandler(handler)
