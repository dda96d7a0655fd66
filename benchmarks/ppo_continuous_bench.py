"""Benchmarks for ppo_continuous.py: returns at 1M steps, and steps/s against Stable-Baselines3.

Not a test: it runs full trainings in subprocesses and prints markdown tables.

Returns (3 seeds per env, runs one after another, each pinned to a CPU with taskset):
    python benchmarks/ppo_continuous_bench.py returns --env-ids HalfCheetah-v5 Hopper-v5 \\
        --seeds 1 2 3 --total-timesteps 1000000 --cpus 1
Speed, side by side with SB3 PPO + VecNormalize on the same settings (needs
`pip install stable-baselines3`; each pair runs at the same moment, one per core, then swapped):
    python benchmarks/ppo_continuous_bench.py sps --env-ids HalfCheetah-v5 --total-timesteps 102400
Any other flag is passed on to ppo_continuous.py (give the mode first):
    python benchmarks/ppo_continuous_bench.py sps --env-ids HalfCheetah-v5 \
        --total-timesteps 204800 --repeats 2 --cpus 0 1 --compile
Tables from runs already finished (nothing is re-run; finished runs are also skipped by default):
    python benchmarks/ppo_continuous_bench.py returns --report-only

Raw output (logs, summaries, TensorBoard runs) goes to benchmarks/out/ (gitignored).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "ppo_continuous.py"

# CleanRL ppo_continuous_action.py, 1M steps, 3 seeds, gymnasium v4 envs (openrlbenchmark).
CLEANRL_1M = {
    "HalfCheetah": (1442, 46),
    "Hopper": (2383, 272),
    "Walker2d": (2288, 572),
    "InvertedPendulum": (963, 22),
    "Humanoid": (716, 49),
}


def _taskset(cpu: str | None) -> list[str]:
    return ["taskset", "-c", cpu] if cpu is not None and shutil.which("taskset") else []


def _fmt(xs: list[float]) -> str:
    return f"{np.mean(xs):.0f} +- {np.std(xs):.0f}" if xs else "n/a"


# ----------------------------------------------------------------------------------------------
# returns
# ----------------------------------------------------------------------------------------------
def collect(rdir: Path, env_id: str, seed: int, eval_episodes: int) -> dict | None:
    """result.json of a finished run (its summary.json, plus a deterministic evaluation of its
    checkpoint); None while the run has no summary. Also picks up runs whose launcher died."""
    if (rdir / "result.json").is_file():
        return json.loads((rdir / "result.json").read_text())
    summaries = list((rdir / "runs").glob("*/summary.json"))
    if not summaries:
        return None
    s = json.loads(summaries[0].read_text())
    result = {
        "env_id": env_id,
        "seed": seed,
        "global_step": s["global_step"],
        "sps": s["sps"],
        "cpu_sps": s.get("cpu_sps"),
        "final_return_last10": s["final_return_last10"],
    }
    if eval_episodes > 0:  # deterministic policy, frozen statistics
        ev = subprocess.run(
            [
                sys.executable,
                str(SCRIPT),
                "--eval-checkpoint",
                str(summaries[0].parent / "checkpoint.pt"),
                "--eval-episodes",
                str(eval_episodes),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        line = [x for x in ev.stdout.splitlines() if x.startswith("eval ")]
        if line:  # "eval Env: N episodes, return M +- S"
            result["eval_return"] = float(line[-1].split("return ")[1].split(" +-")[0])
    (rdir / "result.json").write_text(json.dumps(result))
    return result


def progress(rdir: Path) -> tuple[int, float] | None:
    """(latest step, mean of the last 10 episodic returns) of an unfinished run, from its
    TensorBoard log."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = list((rdir / "runs").glob("*"))
    if not runs:
        return None
    ea = EventAccumulator(str(runs[0]), size_guidance={"scalars": 0})
    ea.Reload()
    if "charts/episodic_return" not in ea.Tags()["scalars"]:
        return None
    ev = ea.Scalars("charts/episodic_return")
    return ev[-1].step, float(np.mean([e.value for e in ev[-10:]]))


