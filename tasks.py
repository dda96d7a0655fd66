"""Tasks, data and rewards: the built-in tasks (addition, multistep, Countdown), JSON Lines data,
answer checking, DeepSeek-R1's think/answer format, reward functions from files, scoring a batch,
prompts. Model text is parsed, never evaluated. Bring your own task: build a :class:`Task`."""

import ast
import bisect
import collections
import functools
import inspect
import json
import math
import numbers
import random
import re
import runpy
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from operator import add, mul, sub, truediv
from pathlib import Path

import numpy as np
import torch

from common import UsageError, check, decode

RewardFn = Callable[[str, dict], float]
SPLIT_SEED = 1234  # fixes each task's held-out split


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
_DIGITS = r"\d+(?:,\d{3})*(?:\.\d+)?"  # 45, 3.5, 1,234: every number read here, model's or data's
_NUMBER = re.compile(rf"-?{_DIGITS}")


def extract_final_number(text: str) -> float | None:
    """The last number in ``text`` (``1,234`` and ``-3.5`` allowed), or None."""
    matches = _NUMBER.findall(text)
    return float(matches[-1].replace(",", "")) if matches else None


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
    if _NUMBER.fullmatch(answer):
        return number_matches(final, {"answer": answer.replace(",", "")})
    final, answer = _normalise(final), _normalise(answer)
    if not answer or not final.endswith(answer):
        return False
    return len(final) == len(answer) or not final[-len(answer) - 1].isalnum()


# ---- data: generated tasks and JSON Lines files ------------------------------------------------
def _split(problems: list[dict], num_test: int, what: str) -> tuple[list[dict], list[dict]]:
    """(train, test), the first ``num_test`` held out; UsageError unless some are left to train."""
    message = f"--eval-size {num_test}: {what} has {len(problems)} problems; hold out fewer"
    check(num_test < len(problems), message)
    return problems[num_test:], problems[:num_test]


