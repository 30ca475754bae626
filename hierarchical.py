"""Hierarchical control over a pretrained agent's frozen skills: "Can a MISL Fly? Analysis and Ingredients
for Mutual Information Skill Learning" (Zheng, Tuyls, Peng and Eysenbach, ICLR 2025), §6.4 and App. B.5.

Every K = 25 env steps a high-level policy π_h(a | s) picks a skill z for the agent's frozen π(· | s, z) (its script's
Actor, as tanh(mean), on the observation without the task's dims). An episode is 8 high-level steps (200 env steps),
the last terminal, each rewarded R = Σ_{t<K} r_t. As in the official garagei/envs/child_policy_env.py, z = a/‖a‖ (CSF,
METRA, VISR), 1.5·a (CIC, DADS) or onehot(a) (DIAYN, one-hot METRA: a categorical π_h). π_h maximizes E[Σ_k γ^k R_k] by
  SAC (AntMultiGoal, QuadrupedGoal, HumanoidGoal): twin Qs on y = R + γ(1 - done)(min_i Q̄_i(s', a') - α log π_h(a'|s'))
    without gradient, π_h on E[α log π_h(a|s) - min_i Q_i(s, a)], α towards the entropy -|A|/2 (one-hot: Q(s, ·)
    over the n skills, expectations under π_h(·|s), entropy +log n); or
  PPO (HalfCheetahGoal, HalfCheetahHurdle): -E[min(ρÂ, clip(ρ, 1 ± ε)Â)] - c E[H(π_h)], ρ = π_h(a|s)/π_old(a|s), Â by
    GAE(λ), V(s) regressed on the discounted returns.
Defaults are official (App. B.5; scripts/hierarchical_control/*.sh) but the budget. eval.jsonl: the mean return of 48
deterministic episodes every 100 epochs (25 on pixels), and "Return (past 10)", of the last 10 after epoch 0.

    python hierarchical.py --checkpoint runs/Ant__csf__1__1700000000 --task AntMultiGoal  # a run folder, or its .pt

Deliberate differences from the official code (github.com/Princeton-RL/contrastive-successor-features):
  - AntMultiGoal draws its whole goal chain every episode, not goals 2-4 once per env (envs.py explains).
  - "Return (past 10)", the mean of the last 10 evaluations (the paper's), never counts epoch 0.
  - a budget: 4M env steps for SAC, 12.8M for PPO, at least 10 evaluations after epoch 0; the official scripts set none.
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
from torch.utils.tensorboard import SummaryWriter

import envs

plt.switch_backend("Agg")
AGENT = "hierarchical"
SKILL_STEPS, HIGH_HORIZON = 25, 8  # env steps per skill, skills per episode
CHILD_AGENTS = ("csf", "metra", "diayn", "visr", "cic", "dads")
Task = Literal["AntMultiGoal", "HalfCheetahGoal", "HalfCheetahHurdle", "QuadrupedGoal", "HumanoidGoal"]
TASK_FLAGS = ("num_envs", "grad_steps_per_epoch", "total_env_steps", "eval_every", "buffer_size")  # unset: the task's


@dataclass
class Args:
    checkpoint: str = ""  # The child: an agent's checkpoint.pt, or its run folder (its newest checkpoint).
    task: Task = "AntMultiGoal"  # The task: SAC learns AntMultiGoal, QuadrupedGoal, HumanoidGoal; PPO the others.
    seed: int = 1  # Seed of torch, numpy and the envs (on a CPU, one run per seed).
    total_env_steps: Optional[int] = None  # Env steps to train for (unset: 4M for SAC, 12.8M for PPO).
    num_envs: Optional[int] = None  # Episodes (200 env steps) per epoch (unset: 8 for SAC, 64 for PPO).
    grad_steps_per_epoch: Optional[int] = None  # Gradient steps after each collection (unset: 50 SAC, 10 PPO).
    learning_starts: int = 10_000  # SAC: transitions stored before the first gradient step.
    batch_size: int = 256  # Transitions per minibatch, drawn with replacement.
    buffer_size: Optional[int] = None  # SAC: replay capacity in high-level transitions (unset: 1M; pixels 300k).
    hidden_dim: int = 1024  # Width of the hidden layers of π_h, Q and V.
    eval_every: Optional[int] = None  # Epochs between evaluations, and the last (unset: 100; pixels 25).
    checkpoint_every: Optional[int] = None  # Epochs between checkpoints, and the last (unset: --eval-every's).
    num_eval_episodes: int = 48  # Deterministic high-level episodes per evaluation.
    resume: Optional[str] = None  # A checkpoint.pt to continue, in its run's folder, with its flags.
    cuda: bool = True  # Use the GPU when torch sees one.
    parallel_envs: bool = True  # Step the envs in worker processes (same numbers).
    compile: bool = False  # SAC: compile the gradient step with torch.compile.
    cudagraphs: bool = False  # SAC, on a GPU: replay the gradient step as a CUDA graph.
    track: bool = False  # Also log to Weights & Biases (WANDB_MODE=offline works).
    wandb_project_name: str = "cleanmisl"  # The W&B project, with --track.
    wandb_entity: Optional[str] = None  # The W&B team, with --track.
    gamma: float = 0.99  # Discount per high-level step.
    lr: float = 1e-4  # Adam learning rate of π_h, Q, V and log α.
    tau: float = 0.005  # SAC: Polyak step of the target Qs.
    alpha_init: float = 0.1  # SAC: initial α, tuned towards the entropy -|A|/2 (one-hot: +log n, n skills).
    clip: float = 0.2  # PPO: clip range ε of the probability ratio.
    gae_lambda: float = 0.95  # PPO: λ of the generalized advantage estimate.
    entropy_coef: float = 0.01  # PPO: weight c of the entropy bonus.


# Every numeric flag's valid interval ("[" closed, "(" open); NaN is never inside.
FLAG_RANGES = {flag: interval for interval, flags in {
    "[1, inf)": "total_env_steps num_envs batch_size buffer_size hidden_dim eval_every checkpoint_every "
                "num_eval_episodes", "[0, inf)": "grad_steps_per_epoch learning_starts entropy_coef",
    "(0, inf)": "lr alpha_init clip", "[0, 2147483647]": "seed", "[0, 1)": "gamma", "(0, 1]": "tau",
    "[0, 1]": "gae_lambda"}.items() for flag in flags.split()}
# What --resume may change: not the problem learned (the device may change the draws).
RESUME_MAY_CHANGE = ("total_env_steps", "eval_every", "checkpoint_every", "resume", "cuda", "parallel_envs", "track",
                     "wandb_project_name", "wandb_entity", "compile", "cudagraphs")


def soft_value(policy, qf, obs, alpha, discrete):
    """min_i Q_i(s, a) - α log π_h(a|s), a ~ π_h(·|s) (one-hot: its expectation under π_h(·|s)), and log π_h (or -H)."""
    if discrete:
        dist = policy.dist(obs)
        log_pi = dist.logits.log_softmax(-1)
        q = torch.stack([net(obs) for net in qf]).amin(0)
        return (dist.probs * (q - alpha * log_pi)).sum(-1), (dist.probs * log_pi).sum(-1)
    action, log_prob, _ = policy.sample(obs)
    return torch.stack([net(obs, action) for net in qf]).amin(0) - alpha * log_prob, log_prob


def critic_loss(qf, qf_target, policy, batch, alpha, gamma, discrete):
    """SAC's L(Q) = Σ_i ½ E[(Q_i(s, a) - y)²], y as in the header (iod/sac.py); returns it and Q_1(s, a)."""
    with torch.no_grad():
        next_value = soft_value(policy, qf_target, batch["next_obs"], alpha, discrete)[0]
        target = batch["reward"] + gamma * (1 - batch["done"]) * next_value
    obs, action = batch["obs"], batch["action"]
    q = [net(obs).gather(-1, action[:, None]).squeeze(-1) if discrete else net(obs, action) for net in qf]
    return sum(0.5 * F.mse_loss(value, target) for value in q), q[0]


