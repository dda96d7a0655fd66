"""--fsdp (issue 51): FSDP2 over `torchrun --nproc_per_node 2` (gloo, CPU) takes the steps one
process takes without it, resumes exactly (with --fsdp, and in one process without it), and a
crash in the middle of a save leaves the last checkpoint whole.

Both runs sample the same completions (each row's draws are seeded by its place in the whole batch,
and the 2-process run gathers the whole weights to sample); everything after that is the same
arithmetic summed in another order (FSDP's reduce-scatter of each layer's gradients against one
process's sum), so the scalars agree to float32 rounding: 1e-5 relative or 1e-6 absolute, as
tests/test_distributed.py, and the final weights to 1e-5 (measured: at most 1.5e-6 after 3 steps at
a learning rate of 1e-2).
"""

import os
import shutil

import pytest
import torch
from conftest import ROOT, make_tiny_model, torchrun
from safetensors.torch import load_file
from test_distributed import QUIET, assert_same_run, scalars, varied_reward

import common
import grpo_lm
import ppo_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

# the third torch.save of rank 0 (step 3's checkpoint) writes half a file and the process dies
CRASH_AT_THIRD_SAVE = """
import os
import sys

import torch

sys.path.insert(0, {root!r})
import grpo_lm

saves = []
real_save = torch.save


def save(obj, path, *args, **kwargs):
    saves.append(path)
    if len(saves) == 3:
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
        os._exit(3)
    real_save(obj, path, *args, **kwargs)


torch.save = save
grpo_lm.cli()
"""


def run_scalars(runs_dir) -> dict[str, list[float]]:
    """The scalars of the one run under ``runs_dir``, every step once (a resumed run's event files
    together), in step order."""
    (run,) = runs_dir.iterdir()
    return scalars(run)  # tb_scalars reads every event file of the directory


def assert_same_weights(one_dir, two_dir) -> None:
    """The two runs' final_model weights agree to 1e-5."""
    ((one,), (two,)) = (list(one_dir.glob("*/final_model")), list(two_dir.glob("*/final_model")))
    one_weights = load_file(one / "model.safetensors")
    two_weights = load_file(two / "model.safetensors")
    assert one_weights.keys() == two_weights.keys()
    for key, value in one_weights.items():
        torch.testing.assert_close(two_weights[key], value, rtol=0, atol=1e-5, msg=key)


def test_grpo_fsdp_takes_one_process_steps_and_resumes_after_a_crash_in_a_save(
    tiny_model_dir, tmp_path
):
    # the KL term (the reference sharded too, reset to the policy at each of 3 iterations and so in
    # the checkpoint), mu 2 (stored old log probs), the global token count
    flags = [
        "--model-name-or-path",
        str(tiny_model_dir),
        "--total-steps",
        "3",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--max-new-tokens",
        "8",
        "--learning-rate",
        "1e-2",
        "--temperature",
        "1.0",
        "--beta",
        "0.1",
        "--mu",
        "2",
        "--iterations",
        "3",
        *varied_reward(tmp_path),
        "--loss-type",
        "dapo",
        "--micro-batch-size",
        "4",
        "--seed",
        "3",
        *QUIET,
    ]
    one = grpo_lm.main(
        common.parse_args(grpo_lm.Args, [*flags, "--runs-dir", str(tmp_path / "one")])
    )
    crashing = tmp_path / "crash_at_third_save.py"
    crashing.write_text(CRASH_AT_THIRD_SAVE.format(root=str(ROOT)))
    two = tmp_path / "two"
    fsdp = [*flags, "--fsdp", "--save-every", "1", "--runs-dir", str(two)]
    out = torchrun(str(crashing), fsdp)
    assert out.returncode != 0 and "exitcode  : 3" in out.stderr, out.stderr[-3000:]
    (run,) = two.iterdir()
    checkpoint = common.load_checkpoint(str(run / "checkpoint.pt"))
    assert checkpoint["step"] == 2 and (run / ".checkpoint.pt.tmp").read_bytes().startswith(b"half")
    copy = tmp_path / "copy"  # the same checkpoint, resumed by one process without --fsdp
    copy.mkdir()
    shutil.copy(run / "checkpoint.pt", copy)
    out = torchrun("grpo_lm.py", ["--resume", str(run / "checkpoint.pt")])
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = grpo_lm.main(
        common.parse_args(grpo_lm.Args, ["--resume", str(copy / "checkpoint.pt"), "--no-fsdp"])
    )
    keys = ("reward/mean", "loss/policy", "loss/kl", "loss/ratio_max", "optim/grad_norm")
    assert_same_run(one, run_scalars(two), keys)
    assert_same_run({key: value[2:] for key, value in one.items()}, resumed, keys)
    assert one["loss/kl"][2] > 0 and one["loss/ratio_max"][2] != 1.0
    assert_same_weights(tmp_path / "one", two)


