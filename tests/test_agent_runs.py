"""Every agent end to end with tiny sizes, in this process: a smoke run that crosses gradient updates, evaluations and
checkpoints; the same seed gives the same numbers; a run resumed from a checkpoint between two evaluations continues
exactly like the uninterrupted one; a NaN stops the run and leaves a checkpoint it can resume from; pixels;
videos; --track (W&B offline) from the shell; --compile."""

import copy
import glob
import importlib.util
import io
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import types

import gymnasium as gym
import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from conftest import (AGENTS, FIVE_EPOCHS, assert_same_state, checkpoint_copies, load, name, read_evals, run_agent,
                      without_timing)

import cic
import csf
import dads
import diayn
import envs
import goal_reaching
import hierarchical
import metra
import visr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HORIZON = 200
# what each agent reports, besides coverage and the timings: training means, then its replay diagnostic
DIAGNOSTICS = {"csf": ("phi_loss", "psi_loss", "actor_loss", "alpha_loss", "logsumexp", "alpha", "dphi_sq"),
               "metra": ("phi_loss", "qf_loss", "actor_loss", "alpha_loss", "reward", "batch_constraint", "alpha",
                         "lambda_loss", "lambda", "dphi_sq", "constraint"),
               "diayn": ("phi_loss", "qf_loss", "actor_loss", "reward", "disc_accuracy"),
               "visr": ("phi_loss", "psi_loss", "actor_loss", "alpha_loss", "batch_score", "alpha", "score"),
               "cic": ("cpc_loss", "qf_loss", "actor_loss", "alpha_loss", "knn_reward", "alpha", "dphi_sq"),
               "dads": ("model_loss", "qf_loss", "actor_loss", "log_likelihood", "reward")}
# the NaN test poisons each agent's first loss: (where it is, its name, the call from which it is NaN: the first
# of gradient step 4), and the loss's name in the logs
POISON = {"csf": (csf, "contrastive_phi_loss", 4, "phi_loss"), "metra": (metra, "metra_phi_loss", 4, "phi_loss"),
          "diayn": (diayn, "discriminator_loss", 4, "phi_loss"), "visr": (visr, "visr_phi_loss", 4, "phi_loss"),
          "cic": (cic, "cpc_loss", 4, "cpc_loss"),
          "dads": (dads.SkillDynamics, "log_likelihoods", 7, "model_loss")}  # twice a step: the loss, the reward
# each agent's networks in its checkpoint, named as its main names them (twin critics: one ModuleList)
SF_NETWORKS, Q_NETWORKS = ("phi", "psi", "psi_target", "actor"), ("phi", "qf", "qf_target", "actor")
NETWORKS = {"csf": SF_NETWORKS, "metra": Q_NETWORKS, "diayn": Q_NETWORKS, "visr": SF_NETWORKS, "cic": Q_NETWORKS,
            "dads": ("model", *Q_NETWORKS[1:])}
