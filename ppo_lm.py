"""Proximal Policy Optimization (PPO) for language models (RLHF), in one file.

Read beside "The N+ Implementation Details of RLHF with PPO" (Huang et al. 2024, arXiv 2403.17031)
and DeepSeekMath (Shao et al. 2024, arXiv 2402.03300) §4.1, whose eq. 1 and 2 state the PPO that
GRPO (grpo_lm.py) simplifies. Four models: the policy pi_theta (trained), a frozen reference pi_ref
(the initial policy), a reward (a frozen reward model, or the task's verifiable reward) and a value
model V_phi (trained).

  r_t      = score * [t = last token] - beta * KL_t,   KL_t = log pi_old(o_t|.) - log pi_ref(o_t|.)
                                                                                    (eq. 2; k1)
  delta_t  = r_t + gamma * V(s_t+1) - V(s_t),   A_t = sum_l (gamma * lam)^l delta_t+l
                                                                  (GAE, Schulman 2016 eq. 16)
  R_t      = A_t + V(s_t)                                                        (value target)
  J(theta) = E[ 1/|o| sum_t min(ratio_t * A_t, clip(ratio_t, 1-eps, 1+eps) * A_t) ]
                                                                           (eq. 1; PPO eq. 7)
  L(phi)   = E[ 1/|o| sum_t 0.5 * max((V_t - R_t)^2, (clip(V_t, V_old,t +- eps_v) - R_t)^2) ]
  loss     = -J(theta) + vf_coef * L(phi),  --num-ppo-epochs x --num-minibatches updates per batch

Read from the top down to the end of main(): the flags, the math (ALGO LOGIC, torch only), then
main(), steps 1-7 of a PPO iteration, each extension (off by default) behind its own `if args.X:`.
Below main(): rollout() and score() (steps 1-2) and the models, the micro-batches, last the run
plumbing. The policy loss differs from grpo_lm.py's only in where the advantage comes from (GAE on
a learned value) and where the KL goes (into the reward, per token; why KL_t is k1:
docs/ppo_lm.md).

Where this file departs from the N+ details' code (vwxyzjn/summarize_from_feedback_details,
ppo.py) and TRL's PPOTrainer:
  1. Losses are averaged per sequence over its |o| tokens, then over sequences (DeepSeekMath eq.
     1, as grpo_lm.py); both take one mean over every valid token of a micro-batch.
  2. The score lands on the EOS token (the last valid one); both add it one position later, on the
     first padding slot, whose value they train.
  3. A constant learning rate, 1e-5 by default; both anneal linearly to 0, the N+ code from 3e-6.
  4. Gradients are clipped per model, the policy's and the value model's apart; both train the two
     as one module under one optimizer and clip nothing.
  5. AdamW weight decay 0, as TRL; the N+ code keeps torch's 0.01.
  6. --missing-eos-penalty is subtracted from the score, as TRL's; the N+ code replaces it with -1.
  7. Padding is the tokenizer's pad token, or its EOS; the N+ code adds a [PAD] token.
  8. The task's verifiable reward is the default; without a reward model the value model starts
     from the policy with a zero head.

Under torchrun each process samples and trains on its share of --prompts-per-step; whitening, the KL
controller and the losses use the global batch; only rank 0 logs, evaluates and saves.

Usage:  python ppo_lm.py          (see --help for every flag)
        torchrun --nproc_per_node 8 ppo_lm.py --prompts-per-step 256
"""

import dataclasses
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import pydantic
import torch
import tyro
from annotated_types import Ge, Gt, Interval

import common
import tasks
from common import check


