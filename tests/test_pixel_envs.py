"""The pixel worlds (Quadruped, Humanoid) and PixelEncoder of envs.py
(the official envs/custom_dmc_tasks and garagei/torch/modules/with_encoder.py).

    python -m pytest -q tests/test_pixel_envs.py     # ~15 s on 2 CPU cores
"""

import os
import subprocess
import sys

import envs  # first: it picks MuJoCo's GL backend before mujoco is imported (tests/conftest.py does too)
import mujoco
import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ACTION_DIMS = {"Quadruped": 12, "Humanoid": 21}
CAMERA_IDS = {"Quadruped": 2, "Humanoid": 0}  # "y" and "back", the official run/train.py: make_env's cameras
AGENT_STEP_SECONDS = {"Quadruped": 2 * 0.02, "Humanoid": 2 * 0.025}  # action repeat 2 × DMC control step


@pytest.fixture(scope="module", params=["Quadruped", "Humanoid"])
def env(request):
    env = envs.make_env(request.param, render_mode="rgb_array")
    env.env_id = request.param
    yield env
    env.close()


def frames(obs):
    """The 3 stacked frames, oldest first."""
    return [obs[..., 3 * i : 3 * i + 3] for i in range(3)]


def floor_colour(obs):
    """Median RGB of the newest frame's bottom rows: floor just in front of the camera, below the body."""
    return np.median(obs[-6:, :, 6:9].reshape(-1, 3), axis=0)


def test_spaces_and_spec(env):
    assert env.action_space.shape == (ACTION_DIMS[env.env_id],)
    assert np.all(env.action_space.low == -1) and np.all(env.action_space.high == 1)
    space = env.observation_space
    assert space.shape == (64, 64, 9) and space.dtype == np.uint8
    assert np.all(space.low == 0) and np.all(space.high == 255)
    u = env.unwrapped
    assert mujoco.mj_name2id(u.model, mujoco.mjtObj.mjOBJ_CAMERA, u.camera) == CAMERA_IDS[env.env_id]
    spec = envs.ENV_SPECS[env.env_id]
    assert (spec.horizon, spec.num_envs, spec.grad_steps_per_epoch, spec.buffer_size) == (200, 8, 200, 300_000)
    assert (spec.eval_every, spec.total_env_steps, spec.coord_dim) == (125, 4_800_000, 2)
    assert spec.goal_range == {"Quadruped": 15.0, "Humanoid": 10.0}[env.env_id]
    assert spec.pixels and spec.frame_stack == 3


def test_floor_lights_and_render_quality_are_the_official_ones(env):
    """The official colour XMLs: the floor's material "mygrid" reflects 0.2 and spans the 30 m floor once; one spot
    light in the torso follows the body and casts shadows; frames with 4× multisampling and a 2048² shadow map."""
    m = env.unwrapped.model
    floor = m.geom("floor")
    material = floor.matid[0]
    assert m.material(material).name == "mygrid" and m.mat_reflectance[material] == pytest.approx(0.2)
    assert np.array_equal(m.mat_texrepeat[material], [1, 1]) and not m.mat_texuniform[material]
    assert np.allclose(floor.size[:2], 15)
    assert m.nlight == 1 and m.light_castshadow[0] and m.light_mode[0] == mujoco.mjtCamLight.mjCAMLIGHT_TRACKCOM
    assert m.body(m.light_bodyid[0]).name == "torso"
    assert (m.vis.quality.offsamples, m.vis.quality.shadowsize) == (4, 2048)  # the fast look leaves them in place


def test_the_official_look_draws_shadows_and_reflections(env):
    official = envs.make_env(env.env_id, render_quality="official")
    fast = envs.make_env(env.env_id, render_quality="fast")
    frames = [e.reset(seed=0)[0][..., :3].astype(int) for e in (official, fast)]
    assert np.array_equal(official.unwrapped.data.qpos, fast.unwrapped.data.qpos)  # the same physics
    brighter = (frames[0] - frames[1]).sum(-1)  # official minus fast, summed over R, G, B
    assert (brighter < -60).mean() > 0.01  # the body's shadow on the floor (3-4% of the pixels)
    assert (brighter > 60).mean() > 0.1  # the floor's reflection (about 20%)
    official.close()
    fast.close()


