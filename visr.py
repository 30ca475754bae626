"""VISR, Variational Intrinsic Successor featuRes (Hansen et al., ICLR 2020), in one file: a baseline of "Can a MISL
Fly? Analysis and Ingredients for Mutual Information Skill Learning" (Zheng et al., ICLR 2025).

A skill z ~ p(z) = Unif(S^{d-1}) is held for a whole trajectory of π(a | s, z). φ(s) ∈ R^d is a von Mises-Fisher
discriminator of z from the *current* state, q(z | s) ∝ exp(ê(s)ᵀz), ê(s) = φ(s)/‖φ(s)‖, κ = 1, trained on the reverse
variational lower bound (paper App. A.5; Hansen et al., Eq. 9):
    I(S; Z) ≥ H(Z) + E[log q(z | s)],   so   max_φ E[ê(s)ᵀz].
The reward φ(s)ᵀz (--normalized-cumulant: ê(s)ᵀz) is linear in z, so, as in CSF (paper §5.2), successor features
ψ(s, a, z) ∈ R^d regress by TD onto φ(s) + γ ψ̄(s', a', z), a' ~ π(·|s', z), and Q = ψᵀz. π is SAC's actor on Q, with an
automatic α; no GPI (App. B.2).

    python visr.py --env-id Ant                                              # the paper's run: 64M env steps
    python visr.py --env-id Ant --hidden-dim 256 --total-env-steps 3000000   # about 2 h on one CPU core
    python visr.py --env-id Humanoid --cudagraphs --buffer-on-device         # 64×64 pixels, on a GPU

Deliberate differences from the official code (github.com/Princeton-RL/contrastive-successor-features, iod/metra_sf.py
with --no_diff_in_rep 1 --self_normalizing 1 --dual_reg 0), none in the algorithm:
  - no --turn_off_dones flag: a time limit is never a terminal step, as every official script sets it.
  - left out, as they never change learning: the future-goal sampler, the never-updated target φ, METRA's λ (off under
    --dual_reg 0), the stored rewards, next actions and returns. ê(s) of a zero φ(s) is 0, not NaN.
  - evaluation (never changing training) every 500 epochs on Ant, 1000 on HalfCheetah, 125 on Quadruped and Humanoid,
    as csf.py (the official VISR script: 1000 on Ant, 250 on Quadruped and Humanoid), and at the last epoch, also
    checkpointed; all but a new run's first report the mean ê(s)ᵀz of up to 10k replay transitions (drawn with
    replacement); a checkpoint holds the stats since the last evaluation, which a resumed run reports.
  - --buffer-size is rounded down to whole trajectories; each pixel frame is stored once, stacks rebuilt by index
    (3.7 GB, not 22 GB, at 300k transitions). On a CPU, envs.py renders without shadows or multisampling
    (CLEANMISL_RENDER=official: the official look); every env is seeded differently (the official code: all alike).
  - on a GPU, float32 matmuls use TF32; the tests' numbers are the CPU's, in float32.
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

AGENT = "visr"
SKILL_DIMS = {"Ant": 5, "HalfCheetah": 5, "Quadruped": 5, "Humanoid": 5, "Kitchen": 5, "Robobin": 5}  # App. B.3


@dataclass
class Args:
    env_id: Literal["Ant", "HalfCheetah", "Quadruped", "Humanoid", "Kitchen", "Robobin"] = "Ant"  # The world.
    skill_dim: Optional[int] = None  # Skill dimension d (unset: the paper's 5).
    seed: int = 1  # Seed of every random stream; on a CPU, the same seed gives the same run.
    total_env_steps: Optional[int] = None  # Env steps to train for (unset: the paper's).
    num_envs: Optional[int] = None  # Trajectories collected per epoch, one skill each (unset: the paper's).
    grad_steps_per_epoch: Optional[int] = None  # Gradient steps after each collection (unset: the paper's).
    learning_starts: int = 10_000  # Transitions stored before the first gradient step.
    batch_size: int = 256  # Transitions per minibatch, drawn uniformly with replacement.
    buffer_size: Optional[int] = None  # Replay capacity in transitions (unset: the paper's).
    hidden_dim: int = 1024  # Width of the hidden layers of φ, ψ and π.
    eval_every: Optional[int] = None  # Epochs between evaluations, and the last one (unset: the paper's).
    checkpoint_every: Optional[int] = None  # Epochs between checkpoints, and the last one (unset: --eval-every).
    resume: Optional[str] = None  # A checkpoint.pt to continue, in its run's folder, with its flags.
    cuda: bool = True  # Use the GPU when torch sees one.
    parallel_envs: bool = True  # Step the envs in worker processes (the same numbers).
    buffer_on_device: bool = False  # Keep the replay buffer on the training device and draw the batches there.
    cudagraphs: bool = False  # On a GPU, replay the whole gradient step as one CUDA graph.
    compile: bool = False  # Compile the whole gradient step with torch.compile.
    bf16: bool = False  # On pixels, run the encoders' convolutions in bfloat16.
    track: bool = False  # Also log to Weights & Biases.
    wandb_project_name: str = "cleanmisl"  # The W&B project, with --track.
    wandb_entity: Optional[str] = None  # The W&B team, with --track.
    capture_video: bool = False  # At each evaluation, write an MP4 of up to four rollouts side by side.
    num_eval_skills: int = 48  # Deterministic evaluation rollouts, one fresh skill each.
    normalized_cumulant: bool = False  # Regress ψ on ê(s) instead of the official φ(s).
    gamma: float = 0.99  # Discount of the successor features.
    tau: float = 0.005  # Polyak step of the target ψ networks.
    lr: float = 1e-4  # Adam learning rate of φ, ψ, π and log α.
    alpha_init: float = 0.01  # Initial entropy temperature α, tuned towards the entropy -|A|/2.


# The values each numeric flag may take ("[": closed end, "(": open end); NaN never.
FLAG_RANGES = {
    "skill_dim": "[1, inf)", "seed": "[0, 2147483647]", "total_env_steps": "[1, inf)", "num_envs": "[1, inf)",
    "grad_steps_per_epoch": "[0, inf)", "learning_starts": "[0, inf)", "batch_size": "[1, inf)",
    "buffer_size": "[1, inf)", "hidden_dim": "[1, inf)", "eval_every": "[1, inf)", "checkpoint_every": "[1, inf)",
    "num_eval_skills": "[1, inf)", "gamma": "[0, 1)", "tau": "(0, 1]", "lr": "(0, inf)", "alpha_init": "(0, inf)"}
# What --resume may change: not the problem learned (the device may change the draws).
RESUME_MAY_CHANGE = ("total_env_steps", "eval_every", "checkpoint_every", "resume", "cuda", "parallel_envs", "compile",
                     "buffer_on_device", "cudagraphs", "bf16", "track", "wandb_project_name", "wandb_entity",
                     "capture_video")


def sample_skills(n, skill_dim, generator=None):
    """z ~ p(z) = Unif(S^{d-1}): a standard normal draw scaled to unit length, as the official code's."""
    z = torch.randn(n, skill_dim, generator=generator)
    return z / z.norm(dim=-1, keepdim=True)


