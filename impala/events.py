"""Reading a run's scalars back from its TensorBoard event files, for plot mode and scripts/results.py.

TensorBoard's own reader (EventAccumulator) checks each record's CRC-32C in pure Python and keeps every tag:
plot mode took 17 s and 258 MB on a run of a day (794,880 scalars, 43.7 MB of events; BENCHMARKS.md, "Reading a
long run back"). `read_scalars` reads the records' framing itself, parses them with TensorBoard's own protobuf
classes and keeps the tags asked for (plot mode on the same run: 2.5 s, 125 MB), and shows what TensorBoard
shows: the files in name order, and a resumed session's start (the event its `purge_step` writes) dropping the
points of earlier sessions at and after its step.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from google.protobuf.message import DecodeError
from tensorboard.compat.proto.event_pb2 import Event, SessionLog

EVENT_FILE_MARK = "tfevents"  # in the name of every event file, as TensorBoard finds them
_HEADER = struct.Struct("<QI")  # a record's length and that length's masked CRC-32C (not checked here)
_FOOTER_BYTES = 4  # the data's masked CRC-32C (not checked here)


@dataclass
class RunScalars:
    """The points of some scalar tags of one run, as TensorBoard shows them.

    `points[tag]` holds (agent step, wall time, value) in the order written, those of a resumed run's dropped
    steps left out. `first_wall` is the wall time of the run's first event (None without one); `resumes` the
    (wall time, seconds since the run's previous event) of each later session's start; `damaged` the (file, byte
    offset) of records that could not be read, each ending its file's points: a record the disk garbled, or one a
    kill cut short in any but the newest file (the newest may be being written).
    """

    points: dict[str, list[tuple[int, float, float]]]
    first_wall: float | None = None
    resumes: list[tuple[float, float]] = field(default_factory=list)
    damaged: list[tuple[Path, int]] = field(default_factory=list)

    def active_s(self, walls: np.ndarray) -> np.ndarray:
        """Seconds from the run's first event to each of the wall times `walls`, less the pauses between its
        sessions (a run resumed days later did not train in between)."""
        active = np.asarray(walls, np.float64) - (self.first_wall or 0.0)
        for resumed_at, paused_s in self.resumes:
            active -= np.where(np.asarray(walls) >= resumed_at, paused_s, 0.0)
        return active


def event_files(run_dir: Path) -> list[Path]:
    """The run's event files in the order TensorBoard reads them (by name: their names begin with the time)."""
    if not run_dir.is_dir():
        return []
    return sorted(path for path in run_dir.iterdir() if EVENT_FILE_MARK in path.name and path.is_file())


def read_scalars(run_dir: Path, tags: tuple[str, ...] | list[str]) -> RunScalars:
    """Every point of `tags` in the event files of `run_dir` (not its subdirectories); see RunScalars."""
    scalars = RunScalars({tag: [] for tag in tags})
    last_wall: float | None = None  # of the files read before this one
    files = event_files(run_dir)
    for path in files:
        ended = last_wall
        for event in _events(path, scalars.damaged, newest=path == files[-1]):
            if scalars.first_wall is None:
                scalars.first_wall = event.wall_time
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                if ended is not None:
                    scalars.resumes.append((event.wall_time, max(0.0, event.wall_time - ended)))
                for points in scalars.points.values():
                    points[:] = [point for point in points if point[0] < event.step]
            last_wall = event.wall_time
            for value in event.summary.value:
                kept = scalars.points.get(value.tag)
                if kept is not None and value.WhichOneof("value") == "simple_value":
                    kept.append((event.step, event.wall_time, value.simple_value))
    return scalars


def _events(path: Path, damaged: list[tuple[Path, int]], newest: bool) -> Iterator[Event]:
    """The events of one file, up to its end or its first record that cannot be read (added to `damaged`)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            end = 0
            for offset, end, event in _records(data):
                if event is None:
                    damaged.append((path, offset))
                    return
                yield event
            if end < len(data) and not newest:
                damaged.append((path, end))
    except ValueError:  # mmap of an empty file: a writer that had not yet written
        return
    except OSError:  # gone meanwhile, or unreadable: as TensorBoard, show what can be read
        return


def _records(data: mmap.mmap) -> Iterator[tuple[int, int, Event | None]]:
    """(offset, end, event) of each whole record of an event file's bytes, in order; the last one yielded has
    event None where its record cannot be read (then nothing follows). A record cut short at the end is not
    yielded: the end of the last one yielded says where the whole records end."""
    offset, size = 0, len(data)
    while size - offset >= _HEADER.size:
        length, _ = _HEADER.unpack_from(data, offset)
        end = offset + _HEADER.size + length + _FOOTER_BYTES
        if length == 0:  # no event is empty: zeros, as a power cut leaves at a file's end
            yield offset, offset, None
            return
        if end > size:
            return
        try:
            event = Event.FromString(data[offset + _HEADER.size:end - _FOOTER_BYTES])
        except DecodeError:
            yield offset, offset, None
            return
        yield offset, end, event
        offset = end


PURGE_TEMPORARY = ".events-purge-{pid}.tmp"  # a purged event file before its rename; no "tfevents" in it


def purge_events(run_dir: Path, purge_step: int) -> int:
    """Rewrite each event file of `run_dir` (not its subdirectories) that holds points at or after `purge_step`
    without them, and without the session starts there; returns how many records were dropped. Raises OSError.

    A resumed run's event file says, by its first event, that earlier points from its step on are void, and
    `read_scalars` honours that; TensorBoard's own loaders do not always: its Python loader takes a run's first
    such start for its beginning and drops nothing, and its Rust data server drops a tag's points only where that
    tag's steps go back. Rewritten, the files say the same to every reader. Each file is replaced atomically (a
    kill leaves it whole, and the temporary file `rundir` removes at the next start); the bytes of the records
    kept are copied as they are, and a record that cannot be read is kept with all that follows it."""
    dropped = 0
    for path in event_files(run_dir):
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                continue
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                kept: list[tuple[int, int]] = []
                skipped, here = 0, 0
                for offset, end, event in _records(data):
                    if event is None:  # unreadable: it and what follows stay as they were
                        break
                    if event.step >= purge_step and (event.HasField("summary") or event.HasField("session_log")):
                        skipped += 1
                    elif kept and kept[-1][1] == offset:  # one range for a stretch of records kept
                        kept[-1] = (kept[-1][0], end)
                    else:
                        kept.append((offset, end))
                    here = end
                if skipped:
                    kept.append((here, len(data)))  # and a record being written, or cut short, as it is
                    _rewrite(path, data, kept)
                    dropped += skipped
    return dropped


def _rewrite(path: Path, data: mmap.mmap, kept: list[tuple[int, int]]) -> None:
    """`path` made of the byte ranges `kept` of its `data`, atomically."""
    temporary = path.with_name(PURGE_TEMPORARY.format(pid=os.getpid()))
    try:
        with open(temporary, "wb") as out:
            out.writelines(data[offset:end] for offset, end in kept)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
