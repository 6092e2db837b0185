"""The three IMPALA losses, summed over time and batch as in the paper. Inputs are [T, B]."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def policy_gradient_loss(logits: torch.Tensor, actions: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """-sum_t,b log pi(a_t|x_t) * A_t, with the advantages treated as constants. logits [T, B, A]."""
    cross_entropy = F.cross_entropy(logits.flatten(0, 1), actions.flatten(), reduction="none")
    return (cross_entropy.view_as(advantages) * advantages.detach()).sum()


def baseline_loss(vs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """0.5 * sum (vs - V)^2 with the V-trace targets vs treated as constants."""
    return 0.5 * ((vs.detach() - values) ** 2).sum()


def entropy_loss(logits: torch.Tensor) -> torch.Tensor:
    """sum pi log pi: the negative entropy, so adding it (times a positive cost) rewards exploration."""
    policy = F.softmax(logits, dim=-1)
    log_policy = F.log_softmax(logits, dim=-1)
    return (policy * log_policy).sum()


def ppo_loss(log_rhos: torch.Tensor, advantages: torch.Tensor, clip: float, dual_clip: float = 0.0,
             moments: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, averaged: -mean min(r A, clip(r, 1 - c, 1 + c) A), r = pi/mu = exp(log_rhos),
    with the advantages normalised to mean 0 and standard deviation 1 over the batch and held constant.

    `dual_clip` > 1 also bounds the loss of a negative advantage by dual_clip * A (dual-clip PPO, Ye et al.
    2020): an action the behaviour policy rarely took, now likely, gets a bounded push instead of r A with
    r in the hundreds. `moments`, when given, is the mean and standard deviation to normalise with (those of
    a whole batch, or of several learner processes' advantages together). Returns the loss and the fraction of ratios
    outside [1 - c, 1 + c].
    """
    advantages = advantages.detach()
    mean, std = moments if moments is not None else (advantages.mean(), advantages.std())
    advantages = (advantages - mean) / (std + 1e-8)
    ratio = log_rhos.exp()
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    if dual_clip > 1:
        surrogate = torch.where(advantages < 0, torch.maximum(surrogate, dual_clip * advantages), surrogate)
    clipped = ((ratio - 1).abs() > clip).float().mean()
    return -surrogate.mean(), clipped.detach()
