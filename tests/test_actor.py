"""Tests for impala/actor.py, run inline: what lands in which row of which slot.

The alignment under test (see buffers.py): obs[t], done[t] and the action chosen there share row t;
the reward and done that action produced are in row t + 1; row 0 of a slot repeats row T of the
env's previous slot.
"""

from __future__ import annotations

import queue
import threading
import time
import types
from multiprocessing import Pipe

import gymnasium as gym
import numpy as np
import pytest
import torch

from impala.actor import ACTOR_PHASES, ENV, POLICY, ActorChannels, PhaseClock, _take_slots, run_actor
from impala.buffers import Buffers, BufferSpec, create_buffers, write_row
from impala.config import Config
from impala.environment import EnvBatch
from impala.inference import InferenceServer
from impala.model import Net
from impala.seeding import first_life

POLICY_VERSION = 7
SERVER_SEED = 1  # the inference server's sampling seed (with it, the time-limit test's games end in both ways)


def _channels(num_buffers: int) -> ActorChannels:
    free_queue: queue.Queue = queue.Queue()
    for slot in range(num_buffers):
        free_queue.put(slot)
    return ActorChannels(free_queue=free_queue, full_queue=queue.Queue(), episode_queue=queue.Queue(),
                         error_queue=queue.Queue(), stop_event=threading.Event(),
                         policy_version=types.SimpleNamespace(value=POLICY_VERSION),
                         phase_seconds=[0.0] * len(ACTOR_PHASES))


def _drain(q: queue.Queue) -> list:
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


