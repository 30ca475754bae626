"""METRA (Park, Rybkin and Levine, ICLR 2024) in one file, as analysed in "Can a MISL Fly? Analysis and Ingredients
for Mutual Information Skill Learning" (Zheng, Tuyls, Peng and Eysenbach, ICLR 2025), §3 and §4.

A skill z ~ p(z) = Unif(S^{d-1}) (one-hot among K on HalfCheetah, Kitchen) is held for a trajectory of π(a | s, z).
φ(s) ∈ R^d learns moves Δφ = φ(s') - φ(s) along z; one dual variable λ ≥ 0 constrains ‖Δφ‖² ≤ 1 (Eq. 5, slack ε):
    max_φ min_λ  E[Δφᵀz] + λ E[min(1 - ‖Δφ‖², ε)],
in expectation only (Eq. 7; Prop. 1: E‖Δφ‖² = 1 at the optimum), a quadratic approximation of the contrastive lower
bound's negative term (Eq. 8; Prop. 2). π is SAC on r(s, s', z) = Δφᵀz (Eq. 6), with twin Qs and automatic α.

    python metra.py --env-id Ant --hidden-dim 256 --total-env-steps 3000000  # a CPU-sized run, about an hour

Deliberate differences from the official code (github.com/Princeton-RL/contrastive-successor-features, iod/metra.py):
  - ‖Δφ‖² is summed over the dimensions, as there (the original METRA's mean: --constraint-norm mean).
  - no --turn_off_dones flag: a time limit is never terminal, as every official script sets it.
  - left out, never changing learning: a target φ never updated, φ's std head, the stored rewards.
  - torch draws the one-hot z; METRA-C (--repr-loss contrastive) draws fresh unit-sphere negatives, so no one-hot z.
  - added: the last epoch is always evaluated and checkpointed; evaluations after epoch 0 report E‖Δφ‖² and the mean
    constraint on up to 10k replay transitions (drawn with replacement); a resumed run reports what the uninterrupted
    one does, but for the clock's figures (wall_time, sps, ms_per_grad_step, peak_rss_mb).
  - the ablations (METRA-C, --constraint-norm mean) live after `main`, which swaps them in with one-line ifs.
  - pixels: each frame is stored once (3.7 GB, not 22 GB, at 300k); envs.py seeds every env apart; TF32 on a GPU.
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
AGENT = "metra"
SKILL_DIMS = {"Ant": 2, "HalfCheetah": 16, "Quadruped": 4, "Humanoid": 2, "Kitchen": 24, "Robobin": 9}  # App. B.3
DISCRETE_ENVS = ("HalfCheetah", "Kitchen")  # one-hot skills, officially
FIXED_ALPHA_ENVS = ("Kitchen",)  # α never tuned, officially


@dataclass
class Args:
    # The world to learn skills in: Ant and HalfCheetah give state vectors, the others 64×64 pixels.
    env_id: Literal["Ant", "HalfCheetah", "Quadruped", "Humanoid", "Kitchen", "Robobin"] = "Ant"
    skill_dim: Optional[int] = None  # The size d of z, or K one-hot skills; unset, the world's in App. B.3.
    discrete: Optional[bool] = None  # Whether z is one-hot, not on the sphere; unset, on HalfCheetah and Kitchen only.
    seed: int = 1  # The seed of torch, numpy and the envs; on a CPU, one seed gives one run, bit for bit.
    total_env_steps: Optional[int] = None  # The env steps to train; unset, the paper's (states 64M, pixels 4.8M).
    num_envs: Optional[int] = None  # The trajectories collected per epoch, a skill each; unset, 8 (Robobin 10).
    grad_steps_per_epoch: Optional[int] = None  # The gradient steps per epoch; unset, the official scripts' per world.
    learning_starts: int = 10_000  # The transitions stored before the first gradient step.
    batch_size: int = 256  # The transitions per minibatch, drawn with replacement.
    # The replay capacity in transitions, kept as whole trajectories; unset, 1M (pixels 300k, Kitchen 100k).
    buffer_size: Optional[int] = None
    hidden_dim: int = 1024  # The width of the hidden layers of φ, Q and π.
    eval_every: Optional[int] = None  # The epochs between evaluations, and the last; unset, the official scripts'.
    checkpoint_every: Optional[int] = None  # The epochs between checkpoints, and the last; unset, --eval-every's.
    resume: Optional[str] = None  # A checkpoint.pt to continue, with its run's folder and flags; unset, a new run.
    cuda: bool = True  # Whether to train on the GPU when torch sees one.
    parallel_envs: bool = True  # Whether to step the envs in worker processes (the same numbers).
    buffer_on_device: bool = False  # Whether to keep the replay buffer on the device, drawn there by torch's generator.
    track: bool = False  # Whether to also log to Weights & Biases (WANDB_MODE=offline works).
    wandb_project_name: str = "cleanmisl"  # The W&B project, with --track.
    wandb_entity: Optional[str] = None  # The W&B team, with --track; unset, your default entity.
    capture_video: bool = False  # Whether to write an MP4 of up to four rollouts at each evaluation.
    num_eval_skills: int = 48  # The deterministic rollouts per evaluation: fresh skills, or the K one-hots in turn.
    save_repr_stats: bool = False  # Whether to save Δφ of replay transitions at each evaluation, for Figure 2.
    # The loss of φ: dual is METRA's (Eq. 5, with λ); contrastive is METRA-C's (§6.3), CSF's bound, λ never stepped.
    repr_loss: Literal["dual", "contrastive"] = "dual"
    # The squared norm ‖Δφ‖² in the constraint: sum over the dimensions (the paper's); mean, the original METRA's.
    constraint_norm: Literal["sum", "mean"] = "sum"
    dual_lam: float = 30.0  # The initial dual variable λ.
    dual_slack: float = 1e-3  # The slack ε of the constraint term min(1 - ‖Δφ‖², ε).
    dual_lr: float = 1e-4  # The Adam learning rate of log λ.
    xi: float = 5.0  # The weight ξ of METRA-C's negative term, with --repr-loss contrastive.
    num_negatives: int = 256  # The prior draws z'_j per gradient step in METRA-C's negative term.
    gamma: float = 0.99  # The discount of the Q-functions.
    tau: float = 0.005  # The Polyak step of the target Qs per gradient step.
    lr: float = 1e-4  # The Adam learning rate of φ, Q, π and log α.
    alpha_init: float = 0.01  # The initial temperature α, tuned towards the entropy -|A|/2 (fixed on Kitchen).
    compile: bool = False  # Whether to torch.compile the gradient step (on a CPU, the same numbers up to rounding).
    bf16: bool = False  # Whether to run the pixel encoders' convolutions in bfloat16.
    cudagraphs: bool = False  # Whether to replay the gradient step and the actions as CUDA graphs, on a GPU.


def sample_skills(n, skill_dim, discrete=False, generator=None, device=None):
    """z ~ p(z): a standard normal draw scaled to unit length, or (discrete) a uniform one-hot among K = skill_dim."""
    if discrete:
        index = torch.randint(skill_dim, (n,), generator=generator, device=device)
        return F.one_hot(index, skill_dim).float()
    z = torch.randn(n, skill_dim, generator=generator, device=device)
    return z / z.norm(dim=-1, keepdim=True)


def skill_weights(skill, discrete):
    """The w of r = Δφᵀw: z, or for a one-hot z among K, (z - 1/K)·K/(K-1), as officially."""
    if not discrete:
        return skill
    k = skill.shape[-1]
    return (skill - 1 / k) * k / (k - 1)


def intrinsic_reward(dphi, weights):
    """r = (φ(s') - φ(s))ᵀw per sample (Eq. 6)."""
    return (dphi * weights).sum(-1)


def constraint(dphi, eps):
    """c = min(1 - ‖Δφ‖², ε) per sample, ‖Δφ‖² summed over the dimensions."""
    squared_norm = dphi.pow(2).sum(-1)
    return torch.clamp(1 - squared_norm, max=eps)


def metra_phi_loss(dphi, weights, log_lam, c):
    """L(φ) = -E[Δφᵀw + λ c], λ = exp(log λ) detached (Eq. 5)."""
    reward = intrinsic_reward(dphi, weights)
    lam = log_lam.exp().detach()
    return -(reward + lam * c).mean()


def dual_loss(log_lam, c):
    """L(λ) = log λ · E[c], c detached: λ falls while c > 0, rises while c < 0 (Eq. 5's min over λ)."""
    return log_lam * c.detach().mean()


def qf_objective(qf, qf_target, actor, reward,
                 obs, action, next_obs, skill, alpha, gamma):
    """L(Q) = Σ_k ½ E[(Q_k - y)²], y = r + γ (min_k Q̄_k(s', a', z) - α log π(a'|s', z)), a' ~ π, never terminal."""
    with torch.no_grad():
        next_action, next_log_prob = actor.sample(next_obs, skill)
        next_q = [net(next_obs, skill, next_action) for net in qf_target]
        next_q = torch.stack(next_q).amin(0)  # the smaller target critic's
        target = reward + gamma * (next_q - alpha * next_log_prob)
    losses = [0.5 * F.mse_loss(net(obs, skill, action), target) for net in qf]
    return sum(losses)


def actor_objective(actor, qf, obs, skill, alpha):
    """L(π) = E[α log π(a|s, z) - min_k Q_k(s, a, z)], a ~ π(·|s, z) reparameterized; and log π(a|s, z)."""
    new_action, log_prob = actor.sample(obs, skill)
    q = [net(obs, skill, new_action) for net in qf]
    q = torch.stack(q).amin(0)  # the smaller critic's
    loss = (alpha * log_prob - q).mean()
    return loss, log_prob


def temperature_loss(log_alpha, log_prob, target_entropy):
    """L(α) = -E[log α (log π(a|s, z) + H̄)], H̄ = -|A|/2 (iod/metra.py's; SAC's usual is -|A|)."""
    return -(log_alpha * (log_prob + target_entropy)).mean()


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


class Phi(nn.Module):
    """φ(s) ∈ R^d (ReLU, Xavier-uniform). Every network owns its pixel encoder (garagei's with_encoder.py)."""
    def __init__(self, space, out_dim, hidden_dim,
                 input_dim=0, init=nn.init.xavier_uniform_):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        in_dim = features + input_dim
        self.net = mlp(in_dim, hidden_dim, out_dim, nn.ReLU, init)

    def forward(self, obs, *inputs):  # Q's inputs z and a come after s
        features = self.encoder(obs)
        features = torch.cat([features, *inputs], -1)
        return self.net(features)

    def delta(self, obs, next_obs):
        """Δφ = φ(s') - φ(s), the move the reward compares with z."""
        return self(next_obs) - self(obs)


class QNetwork(Phi):
    """Q(s, a, z) ∈ R: φ's network on (s, z, a), Xavier-normal."""
    def __init__(self, space, action_dim, skill_dim, hidden_dim):
        inputs = skill_dim + action_dim
        init = nn.init.xavier_normal_
        super().__init__(space, 1, hidden_dim, inputs, init)

    def forward(self, obs, skill, action):
        q = super().forward(obs, skill, action)
        return q.squeeze(-1)


class Actor(nn.Module):
    """π(a | s, z): a tanh-squashed Gaussian on a tanh trunk, its heads initialised 10x smaller."""
    def __init__(self, space, action_dim, skill_dim, hidden_dim):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        init = nn.init.xavier_uniform_
        trunk = mlp(features + skill_dim, hidden_dim, hidden_dim, nn.Tanh, init)
        self.trunk = trunk[:-1]  # without its last layer
        self.mean = nn.Linear(hidden_dim, action_dim)
        self.log_std = nn.Linear(hidden_dim, action_dim)
        for head in (self.mean, self.log_std):
            nn.init.xavier_normal_(head.weight)
            head.weight.data.mul_(0.1)
            nn.init.zeros_(head.bias)

    def forward(self, obs, skill):
        features = self.encoder(obs)
        features = torch.cat([features, skill], -1)
        h = self.trunk(features)
        log_std = self.log_std(h)
        log_std = log_std.clamp(math.log(1e-6), 2.0)
        return self.mean(h), log_std

    def sample(self, obs, skill):
        """A reparameterized action a = tanh(u) and its log-probability."""
        mean, log_std = self(obs, skill)
        std = log_std.exp()
        normal = torch.distributions.Normal(mean, std, validate_args=False)
        u = normal.rsample()
        action = torch.tanh(u)
        squash = (1 - action.pow(2)).clamp(0, 1)
        squash = torch.log(squash + 1e-6).sum(-1)
        log_prob = normal.log_prob(u).sum(-1) - squash
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
    """METRA epoch by epoch (iod/iod.py: IOD.train): evaluate, checkpoint, collect, update."""
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
    space = train_envs.single_observation_space  # a state vector, or stacked RGB frames
    action_dim = train_envs.single_action_space.shape[0]
    d = args.skill_dim
    contrastive = args.repr_loss == "contrastive"  # the ablations swap their parts in (skip on a first reading)
    dual_constraint = constraint
    metra_c_loss = None
    if args.constraint_norm == "mean": dual_constraint = mean_constraint
    if contrastive: metra_c_loss = functools.partial(metra_c_phi_loss, args=args)
    width = args.hidden_dim
    phi = Phi(space, d, width).to(device)
    qf = nn.ModuleList([QNetwork(space, action_dim, d, width) for _ in range(2)]).to(device)
    qf_target = nn.ModuleList([QNetwork(space, action_dim, d, width) for _ in qf])
    qf_target.load_state_dict(qf.state_dict())  # Q̄ = Q
    qf_target.to(device)
    actor = Actor(space, action_dim, d, width).to(device)
    if args.bf16:
        envs.encoders_in_bf16(phi, qf, qf_target, actor)
    log_alpha = torch.tensor(math.log(args.alpha_init), device=device)
    log_alpha.requires_grad_()
    log_lam = torch.tensor(math.log(args.dual_lam), device=device)  # λ = exp(log λ)
    log_lam.requires_grad_()
    fused = args.cudagraphs and not args.compile  # Adam's on the fast path (compile fuses foreach)
    capturable = args.cudagraphs and use_gpu  # its state on the GPU, for a CUDA graph
    adam = dict(lr=args.lr, fused=fused, foreach=not fused, capturable=capturable)
    phi_optimizer = torch.optim.Adam(phi.parameters(), **adam)
    qf_optimizer = torch.optim.Adam(qf.parameters(), **adam)  # both Qs, on their loss sum
    actor_optimizer = torch.optim.Adam(actor.parameters(), **adam)
    alpha_optimizer = torch.optim.Adam([log_alpha], **adam)
    lam_adam = adam | {"lr": args.dual_lr}  # λ's own learning rate
    lam_optimizer = torch.optim.Adam([log_lam], **lam_adam)
    rng = np.random.default_rng(args.seed)  # the replay draws
    buffer_device = None  # on the host
    if args.buffer_on_device: buffer_device = device
    rb = ReplayBuffer(
        args.buffer_size, spec.horizon, space, spec.frame_stack, action_dim, d, rng, buffer_device)
    learned = dict(  # what a checkpoint saves, under these names
        phi=phi, qf=qf, qf_target=qf_target, actor=actor, buffer=rb,
        log_alpha=log_alpha, log_lam=log_lam, phi_optimizer=phi_optimizer,
        qf_optimizer=qf_optimizer, actor_optimizer=actor_optimizer,
        alpha_optimizer=alpha_optimizer, lam_optimizer=lam_optimizer)
    run, progress = start_run(args, ckpt, learned, train_envs, eval_envs, device)

    def update(obs, action, next_obs, skill):
        """φ and λ (Eq. 5); Q by TD on the new φ's reward (Eq. 6), then Q̄; π; α. Stats stay on the device."""
        alpha = log_alpha.exp().detach()
        w = skill_weights(skill, args.discrete)
        with record_function("phi step"):  # then λ's, on the same c
            dphi = phi.delta(obs, next_obs)
            c = dual_constraint(dphi, args.dual_slack)
            phi_loss = metra_phi_loss(dphi, w, log_lam, c)
            if contrastive: phi_loss, logsumexp = metra_c_loss(dphi, w)
            optimize(phi_optimizer, phi_loss)
            lam_loss = dual_loss(log_lam, c)
            if not contrastive: optimize(lam_optimizer, lam_loss)
        with record_function("qf step"):  # on r from the updated φ, then Q̄ ← (1 - τ) Q̄ + τ Q
            with torch.no_grad():
                reward = intrinsic_reward(phi.delta(obs, next_obs), w)
            qf_loss = qf_objective(
                qf, qf_target, actor, reward, obs, action, next_obs, skill, alpha, args.gamma)
            optimize(qf_optimizer, qf_loss)
            with torch.no_grad():
                targets = list(qf_target.parameters())
                torch._foreach_lerp_(targets, list(qf.parameters()), args.tau)
        with record_function("actor step"):
            actor_loss, log_prob = actor_objective(actor, qf, obs, skill, alpha)
            optimize(actor_optimizer, actor_loss)
        with record_function("alpha step"):  # α stays fixed on Kitchen
            alpha_loss = temperature_loss(log_alpha, log_prob.detach(), -action_dim / 2)
            if args.env_id not in FIXED_ALPHA_ENVS: optimize(alpha_optimizer, alpha_loss)
        dual_stats = {"lambda_loss": lam_loss, "lambda": log_lam.exp()}
        if contrastive: dual_stats = {"logsumexp": logsumexp}
        stats = dict(phi_loss=phi_loss, qf_loss=qf_loss, actor_loss=actor_loss,
                     alpha_loss=alpha_loss, reward=reward.mean(), batch_constraint=c.mean(),
                     alpha=alpha, **dual_stats)
        return {name: value.detach() for name, value in stats.items()}
    update = fast_path(update, actor, run, args, device)  # --compile, --cudagraphs
    start_epoch = progress["epoch"]
    for epoch in range(start_epoch, num_epochs + 1):
        epoch_start = time.time()
        progress["epoch"] = epoch
        last = epoch == num_epochs  # evaluate and checkpoint the epochs so far (a resumed run skips both at its first)
        if (epoch % args.eval_every == 0 or last) and not (ckpt and epoch == start_epoch):
            evaluate(run, progress, args, learned, dual_constraint, device)
        if (epoch % args.checkpoint_every == 0 or last) and epoch != start_epoch:
            save_checkpoint(run, progress, args, learned, device)
        if last:
            break
        collect_start = time.time()
        skills = sample_skills(args.num_envs, d, args.discrete).to(device)  # a trajectory per env and skill
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
        observations = np.stack(observations, 1)
        actions = np.stack(actions, 1)
        rb.add(observations, actions, skills)
        train_start = time.time()
        step_stats = []
        if rb.size >= args.learning_starts:  # gradient steps, once that many transitions are stored
            for _ in range(args.grad_steps_per_epoch):
                with record_function("sampling"):
                    batch = rb.sample(args.batch_size, device)
                step_stats.append(update(**batch))
        progress["grad_steps"] += len(step_stats)
        log_epoch(run, progress, args, step_stats, epoch_start, collect_start, train_start)  # or a NaN loss ends it
    train_envs.close()
    eval_envs.close()
    run.writer.close()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as before the run
    print(f"done: {run.dir}")


# ABLATIONS: METRA-C (§6.3, --repr-loss contrastive), the original METRA's --constraint-norm mean. A second reading.
def metra_c_phi_loss(dphi, skill, args):
    """--repr-loss contrastive: L(φ) = -E[Δφᵀz] + ξ E[log Σ_j exp Δφᵀz'_j] (Eq. 10), z'_j ~ p(z); and the mean lse."""
    negatives = sample_skills(args.num_negatives, args.skill_dim, device=dphi.device)
    logsumexp = torch.logsumexp(dphi @ negatives.T, dim=-1)
    loss = -((dphi * skill).sum(-1) - args.xi * logsumexp).mean()
    return loss, logsumexp.mean()


def mean_constraint(dphi, eps):
    """--constraint-norm mean: c = min(1 - ‖Δφ‖²/d, ε), ‖Δφ‖² averaged over the dimensions (the original METRA)."""
    return torch.clamp(1 - dphi.pow(2).mean(-1), max=eps)


# INFRASTRUCTURE: replay buffer, command line, start-up, fast path, checkpoints, evaluation, logs. A second reading.
class ReplayBuffer:
    """A ring of whole trajectories (path_buffer_ex.py), each frame once; on the host, or on `device` (drawn there)."""
    def __init__(self, capacity, horizon, space, frame_stack, action_dim, skill_dim, rng, device=None):
        n = capacity // horizon  # trajectories
        frame_shape = (*space.shape[:-1], space.shape[-1] // frame_stack)
        dtype = getattr(torch, space.dtype.name)  # uint8 frames, or float32 states
        self.frames = torch.empty(n, horizon + 1, *frame_shape, dtype=dtype, device=device)
        self.actions = torch.empty(n, horizon, action_dim, device=device)
        self.skills = torch.empty(n, skill_dim, device=device)
        self.horizon = horizon
        self.frame_stack = frame_stack
        self.rng = rng
        self.on_device = device is not None
        self.added = 0  # trajectories, ever

    @property
    def size(self):  # stored transitions
        return min(self.added, len(self.skills)) * self.horizon

    def add(self, observations, actions, skills):
        """Whole trajectories: observations (n, horizon + 1, ...), actions (n, horizon, |A|), skills (n, d)."""
        slots = torch.arange(self.added, self.added + len(skills)) % len(self.skills)
        newest_frames = observations[..., -self.frames.shape[-1]:]
        self.frames[slots] = torch.as_tensor(newest_frames).to(self.frames)
        self.actions[slots] = torch.as_tensor(actions).to(self.actions)
        self.skills[slots] = torch.as_tensor(skills).to(self.skills)
        self.added += len(skills)

    def sample(self, batch_size, device, rng=None):
        """s, a, s', z drawn with replacement, on `device` (pinned, not waiting); `rng`: numpy's, on either storage."""
        if rng is None and self.on_device:
            i = torch.randint(0, self.size, (batch_size,), device=device)
        else:
            i = (rng or self.rng).integers(0, self.size, batch_size)
            i = torch.as_tensor(i, device=self.frames.device)
        trajectory = i // self.horizon
        t = i % self.horizon
        steps = t[:, None] + torch.arange(1 - self.frame_stack, 2, device=i.device)  # frames t-k+1 .. t+1
        frames = self.frames[trajectory[:, None], steps.clip(min=0)]  # the first repeated before t = 0
        batch = {"frames": frames, "action": self.actions[trajectory, t], "skill": self.skills[trajectory]}
        if torch.device(device).type == "cuda" and not self.on_device:
            batch = {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
        frames = batch.pop("frames")  # s and s' stacked as the envs stack them
        batch["obs"] = frames[:, :-1].movedim(1, -2).flatten(-2).contiguous()
        batch["next_obs"] = frames[:, 1:].movedim(1, -2).flatten(-2).contiguous()
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
    **dict.fromkeys("skill_dim total_env_steps num_envs batch_size buffer_size hidden_dim eval_every "
                    "checkpoint_every num_eval_skills num_negatives".split(), "[1, inf)"),
    **dict.fromkeys("grad_steps_per_epoch learning_starts dual_slack xi".split(), "[0, inf)"),
    **dict.fromkeys("dual_lam dual_lr lr alpha_init".split(), "(0, inf)"),
    "seed": "[0, 2147483647]", "gamma": "[0, 1)", "tau": "(0, 1]",
}
# flags --resume may change, none changing the problem (the device, --buffer-on-device, --compile, --bf16: the numbers)
RESUME_MAY_CHANGE = ("total_env_steps eval_every checkpoint_every resume cuda parallel_envs buffer_on_device "
                     "cudagraphs compile bf16 track wandb_project_name wandb_entity capture_video "
                     "save_repr_stats").split()


def parse_args(argv=None):
    """The flags, unset ones the world's; with --resume, the run's own. A bad flag, or too little memory: one line."""
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
            given = getattr(args, flag)
            if flag not in RESUME_MAY_CHANGE and given != trained:
                error(f"{args.resume} was trained with --{flag.replace('_', '-')} {trained}, not {given}")
    if args.discrete not in (None, args.env_id in DISCRETE_ENVS) and args.skill_dim is None:
        error(f"the paper has no {'one-hot' if args.discrete else 'unit-sphere'} METRA skills on "
              f"{args.env_id}; give --skill-dim too")
    for flag, value in env_defaults(args.env_id).items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    if args.checkpoint_every is None:
        args.checkpoint_every = args.eval_every
    for flag, interval in FLAG_RANGES.items():
        value = getattr(args, flag)
        low, high = interval[1:-1].split(", ")
        above = value >= float(low) if interval[0] == "[" else value > float(low)  # False for NaN
        below = value <= float(high) if interval[-1] == "]" else value < float(high)
        if not (above and below):
            error(f"--{flag.replace('_', '-')} must be in {interval}, got {value}")
    if args.discrete and args.skill_dim < 2:
        error(f"one-hot skills need --skill-dim K >= 2, got {args.skill_dim}")
    if args.discrete and args.repr_loss == "contrastive":
        error("--repr-loss contrastive needs unit-sphere skills; add --discrete False --skill-dim D")
    horizon = envs.ENV_SPECS[args.env_id].horizon
    epoch = args.num_envs * horizon  # the env steps of one epoch
    if args.buffer_size < epoch:
        error(f"--buffer-size must hold one epoch (--num-envs × {horizon} = {epoch} transitions), "
              f"got {args.buffer_size}")
    if args.total_env_steps < epoch:
        error(f"--total-env-steps must cover one epoch (--num-envs × {horizon} = {epoch} "
              f"env steps), got {args.total_env_steps}")
    stored = min(args.total_env_steps // epoch * epoch, args.buffer_size // horizon * horizon)
    if args.grad_steps_per_epoch and args.learning_starts > stored:
        error(f"--learning-starts must be at most --total-env-steps and --buffer-size in whole "
              f"epochs and trajectories ({stored}), or the run never learns; got {args.learning_starts}")
    if ckpt and args.total_env_steps // epoch <= ckpt["epoch"]:
        error(f"{args.resume} has already trained for {ckpt['epoch'] * epoch} env steps; "
              "give a larger --total-env-steps to continue it")
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
    defaults = {"skill_dim": SKILL_DIMS[env_id], "discrete": env_id in DISCRETE_ENVS}
    for flag in "total_env_steps num_envs grad_steps_per_epoch buffer_size eval_every".split():
        defaults[flag] = getattr(spec, flag)
    return defaults


def start_run(args, ckpt, learned, train_envs, eval_envs, device):
    """The run's folder, logs, evaluation streams, and progress: a new run's, or with --resume the checkpoint's."""
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
    # TensorBoard writes from a thread: a failed write raises at the next add_scalar, not in the thread
    threading.excepthook = lambda hook: None if issubclass(hook.exc_type, OSError) else threading.__excepthook__(hook)
    writer = SummaryWriter(folder)
    table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    resolved = [*env_defaults(args.env_id), "checkpoint_every"]
    flags = ", ".join(f"--{flag.replace('_', '-')} {getattr(args, flag)}" for flag in resolved)
    source = "the run's own, but for those given anew" if ckpt else "a flag left unset takes the world's value"
    print(f"{args.env_id} (horizon {envs.ENV_SPECS[args.env_id].horizon}): {flags} ({source})")
    train_envs.run_dir = eval_envs.run_dir = folder  # a dead env worker's line names the checkpoint
    run = types.SimpleNamespace(name=name, dir=folder, writer=writer, train_envs=train_envs,
                                eval_envs=eval_envs)
    run.eval_rng = np.random.default_rng(args.seed + 1)  # E‖Δφ‖²'s replay draws
    run.eval_generator = torch.Generator().manual_seed(args.seed + 1)  # the evaluation's skills
    if ckpt:
        return run, resume(ckpt, run, args, learned, device)
    progress = {"epoch": 0, "grad_steps": 0, "wall_time": 0.0, "timing": {}}
    return run, {**progress, "since_eval": [], "evals": []}


def check_memory(args, space, action_dim):
    """Refuses, before anything is allocated, a run whose buffer, networks and batch do not fit where they go."""
    spec = envs.ENV_SPECS[args.env_id]
    use_gpu = torch.cuda.is_available() and args.cuda
    frame_bytes = math.prod(space.shape) // spec.frame_stack * space.dtype.itemsize
    step_bytes = frame_bytes + 4 * action_dim  # and a last frame, and the skill, per trajectory
    trajectory_bytes = spec.horizon * step_bytes + frame_bytes + 4 * args.skill_dim
    buffer = {"the replay buffer (--buffer-size)": args.buffer_size // spec.horizon * trajectory_bytes}
    batch_floats = 2 * math.prod(space.shape) + 8 * args.hidden_dim
    training = {"the networks (--hidden-dim)": 72 * args.hidden_dim**2,  # 18 square layers' worth of float32
                "one batch (--batch-size)": 4 * args.batch_size * batch_floats}
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
        print("--cudagraphs: CUDA graphs need a GPU; on the CPU the gradient step runs without them (Adam fused)")
    elif args.cudagraphs:
        update = CudaGraphStep(update)
        run.policy = CudaGraphStep(run.policy)
        run.eval_policy = CudaGraphStep(run.eval_policy)
    return update


class CudaGraphStep:
    """A step (or the actions): 3 warm-up calls, one recorded as a CUDA graph, then replays, each batch copied in."""
    def __init__(self, step):
        self.step, self.calls = step, 0

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
        if torch.is_tensor(thing):  # log α, log λ
            state[name] = thing.detach().cpu()
        else:
            state[name] = thing.state_dict()
    state["rngs"] = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else [],
        "eval_numpy": run.eval_rng.bit_generator.state,
        "eval_torch": run.eval_generator.get_state(),
        "envs": envs.env_rng_states(run.train_envs) + envs.env_rng_states(run.eval_envs),
    }
    path = os.path.join(run.dir, "checkpoint.pt")
    write_atomically(path, lambda tmp: torch.save(state, tmp), run.dir)


def resume(ckpt, run, args, learned, device):
    """The checkpoint's state and progress, its evaluations back in eval.jsonl; a state that does not fit: one line."""
    for name, thing in learned.items():
        if name not in ckpt:
            error(f"{args.resume} was written by another version of {AGENT}.py: it has no {name}")
        try:
            if isinstance(thing, torch.optim.Optimizer):  # with this run's options (fused, capturable)
                for group in ckpt[name]["param_groups"]:
                    group.update(thing.defaults)
            if torch.is_tensor(thing):  # log α, log λ
                thing.data.copy_(ckpt[name])
            else:
                thing.load_state_dict(ckpt[name])
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            detail = " ".join(str(e).split())[:160]
            error(f"{args.resume}'s {name} does not fit this {AGENT}.py ({detail})")
    try:
        rngs = ckpt["rngs"]
        torch.set_rng_state(rngs["torch"])
        torch.cuda.set_rng_state_all(rngs["cuda"][:torch.cuda.device_count()])  # on maybe fewer GPUs
        run.eval_rng.bit_generator.state = rngs["eval_numpy"]
        run.eval_generator.set_state(rngs["eval_torch"])
        envs.set_env_rng_states(run.train_envs, rngs["envs"][:args.num_envs])
        envs.set_env_rng_states(run.eval_envs, rngs["envs"][args.num_envs:])
        names = ["epoch", "grad_steps", "wall_time", "since_eval", "evals", "timing"]
        progress = {name: ckpt[name] for name in names}
    except (KeyError, RuntimeError, ValueError, TypeError) as e:
        detail = " ".join(str(e).split())[:160]
        error(f"{args.resume} was written by another version of {AGENT}.py ({detail})")
    write_log(run, progress["evals"])  # without what was logged after the checkpoint
    print(f"resumed {ckpt['run_name']} at epoch {ckpt['epoch']}")
    return progress


def write_log(run, evals):  # eval.jsonl: a line per evaluation
    text = "".join(json.dumps(result) + "\n" for result in evals)
    path = os.path.join(run.dir, "eval.jsonl")
    write_atomically(path, lambda tmp: pathlib.Path(tmp).write_text(text), run.dir)


@torch.no_grad()
@record_function("evaluation")
def evaluate(run, progress, args, learned, dual_constraint, device):
    """Rollouts of skills' modes (iod/metra.py: _evaluate_policy); E‖Δφ‖² and mean c on replay; λ; the stats' means."""
    epoch = progress["epoch"]
    spec = envs.ENV_SPECS[args.env_id]
    env_steps = epoch * args.num_envs * spec.horizon
    videos = run.eval_envs.video_envs
    skills = eval_skills(args.num_eval_skills, args.skill_dim, args.discrete, run.eval_generator).to(device)
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
    coverage = envs.coverage(paths, args.env_id)
    result = dict(epoch=epoch, env_steps=env_steps, grad_steps=progress["grad_steps"],
                  wall_time=round(progress["wall_time"], 2), coverage=coverage)
    rb = learned["buffer"]
    if rb.size > 0:  # on up to 10k replay transitions, 1000 at a time
        n = min(10_000, rb.size)
        dphi, skill = [], []
        for start in range(0, n, 1000):
            batch = rb.sample(min(1000, n - start), device, rng=run.eval_rng)
            dphi.append(learned["phi"].delta(batch["obs"], batch["next_obs"]))
            skill.append(batch["skill"])
        dphi, skill = torch.cat(dphi), torch.cat(skill)
        result["dphi_sq"] = dphi.pow(2).sum(-1).mean().item()
        result["constraint"] = dual_constraint(dphi, args.dual_slack).mean().item()
        if args.save_repr_stats:  # Δφ and w in float64, for benchmarks/metra_repr_stats.py (Figure 2, §6.2)
            weights = skill_weights(skill, args.discrete)
            stats = dict(dphi=dphi.cpu().double().numpy(), z=weights.cpu().double().numpy(),
                         skill=skill.cpu().numpy(), discrete=args.discrete, env_id=args.env_id,
                         env_steps=env_steps, repr_loss=args.repr_loss, constraint_norm=args.constraint_norm)
            path = f"{run.dir}/repr_stats_{env_steps:010d}.npz"
            write_atomically(path, lambda tmp: np.savez_compressed(tmp, **stats), run.dir)
    since_eval = progress["since_eval"]  # each epoch's means of the stats
    if since_eval:
        per_epoch = torch.stack([torch.stack(list(means.values())) for means in since_eval])
        result.update(zip(since_eval[0], per_epoch.mean(0).tolist()))
    since_eval.clear()
    result.update(progress["timing"])
    if args.repr_loss == "dual": result["lambda"] = learned["log_lam"].exp().item()  # now, not a mean
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    for name in result.keys() & {"coverage", "dphi_sq", "constraint", "lambda"}:
        run.writer.add_scalar(f"eval/{name}", result[name], env_steps)
    z = skills.cpu().numpy()  # a path's colour: the one-hot skill's index, the angle of (z_0, z_1), or z's sign
    angle = np.pi * (z[:, 0] > 0)
    if args.skill_dim > 1:
        angle = np.arctan2(z[:, 1], z[:, 0])
    hue = (angle + np.pi) / (2 * np.pi)
    if args.discrete: hue = z.argmax(-1) / args.skill_dim
    fig, ax = plt.subplots(figsize=(5, 5))
    envs.draw_coordinates(ax, paths, plt.cm.hsv(hue), args.env_id)
    ax.set_title(f"METRA{'-C' * (args.repr_loss == 'contrastive')} {args.env_id}, "
                 f"{env_steps:,} env steps, coverage {coverage}")
    fig.tight_layout()
    plot = f"{run.dir}/skills_{env_steps:010d}.png"
    write_atomically(plot, lambda tmp: fig.savefig(tmp, dpi=100), run.dir)
    plt.close(fig)
    if videos:
        import imageio
        os.makedirs(f"{run.dir}/videos", exist_ok=True)
        video = f"{run.dir}/videos/skills_{env_steps:010d}.mp4"
        write_atomically(video, lambda tmp: imageio.mimsave(tmp, frames, fps=20), run.dir)
    progress["evals"].append(result)
    write_log(run, progress["evals"])
    figures = "".join(f" | {k} {v:.4g}" for k, v in list(result.items())[5:-1])
    print(f"eval  epoch {epoch} | env steps {env_steps:,} | coverage {coverage}{figures}")


def eval_skills(n, skill_dim, discrete, generator):
    """Fresh prior draws, or the K one-hots in turn, n // K times each (the lowest indices once more), sorted."""
    if discrete:
        index = (torch.arange(n) % skill_dim).sort().values
        return F.one_hot(index, skill_dim).float()
    return sample_skills(n, skill_dim, generator=generator)


def log_epoch(run, progress, args, step_stats, epoch_start, collect_start, train_start):
    """The epoch's times; a NaN or inf *_loss ends the run; else its stats go to TensorBoard and the next evaluation."""
    epoch = progress["epoch"]
    steps_per_epoch = args.num_envs * envs.ENV_SPECS[args.env_id].horizon
    env_steps = (epoch + 1) * steps_per_epoch
    progress["wall_time"] += time.time() - epoch_start
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
        print(f"epoch {epoch + 1} | env steps {env_steps:,} | SPS {int(sps)} | {left} left{figures}")


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
        checkpoint = os.path.join(run_dir, "checkpoint.pt")
        hint = f"resume with --resume {checkpoint}" if os.path.isfile(checkpoint) else "no checkpoint was written yet"
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
    sys.stdout.reconfigure(line_buffering=True)  # every line as it happens, also into a file
    args, ckpt = parse_args()
    try:
        main(args, ckpt)
    except (envs.RenderUnavailable, envs.WorkerDied, MemoryError) as e:  # no render, a dead env worker, no memory
        error(e, getattr(e, "run_dir", None))
    except OSError as e:  # the run's folder or TensorBoard's file
        where = os.fsdecode(e.filename) if e.filename else "the TensorBoard log"
        error(f"cannot write {where} ({e.strerror or e})")
