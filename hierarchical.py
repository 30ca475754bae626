"""Hierarchical control over a pretrained agent's frozen skills, in one file: "Can a MISL Fly? Analysis and Ingredients
for Mutual Information Skill Learning" (Zheng, Tuyls, Peng and Eysenbach, ICLR 2025), §6.4 and App. B.5.

Every K = 25 env steps a high-level policy π_h(a | s) picks a skill z, which the pretrained agent's skill policy
π(· | s, z) (its script's own Actor, frozen) runs deterministically, tanh(mean), on the observation without the task's
goal dims. The high-level reward is R = Σ_{t<K} r_t; an episode is 8 high-level steps (200 env steps), the last one
terminal. As in the official garagei/envs/child_policy_env.py, z = a/‖a‖ (CSF, METRA, VISR), z = 1.5·a (CIC, DADS) or
z = onehot(a) (DIAYN, METRA on HalfCheetah: a categorical π_h). π_h maximizes E[Σ_k γ^k R_k] by
  SAC (AntMultiGoal, QuadrupedGoal, HumanoidGoal): twin Qs on y = R + γ(1 - done)(min_i Q̄_i(s', a') - α log π_h(a'|s'))
    without gradient, π_h on E[α log π_h(a|s) - min_i Q_i(s, a)], α towards the entropy -|A|/2 (one-hot: Q(s, ·)
    over the K skills, expectations under π_h(·|s), entropy +log K); or
  PPO (HalfCheetahGoal, HalfCheetahHurdle): -E[min(ρÂ, clip(ρ, 1 ± ε)Â)] - c E[H(π_h)], ρ = π_h(a|s)/π_old(a|s), Â by
    GAE(λ), V(s) regressed on the discounted returns.
Every default but the budget is the official value (App. B.5; scripts/hierarchical_control/*.sh). eval.jsonl has the
mean return of 48 deterministic episodes every 100 epochs (25 on pixels), and "Return (past 10)", the mean of the last
10 evaluations after epoch 0.

    python hierarchical.py --checkpoint runs/Ant__csf__1__1700000000 --task AntMultiGoal  # a run folder, or its .pt

Deliberate differences from the official code (github.com/Princeton-RL/contrastive-successor-features):
  - AntMultiGoal draws its whole goal chain every episode, not goals 2-4 once per env (envs.py explains).
  - "Return (past 10)" leaves out epoch 0; the official plot averages the current and the 10 previous evaluations.
  - a budget: 4M env steps for SAC, 12.8M for PPO, 10 evaluations after epoch 0; the official scripts set none.
  - the replay buffer holds whole episodes, each observation once; on a GPU, float32 matmuls use TF32.
"""

import contextlib
import functools
import hashlib
import importlib
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

AGENT = "hierarchical"
SKILL_STEPS, HIGH_HORIZON = 25, 8  # env steps per skill, skills per episode
CHILD_AGENTS = ("csf", "metra", "diayn", "visr", "cic", "dads")
# 2,500 SAC or 1,000 PPO epochs: at least 10 evaluations after epoch 0 at the official periods
ALGO_DEFAULTS = {"sac": {"num_envs": 8, "grad_steps_per_epoch": 50, "total_env_steps": 4_000_000},
                 "ppo": {"num_envs": 64, "grad_steps_per_epoch": 10, "total_env_steps": 12_800_000}}
PAST = 10  # evaluations in "Return (past 10)"


@dataclass
class Args:
    checkpoint: str = ""  # The child: a checkpoint.pt of an agent script, or its run folder (its newest checkpoint).
    # The downstream task: SAC learns AntMultiGoal, QuadrupedGoal and HumanoidGoal, PPO the HalfCheetah ones.
    task: Literal["AntMultiGoal", "HalfCheetahGoal", "HalfCheetahHurdle", "QuadrupedGoal", "HumanoidGoal"] = (
        "AntMultiGoal")
    seed: int = 1  # Seed of torch, numpy and the envs (on a CPU, the same seed gives the same run).
    total_env_steps: Optional[int] = None  # Training budget in env steps (unset: 4M for SAC, 12.8M for PPO).
    num_envs: Optional[int] = None  # High-level episodes (200 env steps) per epoch (unset: 8 for SAC, 64 for PPO).
    grad_steps_per_epoch: Optional[int] = None  # Gradient steps after each collection (unset: 50 SAC, 10 PPO).
    learning_starts: int = 10_000  # SAC: high-level transitions stored before the first gradient step.
    batch_size: int = 256  # High-level transitions per minibatch, drawn uniformly with replacement.
    buffer_size: Optional[int] = None  # SAC: replay capacity in high-level transitions (unset: 1M, 300k on pixels).
    hidden_dim: int = 1024  # Width of the two hidden layers of the high-level networks.
    eval_every: Optional[int] = None  # Epochs between evaluations, and the last one (unset: 100, 25 on pixels).
    checkpoint_every: Optional[int] = None  # Epochs between checkpoints, and the last one (unset: --eval-every).
    num_eval_episodes: int = 48  # Deterministic high-level episodes per evaluation (the paper's 48).
    resume: Optional[str] = None  # A hierarchical checkpoint.pt to continue, with its run's folder and flags.
    cuda: bool = True  # Use the GPU when torch sees one.
    parallel_envs: bool = True  # Step the envs in worker processes (the same numbers).
    compile: bool = False  # SAC: compile the whole gradient step with torch.compile.
    cudagraphs: bool = False  # SAC, on a GPU: replay the whole gradient step as one CUDA graph.
    track: bool = False  # Also log to Weights & Biases (WANDB_MODE=offline works).
    wandb_project_name: str = "cleanmisl"  # The W&B project, with --track.
    wandb_entity: Optional[str] = None  # The W&B team, with --track.
    gamma: float = 0.99  # Discount per high-level step.
    lr: float = 1e-4  # Adam learning rate of every high-level network, and of log α.
    tau: float = 0.005  # SAC: Polyak step of the target Qs.
    alpha_init: float = 0.1  # SAC: initial temperature α, tuned towards the entropy -|A|/2 (one-hot: +log K).
    clip: float = 0.2  # PPO: clip range ε of the probability ratio.
    gae_lambda: float = 0.95  # PPO: λ of the generalized advantage estimate.
    entropy_coef: float = 0.01  # PPO: weight c of the entropy bonus.


# Each numeric flag's valid values ("[" closed end, "(" open end); NaN is never inside.
FLAG_RANGES = {
    "seed": "[0, 2147483647]", "total_env_steps": "[1, inf)", "num_envs": "[1, inf)",
    "grad_steps_per_epoch": "[0, inf)", "learning_starts": "[0, inf)", "batch_size": "[1, inf)",
    "buffer_size": "[1, inf)", "hidden_dim": "[1, inf)", "eval_every": "[1, inf)", "checkpoint_every": "[1, inf)",
    "num_eval_episodes": "[1, inf)", "gamma": "[0, 1)", "lr": "(0, inf)", "tau": "(0, 1]", "alpha_init": "(0, inf)",
    "clip": "(0, inf)", "gae_lambda": "[0, 1]", "entropy_coef": "[0, inf)"}
