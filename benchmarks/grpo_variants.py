"""Same-budget comparisons of grpo_lm.py variants on SmolLM2-135M-Instruct.

    python benchmarks/grpo_variants.py --steps 30                        # all five presets below
    python benchmarks/grpo_variants.py --steps 30 --variants outcome,process
    python benchmarks/grpo_variants.py --steps 3 --eval-size 32 --torch-threads 1 \
        -- --max-new-tokens 48
    # rewrite the table from finished runs
    python benchmarks/grpo_variants.py --steps 30 --report-only
    # a longer run's first 10 steps
    python benchmarks/grpo_variants.py --steps 10 \
        --reuse grpo=benchmarks/out/grpo_addition_seed1_<stamp>

Presets (every run shares the flags in COMMON; the rest of the flags are the preset's):
  outcome, process  --task multistep ("Compute (a + b) * c - d"), outcome vs process
                    supervision (§4.1.2 / §4.1.3)
  grpo, dr_grpo, dapo   --task addition: paper GRPO; Dr. GRPO (sum / (B * L_max), unscaled
                    advantages); DAPO (token-level loss, clip-higher 0.28, overlong buffer 16,
                    no KL)
  dapo_ds           DAPO with dynamic sampling too (more generation per step: not the same
                    sampling budget)

Each preset runs grpo_lm.py as a subprocess into a run directory named by preset, steps and seed; a
rerun skips the runs that finished, so two invocations with different --variants can share the cores
and one --report-only call writes the joint table. The table (held-out greedy accuracy at every
evaluation, sample accuracy first/last third of the steps, seconds per step), the per-step reward
curves, the exact commands and the machine go to --out, rewritten after every run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
# the same helpers as the addition benchmark, importable once benchmarks/ is on the path
from grpo_addition import machine, read_scalars  # noqa: E402

COMMON = [
    "--group-size",
    "8",
    "--prompts-per-step",
    "4",
    "--learning-rate",
    "1e-5",
    "--temperature",
    "0.7",
    "--sample-every",
    "5",
    "--save-every",
    "0",
]
PRESETS = {
    "outcome": ["--task", "multistep", "--max-new-tokens", "96", "--supervision", "outcome"],
    "process": ["--task", "multistep", "--max-new-tokens", "96", "--supervision", "process"],
    "grpo": ["--task", "addition", "--max-new-tokens", "64"],
    "dr_grpo": [
        "--task",
        "addition",
        "--max-new-tokens",
        "64",
        "--loss-type",
        "dr_grpo",
        "--scale-rewards",
        "none",
    ],
    "dapo": [
        "--task",
        "addition",
        "--max-new-tokens",
        "64",
        "--loss-type",
        "dapo",
        "--clip-range-high",
        "0.28",
        "--overlong-buffer",
        "16",
        "--beta",
        "0",
    ],
    "dapo_ds": [
        "--task",
        "addition",
        "--max-new-tokens",
        "64",
        "--loss-type",
        "dapo",
        "--clip-range-high",
        "0.28",
        "--overlong-buffer",
        "16",
        "--beta",
        "0",
        "--dynamic-sampling",
    ],
}


def run_dir_name(name: str, steps: int, seed: int) -> str:
    """Fixed per preset, budget and seed, so a rerun skips runs that already finished."""
    return f"grpo_variants_{name}_steps{steps}_seed{seed}"


def summarise(name: str, run_dir: Path, steps: int) -> tuple[str, str] | None:
    """(table row, reward curve) of the first ``steps`` steps of a run, or None while it has not
    evaluated step ``steps``."""
    s = read_scalars(run_dir) if run_dir.exists() else {}
    s = {tag: [(t, v) for t, v in values if t <= steps] for tag, values in s.items()}
    acc = s.get("eval/accuracy", [])
    if len(acc) < 2 or acc[-1][0] != steps or "time/generation_s" not in s:
        return None
    rewards = [
        v for _, v in s["reward/accuracy"]
    ]  # verifiable accuracy of the samples (comparable across shaping)
    step_s = [
        g + t for (_, g), (_, t) in zip(s["time/generation_s"], s["time/training_s"], strict=False)
    ]
    k = max(1, len(rewards) // 3)
    extra = ""
    if "process/step_reward_mean" in s:
        steps = [v for _, v in s["process/step_reward_mean"]]
        extra = f"checked steps correct: {steps[0]:.2f} -> {steps[-1]:.2f}"
    grad = [v for _, v in s.get("optim/grad_norm", [])]
    if grad:
        extra += (
            "; " if extra else ""
        ) + f"steps with grad norm 0: {sum(g == 0 for g in grad)}/{len(grad)}"
    middle = " ".join(f"{v:.3f} (step {t})" for t, v in acc[1:-1])
    row = (
        f"| {name} | {acc[0][1]:.3f} | {middle or '-'} | {acc[-1][1]:.3f} (step {acc[-1][0]}) | "
        f"{sum(rewards[:k]) / k:.3f} -> {sum(rewards[-k:]) / k:.3f} | "
        f"{sum(step_s) / len(step_s):.0f} | {extra} |"
    )
    return row, f"{name:8s} " + " ".join(f"{r:.2f}" for r in rewards)


def command(name: str, opts: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        "grpo_lm.py",
        "--total-steps",
        str(opts.steps),
        *COMMON,
        *PRESETS[name],
        "--eval-size",
        str(opts.eval_size),
        "--eval-every",
        str(opts.eval_every),
        "--seed",
        str(opts.seed),
        "--runs-dir",
        opts.runs_dir,
        "--run-name",
        run_dir_name(name, opts.steps, opts.seed),
        *opts.extra,
    ]


def threads_env(opts: argparse.Namespace) -> dict[str, str]:
    """--torch-threads N as the child's OMP_NUM_THREADS (grpo_lm.py's flag until issue 39)."""
    return {"OMP_NUM_THREADS": str(opts.torch_threads)} if opts.torch_threads else {}


def shown_command(name: str, opts: argparse.Namespace) -> str:
    env = [f"{k}={v}" for k, v in threads_env(opts).items()]
    return " ".join(env + ["python" if c == sys.executable else c for c in command(name, opts)])


def run_dir_of(name: str, opts: argparse.Namespace) -> Path:
    return (
        Path(opts.reuse[name])
        if name in opts.reuse
        else Path(opts.runs_dir) / run_dir_name(name, opts.steps, opts.seed)
    )


def report(variants: list[str], opts: argparse.Namespace) -> str:
    rows, curves, commands = [], [], []
    for name in variants:
        shown = shown_command(name, opts)
        if name in opts.reuse:
            shown = (
                f"the first {opts.steps} steps of {run_dir_of(name, opts).name} (same flags but "
                f"--total-steps and --eval-every; its args.json holds them): {shown}"
            )
        commands.append(f"- {name}: `{shown}`")
        summary = summarise(name, run_dir_of(name, opts), opts.steps)
        if summary is None:
            rows.append(f"| {name} | not run yet | | | | | |")
        else:
            rows.append(summary[0])
            curves.append(summary[1])
    lines = [
        "# grpo_lm.py variants on SmolLM2-135M-Instruct",
        "",
        *([opts.note, ""] if opts.note else []),
        (
            f"Machine: {machine()}. Date: {time.strftime('%Y-%m-%d')}. Budget: {opts.steps} steps "
            f"per run, 4 questions x G=8 per step, held-out greedy accuracy on {opts.eval_size} "
            "problems."
        ),
        "",
        "| variant | held-out accuracy, step 0 | in between | held-out accuracy, end | sample "
        "accuracy, first third -> last third | s/step | notes |",
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
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="--total-steps of every run")
    parser.add_argument(
        "--variants",
        default="outcome,process,grpo,dr_grpo,dapo",
        help=f"comma-separated presets out of {','.join(PRESETS)}",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--eval-size", type=int, default=128, help="held-out problems for greedy accuracy"
    )
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="OMP_NUM_THREADS of each grpo_lm.py run (0 = torch's default)",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "grpo_variants_results.md"))
    parser.add_argument("--runs-dir", default=str(ROOT / "benchmarks" / "out"))
    parser.add_argument(
        "--note",
        default="",
        help="a paragraph written under the title (e.g. why the budget is small)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing; write the table from the finished runs of --variants",
    )
    parser.add_argument(
        "--reuse",
        nargs="*",
        default=[],
        metavar="PRESET=RUN_DIR",
        help="read PRESET from an existing run with the same flags and at least --steps steps "
        "(the learning rate is constant, so its first --steps steps are this preset's run)",
    )
    parser.add_argument("extra", nargs="*", help="extra grpo_lm.py flags for every run, after --")
    opts = parser.parse_args()
    bad = [r for r in opts.reuse if "=" not in r or r.split("=", 1)[0] not in PRESETS]
    if bad:
        parser.error(
            f"--reuse: expected PRESET=RUN_DIR with a preset out of {','.join(PRESETS)}, got "
            f"{' '.join(bad)}"
        )
    opts.reuse = dict(r.split("=", 1) for r in opts.reuse)
    variants = opts.variants.split(",")
    unknown = [v for v in variants if v not in PRESETS]
    if unknown:
        parser.error(
            f"--variants: unknown preset(s) {', '.join(unknown)}; choose from {', '.join(PRESETS)}"
        )

    for name in [] if opts.report_only else variants:
        run_dir = run_dir_of(name, opts)
        if summarise(name, run_dir, opts.steps) is not None:
            print(f"{name}: finished run found in {run_dir}, skipped", flush=True)
            continue
        if name in opts.reuse:
            parser.error(f"--reuse {name}: {run_dir} has no evaluation at step {opts.steps}")
        if run_dir.exists():  # an unfinished run: start it again from nothing
            shutil.rmtree(run_dir)
        print(shown_command(name, opts), flush=True)
        env = os.environ | threads_env(opts)
        subprocess.run(command(name, opts), cwd=ROOT, check=True, env=env)
        Path(opts.out).write_text(
            report(variants, opts)
        )  # after every run, so a stopped sweep keeps its rows
    text = report(variants, opts)
    Path(opts.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
