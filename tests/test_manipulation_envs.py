"""The manipulation worlds (Kitchen, Robobin) of envs.py (spec §3.4, §3.5, §4.2, §4.3).

    python -m pytest -q tests/test_manipulation_envs.py     # ~30 s on 2 CPU cores
"""

import os
import subprocess
import sys

import envs  # first: it picks MuJoCo's GL backend before mujoco is imported (tests/conftest.py does too)
import mujoco
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ACTION_DIMS = {"Kitchen": 7, "Robobin": 4}


@pytest.fixture(scope="module")
def kitchen():
    env = envs.make_env("Kitchen", render_mode="rgb_array")
    yield env
    env.close()


@pytest.fixture(scope="module")
def robobin():
    env = envs.make_env("Robobin", render_mode="rgb_array")
    yield env
    env.close()


@pytest.fixture(params=["Kitchen", "Robobin"])
def env(request, kitchen, robobin):
    env = {"Kitchen": kitchen, "Robobin": robobin}[request.param]
    env.env_id = request.param
    return env


def hand(env):
    """Kitchen: the end-effector site; Robobin: body "hand" (the first 3 coordinates)."""
    u = env.unwrapped
    if env.env_id == "Kitchen":
        return u.data.site_xpos[u.model.site("end_effector").id].copy()
    return u._coordinates()[:3]


def test_env_specs():
    # horizon, num_envs, grad_steps_per_epoch, buffer_size, eval_every, total_env_steps, goal_range, coord_dim,
    # pixels, frame_stack (spec §1.1, §2.7, §4.1)
    assert envs.ENV_SPECS["Kitchen"] == envs.EnvSpec(50, 8, 100, 100_000, 250, 4_800_000, 0.0, 6, True, 3)
    assert envs.ENV_SPECS["Robobin"] == envs.EnvSpec(200, 10, 100, 300_000, 500, 4_800_000, 0.0, 9, True, 3)
    assert envs.KITCHEN_TASKS == (
        "BottomBurner", "LightSwitch", "SlideCabinet", "HingeCabinet", "Microwave", "Kettle")
    assert envs.ROBOBIN_TASKS == ("ReachLeft", "ReachRight", "PushFront", "PushBack")


def test_spaces_and_frame_stack(env):
    assert env.action_space.shape == (ACTION_DIMS[env.env_id],) and env.action_space.dtype == np.float32
    assert np.all(env.action_space.low == -1) and np.all(env.action_space.high == 1)
    space = env.observation_space
    assert space.shape == (64, 64, 9) and space.dtype == np.uint8 and space.low.min() == 0 and space.high.max() == 255
    obs0, info = env.reset(seed=0)
    assert obs0.shape == (64, 64, 9) and obs0.dtype == np.uint8 and space.contains(obs0)
    assert np.array_equal(obs0[..., 0:3], obs0[..., 3:6]) and np.array_equal(obs0[..., 3:6], obs0[..., 6:9])
    assert info["coordinates"].shape == (envs.ENV_SPECS[env.env_id].coord_dim,)
    previous = obs0
    for _ in range(3):
        obs, *_ = env.step(np.ones(env.action_space.shape, np.float32))
        assert np.array_equal(obs[..., 0:6], previous[..., 3:9])  # shifted one frame towards the oldest
        previous = obs
    assert np.array_equal(obs[..., 6:9], env.unwrapped._frame(64))  # the newest frame is the current view
    assert not np.array_equal(obs[..., 6:9], obs0[..., 6:9])  # and the arm has moved


def test_render_for_videos(env):
    env.reset(seed=1)
    frame = env.render()
    assert frame.shape == (128, 128, 3) and frame.dtype == np.uint8 and frame.std() > 10


def test_start_is_deterministic(env):
    u = env.unwrapped
    obs_a, info_a = env.reset(seed=2)
    qpos_a, qvel_a = u.data.qpos.copy(), u.data.qvel.copy()
    for _ in range(5):
        env.step(env.action_space.sample())
    obs_b, info_b = env.reset(seed=3)
    assert np.array_equal(obs_a, obs_b) and np.array_equal(info_a["coordinates"], info_b["coordinates"])
    assert np.array_equal(u.data.qpos, qpos_a) and np.array_equal(u.data.qvel, qvel_a)


