"""DADS, Dynamics-Aware Discovery of Skills (Sharma et al., ICLR 2020), in one file: a baseline of "Can a MISL Fly?
Analysis and Ingredients for Mutual Information Skill Learning" (Zheng, Tuyls, Peng and Eysenbach, ICLR 2025), App. A.5.

A skill z ~ p(z) = U[-1, 1]^d is held for a whole trajectory of the policy π(a | s, z). A skill-dynamics model
q(Δ | s, z), a unit-variance Gaussian over the batch-normalized change of state Δ = s' - s, is fit by maximum
likelihood; with π, it maximizes the forward variational lower bound (App. A.5; Sharma et al., Eq. 5 and 6)
    I(S'; Z | S) ≥ -E[log p(s' | s)] + E[log q(s' | s, z)],
p(s' | s) being q's average over the transition's own skill and L alternatives z_l ~ p(z). π's reward is thus
    r(s, s', z) = log q(Δ | s, z) - log (1 / (L + 1)) (q(Δ | s, z) + Σ_l q(Δ | s, z_l)),
and π is SAC's actor on it, α fixed at 0.1. Ant and HalfCheetah only, seen as state vectors, as in the paper.

    python dads.py --env-id Ant  # the paper's run: 64M env steps
    python dads.py --env-id HalfCheetah --hidden-dim 256 --total-env-steps 3000000  # a smaller, shorter run

Deliberate differences from the official code (github.com/Princeton-RL/contrastive-successor-features, iod/dads.py):
  - no --turn_off_dones flag: a time limit is never a terminal step, as every official script sets it.
  - left out, as they never change learning: the frozen α's optimizer, the stored rewards, next actions and returns.
  - the reward's L = 100 alternatives share BN_in(s), Δ and the state part of q's first layer, computed once per
    transition: the numbers of every (s, z_l) row through q, up to rounding, cheaper.
  - evaluation every 500 epochs on Ant and 1000 on HalfCheetah as officially, and at the last epoch, always
    checkpointed; --buffer-size is rounded down to whole trajectories; a checkpoint holds the stats since the last
    evaluation, so a resumed run reports what the uninterrupted run does.
  - on a GPU, float32 matmuls use TF32; a CPU computes them in float32, and the tests' numbers are the CPU's.
"""

import contextlib
import functools
import json
import math
import os
import pathlib
import random
import resource
import signal
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Literal, Optional

import matplotlib
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.profiler import record_function
from torch.utils.tensorboard import SummaryWriter

import envs

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

AGENT = "dads"


@dataclass
class Args:
    env_id: Literal["Ant", "HalfCheetah"] = "Ant"  # The world, a state vector (the paper runs DADS on these two).
    skill_dim: int = 3  # Dimension d of the skill z ~ U[-1, 1]^d.
    seed: int = 1  # Seed of torch, numpy and the envs (on a CPU, the same seed gives the same run).
    total_env_steps: Optional[int] = None  # Training budget in env steps, evaluations not counted (unset: 64M).
    num_envs: Optional[int] = None  # Trajectories collected per epoch, one skill each (unset: 8).
    grad_steps_per_epoch: Optional[int] = None  # Gradient steps after each collection (unset: 50).
    learning_starts: int = 10_000  # Transitions stored before the first gradient step.
    batch_size: int = 256  # Transitions per minibatch, drawn uniformly with replacement.
    buffer_size: Optional[int] = None  # Replay capacity in transitions (unset: 1M).
    hidden_dim: int = 1024  # Width of the two hidden layers of the skill dynamics, Q and π.
    eval_every: Optional[int] = None  # Epochs between evaluations, and the last one (unset: Ant 500, HalfCheetah 1000).
    checkpoint_every: Optional[int] = None  # Epochs between checkpoints, and the last one (unset: --eval-every).
    resume: Optional[str] = None  # A checkpoint.pt to continue, with its run's folder, flags and random streams.
    cuda: bool = True  # Use the GPU when torch sees one.
    parallel_envs: bool = True  # Step the envs in worker processes (the same numbers).
    buffer_on_device: bool = False  # Keep the replay buffer, and draw its batches, on the training device.
    cudagraphs: bool = False  # On a GPU, replay the whole gradient step as one CUDA graph.
    compile: bool = False  # Compile the whole gradient step with torch.compile.
    track: bool = False  # Also log to Weights & Biases (WANDB_MODE=offline works).
    wandb_project_name: str = "cleanmisl"  # The W&B project, with --track.
    wandb_entity: Optional[str] = None  # The W&B team, with --track.
    capture_video: bool = False  # At each evaluation, write an MP4 of up to four rollouts side by side.
    num_eval_skills: int = 48  # Deterministic rollouts per evaluation, one fresh skill each.
    gamma: float = 0.99  # Discount of the SAC critic.
    tau: float = 0.005  # Polyak step of the target Q networks.
    num_alternatives: int = 100  # L, the alternative skills per transition in the reward.
    lr: float = 3e-4  # Adam learning rate of the skill dynamics, Q and π.
    alpha: float = 0.1  # Entropy temperature α, fixed, as in the official DADS scripts.


# Each numeric flag's valid values ("[" closed end, "(" open end); NaN is never inside.
FLAG_RANGES = {
    "skill_dim": "[1, inf)", "seed": "[0, 2147483647]", "total_env_steps": "[1, inf)", "num_envs": "[1, inf)",
    "grad_steps_per_epoch": "[0, inf)", "learning_starts": "[0, inf)", "batch_size": "[2, inf)",
    "buffer_size": "[1, inf)", "hidden_dim": "[1, inf)", "eval_every": "[1, inf)", "checkpoint_every": "[1, inf)",
    "num_eval_skills": "[1, inf)", "gamma": "[0, 1)", "tau": "(0, 1]", "num_alternatives": "[1, inf)",
    "lr": "(0, inf)", "alpha": "[0, inf)"}
