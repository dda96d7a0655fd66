"""grpo_lm.py: equations against hand-computed numbers, learning on a tiny model, CLI, resume,
errors."""

import dataclasses
import itertools
import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, hide_module, tb_scalars, tolerance

import common
import grpo_lm
import tasks

LOG_HALF, LOG_2 = math.log(0.5), math.log(2.0)


# ---------------------------------------------------------------------------------------------
# Equations
# ---------------------------------------------------------------------------------------------
def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0, 1.0, 1.0])
    adv = grpo_lm.group_advantages(rewards, torch.arange(12) // 4, eps=1e-4)
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: all equal -> 0; group 3: mean 1, std
    # sqrt(2/3)
    s1, s3 = math.sqrt(1 / 3) + 1e-4, math.sqrt(2 / 3) + 1e-4
    expected = [0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1, 0, 0, 0, 0, 1 / s3, -1 / s3, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=0, atol=1e-6)
    equal = grpo_lm.group_advantages(torch.zeros(8), torch.zeros(8, dtype=torch.long), eps=1e-4)
    assert equal.tolist() == [0.0] * 8


@pytest.mark.parametrize(
    "ratio, adv, loss, grad",
    [
        (1.5, 1.0, -1.2, 0.0),  # A > 0, ratio above 1 + eps: clipped, no gradient
        (1.1, 1.0, -1.1, -1.1),  # A > 0 inside the range: d(-ratio*A)/dlogp = -ratio*A
        (0.5, 1.0, -0.5, -0.5),  # A > 0 below 1 - eps: min picks the unclipped term, gradient flows
        (0.5, -1.0, 0.8, 0.0),  # A < 0, ratio below 1 - eps: clipped, no gradient
        (1.5, -1.0, 1.5, 1.5),  # A < 0 above 1 + eps: unclipped (pessimistic) term, gradient flows
    ],
)
def test_clipped_surrogate_value_and_gradient(ratio, adv, loss, grad):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out, stats = grpo_lm.grpo_loss(
        logp,
        torch.zeros(1, 1),
        None,
        torch.tensor([adv]),
        mask=torch.ones(1, 1),
        clip_range=0.2,
        beta=0.0,
        num_sequences=1,
    )
    out.backward()
    assert out.item() == pytest.approx(loss, abs=1e-6)
    assert logp.grad.item() == pytest.approx(grad, abs=1e-6)
    side, other = ("clipped_high", "clipped_low")[:: 1 if adv > 0 else -1]  # by the sign of A
    assert stats[side].item() == (1.0 if grad == 0.0 else 0.0) and stats[other].item() == 0


def test_completion_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 9, 9, 9]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    assert torch.equal(grpo_lm.completion_mask(ids, eos_token_id=2), expected)


def test_per_sequence_length_normalisation_and_masking():
    # A = 0, so only the KL term (beta = 1) remains. Sequence 1 has 1 valid token, sequence 2 has 3.
    logp = torch.zeros(2, 3)
    ref = torch.tensor(
        [
            [LOG_HALF, 50.0, 50.0],  # tokens after EOS are garbage and must not count
            [0.0, 0.0, LOG_2],
        ]
    )
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    loss, _ = grpo_lm.grpo_loss(
        logp, logp, ref, torch.zeros(2), mask=mask, clip_range=0.2, beta=1.0, num_sequences=2
    )
    kl_half, kl_two = 0.5 - LOG_HALF - 1, 2 - LOG_2 - 1
    # eq. 3: 1/G sum_i 1/|o_i| sum_t -> (kl_half / 1 + kl_two / 3) / 2 = 0.14772 (a token mean gives
    # 0.125)
    assert loss.item() == pytest.approx((kl_half + kl_two / 3) / 2, abs=1e-6)


def test_micro_batch_losses_add_up_to_the_full_batch_loss():
    g = torch.Generator().manual_seed(1)
    logp, old, ref = (torch.randn(6, 5, generator=g) * 0.1 for _ in range(3))
    adv, mask = torch.randn(6, generator=g), (torch.rand(6, 5, generator=g) > 0.3).float()
    terms = dict(clip_range=0.2, beta=0.04, num_sequences=6)
    full, _ = grpo_lm.grpo_loss(logp, old, ref, adv, mask=mask, **terms)
    parts = sum(
        grpo_lm.grpo_loss(logp[s], old[s], ref[s], adv[s], mask=mask[s], **terms)[0]
        for s in (slice(0, 2), slice(2, 6))
    )
    torch.testing.assert_close(full, parts)


