"""CIC, Contrastive Intrinsic Control (Laskin et al., 2022), in one file: a baseline of "Can a MISL Fly? Analysis and
Ingredients for Mutual Information Skill Learning" (Zheng, Tuyls, Peng and Eysenbach, ICLR 2025), App. B.2.

A skill z ~ p(z) = N(0, I_d), d = 64 (App. B.3), is held for a whole trajectory of the policy π(a | s, z). CIC learns
φ(s) by contrasting transitions with skills (CPC): with the skill's query q_i = h(z_i)/‖h(z_i)‖, the transition's key
k_j = g(φ(s_j), φ(s'_j))/‖g(φ(s_j), φ(s'_j))‖ and L_ij = q_iᵀk_j / T over the minibatch's B × B pairs,
    min_{φ,g,h}  -E_i log(exp L_ii / (max(Σ_j exp L_ij - e^{1/T}, 1e-6) + 1e-6)),
and explores with APT's particle estimate of the entropy of φ: the intrinsic reward of transition i is
    r_i = log(1 + mean_{j ∈ kNN(i)} max(‖φ(s_i) - φ(s'_j)‖ / σ² - 0.0005, 0)),
over its k = 16 nearest φ(s'_j) in the minibatch, σ² the running variance of those distances (officially
cic_alpha = 1: z reaches r only through φ). π is SAC's actor on twin critics Q(s, a, z).

    python cic.py --env-id Ant  # the paper's run: 64M env steps
    python cic.py --env-id Ant --hidden-dim 256 --total-env-steps 3000000  # a short run for a CPU
    python cic.py --env-id Humanoid --cudagraphs --buffer-on-device  # 64×64 pixels, on a GPU

Deliberate differences from the official code (github.com/Princeton-RL/contrastive-successor-features):
  - left out, never affecting learning: the CPC reward term (weight 1 - cic_alpha = 0), the unused target φ, the std
    heads of the Gaussians whose means are φ, g and h, the stored rewards, next actions, returns.
  - added: the last epoch is always evaluated and checkpointed; each evaluation but a new run's first (an empty
    buffer) reports E‖Δφ‖² on up to 10k replay transitions drawn with replacement; --buffer-size is rounded down to
    whole trajectories; a checkpoint holds the stats since the last evaluation, so a resumed run reports what the
    uninterrupted one does; --no-time-limit-terminal (officially, and by default, a trajectory's end is terminal).
  - pixels: each frame is stored once, stacks rebuilt by index (3.7 GB, not 22 GB, at 300k transitions); every env
    is seeded differently (run/train.py seeds all alike). GPU matmuls use TF32; the tests' are CPU's.
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

AGENT = "cic"


@dataclass
class Args:
    env_id: Literal["Ant", "HalfCheetah", "Quadruped", "Humanoid", "Kitchen", "Robobin"] = "Ant"  # The world.
    skill_dim: Optional[int] = None  # Dimension d of the skill z ~ N(0, I_d) (unset: 64).
    seed: int = 1  # Seed of torch, numpy and the envs.
    total_env_steps: Optional[int] = None  # Training budget in env steps (unset: the paper's).
    num_envs: Optional[int] = None  # Trajectories per epoch (unset: 8, Robobin 10).
    grad_steps_per_epoch: Optional[int] = None  # Gradient steps per epoch (unset: the paper's).
    learning_starts: int = 10_000  # Transitions stored before the first gradient step.
    batch_size: int = 256  # Transitions per minibatch.
    buffer_size: Optional[int] = None  # Replay capacity in transitions (unset: the paper's).
    hidden_dim: int = 1024  # Width of the hidden layers of φ, g, h, Q and π.
    eval_every: Optional[int] = None  # Epochs between evaluations, and the last (unset: CIC's).
    checkpoint_every: Optional[int] = None  # Epochs between checkpoints (unset: --eval-every).
    resume: Optional[str] = None  # A checkpoint.pt to continue, in its folder, with its flags.
    cuda: bool = True  # Use the GPU when torch sees one.
    parallel_envs: bool = True  # Step the envs in worker processes (the same numbers).
    buffer_on_device: bool = False  # Keep the replay buffer on the training device.
    track: bool = False  # Also log to Weights & Biases (WANDB_MODE=offline works).
    wandb_project_name: str = "cleanmisl"  # The W&B project, with --track.
    wandb_entity: Optional[str] = None  # The W&B team, with --track.
    capture_video: bool = False  # Write an MP4 of up to four rollouts at each evaluation.
    num_eval_skills: int = 48  # Rollouts per evaluation, a fresh skill each.
    temperature: float = 0.5  # Temperature T of the CPC logits q_iᵀk_j / T.
    knn_k: int = 16  # Neighbours k in the batch of the APT particle reward.
    time_limit_terminal: bool = True  # Make a trajectory's end terminal, as the official CIC does.
    gamma: float = 0.99  # Discount of the SAC critic.
    tau: float = 0.005  # Polyak step of the target Q networks.
    lr: float = 1e-4  # Adam learning rate of φ, g and h, Q, π and log α.
    alpha_init: float = 0.01  # Initial α, tuned automatically towards entropy -|A|/2 on every env.
    compile: bool = False  # Compile the whole gradient step (on a CPU, the same numbers up to rounding).
    bf16: bool = False  # Run the pixel encoders' convolutions in bfloat16.
    cudagraphs: bool = False  # On a GPU, replay the whole gradient step as one CUDA graph.


# Each numeric flag's valid values ("[" closed, "(" open end); never NaN.
FLAG_RANGES = {
    "skill_dim": "[1, inf)", "seed": "[0, 2147483647]", "total_env_steps": "[1, inf)", "num_envs": "[1, inf)",
    "grad_steps_per_epoch": "[0, inf)", "learning_starts": "[0, inf)", "batch_size": "[1, inf)",
    "buffer_size": "[1, inf)", "hidden_dim": "[1, inf)", "eval_every": "[1, inf)", "checkpoint_every": "[1, inf)",
    "num_eval_skills": "[1, inf)", "temperature": "(0, inf)", "knn_k": "[1, inf)", "gamma": "[0, 1)",
    "tau": "(0, 1]", "lr": "(0, inf)", "alpha_init": "(0, inf)"}
# What --resume may change: not the problem learned (the device may change the draws).
RESUME_MAY_CHANGE = ("total_env_steps", "eval_every", "checkpoint_every", "resume", "cuda", "parallel_envs",
                     "buffer_on_device", "track", "wandb_project_name", "wandb_entity", "capture_video", "compile",
                     "cudagraphs", "bf16")


def cpc_loss(query, key, temperature):
    """The header's CPC loss of h(z), g(φ(s), φ(s')); as officially, the negatives drop e^{1/T}, not exp(L_ii)."""
    logits = F.normalize(query, dim=-1) @ F.normalize(key, dim=-1).T / temperature
    negative = (logits.exp().sum(-1) - math.exp(1 / temperature)).clamp(min=1e-6)
    return -torch.log(logits.diagonal().exp() / (negative + 1e-6)).mean()


class RunningMoments:
    """Running mean and variance (URLB's RMS, float64): update(x) returns the variance (APT's "std")."""

    def __init__(self, device):
        self.device = device
        self.load_state_dict({"mean": 0.0, "var": 1.0, "count": 1e-4})

    def update(self, x):
        n, delta = x.numel(), x.mean().double() - self.mean
        total = self.count + n
        var = (self.var * self.count + x.var().double() * n + delta**2 * self.count * n / total) / total
        for state, value in ((self.mean, self.mean + delta * n / total), (self.var, var), (self.count, total)):
            state.copy_(value)  # in place, for a CUDA graph
        return var

    def state_dict(self):
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state):
        self.mean, self.var, self.count = (torch.as_tensor(state[key], dtype=torch.float64, device=self.device)
                                           for key in ("mean", "var", "count"))


def knn_reward(source, target, k, moments):
    """The header's r_i, from the k smallest ‖source_i - target_j‖ (j = i included)."""
    distances = torch.cdist(source, target).topk(k, dim=-1, largest=False).values
    scaled = (distances / moments.update(distances) - 0.0005).clamp(min=0)
    return torch.log(1 + scaled.mean(-1))


