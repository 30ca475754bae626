"""The worlds of the paper, their downstream tasks, and the per-env facts the cleanmisl agents need.

Every world and task is a gymnasium env with its time limit, registered as cleanmisl/<name>-v0: `make_env(name)`,
`make_task(name)`, or gym.make("cleanmisl/<name>-v0") once this module is imported. None terminates; only the
tasks have a reward. `info["coordinates"]` holds what the coverage metric counts.

- Ant, HalfCheetah (paper App. B.2; the official envs/mujoco/): Gym's models (gymnasium's copies), frame skip 5,
  observation qpos ⊕ qvel with the global x (and y) kept, normalized by the official code's fixed "preset"
  statistics (iod/utils.py: get_normalizer_preset); 200 steps. Coordinates: raw (x, y), or x.
- Quadruped, Humanoid (the official envs/custom_dmc_tasks/): DMC's bodies on the paper's floor, 15×15 m half-extent,
  painted with one colour gradient so that the COM-tracking camera shows absolute position; action repeat 2;
  200 steps. Coordinates: the torso geom's (x, y).
- Kitchen (LEXA's kitchen.py over D4RL's kitchen_multitask_v0.py): the Franka kitchen under the official
  end-effector control; 7-D actions; 50 steps. Coordinates: the success flags of its 6 tasks (KITCHEN_TASKS).
- Robobin (LEXA's robobin.py over MetaWorld v1's sawyer_two_block_bin.py): a Sawyer arm, a green block in a red
  bin and a yellow block in a blue bin; 4-D actions; 200 steps. Coordinates: the 9-D (hand, block, block) position.
Pixel observations are the last 3 frames of 64×64 RGB, stacked along channels oldest first: (64, 64, 9) uint8.
`PixelEncoder` is the CNN every network puts in front of them (`make_encoder`). `render()` gives 128×128 frames for
videos (render_mode "rgb_array"). Zero-shot goals (paper App. B.4): `goal_observation(goal)`, or on Kitchen and
Robobin `task_goal_observation(i)` and `task_success(i)`. Downstream tasks (paper App. B.5): `TASKS`, on a base
world, with the task's dims after its observation.

Rendering is headless: OSMesa on a CPU, EGL on a machine with a GPU render node (MUJOCO_GL overrides). Frames come
in two looks (`resolve_render_quality`; $CLEANMISL_RENDER or render_quality=): "official", as the official code
drew them (shadows, 4× multisampling, 8× on Kitchen, floor reflections, Kitchen's visual arm meshes of 134k
faces), and "fast", without any of these. The default is "official" on a GPU render node and "fast" elsewhere,
because on a CPU the official look costs 2-70× more (benchmarks/render_quality.py, OSMesa, ms per 64×64 frame:
Quadruped 49 against 3.0, Humanoid 55 against 3.5, Kitchen 718 against 10, Robobin 19 against 8.2). The fast frames
differ from the official ones by 3-22 of 255 levels on average (6-23% of the pixels by more than 32): no shadows
(Robobin's lights cast none), no reflections, unsmoothed edges, and Kitchen's arm drawn with its collision meshes.
Both looks see the same physics.

Where the worlds depart from the official ones, which ran on MuJoCo 2.2.1 through dm_control:
- Kitchen: gymnasium-robotics' copy of D4RL's kitchen scene, with the official end-effector file's mocap body and
  weld added (its textures, wood1.png included, were not compared with the official files). MuJoCo 3's weld
  resists rotation far less than 2.2.1's; a torque scale of 18.47 makes up for it (`_kitchen_model`). The first
  step after a reset then moves link7 as 2.2.1 does, to the millimetre. Later steps move it less than 2.2.1 does,
  most of all upwards, and the official XML does the same under MuJoCo 3.3 (benchmarks/kitchen_response.py): 5
  steps of a = +z raise it 0.341 m (2.2.1: 0.427), +x 0.261 (0.276), -y 0.420 (0.422), a3 = 1 turns it 21.5°
  (24°), and 50 zero-action steps drift it by (-0.082, -0.137, +0.017) m, where 2.2.1 drifts (-0.121, -0.220,
  +0.080): the same direction, 62-68% of the size across and 21% upwards.
- Robobin, built anew from metaworld 3's Sawyer assets (`_robobin_model`): the hand gets 2.2.1's mass and inertia
  (MuJoCo 3 computes 0.43 kg from its mesh, 2.2.1 computed 0.1847), the weld a torque scale of 5.89, and one
  contact that only MuJoCo 3 reports (the arm's base against its first link's sphere) is excluded. The blocks are
  placed at z = 0.046, where they rest, not at the official 0.04 inside the bin floor, which MuJoCo 3 lets them
  fall through; so their height differs by up to 6 mm in the first 10 steps of an episode. The hand at reset is
  1 mm from 2.2.1's. Success tests the task asked, where the official env always tests task 0 (see ROBOBIN_TASKS).
- Quadruped, Humanoid: each env's initial states follow its own reset(seed), where the official workers seed
  their DMC tasks with one seed and so repeat one sequence of initial states.
- AntMultiGoal draws its whole goal chain in every episode (see TASKS).
"""

import atexit
import collections
import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import glob
import importlib.util
import math
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import traceback
import weakref
import xml.etree.ElementTree as ET

# Headless rendering: MuJoCo picks its OpenGL backend when it is imported. EGL needs a GPU render node;
# without one, OSMesa renders on the CPU (Debian/Ubuntu package libosmesa6).
GPU_RENDER_NODE = bool(glob.glob("/dev/dri/renderD*"))
GL_BACKEND = os.environ.setdefault("MUJOCO_GL", "egl" if GPU_RENDER_NODE else "osmesa")
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
if GL_BACKEND in GL_LIBRARIES:  # mujoco refuses a PyOpenGL platform other than its backend (a child process
    os.environ["PYOPENGL_PLATFORM"] = GL_BACKEND  # inherits the parent's, e.g. osmesa under MUJOCO_GL=egl)
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

MODEL_DIR = os.path.join(os.path.dirname(gym.__file__), "envs", "mujoco", "assets")


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """The facts an agent needs about an env; an agent flag left unset takes these values (the official
    scripts/pretrain/*/*.sh)."""

    horizon: int  # env steps per trajectory
    num_envs: int  # trajectories collected per epoch
    grad_steps_per_epoch: int
    buffer_size: int  # replay capacity in transitions
    eval_every: int  # epochs between evaluations (the CSF/METRA scripts' n_epochs_per_eval)
    total_env_steps: int  # training budget used for the paper's skill checkpoints (paper App. B.2)
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

# Preset normalizer statistics of the official code, from 10k random rollouts (iod/utils.py: get_normalizer_preset).
# fmt: off
ANT_MEAN = [
    0.00486117, 0.011312, 0.7022248, 0.8454677, -0.00102548, -0.00300276, 0.00311523, -0.00139029, 0.8607109,
    -0.00185301, -0.8556998, 0.00343217, -0.8585605, -0.00109082, 0.8558013, 0.00278213, 0.00618173, -0.02584622,
    -0.00599026, -0.00379596, 0.00526138, -0.0059213, 0.27686235, 0.00512205, -0.27617684, -0.0033233, -0.2766923,
    0.00268359, 0.27756855,
]
ANT_STD = [
    0.62473416, 0.61958003, 0.1717569, 0.28629342, 0.20020866, 0.20572574, 0.34922406, 0.40098143, 0.3114514,
    0.4024826, 0.31057045, 0.40343934, 0.3110796, 0.40245822, 0.31100526, 0.81786263, 0.8166509, 0.9870919,
    1.7525449, 1.7468817, 1.8596431, 4.502961, 4.4070187, 4.522444, 4.3518476, 4.5105968, 4.3704205, 4.5175962,
    4.3704395,
]
CHEETAH_MEAN = [
    -0.07861924, -0.08627162, 0.08968642, 0.00960849, 0.02950368, -0.00948337, 0.01661406, -0.05476654, -0.04932635,
    -0.08061652, -0.05205841, 0.04500197, 0.02638421, -0.04570961, 0.03183838, 0.01736591, 0.0091929, -0.0115027,
]
CHEETAH_STD = [
    0.4039283, 0.07610687, 0.23817, 0.2515473, 0.2698137, 0.26374814, 0.32229397, 0.2896734, 0.2774097, 0.73060024,
    0.77360505, 1.5871304, 5.5405455, 6.7097645, 6.8253727, 6.3142195, 6.417641, 5.9759197,
]
# fmt: on

VIDEO_SIZE = 128  # render() frames, for videos
FRAME_SIZE = 64  # pixel observations
FRAME_STACK = 3
# How frames are drawn (`resolve_render_quality`): "official", as the official code (shadows, multisampling, floor
# reflections, Kitchen's visual arm meshes), or "fast", without them (several times faster on a CPU)
RENDER_QUALITIES = ("official", "fast")
ACTION_REPEAT = 2  # pixel worlds


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
    """One offscreen render context for one world: square views of up to `max_size` pixels through a camera.

    `quality` "official" draws as the official code did: the model's shadow map and multisampling, shadows and
    reflections on. "fast" draws with none of them, several times faster on a CPU (the header gives the numbers).
    The context is made on the first frame a world draws, never in an env's constructor: a context made before
    a process forks (gymnasium's AsyncVectorEnv builds one env in the parent) hangs the forked workers.

    Unlike mujoco.Renderer (3.3), closing or garbage-collecting it frees its GL objects inside its own GL
    context: mujoco.Renderer frees them in whichever context is current, i.e. in another world's renderer,
    whose images then turn to garbage.
    """

    def __init__(self, model, max_size, quality):
        global _GL_PROCESS
        if GL_MISSING:
            raise RenderUnavailable(_gl_error(f"lib{GL_LIBRARIES[GL_BACKEND][0]} does not load"))
        if _GL_PROCESS not in (None, os.getpid()):  # OpenGL's state does not survive a fork: a context would hang
            raise RenderUnavailable("cannot render in a process forked from one that has rendered; make the vector "
                                    "env (or fork) before anything renders, or use AsyncVectorEnv(context='spawn')")
        official = quality == "official"
        visual = model.vis.quality
        model_quality = visual.offsamples, visual.shadowsize
        if not official:  # read once, when the context is made; the model itself is left as it was
            visual.offsamples = visual.shadowsize = 0
        try:
            self._gl = mujoco.GLContext(max_size, max_size)
            self._gl.make_current()
            self._context = mujoco.MjrContext(model, mujoco.mjtFontScale.mjFONTSCALE_100)
        except Exception as err:  # the backend loaded, but no context could be made (e.g. EGL without a device)
            raise RenderUnavailable(_gl_error(f"{type(err).__name__}: {str(err).strip().splitlines()[0]}")) from err
        finally:
            visual.offsamples, visual.shadowsize = model_quality
        _GL_PROCESS = os.getpid()
        mujoco.mjr_setBuffer(mujoco.mjtFramebuffer.mjFB_OFFSCREEN, self._context)
        self._scene = mujoco.MjvScene(model, maxgeom=1000)
        self._scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = official
        self._scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = official
        self._option, self._camera = mujoco.MjvOption(), mujoco.MjvCamera()
        self._camera.type = mujoco.mjtCamera.mjCAMERA_FIXED
        _LIVE_RENDERERS.add(self)
        # EGL registers its own exit handler (eglTerminate) with its first context; re-registered here, ours runs first
        atexit.unregister(_close_renderers)
        atexit.register(_close_renderers)

    def render(self, model, data, camera, size):
        """The size×size view of `data` through `camera`: the name of one of the model's cameras, or a free
        mujoco.MjvCamera. `model` is the one this Renderer was made for, or an identical copy."""
        if isinstance(camera, str):
            self._camera.fixedcamid = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, camera)
            camera = self._camera
        mujoco.mjv_updateScene(model, data, self._option, None, camera, mujoco.mjtCatBit.mjCAT_ALL, self._scene)
        self._gl.make_current()
        rect, pixels = mujoco.MjrRect(0, 0, size, size), np.empty((size, size, 3), np.uint8)
        mujoco.mjr_render(rect, self._scene, self._context)
        mujoco.mjr_readPixels(pixels, None, rect, self._context)
        return pixels[::-1].copy()  # OpenGL rows run bottom-up

    def close(self):
        if getattr(self, "_context", None) is not None:
            self._gl.make_current()
            self._context.free()
            self._gl.free()
            self._context = None

    __del__ = close