# What --resume may change: neither the learning problem nor the random streams depend on them.
RESUME_MAY_CHANGE = ("total_env_steps", "eval_every", "checkpoint_every", "resume", "cuda", "parallel_envs", "track",
                     "wandb_project_name", "wandb_entity", "compile", "cudagraphs")


def critic_objective(qf, qf_target, policy, batch, alpha, gamma, discrete):
    """SAC's L(Q) = Σ_i ½ E[(Q_i(s, a) - y)²], y as in the header (official iod/sac.py); one-hot: Q(s, ·) over the
    skills, y's expectation under π_h(·|s'). Returns it and Q_1(s, a)."""
    obs, action, next_obs = batch["obs"], batch["action"], batch["next_obs"]
    with torch.no_grad():
        if discrete:
            next_dist = policy.dist(next_obs)
            next_q = torch.stack([net(next_obs) for net in qf_target]).amin(0)
            next_value = (next_dist.probs * (next_q - alpha * next_dist.logits.log_softmax(-1))).sum(-1)
        else:
            next_action, next_log_prob, _ = policy.sample(next_obs)
            next_value = torch.stack([net(next_obs, next_action) for net in qf_target]).amin(0) - alpha * next_log_prob
        target = batch["reward"] + gamma * (1 - batch["done"]) * next_value
    q = [net(obs).gather(-1, action[:, None]).squeeze(-1) if discrete else net(obs, action) for net in qf]
    return sum(0.5 * F.mse_loss(value, target) for value in q), q[0]


def actor_objective(policy, qf, obs, alpha, discrete):
    """SAC's L(π_h) = E[α log π_h(a|s) - min_i Q_i(s, a)], a ~ π_h(·|s) (one-hot: the expectation under π_h(·|s)).
    Returns it and log π_h (one-hot: -H(π_h(·|s)))."""
    if discrete:
        dist = policy.dist(obs)
        log_pi = dist.logits.log_softmax(-1)
        q = torch.stack([net(obs) for net in qf]).amin(0)
        return (dist.probs * (alpha * log_pi - q)).sum(-1).mean(), (dist.probs * log_pi).sum(-1)
    new_action, log_prob, _ = policy.sample(obs)
    q = torch.stack([net(obs, new_action) for net in qf]).amin(0)
    return (alpha * log_prob - q).mean(), log_prob


def temperature_loss(log_alpha, log_prob, target_entropy):
    """L(α) = -E[log α (log π_h(a|s) + H̄)]: α grows while the entropy is below H̄ (one-hot: +log K: α only grows)."""
    return -(log_alpha * (log_prob + target_entropy)).mean()


def gae(rewards, values, gamma, lam):
    """PPO's generalized advantages of (N, T) episodes ending at T (V = 0 after), and the discounted returns."""
    advantages, returns = torch.zeros_like(rewards), torch.zeros_like(rewards)
    next_advantage = next_return = next_value = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = next_advantage = delta + gamma * lam * next_advantage
        returns[:, t] = next_return = rewards[:, t] + gamma * next_return
        next_value = values[:, t]
    return advantages, returns


def ppo_policy_loss(log_prob, old_log_prob, advantages, entropy, clip, entropy_coef):
    """-E[min(ρ Â, clip(ρ, 1 ± ε) Â)] - c E[H], ρ = π(a|s)/π_old(a|s), Â standardized over the minibatch."""
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    ratio = (log_prob - old_log_prob).exp()
    surrogate = torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    return -(surrogate.mean() + entropy_coef * entropy.mean())


def skill_kind(child_ckpt):
    """How an action becomes a skill: "one-hot" (DIAYN, one-hot METRA), "scaled" (CIC, DADS) or "sphere"."""
    if child_ckpt["agent"] == "diayn" or child_ckpt["args"].get("discrete"):
        return "one-hot"
    return "scaled" if child_ckpt["agent"] in ("cic", "dads") else "sphere"


def action_to_skill(action, kind, skill_dim):
    """z = onehot(a) (a: the index), 1.5·a (priors that are not the sphere), or a/‖a‖."""
    if kind == "one-hot":
        return F.one_hot(action.long(), skill_dim).float()
    return 1.5 * action if kind == "scaled" else F.normalize(action, dim=-1)


def mlp(in_dim, hidden_dim, out_dim, activation, init):
    """Linear → act → Linear → act → Linear, zero biases (the official run/train.py's networks)."""
    net = nn.Sequential(nn.Linear(in_dim, hidden_dim), activation(), nn.Linear(hidden_dim, hidden_dim),
                        activation(), nn.Linear(hidden_dim, out_dim))
    for layer in net:
        if isinstance(layer, nn.Linear):
            init(layer.weight)
            nn.init.zeros_(layer.bias)
    return net


class GaussianPolicy(nn.Module):
    """π_h(a | s) over [-1, 1]^d: a tanh-squashed Gaussian on a tanh trunk, output layers initialised 10x smaller."""

    LOG_STD_MIN, LOG_STD_MAX = math.log(1e-6), 2.0

    def __init__(self, observation_space, action_dim, hidden_dim):
        super().__init__()
        self.encoder, features = envs.make_encoder(observation_space)
        self.trunk = mlp(features, hidden_dim, hidden_dim, nn.Tanh, nn.init.xavier_uniform_)[:-1]
        self.mean, self.log_std = nn.Linear(hidden_dim, action_dim), nn.Linear(hidden_dim, action_dim)
        for head in (self.mean, self.log_std):
            nn.init.xavier_normal_(head.weight)
            head.weight.data.mul_(0.1)
            nn.init.zeros_(head.bias)

    def dist(self, obs):  # the pre-tanh Gaussian
        h = self.trunk(self.encoder(obs))
        log_std = self.log_std(h).clamp(self.LOG_STD_MIN, self.LOG_STD_MAX)
        return torch.distributions.Normal(self.mean(h), log_std.exp(), validate_args=False)

    @staticmethod
    def squash(normal, u):  # a = tanh(u) and log π(a|s), with the tanh correction
        action = torch.tanh(u)
        return action, normal.log_prob(u).sum(-1) - torch.log((1 - action.pow(2)).clamp(0, 1) + 1e-6).sum(-1)

    def sample(self, obs):  # a reparameterized action, its log-probability, and the pre-tanh u (PPO re-evaluates it)
        normal = self.dist(obs)
        u = normal.rsample()
        return (*self.squash(normal, u), u)

    def mode(self, obs):
        return torch.tanh(self.dist(obs).mean)


