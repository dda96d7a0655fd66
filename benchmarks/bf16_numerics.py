"""How much bf16 rounding moves GRPO's log probs, on the CPU's bf16 autocast (CUDA's stand-in).

Issue 13 ("Trust I") items 4 and 5. A policy a hair away from its reference (every weight moved by
--perturbation times its tensor's std, in a fixed random direction) samples completions in float32;
then the sampled tokens' log probs are computed

  * in float32 (the truth),
  * under bf16 autocast with the model's own head (logits rounded to bf16: the old token_log_probs),
  * under bf16 autocast with grpo_lm.token_log_probs (body in bf16, LM head and log-softmax in
    float32),

and the per-token k3 KL between policy and reference (DeepSeekMath eq. 4) is read off each, with the
RoPE angle error of an inv_freq cast to bf16.

    python benchmarks/bf16_numerics.py              # SmolLM2-135M-Instruct, GSM8K questions
    python benchmarks/bf16_numerics.py --model-name-or-path DIR --prompts 8

Prints a Markdown table (and writes it with --out).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import grpo_lm  # noqa: E402
import tasks  # noqa: E402


def perturbed(model, scale: float, seed: int):
    """A copy of ``model`` with every floating parameter moved by ``scale * std(param)`` in a random
    direction."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.float().std().nan_to_num(0.0) * scale)
    return out


def log_probs(model, batch, temperature: float, mode: str) -> torch.Tensor:
    """(N, T) log probs of the sampled tokens: mode 'fp32', 'bf16_head' (autocast, bf16 logits) or
    'fp32_head'."""
    if mode == "bf16_head":
        return forward_log_probs(model, batch, temperature, autocast=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "fp32_head"):
        mb = grpo_lm.MicroBatch(*batch)
        return grpo_lm.token_log_probs(model, mb, temperature, share_prompt=False)


def forward_log_probs(model, batch, temperature: float, autocast: bool = False) -> torch.Tensor:
    """(N, T) log probs of the sampled tokens from the model's own forward and head (with
    ``autocast``, under CPU bf16 autocast), as a sampler computes them; the log-softmax in
    float32."""
    prompt_ids, prompt_mask, index, completions, att = batch
    attention_mask = torch.cat([prompt_mask[index], att], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(
            input_ids=torch.cat([prompt_ids[index], completions], 1),
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=completions.shape[1] + 1,
        ).logits[:, :-1]
    return (
        (logits.float() / temperature)
        .log_softmax(-1)
        .gather(2, completions.unsqueeze(-1))
        .squeeze(-1)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-name-or-path", default=common.DEFAULT_MODEL)
    parser.add_argument(
        "--dataset",
        default=str(Path(__file__).resolve().parents[2] / "shared/data/gsm8k/train.jsonl"),
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument(
        "--shots",
        type=int,
        default=0,
        help="worked examples (GSM8K solutions) before each question, to reach longer positions",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--perturbation", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = common.load_tokenizer(args.model_name_or_path)
    reference = common.load_model(args.model_name_or_path).eval()
    policy = perturbed(reference, args.perturbation, args.seed).eval()
    if Path(args.dataset).is_file():
        task = tasks.load_jsonl_task(args.dataset, num_test=args.prompts)
        source = f"GSM8K questions ({Path(args.dataset).name})"
    else:
        task = tasks.make_addition_task(num_test=args.prompts)
        source = "addition questions"
    shots = "".join(
        f"Question: {ex['question']}\nAnswer: {ex.get('solution', '')} #### {ex['answer']}\n\n"
        for ex in task.train[: args.shots]
    )
    prompts = [
        tokenizer(tasks.build_prompt(tokenizer, shots + ex["question"]), add_special_tokens=False)[
            "input_ids"
        ]
        for ex in task.test[: args.prompts]
    ]
    options = dict(temperature=args.temperature, top_p=1.0, max_new_tokens=args.max_new_tokens)
    completions = common.generate_completions(
        policy, prompts, 1, tokenizer, **options, bf16=False, seed_keys=(args.seed,)
    ).ids
    prompt_ids, prompt_mask = common.pad_left(prompts, tokenizer.pad_token_id)
    T = completions.shape[1]
    n = len(completions)
    mask = grpo_lm.completion_mask(completions, tokenizer.eos_token_id)
    completions = torch.where(mask.bool(), completions, tokenizer.pad_token_id)
    batch = (prompt_ids, prompt_mask, torch.arange(n), completions, mask.long())
    valid = mask.bool()
    positions = int(prompt_mask.sum(1).max() + T)

    def kl(logp, ref):
        return grpo_lm.kl_estimate(logp, ref)[valid].mean().item()

    truth_policy = log_probs(policy, batch, args.temperature, "fp32")
    truth_ref = log_probs(reference, batch, args.temperature, "fp32")
    rows_out = [("float32 (truth)", kl(truth_policy, truth_ref), 0.0, 0.0)]
    for mode, label in (
        ("bf16_head", "bf16 autocast, bf16 LM head (before)"),
        ("fp32_head", "bf16 autocast, float32 LM head and log-softmax (now)"),
    ):
        lp, lr = (
            log_probs(policy, batch, args.temperature, mode),
            log_probs(reference, batch, args.temperature, mode),
        )
        d = (lp - truth_policy)[valid].abs()
        rows_out.append((label, kl(lp, lr), d.mean().item(), d.max().item()))

    inv = dict(policy.named_buffers())
    inv_freq = next(v for k, v in inv.items() if k.endswith("inv_freq"))
    pos = torch.tensor(600.0)
    angle_error = (pos * inv_freq.to(torch.bfloat16).float() - pos * inv_freq).abs().max().item()

    if args.shots:
        source += f" after {args.shots} worked examples"
    lines = [
        f"Model {args.model_name_or_path}; {n} {source}, one completion each sampled at T "
        f"= {args.temperature} from the float32 policy ({int(valid.sum())} valid tokens, positions "
        f"up to {positions}); policy = reference with every weight moved by {args.perturbation} x "
        f"its tensor's std; torch {torch.__version__}, CPU bf16 autocast.",
        "",
        "| log probs | k3 KL per token (mean) | vs. truth: mean abs dlogp | max abs dlogp |",
        "|-|-|-|-|",
    ]
    lines += [f"| {label} | {k:.3g} | {m:.3g} | {x:.3g} |" for label, k, m, x in rows_out]
    lines += [
        "",
        f"RoPE angle error of a bf16 inv_freq at position 600: {angle_error:.3g} rad (largest over "
        "frequencies).",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