@dataclasses.dataclass
@pydantic.with_config(allow_inf_nan=False)  # common.check_flags: no NaN or inf in any flag
class Args:
    # --- the N+ details' RLHF-PPO: models, task and score, sampling, rewards, GAE, PPO updates ---

    # policy to train: a local directory or Hub id of a causal LM (the default loads offline)
    model_name_or_path: str = common.DEFAULT_MODEL
    # sequence-classification reward model with the policy's tokenizer, read where its own forward
    # pass pools (the last non-pad token) (default: the task's verifiable reward); frozen; the value
    # model starts from it, else from the policy with a zero head
    reward_model_path: str | None = None
    # built-in verifiable task: 'addition' ("What is a + b?", two-digit a, b) or 'multistep'
    # ("Compute (a + b) * c - d"); examples/ runs Countdown and others through --dataset
    task: Literal["addition", "multistep"] = "addition"
    # JSONL file of questions and answers (GSM8K's '... #### N' or a plain answer); overrides --task
    dataset: str | None = None
    # JSONL file of the held-out questions, same fields (default: --eval-size cut from the data)
    eval_dataset: str | None = None
    prompt_field: str = "question"  # --dataset: the field that holds the question
    answer_field: str = "answer"  # --dataset: the field that holds the answer
    # your own reward, path/to/file.py:function with function(completion, example) -> float,
    # repeatable ('task': the task's own); their weighted sum scores each completion (default: task)
    reward_fn: tyro.conf.UseAppendAction[list[str]] = dataclasses.field(default_factory=list)
    # weights of the --reward-fn functions, in order (default: 1 each)
    reward_weights: list[float] = dataclasses.field(default_factory=list)
    # what counts as right: file.py:function(response, example) -> bool (default: the task's check)
    correct_fn: str | None = None
    # system message before every question (default: none)
    system_prompt: str | None = None
    # the start of every answer (assistant prefill, e.g. '<think>'); rewards see it too
    response_prefix: str = ""
    # subtracted from the score of a completion without EOS, as TRL's missing_eos_penalty (0 = off)
    missing_eos_penalty: Annotated[float, Ge(0)] = 0.0
    # PPO iterations: sample a batch, then --num-ppo-epochs x --num-minibatches updates
    total_steps: Annotated[int, Ge(1)] = 30
    # questions sampled per step, one completion each (grpo_lm's 4 x G=8 before 2026-11-25)
    prompts_per_step: Annotated[int, Ge(1)] = 32
    max_new_tokens: Annotated[int, Ge(1)] = 64  # maximum completion length in tokens
    max_prompt_length: Annotated[int, Ge(1)] = 512  # longer prompts leave the training set
    temperature: Annotated[float, Ge(1e-3)] = 0.7  # sampling temperature T, also of the log probs
    # nucleus sampling (1.0 = sample from the full distribution, which the ratio assumes)
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    # KL coefficient of the per-token reward -beta * KL_t (0 = no reference model); with
    # --adaptive-kl-target its initial value (a resumed run continues the controller's beta)
    beta: Annotated[float, Ge(0)] = 0.05
    # KL_t's estimator: k1 = log pi_old - log pi_ref (the N+ details; as a reward its gradient
    # follows KL(pi || pi_ref)); k2 and k3 follow other targets there (docs/grpo_lm.md)
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    # scale the per-token rewards to unit variance over the batch's valid tokens (mean kept)
    whiten_rewards: bool = False
    gamma: Annotated[float, Interval(ge=0, le=1)] = 1.0  # discount over tokens
    lam: Annotated[float, Interval(ge=0, le=1)] = 0.95  # GAE lambda
    # AdamW learning rate of the policy (the N+ details' 3e-6 barely moves a 135M model in 30 steps)
    learning_rate: Annotated[float, Interval(gt=0, lt=1)] = 1e-5
    # AdamW learning rate of the value model (default: --learning-rate)
    value_learning_rate: Annotated[float, Interval(gt=0, lt=1)] | None = None
    adam_eps: Annotated[float, Gt(0)] = 1e-5  # AdamW epsilon (N+ details)
    weight_decay: Annotated[float, Ge(0)] = 0.0  # AdamW weight decay
    num_ppo_epochs: Annotated[int, Ge(1)] = 4  # passes over each sampled batch
    # optimizer steps per pass; --prompts-per-step must be divisible by it
    num_minibatches: Annotated[int, Ge(1)] = 1
    clip_range: Annotated[float, Interval(gt=0, lt=1)] = 0.2  # eps of the clipped surrogate
    # eps_v: how far the value may move from V_old before its loss is clipped
    clip_range_value: Annotated[float, Gt(0)] = 0.2
    vf_coef: Annotated[float, Gt(0)] = 0.1  # weight of the value loss
    # weight of the entropy bonus in the policy loss (PPO eq. 9's c2; 0: none, as in the papers)
    entropy_coef: Annotated[float, Ge(0)] = 0.0
    # gradient-norm clipping, of the policy and of the value model separately
    max_grad_norm: Annotated[float, Gt(0)] = 1.0

    # --- extension (off by default): the adaptive KL controller of Ziegler et al. 2019 ---

    # adapt beta towards this KL per sequence (nats, summed over tokens); None = fixed beta. Not the
    # early-stopping --target-kl of ppo_continuous.py and CleanRL: no update stops early here
    adaptive_kl_target: Annotated[float, Gt(0)] | None = None
    # horizon of the adaptive KL controller, in sequences: beta *= 1 + clip(KL / target - 1,
    # +-0.2) * N / horizon
    adaptive_kl_horizon: Annotated[int, Ge(1)] = 10000
    # grpo_lm.py's tools while sampling: refused here (GAE over a tool's tokens: docs/ppo_lm.md)
    tool: str | None = None

    # --- LoRA (Hu et al. 2021, through peft): low-rank adapters of the policy ---

    # rank R of the policy's LoRA adapters (0 = full fine-tuning); the reference is then the policy
    # with its adapter disabled; the value model is trained in full
    lora_rank: Annotated[int, Ge(0)] = 0
    # LoRA scale: the update of a weight is (alpha / R) * B A; default 2 x --lora-rank
    lora_alpha: Annotated[float, Gt(0)] | None = None
    # modules that get adapters: peft names (e.g. q_proj v_proj) or 'all-linear' (attention and MLP)
    lora_target_modules: tuple[str, ...] = ("all-linear",)

    # --- run: experiment, logging, evaluation, checkpoints ---

    # seed of the prompts, sampling, minibatch order and initialisation
    seed: Annotated[int, Interval(ge=0, le=2**32 - 1)] = 1
    runs_dir: str = "runs"  # TensorBoard logs, args and checkpoints go to {runs_dir}/{run_name}/
    # run directory (default: {task or dataset}__ppo__{seed}__{unix time})
    run_name: str | None = None
    # greedy held-out accuracy every N steps, and at the start and end (0: only there)
    eval_every: Annotated[int, Ge(0)] = 10
    # held-out questions for the accuracy (0 = no evaluation, nothing held out)
    eval_size: Annotated[int, Ge(0)] = 128
    eval_batch_size: Annotated[int, Ge(1)] = 64  # questions per decoding call
    # responses a held-out question: 1 greedy; n > 1 sampled (--temperature, --top-p): pass@k, maj@n
    eval_samples: Annotated[int, Ge(1)] = 1
    sample_every: Annotated[int, Ge(0)] = 5  # print and log samples every N steps (0 = never)
    save_every: Annotated[int, Ge(0)] = 10  # checkpoint every N steps and at the end (0 = end only)
    # checkpoint.pt to continue from: its run's flags are the defaults, flags given again override
    # them (same flags, same results); the model, reward model, --eval-size and run directory cannot
    # change
    resume: str | None = None
    # no training: the greedy held-out accuracy of the --resume checkpoint or of
    # --model-name-or-path (e.g. a run's final_model/), printed and written as JSON into the run dir
    eval_only: bool = False
    # also log to Weights & Biases (pip install wandb; $WANDB_PROJECT, default minimal-ppo-grpo,
    # and $WANDB_ENTITY choose where; WANDB_MODE=offline keeps it on disk)
    track: bool = False

    # --- scale-out and speed: devices, torchrun, micro-batches, bf16 ---

    device: str = "auto"  # 'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'
    # sequences per forward/backward pass; gradients are accumulated over a minibatch
    micro_batch_size: Annotated[int, Ge(1)] = 8
    # prompts per sampling call (0 = all of a process's): memory; the draws depend on --seed, the
    # step and each row's place in the batch alone (the samples, up to float rounding)
    generation_prompts_per_call: Annotated[int, Ge(0)] = 0
    # bfloat16 autocast on a CUDA GPU that supports it or a CPU with AVX512-BF16 (weights,
    # optimizer, LM head and log-softmax stay float32); float32 elsewhere
    bf16: bool = True
    # recompute the policy's and the value model's activations in the backward pass: less memory,
    # ~30% slower
    gradient_checkpointing: bool = False
    # under torchrun: the policy, the reference (and PPO's value model) sharded over the processes
    # (FSDP2, ZeRO-3; the policy whole while sampling), not one copy each; not with --lora-rank
    # (docs/scale.md)
    fsdp: bool = False


