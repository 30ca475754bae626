"""benchmarks/sweep.py: the report on hand-made runs, a local sweep that finishes and reports, a killed sweep that a
second run resumes, the SLURM parameters through submitit's debug executor, refused combinations; refused flags (one
line each), damaged files, agents left running, stale run folders, unwritable folders."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import submitit
from conftest import small_disk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# appended, after the root: benchmarks/goal_reaching.py and hierarchical.py must not hide the scripts
sys.path.append(os.path.join(ROOT, "benchmarks"))
import envs  # noqa: E402
import sweep  # noqa: E402

TINY = ["--num-envs", "2", "--learning-starts", "400", "--grad-steps-per-epoch", "2", "--batch-size", "16",
        "--hidden-dim", "16", "--num-eval-skills", "2", "--eval-every", "1", "--no-cuda"]


def write_run(folder, coverages, steps=(0, 800, 1600)):
    os.makedirs(os.path.join(folder, "runs", "r"))
    with open(os.path.join(folder, "runs", "r", "eval.jsonl"), "w") as f:
        for s, c in zip(steps, coverages):
            f.write(json.dumps({"env_steps": s, "coverage": c}) + "\n")


def test_report_of_hand_made_runs(tmp_path):
    lines = []
    for agent, seed, coverages in (("metra", 1, [5, 7, 9]), ("csf", 1, [4, 10, 30]), ("csf", 2, [4, 20, 50])):
        folder = f"{agent}_Ant_seed{seed}"
        write_run(tmp_path / folder, coverages)
        lines.append({"agent": agent, "env_id": "Ant", "seed": seed, "status": "done", "folder": folder,
                      "command": f"python {agent}.py --env-id Ant --seed {seed}"})
    goal = {"results": {"adaptive": {"mean": {"staying_time_3": 0.25, "final_distance": 12.0}}}}
    (tmp_path / "csf_Ant_seed1" / "runs" / "r" / "goal_reaching.json").write_text(json.dumps(goal))
    (tmp_path / "sweep.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    sweep.report(str(tmp_path))
    text = (tmp_path / "report.md").read_text()
    assert "| csf | Ant | 1, 2 | 1,600 | 40.0 (30–50) | 12 | 0.25 |" in text  # final distance, staying time
    assert "| metra | Ant | 1 | 1,600 | 9.0 (9–9) | – | – |" in text
    assert text.index("| metra |") < text.index("| csf |")  # rows in the order of sweep.jsonl, as the command listed them
    assert (tmp_path / "report.png").stat().st_size > 0
    steps, mean, low, high = sweep.curves([[{"env_steps": 0, "coverage": 4}, {"env_steps": 800, "coverage": 10}],
                                           [{"env_steps": 0, "coverage": 6}]])
    assert steps.tolist() == [0] and (mean[0], low[0], high[0]) == (5, 4, 6)  # only the steps every seed reached


def run_sweep(sweep_dir, *extra, **popen):
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "sweep.py"), "--sweep-dir", str(sweep_dir),
               "--progress-every", "1", *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def test_local_sweep_finishes_reports_and_skips_what_is_done(tmp_path):
    proc = run_sweep(tmp_path, "--agents", "csf", "metra", "--env-ids", "Ant", "--seeds", "1", "2", "--workers", "2",
                     "--", "--total-env-steps", "400", *TINY)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    states = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert [(s["agent"], s["seed"], s["status"]) for s in states] == [
        ("csf", 1, "done"), ("csf", 2, "done"), ("metra", 1, "done"), ("metra", 2, "done")]
    assert "| csf | Ant | 1, 2 | 400 |" in (tmp_path / "report.md").read_text()
    proc = run_sweep(tmp_path, "--agents", "csf", "metra", "--env-ids", "Ant", "--seeds", "1", "2", "--",
                     "--total-env-steps", "400", *TINY)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "4 runs, 4 already done" in out  # the same command again: nothing to run


def test_the_cores_are_divided_into_near_equal_groups():
    assert envs.divide_cores(range(16), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert envs.divide_cores([0, 1, 2], 2) == [[0, 1], [2]]
    assert envs.divide_cores(range(10), 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert envs.divide_cores([0, 1], 4) == [[0], [1], [0], [1]]  # fewer cores than runs: one each, round-robin
    assert envs.divide_cores([9, 4, 6], 1) == [[4, 6, 9]]  # the cores a taskset left, in any order


def env_workers(agent_pid):
    """The processes that multiprocessing spawned from the agent of `agent_pid`: its env workers."""
    workers = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as stat, open(f"/proc/{pid}/cmdline", "rb") as f:
            parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            if parent == agent_pid and b"spawn_main" in f.read():
                workers.append(int(pid))
    return workers


def test_runs_side_by_side_each_run_on_cores_of_their_own(tmp_path):
    """--workers 2, three runs: two at a time, each agent and its env workers pinned to a share of the cores that no
    other running run holds (one core each on two cores), as agent.pid and the start lines say; a run that ends
    frees its share for the third. No agent starts more env workers than its share (training and evaluation envs)."""
    shares = envs.divide_cores(envs.usable_cores(), 2)
    proc = run_sweep(tmp_path, "--agents", "csf", "--env-ids", "Ant", "--seeds", "1", "2", "3", "--workers", "2",
                     "--", "--total-env-steps", "800", *TINY)
    folders = [tmp_path / f"csf_Ant_seed{seed}" for seed in (1, 2, 3)]
    side_by_side, deadline = [], time.time() + 600
    while proc.poll() is None and time.time() < deadline:
        running = []
        for folder in folders:
            with contextlib.suppress(OSError, ValueError):  # no agent yet, or it ended
                record = json.loads((folder / "agent.pid").read_text())
                workers = env_workers(record["pid"])
                affinities = [sorted(os.sched_getaffinity(pid)) for pid in [record["pid"], *workers]]
                assert len(workers) <= 2 * len(record["cores"])
                running.append((record["cores"], affinities))
        assert len(running) <= 2
        for cores, affinities in running:
            assert all(affinity == cores for affinity in affinities)  # the agent and its workers on its share
        if len(running) == 2:
            side_by_side.append(sorted(cores for cores, _ in running))
        time.sleep(0.1)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert side_by_side and all(cores == sorted(shares) for cores in side_by_side)
    started = re.findall(r"^started csf_Ant_seed(\d) on cores ([\d,]+)$", out, re.MULTILINE)
    assert sorted(seed for seed, _ in started) == ["1", "2", "3"]
    assert all([int(core) for core in cores.split(",")] in shares for _, cores in started)


def agents_working_in(folder):
    """The pids of the agent processes whose working folder is `folder` (what `ps` would show)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if os.readlink(f"/proc/{pid}/cwd") == os.path.realpath(folder) and b"csf.py" in f.read():
                pids.append(int(pid))
    return pids


