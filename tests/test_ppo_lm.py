"""ppo_lm.py: equations against hand-computed numbers, learning on a tiny model, CLI, resume,
errors."""

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from test_grpo_lm import digit_task

import common
import ppo_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

# ---------------------------------------------------------------------------------------------
# Equations
# ---------------------------------------------------------------------------------------------
# ppo_loss's clip ranges and value-loss weight, as the tests below use them
COEFS = dict(clip_range=0.2, clip_range_value=0.2, vf_coef=0.1)
# A padded batch: sequence 1 has 3 valid tokens, sequence 2 only 1 (its EOS); what follows is
# garbage.
REWARDS = torch.tensor([[0.0, 0.0, 1.0], [0.5, 7.0, 7.0]])
VALUES = torch.tensor([[0.1, 0.2, 0.3], [0.4, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1, 1], [1, 0, 0]])


def test_gae_and_returns_hand_computed_on_a_padded_batch():
    adv, ret = ppo_lm.gae(REWARDS, VALUES, MASK, gamma=1.0, lam=0.95)
    # row 1: deltas (t = 2, 1, 0) = 1 - 0.3, 0.3 - 0.2, 0.2 - 0.1; A_1 = 0.1 + 0.95 * 0.7; A_0 = 0.1
    # + 0.95 * A_1 row 2: the last token is terminal: delta = 0.5 - 0.4, nothing after it counts
    torch.testing.assert_close(adv, torch.tensor([[0.82675, 0.765, 0.7], [0.1, 0, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.92675, 0.965, 1.0], [0.5, 0, 0]]))
    adv, ret = ppo_lm.gae(REWARDS, VALUES, MASK, gamma=0.9, lam=0.5)
    # deltas: 0.7, 0.9 * 0.3 - 0.2 = 0.07, 0.9 * 0.2 - 0.1 = 0.08; gamma * lam = 0.45
    torch.testing.assert_close(adv[0], torch.tensor([0.08 + 0.45 * 0.385, 0.07 + 0.45 * 0.7, 0.7]))
    torch.testing.assert_close(ret[0], adv[0] + VALUES[0])
    _, ret = ppo_lm.gae(REWARDS, VALUES, MASK, gamma=1.0, lam=1.0)  # lam = 1: Monte Carlo returns
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1, 1], [0.5, 0, 0]]))


def test_per_token_reward_layout_kl_everywhere_score_on_the_last_token():
    scores = torch.tensor([2.0, -1.0])
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-2.0, 5.0, 5.0]])
    rewards, kl = ppo_lm.per_token_rewards(scores, logp, ref, MASK, beta=0.1)
    torch.testing.assert_close(
        kl, torch.tensor([[0.5, 0.0, -1.0], [1.0, 0, 0]])
    )  # log pi - log pi_ref, masked
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 0.1 + 2.0], [-0.1 - 1.0, 0, 0]]))
    rewards, kl = ppo_lm.per_token_rewards(
        scores, logp, None, MASK, beta=0.1
    )  # no reference: score only
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0, 2], [-1, 0, 0]]))


# A 5-armed bandit: each arm is a one-token completion (T = 1), the task reward is 1 for arm 0 only,
# the reference is uniform. The KL-regularised objective E[r] - beta * KL(pi || pi_ref) has its
# optimum at pi*(a) = pi_ref(a) exp(r(a) / beta) / Z: pi*(a0) = e^2 / (e^2 + 4) = 0.649 for beta =
# 0.5.
BANDIT_REWARD = torch.tensor([1.0, 0, 0, 0, 0])
BANDIT_REF = torch.full((5, 1), math.log(0.2))