PIXEL_AGENTS = [agent for agent in AGENTS if agent is not dads]  # DADS runs on the state worlds only


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_smoke_run_crosses_updates_evaluations_and_checkpoints(agent, tiny_run):
    run_dir, copies = tiny_run(agent, *FIVE_EPOCHS)
    lines = read_evals(run_dir)
    assert [line["epoch"] for line in lines] == [0, 2, 4, 5]
    assert [line["env_steps"] for line in lines] == [0, 800, 1600, 2000]
    assert [line["grad_steps"] for line in lines] == [0, 3, 9, 12]  # updates start once 800 transitions are stored
    for line in lines:
        assert all(math.isfinite(value) for value in line.values()), line
        assert 1 <= line["coverage"] <= 4 * (HORIZON + 1)  # 4 rollouts of 201 positions, 1×1 cells
    # untrained, the actions are near 0 and each ant stays by its start, within 0.1 of the origin: 4 cells around it
    assert lines[0]["coverage"] <= 8
    for key in (*DIAGNOSTICS[name(agent)], "sps", "ms_per_grad_step", "peak_rss_mb"):
        assert key in lines[-1], key
    files = os.listdir(run_dir)
    assert {f"skills_{steps:010d}.png" for steps in (0, 800, 1600, 2000)} <= set(files)
    assert any(f.startswith("events.out.tfevents") for f in files)
    assert sorted(copies) == [3, 5]  # --checkpoint-every 3, and the last epoch
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    assert ckpt["agent"] == name(agent) and ckpt["epoch"] == 5 and ckpt["grad_steps"] == 12
    assert ckpt["buffer"]["added"] == 10 and ckpt["args"]["hidden_dim"] == 16  # 10 trajectories of 200 steps
    assert [line["epoch"] for line in ckpt["evals"]] == [0, 2, 4, 5]  # what eval.jsonl holds, for a resume


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_same_seed_same_numbers(agent, tiny_run, tmp_path):
    first, _ = tiny_run(agent, *FIVE_EPOCHS)
    second = run_agent(agent, tmp_path, *FIVE_EPOCHS)
    assert without_timing(read_evals(second)) == without_timing(read_evals(first))
    assert_same_state(load(os.path.join(second, "checkpoint.pt")), load(os.path.join(first, "checkpoint.pt")))


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_eager_adam_is_foreach_and_steps_as_the_per_tensor_loop(agent, tiny_run):
    """The eager path's Adam steps are foreach calls (a CPU's default is the per-tensor loop), and they move the
    run's own parameters, from the run's own optimizer state, exactly as the loop does: the same numbers, bit for bit."""
    run_dir, _ = tiny_run(agent, *FIVE_EPOCHS)
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    optimizers = [key for key in ckpt if key.endswith("_optimizer")]
    assert optimizers
    for key in optimizers:
        group = ckpt[key]["param_groups"][0]
        assert group["foreach"] is True and group["fused"] is False, key
    network = NETWORKS[name(agent)][-1]  # the actor: its parameters, in the order its optimizer holds them
    generator = torch.Generator().manual_seed(0)
    grads = [[torch.randn(value.shape, generator=generator) for value in ckpt[network].values()] for _ in range(3)]
    moved = []
    for foreach in (True, False):
        params = [value.clone().requires_grad_() for value in ckpt[network].values()]
        optimizer = torch.optim.Adam(params, lr=1e-4, foreach=foreach)
        optimizer.load_state_dict(copy.deepcopy(ckpt["actor_optimizer"]))  # it steps the loaded moments in place
        optimizer.param_groups[0]["foreach"] = foreach
        for step_grads in grads:
            for param, grad in zip(params, step_grads):
                param.grad = grad
            optimizer.step()
        moved.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*moved))
    assert not all(torch.equal(a, b) for a, b in zip(moved[0], ckpt[network].values()))  # the steps moved them


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_resume_between_evaluations_with_resume_alone_continues_exactly(agent, tiny_run, tmp_path):
    """The epoch-3 checkpoint lies between the evaluations at 2 and 4; `--resume PATH` with no other flag must
    continue with the run's own flags (not the defaults) and reproduce epochs 4 and 5 exactly. The run was killed
    after logging its epoch-4 evaluation and before its next checkpoint: that evaluation is done again, not twice."""
    uninterrupted, copies = tiny_run(agent, *FIVE_EPOCHS)
    # the run directory as it was when the epoch-4 evaluation had just been logged, as after a crash
    run_dir = tmp_path / "runs" / os.path.basename(uninterrupted)
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoint.pt").write_bytes(copies[3])
    lines = read_evals(uninterrupted)
    (run_dir / "eval.jsonl").write_text("".join(
        line for line, parsed in zip(open(os.path.join(uninterrupted, "eval.jsonl")), lines) if parsed["epoch"] <= 3)
        + json.dumps({**lines[2], "coverage": -1}) + "\n")  # epoch 4, as the killed run logged it (marked)
    args, ckpt = agent.parse_args(["--resume", str(run_dir / "checkpoint.pt")])
    assert args.hidden_dim == 16 and args.total_env_steps == 2000 and ckpt["epoch"] == 3
    assert len(ckpt["since_eval"]) == 1  # epoch 2's means, not yet reported
    assert run_agent(agent, tmp_path, "--resume", str(run_dir / "checkpoint.pt")) == str(run_dir)
    assert without_timing(read_evals(run_dir)) == without_timing(lines)  # epochs 4 and 5: same losses and metrics
    # every network, optimizer, RNG stream and the buffer
    assert_same_state(load(run_dir / "checkpoint.pt"), load(os.path.join(uninterrupted, "checkpoint.pt")))


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_buffer_on_device_trains_on_its_own_draws_and_resumes_exactly(agent, tiny_run, tmp_path):
    """--buffer-on-device (the CPU as the device here): the same run up to the first update, different batches from
    then on (drawn with torch's own random numbers on the device), and resumed from its epoch-3 checkpoint, the same
    epochs 4 and 5."""
    host_dir, _ = tiny_run(agent, *FIVE_EPOCHS)
    run_dir, copies = tiny_run(agent, *FIVE_EPOCHS, "--buffer-on-device")
    host, lines = without_timing(read_evals(host_dir)), without_timing(read_evals(run_dir))
    assert [line["grad_steps"] for line in lines] == [0, 3, 9, 12]
    assert lines[0] == host[0]  # epoch 0, before any batch is drawn
    first_loss = DIAGNOSTICS[name(agent)][0]
    assert all(line[first_loss] != twin[first_loss] for line, twin in zip(lines[1:], host[1:]))
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    assert ckpt["args"]["buffer_on_device"]
    resumed = tmp_path / "runs" / os.path.basename(run_dir)
    resumed.mkdir(parents=True)
    (resumed / "checkpoint.pt").write_bytes(copies[3])
    (resumed / "eval.jsonl").write_text("".join(open(os.path.join(run_dir, "eval.jsonl")).readlines()[:2]))
    run_agent(agent, tmp_path, "--resume", str(resumed / "checkpoint.pt"))
    assert without_timing(read_evals(resumed)) == lines
    assert_same_state(load(resumed / "checkpoint.pt"), ckpt)


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_nan_stops_the_run_and_leaves_a_checkpoint_it_resumes_from(agent, tiny_run, tmp_path, monkeypatch):
    """A NaN first loss from gradient step 4 on (the first of epoch 2): one line, and the epoch-2 checkpoint untouched
    on disk; resumed from it, the run matches the uninterrupted one (checkpoint periods change no number)."""
    owner, attribute, first_bad_call, loss_name = POISON[name(agent)]
    real_loss, calls = getattr(owner, attribute), itertools.count(1)

    def poisoned(*inputs):
        out = real_loss(*inputs)
        scale = math.nan if next(calls) >= first_bad_call else 1.0
        return (out[0] * scale, *out[1:]) if isinstance(out, tuple) else out * scale

    flags = [*FIVE_EPOCHS, "--checkpoint-every", "1"]
    with checkpoint_copies() as copies, monkeypatch.context() as patch:
        patch.setattr(owner, attribute, poisoned)
        with pytest.raises(SystemExit) as stop:
            run_agent(agent, tmp_path, *flags)
    message = str(stop.value.code)
    assert "\n" not in message
    assert message.startswith(f"{name(agent)}.py: error: {loss_name} is nan at gradient step 4 (epoch 2)")
    (run_dir,) = glob.glob(str(tmp_path / "runs" / "*"))
    assert sorted(copies) == [1, 2]
    with open(os.path.join(run_dir, "checkpoint.pt"), "rb") as f:
        assert f.read() == copies[2]  # byte for byte the one written before the bad update
    run_agent(agent, tmp_path, "--resume", os.path.join(run_dir, "checkpoint.pt"))
    uninterrupted, _ = tiny_run(agent, *FIVE_EPOCHS)
    assert without_timing(read_evals(run_dir)) == without_timing(read_evals(uninterrupted))
    resumed, straight = load(os.path.join(run_dir, "checkpoint.pt")), load(os.path.join(uninterrupted, "checkpoint.pt"))
    for network in NETWORKS[name(agent)]:
        assert_same_state(resumed[network], straight[network], network)


