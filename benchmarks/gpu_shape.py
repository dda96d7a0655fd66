"""A realistic shape on a GPU: a random model with Qwen2.5-0.5B-Instruct's config, PPO vs GRPO
memory and time, the training phase's model FLOP utilisation (issue 42).

    python benchmarks/gpu_shape.py model --tokenizer DIR --out DIR   # random Qwen2.5-0.5B shape
    python benchmarks/gpu_shape.py peak                               # dense bf16 matmul TFLOP/s
    python benchmarks/gpu_shape.py mfu --peak 700 JSON...             # trl_compare speed results
    python benchmarks/gpu_shape.py ppo-vs-grpo --model DIR --steps 4  # same sampled tokens a step

``model`` saves Qwen2.5-0.5B-Instruct's architecture (24 layers, hidden 896, 14 query and 2 key/val.
heads, MLP 4864, vocabulary 151,936, tied embeddings: 494M parameters) with random weights and the
given tokenizer (the default model's: its 49,152 ids are a subset of the vocabulary; sampled ids
beyond it decode to nothing). Nothing loads from the Hub.

``mfu``: the training phase is a step's time outside sampling (rewards, the reference and policy
forward passes, backward, optimizer). Its model FLOPs per step are (6 + 2 [beta > 0]) x N x tokens,
N the parameters (the tied embedding counted once: it is the LM head's matrix multiply), tokens
= sequences x (mean prompt + mean completion length), attention's FLOPs left out (under 5% at these
lengths). MFU = those FLOPs / training seconds / the measured ``peak``.

``ppo-vs-grpo``: ppo_lm.py (P x 1 prompts, its defaults: 4 PPO epochs, a value model) and grpo_lm.py
(P / G x G) with the same sampled completions per step, the same length, micro-batch and seed; peak
CUDA memory and seconds per step (steps 2..S) from their TensorBoard events.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN25_05B = dict(  # Qwen/Qwen2.5-0.5B-Instruct's config.json
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def make_model(a: argparse.Namespace) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(a.tokenizer)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(a.seed)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B, **ids, bos_token_id=None))
    model.generation_config.pad_token_id = ids["pad_token_id"] or ids["eos_token_id"]
    model.save_pretrained(a.out)
    tokenizer.save_pretrained(a.out)
    print(f"{a.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


def peak(a: argparse.Namespace) -> float:
    """Mean TFLOP/s of ``--repeats`` bf16 (n x n) @ (n x n) products on random data, after 3."""
    import torch

    x, y = (torch.randn(a.n, a.n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        x @ y
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(a.repeats):
        x @ y
    torch.cuda.synchronize()
    tflops = 2 * a.n**3 * a.repeats / (time.perf_counter() - start) / 1e12
    print(json.dumps({"device": torch.cuda.get_device_name(0), "n": a.n, "tflops": tflops}))
    return tflops


def mean_prompt_tokens(model_dir: str) -> float:
    """Mean prompt length in tokens of the addition task's training questions."""
    import common
    import tasks

    tokenizer = common.load_tokenizer(model_dir)
    questions = [ex["question"] for ex in tasks.make_addition_task(128).train]
    prompts = [tasks.build_prompt(tokenizer, q) for q in questions]
    lengths = [len(tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]
    return sum(lengths) / len(lengths)


def mfu(a: argparse.Namespace) -> None:
    for path in a.json:
        r = json.loads(Path(path).read_text())
        model_dir = r["runs"][0]["cmd"].split("--model-name-or-path ")[1].split()[0]
        n, tokens = r["params_m"] * 1e6, r["P"] * r["G"] * mean_prompt_tokens(model_dir)
        for who in ("ours", "trl"):
            seq_tokens = tokens + r["tokens_per_step"][who]
            flops = (6 + 2 * (r["beta"] > 0)) * n * seq_tokens
            train_s = r["rest_s_per_step"][who]
            gen_s = r["generation_s_per_step"][who]
            print(json.dumps({
                "tag": r["tag"], "who": who, "steps_per_s": r["steps_per_s"][who],
                "peak_cuda_gb": r.get("peak_cuda_gb", {}).get(who),
                "generation_s": gen_s, "training_s": train_s,
                "generation_tokens_per_s": r["tokens_per_step"][who] / gen_s,
                "training_tflops": flops / train_s / 1e12,
                "mfu": flops / train_s / 1e12 / a.peak,
            }))  # fmt: skip


def scalars(run_dir: Path) -> dict[str, list[tuple[float, int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    return {t: [(e.wall_time, e.step, e.value) for e in acc.Scalars(t)] for t in tags}


def ppo_vs_grpo(a: argparse.Namespace) -> None:
    shared = ["--model-name-or-path", a.model, "--total-steps", str(a.steps), "--seed", "1"]
    shared += ["--max-new-tokens", str(a.max_new_tokens), "--micro-batch-size", str(a.micro)]
    shared += ["--eval-size", "0", "--eval-every", "0", "--save-every", "0", "--sample-every", "0"]
    per = {
        "ppo": ["ppo_lm.py", "--prompts-per-step", str(a.sequences)],
        "grpo": ["grpo_lm.py", "--prompts-per-step", str(a.sequences // a.group_size)]
        + ["--group-size", str(a.group_size), "--beta", str(a.grpo_beta)],
    }
    out = Path(a.out)
    for method in a.methods:
        script, *flags = per[method]
        where = ["--runs-dir", str(out), "--run-name", method]
        cmd = [sys.executable, script, *flags, *shared, *where]
        start = time.time()
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        s = scalars(out / method)
        memory = s.get("memory/peak_cuda_gb", s["memory/peak_rss_gb"])  # RSS on a CPU
        ends = [t for t, _, _ in memory]
        print(json.dumps({
            "method": method, "command": " ".join(["python", script, *flags, *shared]),
            "wall_s": time.time() - start,
            "peak_memory_gb": max(v for _, _, v in memory),
            "s_per_step": (ends[-1] - ends[0]) / (len(ends) - 1),
            "generation_s": [round(v, 2) for _, _, v in s["time/generation_s"]],
            "training_s": [round(v, 2) for _, _, v in s["time/training_s"]],
        }), flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("--tokenizer", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    k = sub.add_parser("peak")
    k.add_argument("--n", type=int, default=8192)
    k.add_argument("--repeats", type=int, default=20)
    f = sub.add_parser("mfu")
    f.add_argument("--peak", type=float, required=True, help="measured TFLOP/s (``peak``)")
    f.add_argument("json", nargs="+")
    v = sub.add_parser("ppo-vs-grpo")
    v.add_argument("--model", required=True)
    v.add_argument("--steps", type=int, default=4)
    v.add_argument("--sequences", type=int, default=64, help="sampled completions per step")
    v.add_argument("--group-size", type=int, default=16)
    v.add_argument("--max-new-tokens", type=int, default=256)
    v.add_argument("--micro", type=int, default=16, help="--micro-batch-size of both")
    v.add_argument("--grpo-beta", type=float, default=0.04)
    v.add_argument("--methods", nargs="+", choices=("ppo", "grpo"), default=["ppo", "grpo"])
    v.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "gpu_shape"))
    a = p.parse_args()
    {"model": make_model, "peak": peak, "mfu": mfu, "ppo-vs-grpo": ppo_vs_grpo}[a.cmd](a)


if __name__ == "__main__":
    main()
