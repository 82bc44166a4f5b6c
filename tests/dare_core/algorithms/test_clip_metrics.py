"""The importance-ratio statistics of the clipped surrogates, by hand on a tiny batch: the mean
hides the one entry whose ratio spikes, so each step also logs the largest ratio (`ratio_max`)."""
import math
from types import SimpleNamespace

import pytest
import torch

from dare_core.algorithms.common import sequence_policy_loss, token_policy_loss

RL = SimpleNamespace(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=0.0, kl_beta=0.0, kl_estimator="k3", entropy_coeff=0.0)


def test_token_loss_reports_the_largest_scored_ratio_and_the_clipped_shares():
    old = torch.zeros(2, 3)
    s = torch.tensor([[math.log(2.0), 0.0, math.log(50.0)], [math.log(0.5), math.log(1.1), 0.0]])
    adv = torch.tensor([[1.0], [-1.0]]).expand(2, 3)
    weight = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # the 50x entry is not scored
    _, metrics = token_policy_loss(s, old, None, adv, weight, float(weight.sum()), RL)
    assert metrics["ratio_max"] == pytest.approx(2.0)
    assert metrics["ratio"] == pytest.approx((2.0 + 1.0 + 0.5 + 1.1 + 1.0) / 5)
    assert metrics["clipfrac_hi"] == pytest.approx(1 / 5) and metrics["clipfrac_lo"] == pytest.approx(1 / 5)


def test_sequence_loss_reports_the_largest_ratio():
    old = torch.zeros(3)
    score = torch.tensor([0.0, math.log(101.8), math.log(0.9)])
    _, metrics = sequence_policy_loss(score, old, None, torch.tensor([1.0, -1.0, 1.0]), 3.0, RL)
    assert metrics["ratio_max"] == pytest.approx(101.8, rel=1e-5)
