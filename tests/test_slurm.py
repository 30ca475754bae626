"""benchmarks/sweep.py --backend slurm against a real SLURM: the one-node cluster that .ci/slurm_up.sh brings up
(cluster cleanmisl-ci; .ci/run starts it). Skipped, with the reason, where that cluster is not running. Nothing of
SLURM is faked here: sbatch, squeue, sacct, scontrol and scancel are the cluster's.

A tiny sweep completes (named jobs, --account, --qos, --constraint and --sbatch reach sbatch, nothing about GPUs,
a failed run points at its job's .err log); the driver SIGKILLed and a job requeued meanwhile: the repeated command
follows the jobs, submits none again, and the requeued run goes on in its folder; a run longer than its 1-minute
time limit reaches its budget over several starts of one job; refused submissions are one line; a job that can
never start is cancelled with SLURM's reason; under a per-user submit limit the rest are submitted as slots free,
by the repeated command after a kill."""

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = "cleanmisl-ci"  # .ci/slurm_up.sh's
TINY = ["--num-envs", "2", "--learning-starts", "400", "--grad-steps-per-epoch", "2", "--batch-size", "16",
        "--hidden-dim", "16", "--num-eval-skills", "2", "--no-cuda"]  # Ant: 400 env steps an epoch
ON_THE_CLUSTER = ["--backend", "slurm", "--cpus-per-run", "1", "--mem", "1", "--progress-every", "1"]


def why_no_cluster():
    """None where .ci/slurm_up.sh's cluster answers here, else why these tests cannot run."""
    if shutil.which("sbatch") is None:
        return "no SLURM here (sbatch is not on PATH); .ci/slurm_up.sh brings up a one-node test cluster, as root"
    conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    try:
        with open(conf) as f:
            ours = re.search(rf"^ClusterName={CLUSTER}$", f.read(), re.MULTILINE)
    except OSError as e:
        return f"no SLURM configuration here ({conf}: {e.strerror}); .ci/slurm_up.sh brings up a test cluster"
    if not ours:
        return f"the SLURM here is not .ci/slurm_up.sh's cluster {CLUSTER}, whose limits these tests change"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=60)
    if ping.returncode or " is UP" not in ping.stdout:
        said = (ping.stdout.strip().splitlines() or [ping.stderr.strip()])[0]
        return f"the test cluster's controller does not answer ({said}); start it with .ci/slurm_up.sh"
    return None


NO_CLUSTER = why_no_cluster()
pytestmark = pytest.mark.skipif(NO_CLUSTER is not None, reason=str(NO_CLUSTER))


def start_sweep(sweep_dir, *argv, **popen):
    """sweep.py on the cluster, run as a user runs it, from `sweep_dir`'s parent (the jobs' working folder)."""
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "sweep.py"), "--sweep-dir", str(sweep_dir),
               *ON_THE_CLUSTER, *argv]
    return subprocess.Popen(command, cwd=os.path.dirname(sweep_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)


def finish(proc, timeout):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"sweep.py did not end within {timeout} s:\n{out}\n{err}")
    return proc.returncode, out, err


def states(sweep_dir):
    """sweep.jsonl's lines by run folder."""
    return {line["folder"]: line for line in map(json.loads, (sweep_dir / "sweep.jsonl").read_text().splitlines())}


def jobs_started_from(folder, expected=None):
    """SLURM's accounting of every job submitted from `folder` (its working folder): {job id: [state of each start,
    oldest first]}, requeued starts included. slurmdbd records a job's end a moment after it: with `expected`, the
    accounting is read again, for up to 30 s, until it says that."""
    deadline = time.time() + 30
    while True:
        text = subprocess.run(["sacct", "-n", "-P", "-X", "-D", "-S", "now-2hours", "-o", "JobID,State,WorkDir"],
                              capture_output=True, text=True, check=True).stdout
        jobs = {}
        for job_id, state, work_dir in (line.split("|", 2) for line in text.splitlines() if line.count("|") >= 2):
            if work_dir == str(folder):
                jobs.setdefault(job_id, []).append(state.split()[0])
        if expected is None or jobs == expected or time.time() > deadline:
            return jobs
        time.sleep(0.5)


def epochs(run_folder):
    """The epochs of the eval.jsonl of the run's one agent run (runs/<name>/; it never has two)."""
    (run_dir,) = run_folder.glob("runs/*")
    return [json.loads(line)["epoch"] for line in (run_dir / "eval.jsonl").read_text().splitlines()]


