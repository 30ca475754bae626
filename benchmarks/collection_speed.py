"""Where a collection step's time goes: the envs alone (serial against worker processes) and the policy alone.

    python benchmarks/collection_speed.py                     # Ant and Humanoid; about a minute on 16 cores
    python benchmarks/collection_speed.py --env-ids Ant       # one world

A training epoch collects 200 steps of 8 envs, one step at a time: the policy (csf.py's Actor, width 1024) samples
8 actions on the training device, and the vector env steps the 8 envs. This times the two apart, as medians over
REPEATS repeats of 200 steps:
  - the envs alone, stepped with random actions: a SyncVectorEnv in this process (--no-parallel-envs), the first
    half of them alone, and a ParallelVectorEnv (the default: the first slice in this process, the others in one
    worker each, one per usable core but this one's), the repeats interleaved; the × column is the median ratio of
    a parallel repeat to the serial one beside it (machines drift: compare within a run). The ParallelVectorEnv's
    step is this process's slice, stepped while the workers step theirs, plus the wait for the slowest worker and
    the messages. On a machine whose cores slow each other down (shared caches, hyperthreads, a busy host), the
    slice takes longer than the same envs stepped alone, which bounds the gain;
  - the policy alone: host to device copy of the observations, actor.sample, and the copy of the actions back, on
    the GPU when torch sees one (else on the CPU);
  - a tiny csf.py run end to end, with its envs in workers and without: what starting workers costs.
Prints one table and writes it to benchmarks/results/collection_speed_<device>.md.
"""

import argparse
import functools
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import gymnasium as gym
import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import csf  # noqa: E402
import envs  # noqa: E402

STEPS, REPEATS, NUM_ENVS = 200, 9, 8
TINY_RUN, TINY_REPEATS = "--total-env-steps 800 --num-envs 2 --hidden-dim 16 --learning-starts 400 --no-cuda", 3


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name()
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor() or "CPU")
    return f"{model}, {os.cpu_count()} cores"


def time_envs(env_id):
    """Median ms per vector step of NUM_ENVS envs with random actions: in this process (a SyncVectorEnv), its first
    half alone, and in a ParallelVectorEnv (its repeats interleaved with the serial ones), with the part of its step
    that this process spends on its own slice while the workers step theirs; the median of the per-repeat ratios
    parallel / serial; and the seconds from building the ParallelVectorEnv to its first reset's answer."""
    make = functools.partial(envs.make_env, env_id)
    serial = gym.vector.SyncVectorEnv([make] * NUM_ENVS, autoreset_mode=gym.vector.AutoresetMode.DISABLED)
    half = gym.vector.SyncVectorEnv([make] * (NUM_ENVS // 2), autoreset_mode=gym.vector.AutoresetMode.DISABLED)
    started = time.time()
    parallel = envs.ParallelVectorEnv([make] * NUM_ENVS)
    parallel.reset(seed=0)
    startup = time.time() - started
    own_slice = []  # ms of each step of this process's slice, inside the parallel steps
    step_own_slice = parallel._local.step

    def timed_step(actions):
        slice_started = time.perf_counter()
        result = step_own_slice(actions)
        own_slice.append((time.perf_counter() - slice_started) * 1000)
        return result

    parallel._local.step = timed_step
    rng = np.random.default_rng(0)
    times = {"serial": [], "half": [], "parallel": [], "own slice": []}
    for repeat in range(REPEATS):
        actions = rng.uniform(-1, 1, (STEPS, *serial.action_space.shape)).astype(np.float32)
        for name, vector_env in [("serial", serial), ("half", half), ("parallel", parallel)]:
            vector_env.reset(seed=repeat)
            own_slice.clear()
            started = time.perf_counter()
            for action in actions:
                vector_env.step(action[:vector_env.num_envs])
            times[name].append((time.perf_counter() - started) / STEPS * 1000)
        times["own slice"].append(statistics.mean(own_slice))
    for vector_env in (serial, half, parallel):
        vector_env.close()
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = statistics.median(p / s for p, s in zip(times["parallel"], times["serial"]))
    return medians, ratio, startup, parallel.num_workers


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


def time_tiny_runs():
    """Seconds of a tiny csf.py run end to end (TINY_RUN, a fresh interpreter each), with its envs in workers and
    without, the repeats interleaved: what every test and quick try pays for starting workers. Medians."""
    times = {"--parallel-envs": [], "--no-parallel-envs": []}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(TINY_REPEATS):
            for flag in times:
                started = time.time()
                subprocess.run([sys.executable, os.path.join(ROOT, "csf.py"), *TINY_RUN.split(), flag], cwd=folder,
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                times[flag].append(time.time() - started)
    return {flag: statistics.median(values) for flag, values in times.items()}


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
           "| world | envs, in this process | half of them, alone | envs, in a ParallelVectorEnv: ms (× in this "
           "process) | of which this process's slice, while the workers step theirs | workers (start-up s) | "
           f"policy on the {device.type.upper()}, width {args.hidden_dim} |",
           "|---|---|---|---|---|---|---|"]
    print("\n".join(out), flush=True)
    for env_id in args.env_ids:
        medians, ratio, startup, workers = time_envs(env_id)
        policy = time_policy(env_id, device, args.hidden_dim)
        out.append(f"| {env_id} | {medians['serial']:.2f} | {medians['half']:.2f} | {medians['parallel']:.2f} "
                   f"({ratio:.2f}×) | {medians['own slice']:.2f} | {workers} ({startup:.1f}) | {policy:.2f} |")
        print(out[-1], flush=True)
    tiny = time_tiny_runs()
    ratio = tiny["--parallel-envs"] / tiny["--no-parallel-envs"]
    out += ["", f"A tiny run, `python csf.py {TINY_RUN}`, end to end (medians of {TINY_REPEATS}, interleaved):", "",
            "| envs in workers (the default) | --no-parallel-envs | ratio |", "|---|---|---|",
            f"| {tiny['--parallel-envs']:.1f} s | {tiny['--no-parallel-envs']:.1f} s | {ratio:.2f}× |"]
    print("\n".join(out[-5:]), flush=True)
    name = re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name() if device.type == "cuda" else "cpu").strip("_")
    path = os.path.join(ROOT, "benchmarks", "results", f"collection_speed_{name}.md")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
