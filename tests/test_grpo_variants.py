"""grpo_lm.py variants: loss types, reward scaling, clip-higher, GSPO, process supervision, DAPO
sampling and shaping, iterative RL with a reward model. Hand-computed numbers on small padded
batches, then tiny-model runs."""

import math
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import ROOT, make_tokenizer, tolerance
from test_grpo_lm import digit_task, tiny_args

import common
import grpo_lm
import tasks

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

LN2 = math.log(2.0)
EPS = 1e-4


# ---------------------------------------------------------------------------------------------
# Loss aggregation (--loss-type), clip-higher, GSPO
# ---------------------------------------------------------------------------------------------
def padded_batch():
    """Two completions, the first padded: 2 and 3 valid tokens; ratio 1.1 on token (0, 0), 1
    elsewhere.

    With A = (1, -2) the masked per-token surrogates are [1.1, 1, -] and [-2, -2, -2]:
    sums 2.1 and -6 over 5 tokens. The padded token has a huge ratio that must not count.
    """
    old = torch.zeros(2, 3)
    logp = torch.tensor([[math.log(1.1), 0.0, 50.0], [0.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    return logp, old, torch.tensor([1.0, -2.0]), mask


@pytest.mark.parametrize(
    "loss_type, extra, loss, grad00",
    [
        (
            "grpo",
            {},
            -(2.1 / 2 - 6 / 3) / 2,
            -1.1 / 2 / 2,
        ),  # eq. 3: mean per sequence, then over sequences
        ("bnpo", {}, -(2.1 - 6) / 5, -1.1 / 5),  # one micro-batch: token mean over its 5 tokens
        (
            "dr_grpo",
            {"max_length": 4},
            -(2.1 - 6) / (2 * 4),
            -1.1 / 8,
        ),  # sum / (B * L_max)
        ("dapo", {"num_tokens": 10}, -(2.1 - 6) / 10, -1.1 / 10),  # sum / tokens of the whole batch
    ],
)
def test_loss_types_hand_computed(loss_type, extra, loss, grad00):
    logp, old, adv, mask = padded_batch()
    out, stats = grpo_lm.grpo_loss(
        logp,
        old,
        None,
        adv,
        mask=mask,
        clip_range=0.2,
        beta=0.0,
        num_sequences=2,
        loss_type=loss_type,
        **extra,
    )
    out.backward()
    assert out.item() == pytest.approx(loss, abs=1e-6)
    assert logp.grad[0, 0].item() == pytest.approx(grad00, abs=1e-6)
    assert logp.grad[0, 2].item() == 0.0 and stats["tokens"].item() == 5


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("variant", [{}, {"clip_range_high": 0.28}, {"level": "sequence"}])
def test_micro_batch_losses_add_up_for_every_loss_type(loss_type, variant):
    g = torch.Generator().manual_seed(2)
    logp, old, ref = (torch.randn(6, 5, generator=g) * 0.3 for _ in range(3))
    adv, mask = torch.randn(6, generator=g), (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1
    kw = dict(loss_type=loss_type, num_tokens=mask.sum().item(), max_length=5, **variant)

    def loss(s, **over):
        terms = {**kw, **over}
        return grpo_lm.grpo_loss(
            logp[s],
            old[s],
            ref[s],
            adv[s],
            mask=mask[s],
            clip_range=0.2,
            beta=0.04,
            num_sequences=6,
            **terms,
        )[0]

    full = loss(slice(0, 6))
    parts = [slice(0, 2), slice(2, 6)]
    if loss_type != "bnpo":
        torch.testing.assert_close(sum(loss(s) for s in parts), full)
    else:  # bnpo: a token mean per micro-batch, weighted by its share of sequences;
        # one micro-batch = dapo
        torch.testing.assert_close(full, loss(slice(0, 6), loss_type="dapo"))
        by_hand = sum(
            loss(s, loss_type="dapo", num_tokens=mask[s].sum().item()) * (s.stop - s.start) / 6
            for s in parts
        )
        torch.testing.assert_close(sum(loss(s) for s in parts), by_hand)
        assert not torch.isclose(by_hand, full)  # bnpo really depends on the micro-batching


@pytest.mark.parametrize(
    "ratio, adv, high, loss, grad",
    [
        (1.25, 1.0, None, -1.2, 0.0),  # symmetric eps 0.2: clipped at 1.2
        (1.25, 1.0, 0.28, -1.25, -1.25),  # clip-higher lets a positive-advantage token rise to 1.28
        (1.35, 1.0, 0.28, -1.28, 0.0),  # ... and no further
        (0.75, -1.0, 0.28, 0.8, 0.0),  # the lower side keeps eps_low = 0.2
    ],
)
def test_clip_higher_value_and_gradient(ratio, adv, high, *, loss, grad):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out, stats = grpo_lm.grpo_loss(
        logp,
        torch.zeros(1, 1),
        None,
        torch.tensor([adv]),
        mask=torch.ones(1, 1),
        clip_range=0.2,
        beta=0.0,
        num_sequences=1,
        clip_range_high=high,
    )
    out.backward()
    assert out.item() == pytest.approx(loss, abs=1e-6)
    assert logp.grad.item() == pytest.approx(grad, abs=1e-6)
    side, other = ("clipped_high", "clipped_low")[:: 1 if adv > 0 else -1]  # by the sign of A
    assert stats[side].item() == (1.0 if grad == 0.0 else 0.0) and stats[other].item() == 0


def test_gspo_sequence_level_ratio_hand_computed():
    # log ratios: sequence 0 [ln 2, 0, (pad 50)], sequence 1 [0, 0, -ln 2]
    # s_0 = exp(ln2 / 2) = sqrt 2, s_1 = exp(-ln2 / 3) = 2^(-1/3); A = (1, -1)
    logp = torch.tensor([[LN2, 0.0, 50.0], [0.0, 0.0, -LN2]], requires_grad=True)
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    s0, s1 = math.sqrt(2), 2 ** (-1 / 3)
    out, stats = grpo_lm.grpo_loss(
        logp,
        torch.zeros(2, 3),
        None,
        torch.tensor([1.0, -1.0]),
        mask=mask,
        clip_range=0.5,
        beta=0.0,
        num_sequences=2,
        level="sequence",
    )
    out.backward()
    assert out.item() == pytest.approx(-(s0 - s1) / 2, abs=1e-6)  # -0.310255
    # d/dlogp_t of s_i = s_i / |o_i|: -(1/2) * s0 / 2 for sequence 0, +(1/2) * s1 / 3 for sequence
    # 1, 0 on padding
    expected = torch.tensor([[-s0 / 4, -s0 / 4, 0.0], [s1 / 6, s1 / 6, s1 / 6]])
    torch.testing.assert_close(logp.grad, expected)
    assert stats["ratio_max"].item() == pytest.approx(s0, abs=1e-6)
    logp.grad = None
    out, _ = grpo_lm.grpo_loss(
        logp,
        torch.zeros(2, 3),
        None,
        torch.tensor([1.0, -1.0]),
        mask=mask,
        clip_range=0.2,
        beta=0.0,
        num_sequences=2,
        level="sequence",
    )
    out.backward()  # eps 0.2: sqrt 2 > 1.2 with A > 0 and 0.794 < 0.8 with A < 0 are both clipped
    assert (
        out.item() == pytest.approx(-(1.2 - 0.8) / 2, abs=1e-6)
        and logp.grad.abs().sum().item() == 0.0
    )


# ---------------------------------------------------------------------------------------------
# Advantages: --scale-rewards, process supervision; DAPO overlong shaping; replay mix
# ---------------------------------------------------------------------------------------------
GROUPS = torch.arange(8) // 4  # two groups of G = 4


def test_scale_rewards_batch_and_none():
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 2])
    centred = torch.tensor([0.5, -0.5, -0.5, 0.5, -0.5, -0.5, -0.5, 1.5])  # group means 0.5 and 0.5
    none = grpo_lm.group_advantages(rewards, GROUPS, eps=EPS, scale="none")
    torch.testing.assert_close(none, centred)
    batch_std = math.sqrt(4.0 / 7)  # sum of squared deviations from 0.5 is 4, unbiased over 8
    batch = grpo_lm.group_advantages(rewards, GROUPS, eps=EPS, scale="batch")
    torch.testing.assert_close(batch, centred / (batch_std + EPS))


def test_rloo_and_reinforce_plus_plus_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 2])
    # RLOO: r_i minus the mean of the group's other 3 rewards, no std: 1 - 1/3, 0 - 2/3, ...; in
    # the second group 0 - 2/3 and 2 - 0
    rloo = grpo_lm.group_advantages(rewards, GROUPS, eps=EPS, baseline="rloo")
    torch.testing.assert_close(rloo, torch.tensor([2, -2, -2, 2, -2, -2, -2, 6]) / 3)
    group_std = grpo_lm.group_advantages(rewards, GROUPS, eps=EPS, scale="group", baseline="rloo")
    std = torch.tensor([1 / 3] * 4 + [1.0] * 4).sqrt()  # unbiased: (1/4 * 4) / 3, (3/4 * 4) / 3
    torch.testing.assert_close(group_std, rloo / (std + EPS))
    # REINFORCE++: the batch's mean 0.5 and unbiased std sqrt(4/7), whatever the groups
    plus = grpo_lm.group_advantages(rewards, GROUPS, eps=EPS, baseline="reinforce++")
    torch.testing.assert_close(plus, (rewards - 0.5) / (math.sqrt(4 / 7) + EPS))
    everyone = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 2, 5, 5, 5, 5])  # another process's group
    spans = grpo_lm.group_advantages(
        rewards, GROUPS, eps=EPS, scale="none", baseline="reinforce++", batch=everyone
    )
    torch.testing.assert_close(spans, rewards - 24 / 12)
    for baseline in ("rloo", "reinforce++"):  # a group of equal rewards: rloo 0, reinforce++ not
        equal = grpo_lm.group_advantages(
            torch.tensor([1.0] * 4 + [0.0] * 4), GROUPS, eps=0.0, scale=None, baseline=baseline
        )
        assert (equal == 0).all() == (baseline == "rloo"), equal


