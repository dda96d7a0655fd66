"""common.py's model loading as both LM scripts use it: what the sampler samples from, how a reward
model is read, dropout. Each test pins an item of "Trust I" (issue 13) on tiny random models."""

import json

import pytest
import torch
from conftest import make_tiny_model, make_tokenizer

import common
import grpo_lm
import tasks


def _with_generation_config(path, **fields):
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **fields}))
    return path


def test_the_models_own_generation_config_does_not_shape_the_sampler(tmp_path):
    # Trust I item 1: a checkpoint's generation_config.json (here repetition_penalty 1.5, as many
    # instruct models ship) must not change what the sampler draws from: the ratio and the KL
    # assume softmax(logits / T). The samples are those of the same weights without it.
    path = _with_generation_config(
        make_tiny_model(tmp_path / "m"),
        repetition_penalty=1.5,
        no_repeat_ngram_size=2,
        min_new_tokens=4,
        suppress_tokens=[5, 6],
        do_sample=True,  # generate's own sampling, which the sampler must not turn on either
    )
    model = common.load_model(str(path)).eval()
    assert model.generation_config.repetition_penalty == 1.5  # loaded, and ignored below
    plain = common.load_model(str(make_tiny_model(tmp_path / "plain"))).eval()  # the same weights
    assert plain.generation_config.repetition_penalty in (None, 1.0)
    tok = common.load_tokenizer(str(path))
    prompts = [tok(q, add_special_tokens=False)["input_ids"] for q in ("1+1=", "What is 12 + 30?")]
    options = dict(temperature=0.7, top_p=1.0, max_new_tokens=10, bf16=False, seed_keys=(0,))
    rows = common.generate_completions(model, prompts, 4, tok, **options).ids.tolist()
    assert rows == common.generate_completions(plain, prompts, 4, tok, **options).ids.tolist()
    mask = grpo_lm.completion_mask(torch.tensor(rows), tok.eos_token_id)
    assert mask.sum() > 16
    # what the penalties would have changed: a repeated pair, a suppressed token, an early EOS
    drawn = [row[: int(n)] for row, n in zip(rows, mask.sum(1), strict=True)]
    pairs = [list(zip(r, r[1:], strict=False)) for r in drawn]
    assert any(
        len(set(p)) < len(p) or {5, 6} & set(r) or len(r) < 4
        for r, p in zip(drawn, pairs, strict=True)
    )


def test_final_model_keeps_the_checkpoints_generation_config(tmp_path):
    # the checkpoint's generation config passes through loading and saving untouched
    path = _with_generation_config(make_tiny_model(tmp_path / "m"), repetition_penalty=1.5)
    model = common.load_model(str(path))
    common.save_pretrained(model, common.load_tokenizer(str(path)), tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert saved["repetition_penalty"] == 1.5
    assert (tmp_path / "out" / "config.json").is_file() and (
        tmp_path / "out" / "tokenizer_config.json"
    ).is_file()


def test_a_failed_write_of_the_final_model_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    # a failed write of the model's generation config is one line, and nothing is left behind
    from transformers import GenerationConfig

    path = _with_generation_config(make_tiny_model(tmp_path / "m"), repetition_penalty=1.5)
    model, write = common.load_model(str(path)), GenerationConfig.save_pretrained

    def disk_full_for_the_checkpoints(config, *args, **kwargs):
        if config.repetition_penalty == 1.5:
            raise OSError(28, "No space left on device")
        return write(config, *args, **kwargs)

    monkeypatch.setattr(GenerationConfig, "save_pretrained", disk_full_for_the_checkpoints)
    with pytest.raises(common.UsageError, match="cannot write .*out: No space left on device"):
        common.save_pretrained(model, common.load_tokenizer(str(path)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _pad_is_eos_reward_model(path):
    """A tiny reward model whose tokenizer pads with its EOS, as SmolLM2's does."""
    make_tiny_model(path, seed=1, kind="reward")
    tok = make_tokenizer()
    tok.pad_token = tok.eos_token
    tok.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["pad_token_id"] = tok.eos_token_id
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_reward_model_scores_equal_its_own_forward_when_pad_is_eos(tmp_path):
    # Trust I item 3: transformers' sequence-classification pooling reads the last token that is not
    # the pad token; with pad == EOS that is the token before the EOS. Our scores must equal the
    # model's own forward on the text.
    path = _pad_is_eos_reward_model(tmp_path / "rm")
    rm = common.load_model(str(path), kind="reward").eval()
    tok = common.load_tokenizer(str(path))
    assert tok.pad_token_id == tok.eos_token_id
    texts = ["What is 1 + 2?3<eos>", "1+1=2<eos>", "1+1=22"]  # the last one never emitted EOS
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids, att = common.pad_left(rows, tok.pad_token_id)
    ids = torch.cat(
        [ids, torch.full((3, 2), tok.pad_token_id)], 1
    )  # right padding after the EOS, as in a batch
    att = torch.cat([att, torch.zeros(3, 2, dtype=torch.long)], 1)
    with torch.no_grad():
        scores = tasks.reward_model_scores(rm, ids, att)
        alone = torch.cat([rm(input_ids=torch.tensor([r])).logits[:, 0] for r in rows])
        before_eos = torch.cat(
            [
                rm.score(rm.base_model(input_ids=torch.tensor([r])).last_hidden_state)[0, -2]
                for r in rows[:2]
            ]
        )
    torch.testing.assert_close(scores, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        scores[:2], before_eos, atol=1e-5, rtol=1e-5
    )  # read one token before the EOS


def test_a_causal_lm_is_not_taken_for_a_reward_model(tiny_model_dir):
    # Trust II: a plain causal LM loaded as a sequence classifier gets a randomly initialised score
    # head
    with pytest.raises(
        common.UsageError, match=r"--reward-model-path: .* has no trained score head"
    ):
        common.load_reward_model(
            str(tiny_model_dir), common.load_tokenizer(str(tiny_model_dir)), "cpu"
        )


def test_reward_model_with_a_smaller_vocabulary_is_refused(tiny_model_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=10,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=1,
    )
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "small")
    with pytest.raises(
        common.UsageError,
        match=r"^--reward-model-path: its vocabulary is smaller than the policy's tokenizer's "
        r"\(76\): not ours$",
    ):
        common.load_reward_model(
            str(tmp_path / "small"), common.load_tokenizer(str(tiny_model_dir)), "cpu"
        )


def test_dropout_is_off_everywhere_even_in_train_mode(tmp_path):
    # Trust I item 11: Llama attention copies config.attention_dropout into a float at construction,
    # which the config change alone misses; under --gradient-checkpointing the updates run in train
    # mode.
    path = make_tiny_model(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.3}))
    for kind in ("causal-lm", "reward"):
        model = common.load_model(str(path), kind=kind).train()
        ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
        torch.manual_seed(0)
        first = model(input_ids=ids).logits
        second = model(input_ids=ids).logits
        assert torch.equal(first, second), kind
