"""CSF, Contrastive Successor Features, in one file: "Can a MISL Fly? Analysis and Ingredients for Mutual Information
Skill Learning" (Zheng, Tuyls, Peng and Eysenbach, ICLR 2025), §5 and Algorithm 1.

A skill z ~ p(z) = Unif(S^{d-1}) is held for a whole trajectory of the policy π(a | s, z). With Δφ = φ(s') - φ(s) and
z'_j ~ p(z), φ(s) ∈ R^d maximizes the contrastive bound on I(S, S'; Z) with critic Δφᵀz (Eq. 8), its negative term
weighted by ξ (Eq. 10 with ξ; Alg. 1, line 5):   max_φ  E[Δφᵀz] - ξ E[log Σ_j exp Δφᵀz'_j].
The reward r = Δφᵀz (Eq. 11) is linear in z, so the critic is a vector: successor features ψ(s, a, z) ∈ R^d regressed
by TD onto Δφ + γ ψ̄(s', a', z), a' ~ π(·|s', z), with Q = ψᵀz (§5.2; line 6); π is SAC's actor on Q (line 7).

    python csf.py --env-id Ant --hidden-dim 256 --total-env-steps 3000000  # a CPU-sized run (README: 73 min)

Deliberate differences from the official code (github.com/Princeton-RL/contrastive-successor-features):
  - no --turn_off_dones flag: a time limit is never terminal, as every official script sets it.
  - left out, never changing learning: the future-goal sampler, a target φ never updated, METRA's idle λ machinery.
  - the 256 negatives z'_j are fresh prior draws (Alg. 1; --sample_new_z 1), not the batch's skills (App. B.2).
  - added: the last epoch is always evaluated and checkpointed; evaluations after epoch 0 report E‖Δφ‖² on up to
    10k replay transitions (with replacement); a resumed run reports what the uninterrupted one does.
  - the ablations of §6.3 (--critic, --reward) follow `main`; a reward r not linear in z is Δφᵀz + (r - Δφᵀz), the
    remainder summed by an extra output ψ₀ of each ψ.
  - pixels: each frame is stored once (3.7 GB, not 22 GB, at 300k transitions); envs.py seeds every env apart.
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
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Literal, Optional

import gymnasium as gym
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
AGENT = "csf"
SKILL_DIMS = {"Ant": 2, "HalfCheetah": 2, "Quadruped": 4, "Humanoid": 8, "Kitchen": 4, "Robobin": 9}  # App. B.3


@dataclass
class Args:
    env_id: Literal["Ant", "HalfCheetah", "Quadruped", "Humanoid", "Kitchen", "Robobin"] = "Ant"  # The world.
    skill_dim: Optional[int] = None  # Dimension d of the skill z; unset, the paper's (App. B.3).
    seed: int = 1  # Seed of torch, numpy and the envs (on a CPU, one run per seed).
    total_env_steps: Optional[int] = None  # Env steps to train for; unset, the paper's (64M; pixels 4.8M).
    num_envs: Optional[int] = None  # Trajectories per epoch, a skill each; unset, 8 (Robobin 10).
    grad_steps_per_epoch: Optional[int] = None  # Gradient steps after each collection; unset, the paper's.
    learning_starts: int = 10_000  # Transitions stored before the first gradient step.
    batch_size: int = 256  # Transitions per minibatch, drawn with replacement.
    buffer_size: Optional[int] = None  # Replay capacity in transitions (unset: 1M; pixels 300k, Kitchen 100k).
    hidden_dim: int = 1024  # Width of the hidden layers of φ, ψ and π.
    eval_every: Optional[int] = None  # Epochs between evaluations (and the last); unset, the official scripts'.
    checkpoint_every: Optional[int] = None  # Epochs between checkpoints (and the last); unset, --eval-every's.
    resume: Optional[str] = None  # A checkpoint.pt to continue, in its run's folder, with its flags.
    cuda: bool = True  # Use the GPU when torch sees one.
    parallel_envs: bool = True  # Step the envs in worker processes, at most one per core (same numbers).
    buffer_on_device: bool = False  # Keep the replay buffer, and sample it, on the training device.
    cudagraphs: bool = False  # On a GPU, replay the gradient step as a CUDA graph.
    compile: bool = False  # Compile the gradient step with torch.compile (on a CPU, same numbers up to rounding).
    bf16: bool = False  # On pixels, run the encoders' convolutions in bfloat16.
    track: bool = False  # Also log to Weights & Biases (WANDB_MODE=offline works).
    wandb_project_name: str = "cleanmisl"  # The W&B project, with --track.
    wandb_entity: Optional[str] = None  # The W&B team, with --track.
    capture_video: bool = False  # At each evaluation, write an MP4 of up to four rollouts.
    num_eval_skills: int = 48  # Deterministic rollouts per evaluation, a fresh skill each.
    xi: float = 5.0  # Weight ξ of the negative term (App. C.3: 2, 5, 10 beat 1 and below).
    critic: Literal["inner", "mlp", "gaussian", "laplacian"] = "inner"  # The bound's critic (§6.3); inner: the paper's.
    reward: Literal["bottleneck", "mutual-information"] = "bottleneck"  # The reward (§6.3); bottleneck: the paper's.
    num_negatives: int = 256  # Prior draws z'_j per gradient step in the negative term.
    gamma: float = 0.99  # Discount of the successor features.
    tau: float = 0.005  # Polyak step of the target ψ per gradient step.
    lr: float = 1e-4  # Adam learning rate of φ, ψ, π and log α.
    alpha_init: float = 0.01  # Initial temperature α, tuned towards the entropy -|A|/2.


# Every numeric flag's valid interval ("[" closed, "(" open); NaN is never inside.
FLAG_RANGES = {flag: interval for interval, flags in {
    "[1, inf)": "skill_dim total_env_steps num_envs batch_size buffer_size hidden_dim eval_every checkpoint_every "
                "num_eval_skills num_negatives", "[0, inf)": "grad_steps_per_epoch learning_starts xi",
    "(0, inf)": "lr alpha_init", "[0, 2147483647]": "seed", "[0, 1)": "gamma", "(0, 1]": "tau"}.items()
    for flag in flags.split()}
# What --resume may change: not the problem learned (the device may change the draws).
RESUME_MAY_CHANGE = ("total_env_steps", "eval_every", "checkpoint_every", "resume", "cuda", "parallel_envs",
                     "buffer_on_device", "cudagraphs", "compile", "bf16", "track", "wandb_project_name",
                     "wandb_entity", "capture_video")


def sample_skills(n, skill_dim, generator=None, device=None):
    """z ~ p(z) = Unif(S^{d-1}): a standard normal draw scaled to unit length (the official code's)."""
    z = torch.randn(n, skill_dim, generator=generator, device=device)
    return z / z.norm(dim=-1, keepdim=True)


def transition_features(phi, obs, next_obs, critic):
    """Δφ = φ(s') - φ(s), which the critic compares with z (--critic mlp: φ of (s, s'))."""
    return phi(torch.cat([obs, next_obs], -1)) if critic == "mlp" else phi(next_obs) - phi(obs)


def contrastive_phi_loss(dphi, skill, negatives, xi):
    """L(φ) = -E[Δφᵀz] + ξ E[log Σ_j exp Δφᵀz'_j] (Eq. 10 with ξ), negatives shared by the batch, no 1/M, no positive
    (iod/metra.py: _update_loss_te); and the mean log-sum-exp (log M at Δφ = 0)."""
    logsumexp = torch.logsumexp(dphi @ negatives.T, dim=-1)
    return -((dphi * skill).sum(-1) - xi * logsumexp).mean(), logsumexp.mean()


def sf_value(psi, skill):
    """Q = ψᵀz (§5.2), plus the ablations' scalar head ψ₀ (for a reward not linear in z)."""
    value = (psi[..., : skill.shape[-1]] * skill).sum(-1)
    return value + psi[..., -1] if psi.shape[-1] > skill.shape[-1] else value


def successor_feature_target(dphi, next_psi, skill, gamma):
    """ψ̂ = Δφ + γ ψ̄_k(s', a', z), k = argmin_k ψ̄_kᵀz per sample, without entropy or terminals (iod/metra_sf.py)."""
    smaller = sf_value(next_psi, skill).argmin(0)
    return dphi + gamma * next_psi[smaller, torch.arange(len(skill), device=skill.device)]


def psi_objective(psi, psi_target, phi, actor, obs, action, next_obs, skill, negatives, args):
    """L(ψ) = Σ_k mean over the batch and the d components of (ψ_k(s, a, z) - ψ̂)², ψ̂ from the updated φ (Alg. 1,
    line 6): Eq. 11's reward enters as the vector Δφ (Q = ψᵀz)."""
    with torch.no_grad():
        next_action, _ = actor.sample(next_obs, skill)
        cumulant = transition_features(phi, obs, next_obs, args.critic)
        cumulant = with_reward_remainder(cumulant, skill, negatives, args) if psi[0].scalar_head else cumulant
        next_psi = torch.stack([net(next_obs, skill, next_action) for net in psi_target])
        target = successor_feature_target(cumulant, next_psi, skill, args.gamma)
    return sum(F.mse_loss(net(obs, skill, action), target) for net in psi)


def actor_objective(actor, psi, obs, skill, alpha):
    """L(π) = E[α log π(a|s, z) - min_k ψ_k(s, a, z)ᵀz], a ~ π(·|s, z) (Alg. 1, line 7, with SAC's entropy)."""
    new_action, log_prob = actor.sample(obs, skill)
    q = torch.stack([sf_value(net(obs, skill, new_action), skill) for net in psi]).amin(0)
    return (alpha * log_prob - q).mean(), log_prob


def temperature_loss(log_alpha, log_prob, target_entropy):
    """L(α) = -E[log α (log π(a|s, z) + H̄)], H̄ = -|A|/2 (iod/metra.py's; SAC's usual is -|A|)."""
    return -(log_alpha * (log_prob + target_entropy)).mean()


def mlp(in_dim, hidden_dim, out_dim, activation, init):  # Linear → act → Linear → act → Linear, zero biases
    net = nn.Sequential(nn.Linear(in_dim, hidden_dim), activation(), nn.Linear(hidden_dim, hidden_dim),
                        activation(), nn.Linear(hidden_dim, out_dim))
    for layer in net[::2]:
        init(layer.weight)
        nn.init.zeros_(layer.bias)
    return net


class Phi(nn.Module):
    """φ(s) ∈ R^d (ReLU, Xavier-uniform); every network owns its pixel encoder (garagei's with_encoder.py)."""
    def __init__(self, space, out_dim, hidden_dim, input_dim=0, init=nn.init.xavier_uniform_):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        self.net = mlp(features + input_dim, hidden_dim, out_dim, nn.ReLU, init)

    def forward(self, obs, *inputs):  # ψ's z and a after s
        return self.net(torch.cat([self.encoder(obs), *inputs], -1))


class SuccessorFeatures(Phi):
    """ψ(s, a, z) ∈ R^d (Xavier-normal): φ's network on (s, z, a), and ψ₀ with scalar_head (the ablations)."""
    def __init__(self, space, action_dim, skill_dim, hidden_dim, scalar_head):
        super().__init__(space, skill_dim + scalar_head, hidden_dim, skill_dim + action_dim, nn.init.xavier_normal_)
        self.scalar_head = scalar_head


class Actor(nn.Module):
    """π(a | s, z): a tanh-squashed Gaussian on a tanh trunk, its heads initialised 10x smaller."""
    def __init__(self, space, action_dim, skill_dim, hidden_dim):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        self.trunk = mlp(features + skill_dim, hidden_dim, hidden_dim, nn.Tanh, nn.init.xavier_uniform_)[:-1]
        self.mean, self.log_std = nn.Linear(hidden_dim, action_dim), nn.Linear(hidden_dim, action_dim)
        for head in (self.mean, self.log_std):
            nn.init.xavier_normal_(head.weight)
            head.weight.data.mul_(0.1)
            nn.init.zeros_(head.bias)

    def forward(self, obs, skill):
        h = self.trunk(torch.cat([self.encoder(obs), skill], -1))
        return self.mean(h), self.log_std(h).clamp(math.log(1e-6), 2.0)

    def sample(self, obs, skill):  # a reparameterized action and its log-probability
        mean, log_std = self(obs, skill)
        normal = torch.distributions.Normal(mean, log_std.exp(), validate_args=False)  # NaN: caught later
        action = torch.tanh(u := normal.rsample())
        log_prob = normal.log_prob(u).sum(-1) - torch.log((1 - action.pow(2)).clamp(0, 1) + 1e-6).sum(-1)
        return action, log_prob

    def mode(self, obs, skill):
        return torch.tanh(self(obs, skill)[0])


def optimize(optimizer, loss):  # one gradient step
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


@contextlib.contextmanager
def frozen(modules):  # no gradient into their weights in the block; one still flows through them
    for module in modules:
        module.requires_grad_(False)
    yield
    for module in modules:
        module.requires_grad_(True)


class ReplayBuffer:
    """A ring of whole trajectories (path_buffer_ex.py), each pixel frame once; numpy, or torch on `device`."""
    def __init__(self, capacity, horizon, space, frame_stack, action_dim, skill_dim, rng, device=None):
        n, frame_shape = capacity // horizon, space.shape[:-1] + (space.shape[-1] // frame_stack,)
        self.horizon, self.rng, self.device, self.pos, self.num_stored = horizon, rng, device, 0, 0  # in trajectories
        self.frames = self.zeros((n, horizon + 1, *frame_shape), space.dtype)
        self.actions = self.zeros((n, horizon, action_dim), np.float32)
        self.skills = self.zeros((n, skill_dim), np.float32)
        self.frame_offsets = self.to_storage(np.arange(1 - frame_stack, 2))  # frames t-k+1..t+1 of step t
        self.generator = None if device is None else torch.Generator(device).manual_seed(int(rng.integers(2**62)))

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype) if self.device is None else torch.zeros(
            shape, dtype=getattr(torch, np.dtype(dtype).name), device=self.device)

    def to_storage(self, array, like=None):  # in `like`'s dtype
        return array if self.device is None else torch.as_tensor(
            array, dtype=None if like is None else like.dtype, device=self.device)

    @property
    def size(self):  # stored transitions
        return self.num_stored * self.horizon

    def add(self, observations, actions, skills):  # (n, horizon + 1, ...), (n, horizon, |A|), (n, d)
        n, capacity = len(observations), len(self.frames)
        idx = self.to_storage((self.pos + np.arange(n)) % capacity)
        self.frames[idx] = self.to_storage(observations[..., -self.frames.shape[-1]:], self.frames)  # newest frames
        self.actions[idx] = self.to_storage(actions, self.actions)
        self.skills[idx] = self.to_storage(skills, self.skills)
        self.pos, self.num_stored = (self.pos + n) % capacity, min(self.num_stored + n, capacity)

    def gather(self, batch_size, rng=None):  # s and s' as (B, k + 1) frames; `rng`: on the host
        if self.device is None or rng is not None:
            i = self.to_storage((rng or self.rng).integers(0, self.size, batch_size))
        else:
            i = torch.randint(0, self.size, (batch_size,), generator=self.generator, device=self.device)
        trajectory, t = i // self.horizon, i % self.horizon
        steps = (t[:, None] + self.frame_offsets).clip(min=0)  # the first frame repeated before t = 0
        return {"frames": self.frames[trajectory[:, None], steps], "action": self.actions[trajectory, t],
                "skill": self.skills[trajectory]}

    def sample(self, batch_size, device, rng=None):  # copied to `device` pinned, without waiting
        batch = self.gather(batch_size, rng)
        if self.device is None:
            batch = {k: torch.from_numpy(v) for k, v in batch.items()}
            if torch.device(device).type == "cuda":
                batch = {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
        frames = batch.pop("frames")
        return {"obs": frames[:, :-1].movedim(1, -2).flatten(-2).contiguous(),
                "next_obs": frames[:, 1:].movedim(1, -2).flatten(-2).contiguous(), **batch}

    def state_dict(self):  # tensors: torch.save copies arrays
        n = self.num_stored
        return {"pos": self.pos, "num_stored": n, "frames": torch.as_tensor(self.frames[:n]).cpu(),
                "actions": torch.as_tensor(self.actions[:n]).cpu(), "skills": torch.as_tensor(self.skills[:n]).cpu(),
                "generator": None if self.generator is None else self.generator.get_state()}

    def load_state_dict(self, state):
        self.pos, self.num_stored = state["pos"], state["num_stored"]
        for name in ("frames", "actions", "skills"):
            getattr(self, name)[:self.num_stored] = self.to_storage(state[name])
        if self.generator is not None and state.get("generator") is not None:  # None: written on the host
            self.generator.set_state(state["generator"])


def main(args, ckpt=None):
    """CSF epoch by epoch (Alg. 1; iod/iod.py: IOD.train): evaluate, collect, update."""
    spec = envs.ENV_SPECS[args.env_id]
    steps_per_epoch = args.num_envs * spec.horizon
    num_epochs = args.total_env_steps // steps_per_epoch
    run_name, run_dir, writer = start_run(args, ckpt)
    torch.manual_seed(args.seed)  # the networks, skills and policy noise
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    torch.set_float32_matmul_precision("high" if device.type == "cuda" else "highest")  # TF32 on a GPU
    try:  # a world that cannot render: one line
        num_video_envs = 4 if args.capture_video else 0
        train_envs, eval_envs = envs.make_envs(functools.partial(envs.make_env, args.env_id), args.num_envs,
                                               args.num_eval_skills, args.seed, num_video_envs, args.parallel_envs)
    except (envs.RenderUnavailable, MemoryError) as e:
        error(e)
    streams = {"rng": np.random.default_rng(args.seed), "eval_rng": np.random.default_rng(args.seed + 1),
               "eval_generator": torch.Generator().manual_seed(args.seed + 1), "envs": (train_envs, eval_envs)}
    space = train_envs.single_observation_space  # a state vector or stacked RGB frames
    action_dim, d = train_envs.single_action_space.shape[0], args.skill_dim
    check_memory(args, space, action_dim, spec, device)
    kernel_critic = args.critic in ("gaussian", "laplacian")  # ablations, as --reward mutual-information
    scalar_head = kernel_critic or args.reward == "mutual-information"  # a reward not linear in z
    phi = Phi(pair_space(space) if args.critic == "mlp" else space, d, args.hidden_dim).to(device)
    psi = [SuccessorFeatures(space, action_dim, d, args.hidden_dim, scalar_head).to(device) for _ in range(2)]
    psi_target = [SuccessorFeatures(space, action_dim, d, args.hidden_dim, scalar_head).to(device) for _ in psi]
    for net, target in zip(psi, psi_target):
        target.load_state_dict(net.state_dict())
    actor = Actor(space, action_dim, d, args.hidden_dim).to(device)
    if args.bf16:
        envs.encoders_in_bf16(phi, *psi, *psi_target, actor)
    log_alpha = torch.tensor(math.log(args.alpha_init), device=device, requires_grad=True)
    target_entropy = -action_dim / 2  # H̄ = -|A|/2, the official code's
    psi_params, psi_target_params = ([p for net in nets for p in net.parameters()] for nets in (psi, psi_target))
    adam = adam_options(args, device)  # one optimizer for both ψ, on their loss sum
    phi_optimizer, psi_optimizer, actor_optimizer, alpha_optimizer = (
        torch.optim.Adam(params, **adam) for params in (phi.parameters(), psi_params, actor.parameters(), [log_alpha]))
    rb = ReplayBuffer(args.buffer_size, spec.horizon, space, spec.frame_stack, action_dim, d, streams["rng"],
                      device if args.buffer_on_device else None)
    modules = {"phi": phi, "psi1": psi[0], "psi2": psi[1], "psi1_target": psi_target[0], "psi2_target": psi_target[1],
               "actor": actor, "phi_optimizer": phi_optimizer, "psi_optimizer": psi_optimizer,  # the checkpoint's keys
               "actor_optimizer": actor_optimizer, "alpha_optimizer": alpha_optimizer, "log_alpha": log_alpha}
    start_epoch, grad_steps, wall_time, window = (
        restore_checkpoint(ckpt, args, modules, rb, streams, device) if ckpt else (0, 0, 0.0, new_window()))

    def update(batch):
        """Alg. 1, lines 4-9: φ on the bound; ψ by TD, then ψ̄; π on min_k ψ_kᵀz + α H(π); α. Stats on the device."""
        obs, action, next_obs, skill = batch["obs"], batch["action"], batch["next_obs"], batch["skill"]
        with record_function("phi step"):
            negatives = sample_skills(args.num_negatives, d, device=device)  # z'_j ~ p(z)
            dphi = transition_features(phi, obs, next_obs, args.critic)
            phi_loss, logsumexp = (ablation_phi_loss(dphi, skill, negatives, args.xi, args.critic) if kernel_critic
                                   else contrastive_phi_loss(dphi, skill, negatives, args.xi))
            optimize(phi_optimizer, phi_loss)
        with record_function("psi step"):  # then the targets ψ̄ ← (1 - τ) ψ̄ + τ ψ
            psi_loss = psi_objective(psi, psi_target, phi, actor, obs, action, next_obs, skill, negatives, args)
            optimize(psi_optimizer, psi_loss)
            with torch.no_grad():
                torch._foreach_lerp_(psi_target_params, psi_params, args.tau)
        with record_function("actor step"), frozen(psi):  # the gradient flows through ψ, not into it
            alpha = log_alpha.exp().detach()
            actor_loss, log_prob = actor_objective(actor, psi, obs, skill, alpha)
            optimize(actor_optimizer, actor_loss)
        with record_function("alpha step"):
            alpha_loss = temperature_loss(log_alpha, log_prob.detach(), target_entropy)
            optimize(alpha_optimizer, alpha_loss)
        return {"phi_loss": phi_loss.detach(), "psi_loss": psi_loss.detach(), "actor_loss": actor_loss.detach(),
                "alpha_loss": alpha_loss.detach(), "logsumexp": logsumexp.detach(), "alpha": alpha}

    if args.compile:  # on a CPU, with eager's random draws
        torch._inductor.config.fallback_random = device.type == "cpu"
        update = torch.compile(update)
    if args.cudagraphs and device.type == "cuda":
        update = CudaGraphStep(update)
    elif args.cudagraphs:
        print("--cudagraphs: CUDA graphs need a GPU; on the CPU the gradient step runs without them", flush=True)
    segment_start = time.time()
    for epoch in range(start_epoch, num_epochs + 1):
        # evaluate and checkpoint what the previous epochs produced
        if (epoch % args.eval_every == 0 or epoch == num_epochs) and not (ckpt and epoch == start_epoch):
            evaluate(epoch, grad_steps, wall_time + time.time() - segment_start, window, args, actor, phi, rb,
                     eval_envs, streams, device, run_dir, writer)
            window = new_window()
        if epoch == num_epochs or (epoch % args.checkpoint_every == 0 and epoch != start_epoch):
            save_checkpoint(run_dir, args, run_name, epoch, grad_steps, wall_time + time.time() - segment_start,
                            window, modules, rb, streams, device)
        if epoch == num_epochs:
            break
        # a trajectory per env and skill, from the stochastic policy (Alg. 1, line 3)
        skills = sample_skills(args.num_envs, d).to(device)
        obs, _ = train_envs.reset()
        observations, actions = [obs], []
        with torch.no_grad(), record_function("collection"):
            for t in range(spec.horizon):
                action = finite(actor.sample(torch.as_tensor(obs, device=device), skills)[0], epoch)
                obs, _, terminated, truncated, _ = train_envs.step(action)
                # never terminal, cut at the horizon: the buffer's layout
                assert not terminated.any() and (truncated == (t == spec.horizon - 1)).all()
                observations.append(obs)  # the last: the final one
                actions.append(action)
        rb.add(np.stack(observations, 1), np.stack(actions, 1), skills.cpu().numpy())
        window["env_steps"] += steps_per_epoch
        # gradient steps, once learning_starts transitions are stored
        train_start, step_stats = time.time(), []
        if rb.size >= args.learning_starts:
            for _ in range(args.grad_steps_per_epoch):
                with record_function("sampling"):
                    batch = rb.sample(args.batch_size, device)
                step_stats.append(update(batch))
        grad_steps += len(step_stats)
        sps = (epoch + 1 - start_epoch) * steps_per_epoch / (time.time() - segment_start)  # this run's, so far
        log_epoch(writer, epoch, (epoch + 1) * steps_per_epoch, grad_steps, sps, window, args, step_stats,
                  time.time() - train_start)  # a NaN loss ends the run here
    for opened in (train_envs, eval_envs, writer):
        opened.close()
    if args.track:
        import wandb
        wandb.finish()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as before the run
    print(f"done: {run_dir}")


# ABLATIONS (§6.3): --critic mlp / gaussian / laplacian, --reward mutual-information. Skip on a first reading.
def critic_value(x, skill, critic):
    """f(s, s', z), x = Δφ: inner and mlp xᵀz, gaussian -½‖x - z‖², laplacian -‖x - z‖₁ (broadcasting)."""
    if critic == "gaussian":
        return -0.5 * (x - skill).pow(2).sum(-1)
    return -(x - skill).abs().sum(-1) if critic == "laplacian" else (x * skill).sum(-1)


def negative_logsumexp(x, negatives, critic):
    """log Σ_j exp f(s, s', z'_j) per sample (B,), the negatives shared by the batch."""
    kernel = critic in ("gaussian", "laplacian")
    return torch.logsumexp(critic_value(x[:, None], negatives[None], critic) if kernel else x @ negatives.T, dim=-1)


def ablation_phi_loss(x, skill, negatives, xi, critic):
    """contrastive_phi_loss with any critic: -E[f(s, s', z)] + ξ E[log Σ_j exp f(s, s', z'_j)], and the mean lse."""
    logsumexp = negative_logsumexp(x, negatives, critic)
    return -(critic_value(x, skill, critic) - xi * logsumexp).mean(), logsumexp.mean()


def with_reward_remainder(dphi, skill, negatives, args):
    """ψ's cumulant (B, d + 1) for a reward r not linear in z: Δφ, then r - Δφᵀz for ψ₀. r = f(s, s', z) (Eq. 11), or
    under --reward mutual-information the bound's per-sample term f(s, s', z) - ξ log Σ_j exp f(s, s', z'_j)."""
    r = critic_value(dphi, skill, args.critic)
    if args.reward == "mutual-information":
        r = r - args.xi * negative_logsumexp(dphi, negatives, args.critic)
    return torch.cat([dphi, (r - (dphi * skill).sum(-1))[:, None]], -1)


def pair_space(space):
    """What φ reads under --critic mlp: (s, s') concatenated along the last axis (channels on pixels)."""
    return gym.spaces.Box(np.concatenate([space.low] * 2, -1), np.concatenate([space.high] * 2, -1), dtype=space.dtype)


# INFRASTRUCTURE: command line, start-up, fast path, checkpoints, evaluation, logs. A second reading.
def parse_args(argv=None):
    """The flags, unset ones the paper's for the env; with --resume, the run's own (RESUME_MAY_CHANGE's anew)."""
    args, ckpt = tyro.cli(Args, args=argv), None
    if args.resume:
        try:
            ckpt = torch.load(args.resume, map_location="cpu", weights_only=False)
        except Exception as e:
            error(f"{args.resume} is not a readable checkpoint ({type(e).__name__})" if os.path.isfile(args.resume)
                  else f"no checkpoint file at {args.resume}")
        if not isinstance(ckpt, dict) or "agent" not in ckpt:
            error(f"{args.resume} is not a cleanmisl checkpoint")
        if ckpt["agent"] != AGENT:
            error(f"{args.resume} is a {ckpt['agent']} checkpoint, not a {AGENT} one")
        if set(ckpt["args"]) - {f.name for f in fields(Args)} or "since_eval" not in ckpt:
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
    h = envs.ENV_SPECS[args.env_id].horizon
    ep = args.num_envs * h  # the env steps of one epoch
    if args.buffer_size < ep:
        error(f"--buffer-size must hold one epoch (--num-envs × {h} = {ep} transitions), got {args.buffer_size}")
    if args.total_env_steps < ep:
        error(f"--total-env-steps must cover one epoch (--num-envs × {h} = {ep} env steps), got {args.total_env_steps}")
    stored = min(args.total_env_steps // ep * ep, args.buffer_size // h * h)
    if args.grad_steps_per_epoch and args.learning_starts > stored:
        error(f"--learning-starts must be at most --total-env-steps and --buffer-size in whole epochs and trajectories "
              f"({stored}), or the run never learns; got {args.learning_starts}")
    if ckpt and args.total_env_steps // ep <= ckpt["epoch"]:
        error(f"{args.resume} has already trained for {ckpt['epoch'] * ep} env steps; give a larger "
              "--total-env-steps to continue it")
    return args, ckpt


def env_defaults(env_id):  # the paper's values that depend on the env
    paper = ("total_env_steps", "num_envs", "grad_steps_per_epoch", "buffer_size", "eval_every")
    return {"skill_dim": SKILL_DIMS[env_id], **{flag: getattr(envs.ENV_SPECS[env_id], flag) for flag in paper}}


def start_run(args, ckpt):  # the run's folder, Ctrl-C, W&B, TensorBoard, the flags
    run_name = ckpt["run_name"] if ckpt else f"{args.env_id}__{AGENT}__{args.seed}__{int(time.time())}"
    run_dir = os.path.dirname(os.path.abspath(args.resume)) if ckpt else os.path.join("runs", run_name)
    os.makedirs(run_dir, exist_ok=True)
    signal.signal(signal.SIGINT, lambda *_: error("interrupted", run_dir))  # every write is atomic
    if args.track:
        import wandb
        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, save_code=True, resume="allow", id=run_name)
    # TensorBoard writes from a thread: a failed write raises at the next add_scalar
    threading.excepthook = lambda hook: None if issubclass(hook.exc_type, OSError) else threading.__excepthook__(hook)
    writer = SummaryWriter(run_dir)
    table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    resolved = (*env_defaults(args.env_id), "checkpoint_every")
    flags = ", ".join(f"--{flag.replace('_', '-')} {getattr(args, flag)}" for flag in resolved)
    print(f"{args.env_id} (horizon {envs.ENV_SPECS[args.env_id].horizon}): {flags}"
          + (" (the run's own)" if ckpt else " (a flag left unset: the paper's for the env)"), flush=True)
    return run_name, run_dir, writer


def check_memory(args, space, action_dim, spec, device):  # refuses what cannot fit, before allocating
    frame_bytes = math.prod(space.shape) // spec.frame_stack * space.dtype.itemsize
    trajectory_bytes = (spec.horizon + 1) * frame_bytes + 4 * (spec.horizon * action_dim + args.skill_dim)
    host = {"the replay buffer (--buffer-size)": args.buffer_size // spec.horizon * trajectory_bytes}
    on_device = {"the networks (--hidden-dim)": 4 * args.hidden_dim**2 * (4 * 4 + 2), "one batch (--batch-size)":
                 4 * args.batch_size * (2 * math.prod(space.shape) + 8 * args.hidden_dim)}
    if args.buffer_on_device:
        host, on_device = {}, {**host, **on_device}
    places = {"GPU": on_device, "host": host} if device.type == "cuda" else {"host": {**host, **on_device}}
    for place, parts in places.items():
        free = torch.cuda.mem_get_info(device)[0] if place == "GPU" else envs.free_host_memory()
        if sum(parts.values()) > free:
            error(f"this run needs at least {sum(parts.values()) / 2**30:,.1f} GiB of {place} memory: " + ", ".join(
                f"{name} {size / 2**30:,.1f}" for name, size in parts.items()) + f"; {free / 2**30:,.1f} GiB is free")


def adam_options(args, device):  # foreach (compile fuses it), fused under --cudagraphs alone
    fused, capturable = args.cudagraphs and not args.compile, args.cudagraphs and device.type == "cuda"
    return {"lr": args.lr, "fused": fused, "foreach": not fused, "capturable": capturable}


class CudaGraphStep:  # 3 warm-up steps, then one recorded as a CUDA graph
    def __init__(self, step):
        self.step, self.calls, self.graph = step, 0, None

    def __call__(self, batch):
        if self.calls < 3:
            self.calls += 1
            side = torch.cuda.Stream()
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
        for k, v in batch.items():
            self.batch[k].copy_(v)
        self.graph.replay()
        return {k: v.clone() for k, v in self.stats.items()}


def save_checkpoint(run_dir, args, run_name, epoch, grad_steps, wall_time, window, modules, rb, streams, device):
    """What a resumed run needs to go on as this one would, written atomically; never NaN or inf."""
    state = {"agent": AGENT, "args": asdict(args), "run_name": run_name, "epoch": epoch, "grad_steps": grad_steps,
             "wall_time": wall_time, "buffer": rb.state_dict(), "torch_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
             "numpy_rng": streams["rng"].bit_generator.state, "eval_numpy_rng": streams["eval_rng"].bit_generator.state,
             "eval_torch_rng": streams["eval_generator"].get_state(),
             "env_rngs": [rng for vector in streams["envs"] for rng in envs.env_rng_states(vector)],
             "since_eval": {**window, "start": time.time() - window["start"]},
             **{name: module.detach().cpu() if torch.is_tensor(module) else module.state_dict()
                for name, module in modules.items()}}
    diverged = non_finite({name: state[name] for name in modules})
    if diverged:
        error(f"{diverged[0]} holds NaN or inf at epoch {epoch} ({len(diverged)} tensors do): the run diverged",
              run_dir)
    write_atomically(os.path.join(run_dir, "checkpoint.pt"), lambda tmp: torch.save(state, tmp), run_dir)


def non_finite(state, prefix=""):  # the names of NaN or inf tensors in a state dict
    if torch.is_tensor(state):
        return [prefix] if state.is_floating_point() and not torch.isfinite(state).all() else []
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else []
    return [name for key, value in items for name in non_finite(value, f"{prefix}.{key}".lstrip("."))]


def restore_checkpoint(ckpt, args, modules, rb, streams, device):
    """The checkpoint's state back; another version's ends the run in one line."""
    try:
        for name, module in modules.items():  # Adam with this run's options
            if hasattr(module, "param_groups"):
                ckpt[name]["param_groups"] = [g | adam_options(args, device) for g in ckpt[name]["param_groups"]]
            module.data.copy_(ckpt[name]) if torch.is_tensor(module) else module.load_state_dict(ckpt[name])  # log α
        rb.load_state_dict(ckpt["buffer"])
        torch.set_rng_state(ckpt["torch_rng"])
        if device.type == "cuda" and ckpt["cuda_rng"] is not None:
            restore_cuda_rng(ckpt["cuda_rng"])
        streams["eval_generator"].set_state(ckpt["eval_torch_rng"])
        streams["rng"].bit_generator.state = ckpt["numpy_rng"]
        streams["eval_rng"].bit_generator.state = ckpt["eval_numpy_rng"]
        envs.set_env_rng_states(streams["envs"][0], ckpt["env_rngs"][:args.num_envs])
        envs.set_env_rng_states(streams["envs"][1], ckpt["env_rngs"][args.num_envs:])
        saved = ckpt["since_eval"]  # start: seconds before the checkpoint
        stats = [{k: v.to(device) for k, v in means.items()} for means in saved["stats"]]
        window = {**saved, "stats": stats, "start": time.time() - saved["start"], "resumed_at": ckpt["epoch"]}
    except (KeyError, RuntimeError, ValueError, AttributeError) as e:
        error(f"{args.resume} was written by another version of {AGENT}.py ({' '.join(str(e).split())[:160]})")
    print(f"resumed {ckpt['run_name']} at epoch {ckpt['epoch']}")
    return ckpt["epoch"], ckpt["grad_steps"], ckpt["wall_time"], window


def restore_cuda_rng(states):  # on maybe fewer GPUs
    for index, state in enumerate(states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(state, index)


@torch.no_grad()
@record_function("evaluation")
def evaluate(epoch, grad_steps, wall_time, window, args, actor, phi, rb, eval_envs, streams, device, run_dir, writer):
    """Deterministic rollouts of fresh skills (iod/metra.py: _evaluate_policy): coverage, E‖Δφ‖², means."""
    spec, videos = envs.ENV_SPECS[args.env_id], eval_envs.video_envs
    skills = sample_skills(args.num_eval_skills, args.skill_dim, streams["eval_generator"])
    (obs, info), coordinates, frames = eval_envs.reset(), [], []
    for t in range(spec.horizon + 1):  # after the reset and every step
        coordinates.append(info["coordinates"])
        frames += [np.concatenate(envs.render_envs(eval_envs, videos), 1)] if videos else []
        if t < spec.horizon:
            action = actor.mode(torch.as_tensor(obs, device=device), skills.to(device))
            obs, _, _, _, info = eval_envs.step(finite(action, epoch))
    paths, env_steps = np.stack(coordinates, 1), epoch * args.num_envs * spec.horizon  # (rollouts, horizon + 1, dims)
    result = {"epoch": epoch, "env_steps": env_steps, "grad_steps": grad_steps, "wall_time": round(wall_time, 2),
              "coverage": envs.coverage(paths, args.env_id)}
    writer.add_scalar("eval/coverage", result["coverage"], env_steps)
    if rb.size > 0:  # E‖Δφ‖² on ≤ 10k replay transitions
        n = min(10_000, rb.size)
        batches = (rb.sample(min(1000, n - i), device, rng=streams["eval_rng"]) for i in range(0, n, 1000))
        result["dphi_sq"] = torch.cat([transition_features(phi, b["obs"], b["next_obs"], args.critic).pow(2).sum(-1)
                                       for b in batches]).mean().item()
        writer.add_scalar("eval/dphi_sq", result["dphi_sq"], env_steps)
    if window["stats"]:
        per_epoch = torch.stack([torch.stack(list(means.values())) for means in window["stats"]])
        result |= dict(zip(window["stats"][0], per_epoch.mean(0).tolist()))
    result |= {"sps": window["env_steps"] / (time.time() - window["start"])} if window["env_steps"] else {}
    result |= {"ms_per_grad_step": 1000 * window["train_time"] / window["grad_steps"]} if window["grad_steps"] else {}
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    z = skills.numpy()
    fig, ax = plt.subplots(figsize=(5, 5))  # colour: the angle of (z_0, z_1), or z's sign
    angle = np.arctan2(z[:, 1], z[:, 0]) if args.skill_dim > 1 else np.pi * (z[:, 0] > 0)
    envs.draw_coordinates(ax, paths, plt.cm.hsv((angle + np.pi) / (2 * np.pi)), args.env_id)
    ax.set_title(f"CSF {args.env_id}, {env_steps:,} env steps, coverage {result['coverage']}")
    fig.tight_layout()
    write_atomically(f"{run_dir}/skills_{env_steps:010d}.png", lambda tmp: fig.savefig(tmp, dpi=100), run_dir)
    plt.close(fig)
    if videos:
        import imageio
        os.makedirs(f"{run_dir}/videos", exist_ok=True)
        video = f"{run_dir}/videos/skills_{env_steps:010d}.mp4"
        write_atomically(video, lambda tmp: imageio.mimsave(tmp, frames, fps=20), run_dir)
    log_path, kept = f"{run_dir}/eval.jsonl", []  # a resume drops lines after its checkpoint
    logged = pathlib.Path(log_path).read_text() if os.path.isfile(log_path) else ""
    lines = [line for line in logged.splitlines() if line.strip()]
    for number, line in enumerate(lines, 1):
        try:
            kept += [line] if json.loads(line)["epoch"] <= window.get("resumed_at", epoch - 1) else []
        except (ValueError, KeyError, TypeError):
            if number < len(lines):
                error(f"line {number} of {log_path} is not an evaluation; mend or delete it, then resume")
            print(f"warning: dropped the torn last line of {log_path}", file=sys.stderr)
    text = "\n".join([*kept, json.dumps(result)]) + "\n"
    write_atomically(log_path, lambda tmp: pathlib.Path(tmp).write_text(text), run_dir)
    print(f"eval  epoch {epoch} | env steps {env_steps:,} | coverage {result['coverage']} | " + " | ".join(
        f"{k} {v:.4g}" for k, v in list(result.items())[5:-1]), flush=True)


def new_window():  # since the last evaluation
    return {"stats": [], "train_time": 0.0, "grad_steps": 0, "start": time.time(), "env_steps": 0}


def log_epoch(writer, epoch, env_steps, grad_steps, sps, window, args, step_stats, train_time):
    """A NaN or inf *_loss ends the run, naming its step; else the means go to the window and TensorBoard."""
    if step_stats:
        names = list(step_stats[0])
        per_step = torch.stack([torch.stack(list(stats.values())) for stats in step_stats])  # (steps, stats)
        losses = [i for i, name in enumerate(names) if name.endswith("_loss")]
        bad = ~torch.isfinite(per_step[:, losses])
        if bad.any():
            step, which = bad.nonzero()[0].tolist()
            error(f"{names[losses[which]]} is {per_step[step, losses[which]].item()} at gradient step "
                  f"{grad_steps - len(step_stats) + step + 1} (epoch {epoch})", writer.log_dir)
        means = per_step.mean(0)
        window["stats"].append(dict(zip(names, means)))
        window["grad_steps"] += len(step_stats)
        window["train_time"] += train_time
        for name, value in zip(names, means.tolist()):
            writer.add_scalar(f"losses/{name}" if name.endswith("loss") else f"charts/{name}", value, env_steps)
    writer.add_scalar("charts/SPS", int(sps), env_steps)
    writer.add_scalar("charts/grad_steps", grad_steps, env_steps)
    if (epoch + 1) % 10 == 0:
        last = {k: v.item() for k, v in window["stats"][-1].items()} if window["stats"] else {}
        left = duration((args.total_env_steps - env_steps) / sps)
        print(f"epoch {epoch + 1} | env steps {env_steps:,} | SPS {int(sps)} | {left} left | "
              + " | ".join(f"{k} {v:.4g}" for k, v in last.items()), flush=True)


def duration(seconds):  # "45 s", "12 min", "3 h 05 min"
    m = round(seconds / 60)
    return f"{seconds:.0f} s" if seconds < 60 else f"{m} min" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def finite(action, epoch):  # for the envs; NaN or inf ends the run
    if not np.isfinite(action := action.cpu().numpy()).all():
        error(f"the policy's action is not finite at epoch {epoch}: its networks diverged")
    return action


def error(message, run_dir=None):  # one line, no traceback
    if run_dir:
        path = os.path.join(run_dir, "checkpoint.pt")
        message += f"; resume with --resume {path}" if os.path.isfile(path) else "; no checkpoint was written yet"
    sys.exit(f"{AGENT}.py: error: {message}")


def write_atomically(path, write, run_dir):  # a failed write leaves the old file whole
    temporary = "{}.tmp{}".format(*os.path.splitext(path))  # its extension names the format
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException as e:  # no temporary left behind
        with contextlib.suppress(OSError):
            os.remove(temporary)
        if not isinstance(e, (OSError, RuntimeError)):  # torch.save fails with a RuntimeError
            raise
        cut_short = "unexpected pos" in str(e) or "write failed" in str(e)
        reason = (e.strerror or str(e)) if isinstance(e, OSError) else (
            "the write was cut short: is the disk full?" if cut_short else " ".join(str(e).split())[:120])
        error(f"cannot write {path} ({reason})", run_dir)


if __name__ == "__main__":
    args, ckpt = parse_args()
    try:
        main(args, ckpt)
    except OSError as e:  # the run's folder or TensorBoard's file
        error(f"cannot write {os.fsdecode(e.filename) if e.filename else 'the TensorBoard log'} ({e.strerror or e})")