def test_frame_stack_order(env):
    obs0, _ = env.reset(seed=0)
    assert obs0.shape == (64, 64, 9) and obs0.dtype == np.uint8
    assert all(f.shape == (64, 64, 3) and f.dtype == np.uint8 for f in frames(obs0))
    assert np.array_equal(frames(obs0)[0], frames(obs0)[1]) and np.array_equal(frames(obs0)[1], frames(obs0)[2])

    previous = obs0
    for _ in range(6):
        obs, *_ = env.step(env.action_space.sample())
        assert np.array_equal(obs[..., 0:6], previous[..., 3:9])  # shifted one frame towards the oldest
        previous = obs
    assert np.array_equal(obs[..., 6:9], env.unwrapped._frame(64))  # the newest frame is the current view
    assert not np.array_equal(obs[..., 6:9], obs0[..., 6:9])  # and the body has moved since reset


def test_floor_colour_shows_position(env):
    u = env.unwrapped
    colours, coordinates = {}, {}
    for goal in [(-10, 0), (10, 0), (0, -10), (0, 10), (10, 0)]:
        obs = u.goal_observation(np.array(goal, dtype=np.float64))
        assert obs.shape == (64, 64, 9) and np.array_equal(obs[..., 0:3], obs[..., 6:9])  # one frame, tiled
        colours.setdefault(goal, []).append(floor_colour(obs))
        coordinates[goal] = u._info()["coordinates"]
    for goal, xy in coordinates.items():
        assert np.allclose(xy, goal, atol=1.5)  # moved there (the humanoid falls over while settling)
    same = np.abs(colours[(10, 0)][0] - colours[(10, 0)][1]).max()
    along_x = np.abs(colours[(10, 0)][0] - colours[(-10, 0)][0]).max()
    along_y = np.abs(colours[(0, 10)][0] - colours[(0, -10)][0]).max()
    assert same < 15, same
    assert along_x > 60 and along_y > 60, (along_x, along_y)  # 20 m of a 30 m gradient: ~170 levels unlit


def test_coordinates_are_torso_geom(env):
    u = env.unwrapped
    torso = mujoco.mj_name2id(u.model, mujoco.mjtObj.mjOBJ_GEOM, "torso")
    _, info = env.reset(seed=1)
    assert info["coordinates"].shape == (2,)
    assert np.allclose(info["coordinates"], 0.0, atol=1e-9)  # both bodies start at x = y = 0
    for _ in range(5):
        _, _, _, _, info = env.step(env.action_space.sample())
        data = mujoco.MjData(u.model)  # torso geom position recomputed from the state alone
        data.qpos[:] = u.data.qpos
        mujoco.mj_kinematics(u.model, data)
        assert np.allclose(info["coordinates"], data.geom_xpos[torso, :2], atol=1e-9)


def test_never_terminates_and_truncates_at_200(env):
    env.reset(seed=2)
    start = env.unwrapped.physics.data.time
    ends = [env.step(env.action_space.sample())[2:4] for _ in range(200)]
    assert not any(terminated for terminated, _ in ends)
    assert [truncated for _, truncated in ends] == [False] * 199 + [True]
    elapsed = env.unwrapped.physics.data.time - start
    assert elapsed == pytest.approx(200 * AGENT_STEP_SECONDS[env.env_id])  # action repeat 2


def test_actions_map_to_actuator_bounds(env):
    env.reset(seed=3)
    low, high = env.unwrapped.model.actuator_ctrlrange.T
    dim = env.action_space.shape[0]
    env.step(np.ones(dim, np.float32))
    assert np.allclose(env.unwrapped.data.ctrl, high)
    env.step(-np.ones(dim, np.float32))
    assert np.allclose(env.unwrapped.data.ctrl, low)
    env.step(np.zeros(dim, np.float32))
    assert np.allclose(env.unwrapped.data.ctrl, (low + high) / 2)
    env.step(5 * np.ones(dim, np.float32))  # clipped
    assert np.allclose(env.unwrapped.data.ctrl, high)


