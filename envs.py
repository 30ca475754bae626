"""Environments shared by every cleanmisl agent, and the per-env facts the agents need.

State-based worlds (paper App. B, spec §3.1-3.2): Gym's Ant and HalfCheetah models (the copies that
ship with gymnasium, "track" camera included), frame skip 5, observation = qpos ⊕ qvel with the global
x (and y) kept, never terminating, 200-step horizon, and the fixed "preset" observation normalization
of the official code (spec §1.10). Each env reports the coordinates used by the coverage metric in
`info["coordinates"]`, raw (before normalization): Ant (x, y), HalfCheetah (x,).

Pixel worlds (spec §3.3): DMC's Quadruped and Humanoid with the paper's changes (no walls/ball/terrain
for the quadruped, a 15×15 floor painted with one colour gradient so absolute position shows in the
COM-tracking camera). Observation = the last 3 frames of 64×64 RGB, stacked along channels oldest first,
shape (64, 64, 9) uint8; action repeat 2, actions in [-1, 1], never terminating, 200-step horizon;
`info["coordinates"]` = torso geom (x, y). `PixelEncoder` is the CNN every network puts in front of such
observations (spec §1.9); `make_encoder` gives it, or an identity for state vectors.

Manipulation worlds (spec §3.4-3.5), pixels as above, never terminating, one fixed start whatever the seed:
Kitchen, D4RL's Franka kitchen (gymnasium-robotics' MJCF) under end-effector control, 7-D actions, 50-step
horizon, `info["coordinates"]` = the 6 success flags of KITCHEN_TASKS; Robobin, a Sawyer arm with two blocks in
a bin (built from metaworld's assets), 4-D actions, 200-step horizon, `info["coordinates"]` = the 9-D (hand,
block 1, block 2) positions.

All worlds come from `make_env(env_id, render_mode)`; `render()` gives a 128×128 RGB frame for videos,
and `env.unwrapped.goal_observation(goal)` the zero-shot goal observation of spec §4.3 (Kitchen and Robobin:
`task_goal_observation(i)` and `task_success(i)` for task i of KITCHEN_TASKS / ROBOBIN_TASKS).

The downstream tasks of hierarchical control (spec §4.4) come from `make_task(task, render_mode)`, their
facts from `TASKS`: a base world with task dims after its observation (raw: goal, or next hurdle) and the
task's reward, on the base world's actions, dynamics and 200-step time limit. A pixel task's observation
is {"pixels": stacked frames, "goal": (x, y)}; `make_encoder` gives its encoder too.
"""

import collections
import ctypes
import ctypes.util
import dataclasses
import functools
import glob
import hashlib
import importlib.util
import os
import weakref
import xml.etree.ElementTree as ET

# Headless rendering: MuJoCo picks its OpenGL backend when it is imported. EGL needs a GPU render node;
# without one, OSMesa renders on the CPU (Debian/Ubuntu package libosmesa6).
GL_BACKEND = os.environ.setdefault("MUJOCO_GL", "egl" if glob.glob("/dev/dri/renderD*") else "osmesa")
GL_LIBRARIES = {"osmesa": ("OSMesa", "libosmesa6"), "egl": ("EGL", "libegl1")}  # backend: (library, package)


def _library_loads(name):
    """Whether the shared library lib<name> is installed and loads."""
    path = ctypes.util.find_library(name)
    if path is None:
        return False
    try:
        ctypes.CDLL(path)
    except OSError:
        return False
    return True


# `import mujoco` itself fails when the backend's library is missing; then import it without GL, so the
# state-based worlds still work and the pixel worlds raise a clear error in make_env (see _gl_error).
GL_MISSING = GL_BACKEND in GL_LIBRARIES and not _library_loads(GL_LIBRARIES[GL_BACKEND][0])
os.environ["MUJOCO_GL"] = "disable" if GL_MISSING else GL_BACKEND
import mujoco  # noqa: E402

# dm_control only simulates here (Renderer below draws with mujoco's own GL bindings): import it without GL,
# since with EGL it opens a display at import time and raises ImportError where that fails.
os.environ["MUJOCO_GL"] = "disable"
from dm_control import mujoco as dm_mujoco  # noqa: E402
from dm_control.rl import control  # noqa: E402
from dm_control.suite import base, common, humanoid, quadruped  # noqa: E402
from dm_control.suite.utils import randomizers  # noqa: E402

os.environ["MUJOCO_GL"] = GL_BACKEND

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

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
    pixels: bool  # obs is a (64, 64, 3·frame_stack) uint8 image for PixelEncoder, not a state vector
    frame_stack: int  # frames per observation (1: a single state vector)


ENV_SPECS = {
    "Ant": EnvSpec(200, 8, 50, 1_000_000, 500, 64_000_000, 50.0, 2, pixels=False, frame_stack=1),
    "HalfCheetah": EnvSpec(200, 8, 50, 1_000_000, 1000, 64_000_000, 100.0, 1, pixels=False, frame_stack=1),
    "Quadruped": EnvSpec(200, 8, 200, 300_000, 125, 4_800_000, 15.0, 2, pixels=True, frame_stack=3),
    "Humanoid": EnvSpec(200, 8, 200, 300_000, 125, 4_800_000, 10.0, 2, pixels=True, frame_stack=3),
    "Kitchen": EnvSpec(50, 8, 100, 100_000, 250, 4_800_000, 0.0, 6, pixels=True, frame_stack=3),
    "Robobin": EnvSpec(200, 10, 100, 300_000, 500, 4_800_000, 0.0, 9, pixels=True, frame_stack=3),
}

# Preset normalizer statistics of the official code, from 10k random rollouts (spec §1.10).
# fmt: off
ANT_MEAN = [0.00486117, 0.011312, 0.7022248, 0.8454677, -0.00102548, -0.00300276, 0.00311523, -0.00139029, 0.8607109, -0.00185301, -0.8556998, 0.00343217, -0.8585605, -0.00109082, 0.8558013, 0.00278213, 0.00618173, -0.02584622, -0.00599026, -0.00379596, 0.00526138, -0.0059213, 0.27686235, 0.00512205, -0.27617684, -0.0033233, -0.2766923, 0.00268359, 0.27756855]
ANT_STD = [0.62473416, 0.61958003, 0.1717569, 0.28629342, 0.20020866, 0.20572574, 0.34922406, 0.40098143, 0.3114514, 0.4024826, 0.31057045, 0.40343934, 0.3110796, 0.40245822, 0.31100526, 0.81786263, 0.8166509, 0.9870919, 1.7525449, 1.7468817, 1.8596431, 4.502961, 4.4070187, 4.522444, 4.3518476, 4.5105968, 4.3704205, 4.5175962, 4.3704395]
CHEETAH_MEAN = [-0.07861924, -0.08627162, 0.08968642, 0.00960849, 0.02950368, -0.00948337, 0.01661406, -0.05476654, -0.04932635, -0.08061652, -0.05205841, 0.04500197, 0.02638421, -0.04570961, 0.03183838, 0.01736591, 0.0091929, -0.0115027]
CHEETAH_STD = [0.4039283, 0.07610687, 0.23817, 0.2515473, 0.2698137, 0.26374814, 0.32229397, 0.2896734, 0.2774097, 0.73060024, 0.77360505, 1.5871304, 5.5405455, 6.7097645, 6.8253727, 6.3142195, 6.417641, 5.9759197]
# fmt: on

