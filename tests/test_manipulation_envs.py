"""The manipulation worlds (Kitchen, Robobin) of envs.py (the official envs/lexa/mykitchen.py and envs/lexa/robobin.py).

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
    # pixels, frame_stack (the official scripts/pretrain/*/*.sh)
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
    # the official reset leaves the hand short of (0, 0.6, 0.2) and moving; MuJoCo 2.2.1: (-0.0071, 0.5549, 0.1977)
    assert np.allclose(start[:3], (-0.0071, 0.5549, 0.1977), atol=0.0015)
    assert 3.5 < np.abs(robobin.unwrapped.data.qvel[:7]).max() < 4.5  # arm joints at up to 4 rad/s
    assert np.allclose(start[3:], (-0.1, 0.7, envs.BLOCK_Z, 0.1, 0.7, envs.BLOCK_Z))
    for _ in range(10):
        _, _, _, _, info = robobin.step(np.zeros(4, np.float32))
    assert np.allclose(info["coordinates"][:3], (0.0, 0.5995, 0.1998), atol=2e-4)  # as 2.2.1 after 10 steps


def test_never_terminates_and_truncates_at_horizon(env):
    env.reset(seed=5)
    horizon = envs.ENV_SPECS[env.env_id].horizon
    steps = [env.step(env.action_space.sample())[1:4] for _ in range(horizon)]
    assert all(reward == 0.0 and not terminated for reward, terminated, _ in steps)
    assert [truncated for *_, truncated in steps] == [False] * (horizon - 1) + [True]


def link7_pose(kitchen):
    u = kitchen.unwrapped
    return u.data.xpos[u._link7].copy(), u.data.xquat[u._link7].copy()


def turn(before, after):
    """The rotation from quaternion `before` to `after`: (angle in degrees, unit axis in world coordinates)."""
    relative, rotvec = np.empty(4), np.empty(3)
    mujoco.mju_mulQuat(relative, after, before * [1, -1, -1, -1])
    mujoco.mju_quat2Vel(rotvec, relative, 1.0)
    return np.degrees(np.linalg.norm(rotvec)), rotvec / np.linalg.norm(rotvec)


def test_kitchen_model_is_the_official_end_effector_one(kitchen):
    m = kitchen.unwrapped.model
    assert (m.nq, m.nv, m.nu, m.nmocap, m.opt.timestep) == (30, 29, 9, 1, 0.002)
    # the 7 arm joint position servos stay, targets 0 (ctrl never written), kp 870 / 120, forces ±87 / ±12
    assert np.array_equal(m.actuator_gainprm[:7, 0], [870] * 4 + [120] * 3)
    assert np.array_equal(m.actuator_biasprm[:7, 1], [-870] * 4 + [-120] * 3)
    assert np.array_equal(m.actuator_forcerange[:7, 1], [87] * 4 + [12] * 3)
    assert np.array_equal(m.actuator_ctrlrange[7:], [[0, 0.04], [0, 0.04]])  # the finger servos
    assert not m.body_gravcomp.any()  # no gravity compensation
    weld = m.equality("mocap_weld")
    assert m.body(weld.obj1id[0]).name == "mocap" and m.body(weld.obj2id[0]).name == "panda0_link7"
    assert np.allclose(weld.solref, [0.02, 1]) and np.allclose(weld.solimp[:3], [0.9, 0.95, 0.001])
    # relpos 0, relquat identity (reset_mocap_welds); torque scale √(invweight ratio) of link7 = 18.47
    assert np.allclose(m.eq_data[weld.id][3:10], [0, 0, 0, 1, 0, 0, 0])
    assert m.eq_data[weld.id][10] == pytest.approx(18.47, abs=0.01)


def test_zyz_euler_angles_are_numpy_quaternions():
    rng = np.random.default_rng(0)
    for _ in range(20):
        alpha, beta, gamma = rng.uniform(-np.pi, np.pi), rng.uniform(0.1, np.pi - 0.1), rng.uniform(-np.pi, np.pi)
        expected, about_z1, about_y, about_z2 = np.empty(4), np.empty(4), np.empty(4), np.empty(4)
        mujoco.mju_axisAngle2Quat(about_z1, [0, 0, 1], alpha)
        mujoco.mju_axisAngle2Quat(about_y, [0, 1, 0], beta)
        mujoco.mju_axisAngle2Quat(about_z2, [0, 0, 1], gamma)
        mujoco.mju_mulQuat(expected, about_z1, about_y)
        mujoco.mju_mulQuat(expected, expected.copy(), about_z2)
        quat = envs.zyz_quaternion([alpha, beta, gamma])
        assert np.allclose(quat, expected)  # exp(α ẑ/2)·exp(β ŷ/2)·exp(γ ẑ/2)
        assert np.allclose(envs.zyz_quaternion(envs.zyz_euler_angles(quat)), quat)  # the round trip keeps the sign
    # link7 at the start, as measured on the official kitchen
    assert np.allclose(envs.zyz_euler_angles(envs.zyz_quaternion([1.497, 1.519, 3.895])), [1.497, 1.519, 3.895])


def test_kitchen_reset_transient_and_drift_under_zero_action(kitchen):
    """The official kitchen on MuJoCo 2.2.1: the first zero-action step pulls link7 towards the origin, where the
    mocap sat when the weld's rows were built (+0.021, +0.002, -0.085 m, 5.3°; fingers 0.048, 0.037 -> 0.035,
    0.031). Then it drifts under gravity and the joint servos; over 50 steps MuJoCo 3 with the weld's torque
    scale drifts (-0.082, -0.137, +0.017) m (2.2.1: (-0.121, -0.220, +0.080)), its orientation within 5.5°."""
    kitchen.reset(seed=0)
    position, orientation = link7_pose(kitchen)
    kitchen.step(np.zeros(7, np.float32))
    moved, turned = link7_pose(kitchen)
    assert np.allclose(moved - position, [0.021, 0.002, -0.085], atol=0.001)
    assert turn(orientation, turned)[0] == pytest.approx(5.3, abs=0.1)
    assert np.allclose(kitchen.unwrapped.data.qpos[7:9], [0.035, 0.031], atol=0.001)
    for _ in range(49):
        kitchen.step(np.zeros(7, np.float32))
    drifted, turned = link7_pose(kitchen)
    assert np.allclose(drifted - position, [-0.082, -0.137, 0.017], atol=0.002)
    assert turn(orientation, turned)[0] < 5.5


@pytest.mark.parametrize("axis, sign, official", [(0, 1, 0.276), (1, -1, -0.422), (2, 1, 0.427)])
def test_kitchen_moves_link7_along_action(kitchen, axis, sign, official):
    """5 steps of a unit action along one axis: about 5-8 cm a step (2.2.1 measured the official distances)."""
    kitchen.reset(seed=6)
    position, _ = link7_pose(kitchen)
    action = np.zeros(7, np.float32)
    action[axis] = sign
    for _ in range(5):
        kitchen.step(action)
    moved = link7_pose(kitchen)[0] - position
    assert 0.6 * abs(official) < sign * moved[axis] < 1.1 * abs(official)
    assert np.abs(np.delete(moved, axis)).max() < 0.12  # gravity and the servos pull it sideways a little


def test_kitchen_turns_by_zyz_euler_angles(kitchen):
    """a3 turns about the world z axis, a5 about link7's own z axis, both by minus the action (official: a3 = 1
    for 5 steps turns 24°)."""
    u = kitchen.unwrapped
    for index in (3, 5):
        kitchen.reset(seed=7)
        axis = [0, 0, 1] if index == 3 else u.data.xmat[u._link7].reshape(3, 3)[:, 2]  # world z, link7's z
        _, orientation = link7_pose(kitchen)
        action = np.zeros(7, np.float32)
        action[index] = 1
        for _ in range(5):
            kitchen.step(action)
        angle, rotation_axis = turn(orientation, link7_pose(kitchen)[1])
        assert 18 < angle < 28 and rotation_axis @ axis < -0.9, (index, angle, rotation_axis @ axis)


@pytest.mark.parametrize("a6, fingers", [(1.0, (0.04, 0.0)), (-1.0, (0.0, 0.04)), (0.02, (0.02, 0.0))])
def test_kitchen_gripper_opens_one_finger(kitchen, a6, fingers):
    """The official mapping: targets (a6, -a6), clamped to [0, 0.04]; one finger opens, the other stays shut."""
    kitchen.reset(seed=8)
    for _ in range(10):
        kitchen.step(np.array([0, 0, 0, 0, 0, 0, a6], np.float32))
    assert np.allclose(kitchen.unwrapped.data.qpos[7:9], fingers, atol=0.001)


def test_kitchen_success_tests():
    start = np.array(envs.KITCHEN_QPOS)
    assert not envs.kitchen_successes(start).any()
    # (qpos index, value just inside, value just outside) per task, from the official
    # Kitchen's success thresholds (lexa_envs/kitchen.py)
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


def test_robobin_model_is_the_official_scene(robobin):
    m = robobin.unwrapped.model
    assert (m.nq, m.nv, m.nu, m.nbody, m.opt.timestep) == (23, 21, 2, 36, 0.0025)
    assert (m.opt.iterations, m.opt.tolerance, m.opt.cone) == (50, 1e-10, mujoco.mjtCone.mjCONE_ELLIPTIC)
    # two bins: red at x = -0.16 (the green block's), blue at x = +0.16 (the yellow block's)
    assert np.allclose(m.body("bin_start").pos, (-0.16, 0.7, 0.02))
    assert np.allclose(m.body("bin_goal").pos, (0.16, 0.7, 0.02))
    for name, colour in [("bin_start", (1, 0.3, 0.3, 1)), ("bin_goal", (0.3, 0.3, 1, 1))]:
        parts = m.geom_bodyid == m.body(name).id
        assert parts.sum() == 9 and np.allclose(m.geom_rgba[parts], colour)  # floor, 4 walls, 4 corner posts
    assert np.allclose(m.geom("objGeom").rgba, (0, 1, 0, 1))  # green, in the red bin
    assert np.allclose(m.geom("obj2Geom").rgba, (0.8, 0.8, 0.1, 1))  # yellow, in the blue bin
    for block in ("obj", "obj2"):  # 10 g, an inertia of 1e5: they cannot tip
        assert m.body(block).mass == 0.01 and np.allclose(m.body(block).inertia, 1e5)
    assert m.body("hand").mass == pytest.approx(0.1847, abs=1e-4)  # 2.2.1's, not MuJoCo 3's 0.43 from the mesh
    weld = m.equality("mocap_weld")
    assert m.body(weld.obj2id[0]).name == "hand" and np.allclose(weld.solref, [0.02, 1])
    assert m.eq_data[weld.id][10] == pytest.approx(5.885, abs=0.01)
    assert not m.light_castshadow.any() and m.vis.headlight.ambient[0] == pytest.approx(0.5)
    # the claw servos: kp 400, targets in [-1, 1]; r_close opens to 0.04, l_close to -0.03
    assert np.array_equal(m.actuator_gainprm[:, 0], [400, 400]) and np.array_equal(m.actuator_ctrlrange, [[-1, 1]] * 2)
    assert np.allclose(m.jnt_range[[m.joint("r_close").id, m.joint("l_close").id]], [[0, 0.04], [-0.03, 0]])


def test_robobin_blocks_rest_in_their_bins_and_never_tip(robobin):
    u = robobin.unwrapped
    robobin.reset(seed=9)
    rng = np.random.default_rng(0)
    for _ in range(200):
        _, _, _, _, info = robobin.step(rng.uniform(-1, 1, 4).astype(np.float32))
        for adr in u._block_qpos:
            assert np.allclose(u.data.qpos[adr + 3 : adr + 7], (1, 0, 0, 0), atol=1e-3)  # no tipping
    robobin.reset(seed=9)
    for _ in range(20):
        _, _, _, _, info = robobin.step(np.zeros(4, np.float32))
    assert np.allclose(info["coordinates"][[5, 8]], 0.046, atol=5e-4)  # on the bin floors (top at z = 0.026)


def test_robobin_moves_hand_with_mocap(robobin):
    u = robobin.unwrapped
    robobin.reset(seed=10)
    start, mocap = hand(robobin), u.data.mocap_pos[0].copy()
    assert np.allclose(mocap, (0, 0.6, 0.2))  # where the reset drove the hand
    for _ in range(5):
        robobin.step(np.array([1, 0, 0, 0], np.float32))
    assert np.allclose(u.data.mocap_pos[0], mocap + (0.05, 0, 0))  # 5 × 0.01, accumulated on the mocap
    assert np.allclose(u.data.mocap_quat[0], envs.HAND_QUAT)
    moved = hand(robobin) - start
    assert moved[0] > 0.015
    for _ in range(40):
        robobin.step(np.array([0, 0, 1, 0], np.float32))
    assert np.allclose(u.data.mocap_pos[0], (0.05, 0.6, 0.5))  # z clipped at the workspace's 0.5


def test_robobin_claws_close_at_the_official_speed(robobin):
    """MuJoCo 2.2.1, from open with a3 = +1: (r, l) = (0.006, -0.006) after 5 steps, (0.021, -0.021) after 10, at
    the limits (0.040, -0.030) by about step 20; -1 reopens them in about 20 steps."""
    u = robobin.unwrapped
    robobin.reset(seed=11)
    assert np.allclose(u.data.qpos[7:9], 0, atol=1e-3)  # open
    claws = {}
    for t in range(1, 41):
        robobin.step(np.array([0, 0, 0, 1 if t <= 20 else -1], np.float32))
        claws[t] = u.data.qpos[7:9].copy()
    assert np.allclose(claws[5], (0.006, -0.006), atol=1e-3) and np.allclose(claws[10], (0.021, -0.021), atol=1e-3)
    assert np.allclose(claws[20], (0.040, -0.030), atol=2e-3)
    assert np.allclose(claws[40], 0, atol=2e-3)


def test_robobin_goals(robobin):
    """The official goal images' hands (MuJoCo 2.2.1): ReachLeft (0.121, 0.747, 0.103), ReachRight
    (-0.090, 0.837, 0.112), the push goals (0.000, 0.649, 0.200). ReachRight's target, y = 0.85, lies outside
    the workspace's y ≤ 0.8, where the goal image's step clips the mocap."""
    u = robobin.unwrapped
    start, _ = robobin.reset(seed=12)
    assert [u.task_success(t) for t in range(4)] == [False] * 4
    hands = [(0.121, 0.747, 0.103), (-0.090, 0.837, 0.112), (0.0, 0.649, 0.2), (0.0, 0.649, 0.2)]
    for task in range(4):
        goal = u.task_goal_observation(task)
        assert goal.shape == (64, 64, 9) and goal.dtype == np.uint8
        assert np.array_equal(goal[..., 0:3], goal[..., 3:6]) and np.array_equal(goal[..., 3:6], goal[..., 6:9])
        assert np.abs(goal[..., :3].astype(int) - start[..., :3]).max() > 50
        # the task asked, not the official env's goal 0: from ReachLeft's goal no other task succeeds
        assert [u.task_success(t) for t in range(4)] == [t == task for t in range(4)]
        state = u._coordinates()
        assert np.allclose(state[:3], hands[task], atol=0.002)
        assert np.allclose(state[[3, 4, 6, 7]], envs.ROBOBIN_GOALS[task][[3, 4, 6, 7]], atol=1e-3)
    assert envs.ROBOBIN_GOALS[1][1] > envs.MOCAP_HIGH[1]
    u.task_goal_observation(1)
    assert u.data.mocap_pos[0][1] == envs.MOCAP_HIGH[1]


def place(env, state):
    env.reset()
    env.unwrapped._place(np.array(state, dtype=np.float64))
    for _ in range(10):  # let the hand come to rest at the mocap
        env.step(np.zeros(4, np.float32))
    return [env.unwrapped.task_success(t) for t in range(4)]


def test_robobin_success_thresholds(robobin):
    reach_left, push_front = envs.ROBOBIN_GOALS[0], envs.ROBOBIN_GOALS[2]
    assert place(robobin, [*(reach_left[:3] + (0, 0, 0.08)), *reach_left[3:]]) == [True, False, False, False]
    assert place(robobin, [*(reach_left[:3] + (0, 0, 0.12)), *reach_left[3:]]) == [False] * 4
    assert place(robobin, [*push_front[:6], *(push_front[6:] + (0.09, 0, 0))]) == [False, False, True, False]
    assert place(robobin, [*push_front[:6], *(push_front[6:] + (0.11, 0, 0))]) == [False] * 4
    # both blocks must be near their targets: block 1 moved 0.11 away fails the push too
    assert place(robobin, [*push_front[:3], *(push_front[3:6] + (0, 0.11, 0)), *push_front[6:]]) == [False] * 4


def test_robobin_view_is_the_official_one(robobin):
    """Turned 180°, the camera behind the table shows world +x on the left: the blue bin with the yellow block
    on the image's left, the red bin with the green block on its right; +y (towards the camera) lower down."""
    u = robobin.unwrapped
    obs, _ = robobin.reset(seed=13)
    frame = obs[..., 6:9].astype(int)
    red, green, blue = frame.transpose(2, 0, 1)
    columns = np.broadcast_to(np.arange(64), (64, 64))
    masks = {"blue bin": (blue > red + 80) & (blue > 150), "red bin": (red > blue + 80) & (green < 120),
             "green block": (green > 150) & (red < 100) & (blue < 100),
             "yellow block": (red > 150) & (green > 150) & (blue < 100)}
    centres = {name: columns[mask].mean() for name, mask in masks.items()}
    assert all(mask.sum() > 0 for mask in masks.values()), {n: m.sum() for n, m in masks.items()}
    assert centres["blue bin"] < 28 < 36 < centres["red bin"], centres
    assert centres["yellow block"] < 32 < centres["green block"], centres

    def yellow_row(frame):
        r, g, b = frame.astype(int).transpose(2, 0, 1)
        return np.nonzero((r > 150) & (g > 150) & (b < 100))[0].mean()

    before = yellow_row(obs[..., 6:9])
    u.data.qpos[u._block_qpos[1] + 1] += 0.15  # the yellow block (x = +0.1) towards the camera
    mujoco.mj_forward(u.model, u.data)
    assert yellow_row(u._frame(64)) > before + 2


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


