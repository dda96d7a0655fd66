"""Group Relative Policy Optimization (GRPO) for language models, in one file.

Read beside DeepSeekMath (Shao et al. 2024, arXiv 2402.03300), §4.1 and its Algorithm 1: sample a
group of G outputs o_i of each question q from pi_old, give every token of o_i the group-normalised
reward as its advantage (§4.1.2), and maximise the clipped surrogate with a k3 KL penalty to a
frozen reference (eq. 3, 4); no value model:

  J(theta) = E[ 1/G sum_i 1/|o_i| sum_t { min(ratio_it * A_it, clip(ratio_it, 1-eps, 1+eps) * A_it)
                                          - beta * KL_it } ],
  ratio_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t),
  KL_it    = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1                                     (eq. 4)

With --mu 1 pi_old = pi_theta and ratio_it = 1 (its gradient is still eq. 3's); with --mu > 1 the
old log probs are stored once before the first of the mu updates.

Read from the top down to the end of main(): Args; Batch (steps 1-2's samples); ALGO LOGIC, the
math (group_advantages §4.1.2, token_log_probs, kl_estimate eq. 4, grpo_loss eq. 3, aggregate);
main(), Algorithm 1 step by step. Below main(): steps 1-2 (sample_and_score, reward), then each
extension in a labelled section, reaching the loop through one line tagged with its source:
process supervision (§4.1.3) and iterative RL with a retrained reward model (§4.1.4); Dr. GRPO
(arXiv 2503.20783), DAPO (arXiv 2503.14476), GSPO (arXiv 2507.18071); micro-batches; then the
run plumbing. Every flag defaults to the paper's GRPO (eq. 3, beta 0.04, eq. 4's k3 to a frozen
reference) unless its value cannot work at this scale: learning rate 1e-5 (1e-6 barely moves a 135M
model in 36 steps), G = 8 outputs of 8 questions a step (the paper: 64 of 1,024), 20 new tokens
(1,024; the sums take 12-16), 36 steps, the task's verifiable reward instead of a reward model,
KL and ratio between temperature-scaled distributions. --beta 0 (TRL's default) runs faster: no
reference model, groups of equal rewards skipped. Open choices: process supervision makes the final
answer a step with the outcome reward; the iterative reward model regresses (MSE) on it.

Several GPUs (as nanoGPT): `torchrun --nproc_per_node K grpo_lm.py ...` gives each process whole
groups of the global --prompts-per-step, normalises every loss by global counts and sums gradients
once per update, so K processes take one process's step. Only rank 0 logs, evaluates and saves.

Usage:  python grpo_lm.py --group-size 8        (see --help for every flag)
        torchrun --nproc_per_node 8 grpo_lm.py --prompts-per-step 64 --group-size 16
"""

import ast
import bisect
import dataclasses
import math
import re
import time
from operator import add, mul, sub, truediv
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import numpy as np
import pydantic
import torch
import torch.nn.functional as F
import tyro
from annotated_types import Ge, Gt, Interval

import common
import tasks
from common import UsageError, check


@dataclasses.dataclass
@pydantic.with_config(allow_inf_nan=False)  # common.check_flags: no NaN or inf in any flag
class Args:
    # --- the paper's GRPO (DeepSeekMath §4.1): models, task, sampling, eq. 3 ---

    # policy to train: a local directory or Hub id of a causal LM (the default loads offline)
    model_name_or_path: str = common.DEFAULT_MODEL
    # sequence-classification reward model with the policy's tokenizer, read where its own forward
    # pass pools (the last non-pad token); frozen unless --train-reward-model; default: task reward
    reward_model_path: str | None = None
    # built-in verifiable task: 'addition' ("What is a + b?", two-digit a, b) or 'multistep'
    # ("Compute (a + b) * c - d"); examples/ runs Countdown and others through --dataset
    task: Literal["addition", "multistep"] = "addition"
    # JSONL file of questions and answers (GSM8K's '... #### N' or a plain answer); overrides --task
    dataset: str | None = None
    prompt_field: str = "question"  # --dataset: the field that holds the question
    answer_field: str = "answer"  # --dataset: the field that holds the answer
    # your own reward, path/to/file.py:function with function(completion, example) -> float,
    # repeatable ('task': the task's own); their weighted sum scores each completion (default: task)
    reward_fn: tyro.conf.UseAppendAction[list[str]] = dataclasses.field(default_factory=list)
    # weights of the --reward-fn functions, in order (default: 1 each)
    reward_weights: list[float] = dataclasses.field(default_factory=list)
    # system message before every question (default: none)
    system_prompt: str | None = None
    # the start of every answer (assistant prefill, e.g. '<think>'); rewards see it too
    response_prefix: str = ""
    total_steps: Annotated[int, Ge(1)] = 36  # steps: sample a batch, then --mu policy updates
    prompts_per_step: Annotated[int, Ge(1)] = 8  # questions per step, --group-size outputs each
    group_size: Annotated[int, Ge(2)] = 8  # G: outputs sampled per question (the paper: 64)
    max_new_tokens: Annotated[int, Ge(1)] = 20  # maximum completion length in tokens
    max_prompt_length: Annotated[int, Ge(1)] = 512  # longer prompts leave the training set
    temperature: Annotated[float, Ge(1e-3)] = 0.7  # sampling temperature T, also of the log probs
    # nucleus sampling (1.0 = sample from the full distribution, which the ratio assumes)
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    # AdamW learning rate (the paper's 1e-6 barely moves a 135M model in 36 steps)
    learning_rate: Annotated[float, Interval(gt=0, lt=1)] = 1e-5
    # KL coefficient beta of eq. 3's k3 penalty (the paper's 0.04; 0: no KL, no reference model)
    beta: Annotated[float, Ge(0)] = 0.04
    # the KL term's estimator, with --beta > 0 (k3: eq. 4; the divergences they follow: kl_estimate)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    clip_range: Annotated[float, Interval(gt=0, lt=1)] = 0.2  # eps of the clipped surrogate
    mu: Annotated[int, Ge(1)] = 1  # policy updates per step (Algorithm 1's GRPO iterations)
    max_grad_norm: Annotated[float, Gt(0)] = 1.0  # global gradient-norm clipping
    weight_decay: Annotated[float, Ge(0)] = 0.0  # AdamW weight decay

    # --- DeepSeekMath's extensions: process supervision (§4.1.3), iterative RL (§4.1.4) ---

    # 'outcome' (§4.1.2) or 'process' (§4.1.3: rewards of checked equations, and the final answer
    # as one more step with the outcome reward)
    supervision: Literal["outcome", "process"] = "outcome"
    # Algorithm 1 iterations, --total-steps split evenly; each starts with reference <- policy
    iterations: Annotated[int, Ge(1)] = 1
    # score with a reward model trained after every iteration; without --reward-model-path, the
    # policy's backbone with a new head, and the verifiable reward scores until its first training
    train_reward_model: bool = False
    # share of each reward-model training set replayed from earlier iterations (the paper's "10% of
    # historical data"), drawn without replacement
    rm_replay_ratio: Annotated[float, Interval(ge=0, lt=1)] = 0.1
    # AdamW learning rate of the reward model (its weight decay is --weight-decay)
    rm_learning_rate: Annotated[float, Interval(gt=0, lt=1)] = 1e-5
    # passes over each reward-model training set (minibatches of --micro-batch-size)
    rm_epochs: Annotated[int, Ge(1)] = 1
    # share of each iteration's samples held out to measure the reward model's accuracy
    rm_eval_fraction: Annotated[float, Interval(ge=0, lt=1)] = 0.25

    # --- later variants (all default to the paper's GRPO): Dr. GRPO, DAPO, GSPO, CISPO, entropy ---

    # 'grpo' (per-sequence mean, eq. 3), 'bnpo' (token mean per micro-batch), 'dr_grpo' (sum / (B *
    # max len)), 'dapo' (token mean over the batch), 'cispo' (MiniMax-M1: clipped weight x A log pi)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo"] = "grpo"
    # weight of the entropy bonus in the policy loss (PPO eq. 9's c2; 0: none, as in the papers)
    entropy_coef: Annotated[float, Ge(0)] = 0.0
    # the baseline subtracted from each reward: its group's mean ('grpo', §4.1.2), the mean of the
    # group's other G-1 ('rloo', arXiv 2402.14740), the batch's mean ('reinforce++', 2501.03262)
    advantage: Literal["grpo", "rloo", "reinforce++"] = "grpo"
    # divide by the std of the 'group', the 'batch', or 'none' (Dr. GRPO); default: --advantage's
    scale_rewards: Literal["group", "batch", "none"] | None = None
    # upper clip eps_high of the ratio (DAPO clip-higher, e.g. 0.28); default: --clip-range
    clip_range_high: Annotated[float, Gt(0)] | None = None
    # 'token' (eq. 3) or 'sequence' (GSPO: one length-normalised ratio per completion)
    importance_sampling_level: Literal["token", "sequence"] = "token"
    # DAPO: drop groups whose rewards are all equal, sample more questions until the batch is full
    dynamic_sampling: bool = False
    # --dynamic-sampling: sampling rounds per step at most, then dropped groups fill the batch
    max_sampling_rounds: Annotated[int, Ge(1)] = 4
    # DAPO soft overlong punishment: reward -(len - (max - N)) / N in the last N tokens (0 = off)
    overlong_buffer: Annotated[int, Ge(0)] = 0
    # completions that never emitted EOS take no part in the loss (DAPO overlong filtering)
    mask_truncated_completions: bool = False

    # --- LoRA (Hu et al. 2021, through peft): train low-rank adapters instead of every weight ---

    # rank R of the policy's LoRA adapters (0 = full fine-tuning; the reference: adapters disabled)
    lora_rank: Annotated[int, Ge(0)] = 0
    # LoRA scale: the update of a weight is (alpha / R) * B A; default 2 x --lora-rank
    lora_alpha: Annotated[float, Gt(0)] | None = None
    # modules that get adapters: peft names (e.g. q_proj v_proj) or 'all-linear' (attention and MLP)
    lora_target_modules: tuple[str, ...] = ("all-linear",)

    # --- run: experiment, logging, evaluation, checkpoints ---

    # seed of the prompts, sampling and initialisation
    seed: Annotated[int, Interval(ge=0, le=2**32 - 1)] = 1
    runs_dir: str = "runs"  # TensorBoard logs, args and checkpoints go to {runs_dir}/{run_name}/
    # run directory (default: {task or dataset}__grpo__{seed}__{unix time})
    run_name: str | None = None
    # greedy held-out accuracy every N steps, and at the start and end (0: only there)
    eval_every: Annotated[int, Ge(0)] = 12
    # held-out questions for the accuracy (0 = no evaluation, nothing held out)
    eval_size: Annotated[int, Ge(0)] = 128
    eval_batch_size: Annotated[int, Ge(1)] = 64  # questions per decoding call
    # responses a held-out question: 1 greedy; n > 1 sampled (--temperature, --top-p): pass@k, maj@n
    eval_samples: Annotated[int, Ge(1)] = 1
    sample_every: Annotated[int, Ge(0)] = 5  # print and log samples every N steps (0 = never)
    save_every: Annotated[int, Ge(0)] = 10  # checkpoint every N steps and at the end (0 = end only)
    # checkpoint.pt to continue from: its run's flags are the defaults, flags given again override
    # them (same flags, same results); the model, group size, reward model, --eval-size and run
    # directory cannot change
    resume: str | None = None
    # no training: the greedy held-out accuracy of the --resume checkpoint or of
    # --model-name-or-path (e.g. a run's final_model/), printed and written as JSON into the run dir
    eval_only: bool = False
    # also log to Weights & Biases (pip install wandb; $WANDB_PROJECT, default minimal-ppo-grpo,
    # and $WANDB_ENTITY choose where; WANDB_MODE=offline keeps it on disk)
    track: bool = False

    # --- scale-out and speed: devices, several processes (torchrun), micro-batches, bf16 ---

    device: str = "auto"  # 'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'
    # sequences per forward/backward pass; gradients are accumulated over the whole batch
    micro_batch_size: Annotated[int, Ge(1)] = 16
    # groups per sampling call (0 = all of a process's); samples depend on --seed, step and groups
    generation_groups_per_call: Annotated[int, Ge(0)] = 0
    # bfloat16 autocast on a CUDA GPU that supports it or a CPU with AVX512-BF16 (weights,
    # optimizer, LM head and log-softmax stay float32); float32 elsewhere
    bf16: bool = True
    # recompute the policy's activations in the backward pass: less memory, ~30% slower
    gradient_checkpointing: bool = False