# What --resume may change: not the problem learned (the device may change the draws).
RESUME_MAY_CHANGE = ("total_env_steps", "eval_every", "checkpoint_every", "resume", "cuda", "parallel_envs",
                     "buffer_on_device", "cudagraphs", "compile", "track", "wandb_project_name", "wandb_entity",
                     "capture_video")


def sample_skills(n, skill_dim, generator=None, device=None):
    """z ~ p(z) = U[-1, 1]^d (App. B.3)."""
    return 2 * torch.rand(n, skill_dim, generator=generator, device=device) - 1


def dads_reward(log_likelihoods, clip=50.0):
    """r = log(L + 1) - log(1 + Σ_l exp(clip(log q(Δ|s, z_l) - log q(Δ|s, z), ±50))), the header's reward, ratios
    clipped (official iod/dads.py). log_likelihoods: (B, 1 + L), the own skill's first."""
    differences = (log_likelihoods[:, 1:] - log_likelihoods[:, :1]).clamp(-clip, clip)
    return math.log(log_likelihoods.shape[1]) - torch.log(1 + differences.exp().sum(-1))


@torch.no_grad()
def skill_dynamics_reward(model, obs, next_obs, skill, num_alternatives):
    """A batch's rewards, L fresh z_l ~ p(z) each; both batch norms on their running statistics, which stay."""
    model.eval()
    alternatives = sample_skills(len(skill) * num_alternatives, skill.shape[-1], device=skill.device)
    skills = torch.cat([skill[:, None], alternatives.view(len(skill), num_alternatives, skill.shape[-1])], 1)
    reward = dads_reward(model.log_likelihoods(obs, next_obs, skills))
    model.train()
    return reward


def model_objective(model, obs, next_obs, skill):
    """L(q) = -E[log q(Δ | s, z)], both batch norms on the batch's statistics (their running ones move)."""
    return -model.log_likelihoods(obs, next_obs, skill[:, None]).mean()


def qf_objective(qf, qf_target, actor, obs, action, next_obs, skill, reward, alpha, gamma):
    """L(Q) = Σ_k 0.5 E[(Q_k(s, a, z) - y)²], y = r + γ (min_k Q̄_k(s', a', z) - α log π(a'|s', z)), a' ~ π(·|s', z):
    the twins' one target, never terminal (the official iod/sac_utils.py)."""
    with torch.no_grad():
        next_action, next_log_prob = actor.sample(next_obs, skill)
        next_q = torch.stack([net(next_obs, skill, next_action) for net in qf_target])
        target = reward + gamma * (next_q.amin(0) - alpha * next_log_prob)
    return sum(0.5 * F.mse_loss(net(obs, skill, action), target) for net in qf)


def actor_objective(actor, qf, obs, skill, alpha):
    """L(π) = E[α log π(a|s, z) - min_k Q_k(s, a, z)], a ~ π(·|s, z)."""
    new_action, log_prob = actor.sample(obs, skill)
    q = torch.stack([net(obs, skill, new_action) for net in qf]).amin(0)
    return (alpha * log_prob - q).mean()


def mlp(in_dim, hidden_dim, out_dim, activation, init):
    """Linear → act → Linear → act → Linear, zero biases (the official run/train.py's networks)."""
    net = nn.Sequential(nn.Linear(in_dim, hidden_dim), activation(), nn.Linear(hidden_dim, hidden_dim),
                        activation(), nn.Linear(hidden_dim, out_dim))
    for layer in net[::2]:  # the Linear layers
        init(layer.weight)
        nn.init.zeros_(layer.bias)
    return net


class SkillDynamics(nn.Module):
    """q(Δ | s, z) = N(μ(BN_in(s) ⊕ z), I), Δ = BN_out(s' - s) (ReLU MLP, Xavier-uniform). BN_in's affine parameters
    stay 1 and 0 (untrained); BN_out has none; both have momentum 0.01, as the official iod/iod.py."""

    def __init__(self, obs_dim, skill_dim, hidden_dim):
        super().__init__()
        self.input_norm = nn.BatchNorm1d(obs_dim, momentum=0.01)
        self.target_norm = nn.BatchNorm1d(obs_dim, affine=False, momentum=0.01)
        self.net = mlp(obs_dim + skill_dim, hidden_dim, obs_dim, nn.ReLU, nn.init.xavier_uniform_)

    def trained_parameters(self):
        return self.net.parameters()

    def log_likelihoods(self, obs, next_obs, skills):
        """log q(Δ | s, z), skills (B, K, d) → (B, K): W_s BN_in(s) + b and Δ once per transition, W_z z per skill."""
        first = self.net[0]
        state_part = F.linear(self.input_norm(obs), first.weight[:, : obs.shape[-1]], first.bias)  # (B, H)
        hidden = state_part[:, None] + skills @ first.weight[:, obs.shape[-1]:].T  # (B, K, H)
        mean = self.net[1:](hidden)  # (B, K, D)
        target = self.target_norm(next_obs - obs)[:, None]  # (B, 1, D)
        return (-((target - mean) ** 2) / 2 - math.log(math.sqrt(2 * math.pi))).sum(-1)  # log N(target; mean, I)


