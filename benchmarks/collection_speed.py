"""Where a collection step's time goes: the envs alone (serial against worker processes) and the policy alone.

    python benchmarks/collection_speed.py                     # Ant and Humanoid; about a minute on 16 cores
    python benchmarks/collection_speed.py --env-ids Ant       # one world

A training epoch collects 200 steps of 8 envs, one step at a time: the policy (csf.py's Actor, width 1024) samples
8 actions on the training device, and the vector env steps the 8 envs. This times the two apart, as medians over
5 repeats of 200 steps:
  - the envs alone, stepped with random actions: a SyncVectorEnv in this process (--no-parallel-envs) against a
    ParallelVectorEnv (the default: one worker per env here, at most one per core);
  - the policy alone: host to device copy of the observations, actor.sample, and the copy of the actions back, on
    the GPU when torch sees one (else on the CPU).
Their sum against the measured epoch tells how much the loop itself costs. Prints one table and writes it to
benchmarks/results/collection_speed_<device>.md.
"""

import argparse
import functools
import os
import platform
import re
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import csf  # noqa: E402
import envs  # noqa: E402

STEPS, REPEATS, NUM_ENVS = 200, 5, 8


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name()
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor() or "CPU")
    return f"{model}, {os.cpu_count()} cores"


def time_envs(env_id, parallel):
    """Median ms per vector step of NUM_ENVS envs with random actions, and the start-up seconds."""
    started = time.time()
    train_envs, eval_envs = envs.make_envs(functools.partial(envs.make_env, env_id), NUM_ENVS, 1, 0, 0, parallel)
    startup = time.time() - started
    rng = np.random.default_rng(0)
    times = []
    for _ in range(REPEATS):
        train_envs.reset()
        actions = rng.uniform(-1, 1, (STEPS, *train_envs.action_space.shape)).astype(np.float32)
        started = time.perf_counter()
        for action in actions:
            train_envs.step(action)
        times.append((time.perf_counter() - started) / STEPS * 1000)
    train_envs.close()
    eval_envs.close()
    return statistics.median(times), startup


def time_policy(env_id, device, hidden_dim):
    """Median ms per collection step of the policy: observations to the device, actor.sample, actions back."""
    env = envs.make_env(env_id)
    obs = np.stack([env.reset(seed=i)[0] for i in range(NUM_ENVS)])
    actor = csf.Actor(env.observation_space, env.action_space.shape[0], 2, hidden_dim).to(device)
    skills = csf.sample_skills(NUM_ENVS, 2).to(device)
    times = []
    with torch.no_grad():
        for _ in range(REPEATS + 1):  # the first repeat warms up (cuDNN, the allocator)
            started = time.perf_counter()
            for _ in range(STEPS):
                actor.sample(torch.as_tensor(obs, device=device), skills)[0].cpu().numpy()
            times.append((time.perf_counter() - started) / STEPS * 1000)
    env.close()
    return statistics.median(times[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env-ids", nargs="+", default=["Ant", "Humanoid"], help="worlds to time")
    parser.add_argument("--hidden-dim", type=int, default=1024, help="width of the policy")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    where = device_name(device)
    out = [f"# Collection speed on {where}, torch {torch.__version__}", "",
           f"`python benchmarks/collection_speed.py {' '.join(sys.argv[1:])}`".replace(" `", "`"), "",
           f"ms per collection step of {NUM_ENVS} envs (medians over {REPEATS} × {STEPS} steps); render look "
           f"{envs.resolve_render_quality()}, MUJOCO_GL={envs.GL_BACKEND}.", "",
           "| world | envs, in this process | envs, in worker processes (start-up s) | policy on the "
           f"{device.type.upper()}, width {args.hidden_dim} | 200 steps: serial + policy, parallel + policy (s) |",
           "|---|---|---|---|---|"]
    print("\n".join(out), flush=True)
    for env_id in args.env_ids:
        serial, _ = time_envs(env_id, parallel=False)
        parallel, startup = time_envs(env_id, parallel=True)
        policy = time_policy(env_id, device, args.hidden_dim)
        out.append(f"| {env_id} | {serial:.2f} | {parallel:.2f} ({startup:.1f}) | {policy:.2f} | "
                   f"{(serial + policy) * STEPS / 1000:.2f}, {(parallel + policy) * STEPS / 1000:.2f} |")
        print(out[-1], flush=True)
    name = re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name() if device.type == "cuda" else "cpu").strip("_")
    path = os.path.join(ROOT, "benchmarks", "results", f"collection_speed_{name}.md")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
