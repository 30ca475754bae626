"""Hierarchical control over any agent's frozen skills, in one file: "Can a MISL Fly? Analysis and Ingredients for
Mutual Information Skill Learning" (Zheng, Tuyls, Peng and Eysenbach, ICLR 2025), §6.4 and App. B.5.

A high-level policy π_h(a | s) picks a skill z every K = 25 steps; the skill policy π(· | s, z) of a pretrained agent,
loaded from its checkpoint with the agent script's own Actor and frozen, acts deterministically, tanh(mean), for those
K steps on the observation without the task's goal dims. The K task rewards are summed into one high-level reward
R = Σ_{t<K} r_t, and an episode is 8 high-level steps (8 × 25 = 200 env steps), its last step terminal. π_h's action a
becomes the skill as the official garagei/envs/child_policy_env.py makes it: z = a/‖a‖ (CSF, METRA, VISR), z = 1.5·a
(CIC, DADS: priors that are not the sphere) or z = onehot(a) (DIAYN, METRA on HalfCheetah: a categorical π_h). π_h
maximizes E[Σ_k γ^k R_k], learned with SAC (twin Qs on y = R + γ(1 - done)(min_i Q̄_i(s', a') - α log π_h(a'|s')),
π_h on E[α log π_h(a|s) - min_i Q_i(s, a)]) on AntMultiGoal, QuadrupedGoal and HumanoidGoal, or with PPO (the clipped
surrogate -E[min(ρÂ, clip(ρ, 1 ± ε)Â)] - c E[H(π_h)], Â from GAE(λ), ρ = π_h(a|s)/π_old(a|s)) on HalfCheetahGoal and
HalfCheetahHurdle.

    python hierarchical.py --checkpoint runs/Ant__csf__1__1700000000 --task AntMultiGoal      # a run folder, or
    python hierarchical.py --checkpoint runs/HalfCheetah__metra__1__1700000000/checkpoint.pt --task HalfCheetahHurdle

The official hyperparameters (scripts/hierarchical_control/*.sh; App. B.5's table):
  SAC: 8 episodes (64 high-level transitions) per epoch, 50 gradient steps per epoch after 10k stored transitions,
       batch 256, twin Q with Polyak targets (τ = 5e-3), α from 0.1 tuned towards entropy -|A|/2; for one-hot
       children discrete SAC (Q(s, ·) over the K skills, expectations under π_h(·|s), target entropy +log K).
  PPO: 64 episodes (512 transitions) per epoch, 10 steps on minibatches of 256 drawn with replacement, clip 0.2,
       GAE λ = 0.95 for the advantages (standardized per minibatch), entropy bonus 0.01 (of the pre-tanh Gaussian),
       a value network regressed on the Monte-Carlo discounted returns with its own optimizer.
  Both: γ = 0.99 per high-level step, Adam lr 1e-4, width 1024, tanh policy trunks, ReLU critics.
Evaluation: 48 deterministic high-level episodes every 100 epochs (25 on pixels), the official periods; eval.jsonl
has their mean return and the mean of the last 10 evaluations after epoch 0 (the paper's "Return (past 10)"; the
untrained evaluation at epoch 0 is never in it, null there), and a plot shows their trajectories.

Deliberate differences from the official code (github.com/Princeton-RL/contrastive-successor-features):
  - AntMultiGoal redraws its whole goal chain every episode, where the official env (ant_nav_prime) draws goals
    2-4 once per env (envs.py explains).
  - the high-level replay buffer stores each observation once per step (whole episodes), as the agents' buffers do.
  - "Return (past 10)" averages the last 10 evaluations after epoch 0, where the official plotting script
    (run/paper/plot_hierarchical_control.py) averages the current evaluation and the 10 before it, epoch 0 included
    while there are fewer.
  - a budget: 4M low-level env steps for SAC, 12.8M for PPO (whose epochs are 8 times larger), at least 10
    evaluations after epoch 0 on every task; the official scripts set none (n_epochs 200001).
  - on a GPU, float32 matmuls use TF32 (torch.set_float32_matmul_precision("high")); a CPU computes them in full
    float32, and the tests' numbers are the CPU's.

The file reads in the paper's order: Args; the high level's losses, SAC's then PPO's; the skills and the networks;
the episode buffer and one high-level episode; `main`, the training loop; then the infrastructure main calls (the
command line, start-up, the child, checkpoints, evaluation, logging).
"""

import contextlib
import hashlib
import importlib
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
from torch.utils.tensorboard import SummaryWriter

import envs

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SKILL_STEPS = 25  # low-level steps per high-level step
HIGH_HORIZON = 8  # high-level steps per episode: 8 × 25 = 200 low-level steps
CHILD_AGENTS = ("csf", "metra", "diayn", "visr", "cic", "dads")
# the budgets: 2,500 SAC epochs (8 episodes) and 1,000 PPO epochs (64 episodes), both at least 10 evaluations after
# epoch 0 at the official periods (every 100 epochs, 25 on pixels), so "Return (past 10)" is ten trained evaluations
ALGO_DEFAULTS = {"sac": {"num_envs": 8, "grad_steps_per_epoch": 50, "total_env_steps": 4_000_000},
                 "ppo": {"num_envs": 64, "grad_steps_per_epoch": 10, "total_env_steps": 12_800_000}}
PAST = 10  # evaluations in "Return (past 10)"


