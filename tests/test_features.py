"""What users reach for next (issue 16), wired into the LM scripts: their own reward functions from
the command line, a system prompt and a response prefix, their own JSONL data. (Countdown and the
think/answer format: examples/, tests/test_examples.py.)"""

import json

import pytest
from test_grpo_lm import tiny_args

import common
import grpo_lm

REWARDS = """
def digits(completion, example):
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def starts_with_prefix(completion, example):
    return completion.startswith("<think>")  # a bool is a number: True is 1.0


def answer_length(completion, example):
    return float(len(example["answer"]))
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def test_weighted_reward_functions_are_summed_and_each_is_logged(
    tiny_model_dir, tmp_path, reward_file
):
    h = grpo_lm.main(
        tiny_args(
            tiny_model_dir,
            tmp_path,
            total_steps=2,
            reward_fn=[f"{reward_file}:digits", f"{reward_file}:answer_length"],
            reward_weights=[1.0, 0.5],
        )
    )
    for step in range(2):
        total = h["reward/digits/mean"][step] + 0.5 * h["reward/answer_length/mean"][step]
        assert h["reward/mean"][step] == pytest.approx(total, rel=1e-6)
    assert 2 <= h["reward/answer_length/mean"][0] <= 3  # addition answers have 2 or 3 digits
    assert 0 < h["reward/digits/mean"][0] < 1


def test_the_task_spec_is_the_tasks_own_reward(tiny_model_dir, tmp_path, reward_file):
    plain = grpo_lm.main(tiny_args(tiny_model_dir, tmp_path / "a", total_steps=1))
    mixed = grpo_lm.main(
        tiny_args(
            tiny_model_dir,
            tmp_path / "b",
            total_steps=1,
            reward_fn=["task", f"{reward_file}:answer_length"],
            reward_weights=[1.0, 0.0],
        )
    )
    assert mixed["reward/task/mean"] == plain["reward/mean"] == mixed["reward/mean"]


def test_reward_functions_read_the_response_prefix(tiny_model_dir, tmp_path, reward_file):
    # --response-prefix is written for the model; the reward functions see it + the completion
    h = grpo_lm.main(
        tiny_args(
            tiny_model_dir,
            tmp_path,
            total_steps=1,
            response_prefix="<think>",
            system_prompt="Think first.",
            reward_fn=[f"{reward_file}:starts_with_prefix"],
        )
    )
    assert h["reward/mean"] == [1.0] and h["reward/starts_with_prefix/mean"] == [1.0]


def test_own_jsonl_data_with_other_field_names(tiny_model_dir, tmp_path, reward_file):
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps({"q": f"{a} and {b}?", "a": "yes" if a > b else "no"}) + "\n"
            for a in range(6)
            for b in range(6)
        )
    )
    h = grpo_lm.main(
        tiny_args(
            tiny_model_dir,
            tmp_path,
            total_steps=1,
            dataset=str(data),
            prompt_field="q",
            answer_field="a",
            reward_fn=[f"{reward_file}:answer_length"],
        )
    )
    assert (
        2 <= h["reward/mean"][0] <= 3 and "eval/accuracy" in h
    )  # "no" and "yes"; text answers checked as text
    with pytest.raises(
        common.UsageError, match=r"data.jsonl:1: answer 'no' is not a number"
    ):  # the built-in reward
        grpo_lm.main(
            tiny_args(
                tiny_model_dir,
                tmp_path,
                total_steps=1,
                dataset=str(data),
                prompt_field="q",
                answer_field="a",
                run_name="builtin",
            )
        )  # a run of its own: "run" holds the first one's checkpoint


# ---------------------------------------------------------------------------------------------
# ppo_lm: the same flags
# ---------------------------------------------------------------------------------------------
def ppo_args(model_dir, tmp_path, **kw):
    from test_ppo_lm import tiny_args as ppo_tiny_args

    return ppo_tiny_args(model_dir, tmp_path, **kw)


def test_ppo_weighted_reward_functions(tiny_model_dir, tmp_path, reward_file):
    import ppo_lm

    h = ppo_lm.main(
        ppo_args(
            tiny_model_dir,
            tmp_path,
            total_steps=1,
            reward_fn=[f"{reward_file}:digits", f"{reward_file}:answer_length"],
            reward_weights=[2.0, 1.0],
        )
    )
    total = 2 * h["reward/digits/mean"][0] + h["reward/answer_length/mean"][0]
    assert (
        h["reward/mean"][0] == pytest.approx(total, rel=1e-6)
        and 2 <= h["reward/answer_length/mean"][0] <= 3
    )


def test_eval_only_in_ppo_scores_a_checkpoint_and_a_final_model(
    tiny_model_dir, tmp_path, monkeypatch
):
    # as grpo's test: --eval-only from checkpoint.pt and from final_model gives the last accuracy
    # training logged, and scores the trained weights, not the untrained model's (which the
    # accuracy need not tell apart: it moved 0 -> 1 on the CPU, stayed 0 on an H100)
    import torch
    from test_grpo_lm import digit_task

    import ppo_lm
    import tasks

    scored = []  # the weights of each model whose held-out accuracy was measured
    greedy = tasks.held_out_accuracy

    def spy(policy, *args, **kwargs):
        scored.append(torch.cat([p.detach().cpu().flatten() for p in policy.parameters()]))
        return greedy(policy, *args, **kwargs)

    monkeypatch.setattr(tasks, "held_out_accuracy", spy)

    task = digit_task()
    task.correct_fn = lambda completion, example: (
        sum(c.isdigit() for c in completion) >= 3
    )  # what the reward teaches
    kw = dict(total_steps=2, eval_size=8, beta=0.01, eval_samples=3)  # sampled: pass@k, maj@n too
    trained = ppo_lm.main(ppo_args(tiny_model_dir, tmp_path, **kw), task=task)
    run = tmp_path / "run"
    from_ckpt = ppo_lm.main(
        ppo_args(tiny_model_dir, tmp_path, eval_only=True, resume=str(run / "checkpoint.pt"), **kw),
        task=task,
    )
    from_model = ppo_lm.main(
        ppo_args(
            run / "final_model",
            tmp_path,
            eval_size=8,
            eval_samples=3,
            eval_only=True,
            run_name="eval",
        ),
        task=task,
    )
    for key in ("eval/accuracy", "eval/pass@2", "eval/pass@3", "eval/maj@3"):  # seeded samples
        assert from_ckpt[key] == from_model[key] == trained[key][-1:], key
    last = trained["eval/accuracy"][-1:]
    assert json.loads((run / "eval_step2.json").read_text())["accuracy"] == last[0]
    assert (tmp_path / "eval" / "eval.json").is_file()
    initial, final, *evaluated = scored  # training's steps 0 and 2, then the two --eval-only runs
    assert len(evaluated) == 2 and all(torch.equal(w, final) for w in evaluated)
    assert not torch.equal(initial, final)  # training moved the weights: a real comparison


def test_ppo_track_writes_an_offline_wandb_run(
    tiny_model_dir, tmp_path, monkeypatch, no_wandb_login
):
    # --track in ppo_lm, as in grpo_lm: the config and the synced TensorBoard scalars in wandb's
    # offline run
    from test_grpo_lm import digit_task

    import ppo_lm

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "tests-project")
    ppo_lm.main(ppo_args(tiny_model_dir, tmp_path, total_steps=1, track=True), task=digit_task())
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    record = runs[0].read_bytes()  # wandb's own log
    assert b"num_ppo_epochs" in record  # the config
    logs = (runs[0].parent / "logs" / "debug.log").read_text()
    assert "finishing run tests-project/run" in logs
    # the synced TensorBoard scalars: test_grpo_lm.py's test_track_syncs_the_tensorboard_scalars


# ----------------------------------------------------------------------------------------------
# What counts as right (--correct-fn) and a held-out file of its own (--eval-dataset)
# ----------------------------------------------------------------------------------------------
VERIFIER = """def right_if_held_out(response, example):
    return 1.0 if example["question"].startswith("Held out") else 0.5
