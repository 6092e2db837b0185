"""CartPole whose import, in the process that learns, makes a thread of that process hang after HANG_AFTER of its
batches (default 20), as a GPU that stops answering would: with HANG_IN=update (the default) the learner, inside
`learner._finish_update`, where an update waits for the device; with HANG_IN=inference the central inference
thread, inside `InferenceServer._act_on`. With HANG_IN=oom the learner raises instead what PyTorch raises when a
GPU has no memory left for the update. SLOW_UPDATE_S (default 0) adds that many seconds to every update.
Actors import it too and are not affected (they neither update nor serve).

    PYTHONPATH=tests python run.py --env hanging_learner_env:HangingLearnerCartPole-v1 --learner_timeout_s 2 ...
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import gymnasium as gym
import torch
from gymnasium.envs.classic_control import CartPoleEnv

from impala import learner
from impala.inference import InferenceServer

HANG_AFTER = int(os.environ.get("HANG_AFTER", "20"))
HANG_IN = os.environ.get("HANG_IN", "update")
SLOW_UPDATE_S = float(os.environ.get("SLOW_UPDATE_S", "0"))
_real_finish_update = learner._finish_update
_real_act_on = InferenceServer._act_on
_calls = 0


def _calls_so_far() -> int:
    global _calls
    _calls += 1
    return _calls


def _hang_after_some_calls() -> None:
    if _calls_so_far() > HANG_AFTER:
        threading.Event().wait()  # never set: the device never answers


def _finish_update_then_hang(*args: Any, **kwargs: Any) -> Any:
    if HANG_IN == "update":
        _hang_after_some_calls()
    elif HANG_IN == "oom" and _calls_so_far() > HANG_AFTER:
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.05 GiB is free. Of the allocated memory 75.61 GiB is allocated by PyTorch.")
    time.sleep(SLOW_UPDATE_S)
    return _real_finish_update(*args, **kwargs)


def _act_on_then_hang(self: InferenceServer, clients: list[int]) -> tuple[float, float]:
    if HANG_IN == "inference":
        _hang_after_some_calls()
    return _real_act_on(self, clients)


learner._finish_update = _finish_update_then_hang
InferenceServer._act_on = _act_on_then_hang  # type: ignore[method-assign]
gym.register("HangingLearnerCartPole-v1", entry_point=CartPoleEnv, max_episode_steps=500)
