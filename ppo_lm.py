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
main(), steps 1-7 of a PPO iteration. Below main(): rollout() and score() (steps 1-2), then each
extension, off by default and one tagged line in the loop (the adaptive KL controller of Ziegler et
al. 2019; micro-batches, torchrun), last the run plumbing. The policy loss
differs from grpo_lm.py's only in where the advantage comes from (GAE on a learned value) and where
the KL goes (into the reward, per token). Why KL_t is k1, and where this file departs from the N+
details' code and TRL's PPOTrainer (loss averaged per sequence, the score on the EOS token, no
learning-rate schedule, gradients clipped per model, ...): docs/ppo_lm.md.

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
    # prompts per sampling call (0 = all of a process's); samples depend only on --seed, the step
    # and the calls' prompts
    generation_prompts_per_call: Annotated[int, Ge(0)] = 0
    # bfloat16 autocast on a CUDA GPU that supports it or a CPU with AVX512-BF16 (weights,
    # optimizer, LM head and log-softmax stay float32); float32 elsewhere
    bf16: bool = True
    # recompute the policy's and the value model's activations in the backward pass: less memory,
    # ~30% slower
    gradient_checkpointing: bool = False


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


def token_log_probs(model, input_ids, attention_mask, T, temperature, entropy_coef=None):
    """(B, T) ``log softmax(logits / temperature)`` of the last T tokens of the (B, P + T)
    left-padded ``input_ids``; with ``entropy_coef`` also their (B, T) entropy, differentiable if
    it is not 0 (one row at a time: 2.5 (B, T, V) copies at the peak, not 5).

    Logits exist for the completion positions only; position ids count real tokens only, as in
    generation; the LM head and the log-softmax run in float32 also under bf16 autocast.
    """
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    with common.float32_lm_head(model):
        logits = model(**inputs, logits_to_keep=T + 1, use_cache=False).logits[:, :-1]  # j: j + 1
    logp, H = [], []
    for z, row in zip(logits.float().split(1), input_ids[:, -T:].split(1), strict=True):
        logp.append((lp := (z / temperature).log_softmax(-1)).gather(2, row[..., None])[..., 0])
        if entropy_coef is not None:  # with its gradient only for a bonus (0: logged only)
            H.append(-((lp := lp if entropy_coef else lp.detach()).exp() * lp).sum(-1))
    return (torch.cat(logp), torch.cat(H)) if entropy_coef is not None else torch.cat(logp)


def token_values(value_model, input_ids, attention_mask, T: int) -> torch.Tensor:
    """(B, T) float32 values V(s_t) of the last T tokens of the (B, P + T) ``input_ids``: the
    ``score`` head of the sequence-classification ``value_model`` on its backbone's hidden states.

    The state s_t before completion token o_t ends at position P + t - 1, whose logits give
    pi(o_t | s_t): V(s_t) is read there. The state after the last token is terminal, valued 0.
    """
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    hidden = value_model.base_model(**inputs, use_cache=False).last_hidden_state
    return value_model.score(hidden[:, -T - 1 : -1]).squeeze(-1).float()


def per_token_rewards(scores, logp, ref_logp, mask, beta: float, estimator: str = "k1"):
    """(rewards, kl), both (B, T): ``-beta * KL_t`` on every valid token, plus the (B,) ``scores``
    on the last valid token (the EOS when there is one), 0 after it (DeepSeekMath eq. 2,
    InstructGPT eq. 2).

    ``KL_t`` from the (B, T) ``logp`` (pi_old) and ``ref_logp`` (None: no KL), ``r = pi_ref /
    pi_old``: k1 ``-log r`` (default), k2 ``(log r)^2 / 2``, k3 ``r - log r - 1`` (Schulman 2020).
    As a reward through the policy gradient, k1's expected gradient is that of KL(pi || pi_ref), so
    PPO optimises ``E[score] - beta * KL(pi || pi_ref)``; k3's is that of KL(pi || pi_ref) -
    KL(pi_ref || pi), k2's that of E_pi[k2] - KL(pi || pi_ref) (tests/test_kl.py, docs/grpo_lm.md).
    """
    kl = torch.zeros_like(mask)  # no reference model (beta = 0): no KL
    if ref_logp is not None:  # masked first: whatever follows the EOS (even inf) never enters
        log_r = torch.where(mask.bool(), ref_logp - logp, 0.0)
        kl = dict(k1=-log_r, k2=log_r**2 / 2, k3=torch.exp(log_r) - log_r - 1)[estimator]
    rewards = -beta * kl
    last = mask.sum(1).long().clamp(min=1) - 1  # index of each completion's last valid token
    rewards[torch.arange(len(last)), last] += scores.to(rewards)
    return rewards, kl


