"""hierarchical.py: the action → skill mappings, GAE and the PPO loss on hand cases, a child that stays frozen, smoke
runs of SAC (continuous and one-hot children) and PPO from tiny checkpoints the tests train, and bad input."""

import copy
import dataclasses
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
from typing import Optional

import pytest
import torch
from conftest import FIVE_EPOCHS, load, read_evals, run_agent

import csf
import dads
import diayn
import envs
import hierarchical
import metra

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 2 high-level episodes (2 × 200 low-level steps) per epoch, evaluated every epoch on 2 episodes
TINY = ("--num-envs", "2", "--batch-size", "8", "--hidden-dim", "16", "--num-eval-episodes", "2", "--eval-every", "1",
        "--no-cuda")


def test_action_to_skill():
    a = torch.tensor([[3.0, -4.0], [0.5, 0.0]])
    assert torch.allclose(hierarchical.action_to_skill(a, "sphere", 2), torch.tensor([[0.6, -0.8], [1.0, 0.0]]))
    assert torch.equal(hierarchical.action_to_skill(a, "scaled", 2), 1.5 * a)
    one_hot = hierarchical.action_to_skill(torch.tensor([2, 0]), "one-hot", 4)
    assert one_hot.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]


def test_skill_kind_of_each_child():
    kinds = {("csf", False): "sphere", ("visr", False): "sphere", ("metra", False): "sphere",
             ("metra", True): "one-hot", ("diayn", None): "one-hot", ("cic", None): "scaled", ("dads", None): "scaled"}
    for (agent, discrete), kind in kinds.items():
        args = {} if discrete is None else {"discrete": discrete}
        assert hierarchical.skill_kind({"agent": agent, "args": args}) == kind, agent


def test_gae_and_monte_carlo_returns_on_a_hand_case():
    rewards, values = torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[0.5, 1.0, 1.5]])
    gamma, lam = 0.5, 0.5
    # the value after the last step is 0: δ = (1 + 0.5·1 - 0.5, 0 + 0.5·1.5 - 1, 2 - 1.5) = (1, -0.25, 0.5)
    deltas = [1.0, -0.25, 0.5]
    a2 = deltas[2]
    a1 = deltas[1] + gamma * lam * a2
    a0 = deltas[0] + gamma * lam * a1
    advantages, returns = hierarchical.gae(rewards, values, gamma, lam)  # flattened: one episode, three steps
    assert advantages.tolist() == pytest.approx([a0, a1, a2])
    assert returns.tolist() == pytest.approx([1 + 0.5 * 0 + 0.25 * 2, 0 + 0.5 * 2, 2])


def test_ppo_loss_clips_the_ratio():
    advantages = torch.tensor([1.0, -1.0])  # standardized: (1/√2·..): equal magnitude, opposite signs
    old = torch.zeros(2)
    # ratio e^0.5 ≈ 1.65 on both: the positive advantage is clipped at 1.2, the negative one is not (min)
    loss = hierarchical.ppo_policy_loss(torch.full((2,), 0.5), old, advantages, torch.zeros(2), 0.2, 0.01)
    std = advantages.std()
    expected = -((1.2 * 1 / std) + (math.exp(0.5) * -1 / std)) / 2
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    with_entropy = hierarchical.ppo_policy_loss(torch.full((2,), 0.5), old, advantages, torch.full((2,), 3.0), 0.2, 0.01)
    assert with_entropy.item() == pytest.approx(loss.item() - 0.03, rel=1e-5)