def test_token_log_probs_ignore_left_padding(tiny_model_dir):
    model = common.load_model(str(tiny_model_dir)).eval()
    tok = common.load_tokenizer(str(tiny_model_dir))
    prompts = tok(
        ["What is 1 + 2?", "1+1="], return_tensors="pt", padding=True, add_special_tokens=False
    )
    completions = tok(["3<eos>", "2<eos>"], return_tensors="pt", add_special_tokens=False)[
        "input_ids"
    ]
    att, first = torch.ones_like(completions), torch.arange(2)
    alone = tok(["1+1=2<eos>"], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        for share in (True, False):
            batched = grpo_lm.token_log_probs(
                model,
                grpo_lm.MicroBatch(
                    prompts["input_ids"], prompts["attention_mask"], first, completions, att
                ),
                0.7,
                share_prompt=share,
            )
            single = grpo_lm.token_log_probs(
                model,
                grpo_lm.MicroBatch(
                    alone["input_ids"][:, :-2],
                    alone["attention_mask"][:, :-2],
                    first[:1],
                    completions[1:],
                    att[1:],
                ),
                0.7,
                share_prompt=share,
            )
            torch.testing.assert_close(batched[1], single[0], atol=1e-5, rtol=1e-5)
        logits = model(**alone).logits[0, -3:-1] / 0.7
    manual = logits.log_softmax(-1).gather(1, alone["input_ids"][0, -2:, None]).squeeze(1)
    torch.testing.assert_close(single[0], manual, atol=1e-5, rtol=1e-5)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def no_tf32():
    """float32 matmuls in full precision for the test (a CUDA run of grpo_lm.main turns TF32 on)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize(
    "device, bf16",
    [
        ("cpu", False),
        ("cpu", True),  # as on a CPU with native bf16
        pytest.param("cuda", False, marks=CUDA),
        pytest.param("cuda", True, marks=CUDA),
    ],
)
def test_shared_prompt_pass_equals_whole_sequences_values_and_gradients(
    tiny_model_dir, device, bf16, *, no_tf32, monkeypatch
):
    # 2 left-padded prompts, 3 completions each of different lengths (right-padded after the EOS):
    # one pass per prompt with its keys and values reused must give the whole-sequence numbers,
    # and the same gradient for every parameter (the prompt's share summed over its completions).
    # On CUDA: float32 without TF32 to the same tolerance; under --bf16 autocast (CUDA, or a CPU
    # with native bf16) to bf16's.
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert common.bf16_active(torch.device(device), bf16) == bf16
    model = common.load_model(str(tiny_model_dir)).to(device)
    tok = common.load_tokenizer(str(tiny_model_dir))
    prompts = tok(
        ["What is 12 + 30?", "1+1="], return_tensors="pt", padding=True, add_special_tokens=False
    ).to(device)
    texts = ["42<eos>", "4 2<eos>", "forty<eos>", "2<eos>", "11<eos>", "2, yes<eos>"]
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    T = max(map(len, rows))
    completions = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows], device=device)
    att = grpo_lm.completion_mask(completions, tok.eos_token_id).long()
    prompt_index = torch.tensor([0, 0, 0, 1, 1, 1], device=device)
    weights = torch.randn(6, T, generator=torch.Generator().manual_seed(0)).to(device) * att
    out = {}
    for share in (True, False):
        model.zero_grad()
        with common.bf16_autocast(torch.device(device), bf16):
            logp = grpo_lm.token_log_probs(
                model,
                grpo_lm.MicroBatch(
                    prompts["input_ids"], prompts["attention_mask"], prompt_index, completions, att
                ),
                0.7,
                share_prompt=share,
            )
        assert logp.dtype == torch.float32  # log-softmax stays float32 under autocast
        (logp * weights).sum().backward()
        out[share] = (
            logp.detach(),
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )
    tol = (
        dict(atol=3e-2, rtol=3e-2) if bf16 else dict(atol=1e-5, rtol=1e-5)
    )  # bf16: 8 mantissa bits
    torch.testing.assert_close(out[True][0] * att, out[False][0] * att, **tol)
    assert out[True][1].keys() == out[False][1].keys() and len(out[True][1]) > 5
    for name, grad in out[False][1].items():
        if bf16:  # different matmul shapes round differently: compare directions, not entries
            cos = torch.nn.functional.cosine_similarity(
                out[True][1][name].flatten(), grad.flatten(), dim=0
            )
            assert cos > 0.99, (name, cos.item())
        else:
            torch.testing.assert_close(out[True][1][name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert (logp * att).abs().sum() > 0


def test_the_tied_embedding_makes_a_sparse_gradient_with_the_same_sum(tiny_model_dir):
    # on a CPU the policy's input embedding, tied to its LM head, gives autograd its looked-up rows
    # only; the parameter's gradient stays dense and equals the dense embedding's to float rounding
    policy = common.load_policy(str(tiny_model_dir), "cpu", None, False)
    embedding = policy.get_input_embeddings()
    assert embedding.sparse and embedding.weight is policy.get_output_embeddings().weight
    tok = common.load_tokenizer(str(tiny_model_dir))
    prompt = tok(["12+30="], return_tensors="pt", add_special_tokens=False)
    completions = torch.tensor([[3, 4, 2], [5, 2, 1]])
    mb = grpo_lm.MicroBatch(
        prompt["input_ids"], prompt["attention_mask"], torch.zeros(2, dtype=torch.long),
        completions, grpo_lm.completion_mask(completions, tok.eos_token_id).long(),
    )  # fmt: skip
    grads = {}
    for sparse in (True, False):
        embedding.sparse = sparse
        policy.zero_grad(set_to_none=True)
        grpo_lm.token_log_probs(policy, mb, 0.7).sum().backward()
        grads[sparse] = embedding.weight.grad
    assert grads[True].layout == torch.strided  # what AdamW and clip_grad_norm_ take
    torch.testing.assert_close(grads[True], grads[False], atol=1e-7, rtol=1e-6)
    assert grads[True][completions[0, 0]].abs().sum() > 0


def test_a_bf16_reference_gives_autocasts_log_probs_exactly(tiny_model_dir, monkeypatch):
    # under --bf16 autocast the reference keeps its Linear weights (not the LM head's) in bf16:
    # the same log probs, bit for bit, as the float32 reference under autocast; reset by
    # --iterations > 1 from the float32 policy, it stays float32 (main passes bf16_weights False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    path = str(tiny_model_dir)
    reference = common.load_reference(None, path, "cpu", lora=False, bf16_weights=True)
    float32 = common.load_reference(None, path, "cpu", lora=False, bf16_weights=False)
    dtypes = {p.dtype for p in float32.parameters()}
    assert dtypes == {torch.float32} and reference.lm_head.weight.dtype == torch.float32
    assert reference.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    tok = common.load_tokenizer(str(tiny_model_dir))
    prompt = tok(["12+30=", "1+1="], return_tensors="pt", padding=True, add_special_tokens=False)
    completions = torch.tensor([[3, 4, 2], [5, 2, 1], [6, 6, 6], [7, 2, 1]])
    mb = grpo_lm.MicroBatch(
        prompt["input_ids"], prompt["attention_mask"], torch.tensor([0, 0, 1, 1]),
        completions, grpo_lm.completion_mask(completions, tok.eos_token_id).long(),
    )  # fmt: skip
    with torch.no_grad(), common.bf16_autocast(torch.device("cpu"), True):
        logp = [grpo_lm.token_log_probs(model, mb, 0.7) for model in (reference, float32)]
    assert torch.equal(logp[0], logp[1]) and logp[0].dtype == torch.float32


def test_reward_model_reads_the_last_real_token(tiny_reward_model_dir):
    rm = common.load_model(str(tiny_reward_model_dir), kind="reward").eval()
    tok = common.load_tokenizer(str(tiny_reward_model_dir))
    a = tok(["12+3=15<eos>"], return_tensors="pt", add_special_tokens=False)
    padded_ids = torch.cat([a["input_ids"], torch.full((1, 3), tok.pad_token_id)], 1)
    padded_mask = torch.cat([a["attention_mask"], torch.zeros(1, 3, dtype=torch.long)], 1)
    s1 = tasks.reward_model_scores(rm, a["input_ids"], a["attention_mask"])
    s2 = tasks.reward_model_scores(rm, padded_ids, padded_mask)
    with torch.no_grad():
        expected = rm(**a).logits.squeeze(-1)  # HF pools the last non-pad token too
    torch.testing.assert_close(s1, expected)
    torch.testing.assert_close(s2, expected)


# ---------------------------------------------------------------------------------------------
# Tasks and rewards
# ---------------------------------------------------------------------------------------------
def test_final_number_and_rewards():
    assert tasks.extract_final_number("12 + 34 = 46.") == 46.0
    assert tasks.extract_final_number("it is -1,234.5 now") == -1234.5
    assert tasks.extract_final_number("__import__('os').system('x')") is None
    task = tasks.make_addition_task(num_test=16)
    assert len(task.test) == 16 and len(task.train) == 90 * 90 - 16
    assert task.reward_fn("12 + 13 = 25", {"answer": "25"}) == 1.0
    assert task.reward_fn("25, I think so", {"answer": "25"}) == 1.0
    assert task.reward_fn("26", {"answer": "25"}) == 0.0
    assert task.reward_fn("25.0000001", {"answer": "25"}) == 1.0  # within 1e-6
    assert task.reward_fn("no number", {"answer": "25"}) == 0.0


def test_gsm8k_loader_real_file_and_errors(tmp_path):
    real = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
    if real.is_file():
        task = tasks.load_jsonl_task(real, num_test=128)
        assert len(task.train) + len(task.test) == 7473
        assert all(tasks.extract_final_number(ex["answer"]) is not None for ex in task.test)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "a #### 3"}) + "\n{not json\n")
    with pytest.raises(common.UsageError, match=r"bad.jsonl:2: Expecting property name"):
        tasks.load_jsonl_task(bad, num_test=0)
    bad.write_text(json.dumps({"question": "q", "answer": "no final number"}) + "\n")
    with pytest.raises(
        common.UsageError, match=r"bad.jsonl:1: answer 'no final number' is not a number"
    ):
        tasks.load_jsonl_task(bad, num_test=0)
    with pytest.raises(common.UsageError, match="cannot read .*missing.jsonl: No such file"):
        tasks.load_jsonl_task(tmp_path / "missing.jsonl", 0)


# ---------------------------------------------------------------------------------------------
# Learning, CLI, resume, errors
# ---------------------------------------------------------------------------------------------
def digit_task() -> tasks.Task:
    """Trivially learnable: the reward is the fraction of completion characters that are digits."""
    examples = [
        {"question": f"{a}+{b}", "answer": str(a + b)} for a in range(10) for b in range(10)
    ]

    def digits(completion: str, example: dict) -> float:
        return sum(c.isdigit() for c in completion) / max(len(completion), 1)

    return tasks.Task("digits", examples[8:], examples[:8], digits, tasks.number_matches)


def tiny_args(model_dir, tmp_path, **kw) -> grpo_lm.Args:
    base = dict(
        model_name_or_path=str(model_dir),
        runs_dir=str(tmp_path),
        run_name="run",
        prompts_per_step=4,
        group_size=8,
        max_new_tokens=12,
        learning_rate=1e-2,
        temperature=1.0,
        eval_size=8,
        eval_every=0,
        sample_every=0,
        save_every=0,
        total_steps=2,
        seed=3,
        beta=0.04,  # the paper's KL term (the default)
    )
    base.update(kw)
    return grpo_lm.Args(**base)


def test_tiny_model_learns_digit_reward(tiny_model_dir, tmp_path):
    history = grpo_lm.main(tiny_args(tiny_model_dir, tmp_path, total_steps=25), task=digit_task())
    rewards = history["reward/mean"]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first < 0.35, rewards  # ~14 of 76 characters are digits at initialisation
    assert last > first + 0.3, rewards
    assert history["loss/kl"][-1] > 0  # the policy moved away from the reference


def test_a_bf16_cpu_samples_and_trains_under_bf16_autocast(tiny_model_dir, tmp_path, monkeypatch):
    # issue 24: --bf16 on a CPU with native bf16 runs sampling, the reference pass and the update
    # under bf16 autocast; the policy still learns. --no-bf16: float32, other numbers from step 1
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert common.bf16_active(torch.device("cpu"), True)
    history = grpo_lm.main(tiny_args(tiny_model_dir, tmp_path, total_steps=25), task=digit_task())
    rewards = history["reward/mean"]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards
    plain = grpo_lm.main(tiny_args(tiny_model_dir, tmp_path / "f32", bf16=False), task=digit_task())
    assert plain["loss/kl"] != history["loss/kl"][:2]  # the same steps but for autocast
    assert all(math.isfinite(x) for x in history["loss/policy"] + history["loss/kl"])


def test_resume_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path):
    full = grpo_lm.main(
        tiny_args(tiny_model_dir, tmp_path / "a", total_steps=4, save_every=2, mu=2),
        task=digit_task(),
    )
    grpo_lm.main(tiny_args(tiny_model_dir, tmp_path / "b", total_steps=2, mu=2), task=digit_task())
    resumed = grpo_lm.main(
        tiny_args(
            tiny_model_dir,
            tmp_path / "b",
            total_steps=4,
            mu=2,
            resume=str(tmp_path / "b" / "run" / "checkpoint.pt"),
        ),
        task=digit_task(),
    )
    for key in ("loss/policy", "reward/mean", "loss/kl", "optim/grad_norm"):
        assert resumed[key] == pytest.approx(full[key][2:], rel=1e-5, abs=1e-7), key
    assert abs(full["loss/policy"][3]) > 0  # a real, non-trivial loss was compared
    assert (
        common.load_checkpoint(tmp_path / "b" / "run" / "checkpoint.pt")["reference"] is None
    )  # one iteration: unchanged


def test_cli_two_steps_writes_events_checkpoint_and_model(tiny_model_dir, tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "grpo_lm.py"),
        "--model-name-or-path",
        str(tiny_model_dir),
        "--total-steps",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--max-new-tokens",
        "8",
        "--eval-size",
        "4",
        "--sample-every",
        "1",
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "cli",
        "--beta",
        "0.1",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    run = tmp_path / "cli"
    assert (
        list(run.glob("events.out.tfevents.*")) and (run / "final_model" / "config.json").is_file()
    )
    ckpt = common.load_checkpoint(run / "checkpoint.pt")
    assert ckpt["step"] == 2 and ckpt["args"]["group_size"] == 4
    assert "step 2 samples" in out.stdout + out.stderr


def test_cli_bad_input_is_one_line(tmp_path):
    # the real command line, once: exit code 2, one line, no traceback (the in-process table of
    # test_bad_input_lm.py holds every other case, through the same cli())
    out = subprocess.run(
        [sys.executable, str(ROOT / "grpo_lm.py"), "--dataset", "missing.jsonl"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last == "error: --dataset: cannot read missing.jsonl: No such file or directory"
    assert "Traceback" not in out.stderr


def test_raising_reward_function_is_reported_and_saved_work_kept(tiny_model_dir, tmp_path):
    task = digit_task()
    grpo_lm.main(tiny_args(tiny_model_dir, tmp_path, total_steps=1), task=task)
    ckpt = tmp_path / "run" / "checkpoint.pt"
    before = ckpt.stat().st_mtime_ns

    def broken(completion, example):
        raise KeyError("score")

    task.reward_fn = broken
    with pytest.raises(
        common.UsageError, match=r"reward function of task 'digits' raised KeyError"
    ):
        grpo_lm.main(
            tiny_args(tiny_model_dir, tmp_path, total_steps=3, resume=str(ckpt)), task=task
        )
    assert ckpt.stat().st_mtime_ns == before and common.load_checkpoint(ckpt)["step"] == 1


@pytest.mark.parametrize("flags", [dict(gradient_checkpointing=True)])
def test_whole_sequence_log_probs_take_the_same_steps(tiny_model_dir, tmp_path, flags):
    # --gradient-checkpointing runs whole sequences instead of the shared prompt pass
    plain = grpo_lm.main(tiny_args(tiny_model_dir, tmp_path / "a", beta=0.1), task=digit_task())
    ckpt = grpo_lm.main(
        tiny_args(tiny_model_dir, tmp_path / "b", beta=0.1, **flags), task=digit_task()
    )
    # float32 on the CPU; on CUDA, bf16 autocast rounds the checkpointed whole-sequence pass and the
    # shared prompt pass differently (measured on an H100: 2.8e-3 relative on step 2's KL of 8e-3)
    tol = dict(rel=tolerance(1e-5, 1e-2), abs=tolerance(1e-7, 1e-6))
    for key in ("loss/policy", "loss/kl", "optim/grad_norm", "reward/mean"):
        assert ckpt[key] == pytest.approx(plain[key], **tol), key
    assert plain["optim/grad_norm"][1] > 0 and plain["loss/kl"][1] > 0


# ---------------------------------------------------------------------------------------------
# Numerics off the default path (issue 13, "Trust I")
# ---------------------------------------------------------------------------------------------
def _batch(tok):
    prompts = tok(
        ["What is 12 + 30?", "1+1="], return_tensors="pt", padding=True, add_special_tokens=False
    )
    rows = [
        tok(t, add_special_tokens=False)["input_ids"]
        for t in ["42<eos>", "forty two<eos>", "2<eos>", "11, 2<eos>"]
    ]
    T = max(map(len, rows))
    completions = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows])
    att = grpo_lm.completion_mask(completions, tok.eos_token_id).long()
    return (
        prompts["input_ids"],
        prompts["attention_mask"],
        torch.tensor([0, 0, 1, 1]),
        completions,
        att,
    )


@pytest.mark.parametrize("share", [True, False])
def test_log_probs_take_the_lm_head_in_float32_under_bf16_autocast(tiny_model_dir, share):
    # item 4: under bf16 autocast the body may run in bf16, but the LM head and the log-softmax of
    # every log prob that enters the loss run in float32 (CPU autocast stands in for CUDA's here)
    model = common.load_model(str(tiny_model_dir)).eval()
    tok = common.load_tokenizer(str(tiny_model_dir))
    prompt_ids, prompt_mask, index, completions, att = _batch(tok)
    heads = []  # what the LM head computed, from what, in every forward pass of token_log_probs
    hook = model.lm_head.register_forward_hook(
        lambda module, inputs, output: heads.append((inputs[0], output))
    )
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        mb = grpo_lm.MicroBatch(prompt_ids, prompt_mask, index, completions, att)
        logp = grpo_lm.token_log_probs(model, mb, 0.7, share_prompt=share)
        bf16 = model.lm_head(heads[-1][0])  # what the head would give under autocast on its own
    hook.remove()
    # one head call over the (b * T, H) hidden states of the completion positions, then ours
    assert len(heads) == 1 + 1 and bf16.dtype == torch.bfloat16
    hidden, logits = heads[0]
    assert logits.dtype == torch.float32
    assert torch.equal(logits, torch.nn.functional.linear(hidden.float(), model.lm_head.weight))
    # the whole log prob, by hand: log_softmax(float32 logits / T) at the sampled tokens
    by_hand = (logits / 0.7).log_softmax(-1).gather(1, completions.reshape(-1, 1))
    torch.testing.assert_close(logp, by_hand.view(completions.shape), atol=1e-6, rtol=0)


def test_masked_positions_never_reach_the_exponent():
    # item 6: post-EOS positions may hold anything; exp() of their log ratios must not turn the loss
    # into NaN
    logp = torch.tensor([[-1.0, 0.0], [-2.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    old = torch.tensor(
        [[-1.1, -1000.0], [-2.0, -3.0]]
    )  # exp(logp - old) overflows at the masked position
    ref = torch.tensor([[-0.9, 1000.0], [-2.5, -3.0]])  # exp(ref - logp) overflows there too
    clean_old, clean_ref = old.clone(), ref.clone()
    clean_old[0, 1], clean_ref[0, 1] = 0.0, 0.0
    for level in ("token", "sequence"):
        out = {}
        for name, (o, r) in {"overflow": (old, ref), "clean": (clean_old, clean_ref)}.items():
            logp.grad = None
            loss, stats = grpo_lm.grpo_loss(
                logp,
                o,
                r,
                torch.tensor([1.0, -0.5]),
                mask=mask,
                clip_range=0.2,
                beta=0.04,
                num_sequences=2,
                level=level,
            )
            loss.backward()
            out[name] = (loss.detach(), logp.grad.clone(), stats["kl"])
        assert torch.isfinite(out["overflow"][0]), level
        for a, b in zip(out["overflow"], out["clean"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_each_distinct_prompt_is_prefilled_once_with_the_same_samples(tiny_model_dir):
    # generate_completions: each distinct prompt goes through the model once (2 rows, not 2 x 4),
    # and the draws are those of the same 8 prompts given one by one
    model = common.load_model(str(tiny_model_dir)).eval()
    tok = common.load_tokenizer(str(tiny_model_dir))
    prompts = [tok(q, add_special_tokens=False)["input_ids"] for q in ("1+1=", "What is 2 + 3?")]
    options = dict(temperature=0.7, top_p=1.0, max_new_tokens=9, bf16=False, seed_keys=(1, 2, 0))
    shapes = []
    model.register_forward_pre_hook(
        lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)), with_kwargs=True
    )
    rows = common.generate_completions(model, prompts, 4, tok, **options).ids.tolist()
    assert shapes[:2] == [(2, 14), (8, 1)]  # the prompts once, then each row's first token
    shapes.clear()
    each = [p for p in prompts for _ in range(4)]
    rows_each = common.generate_completions(model, each, 1, tok, **options).ids.tolist()
    assert shapes[0] == (8, 14)  # every row's whole prompt
    assert rows == rows_each and len(rows) == 8 and len({tuple(r) for r in rows}) > 1


def test_decode_drops_finished_rows_and_draws_what_generate_draws(tiny_model_dir):
    # common.decode: each prompt goes through the model once, then a row that emitted EOS leaves
    # the batch (each forward pass sees only the rows still going); the tokens are those of
    # transformers' generate on the repeated prompts with the same draw as its last logits
    # processor (each row's own uniform at every step); greedy too
    model = common.load_model(str(tiny_model_dir)).eval()
    tok = common.load_tokenizer(str(tiny_model_dir))
    prompts = [tok(q, add_special_tokens=False)["input_ids"] for q in ("1+1=", "What is 2 + 3?")]
    ids, att = common.pad_left(prompts, tok.pad_token_id)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    seen = []
    hook = model.register_forward_pre_hook(
        lambda m, a, k: seen.append(len(k["input_ids"])), with_kwargs=True
    )
    uniforms = common.row_uniforms((0,), range(16), 40)
    draw = common.DrawNextToken(1.0, 1.0, uniforms)
    with torch.no_grad():
        rows, _ = common.decode(
            model, ids, att, max_new_tokens=40, eos=eos, pad=pad, pick=draw, repeats=8
        )
    hook.remove()
    rows = rows.tolist()
    lengths = grpo_lm.completion_mask(torch.tensor(rows), eos).sum(1).long().tolist()
    longest = max(lengths)
    assert min(lengths) < longest == len(seen)  # some rows end early
    assert seen == [2] + [sum(n > t for n in lengths) for t in range(1, longest)]

    def processor(draw):  # the draw as generate's last logits processor, greedy emits its token
        def call(input_ids, scores):
            step = input_ids.shape[1] - ids.shape[1]  # the position of the token drawn
            token = draw(scores, torch.arange(len(scores)), step)
            return torch.full_like(scores, -torch.inf).scatter_(1, token[:, None], 0.0)

        return call

    by_generate = common.DrawNextToken(1.0, 1.0, uniforms)
    ids, att = ids.repeat_interleave(8, 0), att.repeat_interleave(8, 0)
    kw = dict(attention_mask=att, max_new_tokens=40, pad_token_id=pad, eos_token_id=eos)
    out = model.generate(ids, logits_processor=[processor(by_generate)], do_sample=False, **kw)
    assert rows == out[:, ids.shape[1] :].tolist()
    with torch.no_grad():
        greedy, _ = common.decode(
            model,
            ids,
            att,
            max_new_tokens=40,
            eos=eos,
            pad=pad,
            pick=lambda logits, going, step: logits.argmax(-1),
        )
    assert greedy.tolist() == model.generate(ids, do_sample=False, **kw)[:, ids.shape[1] :].tolist()


def test_the_sampler_draws_each_token_with_its_probability():
    # DrawNextToken's inverse-CDF draw: 40,000 draws from p = (0.5, 0.3, 0.2, 0) land on each
    # token with frequency p (binomial std <= 0.0025), never on the token of probability 0
    uniforms = torch.rand(40_000, 1, generator=torch.Generator().manual_seed(0))
    draw = common.DrawNextToken(temperature=1.0, top_p=1.0, uniforms=uniforms)
    scores = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).log().expand(40_000, 4)
    token = draw(scores, torch.arange(40_000), 0)
    freq = torch.bincount(token, minlength=4).float() / len(token)
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.01, rtol=0)
    with pytest.raises(common.UsageError, match="non-finite next-token probabilities"):
        draw(torch.tensor([[0.0, float("nan")]]), torch.tensor([0]), 0)


# ---------------------------------------------------------------------------------------------
# Resume semantics (issue 14)
# ---------------------------------------------------------------------------------------------
def test_resume_takes_the_learning_rate_given_again(tiny_model_dir, tmp_path):
    # the run's saved flags are the defaults; a flag given again takes effect, the learning rate too
    # (the loaded optimizer state must not win)
    grpo_lm.main(tiny_args(tiny_model_dir, tmp_path, total_steps=1), task=digit_task())
    ckpt = str(tmp_path / "run" / "checkpoint.pt")
    resumed = grpo_lm.main(
        tiny_args(tiny_model_dir, tmp_path, total_steps=2, learning_rate=3e-3, resume=ckpt),
        task=digit_task(),
    )
    assert len(resumed["reward/mean"]) == 1
    saved = common.load_checkpoint(ckpt)
    assert (
        saved["optimizer"]["param_groups"][0]["lr"] == 3e-3
        and saved["args"]["learning_rate"] == 3e-3
    )


def test_resumed_run_logs_each_step_once(tiny_model_dir, tmp_path):
    # a run that logged steps 1-3 but whose last checkpoint is step 2 (killed after logging step 3)
    # is resumed: TensorBoard must show step 3 once, from the resumed run
    full = grpo_lm.main(
        tiny_args(tiny_model_dir, tmp_path, total_steps=3, save_every=2), task=digit_task()
    )
    ckpt = tmp_path / "run" / "checkpoint.pt"
    state = common.load_checkpoint(ckpt)
    assert state["step"] == 3
    grpo_lm.main(
        tiny_args(tiny_model_dir, tmp_path / "b", total_steps=2), task=digit_task()
    )  # the step-2 checkpoint
    (tmp_path / "b" / "run" / "checkpoint.pt").replace(ckpt)
    resumed = grpo_lm.main(
        tiny_args(tiny_model_dir, tmp_path / "b", total_steps=3, resume=str(ckpt)),
        task=digit_task(),
    )  # the flags the checkpoint holds (--runs-dir b); it writes beside ckpt
    series = tb_scalars(tmp_path / "run")["reward/mean"]
    assert [step for step, _ in series] == [1, 2, 3], series
    assert series[-1][1] == pytest.approx(resumed["reward/mean"][0])
    assert resumed["reward/mean"][0] == pytest.approx(full["reward/mean"][2])


def test_eval_only_needs_no_training_questions(tiny_model_dir, tmp_path):
    # issue 24: --eval-only on a --dataset that leaves fewer training questions than
    # --prompts-per-step (main_job.py's rephrased problems) was refused; training still is
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(f'{{"question": "{a}+1", "answer": "{a + 1}"}}\n' for a in range(9)))
    args = tiny_args(tiny_model_dir, tmp_path, dataset=str(data), eval_size=8, eval_only=True)
    assert len(grpo_lm.main(args)["eval/accuracy"]) == 1
    with pytest.raises(
        common.UsageError,
        match=r"^--max-prompt-length 512: 1 training prompts fit \(of 1\), fewer than --prompts",
    ):
        grpo_lm.main(dataclasses.replace(args, eval_only=False, run_name="train"))


def test_rows_with_a_gradient_leave_out_only_what_adds_nothing():
    rows = grpo_lm.rows_with_a_gradient
    adv = torch.tensor([0.0] * 4 + [1.0, -1.0, 0.5, -0.5])  # G = 4: group 0's rewards are equal
    mask = torch.ones(8, 3)
    mask[5] = 0  # no token in the loss (--mask-truncated-completions)
    assert rows(adv, mask, 4, other_terms=False).tolist() == [4, 6, 7]
    with_kl = rows(adv, mask, 4, other_terms=True)
    assert with_kl.tolist() == [0, 1, 2, 3, 4, 6, 7]  # the KL's gradient
    # --loss-type bnpo (a per-micro-batch mean counts every row): main() computes every row
    all_zero = torch.zeros(8)  # equal rewards everywhere
    assert rows(all_zero, mask, 4, other_terms=False).tolist() == [0, 1, 2, 3]  # AdamW still steps
    per_token = torch.zeros(8, 3)  # process supervision: one advantage per token
    per_token[1, 2] = 0.3
    assert rows(per_token, mask, 4, other_terms=False).tolist() == [1]


def test_without_the_kl_the_update_leaves_out_equal_reward_groups_with_the_same_gradient(
    tiny_model_dir, tmp_path, monkeypatch
):
    # issue 24: with beta = 0 a group of equal rewards adds exactly 0 to eq. 3's gradient, so steps
    # 4-5 leave it out; the first step's gradient is the one computed from every row (to float
    # rounding: the micro-batches hold other rows)
    examples = [
        {"question": f"{a}+{b}", "answer": str(a + b)} for a in range(10) for b in range(10)
    ]

    def digit_first(completion: str, example: dict) -> float:  # 0 or 1: many equal-reward groups
        return float(any(c.isdigit() for c in completion[:2]))

    task = tasks.Task("d", examples[8:], examples[:8], digit_first, tasks.number_matches)
    # on the CPU (the samples follow the device's arithmetic); seed 7: a quarter of the groups
    # have equal rewards (seeds 1-8 gave 0 to a half)
    args = dict(beta=0.0, total_steps=1, device="cpu", seed=7)
    skipped = grpo_lm.main(tiny_args(tiny_model_dir, tmp_path / "a", **args), task=task)
    monkeypatch.setattr(
        grpo_lm, "rows_with_a_gradient", lambda adv, mask, *_, **__: torch.arange(len(mask))
    )
    every = grpo_lm.main(tiny_args(tiny_model_dir, tmp_path / "b", **args), task=task)
    equal = skipped["reward/frac_zero_std_groups"]
    assert equal == every["reward/frac_zero_std_groups"] and 0 < equal[0] < 1  # 0.25 here
    assert skipped["loss/tokens"][0] < every["loss/tokens"][0]  # those groups left out
    assert skipped["optim/grad_norm"] == pytest.approx(every["optim/grad_norm"], rel=1e-5)
    assert every["optim/grad_norm"][0] > 0.1


def test_entropy_of_the_sampling_distribution_is_logged(tiny_model_dir, tmp_path):
    # issue 16: loss/entropy, the mean entropy of softmax(logits / T) at the completion tokens in
    # the loss
    model = common.load_model(str(tiny_model_dir)).eval()
    tok = common.load_tokenizer(str(tiny_model_dir))
    prompt_ids, prompt_mask, index, completions, att = _batch(tok)
    with torch.no_grad():
        logp, entropy = grpo_lm.token_log_probs(
            model,
            grpo_lm.MicroBatch(prompt_ids, prompt_mask, index, completions, att),
            0.7,
            share_prompt=True,
            entropy_coef=0.0,
        )
        inputs = torch.cat([prompt_ids[index], completions], 1)
        mask = torch.cat([prompt_mask[index], att], 1)
        logits = model(
            input_ids=inputs, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)
        ).logits
        p = (logits[:, -completions.shape[1] - 1 : -1] / 0.7).softmax(-1)
    torch.testing.assert_close(entropy, -(p * p.log()).sum(-1), atol=1e-5, rtol=1e-5)
    assert torch.equal(
        logp,
        grpo_lm.token_log_probs(
            model,
            grpo_lm.MicroBatch(prompt_ids, prompt_mask, index, completions, att),
            0.7,
            share_prompt=True,
        ),
    )
    history = grpo_lm.main(tiny_args(tiny_model_dir, tmp_path, total_steps=1), task=digit_task())
    assert (
        0 < history["loss/entropy"][0] < math.log(len(tok))
    )  # below the uniform distribution's log V


def offline_wandb_record(model_dir, tmp_path, monkeypatch) -> tuple[bytes, str]:
    """A one-step --track run, offline: wandb's own log (the config and the synced TensorBoard
    scalars) and its debug log."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "tests-project")  # wandb's own variable picks the project
    grpo_lm.main(tiny_args(model_dir, tmp_path, total_steps=1, track=True), task=digit_task())
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    return runs[0].read_bytes(), (runs[0].parent / "logs" / "debug.log").read_text()


