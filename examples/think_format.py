"""Rewards for DeepSeek-R1's reasoning format, ``<think> ... </think> <answer> ... </answer>``
(arXiv 2501.12948, §2.2.2: an accuracy reward and a format reward), as ``--reward-fn`` functions
for any ``--dataset`` with numeric answers. GSM8K, from the repository root:

    SYSTEM="Think about the problem step by step inside <think> </think> tags, then write"
    SYSTEM="$SYSTEM only the final answer inside <answer> </answer> tags."  # SYSTEM_PROMPT below
    python grpo_lm.py --dataset ../shared/data/gsm8k/train.jsonl --system-prompt "$SYSTEM" \\
        --response-prefix "<think>" --reward-fn examples/think_format.py:answer_reward \\
        --reward-fn examples/think_format.py:format_reward --reward-weights 1 0.1 \\
        --max-new-tokens 256

The weight 0.1 is TinyZero's format score (github.com/Jiayi-Pan/TinyZero).
The functions read ``--response-prefix`` + the completion, so the prefilled ``<think>`` counts.
Standard library only."""

import re

SYSTEM_PROMPT = (
    "Think about the problem step by step inside <think> </think> tags, then "
    "write only the final answer inside <answer> </answer> tags."
)
TAGS = ("<think>", "</think>", "<answer>", "</answer>")
THINK_ANSWER = re.compile(r"\s*<think>(.*)</think>\s*<answer>(.*)</answer>\s*", re.DOTALL)
ANSWER_BLOCK = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")  # 45, -3.5, 1,234


def format_reward(completion: str, example: dict) -> float:
    """1.0 when the whole ``completion`` is ``<think>...</think> <answer>...</answer>`` (white
    space around and between), each tag once and text in the answer block; else 0.0."""
    if any(completion.count(tag) != 1 for tag in TAGS):
        return 0.0
    match = THINK_ANSWER.fullmatch(completion)
    if match is None:
        return 0.0
    answer = match.group(2).strip()
    return float(bool(answer))


def answer_reward(completion: str, example: dict) -> float:
    """1.0 when the last number in the last ``<answer>`` block equals ``example["answer"]`` (within
    1e-6, thousands separators dropped); 0.0 otherwise, or without a block. An answer that is not
    a number raises ValueError, which stops the run with a line naming this function."""
    answer = float(str(example["answer"]).replace(",", ""))
    blocks = ANSWER_BLOCK.findall(completion)
    if not blocks:
        return 0.0
    numbers = NUMBER.findall(blocks[-1])
    if not numbers:
        return 0.0
    last = float(numbers[-1].replace(",", ""))
    return float(abs(last - answer) < 1e-6)
