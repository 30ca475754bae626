"""What a user or a disk does to a run, in every agent and hierarchical.py: sizes beyond memory are refused before
anything is allocated, with what they need; a full disk and a read-only folder end a run with one line, every file
whole (eval.jsonl, plots, checkpoint) and no temporary behind; TensorBoard's writer on a full disk, too."""

import glob
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import AGENTS, FIVE_EPOCHS, TINY, fill_disk, name, read_evals, run_agent, small_disk

import csf
import hierarchical

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUGE = str(10**12)
# what a size needs at the least, as the scripts say it: "this run needs at least N GiB of host memory: ..."
PARTS = {"buffer-size": "buffer (--buffer-size)", "batch-size": "one batch (--batch-size)",
         "hidden-dim": "the networks (--hidden-dim)"}
HIERARCHICAL_TINY = ("--num-envs", "2", "--batch-size", "8", "--hidden-dim", "16", "--num-eval-episodes", "2",
                     "--eval-every", "1", "--no-cuda")


def needs(message):
    """The GiB each part of a refusal names, by part."""
    parts = message.split(" memory: ")[1].split("; ")[0]
    return {part.rsplit(" ", 1)[0]: float(part.rsplit(" ", 1)[1].replace(",", "")) for part in parts.split(", ")}


@pytest.mark.parametrize("agent", AGENTS, ids=name)
@pytest.mark.parametrize("flag", PARTS)
def test_a_size_beyond_memory_is_refused_before_allocation_with_what_it_needs(agent, flag, tmp_path):
    with pytest.raises(SystemExit) as stop:
        run_agent(agent, tmp_path, *TINY, "--total-env-steps", "800", f"--{flag}", HUGE)
    message = str(stop.value.code)
    assert message.startswith(f"{name(agent)}.py: error: this run needs at least ")
    assert message.endswith(" GiB is free") and " of host memory: " in message
    parts = needs(message)
    biggest = max(parts, key=parts.get)
    assert biggest.endswith(PARTS[flag])  # the flag that does not fit is named, with its size
    assert parts[biggest] > 1000  # 10^12 of anything is terabytes
    assert not glob.glob(str(tmp_path / "runs" / "*" / "checkpoint.pt"))


def test_the_buffer_size_a_refusal_names_is_what_the_buffer_takes(tmp_path):
    """Ant's 1M default: 5,000 trajectories of 201 observations (29 floats) and 200 actions (8 floats), skill 2."""
    with pytest.raises(SystemExit) as stop:
        run_agent(csf, tmp_path, *TINY, "--total-env-steps", "800", "--buffer-size", str(10**12))
    trajectories = 10**12 // 200
    expected = trajectories * (201 * 29 * 4 + 4 * (200 * 8 + 2)) / 2**30
    assert needs(str(stop.value.code))["the replay buffer (--buffer-size)"] == pytest.approx(expected, abs=0.1)


@pytest.mark.parametrize("flag", PARTS)
def test_hierarchical_refuses_a_size_beyond_memory(flag, tiny_run, tmp_path):
    child_dir, _ = tiny_run(csf, *FIVE_EPOCHS)
    with pytest.raises(SystemExit) as stop:
        run_agent(hierarchical, tmp_path, "--checkpoint", child_dir, "--task", "AntMultiGoal", "--total-env-steps",
                  "1200", "--learning-starts", "16", *HIERARCHICAL_TINY, f"--{flag}", HUGE)
    message = str(stop.value.code)
    assert message.startswith("hierarchical.py: error: this run needs at least ")
    parts = needs(message)
    assert max(parts, key=parts.get).endswith(PARTS[flag].replace("buffer (", "episode buffer ("))