def test_seeding(env):
    qpos = env.unwrapped.physics.data.qpos
    obs_a, _ = env.reset(seed=4)
    qpos_a = qpos.copy()
    obs_b, _ = env.reset(seed=4)
    assert np.array_equal(obs_a, obs_b) and np.array_equal(qpos, qpos_a)
    env.reset(seed=5)
    assert not np.array_equal(qpos, qpos_a)


def test_render_for_videos(env):
    env.reset(seed=6)
    frame = env.render()
    assert frame.shape == (128, 128, 3) and frame.dtype == np.uint8 and frame.std() > 10


def test_pixel_encoder():
    encoder = envs.PixelEncoder()
    images = torch.randint(0, 256, (5, 64, 64, 9), dtype=torch.uint8)
    seen = []
    encoder.net[0].register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
    features = encoder(images)
    assert features.shape == (5, 1536) and encoder.out_dim == 1536
    # NCHW, scaled to [0, 1] without a mean shift
    assert torch.allclose(seen[0], images.permute(0, 3, 1, 2).float() / 255)
    assert torch.allclose(encoder(images.float()), features)  # float pixels in [0, 255] give the same
    convs = [m for m in encoder.net if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding) for c in convs] == [
        (9, 48, (4, 4), (2, 2), (0, 0)), (48, 96, (4, 4), (2, 2), (0, 0)),
        (96, 192, (4, 4), (2, 2), (0, 0)), (192, 384, (4, 4), (2, 2), (0, 0))]
    assert sum(isinstance(m, torch.nn.ELU) for m in encoder.net) == 4
    assert envs.PixelEncoder(in_channels=3)(images[..., :3]).shape == (5, 1536)


def test_make_encoder(env):
    encoder, features = envs.make_encoder(env.observation_space)
    assert isinstance(encoder, envs.PixelEncoder) and features == 1536
    obs, _ = env.reset(seed=7)
    assert encoder(torch.as_tensor(obs[None])).shape == (1, features)
    state_encoder, state_features = envs.make_encoder(envs.make_env("Ant").observation_space)
    assert isinstance(state_encoder, torch.nn.Identity) and state_features == 29

@pytest.mark.parametrize("backend, package", [("osmesa", "libosmesa6"), ("egl", "libegl1")])
def test_missing_gl_library_gives_one_line_error(backend, package):
    script = (
        "import ctypes.util\n"
        "find = ctypes.util.find_library\n"
        "ctypes.util.find_library = lambda name: None if name in ('OSMesa', 'EGL') else find(name)\n"
        "import envs\n"
        "env = envs.make_env('Ant'); env.reset(seed=0); env.step(env.action_space.sample())\n"
        "try:\n"
        "    envs.make_env('Quadruped')\n"
        "except envs.RenderUnavailable as err:\n"
        "    print('ERROR', err)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "MUJOCO_GL": backend, "PYTHONPATH": REPO})
    assert result.returncode == 0, result.stderr  # the state worlds still work
    lines = [line for line in result.stdout.splitlines() if line.startswith("ERROR")]
    assert len(lines) == 1 and package in lines[0], result.stdout
    assert result.stdout.count("\n") == 1  # the message is one line


def test_bf16_encoders_give_float32_features_near_the_float32_ones():
    """--bf16: every PixelEncoder inside the networks runs its convolutions in bfloat16; its features stay float32,
    within bfloat16's rounding of the float32 ones, and the encoders of a network without the flag are untouched."""
    torch.manual_seed(0)
    encoder, other = envs.PixelEncoder(), envs.PixelEncoder()
    images = torch.randint(0, 256, (8, 64, 64, 9), dtype=torch.uint8)
    full = encoder(images)
    envs.encoders_in_bf16(torch.nn.Sequential(torch.nn.Identity(), encoder))
    half = encoder(images)
    assert half.dtype == torch.float32 and not torch.equal(half, full)
    assert ((half - full).abs() <= 0.03 * full.abs() + 0.01).float().mean() > 0.99
    assert (half - full).abs().max() < 0.1 * full.abs().max()
    assert not other.bf16