def run_returns(a: argparse.Namespace) -> None:
    out = Path(a.out_dir) / "returns"
    cpus = a.cpus or [None]
    procs: list[tuple[subprocess.Popen, str, int, Path]] = []
    todo = [
        (env_id, seed) for seed in a.seeds for env_id in a.env_ids
    ]  # every env gets seed 1 first
    k = 0
    while not a.report_only and (todo or procs):
        while todo and len(procs) < a.jobs:
            env_id, seed = todo.pop(0)
            rdir = out / f"{env_id}__s{seed}__{a.total_timesteps}"
            if not a.rerun and collect(rdir, env_id, seed, a.eval_episodes) is not None:
                continue
            log_path = rdir / "train.log"
            if log_path.is_file() and time.time() - log_path.stat().st_mtime < 120:
                print(
                    f"skip {env_id} seed {seed}: running elsewhere ({log_path} is being written)",
                    flush=True,
                )
                continue
            shutil.rmtree(rdir, ignore_errors=True)
            rdir.mkdir(parents=True)
            cmd = _taskset(cpus[k % len(cpus)]) + [
                sys.executable,
                str(SCRIPT),
                "--env-id",
                env_id,
                "--seed",
                str(seed),
                "--total-timesteps",
                str(a.total_timesteps),
                "--runs-dir",
                str(rdir / "runs"),
                *a.extra,
            ]
            k += 1
            print(" ".join(cmd), flush=True)
            log = open(rdir / "train.log", "w")
            procs.append(
                (
                    subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT),
                    env_id,
                    seed,
                    rdir,
                )
            )
        time.sleep(2)
        for p in list(procs):
            proc, env_id, seed, rdir = p
            if proc.poll() is None:
                continue
            procs.remove(p)
            result = collect(rdir, env_id, seed, a.eval_episodes)
            if proc.returncode != 0 or result is None:
                print(f"FAILED {env_id} seed {seed}: see {rdir / 'train.log'}", flush=True)
                continue
            print(f"done {env_id} seed {seed}: {result}", flush=True)

    for env_id in a.env_ids:  # runs finished by an earlier, interrupted launcher
        for seed in a.seeds:
            collect(out / f"{env_id}__s{seed}__{a.total_timesteps}", env_id, seed, a.eval_episodes)
    rows = [
        f"| env | ppo_continuous.py ({a.total_timesteps} steps, last 10 episodes) "
        "| deterministic eval | CleanRL (v4, published) | seeds done | steps/s |",
        "|-|-|-|-|-|-|",
    ]
    for env_id in a.env_ids:
        res = [
            json.loads(p.read_text())
            for p in sorted(out.glob(f"{env_id}__s*__{a.total_timesteps}/result.json"))
        ]
        res = [r for r in res if r["seed"] in a.seeds]
        ours = [r["final_return_last10"] for r in res if r["final_return_last10"] is not None]
        evals = [r["eval_return"] for r in res if "eval_return" in r]
        ref = CLEANRL_1M.get(env_id.split("-")[0])
        ref_s = f"{ref[0]} +- {ref[1]}" if ref else "n/a"
        rows.append(
            f"| {env_id} | {_fmt(ours)} | {_fmt(evals)} | {ref_s} | {len(res)} "
            f"({', '.join(str(r['seed']) for r in res)}) | {_fmt([r['sps'] for r in res])} |"
        )
    unfinished = []
    for env_id in a.env_ids:
        for seed in a.seeds:
            rdir = out / f"{env_id}__s{seed}__{a.total_timesteps}"
            if rdir.is_dir() and not (rdir / "result.json").is_file() and (pr := progress(rdir)):
                unfinished.append(f"| {env_id} | {seed} | {pr[0]} | {pr[1]:.0f} |")
    if unfinished:
        rows += [
            "",
            "Unfinished runs (latest TensorBoard point):",
            "",
            "| env | seed | step | last-10 return |",
            "|-|-|-|-|",
            *unfinished,
        ]
    print(
        "\nReturn = mean of the last 10 training episodes (stochastic policy, raw reward) per "
        "seed, then mean +- std over seeds; deterministic eval = mean action, frozen statistics, "
        f"{a.eval_episodes} episodes.\n"
    )
    print("\n".join(rows))