def gae(rewards, values, gamma, lam):  # advantages of (N, T) episodes (V = 0 after T), discounted returns
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


def skill_kind(child_ckpt):  # "one-hot" (DIAYN, one-hot METRA), "scaled" (CIC, DADS) or "sphere"
    if child_ckpt["agent"] == "diayn" or child_ckpt["args"].get("discrete"):
        return "one-hot"
    return "scaled" if child_ckpt["agent"] in ("cic", "dads") else "sphere"


def action_to_skill(action, kind, skill_dim):  # z = onehot(a) (a: the index), 1.5·a, or a/‖a‖
    if kind == "one-hot":
        return F.one_hot(action.long(), skill_dim).float()
    return 1.5 * action if kind == "scaled" else F.normalize(action, dim=-1)


def mlp(in_dim, hidden_dim, out_dim, activation, init):  # run/train.py's, zero biases
    net = nn.Sequential(nn.Linear(in_dim, hidden_dim), activation(), nn.Linear(hidden_dim, hidden_dim),
                        activation(), nn.Linear(hidden_dim, out_dim))
    for layer in net[::2]:
        init(layer.weight)
        nn.init.zeros_(layer.bias)
    return net


class GaussianPolicy(nn.Module):  # π_h(a | s): a tanh-squashed Gaussian, tanh trunk, heads 10x smaller
    def __init__(self, space, action_dim, hidden_dim):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        self.trunk = mlp(features, hidden_dim, hidden_dim, nn.Tanh, nn.init.xavier_uniform_)[:-1]
        self.mean, self.log_std = nn.Linear(hidden_dim, action_dim), nn.Linear(hidden_dim, action_dim)
        for head in (self.mean, self.log_std):
            nn.init.xavier_normal_(head.weight)
            head.weight.data.mul_(0.1)
            nn.init.zeros_(head.bias)

    def dist(self, obs):  # the pre-tanh Gaussian
        h = self.trunk(self.encoder(obs))
        log_std = self.log_std(h).clamp(math.log(1e-6), 2.0)
        return torch.distributions.Normal(self.mean(h), log_std.exp(), validate_args=False)

    @staticmethod
    def squash(normal, u):  # a = tanh(u) and log π(a|s)
        action = torch.tanh(u)
        return action, normal.log_prob(u).sum(-1) - torch.log((1 - action.pow(2)).clamp(0, 1) + 1e-6).sum(-1)

    def sample(self, obs, deterministic=False):  # a, log π(a|s), u (reparameterized, or the mean)
        normal = self.dist(obs)
        u = normal.mean if deterministic else normal.rsample()
        return (*self.squash(normal, u), u)