VIDEO_SIZE = 128  # render() frames, for videos
FRAME_SIZE = 64  # pixel observations (spec §1.9)
FRAME_STACK = 3
ACTION_REPEAT = 2  # pixel worlds (spec §3.3)


class RenderUnavailable(RuntimeError):
    """No OpenGL context can be made; the message is one line naming the system package to install."""


def _gl_error(reason):
    """One line saying why no OpenGL context could be made, and what fixes it."""
    loaded = getattr(mujoco, "GLContext", None)  # the backend mujoco took when it was first imported
    loaded = loaded.__module__.rsplit(".", 1)[-1] if loaded else "disable"
    if not GL_MISSING and loaded != GL_BACKEND:
        return (f"cannot render ({reason}): mujoco was imported before envs.py and took MUJOCO_GL={loaded}; "
                f"import envs first, or export MUJOCO_GL={GL_BACKEND}")
    package = GL_LIBRARIES.get(GL_BACKEND, (None, None))[1]
    fix = (f"install the system package {package} (apt-get install {package})" if package else
           "use MUJOCO_GL=osmesa with the system package libosmesa6, or MUJOCO_GL=egl with libegl1")
    return f"cannot render with MUJOCO_GL={GL_BACKEND} ({reason}); {fix}"


class Renderer:
    """A size×size offscreen view through one camera, without shadows, multisampling or reflections.

    Speed of 64×64 frames on this 2-core CPU with OSMesa, measured while two training runs shared it
    (so ±30%): DMC's default rendering (4× multisampling, 2048² shadow map) gives ~20 frames/s for either
    world, this one 250-400 (shadows alone cost ~10×, multisampling ~1.5×; reflections nothing, as no floor
    here reflects); EGL on Mesa's llvmpipe is about the same. A whole pixel env step (physics included)
    then runs at 130-340 steps/s. The 64×64 images still show the floor gradient and the body clearly, so
    every world renders this way (Ant/HalfCheetah videos included).

    Unlike mujoco.Renderer (3.3), closing or garbage-collecting it frees its GL objects inside its own GL
    context: mujoco.Renderer frees them in whichever context is current, i.e. in another env's renderer,
    whose images then turn to garbage.

    A render context holds a copy of the model's textures and meshes (Kitchen's: 200 MB with OSMesa), so the
    envs of one process whose models are byte-identical share one Renderer (`MujocoEnv._frame`): 56 Kitchen
    envs (8 training, 48 evaluation) otherwise take 12 GB. `render` draws any such model's `data`.
    """

    def __init__(self, model, size):
        if GL_MISSING:
            raise RenderUnavailable(_gl_error(f"lib{GL_LIBRARIES[GL_BACKEND][0]} does not load"))
        model.vis.quality.offsamples = 0  # no multisampling; read when the render context is made
        model.vis.quality.shadowsize = 0  # no shadow map
        try:
            self._gl = mujoco.GLContext(size, size)
            self._gl.make_current()
            self._context = mujoco.MjrContext(model, mujoco.mjtFontScale.mjFONTSCALE_100)
        except Exception as err:  # the backend loaded, but no context could be made (e.g. EGL without a device)
            raise RenderUnavailable(_gl_error(f"{type(err).__name__}: {str(err).strip().splitlines()[0]}")) from err
        mujoco.mjr_setBuffer(mujoco.mjtFramebuffer.mjFB_OFFSCREEN, self._context)
        self._scene = mujoco.MjvScene(model, maxgeom=1000)
        self._scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        self._scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        self._option, self._camera = mujoco.MjvOption(), mujoco.MjvCamera()
        self._camera.type = mujoco.mjtCamera.mjCAMERA_FIXED
        self._rect = mujoco.MjrRect(0, 0, size, size)
        self._pixels = np.empty((size, size, 3), np.uint8)

    def render(self, model, data, camera):
        """The view of `data` through `camera`: the name of one of the model's cameras, or a free
        mujoco.MjvCamera. `model` is the one this Renderer was made for, or a byte-identical copy."""
        if isinstance(camera, str):
            self._camera.fixedcamid = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, camera)
            camera = self._camera
        mujoco.mjv_updateScene(model, data, self._option, None, camera, mujoco.mjtCatBit.mjCAT_ALL, self._scene)
        self._gl.make_current()
        mujoco.mjr_render(self._rect, self._scene, self._context)
        mujoco.mjr_readPixels(self._pixels, None, self._rect, self._context)
        return self._pixels[::-1].copy()  # OpenGL rows run bottom-up

    def close(self):
        if getattr(self, "_context", None) is not None:
            self._gl.make_current()
            self._context.free()
            self._gl.free()
            self._context = None

    __del__ = close


