"""Peak memory of one training micro-batch's log probs at a large vocabulary, this tree against
another commit (issue 42: grpo_lm.py peaked at 1.53x TRL's CUDA memory at the Qwen2.5-0.5B shape).

    python benchmarks/logprob_memory.py --old a2640c8 [--rows 4 --prompt 16 --new-tokens 128]

A 2-layer model (hidden 64) with Qwen2.5's 151,936-token vocabulary, so the (b, T, V) float32
tensors of the log-softmax dominate: each is rows x new tokens x 151,936 x 4 bytes (311 MB at the
defaults). Each side runs in its own process on the CPU: the forward of ``token_log_probs`` as
main() calls it in the training loop (the entropy logged, no entropy bonus), then backward of the
summed log probs. Reported: the peak RSS over that forward and backward minus the RSS before it
(glibc returns such large blocks to the system at once, so RSS follows the live tensors), in
copies of one (b, T, V) tensor, and the seconds. ``--old`` is checked out into a temporary worktree.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(a: argparse.Namespace) -> None:
    sys.path.insert(0, a.repo)
    import inspect

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import grpo_lm
    import ppo_lm

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=151936, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).train()
    b, P, T, V = a.rows, a.prompt, a.new_tokens, config.vocab_size
    ids = torch.randint(0, V, (b, P + T))
    att = torch.ones_like(ids)
    fn = grpo_lm.token_log_probs if a.script == "grpo" else ppo_lm.token_log_probs
    new = "entropy_coef" in inspect.signature(fn).parameters  # else the old ``with_entropy``
    if a.script == "grpo":
        mb = grpo_lm.MicroBatch(ids[:, :P], att[:, :P], torch.arange(b), ids[:, P:], att[:, P:])
        call = lambda: fn(model, mb, 0.7, True, 0.0 if new else True)  # noqa: E731
    else:
        call = lambda: fn(model, ids, att, T, 0.7, 0.0 if new else True)  # noqa: E731
    call()[0].sum().backward()  # warm-up: the allocator's first blocks, the gradients' storage
    model.zero_grad(set_to_none=False)
    deltas, seconds = [], []
    for _ in range(a.repeats):
        Path("/proc/self/clear_refs").write_text("5")  # the peak RSS (VmHWM) := the RSS now
        before = status_kib("VmHWM")
        t = time.perf_counter()
        logp, H = call()
        H = H.detach()  # as the old main() did; a no-op for the new
        logp.sum().backward()
        seconds.append(time.perf_counter() - t)
        deltas.append((status_kib("VmHWM") - before) * 1024)
        del logp, H
        model.zero_grad(set_to_none=False)
    copy = b * T * V * 4
    print(json.dumps(dict(script=a.script, repo=a.label, peak_gb=min(deltas) / 1e9,
                          copies=min(deltas) / copy, copy_gb=copy / 1e9,
                          seconds=sorted(seconds)[len(seconds) // 2])))  # fmt: skip


def status_kib(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
    return int(line.split()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", default="a2640c8", help="the commit to compare against")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="median seconds, least peak")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--repo", default=str(ROOT), help=argparse.SUPPRESS)
    p.add_argument("--label", default="new", help=argparse.SUPPRESS)
    p.add_argument("--script", default="grpo", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)
    shape = ["--rows", str(a.rows), "--prompt", str(a.prompt), "--new-tokens", str(a.new_tokens)]
    shape += ["--repeats", str(a.repeats)]
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(old), a.old], cwd=ROOT)
        try:
            for script in ("grpo", "ppo"):
                for label, repo in (("old " + a.old, old), ("new", ROOT)):  # one at a time
                    cmd = [sys.executable, __file__, "--child", "--repo", str(repo), *shape]
                    cmd += ["--label", label, "--script", script]
                    subprocess.run(cmd, check=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT)


if __name__ == "__main__":
    main()