class Rollout:
    """Two unrolls of one actor, run inline, and everything they produced."""

    def __init__(self, env: str = "CartPole-v1", envs_per_actor: int = 2, unroll_length: int = 20,
                 use_lstm: bool = False, model: str = "auto", max_unrolls: int = 2, extra_buffers: int = 1,
                 env_splits: int = 1, central: bool = False, amp: bool | None = None) -> None:
        """`central`: act through an inference server (--inference central) serving `model` in a thread."""
        self.config = Config(env=env, num_actors=1, envs_per_actor=envs_per_actor, unroll_length=unroll_length,
                             use_lstm=use_lstm, hidden_size=16, model=model, seed=3, env_splits=env_splits, amp=amp)
        probe = EnvBatch(env, 1, 0)
        torch.manual_seed(0)
        self.model = Net(probe.observation_shape, probe.num_actions, model, use_lstm, 16)
        self.model.eval()
        self.num_actions = probe.num_actions
        probe.close()
        core_shapes = self.model.core_state_shapes()
        num_buffers = envs_per_actor * max_unrolls + extra_buffers
        obs_dtype = torch.uint8 if len(self.model.observation_shape) == 3 else torch.float32
        spec = BufferSpec(num_buffers, unroll_length, self.model.observation_shape, obs_dtype, self.num_actions,
                          core_shapes)
        self.buffers: Buffers = create_buffers(spec)
        self.channels = _channels(num_buffers)
        start = time.perf_counter()
        if central:
            self._run_served(max_unrolls)
        else:
            run_actor(0, self.config, self.buffers, self.model, self.channels, max_unrolls=max_unrolls)
        self.wall_s = time.perf_counter() - start
        self.full = _drain(self.channels.full_queue)
        self.episodes = _drain(self.channels.episode_queue)
        self.errors = _drain(self.channels.error_queue)
        n = envs_per_actor
        # Slots are taken in queue order, envs_per_actor per unroll, split after split: env i of unroll u is
        # slot u * n + i.
        self.slots = [self.full[u * n:(u + 1) * n] for u in range(max_unrolls)]

    def field(self, unroll: int, env: int, name: str) -> torch.Tensor:
        return self.buffers[name][self.slots[unroll][env]]

    def _run_served(self, max_unrolls: int) -> None:
        splits = self.config.env_splits
        positions = torch.full((splits, self.config.envs_per_actor // splits + 1), -1, dtype=torch.int64)
        self.server = InferenceServer(self.model, self.buffers, positions, torch.device("cpu"), amp=bool(self.config.amp),
                                      wait_s=0.0, seed=SERVER_SEED)
        actor_ends = []
        for client in range(splits):
            main_end, actor_end = Pipe()
            self.server.connect(client, main_end)
            actor_ends.append(actor_end)
        self.channels = self.channels._replace(inference_positions=positions)
        stop = threading.Event()
        thread = threading.Thread(target=self.server.serve, args=(stop,), daemon=True)
        thread.start()
        try:
            run_actor(0, self.config, self.buffers, self.model, self.channels, max_unrolls=max_unrolls,
                      inference_connections=actor_ends)
        finally:
            stop.set()
            thread.join(5)


@pytest.fixture(scope="module", params=[1, 2], ids=["one-split", "two-splits"])
def rollout(request: pytest.FixtureRequest) -> Rollout:
    """Every env of the actor stepped together, or in two splits stepped in turn: the rows are the same."""
    return Rollout(env_splits=request.param)


def test_slots_are_handed_to_the_learner(rollout: Rollout) -> None:
    assert rollout.errors == []
    assert rollout.full == [0, 1, 2, 3]  # one slot per env per unroll, in the order they were taken
    assert rollout.channels.free_queue.qsize() == 1  # the spare slot was never taken
    for slot in rollout.full:
        assert rollout.buffers["policy_version"][slot] == POLICY_VERSION
    assert (rollout.buffers["slot_owner"] == -1).all()  # poison: only the main process marks owners
    spare = 4
    assert torch.isnan(rollout.buffers["reward"][spare]).all()


def test_row_zero_repeats_the_previous_row_t(rollout: Rollout) -> None:
    T = rollout.config.unroll_length
    for env in range(rollout.config.envs_per_actor):
        for name in ("obs", "done", "reward", "episode_return", "episode_step", "game_over"):
            first = rollout.field(0, env, name)[T]
            second = rollout.field(1, env, name)[0]
            assert torch.equal(first, second), (env, name)


def test_first_row_of_all_starts_an_episode(rollout: Rollout) -> None:
    for env in range(rollout.config.envs_per_actor):
        assert rollout.field(0, env, "done")[0]
        assert rollout.field(0, env, "reward")[0] == 0
        assert rollout.field(0, env, "episode_return")[0] == 0
        assert rollout.field(0, env, "episode_step")[0] == 0


def test_actions_and_logits_belong_to_the_row_they_were_chosen_at(rollout: Rollout) -> None:
    T = rollout.config.unroll_length
    for unroll in range(2):
        for env in range(rollout.config.envs_per_actor):
            action = rollout.field(unroll, env, "action")
            assert ((action[:T] >= 0) & (action[:T] < rollout.num_actions)).all()
            obs = rollout.field(unroll, env, "obs")
            done = rollout.field(unroll, env, "done")
            with torch.no_grad():
                output, _ = rollout.model(obs[:T, None], done[:T, None])
            torch.testing.assert_close(rollout.field(unroll, env, "policy_logits")[:T], output.policy_logits[:, 0])
            torch.testing.assert_close(rollout.field(unroll, env, "baseline")[:T], output.baseline[:, 0])


def test_row_t_action_fields_are_left_unwritten(rollout: Rollout) -> None:
    """Row T's action is chosen in the next unroll (as its row 0), so a fresh slot keeps poison there."""
    T = rollout.config.unroll_length
    for unroll in range(2):
        for env in range(rollout.config.envs_per_actor):
            assert rollout.field(unroll, env, "action")[T] == -1
            assert torch.isnan(rollout.field(unroll, env, "policy_logits")[T]).all()
            assert torch.isnan(rollout.field(unroll, env, "baseline")[T])


def test_rows_replay_against_the_env(rollout: Rollout) -> None:
    """Stepping a fresh copy of the actor's envs with the recorded actions reproduces every row t + 1."""
    config = rollout.config
    T, n = config.unroll_length, config.envs_per_actor
    seeds = first_life(config.seed, 0, config.envs_per_actor).env_seeds
    env = EnvBatch(config.env, n, seeds, episodic_life=config.episodic_life)
    try:
        obs = env.reset()
        for i in range(n):
            np.testing.assert_array_equal(rollout.field(0, i, "obs")[0].numpy(), obs[i])
        for unroll in range(2):
            for t in range(T):
                actions = np.array([int(rollout.field(unroll, i, "action")[t]) for i in range(n)])
                step = env.step(actions)
                for i in range(n):
                    row = {name: rollout.field(unroll, i, name)[t + 1] for name in
                           ("obs", "reward", "done", "game_over", "episode_return", "episode_step")}
                    np.testing.assert_array_equal(row["obs"].numpy(), step.obs[i])
                    assert row["reward"] == step.reward[i] == 1.0  # CartPole pays 1 for every step
                    assert bool(row["done"]) == bool(step.done[i])
                    assert bool(row["game_over"]) == bool(step.game_over[i])
                    assert row["episode_return"] == step.episode_return[i]
                    assert row["episode_step"] == step.episode_step[i]
    finally:
        env.close()


def test_episode_stats_count_up_and_end_at_done_rows(rollout: Rollout) -> None:
    T = rollout.config.unroll_length
    ended = []
    for env in range(rollout.config.envs_per_actor):
        steps = torch.cat([rollout.field(0, env, "episode_step"), rollout.field(1, env, "episode_step")[1:]])
        returns = torch.cat([rollout.field(0, env, "episode_return"), rollout.field(1, env, "episode_return")[1:]])
        done = torch.cat([rollout.field(0, env, "done"), rollout.field(1, env, "done")[1:]])
        assert len(steps) == 2 * T + 1
        for t in range(1, len(steps)):
            # After an end the count restarts: the done row itself holds the finished game's totals.
            assert steps[t] == (1 if done[t - 1] else steps[t - 1] + 1)
            assert returns[t] == steps[t]
            if done[t]:
                ended.append((0, float(returns[t]), int(steps[t])))
    assert len(ended) >= 2  # random CartPole episodes last about 22 steps: 80 steps see several end
    assert sorted(rollout.episodes) == sorted(ended)


def test_the_actors_time_is_split_between_its_phases(rollout: Rollout) -> None:
    """Every phase of an inline actor's acting got some of its time, and together no more than it took."""
    seconds = dict(zip(ACTOR_PHASES, rollout.channels.phase_seconds, strict=True))
    assert all(seconds[phase] > 0 for phase in ("slot_wait", "policy", "env", "write")), seconds
    assert sum(seconds.values()) <= rollout.wall_s


def test_a_phase_clock_gives_each_phase_the_time_since_the_previous_lap() -> None:
    times = iter([10.0, 10.5, 11.0, 13.0, 13.25])
    seconds = [0.0] * (2 * len(ACTOR_PHASES))
    clock = PhaseClock(_channels(1)._replace(phase_seconds=seconds), 1, clock=lambda: next(times))
    clock.start()  # 10.5: the time before is no phase's
    clock.lap(ENV)
    clock.lap(POLICY)
    clock.lap(ENV)
    assert seconds == [0.0] * len(ACTOR_PHASES) + [0.0, 2.0, 0.75, 0.0]  # actor 1's row: policy, env
    reads = []
    idle = PhaseClock(_channels(1)._replace(phase_seconds=None), 0, clock=lambda: reads.append(1) or 0.0)
    before = len(reads)
    for _ in range(3):
        idle.lap(ENV)  # without a place to keep them: nothing kept, not even the clock read
    assert len(reads) == before


def test_a_set_stop_event_stops_before_writing() -> None:
    config = Config(env="CartPole-v1", num_actors=1, envs_per_actor=2, unroll_length=4)
    model = Net((4,), 2, "mlp", hidden_size=16)
    buffers = create_buffers(BufferSpec(4, 4, (4,), torch.float32, 2))
    channels = _channels(4)
    channels.stop_event.set()
    run_actor(0, config, buffers, model, channels, max_unrolls=1)
    assert channels.full_queue.empty()
    assert torch.isnan(buffers["reward"]).all()


def test_a_row_written_slot_by_slot_is_the_indexed_write() -> None:
    """`write_row` puts each env's fields in row t of its own slot, as an indexed write does, and nothing else."""
    spec = BufferSpec(6, 4, (4, 84, 84), torch.uint8, 3)
    written, reference = create_buffers(spec, shared=False), create_buffers(spec, shared=False)
    generator = torch.Generator().manual_seed(0)
    slots = [4, 1, 5]
    index = torch.tensor(slots)
    row = {"obs": torch.randint(0, 255, (3, 4, 84, 84), dtype=torch.uint8, generator=generator),
           "done": torch.tensor([True, False, True]), "reward": torch.randn(3, generator=generator),
           "episode_step": torch.tensor([3, 0, 9])}
    write_row(written, slots, index, 2, row)
    for key, value in row.items():
        reference[key][index, 2] = value
    for key in spec.fields():
        torch.testing.assert_close(written[key], reference[key], rtol=0, atol=0, equal_nan=True, msg=key)
    assert torch.equal(written["obs"][1, 2], row["obs"][1])
    assert (written["obs"][:, [0, 1, 3, 4]] == 255).all()  # other rows keep their poison


def test_lstm_core_state_lets_the_learner_reproduce_the_behaviour_logits() -> None:
    """The state stored with a slot, unrolled over its rows, gives the logits the actor acted with."""
    rollout = Rollout(envs_per_actor=2, unroll_length=12, use_lstm=True)
    assert rollout.errors == []
    T = rollout.config.unroll_length
    for unroll in range(2):
        for env in range(2):
            state = tuple(rollout.field(unroll, env, f"core_state_{i}").unsqueeze(1) for i in range(2))  # [L, 1, H]
            if unroll == 0:
                assert all(not s.any() for s in state)
            obs = rollout.field(unroll, env, "obs")
            done = rollout.field(unroll, env, "done")
            with torch.no_grad():
                output, _ = rollout.model(obs[:, None], done[:, None], state)
            torch.testing.assert_close(output.policy_logits[:T, 0], rollout.field(unroll, env, "policy_logits")[:T])
    # The second unroll's state carries the first unroll's history.
    assert rollout.field(1, 0, "core_state_0").abs().sum() > 0


def test_atari_actor_writes_uint8_frames() -> None:
    rollout = Rollout(env="PongNoFrameskip-v4", envs_per_actor=1, unroll_length=3, max_unrolls=1, extra_buffers=0)
    assert rollout.errors == []
    assert rollout.full == [0]
    obs = rollout.buffers["obs"][0]
    assert obs.dtype == torch.uint8 and obs.shape == (4, 4, 84, 84)
    assert obs.max() > 0 and obs.max() < 255  # real frames, not the poison value
    action = rollout.buffers["action"][0]
    assert ((action[:3] >= 0) & (action[:3] < 6)).all() and action[3] == -1


@pytest.mark.parametrize("amp", [False, True])
@pytest.mark.parametrize("acting", ["actor", "central"])
def test_atari_actor_writes_the_logits_of_the_shared_model_under_its_autocast_setting(acting: str, amp: bool) -> None:
    """With bfloat16 autocast the actor acts with its torso cast once per policy version (model.CastTorso), the
    inference server with its snapshots' torsos in bfloat16: the logits and values written are those of the
    shared model's forward under autocast, bit for bit."""
    rollout = Rollout(env="PongNoFrameskip-v4", envs_per_actor=2, unroll_length=4, max_unrolls=2, extra_buffers=0,
                      amp=amp, central=acting == "central")
    assert rollout.errors == []
    for slots in rollout.slots:
        for t in range(4):  # the actor's forward: one row of both envs
            obs, done = rollout.buffers["obs"][slots, t], rollout.buffers["done"][slots, t]
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                output, _ = rollout.model(obs[None], done[None])
            assert torch.equal(output.policy_logits[0], rollout.buffers["policy_logits"][slots, t])
            assert torch.equal(output.baseline[0], rollout.buffers["baseline"][slots, t])


@pytest.mark.parametrize("env_splits", [1, 2])
def test_lstm_state_is_kept_per_split(env_splits: int) -> None:
    rollout = Rollout(envs_per_actor=2, unroll_length=6, use_lstm=True, env_splits=env_splits)
    assert rollout.errors == []
    T = rollout.config.unroll_length
    for env in range(2):
        state = tuple(rollout.field(1, env, f"core_state_{i}").unsqueeze(1) for i in range(2))
        obs, done = rollout.field(1, env, "obs"), rollout.field(1, env, "done")
        with torch.no_grad():
            output, _ = rollout.model(obs[:, None], done[:, None], state)
        torch.testing.assert_close(output.policy_logits[:T, 0], rollout.field(1, env, "policy_logits")[:T])


def test_atari_splits_step_in_turn_and_replay_like_one_batch() -> None:
    """Two Atari splits, each stepping in ale-py's thread while the other acts, record the frames that one
    batch of the same envs produces for the same actions."""
    rollout = Rollout(env="PongNoFrameskip-v4", envs_per_actor=2, env_splits=2, unroll_length=30, max_unrolls=1,
                      extra_buffers=0)
    assert rollout.errors == []
    assert not torch.equal(rollout.field(0, 0, "obs")[0], rollout.field(0, 0, "obs")[-1])  # the game moved
    config = rollout.config
    env = EnvBatch(config.env, 2, first_life(config.seed, 0, config.envs_per_actor).env_seeds)
    try:
        obs = env.reset()
        for i in range(2):
            np.testing.assert_array_equal(rollout.field(0, i, "obs")[0].numpy(), obs[i])
        for t in range(config.unroll_length):
            step = env.step(np.array([int(rollout.field(0, i, "action")[t]) for i in range(2)]))
            for i in range(2):
                np.testing.assert_array_equal(rollout.field(0, i, "obs")[t + 1].numpy(), step.obs[i])
                assert rollout.field(0, i, "reward")[t + 1] == step.reward[i]
    finally:
        env.close()


# ------------------------------------------------------------------------------- time limits

TIME_LIMIT = 15  # short enough to cut some CartPole games of a random policy, long enough for others to end


def _short_cartpole() -> str:
    env_id = f"TestCartPoleLimit{TIME_LIMIT}-v1"
    if env_id not in gym.registry:
        gym.register(env_id, entry_point="gymnasium.envs.classic_control.cartpole:CartPoleEnv",
                     max_episode_steps=TIME_LIMIT)
    return env_id


def _final_observations(rollout: Rollout) -> dict[tuple[int, int, int], np.ndarray]:
    """{(unroll, env, row): final observation} for every row a time limit ended, by replaying the actions on
    a fresh copy of the actor's envs."""
    config = rollout.config
    T, n = config.unroll_length, config.envs_per_actor
    env = EnvBatch(config.env, n, first_life(config.seed, 0, n).env_seeds)
    finals = {}
    try:
        env.reset()
        for unroll in range(len(rollout.slots)):
            for t in range(T):
                step = env.step(np.array([int(rollout.field(unroll, i, "action")[t]) for i in range(n)]))
                for i in range(n):
                    np.testing.assert_array_equal(rollout.field(unroll, i, "obs")[t + 1].numpy(), step.obs[i])
                    if step.truncated[i]:
                        finals[(unroll, i, t + 1)] = step.final_obs[i]
    finally:
        env.close()
    return finals


@pytest.mark.parametrize("acting", ["local", "local-lstm", "central"])
def test_a_time_limit_is_written_as_truncated_with_the_value_of_the_final_observation(acting: str) -> None:
    """Where a time limit cut a game, the row of that step says `truncated` (and done), and `truncation_value`
    holds the policy's value of the observation the game was cut at: computed after the action, with an LSTM
    from the state that action was chosen with (the stored state unrolled over the rows before it, then the
    final observation as no episode start). Everywhere else it is 0. The games are reported as before."""
    rollout = Rollout(env=_short_cartpole(), envs_per_actor=3, unroll_length=12, use_lstm=acting == "local-lstm",
                      max_unrolls=3, central=acting == "central")
    assert rollout.errors == []
    finals = _final_observations(rollout)
    T = rollout.config.unroll_length
    truncated_rows = set(finals)
    ended_rows = set()
    for unroll in range(3):
        for env in range(3):
            field = {name: rollout.field(unroll, env, name) for name in
                     ("obs", "done", "truncated", "truncation_value", "episode_step")}
            state = tuple(rollout.field(unroll, env, f"core_state_{i}").unsqueeze(1)
                          for i in range(len(rollout.model.initial_state(1))))
            for t in range(1, T + 1):
                if field["done"][t]:
                    ended_rows.add((unroll, env, t))
                if (unroll, env, t) not in finals:
                    assert not field["truncated"][t] and field["truncation_value"][t] == 0
                    continue
                assert field["truncated"][t] and field["done"][t] and field["episode_step"][t] == TIME_LIMIT
                obs = torch.cat([field["obs"][:t], torch.from_numpy(finals[(unroll, env, t)])[None]])
                done = torch.cat([field["done"][:t], torch.tensor([False])])
                with torch.no_grad():
                    output, _ = rollout.model(obs[:, None], done[:, None], state)
                torch.testing.assert_close(field["truncation_value"][t], output.baseline[-1, 0])
    assert len(truncated_rows) >= 2 and ended_rows - truncated_rows, "both time limits and terminations"
    # Some step cut one env's game but not the others': the values are those of the right envs.
    assert any(sum((u, e, t) in finals for e in range(3)) < 3 for u, _, t in finals)
    games = [(0, float(rollout.field(u, e, "episode_return")[t]), int(rollout.field(u, e, "episode_step")[t]))
             for u, e, t in ended_rows]
    assert sorted(rollout.episodes) == sorted(games)
    assert all(length <= TIME_LIMIT for _, _, length in games)


def test_taking_slots_says_when_it_must_wait_for_them_and_when_the_wait_ends():
    """Central inference's threads read the marks (RemotePolicy.waiting_for_slots) to stop waiting for the actor's
    requests meanwhile: made before a wait for a slot not there yet, taken back once all are taken, and not made
    when they are all there."""
    free: queue.Queue = queue.Queue()
    calls: list[bool] = []
    for slot in (3, 4):
        free.put(slot)
    assert _take_slots(free, 2, threading.Event(), waiting=calls.append) == [3, 4]
    assert calls == []  # no wait
    free.put(5)
    threading.Timer(0.3, free.put, args=(6,)).start()
    assert _take_slots(free, 2, threading.Event(), waiting=calls.append) == [5, 6]
    assert calls == [True, False]
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    assert _take_slots(free, 1, stop, waiting=calls.append) is None  # stopped while waiting
    assert calls == [True, False, True]