class CategoricalPolicy(nn.Module):  # π_h(k | s) over the n one-hot skills, tanh trunk
    def __init__(self, space, num_skills, hidden_dim):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        self.net = mlp(features, hidden_dim, num_skills, nn.Tanh, nn.init.xavier_uniform_)

    def dist(self, obs):
        return torch.distributions.Categorical(logits=self.net(self.encoder(obs)), validate_args=False)

    def sample(self, obs, deterministic=False):  # k drawn (or the likeliest), log π(k|s), k
        dist = self.dist(obs)
        k = dist.probs.argmax(-1) if deterministic else dist.sample()
        return k, dist.log_prob(k), k


class QNetwork(nn.Module):  # Q(s, a) ∈ R, Q(s, ·) ∈ R^n (one-hot), or V(s) (action_dim 0); ReLU
    def __init__(self, space, action_dim, hidden_dim, num_actions=1):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        self.net = mlp(features + action_dim, hidden_dim, num_actions, nn.ReLU, nn.init.xavier_normal_)

    def forward(self, obs, action=None):
        features = self.encoder(obs)
        out = self.net(features if action is None else torch.cat([features, action], -1))
        return out.squeeze(-1) if out.shape[-1] == 1 else out


def optimize(optimizer, loss):  # a gradient flows through the other networks, not into them
    optimizer.zero_grad()
    loss.backward(inputs=optimizer.param_groups[0]["params"])
    optimizer.step()


def as_tensor(array, device):  # an array (or dict of them) on `device`; pinned, not waiting
    if isinstance(array, dict):
        return {key: as_tensor(value, device) for key, value in array.items()}
    tensor = torch.as_tensor(array)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor


class EpisodeBuffer:  # a ring of whole episodes; (s, a, R, s', done) drawn with replacement
    def __init__(self, capacity, space, skill_dim, discrete, rng):
        self.dict_obs, self.rng, self.pos, self.num_stored = isinstance(space, gym.spaces.Dict), rng, 0, 0
        n, spaces = max(capacity // HIGH_HORIZON, 1), space.spaces if self.dict_obs else {"obs": space}
        self.obs = {key: np.zeros((n, HIGH_HORIZON + 1, *s.shape), s.dtype) for key, s in spaces.items()}
        shape, dtype = ((n, HIGH_HORIZON), np.int64) if discrete else ((n, HIGH_HORIZON, skill_dim), np.float32)
        self.actions, self.rewards = np.zeros(shape, dtype), np.zeros((n, HIGH_HORIZON), np.float32)

    def add(self, episodes):  # run_episodes' obs {key: (E, T + 1, ...)}, action, reward
        n, capacity = len(episodes["reward"]), len(self.rewards)
        idx = (self.pos + np.arange(n)) % capacity
        for key, value in episodes["obs"].items():
            self.obs[key][idx] = value
        self.actions[idx], self.rewards[idx] = episodes["action"], episodes["reward"]
        self.pos, self.num_stored = (self.pos + n) % capacity, min(self.num_stored + n, capacity)

    def sample(self, batch_size, device):  # done at an episode's last step
        episode, t = np.divmod(self.rng.integers(0, self.num_stored * HIGH_HORIZON, batch_size), HIGH_HORIZON)
        obs, next_obs = ({k: v[episode, step] for k, v in self.obs.items()} if self.dict_obs
                         else self.obs["obs"][episode, step] for step in (t, t + 1))
        return as_tensor({"obs": obs, "action": self.actions[episode, t], "next_obs": next_obs,
                          "reward": self.rewards[episode, t], "done": (t == HIGH_HORIZON - 1).astype(np.float32)},
                         device)

    def state_dict(self):
        n = self.num_stored
        return {"pos": self.pos, "num_stored": n, "obs": {k: torch.from_numpy(v[:n]) for k, v in self.obs.items()},
                "actions": torch.from_numpy(self.actions[:n]), "rewards": torch.from_numpy(self.rewards[:n])}

    def load_state_dict(self, state):
        self.pos, self.num_stored, n = state["pos"], state["num_stored"], state["num_stored"]
        for key, value in state["obs"].items():
            self.obs[key][:n] = value
        self.actions[:n], self.rewards[:n] = state["actions"], state["rewards"]


@torch.no_grad()
def run_episodes(vec_env, policy, child, kind, skill_dim, task, device, deterministic=False):
    """One high-level episode per env: π_h's skill (sampled, or its mode) run by the child 25 steps at a time."""
    obs, info = vec_env.reset()
    observations, steps, coordinates, goals = [obs], [], [info["coordinates"]], [info.get("goal")]
    for step in range(HIGH_HORIZON):
        action, log_prob, raw = policy.sample(as_tensor(obs, device), deterministic)
        skill, reward = action_to_skill(action, kind, skill_dim), np.zeros(vec_env.num_envs)
        for t in range(SKILL_STEPS):
            low_action = child.mode(as_tensor(envs.skill_view(task, obs), device), skill).cpu().numpy()
            if not np.isfinite(low_action).all():  # the envs refuse NaN and inf
                error("the child's action is not finite: the high-level policy's networks diverged")
            obs, r, terminated, truncated, info = vec_env.step(low_action)
            last = step == HIGH_HORIZON - 1 and t == SKILL_STEPS - 1  # the task's time limit
            assert not terminated.any() and (truncated == last).all()
            reward += r
            coordinates.append(info["coordinates"])
            goals.append(info.get("goal"))
        observations.append(obs)
        steps.append((action.cpu().numpy(), log_prob.cpu().numpy(), raw.cpu().numpy(), reward.astype(np.float32)))
    action, log_prob, raw, reward = (np.stack(values, 1) for values in zip(*steps))
    return {"obs": {k: np.stack([o[k] for o in observations], 1) for k in obs} if isinstance(obs, dict) else {
            "obs": np.stack(observations, 1)}, "action": action, "log_prob": log_prob, "raw": raw, "reward": reward,
            "coordinates": np.stack(coordinates, 1), "goals": [] if goals[0] is None else np.stack(goals, 1)}


def main(args, child_ckpt, ckpt=None):
    """Epoch by epoch: evaluate, checkpoint, collect an episode per env over the frozen child, learn (SAC or PPO)."""
    sac = envs.TASKS[args.task].algo == "sac"
    steps_per_epoch = args.num_envs * SKILL_STEPS * HIGH_HORIZON
    num_epochs = args.total_env_steps // steps_per_epoch
    run_name, run_dir, writer = start_run(args, child_ckpt, ckpt)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)  # replay and minibatch draws
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    torch.set_float32_matmul_precision("high" if device.type == "cuda" else "highest")  # TF32 on a GPU
    try:  # a world that cannot render, or too many envs
        train_envs, eval_envs = envs.make_envs(functools.partial(envs.make_task, args.task), args.num_envs,
                                               args.num_eval_episodes, args.seed, 0, args.parallel_envs)
    except (envs.RenderUnavailable, MemoryError) as e:
        error(e)
    space = train_envs.single_observation_space  # state (or pixels) + the task's dims
    child = frozen_child(args, child_ckpt, train_envs, device)
    kind, skill_dim = skill_kind(child_ckpt), child_ckpt["args"]["skill_dim"]
    discrete = kind == "one-hot"  # a categorical π_h over the n skills
    check_memory(args, space, skill_dim, sac, device)
    policy = (CategoricalPolicy if discrete else GaussianPolicy)(space, skill_dim, args.hidden_dim).to(device)
    adam = {"lr": args.lr, "fused": (sac and args.cudagraphs and not args.compile) or None,  # SAC's fast path
            "foreach": (sac and args.compile) or None, "capturable": sac and args.cudagraphs and device.type == "cuda"}
    policy_optimizer = torch.optim.Adam(policy.parameters(), **adam)
    modules = {"policy": policy, "policy_optimizer": policy_optimizer}  # the checkpoint's keys
    if sac:
        q_args = (space, 0, args.hidden_dim, skill_dim) if discrete else (space, skill_dim, args.hidden_dim)
        qf = [QNetwork(*q_args).to(device) for _ in range(2)]  # twins, one optimizer on their loss sum
        qf_target = [QNetwork(*q_args).to(device) for _ in qf]
        for net, target in zip(qf, qf_target):
            target.load_state_dict(net.state_dict())
        qf_params, qf_target_params = ([p for net in nets for p in net.parameters()] for nets in (qf, qf_target))
        log_alpha = torch.tensor(math.log(args.alpha_init), device=device, requires_grad=True)
        qf_optimizer, alpha_optimizer = (torch.optim.Adam(params, **adam) for params in (qf_params, [log_alpha]))
        target_entropy = math.log(skill_dim) if discrete else -skill_dim / 2  # the official targets
        rb = EpisodeBuffer(args.buffer_size, space, skill_dim, discrete, rng)
        modules |= {"qf1": qf[0], "qf2": qf[1], "qf1_target": qf_target[0], "qf2_target": qf_target[1], "buffer": rb,
                    "qf_optimizer": qf_optimizer, "alpha_optimizer": alpha_optimizer, "log_alpha": log_alpha}
    else:
        value = QNetwork(space, 0, args.hidden_dim).to(device)  # V(s)
        value_optimizer = torch.optim.Adam(value.parameters(), **adam)
        modules |= {"value": value, "value_optimizer": value_optimizer}
    start_epoch, grad_steps, wall_time, since_eval, eval_returns = restore_checkpoint(
        ckpt, args, modules, adam, rng, (train_envs, eval_envs), device) if ckpt else (0, 0, 0.0, new_window(), [])
    collect = functools.partial(run_episodes, policy=policy, child=child, kind=kind, skill_dim=skill_dim,
                                task=args.task, device=device)

    def sac_update(batch):
        """iod/sac.py: the twin Qs on y, π_h on min_i Q_i + α H(π_h), α towards H̄, then Q̄; stats on the device."""
        alpha = log_alpha.exp().detach()
        qf_loss, q = critic_loss(qf, qf_target, policy, batch, alpha, args.gamma, discrete)
        optimize(qf_optimizer, qf_loss)
        soft_q, log_prob = soft_value(policy, qf, batch["obs"], alpha, discrete)
        actor_loss = -soft_q.mean()
        optimize(policy_optimizer, actor_loss)
        alpha_loss = -(log_alpha * (log_prob.detach() + target_entropy)).mean()  # L(α) = -E[log α (log π_h + H̄)]
        optimize(alpha_optimizer, alpha_loss)
        with torch.no_grad():  # Q̄ ← (1 - τ) Q̄ + τ Q
            torch._foreach_lerp_(qf_target_params, qf_params, args.tau)
        return {"qf_loss": qf_loss.detach(), "actor_loss": actor_loss.detach(), "alpha_loss": alpha_loss.detach(),
                "alpha": alpha, "q": q.mean().detach()}
    if not sac and (args.compile or args.cudagraphs):
        print("--compile and --cudagraphs speed up SAC alone; this PPO task runs without them", flush=True)
    elif args.cudagraphs and device.type != "cuda":
        print("--cudagraphs: CUDA graphs need a GPU; on the CPU the gradient step runs without them", flush=True)
    if sac and args.compile:  # on a CPU, with eager's random draws
        torch._inductor.config.fallback_random = device.type == "cpu"
        sac_update = torch.compile(sac_update)
    if sac and args.cudagraphs and device.type == "cuda":
        sac_update = CudaGraphStep(sac_update)

    def ppo_update(episodes):
        """iod/ppo.py: GAE on the episodes, then per minibatch a step of π_h on the clipped surrogate and one of V."""
        states = as_tensor(episodes["obs"]["obs"][:, :-1], device).flatten(0, 1)  # PPO's tasks have no pixels
        rewards, raws, old_log_probs = (as_tensor(episodes[key], device) for key in ("reward", "raw", "log_prob"))
        raws, old_log_probs = raws.flatten(0, 1), old_log_probs.flatten()  # raws: skill indices, or pre-tanh actions
        with torch.no_grad():
            values = value(states).reshape(rewards.shape)
        advantages, returns = (x.flatten() for x in gae(rewards, values, args.gamma, args.gae_lambda))
        step_stats = []
        for _ in range(args.grad_steps_per_epoch):
            i = as_tensor(rng.integers(0, len(returns), args.batch_size), device)
            obs = states[i]
            dist = policy.dist(obs)  # tanh's correction cancels in ρ; the bonus: the pre-tanh entropy
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
        # evaluate and checkpoint what the previous epochs produced
        if (epoch % args.eval_every == 0 or epoch == num_epochs) and not (ckpt and epoch == start_epoch):
            evaluate(epoch, grad_steps, wall_time + time.time() - segment_start, since_eval, eval_returns, args,
                     child_ckpt, lambda: collect(eval_envs, deterministic=True), run_dir, writer)
            since_eval = new_window()
        if epoch == num_epochs or (epoch % args.checkpoint_every == 0 and epoch != start_epoch):
            save_checkpoint(run_dir, args, run_name, child_ckpt, epoch, grad_steps, wall_time + time.time()
                            - segment_start, eval_returns, since_eval, modules, rng, (train_envs, eval_envs), device)
        if epoch == num_epochs:
            break
        episodes = collect(train_envs)  # stochastic π_h; PPO learns from them, SAC from replay
        since_eval["env_steps"] += steps_per_epoch
        train_start, step_stats = time.time(), []
        if sac:
            rb.add(episodes)
            if rb.num_stored * HIGH_HORIZON >= args.learning_starts:
                step_stats = [sac_update(rb.sample(args.batch_size, device)) for _ in range(args.grad_steps_per_epoch)]
        else:
            step_stats = ppo_update(episodes)
        grad_steps += len(step_stats)
        log_epoch(args, writer, epoch, grad_steps, step_stats, time.time() - train_start, since_eval,
                  (epoch + 1 - start_epoch) * steps_per_epoch / (time.time() - segment_start),
                  float(episodes["reward"].sum(1).mean()))  # one line at a NaN or inf loss

    for opened in (train_envs, eval_envs, writer):
        opened.close()
    if args.track:
        import wandb
        wandb.finish()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as before the run
    print(f"done: {run_dir}")