"""


@pytest.mark.parametrize("script", ["grpo_lm", "ppo_lm"])
def test_correct_fn_and_eval_dataset_decide_both_accuracies(
    script, tiny_model_dir, tmp_path, reward_file
):
    module = __import__(script)
    make_args = tiny_args if script == "grpo_lm" else ppo_args
    verifier = tmp_path / "verifier.py"
    verifier.write_text(VERIFIER)
    held_out = tmp_path / "test.jsonl"
    rows = [{"question": f"Held out: what is {i} + 6?", "answer": str(i + 6)} for i in range(4)]
    held_out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = dict(
        correct_fn=f"{verifier}:right_if_held_out",
        eval_dataset=str(held_out),
        eval_size=3,
        reward_fn=[f"{reward_file}:answer_length"],
    )
    small = dict(total_steps=1, prompts_per_step=4, max_new_tokens=4, micro_batch_size=4)
    if script == "grpo_lm":
        small |= dict(group_size=2)
    h = module.main(make_args(tiny_model_dir, tmp_path, **small, **flags))
    assert h["eval/accuracy"] == [1.0, 1.0]  # at the start and the end: the file's questions
    assert h["reward/accuracy"] == [0.5]  # the training questions, judged by --correct-fn too
    assert h["eval/reward_mean"] == [1.0, 1.0]  # the reward on them: answer_length, 1 digit each
    # both change what accuracy means: a resumed run keeps them
    resume = dict(resume=str(tmp_path / "run" / "checkpoint.pt"), total_steps=2)
    for flag in ("correct_fn", "eval_dataset"):
        cli_flag = "--" + flag.replace("_", "-")
        with pytest.raises(common.UsageError, match=rf"^{cli_flag}: cannot change when resuming"):
            module.main(make_args(tiny_model_dir, tmp_path, **{**flags, flag: None, **resume}))


# ----------------------------------------------------------------------------------------------
# Resume keeps what defines the run's data and objective (issue 27)
# ----------------------------------------------------------------------------------------------
def one_step_run(module, model_dir, tmp_path, **flags) -> dict:
    """The flags of a 1-step tiny run of either LM script into ``tmp_path/run``, to resume."""
    size = dict(group_size=4) if module is grpo_lm else {}
    return dict(
        model_name_or_path=str(model_dir),
        runs_dir=str(tmp_path),
        run_name="run",
        prompts_per_step=4,
        max_new_tokens=4,
        eval_size=4,
        eval_every=0,
        sample_every=0,
        total_steps=1,
        seed=3,
        **size,
        **flags,
    )


@pytest.mark.parametrize("module", ["grpo_lm", "ppo_lm"])
@pytest.mark.parametrize(
    "change",
    [
        dict(task="multistep"),
        dict(system_prompt="Be brief."),
        dict(response_prefix="The answer:"),
        dict(max_prompt_length=100),
        dict(reward_fn=["task"]),
        dict(reward_weights=[2.0]),
    ],
)
def test_resume_refuses_a_change_of_task_prompt_or_reward(module, change, tiny_model_dir, tmp_path):
    module = __import__(module)
    task_spec = ["task"] if "reward_weights" in change else []
    kw = one_step_run(module, tiny_model_dir, tmp_path, reward_fn=task_spec)
    module.main(module.Args(**kw))
    flag = "--" + next(iter(change)).replace("_", "-")
    with pytest.raises(common.UsageError, match=rf"^{flag}: cannot change when resuming"):
        module.main(
            module.Args(
                **{
                    **kw,
                    **change,
                    "resume": str(tmp_path / "run" / "checkpoint.pt"),
                    "total_steps": 2,
                }
            )
        )