class QNetwork(nn.Module):
    """Q(s, a, z) ∈ R: ReLU MLP on s ⊕ z ⊕ a, Xavier-normal weights."""

    def __init__(self, obs_space, action_dim, skill_dim, hidden_dim):
        super().__init__()
        self.net = mlp(obs_space.shape[0] + skill_dim + action_dim, hidden_dim, 1, nn.ReLU, nn.init.xavier_normal_)

    def forward(self, obs, skill, action):
        return self.net(torch.cat([obs, skill, action], -1)).squeeze(-1)


class Actor(nn.Module):
    """π(a | s, z): a tanh-squashed Gaussian on a tanh trunk, its output layers initialised 10x smaller."""

    def __init__(self, obs_space, action_dim, skill_dim, hidden_dim):
        super().__init__()
        self.trunk = mlp(obs_space.shape[0] + skill_dim, hidden_dim, hidden_dim, nn.Tanh, nn.init.xavier_uniform_)[:-1]
        self.mean, self.log_std = nn.Linear(hidden_dim, action_dim), nn.Linear(hidden_dim, action_dim)
        for head in (self.mean, self.log_std):
            nn.init.xavier_normal_(head.weight)
            head.weight.data.mul_(0.1)
            nn.init.zeros_(head.bias)

    def forward(self, obs, skill):
        h = self.trunk(torch.cat([obs, skill], -1))
        return self.mean(h), self.log_std(h).clamp(math.log(1e-6), 2.0)

    def sample(self, obs, skill):
        """A reparameterized action and its log-probability, with the tanh correction."""
        mean, log_std = self(obs, skill)
        normal = torch.distributions.Normal(mean, log_std.exp(), validate_args=False)  # NaNs are caught per epoch
        u = normal.rsample()
        action = torch.tanh(u)
        log_prob = normal.log_prob(u).sum(-1) - torch.log((1 - action.pow(2)).clamp(0, 1) + 1e-6).sum(-1)
        return action, log_prob

    def mode(self, obs, skill):
        return torch.tanh(self(obs, skill)[0])


@contextlib.contextmanager
def frozen(modules):
    """No gradient into these modules' weights in the block; one still flows through them to their inputs."""
    for module in modules:
        module.requires_grad_(False)
    try:
        yield
    finally:
        for module in modules:
            module.requires_grad_(True)


class ReplayBuffer:
    """A ring of whole trajectories, each state stored once (s'_t is s_{t+1}; frame_stack, 1 here, is unused); (s, a,
    s', z) drawn uniformly with replacement. `device`: where it lives and draws (--buffer-on-device); None: the host."""

    def __init__(self, capacity, horizon, observation_space, frame_stack, action_dim, skill_dim, rng, device=None):
        n, space = capacity // horizon, observation_space  # whole trajectories
        self.horizon, self.rng, self.device, self.pos, self.num_stored = horizon, rng, device, 0, 0
        self.frames = self.to_storage(np.zeros((n, horizon + 1, *space.shape), space.dtype))
        self.actions = self.to_storage(np.zeros((n, horizon, action_dim), np.float32))
        self.skills = self.to_storage(np.zeros((n, skill_dim), np.float32))
        # the device's draws have their own generator, seeded from rng
        self.generator = None if device is None else torch.Generator(device).manual_seed(int(rng.integers(2**62)))

    def to_storage(self, array, dtype=None):  # a host array as the storage holds it
        return array if self.device is None else torch.as_tensor(array, dtype=dtype, device=self.device)

    @property
    def size(self):  # stored transitions
        return self.num_stored * self.horizon

    def add(self, observations, actions, skills):
        """observations: (n, horizon + 1, *obs_shape), the final last; actions: (n, horizon, |A|); skills: (n, d)."""
        n, capacity = len(observations), len(self.frames)
        idx = self.to_storage((self.pos + np.arange(n)) % capacity)
        for storage, value in ((self.frames, observations), (self.actions, actions), (self.skills, skills)):
            storage[idx] = self.to_storage(value, storage.dtype)
        self.pos, self.num_stored = (self.pos + n) % capacity, min(self.num_stored + n, capacity)

    def sample(self, batch_size, device):
        """A minibatch on `device`, drawn on the host (copied to a GPU pinned, without waiting), or on the device."""
        i = (self.rng.integers(0, self.size, batch_size) if self.device is None
             else torch.randint(0, self.size, (batch_size,), generator=self.generator, device=self.device))
        trajectory, t = i // self.horizon, i % self.horizon
        batch = {"obs": self.frames[trajectory, t], "next_obs": self.frames[trajectory, t + 1],
                 "action": self.actions[trajectory, t], "skill": self.skills[trajectory]}
        if self.device is None:
            batch = {key: torch.from_numpy(value) for key, value in batch.items()}
            if torch.device(device).type == "cuda":
                batch = {key: value.pin_memory().to(device, non_blocking=True) for key, value in batch.items()}
        return batch

    def state_dict(self):  # tensors over the stored part, on the host (no copy of a pickled array)
        n = self.num_stored
        return {"pos": self.pos, "num_stored": n, "frames": torch.as_tensor(self.frames[:n]).cpu(),
                "actions": torch.as_tensor(self.actions[:n]).cpu(), "skills": torch.as_tensor(self.skills[:n]).cpu(),
                "generator": None if self.generator is None else self.generator.get_state()}

    def load_state_dict(self, state):
        self.pos, self.num_stored = state["pos"], state["num_stored"]
        for name in ("frames", "actions", "skills"):
            getattr(self, name)[:self.num_stored] = state[name] if self.device is None else state[name].to(self.device)
        if self.generator is not None and state.get("generator") is not None:  # None: moved to the device at resume
            self.generator.set_state(state["generator"])