def bandit_probs_after(
    steps: int, beta: float = 0.5, estimator: str = "k1", lr: float = 2.0
) -> torch.Tensor:
    """pi after ``steps`` gradient steps on the softmax logits, each on the exact expected PPO loss.

    Every arm's loss (ppo_lm's per_token_rewards -> gae -> ppo_loss, with pi_old = pi) is weighted
    by its detached probability: the gradient is sum_a pi(a) A(a) grad log pi(a), with no sampling
    noise. ``estimator``: --kl-estimator.
    """
    theta = torch.zeros(5, requires_grad=True)
    ones = torch.ones(5, 1)
    zeros = torch.zeros(5, 1)
    for _ in range(steps):
        logp = torch.log_softmax(theta, 0).unsqueeze(1)  # (5, 1): log pi(a), one sequence per arm
        old_logp = logp.detach()
        rewards, _ = ppo_lm.per_token_rewards(
            BANDIT_REWARD, old_logp, BANDIT_REF, ones, beta=beta, estimator=estimator
        )
        advantages, returns = ppo_lm.gae(rewards, zeros, ones, gamma=1.0, lam=1.0)
        expected_loss = 0.0
        for a in range(5):
            arm = slice(a, a + 1)
            loss, _ = ppo_lm.ppo_loss(
                logp=logp[arm],
                old_logp=old_logp[arm],
                advantages=advantages[arm],
                mask=ones[arm],
                values=zeros[arm],
                old_values=zeros[arm],
                returns=returns[arm],
                clip_range=0.2,
                clip_range_value=0.2,
                vf_coef=0.1,
                num_sequences=1,
            )
            expected_loss = expected_loss + old_logp[a, 0].exp() * loss
        (grad,) = torch.autograd.grad(expected_loss, theta)
        with torch.no_grad():
            theta -= lr * grad
    return torch.softmax(theta.detach(), 0)


def test_kl_in_the_reward_converges_to_the_regularised_optimum():
    e2 = math.exp(2.0)
    optimum = torch.tensor([e2, 1, 1, 1, 1]) / (e2 + 4)  # pi_ref(a) exp(r(a) / beta), normalised
    torch.testing.assert_close(
        bandit_probs_after(50), optimum, atol=1e-6, rtol=0
    )  # 0.6488 measured after 25 steps
    assert optimum[0].item() == pytest.approx(0.649, abs=5e-4)


def test_k3_as_a_per_token_reward_would_optimise_another_objective():
    # Why ppo_lm's default is k1: k3's expected score-function gradient as a reward is
    # grad KL(pi || ref) - grad KL(ref || pi) (tests/test_kl.py), so it pushes the rare arms rarer
    # instead of towards pi*.
    k3 = bandit_probs_after(15, estimator="k3")
    no_penalty = bandit_probs_after(15, beta=0.0)
    assert (
        k3[0] > 0.9999 and k3[0] > no_penalty[0] > 0.96
    )  # past pi*(a0) = 0.649, faster than with no KL at all


@pytest.mark.parametrize(
    "v_old, v, ret, loss, grad",
    [
        (
            0.0,
            0.5,
            1.0,
            0.32,
            0.0,
        ),  # moved 0.5 > eps_v towards R: the clipped error (0.2 - 1)^2 is larger, no gradient
        (0.0, 0.1, 1.0, 0.405, -0.9),  # inside the clip range: 0.5 * (V - R)^2, gradient V - R
        (0.0, -0.5, -1.0, 0.32, 0.0),  # the mirror image of the first case
        (
            0.0,
            0.5,
            0.3,
            0.02,
            0.2,
        ),  # overshot: the unclipped error is larger and keeps its gradient
        (
            0.0,
            0.5,
            0.6,
            0.08,
            0.0,
        ),  # clipped value (0.2) is further from R: pessimistic max, no gradient
    ],
)
def test_clipped_value_loss_value_and_gradient(v_old, v, ret, *, loss, grad):
    values = torch.tensor([[v]], requires_grad=True)
    zeros = torch.zeros(1, 1)
    out, stats = ppo_lm.ppo_loss(
        logp=zeros,
        old_logp=zeros,
        advantages=zeros,
        mask=torch.ones(1, 1),
        values=values,
        old_values=torch.tensor([[v_old]]),
        returns=torch.tensor([[ret]]),
        clip_range=0.2,
        clip_range_value=0.2,
        vf_coef=1.0,
        num_sequences=1,
    )
    out.backward()
    assert out.item() == pytest.approx(loss, abs=1e-6)
    assert values.grad.item() == pytest.approx(grad, abs=1e-6)
    assert stats["value_clipped"].item() == (1.0 if grad == 0.0 else 0.0)


