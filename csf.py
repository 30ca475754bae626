"""CSF: Contrastive Successor Features ("Can a MISL Fly?", Zheng et al., ICLR 2025), in one file.

    python csf.py --env-id Ant                     # the paper's settings for Ant
    python csf.py --env-id Ant --hidden-dim 256    # what a CPU can train in an hour

Every epoch (spec §1.1): evaluate every `eval_every` epochs (epoch 0 included), collect `num_envs`
trajectories of the env's horizon with one skill z ~ Unif(S^{d-1}) each, then, once `learning_starts`
transitions are stored, take `grad_steps_per_epoch` gradient steps, each on its own minibatch:
  1. φ step: maximize the contrastive lower bound on I(S, S'; Z)         (paper Eq. 8 / Alg. 1)
  2. ψ step: regress the successor features on Δφ + γ ψ̄                 (paper §5.2)
  3. π step: maximize ψ(s, a, z)ᵀz + α H(π)
  4. α step: automatic entropy tuning towards -|A|/2.

Deliberate differences from the official code (none changes the algorithm behind the published numbers):
  - time-limit steps are simply never terminal; the official code marks them done and then zeroes
    every done with --turn_off_dones 1 (spec §1.3, §1.11).
  - dropped because they never affect learning (spec §7): the buffer's unused future-goal sampler, the
    unused target φ, METRA's λ machinery, and the stored rewards / next actions / returns.
  - the contrastive negatives are 256 fresh draws from the prior (what the scripts run), not in-batch
    negatives (what the paper's hyperparameter table says; spec §5.4).
"""

import json
import math
import os
import random
import resource
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import gymnasium as gym
import matplotlib
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.utils.tensorboard import SummaryWriter

import envs

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

AGENT = "csf"
SKILL_DIMS = {"Ant": 2, "HalfCheetah": 2, "Quadruped": 4, "Humanoid": 8, "Kitchen": 4, "Robobin": 9}  # paper Table 4
NUM_EVAL_SKILLS = 48  # deterministic evaluation rollouts per evaluation (spec §4.1)
NUM_DPHI_SAMPLES = 10_000  # replay transitions behind the E‖Δφ‖² diagnostic
NUM_VIDEO_SKILLS = 4  # skills shown side by side in --capture-video


@dataclass
class Args:
    env_id: str = "Ant"
    """the environment: Ant or HalfCheetah"""
    skill_dim: Optional[int] = None
    """dimension d of the skill z on the unit sphere (unset: the paper's, 2 on Ant and HalfCheetah)"""
    seed: int = 1
    """seed of torch, numpy and the envs; on a CPU the same seed gives the same run"""
    total_env_steps: Optional[int] = None
    """training budget in environment steps, evaluation rollouts not counted (unset: 64M, spec §1.1)"""
    num_envs: Optional[int] = None
    """trajectories collected per epoch, one skill each, stepped together (unset: 8)"""
    grad_steps_per_epoch: Optional[int] = None
    """gradient steps after each collection round (unset: 50 on Ant and HalfCheetah)"""
    learning_starts: int = 10_000
    """transitions stored before the first gradient step"""
    batch_size: int = 256
    """transitions per minibatch, sampled uniformly with replacement"""
    buffer_size: Optional[int] = None
    """replay capacity in transitions, oldest overwritten first (unset: 1M on Ant and HalfCheetah)"""
    hidden_dim: int = 1024
    """width of the two hidden layers of φ, ψ and π (the paper's 1024; 256 trains 10x faster on a CPU)"""
    eval_every: Optional[int] = None
    """epochs between evaluations (unset: 500 on Ant, 1000 on HalfCheetah); the last epoch is always evaluated"""
    checkpoint_every: Optional[int] = None
    """epochs between checkpoints (unset: same as --eval-every); the last epoch always writes one"""
    resume: Optional[str] = None
    """path of a checkpoint.pt to continue from; the run keeps its directory, seed and RNG streams"""
    cuda: bool = True
    """use the GPU when torch sees one"""
    track: bool = False
    """also log to Weights & Biases (WANDB_MODE=offline works)"""
    wandb_project_name: str = "cleanmisl"
    """W&B project, with --track"""
    wandb_entity: Optional[str] = None
    """W&B team, with --track"""
    capture_video: bool = False
    """at each evaluation, write an MP4 of the first few evaluation skills side by side"""
    xi: float = 5.0
    """ξ, the weight of the log-sum-exp (negative) term of the contrastive lower bound"""
    num_negatives: int = 256
    """fresh prior samples z' per gradient step in the log-sum-exp"""
    gamma: float = 0.99
    """discount of the successor features"""
    tau: float = 0.005
    """Polyak step of the target ψ networks, after every gradient step"""
    lr: float = 1e-4
    """Adam learning rate of φ, ψ, π and log α"""
    alpha_init: float = 0.01
    """initial entropy temperature α (tuned automatically towards entropy -|A|/2)"""