def main(args, ckpt=None):
    """DADS, epoch by epoch (official iod/iod.py): evaluate; collect a trajectory per env, one skill z ~ p(z) each;
    take the gradient steps (`update`). Around it, the run's checkpoints, logs and NaN stop."""
    spec = envs.ENV_SPECS[args.env_id]
    steps_per_epoch = args.num_envs * spec.horizon
    num_epochs = args.total_env_steps // steps_per_epoch
    run_name, run_dir, checkpoint_path, writer = start_run(args, ckpt)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)  # replay sampling
    eval_generator = torch.Generator().manual_seed(args.seed + 1)  # the evaluation skills
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls
    try:  # envs never reset on their own; envs that cannot fit, or cannot render a video: one line
        train_envs, eval_envs = envs.make_envs(functools.partial(envs.make_env, args.env_id), args.num_envs,
                                               args.num_eval_skills, args.seed, 4 if args.capture_video else 0,
                                               args.parallel_envs)
    except (envs.RenderUnavailable, MemoryError) as e:
        error(e)
    obs_space = train_envs.single_observation_space
    action_dim, d = train_envs.single_action_space.shape[0], args.skill_dim
    check_memory(args, obs_space, action_dim, spec.horizon, device)
    model = SkillDynamics(obs_space.shape[0], d, args.hidden_dim).to(device)
    qf = [QNetwork(obs_space, action_dim, d, args.hidden_dim).to(device) for _ in range(2)]  # twins, as SAC's
    qf_target = [QNetwork(obs_space, action_dim, d, args.hidden_dim).to(device) for _ in qf]
    for net, target in zip(qf, qf_target):
        target.load_state_dict(net.state_dict())
    actor = Actor(obs_space, action_dim, d, args.hidden_dim).to(device)
    adam = adam_options(args, device)
    model_optimizer = torch.optim.Adam(model.trained_parameters(), **adam)  # not BN_in's affine parameters
    qf_params, qf_target_params = ([param for net in nets for param in net.parameters()] for nets in (qf, qf_target))
    qf_optimizer = torch.optim.Adam(qf_params, **adam)  # the twins', on the sum of their losses
    actor_optimizer = torch.optim.Adam(actor.parameters(), **adam)  # α is fixed: no optimizer
    rb = ReplayBuffer(args.buffer_size, spec.horizon, obs_space, spec.frame_stack, action_dim, d, rng,
                      device if args.buffer_on_device else None)
    modules = {"model": model, **{f"qf{k}": net for k, net in enumerate(qf, 1)},  # the checkpoint's keys
               **{f"qf{k}_target": net for k, net in enumerate(qf_target, 1)}, "actor": actor,
               "model_optimizer": model_optimizer, "qf_optimizer": qf_optimizer, "actor_optimizer": actor_optimizer}
    streams = {"rng": rng, "eval_generator": eval_generator, "envs": (train_envs, eval_envs)}
    start_epoch, grad_steps, wall_time, since_eval = (
        restore_checkpoint(ckpt, args, run_dir, modules, rb, streams, device) if ckpt else (0, 0, 0.0, new_window()))

    def update(batch):
        """One gradient step (official iod/dads.py): q, the rewards of the q just updated, Q, π, Q̄. Returns the stats
        by name, left on the device: no step waits for the host."""
        obs, action, next_obs, skill = batch["obs"], batch["action"], batch["next_obs"], batch["skill"]
        with record_function("model step"):
            model_loss = model_objective(model, obs, next_obs, skill)
            model_optimizer.zero_grad()
            model_loss.backward()
            model_optimizer.step()
            reward = skill_dynamics_reward(model, obs, next_obs, skill, args.num_alternatives)
        with record_function("qf step"):
            qf_loss = qf_objective(qf, qf_target, actor, obs, action, next_obs, skill, reward, args.alpha, args.gamma)
            qf_optimizer.zero_grad()
            qf_loss.backward()
            qf_optimizer.step()
        with record_function("actor step"), frozen(qf):  # the gradient flows through Q to the action, not into Q
            actor_loss = actor_objective(actor, qf, obs, skill, args.alpha)
            actor_optimizer.zero_grad()
            actor_loss.backward()
            actor_optimizer.step()
        with torch.no_grad():  # Q̄ ← (1 - τ) Q̄ + τ Q, every tensor in one call
            torch._foreach_lerp_(qf_target_params, qf_params, args.tau)
        return {"model_loss": model_loss.detach(), "qf_loss": qf_loss.detach(), "actor_loss": actor_loss.detach(),
                "log_likelihood": -model_loss.detach(), "reward": reward.mean()}

    update = fast_path(update, args, device)  # --compile, --cudagraphs
    segment_start = time.time()
    for epoch in range(start_epoch, num_epochs + 1):
        # evaluate and checkpoint what the previous `epoch` epochs produced
        if (epoch % args.eval_every == 0 or epoch == num_epochs) and not (ckpt and epoch == start_epoch):
            evaluate(epoch, grad_steps, wall_time + time.time() - segment_start, since_eval, args, actor, eval_envs,
                     eval_generator, device, run_dir, writer)
            since_eval = new_window()
        if epoch == num_epochs or (epoch % args.checkpoint_every == 0 and epoch != start_epoch):
            save_checkpoint(checkpoint_path, args, run_name, epoch, grad_steps, wall_time + time.time() - segment_start,
                            since_eval, modules, rb, streams, device)
        if epoch == num_epochs:
            break

        # collect one trajectory per env, one skill each, with the stochastic policy
        skills = sample_skills(args.num_envs, d).to(device)
        obs, _ = train_envs.reset()
        observations, actions = [obs], []
        with torch.no_grad(), record_function("collection"):
            for t in range(spec.horizon):
                action = finite(actor.sample(torch.as_tensor(obs, device=device), skills)[0], epoch)
                obs, _, terminated, truncated, _ = train_envs.step(action)
                # never terminal, cut by the time limit at the horizon: the buffer's trajectory layout
                assert not terminated.any() and (truncated == (t == spec.horizon - 1)).all(), (t, terminated, truncated)
                observations.append(obs)  # after the last step, the final observation
                actions.append(action)
        rb.add(np.stack(observations, 1), np.stack(actions, 1), skills.cpu().numpy())
        since_eval["env_steps"] += steps_per_epoch

        # update: gradient steps, each on its own minibatch; then the stats (or one line at a NaN loss)
        train_start, step_stats = time.time(), []
        for _ in range(args.grad_steps_per_epoch if rb.size >= args.learning_starts else 0):
            with record_function("sampling"):
                batch = rb.sample(args.batch_size, device)
            step_stats.append(update(batch))
        grad_steps += len(step_stats)
        log_epoch(args, writer, epoch, grad_steps, step_stats, time.time() - train_start, since_eval,
                  (epoch + 1 - start_epoch) * steps_per_epoch / (time.time() - segment_start), checkpoint_path)

    for opened in (train_envs, eval_envs, writer):
        opened.close()
    if args.track:
        import wandb
        wandb.finish()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as before the run
    print(f"done: {run_dir}")


