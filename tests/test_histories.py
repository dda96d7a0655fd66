"""Every logged scalar of grpo_lm.main() and ppo_lm.main(), step by step, for flag combinations that cover every
feature, must equal the recorded histories exactly (issue 15: a reorganisation is bit-identical or it is not done).

The runs use the tests' tiny Llama on one CPU thread. Timings and memory are left out. After a change that moves
the numbers on purpose, record again and say why in the commit:

    python tests/test_histories.py --record
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model

import grpo_lm
import ppo_lm
from test_grpo_lm import digit_task

RECORD = Path(__file__).resolve().parent / "data" / "histories.json"

GRPO = {  # flags on top of the tiny run below; every grpo_lm feature appears in at least one
    "default": {},
    "mu2": dict(mu=2, beta=0.1),
    "beta0_eval": dict(beta=0.0, eval_every=1),
    "process_multistep": dict(supervision="process", task="multistep", scale_rewards="batch"),
    "iterations_reward_model": dict(total_steps=4, iterations=2, train_reward_model=True, rm_learning_rate=1e-2),
    "dapo_all": dict(loss_type="dapo", clip_range_high=0.28, overlong_buffer=4, mask_truncated_completions=True,
                     dynamic_sampling=True, max_sampling_rounds=2, scale_rewards="none"),
    "dr_grpo_batch": dict(loss_type="dr_grpo", scale_rewards="batch"),
    "bnpo": dict(loss_type="bnpo", micro_batch_size=12),
    "gspo": dict(importance_sampling_level="sequence", mu=2),
    "no_share_prompt": dict(share_prompt=False),
    "gradient_checkpointing": dict(gradient_checkpointing=True),
    "fast_generation_tis": dict(fast_generation=True, tis_cap=2.0),
    "top_p_per_call": dict(top_p=0.9, generation_groups_per_call=1),
    "frozen_reward_model": dict(reward_model_path="{rm}"),  # format_reward=0.5 was recorded here: never paid, now refused
}
PPO = {
    "default": {},
    "whiten_adaptive_kl": dict(whiten_rewards=True, adaptive_kl_target=0.01, adaptive_kl_horizon=32),
    "reward_model_eos_penalty": dict(reward_model_path="{rm}", missing_eos_penalty=1.0),
    "gradient_checkpointing": dict(gradient_checkpointing=True),
    "fast_generation_tis": dict(fast_generation=True, tis_cap=2.0),
}


def _args(module, base: dict, flags: dict, models: dict[str, Path], run_dir: Path):
    flags = {k: (str(models["rm"]) if v == "{rm}" else v) for k, v in flags.items()}
    return module.Args(**{**base, "model_name_or_path": str(models["policy"]), "runs_dir": str(run_dir), **flags})


def run_all(tmp: Path) -> dict[str, dict[str, list[float]]]:
    """The history of every combination, without timings and memory."""
    models = {"policy": make_tiny_model(tmp / "policy"), "rm": make_tiny_model(tmp / "rm", seed=1, kind="reward")}
    grpo_base = dict(prompts_per_step=4, group_size=8, max_new_tokens=12, learning_rate=1e-2, temperature=1.0,
                     eval_size=8, eval_every=0, sample_every=0, save_every=0, total_steps=2, seed=3, torch_threads=1)
    ppo_base = dict(prompts_per_step=32, max_new_tokens=12, learning_rate=1e-2, temperature=1.0, eval_size=8,
                    eval_every=0, sample_every=0, save_every=0, total_steps=2, seed=3, micro_batch_size=32,
                    num_ppo_epochs=2, num_minibatches=2, torch_threads=1)
    out = {}
    threads = torch.get_num_threads()
    try:
        for module, base, combos in ((grpo_lm, grpo_base, GRPO), (ppo_lm, ppo_base, PPO)):
            for name, flags in combos.items():
                args = _args(module, {**base, "run_name": name}, flags, models, tmp / module.__name__)
                task = None if flags.get("task") == "multistep" else digit_task()
                history = module.main(args, task=task)
                out[f"{module.__name__}/{name}"] = {k: v for k, v in history.items()
                                                    if not k.startswith(("time/", "memory/"))}
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def histories(tmp_path_factory):
    return run_all(tmp_path_factory.mktemp("histories"))


@pytest.mark.parametrize("run", [f"grpo_lm/{n}" for n in GRPO] + [f"ppo_lm/{n}" for n in PPO])
def test_history_is_bit_identical_to_the_recording(run, histories):
    recorded = json.loads(RECORD.read_text())[run]
    now = histories[run]
    assert sorted(now) == sorted(recorded), sorted(set(now) ^ set(recorded))
    for key, values in recorded.items():
        assert now[key] == values, key  # exact: no tolerance


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile

    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(run_all(Path(tempfile.mkdtemp())), indent=1) + "\n")
    print(f"recorded {RECORD}")
