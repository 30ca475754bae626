"""goal_reaching.py: the metrics on scripted trajectories, the goal observations, each skill inference on hand-set
φ outputs, end to end on tiny checkpoints of every goal-capable agent, and bad input."""

import contextlib
import copy
import errno
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import FIVE_EPOCHS, fill_disk, name, run_agent, small_disk

import cic
import csf
import dads
import diayn
import envs
import goal_reaching
import metra
import visr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRIC_KEYS = {"staying_time_3", "hit_3", "end_3", "staying_time_1", "hit_1", "end_1", "final_distance", "progress"}


def test_metrics_of_a_scripted_episode():
    start, goal = np.array([10.0, 0.0]), np.array([0.0, 0.0])
    positions = np.array([[5.0, 0.0], [2.5, 0.0], [0.0, 0.5], [3.0, 4.0]])  # distances 5, 2.5, 0.5, 5 after each step
    m = goal_reaching.goal_metrics(start, positions, goal)
    assert m == {"staying_time_3": 0.5, "hit_3": 1.0, "end_3": 0.0, "staying_time_1": 0.25, "hit_1": 1.0,
                 "end_1": 0.0, "final_distance": 5.0, "progress": 5.0}
    # 1-D (HalfCheetah): ends inside both radii; the start is not a post-step position and never counts
    m = goal_reaching.goal_metrics(np.array([0.0]), np.array([[50.0], [99.5], [100.2]]), np.array([100.0]))
    assert (m["staying_time_3"], m["staying_time_1"], m["end_1"]) == (pytest.approx(2 / 3), pytest.approx(2 / 3), 1.0)
    assert m["final_distance"] == pytest.approx(0.2) and m["progress"] == pytest.approx(99.8)


@pytest.mark.parametrize("env_id", ["Ant", "HalfCheetah"])
def test_a_state_goal_is_a_reset_state_with_only_its_position_replaced(env_id):
    env = envs.make_env(env_id).unwrapped
    env.reset(seed=0)
    goal = np.array([12.5, -30.0])[: env.coord_dim]
    obs = env.goal_observation(goal)
    # the env stays in the goal state: its position is the goal, the rest a fresh reset pose and velocity
    assert np.array_equal(env.data.qpos[: env.coord_dim], goal)
    assert np.all(np.abs(env.data.qpos[env.coord_dim:] - env.model.qpos0[env.coord_dim:]) <= 0.1)
    assert np.abs(env.data.qvel).max() < 1.0
    assert np.array_equal(obs, env._obs())  # normalized as every observation of the env
    assert not np.allclose(obs[: env.coord_dim], 0)


def test_skill_inference_on_hand_set_phi():
    phi_goal, phi_obs = torch.tensor([[3.0, 5.0, 1.0]]), torch.tensor([[0.0, 1.0, 1.0]])
    # CSF / METRA: the unit direction φ(g) - φ(s) = (3, 4, 0) / 5
    for agent in ("csf", "metra"):
        assert goal_reaching.infer_skill(agent, False, phi_goal, phi_obs)[0].tolist() == pytest.approx([0.6, 0.8, 0.0])
    # one-hot METRA: the largest coordinate of φ(g) - φ(s) (index 1), not of φ(g) alone
    assert goal_reaching.infer_skill("metra", True, phi_goal, torch.tensor([[0.0, 4.0, 1.0]])).tolist() == [[1, 0, 0]]
    # VISR: ê(g), whatever s is
    expected = (phi_goal / phi_goal.norm())[0].tolist()
    assert goal_reaching.infer_skill("visr", False, phi_goal, phi_obs)[0].tolist() == pytest.approx(expected)
    # DIAYN: argmax q(·|g)
    assert goal_reaching.infer_skill("diayn", True, phi_goal, phi_obs).tolist() == [[0, 1, 0]]


def reach(checkpoint, *flags):
    return goal_reaching.main(*goal_reaching.parse_args(["--checkpoint", checkpoint, "--no-cuda", *flags]))


@pytest.mark.parametrize("agent", [csf, metra, diayn, visr], ids=name)
def test_end_to_end_on_a_tiny_checkpoint(agent, tiny_run):
    run_dir, _ = tiny_run(agent, *FIVE_EPOCHS)
    checkpoint = os.path.join(run_dir, "checkpoint.pt")
    report = reach(checkpoint, "--num-goals", "2", "--seed", "4")
    assert report["agent"] == name(agent) and report["env_steps"] == 2000 and list(report["results"]) == ["adaptive"]
    result = report["results"]["adaptive"]
    assert len(result["per_goal"]) == 2 and set(result["mean"]) == METRIC_KEYS
    for goal in result["per_goal"]:
        assert np.all(np.abs(goal["goal"]) <= 50)
        for radius in ("3", "1"):
            assert 0 <= goal[f"staying_time_{radius}"] <= goal[f"hit_{radius}"] <= 1
        assert goal["final_distance"] >= 0
    with open(os.path.join(run_dir, "goal_reaching.json")) as f:
        assert json.load(f)["results"] == report["results"]
    assert os.path.getsize(os.path.join(run_dir, "goal_reaching.png")) > 0
    again = reach(checkpoint, "--num-goals", "2", "--seed", "4")
    assert again["results"] == report["results"]  # same seed, same numbers
    other = reach(checkpoint, "--num-goals", "1", "--seed", "5", "--deterministic")
    assert other["results"]["adaptive"]["per_goal"][0]["goal"] != result["per_goal"][0]["goal"]