@dataclasses.dataclass
class Batch:
    """Steps 1-2, this process's share: N = B * G completions (a question's G contiguous) of at
    most T tokens, their prompts of at most P tokens, and their rewards (set by :func:`reward`)."""

    prompt_ids: torch.Tensor  # (N, P) each completion's prompt, left-padded
    prompt_mask: torch.Tensor  # (N, P) 1 for the prompt's tokens
    completion_ids: torch.Tensor  # (N, T) the sampled tokens, padding after the first EOS
    completion_mask: torch.Tensor  # (N, T) float, 1 up to and including the first EOS
    examples: list[dict]  # the question (and answer) of each completion
    completions: list[str]  # the decoded completions
    rewards: torch.Tensor | None = None  # (N,) r_i, what the advantages normalise
    verifiable: torch.Tensor | None = None  # (N,) the task's reward (None: a frozen RM scores)
    correct: torch.Tensor | None = None  # (N,) bool, the final answer is right
    truncated: torch.Tensor | None = None  # (N,) bool, no EOS within --max-new-tokens
    reward_fns: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # --reward-fn
    scalars: dict[str, float] = dataclasses.field(default_factory=dict)  # the extensions' logs


# ----------------------------------------------------------------------------------------------
# ALGO LOGIC: the pieces of DeepSeekMath §4.1, in the order the loop below uses them (torch only)
# ----------------------------------------------------------------------------------------------
def completion_mask(completion_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, T) float mask of each completion's tokens up to and including its first EOS (what follows
    is padding): the o_i,t that eq. 3 sums over, |o_i| its row sum."""
    is_eos = completion_ids == eos_token_id
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos.long()  # number of EOS strictly before t
    return (eos_before == 0).float()


def group_advantages(rewards, group, eps=1e-4, scale=None, baseline="grpo", batch=None):
    """Outcome supervision (§4.1.2): (S,) ``(r_i - mean(r)) / (std(r) + eps)`` of the (S,)
    ``rewards`` in each one's group (``group``: (S,) long; unbiased std), for every token of o_i.
    --advantage ``baseline``: the group's mean (``"grpo"``; equal rewards get 0), the mean of its
    other n-1, ``n/(n-1) (r_i - mean(r))`` (``"rloo"``, arXiv 2402.14740) or the batch's
    (``"reinforce++"``, arXiv 2501.03262). ``scale``: the std of the ``"group"``, the ``"batch"``
    (``batch``: every process's rewards, default ``rewards``) or ``"none"`` (Dr. GRPO, 2503.20783
    §3.1); None: the baseline's own (grpo: group, rloo: none, reinforce++: batch)."""
    scale = scale or dict(grpo="group", rloo="none", **{"reinforce++": "batch"})[baseline]
    batch = rewards if batch is None else batch
    n = torch.bincount(group)[group].to(rewards.dtype)  # the size of each one's group
    group_sum = lambda x: torch.zeros_like(x).index_add_(0, group, x)[group]  # noqa: E731
    centred = rewards - group_sum(rewards) / n  # r_i - mean(r)
    std = dict(group=(group_sum(centred**2) / (n - 1)).sqrt(), batch=batch.std(), none=None)[scale]
    if baseline != "grpo":  # rloo: n/(n-1) times it; reinforce++: r_i - the batch's mean
        centred = centred * n / (n - 1) if baseline == "rloo" else rewards - batch.mean()
    return centred if scale == "none" else centred / (std + eps)


