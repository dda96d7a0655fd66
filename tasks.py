"""Tasks, data and rewards: the built-in tasks (addition; multistep, with process supervision's
step rewards), JSON Lines data, answer checking, reward functions from files, scoring a batch,
prompts and the held-out accuracy. Model text is parsed, never evaluated. Bring your own task:
build a :class:`Task`, or run a JSONL file and reward file through the flags (examples/)."""

import contextlib
import itertools
import json
import numbers
import random
import re
import runpy
from collections.abc import Callable
from dataclasses import dataclass
from math import comb
from pathlib import Path

import numpy as np
import torch

import common
from common import UsageError, bf16_autocast, check, resolve_model_path

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
DIGITS = r"\d+(?:,\d{3})*(?:\.\d+)?"  # 45, 3.5, 1,234: every number read here, model's or data's
_NUMBER = re.compile(rf"-?{DIGITS}")


def extract_final_number(text: str) -> float | None:
    """The last number in ``text`` (``1,234`` and ``-3.5`` allowed), or None."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    return float(matches[-1].replace(",", ""))


def number_matches(completion: str, example: dict) -> bool:
    """The last number of ``completion`` equals ``example["answer"]`` (within 1e-6): the built-in
    tasks' reward (1.0 or 0.0) and accuracy."""
    value = extract_final_number(completion)
    if value is None:
        return False
    return abs(value - float(example["answer"])) < 1e-6


def _normalised(text: str) -> str:
    """``text`` casefolded, each run of spaces one space, ``.,;:!?"'`` stripped at both ends."""
    words = " ".join(text.casefold().split())
    return words.strip(" .,;:!?\"'`")


def answer_text_matches(completion: str, example: dict) -> bool:
    """The completion matches ``example["answer"]``: as a number (:func:`number_matches`), else,
    case, spaces and ``.,;:!?"'`` aside, it ends with the answer at a word boundary ("Paris" matches
    "The capital is Paris.", not "Parisian")."""
    answer = str(example["answer"])
    if _NUMBER.fullmatch(answer):
        return number_matches(completion, {"answer": answer.replace(",", "")})
    final = _normalised(completion)
    expected = _normalised(answer)
    if not expected:
        return False
    return re.search(rf"(^|\W){re.escape(expected)}$", final) is not None


# ---- data: generated tasks and JSON Lines files ------------------------------------------------
def _split(problems: list[dict], num_test: int, what: str) -> tuple[list[dict], list[dict]]:
    """(train, test), the first ``num_test`` held out; UsageError unless some are left to train."""
    message = f"--eval-size {num_test}: {what} has {len(problems)} problems; hold out fewer"
    check(num_test < len(problems), message)
    return problems[num_test:], problems[:num_test]


def make_addition_task(num_test: int = 128) -> Task:
    """8,100 problems "What is a + b?" for two-digit a and b, in a fixed shuffled order."""
    problems = []
    for a, b in itertools.product(range(10, 100), range(10, 100)):
        problems.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    random.Random(SPLIT_SEED).shuffle(problems)
    train, test = _split(problems, num_test, "task 'addition'")
    return Task("addition", train, test, reward_fn=number_matches, correct_fn=number_matches)


def check_text(text: str, what: str) -> None:
    """UsageError naming ``what`` when ``text`` holds a lone surrogate (JSON's ``\\ud800``, bad
    command-line bytes): not Unicode, so no tokenizer takes it."""
    if bad := re.search("[\ud800-\udfff]", text):
        raise UsageError(f"{what}: a lone surrogate at character {bad.start() + 1} is not Unicode")


