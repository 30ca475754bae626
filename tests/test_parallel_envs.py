"""envs.ParallelVectorEnv and envs.make_envs: envs stepping in worker processes (and the first slice in this one)
give, bit for bit, what one SyncVectorEnv over the same envs gives (observations through shared memory or the pipes,
pixels included, infos, generator states, frames); errors in a worker reach the parent, and a worker imports neither
torch nor the main script.

    python -m pytest -q tests/test_parallel_envs.py     # ~25 s on 2 CPU cores
"""

import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import envs  # first: it picks MuJoCo's GL backend before mujoco is imported (tests/conftest.py does too)
import gymnasium as gym
import numpy as np
import pytest

ANT = functools.partial(envs.make_env, "Ant")


def serial(env_fns):
    return gym.vector.SyncVectorEnv(env_fns, autoreset_mode=gym.vector.AutoresetMode.DISABLED)


def worker_processes():
    return [p for p in multiprocessing.active_children() if p.name.startswith("ParallelVectorEnv worker")]


def assert_equal(a, b, where="result"):
    """The same arrays (values and dtypes), or dicts, lists or tuples of them, item by item."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for key in a:
            assert_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and np.array_equal(a, b), where


def assert_same_rollout(parallel, sync, steps, seed):
    """Reset both with `seed`, then step both with the same random actions: every result equal."""
    assert_equal(parallel.reset(seed=seed), sync.reset(seed=seed), "reset")
    actions = np.random.default_rng(seed).uniform(-1, 1, (steps, *sync.action_space.shape)).astype(np.float32)
    for t, action in enumerate(actions):
        for name, a, b in zip(["obs", "rewards", "terminated", "truncated", "infos"], parallel.step(action),
                              sync.step(action)):
            assert_equal(a, b, f"step {t}: {name}")
    assert_equal(parallel.rng_states(), envs.env_rng_states(sync), "rng states")


@pytest.fixture(scope="module")
def ant():
    """3 Ant envs, the first in this process and one in each of 2 workers, and the same 3 envs in this process."""
    parallel = envs.ParallelVectorEnv([ANT] * 3, num_workers=2)
    yield parallel, serial([ANT] * 3)
    parallel.close()


def test_ant_steps_as_one_sync_vector_env_to_its_time_limit(ant):
    parallel, sync = ant
    assert parallel.num_envs == 3 and parallel.num_workers == 2 and len(worker_processes()) == 2
    assert parallel._observations.shape == (3, 29) and parallel._actions.shape == (3, 8)  # in shared memory
    assert parallel.single_observation_space == sync.single_observation_space
    assert parallel.single_action_space == sync.single_action_space
    assert parallel.observation_space == sync.observation_space and parallel.action_space == sync.action_space
    assert_same_rollout(parallel, sync, steps=200, seed=3)  # the last step truncates
    with pytest.raises(AssertionError, match="_autoreset_envs"):  # as SyncVectorEnv: no step past the end
        parallel.step(np.zeros((3, 8)))
    assert_equal(parallel.reset(seed=[7, None, 9])[0][[0, 2]], sync.reset(seed=[7, 8, 9])[0][[0, 2]])


def test_generator_states_are_read_and_set_env_by_env(ant):
    parallel, sync = ant
    sync.reset(seed=123)
    states = envs.env_rng_states(sync)
    assert len({str(state) for state in states}) == 3  # three different generators
    parallel.reset(seed=0)
    assert parallel.rng_states() != states
    envs.set_env_rng_states(parallel, states)
    assert envs.env_rng_states(parallel) == states
    assert_equal(parallel.reset()[0], sync.reset()[0])  # an unseeded reset draws from the states set
    with pytest.raises(ValueError, match="2 generator states for 3 envs"):
        envs.set_env_rng_states(parallel, states[:2])


def test_a_nan_action_raises_the_envs_value_error_in_the_parent(ant):
    parallel, sync = ant
    parallel.reset(seed=0)
    actions = np.zeros((3, 8))
    actions[2, 0] = np.nan  # the env of the second worker (float64 actions: through the pipe, not shared memory)
    with pytest.raises(ValueError) as raised:
        parallel.step(actions)
    assert str(raised.value) == "action must be finite, got [nan  0.  0.  0.  0.  0.  0.  0.]"
    assert parallel.step(np.zeros((3, 8)))[0].shape == (3, 29)  # the workers answer on
    actions[:] = 0
    actions[0, 1] = np.inf  # the env stepped in this process
    with pytest.raises(ValueError, match="action must be finite"):
        parallel.step(actions.astype(np.float32))
    assert_same_rollout(parallel, sync, steps=3, seed=4)  # every answer of that step was read


def test_pixel_world_frames_and_renders_are_those_of_the_serial_envs():
    """Quadruped's 64×64 observations, drawn in the workers (with OSMesa on a CPU), and 128×128 video frames."""
    env_fns = [functools.partial(envs.make_env, "Quadruped", mode) for mode in (None, "rgb_array", "rgb_array")]
    parallel, sync = envs.ParallelVectorEnv(env_fns, num_workers=1), serial(env_fns)  # envs 0 here | 1, 2
    try:
        assert_same_rollout(parallel, sync, steps=10, seed=5)
        frames = parallel.render([1])
        assert len(frames) == 1 and frames[0].shape == (128, 128, 3) and frames[0].std() > 0
        assert_equal(frames, envs.render_envs(sync, [1]))
        frames = envs.render_envs(parallel, [2, -2])  # in the order asked
        assert_equal(frames, [sync.envs[2].render(), sync.envs[1].render()])
        assert not np.array_equal(frames[0], frames[1])
    finally:
        parallel.close()