SHAPE = dict(shape=(4, 5), group_size=2)  # process_example's (N, T) and G


def process_example():
    """Two groups of G = 2, T = 5; steps given as (completion, last token, reward), in no particular
    order."""
    steps = [
        (0, 1, 1.0),
        (1, 2, 0.0),
        (0, 4, 1.0),
        (1, 3, 0.0),  # group 0: rewards 1, 1, 0, 0
        (3, 4, 0.0),
        (2, 0, 1.0),
        (2, 2, 0.0),
    ]  # group 1: rewards 0 | 1, 0
    seq, end, r = zip(*steps, strict=True)
    return torch.tensor(r), torch.tensor(seq), torch.tensor(end)


def test_process_advantages_hand_computed():
    r, seq, end = process_example()
    adv = grpo_lm.process_advantages(r, seq, end, shape=(4, 5), group_size=2, eps=EPS)
    n0 = 0.5 / (
        math.sqrt(1 / 3) + EPS
    )  # group 0: mean 0.5, unbiased std sqrt(1/3), steps become +-n0
    n1 = 1 / (
        math.sqrt(1 / 3) + EPS
    )  # group 1: [1, 0, 0], mean 1/3, std sqrt(1/3): 2/3 n1, -1/3 n1, -1/3 n1
    expected = torch.tensor(
        [
            [2 * n0, 2 * n0, n0, n0, n0],  # steps ending at 1 and 4 are both at or after t = 0, 1
            [-2 * n0, -2 * n0, -2 * n0, -n0, 0.0],  # nothing ends at or after t = 4
            [n1 / 3, -n1 / 3, -n1 / 3, 0.0, 0.0],
            [-n1 / 3] * 5,
        ]
    )
    torch.testing.assert_close(adv, expected)
    none = grpo_lm.process_advantages(r, seq, end, **SHAPE, eps=EPS, scale="none")
    torch.testing.assert_close(none[0], torch.tensor([1.0, 1, 0.5, 0.5, 0.5]))
    torch.testing.assert_close(none[2], torch.tensor([1 / 3, -1 / 3, -1 / 3, 0, 0]))
    batch = grpo_lm.process_advantages(r, seq, end, **SHAPE, eps=EPS, scale="batch")
    torch.testing.assert_close(
        batch, none / (math.sqrt(2 / 7) + EPS)
    )  # std of [1,1,0,0,1,0,0] = sqrt(2/7)


