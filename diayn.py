"""DIAYN, Diversity is All You Need (Eysenbach, Gupta, Ibarz and Levine, ICLR 2019): a baseline of "Can a MISL Fly?
Analysis and Ingredients for Mutual Information Skill Learning" (Zheng, Tuyls, Peng and Eysenbach, ICLR 2025).

A skill z ~ p(z), one of K one-hot vectors drawn uniformly, is held for a whole trajectory of the policy π(a | s, z).
A discriminator q(z | s') and π both maximize the reverse variational lower bound (App. A.5; DIAYN's Eq. 2 and 3)
    I(S; Z) ≥ H(Z) + E[log q(z | s)] = E[log q(z | s) - log p(z)].
As in the official code, q reads the *next* observation, its logits the K outputs of a network φ: q(z | s') =
softmax(φ(s'))_z, trained on the cross-entropy. π is SAC on r(s, a, s', z) = log q(z | s') + log K from the φ just
updated: twin critics Q_k(s, a, z) regressed onto r + γ (min_k Q̄_k(s', a', z) - α log π(a' | s', z)), a' ~ π(·|s', z),
never terminal, with α fixed at 0.1 (the official --sac_lr_a -1).

    python diayn.py --env-id Ant                                              # the paper's run: 64M env steps
    python diayn.py --env-id Ant --hidden-dim 256 --total-env-steps 3000000   # a smaller run, for a CPU
    python diayn.py --env-id Humanoid                                         # 64×64 pixels (wants a GPU)

Deliberate differences from the official code (github.com/Princeton-RL/contrastive-successor-features, iod/metra.py
with --inner 0), none in the algorithm:
  - no --turn_off_dones flag: a time limit is never terminal, as every official script sets it.
  - left out, never changing learning: the target φ iod/metra.py never updates, its Gaussian φ's std head, the
    frozen α's optimizer, the stored rewards, next actions and returns. Skills are torch's draws, not NumPy's.
  - Robobin follows the official DIAYN Robobin script, not App. B.3's K = 50 one-hot: z ~ N(0, I_9), q(z|s') =
    N(μ(s'), σ(s')) (log σ an MLP of its own), r = log q(z|s') - log(1/9); its evaluations report mean log q(z|s').
  - evaluation every 500 epochs on Ant, 125 on Quadruped and Humanoid, as csf.py (the official scripts: half as
    often); the last epoch is always evaluated and checkpointed; every evaluation but epoch 0's reports the
    discriminator's accuracy (chance 1/K) on up to 10k replay transitions drawn with replacement; --buffer-size is
    rounded down to whole trajectories; a resumed run reports what the uninterrupted run does.
  - pixels: each frame is stored once (3.7 GB, not 22 GB, at 300k transitions); envs.py seeds every env apart
    (run/train.py: alike) and on a CPU renders without shadows or multisampling by default.
  - on a GPU, float32 matmuls use TF32 (the tests' numbers are the CPU's, in float32).
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
AGENT = "diayn"
World = Literal["Ant", "HalfCheetah", "Quadruped", "Humanoid", "Kitchen", "Robobin"]
# App. B.3's K, but Robobin's official script's 9-D Gaussian z (see the header)
SKILL_DIMS = {"Ant": 50, "HalfCheetah": 50, "Quadruped": 50, "Humanoid": 50, "Kitchen": 50, "Robobin": 9}
GAUSSIAN_ENVS = ("Robobin",)  # z ~ N(0, I_d) and a Gaussian q


@dataclass
class Args:
    env_id: World = "Ant"  # The world: Ant and HalfCheetah as states, the others as 64×64 pixels.
    skill_dim: Optional[int] = None  # Number K of one-hot skills (unset: 50), on Robobin the d of z ~ N(0, I_d) (9).
    seed: int = 1  # Seed of torch, numpy and the envs; on a CPU, a seed gives one run.
    total_env_steps: Optional[int] = None  # Training budget in env steps (unset: 64M on states, 4.8M on pixels).
    num_envs: Optional[int] = None  # Trajectories per epoch, one skill each (unset: 8, Robobin 10).
    grad_steps_per_epoch: Optional[int] = None  # Gradient steps per epoch (unset: the paper's, 50-200).
    learning_starts: int = 10_000  # Transitions stored before the first gradient step.
    batch_size: int = 256  # Transitions per minibatch.
    buffer_size: Optional[int] = None  # Replay capacity in transitions (unset: 1M; pixels 300k, Kitchen 100k).
    hidden_dim: int = 1024  # Width of the hidden layers of φ, Q and π.
    eval_every: Optional[int] = None  # Epochs between evaluations, and the last epoch (unset: 125-1000, by world).
    checkpoint_every: Optional[int] = None  # Epochs between checkpoints, and the last epoch (unset: --eval-every).
    resume: Optional[str] = None  # A checkpoint.pt to continue, in its run's folder, with its flags.
    cuda: bool = True  # Use the GPU when torch sees one.
    parallel_envs: bool = True  # Step the envs in worker processes (the same numbers).
    buffer_on_device: bool = False  # Keep the replay buffer on the training device.
    cudagraphs: bool = False  # On a GPU, record the gradient step once as a CUDA graph and replay it.
    compile: bool = False  # Compile the gradient step with torch.compile.
    bf16: bool = False  # On pixels, run the encoders' convolutions in bfloat16.
    track: bool = False  # Also log to Weights & Biases (WANDB_MODE=offline works).
    wandb_project_name: str = "cleanmisl"  # The W&B project, with --track.
    wandb_entity: Optional[str] = None  # The W&B team, with --track.
    capture_video: bool = False  # At each evaluation, write an MP4 of up to four rollouts side by side.
    num_eval_skills: int = 48  # Deterministic rollouts per evaluation, the skills in turn.
    gamma: float = 0.99  # Discount of the SAC critic.
    tau: float = 0.005  # Polyak step of the target Q networks.
    lr: float = 1e-4  # Adam learning rate of φ, Q and π.
    alpha: float = 0.1  # Entropy temperature α, fixed, as in the official scripts.


# Every numeric flag's meaningful values ("[" closed end, "(" open end); NaN is never inside.
FLAG_RANGES = {
    "skill_dim": "[2, inf)", "seed": "[0, 2147483647]", "total_env_steps": "[1, inf)", "num_envs": "[1, inf)",
    "grad_steps_per_epoch": "[0, inf)", "learning_starts": "[0, inf)", "batch_size": "[1, inf)",
    "buffer_size": "[1, inf)", "hidden_dim": "[1, inf)", "eval_every": "[1, inf)", "checkpoint_every": "[1, inf)",
    "num_eval_skills": "[1, inf)", "gamma": "[0, 1)", "tau": "(0, 1]", "lr": "(0, inf)", "alpha": "[0, inf)"}
# What --resume may change: not the problem learned (the device may change the draws).
RESUME_MAY_CHANGE = ("total_env_steps", "eval_every", "checkpoint_every", "resume", "cuda", "parallel_envs",
                     "buffer_on_device", "cudagraphs", "compile", "bf16", "track", "wandb_project_name",
                     "wandb_entity", "capture_video")


# The losses (DIAYN's Eq. 2 and 3; paper App. A.5)
def sample_skills(n, skill_dim, gaussian=False, generator=None):
    """z ~ p(z): uniform over the K one-hot vectors (the official --discrete 1), or N(0, I_d) on Robobin."""
    if gaussian:
        return torch.randn(n, skill_dim, generator=generator)
    return F.one_hot(torch.randint(skill_dim, (n,), generator=generator), skill_dim).float()


def log_likelihood(discriminator, skill):
    """log q(z|s') per sample, from φ(s'): (B, K) logits, or on Robobin a Gaussian's (mean, log-std)."""
    if isinstance(discriminator, tuple):
        mean, log_std = discriminator
        return torch.distributions.Normal(mean, log_std.exp(), validate_args=False).log_prob(skill).sum(-1)
    return (F.log_softmax(discriminator, dim=-1) * skill).sum(-1)