# INFRASTRUCTURE: command line, the child, CUDA graphs, checkpoints, evaluation, logs
def parse_args(argv=None):  # the flags (unset: the task's; --resume: the run's), the child, the checkpoint
    args, ckpt = tyro.cli(Args, args=argv), None
    if args.resume:
        ckpt = load_file(args.resume)[1]
        if ckpt["agent"] != AGENT:
            error(f"{args.resume} is a {ckpt['agent']} checkpoint, not a {AGENT} one")
        if set(ckpt["args"]) - {f.name for f in fields(Args)}:
            error(f"{args.resume} was written by another version of {AGENT}.py")
        args = tyro.cli(Args, args=argv, default=Args(**ckpt["args"]))
        for flag, trained in ckpt["args"].items():
            if flag not in RESUME_MAY_CHANGE and getattr(args, flag) != trained:
                error(f"{args.resume} was trained with --{flag.replace('_', '-')} {trained}, not {getattr(args, flag)}")
    task = envs.TASKS[args.task]
    sac = task.algo == "sac"
    for flag in TASK_FLAGS:
        if getattr(args, flag) is None:
            setattr(args, flag, getattr(task, flag))
    args.checkpoint_every = args.eval_every if args.checkpoint_every is None else args.checkpoint_every
    for flag, interval in FLAG_RANGES.items():  # PPO keeps no replay buffer
        low, high, value = *(float(end) for end in interval[1:-1].split(",")), getattr(args, flag)
        if (sac or flag != "buffer_size") and not ((low <= value if interval[0] == "[" else low < value) and (
                value <= high if interval[-1] == "]" else value < high)):  # both False for NaN
            error(f"--{flag.replace('_', '-')} must be in {interval}, got {value}")
    epoch, per_epoch = args.num_envs * SKILL_STEPS * HIGH_HORIZON, args.num_envs * HIGH_HORIZON  # steps, transitions
    stored = min(args.total_env_steps // epoch * per_epoch, args.buffer_size) // HIGH_HORIZON * HIGH_HORIZON
    if args.total_env_steps < epoch:
        error(f"--total-env-steps must cover one epoch ({epoch} env steps), got {args.total_env_steps}")
    if sac and args.buffer_size < per_epoch:
        error(f"--buffer-size must hold one epoch ({per_epoch} transitions), got {args.buffer_size}")
    if sac and args.grad_steps_per_epoch and args.learning_starts > stored:
        error(f"--learning-starts must be at most the {stored} transitions --total-env-steps and --buffer-size store, "
              f"got {args.learning_starts}")
    if ckpt and args.total_env_steps // epoch <= ckpt["epoch"]:
        error(f"{args.resume} has already trained for {ckpt['epoch'] * epoch} env steps; give a larger "
              "--total-env-steps to continue it")
    args.checkpoint, child = load_file(args.checkpoint, args.task)
    if ckpt and ckpt.get("child_actor_sha256", child["actor_sha256"]) != child["actor_sha256"]:
        error(f"{args.checkpoint} is not the child {args.resume} was trained over: its actor's weights changed "
              "(another checkpoint, or its run went on); give that run's checkpoint as it was")
    return args, child, ckpt


def load_file(path, task=None):  # (path, checkpoint); with `task`, a checked child for it, its actor's SHA-256
    if task and os.path.isdir(path):  # a run folder: its newest .pt
        candidates = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".pt")]
        if not candidates:
            error(f"the run folder {path} holds no checkpoint")
        path = max(candidates, key=os.path.getmtime)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        error(f"{path} is not a readable checkpoint ({type(e).__name__})" if os.path.isfile(path) else
              f"no checkpoint file at {path}" if path else "give the child's --checkpoint (an agent's checkpoint.pt)")
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
    diverged = non_finite(ckpt["actor"])
    if diverged:
        error(f"{path} holds NaN or infinite weights (actor.{diverged[0]}): its run diverged")
    weights = [key.encode() + value.contiguous().numpy().tobytes() for key, value in sorted(ckpt["actor"].items())]
    ckpt["actor_sha256"] = hashlib.sha256(b"".join(weights)).hexdigest()
    return path, ckpt