def _jsonl_example(line: bytes, prompt_field: str, answer_field: str, numeric: bool) -> dict:
    """One JSONL line as an example; ValueError or UsageError: what is wrong with it."""
    row = json.loads(line.decode("utf-8"))  # UnicodeDecodeError, JSONDecodeError: ValueErrors
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object {{...}}, got {json.dumps(row)[:40]}")
    prompt = row.get(prompt_field)
    answer = row.get(answer_field)
    if isinstance(answer, float | int) and not isinstance(answer, bool):
        answer = np.format_float_positional(answer, trim="-")  # 1e-07: "0.0000001"
    for value, field in ((prompt, prompt_field), (answer, answer_field)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"field {field!r}: expected text, got {json.dumps(value)[:40]}")
        check_text(value, f"field {field!r}")
    solution, gsm8k, final = answer.rpartition("####")  # GSM8K: "<solution> #### <answer>"
    final = final.strip()
    if _NUMBER.fullmatch(final):
        final = final.replace(",", "")
    else:  # the caller adds FILE:LINE
        quoted = repr(final[:60])
        number = "a number such as 45, -3.5 or 1,234 (alone or after GSM8K's ####)"
        check(not numeric, f"answer {quoted} is not {number}; else use --reward-fn/--correct-fn")
        check(re.search(r"\w", final), f"answer {quoted} has no word or number to compare")
    example = {**row, "question": prompt, "answer": final}
    if gsm8k:
        example["solution"] = solution.strip()
    return example


def read_jsonl(
    path, prompt_field="question", answer_field="answer", *, numeric=True, flag="--dataset"
):
    """The examples of a JSON Lines file, in the file's order: an example a line, ``{**row,
    "question": prompt, "answer": final}``; ``"... #### 45"`` gives ``final = "45"``, the text
    before as ``"solution"``. ``numeric``: answers are numbers (thousands separators dropped).
    UsageError: ``{flag}: FILE:LINE: ...``, or ``{flag}: cannot read FILE``."""
    examples = []
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    if line.strip():
                        text = line.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
                        example = _jsonl_example(text, prompt_field, answer_field, numeric)
                        examples.append(example)
                except (ValueError, UsageError) as e:
                    raise UsageError(f"{flag}: {path}:{lineno}: {e}") from None
    except OSError as e:
        raise UsageError(f"{flag}: cannot read {path}: {e.strerror}") from None
    return examples


def load_jsonl_task(
    path, num_test, prompt_field="question", answer_field="answer", *, numeric=True
):
    """A JSON Lines file (GSM8K's by default, :func:`read_jsonl`), shuffled, the first
    ``num_test`` held out. ``numeric``: answers are numbers and :func:`number_matches` checks them;
    else text, :func:`answer_text_matches`. UsageError: ``--dataset: FILE:LINE: ...``."""
    examples = read_jsonl(path, prompt_field, answer_field, numeric=numeric)
    random.Random(SPLIT_SEED).shuffle(examples)
    matches = number_matches if numeric else answer_text_matches
    train, test = _split(examples, num_test, str(path))
    return Task(Path(path).stem, train, test, reward_fn=matches, correct_fn=matches)


# ---- a multi-step task (process supervision's default steps: grpo_lm.py) --------------------
def make_multistep_task(num_test=128, num_problems=10_000) -> Task:
    """ "Compute (a + b) * c - d", one calculation a line (a, b, d in 1..20, c in 2..9), with the
    reference ``solution``; the final-number reward."""
    rng = random.Random(SPLIT_SEED)
    problems = {}  # by (a, b, c, d): no problem twice
    while len(problems) < num_problems:
        a = rng.randint(1, 20)
        b = rng.randint(1, 20)
        c = rng.randint(2, 9)
        d = rng.randint(1, 20)
        total = a + b
        product = total * c
        result = product - d
        question = f"Compute ({a} + {b}) * {c} - {d}. Write each calculation on its own line in the"
        question += " form x + y = z, and end with the result."
        add = f"{a} + {b} = {total}"
        multiply = f"{total} * {c} = {product}"
        subtract = f"{product} - {d} = {result}"
        solution = f"{add}\n{multiply}\n{subtract}"
        example = dict(question=question, answer=str(result), solution=solution)
        problems.setdefault((a, b, c, d), example)
    train, test = _split(list(problems.values()), num_test, "task 'multistep'")
    return Task("multistep", train, test, reward_fn=number_matches, correct_fn=number_matches)