@dataclass
class Args:
    checkpoint: str = ""
    """the child: a checkpoint.pt of csf.py, metra.py, diayn.py, visr.py, cic.py or dads.py, or a run folder (its
    newest checkpoint)"""
    task: str = "AntMultiGoal"
    """the downstream task: AntMultiGoal, HalfCheetahGoal, HalfCheetahHurdle, QuadrupedGoal or HumanoidGoal"""
    seed: int = 1
    """seed of torch, numpy and the envs; on a CPU the same seed gives the same run"""
    total_env_steps: Optional[int] = None
    """training budget in low-level env steps, an epoch being num_envs × 200 (unset: SAC 4M, 2,500 epochs;
    PPO 12.8M, 1,000 epochs; either way at least 10 evaluations after epoch 0 at the default --eval-every)"""
    num_envs: Optional[int] = None
    """high-level episodes collected per epoch (unset: SAC 8, PPO 64)"""
    grad_steps_per_epoch: Optional[int] = None
    """gradient steps after each collection round (unset: SAC 50, PPO 10)"""
    learning_starts: int = 10_000
    """SAC: high-level transitions stored before the first gradient step (PPO learns from every epoch)"""
    batch_size: int = 256
    """high-level transitions per minibatch, sampled uniformly with replacement"""
    buffer_size: Optional[int] = None
    """SAC replay capacity in high-level transitions (unset: the task's, 1M on Ant, 300k on pixels)"""
    hidden_dim: int = 1024
    """width of the two hidden layers of the high-level networks"""
    eval_every: Optional[int] = None
    """epochs between evaluations (unset: 100 on Ant and HalfCheetah, 25 on pixels, the official periods);
    epoch 0 and the last epoch are always evaluated, and "past 10" averages the last 10 evaluations after epoch 0"""
    checkpoint_every: Optional[int] = None
    """epochs between checkpoints (unset: same as --eval-every); the last epoch always writes one"""
    num_eval_episodes: int = 48
    """deterministic high-level episodes per evaluation (the paper's 48)"""
    resume: Optional[str] = None
    """path of a hierarchical checkpoint.pt to continue from"""
    cuda: bool = True
    """use the GPU when torch sees one"""
    parallel_envs: bool = True
    """step the training and the evaluation envs in worker processes, at most one per core, each stepping several;
    --no-parallel-envs steps them one by one in this process (the same numbers either way)"""
    compile: bool = False
    """SAC: torch.compile the whole gradient step as one function (its losses, backward, Adam steps and the Polyak
    step); same numbers as eager up to float rounding. PPO runs without it"""
    cudagraphs: bool = False
    """SAC: on a GPU, record the whole gradient step once as a CUDA graph and replay it, one launch per step; a CPU
    runs the step without graphs, and says so. PPO runs without it"""
    track: bool = False
    """also log to Weights & Biases (WANDB_MODE=offline works)"""
    wandb_project_name: str = "cleanmisl"
    """W&B project, with --track"""
    wandb_entity: Optional[str] = None
    """W&B team, with --track"""
    gamma: float = 0.99
    """discount per high-level step"""
    lr: float = 1e-4
    """Adam learning rate of every high-level network (and of log α)"""
    tau: float = 0.005
    """SAC: Polyak step of the target Qs"""
    alpha_init: float = 0.1
    """SAC: initial entropy temperature α, tuned towards -|A|/2 (continuous) or +log K (one-hot children)"""
    clip: float = 0.2
    """PPO: clip range of the probability ratio"""
    gae_lambda: float = 0.95
    """PPO: λ of the generalized advantage estimate"""
    entropy_coef: float = 0.01
    """PPO: weight of the entropy bonus"""


# Every numeric flag and the values that mean something ("[" closed end, "(" open end); NaN is never inside.
FLAG_RANGES = {
    "seed": "[0, 2147483647]", "total_env_steps": "[1, inf)", "num_envs": "[1, inf)",
    "grad_steps_per_epoch": "[0, inf)", "learning_starts": "[0, inf)", "batch_size": "[1, inf)",
    "buffer_size": "[1, inf)", "hidden_dim": "[1, inf)", "eval_every": "[1, inf)", "checkpoint_every": "[1, inf)",
    "num_eval_episodes": "[1, inf)", "gamma": "[0, 1)", "lr": "(0, inf)", "tau": "(0, 1]", "alpha_init": "(0, inf)",
    "clip": "(0, inf)", "gae_lambda": "[0, 1]", "entropy_coef": "[0, inf)",
}
# What --resume may change: neither the learning problem nor the random streams depend on these.
RESUME_MAY_CHANGE = ("total_env_steps", "eval_every", "checkpoint_every", "resume", "cuda", "parallel_envs", "track",
                     "wandb_project_name", "wandb_entity", "compile", "cudagraphs")




# ======================================================================================================================
# THE ALGORITHM
# ======================================================================================================================

# ---------------------------------------------------------------- SAC's losses (official iod/sac.py, iod/sac_utils.py)
def sac_target(reward, done, next_value, gamma):
    """y = R + γ (1 - done) V̄(s'), the TD target of both Qs: done at an episode's last high-level step."""
    return reward + gamma * (1 - done) * next_value


def soft_next_value(policy, qf_target, next_obs, alpha, discrete):
    """V̄(s') = min_i Q̄_i(s', a') - α log π_h(a'|s'), a' ~ π_h(·|s') (continuous); for one-hot skills its expectation
    under π_h: Σ_k π_h(k|s') (min_i Q̄_i(s', k) - α log π_h(k|s'))."""
    if discrete:
        next_dist = policy.dist(next_obs)
        next_q = torch.stack([net(next_obs) for net in qf_target]).amin(0)
        return (next_dist.probs * (next_q - alpha * next_dist.logits.log_softmax(-1))).sum(-1)
    next_action, next_log_prob, _ = policy.sample(next_obs)
    return torch.stack([net(next_obs, next_action) for net in qf_target]).amin(0) - alpha * next_log_prob


def q_value(net, obs, action, discrete):
    """Q(s, a): of the taken skill's index for one-hot skills (Q(s, ·) has one output per skill)."""
    return net(obs).gather(-1, action[:, None]).squeeze(-1) if discrete else net(obs, action)


def critic_objective(qf, qf_target, policy, batch, alpha, gamma, discrete):
    """L(Q) = Σ_i ½ E[(Q_i(s, a) - y)²], y = R + γ (1 - done) V̄(s'), no gradient through y. Returns the loss and the
    first Q's values (logged as q)."""
    with torch.no_grad():
        next_value = soft_next_value(policy, qf_target, batch["next_obs"], alpha, discrete)
        target = sac_target(batch["reward"], batch["done"], next_value, gamma)
    q = [q_value(net, batch["obs"], batch["action"], discrete) for net in qf]
    return sum(0.5 * F.mse_loss(value, target) for value in q), q[0]


def actor_objective(policy, qf, obs, alpha, discrete):
    """L(π_h) = E[α log π_h(a|s) - min_i Q_i(s, a)], a ~ π_h(·|s); for one-hot skills the expectation over the skills,
    E_s Σ_k π_h(k|s) (α log π_h(k|s) - min_i Q_i(s, k)). Returns the loss and log π_h (for one-hot skills, its
    expectation -H(π_h(·|s))) for the temperature step."""
    if discrete:
        dist = policy.dist(obs)
        log_pi = dist.logits.log_softmax(-1)
        q = torch.stack([net(obs) for net in qf]).amin(0)
        return (dist.probs * (alpha * log_pi - q)).sum(-1).mean(), (dist.probs * log_pi).sum(-1)
    new_action, log_prob, _ = policy.sample(obs)
    q = torch.stack([net(obs, new_action) for net in qf]).amin(0)
    return (alpha * log_prob - q).mean(), log_prob


def temperature_loss(log_alpha, log_prob, target_entropy):
    """L(α) = -E[log α (log π_h(a|s) + H̄)]: α grows while the entropy is below H̄ (-|A|/2, or +log K for one-hot
    skills, the official targets; +log K is the largest entropy there is, so α only grows there)."""
    return -(log_alpha * (log_prob + target_entropy)).mean()


# ---------------------------------------------------------------- PPO's losses (official iod/ppo.py)
def gae(rewards, values, gamma, lam):
    """Generalized advantages over (N, T) episodes that end at T (the value after the last step is 0), and the
    Monte-Carlo discounted returns the value network regresses on."""
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


def ppo_objective(policy, obs, raw, old_log_prob, advantages, discrete, clip, entropy_coef):
    """The clipped surrogate of one minibatch, π_h re-evaluated at the stored skill index or pre-tanh action `raw`,
    and the entropy in its bonus."""
    dist = policy.dist(obs)
    if discrete:
        log_prob, entropy = dist.log_prob(raw), dist.entropy()
    else:  # the tanh correction cancels in the ratio; the bonus is the pre-tanh Gaussian's entropy
        log_prob, entropy = GaussianPolicy.squash(dist, raw)[1], dist.entropy().sum(-1)
    return ppo_policy_loss(log_prob, old_log_prob, advantages, entropy, clip, entropy_coef), entropy


