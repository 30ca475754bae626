"""Tests of metra.py and benchmarks/metra_repr_stats.py: the losses against hand-computed numbers, the dual step,
the one-hot skills, and tiny end-to-end runs (a few seconds each on a CPU)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import metra  # noqa: E402
import metra_repr_stats  # noqa: E402

TINY = ["--num-envs", "2", "--learning-starts", "400", "--grad-steps-per-epoch", "5", "--batch-size", "32",
        "--hidden-dim", "32", "--buffer-size", "5000", "--no-cuda"]


def run_metra(cwd, *flags):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "metra.py"), *flags], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def read_evals(cwd):
    (run,) = os.listdir(os.path.join(cwd, "runs"))
    with open(os.path.join(cwd, "runs", run, "eval.jsonl")) as f:
        return os.path.join(cwd, "runs", run), [json.loads(line) for line in f]


# ---------------------------------------------------------------- losses
DPHI = [[0.6, 0.8], [1.0, 1.0], [0.1, 0.0]]  # ‖Δφ‖² = 1, 2, 0.01
Z = [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]  # Δφᵀz = 0.6, 1.0, 0.1


def test_phi_loss_and_constraint_on_a_hand_batch():
    dphi = torch.tensor(DPHI, requires_grad=True)
    log_lam = torch.tensor(math.log(30.0), requires_grad=True)
    loss, c = metra.metra_phi_loss(dphi, torch.tensor(Z), log_lam, 1e-3)
    # c = min(1 - ‖Δφ‖², ε): 0 on the boundary, -1 when violated, capped at ε = 1e-3 when slack
    assert c.tolist() == pytest.approx([0.0, -1.0, 1e-3], abs=1e-6)
    # -mean(Δφᵀz + 30 c) = -(0.6 + (1.0 - 30) + (0.1 + 0.03)) / 3
    assert loss.item() == pytest.approx(-(0.6 + 1.0 - 30.0 + 0.1 + 0.03) / 3, rel=1e-5)
    loss.backward()
    assert log_lam.grad is None  # λ is detached in the φ loss
    # dL/dΔφ_i = -(z_i - 2λΔφ_i)/3 where the constraint is active, -z_i/3 where it is capped at ε
    expected = [[(36 - 1) / 3, 48 / 3], [60 / 3, (60 - 1) / 3], [-1 / 3, 0.0]]
    assert dphi.grad.numpy() == pytest.approx(np.array(expected), abs=1e-4)


def test_constraint_norm_mean_divides_by_d():
    loss, c = metra.metra_phi_loss(torch.tensor(DPHI), torch.tensor(Z), torch.tensor(math.log(30.0)), 1e-3, "mean")
    # ‖Δφ‖²/d = 0.5, 1.0, 0.005 → c = ε, 0, ε
    assert c.tolist() == pytest.approx([1e-3, 0.0, 1e-3], abs=1e-6)
    assert loss.item() == pytest.approx(-(0.6 + 0.03 + 1.0 + 0.1 + 0.03) / 3, rel=1e-5)


@pytest.mark.parametrize("c, direction", [([-0.5, 1e-3], +1), ([1e-3, 1e-3], -1)])
def test_one_dual_step_raises_lambda_when_violated_and_lowers_it_when_satisfied(c, direction):
    log_lam = torch.tensor(math.log(30.0), requires_grad=True)
    optimizer = torch.optim.Adam([log_lam], lr=1e-4)
    loss = metra.dual_loss(log_lam, torch.tensor(c, requires_grad=True))
    assert loss.item() == pytest.approx(math.log(30.0) * np.mean(c), rel=1e-6)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    # Adam's first step moves log λ by exactly lr against the sign of the gradient mean(c)
    assert log_lam.exp().item() == pytest.approx(30.0 * math.exp(direction * 1e-4), rel=1e-6)


def test_contrastive_phi_loss_on_a_hand_batch():
    dphi, z = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]])
    negatives = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]])
    loss, lse = metra.contrastive_phi_loss(dphi, z, negatives, xi=5.0)
    expected_lse = math.log(math.e + math.exp(-1) + 1)
    assert lse.item() == pytest.approx(expected_lse, rel=1e-6)
    assert loss.item() == pytest.approx(-(1.0 - 5.0 * expected_lse), rel=1e-6)


def test_one_hot_reward_vector_for_k16():
    skill = torch.nn.functional.one_hot(torch.tensor([5]), 16).float()
    m = metra.skill_weights(skill, discrete=True)[0]
    assert m[5].item() == pytest.approx(1.0)
    assert torch.cat([m[:5], m[6:]]).numpy() == pytest.approx(np.full(15, -1 / 15))
    dphi = torch.arange(16.0)[None]
    # Δφᵀm = 5 - (0 + 1 + ... + 15 - 5)/15
    assert metra.intrinsic_reward(dphi, m[None]).item() == pytest.approx(5 - 115 / 15, rel=1e-6)
    z = metra.sample_skills(4, 3)
    assert torch.equal(metra.skill_weights(z, discrete=False), z)  # continuous: r = Δφᵀz


@pytest.mark.parametrize("k, counts", [(16, [3] * 16), (24, [2] * 24), (10, [5] * 8 + [4] * 2)])
def test_evaluation_splits_the_48_rollouts_over_the_k_skills(k, counts):
    skills = metra.eval_skills(k, True, None)
    assert skills.shape == (48, k) and torch.all(skills.sum(1) == 1)
    assert skills.sum(0).int().tolist() == counts  # 48 // K each, the remainder to the lowest indices
    continuous = metra.eval_skills(3, False, torch.Generator().manual_seed(0))
    assert continuous.shape == (48, 3) and continuous.norm(dim=1).numpy() == pytest.approx(np.ones(48), abs=1e-6)


def test_sac_target_and_losses_on_a_hand_case():
    reward, alpha, gamma = torch.tensor([1.0, 0.5]), 0.1, 0.99
    next_q1, next_q2, next_log_prob = torch.tensor([2.0, 3.0]), torch.tensor([4.0, 1.0]), torch.tensor([-1.0, 2.0])
    # y = r + γ (min(Q̄1, Q̄2) - α log π): 1 + 0.99 (2 + 0.1), 0.5 + 0.99 (1 - 0.2); never terminal
    y = metra.critic_target(reward, next_q1, next_q2, next_log_prob, alpha, gamma)
    assert y.tolist() == pytest.approx([1 + 0.99 * 2.1, 0.5 + 0.99 * 0.8], rel=1e-6)
    # 0.5 MSE per Q, summed: 0.5 mean(0, 1) + 0.5 mean(1, 1)
    loss = metra.critic_loss(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert loss.item() == pytest.approx(0.75)
    # mean(α log π - min Q) = mean(-0.1 - 2, 0.2 - 1)
    assert metra.actor_loss(next_log_prob, next_q1, next_q2, alpha).item() == pytest.approx(-1.45, rel=1e-6)
    log_alpha = torch.tensor(math.log(0.01))
    assert metra.temperature_loss(log_alpha, torch.tensor([-1.0, 2.0]), -4.0).item() == pytest.approx(
        -math.log(0.01) * ((-1 - 4) + (2 - 4)) / 2, rel=1e-6)


# ---------------------------------------------------------------- benchmarks/metra_repr_stats.py
def test_repr_stats_slope_matches_one_over_2d(tmp_path):
    g = torch.Generator().manual_seed(0)
    dphi = metra.sample_skills(4000, 2, generator=g) * torch.rand(4000, 1, generator=g).sqrt()  # ‖Δφ‖² ~ U(0, 1)
    z = metra.sample_skills(4000, 2, generator=g)
    np.savez(tmp_path / "s.npz", **metra.repr_stats(dphi, z), env_id="Ant", env_steps=0, discrete=False)
    stats = metra_repr_stats.main([str(tmp_path / "s.npz"), "--out-dir", str(tmp_path), "--num-z", "4096"])
    slope = next(v for k, v in stats.items() if k.startswith("slope at 0"))
    assert slope == pytest.approx(0.25, rel=0.02)  # log I_0(r) = r²/4 - r⁴/64 + ...
    assert stats["Monte Carlo: max |error| against the closed form"] < 0.01
    assert stats["E‖Δφ‖²"] == pytest.approx(0.5, abs=0.03)
    assert (tmp_path / "metra_repr_stats_Ant_0.png").stat().st_size > 0
    assert "1/(2d)" in (tmp_path / "metra_repr_stats_Ant_0.md").read_text()


# ---------------------------------------------------------------- end to end
def test_smoke_run_crosses_an_update_and_an_evaluation(tmp_path):
    out = run_metra(tmp_path, "--env-id", "Ant", "--total-env-steps", "400", "--eval-every", "1", "--save-repr-stats", *TINY)
    assert out.returncode == 0, out.stderr
    run_dir, evals = read_evals(tmp_path)
    assert [e["epoch"] for e in evals] == [0, 1]
    last = evals[-1]
    assert last["grad_steps"] == 5 and evals[0]["lambda"] == pytest.approx(30.0)
    for key in ("lambda", "constraint", "dphi_sq", "phi_loss", "qf_loss", "actor_loss", "alpha_loss", "lambda_loss",
                "alpha", "sps", "ms_per_grad_step", "peak_rss_mb"):
        assert math.isfinite(last[key]), key
    assert last["constraint"] <= 1e-3 and last["lambda"] != 30.0  # one dual step per gradient step
    ckpt = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=False)
    assert ckpt["agent"] == "metra" and ckpt["epoch"] == 1
    with np.load(os.path.join(run_dir, "repr_stats_0000000400.npz")) as f:
        assert f["dphi"].shape == (400, 2)
        assert f["dphi_minus_z"] == pytest.approx(f["dphi"] - f["z"])
        assert np.linalg.norm(f["dphi_unit"], axis=1) == pytest.approx(np.ones(400))
    assert os.path.isfile(os.path.join(run_dir, "skills_0000000400.png"))


def test_halfcheetah_one_hot_run(tmp_path):
    out = run_metra(tmp_path, "--env-id", "HalfCheetah", "--total-env-steps", "400", "--eval-every", "1", *TINY)
    assert out.returncode == 0, out.stderr
    run_dir, evals = read_evals(tmp_path)
    ckpt = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=False)
    assert ckpt["args"]["discrete"] is True and ckpt["args"]["skill_dim"] == 16
    skills = ckpt["buffer"]["skills"]
    assert skills.shape == (2, 16) and np.all(skills.sum(1) == 1)  # one-hot, one per trajectory
    assert evals[-1]["grad_steps"] == 5 and math.isfinite(evals[-1]["lambda"])


def test_resume_continues_the_same_run(tmp_path):
    flags = ["--env-id", "Ant", "--eval-every", "1", *TINY]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert run_metra(tmp_path / "a", "--total-env-steps", "800", *flags).returncode == 0
    assert run_metra(tmp_path / "b", "--total-env-steps", "400", *flags).returncode == 0
    run_dir, _ = read_evals(tmp_path / "b")
    out = run_metra(tmp_path / "b", "--total-env-steps", "800", "--resume", os.path.join(run_dir, "checkpoint.pt"), *flags)
    assert out.returncode == 0, out.stderr
    (_, straight), (_, resumed) = read_evals(tmp_path / "a"), read_evals(tmp_path / "b")
    timing = {"wall_time", "sps", "ms_per_grad_step", "peak_rss_mb"}
    assert [{k: v for k, v in e.items() if k not in timing} for e in straight] == \
           [{k: v for k, v in e.items() if k not in timing} for e in resumed]
    (a,), (b,) = (os.listdir(tmp_path / x / "runs") for x in "ab")
    ckpt_a, ckpt_b = (torch.load(tmp_path / x / "runs" / r / "checkpoint.pt", weights_only=False) for x, r in (("a", a), ("b", b)))
    for name in ("phi", "qf1", "qf2_target", "actor"):
        for key, value in ckpt_a[name].items():
            assert torch.equal(value, ckpt_b[name][key]), (name, key)
    assert torch.equal(ckpt_a["log_lam"], ckpt_b["log_lam"]) and torch.equal(ckpt_a["log_alpha"], ckpt_b["log_alpha"])


@pytest.mark.parametrize("flags, message", [
    (["--env-id", "Foo"], "unknown --env-id 'Foo'"),
    (["--skill-dim", "0"], "--skill-dim must be positive"),
    (["--env-id", "HalfCheetah", "--repr-loss", "contrastive"], "needs unit-sphere skills"),
    (["--resume", "csf_checkpoint.pt"], "is a csf checkpoint, not a metra one"),
])
def test_bad_input_gives_one_line_and_no_traceback(tmp_path, flags, message):
    torch.save({"agent": "csf", "args": {"env_id": "Ant"}}, tmp_path / "csf_checkpoint.pt")
    out = run_metra(tmp_path, *flags)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and message in out.stderr
