"""Same-budget comparisons of grpo_lm.py variants on SmolLM2-135M-Instruct.

    python benchmarks/grpo_variants.py --steps 30                        # all five presets below
    python benchmarks/grpo_variants.py --steps 30 --variants outcome,process
    python benchmarks/grpo_variants.py --steps 3 --eval-size 32 --torch-threads 1 -- --max-new-tokens 48

Presets (every run shares the flags in COMMON; the rest of the flags are the preset's):
  outcome, process  --task multistep ("Compute (a + b) * c - d"), outcome vs process supervision (§4.1.2 / §4.1.3)
  grpo, dr_grpo, dapo   --task addition: paper GRPO; Dr. GRPO (sum / (B * L_max), unscaled advantages);
                    DAPO (token-level loss, clip-higher 0.28, overlong buffer 16, no KL)
  dapo_ds           DAPO with dynamic sampling too (more generation per step: not the same sampling budget)

Each preset runs grpo_lm.py as a subprocess; the script then reads its TensorBoard scalars and writes
one markdown table (held-out greedy accuracy before/after, mean reward first/last steps, seconds per
step) plus the per-step reward curves, the exact commands and the machine, to --out.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from grpo_addition import (  # same helpers as the addition benchmark
    machine,
    read_scalars,
)

COMMON = ["--group-size", "8", "--prompts-per-step", "4", "--learning-rate", "1e-5", "--temperature", "0.7",
          "--sample-every", "5", "--save-every", "0"]
PRESETS = {
    "outcome": ["--task", "multistep", "--max-new-tokens", "96", "--supervision", "outcome"],
    "process": ["--task", "multistep", "--max-new-tokens", "96", "--supervision", "process"],
    "grpo": ["--task", "addition", "--max-new-tokens", "64"],
    "dr_grpo": ["--task", "addition", "--max-new-tokens", "64", "--loss-type", "dr_grpo", "--scale-rewards", "none"],
    "dapo": ["--task", "addition", "--max-new-tokens", "64", "--loss-type", "dapo", "--clip-range-high", "0.28",
             "--overlong-buffer", "16", "--beta", "0"],
    "dapo_ds": ["--task", "addition", "--max-new-tokens", "64", "--loss-type", "dapo", "--clip-range-high", "0.28",
                "--overlong-buffer", "16", "--beta", "0", "--dynamic-sampling"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="--total-steps of every run")
    parser.add_argument("--variants", default="outcome,process,grpo,dr_grpo,dapo",
                        help=f"comma-separated presets out of {','.join(PRESETS)}")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--eval-size", type=int, default=128, help="held-out problems for greedy accuracy")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--torch-threads", type=int, default=0, help="passed to grpo_lm.py (0 = torch's default)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "grpo_variants_results.md"))
    parser.add_argument("--runs-dir", default=str(ROOT / "benchmarks" / "out"))
    parser.add_argument("--note", default="", help="a paragraph written under the title (e.g. why the budget is small)")
    parser.add_argument("extra", nargs="*", help="extra grpo_lm.py flags for every run, after --")
    opts = parser.parse_args()
    variants = opts.variants.split(",")
    unknown = [v for v in variants if v not in PRESETS]
    if unknown:
        parser.error(f"--variants: unknown preset(s) {', '.join(unknown)}; choose from {', '.join(PRESETS)}")

    rows, curves, commands = [], [], []
    stamp = int(time.time())
    for name in variants:
        run_name = f"grpo_variants_{name}_seed{opts.seed}_{stamp}"
        cmd = [sys.executable, "grpo_lm.py", "--total-steps", str(opts.steps), *COMMON, *PRESETS[name],
               "--eval-size", str(opts.eval_size), "--eval-every", str(opts.eval_every), "--seed", str(opts.seed),
               "--torch-threads", str(opts.torch_threads), "--runs-dir", opts.runs_dir, "--run-name", run_name, *opts.extra]
        shown = " ".join(c if c != sys.executable else "python" for c in cmd)
        print(shown, flush=True)
        commands.append(f"- {name}: `{shown}`")
        start = time.time()
        subprocess.run(cmd, cwd=ROOT, check=True)
        wall = time.time() - start
        s = read_scalars(Path(opts.runs_dir) / run_name)
        acc = s["eval/accuracy"]
        rewards = [v for _, v in s["reward/accuracy"]]  # verifiable accuracy of the samples (comparable across shaping)
        step_s = [g + t for (_, g), (_, t) in zip(s["time/generation_s"], s["time/training_s"])]
        k = max(1, len(rewards) // 3)
        extra = ""
        if "process/step_reward_mean" in s:
            steps = [v for _, v in s["process/step_reward_mean"]]
            extra = f"checked steps correct: {steps[0]:.2f} -> {steps[-1]:.2f}"
        rows.append(f"| {name} | {acc[0][1]:.3f} | {acc[-1][1]:.3f} (step {acc[-1][0]}) | "
                    + f"{sum(rewards[:k]) / k:.3f} -> {sum(rewards[-k:]) / k:.3f} | {sum(step_s) / len(step_s):.0f} | "
                    + f"{wall / 60:.1f} | {extra} |")
        curves.append(f"{name:8s} " + " ".join(f"{r:.2f}" for r in rewards))

    lines = [
        "# grpo_lm.py variants on SmolLM2-135M-Instruct",
        "",
        *([opts.note, ""] if opts.note else []),
        (f"Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}. Budget: {opts.steps} steps per run, "
         f"4 questions x G=8 per step, held-out greedy accuracy on {opts.eval_size} problems."),
        "",
        "| variant | held-out accuracy, step 0 | held-out accuracy, end | sample accuracy, first third -> last third | s/step | wall (min) | notes |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Sample accuracy (fraction of the 32 completions with the right final number) per step:",
        "",
        "```",
        *curves,
        "```",
        "",
        "Commands (from the repository root):",
        "",
        *commands,
    ]
    Path(opts.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
