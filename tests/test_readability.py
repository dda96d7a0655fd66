"""Each script reads beside its paper, and as the anchors write: what a user copies in AST nodes,
one statement a line, main() in the algorithm box's order, the math in pure functions. Measured with
ast, so that the creep cannot come back silently. Lines are a function's source lines, docstring
included."""

import ast
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# script: (the function that holds the algorithm, its budget in lines, its outer loop's budget,
# longer functions allowed). Written one statement a line, with calls that name their arguments,
# main() is the algorithm box unpacked: the LM scripts' hold the algorithm's input (models,
# optimizer, logging: about 110 lines) and the loop (grpo_lm: Algorithm 1's two loops, about 150
# lines: each of the box's 12 lines and each extension's tagged `if` with its call; ppo_lm: the
# seven steps of a PPO iteration, about 140). The budgets are today's lengths plus about 5%: room
# for a small hack, not for a new stage. A signature of one parameter a line (keyword-only past
# four) makes grpo_loss and ppo_loss longer than the rest.
BUDGETS = {
    "grpo_lm.py": ("main", 290, 160, {"grpo_loss": 90, "token_log_probs": 65}),
    "ppo_lm.py": ("main", 275, 145, {"ppo_loss": 70}),
    "ppo_continuous.py": ("train", 190, None, {}),
}
OTHER_FUNCTIONS = 60
# the functions between "# ALGO LOGIC" and main(), in order: they must read with torch alone, and
# common.lm_head_log_probs, the memory plumbing both scripts share (the LM head and its log-softmax
# a chunk of tokens at a time, in float32 under bf16 autocast)
MATH_BLOCKS = {
    "grpo_lm.py": [
        "completion_mask",
        "group_advantages",
        "process_advantages",
        "MicroBatch",
        "token_log_probs",
        "kl_estimate",
        "grpo_loss",
        "aggregate",
    ],
    "ppo_lm.py": [
        "completion_mask",
        "token_log_probs",
        "token_values",
        "per_token_rewards",
        "masked_whiten",
        "gae",
        "ppo_loss",
        "adaptive_kl_coef",
    ],
}


