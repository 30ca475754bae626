"""cic.py: the CPC loss, the running moments and the kNN reward on hand batches, the spectral norm of h, and the
time limit as a terminal step. What every agent shares is in test_agent_runs.py and test_command_line.py."""

import math

import numpy as np
import pytest
import torch

import cic


def test_cpc_loss_subtracts_the_largest_possible_diagonal_term():
    # unit queries and keys at right angles except on the diagonal: L = I / T with T = 0.5
    query, key = torch.eye(3), torch.eye(3) * 7.0  # keys are normalized inside
    t = 0.5
    positive = math.exp(1 / t)
    negative = max(math.exp(1 / t) + 2 * math.exp(0) - math.exp(1 / t), 1e-6)  # Σ_j exp(L_ij) - e^{1/T} = 2
    expected = -math.log(positive / (negative + 1e-6))
    assert cic.cpc_loss(query, key, t).item() == pytest.approx(expected, rel=1e-6)
    # when every key equals its query's opposite, the sum minus e^{1/T} goes negative: clamped at 1e-6
    loss = cic.cpc_loss(torch.tensor([[1.0, 0.0]]), torch.tensor([[-1.0, 0.0]]), t)
    assert loss.item() == pytest.approx(-math.log(math.exp(-2) / (1e-6 + 1e-6)), rel=1e-6)


def test_running_moments_keep_the_variance_of_everything_seen():
    moments = torch.tensor([0.0, 1.0, 1e-4], dtype=torch.float64)  # main's prior: mean 0, variance 1, count 1e-4
    first, second = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([10.0, 20.0])
    cic.running_variance(moments, first)
    variance = cic.running_variance(moments, second)
    mean, var, count = moments
    seen = np.concatenate([first, second])
    # from the prior, each batch's unbiased variance folds in: ≈ the pooled moments
    assert count.item() == pytest.approx(6 + 1e-4)
    assert mean.item() == pytest.approx(seen.mean(), rel=1e-4)
    pooled = (4 * first.var().item() + 2 * second.var().item() + 4 * 2 / 6 * (first.mean() - second.mean()).item() ** 2) / 6
    assert var.item() == pytest.approx(pooled, rel=1e-3)
    assert torch.equal(variance, var)  # what the reward divides by: the new variance
    # kept as one float64 tensor on the device (no step reads it back), as exact as Python floats; the checkpoint
    # holds it as it is (test_the_last_step_of_a_trajectory_is_terminal)
    assert moments.dtype == torch.float64 and moments.device.type == "cpu"


def test_knn_reward_on_a_hand_batch():
    source = torch.tensor([[0.0], [1.0], [3.0]])
    target = torch.tensor([[0.0], [1.0], [2.0]])
    moments = torch.tensor([0.0, 1.0, 1e-4], dtype=torch.float64)
    reward = cic.knn_reward(source, target, 2, moments)
    # distances source_i → targets: row 0 (0, 1, 2), row 1 (1, 0, 1), row 2 (3, 2, 1); the 2 smallest per row:
    nearest = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 2.0]])
    fresh = torch.tensor([0.0, 1.0, 1e-4], dtype=torch.float64)
    variance = cic.running_variance(fresh, nearest)  # the moments see exactly these 6 distances
    assert torch.equal(moments, fresh)
    expected = torch.log(1 + ((nearest / variance - 0.0005).clamp(min=0)).mean(-1))
    assert torch.allclose(reward, expected)
    assert reward[2] > reward[0]  # the farthest particle earns the most


def test_skill_encoder_is_spectrally_normalized():
    h = cic.skill_encoder(64, 32)
    layers = [m for m in h.modules() if isinstance(m, torch.nn.Linear)]
    assert len(layers) == 3 and all(hasattr(m, "parametrizations") for m in layers)
    h(torch.randn(8, 64))  # power iterations in training mode
    for layer in layers:
        assert torch.linalg.matrix_norm(layer.weight, ord=2).item() == pytest.approx(1.0, rel=0.1)


def test_the_last_step_of_a_trajectory_is_terminal(tmp_path):
    from conftest import read_evals, run_agent

    rb = cic.ReplayBuffer(400, 200, cic.envs.make_env("Ant").observation_space, 1, 8, 64, np.random.default_rng(0))
    steps = np.broadcast_to(np.arange(201, dtype=np.float32)[None, :, None], (2, 201, 29))  # obs = its step index
    rb.add(steps, np.zeros((2, 200, 8)), np.zeros((2, 64)))
    batch = rb.sample(2000, "cpu")
    assert torch.equal(batch["last"] == 1, batch["obs"][:, 0] == 199)  # terminal exactly at the 200th step
    assert 0 < batch["last"].mean().item() < 0.02
    assert cic.critic_target(torch.ones(2), torch.tensor([0.0, 1.0]), torch.ones(2, 2), torch.zeros(2),
                             0.1, 0.5).tolist() == [1.5, 1.0]  # bootstrap cut at the terminal step (twin Q̄ = 1)
    run_dir = run_agent(cic, tmp_path, "--total-env-steps", "800", "--num-envs", "2", "--learning-starts", "400",
                        "--grad-steps-per-epoch", "2", "--batch-size", "16", "--hidden-dim", "16",
                        "--num-eval-skills", "2", "--no-time-limit-terminal", "--no-cuda")
    assert read_evals(run_dir)[-1]["grad_steps"] == 4
    # the checkpoint holds the kNN distances' running moments: 4 steps of 16 × 16 distances after the prior's 1e-4
    moments = torch.load(f"{run_dir}/checkpoint.pt", weights_only=False)["moments"]
    assert moments.dtype == torch.float64 and moments[2].item() == pytest.approx(4 * 16 * 16 + 1e-4)


def test_evaluation_period_is_the_official_cic_one():
    # the official scripts/pretrain/cic/*.sh evaluate HalfCheetah every 500 epochs (the CSF/METRA scripts: 1000);
    # on the other worlds CIC's period is theirs
    expected = {"Ant": 500, "HalfCheetah": 500, "Quadruped": 125, "Humanoid": 125, "Kitchen": 250, "Robobin": 500}
    for env_id, period in expected.items():
        args, _ = cic.parse_args(["--env-id", env_id])
        assert (args.eval_every, args.checkpoint_every) == (period, period), env_id
    assert cic.parse_args(["--env-id", "HalfCheetah", "--eval-every", "1000"])[0].eval_every == 1000  # a set flag wins


def test_help_says_alpha_is_always_tuned(capsys):
    # CIC tunes α on every world (the help text once said "fixed at it on Kitchen", METRA's rule, not CIC's)
    with pytest.raises(SystemExit):
        cic.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "tuned automatically towards entropy -|A|/2 on every env" in help_text
    assert "fixed at it on Kitchen" not in help_text
