"""Shared fixtures: tiny randomly initialised models and a character-level tokenizer, built
offline."""

import os
import signal
import string
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHARS = string.digits + string.ascii_letters + " +-*=?.,:#\n"


def make_tokenizer():
    """A character-level tokenizer: one token per character, plus <unk>, <pad> and <eos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<eos>",
        padding_side="left",
    )


def make_tiny_model(
    path: Path,
    seed: int = 0,
    kind: str = "causal-lm",
    init_std: float = 0.02,
    *,
    positions: int = 256,
    tied: bool = True,
) -> Path:
    """Save a 2-layer Llama (hidden size 32) with the character tokenizer to ``path`` (``tied``:
    the LM head is the embedding).

    ``init_std``: the weights' initial std (transformers' default 0.02 gives this tiny model logits
    within about +-0.6, a scale that only its embeddings and norms can grow; LoRA, which leaves them
    frozen, needs ~0.2).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tokenizer = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=tied,
        num_labels=1,
        initializer_range=init_std,
    )
    torch.manual_seed(seed)
    model = (LlamaForCausalLM if kind == "causal-lm" else LlamaForSequenceClassification)(config)
    if kind == "causal-lm":
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def torchrun(
    script: str, flags: list[str], nproc: int = 2, *, cwd: Path = ROOT, timeout: float = 300, **env
) -> subprocess.CompletedProcess:
    """Run ``script`` under torchrun with ``nproc`` processes (1 thread each, ``env`` added); stdout
    and stderr kept. A run still going after ``timeout`` seconds (a hang) fails the test."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--standalone",
        str(ROOT / script),
        *flags,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(
            proc.pid, signal.SIGKILL
        )  # the launcher and its workers: a hung run leaves no process behind
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def tolerance(cpu: float, cuda: float, device: str = "auto") -> float:
    """``cpu``, or ``cuda`` where the numbers are computed on a GPU: on ``device``, and for "auto"
    where main()'s default ``--device auto`` runs (CUDA when present). There main() turns TF32
    matmuls on (``common.start_processes``: float32 products to ~1e-3 relative) and bf16 autocast
    unless ``--no-bf16``; the CPU keeps the float32 bound ``cpu``."""
    import torch

    on_cuda = device.startswith("cuda") or device == "auto" and torch.cuda.is_available()
    return cuda if on_cuda else cpu


def gradient_vector(parameters):
    """Every parameter's gradient (zeros where None, dense where sparse) as one float64 vector: what
    an update received, to compare two runs' updates."""
    import torch

    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in parameters]
    return torch.cat([(g.to_dense() if g.is_sparse else g).flatten().double() for g in grads])


def tb_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series TensorBoard shows for ``run_dir``: {tag: [(step, value), ...]}, in step
    order, none dropped."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_one_line_error(
    cli, argv: list[str], message: str, capsys, *, checkpoint: Path, cleanup=None
) -> None:
    """The bad-input contract, for one case of a table: ``cli(argv)`` exits with code 2 after
    exactly one line that starts with ``error: `` and contains ``message``, prints no traceback,
    leaves ``checkpoint`` byte-identical and no temporary file beside it. The checkpoint is put back
    (and ``cleanup()`` run) even when the case fails, so that one failing case does not spoil the
    next."""
    before = checkpoint.read_bytes()
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli(argv)
    finally:
        changed = checkpoint.read_bytes() != before
        checkpoint.write_bytes(before)
        if cleanup is not None:
            cleanup()
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert exit_info.value.code == 2, err[-2000:]
    assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], err[
        -2000:
    ]
    assert "Traceback" not in err
    assert not changed
    assert not list(checkpoint.parent.glob(f".{checkpoint.name}.*"))


@pytest.fixture(scope="session", autouse=True)
def float32_on_every_cpu():
    """The tests assert float32 numbers, and CI's CPU varies: --bf16 autocast would run on a
    CPU with native bf16 (AVX512-BF16: recent Xeons and EPYCs) and not on others.
    So no CPU has it here, unless a test says it has."""
    import torch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
        yield


@pytest.fixture
def one_torch_thread():
    """One torch thread for a test (a process-wide value, given back afterwards): two threads of a
    32-wide model mostly wait on each other, and the torchrun processes run on one each."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hide_module(monkeypatch, module: str) -> None:
    """As on a machine without ``module`` installed (``importlib.util.find_spec`` finds nothing)."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == module else find_spec(name, *a),
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def make_tool_model(path: Path) -> Path:
    """:func:`make_tiny_model` with '#' and '=' about 15 times as likely as another character, so
    that a tool with the markers '#' and '=' is called in most rows: the embeddings' dimension 0 is
    0.5 for every token and 1.0 for those two; tied to the LM head, it adds ~2.8 to their logits."""
    import torch
    from transformers import LlamaForCausalLM

    make_tiny_model(path)
    model = LlamaForCausalLM.from_pretrained(path)
    vocab = make_tokenizer().get_vocab()
    with torch.no_grad():
        embeddings = model.model.embed_tokens.weight
        embeddings[:, 0] = 0.5
        embeddings[[vocab["#"], vocab["="]], 0] = 1.0
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory) -> Path:
    return make_tool_model(tmp_path_factory.mktemp("tiny-llama-tool"))


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-rm"), seed=1, kind="reward")


@pytest.fixture(scope="session")
def tiny_lora_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-lora"), init_std=0.2)


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch):
    """wandb with no credentials, reading nothing of the user's: HOME, NETRC and WANDB_CONFIG_DIR in
    ``tmp_path``, no WANDB_* variable, and the process's wandb settings and session credentials
    cleared (wandb keeps the first ones it reads in a process), then put back. Yields the new home
    directory."""
    wandb_setup = pytest.importorskip("wandb.sdk.wandb_setup")
    from wandb.sdk.lib.wbauth import authenticate

    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    home = tmp_path / "home"
    (home / "wandb_config").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb_config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(wandb_setup, "_singleton", None)
    monkeypatch.setattr(authenticate, "_session_auth", None)
    yield home
    if (
        wandb_setup._singleton is not None
    ):  # a wandb.init in the test started wandb's service: stop it
        import wandb

        wandb.teardown()