def frozen_child(args, child_ckpt, vector_env, device):  # π(· | s, z): its script's Actor, frozen
    agent, child_args = child_ckpt["agent"], child_ckpt["args"]
    child = importlib.import_module(agent).Actor(
        envs.skill_view(args.task, vector_env.single_observation_space), vector_env.single_action_space.shape[0],
        child_args["skill_dim"], child_args["hidden_dim"]).to(device)
    try:
        child.load_state_dict(child_ckpt["actor"])
    except RuntimeError as e:  # torch's last line names a tensor
        error(f"{args.checkpoint}'s actor does not fit {agent}.py's network ({str(e).splitlines()[-1].strip()})")
    return child.requires_grad_(False).eval()


def start_run(args, child_ckpt, ckpt):  # the run's folder, Ctrl-C, W&B, TensorBoard, the flags
    agent, algo = f"{AGENT}_{child_ckpt['agent']}", envs.TASKS[args.task].algo
    run_name = ckpt["run_name"] if ckpt else f"{args.task}__{agent}__{args.seed}__{int(time.time())}"
    run_dir = os.path.dirname(os.path.abspath(args.resume)) if ckpt else os.path.join("runs", run_name)
    os.makedirs(run_dir, exist_ok=True)
    signal.signal(signal.SIGINT, lambda *_: error("interrupted", run_dir))  # every write is atomic
    if args.track:
        import wandb
        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, save_code=True, resume="allow", id=run_name)
    # a failed TensorBoard write (in a thread) raises at the next add_scalar
    threading.excepthook = lambda hook: None if issubclass(hook.exc_type, OSError) else threading.__excepthook__(hook)
    writer = SummaryWriter(run_dir)
    table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    resolved = [flag for flag in (*TASK_FLAGS, "checkpoint_every") if algo == "sac" or flag != "buffer_size"]
    flags = ", ".join(f"--{flag.replace('_', '-')} {getattr(args, flag)}" for flag in resolved)
    print(f"{args.task} over {child_ckpt['agent']} skills ({algo.upper()}, {HIGH_HORIZON} × {SKILL_STEPS} steps): "
          f"{flags}" + (" (the run's own)" if ckpt else " (a flag left unset: the task's)"), flush=True)
    return run_name, run_dir, writer