class CategoricalPolicy(nn.Module):
    """π_h(k | s) over the K one-hot skills: logits on a tanh trunk; sample() gives (k, log π_h(k|s), k)."""

    def __init__(self, observation_space, num_skills, hidden_dim):
        super().__init__()
        self.encoder, features = envs.make_encoder(observation_space)
        self.net = mlp(features, hidden_dim, num_skills, nn.Tanh, nn.init.xavier_uniform_)

    def dist(self, obs):
        return torch.distributions.Categorical(logits=self.net(self.encoder(obs)), validate_args=False)

    def sample(self, obs):
        dist = self.dist(obs)
        k = dist.sample()
        return k, dist.log_prob(k), k

    def mode(self, obs):
        return self.dist(obs).probs.argmax(-1)


class QNetwork(nn.Module):
    """Q(s, a) ∈ R (input s ⊕ a), or Q(s, ·) ∈ R^K for one-hot skills, or PPO's V(s) (action_dim 0); ReLU."""

    def __init__(self, observation_space, action_dim, hidden_dim, num_actions=1):
        super().__init__()
        self.encoder, features = envs.make_encoder(observation_space)
        self.net = mlp(features + action_dim, hidden_dim, num_actions, nn.ReLU, nn.init.xavier_normal_)

    def forward(self, obs, action=None):
        features = self.encoder(obs)
        out = self.net(features if action is None else torch.cat([features, action], -1))
        return out.squeeze(-1) if out.shape[-1] == 1 else out


def optimize(optimizer, loss):
    """One gradient step of `optimizer` on `loss`."""
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


@contextlib.contextmanager
def frozen(modules):
    """No gradient into these modules' weights in the block; one still flows through them to their inputs."""
    for module in modules:
        module.requires_grad_(False)
    try:
        yield
    finally:
        for module in modules:
            module.requires_grad_(True)


def as_tensor(array, device):
    """An array (or a dict of them) as tensors on `device`; to a GPU pinned, without waiting."""
    if isinstance(array, dict):
        return {key: as_tensor(value, device) for key, value in array.items()}
    tensor = torch.as_tensor(array)
    return tensor.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else tensor


