"""Tasks, data and rewards: the built-in tasks (addition, multistep, Countdown), JSON Lines data,
answer checking, DeepSeek-R1's think/answer format, reward functions from files, scoring a batch,
prompts. Model text is parsed, never evaluated. Bring your own task: build a :class:`Task`."""

from __future__ import annotations

import ast
import bisect
import functools
import importlib.util
import inspect
import json
import math
import numbers
import operator
import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from common import UsageError, check

RewardFn = Callable[[str, dict], float]


@dataclass
class Task:
    """``train``/``test``: dicts with at least ``question`` and ``answer``. ``reward_fn(response,
    example) -> float`` and ``correct_fn(response, example) -> bool`` (or a number in [0, 1]) see
    ``--response-prefix`` + completion. ``reward_fns`` (--reward-fn): (name, function) pairs whose
    sum weighted by ``reward_weights`` (None: 1 each) replaces ``reward_fn``."""

    name: str
    train: list[dict]
    test: list[dict]
    reward_fn: RewardFn
    correct_fn: Callable[[str, dict], bool]
    reward_fns: list[tuple[str, RewardFn]] | None = None
    reward_weights: list[float] | None = None


# ---- answers: the last number, or text ---------------------------------------------------------
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_DECIMAL = re.compile(r"-?(?:[0-9]+|[0-9]{1,3}(?:,[0-9]{3})+)(?:\.[0-9]+)?")  # 45, -3.5, 1,234


def extract_final_number(text: str) -> float | None:
    """The last number in ``text`` (``1,234`` and ``-3.5`` allowed), or None."""
    matches = _NUMBER.findall(text)
    try:
        return float(matches[-1].replace(",", "")) if matches else None
    except ValueError:
        return None


def number_matches(completion: str, example: dict) -> bool:
    """The last number of ``completion`` equals ``example["answer"]`` (within 1e-6)."""
    value = extract_final_number(completion)
    return value is not None and abs(value - float(example["answer"])) < 1e-6


def outcome_reward(completion: str, example: dict, format_reward: float = 0.0) -> float:
    """1 for a right last number, + ``format_reward`` when the completion ends with a number."""
    reward = float(number_matches(completion, example))
    if format_reward and re.search(r"\d\.?$", completion.strip()):
        reward += format_reward
    return reward


def _normalise(text: str) -> str:
    return " ".join(text.casefold().split()).strip(" .,;:!?\"'`")


def answer_text_matches(completion: str, example: dict) -> bool:
    """The ``<answer>`` block (else the completion) matches ``example["answer"]``: as a number
    (:func:`number_matches`), else normalised (case, spaces, quotes, ``.,;:!?``) it ends with the
    answer at a word boundary ("Paris" matches "The capital is Paris.", not "Parisian")."""
    block = extract_answer_block(completion)
    final, answer = completion if block is None else block, str(example["answer"])
    if _DECIMAL.fullmatch(answer):
        return number_matches(final, {"answer": answer.replace(",", "")})
    final, answer = _normalise(final), _normalise(answer)
    if not answer or not final.endswith(answer):
        return False
    return len(final) == len(answer) or not final[-len(answer) - 1].isalnum()


def _text_reward(completion: str, example: dict) -> float:
    return float(answer_text_matches(completion, example))


# ---- data: generated tasks and JSON Lines files ------------------------------------------------
def _split(problems: list[dict], num_test: int, what: str) -> tuple[list[dict], list[dict]]:
    """(train, test), the first ``num_test`` held out; UsageError unless some are left to train."""
    check(num_test >= 0, f"--eval-size must be >= 0, got {num_test}")
    check(
        num_test < len(problems),
        f"--eval-size {num_test}: {what} has {len(problems)} problems; "
        "hold out fewer so that some are left to train on",
    )
    return problems[num_test:], problems[:num_test]


def make_addition_task(
    num_test: int = 128, format_reward: float = 0.0, split_seed: int = 1234
) -> Task:
    """8,100 problems "What is a + b?" for two-digit a and b; the split is fixed by the seed."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    problems = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]
    random.Random(split_seed).shuffle(problems)
    reward = functools.partial(outcome_reward, format_reward=format_reward)
    return Task("addition", *_split(problems, num_test, "task 'addition'"), reward, number_matches)


def _one_line(text: object, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_text(text: str, what: str) -> None:
    """UsageError naming ``what`` when ``text`` holds a lone surrogate (JSON's ``\\ud800``, bad
    command-line bytes), which tokenizers reject."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(
            f"{what}: contains a lone surrogate {text[e.start]!r} at character {e.start + 1}, "
            "which is not valid Unicode text (a tokenizer cannot take it)"
        ) from None


_JSON = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "true/false",
    type(None): "null",
}


