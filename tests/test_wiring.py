"""The wiring of DeepSeekMath's extensions, checked on its own (issue 41, goal 7): what a recorded
history would notice only as "a number moved" is pinned here by what it must be.

- Iterative RL (§4.1.4): the reward model's continual training fits its labels (on synthetic ones
  its held-out error falls), its labels are the verifiable rewards (not the rewards the policy was
  trained on), and the held-out samples never reach a training minibatch.
- Process supervision (§4.1.3): the final answer is one more step, at the last token, with the
  outcome reward, and the advantages are the sums of the normalised step rewards from t on.
"""

from types import SimpleNamespace

import pytest
import torch
from conftest import make_tokenizer
from test_grpo_variants import char_batch

import common
import grpo_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def synthetic_batch(tok, rng: torch.Generator, n: int = 32) -> grpo_lm.Batch:
    """``n`` one-question samples whose completion starts with a digit (label 1) or a letter
    (label 0); ``rewards`` (what the policy trained on) differ from those verifiable labels."""
    first = torch.randint(0, 2, (n,), generator=rng)
    texts = [("7" if f else "x") + "=" + "ab"[i % 2] for i, f in enumerate(first.tolist())]
    prompts = [tok("q:", add_special_tokens=False)["input_ids"]] * n
    prompt_ids, prompt_mask = common.pad_left(prompts, tok.pad_token_id)
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    completion_ids = torch.tensor(ids)
    mask = grpo_lm.completion_mask(completion_ids, tok.eos_token_id)
    batch = grpo_lm.Batch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=mask,
        sampled_mask=mask,  # no tool: the policy drew every token
        sampler_log_probs=torch.zeros_like(mask),
        examples=[{}] * n,
        completions=texts,
        tool_calls=torch.zeros(n, 2, dtype=torch.long),
    )
    batch.verifiable = first.float()
    batch.rewards = batch.verifiable + 5.0  # e.g. an overlong penalty's shift: never a label
    return batch


def test_the_reward_model_fits_the_verifiable_rewards_and_never_trains_on_held_out_samples(
    tiny_reward_model_dir, monkeypatch
):
    tok = make_tokenizer()
    model = common.load_model(str(tiny_reward_model_dir), kind="reward").eval()
    model.config.pad_token_id = tok.pad_token_id
    args = SimpleNamespace(
        rm_learning_rate=3e-3, weight_decay=0.0, micro_batch_size=8, seed=0, rm_eval_fraction=0.25,
        rm_replay_ratio=0.1, rm_epochs=4, bf16=False,
    )  # fmt: skip
    training = grpo_lm.RewardModelTraining(model, tok, args, torch.device("cpu"))
    trained, evaluated = [], []  # the samples of each training minibatch, and of each evaluation
    scores = training.scores

    def spy(samples):
        (trained if torch.is_grad_enabled() else evaluated).append(samples)
        return scores(samples)

    monkeypatch.setattr(training, "scores", spy)
    rng = torch.Generator().manual_seed(0)
    history = []
    for step in range(3):  # three iterations of 2 batches each
        for _ in range(2):
            training.add(synthetic_batch(tok, rng))
        assert {s["label"] for s in training.new} == {0.0, 1.0}  # the verifiable rewards
        history.append(training.train(step))
    held_out = {id(s) for batch in evaluated for s in batch}
    assert len(held_out) == 3 * 16 and not held_out & {id(s) for b in trained for s in b}
    assert [h["reward_model/train_size"] for h in history] == [48, 53, 53]  # 48 + 5 replayed
    first, last = history[0], history[-1]
    assert last["reward_model/heldout_mse"] < 0.5 * first["reward_model/heldout_mse"], history
    assert last["reward_model/heldout_accuracy"] > 0.9, history


def test_process_supervision_ends_with_the_outcome_at_the_last_token():
    # a group of G = 2 completions of a character tokenizer, by hand: completion 0 "1+1=2\nso 2"
    # has one right step ending at character 5 (token 4) and the outcome reward 1; completion 1
    # "1+1=3" a wrong step ending at token 4 and the outcome 0. The four step rewards [1, 1, 0, 0]
    # are normalised together (mean 0.5, std 0.5774): r~ = +-0.8659; A_i,t sums the r~ of the steps
    # ending at or after t.
    tok = make_tokenizer()
    batch = char_batch(tok, ["1+1=2\nso 2", "1+1=3"], [1.0, 0.0])
    T, mask = batch.completion_ids.shape[1], batch.completion_mask
    args = SimpleNamespace(group_size=2, scale_rewards="group", prompts_per_step=1)
    args.advantage = "grpo"
    args.response_prefix = ""  # the step reward function reads the completion alone
    steps = grpo_lm.arithmetic_step_rewards
    advantages = grpo_lm.process_supervision(batch, tok, args, "cpu", step_reward_fn=steps)
    r = 0.5 / (torch.tensor([1.0, 1.0, 0.0, 0.0]).std().item() + 1e-4)  # |r~| of every step
    expected = torch.zeros(2, T)
    expected[0, :5] = 2 * r  # the step (token 4) and the final answer (token 10, the EOS) after t
    expected[0, 5:11] = r  # only the final answer's step ends at or after t
    expected[1, :5] = -2 * r  # the wrong step ends at token 4, the final answer at the EOS, token 5
    expected[1, 5] = -r
    torch.testing.assert_close(advantages, expected)
    assert advantages[0, 10] == pytest.approx(r) and mask[0].sum() == 11  # at the last token
