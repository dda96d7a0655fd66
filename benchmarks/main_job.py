"""The README's main job, old against new, back to back on this machine (issue 24).

    python benchmarks/main_job.py --old 85abcd7 --seeds 1 2 3   # writes benchmarks/out/main_job.md
    python benchmarks/main_job.py --seeds 2 3                    # this tree alone

For each seed it runs `python grpo_lm.py --group-size 8 --seed S` (the main job, only its seed and
run directory set) from a copy of the git ref ``--old`` (if given), then from this working tree, one
at a time, each from an empty model cache (so the GGUF conversion is in both). From each run's
TensorBoard events it reads the held-out accuracy of every evaluation and the per-phase seconds
(loading with the first evaluation, generation, training, the later evaluations, the rest), and from
the process its wall time and peak RSS. Then each final model is evaluated on the held-out problems
phrased another way ("What is a + b? Give the final answer as a number."): problems the training
never saw, in a prompt it never saw. Writes a table of each side (and the ratios new / old), with
the CPU (`lscpu` model and flags) and the command, to ``--out``, and after each run every run's
figures to ``--out`` with ``.json`` (what benchmarks/main_job_plot.py draws);
benchmarks/main_job_results.md collects those tables by hand.

The extra flags after ``--`` go to each side that has them (its ``grpo_lm.py --help``);
``--torch-threads N`` becomes ``OMP_NUM_THREADS=N`` on a side without the flag (issue 39 removed
it), any other flag a side lacks is left out of its runs, and the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tasks  # noqa: E402  (the held-out split is fixed by tasks.SPLIT_SEED, the same in both trees)

REPHRASED = "What is {a} + {b}? Give the final answer as a number."


def cpu() -> str:
    """`lscpu`'s model name and the flags that decide CPU speed-ups (bf16, AMX, AVX-512)."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s*(.*)", out)
    flags = re.search(r"Flags:\s*(.*)", out)
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")
    have = [f for f in wanted if flags and f in flags[1].split()]
    return f"{os.cpu_count()} cores, {model[1] if model else '?'}, flags: {' '.join(have)}"