@dataclasses.dataclass
class Batch:
    """Steps 1-2 of a step, this process's share: N prompts left-padded to P tokens, one completion
    of at most T tokens each, and the completions' scores (set by :func:`score`)."""

    examples: list[dict]  # the question (and answer) of each prompt
    completions: list[str]  # the decoded completions
    input_ids: torch.Tensor  # (N, P + T) the prompt, then the completion (padding after its EOS)
    attention_mask: torch.Tensor  # (N, P + T) 1 for real tokens
    prompt_width: int  # P: the completions start at this column
    completion_mask: torch.Tensor  # (N, T) float, 1 up to and including the first EOS
    truncated: torch.Tensor  # (N,) bool on the CPU: no EOS within --max-new-tokens
    score: torch.Tensor | None = None  # (N,) the reward model's or task's, before the EOS penalty
    correct: torch.Tensor | None = None  # (N,) bool, the final answer is right
    reward_fns: dict = dataclasses.field(default_factory=dict)  # --reward-fn: each one's (N,)


# ----------------------------------------------------------------------------------------------
# ALGO LOGIC: the pieces of RLHF-PPO, in the order the loop below uses them (torch only)
# ----------------------------------------------------------------------------------------------
def completion_mask(completion_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, T) float mask of the (B, T) sampled tokens up to and including each completion's first
    EOS, 0 on the padding after it (the N+ details' "EOS trick"). Every row starts with 1."""
    is_eos = completion_ids == eos_token_id
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos.long()  # number of EOS strictly before t
    return (eos_before == 0).float()


def token_log_probs(model, input_ids, attention_mask, width, *, temperature, entropy_coef=None):
    """(B, T) ``log softmax(logits / temperature)`` of the last T = ``width`` tokens of the (B, P +
    T) left-padded ``input_ids`` (the completions); with ``entropy_coef`` also their (B, T) entropy,
    differentiable if it is not 0.

    Position ids count real tokens only, as in generation; the LM head and the log-softmax run in
    float32 also under bf16 autocast, a chunk of tokens at a time (``common.lm_head_log_probs``).
    """
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    decoder = model.get_decoder()  # the model without its LM head: hidden states (B, P + T, H)
    output = decoder(**inputs, use_cache=False)
    hidden = output.last_hidden_state[:, -width - 1 : -1]  # position j's gives token j + 1
    completion_ids = input_ids[:, -width:]
    head = model.get_output_embeddings()
    return common.lm_head_log_probs(
        head, hidden, completion_ids, temperature, entropy_coef=entropy_coef
    )


def token_values(value_model, input_ids, attention_mask, width: int) -> torch.Tensor:
    """(B, T) float32 values V(s_t) of the last T = ``width`` tokens of the (B, P + T)
    ``input_ids``: the ``score`` head of the sequence-classification ``value_model`` on its
    backbone's hidden states.

    The state s_t before completion token o_t ends at position P + t - 1, whose logits give
    pi(o_t | s_t): V(s_t) is read there. The state after the last token is terminal, valued 0.
    """
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    decoder = value_model.get_decoder()  # the backbone: hidden states (B, P + T, H)
    output = decoder(**inputs, use_cache=False)
    hidden = output.last_hidden_state
    states = hidden[:, -width - 1 : -1]  # s_t: positions P - 1 .. P + T - 2
    values = value_model.score(states)  # (B, T, 1)
    return values.squeeze(-1).float()


def per_token_rewards(scores, old_logp, ref_logp, mask, *, beta: float, estimator: str = "k1"):
    """(rewards, kl), both (B, T): ``-beta * KL_t`` on every valid token, plus the (B,) ``scores``
    on the last valid token (the EOS when there is one), 0 after it (DeepSeekMath eq. 2,
    InstructGPT eq. 2).

    ``KL_t`` from the (B, T) ``old_logp`` (pi_old, which sampled the tokens) and ``ref_logp``
    (None: no KL), ``r = pi_ref / pi_old``: k1 ``-log r`` (default), k2 ``(log r)^2 / 2``, k3 ``r -
    log r - 1`` (Schulman 2020). As a reward through the policy gradient, k1's expected gradient is
    that of KL(pi || pi_ref), so PPO optimises ``E[score] - beta * KL(pi || pi_ref)``; k3's is that
    of KL(pi || pi_ref) - KL(pi_ref || pi), k2's that of E_pi[k2] - KL(pi || pi_ref)
    (tests/test_kl.py, docs/grpo_lm.md).
    """
    kl = torch.zeros_like(mask)  # no reference model (beta = 0): no KL
    if ref_logp is not None:  # masked first: whatever follows the EOS (even inf) never enters
        valid = mask.bool()
        log_r = torch.where(valid, ref_logp - old_logp, 0.0)
        if estimator == "k1":
            kl = -log_r
        elif estimator == "k2":
            kl = log_r**2 / 2
        else:
            kl = torch.exp(log_r) - log_r - 1  # k3
    rewards = -beta * kl
    lengths = mask.sum(1).long()
    last = lengths.clamp(min=1) - 1  # index of each completion's last valid token
    rows = torch.arange(len(last))
    rewards[rows, last] += scores.to(rewards)
    return rewards, kl


def masked_whiten(x, mask, *, shift_mean=True, all_reduce=lambda tensor: tensor) -> torch.Tensor:
    """``(x - mean) / std`` of the (B, T) ``x``, mean and unbiased std over the valid tokens only
    (``shift_mean=False``: the mean is kept), 0 at masked tokens. The N+ details whiten the
    advantages, and optionally the rewards. ``all_reduce`` sums a tensor over processes (torchrun:
    ``common.all_reduce``, so the statistics are those of the global batch)."""
    local_count = mask.sum()
    local_total = (x * mask).sum()
    count, total = all_reduce(torch.stack([local_count, local_total]))
    mean = total / count.clamp(min=1)
    centered = x - mean
    squares = ((centered * mask) ** 2).sum()
    var = all_reduce(squares) / (count - 1).clamp(min=1)
    whitened = centered * torch.rsqrt(var + 1e-8)  # 1e-8: the N+ details' and TRL's
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def gae(rewards, values, mask, *, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both (B, T) and 0 at masked positions: Generalized Advantage
    Estimation over tokens (Schulman et al. 2016, eq. 16) from the (B, T) rewards and values.

    ``delta_t = r_t + gamma * V(s_t+1) - V(s_t)``, ``A_t = delta_t + gamma * lam * A_t+1``, ``R_t =
    A_t + V(s_t)``. The state after the last valid token is terminal: valued 0, nothing after it.
    """
    rewards = rewards * mask
    values = values * mask
    terminal = torch.zeros_like(values[:, :1])  # V of the state after the last token: 0
    next_values = torch.cat([values[:, 1:], terminal], 1)
    deltas = rewards + gamma * next_values - values
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    decay = gamma * lam
    for t in reversed(range(rewards.shape[1])):
        running = deltas[:, t] + decay * running
        advantages[:, t] = running
    advantages = advantages * mask
    returns = advantages + values
    return advantages, returns


def ppo_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    values,
    old_values,
    returns,
    clip_range,
    clip_range_value,
    vf_coef,
    num_sequences,
    entropy=None,
    entropy_coef=0.0,
):
    """(loss, stats) of a micro-batch: ``-J(theta) + vf_coef * L(phi)`` and detached sums (divide by
    ``tokens``) and extremes for logging.

    Policy: ``min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) + entropy_coef * H``, eps the
    ``clip_range`` (PPO eq. 7 and its entropy bonus, eq. 9; ``entropy`` H (b, T) with grad, read if
    ``entropy_coef``); value: ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) -
    R)^2)``, eps_v the ``clip_range_value`` (N+ details). Both are averaged over each sequence's
    ``|o|`` tokens (as grpo_lm.py does), summed and divided by the ``num_sequences`` of the whole
    minibatch, so micro-batch losses add up to the minibatch's. All tensors are (b, T): ``logp``
    (pi_theta) and ``values`` with grad; ``old_logp`` (pi_old), ``old_values`` (V_old) and
    ``returns`` from sampling time, ``advantages`` whitened; ``mask`` 1 up to the first EOS.
    """
    valid = mask.bool()
    log_ratio = torch.where(valid, logp - old_logp, 0.0)  # before exp(): no inf * 0 after the EOS
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    unclipped_objective = ratio * advantages
    clipped_objective = clipped_ratio * advantages
    surrogate = torch.min(unclipped_objective, clipped_objective)  # pessimistic: the lower
    if entropy_coef:  # the entropy bonus, in the policy loss
        surrogate = surrogate + entropy_coef * entropy
    value_change = torch.clamp(values - old_values, -clip_range_value, clip_range_value)
    values_clipped = old_values + value_change
    value_losses = (values - returns) ** 2
    value_losses_clipped = (values_clipped - returns) ** 2
    per_token_value_loss = 0.5 * torch.max(value_losses, value_losses_clipped)
    lengths = mask.sum(1).clamp(min=1)  # |o|
    policy_per_sequence = (surrogate * mask).sum(1) / lengths
    value_per_sequence = (per_token_value_loss * mask).sum(1) / lengths
    policy_loss = -policy_per_sequence.sum() / num_sequences
    value_loss = value_per_sequence.sum() / num_sequences
    loss = policy_loss + vf_coef * value_loss
    with torch.no_grad():
        # where the clip takes the gradient away
        clipped_high = (advantages > 0) & (ratio > 1 + clip_range)
        clipped_low = (advantages < 0) & (ratio < 1 - clip_range)
        clipped = clipped_high | clipped_low
        value_clipped = (value_losses_clipped > value_losses).float()
        approx_kl = (ratio - 1) - log_ratio  # k3 of KL(pi_old || pi)
        ratio_max = ratio.new_ones(1).max()  # none valid: 1
        if valid.any():
            ratio_max = ratio[valid].max()
        stats = {"policy_loss": policy_loss.detach(), "value_loss": value_loss.detach()}
        stats["tokens"] = mask.sum()
        stats["clipped"] = (clipped.float() * mask).sum()
        stats["approx_kl"] = (approx_kl * mask).sum()
        stats["value_clipped"] = (value_clipped * mask).sum()
        stats["ratio_max"] = ratio_max
    return loss, stats


def adaptive_kl_coef(beta, kl: float, *, target: float, num_sequences: int, horizon: int) -> float:
    """The next beta of the adaptive KL controller (Ziegler et al. 2019 §2.2, their
    lm-human-preferences code): ``beta * (1 + clip(kl / target - 1, -0.2, 0.2) * num_sequences /
    horizon)``, ``kl`` the batch's mean KL per sequence (nats). It never stops an update early."""
    error = kl / target - 1  # the KL's proportional error
    clipped_error = min(max(error, -0.2), 0.2)
    return beta * (1 + clipped_error * num_sequences / horizon)