class MicroBatch(NamedTuple):
    """:func:`token_log_probs`'s inputs: b completions of U distinct prompts (G share each)."""

    prompt_ids: torch.Tensor  # (U, P) the distinct prompts, left-padded
    prompt_mask: torch.Tensor  # (U, P) 1 for real prompt tokens
    prompt_index: torch.Tensor  # (b,) long: the row of prompt_ids each completion continues
    completion_ids: torch.Tensor  # (b, T) the completions
    completion_mask: torch.Tensor  # (b, T) long, 1 up to and including the first EOS


def token_log_probs(model, mb: MicroBatch, temperature, share_prompt=True, entropy_coef=None):
    """(b, T) float32 ``log softmax(logits / temperature)`` of every completion token under
    ``model``; with ``entropy_coef`` also their (b, T) entropy, differentiable if it is not 0.
    ``share_prompt``: each distinct prompt goes through the model once and its keys and values (with
    their gradients) serve every completion that continues it: a whole-sequence pass's numbers, to
    float rounding, for 1/G of the prompt's compute (off under gradient checkpointing, which drops
    the cache). Position ids count real tokens only, as in generation; the LM head runs in float32
    also under bf16 autocast (``common.float32_lm_head``)."""
    P, T = mb.prompt_ids.shape[1], mb.completion_ids.shape[1]
    mask = torch.cat([mb.prompt_mask[mb.prompt_index], mb.completion_mask], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with common.float32_lm_head(model):
        if share_prompt:
            prompt = dict(input_ids=mb.prompt_ids, attention_mask=mb.prompt_mask)
            prompt["position_ids"] = (mb.prompt_mask.cumsum(1) - 1).clamp(min=0)
            prefix = model(**prompt, logits_to_keep=1, use_cache=True)
            logits = prefix.logits[mb.prompt_index]  # (b, 1, V): the first completion token's
            if T > 1:  # the prompts' keys and values, (U, ...) -> (b, ...), differentiable
                (cache := prefix.past_key_values).batch_select_indices(mb.prompt_index)
                rest = dict(input_ids=mb.completion_ids[:, :-1], use_cache=True)
                rest |= dict(attention_mask=mask[:, :-1], position_ids=positions[:, P:-1])
                logits = torch.cat([logits, model(**rest, past_key_values=cache).logits], 1)
        else:
            ids = torch.cat([mb.prompt_ids[mb.prompt_index], mb.completion_ids], 1)
            whole = dict(attention_mask=mask, position_ids=positions, use_cache=False)
            logits = model(input_ids=ids, **whole, logits_to_keep=T + 1).logits[:, :-1]  # t -> t+1
    logp, H = [], []  # a row at a time: 2.5 (b, T, V) copies at the peak, not 5 (all rows at once)
    for z, row in zip(logits.float().split(1), mb.completion_ids.split(1), strict=True):
        logp.append((lp := (z / temperature).log_softmax(-1)).gather(2, row[..., None])[..., 0])
        if entropy_coef is not None:  # with its gradient only for a bonus (0: logged only)
            H.append(-((lp := lp if entropy_coef else lp.detach()).exp() * lp).sum(-1))
    return (torch.cat(logp), torch.cat(H)) if entropy_coef is not None else torch.cat(logp)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """(B, T) per-token estimate of KL(pi_theta || pi_ref) from the (B, T) log probs of tokens
    sampled from pi_theta, ``r = pi_ref / pi_theta`` (Schulman 2020): ``k1 = -log r`` (unbiased),
    ``k2 = (log r)^2 / 2`` (biased, >= 0), ``k3 = r - log r - 1`` (unbiased, >= 0; eq. 4). In the
    loss (d/dlogp: k1 1, k2 ``-log r``, k3 ``1 - r``) the expected gradient is that of KL(pi_ref ||
    pi_theta) for k3 (the paper's and TRL's choice), of KL(pi_theta || pi_ref) for k2, 0 for k1;
    with --mu > 1 (tokens from pi_old) each term lacks the weight pi_theta / pi_old (test_kl.py)."""
    log_ratio = ref_logp - logp  # log r
    k = dict(k1=-log_ratio, k2=log_ratio**2 / 2, k3=torch.exp(log_ratio) - log_ratio - 1)
    return k[estimator]


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, clip_range, beta, num_sequences,
              entropy=None, *, loss_type="grpo", clip_range_high=None, level="token",
              num_tokens=None, max_length=None, kl_estimator="k3", entropy_coef=0.0):  # fmt: skip
    """Negative GRPO objective (DeepSeekMath eq. 3) of a micro-batch, for gradient accumulation.

    Per token ``min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A) - beta * KL + entropy_coef *
    H`` (eq. 3, 4; ``eps_high = clip_range_high``, DAPO §3.1 clip-higher, default eps), summed as
    :func:`aggregate` says; ``ratio = exp(logp - old_logp)`` (mu = 1: old_logp = ``logp.detach()``),
    GSPO (arXiv 2507.18071 §4, ``level="sequence"``) ``exp(mean_t(logp - old_logp))`` per sequence.
    CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4) ``sg(min(ratio, 1 + eps_high)) * A * logp`` instead
    of the min: every token keeps its gradient. Masked positions never reach ``exp``.

    Args:
        logp, old_logp, ref_logp: (b, T) log probs under the policy (with grad), pi_old and the
            reference (None with ``beta == 0``).
        advantages: (b,) one per sequence (outcome) or (b, T) one per token (process).
        mask: (b, T) 1 for the tokens in the loss; num_sequences etc.: see :func:`aggregate`.
        entropy: (b, T) the policy's entropy H at each position (with grad; read if entropy_coef).
    Returns:
        (loss, stats): the loss and detached per-token sums and extremes, for logging (clipped_high:
        A > 0, ratio > 1 + eps_high; clipped_low: A < 0, ratio < 1 - eps)."""
    valid = mask.bool()
    log_ratio = torch.where(valid, logp - old_logp, 0.0)
    if level == "sequence":  # GSPO's s_i, (b, 1)
        log_ratio = (log_ratio.sum(1) / mask.sum(1).clamp(min=1)).unsqueeze(1)
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1) if advantages.ndim == 1 else advantages
    high = clip_range if clip_range_high is None else clip_range_high
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_range, 1 + high) * adv)
    if loss_type == "cispo":  # MiniMax-M1 eq. 4: REINFORCE with a clipped, detached IS weight
        surrogate = torch.clamp(ratio, max=1 + high).detach() * adv * logp
    ref = logp.detach() if ref_logp is None else torch.where(valid, ref_logp, logp.detach())
    kl = kl_estimate(logp, ref, kl_estimator)  # 0 without a reference
    per_token = surrogate - beta * kl if beta else surrogate  # KL in the loss (§4.1.1)
    if entropy_coef:  # the entropy bonus (not in the paper)
        per_token = per_token + entropy_coef * entropy
    loss = aggregate(per_token, mask, num_sequences, loss_type, num_tokens, max_length)
    with torch.no_grad():
        above, below = (adv > 0) & (ratio > 1 + high), (adv < 0) & (ratio < 1 - clip_range)
        ratio_max = ratio.expand_as(logp)[valid].max() if valid.any() else ratio.new_ones(())
        stats = dict(kl=(kl * mask).sum(), clipped_high=(above * mask).sum(), tokens=mask.sum())
    return loss, stats | dict(clipped_low=(below * mask).sum(), ratio_max=ratio_max)