def vmf_score(phi_s, skill):
    """ê(s)ᵀz = log q(z|s) of the vMF discriminator up to a constant (the official --self_normalizing 1)."""
    return (F.normalize(phi_s, dim=-1) * skill).sum(-1)


def visr_phi_loss(phi_s, skill):
    """L(φ) = -E[ê(s)ᵀz] on the current states (the official --no_diff_in_rep 1), and the mean ê(s)ᵀz."""
    score = vmf_score(phi_s, skill)
    return -score.mean(), score.mean()


def successor_feature_target(cumulant, next_psi, skill, gamma):
    """ψ̂ = c(s) + γ ψ̄_k(s', a', z), k = argmin_k ψ̄_kᵀz per sample, never terminal (next_psi: (critics, B, d))."""
    smaller = (next_psi * skill).sum(-1).argmin(0)
    return cumulant + gamma * next_psi[smaller, torch.arange(len(skill), device=skill.device)]


def psi_objective(psi, psi_target, phi, actor, obs, action, next_obs, skill, args):
    """L(ψ) = Σ_k mean over the batch and the d components of (ψ_k(s, a, z) - ψ̂)², c(s) from the φ just updated."""
    with torch.no_grad():
        next_action, _ = actor.sample(next_obs, skill)
        cumulant = F.normalize(phi(obs), dim=-1) if args.normalized_cumulant else phi(obs)
        next_psi = torch.stack([net(next_obs, skill, next_action) for net in psi_target])
        target = successor_feature_target(cumulant, next_psi, skill, args.gamma)
    return sum(F.mse_loss(net(obs, skill, action), target) for net in psi)


def actor_objective(actor, psi, obs, skill, alpha):
    """L(π) = E[α log π(a|s, z) - min_k ψ_k(s, a, z)ᵀz], a ~ π(·|s, z), as CSF's."""
    new_action, log_prob = actor.sample(obs, skill)
    q = torch.stack([(net(obs, skill, new_action) * skill).sum(-1) for net in psi]).amin(0)
    return (alpha * log_prob - q).mean(), log_prob


def mlp(in_dim, hidden_dim, out_dim, activation, init):
    """Linear → act → Linear → act → Linear, zero biases, as the official run/train.py's."""
    net = nn.Sequential(nn.Linear(in_dim, hidden_dim), activation(), nn.Linear(hidden_dim, hidden_dim),
                        activation(), nn.Linear(hidden_dim, out_dim))
    for layer in net:
        if isinstance(layer, nn.Linear):
            init(layer.weight)
            nn.init.zeros_(layer.bias)
    return net


class Phi(nn.Module):
    """φ(s) ∈ R^d (ReLU, Xavier-uniform); each network has its own pixel encoder, as the official ones."""

    def __init__(self, space, skill_dim, hidden_dim):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        self.net = mlp(features, hidden_dim, skill_dim, nn.ReLU, nn.init.xavier_uniform_)

    def forward(self, obs):
        return self.net(self.encoder(obs))


