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
math (group_advantages §4.1.2, token_log_probs, k3_kl eq. 4, grpo_loss eq. 3, aggregate); main(),
Algorithm 1 step by step. Below main(): steps 1-2 in full (sample_and_score, reward), then each
extension in a labelled section, reaching the loop through one line tagged with its source:
process supervision (§4.1.3) and iterative RL with a retrained reward model (§4.1.4); Dr. GRPO
(arXiv 2503.20783), DAPO (arXiv 2503.14476), GSPO (arXiv 2507.18071), TIS; micro-batches; then the
run plumbing. Every flag defaults to the paper's GRPO. Departures: learning rate 1e-5 (the paper's
1e-6 barely moves a 135M model in 30 steps), G = 8 and 16 questions per step, beta = 0 (TRL's
default, the paper's is 0.04: no reference model, and the update skips groups of equal rewards),
KL and ratio between temperature-scaled distributions. Where the paper leaves a choice open:
process supervision makes the final answer one more step with the outcome reward; the iterative
reward model regresses (MSE) on the verifiable reward.

Several GPUs (as nanoGPT): `torchrun --nproc_per_node K grpo_lm.py ...` gives each process whole
groups of the global --prompts-per-step, normalises every loss by global counts and sums gradients
once per update, so K processes take one process's step. Only rank 0 logs, evaluates and saves.

Usage:  python grpo_lm.py --group-size 8        (see --help for every flag)
        torchrun --nproc_per_node 8 grpo_lm.py --prompts-per-step 64 --group-size 16
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass
@pydantic.with_config(allow_inf_nan=False)  # common.flag_error: no NaN or inf in any flag
class Args:
    # --- the paper's GRPO (DeepSeekMath §4.1): models, task, sampling, eq. 3 ---

    # policy to train: a local directory or Hub id of a causal LM (the default loads offline)
    model_name_or_path: str = common.DEFAULT_MODEL
    # sequence-classification reward model with the policy's tokenizer, read where its own forward
    # pass pools (the last non-pad token); frozen unless --train-reward-model; default: task reward
    reward_model_path: str | None = None
    # built-in verifiable task: 'addition' ("What is a + b?", two-digit a, b), 'multistep' ("Compute
    # (a + b) * c - d") or 'countdown' (make a target from 4 numbers with + - * /, as TinyZero)
    task: Literal["addition", "multistep", "countdown"] = "addition"
    # JSONL file of questions and answers (GSM8K's '... #### N' or a plain answer); overrides --task
    dataset: str | None = None
    prompt_field: str = "question"  # --dataset: the field that holds the question
    answer_field: str = "answer"  # --dataset: the field that holds the answer
    # your own reward, path/to/file.py:function with function(completion, example) -> float,
    # repeatable ('task': the task's own); their weighted sum scores each completion (default: task)
    reward_fn: tyro.conf.UseAppendAction[list[str]] = dataclasses.field(default_factory=list)
    # weights of the --reward-fn functions, in order (default: 1 each)
    reward_weights: list[float] = dataclasses.field(default_factory=list)
    # reward for the expected format (0 = off): a final number, Countdown's <answer> block, or the
    # whole <think> ... </think> <answer> ... </answer> shape of --answer-format think
    format_reward: float = 0.0
    # 'think': completions are <think> ... </think> <answer> ... </answer>, and rewards and accuracy
    # read the answer block
    answer_format: Literal["plain", "think"] = "plain"
    # system message before every question (default: none, or --answer-format think's instructions)
    system_prompt: str | None = None
    # the start of every answer (assistant prefill, e.g. '<think>'); rewards see it too
    response_prefix: str = ""
    total_steps: Annotated[int, Ge(1)] = 36  # steps: sample a batch, then --mu policy updates
    prompts_per_step: Annotated[int, Ge(1)] = 16  # questions per step, --group-size outputs each
    group_size: Annotated[int, Ge(2)] = 8  # G: outputs sampled per question (the paper: 64)
    max_new_tokens: Annotated[int, Ge(1)] = 20  # maximum completion length in tokens
    max_prompt_length: Annotated[int, Ge(1)] = 512  # longer prompts leave the training set
    temperature: Annotated[float, Ge(1e-3)] = 0.7  # sampling temperature T, also of the log probs
    # nucleus sampling (1.0 = sample from the full distribution, which the ratio assumes)
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    # AdamW learning rate (the paper's 1e-6 barely moves a 135M model in 30 steps)
    learning_rate: Annotated[float, Interval(gt=0, lt=1)] = 1e-5
    # KL coefficient beta of eq. 3's k3 penalty (the paper's 0.04; 0: no KL, no reference model)
    beta: Annotated[float, Ge(0)] = 0.0
    clip_range: Annotated[float, Interval(gt=0, lt=1)] = 0.2  # eps of the clipped surrogate
    mu: Annotated[int, Ge(1)] = 1  # policy updates per step (Algorithm 1's GRPO iterations)
    max_grad_norm: Annotated[float, Gt(0)] = 1.0  # global gradient-norm clipping
    weight_decay: Annotated[float, Ge(0)] = 0.0  # AdamW weight decay
    adv_eps: Annotated[float, Gt(0)] = 1e-4  # added to the group std: equal rewards give 0, not NaN

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

    # --- later variants (all default to the paper's GRPO): Dr. GRPO, DAPO, GSPO ---

    # 'grpo' (per-sequence mean, eq. 3), 'bnpo' (token mean per micro-batch), 'dr_grpo' (sum / (B *
    # max len)), 'dapo' (token mean over the batch)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "grpo"
    # divide centred rewards by the std of the 'group', of the 'batch', or 'none' (Dr. GRPO)
    scale_rewards: Literal["group", "batch", "none"] = "group"
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

    # rank R of the policy's LoRA adapters (0 = full fine-tuning); the reference is then the policy
    # with its adapter disabled
    lora_rank: Annotated[int, Ge(0)] = 0
    # LoRA scale: the update of a weight is (alpha / R) * B A; default 2 x --lora-rank
    lora_alpha: Annotated[float, Gt(0)] | None = None
    # modules that get adapters: peft names (e.g. q_proj v_proj) or 'all-linear' (attention and MLP)
    lora_target_modules: tuple[str, ...] = ("all-linear",)

    # --- run: experiment, logging, evaluation, checkpoints ---

    exp_name: str = "grpo_lm"  # name of this experiment (part of the run name)
    # seed of the prompts, sampling and initialisation
    seed: Annotated[int, Interval(ge=0, le=2**32 - 1)] = 1
    runs_dir: str = "runs"  # TensorBoard logs, args and checkpoints go to {runs_dir}/{run_name}/
    run_name: str | None = None  # run directory (default: {task}__{exp_name}__{seed}__{unix time})
    # greedy held-out accuracy every N steps, and at the start and end (0: only there)
    eval_every: Annotated[int, Ge(0)] = 12
    # held-out questions for greedy accuracy (0 = no evaluation, nothing held out)
    eval_size: Annotated[int, Ge(0)] = 128
    eval_batch_size: Annotated[int, Ge(1)] = 64  # questions per greedy decoding call
    sample_every: Annotated[int, Ge(0)] = 5  # print and log samples every N steps (0 = never)
    save_every: Annotated[int, Ge(0)] = 10  # checkpoint every N steps and at the end (0 = end only)
    # checkpoint.pt to continue from: its run's flags are the defaults, flags given again override
    # them (same flags, same results); the model, group size, reward model, --eval-size and run
    # directory cannot change
    resume: str | None = None
    torch_threads: Annotated[int, Ge(0)] = 0  # CPU threads for torch (0 = torch's default)
    # no training: the greedy held-out accuracy of the --resume checkpoint or of
    # --model-name-or-path (e.g. a run's final_model/), printed and written as JSON into the run dir
    eval_only: bool = False
    # also log to Weights & Biases (pip install wandb; WANDB_MODE=offline keeps it on disk)
    track: bool = False
    wandb_project_name: str = "minimal-ppo-grpo"  # the wandb project of --track
    wandb_entity: str | None = None  # the wandb team or user of --track (default: yours)

    # --- scale-out and speed: devices, several processes (torchrun), micro-batches, samplers ---

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
    # log probs: each group's prompt through the model once, its keys/values shared by its G outputs
    # (off: whole sequences)
    share_prompt: bool = True
    # sample from a bfloat16 copy of the policy (refreshed every step), not under --bf16 autocast
    fast_generation: bool = False
    # truncated importance sampling (Yao et al. 2025; TRL token_truncate): with a sampler other than
    # the trained module (--fast-generation, --bf16), weight each token's surrogate by
    # min(pi_old / pi_sampler, C); 0 = off
    tis_cap: Annotated[float, Ge(0)] = 0.0


@dataclass
class Batch:
    """Steps 1-2, this process's share: N = B * G completions (a question's G contiguous) of at
    most T tokens, their prompts of at most P tokens, and their rewards (set by :func:`reward`)."""

    prompt_ids: torch.Tensor  # (N, P) each completion's prompt, left-padded
    prompt_mask: torch.Tensor  # (N, P) 1 for the prompt's tokens
    completion_ids: torch.Tensor  # (N, T) the sampled tokens, padding after the first EOS
    completion_mask: torch.Tensor  # (N, T) float, 1 up to and including the first EOS
    examples: list[dict]  # the question (and answer) of each completion
    completions: list[str]  # the decoded completions
    # (N, T) the sampler's log probs, recorded whenever the sampler is not the trained module in
    # float32 (--fast-generation, or --bf16 autocast): the mismatch log and TIS
    sampler_logp: torch.Tensor | None
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


def group_advantages(rewards: torch.Tensor, group_size: int, eps=1e-4, scale="group"):
    """Outcome supervision (§4.1.2): (B * G,) ``(r_i - mean(r)) / (std(r) + eps)`` over the G
    outputs of each question (contiguous in ``rewards``, unbiased std), for every token of o_i; a
    group of equal rewards gets 0. ``scale="batch"``: the whole batch's std; ``"none"``: only
    centred (Dr. GRPO, arXiv 2503.20783 §3.1: the std up-weights questions too easy or too hard).
    Raises ValueError: ``rewards`` do not split into groups of ``group_size``, or a bad ``scale``.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards {tuple(rewards.shape)} do not split into groups of {group_size}")
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', not {scale!r}")
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(1, keepdim=True)
    std = rewards.std() if scale == "batch" else grouped.std(1, keepdim=True)
    return (centred if scale == "none" else centred / (std + eps)).view(-1)


class MicroBatch(NamedTuple):
    """:func:`token_log_probs`'s inputs: b completions of U distinct prompts (G share each)."""

    prompt_ids: torch.Tensor  # (U, P) the distinct prompts, left-padded
    prompt_mask: torch.Tensor  # (U, P) 1 for real prompt tokens
    prompt_index: torch.Tensor  # (b,) long: the row of prompt_ids each completion continues
    completion_ids: torch.Tensor  # (b, T) the completions
    completion_mask: torch.Tensor  # (b, T) long, 1 up to and including the first EOS


def token_log_probs(model, mb: MicroBatch, temperature, share_prompt=True, with_entropy=False):
    """(b, T) float32 ``log softmax(logits / temperature)`` of every completion token under
    ``model`` (with ``with_entropy`` also the detached (b, T) entropy, for logging).

    ``share_prompt``: each distinct prompt goes through the model once and its keys and values (with
    their gradients) serve every completion that continues it: a whole-sequence pass's numbers, to
    float rounding, for 1/G of the prompt's compute (off under gradient checkpointing, which drops
    the cache). Position ids count real tokens only, as in generation; the LM head and log-softmax
    run in float32 also under bf16 autocast (:func:`float32_lm_head`).
    """
    P, T = mb.prompt_ids.shape[1], mb.completion_ids.shape[1]
    mask = torch.cat([mb.prompt_mask[mb.prompt_index], mb.completion_mask], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with float32_lm_head(model):
        if share_prompt:
            prompt = dict(input_ids=mb.prompt_ids, attention_mask=mb.prompt_mask)
            prompt["position_ids"] = (mb.prompt_mask.cumsum(1) - 1).clamp(min=0)
            prefix = model(**prompt, logits_to_keep=1, use_cache=True)
            logits = prefix.logits[mb.prompt_index]  # (b, 1, V): the first completion token's
            if T > 1:
                cache = prefix.past_key_values
                cache.batch_select_indices(mb.prompt_index)  # (U, ...) -> (b, ...), differentiable
                rest = dict(attention_mask=mask[:, :-1], position_ids=positions[:, P:-1])
                ids = mb.completion_ids[:, :-1]
                rest = model(input_ids=ids, **rest, past_key_values=cache, use_cache=True)
                logits = torch.cat([logits, rest.logits], 1)
        else:
            ids = torch.cat([mb.prompt_ids[mb.prompt_index], mb.completion_ids], 1)
            whole = dict(attention_mask=mask, position_ids=positions, use_cache=False)
            logits = model(input_ids=ids, **whole, logits_to_keep=T + 1).logits[:, :-1]  # t -> t+1
    log_probs = (logits.float() / temperature).log_softmax(-1)
    logp = torch.gather(log_probs, 2, mb.completion_ids.unsqueeze(-1)).squeeze(-1)
    return (logp, -(log_probs.exp() * log_probs).sum(-1).detach()) if with_entropy else logp


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """(B, T) per-token k3 estimate of KL(pi_theta || pi_ref), ``pi_ref/pi - log(pi_ref/pi) - 1``
    >= 0, from the (B, T) log probs of the sampled tokens (DeepSeekMath eq. 4; Schulman 2020).

    Unbiased for tokens sampled from pi_theta; with ``--mu > 1`` they come from pi_old, so after the
    first update only approximately. As a loss term its gradient at each sampled token is that of
    KL(pi_ref || pi_theta)'s estimate (d/dlogp = 1 - pi_ref/pi): the paper's and TRL's choice.
    """
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float,
    beta: float,
    num_sequences: int,
    *,
    loss_type: str = "grpo",
    clip_range_high: float | None = None,
    importance_sampling_level: str = "token",
    num_tokens: float | None = None,
    max_completion_length: int | None = None,
    sampler_logp: torch.Tensor | None = None,
    tis_cap: float = 0.0,
):
    """Negative GRPO objective (DeepSeekMath eq. 3) of a micro-batch, for gradient accumulation.

    Per token ``min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A) - beta * KL`` (eq. 3, 4;
    ``eps_high = clip_range_high``, DAPO §3.1 clip-higher, default eps), summed as :func:`aggregate`
    says. ``ratio = exp(logp - old_logp)`` (with mu = 1 old_logp is ``logp.detach()``); GSPO (arXiv
    2507.18071 §4), sequence level: ``exp(mean_t(logp - old_logp))`` per completion. TIS (Yao et
    al. 2025; TRL's ``token_truncate``), ``tis_cap > 0``: each token's surrogate (not its KL) times
    the detached ``min(pi_old / pi_sampler, tis_cap)``. Masked positions never reach ``exp``.

    Args:
        logp, old_logp, ref_logp: (b, T) log probs under the policy (with grad), pi_old and the
            reference (None with ``beta == 0``); sampler_logp: (b, T) the sampler's, or None.
        advantages: (b,) one per sequence (outcome) or (b, T) one per token (process).
        mask: (b, T) 1 for the tokens in the loss; num_sequences etc.: see :func:`aggregate`.
    Returns:
        (loss, stats): the scalar loss and detached per-token sums and extremes, for logging.
    Raises:
        ValueError: unknown ``loss_type`` / ``importance_sampling_level``, or a count it needs.
    """
    valid = mask.bool()
    log_ratio = torch.where(valid, logp - old_logp, 0.0)
    if importance_sampling_level == "sequence":
        log_ratio = (log_ratio.sum(1) / mask.sum(1).clamp(min=1)).unsqueeze(1)  # (b, 1), GSPO s_i
    elif importance_sampling_level != "token":
        level = importance_sampling_level
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', not {level!r}")
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1) if advantages.ndim == 1 else advantages
    high = clip_range if clip_range_high is None else clip_range_high
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_range, 1 + high) * adv)
    if sampler_logp is not None and tis_cap > 0:  # TIS: pi_old / pi_sampler, truncated at C
        weight = torch.exp(torch.where(valid, old_logp - sampler_logp, 0.0)).clamp(max=tis_cap)
        surrogate = surrogate * weight
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        kl = k3_kl(logp, torch.where(valid, ref_logp, logp.detach()))
    per_token = surrogate - beta * kl if beta else surrogate  # KL in the loss (§4.1.1)
    loss = aggregate(per_token, mask, num_sequences, loss_type, num_tokens, max_completion_length)
    with torch.no_grad():
        clipped = ((adv > 0) & (ratio > 1 + high)) | ((adv < 0) & (ratio < 1 - clip_range))
        stats = dict(kl=(kl * mask).sum(), clipped=(clipped.float() * mask).sum())
        ratios = ratio.expand_as(logp)[valid] if valid.any() else ratio.new_ones(1)
        stats.update(tokens=mask.sum(), ratio_min=ratios.min(), ratio_max=ratios.max())
        if sampler_logp is not None:  # |log pi_old - log pi_sampler|
            gap = (old_logp - sampler_logp).abs()[valid] if valid.any() else logp.new_zeros(1)
            stats.update(sampler_gap_sum=gap.sum(), sampler_gap_max=gap.max())
    return loss, stats