# (world, quality) -> the Renderer the envs of that world share in this process, while one holds it. A render
# context holds a copy of the model's textures and meshes (Kitchen's: 200 MB with OSMesa): 56 Kitchen envs
# (8 training, 48 evaluation) would otherwise take 12 GB.
_RENDERERS = weakref.WeakValueDictionary()
_LIVE_RENDERERS = weakref.WeakSet()  # every open Renderer, closed at exit
_GL_PROCESS = None  # the process that made the first render context


def _close_renderers():
    """Free every GL context at interpreter exit, before EGL's own exit handler terminates its display: a
    context freed after that raises EGLError ("Exception ignored in Renderer.close")."""
    for renderer in list(_LIVE_RENDERERS):
        renderer.close()


def resolve_render_quality(quality=None):
    """The render quality to use: `quality` if given, else $CLEANMISL_RENDER, else "official" on a machine with
    a GPU render node and "fast" without one. Raises RenderUnavailable (one line) for any other value."""
    quality = quality or os.environ.get("CLEANMISL_RENDER") or ("official" if GPU_RENDER_NODE else "fast")
    if quality not in RENDER_QUALITIES:
        raise RenderUnavailable(f"unknown render quality {quality!r} (CLEANMISL_RENDER or render_quality); "
                                f"choose one of {', '.join(RENDER_QUALITIES)}")
    return quality


class MujocoEnv(gym.Env):
    """What every world shares: `model`/`data` (raw MuJoCo), rendering from `camera` (a camera name of the
    model, or a free mujoco.MjvCamera) with the renderer that the envs named `world_name` share, no reward, no end.

    `render_mode`: None, or "rgb_array" for `render()` to give 128×128 frames (videos). Pixel worlds draw their
    64×64 observations whatever the render mode. `render_quality`: see `resolve_render_quality`."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}
    camera = "track"

    def __init__(self, world_name, render_mode=None, render_quality=None):
        if render_mode not in (None, *self.metadata["render_modes"]):
            raise ValueError(f"unsupported render_mode {render_mode!r}; choose None or "
                             f"{', '.join(map(repr, self.metadata['render_modes']))}")
        self.world_name, self.render_mode = world_name, render_mode
        self.render_quality = resolve_render_quality(render_quality)
        self._renderer = None  # found or made on the first frame

    def _frame(self, size):
        if self._renderer is None:
            key = (self.world_name, self.render_quality)
            self._renderer = _RENDERERS.get(key)
            if self._renderer is None:
                self._renderer = _RENDERERS[key] = Renderer(self.model, VIDEO_SIZE, self.render_quality)
        return self._renderer.render(self.model, self.data, self.camera, size)

    def render(self):
        if self.render_mode is None:
            gym.logger.warn("render() needs render_mode='rgb_array' at construction; it returns None")
            return None
        return self._frame(VIDEO_SIZE)

    def _check_action(self, action):
        """The action as a float array of the action space's shape; raises ValueError for another shape (as
        gymnasium's MuJoCo envs do) or a NaN or infinite entry (MuJoCo would reset silently or raise deep inside)."""
        action = np.asarray(action, dtype=np.float64)
        if action.shape != self.action_space.shape:
            raise ValueError(f"Action dimension mismatch. Expected {self.action_space.shape}, found {action.shape}")
        if not np.isfinite(action).all():
            raise ValueError(f"action must be finite, got {action}")
        return action

    def close(self):
        self._renderer = None  # a Renderer no env holds any more frees itself


class LocomotionEnv(MujocoEnv):
    """A MuJoCo body on an open floor: obs = normalize(qpos ⊕ qvel), never terminates."""

    def __init__(self, world_name, xml_file, obs_mean, obs_std, coord_dim, render_mode=None, render_quality=None,
                 frame_skip=5):
        super().__init__(world_name, render_mode, render_quality)
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
        # Gym's reset noise: qpos0 + U(-0.1, 0.1), qvel 0.1 N(0, 1)
        mujoco.mj_resetData(self.model, self.data)
        self.data.qpos[:] = self.model.qpos0 + self.np_random.uniform(-0.1, 0.1, self.model.nq)
        self.data.qvel[:] = 0.1 * self.np_random.standard_normal(self.model.nv)
        mujoco.mj_forward(self.model, self.data)
        return self._obs(), self._info()

    def step(self, action):
        self.data.ctrl[:] = np.clip(self._check_action(action), self.action_space.low, self.action_space.high)
        mujoco.mj_step(self.model, self.data, nstep=self.frame_skip)
        return self._obs(), 0.0, False, False, self._info()  # skill discovery ignores the env reward

    def goal_observation(self, goal):
        """Zero-shot goal (paper App. B.4): a fresh reset state with its x (, y) replaced by `goal`, normalized.
        Leaves the env mid-episode: reset it before the next episode."""
        self.reset()
        self.data.qpos[: self.coord_dim] = goal
        return self._obs()


class AntEnv(LocomotionEnv):
    """Gym's Ant (the official envs/mujoco/ant_env.py): 29-D observation (x, y kept), 8-D actions, coordinates
    (x, y)."""

    def __init__(self, render_mode=None, render_quality=None):
        super().__init__("Ant", "ant.xml", ANT_MEAN, ANT_STD, 2, render_mode, render_quality)


class HalfCheetahEnv(LocomotionEnv):
    """Gym's HalfCheetah (the official envs/mujoco/half_cheetah_env.py): 18-D observation (x kept), 6-D actions,
    coordinate x."""

    def __init__(self, render_mode=None, render_quality=None):
        super().__init__("HalfCheetah", "half_cheetah.xml", CHEETAH_MEAN, CHEETAH_STD, 1, render_mode, render_quality)


# ---------------------------------------------------------------- pixel worlds (DMC)