def test_track_writes_an_offline_wandb_run_with_the_tensorboard_scalars(
    tiny_model_dir, tmp_path, monkeypatch, no_wandb_login
):
    # issue 16: --track (CleanRL's convention) logs the run to wandb; offline here, no network.
    # sync_tensorboard patches the SummaryWriters created after wandb.init, so RunLog creates its
    # writer after it (the other order synced the config and no metric)
    record, logs = offline_wandb_record(tiny_model_dir, tmp_path, monkeypatch)
    assert b"group_size" in record and b"mask_truncated_completions" in record  # the config
    assert "finishing run tests-project/run" in logs  # $WANDB_PROJECT, the run named as its dir
    assert b"reward/mean" in record and b"loss/kl" in record  # the scalars


def test_track_without_wandb_is_one_line(monkeypatch):
    hide_module(monkeypatch, "wandb")
    with pytest.raises(
        common.UsageError, match="--track: wandb is not installed; run `pip install wandb`"
    ):
        grpo_lm.validate(grpo_lm.Args(track=True))


def test_eval_samples_report_pass_at_k_and_maj_at_n_of_the_responses_they_report(
    tiny_model_dir, tmp_path
):
    # --eval-samples 4 on 5 held-out questions: the report lists every response, and its metrics
    # are recomputed here from them: pass@k as the share of k-subsets with a right response
    task = digit_task()
    task.correct_fn = lambda completion, example: sum(c.isdigit() for c in completion) % 2 == 0
    kw = dict(eval_only=True, eval_size=5, eval_samples=4)
    history = grpo_lm.main(tiny_args(tiny_model_dir, tmp_path, **kw), task=task)
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["questions"] == 5 and [len(r) for r in report["first"]] == [4] * 5
    right = [[task.correct_fn(text, None) for text in texts] for texts in report["first"]]

    def pass_at(k):  # over the questions, the share of the k-subsets that hold a right response
        shares = [
            sum(any(r[i] for i in s) for s in itertools.combinations(range(4), k)) / math.comb(4, k)
            for r in right
        ]
        return sum(shares) / len(shares)

    number = tasks.extract_final_number  # a vote: the last number, else the text
    votes = [[t if number(t) is None else number(t) for t in ts] for ts in report["first"]]
    top = [max(range(4), key=lambda i, v=v: v.count(v[i])) for v in votes]  # the first of the most
    majority = [r[i] for r, i in zip(right, top, strict=True)]
    expected = dict(accuracy=sum(map(sum, right)) / 20, maj=sum(majority) / 5)
    assert 0 < expected["accuracy"] < 1  # some responses right, some wrong
    assert report["accuracy"] == pytest.approx(expected["accuracy"])
    assert report["pass@2"] == pytest.approx(pass_at(2))
    assert report["pass@4"] == pytest.approx(pass_at(4))
    assert report["maj@4"] == pytest.approx(expected["maj"])
    pairs = zip(task.test[:5], report["first"], strict=True)
    rewards = [task.reward_fn(text, example) for example, texts in pairs for text in texts]
    assert report["reward_mean"] == pytest.approx(sum(rewards) / 20)  # the task's reward
    keys = ("accuracy", "pass@2", "pass@4", "maj@4", "reward_mean")
    assert history == {f"eval/{k}": [report[k]] for k in keys}
    kw |= dict(run_name="again")
    grpo_lm.main(tiny_args(tiny_model_dir, tmp_path, **kw), task=task)  # seeded: the same samples
    assert json.loads((tmp_path / "again" / "eval.json").read_text()) == report
    trained = grpo_lm.main(
        tiny_args(tiny_model_dir, tmp_path, total_steps=1, eval_samples=2, run_name="train"),
        task=task,
    )  # logged at every evaluation (steps 0 and 1)
    assert all(len(trained[f"eval/{k}"]) == 2 for k in ("accuracy", "pass@2", "maj@2"))


