"""Tests for impala/environment.py: shapes, same-step resets, episodic life and unclipped returns."""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import run
from impala.config import UserError
from impala.environment import EnvBatch, NonFiniteEnvOutput, channels_last, is_atari


def test_cartpole_shapes_and_dtypes() -> None:
    env = EnvBatch("CartPole-v1", 3, seed=0)
    try:
        assert env.num_envs == 3
        assert env.observation_shape == (4,)
        assert env.observation_dtype == np.float32
        assert env.num_actions == 2
        obs = env.reset()
        assert obs.shape == (3, 4) and obs.dtype == np.float32
        step = env.step(np.array([0, 1, 0], dtype=np.int64))
        assert step.obs.shape == (3, 4) and step.obs.dtype == np.float32
        for name in ("reward", "done", "game_over", "episode_return", "episode_step"):
            assert getattr(step, name).shape == (3,), name
        assert step.done.dtype == np.bool_ and step.game_over.dtype == np.bool_
        np.testing.assert_array_equal(step.reward, [1.0, 1.0, 1.0])
        np.testing.assert_array_equal(step.episode_step, [1, 1, 1])
    finally:
        env.close()


def test_cartpole_same_step_reset() -> None:
    """After an end the obs is the next episode's first, and the stats are the finished game's totals."""
    num_envs, seed = 2, 7
    env = EnvBatch("CartPole-v1", num_envs, seed=seed)
    # Single envs seeded as the vector env seeds its members (seed + i), reset on end: the reference.
    references = [gym.make("CartPole-v1") for _ in range(num_envs)]
    try:
        obs = env.reset()
        for i, reference in enumerate(references):
            reference_obs, _ = reference.reset(seed=seed + i)
            np.testing.assert_allclose(obs[i], reference_obs)
        rng = np.random.default_rng(0)
        lengths = np.zeros(num_envs, np.int64)
        ends = 0
        for _ in range(400):
            actions = rng.integers(0, 2, num_envs)
            step = env.step(actions)
            lengths += 1
            for i, reference in enumerate(references):
                reference_obs, reward, terminated, truncated, _ = reference.step(int(actions[i]))
                assert step.reward[i] == reward
                assert step.done[i] == (terminated or truncated) == step.game_over[i]
                assert step.episode_step[i] == lengths[i]
                assert step.episode_return[i] == lengths[i]  # CartPole pays 1 per step
                if step.done[i]:
                    ends += 1
                    assert not np.allclose(step.obs[i], reference_obs)  # not the terminal obs...
                    reference_obs, _ = reference.reset()
                    assert np.all(np.abs(step.obs[i]) <= 0.05)  # ...but a fresh start
                    lengths[i] = 0
                np.testing.assert_allclose(step.obs[i], reference_obs)
            if ends >= 4:
                break
        assert ends >= 4
        # The step after an end starts counting again.
        step = env.step(np.zeros(num_envs, np.int64))
        np.testing.assert_array_equal(step.episode_step, lengths + 1)
    finally:
        env.close()
        for reference in references:
            reference.close()


def test_unknown_env_id_is_a_user_error_with_a_suggestion() -> None:
    with pytest.raises(UserError, match="CartPol.*Did you mean.*CartPole"):
        EnvBatch("CartPol-v1", 1, seed=0)
    with pytest.raises(UserError, match="PongNoFrameskp.*Did you mean.*PongNoFrameskip"):
        EnvBatch("PongNoFrameskp-v4", 1, seed=0)


def test_continuous_actions_are_a_user_error() -> None:
    with pytest.raises(UserError, match="Discrete"):
        EnvBatch("Pendulum-v1", 1, seed=0)


def test_is_atari() -> None:
    assert is_atari("PongNoFrameskip-v4")
    assert is_atari("ALE/Breakout-v5")
    assert not is_atari("CartPole-v1")