def test_process_advantages_with_rloo_and_reinforce_plus_plus_hand_computed():
    r, seq, end = process_example()
    # RLOO: each step reward minus the mean of its group's other steps. Group 0 [1, 1, 0, 0]:
    # +-2/3; group 1 [0 (completion 3), 1, 0 (completion 2)]: -1/2, 1, -1/2
    rloo = grpo_lm.process_advantages(r, seq, end, **SHAPE, eps=EPS, baseline="rloo")
    expected = [
        [4 / 3, 4 / 3, 2 / 3, 2 / 3, 2 / 3],  # steps +2/3 ending at tokens 1 and 4
        [-4 / 3, -4 / 3, -4 / 3, -2 / 3, 0],  # -2/3 at tokens 2 and 3
        [1 / 2, -1 / 2, -1 / 2, 0, 0],  # +1 at token 0, -1/2 at token 2
        [-1 / 2] * 5,  # -1/2 at token 4
    ]
    torch.testing.assert_close(rloo, torch.tensor(expected))
    # REINFORCE++: the 7 steps' mean 3/7 and std sqrt(2/7), across groups: up u, down d
    plus = grpo_lm.process_advantages(r, seq, end, **SHAPE, eps=EPS, baseline="reinforce++")
    u, d = (torch.tensor([4 / 7, -3 / 7]) / (math.sqrt(2 / 7) + EPS)).tolist()
    expected = [[2 * u, 2 * u, u, u, u], [2 * d, 2 * d, 2 * d, d, 0], [u + d, d, d, 0, 0], [d] * 5]
    torch.testing.assert_close(plus, torch.tensor(expected))


def test_process_advantages_with_only_final_answers_equal_outcome_advantages():
    g = torch.Generator().manual_seed(0)
    rewards, lengths = torch.rand(8, generator=g), torch.tensor([3, 5, 1, 4, 5, 2, 2, 5])
    adv = grpo_lm.process_advantages(
        rewards, torch.arange(8), lengths - 1, shape=(8, 5), group_size=4, eps=EPS
    )
    outcome = grpo_lm.group_advantages(rewards, GROUPS, eps=EPS)
    for i in range(
        8
    ):  # every token up to the answer carries the outcome advantage, nothing after it
        torch.testing.assert_close(adv[i, : lengths[i]], outcome[i].expand(int(lengths[i])))
        assert adv[i, lengths[i] :].abs().sum() == 0


