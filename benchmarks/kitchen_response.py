"""Kitchen's end effector under scripted actions, in this project's world (MuJoCo 3) beside the official one (2.2.1).

    python benchmarks/kitchen_response.py     # a few seconds

From a reset (seed 0), link7, the body the mocap drives, is moved by 5 steps of one action: a = +x, +z or -y (the
position parts), a3 = 1 (the turn about the world z axis), or 50 zero-action steps (the drift under gravity and the
arm's servos). The table gives link7's displacement along the action's axis (the whole vector for the drift), or the
angle it turned, against the official env's under MuJoCo 2.2.1 (d4rl's kitchen_multitask_v0.py under the official
franka_kitchen_ee_ctrl.xml, measured by the project on the same actions), and their ratio. Prints one table and
writes it to benchmarks/results/kitchen_response.md.
"""

import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import envs  # noqa: E402

# motion: (action, steps, axis (None: the whole displacement; "turn": the angle), the official 2.2.1 value)
MOTIONS = {
    "a = +z, 5 steps (m)": ((0, 0, 1, 0, 0, 0, 0), 5, 2, 0.427),
    "a = +x, 5 steps (m)": ((1, 0, 0, 0, 0, 0, 0), 5, 0, 0.276),
    "a = -y, 5 steps (m)": ((0, -1, 0, 0, 0, 0, 0), 5, 1, -0.422),
    "a3 = 1, 5 steps: turn (°)": ((0, 0, 0, 1, 0, 0, 0), 5, "turn", 24.0),
    "a = 0, 50 steps: drift (m)": ((0, 0, 0, 0, 0, 0, 0), 50, None, (-0.121, -0.220, 0.080)),
}


def respond(action, steps, axis):
    """link7's displacement along `axis` (or the whole vector, or the angle turned in degrees) after `steps` steps
    of `action` from a reset."""
    env = envs.make_env("Kitchen")
    env.reset(seed=0)
    world = env.unwrapped
    link7 = world.model.body("panda0_link7").id
    position, orientation = world.data.xpos[link7].copy(), world.data.xquat[link7].copy()
    for _ in range(steps):
        env.step(np.asarray(action, np.float32))
    moved = world.data.xpos[link7] - position
    turned = np.degrees(2 * np.arccos(min(1.0, abs(float(np.dot(orientation, world.data.xquat[link7]))))))
    env.close()
    return turned if axis == "turn" else moved if axis is None else moved[axis]


def cell(value):
    return f"({', '.join(f'{v:+.3f}' for v in value)})" if np.ndim(value) else f"{value:+.3f}"


def main():
    out = ["# Kitchen's end effector under scripted actions, MuJoCo 3 against 2.2.1", "",
           "`python benchmarks/kitchen_response.py`", "",
           "| motion, from a reset | this project (MuJoCo 3.3) | official (MuJoCo 2.2.1) | ratio |", "|---|---|---|---|"]
    for motion, (action, steps, axis, official) in MOTIONS.items():
        ours = respond(action, steps, axis)
        ratio = (", ".join(f"{o / r:.2f}" for o, r in zip(ours, official)) if np.ndim(ours)
                 else f"{ours / official:.2f}")
        out.append(f"| {motion} | {cell(ours)} | {cell(official)} | {ratio} |")
    print("\n".join(out))
    path = os.path.join(ROOT, "benchmarks", "results", "kitchen_response.md")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
