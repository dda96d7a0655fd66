"""Would bfloat16 autocast pay on this CPU? The main job's pieces, float32 against bf16 (issue 24).

    python benchmarks/cpu_bf16_speed.py          # writes benchmarks/cpu_bf16_speed_results.md

On the default model (SmolLM2-135M-Instruct) and the main job's shapes before 2026-11-25 (4 addition
questions, G = 8, up to 64 new tokens, micro-batches of 8 completions sharing one prompt), it times,
float32 and then bf16 autocast (LM head and log-softmax in float32, as common.float32_lm_head
does), alternating the two and keeping each one's fastest of --repeats: the sampling of the 32
completions (``common.generate_completions``), the no-grad log-prob pass of steps 4 and the
forward + backward of step 5, and torch.multinomial against the exponential race (Gumbel-max) on one
(32, V) distribution. It reports the log-prob gap bf16 makes (|logp_bf16 - logp_fp32| per token,
the gap bf16 autocast puts between learner and float32) and the CPU's flags.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from main_job import cpu  # noqa: E402

import common  # noqa: E402
import grpo_lm  # noqa: E402
import tasks  # noqa: E402


def fastest(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "cpu_bf16_speed_results.md"))
    opts = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = common.load_tokenizer(common.DEFAULT_MODEL)
    policy = common.load_model(common.DEFAULT_MODEL).eval()
    questions = [q["question"] for q in tasks.make_addition_task(128).train[:4]]
    prompts = tasks.prompt_ids(tokenizer, questions, None, "")
    autocast = {
        "float32": contextlib.nullcontext,
        "bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    }

    def sample(kind):
        with autocast[kind]():
            # --bf16's autocast (on a CPU with AVX512-BF16), which replaces the one around it
            options = (0.7, 1.0, 64, kind == "bf16")  # temperature, top-p, new tokens, bf16
            return common.generate_completions(policy, prompts, 8, tokenizer, options, ((1, 0), 0))

    rows = sample("float32")
    T = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])
    mask = grpo_lm.completion_mask(ids, tokenizer.eos_token_id)
    ids = torch.where(mask.bool(), ids, pad)
    prompt_ids, prompt_mask = common.pad_left(prompts, pad)
    micro = [
        grpo_lm.MicroBatch(
            prompt_ids[g : g + 1],
            prompt_mask[g : g + 1],
            torch.zeros(8, dtype=torch.long),
            ids[8 * g : 8 * g + 8],
            mask[8 * g : 8 * g + 8].long(),
        )
        for g in range(4)
    ]

    def log_probs(kind, grad):
        out = []
        for mb in micro:
            with torch.set_grad_enabled(grad), autocast[kind]():
                logp = grpo_lm.token_log_probs(policy, mb, 0.7)
            if grad:
                (logp * mb.completion_mask).sum().backward()
            out.append(logp.detach())
        policy.zero_grad(set_to_none=True)
        return torch.cat(out)

    fp32, bf16 = log_probs("float32", False), log_probs("bf16", False)
    gap = (fp32 - bf16).abs()[mask.bool()]
    seconds = {}
    for _ in range(opts.repeats):  # alternate the two, each call timed once per round
        for kind in ("float32", "bf16"):
            for name, fn in [
                ("generation of 32 x <= 64 tokens", lambda k=kind: sample(k)),
                ("steps 4: no-grad log probs, 32 completions", lambda k=kind: log_probs(k, False)),
                ("step 5: forward + backward, 32 completions", lambda k=kind: log_probs(k, True)),
            ]:
                key = (name, kind)
                seconds[key] = min(seconds.get(key, float("inf")), fastest(fn, 1))
    probs = torch.softmax(torch.randn(32, policy.config.vocab_size) * 3, -1)
    race = {
        "torch.multinomial": lambda: torch.multinomial(probs, 1),
        "exponential race (Gumbel-max)": lambda: (
            probs / torch.empty_like(probs).exponential_()
        ).argmax(-1, keepdim=True),
    }
    draw = {name: fastest(fn, 50) for name, fn in race.items()}
    names = dict.fromkeys(name for name, _ in seconds)
    lines = [
        "# bfloat16 autocast on this CPU: the main job's pieces (issue 24)",
        "",
        f"CPU: {cpu()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{time.strftime('%Y-%m-%d')}. Command: `python benchmarks/cpu_bf16_speed.py`. "
        f"Fastest of {opts.repeats}, float32 and bf16 alternating; nothing else running.",
        "",
        "| piece | float32 s | bf16 autocast s | bf16 / float32 |",
        "|-|-|-|-|",
        *[
            f"| {n} | {seconds[n, 'float32']:.2f} | {seconds[n, 'bf16']:.2f} | "
            f"{seconds[n, 'bf16'] / seconds[n, 'float32']:.2f} |"
            for n in names
        ],
        "",
        f"Log-prob gap of bf16 autocast (LM head in float32) over {gap.numel()} completion tokens:"
        f" mean {gap.mean():.2e}, max {gap.max():.2e}.",
        "",
        "| one draw from a (32, V) distribution | ms |",
        "|-|-|",
        *[f"| {name} | {1000 * s:.1f} |" for name, s in draw.items()],
    ]
    Path(opts.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
