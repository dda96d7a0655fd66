"""What the issue-16 features do on SmolLM2-135M-Instruct: Countdown before and after GRPO, LoRA
against full fine-tuning.

    # held-out solve rate before and after 30 steps
    python benchmarks/grpo_features.py countdown
    # the addition run, full fine-tuning and LoRA, back to back
    python benchmarks/grpo_features.py full lora
    # rewrite the tables from finished runs
    python benchmarks/grpo_features.py --report-only

Every run uses the budget of the README's main job before 2026-11-25 (30 steps of 4 questions x
G = 8 completions, lr 1e-5, T 0.7, beta 0.04, held-out greedy accuracy on 128 questions) and changes
only what its preset says:
  full       that main job itself (addition, 64 new tokens)
  lora       the same with --lora-rank 16 (alpha 32, every linear layer but the LM head) and lr
             1e-4 (adapters start at zero and need a larger step: LoRA's usual 10x)
  countdown  examples/countdown.py's problems (written once to benchmarks/out/countdown.jsonl),
             rewarded by its `correct` + 0.1 x examples/think_format.py's `format_reward`, the
             think/answer system prompt and --response-prefix "<think>", 128 new tokens (room to
             reason); close to `--task countdown --answer-format think --format-reward 0.1`
             before issue 39, but the held-out split differs and the logged accuracy is the proxy
             of examples/README.md (the last number of the <answer> block equals the target)

Each preset runs grpo_lm.py as a subprocess into benchmarks/out/grpo_features_{preset}_seed{seed}; a
rerun skips finished runs. Runs made for a timing comparison must not share the machine with other
work: run them alone, one after the other. The tables, the exact commands and the machine go to
--out.
"""

from __future__ import annotations

import argparse
import runpy
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from grpo_addition import machine, read_scalars  # noqa: E402

COUNTDOWN = "benchmarks/out/countdown.jsonl"  # from the repository root
THINK_SYSTEM = runpy.run_path(str(ROOT / "examples" / "think_format.py"))["SYSTEM_PROMPT"]
COMMON = [
    "--total-steps",
    "30",
    "--group-size",
    "8",
    "--prompts-per-step",
    "4",
    "--temperature",
    "0.7",
    "--beta",
    "0.04",
    "--eval-size",
    "128",
    "--sample-every",
    "5",
    "--save-every",
    "0",
]
PRESETS = {
    "full": [
        "--task",
        "addition",
        "--max-new-tokens",
        "64",
        "--eval-every",
        "10",
        "--learning-rate",
        "1e-5",
    ],
    "lora": [
        "--task",
        "addition",
        "--max-new-tokens",
        "64",
        "--eval-every",
        "10",
        "--learning-rate",
        "1e-4",
        "--lora-rank",
        "16",
    ],
    "countdown": [
        "--learning-rate",
        "1e-5",
        "--dataset",
        COUNTDOWN,
        "--reward-fn",
        "examples/countdown.py:correct",
        "--reward-fn",
        "examples/think_format.py:format_reward",
        "--reward-weights",
        "1",
        "0.1",
        "--system-prompt",
        THINK_SYSTEM,
        "--response-prefix",
        "<think>",
        "--max-new-tokens",
        "128",
        "--eval-every",
        "15",
    ],
}


def command(preset: str, seed: int, runs_dir: str) -> list[str]:
    return [
        sys.executable,
        "grpo_lm.py",
        *COMMON,
        *PRESETS[preset],
        "--seed",
        str(seed),
        "--runs-dir",
        runs_dir,
        "--run-name",
        f"grpo_features_{preset}_seed{seed}",
    ]


def shown(cmd: list[str]) -> str:
    return " ".join("python" if c == sys.executable else shlex.quote(c) for c in cmd)


def row(preset: str, run_dir: Path, wall: str) -> str:
    s = read_scalars(run_dir)
    acc = s.get("eval/accuracy", [])
    step_s = [
        g + t for (_, g), (_, t) in zip(s["time/generation_s"], s["time/training_s"], strict=False)
    ]
    rewards = [v for _, v in s["reward/mean"]]
    peak = max(v for _, v in s["memory/peak_rss_gb"])
    k = max(1, len(rewards) // 6)
    return (
        f"| {preset} | {' -> '.join(f'{v:.3f} (step {t})' for t, v in acc)} | "
        f"{sum(rewards[:k]) / k:.3f} -> {sum(rewards[-k:]) / k:.3f} | "
        f"{statistics.median(step_s):.1f} | {peak:.2f} | {wall} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("presets", nargs="*", help=f"any of {', '.join(PRESETS)}")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs-dir", default=str(ROOT / "benchmarks" / "out"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "grpo_features_results.md"))
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--note",
        default="",
        help="a sentence printed under the table (e.g. a run that overlapped another job)",
    )
    opts = parser.parse_args()
    unknown = set(opts.presets) - set(PRESETS)
    if unknown:
        parser.error(f"unknown presets {sorted(unknown)}; choose from {', '.join(PRESETS)}")
    walls = {}
    for preset in [] if opts.report_only else opts.presets:
        run_dir = Path(opts.runs_dir) / f"grpo_features_{preset}_seed{opts.seed}"
        if (run_dir / "final_model").is_dir():
            print(f"{preset}: finished before, skipped")
            continue
        cmd = command(preset, opts.seed, opts.runs_dir)
        if preset == "countdown" and not (ROOT / COUNTDOWN).is_file():
            make = [sys.executable, "examples/countdown.py", "--out", COUNTDOWN]
            (ROOT / COUNTDOWN).parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(make, cwd=ROOT, check=True)
        print(shown(cmd), flush=True)
        start = time.time()
        subprocess.run(cmd, cwd=ROOT, check=True)
        walls[preset] = f"{(time.time() - start) / 60:.1f} min"
        (run_dir / "wall.txt").write_text(walls[preset])
    lines = [
        "# grpo_lm.py features on SmolLM2-135M-Instruct",
        "",
        f"Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}.",
        "",
        "| preset | held-out greedy accuracy (128 questions) | mean reward, first -> last 5 steps "
        "| median s/step (generation + training) | peak RSS GiB | wall, with loading and "
        "evaluations |",
        "|-|-|-|-|-|-|",
    ]
    for preset in PRESETS:
        run_dir = Path(opts.runs_dir) / f"grpo_features_{preset}_seed{opts.seed}"
        if (run_dir / "final_model").is_dir():
            wall = (run_dir / "wall.txt").read_text() if (run_dir / "wall.txt").is_file() else "?"
            lines.append(row(preset, run_dir, wall))
    lines += ["", opts.note] if opts.note else []
    lines += ["", "Commands (from the repository root):", ""]
    lines += [
        f"- {preset}: `{shown(command(preset, opts.seed, 'benchmarks/out'))}`" for preset in PRESETS
    ]
    Path(opts.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