@pytest.mark.parametrize(
    "ratio, adv, loss, grad",
    [
        (1.5, 1.0, -1.2, 0.0),  # A > 0, ratio above 1 + eps: clipped, no gradient
        (1.1, 1.0, -1.1, -1.1),  # inside the range: d(-ratio * A)/dlogp = -ratio * A
        (0.5, -1.0, 0.8, 0.0),  # A < 0, ratio below 1 - eps: clipped, no gradient
        (
            1.5,
            -1.0,
            1.5,
            1.5,
        ),  # A < 0 above 1 + eps: the pessimistic unclipped term keeps its gradient
    ],
)
def test_clipped_surrogate_value_and_gradient(ratio, adv, loss, grad):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    zeros = torch.zeros(1, 1)
    out, stats = ppo_lm.ppo_loss(
        logp=logp,
        old_logp=zeros,
        advantages=torch.tensor([[adv]]),
        mask=torch.ones(1, 1),
        values=zeros,
        old_values=zeros,
        returns=zeros,
        clip_range=0.2,
        clip_range_value=0.2,
        vf_coef=0.1,
        num_sequences=1,
    )
    out.backward()
    assert out.item() == pytest.approx(loss, abs=1e-6)
    assert logp.grad.item() == pytest.approx(grad, abs=1e-6)
    assert stats["clipped"].item() == (1.0 if grad == 0.0 else 0.0)


def test_loss_is_a_per_sequence_mean_and_micro_batches_add_up():
    # Sequence 1 has 1 valid token, sequence 2 has 3: eq. 1 averages each over its own |o| first.
    logp = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 50, 50], [1.0, 2.0, 3.0]])
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    zeros = torch.zeros(2, 3)
    loss, _ = ppo_lm.ppo_loss(
        logp,
        logp,
        adv,
        mask,
        values=zeros,
        old_values=zeros,
        returns=zeros,
        **COEFS,
        num_sequences=2,
    )
    assert loss.item() == pytest.approx(-(1.0 + 2.0) / 2)
    g = torch.Generator().manual_seed(1)
    logp, old, adv, v, v_old, ret = (torch.randn(6, 5, generator=g) * 0.3 for _ in range(6))
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()

    def loss_of(rows: slice) -> torch.Tensor:  # the 6 sequences' loss over these rows
        loss, _ = ppo_lm.ppo_loss(
            logp[rows],
            old[rows],
            adv[rows],
            mask[rows],
            values=v[rows],
            old_values=v_old[rows],
            returns=ret[rows],
            **COEFS,
            num_sequences=6,
        )
        return loss

    parts = loss_of(slice(0, 2)) + loss_of(slice(2, 6))
    torch.testing.assert_close(loss_of(slice(0, 6)), parts)


def test_masked_positions_never_reach_the_exponent():
    # Post-EOS positions hold whatever the forward pass gave there; the loss and its gradients must
    # not see them.
    g = torch.Generator().manual_seed(0)
    logp, old, adv, v, v_old, ret = (torch.randn(2, 3, generator=g) * 0.3 for _ in range(6))
    adv = adv * MASK
    ret = ret * MASK
    results = []
    for pad in (
        0.0,
        1000.0,
    ):  # logp - old = 0 after the EOS, then 1000, which overflows exp() in float32
        lp = torch.where(MASK.bool(), logp, old + pad).requires_grad_(True)
        values = v.clone().requires_grad_(True)
        loss, stats = ppo_lm.ppo_loss(
            lp,
            old,
            adv,
            MASK,
            values=values,
            old_values=v_old,
            returns=ret,
            **COEFS,
            num_sequences=2,
        )
        loss.backward()
        results.append((loss, lp.grad, values.grad, stats["approx_kl"]))
    (loss0, g0, vg0, kl0), (loss1, g1, vg1, kl1) = results
    assert torch.isfinite(loss1) and torch.equal(loss1, loss0) and torch.equal(kl1, kl0)
    assert (
        torch.equal(g1, g0)
        and torch.equal(vg1, vg0)
        and torch.equal(g1 * (1 - MASK), torch.zeros(2, 3))
    )
    # and in the reward: a log prob of -inf after the EOS (an underflow) leaves the KL and the
    # rewards finite
    ref = torch.zeros(2, 3)
    rewards, kl = ppo_lm.per_token_rewards(
        torch.tensor([1.0, 2.0]), torch.where(MASK.bool(), logp, -math.inf), ref, MASK, beta=0.1
    )
    clean_rewards, clean_kl = ppo_lm.per_token_rewards(
        torch.tensor([1.0, 2.0]), logp * MASK, ref, MASK, beta=0.1
    )
    assert torch.equal(kl, clean_kl) and torch.equal(rewards, clean_rewards)