def test_robobin_gripper_pads_keep_their_own_softer_contacts(robobin):
    """The official XML sets the pads' solimp to 0.9 0.9 0.01 and every other geom's (by default) to 1 1 0; the pads
    then squeeze a block as the official XML does. A scripted grasp (over the green block, down, close, up) lifts
    it out of its bin."""
    m, u = robobin.unwrapped.model, robobin.unwrapped
    for body, solimp in [("rightpad", (0.9, 0.9, 0.01, 0.5, 2)), ("leftpad", (0.9, 0.9, 0.01, 0.5, 2)),
                         ("rightclaw", (1, 1, 0, 0.5, 2)), ("hand", (1, 1, 0, 0.5, 2))]:
        geoms = m.geom_bodyid == m.body(body).id
        assert geoms.any() and np.allclose(m.geom_solimp[geoms], solimp), body
    robobin.reset(seed=0)
    block = u._block_qpos[0]
    start = u.data.qpos[block:block + 3].copy()
    for target, claws, steps in [(None, -1, 60), (start, -1, 30), (None, 1, 25)]:  # over it, down to it, close
        for _ in range(steps):
            gap = (start if target is not None else np.append(start[:2], u.data.mocap_pos[0][2])) - u.data.mocap_pos[0]
            robobin.step(np.array([*np.clip(gap / 0.01, -1, 1), claws], np.float32))
    for _ in range(20):
        robobin.step(np.array([0, 0, 1, 1], np.float32))  # up, claws closed
    assert u.data.qpos[block + 2] > start[2] + 0.08  # lifted 8 cm or more