# ABLATIONS: none (DADS has no ablation flags)
# INFRASTRUCTURE: the command line, start-up, the fast path, checkpoints, evaluation, logging
def parse_args(argv=None):
    """The command line, an unset flag taking the paper's value for the env; with --resume, the run's own flags, but
    RESUME_MAY_CHANGE's given beside it. A bad value or checkpoint ends the run with one line."""
    args, ckpt = tyro.cli(Args, args=argv), None
    if args.resume:
        if not os.path.isfile(args.resume):
            error(f"no checkpoint file at {args.resume}")
        try:
            ckpt = torch.load(args.resume, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001
            error(f"{args.resume} is not a readable checkpoint ({type(e).__name__})")
        if not isinstance(ckpt, dict) or "agent" not in ckpt:
            error(f"{args.resume} is not a cleanmisl checkpoint")
        if ckpt["agent"] != AGENT:
            error(f"{args.resume} is a {ckpt['agent']} checkpoint, not a {AGENT} one")
        if set(ckpt["args"]) - {field.name for field in fields(Args)} or "since_eval" not in ckpt:
            error(f"{args.resume} was written by another version of {AGENT}.py")
        args = tyro.cli(Args, args=argv, default=Args(**ckpt["args"]))
        for flag, trained in ckpt["args"].items():
            if flag not in RESUME_MAY_CHANGE and getattr(args, flag) != trained:
                error(f"{args.resume} was trained with --{flag.replace('_', '-')} {trained}, not {getattr(args, flag)}")
    for flag, value in env_defaults(args.env_id).items():
        setattr(args, flag, value if getattr(args, flag) is None else getattr(args, flag))
    args.checkpoint_every = args.eval_every if args.checkpoint_every is None else args.checkpoint_every
    for flag, interval in FLAG_RANGES.items():
        low, high, value = *(float(end) for end in interval[1:-1].split(",")), getattr(args, flag)
        if not ((low <= value if interval[0] == "[" else low < value) and  # both False for NaN
                (value <= high if interval[-1] == "]" else value < high)):
            error(f"--{flag.replace('_', '-')} must be in {interval}, got {value}")
    horizon = envs.ENV_SPECS[args.env_id].horizon
    epoch = args.num_envs * horizon  # the env steps, and transitions, of one epoch
    for flag, verb, unit in (("buffer_size", "hold", "transitions"), ("total_env_steps", "cover", "env steps")):
        if getattr(args, flag) < epoch:
            error(f"--{flag.replace('_', '-')} must {verb} one epoch (--num-envs × {horizon} = {epoch} {unit}), "
                  f"got {getattr(args, flag)}")
    stored = min(args.total_env_steps // epoch * epoch, args.buffer_size // horizon * horizon)
    if args.grad_steps_per_epoch and args.learning_starts > stored:
        error(f"--learning-starts must be at most --total-env-steps and --buffer-size in whole epochs and trajectories "
              f"({stored}), or the run never learns; got {args.learning_starts}")
    if ckpt and args.total_env_steps // epoch <= ckpt["epoch"]:
        error(f"{args.resume} has already trained for {ckpt['epoch'] * epoch} env steps; give a larger "
              f"--total-env-steps to continue it")
    return args, ckpt


def env_defaults(env_id):
    """The paper's value of each flag whose default depends on the env."""
    return {flag: getattr(envs.ENV_SPECS[env_id], flag)
            for flag in ("total_env_steps", "num_envs", "grad_steps_per_epoch", "buffer_size", "eval_every")}


def start_run(args, ckpt):
    """The run's name, folder (a resumed run's is its checkpoint's), checkpoint path and writer; Ctrl-C, W&B, and a
    line with the flags resolved from the env."""
    run_name = ckpt["run_name"] if ckpt else f"{args.env_id}__{AGENT}__{args.seed}__{int(time.time())}"
    run_dir = os.path.dirname(os.path.abspath(args.resume)) if ckpt else os.path.join("runs", run_name)
    os.makedirs(run_dir, exist_ok=True)
    checkpoint_path = os.path.join(run_dir, "checkpoint.pt")
    signal.signal(signal.SIGINT, lambda *_: error(f"interrupted; {resume_hint(checkpoint_path)}"))
    if args.track:
        import wandb
        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, save_code=True, resume="allow", id=run_name.replace("/", "_"))
    # TensorBoard's thread stays quiet on a failed write, which its next add_scalar raises
    threading.excepthook = lambda hook: None if issubclass(hook.exc_type, OSError) else threading.__excepthook__(hook)
    writer = SummaryWriter(run_dir)
    writer.add_text("hyperparameters",
                    "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    print(f"{args.env_id} (horizon {envs.ENV_SPECS[args.env_id].horizon}): " + ", ".join(
        f"--{flag.replace('_', '-')} {getattr(args, flag)}" for flag in (*env_defaults(args.env_id), "checkpoint_every")
    ) + (" (the run's own)" if ckpt else " (a flag not given takes the paper's value for the env)"), flush=True)
    return run_name, run_dir, checkpoint_path, writer


