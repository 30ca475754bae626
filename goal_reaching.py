"""Zero-shot goal reaching from any agent's checkpoint, in one file: "Can a MISL Fly? Analysis and Ingredients for
Mutual Information Skill Learning" (Zheng, Tuyls, Peng and Eysenbach, ICLR 2025), §6.4 and App. B.4.

Given a goal g, the skill is inferred from the agent's own networks, without any further learning, at every step
from the current observation s, and the skill policy π(a | s, z) acts with it:
    CSF, METRA       z = (φ(g) - φ(s)) / ‖φ(g) - φ(s)‖, the MAP skill of q(z | s, g) ∝ p(z) exp((φ(g) - φ(s))ᵀz)
                     (App. A.10)
    METRA, one-hot   z = onehot(argmax(φ(g) - φ(s))), either chosen once at the first step ("single") or at every
                     step ("adaptive"); both are reported
    VISR             z = ê(g) = φ(g) / ‖φ(g)‖
    DIAYN            z = onehot(argmax q(·|g)), the discriminator's guess for the goal
The paper's metric is the staying time fraction (1/T) Σ_t 1[‖p_t - g‖ < r], the share of the horizon T that the
position p_t after each step spends within r of the goal (§6.4): reaching the goal and staying there.

    python goal_reaching.py --checkpoint runs/Ant__csf__1__1700000000/checkpoint.pt
    python goal_reaching.py --run runs/Ant__metra__1__1700000000          # the checkpoint of that run
    python goal_reaching.py --run runs/... --deterministic                 # act with tanh(mean) instead of sampling

The protocol of the official evaluation (iod/metra.py: _evaluate_policy with --eval_goal_metrics 1), for the agents
whose paper has a goal inference:
  - goals: --num-goals positions drawn uniformly from the env's goal range (Ant (x, y) ∈ [-50, 50]², HalfCheetah
    x ∈ [-100, 100], Quadruped [-15, 15]², Humanoid [-10, 10]²). The goal observation is envs.py's: a fresh reset
    state with only its position replaced, normalized like every observation (state worlds), or the frame seen
    after placing the body there and letting it settle, tiled over the frame stack (pixel worlds).
    On Kitchen and Robobin the goals are the world's named tasks (Kitchen's 6, Robobin's 4), drawn uniformly
    with replacement; the goal observation is the task's goal image, and success is the task's test.
  - one episode per goal, from a fresh reset of the env, for the env's horizon, the skill inferred at every step
    (above), the action sampled from the policy π(·|s, z), as the official evaluation does.
  - metrics on Kitchen and Robobin: the fraction of the steps that pass the task's test (staying time), hit and
    end success, and a bar plot per task.
  - metrics elsewhere, from the positions after each step: staying time (the fraction of the horizon within 3, and
    within 1, of the goal: the paper's headline number), hit success (ever within the radius), end success (within
    it at the last step), the final distance, and the progress (distance at the reset minus the final distance).
Printed as a table (means over goals), written with every goal's numbers to goal_reaching.json next to the
checkpoint, and drawn to goal_reaching.png (trajectories and goals). The same seed gives the same numbers on a CPU.

Deliberate differences from the official code (github.com/Princeton-RL/contrastive-successor-features): the goals
and the episodes have their own seeded generators (the official evaluation draws them from the training run's
streams), the staying time on Kitchen and Robobin is a fraction of the horizon (the official code logs the raw
count of steps), and the progress metric is an addition.

The file reads in the protocol's order: Args; the skill inference and the metrics; `main`, the protocol; then the
infrastructure main calls (the command line, the env and the networks, plots, the report).
"""

import contextlib
import importlib
import json
import math
import os
import random
import sys
from dataclasses import asdict, dataclass
from typing import Optional

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
import tyro

import envs

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GOAL_AGENTS = ("csf", "metra", "diayn", "visr")  # the agents the paper evaluates on goals (App. B.4)
RADII = (3.0, 1.0)
NETWORKS = ("phi", "actor")  # what a checkpoint must hold, besides its args and epoch
ARGS_USED = ("env_id", "skill_dim", "hidden_dim", "num_envs")  # the run's flags this script reads
TASK_WORLDS = {"Kitchen": envs.KITCHEN_TASKS, "Robobin": envs.ROBOBIN_TASKS}  # worlds whose goals are named tasks


@dataclass
class Args:
    checkpoint: Optional[str] = None
    """a checkpoint.pt written by csf.py, metra.py, diayn.py or visr.py"""
    run: Optional[str] = None
    """a run folder (runs/<run_name>): its checkpoint.pt is used"""
    num_goals: int = 50
    """goals, one episode each (the paper's 50)"""
    seed: int = 0
    """seed of the goals, the env resets and the policy's action samples"""
    deterministic: bool = False
    """act with the policy's mode tanh(mean) instead of sampling from it (the official evaluation samples)"""
    cuda: bool = True
    """use the GPU when torch sees one"""