# ----------------------------------------------------------------------------------------------
# RLHF-PPO, the N+ details' training loop
# ----------------------------------------------------------------------------------------------
def main(args: Args, task: tasks.Task | None = None) -> dict:
    """Train with PPO; returns the per-step history of logged scalars (a dict of lists; under
    torchrun, where each process runs this on its share of the batch, the global values on every
    rank). ``task`` replaces the built-in task: any :class:`tasks.Task`, e.g. with your own reward.
    """
    validate(args)  # a bad flag, checkpoint, dataset or reward file: one line, before any load
    flags = dataclasses.asdict(args)
    checkpoint = common.resume_checkpoint(flags, SCRIPT, FROZEN)  # --resume's, checked
    model_path = args.model_name_or_path
    data_name = Path(args.dataset or args.task).stem
    unix_time = int(time.time())
    default_name = f"{data_name}__ppo__{args.seed}__{unix_time}"
    run_name = args.run_name or default_name
    run_dir = common.make_run_dir(args.runs_dir, run_name, args.resume, args.eval_only)
    task = task or tasks.task_of(
        args.task,
        args.dataset,
        prompt_field=args.prompt_field,
        answer_field=args.answer_field,
        reward_fn=args.reward_fn,
        reward_weights=args.reward_weights,
        eval_size=args.eval_size,
        correct_fn=args.correct_fn,
        eval_dataset=args.eval_dataset,
    )
    tokenizer = common.load_tokenizer(model_path)
    if not args.eval_only:  # the training questions whose prompts fit
        questions = tasks.training_questions(
            task,
            tokenizer,
            system_prompt=args.system_prompt,
            response_prefix=args.response_prefix,
            max_prompt_length=args.max_prompt_length,
            minimum=args.prompts_per_step,
            max_new_tokens=args.max_new_tokens,
            model_path=model_path,
        )
    rank, world, device = common.start_processes(args.device)  # torchrun: each its share of a batch
    torch.manual_seed(args.seed)  # the minibatches' order (a checkpoint keeps its state)

    def held_out(pi):  # (metrics, responses) of the held-out questions; --eval-samples: sampled
        return tasks.held_out_accuracy(
            pi,
            tokenizer,
            task,
            size=args.eval_size,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.eval_batch_size,
            system_prompt=args.system_prompt,
            response_prefix=args.response_prefix,
            bf16=args.bf16,
            samples=args.eval_samples,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
        )

    # The four models of RLHF-PPO, dropout off: the policy pi_theta, a reference pi_ref (a frozen
    # copy of the initial policy; none with beta = 0), the reward (a frozen reward model, or the
    # task's verifiable reward) and the value model V_phi (N+ details: from the reward model, else
    # the policy). Every process loads the same weights: they stay equal (same all-reduced
    # gradients).
    lora = None
    if args.lora_rank:  # LoRA: the reference is the policy with its adapters off
        lora = (args.lora_rank, args.lora_alpha, args.lora_target_modules)
    policy = common.load_policy(model_path, device, lora, args.gradient_checkpointing)
    if args.eval_only:  # no training: the held-out accuracy of --resume's policy or of the model
        return tasks.eval_only(policy, checkpoint, held_out, run_dir / "eval.json")
    reference = None
    if args.beta > 0:  # read under bf16 autocast alone: bf16 Linear weights
        bf16 = common.bf16_active(device, args.bf16)
        reference = common.load_reference(
            policy, model_path, device, lora=lora is not None, bf16_weights=bf16
        )
    reward_model, value_model = load_reward_and_value_models(args, tokenizer, device)
    if args.fsdp:  # FSDP2: each process keeps its shard of the weights
        for model in (policy, reference, value_model):
            if model is not None:
                common.shard(model)
    policy_params = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters
    value_params = list(value_model.parameters())
    value_lr = args.value_learning_rate or args.learning_rate
    policy_group = {"params": policy_params}
    value_group = {"params": value_params, "lr": value_lr}
    adam = dict(lr=args.learning_rate, eps=args.adam_eps, weight_decay=args.weight_decay)
    groups = [policy_group, value_group]
    optimizer = torch.optim.AdamW(groups, **adam, fused=True)  # fused: one kernel (CPU and CUDA)
    start_step, beta = restore(checkpoint, args, policy, optimizer, value_model=value_model)
    progress_bar = dict(
        reward="reward/mean", kl="loss/kl", vloss="loss/value", len="completion/length_mean"
    )
    log = common.RunLog(
        run_dir,
        flags,
        rank=rank,
        start_step=start_step,
        resumed=checkpoint is not None,
        name="ppo",
        postfix=progress_bar,
        track=args.track,
    )
    sampler = Sampler(
        policy=policy,
        tokenizer=tokenizer,
        questions=questions,
        task=task,
        reward_model=reward_model,
        rank=rank,
        world=world,
        device=device,
    )
    evaluate_first = args.eval_size > 0 and not checkpoint  # the held-out accuracy at step 0
    log.evaluate(0, evaluate_first, lambda: held_out(policy)[0])
    if checkpoint:  # last: loading must not shift the random state
        common.rng_state(checkpoint["rng"])

    # Under torchrun each process holds N of the --prompts-per-step prompts; a minibatch is
    # minibatch_size prompts of every process, and the losses divide by minibatch_size * world.
    N = args.prompts_per_step // world
    minibatch_size = N // args.num_minibatches
    num_sequences = minibatch_size * world  # a minibatch's sequences, of every process
    steps = range(start_step, args.total_steps)
    for step in log.progress(steps, args.total_steps):
        t0 = time.time()
        # ---- 1. Rollout: a completion of each prompt from pi_old (the policy as it is now) ----
        batch = rollout(sampler, args, step)
        mask = batch.completion_mask  # (N, T): 1 up to and including each completion's first EOS
        gen_time = time.time() - t0

        # ---- 2. Score each completion: the reward model (as it pools) or the task's reward ----
        batch = score(batch, sampler, args)
        scores = batch.score
        if args.missing_eos_penalty:  # TRL's: a completion without EOS scores less
            penalty = args.missing_eos_penalty * batch.truncated.float()
            scores = scores - penalty

        # ---- 3. No-grad forward passes: log probs of pi_old and pi_ref, values V_old(s_t) ----
        old_logp = torch.zeros_like(mask)
        old_values = torch.zeros_like(mask)
        ref_logp = None
        if reference is not None:
            ref_logp = torch.zeros_like(mask)
        all_sequences = torch.arange(N, device=device)
        micro_batches = make_micro_batches(all_sequences, batch, args.micro_batch_size)
        with torch.no_grad(), common.bf16_autocast(device, args.bf16):
            for idx, ids, att, width in micro_batches:
                old_logp[idx, :width] = token_log_probs(
                    policy, ids, att, width, temperature=args.temperature
                )
                old_values[idx, :width] = token_values(value_model, ids, att, width)
                if reference is not None:
                    ref_logp[idx, :width] = token_log_probs(
                        reference, ids, att, width, temperature=args.temperature
                    )

        # ---- 4. Per-token rewards: -beta * KL_t on every token, the score on the last (eq. 2) ----
        rewards, kl = per_token_rewards(
            scores, old_logp, ref_logp, mask, beta=beta, estimator=args.kl_estimator
        )
        if args.whiten_rewards:  # N+ details (optional): unit variance over valid tokens, mean kept
            rewards = masked_whiten(rewards, mask, shift_mean=False, all_reduce=common.all_reduce)

        # ---- 5. GAE: advantages A_t and returns R_t = A_t + V(s_t); advantages whitened ----
        advantages, returns = gae(rewards, old_values, mask, gamma=args.gamma, lam=args.lam)
        advantages = masked_whiten(advantages, mask, all_reduce=common.all_reduce)  # every process

        # ---- 6. PPO updates: --num-ppo-epochs passes, --num-minibatches optimizer steps each ----
        loss_stats = []  # ppo_loss's stats of each micro-batch, for step_metrics
        grad_norms = []  # each update's (policy, value model) gradient norms
        updates_t0 = time.time()
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(N, device=device)  # a new split into minibatches each epoch
            for minibatch in order.split(minibatch_size):
                optimizer.zero_grad(set_to_none=True)
                # dropout is off (zeroed at load); train mode makes HF's gradient checkpointing
                # recompute activations, and does nothing else here
                policy.train(args.gradient_checkpointing)
                value_model.train(args.gradient_checkpointing)
                micro_batches = make_micro_batches(minibatch, batch, args.micro_batch_size)
                for idx, ids, att, width in micro_batches:
                    with common.bf16_autocast(device, args.bf16):
                        logp, entropy = token_log_probs(
                            policy,
                            ids,
                            att,
                            width,
                            temperature=args.temperature,
                            entropy_coef=args.entropy_coef,
                        )
                        values = token_values(value_model, ids, att, width)
                    mb_old_logp = old_logp[idx, :width]
                    mb_advantages = advantages[idx, :width]
                    mb_mask = mask[idx, :width]
                    mb_old_values = old_values[idx, :width]
                    mb_returns = returns[idx, :width]
                    loss, stats = ppo_loss(
                        logp,
                        mb_old_logp,
                        mb_advantages,
                        mb_mask,
                        values=values,
                        old_values=mb_old_values,
                        returns=mb_returns,
                        clip_range=args.clip_range,
                        clip_range_value=args.clip_range_value,
                        vf_coef=args.vf_coef,
                        num_sequences=num_sequences,
                        entropy=entropy,
                        entropy_coef=args.entropy_coef,
                    )
                    loss.backward()
                    stats["entropy"] = (entropy.detach() * mb_mask).sum()
                    loss_stats.append(stats)
                policy.eval()
                value_model.eval()
                if world > 1 and not args.fsdp:  # torchrun: summed over processes, as DDP
                    common.all_reduce_gradients(policy_params + value_params)
                # each model's gradient norm clipped on its own (a non-finite norm stops the run)
                policy_norm = common.clip_gradients_or_stop(policy_params, args.max_grad_norm, step)
                value_norm = common.clip_gradients_or_stop(value_params, args.max_grad_norm, step)
                grad_norms.append((policy_norm, value_norm))
                optimizer.step()

        # ---- 7. KL controller: the next step's beta (fixed by default, as the N+ details) ----
        step_beta = beta  # this step's, logged
        if args.adaptive_kl_target:  # Ziegler et al. 2019 §2.2: beta steers the KL to a target
            kl_sum = common.all_reduce(kl.sum()).item()  # every process's
            kl_per_sequence = kl_sum / args.prompts_per_step
            beta = adaptive_kl_coef(
                beta,
                kl_per_sequence,
                target=args.adaptive_kl_target,
                num_sequences=args.prompts_per_step,
                horizon=args.adaptive_kl_horizon,
            )

        # ---- logging, evaluation (every --eval-every), checkpoints (every --save-every) ----
        metrics = step_metrics(
            args,
            batch,
            scores,
            kl,
            beta=step_beta,
            loss_stats=loss_stats,
            grad_norms=grad_norms,
            t0=t0,
            gen_time=gen_time,
            updates_t0=updates_t0,
        )
        metrics |= value_metrics(old_values, returns, mask.bool())  # V_old and R_t
        done = step + 1  # steps done
        log(done, metrics)
        log.samples(done, sample_lines(batch), args.sample_every)
        is_last = done == args.total_steps
        periodic = args.eval_every > 0 and done % args.eval_every == 0
        eval_due = (is_last or periodic) and args.eval_size > 0
        log.evaluate(done, eval_due, lambda: held_out(policy)[0])
        save_checkpoint(
            log, done, args, policy, value_model=value_model, optimizer=optimizer, beta=beta
        )
    log.close()
    if args.total_steps > start_step:  # --fsdp: every process gathers the weights, rank 0 writes
        common.save_pretrained(policy, tokenizer, run_dir / "final_model", write=rank == 0)
    common.cleanup_distributed()  # the other processes wait until rank 0 has written everything
    return log.history