def _pixel_world_xml(xml):
    """The paper's floor: 15×15 half-extent, material "mygrid" = one 300×300 texture spread once over it (not
    texuniform), reflectance 0.2 (the official quadruped_color.xml and humanoid_color.xml)."""
    root = ET.fromstring(xml)
    asset = ET.SubElement(root, "asset")
    ET.SubElement(asset, "texture", name="mygrid", type="2d", builtin="flat", width="300", height="300")
    ET.SubElement(asset, "material", name="mygrid", texture="mygrid", texrepeat="1 1", reflectance="0.2")
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
    (the official frame stack), shape (64, 64, 9) uint8. The render context is made on the first frame (see Renderer); a
    missing GL library fails here, in the constructor."""

    def __init__(self, world_name, render_mode=None, render_quality=None):
        super().__init__(world_name, render_mode, render_quality)
        if GL_MISSING:
            raise RenderUnavailable(_gl_error(f"lib{GL_LIBRARIES[GL_BACKEND][0]} does not load"))
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
        """A zero-shot goal image (paper App. B.4): the current view tiled 3 times along channels."""
        return np.concatenate([self._frame(FRAME_SIZE)] * FRAME_STACK, axis=-1)


class DMCPixelEnv(PixelEnv):
    """A DMC body seen by its COM-tracking camera."""

    def __init__(self, world_name, xml, assets, set_pose, control_timestep, camera, goal_settle_steps,
                 render_mode=None, render_quality=None):
        super().__init__(world_name, render_mode, render_quality)
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

    def _info(self):
        # torso geom (x, y) (the official wrappers.py: DMCGymWrapper.step); it sits on the root body's origin, so
        # it also equals qpos[0:2]
        return {"coordinates": self.data.geom_xpos[self._torso, :2].copy()}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._task.random.seed(int(self.np_random.integers(2**32)))  # every draw derives from the gym seed
        self._env.reset()
        return self._first_obs(), self._info()

    def step(self, action):
        action = np.clip(self._check_action(action), -1.0, 1.0)
        self._env.step(self._ctrl_low + (action + 1.0) * (self._ctrl_high - self._ctrl_low) / 2)
        return self._next_obs(), 0.0, False, False, self._info()

    def goal_observation(self, goal):
        """Zero-shot goal (paper App. B.4): reset, move the root to (x, y) = `goal`, settle with zero actions
        (Quadruped 1 step, Humanoid 50), and tile that one frame 3 times along channels. Leaves the env
        mid-episode: reset it before the next episode."""
        self.reset()
        self.data.qpos[:2] = goal
        self.physics.after_reset()
        for _ in range(self.goal_settle_steps):
            self.step(np.zeros(self.action_space.shape))
        return self._goal_obs()


class QuadrupedEnv(DMCPixelEnv):
    """DMC's quadruped without walls, ball, target, terrain and rangefinders, its floor 15×15 as in its XML
    (the official quadruped.py: run_forward_color): 0.02 s control step, 12-D actions, camera "y" (id 2), a side
    view following the COM."""

    def __init__(self, render_mode=None, render_quality=None):
        super().__init__("Quadruped", quadruped.make_model(), common.ASSETS, _quadruped_pose, 0.02, "y", 1,
                         render_mode, render_quality)


class HumanoidEnv(DMCPixelEnv):
    """DMC's humanoid (the official humanoid.py: run_color): 0.025 s control step, 21-D actions, camera "back"
    (id 0), behind the COM."""

    def __init__(self, render_mode=None, render_quality=None):
        super().__init__("Humanoid", *humanoid.get_model_and_assets(), _humanoid_pose, 0.025, "back", 50,
                         render_mode, render_quality)


# ---------------------------------------------------------------- manipulation worlds


def _package_dir(name):
    """The folder of the installed package `name`, found without importing it (only its MJCF files are used;
    importing gymnasium_robotics registers its envs and prints warnings)."""
    return os.path.dirname(importlib.util.find_spec(name).origin)


def _free_camera(distance, lookat, azimuth, elevation):
    camera = mujoco.MjvCamera()
    camera.type = mujoco.mjtCamera.mjCAMERA_FREE
    camera.distance, camera.lookat[:], camera.azimuth, camera.elevation = distance, lookat, azimuth, elevation
    return camera


def _physics_step(model, data):
    """One physics step as dm_control's Physics.step takes it, which the official Kitchen and Robobin run on:
    mj_step2, then mj_step1. Positions read after it belong to the new state, and a mocap pose written before
    it acts one step later (mj_step2 uses the constraint rows that mj_step1 built before the pose changed)."""
    mujoco.mj_step2(model, data)
    mujoco.mj_step1(model, data)


class ArmEnv(PixelEnv):
    """A robot arm moved through a mocap body among objects, seen by a free camera. Every episode starts from the
    same state whatever the seed, as officially (no reset noise). A subclass defines `_reset_physics()`,
    `_act(action)` (the physics of one env step, taken with `_physics_step`) and `_coordinates()`."""

    def __init__(self, world_name, model, frame_skip, camera, action_dim, render_mode=None, render_quality=None):
        super().__init__(world_name, render_mode, render_quality)
        self.model, self.data = model, mujoco.MjData(model)
        self.frame_skip, self.camera = frame_skip, camera
        self.action_space = gym.spaces.Box(-1.0, 1.0, (action_dim,), np.float32)
        self.metadata = {**self.metadata, "render_fps": round(1 / (frame_skip * model.opt.timestep))}

    def _info(self):
        return {"coordinates": self._coordinates()}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._reset_physics()
        return self._first_obs(), self._info()

    def step(self, action):
        self._act(np.clip(self._check_action(action), -1.0, 1.0))
        return self._next_obs(), 0.0, False, False, self._info()


KITCHEN_TASKS = ("BottomBurner", "LightSwitch", "SlideCabinet", "HingeCabinet", "Microwave", "Kettle")
# Each task's goal configuration (LEXA's kitchen.py): qpos indices and their values
KITCHEN_GOALS = (([9, 10], [-0.88, -0.01]), ([17, 18], [-0.69, -0.05]), ([19], [0.37]), ([20, 21], [0.0, 0.5]),
                 ([22], [-0.5]), ([23, 24, 25], [-0.23, 0.75, 1.62]))
# The kitchen's start, D4RL's: the arm in its initial pose, knobs off, light off, doors closed, the kettle on
# the bottom-left burner. The numbers are `init_qpos` of D4RL's kitchen_multitask_v0.py, which LEXA and
# gymnasium-robotics copy. Finger 1 (0.048) starts above its 0.04 limit; the kettle's quaternion is not unit.
# fmt: off
KITCHEN_QPOS = [
    1.48388023e-01, -1.76848573e00, 1.84390296e00, -2.47685760e00, 2.60252026e-01, 7.12533105e-01, 1.59515394e00,
    4.79267505e-02, 3.71350919e-02, -2.66279850e-04, -5.18043486e-05, 3.12877220e-05, -4.51199853e-05,
    -3.90842156e-06, -4.22629655e-05, 6.28065475e-05, 4.04984708e-05, 4.62730939e-04, -2.26906415e-04,
    -4.65501369e-04, -6.44129196e-03, -1.77048263e-03, 1.08009684e-03, -2.69397440e-01, 3.50383255e-01,
    1.61944683e00, 1.00618764e00, 4.06395120e-03, -6.62095997e-03, -2.68278933e-04]
# fmt: on


def kitchen_successes(qpos):
    """The success tests of KITCHEN_TASKS on a kitchen qpos (LEXA's kitchen.py: compute_success), 1.0 or 0.0 each."""
    return np.array([
        qpos[9] < -0.38,  # bottom-right burner knob turned
        qpos[17] < -0.25,  # light switch on
        abs(qpos[19] - 0.37) < 0.1,  # sliding cabinet open
        abs(qpos[21] - 0.5) < 0.2,  # right hinge door open
        abs(qpos[22] + 0.5) < 0.2,  # microwave door open
        np.linalg.norm(qpos[23:25] - (-0.23, 0.75)) < 0.2,  # kettle (x, y) on the top-left burner
    ], dtype=np.float64)


def zyz_euler_angles(quat):
    """The z-y-z Euler angles (α, β, γ) of a unit quaternion (w, x, y, z) = exp(α ẑ/2)·exp(β ŷ/2)·exp(γ ẑ/2),
    as numpy-quaternion's `as_euler_angles` computes them (the official Kitchen's `quat_to_rpy`)."""
    w, x, y, z = quat
    half_sum, half_difference = np.arctan2(z, w), np.arctan2(-x, y)  # (α + γ)/2 and (α − γ)/2
    beta = 2 * np.arccos(min(1.0, np.sqrt((w * w + z * z) / (w * w + x * x + y * y + z * z))))  # min: never NaN
    return np.array([half_sum + half_difference, beta, half_sum - half_difference])


def zyz_quaternion(angles):
    """The unit quaternion (w, x, y, z) of z-y-z Euler angles (α, β, γ): the inverse of `zyz_euler_angles`
    (numpy-quaternion's `from_euler_angles`, the official Kitchen's `rpy_to_quat`)."""
    alpha, beta, gamma = angles
    return np.array([np.cos(beta / 2) * np.cos((alpha + gamma) / 2), -np.sin(beta / 2) * np.sin((alpha - gamma) / 2),
                     np.sin(beta / 2) * np.cos((alpha - gamma) / 2), np.cos(beta / 2) * np.sin((alpha + gamma) / 2)])


@functools.cache  # one model per look for every Kitchen env of a process (31 MB of textures): no env writes to it
def _kitchen_model(visual_meshes):
    """The official end-effector-control kitchen (franka_kitchen_ee_ctrl.xml): gymnasium-robotics' copy of D4RL's
    Franka kitchen MJCF, with the official file's mocap body welded to panda0_link7. Everything else stays as
    the official file has it: the 7 arm joint position servos (kp 870/120, their targets left at 0), the 2
    finger servos, no gravity compensation. `visual_meshes` False draws the arm with its collision meshes
    (about 300 faces a link instead of 134k in all; see the header): the physics is the same, since the
    visual geoms have no mass and no contacts."""
    spec = mujoco.MjSpec.from_file(os.path.join(
        _package_dir("gymnasium_robotics"), "envs", "assets", "kitchen_franka", "kitchen_assets",
        "kitchen_env_model.xml"))
    spec.worldbody.add_body(name="mocap", mocap=True)
    weld = spec.add_equality(name="mocap_weld", type=mujoco.mjtEq.mjEQ_WELD, objtype=mujoco.mjtObj.mjOBJ_BODY,
                             name1="mocap", name2="panda0_link7")
    weld.solref, weld.solimp = [0.02, 1], [0.9, 0.95, 0.001, 0.5, 2]
    if not visual_meshes:
        for geom in spec.geoms:
            geom.meshname = geom.meshname.replace("_viz", "_col")
        for mesh in list(spec.meshes):
            if mesh.name.endswith("_viz"):
                mesh.delete()
    model = spec.compile()
    # Weld data: anchor; link7's pose in the mocap frame, none (the official reset_mocap_welds); torque scale.
    # MuJoCo 3's weld resists rotation far less than 2.2.1's: with torque scale 1, 50 zero-action steps turn
    # link7 by 124° where 2.2.1 turns it 5.5°. √(link7's rotational / translational invweight0) = 18.47 makes
    # link7's orientation follow 2.2.1's to 0.4° on average over 50-step rollouts.
    link7 = model.body("panda0_link7").id
    torque_scale = np.sqrt(model.body_invweight0[link7, 1] / model.body_invweight0[link7, 0])
    model.eq_data[model.equality("mocap_weld").id] = [0, 0, 0, 0, 0, 0, 1, 0, 0, 0, torque_scale]
    # the XML asks for a 2560×1920 offscreen buffer (40 MB per render context); frames here are 128×128 at most
    model.vis.global_.offwidth = model.vis.global_.offheight = VIDEO_SIZE
    return model


class KitchenEnv(ArmEnv):
    """D4RL's Franka kitchen under the official end-effector control (the official
    kitchen_multitask_v0.py `step`), from gymnasium-robotics' MJCF (`_kitchen_model`).

    Action (7, clipped to [-1, 1]). Once per env step: the target orientation q* = zyz_quaternion(E − a[3:6]),
    E the z-y-z Euler angles of link7 now (so a3 turns about the world z axis, a4 about the middle y axis, a5
    about link7's own z axis), and the finger servo targets (a6, −a6), which the servos clamp to [0, 0.04] m:
    a6 > 0 opens finger 1 only, a6 < 0 finger 2 only. Then each of 40 sub-steps of 2 ms puts the mocap at
    link7's current pose plus 0.05·a[0:3] m and 5% of the raw quaternion gap q* − q (not renormalized; MuJoCo
    normalizes it), and takes one physics step. The target thus leads link7 and never holds it: with a = 0 the
    arm drifts under gravity and under its joint servos, whose targets stay at 0.

    Reset: the official order, with no forward after the mocap is put on link7, so the first sub-step pulls
    link7 towards the mocap's place at reset (the origin): the first zero-action step moves link7 by 9 cm.
    Camera: free, distance 1.86, lookat (-0.3, 0.5, 2.0), azimuth 90, elevation -60.
    `info["coordinates"]`: `kitchen_successes` of the current state.
    """

    def __init__(self, render_mode=None, render_quality=None):
        quality = resolve_render_quality(render_quality)
        super().__init__("Kitchen", _kitchen_model(visual_meshes=quality == "official"), 40,
                         _free_camera(1.86, (-0.3, 0.5, 2.0), 90, -60), 7, render_mode, quality)
        self._link7 = self.model.body("panda0_link7").id

    def _reset_physics(self):
        mujoco.mj_resetData(self.model, self.data)
        self.data.qpos[:] = KITCHEN_QPOS
        mujoco.mj_forward(self.model, self.data)  # the weld's rows now hold the mocap at the origin
        self.data.mocap_pos[0], self.data.mocap_quat[0] = self.data.xpos[self._link7], self.data.xquat[self._link7]

    def _act(self, action):
        target = zyz_quaternion(zyz_euler_angles(self.data.xquat[self._link7]) - action[3:6])
        self.data.ctrl[7:9] = action[6], -action[6]  # the arm's servo targets, ctrl[0:7], stay 0
        for _ in range(self.frame_skip):
            position, orientation = self.data.xpos[self._link7], self.data.xquat[self._link7]
            self.data.mocap_pos[0] = position + 0.05 * action[:3]
            self.data.mocap_quat[0] = orientation + 0.05 * (target - orientation)
            _physics_step(self.model, self.data)

    def _coordinates(self):
        return kitchen_successes(self.data.qpos)

    def task_success(self, task):
        """Whether KITCHEN_TASKS[task] is achieved in the current state."""
        return bool(kitchen_successes(self.data.qpos)[task])

    def task_goal_observation(self, task):
        """KITCHEN_TASKS[task]'s goal image (the official `render_goal`): the start with that task's
        object joints at their goal values, at rest, the arm at its start pose, tiled 3 times along channels.
        Leaves the env there: reset it before the next episode."""
        self._reset_physics()
        joints, values = KITCHEN_GOALS[task]
        self.data.qpos[joints] = values
        mujoco.mj_forward(self.model, self.data)
        return self._goal_obs()


ROBOBIN_TASKS = ("ReachLeft", "ReachRight", "PushFront", "PushBack")
# 9-D states (hand, block 1, block 2 xyz): the start, and each task's goal (LEXA's robobin.py:
# get_robobin_benchmark_goals). Block 1 is the green block "obj" in the red bin, block 2 the yellow "obj2" in the
# blue bin.
ROBOBIN_START = np.array([0.0, 0.6, 0.2, -0.1, 0.7, 0.04, 0.1, 0.7, 0.04])
ROBOBIN_GOALS = np.array([
    [0.12, 0.75, 0.10, -0.1, 0.7, 0.04, 0.1, 0.7, 0.04],
    [-0.10, 0.85, 0.10, -0.1, 0.7, 0.04, 0.1, 0.7, 0.04],  # y 0.85: outside the workspace, as officially
    [0.0, 0.65, 0.2, -0.1, 0.7, 0.04, 0.1, 0.85, 0.04],
    [0.0, 0.65, 0.2, -0.1, 0.55, 0.04, 0.1, 0.7, 0.04],
])
MOCAP_LOW, MOCAP_HIGH = np.array([-0.5, 0.40, 0.07]), np.array([0.5, 0.8, 0.5])  # the mocap's workspace
HAND_QUAT = np.array([0.0, -np.sqrt(0.5), np.sqrt(0.5), 0.0])  # the front-facing gripper's mocap orientation
# The blocks' height when placed. Officially 0.04, 6 mm into the bin floor: MuJoCo 2.2.1 pushes them up to rest at
# 0.046 within about 10 steps, but MuJoCo 3 finds no contact between a box and a floor slab inside it, and they
# sink through it onto the table. 0.046 is where they rest in both.
BLOCK_Z = 0.046

# The one place where our Robobin's rules differ from the official ones: task success. The official env tests the
# reach-or-push branch on its own goal index, always 0, instead of the task asked (sawyer_two_block_bin.py:
# compute_reward), so every "success" there means "hand within 0.1 of ReachLeft's hand target". We test the task
# asked, as intended.

# v1's invisible collision spheres on the arm, which metaworld 3 comments out (sawyer_xyz_base_ffg.xml): body,
# centre, radius, alpha-0 colour, whether it collides
_SAWYER_SPHERES = [
    ("right_l0", [0.08, 0, 0.23], 0.07, [0.5, 0.1, 0.1, 0], True),
    ("head", [0, 0, 0.08], 0.18, [0.5, 0.1, 0.1, 0], True),
    ("screen", [0, 0, 0], 0.001, [0.2, 0.2, 0.2, 0], True),
    ("right_l1", [0, 0, 0.1225], 0.07, [0.5, 0.1, 0.1, 0], True),
    ("right_l3", [0, -0.01, -0.12], 0.06, [0.5, 0.1, 0.1, 0], True),
    ("right_l5", [0, 0, 0.1], 0.06, [0.5, 0.1, 0.1, 0], True),
    ("right_l4_2", [0, 0.01, 0.26], 0.06, [0.2, 0.2, 0.2, 0], False),
    ("right_l2_2", [0, 0, 0.26], 0.06, [0.2, 0.2, 0.2, 0], False),
]


def _sawyer_arm(assets):
    """v1's Sawyer arm (sawyer_xyz_base_ffg.xml) as an MjSpec: metaworld 3's arm (objects/assets/xyz_base.xml,
    the same meshes) with metaworld 3's changes undone, and v1's front-facing gripper in place of its own."""
    spec = mujoco.MjSpec.from_string(f"""<mujoco>
      <include file="{assets}/objects/assets/xyz_base_dependencies.xml"/>
      <worldbody><include file="{assets}/objects/assets/xyz_base.xml"/></worldbody>
    </mujoco>""")
    for mesh in spec.meshes:  # the include resolves "../objects/meshes/..." from the wrong folder
        mesh.file = os.path.join(assets, "objects", "meshes", "xyz_base", os.path.basename(mesh.file))
    # metaworld 3's class "xyz_base" gives the joints armature 0.001 (v1: 0.1) and makes the arm's primitive
    # geoms contact-free (v1: contype = conaffinity = 1, group 0, but for the torso, screen and pedestal feet)
    for body in [spec.body("base"), *spec.body("base").find_all(mujoco.mjtObj.mjOBJ_BODY)]:
        body.childclass = "main"
    for joint in spec.body("base").find_all(mujoco.mjtObj.mjOBJ_JOINT):
        joint.armature = 0.1
    for geom in spec.body("base").find_all(mujoco.mjtObj.mjOBJ_GEOM):
        if geom.type != mujoco.mjtGeom.mjGEOM_MESH and geom.parent.name not in ("torso", "screen", "pedestal_feet"):
            geom.contype, geom.conaffinity, geom.group = 1, 1, 0
    for body, pos, radius, rgba, collides in _SAWYER_SPHERES:
        spec.body(body).add_geom(pos=pos, size=[radius, 0, 0], rgba=rgba, contype=collides, conaffinity=collides)
    # The l0 sphere rests exactly on the base's cylinder: MuJoCo 3 reports a contact there (distance -6e-17, with
    # kilonewtons of forces that do no work), 2.2.1 never did
    spec.add_exclude(bodyname1="right_arm_base_link", bodyname2="right_l0")

    # v1's front-facing gripper: body "hand" 0.12 m out from the wrist flange, with the eGripperBase mesh, and
    # "grippers", turned to face forward, with the rail and the 2 claws
    spec.detach_body(spec.body("hand"))
    right_hand = spec.body("right_hand")
    next(g for g in right_hand.geoms if g.type == mujoco.mjtGeom.mjGEOM_MESH).delete()  # v1 has it on "hand"
    hand = right_hand.add_body(name="hand", pos=[0, 0, 0.12])
    # MuJoCo 3 finds 0.43 kg in the mesh, MuJoCo 2.2.1 found 0.1847 kg with the same centre and axes: 2.2.1's
    hand.explicitinertial, hand.mass = True, 0.1846708
    hand.ipos, hand.iquat = [-0.0050823, -0.00044416, -0.0656179], [-0.4577838, 0.4463001, 0.5506285, 0.5367108]
    hand.inertia = [1.701648e-4, 1.560499e-4, 6.307094e-5]
    arm_red, white = [0.5, 0.1, 0.1, 1], [1, 1, 1, 1]
    hand.add_geom(type=mujoco.mjtGeom.mjGEOM_MESH, meshname="eGripperBase", pos=[0, 0, -0.09], quat=[0, 0, 0, 1],
                  group=1, rgba=arm_red)
    grippers = hand.add_body(name="grippers", quat=[-1, 0, 1, 0])
    grippers.add_geom(name="rail", type=mujoco.mjtGeom.mjGEOM_BOX, pos=[-0.05, 0, 0], size=[0.005, 0.055, 0.005],
                      density=7850, rgba=[0.5, 0.5, 0.5, 1], friction=[2, 0.1, 0.002])
    claw_size = [0.045, 0.003, 0.015]
    # side, the claw's y (its pad sits 3 mm further in), its slide joint and range (+a3 closes both)
    for side, y, joint, limits in [("right", -0.05, "r_close", [0, 0.04]), ("left", 0.05, "l_close", [-0.03, 0])]:
        claw = grippers.add_body(name=f"{side}claw", pos=[0, y, 0])
        claw.add_geom(type=mujoco.mjtGeom.mjGEOM_BOX, size=claw_size, condim=4, margin=0.001, rgba=white)
        claw.add_joint(name=joint, type=mujoco.mjtJoint.mjJNT_SLIDE, axis=[0, 1, 0], range=limits,
                       limited=mujoco.mjtLimited.mjLIMITED_TRUE, armature=100, damping=1000)
        pad = claw.add_body(name=f"{side}pad", pos=[0, -0.06 * y, 0])
        pad.add_geom(type=mujoco.mjtGeom.mjGEOM_BOX, size=claw_size, condim=4, margin=0.001, rgba=white,
                     solref=[0.01, 1], solimp=[0.9, 0.9, 0.01, 0.5, 2], friction=[2, 0.1, 0.002])
    return spec


def _add_bin(spec, name, x, rgba, floor_solref):
    """One bin of sawyer_two_block_bin_ffg.xml: a static body with a 2 mm floor slab, 4 walls 6 cm high and 4
    corner posts. Its inside spans x ± 0.15, y 0.5-0.9, above its floor's top at z = 0.026."""
    body = spec.worldbody.add_body(name=name, pos=[x, 0.7, 0.02])
    box = mujoco.mjtGeom.mjGEOM_BOX
    body.add_geom(type=box, pos=[0, 0, 0.005], size=[0.15, 0.2, 0.001], mass=1000, rgba=rgba, solref=floor_solref)
    for pos, size in [([0, 0.2, 0.034], [0.15, 0.001, 0.03]), ([0, -0.2, 0.034], [0.15, 0.001, 0.03]),
                      ([0.15, 0, 0.034], [0.001, 0.2, 0.03]), ([-0.151, 0, 0.034], [0.001, 0.2, 0.03])]:
        body.add_geom(type=box, pos=pos, size=size, mass=1000, rgba=rgba, solref=[0.01, 1],
                      solimp=[0.99, 0.99, 0.01, 0.5, 2])
    for cx, cy in [(0.148, 0.198), (0.148, -0.198), (-0.148, 0.198), (-0.148, -0.198)]:
        body.add_geom(type=mujoco.mjtGeom.mjGEOM_CAPSULE, fromto=[cx, cy, 0.0075, cx, cy, 0.06], size=[0.005, 0, 0],
                      rgba=rgba)


@functools.cache  # one model for every Robobin env of a process: no env writes to it
def _robobin_model():
    """The official Robobin scene (sawyer_two_block_bin_ffg.xml with sawyer_xyz_base_ffg.xml and
    shared_config.xml), built from metaworld 3's assets: the Sawyer arm with v1's front-facing gripper and its
    mocap weld, a table, a red bin at x = -0.16 holding the green block "obj" and a blue bin at x = +0.16
    holding the yellow block "obj2". qpos: arm hinges 0-6, claws r_close 7 and l_close 8, the blocks' free
    joints 9-15 and 16-22."""
    assets = os.path.join(_package_dir("metaworld"), "assets")
    spec = _sawyer_arm(assets)
    # shared_config.xml: options (integrator Euler and gravity at their defaults), geom default, light, sky
    spec.option.timestep, spec.option.iterations, spec.option.tolerance = 0.0025, 50, 1e-10
    spec.option.solver, spec.option.jacobian = mujoco.mjtSolver.mjSOL_NEWTON, mujoco.mjtJacobian.mjJAC_DENSE
    spec.option.cone = mujoco.mjtCone.mjCONE_ELLIPTIC
    spec.compiler.inertiagrouprange = [0, 5]  # metaworld 3 takes geom inertias from groups 4-5 only
    v1_solimp = [1, 1, 0, 0.5, 2]  # <default><geom solimp="1 1 0">, for the geoms above and those added below
    for geom in spec.geoms:
        if geom.parent.name not in ("rightpad", "leftpad"):  # the pads keep their own, 0.9 0.9 0.01 (_sawyer_arm)
            geom.solimp = v1_solimp
    spec.default.geom.solimp = v1_solimp
    spec.visual.headlight.ambient = [0.5, 0.5, 0.5]
    spec.add_texture(type=mujoco.mjtTexture.mjTEXTURE_SKYBOX, builtin=mujoco.mjtBuiltin.mjBUILTIN_GRADIENT,
                     rgb1=[0.5, 0.495, 0.48], rgb2=[0.5, 0.495, 0.48], width=32, height=32)  # flat grey
    for pos in ([1, 1, 4], [-3, -3, 4]):  # sawyer_xyz_base_ffg.xml: 2 point lights, no shadows
        spec.worldbody.add_light(pos=pos, dir=[0, -0.15, -1], directional=False, castshadow=False,
                                 diffuse=[0.8, 0.8, 0.8], specular=[0.3, 0.3, 0.3])
    # the table top, with v1's light_wood_v3 material
    spec.add_texture(name="light_wood_v3", type=mujoco.mjtTexture.mjTEXTURE_2D,
                     file=os.path.join(assets, "textures", "light_wood_v3.png"))
    wood = spec.add_material(name="light_wood_v3", shininess=0.1, specular=0.4)
    wood.textures[mujoco.mjtTextureRole.mjTEXROLE_RGB] = "light_wood_v3"
    spec.worldbody.add_geom(name="tableTop", type=mujoco.mjtGeom.mjGEOM_PLANE, pos=[0, 0.6, 0], size=[0.4, 0.4, 0.5],
                            rgba=[0.6, 0.6, 0.5, 1], friction=[2, 0.1, 0.002], material="light_wood_v3")
    # sawyer_two_block_bin_ffg.xml: 4 cm cubes of 10 g on free joints, with an inertia of 1e5 (they cannot
    # turn), the bins and the 2 claw servos (kp 400, targets in [-1, 1])
    for name, x, rgba in [("obj", -0.16, [0, 1, 0, 1]), ("obj2", 0.16, [0.8, 0.8, 0.1, 1])]:
        block = spec.worldbody.add_body(name=name, pos=[x, 0.7, BLOCK_Z], explicitinertial=True, mass=0.01,
                                        ipos=[0, 0, 0], inertia=[1e5, 1e5, 1e5])
        block.add_freejoint(name=f"{name}joint")
        block.add_geom(name=f"{name}Geom", type=mujoco.mjtGeom.mjGEOM_BOX, size=[0.02] * 3, rgba=rgba, condim=4,
                       friction=[1, 0.1, 0.002], solref=[0.01, 1], solimp=[0.99, 0.99, 0.01, 0.5, 2])
    _add_bin(spec, "bin_start", -0.16, [1, 0.3, 0.3, 1], floor_solref=[0.02, 1])
    _add_bin(spec, "bin_goal", 0.16, [0.3, 0.3, 1, 1], floor_solref=[0.01, 1])
    for joint in ("r_close", "l_close"):
        servo = spec.add_actuator(target=joint, trntype=mujoco.mjtTrn.mjTRN_JOINT, ctrlrange=[-1, 1],
                                  ctrllimited=mujoco.mjtLimited.mjLIMITED_TRUE, biastype=mujoco.mjtBias.mjBIAS_AFFINE)
        servo.gainprm[0], servo.biasprm[1] = 400, -400
    spec.add_equality(name="mocap_weld", type=mujoco.mjtEq.mjEQ_WELD, objtype=mujoco.mjtObj.mjOBJ_BODY,
                      name1="mocap", name2="hand", solref=[0.02, 1])
    model = spec.compile()
    # Weld data as in Kitchen's model (no anchor, the hand's pose that of the mocap: reset_mocap_welds), its torque
    # scale the same rule: √(the hand's rotational / translational invweight0) = 5.89. Over 100 random steps the
    # hand's orientation error then matches 2.2.1's (mean 0.064°, max 0.69°), its path within 0.55 mm over 200.
    hand = model.body("hand").id
    torque_scale = np.sqrt(model.body_invweight0[hand, 1] / model.body_invweight0[hand, 0])
    model.eq_data[model.equality("mocap_weld").id] = [0, 0, 0, 0, 0, 0, 1, 0, 0, 0, torque_scale]
    return model


class RobobinEnv(ArmEnv):
    """MetaWorld v1's SawyerTwoBlockBinEnv with the front-facing gripper, as LEXA sets it up (the
    official sawyer_xyz_env.py and sawyer_two_block_bin.py), on `_robobin_model`.

    Action (4, clipped to [-1, 1]): the mocap moves by 0.01·a[0:3] m from where it is (it accumulates, is not
    re-anchored to the hand) and is clipped to the workspace MOCAP_LOW-MOCAP_HIGH; its orientation is set to
    HAND_QUAT; the claws get the servo targets (a3, -a3) (+1 closes, -1 opens); then 5 sub-steps of 2.5 ms.
    Reset: the official one: mj_resetData, then 10 × [mocap at the hand's start (0, 0.6, 0.2), claws open, 5
    sub-steps] (the hand ends about 5 cm short of it, the arm still moving at up to 4 rad/s), then the blocks
    put at rest at their start, their z raised to BLOCK_Z. Camera: free, distance 1.4, lookat (0, 0.65, 0),
    azimuth 90, elevation 221 (so upside down), every frame turned 180°: the table seen from its far side,
    world +x on the image's left. `info["coordinates"]`: the hand (body "hand"), block 1, block 2 xyz.
    """

    def __init__(self, render_mode=None, render_quality=None):
        super().__init__("Robobin", _robobin_model(), 5, _free_camera(1.4, (0, 0.65, 0), 90, 221), 4, render_mode,
                         render_quality)
        self._hand = self.model.body("hand").id
        self._blocks = [self.model.geom("objGeom").id, self.model.geom("obj2Geom").id]
        joints = [self.model.joint(name).id for name in ("objjoint", "obj2joint")]
        self._block_qpos, self._block_qvel = self.model.jnt_qposadr[joints], self.model.jnt_dofadr[joints]

    def _frame(self, size):
        return np.ascontiguousarray(super()._frame(size)[::-1, ::-1])

    def _place(self, state):
        """The official reset_model, towards the 9-D `state`: the hand driven to state[:3] for 10 × 5 sub-steps
        from wherever the arm is (the mocap there unclipped, claws open), then the blocks put at rest at
        state[3:9], z raised to BLOCK_Z (their orientations, and the arm's velocities, left as they are)."""
        for _ in range(10):
            self.data.mocap_pos[0], self.data.mocap_quat[0] = state[:3], HAND_QUAT
            self.data.ctrl[:] = -1.0, 1.0
            for _ in range(self.frame_skip):
                _physics_step(self.model, self.data)
        for qpos, qvel, pos in zip(self._block_qpos, self._block_qvel, (state[3:6], state[6:9])):
            self.data.qpos[qpos : qpos + 3] = pos[0], pos[1], BLOCK_Z
            self.data.qvel[qvel : qvel + 6] = 0.0
        mujoco.mj_forward(self.model, self.data)

    def _reset_physics(self):
        mujoco.mj_resetData(self.model, self.data)
        mujoco.mj_forward(self.model, self.data)  # the weld's rows now hold the mocap at the origin
        self._place(ROBOBIN_START)

    def _act(self, action):
        self.data.mocap_pos[0] = np.clip(self.data.mocap_pos[0] + 0.01 * action[:3], MOCAP_LOW, MOCAP_HIGH)
        self.data.mocap_quat[0] = HAND_QUAT
        self.data.ctrl[:] = action[3], -action[3]
        for _ in range(self.frame_skip):
            _physics_step(self.model, self.data)

    def _coordinates(self):
        return np.concatenate([self.data.xpos[self._hand], *self.data.geom_xpos[self._blocks]])

    def task_success(self, task):
        """Whether ROBOBIN_TASKS[task] is achieved in the current state: the hand within 0.1 of its target for
        the reach tasks (0, 1), both blocks within 0.1 of theirs for the push tasks (2, 3)."""
        state, goal = self._coordinates(), ROBOBIN_GOALS[task]
        if task < 2:
            return bool(np.linalg.norm(state[:3] - goal[:3]) < 0.1)
        return bool(np.linalg.norm(state[3:6] - goal[3:6]) < 0.1 and np.linalg.norm(state[6:9] - goal[6:9]) < 0.1)

    def task_goal_observation(self, task):
        """ROBOBIN_TASKS[task]'s goal image (the official `render_goal`): from the start, the hand
        driven to the goal's hand target and the blocks put at theirs (`_place`), then one zero-action step, in
        which the mocap is clipped to the workspace (ReachRight's y 0.85 becomes 0.8, so its hand stops near
        0.84); the view tiled 3 times along channels. Leaves the env there: reset it before the next episode."""
        self._reset_physics()
        self._place(ROBOBIN_GOALS[task])
        self.step(np.zeros(4))
        return self._goal_obs()


WORLDS = {"Ant": AntEnv, "HalfCheetah": HalfCheetahEnv, "Quadruped": QuadrupedEnv, "Humanoid": HumanoidEnv,
          "Kitchen": KitchenEnv, "Robobin": RobobinEnv}  # ENV_SPECS key -> the world, without its time limit


def make_env(env_id, render_mode=None, render_quality=None):
    """The world of the paper named `env_id`, with its time limit: `gym.make("cleanmisl/<env_id>-v0")`. Raises
    ValueError for an unknown id, and RenderUnavailable (one line naming the system package to install) when
    a pixel world finds no OpenGL library."""
    if env_id not in ENV_SPECS:
        raise ValueError(f"unknown env {env_id!r}; choose one of {', '.join(ENV_SPECS)}")
    return gym.make(f"cleanmisl/{env_id}-v0", render_mode=render_mode, render_quality=render_quality)


# ---------------------------------------------------------------- downstream tasks (paper App. B.5)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """The facts the hierarchical learner needs about a downstream task (the official
    scripts/hierarchical_control/*.sh); a hierarchical.py flag left unset takes these values. The budget is this
    project's (the official scripts set none): at least 10 evaluations after epoch 0."""

    base: str  # the pretraining env (ENV_SPECS key) whose skills the task reuses
    extra_dims: int  # task dims after the base observation; the child policy sees the observation without them
    algo: str  # high-level learner: "sac" or "ppo"
    num_envs: int  # high-level episodes (200 env steps) collected per epoch
    grad_steps_per_epoch: int
    total_env_steps: int  # the budget: 2,500 SAC or 1,000 PPO epochs
    eval_every: int  # epochs between evaluations
    buffer_size: int  # high-level SAC replay capacity in transitions (0: PPO keeps no replay)
    goal_range: float  # goals (and AntMultiGoal's steps between goals) are drawn from U(-goal_range, goal_range)
    radius: float  # +1 per low-level step within this distance of the goal


TASKS = {
    "AntMultiGoal": TaskSpec("Ant", 2, "sac", 8, 50, 4_000_000, 100, 1_000_000, 7.5, 3.0),
    "HalfCheetahGoal": TaskSpec("HalfCheetah", 1, "ppo", 64, 10, 12_800_000, 100, 0, 100.0, 3.0),
    "HalfCheetahHurdle": TaskSpec("HalfCheetah", 2, "ppo", 64, 10, 12_800_000, 100, 0, 0.0, 0.0),
    "QuadrupedGoal": TaskSpec("Quadruped", 2, "sac", 8, 50, 4_000_000, 25, 300_000, 7.5, 1.5),
    "HumanoidGoal": TaskSpec("Humanoid", 2, "sac", 8, 50, 4_000_000, 25, 300_000, 5.0, 1.5),
}
ANT_GOALS = 4  # AntMultiGoal's goals per episode
ANT_GOAL_STEPS = 50  # low-level steps per AntMultiGoal goal

# The one place where our tasks differ from the official ones: AntMultiGoal's goals 2-4. The official env
# draws them once, in its constructor, so each worker and the evaluation env keep one fixed
# chain for the whole run, and only goal 1 is new in each episode. A high level can then score on goals
# 2-4 by memorizing them instead of reading the goal in its observation. We draw the whole chain at every
# reset, so reading the observation's goal is the only way to score.


class GoalTask(gym.Env):
    """TASKS[task]: its base world with goals to reach. The goal (x, y) or x is appended, raw, to the
    observation, and the reward is +1 for each step whose post-step `info["coordinates"]` lie within `radius`
    of the goal in force at that step, except the episode's first step (as in the official code).

    Goal 1 ~ U(-goal_range, goal_range) per coordinate, goal k+1 = goal k + U(-goal_range, goal_range);
    goal k is in force for low-level steps (k-1)·goal_steps onward, the last goal until the episode ends.
    The observation after a step holds the goal of the next step (the one the policy must reach next), and
    `info["goal"]` the goal that step's reward measured: they differ on the last step of a goal that
    another follows (AntMultiGoal's steps 50, 100 and 150, counting from 1).
    Observation: state worlds, base observation ⊕ goal (float32); pixel worlds, {"pixels", "goal"}.
    `world` is the base world (without a time limit), `goals` the episode's goals, one row each.
    """

    metadata = MujocoEnv.metadata  # each instance takes its world's (frames per second)

    def __init__(self, task, render_mode=None, render_quality=None):
        spec = TASKS[task]
        self.world = WORLDS[spec.base](render_mode, render_quality)
        self.metadata, self.render_mode, self.action_space = self.world.metadata, render_mode, self.world.action_space
        # The world and the goals draw from one generator, the world's: reset(seed) seeds both at once
        self._np_random = self.world.np_random
        self.goal_dim, self.goal_range, self.radius = ENV_SPECS[spec.base].coord_dim, spec.goal_range, spec.radius
        one_goal = (1, ENV_SPECS[spec.base].horizon)
        self.num_goals, self.goal_steps = (ANT_GOALS, ANT_GOAL_STEPS) if task == "AntMultiGoal" else one_goal
        self.pixels = ENV_SPECS[spec.base].pixels  # stacked frames, not a state vector
        goal_space = gym.spaces.Box(-np.inf, np.inf, (self.goal_dim,), np.float32)
        world_space = self.world.observation_space
        if self.pixels:
            self.observation_space = gym.spaces.Dict({"pixels": world_space, "goal": goal_space})
        else:
            dims = world_space.shape[0] + self.goal_dim
            self.observation_space = gym.spaces.Box(-np.inf, np.inf, (dims,), np.float32)

    def _goal(self):
        """The goal in force for the next step."""
        return self.goals[min(self.steps // self.goal_steps, self.num_goals - 1)]

    def _observation(self, obs):
        goal = self._goal().astype(np.float32)
        return {"pixels": obs, "goal": goal} if self.pixels else np.concatenate([obs, goal])

    def reset(self, *, seed=None, options=None):
        obs, info = self.world.reset(seed=seed, options=options)
        self._np_random = self.world.np_random  # a seed gives the world a new generator: share it again
        jumps = self.np_random.uniform(-self.goal_range, self.goal_range, (self.num_goals, self.goal_dim))
        self.goals = np.cumsum(jumps, axis=0)
        self.steps = 0  # low-level steps taken this episode
        return self._observation(obs), {**info, "goal": self._goal().copy()}

    def step(self, action):
        goal = self._goal().copy()
        obs, _, terminated, truncated, info = self.world.step(action)
        reached = np.linalg.norm(info["coordinates"] - goal) <= self.radius
        reward = float(reached and self.steps > 0)
        self.steps += 1
        return self._observation(obs), reward, terminated, truncated, {**info, "goal": goal}

    def render(self):
        return self.world.render()

    def close(self):
        self.world.close()


HURDLE_X = (-15.0, -13.0, -9.0, -5.0, -1.0, 3.0, 7.0, 11.0, 15.0, 19.0, 23.0, 27.0)


class HurdleEnv(LocomotionEnv):
    """HalfCheetah with 12 hurdles across its path (the official half_cheetah_hurdle_env.py): boxes of half-size
    (0.05, 1, 0.03) centred at z = 0.2 and x = HURDLE_X, which collide with the body.

    Observation: the HalfCheetah observation (preset normalization) ⊕ [x of the next hurdle, |x of the next
    hurdle − x of the back foot|], raw. The back foot is body "bfoot"; the next hurdle is the first one
    the foot has not passed (x >= the foot's x), x = 15 once the foot is past them all (the official env's value).
    Reward: the change over the step of the number of hurdles at x >= 0 that the back foot has passed
    (x < the foot's x): +1 per hurdle crossed forward, -1 per hurdle crossed back.
    """

    def __init__(self, render_mode=None, render_quality=None):
        super().__init__("HalfCheetahHurdle", "half_cheetah.xml", CHEETAH_MEAN, CHEETAH_STD, 1, render_mode,
                         render_quality)
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
        hurdle = ahead[0] if ahead else 15.0  # as the official hurdle env, whose fallback is 15, not the last hurdle
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


def make_task(task, render_mode=None, render_quality=None):
    """The downstream task named `task` (a TASKS key) on its base world, with the base world's 200-step time
    limit: `gym.make("cleanmisl/<task>-v0")`. Action space and dynamics are the base world's, the reward is the
    task's, and it never terminates. Raises ValueError for an unknown name, and RenderUnavailable for a pixel
    task without OpenGL."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    return gym.make(f"cleanmisl/{task}-v0", render_mode=render_mode, render_quality=render_quality)


def skill_view(task, obs):
    """What the pretrained skills see of `task`'s observation `obs` (a batch, or the observation space): the base
    world's observation, without the task's dims (a pixel task's "pixels")."""
    if isinstance(obs, (dict, gym.spaces.Dict)):
        return obs["pixels"]
    if isinstance(obs, gym.spaces.Box):
        return gym.spaces.Box(-np.inf, np.inf, (obs.shape[0] - TASKS[task].extra_dims,), np.float32)
    return obs[..., :-TASKS[task].extra_dims]


# ---------------------------------------------------------------- gymnasium ids

def _register():
    """Every world and task as a gymnasium env with its time limit: gym.make("cleanmisl/Ant-v0"), ...,
    gym.make("cleanmisl/AntMultiGoal-v0") once this module is imported, or gym.make("envs:cleanmisl/Ant-v0"), which
    imports it. Keyword arguments: render_mode (None or "rgb_array") and render_quality (resolve_render_quality)."""
    for name, spec in ENV_SPECS.items():
        gym.register(f"cleanmisl/{name}-v0", f"{__name__}:{WORLDS[name].__name__}", max_episode_steps=spec.horizon)
    for name, task in TASKS.items():
        entry, kwargs = ("HurdleEnv", {}) if name == "HalfCheetahHurdle" else ("GoalTask", {"task": name})
        gym.register(f"cleanmisl/{name}-v0", f"{__name__}:{entry}", kwargs=kwargs,
                     max_episode_steps=ENV_SPECS[task.base].horizon)


_register()


# ---------------------------------------------------------------- vector envs in worker processes


def env_rng_states(vector_env):
    """Each env's `env.unwrapped.np_random.bit_generator.state`, env by env, of a SyncVectorEnv or a
    ParallelVectorEnv: what a checkpoint saves."""
    if isinstance(vector_env, ParallelVectorEnv):
        return vector_env.rng_states()
    return [env.unwrapped.np_random.bit_generator.state for env in vector_env.envs]


def set_env_rng_states(vector_env, states):
    """Give each env of a SyncVectorEnv or a ParallelVectorEnv its generator state, as `env_rng_states` read it."""
    if len(states) != vector_env.num_envs:
        raise ValueError(f"{len(states)} generator states for {vector_env.num_envs} envs")
    if isinstance(vector_env, ParallelVectorEnv):
        return vector_env.set_rng_states(states)
    for env, state in zip(vector_env.envs, states):
        env.unwrapped.np_random.bit_generator.state = state


def render_envs(vector_env, indices):
    """The `render()` frames of the envs at `indices` of a SyncVectorEnv or a ParallelVectorEnv; only those draw."""
    if isinstance(vector_env, ParallelVectorEnv):
        return vector_env.render(indices)
    return [vector_env.envs[i].render() for i in indices]


class WorkerDied(RuntimeError):
    """A ParallelVectorEnv's worker process is gone (the OOM killer, a crash in a renderer, kill -9). Its message is
    one line naming the worker; `run_dir` is the vector env's (set by the agent: its checkpoint resumes the run)."""


def _shared_array(raw, shape, dtype):
    """A numpy view of a shared-memory RawArray."""
    return np.frombuffer(raw, dtype).reshape(shape)


def _worker(pipe, env_fns, shared):
    """A ParallelVectorEnv's worker process, its envs one SyncVectorEnv: answers each command (name, args) with
    (True, result) or (False, the exception raised), until "close" or until the parent is gone. `shared`: the
    vector env's observations and actions in shared memory and this worker's slice of them (None: through the pipe).
    A reset or step writes its observations there and answers None in their place; a step given no actions reads
    them there."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes the workers
    observations = actions = None
    if shared is not None:
        lo, hi = shared["slice"]
        observations = _shared_array(*shared["observations"])[lo:hi]
        actions = _shared_array(*shared["actions"])[lo:hi]
    vector = None
    try:
        while True:
            name, args = pipe.recv()
            if name == "close":
                break
            try:
                if vector is None:  # the first command builds the envs
                    vector = gym.vector.SyncVectorEnv(env_fns, autoreset_mode=gym.vector.AutoresetMode.DISABLED)
                if name == "step" and args[0] is None:
                    args = (actions.copy(),)  # an env may keep its action: not the shared one, which changes
                result = _COMMANDS[name](vector, *args)
                if name in ("reset", "step") and observations is not None:
                    observations[...] = result[0]
                    result = (None, *result[1:])
                pipe.send((True, result))
            except Exception as err:  # raised again in the parent, with this traceback as a note
                trace = "".join(traceback.format_tb(err.__traceback__)).rstrip()
                err.add_note(f"in ParallelVectorEnv worker {os.getpid()}:\n{trace}")
                pipe.send((False, err))
    except (EOFError, OSError):  # the parent is gone (its end of the pipe closed)
        pass
    finally:
        if vector is not None:
            vector.close()


_COMMANDS = {  # what a worker, or the parent for its own slice, does with its SyncVectorEnv
    "reset": lambda vector, seed, options: vector.reset(seed=seed, options=options),
    "step": lambda vector, actions: vector.step(actions),
    "rng_states": lambda vector: env_rng_states(vector),
    "set_rng_states": lambda vector, states: set_env_rng_states(vector, states),
    "render": lambda vector, indices: render_envs(vector, indices),
}


def _stop_workers(processes, pipes):
    """Ask each worker to close its envs and exit; terminate one still there after 10 s."""
    for pipe in pipes:
        with contextlib.suppress(OSError):  # a worker that is gone
            pipe.send(("close", ()))
        pipe.close()  # a worker still sending an answer no one reads (after Ctrl-C) stops there
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.terminate()
            process.join()


@contextlib.contextmanager
def _main_script_hidden(env_fns):
    """While workers are spawned, the parent's main script is out of their sight: spawn would import it in each
    worker (an agent script imports torch: seconds and 250 MB a worker). Only when `env_fns` need nothing from it."""
    main = sys.modules["__main__"]
    saved = {key: main.__dict__[key] for key in ("__file__", "__spec__") if key in main.__dict__}
    if b"__main__" not in pickle.dumps(env_fns):
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)


def _concatenate(parts, sizes):
    """What one SyncVectorEnv over all the envs gives, from the observations or infos of consecutive slices of
    `sizes` envs: arrays end to end, dicts key by key. A slice without an info key gets what gymnasium gives an
    env without it: zeros (None in object arrays, False in the key's `_key` mask)."""
    if not isinstance(parts[0], dict):
        return np.concatenate(parts)
    merged = {}
    for key in dict.fromkeys(key for part in parts for key in part):  # in order of first appearance
        known = next(part[key] for part in parts if key in part)
        merged[key] = _concatenate([part[key] if key in part else {} if isinstance(known, dict) else
                                    np.full((size, *known.shape[1:]), None if known.dtype == object else 0,
                                            known.dtype) for part, size in zip(parts, sizes)], sizes)
    return merged


def usable_cores():
    """The cores this process may run on, sorted (its CPU affinity, which a sweep sets to each run's share)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count()))


def divide_cores(cores, runs):
    """`cores` divided among `runs` runs at once (benchmarks/sweep.py, gpu_check.py): disjoint groups of consecutive
    cores whose sizes differ by one at most, the larger first; with fewer cores than runs, one core each, in turn."""
    cores = sorted(cores)
    if len(cores) < runs:
        return [[cores[i % len(cores)]] for i in range(runs)]
    size, larger = divmod(len(cores), runs)
    groups = []
    first = 0
    for i in range(runs):
        end = first + size + (1 if i < larger else 0)
        groups.append(cores[first:end])
        first = end
    return groups


class ParallelVectorEnv(gym.vector.VectorEnv):
    """What gym.vector.SyncVectorEnv(env_fns, autoreset_mode=DISABLED) gives, bit for bit, with the envs stepping in
    `num_workers` worker processes and in this one: contiguous slices of them, the first stepped here while the
    workers step theirs (None: one worker per usable core but this process's; never more than the envs after the
    first; 0: all here). Each slice is one SyncVectorEnv, whose envs of one world share one render context.

    Observations and actions go through shared memory, where their spaces are arrays; a step sends each worker a
    short message and waits for its short answer (rewards, flags, infos). The workers are spawned, not forked (a
    render context or CUDA made here would hang a forked worker), and import only envs.py and what it needs (not
    torch, nor the main script): `env_fns` must pickle (e.g. functools.partial(make_env, "Ant")). An exception in
    a worker is raised here again, of its type and message; a worker that died raises WorkerDied."""

    def __init__(self, env_fns, num_workers=None):
        self.num_envs = len(env_fns)
        if self.num_envs < 1:
            raise ValueError("a ParallelVectorEnv needs envs, got none")
        if num_workers is None:
            num_workers = len(usable_cores()) - 1
        self.num_workers = num_workers = max(0, min(num_workers, self.num_envs - 1))
        bounds = [self.num_envs * k // (num_workers + 1) for k in range(num_workers + 2)]
        self._slices = list(zip(bounds, bounds[1:]))  # this process steps envs 0:hi of the first, worker k the k+1-th
        self._processes, self._pipes = [], []
        self.run_dir = None  # an agent's run folder: a worker's death then names its checkpoint
        # stops the workers once: at close(), when garbage-collected, or at interpreter exit
        self._stop = weakref.finalize(self, _stop_workers, self._processes, self._pipes)
        self._local = gym.vector.SyncVectorEnv(env_fns[:bounds[1]], autoreset_mode=gym.vector.AutoresetMode.DISABLED)
        self.single_observation_space = self._local.single_observation_space
        self.single_action_space = self._local.single_action_space
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, self.num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, self.num_envs)
        self.metadata = {"autoreset_mode": gym.vector.AutoresetMode.DISABLED}
        context = multiprocessing.get_context("spawn")
        shared = None
        self._observations = self._actions = None
        if num_workers > 0 and all(isinstance(space, gym.spaces.Box) for space in (self.observation_space,
                                                                                    self.action_space)):
            shared = {}
            for name, space in [("observations", self.observation_space), ("actions", self.action_space)]:
                raw = context.RawArray("b", max(1, math.prod(space.shape) * space.dtype.itemsize))
                shared[name] = (raw, space.shape, space.dtype)
            self._observations = _shared_array(*shared["observations"])
            self._actions = _shared_array(*shared["actions"])
        # the workers inherit Ctrl-C ignored while they start; only the main thread may set it
        main_thread = threading.current_thread() is threading.main_thread()
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
        try:
            with _main_script_hidden(env_fns):
                for lo, hi in self._slices[1:]:
                    pipe, worker_pipe = context.Pipe()
                    self._pipes.append(pipe)
                    worker_shared = None if shared is None else {**shared, "slice": (lo, hi)}
                    process = context.Process(target=_worker, args=(worker_pipe, env_fns[lo:hi], worker_shared),
                                              daemon=True, name=f"ParallelVectorEnv worker (envs {lo}-{hi - 1})")
                    process.start()  # raises here if env_fns do not pickle
                    self._processes.append(process)
                    worker_pipe.close()  # the worker holds that end alone: its death reads as EOF here
        except BaseException:
            self.close()
            raise
        finally:
            if handler is not None:
                signal.signal(signal.SIGINT, handler)

    def _call(self, name, args):
        """Run command `name` with args[k] for each slice k in `args` (0: this process's), the workers' first,
        and return the results once all are in; raises the first exception among them."""
        if self.closed:
            raise RuntimeError("this ParallelVectorEnv is closed")
        try:
            for k, slice_args in args.items():
                if k > 0:
                    with contextlib.suppress(OSError):  # a dead worker: _receive says so
                        self._pipes[k - 1].send((name, slice_args))
            answers = {}
            if 0 in args:
                try:
                    answers[0] = (True, _COMMANDS[name](self._local, *args[0]))
                except Exception as err:  # raised once the workers' answers are in, as theirs
                    answers[0] = (False, err)
            for k in args:
                if k > 0:
                    answers[k] = self._receive(k - 1)
        except BaseException:  # Ctrl-C: answers still on their way would be read as those of the next command
            self.close()
            raise
        for ok, answer in answers.values():
            if not ok:
                raise answer
        return [answers[k][1] for k in args]

    def _receive(self, k):
        """Worker k's answer: (True, result) or (False, exception); (False, WorkerDied) if it died."""
        try:
            return self._pipes[k].recv()
        except (EOFError, OSError):
            process, (lo, hi) = self._processes[k], self._slices[k + 1]
            process.join(timeout=1)
            how = f"exit code {process.exitcode}"
            if process.exitcode is not None and process.exitcode < 0:
                how = f"killed by {signal.Signals(-process.exitcode).name}"
            died = WorkerDied(f"the env worker process of envs {lo}-{hi - 1} (pid {process.pid}) died ({how}: "
                              f"out of memory, a crash or a kill)")
            died.run_dir = self.run_dir
            return False, died

    def _split(self, name, batch, *args):
        """Run command `name` on every slice with its slice of `batch` (and `args`); return the results."""
        return self._call(name, {k: (batch[lo:hi], *args) for k, (lo, hi) in enumerate(self._slices)})

    def _gather(self, results):
        """The batched results of a reset or step from each slice's, observations from shared memory (a copy)."""
        parts = list(zip(*results))
        sizes = [hi - lo for lo, hi in self._slices]
        if self._observations is None:
            observations = _concatenate(parts[0], sizes)
        else:
            self._observations[:sizes[0]] = parts[0][0]  # this process's slice
            observations = self._observations.copy()
        return observations, *[_concatenate(part, sizes) for part in parts[1:]]

    def reset(self, *, seed=None, options=None):
        """Reset every env; an int seed s seeds env i with s + i, a list one seed per env (as SyncVectorEnv)."""
        if seed is None or isinstance(seed, int):
            seed = [None if seed is None else seed + i for i in range(self.num_envs)]
        if len(seed) != self.num_envs:
            raise ValueError(f"{len(seed)} seeds for {self.num_envs} envs")
        return self._gather(self._split("reset", seed, options))

    def step(self, actions):
        """Step env i with actions[i]; returns the batched (obs, rewards, terminated, truncated, infos)."""
        actions = np.asarray(actions)
        args = {k: (actions[lo:hi],) for k, (lo, hi) in enumerate(self._slices)}
        shared = self._actions is not None and actions.shape == self._actions.shape
        if shared and actions.dtype == self._actions.dtype:  # else through the pipes, as given
            self._actions[...] = actions
            args.update(dict.fromkeys(range(1, len(self._slices)), (None,)))  # the workers read them there
        return self._gather(self._call("step", args))

    def rng_states(self):
        """Each env's `env.unwrapped.np_random.bit_generator.state`, env by env."""
        return sum(self._call("rng_states", dict.fromkeys(range(len(self._slices)), ())), [])

    def set_rng_states(self, states):
        """Give each env its generator state, as `rng_states` read it (set_env_rng_states checks their number)."""
        self._split("set_rng_states", states)

    def render(self, indices=None):
        """The `render()` frames of the envs at `indices` (None: all), in that order; only those envs draw."""
        indices = [range(self.num_envs)[i] for i in (range(self.num_envs) if indices is None else indices)]
        asked = {k: [i - lo for i in indices if lo <= i < hi] for k, (lo, hi) in enumerate(self._slices)}
        asked = {k: (local,) for k, local in asked.items() if local}
        frames = {}
        for (k, (local,)), answer in zip(asked.items(), self._call("render", asked)):
            frames.update(zip([self._slices[k][0] + i for i in local], answer))
        return [frames[i] for i in indices]

    def close_extras(self, **kwargs):
        """Stop the workers (they close their envs) and close this process's envs."""
        self._stop()
        self._local.close()


ENV_BYTES = 2**18  # the least one env takes (measured: Kitchen 0.2 MiB, Ant 1 MiB, Quadruped 13 MiB)


def free_host_memory():
    """Bytes of host memory free now (MemAvailable), or inf where that cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return float("inf")


def check_env_memory(num_envs):
    """MemoryError (one line) if `num_envs` envs, training and evaluation together, cannot fit in free host memory."""
    needed, free = num_envs * ENV_BYTES, free_host_memory()
    if needed > free:
        raise MemoryError(f"{num_envs:,} training and evaluation envs need at least {needed / 2**30:,.1f} GiB of host "
                          f"memory; {free / 2**30:,.1f} GiB is free")


def make_envs(make, num_envs, num_eval_envs, seed, num_video_envs=0, parallel=True):
    """A run's training and evaluation vector envs, reset with `seed` and `seed + 10_000`; both never reset on their
    own. `make(render_mode)` builds one env (e.g. functools.partial(make_env, "Ant")); the first `num_video_envs`
    evaluation envs get "rgb_array" (eval_envs.video_envs), and the first of them renders once, to fail now rather than
    at the first evaluation (RenderUnavailable). ParallelVectorEnvs with `parallel`, else SyncVectorEnvs, as the agents
    built. Returns (train_envs, eval_envs). MemoryError, before any env is built, if they cannot fit in free memory."""
    def vector(env_fns):
        if parallel:
            return ParallelVectorEnv(env_fns)
        return gym.vector.SyncVectorEnv(env_fns, autoreset_mode=gym.vector.AutoresetMode.DISABLED)

    check_env_memory(num_envs + num_eval_envs)
    made = []
    try:
        made.append(vector([functools.partial(make, None)] * num_envs))
        made.append(vector([functools.partial(make, "rgb_array" if i < num_video_envs else None)
                            for i in range(num_eval_envs)]))
        made[0].reset(seed=seed)
        made[1].reset(seed=seed + 10_000)
        made[1].video_envs = range(min(num_video_envs, num_eval_envs))  # the evaluation envs that render
        if num_video_envs > 0:
            render_envs(made[1], [0])
    except BaseException:
        for vector_env in made:
            vector_env.close()
        raise
    return made[0], made[1]


def _define_encoders():
    """Define PixelEncoder and PixelGoalEncoder, with torch, at their first use (once; `__getattr__`, `make_encoder`):
    a worker process that only steps envs never imports torch, and starts in a fraction of a second."""
    global PixelEncoder, PixelGoalEncoder, torch, nn
    if "PixelEncoder" in globals():
        return
    import torch
    from torch import nn

    class PixelEncoder(nn.Module):
        """The CNN in front of every network on pixels (the official with_encoder.py): (N, 64, 64, 3k) HWC images,
        uint8 or float in [0, 255] -> (N, 1536). Divide by 255 (no mean shift), then 4 unpadded convolutions (kernel
        4, stride 2; 64 -> 31 -> 14 -> 6 -> 2 pixels) with ELU; PyTorch's default init, no normalization."""

        out_dim = 384 * 2 * 2

        def __init__(self, in_channels=3 * FRAME_STACK):
            super().__init__()
            layers = []
            for c_in, c_out in zip([in_channels, 48, 96, 192], [48, 96, 192, 384]):
                layers += [nn.Conv2d(c_in, c_out, kernel_size=4, stride=2), nn.ELU()]
            self.net = nn.Sequential(*layers, nn.Flatten())
            self.bf16 = False  # the convolutions in bfloat16 (torch.autocast), the features float32

        def forward(self, images):
            pixels = images.permute(0, 3, 1, 2).float() / 255.0
            if not self.bf16:
                return self.net(pixels)
            with torch.autocast(pixels.device.type, torch.bfloat16, cache_enabled=False):  # capturable by a graph
                return self.net(pixels).float()

    class PixelGoalEncoder(nn.Module):
        """The encoder of a pixel task's observation {"pixels": (N, 64, 64, 3k), "goal": (N, goal_dim)}:
        PixelEncoder(pixels) ⊕ goal, raw, of size 1536 + goal_dim."""

        def __init__(self, in_channels, goal_dim):
            super().__init__()
            self.pixels = PixelEncoder(in_channels)
            self.out_dim = PixelEncoder.out_dim + goal_dim

        def forward(self, obs):
            return torch.cat([self.pixels(obs["pixels"]), obs["goal"].float()], dim=-1)

    PixelEncoder.__qualname__ = "PixelEncoder"
    PixelGoalEncoder.__qualname__ = "PixelGoalEncoder"


def __getattr__(name):
    """envs.PixelEncoder and envs.PixelGoalEncoder, defined at the first use (`_define_encoders`)."""
    if name in ("PixelEncoder", "PixelGoalEncoder"):
        _define_encoders()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_encoder(observation_space):
    """One network's own observation encoder and its feature size: a PixelEncoder for stacked frames, a
    PixelGoalEncoder for a pixel task's {"pixels", "goal"}, none (identity) for state vectors."""
    _define_encoders()
    if isinstance(observation_space, gym.spaces.Dict):
        encoder = PixelGoalEncoder(observation_space["pixels"].shape[-1], observation_space["goal"].shape[0])
        return encoder, encoder.out_dim
    if len(observation_space.shape) == 3:  # (64, 64, 3·frame_stack) uint8
        encoder = PixelEncoder(in_channels=observation_space.shape[-1])
        return encoder, encoder.out_dim
    return nn.Identity(), observation_space.shape[0]


def encoders_in_bf16(*networks):
    """--bf16: every PixelEncoder inside `networks` runs its convolutions under bfloat16 autocast, and hands its
    features on as float32."""
    _define_encoders()
    for network in networks:
        for module in network.modules():
            if isinstance(module, PixelEncoder):
                module.bf16 = True


def draw_coordinates(ax, coordinates, colors, env_id=None, goals=()):
    """Draw the evaluation `coordinates` (rollouts, steps, coord_dim) on the matplotlib axes `ax`, rollout i in
    colors[i] (RGBA), as every agent's skill plot shows them; goals[i], if given, holds rollout i's goals (one per
    row), each a star in its colour (for x-only worlds, at the path's last step).

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
    planar = np.shape(coordinates[0])[-1] == 2  # the paths may differ in length
    for path, color in zip(coordinates, colors):
        ax.plot(path[:, 0], path[:, 1] if planar else np.arange(len(path)), color=color, lw=1)
    for path, color, points in zip(coordinates, colors, goals):
        for point in points:
            ax.plot(*(point if planar else (point[0], len(path) - 1)), marker="*", color=color, ms=9, mec="black",
                    mew=0.5)
    ax.set_xlabel("x")
    ax.set_ylabel("y" if planar else "env step")
    ax.set_aspect("equal" if planar else "auto")


def coverage(coordinates, env_id=None):
    """State coverage (paper App. B.3; the official MjNumUniqueCoords) of `coordinates`, shape (..., coord_dim):
    every point of every trajectory.

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
