"""csf.py end to end beyond what every agent shares (tests/test_agent_runs.py): the contrastive term inside a run,
and HalfCheetah."""

import math
import os

import pytest
import torch
from conftest import load, read_evals, run_agent

import csf


def test_halfcheetah_run_draws_fresh_negatives_apart_from_the_positives(tmp_path, monkeypatch):
    """Every φ step gets exactly --num-negatives fresh unit-sphere draws shared by the batch, none of them the
    positive (with the positive among them there would be M + 1 terms: log 9 for log 8); the evaluation reports the
    mean log-sum-exp of the steps since the last one."""
    calls, real_loss = [], csf.contrastive_phi_loss

    def spy(dphi, skill, negatives, xi):
        loss, logsumexp = real_loss(dphi, skill, negatives, xi)
        calls.append((skill, negatives, logsumexp.item()))
        return loss, logsumexp

    monkeypatch.setattr(csf, "contrastive_phi_loss", spy)
    run_dir = run_agent(csf, tmp_path, "--env-id", "HalfCheetah", "--total-env-steps", "1200", "--num-envs", "2",
                        "--learning-starts", "800", "--grad-steps-per-epoch", "3", "--batch-size", "16",
                        "--hidden-dim", "16", "--num-negatives", "8", "--num-eval-skills", "3", "--no-cuda")
    assert len(calls) == 6  # 3 in each of epochs 1 and 2, once 800 transitions are stored
    for skill, negatives, _ in calls:
        assert negatives.shape == (8, 2) and torch.allclose(negatives.norm(dim=-1), torch.ones(8))
        assert skill.shape == (16, 2) and not (torch.cdist(skill, negatives) < 1e-6).any()
    assert not torch.equal(calls[0][1], calls[1][1])  # fresh draws at every step
    first, last = read_evals(run_dir)
    assert last["logsumexp"] == pytest.approx(sum(c[2] for c in calls) / 6, rel=1e-6)
    assert 1 <= last["coverage"] <= 3 * 201 and math.isfinite(last["dphi_sq"])  # 3 rollouts of 201 x positions
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    assert ckpt["args"]["env_id"] == "HalfCheetah" and ckpt["args"]["skill_dim"] == 2  # the paper's d
    assert ckpt["buffer"]["frames"].shape == (6, 201, 18)  # 3 epochs of 2 trajectories of 18-D states
    assert os.path.isfile(os.path.join(run_dir, "skills_0000001200.png"))


@pytest.mark.parametrize("flags", [["--critic", "mlp"], ["--critic", "gaussian"], ["--critic", "laplacian"],
                                   ["--reward", "mutual-information"]], ids=" ".join)
def test_every_ablation_crosses_an_update_and_an_evaluation(flags, tmp_path):
    run_dir = run_agent(csf, tmp_path, *flags, "--total-env-steps", "800", "--num-envs", "2", "--learning-starts", "400",
                        "--grad-steps-per-epoch", "2", "--batch-size", "16", "--hidden-dim", "16", "--num-negatives",
                        "8", "--num-eval-skills", "2", "--no-cuda")
    first, last = read_evals(run_dir)
    assert last["grad_steps"] == 4 and all(math.isfinite(v) for v in last.values())
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    scalar_head = flags != ["--critic", "mlp"]  # a reward not linear in z adds ψ's scalar head
    assert ckpt["psi"]["0.net.4.weight"].shape[0] == ckpt["psi"]["1.net.4.weight"].shape[0] == 2 + scalar_head
    assert ckpt["phi"]["net.0.weight"].shape[1] == (58 if flags == ["--critic", "mlp"] else 29)  # (s, s') or s
