"""DADS, Dynamics-Aware Discovery of Skills (Sharma et al., ICLR 2020), in one file: a baseline of "Can a MISL Fly?
Analysis and Ingredients for Mutual Information Skill Learning" (Zheng, Tuyls, Peng and Eysenbach, ICLR 2025), App. A.5.

A skill z ~ p(z) = U[-1, 1]^d is held for a whole trajectory of the policy π(a | s, z). A skill-dynamics model
q(Δ | s, z), a unit-variance Gaussian over the batch-normalized change of state Δ = s' - s, is fit by maximum
likelihood; with π, it maximizes the forward variational lower bound (App. A.5; Sharma et al., Eq. 5 and 6)
    I(S'; Z | S) ≥ -E[log p(s' | s)] + E[log q(s' | s, z)],
p(s' | s) being q's average over the transition's own skill and L alternatives z_l ~ p(z). π's reward is thus
    r(s, s', z) = log q(Δ | s, z) - log (1 / (L + 1)) (q(Δ | s, z) + Σ_l q(Δ | s, z_l)),
and π is SAC's actor on it, α fixed (--alpha, 0.1). Ant and HalfCheetah only, seen as state vectors, as in the paper.

    python dads.py --env-id Ant  # the paper's run: 64M env steps
    python dads.py --env-id HalfCheetah --hidden-dim 256 --total-env-steps 3000000  # a smaller, shorter run

Deliberate differences from the official code (github.com/Princeton-RL/contrastive-successor-features, iod/dads.py):
  - no --turn_off_dones flag: a time limit is never a terminal step, as every official script sets it.
  - left out, as they never change learning: the frozen α's optimizer, the stored rewards, next actions and returns.
  - the reward's L = 100 alternatives share BN_in(s), Δ and the state part of q's first layer, computed once per
    transition: the numbers of every (s, z_l) row through q, up to rounding, cheaper.
  - added: the last epoch is always evaluated and checkpointed (the official scripts evaluate every 500 epochs on Ant
    and 1000 on HalfCheetah); a resumed run reports what the uninterrupted one does, but for the clock's figures
    (wall_time, sps, ms_per_grad_step, peak_rss_mb).
  - --buffer-on-device draws its batches with torch's own generator on the device: other draws than the host's.
  - on a GPU, float32 matmuls use TF32 (the tests' numbers are a CPU's).
"""

import contextlib
import functools
import json
import math
import os
import pathlib
import resource
import signal
import sys
import threading
import time
import types
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Literal, Optional

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.profiler import record_function
from torch.utils.tensorboard import SummaryWriter

import envs

plt.switch_backend("Agg")
AGENT = "dads"


@dataclass
class Args:
    # The world to learn skills in, seen as a state vector (the paper runs DADS on these two).
    env_id: Literal["Ant", "HalfCheetah"] = "Ant"
    # The dimension d of the skill z ~ U[-1, 1]^d.
    skill_dim: int = 3
    # The seed of torch, numpy and the envs; on a CPU, one seed gives one run, bit for bit.
    seed: int = 1
    # The env steps to train for, evaluations not counted; unset, the paper's 64M.
    total_env_steps: Optional[int] = None
    # The trajectories collected per epoch, a skill each; unset, 8.
    num_envs: Optional[int] = None
    # The gradient steps after each collection; unset, the paper's 50.
    grad_steps_per_epoch: Optional[int] = None
    # The transitions stored before the first gradient step.
    learning_starts: int = 10_000
    # The transitions per minibatch, drawn with replacement (at least 2, for the batch norms).
    batch_size: int = 256
    # The replay capacity in transitions, kept as whole trajectories; unset, 1M.
    buffer_size: Optional[int] = None
    # The width of the two hidden layers of the skill dynamics, Q and π.
    hidden_dim: int = 1024
    # The epochs between evaluations, the last one always evaluated; unset, the official scripts' (Ant 500,
    # HalfCheetah 1000).
    eval_every: Optional[int] = None
    # The epochs between checkpoints, the last one always saved; unset, the value of --eval-every.
    checkpoint_every: Optional[int] = None
    # A checkpoint.pt to continue, in its run's folder and with its flags; unset, a new run starts.
    resume: Optional[str] = None
    # Whether to train on the GPU when torch sees one.
    cuda: bool = True
    parallel_envs: bool = True  # Whether to step the envs in worker processes (the same numbers).
    buffer_on_device: bool = False  # Whether to keep the replay buffer on the device, drawn there by torch's generator.
    # Whether to replay the gradient step and the actions as CUDA graphs, on a GPU.
    cudagraphs: bool = False
    # Whether to compile the gradient step with torch.compile (on a CPU, the same numbers up to rounding).
    compile: bool = False
    # Whether to also log to Weights & Biases (WANDB_MODE=offline works).
    track: bool = False
    # The W&B project, with --track.
    wandb_project_name: str = "cleanmisl"
    # The W&B team, with --track; unset, your default entity.
    wandb_entity: Optional[str] = None
    # Whether to write an MP4 of up to four rollouts at each evaluation.
    capture_video: bool = False
    # The deterministic rollouts per evaluation, a fresh skill each.
    num_eval_skills: int = 48
    # The discount of the SAC critic.
    gamma: float = 0.99
    # The Polyak step of the target Q per gradient step.
    tau: float = 0.005
    # The alternative skills z_l per transition in the reward (L).
    num_alternatives: int = 100
    # The Adam learning rate of the skill dynamics, Q and π.
    lr: float = 3e-4
    # The entropy temperature α, fixed, as in the official DADS scripts.
    alpha: float = 0.1