def test_eval_only_scores_a_checkpoint_and_a_final_model(tiny_model_dir, tmp_path):
    # issue 16: --eval-only gives the greedy held-out accuracy of a saved model, as training
    # measured it
    task = digit_task()
    task.correct_fn = lambda completion, example: (
        sum(c.isdigit() for c in completion) >= 3
    )  # what the reward teaches
    trained = grpo_lm.main(
        tiny_args(tiny_model_dir, tmp_path, total_steps=4, eval_size=8, eval_every=4), task=task
    )
    run = tmp_path / "run"
    from_ckpt = grpo_lm.main(
        tiny_args(
            tiny_model_dir,
            tmp_path,
            total_steps=4,
            eval_size=8,
            eval_only=True,
            resume=str(run / "checkpoint.pt"),
        ),
        task=task,
    )
    from_model = grpo_lm.main(
        tiny_args(run / "final_model", tmp_path, eval_size=8, eval_only=True, run_name="eval"),
        task=task,
    )
    assert (
        from_ckpt["eval/accuracy"] == from_model["eval/accuracy"] == trained["eval/accuracy"][-1:]
    )
    report = json.loads((run / "eval_step4.json").read_text())
    assert (
        report["accuracy"] == trained["eval/accuracy"][-1]
        and report["questions"] == 8
        and report["checkpoint"] == 4
        and len(report["first"]) == 5
    )
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["checkpoint"] is None
    assert (tmp_path / "eval" / "eval.json").is_file()
    assert (
        trained["eval/accuracy"][0] != trained["eval/accuracy"][-1]
    )  # training moved it: a real comparison