def aggregate(
    per_token, mask, num_sequences, loss_type="grpo", num_tokens=None, max_completion_length=None
) -> torch.Tensor:
    """The negated sum of a micro-batch's (b, T) masked per-token terms of eq. 3, normalised so that
    the micro-batch losses add up to the whole batch's (``num_sequences`` = B * G sequences):

    - ``grpo``: mean over each sequence's ``|o_i|`` tokens, sum over sequences / ``num_sequences``.
    - ``bnpo``: token mean within this micro-batch, times its share ``b / num_sequences`` of the
      sequences (depends on micro-batching; ``dapo`` when one micro-batch holds the whole batch).
    - ``dr_grpo``: token sum / (``num_sequences * max_completion_length``) (Dr. GRPO, arXiv
      2503.20783 §3.1: eq. 3 without 1/|o_i|).
    - ``dapo``: token sum / ``num_tokens``, the valid tokens of the whole batch (DAPO §3.3).

    Raises ValueError: unknown ``loss_type``, or the count it needs is missing.
    """
    masked = per_token * mask
    if loss_type == "grpo":
        return -(masked.sum(1) / mask.sum(1).clamp(min=1)).sum() / num_sequences
    if loss_type == "bnpo":
        return -masked.sum() / mask.sum().clamp(min=1) * (mask.shape[0] / num_sequences)
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
        return -masked.sum() / (num_sequences * max_completion_length)
    if loss_type == "dapo":
        if num_tokens is None:
            raise ValueError("loss_type 'dapo' needs num_tokens, the whole batch's valid tokens")
        return -masked.sum() / max(float(num_tokens), 1.0)
    raise ValueError(f"loss_type must be 'grpo', 'bnpo', 'dr_grpo' or 'dapo', not {loss_type!r}")