def run_script(script, cwd, *flags):
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *flags], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def assert_whole(run_dir):
    """Every file of a run is whole: eval.jsonl lines are evaluations, plots end with PNG's IEND chunk, and no
    temporary file is left."""
    assert not [f for f in os.listdir(run_dir) if ".tmp" in f]
    if os.path.isfile(os.path.join(run_dir, "eval.jsonl")):
        assert all("epoch" in line for line in read_evals(run_dir))
    for png in glob.glob(os.path.join(run_dir, "*.png")):
        with open(png, "rb") as f:
            assert f.read()[-8:-4] == b"IEND", png


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_a_full_disk_ends_the_run_with_one_line_and_whole_files(agent, tmp_path):
    with small_disk(tmp_path / "disk", 2) as disk:
        fill_disk(disk, leave=60_000)  # room for the first evaluation's plot and line, not for the next plot
        proc = run_script(f"{name(agent)}.py", disk, *TINY, "--total-env-steps", "2000", "--eval-every", "1")
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"{name(agent)}.py: error: cannot write runs/")
        assert "(No space left on device)" in proc.stderr or "(the write was cut short: is the disk full?)" in proc.stderr
        (run_dir,) = glob.glob(str(disk / "runs" / "*"))
        assert_whole(run_dir)


@pytest.mark.parametrize("agent", AGENTS, ids=name)
def test_resuming_in_a_read_only_folder_is_one_line_and_changes_nothing(agent, tiny_run, tmp_path):
    run_dir, _ = tiny_run(agent, *FIVE_EPOCHS)
    with small_disk(tmp_path / "disk", 16) as disk:
        copy = disk / "run"
        shutil.copytree(run_dir, copy)
        before = {f: (copy / f).read_bytes() for f in os.listdir(copy)}
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        proc = run_script(f"{name(agent)}.py", tmp_path, "--resume", str(copy / "checkpoint.pt"),
                          "--total-env-steps", "4000")
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"{name(agent)}.py: error: cannot write {copy}")
        assert proc.stderr.endswith("(Read-only file system)\n")
        assert {f: (copy / f).read_bytes() for f in os.listdir(copy)} == before


def test_a_new_run_in_a_read_only_folder_is_one_line(tmp_path):
    with small_disk(tmp_path / "disk", 1) as disk:
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        proc = run_script("csf.py", disk, *FIVE_EPOCHS)
    assert proc.returncode == 1 and proc.stderr == "csf.py: error: cannot write runs (Read-only file system)\n"


def test_tensorboard_on_a_full_disk_ends_the_run_with_one_line(tmp_path):
    """TensorBoard writes its events from a thread: when the disk fills between two evaluations, the run ends at
    its next scalar with one line, and the thread prints no traceback of its own."""
    with small_disk(tmp_path / "disk", 2) as disk:
        process = subprocess.Popen([sys.executable, os.path.join(ROOT, "csf.py"), *TINY, "--total-env-steps", "40000",
                                    "--eval-every", "1000"], cwd=disk, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while not glob.glob(str(disk / "runs" / "*" / "eval.jsonl")) and time.time() < deadline:
            time.sleep(0.1)
        fill_disk(disk)  # after the first evaluation, no evaluation or checkpoint before the 100th epoch
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 1
        assert stderr == "csf.py: error: cannot write the TensorBoard log (No space left on device)\n"
        (run_dir,) = glob.glob(str(disk / "runs" / "*"))
        assert [line["epoch"] for line in read_evals(run_dir)] == [0]


def test_hierarchical_on_a_full_disk_is_one_line_with_whole_files(tiny_run, tmp_path):
    child_dir, _ = tiny_run(csf, *FIVE_EPOCHS)
    with small_disk(tmp_path / "disk", 2) as disk:
        fill_disk(disk, leave=60_000)
        proc = run_script("hierarchical.py", disk, "--checkpoint", child_dir, "--task", "AntMultiGoal",
                          "--total-env-steps", "4000", "--learning-starts", "16", "--grad-steps-per-epoch", "2",
                          *HIERARCHICAL_TINY)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("hierarchical.py: error: cannot write runs/")
        (run_dir,) = glob.glob(str(disk / "runs" / "*"))
        assert_whole(run_dir)
