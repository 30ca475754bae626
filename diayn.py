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
    rounded down to whole trajectories; a run resumed from a checkpoint with its own flags reports what the
    uninterrupted one does, but for the clock's figures (wall_time, sps, ms_per_grad_step, peak_rss_mb); one
    continued past its last epoch keeps that epoch's extra evaluation.
  - --buffer-on-device draws its batches with torch's generator on the device, not numpy's: other batches.
  - pixels: each frame is stored once (3.7 GB, not 22 GB, at 300k transitions); envs.py seeds every env apart
    (run/train.py: alike) and, off a GPU render node, renders without shadows or multisampling
    (CLEANMISL_RENDER=official: the official look).
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
AGENT = "diayn"
SKILL_DIMS = {  # App. B.3's K, but Robobin's official script's 9-D Gaussian z (see the header)
    "Ant": 50,
    "HalfCheetah": 50,
    "Quadruped": 50,
    "Humanoid": 50,
    "Kitchen": 50,
    "Robobin": 9,
}
GAUSSIAN_ENVS = ("Robobin",)  # z ~ N(0, I_d) and a Gaussian q


@dataclass
class Args:
    # The world to learn skills in: Ant and HalfCheetah (MuJoCo locomotion, state vectors); Quadruped and Humanoid (DMC
    # locomotion), Kitchen (a Franka arm in a kitchen) and Robobin (a Sawyer arm, two blocks, two bins), 64×64 pixels.
    env_id: Literal["Ant", "HalfCheetah", "Quadruped", "Humanoid", "Kitchen", "Robobin"] = "Ant"
    # The number K of one-hot skills, on Robobin the d of z ~ N(0, I_d); unset, App. B.3's 50 (Robobin 9).
    skill_dim: Optional[int] = None
    seed: int = 1  # The seed of torch, numpy and the envs; on a CPU, one seed gives one run, bit for bit.
    # The env steps to train for, in whole epochs; unset, the paper's (64M on the state worlds, 4.8M on pixels).
    total_env_steps: Optional[int] = None
    num_envs: Optional[int] = None  # The trajectories collected per epoch, a skill each; unset, 8 (Robobin 10).
    # The gradient steps after each collection; unset, the paper's (states 50, Quadruped and Humanoid 200, arms 100).
    grad_steps_per_epoch: Optional[int] = None
    learning_starts: int = 10_000  # The transitions stored before the first gradient step.
    batch_size: int = 256  # The transitions per minibatch, drawn with replacement.
    # The replay capacity in transitions, kept as whole trajectories; unset, 1M (pixels 300k, Kitchen 100k).
    buffer_size: Optional[int] = None
    hidden_dim: int = 1024  # The width of the hidden layers of φ, Q and π.
    # The epochs between evaluations, the last always evaluated; unset, Ant 500, HalfCheetah 1000, pixels 125-500.
    eval_every: Optional[int] = None
    # The epochs between checkpoints, the last one always saved; unset, the value of --eval-every.
    checkpoint_every: Optional[int] = None
    # A checkpoint.pt to continue in its folder, with its flags but those that leave learning alone; unset, a new run.
    resume: Optional[str] = None
    cuda: bool = True  # Whether to train on the GPU when torch sees one.
    parallel_envs: bool = True  # Whether to step the envs in worker processes (the same numbers).
    buffer_on_device: bool = False  # Whether to keep the replay buffer on the device, drawn there by torch's generator.
    cudagraphs: bool = False  # Whether to replay the gradient step and the actions as CUDA graphs, on a GPU.
    compile: bool = False  # Whether to torch.compile the gradient step (on a CPU, the same numbers up to rounding).
    bf16: bool = False  # Whether to run the pixel encoders' convolutions in bfloat16.
    track: bool = False  # Whether to also log to Weights & Biases (WANDB_MODE=offline works).
    wandb_project_name: str = "cleanmisl"  # The W&B project, with --track.
    wandb_entity: Optional[str] = None  # The W&B team, with --track; unset, your default entity.
    capture_video: bool = False  # Whether to write an MP4 of up to four rollouts at each evaluation.
    # The deterministic rollouts per evaluation, the one-hot skills in turn (on Robobin, fresh draws of z).
    num_eval_skills: int = 48
    gamma: float = 0.99  # The discount of the SAC critic.
    tau: float = 0.005  # The Polyak step of the target Q networks per gradient step.
    lr: float = 1e-4  # The Adam learning rate of φ, Q and π.
    alpha: float = 0.1  # The entropy temperature α, fixed, as in the official scripts.


