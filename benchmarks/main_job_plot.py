"""The main job's held-out accuracy per evaluation, each seed and their mean, per side (a PNG).

    pip install matplotlib   # this script's alone: the scripts and tests never need it
    python benchmarks/main_job_plot.py benchmarks/main_job_curves.json [MORE.json ...] \\
        --label old "--beta 0, 16 questions a step" --label new "--beta 0.04, 8 (the default)" \\
        --out benchmarks/main_job_curves.png

Reads what ``benchmarks/main_job.py`` writes beside its table (``--out`` with ``.json``), from one
or more runs of it: each run's side ("old" or "new"), seed, ``wall_s`` and ``accuracy``, a list of
(step, held-out greedy accuracy).
Draws one thin line per run and a thick one for each side's mean over its seeds (at the steps
every seed evaluated; the legend gives its mean wall time), the CPU and commits under the title.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="+", help="main_job.py's JSON (its --out with .json)")
    parser.add_argument("--label", nargs=2, action="append", default=[], metavar=("SIDE", "TEXT"))
    parser.add_argument("--out", default="benchmarks/main_job_curves.png")
    opts = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    files = [json.loads(Path(path).read_text()) for path in opts.results]
    results = {**files[0], "runs": [run for f in files for run in f["runs"]]}
    labels = dict(opts.label)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for colour, side in zip(("tab:gray", "tab:blue"), ("old", "new"), strict=True):
        runs = [run for run in results["runs"] if run["side"] == side]
        if not runs:
            continue
        for run in runs:
            steps, acc = zip(*run["accuracy"], strict=True)
            ax.plot(steps, [100 * a for a in acc], color=colour, alpha=0.35, lw=1)
        common = sorted(set.intersection(*({s for s, _ in run["accuracy"]} for run in runs)))
        mean = [100 * sum(dict(r["accuracy"])[s] for r in runs) / len(runs) for s in common]
        seeds = ", ".join(str(run["seed"]) for run in runs)
        wall = sum(run["wall_s"] for run in runs) / len(runs) / 60
        label = f"{labels.get(side, side)}: seeds {seeds}, {wall:.1f} min"
        ax.plot(common, mean, color=colour, lw=2.5, marker="o", label=label)
        offset = (6, 6 if side == "old" else -12)  # points: the two means apart
        ax.annotate(f"{mean[-1]:.1f}%", (common[-1], mean[-1]), offset, textcoords="offset points",
                    color=colour)  # fmt: skip
    ax.axhline(70, color="tab:red", lw=0.8, ls="--")
    ax.set(xlabel="step", ylabel="held-out greedy accuracy (%)", ylim=(0, 100))
    ax.set_xlim(right=ax.get_xlim()[1] * 1.08)  # room for the final means
    commits = f"old {results['old']}, new {results['new']}" if results["old"] else results["new"]
    ax.set_title(f"The main job: 128 held-out problems\n{results['cpu']}; {commits}", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(opts.out)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