def make_addition_task(num_test: int = 128, format_reward: float = 0.0) -> Task:
    """8,100 problems "What is a + b?" for two-digit a and b, in a fixed shuffled order."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    problems = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]
    random.Random(SPLIT_SEED).shuffle(problems)
    reward = functools.partial(outcome_reward, format_reward=format_reward)
    return Task("addition", *_split(problems, num_test, "task 'addition'"), reward, number_matches)


def _one_line(text: object, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_text(text: str, what: str) -> None:
    """UsageError naming ``what`` when ``text`` holds a lone surrogate (JSON's ``\\ud800``, bad
    command-line bytes): not Unicode, so no tokenizer takes it."""
    if bad := re.search("[\ud800-\udfff]", text):
        where = f"{bad.group()!r} at character {bad.start() + 1}"
        raise UsageError(f"{what}: contains a lone surrogate {where}, which is not valid Unicode")


def _jsonl_example(line: bytes, prompt_field: str, answer_field: str, numeric: bool) -> dict:
    """One JSONL line as an example; ValueError or UsageError: what is wrong with it."""
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        byte = f"byte 0x{line[e.start]:02x} at column {e.start + 1}"
        raise ValueError(f"not UTF-8 ({byte})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object {{...}}, got {_one_line(json.dumps(row), 40)}")
    for field, role in ((prompt_field, "prompt"), (answer_field, "answer")):
        if field not in row:
            fields = ", ".join(map(repr, list(row)[:8]))
            raise ValueError(f"no field {field!r} (the {role}: --{role}-field), only {fields}")
    prompt, answer = row[prompt_field], row[answer_field]
    if isinstance(answer, float) and math.isfinite(answer):
        answer = np.format_float_positional(answer, trim="-")  # 1e-07: "0.0000001"
    elif isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)
    for field, value, role in ((prompt_field, prompt, "prompt"), (answer_field, answer, "answer")):
        if not isinstance(value, str) or not value.strip():
            kind = "a non-empty string" + (" or a finite number" if role == "answer" else "")
            got = _one_line(json.dumps(row[field]), 40)
            raise ValueError(f"field {field!r} (the {role}) must be {kind}, got {got}")
        check_text(value, f"field {field!r}")
    solution, gsm8k, final = answer.rpartition("####")  # GSM8K: "<solution> #### <final answer>"
    final = final.strip()
    if _NUMBER.fullmatch(final):
        final = final.replace(",", "")
    elif numeric:
        raise ValueError(
            f"answer {_one_line(final, 60)!r} is not a number such as 45, -3.5 or 1,234 (alone or "
            "after GSM8K's ####), which the built-in reward compares; else use --reward-fn"
        )
    elif not _normalise(final):
        raise ValueError(f"answer {_one_line(final, 60)!r} has no text to compare")
    solution = {"solution": solution.strip()} if gsm8k else {}
    return {**row, "question": prompt, "answer": final, **solution}


def load_jsonl_task(
    path, num_test, format_reward=0.0, prompt_field="question", answer_field="answer", numeric=True
) -> Task:
    """A JSON Lines file (GSM8K's by default): an example a line, ``{**row, "question": prompt,
    "answer": final}``; ``"... #### 45"`` gives ``final = "45"``, the text before as ``"solution"``.
    ``numeric``: answers are numbers (thousands separators dropped), :func:`outcome_reward`; else
    text, :func:`answer_text_matches`. UsageError ``--dataset: {path}:{line}: ...``: a bad line."""
    check(numeric or not format_reward, "--format-reward: needs numeric answers (it pays for one)")
    examples = []
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                line = line.removeprefix(b"\xef\xbb\xbf")  # a byte order mark
                try:
                    if line.strip():
                        examples.append(_jsonl_example(line, prompt_field, answer_field, numeric))
                except (ValueError, UsageError) as e:
                    raise UsageError(f"--dataset: {path}:{lineno}: {e}") from None
    except OSError as e:
        raise UsageError(f"--dataset: cannot read {path}: {e.strerror or e}") from None
    random.Random(SPLIT_SEED).shuffle(examples)
    train, test = _split(examples, num_test, str(path))
    reward = functools.partial(outcome_reward, format_reward=format_reward)
    fns = (reward, number_matches) if numeric else (answer_text_matches, answer_text_matches)
    return Task(Path(path).stem, train, test, *fns)  # text: True / False is the reward


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
    reward_fn, correct_fn = task.reward_fn, task.correct_fn

    def reward(response: str, example: dict) -> float:
        block = extract_answer_block(response)
        reward = 0.0 if block is None else reward_fn(block, example)
        return reward + format_weight * think_answer_format_reward(response)

    def correct(response: str, example: dict) -> bool:
        block = extract_answer_block(response)
        return block is not None and correct_fn(block, example)

    return Task(task.name, task.train, task.test, reward, correct)


# ---- Countdown (as TinyZero, nano-aha-moment and GRPO-Zero ship it) ----------------------------
_OPS = {ast.Add: add, ast.Sub: sub, ast.Mult: mul, ast.Div: truediv}


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


def exact_arithmetic_value(text: str) -> tuple[Fraction, list[int]] | None:
    """(exact value, integers as written) of integers, ``+ - * / × ÷`` and parentheses (no unary
    minus, ``**``, ``//``, names or other literals), parsed with :mod:`ast`; else None, as for a
    division by zero or over 1,000 characters. White space of any kind separates tokens."""
    text = " ".join(text.replace("×", "*").replace("÷", "/").split())
    if not text or len(text) > 1000 or not set(text) <= set("0123456789+-*/() "):
        return None  # so every literal is an integer
    try:
        value = _arithmetic(ast.parse(text, mode="eval").body, Fraction, unary=False)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None
    return value, [int(n) for n in re.findall(r"\d+", text)]


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
    if parsed is None or sorted(parsed[1]) != sorted(example["numbers"]):
        return False
    values = [exact_arithmetic_value(side) for side in claims if side.strip()]
    return parsed[0] == example["target"] and all(v and v[0] == parsed[0] for v in values)


def countdown_reward(response: str, example: dict, format_reward: float = 0.1) -> float:
    """1.0 when :func:`countdown_correct`, + ``format_reward`` for an ``<answer>`` block (TinyZero:
    1.0 or 0.1; here they add up, as :func:`outcome_reward` adds its bonus)."""
    block = format_reward if extract_answer_block(response) is not None else 0.0
    return float(countdown_correct(response, example)) + block


def make_countdown_task(num_test=128, format_reward=0.1, num_problems=10_000, think=False) -> Task:
    """Countdown: "Using the numbers [a, b, c, d] (1..99) once each with + - * /, make T (1..100)",
    T the value of a random ``example["solution"]``; no problem twice. :func:`countdown_reward` and
    :func:`countdown_correct`; ``think``: both read all their text (the ``<answer>`` block)."""
    rng = random.Random(SPLIT_SEED)
    problems = {}  # by (sorted numbers, target): the first of each, so no problem twice
    while len(problems) < num_problems:
        numbers = [rng.randint(1, 99) for _ in range(4)]
        pool = [(n, str(n)) for n in numbers]  # combined in random order by random operators
        while len(pool) > 1:
            a, left = pool.pop(rng.randrange(len(pool)))
            b, right = pool.pop(rng.randrange(len(pool)))
            ops = ["+"] + ["*"] * (a * b <= 1000) + ["-"] * (a > b) + ["/"] * (b > 1 and a % b == 0)
            op = rng.choice(ops)
            left, right = (e if e.isdigit() else f"({e})" for e in (left, right))
            value = {"+": a + b, "*": a * b, "-": a - b, "/": a // b}[op]
            pool.append((value, f"{left} {op} {right}"))
        [(target, solution)] = pool
        question = (
            f"Using the numbers {numbers} once each with + - * / and parentheses, make {target}. "
            "Show your reasoning in <think> </think> tags, then write only the expression in "
            "<answer> </answer> tags, for example <answer> (1 + 2) * 3 </answer>."
        )
        example = dict(question=question, answer=str(target), numbers=numbers, target=target)
        if 1 <= target <= 100:
            problems.setdefault((tuple(sorted(numbers)), target), {**example, "solution": solution})
    split = _split(list(problems.values()), num_test, "task 'countdown'")
    reward = functools.partial(countdown_reward, format_reward=format_reward)
    fns = (countdown_expression_correct,) * 2 if think else (reward, countdown_correct)
    return Task("countdown", *split, *fns)  # think: True / False is the reward


# ---- process supervision: a multi-step task, checkable steps, char -> token offsets ------------
# A term: a number with "(", "-", ")" around it. No space can match two neighbouring \s*
# (a sum without "=" took exponential time to reject: 6 s for ten terms).
_TERM = rf"(?:-\s*)?\$?{_DIGITS}(?:\s*\)+)?"
_STEP = re.compile(
    rf"(?<![\d.])(\(*\s*{_TERM}(?:\s*[-+*/×]\s*(?:\(+\s*)?{_TERM})+)\s*=\s*(-?\s*\$?{_DIGITS})"
)


def arithmetic_step_rewards(completion: str, example=None) -> list[tuple[int, float]]:
    """Process supervision's step rewards: each equation ``x op y (op z ...) = w`` (``+ - * / ×``,
    parentheses, ``$``, ``1,234``, GSM8K's ``<<48/2=24>>``) as (end offset after its last digit,
    1.0 if right within a relative 1e-4 else 0.0)."""
    steps = []
    for m in _STEP.finditer(completion):
        sides = (m.group(1), m.group(2).replace(" ", ""))
        sides = [s.replace("$", "").replace(",", "").replace("×", "*").strip() for s in sides]
        try:
            lhs, rhs = (_arithmetic(ast.parse(s, mode="eval").body, float, True) for s in sides)
            ok = math.isclose(lhs, rhs, rel_tol=1e-4, abs_tol=1e-9)
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
            ok = False
        steps.append((m.end(), float(ok)))
    return steps


def make_multistep_task(num_test=128, format_reward=0.0, num_problems=10_000) -> Task:
    """ "Compute (a + b) * c - d", one calculation a line (a, b, d in 1..20, c in 2..9), with the
    reference ``solution``; the final-number reward."""
    rng = random.Random(SPLIT_SEED)
    problems = {}  # by (a, b, c, d): the first of each, so no problem twice
    while len(problems) < num_problems:
        a, b, c, d = rng.randint(1, 20), rng.randint(1, 20), rng.randint(2, 9), rng.randint(1, 20)
        s, p = a + b, (a + b) * c
        question = (
            f"Compute ({a} + {b}) * {c} - {d}. Write each calculation on its own line in the form "
            "x + y = z, and end with the result."
        )
        solution = f"{a} + {b} = {s}\n{s} * {c} = {p}\n{p} - {d} = {p - d}"
        example = {"question": question, "answer": str(p - d), "solution": solution}
        problems.setdefault((a, b, c, d), example)
    reward = functools.partial(outcome_reward, format_reward=format_reward)
    split = _split(list(problems.values()), num_test, "task 'multistep'")
    return Task("multistep", *split, reward, number_matches)


def char_ends_to_token_indices(tokenizer, token_ids: list[int], char_ends: list[int]) -> list[int]:
    """For each end offset in the decoded ``token_ids``, the first token whose decoded prefix
    reaches it (past the text: the last token)."""
    prefixes = [token_ids[: k + 1] for k in range(len(token_ids))]
    lengths = [len(p) for p in tokenizer.batch_decode(prefixes, skip_special_tokens=True)]
    return [min(bisect.bisect_left(lengths, end), len(token_ids) - 1) for end in char_ends]


# ---- scoring a batch: the user's functions checked, one line per failure -----------------------
_USER_ERRORS = (Exception, SystemExit)  # sys.exit() in user code too; Ctrl-C stays an interrupt


def _checked_scores(fn, what: str, texts: list[str], examples: list[dict], first=0, unit=False):
    """``float(fn(text, example))`` each; UsageError naming ``what`` and the index when ``fn``
    raises, returns a non-number (bools count), one not finite in float32 or (``unit``) not 0..1."""
    expected = "True/False or a number in [0, 1]" if unit else "a finite number (float32)"
    scores = []
    for i, (text, example) in enumerate(zip(texts, examples, strict=True), first):
        where = f"on completion {i} ({text[:60]!r})"
        try:
            value = fn(text, example)
        except _USER_ERRORS as e:
            raise UsageError(f"{what} raised {type(e).__name__}: {_one_line(e)} {where}") from None
        if not isinstance(value, (numbers.Real, np.bool_)):
            raise UsageError(f"{what} returned {type(value).__name__} {where}; expected {expected}")
        if not abs(value) <= torch.finfo(torch.float32).max or (unit and not 0 <= value <= 1):
            raise UsageError(f"{what} returned {_one_line(value, 40)} {where}; expected {expected}")
        scores.append(float(value))
    return scores


def score_task(task: Task, responses: list[str], examples: list[dict]) -> tuple[torch.Tensor, dict]:
    """(N,) float32 rewards of ``task.reward_fn``, or of ``task.reward_fns`` with each one's own
    (N,) rewards by name (:func:`score_reward_fns`; else {}). UsageError: a function fails."""
    if task.reward_fns:
        return score_reward_fns(task.reward_fns, responses, examples, task.reward_weights)
    what = f"reward function of task {task.name!r}"
    return torch.tensor(_checked_scores(task.reward_fn, what, responses, examples)), {}


def score_correct(task: Task, responses: list[str], examples: list[dict]) -> torch.Tensor:
    """(N,) float32 ``task.correct_fn``, 1.0 for right: the logged accuracy. UsageError: it fails"""
    what = f"correct_fn of task {task.name!r}"
    return torch.tensor(_checked_scores(task.correct_fn, what, responses, examples, unit=True))


def score_reward_fns(reward_fns, completions, examples, weights=None) -> tuple[torch.Tensor, dict]:
    """``r_i = sum_k weights[k] * f_k(completions[i], examples[i])`` (None: 1 each), (N,) float32,
    and each ``f_k``'s (N,) rewards by its name in ``reward_fns``' (name, f_k) pairs. UsageError: a
    function fails (naming ``file:function`` and the index), the sum overflows."""
    if not reward_fns:
        raise ValueError("score_reward_fns needs at least one reward function")
    weights = [1.0] * len(reward_fns) if weights is None else weights
    counts = f"{len(weights)} weights for {len(reward_fns)} functions"
    check(len(weights) == len(reward_fns), f"--reward-weights: {counts}")
    total, each = [0.0] * len(completions), {}
    for (name, fn), weight in zip(reward_fns, weights, strict=True):
        inner = fn.func if isinstance(fn, functools.partial) else fn
        code = getattr(inner, "__code__", None) or getattr(type(inner).__call__, "__code__", None)
        label = getattr(inner, "__qualname__", type(inner).__name__)  # a callable object: its class
        label = f"{code.co_filename}:{label}" if code else label
        scores = _checked_scores(fn, f"reward function {label}", completions, examples)
        each[name] = torch.tensor(scores)
        total = [t + weight * r for t, r in zip(total, scores, strict=True)]
    for i, t in enumerate(total):
        where = f"on completion {i} ({completions[i][:60]!r})"
        check(math.isfinite(t), f"the weighted rewards sum to {t} {where}; lower --reward-weights")
    return torch.tensor(total), each


def load_reward_fns(specs: list[str]) -> list[tuple[str, RewardFn]]:
    """--reward-fn ``path/to/file.py:function_name`` specs as (log name, function) pairs, each file
    run once (:func:`runpy.run_path`). The log name is the function's, ``file_stem.name`` when two
    share it, then ``_2``, ``_3``... for a spec given again. UsageError naming the spec: a bad
    spec, file or function, or one that does not take (completion, example)."""
    names = [spec.rpartition(":")[2] for spec in specs]
    files, loaded, given = {}, [], collections.Counter()
    for spec in specs:
        file, _, name = spec.rpartition(":")
        where = f"--reward-fn {spec}"
        form = f"--reward-fn: expected path/to/file.py:function_name, got {spec!r}"
        check(file.endswith(".py") and name.isidentifier(), form)
        check(Path(file).is_file(), f"{where}: file {file} does not exist")
        path = Path(file).resolve()
        if path not in files:
            try:
                files[path] = runpy.run_path(file)
            except _USER_ERRORS as e:
                error = f"{type(e).__name__}: {_one_line(e)}"
                raise UsageError(f"{where}: cannot import {file}: {error}") from None
        fn = files[path].get(name)
        if not callable(fn):
            defined = ", ".join(k for k, v in files[path].items() if inspect.isfunction(v))
            raise UsageError(f"{where}: {file} has no function {name!r}; it defines: {defined}")
        try:
            inspect.signature(fn).bind("", {})
        except TypeError as e:
            raise UsageError(f"{where}: must take (completion, example): {_one_line(e)}") from None
        except ValueError:  # no signature to inspect (a builtin): its first call will tell
            pass
        label = name if names.count(name) == 1 else f"{Path(file).stem}.{name}"
        given[label] += 1  # a spec given again: label_2, label_3...
        loaded.append((label if given[label] == 1 else f"{label}_{given[label]}", fn))
    return loaded


# ---- the scripts' task flags and prompts -------------------------------------------------------
def check_task_flags(
    format_reward, reward_fns, reward_weights, prompt_field, answer_field, system_prompt, prefix
) -> None:
    """The flags of :func:`task_of` and the prompts, before any file is read. UsageError naming the
    flag: not one finite weight per function; a --format-reward that --reward-fn without ``task``
    drops; ``task`` twice or beside a function so named; a lone surrogate; one field for both."""
    counts = f"{len(reward_weights)} weights for {len(reward_fns)} functions (--reward-fn)"
    check(len(reward_weights) in (0, len(reward_fns)), f"--reward-weights: {counts}")
    check(all(map(math.isfinite, reward_weights)), "--reward-weights: must be finite numbers")
    own = "task" in reward_fns  # --reward-fn task: the task's own reward
    dropped = "--format-reward: is paid by the task's own reward, which --reward-fn replaces"
    check(own or not reward_fns or not format_reward, f"{dropped} (add `--reward-fn task`)")
    check(list(reward_fns).count("task") <= 1, "--reward-fn task: given twice; give it once")
    named_task = [s for s in reward_fns if s != "task" and s.rpartition(":")[2] == "task"]
    if own and len(named_task) == 1:  # load_reward_fns names it by its name
        raise UsageError(f"--reward-fn {named_task[0]}: logs as 'task', as the task's own")
    check_text(system_prompt or "", "--system-prompt")
    check_text(prefix, "--response-prefix")
    check_text(prompt_field, "--prompt-field")
    check_text(answer_field, "--answer-field")
    check(prompt_field != answer_field, "--prompt-field and --answer-field must name two fields")


def prompt_style(answer_format: str, system_prompt: str | None, response_prefix: str):
    """(system prompt, response prefix) of every prompt: --system-prompt (by default with
    --answer-format think :data:`THINK_ANSWER_SYSTEM_PROMPT`) and --response-prefix."""
    default = THINK_ANSWER_SYSTEM_PROMPT if answer_format == "think" else None
    return (default if system_prompt is None else system_prompt), response_prefix


def build_prompt(tokenizer, question: str, system_prompt: str | None = None, response_prefix=""):
    """The chat template's prompt (else ``"Question: {question}\\nAnswer:"``) + ``response_prefix``;
    ``system_prompt`` is the system message, or the user message's first paragraph without a
    template or with one that rejects or drops it."""
    if not getattr(tokenizer, "chat_template", None):
        system = f"{system_prompt}\n\n" if system_prompt else ""
        return f"{system}Question: {question}\nAnswer:{response_prefix}"
    template = functools.partial(
        tokenizer.apply_chat_template, tokenize=False, add_generation_prompt=True
    )
    messages = [{"role": "user", "content": question}]
    if system_prompt:
        try:
            text = template([{"role": "system", "content": system_prompt}, *messages])
            if system_prompt.strip() in text:
                return text + response_prefix
        except Exception:  # a template without a system role: fall back as documented
            pass
        messages = [{"role": "user", "content": f"{system_prompt}\n\n{question}"}]
    return template(messages) + response_prefix


def prompt_ids(tokenizer, questions: list[str], system_prompt=None, response_prefix=""):
    """The token ids of each question's :func:`build_prompt`, no special tokens added."""
    prompts = [build_prompt(tokenizer, q, system_prompt, response_prefix) for q in questions]
    return tokenizer(prompts, add_special_tokens=False)["input_ids"]


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
    """(fraction of ``examples`` that ``correct_fn`` finds right, responses: prefix + completion)
    by greedy decoding of :func:`build_prompt`'s prompts. UsageError: as :func:`score_correct`."""
    style = prompt_style(answer_format, system_prompt, response_prefix)
    limits = (max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id)
    greedy = lambda logits, rows: logits.argmax(-1)  # noqa: E731
    what, correct, outputs = f"correct_fn of task {task_name!r}", 0, []
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        prompts = [build_prompt(tokenizer, ex["question"], *style) for ex in batch]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        enc = enc.to(device)
        new = decode(policy, enc["input_ids"], enc["attention_mask"], *limits, greedy)
        texts = [style[1] + c for c in tokenizer.batch_decode(new, skip_special_tokens=True)]
        correct += sum(_checked_scores(correct_fn, what, texts, batch, start, unit=True))
        outputs += texts
    return correct / len(examples), outputs