# ----------------------------------------------------------------------------------------------
# The N+ details' steps that are not equations: the rollout (step 1), the score (step 2), the
# reward and value models
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Sampler:
    """What steps 1-2 sample with and score by."""

    policy: Any  # pi_old: the policy as it is when the step starts
    tokenizer: Any
    questions: list[dict]  # the training questions whose prompts fit --max-prompt-length
    task: tasks.Task
    reward_model: Any  # None: the task's verifiable reward
    rank: int  # torchrun: this process samples the prompts rank * N .. rank * N + N - 1 of a step
    world: int
    device: torch.device


def rollout(sampler: Sampler, args: Args, step: int) -> Batch:
    """Step 1: this process's N prompts of the step and one completion of each from pi_old, the
    current policy; scores unset.

    The prompts are drawn from ``(--seed, step)``; the completions come from ``softmax(logits /
    temperature)`` (within the top-p nucleus), in calls of --generation-prompts-per-call prompts,
    each row's draws from ``(--seed, step, its place in the whole batch)``: they depend neither on
    the number of processes nor on the calls. Each completion is padded after its first EOS
    (:func:`completion_mask`).

    Raises:
        UsageError: the sampling probabilities are not finite (diverged weights).
    """
    tokenizer = sampler.tokenizer
    device = sampler.device
    N = args.prompts_per_step // sampler.world
    first = sampler.rank * N  # this process's prompts: first + 0..N-1
    rng = np.random.default_rng([args.seed, step])
    picks = rng.choice(len(sampler.questions), args.prompts_per_step, replace=False)
    ours = picks[first : first + N]  # this process's questions
    examples = [sampler.questions[i] for i in ours]
    questions = [ex["question"] for ex in examples]
    prompts = tasks.prompt_ids(tokenizer, questions, args.system_prompt, args.response_prefix)
    seed_keys = (args.seed, step)  # with each row's place in the batch: its draws' seed
    sampled = common.generate_completions(
        sampler.policy,
        prompts,
        1,
        tokenizer,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        bf16=args.bf16,
        seed_keys=seed_keys,
        first_index=first,
        per_call=args.generation_prompts_per_call,
    )
    pad = tokenizer.pad_token_id
    prompt_ids, prompt_mask = common.pad_left(prompts, pad, device)
    completion_ids = sampled.ids.to(device)  # padded after the EOS
    mask = completion_mask(completion_ids, tokenizer.eos_token_id)  # (N, T): none after the EOS
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, mask.long()], 1)
    ends = (completion_ids == tokenizer.eos_token_id) & mask.bool()  # each completion's EOS
    truncated = ~ends.any(1).cpu()
    return Batch(
        examples=examples,
        completions=texts,
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_width=prompt_ids.shape[1],
        completion_mask=mask,
        truncated=truncated,
    )


