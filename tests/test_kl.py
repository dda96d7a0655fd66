"""Which divergence each KL estimator's gradient follows, in each placement (issue 40).

On one categorical policy (a softmax over 5 logits; each outcome is a one-token completion), every
expectation is a sum over the 5 outcomes weighted by their probabilities: no sampling noise. The
gradients come from the scripts' own losses (grpo_lm.grpo_loss, ppo_lm.per_token_rewards -> gae ->
ppo_loss); the targets are autograd's gradients of the divergences written out here. Each test also
checks that the other estimators' targets are far away, so swapping two estimators fails it.
"""

import inspect
import math

import pytest
import test_grpo_lm
import test_ppo_lm
import torch

import grpo_lm
import ppo_lm

THETA = torch.tensor([0.3, -1.2, 2.0, 0.1, -0.4])  # the policy's logits
REF = torch.tensor([0.0, 0.5, 1.0, -0.5, 0.2]).log_softmax(0)  # log pi_ref
OLD = torch.tensor([1.0, 0.0, 0.5, -1.0, 0.3]).log_softmax(0)  # log pi_old != log pi_theta (mu > 1)
ONES = torch.ones(5, 1)


def kl(p, q):
    """KL(p || q) of two (5,) log-probability vectors."""
    return (p.exp() * (p - q)).sum()


def gradient_of(divergence):
    """d/dtheta of ``divergence(log pi_theta)`` at THETA."""
    theta = THETA.clone().requires_grad_()
    return torch.autograd.grad(divergence(theta.log_softmax(0)), theta)[0]


TARGETS = {  # what each estimator's gradient follows as a loss term, on-policy (kl_estimate)
    "k1": lambda logp: 0 * logp.sum(),
    "k2": lambda logp: kl(logp, REF),  # KL(pi_theta || pi_ref)
    "k3": lambda logp: kl(REF, logp),  # KL(pi_ref || pi_theta)
}


def expected_loss_gradient(estimator, sampled_from=None, weight_by_ratio=False):
    """E over a ~ ``sampled_from`` (default pi_theta) of d/dtheta of grpo_loss's KL term at a
    (beta 1, advantage 0), optionally weighted by pi_theta(a) / pi_old(a)."""
    theta = THETA.clone().requires_grad_()
    logp = theta.log_softmax(0)
    rows = logp.detach().unsqueeze(1).requires_grad_()  # (5, 1): one completion per outcome
    sampling = logp.detach() if sampled_from is None else sampled_from
    loss, _ = grpo_lm.grpo_loss(
        rows,
        sampling.unsqueeze(1),
        REF.unsqueeze(1),
        torch.zeros(5),
        mask=ONES,
        clip_range=0.2,
        beta=1.0,
        num_sequences=5,
        kl_estimator=estimator,
    )
    (per_row,) = torch.autograd.grad(loss, rows)  # d term_a / d log pi(a), divided by the 5 rows
    weights = sampling.exp() * (torch.exp(logp.detach() - sampling) if weight_by_ratio else 1)
    return torch.autograd.grad(logp, theta, grad_outputs=weights * 5 * per_row.squeeze(1))[0]


def far_from_the_other_targets(gradient, estimator):
    for other, divergence in TARGETS.items():
        if other != estimator:
            assert (gradient - gradient_of(divergence)).abs().max() > 0.05, other


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_each_estimator_in_the_loss_follows_its_divergence_on_policy(estimator):
    gradient = expected_loss_gradient(estimator)
    torch.testing.assert_close(gradient, gradient_of(TARGETS[estimator]), atol=1e-6, rtol=1e-5)
    far_from_the_other_targets(gradient, estimator)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_with_mu_above_1_the_loss_term_lacks_the_ratio_that_would_keep_its_target(estimator):
    # tokens from pi_old (the later of mu updates): eq. 3 puts the KL term outside the ratio, so its
    # expected gradient moves off the target; weighting each token by pi_theta / pi_old restores it
    target = gradient_of(TARGETS[estimator])
    assert (expected_loss_gradient(estimator, sampled_from=OLD) - target).abs().max() > 0.05
    restored = expected_loss_gradient(estimator, sampled_from=OLD, weight_by_ratio=True)
    torch.testing.assert_close(restored, target, atol=1e-6, rtol=1e-5)