class EpisodeBuffer:
    """A ring of whole high-level episodes, each observation once (a dict: {"obs"}, or pixels + goal); transitions
    (s, a, R, s', done) are drawn uniformly with replacement, done at an episode's last step."""

    def __init__(self, capacity, observation_space, action_shape, action_dtype, rng):
        self.dict_obs, self.rng, self.pos, self.num_stored = isinstance(observation_space, gym.spaces.Dict), rng, 0, 0
        spaces = observation_space.spaces if self.dict_obs else {"obs": observation_space}
        n = max(capacity // HIGH_HORIZON, 1)
        self.obs = {key: np.zeros((n, HIGH_HORIZON + 1, *space.shape), space.dtype) for key, space in spaces.items()}
        self.actions = np.zeros((n, HIGH_HORIZON, *action_shape), action_dtype)
        self.rewards = np.zeros((n, HIGH_HORIZON), np.float32)

    def add(self, observations, actions, rewards):  # {key: (E, T + 1, ...)}, (E, T, ...), (E, T)
        idx = (self.pos + np.arange(len(rewards))) % len(self.rewards)
        for key, value in observations.items():
            self.obs[key][idx] = value
        self.actions[idx], self.rewards[idx] = actions, rewards
        self.pos = (self.pos + len(rewards)) % len(self.rewards)
        self.num_stored = min(self.num_stored + len(rewards), len(self.rewards))

    def sample(self, batch_size, device):
        i = self.rng.integers(0, self.num_stored * HIGH_HORIZON, batch_size)
        episode, t = i // HIGH_HORIZON, i % HIGH_HORIZON
        obs, next_obs = ({k: v[episode, step] for k, v in self.obs.items()} for step in (t, t + 1))
        return as_tensor({"obs": obs if self.dict_obs else obs["obs"], "action": self.actions[episode, t],
                          "next_obs": next_obs if self.dict_obs else next_obs["obs"],
                          "reward": self.rewards[episode, t], "done": (t == HIGH_HORIZON - 1).astype(np.float32)},
                         device)

    def state_dict(self):  # tensors over the stored part: torch.save writes them as they are, no pickled copies
        n = self.num_stored
        return {"pos": self.pos, "num_stored": n, "obs": {k: torch.from_numpy(v[:n]) for k, v in self.obs.items()},
                "actions": torch.from_numpy(self.actions[:n]), "rewards": torch.from_numpy(self.rewards[:n])}

    def load_state_dict(self, state):
        self.pos, self.num_stored, n = state["pos"], state["num_stored"], state["num_stored"]
        for key, value in state["obs"].items():
            self.obs[key][:n] = value
        self.actions[:n], self.rewards[:n] = state["actions"], state["rewards"]


@torch.no_grad()
def run_episodes(vec_env, policy, child, kind, skill_dim, extra_dims, device, deterministic=False):
    """One high-level episode per env, π_h's skill (sampled, or its mode) run by the child 25 steps at a time;
    returns the observations, actions, log π_h, pre-tanh actions (one-hot: indices), rewards, coordinates and goals."""
    obs, info = vec_env.reset()
    observations, steps, coordinates, goals = [obs], [], [info["coordinates"]], [info.get("goal")]
    for step in range(HIGH_HORIZON):
        if deterministic:  # the mode, in sample's (action, log π, raw) form
            action = policy.mode(as_tensor(obs, device))
            log_prob, raw = torch.zeros(len(action)), action
        else:
            action, log_prob, raw = policy.sample(as_tensor(obs, device))
        skill, reward = action_to_skill(action, kind, skill_dim), np.zeros(vec_env.num_envs)
        for t in range(SKILL_STEPS):  # the child sees the observation without the task's dims (on pixels, the frames)
            child_obs = as_tensor(obs["pixels"] if isinstance(obs, dict) else obs[..., :-extra_dims], device)
            low_action = child.mode(child_obs, skill).cpu().numpy()
            if not np.isfinite(low_action).all():  # the envs refuse NaN and inf
                error("the child's action is not finite: the high-level policy's networks diverged")
            obs, r, terminated, truncated, info = vec_env.step(low_action)
            last = step == HIGH_HORIZON - 1 and t == SKILL_STEPS - 1  # the task's time limit
            assert not terminated.any() and (truncated == last).all(), (step, t, terminated, truncated)
            reward += r
            coordinates.append(info["coordinates"])
            goals.append(info.get("goal"))
        observations.append(obs)
        steps.append((action.cpu().numpy(), log_prob.cpu().numpy(), raw.cpu().numpy(), reward))
    action, log_prob, raw, reward = (np.stack(values, 1) for values in zip(*steps))
    return {"obs": {k: np.stack([o[k] for o in observations], 1) for k in obs} if isinstance(obs, dict) else {
            "obs": np.stack(observations, 1)}, "action": action, "log_prob": log_prob, "raw": raw,
            "reward": reward.astype(np.float32), "coordinates": np.stack(coordinates, 1),
            "goals": None if goals[0] is None else np.stack(goals, 1)}


def main(args, child_ckpt, ckpt=None):
    """Epoch by epoch: evaluate, collect `num_envs` high-level episodes over the frozen child, learn (`sac_update` on
    replay minibatches, or `ppo_update`); around it, the checkpoints, logs and NaN stop."""
    task = envs.TASKS[args.task]
    steps_per_epoch = args.num_envs * SKILL_STEPS * HIGH_HORIZON  # env steps
    num_epochs = args.total_env_steps // steps_per_epoch
    run_name, run_dir, checkpoint_path, writer = start_run(args, child_ckpt, ckpt)  # folder, Ctrl-C, W&B, TensorBoard
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)  # replay and minibatch sampling
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on the GPUs that have them
    try:  # episodes of 200 env steps, never reset on their own; a world that cannot render, or too many envs: one line
        train_envs, eval_envs = envs.make_envs(functools.partial(envs.make_task, args.task), args.num_envs,
                                               args.num_eval_episodes, args.seed, 0, args.parallel_envs)
    except (envs.RenderUnavailable, MemoryError) as e:
        error(e)
    observation_space = train_envs.single_observation_space  # state (or pixels) + the task's dims
    pixels = isinstance(observation_space, gym.spaces.Dict)
    child = frozen_child(args.checkpoint, child_ckpt, observation_space, task.extra_dims,
                         train_envs.single_action_space.shape[0], device)  # the agent script's own Actor
    kind, skill_dim = skill_kind(child_ckpt), child_ckpt["args"]["skill_dim"]
    discrete = kind == "one-hot"  # a categorical π_h over the K skills
    check_memory(args, observation_space, skill_dim, task.algo == "sac", device)

    policy = (CategoricalPolicy if discrete else GaussianPolicy)(observation_space, skill_dim, args.hidden_dim)
    policy = policy.to(device)
    adam = adam_options(args, task.algo, device)  # torch's default Adam, but see --compile and --cudagraphs
    policy_optimizer = torch.optim.Adam(policy.parameters(), **adam)
    modules = {"policy": policy, "policy_optimizer": policy_optimizer}  # the checkpoint's keys, and SAC's below
    if task.algo == "sac":
        q_args = (observation_space, 0, args.hidden_dim, skill_dim) if discrete else (
            observation_space, skill_dim, args.hidden_dim)
        qf = [QNetwork(*q_args).to(device) for _ in range(2)]  # twin critics
        qf_target = [QNetwork(*q_args).to(device) for _ in qf]
        for net, target in zip(qf, qf_target):
            target.load_state_dict(net.state_dict())
        qf_params, qf_target_params = ([p for net in nets for p in net.parameters()] for nets in (qf, qf_target))
        qf_optimizer = torch.optim.Adam(qf_params, **adam)  # one optimizer for the twins, on the sum of losses
        log_alpha = torch.tensor(math.log(args.alpha_init), device=device, requires_grad=True)
        alpha_optimizer = torch.optim.Adam([log_alpha], **adam)
        target_entropy = math.log(skill_dim) if discrete else -skill_dim / 2  # the official targets
        rb = EpisodeBuffer(args.buffer_size, observation_space, () if discrete else (skill_dim,),
                           np.int64 if discrete else np.float32, rng)
        modules |= {"qf1": qf[0], "qf2": qf[1], "qf1_target": qf_target[0], "qf2_target": qf_target[1], "buffer": rb,
                    "qf_optimizer": qf_optimizer, "alpha_optimizer": alpha_optimizer, "log_alpha": log_alpha}
    else:
        value = QNetwork(observation_space, 0, args.hidden_dim).to(device)  # V(s)
        value_optimizer = torch.optim.Adam(value.parameters(), **adam)
        modules |= {"value": value, "value_optimizer": value_optimizer}
    streams = {"rng": rng, "envs": (train_envs, eval_envs)}
    start_epoch, grad_steps, wall_time, since_eval, eval_returns = 0, 0, 0.0, new_window(), []
    if ckpt:
        start_epoch, grad_steps, wall_time, since_eval, eval_returns = restore_checkpoint(ckpt, args, run_dir, modules,
                                                                                          streams, device)

    def sac_update(batch):
        """The twin Qs on their soft TD target, π_h on min_i Q_i + α H(π_h), α towards H̄, the Polyak step of the
        target Qs (official iod/sac.py). Returns the step's stats by name, on the device."""
        alpha = log_alpha.exp().detach()
        qf_loss, q = critic_objective(qf, qf_target, policy, batch, alpha, args.gamma, discrete)
        optimize(qf_optimizer, qf_loss)
        with frozen(qf):  # the gradient flows through Q to the action, not into Q
            actor_loss, log_prob = actor_objective(policy, qf, batch["obs"], alpha, discrete)
            optimize(policy_optimizer, actor_loss)
        alpha_loss = temperature_loss(log_alpha, log_prob.detach(), target_entropy)
        optimize(alpha_optimizer, alpha_loss)
        with torch.no_grad():  # Q̄ ← (1 - τ) Q̄ + τ Q, every tensor in one call
            torch._foreach_lerp_(qf_target_params, qf_params, args.tau)
        return {"qf_loss": qf_loss.detach(), "actor_loss": actor_loss.detach(), "alpha_loss": alpha_loss.detach(),
                "alpha": alpha, "q": q.mean().detach()}
    sac_update = fast_path(sac_update, args, task.algo, device)  # --compile, --cudagraphs; without them, itself

    def ppo_update(episodes):
        """GAE advantages and returns of the epoch's episodes; per minibatch a π_h step on the clipped surrogate (π_h
        re-evaluated at the stored index or pre-tanh action) and a V step (official iod/ppo.py). Returns the stats."""
        states = as_tensor({k: v[:, :-1].reshape(-1, *v.shape[2:]) for k, v in episodes["obs"].items()}, device)
        states = states if pixels else states["obs"]  # the E × T states π_h acted in, flattened
        with torch.no_grad():
            values = value(states).reshape(len(episodes["reward"]), HIGH_HORIZON)
        advantages, returns = gae(as_tensor(episodes["reward"], device), values, args.gamma, args.gae_lambda)
        raws = as_tensor(episodes["raw"], device).flatten(0, 1)  # skill indices, or pre-tanh actions
        old_log_probs = as_tensor(episodes["log_prob"], device).reshape(-1)
        advantages, returns, step_stats = advantages.reshape(-1), returns.reshape(-1), []
        for _ in range(args.grad_steps_per_epoch):
            i = as_tensor(rng.integers(0, len(returns), args.batch_size), device)
            obs = {k: v[i] for k, v in states.items()} if pixels else states[i]
            dist = policy.dist(obs)  # the tanh correction cancels in ρ; the bonus is the pre-tanh Gaussian's entropy
            log_prob, entropy = (dist.log_prob(raws[i]), dist.entropy()) if discrete else (
                GaussianPolicy.squash(dist, raws[i])[1], dist.entropy().sum(-1))
            policy_loss = ppo_policy_loss(log_prob, old_log_probs[i], advantages[i], entropy, args.clip,
                                          args.entropy_coef)
            optimize(policy_optimizer, policy_loss)
            value_loss = F.mse_loss(value(obs), returns[i])
            optimize(value_optimizer, value_loss)
            step_stats.append({"policy_loss": policy_loss.detach(), "value_loss": value_loss.detach(),
                               "entropy": entropy.mean().detach()})
        return step_stats

    segment_start = time.time()
    for epoch in range(start_epoch, num_epochs + 1):
        # evaluate and checkpoint what the previous `epoch` epochs produced
        if (epoch % args.eval_every == 0 or epoch == num_epochs) and not (ckpt and epoch == start_epoch):
            evaluate(epoch, grad_steps, wall_time + time.time() - segment_start, since_eval, eval_returns, args,
                     child_ckpt, lambda: run_episodes(eval_envs, policy, child, kind, skill_dim, task.extra_dims,
                                                      device, deterministic=True), run_dir, writer)
            since_eval = new_window()
        if epoch == num_epochs or (epoch % args.checkpoint_every == 0 and epoch != start_epoch):
            save_checkpoint(checkpoint_path, args, run_name, child_ckpt, epoch, grad_steps, wall_time + time.time()
                            - segment_start, eval_returns, since_eval, modules, streams, device)
        if epoch == num_epochs:
            break
        # collect one episode per env with the stochastic π_h; learn: PPO from them, SAC from replay minibatches
        episodes = run_episodes(train_envs, policy, child, kind, skill_dim, task.extra_dims, device)
        since_eval["env_steps"] += steps_per_epoch
        train_start, step_stats = time.time(), []
        if task.algo == "ppo":
            step_stats = ppo_update(episodes)
        else:
            rb.add(episodes["obs"], episodes["action"], episodes["reward"])
            if rb.num_stored * HIGH_HORIZON >= args.learning_starts and args.grad_steps_per_epoch > 0:
                step_stats = [sac_update(rb.sample(args.batch_size, device)) for _ in range(args.grad_steps_per_epoch)]
        grad_steps += len(step_stats)
        log_epoch(args, writer, epoch, grad_steps, step_stats, time.time() - train_start, since_eval,
                  (epoch + 1 - start_epoch) * steps_per_epoch / (time.time() - segment_start),
                  float(episodes["reward"].sum(1).mean()), checkpoint_path)  # one line at a NaN or inf loss

    for opened in (train_envs, eval_envs, writer):
        opened.close()
    if args.track:
        import wandb
        wandb.finish()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as before the run
    print(f"done: {run_dir}")


