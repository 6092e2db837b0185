"""Tests for impala/learner.py and impala/losses.py: one update under SGD, the loss against values
computed by hand, reward clipping, episode ends, the learning-rate schedule and non-finite batches."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import math
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from impala import buffers as buffers_module
from impala import learner, losses, vtrace
from impala.buffers import BufferSpec, create_buffers
from impala.config import Config, UserError, parse_config
from impala.learner import LearnerState
from impala.model import Net
from impala.seeding import ActorLives

OBS_SHAPE = (4,)
NUM_ACTIONS = 3


def _config(**overrides: object) -> Config:
    # The IMPALA loss, one step per batch: what the hand computations below write out.
    values = {"env": "CartPole-v1", "unroll_length": 3, "batch_size": 1, "discounting": 0.9, "entropy_cost": 0.01,
              "baseline_cost": 0.5, "reward_clipping": "none", "grad_norm_clipping": 1e9, "learning_rate": 0.1,
              "policy_loss": "impala", "optimizer": "rmsprop", "epsilon": 0.01, "epochs": 1, "minibatches": 1,
              "vtrace_lambda": 1.0, "lr_schedule": "linear"}
    values.update(overrides)
    return Config(**values)


def _model(use_lstm: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(OBS_SHAPE, NUM_ACTIONS, model="mlp", use_lstm=use_lstm, hidden_size=8)


def _batch(model: Net, rewards: list[list[float]], dones: list[list[bool]], actions: list[list[int]],
           off_policy: bool = False, truncations: dict[tuple[int, int], float] | None = None
           ) -> dict[str, torch.Tensor]:
    """A batch [T + 1, B, ...] laid out as the actors write it.

    `rewards`/`dones` are rows 1..T (row 0 belongs to the previous unroll and must not be used);
    `actions` are rows 0..T-1 (row T's action is chosen in the next unroll). Unused entries hold poison.
    `truncations`: {(row, env): value of the final observation} where a time limit ended the episode (the
    row's done must be set).
    """
    T, B = len(rewards), len(rewards[0])
    generator = torch.Generator().manual_seed(1)
    obs = torch.randn((T + 1, B, *OBS_SHAPE), generator=generator)
    done = torch.tensor([[False] * B] + dones)
    reward = torch.tensor([[math.nan] * B] + rewards)
    action = torch.tensor(actions + [[-1] * B])
    with torch.no_grad():
        output, _ = model(obs, done, model.initial_state(B))
    behaviour_logits = output.policy_logits.clone()
    if off_policy:  # large enough to push pi/mu above and below 1
        behaviour_logits += 1.5 * torch.randn(behaviour_logits.shape, generator=generator)
    behaviour_logits[-1] = math.nan
    truncated = torch.zeros(T + 1, B, dtype=torch.bool)
    truncation_value = torch.zeros(T + 1, B)
    truncated[0], truncation_value[0] = True, math.nan  # row 0 is the previous unroll's
    for (t, b), value in (truncations or {}).items():
        assert t > 0 and done[t, b], "a truncation ends the episode"
        truncated[t, b], truncation_value[t, b] = True, value
    return {"obs": obs, "done": done, "reward": reward, "truncated": truncated, "truncation_value": truncation_value,
            "action": action, "policy_logits": behaviour_logits}


def _reference_vtrace(values: list[float], rewards: list[float], discounts: list[float], rhos: list[float]
                      ) -> tuple[list[float], list[float]]:
    """V-trace for one env as the paper writes it: v_s - V(x_s) = delta_s + gamma_s c_s (v_{s+1} - V(x_{s+1}))."""
    T = len(rewards)
    vs = [0.0] * T
    correction = 0.0  # v_{s+1} - V(x_{s+1}); zero past the last step (v_T = V(x_T))
    for s in reversed(range(T)):
        rho = min(1.0, rhos[s])
        c = min(1.0, rhos[s])
        delta = rho * (rewards[s] + discounts[s] * values[s + 1] - values[s])
        correction = delta + discounts[s] * c * correction
        vs[s] = values[s] + correction
    vs_next = vs[1:] + [values[T]]
    advantages = [min(1.0, rhos[s]) * (rewards[s] + discounts[s] * vs_next[s] - values[s]) for s in range(T)]
    return vs, advantages


def _expected_losses(model: Net, batch: dict[str, torch.Tensor], config: Config,
                     outputs: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
    """pg, baseline and entropy losses computed with plain Python floats from `outputs` (logits [T + 1, B, A],
    values [T + 1, B]; default: the model's from a zero core state)."""
    if outputs is None:
        with torch.no_grad():
            output, _ = model(batch["obs"], batch["done"], model.initial_state(batch["obs"].shape[1]))
        outputs = output.policy_logits, output.baseline
    policy_logits, baseline = outputs
    T = batch["obs"].shape[0] - 1
    B = batch["obs"].shape[1]
    log_pi = F.log_softmax(policy_logits.double(), -1)
    log_mu = F.log_softmax(batch["policy_logits"].double(), -1)
    totals = {"pg_loss": 0.0, "baseline_loss": 0.0, "entropy_loss": 0.0}
    for b in range(B):
        values = [float(v) for v in baseline[:, b]]
        actions = [int(a) for a in batch["action"][:T, b]]
        # Action t was taken at obs t; its reward and done are in row t + 1.
        rewards = [float(r) for r in batch["reward"][1:, b]]
        if config.reward_clipping == "abs_one":
            rewards = [max(-1.0, min(1.0, r)) for r in rewards]
        for t in range(T):  # a time limit: the final observation's value, discounted, is the bootstrap
            if batch["truncated"][t + 1, b]:
                rewards[t] += config.discounting * float(batch["truncation_value"][t + 1, b])
        discounts = [0.0 if bool(d) else config.discounting for d in batch["done"][1:, b]]
        rhos = [math.exp(float(log_pi[t, b, actions[t]] - log_mu[t, b, actions[t]])) for t in range(T)]
        vs, advantages = _reference_vtrace(values, rewards, discounts, rhos)
        for t in range(T):
            totals["pg_loss"] += -float(log_pi[t, b, actions[t]]) * advantages[t]
            totals["baseline_loss"] += config.baseline_cost * 0.5 * (vs[t] - values[t]) ** 2
            p = log_pi[t, b].exp()
            totals["entropy_loss"] += config.entropy_cost * float((p * log_pi[t, b]).sum())
    totals["total_loss"] = sum(totals.values())
    return totals


def _assert_losses(stats: dict[str, torch.Tensor], expected: dict[str, float]) -> None:
    for key, value in expected.items():
        assert float(stats[key]) == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_losses_on_policy_match_a_hand_computation() -> None:
    """On-policy (rho = 1) with an episode end inside the unroll."""
    model = _model()
    config = _config()
    batch = _batch(model, rewards=[[1.0], [2.0], [-0.5]], dones=[[False], [True], [False]], actions=[[0], [2], [1]])
    _, stats = learner.compute_loss(model, batch, (), config)
    assert float(stats["rho_mean"]) == pytest.approx(1.0, abs=1e-6)
    assert float(stats["rho_clipped_fraction"]) == 0.0
    _assert_losses(stats, _expected_losses(model, batch, config))


def test_on_policy_targets_are_discounted_returns_cut_at_the_episode_end() -> None:
    """With rho = 1, vs_t is the n-step return: r_{t+1} + gamma r_{t+2} + ... bootstrapped from V(obs T)."""
    model = _model()
    config = _config()
    batch = _batch(model, rewards=[[1.0], [2.0], [-0.5]], dones=[[False], [True], [False]], actions=[[0], [2], [1]])
    captured = _capture_vtrace(model, batch, config)
    with torch.no_grad():
        values = model(batch["obs"], batch["done"])[0].baseline[:, 0].tolist()
    gamma = config.discounting
    expected_vs = [1.0 + gamma * 2.0,  # the episode ends with action 1: nothing after it counts
                   2.0,
                   -0.5 + gamma * values[3]]
    torch.testing.assert_close(captured.vs[:, 0].double(), torch.tensor(expected_vs, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reward_clipping", ["none", "abs_one"])
def test_a_time_limit_bootstraps_from_the_final_observation_and_cuts_the_trace(reward_clipping: str) -> None:
    """Action 1's step hits a time limit (row 2: done and truncated) in a state of value v_f = 4. Its target is
    r + gamma v_f, not r: the state had a future the limit cut off; v_f is not a reward, so it is not clipped.
    Nothing from the next episode (row 3) reaches back: the discount into row 2 is still 0."""
    model = _model()
    config = _config(reward_clipping=reward_clipping)
    v_f = 4.0
    batch = _batch(model, rewards=[[1.0], [5.0], [-0.5]], dones=[[False], [True], [False]], actions=[[0], [2], [1]],
                   truncations={(2, 0): v_f})
    captured = _capture_vtrace(model, batch, config)
    with torch.no_grad():
        values = model(batch["obs"], batch["done"])[0].baseline[:, 0].tolist()
    gamma = config.discounting
    r_2 = 1.0 if reward_clipping == "abs_one" else 5.0
    expected_vs = [1.0 + gamma * (r_2 + gamma * v_f),
                   r_2 + gamma * v_f,
                   -0.5 + gamma * values[3]]
    torch.testing.assert_close(captured.vs[:, 0].double(), torch.tensor(expected_vs, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    _, stats = learner.compute_loss(model, batch, (), config)
    _assert_losses(stats, _expected_losses(model, batch, config))
    # The same rows without the truncation: a termination, whose target is the reward alone.
    terminated = _capture_vtrace(model, _batch(model, [[1.0], [5.0], [-0.5]], [[False], [True], [False]],
                                               [[0], [2], [1]]), config)
    assert float(terminated.vs[1, 0]) == pytest.approx(r_2)
    torch.testing.assert_close(terminated.vs[2], captured.vs[2], rtol=0, atol=0)


def test_losses_off_policy_match_a_hand_computation() -> None:
    model = _model()
    config = _config()
    batch = _batch(model, rewards=[[0.5, -1.0], [1.0, 0.0], [0.0, 2.0]], dones=[[False, False], [False, True],
                   [True, False]], actions=[[0, 1], [2, 2], [1, 0]], off_policy=True, truncations={(2, 1): -3.0})
    _, stats = learner.compute_loss(model, batch, (), config)
    assert 0.0 < float(stats["rho_clipped_fraction"]) < 1.0  # the clipping threshold is crossed both ways
    _assert_losses(stats, _expected_losses(model, batch, config))


def _capture_vtrace(model: Net, batch: dict[str, torch.Tensor], config: Config) -> vtrace.VTraceFromLogitsReturns:
    captured = []
    original = vtrace.from_action_log_probs

    def recording(**kwargs: torch.Tensor) -> vtrace.VTraceFromLogitsReturns:
        captured.append(original(**kwargs))
        return captured[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vtrace, "from_action_log_probs", recording)
        learner.compute_loss(model, batch, (), config)
    assert len(captured) == 1
    return captured[0]


def test_a_reward_after_an_episode_end_does_not_reach_earlier_targets() -> None:
    model = _model()
    config = _config()
    dones = [[False], [True], [False]]
    actions = [[0], [1], [2]]
    first = _capture_vtrace(model, _batch(model, [[1.0], [1.0], [1.0]], dones, actions), config)
    second = _capture_vtrace(model, _batch(model, [[1.0], [1.0], [-7.0]], dones, actions), config)
    torch.testing.assert_close(first.vs[:2], second.vs[:2], rtol=0, atol=0)
    torch.testing.assert_close(first.pg_advantages[:2], second.pg_advantages[:2], rtol=0, atol=0)
    assert not torch.allclose(first.vs[2], second.vs[2])
    # Without the episode end the same change does reach back.
    no_end = [[False], [False], [False]]
    third = _capture_vtrace(model, _batch(model, [[1.0], [1.0], [1.0]], no_end, actions), config)
    fourth = _capture_vtrace(model, _batch(model, [[1.0], [1.0], [-7.0]], no_end, actions), config)
    assert not torch.allclose(third.vs[0], fourth.vs[0])


def test_reward_clipping() -> None:
    model = _model()
    dones = [[False], [False], [False]]
    actions = [[0], [1], [2]]
    large = _batch(model, [[5.0], [-3.0], [0.25]], dones, actions)
    unit = _batch(model, [[1.0], [-1.0], [0.25]], dones, actions)
    clipped = _config(reward_clipping="abs_one")
    _, stats_large = learner.compute_loss(model, large, (), clipped)
    _, stats_unit = learner.compute_loss(model, unit, (), clipped)
    for key in ("pg_loss", "baseline_loss", "total_loss"):
        assert float(stats_large[key]) == float(stats_unit[key]), key
    _assert_losses(stats_large, _expected_losses(model, large, clipped))
    unclipped = _config(reward_clipping="none")
    _, stats_raw = learner.compute_loss(model, large, (), unclipped)
    assert float(stats_raw["baseline_loss"]) != pytest.approx(float(stats_unit["baseline_loss"]))
    _assert_losses(stats_raw, _expected_losses(model, large, unclipped))


def _sgd(model: Net, lr: float) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def _batch_for_update(model: Net) -> dict[str, torch.Tensor]:
    return _batch(model, rewards=[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dones=[[False, False], [True, False],
                  [False, False]], actions=[[0, 1], [1, 2], [2, 0]], off_policy=True)


def test_sgd_update_moves_each_parameter_by_minus_lr_times_grad() -> None:
    model = _model()
    config = _config(batch_size=2)
    batch = _batch_for_update(model)
    reference = copy.deepcopy(model)
    loss, _ = learner.compute_loss(reference, batch, (), config)
    loss.backward()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {name: p.grad.clone() for name, p in reference.named_parameters()}
    assert all(g.abs().sum() > 0 for g in grads.values())  # every parameter takes part

    optimizer, scheduler = _sgd(model, config.learning_rate)
    stats = learner.update(model, optimizer, scheduler, batch, (), config)
    assert stats["skipped"] == 0.0
    assert stats["learning_rate"] == pytest.approx(config.learning_rate)
    assert stats["total_loss"] == pytest.approx(loss.item())
    grad_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    assert stats["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    for name, p in model.named_parameters():
        # p + (-lr) * grad, rounded once as SGD's fused add rounds it: bit for bit, no tolerance.
        expected = before[name].add(grads[name], alpha=-config.learning_rate)
        assert torch.equal(p.detach(), expected), name
        torch.testing.assert_close(p.detach() - before[name], -config.learning_rate * grads[name], rtol=1e-5, atol=1e-8)


def test_sgd_update_follows_an_independent_gradient_of_the_hand_written_loss() -> None:
    """The same step, with the gradient taken through losses written out here rather than compute_loss."""
    model = _model()
    config = _config(batch_size=2)
    batch = _batch_for_update(model)
    reference = copy.deepcopy(model)
    output, _ = reference(batch["obs"], batch["done"])
    expected = _expected_losses(reference, batch, config)  # checks the forward values on the way
    log_pi = F.log_softmax(output.policy_logits[:-1], -1)
    T = batch["obs"].shape[0] - 1
    with torch.no_grad():
        captured = _capture_vtrace(reference, batch, config)
    taken = log_pi.gather(-1, batch["action"][:T, :, None]).squeeze(-1)
    loss = (-(taken * captured.pg_advantages).sum()
            + config.baseline_cost * 0.5 * ((captured.vs - output.baseline[:-1]) ** 2).sum()
            + config.entropy_cost * (log_pi.exp() * log_pi).sum())
    assert loss.item() == pytest.approx(expected["total_loss"], rel=1e-5)
    loss.backward()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer, scheduler = _sgd(model, config.learning_rate)
    learner.update(model, optimizer, scheduler, batch, (), config)
    for name, p in reference.named_parameters():
        moved = dict(model.named_parameters())[name].detach() - before[name]
        torch.testing.assert_close(moved, -config.learning_rate * p.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_gradient_norm_is_clipped() -> None:
    model = _model()
    batch = _batch_for_update(model)
    reference = copy.deepcopy(model)
    loss, _ = learner.compute_loss(reference, batch, (), _config(batch_size=2))
    loss.backward()
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in reference.parameters()))
    clip = norm / 4
    config = _config(batch_size=2, grad_norm_clipping=clip)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer, scheduler = _sgd(model, config.learning_rate)
    learner.update(model, optimizer, scheduler, batch, (), config)
    for p, p0, ref in zip(model.parameters(), before, reference.parameters()):
        torch.testing.assert_close(p.detach() - p0, -config.learning_rate * ref.grad * (clip / norm),
                                   rtol=1e-4, atol=1e-7)


def test_learning_rate_decays_linearly_to_zero_at_total_steps() -> None:
    config = _config(learning_rate=0.01, unroll_length=5, batch_size=2, total_steps=100)  # 10 steps per update
    model = _model()
    optimizer, scheduler = learner.make_optimizer(model, config)
    assert isinstance(optimizer, torch.optim.RMSprop)
    group = optimizer.param_groups[0]
    assert (group["alpha"], group["eps"], group["momentum"]) == (config.alpha, config.epsilon, config.momentum)
    rates = []
    for _ in range(13):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [0.01 * max(0.0, 1 - 10 * k / 100) for k in range(13)]
    assert rates == pytest.approx(expected, abs=1e-12)
    assert rates[10:] == [0.0, 0.0, 0.0]


def test_a_constant_learning_rate_stays_at_the_flag_past_total_steps() -> None:
    config = _config(learning_rate=0.01, unroll_length=5, batch_size=2, total_steps=100, lr_schedule="constant")
    model = _model()
    optimizer, scheduler = learner.make_optimizer(model, config)
    rates = []
    for _ in range(13):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == [0.01] * 13


def test_a_resumed_schedule_follows_agent_steps_and_the_flags_given_now() -> None:
    """Resumed at agent step 40 with twice the batch (20 steps per update) and a new --learning_rate: the
    rate is the one the new flags give at step 40, 60, 80, ..., not one counted in the old run's updates."""
    config = _config(learning_rate=0.01, unroll_length=5, batch_size=4, total_steps=100)
    model = _model()
    optimizer, _ = learner.make_optimizer(model, _config(learning_rate=0.7, unroll_length=5, batch_size=2,
                                                         total_steps=100))
    optimizer.param_groups[0]["lr"] = 0.5  # as a loaded optimizer state leaves it
    scheduler = learner.make_schedule(optimizer, config, start_step=40)
    rates = []
    for _ in range(4):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([0.006, 0.004, 0.002, 0.0], abs=1e-12)


def test_update_reports_the_scheduled_learning_rate() -> None:
    config = _config(batch_size=2, learning_rate=0.01, total_steps=24)  # T*B = 6: four updates
    model = _model()
    optimizer, scheduler = learner.make_optimizer(model, config)
    batch = _batch_for_update(model)
    rates = [learner.update(model, optimizer, scheduler, batch, (), config)["learning_rate"] for _ in range(4)]
    assert rates == pytest.approx([0.01, 0.0075, 0.005, 0.0025])


# A skipped update still uses up its place in the schedule, so the scheduler steps without the optimizer.
@pytest.mark.filterwarnings("error::UserWarning")  # and says nothing about it
@pytest.mark.parametrize("optimizer_name", ["rmsprop", "adam"])  # adam: skipped on the device, by its fused kernel
@pytest.mark.parametrize("where", ["reward", "obs"])
def test_a_non_finite_batch_is_skipped(where: str, optimizer_name: str) -> None:
    model = _model()
    config = _config(batch_size=2, reward_clipping="abs_one", optimizer=optimizer_name, minibatches=2)
    optimizer, scheduler = learner.make_optimizer(model, config)
    learner.update(model, optimizer, scheduler, _batch_for_update(model), (), config)  # moments, step counts
    batch = _batch_for_update(model)
    batch[where][1, 0] = math.nan
    config = dataclasses.replace(config, minibatches=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    state_before = copy.deepcopy(optimizer.state_dict()["state"])
    stats = learner.update(model, optimizer, scheduler, batch, (), config)
    assert stats["skipped"] == 1.0
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
    state_after = optimizer.state_dict()["state"]
    for index, values in state_before.items():  # Adam's step count and moments, RMSprop's square average
        for key, value in values.items():
            assert torch.equal(state_after[index][key], value), (index, key)
    # A good batch afterwards is applied normally.
    stats = learner.update(model, optimizer, scheduler, _batch_for_update(model), (), config)
    assert stats["skipped"] == 0.0
    assert any(not torch.equal(p.detach(), before[name]) for name, p in model.named_parameters())


@pytest.mark.parametrize("optimizer_name", ["rmsprop", "adam"])
def test_a_step_whose_loss_and_gradient_norm_are_huge_but_finite_is_applied(optimizer_name: str) -> None:
    """A loss of 3e38 and a gradient norm of 1e38 are both finite (float32 ends near 3.4e38), though their sum is
    not: the step is applied, clipped, and not counted as skipped."""
    model = _model()
    config = _config(optimizer=optimizer_name, grad_norm_clipping=1.0)
    optimizer, _ = learner.make_optimizer(model, config)
    weight = model.baseline.bias

    def huge_loss(model: Net, *_: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = 3e38 + 1e38 * (weight - weight.detach()).sum()  # 3e38, and d loss / d bias = 1e38
        return loss, {"total_loss": loss.detach()}

    before = weight.detach().clone()
    stats = learner._step(model, optimizer, _batch_for_update(model), (), config, False, loss_fn=huge_loss)
    assert float(stats["total_loss"]) == pytest.approx(3e38) and float(stats["grad_norm"]) == pytest.approx(1e38)
    assert float(stats["skipped"]) == 0.0
    assert not torch.equal(weight.detach(), before)


def test_slots_gathered_one_by_one_equal_the_stacked_batch() -> None:
    """`gather_slots`, how a GPU learner copies page-locked observations (slot by slot, then time-major on the
    device), gives what stacking the same slots does, in the order the slots were taken."""
    buffers = create_buffers(BufferSpec(6, 4, (2, 3, 3), torch.uint8, 3), shared=False)
    buffers["obs"].copy_(torch.randint(0, 255, buffers["obs"].shape, dtype=torch.uint8))
    slots = [4, 0, 5, 2]
    gathered = learner.gather_slots(buffers["obs"], slots, torch.device("cpu"))
    assert gathered.shape == (5, 4, 2, 3, 3) and gathered.is_contiguous()
    assert torch.equal(gathered, torch.stack([buffers["obs"][i] for i in slots], dim=1))
    assert torch.equal(gathered[:, 1], buffers["obs"][0])


def test_slots_that_cuda_refuses_to_page_lock_leave_one_warning_and_no_error(monkeypatch, caplog) -> None:
    """Where CUDA refuses to page-lock the slots (a limit on locked memory), one warning and False: the learner
    then stacks the observations on the host, as with --no-pin_slots (the GPU tests check both paths)."""
    class RefusingRuntime:
        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
            raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(torch.cuda, "cudart", RefusingRuntime)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # no GPU here to switch to
    buffers = create_buffers(BufferSpec(4, 3, (2, 3, 3), torch.uint8, 3))
    with caplog.at_level("WARNING", logger="impala"):
        assert not buffers_module.pin_observations(buffers, torch.device("cuda"))
    assert "Could not page-lock the slots' observations for the GPU (CUDA error: out of memory" in caplog.text
    assert len(caplog.records) == 1


def test_unused_rows_are_never_read() -> None:
    """Row 0's reward, row T's action and behaviour logits hold poison; the loss must stay finite."""
    model = _model()
    batch = _batch_for_update(model)
    assert torch.isnan(batch["reward"][0]).all() and (batch["action"][-1] == -1).all()
    loss, stats = learner.compute_loss(model, batch, (), _config(batch_size=2))
    assert torch.isfinite(loss)
    assert all(torch.isfinite(v) for v in stats.values())


def test_batch_staging_stacks_slots_time_major() -> None:
    T, num_buffers = 3, 4
    spec = BufferSpec(num_buffers, T, OBS_SHAPE, torch.float32, NUM_ACTIONS, core_state_shapes=((1, 8), (1, 8)))
    buffers = create_buffers(spec)
    for slot in range(num_buffers):
        buffers["obs"][slot] = slot
        buffers["done"][slot] = False
        buffers["reward"][slot] = torch.arange(T + 1) + 10 * slot
        buffers["action"][slot] = slot
        buffers["policy_logits"][slot] = -slot
        buffers["core_state_0"][slot] = slot
        buffers["core_state_1"][slot] = -slot
    staging = learner.BatchStaging(buffers, batch_size=2, pin=False)
    staging.fill([3, 1])
    batch, core_state = staging.to(torch.device("cpu"))
    assert batch["obs"].shape == (T + 1, 2, *OBS_SHAPE)
    assert batch["policy_logits"].shape == (T + 1, 2, NUM_ACTIONS)
    torch.testing.assert_close(batch["reward"][:, 0], torch.arange(T + 1.0) + 30)
    torch.testing.assert_close(batch["reward"][:, 1], torch.arange(T + 1.0) + 10)
    assert (batch["action"][:, 0] == 3).all() and (batch["action"][:, 1] == 1).all()
    assert [s.shape for s in core_state] == [(1, 2, 8), (1, 2, 8)]
    assert (core_state[0][:, 0] == 3).all() and (core_state[1][:, 1] == -1).all()
    # The staged copy no longer depends on the slots.
    buffers["reward"][3] = math.nan
    assert torch.isfinite(staging.tensors["reward"]).all()


def _hand_run_lstm(model: Net, obs: torch.Tensor, done: torch.Tensor, core_state: tuple[torch.Tensor, ...]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and values [T + 1, B] of `model` from `core_state`, its LSTM cell written out step by step:
    the state zeroed where obs t begins an episode, then i, f, g, o = W_ih x + b_ih + W_hh h + b_hh."""
    assert model.core is not None
    with torch.no_grad():
        features = model.torso(obs.flatten(0, 1).float()).view(*obs.shape[:2], -1)
        h, c = (s[0].clone() for s in core_state)  # [B, H]: one layer
        logits, values = [], []
        for t in range(obs.shape[0]):
            keep = (~done[t]).float()[:, None]
            h, c = keep * h, keep * c
            gates = (features[t] @ model.core.weight_ih_l0.T + model.core.bias_ih_l0
                     + h @ model.core.weight_hh_l0.T + model.core.bias_hh_l0)
            i, f, g, o = gates.chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            logits.append(model.policy(h))
            values.append(model.baseline(h)[:, 0])
    return torch.stack(logits), torch.stack(values)


def test_lstm_loss_starts_from_the_stored_core_state() -> None:
    """The loss is that of the LSTM run by hand from the slot's stored state, reset where an episode begins."""
    model = _model(use_lstm=True)
    config = _config(use_lstm=True, batch_size=2)
    batch = _batch(model, [[1.0, 0.5], [0.0, -1.0], [1.0, 2.0]], [[False, False], [True, False], [False, False]],
                   [[0, 1], [1, 2], [2, 0]], off_policy=True)
    generator = torch.Generator().manual_seed(3)
    stored = tuple(torch.randn(1, 2, 8, generator=generator) for _ in range(2))  # (h, c) [layers, B, H]
    _, stats = learner.compute_loss(model, batch, stored, config)
    _assert_losses(stats, _expected_losses(model, batch, config, _hand_run_lstm(model, batch["obs"], batch["done"],
                                                                                stored)))
    _, from_zero = learner.compute_loss(model, batch, model.initial_state(2), config)
    assert float(from_zero["total_loss"]) != pytest.approx(float(stats["total_loss"]), rel=1e-3)


def test_dual_clip_bounds_the_loss_of_a_negative_advantage() -> None:
    """Advantages -1 and 1 (normalised to -0.7071 and 0.7071), both ratios 10, clip 0.2: plain PPO takes
    min(10 A, 1.2 A) per sample; dual clip 3 bounds the negative one's term at 3 A."""
    log_rhos = torch.log(torch.tensor([10.0, 10.0]))
    advantages = torch.tensor([-1.0, 1.0])
    a = 1 / 2 ** 0.5  # (+-1 - 0) / std([-1, 1]) with the unbiased std sqrt(2)
    plain, clipped = losses.ppo_loss(log_rhos, advantages, clip=0.2)
    assert float(plain) == pytest.approx(-(10 * -a + 1.2 * a) / 2, rel=1e-5)
    assert float(clipped) == 1.0
    dual, _ = losses.ppo_loss(log_rhos, advantages, clip=0.2, dual_clip=3.0)
    assert float(dual) == pytest.approx(-(3 * -a + 1.2 * a) / 2, rel=1e-5)


def _hand_ppo_terms(model: Net, batch: dict[str, torch.Tensor], config: Config
                    ) -> tuple[list[float], list[float], list[tuple[float, float]], torch.Tensor]:
    """PPO's advantages, ratios pi/mu and (V-trace target, value) pairs, column after column, and the logits
    [T + 1, B, A]: V-trace with lambda written out one step at a time."""
    with torch.no_grad():
        output, _ = model(batch["obs"], batch["done"], ())
    logits, values = output.policy_logits, output.baseline
    T = config.unroll_length
    rewards, done, actions = batch["reward"][1:], batch["done"][1:], batch["action"][:-1]
    advantages, ratios, targets = [], [], []
    for b in range(batch["obs"].shape[1]):
        log_pi = F.log_softmax(logits[:-1, b], -1).gather(1, actions[:, b:b + 1]).squeeze(1)
        log_mu = F.log_softmax(batch["policy_logits"][:-1, b], -1).gather(1, actions[:, b:b + 1]).squeeze(1)
        rho = (log_pi - log_mu).exp()
        discounts = [0.0 if done[t, b] else config.discounting for t in range(T)]
        # V-trace with lambda: v_s - V_s = delta_s + gamma_s * lambda * min(1, rho_s) * (v_{s+1} - V_{s+1})
        v = [0.0] * T
        next_diff = 0.0
        for t in reversed(range(T)):
            delta = min(1.0, float(rho[t])) * (float(rewards[t, b]) + discounts[t] * float(values[t + 1, b])
                                               - float(values[t, b]))
            diff = delta + discounts[t] * config.vtrace_lambda * min(1.0, float(rho[t])) * next_diff
            v[t] = float(values[t, b]) + diff
            next_diff = diff
        for t in range(T):
            after = v[t + 1] if t + 1 < T else float(values[T, b])
            advantages.append(float(rewards[t, b]) + discounts[t] * after - float(values[t, b]))
            ratios.append(float(rho[t]))
            targets.append((v[t], float(values[t, b])))
    return advantages, ratios, targets, logits


def _hand_surrogate(advantages: list[float], ratios: list[float], config: Config, mean: float, std: float
                    ) -> torch.Tensor:
    """PPO's dual-clipped surrogate per sample, the advantages normalised with `mean` and `std`."""
    adv = (torch.tensor(advantages, dtype=torch.float64) - mean) / (std + 1e-8)
    ratio = torch.tensor(ratios, dtype=torch.float64)
    low, high = 1 - config.ppo_clip, 1 + config.ppo_clip
    surrogate = torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
    return torch.where(adv < 0, torch.maximum(surrogate, config.ppo_dual_clip * adv), surrogate)


def test_ppo_loss_matches_a_hand_computation() -> None:
    """Clipped surrogate on normalised advantages, averaged; value and entropy terms averaged too."""
    model = _model()
    config = _config(batch_size=2, policy_loss="ppo", ppo_clip=0.2, vtrace_lambda=0.5)
    batch = _batch_for_update(model)
    loss, stats = learner.compute_loss(model, batch, (), config)
    advantages, ratios, targets, logits = _hand_ppo_terms(model, batch, config)
    adv = torch.tensor(advantages, dtype=torch.float64)
    expected_pg = -float(_hand_surrogate(advantages, ratios, config, float(adv.mean()), float(adv.std())).mean())
    ratio = torch.tensor(ratios, dtype=torch.float64)
    assert float(stats["ppo_clip_fraction"]) == pytest.approx(float(((ratio - 1).abs() > 0.2).double().mean()))
    expected_baseline = config.baseline_cost * 0.5 * sum((a - b) ** 2 for a, b in targets) / len(targets)
    probs = F.softmax(logits[:-1], -1)
    expected_entropy = config.entropy_cost * float((probs * F.log_softmax(logits[:-1], -1)).sum()) / len(targets)
    assert float(stats["pg_loss"]) == pytest.approx(expected_pg, rel=1e-5, abs=1e-6)
    assert float(stats["baseline_loss"]) == pytest.approx(expected_baseline, rel=1e-5)
    assert float(stats["entropy_loss"]) == pytest.approx(expected_entropy, rel=1e-5)
    assert float(loss.detach()) == pytest.approx(expected_pg + expected_baseline + expected_entropy, rel=1e-5, abs=1e-6)


def test_batch_advantage_moments_are_those_of_the_whole_batch_and_normalise_a_minibatch() -> None:
    """`--advantage_norm batch`: the moments are the mean and deviation of the advantages of both columns, and
    a one-column minibatch's surrogate normalises its advantages with them instead of its own."""
    model = _model()
    config = _config(batch_size=2, policy_loss="ppo", ppo_clip=0.2, vtrace_lambda=0.5, advantage_norm="batch")
    batch = _batch_for_update(model)
    advantages, ratios, _, _ = _hand_ppo_terms(model, batch, config)
    adv = torch.tensor(advantages, dtype=torch.float64)
    mean, std = learner.batch_advantage_moments(model, batch, (), config)
    assert (float(mean), float(std)) == pytest.approx((float(adv.mean()), float(adv.std())), rel=1e-5)
    T = config.unroll_length
    column = {k: v[:, 1:2] for k, v in batch.items()}  # the second column's samples are T..2T-1 above
    _, stats = learner.compute_loss(model, column, (), config, advantage_moments=(mean, std))
    expected = -float(_hand_surrogate(advantages[T:], ratios[T:], config, float(adv.mean()), float(adv.std())).mean())
    assert float(stats["pg_loss"]) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    own = adv[T:]
    _, unnormalised = learner.compute_loss(model, column, (), config)  # its own moments: another loss
    own_loss = -float(_hand_surrogate(advantages[T:], ratios[T:], config, float(own.mean()), float(own.std())).mean())
    assert float(unnormalised["pg_loss"]) == pytest.approx(own_loss, rel=1e-5, abs=1e-6)
    assert own_loss != pytest.approx(expected, rel=1e-3)


def test_batch_advantage_norm_keeps_the_moments_of_the_update_start_in_later_passes_over_one_part() -> None:
    """--minibatches 1 and two passes: the second pass normalises with the moments the batch had before the
    first, as with several parts, not with those of the weights the first pass moved."""
    config = _config(batch_size=2, minibatches=1, epochs=2, policy_loss="ppo", advantage_norm="batch",
                     learning_rate=0.5)
    model = _model()
    batch = _batch_for_update(model)
    advantages, _, _, _ = _hand_ppo_terms(model, batch, config)
    adv = torch.tensor(advantages)
    moments = (adv.mean(), adv.std())
    reference = copy.deepcopy(model)
    optimizer, scheduler = _sgd(model, config.learning_rate)
    learner.update(model, optimizer, scheduler, batch, (), config)
    reference_optimizer, _ = _sgd(reference, config.learning_rate)
    for _ in range(config.epochs):
        reference_optimizer.zero_grad()
        loss, _ = learner.compute_loss(reference, batch, (), config, advantage_moments=moments)
        loss.backward()
        reference_optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_batch_advantage_norm_keeps_the_moments_of_the_update_start_for_every_step() -> None:
    """Two passes over two one-column minibatches: four SGD steps, each normalising with the moments the
    whole batch had before the first (not recomputed as the weights move)."""
    config = _config(batch_size=2, minibatches=2, epochs=2, policy_loss="ppo", advantage_norm="batch")
    model = _model()
    batch = _batch_for_update(model)
    advantages, _, _, _ = _hand_ppo_terms(model, batch, config)
    adv = torch.tensor(advantages)
    moments = (adv.mean(), adv.std())
    torch.manual_seed(5)
    orders = [torch.randperm(2).tolist() for _ in range(config.epochs)]  # what update() draws with this seed
    reference = copy.deepcopy(model)
    optimizer, scheduler = _sgd(model, config.learning_rate)
    torch.manual_seed(5)
    learner.update(model, optimizer, scheduler, batch, (), config)
    reference_optimizer, _ = _sgd(reference, config.learning_rate)
    for c in [c for order in orders for c in order]:
        reference_optimizer.zero_grad()
        loss, _ = learner.compute_loss(reference, {k: v[:, c:c + 1] for k, v in batch.items()}, (), config,
                                       advantage_moments=moments)
        loss.backward()
        reference_optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    per_minibatch = _model()  # and the default, each minibatch's own moments, moves the weights elsewhere
    optimizer, scheduler = _sgd(per_minibatch, config.learning_rate)
    torch.manual_seed(5)
    learner.update(per_minibatch, optimizer, scheduler, batch, (), dataclasses.replace(config, advantage_norm="minibatch"))
    assert not all(torch.allclose(p, q) for p, q in zip(model.parameters(), per_minibatch.parameters(), strict=True))


def test_sample_minibatches_hold_the_targets_of_the_update_start_and_match_a_hand_computation() -> None:
    """`--minibatch_mode samples`: two passes over the batch's 6 steps in 3 minibatches of 2 steps drawn across
    both unrolls. Every step's V-trace target and advantage are those of the weights before the update (V-trace
    written out in `_hand_ppo_terms`); each SGD step's ratio, value and entropy are those of the weights it has."""
    config = _config(batch_size=2, policy_loss="ppo", ppo_clip=0.2, vtrace_lambda=0.5, minibatch_mode="samples",
                     minibatches=3, epochs=2)
    model = _model()
    batch = _batch_for_update(model)
    T, B = config.unroll_length, 2
    advantages, _, targets, _ = _hand_ppo_terms(model, batch, config)  # column-major: b * T + t
    torch.manual_seed(5)
    orders = [torch.randperm(T * B).tolist() for _ in range(config.epochs)]  # what update() draws with this seed
    reference = copy.deepcopy(model)
    optimizer, scheduler = _sgd(model, config.learning_rate)
    torch.manual_seed(5)
    stats = learner.update(model, optimizer, scheduler, batch, (), config)
    reference_optimizer, _ = _sgd(reference, config.learning_rate)
    for order in orders:
        for part in (order[0:2], order[2:4], order[4:6]):
            steps = [(i // B, i % B) for i in part]  # the batch's steps flattened time-major: t * B + b
            obs = torch.stack([batch["obs"][t, b] for t, b in steps])
            output, _ = reference(obs[None], torch.zeros(1, len(steps), dtype=torch.bool))
            logits, values = output.policy_logits[0], output.baseline[0]
            actions = torch.tensor([int(batch["action"][t, b]) for t, b in steps])
            behaviour = torch.stack([batch["policy_logits"][t, b] for t, b in steps])
            ratio = (F.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
                     - F.log_softmax(behaviour, -1).gather(1, actions[:, None]).squeeze(1)).exp()
            adv = torch.tensor([advantages[b * T + t] for t, b in steps])
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            clipped = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
            surrogate = torch.where(adv < 0, torch.maximum(clipped, config.ppo_dual_clip * adv), clipped)
            vs = torch.tensor([targets[b * T + t][0] for t, b in steps])
            probs = F.softmax(logits, -1)
            loss = (-surrogate.mean() + config.baseline_cost * 0.5 * ((vs - values) ** 2).mean()
                    + config.entropy_cost * (probs * F.log_softmax(logits, -1)).sum(-1).mean())
            reference_optimizer.zero_grad()
            loss.backward()
            reference_optimizer.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
    assert stats["skipped"] == 0.0 and scheduler.last_epoch == 1
    unrolls = _model()  # whole unrolls, targets recomputed at each step, move the weights elsewhere
    optimizer, scheduler = _sgd(unrolls, config.learning_rate)
    torch.manual_seed(5)
    learner.update(unrolls, optimizer, scheduler, batch, (), dataclasses.replace(config, minibatch_mode="unrolls",
                                                                                 minibatches=2))
    assert not all(torch.allclose(p, q) for p, q in zip(model.parameters(), unrolls.parameters(), strict=True))


@pytest.mark.parametrize("advantage_norm", ["minibatch", "batch"])
def test_one_pass_over_the_whole_batch_is_the_same_step_as_samples_or_unrolls(advantage_norm: str) -> None:
    """With one minibatch and one pass, both modes take one step on every step of the batch with the targets of
    the same weights: the same loss, stats and weights."""
    config = _config(batch_size=2, policy_loss="ppo", vtrace_lambda=0.5, minibatch_mode="samples",
                     advantage_norm=advantage_norm)
    batch = _batch_for_update(model := _model())
    reference = copy.deepcopy(model)
    optimizer, scheduler = _sgd(model, config.learning_rate)
    stats = learner.update(model, optimizer, scheduler, batch, (), config)
    reference_optimizer, reference_scheduler = _sgd(reference, config.learning_rate)
    reference_stats = learner.update(reference, reference_optimizer, reference_scheduler, batch, (),
                                     dataclasses.replace(config, minibatch_mode="unrolls"))
    assert stats == pytest.approx(reference_stats, rel=1e-5, abs=1e-7)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)


def _plain_steps(model: Net, batches: list[dict[str, torch.Tensor]], config: Config) -> None:
    """One plain SGD step of `compute_loss` per batch, in order: the reference for epochs and minibatches."""
    optimizer, _ = _sgd(model, config.learning_rate)
    for batch in batches:
        optimizer.zero_grad()
        loss, _ = learner.compute_loss(model, batch, (), config)
        loss.backward()
        optimizer.step()


def test_epochs_repeat_the_step_and_the_schedule_steps_once_per_batch() -> None:
    config = _config(batch_size=2, epochs=3)
    batch = _batch_for_update(model := _model())
    reference = copy.deepcopy(model)
    optimizer, scheduler = _sgd(model, config.learning_rate)
    stats = learner.update(model, optimizer, scheduler, batch, (), config)
    _plain_steps(reference, [batch] * 3, config)  # three plain gradient steps on the same batch
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    assert scheduler.last_epoch == 1
    assert stats["skipped"] == 0.0


def test_minibatches_split_the_batch_along_its_unrolls() -> None:
    """Two minibatches of one unroll each: two steps, each on one column of the batch (in some order)."""
    config = _config(batch_size=2, minibatches=2)
    model = _model()
    batch = _batch_for_update(model)
    torch.manual_seed(5)
    order = torch.randperm(2).tolist()  # the permutation update() draws next with this seed
    reference = copy.deepcopy(model)
    optimizer, scheduler = _sgd(model, config.learning_rate)
    torch.manual_seed(5)
    learner.update(model, optimizer, scheduler, batch, (), config)
    _plain_steps(reference, [{k: v[:, c:c + 1] for k, v in batch.items()} for c in order], config)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    whole = copy.deepcopy(_model())  # and it differs from one step on the whole batch
    opt, sched = _sgd(whole, config.learning_rate)
    learner.update(whole, opt, sched, batch, (), _config(batch_size=2))
    assert not all(torch.allclose(p, q) for p, q in zip(model.parameters(), whole.parameters()))


@pytest.mark.parametrize("reward_clipping", ["none", "abs_one"])
def test_vtrace_inputs_are_the_steps_rewards_discounts_and_behaviour_log_probs(reward_clipping: str) -> None:
    """Rows 1..T's rewards (clipped, a time limit's bootstrap added unclipped) and discounts, and log mu of the
    actions of rows 0..T-1; the row-0 and row-T poison of `_batch` reaches none of them. A second call changes
    nothing."""
    model = _model()
    config = _config(reward_clipping=reward_clipping)
    batch = _batch(model, rewards=[[0.5, -3.0], [4.0, 0.0], [0.0, 2.0]], dones=[[False, False], [False, True],
                   [True, False]], actions=[[0, 1], [2, 2], [1, 0]], off_policy=True, truncations={(2, 1): -3.0})
    inputs = learner.vtrace_inputs(batch, config)
    clip = (lambda r: max(-1.0, min(1.0, r))) if reward_clipping == "abs_one" else (lambda r: r)
    gamma = config.discounting
    expected_rewards = [[0.5, clip(-3.0)], [clip(4.0), gamma * -3.0], [0.0, clip(2.0)]]
    torch.testing.assert_close(inputs["rewards"], torch.tensor(expected_rewards), rtol=0, atol=1e-6)
    torch.testing.assert_close(inputs["discounts"], torch.tensor([[gamma, gamma], [gamma, 0.0], [0.0, gamma]]))
    log_mu = F.log_softmax(batch["policy_logits"][:-1], -1).gather(-1, batch["action"][:-1, :, None])[..., 0]
    torch.testing.assert_close(inputs["behaviour_log_probs"], log_mu)
    assert {key: inputs[key] is batch[key] for key in ("obs", "done", "action")} == {"obs": True, "done": True,
                                                                                     "action": True}
    assert learner.vtrace_inputs(inputs, config) is inputs


def test_an_update_takes_the_behaviour_log_probs_once_and_the_targets_once_per_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two passes of two minibatches: the behaviour policy's log-probabilities of the batch's actions are taken
    once for the update (nothing the steps change moves them), the learned policy's once per gradient step."""
    config = _config(batch_size=2, minibatches=2, epochs=2, policy_loss="ppo")
    model = _model()
    batch = _batch_for_update(model)
    calls: list[torch.Tensor] = []
    original = vtrace.action_log_probs

    def recording(policy_logits: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        calls.append(policy_logits)
        return original(policy_logits, actions)

    monkeypatch.setattr(vtrace, "action_log_probs", recording)
    optimizer, scheduler = _sgd(model, config.learning_rate)
    learner.update(model, optimizer, scheduler, batch, (), config)
    behaviour = [logits for logits in calls if not logits.requires_grad]
    assert len(behaviour) == 1 and torch.equal(behaviour[0], batch["policy_logits"][:-1])
    assert len(calls) - len(behaviour) == 4


def test_adam_is_chosen_with_the_flags_epsilon() -> None:
    optimizer, _ = learner.make_optimizer(_model(), _config(optimizer="adam", epsilon=1e-5, learning_rate=0.003))
    assert isinstance(optimizer, torch.optim.Adam)
    assert optimizer.param_groups[0]["eps"] == 1e-5 and optimizer.param_groups[0]["lr"] == 0.003


def test_fused_adam_steps_as_the_reference_adam_does() -> None:
    """The learner's Adam is fused (one kernel per step, and a skip decided on the device): its steps equal
    torch's reference single-tensor Adam's on the same batches, to float error."""
    config = _config(batch_size=4, optimizer="adam", epsilon=1e-5, learning_rate=0.001, minibatches=2, epochs=2)
    torch.manual_seed(0)
    fused_model = _model()
    reference_model = copy.deepcopy(fused_model)
    fused, fused_schedule = learner.make_optimizer(fused_model, config)
    assert all(group["fused"] for group in fused.param_groups)
    reference = torch.optim.Adam(reference_model.parameters(), lr=config.learning_rate, eps=config.epsilon,
                                 foreach=False)
    reference_schedule = torch.optim.lr_scheduler.LambdaLR(reference, lambda _: 1.0)
    for seed in range(3):
        batch = _batch_for_update(fused_model)
        torch.manual_seed(seed)  # the same minibatch order for both
        learner.update(fused_model, fused, fused_schedule, batch, (), config)
        torch.manual_seed(seed)
        learner.update(reference_model, reference, reference_schedule, batch, (), config)
    for (name, a), b in zip(fused_model.named_parameters(), reference_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(a, b) for a, b in zip(fused_model.parameters(), _model().parameters(), strict=True))


def test_an_adam_state_saved_before_adam_was_fused_resumes_fused() -> None:
    """A checkpoint's optimiser state from the unfused Adam (`foreach`, step counts on the CPU) loads, and the
    resumed optimiser is the fused one again, which skips on the device."""
    model = _model()
    config = _config(optimizer="adam", epsilon=1e-5, batch_size=2)
    old = torch.optim.Adam(model.parameters(), lr=config.learning_rate, eps=config.epsilon, foreach=True)
    learner.update(model, old, torch.optim.lr_scheduler.LambdaLR(old, lambda _: 1.0), _batch_for_update(model), (),
                   config)
    optimizer, _ = learner.make_optimizer(model, config)
    optimizer.load_state_dict(old.state_dict())
    scheduler = learner.make_schedule(optimizer, config, start_step=6)
    assert all(group["fused"] and not group["foreach"] for group in optimizer.param_groups)
    before = [p.detach().clone() for p in model.parameters()]
    stats = learner.update(model, optimizer, scheduler, _batch_for_update(model), (), config)
    assert stats["skipped"] == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(float(state["step"]) == 2 for state in optimizer.state.values())


def test_a_checkpoint_of_a_graphed_gpu_run_resumes_with_a_float_learning_rate_and_steps_as_before() -> None:
    """A GPU's default update (`GraphedUpdate`) leaves the optimiser's learning rate a tensor and its groups
    `capturable`; its checkpoint, read on the CPU, resumes as the plain fused Adam at the schedule's rate and
    steps exactly as the optimiser it was saved from would have."""
    config = _config(optimizer="adam", epsilon=1e-5, batch_size=2, policy_loss="ppo", lr_schedule="constant")
    model = _model()
    optimizer, scheduler = learner.make_optimizer(model, config)
    learner.update(model, optimizer, scheduler, _batch_for_update(model), (), config)
    state = LearnerState(model, optimizer, scheduler, ActorLives(0, 0), step=6, updates=1)
    saved = state.state_dict()
    for group in saved["optimizer_state_dict"]["param_groups"]:  # what a graphed run's optimiser holds
        group["lr"], group["capturable"] = torch.tensor(config.learning_rate), True
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    resumed_model = _model()
    resumed_optimizer, resumed_scheduler = learner.make_optimizer(resumed_model, config)
    resumed = LearnerState(resumed_model, resumed_optimizer, resumed_scheduler, ActorLives(0, 1))
    resumed.load_state_dict(torch.load(buffer, weights_only=True), config, Path("model.tar"))
    for group in resumed.optimizer.param_groups:
        assert group["capturable"] is False and group["lr"] == config.learning_rate and isinstance(group["lr"], float)
    learner.update(model, optimizer, scheduler, _batch_for_update(model), (), config)
    resumed_stats = learner.update(resumed.model, resumed.optimizer, resumed.scheduler,
                                   _batch_for_update(resumed.model), (), config)
    assert resumed_stats["skipped"] == 0.0 and resumed_stats["learning_rate"] == config.learning_rate
    for a, b in zip(model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_resumed_learner_cuts_its_batches_as_the_uninterrupted_one_would() -> None:
    """The minibatch orders come from torch's generator, which every session seeds from --seed afresh: the
    checkpoint keeps its state, so updates after a resume are the uninterrupted run's, bit for bit, where
    without it they replayed the first session's orders."""
    config = _config(optimizer="adam", epsilon=1e-5, batch_size=2, policy_loss="ppo", epochs=2, minibatches=3,
                     minibatch_mode="samples", lr_schedule="constant")
    model = _model()
    optimizer, scheduler = learner.make_optimizer(model, config)
    state = LearnerState(model, optimizer, scheduler, ActorLives(0, 0))
    learner.update(model, optimizer, scheduler, _batch_for_update(model), (), config)
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    for _ in range(2):
        learner.update(model, optimizer, scheduler, _batch_for_update(model), (), config)

    resumed_model = _model()  # seeds torch's generator, as each session's start does
    resumed = LearnerState(resumed_model, *learner.make_optimizer(resumed_model, config), ActorLives(0, 1))
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True), config, Path("model.tar"))
    for _ in range(2):
        learner.update(resumed.model, resumed.optimizer, resumed.scheduler, _batch_for_update(resumed.model), (),
                       config)
    for a, b in zip(model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_generator_state_of_another_device_or_none_leaves_the_seeded_stream_and_a_bad_one_is_one_line() -> None:
    """A GPU run's generator state means nothing to the CPU's generator (nor the other way): it is left, as a
    checkpoint without one is; one of this device that does not fit is the checkpoint's fault."""
    torch.manual_seed(5)
    seeded = torch.get_rng_state()
    cpu = torch.device("cpu")
    for saved in (None, {}, {"device": "cuda", "state": torch.zeros(16, dtype=torch.uint8)}):
        learner.load_orders_generator_state(saved, cpu, Path("model.tar"))
        assert torch.equal(torch.get_rng_state(), seeded)
    with pytest.raises(UserError, match=r"^checkpoint model.tar has a generator state that does not fit this run's "
                                        "cpu generator"):
        learner.load_orders_generator_state({"device": "cpu", "state": torch.zeros(3, dtype=torch.uint8)}, cpu,
                                            Path("model.tar"))
    saved = learner.orders_generator_state(cpu)
    drawn = torch.randperm(50)
    learner.load_orders_generator_state(saved, cpu, Path("model.tar"))
    assert torch.equal(torch.randperm(50), drawn)


def _resumed(saved_config: Config, config: Config) -> LearnerState:
    """A learner of `config` resumed from the checkpoint of one update under `saved_config`."""
    model = _model()
    optimizer, scheduler = learner.make_optimizer(model, saved_config)
    learner.update(model, optimizer, scheduler, _batch_for_update(model), (), saved_config)
    saved = {**LearnerState(model, optimizer, scheduler, ActorLives(0, 0), step=6, updates=1).state_dict(),
             "flags": saved_config.to_dict()}
    resumed_model = _model()
    resumed_optimizer, resumed_scheduler = learner.make_optimizer(resumed_model, config)
    resumed = LearnerState(resumed_model, resumed_optimizer, resumed_scheduler, ActorLives(0, 1))
    resumed.load_state_dict(saved, config, Path("model.tar"))
    return resumed


def test_a_checkpoint_saved_before_evaluation_seeds_were_counted_goes_on_past_those_its_evaluations_played() -> None:
    """Evaluation n (from 1) played the seeds n x --eval_episodes on, before their count was kept: a resume from
    such a checkpoint must not play its evaluations' games again."""
    config = _config()
    model = _model()
    optimizer, scheduler = learner.make_optimizer(model, config)
    saved = LearnerState(model, optimizer, scheduler, ActorLives(0, 0), step=6, updates=1, evaluations=3).state_dict()
    del saved["eval_seeds_used"]
    for flags, used in (({"eval_episodes": 5}, 20), ({}, 4 * config.eval_episodes)):
        resumed_model = _model()
        resumed = LearnerState(resumed_model, *learner.make_optimizer(resumed_model, config), ActorLives(0, 1))
        resumed.load_state_dict({**saved, "flags": flags}, config, Path("model.tar"))
        assert (resumed.evaluations, resumed.eval_seeds_used) == (3, used)


def test_a_resume_with_another_optimizer_starts_it_afresh() -> None:
    """An Adam run resumed with --optimizer rmsprop: Adam's moments fit no RMSprop (its first step failed with
    KeyError 'square_avg'), so the optimiser starts afresh, with a warning, and the weights are the run's."""
    config = _config(optimizer="rmsprop", batch_size=2)
    resumed = _resumed(_config(optimizer="adam", epsilon=1e-5, batch_size=2), config)
    assert resumed.optimizer_trained_with == "adam"  # the run's start says so
    assert resumed.optimizer.state_dict()["state"] == {} and resumed.step == 6
    stats = learner.update(resumed.model, resumed.optimizer, resumed.scheduler, _batch_for_update(resumed.model),
                           (), config)
    assert stats["skipped"] == 0.0
    assert all(float(state["step"]) == 1 for state in resumed.optimizer.state.values())


def test_a_resume_takes_the_optimizers_settings_from_the_flags_given_now() -> None:
    """Epsilon, alpha and momentum are the new flags', not the checkpoint's (which loading an optimiser state
    brings back), and momentum turned on at a resume gets its buffer as RMSprop's first step would."""
    config = _config(optimizer="rmsprop", batch_size=2, epsilon=0.1, alpha=0.9, momentum=0.5)
    resumed = _resumed(_config(optimizer="rmsprop", batch_size=2, epsilon=0.01, alpha=0.99, momentum=0.0), config)
    group = resumed.optimizer.param_groups[0]
    assert (group["eps"], group["alpha"], group["momentum"]) == (0.1, 0.9, 0.5)
    stats = learner.update(resumed.model, resumed.optimizer, resumed.scheduler, _batch_for_update(resumed.model),
                           (), config)
    assert stats["skipped"] == 0.0
    assert all(state["momentum_buffer"].abs().sum() > 0 for state in resumed.optimizer.state.values())


@pytest.mark.parametrize(("use_lstm", "advantage_norm", "minibatch_mode"),
                         [(False, "minibatch", "unrolls"), (True, "batch", "unrolls"), (False, "minibatch", "samples")])
@pytest.mark.usefixtures("cpp_compiler")
def test_the_compiled_step_equals_the_eager_step(use_lstm: bool, advantage_norm: str, minibatch_mode: str) -> None:
    """`--compile`: the loss (forward, V-trace, PPO) and its backward compiled as one region. Two batches of
    2 passes x 2 minibatches with Adam leave the weights and stats the eager step leaves, to float error
    (the compiler fuses, so it rounds differently); also with the whole batch's advantage moments handed in."""
    config = _config(batch_size=4, policy_loss="ppo", optimizer="adam", epsilon=1e-5, learning_rate=0.01,
                     minibatches=2, epochs=2, use_lstm=use_lstm, compile=True, advantage_norm=advantage_norm,
                     minibatch_mode=minibatch_mode)
    eager_model = _model(use_lstm)
    compiled_model = copy.deepcopy(eager_model)
    loss_fn = learner.loss_function(config, torch.device("cpu"))
    assert loss_fn not in (learner.compute_loss, learner.compute_sample_loss)
    eager_loss = learner.compute_sample_loss if minibatch_mode == "samples" else learner.compute_loss
    assert learner.loss_function(dataclasses.replace(config, compile=False), torch.device("cpu")) is eager_loss
    eager, eager_schedule = learner.make_optimizer(eager_model, config)
    compiled, compiled_schedule = learner.make_optimizer(compiled_model, config)
    core_state = eager_model.initial_state(4)
    for seed in range(2):
        batch = _batch(eager_model, rewards=[[1.0, 0.0, 0.5, -1.0], [0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 2.0]],
                       dones=[[False, False, True, False], [True, False, False, False], [False, False, False, True]],
                       actions=[[0, 1, 2, 0], [1, 2, 0, 1], [2, 0, 1, 1]], off_policy=True)
        torch.manual_seed(seed)  # the same minibatch order for both
        eager_stats = learner.update(eager_model, eager, eager_schedule, batch, core_state, config)
        torch.manual_seed(seed)
        compiled_stats = learner.update(compiled_model, compiled, compiled_schedule, batch, core_state, config,
                                        loss_fn=loss_fn)
        assert compiled_stats == pytest.approx(eager_stats, rel=1e-4, abs=1e-6)
    for (name, a), b in zip(eager_model.named_parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)
    assert any(not torch.equal(a, b) for a, b in zip(eager_model.parameters(), _model(use_lstm).parameters()))


@pytest.mark.parametrize("first", [True, False])  # the optimiser's state made by the pass itself, or already there
def test_an_update_with_every_step_skipped_changes_nothing(first: bool) -> None:
    """`GraphedUpdate`'s warm-up runs the whole update with `skip_all` set before capturing it: every step is
    computed and fused Adam applies none, so weights, moments and step counts stay bit for bit."""
    config = _config(batch_size=2, optimizer="adam", learning_rate=0.01, minibatches=2, epochs=2,
                     policy_loss="ppo", lr_schedule="constant")
    model = _model()
    optimizer, scheduler = learner.make_optimizer(model, config)
    if not first:
        learner.update(model, optimizer, scheduler, _batch_for_update(model), (), config)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    state_before = copy.deepcopy(optimizer.state_dict()["state"])
    orders = learner.draw_orders(2, config, torch.device("cpu"))
    names, sums = learner._update_steps(model, optimizer, _batch_for_update(model), (), orders, config, False, None,
                                        learner.compute_loss, skip_all=torch.ones(()))
    stats = dict(zip(names, sums.tolist(), strict=True))
    assert stats["skipped"] == 0.0 and stats["grad_norm"] > 0  # finite steps, computed, each one not applied
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
    state_after = optimizer.state_dict()["state"]
    assert len(state_after) == len(before)
    for index, values in state_after.items():
        for key, value in values.items():
            expected = state_before[index][key] if not first else torch.zeros_like(value)
            assert torch.equal(value, expected), (index, key)
    # With skip_all at 0 the same pass applies its steps, as `update` does from the same orders.
    reference = copy.deepcopy(model)
    reference_optimizer, reference_scheduler = learner.make_optimizer(reference, config)
    reference_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # else they share moments
    torch.manual_seed(3)
    learner.update(reference, reference_optimizer, reference_scheduler, _batch_for_update(model), (), config)
    torch.manual_seed(3)
    orders = learner.draw_orders(2, config, torch.device("cpu"))
    learner._update_steps(model, optimizer, _batch_for_update(model), (), orders, config, False, None,
                          learner.compute_loss, skip_all=torch.zeros(()))
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name
        assert not torch.equal(a, before[name]), name


def test_the_learner_graphs_its_updates_on_a_gpu_with_adam_unless_told_not_to() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    graphed = parse_config([])
    assert learner.uses_cuda_graph(graphed, cuda)
    assert isinstance(learner.update_function(graphed, cuda), learner.GraphedUpdate)
    assert not learner.uses_cuda_graph(parse_config(["--no-cuda_graph"]), cuda)
    assert not learner.uses_cuda_graph(dataclasses.replace(graphed, optimizer="rmsprop"), cuda)  # skips on the host
    assert not learner.uses_cuda_graph(graphed, cpu)
    assert learner.update_function(graphed, cpu) is learner.update
    assert learner.update_function(graphed, cuda, world_size=2) is learner.update  # torchrun: every step all-reduces


def test_the_reported_learning_rate_is_the_schedules_without_reading_the_optimiser() -> None:
    config = _config(learning_rate=0.01, total_steps=24, batch_size=2)
    optimizer, scheduler = learner.make_optimizer(_model(), config)
    for group in optimizer.param_groups:  # as GraphedUpdate leaves it: a tensor the schedule fills
        group["lr"] = torch.tensor(group["lr"])
    for expected in (0.01, 0.0075, 0.005):
        assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(expected)
        optimizer.param_groups[0]["lr"].fill_(float("nan"))  # what a read of the optimiser would now report
        assert learner.scheduled_lr(scheduler) == pytest.approx(expected)
        scheduler.step()


def test_torch_compiles_cuda_graphs_of_its_own_only_where_the_update_is_not_one_of_ours() -> None:
    """Central inference serves without graphs where torch.compile captures its own (`cudagraphs`)."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert learner.compiles_cuda_graphs(Config(compile=True, optimizer="rmsprop"), cuda)
    assert learner.compiles_cuda_graphs(Config(compile=True, cuda_graph=False), cuda)
    assert learner.compiles_cuda_graphs(Config(compile=True), cuda, world_size=2)  # torchrun: no graph of ours
    assert not learner.compiles_cuda_graphs(Config(compile=True), cuda)  # compiled inside our graph of the update
    assert not learner.compiles_cuda_graphs(Config(optimizer="rmsprop"), cuda)
    assert not learner.compiles_cuda_graphs(Config(compile=True, optimizer="rmsprop"), cpu)