def score(batch: Batch, sampler: Sampler, args: Args) -> Batch:
    """Step 2: ``batch.score``, (N,) on the CPU, before the missing-EOS penalty: the frozen reward
    model's, read where its own forward pass pools, or else the task's reward (with --reward-fn
    each function's own rewards too, in ``reward_fns``); and ``correct``, the final answer is right.
    The reward functions read --response-prefix + completion.

    Raises:
        UsageError: a reward function raises or returns a non-finite value.
    """
    task = sampler.task
    responses = [args.response_prefix + c for c in batch.completions]
    if sampler.reward_model is not None:
        batch.score = tasks.score_with_reward_model(
            sampler.reward_model,
            batch.input_ids,
            batch.attention_mask,
            args.micro_batch_size,
            device=sampler.device,
            bf16=args.bf16,
        )
    else:
        batch.score, batch.reward_fns = tasks.score_task(task, responses, batch.examples)
    batch.correct = tasks.score_correct(task, responses, batch.examples)
    return batch


def load_reward_and_value_models(args: Args, tokenizer, device) -> tuple[Any, Any]:
    """The frozen reward model of --reward-model-path (None without it) and the value model V_phi,
    a backbone with a scalar head ('score'): from the reward model (N+ details), or else from the
    policy with its new head zeroed, so that every initial value is 0 rather than noise.

    Raises:
        UsageError: a model that cannot take a value head, or whose vocabulary does not fit the
            tokenizer.
    """
    if args.reward_model_path is None:  # the value model starts from the policy
        reward_model = None
        model_path = args.model_name_or_path
        flag = "--model-name-or-path"
    else:  # ... from the reward model (N+ details)
        model_path = args.reward_model_path
        flag = "--reward-model-path"
        reward_model = common.load_reward_model(model_path, tokenizer, device)
        reward_model.eval().requires_grad_(False)  # frozen
    value_model = common.load_model(model_path, "reward", device, flag=flag, vocab=len(tokenizer))
    value_model.eval()
    no_head = f"{flag}: cannot attach a value head ('score') to {model_path}"
    check(hasattr(value_model, "score"), no_head)
    if reward_model is None:  # a new head: zeroed
        for p in value_model.score.parameters():
            torch.nn.init.zeros_(p)
    if args.gradient_checkpointing:  # HF checkpoints in train mode only: the updates switch it on
        value_model.activation_checkpointing_enable({"use_reentrant": False})
    return reward_model, value_model


