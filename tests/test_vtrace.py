"""Tests for impala.vtrace against a slow NumPy reference written from the paper.

The reference evaluates eq. (1) of Espeholt et al. (2018) term by term:

    v_s = V(x_s) + sum_{t=s}^{T-1} (prod_{k=s}^{t-1} gamma_k)
                                  (prod_{i=s}^{t-1} c_i) delta_t V
    delta_t V = rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t))

with rho_t = min(rho_bar, pi/mu), c_i = lambda * min(c_bar, pi/mu) and
V(x_T) = bootstrap_value. Two departures from the printed formula, both matching
scalable_agent/TorchBeast:

* gamma^{t-s} becomes the product of the per-step discounts, so a zero discount
  (end of episode) cuts everything after it;
* lambda < 1 is folded into the trace coefficients, c_i = lambda * min(c_bar, rho_i),
  with c_bar = 1.

It uses explicit loops and no recursion, so it shares no structure with the
backward recursion in the implementation.
"""

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

from impala import vtrace

ATOL = 1e-4
B = 4
# Importance ratios placed at t = 0 of every sequence so that even T = 1 crosses
# every threshold used below (0.5, 1.0, 2.0): two below 1, two above, one above 2.
FIXED_RHOS = np.array([0.1, 0.7, 1.5, 3.0])
THRESHOLDS = [
    (1.0, 1.0),
    (0.5, 2.0),
    (2.0, 0.5),
    (None, None),
    (None, 1.0),
    (1.0, None),
]