def _functions(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    return {
        node.name: node
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("script", list(BUDGETS))
def test_the_algorithm_fits_its_budget(script):
    name, budget, loop_budget, _ = BUDGETS[script]
    function = _functions(ROOT / script)[name]
    assert _lines(function) <= budget, (
        f"{script}: {name}() has {_lines(function)} lines, budget {budget}"
    )
    if script in ("grpo_lm.py", "ppo_lm.py"):  # a budget met by widening lines is no budget
        text = (ROOT / script).read_text().splitlines()[function.lineno - 1 : function.end_lineno]
        wide = [line for line in text if len(line) > 100]
        assert not wide, f"{script}: {name}() has lines over 100 characters: {wide[:2]}"
    if loop_budget is not None:
        # the outer loop: grpo_lm's `for iteration` (Algorithm 1, line 2), else `for step`
        outer = "iteration" if script == "grpo_lm.py" else "step"
        loops = [node for node in ast.walk(function) if _loops_over(node, outer)]
        assert loops, f"{script}: no `for {outer} in ...` loop in {name}()"
        assert _lines(loops[0]) <= loop_budget, (
            f"{script}: the loop has {_lines(loops[0])} lines, budget {loop_budget}"
        )


def _loops_over(node: ast.AST, name: str) -> bool:
    return (
        isinstance(node, ast.For) and isinstance(node.target, ast.Name) and node.target.id == name
    )


def test_grpo_main_is_algorithm_1s_two_loops():
    # Algorithm 1: `for iteration` (reference <- policy) holds `for step` (sample, reward,
    # advantages, mu updates), and the step loop is the only one at its level
    main = _functions(ROOT / "grpo_lm.py")["main"]
    iterations = [node for node in main.body if _loops_over(node, "iteration")]
    assert len(iterations) == 1, "main() has no top-level `for iteration in ...:`"
    steps = [node for node in iterations[0].body if _loops_over(node, "step")]
    assert len(steps) == 1, "`for iteration` does not hold `for step in ...:`"
    reset = ast.unparse(iterations[0]).split("for step in")[0]
    assert "reference.load_state_dict(policy.state_dict())" in reset, "line 3: pi_ref <- pi_theta"
    updates = [node for node in ast.walk(steps[0]) if isinstance(node, ast.For)]
    assert any(ast.unparse(node.iter) == "range(args.mu)" for node in updates), "lines 10-11: mu"


@pytest.mark.parametrize("script", list(BUDGETS))
def test_no_other_function_is_long(script):
    main, _, _, allowed = BUDGETS[script]
    long = {
        name: _lines(node)
        for name, node in _functions(ROOT / script).items()
        if name != main and _lines(node) > allowed.get(name, OTHER_FUNCTIONS)
    }
    assert not long, f"{script}: over {OTHER_FUNCTIONS} lines (or their own budget): {long}"


@pytest.mark.parametrize("script", list(MATH_BLOCKS))
def test_the_math_block_needs_torch_alone(script):
    text = (ROOT / script).read_text()
    tree = ast.parse(text)
    top = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    banner = text[: text.index("# ALGO LOGIC")].count("\n") + 1
    main = next(node.lineno for node in top if node.name == "main")
    block = [node for node in top if banner < node.lineno < main]
    assert [node.name for node in block] == MATH_BLOCKS[script], (
        script
    )  # the block, in the loop's order
    defined = {node.name for node in top}
    for node in block:
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        assert "args" not in used, f"{script}: {node.name} uses args"
        common_uses = {
            n.attr
            for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "common"
        }
        assert common_uses <= {"lm_head_log_probs"}, f"{node.name}: common.{common_uses}"
        outside = (used & defined) - set(MATH_BLOCKS[script])
        assert not outside, f"{script}: {node.name} calls {outside}, defined outside the math block"


@pytest.mark.parametrize("script", list(MATH_BLOCKS))
def test_the_banner_covers_plumbing_only(script):
    # the loop is not under "TRY NOT TO MODIFY": the banner comes after the end of main()
    text = (ROOT / script).read_text()
    main = _functions(ROOT / script)["main"]
    assert text.count("# TRY NOT TO MODIFY") == 1, script
    assert text[: text.index("# TRY NOT TO MODIFY")].count("\n") + 1 > main.end_lineno, script


# What a user copies, in AST nodes (docstrings left out): a script with every module of this
# repository it imports, transitively; common.py and tasks.py alone. Neither the formatter, nor line
# breaks, nor the Python version changes the count: only adding or removing logic does. Fixed
# ceilings with room, not today's counts, so that a user's small hack fits. Set at 19,800 and
# 16,500 for the LM copies when one statement a line came (2026-11-28: 18,370 and 15,380 before it;
# unpacking used about 900 and 800 of that room); each capability since raises them by what it used,
# no more: in the same change --correct-fn, --eval-dataset, the held-out mean reward, the --runs-dir
# check, one line when another torchrun process fails, per-row sampling draws and step rewards that
# read the response prefix used about 590 nodes in the GRPO copy and 570 in the PPO copy (counted
# function by function); the ceilings rose by 500 and 480. Issue 49's tools while sampling (the
# sampler's contract: a sampled mask and its log probs; Tool, the calculator, --tool's flags and
# metrics, the held-out share that calls it) used 1,514 in the GRPO copy, of which ~200 are issue
# 50's sampler-trainer agreement (sampling/logp_diff_*), and 504 in the PPO copy (common.py 447,
# tasks.py 59): every ceiling rose by that. Issue 50's LM head a chunk at a time
# (common.lm_head_log_probs, the reference's decoder and head without the adapter, the load-time
# check that the logits are the head's) and the static-cache sampler to compile for GPUs
# (decode_static, next_token) used 963 in the GRPO copy and 956 in the PPO copy (common.py 1,102;
# the scripts' token_log_probs about 140 fewer each). Issue 51's --fsdp (common.shard, gathered,
# full_tensors, the loads that split whole tensors; the scripts' calls) used 667 in the GRPO copy,
# 692 in the PPO copy and 649 in common.py, over its +600 by what the review's fixes at scale took
# (rank 0 alone copies a save to the CPU, moments split before they load, an explicit mesh); the
# static-cache sampler, which nothing calls until a GPU measures it, moved to
# benchmarks/static_decode.py (668 fewer in each copy).
NODE_CEILINGS = {
    "grpo_lm.py": 22_776,
    "ppo_lm.py": 18_464,
    "ppo_continuous.py": 7_100,
    "common.py": 7_830,
    "tasks.py": 4_059,
}
# packing, as the anchors write: AST nodes a statement (a compound statement counts its header),
# mean and 90th percentile, in every file (CleanRL 11.7 / 25, nanochat 10.4-12.9 / 20-21)
MEAN_NODES_A_STATEMENT = 13.0
P90_NODES_A_STATEMENT = 25
SCRIPTS = [*NODE_CEILINGS, *sorted(p.name for p in (ROOT / "examples").glob("*.py"))]
# the only reasons a `noqa` may give: a broad except that turns any failure into one line
NOQA_ALLOWED = {"BLE001"}


def _path(name: str) -> Path:
    return ROOT / name if (ROOT / name).is_file() else ROOT / "examples" / name


def _local_imports(path: Path) -> set[Path]:
    """The modules of this repository (its top-level .py files) that ``path`` imports, anywhere in
    the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return {ROOT / f"{name}.py" for name in names if (ROOT / f"{name}.py").is_file()} - {path}


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring statements of every module, class and function in ``tree``."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        is_string = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
        if is_string and isinstance(first.value.value, str):
            found.add(id(first))
    return found


def _count(node: ast.AST, docstrings: set[int]) -> int:
    """AST nodes under ``node``, itself included, docstrings left out."""
    if id(node) in docstrings:
        return 0
    return 1 + sum(_count(child, docstrings) for child in ast.iter_child_nodes(node))


def nodes(path: Path) -> int:
    tree = ast.parse(path.read_text())
    return _count(tree, _docstrings(tree))


def statement_sizes(path: Path) -> list[int]:
    """AST nodes of each statement of ``path`` (docstrings and def/class statements left out); a
    compound statement (if, for, while, with, match, try) counts its header alone."""
    tree = ast.parse(path.read_text())
    docstrings = _docstrings(tree)
    sizes = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt) or id(node) in docstrings:
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(getattr(node, "body", None), list):
            parts = [getattr(node, key, None) for key in ("test", "iter", "target", "subject")]
            parts += list(getattr(node, "items", []))
            sizes.append(1 + sum(_count(p, docstrings) for p in parts if p is not None))
        else:
            sizes.append(_count(node, docstrings))
    return sorted(sizes)


def weight(script: str) -> int:
    """AST nodes of ``script`` and every module of this repository it imports, transitively."""
    seen, todo = {ROOT / script}, [ROOT / script]
    while todo:
        for module in _local_imports(todo.pop()) - seen:
            seen.add(module)
            todo.append(module)
    return sum(nodes(path) for path in seen)


@pytest.mark.parametrize("script", list(NODE_CEILINGS))
def test_what_a_user_copies_fits_its_node_ceiling(script):
    alone = script in ("common.py", "tasks.py")
    count = nodes(ROOT / script) if alone else weight(script)
    assert count <= NODE_CEILINGS[script], (
        f"{script}: {count:,} AST nodes, ceiling {NODE_CEILINGS[script]:,}"
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_one_statement_a_line(script):
    sizes = statement_sizes(_path(script))
    mean = sum(sizes) / len(sizes)
    p90 = sizes[int(0.9 * len(sizes))]
    assert mean <= MEAN_NODES_A_STATEMENT, f"{script}: {mean:.1f} AST nodes a statement"
    assert p90 <= P90_NODES_A_STATEMENT, f"{script}: 90th percentile {p90} AST nodes a statement"


def _is_swap(node: ast.Assign) -> bool:
    """``a, b = b, a``: the same names (or attributes, subscripts) on both sides."""
    left = sorted(ast.unparse(e) for e in node.targets[0].elts)
    right = sorted(ast.unparse(e) for e in node.value.elts)
    return left == right


def golf(path: Path) -> list[str]:
    """What packs logic onto a line: a conditional expression or boolean operation used as a
    statement, a lambda bound to a name, a walrus outside a condition, several values bound in one
    assignment from a tuple display (a swap is fine, unpacking a call's result too), a tuple display
    used as a statement, `# fmt: skip`, and a `noqa` for a reason not in NOQA_ALLOWED."""
    text = path.read_text()
    tree = ast.parse(text)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Expr) and isinstance(node.value, (ast.IfExp, ast.BoolOp)):
            found.append(f"{where} conditional expression as a statement")
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Tuple):
            found.append(f"{where} a tuple of calls as a statement")
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Lambda):
            found.append(f"{where} lambda bound to a name")
        several = isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple)
        if several and isinstance(node.targets[0], ast.Tuple) and not _is_swap(node):
            found.append(f"{where} several values bound in one assignment")
        if isinstance(node, ast.NamedExpr):
            parent = parents.get(node)
            while isinstance(parent, (ast.Compare, ast.BoolOp, ast.UnaryOp)):
                parent = parents.get(parent)
            if not isinstance(parent, (ast.If, ast.While, ast.IfExp, ast.comprehension)):
                found.append(f"{where} walrus outside a condition")
    for lineno, line in enumerate(text.splitlines(), 1):
        if "fmt: skip" in line or "fmt: off" in line:
            found.append(f"{path.name}:{lineno} fmt: skip")
        for codes in re.findall(r"#\s*noqa:?\s*([A-Z0-9, ]*)", line):
            if not {c.strip() for c in codes.split(",") if c.strip()} <= NOQA_ALLOWED:
                found.append(f"{path.name}:{lineno} noqa {codes.strip() or '(all)'}")
    return found


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_golf(script):
    assert not golf(_path(script)), golf(_path(script))


def test_imports_go_one_way():
    # the scripts import common and tasks; tasks may import common; common imports neither
    assert _local_imports(ROOT / "common.py") == set()
    assert _local_imports(ROOT / "tasks.py") == {ROOT / "common.py"}
    for script in ("grpo_lm.py", "ppo_lm.py"):
        assert _local_imports(ROOT / script) == {ROOT / "common.py", ROOT / "tasks.py"}
    assert _local_imports(ROOT / "ppo_continuous.py") == set()


def test_the_readmes_new_flag_fits_under_the_ceiling():
    # the README's own "A new flag" hack must not fail the weight test: its AST nodes (each
    # paragraph of the snippet parsed on its own) fit under the GRPO copy's ceiling
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    hack = readme[readme.index("**A new flag.**") :].split("```python\n")[1].split("```")[0]
    added = 0
    for paragraph in hack.split("\n\n"):
        tree = ast.parse(textwrap.dedent(paragraph))
        added += _count(tree, _docstrings(tree)) - 1  # its statements, not the module
    assert added > 10, hack  # the snippet was found and parsed
    assert weight("grpo_lm.py") + added <= NODE_CEILINGS["grpo_lm.py"]
