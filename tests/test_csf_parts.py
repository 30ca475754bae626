"""CSF's losses and networks on small batches whose answers are computed by hand."""

import argparse
import math

import gymnasium as gym
import numpy as np
import pytest
import torch

import csf


def test_phi_loss_matches_hand_computation():
    dphi = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    skill = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    negatives = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    xi = 5.0
    # sample 1: positive 1, logsumexp log(e^1 + e^-1); sample 2: positive 2, logsumexp log(e^0 + e^0)
    lse1, lse2 = math.log(math.e + 1 / math.e), math.log(2.0)
    expected = -((1 - xi * lse1) + (2 - xi * lse2)) / 2
    loss, logsumexp = csf.contrastive_phi_loss(dphi, skill, negatives, xi)
    assert math.isclose(loss.item(), expected, rel_tol=1e-6)
    assert math.isclose(logsumexp.item(), (lse1 + lse2) / 2, rel_tol=1e-6)


def test_phi_loss_at_zero_dphi_is_xi_log_m_and_pushes_towards_the_skill():
    negatives = csf.sample_skills(256, 2)
    dphi = torch.zeros(4, 2, requires_grad=True)
    skill = csf.sample_skills(4, 2)
    loss, logsumexp = csf.contrastive_phi_loss(dphi, skill, negatives, 5.0)
    assert math.isclose(logsumexp.item(), math.log(256), rel_tol=1e-6)  # the collapse signature: log M
    assert math.isclose(loss.item(), 5.0 * math.log(256), rel_tol=1e-6)
    loss.backward()
    # descent direction -grad has a positive component along z (the positive term pulls Δφ towards z)
    assert ((-dphi.grad * skill).sum(-1) > 0).all()


def test_successor_feature_target_takes_the_whole_vector_of_the_argmin_net():
    skill = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    next_psi1 = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # values ψ̄ᵀz: 1.0 and 0.0
    next_psi2 = torch.tensor([[0.5, 5.0], [2.0, 2.0]])  # values ψ̄ᵀz: 0.5 and 2.0
    dphi = torch.tensor([[0.1, 0.2], [0.3, 0.4]])
    next_psi = torch.stack([next_psi1, next_psi2])
    target = csf.successor_feature_target(dphi, next_psi, (next_psi * skill).sum(-1), gamma=0.5)
    # sample 1 picks ψ̄2's whole vector (0.5, 5.0) — an elementwise min would give (0.5, 0.0); sample 2 picks ψ̄1
    expected = torch.tensor([[0.1 + 0.25, 0.2 + 2.5], [0.3, 0.4]])
    assert torch.allclose(target, expected)


def test_temperature_loss_sign():
    """α rises when the policy's entropy is below the target, falls when above."""
    # log π = 6: entropy ≈ -6 < H̄ = -4, so α must rise; log π = -10: entropy ≈ 10 > -4, so α must fall
    for log_prob, direction in ((torch.full((8,), 6.0), +1), (torch.full((8,), -10.0), -1)):
        log_alpha = torch.tensor(math.log(0.01), requires_grad=True)
        loss = csf.temperature_loss(log_alpha, log_prob, target_entropy=-4.0)
        assert math.isclose(loss.item(), -math.log(0.01) * (log_prob[0].item() - 4.0), rel_tol=1e-6)
        loss.backward()
        torch.optim.SGD([log_alpha], lr=0.1).step()
        assert (log_alpha.item() - math.log(0.01)) * direction > 0


def test_skills_lie_on_the_unit_sphere():
    z = csf.sample_skills(1000, 8)
    assert torch.allclose(z.norm(dim=-1), torch.ones(1000))
    assert z.mean(0).abs().max() < 0.1  # uniform on the sphere: no preferred direction


