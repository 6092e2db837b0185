"""Test mode: play full-game episodes with a saved agent and report the mean return."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from impala.checkpoint import CHECKPOINT_NAME, load_checkpoint
from impala.config import Config, UserError
from impala.environment import EnvBatch
from impala.model import Net

log = logging.getLogger("impala")


def load_agent(config: Config) -> tuple[Net, dict]:
    """The model saved in SAVEDIR/XPID, checked against the env it will play."""
    path = Path(config.savedir).expanduser() / str(config.xpid) / CHECKPOINT_NAME
    state = load_checkpoint(path)
    flags = state["flags"]
    if flags.get("env") != config.env:
        config_env = config.env
        raise UserError(f"checkpoint {path} was trained on {flags.get('env')!r}, not {config_env!r}; "
                        f"pass --env {flags.get('env')}")
    model = Net(tuple(state["observation_shape"]), int(state["num_actions"]), state["model"],
                bool(flags.get("use_lstm")), int(flags.get("hidden_size", 256)))
    model.load_state_dict(state["model_state_dict"])
    model.eval()
    return model, state


def play(model: Net, env_id: str, episodes: int, seed: int, greedy: bool = True) -> list[float]:
    """Full-game returns of `episodes` games, the first game of each of `episodes` parallel envs."""
    env = EnvBatch(env_id, episodes, seed, episodic_life=False)
    check_compatible_env(model, env)
    returns: list[float | None] = [None] * episodes
    obs = torch.from_numpy(env.reset())
    done = torch.ones(episodes, dtype=torch.bool)
    core_state = model.initial_state(episodes)
    generator = torch.Generator().manual_seed(seed)
    try:
        while any(r is None for r in returns):
            with torch.no_grad():
                output, core_state = model(obs[None], done[None], core_state)
            logits = output.policy_logits[0]
            if greedy:
                action = logits.argmax(-1)
            else:
                action = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(-1)
            step = env.step(action.numpy())
            for i in np.flatnonzero(step.game_over):
                if returns[i] is None:
                    returns[i] = float(step.episode_return[i])
            obs, done = torch.from_numpy(step.obs), torch.from_numpy(step.done)
    finally:
        env.close()
    return [float(r) for r in returns]


def check_compatible_env(model: Net, env: EnvBatch) -> None:
    if tuple(env.observation_shape) != model.observation_shape or env.num_actions != model.num_actions:
        raise UserError(f"the saved model expects observations {model.observation_shape} and "
                        f"{model.num_actions} actions; the env has {env.observation_shape} and {env.num_actions}")


def test(config: Config) -> float:
    """Play `config.test_episodes` games greedily and print their mean return."""
    torch.set_num_threads(1)
    model, state = load_agent(config)
    returns = play(model, config.env, config.test_episodes, config.seed + 12345)
    mean = float(np.mean(returns))
    print(f"Mean return over {len(returns)} episodes: {mean:.2f} (min {min(returns):.2f}, max {max(returns):.2f}; "
          f"checkpoint at step {state['step']})")
    return mean