def critic_target(reward, done, next_q, next_log_prob, alpha, gamma):
    """y = r + γ (1 - done) (min_k Q̄_k(s', a', z) - α log π(a'|s', z)), next_q: (critics, B)."""
    return reward + gamma * (1 - done) * (next_q.amin(0) - alpha * next_log_prob)


def mlp(in_dim, hidden_dim, out_dim, activation, init):
    """Linear → act → Linear → act → Linear, zero biases (run/train.py)."""
    net = nn.Sequential(nn.Linear(in_dim, hidden_dim), activation(), nn.Linear(hidden_dim, hidden_dim),
                        activation(), nn.Linear(hidden_dim, out_dim))
    for layer in net[::2]:  # the Linear layers
        init(layer.weight)
        nn.init.zeros_(layer.bias)
    return net


def skill_encoder(skill_dim, hidden_dim):
    """h(z) ∈ R^d: ReLU, Xavier-uniform, every layer spectrally normalized."""
    net = mlp(skill_dim, hidden_dim, skill_dim, nn.ReLU, nn.init.xavier_uniform_)
    for i in range(0, len(net), 2):
        net[i] = nn.utils.parametrizations.spectral_norm(net[i])
    return net


class QNetwork(nn.Module):
    """Q(s, a, z) ∈ R: ReLU MLP on features(s) ⊕ z ⊕ a, Xavier-normal weights."""

    def __init__(self, space, action_dim, skill_dim, hidden_dim):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        self.net = mlp(features + skill_dim + action_dim, hidden_dim, 1, nn.ReLU, nn.init.xavier_normal_)

    def forward(self, obs, skill, action):
        return self.net(torch.cat([self.encoder(obs), skill, action], -1)).squeeze(-1)


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

    def sample(self, obs, skill):
        """A reparameterized action and its log-probability, with the tanh correction."""
        mean, log_std = self(obs, skill)
        normal = torch.distributions.Normal(mean, log_std.exp(), validate_args=False)  # NaN: caught per epoch
        u = normal.rsample()
        action = torch.tanh(u)
        log_prob = normal.log_prob(u).sum(-1) - torch.log((1 - action.pow(2)).clamp(0, 1) + 1e-6).sum(-1)
        return action, log_prob

    def mode(self, obs, skill):
        return torch.tanh(self(obs, skill)[0])


