"""Learning with a calculator, with the tool and without it (issue 49, goal 4).

    python benchmarks/tool_learning.py --seeds 1 2 3   # writes benchmarks/out/tool_learning.md
    python benchmarks/tool_learning.py --seeds 1 --sides none -- --total-steps 1 --eval-size 8 \\
        --eval-every 0                                 # a smoke run
    pip install matplotlib                             # --plot's alone
    python benchmarks/tool_learning.py --plot benchmarks/out/tool_learning.json [MORE.json ...]

Writes "What is A * B?" for ``--digits``-digit A and B (products the 135M model gets wrong alone)
under ``--work``: NUM_TRAIN training and NUM_HELD_OUT held-out questions, no (A, B) pair in both.
For each seed, then each of ``--sides``, one at a time, runs the main job on them (`python
grpo_lm.py --group-size 8 --seed S`: 36 steps of 8 questions, an evaluation every 12) with
``--system-prompt`` (the call syntax shown once), plus ``--tool calculator`` on the ``tool`` side
and the flags after ``--`` on both. The runs share one model cache under ``--work`` (one GGUF
conversion). Reads each run's TAGS from its TensorBoard events (``eval/frac_calling_tool`` is
logged only with a tool), its wall time and peak RSS; writes every run's figures to ``--out`` with
``.json`` after each run (what ``--plot`` draws into ``--png``), a table to ``--out`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from main_job import cpu, head, scalars  # this folder's: the same CPU line, commit and reader

ROOT = Path(__file__).resolve().parents[1]
DATA_SEED = 49  # fixes the questions and their split
NUM_TRAIN = 2000
NUM_HELD_OUT = 128
SYSTEM_PROMPT = (
    "You have a calculator: write <<expression= and it writes the result and >>. "
    "For example: <<12*3=36>>. End with 'The answer is N.'"
)
TAGS = {  # a result's key: the TensorBoard scalar it reads, a (step, value) list
    "accuracy": "eval/accuracy",
    "frac_calling_tool": "eval/frac_calling_tool",
    "train_frac_calling": "tools/frac_calling",
    "train_reward": "reward/mean",
}
COLOURS = {"tool": "tab:blue", "none": "tab:gray"}


def write_data(work: Path, digits: int) -> tuple[Path, Path]:
    """(training, held-out) JSONL files of "What is A * B?" for ``digits``-digit A and B, answer
    A * B: NUM_TRAIN and NUM_HELD_OUT rows, no (A, B) pair in both, the same rows every call."""
    low = 10 ** (digits - 1)
    span = 9 * low  # how many numbers have that many digits
    if span * span < NUM_TRAIN + NUM_HELD_OUT:
        sys.exit(f"--digits {digits}: {span * span} pairs, fewer than the questions needed")
    rng = np.random.default_rng(DATA_SEED)
    picks = rng.choice(span * span, size=NUM_TRAIN + NUM_HELD_OUT, replace=False)
    rows = []
    for pick in picks.tolist():
        a = low + pick // span
        b = low + pick % span
        example = {"question": f"What is {a} * {b}?", "answer": str(a * b)}
        rows.append(json.dumps(example))
    train = work / f"multiply{digits}_train.jsonl"
    held_out = work / f"multiply{digits}_held_out.jsonl"
    held_out.write_text("\n".join(rows[:NUM_HELD_OUT]) + "\n")
    train.write_text("\n".join(rows[NUM_HELD_OUT:]) + "\n")
    return train, held_out


def run(side: str, seed: int, *, opts, data: tuple[Path, Path]) -> dict:
    """One main job on ``side`` ("tool": with --tool calculator) of the task ``data``; its wall
    time, peak RSS and each of TAGS as (step, value) pairs (none where the run logged none)."""
    work = Path(opts.work)
    home = work / "home"  # one model cache for every run
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    name = f"{side}_seed{seed}"
    run_dir = work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # else an earlier run's events are read too
    cmd = [sys.executable, "grpo_lm.py", "--group-size", "8", "--seed", str(seed)]
    cmd += ["--dataset", str(data[0]), "--eval-dataset", str(data[1])]
    cmd += ["--eval-size", str(NUM_HELD_OUT), "--system-prompt", opts.system_prompt]
    cmd += ["--max-new-tokens", str(opts.max_new_tokens)]
    cmd += ["--runs-dir", str(work / "runs"), "--run-name", name]
    if side == "tool":
        cmd += ["--tool", "calculator"]
    cmd += opts.extra
    log = work / f"{name}.log"
    start = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - start
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"{shlex.join(cmd)} failed:\n{log.read_text()[-3000:]}")
    logged = scalars(run_dir)
    result = {"side": side, "seed": seed, "wall_s": wall}
    result["peak_rss_gb"] = usage.ru_maxrss / 2**20  # KiB on Linux
    for key, tag in TAGS.items():
        result[key] = [(step, value) for _, step, value in logged.get(tag, [])]
    # the model copies go (disk); the TensorBoard events, args.json and the log stay
    shutil.rmtree(run_dir / "final_model", ignore_errors=True)
    (run_dir / "checkpoint.pt").unlink(missing_ok=True)
    return result


def mean_curve(runs: list[dict], key: str) -> list[tuple[int, float]]:
    """The mean over ``runs`` of ``key``'s (step, value) pairs, at the steps every run logged."""
    curves = [dict(run[key]) for run in runs]
    steps = set(curves[0]) if curves else set()
    for curve in curves:
        steps &= set(curve)
    means = []
    for step in sorted(steps):
        values = [curve[step] for curve in curves]
        means.append((step, sum(values) / len(values)))
    return means