@contextlib.contextmanager
def float32_lm_head(model):
    """While active, ``model``'s LM head computes the logits in float32, also under bf16 autocast:
    logits rounded to bf16 put a floor under every log prob (the k3 KL read ~1.5e-3 per token
    against a true 1e-5, benchmarks/bf16_numerics.py). The head (float32 weights, as
    ``common.load_model`` loads them, LoRA adapter included) runs on float32 hidden states with
    autocast off; without autocast it is the head's usual forward, the same numbers."""
    head = model.get_output_embeddings()
    own_forward, patched = head.forward, "forward" in vars(head)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return own_forward(hidden.float())

    head.forward = forward
    try:
        yield
    finally:
        if patched:
            head.forward = own_forward
        else:
            del head.forward


# ----------------------------------------------------------------------------------------------
# GRPO, DeepSeekMath §4.1 and Algorithm 1
# ----------------------------------------------------------------------------------------------
def main(args: Args, task: tasks.Task | None = None, step_reward_fn: Callable | None = None):
    """Train with GRPO; returns the per-step history of logged scalars (a dict of lists).

    ``task`` replaces the built-in task: any :class:`tasks.Task` with your own reward function.
    ``step_reward_fn(completion, example) -> [(end character offset, reward), ...]`` gives the step
    rewards of ``--supervision process`` (default :func:`tasks.arithmetic_step_rewards`: every
    equation ``x op y = z`` checked). Under ``torchrun`` every process runs this function on its
    share of the batch; the returned history holds the global values on every rank.
    """
    # A bad flag, checkpoint, run directory, dataset or reward file fails here, before any load
    validate(args)
    checkpoint = resume_checkpoint(args)
    run_dir = common.make_run_dir(args)
    task = task or tasks.task_of(args)
    tokenizer = common.load_tokenizer(args.model_name_or_path)
    if args.eval_only:  # --eval-only: the held-out accuracy of a saved model, no training
        return common.eval_only(args, task, tokenizer, checkpoint, run_dir)
    positions = common.max_positions(args.model_name_or_path)
    questions = tasks.training_questions(task, tokenizer, args, positions)
    # torchrun: each process samples and trains on its share of the batch
    rank, world, device = common.start_processes(args.torch_threads, args.device)
    common.seed_everything(args.seed)

    # Algorithm 1's input: the initial policy pi_theta, the reference pi_ref (a frozen copy of it,
    # §4.1.1; none with beta = 0) and the reward: the task's reward function or a reward model r_phi
    policy = common.load_policy(args, device)  # --lora-rank: adapters on the frozen model
    reference = common.load_reference(policy, args, device)
    reward_model = make_reward_model(args, tokenizer, device)
    rm_training = None  # Algorithm 1, §4.1.4: the reward model's continual training
    if args.train_reward_model:
        rm_training = RewardModelTraining(reward_model, tokenizer, args, device)
    trained = [p for p in policy.parameters() if p.requires_grad]
    lr, weight_decay = args.learning_rate, args.weight_decay  # fused: one kernel (CPU and CUDA)
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay, fused=True)
    start_step = restore(checkpoint, args, policy, optimizer, reference, rm_training)  # 0: new run
    bar = {"reward": "reward/mean", "kl": "loss/kl", "len": "completion/length_mean"}
    log = common.RunLog(run_dir, args, rank, start_step, checkpoint is not None, "grpo", bar)
    sampler_model, options = common.sampler_for(policy, args, args.generation_groups_per_call)
    sampler = Sampler(sampler_model, options, tokenizer, questions, task, reward_model, rank, world)
    if checkpoint is not None:
        common.set_rng_state(checkpoint["rng"])  # last: loading the models must not shift the RNG
    else:
        common.evaluate(policy, tokenizer, task, args, device, log, 0)  # held-out accuracy at start

    G, B = args.group_size, args.prompts_per_step // world  # B questions per process
    N, N_all = B * G, args.prompts_per_step * G  # this process's outputs, all processes' outputs
    steps_per_iteration = args.total_steps // args.iterations  # one iteration of Algorithm 1
    shared = args.share_prompt and not args.gradient_checkpointing  # checkpointing: no KV cache
    temperature, eps, beta = args.temperature, args.clip_range, args.beta  # T; eq. 3's eps, beta
    for step in log.progress(start_step, args.total_steps):
        t0 = time.time()
        # ---- 0. Algorithm 1: each iteration starts with reference <- policy ----
        if reference is not None and step > 0 and step % steps_per_iteration == 0:
            reference.load_state_dict(policy.state_dict())

        # ---- 1. Sample B questions, G outputs o_i of each from pi_old = the policy, at T ----
        # ---- 2. and their rewards r_i: the task's reward functions, or the reward model ----
        common.refresh_sampler(sampler.model, policy)  # --fast-generation: the bf16 copy
        batch = sample_and_score(sampler, args, device, step)  # Batch: o_i and r_i (reward())
        if args.dynamic_sampling:  # DAPO §3.2: only groups whose rewards differ
            batch = dynamic_sampling(batch, sampler, args, device, step)
        lengths = batch.completion_mask.sum(1).cpu()  # DAPO §3.4 (0 with --overlong-buffer 0):
        penalty = overlong_penalty(lengths, args.max_new_tokens, args.overlong_buffer)
        batch.rewards = batch.rewards + penalty  # a new tensor: batch.verifiable stays the task's
        rewards = common.all_gather(batch.rewards)  # (N_all,) every process's r_i, group order
        if rm_training is not None:  # Algorithm 1 / §4.1.4: samples for the reward model
            rm_training.add(batch)
        gen_time = time.time() - t0

        # ---- 3. Advantages: A_i,t = (r_i - mean(r)) / std(r) of its group, every t (§4.1.2) ----
        advantages = group_advantages(rewards, G, args.adv_eps, args.scale_rewards)
        advantages = advantages[rank * N : rank * N + N].to(device)  # this process's groups
        if args.supervision == "process":  # §4.1.3: sums of the normalised step rewards from t on
            steps = step_reward_fn or tasks.arithmetic_step_rewards
            advantages = process_supervision(batch, tokenizer, steps, args, device)

        # ---- 4. Old and reference log probs of the sampled tokens (no grad) ----
        loss_mask = completions_in_the_loss(batch, args.mask_truncated_completions)  # DAPO §3.4
        # the rows with a gradient: with beta = 0 not the groups of equal rewards (A = 0)
        rows = rows_with_a_gradient(advantages, loss_mask, beta, args.loss_type, G)
        micro_batches = plan_micro_batches(batch, args.micro_batch_size, G, device, rows)
        old_logp = torch.zeros_like(loss_mask)
        ref_logp = torch.zeros_like(loss_mask) if reference is not None else None
        with torch.no_grad(), common.bf16_autocast(device, args.bf16):  # --bf16 (CUDA, AVX512-BF16)
            for idx, t, inputs in micro_batches:
                if args.mu > 1:  # with mu = 1, pi_old = pi_theta: logp.detach() below
                    old_logp[idx, :t] = token_log_probs(policy, inputs, temperature, shared)
                if reference is not None:
                    ref_logp[idx, :t] = token_log_probs(reference, inputs, temperature, shared)

        # ---- 5. mu GRPO iterations: maximise eq. 3 (gradients accumulated over micro-batches) ----
        # The ratio uses step 4's old_logp: pi_old stays the sampling policy for all mu updates.
        loss_kw = variant_options(args, loss_mask)  # Dr. GRPO, DAPO, GSPO, TIS (off: the paper)
        loss_stats = []  # grpo_loss's stats of each micro-batch, for step_metrics
        for _ in range(args.mu):
            optimizer.zero_grad(set_to_none=True)
            with common.train_mode((policy,), args.gradient_checkpointing):
                for idx, t, inputs in micro_batches:
                    with common.bf16_autocast(device, args.bf16):
                        logp, entropy = token_log_probs(policy, inputs, temperature, shared, True)
                    old = old_logp[idx, :t] if args.mu > 1 else logp.detach()
                    ref = ref_logp[idx, :t] if ref_logp is not None else None
                    adv = advantages[idx] if advantages.ndim == 1 else advantages[idx, :t]
                    mask = loss_mask[idx, :t]
                    tis = common.micro(batch.sampler_logp, idx, t)  # TIS, Yao et al. 2025
                    loss, stats = grpo_loss(
                        logp, old, ref, adv, mask, eps, beta, N_all, sampler_logp=tis, **loss_kw
                    )
                    loss.backward()
                    stats.update(loss=loss.detach(), entropy=(entropy * mask).sum())
                    loss_stats.append(stats)
            common.all_reduce_gradients(policy.parameters())  # torchrun: DDP's all-reduce
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            where = f"step {step + 1}"
            common.check_finite_update(
                where, HINT, log.checkpoint, loss=loss, gradient_norm=grad_norm
            )
            optimizer.step()
            common.check_finite_parameters(policy.parameters(), where, HINT, log.checkpoint)

        # ---- 6. Algorithm 1: after an iteration, train the reward model (samples + replay) ----
        if rm_training is not None and (step + 1) % steps_per_iteration == 0:
            log(step + 1, rm_training.train(step, log.checkpoint))

        # ---- logging, evaluation (every --eval-every), checkpoints (every --save-every) ----
        metrics = step_metrics(args, batch, rewards, loss_stats, grad_norm, t0, gen_time)
        log(step + 1, metrics)
        log.samples(step + 1, sample_lines(batch, G), args.sample_every)
        common.evaluate(policy, tokenizer, task, args, device, log, step + 1)
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
def sample_and_score(sampler: Sampler, args: Args, device, step: int, round_: int = 0) -> Batch:
    """Steps 1-2 for one draw of questions, from ``(--seed, step, round_)``: this process's B
    questions, G completions of each from ``softmax(logits / T)`` (within the top-p nucleus), and
    their rewards (:func:`reward`). Each sampling call of --generation-groups-per-call groups is
    reseeded from ``(--seed, step, round_, global index of its first group)``: the samples do not
    depend on how many processes share the batch."""
    G, tokenizer, pad = args.group_size, sampler.tokenizer, sampler.tokenizer.pad_token_id
    B = args.prompts_per_step // sampler.world
    first = sampler.rank * B  # this process's groups: first .. first + B - 1
    rng = np.random.default_rng([args.seed, step] + ([round_] if round_ else []))
    picks = rng.choice(len(sampler.questions), args.prompts_per_step, replace=False)
    examples = [sampler.questions[i] for i in picks[first : first + B] for _ in range(G)]
    style = tasks.prompt_style(args.answer_format, args.system_prompt, args.response_prefix)
    prompts = tasks.prompt_ids(tokenizer, [ex["question"] for ex in examples[::G]], *style)
    seeds = dict(seed_keys=(args.seed, step, round_), first=first)
    rows, row_logps = common.generate_completions(
        sampler.model, prompts, G, tokenizer, device, **seeds, **sampler.options
    )
    prompt_ids, prompt_mask = common.pad_left([p for p in prompts for _ in range(G)], pad, device)
    T = max(len(r) for r in rows)
    completion_ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows], device=device)
    mask = completion_mask(completion_ids, tokenizer.eos_token_id)  # (N, T): none after the EOS
    completion_ids = torch.where(mask.bool(), completion_ids, pad)
    # recorded whenever the sampler is not the trained module in float32 (--fast-generation, --bf16)
    sampler_logp = None
    if row_logps is not None:
        sampler_logp = torch.tensor([r + [0.0] * (T - len(r)) for r in row_logps], device=device)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    batch = Batch(prompt_ids, prompt_mask, completion_ids, mask, examples, texts, sampler_logp)
    return reward(batch, sampler, args, device, step)