def reference_vtrace(
    log_rhos: np.ndarray,
    discounts: np.ndarray,
    rewards: np.ndarray,
    values: np.ndarray,
    bootstrap_value: np.ndarray,
    clip_rho_threshold: float | None,
    clip_pg_rho_threshold: float | None,
    lambda_: float,
    clip_c_threshold: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Eq. (1) summed directly; returns (vs, pg_advantages), each [T, B]."""
    num_steps, batch = values.shape
    rhos = np.exp(log_rhos)
    vs = np.zeros((num_steps, batch))
    pg_advantages = np.zeros((num_steps, batch))
    for b in range(batch):
        # V(x_0), ..., V(x_{T-1}), V(x_T) = bootstrap.
        v_ext = [float(v) for v in values[:, b]] + [float(bootstrap_value[b])]
        for s in range(num_steps):
            total = 0.0
            for t in range(s, num_steps):
                weight = 1.0
                for i in range(s, t):
                    c_i = lambda_ * min(clip_c_threshold, rhos[i, b])
                    weight *= discounts[i, b] * c_i
                rho_t = rhos[t, b]
                if clip_rho_threshold is not None:
                    rho_t = min(clip_rho_threshold, rho_t)
                delta_t = rho_t * (
                    rewards[t, b] + discounts[t, b] * v_ext[t + 1] - v_ext[t]
                )
                total += weight * delta_t
            vs[s, b] = v_ext[s] + total
        for s in range(num_steps):
            v_next = vs[s + 1, b] if s + 1 < num_steps else v_ext[num_steps]
            rho_s = rhos[s, b]
            if clip_pg_rho_threshold is not None:
                rho_s = min(clip_pg_rho_threshold, rho_s)
            pg_advantages[s, b] = rho_s * (
                rewards[s, b] + discounts[s, b] * v_next - v_ext[s]
            )
    return vs, pg_advantages


def make_inputs(num_steps: int, seed: int) -> dict[str, np.ndarray]:
    """Random float64 [T, B] inputs: rhos spread over ~0.05..7, episode ends inside."""
    rng = np.random.default_rng(seed)
    log_rhos = rng.uniform(-3.0, 2.0, size=(num_steps, B))
    log_rhos[0] = np.log(FIXED_RHOS)
    discounts = np.full((num_steps, B), 0.95)
    discounts[rng.random((num_steps, B)) < 0.15] = 0.0
    if num_steps >= 3:
        # A guaranteed episode end strictly inside the sequence.
        discounts[num_steps // 2, 0] = 0.0
    return {
        "log_rhos": log_rhos,
        "discounts": discounts,
        "rewards": rng.normal(size=(num_steps, B)),
        "values": rng.normal(size=(num_steps, B)),
        "bootstrap_value": rng.normal(size=(B,)),
    }


def to_torch(inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Wraps every array as a tensor of the same dtype (no copy)."""
    return {k: torch.from_numpy(v) for k, v in inputs.items()}


def run_vtrace(
    inputs: dict[str, np.ndarray], **kwargs: float | None
) -> tuple[np.ndarray, np.ndarray]:
    """Runs the implementation on float64 NumPy inputs; returns (vs, pg_advantages)."""
    out = vtrace.from_importance_weights(**to_torch(inputs), **kwargs)
    return out.vs.numpy(), out.pg_advantages.numpy()


@pytest.mark.parametrize("clip_rho, clip_pg_rho", THRESHOLDS)
@pytest.mark.parametrize("lambda_", [1.0, 0.5, 0.9])
@pytest.mark.parametrize("num_steps", [1, 2, 5, 17, 40])
def test_matches_paper_reference(
    num_steps: int, lambda_: float, clip_rho: float | None, clip_pg_rho: float | None
) -> None:
    inputs = make_inputs(num_steps, seed=num_steps)
    kwargs = {
        "clip_rho_threshold": clip_rho,
        "clip_pg_rho_threshold": clip_pg_rho,
        "lambda_": lambda_,
    }
    vs, pg = run_vtrace(inputs, **kwargs)
    ref_vs, ref_pg = reference_vtrace(**inputs, **kwargs)
    assert vs.shape == pg.shape == (num_steps, B)
    np.testing.assert_allclose(vs, ref_vs, rtol=0, atol=ATOL)
    np.testing.assert_allclose(pg, ref_pg, rtol=0, atol=ATOL)


@pytest.mark.parametrize("clip_rho, clip_pg_rho", THRESHOLDS)
def test_advantages_are_the_pg_advantages_before_their_rho_weight(
    clip_rho: float | None, clip_pg_rho: float | None
) -> None:
    """``advantages`` (PPO's) is r_s + gamma_s v_{s+1} - V(x_s) from the reference's vs, and
    ``pg_advantages`` is it times rho clipped at clip_pg_rho, whether or not that equals clip_rho."""
    inputs = make_inputs(17, seed=5)
    kwargs = {"clip_rho_threshold": clip_rho, "clip_pg_rho_threshold": clip_pg_rho, "lambda_": 0.9}
    out = vtrace.from_importance_weights(**to_torch(inputs), **kwargs)
    ref_vs, _ = reference_vtrace(**inputs, **kwargs)
    next_vs = np.concatenate([ref_vs[1:], inputs["bootstrap_value"][None]])
    expected = inputs["rewards"] + inputs["discounts"] * next_vs - inputs["values"]
    np.testing.assert_allclose(out.advantages.numpy(), expected, rtol=0, atol=ATOL)
    rhos = np.exp(inputs["log_rhos"])
    pg_rhos = rhos if clip_pg_rho is None else np.minimum(rhos, clip_pg_rho)
    assert (rhos > 1).any() and (rhos < 1).any()
    np.testing.assert_allclose(out.pg_advantages.numpy(), pg_rhos * expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("lambda_", [1.0, 0.5, 0.9])
def test_float32_matches_reference(lambda_: float) -> None:
    inputs = make_inputs(40, seed=7)
    out = vtrace.from_importance_weights(
        **{k: v.float() for k, v in to_torch(inputs).items()}, lambda_=lambda_
    )
    assert out.vs.dtype == out.pg_advantages.dtype == torch.float32
    ref_vs, ref_pg = reference_vtrace(
        **inputs, clip_rho_threshold=1.0, clip_pg_rho_threshold=1.0, lambda_=lambda_
    )
    np.testing.assert_allclose(out.vs.numpy(), ref_vs, rtol=0, atol=ATOL)
    np.testing.assert_allclose(out.pg_advantages.numpy(), ref_pg, rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    "wrong",
    [
        {"lambda_": 0.9},
        {"clip_rho_threshold": 2.0},
        {"clip_pg_rho_threshold": 2.0},
        {"clip_c_threshold": 2.0},
    ],
    ids=["lambda", "clip_rho", "clip_pg_rho", "clip_c"],
)
def test_reference_comparison_can_fail(wrong: dict[str, float]) -> None:
    """Perturbing any one setting moves the result well beyond the tolerance."""
    inputs = make_inputs(17, seed=17)
    right = {"clip_rho_threshold": 1.0, "clip_pg_rho_threshold": 1.0, "lambda_": 0.5}
    vs, pg = run_vtrace(inputs, **right)
    ref_vs, ref_pg = reference_vtrace(**inputs, **{**right, **wrong})
    gap = max(np.abs(vs - ref_vs).max(), np.abs(pg - ref_pg).max())
    assert gap > 100 * ATOL


def test_ignoring_episode_end_would_differ() -> None:
    inputs = make_inputs(17, seed=17)
    assert (inputs["discounts"] == 0.0).any()
    vs, _ = run_vtrace(inputs)
    no_ends = {
        **inputs,
        "discounts": np.where(inputs["discounts"] == 0.0, 0.95, inputs["discounts"]),
    }
    ref_vs, _ = reference_vtrace(
        **no_ends, clip_rho_threshold=1.0, clip_pg_rho_threshold=1.0, lambda_=1.0
    )
    assert np.abs(vs - ref_vs).max() > 100 * ATOL


def test_zero_discount_cuts_the_trace() -> None:
    """Nothing after an episode end may leak into the targets before it."""
    inputs = make_inputs(9, seed=3)
    inputs["discounts"][:, 1] = 0.9
    inputs["discounts"][4, 1] = 0.0
    vs, pg = run_vtrace(inputs)
    changed = {k: v.copy() for k, v in inputs.items()}
    changed["rewards"][5:, 1] += 10.0
    changed["values"][5:, 1] -= 10.0
    changed["bootstrap_value"][1] += 10.0
    vs2, pg2 = run_vtrace(changed)
    np.testing.assert_array_equal(vs[:5, 1], vs2[:5, 1])
    np.testing.assert_array_equal(pg[:5, 1], pg2[:5, 1])
    assert np.abs(vs[5:, 1] - vs2[5:, 1]).min() > 1.0


def test_on_policy_is_n_step_return() -> None:
    """With pi == mu and lambda = 1, v_s is the discounted return bootstrapped at T."""
    inputs = make_inputs(6, seed=5)
    inputs["log_rhos"] = np.zeros_like(inputs["log_rhos"])
    vs, pg = run_vtrace(inputs)
    ret = inputs["bootstrap_value"].copy()
    for t in reversed(range(6)):
        ret = inputs["rewards"][t] + inputs["discounts"][t] * ret
        np.testing.assert_allclose(vs[t], ret, rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        pg[:-1],
        inputs["rewards"][:-1]
        + inputs["discounts"][:-1] * vs[1:]
        - inputs["values"][:-1],
        rtol=0,
        atol=1e-12,
    )


@pytest.mark.parametrize(
    "lambda_, expected_vs, expected_pg",
    [(1.0, [2.46, 3.8], [1.96, 2.8]), (0.5, [1.83, 3.8], [1.96, 2.8])],
)
def test_hand_computed(
    lambda_: float, expected_vs: list[float], expected_pg: list[float]
) -> None:
    # T = 2, B = 1, rho = (0.5, 2.0), r = (1, 2), gamma = (0.9, 0.9), V = (0.5, 1.0),
    # bootstrap V(x_2) = 2.0, rho_bar = pg_rho_bar = 1.
    #   clipped rho = (0.5, 1.0); c = lambda * (0.5, 1.0)
    #   delta_0 = 0.5 * (1 + 0.9 * 1.0 - 0.5) = 0.7
    #   delta_1 = 1.0 * (2 + 0.9 * 2.0 - 1.0) = 2.8
    #   v_1 = 1.0 + 2.8 = 3.8
    #   v_0 = 0.5 + 0.7 + 0.9 * c_0 * 2.8  = 2.46 (lambda = 1, c_0 = 0.5)
    #                                      = 1.83 (lambda = 0.5, c_0 = 0.25)
    #   pg_0 = 0.5 * (1 + 0.9 * 3.8 - 0.5) = 1.96
    #   pg_1 = 1.0 * (2 + 0.9 * 2.0 - 1.0) = 2.8
    out = vtrace.from_importance_weights(
        log_rhos=torch.tensor([[math.log(0.5)], [math.log(2.0)]], dtype=torch.float64),
        discounts=torch.tensor([[0.9], [0.9]], dtype=torch.float64),
        rewards=torch.tensor([[1.0], [2.0]], dtype=torch.float64),
        values=torch.tensor([[0.5], [1.0]], dtype=torch.float64),
        bootstrap_value=torch.tensor([2.0], dtype=torch.float64),
        lambda_=lambda_,
    )
    np.testing.assert_allclose(out.vs[:, 0].numpy(), expected_vs, rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        out.pg_advantages[:, 0].numpy(), expected_pg, rtol=0, atol=1e-12
    )


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_action_log_probs() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, B, 6))
    actions = rng.integers(0, 6, size=(5, B))
    got = vtrace.action_log_probs(torch.from_numpy(logits), torch.from_numpy(actions))
    expected = np.take_along_axis(np_log_softmax(logits), actions[..., None], axis=-1)[
        ..., 0
    ]
    assert got.shape == (5, B)
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("lambda_", [1.0, 0.9])
def test_from_logits(lambda_: float) -> None:
    num_steps, num_actions = 17, 5
    rng = np.random.default_rng(11)
    inputs = make_inputs(num_steps, seed=11)
    del inputs["log_rhos"]
    behaviour_logits = rng.normal(scale=2.0, size=(num_steps, B, num_actions))
    target_logits = rng.normal(scale=2.0, size=(num_steps, B, num_actions))
    actions = rng.integers(0, num_actions, size=(num_steps, B))

    out = vtrace.from_logits(
        behaviour_policy_logits=torch.from_numpy(behaviour_logits),
        target_policy_logits=torch.from_numpy(target_logits),
        actions=torch.from_numpy(actions),
        lambda_=lambda_,
        **to_torch(inputs),
    )

    def taken(logits: np.ndarray) -> np.ndarray:
        return np.take_along_axis(np_log_softmax(logits), actions[..., None], axis=-1)[
            ..., 0
        ]

    log_mu, log_pi = taken(behaviour_logits), taken(target_logits)
    log_rhos = log_pi - log_mu
    # The random policies must give ratios on both sides of the clipping threshold.
    assert (log_rhos < 0).any() and (log_rhos > 0).any()
    np.testing.assert_allclose(
        out.behaviour_action_log_probs.numpy(), log_mu, rtol=0, atol=1e-12
    )
    np.testing.assert_allclose(
        out.target_action_log_probs.numpy(), log_pi, rtol=0, atol=1e-12
    )
    np.testing.assert_allclose(out.log_rhos.numpy(), log_rhos, rtol=0, atol=1e-12)
    ref_vs, ref_pg = reference_vtrace(
        log_rhos=log_rhos,
        **inputs,
        clip_rho_threshold=1.0,
        clip_pg_rho_threshold=1.0,
        lambda_=lambda_,
    )
    np.testing.assert_allclose(out.vs.detach().numpy(), ref_vs, rtol=0, atol=ATOL)
    np.testing.assert_allclose(
        out.pg_advantages.detach().numpy(), ref_pg, rtol=0, atol=ATOL
    )


