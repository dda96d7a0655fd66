"""A tool for the tests (``--tool tests/length_tool.py:length --tool-markers '#' '='``): the length
of the call's text in characters, and an error for a call that holds a digit 0."""


def length(call: str) -> str:
    if "0" in call:
        raise ValueError("0")
    return str(len(call))