def reward(batch: Batch, sampler: Sampler, args: Args, device, step: int) -> Batch:
    """Step 2: ``batch`` with its rewards, from the task's reward functions or the reward model, and
    its ``verifiable``, ``correct``, ``truncated`` and ``reward_fns``. A reward model trained from
    the policy's backbone scores from iteration 2 on, once trained; until then the verifiable reward
    does (Algorithm 1). Raises UsageError: a reward function raises or returns NaN or inf."""
    examples, task = batch.examples, sampler.task
    responses = [args.response_prefix + c for c in batch.completions]  # what the rewards read
    trained = args.reward_model_path is not None or step >= args.total_steps // args.iterations
    by_model = sampler.reward_model is not None and trained
    if not by_model or args.train_reward_model:  # --reward-fn: each function's own rewards too
        batch.verifiable, batch.reward_fns = tasks.score_task(task, responses, examples)
    batch.rewards = batch.verifiable
    if by_model:
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
        mask = torch.cat([batch.prompt_mask, batch.completion_mask.long()], 1)
        model, size = sampler.reward_model, args.micro_batch_size
        batch.rewards = common.score_with_reward_model(model, ids, mask, size, device, args.bf16)
    batch.correct = tasks.score_correct(task, responses, examples)
    eos = (batch.completion_ids == sampler.tokenizer.eos_token_id) & batch.completion_mask.bool()
    batch.truncated = ~eos.any(1)
    return batch


