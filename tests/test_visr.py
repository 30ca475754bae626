"""visr.py: the vMF score, the φ loss and the ψ target with its cumulant on hand batches, and what only VISR's runs
show (φ reads the current observation; the official and the normalized cumulant; HalfCheetah). What every agent
shares is in test_agent_runs.py and test_command_line.py."""

import math
import os

import pytest
import torch
from conftest import load, read_evals, run_agent

import visr


def test_score_is_the_cosine_of_phi_and_the_skill():
    phi_s = torch.tensor([[3.0, 4.0], [0.0, -2.0], [0.0, 0.0]])
    skill = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    # ê = (0.6, 0.8), (0, -1), and 0 for a zero φ: scores 0.6, -1, 0; the norm of φ does not matter
    assert visr.vmf_score(phi_s, skill).tolist() == pytest.approx([0.6, -1.0, 0.0])
    assert visr.vmf_score(10 * phi_s, skill).tolist() == pytest.approx([0.6, -1.0, 0.0])
    loss, score = visr.visr_phi_loss(phi_s, skill)
    assert loss.item() == pytest.approx(-(0.6 - 1.0) / 3) and score.item() == pytest.approx((0.6 - 1.0) / 3)


def test_phi_loss_turns_phi_towards_the_skill_without_growing_it():
    phi_s = torch.tensor([[1.0, 1.0]], requires_grad=True)
    loss, _ = visr.visr_phi_loss(phi_s, torch.tensor([[1.0, 0.0]]))
    loss.backward()
    # d(-ê·z)/dφ is orthogonal to φ: the gradient only rotates φ, here towards (1, 0)
    assert (phi_s.grad * phi_s.detach()).sum().item() == pytest.approx(0.0, abs=1e-7)
    assert phi_s.grad[0, 0] < 0 < phi_s.grad[0, 1]


def test_successor_feature_target_adds_the_cumulant_to_the_argmin_vector():
    skill = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    next_psi1 = torch.tensor([[2.0, 9.0], [0.0, 1.0]])  # values ψ̄ᵀz: 2 and 1
    next_psi2 = torch.tensor([[1.0, -9.0], [5.0, 3.0]])  # values ψ̄ᵀz: 1 and 3
    cumulant = torch.tensor([[3.0, 4.0], [0.5, 0.5]])  # φ(s), unnormalized
    target = visr.successor_feature_target(cumulant, torch.stack([next_psi1, next_psi2]), skill, gamma=0.5)
    # sample 1 takes ψ̄2's whole vector, sample 2 ψ̄1's
    assert torch.allclose(target, torch.tensor([[3.0 + 0.5, 4.0 - 4.5], [0.5 + 0.0, 0.5 + 0.5]]))


@pytest.mark.parametrize("normalized", [False, True], ids=["official-cumulant", "normalized-cumulant"])
def test_halfcheetah_run_scores_the_current_observation_and_regresses_the_chosen_cumulant(normalized, tmp_path,
                                                                                          monkeypatch):
    """φ sees the batch's s (never s') in a gradient step, and ψ's target holds φ(s), or ê(s) with the flag."""
    batches, phi_inputs, cumulants = [], [], []
    real_sample, real_forward, real_target = visr.ReplayBuffer.sample, visr.Phi.forward, visr.successor_feature_target

    def sample(self, batch_size, device, rng=None):
        batch = real_sample(self, batch_size, device, rng)
        if rng is None:  # a training batch (the evaluation passes its own generator)
            batches.append(batch)
        return batch

    def forward(self, obs, *inputs):  # ψ is a Phi on (s, z, a): only φ's own calls count
        if not isinstance(self, visr.SuccessorFeatures):
            phi_net["module"] = self
            phi_inputs.append(obs)
        return real_forward(self, obs, *inputs)

    def target(cumulant, *rest):
        with torch.no_grad():  # φ(s) of the batch again, by the φ of this step
            cumulants.append((cumulant, real_forward(phi_net["module"], batches[-1]["obs"])))
        return real_target(cumulant, *rest)

    phi_net = {}
    monkeypatch.setattr(visr.ReplayBuffer, "sample", sample)
    monkeypatch.setattr(visr.Phi, "forward", forward)
    monkeypatch.setattr(visr, "successor_feature_target", target)
    run_dir = run_agent(visr, tmp_path, "--env-id", "HalfCheetah", "--total-env-steps", "800", "--num-envs", "2",
                        "--learning-starts", "400", "--grad-steps-per-epoch", "2", "--batch-size", "16",
                        "--hidden-dim", "16", "--num-eval-skills", "3", "--no-cuda",
                        *(["--normalized-cumulant"] if normalized else []))
    assert len(batches) == 4 and len(cumulants) == 4  # 2 gradient steps in each of epochs 0 and 1
    training_inputs = [x for x in phi_inputs if len(x) == 16]
    assert len(training_inputs) == 8  # φ step and cumulant, in each of the 4 steps
    for step, batch in enumerate(batches):
        for x in training_inputs[2 * step: 2 * step + 2]:
            assert torch.equal(x, batch["obs"]) and not torch.equal(x, batch["next_obs"])
    for cumulant, phi_s in cumulants:  # φ(s) of the φ just updated, normalized with the flag
        expected = torch.nn.functional.normalize(phi_s, dim=-1) if normalized else phi_s
        assert torch.allclose(cumulant, expected, atol=1e-6)
        assert torch.allclose(cumulant.norm(dim=-1), torch.ones(16)) == normalized
    first, last = read_evals(run_dir)
    assert -1 <= last["score"] <= 1 and math.isfinite(last["batch_score"])
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    assert ckpt["args"]["skill_dim"] == 5 and ckpt["args"]["normalized_cumulant"] is normalized
    assert torch.allclose(torch.as_tensor(ckpt["buffer"]["skills"]).norm(dim=-1), torch.ones(4))  # unit sphere