def test_sac_over_a_frozen_csf_child_crosses_updates_and_evaluations(tiny_run, tmp_path, monkeypatch):
    child_dir, _ = tiny_run(csf, *FIVE_EPOCHS)
    children = []

    class RecordedActor(csf.Actor):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            children.append(self)

    monkeypatch.setattr(csf, "Actor", RecordedActor)
    run_dir = run_agent(hierarchical, tmp_path, "--checkpoint", child_dir, "--task", "AntMultiGoal",
                        "--total-env-steps", "1200", "--learning-starts", "16", "--grad-steps-per-epoch", "2", *TINY)
    lines = read_evals(run_dir)
    # 16 high-level transitions stored after epoch 0: 2 updates in each of epochs 0, 1 and 2
    assert [line["epoch"] for line in lines] == [0, 1, 2, 3] and [line["grad_steps"] for line in lines] == [0, 2, 4, 6]
    assert all(0 <= line["return"] <= 199 for line in lines)  # +1 per step, never the first
    # "past 10" averages the evaluations after epoch 0 only: none yet at epoch 0
    assert lines[0]["return_past10"] is None
    for k in (1, 2, 3):
        assert lines[k]["return_past10"] == pytest.approx(sum(line["return"] for line in lines[1:k + 1]) / k)
    for key in ("qf_loss", "actor_loss", "alpha_loss", "alpha", "q"):
        assert math.isfinite(lines[-1][key]), key
    checked, child = children  # parse_args checks the checkpoint fits one on the CPU; main runs the other
    # the child is the agent script's own Actor, frozen: its weights are the checkpoint's
    assert not any(p.requires_grad for p in child.parameters())
    trained = load(os.path.join(child_dir, "checkpoint.pt"))["actor"]
    assert all(torch.equal(child.state_dict()[k], v) for k, v in trained.items())
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    assert ckpt["agent"] == "hierarchical" and ckpt["child_agent"] == "csf" and len(ckpt["buffer"]["reward"]) == 6
    assert ckpt["args"]["checkpoint"] == os.path.join(child_dir, "checkpoint.pt")  # the run folder's newest checkpoint
    assert os.path.isfile(os.path.join(run_dir, "episodes_0000001200.png"))


def test_discrete_sac_over_a_diayn_child(tiny_run, tmp_path):
    child_dir, _ = tiny_run(diayn, *FIVE_EPOCHS)
    run_dir = run_agent(hierarchical, tmp_path, "--checkpoint", child_dir, "--task", "AntMultiGoal",
                        "--total-env-steps", "800", "--learning-starts", "16", "--grad-steps-per-epoch", "2", *TINY)
    first, *_, last = read_evals(run_dir)
    assert last["grad_steps"] == 4 and math.isfinite(last["qf_loss"])  # 2 updates in each of the 2 epochs
    assert last["alpha"] > 0.1  # target entropy +log 50 lies above any policy's entropy: α only grows (iod/sac.py)
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    actions = ckpt["buffer"]["action"]
    assert not actions.dtype.is_floating_point and actions.min() >= 0 and actions.max() < 50  # one of the K = 50 skills


def test_ppo_over_a_one_hot_metra_child(tmp_path):
    (tmp_path / "child").mkdir()
    child_dir = run_agent(metra, tmp_path / "child", "--env-id", "HalfCheetah", "--total-env-steps", "400",
                          "--num-envs", "2", "--learning-starts", "400", "--grad-steps-per-epoch", "1",
                          "--batch-size", "8", "--hidden-dim", "8", "--num-eval-skills", "1", "--no-cuda")
    (tmp_path / "high").mkdir()
    run_dir = run_agent(hierarchical, tmp_path / "high", "--checkpoint", child_dir, "--task", "HalfCheetahHurdle",
                        "--total-env-steps", "800", "--grad-steps-per-epoch", "3", *TINY)
    lines = read_evals(run_dir)
    assert [line["grad_steps"] for line in lines] == [0, 3, 6]  # PPO learns from every epoch
    for key in ("policy_loss", "value_loss", "entropy"):
        assert math.isfinite(lines[-1][key]), key
    assert 0 <= lines[-1]["entropy"] <= math.log(16) + 1e-6  # a categorical policy over the K = 16 skills
    assert all(abs(line["return"]) <= 7 for line in lines)  # the 7 hurdles at x ≥ 0, crossed or recrossed
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    assert "value" in ckpt and "buffer" not in ckpt


