"""Every world and downstream task of envs.py as gymnasium sees it: registered ids, gymnasium's own env checker,
vector envs in worker processes, bad actions, render contexts and a clean exit.

    python -m pytest -q tests/test_gymnasium.py     # ~1 minute on 2 CPU cores
"""

import os
import subprocess
import sys
import warnings

import envs  # first: it picks MuJoCo's GL backend before mujoco is imported (tests/conftest.py does too)
import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = [*envs.ENV_SPECS, *envs.TASKS]
HORIZONS = {**{w: s.horizon for w, s in envs.ENV_SPECS.items()}, **{t: 200 for t in envs.TASKS}}
# check_env warns that an unbounded Box is "probably too low/high"; the state worlds' normalized observations (and
# the raw goals) are unbounded, as in gymnasium's own MuJoCo envs, which get the same two warnings
UNBOUNDED = ("A Box observation space minimum value is -infinity", "A Box observation space maximum value is infinity")


@pytest.mark.parametrize("name", NAMES)
def test_registered_under_the_cleanmisl_namespace(name):
    env = gym.make(f"cleanmisl/{name}-v0")
    assert env.spec.id == f"cleanmisl/{name}-v0" and env.spec.namespace == "cleanmisl"
    assert env.spec.max_episode_steps == HORIZONS[name]
    maker = envs.make_env if name in envs.ENV_SPECS else envs.make_task
    assert maker(name).spec.id == env.spec.id
    assert env.observation_space == maker(name).observation_space and env.action_space == maker(name).action_space


def test_gym_make_imports_the_module_itself():
    code = ("import gymnasium as gym; env = gym.make('envs:cleanmisl/Ant-v0'); "
            "print(env.spec.id, env.reset(seed=0)[0].shape)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 0 and result.stdout.split() == ["cleanmisl/Ant-v0", "(29,)"], result.stderr


@pytest.mark.parametrize("name", NAMES)
def test_gymnasium_check_env_passes_with_no_warning(name):
    env = gym.make(f"cleanmisl/{name}-v0", render_mode="rgb_array")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)  # with a spec: its strict checks, the render modes re-made from it included
    messages = [str(w.message) for w in caught]
    assert [m for m in messages if not any(allowed in m for allowed in UNBOUNDED)] == []
    env.close()


