"""Several processes: `torchrun --nproc_per_node 2` (gloo, CPU) takes the same steps as one process.

The gloo runs pass ``--device cpu``, so they test the same thing on a machine with GPUs.

The 2-process runs are launched the way users launch them, ``python -m torch.distributed.run
--nproc_per_node 2 --standalone script.py ...``, and their per-step scalars are read back from rank
0's TensorBoard events. Each row draws from its own generator seeded by (seed, step, round, its
place in the whole batch), so at the default ``--generation-groups-per-call 0`` (a process's groups
in one call) both runs sample the same completions; everything after that is the same arithmetic
summed in a different order, so losses agree to float32 rounding (checked to 1e-5 relative or 1e-6
absolute; measured: at most 4e-6 relative, 8e-8 absolute, on a loss of 0.02).
"""

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, tb_scalars, torchrun

import common
import grpo_lm
import ppo_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

# the tail of every run below: a tiny evaluation, no samples or checkpoints between steps, the CPU
# in float32 (the torchrun processes do not see conftest's bf16 patch); one thread each (conftest's
# torchrun sets OMP_NUM_THREADS=1, the fixture below the in-process runs')
QUIET = "--eval-size 2 --eval-every 0 --sample-every 0 --save-every 0".split()
QUIET += ["--device", "cpu", "--no-bf16"]
DIGITS = "def digits(completion, example):\n    return sum(map(str.isdigit, completion)) / 8\n"


def varied_reward(tmp_path) -> list[str]:
    """--reward-fn flags of a reward that differs within a group (the digits a completion holds),
    so that the policy moves away from its reference."""
    (tmp_path / "digits.py").write_text(DIGITS)
    return ["--reward-fn", f"{tmp_path / 'digits.py'}:digits"]


def scalars(run_dir) -> dict[str, list[float]]:
    """Every scalar series of the (single) TensorBoard event file in ``run_dir``, in step order: the
    values."""
    return {tag: [value for _, value in series] for tag, series in tb_scalars(run_dir).items()}


def assert_same_run(one: dict, two: dict, keys) -> None:
    for key in keys:
        assert len(two[key]) == len(one[key]) > 0, (key, len(two[key]), len(one[key]))
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key


def only_run_dir(runs_dir):
    """Rank 0 alone writes: one run directory (names carry a timestamp), one event file, one
    checkpoint."""
    runs = list(runs_dir.iterdir())
    assert len(runs) == 1, runs
    assert len(list(runs[0].glob("events.out.tfevents.*"))) == 1
    assert (runs[0] / "checkpoint.pt").is_file() and (
        runs[0] / "final_model" / "config.json"
    ).is_file()
    return runs[0]


def test_grpo_two_processes_take_the_same_steps_as_one(tiny_model_dir, tmp_path):
    # dapo (global token count), mu 2 (stored old log probs, ratio != 1), batch-std advantages
    # (gathered rewards)
    flags = [
        "--model-name-or-path",
        str(tiny_model_dir),
        "--total-steps",
        "3",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--max-new-tokens",
        "8",
        "--learning-rate",
        "1e-2",
        "--temperature",
        "1.0",
        "--beta",
        "0.1",
        "--mu",
        "2",
        *varied_reward(tmp_path),
        "--loss-type",
        "dapo",
        "--scale-rewards",
        "batch",
        "--micro-batch-size",
        "4",
        "--seed",
        "3",
        *QUIET,
    ]
    keys = (
        "reward/mean",
        "reward/std",
        "completion/length_mean",
        "loss/policy",
        "loss/kl",
        "loss/ratio_max",
        "optim/grad_norm",
    )
    one = grpo_lm.main(
        common.parse_args(
            grpo_lm.Args, [*flags, "--runs-dir", str(tmp_path / "one"), "--total-steps", "4"]
        )
    )
    out = torchrun("grpo_lm.py", [*flags, "--runs-dir", str(tmp_path / "two")])
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_run_dir(tmp_path / "two")
    assert_same_run({k: v[:3] for k, v in one.items()}, scalars(run), keys)
    assert (
        abs(one["loss/policy"][2]) > 1e-4
        and one["loss/kl"][2] > 0
        and one["loss/ratio_max"][2] != 1.0
    )
    # the 2-process checkpoint (step 3) resumed by one process: step 4 is the 1-process run's step 4
    resumed = grpo_lm.main(
        common.parse_args(
            grpo_lm.Args, ["--resume", str(run / "checkpoint.pt"), "--total-steps", "4"]
        )
    )
    assert_same_run({k: v[3:] for k, v in one.items()}, resumed, keys)


