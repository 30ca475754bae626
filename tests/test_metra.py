"""Tests of metra.py and benchmarks/metra_repr_stats.py: the losses against hand-computed numbers, the dual step,
the one-hot skills, and tiny end-to-end runs of what only METRA has (what every agent shares is in
test_agent_runs.py and test_command_line.py)."""

import math
import os
import sys
import types

import numpy as np
import pytest
import torch
from conftest import FIVE_EPOCHS, load, read_evals, run_agent

import metra

# appended, after the root: benchmarks/goal_reaching.py and hierarchical.py must not hide the scripts
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import metra_repr_stats  # noqa: E402

# one epoch of 2 trajectories, then 5 gradient steps
TINY_ONE_EPOCH = ["--num-envs", "2", "--learning-starts", "400", "--grad-steps-per-epoch", "5", "--batch-size", "32",
                  "--hidden-dim", "32", "--num-eval-skills", "4", "--no-cuda"]


# ---------------------------------------------------------------- losses
DPHI = [[0.6, 0.8], [1.0, 1.0], [0.1, 0.0]]  # ‖Δφ‖² = 1, 2, 0.01
Z = [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]  # Δφᵀz = 0.6, 1.0, 0.1


def test_phi_loss_and_constraint_on_a_hand_batch():
    dphi = torch.tensor(DPHI, requires_grad=True)
    log_lam = torch.tensor(math.log(30.0), requires_grad=True)
    c = metra.constraint(dphi, 1e-3)
    loss = metra.metra_phi_loss(dphi, torch.tensor(Z), log_lam, c)
    # c = min(1 - ‖Δφ‖², ε): 0 on the boundary, -1 when violated, capped at ε = 1e-3 when slack
    assert c.tolist() == pytest.approx([0.0, -1.0, 1e-3], abs=1e-6)
    # -mean(Δφᵀz + 30 c) = -(0.6 + (1.0 - 30) + (0.1 + 0.03)) / 3
    assert loss.item() == pytest.approx(-(0.6 + 1.0 - 30.0 + 0.1 + 0.03) / 3, rel=1e-5)
    loss.backward()
    assert log_lam.grad is None  # λ is detached in the φ loss
    # dL/dΔφ_i = -(z_i - 2λΔφ_i)/3 where the constraint is active, -z_i/3 where it is capped at ε
    expected = [[(36 - 1) / 3, 48 / 3], [60 / 3, (60 - 1) / 3], [-1 / 3, 0.0]]
    assert dphi.grad.numpy() == pytest.approx(np.array(expected), abs=1e-4)


@pytest.mark.parametrize("norm, sq_per_dim, expected", [
    ("sum", [0.2, 0.2], 1e-3),  # ‖Δφ‖² = 0.4: slack, capped at ε
    ("sum", [0.4995, 0.5], 5e-4),  # ‖Δφ‖² = 0.9995: 1 - ‖Δφ‖² is below ε, so it is the value
    ("sum", [0.75, 0.75], -0.5),  # violated
    ("mean", [0.75, 0.75], 1e-3),  # ‖Δφ‖²/d = 0.75: slack under the official averaged norm
    ("mean", [1.5, 2.5], -1.0),
])
def test_constraint_on_a_batch_of_set_squared_norms(norm, sq_per_dim, expected):
    dphi = torch.tensor([sq_per_dim], dtype=torch.float64).sqrt() * torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    constraint = metra.mean_constraint if norm == "mean" else metra.constraint  # --constraint-norm
    assert constraint(dphi, 1e-3).item() == pytest.approx(expected, abs=1e-12)


def test_constraint_norm_mean_divides_by_d():
    c = metra.mean_constraint(torch.tensor(DPHI), 1e-3)  # --constraint-norm mean
    loss = metra.metra_phi_loss(torch.tensor(DPHI), torch.tensor(Z), torch.tensor(math.log(30.0)), c)
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


def test_contrastive_phi_loss_on_a_hand_batch(monkeypatch):
    dphi, z = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]])
    negatives = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]])
    monkeypatch.setattr(metra, "sample_skills", lambda *_, **__: negatives)  # the prior draws z'_j, by hand
    args = types.SimpleNamespace(num_negatives=3, skill_dim=2, xi=5.0)
    loss, lse = metra.metra_c_phi_loss(dphi, z, args)
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


