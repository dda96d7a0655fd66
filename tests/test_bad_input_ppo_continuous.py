"""Bad input to ppo_continuous.py: one `error:` line naming the flag or file, exit code 2, no
traceback, and the checkpoint already on disk byte-identical afterwards (issue 14).

The table runs in-process through ``ppo_continuous.cli(argv)``, the function the ``__main__`` block
calls. Cheap cases must fail before any environment exists (``gym.make`` and ``make_envs`` fail
the test if called); cases that need the env's spaces may make one env to read them, never the
vector env. Flag constraints are pydantic's words ("must be greater than 0, got -1.0").
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from conftest import assert_one_line_error  # noqa: E402

pytest.importorskip("gymnasium")  # without it (requirements.txt): a skip, not an error
import ppo_continuous as pc  # noqa: E402

torch.set_num_threads(1)
CHEAP, ENV, RUN = (
    "cheap",
    "env",
    "run",
)  # fails before any env / after reading the env's spaces / mid-run


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A finished 256-step InvertedPendulum run and files that are not its checkpoint."""
    root = tmp_path_factory.mktemp("bad_input")
    s = pc.train(
        pc.validate(
            pc.Args(
                env_id="InvertedPendulum-v5",
                num_steps=128,
                num_minibatches=4,
                update_epochs=1,
                total_timesteps=256,
                seed=2,
                runs_dir=str(root / "runs"),
            )
        )
    )
    ckpt = Path(s["run_dir"]) / "checkpoint.pt"
    healthy = pc.load_checkpoint(ckpt)
    (root / "junk.pt").write_bytes(b"not a checkpoint")
    (root / "a_file").write_text("x")
    pc.atomic_save({**healthy, "script": "grpo_lm.py"}, root / "other_script.pt")
    pc.atomic_save(
        {"policy": {}, "step": 3, "args": {"model_name_or_path": "m", "group_size": 4}},
        root / "legacy_lm.pt",
    )
    pc.atomic_save(
        {**healthy, "args": {**healthy["args"], "old_flag": 1}}, root / "removed_flag.pt"
    )
    pc.atomic_save(
        {**healthy, "args": {**healthy["args"], "gamma": "0.99"}}, root / "wrong_type.pt"
    )
    pc.atomic_save(
        {key: value for key, value in healthy.items() if key != "norm"}, root / "no_norm.pt"
    )
    nan_agent = {
        **healthy["agent"],
        "actor_logstd": torch.full_like(healthy["agent"]["actor_logstd"], float("nan")),
    }
    torch.save(
        {**healthy, "agent": nan_agent}, root / "nan.pt"
    )  # what a diverged run saved before they were refused
    hopper_agent = pc.Agent(11, 3).state_dict()  # networks of another env under this run's flags
    pc.atomic_save({**healthy, "agent": hopper_agent}, root / "wrong_networks.pt")
    return {"ckpt": ckpt, "root": root, "bytes": ckpt.read_bytes()}


def _argv(argv: list[str], files: dict[str, Path]) -> list[str]:
    return [
        a.replace("{ckpt}", str(files["ckpt"])).replace("{root}", str(files["root"])) for a in argv
    ]


SMALL = [
    "--env-id",
    "InvertedPendulum-v5",
    "--num-steps",
    "128",
    "--num-minibatches",
    "4",
    "--total-timesteps",
    "256",
]