def test_start_states(kitchen, robobin):
    _, info = kitchen.reset(seed=4)
    assert np.array_equal(kitchen.unwrapped.data.qpos, envs.KITCHEN_QPOS) and not info["coordinates"].any()
    _, info = robobin.reset(seed=4)
    start = info["coordinates"]
    assert np.allclose(start[:3], (0, 0.6, 0.2), atol=0.01)  # the mocap is there; the hand sags 4 mm under it
    assert np.allclose(start[3:], (-0.1, 0.7, 0.04, 0.1, 0.7, 0.04), atol=1e-3)


def test_never_terminates_and_truncates_at_horizon(env):
    env.reset(seed=5)
    horizon = envs.ENV_SPECS[env.env_id].horizon
    steps = [env.step(env.action_space.sample())[1:4] for _ in range(horizon)]
    assert all(reward == 0.0 and not terminated for reward, terminated, _ in steps)
    assert [truncated for *_, truncated in steps] == [False] * (horizon - 1) + [True]


@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("sign", [1, -1])
def test_kitchen_moves_end_effector_along_action(kitchen, axis, sign):
    kitchen.reset(seed=6)
    start = hand(kitchen)
    action = np.zeros(7, np.float32)
    action[axis] = sign
    for _ in range(3):
        kitchen.step(action)
    moved = hand(kitchen) - start
    assert sign * moved[axis] > 0.1  # about 7-8 cm per step
    assert np.abs(np.delete(moved, axis)).max() < 0.05


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_kitchen_turns_end_effector_about_world_axes(kitchen, axis):
    u = kitchen.unwrapped
    site = u.model.site("end_effector").id
    kitchen.reset(seed=7)
    before = u.data.site_xmat[site].reshape(3, 3).copy()
    action = np.zeros(7, np.float32)
    action[3 + axis] = 1
    for _ in range(3):
        kitchen.step(action)
    turn, rotvec = np.empty(4), np.empty(3)
    mujoco.mju_mat2Quat(turn, (u.data.site_xmat[site].reshape(3, 3) @ before.T).ravel())  # in world axes
    mujoco.mju_quat2Vel(rotvec, turn, 1.0)
    assert rotvec[axis] > 0.1  # about 0.08 rad per step
    assert np.abs(np.delete(rotvec, axis)).max() < 0.1


def test_kitchen_gripper(kitchen):
    u = kitchen.unwrapped
    kitchen.reset(seed=8)
    fingers = u.data.qpos[7:9].copy()  # 0.048 and 0.037 at the start
    for _ in range(3):
        kitchen.step(np.array([0, 0, 0, 0, 0, 0, -1], np.float32))
    closed = u.data.qpos[7:9].copy()
    assert np.all(closed < fingers - 0.02)
    for _ in range(3):
        kitchen.step(np.array([0, 0, 0, 0, 0, 0, 1], np.float32))
    assert np.all(u.data.qpos[7:9] > closed + 0.01)


def test_kitchen_success_tests():
    start = np.array(envs.KITCHEN_QPOS)
    assert not envs.kitchen_successes(start).any()
    # (qpos index, value just inside, value just outside) per task, from the thresholds of spec §3.4
    cases = [(9, -0.39, -0.37), (17, -0.26, -0.24), (19, 0.46, 0.48), (21, 0.31, 0.29), (22, -0.69, -0.71)]
    for task, (index, inside, outside) in enumerate(cases):
        qpos = start.copy()
        qpos[index] = inside
        assert envs.kitchen_successes(qpos).tolist() == [float(t == task) for t in range(6)]
        qpos[index] = outside
        assert not envs.kitchen_successes(qpos).any()
    qpos = start.copy()
    qpos[23:25] = (-0.23 + 0.12, 0.75 + 0.15)  # 0.192 from the kettle's goal (x, y)
    assert envs.kitchen_successes(qpos).tolist() == [0, 0, 0, 0, 0, 1]
    qpos[23:25] = (-0.23 + 0.12, 0.75 + 0.16)  # 0.2
    assert not envs.kitchen_successes(qpos).any()