def masked_whiten(x, mask, shift_mean=True, eps=1e-8, all_reduce=lambda t: t) -> torch.Tensor:
    """``(x - mean) / std`` of the (B, T) ``x``, mean and unbiased std over the valid tokens only
    (``shift_mean=False``: the mean is kept), 0 at masked tokens. The N+ details whiten the
    advantages, and optionally the rewards. ``all_reduce`` sums a tensor over processes (torchrun:
    ``common.all_reduce``, so the statistics are those of the global batch)."""
    n, total = all_reduce(torch.stack([mask.sum(), (x * mask).sum()]))
    mean = total / n.clamp(min=1)
    var = all_reduce((((x - mean) * mask) ** 2).sum()) / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def gae(rewards, values, mask, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both (B, T) and 0 at masked positions: Generalized Advantage
    Estimation over tokens (Schulman et al. 2016, eq. 16) from the (B, T) rewards and values.

    ``delta_t = r_t + gamma * V(s_t+1) - V(s_t)``, ``A_t = delta_t + gamma * lam * A_t+1``, ``R_t =
    A_t + V(s_t)``. The state after the last valid token is terminal: valued 0, nothing after it.
    """
    rewards, values = rewards * mask, values * mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)  # terminal: 0
    deltas = rewards + gamma * next_values - values
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = deltas[:, t] + gamma * lam * running
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, advantages + values


def ppo_loss(logp, old_logp, advantages, values, old_values, returns, mask, clip_range,
             clip_range_value, vf_coef, num_sequences, entropy=None, entropy_coef=0.0):  # fmt: skip
    """(loss, stats) of a micro-batch: ``-J(theta) + vf_coef * L(phi)`` and detached sums (divide by
    ``tokens``) and extremes for logging.

    Policy: ``min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) + entropy_coef * H`` (PPO eq. 7 and
    its entropy bonus, eq. 9; ``entropy`` H (b, T) with grad, read if ``entropy_coef``); value:
    ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2)`` (N+ details). Both are
    averaged over each sequence's ``|o|`` tokens (as grpo_lm.py does), summed and divided by the
    ``num_sequences`` of the whole minibatch, so micro-batch losses add up to the minibatch's. All
    tensors are (b, T): ``logp`` and
    ``values`` with grad, the others from sampling time, ``advantages`` whitened; ``mask`` 1 up to
    the first EOS.
    """
    valid = mask.bool()
    log_ratio = torch.where(valid, logp - old_logp, 0.0)  # before exp(): no inf * 0 after the EOS
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    surrogate = torch.min(ratio * advantages, clipped_ratio * advantages)
    if entropy_coef:  # the entropy bonus, in the policy loss
        surrogate = surrogate + entropy_coef * entropy
    eps_v = clip_range_value
    values_clipped = old_values + torch.clamp(values - old_values, -eps_v, eps_v)
    value_losses = (values - returns) ** 2
    value_losses_clipped = (values_clipped - returns) ** 2
    per_token_vf = 0.5 * torch.max(value_losses, value_losses_clipped)
    lengths = mask.sum(1).clamp(min=1)  # |o|
    policy_loss = -((surrogate * mask).sum(1) / lengths).sum() / num_sequences
    value_loss = ((per_token_vf * mask).sum(1) / lengths).sum() / num_sequences
    loss = policy_loss + vf_coef * value_loss
    with torch.no_grad():
        clipped = (advantages > 0) & (ratio > 1 + clip_range)  # where the clip takes the gradient
        clipped |= (advantages < 0) & (ratio < 1 - clip_range)
        value_clipped = ((value_losses_clipped > value_losses).float() * mask).sum()
        approx_kl = (((ratio - 1) - log_ratio) * mask).sum()  # k3 of KL(pi_old || pi)
        ratios = ratio[valid] if valid.any() else ratio.new_ones(1)  # none valid: 1
        stats = dict(policy_loss=policy_loss.detach(), value_loss=value_loss.detach())
        stats |= dict(
            tokens=mask.sum(), clipped=(clipped.float() * mask).sum(), approx_kl=approx_kl
        )
        stats |= dict(value_clipped=value_clipped, ratio_max=ratios.max())
    return loss, stats


def adaptive_kl_coef(beta, kl: float, target: float, num_sequences: int, horizon: int) -> float:
    """The next beta of the adaptive KL controller (Ziegler et al. 2019 §2.2, their
    lm-human-preferences code): ``beta * (1 + clip(kl / target - 1, -0.2, 0.2) * num_sequences /
    horizon)``, ``kl`` the batch's mean KL per sequence (nats). It never stops an update early."""
    error = min(max(kl / target - 1, -0.2), 0.2)
    return beta * (1 + error * num_sequences / horizon)