def test_actor_log_prob_is_the_tanh_gaussian_density():
    torch.manual_seed(0)
    space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    actor = csf.Actor(space, action_dim=4, skill_dim=2, hidden_dim=16)  # a density per dimension, summed
    obs, skill = torch.randn(5, 3), csf.sample_skills(5, 2)
    action, log_prob = actor.sample(obs, skill)
    mean, log_std = actor(obs, skill)
    u = torch.atanh(action.clamp(-1 + 1e-6, 1 - 1e-6))
    gauss = -0.5 * ((u - mean) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
    expected = (gauss - torch.log(1 - action**2 + 1e-6)).sum(-1)
    assert log_prob.shape == (5,) and torch.allclose(log_prob, expected, atol=1e-3)
    assert (action.abs() < 1).all()
    assert torch.allclose(actor.mode(obs, skill), torch.tanh(mean))


ON_DEVICE = [None, torch.device("cpu")]  # on the host, drawn with numpy; --buffer-on-device (the CPU here), with torch


@pytest.mark.parametrize("device", ON_DEVICE, ids=["host", "on-device"])
@pytest.mark.parametrize("clone_device", ON_DEVICE, ids=["to-host", "to-device"])
def test_replay_buffer_wraps_around_and_round_trips(device, clone_device):
    """A state saved from either storage loads into either (--buffer-on-device may change at resume)."""
    space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
    rb = csf.ReplayBuffer(6, horizon=2, space=space, frame_stack=1, action_dim=1, skill_dim=1,
                          rng=np.random.default_rng(0), device=device)
    for first in (0, 10, 20, 30):  # 4 trajectories into room for 3: the oldest one is overwritten
        obs = np.arange(first, first + 3, dtype=np.float32).reshape(1, 3, 1)  # s_0, s_1, s_2 of one trajectory
        rb.add(obs, obs[:, :2] * 100, np.array([[first]], np.float32))
    assert rb.size == 6 and rb.added == 4
    assert sorted(rb.skills[:, 0].tolist()) == [10, 20, 30]
    clone = csf.ReplayBuffer(6, 2, space, 1, 1, 1, rng=np.random.default_rng(0), device=clone_device)
    clone.load_state_dict(rb.state_dict())
    assert (clone.added, clone.size) == (rb.added, rb.size)
    batch = clone.sample(64, "cpu")
    assert torch.equal(batch["next_obs"], batch["obs"] + 1)  # s' is the next step of the same trajectory
    assert torch.equal(batch["action"], batch["obs"] * 100)
    assert torch.equal(batch["skill"], torch.floor(batch["obs"] / 10) * 10)  # the trajectory's own skill
    assert set(batch["obs"][:, 0].tolist()) == {10, 11, 20, 21, 30, 31}  # all 6 transitions are drawn


def test_a_buffer_on_the_device_draws_with_torchs_generator_and_an_evaluation_with_its_rng():
    """Training draws on the device come from torch's own generator (which a checkpoint saves): the same torch seed,
    the same batches, another, others; the buffer's state saves its host rng too. An evaluation's `rng` draws the same
    transitions from either storage."""
    space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)

    def filled(device, seed=0):
        rb = csf.ReplayBuffer(40, 4, space, 1, 1, 1, rng=np.random.default_rng(seed), device=device)
        obs = np.arange(50, dtype=np.float32).reshape(10, 5, 1)
        rb.add(obs, obs[:, :4], np.arange(10, dtype=np.float32)[:, None])
        return rb

    draws = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        draws.append(filled(torch.device("cpu")).sample(32, "cpu")["obs"])
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    host = filled(None)
    first = host.sample(32, "cpu")["obs"]
    restored = filled(None, seed=1)  # another seed: its rng is replaced by the saved one
    restored.load_state_dict(host.state_dict())
    assert torch.equal(restored.sample(32, "cpu")["obs"], host.sample(32, "cpu")["obs"])
    assert not torch.equal(first, host.sample(32, "cpu")["obs"])
    on_host = filled(None).sample(32, "cpu", rng=np.random.default_rng(7))
    on_device = filled(torch.device("cpu")).sample(32, "cpu", rng=np.random.default_rng(7))
    assert all(torch.equal(on_host[key], on_device[key]) for key in on_host)


@pytest.mark.parametrize("device", ON_DEVICE, ids=["host", "on-device"])
def test_pixel_buffer_rebuilds_the_env_stacks_across_trajectory_boundaries(device):

    import envs

    env = envs.make_env("Quadruped")
    horizon, rng = 4, np.random.default_rng(0)
    rb = csf.ReplayBuffer(2 * horizon, horizon, env.observation_space, 3, 12, 4, rng, device)
    trajectories = []
    for seed in range(3):  # three trajectories into room for two: the newest two remain, slots wrapped
        obs, _ = env.reset(seed=seed)
        observations = [obs]
        for _ in range(horizon):
            observations.append(env.step(rng.uniform(-1, 1, 12))[0])
        trajectories.append(np.stack(observations))
        rb.add(trajectories[-1][None], np.zeros((1, horizon, 12)), np.zeros((1, 4)))
    assert rb.frames.dtype == torch.uint8
    assert rb.frames.shape == (2, horizon + 1, 64, 64, 3)  # one frame per step
    class Draws:  # every transition of both slots, in order: slot 0's steps 0..3, then slot 1's
        def integers(self, low, high, size):
            return np.arange(size)

    batch = rb.sample(2 * horizon, "cpu", rng=Draws())
    assert batch["obs"].shape == batch["next_obs"].shape == (2 * horizon, 64, 64, 9)  # the env's stacks of 3
    for slot, trajectory in ((1, trajectories[1]), (0, trajectories[2])):
        for t in range(horizon):
            assert np.array_equal(batch["obs"][slot * horizon + t], trajectory[t]), (slot, t)
            assert np.array_equal(batch["next_obs"][slot * horizon + t], trajectory[t + 1]), (slot, t)
    assert not np.array_equal(trajectories[1][0], trajectories[2][0])  # different starts, so the check is not vacuous


# ---------------------------------------------------------------- the paper's ablations (--critic, --reward)
DPHI = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
SKILL = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
NEGATIVES = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])