class ReplayBuffer:
    """Whole trajectories, each observation (a stack's newest frame) stored once, (s, a, s', z) drawn uniformly
    with replacement on `device` (None: numpy, on the host)."""

    def __init__(self, capacity, horizon, space, frame_stack, action_dim, skill_dim, rng, device=None):
        frame_shape, n = space.shape[:-1] + (space.shape[-1] // frame_stack,), capacity // horizon
        self.horizon, self.rng, self.device, self.pos, self.num_stored, self.size = horizon, rng, device, 0, 0, 0
        zeros = np.zeros if device is None else (  # on the device: no host copy
            lambda shape, dtype: torch.zeros(shape, dtype=getattr(torch, np.dtype(dtype).name), device=device))
        self.frames = zeros((n, horizon + 1, *frame_shape), space.dtype)
        self.actions = zeros((n, horizon, action_dim), np.float32)
        self.skills = zeros((n, skill_dim), np.float32)
        self.frame_offsets = self.to_storage(np.arange(1 - frame_stack, 2))
        self.generator = None if device is None else torch.Generator(device).manual_seed(int(rng.integers(2**62)))

    def to_storage(self, array, dtype=None):  # a host array as the storage holds it
        return array if self.device is None else torch.as_tensor(array, dtype=dtype, device=self.device)

    def add(self, observations, actions, skills):
        """observations (n, horizon + 1, ...), the final last; actions (n, horizon, |A|); skills (n, d)."""
        n, capacity = len(observations), len(self.frames)
        idx = self.to_storage((self.pos + np.arange(n)) % capacity)
        newest = observations[..., -self.frames.shape[-1]:]
        for storage, value in ((self.frames, newest), (self.actions, actions), (self.skills, skills)):
            storage[idx] = self.to_storage(value, storage.dtype)
        self.pos, self.num_stored = (self.pos + n) % capacity, min(self.num_stored + n, capacity)
        self.size = self.num_stored * self.horizon

    def sample(self, batch_size, device, rng=None):
        """A minibatch on `device` ("last": 1 at a trajectory's end), drawn where the buffer is (`rng`: the host)."""
        i = (self.to_storage((rng or self.rng).integers(0, self.size, batch_size)) if self.device is None or rng
             else torch.randint(0, self.size, (batch_size,), generator=self.generator, device=self.device))
        trajectory, t = i // self.horizon, i % self.horizon
        steps = (t[:, None] + self.frame_offsets).clip(min=0)  # frames t-k+1..t+1
        batch = {"frames": self.frames[trajectory[:, None], steps], "action": self.actions[trajectory, t],
                 "skill": self.skills[trajectory], "last": t == self.horizon - 1}
        if self.device is None:
            batch = {key: torch.from_numpy(value) for key, value in batch.items()}
            if torch.device(device).type == "cuda":
                batch = {key: value.pin_memory().to(device, non_blocking=True) for key, value in batch.items()}
        frames = batch.pop("frames")  # (B, k + 1, ...), stacked along the last axis
        return {"obs": frames[:, :-1].movedim(1, -2).flatten(-2).contiguous(), "last": batch.pop("last").float(),
                "next_obs": frames[:, 1:].movedim(1, -2).flatten(-2).contiguous(), **batch}

    def state_dict(self):  # tensors over the stored part, not pickled copies
        n = self.num_stored
        return {"pos": self.pos, "num_stored": n, "frames": torch.as_tensor(self.frames[:n]).cpu(),
                "actions": torch.as_tensor(self.actions[:n]).cpu(), "skills": torch.as_tensor(self.skills[:n]).cpu(),
                "generator": None if self.generator is None else self.generator.get_state()}

    def load_state_dict(self, state):
        self.pos, self.num_stored, self.size = state["pos"], state["num_stored"], state["num_stored"] * self.horizon
        for name in ("frames", "actions", "skills"):
            getattr(self, name)[:self.num_stored] = state[name] if self.device is None else state[name].to(self.device)
        if self.generator is not None and state.get("generator") is not None:  # None: moved to the device
            self.generator.set_state(state["generator"])


def main(args, ckpt=None):
    """CIC epoch by epoch (iod/iod.py): evaluate, collect, update; and checkpoints, logs, the NaN stop."""
    spec = envs.ENV_SPECS[args.env_id]
    steps_per_epoch = args.num_envs * spec.horizon
    num_epochs = args.total_env_steps // steps_per_epoch
    run_name, run_dir, writer = start_run(args, ckpt)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng, eval_rng = np.random.default_rng(args.seed), np.random.default_rng(args.seed + 1)  # replay, evaluation
    eval_generator = torch.Generator().manual_seed(args.seed + 1)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32
    try:  # envs never reset on their own
        train_envs, eval_envs = envs.make_envs(functools.partial(envs.make_env, args.env_id), args.num_envs,
                                               args.num_eval_skills, args.seed, 4 * args.capture_video,
                                               args.parallel_envs)
    except (envs.RenderUnavailable, MemoryError) as e:  # too many, or a world that cannot render
        error(e)
    space = train_envs.single_observation_space  # a state, or 64×64 RGB frames
    action_dim, d, hidden = train_envs.single_action_space.shape[0], args.skill_dim, args.hidden_dim
    check_memory(args, space, action_dim, spec.horizon, spec.frame_stack, device)
    phi, (encoder, features) = nn.Sequential(), envs.make_encoder(space)  # each net has its encoder
    phi.encoder, phi.net = encoder, mlp(features, hidden, d, nn.ReLU, nn.init.xavier_uniform_)  # φ(s) ∈ R^d
    phi.to(device)
    predictor = mlp(2 * d, hidden, d, nn.ReLU, nn.init.xavier_uniform_).to(device)  # g(φ(s), φ(s'))
    skill_net = skill_encoder(d, hidden).to(device)  # h(z)
    qf = [QNetwork(space, action_dim, d, hidden).to(device) for _ in range(2)]  # twins, as SAC's
    qf_target = [QNetwork(space, action_dim, d, hidden).to(device) for _ in qf]
    for net, target in zip(qf, qf_target):
        target.load_state_dict(net.state_dict())
    actor = Actor(space, action_dim, d, hidden).to(device)
    if args.bf16:
        envs.encoders_in_bf16(phi, *qf, *qf_target, actor)
    log_alpha = torch.tensor(math.log(args.alpha_init), device=device, requires_grad=True)
    target_entropy = -action_dim / 2  # H̄ = -|A|/2, half the usual (iod/sac_utils.py)
    adam = adam_options(args, device)
    phi_optimizer = torch.optim.Adam([*phi.parameters(), *predictor.parameters(), *skill_net.parameters()], **adam)
    qf_params, qf_target_params = ([param for net in nets for param in net.parameters()] for nets in (qf, qf_target))
    qf_optimizer = torch.optim.Adam(qf_params, **adam)  # on the sum of the twins' losses
    actor_optimizer = torch.optim.Adam(actor.parameters(), **adam)
    alpha_optimizer = torch.optim.Adam([log_alpha], **adam)
    rb = ReplayBuffer(args.buffer_size, spec.horizon, space, spec.frame_stack, action_dim, d, rng,
                      device if args.buffer_on_device else None)
    moments = RunningMoments(device)  # of the kNN distances
    modules = {"phi": phi, "predictor": predictor, "skill_net": skill_net, "moments": moments,  # checkpoint keys
               "qf1": qf[0], "qf2": qf[1], "qf1_target": qf_target[0], "qf2_target": qf_target[1], "actor": actor,
               "phi_optimizer": phi_optimizer, "qf_optimizer": qf_optimizer, "actor_optimizer": actor_optimizer,
               "alpha_optimizer": alpha_optimizer, "log_alpha": log_alpha}
    streams = rng, eval_rng, eval_generator, (train_envs, eval_envs)
    start_epoch, grad_steps, wall_time, window = (
        restore_checkpoint(ckpt, args, run_dir, modules, rb, streams, device) if ckpt else (0, 0, 0.0, new_window()))

    def update(batch):
        """One step (iod/lsd.py): CPC, the new φ's kNN reward, Q, π, α, Q̄; its stats stay on the device."""
        obs, action, next_obs, skill = batch["obs"], batch["action"], batch["next_obs"], batch["skill"]
        done = batch["last"] if args.time_limit_terminal else torch.zeros_like(batch["last"])
        alpha = log_alpha.exp().detach()
        with record_function("phi step"):
            phi_loss = cpc_loss(skill_net(skill), predictor(torch.cat([phi(obs), phi(next_obs)], -1)), args.temperature)
            phi_optimizer.zero_grad()
            phi_loss.backward()
            phi_optimizer.step()
            with torch.no_grad():
                reward = knn_reward(phi(obs), phi(next_obs), args.knn_k, moments)
        with record_function("qf step"):  # L(Q) = Σ_k 0.5 E[(Q_k(s, a, z) - y)²]
            with torch.no_grad():
                next_action, next_log_prob = actor.sample(next_obs, skill)
                next_q = torch.stack([net(next_obs, skill, next_action) for net in qf_target])
                target = critic_target(reward, done, next_q, next_log_prob, alpha, args.gamma)
            qf_loss = sum(0.5 * F.mse_loss(net(obs, skill, action), target) for net in qf)
            qf_optimizer.zero_grad()
            qf_loss.backward()
            qf_optimizer.step()
        with record_function("actor step"):  # L(π) = E[α log π(a|s, z) - min_k Q_k(s, a, z)]
            for param in qf_params:  # gradients through Q to a, not into Q
                param.requires_grad_(False)
            new_action, log_prob = actor.sample(obs, skill)
            actor_loss = (alpha * log_prob - torch.stack([net(obs, skill, new_action) for net in qf]).amin(0)).mean()
            actor_optimizer.zero_grad()
            actor_loss.backward()
            actor_optimizer.step()
            for param in qf_params:
                param.requires_grad_(True)
        with record_function("alpha step"):  # L(α) = -E[log α (log π(a|s, z) + H̄)]; then Q̄ ← (1 - τ) Q̄ + τ Q
            alpha_loss = -(log_alpha * (log_prob.detach() + target_entropy)).mean()
            alpha_optimizer.zero_grad()
            alpha_loss.backward()
            alpha_optimizer.step()
            with torch.no_grad():
                torch._foreach_lerp_(qf_target_params, qf_params, args.tau)
        return {"cpc_loss": phi_loss.detach(), "qf_loss": qf_loss.detach(), "actor_loss": actor_loss.detach(),
                "alpha_loss": alpha_loss.detach(), "knn_reward": reward.mean(), "alpha": alpha}

    update = fast_path(update, args, device)  # --compile, --cudagraphs
    start = time.time()
    for epoch in range(start_epoch, num_epochs + 1):
        if (epoch % args.eval_every == 0 or epoch == num_epochs) and not (ckpt and epoch == start_epoch):
            window = evaluate(epoch, grad_steps, wall_time + time.time() - start, window, args, actor, phi, rb,
                              eval_envs, streams, device, run_dir, writer)
        if epoch == num_epochs or (epoch % args.checkpoint_every == 0 and epoch != start_epoch):
            save_checkpoint(run_dir, args, run_name, epoch, grad_steps, wall_time + time.time() - start, window,
                            modules, rb, streams, device)
        if epoch == num_epochs:
            break

        # a trajectory per env, a skill z ~ N(0, I_d) each (unit_length 0)
        skills = torch.randn(args.num_envs, d).to(device)
        obs, _ = train_envs.reset()
        observations, actions = [obs], []
        with torch.no_grad(), record_function("collection"):
            for t in range(spec.horizon):
                action = finite(actor.sample(torch.as_tensor(obs, device=device), skills)[0], epoch)
                obs, _, terminated, truncated, _ = train_envs.step(action)
                assert not terminated.any() and (truncated == (t == spec.horizon - 1)).all(), (t, terminated, truncated)
                observations.append(obs)  # never terminal: the final obs last
                actions.append(action)
        rb.add(np.stack(observations, 1), np.stack(actions, 1), skills.cpu().numpy())
        window["env_steps"] += steps_per_epoch

        train_start, step_stats = time.time(), []
        for _ in range(args.grad_steps_per_epoch if rb.size >= args.learning_starts else 0):
            with record_function("sampling"):
                batch = rb.sample(args.batch_size, device)
            step_stats.append(update(batch))
        grad_steps += len(step_stats)
        log_epoch(args, writer, epoch, grad_steps, step_stats, time.time() - train_start, window,
                  (epoch + 1 - start_epoch) * steps_per_epoch / (time.time() - start), run_dir)

    for opened in (train_envs, eval_envs, writer):
        opened.close()
    if args.track:
        import wandb
        wandb.finish()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as before the run
    print(f"done: {run_dir}")


# INFRASTRUCTURE: the command line, start-up, the fast path, checkpoints, evaluation, logging
def parse_args(argv=None):
    """The flags, unset ones the env's (--resume: the run's but RESUME_MAY_CHANGE's); a bad one ends the run."""
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
    if args.knn_k > args.batch_size:
        error(f"--knn-k must be at most --batch-size (the batch holds the neighbours), got {args.knn_k}")
    horizon = envs.ENV_SPECS[args.env_id].horizon
    epoch = args.num_envs * horizon  # env steps (and transitions) per epoch
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
    """The paper's value of each env-dependent flag (d = 64, App. B.3; CIC's eval periods: HalfCheetah 500)."""
    spec = envs.ENV_SPECS[env_id]
    return {"skill_dim": 64, "total_env_steps": spec.total_env_steps, "num_envs": spec.num_envs,
            "grad_steps_per_epoch": spec.grad_steps_per_epoch, "buffer_size": spec.buffer_size,
            "eval_every": 500 if env_id == "HalfCheetah" else spec.eval_every}


def start_run(args, ckpt):
    """The run's name, folder (a resumed run's is its checkpoint's) and writer; Ctrl-C; W&B; the flags."""
    run_name = ckpt["run_name"] if ckpt else f"{args.env_id}__{AGENT}__{args.seed}__{int(time.time())}"
    run_dir = os.path.dirname(os.path.abspath(args.resume)) if ckpt else os.path.join("runs", run_name)
    os.makedirs(run_dir, exist_ok=True)
    signal.signal(signal.SIGINT, lambda *_: error("interrupted", run_dir))
    if args.track:
        import wandb
        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, save_code=True, resume="allow", id=run_name.replace("/", "_"))
    # TensorBoard: a failed write raises at the next add_scalar, not in its thread
    threading.excepthook = lambda hook: None if issubclass(hook.exc_type, OSError) else threading.__excepthook__(hook)
    writer = SummaryWriter(run_dir)
    writer.add_text("hyperparameters",
                    "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    print(f"{args.env_id} (horizon {envs.ENV_SPECS[args.env_id].horizon}): " + ", ".join(
        f"--{flag.replace('_', '-')} {getattr(args, flag)}" for flag in (*env_defaults(args.env_id), "checkpoint_every")
    ) + (" (the run's own)" if ckpt else " (unset: the paper's values for the env)"), flush=True)
    return run_name, run_dir, writer