def mean(runs: list[dict], key: str) -> float:
    """The mean over ``runs`` of ``key``'s value (0 without runs)."""
    values = [run[key] for run in runs]
    return sum(values) / max(1, len(values))


def percents(pairs: list) -> str:
    """``step: value`` (in %) of each (step, value) pair, or "-" when there are none."""
    if not pairs:
        return "-"
    return ", ".join(f"{step}: {100 * value:.1f}" for step, value in pairs)


def row(name: str, figures: dict) -> str:
    """A table row: ``figures``' curves (in %), mean training calls, wall time and peak RSS."""
    train = [value for _, value in figures["train_frac_calling"]]
    calling = "-"
    if train:
        calling = f"{100 * sum(train) / len(train):.1f}"
    curves = f"{percents(figures['accuracy'])} | {percents(figures['frac_calling_tool'])}"
    wall = f"{figures['wall_s'] / 60:.1f} min"
    rss = f"{figures['peak_rss_gb']:.2f} GB"
    return f"| {name} | {curves} | {calling} | {wall} | {rss} |"


def write_table(about: dict, runs: list[dict], out: Path) -> None:
    """The markdown table of every run and each side's mean over its seeds, to ``out``."""
    task = f"'What is A * B?', {about['digits']}-digit A and B, {NUM_TRAIN} training and"
    task += f" {NUM_HELD_OUT} held-out questions. System prompt: `{about['system_prompt']}`"
    lines = ["# Learning with a calculator, with the tool and without it (issue 49, goal 4)", ""]
    lines.append(f"CPU: {about['cpu']}. Date: {about['date']}. Commit: `{about['commit']}`.")
    lines += ["", f"Command: `{about['command']}`. Task: {task}", ""]
    lines.append(
        "| run | held-out accuracy % (step: value) | held-out responses calling the tool %"
        " | training: calling % (mean of the steps) | wall | peak RSS |"
    )
    lines.append("|-|-|-|-|-|-|")
    for side in COLOURS:
        mine = [run for run in runs if run["side"] == side]
        if not mine:
            continue
        lines += [row(f"{side} seed {run['seed']}", run) for run in mine]
        means = {key: mean_curve(mine, key) for key in TAGS}
        means["wall_s"] = mean(mine, "wall_s")
        means["peak_rss_gb"] = mean(mine, "peak_rss_gb")
        lines.append(row(f"**{side}: mean**", means))
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def draw(ax, pairs: list, colour: str, **style) -> None:
    """Plot (step, value) ``pairs`` as percents."""
    steps = [step for step, _ in pairs]
    values = [100 * value for _, value in pairs]
    ax.plot(steps, values, color=colour, **style)


