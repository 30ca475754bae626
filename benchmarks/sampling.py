"""How long the host takes to sample one minibatch from a full replay buffer: what a GPU waits for at every gradient
step before it can compute.

    python benchmarks/sampling.py        # about a minute; needs ~5 GB of memory for the pixel buffer

Two buffers of csf.py's ReplayBuffer, filled to capacity: pixels (300k transitions of 64×64 RGB frames, stacks of
3, Humanoid's and Quadruped's default) and states (1M transitions of Ant's 29-dim vectors). For each, the host's part
of a batch of 256 transitions (s, a, s', z), the index draw and gather of whole frames that `ReplayBuffer.sample` does
on the host (`gather` below), is timed 50 times, against the previous way,
kept here as the reference: the stacks of s and s' built on the host (numpy's moveaxis + reshape, which moves
3-byte runs). The stacking now happens on the training device (`ReplayBuffer.sample`); its time on this CPU, which is
a CPU-only run's cost, is the last column. Both ways give the same batch from the same random draws (checked).
Prints one table and writes it to benchmarks/results/sampling.md.
"""

import os
import sys
import time

import gymnasium as gym
import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import csf  # noqa: E402

BATCH, REPEATS = 256, 50


def host_stacked(rb, batch_size, rng):
    """The previous sampling: each stack built on the host, for s and for s'."""
    i = rng.integers(0, rb.size, batch_size)
    trajectory, t = i // rb.horizon, i % rb.horizon

    def observation(t):
        steps = np.maximum(t[:, None] + np.arange(1 - rb.frame_stack, 1), 0)
        frames = rb.frames[trajectory[:, None], steps]
        return np.moveaxis(frames, 1, -2).reshape(*frames.shape[:1], *frames.shape[2:-1], -1)

    batch = {"obs": observation(t), "action": rb.actions[trajectory, t], "next_obs": observation(t + 1),
             "skill": rb.skills[trajectory]}
    return {k: torch.as_tensor(v) for k, v in batch.items()}


def gather(rb, batch_size, rng):
    """The host's part of csf.ReplayBuffer.sample: the index draw, then the gather of whole frames of s and s'."""
    i = torch.as_tensor(rng.integers(0, rb.size, batch_size))
    trajectory, t = i // rb.horizon, i % rb.horizon
    steps = (t[:, None] + torch.arange(1 - rb.frame_stack, 2)).clip(min=0)
    return rb.frames[trajectory[:, None], steps], rb.actions[trajectory, t], rb.skills[trajectory]


def full_buffer(capacity, horizon, observation_space, frame_stack, action_dim):
    rb = csf.ReplayBuffer(capacity, horizon, observation_space, frame_stack, action_dim, 2, np.random.default_rng(0))
    fill = np.random.default_rng(1)
    chunk = 50  # trajectories per add
    shape = observation_space.shape
    for _ in range(len(rb.frames) // chunk):
        if observation_space.dtype == np.uint8:
            observations = fill.integers(0, 256, (chunk, horizon + 1, *shape), dtype=np.uint8)
        else:
            observations = fill.standard_normal((chunk, horizon + 1, *shape), dtype=np.float32)
        rb.add(observations, fill.uniform(-1, 1, (chunk, horizon, action_dim)).astype(np.float32),
               fill.standard_normal((chunk, 2), dtype=np.float32))
    return rb


def milliseconds(sample):
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        sample()
        times.append(1000 * (time.perf_counter() - start))
    return np.median(times), np.min(times)


def main():
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    pixels = gym.spaces.Box(0, 255, (64, 64, 9), np.uint8)
    states = gym.spaces.Box(-np.inf, np.inf, (29,), np.float32)
    rows = []
    for name, rb in (("pixels, 300k × 64×64×3, stacks of 3", full_buffer(300_000, 200, pixels, 3, 21)),
                     ("states, 1M × 29", full_buffer(1_000_000, 200, states, 1, 8))):
        new, old = rb.sample(BATCH, cpu, rng=np.random.default_rng(2)), host_stacked(rb, BATCH, np.random.default_rng(2))
        assert all(torch.equal(new[key], old[key]) for key in old), "the two samplings differ"
        draws = np.random.default_rng(3)
        host = milliseconds(lambda: gather(rb, BATCH, draws))
        before = milliseconds(lambda: host_stacked(rb, BATCH, draws))
        on_cpu = milliseconds(lambda: rb.sample(BATCH, cpu, rng=draws))
        rows.append(f"| {name} | {BATCH} | {host[0]:.2f} ({host[1]:.2f}) | {before[0]:.2f} ({before[1]:.2f}) | "
                    f"{before[0] / host[0]:.0f}× | {on_cpu[0]:.2f} ({on_cpu[1]:.2f}) |")
        del rb
    table = "\n".join(["| buffer | batch | host ms per batch, median (min) | stacked on the host before, median (min) | "
                       "speed-up | whole sample on this CPU, median (min) |", "|---|---|---|---|---|---|", *rows])
    print(table)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "sampling.md"), "w") as f:
        f.write("Host time to sample one minibatch (obs and next obs) on the CPU, one torch thread "
                "(`python benchmarks/sampling.py`).\n\n" + table + "\n")


if __name__ == "__main__":
    main()