def check_memory(args, obs_space, action_dim, horizon, device):
    """Refuse, before allocating, a run that cannot fit in the free memory, naming lower bounds of its parts' needs."""
    trajectory_bytes = ((horizon + 1) * math.prod(obs_space.shape) * obs_space.dtype.itemsize
                        + 4 * (horizon * action_dim + args.skill_dim))
    host = {"the replay buffer (--buffer-size)": args.buffer_size // horizon * trajectory_bytes}
    on_device = {"the networks (--hidden-dim)": 4 * args.hidden_dim**2 * (4 * 4 + 2), "one batch (--batch-size)":
                 4 * args.batch_size * (2 * math.prod(obs_space.shape) + 8 * args.hidden_dim)}
    if args.buffer_on_device:
        host, on_device = {}, {**host, **on_device}
    places = {"GPU": on_device, "host": host} if device.type == "cuda" else {"host": {**host, **on_device}}
    for place, parts in places.items():
        free = torch.cuda.mem_get_info(device)[0] if place == "GPU" else envs.free_host_memory()
        if sum(parts.values()) > free:
            error(f"this run needs at least {sum(parts.values()) / 2**30:,.1f} GiB of {place} memory: " + ", ".join(
                f"{name} {size / 2**30:,.1f}" for name, size in parts.items()) + f"; {free / 2**30:,.1f} GiB is free")


def adam_options(args, device):
    """foreach Adam (torch.compile fuses it); fused under --cudagraphs alone; capturable under a CUDA graph."""
    fused = args.cudagraphs and not args.compile
    capturable = args.cudagraphs and device.type == "cuda"
    return {"lr": args.lr, "fused": fused, "foreach": not fused, "capturable": capturable}


def fast_path(update, args, device):
    """The step compiled as one function (--compile; on a CPU with eager's random draws), on a GPU one CUDA graph."""
    if args.compile:
        torch._inductor.config.fallback_random = device.type == "cpu"
        update = torch.compile(update)
    if args.cudagraphs and device.type != "cuda":
        print("--cudagraphs: CUDA graphs need a GPU; on the CPU the gradient step runs without them", flush=True)
    return CudaGraphStep(update) if args.cudagraphs and device.type == "cuda" else update


class CudaGraphStep:
    """`step(batch) -> stats` as one CUDA graph: WARMUP real steps on a side stream, then one captured on a static
    batch, which each later call refills and replays."""

    WARMUP = 3

    def __init__(self, step):
        self.step, self.calls, self.graph = step, 0, None

    def __call__(self, batch):
        if self.calls < self.WARMUP:
            self.calls += 1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), warnings.catch_warnings():
                warnings.filterwarnings("ignore", "This instance was constructed with capturable=True")
                stats = self.step(batch)
            torch.cuda.current_stream().wait_stream(side)
            return stats
        if self.graph is None:
            self.batch, self.graph = {key: value.clone() for key, value in batch.items()}, torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.stats = self.step(self.batch)
        for key, value in batch.items():
            self.batch[key].copy_(value)
        self.graph.replay()
        return {name: value.clone() for name, value in self.stats.items()}


def save_checkpoint(path, args, run_name, epoch, grad_steps, wall_time, since_eval, modules, rb, streams, device):
    """All a resumed run needs to go on as this one would, atomically; a NaN or inf state ends the run instead."""
    def non_finite(state, prefix=""):  # the float tensors with NaN or inf, by name
        if torch.is_tensor(state):
            return [prefix] if state.is_floating_point() and not torch.isfinite(state).all() else []
        items = (state.items() if isinstance(state, dict) else
                 enumerate(state) if isinstance(state, (list, tuple)) else [])
        return [name for key, value in items for name in non_finite(value, f"{prefix}.{key}".lstrip("."))]

    state = {name: module.state_dict() for name, module in modules.items()}
    diverged = non_finite(state)
    if diverged:  # e.g. Adam's moments overflowed while every loss stayed finite
        error(f"{diverged[0]} holds NaN or inf at epoch {epoch} ({len(diverged)} tensors do): the run diverged; "
              f"{resume_hint(path)}")
    state.update({"agent": AGENT, "args": asdict(args), "run_name": run_name, "epoch": epoch, "grad_steps": grad_steps,
                  "wall_time": wall_time, "buffer": rb.state_dict(), "torch_rng": torch.get_rng_state(),
                  "cuda_rng": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
                  "numpy_rng": streams["rng"].bit_generator.state,
                  "eval_torch_rng": streams["eval_generator"].get_state(),
                  # evaluation's numpy stream: unused by DADS, in every agent's checkpoint
                  "eval_numpy_rng": np.random.default_rng(args.seed + 1).bit_generator.state,
                  "env_rngs": [rng for vector in streams["envs"] for rng in envs.env_rng_states(vector)],
                  "since_eval": {**since_eval, "start": time.time() - since_eval["start"]}})
    write_atomically(path, lambda temporary: torch.save(state, temporary), resume_hint(path))