def test_pong_shapes_and_unclipped_rewards() -> None:
    env = EnvBatch("PongNoFrameskip-v4", 2, seed=0)
    try:
        assert env.observation_shape == (4, 84, 84)
        assert env.observation_dtype == np.uint8
        assert env.num_actions == 6
        obs = env.reset()
        assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8
        assert obs.max() > 0  # a real frame, not a blank buffer
        rng = np.random.default_rng(0)
        total = np.zeros(2)
        for _ in range(150):
            step = env.step(rng.integers(0, 6, 2))
            assert step.obs.shape == (2, 4, 84, 84) and step.obs.dtype == np.uint8
            assert step.reward.dtype == np.float32
            assert set(np.unique(step.reward)) <= {-1.0, 0.0, 1.0}
            total += step.reward
            np.testing.assert_array_equal(step.episode_return, total)
        assert np.any(total != 0)  # points were scored in 150 agent steps (600 frames)
        np.testing.assert_array_equal(step.episode_step, [150, 150])
    finally:
        env.close()


def test_atari_rewards_are_not_clipped() -> None:
    """Space Invaders pays 5 to 30 points per invader: the env must report them as they are."""
    env = EnvBatch("SpaceInvadersNoFrameskip-v4", 1, seed=0)
    try:
        env.reset()
        rng = np.random.default_rng(0)
        total = 0.0
        for _ in range(1000):
            step = env.step(rng.integers(0, env.num_actions, 1))
            total += float(step.reward[0])
            if step.reward[0] > 1:
                break
        assert step.reward[0] > 1
        assert step.episode_return[0] == total
    finally:
        env.close()


def test_breakout_episodic_life() -> None:
    """A lost life ends the learner's episode (`done`) but not the game: the full-game totals keep growing."""
    num_envs = 2
    env = EnvBatch("BreakoutNoFrameskip-v4", num_envs, seed=0, episodic_life=True)
    try:
        env.reset()
        rng = np.random.default_rng(0)
        fire = 1  # Breakout's minimal action set: NOOP, FIRE, RIGHT, LEFT
        returns = np.zeros(num_envs)
        lengths = np.zeros(num_envs, np.int64)
        life_losses = game_overs = 0
        points_before_a_life_loss = False
        for _ in range(5000):
            actions = np.where(rng.random(num_envs) < 0.3, fire, rng.integers(0, 4, num_envs))
            step = env.step(actions)
            returns += step.reward
            lengths += 1
            np.testing.assert_array_equal(step.episode_return, returns)
            np.testing.assert_array_equal(step.episode_step, lengths)
            assert np.all(step.done[step.game_over])  # a game over is always an episode end
            life_lost = step.done & ~step.game_over
            life_losses += int(np.sum(life_lost))
            if np.any(life_lost & (returns > 0)):
                points_before_a_life_loss = True
            game_overs += int(np.sum(step.game_over))
            returns[step.game_over] = 0
            lengths[step.game_over] = 0
            if game_overs >= 1 and life_losses >= 4 and points_before_a_life_loss:
                break
        assert points_before_a_life_loss  # so the totals above were checked carrying points over a life loss
        assert life_losses >= 4  # Breakout has 5 lives: 4 losses before the game ends
        assert game_overs >= 1
    finally:
        env.close()


def test_breakout_without_episodic_life_ends_only_at_game_over() -> None:
    env = EnvBatch("BreakoutNoFrameskip-v4", 2, seed=0, episodic_life=False)
    try:
        env.reset()
        rng = np.random.default_rng(0)
        game_overs = 0
        for _ in range(5000):
            step = env.step(rng.integers(0, 4, 2))
            np.testing.assert_array_equal(step.done, step.game_over)
            game_overs += int(np.sum(step.game_over))
            if game_overs:
                break
        assert game_overs >= 1
        # A full game of Breakout lasts all five lives: far longer than one life.
        assert step.episode_step[step.game_over].min() > 50
    finally:
        env.close()