def diayn_reward(discriminator, skill):
    """r = log q(z|s') - log p(z) = log q(z|s') + log K (DIAYN's Eq. 3; on Robobin + log d, as its script)."""
    return log_likelihood(discriminator, skill) + math.log(skill.shape[-1])


def discriminator_loss(discriminator, skill):
    """L(φ) = -E[log q(z|s') - log p(z)], the cross-entropy less log K (the official -E[r]); and the rewards."""
    reward = diayn_reward(discriminator, skill)
    return -reward.mean(), reward


def qf_objective(qf, qf_target, phi, actor, obs, action, next_obs, skill, alpha, gamma):
    """L(Q) = Σ_k ½ E[(Q_k(s, a, z) - y)²], y = r + γ (min_k Q̄_k(s', a', z) - α log π(a'|s', z)), a' ~ π(·|s', z),
    never terminal (iod/sac_utils.py), r from the φ just updated; and the rewards."""
    with torch.no_grad():
        reward = diayn_reward(phi(next_obs), skill)
        next_action, next_log_prob = actor.sample(next_obs, skill)
        next_q = torch.stack([net(next_obs, skill, next_action) for net in qf_target])
        target = reward + gamma * (next_q.amin(0) - alpha * next_log_prob)
    return sum(0.5 * F.mse_loss(q_k, target) for q_k in [net(obs, skill, action) for net in qf]), reward