def test_overlong_penalty_hand_computed():
    lengths = torch.tensor([5, 6, 7, 10])  # L_max 10, L_cache 4: free up to 6, then -1/4 per token
    mask = (torch.arange(10) < lengths[:, None]).float()  # (4, 10), |o| ones each
    torch.testing.assert_close(
        grpo_lm.overlong_penalty(mask, 10, 4), torch.tensor([0.0, 0.0, -0.25, -1.0])
    )
    assert grpo_lm.overlong_penalty(mask, 10, 0).abs().sum() == 0


def test_replay_mix_ratio():
    rng = np.random.default_rng(0)
    new, history = [("new", i) for i in range(90)], [("old", i) for i in range(200)]
    mix = grpo_lm.replay_mix(new, history, 0.1, rng)
    replayed = [x for x in mix if x[0] == "old"]
    assert (
        len(mix) == 100 and len(replayed) == 10 and len(set(replayed)) == 10
    )  # 10% historical, no repeats
    assert mix[:90] == new
    assert (
        len(grpo_lm.replay_mix(new[:24], history, 0.1, rng)) == 24 + 3
    )  # 24 * 0.1 / 0.9 = 2.67 -> 3
    assert len(grpo_lm.replay_mix(new, history[:4], 0.1, rng)) == 94  # at most the whole history
    assert grpo_lm.replay_mix(new, history, 0.0, rng) == new


# ---------------------------------------------------------------------------------------------
# Checkable steps, the multi-step task, character offsets -> token indices
# ---------------------------------------------------------------------------------------------
def test_arithmetic_steps_are_parsed_and_checked():
    text = "12 + 7 = 19\n19 * 3 = 56\nthen 56 - 5 = 51"
    assert grpo_lm.arithmetic_step_rewards(text) == [(11, True), (23, False), (40, True)]
    assert grpo_lm.arithmetic_step_rewards("(12 + 7) * 3 - 5 = 52") == [(21, True)]
    assert grpo_lm.arithmetic_step_rewards("She sold 48/2 = <<48/2=24>>24 clips") == [
        (25, True)
    ]  # GSM8K annotation
    assert grpo_lm.arithmetic_step_rewards("$1,200 + $300 = $1,500 and 10 / 4 = 2.5.") == [
        (22, True),
        (39, True),
    ]
    assert (
        grpo_lm.arithmetic_step_rewards("__import__('os') = 3, x = 5, 2 ** 3 = 8") == []
    )  # parsed, never evaluated
    assert grpo_lm.arithmetic_step_rewards("1 / 0 = 5") == [(9, False)]
    assert grpo_lm.arithmetic_step_rewards(text, {}) == [(11, 1.0), (23, 0.0), (40, 1.0)]


def test_multistep_task_and_its_reference_solutions():
    task = tasks.make_multistep_task(num_test=16)
    assert len(task.test) == 16 and len(task.train) == 10_000 - 16
    assert tasks.make_multistep_task(num_test=16).test == task.test  # a fixed held-out split
    for ex in task.test:
        steps = grpo_lm.arithmetic_step_rewards(ex["solution"])
        assert len(steps) == 3 and all(ok for _, ok in steps)
        assert task.reward_fn(ex["solution"], ex) == 1.0 and task.correct_fn(ex["solution"], ex)


def char_batch(tok, texts: list[str], rewards: list[float]) -> grpo_lm.Batch:
    """A Batch of ``texts`` as completions of a character tokenizer (each + EOS, right-padded),
    with their outcome ``rewards``."""
    rows = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    T = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows])
    mask = grpo_lm.completion_mask(ids, tok.eos_token_id)
    batch = grpo_lm.Batch(
        prompt_ids=ids[:, :1],
        prompt_mask=mask[:, :1].long(),
        completion_ids=ids,
        completion_mask=mask,
        sampled_mask=mask,  # no tool: the policy drew every token
        sampler_log_probs=torch.zeros_like(mask),
        examples=[{}] * len(texts),
        completions=texts,
        tool_calls=torch.zeros(len(texts), 2, dtype=torch.long),
    )
    batch.rewards = torch.tensor(rewards)
    return batch