@dataclass
class Sampler:
    """What steps 1-2 sample with and score by. With --fast-generation the model is a bfloat16 copy
    of the policy; log probs for the loss always come from the policy, so a bf16 sampler draws from
    a slightly different distribution than the ratio and the KL assume: the gap is logged
    (sampling/logp_diff_*) and --tis-cap corrects it."""

    model: Any  # what generates: the policy itself, or its bfloat16 copy (--fast-generation)
    options: dict  # common.generate_completions' options (temperature, top-p, lengths, ...)
    tokenizer: Any
    questions: list[dict]  # the training questions whose prompts fit --max-prompt-length
    task: tasks.Task
    reward_model: Any  # None: the task's verifiable reward
    rank: int  # torchrun: this process samples the groups rank * B .. rank * B + B - 1 of each step
    world: int


# ----------------------------------------------------------------------------------------------
# DeepSeekMath's own extensions: process supervision (§4.1.3) and iterative RL with the reward model
# (§4.1.4)
# ----------------------------------------------------------------------------------------------
def process_supervision(batch: Batch, tokenizer, step_reward_fn: Callable, args: Args, device):
    """§4.1.3: (N, T) advantages on ``device`` from the steps that ``step_reward_fn(completion,
    example) -> [(end character offset, reward), ...]`` checks in each completion, plus its final
    answer as one more step with the outcome reward (:func:`process_advantages`); the ``process/*``
    scalars (over every process) go to ``batch.scalars``. Raises UsageError: the function raises."""
    N, T = batch.completion_ids.shape
    step_r, step_i, step_t = [], [], []
    for i, (text, ex) in enumerate(zip(batch.completions, batch.examples, strict=True)):
        n_i = int(batch.completion_mask[i].sum())
        try:
            steps = [(int(end), float(reward)) for end, reward in step_reward_fn(text, ex)]
        except Exception as e:  # noqa: BLE001 - user code fails the same way as a reward function
            raise UsageError(
                f"step reward function raised {type(e).__name__}: {e} on completion {text[:60]!r}"
            ) from None
        ids = batch.completion_ids[i, :n_i].tolist()
        ends = tasks.char_ends_to_token_indices(tokenizer, ids, [end for end, _ in steps])
        step_r += [reward for _, reward in steps] + [batch.rewards[i].item()]
        step_t += [min(t, n_i - 1) for t in ends] + [n_i - 1]
        step_i += [i] * (len(steps) + 1)
    batch_std = None
    if args.scale_rewards == "batch":
        batch_std = torch.tensor(common.all_gather_objects(step_r)).std()
    steps = torch.tensor(step_r), torch.tensor(step_i), torch.tensor(step_t)
    G, eps, scale = args.group_size, args.adv_eps, args.scale_rewards
    advantages = process_advantages(*steps, N, T, G, eps, scale, batch_std)
    checked = [len(step_r) - N, sum(step_r) - batch.rewards.sum().item()]  # not the final answers
    checked, step_sum = common.all_reduce(torch.tensor(checked, dtype=torch.float64)).tolist()
    batch.scalars["process/steps_per_completion"] = checked / (args.prompts_per_step * G)
    batch.scalars["process/step_reward_mean"] = step_sum / max(checked, 1)
    return advantages.to(device)


