"""DIAYN (Eysenbach et al., ICLR 2019), a baseline of "Can a MISL Fly?" (Zheng et al., ICLR 2025), in one file.

    python diayn.py --env-id Ant                       # the paper's settings: K = 50 one-hot skills, α fixed at 0.1
    python diayn.py --env-id Ant --hidden-dim 256      # what a CPU can train in an hour
    python diayn.py --env-id Humanoid                  # 64×64 pixels (wants a GPU)

DIAYN learns a discriminator q(z|s') over K one-hot skills and trains a skill-conditioned SAC policy on the
reward log q(z|s') - log p(z): both maximize the reverse variational lower bound I(S; Z) ≥ H(Z) + E[log q(z|s)]
(paper App. B). Here, as in the official code, the discriminator is the φ network applied to the *next*
observation, its K outputs the logits, so the reward of (s, a, s') says how well s' tells z apart.

The epoch is csf.py's (spec §1.1): evaluate every `eval_every` epochs (epoch 0 included), collect `num_envs`
trajectories with one skill each, then, once `learning_starts` transitions are stored, take
`grad_steps_per_epoch` gradient steps. Each gradient step, on its own minibatch (spec §1.5, §2.3):
  1. φ step: minimize the cross-entropy -E[log softmax(φ(s'))_z] (written, as in the official code, as
     -E[r], which differs from it by the constant log K).
  2. rewards r = log softmax(φ(s'))_z + log K from the φ just updated, without gradient.
  3. Q step: Σ_i 0.5 E[(Q_i(s, a, z) - y)²], y = r + γ (min_i Q̄_i(s', a', z) - α log π(a'|s', z)), a' ~ π(·|s', z),
     never terminal.
  4. π step: minimize E[α log π(a|s, z) - min_i Q_i(s, a, z)], a ~ π(·|s, z) reparameterized.
  5. Polyak averaging of both target Qs, τ = 5e-3.
α is fixed at 0.1 (the official scripts freeze it with --sac_lr_a -1): there is no α step.

Deliberate differences from the official code:
  - time-limit steps are simply never terminal; the official code marks them done and then zeroes every done
    with --turn_off_dones 1 (spec §1.3, §1.11).
  - dropped because they never affect learning (spec §5.20, §7): the unused target φ, the std head of the
    Gaussian φ module (its mean head gives the logits), the frozen α's optimizer, and the stored rewards / next
    actions / returns.
  - one-hot skills are drawn with torch's generator, not NumPy's global one (a different random stream only).
  - Robobin follows the official script, not the paper's table (K = 50 one-hot): continuous z ~ N(0, I_9), a
    Gaussian discriminator N(μ(s'), σ(s')) whose log-std has its own MLP, and the reward log q(z|s') - log(1/9);
    its evaluation reports the mean log q(z|s') instead of an accuracy (spec §2.3, §5.11).
  - evaluation every 500 epochs on Ant, 1000 on HalfCheetah, 125 on pixels, as csf.py; the official DIAYN and
    VISR scripts evaluate half as often on Ant and on pixels (spec §4.1). Evaluation never changes training.
  - additions, not in the official code: the last epoch is always evaluated and checkpointed, every
    evaluation also reports the discriminator's accuracy on 10k replay transitions (chance 1/K), and a
    --buffer-size that is not a multiple of the horizon is rounded down to whole trajectories (the paper's
    1M and 300k are). A checkpoint also holds the loss means since the last evaluation, so a run resumed
    from any epoch reports what the uninterrupted run does.
  - pixels: the replay buffer keeps each frame once and rebuilds the stacks by index (3.7 GB instead of
    22 GB at 300k transitions, same samples); envs.py renders without shadows or multisampling and seeds
    every env differently (spec §5.18), as for csf.py.
  - on a GPU, float32 matmuls use TF32 (torch.set_float32_matmul_precision("high")), which is faster there; a CPU
    computes them in full float32, and the tests' numbers are the CPU's.
"""