def test_masked_whiten_ignores_padding():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -100.0]])
    std = math.sqrt(5 / 3)  # valid values 1, 2, 3, 4: mean 2.5, unbiased variance 5/3
    expected = torch.tensor([[-1.5 / std, -0.5 / std, 0.5 / std], [1.5 / std, 0, 0]])
    torch.testing.assert_close(ppo_lm.masked_whiten(x, MASK), expected)
    torch.testing.assert_close(
        ppo_lm.masked_whiten(x, MASK, shift_mean=False), (expected + 2.5) * MASK
    )


def test_adaptive_kl_controller():
    assert ppo_lm.adaptive_kl_coef(
        0.1, kl=12.0, target=6.0, num_sequences=32, horizon=10000
    ) == pytest.approx(0.1 * (1 + 0.2 * 32 / 10000))  # error clipped at +0.2
    assert ppo_lm.adaptive_kl_coef(
        0.1, kl=5.4, target=6.0, num_sequences=32, horizon=10000
    ) == pytest.approx(0.1 * (1 - 0.1 * 32 / 10000))


def test_completion_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 9, 9, 9]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    mask = ppo_lm.completion_mask(ids, eos_token_id=2)
    assert torch.equal(mask, expected)
    rewards, _ = ppo_lm.per_token_rewards(
        torch.tensor([1.0, 2.0, 3.0]), torch.zeros(3, 4), None, mask, beta=0.0
    )
    # the score lands on the first EOS (or the last sampled token when there is none)
    assert torch.equal(rewards, torch.tensor([[0.0, 1, 0, 0], [0, 0, 0, 2], [3, 0, 0, 0]]))


