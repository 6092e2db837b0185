"""CartPole whose import, in the process that learns, makes every update take SLOW_UPDATE_S seconds more (default 0)
and the learner hang inside its update after HANG_AFTER updates (default 20), as a GPU that stops answering would:
`learner._finish_update`, where an update waits for the device, then waits forever. Actors import it too and are
not affected (they never update).

    PYTHONPATH=tests python run.py --env hanging_learner_env:HangingLearnerCartPole-v1 --learner_timeout_s 2 ...
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import gymnasium as gym
from gymnasium.envs.classic_control import CartPoleEnv

from impala import learner

HANG_AFTER = int(os.environ.get("HANG_AFTER", "20"))
SLOW_UPDATE_S = float(os.environ.get("SLOW_UPDATE_S", "0"))
_real_finish_update = learner._finish_update
_updates = 0


def _finish_update_then_hang(*args: Any, **kwargs: Any) -> Any:
    global _updates
    _updates += 1
    if _updates > HANG_AFTER:
        threading.Event().wait()  # never set: the device never answers
    time.sleep(SLOW_UPDATE_S)
    return _real_finish_update(*args, **kwargs)


learner._finish_update = _finish_update_then_hang
gym.register("HangingLearnerCartPole-v1", entry_point=CartPoleEnv, max_episode_steps=500)