import contextlib
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
SKILL_DIMS = {"Ant": 50, "HalfCheetah": 50, "Quadruped": 50, "Humanoid": 50, "Kitchen": 50, "Robobin": 9}  # the scripts
# The official DIAYN-Robobin script runs continuous skills z ~ N(0, I_9) with a Gaussian discriminator (spec §2.3,
# §5.11); the paper's table says K = 50 one-hot. We follow the script, behind the published numbers.
GAUSSIAN_ENVS = ("Robobin",)
NUM_DIAGNOSTIC_SAMPLES = 10_000  # replay transitions behind the discriminator-accuracy diagnostic
NUM_VIDEO_SKILLS = 4  # skills shown side by side in --capture-video


@dataclass
class Args:
    env_id: str = "Ant"
    """the environment: Ant, HalfCheetah (states), Quadruped, Humanoid, Kitchen or Robobin (64×64 pixels)"""
    skill_dim: Optional[int] = None
    """number K of one-hot skills (unset: the paper's 50; on Robobin the dimension d of z ~ N(0, I_d), the script's 9)"""
    seed: int = 1
    """seed of torch, numpy and the envs; on a CPU the same seed gives the same run"""
    total_env_steps: Optional[int] = None
    """training budget in environment steps, evaluation rollouts not counted (unset: the paper's 64M on states, 4.8M on pixels)"""
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
    """torch.compile the three losses (forward and backward) and fuse each Adam step (same numbers as eager up to
    float rounding)"""


# Every numeric flag and the values that mean something ("[" closed end, "(" open end); NaN is never inside.
FLAG_RANGES = {
    "skill_dim": "[2, inf)", "seed": "[0, 2147483647]", "total_env_steps": "[1, inf)", "num_envs": "[1, inf)",
    "grad_steps_per_epoch": "[0, inf)", "learning_starts": "[0, inf)", "batch_size": "[1, inf)",
    "buffer_size": "[1, inf)", "hidden_dim": "[1, inf)", "eval_every": "[1, inf)", "checkpoint_every": "[1, inf)",
    "num_eval_skills": "[1, inf)", "gamma": "[0, 1)", "tau": "(0, 1]", "lr": "(0, inf)", "alpha": "[0, inf)",
}
# What --resume may change: neither the learning problem nor the random streams depend on these.
RESUME_MAY_CHANGE = ("total_env_steps", "eval_every", "checkpoint_every", "resume", "cuda", "buffer_on_device",
                     "track", "wandb_project_name", "wandb_entity", "capture_video", "compile")


def error(message):
    """End the run with one line on stderr, no traceback."""
    sys.exit(f"diayn.py: error: {message}")