def test_past_10_never_includes_epoch_0(tiny_run, tmp_path):
    child_dir, _ = tiny_run(csf, *FIVE_EPOCHS)
    run_dir = run_agent(hierarchical, tmp_path, "--checkpoint", child_dir, "--task", "AntMultiGoal",
                        "--total-env-steps", "2400", "--grad-steps-per-epoch", "0", *TINY)  # 6 epochs of 2 episodes
    lines = read_evals(run_dir)
    assert [line["epoch"] for line in lines] == list(range(7))
    returns = [line["return"] for line in lines]
    assert lines[0]["return_past10"] is None  # epoch 0, before any training, is never in "past 10"
    for k in range(1, 7):
        assert lines[k]["return_past10"] == pytest.approx(sum(returns[1:k + 1]) / k)


def test_default_budget_gives_ten_trained_evaluations_on_every_task(tmp_path, monkeypatch):
    """At the default flags every task is evaluated at least 10 times after epoch 0, as the training loop evaluates
    (epoch % eval_every == 0 or the last epoch), so "Return (past 10)" is ten evaluations of a trained policy."""
    monkeypatch.setattr(hierarchical, "frozen_child", lambda *args: None)  # the stand-in children have no actor
    for task, spec in envs.TASKS.items():
        child = tmp_path / f"{spec.base}.pt"
        torch.save({"agent": "csf", "args": {"env_id": spec.base, "skill_dim": 2, "hidden_dim": 8}, "actor": {}}, child)
        args, _, _ = hierarchical.parse_args(["--checkpoint", str(child), "--task", task])
        assert args.eval_every == spec.eval_every, task  # the official periods: 100, 25 on pixels
        num_epochs = args.total_env_steps // (args.num_envs * hierarchical.SKILL_STEPS * hierarchical.HIGH_HORIZON)
        evaluated = [e for e in range(num_epochs + 1) if e % args.eval_every == 0 or e == num_epochs]
        assert len([e for e in evaluated if e > 0]) >= 10, (task, num_epochs, evaluated)
    # PPO tasks: 1,000 epochs of 64 episodes, evaluated at 0, 100, ..., 1000
    args, _, _ = hierarchical.parse_args(["--checkpoint", str(tmp_path / "HalfCheetah.pt"), "--task", "HalfCheetahGoal"])
    assert (args.total_env_steps, args.num_envs, args.eval_every) == (12_800_000, 64, 100)


def refuses(argv):
    with pytest.raises(SystemExit) as stop:
        hierarchical.parse_args(argv)
    message = str(stop.value.code)
    assert "\n" not in message and message.startswith("hierarchical.py: error: "), message
    return message