def wait_for(what, condition, timeout):
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            pytest.fail(f"{what} did not happen within {timeout} s")
        time.sleep(0.5)


@contextlib.contextmanager
def killed_at_the_end(proc):
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_a_tiny_sweep_completes_and_a_failed_run_points_at_its_log(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = start_sweep(sweep_dir, "--agents", "csf", "--env-ids", "Ant", "--seeds", "1", "--account", "ci", "--qos",
                       "normal", "--constraint", "ci", "--sbatch", "nice=5", "--variants", "--lr 1e-4",
                       "--lr 1e30", "--", "--total-env-steps", "400", "--eval-every", "1", *TINY)
    code, out, err = finish(proc, 300)
    good, bad = "csf_lr-1e-4_Ant_seed1", "csf_lr-1e30_Ant_seed1"  # the second's losses are NaN at its first step
    lines = states(sweep_dir)
    assert code == 1 and (lines[good]["status"], lines[bad]["status"]) == ("done", "failed"), out + err
    (good_job,), (bad_job,) = lines[good]["jobs"], lines[bad]["jobs"]
    log = sweep_dir / "submitit" / f"{bad_job}_0_log.err"
    (failure,) = [line for line in out.splitlines() if line.startswith("failed:")]
    assert re.fullmatch(rf"failed: {bad}: job {bad_job} ended FAILED: csf\.py: error: \w+_loss is -?(nan|inf) at "
                        rf"gradient step 1 .* \(its output: .*\) \(see {re.escape(str(log))}\)", failure), failure
    assert "sweep.py job: csf.py: error: " in log.read_text()  # the reason, where it points
    assert lines[bad]["reason"] in failure
    assert "| csf --lr 1e-4 | Ant | 1 | 400 | " in (sweep_dir / "report.md").read_text()
    text = subprocess.run(["sacct", "-n", "-P", "-X", "-j", f"{good_job},{bad_job}", "-o", "JobID,JobName,Account,QOS"],
                          capture_output=True, text=True, check=True).stdout
    assert sorted(text.split()) == sorted([f"{good_job}|{good}|ci|normal", f"{bad_job}|{bad}|ci|normal"])
    script = (sweep_dir / "submitit" / f"{good_job}_submission.sh").read_text()
    assert "#SBATCH --constraint=ci" in script and "#SBATCH --nice=5" in script
    assert "gpu" not in script.lower() and "gres" not in script  # no GPU asked for: nothing about GPUs sent


def test_a_killed_driver_and_a_requeued_job_the_repeated_command_follows_without_a_second_job(tmp_path):
    """The driver SIGKILLed while two jobs run, then one of them requeued (as a preemption would) while no driver
    runs: the repeated command submits nothing, follows both jobs, and the requeued one goes on in its run's folder
    from its checkpoint."""
    sweep_dir = tmp_path / "sweep"
    argv = ["--agents", "csf", "--env-ids", "Ant", "--seeds", "1", "2", "--", "--total-env-steps", "16000",
            "--eval-every", "1", "--checkpoint-every", "1", "--buffer-size", "800", *TINY]  # 40 epochs
    with killed_at_the_end(start_sweep(sweep_dir, *argv, start_new_session=True)) as driver:
        run1 = sweep_dir / "csf_Ant_seed1"
        wait_for("a checkpoint of seed 1", lambda: list(run1.glob("runs/*/checkpoint.pt")), 180)
        lines = states(sweep_dir)
        (job1,), (job2,) = lines["csf_Ant_seed1"]["jobs"], lines["csf_Ant_seed2"]["jobs"]
        driver.kill()  # the driver only: the jobs go on
    subprocess.run(["scontrol", "requeue", job1], check=True)
    wait_for(f"job {job1} back in the queue", lambda: "PENDING" in subprocess.run(
        ["squeue", "-h", "-j", job1, "-o", "%T"], capture_output=True, text=True).stdout, 60)
    code, out, err = finish(start_sweep(sweep_dir, *argv), 300)  # the same command again
    assert code == 0, out + err
    assert f"following job {job1} of csf_Ant_seed1 (" in out  # job 2's too, unless it has ended meanwhile
    assert not [line for line in out.splitlines() if line.startswith("submitted")]
    lines = states(sweep_dir)
    assert [lines[run]["jobs"] for run in ("csf_Ant_seed1", "csf_Ant_seed2")] == [[job1], [job2]]
    assert all(line["status"] == "done" for line in lines.values())
    expected = {job1: ["REQUEUED", "COMPLETED"], job2: ["COMPLETED"]}
    assert jobs_started_from(tmp_path, expected) == expected  # no second job
    for seed in (1, 2):
        numbers = epochs(sweep_dir / f"csf_Ant_seed{seed}")  # one agent run each
        assert numbers[-1] == 40 and all(a < b for a, b in zip(numbers, numbers[1:]))  # no epoch twice
    assert "resumed" in (run1 / "stdout.log").read_text()  # the requeued job went on from the checkpoint


def seconds_per_epoch(folder):
    """How long an epoch of the time-limit test's tiny csf run takes here now, on one torch thread as a job runs it:
    epochs 10 to 40 of a local run (start-up and the epochs before learning starts left out)."""
    flags = ["--env-id", "Ant", "--total-env-steps", "16000", "--eval-every", "10", "--buffer-size", "800", *TINY]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    subprocess.run([sys.executable, os.path.join(ROOT, "csf.py"), *flags], cwd=folder, env=env, check=True,
                   capture_output=True, timeout=300)
    (run_dir,) = (folder / "runs").glob("*")
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    wall = {line["epoch"]: line["wall_time"] for line in evals}
    return (wall[40] - wall[10]) / 30


def test_a_run_longer_than_its_time_limit_reaches_its_budget_over_several_starts_of_its_job(tmp_path):
    """--time 1 (a minute): SIGUSR2 comes ahead of the limit, the job stops its agent and requeues itself, and the
    next start resumes the checkpoint, until the run reaches its budget. SLURM looks at time limits every 30 s, so
    the signal comes 20 to 50 s into a start: the run's budget is what this machine does in about 150 s at the pace
    measured just before, so it needs two starts or more on any machine."""
    (tmp_path / "pace").mkdir()
    num_epochs = max(300, math.ceil(150 / seconds_per_epoch(tmp_path / "pace")))
    sweep_dir = tmp_path / "sweep"
    code, out, err = finish(start_sweep(
        sweep_dir, "--time", "1", "--agents", "csf", "--env-ids", "Ant", "--seeds", "1", "--", "--total-env-steps",
        str(400 * num_epochs), "--eval-every", "30", "--checkpoint-every", "1", "--buffer-size", "800", *TINY), 900)
    assert code == 0, out + err
    (line,) = states(sweep_dir).values()
    (job,) = line["jobs"]
    wait_for(f"the end of job {job} in SLURM's accounting",
             lambda: jobs_started_from(tmp_path).get(job, ["RUNNING"])[-1] == "COMPLETED", 30)
    starts = jobs_started_from(tmp_path)[job]
    assert len(starts) >= 2 and set(starts[:-1]) == {"REQUEUED"} and starts[-1] == "COMPLETED", (starts, num_epochs)
    assert (sweep_dir / "submitit" / f"{job}_0_log.err").read_text().count("this job is timed-out") == len(starts) - 1
    numbers = epochs(sweep_dir / "csf_Ant_seed1")
    assert numbers[-1] == num_epochs and all(a < b for a, b in zip(numbers, numbers[1:]))
    # Every start after the first resumes the checkpoint: the agent's start-up line says the flags are the run's own,
    # never the paper's afresh. A start stopped before its agent printed it (a slow start-up), or after the agent had
    # reached the budget (the next start has nothing to do), prints less, so launches are counted from the log.
    log = (sweep_dir / "csf_Ant_seed1" / "stdout.log").read_text().splitlines()
    launches = [line for line in log if line.startswith("Ant (horizon 200): ")]
    resumed_at = [int(line.split(" at epoch ")[1].split()[0]) for line in log if line.startswith("resumed ")]
    assert not launches[0].endswith("(the run's own, but for those given anew)"), launches
    assert all(line.endswith("(the run's own, but for those given anew)") for line in launches[1:]), launches
    assert 1 <= len(resumed_at) <= len(launches) - 1 <= len(starts) - 1, (resumed_at, launches, starts)
    assert resumed_at == sorted(resumed_at) and resumed_at[-1] < num_epochs, resumed_at


@pytest.mark.parametrize("flags, reason", [
    (["--partition", "nowhere"], "sbatch: invalid partition specified: nowhere; Batch job submission failed: Invalid "
                                 "partition name specified"),
    (["--gpus-per-run", "1"], "sbatch: Invalid generic resource (gres) specification"),
    (["--mem", "100000"], "sbatch: Memory specification can not be satisfied; Batch job submission failed: Requested "
                          "node configuration is not available"),
])
def test_a_refused_submission_is_one_line_with_sbatchs_reason(flags, reason, tmp_path):
    sweep_dir = tmp_path / "sweep"
    code, out, err = finish(start_sweep(sweep_dir, *flags, "--agents", "csf", "--env-ids", "Ant", "--seeds", "1", "2",
                                        "--", "--total-env-steps", "400", *TINY), 120)
    assert code == 1 and err.splitlines() == [f"sweep.py: error: sbatch refused all 2 runs: {reason}"], err
    assert "Traceback" not in out + err
    assert [(line["status"], line["reason"], line.get("jobs")) for line in states(sweep_dir).values()] == [
        ("refused", reason, None)] * 2


def test_a_job_that_can_never_start_is_cancelled_with_slurms_reason(tmp_path):
    """4 CPUs a job where the node has 2: SLURM leaves it pending for ever (reason PartitionConfig)."""
    sweep_dir = tmp_path / "sweep"
    code, out, err = finish(start_sweep(sweep_dir, "--cpus-per-run", "4", "--agents", "csf", "--env-ids", "Ant",
                                        "--seeds", "1", "--", "--total-env-steps", "400", *TINY), 120)
    (line,) = states(sweep_dir).values()
    (job,) = line["jobs"]
    assert code == 1 and line["status"] == "failed", out + err
    assert f"cancelled job {job} of csf_Ant_seed1: it can never start (PartitionConfig: it asks for more than" in out
    assert line["reason"].startswith(f"job {job} can never start: SLURM's reason is PartitionConfig")
    assert jobs_started_from(tmp_path, {job: ["CANCELLED"]}) == {job: ["CANCELLED"]}


@pytest.fixture
def submit_limit():
    """At most one job of this user in the queue at a time (sacctmgr's MaxSubmitJobs), for the test's length."""
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()

    def limit(value):
        subprocess.run(["sacctmgr", "-i", "modify", "user", user, "set", f"MaxSubmitJobs={value}"], check=True,
                       capture_output=True)
        wait_for("the limit to reach slurmctld", lambda: ("MaxSubmitJobs=1(" in subprocess.run(
            ["scontrol", "show", "assoc_mgr", f"users={user}", "flags=assoc"], capture_output=True,
            text=True).stdout) == (value == 1), 30)

    limit(1)
    try:
        yield
    finally:
        limit(-1)


def test_under_a_submit_limit_the_repeated_command_submits_the_rest(tmp_path, submit_limit):
    """One job at a time: the first sweep.py submits seed 1, is refused seed 2 and is killed; the repeated command
    follows seed 1's job, submits seed 2 once that job has ended, and no run gets a second job."""
    sweep_dir = tmp_path / "sweep"
    argv = ["--agents", "csf", "--env-ids", "Ant", "--seeds", "1", "2", "--", "--total-env-steps", "4000",
            "--eval-every", "5", *TINY]  # 10 epochs
    with killed_at_the_end(start_sweep(sweep_dir, *argv, start_new_session=True)) as driver:
        for line in driver.stdout:
            if line.startswith("sbatch refused"):
                break
        assert line.startswith("sbatch refused csf_Ant_seed2 (sbatch: AssocMaxSubmitJobLimit; Batch job submission "
                               "failed: Job violates accounting/QOS policy (job submit limit, "), line
        driver.kill()
    lines = states(sweep_dir)
    (job1,) = lines["csf_Ant_seed1"]["jobs"]
    assert "jobs" not in lines["csf_Ant_seed2"] and "job submit limit" in lines["csf_Ant_seed2"]["reason"]
    code, out, err = finish(start_sweep(sweep_dir, *argv), 300)
    assert code == 0, out + err
    lines = states(sweep_dir)
    (job2,) = lines["csf_Ant_seed2"]["jobs"]
    assert lines["csf_Ant_seed1"]["jobs"] == [job1]  # followed, if it had not ended yet, never submitted again
    assert f"submitted csf_Ant_seed2: job {job2}" in out
    expected = {job1: ["COMPLETED"], job2: ["COMPLETED"]}
    assert jobs_started_from(tmp_path, expected) == expected
