"""The state-based worlds (the official envs/mujoco/ant_env.py, half_cheetah_env.py, with the preset
normalizer of iod/utils.py) and the coverage metric (the official MjNumUniqueCoords)."""

import gymnasium as gym
import mujoco
import numpy as np
import pytest

import envs


@pytest.mark.parametrize("env_id, obs_dim, action_dim, coord_dim", [("Ant", 29, 8, 2), ("HalfCheetah", 18, 6, 1)])
def test_observation_is_normalized_qpos_qvel_with_global_position(env_id, obs_dim, action_dim, coord_dim):
    env = envs.make_env(env_id)
    obs, info = env.reset(seed=0)
    assert obs.shape == (obs_dim,) and obs.dtype == np.float32
    assert env.action_space.shape == (action_dim,)
    assert np.all(env.action_space.low == -1) and np.all(env.action_space.high == 1)
    for _ in range(30):
        obs, _, _, _, info = env.step(env.action_space.sample())
    raw = env.unwrapped
    mujoco.mj_kinematics(raw.model, raw.data)  # body positions of the current qpos (mj_step leaves them one step behind)
    torso = raw.data.body("torso").xpos
    # x (and y) of the torso, before normalization, both in the observation and in the coverage coordinates
    unnormalized = obs[:coord_dim] * (raw.obs_std[:coord_dim] + 1e-8) + raw.obs_mean[:coord_dim]
    assert np.allclose(unnormalized, torso[:coord_dim], atol=1e-5)
    assert np.allclose(info["coordinates"], torso[:coord_dim])
    expected = (np.concatenate([raw.data.qpos, raw.data.qvel]) - raw.obs_mean) / (raw.obs_std + 1e-8)
    assert np.allclose(obs, expected, atol=1e-5)


def test_preset_normalization_values():
    ant = envs.make_env("Ant").unwrapped
    assert ant.obs_mean[2] == pytest.approx(0.7022248) and ant.obs_std[21] == pytest.approx(4.502961)
    cheetah = envs.make_env("HalfCheetah").unwrapped
    assert cheetah.obs_mean[0] == pytest.approx(-0.07861924) and cheetah.obs_std[17] == pytest.approx(5.9759197)
    # the mean state maps to the zero observation
    ant.reset(seed=0)
    ant.data.qpos[:], ant.data.qvel[:] = ant.obs_mean[:15], ant.obs_mean[15:]
    assert np.allclose(ant._obs(), 0, atol=1e-6)


@pytest.mark.parametrize("env_id", ["Ant", "HalfCheetah"])
def test_never_terminates_and_truncates_at_the_horizon(env_id):
    inner = envs.make_env(env_id).unwrapped
    inner.reset(seed=1)
    rng = np.random.default_rng(0)
    for _ in range(1000):  # violent random actions: Ant flips over, and still nothing ends
        _, _, terminated, truncated, _ = inner.step(rng.uniform(-1, 1, inner.action_space.shape))
        assert not terminated and not truncated
    env = envs.make_env(env_id)
    env.reset(seed=1)
    ends = [env.step(env.action_space.sample())[3] for _ in range(envs.ENV_SPECS[env_id].horizon)]
    assert not any(ends[:-1]) and ends[-1]


def test_reset_noise_and_seeding():
    env = envs.make_env("Ant").unwrapped
    env.reset(seed=3)
    qpos, qvel = env.data.qpos.copy(), env.data.qvel.copy()
    assert np.all(np.abs(qpos - env.model.qpos0) <= 0.1) and np.abs(qvel).max() < 1.0
    env.reset(seed=3)
    assert np.array_equal(env.data.qpos, qpos)  # same seed, same start
    env.reset()
    assert not np.array_equal(env.data.qpos, qpos)


def test_coverage_counts_distinct_unit_cells():
    xy = np.array([[0.5, 0.5], [0.9, 0.1], [1.5, 0.5], [1.7, 0.2], [-0.1, 0.3], [-0.1, -0.3]])
    assert envs.coverage(xy) == 4  # cells (0,0), (1,0), (-1,0), (-1,-1)
    trajectories = np.stack([xy, xy + 10])  # (2 trajectories, 6 points, 2): 4 more cells, shifted
    assert envs.coverage(trajectories) == 8
    x = np.array([[0.1], [0.9], [1.1], [-0.5], [-0.6]])
    assert envs.coverage(x) == 3  # bins 0, 1, -1
    # the untrained floor: positions around a reset at (0, 0) straddle the four cells around the origin
    assert envs.coverage(np.array([[0.05, 0.05], [-0.05, 0.05], [0.05, -0.05], [-0.05, -0.05]])) == 4


def test_unknown_env_is_a_value_error():
    with pytest.raises(ValueError, match="unknown env 'Hopper'"):
        envs.make_env("Hopper")


def test_goal_observation_is_a_reset_state_moved_to_the_goal():
    env = envs.make_env("Ant").unwrapped
    env.reset(seed=0)
    goal = np.array([12.5, -30.0])
    obs = env.goal_observation(goal)
    assert np.allclose(obs[:2] * (env.obs_std[:2] + 1e-8) + env.obs_mean[:2], goal, atol=1e-4)
    assert abs(env.data.qpos[2] - env.model.qpos0[2]) <= 0.1  # the rest is the fresh reset pose


