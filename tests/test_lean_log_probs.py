"""Issue 50, goal 2: the LM head and its log-softmax a chunk of tokens at a time, each chunk's
logits recomputed in the backward (``common.lm_head_log_probs``), for the policy and reference
passes of both LM scripts: the values and gradients of one ``log_softmax`` over every logit."""

import pytest
import torch
from test_grpo_lm import _batch

import common
import grpo_lm
import ppo_lm

TEMPERATURE = 0.7


def inputs(tok) -> tuple:
    """A GRPO micro-batch (2 prompts, 2 completions each) and the same rows as PPO's (B, P + T)
    left-padded ids and mask, T = the completion width."""
    prompt_ids, prompt_mask, index, completions, att = _batch(tok)
    mb = grpo_lm.MicroBatch(prompt_ids, prompt_mask, index, completions, att)
    ids = torch.cat([prompt_ids[index], completions], 1)
    mask = torch.cat([prompt_mask[index], att], 1)
    return mb, ids, mask, completions.shape[1]


def plain_log_probs(model, ids, mask, width: int):
    """(B, T) log probs and entropies from one forward with every (B, T, V) logit at once."""
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    output = model(input_ids=ids, attention_mask=mask, position_ids=positions)
    logits = output.logits[:, -width - 1 : -1] / TEMPERATURE
    log_probs = logits.log_softmax(-1)
    sampled = log_probs.gather(2, ids[:, -width:, None])[..., 0]
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return sampled, entropy


def script_log_probs(script: str, model, batch: tuple, entropy_coef=None):
    """The script's token_log_probs of ``batch`` (from :func:`inputs`)."""
    mb, ids, mask, width = batch
    if script == "ppo":
        return ppo_lm.token_log_probs(
            model, ids, mask, width, temperature=TEMPERATURE, entropy_coef=entropy_coef
        )
    share = script == "grpo-shared-prompt"
    return grpo_lm.token_log_probs(
        model, mb, TEMPERATURE, share_prompt=share, entropy_coef=entropy_coef
    )


def gradients(model, log_probs, entropy) -> dict:
    """d/dtheta of a weighted sum of the log probs and entropies (weights fixed, not all equal)."""
    weights = torch.linspace(-1.0, 2.0, log_probs.numel()).view(log_probs.shape)
    loss = (weights * log_probs).sum() + 0.3 * (weights.flip(1) * entropy).sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("script", ["grpo-shared-prompt", "grpo-whole", "ppo"])
def test_chunked_log_probs_give_the_plain_values_and_gradients(tiny_model_dir, script, monkeypatch):
    model = common.load_model(str(tiny_model_dir)).eval()
    tok = common.load_tokenizer(str(tiny_model_dir))
    batch = inputs(tok)
    _, ids, mask, width = batch
    vocab = model.config.vocab_size
    plain = plain_log_probs(model, ids, mask, width)
    expected_gradients = gradients(model, *plain)

    monkeypatch.setattr(common, "LOGITS_CHUNK", 3 * vocab)  # 3 tokens a chunk
    calls = []  # the tokens of each LM head call: every chunk's, and again in the backward
    hook = model.lm_head.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    kept = []  # the shape of every tensor the autograd graph keeps for the backward
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.shape) or t, lambda t: t):
        log_probs, entropy = script_log_probs(script, model, batch, entropy_coef=0.01)
    torch.testing.assert_close(log_probs, plain[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, plain[1], atol=1e-5, rtol=0)
    chunks = -(-ids.shape[0] * width // 3)
    assert calls == [3] * (chunks - 1) + [ids.shape[0] * width - 3 * (chunks - 1)]
    assert not [shape for shape in kept if shape[-1] == vocab]  # no logits kept: recomputed
    torch.testing.assert_close(
        gradients(model, log_probs, entropy), expected_gradients, atol=1e-5, rtol=1e-5
    )
    hook.remove()
    assert len(calls) == 2 * chunks  # each chunk's head ran again in the backward

    with torch.no_grad():  # no gradients: chunks, nothing to recompute
        again = script_log_probs(script, model, batch)
    torch.testing.assert_close(again, plain[0], atol=1e-5, rtol=0)


def test_without_chunks_the_logits_are_kept_as_before(tiny_model_dir):
    # the default chunk holds these few tokens' logits: one head call, no recompute, and the
    # graph keeps the (B * T, V) log-softmax as the row-at-a-time code did
    model = common.load_model(str(tiny_model_dir)).eval()
    tok = common.load_tokenizer(str(tiny_model_dir))
    batch = inputs(tok)
    _, ids, _, width = batch
    calls = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.shape) or t, lambda t: t):
        log_probs = script_log_probs("grpo-whole", model, batch)
    log_probs.sum().backward()
    hook.remove()
    assert calls == [ids.shape[0] * width]
    assert (ids.shape[0] * width, model.config.vocab_size) in kept


