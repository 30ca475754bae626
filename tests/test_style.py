"""How the scripts read, beside CleanRL's sac_continuous_action.py: the first reading (line 1 to the end of `main`) is
the paper, in plain lines; the ablations and the infrastructure follow it; `main` is a loop a student reads in one
sitting and jumps forward from only to name what happens (start the run, evaluate, checkpoint, log); the whole file
is plain too, and holds no more content than its budget. Also: named stats, lines within 120 characters, references
a reader can follow, and the flags a run resolved from its env.

A code line is a line with code on it (docstrings and comments are prose: not counted); its characters are counted
up to a trailing comment. A file's content is its Python tokens, as `tokenize` gives them, without comments, line
breaks and indentation, a docstring counting as one token.

    python -m pytest -q tests/test_style.py     # a few seconds
"""

import ast
import io
import os
import re
import subprocess
import sys
import tokenize
import types

import pytest
import torch
from conftest import AGENTS, name

import envs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEARNERS = [f"{name(agent)}.py" for agent in AGENTS] + ["hierarchical.py"]
# the first reading (line 1 to the end of main), main, and the whole file (CleanRL's SAC: 8.8 tokens, 43.5 characters
# a code line)
FIRST_READING = {"lines": 480, "tokens per code line": 9.5, "characters per code line": 46, "code lines over 100": 8,
                 "walrus": 0, "generators unpacked into names": 0, "conditional expressions": 3}
MAIN = {"lines": 130, "calls to definitions after main": 6}
WHOLE = {"lines": 900, "tokens per code line": 10.5, "characters per code line": 50, "code lines over 100": 20}
# each learner's tokens, 10% above what it holds now: room for a student's flag, not for packed lines
TOKENS = {"csf.py": 8237, "metra.py": 8560, "diayn.py": 7552, "visr.py": 7482, "cic.py": 7927, "dads.py": 7128,
          "hierarchical.py": 8264}
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


SKIPPED_TOKENS = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                  tokenize.ENDMARKER)


def figures(source):
    """How a script reads: its first reading (line 1 to the end of `main`), `main`, the whole file."""
    lines = source.splitlines()
    module = ast.parse(source)
    main = next(node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    prose = set()  # the lines of every docstring, a string standing alone as a statement
    for node in ast.walk(module):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            prose.update(range(node.lineno, node.end_lineno + 1))
    tokens, ends = {}, {}  # per code line: its tokens, and the column where its code ends
    all_tokens = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in SKIPPED_TOKENS:
            continue
        all_tokens += 1
        if token.start[0] in prose:
            continue
        tokens[token.start[0]] = tokens.get(token.start[0], 0) + 1
        for number in range(token.start[0], token.end[0] + 1):
            ends[number] = token.end[1] if number == token.end[0] else len(lines[number - 1])

    def density(numbers):
        return {"tokens per code line": sum(tokens.get(n, 0) for n in numbers) / len(numbers),
                "characters per code line": sum(ends[n] for n in numbers) / len(numbers),
                "code lines over 100": sum(ends[n] > 100 for n in numbers)}

    first = [node for node in ast.walk(module) if getattr(node, "lineno", main.end_lineno + 1) <= main.end_lineno]
    later = {node.name for node in module.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
             and node.lineno > main.end_lineno}
    called = {node.func.id for node in ast.walk(main) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Name) and node.func.id in later}
    return {
        "first reading": {"lines": main.end_lineno, **density([n for n in ends if n <= main.end_lineno]),
                          "walrus": sum(isinstance(node, ast.NamedExpr) for node in first),
                          "generators unpacked into names": sum(
                              isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
                              and isinstance(node.value, ast.GeneratorExp) for node in first),
                          "conditional expressions": sum(isinstance(node, ast.IfExp) for node in first)},
        "main": {"lines": main.end_lineno - main.lineno + 1, "calls to definitions after main": len(called)},
        "whole": {"lines": len(lines), **density(list(ends))},
        "tokens": all_tokens,
    }


def over(measured, limits):
    return {figure: round(measured[figure], 2) for figure, limit in limits.items() if measured[figure] > limit}


@pytest.mark.parametrize("script", LEARNERS)
def test_the_first_reading_main_and_the_whole_file_read_plainly(script):
    with open(os.path.join(ROOT, script), encoding="utf-8") as f:
        measured = figures(f.read())
    assert over(measured["first reading"], FIRST_READING) == {}, measured["first reading"]
    assert over(measured["main"], MAIN) == {}, measured["main"]
    assert over(measured["whole"], WHOLE) == {}, measured["whole"]
    assert measured["tokens"] <= TOKENS[script], (measured["tokens"], TOKENS[script])