@pytest.mark.parametrize("n, k, counts", [(48, 16, [3] * 16), (48, 24, [2] * 24), (48, 10, [5] * 8 + [4] * 2),
                                          (4, 16, [1] * 4 + [0] * 12)])
def test_evaluation_splits_the_rollouts_over_the_k_skills(n, k, counts):
    skills = metra.eval_skills(n, k, True, None)
    assert skills.shape == (n, k) and torch.all(skills.sum(1) == 1)
    assert skills.sum(0).int().tolist() == counts  # n // K each, the remainder to the lowest indices
    continuous = metra.eval_skills(n, 3, False, torch.Generator().manual_seed(0))
    assert continuous.shape == (n, 3) and continuous.norm(dim=1).numpy() == pytest.approx(np.ones(n), abs=1e-6)


def test_sac_target_and_losses_on_a_hand_case():
    reward, alpha, gamma = torch.tensor([1.0, 0.5]), 0.1, 0.99
    log_prob = torch.tensor([-1.0, 2.0])
    actor = types.SimpleNamespace(sample=lambda obs, skill: (None, log_prob))  # log π(a'|s', z) of its actions
    critic = lambda *values: (lambda obs, skill, action: torch.tensor(values))  # Q(s, a, z) on the batch, by hand
    next_q = [critic(2.0, 3.0), critic(4.0, 1.0)]  # Q̄_1 and Q̄_2
    # y = r + γ (min(Q̄1, Q̄2) - α log π): 1 + 0.99 (2 + 0.1), 0.5 + 0.99 (1 - 0.2); never terminal
    y = [1 + 0.99 * 2.1, 0.5 + 0.99 * 0.8]
    at_target = metra.qf_objective([critic(*y)], next_q, actor, reward, None, None, None, None, alpha, gamma)
    assert at_target.item() == pytest.approx(0.0, abs=1e-10)  # a Q equal to y has no loss
    # 0.5 MSE per Q against y, summed: 0.5 mean(0, 1) + 0.5 mean(1, 1)
    qf = [critic(y[0], y[1] + 1), critic(y[0] + 1, y[1] + 1)]
    loss = metra.qf_objective(qf, next_q, actor, reward, None, None, None, None, alpha, gamma)
    assert loss.item() == pytest.approx(0.75, rel=1e-5)
    # mean(α log π - min Q) = mean(-0.1 - 2, 0.2 - 1)
    loss, _ = metra.actor_objective(actor, next_q, None, None, alpha)
    assert loss.item() == pytest.approx(-1.45, rel=1e-6)
    log_alpha = torch.tensor(math.log(0.01))
    assert metra.temperature_loss(log_alpha, torch.tensor([-1.0, 2.0]), -4.0).item() == pytest.approx(
        -math.log(0.01) * ((-1 - 4) + (2 - 4)) / 2, rel=1e-6)


# ---------------------------------------------------------------- benchmarks/metra_repr_stats.py
def test_repr_stats_slope_matches_one_over_2d(tmp_path):
    g = torch.Generator().manual_seed(0)
    dphi = metra.sample_skills(4000, 2, generator=g) * torch.rand(4000, 1, generator=g).sqrt()  # ‖Δφ‖² ~ U(0, 1)
    z = metra.sample_skills(4000, 2, generator=g)
    np.savez(tmp_path / "s.npz", dphi=dphi.double().numpy(), z=z.double().numpy(), env_id="Ant", env_steps=0,
             discrete=False)  # what metra.py --save-repr-stats writes
    stats = metra_repr_stats.main([str(tmp_path / "s.npz"), "--out-dir", str(tmp_path), "--num-z", "4096"])
    slope = next(v for k, v in stats.items() if k.startswith("slope at 0"))
    assert slope == pytest.approx(0.25, rel=0.02)  # log I_0(r) = r²/4 - r⁴/64 + ...
    assert stats["Monte Carlo: max |error| against the closed form"] < 0.01
    assert stats["E‖Δφ‖²"] == pytest.approx(0.5, abs=0.03)
    assert (tmp_path / "metra_repr_stats_Ant_0.png").stat().st_size > 0
    assert "1/(2d)" in (tmp_path / "metra_repr_stats_Ant_0.md").read_text()