def test_step_ends_map_to_token_indices_with_a_character_tokenizer(monkeypatch):
    # one token per character: a step ending at character offset e ends at token e - 1; a step past
    # the end at the last token (the EOS), where the final answer's step also ends
    tok = make_tokenizer()
    texts = ["12+7=19\n19*3=56\nso 56", "999"]
    assert [e for e, _ in grpo_lm.arithmetic_step_rewards(texts[0])] == [7, 15]
    batch = char_batch(tok, texts, [1.0, 0.0])
    T = batch.completion_ids.shape[1]
    seen = {}

    def process_advantages(rewards, seq, end, *, shape, **baselines):
        seen.update(rewards=rewards.tolist(), seq=seq.tolist(), end=end.tolist())
        return torch.zeros(shape)

    def steps(text, example):  # the arithmetic steps, and one past the end
        return grpo_lm.arithmetic_step_rewards(text) if text == texts[0] else [(999, 0.5)]

    monkeypatch.setattr(grpo_lm, "process_advantages", process_advantages)
    args = SimpleNamespace(group_size=2, scale_rewards=None, prompts_per_step=1)
    args.advantage = "grpo"
    args.response_prefix = ""  # the step reward function reads the completion alone
    advantages = grpo_lm.process_supervision(batch, tok, args, "cpu", step_reward_fn=steps)
    assert advantages.shape == (2, T)
    assert seen == dict(  # the final answer: one more step with the outcome reward
        rewards=[1.0, 0.0, 1.0, 0.5, 0.0], seq=[0, 0, 0, 1, 1], end=[6, 14, 21, 3, 3]
    )
    assert batch.scalars == {
        "process/steps_per_completion": 3 / 2,
        "process/step_reward_mean": 1.5 / 3,
    }

    def raises(text, example):
        raise KeyError("oops")

    with pytest.raises(
        common.UsageError, match=r"^step reward function raised KeyError: 'oops' on"
    ):
        grpo_lm.process_supervision(batch, tok, args, "cpu", step_reward_fn=raises)


# ---------------------------------------------------------------------------------------------
# Runs on the tiny model: process supervision learns, reference reset, reward model, dynamic
# sampling
# ---------------------------------------------------------------------------------------------
def digit_steps(completion: str, example: dict) -> list[tuple[int, float]]:
    """Every character is a step: reward 1 for a digit, 0 otherwise (a dense, learnable step
    reward)."""
    return [(k + 1, float(c.isdigit())) for k, c in enumerate(completion)]


def test_process_supervision_learns_from_step_rewards_alone(tiny_model_dir, tmp_path):
    task = digit_task()
    task.reward_fn = lambda completion, example: (
        0.0
    )  # no outcome signal at all: only the steps can teach
    outcome = grpo_lm.main(tiny_args(tiny_model_dir, tmp_path / "o", total_steps=1), task=task)
    # outcome supervision: every advantage is 0, and the KL's gradient is 0 at the reference (to
    # float rounding: log probs with and without grad may differ by ~5e-7 in 2-group micro-batches;
    # on CUDA, under bf16 autocast, an H100 measured a norm of 4.5e-7)
    assert outcome["optim/grad_norm"][0] < tolerance(1e-7, 1e-5)
    history = grpo_lm.main(
        tiny_args(tiny_model_dir, tmp_path / "p", total_steps=15, supervision="process"),
        task=task,
        step_reward_fn=digit_steps,
    )
    digits = history[
        "process/step_reward_mean"
    ]  # fraction of completion characters that are digits
    first, last = sum(digits[:3]) / 3, sum(digits[-3:]) / 3
    assert first < 0.35, digits  # seeds 3 and 4 went 0.13 -> 0.9 in 15 steps
    assert last > first + 0.4, digits


def test_reference_is_reset_to_the_policy_every_iteration(tiny_model_dir, tmp_path):
    one = grpo_lm.main(
        tiny_args(tiny_model_dir, tmp_path / "a", total_steps=2, beta=0.1), task=digit_task()
    )
    two = grpo_lm.main(
        tiny_args(tiny_model_dir, tmp_path / "b", total_steps=2, beta=0.1, iterations=2),
        task=digit_task(),
    )
    # exactly 0 on the CPU; on CUDA the shared prompt pass under bf16 autocast gave -1.6e-10 (an
    # H100), and a reference left unreset 8e-3
    zero = tolerance(0.0, 1e-6)
    assert abs(one["loss/kl"][0]) <= zero  # step 1: reference = initial policy
    assert two["loss/kl"][0] == one["loss/kl"][0]
    assert one["loss/kl"][1] > zero  # one iteration: the policy moved away from the reference
    assert abs(two["loss/kl"][1]) <= zero  # step 2 starts iteration 2: reference <- policy
    assert two["loss/policy"][0] == one["loss/policy"][0]


