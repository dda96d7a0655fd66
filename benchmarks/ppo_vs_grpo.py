"""PPO vs GRPO, measured: ppo_lm.py and grpo_lm.py on SmolLM2-135M-Instruct and the addition task.

Not a test: it runs both trainings as subprocesses with the same seed, the same number of sampled
completions per step (PPO: 32 prompts x 1; GRPO: 4 prompts x G=8), the same max length, learning
rate and temperature, and held-out greedy accuracy on the same 128 problems before and after. It
measures each child's wall time and peak RSS (``os.wait4``: the child's own ``ru_maxrss``), reads
reward per step, seconds per step and accuracy from the TensorBoard event files, and writes a
markdown table.

Both at once, each pinned to its own core with one torch thread (a run is skipped when its
result.json exists; --force reruns it):
    python benchmarks/ppo_vs_grpo.py run --methods ppo grpo --cpus 1 0 --steps 5 --threads 1
One at a time, when cores free up at different moments:
    python benchmarks/ppo_vs_grpo.py run --methods ppo --cpus 1 --steps 5 --threads 1
The table from the runs that finished (nothing is re-run), into benchmarks/ppo_vs_grpo_results.md:
    python benchmarks/ppo_vs_grpo.py report

Raw output (logs, result.json, TensorBoard runs, checkpoints) goes to benchmarks/out/ppo_vs_grpo/
(gitignored).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out" / "ppo_vs_grpo"
RESULTS = ROOT / "benchmarks" / "ppo_vs_grpo_results.md"
SCRIPTS = {"ppo": "ppo_lm.py", "grpo": "grpo_lm.py"}
PER_METHOD = {
    "ppo": ["--prompts-per-step", "32"],  # 32 completions per step, one per prompt
    "grpo": ["--prompts-per-step", "4", "--group-size", "8"],
}  # 32 completions per step, 8 per prompt


def command(method: str, a: argparse.Namespace) -> list[str]:
    """The training command of ``method`` (taskset pinning added by the caller)."""
    cmd = [
        sys.executable,
        SCRIPTS[method],
        *PER_METHOD[method],
        "--seed",
        str(a.seed),
        "--total-steps",
        str(a.steps),
        "--max-new-tokens",
        str(a.max_new_tokens),
        "--learning-rate",
        str(a.learning_rate),
        "--temperature",
        str(a.temperature),
        "--eval-size",
        str(a.eval_size),
        "--eval-batch-size",
        str(a.eval_batch_size),
        "--eval-every",
        "0",
        "--save-every",
        "0",
        "--sample-every",
        "1",
        "--runs-dir",
        str(OUT / "runs"),
        "--run-name",
        method,
    ]
    return cmd + shlex.split(a.ppo_extra if method == "ppo" else a.grpo_extra)


def threads_env(a: argparse.Namespace) -> dict[str, str]:
    """--threads N as the child's OMP_NUM_THREADS (the scripts' --torch-threads until issue 39)."""
    return {"OMP_NUM_THREADS": str(a.threads)} if a.threads else {}


def machine() -> str:
    """One line about the machine: CPU model, cores, AVX2, memory, GPU."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = next(
            line.split(":", 1)[1].strip()
            for line in cpuinfo.splitlines()
            if line.startswith("model name")
        )
        flags = "AVX2" if " avx2" in cpuinfo else "no AVX2"
    except (OSError, StopIteration):
        pass
    mem = ""
    try:
        kib = int(
            next(
                line.split()[1]
                for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")
            )
        )
        mem = f", {kib / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"{os.cpu_count()}-core {platform.machine()} CPU VM ({model}, {flags}){mem}, {gpu}"