def test_bad_input_is_one_line(tiny_run, tmp_path):
    child_dir, _ = tiny_run(csf, *FIVE_EPOCHS)  # an Ant child
    with pytest.raises(SystemExit) as stop:  # not one of Args.task's choices: tyro's own usage error
        hierarchical.parse_args(["--checkpoint", child_dir, "--task", "AntMaze"])
    assert stop.value.code == 2
    assert "holds skills learned on Ant; HalfCheetahGoal needs skills learned on HalfCheetah" in refuses(
        ["--checkpoint", child_dir, "--task", "HalfCheetahGoal"])
    assert "no checkpoint file at nope.pt" in refuses(["--checkpoint", "nope.pt"])
    (tmp_path / "empty").mkdir()
    assert "holds no checkpoint" in refuses(["--checkpoint", str(tmp_path / "empty")])
    (tmp_path / "bad.pt").write_bytes(b"garbage")
    assert "is not a readable checkpoint" in refuses(["--checkpoint", str(tmp_path / "bad.pt")])
    assert "--gamma must be in [0, 1), got 1.0" in refuses(["--checkpoint", child_dir, "--gamma", "1"])
    assert "--learning-starts must be at most the 1000 transitions" in refuses(  # whole 8-step episodes
        ["--checkpoint", child_dir, "--buffer-size", "1005", "--learning-starts", "1005"])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "hierarchical.py"), "--checkpoint", child_dir, "--task",
                           "HumanoidGoal"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_damaged_old_and_diverged_children_are_one_line(tiny_run, tmp_path):
    child_dir, _ = tiny_run(csf, *FIVE_EPOCHS)
    good = load(os.path.join(child_dir, "checkpoint.pt"))
    first_weight = next(iter(good["actor"]))
    cases = {  # what changes -> what the one line says
        "old": (lambda c: c["args"].pop("skill_dim"), "lacks skill_dim: it was not written by this version of csf.py"),
        "no_actor": (lambda c: c.pop("actor"), "lacks actor: it was not written by this version of csf.py"),
        "unknown_env": (lambda c: c["args"].update(env_id="Foo"),
                        "holds skills learned on Foo; AntMultiGoal needs skills learned on Ant"),
        "args_not_a_dict": (lambda c: c.update(args=["Ant"]), "is not a cleanmisl checkpoint"),
        "diverged": (lambda c: c["actor"][first_weight].view(-1)[0].fill_(float("inf")),
                     f"holds NaN or infinite weights (actor.{first_weight}): its run diverged"),
    }
    for label, (change, expected) in cases.items():
        ckpt = copy.deepcopy(good)
        change(ckpt)
        torch.save(ckpt, tmp_path / f"{label}.pt")
        path = str(tmp_path / f"{label}.pt")
        assert refuses(["--checkpoint", path, "--task", "AntMultiGoal"]) == f"hierarchical.py: error: {path} {expected}"
    # other shapes: found when the child's network is built from its flags
    ckpt = copy.deepcopy(good)
    ckpt["args"]["hidden_dim"] = 32
    torch.save(ckpt, tmp_path / "other_shapes.pt")
    (tmp_path / "run").mkdir()
    with pytest.raises(SystemExit) as stop:
        run_agent(hierarchical, tmp_path / "run", "--checkpoint", str(tmp_path / "other_shapes.pt"), "--task",
                  "AntMultiGoal", "--total-env-steps", "400", "--grad-steps-per-epoch", "0", *TINY)
    assert str(stop.value.code).startswith(f"hierarchical.py: error: {tmp_path / 'other_shapes.pt'}'s actor does not "
                                           "fit csf.py's network (size mismatch for ")


def test_resume_refuses_a_child_that_changed(tiny_run, tmp_path):
    child_dir, _ = tiny_run(csf, *FIVE_EPOCHS)
    shutil.copy(os.path.join(child_dir, "checkpoint.pt"), tmp_path / "child.pt")
    run_dir = run_agent(hierarchical, tmp_path, "--checkpoint", str(tmp_path / "child.pt"), "--task", "AntMultiGoal",
                        "--total-env-steps", "400", "--grad-steps-per-epoch", "0", *TINY)
    resume = ["--resume", os.path.join(run_dir, "checkpoint.pt"), "--total-env-steps", "800"]
    assert hierarchical.parse_args(resume)[1]["agent"] == "csf"  # the same child: accepted
    other = load(tmp_path / "child.pt")
    next(iter(other["actor"].values())).view(-1)[0] += 1.0  # as if its run had gone on
    torch.save(other, tmp_path / "child.pt")
    assert refuses(resume) == (f"hierarchical.py: error: {tmp_path / 'child.pt'} is not the child "
                               f"{os.path.join(run_dir, 'checkpoint.pt')} was trained over: its actor's weights changed "
                               "(another checkpoint, or its run went on); give that run's checkpoint as it was")


