"""Hierarchical control over a pretrained agent's frozen skills: "Can a MISL Fly? Analysis and Ingredients for Mutual
Information Skill Learning" (Zheng, Tuyls, Peng and Eysenbach, ICLR 2025), §6.4 and App. B.5.

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
  - added: the last epoch is always evaluated and checkpointed; a resumed run reports what the uninterrupted one does
    but for the clock's figures (wall_time, sps, ms_per_grad_step, peak_rss_mb).
  - the replay buffer holds whole episodes, each observation once; on a GPU, float32 matmuls use TF32.
"""

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
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.tensorboard import SummaryWriter

import envs

plt.switch_backend("Agg")
AGENT = "hierarchical"
SKILL_STEPS = 25  # K, the env steps of one skill
HIGH_HORIZON = 8  # the skills of one episode
CHILD_AGENTS = ("csf", "metra", "diayn", "visr", "cic", "dads")
TASK_FLAGS = "num_envs grad_steps_per_epoch total_env_steps eval_every buffer_size".split()  # unset: the task's


@dataclass
class Args:
    # The child, required: an agent's checkpoint.pt, or its run folder (then its newest checkpoint).
    checkpoint: str = ""
    # The task, on the child's world: SAC learns AntMultiGoal, QuadrupedGoal, HumanoidGoal; PPO the HalfCheetah ones.
    task: Literal[
        "AntMultiGoal", "HalfCheetahGoal", "HalfCheetahHurdle", "QuadrupedGoal", "HumanoidGoal"
    ] = "AntMultiGoal"
    # The seed of torch, numpy and the envs; on a CPU, one seed gives one run, bit for bit.
    seed: int = 1
    # The env steps to train for; unset, the task's (4M for SAC, 12.8M for PPO).
    total_env_steps: Optional[int] = None
    # The high-level episodes (200 env steps each) collected per epoch; unset, the task's (8 for SAC, 64 for PPO).
    num_envs: Optional[int] = None
    # The gradient steps after each collection; unset, the task's (50 for SAC, 10 for PPO).
    grad_steps_per_epoch: Optional[int] = None
    # SAC: the high-level transitions stored before the first gradient step.
    learning_starts: int = 10_000
    # The transitions per minibatch, drawn with replacement.
    batch_size: int = 256
    # SAC: the replay capacity in high-level transitions, kept as whole episodes; unset, 1M (300k on pixels).
    buffer_size: Optional[int] = None
    # The width of the hidden layers of π_h, Q and V.
    hidden_dim: int = 1024
    # The epochs between evaluations, the last one always evaluated; unset, the task's (100; 25 on pixels).
    eval_every: Optional[int] = None
    # The epochs between checkpoints, the last one always saved; unset, the value of --eval-every.
    checkpoint_every: Optional[int] = None
    # The deterministic high-level episodes per evaluation.
    num_eval_episodes: int = 48
    # A checkpoint.pt to continue, in its run's folder and with its flags; unset, a new run starts.
    resume: Optional[str] = None
    # Whether to train on the GPU when torch sees one.
    cuda: bool = True
    # Whether to step the envs in worker processes (the same numbers).
    parallel_envs: bool = True
    # SAC: whether to compile the gradient step with torch.compile.
    compile: bool = False
    # SAC: whether to replay the gradient step as a CUDA graph, on a GPU.
    cudagraphs: bool = False
    # Whether to also log to Weights & Biases (WANDB_MODE=offline works).
    track: bool = False
    # The W&B project, with --track.
    wandb_project_name: str = "cleanmisl"
    # The W&B team, with --track; unset, your default entity.
    wandb_entity: Optional[str] = None
    # The discount per high-level step.
    gamma: float = 0.99
    # The Adam learning rate of π_h, Q, V and log α.
    lr: float = 1e-4
    # SAC: the Polyak step of the target Qs per gradient step.
    tau: float = 0.005
    # SAC: the initial temperature α, tuned towards the entropy -|A|/2 (one-hot: +log n, n skills).
    alpha_init: float = 0.1
    # PPO: the clip range ε of the probability ratio.
    clip: float = 0.2
    # PPO: the λ of the generalized advantage estimate.
    gae_lambda: float = 0.95
    # PPO: the weight c of the entropy bonus.
    entropy_coef: float = 0.01


def gae(rewards, values, gamma, lam):
    """Â by GAE(λ), and the discounted returns, of (N, T) episodes (V = 0 after the last step), flattened."""
    advantages = torch.zeros_like(rewards)
    returns = torch.zeros_like(rewards)
    next_value = next_advantage = next_return = 0
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * next_advantage
        next_return = rewards[:, t] + gamma * next_return
        advantages[:, t] = next_advantage
        returns[:, t] = next_return
        next_value = values[:, t]
    return advantages.flatten(), returns.flatten()


def ppo_policy_loss(log_prob, old_log_prob, advantages, entropy, clip, entropy_coef):
    """-E[min(ρ Â, clip(ρ, 1 ± ε) Â)] - c E[H], ρ = π(a|s)/π_old(a|s), Â standardized over the minibatch."""
    centered = advantages - advantages.mean()
    advantages = centered / (advantages.std() + 1e-8)
    ratio = (log_prob - old_log_prob).exp()
    clipped = ratio.clamp(1 - clip, 1 + clip) * advantages
    surrogate = torch.min(ratio * advantages, clipped)
    bonus = entropy_coef * entropy.mean()
    return -(surrogate.mean() + bonus)


def skill_kind(child_ckpt):
    """How π_h's action becomes a skill: "one-hot" (DIAYN, one-hot METRA), "scaled" (CIC, DADS) or "sphere"."""
    agent = child_ckpt["agent"]
    if agent == "diayn" or child_ckpt["args"].get("discrete"):
        return "one-hot"
    if agent in ("cic", "dads"):
        return "scaled"
    return "sphere"