# ----------------------------------------------------------------------------------------------
# Scale-out and speed: micro-batches (torchrun: common.py)
# ----------------------------------------------------------------------------------------------
def make_micro_batches(indices: torch.Tensor, batch: Batch, size: int):
    """``indices`` in micro-batches of ``size`` sequences of similar completion length, each
    (idx, input_ids, attention_mask, width) trimmed of the padding it does not need (left of its
    longest prompt, right of its longest completion: the completions fill the last ``width``
    columns). The losses are sums over sequences, so the grouping changes no result, only the time
    spent on padding."""
    P = batch.prompt_width
    lengths = batch.completion_mask.sum(1)  # (N,) each completion's tokens
    order = indices[torch.argsort(lengths[indices], descending=True, stable=True)]
    for idx in order.split(size):
        real = batch.attention_mask[idx, :P].any(0)  # the prompt columns with a real token
        first = int(real.float().argmax())
        width = int(lengths[idx].max())  # its longest completion
        columns = slice(first, P + width)
        input_ids = batch.input_ids[idx, columns]
        attention_mask = batch.attention_mask[idx, columns]
        yield idx, input_ids, attention_mask, width


# ----------------------------------------------------------------------------------------------
# TRY NOT TO MODIFY: run plumbing (validation, resume, metrics, logging, checkpoints)
# ----------------------------------------------------------------------------------------------
SCRIPT = "ppo_lm.py"  # written into checkpoints: --resume refuses another script's
# the flags a resumed run cannot change: its directory, data, objective, weights' shapes
FROZEN = (
    "model_name_or_path",
    "runs_dir",
    "run_name",
    "task",
    "dataset",
    "eval_dataset",
    "prompt_field",
    "answer_field",
    "eval_size",
    "max_prompt_length",
    "system_prompt",
    "response_prefix",
    "reward_fn",
    "reward_weights",
    "correct_fn",
    "reward_model_path",
    "lora_rank",
    "lora_alpha",
    "lora_target_modules",
)
# ppo_loss's sums, added over the micro-batches of a step
SUMMED = ("policy_loss", "value_loss", "tokens", "clipped", "value_clipped", "approx_kl", "entropy")


def validate(args: Args) -> None:
    """One-line errors (:class:`UsageError`, naming the flag) for flag values that cannot work,
    before anything loads: each flag's own constraint and the rules both LM scripts share
    (``common.check_flags``, ``tasks.check_task_flags``), then PPO's."""
    common.check_flags(Args, dataclasses.asdict(args))
    tasks.check_task_flags(
        args.reward_fn,
        args.reward_weights,
        prompt_field=args.prompt_field,
        answer_field=args.answer_field,
        system_prompt=args.system_prompt,
        response_prefix=args.response_prefix,
    )
    two = "--reward-fn and --reward-model-path are two rewards: pick one"
    check(not (args.reward_fn and args.reward_model_path), two)
    prompts = args.prompts_per_step
    world = common.world_size()
    minibatches = args.num_minibatches
    divisible = f"must be divisible by --num-minibatches {minibatches}"
    by_minibatches = f"--prompts-per-step {prompts} {divisible}"
    check(prompts % minibatches == 0, by_minibatches)
    needs_beta = "--adaptive-kl-target needs --beta > 0 (the controller scales beta)"
    check(args.adaptive_kl_target is None or args.beta > 0, needs_beta)
    processes = f"the world size {world} (the number of torchrun processes)"
    by_processes = f"--prompts-per-step {prompts} must be divisible by {processes}"
    check(prompts % world == 0, by_processes)
    no_tools = "--tool: not in ppo_lm.py (GAE over a tool's tokens needs a design: docs/ppo_lm.md)"
    check(args.tool is None, no_tools)
    per_process = prompts // world
    share = f"--prompts-per-step {prompts} / world size {world} = {per_process}"
    check(per_process % minibatches == 0, f"{share} prompts per process {divisible}")


def restore(checkpoint: dict | None, args: Args, policy, optimizer, *, value_model):
    """Resume: the checkpoint's weights and optimizer state, whose hyperparameters the flags given
    now set again (--learning-rate, --value-learning-rate, --adam-eps, --weight-decay). Returns the
    step to start from and its KL coefficient: with --adaptive-kl-target on resume the controller's
    saved value, else --beta (0 and --beta without a checkpoint). The frozen flags make the
    shapes agree."""
    if checkpoint is None:
        return 0, args.beta
    common.load_trained_weights(policy, checkpoint["policy"])  # the same models: the weights fit
    common.load_state(value_model, checkpoint["value_model"])
    common.load_optimizer_state(optimizer, checkpoint["optimizer"])
    value_lr = args.value_learning_rate or args.learning_rate
    learning_rates = (args.learning_rate, value_lr)
    for group, lr in zip(optimizer.param_groups, learning_rates, strict=True):
        group.update(lr=lr, eps=args.adam_eps, weight_decay=args.weight_decay)
    beta = args.beta
    if args.adaptive_kl_target:  # the controller's beta continues
        beta = checkpoint["kl_coef"]
    return checkpoint["step"], beta