def test_ppo_over_a_dads_child_scales_its_actions(tmp_path):
    (tmp_path / "child").mkdir()
    child_dir = run_agent(dads, tmp_path / "child", "--env-id", "HalfCheetah", "--total-env-steps", "400",
                          "--num-envs", "2", "--learning-starts", "400", "--grad-steps-per-epoch", "1",
                          "--batch-size", "8", "--hidden-dim", "8", "--num-eval-skills", "1", "--no-cuda")
    assert hierarchical.skill_kind(load(os.path.join(child_dir, "checkpoint.pt"))) == "scaled"  # z = 1.5·a
    (tmp_path / "high").mkdir()
    run_dir = run_agent(hierarchical, tmp_path / "high", "--checkpoint", child_dir, "--task", "HalfCheetahGoal",
                        "--total-env-steps", "400", "--grad-steps-per-epoch", "2", *TINY)
    first, last = read_evals(run_dir)
    assert last["grad_steps"] == 2 and math.isfinite(last["policy_loss"])
    assert load(os.path.join(run_dir, "checkpoint.pt"))["child_agent"] == "dads"


def test_resume_logs_each_evaluation_once(tiny_run, tmp_path):
    """Killed after logging an evaluation and before its next checkpoint, a resumed run does that evaluation again
    and logs it once."""
    child_dir, _ = tiny_run(csf, *FIVE_EPOCHS)
    flags = ("--checkpoint", child_dir, "--task", "AntMultiGoal", "--learning-starts", "16", "--grad-steps-per-epoch",
             "2", *TINY)
    run_dir = run_agent(hierarchical, tmp_path, *flags, "--total-env-steps", "800")  # checkpoint at epoch 2
    with open(os.path.join(run_dir, "eval.jsonl"), "a") as f:
        f.write(json.dumps({**read_evals(run_dir)[-1], "epoch": 3, "return": -1.0}) + "\n")  # the killed run's epoch 3
    assert run_agent(hierarchical, tmp_path, "--resume", os.path.join(run_dir, "checkpoint.pt"),
                     "--total-env-steps", "1200") == run_dir
    lines = read_evals(run_dir)
    assert [line["epoch"] for line in lines] == [0, 1, 2, 3] and lines[-1]["return"] >= 0


def test_resumed_from_elsewhere_with_a_torn_log_the_run_keeps_its_folder(tiny_run, tmp_path):
    child_dir, _ = tiny_run(csf, *FIVE_EPOCHS)
    (tmp_path / "first").mkdir()
    run_dir = run_agent(hierarchical, tmp_path / "first", "--checkpoint", child_dir, "--task", "AntMultiGoal",
                        "--grad-steps-per-epoch", "0", "--total-env-steps", "800", *TINY)  # epochs 0-2
    log = os.path.join(run_dir, "eval.jsonl")
    with open(log, "a") as f:
        f.write('\n{"epoch": 3, "ret')  # a blank line, then a torn one (a crash mid-write)
    (tmp_path / "elsewhere").mkdir()
    old = os.getcwd()
    os.chdir(tmp_path / "elsewhere")
    try:
        hierarchical.main(*hierarchical.parse_args(["--resume", os.path.join(run_dir, "checkpoint.pt"),
                                                    "--total-env-steps", "1200"]))
        assert not os.path.exists("runs")  # the run went on in its own folder
    finally:
        os.chdir(old)
    assert [line["epoch"] for line in read_evals(run_dir)] == [0, 1, 2, 3]  # the torn line dropped: the log is the
    # checkpoint's evaluations, then the new ones


def test_an_overflowed_optimizer_is_never_checkpointed(tmp_path):
    """--entropy-coef 1e30 keeps every loss finite but overflows Adam's second moments: the run stops with one line
    at the checkpoint instead of writing it and finishing."""
    (tmp_path / "child").mkdir()
    child_dir = run_agent(dads, tmp_path / "child", "--env-id", "HalfCheetah", "--total-env-steps", "400",
                          "--num-envs", "2", "--learning-starts", "400", "--grad-steps-per-epoch", "1",
                          "--batch-size", "8", "--hidden-dim", "8", "--num-eval-skills", "1", "--no-cuda")
    (tmp_path / "high").mkdir()
    with pytest.raises(SystemExit) as stop:
        run_agent(hierarchical, tmp_path / "high", "--checkpoint", child_dir, "--task", "HalfCheetahGoal",
                  "--total-env-steps", "800", "--grad-steps-per-epoch", "2", "--entropy-coef", "1e30", *TINY)
    message = str(stop.value.code)
    assert message.startswith("hierarchical.py: error: policy_optimizer.state.") and "holds NaN or inf at epoch 1" in message
    assert message.endswith("the run diverged; no checkpoint was written yet")
    assert not glob.glob(str(tmp_path / "high" / "runs" / "*" / "checkpoint.pt*"))


