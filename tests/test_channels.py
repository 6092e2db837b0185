"""The channels between the main process and its actors (`impala/channels.py`)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import time

import pytest

from impala.channels import RecordQueue, TracebackQueue, pipe_records

CTX = mp.get_context("fork")


def _dies_with(tracebacks: TracebackQueue, index: int, text: str) -> None:
    tracebacks.put((index, text))


def test_tracebacks_from_dying_processes_arrive_whole_long_ones_in_parts() -> None:
    tracebacks = TracebackQueue(CTX)
    long = "Traceback (most recent call last):\n" + "  a frame \u00fc\n" * 2_000 + "ValueError: the env broke\n"
    texts = {index: (long if index % 2 else f"Traceback {index}\nRuntimeError: {index}\n") for index in range(12)}
    assert len(long.encode()) > 6 * TracebackQueue.TEXT_BYTES  # parts of the actors' interleave in the pipe
    writers = [CTX.Process(target=_dies_with, args=(tracebacks, index, text)) for index, text in texts.items()]
    for writer in writers:  # all at once: each record is one write of one pipe buffer, never torn
        writer.start()
    got = {}
    deadline = time.monotonic() + 30
    while len(got) < len(texts) and time.monotonic() < deadline:  # read while they write: the pipe holds 64 records
        with contextlib.suppress(queue.Empty):
            index, text = tracebacks.get_nowait()
            assert index not in got
            got[index] = text
    for writer in writers:
        writer.join(timeout=30)
        assert writer.exitcode == 0
    with pytest.raises(queue.Empty):
        tracebacks.get_nowait()
    assert got == texts  # whole, a character split between two records too
    tracebacks.close()


def test_a_traceback_longer_than_every_part_keeps_its_end_and_a_half_written_one_is_dropped() -> None:
    tracebacks = TracebackQueue(CTX)
    most = TracebackQueue.MAX_PARTS * TracebackQueue.TEXT_BYTES
    huge = "x" * most + "RecursionError: too deep\n"
    tracebacks.put((3, huge))
    index, text = tracebacks.get_nowait()
    assert index == 3 and text.startswith("[...]\n") and text.endswith("RecursionError: too deep\n")
    assert len(text.encode()) == most and huge.endswith(text.removeprefix("[...]\n"))
    # An actor killed while writing its parts: its restarted successor's traceback replaces the half-written one.
    tracebacks._records.put((5, 0, 3, b"the first part of three"))
    with pytest.raises(queue.Empty):
        tracebacks.get_nowait()
    tracebacks.put((5, "Traceback\nKeyError: 1\n"))
    assert tracebacks.get_nowait() == (5, "Traceback\nKeyError: 1\n")
    tracebacks.close()


def test_a_pipe_grown_to_what_pipe_records_says_takes_that_many_records_without_a_reader() -> None:
    fits = pipe_records(8, 20_000)
    assert fits >= 65536 // 8  # never below a pipe's default size
    assert pipe_records(8, 10**9) >= fits  # asked for too much: as much as the system allows
    wanted = min(fits, 20_000)
    records = RecordQueue(mp.get_context("fork"), "q", capacity=wanted)
    for slot in range(wanted):
        records.put(slot)  # would block for good on a pipe too small
    assert records.qsize() == wanted
    assert [records.get_nowait() for _ in range(3)] == [0, 1, 2]
