"""Real run: GRPO on SmolLM2-135M-Instruct, addition task, held-out greedy accuracy before/after.

    python benchmarks/grpo_addition.py --steps 30   # writes benchmarks/grpo_addition_results.md

Runs grpo_lm.py as a subprocess with the flags below (plus any extra ones after `--`), then reads
its TensorBoard scalars and reports accuracy before/after, the reward curve, seconds per step and
peak memory, together with the exact command and the machine it ran on.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TensorBoard event files in ``run_dir``: {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def machine() -> str:
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in open("/proc/cpuinfo")
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if os.path.exists("/proc/cpuinfo")
        else platform.processor()
    )
    return (
        f"{os.cpu_count()}-core {platform.machine()} CPU VM ({cpu}), no GPU, "
        f"Python {platform.python_version()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "grpo_addition_results.md"))
    parser.add_argument("--runs-dir", default=str(ROOT / "benchmarks" / "out"))
    parser.add_argument("extra", nargs="*", help="extra grpo_lm.py flags, after --")
    opts = parser.parse_args()

    run_name = f"grpo_addition_seed{opts.seed}_{int(time.time())}"
    cmd = [
        sys.executable,
        "grpo_lm.py",
        "--total-steps",
        str(opts.steps),
        "--group-size",
        "8",
        "--prompts-per-step",
        "4",
        "--max-new-tokens",
        "64",
        "--learning-rate",
        "1e-5",
        "--temperature",
        "0.7",
        "--beta",
        "0.04",
        "--eval-size",
        "128",
        "--eval-every",
        "10",
        "--sample-every",
        "5",
        "--save-every",
        "0",
        "--seed",
        str(opts.seed),
        "--runs-dir",
        opts.runs_dir,
        "--run-name",
        run_name,
        *opts.extra,
    ]
    shown = " ".join(c if c != sys.executable else "python" for c in cmd)
    print(shown, flush=True)
    start = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True)
    wall = time.time() - start
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB (Linux)

    s = read_scalars(Path(opts.runs_dir) / run_name)
    acc = s["eval/accuracy"]
    rewards = [v for _, v in s["reward/mean"]]
    step_s = [
        g + t for (_, g), (_, t) in zip(s["time/generation_s"], s["time/training_s"], strict=False)
    ]
    lengths = [v for _, v in s["completion/length_mean"]]
    k = max(1, len(rewards) // 6)
    lines = [
        "# GRPO on SmolLM2-135M-Instruct, addition task",
        "",
        f"Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}.",
        "",
        f"Command (from the repository root): `{shown}`",
        "",
        "| metric | value |",
        "|---|---|",
        f"| held-out greedy accuracy, 128 problems, step {acc[0][0]} | {acc[0][1]:.3f} |",
        *[f"| held-out greedy accuracy, step {st} | {v:.3f} |" for st, v in acc[1:]],
        f"| mean reward, first {k} steps -> last {k} steps | {sum(rewards[:k]) / k:.3f} -> "
        f"{sum(rewards[-k:]) / k:.3f} |",
        f"| mean completion length, first {k} -> last {k} steps (tokens) | "
        f"{sum(lengths[:k]) / k:.1f} -> {sum(lengths[-k:]) / k:.1f} |",
        f"| seconds per step (generation + training), mean | {sum(step_s) / len(step_s):.1f} |",
        f"| wall time, whole run incl. 4 evaluations and loading | {wall / 60:.1f} min |",
        f"| peak RSS | {peak_rss:.2f} GiB |",
        "",
        "Reward (mean over the 32 completions) per step:",
        "",
        "```",
        " ".join(f"{r:.2f}" for r in rewards),
        "```",
    ]
    Path(opts.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