def test_one_hot_metra_reports_the_single_and_the_adaptive_inference(tmp_path):
    run_dir = run_agent(metra, tmp_path, "--env-id", "HalfCheetah", "--total-env-steps", "400", "--num-envs", "2",
                        "--learning-starts", "400", "--grad-steps-per-epoch", "1", "--batch-size", "8",
                        "--hidden-dim", "8", "--num-eval-skills", "1", "--no-cuda")
    report = reach(os.path.join(run_dir, "checkpoint.pt"), "--num-goals", "2")
    assert list(report["results"]) == ["adaptive", "single"]
    goals = [[g["goal"] for g in report["results"][v]["per_goal"]] for v in ("adaptive", "single")]
    assert goals[0] == goals[1] and all(len(g) == 1 and abs(g[0]) <= 100 for g in goals[0])  # the same 1-D goals
    for variant in ("adaptive", "single"):
        assert os.path.isfile(os.path.join(run_dir, f"goal_reaching_{variant}.png"))


def refuses(argv):
    with pytest.raises(SystemExit) as stop:
        goal_reaching.parse_args(argv)
    message = str(stop.value.code)
    assert "\n" not in message and message.startswith("goal_reaching.py: error: ")
    return message


def test_bad_input_is_one_line(tmp_path):
    assert "give exactly one of" in refuses([])
    assert "no checkpoint file at nope.pt" in refuses(["--checkpoint", "nope.pt"])
    assert "no run folder at" in refuses(["--run", str(tmp_path / "missing")])
    (tmp_path / "empty_run").mkdir()
    assert "holds no checkpoint.pt" in refuses(["--run", str(tmp_path / "empty_run")])
    (tmp_path / "corrupt.pt").write_bytes(b"\x00not a checkpoint")
    assert "is not a readable checkpoint" in refuses(["--checkpoint", str(tmp_path / "corrupt.pt")])
    for other in ("cic", "dads"):
        torch.save({"agent": other, "args": {"env_id": "Ant"}}, tmp_path / f"{other}.pt")
        assert f"the paper defines no zero-shot goal inference for {other}" in refuses(
            ["--checkpoint", str(tmp_path / f"{other}.pt")])
    assert "--num-goals must be in [1, inf)" in refuses(["--checkpoint", "x.pt", "--num-goals", "0"])
    torch.save({"agent": "csf", "args": {"env_id": "Ant", "critic": "mlp"}}, tmp_path / "mlp.pt")
    assert "trained with --critic mlp" in refuses(["--checkpoint", str(tmp_path / "mlp.pt")])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "goal_reaching.py"), "--run", str(tmp_path / "empty_run")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("agent", [cic, dads], ids=name)
def test_checkpoints_of_agents_without_goal_inference_are_refused(agent, tiny_run):
    run_dir, _ = tiny_run(agent, *FIVE_EPOCHS)
    message = refuses(["--run", run_dir])
    assert message.endswith(f"is a {name(agent)} checkpoint; the paper defines no zero-shot goal inference for "
                            f"{name(agent)}, only for csf, metra, diayn, visr")


def damaged(tmp_path, checkpoint, label, change):
    """A copy of the checkpoint dict with `change` applied, saved as <tmp_path>/<label>/checkpoint.pt."""
    ckpt = copy.deepcopy(checkpoint)
    change(ckpt)
    (tmp_path / label).mkdir()
    torch.save(ckpt, tmp_path / label / "checkpoint.pt")
    return str(tmp_path / label / "checkpoint.pt")