def test_grpo_process_supervision_and_reward_model_training_on_two_processes(
    tiny_model_dir, tiny_reward_model_dir, tmp_path
):
    # process supervision (step rewards gathered for --scale-rewards batch; the random tiny model
    # writes no checkable equation, so each completion's one step is its final answer, scored by the
    # reward model), the reward model scoring each process's share, Algorithm 1 with 2 iterations:
    # the reward model is retrained on every process's samples (gathered) with replay, and the
    # reference is reset to the policy
    flags = [
        "--model-name-or-path",
        str(tiny_model_dir),
        "--reward-model-path",
        str(tiny_reward_model_dir),
        "--task",
        "multistep",
        "--supervision",
        "process",
        "--scale-rewards",
        "batch",
        "--train-reward-model",
        "--iterations",
        "2",
        "--rm-learning-rate",
        "1e-2",
        "--rm-eval-fraction",
        "0.25",
        "--total-steps",
        "4",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--max-new-tokens",
        "8",
        "--learning-rate",
        "1e-2",
        "--temperature",
        "1.0",
        "--beta",
        "0.1",
        "--micro-batch-size",
        "4",
        "--seed",
        "2",
        *QUIET,
    ]
    one = grpo_lm.main(
        common.parse_args(grpo_lm.Args, [*flags, "--runs-dir", str(tmp_path / "one")])
    )
    out = torchrun("grpo_lm.py", [*flags, "--runs-dir", str(tmp_path / "two")])
    assert out.returncode == 0, out.stderr[-3000:]
    two = scalars(only_run_dir(tmp_path / "two"))
    assert_same_run(
        one,
        two,
        (
            "reward/mean",
            "reward/verifiable_mean",
            "process/steps_per_completion",
            "loss/policy",
            "loss/kl",
            "optim/grad_norm",
            "reward_model/train_mse",
            "reward_model/heldout_accuracy",
            "reward_model/train_size",
        ),
    )
    assert (
        one["loss/kl"][2] == 0.0 and one["loss/kl"][1] > 0
    )  # step 3 starts iteration 2: reference <- policy
    assert one["reward_model/train_size"] == [
        24,
        27,
    ]  # 32 samples, 8 held out; then 24 new + 3 replayed (10%)
    assert max(one["optim/grad_norm"]) > 0


def test_ppo_two_processes_take_the_same_steps_as_one(tiny_model_dir, tmp_path):
    # global advantage and reward whitening, global KL for the adaptive controller, value gradients
    # summed too
    flags = [
        "--model-name-or-path",
        str(tiny_model_dir),
        "--total-steps",
        "3",
        "--prompts-per-step",
        "8",
        "--max-new-tokens",
        "8",
        "--learning-rate",
        "1e-2",
        "--temperature",
        "1.0",
        "--num-ppo-epochs",
        "2",
        *varied_reward(tmp_path),
        "--micro-batch-size",
        "4",
        "--whiten-rewards",
        "--adaptive-kl-target",
        "0.01",
        "--adaptive-kl-horizon",
        "8",
        "--seed",
        "5",
        *QUIET,
    ]
    one = ppo_lm.main(common.parse_args(ppo_lm.Args, [*flags, "--runs-dir", str(tmp_path / "one")]))
    out = torchrun("ppo_lm.py", [*flags, "--runs-dir", str(tmp_path / "two")])
    assert out.returncode == 0, out.stderr[-3000:]
    two = scalars(only_run_dir(tmp_path / "two"))
    assert_same_run(
        one,
        two,
        (
            "reward/mean",
            "loss/policy",
            "loss/value",
            "loss/kl",
            "kl/beta",
            "value/mean",
            "optim/grad_norm",
            "optim/value_grad_norm",
        ),
    )
    assert (
        abs(one["loss/policy"][2]) > 1e-4 and one["loss/kl"][2] > 0 and one["value/mean"][2] != 0.0
    )
    # the controller's betas, derived from the logged KL per sequence: beta_1 = --beta, then
    # beta_t+1 = adaptive_kl_coef(beta_t, KL_t) with target 0.01, 8 sequences, horizon 8
    expected = [0.05]
    for kl in one["kl/sequence_mean"][:-1]:
        expected.append(
            ppo_lm.adaptive_kl_coef(expected[-1], kl, target=0.01, num_sequences=8, horizon=8)
        )
    assert one["kl/beta"] == pytest.approx(expected, rel=1e-6) and len(set(expected)) == 3


