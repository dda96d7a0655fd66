"""--lora-rank (issue 16): only the adapters train, the reference is the policy with its adapter
disabled, checkpoints hold the adapters and resume exactly, final_model/ is a merged model; also
under torchrun (tests/test_distributed.py)."""

import pytest
import torch
from conftest import tolerance
from test_grpo_lm import digit_task, tiny_args

import common
import grpo_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

LORA = dict(lora_rank=4, learning_rate=3e-2, beta=0.1)  # on the tiny model with a real logit scale
# final_model's logits against the policy's with its adapters (both on the CPU): main() merged them
# on its device, on CUDA with TF32 matmuls (B @ A rounded: 6.4e-4 apart on an H100, 7e-4 with that
# rounding emulated on the CPU), where the adapters move the logits by up to 2.5
MERGED = dict(atol=tolerance(1e-5, 3e-3), rtol=tolerance(1e-5, 3e-3))


def lora_policy(model_dir, targets=("all-linear",)):
    """common.load_policy as the scripts call it with --lora-rank 4 --lora-target-modules
    ``targets``."""
    return common.load_policy(str(model_dir), "cpu", (4, None, targets), False)


def test_lora_learns_and_trains_only_the_adapters(tiny_lora_model_dir, tmp_path, monkeypatch):
    loaded = []
    load_model = common.load_model
    monkeypatch.setattr(
        common,
        "load_model",
        lambda *a, **k: loaded.append(k.get("kind", "causal-lm")) or load_model(*a, **k),
    )
    history = grpo_lm.main(
        tiny_args(tiny_lora_model_dir, tmp_path, total_steps=25, **LORA), task=digit_task()
    )
    rewards = history["reward/mean"]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards
    assert loaded == [
        "causal-lm"
    ]  # the reference is the policy without its adapter: no second model
    assert (
        history["loss/kl"][0] == 0.0 and history["loss/kl"][-1] > 0
    )  # ... which starts equal to the policy
    ckpt = common.load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert (
        ckpt["policy"] and all("lora_" in k for k in ckpt["policy"]) and ckpt["reference"] is None
    )
    base = common.load_model(str(tiny_lora_model_dir)).state_dict()
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(
        tmp_path / "run" / "final_model"
    )  # loads without peft
    changed = [k for k, v in merged.state_dict().items() if not torch.equal(v, base[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed), (
        changed
    )  # only the adapted projections moved


def test_final_model_is_the_policy_with_its_adapters_merged(tiny_lora_model_dir, tmp_path):
    grpo_lm.main(tiny_args(tiny_lora_model_dir, tmp_path, total_steps=2, **LORA), task=digit_task())
    ckpt = common.load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    policy = lora_policy(tiny_lora_model_dir)
    common.load_trained_weights(policy, ckpt["policy"])
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final_model").eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=ids).logits, policy(input_ids=ids).logits, **MERGED
        )
        with policy.disable_adapter():  # the adapters did move the policy
            assert not torch.allclose(
                merged(input_ids=ids).logits, policy(input_ids=ids).logits, atol=1e-4
            )


def test_lora_resume_reproduces_the_uninterrupted_run(tiny_lora_model_dir, tmp_path):
    kw = dict(LORA, mu=2)
    full = grpo_lm.main(
        tiny_args(tiny_lora_model_dir, tmp_path / "a", total_steps=4, save_every=2, **kw),
        task=digit_task(),
    )
    grpo_lm.main(
        tiny_args(tiny_lora_model_dir, tmp_path / "b", total_steps=2, **kw), task=digit_task()
    )
    resumed = grpo_lm.main(
        tiny_args(
            tiny_lora_model_dir,
            tmp_path / "b",
            total_steps=4,
            resume=str(tmp_path / "b" / "run" / "checkpoint.pt"),
            **kw,
        ),
        task=digit_task(),
    )
    for key in ("loss/policy", "reward/mean", "loss/kl", "optim/grad_norm"):
        assert resumed[key] == full[key][2:], key  # exact
    with pytest.raises(common.UsageError, match="--lora-rank: cannot change when resuming"):
        grpo_lm.main(
            tiny_args(
                tiny_lora_model_dir,
                tmp_path / "b",
                total_steps=5,
                resume=str(tmp_path / "b" / "run" / "checkpoint.pt"),
                **{**kw, "lora_rank": 8},
            ),
            task=digit_task(),
        )


def test_an_adapter_on_a_tied_lm_head_is_saved_alone_resumes_exactly_and_merges(
    tiny_lora_model_dir, tmp_path
):
    # the tiny model, as SmolLM2, ties its LM head to the input embeddings: the head's adapter must
    # adapt the head only, the checkpoint hold the adapters only (not the frozen shared weight), and
    # final_model be the policy
    kw = dict(LORA, lora_target_modules=("q_proj", "lm_head"))
    full = grpo_lm.main(
        tiny_args(tiny_lora_model_dir, tmp_path / "a", total_steps=4, save_every=2, **kw),
        task=digit_task(),
    )
    grpo_lm.main(
        tiny_args(tiny_lora_model_dir, tmp_path / "b", total_steps=2, **kw), task=digit_task()
    )
    ckpt = tmp_path / "b" / "run" / "checkpoint.pt"
    saved = common.load_checkpoint(ckpt)["policy"]
    assert all("lora_" in k for k in saved) and any("lm_head.lora_B" in k for k in saved), sorted(
        saved
    )
    resumed = grpo_lm.main(
        tiny_args(tiny_lora_model_dir, tmp_path / "b", total_steps=4, resume=str(ckpt), **kw),
        task=digit_task(),
    )
    for key in ("loss/policy", "reward/mean", "loss/kl", "optim/grad_norm"):
        assert resumed[key] == full[key][2:], key  # exact
    policy = lora_policy(tiny_lora_model_dir, kw["lora_target_modules"])
    common.load_trained_weights(
        policy, common.load_checkpoint(tmp_path / "a" / "run" / "checkpoint.pt")["policy"]
    )
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "run" / "final_model").eval()
    base = common.load_model(str(tiny_lora_model_dir))
    assert torch.equal(
        merged.get_input_embeddings().weight, base.get_input_embeddings().weight
    )  # only the head moved
    assert not torch.equal(
        merged.get_output_embeddings().weight, base.get_output_embeddings().weight
    )
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=ids).logits, policy(input_ids=ids).logits, **MERGED
        )


