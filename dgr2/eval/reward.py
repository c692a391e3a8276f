"""The re-ranking reward RL optimises, defined once so training, tests and reports agree.

Why this shape (GR2 / Diffusion-GR2): the reward must pay for moving the target up, must never
pay for a broken ranking, and must not pay a policy for the cheapest valid output - echoing the
candidates in input order, the reward hack the GR2 work reports.  For one strict parse
(:func:`dgr2.eval.parse.parse_completion`, nothing repaired):

* invalid ranking (format error, duplicate, missing or out-of-set label): ``invalid_reward``
  (default -1);
* valid ranking: ``NDCG(target) + alpha * [ranking != input order]`` with
  ``NDCG = 1 / log2(rank + 2)`` over the whole list (rank 0-based) - the conditional format
  term ``alpha`` is earned only by a valid ranking that is *not* the identity permutation.

Reference values with ``alpha = 0.2`` and ten candidates: target first, not echoed -> 1.2;
identity order with the target first -> 1.0; target last, not echoed -> 1/log2(11) + 0.2 ~ 0.489;
any duplicate / missing / malformed output -> -1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dgr2.eval.parse import ParsedRanking, parse_completion


@dataclass(frozen=True)
class RewardConfig:
    invalid_reward: float = -1.0
    echo_alpha: float = 0.2

    def __post_init__(self) -> None:
        if self.invalid_reward > 0:
            raise ValueError(f"invalid_reward must be <= 0, got {self.invalid_reward}")
        if not 0.0 <= self.echo_alpha <= 1.0:
            raise ValueError(f"echo_alpha must be in [0, 1], got {self.echo_alpha}")


@dataclass(frozen=True)
class RewardBreakdown:
    reward: float
    valid: bool
    ndcg: float
    echoed: bool


def ranking_reward(parsed: ParsedRanking, target_index: int, cfg: RewardConfig = RewardConfig()) -> RewardBreakdown:
    """Reward of one strictly parsed ranking for a request whose target is ``target_index``."""
    if not 0 <= target_index < parsed.num_candidates:
        raise ValueError(f"target_index {target_index} outside 0..{parsed.num_candidates - 1}")
    return reward_of_ranking(parsed.valid, parsed.ranking, target_index, cfg)


def reward_of_ranking(
    valid: bool, ranking: Sequence[int], target_index: int, cfg: RewardConfig = RewardConfig()
) -> RewardBreakdown:
    """The reward of a ranking already checked for validity (e.g. a scored evaluation row).

    ``target_index`` -1 means the target is not among the candidates (an evaluation set may hold
    such requests): a valid ranking then earns no NDCG, only the format term."""
    if not valid:
        return RewardBreakdown(cfg.invalid_reward, False, 0.0, False)
    ranking = list(ranking)
    ndcg = 1.0 / math.log2(ranking.index(target_index) + 2) if target_index >= 0 else 0.0
    echoed = ranking == list(range(len(ranking)))
    return RewardBreakdown(ndcg + (0.0 if echoed else cfg.echo_alpha), True, ndcg, echoed)


def reward_config_of(rl: Any) -> RewardConfig:
    """The reward an RL config (:class:`dgr2.config.RlConfig`) trains on."""
    return RewardConfig(invalid_reward=float(rl.invalid_reward), echo_alpha=float(rl.echo_alpha))


def completion_reward(
    text: str, num_candidates: int, target_index: int, cfg: RewardConfig = RewardConfig()
) -> RewardBreakdown:
    """Parse ``text`` strictly and score it (the function RL rollouts go through)."""
    return ranking_reward(parse_completion(text, num_candidates), target_index, cfg)