def process_advantages(
    rewards, seq, end, num_sequences, num_tokens, group_size, eps=1e-4, scale="group", std=None
) -> torch.Tensor:
    """Process-supervision advantages (DeepSeekMath §4.1.3), (B * G, T = ``num_tokens``).

    The (S,) float ``rewards`` of every step of the G outputs of a question, each step j in
    completion ``seq[j]`` ending at its token ``end[j]`` (``seq``, ``end``: (S,) long tensors), are
    normalised together, ``r~_j = (r_j - mean) / (std + eps)`` (unbiased std); then ``A_i,t`` = the
    sum of r~_j over the steps of output i that end at or after t (0 after the last step). ``scale``
    as in :func:`group_advantages` ("batch": the std of every step of the batch, ``std`` when it
    spans several processes). The caller makes the final answer one more step with the outcome
    reward, so every completion has a step.
    Raises ValueError: a completion has no step, a step ends outside [0, T), or a bad ``scale``.
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', not {scale!r}")
    if num_sequences % group_size or torch.bincount(seq, minlength=num_sequences).min() < 1:
        raise ValueError("every completion needs at least one step, in groups of group_size")
    if end.min() < 0 or end.max() >= num_tokens:
        raise ValueError(f"step ends must lie in [0, {num_tokens})")
    group = seq // group_size
    normalised = torch.empty_like(rewards)
    for g in range(num_sequences // group_size):
        r = rewards[group == g]
        centred = r - r.mean()
        normalised[group == g] = centred / (r.std() + eps) if scale == "group" else centred
    if scale == "batch":
        normalised = normalised / ((rewards.std() if std is None else std) + eps)
    at_end = torch.zeros(num_sequences, num_tokens, dtype=rewards.dtype)
    at_end.index_put_((seq, end), normalised, accumulate=True)  # r~_j at the step's last token
    return at_end.flip(1).cumsum(1).flip(1)  # sum over the steps ending at or after t


def make_reward_model(args: Args, tokenizer, device):
    """r_phi (None: the task's reward): --reward-model-path's model (frozen unless trained), or with
    --train-reward-model alone the policy's backbone with a new score head (Algorithm 1, §4.1.4)."""
    if args.reward_model_path:
        model = common.load_reward_model(args.reward_model_path, tokenizer, device).eval()
        return model.requires_grad_(args.train_reward_model)
    if args.train_reward_model:
        model = common.load_model(args.model_name_or_path, kind="reward", device=device).eval()
        model.config.pad_token_id = tokenizer.pad_token_id
        return model
    return None


class RewardModelTraining:
    """Algorithm 1, line 12 (§4.1.4): r_phi trained continually, by MSE regression of its score on
    the verifiable reward, after each iteration's last step, on the iteration's samples and a replay
    of earlier ones (--rm-replay-ratio of each training set). ``add(batch)`` keeps a step's samples
    from every process, so that each trains the same model; ``train`` returns the logged scalars."""

    def __init__(self, model, tokenizer, args: Args, device):
        self.model, self.tokenizer, self.args, self.device = model, tokenizer, args, device
        lr, weight_decay = args.rm_learning_rate, args.weight_decay
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        self.new: list[dict] = []  # this iteration's {"ids": prompt + completion, "label": reward}
        self.replay: list[dict] = []  # every earlier iteration's training samples

    def add(self, batch: Batch) -> None:
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
        real = torch.cat([batch.prompt_mask, batch.completion_mask.long()], 1).bool()
        rows = zip(ids, real, batch.verifiable, strict=True)
        samples = [{"ids": i[m].tolist(), "label": label.item()} for i, m, label in rows]
        self.new += common.all_gather_objects(samples)

    def train(self, step: int, checkpoint: Path) -> dict:
        args, pad, mb = self.args, self.tokenizer.pad_token_id, self.args.micro_batch_size
        rng = np.random.default_rng([args.seed, step + 1, 1])
        shuffled = [self.new[i] for i in rng.permutation(len(self.new))]
        n_eval = int(len(shuffled) * args.rm_eval_fraction)
        held_out, fresh = shuffled[:n_eval], shuffled[n_eval:]
        data = replay_mix(fresh, self.replay, args.rm_replay_ratio, rng)
        before = self.accuracy(held_out)[0] if held_out else None
        for _ in range(args.rm_epochs):  # MSE regression of the score on the verifiable reward
            order = rng.permutation(len(data))
            for i in range(0, len(data), mb):
                chunk = [data[j] for j in order[i : i + mb]]
                ids, attention_mask = common.pad_left([c["ids"] for c in chunk], pad, self.device)
                labels = torch.tensor([c["label"] for c in chunk], device=self.device)
                with common.bf16_autocast(self.device, args.bf16):
                    scores = common.reward_model_scores(self.model, ids, attention_mask)
                loss = F.mse_loss(scores, labels)
                where, hint = f"step {step + 1}", "--rm-learning-rate"
                common.check_finite_update(where, hint, checkpoint, reward_model_loss=loss)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
        self.replay, self.new = self.replay + fresh, []
        scalars = {"reward_model/train_mse": loss.item(), "reward_model/train_size": len(data)}
        scalars["reward_model/replay_fraction"] = 1 - len(fresh) / len(data)
        if held_out:
            accuracy, mse = self.accuracy(held_out)
            scalars["reward_model/heldout_accuracy_before"] = before
            scalars["reward_model/heldout_accuracy"] = accuracy
            scalars["reward_model/heldout_mse"] = mse
        return scalars

    def accuracy(self, samples: list[dict]) -> tuple[float, float]:
        """(accuracy, MSE) on labelled samples; accurate: |score - label| < 0.5."""
        pad, mb = self.tokenizer.pad_token_id, self.args.micro_batch_size
        chunks = [[s["ids"] for s in samples[i : i + mb]] for i in range(0, len(samples), mb)]
        with torch.no_grad():
            padded = (common.pad_left(c, pad, self.device) for c in chunks)
            scores = torch.cat([common.reward_model_scores(self.model, *x).cpu() for x in padded])
        labels = torch.tensor([s["label"] for s in samples])
        accurate = ((scores - labels).abs() < 0.5).float().mean().item()
        return accurate, F.mse_loss(scores, labels).item()

    def state(self) -> dict:
        state = dict(reward_model=self.model.state_dict(), rm_optimizer=self.optimizer.state_dict())
        return state | dict(rm_new=self.new, rm_replay=self.replay)

    def load(self, checkpoint: dict) -> None:
        self.model.load_state_dict(checkpoint["reward_model"])
        self.optimizer.load_state_dict(checkpoint["rm_optimizer"])
        for group in self.optimizer.param_groups:  # the flags given now take effect
            group.update(lr=self.args.rm_learning_rate, weight_decay=self.args.weight_decay)
        self.new, self.replay = checkpoint["rm_new"], checkpoint["rm_replay"]


def replay_mix(new: list, history: list, ratio: float, rng: np.random.Generator) -> list:
    """One iteration's reward-model training set (Algorithm 1, §4.1.4): ``new`` and
    ``round(len(new) * ratio / (1 - ratio))`` samples (at most all) of ``history``, drawn without
    replacement, so that they make up ``ratio`` of it. Raises ValueError: ``ratio`` not in [0, 1).
    """
    if not 0 <= ratio < 1:
        raise ValueError(f"replay ratio must be in [0, 1), not {ratio}")
    k = min(len(history), round(len(new) * ratio / (1 - ratio)))
    return list(new) + [history[i] for i in rng.choice(len(history), k, replace=False)]


# ----------------------------------------------------------------------------------------------
# Later variants (every flag off = the paper's GRPO): DAPO's dynamic sampling and overlong shaping.
# Dr. GRPO, clip-higher, GSPO and TIS are options of group_advantages and grpo_loss above
# (variant_options).
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


def merge_groups(batches: list[Batch], chosen: list, group_size: int, pad_token_id: int) -> Batch:
    """One batch of the groups ``chosen`` = [(batch index, group index), ...], prompts left-padded
    and completions right-padded again, to the widest of the chosen rows."""
    G = group_size
    rows = [(batches[b], slice(g * G, (g + 1) * G)) for b, g in chosen]
    P = max(b.prompt_ids.shape[1] for b, _ in rows)
    T = max(b.completion_ids.shape[1] for b, _ in rows)

    def cat(key: str, width: int = 0, value: float = 0, left: bool = False):
        if getattr(rows[0][0], key) is None:
            return None
        parts = [getattr(b, key)[r] for b, r in rows]
        if width:
            sides = [(width - x.shape[1], 0) if left else (0, width - x.shape[1]) for x in parts]
            parts = [F.pad(x, side, value=value) for x, side in zip(parts, sides, strict=True)]
        return torch.cat(parts)

    prompts = cat("prompt_ids", P, pad_token_id, True), cat("prompt_mask", P, 0, True)
    completions = cat("completion_ids", T, pad_token_id), cat("completion_mask", T)
    examples = [x for b, r in rows for x in b.examples[r]]
    texts = [x for b, r in rows for x in b.completions[r]]
    merged = Batch(*prompts, *completions, examples, texts, cat("sampler_logp", T))
    for key in ("rewards", "verifiable", "correct", "truncated"):
        setattr(merged, key, cat(key))
    for name in rows[0][0].reward_fns:
        merged.reward_fns[name] = torch.cat([b.reward_fns[name][r] for b, r in rows])
    return merged


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int) -> torch.Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476, §3.4), added to the reward: (N,) in [-1, 0]
    from the (N,) lengths |o| (EOS included): 0 for ``|o| <= L_max - L_cache``, then ``((L_max -
    L_cache) - |o|) / L_cache``, -1 at L_max = ``max_length`` (L_cache = ``buffer``, 0 = off)."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    return (((max_length - buffer) - lengths.float()) / buffer).clamp(-1.0, 0.0)