def sample_skills(n, skill_dim, gaussian=False, generator=None):
    """z ~ p(z): uniform over the K one-hot vectors (the official --discrete 1), or N(0, I_d) on Robobin."""
    if gaussian:
        return torch.randn(n, skill_dim, generator=generator)
    index = torch.randint(skill_dim, (n,), generator=generator)
    return F.one_hot(index, skill_dim).float()


def log_likelihood(discriminator, skill):
    """log q(z|s') per sample, from φ(s'): (B, K) logits, or on Robobin a Gaussian's (mean, log-std)."""
    if isinstance(discriminator, tuple):
        mean, log_std = discriminator
        normal = torch.distributions.Normal(mean, log_std.exp(), validate_args=False)
        return normal.log_prob(skill).sum(-1)
    return (F.log_softmax(discriminator, dim=-1) * skill).sum(-1)


def diayn_reward(discriminator, skill):
    """r = log q(z|s') - log p(z) = log q(z|s') + log K (DIAYN's Eq. 3; on Robobin + log d, as its script)."""
    return log_likelihood(discriminator, skill) + math.log(skill.shape[-1])


def discriminator_loss(discriminator, skill):
    """L(φ) = -E[log q(z|s') - log p(z)], the cross-entropy less log K (the official -E[r]); and the rewards."""
    reward = diayn_reward(discriminator, skill)
    return -reward.mean(), reward


def qf_objective(qf, qf_target, actor, reward,
                 obs, action, next_obs, skill, alpha, gamma):
    """L(Q) = Σ_k ½ E[(Q_k(s, a, z) - y)²], y = r + γ (min_k Q̄_k(s', a', z) - α log π(a'|s', z)), a' ~ π(·|s', z),
    never terminal (iod/sac_utils.py)."""
    with torch.no_grad():
        next_action, next_log_prob = actor.sample(next_obs, skill)
        next_q = torch.stack([net(next_obs, skill, next_action) for net in qf_target])
        target = reward + gamma * (next_q.amin(0) - alpha * next_log_prob)
    losses = [0.5 * F.mse_loss(net(obs, skill, action), target) for net in qf]
    return sum(losses)


def actor_objective(actor, qf, obs, skill, alpha):
    """L(π) = E[α log π(a|s, z) - min_k Q_k(s, a, z)], a ~ π(·|s, z) reparameterized."""
    new_action, log_prob = actor.sample(obs, skill)
    q = [net(obs, skill, new_action) for net in qf]
    q = torch.stack(q).amin(0)  # the smaller critic's
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


class Phi(nn.Module):
    """φ(s') ∈ R^K, the logits of q(z|s') (ReLU, Xavier-uniform); with `gaussian` (Robobin), q's mean, and its log-std
    from an MLP of its own. Every network owns its pixel encoder (garagei's with_encoder.py)."""
    def __init__(self, space, skill_dim, hidden_dim, gaussian=False):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        init = nn.init.xavier_uniform_
        self.net = mlp(features, hidden_dim, skill_dim, nn.ReLU, init)
        self.log_std = None
        if gaussian:
            self.log_std = mlp(features, hidden_dim, skill_dim, nn.ReLU, init)

    def forward(self, obs):
        features = self.encoder(obs)
        if self.log_std is None:
            return self.net(features)
        return self.net(features), self.log_std(features)