def test_the_overlong_penalty_stays_out_of_the_verifiable_rewards(tiny_model_dir, tmp_path):
    # issue 39: the penalty was added in place to a tensor that was also batch.verifiable, so the
    # reward model's first training labels held it
    task, seen = digit_task(), []
    add = grpo_lm.RewardModelTraining.add

    def record(self, batch):
        responses = [self.args.response_prefix + c for c in batch.completions]
        seen.append((batch.verifiable.clone(), tasks.score_task(task, responses, batch.examples)))
        add(self, batch)

    flags = dict(train_reward_model=True, iterations=2, overlong_buffer=8, total_steps=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo_lm.RewardModelTraining, "add", record)
        history = grpo_lm.main(tiny_args(tiny_model_dir, tmp_path, **flags), task=task)
    assert min(history["reward/mean"]) < 0  # the penalty was paid: completions ran to the cap
    for verifiable, (scores, _) in seen:
        assert torch.equal(verifiable, scores)


def test_a_dataset_run_is_named_after_the_dataset(tiny_model_dir, tmp_path):
    # issue 39: the default run directory was named after --task (addition__...) with --dataset
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(12)]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = tiny_args(tiny_model_dir, tmp_path, dataset=str(data), run_name=None, eval_only=True)
    grpo_lm.main(dataclasses.replace(args, eval_size=4))
    assert [d.name.split("__")[0] for d in tmp_path.iterdir() if d.is_dir()] == ["sums"]


def test_ctrl_c_in_a_reward_function_ends_as_an_interrupt(tiny_model_dir, tmp_path, capsys):
    # issue 39: KeyboardInterrupt raised in user code was reported as the function's error
    task = digit_task()

    def interrupted(completion, example):
        raise KeyboardInterrupt

    task.reward_fn = interrupted
    args = tiny_args(tiny_model_dir, tmp_path, total_steps=1, eval_size=0)
    with pytest.raises(SystemExit) as exit_info:
        common.run_cli(lambda: grpo_lm.main(args, task=task))
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted"