def actor_objective(actor, qf, obs, skill, alpha):
    """L(π) = E[α log π(a|s, z) - min_k Q_k(s, a, z)], a ~ π(·|s, z) reparameterized."""
    new_action, log_prob = actor.sample(obs, skill)
    q = torch.stack([net(obs, skill, new_action) for net in qf]).amin(0)
    return (alpha * log_prob - q).mean()


# The networks (official run/train.py), each with its own pixel encoder
def mlp(in_dim, hidden_dim, out_dim, activation, init):  # Linear → act → Linear → act → Linear, zero biases
    net = nn.Sequential(nn.Linear(in_dim, hidden_dim), activation(), nn.Linear(hidden_dim, hidden_dim),
                        activation(), nn.Linear(hidden_dim, out_dim))
    for layer in net[::2]:
        init(layer.weight)
        nn.init.zeros_(layer.bias)
    return net


class Phi(nn.Module):  # φ(s') ∈ R^K, q(z|s')'s logits (ReLU, Xavier-uniform), or its mean and log-std
    def __init__(self, space, skill_dim, hidden_dim, gaussian=False):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        self.net = mlp(features, hidden_dim, skill_dim, nn.ReLU, nn.init.xavier_uniform_)
        self.log_std = mlp(features, hidden_dim, skill_dim, nn.ReLU, nn.init.xavier_uniform_) if gaussian else None

    def forward(self, obs):
        h = self.encoder(obs)
        return self.net(h) if self.log_std is None else (self.net(h), self.log_std(h))


class QNetwork(nn.Module):  # Q(s, a, z) ∈ R (ReLU, Xavier-normal)
    def __init__(self, space, action_dim, skill_dim, hidden_dim):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        self.net = mlp(features + skill_dim + action_dim, hidden_dim, 1, nn.ReLU, nn.init.xavier_normal_)

    def forward(self, obs, skill, action):
        return self.net(torch.cat([self.encoder(obs), skill, action], -1)).squeeze(-1)


class Actor(nn.Module):  # π(a | s, z): a tanh-squashed Gaussian, its output layers 10x smaller
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
        normal = torch.distributions.Normal(mean, log_std.exp(), validate_args=False)  # a NaN: caught per epoch
        u = normal.rsample()
        action = torch.tanh(u)
        log_prob = normal.log_prob(u).sum(-1) - torch.log((1 - action.pow(2)).clamp(0, 1) + 1e-6).sum(-1)
        return action, log_prob

    def mode(self, obs, skill):
        return torch.tanh(self(obs, skill)[0])


@contextlib.contextmanager
def frozen(modules):  # no gradient into the modules' weights, only through them
    for module in modules:
        module.requires_grad_(False)
    try:
        yield
    finally:
        for module in modules:
            module.requires_grad_(True)