def test_values_are_read_at_the_token_before_each_completion_token(tiny_reward_model_dir):
    vm = common.load_model(str(tiny_reward_model_dir), kind="reward").eval()
    tok = common.load_tokenizer(str(tiny_reward_model_dir))
    enc = tok(
        ["What is 1 + 2?3<eos>", "1+1=2<eos>"],
        return_tensors="pt",
        padding=True,
        add_special_tokens=False,
    )
    with torch.no_grad():
        values = ppo_lm.token_values(vm, enc["input_ids"], enc["attention_mask"], 3)
        ids = tok(["1+1=2<eos>"], return_tensors="pt", add_special_tokens=False)["input_ids"]
        # V(s_t) for the completion "=2<eos>" scores the prefix before token t, as the HF classifier
        # pools it
        expected = torch.cat(
            [vm(input_ids=ids[:, : ids.shape[1] - 3 + t]).logits[:, 0] for t in range(3)]
        )
    torch.testing.assert_close(values[1], expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Learning, CLI, resume, errors
# ---------------------------------------------------------------------------------------------


def tiny_args(model_dir, tmp_path, **kw) -> ppo_lm.Args:
    base = dict(
        model_name_or_path=str(model_dir),
        runs_dir=str(tmp_path),
        run_name="run",
        prompts_per_step=32,
        max_new_tokens=12,
        learning_rate=1e-2,
        temperature=1.0,
        eval_size=8,
        eval_every=0,
        sample_every=0,
        save_every=0,
        total_steps=2,
        seed=3,
        micro_batch_size=32,
        num_ppo_epochs=2,
        num_minibatches=2,
    )
    base.update(kw)
    return ppo_lm.Args(**base)


def test_tiny_model_learns_digit_reward(tiny_model_dir, tmp_path):
    # beta 0.01: the KL-regularised optimum tilts each token by exp((1/12) / beta), to ~all digits;
    # with the default 0.05 the tilt is only exp(1.67) and the reward settles near 0.4 (measured),
    # as it should.
    history = ppo_lm.main(
        tiny_args(tiny_model_dir, tmp_path, total_steps=12, beta=0.01), task=digit_task()
    )
    rewards = history["reward/mean"]
    first = sum(rewards[:3]) / 3
    last = sum(rewards[-3:]) / 3
    assert first < 0.25, rewards  # ~14 of 76 characters are digits at initialisation
    assert last > first + 0.4, rewards  # +0.65 to +0.72 measured over seeds 3-6
    assert history["value/mean"][0] == 0.0  # zero-initialised value head
    assert history["value/mean"][-1] != 0.0 and history["loss/value"][-1] > 0  # ...that learns
    assert (
        history["loss/kl"][0] == 0.0 and history["loss/kl"][-1] > 0
    )  # the policy moved away from the reference
    assert history["memory/peak_rss_gb"][-1] > 0


def test_a_bf16_cpu_samples_and_trains_under_bf16_autocast(tiny_model_dir, tmp_path, monkeypatch):
    # issue 24: --bf16 on a CPU with native bf16 autocasts sampling and every pass, and the policy
    # still learns; --no-bf16: float32, other numbers from step 1
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    history = ppo_lm.main(
        tiny_args(tiny_model_dir, tmp_path, total_steps=12, beta=0.01), task=digit_task()
    )
    rewards = history["reward/mean"]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.4, rewards
    plain = ppo_lm.main(
        tiny_args(tiny_model_dir, tmp_path / "f32", beta=0.01, bf16=False), task=digit_task()
    )
    assert plain["loss/policy"] != history["loss/policy"][:2]  # the same steps but for autocast
    assert all(math.isfinite(x) for x in history["loss/policy"] + history["loss/value"])


def test_missing_eos_penalty_is_subtracted_from_the_score(tiny_model_dir, tmp_path):
    # TRL's missing_eos_penalty: a positive 1.5 lowers the score of every completion without EOS by
    # 1.5
    h = ppo_lm.main(
        tiny_args(
            tiny_model_dir,
            tmp_path,
            total_steps=1,
            max_new_tokens=3,
            missing_eos_penalty=1.5,
            eval_size=1,
        ),
        task=digit_task(),
    )
    assert h["completion/frac_truncated"][0] > 0.5
    assert h["reward/score"][0] == pytest.approx(
        h["reward/mean"][0] - 1.5 * h["completion/frac_truncated"][0], abs=1e-6
    )


@pytest.mark.parametrize("penalty", [-1.0, math.nan, math.inf])
def test_missing_eos_penalty_must_be_finite_and_non_negative(penalty):
    with pytest.raises(
        common.UsageError,
        match=r"^--missing-eos-penalty: must be (a finite number|greater than or equal to 0)",
    ):
        ppo_lm.validate(ppo_lm.Args(missing_eos_penalty=penalty))


def test_adaptive_kl_flags_do_not_take_the_early_stopping_name():
    # --target-kl stops an update's epochs early in ppo_continuous.py and CleanRL; here the target
    # moves beta
    for flag in ("--target-kl", "--kl-horizon"):
        with pytest.raises(common.UsageError, match=f"^Unrecognized options: {flag}, 6$"):
            common.parse_args(ppo_lm.Args, [flag, "6"])
    args = common.parse_args(
        ppo_lm.Args, ["--adaptive-kl-target", "6", "--adaptive-kl-horizon", "100"]
    )
    assert (args.adaptive_kl_target, args.adaptive_kl_horizon) == (6.0, 100)


@pytest.mark.parametrize(
    "saved, message",
    [
        (
            {"tis_cap": 2.0},
            "^--resume: not a ppo_lm.py checkpoint of this version: .*unexpected keyword argument "
            "'tis_cap'$",
        ),
        (
            {"target_kl": 6.0, "kl_horizon": 100},
            "^--resume: not a ppo_lm.py checkpoint of this version: .*argument 'target_kl'$",
        ),
    ],
)
def test_resuming_a_run_with_a_removed_flag_is_one_line(saved, message, tmp_path):
    # a run saved with k3 in the reward, or with the old name of the adaptive KL target, is refused
    # at once, as its saved flags become the defaults
    path = tmp_path / "checkpoint.pt"
    args = {**dataclasses.asdict(ppo_lm.Args()), **saved}
    torch.save({"script": ppo_lm.SCRIPT, "step": 1, "args": args}, path)
    with pytest.raises(common.UsageError, match=message):
        common.parse_args(ppo_lm.Args, ["--resume", str(path)], ppo_lm.SCRIPT)


def test_resume_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path):
    kw = dict(
        adaptive_kl_target=0.01, adaptive_kl_horizon=32, max_new_tokens=8
    )  # an adaptive beta that moves: it must be restored too
    full = ppo_lm.main(
        tiny_args(tiny_model_dir, tmp_path / "a", total_steps=4, save_every=2, **kw),
        task=digit_task(),
    )
    ppo_lm.main(tiny_args(tiny_model_dir, tmp_path / "b", total_steps=2, **kw), task=digit_task())
    resumed = ppo_lm.main(
        tiny_args(
            tiny_model_dir,
            tmp_path / "b",
            total_steps=4,
            **kw,
            resume=str(tmp_path / "b" / "run" / "checkpoint.pt"),
        ),
        task=digit_task(),
    )
    for key in (
        "loss/policy",
        "loss/value",
        "reward/mean",
        "loss/kl",
        "kl/beta",
        "optim/grad_norm",
        "optim/value_grad_norm",
    ):
        assert resumed[key] == pytest.approx(full[key][2:], rel=1e-5, abs=1e-7), key
    assert (
        abs(full["loss/policy"][3]) > 0 and full["kl/beta"][3] != 0.05
    )  # a real loss, a moved beta
    assert "reference" not in common.load_checkpoint(
        tmp_path / "b" / "run" / "checkpoint.pt"
    )  # it never changes