def sample_skills(n, skill_dim, generator=None, device=None):
    """z ~ p(z) = U[-1, 1]^d (App. B.3)."""
    return 2 * torch.rand(n, skill_dim, generator=generator, device=device) - 1


def dads_reward(log_likelihoods, clip=50.0):
    """r = log(L + 1) - log(1 + Σ_l exp(clip(log q(Δ|s, z_l) - log q(Δ|s, z), ±50))), the header's reward, ratios
    clipped (official iod/dads.py). log_likelihoods: (B, 1 + L), the own skill's first."""
    own = log_likelihoods[:, :1]
    differences = (log_likelihoods[:, 1:] - own).clamp(-clip, clip)
    log_mean = torch.log(1 + differences.exp().sum(-1))
    num_skills = log_likelihoods.shape[1]  # L + 1
    return math.log(num_skills) - log_mean


@torch.no_grad()
def skill_dynamics_reward(model, obs, next_obs, skill, num_alternatives):
    """A batch's rewards, L fresh z_l ~ p(z) each; both batch norms on their running statistics, which stay."""
    model.eval()
    n, d = skill.shape
    alternatives = sample_skills(n * num_alternatives, d, device=skill.device)
    alternatives = alternatives.view(n, num_alternatives, d)
    skills = torch.cat([skill[:, None], alternatives], 1)  # (B, 1 + L, d), the own skill first
    log_likelihoods = model.log_likelihoods(obs, next_obs, skills)  # (B, 1 + L)
    reward = dads_reward(log_likelihoods)
    model.train()
    return reward


def model_objective(model, obs, next_obs, skill):
    """L(q) = -E[log q(Δ | s, z)], both batch norms on the batch's statistics (their running ones move)."""
    return -model.log_likelihoods(obs, next_obs, skill[:, None]).mean()


def qf_objective(qf, qf_target, actor, obs, action, next_obs, skill, reward, alpha, gamma):
    """L(Q) = Σ_k 0.5 E[(Q_k(s, a, z) - y)²], y = r + γ (min_k Q̄_k(s', a', z) - α log π(a'|s', z)), a' ~ π(·|s', z):
    the critics' one target, never terminal (the official iod/sac_utils.py)."""
    with torch.no_grad():
        next_action, next_log_prob = actor.sample(next_obs, skill)
        next_q = [net(next_obs, skill, next_action) for net in qf_target]
        next_q = torch.stack(next_q).amin(0)
        next_value = next_q - alpha * next_log_prob  # the soft value of s'
        target = reward + gamma * next_value
    losses = [0.5 * F.mse_loss(net(obs, skill, action), target) for net in qf]
    return sum(losses)


def actor_objective(actor, qf, obs, skill, alpha):
    """L(π) = E[α log π(a|s, z) - min_k Q_k(s, a, z)], a ~ π(·|s, z)."""
    new_action, log_prob = actor.sample(obs, skill)
    q = [net(obs, skill, new_action) for net in qf]
    q = torch.stack(q).amin(0)
    return (alpha * log_prob - q).mean()


def mlp(in_dim, hidden_dim, out_dim, activation, init):
    """Linear → activation → Linear → activation → Linear, weights from `init`, biases zero."""
    net = nn.Sequential(
        nn.Linear(in_dim, hidden_dim),
        activation(),
        nn.Linear(hidden_dim, hidden_dim),
        activation(),
        nn.Linear(hidden_dim, out_dim),
    )
    for layer in net[::2]:
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
        inputs = obs_dim + skill_dim
        self.net = mlp(inputs, hidden_dim, obs_dim, nn.ReLU, nn.init.xavier_uniform_)

    def trained_parameters(self):  # not BN_in's affine parameters
        return self.net.parameters()

    def log_likelihoods(self, obs, next_obs, skills):
        """log q(Δ | s, z), skills (B, K, d) → (B, K): W_s BN_in(s) + b and Δ once per transition, W_z z per skill."""
        first = self.net[0]
        obs_dim = obs.shape[-1]
        state_weight = first.weight[:, :obs_dim]  # W_s
        skill_weight = first.weight[:, obs_dim:]  # W_z
        state_part = F.linear(self.input_norm(obs), state_weight, first.bias)  # (B, H)
        skill_part = skills @ skill_weight.T  # (B, K, H)
        mean = self.net[1:](state_part[:, None] + skill_part)  # (B, K, D)
        target = self.target_norm(next_obs - obs)[:, None]  # (B, 1, D)
        squares = (target - mean) ** 2
        log_density = -squares / 2 - math.log(math.sqrt(2 * math.pi))  # of N(mean, I)
        return log_density.sum(-1)


class QNetwork(nn.Module):
    """Q(s, a, z) ∈ R: a ReLU MLP on s ⊕ z ⊕ a, Xavier-normal."""

    def __init__(self, space, action_dim, skill_dim, hidden_dim):
        super().__init__()
        inputs = space.shape[0] + skill_dim + action_dim
        self.net = mlp(inputs, hidden_dim, 1, nn.ReLU, nn.init.xavier_normal_)

    def forward(self, obs, skill, action):
        q = self.net(torch.cat([obs, skill, action], -1))
        return q.squeeze(-1)


