"""Every agent's command line: every numeric flag is checked against its range, bad input of any kind ends in one
line and a non-zero exit (a value outside a flag's choices: tyro's own short box), never a traceback or a silent run;
--help gives each flag a whole sentence; --resume continues a run with its own flags.
Checked in this process on `parse_args`; one subprocess per agent shows what reaches the terminal."""

import dataclasses
import os
import re
import subprocess
import sys
import typing
from typing import Optional

import pytest
import torch
from conftest import AGENTS, FIVE_EPOCHS, load, name

import hierarchical

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMERIC = (int, float, Optional[int], Optional[float])


def rejects(agent, argv):
    """The one-line message with which parse_args refuses argv."""
    with pytest.raises(SystemExit) as stop:
        agent.parse_args(argv)
    message = str(stop.value.code)
    assert "\n" not in message and message.startswith(f"{name(agent)}.py: error: "), message
    return message


def outside(interval):
    """Values just outside an interval written like "[0, 1)"; NaN and inf are outside every range."""
    low, high = (float(end) for end in interval[1:-1].split(","))
    values = [low - 1, low] if interval[0] == "(" else [low - 1]
    if high != float("inf"):
        values += [high] if interval[-1] == ")" else [high + 1]
    return values


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_every_numeric_flag_has_a_range(agent):
    numeric = {field.name for field in dataclasses.fields(agent.Args) if field.type in NUMERIC}
    assert numeric == set(agent.FLAG_RANGES)


@pytest.mark.parametrize("agent, flag", [(a, f) for a in AGENTS for f in a.FLAG_RANGES], ids=lambda x: getattr(x, "__name__", x))
def test_a_value_outside_a_flag_range_is_one_line_naming_the_flag_and_range(agent, flag):
    interval = agent.FLAG_RANGES[flag]
    is_float = {field.name: field.type for field in dataclasses.fields(agent.Args)}[flag] in (float, Optional[float])
    values = outside(interval) + ([float("nan"), float("inf")] if is_float else [])
    option = "--" + flag.replace("_", "-")
    for value in values:
        text = repr(value) if is_float else str(int(value))
        message = rejects(agent, [f"{option}={text}"])
        assert f"{option} must be in {interval}, got " in message, message


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_the_edges_that_mean_something_are_accepted(agent):
    edges = {"gamma": 0, "tau": 1, "xi": 0, "alpha": 0, "seed": 0, "grad_steps_per_epoch": 0, "learning_starts": 0,
             "num_eval_skills": 1}
    edges = {flag: value for flag, value in edges.items() if flag in agent.FLAG_RANGES}
    args, _ = agent.parse_args([f"--{flag.replace('_', '-')}={value}" for flag, value in edges.items()])
    assert {flag: getattr(args, flag) for flag in edges} == edges
    args, _ = agent.parse_args(["--total-env-steps", "1600", "--buffer-size", "1600", "--learning-starts", "1600"])
    assert args.total_env_steps == 1600  # exactly one epoch of 8 × 200 steps, learning after it


