"""Channels between the main process and its actors that a process killed at any instant cannot break.

Defined here, created by `actor_pool.py` (which owns the actor processes of a run and every channel to them) and,
for the slots' free pipes, by `slots.py`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import select
import struct
import sys
import termios
import time
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any, Protocol


class SlotQueue(Protocol):
    """A queue of records between processes: a `RecordQueue`, or a `queue.Queue` when an actor runs inline."""

    def put(self, item: Any) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...

    def get_nowait(self) -> Any: ...


class ErrorQueue(Protocol):
    """Where a dying actor puts (actor index, traceback text): a `TracebackQueue`, or a `queue.Queue` inline."""

    def put(self, item: tuple[int, str]) -> None: ...


class StopSignal(Protocol):
    """A `StopFlag`, or a `threading.Event` when an actor runs inline."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...


class SharedInt(Protocol):
    """A shared integer: `multiprocessing.Value("q", lock=False)`."""

    value: int


class SharedFloats(Protocol):
    """Shared floats by index: `multiprocessing.Array("d", n, lock=False)`, or a list inline."""

    def __getitem__(self, index: int, /) -> float: ...

    def __setitem__(self, index: int, value: float, /) -> None: ...


class StopFlag:
    """Tells actors to finish. Unlike `multiprocessing.Event`, reading it takes no lock, so an actor killed
    at any instant cannot leave the other actors, or the shutdown, blocked on it."""

    def __init__(self, ctx: BaseContext) -> None:
        self._value = ctx.Value("b", 0, lock=False)

    def set(self) -> None:
        self._value.value = 1

    def is_set(self) -> bool:
        return bool(self._value.value)


PIPE_DEFAULT_BYTES = 65536  # what a new pipe holds on Linux


def _grow_pipe(write_end: int, nbytes: int) -> bool:
    """Make the pipe hold `nbytes` where it holds fewer; False where the system refuses (above
    /proc/sys/fs/pipe-max-size, for a process without CAP_SYS_RESOURCE)."""
    if nbytes <= PIPE_DEFAULT_BYTES or not hasattr(fcntl, "F_SETPIPE_SZ"):
        return True
    try:
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, nbytes)
    except OSError:
        return False
    return True


def pipe_records(record_bytes: int, wanted: int) -> int:
    """How many records of `record_bytes` a pipe made here can hold, grown (as `RecordQueue` grows its pipe) to
    `wanted` of them, or where the system refuses that, to the most it allows."""
    read_end, write_end = os.pipe()
    try:
        if not _grow_pipe(write_end, wanted * record_bytes):
            with contextlib.suppress(OSError, ValueError):
                _grow_pipe(write_end, int(Path("/proc/sys/fs/pipe-max-size").read_text()))
        if not hasattr(fcntl, "F_GETPIPE_SZ"):
            return wanted  # not Linux: cannot be told
        return fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ) // record_bytes
    finally:
        os.close(read_end)
        os.close(write_end)