class SuccessorFeatures(nn.Module):
    """ψ(s, a, z) ∈ R^d, the discounted sum of future cumulants (ReLU, Xavier-normal)."""

    def __init__(self, space, action_dim, skill_dim, hidden_dim):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        self.net = mlp(features + skill_dim + action_dim, hidden_dim, skill_dim, nn.ReLU, nn.init.xavier_normal_)

    def forward(self, obs, skill, action):
        return self.net(torch.cat([self.encoder(obs), skill, action], -1))


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

    def sample(self, obs, skill):  # a reparameterized action, its log-probability with the tanh correction
        mean, log_std = self(obs, skill)
        normal = torch.distributions.Normal(mean, log_std.exp(), validate_args=False)  # NaN: caught per epoch
        action = torch.tanh(u := normal.rsample())
        log_prob = normal.log_prob(u).sum(-1) - torch.log((1 - action.pow(2)).clamp(0, 1) + 1e-6).sum(-1)
        return action, log_prob

    def mode(self, obs, skill):
        return torch.tanh(self(obs, skill)[0])


@contextlib.contextmanager
def frozen(modules):
    """No gradient into these modules' weights in the block; one flows through them to their inputs."""
    for module in modules:
        module.requires_grad_(False)
    try:
        yield
    finally:
        for module in modules:
            module.requires_grad_(True)


