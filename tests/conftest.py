# envs.py picks MuJoCo's OpenGL backend (MUJOCO_GL), which mujoco fixes when it is first imported: import
# envs before any test module can import mujoco, so the pixel worlds can render whatever runs first.
import envs  # noqa: F401, I001

import contextlib
import glob
import io
import json
import os
import subprocess

import numpy as np
import pytest
import torch

import cic
import csf
import dads
import diayn
import metra
import visr

AGENTS = [csf, metra, diayn, visr, cic, dads]
# 2 trajectories of 200 steps per epoch; 3 gradient steps in every epoch from epoch 1 on (800 transitions stored)
TINY = ("--num-envs", "2", "--learning-starts", "800", "--grad-steps-per-epoch", "3", "--batch-size", "16",
        "--hidden-dim", "16", "--buffer-size", "4000", "--num-eval-skills", "4", "--no-cuda")
# 5 epochs, evaluated at 0, 2, 4 and the last (5), a checkpoint at epoch 3 (between two evaluations) and 5
FIVE_EPOCHS = ("--total-env-steps", "2000", "--eval-every", "2", "--checkpoint-every", "3", *TINY)

TIMING = {"wall_time", "sps", "ms_per_grad_step", "peak_rss_mb"}  # eval.jsonl keys that depend on the clock
# checkpoint keys that may differ between two runs of the same numbers: the clock (in the evaluations it holds too),
# the run's start time in its name, and the path it was resumed from
NOT_NUMBERS = {*TIMING, "timing", "run_name", "resume"}


def name(agent):
    return agent.__name__


def run_agent(agent, cwd, *flags):
    """Run an agent module in this process as `python agent.py *flags` would in `cwd`; return its run directory.
    Its envs step in this process (--no-parallel-envs, the same numbers) unless the flags say otherwise: worker
    processes take seconds to start on 2 cores, and tests/test_parallel_envs.py checks them."""
    old = os.getcwd()
    os.chdir(cwd)
    if not any("parallel-envs" in flag for flag in flags):
        flags = (*flags, "--no-parallel-envs")
    try:
        agent.main(*agent.parse_args(list(flags)))
    finally:
        os.chdir(old)
    (run_dir,) = glob.glob(os.path.join(cwd, "runs", "*"))
    return run_dir


def read_evals(run_dir):
    with open(os.path.join(run_dir, "eval.jsonl")) as f:
        return [json.loads(line) for line in f]


def without_timing(lines):
    return [{k: v for k, v in line.items() if k not in TIMING} for line in lines]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_same_state(a, b, where="checkpoint"):
    """Two checkpoints (or parts of them) hold the same numbers: every tensor, array and value, recursively."""
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            if key not in NOT_NUMBERS:
                assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, (where, a, b)


@contextlib.contextmanager
def checkpoint_copies():
    """While active, keep the bytes of every checkpoint.pt written (the agents write it with os.replace), by epoch."""
    copies, replace = {}, os.replace

    def replace_and_copy(src, dst):
        replace(src, dst)
        if os.path.basename(dst) == "checkpoint.pt":
            with open(dst, "rb") as f:
                data = f.read()
            copies[torch.load(io.BytesIO(data), weights_only=False)["epoch"]] = data

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "replace", replace_and_copy)
        yield copies


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """tiny_run(agent, *flags) -> (run directory, {epoch: checkpoint bytes}): one in-process run per agent and
    flags, made once per test session and read by every test that asks for it."""
    cache = {}

    def run(agent, *flags):
        key = (agent.__name__, flags)
        if key not in cache:
            cwd = tmp_path_factory.mktemp(agent.__name__)
            with checkpoint_copies() as copies:
                cache[key] = run_agent(agent, cwd, *flags), copies
        return cache[key]

    return run


@contextlib.contextmanager
def small_disk(path, megabytes):
    """A tmpfs of `megabytes` mounted at `path` while the block runs; skips the test where none can be mounted."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'mount failed'})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill_disk(disk, leave=0):
    """Fill `disk` with disk/filler until about `leave` bytes are free (a tmpfs counts whole 4 KiB pages)."""
    with open(disk / "filler", "wb") as f:
        with contextlib.suppress(OSError):
            while (room := os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - leave) > 0:
                f.write(b"\0" * min(room, 65536))
                f.flush()