# ABLATIONS: none (hierarchical control has no ablation flags)
# INFRASTRUCTURE: the command line, the child, start-up, the fast path, checkpoints, evaluation, logging
def parse_args(argv=None):
    """The flags (unset: the task's; --resume: the run's own), the child's checkpoint, the run's; one line if bad."""
    args, ckpt = tyro.cli(Args, args=argv), None
    if args.resume:
        ckpt = load_file(args.resume)[1]
        if ckpt["agent"] != AGENT:
            error(f"{args.resume} is a {ckpt['agent']} checkpoint, not a {AGENT} one")
        if set(ckpt["args"]) - {field.name for field in fields(Args)}:
            error(f"{args.resume} was written by another version of {AGENT}.py")
        args = tyro.cli(Args, args=argv, default=Args(**ckpt["args"]))
        for flag, trained in ckpt["args"].items():
            if flag not in RESUME_MAY_CHANGE and getattr(args, flag) != trained:
                error(f"{args.resume} was trained with --{flag.replace('_', '-')} {trained}, not {getattr(args, flag)}")
    task = envs.TASKS[args.task]
    sac = task.algo == "sac"
    for flag, value in {"buffer_size": task.buffer_size, "eval_every": task.eval_every, **ALGO_DEFAULTS[task.algo],
                        "checkpoint_every": args.eval_every or task.eval_every}.items():
        setattr(args, flag, value if getattr(args, flag) is None else getattr(args, flag))
    for flag, interval in FLAG_RANGES.items():  # PPO keeps no replay buffer
        low, high, value = *(float(end) for end in interval[1:-1].split(",")), getattr(args, flag)
        if (sac or flag != "buffer_size") and not ((low <= value if interval[0] == "[" else low < value) and (
                value <= high if interval[-1] == "]" else value < high)):  # both False for NaN
            error(f"--{flag.replace('_', '-')} must be in {interval}, got {value}")
    epoch = args.num_envs * SKILL_STEPS * HIGH_HORIZON  # env steps
    transitions = args.total_env_steps // epoch * args.num_envs * HIGH_HORIZON  # the run's high-level transitions
    if args.total_env_steps < epoch:
        error(f"--total-env-steps must cover one epoch ({epoch} env steps), got {args.total_env_steps}")
    if sac and args.buffer_size < args.num_envs * HIGH_HORIZON:
        error(f"--buffer-size must hold one epoch ({args.num_envs * HIGH_HORIZON} transitions), got {args.buffer_size}")
    if sac and args.grad_steps_per_epoch and args.learning_starts > min(transitions, args.buffer_size):
        error(f"--learning-starts must be at most --buffer-size and the run's {transitions} high-level transitions, or "
              f"the run never learns; got {args.learning_starts}")
    if ckpt and args.total_env_steps // epoch <= ckpt["epoch"]:
        error(f"{args.resume} has already trained for {ckpt['epoch'] * epoch} env steps; give a larger "
              "--total-env-steps to continue it")
    args.checkpoint, child = load_file(args.checkpoint, args.task)
    if ckpt and ckpt.get("child_actor_sha256", child["actor_sha256"]) != child["actor_sha256"]:
        error(f"{args.checkpoint} is not the child {args.resume} was trained over: its actor's weights changed "
              "(another checkpoint, or its run went on); give that run's checkpoint as it was")
    return args, child, ckpt