def test_kitchen_goal_configurations(kitchen):
    u = kitchen.unwrapped
    start, _ = kitchen.reset(seed=9)
    for task in range(6):
        goal = u.task_goal_observation(task)
        assert goal.shape == (64, 64, 9) and goal.dtype == np.uint8
        assert np.array_equal(goal[..., 0:3], goal[..., 3:6]) and np.array_equal(goal[..., 3:6], goal[..., 6:9])
        assert np.abs(goal[..., :3].astype(int) - start[..., :3]).max() > 50  # that object moved in the image
        assert [u.task_success(t) for t in range(6)] == [t == task for t in range(6)]
        assert not u.data.qvel.any()
    joints, values = envs.KITCHEN_GOALS[5]
    assert np.array_equal(u.data.qpos[joints], values)  # the kettle on the top-left burner
    assert np.array_equal(np.delete(u.data.qpos, joints), np.delete(envs.KITCHEN_QPOS, joints))


def test_robobin_moves_hand_with_mocap(robobin):
    u = robobin.unwrapped
    robobin.reset(seed=10)
    start, mocap = hand(robobin), u.data.mocap_pos[0].copy()
    for _ in range(5):
        robobin.step(np.array([1, 0, 0, 0], np.float32))
    assert np.allclose(u.data.mocap_pos[0], mocap + (0.05, 0, 0))  # 5 × 0.01
    moved = hand(robobin) - start
    assert moved[0] > 0.015 and np.abs(moved[1:]).max() < 0.01  # the hand lags the mocap
    for _ in range(40):
        robobin.step(np.array([0, 0, 1, 0], np.float32))
    assert np.allclose(u.data.mocap_pos[0], (0.05, 0.6, 0.5))  # z clipped at the workspace's 0.5


def test_robobin_gripper(robobin):
    u = robobin.unwrapped
    robobin.reset(seed=11)
    assert np.allclose(u.data.qpos[7:9], 0, atol=1e-3)  # claws open at the start
    for _ in range(10):
        robobin.step(np.array([0, 0, 0, 1], np.float32))
    closed = u.data.qpos[7:9].copy()
    assert closed[0] > 0.015 and closed[1] < -0.015  # r_close opens towards +, l_close towards -
    for _ in range(15):
        robobin.step(np.array([0, 0, 0, -1], np.float32))
    assert u.data.qpos[7] < closed[0] - 0.01 and u.data.qpos[8] > closed[1] + 0.01


def test_robobin_goals(robobin):
    u = robobin.unwrapped
    start, _ = robobin.reset(seed=12)
    assert [u.task_success(t) for t in range(4)] == [False] * 4
    for task in range(4):
        goal = u.task_goal_observation(task)
        assert goal.shape == (64, 64, 9) and goal.dtype == np.uint8
        assert np.array_equal(goal[..., 0:3], goal[..., 3:6]) and np.array_equal(goal[..., 3:6], goal[..., 6:9])
        assert np.abs(goal[..., :3].astype(int) - start[..., :3]).max() > 50
        # the task asked, not the official env's goal 0 (spec §5.10): from ReachLeft's goal no other task succeeds
        assert [u.task_success(t) for t in range(4)] == [t == task for t in range(4)]
        assert np.allclose(u._coordinates(), envs.ROBOBIN_GOALS[task], atol=0.02)


def place(env, state):
    env.reset()
    env.unwrapped._place(np.array(state, dtype=np.float64))
    return [env.unwrapped.task_success(t) for t in range(4)]


def test_robobin_success_thresholds(robobin):
    reach_left, push_front = envs.ROBOBIN_GOALS[0], envs.ROBOBIN_GOALS[2]
    # the hand sags about 4 mm under the mocap, so 8 and 12 cm above the target stay on their side of 0.1
    assert place(robobin, [*(reach_left[:3] + (0, 0, 0.08)), *reach_left[3:]]) == [True, False, False, False]
    assert place(robobin, [*(reach_left[:3] + (0, 0, 0.12)), *reach_left[3:]]) == [False] * 4
    assert place(robobin, [*push_front[:6], *(push_front[6:] + (0.09, 0, 0))]) == [False, False, True, False]
    assert place(robobin, [*push_front[:6], *(push_front[6:] + (0.11, 0, 0))]) == [False] * 4
    # both blocks must be near their targets: block 1 moved 0.11 away fails the push too
    assert place(robobin, [*push_front[:3], *(push_front[3:6] + (0, 0.11, 0)), *push_front[6:]]) == [False] * 4


