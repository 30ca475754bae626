"""The downstream tasks of hierarchical control
(the official envs/mujoco/*goal* and envs/custom_dmc_tasks/goal_wrappers.py) and the encoder of the pixel tasks' observations.

    python -m pytest -q tests/test_tasks.py     # ~15 s on 2 CPU cores
"""

import dataclasses

import envs  # first: it picks MuJoCo's GL backend before mujoco is imported
import gymnasium as gym
import mujoco
import numpy as np
import pytest
import torch

STATE_TASKS = {"AntMultiGoal": ("Ant", 29, 8), "HalfCheetahGoal": ("HalfCheetah", 18, 6),
               "HalfCheetahHurdle": ("HalfCheetah", 18, 6)}  # task: (base, base obs dims, action dims)


def test_task_table():
    assert list(envs.TASKS) == ["AntMultiGoal", "HalfCheetahGoal", "HalfCheetahHurdle", "QuadrupedGoal", "HumanoidGoal"]
    assert [f.name for f in dataclasses.fields(envs.TaskSpec)] == [
        "base", "extra_dims", "algo", "num_envs", "grad_steps_per_epoch", "total_env_steps", "eval_every",
        "buffer_size", "goal_range", "radius"]
    sac, ppo = (8, 50, 4_000_000), (64, 10, 12_800_000)  # 2,500 or 1,000 epochs of 200 env steps per env
    assert envs.TASKS["AntMultiGoal"] == envs.TaskSpec("Ant", 2, "sac", *sac, 100, 1_000_000, 7.5, 3.0)
    assert envs.TASKS["HalfCheetahGoal"] == envs.TaskSpec("HalfCheetah", 1, "ppo", *ppo, 100, 0, 100.0, 3.0)
    assert envs.TASKS["HalfCheetahHurdle"] == envs.TaskSpec("HalfCheetah", 2, "ppo", *ppo, 100, 0, 0.0, 0.0)
    assert envs.TASKS["QuadrupedGoal"] == envs.TaskSpec("Quadruped", 2, "sac", *sac, 25, 300_000, 7.5, 1.5)
    assert envs.TASKS["HumanoidGoal"] == envs.TaskSpec("Humanoid", 2, "sac", *sac, 25, 300_000, 5.0, 1.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        envs.TASKS["AntMultiGoal"].radius = 1.0


def test_unknown_task_is_a_value_error():
    with pytest.raises(ValueError, match="unknown task 'Ant'.*AntMultiGoal, HalfCheetahGoal"):
        envs.make_task("Ant")


@pytest.mark.parametrize("task", ["AntMultiGoal", "HalfCheetahGoal"])
def test_state_goal_task_appends_the_raw_goal(task):
    base, base_dims, action_dims = STATE_TASKS[task]
    env = envs.make_task(task)
    assert env.observation_space.shape == (base_dims + envs.TASKS[task].extra_dims,)
    assert env.observation_space.dtype == np.float32
    assert env.action_space == envs.make_env(base).action_space and env.action_space.shape == (action_dims,)
    obs, info = env.reset(seed=0)
    world = env.unwrapped.world  # the base world, a gymnasium env of its own
    for t in range(3):
        assert obs.dtype == np.float32 and env.observation_space.contains(obs)
        assert np.array_equal(obs[:base_dims], world._obs())  # the base world's normalized observation
        assert np.array_equal(obs[base_dims:], info["goal"].astype(np.float32))  # then the goal, raw
        assert np.array_equal(envs.skill_view(task, np.stack([obs, obs])), [world._obs()] * 2)  # what skills see
        assert np.array_equal(info["coordinates"], world.data.qpos[: len(info["goal"])])
        obs, _, _, _, info = env.step(env.action_space.sample())
    assert envs.skill_view(task, env.observation_space) == gym.spaces.Box(-np.inf, np.inf, (base_dims,), np.float32)
    pixels = {"pixels": np.zeros((2, 64, 64, 3), np.uint8), "goal": np.ones((2, 2), np.float32)}  # a pixel task's
    assert envs.skill_view("QuadrupedGoal", pixels) is pixels["pixels"]
    space = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (64, 64, 3), np.uint8), "goal": gym.spaces.Box(-1, 1)})
    assert envs.skill_view("QuadrupedGoal", space) is space["pixels"]
    # raw: well outside the few units a normalized coordinate spans
    assert np.abs(obs[base_dims:]).max() > 1.0 and np.abs(obs[base_dims:]).max() <= envs.TASKS[task].goal_range