def test_outputs_carry_no_gradient() -> None:
    num_steps, num_actions = 5, 3
    inputs = {
        k: v.clone().requires_grad_()
        for k, v in to_torch(make_inputs(num_steps, 1)).items()
    }
    out = vtrace.from_importance_weights(**inputs)
    for tensor in out:
        assert not tensor.requires_grad and tensor.grad_fn is None

    del inputs["log_rhos"]
    target_logits = torch.randn(
        num_steps, B, num_actions, dtype=torch.float64, requires_grad=True
    )
    out = vtrace.from_logits(
        behaviour_policy_logits=torch.randn(
            num_steps, B, num_actions, dtype=torch.float64
        ),
        target_policy_logits=target_logits,
        actions=torch.randint(0, num_actions, (num_steps, B)),
        **inputs,
    )
    assert not out.vs.requires_grad and not out.pg_advantages.requires_grad
    # The target log-probs stay differentiable: they feed the policy-gradient loss.
    assert out.target_action_log_probs.requires_grad
    out.target_action_log_probs.sum().backward()
    assert target_logits.grad is not None and target_logits.grad.abs().sum() > 0


def loop_discounted_sums(deltas: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """The backward recursion acc_t = deltas_t + coefficients_t * acc_{t+1}, one time step at a time."""
    acc = torch.zeros_like(deltas[0])
    out = torch.empty_like(deltas)
    for t in reversed(range(deltas.shape[0])):
        acc = deltas[t] + coefficients[t] * acc
        out[t] = acc
    return out


@pytest.mark.parametrize("sums", [vtrace._matrix_sums, vtrace._doubling_sums], ids=["matrix", "doubling"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_steps", [1, 2, 32, 80, 200])
def test_closed_form_sums_equal_the_recursion(num_steps: int, dtype: torch.dtype, sums: Callable[..., torch.Tensor]
                                              ) -> None:
    """Both ways `discounted_sums` forms the sums: from a matrix of discount products (on a GPU), and by doubling."""
    generator = torch.Generator().manual_seed(num_steps)
    batch = 64
    deltas = torch.randn(num_steps, batch, generator=generator, dtype=dtype) * 3
    # gamma * c as the learner forms it: gamma 0.99, c = min(1, rho), episode ends as exact zeros.
    rhos = torch.exp(torch.empty(num_steps, batch, dtype=dtype).uniform_(-3, 2, generator=generator))
    coefficients = 0.99 * rhos.clamp(max=1.0)
    coefficients[torch.rand(num_steps, batch, generator=generator) < 0.05] = 0.0
    coefficients[:, 0] = 0.99  # one column that never ends: the longest products
    out = sums(deltas, coefficients)
    assert out.dtype == dtype and out.shape == (num_steps, batch)
    torch.testing.assert_close(out, loop_discounted_sums(deltas, coefficients), rtol=0, atol=1e-5)


def test_the_sums_are_a_matrix_off_the_cpu_up_to_its_size_and_a_scan_by_doubling_on_it() -> None:
    assert vtrace.as_matrix(torch.empty(80, 32, device="meta"))  # 204,800 elements
    assert not vtrace.as_matrix(torch.empty(80, 32))
    steps = int(vtrace.MATRIX_ELEMENTS ** 0.5)
    assert vtrace.as_matrix(torch.empty(steps, 1, device="meta"))
    assert not vtrace.as_matrix(torch.empty(steps + 1, 1, device="meta"))


@pytest.mark.parametrize("sums", [vtrace._matrix_sums, vtrace._doubling_sums], ids=["matrix", "doubling"])
def test_closed_form_sums_by_hand(sums: Callable[..., torch.Tensor]) -> None:
    deltas = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    coefficients = torch.tensor([[0.5], [0.0], [0.5], [0.5]])  # the trace is cut after t = 1
    # acc_3 = 4; acc_2 = 3 + 0.5 * 4 = 5; acc_1 = 2 + 0 * 5 = 2; acc_0 = 1 + 0.5 * 2 = 2
    torch.testing.assert_close(sums(deltas, coefficients), torch.tensor([[2.0], [2.0], [5.0], [4.0]]), rtol=0, atol=0)


@pytest.mark.parametrize("matrix", [True, False], ids=["matrix", "doubling"])
@pytest.mark.parametrize("lambda_", [1.0, 0.95])
def test_from_importance_weights_equals_the_loop_at_learner_shapes(lambda_: float, matrix: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 at the learner's shapes ([T=80, B=32]), against the recursion written out in the test, with the sums
    as a GPU forms them and as the CPU does."""
    monkeypatch.setattr(vtrace, "as_matrix", lambda deltas: matrix)
    generator = torch.Generator().manual_seed(7)
    num_steps, batch = 80, 32
    log_rhos = torch.empty(num_steps, batch).uniform_(-2, 1, generator=generator)
    discounts = 0.99 * (torch.rand(num_steps, batch, generator=generator) > 0.02).float()
    rewards = torch.randn(num_steps, batch, generator=generator).clamp(-1, 1)
    values = torch.randn(num_steps, batch, generator=generator) * 5
    bootstrap_value = torch.randn(batch, generator=generator) * 5
    out = vtrace.from_importance_weights(log_rhos, discounts, rewards, values, bootstrap_value, lambda_=lambda_)
    rhos = log_rhos.exp()
    next_values = torch.cat([values[1:], bootstrap_value[None]])
    deltas = rhos.clamp(max=1) * (rewards + discounts * next_values - values)
    vs = values + loop_discounted_sums(deltas, discounts * lambda_ * rhos.clamp(max=1))
    next_vs = torch.cat([vs[1:], bootstrap_value[None]])
    torch.testing.assert_close(out.vs, vs, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.pg_advantages, rhos.clamp(max=1) * (rewards + discounts * next_vs - values),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(out.advantages, rewards + discounts * next_vs - values, rtol=0, atol=1e-5)