def action_to_skill(action, kind, skill_dim):
    """z = onehot(a) (a: the skill's index), 1.5·a, or a/‖a‖."""
    if kind == "one-hot":
        return F.one_hot(action.long(), skill_dim).float()
    if kind == "scaled":
        return 1.5 * action
    return F.normalize(action, dim=-1)


def mlp(in_dim, hidden_dim, out_dim, activation, init):
    """Linear → activation → Linear → activation → Linear, weights from `init`, biases zero (run/train.py's)."""
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


class GaussianPolicy(nn.Module):
    """π_h(a | s): a tanh-squashed Gaussian on a tanh trunk, its heads initialised 10x smaller."""
    def __init__(self, space, action_dim, hidden_dim):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        trunk = mlp(features, hidden_dim, hidden_dim, nn.Tanh, nn.init.xavier_uniform_)
        self.trunk = trunk[:-1]
        self.mean = nn.Linear(hidden_dim, action_dim)
        self.log_std = nn.Linear(hidden_dim, action_dim)
        for head in (self.mean, self.log_std):
            nn.init.xavier_normal_(head.weight)
            head.weight.data.mul_(0.1)
            nn.init.zeros_(head.bias)
        self.target_entropy = -action_dim / 2  # SAC's H̄ = -|A|/2, the official code's

    def dist(self, obs):
        """The Gaussian of u, before the tanh."""
        features = self.encoder(obs)
        h = self.trunk(features)
        mean = self.mean(h)
        log_std = self.log_std(h).clamp(math.log(1e-6), 2.0)
        return torch.distributions.Normal(mean, log_std.exp(), validate_args=False)

    def squash(self, normal, u):
        """a = tanh(u) and its log π_h(a|s)."""
        action = torch.tanh(u)
        correction = (1 - action.pow(2)).clamp(0, 1)
        correction = torch.log(correction + 1e-6)
        log_prob = normal.log_prob(u).sum(-1) - correction.sum(-1)
        return action, log_prob

    def sample(self, obs, deterministic=False):
        """a = tanh(u), log π_h(a|s) and u: u reparameterized, or the mean."""
        normal = self.dist(obs)
        if deterministic:
            u = normal.mean
        else:
            u = normal.rsample()
        action, log_prob = self.squash(normal, u)
        return action, log_prob, u

    def soft_value(self, qf, obs, alpha):
        """min_i Q_i(s, a) - α log π_h(a|s), a ~ π_h(·|s), and log π_h(a|s)."""
        action, log_prob, _ = self.sample(obs)
        q = [net(obs, action) for net in qf]
        q = torch.stack(q).amin(0)
        return q - alpha * log_prob, log_prob

    def log_prob_entropy(self, obs, u):
        """PPO's log π_h(a|s) of a = tanh(u) (tanh's correction cancels in ρ) and the entropy before the tanh."""
        normal = self.dist(obs)
        _, log_prob = self.squash(normal, u)
        entropy = normal.entropy().sum(-1)
        return log_prob, entropy


class QNetwork(nn.Module):
    """Q(s, a) ∈ R, or V(s) ∈ R with action_dim 0: ReLU, Xavier-normal."""
    def __init__(self, space, action_dim, hidden_dim, outputs=1):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        inputs = features + action_dim
        self.net = mlp(inputs, hidden_dim, outputs, nn.ReLU, nn.init.xavier_normal_)

    def forward(self, obs, *action):
        features = self.encoder(obs)
        inputs = torch.cat([features, *action], -1)
        return self.net(inputs).squeeze(-1)


def frozen_child(child_ckpt, task, space, action_space, device):
    """π(a | s, z): the child's script's own Actor with its weights, frozen; it sees `space` without the task's dims."""
    skill_dim = child_ckpt["args"]["skill_dim"]
    hidden_dim = child_ckpt["args"]["hidden_dim"]
    actor = importlib.import_module(child_ckpt["agent"]).Actor
    skill_space = envs.skill_view(task, space)
    action_dim = action_space.shape[0]
    child = actor(skill_space, action_dim, skill_dim, hidden_dim).to(device)
    child.load_state_dict(child_ckpt["actor"])
    return child.requires_grad_(False).eval()


def as_tensor(arrays, device):
    """An array, or a pixel task's dict of them, as tensors on `device` (from the host: pinned, not waiting)."""
    tensors = tree_map(torch.as_tensor, arrays)
    if device.type == "cuda":
        tensors = tree_map(torch.Tensor.pin_memory, tensors)
        tensors = tree_map(lambda t: t.to(device, non_blocking=True), tensors)
    return tensors