# ---------------------------------------------------------------- the skills (official child_policy_env.py)
def skill_kind(child_ckpt):
    """How a high-level action becomes a skill: "one-hot" (DIAYN, one-hot METRA), "scaled" (CIC, DADS: priors that
    are not the unit sphere) or "sphere" (CSF, METRA, VISR)."""
    if child_ckpt["agent"] == "diayn" or child_ckpt["args"].get("discrete"):
        return "one-hot"
    return "scaled" if child_ckpt["agent"] in ("cic", "dads") else "sphere"


def action_to_skill(action, kind, skill_dim):
    """z = onehot(a) for one-hot children (a is the index), 1.5·a for CIC/DADS, a/‖a‖ for unit-sphere children."""
    if kind == "one-hot":
        return F.one_hot(action.long(), skill_dim).float()
    return 1.5 * action if kind == "scaled" else F.normalize(action, dim=-1)


def child_view(obs, extra_dims):
    """The child's input: the observation without the task's goal (or hurdle) dims; on pixels, the frames."""
    return obs["pixels"] if isinstance(obs, dict) else obs[..., :-extra_dims]


# ---------------------------------------------------------------- the high-level networks (official run/train.py)
def mlp(in_dim, hidden_dim, out_dim, activation, init):
    """Linear → act → Linear → act → Linear, zero biases."""
    net = nn.Sequential(nn.Linear(in_dim, hidden_dim), activation(), nn.Linear(hidden_dim, hidden_dim),
                        activation(), nn.Linear(hidden_dim, out_dim))
    for layer in net:
        if isinstance(layer, nn.Linear):
            init(layer.weight)
            nn.init.zeros_(layer.bias)
    return net


class GaussianPolicy(nn.Module):
    """π_h(a | s) over [-1, 1]^d: tanh-squashed Gaussian on a tanh trunk, output layers initialised 10x smaller."""

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

    def dist(self, obs):
        """The pre-tanh Gaussian."""
        h = self.trunk(self.encoder(obs))
        log_std = self.log_std(h).clamp(self.LOG_STD_MIN, self.LOG_STD_MAX)
        return torch.distributions.Normal(self.mean(h), log_std.exp(), validate_args=False)

    @staticmethod
    def squash(normal, u):
        """a = tanh(u) and log π(a|s), with the tanh correction."""
        action = torch.tanh(u)
        return action, normal.log_prob(u).sum(-1) - torch.log((1 - action.pow(2)).clamp(0, 1) + 1e-6).sum(-1)

    def sample(self, obs):
        """A reparameterized action, its log-probability, and the pre-tanh sample u (PPO re-evaluates it)."""
        normal = self.dist(obs)
        u = normal.rsample()
        return (*self.squash(normal, u), u)

    def mode(self, obs):
        return torch.tanh(self.dist(obs).mean)


class CategoricalPolicy(nn.Module):
    """π_h(k | s) over the K one-hot skills: logits on a tanh trunk."""

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
    """Q(s, a) ∈ R for continuous actions (input s ⊕ a), or Q(s, ·) ∈ R^K for one-hot skills; ReLU, Xavier-normal.
    With action_dim 0 and one output it is PPO's value network V(s)."""

    def __init__(self, observation_space, action_dim, hidden_dim, num_actions=1):
        super().__init__()
        self.encoder, features = envs.make_encoder(observation_space)
        self.net = mlp(features + action_dim, hidden_dim, num_actions, nn.ReLU, nn.init.xavier_normal_)

    def forward(self, obs, action=None):
        features = self.encoder(obs)
        out = self.net(features if action is None else torch.cat([features, action], -1))
        return out.squeeze(-1) if out.shape[-1] == 1 else out


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


# ---------------------------------------------------------------- the replay buffer (SAC) and one high-level episode
def as_tensor(array, device):
    """An array (or a dict of arrays: pixels + goal) as tensors on `device`; to a GPU through pinned memory, without
    waiting for the copy."""
    if isinstance(array, dict):
        return {key: as_tensor(value, device) for key, value in array.items()}
    tensor = torch.as_tensor(array)
    return tensor.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else tensor


