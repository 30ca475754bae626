"""diayn.py: the reward and discriminator loss on hand batches, the one-hot skills, and what only DIAYN's runs show
(the discriminator reads the next observation; HalfCheetah). What every agent shares is in test_agent_runs.py and
test_command_line.py."""

import math
import os

import numpy as np
import pytest
import torch
from conftest import load, read_evals, run_agent

import diayn


def test_reward_is_log_q_of_the_skill_plus_log_k():
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    skill = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 0, 1.0]])
    # q(z|s') = softmax: e²/(e² + 3) for the first, 1/4 for the uniform rows; baseline log p(z) = log(1/4)
    expected = [math.log(math.exp(2) / (math.exp(2) + 3)) + math.log(4), 0.0, 0.0]
    assert diayn.diayn_reward(logits, skill).tolist() == pytest.approx(expected, abs=1e-6)
    # a wrong guess is penalised: the first sample's logits name skill 0, so skill 3 scores below log(1/4) + log 4
    assert diayn.diayn_reward(logits[:1], skill[2:]).item() == pytest.approx(math.log(1 / (math.exp(2) + 3)) + math.log(4))


def test_discriminator_loss_is_the_cross_entropy_less_log_k_and_learns():
    logits = torch.randn(6, 50, requires_grad=True)
    skill = diayn.sample_skills(6, 50)
    loss, reward = diayn.discriminator_loss(logits, skill)
    cross_entropy = torch.nn.functional.cross_entropy(logits, skill.argmax(-1))
    # compared as loss + log K, not loss alone: CE - log K is near 0, and float32 leaves it ~1e-7 of CE's rounding
    assert loss.item() + math.log(50) == pytest.approx(cross_entropy.item(), rel=1e-6)
    assert reward.mean().item() == pytest.approx(-loss.item(), rel=1e-6)
    loss.backward()  # descent raises the logit of each sample's own skill and lowers the others
    assert logits.grad[skill == 1].lt(0).all() and logits.grad[skill == 0].gt(0).all()


def test_one_hot_skills_and_the_evaluation_split():
    z = diayn.sample_skills(1000, 50, generator=torch.Generator().manual_seed(0))
    assert torch.all(z.sum(-1) == 1) and len(z.argmax(-1).unique()) == 50
    skills = diayn.eval_skills(48, 50, False, None)  # the paper's 48 rollouts over K = 50: skills 0..47 once each
    assert skills.argmax(-1).tolist() == list(range(48))
    assert diayn.eval_skills(100, 50, False, None).sum(0).tolist() == [2.0] * 50
    gaussian = diayn.eval_skills(4000, 9, True, torch.Generator().manual_seed(0))  # Robobin: z ~ N(0, I)
    assert gaussian.shape == (4000, 9) and abs(gaussian.mean()) < 0.02 and abs(gaussian.std() - 1) < 0.02


def test_halfcheetah_run_feeds_the_discriminator_the_next_observation(tmp_path, monkeypatch):
    """Every φ call of a gradient step sees the batch's s', never s; the evaluation's accuracy is a fraction."""
    batches, phi_inputs = [], []
    real_sample, real_forward = diayn.ReplayBuffer.sample, diayn.Phi.forward

    def sample(self, batch_size, device, rng=None):
        batch = real_sample(self, batch_size, device, rng)
        if rng is None:  # a training batch (the evaluation passes its own generator)
            batches.append(batch)
        return batch

    def forward(self, obs):
        phi_inputs.append(obs)
        return real_forward(self, obs)

    monkeypatch.setattr(diayn.ReplayBuffer, "sample", sample)
    monkeypatch.setattr(diayn.Phi, "forward", forward)
    run_dir = run_agent(diayn, tmp_path, "--env-id", "HalfCheetah", "--total-env-steps", "800", "--num-envs", "2",
                        "--learning-starts", "400", "--grad-steps-per-epoch", "2", "--batch-size", "16",
                        "--hidden-dim", "16", "--num-eval-skills", "3", "--no-cuda")
    assert len(batches) == 4  # 2 gradient steps in each of epochs 0 and 1
    training_inputs = [x for x in phi_inputs if len(x) == 16]
    assert len(training_inputs) == 8  # φ step and reward, in each of the 4 steps
    for step, batch in enumerate(batches):
        for x in training_inputs[2 * step: 2 * step + 2]:
            assert torch.equal(x, batch["next_obs"]) and not torch.equal(x, batch["obs"])
    first, last = read_evals(run_dir)
    assert 0 <= last["disc_accuracy"] <= 1 and last["disc_accuracy"] * 800 == pytest.approx(
        round(last["disc_accuracy"] * 800))  # a count over the 800 stored transitions
    assert 1 <= last["coverage"] <= 3 * 201
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    assert ckpt["args"]["skill_dim"] == 50 and ckpt["args"]["alpha"] == 0.1 and "log_alpha" not in ckpt
    assert bool((ckpt["buffer"]["skills"].sum(1) == 1).all()) and ckpt["buffer"]["skills"].shape == (4, 50)


def test_gaussian_discriminator_of_the_official_robobin_script():
    """z ~ N(0, I_d), q(z|s') = N(μ(s'), σ(s')), r = log q(z|s') - log(1/d)
    (the official iod/metra.py with --inner 0)."""
    mean, log_std = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, math.log(2.0)]])
    skill = torch.tensor([[1.0, 1.0]])
    # log N(1; 0, 1) + log N(1; 1, 2) = (-½ - ½ log 2π) + (-log 2 - ½ log 2π), plus log d = log 2
    expected = -0.5 - math.log(2.0) - math.log(2 * math.pi) + math.log(2.0)
    assert diayn.diayn_reward((mean, log_std), skill).item() == pytest.approx(expected, rel=1e-6)
    phi = diayn.Phi(diayn.envs.make_env("Ant").observation_space, 9, 16, gaussian=True)
    out_mean, out_log_std = phi(torch.randn(3, 29))
    assert out_mean.shape == out_log_std.shape == (3, 9)
    assert diayn.sample_skills(4, 9, gaussian=True).shape == (4, 9)