@torch.no_grad()
def run_episodes(policy, child, kind, skill_dim, task, device, vec_env,
                 deterministic=False):
    """One high-level episode per env: π_h's skill (sampled, or its mode) run by the child 25 steps at a time. The
    episodes' obs (envs, 9, ...), action, log_prob, raw, reward (envs, 8, ...); lists of each env step's path, goal."""
    obs, info = vec_env.reset()
    observations = [obs]
    steps = []
    coordinates = [info["coordinates"]]
    goals = [info.get("goal")]
    for step in range(HIGH_HORIZON):
        high_obs = as_tensor(obs, device)
        action, log_prob, raw = policy.sample(high_obs, deterministic)
        skill = action_to_skill(action, kind, skill_dim)
        reward = np.zeros(vec_env.num_envs)
        for t in range(SKILL_STEPS):
            child_obs = as_tensor(envs.skill_view(task, obs), device)
            low_action = child.mode(child_obs, skill)
            low_action = low_action.cpu().numpy()
            if not np.isfinite(low_action).all():  # the envs refuse NaN and inf
                error("the child's action is not finite: the high-level policy's networks diverged")
            obs, r, terminated, truncated, info = vec_env.step(low_action)
            last = step == HIGH_HORIZON - 1 and t == SKILL_STEPS - 1  # the task's time limit
            assert not terminated.any()
            assert (truncated == last).all()
            reward += r
            coordinates.append(info["coordinates"])
            goals.append(info.get("goal"))
        observations.append(obs)
        reward = torch.as_tensor(reward, dtype=torch.float32)
        steps.append({
            "action": action,
            "log_prob": log_prob,
            "raw": raw,
            "reward": reward,
        })
    # each array stacked over the steps, after the envs
    episodes = tree_map(lambda *x: torch.stack(x, 1), *steps)
    episodes = tree_map(lambda x: x.cpu().numpy(), episodes)
    episodes["obs"] = tree_map(lambda *x: np.stack(x, 1), *observations)
    return episodes, coordinates, goals


def optimize(optimizer, loss):
    """One gradient step of `optimizer`'s parameters alone (a gradient may flow through other networks)."""
    optimizer.zero_grad()
    loss.backward(inputs=optimizer.param_groups[0]["params"])  # its one group's
    optimizer.step()


def main(args, child_ckpt, ckpt=None):
    """Epoch by epoch: evaluate, checkpoint, collect an episode per env over the frozen child, learn (SAC or PPO)."""
    sac = envs.TASKS[args.task].algo == "sac"
    steps_per_epoch = args.num_envs * SKILL_STEPS * HIGH_HORIZON
    num_epochs = args.total_env_steps // steps_per_epoch
    torch.manual_seed(args.seed)  # the networks and the policy's draws
    rng = np.random.default_rng(args.seed)  # the replay and minibatch draws
    use_gpu = torch.cuda.is_available() and args.cuda
    device = torch.device("cuda" if use_gpu else "cpu")
    torch.set_float32_matmul_precision("high" if use_gpu else "highest")  # TF32 on a GPU
    make_task = functools.partial(envs.make_task, args.task)
    train_envs, eval_envs = envs.make_envs(
        make_task, args.num_envs, args.num_eval_episodes, args.seed, 0, args.parallel_envs)
    space = train_envs.single_observation_space  # the child's observation and the task's dims
    child = frozen_child(child_ckpt, args.task, space, train_envs.single_action_space, device)
    kind = skill_kind(child_ckpt)
    d = child_ckpt["args"]["skill_dim"]  # the skill's dimension, or the n one-hot skills
    policy_network = GaussianPolicy
    q_network = QNetwork
    if kind == "one-hot": policy_network = CategoricalPolicy  # over the n skills (after main)
    if kind == "one-hot": q_network = SkillQNetwork  # Q(s, ·) over them
    policy = policy_network(space, d, args.hidden_dim).to(device)
    fused = sac and args.cudagraphs and not args.compile  # Adam on SAC's fast path (compile fuses foreach)
    capturable = sac and args.cudagraphs and use_gpu  # its state on the GPU
    adam = {"lr": args.lr, "fused": fused, "foreach": not fused, "capturable": capturable}
    policy_optimizer = torch.optim.Adam(policy.parameters(), **adam)
    learned = dict(policy=policy, policy_optimizer=policy_optimizer)  # what a checkpoint saves, by name
    if sac:
        qf = nn.ModuleList([q_network(space, d, args.hidden_dim) for _ in range(2)]).to(device)
        qf_target = nn.ModuleList([q_network(space, d, args.hidden_dim) for _ in qf]).to(device)
        qf_target.load_state_dict(qf.state_dict())
        log_alpha = torch.tensor(math.log(args.alpha_init), device=device, requires_grad=True)
        qf_optimizer = torch.optim.Adam(qf.parameters(), **adam)  # both Qs, on their loss sum
        alpha_optimizer = torch.optim.Adam([log_alpha], **adam)
        rb = EpisodeBuffer(args.buffer_size, rng)
        learned.update(qf=qf, qf_target=qf_target, log_alpha=log_alpha)
        learned.update(qf_optimizer=qf_optimizer, alpha_optimizer=alpha_optimizer, buffer=rb)
    else:
        value = QNetwork(space, 0, args.hidden_dim).to(device)  # V(s)
        value_optimizer = torch.optim.Adam(value.parameters(), **adam)
        learned.update(value=value, value_optimizer=value_optimizer)
    run, progress = start_run(args, ckpt, child_ckpt, learned, rng, train_envs, eval_envs)
    collect = functools.partial(run_episodes, policy, child, kind, d, args.task, device)

    def sac_update(obs, action, reward, next_obs, done):
        """iod/sac.py: the twin Qs on y, π_h on min_i Q_i + α H(π_h), α towards H̄, then Q̄; stats on the device."""
        alpha = log_alpha.exp().detach()
        with torch.no_grad():
            next_value, _ = policy.soft_value(qf_target, next_obs, alpha)
            target = reward + args.gamma * (1 - done) * next_value
        q = [net(obs, action) for net in qf]
        qf_loss = sum(0.5 * F.mse_loss(value, target) for value in q)
        optimize(qf_optimizer, qf_loss)
        soft_q, log_prob = policy.soft_value(qf, obs, alpha)
        actor_loss = -soft_q.mean()
        optimize(policy_optimizer, actor_loss)
        alpha_loss = -(log_alpha * (log_prob.detach() + policy.target_entropy)).mean()  # -E[log α (log π_h + H̄)]
        optimize(alpha_optimizer, alpha_loss)
        with torch.no_grad():  # Q̄ ← (1 - τ) Q̄ + τ Q
            targets = list(qf_target.parameters())
            torch._foreach_lerp_(targets, list(qf.parameters()), args.tau)
        stats = {"qf_loss": qf_loss, "actor_loss": actor_loss,
                 "alpha_loss": alpha_loss, "alpha": alpha,
                 "q": q[0].mean()}
        return {name: value.detach() for name, value in stats.items()}

    def ppo_update(obs, action, log_prob, raw, reward):
        """iod/ppo.py: GAE on the episodes, then per minibatch a step of π_h on the clipped surrogate and one of V."""
        states = obs[:, :-1].flatten(0, 1)  # PPO's tasks have no pixels
        raws = raw.flatten(0, 1)  # skill indices, or the actions before tanh
        old_log_probs = log_prob.flatten()
        with torch.no_grad():
            values = value(states).reshape(reward.shape)
        advantages, returns = gae(reward, values, args.gamma, args.gae_lambda)
        step_stats = []
        for _ in range(args.grad_steps_per_epoch):
            i = as_tensor(rng.integers(0, len(returns), args.batch_size), device)
            new_log_prob, entropy = policy.log_prob_entropy(states[i], raws[i])
            policy_loss = ppo_policy_loss(new_log_prob, old_log_probs[i], advantages[i], entropy,
                                          args.clip, args.entropy_coef)
            optimize(policy_optimizer, policy_loss)
            value_loss = F.mse_loss(value(states[i]), returns[i])
            optimize(value_optimizer, value_loss)
            stats = {"policy_loss": policy_loss, "value_loss": value_loss,
                     "entropy": entropy.mean()}
            step_stats.append({name: value.detach() for name, value in stats.items()})
        return step_stats

    sac_update = fast_path(sac_update, args, device)
    start_epoch = progress["epoch"]
    start_time = time.time()
    for epoch in range(start_epoch, num_epochs + 1):
        epoch_start = time.time()
        progress["epoch"] = epoch
        last = epoch == num_epochs
        # evaluate and checkpoint what the previous epochs made (a resumed run skips both at its first epoch)
        if (epoch % args.eval_every == 0 or last) and not (ckpt and epoch == start_epoch):
            evaluate(run, progress, args, collect)
        if (epoch % args.checkpoint_every == 0 or last) and epoch != start_epoch:
            save_checkpoint(run, progress, args, learned, device)
        if last:
            break
        collect_start = time.time()
        episodes = collect(train_envs)[0]  # the stochastic π_h's: PPO learns from them, SAC from replay
        train_start = time.time()
        step_stats = []
        if sac:
            rb.add(episodes)
        if sac and rb.size >= args.learning_starts:
            for _ in range(args.grad_steps_per_epoch):
                batch = rb.sample(args.batch_size, device)
                step_stats.append(sac_update(**batch))
        if not sac:
            step_stats = ppo_update(**as_tensor(episodes, device))
        progress["grad_steps"] += len(step_stats)
        progress["timing"] = {"sps": steps_per_epoch / (time.time() - collect_start)}  # the last epoch's
        if step_stats:
            train_time = time.time() - train_start
            progress["timing"]["ms_per_grad_step"] = 1000 * train_time / len(step_stats)
        sps = (epoch + 1 - start_epoch) * steps_per_epoch / (time.time() - start_time)  # this run's, so far
        log_epoch(run, progress, args, step_stats, sps, episodes["reward"])  # a NaN loss ends the run here
        progress["wall_time"] += time.time() - epoch_start
    for opened in (train_envs, eval_envs, run.writer):
        opened.close()
    if args.track:
        import wandb
        wandb.finish()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as before the run
    print(f"done: {run.dir}")