def completions_in_the_loss(batch: Batch, mask_truncated: bool) -> torch.Tensor:
    """(N, T) mask of the loss's tokens: each completion up to its EOS; with
    --mask-truncated-completions (DAPO §3.4 overlong filtering) none of one without EOS."""
    if not mask_truncated:
        return batch.completion_mask
    return batch.completion_mask * (~batch.truncated).float().unsqueeze(1)


def variant_options(args: Args, loss_mask: torch.Tensor) -> dict:
    """The later variants' options of :func:`grpo_loss` (all off: the paper's eq. 3): Dr. GRPO's and
    DAPO's aggregation (--loss-type, with ``num_tokens`` counted over the global batch so that the
    processes' gradients sum to the 1-process gradient), clip-higher, GSPO's ratio and TIS."""
    return {
        "loss_type": args.loss_type,
        "clip_range_high": args.clip_range_high,
        "importance_sampling_level": args.importance_sampling_level,
        "tis_cap": args.tis_cap,
        "num_tokens": common.all_reduce(loss_mask.sum()).item(),
        "max_completion_length": args.max_new_tokens,
    }


# ----------------------------------------------------------------------------------------------
# Scale-out and speed: micro-batches (torchrun and the bf16 sampler copy are in common.py)
# ----------------------------------------------------------------------------------------------
def rows_with_a_gradient(advantages, loss_mask, beta: float, loss_type: str, G: int):
    """(n,) long: the rows steps 4-5 compute. A row with no token in the (N, T) ``loss_mask`` or,
    with ``beta == 0``, whose (N,) or (N, T) advantages are all 0 (a group of equal rewards) adds
    exactly 0 to eq. 3 and its gradient: left out (not under --loss-type bnpo, whose per-micro-batch
    mean counts it). If none is left, the first group stays: AdamW then steps as on zeros."""
    nonzero = (advantages != 0).reshape(len(advantages), -1).any(1)
    keep = (loss_mask.sum(1) > 0) & (nonzero | (beta > 0)) | (loss_type == "bnpo")
    if not keep.any():
        keep[:G] = True
    return keep.nonzero().squeeze(1)


