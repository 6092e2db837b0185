"""Central inference's servers, pipes and actor loop as they are, the forward replaced by a wait that releases the
GIL (as a wait on a GPU does): what `--inference_threads` and `--inference_wait_ms` do where a batch's time is waiting,
on any machine.

Actor processes behave as actor.py's split loop: turn to split s, wait until its envs have stepped (STEP_MS after its
actions were sent; a sleep, as ale-py's thread steps them), ask, wait for the answer, send, turn to the other split.
A batch takes FIXED_MS + PER_CLIENT_MS x its clients. Prints agent steps/s (4 envs a split) and clients per batch
with 1 thread, 2 threads, and 1 thread waiting 1 ms (or each THREADS:WAIT_MS of --configs, with --splits env splits an
actor); `scripts/central_model.py` gives what the loop alone predicts.

    python scripts/central_stand_in.py ACTORS FIXED_MS STEP_MS [PER_CLIENT_MS] [--splits S] [--configs K:W ...]
    python scripts/central_stand_in.py 14 0.5 2.8 0.37
    python scripts/central_stand_in.py 6 0.5 2.8 0.37 --splits 4 --configs 3:0 3:5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's impala, run from anywhere

from impala import inference
from impala.buffers import BufferSpec, create_buffers
from impala.channels import signal, take_signal
from impala.model import Net

ENVS, SECONDS = 4, 6.0


def stand_in(fixed_s: float, per_client_s: float) -> Any:
    def outputs(model: Net, obs: torch.Tensor, done: torch.Tensor, noise: torch.Tensor, amp: bool) -> torch.Tensor:
        time.sleep(fixed_s + per_client_s * obs.shape[0] / ENVS)
        return torch.zeros((obs.shape[0], noise.shape[1] + 2))
    return outputs


def actor(index: int, ends: list, step_s: float, stop: Any, steps: Any) -> None:
    sent = [0.0] * len(ends)
    split = 0
    while not stop.is_set():
        delay = sent[split] + step_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # its envs still stepping
        signal(ends[split])
        while not ends[split].poll(0.1):
            if stop.is_set():
                return
        if not take_signal(ends[split]):
            return
        sent[split] = time.monotonic()
        steps[index] += ENVS
        split = (split + 1) % len(ends)


def measure(actors: int, step_s: float, threads: int, wait_ms: float, splits: int = 2) -> tuple[float, float]:
    """(agent steps/s, clients per batch) over SECONDS after one second of warm-up."""
    clients = actors * splits
    model = Net((4,), 6, "mlp", hidden_size=16).eval()
    buffers = create_buffers(BufferSpec(clients * ENVS, 2, (4,), torch.float32, 6))
    positions = torch.zeros((clients, ENVS + 1), dtype=torch.int64)
    positions[:, :-1] = torch.arange(clients * ENVS).view(clients, ENVS)
    servers = inference.InferenceServers(model, buffers, positions, torch.device("cpu"), False, wait_ms / 1000,
                                         list(range(threads)), splits=splits)
    ctx = mp.get_context("fork")
    stop, steps = ctx.Event(), ctx.Array("q", actors, lock=False)
    processes = []
    for a in range(actors):
        ends = []
        for split in range(splits):
            server_end, actor_end = ctx.Pipe()
            servers.connect(a * splits + split, server_end)
            ends.append(actor_end)
        processes.append(ctx.Process(target=actor, args=(a, ends, step_s, stop, steps)))
    halt = threading.Event()
    serving = [threading.Thread(target=server.serve, args=(halt,)) for server in servers.servers]
    for thread in serving:
        thread.start()
    for process in processes:
        process.start()
    time.sleep(1.0)
    servers.take_stats()
    before, start = sum(steps), time.monotonic()
    time.sleep(SECONDS)
    after, elapsed = sum(steps), time.monotonic() - start
    per_batch = servers.take_stats()["stats/inference_actors_per_batch"]
    stop.set()
    for process in processes:
        process.join()
    halt.set()
    for thread in serving:
        thread.join()
    return (after - before) / elapsed, per_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("actors", type=int)
    parser.add_argument("fixed_ms", type=float)
    parser.add_argument("step_ms", type=float)
    parser.add_argument("per_client_ms", type=float, nargs="?", default=0.0)
    parser.add_argument("--splits", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["1:0", "2:0", "1:1"], help="THREADS:WAIT_MS each")
    args = parser.parse_args()
    inference._outputs = stand_in(args.fixed_ms / 1000, args.per_client_ms / 1000)
    for config in args.configs:
        threads, wait_ms = int(config.split(":")[0]), float(config.split(":")[1])
        rate, per_batch = measure(args.actors, args.step_ms / 1000, threads, wait_ms, args.splits)
        print(f"{args.actors} actors of {args.splits} splits, batch {args.fixed_ms} ms + {args.per_client_ms} ms per "
              f"client, envs {args.step_ms} ms: {threads} thread(s), wait {wait_ms} ms: {rate:,.0f} agent steps/s, "
              f"{per_batch:.1f} clients per batch")


if __name__ == "__main__":
    main()