def restore_checkpoint(ckpt, args, run_dir, modules, rb, streams, device):
    """A checkpoint's state back (with this run's Adam options), eval.jsonl's later evaluations dropped (to be redone):
    (epoch, gradient steps, wall time, the stats window)."""
    try:
        for name, module in modules.items():
            module.load_state_dict(ckpt[name])
            for group in getattr(module, "param_groups", []):  # an optimizer: this run's options, its step counts
                group.update({key: value for key, value in adam_options(args, device).items() if key != "lr"})
                for param in group["params"]:  # where fused or capturable Adam keep them
                    if "step" in module.state.get(param, {}):
                        place = param.device if group["fused"] or group["capturable"] else "cpu"
                        module.state[param]["step"] = module.state[param]["step"].to(place, torch.float32)
        rb.load_state_dict(ckpt["buffer"])
        torch.set_rng_state(ckpt["torch_rng"])
        if device.type == "cuda" and ckpt["cuda_rng"] is not None:
            restore_cuda_rng(ckpt["cuda_rng"])
        streams["eval_generator"].set_state(ckpt["eval_torch_rng"])
        streams["rng"].bit_generator.state = ckpt["numpy_rng"]
        train_envs, eval_envs = streams["envs"]  # the training envs' states, then the evaluation envs'
        envs.set_env_rng_states(train_envs, ckpt["env_rngs"][:train_envs.num_envs])
        envs.set_env_rng_states(eval_envs, ckpt["env_rngs"][train_envs.num_envs:])
        window = ckpt["since_eval"]  # its start was saved as seconds before the checkpoint
        since_eval = {**window, "stats": [{name: value.to(device) for name, value in means.items()}
                                          for means in window["stats"]], "start": time.time() - window["start"]}
    except (KeyError, RuntimeError, ValueError, AttributeError) as e:
        error(f"{args.resume} was written by another version of {AGENT}.py ({' '.join(str(e).split())[:160]})")
    log_path, kept = os.path.join(run_dir, "eval.jsonl"), []
    if os.path.isfile(log_path):
        lines = [line for line in pathlib.Path(log_path).read_text().splitlines() if line.strip()]
        for number, line in enumerate(lines, 1):
            try:
                kept += [line + "\n"] if json.loads(line)["epoch"] <= ckpt["epoch"] else []
            except (ValueError, KeyError, TypeError):  # a torn last line (a crash mid-write): dropped, with a warning
                if number < len(lines):
                    error(f"line {number} of {log_path} is not an evaluation; mend or delete it, then resume")
                print(f"warning: dropped the torn last line of {log_path}", file=sys.stderr)
        write_atomically(log_path, lambda tmp: pathlib.Path(tmp).write_text("".join(kept)),
                         resume_hint(os.path.join(run_dir, "checkpoint.pt")))
    env_steps = ckpt["epoch"] * args.num_envs * envs.ENV_SPECS[args.env_id].horizon
    print(f"resumed {ckpt['run_name']} at epoch {ckpt['epoch']} ({env_steps:,} env steps)")
    return ckpt["epoch"], ckpt["grad_steps"], ckpt["wall_time"], since_eval