# ---- scoring a batch: the user's functions checked, one line per failure -----------------------
def _checked_scores(fn, what: str, texts: list[str], examples: list[dict], *, first=0, unit=False):
    """``float(fn(text, example))`` each; UsageError naming ``what`` and the index when ``fn``
    raises (or calls sys.exit), returns a non-number (bools count), one not finite in float32 or
    (``unit``) not in [0, 1]. Ctrl-C stays an interrupt."""
    expected = "True/False or a number in [0, 1]" if unit else "a finite number (float32)"
    scores = []
    pairs = zip(texts, examples, strict=True)
    for i, (text, example) in enumerate(pairs, first):
        where = f"on completion {i} ({text[:60]!r})"
        try:
            value = fn(text, example)
        except (Exception, SystemExit) as e:
            message = f"{what} raised {type(e).__name__}: {e} {where}"
            raise UsageError(message[:400]) from None
        number = isinstance(value, numbers.Real | np.bool_)
        finite = number and abs(value) <= 3.4e38
        if not finite or (unit and not 0 <= value <= 1):
            shown = str(value)[:40]
            raise UsageError(f"{what} returned {shown} {where}; expected {expected}")
        scores.append(float(value))
    return scores


def score_task(task: Task, responses: list[str], examples: list[dict]) -> tuple[torch.Tensor, dict]:
    """(N,) float32 rewards: ``r_i = sum_k w_k * f_k(responses[i], examples[i])`` over the
    --reward-fn functions ``task.reward_fns`` (weights ``task.reward_weights``, None: 1 each), with
    each f_k's (N,) rewards by its name; else ``task.reward_fn``'s and {}. UsageError: a function
    fails (naming it and the completion's index), or the weighted sum overflows."""
    if not task.reward_fns:
        what = f"reward function of task {task.name!r}"
        scores = _checked_scores(task.reward_fn, what, responses, examples)
        return torch.tensor(scores), {}
    weights = task.reward_weights or [1.0] * len(task.reward_fns)
    total = 0.0
    each = {}
    for (name, fn), weight in zip(task.reward_fns, weights, strict=True):
        scores = _checked_scores(fn, f"reward function {name}", responses, examples)
        each[name] = torch.tensor(scores)
        total = total + weight * np.array(scores)
    rewards = torch.tensor(total, dtype=torch.float32)
    check(rewards.isfinite().all(), "the weighted rewards overflow: lower --reward-weights")
    return rewards, each


def reward_model_scores(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,) float32 scores, differentiable, of a sequence classifier on (N, L) left-padded prompt +
    completion, pooled where its own forward pools (its last token that is not the pad token)."""
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    return out.logits[:, 0].float()


@torch.no_grad()
def score_with_reward_model(
    model, ids, mask, batch_size: int, *, device, bf16: bool
) -> torch.Tensor:
    """A step's (N,) scores (:func:`reward_model_scores`) on the CPU, ``batch_size`` at a time."""
    with bf16_autocast(device, bf16):
        chunks = zip(ids.split(batch_size), mask.split(batch_size), strict=True)
        return torch.cat([reward_model_scores(model, i, m).cpu() for i, m in chunks])


def score_correct(task: Task, responses: list[str], examples: list[dict]) -> torch.Tensor:
    """(N,) float32 ``task.correct_fn``, 1.0 for right: the logged accuracy. UsageError: it fails"""
    what = f"correct_fn of task {task.name!r}"
    scores = _checked_scores(task.correct_fn, what, responses, examples, unit=True)
    return torch.tensor(scores)


def load_function(spec: str, flag: str, files: dict) -> Callable:
    """The function NAME of a ``path/to/file.py:NAME`` spec, the file run by
    :func:`runpy.run_path` unless ``files`` (each file's globals, by path) holds it already.
    UsageError naming ``flag`` and the spec: not FILE.py:NAME, a file that cannot run, no such
    function."""
    where = f"{flag} {spec}"
    file, _, name = spec.rpartition(":")
    check(file.endswith(".py") and name.isidentifier(), f"{where}: expected FILE.py:NAME")
    if file not in files:
        try:
            files[file] = runpy.run_path(file)
        except (Exception, SystemExit) as e:
            raise UsageError(f"{where}: cannot run {file}: {type(e).__name__}: {e}") from None
    fn = files[file].get(name)
    check(callable(fn), f"{where}: no function {name!r} in {file}")
    return fn