@pytest.mark.parametrize("agent", AGENTS, ids=name)
@pytest.mark.parametrize("argv, message", [
    (["--skill-dim", "0"], "--skill-dim must be in ["),
    (["--gamma", "1"], "--gamma must be in [0, 1), got 1.0"),
    (["--tau", "0"], "--tau must be in (0, 1], got 0.0"),
    (["--total-env-steps", "1000"], "--total-env-steps must cover one epoch (--num-envs × 200 = 1600 env steps), got 1000"),
    (["--buffer-size", "1000"], "--buffer-size must hold one epoch (--num-envs × 200 = 1600 transitions), got 1000"),
    (["--total-env-steps", "5000"], "--learning-starts must be at most --total-env-steps and --buffer-size"),
    (["--buffer-size", "1700", "--learning-starts", "1700"], "--learning-starts must be at most"),  # 8 whole trajectories
    (["--total-env-steps", "11000"], "trajectories (9600), or the run never learns; got 10000"),  # 6 whole epochs
    (["--resume", "no/such/file.pt"], "no checkpoint file at no/such/file.pt"),
])
def test_bad_input_is_one_line(agent, argv, message):
    assert message in rejects(agent, argv)


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_a_file_that_is_no_checkpoint_of_this_agent_is_one_line(agent, tmp_path):
    other = "metra" if name(agent) == "csf" else "csf"
    torch.save({"agent": other, "args": {"env_id": "Ant"}}, tmp_path / "other.pt")
    assert rejects(agent, ["--resume", str(tmp_path / "other.pt")]).endswith(
        f"{tmp_path / 'other.pt'} is a {other} checkpoint, not a {name(agent)} one")
    (tmp_path / "notes.txt").write_text("hello")
    assert "notes.txt is not a readable checkpoint" in rejects(agent, ["--resume", str(tmp_path / "notes.txt")])
    torch.save({"weights": 1}, tmp_path / "plain.pt")
    assert rejects(agent, ["--resume", str(tmp_path / "plain.pt")]).endswith("plain.pt is not a cleanmisl checkpoint")
    torch.save({"agent": name(agent), "args": {"env_id": "Ant", "bogus_flag": 1}}, tmp_path / "future.pt")
    assert "another version" in rejects(agent, ["--resume", str(tmp_path / "future.pt")])


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_a_checkpoint_of_another_version_is_one_line(agent, tiny_run, tmp_path, monkeypatch):
    """A checkpoint whose flags this version knows but whose state it does not (a key added since, a network of
    another shape) stops the resume with one line, not a KeyError or a state-dict traceback."""
    run_dir, _ = tiny_run(agent, *FIVE_EPOCHS)
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    monkeypatch.chdir(tmp_path)
    critic = "psi" if "psi" in ckpt else "qf"
    for broken, detail in (({k: v for k, v in ckpt.items() if k != "rngs"}, "'rngs'"),
                           ({k: v for k, v in ckpt.items() if k != critic}, f": it has no {critic}"),
                           ({**ckpt, "actor": {k: v[..., :1] for k, v in ckpt["actor"].items()}}, "'s actor does "
                            f"not fit this {name(agent)}.py (Error(s) in loading state_dict for Actor: size mismatch")):
        torch.save(broken, tmp_path / "old.pt")
        with pytest.raises(SystemExit) as stop:
            agent.main(*agent.parse_args(["--resume", str(tmp_path / "old.pt"), "--total-env-steps", "4000"]))
        message = str(stop.value.code)
        assert "\n" not in message and message.startswith(f"{name(agent)}.py: error: {tmp_path / 'old.pt'}")
        assert detail in message, message


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_resume_keeps_the_run_flags_and_refuses_a_conflict(agent, tiny_run):
    run_dir, _ = tiny_run(agent, *FIVE_EPOCHS)
    path = os.path.join(run_dir, "checkpoint.pt")  # epoch 5 of 5, --hidden-dim 16, --num-envs 2
    # what does not change the learning problem may change: the budget, periods, device, tracking, video
    args, ckpt = agent.parse_args(["--resume", path, "--total-env-steps", "4000", "--eval-every", "3",
                                   "--checkpoint-every", "7", "--cuda", "--track", "--capture-video"])
    assert (args.total_env_steps, args.eval_every, args.checkpoint_every, args.cuda, args.track, args.capture_video) \
        == (4000, 3, 7, True, True, True)
    assert args.hidden_dim == 16 and args.num_envs == 2 and args.resume == path and ckpt["epoch"] == 5
    # a flag of the learning problem may be typed again with its value, and is refused with another, naming both
    assert agent.parse_args(["--resume", path, "--total-env-steps", "2400", "--hidden-dim", "16"])[0].hidden_dim == 16
    assert rejects(agent, ["--resume", path, "--total-env-steps", "2400", "--hidden-dim", "32"]).endswith(
        f"{path} was trained with --hidden-dim 16, not 32")
    assert rejects(agent, ["--resume", path, "--env-id", "HalfCheetah"]).endswith(
        f"{path} was trained with --env-id Ant, not HalfCheetah")
    assert rejects(agent, ["--resume", path, "--seed", "2"]).endswith(f"{path} was trained with --seed 1, not 2")
    # the run is finished at its budget: continuing needs a larger one
    assert rejects(agent, ["--resume", path]).endswith(
        f"{path} has already trained for 2000 env steps; give a larger --total-env-steps to continue it")


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_from_the_shell_a_bad_value_is_one_line_without_traceback(agent, tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, f"{name(agent)}.py"), "--gamma", "1.5"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == f"{name(agent)}.py: error: --gamma must be in [0, 1), got 1.5\n"
    assert not os.path.exists(tmp_path / "runs")  # refused before anything was written


