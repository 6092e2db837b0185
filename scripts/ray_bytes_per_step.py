"""Bytes a remote actor ships per agent step, on real Pong unrolls (for BENCHMARKS.md, "Bytes on the wire").

    PYTHONPATH=. python scripts/ray_bytes_per_step.py

Calls a `ray_pool.RemoteActor` in this process (no Ray needed) with 8 envs, takes its second batch of
unrolls and splits the bytes into the frame stacks, what one frame instead of four would be, and the rest.
"""

from __future__ import annotations

from impala.config import Config
from impala.ray_pool import RemoteActor
from impala.seeding import first_life
from impala.training import probe_env

ENVS = 8


def main() -> None:
    for unroll_length in (32, 80):
        config = Config(env="PongNoFrameskip-v4", envs_per_actor=ENVS, unroll_length=unroll_length)
        shape, dtype, num_actions = probe_env(config)
        actor = RemoteActor(0, config, shape, dtype, num_actions, first_life(0, 0, ENVS))
        try:
            actor.unrolls(-1, [None])
            fields = actor.unrolls(-1, [None])["fields"]
        finally:
            actor.stop()
        total = sum(array.nbytes for array in fields.values())
        steps = ENVS * unroll_length
        obs = fields["obs"]
        print(f"T={unroll_length}: object {total / 2**20:.2f} MiB for {steps} agent steps: {total / steps:.0f} B/step; "
              f"frame stacks {obs.nbytes / steps:.0f} B/step; one frame instead {obs[:, :, -1].nbytes / steps:.0f} "
              f"B/step; other fields {(total - obs.nbytes) / steps:.0f} B/step")


if __name__ == "__main__":
    main()