def plan_micro_batches(batch: Batch, size: int, G: int, device, rows: torch.Tensor) -> list:
    """Micro-batches of ``size`` of the batch's ``rows`` for steps 4-5: [(rows, length t,
    :class:`MicroBatch`)]. Groups of similar completion length go together (whole groups when
    ``size`` is a multiple of G: a prompt goes through the model once per micro-batch that holds
    its completions), each trimmed to its longest prompt and completion. The loss is a sum over
    sequences, so the order only saves compute (except --loss-type bnpo's per-micro-batch mean)."""
    mask, completion_ids = batch.completion_mask, batch.completion_ids
    lengths = mask.sum(1)
    lens, group_lens = lengths.tolist(), lengths.view(-1, G).amax(1).tolist()
    order = sorted(rows.tolist(), key=lambda i: (-group_lens[i // G], i // G, -lens[i]))
    order = torch.tensor(order, device=device)
    micro_batches = []
    for i in range(0, len(order), size):
        idx = order[i : i + size]
        groups, prompt_index = torch.unique(idx // G, return_inverse=True)  # each prompt once
        prompt_ids, prompt_mask = batch.prompt_ids[groups * G], batch.prompt_mask[groups * G]
        first = int(prompt_mask.any(0).float().argmax())  # first column with a real token
        t = int(lengths[idx].max())
        prompts = prompt_ids[:, first:], prompt_mask[:, first:], prompt_index
        inputs = MicroBatch(*prompts, completion_ids[idx, :t], mask[idx, :t].long())
        micro_batches.append((idx, t, inputs))
    return micro_batches


# ----------------------------------------------------------------------------------------------
# TRY NOT TO MODIFY: run plumbing (validation, resume, metrics, checkpoints)
# ----------------------------------------------------------------------------------------------
def sample_lines(batch: Batch, G: int) -> list[str]:
    """The first completion of each group with its reward, for the printed and logged samples."""
    return [
        f"[reward {batch.rewards[j]:.2f}] {batch.examples[j]['question']!r} -> "
        f"{batch.completions[j]!r}"
        for j in range(0, len(batch.rewards), G)
    ]


SCRIPT = "grpo_lm.py"  # written into checkpoints: --resume refuses another script's
FROZEN = {  # flags a resumed run cannot change, and why (and common.FROZEN_DATA)
    "model_name_or_path": "the checkpoint holds this model's weights",
    "group_size": "the advantages of a run compare groups of this size",
    "reward_model_path": "the run's rewards (and a trained reward model's weights) are its",
    "train_reward_model": "the checkpoint holds the reward model's training state, or none",
    "lora_rank": "the checkpoint holds adapters of this rank (or the full model)",
    "lora_alpha": "the adapters were trained at this scale",
    "lora_target_modules": "the checkpoint holds adapters of these modules",
}
HINT = "--learning-rate, --max-grad-norm, --beta and the reward"  # after a non-finite update


def validate(args: Args) -> None:
    """One-line errors (UsageError naming the flag) for flags that cannot work, before anything
    loads: each flag's own constraint (beside it in Args) and both LM scripts' rules
    (common.check_lm_flags, tasks.check_task_flags), then GRPO's."""
    common.check_lm_flags(args)
    prompt_flags = (args.prompt_field, args.answer_field, args.system_prompt, args.response_prefix)
    tasks.check_task_flags(args.format_reward, args.reward_fn, args.reward_weights, *prompt_flags)
    steps, iterations, world = args.total_steps, args.iterations, common.world_size()
    check(steps % iterations == 0, f"--iterations {iterations} must divide --total-steps {steps}")
    check(
        args.overlong_buffer < args.max_new_tokens,
        "--overlong-buffer must be in [0, --max-new-tokens)",
    )
    check(
        not args.train_reward_model or args.reward_model_path is not None or iterations >= 2,
        "--train-reward-model without --reward-model-path needs --iterations >= 2: its reward "
        "model starts with an untrained head, scores from iteration 2 on, and is first trained at "
        "the end of iteration 1",
    )
    check(
        args.prompts_per_step % world == 0,
        f"--prompts-per-step {args.prompts_per_step} must be divisible by the world size {world} "
        "(the number of torchrun processes): every process samples whole groups",
    )
    check(
        not args.lora_rank or iterations == 1,
        "--lora-rank with --iterations > 1: the reference is the policy with its adapter disabled, "
        "which cannot be reset to the policy at each iteration; use full fine-tuning",
    )


def resume_checkpoint(args: Args) -> dict | None:
    """The --resume checkpoint (memory-mapped; None without --resume), checked before anything loads
    by common.resume_checkpoint (this script's, ``FROZEN`` flags unchanged, steps left, no NaN or
    inf), with the same Algorithm 1 iterations: --total-steps / --iterations steps each.

    Raises:
        UsageError: a missing, unreadable, other script's or diverged checkpoint, a flag that
            cannot change, a run that already reached --total-steps, or another iteration length.
    """
    checkpoint = common.resume_checkpoint(args, SCRIPT, FROZEN)
    if checkpoint is None:
        return None
    saved, steps, iterations = checkpoint["args"], args.total_steps, args.iterations
    length = checkpoint.get("steps_per_iteration", saved["total_steps"] // saved["iterations"])
    n = max(steps // length, 1)  # iterations of that length, for the hint
    check(
        (saved["iterations"] == 1 and iterations == 1)
        or (steps // iterations == length and steps % iterations == 0),
        f"--total-steps: this run has iterations of {length} step{'s' * (length != 1)} "
        f"({saved['total_steps']} steps / {saved['iterations']} iterations); resume with the same "
        f"iteration length, e.g. --total-steps {n * length} --iterations {n}",
    )
    return checkpoint


def restore(checkpoint: dict | None, args: Args, policy, optimizer, reference, rm_training) -> int:
    """Load a checkpoint's weights and optimizer states (the flags given now set the optimizers'
    hyperparameters); returns the checkpoint's step (0 without one).
    Raises UsageError: the checkpoint's tensors do not fit the models (another model's)."""
    if checkpoint is None:
        return 0
    try:
        common.load_trained_weights(policy, checkpoint["policy"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        if isinstance(reference, torch.nn.Module) and checkpoint.get("reference") is not None:
            reference.load_state_dict(checkpoint["reference"])
        if rm_training is not None and checkpoint.get("reward_model") is not None:
            rm_training.load(checkpoint)
    except (RuntimeError, ValueError, KeyError) as e:
        raise UsageError(
            f"--resume: {args.resume} does not fit {args.model_name_or_path} "
            f"({type(e).__name__}: {common.first_line(e)[:200]})"
        ) from None
    for group in optimizer.param_groups:
        group.update(lr=args.learning_rate, weight_decay=args.weight_decay)
    return checkpoint["step"]


def step_metrics(args: Args, batch: Batch, rewards, loss_stats: list, grad_norm, t0, gen_time):
    """A step's logged scalars over the global batch (sums and per-sequence values gathered from
    every process), from ``loss_stats``, the :func:`grpo_loss` statistics of every micro-batch with
    its ``loss`` and masked ``entropy`` sum, and the extensions' ``batch.scalars``. ``loss/policy``
    is the minimised -J of eq. 3 (KL included), the other ``loss/*`` are over the rows the update
    computed (:func:`rows_with_a_gradient`); ``time/generation_s`` covers steps 1-2."""

    def total(key: str) -> float:  # summed over this process's micro-batches and mu updates
        return sum(stats[key].item() for stats in loss_stats)

    G = args.group_size
    sums = torch.tensor([total("loss"), total("kl"), total("clipped"), total("tokens")])
    loss_sum, kl_sum, clipped_sum, tokens_sum = common.all_reduce(sums).tolist()
    per_sequence = (batch.completion_mask.sum(1), batch.correct, batch.truncated)
    lengths, correct, truncated = (common.all_gather(x.float().cpu()) for x in per_sequence)
    entropy = common.all_reduce(torch.tensor(total("entropy"))).item()
    ratio_min = torch.tensor(min(stats["ratio_min"].item() for stats in loss_stats))
    ratio_max = torch.tensor(max(stats["ratio_max"].item() for stats in loss_stats))
    scalars = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item(),
        "reward/accuracy": correct.mean().item(),
        "reward/frac_zero_std_groups": (rewards.view(-1, G).std(1) == 0).float().mean().item(),
        "loss/policy": loss_sum / args.mu,
        "loss/kl": kl_sum / max(tokens_sum, 1),
        "loss/clip_fraction": clipped_sum / max(tokens_sum, 1),
        "loss/tokens": tokens_sum / args.mu,
        "loss/entropy": entropy / max(tokens_sum, 1),
        "loss/ratio_min": common.all_reduce(ratio_min, "min").item(),
        "loss/ratio_max": common.all_reduce(ratio_max, "max").item(),
        "completion/length_mean": lengths.mean().item(),
        "completion/frac_truncated": truncated.mean().item(),
        "optim/grad_norm": grad_norm.item(),
        "optim/learning_rate": args.learning_rate,
        "time/generation_s": gen_time,
        "time/training_s": time.time() - t0 - gen_time,
        "time/tokens_per_s": lengths.sum().item() / (time.time() - t0),
        **common.peak_memory_gb(grad_norm.device),
    }
    scalars.update(batch.scalars)
    scalars.update(common.reward_fn_means(batch.reward_fns))  # --reward-fn
    if batch.sampler_logp is not None:  # |log pi_old - log pi_sampler| over the loss's tokens
        gap = torch.tensor([total("sampler_gap_sum"), total("tokens")])
        gap_sum, gap_tokens = common.all_reduce(gap).tolist()
        scalars["sampling/logp_diff_mean"] = gap_sum / max(gap_tokens, 1)
        gap_max = torch.tensor(max(0.0, *(stats["sampler_gap_max"].item() for stats in loss_stats)))
        scalars["sampling/logp_diff_max"] = common.all_reduce(gap_max, "max").item()
    if batch.verifiable is not None and (args.reward_model_path or args.train_reward_model):
        scalars["reward/verifiable_mean"] = common.all_gather(batch.verifiable).mean().item()
    return scalars


def save_checkpoint(log, step: int, args: Args, policy, optimizer, reference, rm_training) -> None:
    """Every --save-every steps and at the end (rank 0), atomically, what an exact resume needs: the
    reference when --iterations > 1 resets it (else --model-name-or-path's, loaded again), the
    reward model with its samples, and the iteration index (for readers)."""
    due = (args.save_every and step % args.save_every == 0) or step == args.total_steps
    if not (log.is_main and due):
        return
    length = args.total_steps // args.iterations
    rm_state = dict(reward_model=None, rm_optimizer=None, rm_new=[], rm_replay=[])
    if rm_training is not None:
        rm_state = rm_training.state()
    keep_reference = isinstance(reference, torch.nn.Module) and args.iterations > 1
    state = {
        "script": SCRIPT,
        "policy": common.trained_weights(policy),
        "step": step,
        "optimizer": optimizer.state_dict(),
        "args": dataclasses.asdict(args),
        "rng": common.get_rng_state(),
        "iteration": step // length,
        "steps_per_iteration": length,
        "digests": common.input_digests(args.dataset, args.reward_fn),
        "reference": reference.state_dict() if keep_reference else None,
    }
    common.atomic_save(state | rm_state, log.checkpoint)


def cli(argv: list[str] | None = None) -> None:
    """The command line (``--help``): bad input ends in one ``error: ...`` line, exit code 2."""
    common.run_cli(lambda: main(common.parse_args(Args, argv, SCRIPT)))


if __name__ == "__main__":
    cli()
