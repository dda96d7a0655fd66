"""The sampler on a GPU (issue 50, goals 1 and 5): generated tokens a second of ``common.decode``
(the eager loop, finished rows leaving the batch) against ``decode_static`` (benchmarks/
static_decode.py: a static KV cache, every row kept) with its one-token step run eagerly, compiled
by inductor, and compiled with CUDA graphs (``reduce-overhead``); each variant's tokens against
``decode``'s from the same uniforms, its first call (compilation included) apart from the best of
``--repeats``, and dynamo's counters (recompiles, CUDA graph skips).

    python benchmarks/gpu_shape.py model --tokenizer DIR --out /tmp/qwen05   # the 0.5B shape
    python benchmarks/gpu_decode.py --model /tmp/qwen05                      # on the GPU
    python benchmarks/gpu_decode.py --model DIR --device cpu --variants eager static --prompts 2 \\
        --group-size 2 --max-new-tokens 8                                    # a smoke run

The default shape is the 0.5B pair's: 4 prompts x 16 completions, 256 new tokens, sampled at
temperature 0.7 under bf16 autocast (the scripts' defaults on a GPU). A random model rarely draws
its EOS, so rows run to the budget: the case where keeping every row costs nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import static_decode  # noqa: E402

import common  # noqa: E402

QUESTIONS = [
    "What is 12 + 30?",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes. How much?",
]


def sample(variant: str, model, prompts: tuple, a: argparse.Namespace, *, step, eos: int, pad: int):
    """One sampling call of ``variant`` on ``prompts`` (ids, mask): ``decode`` if ``step`` is None,
    else ``decode_static`` with ``step``; (tokens, sampled mask, seconds)."""
    ids, att = prompts
    rows = range(len(ids) * a.group_size)
    uniforms = common.row_uniforms((a.seed,), rows, a.max_new_tokens).to(model.device)
    draw = common.DrawNextToken(a.temperature, 1.0, uniforms)
    options = dict(max_new_tokens=a.max_new_tokens, eos=eos, pad=pad, pick=draw)
    options["repeats"] = a.group_size
    if variant == "graphs":
        torch._dynamo.mark_static_address(draw.log_probs)  # the step writes into it
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad(), common.bf16_autocast(model.device, a.bf16):
        if step is None:
            tokens, sampled = common.decode(model, ids, att, **options)
        else:
            tokens, sampled = static_decode.decode_static(model, ids, att, **options, step=step)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return tokens, sampled, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a from_pretrained directory")
    parser.add_argument("--tokenizer", help="its tokenizer's directory (default: --model)")
    parser.add_argument("--device", default="cuda")
    variants = ["eager", "static", "compiled", "graphs"]
    parser.add_argument("--variants", nargs="+", choices=variants, default=variants)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--no-bf16", dest="bf16", action="store_false")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "gpu_decode.json"))
    a = parser.parse_args()
    steps = {  # decode_static's one-token step of each variant; "eager" is decode
        "eager": None,
        "static": static_decode.next_token,
        "compiled": torch.compile(static_decode.next_token),
        "graphs": torch.compile(static_decode.next_token, mode="reduce-overhead"),
    }
    from torch._dynamo.utils import counters

    device = torch.device(a.device)
    model = common.load_model(a.model, device=device).eval()
    tokenizer = common.load_tokenizer(a.tokenizer or a.model)
    questions = (QUESTIONS * a.prompts)[: a.prompts]
    prompts = [tokenizer(q, add_special_tokens=False)["input_ids"] for q in questions]
    ids, att = common.pad_left(prompts, tokenizer.pad_token_id, device)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else a.device}
    results["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    results["shape"] = vars(a)
    reference = None
    for variant in a.variants:
        counters.clear()
        try:
            times = []
            for _ in range(a.repeats + 1):
                tokens, sampled, seconds = sample(
                    variant, model, (ids, att), a, step=steps[variant], eos=eos, pad=pad
                )
                times.append(seconds)
        except Exception as e:  # a variant that fails is a finding, the others still run
            results[variant] = {"error": common.first_line(e)[:300]}
            print(variant, "error:", results[variant]["error"], flush=True)
            continue
        if reference is None:
            reference = tokens
        drawn = int(sampled.sum())
        same = reference.shape == tokens.shape and bool((reference == tokens).all())
        figures = {
            "first_call_s": times[0],
            "best_s": min(times[1:]),
            "tokens_per_s": drawn / min(times[1:]),
            "tokens": drawn,
            "same_tokens_as_first_variant": same,
            "dynamo": {name: dict(counts) for name, counts in counters.items()},
        }
        results[variant] = figures
        print(variant, json.dumps(figures), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