def load_file(path, task=None):
    """(path, checkpoint) of a cleanmisl checkpoint, or with `task` of a child for it (`path` may be its run folder:
    its newest .pt), checked, with its actor's SHA-256. One line on failure."""
    if task and os.path.isdir(path):
        candidates = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".pt")]
        if not candidates:
            error(f"the run folder {path} holds no checkpoint")
        path = max(candidates, key=os.path.getmtime)
    if not os.path.isfile(path):
        error(f"no checkpoint file at {path}" if path else "give the child's --checkpoint (an agent's checkpoint.pt)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001
        error(f"{path} is not a readable checkpoint ({type(e).__name__})")
    if not isinstance(ckpt, dict) or "agent" not in ckpt or not isinstance(ckpt.get("args"), dict):
        error(f"{path} is not a cleanmisl checkpoint")
    if task is None:
        return path, ckpt
    if ckpt["agent"] not in CHILD_AGENTS:
        error(f"{path} is a {ckpt['agent']} checkpoint, not one of a skill-discovery agent ({', '.join(CHILD_AGENTS)})")
    missing = [k for k in ("env_id", "skill_dim", "hidden_dim") if k not in ckpt["args"]]
    if missing or not isinstance(ckpt.get("actor"), dict):
        error(f"{path} lacks {', '.join(missing) or 'actor'}: it was not written by this version of {ckpt['agent']}.py")
    if ckpt["args"]["env_id"] != envs.TASKS[task].base:
        error(f"{path} holds skills learned on {ckpt['args']['env_id']}; {task} needs skills learned on "
              f"{envs.TASKS[task].base}")
    for key, value in ckpt["actor"].items():
        if torch.is_tensor(value) and value.is_floating_point() and not torch.isfinite(value).all():
            error(f"{path} holds NaN or infinite weights (actor.{key}): its run diverged")
    ckpt["actor_sha256"] = hashlib.sha256(b"".join(key.encode() + value.detach().cpu().contiguous().numpy().tobytes()
                                                   for key, value in sorted(ckpt["actor"].items()))).hexdigest()
    return path, ckpt


def frozen_child(path, child_ckpt, observation_space, extra_dims, action_dim, device):
    """The child's π(· | s, z): its script's own Actor with the checkpoint's weights, frozen (one line if unfit)."""
    child_agent, child_args = importlib.import_module(child_ckpt["agent"]), child_ckpt["args"]
    child_space = observation_space["pixels"] if isinstance(observation_space, gym.spaces.Dict) else gym.spaces.Box(
        -np.inf, np.inf, (observation_space.shape[0] - extra_dims,), np.float32)
    child = child_agent.Actor(child_space, action_dim, child_args["skill_dim"], child_args["hidden_dim"]).to(device)
    try:
        child.load_state_dict(child_ckpt["actor"])
    except RuntimeError as e:  # other shapes or names; torch's last line names a tensor and its shapes
        error(f"{path}'s actor does not fit {child_ckpt['agent']}.py's network ({str(e).splitlines()[-1].strip()})")
    return child.requires_grad_(False).eval()


def start_run(args, child_ckpt, ckpt):
    """The run's name, folder (a resumed run's is its checkpoint's), checkpoint path and writer; Ctrl-C, W&B, and a
    line with the flags resolved from the task."""
    agent = f"{AGENT}_{child_ckpt['agent']}"
    run_name = ckpt["run_name"] if ckpt else f"{args.task}__{agent}__{args.seed}__{int(time.time())}"
    run_dir = os.path.dirname(os.path.abspath(args.resume)) if ckpt else os.path.join("runs", run_name)
    os.makedirs(run_dir, exist_ok=True)
    checkpoint_path = os.path.join(run_dir, "checkpoint.pt")
    signal.signal(signal.SIGINT, lambda *_: error(f"interrupted; {resume_hint(checkpoint_path)}"))
    if args.track:
        import wandb
        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, save_code=True, resume="allow", id=run_name.replace("/", "_"))
    # TensorBoard's thread stays quiet on a failed write, which its next add_scalar raises
    threading.excepthook = lambda hook: None if issubclass(hook.exc_type, OSError) else threading.__excepthook__(hook)
    writer = SummaryWriter(run_dir)
    writer.add_text("hyperparameters",
                    "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    algo = envs.TASKS[args.task].algo
    shown = ("buffer_size",) * (algo == "sac") + ("eval_every", *ALGO_DEFAULTS[algo], "checkpoint_every")
    print(f"{args.task} over {child_ckpt['agent']} skills ({algo.upper()}, {HIGH_HORIZON} × {SKILL_STEPS} steps): "
          + ", ".join(f"--{flag.replace('_', '-')} {getattr(args, flag)}" for flag in shown)
          + (" (the run's own)" if ckpt else " (a flag not given takes the task's value)"), flush=True)
    return run_name, run_dir, checkpoint_path, writer


def check_memory(args, observation_space, skill_dim, sac, device):
    """Refuse, before allocating, a run that cannot fit in the free memory, naming lower bounds of its parts' needs."""
    spaces = observation_space.spaces.values() if isinstance(observation_space, gym.spaces.Dict) else [
        observation_space]
    obs_size = sum(math.prod(space.shape) for space in spaces)
    obs_bytes = sum(math.prod(space.shape) * space.dtype.itemsize for space in spaces)
    episodes = max(args.buffer_size // HIGH_HORIZON, 1) if sac else 0  # PPO keeps none
    episode_bytes = (HIGH_HORIZON + 1) * obs_bytes + HIGH_HORIZON * (8 + 4 * skill_dim)
    host = {"the episode buffer (--buffer-size)": episodes * episode_bytes}
    on_device = {"the networks (--hidden-dim)": 4 * args.hidden_dim**2 * (3 * 4 + 2 if sac else 2 * 4),
                 "one batch (--batch-size)": 4 * args.batch_size * (2 * obs_size + 8 * args.hidden_dim)}
    places = {"GPU": on_device, "host": host} if device.type == "cuda" else {"host": host | on_device}
    for place, parts in places.items():
        free = torch.cuda.mem_get_info(device)[0] if place == "GPU" else envs.free_host_memory()
        if sum(parts.values()) > free:
            error(f"this run needs at least {sum(parts.values()) / 2**30:,.1f} GiB of {place} memory: " + ", ".join(
                f"{name} {size / 2**30:,.1f}" for name, size in parts.items()) + f"; {free / 2**30:,.1f} GiB is free")


def adam_options(args, algo, device):
    """torch's default Adam; for SAC, foreach under --compile, fused under --cudagraphs alone, capturable in a graph."""
    graphs, fused = algo == "sac" and args.cudagraphs, algo == "sac" and args.cudagraphs and not args.compile
    return {"lr": args.lr, "fused": fused or None, "foreach": True if algo == "sac" and args.compile else None,
            "capturable": graphs and device.type == "cuda"}


def fast_path(update, args, algo, device):
    """SAC's step compiled as one function (--compile; on a CPU with eager's random draws), on a GPU one CUDA graph."""
    if algo != "sac":
        if args.compile or args.cudagraphs:
            print("--compile and --cudagraphs apply to SAC's gradient step; this PPO task runs without them",
                  flush=True)
        return update
    if args.compile:
        torch._inductor.config.fallback_random = device.type == "cpu"
        update = torch.compile(update)
    if args.cudagraphs and device.type != "cuda":
        print("--cudagraphs: CUDA graphs need a GPU; on the CPU the gradient step runs without them", flush=True)
    return CudaGraphStep(update) if args.cudagraphs and device.type == "cuda" else update


class CudaGraphStep:
    """`step(batch) -> stats` as one CUDA graph: WARMUP real steps on a side stream, then one captured on a static
    batch (dicts of tensors), which each later call refills and replays."""

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
            self.batch, self.graph = clone(batch), torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.stats = self.step(self.batch)
        copy_into(self.batch, batch)
        self.graph.replay()
        return clone(self.stats)


def clone(tensors):
    """A copy of a dict of tensors (or of dicts of tensors)."""
    return {key: clone(value) if isinstance(value, dict) else value.clone() for key, value in tensors.items()}


def copy_into(static, tensors):
    """Copy a dict of tensors (or of dicts of them) into `static`'s tensors."""
    for key, value in tensors.items():
        copy_into(static[key], value) if isinstance(value, dict) else static[key].copy_(value)


def save_checkpoint(path, args, run_name, child_ckpt, epoch, grad_steps, wall_time, eval_returns, since_eval, modules,
                    streams, device):
    """All a resumed run needs to go on as this one would, atomically; a NaN or inf in a network or optimizer ends
    the run instead."""
    def non_finite(state, prefix=""):  # the float tensors with NaN or inf, by name
        if torch.is_tensor(state):
            return [prefix] if state.is_floating_point() and not torch.isfinite(state).all() else []
        items = (state.items() if isinstance(state, dict) else
                 enumerate(state) if isinstance(state, (list, tuple)) else [])
        return [name for key, value in items for name in non_finite(value, f"{prefix}.{key}".lstrip("."))]

    state = {name: module.detach().cpu() if torch.is_tensor(module) else module.state_dict()
             for name, module in modules.items()}
    diverged = non_finite({name: value for name, value in state.items() if name != "buffer"})
    if diverged:  # e.g. Adam's moments overflowed while every loss stayed finite
        error(f"{diverged[0]} holds NaN or inf at epoch {epoch} ({len(diverged)} tensors do): the run diverged; "
              f"{resume_hint(path)}")
    state |= {"agent": AGENT, "args": asdict(args), "child_agent": child_ckpt["agent"],
              "child_actor_sha256": child_ckpt["actor_sha256"], "run_name": run_name, "epoch": epoch,
              "grad_steps": grad_steps, "wall_time": wall_time, "eval_returns": eval_returns,
              "torch_rng": torch.get_rng_state(), "numpy_rng": streams["rng"].bit_generator.state,
              "cuda_rng": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
              "env_rngs": [rng for vector_env in streams["envs"] for rng in envs.env_rng_states(vector_env)],
              "since_eval": {**since_eval, "start": time.time() - since_eval["start"]}}
    write_atomically(path, lambda temporary: torch.save(state, temporary), resume_hint(path))


def restore_checkpoint(ckpt, args, run_dir, modules, streams, device):
    """A checkpoint's state back (with this run's Adam options), eval.jsonl's later evaluations dropped (to be redone):
    (epoch, gradient steps, wall time, the stats window, the evaluations' returns)."""
    adam = adam_options(args, envs.TASKS[args.task].algo, device)
    try:
        for name, module in modules.items():
            if torch.is_tensor(module):
                with torch.no_grad():
                    module.copy_(ckpt[name])
                continue
            module.load_state_dict(ckpt[name])
            for group in getattr(module, "param_groups", []):  # an optimizer: this run's options, its step counts
                group.update({key: value for key, value in adam.items() if key != "lr"})
                for param in group["params"]:  # where fused or capturable Adam keep them
                    if "step" in module.state.get(param, {}):
                        place = param.device if group["fused"] or group["capturable"] else "cpu"
                        module.state[param]["step"] = module.state[param]["step"].to(place, torch.float32)
        torch.set_rng_state(ckpt["torch_rng"])
        if device.type == "cuda" and ckpt["cuda_rng"] is not None:
            restore_cuda_rng(ckpt["cuda_rng"])
        streams["rng"].bit_generator.state = ckpt["numpy_rng"]
        train_envs, eval_envs = streams["envs"]  # the training envs' states, then the evaluation envs'
        envs.set_env_rng_states(train_envs, ckpt["env_rngs"][:train_envs.num_envs])
        envs.set_env_rng_states(eval_envs, ckpt["env_rngs"][train_envs.num_envs:])
        window = ckpt["since_eval"]  # its start was saved as seconds before the checkpoint
        since_eval = {**window, "stats": [{name: value.to(device) for name, value in means.items()}
                                          for means in window["stats"]], "start": time.time() - window["start"]}
    except (KeyError, RuntimeError, ValueError, AttributeError) as e:
        error(f"{args.resume} was written by another version of {AGENT}.py ({' '.join(str(e).split())[:160]})")
    log_path, kept = os.path.join(run_dir, "eval.jsonl"), []
    if os.path.isfile(log_path):
        lines = [line for line in pathlib.Path(log_path).read_text().splitlines() if line.strip()]
        for number, line in enumerate(lines, 1):
            try:
                kept += [line + "\n"] if json.loads(line)["epoch"] <= ckpt["epoch"] else []
            except (ValueError, KeyError, TypeError):  # a torn last line (a crash mid-write): dropped, with a warning
                if number < len(lines):
                    error(f"line {number} of {log_path} is not an evaluation; mend or delete it, then resume")
                print(f"warning: dropped the torn last line of {log_path}", file=sys.stderr)
        write_atomically(log_path, lambda tmp: pathlib.Path(tmp).write_text("".join(kept)),
                         resume_hint(os.path.join(run_dir, "checkpoint.pt")))
    env_steps = ckpt["epoch"] * args.num_envs * SKILL_STEPS * HIGH_HORIZON
    print(f"resumed {ckpt['run_name']} at epoch {ckpt['epoch']} ({env_steps:,} env steps)")
    return ckpt["epoch"], ckpt["grad_steps"], ckpt["wall_time"], since_eval, ckpt["eval_returns"]


def restore_cuda_rng(states):
    """The CUDA RNG states of the GPUs this machine has (a run may resume where fewer are visible)."""
    for index, state in enumerate(states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(state, index)


def evaluate(epoch, grad_steps, wall_time, window, eval_returns, args, child_ckpt, collect, run_dir, writer):
    """The deterministic episodes of `collect()` → their mean return, "past 10" (the last 10 after epoch 0), a plot
    (goals as stars), a line of eval.jsonl with the window's speeds and stat means."""
    stats = {}
    if window["stats"]:
        per_epoch = torch.stack([torch.stack(list(means.values())) for means in window["stats"]])
        stats = dict(zip(window["stats"][0], per_epoch.mean(0).tolist()))
    stats |= {"sps": window["env_steps"] / (time.time() - window["start"])} if window["env_steps"] else {}
    stats |= {"ms_per_grad_step": 1000 * window["train_time"] / window["grad_steps"]} if window["grad_steps"] else {}
    episodes = collect()
    returns, paths, goals = episodes["reward"].sum(1), episodes["coordinates"], episodes["goals"]
    eval_returns.append(float(returns.mean()))
    env_steps, trained = epoch * args.num_envs * SKILL_STEPS * HIGH_HORIZON, eval_returns[1:]  # without epoch 0's
    result = {"epoch": epoch, "env_steps": env_steps, "grad_steps": grad_steps, "wall_time": round(wall_time, 2),
              "return": eval_returns[-1], "return_past10": float(np.mean(trained[-PAST:])) if trained else None,
              "return_min": float(returns.min()), "return_max": float(returns.max()), **stats,
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    fig, ax = plt.subplots(figsize=(5, 5))
    colors = plt.cm.hsv(np.linspace(0, 1, len(paths), endpoint=False))
    envs.draw_coordinates(ax, paths, colors)  # the (x, y) paths, or on HalfCheetah x against the env step
    for i, color in enumerate(colors if goals is not None else []):
        for star in np.unique(goals[i], axis=0) if paths.shape[-1] == 2 else [(goals[i, -1, 0], paths.shape[1] - 1)]:
            ax.plot(*star, marker="*", color=color, ms=8, mec="black", mew=0.4)
    ax.set_title(f"{args.task} over {child_ckpt['agent']} skills, {env_steps:,} env steps, return "
                 f"{result['return']:.1f}", fontsize=9)
    fig.tight_layout()
    hint = resume_hint(os.path.join(run_dir, "checkpoint.pt"))
    write_atomically(os.path.join(run_dir, f"episodes_{env_steps:010d}.png"), lambda tmp: fig.savefig(tmp, dpi=100),
                     hint)
    plt.close(fig)
    for key in ("return", "return_past10"):
        if result[key] is not None:
            writer.add_scalar(f"eval/{key}", result[key], env_steps)
    log_path = os.path.join(run_dir, "eval.jsonl")
    logged = pathlib.Path(log_path).read_text() if os.path.isfile(log_path) else ""
    write_atomically(log_path, lambda tmp: pathlib.Path(tmp).write_text(logged + json.dumps(result) + "\n"), hint)
    past = "–" if result["return_past10"] is None else f"{result['return_past10']:.3g}"
    print(f"eval  epoch {epoch} | env steps {env_steps:,} | return {result['return']:.3g} | past 10 {past} | "
          + " | ".join(f"{k} {v:.4g}" for k, v in stats.items()), flush=True)


def new_window():
    """What happened since the last evaluation: named means per epoch that trained, and the speeds."""
    return {"stats": [], "train_time": 0.0, "grad_steps": 0, "start": time.time(), "env_steps": 0}


def log_epoch(args, writer, epoch, grad_steps, step_stats, train_time, window, sps, episode_return, checkpoint_path):
    """An epoch's stat means to the window and TensorBoard (one line at a NaN or inf *_loss), with the training return
    and `sps` (so far, evaluations included); every 10 epochs, a progress line."""
    env_steps = (epoch + 1) * args.num_envs * SKILL_STEPS * HIGH_HORIZON
    if step_stats:
        names = list(step_stats[0])
        per_step = torch.stack([torch.stack(list(stats.values())) for stats in step_stats])  # (steps, names)
        bad = ~torch.isfinite(per_step) & torch.tensor([n.endswith("_loss") for n in names]).to(per_step.device)
        if bad.any():
            step, which = bad.nonzero()[0].tolist()
            error(f"{names[which]} is {per_step[step, which].item()} at gradient step "
                  f"{grad_steps - len(step_stats) + step + 1} (epoch {epoch}); {resume_hint(checkpoint_path)}")
        means = per_step.mean(0)
        window["stats"].append(dict(zip(names, means)))
        window["grad_steps"] += len(step_stats)
        window["train_time"] += train_time
        for name, value in zip(names, means.tolist()):
            writer.add_scalar(f"losses/{name}" if name.endswith("loss") else f"charts/{name}", value, env_steps)
    writer.add_scalar("charts/episode_return", episode_return, env_steps)
    writer.add_scalar("charts/SPS", int(sps), env_steps)
    if (epoch + 1) % 10 == 0:
        print(f"epoch {epoch + 1} | env steps {env_steps:,} | SPS {int(sps)} | "
              f"{duration((args.total_env_steps - env_steps) / sps)} left | episode return {episode_return:.3g}",
              flush=True)


def duration(seconds):
    """A time span as people read it: "45 s", "12 min", "3 h 05 min"."""
    minutes = round(seconds / 60)
    return (f"{seconds:.0f} s" if seconds < 60 else f"{minutes} min" if minutes < 60
            else f"{minutes // 60} h {minutes % 60:02d} min")


def error(message):
    """End the run with one line on stderr, no traceback."""
    sys.exit(f"{AGENT}.py: error: {message}")


def resume_hint(path):
    return f"resume with --resume {path}" if os.path.isfile(path) else "no checkpoint was written yet"


def write_atomically(path, write, hint):
    """write(a temporary path), renamed to `path`: a failed write leaves the earlier file whole, and ends the run."""
    temporary = "{}.tmp{}".format(*os.path.splitext(path))  # the extension tells savefig the format
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException as e:  # a failed write, or Ctrl-C mid-write: no temporary left
        with contextlib.suppress(OSError):
            os.remove(temporary)
        if not isinstance(e, (OSError, RuntimeError)):  # torch.save reports a failed write as a RuntimeError
            raise
        cut_short = "unexpected pos" in str(e) or "write failed" in str(e)
        reason = (e.strerror or str(e)) if isinstance(e, OSError) else (
            "the write was cut short: is the disk full?" if cut_short else " ".join(str(e).split())[:120])
        error(f"cannot write {path} ({reason}); {hint}")


if __name__ == "__main__":
    parsed = parse_args()  # the args, the child's checkpoint, and this run's checkpoint if it resumes
    try:
        main(*parsed)
    except OSError as e:  # the run's folder or TensorBoard's file cannot be written
        error(f"cannot write {os.fsdecode(e.filename) if e.filename else 'the TensorBoard log'} ({e.strerror or e})")