@pytest.mark.parametrize(
    "script, message",
    [
        ("grpo_lm.py", "--prompts-per-step must be divisible by the 2 torchrun processes"),
        ("ppo_lm.py", "--prompts-per-step 3 must be divisible by the world size 2 (the number"),
    ],
)
def test_batch_not_divisible_by_the_world_size_is_one_line(script, message, tmp_path):
    # what each torchrun worker sees: its environment says 2 processes; the check runs before the
    # process group
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    out = subprocess.run(
        [sys.executable, str(ROOT / script), "--prompts-per-step", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: {message}")


@pytest.mark.parametrize("rank", [0, 1])
def test_more_processes_than_gpus_are_refused_by_every_process(rank, monkeypatch):
    # torchrun --nproc_per_node 2 on a 1-GPU machine: rank 0 too refuses before it joins the
    # process group (it waited there for rank 1, which had refused, until torchrun ended both)
    env = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2)
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "init_process_group", None)  # not to be reached
    with pytest.raises(
        common.UsageError,
        match=r"^--device: torchrun started 2 processes here, with 1 GPU\(s\) visible; use "
        r"--nproc_per_node <= 1, or --device cpu$",
    ):
        common.start_processes("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("script", ["grpo_lm.py", "ppo_lm.py"])
def test_nccl_on_one_gpu(script, tiny_model_dir, tmp_path):
    # the multi-GPU code path (NCCL process group, gradient all-reduce on cuda:LOCAL_RANK, bf16
    # autocast) on the one GPU a test machine has; more processes than GPUs are refused in one line
    flags = [
        "--model-name-or-path",
        str(tiny_model_dir),
        "--total-steps",
        "2",
        "--prompts-per-step",
        "2",
        "--max-new-tokens",
        "8",
        "--eval-size",
        "2",
        "--eval-every",
        "0",
        "--sample-every",
        "0",
        "--device",
        "cuda",
        *(["--group-size", "4"] if script == "grpo_lm.py" else []),
    ]
    out = torchrun(script, [*flags, "--runs-dir", str(tmp_path / "one")], nproc=1)
    assert out.returncode == 0, out.stderr[-3000:]
    s = scalars(only_run_dir(tmp_path / "one"))
    assert len(s["loss/policy"]) == 2 and s["memory/peak_cuda_gb"][-1] > 0
    gpus = torch.cuda.device_count()
    out = torchrun(script, [*flags, "--runs-dir", str(tmp_path / "many")], nproc=gpus + 1)
    refused = f"torchrun started {gpus + 1} processes here, with {gpus} GPU(s) visible"
    assert out.returncode != 0 and f"error: --device: {refused}" in out.stderr


def test_grpo_lora_two_processes_take_the_same_steps_as_one(tiny_lora_model_dir, tmp_path):
    # issue 16: --lora-rank under torchrun: only the adapters' gradients are summed; the reference
    # is the policy with its adapter disabled on every process
    flags = [
        "--model-name-or-path",
        str(tiny_lora_model_dir),
        "--total-steps",
        "2",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--max-new-tokens",
        "8",
        "--learning-rate",
        "3e-2",
        "--temperature",
        "1.0",
        "--beta",
        "0.1",
        "--lora-rank",
        "4",
        *varied_reward(tmp_path),
        "--micro-batch-size",
        "4",
        "--seed",
        "3",
        *QUIET,
    ]
    one = grpo_lm.main(
        common.parse_args(grpo_lm.Args, [*flags, "--runs-dir", str(tmp_path / "one")])
    )
    out = torchrun("grpo_lm.py", [*flags, "--runs-dir", str(tmp_path / "two")])
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_run(
        one,
        scalars(only_run_dir(tmp_path / "two")),
        ("reward/mean", "loss/policy", "loss/kl", "optim/grad_norm"),
    )
    assert one["loss/kl"][1] > 0 and one["optim/grad_norm"][0] > 0


RANK_REWARDS = """import os


def fails_on_rank_1(completion, example):
    if os.environ["RANK"] == "1":
        raise ValueError("no score for this one")
    return 1.0


def flat_on_rank_0(completion, example):  # rank 0's groups tie: it samples more rounds
    return 1.0 if os.environ["RANK"] == "0" else float(len(completion) % 2)
"""


def rank_flags(script: str, model_dir, tmp_path, *flags) -> list[str]:
    (tmp_path / "rank_rewards.py").write_text(RANK_REWARDS)
    size = ["--group-size", "4"] if script == "grpo_lm.py" else []
    return [
        "--model-name-or-path",
        str(model_dir),
        "--total-steps",
        "2",
        "--prompts-per-step",
        "4",
        *size,
        "--max-new-tokens",
        "6",
        "--eval-size",
        "2",
        "--eval-every",
        "0",
        "--sample-every",
        "0",
        "--runs-dir",
        str(tmp_path / "runs"),
        "--device",
        "cpu",
        *flags,
    ]


@pytest.mark.parametrize("script", ["grpo_lm.py", "ppo_lm.py"])
def test_a_failure_on_one_process_ends_every_process_with_one_line(
    script, tiny_model_dir, tmp_path
):
    # user code that fails on rank 1's share only: rank 1 prints its line, on a line of its own
    # (rank 0's progress bar ends without a newline), and rank 0, whose collective fails when rank 1
    # ends, says in one line that another process failed: no traceback from either process (the
    # one traceback is torchrun's own report of the failed processes)
    flags = rank_flags(
        script,
        tiny_model_dir,
        tmp_path,
        "--reward-fn",
        f"{tmp_path}/rank_rewards.py:fails_on_rank_1",
    )
    out = torchrun(script, flags, cwd=tmp_path, timeout=60)
    err = out.stdout + out.stderr
    lines = [line for line in err.splitlines() if "error:" in line]
    assert out.returncode != 0 and len(lines) == 2, err[-3000:]
    failed = "error: reward function fails_on_rank_1 raised ValueError: no score for this one"
    assert lines[0].startswith(failed) and lines[0].endswith(" (rank 1)"), err[-3000:]
    assert lines[1] == "error: another process failed; its error is above", err[-3000:]
    ours = [
        f'File "{ROOT / name}"' for name in ("grpo_lm.py", "ppo_lm.py", "common.py", "tasks.py")
    ]
    assert "[rank" not in err and not any(where in err for where in ours), err[-3000:]
    assert err.count("Traceback") == 1 and "ChildFailedError" in err, err[-3000:]  # torchrun's


def test_dynamic_sampling_with_a_reward_function_runs_on_two_processes(tiny_model_dir, tmp_path):
    # issue 22: the ranks sample different numbers of rounds; reward() all-gathered every round and
    # hung
    flags = rank_flags(
        "grpo_lm.py",
        tiny_model_dir,
        tmp_path,
        "--dynamic-sampling",
        "--max-sampling-rounds",
        "3",
        "--reward-fn",
        f"{tmp_path}/rank_rewards.py:flat_on_rank_0",
    )
    out = torchrun("grpo_lm.py", flags, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    run = next((tmp_path / "runs").iterdir())
    logged = scalars(run)
    assert logged["sampling/rounds"] == [3.0, 3.0]  # rank 0 sampled every round it may
    assert len(logged["reward/flat_on_rank_0/mean"]) == 2