class ReplayBuffer:
    """A ring of whole trajectories sampled uniformly with replacement (the official path_buffer_ex.py), each pixel
    frame stored once; numpy arrays on the host, or tensors on `device`."""

    def __init__(self, capacity, horizon, space, frame_stack, action_dim, skill_dim, rng, device=None):
        frame_shape = space.shape[:-1] + (space.shape[-1] // frame_stack,)
        n = capacity // horizon  # whole trajectories
        self.horizon, self.frame_stack, self.rng, self.device, self.pos, self.num_stored = \
            horizon, frame_stack, rng, device, 0, 0  # pos, num_stored: in trajectories
        self.frames = self.zeros((n, horizon + 1, *frame_shape), space.dtype)
        self.actions = self.zeros((n, horizon, action_dim), np.float32)
        self.skills = self.zeros((n, skill_dim), np.float32)
        self.frame_offsets = self.to_storage(np.arange(1 - frame_stack, 2))  # frames t-k+1..t+1 of a transition at t
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

    def add(self, observations, actions, skills):  # (n, horizon + 1, *obs_shape), (n, horizon, |A|), (n, d)
        n, capacity = len(observations), len(self.frames)
        idx = self.to_storage((self.pos + np.arange(n)) % capacity)
        self.frames[idx] = self.to_storage(observations[..., -self.frames.shape[-1]:], self.frames)  # newest frames
        self.actions[idx] = self.to_storage(actions, self.actions)
        self.skills[idx] = self.to_storage(skills, self.skills)
        self.pos, self.num_stored = (self.pos + n) % capacity, min(self.num_stored + n, capacity)

    def gather(self, batch_size, rng=None):  # (B, k + 1) frames of s and s'; `rng`: drawn on the host
        if self.device is None or rng is not None:
            i = self.to_storage((rng or self.rng).integers(0, self.size, batch_size))
        else:
            i = torch.randint(0, self.size, (batch_size,), generator=self.generator, device=self.device)
        trajectory, t = i // self.horizon, i % self.horizon
        steps = (t[:, None] + self.frame_offsets).clip(min=0)  # the first frame repeated before t = 0
        return {"frames": self.frames[trajectory[:, None], steps], "action": self.actions[trajectory, t],
                "skill": self.skills[trajectory]}

    def sample(self, batch_size, device, rng=None):  # copied pinned, without waiting; stacked on `device`
        batch = self.gather(batch_size, rng)
        if self.device is None:
            batch = {key: torch.from_numpy(value) for key, value in batch.items()}
            if torch.device(device).type == "cuda":
                batch = {key: value.pin_memory().to(device, non_blocking=True) for key, value in batch.items()}
        frames = batch.pop("frames")
        return {"obs": frames[:, :-1].movedim(1, -2).flatten(-2).contiguous(),
                "next_obs": frames[:, 1:].movedim(1, -2).flatten(-2).contiguous(), **batch}

    def state_dict(self):  # tensors: torch.save copies a pickled array
        n = self.num_stored
        return {"pos": self.pos, "num_stored": n, "frames": torch.as_tensor(self.frames[:n]).cpu(),
                "actions": torch.as_tensor(self.actions[:n]).cpu(), "skills": torch.as_tensor(self.skills[:n]).cpu(),
                "generator": None if self.generator is None else self.generator.get_state()}

    def load_state_dict(self, state):
        self.pos, self.num_stored = state["pos"], state["num_stored"]
        for name in ("frames", "actions", "skills"):
            getattr(self, name)[:self.num_stored] = state[name] if self.device is None else state[name].to(self.device)
        if self.generator is not None and state.get("generator") is not None:  # None: a host buffer's
            self.generator.set_state(state["generator"])


def main(args, ckpt=None):
    """VISR epoch by epoch (the official iod/iod.py: IOD.train): evaluate; collect a trajectory per env, one skill
    each; take gradient steps (`update`). Around it: checkpoints, logs and the NaN stop."""
    spec = envs.ENV_SPECS[args.env_id]
    steps_per_epoch = args.num_envs * spec.horizon
    num_epochs = args.total_env_steps // steps_per_epoch
    run_name, run_dir, ckpt_path, writer = start_run(args, ckpt)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)  # replay sampling
    eval_rng = np.random.default_rng(args.seed + 1)  # evaluation's own streams
    eval_generator = torch.Generator().manual_seed(args.seed + 1)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    torch.set_float32_matmul_precision("high" if device.type == "cuda" else "highest")  # TF32 on a GPU
    try:  # never reset on their own: trajectories of the horizon
        train_envs, eval_envs = envs.make_envs(
            functools.partial(envs.make_env, args.env_id), args.num_envs, args.num_eval_skills, args.seed,
            4 if args.capture_video else 0, args.parallel_envs)
    except (envs.RenderUnavailable, MemoryError) as e:
        error(e)
    space = train_envs.single_observation_space  # a state vector, or stacked 64×64 RGB frames
    action_dim, d = train_envs.single_action_space.shape[0], args.skill_dim
    check_memory(args, space, action_dim, spec.horizon, spec.frame_stack, device)
    phi = Phi(space, d, args.hidden_dim).to(device)
    psi = [SuccessorFeatures(space, action_dim, d, args.hidden_dim).to(device) for _ in range(2)]  # twin critics
    psi_target = [SuccessorFeatures(space, action_dim, d, args.hidden_dim).to(device) for _ in psi]
    for net, target in zip(psi, psi_target):
        target.load_state_dict(net.state_dict())
    actor = Actor(space, action_dim, d, args.hidden_dim).to(device)
    if args.bf16:
        envs.encoders_in_bf16(phi, *psi, *psi_target, actor)
    log_alpha = torch.tensor(math.log(args.alpha_init), device=device, requires_grad=True)
    target_entropy = -action_dim / 2  # H̄ = -|A|/2, the official iod/metra.py's
    adam = adam_options(args, device)
    phi_optimizer = torch.optim.Adam(phi.parameters(), **adam)
    psi_params = [param for net in psi for param in net.parameters()]
    psi_target_params = [param for net in psi_target for param in net.parameters()]
    psi_optimizer = torch.optim.Adam(psi_params, **adam)  # one for the twins, on the sum of their losses
    actor_optimizer = torch.optim.Adam(actor.parameters(), **adam)
    alpha_optimizer = torch.optim.Adam([log_alpha], **adam)
    rb = ReplayBuffer(args.buffer_size, spec.horizon, space, spec.frame_stack, action_dim, d, rng,
                      device if args.buffer_on_device else None)
    modules = {"phi": phi, "psi1": psi[0], "psi2": psi[1], "psi1_target": psi_target[0], "psi2_target": psi_target[1],
               "actor": actor, "phi_optimizer": phi_optimizer, "psi_optimizer": psi_optimizer,
               "actor_optimizer": actor_optimizer, "alpha_optimizer": alpha_optimizer, "log_alpha": log_alpha}
    streams = rng, eval_rng, eval_generator, train_envs, eval_envs
    start_epoch, grad_steps, wall_time, window = (
        restore_checkpoint(ckpt, args, run_dir, modules, rb, streams, device) if ckpt else (0, 0, 0.0, new_window()))

    def update(batch):  # as the official iod/metra_sf.py; the stats by name, left on the device
        obs, action, next_obs, skill = batch["obs"], batch["action"], batch["next_obs"], batch["skill"]
        with record_function("phi step"):
            phi_loss, score = visr_phi_loss(phi(obs), skill)
            phi_optimizer.zero_grad()
            phi_loss.backward()
            phi_optimizer.step()
        with record_function("psi step"):  # then ψ̄ ← (1 - τ) ψ̄ + τ ψ
            psi_loss = psi_objective(psi, psi_target, phi, actor, obs, action, next_obs, skill, args)
            psi_optimizer.zero_grad()
            psi_loss.backward()
            psi_optimizer.step()
            with torch.no_grad():
                torch._foreach_lerp_(psi_target_params, psi_params, args.tau)
        with record_function("actor step"), frozen(psi):  # a gradient through ψ to the action, not into ψ
            alpha = log_alpha.exp().detach()
            actor_loss, log_prob = actor_objective(actor, psi, obs, skill, alpha)
            actor_optimizer.zero_grad()
            actor_loss.backward()
            actor_optimizer.step()
        with record_function("alpha step"):  # L(α) = -E[log α (log π(a|s, z) + H̄)]
            alpha_loss = -(log_alpha * (log_prob.detach() + target_entropy)).mean()
            alpha_optimizer.zero_grad()
            alpha_loss.backward()
            alpha_optimizer.step()
        return {"phi_loss": phi_loss.detach(), "psi_loss": psi_loss.detach(), "actor_loss": actor_loss.detach(),
                "alpha_loss": alpha_loss.detach(), "batch_score": score.detach(), "alpha": alpha}

    update = fast_path(update, args, device)  # --compile, --cudagraphs
    segment_start = time.time()
    for epoch in range(start_epoch, num_epochs + 1):
        if (epoch % args.eval_every == 0 or epoch == num_epochs) and not (ckpt and epoch == start_epoch):
            evaluate(epoch, grad_steps, wall_time + time.time() - segment_start, window, args, modules, rb, streams,
                     device, run_dir, writer)
            window = new_window()
        if epoch == num_epochs or (epoch % args.checkpoint_every == 0 and epoch != start_epoch):
            save_checkpoint(ckpt_path, args, run_name, epoch, grad_steps, wall_time + time.time() - segment_start,
                            window, modules, rb, streams, device)
        if epoch == num_epochs:
            break
        skills = sample_skills(args.num_envs, d).to(device)  # collect a trajectory per env, one skill each
        observations, actions = [train_envs.reset()[0]], []
        with torch.no_grad(), record_function("collection"):
            for t in range(spec.horizon):
                action = finite(actor.sample(torch.as_tensor(observations[-1], device=device), skills)[0], epoch)
                obs, _, terminated, truncated, _ = train_envs.step(action)
                # never terminal, cut at the horizon: the buffer's layout
                assert not terminated.any() and (truncated == (t == spec.horizon - 1)).all(), (t, terminated, truncated)
                observations.append(obs)  # after the last step, the final observation
                actions.append(action)
        rb.add(np.stack(observations, 1), np.stack(actions, 1), skills.cpu().numpy())
        window["env_steps"] += steps_per_epoch
        env_steps = (epoch + 1) * steps_per_epoch
        train_start, step_stats = time.time(), []  # gradient steps, each on its own minibatch
        for _ in range(args.grad_steps_per_epoch if rb.size >= args.learning_starts else 0):
            with record_function("sampling"):
                batch = rb.sample(args.batch_size, device)
            step_stats.append(update(batch))
        sps = (epoch + 1 - start_epoch) * steps_per_epoch / (time.time() - segment_start)  # evaluations included
        log_epoch(window, step_stats, time.time() - train_start, epoch, grad_steps, env_steps, sps, writer, args,
                  ckpt_path)  # ends the run at a NaN loss
        grad_steps += len(step_stats)

    train_envs.close()
    eval_envs.close()
    writer.close()
    if args.track:
        import wandb
        wandb.finish()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"done: {run_dir}")