class Actor(nn.Module):
    """π(a | s, z): a tanh-squashed Gaussian on a tanh trunk, its heads initialised 10x smaller."""

    def __init__(self, space, action_dim, skill_dim, hidden_dim):
        super().__init__()
        inputs = space.shape[0] + skill_dim
        trunk = mlp(inputs, hidden_dim, hidden_dim, nn.Tanh, nn.init.xavier_uniform_)
        self.trunk = trunk[:-1]
        self.mean = nn.Linear(hidden_dim, action_dim)
        self.log_std = nn.Linear(hidden_dim, action_dim)
        for head in (self.mean, self.log_std):
            nn.init.xavier_normal_(head.weight)
            head.weight.data.mul_(0.1)
            nn.init.zeros_(head.bias)

    def forward(self, obs, skill):
        h = self.trunk(torch.cat([obs, skill], -1))
        log_std = self.log_std(h).clamp(math.log(1e-6), 2.0)
        return self.mean(h), log_std

    def sample(self, obs, skill):
        """A reparameterized action a = tanh(u) and its log-probability."""
        mean, log_std = self(obs, skill)
        normal = torch.distributions.Normal(mean, log_std.exp(), validate_args=False)
        u = normal.rsample()
        action = torch.tanh(u)
        squash = torch.log((1 - action.pow(2)).clamp(0, 1) + 1e-6)
        log_prob = normal.log_prob(u).sum(-1) - squash.sum(-1)
        return action, log_prob

    def mode(self, obs, skill):
        mean, _ = self(obs, skill)
        return torch.tanh(mean)


def env_actions(policy, obs, skill, epoch):
    """The policy's actions for the envs, as numpy. A NaN or inf one ends the run."""
    obs = torch.as_tensor(obs)
    if skill.is_cuda:  # through pinned memory: the policy's launches need not wait for the copy
        obs = obs.pin_memory()
    obs = obs.to(skill.device, non_blocking=True)
    action = policy(obs=obs, skill=skill)["action"]
    action = action.cpu().numpy()  # the one wait for the device
    if not np.isfinite(action).all():
        error(f"the policy's action is not finite at epoch {epoch}: its networks diverged")
    return action


def optimize(optimizer, loss):
    """One gradient step of `optimizer`'s parameters alone (a gradient may flow through other networks)."""
    params = optimizer.param_groups[0]["params"]  # one group
    optimizer.zero_grad()
    loss.backward(inputs=params)
    optimizer.step()