def test_a_beta_given_again_on_resume_takes_effect(tiny_model_dir, tmp_path):
    # a fixed beta is the flag's: --resume with --beta 0.5 trains with 0.5, not the saved 0.05; with
    # --adaptive-kl-target the controller's saved value continues (the flag set only the run's first
    # beta)
    kw = dict(
        total_steps=1,
        prompts_per_step=4,
        micro_batch_size=4,
        num_minibatches=1,
        max_new_tokens=4,
        eval_size=0,
    )
    betas = {}
    for name, extra in (
        ("fixed", {}),
        ("adaptive", dict(adaptive_kl_target=0.01, adaptive_kl_horizon=8)),
    ):
        ppo_lm.main(
            tiny_args(tiny_model_dir, tmp_path, run_name=name, **kw, **extra), task=digit_task()
        )
        ckpt = tmp_path / name / "checkpoint.pt"
        saved = common.load_checkpoint(ckpt)["kl_coef"]
        args = common.parse_args(
            ppo_lm.Args,
            ["--resume", str(ckpt), "--total-steps", "2", "--beta", "0.5"],
            ppo_lm.SCRIPT,
        )
        betas[name] = (saved, ppo_lm.main(args, task=digit_task())["kl/beta"])
    assert betas["fixed"] == (0.05, [0.5])
    saved, resumed = betas["adaptive"]
    assert saved != 0.05 and resumed == [
        saved
    ]  # the controller moved beta in step 1, and step 2 goes on from there