# ONE-HOT CHILDREN (DIAYN, one-hot METRA): π_h picks a skill k of n, z = onehot(k); main's one-line ifs swap these in.
class CategoricalPolicy(nn.Module):
    """π_h(k | s) over the n one-hot skills, on a tanh trunk; its action is the skill's index k."""
    def __init__(self, space, num_skills, hidden_dim):
        super().__init__()
        self.encoder, features = envs.make_encoder(space)
        self.net = mlp(features, hidden_dim, num_skills, nn.Tanh, nn.init.xavier_uniform_)
        self.target_entropy = math.log(num_skills)  # SAC's H̄ = +log n, the official code's

    def dist(self, obs):
        return torch.distributions.Categorical(logits=self.net(self.encoder(obs)), validate_args=False)

    def sample(self, obs, deterministic=False):  # k drawn (or the likeliest), log π_h(k|s), k again (PPO's "raw")
        dist = self.dist(obs)
        k = dist.probs.argmax(-1) if deterministic else dist.sample()
        return k, dist.log_prob(k), k

    def soft_value(self, qf, obs, alpha):  # E_k[min_i Q_i(s, k) - α log π_h(k|s)] and E_k[log π_h(k|s)], k ~ π_h(·|s)
        dist = self.dist(obs)
        log_pi = dist.logits.log_softmax(-1)
        q = torch.stack([net(obs) for net in qf]).amin(0)
        return (dist.probs * (q - alpha * log_pi)).sum(-1), (dist.probs * log_pi).sum(-1)

    def log_prob_entropy(self, obs, k):
        dist = self.dist(obs)
        return dist.log_prob(k), dist.entropy()


class SkillQNetwork(QNetwork):
    """Q(s, ·) ∈ R^n over the n skills; given the skills' indices k, Q(s, k)."""
    def __init__(self, space, num_skills, hidden_dim):
        super().__init__(space, 0, hidden_dim, num_skills)

    def forward(self, obs, *k):
        q = super().forward(obs)
        return q.gather(-1, k[0][:, None]).squeeze(-1) if k else q


