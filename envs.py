"""Environments shared by every cleanmisl agent, and the per-env facts the agents need.

State-based worlds (paper App. B, spec §3.1-3.2): Gym's Ant and HalfCheetah models (the copies that
ship with gymnasium, "track" camera included), frame skip 5, observation = qpos ⊕ qvel with the global
x (and y) kept, never terminating, 200-step horizon, and the fixed "preset" observation normalization
of the official code (spec §1.10). Each env reports the coordinates used by the coverage metric in
`info["coordinates"]`, raw (before normalization): Ant (x, y), HalfCheetah (x,).
"""

import dataclasses
import glob
import os

# Headless rendering: MuJoCo picks its OpenGL backend when it is imported. EGL needs a GPU render node;
# without one, OSMesa renders on the CPU (Debian/Ubuntu package libosmesa6).
os.environ.setdefault("MUJOCO_GL", "egl" if glob.glob("/dev/dri/renderD*") else "osmesa")

import gymnasium as gym  # noqa: E402
import mujoco  # noqa: E402
import numpy as np  # noqa: E402

MODEL_DIR = os.path.join(os.path.dirname(gym.__file__), "envs", "mujoco", "assets")


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """The facts an agent needs about an env; an agent flag left unset takes these values (spec §1, §2.7)."""

    horizon: int  # env steps per trajectory
    num_envs: int  # trajectories collected per epoch
    grad_steps_per_epoch: int
    buffer_size: int  # replay capacity in transitions
    eval_every: int  # epochs between evaluations (CSF/METRA scripts, spec §4.1)
    total_env_steps: int  # training budget used for the paper's skill checkpoints (spec §1.1)
    goal_range: float  # zero-shot goals are drawn from U(-goal_range, goal_range) per coordinate
    coord_dim: int  # 2 for (x, y), 1 for x only


ENV_SPECS = {
    "Ant": EnvSpec(200, 8, 50, 1_000_000, 500, 64_000_000, 50.0, 2),
    "HalfCheetah": EnvSpec(200, 8, 50, 1_000_000, 1000, 64_000_000, 100.0, 1),
}

# Preset normalizer statistics of the official code, from 10k random rollouts (spec §1.10).
# fmt: off
ANT_MEAN = [0.00486117, 0.011312, 0.7022248, 0.8454677, -0.00102548, -0.00300276, 0.00311523, -0.00139029, 0.8607109, -0.00185301, -0.8556998, 0.00343217, -0.8585605, -0.00109082, 0.8558013, 0.00278213, 0.00618173, -0.02584622, -0.00599026, -0.00379596, 0.00526138, -0.0059213, 0.27686235, 0.00512205, -0.27617684, -0.0033233, -0.2766923, 0.00268359, 0.27756855]
ANT_STD = [0.62473416, 0.61958003, 0.1717569, 0.28629342, 0.20020866, 0.20572574, 0.34922406, 0.40098143, 0.3114514, 0.4024826, 0.31057045, 0.40343934, 0.3110796, 0.40245822, 0.31100526, 0.81786263, 0.8166509, 0.9870919, 1.7525449, 1.7468817, 1.8596431, 4.502961, 4.4070187, 4.522444, 4.3518476, 4.5105968, 4.3704205, 4.5175962, 4.3704395]
CHEETAH_MEAN = [-0.07861924, -0.08627162, 0.08968642, 0.00960849, 0.02950368, -0.00948337, 0.01661406, -0.05476654, -0.04932635, -0.08061652, -0.05205841, 0.04500197, 0.02638421, -0.04570961, 0.03183838, 0.01736591, 0.0091929, -0.0115027]
CHEETAH_STD = [0.4039283, 0.07610687, 0.23817, 0.2515473, 0.2698137, 0.26374814, 0.32229397, 0.2896734, 0.2774097, 0.73060024, 0.77360505, 1.5871304, 5.5405455, 6.7097645, 6.8253727, 6.3142195, 6.417641, 5.9759197]
# fmt: on


class LocomotionEnv(gym.Env):
    """A MuJoCo body on an open floor: obs = normalize(qpos ⊕ qvel), never terminates."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}

    def __init__(self, xml_file, obs_mean, obs_std, coord_dim, render_mode=None, frame_skip=5):
        self.model = mujoco.MjModel.from_xml_path(os.path.join(MODEL_DIR, xml_file))
        self.data = mujoco.MjData(self.model)
        self.frame_skip = frame_skip
        self.coord_dim = coord_dim
        self.obs_mean = np.asarray(obs_mean, dtype=np.float64)
        self.obs_std = np.asarray(obs_std, dtype=np.float64)
        self.render_mode = render_mode
        self.renderer = None
        obs_dim = self.model.nq + self.model.nv  # Ant 15 + 14, HalfCheetah 9 + 9
        assert obs_dim == len(obs_mean)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (obs_dim,), np.float32)
        low, high = self.model.actuator_ctrlrange.T  # [-1, 1] for every actuator of both models
        self.action_space = gym.spaces.Box(low.astype(np.float32), high.astype(np.float32))

    def _obs(self):
        raw = np.concatenate([self.data.qpos, self.data.qvel])
        return ((raw - self.obs_mean) / (self.obs_std + 1e-8)).astype(np.float32)

    def _info(self):
        return {"coordinates": self.data.qpos[: self.coord_dim].copy()}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        # Gym's reset noise: qpos0 + U(-0.1, 0.1), qvel 0.1 N(0, 1) (spec §3.1)
        mujoco.mj_resetData(self.model, self.data)
        self.data.qpos[:] = self.model.qpos0 + self.np_random.uniform(-0.1, 0.1, self.model.nq)
        self.data.qvel[:] = 0.1 * self.np_random.standard_normal(self.model.nv)
        mujoco.mj_forward(self.model, self.data)
        return self._obs(), self._info()

    def step(self, action):
        self.data.ctrl[:] = np.clip(action, self.action_space.low, self.action_space.high)
        mujoco.mj_step(self.model, self.data, nstep=self.frame_skip)
        return self._obs(), 0.0, False, False, self._info()  # skill discovery ignores the env reward

    def render(self):
        if self.renderer is None:
            self.renderer = mujoco.Renderer(self.model, 128, 128)
        self.renderer.update_scene(self.data, camera="track")
        return self.renderer.render()

    def close(self):
        if self.renderer is not None:
            self.renderer.close()
            self.renderer = None


def make_env(env_id, render_mode=None):
    """The env of the paper named `env_id`, with its time limit. Raises ValueError for an unknown id."""
    if env_id not in ENV_SPECS:
        raise ValueError(f"unknown env {env_id!r}; choose one of {', '.join(ENV_SPECS)}")
    if env_id == "Ant":
        env = LocomotionEnv("ant.xml", ANT_MEAN, ANT_STD, coord_dim=2, render_mode=render_mode)
    else:
        env = LocomotionEnv("half_cheetah.xml", CHEETAH_MEAN, CHEETAH_STD, coord_dim=1, render_mode=render_mode)
    return gym.wrappers.TimeLimit(env, ENV_SPECS[env_id].horizon)


def coverage(coordinates):
    """State coverage (spec §4.2): the number of distinct 1×1 cells (1-unit bins for x only) visited.

    `coordinates` has shape (..., coord_dim); every point of every trajectory counts.
    """
    cells = np.floor(np.asarray(coordinates)).astype(np.int64)
    return len(np.unique(cells.reshape(-1, cells.shape[-1]), axis=0))