# ----------------------------------------------------------------------------------------------
# steps per second, side by side with Stable-Baselines3
# ----------------------------------------------------------------------------------------------
def sb3_worker(env_id: str, seed: int, total_timesteps: int, out_json: str) -> None:
    """SB3 PPO with ppo_continuous.py's hyperparameters and VecNormalize; writes its SPS."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    torch.set_num_threads(1)  # as ppo_continuous.py's --num-threads 1
    venv = VecNormalize(
        make_vec_env(env_id, n_envs=1, seed=seed), gamma=0.99, clip_obs=10.0, clip_reward=10.0
    )
    model = PPO(
        "MlpPolicy",
        venv,
        n_steps=2048,
        batch_size=64,
        n_epochs=10,
        learning_rate=lambda f: 3e-4 * f,
        gamma=0.99,
        gae_lambda=0.95,
        clip_range=0.2,
        clip_range_vf=0.2,
        ent_coef=0.0,
        vf_coef=0.5,
        max_grad_norm=0.5,
        policy_kwargs=dict(net_arch=dict(pi=[64, 64], vf=[64, 64]), activation_fn=torch.nn.Tanh),
        device="cpu",
        seed=seed,
        verbose=0,
    )
    t, t_cpu = time.time(), time.process_time()
    model.learn(total_timesteps)
    sps = model.num_timesteps / (time.time() - t)
    cpu_sps = model.num_timesteps / (time.process_time() - t_cpu)
    Path(out_json).write_text(
        json.dumps({"sps": sps, "cpu_sps": cpu_sps, "global_step": model.num_timesteps})
    )


def run_sps(a: argparse.Namespace) -> None:
    out = Path(a.out_dir) / "sps"
    out.mkdir(parents=True, exist_ok=True)
    cpus = a.cpus or ["0", "1"]
    rows = [
        "| env | pair | ppo_continuous.py steps/s: wall / CPU-time (core) "
        "| SB3 PPO steps/s: wall / CPU-time (core) "
        "| ratio wall | ratio CPU-time |",
        "|-|-|-|-|-|-|",
    ]
    ratios: dict[str, list[float]] = {}
    for env_id in a.env_ids:
        for rep in range(a.repeats):
            ours_cpu, sb3_cpu = (cpus[0], cpus[1]) if rep % 2 == 0 else (cpus[1], cpus[0])
            tag = f"{env_id}__rep{rep}"
            ours_dir, sb3_json = out / f"{tag}__ours", out / f"{tag}__sb3.json"
            shutil.rmtree(ours_dir, ignore_errors=True)
            sb3_json.unlink(missing_ok=True)
            cmd_ours = _taskset(ours_cpu) + [
                sys.executable,
                str(SCRIPT),
                "--env-id",
                env_id,
                "--seed",
                "1",
                "--total-timesteps",
                str(a.total_timesteps),
                "--runs-dir",
                str(ours_dir),
                "--save-every",
                "0",
                *a.extra,
            ]
            cmd_sb3 = _taskset(sb3_cpu) + [
                sys.executable,
                __file__,
                "sb3-worker",
                "--env-ids",
                env_id,
                "--total-timesteps",
                str(a.total_timesteps),
                "--out-json",
                str(sb3_json),
            ]
            print(" ".join(cmd_ours) + "\n" + " ".join(cmd_sb3), flush=True)
            with (
                open(out / f"{tag}__ours.log", "w") as lo,
                open(out / f"{tag}__sb3.log", "w") as ls,
            ):
                p1 = subprocess.Popen(cmd_ours, stdout=lo, stderr=subprocess.STDOUT, cwd=ROOT)
                p2 = subprocess.Popen(cmd_sb3, stdout=ls, stderr=subprocess.STDOUT, cwd=ROOT)
                p1.wait(), p2.wait()
            summaries = list(ours_dir.glob("*/summary.json"))
            if not summaries or not sb3_json.is_file():
                print(f"FAILED pair {tag}: see {out}", flush=True)
                continue
            o, b = json.loads(summaries[0].read_text()), json.loads(sb3_json.read_text())
            ratios.setdefault(env_id, []).append((o["sps"] / b["sps"], o["cpu_sps"] / b["cpu_sps"]))
            rows.append(
                f"| {env_id} | {rep + 1} | {o['sps']:.0f} / {o['cpu_sps']:.0f} ({ours_cpu}) | "
                f"{b['sps']:.0f} / {b['cpu_sps']:.0f} ({sb3_cpu}) | {o['sps'] / b['sps']:.2f}x | "
                f"{o['cpu_sps'] / b['cpu_sps']:.2f}x |"
            )
            print(rows[-1], flush=True)
    print(
        f"\n{a.total_timesteps} steps per run, 1 env, 2048 steps x 10 epochs x 32 minibatches, "
        "torch threads 1, both runs of a pair at the same moment, one per core, cores swapped "
        "between pairs.\n"
    )
    print("\n".join(rows))
    print(
        "\nwall: steps / elapsed seconds; CPU-time: steps / seconds of CPU the process itself used "
        "(insensitive to other load on a shared machine)."
    )
    for env_id, r in ratios.items():
        w, c = np.mean([x[0] for x in r]), np.mean([x[1] for x in r])
        print(
            f"{env_id}: ppo_continuous.py / SB3 = {w:.2f}x wall, {c:.2f}x CPU-time "
            f"(mean over {len(r)} pairs)"
        )


def main() -> None:
    global SCRIPT
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("mode", choices=["returns", "sps", "sb3-worker"])
    p.add_argument("--env-ids", nargs="+", default=["HalfCheetah-v5", "Hopper-v5"])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument(
        "--total-timesteps",
        type=int,
        default=None,
        help="per run (default: 1000000 for returns, 102400 for sps)",
    )
    p.add_argument("--jobs", type=int, default=1, help="returns: runs at the same time")
    p.add_argument(
        "--cpus", nargs="+", default=None, help="CPUs to pin runs to with taskset (round robin)"
    )
    p.add_argument(
        "--repeats", type=int, default=2, help="sps: pairs per env (cores swapped each time)"
    )
    p.add_argument(
        "--eval-episodes",
        type=int,
        default=10,
        help="returns: deterministic eval episodes (0: none)",
    )
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out"))
    p.add_argument(
        "--report-only", action="store_true", help="returns: only print the table of finished runs"
    )
    p.add_argument(
        "--rerun", action="store_true", help="returns: re-run seeds that already finished"
    )
    p.add_argument(
        "--script", default=str(SCRIPT), help="the ppo_continuous.py to run (e.g. a frozen copy)"
    )
    p.add_argument("--out-json", default=None, help=argparse.SUPPRESS)
    a, a.extra = p.parse_known_args()  # the rest: flags for ppo_continuous.py
    SCRIPT = Path(a.script).resolve()
    if a.total_timesteps is None:
        a.total_timesteps = 102_400 if a.mode == "sps" else 1_000_000
    if a.mode == "returns":
        run_returns(a)
    elif a.mode == "sps":
        run_sps(a)
    else:
        sb3_worker(a.env_ids[0], a.seeds[0], a.total_timesteps, a.out_json)


if __name__ == "__main__":
    main()