def aggregate(per_token, mask, num_sequences, loss_type="grpo", num_tokens=None, max_length=None):
    """The negated sum of a micro-batch's (b, T) masked per-token terms of eq. 3, normalised so that
    the micro-batch losses add up to the whole batch's (``num_sequences`` = B * G sequences):

    - ``grpo``: mean over each sequence's ``|o_i|`` tokens, sum over sequences / ``num_sequences``.
    - ``bnpo``: token mean within this micro-batch, times its share ``b / num_sequences`` of the
      sequences (depends on micro-batching; ``dapo`` when one micro-batch holds the whole batch).
    - ``dr_grpo``: token sum / (``num_sequences * max_length``), ``max_length`` the completions'
      token cap (Dr. GRPO, arXiv 2503.20783 §3.1: eq. 3 without 1/|o_i|).
    - ``dapo``, ``cispo``: token sum / ``num_tokens``, the whole batch's valid tokens (DAPO §3.3).
    """
    masked = per_token * mask
    if loss_type == "grpo":
        return -(masked.sum(1) / mask.sum(1).clamp(min=1)).sum() / num_sequences
    if loss_type == "bnpo":
        return -masked.sum() / mask.sum().clamp(min=1) * (mask.shape[0] / num_sequences)
    if loss_type == "dr_grpo":
        return -masked.sum() / (num_sequences * max_length)
    return -masked.sum() / max(float(num_tokens), 1.0)  # dapo, cispo


# ----------------------------------------------------------------------------------------------
# GRPO, DeepSeekMath §4.1 and Algorithm 1
# ----------------------------------------------------------------------------------------------
def main(args: Args, task: tasks.Task | None = None, step_reward_fn=None):
    """Train with GRPO; returns the per-step history of logged scalars (a dict of lists).

    ``task`` replaces the built-in task: any :class:`tasks.Task` with your own reward function.
    ``step_reward_fn(completion, example) -> [(end character offset, reward), ...]`` gives the step
    rewards of ``--supervision process`` (default :func:`arithmetic_step_rewards`: every
    equation ``x op y = z`` checked). Under ``torchrun`` every process runs this function on its
    share of the batch; the returned history holds the global values on every rank."""
    validate(args)  # a bad flag, checkpoint, dataset or reward file: one line, before any load
    checkpoint, model = resume_checkpoint(args), args.model_name_or_path  # --resume's, checked
    name = f"{Path(args.dataset or args.task).stem}__grpo__{args.seed}__{int(time.time())}"
    run_dir = common.make_run_dir(args.runs_dir, args.run_name or name, args.resume, args.eval_only)
    fields = (args.prompt_field, args.answer_field, args.reward_fn, args.reward_weights)
    task = task or tasks.task_of(args.task, args.dataset, *fields, args.eval_size)
    tokenizer = common.load_tokenizer(model)
    style = (args.system_prompt, args.response_prefix)  # every prompt's system message and prefix
    if not args.eval_only:  # the training questions whose prompts fit
        limits = (args.max_prompt_length, args.prompts_per_step, args.max_new_tokens)
        questions = tasks.training_questions(task, tokenizer, style, *limits, model)
    rank, world, device = common.start_processes(args.device)  # torchrun: each its share of a batch
    torch.manual_seed(args.seed)  # the other draws are seeded per step from --seed

    options = (tokenizer, task, args.eval_size, args.max_new_tokens, args.eval_batch_size, style)
    sampling = (args.eval_samples, args.temperature, args.top_p, args.seed)  # --eval-samples
    held_out = lambda pi: tasks.held_out_accuracy(pi, *options, args.bf16, sampling)  # noqa: E731

    # Algorithm 1's input: the initial policy pi_theta, the reference pi_ref (a frozen copy of it,
    # §4.1.1; none with beta = 0) and the reward: the task's reward function or a reward model r_phi
    lora = (args.lora_rank, args.lora_alpha, args.lora_target_modules) if args.lora_rank else None
    policy = common.load_policy(model, device, lora, args.gradient_checkpointing)
    if args.eval_only:  # no training: the held-out accuracy of --resume's policy or of the model
        return tasks.eval_only(policy, checkpoint, held_out, run_dir / "eval.json")
    bf16 = args.iterations == 1 and common.bf16_active(device, args.bf16)  # bf16 weights: no reset
    reference = common.load_reference(policy, model, device, lora, bf16) if args.beta > 0 else None
    reward_model, rm_training = make_reward_model(args, tokenizer, device)  # §4.1.4: and training
    trained, decay = [p for p in policy.parameters() if p.requires_grad], args.weight_decay
    optimizer = torch.optim.AdamW(trained, args.learning_rate, weight_decay=decay, fused=True)
    start_step = restore(checkpoint, args, policy, optimizer, reference, rm_training)  # 0: new run
    bar = {"reward": "reward/mean", "kl": "loss/kl", "len": "completion/length_mean"}
    log_args = (rank, start_step, checkpoint is not None, "grpo", bar, args.track)
    log = common.RunLog(run_dir, dataclasses.asdict(args), *log_args)
    sampler = Sampler(policy, tokenizer, questions, task, reward_model, rank, world)
    log.evaluate(0, args.eval_size > 0 and not checkpoint, lambda: held_out(policy)[0])  # start
    common.rng_state(checkpoint["rng"]) if checkpoint else None  # last: loading must not shift it

    G, B = args.group_size, args.prompts_per_step // world  # B questions per process
    N, N_all = B * G, args.prompts_per_step * G  # this process's outputs, all processes' outputs
    steps_per_iteration = args.total_steps // args.iterations  # one iteration of Algorithm 1
    shared = not args.gradient_checkpointing  # each prompt once (checkpointing drops the cache)
    temperature, eps, beta = args.temperature, args.clip_range, args.beta  # T; eq. 3's eps, beta
    # eq. 3's variants: loss_type (Dr. GRPO, DAPO), clip-higher (DAPO), level (GSPO), L (Dr. GRPO)
    variants = dict(loss_type=args.loss_type, clip_range_high=args.clip_range_high)
    variants |= dict(level=args.importance_sampling_level, max_length=args.max_new_tokens)
    variants |= dict(kl_estimator=args.kl_estimator, entropy_coef=args.entropy_coef)
    for step in log.progress(start_step, args.total_steps):
        t0 = time.time()
        # ---- 0. Algorithm 1: each iteration starts with reference <- policy ----
        if reference is not None and step > 0 and step % steps_per_iteration == 0:
            reference.load_state_dict(policy.state_dict())

        # ---- 1. Sample B questions, G outputs o_i of each from pi_old = the policy, at T ----
        # ---- 2. and their rewards r_i: the task's reward functions, or the reward model ----
        batch = sample_and_score(sampler, args, device, step)  # Batch: o_i and r_i (reward())
        if args.dynamic_sampling:  # DAPO §3.2: only groups whose rewards differ
            batch = dynamic_sampling(batch, sampler, args, device, step)
        # DAPO §3.4, soft overlong punishment (0 with --overlong-buffer 0):
        penalty = overlong_penalty(batch.completion_mask, args.max_new_tokens, args.overlong_buffer)
        batch.rewards = batch.rewards + penalty  # a new tensor: batch.verifiable stays the task's
        rewards = common.all_gather(batch.rewards)  # (N_all,) every process's r_i, group order
        rm_training.add(batch) if rm_training else None  # Algorithm 1 / §4.1.4: the RM's samples
        gen_time = time.time() - t0

        # ---- 3. Advantages: A_i,t = (r_i - mean(r)) / std(r) of its group, every t (§4.1.2) ----
        baselines = dict(scale=args.scale_rewards, baseline=args.advantage)  # --advantage
        advantages = group_advantages(rewards, torch.arange(N_all) // G, **baselines)  # groups of G
        advantages = advantages[rank * N : rank * N + N].to(device)  # this process's groups
        if args.supervision == "process":  # §4.1.3: sums of the normalised step rewards from t on
            steps = step_reward_fn or arithmetic_step_rewards
            advantages = process_supervision(batch, tokenizer, steps, args, device)

        # ---- 4. Old and reference log probs of the sampled tokens (no grad) ----
        keep = ~batch.truncated[:, None] if args.mask_truncated_completions else 1.0  # DAPO §3.4:
        loss_mask = batch.completion_mask * keep  # overlong filtering, none of a truncated one
        other_weights = beta + args.entropy_coef  # of every term but A's: KL, entropy (each >= 0)
        rows = rows_with_a_gradient(advantages, loss_mask, other_weights, args.loss_type, G)
        micro_batches = list(plan_micro_batches(batch, args.micro_batch_size, G, device, rows))
        old_logp = torch.zeros_like(loss_mask)
        ref_logp = torch.zeros_like(loss_mask) if reference is not None else None
        with torch.no_grad(), common.bf16_autocast(device, args.bf16):  # --bf16 (CUDA, AVX512-BF16)
            for idx, t, mb in micro_batches:
                if args.mu > 1:  # with mu = 1, pi_old = pi_theta: logp.detach() below
                    old_logp[idx, :t] = token_log_probs(policy, mb, temperature, shared)
                if reference is not None:
                    ref_logp[idx, :t] = token_log_probs(reference, mb, temperature, shared)

        # ---- 5. mu GRPO iterations: maximise eq. 3 (gradients accumulated over micro-batches) ----
        # The ratio uses step 4's old_logp: pi_old stays the sampling policy for all mu updates.
        variants["num_tokens"] = common.all_reduce(loss_mask.sum()).item()  # the global batch's
        loss_stats = []  # grpo_loss's stats of each micro-batch, for step_metrics
        for _ in range(args.mu):
            optimizer.zero_grad(set_to_none=True)
            policy.train(args.gradient_checkpointing)  # HF recomputes activations in train mode
            for idx, t, mb in micro_batches:
                with common.bf16_autocast(device, args.bf16):
                    logp, H = token_log_probs(policy, mb, temperature, shared, args.entropy_coef)
                old = old_logp[idx, :t] if args.mu > 1 else logp.detach()
                ref = ref_logp[idx, :t] if ref_logp is not None else None
                adv = advantages[idx] if advantages.ndim == 1 else advantages[idx, :t]
                mask = loss_mask[idx, :t]
                loss, stats = grpo_loss(logp, old, ref, adv, mask, eps, beta, N_all, H, **variants)
                loss.backward()
                stats.update(loss=loss.detach(), entropy=(H.detach() * mask).sum())
                loss_stats.append(stats)
            policy.eval()
            common.all_reduce_gradients(policy.parameters())  # torchrun: DDP's all-reduce
            grad_norm = common.clip_gradients(trained, args.max_grad_norm, step)  # finite, or stop
            optimizer.step()

        # ---- 6. Algorithm 1: after an iteration, train the reward model (samples + replay) ----
        if rm_training and (step + 1) % steps_per_iteration == 0:
            log(step + 1, rm_training.train(step))

        # ---- logging, evaluation (every --eval-every), checkpoints (every --save-every) ----
        log(step + 1, step_metrics(args, batch, rewards, loss_stats, grad_norm, t0, gen_time))
        log.samples(step + 1, sample_lines(batch, G), args.sample_every)
        due = step + 1 == args.total_steps or args.eval_every and (step + 1) % args.eval_every == 0
        log.evaluate(step + 1, args.eval_size > 0 and due, lambda: held_out(policy)[0])
        save_checkpoint(log, step + 1, args, policy, optimizer, reference, rm_training)
    log.close()
    if rank == 0 and args.total_steps > start_step:
        common.save_pretrained(policy, tokenizer, run_dir / "final_model")
        print(f"saved {log.checkpoint} and {run_dir / 'final_model'} (from_pretrained loads it)")
    common.cleanup_distributed()  # the other processes wait until rank 0 has written everything
    return log.history


# ----------------------------------------------------------------------------------------------
# Steps 1-2 of Algorithm 1: sample G outputs of each question from pi_old, and their rewards
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Sampler:
    """What steps 1-2 sample with and score by."""

    policy: Any  # pi_old: the policy as it is when the step starts
    tokenizer: Any
    questions: list[dict]  # the training questions whose prompts fit --max-prompt-length
    task: tasks.Task
    reward_model: Any  # None: the task's verifiable reward
    rank: int  # torchrun: this process samples the groups rank * B .. rank * B + B - 1 of each step
    world: int


def sample_and_score(sampler: Sampler, args: Args, device, step: int, round_: int = 0) -> Batch:
    """Steps 1-2 for one draw of questions, from ``(--seed, step, round_)``: this process's B
    questions, G completions of each from ``softmax(logits / T)`` (within the top-p nucleus), and
    their rewards (:func:`reward`). Each sampling call of --generation-groups-per-call groups is
    reseeded from ``(--seed, step, round_, global index of its first group)``: the samples do not
    depend on how many processes share the batch."""
    G, B, tokenizer = args.group_size, args.prompts_per_step // sampler.world, sampler.tokenizer
    first, pad = sampler.rank * B, tokenizer.pad_token_id  # this process's groups: first + 0..B-1
    rng = np.random.default_rng([args.seed, step] + ([round_] if round_ else []))
    picks = rng.choice(len(sampler.questions), args.prompts_per_step, replace=False)
    examples = [sampler.questions[i] for i in picks[first : first + B] for _ in range(G)]
    style = (args.system_prompt, args.response_prefix)
    prompts = tasks.prompt_ids(tokenizer, [ex["question"] for ex in examples[::G]], *style)
    options = (args.temperature, args.top_p, args.max_new_tokens, args.bf16)
    seeds = ((args.seed, step, round_), first), args.generation_groups_per_call
    rows = common.generate_completions(sampler.policy, prompts, G, tokenizer, options, *seeds)
    prompt_ids, prompt_mask = common.pad_left([p for p in prompts for _ in range(G)], pad, device)
    rows = [torch.tensor(row, device=device) for row in rows]  # padded after the EOS
    completion_ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad)
    mask = completion_mask(completion_ids, tokenizer.eos_token_id)  # (N, T): none after the EOS
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    batch = Batch(prompt_ids, prompt_mask, completion_ids, mask, examples, texts)
    batch.truncated = ~((completion_ids == tokenizer.eos_token_id) & mask.bool()).any(1)  # no EOS
    return reward(batch, sampler, args, device, step)


