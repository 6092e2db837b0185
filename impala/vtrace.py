"""V-trace off-policy actor-critic targets (Espeholt et al., 2018, "IMPALA", eq. 1).

All tensors are time-major: a leading time dimension ``T`` followed by the batch
dimension ``B``. The API follows scalable_agent / TorchBeast:

* ``from_importance_weights`` computes the V-trace value targets ``vs`` and the
  policy-gradient advantages from log importance weights.
* ``from_logits`` derives those log importance weights from behaviour and target
  policy logits and then calls ``from_importance_weights``.
* ``from_action_log_probs`` does the same from the log-probabilities of the
  actions taken, for a learner that computes the behaviour's once per batch.

Everything returned is a constant (computed under ``torch.no_grad()``): the
targets are regression targets / advantage weights, not something to
differentiate through.

Conventions for ``lambda_`` follow scalable_agent/TorchBeast: it multiplies the
truncated trace coefficients, ``c_t = lambda_ * min(1, rho_t)``.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F


class VTraceReturns(NamedTuple):
    """V-trace outputs.

    vs: [T, B] value targets v_s.
    pg_advantages: [T, B] advantages for the policy-gradient term,
        ``clipped_rho_s * (r_s + gamma_s * v_{s+1} - V(x_s))``.
    advantages: [T, B] the same before the rho weight, ``r_s + gamma_s * v_{s+1} - V(x_s)``:
        PPO's, whose clipped ratio does the importance weighting.
    """

    vs: torch.Tensor
    pg_advantages: torch.Tensor
    advantages: torch.Tensor


class VTraceFromLogitsReturns(NamedTuple):
    """V-trace outputs plus the log-probabilities used to form the importance weights.

    vs, pg_advantages, advantages: as in ``VTraceReturns``.
    log_rhos: [T, B] ``target_action_log_probs - behaviour_action_log_probs``.
    behaviour_action_log_probs: [T, B] log mu(a_t | x_t).
    target_action_log_probs: [T, B] log pi(a_t | x_t); keeps its autograd graph so
        it can be reused for the policy-gradient loss.
    """

    vs: torch.Tensor
    pg_advantages: torch.Tensor
    advantages: torch.Tensor
    log_rhos: torch.Tensor
    behaviour_action_log_probs: torch.Tensor
    target_action_log_probs: torch.Tensor


def action_log_probs(
    policy_logits: torch.Tensor, actions: torch.Tensor
) -> torch.Tensor:
    """Log-probabilities of the taken actions under a categorical policy.

    Args:
        policy_logits: [T, B, A] unnormalised logits.
        actions: [T, B] integer action indices in ``[0, A)``.

    Returns:
        [T, B] ``log softmax(policy_logits)[t, b, actions[t, b]]``. Differentiable
        with respect to ``policy_logits``.
    """
    # Negative cross-entropy == log-prob of the target class; flatten so that
    # nll_loss sees the usual [N, A] / [N] layout.
    return -F.nll_loss(
        F.log_softmax(torch.flatten(policy_logits, 0, -2), dim=-1),
        torch.flatten(actions),
        reduction="none",
    ).view_as(actions)


def from_logits(
    behaviour_policy_logits: torch.Tensor,
    target_policy_logits: torch.Tensor,
    actions: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
    lambda_: float = 1.0,
) -> VTraceFromLogitsReturns:
    """V-trace for softmax policies given as logits.

    Args:
        behaviour_policy_logits: [T, B, A] logits of the policy mu that acted.
        target_policy_logits: [T, B, A] logits of the policy pi being learned.
        actions: [T, B] actions taken by mu.
        discounts, rewards, values, bootstrap_value, clip_rho_threshold,
        clip_pg_rho_threshold, lambda_: see ``from_importance_weights``.

    Returns:
        ``VTraceFromLogitsReturns``. ``vs`` and ``pg_advantages`` carry no gradient;
        ``target_action_log_probs`` keeps the graph of ``target_policy_logits``.
    """
    return from_action_log_probs(
        behaviour_action_log_probs=action_log_probs(behaviour_policy_logits, actions),
        target_action_log_probs=action_log_probs(target_policy_logits, actions),
        discounts=discounts,
        rewards=rewards,
        values=values,
        bootstrap_value=bootstrap_value,
        clip_rho_threshold=clip_rho_threshold,
        clip_pg_rho_threshold=clip_pg_rho_threshold,
        lambda_=lambda_,
    )


def from_action_log_probs(
    behaviour_action_log_probs: torch.Tensor,
    target_action_log_probs: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
    lambda_: float = 1.0,
) -> VTraceFromLogitsReturns:
    """``from_logits`` from the log-probabilities of the actions taken (``action_log_probs``).

    Args:
        behaviour_action_log_probs: [T, B] log mu(a_t | x_t); a constant.
        target_action_log_probs: [T, B] log pi(a_t | x_t), with its graph if any.
        discounts, rewards, values, bootstrap_value, clip_rho_threshold,
        clip_pg_rho_threshold, lambda_: see ``from_importance_weights``.

    Returns:
        ``VTraceFromLogitsReturns``, as ``from_logits``'s.
    """
    log_rhos = target_action_log_probs - behaviour_action_log_probs
    vtrace_returns = from_importance_weights(
        log_rhos=log_rhos,
        discounts=discounts,
        rewards=rewards,
        values=values,
        bootstrap_value=bootstrap_value,
        clip_rho_threshold=clip_rho_threshold,
        clip_pg_rho_threshold=clip_pg_rho_threshold,
        lambda_=lambda_,
    )
    return VTraceFromLogitsReturns(
        log_rhos=log_rhos,
        behaviour_action_log_probs=behaviour_action_log_probs,
        target_action_log_probs=target_action_log_probs,
        **vtrace_returns._asdict(),
    )


# Off the CPU (on a GPU), up to this many elements in [T, T, B], `discounted_sums` forms its sums from a matrix of discount
# products (a few kernels, whatever T); beyond it (long unrolls: the matrix grows as T squared) and on the CPU it scans
# by doubling.
MATRIX_ELEMENTS = 1 << 22


def discounted_sums(deltas: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """``acc_t = deltas_t + coefficients_t * acc_{t+1}`` with ``acc_T = 0``, for every t at once.

    Two ways, equal to the loop to float rounding (tests/test_vtrace.py keeps the loop as the reference), and
    neither divides, so a zero coefficient (an episode end) cuts exactly. On a GPU, where a learner's gradient step
    is bound by the number of kernels it launches rather than by their arithmetic, `_matrix_sums` (about ten kernels
    whatever T); on the CPU, where the arithmetic is the cost, `_doubling_sums` (some 25 operations for T = 32, on
    T x B elements each). The choice is `as_matrix`'s.

    Args:
        deltas: [T, B].
        coefficients: [T, B], here ``gamma_t * c_t`` in [0, 1].

    Returns:
        [T, B] ``acc``.
    """
    return _matrix_sums(deltas, coefficients) if as_matrix(deltas) else _doubling_sums(deltas, coefficients)


def as_matrix(deltas: torch.Tensor) -> bool:
    """Whether `discounted_sums` uses `_matrix_sums` for `deltas` [T, B]: off the CPU, up to `MATRIX_ELEMENTS`."""
    steps = deltas.shape[0]
    return deltas.device.type != "cpu" and steps * steps * deltas[0].numel() <= MATRIX_ELEMENTS


def _matrix_sums(deltas: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """`discounted_sums` written out: ``acc_t = sum_{s >= t} w_{t,s} deltas_s``, with the weights
    ``w_{t,s} = coefficients_t ... coefficients_{s-1}`` (1 for s = t) [T, T, B] from one cumulative product along s."""
    steps = deltas.shape[0]
    ahead = torch.ones(steps, steps, dtype=torch.bool, device=deltas.device).triu()[..., None]  # [t, s, 1]: s >= t
    # [t, s]: coefficients_t ... coefficients_s along s >= t, 1 before t; then shifted one step later
    products = torch.where(ahead, coefficients[None], 1.0).cumprod(1)
    weights = F.pad(products[:, :-1], (0, 0, 1, 0), value=1.0)
    return torch.where(ahead, weights * deltas[None], 0.0).sum(1)


def _doubling_sums(deltas: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """`discounted_sums` as a scan by doubling, on the CPU and for long unrolls: before the round with ``span`` (1, 2, 4, ...),
    ``acc_t`` holds the recursion's sum over the window of steps ``t .. t + span - 1`` and ``factor_t`` the product
    of the coefficients over it; the round joins every window with the one after it, doubling the span.
    ceil(log2 T) rounds of a few whole-tensor operations, with memory linear in T."""
    acc, factor = deltas, coefficients
    span = 1
    while span < deltas.shape[0]:
        # Windows that reach past T have nothing after them: their sums stay, their factors no longer matter.
        acc = torch.cat([torch.addcmul(acc[:-span], factor[:-span], acc[span:]), acc[-span:]])
        factor = torch.cat([factor[:-span] * factor[span:], torch.zeros_like(factor[-span:])])
        span *= 2
    return acc


def _clip(rhos: torch.Tensor, threshold: float | None) -> torch.Tensor:
    """min(threshold, rho); `rhos` themselves without a threshold."""
    return rhos if threshold is None else torch.clamp(rhos, max=threshold)


@torch.no_grad()
def from_importance_weights(
    log_rhos: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
    lambda_: float = 1.0,
) -> VTraceReturns:
    """V-trace targets from log importance weights log(pi(a_t|x_t) / mu(a_t|x_t)).

    With ``rho_t = exp(log_rhos[t])``, ``rho_bar = clip_rho_threshold`` and
    ``c_t = lambda_ * min(1, rho_t)``:

        delta_t = min(rho_bar, rho_t) * (r_t + gamma_t * V(x_{t+1}) - V(x_t))
        v_t - V(x_t) = delta_t + gamma_t * c_t * (v_{t+1} - V(x_{t+1}))

    with ``V(x_T) = v_T = bootstrap_value``. This backward recursion is eq. (1) of
    the IMPALA paper with the n-step horizon running to the end of the sequence.

    Args:
        log_rhos: [T, B] log importance weights.
        discounts: [T, B] per-step discounts gamma_t; 0 where the episode ended at
            step t, which cuts both the bootstrap and the trace.
        rewards: [T, B] rewards r_t.
        values: [T, B] value estimates V(x_t).
        bootstrap_value: [B] value estimate V(x_T) after the last step.
        clip_rho_threshold: rho_bar for the value targets; ``None`` means no clipping.
        clip_pg_rho_threshold: clipping of rho in ``pg_advantages``; ``None`` means
            no clipping.
        lambda_: trace-cutting parameter in [0, 1], folded into c_t.

    Returns:
        ``VTraceReturns`` of [T, B] tensors that carry no gradient.
    """
    rhos = torch.exp(log_rhos)
    clipped_rhos = _clip(rhos, clip_rho_threshold)
    # The trace coefficients are always truncated at 1 (the paper's c_bar = 1).
    cs = lambda_ * (clipped_rhos if clip_rho_threshold == 1.0 else torch.clamp(rhos, max=1.0))

    # V(x_{t+1}) for every t: shift values by one and append the bootstrap.
    values_t_plus_1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)], dim=0)
    deltas = clipped_rhos * (rewards + discounts * values_t_plus_1 - values)

    # The backward recursion above, for every t at once.
    vs_minus_v_xs = discounted_sums(deltas, discounts * cs)
    vs = vs_minus_v_xs + values

    # Advantage for the policy gradient uses the V-trace target of the next state.
    vs_t_plus_1 = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)], dim=0)
    advantages = rewards + discounts * vs_t_plus_1 - values
    same_clip = clip_pg_rho_threshold == clip_rho_threshold
    clipped_pg_rhos = clipped_rhos if same_clip else _clip(rhos, clip_pg_rho_threshold)
    pg_advantages = clipped_pg_rhos * advantages

    return VTraceReturns(vs=vs, pg_advantages=pg_advantages, advantages=advantages)
