"""The two looks of the pixel worlds side by side: how long a 64×64 frame takes to draw, and how far the frames
of the "fast" look (no shadows, multisampling or reflections; Kitchen's arm drawn with its collision meshes) are
from the "official" look, which draws as the official code did.

    python benchmarks/render_quality.py              # about 3 minutes on a CPU
    python benchmarks/render_quality.py --steps 200  # more frames per world

For each world, two envs of the two looks take the same random actions from the same reset (their physics is
the same), and each step's newest 64×64 frame is compared. Prints one table and writes it to
benchmarks/results/render_quality_<backend>.md.
"""

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import envs  # noqa: E402

WORLDS = ("Quadruped", "Humanoid", "Kitchen", "Robobin")


def measure(env_id, steps):
    """ms per 64×64 frame (median over steps) of each look, and the pixel differences between the looks."""
    looks = {quality: envs.make_env(env_id, render_quality=quality) for quality in envs.RENDER_QUALITIES}
    for env in looks.values():
        env.reset(seed=0)
    rng = np.random.default_rng(0)
    times = {quality: [] for quality in looks}
    differences = []
    for _ in range(steps):
        action = rng.uniform(-1, 1, looks["official"].action_space.shape)
        frames = {}
        for quality, env in looks.items():
            env.step(action)
            start = time.perf_counter()
            frames[quality] = env.unwrapped._frame(envs.FRAME_SIZE).astype(np.int16)
            times[quality].append(time.perf_counter() - start)
        assert np.array_equal(looks["official"].unwrapped.data.qpos, looks["fast"].unwrapped.data.qpos)
        differences.append(np.abs(frames["official"] - frames["fast"]))
    for env in looks.values():
        env.close()
    differences = np.stack(differences)
    return {"official_ms": 1000 * np.median(times["official"]), "fast_ms": 1000 * np.median(times["fast"]),
            "mean_difference": differences.mean(), "pixels_over_32": (differences.max(-1) > 32).mean()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="env steps (frames) per world")
    args = parser.parse_args()
    rows = ["| world | official: ms / frame | fast: ms / frame | official / fast | mean \\|difference\\| (of 255) "
            "| pixels differing by > 32 |", "|---|---|---|---|---|---|"]
    for env_id in WORLDS:
        r = measure(env_id, args.steps)
        rows.append(f"| {env_id} | {r['official_ms']:.1f} | {r['fast_ms']:.1f} | {r['official_ms'] / r['fast_ms']:.1f}× "
                    f"| {r['mean_difference']:.1f} | {100 * r['pixels_over_32']:.1f}% |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    out = os.path.join(ROOT, "benchmarks", "results", f"render_quality_{envs.GL_BACKEND}.md")
    with open(out, "w") as f:
        f.write(f"# The two render looks ({envs.GL_BACKEND}, {args.steps} frames per world)\n\n"
                f"`python benchmarks/render_quality.py --steps {args.steps}`\n\n{table}\n")
    print(table)
    print(f"written to {os.path.relpath(out, ROOT)}")


if __name__ == "__main__":
    main()