def test_reward_model_is_trained_with_replay_and_resumes_exactly(tiny_model_dir, tmp_path):
    kw = {
        "total_steps": 4,
        "iterations": 2,
        "train_reward_model": True,
        "beta": 0.04,
        "save_every": 1,
        "rm_learning_rate": 1e-2,
    }
    full = grpo_lm.main(tiny_args(tiny_model_dir, tmp_path / "a", **kw), task=digit_task())
    # 32 samples per step, 2 steps per iteration: 64 per iteration, 16 held out, 48 trained on
    assert full["reward_model/train_size"] == [48, 48 + 5]  # 48 * 0.1 / 0.9 = 5.3 -> 5 replayed
    assert full["reward_model/replayed"] == [0, 5]
    assert len(full["reward_model/heldout_accuracy"]) == 2 and "reward/verifiable_mean" in full
    ckpt = common.load_checkpoint(tmp_path / "a" / "run" / "checkpoint.pt")
    assert ckpt["step"] == 4 and len(ckpt["rm_replay"]) == 96 and ckpt["rm_new"] == []
    assert ckpt["reference"] is not None  # --iterations 2 resets it: resume needs it
    assert [g["weight_decay"] for g in ckpt["rm_optimizer"]["param_groups"]] == [
        0.0
    ]  # --weight-decay, as the policy's
    initial = common.load_model(str(tiny_model_dir), kind="reward")
    assert not torch.equal(
        ckpt["reward_model"]["score.weight"], initial.state_dict()["score.weight"]
    )

    # interrupt the same run in step 3 (its reward function fails), then resume from the step-2
    # checkpoint
    task, calls = digit_task(), [0]
    digits = task.reward_fn

    def fails_in_step_3(completion, example):  # after the step-0 evaluation's 8 responses
        calls[0] += 1  # (their mean reward is logged) and steps 1-2's 64 samples
        if calls[0] > 8 + 64:
            raise RuntimeError("stop")
        return digits(completion, example)

    task.reward_fn = fails_in_step_3
    with pytest.raises(common.UsageError):
        grpo_lm.main(tiny_args(tiny_model_dir, tmp_path / "b", **kw), task=task)
    resumed = grpo_lm.main(
        tiny_args(
            tiny_model_dir,
            tmp_path / "b",
            **kw,
            resume=str(tmp_path / "b" / "run" / "checkpoint.pt"),
        ),
        task=digit_task(),
    )
    for key in (
        "reward/mean",
        "loss/policy",
        "loss/kl",
        "reward_model/heldout_accuracy",
        "reward_model/train_mse",
    ):
        assert resumed[key] == pytest.approx(full[key][-len(resumed[key]) :], rel=1e-5, abs=1e-7), (
            key
        )
    assert len(resumed["reward/mean"]) == 2


def test_dynamic_sampling_keeps_only_groups_with_different_rewards(tiny_model_dir, tmp_path):
    task = digit_task()
    digits = task.reward_fn
    task.reward_fn = lambda c, ex: (
        1.0 if int(ex["question"][0]) % 2 == 0 else digits(c, ex)
    )  # even a: all equal
    plain = grpo_lm.main(tiny_args(tiny_model_dir, tmp_path / "a", total_steps=3), task=task)
    assert max(plain["reward/frac_zero_std_groups"]) > 0
    dyn = grpo_lm.main(
        tiny_args(
            tiny_model_dir,
            tmp_path / "b",
            total_steps=3,
            dynamic_sampling=True,
            max_sampling_rounds=8,
        ),
        task=task,
    )
    assert dyn["reward/frac_zero_std_groups"] == [0.0, 0.0, 0.0]
    assert max(dyn["sampling/rounds"]) > 1 and dyn["sampling/frac_groups_varied"] == [1.0, 1.0, 1.0]
    capped = grpo_lm.main(
        tiny_args(
            tiny_model_dir,
            tmp_path / "c",
            total_steps=3,
            dynamic_sampling=True,
            max_sampling_rounds=1,
        ),
        task=task,
    )  # one round: the batch is topped up
    assert (
        capped["sampling/rounds"] == [1.0, 1.0, 1.0]
        and capped["reward/frac_zero_std_groups"] == plain["reward/frac_zero_std_groups"]
    )


def test_merge_groups_repads_rows_of_different_rounds():
    def batch(prompts, completions, rewards):  # G = 2; 0 is the pad id
        mask = (torch.tensor(completions) != 0).float()
        out = grpo_lm.Batch(
            prompt_ids=torch.tensor(prompts),
            prompt_mask=(torch.tensor(prompts) != 0).long(),
            completion_ids=torch.tensor(completions),
            completion_mask=mask,
            sampled_mask=mask * (torch.tensor(completions) != 9),  # a tool wrote the 9s
            sampler_log_probs=-mask,
            examples=[{"r": r} for r in rewards],
            completions=[str(r) for r in rewards],
            tool_calls=torch.tensor([[r, 0] for r in rewards]).long(),
        )
        out.rewards, out.correct, out.reward_fns = (
            torch.tensor(rewards),
            torch.tensor(rewards),
            {"f": -torch.tensor(rewards)},
        )
        return out

    a = batch(
        [[0, 5], [0, 5], [6, 6], [6, 6]], [[1, 2], [3, 0], [4, 4], [4, 4]], [1.0, 0.0, 1.0, 1.0]
    )
    b = batch([[7], [7]], [[8, 9, 9], [8, 0, 0]], [0.0, 1.0])
    out = grpo_lm.merge_groups([a, b], [(1, 0), (0, 0)], 2, 0)  # G = 2, pad id 0
    assert out.prompt_ids.tolist() == [[0, 7], [0, 7], [0, 5], [0, 5]]  # prompts stay left-padded
    assert out.prompt_mask.tolist() == [[0, 1], [0, 1], [0, 1], [0, 1]]
    assert out.completion_ids.tolist() == [
        [8, 9, 9],
        [8, 0, 0],
        [1, 2, 0],
        [3, 0, 0],
    ]  # completions right-padded
    assert out.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]]
    assert out.sampled_mask.tolist() == [[1, 0, 0], [1, 0, 0], [1, 1, 0], [1, 0, 0]]
    assert out.sampler_log_probs.tolist() == (-out.completion_mask).tolist()
    assert out.tool_calls[:, 0].tolist() == [0, 1, 1, 0]
    assert out.rewards.tolist() == [0.0, 1.0, 1.0, 0.0] and out.verifiable is None
    assert out.reward_fns["f"].tolist() == [
        -0.0,
        -1.0,
        -1.0,
        -0.0,
    ]  # each function's rewards follow their rows
    assert out.completions == ["0.0", "1.0", "1.0", "0.0"] and out.examples[2] == {"r": 1.0}


