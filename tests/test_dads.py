"""dads.py: the skill-dynamics log-likelihood and the reward on hand batches, the batch-norm modes, the batched
alternatives against the naive form, and the refusal of the pixel worlds. What every agent shares is in
test_agent_runs.py and test_command_line.py."""

import math

import pytest
import torch

import dads


def test_reward_on_a_hand_batch():
    # own skill first, then L = 2 alternatives: log q = (-1; -1, -3) and (-2; 0, -60)
    log_likelihoods = torch.tensor([[-1.0, -1.0, -3.0], [-2.0, 0.0, -60.0]])
    expected = [math.log(3) - math.log(1 + math.exp(0) + math.exp(-2)),
                math.log(3) - math.log(1 + math.exp(2) + math.exp(-50))]  # -58 clipped at -50
    assert dads.dads_reward(log_likelihoods).tolist() == pytest.approx(expected, rel=1e-6)


def set_model(model):
    """A model whose mean is the skill's first coordinate on every output dimension, whatever the state."""
    with torch.no_grad():
        for layer in (model.net[0], model.net[2], model.net[4]):
            layer.weight.zero_(), layer.bias.zero_()
        model.net[0].weight[0, -3] = 1.0  # hidden 0 = relu(z_0)
        model.net[2].weight[0, 0] = 1.0
        model.net[4].weight[:, 0] = 1.0


def test_log_likelihood_of_a_set_model():
    model = dads.SkillDynamics(obs_dim=2, skill_dim=3, hidden_dim=4)
    set_model(model)
    model.eval()  # running statistics: mean 0, variance 1, so BN_out(Δ) ≈ Δ
    obs, next_obs = torch.zeros(1, 2), torch.tensor([[0.5, 1.5]])
    skills = torch.tensor([[[0.5, 0.0, 0.0], [-1.0, 0.0, 0.0]]])  # means (0.5, 0.5) and (0, 0) (relu)
    delta = next_obs / math.sqrt(1 + 1e-5)
    for k, mean in enumerate((0.5, 0.0)):
        expected = (-0.5 * (delta - mean).pow(2) - 0.5 * math.log(2 * math.pi)).sum().item()
        assert model.log_likelihoods(obs, next_obs, skills)[0, k].item() == pytest.approx(expected, rel=1e-5)


def test_batched_alternatives_equal_the_naive_form():
    torch.manual_seed(0)
    model = dads.SkillDynamics(obs_dim=29, skill_dim=3, hidden_dim=32)
    obs, next_obs = torch.randn(8, 29), torch.randn(8, 29)
    model.eval()
    skills = dads.sample_skills(8 * 5, 3).view(8, 5, 3)
    batched = model.log_likelihoods(obs, next_obs, skills)
    # naive: every (s, z_l) row through the whole network
    rows = torch.cat([model.input_norm(obs).repeat_interleave(5, 0), skills.reshape(-1, 3)], -1)
    target = model.target_norm(next_obs - obs).repeat_interleave(5, 0)
    naive = torch.distributions.Normal(model.net(rows), 1.0).log_prob(target).sum(-1).view(8, 5)
    assert torch.allclose(batched, naive, atol=1e-5)


def test_batch_norms_train_for_the_loss_and_stay_put_for_the_reward():
    model = dads.SkillDynamics(obs_dim=3, skill_dim=3, hidden_dim=8)
    assert {id(p) for p in model.trained_parameters()}.isdisjoint({id(model.input_norm.weight), id(model.input_norm.bias)})
    assert model.target_norm.momentum == 0.01 and not model.target_norm.affine and model.input_norm.affine
    obs, next_obs, skill = torch.randn(16, 3) + 5, torch.randn(16, 3), dads.sample_skills(16, 3)
    model.train()
    model.log_likelihoods(obs, next_obs, skill[:, None])  # the loss: batch statistics, running ones move
    moved = model.input_norm.running_mean.clone(), model.target_norm.running_mean.clone()
    assert moved[0].abs().min() > 0.03 and moved[1].abs().max() > 0  # 0.01 · (≈ 5): momentum 0.01
    model.eval()
    model.log_likelihoods(obs, next_obs, skill[:, None].expand(16, 4, 3))  # the reward: running statistics, unchanged
    assert torch.equal(model.input_norm.running_mean, moved[0]) and torch.equal(model.target_norm.running_mean, moved[1])


def test_input_norm_momentum_is_the_official_one():
    # the official IOD.__init__ (iod/iod.py) builds both skill-dynamics batch norms with momentum 0.01; the reward
    # reads BN_in's running statistics, so PyTorch's default 0.1 would track the buffer ten times faster
    model = dads.SkillDynamics(obs_dim=3, skill_dim=3, hidden_dim=8)
    assert model.input_norm.momentum == 0.01 and model.target_norm.momentum == 0.01
    obs = torch.tensor([[1.0, 2.0, -4.0], [3.0, 6.0, 0.0], [5.0, -2.0, 10.0], [7.0, 10.0, 2.0]])  # mean (4, 4, 2)
    model.train()
    model.log_likelihoods(obs, torch.zeros(4, 3), dads.sample_skills(4, 3)[:, None])
    expected = 0.99 * torch.zeros(3) + 0.01 * obs.mean(0)  # (0.04, 0.04, 0.02); momentum 0.1 would give (0.4, 0.4, 0.2)
    assert torch.allclose(model.input_norm.running_mean, expected, atol=1e-7)
    unbiased_var = obs.var(0, unbiased=True)
    assert torch.allclose(model.input_norm.running_var, 0.99 * torch.ones(3) + 0.01 * unbiased_var, atol=1e-6)


def test_skills_and_worlds(capsys):
    z = dads.sample_skills(1000, 3, torch.Generator().manual_seed(0))
    assert z.min() >= -1 and z.max() <= 1 and z.min() < -0.9 and z.max() > 0.9  # U[-1, 1]^3
    with pytest.raises(SystemExit) as stop:  # --env-id takes Ant or HalfCheetah only: tyro refuses the rest
        dads.parse_args(["--env-id", "Quadruped"])
    refusal = "".join(capsys.readouterr().err.replace("│", "").split())  # tyro's box, without spaces or borders
    assert stop.value.code == 2 and "invalidchoice'Quadruped'forargument'--env-id'" in refusal
    assert "Expectedoneof('Ant','HalfCheetah')" in refusal