class MujocoEnv(gym.Env):
    """What every world shares: `model`/`data` (raw MuJoCo), rendering from `camera` (a camera name of the
    model, or a free mujoco.MjvCamera), no reward, no end."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}
    camera = "track"

    def __init__(self, render_mode=None):
        self.render_mode = render_mode
        self._renderers = {}  # side length -> Renderer, found or made on first use

    def _frame(self, size):
        if size not in self._renderers:
            model_bytes = np.empty(mujoco.mj_sizeModel(self.model), np.uint8)
            mujoco.mj_saveModel(self.model, None, model_bytes)
            key = (hashlib.blake2b(model_bytes).digest(), size)
            self._renderers[size] = _RENDERERS.get(key) or _RENDERERS.setdefault(key, Renderer(self.model, size))
        return self._renderers[size].render(self.model, self.data, self.camera)

    def render(self):
        return self._frame(VIDEO_SIZE)

    def close(self):
        self._renderers.clear()  # a Renderer no env holds any more frees itself


# (model bytes digest, side length) -> the Renderer that the envs with such a model share, while one holds it
_RENDERERS = weakref.WeakValueDictionary()


class LocomotionEnv(MujocoEnv):
    """A MuJoCo body on an open floor: obs = normalize(qpos ⊕ qvel), never terminates."""

    def __init__(self, xml_file, obs_mean, obs_std, coord_dim, render_mode=None, frame_skip=5):
        super().__init__(render_mode)
        self.model = self._load_model(os.path.join(MODEL_DIR, xml_file))
        self.data = mujoco.MjData(self.model)
        self.frame_skip = frame_skip
        self.coord_dim = coord_dim
        self.obs_mean = np.asarray(obs_mean, dtype=np.float64)
        self.obs_std = np.asarray(obs_std, dtype=np.float64)
        obs_dim = self.model.nq + self.model.nv  # Ant 15 + 14, HalfCheetah 9 + 9
        assert obs_dim == len(obs_mean)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (obs_dim,), np.float32)
        low, high = self.model.actuator_ctrlrange.T  # [-1, 1] for every actuator of both models
        self.action_space = gym.spaces.Box(low.astype(np.float32), high.astype(np.float32))

    def _load_model(self, path):
        return mujoco.MjModel.from_xml_path(path)

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

    def goal_observation(self, goal):
        """Zero-shot goal (spec §4.3): a fresh reset state with its x (, y) replaced by `goal`, normalized.
        Leaves the env mid-episode: reset it before the next episode."""
        self.reset()
        self.data.qpos[: self.coord_dim] = goal
        return self._obs()


# ---------------------------------------------------------------- pixel worlds (DMC, spec §3.3)


def _pixel_world_xml(xml):
    """The paper's floor: 15×15 half-extent, material "mygrid" = one 300×300 texture spread once over it."""
    root = ET.fromstring(xml)
    asset = ET.SubElement(root, "asset")
    ET.SubElement(asset, "texture", name="mygrid", type="2d", builtin="flat", width="300", height="300")
    ET.SubElement(asset, "material", name="mygrid", texture="mygrid", texrepeat="1 1")  # not texuniform
    floor = root.find(".//geom[@name='floor']")
    floor.set("material", "mygrid")
    floor.set("size", "15 15 " + floor.get("size").split()[2])  # Humanoid 100×100 -> 15×15
    return ET.tostring(root)


def _paint_floor_gradient(model):
    """Every 2-D texture: texel (row x, col y) = RGB (255·x/H, 255·y/W, 128); every texrepeat 1.

    So each floor location has its own colour and the COM-tracking camera shows absolute position (on the
    floor, red falls along +y and green rises along +x). Must run before the first renderer is made, since
    that is when the textures are uploaded.
    """
    for tex in np.flatnonzero(model.tex_type == mujoco.mjtTexture.mjTEXTURE_2D):
        h, w, c = model.tex_height[tex], model.tex_width[tex], model.tex_nchannel[tex]
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        texels = np.full((h, w, c), 255, np.uint8)  # opaque alpha, if any
        texels[..., 0], texels[..., 1], texels[..., 2] = 255 * rows / h, 255 * cols / w, 128
        model.tex_data[model.tex_adr[tex] : model.tex_adr[tex] + h * w * c] = texels.ravel()
    model.mat_texrepeat[:] = 1


def _quadruped_pose(physics, random):
    """Near-upright (identity quaternion + 0.02·N(0, I), renormalized) at x = y = 0, lifted in 1 cm
    steps until nothing touches (the paper's Move task; DMC's own run task draws any orientation)."""
    quat = np.array([1.0, 0.0, 0.0, 0.0]) + 0.02 * random.randn(4)
    quat /= np.linalg.norm(quat)
    for z in np.arange(0.0, 5.0, 0.01):
        try:
            with physics.reset_context():
                physics.named.data.qpos["root"] = [0.0, 0.0, z, *quat]
        except control.PhysicsError:  # deep in the floor, the contact buffer can overflow
            continue
        if physics.data.ncon == 0:
            return
    raise RuntimeError("found no contact-free height for the quadruped")


def _humanoid_pose(physics, random):
    """DMC's humanoid start: limited joints and the root rotation drawn at random until nothing penetrates."""
    while True:
        randomizers.randomize_limited_and_rotational_joints(physics, random)
        physics.after_reset()
        if physics.data.ncon == 0:
            return


class _PoseTask(base.Task):
    """A DMC task that only sets the initial pose: no reward, no state observation, never ends."""

    def __init__(self, set_pose):
        super().__init__(random=0)  # reseeded from the env's gymnasium generator at every reset
        self._set_pose = set_pose

    def initialize_episode(self, physics):
        self._set_pose(physics, self.random)
        super().initialize_episode(physics)

    def get_observation(self, physics):
        return collections.OrderedDict()

    def get_reward(self, physics):
        return 0.0


class PixelEnv(MujocoEnv):
    """A world seen through `camera`: obs = the last 3 64×64 RGB frames, stacked along channels oldest first
    (spec §1.9), shape (64, 64, 9) uint8."""

    def __init__(self, render_mode=None):
        super().__init__(render_mode)
        self.observation_space = gym.spaces.Box(0, 255, (FRAME_SIZE, FRAME_SIZE, 3 * FRAME_STACK), np.uint8)
        self._frames = collections.deque(maxlen=FRAME_STACK)

    def _obs(self):
        return np.concatenate(self._frames, axis=-1)

    def _first_obs(self):
        """The observation at reset: the current view, repeated."""
        self._frames.extend([self._frame(FRAME_SIZE)] * FRAME_STACK)
        return self._obs()

    def _next_obs(self):
        """The observation after a step: the current view in, the oldest frame out."""
        self._frames.append(self._frame(FRAME_SIZE))
        return self._obs()

    def _goal_obs(self):
        """A zero-shot goal image (spec §4.3): the current view tiled 3 times along channels."""
        return np.concatenate([self._frame(FRAME_SIZE)] * FRAME_STACK, axis=-1)


