"""examples/: Countdown and DeepSeek-R1's think/answer format as standalone files that the scripts
load with --dataset and --reward-fn. Hand-computed rewards, the Countdown writer, and short runs of
grpo_lm and ppo_lm on the tiny model through the public flags."""

import ast
import json
import runpy
import subprocess
import sys
from fractions import Fraction

import pytest
from conftest import ROOT, make_tiny_model
from test_grpo_lm import tiny_args

import grpo_lm

COUNTDOWN = ROOT / "examples" / "countdown.py"
THINK = ROOT / "examples" / "think_format.py"
DATE_TOOL = ROOT / "examples" / "date_tool.py"
countdown = runpy.run_path(str(COUNTDOWN))  # as --reward-fn loads them
think = runpy.run_path(str(THINK))
EX = {"question": "...", "numbers": [3, 5, 2, 7], "target": 9, "answer": "9"}


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    "path", [COUNTDOWN, THINK, DATE_TOOL], ids=["countdown", "think_format", "date_tool"]
)
def test_the_examples_import_only_the_standard_library(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert modules and {m.split(".")[0] for m in modules} <= sys.stdlib_module_names, modules


# ---------------------------------------------------------------------------------------------
# think_format.py: DeepSeek-R1's <think> ... </think> <answer> ... </answer>
# ---------------------------------------------------------------------------------------------
def test_format_reward_accepts_only_the_whole_shape():
    fmt = think["format_reward"]
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
    assert think["SYSTEM_PROMPT"] == (
        "Think about the problem step by step inside <think> </think> tags, then write only the "
        "final answer inside <answer> </answer> tags."
    )


def test_answer_reward_reads_the_last_number_of_the_answer_block():
    answer = think["answer_reward"]
    ex = {"question": "What is 12 + 13?", "answer": "25"}
    for completion, expected in (
        ("<think>12 + 13 = 25</think><answer>25</answer>", 1.0),
        ("<think>hm</think> <answer>26</answer>", 0.0),
        ("<answer>25</answer>", 1.0),  # the format is format_reward's business
        ("<think>25</think><answer>it is 25</answer>", 1.0),
        ("<answer>\n 25.0 \n</answer>", 1.0),
        ("<answer>25 or 26</answer>", 0.0),
        ("<answer>25</answer> then <answer>26</answer>", 0.0),  # the last block
        ("<answer> a <answer> 25 </answer>", 1.0),
        ("<answer>2</answer>5", 0.0),
        ("12 + 13 = 25", 0.0),  # no block
        ("<answer></answer>", 0.0),
        ("<answer>25", 0.0),
    ):
        assert answer(completion, ex) == expected, completion
    assert answer("<answer>1,234</answer>", {"answer": "1234"}) == 1.0
    assert answer("<answer>1234</answer>", {"answer": "1,234"}) == 1.0
    assert answer("<answer>-3.5</answer>", {"answer": "-3.5"}) == 1.0
    assert answer("<answer>3.5</answer>", {"answer": "-3.5"}) == 0.0
    with pytest.raises(ValueError):  # a text answer: the run stops, naming the function
        answer("<answer>Paris</answer>", {"answer": "Paris"})


# ---------------------------------------------------------------------------------------------
# countdown.py: exact arithmetic on a parsed expression, never eval
# ---------------------------------------------------------------------------------------------
def test_arithmetic_parses_only_integers_and_four_operators():
    value = countdown["arithmetic"]
    assert value("(1 + 2) * 3") == (Fraction(9), [1, 2, 3])
    assert value(" 7 / 2 ") == (Fraction(7, 2), [7, 2])
    assert value("10 - 4 × 2 ÷ 4") == (Fraction(8), [10, 4, 2, 4])
    assert value("(1/3 - 1/5) * 15") == (Fraction(2), [1, 3, 1, 5, 15])  # floats: 2.0000...04
    assert value("(3 + 5) * 2\r\n- 7") == (Fraction(9), [3, 5, 2, 7])  # white space is white space
    assert value("3 + 5\n* 2 - 7") == (Fraction(6), [3, 5, 2, 7])  # one expression: * binds first
    assert value("(3 + 5)\t*\n2 -\r7") == (Fraction(9), [3, 5, 2, 7])
    assert value("(2 +\n 3)") == (Fraction(5), [2, 3])
    for bad in (
        "3 / (5 - 5)",
        "2 ^ 3",
        "  ",
        "+".join(["1"] * 501),
        "-3 + 5",
        "+3",
        "2 ** 3",
        "2 // 3",
        "7 % 2",
        "__import__('os').system('x')",
        "3.5 + 1",
        "1_0 + 1",
        "07 + 1",
        "1e3",
        "",
        "(",
        "3 4",
        "3(4)",
        "x = 3",
        "9" * 1001,
        "(" * 300 + "1" + ")" * 300,
        "[1, 2]",
        "1; 2",
    ):
        assert value(bad) is None, bad


def test_countdown_expression_and_correctness():
    expr, correct, reward = countdown["expression"], countdown["correct"], countdown["reward"]
    assert expr("<think>8 * 2</think>\n<answer> (3 + 5) * 2 - 7 </answer>") == "(3 + 5) * 2 - 7"
    assert expr("Let me see.\nStep 2: 5 * 3 = 15\n\n") == "5 * 3 = 15"
    assert expr("so (3 + 5) * 2 = 16.") == "(3 + 5) * 2 = 16"
    assert expr("no numbers here") is None and expr("") is None
    for response in (
        "<answer>(3 + 5) * 2 - 7</answer>",
        "<answer>(5 + 3) * 2 - 7 = 9</answer>",
        "<answer>2 * (3 + 5) - 7 = 18 / 2</answer>",
        "<answer>\r\n(3 + 5) * 2\r\n- 7\r\n</answer>",
        "I found it:\n(3 + 5) * 2 - 7 = 9",
        "<think>x</think><answer>(3 + 5) × 2 - 7</answer>",
    ):
        assert correct(response, EX), response
        assert reward(response, EX) == pytest.approx(1.0 + 0.1 * ("<answer>" in response))
    for response in (
        "<answer>(3 + 5) * 2 - 7 = 10</answer>",  # a wrong claim after '='
        "<answer>3 + 5 + 2 - 7</answer>",  # 3
        "<answer>(3 + 5) * 2 - 7 + 0</answer>",  # a number not given
        "<answer>3 * 5 - 2 - 7 + 3</answer>",  # 9, but 3 used twice
        "<answer>7 + 2</answer>",  # 9, but 3 and 5 unused
        "<answer>7 + 2</answer>\n(3 + 5) * 2 - 7",  # the answer block wins over the last line
        "<answer>(3 + 5) * 2 - 7 is my answer</answer>",  # words in the block
        "<answer>The answer is (3 + 5) * 2 - 7</answer>",
        "<answer>\n3 + 5 = 8\n(3 + 5) * 2 - 7\n</answer>",  # work in the block, then the answer
        "<answer>3 + 5\n* 2 - 7</answer>",  # 6
        "<answer>9</answer>",
        "<answer></answer>",
        "<think>(3 + 5) * 2 - 7</think><answer>nine</answer>",
        "<answer>__import__('os').system('echo (3 + 5) * 2 - 7')</answer>",
    ):
        assert not correct(response, EX), response
        assert reward(response, EX) == pytest.approx(0.1), response
    # without a block: the last run of arithmetic on the last line
    for response in ("9", "", "no idea", "(3 + 5) * 2 - 7\nso that is it", "Step 3: 16 - 7 = 9"):
        assert reward(response, EX) == 0.0, response
    for response in ("(3 + 5) * 2 - 7", "so (3 + 5) * 2 - 7 is it", "Step 3: (3 + 5) * 2 - 7 = 9"):
        assert reward(response, EX) == 1.0, response
    exact = {"numbers": [2, 3, 4, 6], "target": 9}
    assert correct("<answer>6 / 4 * 3 * 2</answer>", exact)  # 3/2 on the way
    assert not correct("<answer>6 / 4 * 3 + 2</answer>", exact)  # 6.5
    assert not correct("<answer>3 / (5 - 5) + 1</answer>", {"numbers": [5, 5, 3, 1], "target": 1})


def test_countdown_and_the_think_format_together():
    # countdown.py:correct + 0.1 * think_format.py:format_reward: the expression is the whole block
    correct, fmt = countdown["correct"], think["format_reward"]
    for response, right in (
        ("<think>x</think><answer>(3 + 5) * 2 - 7</answer>", True),
        ("<think>x</think><answer> (3 + 5) * 2 - 7 = 9 </answer>", True),
        ("<think>x</think><answer>(3 + 5) * 2\n- 7</answer>", True),
        ("<think>x</think><answer>(3 + 5) * 2 - 7\n= 9</answer>", True),
        ("<think>x</think><answer>(3 + 5) * 2 - 7 is it</answer>", False),
        ("<think>x</think><answer>The answer is (3 + 5) * 2 - 7</answer>", False),  # prose
        ("<think>x</think><answer>\n3 + 5 = 8\n(3 + 5) * 2 - 7\n</answer>", False),  # work first
        ("<think>(3 + 5) * 2 - 7</think><answer>nine</answer>", False),
    ):
        assert correct(response, EX) is right and fmt(response, EX) == 1.0, response


# ---------------------------------------------------------------------------------------------
# the Countdown writer
# ---------------------------------------------------------------------------------------------
def integer_steps(node: ast.AST) -> int:
    """The value of a solution's ast, asserting the writer's steps: products up to 1,000, positive
    differences, exact divisions by more than 1."""
    if isinstance(node, ast.Constant):
        return node.value
    a, b = integer_steps(node.left), integer_steps(node.right)
    if isinstance(node.op, ast.Mult):
        assert a * b <= 1000, ast.unparse(node)
    assert not isinstance(node.op, ast.Sub) or a > b, ast.unparse(node)
    assert not isinstance(node.op, ast.Div) or (b > 1 and a % b == 0), ast.unparse(node)
    ops = {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b, ast.Div: a // b}
    return ops[type(node.op)]


def test_the_countdown_writer_writes_solvable_problems_once_each(tmp_path):
    out = tmp_path / "countdown.jsonl"
    argv = [sys.executable, str(COUNTDOWN), "--out", str(out), "--num-problems", "300"]
    proc = subprocess.run([*argv, "--seed", "7"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == f"wrote 300 problems to {out}\n", proc.stderr
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 300
    for row in rows:
        assert list(row) == ["question", "answer", "numbers", "target", "solution"], row
        assert len(row["numbers"]) == 4 and all(1 <= n <= 99 for n in row["numbers"])
        assert 1 <= row["target"] <= 100 and row["answer"] == str(row["target"])
        assert row["question"].startswith(
            f"Using the numbers {row['numbers']} once each with + - * / and parentheses, make "
            f"{row['target']}. "
        )
        assert countdown["reward"](f"<answer>{row['solution']}</answer>", row) == 1.1, row
        assert integer_steps(ast.parse(row["solution"], mode="eval").body) == row["target"]
    assert len({(tuple(sorted(r["numbers"])), r["target"]) for r in rows}) == 300
    assert rows == countdown["make_problems"](300, seed=7)  # the file is the function's
    assert countdown["make_problems"](300, seed=8) != rows
    # seed 1234's first problem, checked by hand: (57 - 12) + (15 * 1) = 45 + 15 = 60
    first = countdown["make_problems"](1)[0]
    assert (first["numbers"], first["target"]) == ([57, 15, 1, 12], 60)
    assert first["solution"] == "(57 - 12) + (15 * 1)"


# ---------------------------------------------------------------------------------------------
# end to end through the public flags: grpo_lm and ppo_lm on the tiny model
# ---------------------------------------------------------------------------------------------
def example_args(model_dir, tmp_path, **kw) -> grpo_lm.Args:
    small = dict(prompts_per_step=2, group_size=4, eval_size=4, total_steps=2)
    prompts = dict(max_prompt_length=1000, response_prefix="<think>")
    return tiny_args(model_dir, tmp_path, **{**small, **prompts, **kw})


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """The tiny model with 1,024 positions: a Countdown prompt (~384 tokens of the character
    tokenizer) plus --max-new-tokens does not fit its usual 256, which the scripts refuse."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-1024"), positions=1024)


def test_countdown_runs_in_grpo(long_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "countdown.jsonl", countdown["make_problems"](20))
    h = grpo_lm.main(
        example_args(
            long_model_dir,
            tmp_path,
            dataset=data,
            reward_fn=[f"{COUNTDOWN}:reward"],
            system_prompt=think["SYSTEM_PROMPT"],
        )
    )
    assert len(h["reward/reward/mean"]) == 2 and h["reward/reward/mean"] == h["reward/mean"]
    assert all(0 <= r <= 1.1 + 1e-6 for r in h["reward/mean"]) and len(h["eval/accuracy"]) == 2


def test_the_think_format_runs_in_grpo(tiny_model_dir, tmp_path):
    # GSM8K's answers: the solution, then "#### <final answer>"
    rows = [{"question": f"What is {a} + 7?", "answer": f"{a} + 7\n#### {a + 7}"} for a in range(9)]
    h = grpo_lm.main(
        example_args(
            tiny_model_dir,
            tmp_path,
            dataset=write_jsonl(tmp_path / "sums.jsonl", rows),
            reward_fn=[f"{THINK}:answer_reward", f"{THINK}:format_reward"],
            reward_weights=[1.0, 0.1],
            system_prompt=think["SYSTEM_PROMPT"],
        )
    )
    assert len(h["reward/answer_reward/mean"]) == len(h["reward/format_reward/mean"]) == 2
    for step in range(2):
        total = h["reward/answer_reward/mean"][step] + 0.1 * h["reward/format_reward/mean"][step]
        assert h["reward/mean"][step] == pytest.approx(total, rel=1e-6, abs=1e-7)
    assert len(h["eval/accuracy"]) == 2


def test_the_rewards_read_the_prefix_and_the_rows_fields(tiny_model_dir, tmp_path):
    # a response prefix that solves the problem: every response is right, whatever the tiny model
    # samples after it (its tokenizer has no '<', so it cannot open another block)
    rows = [{**EX, "question": f"Make 9 from 3, 5, 2 and 7 ({i})."} for i in range(8)]
    h = grpo_lm.main(
        example_args(
            tiny_model_dir,
            tmp_path,
            total_steps=1,
            dataset=write_jsonl(tmp_path / "one.jsonl", rows),
            reward_fn=[f"{COUNTDOWN}:reward", f"{THINK}:answer_reward"],
            response_prefix="<think>x</think><answer>(3 + 5) * 2 - 7 = 9</answer>",
        )
    )
    assert h["reward/reward/mean"] == [pytest.approx(1.1)]  # numbers, target: the JSONL's fields
    assert h["reward/answer_reward/mean"] == [1.0]
    assert h["eval/accuracy"] == [1.0, 1.0]  # the proxy: the last number is the target


def test_countdown_runs_in_ppo(long_model_dir, tmp_path):
    from test_ppo_lm import tiny_args as ppo_tiny_args

    import ppo_lm

    data = write_jsonl(tmp_path / "countdown.jsonl", countdown["make_problems"](40))
    h = ppo_lm.main(
        ppo_tiny_args(
            long_model_dir,
            tmp_path,
            total_steps=1,
            eval_size=4,
            max_prompt_length=1000,
            dataset=data,
            reward_fn=[f"{COUNTDOWN}:reward"],
            system_prompt=think["SYSTEM_PROMPT"],
            response_prefix="<think>",
        )
    )
    assert len(h["reward/reward/mean"]) == 1 and 0 <= h["reward/reward/mean"][0] <= 1.1 + 1e-6
    assert len(h["eval/accuracy"]) == 2


def test_the_date_tool_counts_days_and_raises_on_anything_else():
    # as --tool loads it; what it raises, the sampler injects as the tool's output
    days_between = grpo_lm.make_tool(grpo_lm.Args(tool=f"{DATE_TOOL}:days_between"), {}).function
    assert days_between("2024-01-01 2024-03-01") == " = 60"  # 31 + 29 (a leap year)
    assert days_between(" 2023-03-01  2023-01-01 ") == " = -59"
    for call in ("2024-01-01", "2024-01-01 to 2024-03-01", "2024-02-30 2024-03-01"):
        with pytest.raises(ValueError):
            days_between(call)
