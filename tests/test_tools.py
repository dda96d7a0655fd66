"""Tools while sampling (issue 49): a tool's tokens join a row as context, never as the policy's.

The sampler returns a sampled mask (1 where the policy drew the token, 0 where a tool wrote it);
every loss term, normaliser, length and penalty reads it. Pinned here: the stream a scripted model
and a tool write, and the budget's edges (goal 3 a, d); the sampler's log probs against a
teacher-forced forward (b); a tool's output moving no sampled token's weight in any loss (c); and
main() reading the mask in the loss, its counts, the overlong penalty, the logged lengths and
process supervision. Split invariance with a tool: test_split_invariance.py's "tool" case.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT, make_tokenizer
from test_grpo_lm import digit_task, tiny_args

import common
import grpo_lm

LENGTH_TOOL = str(ROOT / "tests" / "length_tool.py") + ":length"  # '#' ... '=': the call's length
TOOL_FLAGS = dict(tool=LENGTH_TOOL, tool_markers=("#", "="))


class Markov(torch.nn.Module):
    """The tiny model's cache and shapes, with logits that draw ``following[the last token]``."""

    def __init__(self, model, following: torch.Tensor):
        super().__init__()
        self.model = model
        self.following = following

    @property
    def device(self):
        return self.model.device

    def forward(self, input_ids, **kwargs):
        out = self.model(input_ids=input_ids, **kwargs)
        logits = torch.full_like(out.logits, -1e4)
        logits[:, -1].scatter_(1, self.following[input_ids[:, -1], None], 0.0)
        out.logits = logits
        return out


def scripted(tiny_model_dir, function, **options):
    """The completions of a Markov model that writes '#1+2=' after a '?', 'k' after 'o', the EOS
    after 'k', and 'o' after any other token, with the tool ``function`` behind the markers '#'
    and '='; (texts, sampled masks, the calls it received, the :class:`common.Completions`)."""
    tok = make_tokenizer()
    vocab = tok.get_vocab()
    following = torch.full((len(vocab),), vocab["o"])
    script = {"?": "#", "#": "1", "1": "+", "+": "2", "2": "=", "o": "k", "k": "<eos>"}
    for token, then in script.items():
        following[vocab[token]] = vocab[then]
    model = Markov(common.load_model(str(tiny_model_dir)).eval(), following)
    calls = []

    def recorded(call):
        calls.append(call)
        return function(call)

    questions = options.pop("questions", ("What is 1 + 2?", "ok"))
    prompts = [tok(q, add_special_tokens=False)["input_ids"] for q in questions]
    options = dict(temperature=1.0, top_p=1.0, bf16=False, seed_keys=(0,)) | options
    max_tool_tokens = options.pop("max_tool_tokens", 16)
    prefix = options.pop("prefix", "")  # --response-prefix: the end of each prompt
    tool = grpo_lm.Tool(recorded, ("#", "="), max_tool_tokens, prefix)
    out = common.generate_completions(model, prompts, 2, tok, tool=tool, **options)
    texts = tok.batch_decode(out.ids, skip_special_tokens=False)
    texts = [text.replace("<pad>", "") for text in texts]
    return texts, out.sampled.long().tolist(), calls, out


def test_a_tools_tokens_go_in_between_the_draws_and_only_the_draws_are_sampled(tiny_model_dir):
    texts, sampled, calls, out = scripted(tiny_model_dir, lambda call: "3.", max_new_tokens=20)
    assert texts == ["#1+2=3.ok<eos>"] * 2 + ["<eos>"] * 2  # each prompt twice
    assert sampled[0] == sampled[1] == [1, 1, 1, 1, 1, 0, 0, 1, 1, 1]
    assert sampled[2] == [1] + [0] * 9
    assert calls == ["1+2", "1+2"]  # the text between the markers, once a row
    assert out.tool_calls.tolist() == [[1, 0], [1, 0], [0, 0], [0, 0]]  # calls, errors
    # a tool that raises writes its error (cut to --max-tool-tokens); one that returns None, nothing
    texts, sampled, _, out = scripted(
        tiny_model_dir, lambda call: 1 / 0, max_new_tokens=20, max_tool_tokens=4
    )
    assert texts[0] == "#1+2=Zerok<eos>"  # "ZeroDivisionError: division by zero", 4 tokens
    assert out.tool_calls[:, 1].tolist() == [1, 1, 0, 0]
    texts, sampled, _, _ = scripted(tiny_model_dir, lambda call: None, max_new_tokens=20)
    assert texts[0] == "#1+2=ok<eos>" and sampled[0] == [1] * 8
    # a call opened by --response-prefix ("#", prefilled: the prompt's end) is a call
    texts, sampled, calls, _ = scripted(
        tiny_model_dir, lambda call: "3.", max_new_tokens=20, questions=("Q: #",), prefix="#"
    )
    assert texts[0] == "1+2=3.ok<eos>" and calls == ["1+2", "1+2"]
    # one that the prefix opened and closed is not: "#1=3 +" then the drawn "2=" calls nothing
    texts, sampled, calls, _ = scripted(
        tiny_model_dir,
        lambda call: "3.",
        max_new_tokens=20,
        questions=("Q: #1=3 +",),
        prefix="#1=3 +",
    )
    assert texts[0] == "2=ok<eos>" and calls == []
    # a tool's output is never read for a call: "3=" ends with the closing marker, one call a row
    texts, sampled, calls, _ = scripted(tiny_model_dir, lambda call: "3=", max_new_tokens=20)
    assert texts[0] == "#1+2=3=ok<eos>" and calls == ["1+2", "1+2"]