class DMCPixelEnv(PixelEnv):
    """A DMC body seen by its COM-tracking camera."""

    def __init__(self, xml, assets, set_pose, control_timestep, camera, goal_settle_steps, render_mode=None):
        super().__init__(render_mode)
        self.physics = dm_mujoco.Physics.from_xml_string(_pixel_world_xml(xml), assets)
        self.model, self.data = self.physics.model.ptr, self.physics.data.ptr
        _paint_floor_gradient(self.model)
        self.camera = camera
        self.goal_settle_steps = goal_settle_steps
        self._task = _PoseTask(set_pose)
        # action repeat as a longer control step: the same action held for 2 DMC control steps; no time
        # limit here (gymnasium's TimeLimit ends episodes)
        self._env = control.Environment(self.physics, self._task, control_timestep=ACTION_REPEAT * control_timestep)
        self.metadata = {**self.metadata, "render_fps": round(1 / self._env.control_timestep())}
        spec = self._env.action_spec()
        self._ctrl_low, self._ctrl_high = spec.minimum, spec.maximum
        self.action_space = gym.spaces.Box(-1.0, 1.0, spec.shape, np.float32)  # mapped onto the spec bounds
        self._torso = mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_GEOM, "torso")
        self._frame(FRAME_SIZE)  # make the GL context now, so a missing backend fails inside make_env

    def _info(self):
        # torso geom (x, y) (spec §3.3); it sits on the root body's origin, so it also equals qpos[0:2]
        return {"coordinates": self.data.geom_xpos[self._torso, :2].copy()}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._task.random.seed(int(self.np_random.integers(2**32)))  # every draw derives from the gym seed
        self._env.reset()
        return self._first_obs(), self._info()

    def step(self, action):
        action = np.clip(action, -1.0, 1.0)
        self._env.step(self._ctrl_low + (action + 1.0) * (self._ctrl_high - self._ctrl_low) / 2)
        return self._next_obs(), 0.0, False, False, self._info()

    def goal_observation(self, goal):
        """Zero-shot goal (spec §4.3): reset, move the root to (x, y) = `goal`, settle with zero actions
        (Quadruped 1 step, Humanoid 50), and tile that one frame 3 times along channels. Leaves the env
        mid-episode: reset it before the next episode."""
        self.reset()
        self.data.qpos[:2] = goal
        self.physics.after_reset()
        for _ in range(self.goal_settle_steps):
            self.step(np.zeros(self.action_space.shape))
        return self._goal_obs()


# ---------------------------------------------------------------- manipulation worlds (spec §3.4, §3.5)

ARM_STATE = mujoco.mjtState.mjSTATE_INTEGRATION  # everything the next mj_step reads, mocap poses included


def _package_dir(name):
    """The folder of the installed package `name`, found without importing it (only its MJCF files are used;
    importing gymnasium_robotics registers its envs and prints warnings)."""
    return os.path.dirname(importlib.util.find_spec(name).origin)


def _free_camera(distance, lookat, azimuth, elevation):
    camera = mujoco.MjvCamera()
    camera.type = mujoco.mjtCamera.mjCAMERA_FREE
    camera.distance, camera.lookat[:], camera.azimuth, camera.elevation = distance, lookat, azimuth, elevation
    return camera


class ArmEnv(PixelEnv):
    """A robot arm moved through a mocap body among objects, seen by a free camera. Every episode starts
    from the same state `_start` whatever the seed (spec §3.4-3.5). A subclass sets `_start` (see `_save`)
    and defines `_act(action)`, the physics of one env step, and `_coordinates()`."""

    def __init__(self, model, frame_skip, camera, action_dim, render_mode=None):
        super().__init__(render_mode)
        self.model, self.data = model, mujoco.MjData(model)
        self.frame_skip, self.camera = frame_skip, camera
        self.action_space = gym.spaces.Box(-1.0, 1.0, (action_dim,), np.float32)
        self.metadata = {**self.metadata, "render_fps": round(1 / (frame_skip * model.opt.timestep))}

    def _save(self):
        state = np.empty(mujoco.mj_stateSize(self.model, ARM_STATE))
        mujoco.mj_getState(self.model, self.data, state, ARM_STATE)
        return state

    def _restore(self, state):
        mujoco.mj_setState(self.model, self.data, state, ARM_STATE)
        mujoco.mj_forward(self.model, self.data)

    def _info(self):
        return {"coordinates": self._coordinates()}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._restore(self._start)
        return self._first_obs(), self._info()

    def step(self, action):
        self._act(np.clip(action, -1.0, 1.0))
        # mj_step leaves positions one sub-step behind qpos; recompute them for the frame and the coordinates
        # (this changes no state that the next mj_step reads)
        mujoco.mj_kinematics(self.model, self.data)
        return self._next_obs(), 0.0, False, False, self._info()


KITCHEN_TASKS = ("BottomBurner", "LightSwitch", "SlideCabinet", "HingeCabinet", "Microwave", "Kettle")
# Each task's goal configuration (LEXA's, spec §3.4): qpos indices and their values
KITCHEN_GOALS = (([9, 10], [-0.88, -0.01]), ([17, 18], [-0.69, -0.05]), ([19], [0.37]), ([20, 21], [0.0, 0.5]),
                 ([22], [-0.5]), ([23, 24, 25], [-0.23, 0.75, 1.62]))
# The kitchen's start, D4RL's: the arm in its initial pose, knobs off, light off, doors closed, the kettle on
# the bottom-left burner. The numbers are `init_qpos` of gymnasium_robotics/envs/franka_kitchen/kitchen_env.py
# (gymnasium-robotics 1.4.2), the same as D4RL's and LEXA's kitchen.
# fmt: off
KITCHEN_QPOS = [
    1.48388023e-01, -1.76848573e00, 1.84390296e00, -2.47685760e00, 2.60252026e-01, 7.12533105e-01, 1.59515394e00,
    4.79267505e-02, 3.71350919e-02, -2.66279850e-04, -5.18043486e-05, 3.12877220e-05, -4.51199853e-05,
    -3.90842156e-06, -4.22629655e-05, 6.28065475e-05, 4.04984708e-05, 4.62730939e-04, -2.26906415e-04,
    -4.65501369e-04, -6.44129196e-03, -1.77048263e-03, 1.08009684e-03, -2.69397440e-01, 3.50383255e-01,
    1.61944683e00, 1.00618764e00, 4.06395120e-03, -6.62095997e-03, -2.68278933e-04]
# fmt: on


def kitchen_successes(qpos):
    """The success tests of KITCHEN_TASKS on a kitchen qpos (spec §3.4), 1.0 or 0.0 each."""
    return np.array([
        qpos[9] < -0.38,  # bottom-right burner knob turned
        qpos[17] < -0.25,  # light switch on
        abs(qpos[19] - 0.37) < 0.1,  # sliding cabinet open
        abs(qpos[21] - 0.5) < 0.2,  # right hinge door open
        abs(qpos[22] + 0.5) < 0.2,  # microwave door open
        np.linalg.norm(qpos[23:25] - (-0.23, 0.75)) < 0.2,  # kettle (x, y) on the top-left burner
    ], dtype=np.float64)


