"""Tasks, data and rewards: the built-in tasks (addition; multistep, with process supervision's
step rewards), JSON Lines data, answer checking, reward functions from files, scoring a batch,
prompts and the held-out accuracy. Model text is parsed, never evaluated. Bring your own task:
build a :class:`Task`, or run a JSONL file and reward file through the flags (examples/)."""

import contextlib
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
    return float(matches[-1].replace(",", "")) if matches else None


def number_matches(completion: str, example: dict) -> bool:
    """The last number of ``completion`` equals ``example["answer"]`` (within 1e-6): the built-in
    tasks' reward (1.0 or 0.0) and accuracy."""
    value = extract_final_number(completion)
    return value is not None and abs(value - float(example["answer"])) < 1e-6


def answer_text_matches(completion: str, example: dict) -> bool:
    """The completion matches ``example["answer"]``: as a number (:func:`number_matches`), else,
    case, spaces and ``.,;:!?"'`` aside, it ends with the answer at a word boundary ("Paris" matches
    "The capital is Paris.", not "Parisian")."""
    if _NUMBER.fullmatch(answer := str(example["answer"])):
        return number_matches(completion, {"answer": answer.replace(",", "")})
    strip = lambda text: " ".join(text.casefold().split()).strip(" .,;:!?\"'`")  # noqa: E731
    final, answer = strip(completion), strip(answer)
    return bool(answer) and re.search(rf"(^|\W){re.escape(answer)}$", final) is not None


# ---- data: generated tasks and JSON Lines files ------------------------------------------------
def _split(problems: list[dict], num_test: int, what: str) -> tuple[list[dict], list[dict]]:
    """(train, test), the first ``num_test`` held out; UsageError unless some are left to train."""
    message = f"--eval-size {num_test}: {what} has {len(problems)} problems; hold out fewer"
    check(num_test < len(problems), message)
    return problems[num_test:], problems[:num_test]