def test_a_killed_sweep_takes_its_agent_along_and_the_repeated_command_resumes(tmp_path):
    """SIGKILL of sweep.py alone (its submitit job processes survive it): the agent stops within seconds instead of
    running on beside the repeated sweep, which resumes from the checkpoint with one agent per run."""
    flags = ["--agents", "csf", "--env-ids", "Ant", "--seeds", "1", "--", "--total-env-steps", "2800",
             "--checkpoint-every", "1", *TINY]  # 7 epochs: the agent goes on for up to a second after the kill
    proc = run_sweep(tmp_path, *flags, start_new_session=True)
    folder = tmp_path / "csf_Ant_seed1"
    try:
        deadline = time.time() + 300
        while not list(folder.glob("runs/*/checkpoint.pt")) and time.time() < deadline:
            time.sleep(0.2)
        record = json.loads((folder / "agent.pid").read_text())
        assert sweep.alive(record["pid"], record["start"]) and record["driver_pid"] == proc.pid
        proc.kill()  # the driver only
        proc.wait()
        deadline = time.time() + 15
        while sweep.alive(record["pid"], record["start"]) and time.time() < deadline:
            time.sleep(0.2)
        assert not sweep.alive(record["pid"], record["start"])  # the agent did not outlive the sweep
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    (run_dir,) = folder.glob("runs/*")
    assert json.loads((run_dir / "eval.jsonl").read_text().splitlines()[-1])["epoch"] < 7
    proc, most_at_once = run_sweep(tmp_path, *flags), 0  # the same command again
    while proc.poll() is None:
        most_at_once = max(most_at_once, len(agents_working_in(folder)))
        time.sleep(0.1)
    out = proc.stdout.read()
    assert proc.returncode == 0, out
    assert most_at_once == 1  # never two agents writing one run
    assert "resumed" in (folder / "stdout.log").read_text()
    assert list(folder.glob("runs/*")) == [run_dir] and not (folder / "agent.pid").exists()
    epochs = [json.loads(line)["epoch"] for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert epochs[-1] == 7 and all(a < b for a, b in zip(epochs, epochs[1:]))  # no evaluation twice


def test_slurm_parameters_through_the_debug_executor(tmp_path):
    args = SimpleNamespace(partition="gpu", account="lab", qos="high", constraint="a100|h100", gpus_per_run=1,
                           sbatch=[("reservation", "maint"), ("exclusive", True)], time=90, mem=16, cpus_per_run=4)
    params = sweep.slurm_parameters(args)
    assert params == {"slurm_partition": "gpu", "slurm_account": "lab", "slurm_qos": "high",
                      "slurm_constraint": "a100|h100", "gpus_per_node": 1, "timeout_min": 90, "mem_gb": 16,
                      "cpus_per_task": 4, "nodes": 1, "tasks_per_node": 1, "slurm_signal_delay_s": 90,
                      "slurm_additional_parameters": {"reservation": "maint", "exclusive": True}}
    bare = sweep.slurm_parameters(SimpleNamespace(partition=None, account=None, qos=None, constraint=None,
                                                  gpus_per_run=0, sbatch=[], time=1, mem=1, cpus_per_run=1))
    assert bare == {"timeout_min": 1, "mem_gb": 1, "cpus_per_task": 1, "nodes": 1, "tasks_per_node": 1,
                    "slurm_signal_delay_s": 10}  # no GPU, nothing about GPUs; SIGUSR2 10 s ahead of a 1-minute limit
    executor = submitit.AutoExecutor(tmp_path, cluster="debug")
    executor.update_parameters(**params)  # every parameter is one submitit knows
    run = {"agent": "csf", "argv": ["--env-id", "Ant", "--total-env-steps", "400"], "folder": str(tmp_path / "run"),
           "final_env_steps": 400}
    write_run(tmp_path / "run", [2, 3], steps=(0, 400))  # its budget reached: the job starts no agent
    assert executor.submit(sweep.Job(), run, 1).result() == 0 and not (tmp_path / "run" / "stdout.log").exists()


def test_a_job_decides_at_its_start_and_a_failed_agent_gives_its_reason(tmp_path, capsys):
    """What a job runs is decided when it starts (here: the agent refuses a flag at once), and the line it writes to
    its .err log is what the sweep quotes; job_reason reads it from the job's latest start."""
    run = {"agent": "csf", "argv": ["--env-id", "Ant", "--hidden-dim", "0"], "folder": str(tmp_path),
           "final_env_steps": 400}
    with pytest.raises(sweep.RunFailed) as failed:
        sweep.Job()(run, 1)
    assert str(failed.value) == "csf.py: error: --hidden-dim must be in [1, inf), got 0"
    log = tmp_path / "stdout.log"
    assert capsys.readouterr().err == f"sweep.py job: {failed.value} (its output: {log})\n"
    err = tmp_path / "7_0_log.err"
    err.write_text("submitit INFO - Starting with JobEnvironment(job_id=7)\nsweep.py job: an old failure\n"
                   "submitit INFO - Starting with JobEnvironment(job_id=7)\nTraceback (most recent call last):\n"
                   "  ...\nsubmitit.core.utils.UncompletedJobError: Job not requeued because: timed-out.\n")
    assert sweep.job_reason(str(err)) == ("submitit.core.utils.UncompletedJobError: Job not requeued because: "
                                          "timed-out.")  # the latest start's error, not an earlier start's line
    assert sweep.failure(7, str(err), "ended FAILED").startswith("job 7 ended FAILED: submitit.core.utils.")
    assert sweep.job_reason(str(tmp_path / "none.err")) == "" and sweep.failure(8, "x.err") == "job 8 (see x.err)"


def test_a_job_warned_of_its_time_limit_stops_its_agent_and_requeues_itself_unless_it_is_stuck(tmp_path, capsys):
    """Job.checkpoint, as submitit calls it on SIGUSR2: the agent stops, and the job to requeue is a new Job; after
    MAX_STALLED starts in a row without a new checkpoint, none (the job fails instead of requeuing for ever)."""
    run = {"agent": "csf", "argv": [], "folder": str(tmp_path), "final_env_steps": 400}
    write_run(tmp_path, [2], steps=(0,))
    checkpoint = tmp_path / "runs" / "r" / "checkpoint.pt"
    checkpoint.write_bytes(b"epoch 1")
    job = sweep.Job()
    job.stamp = sweep.checkpoint_stamp(str(tmp_path))
    agent = sleeper(tmp_path)
    job.started(agent.pid, sweep.process_start(agent.pid))
    os.utime(checkpoint, ns=(1, 1))  # the agent wrote a new checkpoint in this job
    delayed = job.checkpoint(run, 1)
    assert agent.wait(timeout=15) == -signal.SIGTERM
    assert isinstance(delayed.function, sweep.Job) and delayed.function.stalled == 0
    assert delayed.args == (run, 1, None)
    for stalled in range(1, sweep.MAX_STALLED):  # no new checkpoint since the job started
        job = sweep.Job(stalled - 1)
        job.stamp = sweep.checkpoint_stamp(str(tmp_path))
        assert job.checkpoint(run, 1).function.stalled == stalled
    capsys.readouterr()
    job = sweep.Job(sweep.MAX_STALLED - 1)
    job.stamp = sweep.checkpoint_stamp(str(tmp_path))
    assert job.checkpoint(run, 1) is None
    assert capsys.readouterr().err.startswith(f"sweep.py job: {sweep.MAX_STALLED} jobs in a row stopped before")


def test_a_failed_local_run_points_at_the_log_that_holds_its_reason(tmp_path):
    """The agent fails after it started (a learning rate of 1e30 makes a loss NaN at the first gradient step): the
    run's line names the job's .err log."""
    proc = run_sweep(tmp_path, "--agents", "csf", "--env-ids", "Ant", "--seeds", "1", "--", "--total-env-steps", "400",
                     "--lr", "1e30", *TINY)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    (line,) = [line for line in out.splitlines() if line.startswith("failed:")]
    match = re.fullmatch(r"failed: csf_Ant_seed1: job (\d+): csf\.py: error: \w+_loss is -?(nan|inf) at gradient step "
                         r"1 \(epoch 0\).* \(its output: .*stdout\.log\) \(see (.*)\)", line)
    assert match and match[3] == str(tmp_path / "submitit" / f"{match[1]}_0_log.err"), line
    assert "sweep.py job: csf.py: error: " in open(match[3]).read()
    (state,) = [json.loads(text) for text in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert state["status"] == "failed" and line.endswith(state["reason"])


def test_the_report_marks_a_failed_or_unfinished_runs_steps_as_partial(tmp_path):
    lines = hand_made_sweep(tmp_path, seeds=(1, 2, 3))
    unfinished = [lines[0], lines[1].replace('"status": "done"', '"status": "failed"'),
                  lines[2].replace('"status": "done"', '"status": "running"')]
    (tmp_path / "sweep.jsonl").write_text("".join(unfinished))
    assert sweep.main(["--report", str(tmp_path)]) == 0
    assert ("| csf | Ant | 1, 2, 3 | 1,600 (partial: seed 2 failed, seed 3 running) | 20.0 (10–30) |"
            in (tmp_path / "report.md").read_text())
    (tmp_path / "sweep.jsonl").write_text("".join(lines))  # every seed done: the steps are final
    assert sweep.main(["--report", str(tmp_path)]) == 0
    assert "| csf | Ant | 1, 2, 3 | 1,600 | 20.0 (10–30) |" in (tmp_path / "report.md").read_text()


def test_refused_combinations_are_skipped_with_one_line(tmp_path, capsys):
    runs = sweep.plan(["csf", "metra"], ["Ant", "Hopper"], [1, 2], ["--hidden-dim", "16"], str(tmp_path))
    assert [(r["agent"], r["env_id"], r["seed"]) for r in runs] == [("csf", "Ant", 1), ("csf", "Ant", 2),
                                                                    ("metra", "Ant", 1), ("metra", "Ant", 2)]
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"skipped {a} on Hopper: {a}.py: error: --env-id must be one of "
                     + ", ".join(sweep.envs.ENV_SPECS) + ", got 'Hopper'" for a in ("csf", "metra")]
    assert runs[0]["final_env_steps"] == 64_000_000  # the paper's budget, from the agent's own defaults
    runs = sweep.plan(["dads"], ["HalfCheetah", "Quadruped"], [1], [], str(tmp_path))
    assert [r["env_id"] for r in runs] == ["HalfCheetah"]
    assert capsys.readouterr().out.strip() == ("skipped dads on Quadruped: dads.py: error: --env-id must be one of "
                                               "Ant, HalfCheetah, got 'Quadruped'")
    with pytest.raises(SystemExit):
        sweep.main(["--report", str(tmp_path)])  # not a sweep folder


def test_variants_are_runs_of_their_own_and_rows_of_their_own(tmp_path, capsys):
    runs = sweep.plan(["csf"], ["HalfCheetah"], [1], ["--hidden-dim", "16"], str(tmp_path),
                      ["--critic inner", "--critic mlp", "--critic nonsense"])
    assert [(os.path.basename(r["folder"]), r["argv"][4:6]) for r in runs] == [
        ("csf_critic-inner_HalfCheetah_seed1", ["--critic", "inner"]), ("csf_critic-mlp_HalfCheetah_seed1", ["--critic", "mlp"])]
    assert "skipped csf --critic nonsense on HalfCheetah: csf.py: error: --critic must be one of inner, mlp, gaussian, " \
        "laplacian, got 'nonsense'" in capsys.readouterr().out
    for run, coverage in zip(runs, (30, 3)):
        run["status"] = "done"
        write_run(run["folder"], [2, coverage], steps=(0, 1600))
    sweep.write_state(str(tmp_path), runs)
    sweep.report(str(tmp_path))
    text = (tmp_path / "report.md").read_text()
    assert "| csf --critic inner | HalfCheetah | 1 | 1,600 | 30.0 (30–30) |" in text
    assert "| csf --critic mlp | HalfCheetah | 1 | 1,600 | 3.0 (3–3) |" in text


def test_a_run_finished_in_a_sibling_sweep_is_linked_not_run_again(tmp_path):
    flags = ["--total-env-steps", "800", *TINY]  # HalfCheetah with 2 envs: 400 env steps per epoch, 2 epochs
    first = sweep.plan(["csf"], ["HalfCheetah"], [1], flags, str(tmp_path / "critic"), ["", "--critic mlp"])
    for run, coverage in zip(first, (30, 3)):
        run["status"] = "done"
        write_run(run["folder"], [2, coverage], steps=(0, 800))
    sweep.write_state(str(tmp_path / "critic"), first)
    proc = run_sweep(tmp_path / "xi", "--agents", "csf", "--env-ids", "HalfCheetah", "--seeds", "1",
                     "--variants", "--xi 5", "--xi 2", "--", *flags)  # ξ = 5 is the default: the first run again
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert "reused critic/csf_HalfCheetah_seed1 for `python csf.py --env-id HalfCheetah --seed 1 --xi 5 " in out
    assert "2 runs, 1 already done" in out
    assert os.path.islink(tmp_path / "xi" / "csf_xi-5_HalfCheetah_seed1")  # linked to the first sweep's run
    assert not os.path.islink(tmp_path / "xi" / "csf_xi-2_HalfCheetah_seed1")  # another experiment: run here
    assert not os.path.islink(tmp_path / "critic" / "csf_critic-mlp_HalfCheetah_seed1")
    text = (tmp_path / "xi" / "report.md").read_text()
    assert "| csf --xi 5 | HalfCheetah | 1 | 800 | 30.0 (30–30) |" in text
    assert "| csf --xi 2 | HalfCheetah | 1 | 800 |" in text


def test_two_commands_in_one_sweep_folder_keep_each_others_runs(tmp_path):
    three_million = sweep.plan(["csf"], ["Ant"], [1, 2], ["--total-env-steps", "3000000"], str(tmp_path))
    one_million = sweep.plan(["dads"], ["Ant"], [1], ["--total-env-steps", "1000000"], str(tmp_path))
    sweep.write_state(str(tmp_path), three_million)
    sweep.write_state(str(tmp_path), one_million)
    three_million[1]["status"] = "done"
    sweep.write_state(str(tmp_path), three_million)  # the first command again: its lines updated in their place
    states = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert [(s["agent"], s["seed"], s["status"]) for s in states] == [
        ("csf", 1, "pending"), ("csf", 2, "done"), ("dads", 1, "pending")]
    assert states[2]["command"] == "python dads.py --env-id Ant --seed 1 --total-env-steps 1000000"


def test_a_hierarchical_run_started_in_a_run_folder_is_reported_and_not_mistaken_for_the_agent(tmp_path):
    folder = tmp_path / "csf_Ant_seed1"
    write_run(folder, [4, 10, 30])
    (folder / "runs" / "r" / "checkpoint.pt").write_bytes(b"agent")
    high = folder / "runs" / "AntMultiGoal__hierarchical_csf__1__99"  # sorts before "r"
    high.mkdir()
    (high / "eval.jsonl").write_text(json.dumps({"env_steps": 50, "coverage": 0, "return_past10": 21.4}) + "\n")
    (high / "checkpoint.pt").write_bytes(b"high level")
    assert sweep.agent_run_file(str(folder), "eval.jsonl") == str(folder / "runs" / "r" / "eval.jsonl")
    assert [e["coverage"] for e in sweep.read_evals(str(folder))] == [4, 10, 30]
    run = {"agent": "csf", "argv": ["--env-id", "Ant"], "folder": str(folder)}
    assert sweep.command(run)[-2:] == ["--resume", str(folder / "runs" / "r" / "checkpoint.pt")]
    assert sweep.goal_and_hierarchical_results(str(folder)) == {"AntMultiGoal return (past 10)": 21.4}


# ---------------------------------------------------------------- refusals, damaged files, agents left running
def refusal(*argv):
    """sweep.main's refusal of argv, in this process: checked to be one `sweep.py: error: ...` line."""
    with pytest.raises(SystemExit) as stop:
        sweep.main(list(argv))
    message = stop.value.code
    assert isinstance(message, str) and message.startswith("sweep.py: error: ") and "\n" not in message, message
    return message


REFUSED = [
    (["--agents", "foo"], "argument --agents: invalid choice: 'foo' (choose from 'csf', 'metra', 'diayn', 'visr', "
                          "'cic', 'dads')"),
    (["--agents", "envs"], "invalid choice: 'envs'"),
    (["--agents", "../csf"], "invalid choice: '../csf'"),
    (["--agents", ""], "invalid choice: ''"),
    (["--agents", "csf.py"], "invalid choice: 'csf.py'"),
    (["--threads", "0"], "argument --threads: must be at least 1, got 0"),
    (["--threads", "-1"], "argument --threads: must be at least 1, got -1"),
    (["--time", "0"], "argument --time: must be at least 1, got 0"),
    (["--time", "-1"], "argument --time: must be at least 1, got -1"),
    (["--workers", "0"], "argument --workers: must be at least 1, got 0"),
    (["--gpus-per-run", "-1"], "argument --gpus-per-run: must be at least 0, got -1"),
    (["--cpus-per-run", "0"], "argument --cpus-per-run: must be at least 1, got 0"),
    (["--mem", "0"], "argument --mem: must be at least 1, got 0"),
    (["--mem", "lots"], "argument --mem: invalid int value: 'lots'"),
    (["--progress-every", "0"], "argument --progress-every: must be a positive number of seconds, got 0"),
    (["--progress-every", "-1"], "must be a positive number of seconds, got -1"),
    (["--progress-every", "nan"], "must be a positive number of seconds, got nan"),
    (["--seeds", "1", "1"], "--seeds lists 1 twice: its runs would share one folder"),
    (["--agents", "csf", "csf"], "--agents lists 'csf' twice"),
    (["--env-ids", "Ant", "Ant"], "--env-ids lists 'Ant' twice"),
    (["--variants", "--xi 5", "--xi 5"], "--variants lists '--xi 5' twice"),
    (["--variants", "--xi 5", "--xi  5"], "--variants '--xi 5' and '--xi  5' would share their run folders"),
    (["--variants", '--xi "5'], "--variants '--xi \"5' cannot be split into flags (No closing quotation)"),
    (["--env-ids", "Ant", "--variants", "--env-id HalfCheetah"], "--variants '--env-id HalfCheetah' sets --env-id, "
                                                                 "which the sweep sets itself"),
    (["--variants", "--hidden-dim 16 --seed=3"], "--variants '--hidden-dim 16 --seed=3' sets --seed"),
    (["--variants", "--resume runs/r/checkpoint.pt"], "sets --resume"),
    (["--seeds", "1", "2", "--", "--seed", "3"], "the flags after -- set --seed, which the sweep sets itself"),
    (["--", "--env_id", "HalfCheetah"], "the flags after -- set --env-id"),
    (["--sbatch", "job-name=mine"], "argument --sbatch: job-name is set by the sweep: each job is named after its "
                                    "run"),
    (["--sbatch", "time=10"], "argument --sbatch: time is set by the sweep: use --time"),
    (["--sbatch", "Reservation=x"], "argument --sbatch: 'Reservation=x' is not NAME=VALUE or NAME with a long sbatch "
                                    "option's name"),
    (["--sweep-dir", ""], "--sweep-dir must name a folder"),
    (["--agents", "dads", "--env-ids", "Quadruped"], "no run left to do: every combination was refused"),
    (["--report", ""], "'' is not a sweep folder (it has no sweep.jsonl)"),
]


@pytest.mark.parametrize("argv, reason", REFUSED, ids=[" ".join(argv) or "empty" for argv, _ in REFUSED])
def test_bad_flags_are_refused_with_one_line_before_anything_is_written(argv, reason, tmp_path, monkeypatch,
                                                                          capsys):
    monkeypatch.chdir(tmp_path)  # --sweep-dir '' must not write here either
    assert reason in refusal("--sweep-dir", str(tmp_path / "sweep"), *argv)
    assert os.listdir(tmp_path) == [] and capsys.readouterr().err == ""


@pytest.mark.parametrize("argv", [["--variants", '--xi "5'], ["--backend", "slurm"]])
def test_the_script_refuses_with_one_line_and_no_traceback(argv, tmp_path):
    """As a user runs it; PATH holds no sbatch, so that SLURM is refused up front instead of waiting forever."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sweep.py"), "--sweep-dir",
                           str(tmp_path / "sweep"), *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": str(tmp_path)})
    assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("sweep.py: error: ")
    if argv[0] == "--backend":
        assert line == "sweep.py: error: --backend slurm needs SLURM's sbatch, which is not on PATH here"


def test_a_sweep_dir_that_is_a_file_or_lies_under_one(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    sweep_flags = ["--agents", "csf", "--env-ids", "Ant", "--seeds", "1"]
    assert refusal("--sweep-dir", str(tmp_path / "file"), *sweep_flags) == (
        f"sweep.py: error: --sweep-dir {tmp_path / 'file'} is a file, not a folder")
    assert refusal("--sweep-dir", str(tmp_path / "file" / "sweep"), *sweep_flags) == (
        f"sweep.py: error: cannot make the folder {tmp_path / 'file' / 'sweep'} (Not a directory)")
    assert "is not a sweep folder" in refusal("--report", str(tmp_path / "file"))


def hand_made_sweep(folder, env_id="Ant", seeds=(1, 2)):
    """A finished sweep of csf on `env_id`, seed s reaching coverage 10·s at 1,600 env steps; its sweep.jsonl lines."""
    lines = []
    for seed in seeds:
        write_run(folder / f"csf_{env_id}_seed{seed}", [2, 5 * seed, 10 * seed])
        lines.append(json.dumps({"agent": "csf", "variant": "", "env_id": env_id, "seed": seed, "status": "done",
                                 "folder": f"csf_{env_id}_seed{seed}",
                                 "command": f"python csf.py --env-id {env_id} --seed {seed}"}) + "\n")
    (folder / "sweep.jsonl").write_text("".join(lines))
    return lines


TORN = '{"agent": "csf", "env_id": "Ant", "se'  # a line cut short by a crash: no closing brace, no newline
DAMAGED_SWEEP_FILES = {  # sweep.jsonl from its two good lines -> what --report says (None: the report is written)
    "torn last line": (lambda a, b: a + b + TORN, None),
    "blank lines": (lambda a, b: "\n" + a + "\n  \n" + b + "\n", None),
    "a bad line in the middle": (lambda a, b: a + "{not json\n" + b,
                                 "line 2 of {path} is not JSON; mend or delete the file"),
    "not JSON at all": (lambda a, b: "\0\xff\n" * 3, "line 1 of {path} is not JSON; mend or delete the file"),
    "a line without env_id": (lambda a, b: a.replace('"env_id": "Ant", ', "") + b,
                              "line 1 of {path} has no valid 'env_id'; mend or delete the file"),
    "a line that is no object": (lambda a, b: "[1, 2]\n" + b,
                                 "line 1 of {path} has no valid 'agent'; mend or delete the file"),
    "a seed that is no number": (lambda a, b: a.replace('"seed": 1', '"seed": "one"') + b,
                                 "line 1 of {path} has no valid 'seed'; mend or delete the file"),
    "empty": (lambda a, b: "", "{path} lists no run: nothing to report"),
    "only blank lines": (lambda a, b: "\n \n", "{path} lists no run: nothing to report"),
}


@pytest.mark.parametrize("damage", DAMAGED_SWEEP_FILES)
def test_a_damaged_sweep_jsonl_is_read_or_named_in_one_line(damage, tmp_path, capsys):
    make, reason = DAMAGED_SWEEP_FILES[damage]
    path = tmp_path / "sweep.jsonl"
    path.write_text(make(*hand_made_sweep(tmp_path)))
    if reason is None:
        assert sweep.main(["--report", str(tmp_path)]) == 0
        assert "| csf | Ant | 1, 2 | 1,600 | 15.0 (10–20) |" in (tmp_path / "report.md").read_text()
        warned = damage == "torn last line"
        assert (f"warning: skipped the torn last line of {path}" in capsys.readouterr().err) == warned
    else:
        assert refusal("--report", str(tmp_path)) == f"sweep.py: error: {reason.format(path=path)}"
        assert not (tmp_path / "report.md").exists()


def test_a_sweep_whose_runs_have_not_evaluated_reports_nothing(tmp_path):
    hand_made_sweep(tmp_path)
    for seed in (1, 2):
        (tmp_path / f"csf_Ant_seed{seed}" / "runs" / "r" / "eval.jsonl").unlink()
    assert refusal("--report", str(tmp_path)) == (f"sweep.py: error: no run of {tmp_path} has evaluated yet: "
                                                 "nothing to report")


def test_a_damaged_eval_jsonl_is_read_or_named_in_one_line(tmp_path, capsys):
    hand_made_sweep(tmp_path)
    path = tmp_path / "csf_Ant_seed2" / "runs" / "r" / "eval.jsonl"
    good = path.read_text()
    path.write_text(good + '{"env_steps": 2400, "cover')  # torn: the evaluation being written
    assert sweep.main(["--report", str(tmp_path)]) == 0
    assert f"warning: skipped the torn last line of {path}" in capsys.readouterr().err
    assert "| csf | Ant | 1, 2 | 1,600 | 15.0 (10–20) |" in (tmp_path / "report.md").read_text()
    lines = good.splitlines(keepends=True)
    path.write_text(lines[0] + "\x00garbage\n" + "".join(lines[1:]))
    assert refusal("--report", str(tmp_path)) == (f"sweep.py: error: line 2 of {path} is not JSON; mend or delete "
                                                 "the file")
    path.write_text(good.replace('"coverage": 20', '"coverage": "twenty"'))
    assert refusal("--report", str(tmp_path)) == (f"sweep.py: error: line 3 of {path} has no valid 'coverage'; mend or "
                                                 "delete the file")


def test_goal_reaching_and_hierarchical_extras_of_kitchen_and_damaged_ones(tmp_path, capsys):
    """Kitchen's goal_reaching.json holds its tasks' staying time (no radius, no distance); a truncated
    goal_reaching.json and empty, torn or corrupt hierarchical eval.jsonl files are skipped, with warnings."""
    lines = hand_made_sweep(tmp_path, "Kitchen", seeds=(1,)) + hand_made_sweep(tmp_path, "Ant", seeds=(1,))
    (tmp_path / "sweep.jsonl").write_text("".join(lines))
    kitchen = {"env_id": "Kitchen", "results": {"adaptive": {"mean": {"staying_time": 0.5, "hit": 1.0, "end": 0.0},
                                                             "per_goal": []}}}
    (tmp_path / "csf_Kitchen_seed1" / "runs" / "r" / "goal_reaching.json").write_text(json.dumps(kitchen))
    ant = tmp_path / "csf_Ant_seed1" / "runs"
    (ant / "r" / "goal_reaching.json").write_text('{"results": {"adaptive": {"me')
    hierarchical = {}
    for task, text in (("AntMultiGoal", ""), ("AntGoal", '{"return_past10": 3'),
                       ("AntLeft", "oops\n" + json.dumps({"return_past10": 2.0}) + "\n")):
        (ant / f"{task}__hierarchical_csf__1__99").mkdir()
        hierarchical[task] = ant / f"{task}__hierarchical_csf__1__99" / "eval.jsonl"
        hierarchical[task].write_text(text)
    assert sweep.main(["--report", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| agent | env | seeds | env steps | coverage, mean (min–max) | goal task staying time |" in text
    assert "| csf | Kitchen | 1 | 1,600 | 10.0 (10–10) | 0.5 |" in text
    assert "| csf | Ant | 1 | 1,600 | 10.0 (10–10) | – |" in text
    err = capsys.readouterr().err
    assert f"warning: skipped {ant / 'r' / 'goal_reaching.json'}: it does not hold goal_reaching.py's results" in err
    assert f"warning: skipped the torn last line of {hierarchical['AntGoal']}" in err
    assert f"warning: skipped {hierarchical['AntMultiGoal']}: it holds no evaluation" in err
    assert f"warning: line 1 of {hierarchical['AntLeft']} is not JSON; mend or delete the file; skipped" in err


def quick_sweep(sweep_dir, *extra):
    """The argv of a one-run csf sweep (Ant, seed 1) of one epoch: 400 env steps."""
    return ["--sweep-dir", str(sweep_dir), "--agents", "csf", "--env-ids", "Ant", "--seeds", "1", *extra, "--",
            "--total-env-steps", "400", *TINY]


def test_a_repeated_or_sibling_sweep_with_a_damaged_sweep_jsonl(tmp_path, capsys):
    """A repeated sweep reads its sweep.jsonl (and a sibling's, for runs to reuse) before it starts anything."""
    mine, sibling = tmp_path / "mine", tmp_path / "sibling"
    mine.mkdir(), sibling.mkdir()
    (sibling / "sweep.jsonl").write_text("{broken\n{}\n")
    assert refusal(*quick_sweep(mine)) == (f"sweep.py: error: line 1 of {sibling / 'sweep.jsonl'} is not JSON; mend "
                                           "or delete the file")
    (sibling / "sweep.jsonl").unlink()
    (mine / "sweep.jsonl").write_text('{"agent": "csf"}\n' + TORN)
    assert refusal(*quick_sweep(mine)) == (f"sweep.py: error: line 1 of {mine / 'sweep.jsonl'} has no valid 'env_id'; "
                                           "mend or delete the file")
    assert not (mine / "submitit").exists()  # nothing started
    write_run(mine / "csf_Ant_seed1", [2, 3], steps=(0, 400))  # the run is done: nothing to start
    (mine / "sweep.jsonl").write_text(TORN)
    assert sweep.main(quick_sweep(mine)) == 0
    assert "1 runs, 1 already done" in capsys.readouterr().out
    (line,) = [json.loads(line) for line in (mine / "sweep.jsonl").read_text().splitlines()]
    assert (line["folder"], line["status"]) == ("csf_Ant_seed1", "done")
    assert sorted(p.name for p in mine.iterdir() if p.name.endswith(".tmp")) == []


def test_the_agent_run_of_a_folder_is_the_one_with_a_checkpoint_and_stale_ones_are_removed(tmp_path, monkeypatch,
                                                                                          capsys):
    folder = tmp_path / "csf_Ant_seed1"
    write_run(folder, [2, 3], steps=(0, 400))
    runs = folder / "runs"
    (runs / "r").rename(runs / "Ant__csf__1__100")  # checkpointed, then killed
    (runs / "Ant__csf__1__100" / "checkpoint.pt").write_bytes(b"checkpoint")
    (runs / "Ant__csf__1__200").mkdir()  # a later start, killed before its first checkpoint
    (runs / "Ant__csf__1__200" / "eval.jsonl").write_text(json.dumps({"env_steps": 0, "coverage": 9}) + "\n")
    (runs / "AntGoal__hierarchical_csf__1__300").mkdir()
    checkpointed = str(runs / "Ant__csf__1__100")
    for order in (sorted, lambda paths: sorted(paths, reverse=True)):  # whatever order glob gives
        monkeypatch.setattr(sweep.glob, "glob", lambda pattern, glob=sweep.glob.glob, order=order: order(glob(pattern)))
        assert sweep.agent_run_file(str(folder), "eval.jsonl") == os.path.join(checkpointed, "eval.jsonl")
        assert [e["coverage"] for e in sweep.read_evals(str(folder))] == [2, 3]
    monkeypatch.undo()
    run = {"agent": "csf", "argv": ["--env-id", "Ant"], "folder": str(folder)}
    assert sweep.command(run)[-2:] == ["--resume", os.path.join(checkpointed, "checkpoint.pt")]
    sweep.remove_stale_runs(str(folder))
    assert sorted(p.name for p in runs.iterdir()) == ["AntGoal__hierarchical_csf__1__300", "Ant__csf__1__100"]
    assert capsys.readouterr().out == (f"removed {runs / 'Ant__csf__1__200'}: an earlier start left it without a "
                                       "checkpoint\n")
    (runs / "Ant__csf__1__100" / "checkpoint.pt").unlink()  # no checkpoint anywhere: the run starts afresh
    assert sweep.agent_run_file(str(folder), "eval.jsonl") == os.path.join(checkpointed, "eval.jsonl")
    sweep.remove_stale_runs(str(folder))
    assert [p.name for p in runs.iterdir()] == ["AntGoal__hierarchical_csf__1__300"]
    assert sweep.command(run)[-1] == "Ant"  # no --resume


def sleeper(cwd, seconds=60):
    """A process that stands in for an agent (or a driver): it sleeps."""
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"], cwd=cwd)


def record_agent(folder, agent, driver_pid, driver_start, host=None):
    record = {"pid": agent.pid, "start": sweep.process_start(agent.pid), "host": host or sweep.socket.gethostname(),
              "driver_pid": driver_pid, "driver_start": driver_start, "command": ["python", "csf.py"]}
    (folder / "agent.pid").write_text(json.dumps(record) + "\n")


def test_an_agent_left_running_is_stopped_and_one_another_sweep_drives_is_refused(tmp_path, capsys):
    folder = tmp_path / "sweep" / "csf_Ant_seed1"
    folder.mkdir(parents=True)
    agent = sleeper(folder)
    try:
        record_agent(folder, agent, os.getpid(), sweep.process_start(os.getpid()))  # its sweep.py still runs
        assert refusal(*quick_sweep(tmp_path / "sweep")) == (
            f"sweep.py: error: the agent of {folder} is still running (pid {agent.pid}, started by the sweep.py of pid "
            f"{os.getpid()}); wait for that sweep to end, or stop it, then repeat the command")
        record_agent(folder, agent, os.getpid(), sweep.process_start(os.getpid()), host="another-node")
        sweep.stop_orphaned_agent(str(folder))  # a SLURM node's agent: not to be judged from here
        assert agent.poll() is None and not (tmp_path / "sweep" / "submitit").exists()
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        record_agent(folder, agent, gone.pid, 1)  # its sweep.py was killed
        sweep.stop_orphaned_agent(str(folder))
        assert agent.wait(timeout=15) == -signal.SIGTERM
        out = capsys.readouterr().out
        assert f"stopping the agent that a killed sweep left running in {folder} (pid {agent.pid})" in out
        sweep.stop_orphaned_agent(str(folder))  # the record of a stopped agent: nothing to do
    finally:
        agent.kill()
        agent.wait()


JOB = ("import json, sys; sys.path.insert(0, {benchmarks!r}); import sweep; "
       "sweep.run_job([sys.executable, '-c', 'import time; time.sleep(60)'], {cwd!r}, 1, json.loads({driver!r}))")


def start_job(folder, driver=None):
    """run_job in a process of its own, as submitit runs it; returns it once its agent is recorded."""
    job = subprocess.Popen([sys.executable, "-c", JOB.format(benchmarks=os.path.join(ROOT, "benchmarks"),
                                                             cwd=str(folder), driver=json.dumps(driver))])
    deadline = time.time() + 60
    while not (folder / "agent.pid").exists() and time.time() < deadline:
        time.sleep(0.1)
    return job, json.loads((folder / "agent.pid").read_text())


def wait_until_gone(record, seconds=10):
    deadline = time.time() + seconds
    while sweep.alive(record["pid"], record["start"]) and time.time() < deadline:
        time.sleep(0.1)
    return not sweep.alive(record["pid"], record["start"])


def test_an_agent_dies_with_its_job_and_with_the_sweep_that_started_it(tmp_path):
    """For real: SIGKILL of the job process (prctl's PR_SET_PDEATHSIG) and of the sweep.py given as its driver."""
    job, record = start_job(tmp_path)
    assert sweep.alive(record["pid"], record["start"]) and record["driver_pid"] is None
    job.kill()
    job.wait()
    assert wait_until_gone(record)
    driver = sleeper(tmp_path)
    (tmp_path / "agent.pid").unlink()
    job, record = start_job(tmp_path, {"pid": driver.pid, "start": sweep.process_start(driver.pid)})
    try:
        assert sweep.alive(record["pid"], record["start"]) and record["driver_pid"] == driver.pid
        driver.kill()
        driver.wait()
        assert job.wait(timeout=20) == 0 and wait_until_gone(record, 1)
        assert not (tmp_path / "agent.pid").exists()  # the job removed its record
    finally:
        for process in (driver, job):
            process.kill()
            process.wait()


def report_files(folder):
    return {name: (folder / name).read_bytes() for name in ("report.md", "report.png", "sweep.jsonl")}


def test_a_read_only_sweep_folder_gives_one_line_and_keeps_the_earlier_files(tmp_path):
    folder, root = tmp_path / "sweep", os.geteuid() == 0
    with contextlib.ExitStack() as stack:
        if root:  # root writes through chmod: a tmpfs remounted read-only instead
            stack.enter_context(small_disk(folder, 8))
        else:
            folder.mkdir()
        hand_made_sweep(folder)
        assert sweep.main(["--report", str(folder)]) == 0
        earlier = report_files(folder)
        if root:
            subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
            reason = "Read-only file system"
        else:
            folder.chmod(0o555)
            stack.callback(folder.chmod, 0o755)
            reason = "Permission denied"
        assert refusal("--report", str(folder)) == f"sweep.py: error: cannot write {folder / 'report.png'} ({reason})"
        repeated = ["--sweep-dir", str(folder), "--agents", "csf", "--env-ids", "Ant", "--seeds", "1", "2", "--",
                    "--total-env-steps", "1600", *TINY]  # both runs done: only sweep.jsonl and the report to write
        assert refusal(*repeated) == f"sweep.py: error: cannot write {folder / 'sweep.jsonl'} ({reason})"
        assert refusal(*quick_sweep(folder / "new")) == (f"sweep.py: error: cannot make the folder {folder / 'new'} "
                                                         f"({reason})")
        assert report_files(folder) == earlier and not list(folder.glob("*.tmp"))


def test_a_full_disk_gives_one_line_and_leaves_no_temporary_file(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("filling a disk to the last byte needs a tmpfs, which only root can mount")
    with small_disk(tmp_path / "sweep", 8) as folder:
        hand_made_sweep(folder)
        assert sweep.main(["--report", str(folder)]) == 0
        earlier = report_files(folder)
        with open(folder / "filler", "wb") as f:  # fill the disk to the last byte
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        assert refusal("--report", str(folder)) == (f"sweep.py: error: cannot write {folder / 'report.png'} (No space "
                                                    "left on device)")
        assert report_files(folder) == earlier and not list(folder.glob("*.tmp"))
