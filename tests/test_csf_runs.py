"""csf.py end to end, with tiny sizes: smoke run, determinism, checkpoint and resume, NaN stop, bad input."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 2 trajectories of 200 steps per epoch; the first gradient step comes after epoch 2 (800 transitions)
TINY = ["--num-envs", "2", "--learning-starts", "800", "--grad-steps-per-epoch", "3", "--batch-size", "16",
        "--hidden-dim", "16", "--num-negatives", "8", "--buffer-size", "4000", "--no-cuda"]
TIMING_KEYS = {"wall_time", "sps", "ms_per_grad_step", "peak_rss_mb"}


def run_csf(cwd, *flags, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "csf.py"), *flags], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def run_dir(cwd):
    (path,) = glob.glob(os.path.join(cwd, "runs", "*"))
    return path


def evals(cwd):
    with open(os.path.join(run_dir(cwd), "eval.jsonl")) as f:
        return [json.loads(line) for line in f]


def without_timing(lines):
    return [{k: v for k, v in line.items() if k not in TIMING_KEYS} for line in lines]


@pytest.fixture(scope="module")
def five_epochs(tmp_path_factory):
    """One uninterrupted run of 5 epochs, evaluating every 2 epochs (and at the end)."""
    cwd = tmp_path_factory.mktemp("five")
    run_csf(cwd, "--total-env-steps", "2000", "--eval-every", "2", *TINY)
    return cwd


def test_smoke_run_crosses_updates_evaluations_and_checkpoints(five_epochs):
    lines = evals(five_epochs)
    assert [line["epoch"] for line in lines] == [0, 2, 4, 5]
    assert [line["env_steps"] for line in lines] == [0, 800, 1600, 2000]
    assert [line["grad_steps"] for line in lines] == [0, 3, 9, 12]  # updates start once 800 transitions are stored
    last = lines[-1]
    for key in ("phi_loss", "psi_loss", "actor_loss", "alpha_loss", "logsumexp", "alpha", "dphi_sq", "sps",
                "ms_per_grad_step", "peak_rss_mb"):
        assert key in last and last[key] == last[key], key  # present and not NaN
    assert 3 <= last["coverage"] <= 48 * 201
    assert abs(last["logsumexp"] - torch.log(torch.tensor(8.0)).item()) < 1.0  # log M with M = 8 negatives, Δφ small
    files = os.listdir(run_dir(five_epochs))
    assert "checkpoint.pt" in files and "skills_0000002000.png" in files
    assert any(f.startswith("events.out.tfevents") for f in files)
    ckpt = torch.load(os.path.join(run_dir(five_epochs), "checkpoint.pt"), weights_only=False)
    assert ckpt["agent"] == "csf" and ckpt["epoch"] == 5 and ckpt["grad_steps"] == 12
    assert ckpt["buffer"]["num_stored"] == 10 and ckpt["args"]["env_id"] == "Ant"  # 10 trajectories of 200 steps


def test_same_seed_same_numbers(five_epochs, tmp_path):
    run_csf(tmp_path, "--total-env-steps", "2000", "--eval-every", "2", *TINY)
    assert without_timing(evals(tmp_path)) == without_timing(evals(five_epochs))


def test_resume_continues_exactly_like_an_uninterrupted_run(five_epochs, tmp_path):
    run_csf(tmp_path, "--total-env-steps", "800", "--eval-every", "2", *TINY)  # stops (and checkpoints) at epoch 2
    checkpoint = os.path.join(run_dir(tmp_path), "checkpoint.pt")
    ckpt = torch.load(checkpoint, weights_only=False)
    assert ckpt["epoch"] == 2 and ckpt["grad_steps"] == 3 and ckpt["buffer"]["num_stored"] == 4
    proc = run_csf(tmp_path, "--total-env-steps", "2000", "--eval-every", "2", "--resume", checkpoint, *TINY)
    assert "resumed" in proc.stdout
    resumed = without_timing(evals(tmp_path))
    assert [line["epoch"] for line in resumed] == [0, 2, 4, 5]  # epoch 2 is not evaluated twice
    uninterrupted = without_timing(evals(five_epochs))
    assert resumed[-2:] == uninterrupted[-2:]  # epochs 4 and 5: identical losses, coverage and E‖Δφ‖²


def test_nan_loss_stops_with_one_line_and_keeps_the_last_checkpoint(tmp_path):
    proc = run_csf(tmp_path, "--total-env-steps", "2000", "--checkpoint-every", "1", "--eval-every", "10",
                   "--xi", "nan", *TINY, check=False)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "phi_loss is nan at gradient step 1" in line
    ckpt = torch.load(os.path.join(run_dir(tmp_path), "checkpoint.pt"), weights_only=False)
    assert ckpt["epoch"] == 1 and ckpt["grad_steps"] == 0  # written before the bad update, untouched after it
    assert all(torch.isfinite(p).all() for p in ckpt["phi"].values())


@pytest.mark.parametrize("flags, message", [
    (["--env-id", "Hopper"], "unknown --env-id 'Hopper'"),
    (["--skill-dim", "0"], "--skill-dim must be positive"),
    (["--resume", "no/such/file.pt"], "no checkpoint file at no/such/file.pt"),
])
def test_bad_input_is_one_line_without_traceback(tmp_path, flags, message):
    proc = run_csf(tmp_path, *flags, check=False)
    assert proc.returncode != 0
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"csf.py: error: {message}")


def test_resume_rejects_a_checkpoint_of_another_agent_or_env(five_epochs, tmp_path):
    other = tmp_path / "metra.pt"
    torch.save({"agent": "metra", "args": {"env_id": "Ant"}}, other)
    proc = run_csf(tmp_path, "--resume", str(other), check=False)
    assert proc.returncode != 0 and proc.stderr.strip() == f"csf.py: error: {other} is a metra checkpoint, not a csf one"
    checkpoint = os.path.join(run_dir(five_epochs), "checkpoint.pt")
    proc = run_csf(tmp_path, "--env-id", "HalfCheetah", "--resume", checkpoint, *TINY, check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip() == f"csf.py: error: {checkpoint} was trained with --env-id Ant, not HalfCheetah"
    not_a_checkpoint = tmp_path / "notes.txt"
    not_a_checkpoint.write_text("hello")
    proc = run_csf(tmp_path, "--resume", str(not_a_checkpoint), check=False)
    assert proc.returncode != 0 and "is not a readable checkpoint" in proc.stderr and "Traceback" not in proc.stderr


def test_pixel_smoke_run_crosses_an_update_and_an_evaluation(tmp_path):
    # 1 epoch of 2 trajectories: evaluation at epoch 0, 2 gradient steps on stacked frames, the final evaluation
    proc = run_csf(tmp_path, "--env-id", "Quadruped", "--total-env-steps", "400", "--learning-starts", "400",
                   "--num-envs", "2", "--grad-steps-per-epoch", "2", "--batch-size", "4", "--hidden-dim", "16",
                   "--buffer-size", "400", "--no-cuda")
    assert "done" in proc.stdout
    first, last = evals(tmp_path)
    assert (first["grad_steps"], last["grad_steps"]) == (0, 2) and last["env_steps"] == 400
    assert last["coverage"] >= 1 and last["dphi_sq"] == last["dphi_sq"] and last["psi_loss"] == last["psi_loss"]
    ckpt = torch.load(os.path.join(run_dir(tmp_path), "checkpoint.pt"), weights_only=False)
    assert ckpt["buffer"]["frames"].shape == (2, 201, 64, 64, 3)  # one uint8 frame per step, stacks rebuilt
    assert any(k.startswith("encoder.") for k in ckpt["phi"]) and any(k.startswith("encoder.") for k in ckpt["actor"])


def test_pixel_env_without_opengl_is_one_line_naming_the_package(tmp_path):
    # hide libOSMesa from this process, as on a machine without the system package
    script = ("import ctypes.util, runpy, sys\n"
              "find = ctypes.util.find_library\n"
              "ctypes.util.find_library = lambda name: None if name == 'OSMesa' else find(name)\n"
              f"sys.argv = ['csf.py', '--env-id', 'Humanoid', '--no-cuda']\n"
              f"runpy.run_path({os.path.join(ROOT, 'csf.py')!r}, run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MUJOCO_GL": "osmesa", "PYTHONPATH": ROOT})
    assert proc.returncode != 0
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("csf.py: error: cannot render") and "libosmesa6" in line