def load_reward_fns(
    specs: list[str], own: RewardFn | None = None, files: dict | None = None
) -> list[tuple[str, RewardFn]]:
    """--reward-fn ``path/to/file.py:function_name`` specs as (log name, function) pairs, each file
    run once (:func:`load_function`; ``files``: the globals of files already run, by path),
    ``task``: ``own``; the log name is the function's, with
    ``_2``, ``_3``... when it repeats (``task`` counts). A function that does not take (completion,
    example) fails at its first call. UsageError naming the spec: a bad spec, file or function."""
    if files is None:
        files = {}  # each file's globals, by path
    names = [spec.rpartition(":")[2] for spec in specs]
    loaded = []
    for i, spec in enumerate(specs):
        name = names[i]
        repeats = names[:i].count(name)
        label = f"{name}_{repeats + 1}" if repeats else name  # given again: name_2, name_3, ...
        if spec == "task":  # the task's own reward
            fn = own
        else:
            fn = load_function(spec, "--reward-fn", files)
        loaded.append((label, fn))
    return loaded


# ---- the scripts' task flags, prompts, the held-out accuracy -----------------------------------
def check_task_flags(
    reward_fns, weights, *, prompt_field, answer_field, system_prompt, response_prefix
):
    """The flags of :func:`task_of` and the prompts, before any file is read. UsageError naming the
    flag: not one weight per function; ``task`` twice; a lone surrogate; one field for both."""
    counts = f"{len(weights)} weights for {len(reward_fns)} functions (--reward-fn)"
    check(len(weights) in (0, len(reward_fns)), f"--reward-weights: {counts}")
    check(list(reward_fns).count("task") <= 1, "--reward-fn task: given twice; give it once")
    check_text(system_prompt or "", "--system-prompt")
    check_text(response_prefix, "--response-prefix")
    check(prompt_field != answer_field, "--prompt-field and --answer-field must name two fields")


def task_of(
    name,
    dataset,
    *,
    prompt_field,
    answer_field,
    reward_fn,
    reward_weights,
    eval_size,
    correct_fn=None,
    eval_dataset=None,
    files=None,
):
    """The task --task ``name``, or the JSONL file --dataset, with ``eval_size`` questions held
    out, scored by the --reward-fn functions weighted by --reward-weights if given (``task``: the
    task's own). ``eval_dataset`` (--eval-dataset): a JSONL file whose first ``eval_size``
    questions are the held-out ones instead, none cut from the training data. ``correct_fn``
    (--correct-fn ``FILE.py:NAME``): what counts as right, for the held-out accuracy and
    reward/accuracy (default: the task's own matcher). ``files``: the globals of the function files
    run so far, by path, shared with the caller's other loaders (a file run once). UsageError: a bad
    dataset or function file."""
    numeric = not reward_fn or "task" in reward_fn  # the built-in reward: numbers
    num_test = 0 if eval_dataset else eval_size  # --eval-dataset: the training data stays whole
    if dataset is not None:
        task = load_jsonl_task(dataset, num_test, prompt_field, answer_field, numeric=numeric)
    elif name == "multistep":
        task = make_multistep_task(num_test)
    else:
        task = make_addition_task(num_test)
    if files is None:
        files = {}  # each function file's globals, by path: a file several flags name runs once
    if correct_fn:
        task.correct_fn = load_function(correct_fn, "--correct-fn", files)
    if eval_dataset:
        flag = "--eval-dataset"
        numbers = task.correct_fn is number_matches  # the matcher that judges them reads numbers
        test = read_jsonl(eval_dataset, prompt_field, answer_field, numeric=numbers, flag=flag)
        check(test, f"{flag}: {eval_dataset} has no examples")
        task.test = test[:eval_size]
    if reward_fn:
        task.reward_fns = load_reward_fns(reward_fn, task.reward_fn, files)
        task.reward_weights = list(reward_weights) or None
    return task