# ======================================================================================================================
# THE ALGORITHM
# ======================================================================================================================

# ---------------------------------------------------------------- skill inference (App. B.4; iod/metra.py)
def direction(phi_goal, phi_obs):
    """z = (φ(g) - φ(s)) / ‖φ(g) - φ(s)‖: the unit direction from the state to the goal in φ-space (CSF, METRA)."""
    return F.normalize(phi_goal - phi_obs, dim=-1)


def one_hot_argmax(scores):
    """The one-hot skill of the largest score."""
    return F.one_hot(scores.argmax(-1), scores.shape[-1]).float()


def infer_skill(agent, discrete, phi_goal, phi_obs):
    """The skill that should move s towards g, from φ(g) and φ(s) of the agent's own φ network."""
    if agent in ("csf", "metra"):
        return one_hot_argmax(phi_goal - phi_obs) if discrete else direction(phi_goal, phi_obs)
    if agent == "visr":
        return F.normalize(phi_goal, dim=-1)  # ê(g): the skill whose vMF score the goal maximizes
    if isinstance(phi_goal, tuple):  # DIAYN on Robobin, Gaussian q(z|g): its mean, as the official evaluation takes
        return phi_goal[0]
    return one_hot_argmax(phi_goal)  # DIAYN: argmax q(·|g)


# ---------------------------------------------------------------- the metrics (App. B.4)
def goal_metrics(start, positions, goal):
    """The metrics of one episode. start: (coord_dim,) the position after the reset; positions: (T, coord_dim) the
    positions after each step; goal: (coord_dim,)."""
    distance = np.linalg.norm(np.asarray(positions) - goal, axis=-1)
    metrics = {}
    for radius in RADII:
        inside = distance < radius
        metrics[f"staying_time_{radius:g}"] = float(inside.mean())  # the official AtSuccess
        metrics[f"hit_{radius:g}"] = float(inside.any())
        metrics[f"end_{radius:g}"] = float(inside[-1])
    metrics["final_distance"] = float(distance[-1])
    metrics["progress"] = float(np.linalg.norm(start - goal) - distance[-1])
    return metrics


def task_metrics(successes):
    """The metrics of one episode towards a named task: the fraction of its steps that satisfy the task's success
    test (the official staying time, a raw count there, divided by the horizon), ever (hit), at the last step (end)."""
    successes = np.asarray(successes, dtype=float)
    return {"staying_time": float(successes.mean()), "hit": float(successes.max()), "end": float(successes[-1])}


# ---------------------------------------------------------------- the protocol
def main(args, ckpt):
    """Draw the goals; for each, one episode from a fresh reset in which the skill is inferred from φ(g) and φ(s) at
    every step; each goal's metrics and their means, per inference variant. Plots them, writes goal_reaching.json
    next to the checkpoint, prints the means, and returns the report."""
    trained = ckpt["args"]
    discrete = trained.get("discrete", False)  # one-hot METRA; DIAYN is always one-hot
    spec = envs.ENV_SPECS[trained["env_id"]]
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    env = make_env(trained["env_id"], args.seed)
    phi, actor = load_networks(args.checkpoint, ckpt, env, device)  # the agent script's own, with its weights

    tasks = TASK_WORLDS.get(trained["env_id"])
    if tasks:  # the world's named tasks, drawn uniformly with replacement
        goals = rng.integers(len(tasks), size=args.num_goals)
    else:
        goals = rng.uniform(-spec.goal_range, spec.goal_range, (args.num_goals, spec.coord_dim))
    variants = ("adaptive", "single") if ckpt["agent"] == "metra" and discrete else ("adaptive",)
    results = {}
    for variant in variants:
        per_goal, episodes = [], []
        for goal in goals:
            with torch.no_grad():
                goal_obs = env.unwrapped.task_goal_observation(goal) if tasks else env.unwrapped.goal_observation(goal)
                phi_goal = phi(torch.as_tensor(goal_obs[None], device=device))
                obs, info = env.reset()  # the goal observation moved the body; start the episode afresh
                start, positions, successes, skill = info["coordinates"], [], [], None
                for _ in range(spec.horizon):
                    obs = torch.as_tensor(obs[None], device=device)
                    if skill is None or variant == "adaptive":  # "single": z chosen at the first step only
                        skill = infer_skill(ckpt["agent"], discrete, phi_goal, phi(obs))
                    action = actor.mode(obs, skill) if args.deterministic else actor.sample(obs, skill)[0]
                    action = action[0].cpu().numpy()
                    if not np.isfinite(action).all():  # the env refuses NaN and inf
                        error(f"the policy's action is not finite: {args.checkpoint} holds diverged networks")
                    obs, _, terminated, truncated, info = env.step(action)
                    positions.append(info["coordinates"])
                    successes.append(tasks is not None and env.unwrapped.task_success(goal))
                    if terminated or truncated:
                        break
            if tasks:
                per_goal.append({"goal": tasks[goal], **task_metrics(successes)})
            else:
                per_goal.append({"goal": goal.tolist(), **goal_metrics(start, np.stack(positions), goal)})
            episodes.append((start, np.stack(positions)))
        means = {key: float(np.mean([g[key] for g in per_goal])) for key in per_goal[0] if key != "goal"}
        results[variant] = {"mean": means, "per_goal": per_goal}
        plot_variant(args.checkpoint, ckpt, variant, len(variants), per_goal, episodes, goals, tasks, means)
    env.close()

    report = {"checkpoint": args.checkpoint, "agent": ckpt["agent"], "env_id": trained["env_id"],
              "env_steps": ckpt["epoch"] * trained["num_envs"] * spec.horizon, "args": asdict(args), "results": results}
    write_report(report, os.path.join(os.path.dirname(args.checkpoint), "goal_reaching.json"), variants)
    return report