def plot(paths: list[str], png: str) -> None:
    """Two panels from tool_learning.py's JSON files: the held-out accuracy and the fraction of
    held-out responses calling the tool (%), per evaluation; a thin line a run, a thick one for
    each side's mean over its runs (the legend gives the seeds and mean wall time)."""
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    files = [json.loads(Path(path).read_text()) for path in paths]
    runs = [run for f in files for run in f["runs"]]
    panels = {
        "accuracy": "held-out greedy accuracy (%)",
        "frac_calling_tool": "held-out responses calling the tool (%)",
    }
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    for ax, (key, ylabel) in zip(axes, panels.items(), strict=True):
        for side, colour in COLOURS.items():
            mine = [run for run in runs if run["side"] == side and run[key]]
            if not mine:
                continue
            for run in mine:
                draw(ax, run[key], colour, alpha=0.35, lw=1)
            if key == "frac_calling_tool":  # the training batches' share, every step
                training = mean_curve(mine, "train_frac_calling")
                draw(ax, training, colour, lw=1, ls="--", label=f"{side}: training answers")
            seeds = ", ".join(str(run["seed"]) for run in mine)
            wall = mean(mine, "wall_s") / 60
            label = f"{side}: seeds {seeds}, {wall:.1f} min"
            draw(ax, mean_curve(mine, key), colour, lw=2.5, marker="o", label=label)
        ax.set(xlabel="step", ylabel=ylabel, ylim=(0, 100))
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper left", fontsize=8)
    axes[1].legend(loc="lower right", fontsize=8)
    axes[1].set_title("(logged with --tool only)", fontsize=8)
    commits = ", ".join(sorted({f["commit"] for f in files}))
    digits = files[0]["digits"]
    title = f"'What is A * B?', {digits}-digit A and B: {NUM_HELD_OUT} held-out questions"
    fig.suptitle(f"{title}\n{files[0]['cpu']}; commit {commits}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png)
    print(f"wrote {png}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--sides", nargs="+", choices=list(COLOURS), default=list(COLOURS))
    parser.add_argument("--digits", type=int, default=2, help="digits of A and of B")
    parser.add_argument("--system-prompt", default=SYSTEM_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    work = Path(tempfile.gettempdir()) / "tool-learning"
    parser.add_argument("--work", default=str(work), help="data, runs, logs and the model cache")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "tool_learning.md"))
    parser.add_argument("--plot", nargs="+", metavar="JSON", help="draw these results; no runs")
    parser.add_argument("--png", default=str(ROOT / "benchmarks" / "tool_learning.png"))
    parser.add_argument("extra", nargs="*", help="flags for every run, after -- (a smoke run)")
    opts = parser.parse_args()
    if opts.plot:
        plot(opts.plot, opts.png)
        return
    Path(opts.work).mkdir(parents=True, exist_ok=True)
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = write_data(Path(opts.work), opts.digits)
    about = {"cpu": cpu(), "commit": head(), "date": time.strftime("%Y-%m-%d")}
    about["command"] = shlex.join(["python", "benchmarks/tool_learning.py", *sys.argv[1:]])
    about["digits"] = opts.digits
    about["system_prompt"] = opts.system_prompt
    runs = []
    for seed in opts.seeds:
        for side in opts.sides:
            runs.append(run(side, seed, opts=opts, data=data))
            print(json.dumps(runs[-1]), flush=True)
            results = json.dumps({**about, "runs": runs}, indent=1)
            out.with_suffix(".json").write_text(results + "\n")
    write_table(about, runs, out)


if __name__ == "__main__":
    main()