# INFRASTRUCTURE: the episode buffer, command line, the child, start-up, fast path, checkpoints, evaluation, logs.
class EpisodeBuffer:
    """A ring of whole high-level episodes (each observation once) in numpy arrays, drawn with replacement by `rng`."""
    def __init__(self, capacity, rng):
        self.capacity = max(capacity // HIGH_HORIZON, 1)  # episodes
        self.rng = rng
        self.added = 0  # episodes, ever
        self.size = 0  # transitions stored
        self.ring = None

    def add(self, episodes):  # run_episodes' (or a state_dict's) obs (E, 9, ...), action (E, 8, ...), reward (E, 8)
        new = {key: episodes[key] for key in ("obs", "action", "reward")}
        if self.ring is None:  # zeros shaped as the episodes
            self.ring = tree_map(lambda x: np.zeros((self.capacity, *x.shape[1:]), x.dtype), new)
        slots = np.arange(self.added, self.added + len(new["reward"])) % self.capacity
        for ring, array in zip(tree_leaves(self.ring), tree_leaves(new)):
            ring[slots] = array
        self.added += len(slots)
        self.size = min(self.added, self.capacity) * HIGH_HORIZON

    def sample(self, batch_size, device):  # s, a, R, s', done on `device`; done at an episode's last step
        episode, t = np.divmod(self.rng.integers(0, self.size, batch_size), HIGH_HORIZON)
        batch = tree_map(lambda x: x[episode, t], self.ring)  # obs, action, reward
        batch["next_obs"] = tree_map(lambda x: x[episode, t + 1], self.ring["obs"])
        batch["done"] = (t == HIGH_HORIZON - 1).astype(np.float32)
        return as_tensor(batch, device)

    def state_dict(self):  # the stored episodes alone, as tensors sharing their memory
        stored = min(self.added, self.capacity)
        return {"added": self.added, **tree_map(lambda x: torch.from_numpy(x[:stored]), self.ring)}

    def load_state_dict(self, state):  # the stored episodes, added again in their slots
        self.add(tree_map(np.asarray, state))
        self.added = state["added"]


FLAG_RANGES = {  # every numeric flag's valid interval ("[" closed, "(" open); NaN is never inside
    **dict.fromkeys("total_env_steps num_envs batch_size buffer_size".split(), "[1, inf)"),
    **dict.fromkeys("hidden_dim eval_every checkpoint_every num_eval_episodes".split(), "[1, inf)"),
    **dict.fromkeys("grad_steps_per_epoch learning_starts entropy_coef".split(), "[0, inf)"),
    **dict.fromkeys("lr alpha_init clip".split(), "(0, inf)"),
    "seed": "[0, 2147483647]", "gamma": "[0, 1)", "tau": "(0, 1]", "gae_lambda": "[0, 1]",
}
# flags --resume may change, none changing the problem (the device and --compile change the numbers)
RESUME_MAY_CHANGE = ("total_env_steps eval_every checkpoint_every resume cuda parallel_envs "
                     "compile cudagraphs track wandb_project_name wandb_entity").split()


def parse_args(argv=None):
    """The flags (unset: the task's; --resume: the run's, but RESUME_MAY_CHANGE's) and the child, or one line why."""
    args = tyro.cli(Args, args=argv)
    ckpt = None
    if args.resume:
        ckpt = load_file(args.resume)
        if ckpt["agent"] != AGENT:
            error(f"{args.resume} is a {ckpt['agent']} checkpoint, not a {AGENT} one")
        if set(ckpt["args"]) - {field.name for field in fields(Args)}:
            error(f"{args.resume} was written by another version of {AGENT}.py")
        args = tyro.cli(Args, args=argv, default=Args(**ckpt["args"]))
        for flag, trained in ckpt["args"].items():
            if flag not in RESUME_MAY_CHANGE and getattr(args, flag) != trained:
                error(f"{args.resume} was trained with --{flag.replace('_', '-')} {trained}, not "
                      f"{getattr(args, flag)}")
    sac = envs.TASKS[args.task].algo == "sac"
    for flag in TASK_FLAGS:
        if getattr(args, flag) is None:
            setattr(args, flag, getattr(envs.TASKS[args.task], flag))
    if args.checkpoint_every is None:
        args.checkpoint_every = args.eval_every
    for flag, interval in FLAG_RANGES.items():
        value = getattr(args, flag)
        low, high = interval[1:-1].split(", ")
        above = value >= float(low) if interval[0] == "[" else value > float(low)  # False for NaN
        below = value <= float(high) if interval[-1] == "]" else value < float(high)
        if not (above and below) and (sac or flag != "buffer_size"):  # PPO keeps no replay buffer
            error(f"--{flag.replace('_', '-')} must be in {interval}, got {value}")
    total = args.total_env_steps
    epoch = args.num_envs * SKILL_STEPS * HIGH_HORIZON  # the env steps of one epoch
    transitions = args.num_envs * HIGH_HORIZON  # and its high-level transitions
    stored = min(total // epoch * transitions, args.buffer_size) // HIGH_HORIZON * HIGH_HORIZON
    if total < epoch:
        error(f"--total-env-steps must cover one epoch ({epoch} env steps), got {total}")
    if sac and args.buffer_size < transitions:
        error(f"--buffer-size must hold one epoch ({transitions} transitions), got {args.buffer_size}")
    if sac and args.grad_steps_per_epoch and args.learning_starts > stored:
        error(f"--learning-starts must be at most the {stored} transitions --total-env-steps and "
              f"--buffer-size store, got {args.learning_starts}")
    if ckpt and total // epoch <= ckpt["epoch"]:
        error(f"{args.resume} has already trained for {ckpt['epoch'] * epoch} env steps; give a "
              "larger --total-env-steps to continue it")
    try:
        envs.check_env_memory(args.num_envs + args.num_eval_episodes)
        env = envs.make_task(args.task)  # for its sizes
    except (MemoryError, envs.RenderUnavailable) as e:
        error(e)
    args.checkpoint, child = load_child(args.checkpoint, args.task, env)
    if ckpt and ckpt.get("child_actor_sha256") != child["actor_sha256"]:
        error(f"{args.checkpoint} is not the child {args.resume} was trained over: its actor's weights "
              "changed (another checkpoint, or its run went on); give that run's checkpoint as it was")
    check_memory(args, env.observation_space.sample(), child["args"]["skill_dim"])
    env.close()
    return args, child, ckpt


def load_file(path):
    """A cleanmisl checkpoint, or one line that says why not."""
    if not os.path.isfile(path):
        error(f"no checkpoint file at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        error(f"{path} is not a readable checkpoint ({type(e).__name__})")
    if not isinstance(ckpt, dict) or "agent" not in ckpt or not isinstance(ckpt.get("args"), dict):
        error(f"{path} is not a cleanmisl checkpoint")
    return ckpt


def load_child(path, task, env):
    """The child's path (a run folder's newest .pt) and checkpoint, checked, with its actor's SHA-256; or one line."""
    if not path:
        error("give the child's --checkpoint (an agent's checkpoint.pt)")
    if os.path.isdir(path):
        candidates = [os.path.join(path, name) for name in os.listdir(path) if name.endswith(".pt")]
        if not candidates:
            error(f"the run folder {path} holds no checkpoint")
        path = max(candidates, key=os.path.getmtime)
    child = load_file(path)
    agent = child["agent"]
    if agent not in CHILD_AGENTS:
        error(f"{path} is a {agent} checkpoint, not one of a skill-discovery agent ({', '.join(CHILD_AGENTS)})")
    missing = [key for key in ("env_id", "skill_dim", "hidden_dim") if key not in child["args"]]
    missing += [] if isinstance(child.get("actor"), dict) else ["actor"]
    if missing:
        error(f"{path} lacks {', '.join(missing)}: it was not written by this version of {agent}.py")
    world = child["args"]["env_id"]
    base = envs.TASKS[task].base
    if world != base:
        error(f"{path} holds skills learned on {world}; {task} needs skills learned on {base}")
    diverged = [f"actor.{key}" for key, value in child["actor"].items() if not value.isfinite().all()]
    if diverged:
        error(f"{path} holds NaN or infinite weights ({diverged[0]}): its run diverged")
    try:  # on the CPU, before main seeds torch
        frozen_child(child, task, env.observation_space, env.action_space, torch.device("cpu"))
    except RuntimeError as e:  # torch's last line names a tensor
        error(f"{path}'s actor does not fit {agent}.py's network ({str(e).splitlines()[-1].strip()})")
    weights = [key.encode() + value.numpy().tobytes() for key, value in sorted(child["actor"].items())]
    child["actor_sha256"] = hashlib.sha256(b"".join(weights)).hexdigest()
    return path, child


def non_finite(state, prefix):
    """The names of the NaN or inf tensors in a state dict, its nested dicts included (an optimizer's state)."""
    if isinstance(state, dict):
        names = [non_finite(value, f"{prefix}.{key}") for key, value in state.items()]
        return sum(names, [])
    if torch.is_tensor(state) and state.is_floating_point() and not state.isfinite().all():
        return [prefix]
    return []


def start_run(args, ckpt, child_ckpt, learned, rng, train_envs, eval_envs):
    """The run's folder and logs, and its progress: a new run's, or with --resume the checkpoint's, its state restored
    and its evaluations back in eval.jsonl; a state that does not fit ends the run in one line naming the difference."""
    algo = envs.TASKS[args.task].algo
    agent = child_ckpt["agent"]
    name = f"{args.task}__{AGENT}_{agent}__{args.seed}__{int(time.time())}"
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
    threading.excepthook = lambda hook: None if issubclass(hook.exc_type, OSError) else threading.__excepthook__(hook)
    writer = SummaryWriter(folder)  # its thread's failed write is ignored there (above), raised at the next add_scalar
    table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    resolved = [*TASK_FLAGS, "checkpoint_every"]
    if algo == "ppo":  # no replay buffer
        resolved.remove("buffer_size")
    flags = ", ".join(f"--{flag.replace('_', '-')} {getattr(args, flag)}" for flag in resolved)
    source = "the run's own, but for those given anew" if ckpt else "a flag left unset: the task's"
    print(f"{args.task} over {agent} skills ({algo.upper()}, {HIGH_HORIZON} × {SKILL_STEPS} steps): {flags} ({source})")
    train_envs.run_dir = eval_envs.run_dir = folder  # a dead env worker's line names the checkpoint
    run = types.SimpleNamespace(name=name, dir=folder, writer=writer, train_envs=train_envs,
                                eval_envs=eval_envs, rng=rng)
    run.child = {"child_agent": agent, "child_actor_sha256": child_ckpt["actor_sha256"]}  # for the checkpoint
    if not ckpt:
        return run, {"epoch": 0, "grad_steps": 0, "wall_time": 0.0, "since_eval": [], "evals": [], "timing": {}}
    missing = [name for name in learned if name not in ckpt]
    if missing:
        error(f"{args.resume} was written by another version of {AGENT}.py: it has no {', '.join(missing)}")
    try:
        for key, thing in learned.items():
            if torch.is_tensor(thing):  # log α
                thing.data.copy_(ckpt[key])
                continue
            if isinstance(thing, torch.optim.Optimizer):  # with this run's options (fused, capturable)
                options = {k: v for k, v in thing.param_groups[0].items() if k != "params"}
                ckpt[key]["param_groups"] = [group | options for group in ckpt[key]["param_groups"]]
            thing.load_state_dict(ckpt[key])
        rngs = ckpt["rngs"]
        torch.set_rng_state(rngs["torch"])
        torch.cuda.set_rng_state_all(rngs["cuda"][:torch.cuda.device_count()])  # on maybe fewer GPUs
        run.rng.bit_generator.state = rngs["numpy"]
        envs.set_env_rng_states(run.train_envs, rngs["envs"][:args.num_envs])
        envs.set_env_rng_states(run.eval_envs, rngs["envs"][args.num_envs:])
        names = ("epoch", "grad_steps", "wall_time", "since_eval", "evals", "timing")
        progress = {key: ckpt[key] for key in names}
    except (KeyError, RuntimeError, ValueError, TypeError) as e:
        error(f"{args.resume} was written by another version of {AGENT}.py ({' '.join(str(e).split())[:160]})")
    text = "".join(json.dumps(result) + "\n" for result in progress["evals"])  # not what was logged after it
    write_atomically(run, "eval.jsonl", lambda tmp: pathlib.Path(tmp).write_text(text))
    print(f"resumed {ckpt['run_name']} at epoch {ckpt['epoch']}")
    return run, progress


def check_memory(args, obs, skill_dim):
    """Refuses, before anything is allocated, a run whose buffer, networks and batch outgrow memory (lower bounds)."""
    sac = envs.TASKS[args.task].algo == "sac"
    obs_bytes = sum(array.nbytes for array in tree_leaves(obs))
    obs_floats = sum(array.size for array in tree_leaves(obs))
    episode_bytes = (HIGH_HORIZON + 1) * obs_bytes + HIGH_HORIZON * (8 + 4 * skill_dim)
    episodes = max(args.buffer_size // HIGH_HORIZON, 1) * sac  # PPO keeps none
    layers = 14 if sac else 8  # square layers' worth of float32: π_h and four Qs, or π_h and V
    buffer = {"the episode buffer (--buffer-size)": episodes * episode_bytes}
    batch_floats = 2 * obs_floats + 8 * args.hidden_dim
    training = {"the networks (--hidden-dim)": 4 * layers * args.hidden_dim**2,
                "one batch (--batch-size)": 4 * args.batch_size * batch_floats}
    places = {"host": buffer | training}
    if torch.cuda.is_available() and args.cuda:
        places = {"GPU": training, "host": buffer}
    for place, parts in places.items():
        free = torch.cuda.mem_get_info()[0] if place == "GPU" else envs.free_host_memory()
        needed = sum(parts.values())
        sizes = ", ".join(f"{part} {size / 2**30:,.1f}" for part, size in parts.items())
        if needed > free:
            error(f"this run needs at least {needed / 2**30:,.1f} GiB of {place} memory: {sizes}; "
                  f"{free / 2**30:,.1f} GiB is free")


def fast_path(update, args, device):
    """SAC's gradient step compiled with --compile, and replayed as one CUDA graph with --cudagraphs on a GPU."""
    sac = envs.TASKS[args.task].algo == "sac"
    if not sac and (args.compile or args.cudagraphs):
        print("--compile and --cudagraphs speed up SAC alone; this PPO task runs without them")
    elif args.cudagraphs and device.type != "cuda":
        print("--cudagraphs: CUDA graphs need a GPU; on the CPU the gradient step runs without them (Adam fused)")
    if sac and args.compile:
        torch._inductor.config.fallback_random = device.type == "cpu"  # on a CPU, eager's random draws
        update = torch.compile(update)
    if sac and args.cudagraphs and device.type == "cuda":
        update = CudaGraphStep(update)
    return update


class CudaGraphStep:
    """3 warm-up steps on a side stream, one recorded as a CUDA graph, then replays, each batch copied into it."""
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
        tree_map(torch.Tensor.copy_, self.batch, batch)  # a pixel task's obs: a dict
        self.graph.replay()
        return {name: value.clone() for name, value in self.stats.items()}


def save_checkpoint(run, progress, args, learned, device):
    """What a resumed run needs, written atomically; a NaN or inf in a network or an optimizer ends the run instead."""
    state = {"agent": AGENT, "args": asdict(args), "run_name": run.name, **run.child, **progress}
    for name, thing in learned.items():
        state[name] = thing.detach().cpu() if torch.is_tensor(thing) else thing.state_dict()  # log α, or a state
    broken = [tensor for name in learned if name != "buffer" for tensor in non_finite(state[name], name)]
    if broken:
        error(f"{broken[0]} holds NaN or inf at epoch {progress['epoch']} ({len(broken)} tensors "
              "do): the run diverged", run.dir)
    cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" else []
    env_rngs = envs.env_rng_states(run.train_envs) + envs.env_rng_states(run.eval_envs)
    state["rngs"] = {"torch": torch.get_rng_state(), "cuda": cuda, "envs": env_rngs,
                     "numpy": run.rng.bit_generator.state}
    write_atomically(run, "checkpoint.pt", lambda tmp: torch.save(state, tmp))


def evaluate(run, progress, args, collect):
    """`collect`'s deterministic episodes: their return, "past 10", the training means; a plot, a line of eval.jsonl."""
    epoch = progress["epoch"]
    env_steps = epoch * args.num_envs * SKILL_STEPS * HIGH_HORIZON
    episodes, coordinates, goals = collect(run.eval_envs, deterministic=True)
    returns = episodes["reward"].sum(1)
    result = {"epoch": epoch, "env_steps": env_steps, "grad_steps": progress["grad_steps"],
              "wall_time": round(progress["wall_time"], 2), "return": float(returns.mean()),
              "return_past10": None, "return_min": float(returns.min()),
              "return_max": float(returns.max())}
    trained = [line["return"] for line in [*progress["evals"], result][1:]]  # without epoch 0's
    run.writer.add_scalar("eval/return", result["return"], env_steps)
    if trained:
        result["return_past10"] = float(np.mean(trained[-10:]))
        run.writer.add_scalar("eval/return_past10", result["return_past10"], env_steps)
    since_eval = progress["since_eval"]  # each epoch's means of the stats
    if since_eval:
        per_epoch = torch.stack([torch.stack(list(means.values())) for means in since_eval])
        result.update(zip(since_eval[0], per_epoch.mean(0).tolist()))
    since_eval.clear()
    result.update(progress["timing"])
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    fig, ax = plt.subplots(figsize=(5, 5))  # the paths, each episode's goals as stars
    colors = plt.cm.hsv(np.linspace(0, 1, len(returns), endpoint=False))
    stars = [np.unique(chain, axis=0) for chain in np.stack(goals, 1)] if goals[0] is not None else []
    envs.draw_coordinates(ax, np.stack(coordinates, 1), colors, goals=stars)
    ax.set_title(f"{args.task} over {run.child['child_agent']}, {env_steps:,} env steps, "
                 f"return {result['return']:.1f}")
    fig.tight_layout()
    write_atomically(run, f"episodes_{env_steps:010d}.png", lambda tmp: fig.savefig(tmp, dpi=100))
    plt.close(fig)
    progress["evals"].append(result)
    text = "".join(json.dumps(line) + "\n" for line in progress["evals"])  # eval.jsonl: a line per evaluation
    write_atomically(run, "eval.jsonl", lambda tmp: pathlib.Path(tmp).write_text(text))
    past = "–" if result["return_past10"] is None else f"{result['return_past10']:.3g}"
    figures = " | ".join(f"{k} {v:.4g}" for k, v in list(result.items())[8:-1])
    print(f"eval  epoch {epoch} | env steps {env_steps:,} | return {result['return']:.3g} | "
          f"past 10 {past} | {figures}")


def log_epoch(run, progress, args, step_stats, sps, rewards):
    """A NaN or inf *_loss ends the run; the means go to TensorBoard and the next evaluation; a line every 10 epochs."""
    epoch = progress["epoch"]
    env_steps = (epoch + 1) * args.num_envs * SKILL_STEPS * HIGH_HORIZON
    episode_return = float(rewards.sum(1).mean())  # the mean of this epoch's episodes
    if step_stats:
        names = list(step_stats[0])
        per_step = torch.stack([torch.stack(list(stats.values())) for stats in step_stats])  # (steps, stats)
        for step, values in enumerate(per_step.tolist(), progress["grad_steps"] - len(step_stats) + 1):
            for name, value in zip(names, values):
                if name.endswith("_loss") and not math.isfinite(value):
                    error(f"{name} is {value} at gradient step {step} (epoch {epoch})", run.dir)
        means = per_step.mean(0).cpu()
        progress["since_eval"].append(dict(zip(names, means)))
        for name, value in zip(names, means.tolist()):
            group = "losses" if name.endswith("loss") else "charts"
            run.writer.add_scalar(f"{group}/{name}", value, env_steps)
    run.writer.add_scalar("charts/episode_return", episode_return, env_steps)
    run.writer.add_scalar("charts/SPS", int(sps), env_steps)
    if (epoch + 1) % 10 == 0:
        seconds = (args.total_env_steps - env_steps) / sps
        minutes = round(seconds / 60)
        left = f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"
        left = f"{seconds:.0f} s" if seconds < 60 else left  # "45 s", "12 min", "3 h 05 min"
        print(f"epoch {epoch + 1} | env steps {env_steps:,} | SPS {int(sps)} | {left} left | "
              f"episode return {episode_return:.3g}")


def error(message, run_dir=None):
    """Ends the run with one line, no traceback; given the run's folder, with the command that resumes it."""
    if run_dir:
        checkpoint = os.path.join(run_dir, "checkpoint.pt")
        hint = f"resume with --resume {checkpoint}" if os.path.isfile(checkpoint) else "no checkpoint was written yet"
        message = f"{message}; {hint}"
    sys.exit(f"{AGENT}.py: error: {message}")


def write_atomically(run, name, write):
    """write(temporary), then a rename: a failed write leaves the old file whole and no temporary behind."""
    path = os.path.join(run.dir, name)
    temporary = "{}.tmp{}".format(*os.path.splitext(path))  # its extension names the format
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException as e:
        if os.path.exists(temporary):
            os.remove(temporary)
        if isinstance(e, OSError):
            error(f"cannot write {path} ({e.strerror or e})", run.dir)
        if not isinstance(e, RuntimeError):
            raise
        if "unexpected pos" in str(e) or "write failed" in str(e):  # torch.save on a full disk
            error(f"cannot write {path} (the write was cut short: is the disk full?)", run.dir)
        error(f"cannot write {path} ({' '.join(str(e).split())[:120]})", run.dir)


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # every line as it happens, also into a file
    try:
        main(*parse_args())
    except (envs.RenderUnavailable, envs.WorkerDied, MemoryError) as e:  # no render, a dead env worker, no memory
        error(e, getattr(e, "run_dir", None))
    except OSError as e:  # the run's folder or TensorBoard's file
        where = os.fsdecode(e.filename) if e.filename else "the TensorBoard log"
        error(f"cannot write {where} ({e.strerror or e})")