CASES = [
    # (argv, text the error line must contain, stage)
    (["--seed", "abc"], "--seed: invalid literal for int()", CHEAP),
    (["--seed", "-1"], "--seed: must be greater than or equal to 0, got -1", CHEAP),
    (["--seed", "4294967296"], "--seed: must be less than or equal to 4294967295", CHEAP),
    (["--learning-rate", "nan"], "--learning-rate: must be a finite number, got nan", CHEAP),
    (["--learning-rate", "inf"], "--learning-rate: must be a finite number, got inf", CHEAP),
    (["--learning-rate", "0"], "--learning-rate: must be greater than 0, got 0.0", CHEAP),
    (["--learning-rate", "-3e-4"], "--learning-rate: must be greater than 0", CHEAP),
    (["--max-grad-norm", "-1"], "--max-grad-norm: must be greater than 0", CHEAP),
    (["--max-grad-norm", "0"], "--max-grad-norm: must be greater than 0", CHEAP),
    (["--max-grad-norm", "nan"], "--max-grad-norm: must be a finite number", CHEAP),
    (["--vf-coef", "-1"], "--vf-coef: must be greater than or equal to 0", CHEAP),
    (["--ent-coef", "nan"], "--ent-coef: must be a finite number", CHEAP),
    (["--ent-coef", "inf"], "--ent-coef: must be a finite number", CHEAP),
    (["--ent-coef", "-0.01"], "--ent-coef: must be greater than or equal to 0", CHEAP),
    (["--num-threads", "-1"], "--num-threads: must be greater than or equal to 0", CHEAP),
    (["--num-threads", "1000000000"], "--num-threads: must be less than or equal to", CHEAP),
    (["--gamma", "1.5"], "--gamma: must be less than or equal to 1, got 1.5", CHEAP),
    (["--gae-lambda", "nan"], "--gae-lambda: must be a finite number", CHEAP),
    (["--clip-coef", "0"], "--clip-coef: must be greater than 0", CHEAP),
    (["--target-kl", "-1"], "--target-kl: must be greater than 0", CHEAP),
    (["--target-kl", "nan"], "--target-kl: must be a finite number", CHEAP),
    (["--target-kl", "abc"], "--target-kl: ", CHEAP),
    (["--obs-clip", "0"], "--obs-clip: must be greater than 0", CHEAP),
    (["--reward-clip", "-1"], "--reward-clip: must be greater than 0", CHEAP),
    (["--num-envs", "0"], "--num-envs: must be greater than or equal to 1", CHEAP),
    (["--num-envs", "1.5"], "--num-envs: invalid literal for int()", CHEAP),
    (["--num-steps", "0"], "--num-steps: must be greater than or equal to 1", CHEAP),
    (["--num-minibatches", "0"], "--num-minibatches: must be greater than or equal to 1", CHEAP),
    (
        ["--num-minibatches", "3"],
        "--num-minibatches: must divide num_envs * num_steps = 2048",
        CHEAP,
    ),
    (
        ["--num-steps", "64", "--num-minibatches", "64"],
        "--num-minibatches: each minibatch needs at least 2",
        CHEAP,
    ),
    (["--update-epochs", "0"], "--update-epochs: must be greater than or equal to 1", CHEAP),
    (["--total-timesteps", "100"], "--total-timesteps: must be at least one rollout", CHEAP),
    (["--save-every", "-1"], "--save-every: must be greater than or equal to 0", CHEAP),
    (["--eval-episodes", "0"], "--eval-episodes: must be greater than or equal to 1", CHEAP),
    (
        ["--num-steps", "1000000000000", "--total-timesteps", "1000000000000"],
        "--num-steps/--num-envs: a rollout of",
        CHEAP,
    ),
    (
        [
            "--num-envs",
            "100000000",
            "--num-steps",
            "100000",
            "--num-minibatches",
            "1",
            "--total-timesteps",
            "10000000000000",
        ],
        "GiB of memory, this machine has",
        CHEAP,
    ),
    (
        ["--vector-mode", "threads"],
        "invalid choice 'threads' for argument '--vector-mode'. Expected one of ('sync', 'async')",
        CHEAP,
    ),
    (["--no-such-flag", "1"], "Unrecognized options: --no-such-flag", CHEAP),
    (["--batch-size", "64"], "Unrecognized options: --batch-size", CHEAP),  # computed, not a flag
    (["--num-iterations", "3"], "Unrecognized options: --num-iterations", CHEAP),
    (["--exp-name", "a/b"], "--exp-name: ", CHEAP),
    (["--exp-name", ""], "--exp-name: ", CHEAP),
    (["--runs-dir", "{root}/a_file"], "--runs-dir: cannot write in", CHEAP),
    (["--runs-dir", "{root}/a_file/runs"], "--runs-dir: cannot write in", CHEAP),
    (["--runs-dir", "/proc/runs"], "--runs-dir: cannot write in /proc/runs", CHEAP),
    (
        ["--resume", "{root}/missing.pt"],
        "--resume: cannot read checkpoint {root}/missing.pt",
        CHEAP,
    ),
    (["--resume", "{root}"], "--resume: ", CHEAP),
    (["--resume", "{root}/junk.pt"], "--resume: cannot read checkpoint", CHEAP),
    (
        ["--resume", "{root}/other_script.pt"],
        "--resume: {root}/other_script.pt was written by grpo_lm.py",
        CHEAP,
    ),
    (
        ["--resume", "{root}/legacy_lm.pt"],
        "--resume: {root}/legacy_lm.pt is not a ppo_continuous.py checkpoint",
        CHEAP,
    ),
    (["--resume", "{root}/no_norm.pt", "--total-timesteps", "512"], "--resume: ", CHEAP),
    (["--resume", "{ckpt}"], "--total-timesteps: this run already reached step 256", CHEAP),
    (
        ["--resume", "{ckpt}", "--total-timesteps", "512", "--num-envs", "2"],
        "--num-envs: cannot change when resuming",
        CHEAP,
    ),
    (
        [
            "--resume",
            "{ckpt}",
            "--total-timesteps",
            "512",
            "--num-steps",
            "256",
            "--num-minibatches",
            "4",
        ],
        "--num-steps: cannot change when resuming (this run was started with 128)",
        CHEAP,
    ),
    (
        ["--resume", "{ckpt}", "--total-timesteps", "512", "--env-id", "Hopper-v5"],
        "--env-id: cannot change when resuming (this run was started with 'InvertedPendulum-v5')",
        CHEAP,
    ),
    (
        ["--resume", "{ckpt}", "--total-timesteps", "512", "--runs-dir", "elsewhere"],
        "--runs-dir: cannot change",
        CHEAP,
    ),
    (
        ["--resume", "{ckpt}", "--total-timesteps", "512", "--ent-coef", "nan"],
        "--ent-coef: must be a finite number",
        CHEAP,
    ),
    (["--resume", "{ckpt}", "--eval-checkpoint", "{ckpt}"], "--eval-checkpoint: ", CHEAP),
    (
        ["--resume", "{root}/nan.pt", "--total-timesteps", "512"],
        "--resume: {root}/nan.pt holds non-finite values in agent.actor_logstd",
        CHEAP,
    ),
    (
        ["--eval-checkpoint", "{root}/nan.pt"],
        "--eval-checkpoint: {root}/nan.pt holds non-finite values",
        CHEAP,
    ),
    (
        ["--eval-checkpoint", "{root}/missing.pt"],
        "--eval-checkpoint: cannot read checkpoint {root}/missing.pt",
        CHEAP,
    ),
    (["--eval-checkpoint", "{root}/junk.pt"], "--eval-checkpoint: cannot read checkpoint", CHEAP),
    (
        ["--eval-checkpoint", "{root}/other_script.pt"],
        "--eval-checkpoint: {root}/other_script.pt was written by",
        CHEAP,
    ),
    (
        ["--eval-checkpoint", "{root}/legacy_lm.pt"],
        "--eval-checkpoint: {root}/legacy_lm.pt is not a",
        CHEAP,
    ),
    (
        ["--resume", "{root}/removed_flag.pt", "--total-timesteps", "512"],
        "--resume: {root}/removed_flag.pt is not a ppo_continuous.py checkpoint of this version "
        "(--old-flag: Unexpected keyword argument, got 1)",
        CHEAP,
    ),
    (
        ["--eval-checkpoint", "{root}/removed_flag.pt"],
        "--eval-checkpoint: {root}/removed_flag.pt is not a ppo_continuous.py checkpoint of this "
        "version (--old-flag: Unexpected keyword argument, got 1)",
        CHEAP,
    ),
    (
        ["--resume", "{root}/wrong_type.pt", "--total-timesteps", "512"],
        "--resume: {root}/wrong_type.pt is not a ppo_continuous.py checkpoint of this version "
        "(--gamma: must be a valid number, got '0.99')",
        CHEAP,
    ),
    (
        ["--eval-checkpoint", "{root}/wrong_type.pt"],
        "{root}/wrong_type.pt is not a ppo_continuous.py checkpoint of this version "
        "(--gamma: must be a valid number, got '0.99')",
        CHEAP,
    ),
    (["--env-id", "NoSuchEnv-v9"], "--env-id: cannot make 'NoSuchEnv-v9'", ENV),
    (["--env-id", "CartPole-v1"], "--env-id: CartPole-v1 has Discrete actions", ENV),
    (
        ["--resume", "{root}/wrong_networks.pt", "--total-timesteps", "512"],
        "--resume: the networks in {root}/wrong_networks.pt do not fit InvertedPendulum-v5",
        ENV,
    ),
    (
        ["--eval-checkpoint", "{root}/wrong_networks.pt"],
        "--eval-checkpoint: the networks in {root}/wrong_networks.pt do not fit "
        "InvertedPendulum-v5",
        ENV,
    ),
    (
        [
            "--resume",
            "{ckpt}",
            "--total-timesteps",
            "1024",
            "--learning-rate",
            "1e30",
            "--no-anneal-lr",
        ],
        "check --learning-rate",
        RUN,
    ),
    (
        [*SMALL, "--learning-rate", "1e30", "--runs-dir", "{root}/nan_runs"],
        "no checkpoint was written yet",
        RUN,
    ),
]