def test_robobin_view_is_upright_as_official(robobin):
    """Flipped both ways, the camera behind the table shows +x on the left (hence "ReachLeft" at x = +0.12)
    and +y (towards the camera) lower in the image."""
    u = robobin.unwrapped
    obs, _ = robobin.reset(seed=13)

    def block_rows(frame):
        """Mean row of the green block pixels in the image's left and right halves."""
        green = (frame[..., 1] > 120) & (frame[..., 0] < 100) & (frame[..., 2] < 100)
        return [np.nonzero(green[:, cols])[0].mean() for cols in (slice(0, 32), slice(32, 64))]

    left, right = block_rows(obs[..., 6:9])
    assert abs(left - right) < 1  # the two blocks side by side
    block2 = u.model.jnt_qposadr[u.model.body_jntadr[u.model.body("block2").id]]
    u.data.qpos[block2 + 1] += 0.15  # block 2 (x = +0.1) towards the camera
    mujoco.mj_forward(u.model, u.data)
    moved_left, moved_right = block_rows(u._frame(64))
    assert moved_left > left + 2 and abs(moved_right - right) < 0.5


def test_coverage():
    flags = np.zeros((2, 3, 6))  # 2 trajectories of 3 points
    assert envs.coverage(flags, "Kitchen") == 0
    flags[0, 1, 4] = flags[1, 2, 4] = flags[1, 0, 0] = 1  # Microwave twice, BottomBurner once
    assert envs.coverage(flags, "Kitchen") == 2
    flags[:, :, :] = 1
    assert envs.coverage(flags, "Kitchen") == 6

    states = np.zeros((2, 2, 9))
    states[0, 1, 0] = 0.004  # rounds to the first point
    states[1, 0, 0] = 0.006  # rounds to 0.01: a new state
    states[1, 1, 8] = -0.006  # -0.01 in the last dimension: another one
    assert envs.coverage(states, "Robobin") == 3
    assert envs.coverage(states[0], "Robobin") == 1

    xy = [[0.5, 0.5], [0.2, 0.9], [1.5, 0.5], [-0.5, 0.5]]  # cells (0, 0) twice, (1, 0), (-1, 0)
    assert envs.coverage(xy) == envs.coverage(xy, "Ant") == envs.coverage(xy, "Quadruped") == 3


def test_missing_gl_library_gives_one_line_error():
    script = (
        "import ctypes.util\n"
        "find = ctypes.util.find_library\n"
        "ctypes.util.find_library = lambda name: None if name in ('OSMesa', 'EGL') else find(name)\n"
        "import envs\n"
        "for env_id in ('Kitchen', 'Robobin'):\n"
        "    try:\n"
        "        envs.make_env(env_id)\n"
        "    except envs.RenderUnavailable as err:\n"
        "        print('ERROR', err)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "MUJOCO_GL": "osmesa", "PYTHONPATH": REPO})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("ERROR") and "libosmesa6" in line for line in lines), result.stdout


def test_skill_plot_draws_tasks_for_kitchen_and_the_hand_for_robobin():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = np.array([[1.0, 0, 0, 1], [0, 0, 1.0, 1]])
    flags = np.zeros((2, 51, 6))
    flags[0, 10:20, 1] = 1  # rollout 0 turns the light on for a while
    flags[1, 50, [0, 5]] = 1  # rollout 1 achieves two tasks at its last step
    fig, ax = plt.subplots()
    envs.draw_coordinates(ax, flags, colors, "Kitchen")
    grid = ax.images[0].get_array()  # (rollouts, tasks, RGBA)
    assert grid.shape == (2, 6, 4)
    assert np.array_equal(grid[0, 1], colors[0]) and np.array_equal(grid[1, 0], colors[1])
    assert np.array_equal(grid[1, 5], colors[1])
    assert (grid[0, [0, 2, 3, 4, 5]] == 1).all() and (grid[1, 1:5] == 1).all()  # white where not achieved
    assert [t.get_text() for t in ax.get_xticklabels()] == list(envs.KITCHEN_TASKS)
    plt.close(fig)

    rng = np.random.default_rng(0)
    states = rng.normal(size=(2, 201, 9))  # hand, block 1, block 2
    fig, ax = plt.subplots()
    envs.draw_coordinates(ax, states, colors, "Robobin")
    hand, blocks = ax.lines[0].get_xydata(), ax.lines[1].get_xydata()
    assert np.allclose(hand, states[0, :, 0:2])
    assert np.allclose(blocks, [states[0, -1, 3:5], states[0, -1, 6:8]])
    plt.close(fig)
