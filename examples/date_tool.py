"""A tool of your own for grpo_lm.py's --tool: the days between two dates (standard library only).

The policy writes ``<days>2024-01-01 2024-03-01</days>``; when its text ends with the closing
marker, the sampler calls ``days_between("2024-01-01 2024-03-01")`` and the returned ``" = 60"``
joins the answer as context (the sampled mask is 0 on it: no loss term reads those tokens).

    python grpo_lm.py --dataset dates.jsonl --tool examples/date_tool.py:days_between \\
        --tool-markers "<days>" "</days>" --max-new-tokens 64

A tool receives the text between the markers (since its last output) and returns the text to inject,
or None for nothing. What it raises is injected as ``ErrorName: message`` and counted in
``tools/errors``: here a call that is not two ISO dates.
"""

from datetime import date


def days_between(call: str) -> str:
    """The days from the first ISO date of ``call`` to the second (negative when it comes first),
    as ``" = N"``. ValueError: not two dates."""
    dates = call.split()
    if len(dates) != 2:
        raise ValueError(f"expected two dates, got {len(dates)}")
    start = date.fromisoformat(dates[0])
    end = date.fromisoformat(dates[1])
    days = (end - start).days
    return f" = {days}"