# ======================================================================================================================
# INFRASTRUCTURE: what main calls around the protocol (the command line, the env and the networks, plots, the report)
# ======================================================================================================================

# ---------------------------------------------------------------- the command line
def parse_args(argv=None):
    """The command line, checked; returns the args and the loaded checkpoint."""
    args = tyro.cli(Args, args=argv)
    if (args.checkpoint is None) == (args.run is None):
        error("give exactly one of --checkpoint PATH and --run RUN_FOLDER")
    if args.num_goals < 1:
        error(f"--num-goals must be in [1, inf), got {args.num_goals}")
    if not 0 <= args.seed <= 2**31 - 1:
        error(f"--seed must be in [0, 2147483647], got {args.seed}")
    if args.run is not None:
        if not os.path.isdir(args.run):
            error(f"no run folder at {args.run}")
        args.checkpoint = os.path.join(args.run, "checkpoint.pt")
        if not os.path.isfile(args.checkpoint):
            error(f"the run folder {args.run} holds no checkpoint.pt (yet)")
    if not os.path.isfile(args.checkpoint):
        error(f"no checkpoint file at {args.checkpoint}")
    try:
        ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        error(f"{args.checkpoint} is not a readable checkpoint ({type(e).__name__})")
    if not isinstance(ckpt, dict) or "agent" not in ckpt or not isinstance(ckpt.get("args"), dict):
        error(f"{args.checkpoint} is not a cleanmisl checkpoint")
    if ckpt["agent"] not in GOAL_AGENTS:
        error(f"{args.checkpoint} is a {ckpt['agent']} checkpoint; the paper defines no zero-shot goal inference for "
              f"{ckpt['agent']}, only for {', '.join(GOAL_AGENTS)}")
    if ckpt["args"].get("critic") == "mlp":
        error(f"{args.checkpoint} was trained with --critic mlp: its φ reads pairs (s, s'), so there is no φ(g) - φ(s) "
              f"to infer a skill from")
    missing = [k for k in ARGS_USED if k not in ckpt["args"]] + [
        k for k in (*NETWORKS, "epoch") if not isinstance(ckpt.get(k), dict if k in NETWORKS else int)]
    if missing:
        error(f"{args.checkpoint} lacks {', '.join(missing)}: it was not written by this version of "
              f"{ckpt['agent']}.py")
    if ckpt["args"]["env_id"] not in envs.ENV_SPECS:
        error(f"{args.checkpoint} was trained on {ckpt['args']['env_id']!r}, a world envs.py does not have")
    for network in NETWORKS:
        for key, value in ckpt[network].items():
            if torch.is_tensor(value) and value.is_floating_point() and not torch.isfinite(value).all():
                error(f"{args.checkpoint} holds NaN or infinite weights ({network}.{key}): its run diverged")
    # each goal keeps its episode's positions and metrics until the end (about 1 kB + the positions in float64)
    spec = envs.ENV_SPECS[ckpt["args"]["env_id"]]
    needed = args.num_goals * (1024 + 8 * (spec.horizon + 1) * spec.coord_dim)
    if needed > available_memory():
        error(f"--num-goals {args.num_goals} needs about {needed / 2**30:.1f} GiB for its episodes; "
              f"{available_memory() / 2**30:.1f} GiB of memory is free")
    return args, ckpt