@pytest.mark.parametrize(
    "case",
    [
        (7, 16, "#1+2=3.", [1, 1, 1, 1, 1, 0, 0]),  # the tool's output fills the budget: kept
        (6, 16, "#1+2=3", [1, 1, 1, 1, 1, 0]),  # it would overflow: cut, as a truncated answer
        (20, 1, "#1+2=3ok<eos>", [1, 1, 1, 1, 1, 0, 1, 1, 1]),  # --max-tool-tokens 1: "3" alone
    ],
)
def test_a_tools_output_counts_against_the_budget(tiny_model_dir, case):
    max_new_tokens, max_tool_tokens, text, sampled = case
    texts, masks, _, _ = scripted(
        tiny_model_dir,
        lambda call: "3.",
        max_new_tokens=max_new_tokens,
        max_tool_tokens=max_tool_tokens,
    )
    assert texts[0] == text and masks[0][: len(sampled)] == sampled


def test_the_samplers_log_probs_equal_a_teacher_forced_forward(tool_model_dir):
    # recorded during the cached decode, with a tool's tokens injected between the draws
    model = common.load_model(str(tool_model_dir)).eval()
    tok = make_tokenizer()
    questions = ("1+1?", "What is 2 + 3?", "7*8", "9")
    prompts = [tok(q, add_special_tokens=False)["input_ids"] for q in questions]
    tool = grpo_lm.make_tool(grpo_lm.Args(max_tool_tokens=3, **TOOL_FLAGS), {})
    options = dict(temperature=0.7, top_p=1.0, max_new_tokens=16, bf16=False, seed_keys=(5,))
    out = common.generate_completions(model, prompts, 4, tok, tool=tool, **options)
    mask = grpo_lm.completion_mask(out.ids, tok.eos_token_id)
    assert ((mask - out.sampled) > 0).sum() >= 8  # a tool wrote tokens
    prompt_ids, prompt_mask = common.pad_left(prompts, tok.pad_token_id)
    micro_batch = grpo_lm.MicroBatch(
        prompt_ids, prompt_mask, torch.arange(16) // 4, out.ids, mask.long()
    )
    with torch.no_grad():
        logp = grpo_lm.token_log_probs(model, micro_batch, 0.7, share_prompt=False)
    torch.testing.assert_close(logp * out.sampled, out.log_probs, rtol=0, atol=1e-5)


def layout(tool_tokens: int, generator) -> dict:
    """A micro-batch's loss inputs, 2 rows: row 0 three sampled tokens, ``tool_tokens`` a tool
    wrote, three sampled; row 1 five sampled. The sampled tokens' values are the same in every
    layout (drawn first), the tool's are drawn anew."""
    sampled_values = torch.randn(4, 6, generator=generator)  # logp, old, ref, entropy
    T = 6 + tool_tokens
    values = torch.randn(4, 2, T, generator=generator) * 3 - 2
    mask = torch.zeros(2, T)
    mask[0, :3] = 1
    mask[0, 3 + tool_tokens :] = 1
    mask[1, :5] = 1
    values[:, 0, mask[0].bool()] = sampled_values
    values[:, 1, :5] = sampled_values[:, :5] + 0.5
    logp = (-values[0].abs()).requires_grad_()
    old = logp.detach() + 0.3 * values[1].tanh()
    ref = -values[2].abs()
    entropy = values[3].abs().requires_grad_()
    return dict(logp=logp, old=old, ref=ref, entropy=entropy, mask=mask)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_tools_output_moves_no_sampled_tokens_weight(loss_type, level):
    # the gradient of the loss with respect to each sampled token's log prob and entropy is the
    # same whatever the tool wrote (2 or 5 tokens of other values), and exactly 0 at its tokens
    weights = []
    for tool_tokens in (2, 5):
        x = layout(tool_tokens, torch.Generator().manual_seed(0))
        mask = x["mask"]
        loss, _ = grpo_lm.grpo_loss(
            x["logp"],
            x["old"],
            x["ref"],
            torch.tensor([1.5, -0.7]),
            mask=mask,
            clip_range=0.2,
            beta=0.04,
            num_sequences=2,
            entropy=x["entropy"],
            loss_type=loss_type,
            level=level,
            num_tokens=mask.sum().item(),  # main()'s: the loss mask's count
            max_length=16,
            entropy_coef=0.01,
        )
        loss.backward()
        for grad in (x["logp"].grad, x["entropy"].grad):
            assert torch.all(grad[~mask.bool()] == 0)  # a tool's tokens and the padding
        weights.append(torch.cat([x["logp"].grad[mask.bool()], x["entropy"].grad[mask.bool()]]))
        assert weights[-1].abs().min() > 0
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-6, atol=0)


