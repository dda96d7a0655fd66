"""Group Relative Policy Optimization (GRPO) for language models, in one file.

Read beside DeepSeekMath (Shao et al. 2024, arXiv 2402.03300), §4.1:
for each question q sample a group of G outputs {o_1..o_G} from the old policy pi_old, score them,
use the group-normalised reward as the advantage of every token (outcome supervision, §4.1.2),
and maximise the clipped surrogate with a k3 KL penalty to a frozen reference model (eq. 3, 4):

  J(theta) = E[ 1/G sum_i 1/|o_i| sum_t { min(ratio_it * A_it, clip(ratio_it, 1-eps, 1+eps) * A_it)
                                          - beta * KL_it } ],
  ratio_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t),
  KL_it    = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1                                     (eq. 4)

No value model. Usage:  python grpo_lm.py --group-size 8        (see --help for every flag)
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import common
from common import UsageError, check


@dataclass
class Args:
    # --- experiment ---
    exp_name: str = "grpo_lm"
    """name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment: prompts, sampling and initialisation all flow from it"""
    runs_dir: str = "runs"
    """TensorBoard logs, args and checkpoints go to {runs_dir}/{run_name}/"""
    run_name: str | None = None
    """run directory name (default: {task}__{exp_name}__{seed}__{unix time})"""
    device: str = "auto"
    """'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'"""
    # --- models ---
    model_name_or_path: str = common.DEFAULT_MODEL
    """policy to train: a local directory or Hub id of a causal LM (default: offline SmolLM2-135M-Instruct)"""
    reward_model_path: str | None = None
    """frozen sequence-classification reward model scored at the last token (default: the task's verifiable reward)"""
    # --- task ---
    task: str = "addition"
    """built-in verifiable task: 'addition' ("What is a + b?" with two-digit a, b)"""
    dataset: str | None = None
    """GSM8K-format JSONL file ('question', 'answer' ending in '#### N'); overrides --task"""
    format_reward: float = 0.0
    """extra reward for a completion that ends with a number (0 = off)"""
    # --- sampling ---
    total_steps: int = 30
    """number of exploration stages (sample a batch, then --mu policy updates)"""
    prompts_per_step: int = 4
    """questions sampled per step; each gets --group-size completions"""
    group_size: int = 8
    """G: completions sampled per question (DeepSeekMath used 64)"""
    max_new_tokens: int = 64
    """maximum completion length in tokens"""
    max_prompt_length: int = 512
    """prompts longer than this many tokens are dropped from the training set"""
    temperature: float = 0.7
    """sampling temperature; log probs use the same logits / temperature"""
    top_p: float = 1.0
    """nucleus sampling (1.0 = sample from the full distribution, which the ratio assumes)"""
    # --- optimisation (DeepSeekMath eq. 3) ---
    learning_rate: float = 1e-5
    """AdamW learning rate (the paper's 1e-6 barely moves a 135M model in 30 steps)"""
    beta: float = 0.04
    """KL coefficient beta of the k3 penalty to the reference model (0 = no reference model)"""
    clip_range: float = 0.2
    """eps of the clipped surrogate"""
    mu: int = 1
    """policy updates per exploration stage (GRPO iterations of Algorithm 1)"""
    micro_batch_size: int = 8
    """sequences per forward/backward pass; gradients are accumulated over the whole batch"""
    max_grad_norm: float = 1.0
    """global gradient-norm clipping"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adv_eps: float = 1e-4
    """added to the group std: a group with equal rewards gets advantage 0, never NaN"""
    # --- logging, evaluation, checkpoints ---
    eval_every: int = 10
    """greedy held-out accuracy every N steps (and at the start and end; 0 = only start and end)"""
    eval_size: int = 128
    """held-out questions for greedy accuracy"""
    eval_batch_size: int = 64
    """questions per greedy generation batch during evaluation"""
    sample_every: int = 5
    """print and log sample completions every N steps"""
    save_every: int = 10
    """write a checkpoint every N steps (and at the end)"""
    resume: str | None = None
    """checkpoint.pt to continue from (same flags, same results)"""
    torch_threads: int = 0
    """CPU threads for torch (0 = torch's default)"""


# ----------------------------------------------------------------------------------------------
# ALGO LOGIC: the pieces of DeepSeekMath §4.1, in the order the loop below uses them
# ----------------------------------------------------------------------------------------------
def completion_mask(completion_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Mask of the tokens of each completion up to and including its first EOS.

    Args:
        completion_ids: (B, T) sampled token ids; whatever follows the first EOS is padding.
    Returns:
        (B, T) float mask, 1 for real completion tokens (the EOS included), 0 after it.
    """
    is_eos = completion_ids == eos_token_id
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos.long()  # number of EOS strictly before t
    return (eos_before == 0).float()


def token_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion_tokens: int,
                    temperature: float) -> torch.Tensor:
    """Log probs of the last ``T`` tokens of each sequence under ``model`` at ``temperature``.

    Logits are computed only for the completion positions (``logits_to_keep``), so at most
    (B, T, V) logits exist at once; position ids count real tokens only, as in generation.

    Args:
        input_ids: (B, P + T) left-padded prompt followed by the completion.
        attention_mask: (B, P + T) 1 for real tokens.
        num_completion_tokens: T.
    Returns:
        (B, T) ``log softmax(logits / temperature)`` gathered at the sampled tokens.
    """
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=num_completion_tokens + 1, use_cache=False).logits
    logits = logits[:, :-1].float() / temperature  # logits at t predict token t + 1
    targets = input_ids[:, -num_completion_tokens:]
    return torch.gather(logits.log_softmax(-1), 2, targets.unsqueeze(-1)).squeeze(-1)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """Outcome-supervision advantages (DeepSeekMath §4.1.2): ``(r_i - mean(r)) / (std(r) + eps)``.

    Mean and (unbiased) std are taken over the G outputs of the same question. A group whose
    rewards are all equal gets advantage 0: it carries no signal about which output is better.

    Args:
        rewards: (B * G,) one scalar per completion, the G completions of a question contiguous.
    Returns:
        (B * G,) advantage of every completion, shared by all its tokens.
    Raises:
        ValueError: ``rewards`` cannot be split into groups of ``group_size``.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    mean, std = grouped.mean(1, keepdim=True), grouped.std(1, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(-1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref) (DeepSeekMath eq. 4; Schulman 2020).

    ``pi_ref/pi - log(pi_ref/pi) - 1``: unbiased, always >= 0, and 0 where the log probs agree.

    Args:
        logp, ref_logp: (B, T) log probs of the sampled tokens under the policy and reference.
    Returns:
        (B, T) per-token KL estimates.
    """
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None, advantages: torch.Tensor,
              mask: torch.Tensor, clip_range: float, beta: float, num_sequences: int):
    """Negative GRPO objective (DeepSeekMath eq. 3) of a micro-batch, for gradient accumulation.

    Per token: ``min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) - beta * KL``; per sequence the
    mean over its ``|o_i|`` valid tokens; the sum over the micro-batch divided by the number of
    sequences in the whole batch, so the micro-batch losses add up to ``-J``.

    Args:
        logp: (b, T) log probs under the policy being trained (with grad).
        old_logp: (b, T) log probs under pi_old, the policy that sampled the batch.
        ref_logp: (b, T) log probs under the reference model, or None when ``beta == 0``.
        advantages: (b,) one advantage per sequence, broadcast to its tokens.
        mask: (b, T) 1 for completion tokens up to and including the first EOS.
        num_sequences: B * G, sequences in the whole batch.
    Returns:
        (loss, stats): the scalar loss and a dict of detached per-token statistics.
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(1)
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_range, 1 + clip_range) * adv)
    per_token = surrogate
    kl = k3_kl(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
    if beta:
        per_token = per_token - beta * kl  # KL in the loss, not in the reward (§4.1.1)
    lengths = mask.sum(1).clamp(min=1)  # |o_i|
    per_sequence = (per_token * mask).sum(1) / lengths
    loss = -per_sequence.sum() / num_sequences
    with torch.no_grad():
        clipped = ((adv > 0) & (ratio > 1 + clip_range)) | ((adv < 0) & (ratio < 1 - clip_range))
        valid = mask.bool()
        stats = {
            "kl": (kl * mask).sum(), "clipped": (clipped.float() * mask).sum(), "tokens": mask.sum(),
            "ratio_min": ratio[valid].min() if valid.any() else ratio.new_tensor(1.0),
            "ratio_max": ratio[valid].max() if valid.any() else ratio.new_tensor(1.0),
        }
    return loss, stats


# ----------------------------------------------------------------------------------------------
# TRY NOT TO MODIFY: set-up, generation, reward plumbing, logging, checkpoints
# ----------------------------------------------------------------------------------------------
def validate(args: Args) -> None:
    """One-line errors for flag values that cannot work."""
    check(args.group_size >= 2, "--group-size must be >= 2: group-relative advantages need at least two outputs")
    for flag in ("total_steps", "prompts_per_step", "max_new_tokens", "max_prompt_length", "mu",
                 "micro_batch_size", "eval_size", "eval_batch_size"):
        check(getattr(args, flag) > 0, f"--{flag.replace('_', '-')} must be a positive integer")
    check(args.temperature > 0, "--temperature must be > 0")
    check(0 < args.top_p <= 1, "--top-p must be in (0, 1]")
    check(args.beta >= 0, "--beta must be >= 0")
    check(0 < args.clip_range < 1, "--clip-range must be in (0, 1)")
    check(args.learning_rate > 0, "--learning-rate must be > 0")
    check(args.task == "addition" or args.dataset is not None, f"--task: unknown task {args.task!r}; built in: 'addition' (or use --dataset)")


def make_task(args: Args) -> common.Task:
    if args.dataset is not None:
        return common.load_gsm8k_jsonl(args.dataset, args.eval_size, args.format_reward)
    return common.make_addition_task(args.eval_size, args.format_reward)


def save_checkpoint(path: Path, policy, optimizer, step: int, args: Args, reference=None) -> None:
    common.atomic_save({"policy": policy.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                        "args": dataclasses.asdict(args), "rng": common.get_rng_state(),
                        "reference": reference.state_dict() if reference is not None else None}, path)


def main(args: Args, task: common.Task | None = None) -> dict:
    """Train with GRPO; returns the per-step history of logged scalars (for tests and notebooks).

    ``task`` replaces the built-in task: any :class:`common.Task` with your own reward function.
    """
    validate(args)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else torch.device(args.device)
    checkpoint = common.load_checkpoint(args.resume) if args.resume else None
    common.seed_everything(args.seed)

    tokenizer = common.load_tokenizer(args.model_name_or_path)
    policy = common.load_model(args.model_name_or_path, device=device).eval()  # dropout is off everywhere
    # Reference model: a frozen copy of the initial policy (§4.1.1); not needed at all when beta = 0.
    reference = None
    if args.beta > 0:
        reference = common.load_model(args.model_name_or_path, device=device).eval().requires_grad_(False)
    reward_model = None
    if args.reward_model_path:
        reward_model = common.load_model(args.reward_model_path, kind="reward", device=device,
                                         flag="--reward-model-path").eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)

    task = task or make_task(args)
    prompt_lengths = [len(ids) for ids in tokenizer([common.build_prompt(tokenizer, ex["question"]) for ex in task.train],
                                                    add_special_tokens=False)["input_ids"]]
    train = [ex for ex, n in zip(task.train, prompt_lengths) if n <= args.max_prompt_length]
    check(len(train) >= args.prompts_per_step, f"--max-prompt-length {args.max_prompt_length}: only {len(train)} "
          f"training prompts fit, fewer than --prompts-per-step {args.prompts_per_step}")

    start_step = 0
    if checkpoint is not None:
        policy.load_state_dict(checkpoint["policy"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        if reference is not None and checkpoint.get("reference") is not None:
            reference.load_state_dict(checkpoint["reference"])
        start_step = checkpoint["step"]
        run_dir = Path(args.resume).parent
    else:
        run_dir = Path(args.runs_dir) / (args.run_name or common.make_run_name(args.exp_name, args))
    writer = common.make_writer(run_dir, args)
    ckpt_path = run_dir / "checkpoint.pt"
    history: dict[str, list[float]] = {}

    def log(step: int, scalars: dict) -> None:
        for key, value in scalars.items():
            writer.add_scalar(key, value, step)
            history.setdefault(key, []).append(float(value))

    if checkpoint is not None:
        common.set_rng_state(checkpoint["rng"])  # last: loading models above must not shift the RNG
    elif args.eval_size:
        accuracy, _ = common.greedy_accuracy(policy, tokenizer, task.test[: args.eval_size], task.correct_fn,
                                                  args.max_new_tokens, args.eval_batch_size, device)
        log(0, {"eval/accuracy": accuracy})
        print(f"step 0: held-out greedy accuracy {accuracy:.3f}")

    G, N = args.group_size, args.prompts_per_step * args.group_size
    progress = tqdm(range(start_step, args.total_steps), initial=start_step, total=args.total_steps, desc="grpo")
    step = start_step
    try:
        for step in progress:
            # ---- 1. Sample G outputs per question from pi_old = the current policy (Algorithm 1) ----
            t0 = time.time()
            picks = np.random.default_rng([args.seed, step]).choice(len(train), args.prompts_per_step, replace=False)
            examples = [train[i] for i in picks for _ in range(G)]  # the G outputs of a question are contiguous
            prompts = [common.build_prompt(tokenizer, ex["question"]) for ex in examples]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            with torch.no_grad():
                sequences = policy.generate(**enc, do_sample=True, temperature=args.temperature, top_p=args.top_p,
                                            top_k=0, max_new_tokens=args.max_new_tokens,
                                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            P = enc["input_ids"].shape[1]
            completion_ids = sequences[:, P:]
            mask = completion_mask(completion_ids, tokenizer.eos_token_id)  # (N, T): nothing after the first EOS
            completion_ids = torch.where(mask.bool(), completion_ids, tokenizer.pad_token_id)
            input_ids = torch.cat([enc["input_ids"], completion_ids], 1)
            attention_mask = torch.cat([enc["attention_mask"], mask.long()], 1)
            T = completion_ids.shape[1]
            gen_time = time.time() - t0

            # ---- 2. Rewards: verifiable reward function or frozen reward model ----
            completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            if reward_model is not None:
                rewards = torch.cat([common.reward_model_scores(reward_model, input_ids[i: i + args.micro_batch_size],
                                                         attention_mask[i: i + args.micro_batch_size]).cpu()
                                     for i in range(0, N, args.micro_batch_size)])
            else:
                rewards = common.score_completions(task, completions, examples)
            correct = torch.tensor([float(task.correct_fn(c, ex)) for c, ex in zip(completions, examples)])

            # ---- 3. Outcome supervision: A_i,t = (r_i - mean(r)) / std(r) for every token t (§4.1.2) ----
            advantages = group_advantages(rewards, G, args.adv_eps).to(device)

            # ---- 4. Old and reference log probs of the sampled tokens (no grad) ----
            # Micro-batches hold sequences of similar completion length, each trimmed to its own longest
            # prompt and completion: the loss is a sum over sequences, so grouping only saves padding.
            t1 = time.time()
            order = torch.argsort(mask.sum(1), descending=True, stable=True)
            micro_batches = []
            for i in range(0, N, args.micro_batch_size):
                idx = order[i: i + args.micro_batch_size]
                first = int(attention_mask[idx, :P].any(0).float().argmax())  # first column with a real token
                t_mb = int(mask[idx].sum(1).max())
                micro_batches.append((idx, input_ids[idx, first: P + t_mb], attention_mask[idx, first: P + t_mb], t_mb))
            old_logp = torch.zeros(N, T, device=device)
            ref_logp = torch.zeros(N, T, device=device) if reference is not None else None
            with torch.no_grad():
                for idx, ids, att, t_mb in micro_batches:
                    if args.mu > 1:  # with mu = 1 pi_old = pi_theta, so ratio = 1: reuse logp.detach() below
                        old_logp[idx, :t_mb] = token_log_probs(policy, ids, att, t_mb, args.temperature)
                    if reference is not None:
                        ref_logp[idx, :t_mb] = token_log_probs(reference, ids, att, t_mb, args.temperature)

            # ---- 5. mu GRPO iterations: maximise eq. 3 over the batch (gradient accumulation) ----
            totals = {"loss": 0.0, "kl": 0.0, "clipped": 0.0, "tokens": 0.0, "ratio_min": math.inf, "ratio_max": -math.inf}
            for _ in range(args.mu):
                optimizer.zero_grad(set_to_none=True)
                for idx, ids, att, t_mb in micro_batches:
                    logp = token_log_probs(policy, ids, att, t_mb, args.temperature)
                    old = old_logp[idx, :t_mb] if args.mu > 1 else logp.detach()
                    ref = ref_logp[idx, :t_mb] if ref_logp is not None else None
                    loss, stats = grpo_loss(logp, old, ref, advantages[idx], mask[idx, :t_mb], args.clip_range, args.beta, N)
                    if not torch.isfinite(loss):
                        raise UsageError(f"non-finite loss at step {step + 1}; lower --learning-rate "
                                         f"(the last checkpoint and {ckpt_path.name} are intact)")
                    loss.backward()
                    totals["loss"] += loss.item()
                    for key in ("kl", "clipped", "tokens"):
                        totals[key] += stats[key].item()
                    totals["ratio_min"] = min(totals["ratio_min"], stats["ratio_min"].item())
                    totals["ratio_max"] = max(totals["ratio_max"], stats["ratio_max"].item())
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                optimizer.step()
            train_time = time.time() - t1

            # ---- logging ----
            lengths = mask.sum(1)
            truncated = (mask[:, -1] == 1) & (completion_ids[:, -1] != tokenizer.eos_token_id)
            scalars = {
                "reward/mean": rewards.mean().item(), "reward/std": rewards.std().item(),
                "reward/accuracy": correct.mean().item(),
                "reward/frac_zero_std_groups": (rewards.view(-1, G).std(1) == 0).float().mean().item(),
                "loss/policy": totals["loss"] / args.mu, "loss/kl": totals["kl"] / max(totals["tokens"], 1),
                "loss/clip_fraction": totals["clipped"] / max(totals["tokens"], 1),
                "loss/ratio_min": totals["ratio_min"], "loss/ratio_max": totals["ratio_max"],
                "completion/length_mean": lengths.mean().item(), "completion/frac_truncated": truncated.float().mean().item(),
                "optim/grad_norm": grad_norm.item(), "optim/learning_rate": optimizer.param_groups[0]["lr"],
                "time/generation_s": gen_time, "time/training_s": train_time,
                "time/tokens_per_s": lengths.sum().item() / (time.time() - t0),
                **common.peak_memory_gb(device),
            }
            log(step + 1, scalars)
            progress.set_postfix(reward=f"{scalars['reward/mean']:.3f}", kl=f"{scalars['loss/kl']:.4f}",
                                 len=f"{scalars['completion/length_mean']:.1f}")

            if args.sample_every and (step + 1) % args.sample_every == 0:
                text = "\n".join(f"[reward {rewards[j]:.2f}] {examples[j]['question']!r} -> {completions[j]!r}"
                                 for j in range(0, N, G))
                tqdm.write(f"--- step {step + 1} samples ---\n{text}")
                writer.add_text("samples", text.replace("\n", "  \n"), step + 1)
            last = step + 1 == args.total_steps
            if args.eval_size and ((args.eval_every and (step + 1) % args.eval_every == 0) or last):
                accuracy, _ = common.greedy_accuracy(policy, tokenizer, task.test[: args.eval_size], task.correct_fn,
                                                  args.max_new_tokens, args.eval_batch_size, device)
                log(step + 1, {"eval/accuracy": accuracy})
                tqdm.write(f"step {step + 1}: held-out greedy accuracy {accuracy:.3f}")
            if (args.save_every and (step + 1) % args.save_every == 0) or last:
                save_checkpoint(ckpt_path, policy, optimizer, step + 1, args, reference)
    except (UsageError, KeyboardInterrupt):
        writer.close()
        raise
    writer.close()
    if args.total_steps > start_step:
        policy.save_pretrained(run_dir / "final_model")
        tokenizer.save_pretrained(run_dir / "final_model")
        print(f"saved {ckpt_path} and {run_dir / 'final_model'} (load it with from_pretrained)")
    return history


if __name__ == "__main__":
    common.run_cli(lambda: main(common.parse_args(Args)))
