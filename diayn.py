"""DIAYN, Diversity is All You Need (Eysenbach, Gupta, Ibarz and Levine, ICLR 2019), in one file: a baseline of "Can a
MISL Fly? Analysis and Ingredients for Mutual Information Skill Learning" (Zheng, Tuyls, Peng and Eysenbach, ICLR 2025),
App. A.5 and B.2.

A skill z ~ p(z), one of K one-hot vectors drawn uniformly, is held for a whole trajectory of the policy π(a | s, z).
DIAYN learns a discriminator q(z | s') and trains π to make its skills easy to tell apart: both maximize the reverse
variational lower bound (paper App. A.5; DIAYN's Eq. 2 and 3)
    I(S; Z) ≥ H(Z) + E[log q(z | s)] = E[log q(z | s) - log p(z)].
As in the official code, the discriminator is the φ network applied to the *next* observation, its K outputs the
logits: q(z | s') = softmax(φ(s'))_z, trained on the cross-entropy -E[log q(z | s')]. π is SAC on the intrinsic reward
r(s, a, s', z) = log q(z | s') - log p(z) = log q(z | s') + log K, computed from the φ just updated, with twin critics
Q_k(s, a, z) regressed onto r + γ (min_k Q̄_k(s', a', z) - α log π(a' | s', z)), a' ~ π(·|s', z), never terminal; its
entropy temperature α is fixed at 0.1 (the official scripts freeze it with --sac_lr_a -1): there is no α step.

    python diayn.py --env-id Ant                       # the paper's settings: K = 50 one-hot skills, α fixed at 0.1
    python diayn.py --env-id Ant --hidden-dim 256      # what a CPU can train in an hour
    python diayn.py --env-id Humanoid                  # 64×64 pixels (wants a GPU)

Deliberate differences from the official code (github.com/Princeton-RL/contrastive-successor-features, iod/metra.py
with --inner 0; none changes the algorithm behind the published numbers):
  - time-limit steps are simply never terminal; the official sampler marks the last step of every trajectory done
    (garagei/sampler/option_worker.py), and the scripts' --turn_off_dones 1 then zeroes every done.
  - dropped because they never affect learning: the target φ that iod/metra.py creates and never updates, the std
    head of the Gaussian φ module (its mean head gives the logits), the frozen α's optimizer, and the stored
    rewards / next actions / returns.
  - one-hot skills are drawn with torch's generator, not NumPy's global one (a different random stream only).
  - Robobin follows the official DIAYN Robobin script (--discrete 0 --dim_option 9), not App. B.3's table (K = 50
    one-hot): continuous z ~ N(0, I_9), a Gaussian discriminator N(μ(s'), σ(s')) whose log-std has its own MLP, and
    the reward log q(z|s') - log(1/9); its evaluation reports the mean log q(z|s') instead of an accuracy.
  - evaluation every 500 epochs on Ant, 1000 on HalfCheetah, 125 on pixels, as csf.py; the official DIAYN and
    VISR scripts evaluate half as often on Ant and on pixels (their --n_epochs_per_eval). Evaluation never changes
    training.
  - additions, not in the official code: the last epoch is always evaluated and checkpointed, every
    evaluation also reports the discriminator's accuracy on 10k replay transitions (chance 1/K), and a
    --buffer-size that is not a multiple of the horizon is rounded down to whole trajectories (the paper's
    1M and 300k are). A checkpoint also holds the loss means since the last evaluation, so a run resumed
    from any epoch reports what the uninterrupted run does.
  - pixels: the replay buffer keeps each frame once and rebuilds the stacks by index (3.7 GB instead of
    22 GB at 300k transitions, same samples); on a CPU, envs.py renders by default without shadows or
    multisampling, and it seeds every env differently, where the official run/train.py: make_env seeds every
    worker's task alike, as for csf.py.
  - on a GPU, float32 matmuls use TF32 (torch.set_float32_matmul_precision("high")), which is faster there; a CPU
    computes them in full float32, and the tests' numbers are the CPU's.

The file reads in the paper's order: Args; the losses; the networks; the replay buffer; `main`, the training loop;
then the infrastructure main calls (the command line, start-up, checkpoints, evaluation, logging).
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
from typing import Optional

import gymnasium as gym
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

AGENT = "diayn"
# the skill counts of the official scripts: App. B.3's table has K = 50 one-hot for every env; the official DIAYN
# Robobin script runs continuous skills z ~ N(0, I_9) with a Gaussian discriminator, and we follow the script
SKILL_DIMS = {"Ant": 50, "HalfCheetah": 50, "Quadruped": 50, "Humanoid": 50, "Kitchen": 50, "Robobin": 9}
GAUSSIAN_ENVS = ("Robobin",)
NUM_DIAGNOSTIC_SAMPLES = 10_000  # replay transitions behind the discriminator-accuracy diagnostic
NUM_VIDEO_SKILLS = 4  # skills shown side by side in --capture-video

@dataclass
class Args:
    env_id: str = "Ant"
    """the environment: Ant, HalfCheetah (states), Quadruped, Humanoid, Kitchen or Robobin (64×64 pixels)"""
    skill_dim: Optional[int] = None
    """number K of one-hot skills (unset: the paper's 50; on Robobin the dimension d of z ~ N(0, I_d), the
    script's 9)"""
    seed: int = 1
    """seed of torch, numpy and the envs; on a CPU the same seed gives the same run"""
    total_env_steps: Optional[int] = None
    """training budget in environment steps, evaluation rollouts not counted (unset: the paper's 64M on states,
    4.8M on pixels)"""
    num_envs: Optional[int] = None
    """trajectories collected per epoch, one skill each, stepped together (unset: 8, Robobin 10)"""
    grad_steps_per_epoch: Optional[int] = None
    """gradient steps after each collection round (unset: 50 on states, 200 on Quadruped and Humanoid, 100 on
    Kitchen and Robobin)"""
    learning_starts: int = 10_000
    """transitions stored before the first gradient step"""
    batch_size: int = 256
    """transitions per minibatch, sampled uniformly with replacement"""
    buffer_size: Optional[int] = None
    """replay capacity in transitions, oldest overwritten first (unset: 1M on states, 300k on pixels, Kitchen 100k)"""
    hidden_dim: int = 1024
    """width of the two hidden layers of φ, Q and π (the paper's 1024; 256 trains 10x faster on a CPU)"""
    eval_every: Optional[int] = None
    """epochs between evaluations (unset: Ant 500, HalfCheetah 1000, Quadruped and Humanoid 125, Kitchen 250, Robobin
    500); the last epoch is always evaluated"""
    checkpoint_every: Optional[int] = None
    """epochs between checkpoints (unset: same as --eval-every); the last epoch always writes one"""
    resume: Optional[str] = None
    """path of a checkpoint.pt to continue from; the run keeps its directory, seed and RNG streams"""
    cuda: bool = True
    """use the GPU when torch sees one"""
    parallel_envs: bool = True
    """step the training and the evaluation envs in worker processes, at most one per core, each stepping several;
    --no-parallel-envs steps them one by one in this process (the same numbers either way)"""
    buffer_on_device: bool = False
    """keep the replay buffer in the training device's memory and draw the batches there, so a gradient step copies
    nothing from the host (a 300k-transition pixel buffer takes 3.7 GB); the draws are torch's, not the host
    buffer's. On a CPU, the same code with the CPU as the device"""
    track: bool = False
    """also log to Weights & Biases (WANDB_MODE=offline works)"""
    wandb_project_name: str = "cleanmisl"
    """W&B project, with --track"""
    wandb_entity: Optional[str] = None
    """W&B team, with --track"""
    capture_video: bool = False
    """at each evaluation, write an MP4 of the first few evaluation skills side by side"""
    num_eval_skills: int = 48
    """deterministic evaluation rollouts per evaluation (the paper's 48), the K one-hot skills in turn"""
    gamma: float = 0.99
    """discount of the SAC critic"""
    tau: float = 0.005
    """Polyak step of the target Q networks, after every gradient step"""
    lr: float = 1e-4
    """Adam learning rate of φ (the discriminator), Q and π"""
    alpha: float = 0.1
    """entropy temperature α, fixed (the official DIAYN scripts freeze it at 0.1)"""
    compile: bool = False
    """torch.compile the whole gradient step as one function: every loss, its backward and Adam step, and the Polyak
    step. Same numbers as eager up to float rounding; meant for a GPU"""
    bf16: bool = False
    """on pixels, run the CNN encoders' convolutions in bfloat16 (torch.autocast), their features in float32"""
    cudagraphs: bool = False
    """on a GPU, record the whole gradient step once as a CUDA graph and replay it, one launch per step (with or
    without --compile); a CPU runs the step without graphs, and says so"""


# Every numeric flag and the values that mean something ("[" closed end, "(" open end); NaN is never inside.
FLAG_RANGES = {
    "skill_dim": "[2, inf)", "seed": "[0, 2147483647]", "total_env_steps": "[1, inf)", "num_envs": "[1, inf)",
    "grad_steps_per_epoch": "[0, inf)", "learning_starts": "[0, inf)", "batch_size": "[1, inf)",
    "buffer_size": "[1, inf)", "hidden_dim": "[1, inf)", "eval_every": "[1, inf)", "checkpoint_every": "[1, inf)",
    "num_eval_skills": "[1, inf)", "gamma": "[0, 1)", "tau": "(0, 1]", "lr": "(0, inf)", "alpha": "[0, inf)",
}
# What --resume may change: neither the learning problem nor the random streams depend on these.
RESUME_MAY_CHANGE = ("total_env_steps", "eval_every", "checkpoint_every", "resume", "cuda", "parallel_envs",
                     "buffer_on_device", "track", "wandb_project_name", "wandb_entity", "capture_video", "compile",
                     "cudagraphs", "bf16")


# ======================================================================================================================
# THE ALGORITHM
# ======================================================================================================================

# ---------------------------------------------------------------- the losses (DIAYN's Eq. 2-3; paper App. A.5)
def sample_skills(n, skill_dim, gaussian=False, generator=None):
    """z ~ p(z): uniform over the K one-hot vectors, as the official iod/metra.py:
    METRA._get_train_trajectories_kwargs draws it (--discrete 1), or z ~ N(0, I_d) on Robobin."""
    if gaussian:
        return torch.randn(n, skill_dim, generator=generator)
    return F.one_hot(torch.randint(skill_dim, (n,), generator=generator), skill_dim).float()


def log_likelihood(discriminator, skill):
    """log q(z|s') per sample: discriminator = φ(s') of the next observations, (B, K) logits for one-hot z, or a
    (mean, log-std) pair of a Gaussian over continuous z (Robobin)."""
    if isinstance(discriminator, tuple):
        mean, log_std = discriminator
        return torch.distributions.Normal(mean, log_std.exp(), validate_args=False).log_prob(skill).sum(-1)
    return (F.log_softmax(discriminator, dim=-1) * skill).sum(-1)


def diayn_reward(discriminator, skill):
    """r = log q(z|s') - log p(z) = log q(z|s') + log K per sample   (DIAYN's Eq. 3)

    The baseline log p(z) = log(1/K) of K one-hot skills (the official --diayn_include_baseline 1); the official
    Robobin script subtracts log(1/d) from its Gaussian log-likelihood too.
    """
    return log_likelihood(discriminator, skill) + math.log(skill.shape[-1])


def discriminator_loss(discriminator, skill):
    """L(φ) = -E[log q(z|s') - log p(z)]: the cross-entropy of q(·|s') against z, less the constant log K, as the
    official iod/metra.py: _update_loss_te writes it (-E[r]). Returns the loss and the rewards of the batch."""
    reward = diayn_reward(discriminator, skill)
    return -reward.mean(), reward


def critic_target(reward, next_q, next_log_prob, alpha, gamma):
    """y = r + γ (min_k Q̄_k(s', a', z) - α log π(a'|s', z)), never terminal (the official iod/sac_utils.py)

    next_q: (critics, B), every target net's Q̄(s', a', z)."""
    return reward + gamma * (next_q.amin(0) - alpha * next_log_prob)


def critic_loss(q, target):
    """Σ_k 0.5 E[(Q_k(s, a, z) - y)²]: the twin Qs on one target, one optimizer for both. q: each Q_k(s, a, z),
    (B,)."""
    return sum(0.5 * F.mse_loss(q_k, target) for q_k in q)


# ---------------------------------------------------------------- the losses of one gradient step
def phi_objective(phi, next_obs, skill):
    """The discriminator's loss on q(z|s') = softmax(φ(s')), and its rewards."""
    return discriminator_loss(phi(next_obs), skill)


def qf_objective(qf, qf_target, phi, actor, obs, action, next_obs, skill, alpha, gamma):
    """The Q step's loss on r = log q(z|s') + log K from the φ just updated, and the rewards."""
    with torch.no_grad():
        reward = diayn_reward(phi(next_obs), skill)
        next_action, next_log_prob = actor.sample(next_obs, skill)
        next_q = torch.stack([net(next_obs, skill, next_action) for net in qf_target])
        target = critic_target(reward, next_q, next_log_prob, alpha, gamma)
    return critic_loss([net(obs, skill, action) for net in qf], target), reward


def actor_objective(actor, qf, obs, skill, alpha):
    """L(π) = E[α log π(a|s, z) - min_k Q_k(s, a, z)], a ~ π(·|s, z) reparameterized."""
    new_action, log_prob = actor.sample(obs, skill)
    q = torch.stack([net(obs, skill, new_action) for net in qf]).amin(0)
    return (alpha * log_prob - q).mean()


# ---------------------------------------------------------------- the networks (official run/train.py)
def mlp(in_dim, hidden_dim, out_dim, activation, init):
    """Linear → act → Linear → act → Linear, zero biases."""
    net = nn.Sequential(nn.Linear(in_dim, hidden_dim), activation(), nn.Linear(hidden_dim, hidden_dim),
                        activation(), nn.Linear(hidden_dim, out_dim))
    for layer in net:
        if isinstance(layer, nn.Linear):
            init(layer.weight)
            nn.init.zeros_(layer.bias)
    return net


class Phi(nn.Module):
    """φ(s') ∈ R^K, the discriminator's logits of q(z|s') (ReLU MLP, Xavier-uniform; the official code's
    "trajectory encoder", applied to the next observation). With gaussian, (mean, log-std) of q(z|s') = N(μ(s'),
    σ(s')), the log-std from a second MLP of its own (the official GaussianMLPIndependentStdModuleEx)."""

    def __init__(self, observation_space, skill_dim, hidden_dim, gaussian=False):
        super().__init__()
        # every network owns its encoder, as in the official garagei/torch/modules/with_encoder.py
        self.encoder, features = envs.make_encoder(observation_space)
        self.net = mlp(features, hidden_dim, skill_dim, nn.ReLU, nn.init.xavier_uniform_)
        self.log_std = mlp(features, hidden_dim, skill_dim, nn.ReLU, nn.init.xavier_uniform_) if gaussian else None

    def forward(self, obs):
        h = self.encoder(obs)
        return self.net(h) if self.log_std is None else (self.net(h), self.log_std(h))


class QNetwork(nn.Module):
    """Q(s, a, z) ∈ R: ReLU MLP on features(s) ⊕ z ⊕ a, Xavier-normal weights."""

    def __init__(self, observation_space, action_dim, skill_dim, hidden_dim):
        super().__init__()
        self.encoder, features = envs.make_encoder(observation_space)
        self.net = mlp(features + skill_dim + action_dim, hidden_dim, 1, nn.ReLU, nn.init.xavier_normal_)

    def forward(self, obs, skill, action):
        return self.net(torch.cat([self.encoder(obs), skill, action], -1)).squeeze(-1)


class Actor(nn.Module):
    """π(a | s, z): tanh-squashed Gaussian on a tanh trunk, output layers initialised 10x smaller."""

    LOG_STD_MIN, LOG_STD_MAX = math.log(1e-6), 2.0

    def __init__(self, observation_space, action_dim, skill_dim, hidden_dim):
        super().__init__()
        self.encoder, features = envs.make_encoder(observation_space)
        self.trunk = mlp(features + skill_dim, hidden_dim, hidden_dim, nn.Tanh, nn.init.xavier_uniform_)[:-1]
        self.mean = nn.Linear(hidden_dim, action_dim)
        self.log_std = nn.Linear(hidden_dim, action_dim)
        for head in (self.mean, self.log_std):
            nn.init.xavier_normal_(head.weight)
            head.weight.data.mul_(0.1)
            nn.init.zeros_(head.bias)

    def forward(self, obs, skill):
        h = self.trunk(torch.cat([self.encoder(obs), skill], -1))
        return self.mean(h), self.log_std(h).clamp(self.LOG_STD_MIN, self.LOG_STD_MAX)

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
    """No gradient into these modules' weights while the block runs; one still flows through them to their inputs."""
    for module in modules:
        module.requires_grad_(False)
    try:
        yield
    finally:
        for module in modules:
            module.requires_grad_(True)


# ---------------------------------------------------------------- the replay buffer
def to_device(array, device):
    """A host array as a tensor on `device`; to a GPU through pinned memory, without waiting for the copy."""
    tensor = torch.from_numpy(array)
    return tensor.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else tensor


def stack_frames(frames):
    """(B, k, *frame_shape) frames, oldest first → (B, *obs_shape): the frames along the last axis, as the env
    stacks them (a state vector, k = 1, is its one frame)."""
    return frames.movedim(1, -2).flatten(-2).contiguous()


class ReplayBuffer:
    """A ring of whole trajectories; transitions (s, a, s', z) are sampled uniformly, with replacement, as from the
    official garagei/replay_buffer/path_buffer_ex.py.

    Observations are stored once per time step (s'_t is s_{t+1}), and of a stacked pixel observation only its
    newest frame, as uint8: the stack is rebuilt by index, oldest frame first, the first frame repeated at
    the start of a trajectory, as the env built it. A 300k-transition pixel buffer then takes 3.7 GB instead
    of the official 22 GB (obs and next_obs, all 3 frames each). The capacity is rounded down to whole
    trajectories.
    """

    def __init__(self, capacity, horizon, observation_space, frame_stack, action_dim, skill_dim, rng, device=None):
        """device: where the storage lives and the training batches are drawn (--buffer-on-device); None keeps the
        storage in host memory as numpy arrays, whose gather is several times faster than torch's on a CPU."""
        frame_shape = observation_space.shape[:-1] + (observation_space.shape[-1] // frame_stack,)
        num_trajectories = capacity // horizon
        self.horizon, self.frame_stack, self.rng, self.device = horizon, frame_stack, rng, device
        self.frames = self.zeros((num_trajectories, horizon + 1, *frame_shape), observation_space.dtype)
        self.actions = self.zeros((num_trajectories, horizon, action_dim), np.float32)
        self.skills = self.zeros((num_trajectories, skill_dim), np.float32)
        self.frame_offsets = self.to_storage(np.arange(1 - frame_stack, 2))  # frames t-k+1..t+1 of a transition at t
        # the training draws on the device have their own generator, seeded from the replay stream
        self.generator = None if device is None else torch.Generator(device).manual_seed(int(rng.integers(2**62)))
        self.pos, self.num_stored = 0, 0  # in trajectories

    def zeros(self, shape, dtype):
        dtype = np.dtype(dtype)
        return np.zeros(shape, dtype) if self.device is None else torch.zeros(shape, dtype=getattr(torch, dtype.name),
                                                                              device=self.device)

    def to_storage(self, array, like=None):
        """A host array as the storage holds it: itself, or a tensor on the buffer's device (in `like`'s dtype)."""
        if self.device is None:
            return array
        return torch.as_tensor(array, dtype=None if like is None else like.dtype, device=self.device)

    @property
    def size(self):  # stored transitions
        return self.num_stored * self.horizon

    def add(self, observations, actions, skills):
        """observations: (n, horizon + 1, *obs_shape) with the final one; actions: (n, horizon, |A|); skills: (n, d)."""
        n, capacity = len(observations), len(self.frames)
        idx = self.to_storage((self.pos + np.arange(n)) % capacity)
        self.frames[idx] = self.to_storage(observations[..., -self.frames.shape[-1]:], self.frames)  # newest frames
        self.actions[idx] = self.to_storage(actions, self.actions)
        self.skills[idx] = self.to_storage(skills, self.skills)
        self.pos, self.num_stored = (self.pos + n) % capacity, min(self.num_stored + n, capacity)

    def gather(self, batch_size, rng=None):
        """The host's part of a minibatch of transitions, uniform (with replacement): whole frames only, those of s
        and s' in one (B, k + 1) block, so the copy runs at memcpy speed; stacking them is left to the device.
        A training batch of a buffer on the device is drawn there; `rng` (evaluation's) draws on the host."""
        if self.device is None or rng is not None:
            i = self.to_storage((rng or self.rng).integers(0, self.size, batch_size))
        else:
            i = torch.randint(0, self.size, (batch_size,), generator=self.generator, device=self.device)
        trajectory, t = i // self.horizon, i % self.horizon
        steps = (t[:, None] + self.frame_offsets).clip(min=0)  # frames t-k+1..t+1, the first repeated before t = 0
        return {"frames": self.frames[trajectory[:, None], steps], "action": self.actions[trajectory, t],
                "skill": self.skills[trajectory]}

    def sample(self, batch_size, device, rng=None):
        """A minibatch on `device`: each field copied there once (pinned, without waiting, on a GPU), and the stacks
        of s (frames 0..k-1) and s' (frames 1..k) built there, where reordering bytes is cheap. A buffer on the
        device copies nothing."""
        batch = self.gather(batch_size, rng)
        if self.device is None:
            batch = {key: to_device(value, device) for key, value in batch.items()}
        frames = batch.pop("frames")
        return {"obs": stack_frames(frames[:, :-1]), "next_obs": stack_frames(frames[:, 1:]), **batch}

    def state_dict(self):
        n = self.num_stored
        # Tensors over the arrays, not copies: torch.save writes them as they are, while a pickled numpy array
        # is copied several times over in memory on its way to disk (a pixel buffer's 1-3 GB, 4-5 times).
        # On the device, the arrays are copied to the host first, so that any machine can resume the run.
        return {"pos": self.pos, "num_stored": n, "frames": torch.as_tensor(self.frames[:n]).cpu(),
                "actions": torch.as_tensor(self.actions[:n]).cpu(), "skills": torch.as_tensor(self.skills[:n]).cpu(),
                "generator": None if self.generator is None else self.generator.get_state()}

    def load_state_dict(self, state):
        self.pos, self.num_stored = state["pos"], state["num_stored"]
        n = self.num_stored
        for name in ("frames", "actions", "skills"):
            getattr(self, name)[:n] = state[name] if self.device is None else state[name].to(self.device)
        if self.generator is not None and state.get("generator") is not None:  # else: moved to the device at resume
            self.generator.set_state(state["generator"])


# ---------------------------------------------------------------- the training loop
def main(args, ckpt=None):
    """DIAYN, epoch by epoch (the official iod/iod.py: IOD.train): evaluate every `eval_every` epochs (epoch 0
    included); collect `num_envs` trajectories of the env's horizon, one skill z ~ p(z) each; then, once
    `learning_starts` transitions are stored, take `grad_steps_per_epoch` gradient steps (`update`). `ckpt`: the
    checkpoint to resume from (parse_args loads it)."""
    spec = envs.ENV_SPECS[args.env_id]
    steps_per_epoch = args.num_envs * spec.horizon
    num_epochs = args.total_env_steps // steps_per_epoch
    run_name, run_dir, checkpoint_path, writer = start_run(args, ckpt)  # folder, Ctrl-C, W&B, TensorBoard

    # ------------------------------------------------------------ seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)  # replay sampling
    eval_rng = np.random.default_rng(args.seed + 1)  # evaluation has its own streams, so it never changes training
    eval_generator = torch.Generator().manual_seed(args.seed + 1)  # Robobin's Gaussian evaluation skills
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on the GPUs that have them

    # ------------------------------------------------------------ envs
    train_envs, eval_envs = make_envs(args)  # trajectories of exactly the horizon, never reset on their own
    observation_space = train_envs.single_observation_space  # a state vector, or stacked 64×64 RGB frames
    action_dim = train_envs.single_action_space.shape[0]
    d = args.skill_dim
    gaussian = args.env_id in GAUSSIAN_ENVS  # continuous z and a Gaussian discriminator (Robobin's script)
    check_memory(args, observation_space, action_dim, spec.horizon, spec.frame_stack, device)

    # ------------------------------------------------------------ networks, optimizers, replay buffer
    phi = Phi(observation_space, d, args.hidden_dim, gaussian).to(device)  # the discriminator's logits
    qf = [QNetwork(observation_space, action_dim, d, args.hidden_dim).to(device) for _ in range(2)]  # twin critics
    qf_target = [QNetwork(observation_space, action_dim, d, args.hidden_dim).to(device) for _ in qf]
    for net, target in zip(qf, qf_target):
        target.load_state_dict(net.state_dict())
    actor = Actor(observation_space, action_dim, d, args.hidden_dim).to(device)
    if args.bf16:
        envs.encoders_in_bf16(phi, *qf, *qf_target, actor)
    adam = adam_options(args, device)  # foreach Adam; fused under --cudagraphs alone
    phi_optimizer = torch.optim.Adam(phi.parameters(), **adam)
    qf_params = [param for net in qf for param in net.parameters()]
    qf_target_params = [param for net in qf_target for param in net.parameters()]
    qf_optimizer = torch.optim.Adam(qf_params, **adam)  # one optimizer for the twins, on the sum of their losses
    actor_optimizer = torch.optim.Adam(actor.parameters(), **adam)  # α is fixed: no α optimizer
    rb = ReplayBuffer(args.buffer_size, spec.horizon, observation_space, spec.frame_stack, action_dim, d, rng,
                      device if args.buffer_on_device else None)

    modules = {"phi": phi, **{f"qf{k}": net for k, net in enumerate(qf, 1)},  # the checkpoint's keys
               **{f"qf{k}_target": net for k, net in enumerate(qf_target, 1)}, "actor": actor,
               "phi_optimizer": phi_optimizer, "qf_optimizer": qf_optimizer, "actor_optimizer": actor_optimizer}
    start_epoch, grad_steps, wall_time, since_eval = 0, 0, 0.0, new_window()
    if ckpt:
        start_epoch, grad_steps, wall_time, since_eval = restore_checkpoint(
            ckpt, args, run_dir, modules, rb, rng, eval_rng, eval_generator, (train_envs, eval_envs), device)

    # ------------------------------------------------------------ one gradient step
    def update(batch):
        """One gradient step on one minibatch, in the official iod/metra.py: _train_components's order: φ on the
        cross-entropy of q(z|s'); the twin Qs on their TD target with the rewards of the φ just updated; π on
        min_k Q_k + α H(π); then the Polyak step of Q̄. Returns the step's stats by name, left on the device:
        nothing in a step waits for the host."""
        obs, action, next_obs, skill = batch["obs"], batch["action"], batch["next_obs"], batch["skill"]
        with record_function("phi step"):  # the discriminator
            phi_loss, _ = phi_objective(phi, next_obs, skill)
            phi_optimizer.zero_grad()
            phi_loss.backward()
            phi_optimizer.step()
        with record_function("qf step"):
            qf_loss, reward = qf_objective(qf, qf_target, phi, actor, obs, action, next_obs, skill, args.alpha,
                                         args.gamma)
            qf_optimizer.zero_grad()
            qf_loss.backward()
            qf_optimizer.step()
        with record_function("actor step"), frozen(qf):  # the gradient flows through Q to the action, not into Q
            actor_loss = actor_objective(actor, qf, obs, skill, args.alpha)
            actor_optimizer.zero_grad()
            actor_loss.backward()
            actor_optimizer.step()
        with torch.no_grad():  # the target Qs: Q̄ ← (1 - τ) Q̄ + τ Q, every tensor in one call
            torch._foreach_lerp_(qf_target_params, qf_params, args.tau)
        return {"phi_loss": phi_loss.detach(), "qf_loss": qf_loss.detach(), "actor_loss": actor_loss.detach(),
                "reward": reward.mean().detach()}

    update = fast_path(update, args, device)  # --compile, --cudagraphs; without them, `update` itself

    # ------------------------------------------------------------ the loop: evaluate, collect, update
    segment_start = time.time()
    for epoch in range(start_epoch, num_epochs + 1):
        # evaluate and checkpoint at the start of the epoch: what the previous `epoch` epochs produced
        if (epoch % args.eval_every == 0 or epoch == num_epochs) and not (ckpt and epoch == start_epoch):
            evaluate(epoch, grad_steps, wall_time + time.time() - segment_start, window_stats(since_eval), args,
                     actor, phi, rb, eval_envs, eval_rng, eval_generator, device, run_dir, writer)
            since_eval = new_window()
        if epoch == num_epochs or (epoch % args.checkpoint_every == 0 and epoch != start_epoch):
            save_checkpoint(checkpoint_path, args, run_name, epoch, grad_steps, wall_time + time.time() - segment_start,
                            since_eval, modules, rb, rng, eval_rng, eval_generator, (train_envs, eval_envs),
                            device)
        if epoch == num_epochs:
            break

        # collect one trajectory per env, one skill each, with the stochastic policy
        skills = sample_skills(args.num_envs, d, gaussian).to(device)
        obs, _ = train_envs.reset()
        observations, actions = [obs], []
        with torch.no_grad(), record_function("collection"):
            for t in range(spec.horizon):
                action = finite(actor.sample(torch.as_tensor(obs, device=device), skills)[0], epoch)
                obs, _, terminated, truncated, _ = train_envs.step(action)
                # never terminal, cut by the time limit exactly at the horizon: the buffer's trajectory layout
                assert not terminated.any() and (truncated == (t == spec.horizon - 1)).all(), (t, terminated, truncated)
                observations.append(obs)  # after the last step, the final observation; reset() starts the next epoch
                actions.append(action)
        rb.add(np.stack(observations, 1), np.stack(actions, 1), skills.cpu().numpy())
        since_eval["env_steps"] += steps_per_epoch
        env_steps = (epoch + 1) * steps_per_epoch

        # update: gradient steps, each on its own minibatch
        if rb.size >= args.learning_starts and args.grad_steps_per_epoch > 0:
            train_start, step_stats = time.time(), []
            for _ in range(args.grad_steps_per_epoch):
                with record_function("sampling"):
                    batch = rb.sample(args.batch_size, device)
                step_stats.append(update(batch))
            names, per_step = stack_stats(step_stats)  # (steps, stats)
            stop_at_a_non_finite_loss(names, per_step, grad_steps, epoch, resume_hint(checkpoint_path))
            grad_steps += args.grad_steps_per_epoch
            record_epoch(since_eval, dict(zip(names, per_step.mean(0))), args.grad_steps_per_epoch,
                         time.time() - train_start, writer, env_steps)
        log_epoch(writer, epoch, env_steps, grad_steps, (epoch + 1 - start_epoch) * steps_per_epoch,
                  time.time() - segment_start, since_eval, args.total_env_steps)

    finish_run(args, run_dir, writer, train_envs, eval_envs)


# ======================================================================================================================
# INFRASTRUCTURE: what main calls around the algorithm (the command line, start-up, checkpoints, evaluation, logging)
# ======================================================================================================================

# ---------------------------------------------------------------- the command line
def parse_args(argv=None):
    """The command line, every unset flag given the paper's value for the env, every value checked (one line on
    failure). With --resume, the flags the run was started with; a flag given beside it may change only what
    RESUME_MAY_CHANGE names. Returns the args and the checkpoint (None for a new run)."""
    args, ckpt = tyro.cli(Args, args=argv), None
    if args.resume:
        ckpt = load_checkpoint(args.resume)
        args = tyro.cli(Args, args=argv, default=Args(**ckpt["args"]))
        for flag, trained in ckpt["args"].items():
            if flag not in RESUME_MAY_CHANGE and getattr(args, flag) != trained:
                error(f"{args.resume} was trained with --{flag.replace('_', '-')} {trained}, not {getattr(args, flag)}")
    if args.env_id not in envs.ENV_SPECS:
        error(f"unknown --env-id {args.env_id!r}; choose one of {', '.join(envs.ENV_SPECS)}")
    spec = envs.ENV_SPECS[args.env_id]
    for flag, paper_value in env_defaults(args.env_id).items():
        if getattr(args, flag) is None:
            setattr(args, flag, paper_value)
    if args.checkpoint_every is None:
        args.checkpoint_every = args.eval_every
    for flag, interval in FLAG_RANGES.items():
        if not in_range(getattr(args, flag), interval):
            error(f"--{flag.replace('_', '-')} must be in {interval}, got {getattr(args, flag)}")
    steps_per_epoch = args.num_envs * spec.horizon
    if args.buffer_size < steps_per_epoch:
        error(f"--buffer-size must hold one epoch (--num-envs × {spec.horizon} = {steps_per_epoch} transitions), "
              f"got {args.buffer_size}")
    if args.total_env_steps < steps_per_epoch:
        error(f"--total-env-steps must cover one epoch (--num-envs × {spec.horizon} = {steps_per_epoch} env steps), "
              f"got {args.total_env_steps}")
    if args.grad_steps_per_epoch and args.learning_starts > min(args.total_env_steps,
                                                                args.buffer_size // spec.horizon * spec.horizon):
        error(f"--learning-starts must be at most --total-env-steps and --buffer-size, or the run never learns; "
              f"got {args.learning_starts}")
    if ckpt and args.total_env_steps // steps_per_epoch <= ckpt["epoch"]:
        error(f"{args.resume} has already trained for {ckpt['epoch'] * steps_per_epoch} env steps; "
              f"give a larger --total-env-steps to continue it")
    return args, ckpt


def env_defaults(env_id):
    """The paper's value of each flag whose default depends on the env (--checkpoint-every follows --eval-every)."""
    spec = envs.ENV_SPECS[env_id]
    return {"skill_dim": SKILL_DIMS[env_id], "total_env_steps": spec.total_env_steps, "num_envs": spec.num_envs,
            "grad_steps_per_epoch": spec.grad_steps_per_epoch, "buffer_size": spec.buffer_size,
            "eval_every": spec.eval_every}


def in_range(value, interval):
    """Whether `value` lies in an interval written like "[0, 1)" or "(0, inf)"."""
    low, high = (float(end) for end in interval[1:-1].split(","))
    above = low <= value if interval[0] == "[" else low < value
    below = value <= high if interval[-1] == "]" else value < high
    return above and below  # both False for NaN


def load_checkpoint(path):
    """The checkpoint at `path`, if it is one of this agent's; one line on failure."""
    if not os.path.isfile(path):
        error(f"no checkpoint file at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        error(f"{path} is not a readable checkpoint ({type(e).__name__})")
    if not isinstance(ckpt, dict) or "agent" not in ckpt:
        error(f"{path} is not a cleanmisl checkpoint")
    if ckpt["agent"] != AGENT:
        error(f"{path} is a {ckpt['agent']} checkpoint, not a {AGENT} one")
    if set(ckpt["args"]) - {field.name for field in fields(Args)} or "since_eval" not in ckpt:
        error(f"{path} was written by another version of {AGENT}.py")
    return ckpt


# ---------------------------------------------------------------- start-up
def start_run(args, ckpt):
    """The run's folder (a resumed run goes on in its checkpoint's, whatever the working directory), Ctrl-C as one
    line naming the checkpoint to resume from, W&B with --track, TensorBoard, and one line with the values of the
    flags that depend on the env. Returns the run's name, folder, checkpoint path and TensorBoard writer."""
    run_name = ckpt["run_name"] if ckpt else f"{args.env_id}__{AGENT}__{args.seed}__{int(time.time())}"
    run_dir = os.path.dirname(os.path.abspath(args.resume)) if ckpt else os.path.join("runs", run_name)
    os.makedirs(run_dir, exist_ok=True)
    checkpoint_path = os.path.join(run_dir, "checkpoint.pt")
    signal.signal(signal.SIGINT, lambda *_: error(f"interrupted; {resume_hint(checkpoint_path)}"))  # writes are atomic
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, save_code=True, resume="allow", id=run_name.replace("/", "_"))
    # TensorBoard writes from a thread: a failed write (a full disk) is raised again at the next add_scalar, and
    # ends the run with one line there; its thread stays quiet
    threading.excepthook = lambda hook: None if issubclass(hook.exc_type, OSError) else threading.__excepthook__(hook)
    writer = SummaryWriter(run_dir)
    writer.add_text("hyperparameters",
                    "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    spec = envs.ENV_SPECS[args.env_id]
    print(f"{args.env_id} (horizon {spec.horizon}): "
          + ", ".join(f"--{flag.replace('_', '-')} {getattr(args, flag)}"
                      for flag in (*env_defaults(args.env_id), "checkpoint_every"))
          + (" (the run's own)" if ckpt else " (a flag not given takes the paper's value for the env)"), flush=True)
    return run_name, run_dir, checkpoint_path, writer


def num_video_skills(args):
    """How many evaluation rollouts the --capture-video video shows side by side (0 without it)."""
    return min(NUM_VIDEO_SKILLS, args.num_eval_skills) if args.capture_video else 0


def make_envs(args):
    """The training envs (one trajectory each per epoch) and the evaluation envs (one rollout each), seeded, in
    worker processes unless --no-parallel-envs.

    Every trajectory is started by an explicit reset() and ends at the horizon; with autoreset DISABLED the vector
    env never resets on its own, so the observation after the last step is the final one (never a reset one). A
    pixel world that cannot render ends the run with one line."""
    try:  # a pixel world makes its render context at its first frame: the first reset
        train_envs, eval_envs = envs.make_envs(functools.partial(envs.make_env, args.env_id), args.num_envs,
                                               args.num_eval_skills, args.seed, num_video_skills(args),
                                               args.parallel_envs)
    except (envs.RenderUnavailable, MemoryError) as e:  # a world that cannot render; envs that cannot fit
        error(e)
    return train_envs, eval_envs


def free_memory(device):
    """Bytes of memory free now: the GPU's, or the host's (MemAvailable); inf where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return math.inf


def check_memory(args, observation_space, action_dim, horizon, frame_stack, device):
    """Refuse, before anything is allocated, a run that cannot fit in the memory free now, with what it needs.
    Lower bounds: the replay buffer in host memory (with --buffer-on-device, on the device); on the device, the
    hidden-by-hidden weights of the discriminator φ, Q1, Q2 and π with their gradients and Adam's two moments plus
    Q's two targets, and one batch of float observations and 8 hidden activations per transition."""
    frame_bytes = math.prod(observation_space.shape) // frame_stack * observation_space.dtype.itemsize
    trajectories = args.buffer_size // horizon
    host = {"the replay buffer (--buffer-size)":
            trajectories * ((horizon + 1) * frame_bytes + 4 * (horizon * action_dim + args.skill_dim))}
    on_device = {"the networks (--hidden-dim)": 4 * args.hidden_dim**2 * (4 * 4 + 2),
                 "one batch (--batch-size)": 4 * args.batch_size * (2 * math.prod(observation_space.shape)
                                                                    + 8 * args.hidden_dim)}
    if args.buffer_on_device:
        host, on_device = {}, {**host, **on_device}
    places = {"GPU": on_device, "host": host} if device.type == "cuda" else {"host": {**host, **on_device}}
    for place, parts in places.items():
        free = free_memory(device if place == "GPU" else torch.device("cpu"))
        if sum(parts.values()) > free:
            error(f"this run needs at least {sum(parts.values()) / 2**30:,.1f} GiB of {place} memory: "
                  + ", ".join(f"{name} {size / 2**30:,.1f}" for name, size in parts.items())
                  + f"; {free / 2**30:,.1f} GiB is free")


def adam_options(args, device):
    """Eager: foreach Adam, the per-tensor loop's numbers bit for bit in fewer calls. --compile: the same foreach Adam,
    which torch.compile traces and fuses. --cudagraphs alone: fused Adam, one kernel per optimizer step. Under a CUDA
    graph, capturable (the step counts on the GPU, so that each replay advances them)."""
    fused = args.cudagraphs and not args.compile
    capturable = args.cudagraphs and device.type == "cuda"
    return {"lr": args.lr, "fused": fused, "foreach": not fused, "capturable": capturable}


def fast_path(update, args, device):
    """The gradient step that --compile and --cudagraphs ask for: torch.compile'd as one function, and on a GPU
    replayed as one CUDA graph. On a CPU, --compile keeps eager's random draws, so that only the float rounding
    differs (the equality test); on a GPU, inductor's own, fused into the kernels."""
    if args.compile:
        torch._inductor.config.fallback_random = device.type == "cpu"
        update = torch.compile(update)
    if args.cudagraphs and device.type != "cuda":
        print("--cudagraphs: CUDA graphs need a GPU; on the CPU the gradient step runs without them", flush=True)
    elif args.cudagraphs:
        update = CudaGraphStep(update)
    return update


class CudaGraphStep:
    """A gradient step `step(batch) -> stats` replayed as one CUDA graph (--cudagraphs).

    The first WARMUP calls run the step as it is, on a side stream as capture requires (they are real steps; they
    also compile it under --compile). The next call records the step on a static copy of the batch, and from then on
    every call copies its batch there and replays the graph: one launch for all of the step's kernels, the random
    draws included. The stats are copied out of the graph's memory, which the next replay overwrites."""

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


# ---------------------------------------------------------------- checkpoints
def restore_checkpoint(ckpt, args, run_dir, modules, rb, rng, eval_rng, eval_generator, vector_envs, device):
    """Put a checkpoint's state back: every network and optimizer (with the Adam the speed flags ask for now, not the
    saved one), the replay buffer, every RNG stream and the envs'. Drops the evaluations logged after it
    (the run redoes them). Returns (epoch, gradient steps, wall time, the window since the last evaluation).
    The state of another version of this script ends the run with one line."""
    try:
        for name, module in modules.items():
            module.load_state_dict(ckpt[name])
            if isinstance(module, torch.optim.Optimizer):
                use_adam_options(module, adam_options(args, device))
        rb.load_state_dict(ckpt["buffer"])
        epoch, grad_steps, wall_time = ckpt["epoch"], ckpt["grad_steps"], ckpt["wall_time"]
        torch.set_rng_state(ckpt["torch_rng"])
        if device.type == "cuda" and ckpt["cuda_rng"] is not None:
            restore_cuda_rng(ckpt["cuda_rng"])
        eval_generator.set_state(ckpt["eval_torch_rng"])
        rng.bit_generator.state, eval_rng.bit_generator.state = ckpt["numpy_rng"], ckpt["eval_numpy_rng"]
        env_rngs = ckpt["env_rngs"]
        for vector_env in vector_envs:  # the training envs' states, then the evaluation envs'
            envs.set_env_rng_states(vector_env, env_rngs[:vector_env.num_envs])
            env_rngs = env_rngs[vector_env.num_envs:]
        window = ckpt["since_eval"]  # its start was saved as seconds before the checkpoint
        stats = window["stats"]
        if stats and torch.is_tensor(stats[0]):  # written before the stats had names: vectors in update's order
            stats = [dict(zip(("phi_loss", "qf_loss", "actor_loss", "reward"), means)) for means in stats]
        since_eval = {**window, "stats": [{name: value.to(device) for name, value in means.items()} for means in stats],
                      "start": time.time() - window["start"]}
    except (KeyError, RuntimeError, ValueError) as e:  # the state of another version of this script
        error(f"{args.resume} was written by another version of {AGENT}.py ({' '.join(str(e).split())[:160]})")
    # evaluations logged after this checkpoint (the run stopped before writing its next one) are done again
    truncate_log(os.path.join(run_dir, "eval.jsonl"), epoch)
    steps_per_epoch = args.num_envs * envs.ENV_SPECS[args.env_id].horizon
    print(f"resumed {ckpt['run_name']} at epoch {epoch} ({epoch * steps_per_epoch:,} env steps)")
    return epoch, grad_steps, wall_time, since_eval


def use_adam_options(optimizer, options):
    """Give a restored optimizer this run's Adam options (the checkpoint's may differ), with its step counts where
    they must be: on the parameters' device for fused or capturable Adam, on the host otherwise."""
    for group in optimizer.param_groups:
        group.update({key: value for key, value in options.items() if key != "lr"})
        for param in group["params"]:
            if "step" in optimizer.state.get(param, {}):
                device = param.device if group["fused"] or group["capturable"] else "cpu"
                optimizer.state[param]["step"] = optimizer.state[param]["step"].to(device, torch.float32)


def restore_cuda_rng(states):
    """Restore a checkpoint's CUDA RNG states on the GPUs this machine sees: a run resumed where fewer GPUs are
    visible than where it was written sets the ones it has (torch.cuda.set_rng_state_all would raise IndexError)."""
    for index, state in enumerate(states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(state, index)


def truncate_log(log_path, last_epoch):
    """Keep the evaluations of eval.jsonl up to `last_epoch` (a resumed run does the later ones again), rewritten
    atomically. Blank lines and a torn last line (a crash while it was written) are dropped, the latter with a
    warning; any other line that is not an evaluation ends the run with one line."""
    if not os.path.isfile(log_path):
        return
    with open(log_path) as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            epoch = json.loads(line)["epoch"]
        except (ValueError, KeyError, TypeError):
            if number < len(lines):
                error(f"line {number} of {log_path} is not an evaluation; mend or delete it, then resume")
            print(f"warning: dropped the torn last line of {log_path}", file=sys.stderr)
            continue
        if epoch <= last_epoch:
            kept.append(line + "\n")
    write_atomically(log_path, lambda temporary: pathlib.Path(temporary).write_text("".join(kept)),
                     resume_hint(os.path.join(os.path.dirname(log_path), "checkpoint.pt")))


def save_checkpoint(path, args, run_name, epoch, grad_steps, wall_time, since_eval, modules, rb, rng, eval_rng,
                    eval_generator, vector_envs, device):
    """Write everything a resumed run needs to go on exactly as this one would, atomically: a crash, a kill or a full
    disk mid-write leaves the previous checkpoint intact. A network or optimizer holding NaN or inf is never saved as
    good: the run ends with one line instead."""
    state = {"agent": AGENT, "args": asdict(args), "run_name": run_name, "epoch": epoch, "grad_steps": grad_steps,
             "wall_time": wall_time, "buffer": rb.state_dict(),
             "torch_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
             "numpy_rng": rng.bit_generator.state, "eval_numpy_rng": eval_rng.bit_generator.state,
             "eval_torch_rng": eval_generator.get_state(),
             "env_rngs": [state for vector_env in vector_envs for state in envs.env_rng_states(vector_env)],
             "since_eval": {**since_eval, "start": time.time() - since_eval["start"]},
             **{name: module.state_dict() for name, module in modules.items()}}
    diverged = non_finite({name: state[name] for name in modules})
    if diverged:  # e.g. Adam's second moments overflowed while every loss stayed finite
        error(f"{diverged[0]} holds NaN or inf at epoch {epoch} ({len(diverged)} tensors do): the run diverged; "
              f"{resume_hint(path)}")
    write_atomically(path, lambda temporary: torch.save(state, temporary), resume_hint(path))


def non_finite(state, prefix=""):
    """The names of the float tensors holding NaN or inf in a (nested) state dict, such as
    "actor_optimizer.state.0.exp_avg_sq"."""
    if torch.is_tensor(state):
        return [prefix] if state.is_floating_point() and not torch.isfinite(state).all() else []
    if isinstance(state, dict):
        return [name for key, value in state.items() for name in non_finite(value, f"{prefix}.{key}".lstrip("."))]
    if isinstance(state, (list, tuple)):
        return [name for i, value in enumerate(state) for name in non_finite(value, f"{prefix}.{i}")]
    return []


# ---------------------------------------------------------------- evaluation (official iod/metra.py: _evaluate_policy)
def eval_skills(n, skill_dim, gaussian, generator):
    """The n evaluation skills: the K one-hots split evenly (n // K each, the remainder to the lowest indices;
    with the paper's n = 48 and K = 50, skills 0 to 47 once each), or fresh prior draws on Robobin."""
    if gaussian:
        return sample_skills(n, skill_dim, True, generator)
    return F.one_hot((torch.arange(n) % skill_dim).sort().values, skill_dim).float()


@torch.no_grad()
@record_function("evaluation")
def evaluate(epoch, grad_steps, wall_time, stats, args, actor, phi, rb, eval_envs, eval_rng, eval_generator, device,
             run_dir, writer):
    """Deterministic rollouts, the skills in turn → coverage, skill plot, discriminator accuracy, one line of
    eval.jsonl with `stats` (the means since the previous evaluation); with --capture-video, a video of the first
    few rollouts."""
    spec = envs.ENV_SPECS[args.env_id]
    gaussian = args.env_id in GAUSSIAN_ENVS
    skills = eval_skills(args.num_eval_skills, args.skill_dim, gaussian, eval_generator)
    coordinates, frames, videos = [], [], num_video_skills(args)

    def record(info):  # the state after reset and after every step
        coordinates.append(info["coordinates"])
        if videos:
            frames.append(np.concatenate(envs.render_envs(eval_envs, range(videos)), 1))

    obs, info = eval_envs.reset()
    skills_on_device = skills.to(device)
    record(info)
    for _ in range(spec.horizon):
        action = actor.mode(torch.as_tensor(obs, device=device), skills_on_device)
        obs, _, _, _, info = eval_envs.step(finite(action, epoch))
        record(info)
    paths = np.stack(coordinates, 1)  # (rollouts, horizon + 1, coord_dim)
    env_steps = epoch * args.num_envs * spec.horizon
    result = {"epoch": epoch, "env_steps": env_steps, "grad_steps": grad_steps, "wall_time": round(wall_time, 2),
              "coverage": envs.coverage(paths, args.env_id)}
    if rb.size > 0:  # how often argmax q(·|s') names the trajectory's skill (chance 1/K), over replay transitions;
        n = min(NUM_DIAGNOSTIC_SAMPLES, rb.size)  # for Gaussian skills the mean log q(z|s') instead
        batches = (rb.sample(min(1000, n - i), device, rng=eval_rng) for i in range(0, n, 1000))  # one at a time
        if gaussian:
            result["disc_log_likelihood"] = torch.cat([log_likelihood(phi(b["next_obs"]), b["skill"])
                                                       for b in batches]).mean().item()
        else:
            result["disc_accuracy"] = torch.cat([phi(b["next_obs"]).argmax(-1) == b["skill"].argmax(-1)
                                                 for b in batches]).float().mean().item()
    result.update(stats)
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    # every file whole or not at all: a full disk or a read-only folder ends the run with one line
    hint = resume_hint(os.path.join(run_dir, "checkpoint.pt"))
    fig = plot_skills(paths, skill_colors(skills.numpy(), gaussian),
                      f"DIAYN {args.env_id}, {env_steps:,} env steps, coverage {result['coverage']}", args.env_id)
    write_atomically(os.path.join(run_dir, f"skills_{env_steps:010d}.png"),
                     lambda temporary: fig.savefig(temporary, dpi=100), hint)
    plt.close(fig)
    if frames:
        import imageio

        os.makedirs(os.path.join(run_dir, "videos"), exist_ok=True)
        write_atomically(os.path.join(run_dir, "videos", f"skills_{env_steps:010d}.mp4"),
                         lambda temporary: imageio.mimsave(temporary, frames, fps=20), hint)
    for key in ("coverage", "disc_accuracy", "disc_log_likelihood"):
        if key in result:
            writer.add_scalar(f"eval/{key}", result[key], env_steps)
    log_path = os.path.join(run_dir, "eval.jsonl")
    logged = pathlib.Path(log_path).read_text() if os.path.isfile(log_path) else ""
    write_atomically(log_path, lambda temporary: pathlib.Path(temporary).write_text(
        logged + json.dumps(result) + "\n"), hint)
    print(f"eval  epoch {epoch} | env steps {env_steps:,} | coverage {result['coverage']} | " + " | ".join(
        f"{k} {result[k]:.4g}" for k in ("disc_accuracy", "disc_log_likelihood", *stats) if k in result), flush=True)


def skill_colors(skills, gaussian):
    """One colour per one-hot skill, by its index; Gaussian skills by the angle of (z_0, z_1)."""
    if gaussian:
        return plt.cm.hsv((np.arctan2(skills[:, 1], skills[:, 0]) + np.pi) / (2 * np.pi))
    return plt.cm.hsv(skills.argmax(-1) / skills.shape[-1])


def plot_skills(coordinates, colors, title, env_id):
    """The evaluation trajectories, one colour per skill."""
    fig, ax = plt.subplots(figsize=(5, 5))
    envs.draw_coordinates(ax, coordinates, colors, env_id)
    ax.set_title(title)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- stats, logging and the end of a run
def new_window():
    """What happened since the last evaluation: the means and speeds the next one reports. `stats` holds one dict of
    named means per epoch that trained."""
    return {"stats": [], "train_time": 0.0, "grad_steps": 0, "start": time.time(), "env_steps": 0}


def stack_stats(stats):
    """A list of dicts of named 0-dim tensors (one per gradient step, or per epoch) → the names, and the values as one
    (len(stats), names) tensor, whose mean(0) is each stat's mean."""
    names = list(stats[0])
    return names, torch.stack([torch.stack([entry[name] for name in names]) for entry in stats])


def window_stats(window):
    """What the next evaluation reports of the window since the previous one: each stat's mean over the epochs that
    trained, the env steps per second and the milliseconds per gradient step."""
    stats = {}
    if window["stats"]:
        names, per_epoch = stack_stats(window["stats"])
        stats = dict(zip(names, per_epoch.mean(0).tolist()))
    elapsed = time.time() - window["start"]
    if window["env_steps"]:
        stats["sps"] = window["env_steps"] / elapsed
    if window["grad_steps"]:
        stats["ms_per_grad_step"] = 1000 * window["train_time"] / window["grad_steps"]
    return stats


def stop_at_a_non_finite_loss(names, per_step, grad_steps, epoch, hint):
    """End the run with one line naming the first loss (a stat named *_loss) that is NaN or inf in this epoch's
    steps, and its gradient step. per_step: (steps, names); grad_steps: the steps taken before this epoch's."""
    losses = [i for i, name in enumerate(names) if name.endswith("_loss")]
    bad = ~torch.isfinite(torch.stack([per_step[:, i] for i in losses], 1))  # (steps, losses)
    if bad.any():
        step, which = bad.nonzero()[0].tolist()
        loss = losses[which]
        error(f"{names[loss]} is {per_step[step, loss].item()} at gradient step {grad_steps + step + 1} "
              f"(epoch {epoch}); {hint}")


def finite(action, epoch):
    """The policy's action as a numpy array for the envs, which refuse NaN and inf: if it has one, the networks
    diverged in the last update (a NaN loss would show at the next), and the run ends with one line."""
    action = action.cpu().numpy()
    if not np.isfinite(action).all():
        error(f"the policy's action is not finite at epoch {epoch}: its networks diverged")
    return action


def record_epoch(window, stats, steps, train_time, writer, env_steps):
    """Add an epoch's `steps` gradient steps to the window (`stats`: each stat's mean over them) and to TensorBoard."""
    window["stats"].append(stats)
    window["grad_steps"] += steps
    window["train_time"] += train_time
    for name, value in floats(stats).items():
        writer.add_scalar(f"losses/{name}" if name.endswith("loss") else f"charts/{name}", value, env_steps)


def log_epoch(writer, epoch, env_steps, grad_steps, steps_this_segment, seconds_this_segment, window,
              total_env_steps):
    """TensorBoard's speed and gradient steps after each epoch; every 10 epochs, one line with the last stats and
    the time the rest of --total-env-steps takes at this run's speed so far (evaluations included)."""
    sps = int(steps_this_segment / seconds_this_segment)
    writer.add_scalar("charts/SPS", sps, env_steps)
    writer.add_scalar("charts/grad_steps", grad_steps, env_steps)
    if (epoch + 1) % 10 == 0:
        last = floats(window["stats"][-1]) if window["stats"] else {}
        left = duration((total_env_steps - env_steps) * seconds_this_segment / steps_this_segment)
        print(f"epoch {epoch + 1} | env steps {env_steps:,} | SPS {sps} | {left} left | "
              + " | ".join(f"{k} {v:.4g}" for k, v in last.items()), flush=True)


def duration(seconds):
    """A time span as people read it: "45 s", "12 min", "3 h 05 min"."""
    minutes = round(seconds / 60)
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def floats(stats):
    """Named 0-dim tensors as Python floats, read from the device at once."""
    names, values = stack_stats([stats])
    return dict(zip(names, values[0].tolist()))


def finish_run(args, run_dir, writer, *vector_envs):
    """Close the envs and the logs; Ctrl-C as before the run."""
    for vector_env in vector_envs:
        vector_env.close()
    writer.close()
    if args.track:
        import wandb

        wandb.finish()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"done: {run_dir}")


# ---------------------------------------------------------------- failures and files
def error(message):
    """End the run with one line on stderr, no traceback."""
    sys.exit(f"diayn.py: error: {message}")


def resume_hint(checkpoint_path):
    """What a stopped run can be resumed from."""
    if os.path.isfile(checkpoint_path):
        return f"resume with --resume {checkpoint_path}"
    return "no checkpoint was written yet"


def write_atomically(path, write, hint):
    """Write `path` by `write(temporary path)`, then rename it into place: a write that fails (a full disk, a
    read-only folder) leaves the earlier file whole and no temporary behind, and ends the run with one line."""
    root, extension = os.path.splitext(path)
    temporary = f"{root}.tmp{extension}"  # the extension tells savefig and imageio the format
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException as e:  # a failed write, or Ctrl-C or an error mid-write: no temporary left behind
        with contextlib.suppress(OSError):
            os.remove(temporary)
        if not isinstance(e, (OSError, RuntimeError)):  # torch.save reports a failed write as a RuntimeError
            raise
        if isinstance(e, OSError):
            reason = e.strerror or str(e)
        elif "unexpected pos" in str(e) or "write failed" in str(e):
            reason = "the write was cut short: is the disk full?"
        else:
            reason = " ".join(str(e).split())[:120]
        error(f"cannot write {path} ({reason}); {hint}")


if __name__ == "__main__":
    args, ckpt = parse_args()
    try:
        main(args, ckpt)
    except OSError as e:  # the run's folder or TensorBoard's file cannot be written (read-only, a full disk)
        error(f"cannot write {os.fsdecode(e.filename) if e.filename else 'the TensorBoard log'} ({e.strerror or e})")
