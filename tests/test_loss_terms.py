"""Issue 41's loss terms: CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4), the entropy bonus of both LM
scripts (PPO eq. 9's c2 * S), and the clip fraction split by the advantage's sign."""

import math

import pytest
import torch
from test_grpo_lm import digit_task
from test_grpo_lm import tiny_args as grpo_args
from test_ppo_lm import tiny_args as ppo_args

import grpo_lm
import ppo_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def cispo(logp, old, adv, mask, *, high=0.2):
    return grpo_lm.grpo_loss(
        logp,
        old,
        None,
        adv,
        mask=mask,
        clip_range=0.2,
        beta=0.0,
        num_sequences=len(logp),
        loss_type="cispo",
        clip_range_high=high,
        num_tokens=mask.sum(),
    )


@pytest.mark.parametrize(
    "ratio, adv, weight",
    [
        (1.5, 1.0, 1.2),  # above 1 + eps_high: the weight is clipped, the token keeps a gradient
        (1.1, 1.0, 1.1),  # inside: the ratio itself
        (0.5, -1.0, 0.5),  # below 1 - eps: no lower clip (MiniMax-M1's eps_low is unbounded)
        (1.5, -1.0, 1.2),  # the clip does not look at the sign of A
    ],
)
def test_cispo_hand_computed(ratio, adv, weight):
    # one token: loss = -sg(w) * A * log pi, d/dlogp = -w * A (grpo's min would give 0 when clipped)
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, stats = cispo(logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1))
    loss.backward()
    assert loss.item() == pytest.approx(-weight * adv * math.log(ratio), abs=1e-6)
    assert logp.grad.item() == pytest.approx(-weight * adv, abs=1e-6)


def test_cispo_is_its_papers_formula():
    # J = 1 / sum_i |o_i| * sum_i sum_t sg(clip(r_it, 1 - eps_low, 1 + eps_high)) * A_i * log pi
    # (MiniMax-M1 eq. 4; eps_low unbounded; eps_high 0.28 here, DAPO's value), token by token
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 4, generator=g) * 2).requires_grad_()
    old = logp.detach() + 0.4 * torch.randn(3, 4, generator=g)
    adv = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    loss, _ = cispo(logp, old, adv, mask, high=0.28)
    (grad,) = torch.autograd.grad(loss, logp)
    objective, tokens = 0.0, 0
    for i in range(3):
        for t in range(int(mask[i].sum())):
            weight = min(math.exp(logp[i, t].item() - old[i, t].item()), 1.28)
            objective = objective + weight * adv[i] * logp[i, t]
            tokens += 1
    (expected,) = torch.autograd.grad(-objective / tokens, logp)
    assert loss.item() == pytest.approx(-objective.item() / tokens, rel=1e-6)
    torch.testing.assert_close(grad, expected)
    assert grad[0, 3] == 0 and grad[1, 1:].abs().sum() == 0  # padding: no gradient


def test_clip_fraction_is_split_by_the_advantages_sign():
    # tokens (A, ratio): (+, 1.5) and (+, 1.3) clipped high (eps_high 0.28), (+, 1.25) not; (-, 0.5)
    # clipped low; (+, 0.5) and (-, 1.5) not clipped (the min keeps the pessimistic unclipped term)
    ratios = torch.tensor([[1.5], [1.3], [1.25], [0.5], [0.5], [1.5]])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, 1.0, -1.0])
    terms = dict(mask=torch.ones(6, 1), clip_range=0.2, beta=0.0, num_sequences=6)
    logp = torch.log(ratios)
    _, stats = grpo_lm.grpo_loss(logp, torch.zeros(6, 1), None, adv, **terms, clip_range_high=0.28)
    assert stats["clipped_high"].item() == 2 and stats["clipped_low"].item() == 1