@pytest.mark.parametrize("agent", [csf, diayn], ids=name)
def test_a_third_critic_added_in_main_is_saved_and_resumed_and_the_unchanged_script_refuses_it(agent, tmp_path):
    """A student's change, `range(2)` to `range(3)` where `main` builds the twin critics (ψ for CSF, Q for DIAYN):
    the variant saves three critics and three targets under the names `main` gives them, a resume of it continues
    exactly as the uninterrupted variant, and the unchanged script refuses its checkpoint in one line that names the
    extra critic."""
    source = open(os.path.join(ROOT, f"{name(agent)}.py"), encoding="utf-8").read()
    assert source.count("for _ in range(2)]") == 1  # the one place that sets how many critics there are
    path = tmp_path / f"{name(agent)}_three_critics.py"
    path.write_text(source.replace("for _ in range(2)]", "for _ in range(3)]"), encoding="utf-8")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    variant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variant)
    (tmp_path / "straight").mkdir()
    with checkpoint_copies() as copies:
        straight = run_agent(variant, tmp_path / "straight", *FIVE_EPOCHS)
    ckpt = load(os.path.join(straight, "checkpoint.pt"))
    critic = NETWORKS[name(agent)][1]
    for key in (critic, f"{critic}_target"):
        assert {parameter.split(".")[0] for parameter in ckpt[key]} == {"0", "1", "2"}, key
    resumed = tmp_path / "resumed" / "runs" / "three"
    resumed.mkdir(parents=True)
    (resumed / "checkpoint.pt").write_bytes(copies[3])  # between the evaluations at epochs 2 and 4
    variant.main(*variant.parse_args(["--resume", str(resumed / "checkpoint.pt")]))
    assert without_timing(read_evals(resumed)) == without_timing(read_evals(straight))
    assert_same_state(load(resumed / "checkpoint.pt"), ckpt)
    with pytest.raises(SystemExit) as stop:
        agent.main(*agent.parse_args(["--resume", str(resumed / "checkpoint.pt"), "--total-env-steps", "4000"]))
    message = str(stop.value.code)
    assert "\n" not in message and f"checkpoint.pt's {critic} does not fit this {name(agent)}.py (" in message
    assert 'Unexpected key(s) in state_dict: "2.' in message, message


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_a_resume_drops_what_was_logged_after_its_checkpoint_even_on_another_schedule(agent, tmp_path):
    """An evaluation logged after the last checkpoint (the run then died) is dropped, also where the resumed run,
    with another --eval-every, does not make it again."""
    run_dir = run_agent(agent, tmp_path, "--total-env-steps", "1200", *FIVE_EPOCHS[2:])  # evaluated at 0, 2, 3
    with open(os.path.join(run_dir, "eval.jsonl"), "a") as f:
        f.write('{"epoch": 4, "env_steps": 1600}\n')  # after the checkpoint at epoch 3
    agent.main(*agent.parse_args(["--resume", os.path.join(run_dir, "checkpoint.pt"), "--total-env-steps", "2000",
                                  "--eval-every", "5", "--no-parallel-envs"]))
    assert [line["epoch"] for line in read_evals(run_dir)] == [0, 2, 3, 5]


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_resumed_from_elsewhere_the_run_keeps_its_folder_and_rewrites_a_damaged_log(agent, tmp_path):
    """A resume from another working directory goes on in the checkpoint's folder, and writes eval.jsonl anew from
    the evaluations the checkpoint holds: a corrupt line, a blank one and a torn last one (a crash mid-write) are
    gone, and the lines the checkpoint holds are back byte for byte."""
    (tmp_path / "first").mkdir()
    run_dir = run_agent(agent, tmp_path / "first", "--total-env-steps", "1200", *FIVE_EPOCHS[2:])  # epochs 0-3
    log = os.path.join(run_dir, "eval.jsonl")
    with open(log) as f:
        lines = f.readlines()
    with open(log, "w") as f:
        f.writelines([lines[0], "not json\n", *lines[1:], '\n{"epoch": 4, "env_steps": 16'])
    (tmp_path / "elsewhere").mkdir()
    old = os.getcwd()
    os.chdir(tmp_path / "elsewhere")
    try:
        agent.main(*agent.parse_args(["--resume", os.path.join(run_dir, "checkpoint.pt"), "--total-env-steps", "2000"]))
        assert not os.path.exists("runs")  # no second folder
    finally:
        os.chdir(old)
    with open(log) as f:
        mended = f.readlines()
    assert mended[:len(lines)] == lines and [json.loads(line)["epoch"] for line in mended] == [0, 2, 3, 4, 5]


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_a_non_finite_action_stops_the_run_with_one_line(agent, tmp_path, monkeypatch):
    """The envs refuse NaN actions; a policy that gives one (its networks diverged) ends the run with one line."""
    real_mode, calls = agent.Actor.mode, itertools.count(1)

    def diverged(self, *inputs):  # from the evaluation at epoch 2 on (epoch 0's took HORIZON calls)
        action = real_mode(self, *inputs)
        return action * math.nan if next(calls) > HORIZON else action

    monkeypatch.setattr(agent.Actor, "mode", diverged)
    with pytest.raises(SystemExit) as stop:
        run_agent(agent, tmp_path, *FIVE_EPOCHS)
    assert str(stop.value.code) == (f"{name(agent)}.py: error: the policy's action is not finite at epoch 2: its "
                                    "networks diverged")


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_the_policies_are_the_actors_sample_and_mode(agent):
    """fast_path's run.policy samples (collection's actions) and run.eval_policy gives the mode (evaluation's); on a
    CPU neither is a CUDA graph, even with --cudagraphs (tests/test_cuda.py replays them on a GPU)."""
    env = envs.make_env("Ant")
    actor = agent.Actor(env.observation_space, env.action_space.shape[0], 2, 16)
    run = types.SimpleNamespace()
    agent.fast_path(None, actor, run, types.SimpleNamespace(compile=False, cudagraphs=True), torch.device("cpu"))
    assert not isinstance(run.policy, agent.CudaGraphStep) and not isinstance(run.eval_policy, agent.CudaGraphStep)
    obs = torch.randn(4, *env.observation_space.shape)
    skill = torch.nn.functional.normalize(torch.randn(4, 2), dim=-1)
    with torch.no_grad():
        torch.manual_seed(0)
        expected = actor.sample(obs, skill)[0]
        torch.manual_seed(0)
        assert torch.equal(run.policy(obs=obs, skill=skill)["action"], expected)
        assert torch.equal(run.eval_policy(obs=obs, skill=skill)["action"], actor.mode(obs, skill))
        assert not torch.equal(expected, actor.mode(obs, skill))


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_buffer_stores_the_final_observation_of_every_trajectory(agent, tmp_path, monkeypatch):
    """s' of a trajectory's last step is the observation the time limit ended it with, never a reset one (what a
    vector env that resets on its own, or a time limit off by one, would leave)."""
    made = []

    class KeepFinal(gym.Wrapper):
        def step(self, action):
            obs, reward, terminated, truncated, info = self.env.step(action)
            if truncated:
                self.finals.append(obs.copy())
            return obs, reward, terminated, truncated, info

    def make_env(*args, **kwargs):
        made.append(KeepFinal(real_make_env(*args, **kwargs)))
        made[-1].finals = []
        return made[-1]

    real_make_env = envs.make_env
    monkeypatch.setattr(envs, "make_env", make_env)
    run_dir = run_agent(agent, tmp_path, "--total-env-steps", "1200", "--grad-steps-per-epoch", "0",
                        "--num-envs", "2", "--num-eval-skills", "1", "--hidden-dim", "8", "--no-cuda")
    frames = load(os.path.join(run_dir, "checkpoint.pt"))["buffer"]["frames"]  # (trajectories, 201, obs)
    train_envs = made[-3:-1]  # made just before the evaluation env (parse_args made one first, for its sizes)
    for epoch in range(3):
        for i, env in enumerate(train_envs):
            assert np.array_equal(frames[2 * epoch + i, HORIZON], env.finals[epoch]), (epoch, i)
            assert not np.array_equal(frames[2 * epoch + i, HORIZON], frames[2 * epoch + i, 0])