def head() -> str:
    """This tree's commit, short."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True)
    return out.stdout.decode().strip()


def scalars(run_dir: Path) -> dict[str, list]:
    """{tag: [(wall_time, step, value), ...]} from the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {
        tag: [(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


def side_flags(tree: Path, extra: list[str]) -> tuple[list[str], dict[str, str], list[str]]:
    """(the flags of ``extra`` that ``tree``'s grpo_lm.py has, environment variables, notes): a
    flag it lacks is left out (a note says so), --torch-threads N as OMP_NUM_THREADS=N."""
    env = {**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"}
    usage = subprocess.run(
        [sys.executable, "grpo_lm.py", "--help"], cwd=tree, env=env, capture_output=True, text=True
    )
    if usage.returncode:
        sys.exit(f"{tree}/grpo_lm.py --help failed:\n{usage.stderr[-2000:]}")
    known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", usage.stdout + usage.stderr))
    kept, threads, notes, i = [], {}, [], 0
    while i < len(extra):
        j = i + 1  # a flag's values: up to the next --flag
        while j < len(extra) and not extra[j].startswith("--"):
            j += 1
        flag = extra[i].split("=")[0]
        if not flag.startswith("--") or flag in known:
            kept += extra[i:j]
        elif flag == "--torch-threads":
            threads["OMP_NUM_THREADS"] = (extra[i].split("=")[1:] or extra[i + 1 : j])[0]
            notes.append(f"{' '.join(extra[i:j])} as OMP_NUM_THREADS={threads['OMP_NUM_THREADS']}")
        else:
            notes.append(f"{' '.join(extra[i:j])} left out (no such flag)")
        i = j
    return kept, threads, notes


def run(tree: Path, seed: int, out: Path, name: str, *, flags: tuple) -> dict:
    """One main job from ``tree`` with its :func:`side_flags` ``flags``; its wall time, peak RSS,
    phases and accuracies."""
    extra, threads, _ = flags
    home = Path(tempfile.mkdtemp(prefix="main-job-home-"))
    env = {**os.environ, **threads, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    cmd = [sys.executable, "grpo_lm.py", "--group-size", "8", "--seed", str(seed)]
    cmd += ["--runs-dir", str(out), "--run-name", name, *extra]
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - start
    assert os.waitstatus_to_exitcode(status) == 0, f"{cmd} failed"
    s = scalars(out / name)
    evals = s["eval/accuracy"]
    gen = sum(v for _, _, v in s["time/generation_s"])
    train = sum(v for _, _, v in s["time/training_s"])
    times = sorted(t for rows in s.values() for t, _, _ in rows)
    # an evaluation's seconds: from the scalar logged before it to its own (the first one also
    # holds the loading: nothing is logged before it)
    later = sum(t - max(x for x in times if x < t) for t, step, _ in evals[1:])
    loading = evals[0][0] - start
    result = {
        "wall_s": wall,
        "peak_rss_gb": usage.ru_maxrss / 2**20,  # KiB on Linux
        "loading_and_first_eval_s": loading,
        "generation_s": gen,
        "training_s": train,
        "later_evals_s": later,
        "rest_s": wall - loading - gen - train - later,
        "accuracy": [(step, v) for _, step, v in evals],
        "rephrased": rephrased_accuracy(tree, out / name / "final_model", out, env),
    }
    # the run's model copies (its converted default model, checkpoint and final model, 2.7 GB a run:
    # a sweep of them filled this machine's disk) go; its TensorBoard events and args.json stay
    shutil.rmtree(home)
    shutil.rmtree(out / name / "final_model")
    (out / name / "checkpoint.pt").unlink(missing_ok=True)
    return result


def rephrased_accuracy(tree: Path, model: Path, out: Path, env: dict) -> float:
    """Greedy accuracy of ``model`` on the 128 held-out addition problems phrased another way."""
    held_out = tasks.make_addition_task(128).test
    rows = [re.fullmatch(r"What is (\d+) \+ (\d+)\?", q["question"]).groups() for q in held_out]
    data = out / "rephrased.jsonl"
    lines = [
        json.dumps({"question": REPHRASED.format(a=a, b=b), "answer": str(int(a) + int(b))})
        for a, b in rows
    ]
    lines += lines[:8]  # --dataset holds out the first --eval-size rows and wants a batch left
    data.write_text("\n".join(lines) + "\n")
    name = f"{model.parent.name}_rephrased"
    cmd = [sys.executable, "grpo_lm.py", "--eval-only", "--model-name-or-path", str(model)]
    cmd += ["--dataset", str(data), "--eval-size", "128", "--runs-dir", str(out)]
    subprocess.run(cmd + ["--run-name", name], cwd=tree, env=env, check=True)
    return json.loads((out / name / "eval.json").read_text())["accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--old", help="git ref of today's main job (default: this tree alone)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "main_job.md"))
    parser.add_argument("extra", nargs="*", help="flags for both sides, after -- (a smoke run)")
    opts = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="main-job-"))
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    trees = {"new": ROOT}  # side -> the tree it runs from, old first
    if opts.old:
        trees = {"old": work / "old", "new": ROOT}
        trees["old"].mkdir()
        archive = subprocess.run(["git", "archive", opts.old], cwd=ROOT, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(trees["old"])], input=archive.stdout, check=True)
    flags = {side: side_flags(tree, opts.extra) for side, tree in trees.items()}
    for side, (_, _, notes) in flags.items():
        if notes:
            print(f"{side}: {'; '.join(notes)}", flush=True)
    results, about = {}, {"cpu": cpu(), "old": opts.old, "new": head(), "extra": opts.extra}
    for seed in opts.seeds:
        for side, tree in trees.items():
            results[side, seed] = run(
                tree, seed, work / "runs", f"{side}_seed{seed}", flags=flags[side]
            )
            print(side, seed, json.dumps(results[side, seed]), flush=True)
            runs = [{"side": side, "seed": seed, **r} for (side, seed), r in results.items()]
            Path(opts.out).with_suffix(".json").write_text(
                json.dumps({**about, "runs": runs}, indent=1) + "\n"
            )
    write(results, opts, list(trees), {side: notes for side, (_, _, notes) in flags.items()})


def write(results: dict, opts, sides: list[str], notes: dict[str, list[str]]) -> None:
    mean = {
        side: {
            key: sum(results[side, s][key] for s in opts.seeds) / len(opts.seeds)
            for key in results[side, opts.seeds[0]]
            if key != "accuracy"
        }
        for side in sides
    }
    for side in sides:
        mean[side]["final_accuracy"] = sum(
            results[side, s]["accuracy"][-1][1] for s in opts.seeds
        ) / len(opts.seeds)

    def row(k: str) -> str:  # a key's mean on each side, and new / old when there are two
        cells = [f"{mean[side][k]:.3f}" for side in sides]
        if opts.old:
            cells.append(
                f"{mean['new'][k] / mean['old'][k] if mean['old'][k] else float('nan'):.2f}"
            )
        return f"| {k} | {' | '.join(cells)} |"

    old = f"--old {opts.old} " if opts.old else ""
    columns = ["mean over seeds", *sides] + (["new / old"] if opts.old else [])
    lines = [
        "# The main job, old against new (issue 24)",
        "",
        f"CPU: {cpu()}. Date: {time.strftime('%Y-%m-%d')}. Old: `{opts.old or '-'}`; new: the"
        f" working tree at `{head()}`.",
        "",
        f"Command: `python benchmarks/main_job.py {old}--seeds "
        f"{' '.join(map(str, opts.seeds))}{' -- ' + ' '.join(opts.extra) if opts.extra else ''}`;"
        " each run is `python grpo_lm.py --group-size 8 --seed S` (with those extra flags) from an"
        " empty model cache, one at a time."
        + "".join(f" {side}: {'; '.join(notes[side])}." for side in sides if notes[side]),
        "",
        "| " + " | ".join(columns) + " |",
        "|-" * len(columns) + "|",
        *[row(k) for k in mean["new"]],
        "",
        "| run | held-out accuracy per evaluation (step: accuracy) | rephrased | wall |",
        "|-|-|-|-|",
        *[
            f"| {side} seed {s} | "
            + ", ".join(f"{st}: {v:.3f}" for st, v in results[side, s]["accuracy"])
            + f" | {results[side, s]['rephrased']:.3f} | "
            + f"{results[side, s]['wall_s'] / 60:.1f} min |"
            for s in opts.seeds
            for side in sides
        ],
    ]
    Path(opts.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