def test_ppo_fsdp_takes_one_process_steps_with_an_untied_head_and_resumes(tmp_path):
    # the policy, the reference and the value model sharded; an LM head of its own (not the
    # embedding), in the sharded root with the embedding and the final norm; activations recomputed
    # in the backward (the layers gathered again for it); step 3 resumed from step 2's checkpoint
    # (the value model's weights, the optimizer's two groups)
    model = make_tiny_model(tmp_path / "untied", tied=False)
    flags = [
        "--model-name-or-path",
        str(model),
        "--total-steps",
        "3",
        "--prompts-per-step",
        "8",
        "--num-ppo-epochs",
        "2",
        "--max-new-tokens",
        "8",
        "--learning-rate",
        "1e-2",
        "--temperature",
        "1.0",
        "--beta",
        "0.1",
        *varied_reward(tmp_path),
        "--micro-batch-size",
        "2",
        "--gradient-checkpointing",
        "--seed",
        "3",
        *QUIET,
    ]
    one = ppo_lm.main(common.parse_args(ppo_lm.Args, [*flags, "--runs-dir", str(tmp_path / "one")]))
    two = [*flags, "--fsdp", "--total-steps", "2", "--runs-dir", str(tmp_path / "two")]
    out = torchrun("ppo_lm.py", two)
    assert out.returncode == 0, out.stderr[-3000:]
    (checkpoint,) = (tmp_path / "two").glob("*/checkpoint.pt")
    out = torchrun("ppo_lm.py", ["--resume", str(checkpoint), "--total-steps", "3"])
    assert out.returncode == 0, out.stderr[-3000:]
    keys = ("reward/mean", "loss/policy", "loss/value", "loss/kl", "optim/grad_norm")
    assert_same_run(one, run_scalars(tmp_path / "two"), (*keys, "optim/value_grad_norm"))
    assert one["loss/kl"][1] != 0
    assert_same_weights(tmp_path / "one", tmp_path / "two")


@pytest.fixture
def one_process_group():
    """A process group of this process alone (gloo), as torchrun's with one process."""
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_sampling_gathers_the_whole_weights_or_refuses(
    tiny_model_dir, one_process_group, monkeypatch
):
    from torch.distributed.tensor import DTensor

    policy = common.load_policy(str(tiny_model_dir), "cpu", None, False)
    common.shard(policy)
    up_proj = policy.model.layers[0].mlp.up_proj
    head = policy.get_output_embeddings()
    assert isinstance(up_proj.weight, DTensor) and isinstance(head.weight, DTensor)
    with common.gathered(policy):
        assert not isinstance(up_proj.weight, DTensor) and not isinstance(head.weight, DTensor)
    assert isinstance(up_proj.weight, DTensor) and isinstance(head.weight, DTensor)
    monkeypatch.setattr(os, "sysconf", lambda name: 100)  # 100 pages of 100 bytes free
    too_big = r"--fsdp: the policy's whole weights, 0.0 GiB, gathered to sample, exceed cpu's free"
    with pytest.raises(common.UsageError, match=too_big):
        with common.gathered(policy):
            pass


def test_a_bf16_reference_reads_sharded_what_it_reads_whole(tiny_model_dir, one_process_group):
    # --iterations 1 under bf16: the reference's Linear weights in bf16, its norms, embedding and
    # head in float32, in one unit each layer (FSDP gathers a frozen unit of mixed dtypes)
    from torch.distributed.tensor import DTensor

    policy = common.load_policy(str(tiny_model_dir), "cpu", None, False)
    options = dict(lora=False, bf16_weights=True)
    reference = common.load_reference(policy, str(tiny_model_dir), "cpu", **options)
    ids = torch.arange(3, 15).view(2, 6)
    mask = torch.ones_like(ids)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        whole = ppo_lm.token_log_probs(reference, ids, mask, 3, temperature=1.0)
        common.shard(reference)
        split = ppo_lm.token_log_probs(reference, ids, mask, 3, temperature=1.0)
    up_proj = reference.model.layers[0].mlp.up_proj.weight
    assert isinstance(up_proj, DTensor) and up_proj.dtype == torch.bfloat16
    torch.testing.assert_close(split, whole, rtol=0, atol=0)