def reward(batch: Batch, sampler: Sampler, args: Args, device, step: int) -> Batch:
    """Step 2: ``batch`` with its rewards, from the task's reward functions or the reward model, and
    its ``verifiable``, ``correct`` and ``reward_fns``. A reward model trained from
    the policy's backbone scores from iteration 2 on, once trained; until then the verifiable reward
    does (Algorithm 1). Raises UsageError: a reward function raises or returns NaN or inf."""
    texts = [args.response_prefix + c for c in batch.completions]  # what the rewards read
    trained = args.reward_model_path is not None or step >= args.total_steps // args.iterations
    by_model = sampler.reward_model is not None and trained
    if not by_model or args.train_reward_model:  # --reward-fn: each function's own rewards too
        batch.verifiable, batch.reward_fns = tasks.score_task(sampler.task, texts, batch.examples)
    batch.rewards = batch.verifiable
    if by_model:
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
        mask = torch.cat([batch.prompt_mask, batch.completion_mask.long()], 1)
        model, size = sampler.reward_model, args.micro_batch_size
        batch.rewards = tasks.score_with_reward_model(model, ids, mask, size, device, args.bf16)
    batch.correct = tasks.score_correct(sampler.task, texts, batch.examples)
    return batch


# ----------------------------------------------------------------------------------------------
# DeepSeekMath's extensions: process supervision (§4.1.3), iterative RL with its reward model §4.1.4
# ----------------------------------------------------------------------------------------------
def process_supervision(batch: Batch, tokenizer, step_reward_fn, args: Args, device):
    """§4.1.3: (N, T) advantages on ``device`` from the steps that ``step_reward_fn(completion,
    example) -> [(end character offset, reward), ...]`` checks in each completion, plus its final
    answer as one more step with the outcome reward (:func:`process_advantages`); the ``process/*``
    scalars (over every process) go to ``batch.scalars``. Raises UsageError: the function raises."""
    (N, T), rewards, rows, ends = batch.completion_ids.shape, [], [], []
    for i, (text, ex) in enumerate(zip(batch.completions, batch.examples, strict=True)):
        n_i, ids = int(batch.completion_mask[i].sum()), batch.completion_ids[i].tolist()
        try:
            steps = [(int(end), float(r)) for end, r in step_reward_fn(text, ex)]
        except (Exception, SystemExit) as e:  # noqa: BLE001 - as a reward function's failure
            failed = f"step reward function raised {type(e).__name__}: {e} on completion {i}"
            raise UsageError(failed) from None
        prefixes = [ids[: k + 1] for k in range(n_i)]  # a step ends where its characters are out
        lengths = [len(p) for p in tokenizer.batch_decode(prefixes, skip_special_tokens=True)]
        ends += [min(bisect.bisect_left(lengths, e), n_i - 1) for e, _ in steps] + [n_i - 1]
        rewards += [r for _, r in steps] + [batch.rewards[i].item()]
        rows += [i] * (len(steps) + 1)
    G, batch_rewards = args.group_size, torch.tensor(common.all_gather_objects(rewards))
    steps = torch.tensor(rewards), torch.tensor(rows), torch.tensor(ends)
    baselines = dict(scale=args.scale_rewards, baseline=args.advantage, batch=batch_rewards)
    advantages = process_advantages(*steps, N, T, G, **baselines)  # every process's step rewards
    checked = [len(rewards) - N, sum(rewards) - batch.rewards.sum().item()]  # not final answers
    checked, step_sum = common.all_reduce(torch.tensor(checked, dtype=torch.float64)).tolist()
    batch.scalars["process/steps_per_completion"] = checked / (args.prompts_per_step * G)
    batch.scalars["process/step_reward_mean"] = step_sum / max(checked, 1)
    return advantages.to(device)