def test_a_dict_observation_goes_through_the_pipes():
    """QuadrupedGoal's {"pixels", "goal"} is no single array: no shared memory, the same numbers."""
    env_fns = [functools.partial(envs.make_task, "QuadrupedGoal")] * 2
    parallel, sync = envs.ParallelVectorEnv(env_fns, num_workers=1), serial(env_fns)
    try:
        assert parallel._observations is None and isinstance(parallel.single_observation_space, gym.spaces.Dict)
        assert_same_rollout(parallel, sync, steps=3, seed=2)
    finally:
        parallel.close()


def test_make_envs_in_parallel_builds_the_serial_envs():
    made = {parallel: envs.make_envs(ANT, 2, 3, seed=11, num_video_envs=1, parallel=parallel)
            for parallel in (False, True)}
    (train, evaluation), (parallel_train, parallel_evaluation) = made[False], made[True]
    try:
        assert isinstance(train, gym.vector.SyncVectorEnv) and isinstance(parallel_train, envs.ParallelVectorEnv)
        sizes = (parallel_train.num_envs, parallel_evaluation.num_envs)
        assert sizes == (train.num_envs, evaluation.num_envs) == (2, 3)
        cores = len(os.sched_getaffinity(0))  # the default: a worker per usable core but this process's, and a slice here
        assert (parallel_train.num_workers, parallel_evaluation.num_workers) == (min(1, cores - 1), min(2, cores - 1))
        assert [env.render_mode for env in evaluation.envs] == ["rgb_array", None, None]
        # the first video env rendered once (its render context made), no other env
        assert [env.unwrapped._renderer is not None for env in evaluation.envs] == [True, False, False]
        for sync, parallel in [(train, parallel_train), (evaluation, parallel_evaluation)]:
            assert_equal(envs.env_rng_states(parallel), envs.env_rng_states(sync))  # reset with the same seeds
            zeros = np.zeros(sync.action_space.shape)
            assert_equal(parallel.step(zeros)[0], sync.step(zeros)[0])
        assert_equal(envs.render_envs(parallel_evaluation, [0]), envs.render_envs(evaluation, [0]))
        for vector_env, seed in [(parallel_train, 11), (parallel_evaluation, 11 + 10_000)]:
            env = ANT()
            env.reset(seed=seed + 1)
            assert envs.env_rng_states(vector_env)[1] == env.unwrapped.np_random.bit_generator.state
    finally:
        for vector_env in made[True]:
            vector_env.close()


class InfoEnv(gym.Env):
    """Env i gives info keys that depend on i: some only on odd envs, an object array, a nested dict."""

    observation_space, action_space = gym.spaces.Box(-1, 1, (2,)), gym.spaces.Box(-1, 1, (1,))

    def __init__(self, i):
        self.i = i

    def info(self):
        if self.i % 2:
            return {"odd": self.i, "label": f"env {self.i}"}
        return {"all": 1.5 * self.i, "nested": {"v": np.arange(2) + self.i}}

    def reset(self, *, seed=None, options=None):
        return np.full(2, self.i, np.float32), self.info()

    def step(self, action):
        return np.full(2, self.i, np.float32), 0.0, False, False, self.info()