class EpisodeBuffer:
    """A ring of whole high-level episodes: each observation stored once (s'_t is s_{t+1}), a dict of arrays for
    pixels + goal. Transitions are sampled uniformly, with replacement; the last step of an episode is terminal."""

    def __init__(self, capacity, observation_space, action_shape, action_dtype, rng):
        spaces = observation_space.spaces if isinstance(observation_space, gym.spaces.Dict) else {
            "obs": observation_space}
        n = max(capacity // HIGH_HORIZON, 1)
        self.obs = {key: np.zeros((n, HIGH_HORIZON + 1, *space.shape), space.dtype) for key, space in spaces.items()}
        self.actions = np.zeros((n, HIGH_HORIZON, *action_shape), action_dtype)
        self.rewards = np.zeros((n, HIGH_HORIZON), np.float32)
        self.dict_obs, self.rng, self.pos, self.num_stored = isinstance(observation_space, gym.spaces.Dict), rng, 0, 0

    def add(self, observations, actions, rewards):
        """observations: {key: (E, T + 1, ...)}; actions: (E, T, ...); rewards: (E, T)."""
        idx = (self.pos + np.arange(len(rewards))) % len(self.rewards)
        for key, value in observations.items():
            self.obs[key][idx] = value
        self.actions[idx], self.rewards[idx] = actions, rewards
        self.pos = (self.pos + len(rewards)) % len(self.rewards)
        self.num_stored = min(self.num_stored + len(rewards), len(self.rewards))

    @property
    def size(self):  # stored transitions
        return self.num_stored * HIGH_HORIZON

    def sample(self, batch_size, device):
        """A minibatch of transitions (s, a, R, s', done) on `device`."""
        i = self.rng.integers(0, self.size, batch_size)
        episode, t = i // HIGH_HORIZON, i % HIGH_HORIZON
        view = (lambda o: o) if self.dict_obs else (lambda o: o["obs"])
        return {"obs": as_tensor(view({k: v[episode, t] for k, v in self.obs.items()}), device),
                "next_obs": as_tensor(view({k: v[episode, t + 1] for k, v in self.obs.items()}), device),
                "action": as_tensor(self.actions[episode, t], device),
                "reward": as_tensor(self.rewards[episode, t], device),
                "done": as_tensor((t == HIGH_HORIZON - 1).astype(np.float32), device)}

    def state_dict(self):
        n = self.num_stored
        # Tensors over the arrays, not copies: torch.save writes them as they are (a pickled array is copied 4-5 times)
        return {"pos": self.pos, "num_stored": n, "obs": {k: torch.from_numpy(v[:n]) for k, v in self.obs.items()},
                "actions": torch.from_numpy(self.actions[:n]), "rewards": torch.from_numpy(self.rewards[:n])}

    def load_state_dict(self, state):
        self.pos, self.num_stored, n = state["pos"], state["num_stored"], state["num_stored"]
        for key, value in state["obs"].items():
            self.obs[key][:n] = value
        self.actions[:n], self.rewards[:n] = state["actions"], state["rewards"]


@torch.no_grad()
def run_episodes(vec_env, policy, child, kind, skill_dim, extra_dims, device, deterministic=False):
    """One high-level episode in each env: π_h picks a skill (sampled, or its mode with `deterministic`), the frozen
    child runs it for 25 steps, its rewards summed. Returns the episodes' observations, actions, log-probs, pre-tanh
    actions (skill indices for one-hot skills), summed rewards, and the low-level coordinates and goals (plots)."""
    obs, info = vec_env.reset()
    observations, actions, log_probs, raws, rewards = [obs], [], [], [], []
    coordinates, goals = [info["coordinates"]], [info.get("goal")]
    for step in range(HIGH_HORIZON):
        if deterministic:  # the mode (or most likely skill), in sample's (action, log π, raw) form
            action = policy.mode(as_tensor(obs, device))
            log_prob, raw = torch.zeros(len(action)), action
        else:
            action, log_prob, raw = policy.sample(as_tensor(obs, device))
        skill = action_to_skill(action, kind, skill_dim)
        reward = np.zeros(vec_env.num_envs)
        for t in range(SKILL_STEPS):
            low_action = child.mode(child_view(as_tensor(obs, device), extra_dims), skill).cpu().numpy()
            if not np.isfinite(low_action).all():  # the envs refuse NaN and inf
                error("the child's action is not finite: the high-level policy's networks diverged")
            obs, r, terminated, truncated, info = vec_env.step(low_action)
            last = step == HIGH_HORIZON - 1 and t == SKILL_STEPS - 1  # the 200-step time limit
            assert not terminated.any() and (truncated == last).all(), (step, t, terminated, truncated)
            reward += r
            coordinates.append(info["coordinates"])
            goals.append(info.get("goal"))
        observations.append(obs)
        actions.append(action.cpu().numpy())
        log_probs.append(log_prob.cpu().numpy())
        raws.append(raw.cpu().numpy())
        rewards.append(reward)
    stack = (lambda xs: {k: np.stack([x[k] for x in xs], 1) for k in xs[0]}) if isinstance(obs, dict) else (
        lambda xs: {"obs": np.stack(xs, 1)})
    return {"obs": stack(observations), "action": np.stack(actions, 1), "log_prob": np.stack(log_probs, 1),
            "raw": np.stack(raws, 1), "reward": np.stack(rewards, 1).astype(np.float32),
            "coordinates": np.stack(coordinates, 1), "goals": None if goals[0] is None else np.stack(goals, 1)}


def acted_states(observations, pixels):
    """{key: (E, T + 1, ...)} → the E × T states the high level acted in (not the final ones), flattened: a dict on
    pixels + goal, else an array."""
    flat = {key: value[:, :-1].reshape(-1, *value.shape[2:]) for key, value in observations.items()}
    return flat if pixels else flat["obs"]


# ---------------------------------------------------------------- the training loop
def main(args, child_ckpt, ckpt=None):
    """Epoch by epoch: evaluate every `eval_every` epochs (epoch 0 included); collect `num_envs` high-level episodes
    over the frozen child of `child_ckpt`; learn from them: SAC's `sac_update` on its replay buffer's minibatches,
    or PPO's `ppo_update`. `ckpt`: this run's checkpoint to resume from (parse_args loads both)."""
    task = envs.TASKS[args.task]
    steps_per_epoch = args.num_envs * SKILL_STEPS * HIGH_HORIZON  # low-level env steps
    num_epochs = args.total_env_steps // steps_per_epoch
    run_name, run_dir, checkpoint_path, writer = start_run(args, child_ckpt, ckpt)  # folder, Ctrl-C, W&B, TensorBoard

    # ------------------------------------------------------------ seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)  # replay and minibatch sampling
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on the GPUs that have them

    # ------------------------------------------------------------ envs, and the frozen child
    train_envs, eval_envs = make_envs(args)  # episodes of exactly 200 low-level steps, never reset on their own
    observation_space = train_envs.single_observation_space  # the full observation: state (or pixels) + task dims
    pixels = isinstance(observation_space, gym.spaces.Dict)
    child = frozen_child(args.checkpoint, child_ckpt, observation_space, task.extra_dims,
                         train_envs.single_action_space.shape[0], device)  # the agent script's own Actor
    kind, skill_dim = skill_kind(child_ckpt), child_ckpt["args"]["skill_dim"]
    discrete = kind == "one-hot"  # a categorical π_h over the K skills
    check_memory(args, observation_space, skill_dim, task.algo == "sac", device)

    # ------------------------------------------------------------ high-level networks, optimizers, replay buffer
    policy_class = CategoricalPolicy if discrete else GaussianPolicy
    policy = policy_class(observation_space, skill_dim, args.hidden_dim).to(device)
    adam = adam_options(args, task.algo, device)  # torch's default Adam, but see --compile and --cudagraphs
    policy_optimizer = torch.optim.Adam(policy.parameters(), **adam)
    modules, log_alpha, rb = {"policy": policy, "policy_optimizer": policy_optimizer}, None, None  # + SAC's below
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
        modules |= {**{f"qf{k}": net for k, net in enumerate(qf, 1)}, **{f"qf{k}_target": net for k, net in
                    enumerate(qf_target, 1)}, "qf_optimizer": qf_optimizer, "alpha_optimizer": alpha_optimizer}
    else:
        value = QNetwork(observation_space, 0, args.hidden_dim).to(device)  # V(s)
        value_optimizer = torch.optim.Adam(value.parameters(), **adam)
        modules |= {"value": value, "value_optimizer": value_optimizer}

    start_epoch, grad_steps, wall_time, since_eval, eval_returns = 0, 0, 0.0, new_window(), []
    if ckpt:
        start_epoch, grad_steps, wall_time, since_eval, eval_returns = restore_checkpoint(
            ckpt, args, run_dir, modules, log_alpha, rb, rng, (train_envs, eval_envs), device)

    # ------------------------------------------------------------ SAC: one gradient step
    def sac_update(batch):
        """One SAC step (official iod/sac.py): the twin Qs on their soft TD target; π_h on min_i Q_i + α H(π_h); α
        towards the target entropy; the Polyak step of the target Qs. Returns its stats by name, on the device."""
        alpha = log_alpha.exp().detach()
        qf_loss, q = critic_objective(qf, qf_target, policy, batch, alpha, args.gamma, discrete)
        qf_optimizer.zero_grad()
        qf_loss.backward()
        qf_optimizer.step()
        with frozen(qf):  # the gradient flows through Q to the action, not into Q
            actor_loss, log_prob = actor_objective(policy, qf, batch["obs"], alpha, discrete)
            policy_optimizer.zero_grad()
            actor_loss.backward()
            policy_optimizer.step()
        alpha_loss = temperature_loss(log_alpha, log_prob.detach(), target_entropy)
        alpha_optimizer.zero_grad()
        alpha_loss.backward()
        alpha_optimizer.step()
        with torch.no_grad():  # Q̄ ← (1 - τ) Q̄ + τ Q, every tensor in one call
            torch._foreach_lerp_(qf_target_params, qf_params, args.tau)
        return {"qf_loss": qf_loss.detach(), "actor_loss": actor_loss.detach(), "alpha_loss": alpha_loss.detach(),
                "alpha": alpha, "q": q.mean().detach()}
    sac_update = fast_path(sac_update, args, task.algo, device)  # --compile, --cudagraphs; without them, itself

    # ------------------------------------------------------------ PPO: one epoch's gradient steps
    def ppo_update(episodes):
        """GAE advantages and returns of the epoch's episodes (official iod/ppo.py), then a π_h step on the clipped
        surrogate and a V step on the returns per minibatch. Returns each step's stats by name, on the device."""
        states = as_tensor(acted_states(episodes["obs"], pixels), device)
        with torch.no_grad():
            values = value(states).reshape(len(episodes["reward"]), HIGH_HORIZON)
        advantages, returns = gae(as_tensor(episodes["reward"], device), values, args.gamma, args.gae_lambda)
        raws = as_tensor(episodes["raw"], device).flatten(0, 1)  # skill indices, or pre-tanh actions
        old_log_probs = as_tensor(episodes["log_prob"], device).reshape(-1)
        advantages, returns = advantages.reshape(-1), returns.reshape(-1)
        step_stats = []
        for _ in range(args.grad_steps_per_epoch):
            i = as_tensor(rng.integers(0, len(returns), args.batch_size), device)
            obs = {k: v[i] for k, v in states.items()} if pixels else states[i]
            policy_loss, entropy = ppo_objective(policy, obs, raws[i], old_log_probs[i], advantages[i], discrete,
                                                 args.clip, args.entropy_coef)
            policy_optimizer.zero_grad()
            policy_loss.backward()
            policy_optimizer.step()
            value_loss = F.mse_loss(value(obs), returns[i])
            value_optimizer.zero_grad()
            value_loss.backward()
            value_optimizer.step()
            step_stats.append({"policy_loss": policy_loss.detach(), "value_loss": value_loss.detach(),
                               "entropy": entropy.mean().detach()})
        return step_stats

    # ------------------------------------------------------------ the loop: evaluate, collect, update
    segment_start = time.time()
    for epoch in range(start_epoch, num_epochs + 1):
        # evaluate and checkpoint at the start of the epoch: what the previous `epoch` epochs produced
        if (epoch % args.eval_every == 0 or epoch == num_epochs) and not (ckpt and epoch == start_epoch):
            evaluate(epoch, grad_steps, wall_time + time.time() - segment_start, window_stats(since_eval),
                     eval_returns, args, child_ckpt, policy, child, eval_envs, device, run_dir, writer)
            since_eval = new_window()
        if epoch == num_epochs or (epoch % args.checkpoint_every == 0 and epoch != start_epoch):
            save_checkpoint(checkpoint_path, args, run_name, child_ckpt, epoch, grad_steps,
                            wall_time + time.time() - segment_start, eval_returns, since_eval, modules, log_alpha, rb,
                            rng, (train_envs, eval_envs), device)
        if epoch == num_epochs:
            break

        # collect one high-level episode per env with the stochastic π_h
        episodes = run_episodes(train_envs, policy, child, kind, skill_dim, task.extra_dims, device)
        since_eval["env_steps"] += steps_per_epoch
        env_steps = (epoch + 1) * steps_per_epoch

        # update: PPO on this epoch's episodes; SAC on minibatches of its replay buffer
        train_start, step_stats = time.time(), []
        if task.algo == "ppo":
            step_stats = ppo_update(episodes)
        else:
            rb.add(episodes["obs"], episodes["action"], episodes["reward"])
            if rb.size >= args.learning_starts and args.grad_steps_per_epoch > 0:
                step_stats = [sac_update(rb.sample(args.batch_size, device)) for _ in range(args.grad_steps_per_epoch)]
        if step_stats:
            names, per_step = stack_stats(step_stats)  # (steps, stats)
            stop_at_a_non_finite_loss(names, per_step, grad_steps, epoch, resume_hint(checkpoint_path))
            grad_steps += len(step_stats)
            record_epoch(since_eval, dict(zip(names, per_step.mean(0))), len(step_stats), time.time() - train_start,
                         writer, env_steps)
        log_epoch(writer, epoch, env_steps, (epoch + 1 - start_epoch) * steps_per_epoch, time.time() - segment_start,
                  float(episodes["reward"].sum(1).mean()), args.total_env_steps)

    finish_run(args, run_dir, writer, train_envs, eval_envs)


# ======================================================================================================================
# INFRASTRUCTURE: what main calls around the algorithm (the command line, start-up, the child, checkpoints,
# evaluation, logging)
# ======================================================================================================================

# ---------------------------------------------------------------- the command line
def parse_args(argv=None):
    """The command line, every unset flag given the task's value, every value checked (one line on failure). With
    --resume, the flags the run was started with; a flag given beside it may change only what RESUME_MAY_CHANGE
    names. Returns the args, the child's checkpoint and the hierarchical checkpoint to resume (None for a new run)."""
    args, ckpt = tyro.cli(Args, args=argv), None
    if args.resume:
        ckpt = load_file(args.resume, "checkpoint")
        if ckpt["agent"] != "hierarchical":
            error(f"{args.resume} is a {ckpt['agent']} checkpoint, not a hierarchical one")
        if set(ckpt["args"]) - {field.name for field in fields(Args)}:
            error(f"{args.resume} was written by another version of hierarchical.py")
        args = tyro.cli(Args, args=argv, default=Args(**ckpt["args"]))
        for flag, trained in ckpt["args"].items():
            if flag not in RESUME_MAY_CHANGE and getattr(args, flag) != trained:
                error(f"{args.resume} was trained with --{flag.replace('_', '-')} {trained}, not {getattr(args, flag)}")
    if args.task not in envs.TASKS:
        error(f"unknown --task {args.task!r}; choose one of {', '.join(envs.TASKS)}")
    if not args.checkpoint:
        error("give the child's --checkpoint (a checkpoint.pt of an agent, or its run folder)")
    task = envs.TASKS[args.task]
    for flag, task_value in task_defaults(args.task).items():
        if getattr(args, flag) is None:
            setattr(args, flag, task_value)
    if args.checkpoint_every is None:
        args.checkpoint_every = args.eval_every
    for flag, interval in FLAG_RANGES.items():
        if not (flag == "buffer_size" and task.algo == "ppo") and not in_range(getattr(args, flag), interval):
            error(f"--{flag.replace('_', '-')} must be in {interval}, got {getattr(args, flag)}")
    steps_per_epoch = args.num_envs * SKILL_STEPS * HIGH_HORIZON
    if args.total_env_steps < steps_per_epoch:
        error(f"--total-env-steps must cover one epoch (--num-envs × 200 = {steps_per_epoch} env steps), "
              f"got {args.total_env_steps}")
    if task.algo == "sac" and args.buffer_size < args.num_envs * HIGH_HORIZON:
        error(f"--buffer-size must hold one epoch (--num-envs × {HIGH_HORIZON} transitions), got {args.buffer_size}")
    high_level_transitions = args.total_env_steps // steps_per_epoch * args.num_envs * HIGH_HORIZON
    if task.algo == "sac" and args.grad_steps_per_epoch and args.learning_starts > min(high_level_transitions,
                                                                                      args.buffer_size):
        error(f"--learning-starts ({args.learning_starts} high-level transitions) must be at most the run's "
              f"{high_level_transitions} and --buffer-size, or the run never learns")
    if ckpt and args.total_env_steps // steps_per_epoch <= ckpt["epoch"]:
        error(f"{args.resume} has already trained for {ckpt['epoch'] * steps_per_epoch} env steps; "
              f"give a larger --total-env-steps to continue it")
    child_path, child = load_child(args.checkpoint, args.task)
    args.checkpoint = child_path
    if ckpt and "child_actor_sha256" in ckpt and ckpt["child_actor_sha256"] != actor_digest(child):
        error(f"{child_path} is not the child {args.resume} was trained over: its actor's weights changed (another "
              f"checkpoint, or its run went on); give that run's checkpoint as it was")
    return args, child, ckpt


def task_defaults(task_name):
    """The official value of each flag whose default depends on the task and its learner (--checkpoint-every
    follows --eval-every)."""
    task = envs.TASKS[task_name]
    return {"buffer_size": task.buffer_size, "eval_every": task.eval_every, **ALGO_DEFAULTS[task.algo]}


def in_range(value, interval):
    """Whether `value` lies in an interval written like "[0, 1)" or "(0, inf)"."""
    low, high = (float(end) for end in interval[1:-1].split(","))
    above = low <= value if interval[0] == "[" else low < value
    below = value <= high if interval[-1] == "]" else value < high
    return above and below  # both False for NaN


def load_file(path, what):
    """A torch checkpoint file; one line if it is missing or unreadable."""
    if not os.path.isfile(path):
        error(f"no {what} file at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        error(f"{path} is not a readable checkpoint ({type(e).__name__})")
    if not isinstance(ckpt, dict) or "agent" not in ckpt or not isinstance(ckpt.get("args"), dict):
        error(f"{path} is not a cleanmisl checkpoint")
    return ckpt


def load_child(path, task):
    """The pretrained agent's checkpoint at `path` (or the newest .pt in the run folder `path`), checked against the
    task; one line on failure."""
    if os.path.isdir(path):
        candidates = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".pt")]
        if not candidates:
            error(f"the run folder {path} holds no checkpoint")
        path = max(candidates, key=os.path.getmtime)
    ckpt = load_file(path, "checkpoint")
    if ckpt["agent"] not in CHILD_AGENTS:
        error(f"{path} is a {ckpt['agent']} checkpoint, not one of a skill-discovery agent ({', '.join(CHILD_AGENTS)})")
    missing = [k for k in ("env_id", "skill_dim", "hidden_dim") if k not in ckpt["args"]]
    if missing or not isinstance(ckpt.get("actor"), dict):
        error(f"{path} lacks {', '.join(missing) or 'actor'}: it was not written by this version of "
              f"{ckpt['agent']}.py")
    base = envs.TASKS[task].base
    if ckpt["args"]["env_id"] != base:
        error(f"{path} holds skills learned on {ckpt['args']['env_id']}; {task} needs skills learned on {base}")
    for key, value in ckpt["actor"].items():
        if torch.is_tensor(value) and value.is_floating_point() and not torch.isfinite(value).all():
            error(f"{path} holds NaN or infinite weights (actor.{key}): its run diverged")
    return path, ckpt


