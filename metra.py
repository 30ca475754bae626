"""METRA (Park, Rybkin and Levine, ICLR 2024) in one file, as analysed in "Can a MISL Fly? Analysis and Ingredients
for Mutual Information Skill Learning" (Zheng, Tuyls, Peng and Eysenbach, ICLR 2025), §3 and §4.

A skill z ~ p(z) = Unif(S^{d-1}) (one-hot among K on HalfCheetah, Kitchen) is held for a trajectory of π(a | s, z).
φ(s) ∈ R^d learns moves Δφ = φ(s') - φ(s) along z; one dual variable λ ≥ 0 constrains ‖Δφ‖² ≤ 1 (Eq. 5, slack ε):
    max_φ min_λ  E[Δφᵀz] + λ E[min(1 - ‖Δφ‖², ε)],
in expectation only (Eq. 7; Prop. 1: E‖Δφ‖² = 1 at the optimum), a quadratic approximation of the contrastive lower
bound's negative term (Eq. 8; Prop. 2). π is SAC on r(s, s', z) = Δφᵀz (Eq. 6), with twin Qs and automatic α.
`python metra.py --hidden-dim 256 --total-env-steps 3000000` trains on Ant for about an hour on a CPU.

Deliberate differences from the official code (github.com/Princeton-RL/contrastive-successor-features, iod/metra.py):
‖Δφ‖² is summed over dimensions, as there (original METRA: the mean, --constraint-norm mean); time limits are never
terminal; left out: its never-updated target φ, φ's std head, stored rewards; torch draws the one-hot z; METRA-C
(--repr-loss contrastive) draws fresh unit-sphere negatives (CSF's --sample_new_z 1), so no one-hot z. Added: the
last epoch is evaluated and checkpointed; evaluations after the first (an empty buffer) report E‖Δφ‖² and the mean
constraint on min(10k, stored) replay transitions drawn with replacement; --buffer-size is rounded down to whole
trajectories; checkpoints hold the stats since the last evaluation. Pixels: frames are stored once (3.7 GB, not 22
GB, at 300k transitions); envs.py seeds each env differently. On a GPU, float32 matmuls use TF32.
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

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from matplotlib import colormaps
from matplotlib.figure import Figure
from torch.profiler import record_function
from torch.utils.tensorboard import SummaryWriter

import envs

AGENT = "metra"
SKILL_DIMS = {"Ant": 2, "HalfCheetah": 16, "Quadruped": 4, "Humanoid": 2, "Kitchen": 24, "Robobin": 9}  # App. B.3
DISCRETE_ENVS = ("HalfCheetah", "Kitchen")  # one-hot, officially
FIXED_ALPHA_ENVS = ("Kitchen",)  # α stays 0.01, officially


@dataclass
class Args:
    env_id: Literal["Ant", "HalfCheetah", "Quadruped", "Humanoid", "Kitchen", "Robobin"] = "Ant"  # The world.
    skill_dim: Optional[int] = None  # Dimension d of z, or K one-hot skills (unset: the paper's).
    discrete: Optional[bool] = None  # One-hot skills (unset: on HalfCheetah and Kitchen).
    seed: int = 1  # Seed of torch, numpy and the envs.
    total_env_steps: Optional[int] = None  # Training env steps (unset: the paper's).
    num_envs: Optional[int] = None  # Trajectories per epoch, one skill each (unset: the paper's).
    grad_steps_per_epoch: Optional[int] = None  # Gradient steps per epoch (unset: the paper's).
    learning_starts: int = 10_000  # Transitions stored before the first gradient step.
    batch_size: int = 256  # Transitions per minibatch.
    buffer_size: Optional[int] = None  # Replay capacity in transitions (unset: the paper's).
    hidden_dim: int = 1024  # Width of the hidden layers of φ, Q and π.
    eval_every: Optional[int] = None  # Epochs between evaluations (unset: the paper's).
    checkpoint_every: Optional[int] = None  # Epochs between checkpoints (unset: --eval-every).
    resume: Optional[str] = None  # A checkpoint.pt to continue.
    cuda: bool = True  # Use the GPU when torch sees one.
    parallel_envs: bool = True  # Step the envs in worker processes (the same numbers).
    buffer_on_device: bool = False  # Keep the replay buffer on the training device.
    track: bool = False  # Also log to Weights & Biases.
    wandb_project_name: str = "cleanmisl"  # The W&B project.
    wandb_entity: Optional[str] = None  # The W&B team.
    capture_video: bool = False  # Write a video of up to four rollouts at each evaluation.
    num_eval_skills: int = 48  # Rollouts per evaluation: fresh skills, or the K one-hots equally.
    save_repr_stats: bool = False  # Save replay transitions' Δφ at each evaluation.
    repr_loss: Literal["dual", "contrastive"] = "dual"  # METRA's φ loss, or METRA-C's contrastive bound.
    constraint_norm: Literal["sum", "mean"] = "sum"  # Sum ‖Δφ‖² over dimensions (the paper's), or average.
    dual_lam: float = 30.0  # The initial λ.
    dual_slack: float = 1e-3  # The slack ε of the constraint term min(1 - ‖Δφ‖², ε).
    dual_lr: float = 1e-4  # The Adam learning rate of log λ.
    xi: float = 5.0  # METRA-C's weight ξ of the log-sum-exp.
    num_negatives: int = 256  # METRA-C's prior draws z'_j per gradient step.
    gamma: float = 0.99  # The discount.
    tau: float = 0.005  # The Polyak step of the target Qs.
    lr: float = 1e-4  # The Adam learning rate of φ, Q, π and log α.
    alpha_init: float = 0.01  # The initial entropy temperature α (Kitchen: fixed).
    compile: bool = False  # Torch.compile the whole gradient step (on a CPU, the same numbers up to rounding).
    bf16: bool = False  # On pixels, run the encoders' convolutions in bfloat16.
    cudagraphs: bool = False  # On a GPU, replay the whole gradient step as one CUDA graph.


# Every numeric flag and the values that mean something ("[" closed end, "(" open end); NaN is never inside.
FLAG_RANGES = {flag: interval for interval, flags in {
    "[1, inf)": "skill_dim total_env_steps num_envs batch_size buffer_size hidden_dim eval_every checkpoint_every "
                "num_eval_skills num_negatives", "[0, inf)": "grad_steps_per_epoch learning_starts dual_slack xi",
    "(0, inf)": "dual_lam dual_lr lr alpha_init", "[0, 1)": "gamma", "(0, 1]": "tau", "[0, 2147483647]": "seed",
}.items() for flag in flags.split()}
# What --resume may change: not the problem learned (the device may change the draws).
RESUME_MAY_CHANGE = ("total_env_steps eval_every checkpoint_every resume cuda parallel_envs buffer_on_device track "
                     "wandb_project_name wandb_entity capture_video save_repr_stats compile cudagraphs bf16").split()


def sample_skills(n, skill_dim, discrete=False, generator=None, device=None):
    """z ~ p(z): a normal draw scaled to unit length, or a uniform one-hot."""
    if discrete:
        return F.one_hot(torch.randint(skill_dim, (n,), generator=generator, device=device), skill_dim).float()
    z = torch.randn(n, skill_dim, generator=generator, device=device)
    return z / z.norm(dim=-1, keepdim=True)


def skill_weights(skill, discrete):
    """The w of r = Δφᵀw: z, or for a one-hot z, (z - 1/K)·K/(K-1), as officially."""
    k = skill.shape[-1]
    return (skill - 1 / k) * k / (k - 1) if discrete else skill


def intrinsic_reward(dphi, weights):
    """r = (φ(s') - φ(s))ᵀw per sample (Eq. 6)."""
    return (dphi * weights).sum(-1)


def constraint(dphi, eps, norm="sum"):
    """c = min(1 - ‖Δφ‖², ε) per sample, ‖Δφ‖² summed or (norm="mean") averaged over dimensions."""
    return torch.clamp(1 - (dphi.pow(2).sum(-1) if norm == "sum" else dphi.pow(2).mean(-1)), max=eps)


def metra_phi_loss(dphi, weights, log_lam, eps, norm="sum"):
    """L(φ) = -E[Δφᵀw + λ min(1 - ‖Δφ‖², ε)], λ = exp(log λ) detached (Eq. 5); and c per sample."""
    c = constraint(dphi, eps, norm)
    return -(intrinsic_reward(dphi, weights) + log_lam.exp().detach() * c).mean(), c


def dual_loss(log_lam, c):
    """L(λ) = log λ · E[c], c detached: λ falls while c > 0, rises while c < 0 (Eq. 5's min over λ)."""
    return log_lam * c.detach().mean()


def critic_target(reward, next_q, next_log_prob, alpha, gamma):
    """y = r + γ (min_k Q̄_k(s', a', z) - α log π(a'|s', z)), a' ~ π(·|s', z), never terminal. next_q: (critics, B)."""
    return reward + gamma * (next_q.amin(0) - alpha * next_log_prob)


def critic_loss(q, target):
    """Σ_k 0.5 E[(Q_k(s, a, z) - y)²] over the twin critics. q: (critics, B)."""
    return sum(0.5 * F.mse_loss(q_k, target) for q_k in q)


def actor_loss(log_prob, q, alpha):
    """L(π) = E[α log π(a|s, z) - min_k Q_k(s, a, z)], a ~ π(·|s, z) reparameterized. q: (critics, B)."""
    return (alpha * log_prob - q.amin(0)).mean()


def temperature_loss(log_alpha, log_prob, target_entropy):
    """L(α) = -E[log α (log π(a|s, z) + H̄)], H̄ = -|A|/2 as officially."""
    return -(log_alpha * (log_prob + target_entropy)).mean()


def mlp(in_dim, hidden_dim, out_dim, activation, init):  # Linear → act → Linear → act → Linear, zero biases
    net = nn.Sequential(nn.Linear(in_dim, hidden_dim), activation(), nn.Linear(hidden_dim, hidden_dim),
                        activation(), nn.Linear(hidden_dim, out_dim))
    for layer in net[::2]:
        init(layer.weight)
        nn.init.zeros_(layer.bias)
    return net


class Phi(nn.Module):
    """φ(s) ∈ R^d (ReLU, Xavier-uniform) on its own pixel encoder's features, as officially."""

    def __init__(self, space, out_dim, hidden_dim, in_dim=0, init=nn.init.xavier_uniform_):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        self.net = mlp(features + in_dim, hidden_dim, out_dim, nn.ReLU, init)

    def forward(self, obs):
        return self.net(self.encoder(obs))


class QNetwork(Phi):
    """Q(s, a, z) ∈ R: φ's network on features(s) ⊕ z ⊕ a (Xavier-normal, made in `main`)."""

    def forward(self, obs, skill, action):
        return self.net(torch.cat([self.encoder(obs), skill, action], -1)).squeeze(-1)


class Actor(nn.Module):
    """π(a | s, z): a tanh-squashed Gaussian on a tanh trunk, output layers initialised 10x smaller."""

    def __init__(self, space, action_dim, skill_dim, hidden_dim):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        self.trunk = mlp(features + skill_dim, hidden_dim, hidden_dim, nn.Tanh, nn.init.xavier_uniform_)[:-1]
        self.mean, self.log_std = nn.Linear(hidden_dim, action_dim), nn.Linear(hidden_dim, action_dim)
        for head in (self.mean, self.log_std):
            nn.init.xavier_normal_(head.weight).data.mul_(0.1)
            nn.init.zeros_(head.bias)

    def forward(self, obs, skill):
        h = self.trunk(torch.cat([self.encoder(obs), skill], -1))
        return self.mean(h), self.log_std(h).clamp(math.log(1e-6), 2.0)

    def sample(self, obs, skill):  # a ~ π and log π(a|s, z)
        mean, log_std = self(obs, skill)
        normal = torch.distributions.Normal(mean, log_std.exp(), validate_args=False)
        action = torch.tanh(u := normal.rsample())
        return action, normal.log_prob(u).sum(-1) - torch.log((1 - action.pow(2)).clamp(0, 1) + 1e-6).sum(-1)

    def mode(self, obs, skill):
        return torch.tanh(self(obs, skill)[0])


@contextlib.contextmanager
def frozen(modules):  # no gradient into them, only through
    for module in modules:
        module.requires_grad_(False)
    yield
    for module in modules:
        module.requires_grad_(True)


def gradient_step(optimizer, loss):
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


class ReplayBuffer:
    """Whole trajectories, each frame stored once; uniform draws of (s, a, s', z); in numpy, or torch on `device`."""

    def __init__(self, capacity, horizon, space, frame_stack, action_dim, skill_dim, rng, device=None):
        n = capacity // horizon
        self.horizon, self.rng, self.device, self.pos, self.num_stored = horizon, rng, device, 0, 0
        self.frames = self.zeros((n, horizon + 1, *space.shape[:-1], space.shape[-1] // frame_stack), space.dtype)
        self.actions, self.skills = self.zeros((n, horizon, action_dim)), self.zeros((n, skill_dim))
        self.frame_offsets = self.to_storage(np.arange(1 - frame_stack, 2))
        self.generator = None if device is None else torch.Generator(device).manual_seed(int(rng.integers(2**62)))

    def zeros(self, shape, dtype="float32"):
        return np.zeros(shape, dtype) if self.device is None else torch.zeros(
            shape, dtype=getattr(torch, np.dtype(dtype).name), device=self.device)

    def to_storage(self, array, to=None):
        return array if self.device is None else torch.as_tensor(array, dtype=getattr(to, "dtype", None),
                                                                 device=self.device)

    size = property(lambda self: self.num_stored * self.horizon)  # stored transitions

    def add(self, observations, actions, skills):  # (n, horizon + 1, ...), (n, horizon, |A|), (n, d)
        n, capacity = len(observations), len(self.frames)
        idx = self.to_storage((self.pos + np.arange(n)) % capacity)
        self.frames[idx] = self.to_storage(observations[..., -self.frames.shape[-1]:], self.frames)  # newest frames
        self.actions[idx] = self.to_storage(actions, self.actions)
        self.skills[idx] = self.to_storage(skills, self.skills)
        self.pos, self.num_stored = (self.pos + n) % capacity, min(self.num_stored + n, capacity)

    def gather(self, batch_size, rng=None):  # frames of s and s'; `rng`: on the host
        if self.device is None or rng is not None:
            i = self.to_storage((rng or self.rng).integers(0, self.size, batch_size))
        else:
            i = torch.randint(0, self.size, (batch_size,), generator=self.generator, device=self.device)
        trajectory, t = i // self.horizon, i % self.horizon
        steps = (t[:, None] + self.frame_offsets).clip(min=0)  # frames t-k+1..t+1, the first repeated before t = 0
        return {"frames": self.frames[trajectory[:, None], steps], "action": self.actions[trajectory, t],
                "skill": self.skills[trajectory]}

    def sample(self, batch_size, device, rng=None):  # on `device`, stacked there
        batch = self.gather(batch_size, rng)
        if self.device is None:
            batch = {k: torch.from_numpy(v) for k, v in batch.items()}
            if torch.device(device).type == "cuda":
                batch = {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
        frames = batch.pop("frames")  # (B, k + 1, ...): s is 0..k-1, s' 1..k
        return {"obs": frames[:, :-1].movedim(1, -2).flatten(-2).contiguous(),
                "next_obs": frames[:, 1:].movedim(1, -2).flatten(-2).contiguous(), **batch}

    def state_dict(self):  # tensors: torch.save copies them less
        n = self.num_stored
        arrays = {name: torch.as_tensor(getattr(self, name)[:n]).cpu() for name in ("frames", "actions", "skills")}
        return {"pos": self.pos, "num_stored": n, **arrays, "generator": self.generator and self.generator.get_state()}

    def load_state_dict(self, state):
        self.pos, self.num_stored = state["pos"], state["num_stored"]
        for name in ("frames", "actions", "skills"):
            getattr(self, name)[:self.num_stored] = state[name] if self.device is None else state[name].to(self.device)
        if self.generator is not None and state.get("generator") is not None:
            self.generator.set_state(state["generator"])


def main(args, ckpt=None):
    """Epoch by epoch (iod/iod.py): evaluate, collect a trajectory per env, train; checkpoint, log, stop at a NaN."""
    spec, d, contrastive = envs.ENV_SPECS[args.env_id], args.skill_dim, args.repr_loss == "contrastive"  # METRA-C
    steps_per_epoch = args.num_envs * spec.horizon
    num_epochs = args.total_env_steps // steps_per_epoch
    run_name, run_dir, ckpt_path, writer = start_run(args, ckpt)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng, eval_rng = np.random.default_rng(args.seed), np.random.default_rng(args.seed + 1)
    eval_generator = torch.Generator().manual_seed(args.seed + 1)  # evaluation's own streams
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    torch.set_float32_matmul_precision("high" if device.type == "cuda" else "highest")
    num_video_envs = 4 if args.capture_video else 0  # the first evaluation envs
    try:
        train_envs, eval_envs = envs.make_envs(functools.partial(envs.make_env, args.env_id), args.num_envs,
                                               args.num_eval_skills, args.seed, num_video_envs, args.parallel_envs)
    except (envs.RenderUnavailable, MemoryError) as e:
        error(e)
    space, action_dim = train_envs.single_observation_space, train_envs.single_action_space.shape[0]
    check_memory(args, space, action_dim, spec.horizon, spec.frame_stack, device)
    phi = Phi(space, d, args.hidden_dim).to(device)
    qf = [QNetwork(space, 1, args.hidden_dim, d + action_dim, nn.init.xavier_normal_).to(device) for _ in range(4)]
    qf, qf_target = qf[:2], qf[2:]  # twins, then targets
    for net, target in zip(qf, qf_target):
        target.load_state_dict(net.state_dict())
    actor = Actor(space, action_dim, d, args.hidden_dim).to(device)
    if args.bf16:
        envs.encoders_in_bf16(phi, *qf, *qf_target, actor)
    log_alpha = torch.tensor(math.log(args.alpha_init), device=device, requires_grad=True)
    log_lam = torch.tensor(math.log(args.dual_lam), device=device, requires_grad=True)  # never stepped in METRA-C
    adam = functools.partial(torch.optim.Adam, **adam_options(args, device))
    qf_params, qf_target_params = ([p for net in nets for p in net.parameters()] for nets in (qf, qf_target))
    modules = {"phi": phi, "qf1": qf[0], "qf2": qf[1], "qf1_target": qf_target[0], "qf2_target": qf_target[1],
               "actor": actor, "phi_optimizer": adam(phi.parameters()), "qf_optimizer": adam(qf_params),
               "actor_optimizer": adam(actor.parameters()), "alpha_optimizer": adam([log_alpha]),
               "lam_optimizer": adam([log_lam], lr=args.dual_lr), "log_alpha": log_alpha, "log_lam": log_lam}
    rb = ReplayBuffer(args.buffer_size, spec.horizon, space, spec.frame_stack, action_dim, d, rng,
                      device if args.buffer_on_device else None)
    streams = (rng, eval_rng, eval_generator, train_envs, eval_envs)
    window = {"stats": [], "train_time": 0.0, "grad_steps": 0, "start": time.time(), "env_steps": 0}
    start_epoch, grad_steps, wall_time = (restore_checkpoint(ckpt, args, modules, rb, streams, window, device)
                                          if ckpt else (0, 0, 0.0))

    def update(batch):
        """φ (Eq. 5), λ, Q on the new φ's reward (Eq. 6), π, α, Q̄, as officially; the stats stay on the device."""
        obs, action, next_obs, skill = (batch[key] for key in ("obs", "action", "next_obs", "skill"))
        alpha, w = log_alpha.exp().detach(), skill_weights(skill, args.discrete)
        with record_function("phi step"):  # and λ's
            negatives = sample_skills(args.num_negatives, d, device=device) if contrastive else None  # z'_j ~ p(z)
            dphi = phi(next_obs) - phi(obs)
            metra_loss, c = metra_phi_loss(dphi, w, log_lam, args.dual_slack, args.constraint_norm)
            # φ minimizes METRA's loss (Eq. 5), or in the ablation METRA-C, CSF's contrastive bound (c only logged)
            phi_loss, logsumexp = contrastive_phi_loss(dphi, w, negatives, args.xi) if contrastive else (metra_loss, 0)
            gradient_step(modules["phi_optimizer"], phi_loss)
            if not contrastive:  # λ steps on METRA's c
                lam_loss = dual_loss(log_lam, c)
                gradient_step(modules["lam_optimizer"], lam_loss)
        with record_function("qf step"):
            with torch.no_grad():
                reward = intrinsic_reward(phi(next_obs) - phi(obs), w)
                next_action, next_log_prob = actor.sample(next_obs, skill)
                next_q = torch.stack([net(next_obs, skill, next_action) for net in qf_target])
                target = critic_target(reward, next_q, next_log_prob, alpha, args.gamma)
            qf_loss = critic_loss([net(obs, skill, action) for net in qf], target)
            gradient_step(modules["qf_optimizer"], qf_loss)
        with record_function("actor step"), frozen(qf):
            new_action, log_prob = actor.sample(obs, skill)
            pi_loss = actor_loss(log_prob, torch.stack([net(obs, skill, new_action) for net in qf]), alpha)
            gradient_step(modules["actor_optimizer"], pi_loss)
        with record_function("alpha step"):  # then Q̄ ← (1 - τ) Q̄ + τ Q
            alpha_loss = temperature_loss(log_alpha, log_prob.detach(), -action_dim / 2)
            if args.env_id not in FIXED_ALPHA_ENVS:
                gradient_step(modules["alpha_optimizer"], alpha_loss)
            with torch.no_grad():
                torch._foreach_lerp_(qf_target_params, qf_params, args.tau)
        stats = {"phi_loss": phi_loss, "qf_loss": qf_loss, "actor_loss": pi_loss, "alpha_loss": alpha_loss,
                 "reward": reward.mean(), "batch_constraint": c.mean(), "alpha": alpha}
        stats.update({"logsumexp": logsumexp} if contrastive else {"lambda_loss": lam_loss, "lambda": log_lam.exp()})
        return {k: v.detach() for k, v in stats.items()}

    if args.compile:  # on a CPU with eager's random draws
        torch._inductor.config.fallback_random = device.type == "cpu"
        update = torch.compile(update)
    if args.cudagraphs and device.type != "cuda":
        print("--cudagraphs: CUDA graphs need a GPU; on the CPU the gradient step runs without them", flush=True)
    update = CudaGraphStep(update) if args.cudagraphs and device.type == "cuda" else update
    segment_start = time.time()
    for epoch in range(start_epoch, num_epochs + 1):
        if (epoch % args.eval_every == 0 or epoch == num_epochs) and not (ckpt and epoch == start_epoch):
            evaluate(epoch, grad_steps, wall_time + time.time() - segment_start, window, args, modules, rb, streams,
                     device, run_dir, writer)
        if epoch == num_epochs or (epoch % args.checkpoint_every == 0 and epoch != start_epoch):
            save_checkpoint(ckpt_path, args, run_name, epoch, grad_steps, wall_time + time.time() - segment_start,
                            window, modules, rb, streams, device)
        if epoch == num_epochs:
            break
        skills = sample_skills(args.num_envs, d, args.discrete).to(device)
        obs, _ = train_envs.reset()
        observations, actions = [obs], []
        with torch.no_grad(), record_function("collection"):
            for t in range(spec.horizon):
                action = finite(actor.sample(torch.as_tensor(obs, device=device), skills)[0], epoch)
                obs, _, terminated, truncated, _ = train_envs.step(action)
                assert not terminated.any() and (truncated == (t == spec.horizon - 1)).all()  # the buffer's layout
                observations.append(obs)
                actions.append(action)
        rb.add(np.stack(observations, 1), np.stack(actions, 1), skills.cpu().numpy())
        window["env_steps"] += steps_per_epoch
        train_start, step_stats = time.time(), []
        for _ in range(args.grad_steps_per_epoch if rb.size >= args.learning_starts else 0):
            with record_function("sampling"):
                batch = rb.sample(args.batch_size, device)
            step_stats.append(update(batch))
        env_steps, segment_steps = (epoch + 1) * steps_per_epoch, (epoch + 1 - start_epoch) * steps_per_epoch
        if step_stats:  # stop at a NaN loss, else log the means
            names = list(step_stats[0])
            per_step = torch.stack([torch.stack(list(stats.values())) for stats in step_stats])  # (steps, names)
            losses = [i for i, name in enumerate(names) if name.endswith("_loss")]
            bad = ~torch.isfinite(per_step[:, losses])
            if bad.any():
                step, which = bad.nonzero()[0].tolist()
                error(f"{names[losses[which]]} is {per_step[step, losses[which]].item()} at gradient step "
                      f"{grad_steps + step + 1} (epoch {epoch})", ckpt_path)
            grad_steps += len(step_stats)
            means = per_step.mean(0)
            window["stats"].append(dict(zip(names, means)))
            window["grad_steps"] += len(step_stats)
            window["train_time"] += time.time() - train_start
            for name, value in zip(names, means.tolist()):
                writer.add_scalar(f"losses/{name}" if name.endswith("loss") else f"charts/{name}", value, env_steps)
        seconds = time.time() - segment_start
        sps = int(segment_steps / seconds)
        writer.add_scalar("charts/SPS", sps, env_steps)
        writer.add_scalar("charts/grad_steps", grad_steps, env_steps)
        if (epoch + 1) % 10 == 0:
            last = {k: v.item() for k, v in window["stats"][-1].items()} if window["stats"] else {}
            print(f"epoch {epoch + 1} | env steps {env_steps:,} | SPS {sps} | "
                  f"{duration((args.total_env_steps - env_steps) * seconds / segment_steps)} left | "
                  + " | ".join(f"{k} {v:.4g}" for k, v in last.items()), flush=True)
    for opened in (train_envs, eval_envs, writer):
        opened.close()
    if args.track:
        import wandb
        wandb.finish()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"done: {run_dir}")


# ABLATIONS: METRA-C (§6.3), --repr-loss contrastive: CSF's contrastive bound replaces METRA's φ loss, and λ stays.
def contrastive_phi_loss(dphi, skill, negatives, xi):
    """L(φ) = -E[Δφᵀz] + ξ E[log Σ_j exp Δφᵀz'_j] (Eq. 10 with ξ: Eq. 8's bound); and the mean log-sum-exp."""
    logsumexp = torch.logsumexp(dphi @ negatives.T, dim=-1)
    return -((dphi * skill).sum(-1) - xi * logsumexp).mean(), logsumexp.mean()


# INFRASTRUCTURE: the command line, start-up, the fast path, checkpoints, evaluation, logging.
def parse_args(argv=None):  # the flags (unset: the paper's for the env) and any checkpoint
    args, ckpt = tyro.cli(Args, args=argv), None
    path = args.resume
    if path:
        if not os.path.isfile(path):
            error(f"no checkpoint file at {path}")
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001
            error(f"{path} is not a readable checkpoint ({type(e).__name__})")
        if not isinstance(ckpt, dict) or "agent" not in ckpt:
            error(f"{path} is not a cleanmisl checkpoint")
        if ckpt["agent"] != AGENT:
            error(f"{path} is a {ckpt['agent']} checkpoint, not a {AGENT} one")
        if set(ckpt["args"]) - {field.name for field in fields(Args)} or "since_eval" not in ckpt:
            error(f"{path} was written by another version of {AGENT}.py")
        args = tyro.cli(Args, args=argv, default=Args(**ckpt["args"]))
        for flag, trained in ckpt["args"].items():
            if flag not in RESUME_MAY_CHANGE and getattr(args, flag) != trained:
                error(f"{path} was trained with --{flag.replace('_', '-')} {trained}, not {getattr(args, flag)}")
    if args.discrete is not None and args.discrete != (args.env_id in DISCRETE_ENVS) and args.skill_dim is None:
        error(f"the paper has no {'one-hot' if args.discrete else 'unit-sphere'} METRA skills on {args.env_id}; "
              "give --skill-dim too")
    for flag, value in env_defaults(args.env_id).items():
        setattr(args, flag, value if getattr(args, flag) is None else getattr(args, flag))
    args.checkpoint_every = args.eval_every if args.checkpoint_every is None else args.checkpoint_every
    for flag, interval in FLAG_RANGES.items():
        low, high, value = *map(float, interval[1:-1].split(",")), getattr(args, flag)
        if not ((low <= value if interval[0] == "[" else low < value)  # both False for NaN
                and (value <= high if interval[-1] == "]" else value < high)):
            error(f"--{flag.replace('_', '-')} must be in {interval}, got {value}")
    if args.discrete and args.skill_dim < 2:
        error(f"one-hot skills need --skill-dim K >= 2, got {args.skill_dim}")
    if args.discrete and args.repr_loss == "contrastive":
        error("--repr-loss contrastive needs unit-sphere skills; add --discrete False --skill-dim D")
    h = envs.ENV_SPECS[args.env_id].horizon
    epoch = args.num_envs * h
    if args.buffer_size < epoch:
        error(f"--buffer-size must hold one epoch (--num-envs × {h} = {epoch} transitions), got {args.buffer_size}")
    if args.total_env_steps < epoch:
        error(f"--total-env-steps must cover one epoch (--num-envs × {h} = {epoch} env steps), got "
              f"{args.total_env_steps}")
    stored = min(args.total_env_steps // epoch * epoch, args.buffer_size // h * h)
    if args.grad_steps_per_epoch and args.learning_starts > stored:
        error(f"--learning-starts must be at most --total-env-steps and --buffer-size in whole epochs and trajectories "
              f"({stored}), or the run never learns; got {args.learning_starts}")
    if ckpt and args.total_env_steps // epoch <= ckpt["epoch"]:
        error(f"{path} has already trained for {ckpt['epoch'] * epoch} env steps; give a larger --total-env-steps to "
              "continue it")
    return args, ckpt


def env_defaults(env_id):  # the paper's, for the env
    spec = envs.ENV_SPECS[env_id]
    return {"skill_dim": SKILL_DIMS[env_id], "discrete": env_id in DISCRETE_ENVS, "total_env_steps":
            spec.total_env_steps, "num_envs": spec.num_envs, "grad_steps_per_epoch": spec.grad_steps_per_epoch,
            "buffer_size": spec.buffer_size, "eval_every": spec.eval_every}


def start_run(args, ckpt):  # the run's folder, Ctrl-C as one line, W&B, TensorBoard
    run_name = ckpt["run_name"] if ckpt else f"{args.env_id}__{AGENT}__{args.seed}__{int(time.time())}"
    run_dir = os.path.dirname(os.path.abspath(args.resume)) if ckpt else os.path.join("runs", run_name)
    os.makedirs(run_dir, exist_ok=True)
    ckpt_path = os.path.join(run_dir, "checkpoint.pt")
    signal.signal(signal.SIGINT, lambda *_: error("interrupted", ckpt_path))
    if args.track:
        import wandb
        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, save_code=True, resume="allow", id=run_name.replace("/", "_"))
    # TensorBoard's thread: a failed write comes back at the next add_scalar, as one line
    threading.excepthook = lambda hook: None if issubclass(hook.exc_type, OSError) else threading.__excepthook__(hook)
    writer, table = SummaryWriter(run_dir), "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
    print(f"{args.env_id} (horizon {envs.ENV_SPECS[args.env_id].horizon}): " + ", ".join(
        f"--{f.replace('_', '-')} {getattr(args, f)}" for f in (*env_defaults(args.env_id), "checkpoint_every"))
          + (" (the run's own)" if ckpt else " (a flag not given takes the paper's value for the env)"), flush=True)
    return run_name, run_dir, ckpt_path, writer


def check_memory(args, space, action_dim, horizon, frame_stack, device):  # or one line
    frame = math.prod(space.shape) // frame_stack * space.dtype.itemsize
    parts = {"the replay buffer (--buffer-size)": args.buffer_size // horizon * (
                 (horizon + 1) * frame + 4 * (horizon * action_dim + args.skill_dim)),
             "the networks (--hidden-dim)": 4 * args.hidden_dim**2 * (4 * 4 + 2),
             "one batch (--batch-size)": 4 * args.batch_size * (2 * math.prod(space.shape) + 8 * args.hidden_dim)}
    gpu = [*parts][0 if args.buffer_on_device else 1:] if device.type == "cuda" else []
    for place, names in (("GPU", gpu), ("host", [name for name in parts if name not in gpu])):
        free = torch.cuda.mem_get_info(device)[0] if place == "GPU" and gpu else envs.free_host_memory()
        needed = sum(parts[name] for name in names)
        if needed > free:
            error(f"this run needs at least {needed / 2**30:,.1f} GiB of {place} memory: " + ", ".join(
                f"{name} {parts[name] / 2**30:,.1f}" for name in names) + f"; {free / 2**30:,.1f} GiB is free")


def adam_options(args, device):  # foreach; fused under --cudagraphs alone; capturable in a graph
    fused, capturable = args.cudagraphs and not args.compile, args.cudagraphs and device.type == "cuda"
    return {"lr": args.lr, "fused": fused, "foreach": not fused, "capturable": capturable}


class CudaGraphStep:  # warm up, record, replay
    def __init__(self, step):
        self.step, self.calls, self.graph = step, 0, None

    def __call__(self, batch):
        if self.calls < 3:  # the warm-up, on a side stream
            self.calls, side = self.calls + 1, torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), warnings.catch_warnings():
                warnings.filterwarnings("ignore", "This instance was constructed with capturable=True")
                stats = self.step(batch)
            torch.cuda.current_stream().wait_stream(side)
            return stats
        if self.graph is None:
            self.batch, self.graph = {k: v.clone() for k, v in batch.items()}, torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.stats = self.step(self.batch)
        for key, value in batch.items():
            self.batch[key].copy_(value)
        self.graph.replay()
        return {k: v.clone() for k, v in self.stats.items()}


def save_checkpoint(path, args, run_name, epoch, grad_steps, wall_time, window, modules, rb, streams, device):
    """All a resumed run needs, written atomically; NaN or inf ends the run instead."""
    def non_finite(x, prefix=""):  # the names of the tensors with NaN or inf, e.g. "actor.trunk.0.weight"
        if torch.is_tensor(x):
            return [prefix] if x.is_floating_point() and not torch.isfinite(x).all() else []
        items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, (list, tuple)) else []
        return [name for key, value in items for name in non_finite(value, f"{prefix}.{key}".lstrip("."))]

    state = {name: module.detach().cpu() if torch.is_tensor(module) else module.state_dict()
             for name, module in modules.items()}
    diverged = non_finite(state)
    if diverged:
        error(f"{diverged[0]} holds NaN or inf at epoch {epoch} ({len(diverged)} tensors do): the run diverged", path)
    rng, eval_rng, eval_generator, *vectors = streams
    state |= {"agent": AGENT, "args": asdict(args), "run_name": run_name, "epoch": epoch, "grad_steps": grad_steps,
              "wall_time": wall_time, "buffer": rb.state_dict(), "torch_rng": torch.get_rng_state(),
              "cuda_rng": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
              "numpy_rng": rng.bit_generator.state, "eval_numpy_rng": eval_rng.bit_generator.state,
              "eval_torch_rng": eval_generator.get_state(),
              "env_rngs": [s for vector in vectors for s in envs.env_rng_states(vector)],
              "since_eval": {**window, "start": time.time() - window["start"]}}
    write_atomically(path, lambda temporary: torch.save(state, temporary), path)


def restore_checkpoint(ckpt, args, modules, rb, streams, window, device):  # Adam with this run's options
    rng, eval_rng, eval_generator, train_envs, eval_envs = streams
    try:
        for name, module in modules.items():
            module.data.copy_(ckpt[name]) if torch.is_tensor(module) else module.load_state_dict(ckpt[name])
            for group in getattr(module, "param_groups", []):
                group.update({k: v for k, v in adam_options(args, device).items() if k != "lr"})
                for param in [param for param in group["params"] if "step" in module.state.get(param, {})]:
                    place = param.device if group["fused"] or group["capturable"] else "cpu"
                    module.state[param]["step"] = module.state[param]["step"].to(place, torch.float32)
        rb.load_state_dict(ckpt["buffer"])
        torch.set_rng_state(ckpt["torch_rng"])
        if device.type == "cuda" and ckpt["cuda_rng"] is not None:
            restore_cuda_rng(ckpt["cuda_rng"])
        eval_generator.set_state(ckpt["eval_torch_rng"])
        rng.bit_generator.state, eval_rng.bit_generator.state = ckpt["numpy_rng"], ckpt["eval_numpy_rng"]
        envs.set_env_rng_states(train_envs, ckpt["env_rngs"][:train_envs.num_envs])
        envs.set_env_rng_states(eval_envs, ckpt["env_rngs"][train_envs.num_envs:])
        saved = ckpt["since_eval"]
        window |= {**saved, "start": time.time() - saved["start"], "resumed_at": ckpt["epoch"]}
        window["stats"] = [{k: v.to(device) for k, v in means.items()} for means in window["stats"]]
    except (KeyError, RuntimeError, ValueError, AttributeError) as e:
        error(f"{args.resume} was written by another version of {AGENT}.py ({' '.join(str(e).split())[:160]})")
    env_steps = ckpt["epoch"] * args.num_envs * envs.ENV_SPECS[args.env_id].horizon
    print(f"resumed {ckpt['run_name']} at epoch {ckpt['epoch']} ({env_steps:,} env steps)")
    return ckpt["epoch"], ckpt["grad_steps"], ckpt["wall_time"]


def restore_cuda_rng(states):  # maybe fewer GPUs
    for index, state in enumerate(states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(state, index)


@torch.no_grad()
@record_function("evaluation")
def evaluate(epoch, grad_steps, wall_time, window, args, modules, rb, streams, device, run_dir, writer):
    """Rollouts → coverage, λ, E‖Δφ‖², the window's stats (then a new one): eval.jsonl, TensorBoard, plot, video."""
    (_, eval_rng, eval_generator, _, eval_envs), spec = streams, envs.ENV_SPECS[args.env_id]
    videos = eval_envs.video_envs  # the evaluation envs that render
    skills = eval_skills(args.num_eval_skills, args.skill_dim, args.discrete, eval_generator)
    (obs, info), on_device, coordinates, frames = eval_envs.reset(), skills.to(device), [], []
    for t in range(spec.horizon + 1):
        coordinates.append(info["coordinates"])
        frames += [np.concatenate(envs.render_envs(eval_envs, videos), 1)] if videos else []
        if t < spec.horizon:
            action = modules["actor"].mode(torch.as_tensor(obs, device=device), on_device)
            obs, _, _, _, info = eval_envs.step(finite(action, epoch))
    paths, env_steps = np.stack(coordinates, 1), epoch * args.num_envs * spec.horizon
    result = {"epoch": epoch, "env_steps": env_steps, "grad_steps": grad_steps, "wall_time": round(wall_time, 2),
              "coverage": envs.coverage(paths, args.env_id)}
    if rb.size > 0:  # 1000 at a time
        n, phi = min(10_000, rb.size), modules["phi"]
        batches = (rb.sample(min(1000, n - i), device, rng=eval_rng) for i in range(0, n, 1000))
        dphi, skill = (torch.cat(x) for x in zip(*[(phi(b["next_obs"]) - phi(b["obs"]), b["skill"]) for b in batches]))
        result["dphi_sq"] = dphi.pow(2).sum(-1).mean().item()
        result["constraint"] = constraint(dphi, args.dual_slack, args.constraint_norm).mean().item()
        if args.save_repr_stats:
            np.savez_compressed(f"{run_dir}/repr_stats_{env_steps:010d}.npz", skill=skill.cpu().numpy(),
                                **repr_stats(dphi, skill_weights(skill, args.discrete)), discrete=args.discrete,
                                env_id=args.env_id, env_steps=env_steps, repr_loss=args.repr_loss,
                                constraint_norm=args.constraint_norm)
    if window["stats"]:
        per_epoch = torch.stack([torch.stack(list(means.values())) for means in window["stats"]])
        result |= dict(zip(window["stats"][0], per_epoch.mean(0).tolist()))
    result |= {"sps": window["env_steps"] / (time.time() - window["start"])} if window["env_steps"] else {}
    result |= {"ms_per_grad_step": 1000 * window["train_time"] / window["grad_steps"]} if window["grad_steps"] else {}
    result |= {"lambda": modules["log_lam"].exp().item()} if args.repr_loss == "dual" else {}
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    fig, z = Figure(figsize=(5, 5)), skills.numpy()
    angle = np.arctan2(z[:, 1], z[:, 0]) if args.skill_dim > 1 else np.pi * (z[:, 0] > 0)
    hue = z.argmax(-1) / z.shape[-1] if args.discrete else (angle + np.pi) / (2 * np.pi)
    ax = fig.subplots()
    envs.draw_coordinates(ax, paths, colormaps["hsv"](hue), args.env_id)
    ax.set_title(f"METRA{'-C' * (args.repr_loss == 'contrastive')} {args.env_id}, {env_steps:,} env steps, "
                 f"coverage {result['coverage']}")
    fig.tight_layout()
    checkpoint = f"{run_dir}/checkpoint.pt"
    write_atomically(f"{run_dir}/skills_{env_steps:010d}.png", lambda tmp: fig.savefig(tmp, dpi=100), checkpoint)
    if frames:
        import imageio
        os.makedirs(f"{run_dir}/videos", exist_ok=True)
        write_atomically(f"{run_dir}/videos/skills_{env_steps:010d}.mp4",
                         lambda tmp: imageio.mimsave(tmp, frames, fps=20), checkpoint)
    for key in [key for key in ("coverage", "dphi_sq", "constraint", "lambda") if key in result]:
        writer.add_scalar(f"eval/{key}", result[key], env_steps)
    log, kept, cutoff = pathlib.Path(run_dir, "eval.jsonl"), [], window.pop("resumed_at", epoch - 1)  # after: redone
    lines = [line for line in log.read_text().split("\n") if line.strip()] if log.is_file() else []
    for number, line in enumerate(lines, 1):
        try:
            kept += [line + "\n"] if json.loads(line)["epoch"] <= cutoff else []
        except (ValueError, KeyError, TypeError):
            if number < len(lines):
                error(f"line {number} of {log} is not an evaluation; mend or delete it, then resume")
            print(f"warning: dropped the torn last line of {log}", file=sys.stderr)
    write_atomically(str(log), lambda tmp: pathlib.Path(tmp).write_text("".join(kept) + json.dumps(result) + "\n"),
                     checkpoint)
    print(f"eval  epoch {epoch} | env steps {env_steps:,} | coverage {result['coverage']} | " + " | ".join(
        f"{k} {result[k]:.4g}" for k in dict.fromkeys(("dphi_sq", "constraint", "lambda", *list(result)[5:-1]))
        if k in result), flush=True)
    window.update(stats=[], train_time=0.0, grad_steps=0, start=time.time(), env_steps=0)


def eval_skills(n, skill_dim, discrete, generator):  # or the K one-hots, each n/K times
    if discrete:
        return F.one_hot((torch.arange(n) % skill_dim).sort().values, skill_dim).float()
    return sample_skills(n, skill_dim, generator=generator)


def repr_stats(dphi, weights):  # Figure 2 (§6.2)
    dphi, weights = dphi.detach().cpu().double(), weights.detach().cpu().double()
    norm = dphi.norm(dim=-1, keepdim=True)
    return {"dphi": dphi.numpy(), "z": weights.numpy(), "dphi_minus_z": (dphi - weights).numpy(),
            "dphi_unit": (dphi / norm.clamp_min(1e-12)).numpy(), "dphi_sq": norm.squeeze(-1).pow(2).numpy()}


def duration(seconds):  # "45 s", "12 min", "3 h 05 min"
    m = round(seconds / 60)
    return f"{seconds:.0f} s" if seconds < 60 else f"{m} min" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def finite(action, epoch):  # or one line
    if not np.isfinite(action := action.cpu().numpy()).all():
        error(f"the policy's action is not finite at epoch {epoch}: its networks diverged")
    return action


def error(message, checkpoint_path=None):
    if checkpoint_path:
        resumable = os.path.isfile(checkpoint_path)
        message += f"; resume with --resume {checkpoint_path}" if resumable else "; no checkpoint was written yet"
    sys.exit(f"{AGENT}.py: error: {message}")


def write_atomically(path, write, checkpoint_path):  # or one line
    temporary = "{}.tmp{}".format(*os.path.splitext(path))
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        if not isinstance(e, (OSError, RuntimeError)):  # torch.save's failed write
            raise
        cut_short = "unexpected pos" in str(e) or "write failed" in str(e)
        reason = (e.strerror or str(e)) if isinstance(e, OSError) else (
            "the write was cut short: is the disk full?" if cut_short else " ".join(str(e).split())[:120])
        error(f"cannot write {path} ({reason})", checkpoint_path)


if __name__ == "__main__":
    args, ckpt = parse_args()
    try:
        main(args, ckpt)
    except OSError as e:
        error(f"cannot write {os.fsdecode(e.filename) if e.filename else 'the TensorBoard log'} ({e.strerror or e})")
