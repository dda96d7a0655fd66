"""Group Relative Policy Optimization (GRPO) for language models, in one file.

Read beside DeepSeekMath (Shao et al. 2024, arXiv 2402.03300), §4.1 and its Algorithm 1: sample a
group of G outputs o_i of each question q from pi_old, give every token of o_i the group-normalised
reward as its advantage (§4.1.2), and maximise the clipped surrogate with a k3 KL penalty to a
frozen reference (eq. 3, 4); no value model:

  J(theta) = E[ 1/G sum_i 1/|o_i| sum_t { min(ratio_it * A_it, clip(ratio_it, 1-eps, 1+eps) * A_it)
                                          - beta * KL_it } ],
  ratio_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t),
  KL_it    = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1                                     (eq. 4)

Read from the top down to the end of main(): Args (each flag's constraint beside it); Batch (the
samples of lines 5-8); ALGO LOGIC, the math (group_advantages §4.1.2, process_advantages §4.1.3,
token_log_probs, kl_estimate eq. 4, grpo_loss eq. 3, aggregate); main(), Algorithm 1 line by line,
its two loops the paper's (for iteration: reference <- policy; for step: sample, reward, advantages,
mu updates), each extension behind an `if args.<flag>:` with its source. Below main(): lines 5-8
(sample_and_score, reward), tools while sampling (Tool, calculator), DeepSeekMath's extensions
(process supervision §4.1.3, iterative RL with a retrained reward model §4.1.4), the later variants
(Dr. GRPO arXiv 2503.20783, DAPO 2503.14476, GSPO 2507.18071, CISPO 2506.13585, RLOO, REINFORCE++),
micro-batches, then the run plumbing.

Where this file departs from the paper (every flag defaults to the paper's GRPO otherwise):
- Scale: learning rate 1e-5 (the paper's 1e-6 barely moves a 135M model in 36 steps), G = 8
  outputs of 8 questions a step (64 of 1,024), at most 20 new tokens (1,024; the sums take 12-16),
  36 steps; the task's verifiable reward instead of a reward model.
- The ratio, the KL and the entropy are of temperature-scaled distributions, softmax(logits / T),
  the distribution the outputs were sampled from.
- The advantage divides by the group's unbiased std plus 1e-4 (a group of equal rewards, whose
  centred rewards are 0, gets 0 rather than 0/0).
- With --mu 1, pi_old is pi_theta: the ratio is exp(logp - logp.detach()) = 1, whose gradient is
  eq. 3's; no old log probs are computed. With --mu > 1 they are computed once before the first
  update. With --mu > 1 the k3 term, as in the paper, lacks the weight pi_theta / pi_old.
- Process supervision (§4.1.3) makes the final answer one more step with the outcome reward; the
  iterative reward model (§4.1.4) regresses (MSE) on the verifiable reward; line 12 (its training)
  runs at the end of each iteration's last step, before that step's checkpoint, which so holds it.
- With --tool, a tool's tokens join o_i as context the policy did not choose: the sampler's mask of
  drawn tokens, not o_i's extent, is eq. 3's sum over t and |o_i| (and every count, length and
  penalty); process supervision pays no step whose result a tool wrote.
- Rows whose every loss term is exactly 0 are left out of the forward and backward passes (same
  loss and gradient, less compute); with --beta 0 (TRL's default) there is no reference model.

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
from operator import add, mul, neg, sub, truediv
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import numpy as np
import pydantic
import torch
import torch.nn.functional as F
import tyro
from annotated_types import Ge, Gt, Interval, MinLen

import common
import tasks
from common import UsageError, check

Marker = Annotated[str, MinLen(1)]  # a --tool-markers text


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

    # --- tools while sampling (not in the paper): a tool's tokens are context, not actions ---

    # 'calculator' (the arithmetic between --tool-markers, as GSM8K's <<48/2= gets 24>>) or your
    # own, path/to/file.py:function(call text) -> the text to inject or None (default: no tool)
    tool: str | None = None
    # the texts that open and close a call: when a completion's text ends with the second, the tool
    # gets the text between them (since its last output)
    tool_markers: tuple[Marker, Marker] = ("<<", "=")
    # tokens of a tool's output at most (the rest cut); they count against --max-new-tokens
    max_tool_tokens: Annotated[int, Ge(1)] = 16

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
    # groups per sampling call (0 = all of a process's): memory; the draws depend on --seed, the
    # step and each row's place in the batch alone (the samples, up to float rounding)
    generation_groups_per_call: Annotated[int, Ge(0)] = 0
    # bfloat16 autocast on a CUDA GPU that supports it or a CPU with AVX512-BF16 (weights,
    # optimizer, LM head and log-softmax stay float32); float32 elsewhere
    bf16: bool = True
    # recompute the policy's activations in the backward pass: less memory, ~30% slower
    gradient_checkpointing: bool = False
    # under torchrun: the policy, the reference (and PPO's value model) sharded over the processes
    # (FSDP2, ZeRO-3; the policy whole while sampling), not one copy each; not with --lora-rank
    # (docs/scale.md)
    fsdp: bool = False


@dataclasses.dataclass
class Batch:
    """Lines 5-8 of Algorithm 1, this process's share: N = B * G completions (a question's G
    contiguous) of at most T tokens, their prompts of at most P tokens, and their rewards (set by
    :func:`reward`)."""

    prompt_ids: torch.Tensor  # (N, P) each completion's prompt, left-padded
    prompt_mask: torch.Tensor  # (N, P) 1 for the prompt's tokens
    completion_ids: torch.Tensor  # (N, T) the tokens (drawn or a tool's), padding after the EOS
    completion_mask: torch.Tensor  # (N, T) float, 1 up to and including the first EOS
    # (N, T) float, 1 where the policy drew the token (inside completion_mask; 0: a tool wrote it)
    sampled_mask: torch.Tensor
    sampler_log_probs: torch.Tensor  # (N, T) the sampler's log probs of the drawn tokens (else 0)
    examples: list[dict]  # the question (and answer) of each completion
    completions: list[str]  # the decoded completions
    tool_calls: torch.Tensor  # (N, 2) long: each completion's --tool calls, and those that raised
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
    """(N, T) float mask of each completion's tokens up to and including its first EOS (what follows
    is padding): the o_i,t that eq. 3 sums over, |o_i| its row sum."""
    is_eos = completion_ids == eos_token_id
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos.long()  # number of EOS strictly before t
    return (eos_before == 0).float()


def group_advantages(rewards, group, *, scale=None, baseline="grpo", batch=None, eps=1e-4):
    """Outcome supervision (§4.1.2): (S,) ``(r_i - mean(r)) / (std(r) + eps)`` of the (S,)
    ``rewards`` in each one's group (``group``: (S,) long; unbiased std), for every token of o_i.
    --advantage ``baseline``: the group's mean (``"grpo"``; equal rewards get 0), the mean of its
    other n-1, ``n/(n-1) (r_i - mean(r))`` (``"rloo"``, arXiv 2402.14740) or the batch's
    (``"reinforce++"``, arXiv 2501.03262). ``scale``: the std of the ``"group"``, the ``"batch"``
    (``batch``: every process's rewards, default ``rewards``) or ``"none"`` (Dr. GRPO, 2503.20783
    §3.1); None: the baseline's own (grpo: group, rloo: none, reinforce++: batch). ``eps`` keeps
    a group of equal rewards finite. Process supervision normalises step rewards with it too."""
    if scale is None:
        scale = {"grpo": "group", "rloo": "none", "reinforce++": "batch"}[baseline]
    if batch is None:
        batch = rewards

    def group_sum(x):  # (S,): the sum of x over each one's group
        return torch.zeros_like(x).index_add_(0, group, x)[group]

    sizes = torch.bincount(group)  # of each group
    n = sizes[group].to(rewards.dtype)  # the size of each one's group
    centred = rewards - group_sum(rewards) / n  # r_i - mean(r)
    if scale == "group":
        variance = group_sum(centred**2) / (n - 1)  # unbiased
        std = variance.sqrt()
    if scale == "batch":
        std = batch.std()
    if baseline == "rloo":  # r_i - the mean of the other n - 1
        centred = centred * n / (n - 1)
    if baseline == "reinforce++":  # r_i - the batch's mean
        centred = rewards - batch.mean()
    if scale == "none":
        return centred
    return centred / (std + eps)


def process_advantages(rewards, seq, end, *, shape, group_size, **baselines):
    """Process-supervision advantages (DeepSeekMath §4.1.3), ``shape`` = (N, T): the (S,)
    float ``rewards`` of every step of the G outputs of a question, step j in completion ``seq[j]``
    ending at its token ``end[j]`` ((S,) long), normalised together by :func:`group_advantages`
    (``baselines``: its keywords; ``batch``: every process's step rewards), ``r~_j = (r_j - mean) /
    (std + eps)``; then ``A_i,t`` = the sum of r~_j over the steps of output i that end at or after
    t (0 after the last). The caller makes the final answer a step with the outcome reward."""
    normalised = group_advantages(rewards, seq // group_size, **baselines)
    at_end = torch.zeros(shape, dtype=rewards.dtype)
    at_end.index_put_((seq, end), normalised, accumulate=True)  # r~_j at the step's last token
    return at_end.flip(1).cumsum(1).flip(1)  # sum over the steps ending at or after t


class MicroBatch(NamedTuple):
    """:func:`token_log_probs`'s inputs: b completions of U distinct prompts (G share each)."""

    prompt_ids: torch.Tensor  # (U, P) the distinct prompts, left-padded
    prompt_mask: torch.Tensor  # (U, P) 1 for real prompt tokens
    prompt_index: torch.Tensor  # (b,) long: the row of prompt_ids each completion continues
    completion_ids: torch.Tensor  # (b, T) the completions
    completion_mask: torch.Tensor  # (b, T) long, 1 up to and including the first EOS
    rows: torch.Tensor | None = None  # (b,) long: the rows of the whole batch it holds

    def take(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """This micro-batch's rows of a whole batch's (N,) or (N, T') tensor ``x``, cut to its T
        completion tokens; None stays None."""
        if x is None:
            return None
        if x.ndim == 1:
            return x[self.rows]
        return x[self.rows, : self.completion_ids.shape[1]]


def token_log_probs(model, mb: MicroBatch, temperature, *, share_prompt=True, entropy_coef=None):
    """(b, T) float32 ``log softmax(logits / temperature)`` of every completion token under
    ``model``; with ``entropy_coef`` also their (b, T) entropy, differentiable if it is not 0.
    ``share_prompt``: each distinct prompt goes through the model once and its keys and values (with
    their gradients) serve every completion that continues it: a whole-sequence pass's numbers, to
    float rounding, for 1/G of the prompt's compute (off under gradient checkpointing, which drops
    the cache). Position ids count real tokens only, as in generation; the LM head runs in float32
    also under bf16 autocast, a chunk of tokens at a time (``common.lm_head_log_probs``)."""
    P = mb.prompt_ids.shape[1]
    T = mb.completion_ids.shape[1]
    prompt_mask = mb.prompt_mask[mb.prompt_index]  # (b, P): each completion's prompt's
    mask = torch.cat([prompt_mask, mb.completion_mask], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    decoder = model.get_decoder()  # the model without its LM head: its last hidden states
    if share_prompt:
        prompt_positions = (mb.prompt_mask.cumsum(1) - 1).clamp(min=0)
        prompt = dict(input_ids=mb.prompt_ids, attention_mask=mb.prompt_mask)
        prefix = decoder(**prompt, position_ids=prompt_positions, use_cache=True)
        # (b, 1, H): the last prompt token's, which predicts the first completion token
        hidden = prefix.last_hidden_state[mb.prompt_index, -1:]
        if T > 1:  # the prompts' keys and values, (U, ...) -> (b, ...), differentiable
            cache = prefix.past_key_values
            cache.batch_select_indices(mb.prompt_index)
            inputs = mb.completion_ids[:, :-1]  # token t - 1 predicts token t
            rest = decoder(
                input_ids=inputs,
                attention_mask=mask[:, :-1],
                position_ids=positions[:, P:-1],
                past_key_values=cache,
                use_cache=True,
            )
            hidden = torch.cat([hidden, rest.last_hidden_state], 1)
    else:
        prompt_ids = mb.prompt_ids[mb.prompt_index]
        ids = torch.cat([prompt_ids, mb.completion_ids], 1)
        whole = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        hidden = whole.last_hidden_state[:, P - 1 : -1]  # position t predicts token t + 1
    head = model.get_output_embeddings()
    return common.lm_head_log_probs(
        head, hidden, mb.completion_ids, temperature, entropy_coef=entropy_coef
    )


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """(b, T) per-token estimate of KL(pi_theta || pi_ref) from the (b, T) log probs of tokens
    sampled from pi_theta, ``r = pi_ref / pi_theta`` (Schulman 2020): ``k1 = -log r`` (unbiased),
    ``k2 = (log r)^2 / 2`` (biased, >= 0), ``k3 = r - log r - 1`` (unbiased, >= 0; eq. 4). In the
    loss (d/dlogp: k1 1, k2 ``-log r``, k3 ``1 - r``) the expected gradient is that of KL(pi_ref ||
    pi_theta) for k3 (the paper's and TRL's choice), of KL(pi_theta || pi_ref) for k2, 0 for k1;
    with --mu > 1 (tokens from pi_old) each term lacks the weight pi_theta / pi_old (test_kl.py)."""
    log_ratio = ref_logp - logp  # log r
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return log_ratio**2 / 2
    return torch.exp(log_ratio) - log_ratio - 1  # k3, eq. 4


def grpo_loss(
    logp,
    old_logp,
    ref_logp,
    advantages,
    *,
    mask,
    clip_range,
    beta,
    num_sequences,
    entropy=None,
    loss_type="grpo",
    clip_range_high=None,
    level="token",
    num_tokens=None,
    max_length=None,
    kl_estimator="k3",
    entropy_coef=0.0,
):
    """Negative GRPO objective (DeepSeekMath eq. 3) of a micro-batch, for gradient accumulation.

    Per token ``min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A) - beta * KL + entropy_coef *
    H`` (eq. 3, 4; ``eps = clip_range``, ``eps_high = clip_range_high``, DAPO §3.1 clip-higher,
    default eps), summed as :func:`aggregate` says; ``ratio = exp(logp - old_logp)``, GSPO (arXiv
    2507.18071 §4, ``level="sequence"``) ``exp(mean_t(logp - old_logp))`` per sequence. CISPO
    (MiniMax-M1, arXiv 2506.13585, eq. 4) ``sg(min(ratio, 1 + eps_high)) * A * logp`` instead of
    the min: every token keeps its gradient. Masked positions never reach ``exp``.

    Args:
        logp: (b, T) log probs under the policy pi_theta (with grad).
        old_logp: (b, T) log probs under pi_old (no grad); None with mu = 1, where pi_old is
            pi_theta: ``logp.detach()``, a ratio of 1 with eq. 3's gradient.
        ref_logp: (b, T) log probs under the reference (no grad); None with ``beta == 0``.
        advantages: (b,) one per sequence (outcome) or (b, T) one per token (process).
        mask: (b, T) 1 for the tokens in the loss; num_sequences etc.: see :func:`aggregate`.
        entropy: (b, T) the policy's entropy H at each position (with grad; read if entropy_coef).
    Returns:
        (loss, stats): the loss and detached per-token sums and extremes, for logging (clipped_high:
        A > 0, ratio > 1 + eps_high; clipped_low: A < 0, ratio < 1 - eps)."""
    valid = mask.bool()
    if old_logp is None:  # mu = 1: pi_old = pi_theta
        old_logp = logp.detach()
    log_ratio = torch.where(valid, logp - old_logp, 0.0)
    if level == "sequence":  # GSPO's s_i, (b, 1)
        lengths = mask.sum(1).clamp(min=1)
        log_ratio = (log_ratio.sum(1) / lengths).unsqueeze(1)
    ratio = torch.exp(log_ratio)
    if advantages.ndim == 1:  # outcome supervision: A_i for every token of o_i
        advantages = advantages.unsqueeze(1)
    high = clip_range if clip_range_high is None else clip_range_high
    clipped_ratio = torch.clamp(ratio, 1 - clip_range, 1 + high)
    surrogate = torch.min(ratio * advantages, clipped_ratio * advantages)
    if loss_type == "cispo":  # MiniMax-M1 eq. 4: REINFORCE with a clipped, detached IS weight
        weight = torch.clamp(ratio, max=1 + high).detach()
        surrogate = weight * advantages * logp
    reference = logp.detach()  # without a reference model the KL is 0
    if ref_logp is not None:
        reference = torch.where(valid, ref_logp, logp.detach())
    kl = kl_estimate(logp, reference, kl_estimator)
    per_token = surrogate
    if beta:  # the KL in the loss (§4.1.1)
        per_token = surrogate - beta * kl
    if entropy_coef:  # the entropy bonus (not in the paper)
        per_token = per_token + entropy_coef * entropy
    loss = aggregate(
        per_token,
        mask,
        num_sequences=num_sequences,
        loss_type=loss_type,
        num_tokens=num_tokens,
        max_length=max_length,
    )
    with torch.no_grad():
        above = (advantages > 0) & (ratio > 1 + high)
        below = (advantages < 0) & (ratio < 1 - clip_range)
        ratio_max = ratio.new_ones(())
        if valid.any():
            ratio_max = ratio.expand_as(logp)[valid].max()
        stats = {"ratio_max": ratio_max, "tokens": mask.sum()}
        stats["kl"] = (kl * mask).sum()
        stats["clipped_high"] = (above * mask).sum()
        stats["clipped_low"] = (below * mask).sum()
    return loss, stats


def aggregate(
    per_token, mask, *, num_sequences, loss_type="grpo", num_tokens=None, max_length=None
):
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
        lengths = mask.sum(1).clamp(min=1)  # |o_i|
        return -(masked.sum(1) / lengths).sum() / num_sequences
    if loss_type == "bnpo":
        token_mean = masked.sum() / mask.sum().clamp(min=1)
        return -token_mean * (mask.shape[0] / num_sequences)
    if loss_type == "dr_grpo":
        return -masked.sum() / (num_sequences * max_length)
    return -masked.sum() / max(float(num_tokens), 1.0)  # dapo, cispo


# ----------------------------------------------------------------------------------------------
# GRPO, DeepSeekMath §4.1 and Algorithm 1
# ----------------------------------------------------------------------------------------------
def main(args: Args, task: tasks.Task | None = None, step_reward_fn=None):
    """Train with GRPO; returns the per-step history of logged scalars (a dict of lists).

    ``task`` replaces the built-in task: any :class:`tasks.Task` with your own reward function.
    ``step_reward_fn(response, example) -> [(end character offset, reward), ...]`` gives the step
    rewards of ``--supervision process`` (default :func:`arithmetic_step_rewards`: every
    equation ``x op y = z`` checked). Under ``torchrun`` every process runs this function on its
    share of the batch; the returned history holds the global values on every rank."""
    validate(args)  # a bad flag, checkpoint, dataset or reward file: one line, before any load
    checkpoint = resume_checkpoint(args)  # --resume's, checked
    model_path = args.model_name_or_path
    data_name = Path(args.dataset or args.task).stem
    run_name = args.run_name or f"{data_name}__grpo__{args.seed}__{int(time.time())}"
    run_dir = common.make_run_dir(args.runs_dir, run_name, args.resume, args.eval_only)
    files = {}  # each function file's globals, by path: a file several flags name runs once
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
        files=files,
    )
    tool = make_tool(args, files)  # --tool: the calculator or your function
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
    torch.manual_seed(args.seed)  # the reward model's new head; the draws are seeded per step

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
            tool=tool,
        )

    # Algorithm 1's input: the initial policy pi_theta_init, a reference pi_ref (a frozen copy of
    # it, §4.1.1; none with beta = 0) and the reward: the task's reward functions or a reward model
    lora = None
    if args.lora_rank:  # LoRA: the reference is the policy with its adapters off
        lora = (args.lora_rank, args.lora_alpha, args.lora_target_modules)
    policy = common.load_policy(model_path, device, lora, args.gradient_checkpointing)
    if args.eval_only:  # no training: the held-out accuracy of --resume's policy or of the model
        return tasks.eval_only(policy, checkpoint, held_out, run_dir / "eval.json")
    if args.fsdp:  # FSDP2: each process keeps its shard of the weights
        common.shard(policy)
    reference = None
    if args.beta > 0:  # bf16 weights where the reference never resets (--iterations 1)
        bf16 = args.iterations == 1 and common.bf16_active(device, args.bf16)
        reference = common.load_reference(
            policy, model_path, device, lora=lora is not None, bf16_weights=bf16
        )
        if args.fsdp:
            common.shard(reference)
    reward_model = make_reward_model(args, tokenizer, device)
    rm_training = None
    if args.train_reward_model:  # §4.1.4: r_phi trained continually (Algorithm 1, line 12)
        rm_training = RewardModelTraining(reward_model, tokenizer, args, device)
    trained = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters
    optimizer = torch.optim.AdamW(
        trained, args.learning_rate, weight_decay=args.weight_decay, fused=True
    )
    start_step = restore(
        checkpoint, args, policy, optimizer, reference=reference, rm_training=rm_training
    )
    progress_bar = {"reward": "reward/mean", "kl": "loss/kl", "len": "completion/length_mean"}
    log = common.RunLog(
        run_dir,
        dataclasses.asdict(args),
        rank=rank,
        start_step=start_step,
        resumed=checkpoint is not None,
        name="grpo",
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
        tool=tool,
    )
    evaluate_first = args.eval_size > 0 and not checkpoint  # the held-out accuracy at the start
    log.evaluate(0, evaluate_first, lambda: held_out(policy)[0])
    if checkpoint:  # last: loading must not shift the random state
        common.rng_state(checkpoint["rng"])

    G = args.group_size
    B = args.prompts_per_step // world  # questions of this process
    N = B * G  # outputs of this process
    num_outputs = args.prompts_per_step * G  # outputs of every process: eq. 3's sum
    steps_per_iteration = args.total_steps // args.iterations
    # each prompt through the model once per micro-batch (gradient checkpointing drops the cache;
    # --fsdp needs every process to call the model alike: one-token outputs skip the second call)
    share_prompt = not (args.gradient_checkpointing or args.fsdp)
    # leave out rows that add exactly 0 to the loss and its gradient (no token in it, or, with no
    # KL or entropy term, A = 0); not under bnpo (its micro-batch mean counts them), nor --fsdp
    other_terms = args.beta > 0 or args.entropy_coef > 0
    zero_rows = args.mask_truncated_completions or not other_terms  # no token, or A = 0 alone
    skip_rows = zero_rows and args.loss_type != "bnpo" and not args.fsdp

    # Algorithm 1, line 1: policy model pi_theta <- pi_theta_init (loaded above)
    for iteration in range(start_step // steps_per_iteration, args.iterations):  # line 2
        first_step = iteration * steps_per_iteration
        last_step = first_step + steps_per_iteration - 1
        # line 3: reference model pi_ref <- pi_theta (the first iteration's was loaded as
        # pi_theta_init; an iteration resumed after its first step has its own, restored)
        restored = start_step > first_step
        if reference is not None and iteration > 0 and not restored:
            reference.load_state_dict(policy.state_dict())
        steps = range(max(start_step, first_step), last_step + 1)
        for step in log.progress(steps, args.total_steps):  # line 4
            t0 = time.time()
            # line 5: sample a batch D_b of B questions; line 6: pi_old <- pi_theta (the policy as
            # it is now); line 7: sample G outputs o_i ~ pi_old(. | q) of each question q, at T;
            # line 8: their rewards r_i, from the task's reward functions or the reward model
            batch = sample_and_score(sampler, args, step)
            if args.dynamic_sampling:  # DAPO §3.2: only groups whose rewards differ
                batch = dynamic_sampling(batch, sampler, args, step)
            if args.overlong_buffer:  # DAPO §3.4: soft overlong punishment
                penalty = overlong_penalty(
                    batch.sampled_mask, args.max_new_tokens, args.overlong_buffer
                )
                batch.rewards = batch.rewards + penalty  # batch.verifiable stays the task's
            all_rewards = batch.rewards  # (N,) r_i, G contiguous outputs a question
            if world > 1:  # torchrun: every process's r_i, (B * G * world,) in group order
                all_rewards = common.all_gather(all_rewards)
            if rm_training:  # line 12's training set (§4.1.4): these samples
                rm_training.add(batch)
            gen_time = time.time() - t0

            # line 9: the advantage A_i,t of every token of every o_i
            if args.supervision == "outcome":  # §4.1.2: (r_i - mean(r)) / std(r) of its group
                groups = torch.arange(num_outputs) // G
                advantages = group_advantages(
                    all_rewards, groups, scale=args.scale_rewards, baseline=args.advantage
                )
                ours = slice(rank * N, rank * N + N)  # this process's groups
                advantages = advantages[ours].to(device)
            else:  # §4.1.3: the sums of the normalised step rewards from t on
                advantages = process_supervision(
                    batch, tokenizer, args, device, step_reward_fn=step_reward_fn
                )

            # the tokens in the loss: those of o_i the policy drew, up to its EOS (a tool's tokens
            # are context: no ratio, KL, entropy or count of |o_i| has them)
            loss_mask = batch.sampled_mask
            if args.mask_truncated_completions:  # DAPO §3.4 overlong filtering
                loss_mask = loss_mask * ~batch.truncated[:, None]
            rows = torch.arange(N)
            if skip_rows:  # speed: the rows that add 0 to the loss stay out
                rows = rows_with_a_gradient(advantages, loss_mask, G, other_terms=other_terms)
            micro_batches = plan_micro_batches(
                batch, rows, size=args.micro_batch_size, group_size=G, device=device
            )
            # eq. 3's pi_old and eq. 4's pi_ref log probs of the sampled tokens (no grad); with
            # mu = 1 pi_old is pi_theta itself, and grpo_loss reads its log probs there
            old_logp = None
            if args.mu > 1:
                old_logp = torch.zeros_like(loss_mask)
            ref_logp = None
            if reference is not None:
                ref_logp = torch.zeros_like(loss_mask)
            with torch.no_grad(), common.bf16_autocast(device, args.bf16):
                for mb in micro_batches:
                    T = mb.completion_ids.shape[1]
                    if old_logp is not None:
                        old_logp[mb.rows, :T] = token_log_probs(
                            policy, mb, args.temperature, share_prompt=share_prompt
                        )
                    if ref_logp is not None:
                        ref_logp[mb.rows, :T] = token_log_probs(
                            reference, mb, args.temperature, share_prompt=share_prompt
                        )

            # lines 10-11: mu GRPO iterations, each maximising eq. 3 over the whole batch
            # (gradients accumulated over its micro-batches); pi_old stays the sampling policy
            num_tokens = loss_mask.sum().item()  # DAPO's normaliser: the tokens in the loss
            if world > 1:  # torchrun: every process's
                num_tokens = common.all_reduce(torch.tensor(num_tokens)).item()
            loss_stats = []  # grpo_loss's stats of each micro-batch, for step_metrics
            for update in range(args.mu):
                optimizer.zero_grad(set_to_none=True)
                # dropout is off (zeroed at load); train mode makes HF's gradient checkpointing
                # recompute activations, and does nothing else here
                policy.train(args.gradient_checkpointing)
                for mb in micro_batches:
                    with common.bf16_autocast(device, args.bf16):
                        logp, entropy = token_log_probs(
                            policy,
                            mb,
                            args.temperature,
                            share_prompt=share_prompt,
                            entropy_coef=args.entropy_coef,
                        )
                    old = mb.take(old_logp)
                    ref = mb.take(ref_logp)
                    adv = mb.take(advantages)
                    mask = mb.take(loss_mask)
                    loss, stats = grpo_loss(
                        logp,
                        old,
                        ref,
                        adv,
                        mask=mask,
                        clip_range=args.clip_range,
                        beta=args.beta,
                        num_sequences=num_outputs,
                        entropy=entropy,
                        loss_type=args.loss_type,
                        clip_range_high=args.clip_range_high,
                        level=args.importance_sampling_level,
                        num_tokens=num_tokens,
                        max_length=args.max_new_tokens,
                        kl_estimator=args.kl_estimator,
                        entropy_coef=args.entropy_coef,
                    )
                    loss.backward()
                    stats["loss"] = loss.detach()
                    stats["entropy"] = (entropy.detach() * mask).sum()
                    if update == 0:  # the sampler's log probs against these (the same weights)
                        sampler_logp = mb.take(batch.sampler_log_probs)
                        stats |= sampler_agreement(logp.detach(), sampler_logp, mask)
                    loss_stats.append(stats)
                policy.eval()
                if world > 1 and not args.fsdp:  # torchrun: summed over processes, as DDP
                    common.all_reduce_gradients(policy.parameters())
                grad_norm = common.clip_gradients_or_stop(trained, args.max_grad_norm, step)
                optimizer.step()

            # line 12: update r_phi by continuous training with a replay mechanism (§4.1.4). The
            # paper's line closes the iteration loop; here it runs at the iteration's last step,
            # before that step's checkpoint, which so holds the trained r_phi
            done = step + 1  # steps done
            if rm_training and step == last_step:
                log(done, rm_training.train(step))

            # logging, evaluation (every --eval-every), checkpoints (every --save-every)
            metrics = step_metrics(
                args, batch, all_rewards, loss_stats, grad_norm=grad_norm, t0=t0, gen_time=gen_time
            )
            log(done, metrics)
            log.samples(done, sample_lines(batch, G), args.sample_every)
            periodic = args.eval_every > 0 and done % args.eval_every == 0
            eval_due = args.eval_size > 0 and (periodic or done == args.total_steps)
            log.evaluate(done, eval_due, lambda: held_out(policy)[0])
            save_checkpoint(
                log,
                done,
                args,
                policy,
                optimizer=optimizer,
                reference=reference,
                rm_training=rm_training,
            )
    log.close()
    if args.total_steps > start_step:  # --fsdp: every process gathers the weights, rank 0 writes
        common.save_pretrained(policy, tokenizer, run_dir / "final_model", write=rank == 0)
    common.cleanup_distributed()  # the other processes wait until rank 0 has written everything
    return log.history


# ----------------------------------------------------------------------------------------------
# Algorithm 1, lines 5-8: sample G outputs of each question from pi_old, and their rewards
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Sampler:
    """What lines 5-8 sample with and score by."""

    policy: Any  # pi_old: the policy as it is when the step starts
    tokenizer: Any
    questions: list[dict]  # the training questions whose prompts fit --max-prompt-length
    task: tasks.Task
    reward_model: Any  # None: the task's verifiable reward
    rank: int  # torchrun: this process samples the groups rank * B .. rank * B + B - 1 of each step
    world: int
    device: torch.device
    tool: Any = None  # --tool's Tool: called while sampling


def sample_and_score(sampler: Sampler, args: Args, step: int, round_: int = 0) -> Batch:
    """Lines 5-8 for one draw of questions, from ``(--seed, step, round_)``: this process's B
    questions, G completions of each from ``softmax(logits / T)`` (within the top-p nucleus), and
    their rewards (:func:`reward`). Each row's draws come from ``(--seed, step, round_, its place
    in the whole batch)``: the samples depend neither on how many processes share the batch nor on
    --generation-groups-per-call."""
    G = args.group_size
    B = args.prompts_per_step // sampler.world
    tokenizer = sampler.tokenizer
    pad = tokenizer.pad_token_id
    first = sampler.rank * B  # this process's groups: first + 0..B-1
    keys = [args.seed, step]
    if round_:
        keys.append(round_)
    rng = np.random.default_rng(keys)
    picks = rng.choice(len(sampler.questions), args.prompts_per_step, replace=False)
    ours = picks[first : first + B]  # this process's questions
    examples = [sampler.questions[i] for i in ours for _ in range(G)]
    questions = [example["question"] for example in examples[::G]]
    prompts = tasks.prompt_ids(tokenizer, questions, args.system_prompt, args.response_prefix)
    seed_keys = (args.seed, step, round_)
    sampled = common.generate_completions(
        sampler.policy,
        prompts,
        G,
        tokenizer,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        bf16=args.bf16,
        seed_keys=seed_keys,
        first_index=first,
        per_call=args.generation_groups_per_call,
        tool=sampler.tool,
    )
    repeated = [prompt for prompt in prompts for _ in range(G)]
    prompt_ids, prompt_mask = common.pad_left(repeated, pad, sampler.device)
    completion_ids = sampled.ids.to(sampler.device)  # padded after the EOS
    mask = completion_mask(completion_ids, tokenizer.eos_token_id)  # (N, T): none after the EOS
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    batch = Batch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=mask,
        sampled_mask=sampled.sampled.to(sampler.device),
        sampler_log_probs=sampled.log_probs.to(sampler.device),
        examples=examples,
        completions=texts,
        tool_calls=sampled.tool_calls,
    )
    ends_with_eos = (completion_ids == tokenizer.eos_token_id) & mask.bool()
    batch.truncated = ~ends_with_eos.any(1)  # no EOS within --max-new-tokens
    return reward(batch, sampler, args, step)


def reward(batch: Batch, sampler: Sampler, args: Args, step: int) -> Batch:
    """Line 8: ``batch`` with its rewards, from the task's reward functions or the reward model, and
    its ``verifiable``, ``correct`` and ``reward_fns``. A reward model trained from the policy's
    backbone scores from iteration 2 on, once trained; until then the verifiable reward does
    (Algorithm 1). Raises UsageError: a reward function raises or returns NaN or inf."""
    texts = responses(batch, args)
    first_iteration = step < args.total_steps // args.iterations
    trained = args.reward_model_path is not None or not first_iteration
    by_model = sampler.reward_model is not None and trained
    if not by_model or args.train_reward_model:  # --reward-fn: each function's own rewards too
        verifiable, reward_fns = tasks.score_task(sampler.task, texts, batch.examples)
        batch.verifiable = verifiable
        batch.reward_fns = reward_fns
    batch.rewards = batch.verifiable
    if by_model:
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
        mask = torch.cat([batch.prompt_mask, batch.completion_mask.long()], 1)
        batch.rewards = tasks.score_with_reward_model(
            sampler.reward_model,
            ids,
            mask,
            args.micro_batch_size,
            device=sampler.device,
            bf16=args.bf16,
        )
    batch.correct = tasks.score_correct(sampler.task, texts, batch.examples)
    return batch


def responses(batch: Batch, args: Args) -> list[str]:
    """What every reward, correctness and step-reward function reads: --response-prefix (the
    answer's prefilled start) + each decoded completion."""
    return [args.response_prefix + completion for completion in batch.completions]


# ----------------------------------------------------------------------------------------------
# Tools while sampling (not in the paper): a tool's tokens are context for the policy, not actions
# ----------------------------------------------------------------------------------------------
class Tool:
    """--tool: ``function(call text) -> the text to inject, or None`` (:func:`calculator`, or
    yours), called when a row's text since its last tool output (``prefix``, --response-prefix,
    then ``tokenizer.decode``) ends with the first ``markers[1]`` after a ``markers[0]``, with the
    text between. Its output's tokens (``split_special_tokens``: it cannot write an EOS), cut to
    ``max_tokens``, join the row one a decode step (:func:`common.decode`), the cache kept and
    nothing re-tokenised; a tool that raises writes its error instead. ``start(rows, tokenizer)``
    begins a decoding call; ``counts``: (rows, 2) long, each row's calls and errors in it."""

    def __init__(self, function, markers: tuple[str, str], max_tokens: int, prefix: str = ""):
        self.function = function
        self.markers = markers
        self.max_tokens = max_tokens
        self.prefix = prefix

    def start(self, rows: int, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.since = [[] for _ in range(rows)]  # each row's tokens since its last tool output
        self.before = [self.prefix] * rows  # the text before them: the prefix until a call
        self.queued = [[] for _ in range(rows)]  # each row's tool tokens still to go in
        self.counts = torch.zeros(rows, 2, dtype=torch.long)

    def __call__(self, token: torch.Tensor, going: torch.Tensor):
        """(n,) tokens of the ``going`` rows, ``token`` (the draws) or the tool's next ones, and
        the (n,) float mask of the draws kept."""
        tokens = token.tolist()
        drawn = [1.0] * len(tokens)
        opening, closing = self.markers
        for i, row in enumerate(going.tolist()):
            if self.queued[row]:  # the tool's output, one token a step
                tokens[i] = self.queued[row].pop(0)
                drawn[i] = 0.0
                continue
            self.since[row].append(tokens[i])
            decoded = self.tokenizer.decode(self.since[row])
            text = self.before[row] + decoded
            _, opened, call = text.removesuffix(closing).rpartition(opening)
            closes = text.endswith(closing) and closing not in call  # its first closing marker
            if opened and closes:  # a call: the text between the markers
                self.queued[row] = self.output(call, row)
                self.since[row] = []
                self.before[row] = ""
        device = token.device
        return torch.tensor(tokens, device=device), torch.tensor(drawn, device=device)

    def output(self, call: str, row: int) -> list[int]:
        """The token ids of the tool's text for ``call`` (or of its error)."""
        self.counts[row, 0] += 1
        try:
            text = self.function(call)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - its error is its output
            self.counts[row, 1] += 1
            text = f"{type(e).__name__}: {e}"
        if text is None:
            return []
        encoded = self.tokenizer(str(text), add_special_tokens=False, split_special_tokens=True)
        return encoded["input_ids"][: self.max_tokens]


def make_tool(args: Args, files: dict) -> Tool | None:
    """--tool's :class:`Tool` (None without it): :func:`calculator`, or your function run from its
    file as --reward-fn's are (``files``: the globals of files already run, by path; filled).
    UsageError: a bad spec, file or function."""
    if args.tool is None:
        return None
    function = calculator
    if args.tool != "calculator":
        function = tasks.load_function(args.tool, "--tool", files)
    return Tool(function, args.tool_markers, args.max_tool_tokens, args.response_prefix)


def calculator(call: str) -> str:
    """--tool calculator: the value of the arithmetic ``call`` (:func:`arithmetic_value`, as process
    supervision checks a step) and GSM8K's closing ``>>``: ``"24>>"`` for ``"48/2"``,
    ``"0.333333>>"`` for ``"1/3"``. Raises as arithmetic_value: the sampler writes the error."""
    value = arithmetic_value(call)
    if value.is_integer():
        return f"{int(value)}>>"
    return f"{value:.6g}>>"


# ----------------------------------------------------------------------------------------------
# DeepSeekMath's extensions: process supervision (§4.1.3), iterative RL with its reward model §4.1.4
# ----------------------------------------------------------------------------------------------
def process_supervision(batch: Batch, tokenizer, args: Args, device, *, step_reward_fn=None):
    """§4.1.3: (N, T) advantages on ``device`` from the steps ``step_reward_fn(response, example)
    -> [(end character offset, reward), ...]`` (:func:`arithmetic_step_rewards`) checks in each
    response (prefix + completion, as reward functions read it) and its final answer, a step with
    the outcome reward (:func:`process_advantages`); a step ending in the prefix or on a tool's
    token is not the policy's: unpaid. ``process/*``: ``batch.scalars``. UsageError: it raises."""
    step_reward_fn = step_reward_fn or arithmetic_step_rewards
    N, T = batch.completion_ids.shape
    prefix = len(args.response_prefix)  # characters before the completion's first
    rewards = []
    rows = []
    ends = []
    texts = responses(batch, args)
    for i, (text, example) in enumerate(zip(texts, batch.examples, strict=True)):
        length = int(batch.completion_mask[i].sum())  # |o_i|
        ids = batch.completion_ids[i].tolist()
        try:
            returned = step_reward_fn(text, example)
            steps = [(int(end), float(r)) for end, r in returned]
        except (Exception, SystemExit) as e:  # noqa: BLE001 - as a reward function's failure
            failed = f"step reward function raised {type(e).__name__}: {e} on completion {i}"
            raise UsageError(failed) from None
        # a step ends at the first token whose decoded prefix holds its last character
        prefixes = [ids[:n] for n in range(1, length + 1)]
        decoded = tokenizer.batch_decode(prefixes, skip_special_tokens=True)
        lengths = [len(p) for p in decoded]
        for end, step_reward in steps:
            if end <= prefix:  # inside --response-prefix: not the policy's text, not paid
                continue
            token = min(bisect.bisect_left(lengths, end - prefix), length - 1)
            if not batch.sampled_mask[i, token]:  # a tool wrote the step's result: not paid
                continue
            ends.append(token)
            rewards.append(step_reward)
            rows.append(i)
        ends.append(length - 1)  # the final answer: the completion's last token
        rewards.append(batch.rewards[i].item())
        rows.append(i)
    every_process = torch.tensor(common.all_gather_objects(rewards))
    step_rewards = torch.tensor(rewards)
    step_rows = torch.tensor(rows)
    step_ends = torch.tensor(ends)
    advantages = process_advantages(
        step_rewards,
        step_rows,
        step_ends,
        shape=(N, T),
        group_size=args.group_size,
        scale=args.scale_rewards,
        baseline=args.advantage,
        batch=every_process,
    )
    checked = len(rewards) - N  # the steps that are not final answers, and their rewards' sum
    step_sum = sum(rewards) - batch.rewards.sum().item()
    totals = torch.tensor([checked, step_sum], dtype=torch.float64)
    checked, step_sum = common.all_reduce(totals).tolist()
    completions = args.prompts_per_step * args.group_size
    batch.scalars["process/steps_per_completion"] = checked / completions
    batch.scalars["process/step_reward_mean"] = step_sum / max(checked, 1)
    return advantages.to(device)


_OPS = {ast.Add: add, ast.Sub: sub, ast.Mult: mul, ast.Div: truediv, ast.USub: neg}


def _arithmetic(node: ast.AST) -> float:
    """The value of an ast of number literals, ``+ - * /`` and unary minus; ValueError else."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return float(node.value)
    if isinstance(node, ast.UnaryOp | ast.BinOp) and type(node.op) in _OPS:  # -x, x op y
        if isinstance(node, ast.UnaryOp):
            operands = [node.operand]
        else:
            operands = [node.left, node.right]
        values = [_arithmetic(operand) for operand in operands]
        return _OPS[type(node.op)](*values)
    raise ValueError("not arithmetic")


# A term: a number with "(", "-", ")" around it. No space can match two neighbouring \s*
# (a sum without "=" took exponential time to reject: 6 s for ten terms).
_TERM = rf"(?:-\s*)?\$?{tasks.DIGITS}(?:\s*\)+)?"
_LHS = rf"(\(*\s*{_TERM}(?:\s*[-+*/×]\s*(?:\(+\s*)?{_TERM})+)"  # x op y (op z ...), group 1
_STEP = re.compile(rf"(?<![\d.]){_LHS}\s*=\s*(-?\s*\$?{tasks.DIGITS})")


def arithmetic_value(text: str) -> float:
    """The value of the arithmetic ``text``: numbers (``$``, ``1,234``), ``+ - * / ×``, parentheses
    and unary minus, parsed by :func:`_arithmetic` (model text is never evaluated as code). Raises
    SyntaxError, ValueError (not arithmetic), ZeroDivisionError, OverflowError, RecursionError."""
    expression = text.replace("$", "").replace(",", "").replace("×", "*").strip()
    return _arithmetic(ast.parse(expression, mode="eval").body)


def arithmetic_step_rewards(completion: str, example=None) -> list[tuple[int, float]]:
    """Process supervision's step rewards: each equation ``x op y (op z ...) = w`` (``+ - * / ×``,
    parentheses, ``$``, ``1,234``, GSM8K's ``<<48/2=24>>``) as (end offset after its last digit,
    1.0 if right within a relative 1e-4 else 0.0)."""
    steps = []
    for match in _STEP.finditer(completion):
        try:
            lhs = arithmetic_value(match.group(1))
            rhs = arithmetic_value(match.group(2).replace(" ", ""))
            right = math.isclose(lhs, rhs, rel_tol=1e-4, abs_tol=1e-9)
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
            right = False
        steps.append((match.end(), float(right)))
    return steps


def make_reward_model(args: Args, tokenizer, device):
    """r_phi: the model of --reward-model-path (frozen unless --train-reward-model), or with
    --train-reward-model alone the policy's backbone with a new score head (Algorithm 1, §4.1.4);
    None: the task's reward scores."""
    if args.reward_model_path:
        model = common.load_reward_model(args.reward_model_path, tokenizer, device).eval()
        model.requires_grad_(args.train_reward_model)
        return model
    if args.train_reward_model:
        model = common.load_model(args.model_name_or_path, kind="reward", device=device).eval()
        model.config.pad_token_id = tokenizer.pad_token_id
        return model
    return None


class RewardModelTraining:
    """Algorithm 1, line 12 (§4.1.4): r_phi trained continually, by MSE regression of its score on
    the verifiable reward, after each iteration's last step, on the iteration's samples and a replay
    of earlier ones (--rm-replay-ratio of each set). ``add(batch)`` keeps every process's samples
    (each trains the same model); --rm-eval-fraction of new ones is held out (never trained on)."""

    def __init__(self, model, tokenizer, args: Args, device):
        self.model = model
        self.pad = tokenizer.pad_token_id
        self.args = args
        self.device = device
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=args.rm_learning_rate, weight_decay=args.weight_decay
        )
        self.new = []  # this iteration's {"ids": ..., "label": r_i}
        self.replay = []  # earlier iterations'

    def add(self, batch: Batch) -> None:
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
        real = torch.cat([batch.prompt_mask, batch.completion_mask.long()], 1).bool()
        samples = []
        for row_ids, row_real, label in zip(ids, real, batch.verifiable, strict=True):
            samples.append({"ids": row_ids[row_real].tolist(), "label": label.item()})
        self.new += common.all_gather_objects(samples)

    def scores(self, samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """(n,) float32 scores of r_phi (differentiable) and (n,) labels of ``samples``."""
        sequences = [sample["ids"] for sample in samples]
        ids, mask = common.pad_left(sequences, self.pad, self.device)
        rewards = [sample["label"] for sample in samples]
        labels = torch.tensor(rewards, device=self.device)
        with common.bf16_autocast(self.device, self.args.bf16):
            return tasks.reward_model_scores(self.model, ids, mask), labels

    def train(self, step: int) -> dict:
        args = self.args
        size = args.micro_batch_size
        rng = np.random.default_rng([args.seed, step + 1, 1])
        order = rng.permutation(len(self.new))
        shuffled = [self.new[i] for i in order]
        split = int(len(shuffled) * args.rm_eval_fraction)
        held_out = shuffled[:split]
        fresh = shuffled[split:]
        data = replay_mix(fresh, self.replay, args.rm_replay_ratio, rng)
        for _ in range(args.rm_epochs):  # MSE regression of the score on the verifiable reward
            order = rng.permutation(len(data))
            for start in range(0, len(data), size):
                chunk = [data[j] for j in order[start : start + size]]
                scores, labels = self.scores(chunk)
                loss = F.mse_loss(scores, labels)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
        self.replay = self.replay + fresh
        self.new = []
        scalars = {"train_mse": loss.item(), "train_size": len(data)}
        scalars["replayed"] = len(data) - len(fresh)
        if held_out:
            accuracy, mse = self.accuracy(held_out)
            scalars["heldout_accuracy"] = accuracy
            scalars["heldout_mse"] = mse
        return {f"reward_model/{key}": value for key, value in scalars.items()}

    @torch.no_grad()
    def accuracy(self, samples: list[dict]) -> tuple[float, float]:
        """(accuracy, MSE) on labelled samples; accurate: |score - label| < 0.5."""
        size = self.args.micro_batch_size
        pairs = []
        for start in range(0, len(samples), size):
            pairs.append(self.scores(samples[start : start + size]))
        scores = torch.cat([score.cpu() for score, _ in pairs])
        labels = torch.cat([label.cpu() for _, label in pairs])
        errors = (scores - labels).abs()
        accurate = (errors < 0.5).float().mean().item()
        return accurate, F.mse_loss(scores, labels).item()

    def state(self, checkpoint: dict | None = None) -> dict:
        """What a checkpoint keeps of it; with ``checkpoint``, that state restored first."""
        if checkpoint is not None:
            self.model.load_state_dict(checkpoint["reward_model"])
            self.optimizer.load_state_dict(checkpoint["rm_optimizer"])
            self.new = checkpoint["rm_new"]
            self.replay = checkpoint["rm_replay"]
        state = {"rm_new": self.new, "rm_replay": self.replay}
        state["reward_model"] = self.model.state_dict()
        state["rm_optimizer"] = self.optimizer.state_dict()
        return state


def replay_mix(new: list, history: list, ratio: float, rng: np.random.Generator) -> list:
    """One iteration's reward-model training set (Algorithm 1, §4.1.4): ``new`` and
    ``round(len(new) * ratio / (1 - ratio))`` samples (at most all) of ``history``, drawn without
    replacement, so that they make up ``ratio`` (in [0, 1)) of it."""
    wanted = round(len(new) * ratio / (1 - ratio))
    count = min(len(history), wanted)
    replayed = rng.choice(len(history), count, replace=False)
    return list(new) + [history[i] for i in replayed]


# ----------------------------------------------------------------------------------------------
# Later variants (every flag off = the paper's GRPO): DAPO's dynamic sampling and overlong shaping;
# Dr. GRPO, RLOO, REINFORCE++, clip-higher, GSPO, CISPO: options of group_advantages, grpo_loss.
# ----------------------------------------------------------------------------------------------
def dynamic_sampling(batch: Batch, sampler: Sampler, args: Args, step: int) -> Batch:
    """DAPO dynamic sampling (arXiv 2503.14476, §3.2): keep the groups whose rewards differ, and
    sample new questions (rounds 1, 2, ...) until B such groups are found or --max-sampling-rounds
    is reached; dropped groups top the batch up (advantage 0 unless --overlong-buffer's penalty,
    added afterwards, separates them; they still carry the KL term). Under torchrun each process
    fills its own B groups, and all sample as many rounds (until each has its B: --fsdp calls the
    model alike on every process). The ``sampling/*`` scalars go to ``batch.scalars``."""
    G = args.group_size
    B = len(batch.rewards) // G
    rounds = []
    chosen = []  # (round, group) of the groups whose rewards differ
    for r in range(args.max_sampling_rounds):
        if r == 0:
            rounds.append(batch)
        else:
            rounds.append(sample_and_score(sampler, args, step, round_=r))
        grouped = rounds[r].rewards.view(-1, G)
        varied = grouped.max(1).values > grouped.min(1).values
        chosen += [(r, g) for g in range(B) if varied[g]]
        varied_here = torch.tensor(min(len(chosen), B))
        varied_groups = common.all_reduce(varied_here).item()  # every process's
        if varied_groups == args.prompts_per_step:  # each has its B: all sample alike (--fsdp)
            break
    everyone = [(r, g) for r in range(len(rounds)) for g in range(B)]
    dropped = [group for group in everyone if group not in chosen]
    pad = sampler.tokenizer.pad_token_id
    kept = (chosen + dropped)[:B]
    merged = merge_groups(rounds, kept, G, pad)
    merged.scalars["sampling/rounds"] = len(rounds)  # the same on every process
    merged.scalars["sampling/frac_groups_varied"] = varied_groups / args.prompts_per_step
    return merged


def merge_groups(batches: list[Batch], chosen: list, G: int, pad: int) -> Batch:
    """One batch of the groups ``chosen`` = [(batch index, group index), ...]: every field's rows
    concatenated, prompts left-padded and completions right-padded again to the widest."""
    rows = []  # (batch, its group's rows)
    for b, g in chosen:
        group_rows = slice(g * G, (g + 1) * G)
        rows.append((batches[b], group_rows))

    def cat(key: str, value=0, left=False):  # the chosen rows of a field, padded to the widest
        if getattr(batches[0], key) is None:
            return None
        parts = [getattr(b, key)[r] for b, r in rows]
        if isinstance(parts[0], list):
            return [x for part in parts for x in part]
        if parts[0].ndim == 1:
            return torch.cat(parts)
        width = max(part.shape[-1] for part in parts)
        padded = []
        for part in parts:
            gap = width - part.shape[-1]
            sides = (gap, 0) if left else (0, gap)  # F.pad's (left, right)
            padded.append(F.pad(part, sides, value=value))
        return torch.cat(padded)

    reward_fns = {}
    for name in batches[0].reward_fns:
        parts = [b.reward_fns[name][r] for b, r in rows]
        reward_fns[name] = torch.cat(parts)
    return Batch(
        prompt_ids=cat("prompt_ids", pad, left=True),
        prompt_mask=cat("prompt_mask", 0, left=True),
        completion_ids=cat("completion_ids", pad),
        completion_mask=cat("completion_mask"),
        sampled_mask=cat("sampled_mask"),
        sampler_log_probs=cat("sampler_log_probs"),
        examples=cat("examples"),
        completions=cat("completions"),
        tool_calls=cat("tool_calls"),
        rewards=cat("rewards"),
        verifiable=cat("verifiable"),
        correct=cat("correct"),
        truncated=cat("truncated"),
        reward_fns=reward_fns,
    )


def overlong_penalty(mask: torch.Tensor, max_length: int, buffer: int) -> torch.Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476, §3.4), added to the reward: (N,) in [-1, 0]
    from the lengths |o| of the (N, T) ``mask``: 0 for ``|o| <= L_max - L_cache``, then ``((L_max -
    L_cache) - |o|) / L_cache``, -1 at L_max = ``max_length`` (L_cache = ``buffer``; 0: all 0)."""
    lengths = mask.float().sum(1).cpu()
    penalty = ((max_length - buffer) - lengths) / max(buffer, 1)
    return penalty.clamp(-1.0, 0.0)


# ----------------------------------------------------------------------------------------------
# Scale-out and speed: micro-batches (torchrun is in common.py)
# ----------------------------------------------------------------------------------------------
def rows_with_a_gradient(advantages, loss_mask, group_size: int, *, other_terms: bool):
    """(n,) long: the rows whose loss terms are not all exactly 0, the rows lines 10-11 compute: a
    token in the (N, T) ``loss_mask`` and, without ``other_terms`` (a KL or entropy term), an
    advantage that is not 0 (equal rewards give 0). None left: the first group (AdamW then steps
    on zero gradients, as it would on the whole batch)."""
    has_tokens = loss_mask.sum(1) > 0
    nonzero = (advantages != 0).reshape(len(advantages), -1).any(1)
    keep = has_tokens & (nonzero | other_terms)
    keep[:group_size] |= not keep.any()  # none left: the first group
    return keep.nonzero().squeeze(1)


def plan_micro_batches(batch: Batch, rows: torch.Tensor, *, size: int, group_size: int, device):
    """:class:`MicroBatch` es of ``size`` of the batch's ``rows`` for lines 6-11. Groups of similar
    completion length go together (whole groups when ``size`` is a multiple of G: a prompt goes
    through the model once per micro-batch that holds its completions), each trimmed to its
    longest prompt and completion. The loss is a sum over sequences, so the order only saves
    compute (except --loss-type bnpo's per-micro-batch mean)."""
    G = group_size
    lengths = batch.completion_mask.sum(1)
    row_lengths = lengths.tolist()
    group_lengths = lengths.view(-1, G).amax(1).tolist()

    def longest_first(i):  # groups by their longest completion, then rows by theirs
        group = i // G
        return (-group_lengths[group], group, -row_lengths[i])

    order = sorted(rows.tolist(), key=longest_first)
    micro_batches = []
    for idx in torch.tensor(order, device=device).split(size):
        groups, prompt_index = torch.unique(idx // G, return_inverse=True)  # each prompt once
        prompt_ids = batch.prompt_ids[groups * G]
        prompt_mask = batch.prompt_mask[groups * G]
        first = int(prompt_mask.any(0).float().argmax())  # the first column with a real token
        T = int(lengths[idx].max())
        completion_ids = batch.completion_ids[idx, :T]
        completion_mask = batch.completion_mask[idx, :T].long()
        micro_batch = MicroBatch(
            prompt_ids[:, first:],
            prompt_mask[:, first:],
            prompt_index,
            completion_ids,
            completion_mask,
            rows=idx,
        )
        micro_batches.append(micro_batch)
    return micro_batches


# ----------------------------------------------------------------------------------------------
# TRY NOT TO MODIFY: run plumbing (validation, resume, metrics, checkpoints)
# ----------------------------------------------------------------------------------------------
SCRIPT = "grpo_lm.py"  # written into checkpoints: --resume refuses another script's
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
    "group_size",
    "reward_model_path",
    "train_reward_model",
    "lora_rank",
    "lora_alpha",
    "lora_target_modules",
)


def validate(args: Args) -> None:
    """One-line errors (UsageError naming the flag) for flags that cannot work, before anything
    loads: each flag's own constraint (beside it in Args), the rules both LM scripts share
    (common.check_flags, tasks.check_task_flags), then GRPO's."""
    common.check_flags(Args, dataclasses.asdict(args))
    tasks.check_task_flags(
        args.reward_fn,
        args.reward_weights,
        prompt_field=args.prompt_field,
        answer_field=args.answer_field,
        system_prompt=args.system_prompt,
        response_prefix=args.response_prefix,
    )
    steps = args.total_steps
    iterations = args.iterations
    rm_path = args.reward_model_path
    divides = f"--iterations {iterations} must divide --total-steps {steps}"
    check(steps % iterations == 0, divides)
    check(args.overlong_buffer < args.max_new_tokens, "--overlong-buffer: below --max-new-tokens")
    world = common.world_size()
    divisible = f"--prompts-per-step must be divisible by the {world} torchrun processes"
    check(args.prompts_per_step % world == 0, divisible)
    two = "--reward-fn and a frozen --reward-model-path are two rewards: pick one"
    frozen_model = rm_path and not args.train_reward_model
    check(not (args.reward_fn and frozen_model), two)
    untrained = "--train-reward-model without --reward-model-path needs --iterations >= 2"
    first_from_scratch = args.train_reward_model and not rm_path
    check(not first_from_scratch or iterations >= 2, untrained)
    lora = "--lora-rank needs --iterations 1: the reference (the policy's adapter off) never resets"
    mixed = "--scale-rewards group: not with --advantage reinforce++ (its batch-centred rewards)"
    reinforce_by_group = args.advantage == "reinforce++" and args.scale_rewards == "group"
    check(not reinforce_by_group, mixed)
    check(not args.lora_rank or iterations == 1, lora)


def resume_checkpoint(args: Args) -> dict | None:
    """The --resume checkpoint (memory-mapped; None without --resume), checked before anything loads
    by common.resume_checkpoint (this script's, ``FROZEN`` flags unchanged, steps left), with the
    same Algorithm 1 iterations: --total-steps / --iterations steps each. Raises UsageError."""
    checkpoint = common.resume_checkpoint(dataclasses.asdict(args), SCRIPT, FROZEN)
    saved = dataclasses.asdict(args)
    if checkpoint:
        saved = checkpoint["args"]
    length = saved["total_steps"] // saved["iterations"]
    both_one = saved["iterations"] == 1 and args.iterations == 1
    same = f"--total-steps: this run's iterations have {length} steps; resume with that length"
    check(both_one or args.total_steps // args.iterations == length, same)
    return checkpoint


def restore(checkpoint: dict | None, args: Args, policy, optimizer, *, reference, rm_training):
    """Load a checkpoint's weights and optimizer states (the flags given now set the optimizers'
    learning rates and weight decay); returns the checkpoint's step (0 without one)."""
    if checkpoint is None:
        return 0
    common.load_trained_weights(policy, checkpoint["policy"])  # the same model: the weights fit
    common.load_optimizer_state(optimizer, checkpoint["optimizer"])
    if reference is not None and checkpoint["reference"] is not None:  # reset (--iterations > 1)
        common.load_state(reference, checkpoint["reference"])
    optimizer.param_groups[0].update(lr=args.learning_rate, weight_decay=args.weight_decay)
    if rm_training:
        rm_training.state(checkpoint)
        for group in rm_training.optimizer.param_groups:
            group.update(lr=args.rm_learning_rate, weight_decay=args.weight_decay)
    return checkpoint["step"]


def sampler_agreement(logp, sampler_logp, mask) -> dict:
    """The (b, T) log probs of the drawn tokens as the sampler computed them against ``logp``, the
    training forward's under the same weights, over ``mask``: the sum of the absolute differences
    and their max (``sampling/logp_diff_mean``, ``_max``). With --mu 1 the ratio reads the training
    forward alone, so a mismatch never reaches the loss; this shows a sampler drifting from the
    trainer (bf16, another kernel: trl#4772)."""
    difference = (logp - sampler_logp).abs() * mask
    return {"logp_diff": difference.sum(), "logp_diff_max": difference.max()}


def step_metrics(args: Args, batch: Batch, rewards, loss_stats: list, *, grad_norm, t0, gen_time):
    """A step's logged scalars over the global batch from ``loss_stats`` (:func:`grpo_loss`'s of
    every micro-batch, with its ``loss`` and masked ``entropy`` sum) and ``batch.scalars``:
    ``loss/policy`` the minimised -J of eq. 3 (KL, entropy bonus in), other ``loss/*`` over
    :func:`rows_with_a_gradient`'s rows."""
    keys = ("loss", "kl", "clipped_high", "clipped_low", "tokens", "entropy")  # micro-batches, mu
    totals = [sum(stats[key].item() for stats in loss_stats) for key in keys]
    sums = torch.tensor(totals)
    loss, kl, high, low, tokens, entropy = common.all_reduce(sums).tolist()
    token_count = max(tokens, 1)  # the token means' denominator
    lengths = common.all_gather(batch.sampled_mask.sum(1).float().cpu())  # the policy's tokens
    correct = common.all_gather(batch.correct.float().cpu())
    truncated = common.all_gather(batch.truncated.float().cpu())
    ratio_max_here = max(stats["ratio_max"].item() for stats in loss_stats)
    ratio_max = common.all_reduce(torch.tensor(ratio_max_here), "max")
    group_stds = rewards.view(-1, args.group_size).std(1)
    first = loss_stats[: len(loss_stats) // args.mu]  # the first update's: the sampling weights
    diff_here = sum(stats["logp_diff"].item() for stats in first)
    diff_max_here = max(stats["logp_diff_max"].item() for stats in first)
    diff = common.all_reduce(torch.tensor(diff_here)).item()
    diff_max = common.all_reduce(torch.tensor(diff_max_here), "max").item()
    scalars = {}
    scalars["reward/mean"] = rewards.mean().item()
    scalars["reward/std"] = rewards.std().item()
    scalars["reward/accuracy"] = correct.mean().item()
    scalars["reward/frac_zero_std_groups"] = (group_stds == 0).float().mean().item()
    scalars["loss/policy"] = loss / args.mu  # the minimised -J of eq. 3, a mean over mu updates
    scalars["loss/tokens"] = tokens / args.mu
    scalars["loss/kl"] = kl / token_count
    scalars["loss/clip_fraction"] = (high + low) / token_count
    scalars["loss/entropy"] = entropy / token_count
    scalars["loss/clip_fraction_high"] = high / token_count  # A > 0
    scalars["loss/clip_fraction_low"] = low / token_count  # A < 0
    scalars["loss/ratio_max"] = ratio_max.item()
    scalars["completion/length_mean"] = lengths.mean().item()
    scalars["completion/frac_truncated"] = truncated.mean().item()
    scalars["sampling/logp_diff_mean"] = diff / max(tokens / args.mu, 1)
    scalars["sampling/logp_diff_max"] = diff_max
    if args.tool:  # how often the policy calls it, and how many tokens of o_i it writes
        calls = common.all_gather(batch.tool_calls.float())  # (N, 2): calls, errors
        written = (batch.completion_mask - batch.sampled_mask).sum(1).cpu()
        scalars["tools/frac_calling"] = (calls[:, 0] > 0).float().mean().item()
        scalars["tools/errors"] = calls[:, 1].sum().item()
        scalars["tools/tokens_mean"] = common.all_gather(written).mean().item()
    scalars["optim/grad_norm"] = grad_norm.item()
    scalars["time/generation_s"] = gen_time
    scalars["time/training_s"] = time.time() - t0 - gen_time
    scalars |= common.peak_memory_gb(grad_norm.device)
    scalars |= batch.scalars
    scalars |= common.reward_fn_means(batch.reward_fns)  # --reward-fn
    if batch.verifiable is not None and (args.reward_model_path or args.train_reward_model):
        scalars["reward/verifiable_mean"] = common.all_gather(batch.verifiable).mean().item()
    return scalars


def save_checkpoint(log, step: int, args: Args, policy, *, optimizer, reference, rm_training):
    """Every --save-every steps and at the end, atomically (rank 0; --fsdp: every process gathers
    the shards), what an exact resume needs: the reference when --iterations > 1 resets it (else
    --model-name-or-path's, loaded again) and the reward model with its samples."""
    periodic = args.save_every > 0 and step % args.save_every == 0
    if not (periodic or step == args.total_steps):
        return
    reference_state = None
    if args.iterations > 1 and reference is not None:
        reference_state = reference.state_dict()
    state = {"script": SCRIPT, "step": step, "args": dataclasses.asdict(args)}
    state["reference"] = reference_state
    state["policy"] = common.trained_weights(policy)
    state["optimizer"] = optimizer.state_dict()
    if rm_training:
        state |= rm_training.state()
    state["rng"] = common.rng_state()
    state = common.full_tensors(state)
    if log.is_main:
        common.atomic_save(state, log.checkpoint)


def sample_lines(batch: Batch, G: int) -> list[str]:
    """The first completion of each group with its reward, for the printed and logged samples."""
    lines = []
    for i in range(0, len(batch.completions), G):
        question = batch.examples[i]["question"]
        lines.append(f"[reward {batch.rewards[i]:.2f}] {question!r} -> {batch.completions[i]!r}")
    return lines


def cli(argv: list[str] | None = None) -> None:
    """The command line (``--help``): bad input ends in one ``error: ...`` line, exit code 2."""
    common.run_cli(lambda: main(common.parse_args(Args, argv, SCRIPT)))


if __name__ == "__main__":
    cli()