@pytest.mark.parametrize("script", ["grpo-shared-prompt", "grpo-whole", "ppo"])
def test_the_lora_reference_is_the_base_model_in_the_decoder_and_the_head(
    tiny_lora_model_dir, script
):
    # --lora-rank's reference runs the decoder and the LM head (both adapted here) with the
    # adapter off: the log probs of the model as loaded, not the policy's
    base = common.load_model(str(tiny_lora_model_dir)).eval()
    policy = common.load_policy(
        str(tiny_lora_model_dir), "cpu", (4, None, ("q_proj", "lm_head")), False
    )
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    reference = common.load_reference(policy, None, "cpu", lora=True, bf16_weights=False)
    tok = common.load_tokenizer(str(tiny_lora_model_dir))
    batch = inputs(tok)
    with torch.no_grad():
        expected = plain_log_probs(base, *batch[1:])[0]
        adapted = script_log_probs(script, policy, batch)
        log_probs = script_log_probs(script, reference, batch)
    torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=0)
    assert (adapted - expected).abs().max() > 0.1  # the adapter moves the policy's


@pytest.mark.parametrize("setting", ["bf16-autocast", "entropy-logged", "gradient-checkpointing"])
def test_chunks_change_nothing_under_autocast_logged_entropy_and_checkpointing(
    tiny_model_dir, setting, monkeypatch
):
    # chunked and recomputed against one chunk, under bf16 autocast (the body in bf16, the head in
    # float32), with the entropy logged only (no gradient through it) and under HF's gradient
    # checkpointing (the decoder's layers recomputed too; GRPO then runs whole sequences)
    policy = common.load_policy(
        str(tiny_model_dir), "cpu", None, setting == "gradient-checkpointing"
    )
    policy.train(setting == "gradient-checkpointing")
    tok = common.load_tokenizer(str(tiny_model_dir))
    batch = inputs(tok)
    coef = 0.0 if setting == "entropy-logged" else 0.01
    script = "grpo-whole" if setting == "gradient-checkpointing" else "grpo-shared-prompt"
    results = []
    for chunk in (common.LOGITS_CHUNK, 3 * policy.config.vocab_size):
        monkeypatch.setattr(common, "LOGITS_CHUNK", chunk)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting == "bf16-autocast"):
            log_probs, entropy = script_log_probs(script, policy, batch, entropy_coef=coef)
        grads = gradients(policy, log_probs, entropy.detach() if not coef else entropy)
        results.append((log_probs, entropy, grads))
    (one_logp, one_entropy, one_grads), (logp, entropy, grads) = results
    torch.testing.assert_close(logp, one_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, one_entropy, atol=1e-5, rtol=0)
    torch.testing.assert_close(grads, one_grads, atol=1e-5, rtol=1e-5)
    assert entropy.requires_grad == bool(coef)  # logged only: no gradient through it


def test_a_model_whose_logits_are_not_its_heads_output_is_refused(tmp_path):
    # Gemma 2 soft-caps its logits after the LM head (tanh(x / c) * c), which log probs read from
    # the head's output would miss: one line, at load
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=0.1,  # small: this random model's logits are about 1
    )
    torch.manual_seed(0)
    Gemma2ForCausalLM(config).save_pretrained(tmp_path / "capped")
    with pytest.raises(common.UsageError, match="its logits are not its LM head's output"):
        common.load_policy(str(tmp_path / "capped"), "cpu", None, False)
    config.final_logit_softcapping = None
    Gemma2ForCausalLM(config).save_pretrained(tmp_path / "plain")
    common.load_policy(str(tmp_path / "plain"), "cpu", None, False)
