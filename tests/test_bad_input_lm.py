"""Bad input to grpo_lm.py and ppo_lm.py (and both under torchrun): one `error:` line naming the
flag or file, exit code 2, no traceback, and the checkpoint already on disk byte-identical
afterwards (issue 14).

The table runs in-process through each script's ``cli(argv)``, the function its ``__main__`` block
calls.
Stages: "cheap" cases must fail before the tokenizer or any model loads; "tokenizer" cases may read
the tokenizer, not a model; "model" cases may load models but not train; "run" cases stop mid-run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ROOT, assert_one_line_error, make_tiny_model, torchrun

import common
import grpo_lm
import ppo_lm

CHEAP, TOKENIZER, MODEL, RUN = "cheap", "tokenizer", "model", "run"
GPUS = f"--device: expected auto, cpu, or one of {torch.cuda.device_count()} GPUs"


@pytest.fixture(scope="module", autouse=True)
def one_thread_and_utf8_boxes():
    """One thread (~10x faster for the tiny model); tyro's error box drawn as in a UTF-8 terminal,
    which pytest's capture ("UTF-8", not "utf-8") is not to tyro (the ASCII box:
    test_common.py's test_parse_args_reads_tyros_ascii_box_too)."""
    import tyro

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tyro._fmtlib, "_FORCE_UTF8_BOXES", True)
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Tiny models, a finished 1-step run of each script, and files that are not what a flag
    expects."""
    root = tmp_path_factory.mktemp("bad_input_lm")
    model = make_tiny_model(root / "model")
    make_tiny_model(root / "rm", seed=1, kind="reward")
    from transformers import LlamaConfig, LlamaForSequenceClassification

    LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=10,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_labels=1,
            pad_token_id=1,
        )
    ).save_pretrained(root / "small_rm")
    (root / "junk.pt").write_bytes(b"not a checkpoint")
    (root / "binary.jsonl").write_bytes(bytes(range(256)) * 4)
    rows = [{"question": f"What is {i} + 1?", "answer": f"step #### {i + 1}"} for i in range(40)]
    lines = [json.dumps(r) for r in rows]
    (root / "bad_json.jsonl").write_text("\n".join(lines[:3] + ["{not json"] + lines[3:]) + "\n")
    (root / "dollars.jsonl").write_text(
        "\n".join(
            lines[:5] + [json.dumps({"question": "q", "answer": "#### 45 dollars"})] + lines[5:]
        )
        + "\n"
    )
    (root / "surrogate.jsonl").write_text(
        "\n".join(lines[:2] + ['{"question": "\\ud800", "answer": "#### 1"}'] + lines[2:]) + "\n"
    )
    (root / "short.jsonl").write_text("\n".join(lines[:3]) + "\n")
    (root / "rewards.py").write_text(
        "def length(completion, example):\n    return len(completion) / 10\n\n\n"
        "def ok(completion, example):\n    return 1.0\n\n\ndef raises(completion, example):\n"
        "    raise KeyError('score')\n\n\ndef text(completion, example):\n    return 'high'\n\n\n"
        "def nan(completion, example):\n    return float('nan')\n\n\n"
        "def huge(completion, example):\n    return 1e39\n\n\nnot_callable = 3\n\n\n"
        "def task(completion, example):\n    return 0.5\n"
    )
    (root / "syntax.py").write_text("def f(completion, example)\n    return 1\n")
    (root / "eval_big.jsonl").write_text("\n".join(lines) + "\n")
    for script, module in (
        ("grpo", grpo_lm),
        ("ppo", ppo_lm),
    ):  # healthy runs: their checkpoints must survive the table
        module.cli(
            [
                *BASE[script],
                "--model-name-or-path",
                str(model),
                "--runs-dir",
                str(root / "runs"),
                "--run-name",
                script,
                "--total-steps",
                "2",
                "--save-every",
                "1",
                "--reward-fn",
                str(root / "rewards.py:length"),
                "--learning-rate",
                "0.01",
            ]
        )  # rewards that differ: the policy moves away from its reference
        healthy = common.load_checkpoint(root / "runs" / script / "checkpoint.pt")
        common.atomic_save(
            {**healthy, "args": {**healthy["args"], "tis_cap": 2.0}},
            root / f"{script}_removed_flag.pt",
        )
        key = next(k for k in healthy["policy"] if k.endswith("q_proj.weight"))
        torch.save(
            {
                **healthy,
                "policy": {
                    **healthy["policy"],
                    key: torch.full_like(healthy["policy"][key], float("nan")),
                },
            },
            root / f"{script}_nan.pt",
        )  # what a diverged run saved before checkpoints refused non-finite values
    return {"root": root, "model": model}


BASE = {
    "grpo": [
        "--total-steps",
        "1",
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "4",
        "--eval-size",
        "2",
        "--eval-every",
        "0",
        "--sample-every",
        "0",
        "--micro-batch-size",
        "4",
    ],
    "ppo": [
        "--total-steps",
        "1",
        "--prompts-per-step",
        "4",
        "--num-minibatches",
        "2",
        "--max-new-tokens",
        "4",
        "--eval-size",
        "2",
        "--eval-every",
        "0",
        "--sample-every",
        "0",
        "--micro-batch-size",
        "4",
    ],
}

REMOVED = (  # flags of earlier versions (issue 39): an old command line is one line too
    ["--fast-generation"],
    ["--tis-cap", "2"],
    ["--format-reward", "0.1"],
    ["--answer-format", "think"],
    ["--no-share-prompt"],
    ["--wandb-project-name", "p"],
    ["--wandb-entity", "e"],
    ["--exp-name", "x"],
    ["--adv-eps", "1e-4"],  # 2026-11-27: fixed at 1e-4 (TRL's)
    ["--torch-threads", "1"],
    ["--lora-dropout", "0.05"],
)
# the removed flags that one script never had
REMOVED_FROM = {"--no-share-prompt": "grpo"}

SHARED = [  # (argv, text the error line must contain, stage), for both scripts
    (["--seed", "abc"], "--seed: invalid literal for int()", CHEAP),
    (["--seed", "-1"], "--seed: must be greater than or equal to 0, got -1", CHEAP),
    (["--seed", "4294967296"], "--seed: must be less than or equal to 4294967295", CHEAP),
    (["--learning-rate", "inf"], "--learning-rate: must be a finite number", CHEAP),
    (["--learning-rate", "nan"], "--learning-rate: must be a finite number", CHEAP),
    (["--learning-rate", "0"], "--learning-rate: must be greater than 0, got 0.0", CHEAP),
    (["--learning-rate", "1e5"], "--learning-rate: must be less than 1, got 100000.0", CHEAP),
    (["--weight-decay", "-1"], "--weight-decay: must be greater than or equal to 0", CHEAP),
    (["--weight-decay", "nan"], "--weight-decay: must be a finite number", CHEAP),
    (["--max-grad-norm", "-1"], "--max-grad-norm: must be greater than 0", CHEAP),
    (["--max-grad-norm", "nan"], "--max-grad-norm: must be a finite number", CHEAP),
    (["--device", "foo"], GPUS, CHEAP),
    (["--device", "cuda:99"], "--device: expected auto, cpu, or one of ", CHEAP),
    (["--device", "cuda"], GPUS, CHEAP),  # no GPU (skipped where one is visible)
    (["--temperature", "0"], "--temperature: must be greater than or equal to 0.001", CHEAP),
    (["--temperature", "nan"], "--temperature: must be a finite number", CHEAP),
    (["--temperature", "1e-40"], "--temperature: must be greater than or equal to 0.001", CHEAP),
    (["--top-p", "1.5"], "--top-p: must be less than or equal to 1", CHEAP),
    (["--beta", "-0.1"], "--beta: must be greater than or equal to 0", CHEAP),
    (["--beta", "inf"], "--beta: must be a finite number", CHEAP),
    (["--clip-range", "1.5"], "--clip-range: must be less than 1", CHEAP),
    (["--max-new-tokens", "0"], "--max-new-tokens: must be greater than or equal to 1", CHEAP),
    (["--micro-batch-size", "0"], "--micro-batch-size: must be greater than or equal to 1", CHEAP),
    (["--eval-size", "-1"], "--eval-size: must be greater than or equal to 0", CHEAP),
    (["--eval-samples", "0"], "--eval-samples: must be greater than or equal to 1", CHEAP),
    (
        ["--task", "nope"],
        "invalid choice 'nope' for argument '--task'. Expected one of ('addition', 'multistep')",
        CHEAP,
    ),
    (["--task", "countdown"], "invalid choice 'countdown' for argument '--task'", CHEAP),
    (["--kl-estimator", "k4"], "invalid choice 'k4' for argument '--kl-estimator'", CHEAP),
    (["--entropy-coef", "-0.01"], "--entropy-coef: must be greater than or equal to 0", CHEAP),
    (["--no-such-flag"], "Unrecognized options: --no-such-flag", CHEAP),
    *[(argv, f"Unrecognized options: {argv[0]}", CHEAP) for argv in REMOVED],
    (["--runs-dir", "{root}/rewards.py"], "--runs-dir: {root}/rewards.py is a file", CHEAP),
    (
        ["--model-name-or-path", "./no/such/model"],
        "--model-name-or-path: no directory ./no/such/model",
        CHEAP,
    ),
    (["--dataset", "{root}/missing.jsonl"], "--dataset: cannot read", CHEAP),
    (
        ["--dataset", "{root}/binary.jsonl"],
        "binary.jsonl:1: Expecting value: line 1 column 1",
        CHEAP,
    ),
    (
        ["--dataset", "{root}/bad_json.jsonl"],
        "bad_json.jsonl:4: Expecting property name enclosed in double quotes",
        CHEAP,
    ),
    (["--dataset", "{root}/dollars.jsonl"], "dollars.jsonl:6: answer '45 dollars'", CHEAP),
    (["--dataset", "{root}/surrogate.jsonl"], "surrogate.jsonl:3: field 'question'", CHEAP),
    (
        ["--dataset", "{root}/short.jsonl"],
        "1 training prompts fit (of 1), fewer than --prompts-per-step",
        TOKENIZER,
    ),
    (
        ["--dataset", "{root}/eval_big.jsonl", "--eval-size", "40"],
        "--eval-size 40: {root}/eval_big.jsonl has 40",
        CHEAP,
    ),
    (["--eval-size", "8100"], "--eval-size 8100: task 'addition' has 8100 problems", CHEAP),
    (["--resume", "{root}/nothing.pt"], "--resume: checkpoint file", CHEAP),
    (["--resume", "{root}/junk.pt"], "--resume: cannot read {root}/junk.pt: ", CHEAP),
    (["--resume", "{root}"], "--resume: checkpoint file {root} does not exist", CHEAP),
    (
        ["--resume", "{ckpt}", "--model-name-or-path", "{root}/rm"],
        "--model-name-or-path: cannot change when resuming",
        CHEAP,
    ),
    (["--lora-rank", "-1"], "--lora-rank: must be greater than or equal to 0", CHEAP),
    (["--fsdp"], "--fsdp: run it under torchrun, without --lora-rank", CHEAP),
    (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha: must be greater than 0", CHEAP),
    (
        ["--lora-rank", "4", "--lora-target-modules", "no_such_proj"],
        "--lora-target-modules: 'no_such_proj' matches no",
        MODEL,
    ),
    (["--resume", "{ckpt}", "--lora-rank", "4"], "--lora-rank: cannot change when resuming", CHEAP),
    (["--eval-only", "--eval-size", "0"], "--eval-only needs --eval-size > 0", CHEAP),
    (
        ["--reward-fn", "{root}/missing.py:f"],
        "--reward-fn {root}/missing.py:f: cannot run {root}/missing.py: FileNotFoundError",
        CHEAP,
    ),
    (
        ["--reward-fn", "{root}/rewards.py:nope"],
        "--reward-fn {root}/rewards.py:nope: no function 'nope'",
        CHEAP,
    ),
    (
        ["--reward-fn", "{root}/rewards.py:not_callable"],
        "--reward-fn {root}/rewards.py:not_callable: no function 'not_callable'",
        CHEAP,
    ),
    (["--reward-fn", "{root}/syntax.py:f"], "SyntaxError", CHEAP),
    (
        ["--reward-fn", "rewards_without_function"],
        "--reward-fn rewards_without_function: expected FILE.py:NAME",
        CHEAP,
    ),
    (
        ["--reward-fn", "{root}/rewards.py:ok", "--reward-weights", "1", "2"],
        "--reward-weights: 2 weights for 1",
        CHEAP,
    ),
    (
        ["--reward-fn", "{root}/rewards.py:ok", "--reward-weights", "nan"],
        "--reward-weights: must be a finite number",
        CHEAP,
    ),
    (
        ["--reward-fn", "{root}/rewards.py:raises"],
        "reward function raises raised KeyError: 'score' on completion 0",
        RUN,
    ),
    (["--reward-fn", "{root}/rewards.py:text"], "reward function text returned high", RUN),
    (["--reward-fn", "{root}/rewards.py:nan"], "reward function nan returned nan", RUN),
    (["--reward-fn", "{root}/rewards.py:huge"], "reward function huge returned 1e+39", RUN),
    (["--reward-fn", "task", "--reward-fn", "task"], "--reward-fn task: given twice", CHEAP),
    (
        ["--correct-fn", "{root}/missing.py:f"],
        "--correct-fn {root}/missing.py:f: cannot run {root}/missing.py: FileNotFoundError",
        CHEAP,
    ),
    (["--correct-fn", "rewards.py"], "--correct-fn rewards.py: expected FILE.py:NAME", CHEAP),
    (
        ["--correct-fn", "{root}/rewards.py:nope"],
        "--correct-fn {root}/rewards.py:nope: no function 'nope' in {root}/rewards.py",
        CHEAP,
    ),
    (["--eval-dataset", "{root}/missing.jsonl"], "--eval-dataset: cannot read", CHEAP),
    (
        ["--eval-dataset", "{root}/bad_json.jsonl"],
        "--eval-dataset: {root}/bad_json.jsonl:4: Expecting property name",
        CHEAP,
    ),
    (["--system-prompt", "a \ud800 b"], "--system-prompt: a lone surrogate at character 3", CHEAP),
    (["--response-prefix", "\udfff"], "--response-prefix: a lone surrogate at character 1", CHEAP),
    (["--prompt-field", "answer"], "--prompt-field and --answer-field must name two fields", CHEAP),
    (
        ["--dataset", "{root}/eval_big.jsonl", "--prompt-field", "nope"],
        "eval_big.jsonl:1: field 'nope': expected text, got null",
        CHEAP,
    ),
    (  # the other script's: flags this script lacks
        ["--resume", "{other}"],
        "--resume: not a {script}_lm.py checkpoint of this version: Args.__init__() got an "
        "unexpected keyword argument",
        CHEAP,
    ),
    (
        ["--max-prompt-length", "1"],
        "--max-prompt-length 1: 0 training prompts fit (of 8098), fewer than --prompts-per-step",
        TOKENIZER,
    ),
    (  # the tiny model has 256 positions: a prompt plus 100000 tokens cannot fit (issue 39)
        ["--max-new-tokens", "100000"],
        "--max-new-tokens 100000: with the longest prompt (",
        TOKENIZER,
    ),
    (
        ["--reward-model-path", "{model}"],
        "--reward-model-path: {model} has no trained score",
        MODEL,
    ),
    (
        ["--reward-model-path", "{root}/small_rm"],
        "--reward-model-path: its vocabulary is smaller than the policy's tokenizer's (76)",
        MODEL,
    ),
    (["--reward-model-path", "{root}/no_rm"], "--reward-model-path: no directory", CHEAP),
    (
        ["--track"],
        "--track: wandb failed: ",
        RUN,
    ),  # no WANDB_* variable, netrc or settings: wandb refuses
    (
        ["--resume", "{ckpt}"],
        "--total-steps: at step 2; pass more to train further, or --eval-only to evaluate it",
        CHEAP,
    ),
    (["--resume", "{ckpt}", "--total-steps", "2"], "--total-steps: at step 2; pass more", CHEAP),
    (
        ["--resume", "{root}/{script}_removed_flag.pt", "--total-steps", "4"],
        "--resume: not a {script}_lm.py checkpoint of this version: Args.__init__() got an "
        "unexpected keyword argument 'tis_cap'",
        CHEAP,
    ),
    (["--resume", ""], "--resume: checkpoint file  does not exist", CHEAP),
    (["--save-every", "-1"], "--save-every: must be greater than or equal to 0", CHEAP),
    (["--eval-every", "-3"], "--eval-every: must be greater than or equal to 0", CHEAP),
    (["--sample-every", "-1"], "--sample-every: must be greater than or equal to 0", CHEAP),
    (
        ["--resume", "{ckpt}", "--total-steps", "4", "--runs-dir", "{root}/elsewhere"],
        "--runs-dir: cannot change when resuming",
        CHEAP,
    ),
    (
        ["--resume", "{ckpt}", "--total-steps", "4", "--run-name", "zzz"],
        "--run-name: cannot change when resuming",
        CHEAP,
    ),
    (
        ["--runs-dir", "{root}/runs", "--run-name", "{script}"],
        "{root}/runs/{script} holds a checkpoint: resume it with --resume, or pick another "
        "--run-name",
        CHEAP,
    ),
    (  # the weights of a checkpoint written before checkpoints refused non-finite values
        ["--resume", "{root}/{script}_nan.pt", "--total-steps", "4"],
        "--resume: {root}/{script}_nan.pt: policy.",
        CHEAP,
    ),
    (
        ["--resume", "{root}/{script}_nan.pt", "--eval-only"],
        "--resume: {root}/{script}_nan.pt: policy.",
        CHEAP,
    ),
    (
        ["--lora-rank", "4", "--lora-target-modules", "q_proj", "nonsense"],
        "--lora-target-modules: 'nonsense' matches no module",
        MODEL,
    ),
    (
        ["--lora-rank", "4", "--lora-target-modules", "all-linear", "q_proj"],
        "--lora-target-modules: 'all-linear'",
        CHEAP,
    ),
    (
        ["--resume", "{ckpt}", "--total-steps", "4", "--eval-size", "3"],
        "--eval-size: cannot change when resuming (it was 2)",
        CHEAP,
    ),
    (
        ["--resume", "{ckpt}", "--eval-only", "--eval-size", "3"],
        "--eval-size: cannot change when resuming (it was 2)",
        CHEAP,
    ),
]

GRPO = [
    (["--group-size", "1"], "--group-size: must be greater than or equal to 2", CHEAP),
    (
        ["--advantage", "reinforce++", "--scale-rewards", "group"],
        "--scale-rewards group: not with --advantage reinforce++ (its batch-centred rewards)",
        CHEAP,
    ),
    (["--loss-type", "ppo"], "invalid choice 'ppo' for argument '--loss-type'", CHEAP),
    (["--scale-rewards", "std"], "invalid choice 'std' for argument '--scale-rewards'", CHEAP),
    (["--advantage", "ppo"], "invalid choice 'ppo' for argument '--advantage'", CHEAP),
    (["--supervision", "steps"], "invalid choice 'steps' for argument '--supervision'", CHEAP),
    (
        ["--importance-sampling-level", "seq"],
        "invalid choice 'seq' for argument '--importance-sampling-level'",
        CHEAP,
    ),
    (
        ["--iterations", "7", "--total-steps", "30"],
        "--iterations 7 must divide --total-steps 30",
        CHEAP,
    ),
    (["--overlong-buffer", "4"], "--overlong-buffer: below --max-new-tokens", CHEAP),
    (["--rm-replay-ratio", "1.0"], "--rm-replay-ratio: must be less than 1", CHEAP),
    (["--clip-range-high", "0"], "--clip-range-high: must be greater than 0", CHEAP),
    (
        ["--max-sampling-rounds", "0"],
        "--max-sampling-rounds: must be greater than or equal to 1",
        CHEAP,
    ),
    (["--rm-learning-rate", "-1"], "--rm-learning-rate: must be greater than 0", CHEAP),
    (
        ["--train-reward-model"],
        "--train-reward-model without --reward-model-path needs --iterations >= 2",
        CHEAP,
    ),
    (["--use-vllm"], "Unrecognized options: --use-vllm", CHEAP),  # removed
    (["--share-prompt"], "Unrecognized options: --share-prompt", CHEAP),  # removed (issue 39)
    (
        ["--resume", "{ckpt}", "--group-size", "4"],
        "--group-size: cannot change when resuming",
        CHEAP,
    ),
    (
        ["--resume", "{ckpt}", "--total-steps", "5", "--iterations", "5"],
        "--total-steps: this run's iterations have 2 steps; resume with that length",
        CHEAP,
    ),
    (
        ["--resume", "{ckpt}", "--beta", "1e38", "--total-steps", "4"],
        "non-finite gradient norm at step 3 (not applied)",
        RUN,
    ),
    (  # on the CPU, where step 1's KL is exactly 0 (on CUDA ~1e-10, whose 1e38-fold gradient
        # already overflows: step 1)
        ["--beta", "1e38", "--reward-fn", "{root}/rewards.py:length", "--total-steps", "3"]
        + ["--device", "cpu"],
        "non-finite gradient norm at step 2 (not applied)",
        RUN,
    ),
    (
        ["--lora-rank", "4", "--iterations", "2", "--total-steps", "2"],
        "--lora-rank needs --iterations 1",
        CHEAP,
    ),
    (
        ["--vllm-gpu-memory-utilization", "0.5"],
        "Unrecognized options: --vllm-gpu-memory-utilization",
        CHEAP,
    ),
    (
        ["--reward-fn", "{root}/rewards.py:ok", "--reward-model-path", "{root}/rm"],
        "--reward-fn and a frozen --reward-model-path are two rewards: pick one",
        CHEAP,
    ),
    (["--tool", "calc"], "--tool calc: expected FILE.py:NAME", CHEAP),
    (
        ["--tool", "{root}/missing.py:f"],
        "--tool {root}/missing.py:f: cannot run {root}/missing.py: FileNotFoundError",
        CHEAP,
    ),
    (["--tool", "{root}/rewards.py:nope"], "--tool {root}/rewards.py:nope: no function", CHEAP),
    (["--tool-markers", "", "="], "--tool-markers: String should have at least 1 character", CHEAP),
    (["--max-tool-tokens", "0"], "--max-tool-tokens: must be greater than or equal to 1", CHEAP),
]

PPO = [
    (["--tool", "calculator"], "--tool: not in ppo_lm.py (GAE over a tool's tokens", CHEAP),
    (
        ["--num-minibatches", "3"],
        "--prompts-per-step 4 must be divisible by --num-minibatches 3",
        CHEAP,
    ),
    (["--gamma", "1.5"], "--gamma: must be less than or equal to 1", CHEAP),
    (["--lam", "nan"], "--lam: must be a finite number", CHEAP),
    (["--vf-coef", "-1"], "--vf-coef: must be greater than 0", CHEAP),
    (["--adam-eps", "-1"], "--adam-eps: must be greater than 0", CHEAP),
    (["--adam-eps", "nan"], "--adam-eps: must be a finite number", CHEAP),
    (["--missing-eos-penalty", "-1"], "--missing-eos-penalty: must be greater than or", CHEAP),
    (["--missing-eos-penalty", "nan"], "--missing-eos-penalty: must be a finite number", CHEAP),
    (["--adaptive-kl-target", "6", "--beta", "0"], "--adaptive-kl-target needs --beta > 0", CHEAP),
    (["--value-learning-rate", "inf"], "--value-learning-rate: must be a finite number", CHEAP),
    (["--value-learning-rate", "2"], "--value-learning-rate: must be less than 1", CHEAP),
    (
        ["--missing-eos-penalty", "1e38", "--total-steps", "3"],
        "non-finite gradient norm at step 1 (not applied)",
        RUN,
    ),
    (
        ["--resume", "{ckpt}", "--missing-eos-penalty", "1e38", "--total-steps", "4"],
        "non-finite gradient norm at step 3 (not applied)",
        RUN,
    ),
    (
        ["--beta", "1e38", "--reward-fn", "{root}/rewards.py:length", "--total-steps", "3"],
        "non-finite gradient norm at step 2 (not applied)",
        RUN,
    ),
    (
        ["--reward-fn", "{root}/rewards.py:ok", "--reward-model-path", "{root}/rm"],
        "--reward-fn and --reward-model-path are two rewards: pick one",
        CHEAP,
    ),
]

CASES = [
    pytest.param(script, *c, id=f"{script}:{' '.join(c[0])}")
    for script, rows in (("grpo", SHARED + GRPO), ("ppo", SHARED + PPO))
    for c in rows
    if REMOVED_FROM.get(c[0][0], script) == script
]


def _subs(script: str, files: dict[str, Path]) -> dict[str, str]:
    root, other = files["root"], "ppo" if script == "grpo" else "grpo"
    return {
        "{ckpt}": str(root / "runs" / script / "checkpoint.pt"),
        "{other}": str(root / "runs" / other / "checkpoint.pt"),
        "{root}": str(root),
        "{model}": str(files["model"]),
        "{script}": script,
    }


def _argv(script: str, argv: list[str], files: dict[str, Path]) -> list[str]:
    root, out = files["root"], []
    for a in argv:
        for key, value in _subs(script, files).items():
            a = a.replace(key, value)
        out.append(a)
    resume = "--resume" in out
    run = [] if resume else ["--runs-dir", str(root / "runs_new"), "--run-name", "case"]
    base = ["--model-name-or-path", str(files["model"])] + BASE[script]
    return base + run + out


@pytest.mark.parametrize("script, argv, message, stage", CASES)
def test_bad_input_is_one_line_and_leaves_the_checkpoint_intact(
    script, argv, message, stage, *, files, capsys, monkeypatch, request
):
    if argv == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("a GPU is visible: --device cuda is good input here")
    if "--track" in argv:
        request.getfixturevalue(
            "no_wandb_login"
        )  # no credentials, nothing read from the user's home
    module = grpo_lm if script == "grpo" else ppo_lm
    for key, value in _subs(script, files).items():
        message = message.replace(key, value)
    ckpt = files["root"] / "runs" / script / "checkpoint.pt"

    def too_early(*args, **kwargs):
        raise AssertionError(f"{stage} case loaded a tokenizer or model before failing")

    if stage == CHEAP:
        monkeypatch.setattr(common, "load_tokenizer", too_early)
    if stage in (CHEAP, TOKENIZER):
        for name in ("load_model", "load_reward_model"):
            monkeypatch.setattr(common, name, too_early)
    monkeypatch.chdir(files["root"])  # a run that wrongly starts writes under the test's directory
    assert_one_line_error(
        module.cli,
        _argv(script, argv, files),
        message,
        capsys,
        checkpoint=ckpt,
        cleanup=lambda: shutil.rmtree(files["root"] / "runs_new", ignore_errors=True),
    )  # no run left


def test_the_table_is_large():
    assert len(CASES) >= 100


@pytest.mark.parametrize("script", ["grpo_lm.py", "ppo_lm.py"])
@pytest.mark.parametrize(
    "argv, messages",
    [
        (["--seed", "-1"], dict.fromkeys(("grpo", "ppo"), "--seed: must be greater than or equal")),
        (
            ["--prompts-per-step", "3"],
            dict(
                grpo="--prompts-per-step must be divisible by the 2 torchrun processes",
                ppo="--prompts-per-step 3 must be divisible by the world size 2",
            ),
        ),
    ],
)
def test_torchrun_every_rank_stops_with_one_line(script, argv, messages, tmp_path):
    # every process finds the error before joining the process group and prints its own line (rank
    # r > 0 says so); torchrun then ends the others and reports the failed processes with its own
    # launcher's traceback, none from our files
    out = torchrun(script, ["--device", "cpu", *argv], cwd=tmp_path)
    err = out.stdout + out.stderr
    message = messages[script.split("_")[0]]
    lines = [line for line in err.splitlines() if "error:" in line]
    assert out.returncode != 0 and lines, err[-3000:]
    for line in lines:  # rank 0's line, then perhaps rank 1's, "(rank 1)" appended
        assert line.startswith("error: ") and message in line, err[-3000:]
    assert f"{script} FAILED" in err  # torchrun's own report
    assert not any(
        f'File "{ROOT / name}"' in err for name in ("grpo_lm.py", "ppo_lm.py", "common.py")
    )