def task_of(args) -> Task:
    """The task of --task or --dataset (think: answers in ``<answer>``, --format-reward for the
    format), scored by the --reward-fn functions weighted by --reward-weights if given. UsageError:
    a bad dataset or reward file, or (unless --eval-only) under --prompts-per-step to train on."""
    think = args.answer_format == "think"
    plain = 0.0 if think else args.format_reward
    if args.dataset is not None:
        numeric = not args.reward_fn or "task" in args.reward_fn  # the built-in reward: numbers
        fields = (args.prompt_field, args.answer_field, numeric)
        task = load_jsonl_task(args.dataset, args.eval_size, plain, *fields)
    elif args.task == "multistep":
        task = make_multistep_task(args.eval_size, plain)
    elif args.task == "countdown":
        task = make_countdown_task(args.eval_size, plain, think=think)
    else:
        task = make_addition_task(args.eval_size, plain)
    if think:
        task = with_think_answer_format(task, args.format_reward)
    if args.reward_fn:
        files = load_reward_fns([spec for spec in args.reward_fn if spec != "task"])
        own = ("task", task.reward_fn)
        task.reward_fns = [own if spec == "task" else files.pop(0) for spec in args.reward_fn]
        task.reward_weights = list(args.reward_weights) or None
    flag = f"--dataset: {args.dataset}" if args.dataset else f"--eval-size {args.eval_size}"
    left = f"{len(task.test)} held out, {len(task.train)} to train on, under --prompts-per-step"
    check(args.eval_only or len(task.train) >= args.prompts_per_step, f"{flag}: {left}")
    return task


def training_questions(task: Task, tokenizer, args, positions: int | None) -> list[dict]:
    """The training examples whose prompts, in the run's prompt style, have at most
    --max-prompt-length tokens. UsageError: fewer than --prompts-per-step of them, or the longest
    prompt plus --max-new-tokens beyond the model's ``positions`` (None: no limit)."""
    style = prompt_style(args.answer_format, args.system_prompt, args.response_prefix)
    ids = prompt_ids(tokenizer, [ex["question"] for ex in task.train], *style)
    fits = [len(row) <= args.max_prompt_length for row in ids]
    train = [ex for ex, fit in zip(task.train, fits, strict=True) if fit]
    fit = f"--max-prompt-length {args.max_prompt_length}: only {len(train)} training prompts fit"
    check(len(train) >= args.prompts_per_step, f"{fit}, fewer than --prompts-per-step")
    longest, new = (
        max(len(row) for row, fit in zip(ids, fits, strict=True) if fit),
        args.max_new_tokens,
    )
    check(
        positions is None or longest + new <= positions,
        f"--max-new-tokens {new}: the longest prompt ({longest} tokens) plus {new} new tokens "
        f"exceeds the model's {positions} positions; lower --max-new-tokens or --max-prompt-length",
    )
    return train