# INFRASTRUCTURE: the command line, start-up, fast path, checkpoints, evaluation, logging
def parse_args(argv=None):
    """The flags (unset: the paper's for the env; --resume: the run's but RESUME_MAY_CHANGE's) and the checkpoint."""
    args, ckpt = tyro.cli(Args, args=argv), None
    if args.resume:
        try:
            ckpt = torch.load(args.resume, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001
            error(f"{args.resume} is not a readable checkpoint ({type(e).__name__})" if os.path.isfile(args.resume)
                  else f"no checkpoint file at {args.resume}")
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
        if not ((low <= value if interval[0] == "[" else low < value)  # both False for NaN
                and (value <= high if interval[-1] == "]" else value < high)):
            error(f"--{flag.replace('_', '-')} must be in {interval}, got {value}")
    horizon = envs.ENV_SPECS[args.env_id].horizon
    epoch = args.num_envs * horizon  # env steps and transitions
    for flag, verb, unit in (("buffer_size", "hold", "transitions"), ("total_env_steps", "cover", "env steps")):
        if getattr(args, flag) < epoch:
            error(f"--{flag.replace('_', '-')} must {verb} one epoch (--num-envs × {horizon} = {epoch} {unit}), got "
                  f"{getattr(args, flag)}")
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
    flags = ("total_env_steps", "num_envs", "grad_steps_per_epoch", "buffer_size", "eval_every")
    return {"skill_dim": SKILL_DIMS[env_id], **{flag: getattr(envs.ENV_SPECS[env_id], flag) for flag in flags}}


def start_run(args, ckpt):
    """The run's name, folder, checkpoint path and TensorBoard writer; W&B, Ctrl-C as one line, the env's flags."""
    run_name = ckpt["run_name"] if ckpt else f"{args.env_id}__{AGENT}__{args.seed}__{int(time.time())}"
    run_dir = os.path.dirname(os.path.abspath(args.resume)) if ckpt else os.path.join("runs", run_name)
    os.makedirs(run_dir, exist_ok=True)
    ckpt_path = os.path.join(run_dir, "checkpoint.pt")
    signal.signal(signal.SIGINT, lambda *_: error("interrupted", ckpt_path))  # every write is atomic
    if args.track:
        import wandb
        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, save_code=True, resume="allow", id=run_name.replace("/", "_"))
    # a failed write in TensorBoard's thread comes back at the next add_scalar, as one line
    threading.excepthook = lambda hook: None if issubclass(hook.exc_type, OSError) else threading.__excepthook__(hook)
    writer = SummaryWriter(run_dir)
    writer.add_text("hyperparameters", "|param|value|\n|-|-|" + "".join(f"\n|{k}|{v}|" for k, v in vars(args).items()))
    flags = (*env_defaults(args.env_id), "checkpoint_every")
    print(f"{args.env_id} (horizon {envs.ENV_SPECS[args.env_id].horizon}): "
          + ", ".join(f"--{flag.replace('_', '-')} {getattr(args, flag)}" for flag in flags)
          + (" (the run's own)" if ckpt else " (a flag not given takes the paper's value for the env)"), flush=True)
    return run_name, run_dir, ckpt_path, writer