def test_main_reads_the_sampled_mask_in_the_loss_lengths_and_overlong_penalty(
    tool_model_dir, tmp_path, monkeypatch
):
    batches = []
    sample_and_score = grpo_lm.sample_and_score

    def spy(*args, **kwargs):
        batches.append(sample_and_score(*args, **kwargs))
        return batches[-1]

    monkeypatch.setattr(grpo_lm, "sample_and_score", spy)
    flags = dict(total_steps=1, overlong_buffer=8, entropy_coef=0.01, **TOOL_FLAGS)
    history = grpo_lm.main(tiny_args(tool_model_dir, tmp_path, **flags), task=digit_task())
    batch = batches[0]
    sampled = batch.sampled_mask
    written = batch.completion_mask - sampled  # a tool's tokens
    assert written.min() == 0 and written.sum() >= 8
    assert history["loss/tokens"] == [sampled.sum().item()]  # the tokens in the loss
    lengths = sampled.sum(1)
    assert history["completion/length_mean"][0] == pytest.approx(lengths.mean().item())
    penalty = grpo_lm.overlong_penalty(sampled, 12, 8)
    assert torch.equal(batch.rewards - batch.verifiable, penalty)
    assert not torch.equal(penalty, grpo_lm.overlong_penalty(batch.completion_mask, 12, 8))
    calls = batch.tool_calls[:, 0].float()
    assert history["tools/frac_calling"][0] == pytest.approx((calls > 0).float().mean().item())
    assert history["tools/errors"][0] == batch.tool_calls[:, 1].sum().item()
    assert history["tools/tokens_mean"][0] == pytest.approx(written.sum(1).mean().item())
    assert history["sampling/logp_diff_max"][0] < 1e-5  # the sampler's log probs, the trainer's
    assert len(history["eval/frac_calling_tool"]) == 2  # the held-out answers have the tool too


def test_process_supervision_pays_no_step_whose_result_a_tool_wrote():
    # "1+2=3 2+2=5" twice: the tool wrote the first "3"; the policy wrote everything else
    tok = make_tokenizer()
    text = "1+2=3 2+2=5"
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]] * 2)
    sampled = torch.ones(2, len(text))
    sampled[0, 4] = 0
    batch = grpo_lm.Batch(
        prompt_ids=torch.ones(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1, dtype=torch.long),
        completion_ids=ids,
        completion_mask=torch.ones(2, len(text)),
        sampled_mask=sampled,
        sampler_log_probs=torch.zeros(2, len(text)),
        examples=[{"question": "q", "answer": "4"}] * 2,
        completions=[text] * 2,
        tool_calls=torch.tensor([[1, 0], [0, 0]]),
        rewards=torch.tensor([1.0, 1.0]),
    )
    args = grpo_lm.Args(group_size=2, prompts_per_step=1, supervision="process")
    advantages = grpo_lm.process_supervision(batch, tok, args, torch.device("cpu"))
    assert batch.scalars["process/steps_per_completion"] == 1.5  # row 0: one step paid, row 1: two
    assert advantages[0, 0] < advantages[1, 0]  # row 1 is paid for its right first step too


def test_the_calculator_parses_arithmetic_and_never_evaluates_code():
    assert grpo_lm.calculator("48/2") == "24>>"
    assert grpo_lm.calculator(" $1,234 × 2 ") == "2468>>"
    assert grpo_lm.calculator("1/3") == "0.333333>>"
    assert grpo_lm.calculator("-(2+3)*4") == "-20>>"
    for call, error in [
        ("__import__('os').system('true')", ValueError),
        ("2**10", ValueError),
        ("1/0", ZeroDivisionError),
        ("(1+", SyntaxError),
    ]:
        with pytest.raises(error):
            grpo_lm.calculator(call)


def test_a_file_that_tool_and_reward_fn_both_name_runs_once(tmp_path, monkeypatch):
    # as --correct-fn and --reward-fn share one run of a file: a module-level counter counts 1
    (tmp_path / "both.py").write_text(
        "import builtins\n"
        "builtins.runs = getattr(builtins, 'runs', 0) + 1\n"
        "def reward(completion, example):\n    return 0.0\n"
        "def tool(call):\n    return None\n"
    )
    import builtins

    monkeypatch.setattr(builtins, "runs", 0, raising=False)
    args = grpo_lm.Args(reward_fn=[f"{tmp_path}/both.py:reward"], tool=f"{tmp_path}/both.py:tool")
    files = {}
    grpo_lm.tasks.task_of(
        args.task,
        None,
        prompt_field="question",
        answer_field="answer",
        reward_fn=args.reward_fn,
        reward_weights=[],
        eval_size=4,
        files=files,
    )
    grpo_lm.make_tool(args, files)
    assert builtins.runs == 1