def main(args, ckpt=None):
    """DADS epoch by epoch (official iod/iod.py: IOD.train): evaluate, checkpoint, collect, update."""
    spec = envs.ENV_SPECS[args.env_id]
    steps_per_epoch = args.num_envs * spec.horizon
    num_epochs = args.total_env_steps // steps_per_epoch
    torch.manual_seed(args.seed)  # the networks, skills and policy noise
    use_gpu = torch.cuda.is_available() and args.cuda
    device = torch.device("cuda" if use_gpu else "cpu")
    torch.set_float32_matmul_precision("high" if use_gpu else "highest")  # TF32 on a GPU
    make_env = functools.partial(envs.make_env, args.env_id)
    num_videos = 4 * args.capture_video  # the rollouts filmed at each evaluation
    train_envs, eval_envs = envs.make_envs(
        make_env, args.num_envs, args.num_eval_skills, args.seed, num_videos, args.parallel_envs)
    space = train_envs.single_observation_space  # a state vector
    action_dim = train_envs.single_action_space.shape[0]
    d = args.skill_dim
    width = args.hidden_dim
    model = SkillDynamics(space.shape[0], d, width).to(device)
    qf = nn.ModuleList([QNetwork(space, action_dim, d, width) for _ in range(2)]).to(device)  # SAC's twins
    qf_target = nn.ModuleList([QNetwork(space, action_dim, d, width) for _ in qf]).to(device)
    qf_target.load_state_dict(qf.state_dict())  # Q̄ = Q
    actor = Actor(space, action_dim, d, width).to(device)
    # Adam; on the fast path fused (or foreach, which compile fuses), its state on the GPU
    fused = args.cudagraphs and not args.compile
    capturable = args.cudagraphs and use_gpu
    adam = {"lr": args.lr, "fused": fused, "foreach": not fused, "capturable": capturable}
    model_optimizer = torch.optim.Adam(model.trained_parameters(), **adam)
    qf_optimizer = torch.optim.Adam(qf.parameters(), **adam)  # both Q, on their loss sum
    actor_optimizer = torch.optim.Adam(actor.parameters(), **adam)  # α is fixed: no optimizer
    rng = np.random.default_rng(args.seed)  # the replay draws
    buffer_device = None  # on the host
    if args.buffer_on_device:
        buffer_device = device
    rb = ReplayBuffer(
        args.buffer_size, spec.horizon, space, spec.frame_stack, action_dim, d, rng, buffer_device)
    learned = dict(  # what a checkpoint saves, under these names
        model=model,
        qf=qf,
        qf_target=qf_target,
        actor=actor,
        buffer=rb,
        model_optimizer=model_optimizer,
        qf_optimizer=qf_optimizer,
        actor_optimizer=actor_optimizer,
    )
    run, progress = start_run(args, ckpt, learned, train_envs, eval_envs, device)

    def update(obs, action, next_obs, skill):
        """One gradient step (official iod/dads.py): q; the rewards of the q just updated; Q by TD; π; then Q̄.
        Stats on the device."""
        with record_function("model step"):
            model_loss = model_objective(model, obs, next_obs, skill)
            optimize(model_optimizer, model_loss)
            reward = skill_dynamics_reward(model, obs, next_obs, skill, args.num_alternatives)
        with record_function("qf step"):
            qf_loss = qf_objective(
                qf, qf_target, actor, obs, action, next_obs, skill, reward, args.alpha, args.gamma)
            optimize(qf_optimizer, qf_loss)
        with record_function("actor step"):  # the gradient flows through Q to the action, not into Q
            actor_loss = actor_objective(actor, qf, obs, skill, args.alpha)
            optimize(actor_optimizer, actor_loss)
        with torch.no_grad():  # Q̄ ← (1 - τ) Q̄ + τ Q
            targets = list(qf_target.parameters())
            torch._foreach_lerp_(targets, list(qf.parameters()), args.tau)
        stats = {
            "model_loss": model_loss,
            "qf_loss": qf_loss,
            "actor_loss": actor_loss,
            "log_likelihood": -model_loss,
            "reward": reward.mean(),
        }
        return {name: value.detach() for name, value in stats.items()}

    update = fast_path(update, actor, run, args, device)
    start_epoch = progress["epoch"]
    for epoch in range(start_epoch, num_epochs + 1):
        epoch_start = time.time()
        progress["epoch"] = epoch
        last = epoch == num_epochs
        # evaluate and checkpoint what the previous epochs made (a resumed run skips both at its first epoch)
        if (epoch % args.eval_every == 0 or last) and not (ckpt and epoch == start_epoch):
            evaluate(run, progress, args, device)
        if (epoch % args.checkpoint_every == 0 or last) and epoch != start_epoch:
            save_checkpoint(run, progress, args, learned, device)
        if last:
            break
        # a trajectory per env and skill, from the stochastic policy
        collect_start = time.time()
        skills = sample_skills(args.num_envs, d).to(device)
        obs, _ = train_envs.reset()
        observations = [obs]
        actions = []
        with torch.no_grad(), record_function("collection"):
            for t in range(spec.horizon):
                action = env_actions(run.policy, obs, skills, epoch)
                obs, _, terminated, truncated, _ = train_envs.step(action)
                assert not terminated.any()  # never terminal, cut at the horizon: the buffer's layout
                assert (truncated == (t == spec.horizon - 1)).all()
                observations.append(obs)  # the last one: the trajectory's final observation
                actions.append(action)
        observations = np.stack(observations, 1)  # (envs, horizon + 1, |S|)
        actions = np.stack(actions, 1)
        rb.add(observations, actions, skills.cpu().numpy())
        # gradient steps, once learning_starts transitions are stored
        train_start = time.time()
        step_stats = []
        if rb.size >= args.learning_starts:
            for _ in range(args.grad_steps_per_epoch):
                with record_function("sampling"):
                    batch = rb.sample(args.batch_size, device)
                step_stats.append(update(**batch))
        progress["grad_steps"] += len(step_stats)
        progress["wall_time"] += time.time() - epoch_start
        log_epoch(run, progress, args, step_stats, collect_start, train_start)  # a NaN loss ends the run here
    train_envs.close()
    eval_envs.close()
    run.writer.close()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as before the run
    print(f"done: {run.dir}")