def test_mask_truncated_completions_leaves_them_out_of_the_loss(tiny_model_dir, tmp_path):
    kw = dict(total_steps=1, beta=0.0)
    plain = grpo_lm.main(tiny_args(tiny_model_dir, tmp_path / "a", **kw), task=digit_task())
    masked = grpo_lm.main(
        tiny_args(tiny_model_dir, tmp_path / "b", mask_truncated_completions=True, **kw),
        task=digit_task(),
    )
    n, max_new = 4 * 8, 12
    length, frac = plain["completion/length_mean"][0], plain["completion/frac_truncated"][0]
    assert (
        masked["completion/length_mean"][0] == length
        and masked["completion/frac_truncated"][0] == frac
    )  # same samples
    assert 0 < frac < 1, frac  # some completions hit --max-new-tokens 12, some emitted EOS
    assert plain["loss/tokens"][0] == pytest.approx(length * n)  # every valid token
    # a truncated completion never emitted EOS, so it is exactly max_new tokens long: all of them
    # leave the loss
    assert masked["loss/tokens"][0] == pytest.approx(length * n - frac * n * max_new)
    # their rewards still shape the group advantages, but only the finished completions carry
    # gradient
    assert (
        masked["reward/mean"] == plain["reward/mean"]
        and masked["optim/grad_norm"] != plain["optim/grad_norm"]
    )


def test_dapo_flags_run_together(tiny_model_dir, tmp_path):
    history = grpo_lm.main(
        tiny_args(
            tiny_model_dir,
            tmp_path,
            total_steps=2,
            loss_type="dapo",
            clip_range_high=0.28,
            overlong_buffer=4,
            mask_truncated_completions=True,
            scale_rewards="none",
            importance_sampling_level="sequence",
            mu=2,
        ),
        task=digit_task(),
    )
    # most completions of the untrained model hit --max-new-tokens 12: the overlong penalty pulls
    # the reward down
    assert history["completion/frac_truncated"][0] > 0.5 and history["reward/mean"][0] < -0.5
    assert all(math.isfinite(x) for x in history["loss/policy"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"loss_type": "ppo"},
            "--loss-type: must be 'grpo', 'bnpo', 'dr_grpo', 'dapo' or 'cispo', got 'ppo'",
        ),
        ({"scale_rewards": "std"}, "--scale-rewards: must be"),
        ({"importance_sampling_level": "seq"}, "--importance-sampling-level: must be"),
        ({"supervision": "steps"}, "--supervision: must be 'outcome' or 'process'"),
        ({"iterations": 7}, "--iterations 7 must divide --total-steps 36"),
        ({"overlong_buffer": 20}, "--overlong-buffer: below --max-new-tokens"),
        ({"overlong_buffer": -1}, "--overlong-buffer: must be greater than or equal to 0"),
        ({"rm_replay_ratio": 1.0}, "--rm-replay-ratio: must be less than 1"),
        ({"clip_range_high": 0.0}, "--clip-range-high: must be greater than 0"),
        ({"max_sampling_rounds": 0}, "--max-sampling-rounds: must be greater than or equal to 1"),
    ],
)
def test_variant_flags_are_validated(overrides, message):
    with pytest.raises(common.UsageError) as err:
        grpo_lm.validate(grpo_lm.Args(**overrides))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_cli_variant_error_is_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "grpo_lm.py"), "--loss-type", "ppo"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    # a Literal choice flag: tyro lists the choices in --help and rejects the rest, in one line
    assert out.stderr.strip().splitlines() == [
        "error: invalid choice 'ppo' for argument '--loss-type'. Expected one of ('grpo', "
        "'bnpo', 'dr_grpo', 'dapo', 'cispo')."
    ]