def process_advantages(rewards, seq, end, num_sequences, num_tokens, group_size, **baselines):
    """Process-supervision advantages (DeepSeekMath §4.1.3), (B * G, T = ``num_tokens``): the (S,)
    float ``rewards`` of every step of the G outputs of a question, step j in completion ``seq[j]``
    ending at its token ``end[j]`` ((S,) long), normalised together by :func:`group_advantages`
    (``baselines``: its keywords; ``batch``: every process's step rewards), ``r~_j = (r_j - mean) /
    (std + eps)``; then ``A_i,t`` = the sum of r~_j over the steps of output i that end at or after
    t (0 after the last). The caller makes the final answer a step with the outcome reward."""
    normalised = group_advantages(rewards, seq // group_size, **baselines)
    at_end = torch.zeros(num_sequences, num_tokens, dtype=rewards.dtype)
    at_end.index_put_((seq, end), normalised, accumulate=True)  # r~_j at the step's last token
    return at_end.flip(1).cumsum(1).flip(1)  # sum over the steps ending at or after t


_OPS = {ast.Add: add, ast.Sub: sub, ast.Mult: mul, ast.Div: truediv, ast.USub: lambda x: -x}


def _arithmetic(node: ast.AST) -> float:
    """The value of an ast of number literals, ``+ - * /`` and unary minus; ValueError else."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return float(node.value)
    if isinstance(node, ast.UnaryOp | ast.BinOp) and type(node.op) in _OPS:  # -x, x op y
        operands = [node.operand] if isinstance(node, ast.UnaryOp) else [node.left, node.right]
        return _OPS[type(node.op)](*map(_arithmetic, operands))
    raise ValueError("not arithmetic")


# A term: a number with "(", "-", ")" around it. No space can match two neighbouring \s*
# (a sum without "=" took exponential time to reject: 6 s for ten terms).
_TERM = rf"(?:-\s*)?\$?{tasks.DIGITS}(?:\s*\)+)?"
_LHS = rf"(\(*\s*{_TERM}(?:\s*[-+*/×]\s*(?:\(+\s*)?{_TERM})+)"  # x op y (op z ...), group 1
_STEP = re.compile(rf"(?<![\d.]){_LHS}\s*=\s*(-?\s*\$?{tasks.DIGITS})")


def arithmetic_step_rewards(completion: str, example=None) -> list[tuple[int, float]]:
    """Process supervision's step rewards: each equation ``x op y (op z ...) = w`` (``+ - * / ×``,
    parentheses, ``$``, ``1,234``, GSM8K's ``<<48/2=24>>``) as (end offset after its last digit,
    1.0 if right within a relative 1e-4 else 0.0)."""
    steps = []
    for m in _STEP.finditer(completion):
        sides = (m.group(1), m.group(2).replace(" ", ""))
        sides = [s.replace("$", "").replace(",", "").replace("×", "*").strip() for s in sides]
        try:
            lhs, rhs = (_arithmetic(ast.parse(s, mode="eval").body) for s in sides)
            ok = math.isclose(lhs, rhs, rel_tol=1e-4, abs_tol=1e-9)
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
            ok = False
        steps.append((m.end(), float(ok)))
    return steps


def make_reward_model(args: Args, tokenizer, device):
    """(r_phi, its :class:`RewardModelTraining` with --train-reward-model, else False): the model of
    --reward-model-path (frozen unless trained), or with --train-reward-model alone the policy's
    backbone with a new score head (Algorithm 1, §4.1.4); None: the task's reward scores."""
    model = None
    if args.reward_model_path:
        model = common.load_reward_model(args.reward_model_path, tokenizer, device).eval()
        model.requires_grad_(args.train_reward_model)
    elif args.train_reward_model:
        model = common.load_model(args.model_name_or_path, kind="reward", device=device).eval()
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, args.train_reward_model and RewardModelTraining(model, tokenizer, args, device)