# ABLATIONS: none (DADS has no ablation flags).
# INFRASTRUCTURE: the replay buffer, command line, start-up, fast path, checkpoints, evaluation, logs. A second
# reading.
class ReplayBuffer:
    """The replay buffer: a ring of whole trajectories (path_buffer_ex.py), each state stored once (s'_t is s_{t+1};
    frame_stack, 1 in DADS's worlds, is unused), in tensors on the host, drawn with numpy's `rng`; or on `device`
    (--buffer-on-device), drawn there with torch's own."""

    def __init__(self, capacity, horizon, space, frame_stack, action_dim, skill_dim, rng,
                 device=None):
        n = capacity // horizon  # trajectories
        dtype = getattr(torch, space.dtype.name)
        self.frames = torch.empty(n, horizon + 1, *space.shape, dtype=dtype, device=device)
        self.actions = torch.empty(n, horizon, action_dim, device=device)
        self.skills = torch.empty(n, skill_dim, device=device)
        self.horizon = horizon
        self.rng = rng
        self.on_device = device is not None
        self.added = 0  # trajectories, ever

    @property
    def size(self):  # stored transitions
        return min(self.added, len(self.skills)) * self.horizon

    def add(self, observations, actions, skills):
        """Whole trajectories: observations (n, horizon + 1, ...), actions (n, horizon, |A|), skills (n, d)."""
        slots = torch.arange(self.added, self.added + len(skills)) % len(self.skills)
        self.frames[slots] = torch.as_tensor(observations).to(self.frames)
        self.actions[slots] = torch.as_tensor(actions).to(self.actions)
        self.skills[slots] = torch.as_tensor(skills).to(self.skills)
        self.added += len(skills)

    def sample(self, batch_size, device):
        """s, a, s', z of transitions drawn with replacement, on `device` (from the host: pinned, not waiting)."""
        if self.on_device:
            i = torch.randint(0, self.size, (batch_size,), device=device)
        else:
            i = torch.as_tensor(self.rng.integers(0, self.size, batch_size))
        trajectory = i // self.horizon
        t = i % self.horizon
        batch = {"obs": self.frames[trajectory, t], "next_obs": self.frames[trajectory, t + 1],
                 "action": self.actions[trajectory, t], "skill": self.skills[trajectory]}
        if torch.device(device).type == "cuda" and not self.on_device:
            batch = {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
        return batch

    def state_dict(self):
        stored = min(self.added, len(self.skills))
        state = {"added": self.added, "rng": self.rng.bit_generator.state}
        for name in ("frames", "actions", "skills"):
            values = getattr(self, name)[:stored].cpu()  # on the host, a view
            state[name] = torch.from_numpy(values.numpy())  # which torch.save writes alone, not the whole ring
        return state

    def load_state_dict(self, state):
        self.added = state["added"]
        self.rng.bit_generator.state = state["rng"]
        for name in ("frames", "actions", "skills"):
            getattr(self, name)[:len(state[name])] = state[name]


FLAG_RANGES = {  # every numeric flag's valid interval ("[" closed, "(" open); NaN is never inside
    "skill_dim": "[1, inf)",
    "seed": "[0, 2147483647]",
    "total_env_steps": "[1, inf)",
    "num_envs": "[1, inf)",
    "grad_steps_per_epoch": "[0, inf)",
    "learning_starts": "[0, inf)",
    "batch_size": "[2, inf)",  # the batch norms need two samples
    "buffer_size": "[1, inf)",
    "hidden_dim": "[1, inf)",
    "eval_every": "[1, inf)",
    "checkpoint_every": "[1, inf)",
    "num_eval_skills": "[1, inf)",
    "gamma": "[0, 1)",
    "tau": "(0, 1]",
    "num_alternatives": "[1, inf)",
    "lr": "(0, inf)",
    "alpha": "[0, inf)",
}
# flags --resume may change, none changing the problem (the device, --buffer-on-device, --compile, --bf16: the numbers)
RESUME_MAY_CHANGE = (
    "total_env_steps", "eval_every", "checkpoint_every", "resume", "cuda", "parallel_envs",
    "buffer_on_device", "cudagraphs", "compile", "track", "wandb_project_name", "wandb_entity",
    "capture_video")


def parse_args(argv=None):
    """The flags: unset ones take the world's values (the paper's and the official scripts'); with --resume, the
    run's own, but for RESUME_MAY_CHANGE's given anew. A flag out of its range ends here in one line."""
    args = tyro.cli(Args, args=argv)
    ckpt = None
    if args.resume and not os.path.isfile(args.resume):
        error(f"no checkpoint file at {args.resume}")
    if args.resume:
        try:
            ckpt = torch.load(args.resume, map_location="cpu", weights_only=False)
        except Exception as e:
            error(f"{args.resume} is not a readable checkpoint ({type(e).__name__})")
        if not isinstance(ckpt, dict) or "agent" not in ckpt:
            error(f"{args.resume} is not a cleanmisl checkpoint")
        if ckpt["agent"] != AGENT:
            error(f"{args.resume} is a {ckpt['agent']} checkpoint, not a {AGENT} one")
        if set(ckpt["args"]) - {field.name for field in fields(Args)}:
            error(f"{args.resume} was written by another version of {AGENT}.py")
        args = tyro.cli(Args, args=argv, default=Args(**ckpt["args"]))
        for flag, trained in ckpt["args"].items():
            if flag not in RESUME_MAY_CHANGE and getattr(args, flag) != trained:
                error(f"{args.resume} was trained with --{flag.replace('_', '-')} {trained}, not {getattr(args, flag)}")
    for flag, value in env_defaults(args.env_id).items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    if args.checkpoint_every is None:
        args.checkpoint_every = args.eval_every
    for flag, interval in FLAG_RANGES.items():
        value = getattr(args, flag)
        low, high = map(float, interval[1:-1].split(", "))
        above = value >= low if interval[0] == "[" else value > low  # False for NaN
        below = value <= high if interval[-1] == "]" else value < high
        if not (above and below):
            error(f"--{flag.replace('_', '-')} must be in {interval}, got {value}")
    horizon = envs.ENV_SPECS[args.env_id].horizon
    epoch = args.num_envs * horizon  # the env steps of one epoch
    if args.buffer_size < epoch:
        error(f"--buffer-size must hold one epoch (--num-envs × {horizon} = {epoch} transitions), "
              f"got {args.buffer_size}")
    if args.total_env_steps < epoch:
        error(f"--total-env-steps must cover one epoch (--num-envs × {horizon} = {epoch} env "
              f"steps), got {args.total_env_steps}")
    stored = min(args.total_env_steps // epoch * epoch, args.buffer_size // horizon * horizon)
    if args.grad_steps_per_epoch and args.learning_starts > stored:
        error(f"--learning-starts must be at most --total-env-steps and --buffer-size in whole "
              f"epochs and trajectories ({stored}), or the run never learns; got {args.learning_starts}")
    if ckpt and args.total_env_steps // epoch <= ckpt["epoch"]:
        error(f"{args.resume} has already trained for {ckpt['epoch'] * epoch} env steps; give a "
              "larger --total-env-steps to continue it")
    try:
        envs.check_env_memory(args.num_envs + args.num_eval_skills)
        env = envs.make_env(args.env_id)  # for its sizes
    except (MemoryError, envs.RenderUnavailable) as e:
        error(e)
    check_memory(args, env.observation_space, env.action_space.shape[0])
    env.close()
    return args, ckpt


def env_defaults(env_id):  # the flags whose unset value depends on the world
    spec = envs.ENV_SPECS[env_id]
    flags = ("total_env_steps", "num_envs", "grad_steps_per_epoch", "buffer_size", "eval_every")
    return {flag: getattr(spec, flag) for flag in flags}


def start_run(args, ckpt, learned, train_envs, eval_envs, device):
    """The run's folder and logs (Ctrl-C, W&B, TensorBoard, a line with the flags the world set), the evaluation's
    random streams, and the progress: a new run's, or with --resume the checkpoint's, its state restored."""
    name = f"{args.env_id}__{AGENT}__{args.seed}__{int(time.time())}"
    folder = f"runs/{name}"
    if ckpt:
        name = ckpt["run_name"]
        folder = os.path.dirname(os.path.abspath(args.resume))
    os.makedirs(folder, exist_ok=True)
    signal.signal(signal.SIGINT, lambda *_: error("interrupted", folder))  # every write is atomic
    if args.track:
        import wandb
        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=name, save_code=True, resume="allow", id=name)
    # TensorBoard writes from a thread: a failed write raises at the next add_scalar
    threading.excepthook = lambda hook: (
        None if issubclass(hook.exc_type, OSError) else threading.__excepthook__(hook))
    writer = SummaryWriter(folder)
    table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    resolved = [*env_defaults(args.env_id), "checkpoint_every"]
    flags = ", ".join(f"--{flag.replace('_', '-')} {getattr(args, flag)}" for flag in resolved)
    source = "the run's own, but for those given anew" if ckpt else "a flag left unset takes the world's value"
    print(f"{args.env_id} (horizon {envs.ENV_SPECS[args.env_id].horizon}): {flags} ({source})", flush=True)
    train_envs.run_dir = eval_envs.run_dir = folder  # a dead env worker's line names the checkpoint
    run = types.SimpleNamespace(name=name, dir=folder, writer=writer, train_envs=train_envs, eval_envs=eval_envs)
    run.eval_rng = np.random.default_rng(args.seed + 1)  # unused by DADS: every agent's checkpoint holds it
    run.eval_generator = torch.Generator().manual_seed(args.seed + 1)  # the evaluation's skills
    if ckpt:
        return run, resume(ckpt, run, args, learned, device)
    return run, {"epoch": 0, "grad_steps": 0, "wall_time": 0.0, "since_eval": [], "evals": [], "timing": {}}


def check_memory(args, space, action_dim):
    """Refuses, before anything is allocated, a run whose buffer, networks and batch do not fit where they go."""
    horizon = envs.ENV_SPECS[args.env_id].horizon
    use_gpu = torch.cuda.is_available() and args.cuda
    obs_dim = math.prod(space.shape)
    obs_bytes = obs_dim * space.dtype.itemsize
    trajectory_bytes = (horizon + 1) * obs_bytes + 4 * (horizon * action_dim + args.skill_dim)
    buffer = {"the replay buffer (--buffer-size)": args.buffer_size // horizon * trajectory_bytes}
    training = {
        "the networks (--hidden-dim)": 72 * args.hidden_dim**2,  # 18 square layers' worth of float32
        "one batch (--batch-size)": 4 * args.batch_size * (2 * obs_dim + 8 * args.hidden_dim),
    }
    places = {"host": buffer | training}
    if use_gpu and args.buffer_on_device:
        places = {"GPU": buffer | training}
    elif use_gpu:
        places = {"GPU": training, "host": buffer}
    for place, parts in places.items():
        free = torch.cuda.mem_get_info()[0] if place == "GPU" else envs.free_host_memory()
        needed = sum(parts.values())
        sizes = ", ".join(f"{part} {size / 2**30:,.1f}" for part, size in parts.items())
        if needed > free:
            error(f"this run needs at least {needed / 2**30:,.1f} GiB of {place} memory: {sizes}; "
                  f"{free / 2**30:,.1f} GiB is free")


def fast_path(update, actor, run, args, device):
    """Makes run.policy and run.eval_policy; compiles the step (--compile); CUDA graphs of all three (--cudagraphs)."""
    run.policy = lambda obs, skill: {"action": actor.sample(obs, skill)[0]}  # collection's actions
    run.eval_policy = lambda obs, skill: {"action": actor.mode(obs, skill)}  # evaluation's
    if args.compile:
        torch._inductor.config.fallback_random = device.type == "cpu"  # on a CPU, eager's random draws
        update = torch.compile(update)
    if args.cudagraphs and device.type != "cuda":
        print("--cudagraphs: CUDA graphs need a GPU; on the CPU the gradient step runs without "
              "them", flush=True)
    elif args.cudagraphs:
        update = CudaGraphStep(update)
        run.policy = CudaGraphStep(run.policy)
        run.eval_policy = CudaGraphStep(run.eval_policy)
    return update


class CudaGraphStep:
    """A step (the gradient step, or the actions): 3 warm-up calls on a side stream, then one recorded as a CUDA graph,
    then replays of it on the recorded batch's tensors, each new batch copied into them."""

    def __init__(self, step):
        self.step = step
        self.calls = 0

    def __call__(self, **batch):
        self.calls += 1
        if self.calls <= 3:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), warnings.catch_warnings():
                warnings.filterwarnings("ignore", "This instance was constructed with capturable=True")
                stats = self.step(**batch)
            torch.cuda.current_stream().wait_stream(side)
            return stats
        if self.calls == 4:
            self.batch = batch
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.stats = self.step(**batch)
        for name, value in batch.items():
            self.batch[name].copy_(value)
        self.graph.replay()
        return {name: value.clone() for name, value in self.stats.items()}


def save_checkpoint(run, progress, args, learned, device):
    """What a resumed run needs to go on as this one would, written atomically; a NaN or inf weight or moment: stop."""
    state = {"agent": AGENT, "args": asdict(args), "run_name": run.name, **progress}
    for name, thing in learned.items():
        tensors = list(thing.parameters()) if isinstance(thing, nn.Module) else []
        if isinstance(thing, torch.optim.Optimizer):  # its moments
            tensors = [value for state in thing.state.values() for value in state.values()]
        if not all(tensor.isfinite().all() for tensor in tensors):
            error(f"{name} holds NaN or inf at epoch {progress['epoch']}: the run diverged", run.dir)
        state[name] = thing.state_dict()
    state["rngs"] = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else [],
        "eval_numpy": run.eval_rng.bit_generator.state,
        "eval_torch": run.eval_generator.get_state(),
        "envs": envs.env_rng_states(run.train_envs) + envs.env_rng_states(run.eval_envs),
    }
    write_atomically(f"{run.dir}/checkpoint.pt", lambda tmp: torch.save(state, tmp), run.dir)


