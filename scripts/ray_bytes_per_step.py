"""Bytes a remote actor ships per agent step, on real Pong unrolls (for BENCHMARKS.md, "Bytes on the wire").

    PYTHONPATH=. python scripts/ray_bytes_per_step.py

Calls a `ray_pool.RemoteActor` in this process (no Ray needed) with 8 envs, takes its second batch of
unrolls and splits the bytes into the packed frame stacks (`ray_pool.pack_frames`), what the stacks themselves
would have been, and the rest; then times packing the frame stacks (on the remote actor) and rebuilding them into
slots (on the learner's side) against copying the stacks as they are, per unroll, medians of 20.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from impala.buffers import BufferSpec, create_buffers
from impala.config import Config
from impala.environment import probe_env
from impala.ray_pool import RemoteActor, pack_frames, shipped_keys, write_unroll
from impala.seeding import first_life

ENVS = 8


def main() -> None:
    for unroll_length in (32, 80):
        measure(unroll_length)


def measure(unroll_length: int) -> None:
    config = Config(env="PongNoFrameskip-v4", envs_per_actor=ENVS, unroll_length=unroll_length)
    shape, dtype, num_actions = probe_env(config.env, config.seed)
    actor = RemoteActor(0, config, shape, dtype, num_actions, first_life(0, 0, ENVS))
    try:
        actor.unrolls(-1, [None])
        fields = actor.unrolls(-1, [None])["fields"]
    finally:
        actor.stop()
    total = sum(array.nbytes for array in fields.values())
    steps = ENVS * unroll_length
    packed = sum(fields[key].nbytes for key in ("obs_newest", "obs_whole", "obs_older"))
    stack_bytes = fields["obs_newest"].nbytes * shape[0]  # C frames in every row
    print(f"T={unroll_length}: object {total / 2**20:.2f} MiB for {steps} agent steps: {total / steps:.0f} B/step; "
          f"packed frame stacks {packed / steps:.0f} B/step ({int(fields['obs_whole'].sum())} rows sent whole); "
          f"the stacks unpacked {stack_bytes / steps:.0f} B/step; other fields {(total - packed) / steps:.0f} B/step")

    unrolls = len(fields["policy_version"])
    slots = create_buffers(BufferSpec(unrolls, unroll_length, shape, dtype, num_actions), shared=False)
    keys = shipped_keys(slots)
    for i in range(unrolls):
        write_unroll(slots, keys, fields, i, i)
    stacks = slots["obs"].numpy().copy()
    target = slots["obs"].numpy()
    pack_ms = _median_ms(lambda: pack_frames(stacks)) / unrolls
    rebuild_ms = _median_ms(lambda: [write_unroll(slots, ("obs",), fields, i, i) for i in range(unrolls)]) / unrolls
    copy_ms = _median_ms(lambda: [np.copyto(target[i], stacks[i]) for i in range(unrolls)]) / unrolls
    print(f"  per unroll: packing {pack_ms:.3f} ms, rebuilding into a slot {rebuild_ms:.3f} ms, copying the stacks "
          f"into a slot instead {copy_ms:.3f} ms")


def _median_ms(work: Callable[[], object], calls: int = 20) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


if __name__ == "__main__":
    main()
