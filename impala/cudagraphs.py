"""What every CUDA graph capture of a run shares: one capture at a time, and a thread left on its own stream.

The learner's update (`learner.GraphedUpdate`) and central inference's forwards (`inference._GraphedForward`) are
captured in different threads, each when first needed, so two can come at once: the inference thread meets a batch
size it has not served while the learner captures its first update, or two inference threads switch to a new
weight copy together. `torch.cuda.graph` synchronizes the whole device and empties the allocator's cache as it
begins, which invalidates a capture under way in another thread; the capture that lost would fall back to eager
launches for the rest of the run. So every capture, its warm-up included (a first `torch.compile` inside it
benchmarks kernels, synchronizing too), holds `CAPTURE_LOCK`, as torch.compile's own captures hold a lock of their
own (`graph_capture_lock` in torch/_inductor/cudagraph_trees.py); the run never has both kinds at once
(`learner.compiles_cuda_graphs`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch

CAPTURE_LOCK = threading.Lock()


@contextmanager
def capture(graph: torch.cuda.CUDAGraph, pool: Any = None, stream: torch.cuda.Stream | None = None) -> Iterator[None]:
    """`torch.cuda.graph` in thread-local mode (the run's other threads go on launching and copying meanwhile). The
    caller holds `CAPTURE_LOCK`. A capture that fails raises as it would, with the thread back on the stream it was
    on (`torch.cuda.graph`'s exit raises before it leaves its capture stream, and every later launch of the thread
    would go there) and the allocator no longer capturing (`_end_pool`)."""
    device, previous = torch.cuda.current_device(), torch.cuda.current_stream()
    # Its id known before the capture: once `capture_end` has failed, the graph no longer tells it (`graph.pool()`
    # refuses "without a preceding successful capture"). A new handle is the fresh pool that None gives.
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            yield
    except BaseException:
        torch.cuda.set_stream(previous)
        torch.cuda.set_device(device)  # the capture stream's context had switched it too
        _end_pool(pool)
        raise


def _end_pool(pool: Any) -> None:
    """What a failed capture leaves undone (torch 2.13's `capture_end` raises before it): the caching allocator still
    routes the capture stream's allocations to memory pool `pool`, counts a capture under way (so every later
    capture's `empty_cache` fails its check, and a block freed after another stream's use is never reused: memory
    that grows over a long run) and holds the pool. As `torch.cuda.use_mem_pool` ends a pool. Private functions of
    torch's: where they are missing, or refuse (a capture that ended, whose graph releases its pool itself; one that
    failed before it began allocating), nothing is done."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None or release is None:
        return
    try:
        end(torch.cuda.current_device(), pool)
    except RuntimeError:  # not allocating to it: nothing of the capture's to undo
        return
    with suppress(RuntimeError):  # the capture's own error is the one to raise
        release(torch.cuda.current_device(), pool)