def test_the_entropy_bonus_adds_its_term_and_gradient_in_grpo_and_ppo():
    # loss(coef) = loss(0) - coef * (the aggregated entropy): grpo per-sequence means over B = 2,
    # ppo the same; the gradient reaches the entropy tensor with weight -coef * mask / (|o_i| * B)
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    entropy = torch.tensor([[0.5, 1.5, 9.0], [1.0, 2.0, 3.0]], requires_grad=True)
    weight = -0.1 * mask / mask.sum(1, keepdim=True) / 2
    adv = torch.tensor([1.0, -1.0])
    terms = dict(mask=mask, clip_range=0.2, beta=0.0, num_sequences=2)
    base, _ = grpo_lm.grpo_loss(logp, logp, None, adv, **terms)
    bonus, _ = grpo_lm.grpo_loss(logp, logp, None, adv, **terms, entropy=entropy, entropy_coef=0.1)
    assert bonus.item() == pytest.approx(base.item() - 0.1 * (1.0 + 2.0) / 2, abs=1e-6)
    (grad,) = torch.autograd.grad(bonus, entropy)
    torch.testing.assert_close(grad, weight)
    zeros = torch.zeros(2, 3)
    ppo = dict(values=zeros, old_values=zeros, returns=zeros, clip_range=0.2, clip_range_value=0.2)
    ppo |= dict(vf_coef=0.1, num_sequences=2)
    per_token = adv[:, None].expand(2, 3)  # ppo's advantages: one per token
    base, _ = ppo_lm.ppo_loss(logp, logp, per_token, mask, **ppo)
    bonus, _ = ppo_lm.ppo_loss(
        logp, logp, per_token, mask, **ppo, entropy=entropy, entropy_coef=0.1
    )
    assert bonus.item() == pytest.approx(base.item() - 0.1 * (1.0 + 2.0) / 2, abs=1e-6)
    (grad,) = torch.autograd.grad(bonus, entropy)
    torch.testing.assert_close(grad, weight)


def test_with_an_entropy_bonus_no_row_is_skipped(tiny_model_dir, tmp_path):
    # a term besides A's (here the entropy bonus, with --beta 0) has a gradient on the rows of
    # equal rewards too: the update keeps every row (every group's A is 0 here), so every token
    # of every completion is in the loss, and the bonus alone moves the policy
    kw = dict(beta=0.0, entropy_coef=0.05, total_steps=1)
    kept = grpo_lm.main(grpo_args(tiny_model_dir, tmp_path / "a", **kw), task=const_task())
    completions = 4 * 8  # tiny_args: 4 questions, G = 8
    assert kept["reward/frac_zero_std_groups"] == [1.0]  # every group: A = 0 everywhere
    tokens = kept["completion/length_mean"][0] * completions
    assert kept["loss/tokens"][0] == pytest.approx(tokens, rel=1e-6)
    assert kept["optim/grad_norm"][0] > 1e-3  # the bonus alone moves the policy


def const_task():
    task = digit_task()
    task.reward_fn = lambda completion, example: 0.5  # every advantage 0: the bonus acts alone
    return task


@pytest.mark.parametrize("module", [grpo_lm, ppo_lm])
def test_the_entropy_bonus_alone_raises_the_entropy(module, tiny_lora_model_dir, tmp_path):
    # (the LoRA tests' model, weights 10x larger: an entropy of ~3.7 nats, room to rise; the
    # default tiny model's is already ~4.3 of a uniform 4.4)
    # a constant reward (grpo: A = 0; ppo: GAE's advantages, a bonus large beside them) and
    # --entropy-coef: the policy's entropy at the sampled tokens rises step after step; without it,
    # it does not
    args = grpo_args if module is grpo_lm else ppo_args
    extra = dict(beta=0.0) if module is grpo_lm else dict(beta=0.0, num_ppo_epochs=1)

    def entropies(coef, name):
        kw = dict(total_steps=4, entropy_coef=coef, run_name=name, **extra)
        run = args(tiny_lora_model_dir, tmp_path, **kw)
        return module.main(run, task=const_task())["loss/entropy"]

    raised = entropies(2.0, "bonus")  # measured: 3.75 -> 4.16 (grpo), 3.74 -> 4.18 (ppo)
    assert raised[-1] > raised[0] + 0.1, raised
    flat = entropies(0.0, "none")
    assert flat[-1] < raised[-1] - 0.1, (flat, raised)