def available_memory():
    """Bytes of memory free now (MemAvailable: what can be had without swapping); inf where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return math.inf


# ---------------------------------------------------------------- the env and the networks
def make_env(env_id, seed):
    """The world, seeded; a pixel world that cannot render ends with one line."""
    try:  # a pixel world makes its render context at its first frame: the first reset
        env = envs.make_env(env_id)
        env.reset(seed=seed)
    except envs.RenderUnavailable as e:
        error(e)
    return env


def load_networks(path, ckpt, env, device):
    """φ and π: the agent script's own classes with the checkpoint's weights, in eval mode. Weights that do not fit
    end with one line."""
    trained = ckpt["args"]
    agent = importlib.import_module(ckpt["agent"])
    action_dim = env.action_space.shape[0]
    gaussian = {"gaussian": True} if trained["env_id"] in getattr(agent, "GAUSSIAN_ENVS", ()) else {}  # DIAYN-Robobin
    phi = agent.Phi(env.observation_space, trained["skill_dim"], trained["hidden_dim"], **gaussian).to(device)
    actor = agent.Actor(env.observation_space, action_dim, trained["skill_dim"], trained["hidden_dim"]).to(device)
    for network, module in (("phi", phi), ("actor", actor)):
        try:
            module.load_state_dict(ckpt[network])
        except RuntimeError as e:  # other shapes or names: another version of the agent, or an edited file
            detail = str(e).strip().splitlines()[-1].strip()  # torch's last line names a tensor and its shapes
            error(f"{path}'s {network} does not fit {ckpt['agent']}.py's network ({detail})")
    return phi.eval(), actor.eval()


# ---------------------------------------------------------------- plots and the report
def plot_variant(checkpoint, ckpt, variant, num_variants, per_goal, episodes, goals, tasks, means):
    """One inference variant's plot next to the checkpoint: goal_reaching.png (goal_reaching_<variant>.png when
    there are two), the trajectories and goals, or on Kitchen and Robobin the staying time per task."""
    trained = ckpt["args"]
    stem = "goal_reaching" if num_variants == 1 else f"goal_reaching_{variant}"
    env_steps = ckpt["epoch"] * trained["num_envs"] * envs.ENV_SPECS[trained["env_id"]].horizon
    title = f"{ckpt['agent']} {trained['env_id']}, {env_steps:,} env steps, {variant}"
    path = os.path.join(os.path.dirname(checkpoint), f"{stem}.png")
    if tasks:
        plot_tasks(per_goal, tasks, path, f"{title}: staying time {means['staying_time']:.3f}")
    else:
        plot_episodes(episodes, goals, path, f"{title}: staying time (r = 3) {means['staying_time_3']:.3f}")


def plot_tasks(per_goal, tasks, path, title):
    """Mean staying time per task, over the episodes that asked for it."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    values = [np.mean([g["staying_time"] for g in per_goal if g["goal"] == task] or [np.nan]) for task in tasks]
    ax.bar(range(len(tasks)), values)
    ax.set_xticks(range(len(tasks)), tasks, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("staying time")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    write_atomically(path, lambda temporary: fig.savefig(temporary, dpi=100, format="png"))
    plt.close(fig)


def plot_episodes(episodes, goals, path, title):
    """Each episode's trajectory in its goal's colour, the goal a star (x against time for 1-D worlds)."""
    fig, ax = plt.subplots(figsize=(5, 5))
    paths = [np.concatenate([start[None], positions]) for start, positions in episodes]
    envs.draw_coordinates(ax, paths, plt.cm.hsv(np.linspace(0, 1, len(goals), endpoint=False)), goals=goals[:, None])
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    write_atomically(path, lambda temporary: fig.savefig(temporary, dpi=100, format="png"))
    plt.close(fig)


def write_report(report, path, variants):
    """goal_reaching.json (every goal's numbers), then the means printed as a table."""
    def write_json(temporary):
        with open(temporary, "w") as f:
            json.dump(report, f, indent=1)

    write_atomically(path, write_json)
    results = report["results"]
    keys = list(results[variants[0]]["mean"])
    print(f"{report['agent']} on {report['env_id']}, {report['env_steps']:,} env steps, {report['args']['num_goals']} "
          f"goals, {'deterministic' if report['args']['deterministic'] else 'sampled'} actions")
    print("| inference | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for variant in variants:
        print(f"| {variant} | " + " | ".join(f"{results[variant]['mean'][k]:.3f}" for k in keys) + " |")
    print(f"written to {path}")


# ---------------------------------------------------------------- failures and files
def error(message):
    """End with one line on stderr, no traceback."""
    sys.exit(f"goal_reaching.py: error: {message}")


def write_atomically(path, write):
    """Write `path` by `write(temporary path)`, then rename it into place: a write that fails (a full disk, a
    read-only folder) leaves the earlier file whole and no temporary behind, and ends with one line."""
    temporary = path + ".tmp"
    try:
        write(temporary)
        os.replace(temporary, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        error(f"cannot write {path}: {e.strerror or e}")


if __name__ == "__main__":
    main(*parse_args())