def test_vector_env_without_autoreset_returns_the_final_observation_and_refuses_to_step_on():
    """The agents' contract with gymnasium: with autoreset DISABLED, the step that hits the time limit returns that
    trajectory's final observation, and stepping a finished env fails loudly instead of resetting it."""
    vector = gym.vector.SyncVectorEnv([lambda: envs.make_env("Ant") for _ in range(2)],
                                      autoreset_mode=gym.vector.AutoresetMode.DISABLED)
    vector.reset(seed=0)
    actions = np.zeros((2, 8), np.float32)
    for t in range(envs.ENV_SPECS["Ant"].horizon):
        obs, _, terminated, truncated, _ = vector.step(actions)
        assert not terminated.any() and truncated.all() == (t == envs.ENV_SPECS["Ant"].horizon - 1)
    for i, env in enumerate(vector.envs):
        assert np.array_equal(obs[i], env.unwrapped._obs())  # the state the time limit stopped at
    with pytest.raises(AssertionError):
        vector.step(actions)
    first, _ = vector.reset()
    assert not np.array_equal(first, obs)


def test_envs_of_one_world_share_one_render_context():
    """One Renderer per world and look in a process, whatever the frame size (a Kitchen render context alone
    holds 200 MB of textures); each env still draws its own state, and the context goes with the last env
    holding it. No context is made before the first frame."""
    a, b = envs.make_env("Ant", "rgb_array"), envs.make_env("Ant", "rgb_array")
    other = envs.make_env("HalfCheetah", "rgb_array")
    a.reset(seed=1)
    b.reset(seed=2)
    other.reset(seed=3)
    assert a.unwrapped._renderer is None  # made at the first frame, not in the constructor or at reset
    for _ in range(20):
        a.step(np.ones(8, np.float32))
    frame_a = a.render()
    frame_b, _ = b.render(), other.render()  # b draws after a, with the same context
    renderer = a.unwrapped._renderer
    assert b.unwrapped._renderer is renderer and other.unwrapped._renderer is not renderer
    assert a.unwrapped._frame(64).shape == (64, 64, 3) and a.unwrapped._renderer is renderer  # any size, one context
    assert not np.array_equal(frame_a, frame_b) and np.array_equal(a.render(), frame_a)
    b.close()
    assert np.array_equal(a.render(), frame_a)  # closing b left a's context alone
    key = ("Ant", a.unwrapped.render_quality)
    assert envs._RENDERERS[key] is renderer
    del renderer
    a.close()
    assert key not in envs._RENDERERS
    other.close()


def test_render_mode_is_checked_and_honoured():
    with pytest.raises(ValueError, match="unsupported render_mode 'depth_array'"), pytest.warns(UserWarning):
        envs.make_env("Ant", "depth_array")  # gym.make warns first, then the env refuses
    env = envs.make_env("Ant")
    env.reset(seed=0)
    with pytest.warns(UserWarning, match="render_mode='rgb_array'"):
        assert env.render() is None  # no render mode, no frames (gymnasium's convention)
    assert env.unwrapped._renderer is None
    env = envs.make_env("Ant", "rgb_array")
    env.reset(seed=0)
    assert env.render().shape == (envs.VIDEO_SIZE, envs.VIDEO_SIZE, 3)


def test_render_quality_is_checked():
    assert envs.make_env("Ant", render_quality="official").unwrapped.render_quality == "official"
    assert envs.make_env("Ant", render_quality="fast").unwrapped.render_quality == "fast"
    with pytest.raises(envs.RenderUnavailable, match="unknown render quality 'best'"):
        envs.make_env("Ant", render_quality="best")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CLEANMISL_RENDER", "official")
        assert envs.make_env("Ant").unwrapped.render_quality == "official"
        patch.setenv("CLEANMISL_RENDER", "fast")
        assert envs.make_env("Ant").unwrapped.render_quality == "fast"
        patch.delenv("CLEANMISL_RENDER")
        expected = "official" if envs.GPU_RENDER_NODE else "fast"  # the default: official on a GPU render node
        assert envs.make_env("Ant").unwrapped.render_quality == expected


def test_skill_plot_draws_paths_in_the_plane_or_against_time():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = np.cumsum(np.ones((3, 201, 2)), axis=1) * [[[1, -1]], [[2, 0]], [[0, 3]]]
    colors = np.eye(4)[:3]
    fig, ax = plt.subplots()
    envs.draw_coordinates(ax, paths, colors, "Ant")
    assert [np.allclose(line.get_xydata(), p) for line, p in zip(ax.lines, paths)] == [True] * 3
    assert np.allclose(matplotlib.colors.to_rgba(ax.lines[2].get_color()), colors[2])
    fig, ax = plt.subplots()
    envs.draw_coordinates(ax, paths[..., :1], colors, "HalfCheetah")  # x against the env step
    assert np.allclose(ax.lines[1].get_xydata(), np.stack([paths[1, :, 0], np.arange(201)], -1))
    assert ax.get_ylabel() == "env step"
    fig, ax = plt.subplots()  # paths of any lengths; goals as stars in their rollout's colour
    envs.draw_coordinates(ax, [paths[0, :5], paths[1, :3]], colors, goals=[[(4, 5)], [(7, 1), (9, 2)]])
    stars = [line for line in ax.lines if line.get_marker() == "*"]
    assert [tuple(star.get_xydata()[0]) for star in stars] == [(4, 5), (7, 1), (9, 2)]
    assert np.allclose(matplotlib.colors.to_rgba(stars[2].get_color()), colors[1])
    fig, ax = plt.subplots()  # x-only: each star at its path's last step
    envs.draw_coordinates(ax, [paths[0, :5, :1], paths[1, :3, :1]], colors, goals=[[(4,)], [(7,), (9,)]])
    assert [tuple(line.get_xydata()[0]) for line in ax.lines[2:]] == [(4, 4), (7, 2), (9, 2)]
    plt.close("all")