def test_every_numeric_flag_has_a_range_and_a_value_outside_it_is_one_line(tiny_run):
    child_dir, _ = tiny_run(csf, *FIVE_EPOCHS)
    types = {field.name: field.type for field in dataclasses.fields(hierarchical.Args)}
    numeric = {flag for flag, kind in types.items() if kind in (int, float, Optional[int], Optional[float])}
    assert numeric == set(hierarchical.FLAG_RANGES)
    for flag, interval in hierarchical.FLAG_RANGES.items():
        low, high = (float(end) for end in interval[1:-1].split(","))
        is_float = types[flag] in (float, Optional[float])
        values = [low - 1] + ([low] if interval[0] == "(" else []) + (
            [high + (interval[-1] == "]")] if high != float("inf") else []) + (
            [float("nan"), float("inf")] if is_float else [])
        for value in values:
            option = "--" + flag.replace("_", "-")
            text = repr(value) if is_float else str(int(value))
            task = "HalfCheetahGoal" if flag in ("clip", "gae_lambda", "entropy_coef") else "AntMultiGoal"
            message = refuses(["--checkpoint", child_dir, "--task", task, f"{option}={text}"])
            assert f"{option} must be in {interval}, got " in message, message


def test_sac_fast_path_flags_on_a_cpu(tiny_run, tmp_path, capsys):
    """--cudagraphs on a CPU: one line says the step runs without graphs, and the run trains with fused Adam."""
    child_dir, _ = tiny_run(csf, *FIVE_EPOCHS)
    run_dir = run_agent(hierarchical, tmp_path, "--checkpoint", child_dir, "--task", "AntMultiGoal", "--cudagraphs",
                        "--total-env-steps", "800", "--learning-starts", "16", "--grad-steps-per-epoch", "2", *TINY)
    assert "--cudagraphs: CUDA graphs need a GPU; on the CPU the gradient step runs without them" in (
        capsys.readouterr().out)
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    assert ckpt["grad_steps"] == 4 and all(group["fused"] and not group["capturable"] for key in
                                           ("qf_optimizer", "policy_optimizer", "alpha_optimizer")
                                           for group in ckpt[key]["param_groups"])


def test_too_many_envs_are_refused_with_one_line_before_any_is_built(tiny_run, tmp_path, monkeypatch):
    child_dir, _ = tiny_run(csf, *FIVE_EPOCHS)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        hierarchical.main(*hierarchical.parse_args(["--checkpoint", child_dir, "--task", "AntMultiGoal", "--no-cuda",
                                                    "--num-eval-episodes", "1000000000000"]))
    message = str(stop.value.code)
    assert "\n" not in message and message.startswith(
        "hierarchical.py: error: 1,000,000,000,008 training and evaluation envs need at least 244,140,625.0 GiB"), message


def test_the_progress_line_gives_the_time_left(tiny_run, tmp_path, capsys):
    child_dir, _ = tiny_run(csf, *FIVE_EPOCHS)
    run_agent(hierarchical, tmp_path, "--checkpoint", child_dir, "--task", "AntMultiGoal", "--total-env-steps", "4400",
              "--grad-steps-per-epoch", "0", *TINY)
    assert re.search(r"^epoch 10 \| env steps 4,000 \| SPS \d+ \| \d+ s left \| episode return ",
                     capsys.readouterr().out, re.M)