# ----------------------------------------------------------------------------------------------
# RLHF-PPO, the N+ details' training loop
# ----------------------------------------------------------------------------------------------
def main(args: Args, task: tasks.Task | None = None) -> dict:
    """Train with PPO; returns the per-step history of logged scalars (a dict of lists; under
    torchrun, where each process runs this on its share of the batch, the global values on every
    rank). ``task`` replaces the built-in task: any :class:`tasks.Task`, e.g. with your own reward.
    """
    validate(args)  # a bad flag, checkpoint, dataset or reward file: one line, before any load
    checkpoint = common.resume_checkpoint(dataclasses.asdict(args), SCRIPT, FROZEN)  # --resume's
    data = Path(args.dataset).stem if args.dataset else args.task
    name = args.run_name or f"{data}__ppo__{args.seed}__{int(time.time())}"
    run_dir = common.make_run_dir(args.runs_dir, name, args.resume, args.eval_only)
    fields = (args.prompt_field, args.answer_field, args.reward_fn, args.reward_weights)
    task = task or tasks.task_of(args.task, args.dataset, *fields, args.eval_size)
    tokenizer = common.load_tokenizer(args.model_name_or_path)
    style = (args.system_prompt, args.response_prefix)  # every prompt's system message and prefix
    if not args.eval_only:  # the training questions whose prompts fit
        limits = (args.max_prompt_length, args.prompts_per_step, args.max_new_tokens)
        questions = tasks.training_questions(
            task, tokenizer, style, *limits, args.model_name_or_path
        )
    # torchrun: each process samples and trains on its share of the batch
    rank, world, device = common.start_processes(args.device)
    torch.manual_seed(args.seed)  # the other draws are seeded per step from --seed

    options = (tokenizer, task, args.eval_size, args.max_new_tokens, args.eval_batch_size, style)
    sampling = (args.eval_samples, args.temperature, args.top_p, args.seed)  # --eval-samples
    held_out = lambda pi: tasks.held_out_accuracy(pi, *options, args.bf16, sampling)  # noqa: E731

    # The four models, dropout off: the policy pi_theta, a reference pi_ref (a frozen copy of the
    # initial policy; none with beta = 0), the reward (a frozen reward model, or the task's
    # verifiable reward) and the value model V_phi (N+ details: from the reward model, else the
    # policy). Every process loads the same weights: they stay equal (same all-reduced gradients).
    lora = (args.lora_rank, args.lora_alpha, args.lora_target_modules) if args.lora_rank else None
    policy = common.load_policy(args.model_name_or_path, device, lora, args.gradient_checkpointing)
    if args.eval_only:  # no training: the held-out accuracy of --resume's policy or of the model
        return tasks.eval_only(policy, checkpoint, held_out, run_dir / "eval.json")
    reference = None  # read under bf16 autocast alone: bf16 Linear weights (LoRA: adapter off)
    if args.beta > 0:
        bf16 = common.bf16_active(device, args.bf16)
        reference = common.load_reference(policy, args.model_name_or_path, device, lora, bf16)
    reward_model, value_model = load_reward_and_value_models(args, tokenizer, device)
    policy_params = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters
    value_params = list(value_model.parameters())
    params = policy_params, value_params  # each model's gradients clipped on their own
    value_lr = args.value_learning_rate or args.learning_rate
    groups = [dict(params=policy_params), dict(params=value_params, lr=value_lr)]
    adam = dict(lr=args.learning_rate, eps=args.adam_eps, weight_decay=args.weight_decay)
    optimizer = torch.optim.AdamW(groups, **adam, fused=True)  # fused: one kernel (CPU and CUDA)
    start_step, beta = restore(checkpoint, args, policy, value_model, optimizer)  # 0, --beta: new
    bar = dict(reward="reward/mean", kl="loss/kl", vloss="loss/value", len="completion/length_mean")
    log_args = (rank, start_step, checkpoint is not None, "ppo", bar, args.track)
    log = common.RunLog(run_dir, dataclasses.asdict(args), *log_args)
    sampler = Sampler(policy, tokenizer, questions, rank, world)
    log.evaluate(0, args.eval_size > 0 and not checkpoint, lambda: held_out(policy)[0])  # start
    common.rng_state(checkpoint["rng"]) if checkpoint else None  # last: loading must not shift it

    # Under torchrun each process holds N of the --prompts-per-step prompts; a minibatch is
    # minibatch_size prompts of every process, and the losses divide by minibatch_size * world.
    N = args.prompts_per_step // world
    minibatch_size = N // args.num_minibatches
    M = minibatch_size * world  # sequences per minibatch, of every process: the losses divide by M
    coefs = args.clip_range, args.clip_range_value, args.vf_coef  # eq. 1's eps, N+ details
    bonus = args.entropy_coef  # PPO eq. 9's c2
    temperature, micro_batch_size = args.temperature, args.micro_batch_size
    for step in log.progress(start_step, args.total_steps):
        t0 = time.time()
        # ---- 1. Rollout: a completion per prompt from pi_old = the policy, cut after its EOS ----
        batch = rollout(sampler, args, device, step)  # Batch
        mask = batch.completion_mask  # (N, T): 1 up to and including each completion's first EOS
        gen_time = time.time() - t0

        # ---- 2. Score each completion: the reward model (as it pools) or the task's reward ----
        batch = score(batch, reward_model, task, args, device)
        scores = batch.score - args.missing_eos_penalty * batch.truncated.float()  # TRL's penalty

        # ---- 3. pi_old and pi_ref log probs and V_old values of the sampled tokens (no grad) ----
        old_logp, old_values = torch.zeros_like(mask), torch.zeros_like(mask)
        ref_logp = torch.zeros_like(mask) if reference is not None else None
        everyone = torch.arange(N, device=device)
        with torch.no_grad(), common.bf16_autocast(device, args.bf16):
            for idx, ids, att, t in make_micro_batches(everyone, batch, micro_batch_size):
                old_logp[idx, :t] = token_log_probs(policy, ids, att, t, temperature)
                old_values[idx, :t] = token_values(value_model, ids, att, t)
                if reference is not None:
                    ref_logp[idx, :t] = token_log_probs(reference, ids, att, t, temperature)

        # ---- 4. Per-token rewards: -beta * KL_t on every token, the score on the last (eq. 2) ----
        kl_terms = (old_logp, ref_logp, mask, beta, args.kl_estimator)
        rewards, kl = per_token_rewards(scores.to(device), *kl_terms)
        if args.whiten_rewards:  # N+ details (optional): unit variance over valid tokens, mean kept
            rewards = masked_whiten(rewards, mask, shift_mean=False, all_reduce=common.all_reduce)

        # ---- 5. GAE advantages and value targets R_t = A_t + V(s_t); advantages whitened ----
        advantages, returns = gae(rewards, old_values, mask, args.gamma, args.lam)
        advantages = masked_whiten(advantages, mask, all_reduce=common.all_reduce)  # every process

        # ---- 6. PPO updates: --num-ppo-epochs passes, --num-minibatches optimizer steps each ----
        loss_stats, grad_norms = [], []  # ppo_loss's of each micro-batch, norms of each update
        t2 = time.time()
        for _ in range(args.num_ppo_epochs):
            for minibatch in torch.randperm(N, device=device).split(minibatch_size):  # new split
                optimizer.zero_grad(set_to_none=True)
                for model in (policy, value_model):  # HF recomputes activations in train mode
                    model.train(args.gradient_checkpointing)
                for idx, ids, att, t in make_micro_batches(minibatch, batch, micro_batch_size):
                    with common.bf16_autocast(device, args.bf16):
                        logp, H = token_log_probs(policy, ids, att, t, temperature, bonus)
                        values = token_values(value_model, ids, att, t)
                    old_lp, old_v = old_logp[idx, :t], old_values[idx, :t]
                    adv, ret, m = advantages[idx, :t], returns[idx, :t], mask[idx, :t]
                    inputs = (logp, old_lp, adv, values, old_v, ret, m, *coefs, M, H, bonus)
                    loss, stats = ppo_loss(*inputs)
                    loss.backward()
                    loss_stats.append({**stats, "entropy": (H.detach() * m).sum()})
                policy.eval(), value_model.eval()
                common.all_reduce_gradients(policy_params + value_params)  # torchrun: DDP's
                norms = [common.clip_gradients(p, args.max_grad_norm, step) for p in params]
                grad_norms.append(norms)
                optimizer.step()

        # ---- 7. The KL coefficient beta of the next step: fixed (N+ details), or adaptive ----
        beta_used, beta = beta, next_beta(beta, kl, args)  # Ziegler et al. 2019

        # ---- logging, evaluation (every --eval-every), checkpoints (every --save-every) ----
        timing = t0, gen_time, t2
        metrics = step_metrics(args, batch, scores, kl, beta_used, loss_stats, grad_norms, *timing)
        log(step + 1, metrics | value_metrics(old_values, returns, mask.bool()))  # V_old and R_t
        log.samples(step + 1, sample_lines(batch), args.sample_every)
        due = step + 1 == args.total_steps or args.eval_every and (step + 1) % args.eval_every == 0
        log.evaluate(step + 1, args.eval_size > 0 and due, lambda: held_out(policy)[0])
        save_checkpoint(log, step + 1, args, policy, value_model, optimizer, beta)
    log.close()
    if rank == 0 and args.total_steps > start_step:
        common.save_pretrained(policy, tokenizer, run_dir / "final_model")
        print(f"saved {log.checkpoint} and {run_dir / 'final_model'} (from_pretrained loads it)")
    common.cleanup_distributed()  # the other processes wait until rank 0 has written everything
    return log.history