def start(
    method: str, cpu: str | None, a: argparse.Namespace
) -> tuple[subprocess.Popen, dict, float]:
    rdir = OUT / method
    if rdir.exists():
        shutil.rmtree(rdir)
    shutil.rmtree(OUT / "runs" / method, ignore_errors=True)
    rdir.mkdir(parents=True)
    cmd = command(method, a)
    pin = ["taskset", "-c", cpu] if cpu is not None and shutil.which("taskset") else []
    log = open(rdir / "log.txt", "w")
    env = os.environ | threads_env(a)
    proc = subprocess.Popen(pin + cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    shown = " ".join(
        [
            "python",
            *(
                str(Path(c).relative_to(ROOT)) if str(c).startswith(str(ROOT)) else str(c)
                for c in cmd[1:]
            ),
        ]
    )
    info = {
        "method": method,
        "command": "".join(f"{k}={v} " for k, v in threads_env(a).items())
        + (f"taskset -c {cpu} " if pin else "")
        + shown,
        "cpu": cpu,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": machine(),
    }
    print(f"started {method} (pid {proc.pid}): {info['command']}", flush=True)
    return proc, info, time.time()


def run(a: argparse.Namespace) -> None:
    cpus = a.cpus or [None] * len(a.methods)
    if len(cpus) != len(a.methods):
        sys.exit("error: give one --cpus entry per method")
    running = {}
    for method, cpu in zip(a.methods, cpus, strict=True):
        if (OUT / method / "result.json").is_file() and not a.force:
            print(f"{method}: result.json exists, skipped (--force reruns it)")
            continue
        running[method] = start(method, cpu, a)
    by_pid = {proc.pid: m for m, (proc, _, _) in running.items()}
    while by_pid:
        pid, status, usage = os.wait4(
            -1, 0
        )  # this child's own rusage: its peak RSS, not the sum of all
        if pid not in by_pid:
            continue
        method = by_pid.pop(pid)
        proc, info, t0 = running[method]
        proc.returncode = os.waitstatus_to_exitcode(status)
        rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        info.update(
            returncode=proc.returncode,
            wall_s=time.time() - t0,
            peak_rss_gb=rss / 1e9,
            user_s=usage.ru_utime,
            sys_s=usage.ru_stime,
            steps=a.steps,
        )
        (OUT / method / "result.json").write_text(json.dumps(info, indent=2))
        print(
            f"{method} finished: exit {proc.returncode}, {info['wall_s']:.0f} s, peak RSS "
            f"{info['peak_rss_gb']:.2f} GB",
            flush=True,
        )
    report(a)


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} from the TensorBoard event files of one run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def report(a: argparse.Namespace) -> None:
    rows, commands, notes, info_machine = [], [], [], None
    for method in ("ppo", "grpo"):
        path = OUT / method / "result.json"
        if not path.is_file():
            notes.append(f"- {method}: no finished run.")
            continue
        info = json.loads(path.read_text())
        info_machine = info["machine"]
        s = scalars(OUT / "runs" / method)
        acc = dict(s.get("eval/accuracy", []))
        reward = [v for _, v in s.get("reward/mean", [])]
        step_s = [
            g + t
            for (_, g), (_, t) in zip(
                s.get("time/generation_s", []), s.get("time/training_s", []), strict=False
            )
        ]
        gen_s = [v for _, v in s.get("time/generation_s", [])]
        steps = len(reward)
        before, after = acc.get(0), acc.get(steps) if steps else None
        fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
        rows.append(
            f"| {method.upper()} ({SCRIPTS[method]}) | {steps} | {fmt(before)} -> {fmt(after)} | "
            f"{' '.join(f'{r:.2f}' for r in reward)} | "
            f"{sum(reward[-3:]) / max(len(reward[-3:]), 1):.3f} | "
            f"{sum(step_s) / max(len(step_s), 1):.0f} ({sum(gen_s) / max(len(gen_s), 1):.0f}) | "
            f"{info['wall_s'] / 60:.1f} | {(info['user_s'] + info['sys_s']) / 60:.1f} | "
            f"{info['peak_rss_gb']:.2f} |"
        )
        commands.append(f"    {info['command']}")
        if info.get("returncode") == 130:
            notes.append(
                f"- {method}: stopped with SIGINT after {steps} of {info['steps']} steps, when "
                "this session's CPU budget ran out: no final evaluation, no checkpoint; the steps "
                "shown are complete."
            )
        elif info.get("returncode"):
            notes.append(
                f"- {method}: exited with code {info['returncode']} (see "
                f"benchmarks/out/ppo_vs_grpo/{method}/log.txt)."
            )
    by_method = {}
    for method in ("ppo", "grpo"):
        path = OUT / method / "result.json"
        if path.is_file():
            by_method[method] = json.loads(path.read_text())["peak_rss_gb"]
    saving = ""
    if len(by_method) == 2:
        saving = (
            f"\nGRPO's peak RSS is {100 * (1 - by_method['grpo'] / by_method['ppo']):.0f}% below "
            f"PPO's ({by_method['grpo']:.2f} GB vs {by_method['ppo']:.2f} GB).\n"
        )
    text = "\n".join(
        [
            "# PPO vs GRPO on SmolLM2-135M-Instruct, addition task",
            "",
            f"Machine: {info_machine or machine()}. Written by `benchmarks/ppo_vs_grpo.py report` "
            f"on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
            "",
            "| method | steps | held-out greedy accuracy (128), before -> after | reward/mean per "
            "step | mean reward, last 3 steps | s/step: generation + training (generation) | wall, "
            "min (incl. 2 evals, load, save) | CPU time, min | peak RSS, GB |",
            "|-|-|-|-|-|-|-|-|-|",
            *rows,
            saving,
            "Commands (run from the repository root; `taskset` pins each run to one core):",
            "",
            *commands,
            "",
            *notes,
        ]
    )
    RESULTS.write_text(text.rstrip() + "\n")
    print(text)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train (skipping finished runs), then write the table")
    r.add_argument("--methods", nargs="+", choices=list(SCRIPTS), default=["ppo", "grpo"])
    r.add_argument(
        "--cpus",
        nargs="+",
        default=None,
        help="one core (taskset -c) per method; runs are concurrent",
    )
    r.add_argument(
        "--steps", type=int, default=5, help="training steps of each run (the CPU budget decides)"
    )
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--learning-rate", type=float, default=1e-5)
    r.add_argument("--temperature", type=float, default=0.7)
    r.add_argument("--eval-size", type=int, default=128)
    r.add_argument("--eval-batch-size", type=int, default=64)
    r.add_argument(
        "--threads", type=int, default=0, help="OMP_NUM_THREADS of each run (0 = torch's default)"
    )
    r.add_argument(
        "--ppo-extra",
        default="",
        help='more flags for ppo_lm.py, one string: --ppo-extra="--num-ppo-epochs 2"',
    )
    r.add_argument("--grpo-extra", default="", help="more flags for grpo_lm.py, one string")
    r.add_argument("--force", action="store_true", help="rerun methods whose result.json exists")
    sub.add_parser("report", help="write the table from finished runs")
    a = p.parse_args()
    run(a) if a.cmd == "run" else report(a)


if __name__ == "__main__":
    main()
