"""The fast path on a real GPU: `python -m pytest -q tests/test_cuda.py` on a machine with CUDA (skipped without).

--cudagraphs records the whole gradient step once and replays it: after its warm-up steps, a replayed step must give
the numbers of the eager step (the same kernels and the same random draws; only fused against foreach Adam rounds
differently). It replays the policy's actions too (collection's samples, evaluation's modes), which must equal the
eager actions for the same observations and random draws. --compile --cudagraphs draws its own random numbers, so
there the run must only train and stay finite. A checkpoint crosses between the paths both ways, and
hierarchical.py's SAC replays its step too.
"""

import math
import os
import types

import pytest
import torch
from conftest import AGENTS, load, name, read_evals, run_agent

import csf
import envs
import hierarchical
import metra

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

# one epoch of 8 gradient steps on 400 stored transitions: 3 warm-up steps, the capture, then replays
FLAGS = ("--total-env-steps", "800", "--learning-starts", "400", "--num-envs", "2", "--grad-steps-per-epoch", "8",
         "--batch-size", "64", "--hidden-dim", "64", "--num-eval-skills", "2", "--eval-every", "1")
STATS = {"csf": ("phi_loss", "psi_loss", "actor_loss", "alpha_loss", "logsumexp"),
         "metra": ("phi_loss", "qf_loss", "actor_loss", "alpha_loss", "reward", "lambda_loss"),
         "diayn": ("phi_loss", "qf_loss", "actor_loss", "reward"), "visr": ("phi_loss", "psi_loss", "actor_loss"),
         "cic": ("cpc_loss", "qf_loss", "actor_loss", "knn_reward"), "dads": ("model_loss", "qf_loss", "actor_loss")}


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_a_replayed_step_gives_the_eager_numbers(agent, tmp_path):
    (tmp_path / "eager").mkdir(), (tmp_path / "graphs").mkdir()
    eager = read_evals(run_agent(agent, tmp_path / "eager", *FLAGS, "--no-parallel-envs"))
    graphs = read_evals(run_agent(agent, tmp_path / "graphs", *FLAGS, "--no-parallel-envs", "--cudagraphs"))
    assert graphs[-1]["grad_steps"] == eager[-1]["grad_steps"] == 16
    for stat in STATS[name(agent)]:  # the means over the first epoch's 8 steps, 5 of them replayed
        assert graphs[1][stat] == pytest.approx(eager[1][stat], rel=2e-3, abs=1e-5), stat


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_the_replayed_policy_gives_the_eager_actions(agent):
    """fast_path's run.policy and run.eval_policy with --cudagraphs (3 eager calls, the capture, then replays) on new
    observations each call: the eager policy's actions, for the same random draws."""
    device = torch.device("cuda")
    env = envs.make_env("Ant")
    actor = agent.Actor(env.observation_space, env.action_space.shape[0], 2, 64).to(device)
    eager, graphs = types.SimpleNamespace(), types.SimpleNamespace()
    agent.fast_path(None, actor, eager, types.SimpleNamespace(compile=False, cudagraphs=False), device)
    agent.fast_path(None, actor, graphs, types.SimpleNamespace(compile=False, cudagraphs=True), device)
    assert isinstance(graphs.policy, agent.CudaGraphStep) and isinstance(graphs.eval_policy, agent.CudaGraphStep)
    skill = torch.nn.functional.normalize(torch.randn(8, 2, device=device), dim=-1)
    with torch.no_grad():
        for call in range(8):
            obs = torch.randn(8, *env.observation_space.shape, device=device)
            torch.cuda.manual_seed(call)
            expected = eager.policy(obs=obs, skill=skill)["action"]
            torch.cuda.manual_seed(call)
            sampled = graphs.policy(obs=obs, skill=skill)["action"]
            torch.testing.assert_close(sampled, expected, rtol=1e-5, atol=1e-6)
            mode = graphs.eval_policy(obs=obs, skill=skill)["action"]
            torch.testing.assert_close(mode, eager.eval_policy(obs=obs, skill=skill)["action"], rtol=1e-5, atol=1e-6)
            assert not torch.equal(sampled, mode)  # a sample, not the mode


@pytest.mark.parametrize("agent", [csf, metra], ids=name)
def test_compiled_and_replayed_step_trains(agent, tmp_path):
    lines = read_evals(run_agent(agent, tmp_path, *FLAGS, "--compile", "--cudagraphs"))
    assert lines[-1]["grad_steps"] == 16
    assert all(math.isfinite(lines[1][stat]) for stat in STATS[name(agent)])


def test_a_checkpoint_crosses_between_the_eager_and_the_replayed_step(tmp_path):
    """Eager → --cudagraphs (Adam's step counts move to the GPU, capturable) → eager (back to the host)."""
    run_dir = run_agent(csf, tmp_path, *FLAGS, "--no-parallel-envs")
    checkpoint = os.path.join(run_dir, "checkpoint.pt")
    for flags, epochs in ((("--cudagraphs",), 3), (("--no-cudagraphs",), 4)):
        csf.main(*csf.parse_args(["--resume", checkpoint, "--total-env-steps", str(400 * epochs), *flags]))
        ckpt = load(checkpoint)
        assert ckpt["epoch"] == epochs and ckpt["grad_steps"] == 8 * epochs
        assert all(math.isfinite(value) for value in read_evals(run_dir)[-1].values() if isinstance(value, float))


def test_hierarchical_sac_replays_its_step(tmp_path):
    (tmp_path / "child").mkdir(), (tmp_path / "eager").mkdir(), (tmp_path / "graphs").mkdir()
    child = run_agent(csf, tmp_path / "child", "--total-env-steps", "400", "--num-envs", "2", "--hidden-dim", "16",
                      "--grad-steps-per-epoch", "0", "--num-eval-skills", "1", "--no-parallel-envs")
    flags = ("--checkpoint", child, "--task", "AntMultiGoal", "--total-env-steps", "800", "--learning-starts", "16",
             "--grad-steps-per-epoch", "8", "--num-envs", "2", "--batch-size", "16", "--hidden-dim", "64",
             "--num-eval-episodes", "2", "--eval-every", "1", "--no-parallel-envs")
    eager = read_evals(run_agent(hierarchical, tmp_path / "eager", *flags))
    graphs = read_evals(run_agent(hierarchical, tmp_path / "graphs", *flags, "--cudagraphs"))
    assert graphs[-1]["grad_steps"] == eager[-1]["grad_steps"] > 0
    for stat in ("qf_loss", "actor_loss", "alpha_loss", "q"):  # the first epoch's 8 steps, 5 of them replayed
        assert graphs[1][stat] == pytest.approx(eager[1][stat], rel=2e-3, abs=1e-5), stat