def _jsonl_example(line: bytes, prompt_field: str, answer_field: str, numeric: bool) -> dict | None:
    """One JSONL line as an example (None when blank); ValueError or UsageError: what is wrong."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"not UTF-8 text (byte 0x{line[e.start]:02x} at column {e.start + 1}); "
            "expected a JSON Lines text file, one JSON object per line"
        ) from None
    if not text.strip():
        return None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object {{...}}, got {_JSON[type(row)]}")
    for field, role in ((prompt_field, "prompt"), (answer_field, "answer")):
        if field not in row:
            fields = ", ".join(repr(k) for k in list(row)[:8]) or "none"
            raise ValueError(
                f"no field {field!r} (the {role}; choose the field with --{role}-field); "
                f"its fields: {fields}"
            )
    prompt, answer = row[prompt_field], row[answer_field]
    if not isinstance(prompt, str):
        raise ValueError(
            f"field {prompt_field!r} (the prompt) must be a string, got {_JSON[type(prompt)]}"
        )
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(
            f"field {answer_field!r} (the answer) must be a string or a number, "
            f"got {_JSON[type(answer)]}"
        )
    for field, value in ((prompt_field, prompt), (answer_field, answer)):
        if isinstance(value, str):
            check_text(value, f"field {field!r}")
    if not prompt.strip():
        raise ValueError(f"field {prompt_field!r} (the prompt) is empty")
    solution = None
    if isinstance(answer, str):
        solution, sep, final = answer.rpartition("####")
        solution, final = (solution.strip(), final.strip()) if sep else (None, answer.strip())
    elif not math.isfinite(answer):
        raise ValueError(f"field {answer_field!r} (the answer) is {answer}, not a finite number")
    else:
        final = (
            str(answer) if isinstance(answer, int) else np.format_float_positional(answer, trim="-")
        )
    if _DECIMAL.fullmatch(final):
        final = final.replace(",", "")
    elif numeric:
        raise ValueError(
            f"answer {_one_line(final, 60)!r} is not a number; the built-in reward compares "
            "numbers, so expected one such as '45', '-3.5' or '1,234', alone or after GSM8K's "
            "'####' (answers that are not numbers need your own --reward-fn)"
        )
    elif not _normalise(final):
        raise ValueError(f"answer {_one_line(final, 60)!r} has no text to compare")
    example = {**row, "question": prompt, "answer": final}
    if solution is not None:
        example["solution"] = solution
    return example


def load_jsonl_task(
    path: str | Path,
    num_test: int = 128,
    format_reward: float = 0.0,
    split_seed: int = 1234,
    prompt_field: str = "question",
    answer_field: str = "answer",
    numeric_answers: bool = True,
) -> Task:
    """A JSON Lines file, one object a line (GSM8K's by default), as a :class:`Task`.

    An example is ``{**row, "question": row[prompt_field], "answer": final}``; ``"... #### 45"``
    gives ``final = "45"`` and the text before as ``example["solution"]``; numbers lose their
    thousands separators. ``numeric_answers``: every answer a number, the reward
    :func:`outcome_reward`; else any text, scored by :func:`answer_text_matches`.
    Raises:
        UsageError ``--dataset: {path}:{line}: ...``: a missing or unreadable file, a line that is
            not UTF-8 JSON object with the fields, an answer not a number while ``numeric_answers``,
            too few examples, ``format_reward`` without ``numeric_answers``.
    """
    path = Path(path)
    check(
        path.is_file(),
        f"--dataset: dataset file {path} does not exist"
        if not path.exists()
        else f"--dataset: {path} is not a file; expected a JSON Lines file",
    )
    check(
        numeric_answers or not format_reward,
        "--format-reward: the format bonus (a completion that ends with a number) "
        "needs numeric answers",
    )
    examples = []
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                line = line.removeprefix(b"\xef\xbb\xbf") if lineno == 1 else line
                try:
                    example = _jsonl_example(line, prompt_field, answer_field, numeric_answers)
                except (ValueError, UsageError) as e:
                    raise UsageError(f"--dataset: {path}:{lineno}: {e}") from None
                examples += [] if example is None else [example]
    except OSError as e:
        raise UsageError(f"--dataset: cannot read {path}: {e.strerror or e}") from None
    check(
        len(examples) > num_test,
        f"--dataset: {path} has {len(examples)} examples; need more than the "
        f"{num_test} held out (--eval-size), to leave some to train on",
    )
    random.Random(split_seed).shuffle(examples)
    train, test = examples[num_test:], examples[:num_test]
    if not numeric_answers:
        return Task(path.stem, train, test, _text_reward, answer_text_matches)
    reward = functools.partial(outcome_reward, format_reward=format_reward)
    return Task(path.stem, train, test, reward, number_matches)


# ---- the think/answer format of DeepSeek-R1 (arXiv 2501.12948, §2.2.2) -------------------------
_THINK_ANSWER = re.compile(r"\s*<think>(.*)</think>\s*<answer>(.*)</answer>\s*", re.DOTALL)
_ANSWER_BLOCK = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)
THINK_ANSWER_SYSTEM_PROMPT = (
    "Think about the problem step by step inside <think> </think> tags, then "
    "write only the final answer inside <answer> </answer> tags."
)


def think_answer_format_reward(completion: str, example: dict | None = None) -> float:
    """1.0 when the whole response is ``<think>...</think> <answer>...</answer>`` (white space
    around and between), each tag once and text in the answer block; else 0.0."""
    if any(completion.count(tag) != 1 for tag in ("<think>", "</think>", "<answer>", "</answer>")):
        return 0.0
    match = _THINK_ANSWER.fullmatch(completion)
    return float(match is not None and bool(match.group(2).strip()))


def extract_answer_block(text: str) -> str | None:
    """The stripped text of the last ``<answer>...</answer>`` block (by closing tag), or None."""
    blocks = _ANSWER_BLOCK.findall(text)
    return blocks[-1].strip() if blocks else None


def with_think_answer_format(task: Task, format_weight: float = 0.1) -> Task:
    """``task`` whose functions read only the ``<answer>`` block (0.0 / False without one), plus
    ``format_weight * think_answer_format_reward`` (0.1: TinyZero's format score)."""
    reward = functools.partial(_answer_block_reward, task.reward_fn, format_weight)
    return Task(
        task.name, task.train, task.test, reward, functools.partial(_block_correct, task.correct_fn)
    )


def _answer_block_reward(
    reward_fn: RewardFn, format_weight: float, response: str, example: dict
) -> float:
    block = extract_answer_block(response)
    reward = 0.0 if block is None else reward_fn(block, example)
    return reward + format_weight * think_answer_format_reward(response)


def _block_correct(correct_fn: Callable, response: str, example: dict) -> bool:
    block = extract_answer_block(response)
    return block is not None and correct_fn(block, example)


# ---- Countdown (as TinyZero, nano-aha-moment and GRPO-Zero ship it) ----------------------------
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def _arithmetic(node: ast.AST, number: Callable, unary: bool):
    """Value of an ast of number literals (each through ``number``), ``+ - * /`` and, with
    ``unary``, unary ``+ -``; ValueError for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return number(node.value)
    if unary and isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _arithmetic(node.operand, number, unary)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left = _arithmetic(node.left, number, unary)
        return _OPS[type(node.op)](left, _arithmetic(node.right, number, unary))
    raise ValueError("not arithmetic")


def _integer(literal: int | float) -> Fraction:
    if type(literal) is not int:
        raise ValueError("not an integer")
    return Fraction(literal)


def exact_arithmetic_value(text: str) -> tuple[Fraction, list[int]] | None:
    """(exact value, integers as written) of integers, ``+ - * / × ÷`` and parentheses, or None.

    Parsed with :mod:`ast`: no unary minus, ``**``, ``//``, names or other literals; white space of
    any kind separates tokens. None too for a division by zero or over 1,000 characters.
    """
    text = " ".join(text.replace("×", "*").replace("÷", "/").split())
    if not text or len(text) > 1000 or not set(text) <= set("0123456789+-*/() "):
        return None
    try:
        tree = ast.parse(text, mode="eval").body
        value = _arithmetic(tree, _integer, unary=False)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None
    literals = sorted(
        (n for n in ast.walk(tree) if isinstance(n, ast.Constant)), key=lambda n: n.col_offset
    )
    return value, [n.value for n in literals]


def countdown_expression(response: str) -> str | None:
    """The ``<answer>`` block, else the last run of arithmetic with a digit on the last non-empty
    line (``"Step 2: 5 * 3 = 15"`` gives ``"5 * 3 = 15"``), else None."""
    block = extract_answer_block(response)
    if block is not None:
        return block
    lines = [line for line in response.splitlines() if line.strip()]
    runs = re.split(r"[^0-9+\-*/()×÷= \t]+", lines[-1]) if lines else []
    runs = [run for run in runs if any(c.isdigit() for c in run)]
    return runs[-1].strip() if runs else None


def countdown_correct(response: str, example: dict) -> bool:
    """:func:`countdown_expression_correct` of :func:`countdown_expression` (words: wrong)."""
    expression = countdown_expression(response)
    return expression is not None and countdown_expression_correct(expression, example)


def countdown_expression_correct(expression: str, example: dict) -> bool:
    """All of ``expression`` uses each of ``example["numbers"]`` once and equals
    ``example["target"]`` exactly; each ``= ...`` after it must be an expression of that value."""
    first, *claims = expression.split("=")
    parsed = exact_arithmetic_value(first)
    if (
        parsed is None
        or sorted(parsed[1]) != sorted(example["numbers"])
        or parsed[0] != example["target"]
    ):
        return False
    values = [exact_arithmetic_value(side) for side in claims if side.strip()]
    return all(value is not None and value[0] == parsed[0] for value in values)


def countdown_reward(response: str, example: dict, format_reward: float = 0.1) -> float:
    """1.0 when :func:`countdown_correct`, + ``format_reward`` for an ``<answer>`` block (TinyZero:
    1.0 or 0.1; here they add up, as :func:`outcome_reward` adds its bonus)."""
    block = format_reward if extract_answer_block(response) is not None else 0.0
    return float(countdown_correct(response, example)) + block


def _countdown_block_reward(block: str, example: dict) -> float:
    return float(countdown_expression_correct(block, example))


def _random_expression(rng: random.Random, numbers: list[int], cap: int) -> tuple[int, str]:
    """The numbers combined in random order by random operators, every value a positive integer
    (``*`` up to ``cap``, ``/`` exact and not by 1)."""
    pool = [(n, str(n)) for n in numbers]
    while len(pool) > 1:
        a, left = pool.pop(rng.randrange(len(pool)))
        b, right = pool.pop(rng.randrange(len(pool)))
        op = rng.choice(
            ["+"] + ["*"] * (a * b <= cap) + ["-"] * (a > b) + ["/"] * (b > 1 and a % b == 0)
        )
        value = a + b if op == "+" else a * b if op == "*" else a - b if op == "-" else a // b
        left, right = (e if e.isdigit() else f"({e})" for e in (left, right))
        pool.append((value, f"{left} {op} {right}"))
    return pool[0]


def make_countdown_task(
    num_test: int = 128,
    format_reward: float = 0.1,
    split_seed: int = 1234,
    num_problems: int = 10_000,
    num_numbers: int = 4,
    max_number: int = 99,
    max_target: int = 100,
    answer_format: str = "plain",
) -> Task:
    """Countdown: "Using the numbers [a, b, c, d] once each with + - * /, make T".

    From ``split_seed``: numbers in 1..``max_number``, the target (1..``max_target``) the value of a
    random expression of them (``example["solution"]``); no (numbers, target) twice. Reward
    :func:`countdown_reward`, correct_fn :func:`countdown_correct`; ``answer_format="think"``: both
    read their whole text, for :func:`with_think_answer_format`.
    Raises UsageError: under 2 numbers, a bound under 1, too few distinct problems in 100 draws
    each, or none left to train on.
    """
    check(
        num_numbers >= 2,
        f"--task countdown: needs at least 2 numbers per problem, got {num_numbers}",
    )
    check(
        max_number >= 1 and max_target >= 1,
        "--task countdown: the largest number and target must be >= 1",
    )
    rng = random.Random(split_seed)
    problems, seen = [], set()
    for _ in range(100 * num_problems):
        if len(problems) == num_problems:
            break
        numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
        target, solution = _random_expression(rng, numbers, cap=10 * max_target)
        if not 1 <= target <= max_target or (tuple(sorted(numbers)), target) in seen:
            continue
        seen.add((tuple(sorted(numbers)), target))
        question = (
            f"Using the numbers {numbers} once each with + - * / and parentheses, make {target}. "
            "Show your reasoning in <think> </think> tags, then write only the expression in "
            "<answer> </answer> tags, for example <answer> (1 + 2) * 3 </answer>."
        )
        problems.append(
            {
                "question": question,
                "answer": str(target),
                "numbers": numbers,
                "target": target,
                "solution": solution,
            }
        )
    check(
        len(problems) == num_problems,
        f"--task countdown: only {len(problems)} distinct problems of "
        f"{num_numbers} numbers up to {max_number} with targets up to {max_target} found in "
        f"{100 * num_problems} draws; ask for fewer than {num_problems}",
    )
    split = _split(problems, num_test, "task 'countdown'")
    if answer_format == "think":
        return Task("countdown", *split, _countdown_block_reward, countdown_expression_correct)
    reward = functools.partial(countdown_reward, format_reward=format_reward)
    return Task("countdown", *split, reward, countdown_correct)


# ---- process supervision: a multi-step task, checkable steps, char -> token offsets ------------
# A term: a number with "(", "-", ")" around it. No space can match two neighbouring \s*
# (a sum without "=" took exponential time to reject: 6 s for ten terms).
_TERM = r"(?:-\s*)?\$?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*\)+)?"
_STEP = re.compile(
    rf"(?<![\d.])(\(*\s*{_TERM}(?:\s*[-+*/×]\s*(?:\(+\s*)?{_TERM})+)"
    r"\s*=\s*(-?\s*\$?\d+(?:,\d{3})*(?:\.\d+)?)"
)


def _arithmetic_value(expr: str) -> float | None:
    expr = expr.replace("$", "").replace(",", "").replace("×", "*").strip()
    try:
        return _arithmetic(ast.parse(expr, mode="eval").body, float, unary=True)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return None


def find_arithmetic_steps(text: str) -> list[tuple[int, bool]]:
    """Each equation ``x op y (op z ...) = w`` (``+ - * / ×``, parentheses, ``$``, ``1,234``,
    GSM8K's ``<<48/2=24>>``) as (end offset after its last digit, right within a relative 1e-4)."""
    steps = []
    for m in _STEP.finditer(text):
        lhs, rhs = _arithmetic_value(m.group(1)), _arithmetic_value(m.group(2).replace(" ", ""))
        ok = (
            lhs is not None
            and rhs is not None
            and math.isclose(lhs, rhs, rel_tol=1e-4, abs_tol=1e-9)
        )
        steps.append((m.end(), ok))
    return steps


def arithmetic_step_rewards(completion: str, example: dict) -> list[tuple[int, float]]:
    """Process supervision's step rewards: (end offset, 1.0 or 0.0) per equation."""
    return [(end, float(ok)) for end, ok in find_arithmetic_steps(completion)]


def make_multistep_task(
    num_test: int = 128,
    format_reward: float = 0.0,
    split_seed: int = 1234,
    num_problems: int = 10_000,
) -> Task:
    """ "Compute (a + b) * c - d", one calculation a line (a, b, d in 1..20, c in 2..9), with the
    reference ``solution``; the final-number reward."""
    rng = random.Random(split_seed)
    problems, seen = [], set()
    while len(problems) < num_problems:
        a, b, c, d = rng.randint(1, 20), rng.randint(1, 20), rng.randint(2, 9), rng.randint(1, 20)
        if (a, b, c, d) in seen:
            continue
        seen.add((a, b, c, d))
        s, p = a + b, (a + b) * c
        question = (
            f"Compute ({a} + {b}) * {c} - {d}. Write each calculation on its own line in the form "
            "x + y = z, and end with the result."
        )
        solution = f"{a} + {b} = {s}\n{s} * {c} = {p}\n{p} - {d} = {p - d}"
        problems.append({"question": question, "answer": str(p - d), "solution": solution})
    reward = functools.partial(outcome_reward, format_reward=format_reward)
    return Task(
        "multistep", *_split(problems, num_test, "task 'multistep'"), reward, number_matches
    )


def char_ends_to_token_indices(tokenizer, token_ids: list[int], char_ends: list[int]) -> list[int]:
    """For each end offset in the decoded ``token_ids``, the first token whose decoded prefix
    reaches it (past the text: the last token)."""
    prefixes = tokenizer.batch_decode(
        [token_ids[: k + 1] for k in range(len(token_ids))], skip_special_tokens=True
    )
    lengths = [len(prefix) for prefix in prefixes]
    return [min(bisect.bisect_left(lengths, end), len(token_ids) - 1) for end in char_ends]


# ---- scoring a batch: the user's functions checked, one line per failure -----------------------
def _checked_scores(
    fn: Callable,
    what: str,
    texts: list[str],
    examples: list[dict],
    first: int = 0,
    unit: bool = False,
) -> list[float]:
    """``float(fn(text, example))`` each; UsageError naming ``what`` and the index when ``fn``
    raises, returns a non-number (bools count), one not finite in float32, or with ``unit`` one not
    in [0, 1]."""
    if len(texts) != len(examples):
        raise ValueError(f"{len(texts)} completions for {len(examples)} examples")
    scores = []
    for i, (text, example) in enumerate(zip(texts, examples, strict=True), first):
        where = f"on completion {i} ({text[:60]!r})"
        try:
            value = fn(text, example)
        except (Exception, SystemExit, KeyboardInterrupt) as e:  # issue 27: sys.exit() too
            raise UsageError(f"{what} raised {type(e).__name__}: {_one_line(e)} {where}") from None
        if not isinstance(value, (numbers.Real, np.bool_)):
            expected = "True/False" if unit else "a number (float)"
            raise UsageError(f"{what} returned {type(value).__name__} {where}; expected {expected}")
        try:
            value = float(value)
        except OverflowError:  # an int too large for a float
            value = math.inf
        if not abs(value) <= np.finfo(np.float32).max or (unit and not 0 <= value <= 1):
            expected = (
                "True/False or a number in [0, 1]"
                if unit
                else "a finite number (rewards are float32: |x| <= 3.4e38)"
            )
            raise UsageError(f"{what} returned {value} {where}; expected {expected}")
        scores.append(value)
    return scores


def score_completions(task: Task, completions: list[str], examples: list[dict]) -> torch.Tensor:
    """(N,) float32 ``task.reward_fn`` rewards (UsageError as :func:`_checked_scores`)."""
    scores = _checked_scores(
        task.reward_fn, f"reward function of task {task.name!r}", completions, examples
    )
    return torch.tensor(scores, dtype=torch.float32)


def score_correct(task: Task, completions: list[str], examples: list[dict]) -> torch.Tensor:
    """(N,) float32 ``task.correct_fn``, 1.0 for right: the logged accuracy (UsageError as above)"""
    what = f"correct_fn of task {task.name!r}"
    return torch.tensor(
        _checked_scores(task.correct_fn, what, completions, examples, unit=True),
        dtype=torch.float32,
    )


def score_task(task: Task, responses: list[str], examples: list[dict]) -> tuple[torch.Tensor, dict]:
    """(N,) float32 rewards of ``task.reward_fn``, or of ``task.reward_fns`` with each one's own
    (N,) rewards by name (:func:`score_reward_fns`; else {})."""
    if task.reward_fns:
        return score_reward_fns(task.reward_fns, responses, examples, task.reward_weights)
    return score_completions(task, responses, examples), {}


def _reward_weights(weights: list[float] | None, n: int) -> list[float]:
    if weights is None:
        return [1.0] * n
    check(
        len(weights) == n,
        f"--reward-weights: got {len(weights)} weights for {n} reward functions "
        "(--reward-fn); give one weight per function, in the same order",
    )
    check(
        all(map(math.isfinite, weights)),
        f"--reward-weights: weights must be finite numbers, got {list(weights)}",
    )
    return [float(w) for w in weights]


_REWARD_FILES: list[str] = []  # the module names of the reward files imported so far


def _import_reward_file(path: Path, where: str):
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_reward_file_{len(_REWARD_FILES)}_{stem}"
    _REWARD_FILES.append(name)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    sys.modules[name] = module  # as an import does: dataclasses and pickle look the module up there
    try:
        module.__spec__.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever the file raises is one line
        del sys.modules[name]
        raise UsageError(
            f"{where}: cannot import {path}: {type(e).__name__}: {_one_line(e)}"
        ) from None
    return module


def load_reward_fns(
    specs: list[str], weights: list[float] | None = None
) -> list[tuple[str, RewardFn]]:
    """--reward-fn ``path/to/file.py:function_name`` specs as (log name, function) pairs.

    Each file is imported once per call, as a module of its own. The log name is the function's,
    ``file_stem.name`` when two share it, then ``_2``, ``_3``... for a spec given again.
    Raises UsageError, one line naming the spec: not ``path.py:name``, a missing file or name, a
    file that cannot be imported, not a function of (completion, example); or not one finite
    weight per spec (--reward-weights).
    """
    _reward_weights(weights, len(specs))
    modules, loaded = {}, []
    for spec in specs:
        file, _, name = spec.rpartition(":")
        check(
            bool(file) and name.isidentifier(),
            f"--reward-fn: expected path/to/file.py:function_name, got {spec!r}",
        )
        path, where = Path(file), f"--reward-fn {spec}"
        check(path.suffix == ".py", f"{where}: expected a Python file ending in .py")
        check(path.is_file(), f"{where}: file {path} does not exist")
        if path.resolve() not in modules:
            modules[path.resolve()] = _import_reward_file(path, where)
        module = modules[path.resolve()]
        if not hasattr(module, name):
            defined = [
                k
                for k, v in vars(module).items()
                if callable(v)
                and not k.startswith("_")
                and getattr(v, "__module__", None) == module.__name__
            ]
            defined = ", ".join(defined) or "no functions"
            raise UsageError(f"{where}: {path} has no {name!r}; it defines: {defined}")
        fn = getattr(module, name)
        check(callable(fn), f"{where}: is {type(fn).__name__}, not a function")
        try:
            inspect.signature(fn).bind("", {})
        except TypeError as e:
            raise UsageError(
                f"{where}: must take (completion: str, example: dict): {_one_line(e)}"
            ) from None
        except ValueError:  # no signature to inspect (a builtin): its first call will tell
            pass
        loaded.append((name, path.stem, fn))
    names = [name for name, _, _ in loaded]
    named: dict[str, RewardFn] = {}
    for name, stem, fn in loaded:
        label = unique = name if names.count(name) == 1 else f"{stem}.{name}"
        k = 1
        while unique in named:
            k += 1
            unique = f"{label}_{k}"
        named[unique] = fn
    return list(named.items())


def _describe(fn: Callable) -> str:
    """``file:function`` of a function, a partial of one or a callable object (``file:Class``)."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    call = getattr(type(inner), "__call__", None)  # noqa: B004 - a callable object's method
    code = getattr(inner, "__code__", None) or getattr(call, "__code__", None)
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    return f"{code.co_filename}:{name}" if code is not None else name


def score_reward_fns(
    reward_fns: list[tuple[str, RewardFn]],
    completions: list[str],
    examples: list[dict],
    weights: list[float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``r_i = sum_k weights[k] * f_k(completions[i], examples[i])`` (None: weights 1), (N,)
    float32, and each ``f_k``'s own (N,) rewards by name. Each returns a real number (True: 1.0).

    Raises:
        UsageError, one line: a function raises or returns a non-number or non-finite value (naming
            ``file:function`` and the index), the sum overflows, bad weights, a name twice.
        ValueError: no function.
    """
    if not reward_fns:
        raise ValueError("score_reward_fns needs at least one reward function")
    weights = _reward_weights(weights, len(reward_fns))
    names = [name for name, _ in reward_fns]
    check(len(set(names)) == len(names), f"reward function names must be unique, got {names}")
    total, each = [0.0] * len(completions), {}
    for (name, fn), weight in zip(reward_fns, weights, strict=True):
        scores = _checked_scores(fn, f"reward function {_describe(fn)}", completions, examples)
        each[name] = torch.tensor(scores, dtype=torch.float32)
        total = [t + weight * r for t, r in zip(total, scores, strict=True)]
    for i, t in enumerate(total):
        check(
            math.isfinite(t),
            f"the weighted sum of the rewards is {t} on completion {i} "
            f"({completions[i][:60]!r}); lower --reward-weights",
        )
    return torch.tensor(total, dtype=torch.float32), each


# ---- the scripts' task flags and prompts -------------------------------------------------------
def make_task(
    name: str,
    dataset: str | None,
    eval_size: int,
    prompt_field: str,
    answer_field: str,
    answer_format: str,
    format_reward: float,
    reward_fns: list[str],
    reward_weights: list[float],
) -> Task:
    """The task of --task, or of --dataset (a JSONL file: --prompt-field, --answer-field).

    --answer-format think reads answers from the ``<answer>`` block and pays ``format_reward`` for
    the format (plain: for ending with a number, or Countdown's answer block). --reward-fn specs
    replace the reward by their sum weighted by --reward-weights; the spec ``task``: the task's own.
    Raises UsageError: a bad dataset, reward file or weights (naming flag, file and line).
    """
    plain = format_reward if answer_format == "plain" else 0.0
    if dataset is not None:
        numeric = not reward_fns or "task" in reward_fns  # the built-in reward compares numbers
        task = load_jsonl_task(
            dataset,
            eval_size,
            plain,
            prompt_field=prompt_field,
            answer_field=answer_field,
            numeric_answers=numeric,
        )
    elif name == "multistep":
        task = make_multistep_task(eval_size, plain)
    elif name == "countdown":
        task = make_countdown_task(eval_size, plain, answer_format=answer_format)
    else:
        task = make_addition_task(eval_size, plain)
    if answer_format == "think":
        task = with_think_answer_format(task, format_reward)
    if reward_fns:
        files = load_reward_fns([spec for spec in reward_fns if spec != "task"])
        task.reward_fns = [
            ("task", task.reward_fn) if s == "task" else files.pop(0) for s in reward_fns
        ]
        task.reward_weights = list(reward_weights) or None
    return task


def check_task_flags(
    name: str,
    dataset: str | None,
    answer_format: str,
    format_reward: float,
    reward_fns: list[str],
    reward_weights: list[float],
    prompt_field: str,
    answer_field: str,
    system_prompt: str | None,
    response_prefix: str,
) -> None:
    """The flags of :func:`make_task` and of the prompts, checked before any file is read.

    Raises UsageError naming the flag: an unknown task or format; not one finite weight per
    function; a --format-reward that --reward-fn without ``task`` drops; ``task`` twice, or beside a
    function of that name; a lone surrogate; one field for prompt and answer.
    """
    check(
        name in ("addition", "multistep", "countdown") or dataset is not None,
        f"--task: unknown task "
        f"{name!r}; built in: 'addition', 'multistep', 'countdown' (or use --dataset)",
    )
    check(
        answer_format in ("plain", "think"),
        f"--answer-format must be 'plain' or 'think', not {answer_format!r}",
    )
    check(
        not reward_weights or len(reward_weights) == len(reward_fns),
        f"--reward-weights: {len(reward_weights)} "
        f"weights for {len(reward_fns)} --reward-fn functions; give one each (or none)",
    )
    _reward_weights(list(reward_weights) or None, len(reward_fns))  # finite
    check(
        not reward_fns or "task" in reward_fns or format_reward == 0,
        "--format-reward: is paid by the task's own reward, which --reward-fn replaces; add "
        "`--reward-fn task` to keep it (or score the format in your own function)",
    )
    check(
        list(reward_fns).count("task") <= 1,
        "--reward-fn task: given twice; give it once (--reward-weights sets its weight)",
    )
    named_task = [
        spec for spec in reward_fns if spec != "task" and spec.rpartition(":")[2] == "task"
    ]
    if (
        "task" in reward_fns and len(named_task) == 1
    ):  # load_reward_fns names a lone function by its name
        raise UsageError(
            f"--reward-fn {named_task[0]}: logs as 'task', the name of the task's own reward "
            "(--reward-fn task); rename the function"
        )
    for flag, text in (
        ("--system-prompt", system_prompt or ""),
        ("--response-prefix", response_prefix),
        ("--prompt-field", prompt_field),
        ("--answer-field", answer_field),
    ):
        check_text(text, flag)
    check(prompt_field != answer_field, "--prompt-field and --answer-field must name two fields")


def check_split(
    task: Task, prompts_per_step: int, eval_size: int, dataset: str | None = None
) -> None:
    """UsageError (naming --dataset or --eval-size) unless ``prompts_per_step`` training questions
    are left once ``eval_size`` are held out."""
    flag = f"--dataset: {dataset}" if dataset else f"--eval-size {eval_size}"
    check(
        len(task.train) >= prompts_per_step,
        f"{flag}: {len(task.test)} questions held out for evaluation "
        f"leave {len(task.train)} for training, fewer than --prompts-per-step {prompts_per_step}",
    )


def prompt_style(
    answer_format: str, system_prompt: str | None, response_prefix: str
) -> tuple[str | None, str]:
    """(system prompt, response prefix) of every prompt: --system-prompt (by default with
    --answer-format think :data:`THINK_ANSWER_SYSTEM_PROMPT`) and --response-prefix."""
    default = THINK_ANSWER_SYSTEM_PROMPT if answer_format == "think" else None
    return (default if system_prompt is None else system_prompt), response_prefix


def build_prompt(
    tokenizer, question: str, system_prompt: str | None = None, response_prefix: str = ""
) -> str:
    """The chat template's prompt (else ``"Question: {question}\\nAnswer:"``) + ``response_prefix``.

    ``system_prompt`` is the system message, or the user message's first paragraph without a
    template or with one that rejects or drops it.
    """
    if not getattr(tokenizer, "chat_template", None):
        return (
            (f"{system_prompt}\n\n" if system_prompt else "")
            + f"Question: {question}\nAnswer:"
            + response_prefix
        )
    messages = [{"role": "user", "content": question}]
    if system_prompt:
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "system", "content": system_prompt}, *messages],
                tokenize=False,
                add_generation_prompt=True,
            )
            if system_prompt.strip() in text:
                return text + response_prefix
        except Exception:  # noqa: BLE001 - a template without a system role; fall back as documented
            pass
        messages = [{"role": "user", "content": f"{system_prompt}\n\n{question}"}]
    return (
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        + response_prefix
    )