def place(env, xy):
    """Move the root to `xy` (x, or x and y) at rest, so the next step ends within millimetres of it."""
    env.unwrapped.world.data.qpos[: len(xy)] = xy
    env.unwrapped.world.data.qvel[:] = 0


def test_ant_multi_goal_reward_on_a_hand_made_trajectory():
    env = envs.make_task("AntMultiGoal")
    env.reset(seed=0)
    goals = np.array([[5.0, 0.0], [-5.0, 0.0], [0.0, 5.0], [0.0, -5.0]])  # each > 6 from the others
    env.unwrapped.goals = goals.copy()
    positions = ([goals[0], goals[0] + [2.9, 0], goals[0] + [3.1, 0], goals[0] + [0, -2.9]] + [goals[0]] * 46
                 + [goals[0]] + [goals[1] + [0, 2]] * 49  # steps 50-99: goal 2, first still at goal 1
                 + [goals[1]] * 50  # steps 100-149: goal 3, still at goal 2
                 + [goals[3] + [-2, -2]] * 50)  # steps 150-199: goal 4, 2.83 from it
    # the first step never scores; 3.1 is outside radius 3
    expected = [0, 1, 0, 1] + [1] * 46 + [0] + [1] * 49 + [0] * 50 + [1] * 50
    rewards = []
    for t, xy in enumerate(positions):
        place(env, xy)
        obs, reward, terminated, truncated, info = env.step(np.zeros(8))
        assert np.abs(info["coordinates"] - xy).max() < 0.05  # the torso is where the test put it
        assert np.array_equal(info["goal"], goals[min(t // 50, 3)])  # the goal this step's reward measured
        assert np.array_equal(obs[-2:], goals[min((t + 1) // 50, 3)])  # the goal of the next step
        assert not terminated and truncated == (t == 199)
        rewards.append(reward)
    assert rewards == expected and sum(expected) == 147


def test_half_cheetah_goal_radius_and_first_step():
    env = envs.make_task("HalfCheetahGoal")
    _, info = env.reset(seed=0)
    goal = info["goal"][0]
    positions = [goal, goal + 2.9, goal + 3.1, goal - 2.9, goal - 3.1, goal]
    rewards = []
    for x in positions:
        place(env, [x])
        obs, reward, _, _, info = env.step(np.zeros(6))
        assert abs(info["coordinates"][0] - x) < 0.05 and info["goal"][0] == goal
        assert obs[-1] == np.float32(goal)  # one goal for the whole episode
        rewards.append(reward)
    assert rewards == [0, 1, 0, 1, 0, 1]


def test_goals_follow_the_seed_and_change_at_every_reset():
    env = envs.make_task("AntMultiGoal")
    chains = []
    for seed in [0, 0, 1, None]:
        obs, info = env.reset(seed=seed)
        chain = env.unwrapped.goals.copy()
        assert chain.shape == (4, 2) and np.array_equal(info["goal"], chain[0])
        assert np.abs(chain[0]).max() <= 7.5 and np.abs(np.diff(chain, axis=0)).max() <= 7.5
        chains.append(chain)
    assert np.array_equal(chains[0], chains[1])  # same seed, same goals
    assert not np.isin(chains[2], chains[0]).any()  # another seed, other goals
    assert not np.isin(chains[3], chains[2]).any()  # a new chain at every reset, all four goals included
    spread = np.abs(np.diff(np.stack([env.reset()[1]["goal"] for _ in range(50)]), axis=0))
    assert spread.max() > 7.5  # goal 1 covers U(-7.5, 7.5)², not one corner of it
    cheetah = envs.make_task("HalfCheetahGoal")
    goals = [cheetah.reset(seed=seed)[1]["goal"] for seed in [3, 3, 4]]
    assert goals[0] == goals[1] and goals[0] != goals[2] and abs(goals[2]) <= 100


@pytest.mark.parametrize("task", list(STATE_TASKS))
def test_state_tasks_never_terminate_and_truncate_at_200(task):
    env = envs.make_task(task)
    env.reset(seed=5)
    ends = [env.step(env.action_space.sample())[2:4] for _ in range(200)]
    assert not any(terminated for terminated, _ in ends)
    assert [truncated for _, truncated in ends] == [False] * 199 + [True]


# ---------------------------------------------------------------- HalfCheetahHurdle


def foot_x(world):
    data = mujoco.MjData(world.model)  # recomputed from the state alone
    data.qpos[:] = world.data.qpos
    mujoco.mj_kinematics(world.model, data)
    return data.body("bfoot").xpos[0]


def test_hurdle_model():
    world = envs.make_task("HalfCheetahHurdle").unwrapped
    hurdles = [g for g in range(world.model.ngeom) if world.model.geom(g).name.startswith("hurdle")]
    assert list(world.model.geom_pos[hurdles, 0]) == [-15, -13, -9, -5, -1, 3, 7, 11, 15, 19, 23, 27]
    assert np.all(world.model.geom_pos[hurdles, 1:] == [0, 0.2])
    assert np.allclose(world.model.geom_size[hurdles], [0.05, 1, 0.03])
    assert np.all(world.model.geom_type[hurdles] == mujoco.mjtGeom.mjGEOM_BOX)
    # the torso lowered onto the hurdle at x = 3 touches it
    world.reset(seed=0)
    world.data.qpos[:2] = [3.0, -0.5]  # torso at z = 0.7 - 0.5, the hurdle's height
    mujoco.mj_forward(world.model, world.data)
    touching = {(world.model.geom(c.geom1).name, world.model.geom(c.geom2).name) for c in world.data.contact}
    assert ("torso", "hurdle5") in touching
    # apart from the hurdles, the dynamics are HalfCheetah's: the same steps until the back foot first
    # touches the hurdle at x = -1 (step 13 of these actions)
    cheetah = envs.make_env("HalfCheetah").unwrapped
    world.reset(seed=0)
    cheetah.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(10):
        action = rng.uniform(-1, 1, 6)
        obs, *_ = world.step(action)
        assert np.array_equal(obs[:18], cheetah.step(action)[0])
    assert np.array_equal(world.data.qpos, cheetah.data.qpos)


def test_hurdle_reward_and_next_hurdle_features():
    env = envs.make_task("HalfCheetahHurdle")
    obs, info = env.reset(seed=0)
    assert obs.shape == (20,) and env.observation_space.shape == (20,) and "goal" not in info
    world = env.unwrapped
    # back foot x -> (reward, next hurdle x); hurdles at -15, -13, -9, -5, -1, 3, 7, 11, 15, 19, 23, 27
    steps = [(0.5, 0, 3), (3.5, 1, 7), (11.5, 2, 15), (7.5, -1, 11), (-3.0, -2, -1),
             (-14.0, 0, -13),  # crossing hurdles at x < 0 counts nothing, either way
             (-16.0, 0, -15),
             (30.0, 7, 15),  # past all 7 at x >= 0: the next hurdle is x = 15, the official env's value
             (26.5, -1, 27)]
    for target, expected_reward, expected_hurdle in steps:
        world.data.qpos[0] += target - foot_x(world)
        world.data.qpos[1] = 0.5  # lifted clear of the hurdles, at rest
        world.data.qvel[:] = 0
        obs, reward, terminated, _, info = env.step(np.zeros(6))
        foot = foot_x(world)
        assert abs(foot - target) < 0.05
        assert reward == expected_reward and not terminated
        assert obs[18] == expected_hurdle
        assert obs[19] == pytest.approx(abs(expected_hurdle - foot), abs=1e-5)
        assert np.array_equal(info["coordinates"], world.data.qpos[:1])
        raw = np.concatenate([world.data.qpos, world.data.qvel])
        assert np.allclose(obs[:18], (raw - world.obs_mean) / (world.obs_std + 1e-8), atol=1e-5)  # HalfCheetah preset


def test_hurdle_features_past_the_last_hurdle():
    # the official hurdle env falls back to x = 15 (not the last hurdle, 27) once the back foot is past them all
    env = envs.make_task("HalfCheetahHurdle")
    env.reset(seed=0)
    world = env.unwrapped
    world.data.qpos[0] = 40.0
    mujoco.mj_forward(world.model, world.data)
    foot = foot_x(world)
    assert foot > 27
    obs = world._obs()
    assert obs[18] == 15.0
    assert obs[19] == pytest.approx(abs(15.0 - foot), abs=1e-4)
    obs, *_ = env.step(np.zeros(6))  # the observation a step returns says the same
    assert obs[18] == 15.0 and obs[19] == pytest.approx(foot_x(world) - 15.0, abs=1e-4)


# ---------------------------------------------------------------- pixel tasks


@pytest.fixture(scope="module", params=["QuadrupedGoal", "HumanoidGoal"])
def pixel_task(request):
    env = envs.make_task(request.param)
    env.task = request.param
    yield env
    env.close()


def test_pixel_task_observation_reward_and_time_limit(pixel_task):
    env, spec = pixel_task, envs.TASKS[pixel_task.task]
    space = env.observation_space
    assert set(space) == {"pixels", "goal"}
    assert space["pixels"] == gym.spaces.Box(0, 255, (64, 64, 9), np.uint8)  # the base world's
    assert space["goal"].shape == (2,) and space["goal"].dtype == np.float32
    obs, info = env.reset(seed=0)
    assert space.contains(obs) and obs["pixels"].shape == (64, 64, 9) and obs["pixels"].dtype == np.uint8
    goal = info["goal"]
    assert np.array_equal(obs["goal"], goal.astype(np.float32)) and np.abs(goal).max() <= spec.goal_range
    # radius 1.5 around the torso's (x, y); the first step never scores
    rewards = []
    for offset in [0.0, 1.0, 2.0, 1.0]:
        place(env, goal + [offset, 0.0])
        obs, reward, _, _, info = env.step(np.zeros(env.action_space.shape))
        assert np.abs(info["coordinates"] - goal - [offset, 0.0]).max() < 0.2
        rewards.append(reward)
    assert rewards == [0, 1, 0, 1]
    ends = [env.step(env.action_space.sample()) for _ in range(196)]
    assert all(np.array_equal(info["goal"], goal) for *_, info in ends)  # one goal per episode
    assert not any(terminated for _, _, terminated, _, _ in ends)
    assert [truncated for _, _, _, truncated, _ in ends] == [False] * 195 + [True]
    assert np.array_equal(env.reset(seed=0)[1]["goal"], goal)  # same seed, same goal
    assert not np.array_equal(env.reset(seed=1)[1]["goal"], goal)


def test_pixel_task_encoder(pixel_task):
    encoder, features = envs.make_encoder(pixel_task.observation_space)
    assert features == 1538 and encoder.out_dim == 1538
    observations = [pixel_task.reset(seed=seed)[0] for seed in [2, 3]]
    batch = {key: torch.as_tensor(np.stack([obs[key] for obs in observations])) for key in ["pixels", "goal"]}
    out = encoder(batch)
    assert out.shape == (2, 1538)
    assert torch.equal(out[:, -2:], batch["goal"])  # the raw goal after the CNN features
    assert torch.equal(out[:, :1536], encoder.pixels(batch["pixels"]))
    assert not torch.equal(out[0, -2:], out[1, -2:])
    assert torch.equal(encoder({"pixels": batch["pixels"].float(), "goal": batch["goal"]}), out)  # float pixels too
    # Box spaces keep their encoders
    assert isinstance(envs.make_encoder(pixel_task.observation_space["pixels"])[0], envs.PixelEncoder)
    state_encoder, state_features = envs.make_encoder(envs.make_task("AntMultiGoal").observation_space)
    assert isinstance(state_encoder, torch.nn.Identity) and state_features == 31


def test_pixel_task_without_opengl_raises_render_unavailable(monkeypatch):
    monkeypatch.setattr(envs, "GL_MISSING", True)  # as when libOSMesa/libEGL does not load
    with pytest.raises(envs.RenderUnavailable):
        envs.make_task("QuadrupedGoal")