def _frames_after_first_life_loss(episodic_life: bool, fire_on_life_loss: bool = True) -> tuple[list[int], int]:
    """Breakout played with NOOP only (the agent never presses FIRE): how many pixels change between the
    newest two stacked frames at each of the 10 steps after the first lost life, and that life count."""
    kwargs = {} if fire_on_life_loss else {"fire_on_life_loss": False}  # the default is on
    env = EnvBatch("BreakoutNoFrameskip-v4", 2, seed=0, episodic_life=episodic_life, **kwargs)
    try:
        env.reset()
        noop = np.zeros(2, np.int64)
        for _ in range(500):
            lives_before = env._lives.copy()
            step = env.step(noop)
            lost = np.flatnonzero((env._lives < lives_before) & ~step.game_over)
            if lost.size:
                break
        assert lost.size, "no life lost in 500 NOOP steps"
        i = int(lost[0])
        assert step.done[i] == episodic_life  # the learner's episode ends only with episodic life
        changed = []
        for _ in range(10):
            step = env.step(noop)
            changed.append(int(np.count_nonzero(step.obs[i, -1] != step.obs[i, -2])))
        return changed, int(env._lives[i])
    finally:
        env.close()


@pytest.mark.parametrize("episodic_life", [True, False])  # training and test mode
def test_breakout_ball_is_back_in_play_after_a_lost_life_without_the_agent_firing(episodic_life: bool) -> None:
    changed, lives = _frames_after_first_life_loss(episodic_life)
    assert lives == 4
    assert all(n > 0 for n in changed), changed  # the ball moves in every frame


@pytest.mark.parametrize(("env_id", "fires"), [("BreakoutNoFrameskip-v4", True), ("PongNoFrameskip-v4", False),
                                               ("AmidarNoFrameskip-v4", True), ("MsPacmanNoFrameskip-v4", False)])
def test_fire_after_a_lost_life_is_for_games_whose_action_1_is_fire_and_that_have_lives(env_id: str,
                                                                                       fires: bool) -> None:
    """Pong has no lives and Ms. Pac-Man no FIRE; Amidar shows its lives only from its first frame on."""
    env = EnvBatch(env_id, 1, seed=0)
    try:
        env.reset()
        assert env._fire_on_life_loss is fires and (env._lives[0] > 0 or not fires)
    finally:
        env.close()


def test_breakout_without_fire_on_life_loss_waits_for_the_agent() -> None:
    changed, _ = _frames_after_first_life_loss(True, fire_on_life_loss=False)
    assert changed == [0] * 10  # nothing moves until the agent presses FIRE


# ------------------------------------------------------------------------------- time limits


CARTPOLE_LIMIT = 5


def _register(env_id: str, entry_point: str, **kwargs: object) -> str:
    if env_id not in gym.registry:
        gym.register(env_id, entry_point=entry_point, **kwargs)  # type: ignore[arg-type]
    return env_id


def _short_cartpole() -> str:
    """CartPole cut at 5 steps: alternating pushes keep the pole up that long, so every end is a truncation."""
    return _register("TestCartPoleLimit5-v1", "gymnasium.envs.classic_control.cartpole:CartPoleEnv",
                     max_episode_steps=CARTPOLE_LIMIT)


def _short_atari(game: str, frames: int) -> str:
    """An ALE game cut at `frames` frames (ale-py's max_num_frames_per_episode), as the 108,000 cap cuts it."""
    return _register(f"Test{game.title()}Frames{frames}-v4", "ale_py.env:AtariEnv",
                     kwargs={"game": game, "repeat_action_probability": 0.0, "full_action_space": False,
                             "frameskip": 1, "max_num_frames_per_episode": frames})


