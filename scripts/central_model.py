"""A model of central inference's throughput (--inference central): what K inference threads could give.

An actor runs its env splits in turn (actor.py): split s waits for its envs' last step (S ms after its actions were
sent; each split's envs step in a thread of their own), writes its row and asks (Z ms), waits for the answer, sends
the actions, and the actor moves on to the next split. So each actor has one request out at a time. A server thread
takes every request pending for it into one batch, which takes fixed_ms + per_client_ms x (clients in it); client c (actor a's split
s, c = a x splits + s) is served by thread c mod K.

With one thread the actors fall into two groups that alternate: those answered by one batch ask again while the next
batch runs, so each request waits out another batch before its own, and a batch serves about half the actors. With
two threads and two splits, split 0 goes to one thread and split 1 to the other, and the groups alternate between
the threads instead of queueing behind each other. That holds only where the threads' batches overlap, i.e. where a
batch's time is waiting (on the GPU) and not work on the host, which one interpreter lock serialises.

    python scripts/central_model.py                                   # several splits of a batch's time
    python scripts/central_model.py --fixed_ms 1.5 --per_client_ms 0.21  # one
    python scripts/central_model.py --wait_ms 0.3                        # with --inference_wait_ms 0.3

It counts no cores: where it gives more than the machine's cores can step (some 1,450 agent steps per core-second
on the GPU machines' Xeons), the cores are the limit.
"""

from __future__ import annotations

import argparse
import heapq
import itertools


def simulate(fixed_ms: float, per_client_ms: float, threads: int = 1, actors: int = 14, splits: int = 2,
             envs_per_split: int = 4, step_ms: float = 2.8, write_ms: float = 0.3, wait_ms: float = 0.0,
             ms: float = 30_000.0) -> tuple[float, float]:
    """(agent steps per second, clients per batch) over `ms` simulated milliseconds. `wait_ms`: --inference_wait_ms,
    how long a thread gathers more requests after the first before its batch starts, unless every actor it serves
    has asked sooner."""
    events: list[tuple[float, int, str, tuple]] = []
    order = itertools.count()
    pending: list[list[tuple[int, int]]] = [[] for _ in range(threads)]
    busy = [False] * threads
    sent_at = {(a, s): -1e9 for a in range(actors) for s in range(splits)}
    steps = batches = served = 0
    # what a thread waits for (--inference_wait_ms): every actor it serves asking, one split each (inference.py)
    clients_of = [len({c // splits for c in range(actors * splits) if c % threads == k}) for k in range(threads)]

    gathering: list[int | None] = [None] * threads  # the batch a thread is gathering requests for, if any

    def serve(k: int, now: float) -> None:
        if gathering[k] is not None and len(pending[k]) == clients_of[k]:  # all asked: no need to wait longer
            run_batch(k, now)
        if busy[k] or not pending[k]:
            return
        busy[k] = True
        if wait_ms > 0 and len(pending[k]) < clients_of[k]:
            gathering[k] = batches
            heapq.heappush(events, (now + wait_ms, next(order), "gathered", (k, batches)))
        else:
            run_batch(k, now)

    def run_batch(k: int, now: float) -> None:
        nonlocal batches, served
        gathering[k] = None
        batch, pending[k] = pending[k], []
        batches += 1
        served += len(batch)
        heapq.heappush(events, (now + fixed_ms + per_client_ms * len(batch), next(order), "answered", (k, batch)))

    def turn_to(a: int, s: int, now: float) -> None:  # the actor moves on to split s: its envs' step, its row
        heapq.heappush(events, (max(now, sent_at[a, s] + step_ms) + write_ms, next(order), "asks", (a, s)))

    for a in range(actors):
        turn_to(a, 0, a * 0.2)
    while events:
        now, _, kind, data = heapq.heappop(events)
        if now > ms:
            break
        if kind == "gathered":
            k, batch_number = data
            if gathering[k] == batch_number:  # not started already because every client had asked
                run_batch(k, now)
        elif kind == "asks":
            a, s = data
            k = (a * splits + s) % threads
            pending[k].append((a, s))
            serve(k, now)
        else:
            k, batch = data
            busy[k] = False
            for a, s in batch:
                sent_at[a, s] = now
                steps += envs_per_split
                turn_to(a, (s + 1) % splits, now)
            serve(k, now)
    return steps / ms * 1000, served / max(batches, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixed_ms", type=float, help="ms a batch takes whatever its size")
    parser.add_argument("--per_client_ms", type=float, help="ms a batch takes per client in it")
    parser.add_argument("--actors", type=int, default=14)
    parser.add_argument("--step_ms", type=float, default=2.8, help="ms a split's envs take to step")
    parser.add_argument("--wait_ms", type=float, default=0.0, help="--inference_wait_ms")
    args = parser.parse_args()
    # Splits of the 2.82 ms that a batch of 6.3 clients took in the H200 trainer (BENCHMARKS.md)
    given = args.fixed_ms is not None and args.per_client_ms is not None
    pairs = [(args.fixed_ms, args.per_client_ms)] if given else [
        (2.5, 0.05), (2.0, 0.13), (1.5, 0.21), (1.0, 0.29), (0.5, 0.37)]
    print("agent steps/s (clients per batch) with 1, 2 and 4 inference threads")
    for fixed_ms, per_client_ms in pairs:
        cells = []
        for threads in (1, 2, 4):
            rate, per_batch = simulate(fixed_ms, per_client_ms, threads, args.actors, step_ms=args.step_ms,
                                       wait_ms=args.wait_ms)
            cells.append(f"{threads}: {rate:7,.0f} ({per_batch:.1f})")
        print(f"batch {fixed_ms:.2f} ms + {per_client_ms:.2f} ms per client   " + "   ".join(cells))


if __name__ == "__main__":
    main()