@functools.cache  # one model for every Kitchen env of a process (31 MB of textures): no env writes to it
def _kitchen_model():
    """gymnasium-robotics' Franka kitchen MJCF, the arm driven through a mocap body instead of its joint
    actuators: the 7 arm actuators are removed (their position targets would fight the mocap), the 2 finger
    actuators stay, and a mocap body "mocap" is welded to the end-effector site (between the fingertips).
    The arm is drawn with its collision meshes."""
    spec = mujoco.MjSpec.from_file(os.path.join(
        _package_dir("gymnasium_robotics"), "envs", "assets", "kitchen_franka", "kitchen_assets",
        "kitchen_env_model.xml"))
    for actuator in list(spec.actuators):
        if actuator.target.startswith("robot:panda0_joint"):
            actuator.delete()
    # The arm's visual meshes have 134k faces, which make a frame 3× slower to draw on the CPU (OSMesa): draw
    # the arm with its collision meshes instead (about 300 faces a link; the fingers' visual mesh already is
    # one). At 64×64 the two look alike.
    for geom in spec.geoms:
        geom.meshname = geom.meshname.replace("_viz", "_col")
    for mesh in list(spec.meshes):
        if mesh.name.endswith("_viz"):
            mesh.delete()
    spec.worldbody.add_body(name="mocap", mocap=True).add_site(name="mocap")
    weld = spec.add_equality(type=mujoco.mjtEq.mjEQ_WELD, objtype=mujoco.mjtObj.mjOBJ_SITE,
                             name1="mocap", name2="end_effector")
    # anchor, pose of the end effector relative to the mocap (none), torque scale. The wrist joints are 10× less
    # damped than the shoulder ones: with the default torque scale 1 the hand turns by 0.1-0.3 rad per step
    # while it translates, with 10 by 0.01-0.07.
    weld.data[:] = [0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 10]
    # The mocap target follows the hand, so nothing holds the arm up against gravity: uncompensated, the hand
    # sinks 3.6 cm in 10 zero-action steps.
    for i in range(1, 8):
        spec.body(f"panda0_link{i}").gravcomp = 1
    model = spec.compile()
    # the XML asks for a 2560×1920 offscreen buffer (40 MB per render context); frames here are 128×128 at most
    model.vis.global_.offwidth = model.vis.global_.offheight = VIDEO_SIZE
    return model


class KitchenEnv(ArmEnv):
    """D4RL's Franka kitchen (spec §3.4), gymnasium-robotics' MJCF, under end-effector (mocap) control.

    Action (7, in [-1, 1]), held for 40 sub-steps of 2 ms; at each sub-step the mocap is put at the end
    effector's current position + 0.05·a[0:3] m, with its current orientation turned by the roll-pitch-yaw
    angles 0.05·a[3:6] rad about the world x, y, z axes, and both fingers get the position target
    0.02·(1 + a[6]) m (-1 closed, +1 fully open). Camera: free, distance 1.86, lookat (-0.3, 0.5, 2.0),
    azimuth 90, elevation -60. `info["coordinates"]`: `kitchen_successes` of the current state.
    """

    def __init__(self, render_mode=None):
        super().__init__(_kitchen_model(), 40, _free_camera(1.86, (-0.3, 0.5, 2.0), 90, -60), 7, render_mode)
        self._ee = self.model.site("end_effector").id
        self.data.qpos[:] = KITCHEN_QPOS
        mujoco.mj_kinematics(self.model, self.data)
        self.data.mocap_pos[0], self.data.mocap_quat[0] = self.data.site_xpos[self._ee], self._ee_quat()
        self._start = self._save()
        self._frame(FRAME_SIZE)  # make the GL context now, so a missing backend fails inside make_env

    def _ee_quat(self):
        quat = np.empty(4)
        mujoco.mju_mat2Quat(quat, self.data.site_xmat[self._ee])
        return quat

    def _act(self, action):
        turn = np.empty(4)
        mujoco.mju_euler2Quat(turn, 0.05 * action[3:6], "XYZ")  # upper case: about the fixed world axes
        self.data.ctrl[:] = 0.02 * (1 + action[6])
        for _ in range(self.frame_skip):
            self.data.mocap_pos[0] = self.data.site_xpos[self._ee] + 0.05 * action[:3]
            mujoco.mju_mulQuat(self.data.mocap_quat[0], turn, self._ee_quat())
            mujoco.mj_step(self.model, self.data)

    def _coordinates(self):
        return kitchen_successes(self.data.qpos)

    def task_success(self, task):
        """Whether KITCHEN_TASKS[task] is achieved in the current state."""
        return bool(kitchen_successes(self.data.qpos)[task])

    def task_goal_observation(self, task):
        """KITCHEN_TASKS[task]'s goal image (spec §3.4, §4.3): the start with that task's object joints at their
        goal values, at rest, tiled 3 times along channels. Leaves the env there: reset it before the next
        episode."""
        self._restore(self._start)
        joints, values = KITCHEN_GOALS[task]
        self.data.qpos[joints] = values
        mujoco.mj_forward(self.model, self.data)
        return self._goal_obs()


ROBOBIN_TASKS = ("ReachLeft", "ReachRight", "PushFront", "PushBack")
# 9-D states (hand, block 1, block 2 xyz): the start, and each task's goal (LEXA's, spec §3.5)
ROBOBIN_START = np.array([0.0, 0.6, 0.2, -0.1, 0.7, 0.04, 0.1, 0.7, 0.04])
ROBOBIN_GOALS = np.array([
    [0.12, 0.75, 0.10, -0.1, 0.7, 0.04, 0.1, 0.7, 0.04],
    [-0.10, 0.85, 0.10, -0.1, 0.7, 0.04, 0.1, 0.7, 0.04],
    [0.0, 0.65, 0.2, -0.1, 0.7, 0.04, 0.1, 0.85, 0.04],
    [0.0, 0.65, 0.2, -0.1, 0.55, 0.04, 0.1, 0.7, 0.04],
])
MOCAP_LOW, MOCAP_HIGH = np.array([-0.5, 0.40, 0.07]), np.array([0.5, 0.8, 0.5])  # the hand's workspace
HAND_QUAT = (1.0, 0.0, 1.0, 0.0)  # metaworld's mocap orientation: the gripper points down

# The one place where our Robobin differs from the official one: task success. The official env tests the
# reach-or-push branch on its own goal index, always 0, instead of the task asked (spec §5.10), so every
# "success" there means "hand within 0.1 of ReachLeft's hand target". We test the task asked, as intended.