def check_memory(args, space, skill_dim, sac, device):  # refuses what cannot fit, before allocating
    spaces = space.spaces.values() if isinstance(space, gym.spaces.Dict) else [space]
    obs_bytes = sum(math.prod(s.shape) * s.dtype.itemsize for s in spaces)
    episode_bytes = (HIGH_HORIZON + 1) * obs_bytes + HIGH_HORIZON * (8 + 4 * skill_dim)  # lower bounds
    batch_floats = 2 * sum(math.prod(s.shape) for s in spaces) + 8 * args.hidden_dim
    host = {"the episode buffer (--buffer-size)": max(args.buffer_size // HIGH_HORIZON, 1) * episode_bytes * sac}
    on_device = {"the networks (--hidden-dim)": 4 * args.hidden_dim**2 * (3 * 4 + 2 if sac else 2 * 4),
                 "one batch (--batch-size)": 4 * args.batch_size * batch_floats}
    places = {"GPU": on_device, "host": host} if device.type == "cuda" else {"host": host | on_device}
    for place, parts in places.items():
        free = torch.cuda.mem_get_info(device)[0] if place == "GPU" else envs.free_host_memory()
        if sum(parts.values()) > free:
            error(f"this run needs at least {sum(parts.values()) / 2**30:,.1f} GiB of {place} memory: " + ", ".join(
                f"{name} {size / 2**30:,.1f}" for name, size in parts.items()) + f"; {free / 2**30:,.1f} GiB is free")


class CudaGraphStep:  # 3 warm-up steps, then one recorded as a CUDA graph
    def __init__(self, step):
        self.step, self.calls, self.graph = step, 0, None
        warnings.filterwarnings("ignore", "This instance was constructed with capturable=True")  # in the warm-up

    def __call__(self, batch):
        if self.calls < 3:
            self.calls += 1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                stats = self.step(batch)
            torch.cuda.current_stream().wait_stream(side)
            return stats
        if self.graph is None:
            self.batch, self.graph = batch, torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.stats = self.step(self.batch)
        self.refill(self.batch, batch)
        self.graph.replay()
        return {k: v.clone() for k, v in self.stats.items()}

    def refill(self, static, batch):  # a batch into the recorded one
        for key, value in batch.items():
            self.refill(static[key], value) if isinstance(value, dict) else static[key].copy_(value)


def save_checkpoint(run_dir, args, run_name, child_ckpt, epoch, grad_steps, wall_time, eval_returns, window, modules,
                    rng, vector_envs, device):  # what a resumed run needs to go on as this one would
    state = {name: module.detach().cpu() if torch.is_tensor(module) else module.state_dict()
             for name, module in modules.items()}
    broken = non_finite({name: value for name, value in state.items() if name != "buffer"})
    if broken:  # e.g. Adam's moments overflowed
        error(f"{broken[0]} holds NaN or inf at epoch {epoch} ({len(broken)} tensors do): the run diverged", run_dir)
    state |= {"agent": AGENT, "args": asdict(args), "child_agent": child_ckpt["agent"], "run_name": run_name,
              "child_actor_sha256": child_ckpt["actor_sha256"], "epoch": epoch, "grad_steps": grad_steps,
              "wall_time": wall_time, "eval_returns": eval_returns, "torch_rng": torch.get_rng_state(),
              "numpy_rng": rng.bit_generator.state, "since_eval": {**window, "start": time.time() - window["start"]},
              "cuda_rng": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
              "env_rngs": [rng_state for vector in vector_envs for rng_state in envs.env_rng_states(vector)]}
    write_atomically(os.path.join(run_dir, "checkpoint.pt"), lambda tmp: torch.save(state, tmp), run_dir)


def non_finite(state, prefix=""):  # the names of NaN or inf tensors in a state dict
    if torch.is_tensor(state):
        return [prefix] if state.is_floating_point() and not torch.isfinite(state).all() else []
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else []
    return [name for key, value in items for name in non_finite(value, f"{prefix}.{key}".lstrip("."))]


def restore_checkpoint(ckpt, args, modules, adam, rng, vector_envs, device):  # another version's: one line
    try:
        for name, module in modules.items():
            if hasattr(module, "param_groups"):  # Adam with this run's options
                ckpt[name]["param_groups"] = [group | adam for group in ckpt[name]["param_groups"]]
            module.data.copy_(ckpt[name]) if torch.is_tensor(module) else module.load_state_dict(ckpt[name])  # log α
        torch.set_rng_state(ckpt["torch_rng"])
        if device.type == "cuda" and ckpt["cuda_rng"] is not None:
            restore_cuda_rng(ckpt["cuda_rng"])
        rng.bit_generator.state = ckpt["numpy_rng"]
        envs.set_env_rng_states(vector_envs[0], ckpt["env_rngs"][:args.num_envs])
        envs.set_env_rng_states(vector_envs[1], ckpt["env_rngs"][args.num_envs:])
        saved = ckpt["since_eval"]  # start: seconds before the checkpoint
        stats = [{k: v.to(device) for k, v in means.items()} for means in saved["stats"]]
        window = {**saved, "stats": stats, "start": time.time() - saved["start"], "resumed_at": ckpt["epoch"]}
    except (KeyError, RuntimeError, ValueError, AttributeError) as e:
        error(f"{args.resume} was written by another version of {AGENT}.py ({' '.join(str(e).split())[:160]})")
    print(f"resumed {ckpt['run_name']} at epoch {ckpt['epoch']}")
    return ckpt["epoch"], ckpt["grad_steps"], ckpt["wall_time"], window, ckpt["eval_returns"]


def restore_cuda_rng(states):  # on maybe fewer GPUs
    for index, state in enumerate(states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(state, index)


def evaluate(epoch, grad_steps, wall_time, window, eval_returns, args, child_ckpt, collect, run_dir, writer):
    """`collect()`'s deterministic episodes: their mean return, "past 10", a plot, a line of eval.jsonl."""
    per_epoch = [torch.stack(list(means.values())) for means in window["stats"]]  # each stat's mean over its epochs
    stats = dict(zip(window["stats"][0], torch.stack(per_epoch).mean(0).tolist())) if per_epoch else {}
    stats |= {"sps": window["env_steps"] / (time.time() - window["start"])} if window["env_steps"] else {}
    stats |= {"ms_per_grad_step": 1000 * window["train_time"] / window["grad_steps"]} if window["grad_steps"] else {}
    episodes = collect()
    returns = episodes["reward"].sum(1)
    eval_returns.append(float(returns.mean()))
    env_steps, trained = epoch * args.num_envs * SKILL_STEPS * HIGH_HORIZON, eval_returns[1:]  # without epoch 0's
    result = {"epoch": epoch, "env_steps": env_steps, "grad_steps": grad_steps, "wall_time": round(wall_time, 2),
              "return": eval_returns[-1], "return_past10": float(np.mean(trained[-10:])) if trained else None,
              "return_min": float(returns.min()), "return_max": float(returns.max()), **stats,
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    fig, ax = plt.subplots(figsize=(5, 5))  # the paths, each episode's goals as stars
    envs.draw_coordinates(ax, episodes["coordinates"], plt.cm.hsv(np.linspace(0, 1, len(returns), endpoint=False)),
                          goals=[np.unique(chain, axis=0) for chain in episodes["goals"]])
    ax.set_title(f"{args.task} over {child_ckpt['agent']}, {env_steps:,} env steps, return {result['return']:.1f}")
    fig.tight_layout()
    write_atomically(f"{run_dir}/episodes_{env_steps:010d}.png", lambda tmp: fig.savefig(tmp, dpi=100), run_dir)
    plt.close(fig)
    for key in ("return", "return_past10"):
        if result[key] is not None:
            writer.add_scalar(f"eval/{key}", result[key], env_steps)
    log_path, kept = pathlib.Path(run_dir, "eval.jsonl"), []  # a resume drops lines after its checkpoint
    lines = [line for line in (log_path.read_text() if log_path.is_file() else "").splitlines() if line.strip()]
    for number, line in enumerate(lines, 1):
        try:
            kept += [line] if json.loads(line)["epoch"] <= window.get("resumed_at", epoch - 1) else []
        except (ValueError, KeyError, TypeError):  # a torn last line: dropped
            if number < len(lines):
                error(f"line {number} of {log_path} is not an evaluation; mend or delete it, then resume")
            print(f"warning: dropped the torn last line of {log_path}", file=sys.stderr)
    text = "\n".join([*kept, json.dumps(result)]) + "\n"
    write_atomically(log_path, lambda tmp: pathlib.Path(tmp).write_text(text), run_dir)
    past = "–" if result["return_past10"] is None else f"{result['return_past10']:.3g}"
    print(f"eval  epoch {epoch} | env steps {env_steps:,} | return {result['return']:.3g} | past 10 {past} | "
          + " | ".join(f"{k} {v:.4g}" for k, v in stats.items()), flush=True)


def new_window():  # since the last evaluation
    return {"stats": [], "train_time": 0.0, "grad_steps": 0, "start": time.time(), "env_steps": 0}


def log_epoch(args, writer, epoch, grad_steps, step_stats, train_time, window, sps, episode_return):
    """A NaN or inf *_loss ends the run; else the means go to the window and TensorBoard; a line every 10 epochs."""
    env_steps = (epoch + 1) * args.num_envs * SKILL_STEPS * HIGH_HORIZON
    if step_stats:
        names = list(step_stats[0])
        per_step = torch.stack([torch.stack(list(stats.values())) for stats in step_stats])  # (steps, stats)
        for step, values in enumerate(per_step.tolist(), grad_steps - len(step_stats) + 1):
            for name, value in zip(names, values):
                if name.endswith("_loss") and not math.isfinite(value):
                    error(f"{name} is {value} at gradient step {step} (epoch {epoch})", writer.log_dir)
        means = per_step.mean(0)
        window["stats"].append(dict(zip(names, means)))
        window["grad_steps"] += len(step_stats)
        window["train_time"] += train_time
        for name, value in zip(names, means.tolist()):
            writer.add_scalar(f"losses/{name}" if name.endswith("loss") else f"charts/{name}", value, env_steps)
    writer.add_scalar("charts/episode_return", episode_return, env_steps)
    writer.add_scalar("charts/SPS", int(sps), env_steps)  # evaluations included
    if (epoch + 1) % 10 == 0:
        seconds = (args.total_env_steps - env_steps) / sps
        m = round(seconds / 60)
        left = f"{seconds:.0f} s" if seconds < 60 else f"{m} min" if m < 60 else f"{m // 60} h {m % 60:02d} min"
        print(f"epoch {epoch + 1} | env steps {env_steps:,} | SPS {int(sps)} | {left} left | episode return "
              f"{episode_return:.3g}", flush=True)


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
    parsed = parse_args()
    try:
        main(*parsed)
    except OSError as e:  # the run's folder or TensorBoard's file
        error(f"cannot write {os.fsdecode(e.filename) if e.filename else 'the TensorBoard log'} ({e.strerror or e})")