# ----------------------------------------------------------------------------------------------
# The N+ details' steps that are not equations: the rollout (step 1), the score (step 2), the
# reward and value models
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Sampler:
    """What step 1 samples with."""

    policy: Any  # pi_old: the policy as it is when the step starts
    tokenizer: Any
    questions: list[dict]  # the training questions whose prompts fit --max-prompt-length
    rank: int  # torchrun: this process samples the prompts rank * N .. rank * N + N - 1 of a step
    world: int


def rollout(sampler: Sampler, args: Args, device, step: int) -> Batch:
    """Step 1: this process's N prompts of the step and one completion of each from pi_old, the
    current policy; scores unset.

    The prompts are drawn from ``(--seed, step)``; the completions come from ``softmax(logits / T)``
    (within the top-p nucleus), in calls of --generation-prompts-per-call prompts, each reseeded
    from ``(--seed, step, global index of its first prompt)``: samples do not depend on the number
    of processes. Each completion is padded after its first EOS (:func:`completion_mask`).

    Raises:
        UsageError: the sampling probabilities are not finite (diverged weights).
    """
    tokenizer, N = sampler.tokenizer, args.prompts_per_step // sampler.world
    first, pad = sampler.rank * N, tokenizer.pad_token_id  # this process's prompts: first + 0..N-1
    rng = np.random.default_rng([args.seed, step])
    picks = rng.choice(len(sampler.questions), args.prompts_per_step, replace=False)
    examples = [sampler.questions[i] for i in picks[first : first + N]]
    style = (args.system_prompt, args.response_prefix)
    prompts = tasks.prompt_ids(tokenizer, [ex["question"] for ex in examples], *style)
    options = (args.temperature, args.top_p, args.max_new_tokens, args.bf16)
    seeds = ((args.seed, step), first), args.generation_prompts_per_call
    rows = common.generate_completions(sampler.policy, prompts, 1, tokenizer, options, *seeds)
    prompt_ids, prompt_mask = common.pad_left(prompts, pad, device)
    rows = [torch.tensor(row, device=device) for row in rows]  # padded after the EOS
    completion_ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad)
    mask = completion_mask(completion_ids, tokenizer.eos_token_id)  # (N, T): none after the EOS
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, mask.long()], 1)
    truncated = ~((completion_ids == tokenizer.eos_token_id) & mask.bool()).any(1).cpu()
    return Batch(examples, texts, input_ids, attention_mask, prompt_ids.shape[1], mask, truncated)