@functools.cache  # one model for every Robobin env of a process: no env writes to it
def _robobin_model():
    """Metaworld's bin-picking scene (Sawyer arm, mocap weld, 2 claw actuators, table) with its bins and
    object replaced by one red bin centred at (0, 0.7) (walls 0.5 × 0.44 m apart, 6 cm high, floor top at
    z = 0.02) holding two green 4 cm blocks, "block1" and "block2", on free joints."""
    spec = mujoco.MjSpec.from_file(os.path.join(
        _package_dir("metaworld"), "assets", "sawyer_xyz", "sawyer_bin_picking.xml"))
    for name in ("obj", "bin_start", "bin_goal"):
        spec.detach_body(spec.body(name))
    # anchor, pose of the hand relative to the mocap (none), torque scale: metaworld's reset_mocap_welds
    spec.equalities[0].data[:] = [0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 5]
    box = mujoco.mjtGeom.mjGEOM_BOX
    tray = spec.worldbody.add_body(name="bin", pos=[0, 0.7, 0])
    tray.add_geom(type=box, pos=[0, 0, 0.01], size=[0.25, 0.22, 0.01], material="bin_red")
    for pos, size in [([0, -0.22, 0.03], [0.25, 0.005, 0.03]), ([0, 0.22, 0.03], [0.25, 0.005, 0.03]),
                      ([-0.25, 0, 0.03], [0.005, 0.22, 0.03]), ([0.25, 0, 0.03], [0.005, 0.22, 0.03])]:
        tray.add_geom(type=box, pos=pos, size=size, material="bin_red")
    for name in ("block1", "block2"):
        block = spec.worldbody.add_body(name=name)
        block.add_freejoint()
        block.add_geom(type=box, size=[0.02] * 3, material="obj_green")
        # explicit: the scene computes inertias from geom groups 4-5 only, and these geoms are in group 0
        block.mass, block.inertia, block.explicitinertial = 0.1, [0.1 * 0.04**2 / 6] * 3, True
    return spec.compile()


class RobobinEnv(ArmEnv):
    """A Sawyer arm with two blocks in a bin (spec §3.5), built from metaworld's assets (`_robobin_model`).

    Action (4, in [-1, 1]): the mocap moves by 0.01·a[0:3] m, clipped to the workspace MOCAP_LOW-MOCAP_HIGH,
    and the claws get metaworld's targets (a[3], -a[3]) (+1 closes, -1 opens); then 5 sub-steps of 2.5 ms.
    Camera: free, distance 1.4, lookat (0, 0.65, 0), azimuth 90, elevation 221 (so upside down), every frame
    flipped horizontally and vertically. `info["coordinates"]`: hand (body "hand"), block 1, block 2 xyz.
    """

    def __init__(self, render_mode=None):
        super().__init__(_robobin_model(), 5, _free_camera(1.4, (0, 0.65, 0), 90, 221), 4, render_mode)
        self._hand, self._block1, self._block2 = (self.model.body(n).id for n in ("hand", "block1", "block2"))
        self._place(ROBOBIN_START)
        self._start = self._save()
        self._frame(FRAME_SIZE)  # make the GL context now, so a missing backend fails inside make_env

    def _frame(self, size):
        return np.ascontiguousarray(super()._frame(size)[::-1, ::-1])

    def _place(self, state):
        """Put the hand and the blocks at the 9-D `state`, at rest, claws open: hold the mocap at the hand
        position for 100 env steps (the arm moves there from where it is), then put the blocks in place."""
        self.data.mocap_pos[0], self.data.mocap_quat[0] = state[:3], HAND_QUAT
        self.data.ctrl[:] = -1.0, 1.0
        mujoco.mj_step(self.model, self.data, nstep=100 * self.frame_skip)
        for body, pos in [(self._block1, state[3:6]), (self._block2, state[6:9])]:
            adr = self.model.jnt_qposadr[self.model.body_jntadr[body]]
            self.data.qpos[adr : adr + 7] = [*pos, 1.0, 0.0, 0.0, 0.0]
        self.data.qvel[:] = 0.0
        mujoco.mj_forward(self.model, self.data)

    def _act(self, action):
        self.data.mocap_pos[0] = np.clip(self.data.mocap_pos[0] + 0.01 * action[:3], MOCAP_LOW, MOCAP_HIGH)
        self.data.ctrl[:] = action[3], -action[3]
        mujoco.mj_step(self.model, self.data, nstep=self.frame_skip)

    def _coordinates(self):
        return self.data.xpos[[self._hand, self._block1, self._block2]].ravel()

    def task_success(self, task):
        """Whether ROBOBIN_TASKS[task] is achieved in the current state: the hand within 0.1 of its target for
        the reach tasks (0, 1), both blocks within 0.1 of theirs for the push tasks (2, 3)."""
        state, goal = self._coordinates(), ROBOBIN_GOALS[task]
        if task < 2:
            return bool(np.linalg.norm(state[:3] - goal[:3]) < 0.1)
        return bool(np.linalg.norm(state[3:6] - goal[3:6]) < 0.1 and np.linalg.norm(state[6:9] - goal[6:9]) < 0.1)

    def task_goal_observation(self, task):
        """ROBOBIN_TASKS[task]'s goal image (spec §3.5, §4.3): from the start, hand and blocks put at the goal
        positions, one zero-action step, the view tiled 3 times along channels. Leaves the env there: reset
        it before the next episode."""
        self._restore(self._start)
        self._place(ROBOBIN_GOALS[task])
        self.step(np.zeros(4))
        return self._goal_obs()


def make_env(env_id, render_mode=None):
    """The env of the paper named `env_id`, with its time limit. Raises ValueError for an unknown id, and
    RenderUnavailable (one line naming the system package to install) when a pixel world finds no OpenGL."""
    if env_id not in ENV_SPECS:
        raise ValueError(f"unknown env {env_id!r}; choose one of {', '.join(ENV_SPECS)}")
    if env_id == "Ant":
        env = LocomotionEnv("ant.xml", ANT_MEAN, ANT_STD, coord_dim=2, render_mode=render_mode)
    elif env_id == "HalfCheetah":
        env = LocomotionEnv("half_cheetah.xml", CHEETAH_MEAN, CHEETAH_STD, coord_dim=1, render_mode=render_mode)
    elif env_id == "Quadruped":
        # the suite's model without walls, ball, target, terrain and rangefinders, floor 15×15 as in its
        # XML; 0.02 s control step; camera "y" (id 2), a side view following the COM
        env = DMCPixelEnv(quadruped.make_model(), common.ASSETS, _quadruped_pose, 0.02, "y", 1, render_mode)
    elif env_id == "Humanoid":
        # 0.025 s control step; camera "back" (id 0), behind the COM
        env = DMCPixelEnv(*humanoid.get_model_and_assets(), _humanoid_pose, 0.025, "back", 50, render_mode)
    elif env_id == "Kitchen":
        env = KitchenEnv(render_mode)
    else:
        env = RobobinEnv(render_mode)
    return gym.wrappers.TimeLimit(env, ENV_SPECS[env_id].horizon)