def step_metrics(
    args, batch, scores, kl, *, beta, loss_stats, grad_norms, t0, gen_time, updates_t0
):
    """A step's logged scalars over the global batch (gathered from every process): ``reward/mean``
    is the score before the missing-EOS penalty, ``reward/score`` after it, ``reward/non_score`` the
    summed -beta * KL_t; ``loss/*`` means over the updates or over the tokens of every micro-batch.
    ``loss_stats``: :func:`ppo_loss`'s of each micro-batch; ``grad_norms``: each update's (policy,
    value model) gradient norms; ``t0``, ``gen_time``, ``updates_t0``: the step's start time, step
    1's seconds and the start time of step 6, the updates."""
    mask = batch.completion_mask
    non_score = (-beta * kl).sum(1).cpu()
    kl_sum = common.all_reduce(kl.sum()).item()  # every process's; kl is 0 after each EOS
    # every process's sequences
    raw_scores = common.all_gather(batch.score.float().cpu())  # before the missing-EOS penalty
    correct = common.all_gather(batch.correct.float().cpu())
    scores = common.all_gather(scores.float().cpu())
    non_score = common.all_gather(non_score.float().cpu())
    lengths = common.all_gather(mask.sum(1).cpu())
    truncated = common.all_gather(batch.truncated.float().cpu())
    local_sums = [sum(float(stats[key]) for stats in loss_stats) for key in SUMMED]
    sums = common.all_reduce(torch.tensor(local_sums)).tolist()  # every process's
    totals = dict(zip(SUMMED, sums, strict=True))
    local_ratio_max = max(float(stats["ratio_max"]) for stats in loss_stats)
    ratio_max = common.all_reduce(torch.tensor(local_ratio_max), "max").item()
    loss_tokens = max(totals["tokens"], 1)  # the tokens of every update's micro-batches
    batch_tokens = max(lengths.sum().item(), 1)  # the batch's valid tokens
    updates = len(grad_norms)
    policy_norms = [float(policy_norm) for policy_norm, _ in grad_norms]
    value_norms = [float(value_norm) for _, value_norm in grad_norms]
    now = time.time()
    scalars = {}
    scalars["reward/mean"] = raw_scores.mean().item()
    scalars["reward/std"] = raw_scores.std().item()
    scalars["reward/accuracy"] = correct.mean().item()
    scalars["reward/score"] = scores.mean().item()
    scalars["reward/non_score"] = non_score.mean().item()
    scalars["reward/total"] = (scores + non_score).mean().item()
    scalars["loss/policy"] = totals["policy_loss"] / updates
    scalars["loss/value"] = totals["value_loss"] / updates
    scalars["loss/kl"] = kl_sum / batch_tokens
    scalars["loss/clip_fraction"] = totals["clipped"] / loss_tokens
    scalars["loss/value_clip_fraction"] = totals["value_clipped"] / loss_tokens
    scalars["loss/approx_kl"] = totals["approx_kl"] / loss_tokens
    scalars["loss/entropy"] = totals["entropy"] / loss_tokens
    scalars["loss/ratio_max"] = ratio_max
    scalars["kl/sequence_mean"] = kl_sum / args.prompts_per_step
    scalars["kl/beta"] = beta
    scalars["completion/length_mean"] = lengths.mean().item()
    scalars["completion/frac_truncated"] = truncated.mean().item()
    scalars["optim/grad_norm"] = sum(policy_norms) / updates
    scalars["optim/value_grad_norm"] = sum(value_norms) / updates
    scalars["time/generation_s"] = gen_time
    scalars["time/training_s"] = now - t0 - gen_time
    scalars["time/update_s_per_epoch"] = (now - updates_t0) / args.num_ppo_epochs
    scalars["time/step_s"] = now - t0
    scalars |= common.peak_memory_gb(kl.device)
    scalars |= common.reward_fn_means(batch.reward_fns)  # --reward-fn
    return scalars


def value_metrics(values: torch.Tensor, returns: torch.Tensor, valid: torch.Tensor) -> dict:
    """``value/*``: the mean value and return over every process's valid tokens, and the explained
    variance ``1 - Var(R - V) / Var(R)`` (NaN when the returns do not vary)."""
    # each process has its own number of valid tokens: gathered as objects, any length
    local_returns = [returns[valid].cpu()]
    local_values = [values[valid].cpu()]
    returns = torch.cat(common.all_gather_objects(local_returns))  # every process's
    values = torch.cat(common.all_gather_objects(local_values))
    returns_var = returns.var()
    explained = float("nan")
    if returns_var > 0:
        residual_var = (returns - values).var()
        explained = (1 - residual_var / returns_var).item()
    scalars = {"value/mean": values.mean().item()}
    scalars["value/returns_mean"] = returns.mean().item()
    scalars["value/explained_variance"] = explained
    return scalars


def save_checkpoint(log, step: int, args: Args, policy, *, value_model, optimizer, beta) -> None:
    """Every --save-every steps and at the end, atomically (rank 0; --fsdp: every process gathers
    the shards): what resume needs to continue exactly (the next step's beta included; not the
    reference, which resume loads from --model-name-or-path, which cannot change)."""
    periodic = args.save_every and step % args.save_every == 0
    due = periodic or step == args.total_steps
    if not due:
        return
    state = {"script": SCRIPT, "step": step, "args": dataclasses.asdict(args)}
    state["kl_coef"] = beta  # the next step's
    state["policy"] = common.trained_weights(policy)
    state["value_model"] = value_model.state_dict()
    state["optimizer"] = optimizer.state_dict()
    state["rng"] = common.rng_state()
    state = common.full_tensors(state)
    if log.is_main:
        common.atomic_save(state, log.checkpoint)


def sample_lines(batch: Batch) -> list[str]:
    """Rank 0's first four completions with their scores, for the printed and logged samples."""
    lines = []
    for i in range(min(4, len(batch.completions))):
        question = batch.examples[i]["question"]
        completion = batch.completions[i]
        reward = batch.score[i]
        lines.append(f"[reward {reward:.2f}] {question!r} -> {completion!r}")
    return lines


def cli(argv: list[str] | None = None) -> None:
    """The command line (``python ppo_lm.py --help``): bad input ends in one ``error: ...`` line and
    exit code 2."""
    common.run_cli(lambda: main(common.parse_args(Args, argv, SCRIPT)))


if __name__ == "__main__":
    cli()