def test_the_figures_count_what_they_say():
    """A hand-counted script: prose is not code, a trailing comment not counted in a line's width, a docstring one
    token; the conditional expression, the walrus, the generator unpacked into names and the call forward are found."""
    source = ('"""A module docstring."""\n'
              "import os  # a comment\n"
              "\n"
              "def main():\n"
              '    """Its docstring."""\n'
              "    a, b = (x for x in (1, 2))\n"
              "    c = 1 if (d := 2) else 3\n"
              "    later()\n"
              "\n"
              "\n"
              "def later():\n"
              "    return 1\n")
    measured = figures(source)
    assert measured["first reading"] == {"lines": 8, "tokens per code line": (2 + 5 + 15 + 11 + 3) / 5,
                                         "characters per code line": (9 + 11 + 30 + 28 + 11) / 5,
                                         "code lines over 100": 0, "walrus": 1, "generators unpacked into names": 1,
                                         "conditional expressions": 1}
    assert measured["main"] == {"lines": 5, "calls to definitions after main": 1}
    assert measured["whole"]["lines"] == 12 and measured["tokens"] == 1 + 2 + 5 + 1 + 15 + 11 + 3 + 5 + 2


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
    """The losses and networks come before `main`; the replay buffer and the command line after it (the buffer is
    infrastructure, as SB3's is to CleanRL's SAC); `main` holds no closure but its gradient step(s)."""
    lines = top_level(script)
    main = function(script, "main")
    assert lines["Actor" if script != "hierarchical.py" else "QNetwork"] < lines["main"] < lines["parse_args"]
    assert min(line for definition, line in lines.items() if definition.endswith("Buffer")) > lines["main"]
    steps = {"hierarchical.py": {"sac_update", "ppo_update"}}.get(script, {"update"})
    assert {inner.name for inner in nested_functions(main)} == steps


@pytest.mark.parametrize("script", [f"{name(agent)}.py" for agent in AGENTS])
def test_update_returns_its_stats_by_name(script):
    (update,) = [inner for inner in nested_functions(function(script, "main")) if inner.name == "update"]
    returns = [node.value for node in ast.walk(update) if isinstance(node, ast.Return)]
    assert returns and all(isinstance(value, (ast.Dict, ast.DictComp)) for value in returns)
    names = [key.value for node in ast.walk(update) if isinstance(node, ast.Dict) for key in node.keys
             if isinstance(key, ast.Constant)]
    names += [keyword.arg for node in ast.walk(update) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Name) and node.func.id == "dict" for keyword in node.keywords]
    assert any(name.endswith("_loss") for name in names), names


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_start_up_prints_the_flags_resolved_from_the_env(agent, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, ckpt = agent.parse_args(["--env-id", "HalfCheetah", "--no-cuda"])
    train_envs, eval_envs = types.SimpleNamespace(), types.SimpleNamespace()
    run, progress = agent.start_run(args, ckpt, {}, train_envs, eval_envs, torch.device("cpu"))
    run.writer.close()
    assert progress["epoch"] == 0 and os.path.isdir(run.dir)
    assert train_envs.run_dir == eval_envs.run_dir == run.dir  # a dead env worker's line names its checkpoint
    printed = capsys.readouterr().out
    spec = envs.ENV_SPECS["HalfCheetah"]
    assert f"HalfCheetah (horizon {spec.horizon})" in printed, printed
    resolved = agent.env_defaults("HalfCheetah")  # the flags whose default depends on the env
    assert {"total_env_steps", "eval_every", "buffer_size", "num_envs"} <= set(resolved)
    for flag in resolved:
        assert f"--{flag.replace('_', '-')} {getattr(args, flag)}" in printed, (flag, printed)


@pytest.mark.parametrize("script", LEARNERS)
def test_a_dead_env_worker_ends_the_script_with_its_run_folder(script):
    """The script's `if __name__ == "__main__"` block ends a run whose env worker died (envs.WorkerDied) with
    error(e, e.run_dir): one line and the resume command (run for csf and dads in tests/test_agent_runs.py)."""
    tree = ast.parse(open(os.path.join(ROOT, script)).read())
    block = next(node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test))
    handlers = [node for node in ast.walk(block) if isinstance(node, ast.ExceptHandler)
                and "envs.WorkerDied" in ast.unparse(node.type)]
    assert handlers, f"{script} does not catch envs.WorkerDied"
    assert ast.unparse(handlers[0].body[0]) == "error(e, getattr(e, 'run_dir', None))"


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