def restore_cuda_rng(states):
    """The CUDA RNG states of the GPUs this machine has (a run may resume where fewer are visible)."""
    for index, state in enumerate(states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(state, index)


@torch.no_grad()
@record_function("evaluation")
def evaluate(epoch, grad_steps, wall_time, window, args, actor, eval_envs, eval_generator, device, run_dir, writer):
    """Deterministic rollouts of fresh skills (official iod/metra.py) → coverage, skill plot, a line of eval.jsonl with
    the window's speeds and stat means; with --capture-video, a video."""
    stats = {}
    if window["stats"]:
        per_epoch = torch.stack([torch.stack(list(means.values())) for means in window["stats"]])
        stats = dict(zip(window["stats"][0], per_epoch.mean(0).tolist()))
    stats |= {"sps": window["env_steps"] / (time.time() - window["start"])} if window["env_steps"] else {}
    stats |= {"ms_per_grad_step": 1000 * window["train_time"] / window["grad_steps"]} if window["grad_steps"] else {}
    spec, videos = envs.ENV_SPECS[args.env_id], eval_envs.video_envs
    skills = sample_skills(args.num_eval_skills, args.skill_dim, eval_generator)
    obs, info = eval_envs.reset()
    coordinates = [info["coordinates"]]
    frames = [np.concatenate(envs.render_envs(eval_envs, videos), 1)] if videos else []
    for _ in range(spec.horizon):
        action = finite(actor.mode(torch.as_tensor(obs, device=device), skills.to(device)), epoch)
        obs, _, _, _, info = eval_envs.step(action)
        coordinates.append(info["coordinates"])
        frames += [np.concatenate(envs.render_envs(eval_envs, videos), 1)] if videos else []
    paths, env_steps = np.stack(coordinates, 1), epoch * args.num_envs * spec.horizon  # (rollouts, horizon + 1, dims)
    result = {"epoch": epoch, "env_steps": env_steps, "grad_steps": grad_steps, "wall_time": round(wall_time, 2),
              "coverage": envs.coverage(paths, args.env_id), **stats,
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    hint, z = resume_hint(os.path.join(run_dir, "checkpoint.pt")), skills.numpy()
    fig, ax = plt.subplots(figsize=(5, 5))  # coloured by the angle of (z_0, z_1), or the sign of z
    angle = np.arctan2(z[:, 1], z[:, 0]) if args.skill_dim > 1 else np.pi * (z[:, 0] > 0)
    envs.draw_coordinates(ax, paths, plt.cm.hsv((angle + np.pi) / (2 * np.pi)), args.env_id)
    ax.set_title(f"DADS {args.env_id}, {env_steps:,} env steps, coverage {result['coverage']}")
    fig.tight_layout()
    write_atomically(os.path.join(run_dir, f"skills_{env_steps:010d}.png"), lambda tmp: fig.savefig(tmp, dpi=100), hint)
    plt.close(fig)
    if videos:
        import imageio
        os.makedirs(os.path.join(run_dir, "videos"), exist_ok=True)
        write_atomically(os.path.join(run_dir, "videos", f"skills_{env_steps:010d}.mp4"),
                         lambda tmp: imageio.mimsave(tmp, frames, fps=20), hint)
    writer.add_scalar("eval/coverage", result["coverage"], env_steps)
    log_path = os.path.join(run_dir, "eval.jsonl")
    logged = pathlib.Path(log_path).read_text() if os.path.isfile(log_path) else ""
    write_atomically(log_path, lambda tmp: pathlib.Path(tmp).write_text(logged + json.dumps(result) + "\n"), hint)
    print(f"eval  epoch {epoch} | env steps {env_steps:,} | coverage {result['coverage']} | " + " | ".join(
        f"{k} {v:.4g}" for k, v in stats.items()), flush=True)


def new_window():
    """What happened since the last evaluation: named means per epoch that trained, and the speeds."""
    return {"stats": [], "train_time": 0.0, "grad_steps": 0, "start": time.time(), "env_steps": 0}


def log_epoch(args, writer, epoch, grad_steps, step_stats, train_time, window, sps, checkpoint_path):
    """An epoch's stat means to the window and TensorBoard (one line at a NaN or inf *_loss), with `sps` (so far,
    evaluations included); every 10 epochs, a progress line."""
    env_steps = (epoch + 1) * args.num_envs * envs.ENV_SPECS[args.env_id].horizon
    if step_stats:
        names = list(step_stats[0])
        per_step = torch.stack([torch.stack(list(stats.values())) for stats in step_stats])  # (steps, names)
        bad = ~torch.isfinite(per_step) & torch.tensor([n.endswith("_loss") for n in names]).to(per_step.device)
        if bad.any():
            step, which = bad.nonzero()[0].tolist()
            error(f"{names[which]} is {per_step[step, which].item()} at gradient step "
                  f"{grad_steps - len(step_stats) + step + 1} (epoch {epoch}); {resume_hint(checkpoint_path)}")
        means = per_step.mean(0)
        window["stats"].append(dict(zip(names, means)))
        window["grad_steps"] += len(step_stats)
        window["train_time"] += train_time
        for name, value in zip(names, means.tolist()):
            writer.add_scalar(f"losses/{name}" if name.endswith("loss") else f"charts/{name}", value, env_steps)
    writer.add_scalar("charts/SPS", int(sps), env_steps)
    writer.add_scalar("charts/grad_steps", grad_steps, env_steps)
    if (epoch + 1) % 10 == 0:
        last = {name: value.item() for name, value in window["stats"][-1].items()} if window["stats"] else {}
        print(f"epoch {epoch + 1} | env steps {env_steps:,} | SPS {int(sps)} | "
              f"{duration((args.total_env_steps - env_steps) / sps)} left | "
              + " | ".join(f"{k} {v:.4g}" for k, v in last.items()), flush=True)


def duration(seconds):
    """A time span as people read it: "45 s", "12 min", "3 h 05 min"."""
    minutes = round(seconds / 60)
    return (f"{seconds:.0f} s" if seconds < 60 else f"{minutes} min" if minutes < 60
            else f"{minutes // 60} h {minutes % 60:02d} min")


def finite(action, epoch):
    """The policy's action as an array for the envs; a NaN or inf (the networks diverged) ends the run."""
    action = action.cpu().numpy()
    if not np.isfinite(action).all():
        error(f"the policy's action is not finite at epoch {epoch}: its networks diverged")
    return action


def error(message):
    """End the run with one line on stderr, no traceback."""
    sys.exit(f"{AGENT}.py: error: {message}")


def resume_hint(path):
    return f"resume with --resume {path}" if os.path.isfile(path) else "no checkpoint was written yet"


def write_atomically(path, write, hint):
    """write(a temporary path), renamed to `path`: a failed write leaves the earlier file whole, and ends the run."""
    temporary = "{}.tmp{}".format(*os.path.splitext(path))  # the extension tells savefig and imageio the format
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException as e:  # a failed write, or Ctrl-C mid-write: no temporary left
        with contextlib.suppress(OSError):
            os.remove(temporary)
        if not isinstance(e, (OSError, RuntimeError)):  # torch.save reports a failed write as a RuntimeError
            raise
        cut_short = "unexpected pos" in str(e) or "write failed" in str(e)
        reason = (e.strerror or str(e)) if isinstance(e, OSError) else (
            "the write was cut short: is the disk full?" if cut_short else " ".join(str(e).split())[:120])
        error(f"cannot write {path} ({reason}); {hint}")


if __name__ == "__main__":
    args, ckpt = parse_args()
    try:
        main(args, ckpt)
    except OSError as e:  # the run's folder or TensorBoard's file cannot be written
        error(f"cannot write {os.fsdecode(e.filename) if e.filename else 'the TensorBoard log'} ({e.strerror or e})")