# ---------------------------------------------------------------- downstream tasks (spec §4.4)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """The facts the hierarchical learner needs about a downstream task (spec §4.4)."""

    base: str  # the pretraining env (ENV_SPECS key) whose skills the task reuses
    extra_dims: int  # task dims after the base observation; the child policy sees the observation without them
    algo: str  # high-level learner: "sac" or "ppo"
    eval_every: int  # epochs between evaluations
    buffer_size: int  # high-level SAC replay capacity in transitions (0: PPO keeps no replay)
    goal_range: float  # goals (and AntMultiGoal's steps between goals) are drawn from U(-goal_range, goal_range)
    radius: float  # +1 per low-level step within this distance of the goal


TASKS = {
    "AntMultiGoal": TaskSpec("Ant", 2, "sac", 100, 1_000_000, 7.5, 3.0),
    "HalfCheetahGoal": TaskSpec("HalfCheetah", 1, "ppo", 100, 0, 100.0, 3.0),
    "HalfCheetahHurdle": TaskSpec("HalfCheetah", 2, "ppo", 100, 0, 0.0, 0.0),
    "QuadrupedGoal": TaskSpec("Quadruped", 2, "sac", 25, 300_000, 7.5, 1.5),
    "HumanoidGoal": TaskSpec("Humanoid", 2, "sac", 25, 300_000, 5.0, 1.5),
}
ANT_GOALS = 4  # AntMultiGoal's goals per episode
ANT_GOAL_STEPS = 50  # low-level steps per AntMultiGoal goal

# The one place where our tasks differ from the official ones: AntMultiGoal's goals 2-4. The official env
# draws them once, in its constructor (spec §5.15), so each worker and the evaluation env keep one fixed
# chain for the whole run, and only goal 1 is new in each episode. A high level can then score on goals
# 2-4 by memorizing them instead of reading the goal in its observation. We draw the whole chain at every
# reset, so reading the observation's goal is the only way to score.


class GoalTask(gym.Wrapper):
    """A base world with goals to reach: the goal (x, y) or x is appended, raw, to the observation, and the
    reward is +1 for each step whose post-step `info["coordinates"]` lie within `radius` of the goal in
    force at that step, except the episode's first step (as in the official code).

    Goal 1 ~ U(-goal_range, goal_range) per coordinate, goal k+1 = goal k + U(-goal_range, goal_range);
    goal k is in force for low-level steps (k-1)·goal_steps onward, the last goal until the episode ends.
    The observation after a step holds the goal of the next step (the one the policy must reach next), and
    `info["goal"]` the goal that step's reward measured: they differ on the last step of a goal that
    another follows (AntMultiGoal's steps 50, 100 and 150, counting from 1).
    Observation: state worlds, base observation ⊕ goal (float32); pixel worlds, {"pixels", "goal"}.
    `goals` holds the episode's goals, one row each, drawn at reset from the base world's np_random.
    """

    def __init__(self, env, goal_dim, goal_range, radius, num_goals, goal_steps):
        super().__init__(env)
        self.goal_dim, self.goal_range, self.radius = goal_dim, goal_range, radius
        self.num_goals, self.goal_steps = num_goals, goal_steps
        self.pixels = env.observation_space.dtype == np.uint8  # stacked frames, not a state vector
        goal_space = gym.spaces.Box(-np.inf, np.inf, (goal_dim,), np.float32)
        if self.pixels:
            self.observation_space = gym.spaces.Dict({"pixels": env.observation_space, "goal": goal_space})
        else:
            dims = env.observation_space.shape[0] + goal_dim
            self.observation_space = gym.spaces.Box(-np.inf, np.inf, (dims,), np.float32)

    def _goal(self):
        """The goal in force for the next step."""
        return self.goals[min(self.steps // self.goal_steps, self.num_goals - 1)]

    def _observation(self, obs):
        goal = self._goal().astype(np.float32)
        return {"pixels": obs, "goal": goal} if self.pixels else np.concatenate([obs, goal])

    def reset(self, *, seed=None, options=None):
        obs, info = self.env.reset(seed=seed, options=options)
        jumps = self.np_random.uniform(-self.goal_range, self.goal_range, (self.num_goals, self.goal_dim))
        self.goals = np.cumsum(jumps, axis=0)
        self.steps = 0  # low-level steps taken this episode
        return self._observation(obs), {**info, "goal": self._goal().copy()}

    def step(self, action):
        goal = self._goal().copy()
        obs, _, terminated, truncated, info = self.env.step(action)
        reached = np.linalg.norm(info["coordinates"] - goal) <= self.radius
        reward = float(reached and self.steps > 0)
        self.steps += 1
        return self._observation(obs), reward, terminated, truncated, {**info, "goal": goal}


HURDLE_X = (-15.0, -13.0, -9.0, -5.0, -1.0, 3.0, 7.0, 11.0, 15.0, 19.0, 23.0, 27.0)


class HurdleEnv(LocomotionEnv):
    """HalfCheetah with 12 hurdles across its path (spec §4.4): boxes of half-size (0.05, 1, 0.03) centred at
    z = 0.2 and x = HURDLE_X, which collide with the body.

    Observation: the HalfCheetah observation (preset normalization) ⊕ [x of the next hurdle, |x of the next
    hurdle − x of the back foot|], raw. The back foot is body "bfoot"; the next hurdle is the first one
    the foot has not passed (x >= the foot's x), the last one once the foot is past them all.
    Reward: the change over the step of the number of hurdles at x >= 0 that the back foot has passed
    (x < the foot's x): +1 per hurdle crossed forward, -1 per hurdle crossed back.
    """

    def __init__(self, render_mode=None):
        super().__init__("half_cheetah.xml", CHEETAH_MEAN, CHEETAH_STD, coord_dim=1, render_mode=render_mode)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (self.model.nq + self.model.nv + 2,), np.float32)
        self._foot = mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_BODY, "bfoot")

    def _load_model(self, path):
        root = ET.parse(path).getroot()
        world = root.find("worldbody")
        for i, x in enumerate(HURDLE_X):
            # conaffinity 1, as the floor: the body's geoms have contype 1 and conaffinity 0 (the file's
            # defaults), so hurdles with those defaults would collide with nothing
            ET.SubElement(world, "geom", name=f"hurdle{i}", type="box", pos=f"{x} 0 0.2", size="0.05 1 0.03",
                          conaffinity="1", rgba="0.3 0.16 0 1")  # brown, as the official hurdles' texture
        # half_cheetah.xml names no files (its textures are builtin), so the string needs no assets
        return mujoco.MjModel.from_xml_string(ET.tostring(root, encoding="unicode"))

    def _foot_x(self):
        # mj_step leaves body positions one substep behind qpos; recompute them from the current qpos (this
        # changes no state that the next mj_step reads)
        mujoco.mj_kinematics(self.model, self.data)
        return self.data.xpos[self._foot, 0]

    def _passed(self):
        foot = self._foot_x()
        return sum(foot > x for x in HURDLE_X if x >= 0)

    def _obs(self):
        foot = self._foot_x()
        ahead = [x for x in HURDLE_X if x >= foot]
        hurdle = ahead[0] if ahead else HURDLE_X[-1]
        return np.concatenate([super()._obs(), np.float32([hurdle, abs(hurdle - foot)])])

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed, options=options)
        self._num_passed = self._passed()
        return obs, info

    def step(self, action):
        obs, _, terminated, truncated, info = super().step(action)
        passed = self._passed()
        reward, self._num_passed = float(passed - self._num_passed), passed
        return obs, reward, terminated, truncated, info