def score(batch: Batch, reward_model, task: tasks.Task, args: Args, device) -> Batch:
    """Step 2: ``batch.score``, (N,) on the CPU, before the missing-EOS penalty: the frozen reward
    model's, read where its own forward pass pools, or else the task's reward (with --reward-fn
    each function's own rewards too, in ``reward_fns``); and ``correct``, the final answer is right.
    The reward functions read --response-prefix + completion.

    Raises:
        UsageError: a reward function raises or returns a non-finite value.
    """
    responses = [args.response_prefix + c for c in batch.completions]
    if reward_model is not None:
        inputs = batch.input_ids, batch.attention_mask, args.micro_batch_size, device, args.bf16
        batch.score = tasks.score_with_reward_model(reward_model, *inputs)
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
    reward_model, path, flag = None, args.model_name_or_path, "--model-name-or-path"
    if args.reward_model_path is not None:
        path, flag = args.reward_model_path, "--reward-model-path"
        reward_model = common.load_reward_model(path, tokenizer, device)
        reward_model.eval().requires_grad_(False)  # frozen
    value_model = common.load_model(path, "reward", device, flag, len(tokenizer)).eval()
    check(hasattr(value_model, "score"), f"{flag}: cannot attach a value head ('score') to {path}")
    if reward_model is None:
        for p in value_model.score.parameters():
            torch.nn.init.zeros_(p)
    if args.gradient_checkpointing:  # HF checkpoints in train mode only: the updates switch it on
        value_model.activation_checkpointing_enable({"use_reentrant": False})
    return reward_model, value_model


