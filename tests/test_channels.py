"""The channels between the main process and its actors (`impala/channels.py`)."""

from __future__ import annotations

import multiprocessing as mp
import queue

import pytest

from impala.channels import TracebackQueue

CTX = mp.get_context("fork")


def _dies_with(tracebacks: TracebackQueue, index: int, text: str) -> None:
    tracebacks.put((index, text))


def test_tracebacks_from_dying_processes_arrive_whole_and_long_ones_keep_their_end() -> None:
    tracebacks = TracebackQueue(CTX)
    long = "Traceback (most recent call last):\n" + "  a frame ü\n" * 2_000 + "ValueError: the env broke\n"
    texts = {index: (long if index % 2 else f"Traceback {index}\nRuntimeError: {index}\n") for index in range(12)}
    writers = [CTX.Process(target=_dies_with, args=(tracebacks, index, text)) for index, text in texts.items()]
    for writer in writers:  # all at once: each record is one write of one pipe buffer, never interleaved
        writer.start()
    for writer in writers:
        writer.join(timeout=30)
        assert writer.exitcode == 0
    got = dict(tracebacks.get_nowait() for _ in texts)
    with pytest.raises(queue.Empty):
        tracebacks.get_nowait()
    assert sorted(got) == sorted(texts)
    for index, text in texts.items():
        if index % 2 == 0:
            assert got[index] == text
        else:  # cut at the front to what one record holds, the exception kept
            assert got[index].startswith("[...]\n") and got[index].endswith("ValueError: the env broke\n")
            assert len(got[index].encode()) <= TracebackQueue.TEXT_BYTES
            assert text.endswith(got[index].removeprefix("[...]\n").lstrip("\ufffd"))
    tracebacks.close()