# In a fresh interpreter, so that its peak RSS is the checkpoint's alone: a 60 MiB pixel buffer (100 trajectories of
# 51 frames) is saved as a checkpoint saves it, then loaded back into an empty buffer.
CHECKPOINT_MEMORY = """
import resource, sys, numpy as np, torch, gymnasium as gym, importlib
agent = importlib.import_module(sys.argv[1])
space = gym.spaces.Box(0, 255, (64, 64, 9), np.uint8)  # 3 stacked frames, as the pixel worlds
make = lambda: agent.ReplayBuffer(5000, 50, space, 3, 7, 2, np.random.default_rng(0))
rb, rng = make(), np.random.default_rng(1)
for _ in range(10):  # 10 trajectories at a time: 100 in all
    rb.add(rng.integers(0, 256, (10, 51, 64, 64, 9), np.uint8), rng.random((10, 50, 7), np.float32),
           rng.random((10, 2), np.float32))
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
before = peak()
torch.save({"buffer": rb.state_dict()}, sys.argv[2])
growth = peak() - before
clone = make()
clone.load_state_dict(torch.load(sys.argv[2], weights_only=True)["buffer"])  # plain tensors: no pickled arrays
assert (clone.added, clone.size) == (rb.added, rb.size) == (100, 5000)
for key in ("frames", "actions", "skills"):
    assert np.array_equal(getattr(clone, key), getattr(rb, key)), key
print(f"{rb.frames.nbytes / 2**20:.0f} {growth:.0f}")
"""


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_saving_the_buffer_costs_no_copy_of_it_and_round_trips(agent, tmp_path):
    # A pickled numpy buffer is copied 4-5 times in memory on its way to disk: a Kitchen checkpoint at 56k env steps
    # peaked gigabytes above the run. Written as tensors over the arrays, saving adds next to nothing.
    out = subprocess.run([sys.executable, "-c", CHECKPOINT_MEMORY, name(agent), str(tmp_path / "checkpoint.pt")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    buffer_mb, growth_mb = map(float, out.stdout.split())
    assert buffer_mb > 50 and growth_mb < 0.25 * buffer_mb, (buffer_mb, growth_mb)


@pytest.mark.parametrize("agent", PIXEL_AGENTS, ids=name)
def test_pixel_smoke_run_crosses_an_update_and_an_evaluation(agent, tmp_path):
    # 1 epoch of 1 Quadruped trajectory: evaluation at epoch 0, 2 gradient steps on stacked frames, the last evaluation
    run_dir = run_agent(agent, tmp_path, "--env-id", "Quadruped", "--total-env-steps", "200", "--learning-starts", "200",
                        "--num-envs", "1", "--grad-steps-per-epoch", "2", "--batch-size", "4", "--hidden-dim", "16",
                        "--buffer-size", "200", "--num-eval-skills", "1", "--no-cuda",
                        *(["--knn-k", "2"] if agent is cic else []))  # CIC's neighbours come from the batch of 4
    first, last = read_evals(run_dir)
    assert (first["grad_steps"], last["grad_steps"], last["env_steps"]) == (0, 2, 200)
    assert all(math.isfinite(value) for value in last.values()) and set(DIAGNOSTICS[name(agent)]) <= set(last)
    assert 1 <= last["coverage"] <= HORIZON + 1
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    assert ckpt["buffer"]["frames"].shape == (1, 201, 64, 64, 3)  # one uint8 frame per step, stacks rebuilt
    for network in (NETWORKS[name(agent)][0], NETWORKS[name(agent)][1], "actor"):  # every network owns its CNN
        assert any("encoder." in key for key in ckpt[network]), network


def assert_videos(run_dir, steps, width):
    for env_steps in steps:  # reset + 200 steps, the skills side by side at 128×128
        with imageio.get_reader(os.path.join(run_dir, "videos", f"skills_{env_steps:010d}.mp4")) as video:
            assert video.count_frames() == HORIZON + 1 and video.get_meta_data()["size"] == (width, 128)


def test_track_offline_and_capture_video_from_the_shell(tmp_path):
    """csf.py from the shell with W&B offline: the offline run holds the logged metrics. (The W&B lines are the same
    in every agent; the videos are checked for each in the next test.)"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "csf.py"), "--total-env-steps", "400",
                           "--learning-starts", "400", "--num-envs", "2", "--grad-steps-per-epoch", "1",
                           "--batch-size", "8", "--hidden-dim", "8", "--num-eval-skills", "2", "--track",
                           "--capture-video", "--no-cuda"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    (run_dir,) = glob.glob(str(tmp_path / "runs" / "*"))
    assert_videos(run_dir, (0, 400), 256)
    (offline,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    with open(offline, "rb") as f:
        logged = f.read()
    for metric in (b"charts/SPS", b"eval/coverage", b"losses/phi_loss"):
        assert metric in logged, metric
    assert torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=False)["args"]["track"] is True


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_capture_video_writes_every_evaluation(agent, tmp_path):
    run_dir = run_agent(agent, tmp_path, "--total-env-steps", "400", "--grad-steps-per-epoch", "0", "--num-envs", "2",
                        "--hidden-dim", "8", "--num-eval-skills", "1", "--capture-video", "--no-cuda")
    assert_videos(run_dir, (0, 400), 128)


@pytest.mark.parametrize("agent", [csf, metra], ids=name)
def test_compiled_step_matches_the_eager_one(agent, tmp_path):
    """--compile compiles the whole gradient step: one step on the same batch (same seed, same replay sample, eager's
    random draws) gives the eager losses, gradients and parameters up to float rounding. One agent of each critic
    family (successor features, SAC Q), each compile taking 15-45 s here; the others compile the same way.

    The gradients are Adam's first moments, 0.1 g after one step. Adam's first step moves a weight by lr g / (|g| + ε),
    so where |g| is within a few orders of ε, rounding alone changes the size of that step: there the parameters are
    held within lr of each other, elsewhere to rounding."""
    flags = ("--total-env-steps", "400", "--learning-starts", "400", "--num-envs", "2", "--grad-steps-per-epoch", "1",
             "--batch-size", "16", "--hidden-dim", "16", "--num-eval-skills", "1", "--no-cuda")
    (tmp_path / "eager").mkdir(), (tmp_path / "compiled").mkdir()
    eager = run_agent(agent, tmp_path / "eager", *flags)
    compiled = run_agent(agent, tmp_path / "compiled", *flags, "--compile")
    eager_line, compiled_line = read_evals(eager)[-1], read_evals(compiled)[-1]
    assert compiled_line["grad_steps"] == 1
    for key in DIAGNOSTICS[name(agent)]:
        assert compiled_line[key] == pytest.approx(eager_line[key], rel=1e-4, abs=1e-6), key
    eager_ckpt, compiled_ckpt = load(os.path.join(eager, "checkpoint.pt")), load(os.path.join(compiled, "checkpoint.pt"))
    lr, critic = eager_ckpt["args"]["lr"], NETWORKS[name(agent)][1]  # "psi" or "qf": both critics
    owners = {"phi_optimizer": ["phi"], f"{critic}_optimizer": [critic], "actor_optimizer": ["actor"]}
    for optimizer, networks in owners.items():
        params = [(network, key) for network in networks for key in eager_ckpt[network]]  # the optimizer's order
        states = [eager_ckpt[optimizer]["state"][i] for group in eager_ckpt[optimizer]["param_groups"]
                  for i in group["params"]]
        assert len(params) == len(states)
        for (network, key), state in zip(params, states):
            i = next(i for i, s in eager_ckpt[optimizer]["state"].items() if s is state)
            first_moment = state["exp_avg"]
            assert torch.allclose(compiled_ckpt[optimizer]["state"][i]["exp_avg"], first_moment, rtol=1e-3,
                                  atol=1e-9), (optimizer, network, key)
            full_step = first_moment.abs() >= 1e-4  # |g| >= 1e-3, 10^5 ε: a step of lr to 5 digits
            difference = (compiled_ckpt[network][key] - eager_ckpt[network][key]).abs()
            assert full_step.any() or key.endswith("bias"), (network, key)
            assert (difference[full_step] <= 1e-4 * lr + 1e-5 * eager_ckpt[network][key].abs()[full_step]).all(), (
                network, key)
            assert (difference <= 2 * lr).all(), (network, key)
    assert compiled_ckpt["args"]["compile"] and not eager_ckpt["args"]["compile"]


@pytest.mark.parametrize("env_id", ["Kitchen", "Robobin"])
@pytest.mark.parametrize("agent", [csf, metra], ids=name)
def test_manipulation_smoke_run_and_task_goals(agent, env_id, tmp_path):
    """One epoch on the manipulation worlds: an update, two evaluations with their coverage, and zero-shot goals
    that are the world's named tasks."""
    horizon = envs.ENV_SPECS[env_id].horizon
    run_dir = run_agent(agent, tmp_path, "--env-id", env_id, "--total-env-steps", str(horizon), "--num-envs", "1",
                        "--learning-starts", str(horizon), "--grad-steps-per-epoch", "2", "--batch-size", "4",
                        "--hidden-dim", "8", "--buffer-size", str(horizon), "--num-eval-skills", "1", "--no-cuda")
    first, last = read_evals(run_dir)
    assert last["grad_steps"] == 2 and all(math.isfinite(v) for v in last.values())
    if env_id == "Kitchen":  # how many of the 6 tasks a rollout achieved
        assert 0 <= last["coverage"] <= 6
    else:  # distinct 9-D states on the 2-decimal grid: the arm moves, so more than one
        assert 1 < last["coverage"] <= horizon + 1
    ckpt = load(os.path.join(run_dir, "checkpoint.pt"))
    if name(agent) == "metra" and env_id == "Kitchen":  # one-hot K = 24, α frozen at 0.01 (the official script)
        assert ckpt["args"]["discrete"] and ckpt["args"]["skill_dim"] == 24
        assert torch.equal(ckpt["log_alpha"], torch.tensor(math.log(0.01))) and last["alpha"] == pytest.approx(0.01)
    if name(agent) == "csf":  # (the goal code is the same for every agent: test_goal_reaching.py)
        report = goal_reaching.main(*goal_reaching.parse_args(
            ["--checkpoint", os.path.join(run_dir, "checkpoint.pt"), "--num-goals", "1", "--no-cuda"]))
        (goal,) = report["results"]["adaptive"]["per_goal"]
        tasks = envs.KITCHEN_TASKS if env_id == "Kitchen" else envs.ROBOBIN_TASKS
        assert goal["goal"] in tasks and 0 <= goal["staying_time"] <= goal["hit"] <= 1


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_ctrl_c_ends_the_run_with_one_line_naming_its_checkpoint(agent, tmp_path):
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, f"{name(agent)}.py"), *FIVE_EPOCHS,
                                "--total-env-steps", "40000", "--checkpoint-every", "1"], cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not glob.glob(str(tmp_path / "runs" / "*" / "checkpoint.pt")) and time.time() < deadline:
        time.sleep(0.2)
    (checkpoint,) = glob.glob(str(tmp_path / "runs" / "*" / "checkpoint.pt"))
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1
    relative = os.path.relpath(checkpoint, tmp_path)  # runs/<run name>/checkpoint.pt, from where the run started
    assert stderr == f"{name(agent)}.py: error: interrupted; resume with --resume {relative}\n"
    assert not [f for f in os.listdir(os.path.dirname(checkpoint)) if ".tmp" in f]
    torch.load(checkpoint, weights_only=False)  # whole