def resume_hint(checkpoint_path):
    """What a stopped run can be resumed from."""
    if os.path.isfile(checkpoint_path):
        return f"resume with --resume {checkpoint_path}"
    return "no checkpoint was written yet"


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
    Lower bounds: the replay buffer in host memory; on the device, the hidden-by-hidden weights of the
    discriminator, Q1, Q2 and π with their gradients and Adam's two moments plus Q's two targets, and one batch of
    float observations and 8 hidden activations per transition."""
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


def finite(action, epoch):
    """The policy's action as a numpy array for the envs, which refuse NaN and inf: if it has one, the networks
    diverged in the last update (a NaN loss would show at the next), and the run ends with one line."""
    action = action.cpu().numpy()
    if not np.isfinite(action).all():
        error(f"the policy's action is not finite at epoch {epoch}: its networks diverged")
    return action


def restore_cuda_rng(states):
    """Restore a checkpoint's CUDA RNG states on the GPUs this machine sees: a run resumed where fewer GPUs are
    visible than where it was written sets the ones it has (torch.cuda.set_rng_state_all would raise IndexError)."""
    for index, state in enumerate(states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(state, index)


def in_range(value, interval):
    """Whether `value` lies in an interval written like "[0, 1)" or "(0, inf)"."""
    low, high = (float(end) for end in interval[1:-1].split(","))
    above = low <= value if interval[0] == "[" else low < value
    below = value <= high if interval[-1] == "]" else value < high
    return above and below  # both False for NaN


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
    for flag, paper_value in (("skill_dim", SKILL_DIMS[args.env_id]), ("total_env_steps", spec.total_env_steps),
                              ("num_envs", spec.num_envs), ("grad_steps_per_epoch", spec.grad_steps_per_epoch),
                              ("buffer_size", spec.buffer_size), ("eval_every", spec.eval_every)):
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


def sample_skills(n, skill_dim, gaussian=False, generator=None):
    """z ~ Unif of the K one-hot vectors, or z ~ N(0, I_d) on Robobin (spec §1.2)."""
    if gaussian:
        return torch.randn(n, skill_dim, generator=generator)
    return F.one_hot(torch.randint(skill_dim, (n,), generator=generator), skill_dim).float()


def eval_skills(n, skill_dim, gaussian, generator):
    """The n evaluation skills: the K one-hots split evenly (n // K each, the remainder to the lowest indices;
    with the paper's n = 48 and K = 50, skills 0 to 47 once each), or fresh prior draws on Robobin."""
    if gaussian:
        return sample_skills(n, skill_dim, True, generator)
    return F.one_hot((torch.arange(n) % skill_dim).sort().values, skill_dim).float()


# ---------------------------------------------------------------- losses (spec §1.7, §2.3)
def log_likelihood(discriminator, skill):
    """log q(z|s') per sample: discriminator = φ(s') of the next observations, (B, K) logits for one-hot z, or a
    (mean, log-std) pair of a Gaussian over continuous z (Robobin)."""
    if isinstance(discriminator, tuple):
        mean, log_std = discriminator
        return torch.distributions.Normal(mean, log_std.exp(), validate_args=False).log_prob(skill).sum(-1)
    return (F.log_softmax(discriminator, dim=-1) * skill).sum(-1)


def diayn_reward(discriminator, skill):
    """r = log q(z|s') - log p(z) = log q(z|s') + log K per sample   (DIAYN Eq. 3, spec §2.3)

    The baseline log p(z) = log(1/K) of K one-hot skills; the official Robobin script subtracts log(1/d) from its
    Gaussian log-likelihood too.
    """
    return log_likelihood(discriminator, skill) + math.log(skill.shape[-1])


def discriminator_loss(discriminator, skill):
    """L(φ) = -E[log q(z|s') - log p(z)]: the cross-entropy of q(·|s') against z, less the constant log K.
    Returns the loss and the rewards of the batch."""
    reward = diayn_reward(discriminator, skill)
    return -reward.mean(), reward


def critic_target(reward, next_q1, next_q2, next_log_prob, alpha, gamma):
    """y = r + γ (min_i Q̄_i(s', a', z) - α log π(a'|s', z)), never terminal (spec §1.7)."""
    return reward + gamma * (torch.min(next_q1, next_q2) - alpha * next_log_prob)


def critic_loss(q1, q2, target):
    """Σ_i 0.5 E[(Q_i - y)²]: the twin Qs, one optimizer (spec §1.5, §1.7)."""
    return 0.5 * F.mse_loss(q1, target) + 0.5 * F.mse_loss(q2, target)


def actor_loss(log_prob, q1, q2, alpha):
    """L(π) = E[α log π(a|s, z) - min_i Q_i(s, a, z)], a ~ π(·|s, z)."""
    return (alpha * log_prob - torch.min(q1, q2)).mean()


# ---------------------------------------------------------------- networks (spec §1.8)
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
        self.encoder, features = envs.make_encoder(observation_space)  # every network owns its encoder (spec §1.9)
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


# ---------------------------------------------------------------- replay buffer (spec §1.4)
def to_device(array, device):
    """A host array as a tensor on `device`; to a GPU through pinned memory, without waiting for the copy."""
    tensor = torch.from_numpy(array)
    return tensor.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else tensor


def stack_frames(frames):
    """(B, k, *frame_shape) frames, oldest first → (B, *obs_shape): the frames along the last axis, as the env
    stacks them (a state vector, k = 1, is its one frame)."""
    return frames.movedim(1, -2).flatten(-2).contiguous()


class ReplayBuffer:
    """A ring of whole trajectories; transitions (s, a, s', z) are sampled uniformly, with replacement.

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


# ---------------------------------------------------------------- evaluation (spec §4.1-4.2)
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


def main(args, ckpt=None):
    spec = envs.ENV_SPECS[args.env_id]
    run_name = ckpt["run_name"] if ckpt else f"{args.env_id}__{AGENT}__{args.seed}__{int(time.time())}"
    # a resumed run goes on in its checkpoint's folder, whatever the working directory
    run_dir = os.path.dirname(os.path.abspath(args.resume)) if ckpt else os.path.join("runs", run_name)
    os.makedirs(run_dir, exist_ok=True)
    # Ctrl-C ends the run with one line naming the checkpoint to resume from (atomic writes keep it whole)
    checkpoint_path = os.path.join(run_dir, "checkpoint.pt")
    signal.signal(signal.SIGINT, lambda *_: error(f"interrupted; {resume_hint(checkpoint_path)}"))
    steps_per_epoch = args.num_envs * spec.horizon
    num_epochs = args.total_env_steps // steps_per_epoch
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, save_code=True, resume="allow", id=run_name.replace("/", "_"))
    # TensorBoard writes from a thread: a failed write (a full disk) is raised again at the next add_scalar, and
    # ends the run with one line there; its thread stays quiet
    threading.excepthook = lambda hook: None if issubclass(hook.exc_type, OSError) else threading.__excepthook__(hook)
    writer = SummaryWriter(run_dir)
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))

    # ------------------------------------------------------------ seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)  # replay sampling
    eval_rng = np.random.default_rng(args.seed + 1)  # evaluation has its own streams, so it never changes training
    eval_generator = torch.Generator().manual_seed(args.seed + 1)  # Robobin's Gaussian evaluation skills
    gaussian = args.env_id in GAUSSIAN_ENVS
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on the GPUs that have them

    # ------------------------------------------------------------ envs
    # Every trajectory is started by an explicit reset() and ends at the horizon; with autoreset DISABLED the vector
    # env never resets on its own, so the observation after the last step is the final one (never a reset one).
    num_video_skills = min(NUM_VIDEO_SKILLS, args.num_eval_skills) if args.capture_video else 0
    try:  # a pixel world makes its render context at its first frame: the first reset
        train_envs = gym.vector.SyncVectorEnv([lambda: envs.make_env(args.env_id) for _ in range(args.num_envs)],
                                              autoreset_mode=gym.vector.AutoresetMode.DISABLED)
        eval_envs = gym.vector.SyncVectorEnv([
            lambda i=i: envs.make_env(args.env_id, "rgb_array" if i < num_video_skills else None)
            for i in range(args.num_eval_skills)], autoreset_mode=gym.vector.AutoresetMode.DISABLED)
        train_envs.reset(seed=args.seed)
        eval_envs.reset(seed=args.seed + 10_000)
        if args.capture_video:
            eval_envs.envs[0].render()  # fail now, not at the first evaluation
    except envs.RenderUnavailable as e:
        error(e)
    observation_space = train_envs.single_observation_space  # a state vector, or stacked 64×64 RGB frames
    action_dim = train_envs.single_action_space.shape[0]
    d = args.skill_dim
    check_memory(args, observation_space, action_dim, spec.horizon, spec.frame_stack, device)

    # ------------------------------------------------------------ networks and optimizers
    phi = Phi(observation_space, d, args.hidden_dim, gaussian).to(device)
    qf1, qf2 = (QNetwork(observation_space, action_dim, d, args.hidden_dim).to(device) for _ in range(2))
    qf1_target, qf2_target = (QNetwork(observation_space, action_dim, d, args.hidden_dim).to(device) for _ in range(2))
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    actor = Actor(observation_space, action_dim, d, args.hidden_dim).to(device)
    # --compile: fused, one kernel per optimizer step, equal up to rounding. Eager: foreach, the numbers of the
    # per-tensor loop bit for bit in fewer, larger calls (the default on a GPU; on a CPU, faster than the loop)
    adam = {"lr": args.lr, "fused": args.compile, "foreach": not args.compile}
    phi_optimizer = torch.optim.Adam(phi.parameters(), **adam)
    qf_params, qf_target_params = [*qf1.parameters(), *qf2.parameters()], [*qf1_target.parameters(),
                                                                          *qf2_target.parameters()]
    qf_optimizer = torch.optim.Adam(qf_params, **adam)
    actor_optimizer = torch.optim.Adam(actor.parameters(), **adam)
    rb = ReplayBuffer(args.buffer_size, spec.horizon, observation_space, spec.frame_stack, action_dim, d, rng,
                      device if args.buffer_on_device else None)
    modules = {"phi": phi, "qf1": qf1, "qf2": qf2, "qf1_target": qf1_target, "qf2_target": qf2_target,
               "actor": actor, "phi_optimizer": phi_optimizer, "qf_optimizer": qf_optimizer,
               "actor_optimizer": actor_optimizer}

    def new_window():  # what happened since the last evaluation: the means and speeds the next one reports
        return {"stats": [], "train_time": 0.0, "grad_steps": 0, "start": time.time(), "env_steps": 0}

    start_epoch, grad_steps, wall_time, since_eval = 0, 0, 0.0, new_window()
    if ckpt:
        try:
            for name, module in modules.items():
                module.load_state_dict(ckpt[name])
                if isinstance(module, torch.optim.Optimizer):  # the Adam --compile asks for now, not the saved one
                    for group in module.param_groups:
                        group.update(fused=args.compile, foreach=not args.compile)
            rb.load_state_dict(ckpt["buffer"])
            start_epoch, grad_steps, wall_time = ckpt["epoch"], ckpt["grad_steps"], ckpt["wall_time"]
            torch.set_rng_state(ckpt["torch_rng"])
            if device.type == "cuda" and ckpt["cuda_rng"] is not None:
                restore_cuda_rng(ckpt["cuda_rng"])
            rng.bit_generator.state, eval_rng.bit_generator.state = ckpt["numpy_rng"], ckpt["eval_numpy_rng"]
            eval_generator.set_state(ckpt["eval_torch_rng"])
            for env, state in zip(train_envs.envs + eval_envs.envs, ckpt["env_rngs"]):
                env.unwrapped.np_random.bit_generator.state = state
            window = ckpt["since_eval"]  # its start was saved as seconds before the checkpoint
            since_eval = {**window, "stats": [s.to(device) for s in window["stats"]], "start": time.time() - window["start"]}
        except (KeyError, RuntimeError, ValueError) as e:  # the state of another version of this script
            error(f"{args.resume} was written by another version of {AGENT}.py ({' '.join(str(e).split())[:160]})")
        # evaluations logged after this checkpoint (the run stopped before writing its next one) are done again
        truncate_log(os.path.join(run_dir, "eval.jsonl"), start_epoch)
        print(f"resumed {run_name} at epoch {start_epoch} ({start_epoch * steps_per_epoch:,} env steps)")

    def save_checkpoint(epoch):
        state = {"agent": AGENT, "args": asdict(args), "run_name": run_name, "epoch": epoch, "grad_steps": grad_steps,
                 "wall_time": wall_time + time.time() - segment_start, "buffer": rb.state_dict(),
                 "torch_rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
                 "numpy_rng": rng.bit_generator.state, "eval_numpy_rng": eval_rng.bit_generator.state,
                 "eval_torch_rng": eval_generator.get_state(),
                 "env_rngs": [e.unwrapped.np_random.bit_generator.state for e in train_envs.envs + eval_envs.envs],
                 "since_eval": {**since_eval, "start": time.time() - since_eval["start"]},
                 **{name: module.state_dict() for name, module in modules.items()}}
        diverged = non_finite({name: state[name] for name in modules})
        if diverged:  # e.g. Adam's second moments overflowed while every loss stayed finite: never saved as good
            error(f"{diverged[0]} holds NaN or inf at epoch {epoch} ({len(diverged)} tensors do): the run diverged; "
                  f"{resume_hint(checkpoint_path)}")
        # atomic: a crash, a kill or a full disk mid-write leaves the previous checkpoint intact
        write_atomically(checkpoint_path, lambda temporary: torch.save(state, temporary), resume_hint(checkpoint_path))

    @torch.no_grad()
    @record_function("evaluation")
    def evaluate(epoch, epoch_stats):
        """Deterministic rollouts → coverage, skill plot, discriminator accuracy, one line of eval.jsonl."""
        skills = eval_skills(args.num_eval_skills, d, gaussian, eval_generator)
        coordinates, frames = [], []

        def record(info):  # the state after reset and after every step
            coordinates.append(info["coordinates"])
            if num_video_skills:
                frames.append(np.concatenate([eval_envs.envs[i].render() for i in range(num_video_skills)], 1))

        obs, info = eval_envs.reset()
        skills_on_device = skills.to(device)
        record(info)
        for _ in range(spec.horizon):
            action = actor.mode(torch.as_tensor(obs, device=device), skills_on_device)
            obs, _, _, _, info = eval_envs.step(finite(action, epoch))
            record(info)
        coordinates = np.stack(coordinates, 1)  # (rollouts, horizon + 1, coord_dim)
        env_steps = epoch * steps_per_epoch
        result = {"epoch": epoch, "env_steps": env_steps, "grad_steps": grad_steps,
                  "wall_time": round(wall_time + time.time() - segment_start, 2),
                  "coverage": envs.coverage(coordinates, args.env_id)}
        if rb.size > 0:  # how often argmax q(·|s') names the trajectory's skill (chance 1/K), over replay transitions;
            n = min(NUM_DIAGNOSTIC_SAMPLES, rb.size)  # for Gaussian skills the mean log q(z|s') instead
            batches = (rb.sample(min(1000, n - i), device, rng=eval_rng) for i in range(0, n, 1000))  # one at a time
            if gaussian:
                result["disc_log_likelihood"] = torch.cat([log_likelihood(phi(b["next_obs"]), b["skill"])
                                                           for b in batches]).mean().item()
            else:
                result["disc_accuracy"] = torch.cat([phi(b["next_obs"]).argmax(-1) == b["skill"].argmax(-1)
                                                     for b in batches]).float().mean().item()
        result.update(epoch_stats)  # training means since the last evaluation
        result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        # every file whole or not at all: a full disk or a read-only folder ends the run with one line
        hint = resume_hint(checkpoint_path)
        fig = plot_skills(coordinates, skill_colors(skills.numpy(), gaussian),
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
        shown = ("disc_accuracy", "disc_log_likelihood", *epoch_stats)
        print(f"eval  epoch {epoch} | env steps {env_steps:,} | coverage {result['coverage']} | "
              + " | ".join(f"{k} {result[k]:.4g}" for k in shown if k in result))

    # ------------------------------------------------------------ one gradient step (spec §1.5, §2.3)
    # Each loss is a function of the batch alone, so that --compile can compile it (forward and backward);
    # the optimizer steps between them stay eager.
    def phi_objective(next_obs, skill):
        """The discriminator's loss on q(z|s') = softmax(φ(s')), and its rewards."""
        return discriminator_loss(phi(next_obs), skill)

    def qf_objective(obs, action, next_obs, skill):
        """The Q step's loss on r = log q(z|s') + log K from the φ just updated, and the rewards."""
        with torch.no_grad():
            reward = diayn_reward(phi(next_obs), skill)
            next_action, next_log_prob = actor.sample(next_obs, skill)
            target = critic_target(reward, qf1_target(next_obs, skill, next_action),
                                   qf2_target(next_obs, skill, next_action), next_log_prob, args.alpha, args.gamma)
        return critic_loss(qf1(obs, skill, action), qf2(obs, skill, action), target), reward

    def actor_objective(obs, skill):
        """The π step's loss."""
        new_action, log_prob = actor.sample(obs, skill)
        return actor_loss(log_prob, qf1(obs, skill, new_action), qf2(obs, skill, new_action), args.alpha)

    if args.compile:
        # on a CPU, eager's random draws, so that only the float rounding differs (the equality test); on a GPU,
        # inductor's own, fused into the kernels (the fallback is its slow debugging mode)
        torch._inductor.config.fallback_random = device.type == "cpu"
        phi_objective, qf_objective, actor_objective = map(torch.compile, (phi_objective, qf_objective,
                                                                          actor_objective))

    def update(batch):
        obs, action, next_obs, skill = batch["obs"], batch["action"], batch["next_obs"], batch["skill"]
        with record_function("phi step"):  # the discriminator
            phi_loss, _ = phi_objective(next_obs, skill)
            phi_optimizer.zero_grad()
            phi_loss.backward()
            phi_optimizer.step()
        with record_function("qf step"):
            qf_loss, reward = qf_objective(obs, action, next_obs, skill)
            qf_optimizer.zero_grad()
            qf_loss.backward()
            qf_optimizer.step()
        with record_function("actor step"):  # the gradient flows through Q to the action, none into Q's weights
            qf1.requires_grad_(False), qf2.requires_grad_(False)
            pi_loss = actor_objective(obs, skill)
            actor_optimizer.zero_grad()
            pi_loss.backward()
            actor_optimizer.step()
            qf1.requires_grad_(True), qf2.requires_grad_(True)
        with torch.no_grad():  # the target Qs: Q̄ ← (1 - τ) Q̄ + τ Q, every tensor in one call
            torch._foreach_lerp_(qf_target_params, qf_params, args.tau)
        return torch.stack([phi_loss, qf_loss, pi_loss, reward.mean()]).detach()

    stat_names = ("phi_loss", "qf_loss", "actor_loss", "reward")
    loss_columns = [i for i, name in enumerate(stat_names) if name.endswith("loss")]

    # ------------------------------------------------------------ main loop
    segment_start = time.time()
    for epoch in range(start_epoch, num_epochs + 1):
        # evaluate and checkpoint at the start of the epoch: what the previous `epoch` epochs produced
        if (epoch % args.eval_every == 0 or epoch == num_epochs) and not (ckpt and epoch == start_epoch):
            stats = dict(zip(stat_names, torch.stack(since_eval["stats"]).mean(0).tolist())) if since_eval["stats"] else {}
            elapsed = time.time() - since_eval["start"]
            if since_eval["env_steps"]:
                stats["sps"] = since_eval["env_steps"] / elapsed
            if since_eval["grad_steps"]:
                stats["ms_per_grad_step"] = 1000 * since_eval["train_time"] / since_eval["grad_steps"]
            evaluate(epoch, stats)
            since_eval = new_window()
        if epoch == num_epochs or (epoch % args.checkpoint_every == 0 and epoch != start_epoch):
            save_checkpoint(epoch)
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

        # train
        if rb.size >= args.learning_starts and args.grad_steps_per_epoch > 0:
            train_start = time.time()
            losses = []
            for _ in range(args.grad_steps_per_epoch):
                with record_function("sampling"):
                    batch = rb.sample(args.batch_size, device)
                losses.append(update(batch))
            losses = torch.stack(losses)
            bad = ~torch.isfinite(losses[:, loss_columns])
            if bad.any():
                step, which = bad.nonzero()[0].tolist()
                name = stat_names[loss_columns[which]]
                error(f"{name} is {losses[step, loss_columns[which]].item()} at gradient step {grad_steps + step + 1} "
                      f"(epoch {epoch}); {resume_hint(checkpoint_path)}")
            grad_steps += args.grad_steps_per_epoch
            since_eval["train_time"] += time.time() - train_start
            since_eval["grad_steps"] += args.grad_steps_per_epoch
            since_eval["stats"].append(losses.mean(0))
            for name, value in zip(stat_names, losses.mean(0).tolist()):
                writer.add_scalar(f"losses/{name}" if name.endswith("loss") else f"charts/{name}", value, env_steps)
        sps = int((epoch + 1 - start_epoch) * steps_per_epoch / (time.time() - segment_start))
        writer.add_scalar("charts/SPS", sps, env_steps)
        writer.add_scalar("charts/grad_steps", grad_steps, env_steps)
        if (epoch + 1) % 10 == 0:
            last = dict(zip(stat_names, since_eval["stats"][-1].tolist())) if since_eval["stats"] else {}
            print(f"epoch {epoch + 1} | env steps {env_steps:,} | SPS {sps} | "
                  + " | ".join(f"{k} {v:.4g}" for k, v in last.items()), flush=True)

    train_envs.close()
    eval_envs.close()
    writer.close()
    if args.track:
        wandb.finish()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as before the run
    print(f"done: {run_dir}")


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


if __name__ == "__main__":
    args, ckpt = parse_args()
    try:
        main(args, ckpt)
    except OSError as e:  # the run's folder or TensorBoard's file cannot be written (read-only, a full disk)
        error(f"cannot write {os.fsdecode(e.filename) if e.filename else 'the TensorBoard log'} ({e.strerror or e})")