def _forbid(*_, **__):
    pytest.fail("an environment was created before the bad input was reported")


@pytest.mark.parametrize("argv, expected, stage", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_input_is_one_line_and_keeps_the_checkpoint(
    argv, expected, stage, *, files, capsys, monkeypatch
):
    monkeypatch.chdir(files["root"])
    if stage in (CHEAP, ENV):
        monkeypatch.setattr(pc, "make_envs", _forbid)
    if stage == CHEAP:
        monkeypatch.setattr(pc.gym, "make", _forbid)
    assert_one_line_error(
        pc.cli, _argv(argv, files), _argv([expected], files)[0], capsys, checkpoint=files["ckpt"]
    )
    assert files["ckpt"].read_bytes() == files["bytes"]


def test_a_new_run_does_not_overwrite_a_run_directory_with_a_checkpoint(files, capsys, monkeypatch):
    # two runs of the same env and seed started in the same second get the same default name
    run = files["ckpt"].parent
    started = float(run.name.rsplit("__", 1)[1])  # {env}__{exp_name}__{seed}__{unix time}
    monkeypatch.setattr(pc.time, "time", lambda: started)
    monkeypatch.setattr(pc, "make_envs", _forbid)
    with pytest.raises(SystemExit) as exit_:
        pc.cli([*SMALL, "--seed", "2", "--runs-dir", str(run.parent)])
    assert exit_.value.code == 2 and capsys.readouterr().err == (
        f"error: {run} holds a checkpoint: resume it with --resume, or pick another --exp-name\n"
    )
    assert files["ckpt"].read_bytes() == files["bytes"]


def test_resume_into_an_unwritable_run_directory_is_one_line(files, capsys, tmp_path):
    chattr = shutil.which("chattr")
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(files["ckpt"], run / "checkpoint.pt")
    if (
        chattr is None
        or subprocess.run([chattr, "+i", str(run)], capture_output=True).returncode != 0
    ):
        pytest.skip("cannot make an immutable directory here (needs chattr and root)")
    try:
        with pytest.raises(SystemExit) as exit_:
            pc.cli(["--resume", str(run / "checkpoint.pt"), "--total-timesteps", "512"])
    finally:
        subprocess.run([chattr, "-i", str(run)], check=True)
    err = capsys.readouterr().err
    assert (
        exit_.value.code == 2
        and err == f"error: --resume: cannot write in {run} ({run}: Operation not permitted)\n"
    )


def _script(*argv, env=None, cwd=None):
    return subprocess.run(
        [sys.executable, str(ROOT / "ppo_continuous.py"), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
    )


def test_real_command_line(tmp_path):
    p = _script("--seed", "abc", cwd=tmp_path)
    assert (p.returncode, p.stderr) == (
        2,
        "error: --seed: invalid literal for int() with base 10: 'abc'\n",
    )
    p = _script("--gamma", "2", cwd=tmp_path)
    assert (p.returncode, p.stderr) == (
        2,
        "error: --gamma: must be less than or equal to 1, got 2.0\n",
    )
    p = _script("--help", cwd=tmp_path)
    assert p.returncode == 0 and "--learning-rate" in p.stdout and "--batch-size" not in p.stdout
    assert not list(tmp_path.iterdir())