# ---------------------------------------------------------------------------------------------
# Issue 13 ("Trust I"): iterative RL and the smaller truths
# ---------------------------------------------------------------------------------------------
def test_a_reward_model_trained_from_the_backbone_never_scores_before_its_first_training(
    tiny_model_dir, tmp_path
):
    # item 2: without --reward-model-path the reward model starts with a random score head;
    # iteration 1 is scored by the verifiable reward it will be trained on, and the reward model
    # scores from iteration 2 on
    kw = {"total_steps": 2, "iterations": 2, "train_reward_model": True, "rm_learning_rate": 1e-2}
    h = grpo_lm.main(tiny_args(tiny_model_dir, tmp_path, **kw), task=digit_task())
    assert (
        h["reward/mean"][0] == h["reward/verifiable_mean"][0]
    )  # iteration 1: advantages of the verifiable reward
    assert (
        h["reward/mean"][1] != h["reward/verifiable_mean"][1]
    )  # iteration 2: the trained reward model's scores
    with pytest.raises(
        common.UsageError,
        match="--train-reward-model without --reward-model-path needs --iterations >= 2",
    ):
        grpo_lm.validate(grpo_lm.Args(train_reward_model=True))


def test_resume_refuses_to_move_the_iteration_boundaries(tiny_model_dir, tmp_path):
    # item 8: --iterations splits --total-steps; a resumed run with another --total-steps would move
    # the boundaries
    grpo_lm.main(
        tiny_args(tiny_model_dir, tmp_path, total_steps=2, iterations=2, save_every=1, beta=0.1),
        task=digit_task(),
    )
    ckpt = str(tmp_path / "run" / "checkpoint.pt")
    with pytest.raises(
        common.UsageError,
        match=r"^--total-steps: this run's iterations have 1 steps; resume with that length$",
    ):
        grpo_lm.main(
            tiny_args(tiny_model_dir, tmp_path, total_steps=6, iterations=2, beta=0.1, resume=ckpt),
            task=digit_task(),
        )
    resumed = grpo_lm.main(
        tiny_args(tiny_model_dir, tmp_path, total_steps=3, iterations=3, beta=0.1, resume=ckpt),
        task=digit_task(),
    )  # the same iteration length: fine
    assert resumed["loss/kl"] == [0.0]  # step 3 starts iteration 3: reference <- policy


def test_eval_size_zero_means_no_evaluation(tiny_model_dir, tmp_path):
    # item 8: --eval-size 0 turns the held-out evaluation off (and holds nothing out)
    h = grpo_lm.main(
        tiny_args(tiny_model_dir, tmp_path, total_steps=1, eval_size=0), task=digit_task()
    )
    assert "eval/accuracy" not in h and len(h["reward/mean"]) == 1


def test_dynamic_sampling_keeps_the_reward_functions_own_means(tiny_model_dir, tmp_path):
    # issue 22: with --dynamic-sampling the reward/<fn>/mean scalars were lost (the merged batch
    # dropped them); they are the means over the batch that is trained on
    (tmp_path / "r.py").write_text(
        "def length(completion, example):\n    return float(len(completion) % 3)\n"
    )
    h = grpo_lm.main(
        tiny_args(
            tiny_model_dir,
            tmp_path,
            total_steps=2,
            dynamic_sampling=True,
            reward_fn=[f"{tmp_path}/r.py:length"],
        )
    )
    assert len(h["reward/length/mean"]) == 2
    assert h["reward/length/mean"] == pytest.approx(h["reward/mean"])  # the only function, weight 1


def test_a_step_reward_function_reads_what_a_reward_function_reads(monkeypatch):
    # --response-prefix: the step reward function gets prefix + completion, as a reward function
    # does, and its offsets count the prefix's characters; a step inside the prefix (not the
    # policy's text) is not paid, and the completion's steps end at the same tokens as without it
    tok = make_tokenizer()
    texts = ["12+7=19\n19*3=56", "999"]
    batch = char_batch(tok, texts, [1.0, 0.0])
    received = []
    seen = {}

    def process_advantages(rewards, seq, end, *, shape, **baselines):
        seen[prefix] = (rewards.tolist(), seq.tolist(), end.tolist())
        return torch.zeros(shape)

    def steps(text, example):
        received.append(text)
        return grpo_lm.arithmetic_step_rewards(text)

    monkeypatch.setattr(grpo_lm, "process_advantages", process_advantages)
    for prefix in ("", "Check: 1+1=2. "):
        args = SimpleNamespace(group_size=2, scale_rewards=None, prompts_per_step=1)
        args.advantage = "grpo"
        args.response_prefix = prefix
        grpo_lm.process_supervision(batch, tok, args, "cpu", step_reward_fn=steps)
    assert received == texts + ["Check: 1+1=2. " + text for text in texts]
    assert seen["Check: 1+1=2. "] == seen[""]  # the prefix's own equation is not a step
    assert seen[""] == ([1.0, 0.0, 1.0, 0.0], [0, 0, 0, 1], [6, 14, 15, 3])
