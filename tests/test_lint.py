"""ruff (line length 100, the rules in ruff.toml) passes on every Python file of the repository:
`ruff check` and `ruff format --check`, so that the line budgets of tests/test_readability.py cannot
be met by widening lines."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _files() -> list[str]:
    files = [str(p.relative_to(ROOT)) for p in sorted(ROOT.glob("*.py"))]
    files += [
        str(p.relative_to(ROOT))
        for d in ("tests", "benchmarks", "examples")
        for p in sorted((ROOT / d).glob("*.py"))
    ]
    return files


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_passes(command):
    ruff = shutil.which("ruff")
    assert ruff is not None, "ruff is not installed: pip install -r requirements.txt installs it"
    out = subprocess.run([ruff, *command, *_files()], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