class QNetwork(nn.Module):
    """Q(s, a, z) ∈ R: an MLP on (s, z, a) (ReLU, Xavier-normal)."""
    def __init__(self, space, action_dim, skill_dim, hidden_dim):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        in_dim = features + skill_dim + action_dim
        self.net = mlp(in_dim, hidden_dim, 1, nn.ReLU, nn.init.xavier_normal_)

    def forward(self, obs, skill, action):
        features = self.encoder(obs)
        features = torch.cat([features, skill, action], -1)
        return self.net(features).squeeze(-1)


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
    """DIAYN epoch by epoch (iod/iod.py: IOD.train): evaluate, checkpoint, collect, update."""
    spec = envs.ENV_SPECS[args.env_id]
    steps_per_epoch = args.num_envs * spec.horizon
    num_epochs = args.total_env_steps // steps_per_epoch
    torch.manual_seed(args.seed)  # the networks, skills, policy noise (and a device buffer's draws)
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
    gaussian = args.env_id in GAUSSIAN_ENVS  # Robobin's z ~ N(0, I_d) and Gaussian q
    width = args.hidden_dim
    phi = Phi(space, d, width, gaussian).to(device)
    qf = nn.ModuleList([QNetwork(space, action_dim, d, width) for _ in range(2)]).to(device)
    qf_target = nn.ModuleList([QNetwork(space, action_dim, d, width) for _ in qf]).to(device)
    qf_target.load_state_dict(qf.state_dict())  # Q̄ = Q
    actor = Actor(space, action_dim, d, width).to(device)
    if args.bf16:
        envs.encoders_in_bf16(phi, qf, qf_target, actor)
    # Adam: fused with --cudagraphs (foreach, which compile fuses, with --compile); its steps on the GPU with graphs
    fused = args.cudagraphs and not args.compile
    capturable = args.cudagraphs and use_gpu
    adam = dict(lr=args.lr, fused=fused, foreach=not fused, capturable=capturable)
    phi_optimizer = torch.optim.Adam(phi.parameters(), **adam)
    qf_optimizer = torch.optim.Adam(qf.parameters(), **adam)  # both Q, on their loss sum
    actor_optimizer = torch.optim.Adam(actor.parameters(), **adam)  # α is fixed
    rng = np.random.default_rng(args.seed)  # a host buffer's draws
    buffer_device = None  # on the host
    if args.buffer_on_device: buffer_device = device
    rb = ReplayBuffer(
        args.buffer_size, spec.horizon, space, spec.frame_stack, action_dim, d, rng, buffer_device)
    learned = dict(  # what a checkpoint saves, under these names
        phi=phi, qf=qf, qf_target=qf_target, actor=actor, buffer=rb,
        phi_optimizer=phi_optimizer, qf_optimizer=qf_optimizer, actor_optimizer=actor_optimizer)
    run, progress = start_run(args, ckpt, learned, train_envs, eval_envs, device)

    def update(obs, action, next_obs, skill):
        """φ on the cross-entropy; Q by TD on r from the φ just updated; π on min_k Q_k + α H(π); then Q̄ (the order
        of iod/metra.py). Stats on the device."""
        with record_function("phi step"):
            phi_loss, _ = discriminator_loss(phi(next_obs), skill)
            optimize(phi_optimizer, phi_loss)
        with record_function("qf step"):
            with torch.no_grad():
                reward = diayn_reward(phi(next_obs), skill)
            qf_loss = qf_objective(
                qf, qf_target, actor, reward, obs, action, next_obs, skill, args.alpha, args.gamma)
            optimize(qf_optimizer, qf_loss)
        with record_function("actor step"):
            actor_loss = actor_objective(actor, qf, obs, skill, args.alpha)
            optimize(actor_optimizer, actor_loss)
        with torch.no_grad():  # Q̄ ← (1 - τ) Q̄ + τ Q
            targets = list(qf_target.parameters())
            torch._foreach_lerp_(targets, list(qf.parameters()), args.tau)
        stats = dict(phi_loss=phi_loss, qf_loss=qf_loss, actor_loss=actor_loss,
                     reward=reward.mean())
        return {name: value.detach() for name, value in stats.items()}

    update = fast_path(update, actor, run, args, device)
    start_epoch = progress["epoch"]
    for epoch in range(start_epoch, num_epochs + 1):
        epoch_start = time.time()
        progress["epoch"] = epoch
        last = epoch == num_epochs
        # evaluate and checkpoint what the previous epochs made (a resumed run skips both at its first epoch)
        if (epoch % args.eval_every == 0 or last) and not (ckpt and epoch == start_epoch):
            evaluate(run, progress, args, phi, rb, device)
        if (epoch % args.checkpoint_every == 0 or last) and epoch != start_epoch:
            save_checkpoint(run, progress, args, learned, device)
        if last:
            break
        # a trajectory per env and skill, from the stochastic policy
        collect_start = time.time()
        skills = sample_skills(args.num_envs, d, gaussian).to(device)
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
        log_epoch(run, progress, args, step_stats, collect_start, train_start)  # a NaN or inf loss ends the run
    train_envs.close()
    eval_envs.close()
    run.writer.close()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as before the run
    print(f"done: {run.dir}")


# INFRASTRUCTURE: the replay buffer, command line, start-up, fast path, checkpoints, evaluation, logs. Read later.
class ReplayBuffer:
    """A ring of whole trajectories (path_buffer_ex.py), each frame once, on the host or on `device` (drawn there)."""
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
        """s, a, s', z drawn with replacement (numpy's `rng`, or a device buffer's torch generator), on `device`."""
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
            values = getattr(self, name)[:stored].cpu()  # a view of a host buffer, a copy of a device one
            state[name] = torch.from_numpy(values.numpy())  # which torch.save writes alone, not the whole ring
        return state

    def load_state_dict(self, state):
        self.added = state["added"]
        self.rng.bit_generator.state = state["rng"]
        for name in ("frames", "actions", "skills"):
            getattr(self, name)[:len(state[name])] = state[name]