def resume(ckpt, run, args, learned, device):
    """The checkpoint's networks, optimizers, buffer, random streams and progress; its evaluations, back in
    eval.jsonl. A state that does not fit this script ends the run in one line that names the difference."""
    for name, thing in learned.items():
        if name not in ckpt:
            error(f"{args.resume} was written by another version of {AGENT}.py: it has no {name}")
        try:
            if isinstance(thing, torch.optim.Optimizer):  # with this run's options (fused, capturable)
                for group in ckpt[name]["param_groups"]:
                    group.update(thing.defaults)
            thing.load_state_dict(ckpt[name])
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            error(f"{args.resume}'s {name} does not fit this {AGENT}.py ({' '.join(str(e).split())[:160]})")
    try:
        rngs = ckpt["rngs"]
        torch.set_rng_state(rngs["torch"])
        torch.cuda.set_rng_state_all(rngs["cuda"][:torch.cuda.device_count()])  # on maybe fewer GPUs
        run.eval_rng.bit_generator.state = rngs["eval_numpy"]
        run.eval_generator.set_state(rngs["eval_torch"])
        envs.set_env_rng_states(run.train_envs, rngs["envs"][:args.num_envs])
        envs.set_env_rng_states(run.eval_envs, rngs["envs"][args.num_envs:])
        progress = {name: ckpt[name] for name in ("epoch", "grad_steps", "wall_time", "since_eval", "evals", "timing")}
    except (KeyError, RuntimeError, ValueError, TypeError) as e:
        error(f"{args.resume} was written by another version of {AGENT}.py ({' '.join(str(e).split())[:160]})")
    write_log(run, progress["evals"])  # without what was logged after the checkpoint
    print(f"resumed {ckpt['run_name']} at epoch {ckpt['epoch']}")
    return progress