VECTOR_SCRIPT = """
import functools, sys
import gymnasium as gym, numpy as np
import envs
if __name__ == "__main__":
    make = functools.partial(envs.make_env, "Quadruped")
    if sys.argv[2] == "render first":
        envs.make_env("Quadruped").reset(seed=0)
    vector = gym.vector.AsyncVectorEnv([make] * 2, context=sys.argv[1])
    actions = np.random.default_rng(0).uniform(-1, 1, (2, 12))
    frames = [vector.reset(seed=0)[0], vector.step(actions)[0]]
    vector.close()
    local = gym.vector.SyncVectorEnv([make] * 2)  # the same envs in this process, after the workers
    expected = [local.reset(seed=0)[0], local.step(actions)[0]]
    print(frames[0].shape, all(np.array_equal(a, b) for a, b in zip(frames, expected)))
"""


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_async_vector_env_runs_a_pixel_world_in_worker_processes(context):
    """The render context is made at the first frame, in the worker: gymnasium's AsyncVectorEnv builds one env
    in the parent first, and a context made there hung forked workers. Run in a fresh interpreter, since a
    process that has rendered cannot fork renderers (next test)."""
    result = subprocess.run([sys.executable, "-c", VECTOR_SCRIPT, context, "-"], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 0 and result.stdout == "(2, 64, 64, 9) True\n", result.stderr


def test_forking_after_rendering_fails_with_one_line_instead_of_hanging():
    result = subprocess.run([sys.executable, "-c", VECTOR_SCRIPT, "fork", "render first"], cwd=REPO,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode != 0
    assert "RenderUnavailable: cannot render in a process forked from one that has rendered" in result.stderr


@pytest.mark.parametrize("name", NAMES)
def test_bad_actions_raise_and_change_nothing(name):
    env = gym.make(f"cleanmisl/{name}-v0")
    env.reset(seed=0)
    world = env.unwrapped.world if isinstance(env.unwrapped, envs.GoalTask) else env.unwrapped
    qpos = world.data.qpos.copy()
    n = env.action_space.shape[0]
    for action, error in [(np.full(n, np.nan), "finite"), (np.r_[np.zeros(n - 1), np.inf], "finite"),
                          (0.5, "Action dimension mismatch"), (np.zeros((1, n)), "Action dimension mismatch"),
                          (np.zeros(n + 1), "Action dimension mismatch")]:
        with pytest.raises(ValueError, match=error):
            env.step(action)
        assert np.array_equal(world.data.qpos, qpos)
    env.step(np.zeros(n))  # a good action still steps


def test_one_render_context_per_world_whatever_the_envs_and_sizes():
    """Kitchen's 64×64 observations and 128×128 videos of any number of envs draw with one render context
    (each holds a copy of the scene's 200 MB of textures); another world gets its own."""
    before = len(envs._LIVE_RENDERERS)
    kitchens = [envs.make_env("Kitchen", "rgb_array") for _ in range(3)]
    assert len(envs._LIVE_RENDERERS) == before  # none made before the first frame
    for env in kitchens:
        env.reset(seed=0)
        assert env.render().shape == (128, 128, 3)
    assert len(envs._LIVE_RENDERERS) == before + 1
    robobin = envs.make_env("Robobin")
    robobin.reset(seed=0)
    assert len(envs._LIVE_RENDERERS) == before + 2
    for env in [*kitchens, robobin]:
        env.close()
    assert len(envs._LIVE_RENDERERS) == before  # the last env of a world frees its context


@pytest.mark.parametrize("backend", ["osmesa", "egl"])
def test_a_pixel_run_exits_cleanly(backend):
    """No "Exception ignored ... EGLError" at exit: the render contexts are freed before EGL's own exit handler
    terminates its display (this script printed one under EGL before)."""
    script = (
        "import envs, gymnasium as gym, numpy as np\n"
        "try:\n"
        "    vector = gym.vector.SyncVectorEnv([lambda: envs.make_env('Quadruped', 'rgb_array') for _ in range(2)])\n"
        "    vector.reset(seed=0)\n"
        "except envs.RenderUnavailable as err:\n"
        "    print('UNAVAILABLE', err); raise SystemExit\n"
        "vector.envs[0].render()\n"
        "for _ in range(3):\n"
        "    vector.step(np.zeros((2, 12)))\n"
        "print('OK')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "MUJOCO_GL": backend, "PYTHONPATH": REPO})
    if result.stdout.startswith("UNAVAILABLE"):
        pytest.skip(f"no {backend} context on this machine: {result.stdout.strip()}")
    assert result.returncode == 0 and result.stdout == "OK\n" and result.stderr == "", result.stderr


SPAWN_BY_ID = """
import gymnasium as gym, sys
sys.path.insert(0, {root!r})
import envs  # registers the worlds here; the spawned workers import nothing
made = {{"plain id, make_vec": lambda: gym.make_vec("cleanmisl/Ant-v0", 2, vectorization_mode="async",
                                                     vector_kwargs={{"context": "spawn"}}),
        "envs: id, AsyncVectorEnv": lambda: gym.vector.AsyncVectorEnv([lambda: gym.make("envs:cleanmisl/Ant-v0")] * 2,
                                                                       context="spawn"),
        "plain id, AsyncVectorEnv": lambda: gym.vector.AsyncVectorEnv([lambda: gym.make("cleanmisl/Ant-v0")] * 2,
                                                                       context="spawn")}}
for name, make in made.items():
    try:
        vector = make()
        print(name, "ok", vector.reset(seed=0)[0].shape)
        vector.close()
    except Exception as e:
        print(name, "fails", type(e).__name__)
"""


def test_spawned_workers_find_the_worlds_by_the_ids_docs_envs_md_gives():
    """docs/envs.md: in a spawned worker, which has not imported envs.py, `envs:cleanmisl/<name>-v0` works, and so
    does the plain id through gym.make_vec (its workers get the registration); the plain id inside a function of
    your own does not. Run from `python -c`, whose main module a spawned worker cannot import."""
    proc = subprocess.run([sys.executable, "-c", SPAWN_BY_ID.format(root=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))], capture_output=True, text=True,
                          timeout=300, cwd="/")
    lines = [line for line in proc.stdout.splitlines() if " ok " in line or " fails " in line]
    assert lines[:2] == ["plain id, make_vec ok (2, 29)", "envs: id, AsyncVectorEnv ok (2, 29)"], proc.stdout
    assert len(lines) == 3 and lines[2].startswith("plain id, AsyncVectorEnv fails"), proc.stdout + proc.stderr