# ----------------------------------------------------------------------------------------------
# Extension (off by default): the adaptive KL controller of Ziegler et al. 2019
# ----------------------------------------------------------------------------------------------
def next_beta(beta: float, kl: torch.Tensor, args: Args) -> float:
    """Step 7: the next step's KL coefficient: ``beta`` without --adaptive-kl-target, else moved by
    :func:`adaptive_kl_coef` from the mean KL per sequence of the global batch (``kl``: this
    process's (N, T) KL_t, 0 after the EOS)."""
    if args.adaptive_kl_target is None:
        return beta
    kl_per_sequence = common.all_reduce(kl.sum()).item() / args.prompts_per_step  # all processes'
    target, horizon = args.adaptive_kl_target, args.adaptive_kl_horizon
    return adaptive_kl_coef(beta, kl_per_sequence, target, args.prompts_per_step, horizon)


# ----------------------------------------------------------------------------------------------
# Scale-out and speed: micro-batches (torchrun: common.py)
# ----------------------------------------------------------------------------------------------
def make_micro_batches(indices: torch.Tensor, batch: Batch, size: int):
    """``indices`` in micro-batches of ``size`` sequences of similar completion length, each
    (idx, input_ids, attention_mask, t) trimmed of the padding it does not need (left of its longest
    prompt, right of its longest completion: the completions fill the last t columns). The losses
    are sums over sequences, so the grouping changes no result, only the time spent on padding."""
    mask, P = batch.completion_mask, batch.prompt_width
    order = indices[torch.argsort(mask[indices].sum(1), descending=True, stable=True)]
    for idx in order.split(size):
        first = int(batch.attention_mask[idx, :P].any(0).float().argmax())  # first real column
        t = int(mask[idx].sum(1).max())
        yield idx, batch.input_ids[idx, first : P + t], batch.attention_mask[idx, first : P + t], t