def write_log(run, evals):  # eval.jsonl: a line per evaluation
    text = "".join(json.dumps(result) + "\n" for result in evals)
    write_atomically(f"{run.dir}/eval.jsonl", lambda tmp: pathlib.Path(tmp).write_text(text), run.dir)


@torch.no_grad()
@record_function("evaluation")
def evaluate(run, progress, args, device):
    """Deterministic rollouts of fresh skills (official iod/metra.py: _evaluate_policy): their coverage, the training
    means since the last evaluation; a plot of the paths, a video, a line of eval.jsonl."""
    epoch = progress["epoch"]
    spec = envs.ENV_SPECS[args.env_id]
    env_steps = epoch * args.num_envs * spec.horizon
    videos = run.eval_envs.video_envs
    skills = sample_skills(args.num_eval_skills, args.skill_dim, run.eval_generator).to(device)
    obs, info = run.eval_envs.reset()
    coordinates = [info["coordinates"]]
    frames = []
    for t in range(spec.horizon + 1):  # after the reset and after every step
        if videos:
            frames.append(np.concatenate(envs.render_envs(run.eval_envs, videos), 1))
        if t < spec.horizon:
            action = env_actions(run.eval_policy, obs, skills, epoch)
            obs, _, _, _, info = run.eval_envs.step(action)
            coordinates.append(info["coordinates"])
    paths = np.stack(coordinates, 1)  # (rollouts, horizon + 1, coordinates)
    result = {
        "epoch": epoch,
        "env_steps": env_steps,
        "grad_steps": progress["grad_steps"],
        "wall_time": round(progress["wall_time"], 2),
        "coverage": envs.coverage(paths, args.env_id),
    }
    run.writer.add_scalar("eval/coverage", result["coverage"], env_steps)
    since_eval = progress["since_eval"]  # each epoch's means of the stats
    if since_eval:
        per_epoch = torch.stack([torch.stack(list(means.values())) for means in since_eval])
        result.update(zip(since_eval[0], per_epoch.mean(0).tolist()))
    since_eval.clear()
    result.update(progress["timing"])
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    z = skills.cpu().numpy()  # a path's colour: the angle of (z_0, z_1), or z's sign
    angle = np.arctan2(z[:, 1], z[:, 0]) if args.skill_dim > 1 else np.pi * (z[:, 0] > 0)
    fig, ax = plt.subplots(figsize=(5, 5))
    envs.draw_coordinates(ax, paths, plt.cm.hsv((angle + np.pi) / (2 * np.pi)), args.env_id)
    ax.set_title(f"DADS {args.env_id}, {env_steps:,} env steps, coverage {result['coverage']}")
    fig.tight_layout()
    write_atomically(f"{run.dir}/skills_{env_steps:010d}.png", lambda tmp: fig.savefig(tmp, dpi=100), run.dir)
    plt.close(fig)
    if videos:
        import imageio
        os.makedirs(f"{run.dir}/videos", exist_ok=True)
        video = f"{run.dir}/videos/skills_{env_steps:010d}.mp4"
        write_atomically(video, lambda tmp: imageio.mimsave(tmp, frames, fps=20), run.dir)
    progress["evals"].append(result)
    write_log(run, progress["evals"])
    figures = "".join(f" | {k} {v:.4g}" for k, v in list(result.items())[5:-1])
    print(f"eval  epoch {epoch} | env steps {env_steps:,} | coverage {result['coverage']}{figures}", flush=True)