def build_prompt(tokenizer, question: str, system_prompt: str | None = None, response_prefix=""):
    """The chat template's prompt (else ``"Question: {question}\\nAnswer:"``) + ``response_prefix``;
    ``system_prompt`` is the system message, or the user message's first paragraph without a
    template or with one that rejects or drops it."""
    if not getattr(tokenizer, "chat_template", None):
        system = f"{system_prompt}\n\n" if system_prompt else ""
        return f"{system}Question: {question}\nAnswer:{response_prefix}"
    template = tokenizer.apply_chat_template
    kw = dict(tokenize=False, add_generation_prompt=True)
    user = {"role": "user", "content": question}
    if system_prompt:
        with contextlib.suppress(Exception):  # a template without a system role: fall back
            system = {"role": "system", "content": system_prompt}
            text = template([system, user], **kw)
            if system_prompt.strip() in text:
                return text + response_prefix
        user = {"role": "user", "content": f"{system_prompt}\n\n{question}"}
    return template([user], **kw) + response_prefix


def prompt_ids(tokenizer, questions: list[str], system_prompt=None, response_prefix=""):
    """The token ids of each question's :func:`build_prompt`, no special tokens added."""
    prompts = [build_prompt(tokenizer, q, system_prompt, response_prefix) for q in questions]
    return tokenizer(prompts, add_special_tokens=False)["input_ids"]


def training_questions(
    task,
    tokenizer,
    *,
    system_prompt,
    response_prefix,
    max_prompt_length,
    minimum,
    max_new_tokens,
    model_path,
):
    """The training examples whose prompts (with ``system_prompt`` and ``response_prefix``) have at
    most ``max_prompt_length`` tokens. UsageError: fewer than ``minimum`` (--prompts-per-step), or
    the longest prompt plus ``max_new_tokens`` beyond the positions of the model at ``model_path``
    (its ``max_position_embeddings``)."""
    questions = [example["question"] for example in task.train]
    prompts = prompt_ids(tokenizer, questions, system_prompt, response_prefix)
    lengths = [len(ids) for ids in prompts]
    train = []
    for example, length in zip(task.train, lengths, strict=True):
        if length <= max_prompt_length:
            train.append(example)
    fit = f"--max-prompt-length {max_prompt_length}: {len(train)} training prompts fit"
    few = f"{fit} (of {len(task.train)}), fewer than --prompts-per-step"
    check(len(train) >= minimum, few)
    from transformers import AutoConfig  # the model's config alone: its positions

    config = AutoConfig.from_pretrained(resolve_model_path(model_path))
    positions = getattr(config, "max_position_embeddings", None)
    longest = max(n for n in lengths if n <= max_prompt_length)
    past = f"--max-new-tokens {max_new_tokens}: with the longest prompt ({longest} tokens) past"
    fits = positions is None or longest + max_new_tokens <= positions
    check(fits, f"{past} the model's {positions} positions; lower it or --max-prompt-length")
    return train


def eval_only(policy, checkpoint: dict | None, held_out, out: Path) -> dict:
    """--eval-only: ``held_out(policy)`` = (metrics, completions) of the ``checkpoint`` or
    ``policy``, printed, and as JSON in ``out`` (``eval_step{N}.json`` for a checkpoint)."""
    if checkpoint is not None:  # its model is --model-name-or-path: the weights fit
        out = out.with_name(f"eval_step{checkpoint['step']}.json")
        common.load_trained_weights(policy, checkpoint["policy"])
    metrics, completions = held_out(policy)
    report = {key.removeprefix("eval/"): value for key, value in metrics.items()}
    report["first"] = completions[:5]
    report["questions"] = len(completions)
    report["checkpoint"] = None if checkpoint is None else checkpoint["step"]
    out.parent.mkdir(parents=True, exist_ok=True)  # a new run directory
    out.write_text(json.dumps(report))
    shown = ", ".join(f"{key[5:]} {value:.3f}" for key, value in metrics.items())
    print(f"held-out {shown}; written to {out}")
    return {key: [value] for key, value in metrics.items()}