def check_memory(args, space, action_dim, horizon, frame_stack, device):
    """One line, before allocating, if lower bounds of the buffer, networks and a batch exceed the free memory."""
    frame_bytes = math.prod(space.shape) // frame_stack * space.dtype.itemsize
    trajectory_bytes = (horizon + 1) * frame_bytes + 4 * (horizon * action_dim + args.skill_dim)
    host = {"the replay buffer (--buffer-size)": args.buffer_size // horizon * trajectory_bytes}
    on_device = {"the networks (--hidden-dim)": 4 * args.hidden_dim**2 * (4 * 4 + 2),
                 "one batch (--batch-size)": 4 * args.batch_size * (2 * math.prod(space.shape) + 8 * args.hidden_dim)}
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
    fused, capturable = args.cudagraphs and not args.compile, args.cudagraphs and device.type == "cuda"
    return {"lr": args.lr, "fused": fused, "foreach": not fused, "capturable": capturable}


def fast_path(update, args, device):
    """The gradient step compiled as one function (on a CPU with eager's random draws), on a GPU one CUDA graph."""
    if args.compile:
        torch._inductor.config.fallback_random = device.type == "cpu"
        update = torch.compile(update)
    if args.cudagraphs and device.type != "cuda":
        print("--cudagraphs: CUDA graphs need a GPU; on the CPU the gradient step runs without them", flush=True)
    return CudaGraphStep(update) if args.cudagraphs and device.type == "cuda" else update


class CudaGraphStep:
    """`step(batch) -> stats` as a CUDA graph: WARMUP steps on a side stream, then one recorded, then replays."""

    WARMUP = 3

    def __init__(self, step):
        self.step, self.calls, self.graph = step, 0, None

    def __call__(self, batch):
        if self.calls < self.WARMUP:
            self.calls, side = self.calls + 1, torch.cuda.Stream()
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


def save_checkpoint(path, args, run_name, epoch, grad_steps, wall_time, window, modules, rb, streams, device):
    """Everything a resumed run needs, written atomically; never a network, optimizer or log α with a NaN or inf."""
    rng, eval_rng, eval_generator, train_envs, eval_envs = streams
    state = {name: module.detach().cpu() if torch.is_tensor(module) else module.state_dict()
             for name, module in modules.items()}
    if diverged := non_finite(state):  # e.g. Adam's moments overflowed while every loss stayed finite
        error(f"{diverged[0]} holds NaN or inf at epoch {epoch} ({len(diverged)} tensors do): the run diverged", path)
    state.update(
        agent=AGENT, args=asdict(args), run_name=run_name, epoch=epoch, grad_steps=grad_steps, wall_time=wall_time,
        buffer=rb.state_dict(), torch_rng=torch.get_rng_state(), numpy_rng=rng.bit_generator.state,
        cuda_rng=torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
        eval_numpy_rng=eval_rng.bit_generator.state, eval_torch_rng=eval_generator.get_state(),
        env_rngs=[*envs.env_rng_states(train_envs), *envs.env_rng_states(eval_envs)],
        since_eval={**window, "start": time.time() - window["start"]})
    write_atomically(path, lambda temporary: torch.save(state, temporary), path)


def non_finite(state, prefix=""):
    """Names of the float tensors with a NaN or inf in a nested state dict, e.g. "actor_optimizer.state.0.exp_avg"."""
    if torch.is_tensor(state):
        return [prefix] if state.is_floating_point() and not torch.isfinite(state).all() else []
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else []
    return [name for key, value in items for name in non_finite(value, f"{prefix}.{key}".lstrip("."))]


def restore_checkpoint(ckpt, args, run_dir, modules, rb, streams, device):
    """Put a checkpoint back (with this run's Adam options) and drop later evaluations; another version's: one line."""
    try:
        for name, module in modules.items():
            if torch.is_tensor(module):  # log α
                module.data.copy_(ckpt[name])
                continue
            module.load_state_dict(ckpt[name])
            for group in getattr(module, "param_groups", []):  # this run's Adam options
                group.update({key: value for key, value in adam_options(args, device).items() if key != "lr"})
                for param in group["params"]:  # step counts where fused or capturable Adam want them
                    if "step" in module.state.get(param, {}):
                        place = param.device if group["fused"] or group["capturable"] else "cpu"
                        module.state[param]["step"] = module.state[param]["step"].to(place, torch.float32)
        rb.load_state_dict(ckpt["buffer"])
        torch.set_rng_state(ckpt["torch_rng"])
        if device.type == "cuda" and ckpt["cuda_rng"] is not None:
            restore_cuda_rng(ckpt["cuda_rng"])
        rng, eval_rng, eval_generator, train_envs, eval_envs = streams
        rng.bit_generator.state, eval_rng.bit_generator.state = ckpt["numpy_rng"], ckpt["eval_numpy_rng"]
        eval_generator.set_state(ckpt["eval_torch_rng"])
        envs.set_env_rng_states(train_envs, ckpt["env_rngs"][:train_envs.num_envs])
        envs.set_env_rng_states(eval_envs, ckpt["env_rngs"][train_envs.num_envs:])
        window = ckpt["since_eval"]  # start: seconds before the checkpoint
        stats = [{name: value.to(device) for name, value in means.items()} for means in window["stats"]]
        since_eval = {**window, "stats": stats, "start": time.time() - window["start"]}
    except (KeyError, RuntimeError, ValueError, AttributeError) as e:
        error(f"{args.resume} was written by another version of {AGENT}.py ({' '.join(str(e).split())[:160]})")
    log_path = os.path.join(run_dir, "eval.jsonl")
    if os.path.isfile(log_path):  # the run does the later evaluations again
        lines, kept = [line for line in pathlib.Path(log_path).read_text().split("\n") if line.strip()], []
        for number, line in enumerate(lines, 1):
            try:
                kept += [line + "\n"] if json.loads(line)["epoch"] <= ckpt["epoch"] else []
            except (ValueError, KeyError, TypeError):
                if number < len(lines):
                    error(f"line {number} of {log_path} is not an evaluation; mend or delete it, then resume")
                print(f"warning: dropped the torn last line of {log_path}", file=sys.stderr)
        write_atomically(log_path, lambda tmp: pathlib.Path(tmp).write_text("".join(kept)), args.resume)
    env_steps = ckpt["epoch"] * args.num_envs * envs.ENV_SPECS[args.env_id].horizon
    print(f"resumed {ckpt['run_name']} at epoch {ckpt['epoch']} ({env_steps:,} env steps)")
    return ckpt["epoch"], ckpt["grad_steps"], ckpt["wall_time"], since_eval


def restore_cuda_rng(states):
    """The CUDA RNG states of the GPUs this machine has (it may have fewer)."""
    for index, state in enumerate(states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(state, index)


@torch.no_grad()
@record_function("evaluation")
def evaluate(epoch, grad_steps, wall_time, window, args, modules, rb, streams, device, run_dir, writer):
    """Deterministic rollouts of fresh skills: coverage, mean ê(s)ᵀz, `window`'s stats to eval.jsonl; plot, video."""
    actor, phi, (_, eval_rng, eval_generator, _, eval_envs) = modules["actor"], modules["phi"], streams
    spec, videos = envs.ENV_SPECS[args.env_id], eval_envs.video_envs
    skills = sample_skills(args.num_eval_skills, args.skill_dim, eval_generator)
    (obs, info), coordinates, frames = eval_envs.reset(), [], []
    for step in range(spec.horizon + 1):  # the state after reset and after every step
        coordinates.append(info["coordinates"])
        frames += [np.concatenate(envs.render_envs(eval_envs, videos), 1)] if videos else []
        if step < spec.horizon:
            action = actor.mode(torch.as_tensor(obs, device=device), skills.to(device))
            obs, _, _, _, info = eval_envs.step(finite(action, epoch))
    paths, env_steps = np.stack(coordinates, 1), epoch * args.num_envs * spec.horizon
    result = {"epoch": epoch, "env_steps": env_steps, "grad_steps": grad_steps, "wall_time": round(wall_time, 2),
              "coverage": envs.coverage(paths, args.env_id)}
    writer.add_scalar("eval/coverage", result["coverage"], env_steps)
    if rb.size > 0:  # 1000 transitions at a time
        n = min(10_000, rb.size)
        batches = (rb.sample(min(1000, n - i), device, rng=eval_rng) for i in range(0, n, 1000))
        result["score"] = torch.cat([vmf_score(phi(b["obs"]), b["skill"]) for b in batches]).mean().item()
        writer.add_scalar("eval/score", result["score"], env_steps)
    per_epoch = [torch.stack(list(means.values())) for means in window["stats"]]  # the mean of the epochs' means
    stats = dict(zip(window["stats"][0], torch.stack(per_epoch).mean(0).tolist())) if per_epoch else {}
    stats |= {"sps": window["env_steps"] / (time.time() - window["start"])} if window["env_steps"] else {}
    stats |= {"ms_per_grad_step": 1000 * window["train_time"] / window["grad_steps"]} if window["grad_steps"] else {}
    result |= {**stats, "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    saved, z = os.path.join(run_dir, "checkpoint.pt"), skills.numpy()
    fig = Figure(figsize=(5, 5))  # coloured by the angle of (z_0, z_1), or the sign of z
    angle = np.arctan2(z[:, 1], z[:, 0]) if args.skill_dim > 1 else np.pi * (z[:, 0] > 0)
    envs.draw_coordinates(ax := fig.subplots(), paths, colormaps["hsv"]((angle + np.pi) / (2 * np.pi)), args.env_id)
    ax.set_title(f"VISR {args.env_id}, {env_steps:,} env steps, coverage {result['coverage']}")
    fig.tight_layout()
    write_atomically(f"{run_dir}/skills_{env_steps:010d}.png", lambda tmp: fig.savefig(tmp, dpi=100), saved)
    if frames:
        import imageio
        os.makedirs(os.path.join(run_dir, "videos"), exist_ok=True)
        write_atomically(os.path.join(run_dir, "videos", f"skills_{env_steps:010d}.mp4"),
                         lambda tmp: imageio.mimsave(tmp, frames, fps=20), saved)
    log_path = os.path.join(run_dir, "eval.jsonl")
    logged = pathlib.Path(log_path).read_text() if os.path.isfile(log_path) else ""
    write_atomically(log_path, lambda tmp: pathlib.Path(tmp).write_text(logged + json.dumps(result) + "\n"), saved)
    print(f"eval  epoch {epoch} | env steps {env_steps:,} | coverage {result['coverage']} | " + " | ".join(
        f"{k} {result[k]:.4g}" for k in ("score", *stats) if k in result), flush=True)


def new_window():
    """Since the last evaluation: each training epoch's means by name, and what the speeds need."""
    return {"stats": [], "train_time": 0.0, "grad_steps": 0, "start": time.time(), "env_steps": 0}


def log_epoch(window, step_stats, train_time, epoch, grad_steps, env_steps, sps, writer, args, ckpt_path):
    """An epoch's means to `window` and TensorBoard (or one line at a NaN or inf *_loss); every 10, the time left."""
    if step_stats:
        names = list(step_stats[0])
        per_step = torch.stack([torch.stack([stats[name] for name in names]) for stats in step_stats])  # (steps, stats)
        losses = [i for i, name in enumerate(names) if name.endswith("_loss")]
        bad = ~torch.isfinite(per_step[:, losses])
        if bad.any():
            step, which = bad.nonzero()[0].tolist()
            error(f"{names[losses[which]]} is {per_step[step, losses[which]].item()} at gradient step "
                  f"{grad_steps + step + 1} (epoch {epoch})", ckpt_path)
        window["stats"].append(dict(zip(names, means := per_step.mean(0))))
        window["grad_steps"] += len(step_stats)
        window["train_time"] += train_time
        for name, value in zip(names, means.tolist()):
            writer.add_scalar(f"losses/{name}" if name.endswith("loss") else f"charts/{name}", value, env_steps)
    writer.add_scalar("charts/SPS", int(sps), env_steps)
    writer.add_scalar("charts/grad_steps", grad_steps + len(step_stats), env_steps)
    if (epoch + 1) % 10 == 0:
        last = {name: value.item() for name, value in window["stats"][-1].items()} if window["stats"] else {}
        print(f"epoch {epoch + 1} | env steps {env_steps:,} | SPS {int(sps)} | "
              f"{duration((args.total_env_steps - env_steps) / sps)} left | "
              + " | ".join(f"{k} {v:.4g}" for k, v in last.items()), flush=True)


def duration(seconds):
    """A time span as people read it: "45 s", "12 min", "3 h 05 min"."""
    minutes = round(seconds / 60)
    return f"{seconds:.0f} s" if seconds < 60 else f"{minutes} min" if minutes < 60 else \
        f"{minutes // 60} h {minutes % 60:02d} min"


def finite(action, epoch):
    """The action as an array for the envs, or one line if it is NaN or inf (the networks diverged)."""
    if not np.isfinite(action := action.cpu().numpy()).all():
        error(f"the policy's action is not finite at epoch {epoch}: its networks diverged")
    return action


def error(message, path=None):
    """End the run with one line on stderr; with `path`, whether it can be resumed from that checkpoint."""
    if path:
        message += f"; resume with --resume {path}" if os.path.isfile(path) else "; no checkpoint was written yet"
    sys.exit(f"{AGENT}.py: error: {message}")


def write_atomically(path, write, ckpt_path):
    """Write `path` by write(temporary) and a rename: a failed write leaves the old file whole, and one line."""
    temporary = "{}.tmp{}".format(*os.path.splitext(path))  # the extension tells savefig and imageio the format
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException as e:  # Ctrl-C too: no temporary left behind
        with contextlib.suppress(OSError):
            os.remove(temporary)
        if not isinstance(e, (OSError, RuntimeError)):  # torch.save's failed write: RuntimeError
            raise
        cut_short = "unexpected pos" in str(e) or "write failed" in str(e)
        reason = (e.strerror or str(e)) if isinstance(e, OSError) else (
            "the write was cut short: is the disk full?" if cut_short else " ".join(str(e).split())[:120])
        error(f"cannot write {path} ({reason})", ckpt_path)


if __name__ == "__main__":
    args, ckpt = parse_args()
    try:
        main(args, ckpt)
    except OSError as e:  # the run's folder or TensorBoard's file
        error(f"cannot write {os.fsdecode(e.filename) if e.filename else 'the TensorBoard log'} ({e.strerror or e})")