@pytest.mark.parametrize("critic, positives, negative_scores", [
    # inner (and mlp, on its own features): xᵀz
    ("inner", [1.0, 2.0], [[1.0, -1.0], [0.0, 0.0]]),
    ("mlp", [1.0, 2.0], [[1.0, -1.0], [0.0, 0.0]]),
    # gaussian: -½‖x - z‖²: (1,0)-(1,0) → 0, (1,0)-(-1,0) → -2; (0,2)-(0,1) → -0.5, (0,2)-(±1,0) → -2.5
    ("gaussian", [0.0, -0.5], [[0.0, -2.0], [-2.5, -2.5]]),
    # laplacian: -‖x - z‖₁: 0 and -2; -1, and -3 for both negatives
    ("laplacian", [0.0, -1.0], [[0.0, -2.0], [-3.0, -3.0]]),
])
def test_each_critic_phi_loss_on_a_hand_batch(critic, positives, negative_scores):
    xi = 5.0
    lse = [math.log(sum(math.exp(v) for v in row)) for row in negative_scores]
    expected = -sum(p - xi * l for p, l in zip(positives, lse)) / 2
    loss, logsumexp = csf.kernel_phi_loss(DPHI, SKILL, NEGATIVES, xi, critic)
    if critic == "inner":  # the paper's loss, without the ablations' code
        assert torch.equal(csf.contrastive_phi_loss(DPHI, SKILL, NEGATIVES, xi)[0], loss)
    assert loss.item() == pytest.approx(expected, rel=1e-6) and logsumexp.item() == pytest.approx(sum(lse) / 2)
    assert csf.critic_value(DPHI, SKILL, critic).tolist() == pytest.approx(positives)


def test_inner_critic_is_todays_loss_exactly():
    dphi, skill, negatives = torch.randn(64, 3), csf.sample_skills(64, 3), csf.sample_skills(256, 3)
    positive = (dphi * skill).sum(-1)
    expected = -(positive - 5.0 * torch.logsumexp(dphi @ negatives.T, dim=-1)).mean()
    assert torch.equal(csf.contrastive_phi_loss(dphi, skill, negatives, 5.0)[0], expected)  # bit for bit


def scalar_head_psi(critic, reward):
    """A tiny ψ with ψ₀, as --critic `critic` --reward `reward` builds it."""
    flags = argparse.Namespace(xi=5.0, critic=critic, reward=reward)
    space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    return csf.ScalarHeadSuccessorFeatures(space, action_dim=1, skill_dim=2, hidden_dim=4, args=flags)


@pytest.mark.parametrize("critic", ["inner", "gaussian", "laplacian"])
def test_mutual_information_reward_is_the_per_sample_contrastive_bound(critic):
    def reward(kind):  # r, from ψ's cumulant: Δφ, then r - Δφᵀz
        cumulant = scalar_head_psi(critic, kind).with_remainder(DPHI, SKILL, NEGATIVES)
        assert torch.equal(cumulant[:, :-1], DPHI)
        return cumulant[:, -1] + (DPHI * SKILL).sum(-1)

    bottleneck, mi = reward("bottleneck"), reward("mutual-information")
    assert torch.allclose(bottleneck, csf.critic_value(DPHI, SKILL, critic))  # the negative term left out
    loss, _ = csf.kernel_phi_loss(DPHI, SKILL, NEGATIVES, 5.0, critic)
    assert mi.mean().item() == pytest.approx(-loss.item(), rel=1e-6)  # φ's objective, sample by sample
    lse = csf.negative_logsumexp(DPHI, NEGATIVES, critic)
    assert torch.allclose(mi, bottleneck - 5.0 * lse)


def test_scalar_head_enters_the_value_and_the_argmin():
    skill = torch.tensor([[1.0, 0.0]])
    space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    paper_psi = csf.SuccessorFeatures(space, action_dim=1, skill_dim=2, hidden_dim=4)
    assert paper_psi(torch.zeros(1, 3), skill, torch.zeros(1, 1)).shape == (1, 2)  # ψ ∈ R^d
    assert paper_psi.value(torch.tensor([[1.0, 2.0]]), skill).item() == 1.0  # ψᵀz
    psi = scalar_head_psi("gaussian", "bottleneck")
    assert psi(torch.zeros(1, 3), skill, torch.zeros(1, 1)).shape == (1, 3)  # ψ and ψ₀
    assert psi.value(torch.tensor([[1.0, 2.0, 3.0]]), skill).item() == 4.0  # ψᵀz + ψ₀
    # ψ̄1 has the larger ψ̄ᵀz (2 > 1) but the smaller value once its scalar head (-5) counts: it is the argmin
    next_psi = torch.stack([torch.tensor([[2.0, 0.0, -5.0]]), torch.tensor([[1.0, 0.0, 0.0]])])
    cumulant = torch.tensor([[0.5, 0.0, -1.0]])
    target = csf.successor_feature_target(cumulant, next_psi, psi.value(next_psi, skill), gamma=0.5)
    assert target.tolist() == [[0.5 + 1.0, 0.0, -1.0 - 2.5]]