def actor_digest(child_ckpt):
    """A SHA-256 of the child's actor weights: what a resumed run checks it is still over the same skills."""
    digest = hashlib.sha256()
    for key, value in sorted(child_ckpt["actor"].items()):
        digest.update(key.encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------- start-up
def start_run(args, child_ckpt, ckpt):
    """The run's folder (a resumed run goes on in its checkpoint's, whatever the working directory), Ctrl-C as one
    line naming the checkpoint to resume from, W&B with --track, TensorBoard, and one line with the values of the
    flags that depend on the task. Returns the run's name, folder, checkpoint path and TensorBoard writer."""
    run_name = ckpt["run_name"] if ckpt else (f"{args.task}__hierarchical_{child_ckpt['agent']}__{args.seed}__"
                                              f"{int(time.time())}")
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
    algo = envs.TASKS[args.task].algo
    shown = [flag for flag in (*task_defaults(args.task), "checkpoint_every") if flag != "buffer_size" or algo == "sac"]
    print(f"{args.task} over {child_ckpt['agent']} skills ({algo.upper()}, {HIGH_HORIZON} × {SKILL_STEPS} steps): "
          + ", ".join(f"--{flag.replace('_', '-')} {getattr(args, flag)}" for flag in shown)
          + (" (the run's own)" if ckpt else " (a flag not given takes the task's value)"), flush=True)
    return run_name, run_dir, checkpoint_path, writer


def make_envs(args):
    """The training envs (one high-level episode each per epoch) and the evaluation envs (one each), seeded, in
    worker processes unless --no-parallel-envs.

    Every episode is started by an explicit reset() and ends at 200 low-level steps; with autoreset DISABLED the
    vector env never resets on its own. A pixel world that cannot render ends the run with one line."""
    try:  # a pixel world makes its render context at its first frame: the first reset
        train_envs, eval_envs = envs.make_envs(functools.partial(envs.make_task, args.task), args.num_envs,
                                               args.num_eval_episodes, args.seed, 0, args.parallel_envs)
    except (envs.RenderUnavailable, MemoryError) as e:  # a world that cannot render; envs that cannot fit
        error(e)
    return train_envs, eval_envs


def frozen_child(path, child_ckpt, observation_space, extra_dims, action_dim, device):
    """The child's skill policy π(· | s, z): the agent script's own Actor with the checkpoint's weights, frozen and
    in eval mode, reading the observation without the task's dims. Weights that do not fit end the run with one
    line."""
    child_args = child_ckpt["args"]
    child_agent = importlib.import_module(child_ckpt["agent"])
    child_space = observation_space["pixels"] if isinstance(observation_space, gym.spaces.Dict) else gym.spaces.Box(
        -np.inf, np.inf, (observation_space.shape[0] - extra_dims,), np.float32)
    child = child_agent.Actor(child_space, action_dim, child_args["skill_dim"], child_args["hidden_dim"]).to(device)
    try:
        child.load_state_dict(child_ckpt["actor"])
    except RuntimeError as e:  # other shapes or names: another version of the agent, or an edited file
        detail = str(e).strip().splitlines()[-1].strip()  # torch's last line names a tensor and its shapes
        error(f"{path}'s actor does not fit {child_ckpt['agent']}.py's network ({detail})")
    child.requires_grad_(False)
    return child.eval()


def free_memory(device):
    """Bytes of memory free now: the GPU's, or the host's (MemAvailable); inf where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return math.inf


def check_memory(args, observation_space, skill_dim, sac, device):
    """Refuse, before anything is allocated, a run that cannot fit in the memory free now, with what it needs.
    Lower bounds: SAC's episode buffer in host memory; on the device, the hidden-by-hidden weights of the policy and
    of Q1 and Q2 (SAC) or V (PPO) with their gradients and Adam's two moments plus SAC's two target Qs, and one
    batch of float observations and 8 hidden activations per transition."""
    dict_space = isinstance(observation_space, gym.spaces.Dict)
    spaces = observation_space.spaces.values() if dict_space else [observation_space]
    obs_size = sum(math.prod(space.shape) for space in spaces)
    obs_bytes = sum(math.prod(space.shape) * space.dtype.itemsize for space in spaces)
    episodes = max(args.buffer_size // HIGH_HORIZON, 1)
    host = {"the episode buffer (--buffer-size)":
            episodes * ((HIGH_HORIZON + 1) * obs_bytes + HIGH_HORIZON * (8 + 4 * skill_dim)) if sac else 0}
    on_device = {"the networks (--hidden-dim)": 4 * args.hidden_dim**2 * (3 * 4 + 2 if sac else 2 * 4),
                 "one batch (--batch-size)": 4 * args.batch_size * (2 * obs_size + 8 * args.hidden_dim)}
    places = {"GPU": on_device, "host": host} if device.type == "cuda" else {"host": {**host, **on_device}}
    for place, parts in places.items():
        free = free_memory(device if place == "GPU" else torch.device("cpu"))
        if sum(parts.values()) > free:
            error(f"this run needs at least {sum(parts.values()) / 2**30:,.1f} GiB of {place} memory: "
                  + ", ".join(f"{name} {size / 2**30:,.1f}" for name, size in parts.items())
                  + f"; {free / 2**30:,.1f} GiB is free")


def adam_options(args, algo, device):
    """Eager: torch's default Adam. SAC with --compile: foreach Adam, which torch.compile traces and fuses; with
    --cudagraphs alone: fused Adam, one kernel per optimizer step. Under a CUDA graph, capturable (the step counts on
    the GPU, so that each replay advances them)."""
    graphs, fused = algo == "sac" and args.cudagraphs, algo == "sac" and args.cudagraphs and not args.compile
    return {"lr": args.lr, "fused": fused or None, "foreach": True if algo == "sac" and args.compile else None,
            "capturable": graphs and device.type == "cuda"}


def fast_path(update, args, algo, device):
    """SAC's gradient step as --compile and --cudagraphs ask for it: torch.compile'd as one function, and on a GPU
    replayed as one CUDA graph. On a CPU, --compile keeps eager's random draws, so that only the float rounding
    differs; on a GPU, inductor's own. PPO's steps stay eager."""
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
    elif args.cudagraphs:
        update = CudaGraphStep(update)
    return update


class CudaGraphStep:
    """A gradient step `step(batch) -> stats` replayed as one CUDA graph (--cudagraphs).

    The first WARMUP calls run the step as it is, on a side stream as capture requires (they are real steps; they
    also compile it under --compile). The next call records the step on a static copy of the batch (a dict of
    tensors, or of dicts of tensors for pixels + goal), and from then on every call copies its batch there and
    replays the graph: one launch for all of the step's kernels, the random draws included. The stats are copied
    out of the graph's memory, which the next replay overwrites."""

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
    """Copy a dict of tensors (or of dicts of tensors) into the tensors of `static`, of the same shapes."""
    for key, value in tensors.items():
        if isinstance(value, dict):
            copy_into(static[key], value)
        else:
            static[key].copy_(value)


def use_adam_options(optimizer, options):
    """Give a restored optimizer this run's Adam options (the checkpoint's may differ), with its step counts where
    they must be: on the parameters' device for fused or capturable Adam, on the host otherwise."""
    for group in optimizer.param_groups:
        group.update({key: value for key, value in options.items() if key != "lr"})
        for param in group["params"]:
            if "step" in optimizer.state.get(param, {}):
                device = param.device if group["fused"] or group["capturable"] else "cpu"
                optimizer.state[param]["step"] = optimizer.state[param]["step"].to(device, torch.float32)


# ---------------------------------------------------------------- checkpoints
# The stats of each algorithm in update's order: how a checkpoint written before the stats had names lists them.
STAT_NAMES = {"sac": ("qf_loss", "actor_loss", "alpha_loss", "alpha", "q"),
              "ppo": ("policy_loss", "value_loss", "entropy")}


def restore_checkpoint(ckpt, args, run_dir, modules, log_alpha, rb, rng, vector_envs, device):
    """Put a checkpoint's state back: every network and optimizer, SAC's log α and replay buffer, every RNG stream
    and the envs'. Drops the evaluations logged after it (the run redoes them). Returns (epoch, gradient steps, wall
    time, the window since the last evaluation, the evaluations' returns so far). The state of another version of
    this script ends the run with one line."""
    try:
        for name, module in modules.items():
            module.load_state_dict(ckpt[name])
            if isinstance(module, torch.optim.Optimizer):
                use_adam_options(module, adam_options(args, envs.TASKS[args.task].algo, device))
        if log_alpha is not None:
            with torch.no_grad():
                log_alpha.copy_(ckpt["log_alpha"])
            rb.load_state_dict(ckpt["buffer"])
        epoch, grad_steps, wall_time, eval_returns = (ckpt["epoch"], ckpt["grad_steps"], ckpt["wall_time"],
                                                      ckpt["eval_returns"])
        torch.set_rng_state(ckpt["torch_rng"])
        if device.type == "cuda" and ckpt["cuda_rng"] is not None:
            restore_cuda_rng(ckpt["cuda_rng"])
        rng.bit_generator.state = ckpt["numpy_rng"]
        env_rngs = ckpt["env_rngs"]
        for vector_env in vector_envs:  # the training envs' states, then the evaluation envs'
            envs.set_env_rng_states(vector_env, env_rngs[:vector_env.num_envs])
            env_rngs = env_rngs[vector_env.num_envs:]
        window = ckpt["since_eval"]  # its start was saved as seconds before the checkpoint
        stats = window["stats"]
        if stats and torch.is_tensor(stats[0]):  # written before the stats had names: vectors in update's order
            stats = [dict(zip(STAT_NAMES[envs.TASKS[args.task].algo], means)) for means in stats]
        since_eval = {**window, "stats": [{name: value.to(device) for name, value in means.items()} for means in stats],
                      "start": time.time() - window["start"]}
    except (KeyError, RuntimeError, ValueError) as e:  # the state of another version of this script
        error(f"{args.resume} was written by another version of hierarchical.py ({' '.join(str(e).split())[:160]})")
    # evaluations logged after this checkpoint (the run stopped before writing its next one) are done again
    truncate_log(os.path.join(run_dir, "eval.jsonl"), epoch)
    steps_per_epoch = args.num_envs * SKILL_STEPS * HIGH_HORIZON
    print(f"resumed {ckpt['run_name']} at epoch {epoch} ({epoch * steps_per_epoch:,} env steps)")
    return epoch, grad_steps, wall_time, since_eval, eval_returns


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


def save_checkpoint(path, args, run_name, child_ckpt, epoch, grad_steps, wall_time, eval_returns, since_eval, modules,
                    log_alpha, rb, rng, vector_envs, device):
    """Write everything a resumed run needs to go on exactly as this one would, atomically: a crash, a kill or a full
    disk mid-write leaves the previous checkpoint intact. It names the child and the SHA-256 of its actor, which a
    resumed run checks. A network or optimizer holding NaN or inf is never saved as good: the run ends with one line
    instead."""
    state = {"agent": "hierarchical", "args": asdict(args), "child_agent": child_ckpt["agent"],
             "child_actor_sha256": actor_digest(child_ckpt), "run_name": run_name, "epoch": epoch,
             "grad_steps": grad_steps, "wall_time": wall_time, "eval_returns": eval_returns,
             "torch_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
             "numpy_rng": rng.bit_generator.state,
             "env_rngs": [state for vector_env in vector_envs for state in envs.env_rng_states(vector_env)],
             "since_eval": {**since_eval, "start": time.time() - since_eval["start"]},
             **({"log_alpha": log_alpha.detach().cpu(), "buffer": rb.state_dict()} if log_alpha is not None else {}),
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


# ---------------------------------------------------------------- evaluation
def evaluate(epoch, grad_steps, wall_time, stats, eval_returns, args, child_ckpt, policy, child, eval_envs, device,
             run_dir, writer):
    """Deterministic high-level episodes → their mean return (appended to `eval_returns`), the mean of the last 10
    evaluations after epoch 0 (None at epoch 0), a plot, and one line of eval.jsonl with `stats` (the means since
    the previous evaluation)."""
    episodes = run_episodes(eval_envs, policy, child, skill_kind(child_ckpt), child_ckpt["args"]["skill_dim"],
                            envs.TASKS[args.task].extra_dims, device, deterministic=True)
    returns = episodes["reward"].sum(1)
    eval_returns.append(float(returns.mean()))
    env_steps = epoch * args.num_envs * SKILL_STEPS * HIGH_HORIZON
    trained = eval_returns[1:]  # eval_returns[0] is epoch 0's, before any training: never in "past 10"
    result = {"epoch": epoch, "env_steps": env_steps, "grad_steps": grad_steps, "wall_time": round(wall_time, 2),
              "return": eval_returns[-1], "return_past10": float(np.mean(trained[-PAST:])) if trained else None,
              "return_min": float(returns.min()), "return_max": float(returns.max()), **stats,
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    # every file whole or not at all: a full disk or a read-only folder ends the run with one line
    hint = resume_hint(os.path.join(run_dir, "checkpoint.pt"))
    fig = plot_episodes(episodes["coordinates"], episodes["goals"], f"{args.task} over {child_ckpt['agent']} skills, "
                        f"{env_steps:,} env steps, return {result['return']:.1f}")
    write_atomically(os.path.join(run_dir, f"episodes_{env_steps:010d}.png"),
                     lambda temporary: fig.savefig(temporary, dpi=100), hint)
    plt.close(fig)
    for key in ("return", "return_past10"):
        if result[key] is not None:
            writer.add_scalar(f"eval/{key}", result[key], env_steps)
    log_path = os.path.join(run_dir, "eval.jsonl")
    logged = pathlib.Path(log_path).read_text() if os.path.isfile(log_path) else ""
    write_atomically(log_path, lambda temporary: pathlib.Path(temporary).write_text(
        logged + json.dumps(result) + "\n"), hint)
    past = "–" if result["return_past10"] is None else f"{result['return_past10']:.3g}"
    print(f"eval  epoch {epoch} | env steps {env_steps:,} | return {result['return']:.3g} | past 10 {past} | "
          + " | ".join(f"{k} {v:.4g}" for k, v in stats.items()), flush=True)


def plot_episodes(coordinates, goals, title):
    """Low-level trajectories of the evaluation episodes, each goal a star of its episode's colour (x against time
    on HalfCheetah)."""
    colors = plt.cm.hsv(np.linspace(0, 1, len(coordinates), endpoint=False))
    fig, ax = plt.subplots(figsize=(5, 5))
    for i, (xy, color) in enumerate(zip(coordinates, colors)):
        if xy.shape[-1] == 2:
            ax.plot(xy[:, 0], xy[:, 1], color=color, lw=0.8)
            if goals is not None:
                for goal in np.unique(goals[i], axis=0):
                    ax.plot(*goal, marker="*", color=color, ms=8, mec="black", mew=0.4)
        else:
            ax.plot(xy[:, 0], np.arange(len(xy)), color=color, lw=0.8)
            if goals is not None:
                ax.plot(goals[i, -1, 0], len(xy) - 1, marker="*", color=color, ms=8, mec="black", mew=0.4)
    ax.set_xlabel("x")
    ax.set_ylabel("y" if coordinates.shape[-1] == 2 else "env step")
    ax.set_aspect("equal" if coordinates.shape[-1] == 2 else "auto")
    ax.set_title(title, fontsize=9)
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


def record_epoch(window, stats, steps, train_time, writer, env_steps):
    """Add an epoch's `steps` gradient steps to the window (`stats`: each stat's mean over them) and to TensorBoard."""
    window["stats"].append(stats)
    window["grad_steps"] += steps
    window["train_time"] += train_time
    for name, value in floats(stats).items():
        writer.add_scalar(f"losses/{name}" if name.endswith("loss") else f"charts/{name}", value, env_steps)


def log_epoch(writer, epoch, env_steps, steps_this_segment, seconds_this_segment, episode_return, total_env_steps):
    """TensorBoard's training return and speed after each epoch; every 10 epochs, one line with them and the time the
    rest of --total-env-steps takes at this run's speed so far (evaluations included)."""
    sps = int(steps_this_segment / seconds_this_segment)
    writer.add_scalar("charts/episode_return", episode_return, env_steps)
    writer.add_scalar("charts/SPS", sps, env_steps)
    if (epoch + 1) % 10 == 0:
        left = duration((total_env_steps - env_steps) * seconds_this_segment / steps_this_segment)
        print(f"epoch {epoch + 1} | env steps {env_steps:,} | SPS {sps} | {left} left | episode return "
              f"{episode_return:.3g}", flush=True)


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
    sys.exit(f"hierarchical.py: error: {message}")


def resume_hint(checkpoint_path):
    """What a stopped run can be resumed from."""
    if os.path.isfile(checkpoint_path):
        return f"resume with --resume {checkpoint_path}"
    return "no checkpoint was written yet"


def write_atomically(path, write, hint):
    """Write `path` by `write(temporary path)`, then rename it into place: a write that fails (a full disk, a
    read-only folder) leaves the earlier file whole and no temporary behind, and ends the run with one line."""
    root, extension = os.path.splitext(path)
    temporary = f"{root}.tmp{extension}"  # the extension tells savefig the format
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
    parsed = parse_args()  # the args, the child's checkpoint, and this run's checkpoint if it resumes
    try:
        main(*parsed)
    except OSError as e:  # the run's folder or TensorBoard's file cannot be written (read-only, a full disk)
        error(f"cannot write {os.fsdecode(e.filename) if e.filename else 'the TensorBoard log'} ({e.strerror or e})")