def fill_env_defaults(args):
    """Reject bad input with one line, and give every unset flag the paper's value for the env."""
    if args.env_id not in envs.ENV_SPECS:
        sys.exit(f"csf.py: error: unknown --env-id {args.env_id!r}; choose one of {', '.join(envs.ENV_SPECS)}")
    spec = envs.ENV_SPECS[args.env_id]
    args.skill_dim = args.skill_dim if args.skill_dim is not None else SKILL_DIMS[args.env_id]
    args.total_env_steps = args.total_env_steps if args.total_env_steps is not None else spec.total_env_steps
    args.num_envs = args.num_envs or spec.num_envs
    args.grad_steps_per_epoch = args.grad_steps_per_epoch if args.grad_steps_per_epoch is not None else spec.grad_steps_per_epoch
    args.buffer_size = args.buffer_size or spec.buffer_size
    args.eval_every = args.eval_every or spec.eval_every
    args.checkpoint_every = args.checkpoint_every or args.eval_every
    for flag in ("skill_dim", "total_env_steps", "num_envs", "batch_size", "buffer_size", "hidden_dim",
                 "eval_every", "checkpoint_every", "num_negatives"):
        if getattr(args, flag) <= 0:
            sys.exit(f"csf.py: error: --{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.buffer_size < args.num_envs * spec.horizon:
        sys.exit(f"csf.py: error: --buffer-size must hold one epoch ({args.num_envs * spec.horizon} transitions)")
    return args


def sample_skills(n, skill_dim, generator=None):
    """z ~ Unif(S^{d-1}): a standard normal draw scaled to unit length (spec §1.2)."""
    z = torch.randn(n, skill_dim, generator=generator)
    return z / z.norm(dim=-1, keepdim=True)


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


class SuccessorFeatures(nn.Module):
    """ψ(s, a, z) ∈ R^d: the discounted sum of future Δφ under π(·|·, z); Q(s, a, z) = ψ(s, a, z)ᵀz."""

    def __init__(self, obs_dim, action_dim, skill_dim, hidden_dim):
        super().__init__()
        self.net = mlp(obs_dim + skill_dim + action_dim, hidden_dim, skill_dim, nn.ReLU, nn.init.xavier_normal_)

    def forward(self, obs, skill, action):
        return self.net(torch.cat([obs, skill, action], -1))


class Actor(nn.Module):
    """π(a | s, z): tanh-squashed Gaussian on a tanh trunk, output layers initialised 10x smaller."""

    LOG_STD_MIN, LOG_STD_MAX = math.log(1e-6), 2.0

    def __init__(self, obs_dim, action_dim, skill_dim, hidden_dim):
        super().__init__()
        self.trunk = mlp(obs_dim + skill_dim, hidden_dim, hidden_dim, nn.Tanh, nn.init.xavier_uniform_)[:-1]
        self.mean = nn.Linear(hidden_dim, action_dim)
        self.log_std = nn.Linear(hidden_dim, action_dim)
        for head in (self.mean, self.log_std):
            nn.init.xavier_normal_(head.weight)
            head.weight.data.mul_(0.1)
            nn.init.zeros_(head.bias)

    def forward(self, obs, skill):
        h = self.trunk(torch.cat([obs, skill], -1))
        return self.mean(h), self.log_std(h).clamp(self.LOG_STD_MIN, self.LOG_STD_MAX)

    def sample(self, obs, skill):
        """A reparameterized action and its log-probability, with the tanh correction."""
        mean, log_std = self(obs, skill)
        normal = torch.distributions.Normal(mean, log_std.exp())
        u = normal.rsample()
        action = torch.tanh(u)
        log_prob = normal.log_prob(u).sum(-1) - torch.log((1 - action.pow(2)).clamp(0, 1) + 1e-6).sum(-1)
        return action, log_prob

    def mode(self, obs, skill):
        return torch.tanh(self(obs, skill)[0])


# ---------------------------------------------------------------- replay buffer (spec §1.4)
class ReplayBuffer:
    """A ring of transitions (s, a, s', z); whole epochs are appended, the oldest overwritten first."""

    FIELDS = ("obs", "action", "next_obs", "skill")

    def __init__(self, capacity, obs_dim, action_dim, skill_dim, rng):
        dims = {"obs": obs_dim, "action": action_dim, "next_obs": obs_dim, "skill": skill_dim}
        self.data = {k: np.zeros((capacity, dims[k]), dtype=np.float32) for k in self.FIELDS}
        self.capacity, self.pos, self.size, self.rng = capacity, 0, 0, rng

    def add(self, **batch):
        n = len(batch["obs"])
        idx = (self.pos + np.arange(n)) % self.capacity
        for k in self.FIELDS:
            self.data[k][idx] = batch[k]
        self.pos, self.size = (self.pos + n) % self.capacity, min(self.size + n, self.capacity)

    def sample(self, batch_size, device, rng=None):
        idx = (rng or self.rng).integers(0, self.size, batch_size)
        return {k: torch.as_tensor(v[idx], device=device) for k, v in self.data.items()}

    def state_dict(self):
        return {"pos": self.pos, "size": self.size, **{k: v[: self.size].copy() for k, v in self.data.items()}}

    def load_state_dict(self, state):
        self.pos, self.size = state["pos"], state["size"]
        for k in self.FIELDS:
            self.data[k][: self.size] = state[k]


# ---------------------------------------------------------------- evaluation (spec §4.1-4.2)
def plot_skills(coordinates, skills, path, title):
    """The 48 evaluation trajectories, coloured by the angle of (z_0, z_1)."""
    colors = plt.cm.hsv((np.arctan2(skills[:, 1], skills[:, 0]) + np.pi) / (2 * np.pi))
    fig, ax = plt.subplots(figsize=(5, 5))
    for xy, color in zip(coordinates, colors):
        if xy.shape[-1] == 2:
            ax.plot(xy[:, 0], xy[:, 1], color=color, lw=1)
        else:  # x only: position against time
            ax.plot(xy[:, 0], np.arange(len(xy)), color=color, lw=1)
    ax.set_xlabel("x")
    ax.set_ylabel("y" if coordinates.shape[-1] == 2 else "env step")
    ax.set_title(title)
    ax.set_aspect("equal" if coordinates.shape[-1] == 2 else "auto")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args):
    spec = envs.ENV_SPECS[args.env_id]
    ckpt = load_checkpoint(args) if args.resume else None
    run_name = ckpt["run_name"] if ckpt else f"{args.env_id}__{AGENT}__{args.seed}__{int(time.time())}"
    run_dir = os.path.join("runs", run_name)
    os.makedirs(run_dir, exist_ok=True)
    steps_per_epoch = args.num_envs * spec.horizon
    num_epochs = args.total_env_steps // steps_per_epoch
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, save_code=True, resume="allow", id=run_name.replace("/", "_"))
    writer = SummaryWriter(run_dir)
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))

    # ------------------------------------------------------------ seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)  # replay sampling
    eval_rng = np.random.default_rng(args.seed + 1)  # evaluation has its own streams, so it never changes training
    eval_generator = torch.Generator().manual_seed(args.seed + 1)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    # ------------------------------------------------------------ envs
    train_envs = gym.vector.SyncVectorEnv([lambda: envs.make_env(args.env_id) for _ in range(args.num_envs)])
    eval_envs = gym.vector.SyncVectorEnv([
        lambda i=i: envs.make_env(args.env_id, "rgb_array" if args.capture_video and i < NUM_VIDEO_SKILLS else None)
        for i in range(NUM_EVAL_SKILLS)])
    train_envs.reset(seed=args.seed)
    eval_envs.reset(seed=args.seed + 10_000)
    obs_dim = train_envs.single_observation_space.shape[0]
    action_dim = train_envs.single_action_space.shape[0]
    d = args.skill_dim

    # ------------------------------------------------------------ networks and optimizers
    phi = mlp(obs_dim, args.hidden_dim, d, nn.ReLU, nn.init.xavier_uniform_).to(device)
    psi1, psi2 = (SuccessorFeatures(obs_dim, action_dim, d, args.hidden_dim).to(device) for _ in range(2))
    psi1_target, psi2_target = (SuccessorFeatures(obs_dim, action_dim, d, args.hidden_dim).to(device) for _ in range(2))
    psi1_target.load_state_dict(psi1.state_dict())
    psi2_target.load_state_dict(psi2.state_dict())
    actor = Actor(obs_dim, action_dim, d, args.hidden_dim).to(device)
    log_alpha = torch.tensor(math.log(args.alpha_init), device=device, requires_grad=True)
    target_entropy = -action_dim / 2  # the official code halves the usual -|A| (spec §1.7)
    phi_optimizer = torch.optim.Adam(phi.parameters(), lr=args.lr)
    psi_optimizer = torch.optim.Adam(list(psi1.parameters()) + list(psi2.parameters()), lr=args.lr)
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=args.lr)
    alpha_optimizer = torch.optim.Adam([log_alpha], lr=args.lr)
    rb = ReplayBuffer(args.buffer_size, obs_dim, action_dim, d, rng)
    modules = {"phi": phi, "psi1": psi1, "psi2": psi2, "psi1_target": psi1_target, "psi2_target": psi2_target,
               "actor": actor, "phi_optimizer": phi_optimizer, "psi_optimizer": psi_optimizer,
               "actor_optimizer": actor_optimizer, "alpha_optimizer": alpha_optimizer}

    start_epoch, grad_steps, wall_time = 0, 0, 0.0
    if ckpt:
        for name, module in modules.items():
            module.load_state_dict(ckpt[name])
        with torch.no_grad():
            log_alpha.copy_(ckpt["log_alpha"])
        rb.load_state_dict(ckpt["buffer"])
        start_epoch, grad_steps, wall_time = ckpt["epoch"], ckpt["grad_steps"], ckpt["wall_time"]
        torch.set_rng_state(ckpt["torch_rng"])
        eval_generator.set_state(ckpt["eval_torch_rng"])
        rng.bit_generator.state, eval_rng.bit_generator.state = ckpt["numpy_rng"], ckpt["eval_numpy_rng"]
        for env, state in zip(train_envs.envs + eval_envs.envs, ckpt["env_rngs"]):
            env.unwrapped.np_random.bit_generator.state = state
        print(f"resumed {run_name} at epoch {start_epoch} ({start_epoch * steps_per_epoch:,} env steps)")

    def save_checkpoint(epoch):
        state = {"agent": AGENT, "args": asdict(args), "run_name": run_name, "epoch": epoch, "grad_steps": grad_steps,
                 "wall_time": wall_time + time.time() - segment_start, "log_alpha": log_alpha.detach().cpu(),
                 "buffer": rb.state_dict(), "torch_rng": torch.get_rng_state(), "numpy_rng": rng.bit_generator.state,
                 "eval_numpy_rng": eval_rng.bit_generator.state, "eval_torch_rng": eval_generator.get_state(),
                 "env_rngs": [e.unwrapped.np_random.bit_generator.state for e in train_envs.envs + eval_envs.envs],
                 **{name: module.state_dict() for name, module in modules.items()}}
        path = os.path.join(run_dir, "checkpoint.pt")
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # atomic: a crash mid-write leaves the previous checkpoint intact

    @torch.no_grad()
    def evaluate(epoch, epoch_stats):
        """48 deterministic rollouts with fresh skills → coverage, skill plot, E‖Δφ‖², one line of eval.jsonl."""
        skills = sample_skills(NUM_EVAL_SKILLS, d, eval_generator)
        obs, info = eval_envs.reset()
        coordinates, frames = [info["coordinates"]], []
        for _ in range(spec.horizon):
            if args.capture_video:
                frames.append(np.concatenate([eval_envs.envs[i].render() for i in range(NUM_VIDEO_SKILLS)], 1))
            action = actor.mode(torch.as_tensor(obs, device=device), skills.to(device))
            obs, _, _, _, info = eval_envs.step(action.cpu().numpy())
            coordinates.append(info["coordinates"])
        coordinates = np.stack(coordinates, 1)  # (48, horizon + 1, coord_dim): positions before each step + the last
        env_steps = epoch * steps_per_epoch
        result = {"epoch": epoch, "env_steps": env_steps, "grad_steps": grad_steps,
                  "wall_time": round(wall_time + time.time() - segment_start, 2), "coverage": envs.coverage(coordinates)}
        if rb.size > 0:  # E‖φ(s') - φ(s)‖² over replay transitions
            batch = rb.sample(min(NUM_DPHI_SAMPLES, rb.size), device, rng=eval_rng)
            result["dphi_sq"] = (phi(batch["next_obs"]) - phi(batch["obs"])).pow(2).sum(-1).mean().item()
        result.update(epoch_stats)
        result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        plot_skills(coordinates, skills.numpy(), os.path.join(run_dir, f"skills_{env_steps:010d}.png"),
                    f"CSF {args.env_id}, {env_steps:,} env steps, coverage {result['coverage']}")
        if frames:
            import imageio

            os.makedirs(os.path.join(run_dir, "videos"), exist_ok=True)
            imageio.mimsave(os.path.join(run_dir, "videos", f"skills_{env_steps:010d}.mp4"), frames, fps=20)
        for key in ("coverage", "dphi_sq"):
            if key in result:
                writer.add_scalar(f"eval/{key}", result[key], env_steps)
        with open(os.path.join(run_dir, "eval.jsonl"), "a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"eval  epoch {epoch} | env steps {env_steps:,} | coverage {result['coverage']} | "
              f"E|dphi|^2 {result.get('dphi_sq', float('nan')):.3g} | " + " | ".join(f"{k} {v:.4g}" for k, v in epoch_stats.items()))

    # ------------------------------------------------------------ one gradient step (spec §2.1, §7)
    def update(batch):
        obs, action, next_obs, skill = batch["obs"], batch["action"], batch["next_obs"], batch["skill"]

        # φ step. L(φ) = -E[(φ(s') - φ(s))ᵀz] + ξ E[log Σ_{z'} exp((φ(s') - φ(s))ᵀz')]   (paper Alg. 1, Eq. 8)
        negatives = sample_skills(args.num_negatives, d).to(device)  # z'_j ~ p(z), fresh each step, shared by the batch
        dphi = phi(next_obs) - phi(obs)
        positive = (dphi * skill).sum(-1)  # (φ(s') - φ(s))ᵀz
        logsumexp = torch.logsumexp(dphi @ negatives.T, dim=-1)  # log Σ_j exp((φ(s') - φ(s))ᵀz'_j), positive excluded
        phi_loss = -(positive - args.xi * logsumexp).mean()
        phi_optimizer.zero_grad()
        phi_loss.backward()
        phi_optimizer.step()

        # ψ step. ψ(s,a,z) ← φ(s') - φ(s) + γ ψ̄_k(s', a', z), a' ~ π(·|s', z), k = argmin_k ψ̄_k(s', a', z)ᵀz  (paper §5.2)
        with torch.no_grad():
            dphi = phi(next_obs) - phi(obs)  # the cumulant, from the φ just updated
            next_action, _ = actor.sample(next_obs, skill)
            next_psi = torch.stack([psi1_target(next_obs, skill, next_action), psi2_target(next_obs, skill, next_action)])
            smaller = (next_psi * skill).sum(-1).argmin(0)  # per sample: the target net with the smaller ψ̄ᵀz
            target = dphi + args.gamma * next_psi[smaller, torch.arange(len(skill))]  # its whole vector, no entropy term
        psi_loss = F.mse_loss(psi1(obs, skill, action), target) + F.mse_loss(psi2(obs, skill, action), target)
        psi_optimizer.zero_grad()
        psi_loss.backward()
        psi_optimizer.step()
        with torch.no_grad():
            for net, target_net in ((psi1, psi1_target), (psi2, psi2_target)):
                for p, p_target in zip(net.parameters(), target_net.parameters()):
                    p_target.lerp_(p, args.tau)  # ψ̄ ← (1 - τ) ψ̄ + τ ψ

        # π step. L(π) = E[α log π(a|s,z) - min_k ψ_k(s, a, z)ᵀz], a ~ π(·|s, z)   (paper Alg. 1 plus the SAC entropy)
        alpha = log_alpha.exp().detach()
        new_action, log_prob = actor.sample(obs, skill)
        q = torch.min((psi1(obs, skill, new_action) * skill).sum(-1), (psi2(obs, skill, new_action) * skill).sum(-1))
        actor_loss = (alpha * log_prob - q).mean()
        actor_optimizer.zero_grad()
        actor_loss.backward()
        actor_optimizer.step()

        # α step. L(α) = -E[log α (log π(a|s,z) + H̄)], H̄ = -|A|/2   (spec §1.7)
        alpha_loss = -(log_alpha * (log_prob.detach() + target_entropy)).mean()
        alpha_optimizer.zero_grad()
        alpha_loss.backward()
        alpha_optimizer.step()
        return torch.stack([phi_loss, psi_loss, actor_loss, alpha_loss, logsumexp.mean(), alpha]).detach()

    stat_names = ("phi_loss", "psi_loss", "actor_loss", "alpha_loss", "logsumexp", "alpha")

    # ------------------------------------------------------------ main loop
    segment_start = time.time()
    since_eval = {"stats": [], "train_time": 0.0, "grad_steps": 0, "start": time.time(), "env_steps": 0}
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
            since_eval = {"stats": [], "train_time": 0.0, "grad_steps": 0, "start": time.time(), "env_steps": 0}
        if epoch == num_epochs or (epoch % args.checkpoint_every == 0 and epoch != start_epoch):
            save_checkpoint(epoch)
        if epoch == num_epochs:
            break

        # collect one trajectory per env, one skill each, with the stochastic policy
        skills = sample_skills(args.num_envs, d).to(device)
        obs, _ = train_envs.reset()
        traj = {k: [] for k in ReplayBuffer.FIELDS}
        with torch.no_grad():
            for _ in range(spec.horizon):
                action, _ = actor.sample(torch.as_tensor(obs, device=device), skills)
                next_obs, _, terminated, _, _ = train_envs.step(action.cpu().numpy())
                assert not terminated.any(), "pretraining envs never terminate"
                for k, v in (("obs", obs), ("action", action.cpu().numpy()), ("next_obs", next_obs), ("skill", skills.cpu().numpy())):
                    traj[k].append(v)
                obs = next_obs  # after the last step this is the final observation; reset() starts the next epoch
        rb.add(**{k: np.stack(v, 1).reshape(-1, v[0].shape[-1]) for k, v in traj.items()})  # trajectory-major
        since_eval["env_steps"] += steps_per_epoch
        env_steps = (epoch + 1) * steps_per_epoch

        # train
        if rb.size >= args.learning_starts and args.grad_steps_per_epoch > 0:
            train_start = time.time()
            losses = torch.stack([update(rb.sample(args.batch_size, device)) for _ in range(args.grad_steps_per_epoch)])
            bad = ~torch.isfinite(losses[:, :4])
            if bad.any():
                step, which = bad.nonzero()[0].tolist()
                sys.exit(f"csf.py: error: {stat_names[which]} is {losses[step, which].item()} at gradient step "
                         f"{grad_steps + step + 1} (epoch {epoch}); the last good checkpoint is in {run_dir}")
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
    print(f"done: {run_dir}")


def load_checkpoint(args):
    """The checkpoint named by --resume, checked against this agent and the command line; one line on failure."""
    if not os.path.isfile(args.resume):
        sys.exit(f"csf.py: error: no checkpoint file at {args.resume}")
    try:
        ckpt = torch.load(args.resume, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        sys.exit(f"csf.py: error: {args.resume} is not a readable checkpoint ({type(e).__name__})")
    if not isinstance(ckpt, dict) or "agent" not in ckpt:
        sys.exit(f"csf.py: error: {args.resume} is not a cleanmisl checkpoint")
    if ckpt["agent"] != AGENT:
        sys.exit(f"csf.py: error: {args.resume} is a {ckpt['agent']} checkpoint, not a {AGENT} one")
    for flag in ("env_id", "skill_dim", "hidden_dim"):
        if ckpt["args"][flag] != getattr(args, flag):
            sys.exit(f"csf.py: error: {args.resume} was trained with --{flag.replace('_', '-')} "
                     f"{ckpt['args'][flag]}, not {getattr(args, flag)}")
    return ckpt


if __name__ == "__main__":
    main(fill_env_defaults(tyro.cli(Args)))