def log_epoch(run, progress, args, step_stats, collect_start, train_start):
    """A NaN or inf *_loss ends the run, naming its step; else the epoch's means go to TensorBoard and, with its SPS
    and ms per gradient step, to the next evaluation. Every 10 epochs, a line with the time left at the run's SPS."""
    epoch = progress["epoch"]
    steps_per_epoch = args.num_envs * envs.ENV_SPECS[args.env_id].horizon
    env_steps = (epoch + 1) * steps_per_epoch
    progress["timing"] = {"sps": steps_per_epoch / (time.time() - collect_start)}
    means = {}
    if step_stats:
        progress["timing"]["ms_per_grad_step"] = 1000 * (time.time() - train_start) / len(step_stats)
        names = list(step_stats[0])
        per_step = torch.stack([torch.stack(list(stats.values())) for stats in step_stats])  # (steps, stats)
        losses = [i for i, name in enumerate(names) if name.endswith("_loss")]
        bad = torch.nonzero(~per_step[:, losses].isfinite())  # (step, loss) pairs, the earliest first
        if len(bad) > 0:
            step, i = bad[0].tolist()
            value = per_step[step, losses[i]].item()
            step += progress["grad_steps"] - len(step_stats) + 1
            error(f"{names[losses[i]]} is {value} at gradient step {step} (epoch {epoch})", run.dir)
        means = dict(zip(names, per_step.mean(0).cpu()))
        progress["since_eval"].append(means)
    for name, value in means.items():
        group = "losses" if name.endswith("loss") else "charts"
        run.writer.add_scalar(f"{group}/{name}", value, env_steps)
    sps = env_steps / progress["wall_time"]  # the run's, evaluations included
    run.writer.add_scalar("charts/SPS", int(sps), env_steps)
    run.writer.add_scalar("charts/grad_steps", progress["grad_steps"], env_steps)
    if (epoch + 1) % 10 == 0:
        figures = "".join(f" | {name} {value:.4g}" for name, value in means.items())
        left = duration((args.total_env_steps - env_steps) / sps)
        print(f"epoch {epoch + 1} | env steps {env_steps:,} | SPS {int(sps)} | {left} left{figures}",
              flush=True)


def duration(seconds):  # "45 s", "12 min", "3 h 05 min"
    minutes = round(seconds / 60)
    if seconds < 60:
        return f"{seconds:.0f} s"
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def error(message, run_dir=None):
    """Ends the run with one line, no traceback; given the run's folder, with the command that resumes it."""
    if run_dir:
        checkpoint = f"{run_dir}/checkpoint.pt"
        hint = "no checkpoint was written yet"
        if os.path.isfile(checkpoint):
            hint = f"resume with --resume {checkpoint}"
        message = f"{message}; {hint}"
    sys.exit(f"{AGENT}.py: error: {message}")


def write_atomically(path, write, run_dir):
    """write(temporary), then a rename: a failed write leaves the old file whole and no temporary behind."""
    temporary = "{}.tmp{}".format(*os.path.splitext(path))  # its extension names the format
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        if isinstance(e, OSError):
            error(f"cannot write {path} ({e.strerror or e})", run_dir)
        if not isinstance(e, RuntimeError):
            raise
        if "unexpected pos" in str(e) or "write failed" in str(e):  # torch.save on a full disk
            error(f"cannot write {path} (the write was cut short: is the disk full?)", run_dir)
        error(f"cannot write {path} ({' '.join(str(e).split())[:120]})", run_dir)


if __name__ == "__main__":
    args, ckpt = parse_args()
    try:
        main(args, ckpt)
    except (envs.RenderUnavailable, envs.WorkerDied, MemoryError) as e:  # no render, a dead env worker, no memory
        error(e, getattr(e, "run_dir", None))
    except OSError as e:  # the run's folder or TensorBoard's file
        where = os.fsdecode(e.filename) if e.filename else "the TensorBoard log"
        error(f"cannot write {where} ({e.strerror or e})")