@pytest.mark.parametrize("agent", [a for a in AGENTS if name(a) != "dads"], ids=name)  # DADS refuses pixels first
def test_pixel_env_without_opengl_is_one_line_naming_the_package(agent, tmp_path):
    # hide libOSMesa from this process, as on a machine without the system package (envs stepped in this process:
    # worker processes would not see the patch; tests/test_parallel_envs.py checks that their errors come back)
    script = ("import ctypes.util, runpy, sys\n"
              "find = ctypes.util.find_library\n"
              "ctypes.util.find_library = lambda name: None if name == 'OSMesa' else find(name)\n"
              f"sys.argv = ['{name(agent)}.py', '--env-id', 'Humanoid', '--no-cuda', '--no-parallel-envs']\n"
              f"runpy.run_path({os.path.join(ROOT, name(agent) + '.py')!r}, run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MUJOCO_GL": "osmesa", "PYTHONPATH": ROOT})
    assert proc.returncode != 0
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"{name(agent)}.py: error: cannot render") and "libosmesa6" in line


def choice_flags(agent):
    """Each flag with a fixed set of values (a Literal field of Args), and its values."""
    return {field.name: typing.get_args(field.type) for field in dataclasses.fields(agent.Args)
            if typing.get_origin(field.type) is typing.Literal}


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_a_choice_flag_lists_its_choices_and_refuses_another_value(agent, capsys):
    flags = choice_flags(agent)
    assert "Ant" in flags["env_id"] and not any(f.type is str and f.name.endswith(("_id", "loss", "norm", "critic"))
                                                for f in dataclasses.fields(agent.Args))  # no free-text choice left
    for flag, choices in flags.items():
        option = "--" + flag.replace("_", "-")
        with pytest.raises(SystemExit) as stop:  # tyro's own answer: the flag, the value, the choices, no traceback
            agent.parse_args([option, "nonsense"])
        message = capsys.readouterr().err
        assert stop.value.code == 2 and "Traceback" not in message and "nonsense" in message and option in message
        assert all(choice in message for choice in choices), message
        for choice in choices:  # every choice is accepted (alone, on Ant: METRA-C needs unit-sphere skills)
            assert getattr(agent.parse_args([option, choice, *(["--env-id", "Ant"] if flag != "env_id" else [])])[0],
                           flag) == choice


def help_texts(agent, capsys, monkeypatch):
    """Each option's help in `--help`, as one line (a terminal wide enough for every help)."""
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        agent.parse_args(["--help"])
    rows = [line.strip("│ ") for line in capsys.readouterr().out.splitlines()]  # a box on a terminal, else rules
    rows = rows[rows.index(next(row for row in rows if row.startswith("-h, --help"))) + 1:]
    texts, option = {}, None
    for row in rows:
        match = re.fullmatch(r"(--[\w-]+)(?:, --[\w-]+)?(?: \S+)?(?:\s{2,}(.*))?", row)
        if not row or row.startswith(("╰", "─", "-" * 10)):
            continue
        if match:
            option = match[1]
        if option and (match and match[2] or not match):
            texts[option] = (match[2] if match else row).split(" (default:")[0]
    return texts


@pytest.mark.parametrize("agent", [*AGENTS, hierarchical], ids=name)
def test_help_gives_every_flag_a_whole_sentence_and_lists_choices(agent, capsys, monkeypatch):
    texts = help_texts(agent, capsys, monkeypatch)
    fields = dataclasses.fields(agent.Args)
    assert set(texts) == {"--" + field.name.replace("_", "-") for field in fields}
    broken = {option: text for option, text in texts.items() if not (text[0].isupper() and text.endswith("."))}
    assert not broken, broken
    # a flag whose default is None says what a run does when it is left unset (tyro's "(default: None)" does not)
    silent = {field.name: texts["--" + field.name.replace("_", "-")] for field in fields
              if field.default is None and "unset" not in texts["--" + field.name.replace("_", "-")]}
    assert not silent, silent
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        agent.parse_args(["--help"])
    listed = capsys.readouterr().out
    for flag, choices in choice_flags(agent).items():
        assert f"--{flag.replace('_', '-')} {{{','.join(choices)}}}" in listed