# ----------------------------------------------------------------------------------------------
# TRY NOT TO MODIFY: run plumbing (validation, resume, metrics, logging, checkpoints)
# ----------------------------------------------------------------------------------------------
SCRIPT = "ppo_lm.py"  # written into checkpoints: --resume refuses another script's
# the flags a resumed run cannot change: its directory, data, objective, weights' shapes
FROZEN = ("model_name_or_path", "runs_dir", "run_name", "task", "dataset", "prompt_field",
          "answer_field", "eval_size", "max_prompt_length", "system_prompt", "response_prefix",
          "reward_fn", "reward_weights", "reward_model_path", "lora_rank", "lora_alpha",
          "lora_target_modules")  # fmt: skip
# ppo_loss's sums, added over the micro-batches of a step
SUMMED = ("policy_loss", "value_loss", "tokens", "clipped", "value_clipped", "approx_kl", "entropy")


def validate(args: Args) -> None:
    """One-line errors (:class:`UsageError`, naming the flag) for flag values that cannot work,
    before anything loads: each flag's own constraint and the rules both LM scripts share
    (``common.check_flags``, ``tasks.check_task_flags``), then PPO's."""
    common.check_flags(Args, dataclasses.asdict(args))
    prompt_flags = (args.prompt_field, args.answer_field, args.system_prompt, args.response_prefix)
    tasks.check_task_flags(args.reward_fn, args.reward_weights, *prompt_flags)
    two = "--reward-fn and --reward-model-path are two rewards: pick one"
    check(not (args.reward_fn and args.reward_model_path), two)
    prompts, world, minibatches = args.prompts_per_step, common.world_size(), args.num_minibatches
    divisible = f"must be divisible by --num-minibatches {minibatches}"
    check(prompts % minibatches == 0, f"--prompts-per-step {prompts} {divisible}")
    needs_beta = "--adaptive-kl-target needs --beta > 0 (the controller scales beta)"
    check(args.adaptive_kl_target is None or args.beta > 0, needs_beta)
    processes = f"the world size {world} (the number of torchrun processes)"
    check(prompts % world == 0, f"--prompts-per-step {prompts} must be divisible by {processes}")
    per_process = f"--prompts-per-step {prompts} / world size {world} = {prompts // world}"
    check(prompts // world % minibatches == 0, f"{per_process} prompts per process {divisible}")


def restore(checkpoint: dict | None, args: Args, policy, value_model, optimizer):
    """Resume: the checkpoint's weights and optimizer state, whose hyperparameters the flags given
    now set again (--learning-rate, --value-learning-rate, --adam-eps, --weight-decay). Returns the
    step to start from and its KL coefficient: with --adaptive-kl-target on resume the controller's
    saved value, else --beta (0 and --beta without a checkpoint). The frozen flags make the
    shapes agree."""
    if checkpoint is None:
        return 0, args.beta
    common.load_trained_weights(policy, checkpoint["policy"])  # the same models: the weights fit
    value_model.load_state_dict(checkpoint["value_model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    lrs = (args.learning_rate, args.value_learning_rate or args.learning_rate)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group.update(lr=lr, eps=args.adam_eps, weight_decay=args.weight_decay)
    return checkpoint["step"], checkpoint["kl_coef"] if args.adaptive_kl_target else args.beta


def step_metrics(args, batch, scores, kl, beta, loss_stats, grad_norms, t0, gen_time, t2) -> dict:
    """A step's logged scalars over the global batch (gathered from every process): ``reward/mean``
    is the score before the missing-EOS penalty, ``reward/score`` after it, ``reward/non_score`` the
    summed -beta * KL_t; ``loss/*`` means over the updates or over the tokens of every micro-batch.
    ``loss_stats``: :func:`ppo_loss`'s of each micro-batch; ``grad_norms``: each update's gradient
    norms; ``t0``, ``gen_time``, ``t2``: the step's start, step 1's seconds and step 6's start."""
    mask = batch.completion_mask
    non_score = (-beta * kl).sum(1).cpu()
    kl_sum = common.all_reduce(kl.sum()).item()  # every process's; kl is 0 after each EOS
    rewards_task, correct, scores, non_score, lengths, truncated = (
        common.all_gather(x.float().cpu())
        for x in (batch.score, batch.correct, scores, non_score, mask.sum(1), batch.truncated)
    )
    sums = torch.tensor([sum(float(s[k]) for s in loss_stats) for k in SUMMED])
    totals = dict(zip(SUMMED, common.all_reduce(sums).tolist(), strict=True))
    ratio_max = torch.tensor(max(float(s["ratio_max"]) for s in loss_stats))
    tokens, now = max(totals["tokens"], 1), time.time()
    norms = [sum(float(n[k]) for n in grad_norms) / len(grad_norms) for k in (0, 1)]
    return {
        "reward/mean": rewards_task.mean().item(),
        "reward/std": rewards_task.std().item(),
        "reward/accuracy": correct.mean().item(),
        "reward/score": scores.mean().item(),
        "reward/non_score": non_score.mean().item(),
        "reward/total": (scores + non_score).mean().item(),
        "loss/policy": totals["policy_loss"] / len(grad_norms),
        "loss/value": totals["value_loss"] / len(grad_norms),
        "loss/kl": kl_sum / max(lengths.sum().item(), 1),
        "loss/clip_fraction": totals["clipped"] / tokens,
        "loss/value_clip_fraction": totals["value_clipped"] / tokens,
        "loss/approx_kl": totals["approx_kl"] / tokens,
        "loss/entropy": totals["entropy"] / tokens,
        "loss/ratio_max": common.all_reduce(ratio_max, "max").item(),
        "kl/sequence_mean": kl_sum / args.prompts_per_step,
        "kl/beta": beta,
        "completion/length_mean": lengths.float().mean().item(),
        "completion/frac_truncated": truncated.float().mean().item(),
        "optim/grad_norm": norms[0],
        "optim/value_grad_norm": norms[1],
        "time/generation_s": gen_time,
        "time/training_s": now - t0 - gen_time,
        "time/update_s_per_epoch": (now - t2) / args.num_ppo_epochs,
        "time/step_s": now - t0,
        **common.peak_memory_gb(kl.device),
        **common.reward_fn_means(batch.reward_fns),
    }


def value_metrics(values: torch.Tensor, returns: torch.Tensor, valid: torch.Tensor) -> dict:
    """``value/*``: the mean value and return over every process's valid tokens, and the explained
    variance ``1 - Var(R - V) / Var(R)`` (NaN when the returns do not vary)."""
    # each process has its own number of valid tokens: gathered as objects, any length
    gathered = (torch.cat(common.all_gather_objects([x[valid].cpu()])) for x in (returns, values))
    returns, values = gathered  # every process's valid tokens
    explained = (
        (1 - (returns - values).var() / returns.var()).item() if returns.var() > 0 else float("nan")
    )
    mean = {"value/mean": values.mean().item(), "value/returns_mean": returns.mean().item()}
    return mean | {"value/explained_variance": explained}


def save_checkpoint(log, step: int, args: Args, policy, value_model, optimizer, beta) -> None:
    """Every --save-every steps and at the end (rank 0), atomically: what resume needs to continue
    exactly (the next step's beta included; not the reference, which resume loads from
    --model-name-or-path, which cannot change)."""
    due = (args.save_every and step % args.save_every == 0) or step == args.total_steps
    if log.is_main and due:
        state = dict(script=SCRIPT, step=step, args=dataclasses.asdict(args), kl_coef=beta)
        state |= dict(policy=common.trained_weights(policy), value_model=value_model.state_dict())
        state |= dict(optimizer=optimizer.state_dict(), rng=common.rng_state())
        common.atomic_save(state, log.checkpoint)


def sample_lines(batch: Batch) -> list[str]:
    """Rank 0's first four completions with their scores, for the printed and logged samples."""
    first_four = list(zip(batch.score, batch.examples, batch.completions, strict=True))[:4]
    return [f"[reward {r:.2f}] {ex['question']!r} -> {c!r}" for r, ex, c in first_four]


def cli(argv: list[str] | None = None) -> None:
    """The command line (``python ppo_lm.py --help``): bad input ends in one ``error: ...`` line and
    exit code 2."""
    common.run_cli(lambda: main(common.parse_args(Args, argv, SCRIPT)))


if __name__ == "__main__":
    cli()