def held_out_accuracy(
    policy,
    tokenizer,
    task,
    *,
    size,
    max_new_tokens,
    batch_size,
    system_prompt,
    response_prefix,
    bf16,
    samples=1,
    temperature=1.0,
    top_p=1.0,
    seed=0,
    tool=None,
):
    """(:func:`sample_metrics`, each question's responses) of the first ``size`` held-out questions:
    prompts (with ``system_prompt`` and ``response_prefix``) answered greedily, or ``samples`` > 1
    times at ``temperature`` and ``top_p``, each response's draws seeded from ``seed`` and its
    place among the held-out responses (:func:`common.row_uniforms`); each
    response (prefix + completion) scored by ``task.correct_fn``, and ``eval/reward_mean``: the
    mean of the task's reward (:func:`score_task`; not a reward model's) over the responses; with
    ``tool`` (grpo_lm.Tool, called while sampling) ``eval/frac_calling_tool``, the share
    of responses that call it. UsageError: as score_correct and score_task."""
    n = samples
    sample_temperature = temperature if n > 1 else 0.0  # temperature 0: greedy
    examples = task.test[:size]
    what = f"correct_fn of task {task.name!r}"
    scores = []
    answers = []
    every_response = []
    every_example = []
    calls = []
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        questions = [ex["question"] for ex in batch]
        prompts = prompt_ids(tokenizer, questions, system_prompt, response_prefix)
        new = common.generate_completions(
            policy,
            prompts,
            n,
            tokenizer,
            temperature=sample_temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            bf16=bf16,
            seed_keys=(seed, 2**31),  # seeds apart from training's
            first_index=start,
            tool=tool,
        )
        completions = tokenizer.batch_decode(new.ids, skip_special_tokens=True)
        responses = [response_prefix + c for c in completions]
        each = [ex for ex in batch for _ in range(n)]
        first = start * n  # the index of the batch's first response
        scores += _checked_scores(task.correct_fn, what, responses, each, first=first, unit=True)
        for i in range(0, len(responses), n):  # question by question
            answers.append(responses[i : i + n])
        every_response += responses
        every_example += each
        calls.append(new.tool_calls[:, 0] > 0)
    metrics = sample_metrics(torch.tensor(scores).view(-1, n), answers)
    rewards, _ = score_task(task, every_response, every_example)
    metrics["eval/reward_mean"] = rewards.mean().item()
    if tool is not None:
        metrics["eval/frac_calling_tool"] = torch.cat(calls).float().mean().item()
    return metrics, answers


def final_answer(text: str) -> float | str:
    """A response's vote for maj@n: its last number, else its text."""
    number = extract_final_number(text)
    if number is None:
        return text
    return number


def sample_metrics(scores: torch.Tensor, answers: list[list[str]]) -> dict[str, float]:
    """Metrics of n responses ``answers`` to each of Q questions, (Q, n) correct_fn ``scores`` in
    [0, 1] (right: 1): ``eval/accuracy`` (pass@1: the mean score; greedy if n = 1); for n > 1 the
    unbiased ``eval/pass@k`` (Chen et al. 2021, arXiv 2107.03374, eq. 1: ``1 - C(n - c, k) / C(n,
    k)``, c right responses, averaged over questions) for k = 2, 4, 8, ... < n and k = n, and
    ``eval/maj@n``: the score of the first response whose final answer (its last number, else its
    text) the most give; meaningful where the last number is the answer."""
    n = scores.shape[1]
    metrics = {"eval/accuracy": scores.mean().item()}
    if n == 1:  # greedy: no pass@k or majority
        return metrics
    right = (scores == 1).sum(1).tolist()  # c of each question
    ks = [2**j for j in range(1, (n - 1).bit_length())] + [n]  # 2, 4, 8, ... < n, and n
    for k in ks:
        each = [1 - comb(n - c, k) / comb(n, k) for c in right]
        metrics[f"eval/pass@{k}"] = sum(each) / len(right)
    votes = [[final_answer(text) for text in responses] for responses in answers]
    top = [max(range(n), key=lambda i, v=v: v.count(v[i])) for v in votes]  # the first of the most
    questions = torch.arange(len(top))
    metrics[f"eval/maj@{n}"] = scores[questions, top].mean().item()
    return metrics