def test_cli_two_steps_with_reward_model_writes_events_checkpoint_and_model(
    tiny_model_dir, tiny_reward_model_dir, tmp_path
):
    cmd = [
        sys.executable,
        str(ROOT / "ppo_lm.py"),
        "--model-name-or-path",
        str(tiny_model_dir),
        "--reward-model-path",
        str(tiny_reward_model_dir),
        "--total-steps",
        "2",
        "--prompts-per-step",
        "4",
        "--num-minibatches",
        "2",
        "--max-new-tokens",
        "8",
        "--eval-size",
        "4",
        "--sample-every",
        "1",
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "cli",
        "--whiten-rewards",
    ]
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}  # ~10x faster for the tiny model
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=one_thread)
    assert out.returncode == 0, out.stderr[-2000:]
    run = tmp_path / "cli"
    assert (
        list(run.glob("events.out.tfevents.*")) and (run / "final_model" / "config.json").is_file()
    )
    ckpt = common.load_checkpoint(run / "checkpoint.pt")
    assert ckpt["step"] == 2 and ckpt["args"]["whiten_rewards"] and "value_model" in ckpt
    rm = common.load_model(str(tiny_reward_model_dir), kind="reward")
    assert not torch.equal(
        ckpt["value_model"]["score.weight"], torch.zeros_like(rm.score.weight)
    )  # from the RM head
    assert "step 2 samples" in out.stdout + out.stderr


def test_cli_bad_input_is_one_line(tmp_path):
    # the real command line, once: exit code 2, one line, no traceback (the in-process table of
    # test_bad_input_lm.py holds every other case, through the same cli())
    out = subprocess.run(
        [sys.executable, str(ROOT / "ppo_lm.py"), "--gamma", "1.5"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last == "error: --gamma: must be less than or equal to 1, got 1.5"
    assert "Traceback" not in out.stderr


def test_gradient_checkpointing_takes_the_same_steps(tiny_model_dir, tmp_path):
    plain = ppo_lm.main(tiny_args(tiny_model_dir, tmp_path / "a"), task=digit_task())
    ckpt = ppo_lm.main(
        tiny_args(tiny_model_dir, tmp_path / "b", gradient_checkpointing=True), task=digit_task()
    )
    for key in (
        "loss/policy",
        "loss/value",
        "optim/grad_norm",
        "optim/value_grad_norm",
        "reward/mean",
    ):
        assert ckpt[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
    assert plain["optim/value_grad_norm"][1] > 0 and plain["loss/kl"][1] != 0


# ---------------------------------------------------------------------------------------------
# bf16 numerics and the sampler (issue 13, item 4)
# ---------------------------------------------------------------------------------------------
def test_log_probs_take_the_lm_head_in_float32_under_bf16_autocast(tiny_model_dir):
    model = common.load_model(str(tiny_model_dir)).eval()
    tok = common.load_tokenizer(str(tiny_model_dir))
    enc = tok(
        ["What is 1 + 2?3<eos>", "1+1=2<eos>"],
        return_tensors="pt",
        padding=True,
        add_special_tokens=False,
    )
    ids = enc["input_ids"]
    att = enc["attention_mask"]
    position_ids = (att.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logp = ppo_lm.token_log_probs(model, ids, att, 3, temperature=0.7)
        hidden = model.model(
            input_ids=ids, attention_mask=att, position_ids=position_ids
        ).last_hidden_state[:, -4:-1]
        bf16_head = (
            (model.lm_head(hidden).float() / 0.7)
            .log_softmax(-1)
            .gather(2, ids[:, -3:, None])
            .squeeze(-1)
        )
    expected = (torch.nn.functional.linear(hidden.float(), model.lm_head.weight) / 0.7).log_softmax(
        -1
    )
    expected = expected.gather(2, ids[:, -3:, None]).squeeze(-1)
    assert (
        expected - bf16_head
    ).abs().max() > 1e-4  # what a bf16 head costs (small logits in this tiny model)
    torch.testing.assert_close(logp, expected, atol=1e-6, rtol=0)
