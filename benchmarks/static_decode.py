"""A static-KV-cache sampler for GPUs (issue 50, goal 1), kept here until a GPU measures it
(``benchmarks/gpu_decode.py``): nothing in the scripts calls it yet, so it stays out of the files a
user copies. If it wins there, it moves into ``common.py`` and ``common.generate_completions``
calls it on CUDA without a tool. ``tests/test_static_decode.py`` checks that it draws what
``common.decode`` draws."""

import torch

EOS_CHECK_EVERY = 8  # decode_static's steps between two looks (host syncs) for rows still going
PROMPT_BUCKET = 64  # decode_static pads the prompts' width to a multiple of this


def decode_static(
    model, ids, att, *, max_new_tokens: int, eos: int, pad: int, pick, repeats: int = 1, step=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``common.decode``'s tokens and sampled mask from a static KV cache, the path to compile for a
    GPU: every row stays in a batch of fixed shape, finished rows writing ``pad``, so that one
    token's step (``step``: :func:`next_token`, or a compiled copy of it) needs nothing from the
    host; the host looks for rows still going every EOS_CHECK_EVERY steps. The prompts are prefilled
    once (eagerly) and their keys and values copied to each repeat's row; the cache holds the prompt
    width, rounded up to PROMPT_BUCKET, plus ``max_new_tokens``."""
    n = len(ids) * repeats
    bucket = -ids.shape[1] % PROMPT_BUCKET  # more left padding: a few cache shapes, a few compiles
    ids = torch.nn.functional.pad(ids, (bucket, 0), value=pad)
    att = torch.nn.functional.pad(att, (bucket, 0))
    positions = (att.cumsum(1) - 1).clamp(min=0)
    prefill = model(
        input_ids=ids, attention_mask=att, position_ids=positions, use_cache=True, logits_to_keep=1
    )
    prompt_cache = prefill.past_key_values
    prompt_cache.batch_repeat_interleave(repeats)
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + max_new_tokens)
    for index, layer in enumerate(prompt_cache.layers):  # the prompts' keys and values, each row's
        cache.update(layer.keys, layer.values, index)
    att = att.repeat_interleave(repeats, 0)
    mask = torch.cat([att, att.new_ones(n, max_new_tokens)], 1)  # later keys: causally masked
    position_ids = positions[:, -1:].repeat_interleave(repeats, 0)  # (n, 1)
    rows = torch.arange(n, device=ids.device)
    logits = prefill.logits[:, -1].float().repeat_interleave(repeats, 0)
    del prefill, prompt_cache  # the static cache holds the prompts' keys and values now
    token = pick(logits, rows, 0)
    steps = torch.arange(max_new_tokens, device=ids.device)  # positions, indexed without a sync
    step = step or next_token
    out = ids.new_full((n, max_new_tokens), pad)
    sampled = torch.zeros(n, max_new_tokens, device=ids.device)
    going = torch.ones(n, dtype=torch.bool, device=ids.device)
    for position in range(max_new_tokens):  # of the token drawn, in the completion
        token = torch.where(going, token, pad)
        out[:, position] = token
        sampled[:, position] = going.float()
        going = going & (token != eos)
        if position + 1 == max_new_tokens:
            break
        if position % EOS_CHECK_EVERY == EOS_CHECK_EVERY - 1 and not going.any():
            break
        position_ids = position_ids + 1
        inputs = dict(token=token, position_ids=position_ids, mask=mask, cache=cache)
        token = step(model, **inputs, pick=pick, rows=rows, position=steps[position + 1]).clone()
    width = int(sampled.any(0).sum())  # the longest row's: a row goes on from position 0
    return out[:, :width], sampled[:, :width]


def next_token(model, *, token, position_ids, mask, cache, pick, rows, position) -> torch.Tensor:
    """:func:`decode_static`'s one-token step: the (n,) ``token`` through ``model`` at
    ``position_ids`` (n, 1) with the static ``cache`` and (n, cache length) ``mask``, then the next
    (n,) tokens ``pick(logits, rows, position)`` draws."""
    result = model(
        input_ids=token[:, None],
        attention_mask=mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    logits = result.logits[:, -1].float()
    return pick(logits, rows, position)
