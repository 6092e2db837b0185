"""Atari-5 arithmetic: human-normalised scores and the predicted Atari-57 median, with the reference numbers.

Atari-5 (Aitchison, Sweetser and Hutter, 2022, arXiv:2210.02019) predicts the median human-normalised score
over the 57 Atari games from five of them. For each game the normalised score, in percent, is

    x = 100 * (score - random) / (human - random)

and the prediction is a linear regression without intercept on log10(1 + max(x, 0)), mapped back:

    median_57 ~= 10 ** (sum_g w_g * log10(1 + max(x_g, 0))) - 1

Where every number comes from (docs/atari5.md says more):

- random, human: `Atari-Human.csv`, columns Random and Human, of github.com/maitchison/Atari-5 at commit
  118cad542c94bc6e57181bb259a17d020e0a330f (the scores the paper's regression was fitted with; its
  `atari5.py` normalises with exactly these two columns). They are the usual DQN/Agent57 table values.
- w_g: `AtariScoreNormalizer.SUBSETS["Atari_5"]` in `tools/plot_util.py` of github.com/maitchison/PPO (the
  first author's training code) at commit d3e3228252b87bb9b0e5ea6f29329db01287439e. The form (log10(1 + x),
  x clipped at 0, no intercept, 10**y - 1 back) is `transform`, `inv_transform` and `USE_INTERCEPT = False`
  in the Atari-5 repository's `atari5.py`, and `subset_score` in the same plot_util.py.
- CleanRL PPO: `docs/benchmark/ppo_atari_envpool_xla_jax.md` of github.com/vwxyzjn/cleanrl at commit
  fe8d8a03c41a7ef5b523e2e354bd01c363e786bb: `ppo_atari_envpool_xla_jax.py` at its defaults, 10M agent
  steps (40M frames), envpool `*-v5`, 3 seeds, mean +- std of `charts/avg_episodic_return` (full games,
  unclipped), as openrlbenchmark computed them for that table.

Imports nothing from the package: level 0 in DESIGN.md's layers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

PAPER = ("Aitchison, Sweetser and Hutter (2022), Atari-5: Distilling the Arcade Learning Environment down to "
         "Five Games, arXiv:2210.02019")
REFERENCE_SCORES_SOURCE = ("github.com/maitchison/Atari-5 Atari-Human.csv (columns Random, Human) at "
                           "118cad542c94bc6e57181bb259a17d020e0a330f")
WEIGHTS_SOURCE = ("github.com/maitchison/PPO tools/plot_util.py AtariScoreNormalizer.SUBSETS['Atari_5'] at "
                  "d3e3228252b87bb9b0e5ea6f29329db01287439e")
CLEANRL_SOURCE = ("github.com/vwxyzjn/cleanrl docs/benchmark/ppo_atari_envpool_xla_jax.md at "
                  "fe8d8a03c41a7ef5b523e2e354bd01c363e786bb (3 seeds, 10M agent steps)")
RELATIVE_ERROR_PERCENT = 10.4  # the third entry of SUBSETS["Atari_5"]: cross-validated error of the prediction


@dataclass(frozen=True)
class Game:
    """One Atari-5 game: its env id here, its reference scores, its regression weight and CleanRL's score."""

    env_id: str
    name: str
    random: float
    human: float
    weight: float
    cleanrl_ppo: float  # mean over 3 seeds at 10M agent steps
    cleanrl_ppo_std: float  # spread over those seeds


GAMES: tuple[Game, ...] = (
    Game("BattleZoneNoFrameskip-v4", "Battle Zone", 2360.0, 37187.5, 0.3819751237831753, 24283.75, 1841.94),
    Game("DoubleDunkNoFrameskip-v4", "Double Dunk", -18.55, -16.4, 0.0679099488887574, -6.81, 0.24),
    Game("NameThisGameNoFrameskip-v4", "Name This Game", 2292.35, 8049.0, 0.310804148620847, 5750.00, 181.32),
    Game("PhoenixNoFrameskip-v4", "Phoenix", 761.4, 7242.6, 0.12412619402774641, 14474.11, 1794.83),
    Game("QbertNoFrameskip-v4", "Q*bert", 163.88, 13455.0, 0.08048518286466755, 17246.27, 605.40),
)
BY_ENV = {game.env_id: game for game in GAMES}


def game(env_id: str) -> Game:
    """The Atari-5 game of `env_id`; KeyError naming the five for any other id."""
    try:
        return BY_ENV[env_id]
    except KeyError:
        raise KeyError(f"{env_id!r} is not an Atari-5 game ({', '.join(BY_ENV)})") from None


def normalised(env_id: str, score: float) -> float:
    """Human-normalised score in percent: 0 plays like random, 100 like the human reference."""
    g = game(env_id)
    return 100.0 * (score - g.random) / (g.human - g.random)


def predicted_median(normalised_scores: Mapping[str, float]) -> float:
    """Atari-5's estimate of the Atari-57 median normalised score (percent) from the five normalised scores
    (percent, keyed by env id). Scores below 0 count as 0, as in the fit. KeyError when a game is missing."""
    missing = [env_id for env_id in BY_ENV if env_id not in normalised_scores]
    if missing:
        raise KeyError(f"Atari-5 needs all five games; missing {', '.join(missing)}")
    log_median = sum(g.weight * math.log10(1.0 + max(normalised_scores[g.env_id], 0.0)) for g in GAMES)
    return 10.0 ** log_median - 1.0


def cleanrl_predicted_median() -> float:
    """The Atari-5 prediction from CleanRL's five published PPO scores."""
    return predicted_median({g.env_id: normalised(g.env_id, g.cleanrl_ppo) for g in GAMES})