def test_damaged_old_and_diverged_checkpoints_are_one_line(tiny_run, tmp_path):
    run_dir, _ = tiny_run(csf, *FIVE_EPOCHS)
    good = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=False)
    first_phi_weight = next(iter(good["phi"]))
    cases = {  # what changes -> what the one line says
        "old": (lambda c: c["args"].pop("skill_dim"), "lacks skill_dim: it was not written by this version of csf.py"),
        "no_actor": (lambda c: c.pop("actor"), "lacks actor: it was not written by this version of csf.py"),
        "unknown_env": (lambda c: c["args"].update(env_id="Foo"), "was trained on 'Foo', a world envs.py does not have"),
        "args_not_a_dict": (lambda c: c.update(args=["Ant"]), "is not a cleanmisl checkpoint"),
        "diverged": (lambda c: c["phi"][first_phi_weight].view(-1)[0].fill_(float("nan")),
                     f"holds NaN or infinite weights (phi.{first_phi_weight}): its run diverged"),
    }
    for label, (change, expected) in cases.items():
        path = damaged(tmp_path, good, label, change)
        assert refuses(["--checkpoint", path]) == f"goal_reaching.py: error: {path} {expected}", label
    # other shapes: found when the networks are built from the flags
    path = damaged(tmp_path, good, "other_shapes", lambda c: c["args"].update(hidden_dim=32))
    with pytest.raises(SystemExit) as stop:
        reach(path, "--num-goals", "1")
    message = str(stop.value.code)
    assert "\n" not in message and message.startswith(f"goal_reaching.py: error: {path}'s phi does not fit csf.py's "
                                                      "network (size mismatch for ")
    # more goals than memory: refused before anything is drawn
    message = refuses(["--checkpoint", os.path.join(run_dir, "checkpoint.pt"), "--num-goals", str(10**12)])
    assert "--num-goals 1000000000000 needs about" in message and "GiB of memory is free" in message


def test_full_disk_and_read_only_folder_keep_the_earlier_results(tiny_run, tmp_path):
    run_dir, _ = tiny_run(csf, *FIVE_EPOCHS)
    with small_disk(tmp_path / "disk", 16) as disk:
        shutil.copy(os.path.join(run_dir, "checkpoint.pt"), disk)
        checkpoint = str(disk / "checkpoint.pt")
        reach(checkpoint, "--num-goals", "2")
        earlier = {name: (disk / name).read_bytes() for name in ("goal_reaching.json", "goal_reaching.png")}
        fill_disk(disk)
        with pytest.raises(SystemExit) as stop:
            reach(checkpoint, "--num-goals", "2", "--seed", "1")
        assert str(stop.value.code) == (f"goal_reaching.py: error: cannot write {disk / 'goal_reaching.png'}: "
                                        "No space left on device")
        (disk / "filler").unlink()
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with pytest.raises(SystemExit) as stop:
            reach(checkpoint, "--num-goals", "2", "--seed", "1")
        assert str(stop.value.code) == (f"goal_reaching.py: error: cannot write {disk / 'goal_reaching.png'}: "
                                        "Read-only file system")
        assert {name: (disk / name).read_bytes() for name in earlier} == earlier  # both results whole
        assert sorted(os.listdir(disk)) == ["checkpoint.pt", "goal_reaching.json", "goal_reaching.png"]  # no .tmp


def test_a_json_write_cut_short_keeps_the_earlier_result(tiny_run, tmp_path, monkeypatch):
    """The disk fills up in the middle of goal_reaching.json (the plots fitted): the earlier file stays whole."""
    run_dir, _ = tiny_run(csf, *FIVE_EPOCHS)
    shutil.copy(os.path.join(run_dir, "checkpoint.pt"), tmp_path)
    checkpoint, result = str(tmp_path / "checkpoint.pt"), tmp_path / "goal_reaching.json"
    reach(checkpoint, "--num-goals", "2")
    earlier = result.read_bytes()

    def disk_full_midway(report, f, **kwargs):
        f.write(json.dumps(report)[:100])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(json, "dump", disk_full_midway)
    with pytest.raises(SystemExit) as stop:
        reach(checkpoint, "--num-goals", "2", "--seed", "1")
    assert str(stop.value.code) == f"goal_reaching.py: error: cannot write {result}: No space left on device"
    assert result.read_bytes() == earlier and not os.path.exists(f"{result}.tmp")


@pytest.mark.parametrize("flag, value, message", [
    ("--num-goals", "0", "--num-goals must be in [1, inf), got 0"),
    ("--num-goals", "-1", "--num-goals must be in [1, inf), got -1"),
    ("--seed", "-1", "--seed must be in [0, 2147483647], got -1"),
    ("--seed", str(2**31), "--seed must be in [0, 2147483647], got 2147483648"),
])
def test_every_numeric_flag_outside_its_range_is_one_line(flag, value, message):
    assert message in refuses(["--checkpoint", "x.pt", flag, value])


@pytest.mark.parametrize("value", ["nan", "inf", "1e3", ""])
def test_a_value_that_is_no_integer_is_tyros_usage_error(value, capsys):
    with pytest.raises(SystemExit) as stop:
        goal_reaching.parse_args(["--checkpoint", "x.pt", "--num-goals", value])
    assert stop.value.code == 2 and "Traceback" not in capsys.readouterr().err
