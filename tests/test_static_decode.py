"""Issue 50, goals 1 and 4: ``static_decode.decode_static`` (a static KV cache, every row kept, the
one-token step compilable) draws what ``common.decode`` (the eager sampler, finished rows leaving)
draws, run eagerly on the CPU: greedy and seeded sampling, prompts of different lengths, the budget
and the EOS edges. Tools keep the eager path (tests/test_tools.py)."""

import os
import shutil
import sys

import pytest
import torch
from conftest import ROOT

import common

sys.path.insert(0, str(ROOT / "benchmarks"))
import static_decode  # noqa: E402  benchmarks/static_decode.py

PROMPTS = ["What is 12 + 30?", "1+1=", "a", "What is the sum of 2, 3 and 4?"]


def both(model, tok, *, temperature, top_p, repeats, max_new_tokens, prompts=PROMPTS, step=None):
    """(tokens, sampled mask, log probs) of decode and of decode_static, each with a fresh draw
    from the same uniforms."""
    ids, att = common.pad_left(
        [tok(p, add_special_tokens=False)["input_ids"] for p in prompts],
        tok.pad_token_id,
        model.device,
    )
    rows = range(len(prompts) * repeats)
    uniforms = common.row_uniforms((5,), rows, max_new_tokens).to(model.device)
    options = dict(
        max_new_tokens=max_new_tokens,
        eos=tok.eos_token_id,
        pad=tok.pad_token_id,
        repeats=repeats,
    )
    out = []
    for decode in (common.decode, static_decode.decode_static):
        draw = common.DrawNextToken(temperature, top_p, uniforms)
        extra = {"step": step} if step and decode is static_decode.decode_static else {}
        with torch.no_grad():
            tokens, sampled = decode(model, ids, att, **options, pick=draw, **extra)
        out.append((tokens, sampled, draw.log_probs[:, : tokens.shape[1]] * sampled))
    return out


@pytest.fixture(scope="module")
def eos_model(tiny_model_dir):
    """The tiny model with its EOS about 15 times as likely as another token (conftest's
    make_tool_model's way: its embeddings' dimension 0, tied to the LM head)."""
    model = common.load_model(str(tiny_model_dir)).eval()
    tok = common.load_tokenizer(str(tiny_model_dir))
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings[:, 0] = 0.5
        embeddings[tok.eos_token_id, 0] = 1.0
    return model, tok


@pytest.mark.parametrize("draw", [(0.0, 1.0, 1), (1.0, 1.0, 4), (0.8, 0.9, 3)])
def test_the_static_cache_draws_what_the_eager_sampler_draws(tiny_model_dir, eos_model, draw):
    temperature, top_p, repeats = draw  # greedy; sampling; sampling in the top-p nucleus
    model = common.load_model(str(tiny_model_dir)).eval()
    tok = common.load_tokenizer(str(tiny_model_dir))
    if temperature:  # rows that end at different steps
        model, tok = eos_model
    (eager, eager_mask, eager_logp), (static, static_mask, static_logp) = both(
        model, tok, temperature=temperature, top_p=top_p, repeats=repeats, max_new_tokens=30
    )
    assert torch.equal(static, eager)
    assert torch.equal(static_mask, eager_mask)
    torch.testing.assert_close(static_logp, eager_logp, atol=1e-5, rtol=0)
    lengths = eager_mask.sum(1)
    assert temperature == 0 or lengths.min() < lengths.max()  # rows end at different steps


@pytest.mark.parametrize("check_every", [1, 3, 100])
def test_the_static_cache_stops_where_the_last_row_ends(eos_model, check_every, monkeypatch):
    # every row ends before the budget: the output is as wide as the longest row, however often the
    # host looks for rows still going; budgets of 1 and of the longest row
    monkeypatch.setattr(static_decode, "EOS_CHECK_EVERY", check_every)
    model, tok = eos_model
    for max_new_tokens in (1, 5, 60):
        (eager, eager_mask, _), (static, static_mask, _) = both(
            model, tok, temperature=1.0, top_p=1.0, repeats=4, max_new_tokens=max_new_tokens
        )
        assert torch.equal(static, eager)
        assert torch.equal(static_mask, eager_mask)
    assert eager.shape[1] < 60  # every row ended


def test_the_compiled_step_draws_what_the_eager_step_draws(tiny_model_dir):
    # on CUDA with CUDA graphs ("reduce-overhead"), which must not be skipped; on the CPU,
    # inductor's default (a C++ compiler; about 2 minutes on 2 cores: asked for by TEST_COMPILE=1)
    cuda = torch.cuda.is_available()
    if not cuda and not os.environ.get("TEST_COMPILE"):
        pytest.skip("compiling on the CPU takes minutes: set TEST_COMPILE=1 to run it")
    if not cuda and not shutil.which("g++"):
        pytest.skip("torch.compile on the CPU needs a C++ compiler (g++)")
    from torch._dynamo.utils import counters

    device = "cuda" if cuda else "cpu"
    mode = "reduce-overhead" if cuda else None
    compiled = torch.compile(static_decode.next_token, mode=mode)
    model = common.load_model(str(tiny_model_dir), device=device).eval()
    tok = common.load_tokenizer(str(tiny_model_dir))
    counters.clear()
    (eager, _, eager_logp), (static, _, static_logp) = both(
        model, tok, temperature=1.0, top_p=1.0, repeats=2, max_new_tokens=8, step=compiled
    )
    assert torch.equal(static, eager)
    torch.testing.assert_close(static_logp, eager_logp, atol=1e-5, rtol=0)
    assert not counters["inductor"]["cudagraph_skips"]