FLAG_RANGES = {  # every numeric flag's valid interval ("[" closed, "(" open); NaN is never inside
    **dict.fromkeys(["total_env_steps", "num_envs", "batch_size", "buffer_size", "hidden_dim",
                     "eval_every", "checkpoint_every", "num_eval_skills"], "[1, inf)"),
    **dict.fromkeys(["grad_steps_per_epoch", "learning_starts", "alpha"], "[0, inf)"),
    "skill_dim": "[2, inf)",
    "lr": "(0, inf)",
    "seed": "[0, 2147483647]",
    "gamma": "[0, 1)",
    "tau": "(0, 1]",
}
# flags --resume may change, none changing the problem (the device, --buffer-on-device, --compile, --bf16: the numbers)
RESUME_MAY_CHANGE = ("total_env_steps", "eval_every", "checkpoint_every", "resume", "cuda", "parallel_envs",
                     "buffer_on_device", "cudagraphs", "compile", "bf16", "track", "wandb_project_name",
                     "wandb_entity", "capture_video")


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
    horizon = envs.ENV_SPECS[args.env_id].horizon
    epoch = args.num_envs * horizon  # the env steps of one epoch
    if args.buffer_size < epoch:
        error(f"--buffer-size must hold one epoch (--num-envs × {horizon} = {epoch} transitions), "
              f"got {args.buffer_size}")
    if args.total_env_steps < epoch:
        error(f"--total-env-steps must cover one epoch (--num-envs × {horizon} = {epoch} env steps), "
              f"got {args.total_env_steps}")
    stored = min(args.total_env_steps // epoch * epoch, args.buffer_size // horizon * horizon)
    if args.grad_steps_per_epoch and args.learning_starts > stored:
        error(f"--learning-starts must be at most --total-env-steps and --buffer-size in whole epochs "
              f"and trajectories ({stored}), or the run never learns; got {args.learning_starts}")
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
    flags = ("total_env_steps", "num_envs", "grad_steps_per_epoch", "buffer_size", "eval_every")
    return {"skill_dim": SKILL_DIMS[env_id], **{flag: getattr(spec, flag) for flag in flags}}


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
    run.eval_rng = np.random.default_rng(args.seed + 1)  # the discriminator's replay draws
    run.eval_generator = torch.Generator().manual_seed(args.seed + 1)  # the evaluation's skills
    if ckpt:
        return run, resume(ckpt, run, args, learned, device)
    progress = {"epoch": 0, "grad_steps": 0, "wall_time": 0.0, "timing": {}}
    return run, {**progress, "since_eval": [], "evals": []}


def check_memory(args, space, action_dim):
    """Refuses, before anything is allocated, a run whose buffer, networks and batch do not fit where they go."""
    spec = envs.ENV_SPECS[args.env_id]
    frame_bytes = math.prod(space.shape) // spec.frame_stack * space.dtype.itemsize
    step_bytes = frame_bytes + 4 * action_dim  # and a last frame, and the skill, per trajectory
    trajectory_bytes = spec.horizon * step_bytes + frame_bytes + 4 * args.skill_dim
    buffer = {"the replay buffer (--buffer-size)": args.buffer_size // spec.horizon * trajectory_bytes}
    batch_floats = 2 * math.prod(space.shape) + 8 * args.hidden_dim
    training = {
        "the networks (--hidden-dim)": 72 * args.hidden_dim**2,  # 18 square layers' worth of float32
        "one batch (--batch-size)": 4 * args.batch_size * batch_floats,
    }
    places = {"host": buffer | training}
    if torch.cuda.is_available() and args.cuda:  # the networks, the batches and a device buffer on the GPU
        places = {"GPU": training, "host": buffer}
        if args.buffer_on_device:
            places = {"GPU": buffer | training}
    for place, parts in places.items():
        free = torch.cuda.mem_get_info()[0] if place == "GPU" else envs.free_host_memory()
        sizes = ", ".join(f"{part} {size / 2**30:,.1f}" for part, size in parts.items())
        if sum(parts.values()) > free:
            error(f"this run needs at least {sum(parts.values()) / 2**30:,.1f} GiB of {place} memory: {sizes}; "
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
    """A step (or the actions): 3 warm-up calls, one recorded as a CUDA graph, then replays on each batch copied in."""
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
    """The checkpoint's state and progress, its evaluations back in eval.jsonl; a state that does not fit: one line."""
    for name, thing in learned.items():
        if name not in ckpt:
            error(f"{args.resume} was written by another version of {AGENT}.py: it has no {name}")
        try:
            if isinstance(thing, torch.optim.Optimizer):  # with this run's options (fused, capturable)
                for group in ckpt[name]["param_groups"]:
                    group.update(thing.defaults)
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
    write_atomically(f"{run.dir}/eval.jsonl", lambda tmp: pathlib.Path(tmp).write_text(text), run.dir)


def eval_skills(n, skill_dim, gaussian, generator):
    """The evaluation's skills: the K one-hots in turn, sorted (48 of K = 50: skills 0..47); on Robobin, z ~ N(0, I)."""
    if gaussian:
        return sample_skills(n, skill_dim, True, generator)
    index = torch.arange(n) % skill_dim
    return F.one_hot(index.sort().values, skill_dim).float()


@torch.no_grad()
@record_function("evaluation")
def evaluate(run, progress, args, phi, rb, device):
    """The policy's mode for each skill (iod/metra.py: _evaluate_policy), the discriminator on replay, the means since
    the last evaluation; a plot of the paths, a video, a line of eval.jsonl."""
    epoch = progress["epoch"]
    spec = envs.ENV_SPECS[args.env_id]
    env_steps = epoch * args.num_envs * spec.horizon
    videos = run.eval_envs.video_envs
    gaussian = args.env_id in GAUSSIAN_ENVS
    skills = eval_skills(args.num_eval_skills, args.skill_dim, gaussian, run.eval_generator).to(device)
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
    run.writer.add_scalar("eval/coverage", coverage, env_steps)
    if rb.size > 0:  # how often argmax q(·|s') is z, on up to 10k replay transitions, 1000 at a time
        n = min(10_000, rb.size)
        scores = []
        for start in range(0, n, 1000):
            batch = rb.sample(min(1000, n - start), device, rng=run.eval_rng)
            discriminator = phi(batch["next_obs"])
            if gaussian:  # Robobin: the mean log q(z|s')
                scores.append(log_likelihood(discriminator, batch["skill"]))
            else:
                scores.append((discriminator.argmax(-1) == batch["skill"].argmax(-1)).float())
        name = "disc_log_likelihood" if gaussian else "disc_accuracy"
        result[name] = torch.cat(scores).mean().item()
        run.writer.add_scalar(f"eval/{name}", result[name], env_steps)
    since_eval = progress["since_eval"]  # each epoch's means of the stats
    if since_eval:
        per_epoch = torch.stack([torch.stack(list(means.values())) for means in since_eval])
        result.update(zip(since_eval[0], per_epoch.mean(0).tolist()))
    since_eval.clear()
    result.update(progress["timing"])
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    z = skills.cpu().numpy()  # a path's colour: its skill's index, or the angle of a Gaussian (z_0, z_1)
    hue = z.argmax(-1) / args.skill_dim
    if gaussian:
        hue = (np.arctan2(z[:, 1], z[:, 0]) + np.pi) / (2 * np.pi)
    fig, ax = plt.subplots(figsize=(5, 5))
    envs.draw_coordinates(ax, paths, plt.cm.hsv(hue), args.env_id)
    ax.set_title(f"DIAYN {args.env_id}, {env_steps:,} env steps, coverage {coverage}")
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


def log_epoch(run, progress, args, step_stats, collect_start, train_start):
    """A NaN or inf *_loss ends the run; else the epoch's stats go to TensorBoard and the next evaluation."""
    epoch = progress["epoch"]
    steps_per_epoch = args.num_envs * envs.ENV_SPECS[args.env_id].horizon
    env_steps = (epoch + 1) * steps_per_epoch
    progress["timing"] = {"sps": steps_per_epoch / (time.time() - collect_start)}
    means = {}
    if step_stats:
        milliseconds = 1000 * (time.time() - train_start)
        progress["timing"]["ms_per_grad_step"] = milliseconds / len(step_stats)
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
        if not isinstance(e, (OSError, RuntimeError)):  # torch.save fails with a RuntimeError
            raise
        reason = "the write was cut short: is the disk full?"
        if isinstance(e, OSError):
            reason = e.strerror or str(e)
        error(f"cannot write {path} ({reason})", run_dir)


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