def env_workers(pid):
    """The pids of a process's spawned children (its env workers), from /proc."""
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    return [child for child in children if "spawn_main" in open(f"/proc/{child}/cmdline").read()]


@pytest.mark.parametrize("agent", [csf, dads], ids=name)  # every agent's __main__: tests/test_style.py
def test_a_killed_env_worker_ends_the_run_with_one_line_naming_it_and_its_checkpoint(agent, tmp_path):
    """kill -9 of an env worker (the OOM killer's way) mid-run: one line naming the worker and the resume command,
    and the last checkpoint whole."""
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, f"{name(agent)}.py"), *FIVE_EPOCHS,
                                "--total-env-steps", "40000", "--checkpoint-every", "1", "--parallel-envs"],
                               cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not glob.glob(str(tmp_path / "runs" / "*" / "checkpoint.pt")) and time.time() < deadline:
        time.sleep(0.2)
    (checkpoint,) = glob.glob(str(tmp_path / "runs" / "*" / "checkpoint.pt"))
    workers = env_workers(process.pid)
    assert len(workers) == 2 * min(1, len(envs.usable_cores()) - 1)  # on 2 cores: the training envs', the evaluation's
    os.kill(int(workers[0]), signal.SIGKILL)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1
    relative = os.path.relpath(checkpoint, tmp_path)
    assert re.fullmatch(rf"{name(agent)}\.py: error: the env worker process of envs \d+-\d+ \(pid {workers[0]}\) "
                        rf"died \(killed by SIGKILL: out of memory, a crash or a kill\); resume with --resume "
                        rf"{re.escape(relative)}\n", stderr), stderr
    torch.load(checkpoint, weights_only=False)  # whole


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_a_checkpoint_that_cannot_be_written_leaves_the_previous_one(agent, tmp_path, monkeypatch):
    """A full disk mid-checkpoint (torch raises a RuntimeError there): one line, the previous checkpoint whole on
    disk, and no temporary file behind."""
    real_save, saves = torch.save, itertools.count(1)

    def disk_full_at_the_second(state, path):
        if next(saves) < 2:
            return real_save(state, path)
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 half a checkpoint")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 868352")

    with checkpoint_copies() as copies:
        monkeypatch.setattr(torch, "save", disk_full_at_the_second)
        with pytest.raises(SystemExit) as stop:
            run_agent(agent, tmp_path, *FIVE_EPOCHS)  # checkpoints at epochs 3 and 5
        monkeypatch.undo()
    (run_dir,) = glob.glob(str(tmp_path / "runs" / "*"))
    path = os.path.join("runs", os.path.basename(run_dir), "checkpoint.pt")
    assert str(stop.value.code) == (f"{name(agent)}.py: error: cannot write {path} (the write was cut short: is the "
                                    f"disk full?); resume with --resume {path}")
    assert not [f for f in os.listdir(run_dir) if ".tmp" in f]
    with open(os.path.join(run_dir, "checkpoint.pt"), "rb") as f:
        assert f.read() == copies[3]


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_cuda_rng_states_of_more_gpus_than_this_machine_sees_restore_the_ones_it_has(agent, tiny_run, tmp_path,
                                                                                    monkeypatch):
    """A checkpoint written on 2 GPUs resumes on 1: the first GPU's generator state is restored, and only it."""
    _, copies = tiny_run(agent, *FIVE_EPOCHS)
    ckpt = torch.load(io.BytesIO(copies[3]), weights_only=False)
    states = [torch.full((8,), 1, dtype=torch.uint8), torch.full((8,), 2, dtype=torch.uint8)]  # written on 2 GPUs
    ckpt["rngs"]["cuda"] = states
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    restored = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", lambda state, index=0: restored.append((state, index)))
    agent.main(*agent.parse_args(["--resume", str(tmp_path / "checkpoint.pt"), "--total-env-steps", "1600"]))
    assert len(restored) == 1 and restored[0][1] == 0 and torch.equal(restored[0][0], states[0])


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_cudagraphs_given_at_resume_gets_the_fused_adam(agent, tiny_run, tmp_path, capsys):
    """Optimizer.load_state_dict brings back the saved foreach/fused: a run resumed with --cudagraphs must still get
    the fused Adam it asks for, with its step counts where fused Adam keeps them (on the parameters' device); on a
    CPU the step runs without graphs, and the run says so."""
    _, copies = tiny_run(agent, *FIVE_EPOCHS)
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(copies[3])
    agent.main(*agent.parse_args(["--resume", str(checkpoint), "--cudagraphs"]))
    assert "--cudagraphs: CUDA graphs need a GPU; on the CPU the gradient step runs without them" in capsys.readouterr().out
    ckpt = load(checkpoint)
    optimizers = [key for key in ckpt if key.endswith("optimizer")]
    assert optimizers and all(group["fused"] and not group["foreach"] and not group["capturable"]
                              for key in optimizers for group in ckpt[key]["param_groups"])
    assert all(state["step"].dtype == torch.float32 for key in optimizers for state in ckpt[key]["state"].values())