class RewardModelTraining:
    """Algorithm 1, line 12 (§4.1.4): r_phi trained continually, by MSE regression of its score on
    the verifiable reward, after each iteration's last step, on the iteration's samples and a replay
    of earlier ones (--rm-replay-ratio of each set). ``add(batch)`` keeps every process's samples
    (each trains the same model); --rm-eval-fraction of new ones is held out (never trained on)."""

    def __init__(self, model, tokenizer, args: Args, device):
        self.model, self.pad, self.args, self.device = model, tokenizer.pad_token_id, args, device
        lr, weight_decay = args.rm_learning_rate, args.weight_decay
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        self.new, self.replay = [], []  # this and earlier iterations' {"ids": ..., "label": r_i}

    def add(self, batch: Batch) -> None:
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
        real = torch.cat([batch.prompt_mask, batch.completion_mask.long()], 1).bool()
        rows = zip(ids, real, batch.verifiable, strict=True)
        samples = [dict(ids=i[m].tolist(), label=r.item()) for i, m, r in rows]
        self.new += common.all_gather_objects(samples)

    def scores(self, samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """(n,) float32 scores of r_phi (differentiable) and (n,) labels of ``samples``."""
        ids, mask = common.pad_left([s["ids"] for s in samples], self.pad, self.device)
        labels = torch.tensor([s["label"] for s in samples], device=self.device)
        with common.bf16_autocast(self.device, self.args.bf16):
            return tasks.reward_model_scores(self.model, ids, mask), labels

    def train(self, step: int) -> dict:
        args, size = self.args, self.args.micro_batch_size
        rng = np.random.default_rng([args.seed, step + 1, 1])
        shuffled = [self.new[i] for i in rng.permutation(len(self.new))]
        split = int(len(shuffled) * args.rm_eval_fraction)
        held_out, fresh = shuffled[:split], shuffled[split:]
        data = replay_mix(fresh, self.replay, args.rm_replay_ratio, rng)
        for _ in range(args.rm_epochs):  # MSE regression of the score on the verifiable reward
            order = rng.permutation(len(data))
            for i in range(0, len(data), size):
                loss = F.mse_loss(*self.scores([data[j] for j in order[i : i + size]]))
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
        self.replay, self.new = self.replay + fresh, []
        scalars = dict(train_mse=loss.item(), train_size=len(data), replayed=len(data) - len(fresh))
        if held_out:
            scalars["heldout_accuracy"], scalars["heldout_mse"] = self.accuracy(held_out)
        return {f"reward_model/{key}": value for key, value in scalars.items()}

    @torch.no_grad()
    def accuracy(self, samples: list[dict]) -> tuple[float, float]:
        """(accuracy, MSE) on labelled samples; accurate: |score - label| < 0.5."""
        size = self.args.micro_batch_size
        pairs = [self.scores(samples[i : i + size]) for i in range(0, len(samples), size)]
        scores, labels = (torch.cat([pair[k].cpu() for pair in pairs]) for k in (0, 1))
        accurate = ((scores - labels).abs() < 0.5).float().mean().item()
        return accurate, F.mse_loss(scores, labels).item()

    def state(self, checkpoint: dict | None = None) -> dict:
        """What a checkpoint keeps of it; with ``checkpoint``, that state restored first."""
        if checkpoint is not None:
            self.model.load_state_dict(checkpoint["reward_model"])
            self.optimizer.load_state_dict(checkpoint["rm_optimizer"])
            self.new, self.replay = checkpoint["rm_new"], checkpoint["rm_replay"]
        state = dict(reward_model=self.model.state_dict(), rm_optimizer=self.optimizer.state_dict())
        return state | dict(rm_new=self.new, rm_replay=self.replay)


def replay_mix(new: list, history: list, ratio: float, rng: np.random.Generator) -> list:
    """One iteration's reward-model training set (Algorithm 1, §4.1.4): ``new`` and
    ``round(len(new) * ratio / (1 - ratio))`` samples (at most all) of ``history``, drawn without
    replacement, so that they make up ``ratio`` (in [0, 1)) of it."""
    k = min(len(history), round(len(new) * ratio / (1 - ratio)))
    return list(new) + [history[i] for i in rng.choice(len(history), k, replace=False)]


# ----------------------------------------------------------------------------------------------
# Later variants (every flag off = the paper's GRPO): DAPO's dynamic sampling and overlong shaping;
# Dr. GRPO, RLOO, REINFORCE++, clip-higher, GSPO, CISPO: options of group_advantages, grpo_loss.
# ----------------------------------------------------------------------------------------------
def dynamic_sampling(batch: Batch, sampler: Sampler, args: Args, device, step: int) -> Batch:
    """DAPO dynamic sampling (arXiv 2503.14476, §3.2): keep the groups whose rewards differ, and
    sample new questions (rounds 1, 2, ...) until B such groups are found or --max-sampling-rounds
    is reached; dropped groups top the batch up (advantage 0 unless --overlong-buffer's penalty,
    added afterwards, separates them; they still carry the KL term). Under torchrun each process
    fills its own B groups. The ``sampling/*`` scalars go to ``batch.scalars``."""
    G, B = args.group_size, len(batch.rewards) // args.group_size
    rounds, chosen = [], []
    for r in range(args.max_sampling_rounds):
        rounds.append(batch if r == 0 else sample_and_score(sampler, args, device, step, round_=r))
        grouped = rounds[r].rewards.view(-1, G)
        chosen += [(r, g) for g in range(B) if grouped[g].max() > grouped[g].min()]
        if len(chosen) >= B:
            break
    dropped = [(r, g) for r in range(len(rounds)) for g in range(B) if (r, g) not in chosen]
    merged = merge_groups(rounds, (chosen + dropped)[:B], G, sampler.tokenizer.pad_token_id)
    merged.scalars["sampling/rounds"] = common.all_reduce(torch.tensor(len(rounds)), "max").item()
    varied = common.all_reduce(torch.tensor(min(len(chosen), B))).item()
    merged.scalars["sampling/frac_groups_varied"] = varied / args.prompts_per_step
    return merged


def merge_groups(batches: list[Batch], chosen: list, G: int, pad: int) -> Batch:
    """One batch of the groups ``chosen`` = [(batch index, group index), ...]: every field's rows
    concatenated, prompts left-padded and completions right-padded again to the widest."""
    rows, first = [(batches[b], slice(g * G, (g + 1) * G)) for b, g in chosen], batches[0]

    def cat(key: str, value=0, left=False):  # the chosen rows of a field, padded to the widest
        parts = [getattr(b, key)[r] for b, r in rows] if getattr(first, key) is not None else None
        if parts is None or isinstance(parts[0], list):
            return parts and [x for part in parts for x in part]
        if parts[0].ndim == 1:
            return torch.cat(parts)
        width = max(p.shape[-1] for p in parts)
        side = lambda gap: (gap, 0) if left else (0, gap)  # noqa: E731 - F.pad's (left, right)
        return torch.cat([F.pad(p, side(width - p.shape[-1]), value=value) for p in parts])

    prompts = cat("prompt_ids", pad, True), cat("prompt_mask", 0, True)
    completions = cat("completion_ids", pad), cat("completion_mask")
    fields = ("examples", "completions", "rewards", "verifiable", "correct", "truncated")
    fns = {k: torch.cat([b.reward_fns[k][r] for b, r in rows]) for k in first.reward_fns}
    return Batch(*prompts, *completions, *map(cat, fields), reward_fns=fns)


def overlong_penalty(mask: torch.Tensor, max_length: int, buffer: int) -> torch.Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476, §3.4), added to the reward: (N,) in [-1, 0]
    from the lengths |o| of the (N, T) ``mask``: 0 for ``|o| <= L_max - L_cache``, then ``((L_max -
    L_cache) - |o|) / L_cache``, -1 at L_max = ``max_length`` (L_cache = ``buffer``, 0 = off)."""
    return (((max_length - buffer) - mask.float().sum(1).cpu()) / max(buffer, 1)).clamp(-1.0, 0.0)


# ----------------------------------------------------------------------------------------------
# Scale-out and speed: micro-batches (torchrun is in common.py)
# ----------------------------------------------------------------------------------------------
def rows_with_a_gradient(advantages, loss_mask, other_weights: float, loss_type: str, G: int):
    """(n,) long: the rows steps 4-5 compute. A row with no token in the (N, T) ``loss_mask`` or,
    if ``other_weights`` (summed, of the terms but A's) is 0, whose advantages are all 0 (equal
    rewards) adds exactly 0 to the loss and its gradient: left out (not under bnpo, whose
    per-micro-batch mean counts it). If none is left, the first group stays: AdamW steps on 0s."""
    nonzero = (advantages != 0).reshape(len(advantages), -1).any(1)
    keep = (loss_mask.sum(1) > 0) & (nonzero | (other_weights > 0)) | (loss_type == "bnpo")
    keep[:G] |= not keep.any()  # none left: the first group
    return keep.nonzero().squeeze(1)


def plan_micro_batches(batch: Batch, size: int, G: int, device, rows: torch.Tensor):
    """Micro-batches of ``size`` of the batch's ``rows`` for steps 4-5, yielded as (rows, length t,
    :class:`MicroBatch`). Groups of similar completion length go together (whole groups when
    ``size`` is a multiple of G: a prompt goes through the model once per micro-batch that holds
    its completions), each trimmed to its longest prompt and completion. The loss is a sum over
    sequences, so the order only saves compute (except --loss-type bnpo's per-micro-batch mean)."""
    mask, lengths = batch.completion_mask, batch.completion_mask.sum(1)
    lens, group_lens = lengths.tolist(), lengths.view(-1, G).amax(1).tolist()
    order = sorted(rows.tolist(), key=lambda i: (-group_lens[i // G], i // G, -lens[i]))
    for idx in torch.tensor(order, device=device).split(size):
        groups, prompt_index = torch.unique(idx // G, return_inverse=True)  # each prompt once
        prompt_ids, prompt_mask = batch.prompt_ids[groups * G], batch.prompt_mask[groups * G]
        first = int(prompt_mask.any(0).float().argmax())  # first column with a real token
        t = int(lengths[idx].max())
        prompts = prompt_ids[:, first:], prompt_mask[:, first:], prompt_index
        yield idx, t, MicroBatch(*prompts, batch.completion_ids[idx, :t], mask[idx, :t].long())


# ----------------------------------------------------------------------------------------------
# TRY NOT TO MODIFY: run plumbing (validation, resume, metrics, checkpoints)
# ----------------------------------------------------------------------------------------------
SCRIPT = "grpo_lm.py"  # written into checkpoints: --resume refuses another script's
# the flags a resumed run cannot change: its directory, data, objective, weights' shapes
FROZEN = ("model_name_or_path", "runs_dir", "run_name", "task", "dataset", "prompt_field",
          "answer_field", "eval_size", "max_prompt_length", "system_prompt", "response_prefix",
          "reward_fn", "reward_weights", "group_size", "reward_model_path", "train_reward_model",
          "lora_rank", "lora_alpha", "lora_target_modules")  # fmt: skip


def validate(args: Args) -> None:
    """One-line errors (UsageError naming the flag) for flags that cannot work, before anything
    loads: each flag's own constraint (beside it in Args), the rules both LM scripts share
    (common.check_flags, tasks.check_task_flags), then GRPO's."""
    common.check_flags(Args, dataclasses.asdict(args))
    prompts = (args.prompt_field, args.answer_field, args.system_prompt, args.response_prefix)
    tasks.check_task_flags(args.reward_fn, args.reward_weights, *prompts)
    steps, iterations, rm_path = args.total_steps, args.iterations, args.reward_model_path
    check(steps % iterations == 0, f"--iterations {iterations} must divide --total-steps {steps}")
    check(args.overlong_buffer < args.max_new_tokens, "--overlong-buffer: below --max-new-tokens")
    world = f"--prompts-per-step must be divisible by the {common.world_size()} torchrun processes"
    check(args.prompts_per_step % common.world_size() == 0, world)
    two = "--reward-fn and a frozen --reward-model-path are two rewards: pick one"
    check(not (args.reward_fn and rm_path and not args.train_reward_model), two)
    untrained = "--train-reward-model without --reward-model-path needs --iterations >= 2"
    check(not args.train_reward_model or rm_path or iterations >= 2, untrained)
    lora = "--lora-rank needs --iterations 1: the reference (the policy's adapter off) never resets"
    mixed = "--scale-rewards group: not with --advantage reinforce++ (its batch-centred rewards)"
    check(args.advantage != "reinforce++" or args.scale_rewards != "group", mixed)
    check(not args.lora_rank or iterations == 1, lora)


def resume_checkpoint(args: Args) -> dict | None:
    """The --resume checkpoint (memory-mapped; None without --resume), checked before anything loads
    by common.resume_checkpoint (this script's, ``FROZEN`` flags unchanged, steps left), with the
    same Algorithm 1 iterations: --total-steps / --iterations steps each. Raises UsageError."""
    checkpoint = common.resume_checkpoint(dataclasses.asdict(args), SCRIPT, FROZEN)
    saved = checkpoint["args"] if checkpoint else dataclasses.asdict(args)
    length, one = saved["total_steps"] // saved["iterations"], saved["iterations"] == 1
    same = f"--total-steps: this run's iterations have {length} steps; resume with that length"
    check(one and args.iterations == 1 or args.total_steps // args.iterations == length, same)
    return checkpoint


def restore(checkpoint: dict | None, args: Args, policy, optimizer, reference, rm_training) -> int:
    """Load a checkpoint's weights and optimizer states (the flags given now set the optimizers'
    learning rates and weight decay); returns the checkpoint's step (0 without one)."""
    if checkpoint is None:
        return 0
    common.load_trained_weights(policy, checkpoint["policy"])  # the same model: the weights fit
    optimizer.load_state_dict(checkpoint["optimizer"])
    if reference is not None and checkpoint["reference"] is not None:  # reset (--iterations > 1)
        reference.load_state_dict(checkpoint["reference"])
    rm_training.state(checkpoint) if rm_training else None
    optimizer.param_groups[0].update(lr=args.learning_rate, weight_decay=args.weight_decay)
    for group in rm_training.optimizer.param_groups if rm_training else []:
        group.update(lr=args.rm_learning_rate, weight_decay=args.weight_decay)
    return checkpoint["step"]


def step_metrics(args: Args, batch: Batch, rewards, loss_stats: list, grad_norm, t0, gen_time):
    """A step's logged scalars over the global batch from ``loss_stats`` (:func:`grpo_loss`'s of
    every micro-batch, with its ``loss`` and masked ``entropy`` sum) and ``batch.scalars``:
    ``loss/policy`` the minimised -J of eq. 3 (KL, entropy bonus in), other ``loss/*`` over
    :func:`rows_with_a_gradient`'s rows."""
    keys = ("loss", "kl", "clipped_high", "clipped_low", "tokens", "entropy")  # micro-batches, mu
    sums = torch.tensor([sum(stats[key].item() for stats in loss_stats) for key in keys])
    loss, kl, high, low, tokens, entropy = common.all_reduce(sums).tolist()
    per_token = dict(kl=kl, clip_fraction=high + low, entropy=entropy)
    per_token |= dict(clip_fraction_high=high, clip_fraction_low=low)  # A > 0 and A < 0
    per_sequence = (batch.completion_mask.sum(1), batch.correct, batch.truncated)
    lengths, correct, truncated = (common.all_gather(x.float().cpu()) for x in per_sequence)
    ratio_max = torch.tensor(max(stats["ratio_max"].item() for stats in loss_stats))
    equal = (rewards.view(-1, args.group_size).std(1) == 0).float().mean().item()
    scalars = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item(),
        "reward/accuracy": correct.mean().item(),
        "reward/frac_zero_std_groups": equal,
        "loss/policy": loss / args.mu,
        "loss/tokens": tokens / args.mu,
        **{f"loss/{k}": v / max(tokens, 1) for k, v in per_token.items()},  # token means
        "loss/ratio_max": common.all_reduce(ratio_max, "max").item(),
        "completion/length_mean": lengths.mean().item(),
        "completion/frac_truncated": truncated.mean().item(),
        "optim/grad_norm": grad_norm.item(),
        "time/generation_s": gen_time,
        "time/training_s": time.time() - t0 - gen_time,
        **common.peak_memory_gb(grad_norm.device),
        **batch.scalars,
        **common.reward_fn_means(batch.reward_fns),  # --reward-fn
    }
    if batch.verifiable is not None and (args.reward_model_path or args.train_reward_model):
        scalars["reward/verifiable_mean"] = common.all_gather(batch.verifiable).mean().item()
    return scalars


def save_checkpoint(log, step: int, args: Args, policy, optimizer, reference, rm_training) -> None:
    """Every --save-every steps and at the end (rank 0), atomically, what an exact resume needs: the
    reference when --iterations > 1 resets it (else --model-name-or-path's, loaded again) and the
    reward model with its samples."""
    due = args.save_every and step % args.save_every == 0 or step == args.total_steps
    if log.is_main and due:
        reset = reference.state_dict() if args.iterations > 1 and reference is not None else None
        state = dict(script=SCRIPT, step=step, args=dataclasses.asdict(args), reference=reset)
        state |= dict(policy=common.trained_weights(policy), optimizer=optimizer.state_dict())
        state |= rm_training.state() if rm_training else {}
        common.atomic_save(state | dict(rng=common.rng_state()), log.checkpoint)


def sample_lines(batch: Batch, G: int) -> list[str]:
    """The first completion of each group with its reward, for the printed and logged samples."""
    lines = zip(batch.rewards[::G], batch.examples[::G], batch.completions[::G], strict=True)
    return [f"[reward {r:.2f}] {ex['question']!r} -> {c!r}" for r, ex, c in lines]


def cli(argv: list[str] | None = None) -> None:
    """The command line (``--help``): bad input ends in one ``error: ...`` line, exit code 2."""
    common.run_cli(lambda: main(common.parse_args(Args, argv, SCRIPT)))


if __name__ == "__main__":
    cli()
