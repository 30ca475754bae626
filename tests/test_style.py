"""How the scripts read: each agent and hierarchical.py within a few hundred lines, the paper's path first (`main`
ends before line 500) and apart from the ablations, then the infrastructure; a `main` a student reads in one sitting,
named stats, lines within 120 characters, references a reader can follow, and the flags a run resolved from its env.

    python -m pytest -q tests/test_style.py     # a few seconds
"""

import ast
import os
import re
import subprocess
import sys

import pytest
from conftest import AGENTS, name

import envs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEARNERS = [f"{name(agent)}.py" for agent in AGENTS] + ["hierarchical.py"]
MAX_LINES, MAX_CHARACTERS, MAIN_ENDS_BEFORE = 750, 45_000, 500  # CleanRL's longest script: 682 lines
SCRIPTS = [f"{name(agent)}.py" for agent in AGENTS] + ["goal_reaching.py", "hierarchical.py", "envs.py"]
# documents the project draws on that a user's clone does not have: code and docs never send a reader there
OUTSIDE_DOCUMENTS = re.compile(r"spec §|spec\.md|\.\./shared|calibration\.md|worlds\.md")


def tree(script):
    with open(os.path.join(ROOT, script), encoding="utf-8") as f:
        return ast.parse(f.read())


def top_level(script):
    """Line of each top-level function and class of a script, by name."""
    return {node.name: node.lineno for node in tree(script).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def function(script, function_name):
    (node,) = [node for node in tree(script).body if isinstance(node, ast.FunctionDef) and node.name == function_name]
    return node


def nested_functions(node):
    return [inner for inner in ast.walk(node) if isinstance(inner, ast.FunctionDef) and inner is not node]


@pytest.mark.parametrize("script", SCRIPTS)
def test_lines_stay_within_120_characters(script):
    with open(os.path.join(ROOT, script), encoding="utf-8") as f:
        long_lines = [number for number, line in enumerate(f, 1) if len(line.rstrip("\n")) > 120]
    assert not long_lines, f"{script}: lines over 120 characters: {long_lines}"


def test_no_reference_to_a_document_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.sh", ".ci/run"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    assert "csf.py" in tracked and "README.md" in tracked
    found = []
    for path in set(tracked) - {"tests/test_style.py"}:  # the one file that names them, in OUTSIDE_DOCUMENTS
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            found += [f"{path}:{number}" for number, line in enumerate(f, 1) if OUTSIDE_DOCUMENTS.search(line)]
    assert not found, found


@pytest.mark.parametrize("script", LEARNERS)
def test_a_script_is_a_few_hundred_lines_and_its_main_ends_early(script):
    with open(os.path.join(ROOT, script), encoding="utf-8") as f:
        text = f.read()
    assert text.count("\n") <= MAX_LINES and len(text) <= MAX_CHARACTERS, (text.count("\n"), len(text))
    assert function(script, "main").end_lineno < MAIN_ENDS_BEFORE


def sections(script):
    """Line numbers of the `# ABLATIONS` (None if the script has none) and `# INFRASTRUCTURE` comment lines."""
    with open(os.path.join(ROOT, script), encoding="utf-8") as f:
        lines = f.read().splitlines()
    starts = {marker: [n for n, line in enumerate(lines, 1) if line.startswith(f"# {marker}")]
              for marker in ("ABLATIONS", "INFRASTRUCTURE")}
    assert len(starts["ABLATIONS"]) <= 1 and len(starts["INFRASTRUCTURE"]) == 1, starts
    return (starts["ABLATIONS"] or [None])[0], starts["INFRASTRUCTURE"][0]


def ablation_calls_off_a_branch(script):
    """(line, name) for each use, above the ablation section, of a name defined in it, on a line with no ` if `."""
    ablations, infrastructure = sections(script)
    if ablations is None:
        return []
    defined = {node.name for node in tree(script).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
               and ablations < node.lineno < infrastructure}
    with open(os.path.join(ROOT, script), encoding="utf-8") as f:
        lines = f.read().splitlines()
    return [(node.lineno, node.id) for node in ast.walk(tree(script)) if isinstance(node, ast.Name)
            and node.id in defined and node.lineno < ablations and " if " not in lines[node.lineno - 1]]


@pytest.mark.parametrize("script", LEARNERS)
def test_the_paper_path_comes_first_and_calls_an_ablation_only_from_a_one_line_branch(script):
    ablations, infrastructure = sections(script)
    lines = top_level(script)
    assert function(script, "main").end_lineno < (ablations or infrastructure) < infrastructure + 1
    assert infrastructure < lines["parse_args"]
    assert ablation_calls_off_a_branch(script) == []


def test_an_ablation_called_off_a_branch_is_found(tmp_path, monkeypatch):
    (tmp_path / "ab.py").write_text("def main():\n    a = variant() if flag else paper()\n    b = variant()\n\n\n"
                                    "# ABLATIONS\ndef variant():\n    pass\n\n\n# INFRASTRUCTURE\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert ablation_calls_off_a_branch("ab.py") == [(3, "variant")]


@pytest.mark.parametrize("script", LEARNERS)
def test_main_is_the_training_loop_between_the_algorithm_and_the_infrastructure(script):
    """Networks and the replay buffer come before `main`, the command line after it; `main` fits in 150 lines and
    holds no closure but its gradient step(s)."""
    lines = top_level(script)
    main = function(script, "main")
    assert main.end_lineno - main.lineno + 1 <= 150, f"{script}: main runs {main.end_lineno - main.lineno + 1} lines"
    assert max(line for definition, line in lines.items() if definition.endswith("Buffer")) < lines["main"]
    assert lines["main"] < lines["parse_args"]
    steps = {"hierarchical.py": {"sac_update", "ppo_update"}}.get(script, {"update"})
    assert {inner.name for inner in nested_functions(main)} == steps


@pytest.mark.parametrize("script", [f"{name(agent)}.py" for agent in AGENTS])
def test_update_returns_its_stats_by_name(script):
    (update,) = [inner for inner in nested_functions(function(script, "main")) if inner.name == "update"]
    returns = [node.value for node in ast.walk(update) if isinstance(node, ast.Return)]
    assert returns and all(isinstance(value, (ast.Dict, ast.DictComp)) for value in returns)
    names = [key.value for node in ast.walk(update) if isinstance(node, ast.Dict) for key in node.keys
             if isinstance(key, ast.Constant)]
    assert any(name.endswith("_loss") for name in names), names


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_start_up_prints_the_flags_resolved_from_the_env(agent, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, ckpt = agent.parse_args(["--env-id", "HalfCheetah", "--no-cuda"])
    *_, writer = agent.start_run(args, ckpt)
    writer.close()
    printed = capsys.readouterr().out
    spec = envs.ENV_SPECS["HalfCheetah"]
    assert f"HalfCheetah (horizon {spec.horizon})" in printed, printed
    resolved = agent.env_defaults("HalfCheetah")  # the flags whose default depends on the env
    assert {"total_env_steps", "eval_every", "buffer_size", "num_envs"} <= set(resolved)
    for flag in resolved:
        assert f"--{flag.replace('_', '-')} {getattr(args, flag)}" in printed, (flag, printed)


def names_read_before_main_assigns_them(script):
    """(function, name, line) for each name a function nested in `main` reads that `main` first assigns after it."""
    main = function(script, "main")
    nested = nested_functions(main)
    inside = {id(node) for inner in nested for node in ast.walk(inner)}
    first_assigned = {}
    for node in ast.walk(main):
        if id(node) not in inside and isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            first_assigned[node.id] = min(node.lineno, first_assigned.get(node.id, node.lineno))
    late = []
    for inner in nested:
        own = {arg.arg for arg in ast.walk(inner.args) if isinstance(arg, ast.arg)}
        own |= {node.id for node in ast.walk(inner) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
        late += sorted({(inner.name, node.id, first_assigned[node.id]) for node in ast.walk(inner)
                        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in own
                        and first_assigned.get(node.id, 0) > inner.lineno})
    return late


def test_a_late_name_is_found(tmp_path, monkeypatch):
    (tmp_path / "late.py").write_text("def main():\n    a = 1\n    def update():\n        return a + b\n    b = 2\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))  # tree() reads from ROOT
    assert names_read_before_main_assigns_them("late.py") == [("update", "b", 5)]


@pytest.mark.parametrize("script", [f"{name(agent)}.py" for agent in AGENTS] + ["hierarchical.py"])
def test_no_closure_reads_a_name_main_assigns_after_it(script):
    assert names_read_before_main_assigns_them(script) == []