def make_task(task, render_mode=None):
    """The downstream task named `task` (a TASKS key) on its base world, with the base world's 200-step time
    limit. Action space and dynamics are the base world's, the reward is the task's, and it never terminates.
    Raises ValueError for an unknown name, and RenderUnavailable for a pixel task without OpenGL."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    spec, base_spec = TASKS[task], ENV_SPECS[TASKS[task].base]
    if task == "HalfCheetahHurdle":
        env = HurdleEnv(render_mode)
    else:
        world = make_env(spec.base, render_mode).unwrapped
        goals = (ANT_GOALS, ANT_GOAL_STEPS) if task == "AntMultiGoal" else (1, base_spec.horizon)
        env = GoalTask(world, base_spec.coord_dim, spec.goal_range, spec.radius, *goals)
    return gym.wrappers.TimeLimit(env, base_spec.horizon)


class PixelEncoder(nn.Module):
    """The CNN in front of every network on pixels (spec §1.9): (N, 64, 64, 3k) HWC images, uint8 or
    float in [0, 255] -> (N, 1536). Divide by 255 (no mean shift), then 4 unpadded convolutions (kernel 4,
    stride 2; 64 -> 31 -> 14 -> 6 -> 2 pixels) with ELU; PyTorch's default init, no normalization."""

    out_dim = 384 * 2 * 2

    def __init__(self, in_channels=3 * FRAME_STACK):
        super().__init__()
        layers = []
        for c_in, c_out in zip([in_channels, 48, 96, 192], [48, 96, 192, 384]):
            layers += [nn.Conv2d(c_in, c_out, kernel_size=4, stride=2), nn.ELU()]
        self.net = nn.Sequential(*layers, nn.Flatten())

    def forward(self, images):
        return self.net(images.permute(0, 3, 1, 2).float() / 255.0)


class PixelGoalEncoder(nn.Module):
    """The encoder of a pixel task's observation {"pixels": (N, 64, 64, 3k), "goal": (N, goal_dim)}:
    PixelEncoder(pixels) ⊕ goal, raw (spec §1.9), of size 1536 + goal_dim."""

    def __init__(self, in_channels, goal_dim):
        super().__init__()
        self.pixels = PixelEncoder(in_channels)
        self.out_dim = PixelEncoder.out_dim + goal_dim

    def forward(self, obs):
        return torch.cat([self.pixels(obs["pixels"]), obs["goal"].float()], dim=-1)


def make_encoder(observation_space):
    """One network's own observation encoder and its feature size: a PixelEncoder for stacked frames, a
    PixelGoalEncoder for a pixel task's {"pixels", "goal"}, none (identity) for state vectors."""
    if isinstance(observation_space, gym.spaces.Dict):
        encoder = PixelGoalEncoder(observation_space["pixels"].shape[-1], observation_space["goal"].shape[0])
        return encoder, encoder.out_dim
    if len(observation_space.shape) == 3:  # (64, 64, 3·frame_stack) uint8
        encoder = PixelEncoder(in_channels=observation_space.shape[-1])
        return encoder, encoder.out_dim
    return nn.Identity(), observation_space.shape[0]


def draw_coordinates(ax, coordinates, colors, env_id=None):
    """Draw the evaluation `coordinates` (rollouts, steps, coord_dim) on the matplotlib axes `ax`, rollout i in
    colors[i] (RGBA), as every agent's skill plot shows them.

    Kitchen: a grid of rollouts × KITCHEN_TASKS, a cell in its rollout's colour where the rollout achieved
    the task at some step. Robobin: the hand's (x, y) path from above, each block's last (x, y) a dot.
    Any other world: the (x, y) paths, or x against the env step for x-only worlds.
    """
    if env_id == "Kitchen":
        achieved = np.asarray(coordinates).any(axis=1)  # (rollouts, tasks)
        ax.imshow(np.where(achieved[..., None], np.asarray(colors)[:, None, :], 1.0), aspect="auto",
                  interpolation="nearest")
        ax.set_xticks(range(len(KITCHEN_TASKS)), KITCHEN_TASKS, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("rollout")
        return
    if env_id == "Robobin":  # coordinates: hand, block 1, block 2, (x, y, z) each
        for path, color in zip(coordinates, colors):
            ax.plot(path[:, 0], path[:, 1], color=color, lw=1)
            ax.plot(path[-1, [3, 6]], path[-1, [4, 7]], "o", color=color, ms=3)
        ax.set_xlabel("hand x (dots: blocks at the end)")
        ax.set_ylabel("hand y")
        ax.set_aspect("equal")
        return
    planar = np.shape(coordinates)[-1] == 2
    for path, color in zip(coordinates, colors):
        ax.plot(path[:, 0], path[:, 1] if planar else np.arange(len(path)), color=color, lw=1)
    ax.set_xlabel("x")
    ax.set_ylabel("y" if planar else "env step")
    ax.set_aspect("equal" if planar else "auto")


def coverage(coordinates, env_id=None):
    """State coverage (spec §4.2) of `coordinates`, shape (..., coord_dim): every point of every trajectory.

    Kitchen: the number of KITCHEN_TASKS achieved at any point (coordinates are their success flags).
    Robobin: the number of distinct 9-D states rounded to 2 decimals.
    Any other world (env_id None included): the number of distinct 1×1 cells (1-unit bins for x only) visited.
    """
    points = np.asarray(coordinates)
    if env_id == "Kitchen":
        return int(points.reshape(-1, len(KITCHEN_TASKS)).any(axis=0).sum())
    if env_id == "Robobin":
        cells = np.rint(points * 100).astype(np.int64)  # the same classes as rounding to 2 decimals
    else:
        cells = np.floor(points).astype(np.int64)
    return len(np.unique(cells.reshape(-1, cells.shape[-1]), axis=0))
