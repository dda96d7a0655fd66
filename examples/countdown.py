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
from operator import add, mul, sub, truediv

OPS = {ast.Add: add, ast.Sub: sub, ast.Mult: mul, ast.Div: truediv}
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
        row = dict(question=question, answer=str(target), numbers=numbers, target=target)
        if 1 <= target <= 100:
            problems.setdefault((tuple(sorted(numbers)), target), {**row, "solution": solution})
    return list(problems.values())


def _value(node: ast.AST) -> Fraction:
    """The exact value of an ast of integers and ``+ - * /``; ValueError for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError("not arithmetic")


def arithmetic(text: str) -> tuple[Fraction, list[int]] | None:
    """(exact value, integers as written) of integers, ``+ - * / × ÷`` and parentheses (no unary
    minus, ``**``, names or decimals), parsed with :mod:`ast`; else None, as for a division by zero
    or over 1,000 characters. White space of any kind separates tokens."""
    text = " ".join(text.replace("×", "*").replace("÷", "/").split())
    if not text or len(text) > 1000 or not set(text) <= set("0123456789+-*/() "):
        return None
    try:
        return _value(ast.parse(text, mode="eval").body), [int(n) for n in re.findall(r"\d+", text)]
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None


def expression(completion: str) -> str | None:
    """The last ``<answer>`` block, stripped, else the last run of arithmetic with a digit on the
    last non-empty line (``"Step 2: 5 * 3 = 15"`` gives ``"5 * 3 = 15"``), else None."""
    blocks = ANSWER_BLOCK.findall(completion)
    if blocks:
        return blocks[-1].strip()
    lines = [line for line in completion.splitlines() if line.strip()]
    runs = re.split(r"[^0-9+\-*/()×÷= \t]+", lines[-1]) if lines else []
    runs = [run for run in runs if any(c.isdigit() for c in run)]
    return runs[-1].strip() if runs else None


def correct(completion: str, example: dict) -> bool:
    """The :func:`expression` uses each of ``example["numbers"]`` once and equals
    ``example["target"]`` exactly; each ``= ...`` after it must have that value. Also a
    ``--reward-fn`` (True is 1.0)."""
    text = expression(completion)
    if text is None:
        return False
    first, *claims = text.split("=")
    parsed = arithmetic(first)
    if parsed is None or sorted(parsed[1]) != sorted(example["numbers"]):
        return False
    values = [arithmetic(side) for side in claims if side.strip()]
    return parsed[0] == example["target"] and all(v and v[0] == parsed[0] for v in values)


def reward(completion: str, example: dict) -> float:
    """1.0 when :func:`correct`, + 0.1 for an ``<answer>`` block (TinyZero: 1.0 or 0.1; here they
    add up): 0.0, 0.1, 1.0 or 1.1."""
    return float(correct(completion, example)) + 0.1 * bool(ANSWER_BLOCK.search(completion))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write Countdown problems as JSONL.")
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.add_argument("--num-problems", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    rows = make_problems(args.num_problems, args.seed)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"wrote {len(rows)} problems to {args.out}")