def test_a_time_limit_is_a_truncation_with_the_final_observation() -> None:
    """At the limit the game is over and done is set (the episode ends), but `truncated` says it was cut, and
    `final_obs` holds the observation it was cut at: the one a lone env returns there, not the next start."""
    num_envs, seed = 2, 3
    env = EnvBatch(_short_cartpole(), num_envs, seed=seed)
    references = [gym.make("CartPole-v1") for _ in range(num_envs)]
    try:
        env.reset()
        for i, reference in enumerate(references):
            reference.reset(seed=seed + i)
        for t in range(1, 2 * CARTPOLE_LIMIT + 1):
            actions = np.full(num_envs, t % 2)
            step = env.step(actions)
            reference_obs = np.stack([r.step(int(actions[i]))[0] for i, r in enumerate(references)])
            at_limit = t % CARTPOLE_LIMIT == 0
            np.testing.assert_array_equal(step.truncated, [at_limit] * num_envs)
            np.testing.assert_array_equal(step.done, [at_limit] * num_envs)
            np.testing.assert_array_equal(step.game_over, [at_limit] * num_envs)
            np.testing.assert_allclose(step.final_obs, reference_obs)
            if at_limit:
                np.testing.assert_array_equal(step.episode_step, [CARTPOLE_LIMIT] * num_envs)
                assert not np.allclose(step.obs, reference_obs)  # the next game's start
                for reference in references:
                    reference.reset()
            else:
                np.testing.assert_array_equal(step.obs, step.final_obs)
    finally:
        env.close()
        for reference in references:
            reference.close()


def test_a_termination_is_not_a_truncation() -> None:
    env = EnvBatch("CartPole-v1", 2, seed=0)
    try:
        env.reset()
        for _ in range(100):
            step = env.step(np.zeros(2, np.int64))  # always left: the pole falls in about 10 steps
            assert not step.truncated.any()
            np.testing.assert_array_equal(step.final_obs, step.obs)
            if step.done.all():
                break
        assert step.game_over.any()
    finally:
        env.close()


