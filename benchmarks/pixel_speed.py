"""Speed and memory of the pixel worlds (Quadruped, Humanoid, Kitchen, Robobin): env steps/s with rendering, replay
bytes per transition, a short csf.py run on Humanoid at the paper's network sizes (ms per gradient step, SPS, peak
RSS), and the host's part of one Humanoid gradient step (benchmarks/step_profile.py): the host's ms in sampling and
in the gather, the waits for the device, with the buffer in host memory and with --buffer-on-device, and the step's
FLOPs. On a GPU the device's kernel time per step is measured (CUDA activity, warm-up steps left out); on a CPU it is
estimated from the FLOPs, and the waits are counted on tests/test_host_syncs.py's simulated GPU.

    python benchmarks/pixel_speed.py                 # about 10 minutes on 2 CPU cores
    python benchmarks/pixel_speed.py --grad-steps 20 # more gradient steps in the timed epoch

Prints one table and writes it to benchmarks/results/pixel_speed_<device>.md. csf.py runs on the GPU when
torch sees one, so the same command measures a GPU machine.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import csf  # noqa: E402
import envs  # noqa: E402
import step_profile  # noqa: E402

WORLDS = ("Quadruped", "Humanoid", "Kitchen", "Robobin")
# The estimate of a Humanoid step's device time on an H100 until one measures it: its FLOPs at 50-100 TFLOP/s, 10-20%
# of the H100's dense TF32 peak (495 TFLOP/s), what networks of this size at batch 256 typically reach
H100_EFFECTIVE_TFLOPS = (50, 100)
# one epoch of 200 steps collected, then a training epoch: its first steps are the warm-up
STEP_FLAGS = ["--env-id", "Humanoid", "--num-envs", "1", "--total-env-steps", "400", "--learning-starts", "200",
              "--num-eval-skills", "1"]
WARMUP_STEPS = 3


def env_steps_per_second(env_id, steps):
    env = envs.make_env(env_id)
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for t in range(steps):
        if (t + 1) % envs.ENV_SPECS[env_id].horizon == 0:
            env.reset()
        env.step(rng.uniform(-1, 1, env.action_space.shape))
    return steps / (time.perf_counter() - start)


def replay_bytes_per_transition(env_id):
    env, spec = envs.make_env(env_id), envs.ENV_SPECS[env_id]
    rb = csf.ReplayBuffer(spec.buffer_size, spec.horizon, env.observation_space, spec.frame_stack,
                          env.action_space.shape[0], csf.SKILL_DIMS[env_id], None)  # np.zeros: nothing touched yet
    total = rb.frames.nbytes + rb.actions.nbytes + rb.skills.nbytes
    return total / spec.buffer_size, total


def host_part(device):
    """(label, value) of the host's part of one Humanoid gradient step (width 1024, batch 256)."""
    cuda = device != "CPU"
    measured = {}
    for where, extra in (("host memory", []), ("--buffer-on-device", ["--buffer-on-device"])):
        print(f"profiling Humanoid gradient steps, replay buffer in {where}", flush=True)
        measured[where] = step_profile.profile_steps(
            "csf", [*STEP_FLAGS, "--grad-steps-per-epoch", str(WARMUP_STEPS + 5), *extra], WARMUP_STEPS)
    waits = ({where: m["syncs"] for where, m in measured.items()} if cuda else dict(zip(
        measured, step_profile.simulated_syncs(["csf", "csf+device"]).values())))
    cells = []
    for where, m in measured.items():
        cells.append((f"csf.py Humanoid gradient step, replay buffer in {where}: host ms in sampling (draw, gather, "
                      f"transfers{'' if cuda else ', stacking'}), in brackets the gather; median of {m['steps']} "
                      f"steps after {WARMUP_STEPS}", f"{m['host_ms']:.2f} ({m['gather_ms']:.2f})"))
        cells.append((f"csf.py Humanoid gradient step, replay buffer in {where}: waits for the device per step"
                      f"{'' if cuda else ' (simulated GPU, tests/test_host_syncs.py)'}", f"{waits[where]:g}"))
    print("counting the FLOPs of a Humanoid gradient step", flush=True)
    flops = step_profile.flops_per_step("csf", [*STEP_FLAGS, *([] if cuda else ["--no-cuda"])])
    cells.append(("csf.py Humanoid gradient step: FLOPs (forward, backward, Adam; torch's FlopCounterMode)",
                  f"{flops / 1e12:.3f} T"))
    if cuda:
        cells.append(("csf.py Humanoid gradient step: device ms (kernel time, CUDA activity), buffer in host memory",
                      f"{measured['host memory']['device_ms']:.2f}"))
    else:
        low, high = (flops / tflops / 1e9 for tflops in reversed(H100_EFFECTIVE_TFLOPS))
        cells.append((f"csf.py Humanoid gradient step: device ms on an H100, an estimate (the FLOPs at "
                      f"{H100_EFFECTIVE_TFLOPS[0]}-{H100_EFFECTIVE_TFLOPS[1]} TFLOP/s)", f"{low:.1f}-{high:.1f}"))
    return cells


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env-steps", type=int, default=400, help="steps timed per world")
    parser.add_argument("--grad-steps", type=int, default=10, help="gradient steps in the timed csf.py epoch")
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    rows = ["| what | " + " | ".join(WORLDS) + " |", "|---|" + "---|" * len(WORLDS)]
    sps = [env_steps_per_second(e, args.env_steps) for e in WORLDS]
    rows.append(f"| env steps/s, one env, 64×64 rendering ({envs.GL_BACKEND}) | " + " | ".join(f"{v:.0f}" for v in sps)
                + " |")
    sizes = [replay_bytes_per_transition(e) for e in WORLDS]
    rows.append("| replay bytes / transition (official: obs + next_obs, 3 frames each = 73,728 + tail) | "
                + " | ".join(f"{size[0]:,.0f}" for size in sizes) + " |")
    rows.append("| replay buffer at the world's capacity (official at 300k: ≈ 22 GB) | "
                + " | ".join(f"{size[1] / 1e9:.2f} GB ({envs.ENV_SPECS[e].buffer_size // 1000}k)"
                             for e, size in zip(WORLDS, sizes)) + " |")

    # a short csf.py run on Humanoid at the paper's sizes: 2 epochs of 8 × 200 steps, the second one training
    with tempfile.TemporaryDirectory() as cwd:
        cmd = [sys.executable, os.path.join(ROOT, "csf.py"), "--env-id", "Humanoid", "--total-env-steps", "3200",
               "--learning-starts", "1600", "--grad-steps-per-epoch", str(args.grad_steps)]
        print("running:", " ".join(cmd[1:]), flush=True)
        start = time.time()
        subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
        wall = time.time() - start
        (path,) = glob.glob(os.path.join(cwd, "runs", "*", "eval.jsonl"))
        last = [json.loads(line) for line in open(path)][-1]
    for label, value in ((f"csf.py Humanoid, width 1024, batch 256: ms / gradient step ({device})",
                          f"{last['ms_per_grad_step']:.0f}"),
                         (f"csf.py Humanoid: env steps/s of the training epochs, collection + {args.grad_steps} "
                          "gradient steps", f"{last['sps']:.0f}"),
                         ("csf.py Humanoid: peak RSS, 56 envs (8 training + 48 evaluation), 3,200 transitions stored",
                          f"{last['peak_rss_mb']:,.0f} MB"),
                         ("csf.py Humanoid: wall time of the whole command (2 evaluations of 48 rollouts included)",
                          f"{wall:.0f} s"), *host_part(device)):
        rows.append(f"| {label} | " + " | ".join(value if w == "Humanoid" else "–" for w in WORLDS) + " |")
    table = "\n".join(rows)
    command = f"python benchmarks/pixel_speed.py --env-steps {args.env_steps} --grad-steps {args.grad_steps}"
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    result_file = os.path.join(ROOT, "benchmarks", "results", f"pixel_speed_{'gpu' if device != 'CPU' else 'cpu'}.md")
    with open(result_file, "w") as f:
        f.write(f"# Pixel worlds: speed and memory ({device}, {os.cpu_count()} cores)\n\n`{command}`\n\n{table}\n")
    print(table)
    print(f"\nwritten to {os.path.relpath(result_file, ROOT)}")


if __name__ == "__main__":
    main()