def make_addition_task(num_test: int = 128) -> Task:
    """8,100 problems "What is a + b?" for two-digit a and b, in a fixed shuffled order."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    problems = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]
    random.Random(SPLIT_SEED).shuffle(problems)
    split = _split(problems, num_test, "task 'addition'")
    return Task("addition", *split, number_matches, number_matches)


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
    prompt, answer = row.get(prompt_field), row.get(answer_field)
    if isinstance(answer, float | int) and not isinstance(answer, bool):
        answer = np.format_float_positional(answer, trim="-")  # 1e-07: "0.0000001"
    for value, field in ((prompt, prompt_field), (answer, answer_field)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"field {field!r}: expected text, got {json.dumps(value)[:40]}")
        check_text(value, f"field {field!r}")
    solution, gsm8k, final = answer.rpartition("####")  # GSM8K: "<solution> #### <answer>"
    if _NUMBER.fullmatch(final := final.strip()):
        final = final.replace(",", "")
    else:  # the caller adds FILE:LINE
        number = "a number such as 45, -3.5 or 1,234 (alone or after GSM8K's ####)"
        check(not numeric, f"answer {final[:60]!r} is not {number}; else use --reward-fn")
        check(re.search(r"\w", final), f"answer {final[:60]!r} has no word or number to compare")
    solution = {"solution": solution.strip()} if gsm8k else {}
    return {**row, "question": prompt, "answer": final, **solution}


def load_jsonl_task(path, num_test, prompt_field="question", answer_field="answer", numeric=True):
    """A JSON Lines file (GSM8K's by default): an example a line, ``{**row, "question": prompt,
    "answer": final}``; ``"... #### 45"`` gives ``final = "45"``, the text before as ``"solution"``.
    ``numeric``: answers are numbers (thousands separators dropped) and :func:`number_matches`
    checks them; else text, :func:`answer_text_matches`. UsageError: ``--dataset: FILE:LINE: ...``.
    """
    examples, fields = [], (prompt_field, answer_field, numeric)
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    if line.strip():
                        examples.append(_jsonl_example(line.removeprefix(b"\xef\xbb\xbf"), *fields))
                except (ValueError, UsageError) as e:
                    raise UsageError(f"--dataset: {path}:{lineno}: {e}") from None
    except OSError as e:
        raise UsageError(f"--dataset: cannot read {path}: {e.strerror}") from None
    random.Random(SPLIT_SEED).shuffle(examples)
    matches = number_matches if numeric else answer_text_matches
    return Task(Path(path).stem, *_split(examples, num_test, str(path)), matches, matches)


# ---- a multi-step task (process supervision's default steps: grpo_lm.py) --------------------
def make_multistep_task(num_test=128, num_problems=10_000) -> Task:
    """ "Compute (a + b) * c - d", one calculation a line (a, b, d in 1..20, c in 2..9), with the
    reference ``solution``; the final-number reward."""
    rng, problems = random.Random(SPLIT_SEED), {}  # by (a, b, c, d): no problem twice
    while len(problems) < num_problems:
        a, b, c, d = rng.randint(1, 20), rng.randint(1, 20), rng.randint(2, 9), rng.randint(1, 20)
        s, p = a + b, (a + b) * c
        question = f"Compute ({a} + {b}) * {c} - {d}. Write each calculation on its own line in the"
        question += " form x + y = z, and end with the result."
        solution = f"{a} + {b} = {s}\n{s} * {c} = {p}\n{p} - {d} = {p - d}"
        example = dict(question=question, answer=str(p - d), solution=solution)
        problems.setdefault((a, b, c, d), example)
    split = _split(list(problems.values()), num_test, "task 'multistep'")
    return Task("multistep", *split, number_matches, number_matches)


# ---- scoring a batch: the user's functions checked, one line per failure -----------------------
def _checked_scores(fn, what: str, texts: list[str], examples: list[dict], first=0, unit=False):
    """``float(fn(text, example))`` each; UsageError naming ``what`` and the index when ``fn``
    raises (or calls sys.exit), returns a non-number (bools count), one not finite in float32 or
    (``unit``) not in [0, 1]. Ctrl-C stays an interrupt."""
    expected = "True/False or a number in [0, 1]" if unit else "a finite number (float32)"
    scores = []
    for i, (text, example) in enumerate(zip(texts, examples, strict=True), first):
        where = f"on completion {i} ({text[:60]!r})"
        try:
            value = fn(text, example)
        except (Exception, SystemExit) as e:
            raise UsageError(f"{what} raised {type(e).__name__}: {e} {where}"[:400]) from None
        number = isinstance(value, numbers.Real | np.bool_)
        if not number or not abs(value) <= 3.4e38 or (unit and not 0 <= value <= 1):
            raise UsageError(f"{what} returned {str(value)[:40]} {where}; expected {expected}")
        scores.append(float(value))
    return scores


def score_task(task: Task, responses: list[str], examples: list[dict]) -> tuple[torch.Tensor, dict]:
    """(N,) float32 rewards: ``r_i = sum_k w_k * f_k(responses[i], examples[i])`` over the
    --reward-fn functions ``task.reward_fns`` (weights ``task.reward_weights``, None: 1 each), with
    each f_k's (N,) rewards by its name; else ``task.reward_fn``'s and {}. UsageError: a function
    fails (naming it and the completion's index), or the weighted sum overflows."""
    if not task.reward_fns:
        what = f"reward function of task {task.name!r}"
        return torch.tensor(_checked_scores(task.reward_fn, what, responses, examples)), {}
    weights, total, each = task.reward_weights or [1.0] * len(task.reward_fns), 0.0, {}
    for (name, fn), weight in zip(task.reward_fns, weights, strict=True):
        scores = _checked_scores(fn, f"reward function {name}", responses, examples)
        each[name], total = torch.tensor(scores), total + weight * np.array(scores)
    total = torch.tensor(total, dtype=torch.float32)
    check(total.isfinite().all(), "the weighted rewards overflow: lower --reward-weights")
    return total, each


def reward_model_scores(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,) float32 scores, differentiable, of a sequence classifier on (N, L) left-padded prompt +
    completion, pooled where its own forward pools (its last token that is not the pad token)."""
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    return out.logits[:, 0].float()


@torch.no_grad()
def score_with_reward_model(model, ids, mask, batch_size: int, device, bf16: bool) -> torch.Tensor:
    """A step's (N,) scores (:func:`reward_model_scores`) on the CPU, ``batch_size`` at a time."""
    with bf16_autocast(device, bf16):
        chunks = zip(ids.split(batch_size), mask.split(batch_size), strict=True)
        return torch.cat([reward_model_scores(model, i, m).cpu() for i, m in chunks])


def score_correct(task: Task, responses: list[str], examples: list[dict]) -> torch.Tensor:
    """(N,) float32 ``task.correct_fn``, 1.0 for right: the logged accuracy. UsageError: it fails"""
    what = f"correct_fn of task {task.name!r}"
    return torch.tensor(_checked_scores(task.correct_fn, what, responses, examples, unit=True))


def load_reward_fns(specs: list[str], own: RewardFn | None = None) -> list[tuple[str, RewardFn]]:
    """--reward-fn ``path/to/file.py:function_name`` specs as (log name, function) pairs, each file
    run once (:func:`runpy.run_path`), ``task``: ``own``; the log name is the function's, with
    ``_2``, ``_3``... when it repeats (``task`` counts). A function that does not take (completion,
    example) fails at its first call. UsageError naming the spec: a bad spec, file or function."""
    files, names, loaded = {}, [spec.rpartition(":")[2] for spec in specs], []
    for i, (spec, name) in enumerate(zip(specs, names, strict=True)):
        k = names[:i].count(name)
        label = f"{name}_{k + 1}" if k else name  # a name given again: name_2, name_3, ...
        if spec == "task":  # the task's own reward
            loaded.append((label, own))
            continue
        where, file = f"--reward-fn {spec}", spec.rpartition(":")[0]
        check(file.endswith(".py") and name.isidentifier(), f"{where}: expected FILE.py:NAME")
        try:
            files[file] = files.get(file) or runpy.run_path(file)
        except (Exception, SystemExit) as e:
            raise UsageError(f"{where}: cannot run {file}: {type(e).__name__}: {e}") from None
        check(callable(fn := files[file].get(name)), f"{where}: no function {name!r} in {file}")
        loaded.append((label, fn))
    return loaded


# ---- the scripts' task flags, prompts, the held-out accuracy -----------------------------------
def check_task_flags(reward_fns, weights, prompt_field, answer_field, system_prompt, prefix):
    """The flags of :func:`task_of` and the prompts, before any file is read. UsageError naming the
    flag: not one weight per function; ``task`` twice; a lone surrogate; one field for both."""
    counts = f"{len(weights)} weights for {len(reward_fns)} functions (--reward-fn)"
    check(len(weights) in (0, len(reward_fns)), f"--reward-weights: {counts}")
    check(list(reward_fns).count("task") <= 1, "--reward-fn task: given twice; give it once")
    for text, flag in ((system_prompt or "", "--system-prompt"), (prefix, "--response-prefix")):
        check_text(text, flag)
    check(prompt_field != answer_field, "--prompt-field and --answer-field must name two fields")


def task_of(name, dataset, prompt_field, answer_field, reward_fn, reward_weights, eval_size):
    """The task --task ``name``, or the JSONL file --dataset, with ``eval_size`` questions held
    out, scored by the --reward-fn functions weighted by --reward-weights if given (``task``: the
    task's own). UsageError: a bad dataset or reward file."""
    if dataset is not None:
        numeric = not reward_fn or "task" in reward_fn  # the built-in reward: numbers
        task = load_jsonl_task(dataset, eval_size, prompt_field, answer_field, numeric)
    else:
        task = (make_multistep_task if name == "multistep" else make_addition_task)(eval_size)
    if reward_fn:
        task.reward_fns = load_reward_fns(reward_fn, task.reward_fn)
        task.reward_weights = list(reward_weights) or None
    return task


def build_prompt(tokenizer, question: str, system_prompt: str | None = None, response_prefix=""):
    """The chat template's prompt (else ``"Question: {question}\\nAnswer:"``) + ``response_prefix``;
    ``system_prompt`` is the system message, or the user message's first paragraph without a
    template or with one that rejects or drops it."""
    if not getattr(tokenizer, "chat_template", None):
        system = f"{system_prompt}\n\n" if system_prompt else ""
        return f"{system}Question: {question}\nAnswer:{response_prefix}"
    template, kw = tokenizer.apply_chat_template, dict(tokenize=False, add_generation_prompt=True)
    messages = [{"role": "user", "content": question}]
    if system_prompt:
        with contextlib.suppress(Exception):  # a template without a system role: fall back
            text = template([{"role": "system", "content": system_prompt}, *messages], **kw)
            if system_prompt.strip() in text:
                return text + response_prefix
        messages = [{"role": "user", "content": f"{system_prompt}\n\n{question}"}]
    return template(messages, **kw) + response_prefix


def prompt_ids(tokenizer, questions: list[str], system_prompt=None, response_prefix=""):
    """The token ids of each question's :func:`build_prompt`, no special tokens added."""
    prompts = [build_prompt(tokenizer, q, system_prompt, response_prefix) for q in questions]
    return tokenizer(prompts, add_special_tokens=False)["input_ids"]


def training_questions(task, tokenizer, style, max_length, minimum, max_new_tokens, model):
    """The training examples whose prompts in the ``style`` (system prompt, response prefix) have
    at most ``max_length`` (--max-prompt-length) tokens. UsageError: fewer than ``minimum``
    (--prompts-per-step), or the longest prompt plus ``max_new_tokens`` beyond the positions of
    the model ``model`` (its ``max_position_embeddings``)."""
    questions = [example["question"] for example in task.train]
    lengths = [len(ids) for ids in prompt_ids(tokenizer, questions, *style)]
    train = [ex for ex, n in zip(task.train, lengths, strict=True) if n <= max_length]
    fit = f"--max-prompt-length {max_length}: {len(train)} training prompts fit"
    check(len(train) >= minimum, f"{fit} (of {len(task.train)}), fewer than --prompts-per-step")
    from transformers import AutoConfig  # the model's config alone: its positions

    config = AutoConfig.from_pretrained(resolve_model_path(model))
    positions = getattr(config, "max_position_embeddings", None)
    longest = max(n for n in lengths if n <= max_length)
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
    report = {k.removeprefix("eval/"): v for k, v in metrics.items()} | dict(first=completions[:5])
    report |= dict(questions=len(completions), checkpoint=checkpoint and checkpoint["step"])
    out.parent.mkdir(parents=True, exist_ok=True)  # a new run directory
    out.write_text(json.dumps(report))
    print(f"held-out {', '.join(f'{k[5:]} {v:.3f}' for k, v in metrics.items())}; written to {out}")
    return {key: [value] for key, value in metrics.items()}


def held_out_accuracy(policy, tokenizer, task, size, max_new_tokens, batch_size, style, bf16,
                      sampling=(1, 1.0, 1.0, 0)):  # fmt: skip
    """(:func:`sample_metrics`, each question's responses) of the first ``size`` held-out questions:
    prompts in the ``style`` (system prompt, response prefix) answered greedily, or with
    ``sampling`` = (n > 1, T, top_p, seed) n times, seeded per call of ``batch_size``; each
    response (prefix + completion) scored by ``task.correct_fn``. UsageError: as score_correct."""
    n, temperature, top_p, seed = sampling  # temperature 0: greedy; seeds apart from training's
    options, keys = (temperature if n > 1 else 0.0, top_p, max_new_tokens, bf16), (seed, 2**31)
    examples, what, scores, answers = task.test[:size], f"correct_fn of task {task.name!r}", [], []
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        prompts = prompt_ids(tokenizer, [ex["question"] for ex in batch], *style)
        new = common.generate_completions(policy, prompts, n, tokenizer, options, (keys, start))
        new = [style[1] + c for c in tokenizer.batch_decode(new, skip_special_tokens=True)]
        each = [ex for ex in batch for _ in range(n)]
        scores += _checked_scores(task.correct_fn, what, new, each, start * n, unit=True)
        answers += [new[i : i + n] for i in range(0, len(new), n)]  # question by question
    return sample_metrics(torch.tensor(scores).view(-1, n), answers), answers


def sample_metrics(scores: torch.Tensor, answers: list[list[str]]) -> dict[str, float]:
    """Metrics of n responses ``answers`` to each of Q questions, (Q, n) correct_fn ``scores`` in
    [0, 1] (right: 1): ``eval/accuracy`` (pass@1: the mean score; greedy if n = 1); for n > 1 the
    unbiased ``eval/pass@k`` (Chen et al. 2021, arXiv 2107.03374, eq. 1: ``1 - C(n - c, k) / C(n,
    k)``, c right responses, averaged over questions) for k = 2, 4, 8, ... < n and k = n, and
    ``eval/maj@n``: the score of the first response whose final answer (its last number, else its
    text) the most give; meaningful where the last number is the answer."""
    n, metrics = scores.shape[1], {"eval/accuracy": scores.mean().item()}
    right = (scores == 1).sum(1).tolist()  # c of each question
    for k in [2**j for j in range(1, (n - 1).bit_length())] + [n] * (n > 1):  # none if n = 1
        metrics[f"eval/pass@{k}"] = sum(1 - comb(n - c, k) / comb(n, k) for c in right) / len(right)
    votes = [[x if (x := extract_final_number(t)) is not None else t for t in a] for a in answers]
    top = [max(range(n), key=lambda i, v=v: v.count(v[i])) for v in votes]  # the first of the most
    majority = scores[torch.arange(len(top)), top].mean().item()
    return metrics | ({f"eval/maj@{n}": majority} if n > 1 else {})