@pytest.mark.parametrize("game", ["pong", "breakout"])  # one vector env for all, and one per env (FIRE on life loss)
def test_an_atari_frame_cap_is_a_truncation_with_the_final_frames(game: str) -> None:
    """ale-py cuts a game at max_num_frames_per_episode: a truncation whose final observation is the stack
    after the last action (the previous stack shifted by one frame), not the next game's first."""
    frames = 160  # 40 agent steps less the random no-op start
    env = EnvBatch(_short_atari(game, frames), 2, seed=0)
    try:
        obs = env.reset()
        rng = np.random.default_rng(0)
        truncations = 0
        for _ in range(3 * frames // 4):
            step = env.step(rng.integers(0, env.num_actions, 2))
            assert not (step.game_over & ~step.truncated).any(), "no game ends by itself in 160 frames"
            for i in np.flatnonzero(step.truncated):
                truncations += 1
                assert step.done[i] and step.episode_step[i] <= frames // 4
                np.testing.assert_array_equal(step.final_obs[i, :-1], obs[i, 1:])
                assert not np.array_equal(step.final_obs[i], step.obs[i])
            np.testing.assert_array_equal(step.final_obs[~step.truncated], step.obs[~step.truncated])
            obs = step.obs
        assert truncations >= 2
    finally:
        env.close()


@pytest.mark.parametrize("env_id, limit, cut_at", [("Endless-v0", 7, 7), ("Endless-v0", None, None),
                                                   ("EndlessCutAt5-v0", 7, 5), ("EndlessCutAt5-v0", 3, 5)])
def test_a_time_limit_is_given_only_to_an_env_without_one_of_its_own(env_id: str, limit: int | None,
                                                                      cut_at: int | None) -> None:
    import odd_spaces_env  # noqa: F401  (registers the env)

    env = EnvBatch(env_id, 2, seed=0, max_episode_steps=limit)
    try:
        env.reset()
        for t in range(1, 12):
            step = env.step(np.ones(2, np.int64))
            assert step.truncated.all() == (t == cut_at) and step.game_over.all() == (t == cut_at), t
            if t == cut_at:
                np.testing.assert_array_equal(step.episode_return, [cut_at, cut_at])
                np.testing.assert_array_equal(step.episode_step, [cut_at, cut_at])
                break
    finally:
        env.close()


@pytest.mark.parametrize("env_id, fire_on_life_loss", [("PongNoFrameskip-v4", True),  # one vector env
                                                        ("BreakoutNoFrameskip-v4", True)])  # one env each
def test_a_time_limit_below_an_atari_games_own_cuts_it_there(env_id: str, fire_on_life_loss: bool) -> None:
    """--eval_max_steps on Atari: once ignored (its own 27,000 steps stood), so nothing bounded an evaluation of a
    policy that never ends a game (one that never presses FIRE in a game where sticky actions lost the env's)."""
    env = EnvBatch(env_id, 2, seed=3, max_episode_steps=10, fire_on_life_loss=fire_on_life_loss)
    try:
        env.reset()
        for t in range(1, 11):
            step = env.step(np.zeros(2, np.int64))  # NOOP: neither game ends by itself this soon
            assert step.game_over.all() == (t == 10) and step.truncated.all() == (t == 10), t
        np.testing.assert_array_equal(step.episode_step, [10, 10])
    finally:
        env.close()


def test_an_action_space_that_starts_elsewhere_gets_the_policys_indices_shifted_to_its_actions_and_a_scalar_box_is_1d(
) -> None:
    import odd_spaces_env  # noqa: F401  (registers the env)

    env = EnvBatch("ShiftedActions-v0", 3, seed=0)
    try:
        assert env.num_actions == 3
        assert env.observation_shape == (1,)  # its Box of shape (), one number
        env.reset()
        step = env.step(np.array([0, 1, 2], np.int64))  # the env raises on an action outside {-1, 0, 1}
        np.testing.assert_array_equal(step.obs[:, 0], [-1, 0, 1])  # the env's observation is its last action
        np.testing.assert_array_equal(step.reward, [0, 0, 1])
    finally:
        env.close()


def test_images_laid_out_hwc_come_out_chw_with_the_same_pixels() -> None:
    import odd_spaces_env

    height, width, channels = odd_spaces_env.ColourImage.observation_space.shape
    env = EnvBatch("ColourImage-v0", 2, seed=0)
    reference = gym.make("ColourImage-v0")
    try:
        assert env.observation_shape == (channels, height, width) and env.observation_dtype == np.uint8
        obs = env.reset()
        raw, _ = reference.reset(seed=0)  # the batch's first env has seed 0
        assert obs.shape == (2, channels, height, width) and obs.flags.c_contiguous
        np.testing.assert_array_equal(obs[0], raw.transpose(2, 0, 1))
        for t in range(1, odd_spaces_env.LENGTH + 1):
            step = env.step(np.zeros(2, np.int64))
            raw = reference.step(0)[0]
            assert step.obs.shape == step.final_obs.shape == (2, channels, height, width)
            if t < odd_spaces_env.LENGTH:
                np.testing.assert_array_equal(step.obs[0], raw.transpose(2, 0, 1))
        assert step.done.all()  # the last step ended the episode and reset: a new image
        np.testing.assert_array_equal(step.obs[0], reference.reset()[0].transpose(2, 0, 1))
    finally:
        env.close()
        reference.close()


@pytest.mark.parametrize(("shape", "expected"), [((84, 84, 4), True), ((4, 84, 84), False), ((64, 64, 3), True),
                                                 ((3, 64, 64), False), ((7, 7, 3), True), ((3, 3, 3), False),
                                                 ((5, 6), False), ((4,), False)])
def test_channels_last_tells_hwc_images_by_their_smallest_dimension_last(shape: tuple[int, ...],
                                                                         expected: bool) -> None:
    assert channels_last(shape) is expected


def test_a_discrete_observation_comes_out_one_hot_and_so_does_the_final_one_of_a_truncation() -> None:
    import odd_spaces_env  # noqa: F401  (registers the env)

    env = EnvBatch("FrozenLakeNotSlippery-v1", 2, seed=0)
    try:
        assert env.observation_shape == (16,) and env.observation_dtype == np.float32
        np.testing.assert_array_equal(env.reset(), np.eye(16)[[0, 0]])  # both on the start square
        right, down, left = 2, 1, 0
        step = env.step(np.array([right, down]))
        np.testing.assert_array_equal(step.obs, np.eye(16)[[1, 4]])
        for t in range(2, 21):  # pressing left into the wall keeps the first env on square 0 until the time limit
            step = env.step(np.array([left, left]))
        assert step.truncated.all() and t == 20
        np.testing.assert_array_equal(step.final_obs, np.eye(16)[[0, 4]])  # where each was cut
        np.testing.assert_array_equal(step.obs, np.eye(16)[[0, 0]])  # the next games' start
    finally:
        env.close()


@pytest.mark.parametrize(("env", "what"), [("NonFiniteObservation-v0", "observation"),
                                         ("NonFiniteReward-v0", "reward"),
                                         ("NonFiniteFinalObservation-v0", "final observation"),
                                         ("NonFiniteAsFloat32-v0", "observation")])
def test_a_nan_or_an_infinity_from_an_env_fails_with_what_it_was(env: str, what: str) -> None:
    """Before, a NaN observation failed the actor inside torch.multinomial ("probability tensor contains either
    inf, nan or element < 0"), and an infinite reward not at all: clipped to 1 by the learner (or, unclipped,
    every update it reached skipped), and the game's return infinite."""
    import odd_spaces_env

    envs = EnvBatch(f"odd_spaces_env:{env}", 3, seed=0)
    obs = envs.reset()
    actions = np.zeros(3, np.int64)
    for _ in range(odd_spaces_env.BAD_STEP - 1):
        step = envs.step(actions)
        assert np.isfinite(step.obs).all() and np.isfinite(step.reward).all()
    with pytest.raises(NonFiniteEnvOutput, match=rf"^env 'odd_spaces_env:{env}' sent a non-finite {what} "
                                                 r"\(NaN or inf\) in 3 of its 3 envs \(the first: env 0\)$"):
        envs.step(actions)
    assert np.isfinite(obs).all()


def test_a_missing_dependency_of_an_env_is_a_user_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*args: object, **kwargs: object) -> None:
        raise gym.error.DependencyNotInstalled('Box2D is not installed, run `pip install "gymnasium[box2d]"`')

    monkeypatch.setattr(gym, "make_vec", missing)
    with pytest.raises(UserError, match=r"env 'LunarLander-v3' needs a package that is not installed: Box2D is not"):
        EnvBatch("LunarLander-v3", 1, seed=0)


