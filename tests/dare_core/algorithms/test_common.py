"""Shared RL pieces: advantages, PPO clip with dual clip, KL estimators."""
import pytest
import torch

from dare_core.algorithms.common import group_advantages, kl_estimate, ppo_clip


def test_advantages():
    r = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.25])
    for est in ("grpo", "grpo_no_std", "rloo"):
        a, m = group_advantages(r, 4, est)
        assert torch.equal(a[:4], torch.zeros(4))  # identical rewards -> zero advantage
        assert m["zero_std_ratio"] == 0.5
    a, _ = group_advantages(r, 4, "grpo")
    assert abs(a[4:].mean()) < 1e-6 and abs(a[4:].std(unbiased=True) - 1) < 1e-5
    a, _ = group_advantages(r, 4, "rloo")
    torch.testing.assert_close(a[4:], 4 / 3 * (r[4:] - r[4:].mean()))
    with pytest.raises(ValueError):
        group_advantages(r, 1)


def test_clip_gradients_and_dual_clip():
    lr = torch.tensor([0.5], requires_grad=True)  # ratio e^0.5 > 1.2
    loss, m = ppo_clip(lr, torch.tensor([1.0]), 0.2, 0.2, 3.0)
    loss.sum().backward()
    assert lr.grad.item() == 0.0 and m["clipfrac_hi"].item() == 1.0
    lr = torch.tensor([2.0], requires_grad=True)  # A < 0 and ratio e^2 > c = 3
    loss, m = ppo_clip(lr, torch.tensor([-1.0]), 0.2, 0.2, 3.0)
    assert loss.item() == pytest.approx(3.0)
    loss.sum().backward()
    assert lr.grad.item() == 0.0 and m["dual_clipfrac"].item() == 1.0


def test_kl_estimators():
    d = torch.linspace(-50, 50, 101)
    zero = torch.zeros(101)
    k3 = kl_estimate(d, zero, "k3")
    assert torch.isfinite(k3).all() and (k3 >= 0).all()
    for est in ("k1", "k2", "k3"):
        assert torch.equal(kl_estimate(zero, zero, est), zero)