def test_ppo_lora_trains_only_the_policys_adapters_and_resumes_exactly(
    tiny_lora_model_dir, tmp_path
):
    from test_ppo_lm import tiny_args as ppo_args

    import ppo_lm

    kw = dict(lora_rank=4, learning_rate=3e-2, beta=0.1, max_new_tokens=8)
    full = ppo_lm.main(
        ppo_args(tiny_lora_model_dir, tmp_path / "a", total_steps=4, save_every=2, **kw),
        task=digit_task(),
    )
    ppo_lm.main(
        ppo_args(tiny_lora_model_dir, tmp_path / "b", total_steps=2, **kw), task=digit_task()
    )
    ckpt = tmp_path / "b" / "run" / "checkpoint.pt"
    saved = common.load_checkpoint(ckpt)
    assert all("lora_" in k for k in saved["policy"]) and "reference" not in saved
    resumed = ppo_lm.main(
        ppo_args(tiny_lora_model_dir, tmp_path / "b", total_steps=4, resume=str(ckpt), **kw),
        task=digit_task(),
    )
    for key in ("loss/policy", "loss/value", "reward/mean", "loss/kl"):
        assert resumed[key] == full[key][2:], key
    assert (
        full["loss/kl"][0] == 0.0 and full["loss/kl"][-1] > 0
    )  # the reference: the policy without its adapter


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_an_adapter_on_the_lm_head_acts_in_every_log_prob(script, tiny_lora_model_dir):
    """--lora-target-modules lm_head: the float32 head must run the adapter too, or the ratio and
    the KL would be those of the model without it while the sampler draws with it."""
    import ppo_lm

    policy = lora_policy(tiny_lora_model_dir, ("q_proj", "lm_head"))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    att = torch.ones_like(ids)
    with torch.no_grad():
        direct = policy(input_ids=ids, attention_mask=att).logits[:, 2:-1].log_softmax(-1)
        direct = direct.gather(2, ids[:, 3:, None]).squeeze(-1)
        if script == "grpo":
            logp = grpo_lm.token_log_probs(
                policy,
                grpo_lm.MicroBatch(
                    ids[:, :3], att[:, :3], torch.tensor([0]), ids[:, 3:], att[:, 3:]
                ),
                1.0,
            )
        else:
            logp = ppo_lm.token_log_probs(policy, ids, att, 3, temperature=1.0)
    torch.testing.assert_close(logp, direct, atol=1e-5, rtol=1e-5)


def test_a_lora_checkpoint_loads_exactly_its_adapters_and_refuses_other_keys(tiny_lora_model_dir):
    # the adapters alone are saved (the frozen base weights are not in a checkpoint) and loaded
    # with strict=False, so the keys are checked: one more (e.g. peft's own file format of earlier
    # versions) or one fewer is an error, not an adapter silently left at its initial value
    policy = lora_policy(tiny_lora_model_dir)
    weights = {key: value + 0.5 for key, value in common.trained_weights(policy).items()}
    assert weights and all("lora_" in key for key in weights)
    common.load_trained_weights(policy, weights)
    now = common.trained_weights(policy)
    assert all(torch.equal(now[key], value) for key, value in weights.items())  # loaded
    old = {key.replace(".default", ""): value for key, value in weights.items()}
    fewer = dict(list(weights.items())[1:])
    for bad in (old, fewer):
        with pytest.raises(common.UsageError, match="^--resume: not this version's checkpoint"):
            common.load_trained_weights(policy, bad)