def test_an_id_whose_entry_point_cannot_be_imported_is_a_user_error_naming_the_package() -> None:
    """gymnasium registers ids whose entry points import packages it does not require (jax for phys2d/ and
    tabular/, shimmy for GymV26Environment-v0): `gym.spec` finds them, building one raises ImportError."""
    gym.register("TestMissingPackage-v0", entry_point="no_such_package_for_impala_tests.envs:Maze")
    try:
        with pytest.raises(UserError, match=r"^env 'TestMissingPackage-v0' needs a package that is not installed: "
                                            r"No module named 'no_such_package_for_impala_tests'$"):
            EnvBatch("TestMissingPackage-v0", 1, seed=0)
    finally:
        del gym.registry["TestMissingPackage-v0"]


@pytest.mark.parametrize(("source", "pattern"), [
    ('raise RuntimeError("no licence file")\n',
     r"importing 'impala_test_env_{0}' raised RuntimeError: no licence file \(at .*impala_test_env_{0}.py:1\)$"),
    ("def f(:\n", r"importing 'impala_test_env_{0}' raised SyntaxError: invalid syntax \(at .*impala_test_env_{0}.py:1\)$"),
    ('import gymnasium\ngymnasium.register("Entry-v0", entry_point="impala_test_env_{0}:NoSuchEnv")\n',
     (r"its entry point 'impala_test_env_{0}:NoSuchEnv' names nothing in its module \(module 'impala_test_env_{0}' "
      r"has no attribute 'NoSuchEnv'\); fix the module's gymnasium.register call$")),
], ids=["raises", "syntax", "entry-point"])
def test_a_users_env_module_that_fails_to_import_or_names_nothing_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, source: str, pattern: str
        ) -> None:
    """MODULE:ID whose module raises when imported, does not parse, or registers an entry point naming nothing:
    the user's input, said in one line with where it failed, not a traceback from inside gymnasium."""
    name = request.node.callspec.id.replace("-", "_")
    (tmp_path / f"impala_test_env_{name}.py").write_text(source.replace("{0}", name))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(UserError, match=rf"^env 'impala_test_env_{name}:Entry-v0': " + pattern.format(name)):
            EnvBatch(f"impala_test_env_{name}:Entry-v0", 1, seed=0)
    finally:
        gym.registry.pop("Entry-v0", None)
        sys.modules.pop(f"impala_test_env_{name}", None)