def prompt_ids(
    tokenizer, questions: list[str], system_prompt: str | None = None, response_prefix: str = ""
) -> list[list[int]]:
    """The token ids of each question's :func:`build_prompt`, no special tokens added."""
    prompts = [
        build_prompt(tokenizer, question, system_prompt, response_prefix) for question in questions
    ]
    return tokenizer(prompts, add_special_tokens=False)["input_ids"]


def prompts_that_fit(
    task: Task,
    tokenizer,
    max_prompt_length: int,
    prompts_per_step: int,
    system_prompt: str | None = None,
    response_prefix: str = "",
) -> list[dict]:
    """The training examples whose prompts have at most ``max_prompt_length`` tokens; UsageError
    (naming --max-prompt-length) when fewer than ``prompts_per_step`` fit."""
    ids = prompt_ids(
        tokenizer, [ex["question"] for ex in task.train], system_prompt, response_prefix
    )
    train = [ex for ex, n in zip(task.train, map(len, ids), strict=True) if n <= max_prompt_length]
    check(
        len(train) >= prompts_per_step,
        f"--max-prompt-length {max_prompt_length}: only {len(train)} "
        f"training prompts fit, fewer than --prompts-per-step {prompts_per_step}",
    )
    return train


@torch.no_grad()
def greedy_accuracy(
    policy,
    tokenizer,
    examples: list[dict],
    correct_fn: Callable,
    max_new_tokens: int,
    batch_size: int,
    device,
    system_prompt: str | None = None,
    response_prefix: str = "",
    task_name: str = "task",
    answer_format: str = "plain",
) -> tuple[float, list[str]]:
    """(fraction of ``examples`` that ``correct_fn`` finds right, responses) with greedy decoding.

    Prompts as :func:`prompt_style` and :func:`build_prompt` make them; a response is
    ``response_prefix`` + completion. UsageError: ``correct_fn`` fails (as :func:`score_correct`).
    """
    system_prompt, response_prefix = prompt_style(answer_format, system_prompt, response_prefix)
    correct, outputs = 0, []
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        prompts = [
            build_prompt(tokenizer, ex["question"], system_prompt, response_prefix) for ex in batch
        ]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(
            device
        )
        out = policy.generate(
            **enc,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            top_k=None,
            top_p=None,
            temperature=None,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        completions = tokenizer.batch_decode(
            out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True
        )
        texts = [response_prefix + completion for completion in completions]
        correct += sum(
            _checked_scores(
                correct_fn, f"correct_fn of task {task_name!r}", texts, batch, start, unit=True
            )
        )
        outputs += texts
    return correct / len(examples), outputs
