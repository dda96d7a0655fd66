"""Countdown through the scripts' public flags: "Using the numbers [a, b, c, d] once each with
+ - * / and parentheses, make T", as TinyZero (github.com/Jiayi-Pan/TinyZero) and nano-aha-moment
(github.com/McGill-NLP/nano-aha-moment) train it. Run as a script, it writes the problems as JSONL;
its ``reward`` is a ``--reward-fn``. From the repository root:

    python examples/countdown.py --out countdown.jsonl
    SYSTEM="Think about the problem step by step inside <think> </think> tags, then write"
    SYSTEM="$SYSTEM only the final answer inside <answer> </answer> tags."
    python grpo_lm.py --dataset countdown.jsonl --reward-fn examples/countdown.py:reward \\
        --system-prompt "$SYSTEM" --response-prefix "<think>" --max-new-tokens 128

Each row's ``answer`` is the target, so the held-out accuracy the scripts log (the last number of
the response equals the target) is a loose proxy: ``"60"`` and
``"(57 - 12) + (15 * 1) = 60"`` count, the bare right expression does not, and the numbers are not
checked. The reward (logged as ``reward/reward/mean``) is the real check. Model text is parsed with
:mod:`ast` and computed with exact fractions, never evaluated. Standard library only."""

import argparse
import ast
import json
import random
import re
from fractions import Fraction
from operator import add, floordiv, mul, sub, truediv

OPS = {ast.Add: add, ast.Sub: sub, ast.Mult: mul, ast.Div: truediv}
INTEGER_OPS = {"+": add, "*": mul, "-": sub, "/": floordiv}
ARITHMETIC_CHARACTERS = set("0123456789+-*/() ")
ANSWER_BLOCK = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)


def make_problems(num_problems: int = 10_000, seed: int = 1234) -> list[dict]:
    """``num_problems`` rows ``{question, answer, numbers, target, solution}``: four numbers in
    1..99 combined in random order by random operators (integer steps only) into ``solution``, of
    value ``target`` in 1..100; no (numbers, target) twice. Seed 1234 gives the problems of
    ``--task countdown`` (tasks.py before this example), in the same order."""
    rng = random.Random(seed)
    problems = {}  # by (sorted numbers, target): the first of each, so no problem twice
    while len(problems) < num_problems:
        numbers = [rng.randint(1, 99) for _ in range(4)]
        pool = [(n, str(n)) for n in numbers]
        while len(pool) > 1:
            a, left = pool.pop(rng.randrange(len(pool)))
            b, right = pool.pop(rng.randrange(len(pool)))
            ops = ["+"]  # each step's value a positive integer, a product at most 1000
            if a * b <= 1000:
                ops.append("*")
            if a > b:
                ops.append("-")
            if b > 1 and a % b == 0:
                ops.append("/")
            op = rng.choice(ops)
            value = INTEGER_OPS[op](a, b)
            left = _bracketed(left)
            right = _bracketed(right)
            pool.append((value, f"{left} {op} {right}"))
        [(target, solution)] = pool
        question = (
            f"Using the numbers {numbers} once each with + - * / and parentheses, make {target}. "
            "Show your reasoning in <think> </think> tags, then write only the expression in "
            "<answer> </answer> tags, for example <answer> (1 + 2) * 3 </answer>."
        )
        answer = str(target)
        row = dict(
            question=question, answer=answer, numbers=numbers, target=target, solution=solution
        )
        if 1 <= target <= 100:
            key = (tuple(sorted(numbers)), target)
            problems.setdefault(key, row)
    return list(problems.values())


def _bracketed(expression: str) -> str:
    """A number as it is, anything longer in parentheses."""
    if expression.isdigit():
        return expression
    return f"({expression})"


def _value(node: ast.AST) -> Fraction:
    """The exact value of an ast of integers and ``+ - * /``; ValueError for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        op = OPS[type(node.op)]
        left = _value(node.left)
        right = _value(node.right)
        return op(left, right)
    raise ValueError("not arithmetic")


def arithmetic(text: str) -> tuple[Fraction, list[int]] | None:
    """(exact value, integers as written) of integers, ``+ - * / × ÷`` and parentheses (no unary
    minus, ``**``, names or decimals), parsed with :mod:`ast`; else None, as for a division by zero
    or over 1,000 characters. White space of any kind separates tokens."""
    text = text.replace("×", "*").replace("÷", "/")
    text = " ".join(text.split())
    if not text or len(text) > 1000 or not set(text) <= ARITHMETIC_CHARACTERS:
        return None
    try:
        tree = ast.parse(text, mode="eval")
        value = _value(tree.body)
        integers = [int(n) for n in re.findall(r"\d+", text)]
        return value, integers
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None


def expression(completion: str) -> str | None:
    """The last ``<answer>`` block, stripped, else the last run of arithmetic with a digit on the
    last non-empty line (``"Step 2: 5 * 3 = 15"`` gives ``"5 * 3 = 15"``), else None."""
    blocks = ANSWER_BLOCK.findall(completion)
    if blocks:
        return blocks[-1].strip()
    lines = [line for line in completion.splitlines() if line.strip()]
    if not lines:
        return None
    runs = re.split(r"[^0-9+\-*/()×÷= \t]+", lines[-1])
    runs = [run for run in runs if any(c.isdigit() for c in run)]
    if not runs:
        return None
    return runs[-1].strip()


def correct(completion: str, example: dict) -> bool:
    """The :func:`expression` uses each of ``example["numbers"]`` once and equals
    ``example["target"]`` exactly; each ``= ...`` after it must have that value. Also a
    ``--reward-fn`` (True is 1.0)."""
    text = expression(completion)
    if text is None:
        return False
    first, *claims = text.split("=")
    parsed = arithmetic(first)
    if parsed is None:
        return False
    value, integers = parsed
    if sorted(integers) != sorted(example["numbers"]):
        return False
    claimed = [arithmetic(side) for side in claims if side.strip()]
    claims_hold = all(claim and claim[0] == value for claim in claimed)
    return value == example["target"] and claims_hold


def reward(completion: str, example: dict) -> float:
    """1.0 when :func:`correct`, + 0.1 for an ``<answer>`` block (TinyZero: 1.0 or 0.1; here they
    add up): 0.0, 0.1, 1.0 or 1.1."""
    is_correct = correct(completion, example)
    has_block = bool(ANSWER_BLOCK.search(completion))
    return float(is_correct) + 0.1 * has_block


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write Countdown problems as JSONL.")
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.add_argument("--num-problems", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    rows = make_problems(args.num_problems, seed=args.seed)
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} problems to {args.out}")