@pytest.mark.skipif(importlib.util.find_spec("shimmy") is not None, reason="shimmy is installed: the id builds")
def test_gymnasiums_compatibility_id_without_shimmy_is_a_user_error() -> None:
    with pytest.raises(UserError, match=r"^env 'GymV26Environment-v0' needs a package that is not installed: .*shimmy"):
        EnvBatch("GymV26Environment-v0", 1, seed=0)


@pytest.mark.parametrize("env_id", ["..:X-v0", ".json:X-v0", ".:X-v0"])
def test_a_relative_module_is_a_user_error(env_id: str) -> None:
    module = env_id.rpartition(":")[0]
    with pytest.raises(UserError, match=rf"^env '{re.escape(env_id)}': MODULE of MODULE:ID must be an absolute "
                                        rf"module name .*got '{re.escape(module)}'$"):
        EnvBatch(env_id, 1, seed=0)


@pytest.mark.parametrize(("env_id", "pattern"), [
    ("TestMissingPackage-v0", r"needs a package that is not installed: No module named 'no_such_package_for_impala"),
    (".json:X-v0", r"MODULE of MODULE:ID must be an absolute module name"),
])
def test_an_env_that_cannot_be_built_ends_the_run_in_one_line(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                               env_id: str, pattern: str) -> None:
    gym.register("TestMissingPackage-v0", entry_point="no_such_package_for_impala_tests.envs:Maze")
    try:
        assert run.main(["--env", env_id, "--num_actors", "1", "--envs_per_actor", "2", "--unroll_length", "5",
                         "--batch_size", "4", "--hidden_size", "32", "--total_steps", "1000",
                         "--savedir", str(tmp_path)]) == 2
    finally:
        del gym.registry["TestMissingPackage-v0"]
    err = capsys.readouterr().err
    assert err.startswith(f"run.py: error: env '{env_id}'") and err.count("\n") == 1, err
    assert re.search(pattern, err), err
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_an_observation_space_gymnasium_cannot_flatten_is_a_user_error() -> None:
    class Graph(gym.Env):
        observation_space = gym.spaces.Graph(gym.spaces.Box(0, 1, (2,)), None)
        action_space = gym.spaces.Discrete(2)

    gym.register("TestGraphObservation-v0", entry_point=Graph)
    try:
        with pytest.raises(UserError, match="cannot flatten into one vector"):
            EnvBatch("TestGraphObservation-v0", 1, seed=0)
    finally:
        del gym.registry["TestGraphObservation-v0"]


@pytest.mark.parametrize(("env_id", "own"), [
    ("Pong-v4", "a random 2 to 4"), ("Pong-v0", "a random 2 to 4"),
    ("PongNoFrameskip-v4", None), ("PongNoFrameskip-v0", None), ("ALE/Pong-v5", None), ("CartPole-v1", None),
])
def test_an_atari_id_whose_own_frame_skip_is_not_what_it_gets_here_is_warned_of_at_start(
        caplog: pytest.LogCaptureFixture, env_id: str, own: str | None) -> None:
    """Pong-v4 trained as PongNoFrameskip-v4 does (a skip of 4), where gymnasium's own skips 2, 3 or 4 at random:
    said once at start, not silently."""
    from impala.environment import probe_env

    caplog.set_level(logging.WARNING, logger="impala")
    probe_env(env_id, seed=0)
    said = (f"{env_id} skips {own} frames per step in gymnasium; here every Atari id skips 4 (max-pooled), as the "
            "NoFrameskip ids do with the DeepMind preprocessing: its returns compare with those ids'")
    assert [record.getMessage() for record in caplog.records] == ([said] if own else [])