def test_parallel_collection_gives_the_serial_numbers_and_resumes_exactly(tmp_path):
    """The envs stepped in worker processes (the default) give every number that the envs stepped in this process
    give, bit for bit on a CPU: eval.jsonl, the replay buffer, the networks and each env's RNG state in the
    checkpoint. A run resumed in workers from its epoch-1 checkpoint ends as the whole run does. (Pixels through the
    workers: tests/test_parallel_envs.py.)"""
    flags = ("--total-env-steps", "1200", "--num-envs", "2", "--learning-starts", "400", "--grad-steps-per-epoch",
             "1", "--batch-size", "8", "--hidden-dim", "8", "--buffer-size", "2000", "--num-eval-skills", "3",
             "--eval-every", "1", "--no-cuda")
    for folder in ("serial", "parallel", "resumed"):
        (tmp_path / folder).mkdir()
    serial = run_agent(csf, tmp_path / "serial", *flags, "--no-parallel-envs")
    with checkpoint_copies() as copies:
        parallel = run_agent(csf, tmp_path / "parallel", *flags, "--parallel-envs")
    assert without_timing(read_evals(parallel)) == without_timing(read_evals(serial))
    serial_ckpt, parallel_ckpt = load(os.path.join(serial, "checkpoint.pt")), load(os.path.join(parallel, "checkpoint.pt"))
    assert not serial_ckpt["args"].pop("parallel_envs") and parallel_ckpt["args"].pop("parallel_envs")
    assert_same_state(serial_ckpt, parallel_ckpt)
    checkpoint = tmp_path / "resumed" / "checkpoint.pt"
    checkpoint.write_bytes(copies[1])
    csf.main(*csf.parse_args(["--resume", str(checkpoint)]))
    assert without_timing(read_evals(tmp_path / "resumed")) == without_timing(read_evals(parallel))  # the checkpoint's, then its own
    assert_same_state(load(checkpoint)["buffer"], parallel_ckpt["buffer"])


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_too_many_envs_are_refused_with_one_line_before_any_is_built(agent, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        agent.main(*agent.parse_args(["--num-eval-skills", "1000000000000", "--no-cuda"]))
    message = str(stop.value.code)
    assert "\n" not in message and message.startswith(
        f"{name(agent)}.py: error: 1,000,000,000,008 training and evaluation envs need at least 244,140,625.0 GiB"), message


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_the_progress_line_gives_the_time_left_at_the_runs_speed(agent, tmp_path, capsys):
    run_agent(agent, tmp_path, "--total-env-steps", "4400", "--grad-steps-per-epoch", "0", "--num-envs", "2",
              "--hidden-dim", "8", "--num-eval-skills", "1", "--eval-every", "100", "--no-cuda")
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch 10 |"))
    sps = int(re.search(r"\| SPS (\d+) \|", line).group(1))
    left = int(re.search(r"\| (\d+) s left\b", line).group(1))  # 400 env steps to go, at the run's speed
    assert left == round(400 / sps) or abs(left - 400 / sps) < 1, line
    assert [agent.duration(s) for s in (45, 720, 3 * 3600 + 5 * 60, 110 * 3600)] == [
        "45 s", "12 min", "3 h 05 min", "110 h 00 min"]