class RecordQueue:
    """A queue of fixed-size records (`struct` format `fmt`) over an OS pipe, for any number of processes,
    that a process killed at any instant cannot break.

    `multiprocessing.Queue` can: a reader holds a cross-process lock while it waits and reads a message in
    two system calls, so an actor killed there (kill -9) leaves the lock taken or the stream torn, and every
    other actor stalls for good. Here every `put` is one `write` of one record and every `get` one `read`
    of one record on a non-blocking pipe; the kernel makes each atomic (records are far below PIPE_BUF),
    so there is no lock to keep and no half-read record. Readers wait with `select`, holding nothing.
    Picklable only while starting a process (it carries two pipe ends).
    The subset of the `queue.Queue` interface that actors and learners use: put, get, get_nowait, qsize.
    """

    def __init__(self, ctx: BaseContext, fmt: str, capacity: int = 0) -> None:
        """`capacity`: records the pipe must hold without blocking a writer (the pipe is grown to fit)."""
        self._fmt = fmt
        self._size = struct.calcsize(fmt)
        self._reader, self._writer = ctx.Pipe(duplex=False)
        os.set_blocking(self._reader.fileno(), False)
        _grow_pipe(self._writer.fileno(), capacity * self._size)  # refused: writers may wait

    def __getstate__(self) -> dict[str, Any]:
        return {"fmt": self._fmt, "reader": self._reader, "writer": self._writer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._fmt, self._reader, self._writer = state["fmt"], state["reader"], state["writer"]
        self._size = struct.calcsize(self._fmt)

    def put(self, item: Any) -> None:
        """Append one record: a tuple for a several-field format, else one value. Blocks only on a full pipe."""
        values = item if isinstance(item, tuple) else (item,)
        os.write(self._writer.fileno(), struct.pack(self._fmt, *values))

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The oldest record; raises queue.Empty when none came within `timeout` (or at once if not `block`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self._reader.fileno()
        while True:
            try:
                data = os.read(fd, self._size)
            except BlockingIOError:
                data = None
            if data:
                values = struct.unpack(self._fmt, data)
                return values if len(values) > 1 else values[0]
            remaining = None if deadline is None else deadline - time.monotonic()
            if not block or (remaining is not None and remaining <= 0):
                raise queue.Empty
            select.select([fd], [], [], remaining)  # another reader may still win the record: loop

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def wait(self, timeout: float) -> None:
        """Return when a record may be ready to read, or after `timeout` seconds."""
        select.select([self._reader.fileno()], [], [], timeout)

    def qsize(self) -> int:
        """Records waiting (a snapshot)."""
        available = bytearray(4)
        fcntl.ioctl(self._reader.fileno(), termios.FIONREAD, available)
        return int.from_bytes(available, sys.byteorder) // self._size

    def close(self) -> None:
        self._reader.close()
        self._writer.close()


class TracebackQueue:
    """Where a dying actor puts (actor index, traceback text), read by the main process: a `RecordQueue` of records of
    one pipe buffer each, so that every write is atomic, like the slot queues'. A traceback longer than one record
    goes in several, numbered, which `get_nowait` joins again (one actor writes its records in order; the records of
    two actors dying at once may interleave).

    Unlike `multiprocessing.Queue` it holds no named semaphores (a run killed with its whole process group, kill -9,
    left three in /dev/shm) and no lock a killed writer could keep. A traceback of more than MAX_PARTS records keeps
    its end, where the exception is.
    """

    HEADER = "<iHH"  # actor index, part, parts
    TEXT_BYTES = select.PIPE_BUF - struct.calcsize(HEADER)
    MAX_PARTS = 16  # 64 KiB of traceback

    def __init__(self, ctx: BaseContext, capacity: int = 64) -> None:
        self._records = RecordQueue(ctx, f"{self.HEADER}{self.TEXT_BYTES}s", capacity=capacity)
        self._parts: dict[int, list[bytes]] = {}  # the reader's: an actor's parts so far

    def put(self, item: tuple[int, str]) -> None:
        index, text = item
        data = text.encode("utf-8", "replace")
        most = self.MAX_PARTS * self.TEXT_BYTES
        if len(data) > most:  # the cut may split a character: `get_nowait` replaces it
            data = b"[...]\n" + data[len(data) - most + 6:]
        chunks = [data[at:at + self.TEXT_BYTES] for at in range(0, len(data), self.TEXT_BYTES)] or [b""]
        for part, chunk in enumerate(chunks):
            self._records.put((index, part, len(chunks), chunk))

    def get_nowait(self) -> tuple[int, str]:
        """The oldest traceback whose every part has come; raises queue.Empty where none has."""
        while True:
            index, part, parts, chunk = self._records.get_nowait()
            chunk = chunk.rstrip(b"\0") if part == parts - 1 else chunk  # the padding of the last part
            received = self._parts.setdefault(index, [])
            if part == 0:
                received.clear()  # a restarted actor's first part: what its predecessor left half-written goes
            received.append(chunk)
            if len(received) == parts:
                del self._parts[index]
                return index, b"".join(received).decode("utf-8", "replace")

    def close(self) -> None:
        self._records.close()


# --inference central: the row an actor's split puts in its `positions` while the actor waits for free slots, so
# that the inference threads do not wait for a request that cannot come until the learner frees some
# (InferenceServer.serve_once). -1 is a split that has not asked yet.
SLOT_WAIT_ROW = -2

# --inference central: an actor asks for actions and the inference thread answers, each with one byte on the pair's
# pipe (`multiprocessing.Pipe`, made by `actor_pool.py`). Each side writes only after reading the other's byte, so
# one read takes all there is. The byte goes straight to the pipe's file descriptor, not through `send_bytes` and
# `recv_bytes`, whose framing (a length, then the data) costs two reads: a round trip takes half the time (2.3
# against 5.2 us on the 2-core VM; the server pays it once per client per batch, BENCHMARKS.md).
def signal(connection: Connection) -> None:
    """Ask, or answer, on `connection`. Raises OSError where the other end is gone."""
    os.write(connection.fileno(), b"a")


def take_signal(connection: Connection) -> bool:
    """Read what came on `connection`, whose other end has signalled (its pipe is readable): False where that end
    was closed instead (its process died or shut down). Raises OSError for a pipe broken otherwise."""
    return bool(os.read(connection.fileno(), 64))