class ReplayBuffer:
    """A ring of whole trajectories, (s, a, s', z) drawn uniformly with replacement, only a stack's newest frame
    stored. `device`: where the storage lives and training batches are drawn; None: numpy, on the host."""

    def __init__(self, capacity, horizon, space, frame_stack, action_dim, skill_dim, rng, device=None):
        frame_shape = space.shape[:-1] + (space.shape[-1] // frame_stack,)
        n = capacity // horizon  # whole trajectories
        self.horizon, self.rng, self.device, self.pos, self.num_stored = horizon, rng, device, 0, 0
        self.frames = self.zeros((n, horizon + 1, *frame_shape), space.dtype)
        self.actions = self.zeros((n, horizon, action_dim), np.float32)
        self.skills = self.zeros((n, skill_dim), np.float32)
        self.frame_offsets = self.to_storage(np.arange(1 - frame_stack, 2))
        self.generator = None if device is None else torch.Generator(device).manual_seed(int(rng.integers(2**62)))

    def zeros(self, shape, dtype):
        if self.device is None:
            return np.zeros(shape, dtype)
        return torch.zeros(shape, dtype=getattr(torch, np.dtype(dtype).name), device=self.device)

    def to_storage(self, array, like=None):  # a host array as the storage holds it
        if self.device is None:
            return array
        return torch.as_tensor(array, dtype=None if like is None else like.dtype, device=self.device)

    @property
    def size(self):  # stored transitions
        return self.num_stored * self.horizon

    def add(self, observations, actions, skills):  # (n, horizon + 1, *obs), (n, horizon, |A|), (n, d)
        n, capacity = len(observations), len(self.frames)
        idx = self.to_storage((self.pos + np.arange(n)) % capacity)
        self.frames[idx] = self.to_storage(observations[..., -self.frames.shape[-1]:], self.frames)  # newest frames
        self.actions[idx] = self.to_storage(actions, self.actions)
        self.skills[idx] = self.to_storage(skills, self.skills)
        self.pos, self.num_stored = (self.pos + n) % capacity, min(self.num_stored + n, capacity)

    def gather(self, batch_size, rng=None):  # s and s' as one (B, k + 1) block of frames
        if self.device is None or rng is not None:
            i = self.to_storage((rng or self.rng).integers(0, self.size, batch_size))
        else:
            i = torch.randint(0, self.size, (batch_size,), generator=self.generator, device=self.device)
        trajectory, t = i // self.horizon, i % self.horizon
        steps = (t[:, None] + self.frame_offsets).clip(min=0)  # frames t-k+1..t+1, the first repeated before t = 0
        return {"frames": self.frames[trajectory[:, None], steps], "action": self.actions[trajectory, t],
                "skill": self.skills[trajectory]}

    def sample(self, batch_size, device, rng=None):  # copied to `device`, stacked there
        batch = self.gather(batch_size, rng)
        if self.device is None:
            batch = {key: torch.from_numpy(value) for key, value in batch.items()}
            if torch.device(device).type == "cuda":
                batch = {key: value.pin_memory().to(device, non_blocking=True) for key, value in batch.items()}
        frames = batch.pop("frames")  # a stack's frames go along the last axis
        return {"obs": frames[:, :-1].movedim(1, -2).flatten(-2).contiguous(),
                "next_obs": frames[:, 1:].movedim(1, -2).flatten(-2).contiguous(), **batch}

    def state_dict(self):  # tensors over the stored part, on the host
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
    """DIAYN epoch by epoch (iod/iod.py: IOD.train): evaluate, collect, update; with checkpoints, logs, a NaN stop."""
    spec = envs.ENV_SPECS[args.env_id]
    steps_per_epoch = args.num_envs * spec.horizon
    num_epochs = args.total_env_steps // steps_per_epoch
    run_name, run_dir, writer = start_run(args, ckpt)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32
    try:  # a world that cannot render: one line
        num_video_envs = 4 if args.capture_video else 0
        train_envs, eval_envs = envs.make_envs(functools.partial(envs.make_env, args.env_id), args.num_envs,
                                               args.num_eval_skills, args.seed, num_video_envs, args.parallel_envs)
    except (envs.RenderUnavailable, MemoryError) as e:
        error(e)
    streams = {"rng": rng, "eval_rng": np.random.default_rng(args.seed + 1),  # evaluation's own
               "eval_generator": torch.Generator().manual_seed(args.seed + 1), "envs": (train_envs, eval_envs)}
    space = train_envs.single_observation_space  # states, or stacked 64×64 RGB frames
    action_dim, d = train_envs.single_action_space.shape[0], args.skill_dim
    gaussian = args.env_id in GAUSSIAN_ENVS
    check_memory(args, space, action_dim, spec.horizon, spec.frame_stack, device)
    phi = Phi(space, d, args.hidden_dim, gaussian).to(device)
    qf = [QNetwork(space, action_dim, d, args.hidden_dim).to(device) for _ in range(2)]  # twin critics
    qf_target = [QNetwork(space, action_dim, d, args.hidden_dim).to(device) for _ in qf]
    for net, target in zip(qf, qf_target):
        target.load_state_dict(net.state_dict())
    actor = Actor(space, action_dim, d, args.hidden_dim).to(device)
    if args.bf16:
        envs.encoders_in_bf16(phi, *qf, *qf_target, actor)
    adam = adam_options(args, device)
    qf_params = [param for net in qf for param in net.parameters()]
    qf_target_params = [param for net in qf_target for param in net.parameters()]
    phi_optimizer = torch.optim.Adam(phi.parameters(), **adam)
    qf_optimizer = torch.optim.Adam(qf_params, **adam)  # one optimizer for both twins
    actor_optimizer = torch.optim.Adam(actor.parameters(), **adam)  # α is fixed
    rb = ReplayBuffer(args.buffer_size, spec.horizon, space, spec.frame_stack, action_dim, d, rng,
                      device if args.buffer_on_device else None)
    modules = {"phi": phi, **{f"qf{k}": net for k, net in enumerate(qf, 1)},  # the checkpoint's keys
               **{f"qf{k}_target": net for k, net in enumerate(qf_target, 1)}, "actor": actor,
               "phi_optimizer": phi_optimizer, "qf_optimizer": qf_optimizer, "actor_optimizer": actor_optimizer}
    start_epoch, grad_steps, wall_time, since_eval = 0, 0, 0.0, new_window()
    if ckpt:
        start_epoch, grad_steps, wall_time, since_eval = restore_checkpoint(ckpt, args, modules, rb, streams, device)

    def update(batch):
        """φ, then Q on the rewards of the φ just updated, then π, then Q̄ (iod/metra.py's order)."""
        obs, action, next_obs, skill = batch["obs"], batch["action"], batch["next_obs"], batch["skill"]
        with record_function("phi step"):
            phi_loss, _ = discriminator_loss(phi(next_obs), skill)
            phi_optimizer.zero_grad()
            phi_loss.backward()
            phi_optimizer.step()
        with record_function("qf step"):
            qf_loss, reward = qf_objective(qf, qf_target, phi, actor, obs, action, next_obs, skill, args.alpha,
                                           args.gamma)
            qf_optimizer.zero_grad()
            qf_loss.backward()
            qf_optimizer.step()
        with record_function("actor step"), frozen(qf):  # through Q to the action, not into Q
            actor_loss = actor_objective(actor, qf, obs, skill, args.alpha)
            actor_optimizer.zero_grad()
            actor_loss.backward()
            actor_optimizer.step()
        with torch.no_grad():  # Q̄ ← (1 - τ) Q̄ + τ Q, every tensor in one call
            torch._foreach_lerp_(qf_target_params, qf_params, args.tau)
        return {"phi_loss": phi_loss.detach(), "qf_loss": qf_loss.detach(), "actor_loss": actor_loss.detach(),
                "reward": reward.mean().detach()}  # on the device: nothing waits for the host

    if args.compile:  # on a CPU, with eager's random draws
        torch._inductor.config.fallback_random = device.type == "cpu"
        update = torch.compile(update)
    if args.cudagraphs and device.type != "cuda":
        print("--cudagraphs: CUDA graphs need a GPU; on the CPU the gradient step runs without them", flush=True)
    update = CudaGraphStep(update) if args.cudagraphs and device.type == "cuda" else update
    segment_start = time.time()
    for epoch in range(start_epoch, num_epochs + 1):
        # evaluate and checkpoint what the previous `epoch` epochs produced
        if (epoch % args.eval_every == 0 or epoch == num_epochs) and not (ckpt and epoch == start_epoch):
            evaluate(epoch, grad_steps, wall_time + time.time() - segment_start, since_eval, args, actor, phi, rb,
                     eval_envs, streams, device, run_dir, writer)
            since_eval = new_window()
        if epoch == num_epochs or (epoch % args.checkpoint_every == 0 and epoch != start_epoch):
            save_checkpoint(run_dir, args, run_name, epoch, grad_steps, wall_time + time.time() - segment_start,
                            since_eval, modules, rb, streams, device)
        if epoch == num_epochs:
            break
        # collect one trajectory per env, one skill each
        skills = sample_skills(args.num_envs, d, gaussian).to(device)
        obs, _ = train_envs.reset()
        observations, actions = [obs], []
        with torch.no_grad(), record_function("collection"):
            for t in range(spec.horizon):
                action = finite(actor.sample(torch.as_tensor(obs, device=device), skills)[0], epoch)
                obs, _, terminated, truncated, _ = train_envs.step(action)
                # never terminal, cut exactly at the horizon: the buffer's layout
                assert not terminated.any() and (truncated == (t == spec.horizon - 1)).all(), (t, terminated, truncated)
                observations.append(obs)  # the last: the final observation
                actions.append(action)
        rb.add(np.stack(observations, 1), np.stack(actions, 1), skills.cpu().numpy())
        since_eval["env_steps"] += steps_per_epoch
        # gradient steps, each on its own minibatch
        train_start, step_stats = time.time(), []
        if rb.size >= args.learning_starts and args.grad_steps_per_epoch > 0:
            for _ in range(args.grad_steps_per_epoch):
                with record_function("sampling"):
                    batch = rb.sample(args.batch_size, device)
                step_stats.append(update(batch))
            grad_steps += args.grad_steps_per_epoch
        log_epoch(writer, epoch, (epoch + 1) * steps_per_epoch, grad_steps, (epoch + 1 - start_epoch) * steps_per_epoch,
                  time.time() - segment_start, since_eval, args, step_stats, time.time() - train_start)
    for opened in (train_envs, eval_envs, writer):
        opened.close()
    if args.track:
        import wandb

        wandb.finish()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as before the run
    print(f"done: {run_dir}")


# INFRASTRUCTURE: the command line, start-up, checkpoints, evaluation, logging. A second reading.
def parse_args(argv=None):
    """The flags, unset ones the paper's for the env; with --resume, the run's own (RESUME_MAY_CHANGE's anew)."""
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
    ep = args.num_envs * h
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
    spec = envs.ENV_SPECS[env_id]
    return {"skill_dim": SKILL_DIMS[env_id], "total_env_steps": spec.total_env_steps, "num_envs": spec.num_envs,
            "grad_steps_per_epoch": spec.grad_steps_per_epoch, "buffer_size": spec.buffer_size,
            "eval_every": spec.eval_every}


def start_run(args, ckpt):
    """The run's folder (a resumed run's: its checkpoint's), Ctrl-C as one line, W&B, TensorBoard."""
    run_name = ckpt["run_name"] if ckpt else f"{args.env_id}__{AGENT}__{args.seed}__{int(time.time())}"
    run_dir = os.path.dirname(os.path.abspath(args.resume)) if ckpt else os.path.join("runs", run_name)
    os.makedirs(run_dir, exist_ok=True)
    signal.signal(signal.SIGINT, lambda *_: error("interrupted", run_dir))  # every write is atomic
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, save_code=True, resume="allow", id=run_name.replace("/", "_"))
    # TensorBoard writes from a thread: a failed write comes back at the next add_scalar
    threading.excepthook = lambda hook: None if issubclass(hook.exc_type, OSError) else threading.__excepthook__(hook)
    writer = SummaryWriter(run_dir)
    table = "\n".join(f"|{flag}|{value}|" for flag, value in vars(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    flags = ", ".join(f"--{flag.replace('_', '-')} {getattr(args, flag)}" for flag in [*env_defaults(args.env_id),
                                                                                       "checkpoint_every"])
    print(f"{args.env_id} (horizon {envs.ENV_SPECS[args.env_id].horizon}): {flags}"
          + (" (the run's own)" if ckpt else " (a flag not given takes the paper's value for the env)"), flush=True)
    return run_name, run_dir, writer


def check_memory(args, space, action_dim, horizon, frame_stack, device):
    """Refuse, before allocating, a run that cannot fit in the free memory, with lower bounds of its parts."""
    frame_bytes = math.prod(space.shape) // frame_stack * space.dtype.itemsize
    trajectory_bytes = (horizon + 1) * frame_bytes + 4 * (horizon * action_dim + args.skill_dim)
    host = {"the replay buffer (--buffer-size)": args.buffer_size // horizon * trajectory_bytes}
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


def adam_options(args, device):  # foreach Adam, fused under --cudagraphs alone
    fused = args.cudagraphs and not args.compile
    capturable = args.cudagraphs and device.type == "cuda"
    return {"lr": args.lr, "fused": fused, "foreach": not fused, "capturable": capturable}


class CudaGraphStep:
    """The step as a CUDA graph: 3 real steps on a side stream, then recorded on a batch refilled to replay."""

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
            self.batch, self.graph = {key: value.clone() for key, value in batch.items()}, torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.stats = self.step(self.batch)
        for key, value in batch.items():
            self.batch[key].copy_(value)
        self.graph.replay()
        return {name: value.clone() for name, value in self.stats.items()}


def save_checkpoint(run_dir, args, run_name, epoch, grad_steps, wall_time, since_eval, modules, rb, streams, device):
    """What a resumed run needs to go on as this one would, written atomically; never a NaN or inf as good."""
    state = {"agent": AGENT, "args": asdict(args), "run_name": run_name, "epoch": epoch, "grad_steps": grad_steps,
             "wall_time": wall_time, "buffer": rb.state_dict(), "torch_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
             "numpy_rng": streams["rng"].bit_generator.state, "eval_numpy_rng": streams["eval_rng"].bit_generator.state,
             "eval_torch_rng": streams["eval_generator"].get_state(),
             "env_rngs": [rng for vector in streams["envs"] for rng in envs.env_rng_states(vector)],
             "since_eval": {**since_eval, "start": time.time() - since_eval["start"]},
             **{name: module.state_dict() for name, module in modules.items()}}
    diverged = non_finite({name: state[name] for name in modules})
    if diverged:  # e.g. Adam's moments overflowed
        error(f"{diverged[0]} holds NaN or inf at epoch {epoch} ({len(diverged)} tensors do): the run diverged",
              run_dir)
    write_atomically(os.path.join(run_dir, "checkpoint.pt"), lambda tmp: torch.save(state, tmp), run_dir)


def non_finite(state, prefix=""):  # the float tensors with NaN or inf in a nested state dict
    if torch.is_tensor(state):
        return [prefix] if state.is_floating_point() and not torch.isfinite(state).all() else []
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else []
    return [name for key, value in items for name in non_finite(value, f"{prefix}.{key}".lstrip("."))]


def restore_checkpoint(ckpt, args, modules, rb, streams, device):
    """A checkpoint's state back, Adam with this run's options; another version's ends the run."""
    try:
        for name, module in modules.items():
            module.load_state_dict(ckpt[name])
            for group in getattr(module, "param_groups", []):
                group.update({key: value for key, value in adam_options(args, device).items() if key != "lr"})
                for param in group["params"]:  # where fused or capturable Adam want them
                    if "step" in module.state.get(param, {}):
                        place = param.device if group["fused"] or group["capturable"] else "cpu"
                        module.state[param]["step"] = module.state[param]["step"].to(place, torch.float32)
        rb.load_state_dict(ckpt["buffer"])
        torch.set_rng_state(ckpt["torch_rng"])
        if device.type == "cuda" and ckpt["cuda_rng"] is not None:
            restore_cuda_rng(ckpt["cuda_rng"])
        streams["eval_generator"].set_state(ckpt["eval_torch_rng"])
        streams["rng"].bit_generator.state = ckpt["numpy_rng"]
        streams["eval_rng"].bit_generator.state = ckpt["eval_numpy_rng"]
        train_envs, eval_envs = streams["envs"]
        envs.set_env_rng_states(train_envs, ckpt["env_rngs"][:train_envs.num_envs])
        envs.set_env_rng_states(eval_envs, ckpt["env_rngs"][train_envs.num_envs:])
        window = ckpt["since_eval"]  # its start: seconds before the checkpoint
        since_eval = {**window, "stats": [{name: value.to(device) for name, value in means.items()}
                                          for means in window["stats"]], "start": time.time() - window["start"],
                      "resumed_at": ckpt["epoch"]}
    except (KeyError, RuntimeError, ValueError, AttributeError) as e:
        error(f"{args.resume} was written by another version of {AGENT}.py ({' '.join(str(e).split())[:160]})")
    env_steps = ckpt["epoch"] * args.num_envs * envs.ENV_SPECS[args.env_id].horizon
    print(f"resumed {ckpt['run_name']} at epoch {ckpt['epoch']} ({env_steps:,} env steps)")
    return ckpt["epoch"], ckpt["grad_steps"], ckpt["wall_time"], since_eval


def restore_cuda_rng(states):  # on the GPUs this machine has, maybe fewer
    for index, state in enumerate(states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(state, index)


def eval_skills(n, skill_dim, gaussian, generator):  # the K one-hots in turn, sorted
    if gaussian:
        return sample_skills(n, skill_dim, True, generator)
    return F.one_hot((torch.arange(n) % skill_dim).sort().values, skill_dim).float()


@torch.no_grad()
@record_function("evaluation")
def evaluate(epoch, grad_steps, wall_time, window, args, actor, phi, rb, eval_envs, streams, device, run_dir, writer):
    """Deterministic rollouts (iod/metra.py: _evaluate_policy) → coverage, plot, disc_*, video, a line of eval.jsonl."""
    spec, gaussian = envs.ENV_SPECS[args.env_id], args.env_id in GAUSSIAN_ENVS
    videos = eval_envs.video_envs
    skills = eval_skills(args.num_eval_skills, args.skill_dim, gaussian, streams["eval_generator"])
    obs, info = eval_envs.reset()
    coordinates, frames, skills_on_device = [info["coordinates"]], [], skills.to(device)
    for t in range(spec.horizon + 1):
        frames += [np.concatenate(envs.render_envs(eval_envs, videos), 1)] if videos else []
        if t < spec.horizon:
            action = finite(actor.mode(torch.as_tensor(obs, device=device), skills_on_device), epoch)
            obs, _, _, _, info = eval_envs.step(action)
            coordinates.append(info["coordinates"])
    paths, env_steps = np.stack(coordinates, 1), epoch * args.num_envs * spec.horizon  # (rollouts, horizon + 1, dims)
    result = {"epoch": epoch, "env_steps": env_steps, "grad_steps": grad_steps, "wall_time": round(wall_time, 2),
              "coverage": envs.coverage(paths, args.env_id)}
    if rb.size > 0:  # how often argmax q(·|s') is z, or mean log q(z|s')
        n = min(10_000, rb.size)
        batches = (rb.sample(min(1000, n - i), device, rng=streams["eval_rng"]) for i in range(0, n, 1000))
        result["disc_log_likelihood" if gaussian else "disc_accuracy"] = torch.cat([
            log_likelihood(phi(b["next_obs"]), b["skill"]) if gaussian
            else (phi(b["next_obs"]).argmax(-1) == b["skill"].argmax(-1)).float() for b in batches]).mean().item()
    if window["stats"]:  # each stat's mean over its epochs
        per_epoch = torch.stack([torch.stack(list(means.values())) for means in window["stats"]])
        result |= dict(zip(window["stats"][0], per_epoch.mean(0).tolist()))
    result |= {"sps": window["env_steps"] / (time.time() - window["start"])} if window["env_steps"] else {}
    result |= {"ms_per_grad_step": 1000 * window["train_time"] / window["grad_steps"]} if window["grad_steps"] else {}
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    z = skills.numpy()
    fig, ax = plt.subplots(figsize=(5, 5))  # Gaussian z: the angle of (z_0, z_1)
    hue = (np.arctan2(z[:, 1], z[:, 0]) + np.pi) / (2 * np.pi) if gaussian else z.argmax(-1) / z.shape[-1]
    envs.draw_coordinates(ax, paths, plt.cm.hsv(hue), args.env_id)
    ax.set_title(f"DIAYN {args.env_id}, {env_steps:,} env steps, coverage {result['coverage']}")
    fig.tight_layout()
    write_atomically(os.path.join(run_dir, f"skills_{env_steps:010d}.png"), lambda tmp: fig.savefig(tmp, dpi=100),
                     run_dir)
    plt.close(fig)
    if videos:
        import imageio

        os.makedirs(os.path.join(run_dir, "videos"), exist_ok=True)
        write_atomically(os.path.join(run_dir, "videos", f"skills_{env_steps:010d}.mp4"),
                         lambda tmp: imageio.mimsave(tmp, frames, fps=20), run_dir)
    for key in [key for key in ("coverage", "disc_accuracy", "disc_log_likelihood") if key in result]:
        writer.add_scalar(f"eval/{key}", result[key], env_steps)
    log_path, kept = os.path.join(run_dir, "eval.jsonl"), []  # a resumed run redoes the later ones
    logged = pathlib.Path(log_path).read_text() if os.path.isfile(log_path) else ""
    lines = [line for line in logged.splitlines() if line.strip()]
    for number, line in enumerate(lines, 1):
        try:
            kept += [line] if json.loads(line)["epoch"] <= window.get("resumed_at", epoch - 1) else []
        except (ValueError, KeyError, TypeError):
            if number < len(lines):
                error(f"line {number} of {log_path} is not an evaluation; mend or delete it, then resume")
            print(f"warning: dropped the torn last line of {log_path}", file=sys.stderr)
    text = "".join(line + "\n" for line in [*kept, json.dumps(result)])
    write_atomically(log_path, lambda tmp: pathlib.Path(tmp).write_text(text), run_dir)
    print(f"eval  epoch {epoch} | env steps {env_steps:,} | coverage {result['coverage']} | " + " | ".join(
        f"{k} {v:.4g}" for k, v in list(result.items())[5:-1]), flush=True)


def new_window():  # since the last evaluation
    return {"stats": [], "train_time": 0.0, "grad_steps": 0, "start": time.time(), "env_steps": 0}


def log_epoch(writer, epoch, env_steps, grad_steps, segment_steps, segment_seconds, window, args,
              step_stats, train_time):
    """A NaN or inf *_loss ends the run; else the epoch's means go to the window and TensorBoard, with the speed."""
    if step_stats:
        names = list(step_stats[0])
        per_step = torch.stack([torch.stack(list(stats.values())) for stats in step_stats])
        losses = [i for i, name in enumerate(names) if name.endswith("_loss")]
        if not torch.isfinite(per_step[:, losses]).all():
            step, which = (~torch.isfinite(per_step[:, losses])).nonzero()[0].tolist()
            error(f"{names[losses[which]]} is {per_step[step, losses[which]].item()} at gradient step "
                  f"{grad_steps - len(step_stats) + step + 1} (epoch {epoch})", writer.log_dir)
        means = per_step.mean(0)
        window["stats"].append(dict(zip(names, means)))
        window["grad_steps"] += len(step_stats)
        window["train_time"] += train_time
        for name, value in zip(names, means.tolist()):
            writer.add_scalar(f"losses/{name}" if name.endswith("loss") else f"charts/{name}", value, env_steps)
    sps = int(segment_steps / segment_seconds)
    writer.add_scalar("charts/SPS", sps, env_steps)
    writer.add_scalar("charts/grad_steps", grad_steps, env_steps)
    if (epoch + 1) % 10 == 0:
        last = {name: value.item() for name, value in window["stats"][-1].items()} if window["stats"] else {}
        left = duration((args.total_env_steps - env_steps) * segment_seconds / segment_steps)
        print(f"epoch {epoch + 1} | env steps {env_steps:,} | SPS {sps} | {left} left | "
              + " | ".join(f"{k} {v:.4g}" for k, v in last.items()), flush=True)


def duration(seconds):  # a time span as people read it: "45 s", "12 min", "3 h 05 min"
    m = round(seconds / 60)
    return f"{seconds:.0f} s" if seconds < 60 else f"{m} min" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def finite(action, epoch):  # the action for the envs; NaN or inf ends the run
    if not np.isfinite(action := action.cpu().numpy()).all():
        error(f"the policy's action is not finite at epoch {epoch}: its networks diverged")
    return action


def error(message, run_dir=None):  # one line, no traceback
    if run_dir:
        checkpoint = os.path.join(run_dir, "checkpoint.pt")
        exists = os.path.isfile(checkpoint)
        message += f"; resume with --resume {checkpoint}" if exists else "; no checkpoint was written yet"
    sys.exit(f"{AGENT}.py: error: {message}")


def write_atomically(path, write, run_dir):  # a failed write leaves the old file whole
    root, extension = os.path.splitext(path)
    temporary = f"{root}.tmp{extension}"  # the extension tells savefig and imageio the format
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException as e:  # no temporary left behind
        with contextlib.suppress(OSError):
            os.remove(temporary)
        if not isinstance(e, (OSError, RuntimeError)):  # torch.save reports a failed write as a RuntimeError
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