def check_memory(args, space, action_dim, horizon, frame_stack, device):
    """Refuse, before allocating, a run that cannot fit in the free memory, with its parts' lower bounds."""
    frame_bytes = math.prod(space.shape) // frame_stack * space.dtype.itemsize
    trajectory_bytes = (horizon + 1) * frame_bytes + 4 * (horizon * action_dim + args.skill_dim)
    host = {"the replay buffer (--buffer-size)": args.buffer_size // horizon * trajectory_bytes}
    on_device = {"the networks (--hidden-dim)": 4 * args.hidden_dim**2 * (6 * 4 + 2), "one batch (--batch-size)":
                 4 * args.batch_size * (2 * math.prod(space.shape) + 8 * args.hidden_dim)}
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
    """The step compiled as one function (on a CPU with eager's random draws), on a GPU one CUDA graph."""
    if args.compile:
        torch._inductor.config.fallback_random = device.type == "cpu"
        update = torch.compile(update)
    if args.cudagraphs and device.type != "cuda":
        print("--cudagraphs: CUDA graphs need a GPU; on the CPU the gradient step runs without them", flush=True)
    return CudaGraphStep(update) if args.cudagraphs and device.type == "cuda" else update


class CudaGraphStep:
    """`step(batch) -> stats` as one CUDA graph: 3 real steps, then one recorded on a static batch, replayed."""

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


def save_checkpoint(run_dir, args, run_name, epoch, grad_steps, wall_time, window, modules, rb, streams, device):
    """All a resumed run needs to go on as this one would, written atomically; never a NaN or inf."""
    def non_finite(state, prefix=""):  # names of tensors with a NaN or inf
        if torch.is_tensor(state):
            return [prefix] if state.is_floating_point() and not torch.isfinite(state).all() else []
        items = (state.items() if isinstance(state, dict) else
                 enumerate(state) if isinstance(state, (list, tuple)) else [])
        return [name for key, value in items for name in non_finite(value, f"{prefix}.{key}".lstrip("."))]

    rng, eval_rng, eval_generator, vector_envs = streams
    state = {name: module.detach().cpu() if torch.is_tensor(module) else module.state_dict()
             for name, module in modules.items()}
    diverged = non_finite(state)
    if diverged:  # e.g. Adam's moments overflowed
        error(f"{diverged[0]} holds NaN or inf at epoch {epoch} ({len(diverged)} tensors do): the run diverged",
              run_dir)
    state.update({"agent": AGENT, "args": asdict(args), "run_name": run_name, "epoch": epoch, "grad_steps": grad_steps,
                  "wall_time": wall_time, "buffer": rb.state_dict(), "torch_rng": torch.get_rng_state(),
                  "cuda_rng": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
                  "numpy_rng": rng.bit_generator.state, "eval_numpy_rng": eval_rng.bit_generator.state,
                  "eval_torch_rng": eval_generator.get_state(),
                  "env_rngs": [rng_state for vector in vector_envs for rng_state in envs.env_rng_states(vector)],
                  "since_eval": {**window, "start": time.time() - window["start"]}})
    write_atomically(os.path.join(run_dir, "checkpoint.pt"), lambda tmp: torch.save(state, tmp), run_dir)


def restore_checkpoint(ckpt, args, run_dir, modules, rb, streams, device):
    """A checkpoint's state back (with this run's Adam options); eval.jsonl's later lines dropped."""
    rng, eval_rng, eval_generator, (train_envs, eval_envs) = streams
    try:
        for name, module in modules.items():
            if torch.is_tensor(module):
                module.data.copy_(ckpt[name])
                continue
            module.load_state_dict(ckpt[name])
            for group in getattr(module, "param_groups", []):  # an optimizer: this run's options
                group.update({key: value for key, value in adam_options(args, device).items() if key != "lr"})
                for param in group["params"]:  # step counts where fused/capturable Adam wants them
                    if "step" in module.state.get(param, {}):
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
        saved = ckpt["since_eval"]  # start: seconds before saving
        window = {**saved, "stats": [{name: value.to(device) for name, value in means.items()}
                                     for means in saved["stats"]], "start": time.time() - saved["start"]}
    except (KeyError, RuntimeError, ValueError, AttributeError) as e:
        error(f"{args.resume} was written by another version of {AGENT}.py ({' '.join(str(e).split())[:160]})")
    log_path, kept = os.path.join(run_dir, "eval.jsonl"), []
    if os.path.isfile(log_path):
        lines = [line for line in pathlib.Path(log_path).read_text().split("\n") if line.strip()]
        for number, line in enumerate(lines, 1):
            try:
                kept += [line + "\n"] if json.loads(line)["epoch"] <= ckpt["epoch"] else []
            except (ValueError, KeyError, TypeError):  # a torn last line is dropped
                if number < len(lines):
                    error(f"line {number} of {log_path} is not an evaluation; mend or delete it, then resume")
                print(f"warning: dropped the torn last line of {log_path}", file=sys.stderr)
        write_atomically(log_path, lambda tmp: pathlib.Path(tmp).write_text("".join(kept)), run_dir)
    env_steps = ckpt["epoch"] * args.num_envs * envs.ENV_SPECS[args.env_id].horizon
    print(f"resumed {ckpt['run_name']} at epoch {ckpt['epoch']} ({env_steps:,} env steps)")
    return ckpt["epoch"], ckpt["grad_steps"], ckpt["wall_time"], window


def restore_cuda_rng(states):
    """The CUDA RNG states of the GPUs here (maybe fewer than the run's)."""
    for index, state in enumerate(states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(state, index)


@torch.no_grad()
@record_function("evaluation")
def evaluate(epoch, grad_steps, wall_time, window, args, actor, phi, rb, eval_envs, streams, device, run_dir, writer):
    """Rollouts of fresh skills (iod/metra.py) → eval.jsonl (coverage, E‖Δφ‖², the window), plot, video."""
    per_epoch = [torch.stack(list(means.values())) for means in window["stats"]]
    stats = dict(zip(window["stats"][0], torch.stack(per_epoch).mean(0).tolist())) if per_epoch else {}
    stats |= {"sps": window["env_steps"] / (time.time() - window["start"])} if window["env_steps"] else {}
    stats |= {"ms_per_grad_step": 1000 * window["train_time"] / window["grad_steps"]} if window["grad_steps"] else {}
    spec, videos = envs.ENV_SPECS[args.env_id], eval_envs.video_envs
    _, eval_rng, eval_generator, _ = streams
    z = torch.randn(args.num_eval_skills, args.skill_dim, generator=eval_generator)  # z ~ p(z)
    skills = z.to(device)
    (obs, info), coordinates, frames = eval_envs.reset(), [], []
    for t in range(spec.horizon + 1):  # after the reset and every step
        if t:
            obs, _, _, _, info = eval_envs.step(finite(actor.mode(torch.as_tensor(obs, device=device), skills), epoch))
        coordinates.append(info["coordinates"])
        frames += [np.concatenate(envs.render_envs(eval_envs, videos), 1)] if videos else []
    paths, env_steps = np.stack(coordinates, 1), epoch * args.num_envs * spec.horizon
    result = {"epoch": epoch, "env_steps": env_steps, "grad_steps": grad_steps, "wall_time": round(wall_time, 2),
              "coverage": envs.coverage(paths, args.env_id)}
    if rb.size > 0:  # E‖φ(s') - φ(s)‖², 1000 transitions at a time
        n = min(10_000, rb.size)
        batches = (rb.sample(min(1000, n - i), device, rng=eval_rng) for i in range(0, n, 1000))
        result["dphi_sq"] = torch.cat([(phi(b["next_obs"]) - phi(b["obs"])).pow(2).sum(-1)
                                       for b in batches]).mean().item()
    result |= {**stats, "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    z = z.numpy()
    fig, ax = plt.subplots(figsize=(5, 5))  # coloured by the angle of (z_0, z_1)
    angle = np.arctan2(z[:, 1], z[:, 0]) if args.skill_dim > 1 else np.pi * (z[:, 0] > 0)
    envs.draw_coordinates(ax, paths, plt.cm.hsv((angle + np.pi) / (2 * np.pi)), args.env_id)
    ax.set_title(f"CIC {args.env_id}, {env_steps:,} env steps, coverage {result['coverage']}")
    fig.tight_layout()
    write_atomically(os.path.join(run_dir, f"skills_{env_steps:010d}.png"), lambda tmp: fig.savefig(tmp, dpi=100),
                     run_dir)
    plt.close(fig)
    if videos:
        import imageio
        os.makedirs(os.path.join(run_dir, "videos"), exist_ok=True)
        write_atomically(os.path.join(run_dir, "videos", f"skills_{env_steps:010d}.mp4"),
                         lambda tmp: imageio.mimsave(tmp, frames, fps=20), run_dir)
    for key in {"coverage", "dphi_sq"} & result.keys():
        writer.add_scalar(f"eval/{key}", result[key], env_steps)
    log_path = os.path.join(run_dir, "eval.jsonl")
    logged = pathlib.Path(log_path).read_text() if os.path.isfile(log_path) else ""
    write_atomically(log_path, lambda tmp: pathlib.Path(tmp).write_text(logged + json.dumps(result) + "\n"), run_dir)
    print(f"eval  epoch {epoch} | env steps {env_steps:,} | coverage {result['coverage']} | " + " | ".join(
        f"{k} {result[k]:.4g}" for k in ("dphi_sq", *stats) if k in result), flush=True)
    return new_window()


def new_window():
    """Since the last evaluation: each trained epoch's named means, and the speeds."""
    return {"stats": [], "train_time": 0.0, "grad_steps": 0, "start": time.time(), "env_steps": 0}


def log_epoch(args, writer, epoch, grad_steps, step_stats, train_time, window, sps, run_dir):
    """An epoch's means to the window and TensorBoard (a NaN or inf loss ends the run); the time left."""
    env_steps = (epoch + 1) * args.num_envs * envs.ENV_SPECS[args.env_id].horizon
    if step_stats:
        names = list(step_stats[0])
        per_step = torch.stack([torch.stack(list(stats.values())) for stats in step_stats])
        bad = ~torch.isfinite(per_step) & torch.tensor([n.endswith("_loss") for n in names], device=per_step.device)
        if bad.any():
            step, which = bad.nonzero()[0].tolist()
            error(f"{names[which]} is {per_step[step, which].item()} at gradient step "
                  f"{grad_steps - len(step_stats) + step + 1} (epoch {epoch})", run_dir)
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
    """The action as an array for the envs; a NaN or inf ends the run."""
    action = action.cpu().numpy()
    if not np.isfinite(action).all():
        error(f"the policy's action is not finite at epoch {epoch}: its networks diverged")
    return action


def error(message, run_dir=None):
    """End the run with one line on stderr (given its folder, what to resume it from)."""
    if run_dir:
        path = os.path.join(run_dir, "checkpoint.pt")
        message += f"; resume with --resume {path}" if os.path.isfile(path) else "; no checkpoint was written yet"
    sys.exit(f"{AGENT}.py: error: {message}")


def write_atomically(path, write, run_dir):
    """write(a temporary path), renamed to `path`: a failed write leaves the old file and ends the run."""
    temporary = "{}.tmp{}".format(*os.path.splitext(path))  # the extension tells the format
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException as e:  # even Ctrl-C mid-write: no temporary left
        with contextlib.suppress(OSError):
            os.remove(temporary)
        if not isinstance(e, (OSError, RuntimeError)):  # torch.save's failed write: a RuntimeError
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