# ---------------------------------------------------------------- end to end (what all agents share: test_agent_runs.py)
def test_dual_run_reports_lambda_and_a_constraint_consistent_with_its_dphi(tiny_run):
    run_dir, _ = tiny_run(metra, *FIVE_EPOCHS)
    evals = read_evals(run_dir)
    assert evals[0]["lambda"] == pytest.approx(30.0) and evals[-1]["lambda"] != pytest.approx(30.0, rel=1e-6)
    for e in evals[1:]:
        # c = min(1 - ‖Δφ‖², ε) is concave in ‖Δφ‖², so its mean lies below min(1 - E‖Δφ‖², ε) (Jensen)
        assert e["constraint"] <= min(1 - e["dphi_sq"], 1e-3) + 1e-6, e
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    # 12 dual steps of Adam (lr 1e-4) move log λ by at most 12 lr
    assert 0 < abs(ckpt["log_lam"].item() - math.log(30.0)) <= 12 * 1e-4 + 1e-7


def test_metra_c_run_has_no_lambda_and_saves_repr_stats(tmp_path):
    run_dir = run_agent(metra, tmp_path, "--repr-loss", "contrastive", "--total-env-steps", "400", "--eval-every", "1",
                        "--save-repr-stats", "--num-negatives", "8", *TINY_ONE_EPOCH)
    first, last = read_evals(run_dir)
    assert "lambda" not in last and "lambda_loss" not in last and math.isfinite(last["logsumexp"])
    assert last["grad_steps"] == 5
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    assert torch.equal(ckpt["log_lam"], torch.tensor(math.log(30.0)))  # λ is never stepped in METRA-C
    with np.load(os.path.join(run_dir, "repr_stats_0000000400.npz")) as f:
        assert f["dphi"].shape == f["z"].shape == (400, 2) and str(f["repr_loss"]) == "contrastive"
        assert f["dphi"].dtype == f["z"].dtype == np.float64
        assert np.linalg.norm(f["z"], axis=1) == pytest.approx(np.ones(400))  # unit-sphere skills: w = z
        assert (f["dphi"] ** 2).sum(1).mean() == pytest.approx(last["dphi_sq"], rel=1e-5)  # the same 400 transitions
        derived = metra_repr_stats.derived(f["dphi"], f["z"])
        assert derived["dphi_minus_z"] == pytest.approx(f["dphi"] - f["z"])
        assert np.linalg.norm(derived["dphi_unit"], axis=1) == pytest.approx(np.ones(400))


def test_halfcheetah_one_hot_run(tmp_path):
    run_dir = run_agent(metra, tmp_path, "--env-id", "HalfCheetah", "--total-env-steps", "400", "--eval-every", "1",
                        *TINY_ONE_EPOCH, "--num-eval-skills", "20")
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    assert ckpt["args"]["discrete"] is True and ckpt["args"]["skill_dim"] == 16
    skills = ckpt["buffer"]["skills"]
    assert skills.shape == (2, 16) and bool((skills.sum(1) == 1).all())  # one-hot, one per trajectory
    evals = read_evals(run_dir)
    assert evals[-1]["grad_steps"] == 5 and math.isfinite(evals[-1]["lambda"])
    assert 1 <= evals[-1]["coverage"] <= 20 * 201


@pytest.mark.parametrize("flags, message", [
    (["--env-id", "HalfCheetah", "--repr-loss", "contrastive"],
     "--repr-loss contrastive needs unit-sphere skills; add --discrete False --skill-dim D"),
    (["--discrete", "True"], "the paper has no one-hot METRA skills on Ant; give --skill-dim too"),
    (["--discrete", "True", "--skill-dim", "1"], "one-hot skills need --skill-dim K >= 2, got 1"),
])
def test_bad_skill_settings_are_one_line(flags, message):
    with pytest.raises(SystemExit) as stop:
        metra.parse_args(flags)
    assert str(stop.value.code) == f"metra.py: error: {message}"