def test_infos_of_slices_concatenate_into_those_of_one_sync_vector_env():
    """Slices [env 0] and [envs 1, 2]: "odd" and "label" only in the second, "nested" only in env 0 and 2."""
    env_fns = [functools.partial(InfoEnv, i) for i in range(3)]
    slices = [serial(env_fns[:1]).reset()[1], serial(env_fns[1:]).reset()[1]]
    expected = serial(env_fns).reset()[1]
    assert_equal(envs._concatenate(slices, [1, 2]), expected)
    assert list(expected["label"]) == [None, "env 1", None] and list(expected["_odd"]) == [False, True, False]


def test_workers_never_outnumber_the_envs_ignore_ctrl_c_and_report_their_death():
    before = len(worker_processes())
    assert envs.ParallelVectorEnv([ANT], num_workers=4).num_workers == 0  # one env: stepped here
    parallel = envs.ParallelVectorEnv([ANT] * 2, num_workers=4)
    assert parallel.num_workers == 1 and len(worker_processes()) == before + 1
    parallel.run_dir = "runs/x"
    parallel.reset(seed=0)
    os.kill(parallel._processes[0].pid, signal.SIGINT)  # the parent's to handle, not the worker's
    assert parallel.step(np.zeros((2, 8), np.float32))[0].shape == (2, 29)
    os.kill(parallel._processes[0].pid, signal.SIGKILL)
    with pytest.raises(envs.WorkerDied, match=r"^the env worker process of envs 1-1 \(pid \d+\) died \(killed by "
                                              r"SIGKILL: out of memory, a crash or a kill\)$") as died:
        parallel.step(np.zeros((2, 8), np.float32))
    assert died.value.run_dir == "runs/x"
    parallel.close()
    parallel.close()
    assert parallel.closed and len(worker_processes()) == before


def test_a_worker_imports_neither_torch_nor_the_main_script(tmp_path):
    """Run from a main script that imports torch: its worker's memory maps no torch library, and the script is not
    run again in the worker (spawn would import it as __mp_main__)."""
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent(f"""
        import functools, pathlib, sys
        import torch
        sys.path.insert(0, {os.getcwd()!r})
        import envs
        if __name__ != "__main__":
            pathlib.Path({str(tmp_path / "imported")!r}).write_text(__name__)
        if __name__ == "__main__":
            vector = envs.ParallelVectorEnv([functools.partial(envs.make_env, "Ant")] * 2, num_workers=1)
            vector.reset(seed=0)
            maps = open(f"/proc/{{vector._processes[0].pid}}/maps").read()
            print("torch" in maps, "libmujoco" in maps)
            vector.close()
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]  # mujoco loaded, torch not
    assert not (tmp_path / "imported").exists()


def test_ctrl_c_during_a_call_closes_the_workers_at_once():
    """A KeyboardInterrupt while the parent waits for answers: the workers stop, even one blocked sending answers
    that no one reads (6 frames of 128×128 pixels, more than a pipe holds), and the env says it is closed."""
    before = len(worker_processes())
    parallel = envs.ParallelVectorEnv([functools.partial(envs.make_env, "Ant", "rgb_array")] * 6, num_workers=1)
    assert parallel._slices == [(0, 3), (3, 6)]
    parallel.reset(seed=0)

    def interrupted():
        time.sleep(0.5)  # the worker has drawn the frames and waits to send them
        raise KeyboardInterrupt

    parallel._pipes[0].recv = interrupted
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        parallel.render()
    assert time.perf_counter() - start < 5 and parallel.closed and len(worker_processes()) == before
    with pytest.raises(RuntimeError, match="this ParallelVectorEnv is closed"):
        parallel.step(np.zeros((6, 8)))


def test_an_env_that_cannot_be_built_raises_its_error_in_the_parent():
    before = len(worker_processes())
    with pytest.raises(ValueError, match="^unknown env 'Nowhere'; choose one of Ant, "):
        envs.ParallelVectorEnv([functools.partial(envs.make_env, "Nowhere")] * 2)
    assert len(worker_processes()) == before  # the workers are gone
    with pytest.raises(ValueError, match="^a ParallelVectorEnv needs envs, got none$"):
        envs.ParallelVectorEnv([])