REWARD_TARGETS = {  # what -beta * estimator as a per-token reward follows (per_token_rewards)
    "k1": lambda logp: kl(logp, REF),  # KL(pi || pi_ref): PPO-RLHF's objective
    "k2": lambda logp: (logp.exp() * (logp - REF) ** 2 / 2).sum() - kl(logp, REF),  # E_pi[k2] - KL
    "k3": lambda logp: kl(logp, REF) - kl(REF, logp),  # KL(pi || pi_ref) - KL(pi_ref || pi)
}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_each_estimator_in_the_reward_follows_its_divergence(estimator):
    # ppo_lm's step 4 (reward -KL_t, score 0, beta 1) -> GAE (gamma = lam = 1, values 0) -> PPO's
    # loss with pi_old = pi; each outcome's loss weighted by its probability: the policy gradient
    # ascends -target, so the loss's gradient is the target's
    theta = THETA.clone().requires_grad_()
    logp = theta.log_softmax(0).unsqueeze(1)
    old = logp.detach()
    rewards, _ = ppo_lm.per_token_rewards(
        torch.zeros(5), old, REF.unsqueeze(1), ONES, beta=1.0, estimator=estimator
    )
    advantages, returns = ppo_lm.gae(rewards, torch.zeros(5, 1), ONES, gamma=1.0, lam=1.0)
    zeros = torch.zeros(1, 1)
    expected = sum(
        old[a, 0].exp()
        * ppo_lm.ppo_loss(
            logp[a : a + 1],
            old[a : a + 1],
            advantages[a : a + 1],
            ONES[:1],
            values=zeros,
            old_values=zeros,
            returns=returns[a : a + 1],
            clip_range=0.2,
            clip_range_value=0.2,
            vf_coef=0.0,
            num_sequences=1,
        )[0]
        for a in range(5)
    )
    (gradient,) = torch.autograd.grad(expected, theta)
    torch.testing.assert_close(
        gradient, gradient_of(REWARD_TARGETS[estimator]), atol=1e-6, rtol=1e-5
    )
    for other, divergence in REWARD_TARGETS.items():
        if other != estimator:
            assert (gradient - gradient_of(divergence)).abs().max() > 0.05, other


def test_the_estimators_values_by_hand_and_their_means():
    # r = pi_ref / pi = 0.5, 2, 1 (log r = -ln 2, ln 2, 0)
    logp = torch.tensor([[math.log(0.5), math.log(0.5), -1.0]])
    ref = torch.tensor([[math.log(0.25), 0.0, -1.0]])
    ln2 = math.log(2)
    hand = {
        "k1": [ln2, -ln2, 0.0],
        "k2": [ln2**2 / 2, ln2**2 / 2, 0.0],
        "k3": [0.5 + ln2 - 1, 2 - ln2 - 1, 0.0],
    }
    for estimator, values in hand.items():
        torch.testing.assert_close(
            grpo_lm.kl_estimate(logp, ref, estimator), torch.tensor([values]), atol=1e-7, rtol=0
        )
        _, kl_t = ppo_lm.per_token_rewards(
            torch.zeros(1), logp, ref, torch.ones(1, 3), beta=1, estimator=estimator
        )
        torch.testing.assert_close(kl_t, torch.tensor([values]), atol=1e-7, rtol=0)
    # on-policy means: k1 and k3 are unbiased for KL(pi || pi_ref), k2 is not
    logp = THETA.log_softmax(0)
    pi, true = logp.exp(), kl(logp, REF).item()
    mean = {k: (pi * grpo_lm.kl_estimate(logp, REF, k)).sum().item() for k in ("k1", "k2", "k3")}
    assert mean["k1"] == pytest.approx(true, rel=1e-5)
    assert mean["k3"] == pytest.approx(true, rel=1e-5)
    assert abs(mean["k2"] - true) > 0.01
    assert (grpo_lm.kl_estimate(torch.randn(64, 16), torch.randn(64, 16), "k3") >= 0).all()


@pytest.mark.parametrize("script", [grpo_lm, ppo_lm])
def test_the_flag_reaches_the_kl_term(script, tiny_model_dir, tmp_path, monkeypatch):
    # the wiring from --kl-estimator to the function that computes the term, in each main()
    name = "kl_estimate" if script is grpo_lm else "per_token_rewards"
    real, seen = getattr(script, name), []

    def spy(*args, **kwargs):
        seen.append(inspect.signature(real).bind(*args, **kwargs).arguments["estimator"])
        return real(*args, **kwargs)

    monkeypatch.setattr(script, name, spy)
    tiny_args = (test_grpo_lm if script is grpo_lm else test_ppo_lm).tiny_args
    script.main(tiny_args(tiny_model_dir, tmp_path, total_steps=1, kl_estimator="k2"))
    assert seen and set(seen) == {"k2"}
