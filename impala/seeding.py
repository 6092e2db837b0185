"""Seeds of a run: every actor life gets env seeds and a sampling stream that no other life of the run shares.

A life is one actor process, from its start to its death or the end of its session. Lives are numbered
run-wide in the order they start (the count is in the checkpoint, so a resumed run goes on counting) and
sessions by the run's starts (meta.json). So every seed follows from --seed and the run's history:

- env seeds are handed out consecutively from --seed, each life taking the next block of one seed per env,
  so no two lives of a run's checkpointed history share one (they wrap at 2^31, ale-py's int32 limit);
- a sampling stream is seeded by numpy's SeedSequence from (--seed, session, actor, life): a session
  killed before its last checkpoint does not replay its sampling streams after a resume;
- evaluations and test mode play games seeded from ranges of their own, EVAL_SEED_OFFSET and TEST_SEED_OFFSET
  after --seed: the actors' range meets the evaluations' only after 2^30 seeds, theirs the test mode's after
  2^29, so no evaluated or tested game is one the actors trained on (of a run of one process: under torchrun the
  other ranks' actors count from seeds drawn anywhere below SEED_LIMIT, `distributed.rank_seed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

SEED_LIMIT = 2**31  # ale-py takes int32 env seeds; --seed must be below it
EVAL_SEED_OFFSET = 2**30  # evaluations' first env seed, after --seed (wrapped below SEED_LIMIT)
TEST_SEED_OFFSET = 2**30 + 2**29  # test mode's first env seed, after --seed
INFERENCE_STREAM = -1  # the "actor index" of the central inference thread's sampling stream


@dataclass(frozen=True)
class LifeSeeds:
    """The seeds of one actor life."""

    life: int  # run-wide number of the life
    env_seeds: tuple[int, ...]  # one per env of the actor, in [0, SEED_LIMIT)
    sampling_seed: int  # for the actor's action-sampling generator, 64 bits


def env_seeds(first: int, count: int) -> tuple[int, ...]:
    """`count` consecutive env seeds from `first`, wrapped into [0, SEED_LIMIT)."""
    return tuple((first + i) % SEED_LIMIT for i in range(count))


def sampling_seed(seed: int, session: int, actor_index: int, life: int) -> int:
    """A 64-bit seed for the sampling stream of (session, actor, life): independent streams for any two keys."""
    key = (session, actor_index + 1, life)  # SeedSequence keys are non-negative: INFERENCE_STREAM -> 0
    return int(np.random.SeedSequence(seed, spawn_key=key).generate_state(1, np.uint64)[0])


@dataclass
class ActorLives:
    """Numbers the actor lives of a run and hands each its seeds. Owned by the main process's monitor.

    `state_dict()` goes into the checkpoint; a resumed run passes it back to go on where the run stopped.
    """

    seed: int
    session: int  # 0 for a new run, one more for every start of it
    lives: int = 0  # actor lives started in the run so far
    env_seeds_used: int = 0  # env seeds handed out so far (--envs_per_actor may differ between sessions)

    def next_life(self, actor_index: int, num_envs: int) -> LifeSeeds:
        seeds = LifeSeeds(self.lives, env_seeds(self.seed + self.env_seeds_used, num_envs),
                          sampling_seed(self.seed, self.session, actor_index, self.lives))
        self.lives += 1
        self.env_seeds_used += num_envs
        return seeds

    KEYS: ClassVar[tuple[str, ...]] = ("actor_lives", "env_seeds_used")  # of `state_dict()`

    def state_dict(self) -> dict[str, int]:
        return {"actor_lives": self.lives, "env_seeds_used": self.env_seeds_used}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.lives = int(state.get("actor_lives", 0))
        self.env_seeds_used = int(state.get("env_seeds_used", 0))


def first_life(seed: int, actor_index: int, num_envs: int) -> LifeSeeds:
    """The seeds actor `actor_index` starts with in a new run (actors start in order, one life each)."""
    lives = ActorLives(seed, session=0, lives=actor_index, env_seeds_used=actor_index * num_envs)
    return lives.next_life(actor_index, num_envs)
