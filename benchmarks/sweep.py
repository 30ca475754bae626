"""Sweeps of agents × envs × seeds, on this machine or a SLURM cluster, and their report.

    python benchmarks/sweep.py --agents csf metra diayn --env-ids Ant HalfCheetah --seeds 1 2 3 -- --hidden-dim 256
    python benchmarks/sweep.py --agents csf --env-ids Humanoid --seeds 1 2 --backend slurm --partition gpu \\
        --gpus-per-run 1 --time 1440 --mem 64
    python benchmarks/sweep.py --report benchmarks/sweeps/<name>

Flags after `--` go to every run. A combination an agent refuses (an env it does not run on, a flag it does not
have) is skipped with the agent's own one-line reason, before anything starts. Every run works in its own folder,
SWEEP_DIR/<agent>_<env>_seed<S>/ (the agent writes runs/<run_name>/ and its stdout.log there), and SWEEP_DIR/
sweep.jsonl holds one line per run: its command, budget, folder and status (pending, queued, running, done, failed,
refused), and on SLURM its job ids and the reason of a failure. Running the same command again skips the runs that
reached their budget and resumes the others from their checkpoints, so an interrupted sweep (the machine rebooted,
the job hit its time limit, sweep.py was killed) is continued by repeating it. A run that a sibling sweep (another
folder of the same parent) has already finished with the same arguments, once parsed, is not run again: its folder
becomes a link to that run (the default variant that several ablation figures share, written `--xi 5` in one and
`--critic inner` in another). Several commands may share one --sweep-dir (one agent at another budget): sweep.jsonl
keeps every command's runs, and the report shows them all.

What is refused, with one line, before anything starts: an agent other than csf metra diayn visr cic dads, an agent,
env, seed or variant listed twice (two runs would share a folder), a variant or flag after `--` that sets what the
sweep sets (--env-id, --seed, --resume), and a run folder whose agent another sweep.py is still running. While a run
goes on, its folder's agent.pid records the agent (pid and start time); an agent outlives neither its job nor, on this
machine, the sweep.py that started it, and one left running by a killed sweep.py is stopped when the sweep is
repeated. A run restarted without a checkpoint first deletes what an earlier start left without one.

Backends, through submitit: `local` (default) runs --workers runs at once on this machine, one torch thread each
unless --threads says otherwise; `slurm` submits every run as a job of its own, named after the run (--partition,
--account, --qos, --constraint, --gpus-per-run, --time in minutes, --mem in GB, --cpus-per-run, and any other sbatch
option with --sbatch). The agent scripts are the same on both. A job decides what to do when it starts: nothing if
its run reached its budget, else the agent, resuming the run's checkpoint if there is one, so that a requeued,
preempted or timed-out job goes on where the last one stopped, in the run's one folder (a lock, job.lock, keeps a
second job of the run from starting an agent beside the first). On SLURM a job warned of its time limit, or
preempted, stops its agent and requeues itself (submitit's checkpointing) until its run reaches its budget.

On this machine the cores sweep.py may use are divided into --workers disjoint groups of near-equal size (one core
each, shared round-robin, where there are fewer cores than runs), and each run's agent is pinned to a group that no
other running run holds (CPU affinity, which its env workers inherit: an agent starts no more env workers than the
cores it may use), so that runs sharing one GPU do not fight over the cores. A run's cores are in its `started <run>
on cores ...` line and in its agent.pid. SLURM gives each job its own cores.

On SLURM, sweep.py only submits and follows: killing it (or closing its terminal) stops no job. sweep.jsonl records
each run's job ids and state as they change, and the repeated command follows a run's live job (found in squeue by
its comment, `cleanmisl sweep run <folder>`) instead of submitting another. A submission sbatch refuses is one line
with sbatch's reason, and the other runs are submitted still; under a submit limit the rest wait for this sweep's
jobs to end, or for the repeated command. A job that can never start (SLURM's reason PartitionConfig, say: it asks
for more CPUs or memory than a node has) is cancelled, with that reason. A failed run's line quotes its job's reason
and names the file that holds it, SWEEP_DIR/submitit/<job id>_0_log.err (the agent's own output is in the run's
stdout.log).

The report (written at the end of every sweep, or alone with --report) reads every run's eval.jsonl and writes
SWEEP_DIR/report.md and report.png: coverage against env steps per agent and env (mean, min and max over seeds, the
paper's layout), the final-evaluation table, and, where they exist, goal_reaching.py's numbers (goal_reaching.json
next to a run's checkpoint) and hierarchical.py's (hierarchical runs started from a run's folder).
"""

import argparse
import contextlib
import ctypes
import dataclasses
import fcntl
import glob
import hashlib
import importlib
import io
import itertools
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import typing

import matplotlib
import numpy as np
import submitit

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import envs  # noqa: E402

AGENTS = ("csf", "metra", "diayn", "visr", "cic", "dads")
SET_BY_THE_SWEEP = ("--env-id", "--seed", "--resume")  # flags neither a variant nor the flags after `--` may give
AGENT_RECORD = "agent.pid"  # in a run's folder while its agent runs
PR_SET_PDEATHSIG = 1  # prctl's option: a signal for the process when its parent dies (Linux)
# the keys each line of a JSON-lines file must hold, with their types
SWEEP_LINE = {"agent": str, "env_id": str, "seed": int, "folder": str, "command": str}
EVAL_LINE = {"env_steps": int, "coverage": (int, float)}
HIERARCHICAL_LINE = {"return_past10": (int, float, type(None))}  # None until an evaluation after epoch 0
AGENT_LINE = {"pid": int, "start": int, "host": str}
# what a run can be: not started; its job queued (SLURM) or running; done; failed; refused by sbatch
STATUSES = ("done", "running", "queued", "failed", "refused", "pending")


class SweepError(Exception):
    """A failure to report as one line: main prints `sweep.py: error: <message>` and exits with 1."""


def warn(message):
    print(f"warning: {message}", file=sys.stderr)


# ---------------------------------------------------------------- files
def read_json_lines(path, needed):
    """The objects of a JSON-lines file ([] if it does not exist), each holding the keys of `needed` with values of
    their types. Blank lines are skipped, and so is a torn last line (a write cut short), with a warning; any other
    line that is not such an object raises SweepError naming the file and the line."""
    try:
        with open(path, "rb") as f:
            lines = [(number, line) for number, line in enumerate(f.read().splitlines(), 1) if line.strip()]
    except FileNotFoundError:
        return []
    except OSError as e:
        raise SweepError(f"cannot read {path} ({e.strerror})") from None
    records = []
    for number, line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8
            if number == lines[-1][0]:
                warn(f"skipped the torn last line of {path}")
                continue
            raise SweepError(f"line {number} of {path} is not JSON; mend or delete the file") from None
        wrong = [key for key, kind in needed.items() if not isinstance(record, dict) or
                 key not in record or not isinstance(record[key], kind)]
        if wrong:
            raise SweepError(f"line {number} of {path} has no valid {wrong[0]!r}; mend or delete the file")
        records.append(record)
    return records


def write_atomically(path, write):
    """Write a file whole or not at all: write(temporary path) in the same folder, then os.replace; the temporary
    file never stays. SweepError names the path when it cannot be written (a read-only folder, a full disk)."""
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        if isinstance(e, OSError):
            raise SweepError(f"cannot write {path} ({e.strerror or e})") from None
        raise


def write_text(path, text):
    """Write `text` to `path` atomically (see write_atomically)."""
    def write(temporary):
        with open(temporary, "w") as f:
            f.write(text)

    write_atomically(path, write)


def make_folder(path):
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise SweepError(f"cannot make the folder {path} ({e.strerror})") from None


# ---------------------------------------------------------------- processes
def process_start(pid):
    """When process `pid` started (field 22 of /proc/<pid>/stat, clock ticks after boot), so that a recorded pid
    that the system has since given to another process is not mistaken for it; None if it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the fields after the name, which may hold spaces: 3, 4, ...
    return None if fields[0] in ("Z", "X") else int(fields[19])


def alive(pid, start):
    """Whether the process that started at `start` as `pid` still runs."""
    return start is not None and process_start(pid) == start


def stop_process(pid, start):
    """SIGTERM, then SIGKILL if it still runs 10 s later; returns once it is gone."""
    for sig, patience in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if not alive(pid, start):
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            raise SweepError(f"cannot stop process {pid}: it is another user's") from None
        deadline = time.time() + patience
        while alive(pid, start) and time.time() < deadline:
            time.sleep(0.1)
    if alive(pid, start):
        raise SweepError(f"cannot stop process {pid}: it outlived SIGKILL")


def run_job(command, cwd, threads, driver=None, started=None, cores=None):
    """Run one agent command in its folder, its output appended to stdout.log; the exit code. The agent may run on
    `cores` alone (a list of core numbers; None: wherever this process may). While the agent runs, agent.pid in the
    folder records it (its cores, and the SLURM job it belongs to). The agent does not outlive this process
    (prctl's PR_SET_PDEATHSIG, on Linux), nor the sweep.py that started it: `driver`, {"pid", "start"}, on the local
    backend. It ignores SIGUSR2, the signal with which SLURM warns a job of its time limit: that is for the job,
    which stops the agent itself. started(pid, start), if given, learns the agent's process."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    prctl = getattr(ctypes.CDLL(None), "prctl", None)  # looked up before the fork: nothing to load in the child

    def in_the_child():  # after the fork, before the agent's program starts
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # an ignored signal stays ignored across exec
        if prctl:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if cores:
            os.sched_setaffinity(0, cores)

    with open(os.path.join(cwd, "stdout.log"), "a") as log:
        agent = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 preexec_fn=in_the_child)
    record_path, start = os.path.join(cwd, AGENT_RECORD), process_start(agent.pid)
    try:
        if start is not None:  # None: the agent ended already, or this is not Linux
            write_text(record_path, json.dumps({
                "pid": agent.pid, "start": start, "host": socket.gethostname(), "driver_pid": driver and driver["pid"],
                "driver_start": driver and driver["start"], "slurm_job": os.environ.get("SLURM_JOB_ID"),
                "cores": cores, "command": command}) + "\n")
            if started:
                started(agent.pid, start)
        while True:
            try:
                return agent.wait(timeout=1)
            except subprocess.TimeoutExpired:
                if driver and not alive(driver["pid"], driver["start"]):
                    break  # the sweep is gone: its agent goes too
    finally:
        if agent.poll() is None:  # the sweep is gone, or this job is ending (interrupted, timed out)
            agent.terminate()
            try:
                agent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                agent.kill()
        agent.wait()
        with contextlib.suppress(OSError, SweepError, IndexError):
            if read_json_lines(record_path, AGENT_LINE)[-1]["pid"] == agent.pid:
                os.remove(record_path)
    return agent.returncode


def stop_orphaned_agent(folder):
    """Before a run of `folder` starts: if agent.pid names an agent still running on this machine, stop it when the
    sweep.py that started it is gone (killed: the agent was left behind), and refuse when one may still drive it.
    An agent on another machine, or one that a SLURM job runs (the job is followed through SLURM), is left alone."""
    path = os.path.join(folder, AGENT_RECORD)
    records = read_json_lines(path, AGENT_LINE)
    if not records:
        return
    record = records[-1]
    if (record["host"] != socket.gethostname() or record.get("slurm_job")
            or not alive(record["pid"], record["start"])):
        return
    driver_pid, driver_start = record.get("driver_pid"), record.get("driver_start")
    if not isinstance(driver_pid, int) or not isinstance(driver_start, int) or alive(driver_pid, driver_start):
        driven = f", started by the sweep.py of pid {driver_pid}" if isinstance(driver_pid, int) else ""
        raise SweepError(f"the agent of {folder} is still running (pid {record['pid']}{driven}); wait for that sweep "
                         "to end, or stop it, then repeat the command")
    print(f"stopping the agent that a killed sweep left running in {folder} (pid {record['pid']})", flush=True)
    stop_process(record["pid"], record["start"])


# ---------------------------------------------------------------- runs
def variant_slug(variant):
    """A variant's part of its runs' folder names: "--critic mlp" -> "critic-mlp"."""
    return re.sub(r"[^\w.]+", "-", variant).strip("-")


def parse_agent_args(agent_name, argv):
    """The agent's parse of `python <agent>.py *argv`: (args, None), or (None, its one-line reason for refusing)."""
    module = importlib.import_module(agent_name)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # tyro's own refusals are a box on the terminal
            args, _ = module.parse_args(argv)
    except SystemExit as refusal:
        if isinstance(refusal.code, str):
            return None, refusal.code
        return None, choice_refused(module, argv) or f"{agent_name}.py refused it (exit code {refusal.code})"
    return args, None


def choice_refused(module, argv):
    """What tyro refused in `argv`, as one line: a value outside the choices of a flag (a Literal field of Args)."""
    for field in dataclasses.fields(module.Args):
        choices, option = typing.get_args(field.type), "--" + field.name.replace("_", "-")
        for i, word in enumerate(argv):
            value = word.split("=", 1)[1] if word.startswith(option + "=") else (
                argv[i + 1] if word == option and i + 1 < len(argv) else None)
            if typing.get_origin(field.type) is typing.Literal and value is not None and value not in choices:
                return f"{module.AGENT}.py: error: {option} must be one of {', '.join(choices)}, got {value!r}"
    return None


def plan(agents, env_ids, seeds, flags, sweep_dir, variants=("",)):
    """Every run of the sweep: its folder, command and budget (final env steps). A variant is a string of more flags
    (an ablation: "--critic mlp"). A combination the agent refuses is skipped with one line."""
    runs, refused = [], set()
    for agent_name, variant, env_id in itertools.product(agents, variants, env_ids):
        slug = variant_slug(variant)
        label = f"{agent_name}_{slug}_{env_id}" if slug else f"{agent_name}_{env_id}"
        for seed in seeds:
            argv = ["--env-id", env_id, "--seed", str(seed), *shlex.split(variant), *flags]
            args, reason = parse_agent_args(agent_name, argv)
            if reason:
                if (label, reason) not in refused:  # one line per agent, variant, env and reason
                    refused.add((label, reason))
                    print(f"skipped {' '.join([agent_name, variant]).strip()} on {env_id}: {reason}")
                continue
            steps_per_epoch = args.num_envs * envs.ENV_SPECS[env_id].horizon
            runs.append({"agent": agent_name, "variant": variant, "env_id": env_id, "seed": seed, "argv": argv,
                         "folder": os.path.join(sweep_dir, f"{label}_seed{seed}"),
                         "final_env_steps": args.total_env_steps // steps_per_epoch * steps_per_epoch,
                         "command": shlex.join(["python", f"{agent_name}.py", *argv]), "args": args,
                         "status": "pending"})
    return runs


def agent_runs(folder):
    """The agent's run folders in `folder` (runs/<run_name>/, not the hierarchical.py runs started there), sorted by
    name, which ends with the run's start time."""
    return sorted(path for path in glob.glob(os.path.join(folder, "runs", "*"))
                  if os.path.isdir(path) and "__hierarchical_" not in os.path.basename(path))


def agent_run_file(folder, name):
    """The file `name` of the agent's run in `folder`, None if it has none: the run is the one holding a checkpoint
    (the latest started if several do), else the latest started."""
    runs = agent_runs(folder)
    checkpointed = [run for run in runs if os.path.isfile(os.path.join(run, "checkpoint.pt"))]
    path = os.path.join((checkpointed or runs)[-1], name) if runs else None
    return path if path and os.path.isfile(path) else None


def remove_stale_runs(folder):
    """Before a run (re)starts: delete the agent runs in `folder` that earlier starts left without a checkpoint (an
    agent killed before its first one), so that the folder holds one agent run."""
    for path in agent_runs(folder):
        if not os.path.isfile(os.path.join(path, "checkpoint.pt")):
            try:
                shutil.rmtree(path)
            except OSError as e:
                raise SweepError(f"cannot remove {path}, left without a checkpoint by an earlier start "
                                 f"({e.strerror})") from None
            print(f"removed {path}: an earlier start left it without a checkpoint", flush=True)


def read_evals(folder):
    """The eval.jsonl lines of the agent run in `folder`, [] if there is none yet."""
    path = agent_run_file(folder, "eval.jsonl")
    return read_json_lines(path, EVAL_LINE) if path else []


def finished(run):
    evals = read_evals(run["folder"])
    return bool(evals) and evals[-1]["env_steps"] >= run["final_env_steps"]


def command(run):
    """The run's command, with --resume when an earlier attempt left a checkpoint."""
    checkpoint = agent_run_file(run["folder"], "checkpoint.pt")
    return [sys.executable, os.path.join(ROOT, f"{run['agent']}.py"), *run["argv"],
            *(["--resume", checkpoint] if checkpoint else [])]


JOB_LOCK = "job.lock"  # in a run's folder: held by the job that runs it
JOB_REASON = "sweep.py job: "  # starts the line of a job's submitit .err log that says why its run failed
MAX_STALLED = 3  # jobs in a row that may stop (time limit, preemption) without a new checkpoint before one fails


class RunFailed(Exception):
    """A run whose agent ended with an error or could not start; the message is the reason, one line."""


@contextlib.contextmanager
def job_lock(folder, patience=30):
    """Hold the run's job.lock (flock) while the body runs, so that two jobs never run one run's agent at once: a
    second job (a predecessor still ending, a job submitted beside a live one) waits `patience` seconds, then fails."""
    path = os.path.join(folder, JOB_LOCK)
    with open(path, "a") as f:
        deadline = time.time() + patience
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.time() > deadline:
                    raise RunFailed(f"another job is running {folder} (it holds {path}); this one stops") from None
                time.sleep(0.5)
        yield  # the lock goes when the file is closed, or when this process ends, however it ends


def checkpoint_stamp(folder):
    """The run's checkpoint and when it was written, to tell whether a job wrote a new one; None if it has none."""
    path = agent_run_file(folder, "checkpoint.pt")
    with contextlib.suppress(OSError):
        return path and (path, os.stat(path).st_mtime_ns)
    return None


def last_line(path, offset=0):
    """The last non-blank line of the file `path` after byte `offset`, '' if none (or no such file)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(offset, os.path.getsize(path) - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.strip()[:400] for line in reversed(lines) if line.strip()), "")


class Job(submitit.helpers.Checkpointable):
    """The job of one run, on either backend. What it does is decided when it starts, not when it was submitted, so
    that a requeued, preempted or timed-out job goes on where the last one stopped: nothing if the run has reached
    its budget; else its agent, continuing the run's checkpoint if it has one, or afresh in a folder cleared of what
    earlier starts left without a checkpoint, so that the run keeps one agent run (runs/<name>/) whatever happens. It
    holds the run's job.lock meanwhile. A failed agent makes the job fail (an exception) after one line on stderr,
    `sweep.py job: <reason>`, which the driver quotes from the job's submitit .err log.

    On SLURM, submitit calls checkpoint() when the job nears its time limit or is preempted (SIGUSR2, sent --signal
    seconds ahead): the agent stops, its last checkpoint whole on disk (agents write them atomically), and the job
    requeues itself, keeping its job id, to go on from there until the run reaches its budget. After MAX_STALLED jobs
    in a row without a new checkpoint (a time limit shorter than one checkpoint period) it fails instead."""

    def __init__(self, stalled=0):
        self.stalled = stalled  # jobs in a row before this one that stopped without a new checkpoint
        self.agent = self.stamp = None  # the agent's (pid, start); the checkpoint this job started from

    def started(self, pid, start):
        self.agent = (pid, start)

    def __call__(self, run, threads, driver=None):
        folder, log = run["folder"], os.path.join(run["folder"], "stdout.log")
        try:
            with job_lock(folder):
                if finished(run):
                    print(f"{folder} has reached its budget already: nothing to do", flush=True)
                    return 0
                if not agent_run_file(folder, "checkpoint.pt"):
                    remove_stale_runs(folder)
                self.stamp = checkpoint_stamp(folder)
                offset = os.path.getsize(log) if os.path.exists(log) else 0
                code = run_job(command(run), folder, threads, driver, started=self.started, cores=run.get("cores"))
        except (RunFailed, SweepError) as e:
            print(JOB_REASON + str(e), file=sys.stderr, flush=True)
            raise RunFailed(str(e)) from None
        if code == 0:
            return 0
        last, script = last_line(log, offset), f"{run['agent']}.py"
        if code < 0:
            reason = f"{script} was killed by {signal.Signals(-code).name}" + (f" after: {last}" if last else "")
        else:
            reason = last if last.startswith(f"{script}: error:") else (
                f"{script} ended with exit code {code}" + (f": {last}" if last else ""))
        print(JOB_REASON + reason + f" (its output: {log})", file=sys.stderr, flush=True)
        raise RunFailed(reason)

    def checkpoint(self, run, threads, driver=None):
        """submitit's call on SIGUSR2 (the time limit is near, or the job is preempted): stop the agent and return
        the job to requeue, a new Job that starts from the checkpoint (None: not requeued, the job fails)."""
        if self.agent:
            stop_process(*self.agent)
        stalled = self.stalled + 1 if checkpoint_stamp(run["folder"]) == self.stamp else 0
        if stalled >= MAX_STALLED:
            print(f"{JOB_REASON}{stalled} jobs in a row stopped before {run['folder']} wrote a new checkpoint: the "
                  "time limit (--time) is shorter than one checkpoint period (the agent's --checkpoint-every); "
                  "not requeued", file=sys.stderr, flush=True)
            return None
        print("requeued: the next job goes on from the run's checkpoint", flush=True)
        return submitit.helpers.DelayedSubmission(Job(stalled), run, threads, driver)


def job_spec(run):
    """What a job needs to know of its run (small, and picklable without the agent's modules)."""
    return {key: run[key] for key in ("agent", "argv", "folder", "final_env_steps")}


def same_experiment(run, line):
    """Whether a line of another sweep runs the run's agent with the same arguments once parsed, so that
    `--critic inner` (the default written out) is the same experiment as no flag at all."""
    if line["agent"] != run["agent"]:
        return False
    try:
        argv = shlex.split(line["command"])[2:]
    except ValueError:
        return False
    other, _ = parse_agent_args(run["agent"], argv)
    return other == run["args"]


def reuse_finished_twin(run, sweep_dir):
    """Link the run's folder to a finished run of the same experiment in a sibling sweep (the default variant that
    several ablation figures share, say), so that it is not run twice. True if it found one. Only a folder holding
    no agent run is replaced (what a start that failed at once left there goes with it)."""
    if agent_runs(run["folder"]):
        return False
    for state in sorted(glob.glob(os.path.join(os.path.dirname(sweep_dir), "*", "sweep.jsonl"))):
        other_dir = os.path.dirname(state)
        if other_dir == sweep_dir:
            continue
        for line in read_json_lines(state, SWEEP_LINE):
            twin = {**run, "folder": os.path.join(other_dir, line["folder"])}
            if not os.path.islink(twin["folder"]) and finished(twin) and same_experiment(run, line):
                try:
                    shutil.rmtree(run["folder"])
                    os.symlink(os.path.relpath(twin["folder"], sweep_dir), run["folder"])
                except OSError as e:
                    raise SweepError(f"cannot link {run['folder']} to {twin['folder']} ({e.strerror})") from None
                print(f"reused {os.path.relpath(twin['folder'], os.path.dirname(sweep_dir))} for "
                      f"`{run['command']}` (the same experiment, finished in another sweep)")
                return True
    return False


def label(run):
    """A run's name, that of its folder (agent, variant, env, seed), which its SLURM jobs are named after too."""
    return os.path.basename(run["folder"])


def recorded_jobs(line):
    """The SLURM job ids that a sweep.jsonl line records, oldest first."""
    jobs = line.get("jobs") if line else None
    return [str(job) for job in jobs if isinstance(job, (str, int))] if isinstance(jobs, list) else []


def write_state(sweep_dir, runs):
    """sweep.jsonl: one line per run, its folder relative to the sweep's, so the file reads the same anywhere: its
    command, budget (env steps), status, and where they apply its SLURM job ids (oldest first) and the reason of a
    failure, a refusal or a wait. Lines of other commands that used the same folder (another agent at another
    budget) are kept, in their place."""
    path = os.path.join(sweep_dir, "sweep.jsonl")
    lines = {}
    for run in runs:
        folder = os.path.relpath(run["folder"], sweep_dir)
        lines[folder] = {"agent": run["agent"], "variant": run["variant"], "env_id": run["env_id"], "seed": run["seed"],
                         "status": run["status"], "folder": folder, "command": run["command"],
                         "budget": run["final_env_steps"]}
        lines[folder].update({key: run[key] for key in ("jobs", "reason") if run.get(key)})
    lines = {**{line["folder"]: line for line in read_json_lines(path, SWEEP_LINE)}, **lines}
    write_text(path, "".join(json.dumps(line) + "\n" for line in lines.values()))


def env_steps(run):
    """The env steps of the run's latest evaluation, -1 before its first."""
    evals = read_evals(run["folder"])
    return evals[-1]["env_steps"] if evals else -1


def progress(runs, live):
    """One line: how many runs are in each state; the latest evaluation of each live run, and why a queued one waits."""
    counts = {status: sum(run["status"] == status for run in runs) for status in STATUSES}
    line = " | ".join(f"{n} {status}" for status, n in counts.items() if n or status in ("done", "running", "failed"))
    notes = [f"{label(run)} {e[-1]['env_steps']:,} steps, coverage {e[-1]['coverage']}"
             for run in live if (e := read_evals(run["folder"]))]
    notes += [f"{label(run)} waits: {run['waits']}" for run in live if run["status"] == "queued" and run.get("waits")]
    return line + (": " + "; ".join(notes) if notes else "")


def job_reason(err):
    """Why a job failed, from its submitit .err log: the job's own `sweep.py job:` line, else the last line that
    names an error (SLURM's, or a traceback's), both from the job's latest start; '' if there is none."""
    try:
        with open(err, "rb") as f:
            f.seek(max(0, os.path.getsize(err) - 262144))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    starts = [i for i, line in enumerate(lines) if "Starting with JobEnvironment" in line]
    lines = lines[starts[-1]:] if starts else lines
    for match in (lambda line: line.startswith(JOB_REASON), lambda line: re.search("error", line, re.IGNORECASE)):
        found = [line.strip() for line in lines if match(line)]
        if found:
            return found[-1].removeprefix(JOB_REASON)[:400]
    return ""


def failure(job_id, err, how=""):
    """A failed run's reason, one line, naming the file that holds it (the job's submitit .err log)."""
    reason = job_reason(err)
    return f"job {job_id}{' ' + how if how else ''}{': ' + reason if reason else ''} (see {err})"


def finish(args, runs):
    """The end of a sweep: a line for each run that failed or was not submitted, the report; the exit code."""
    for run in runs:
        if run["status"] in ("failed", "refused"):
            reason = run.get("reason") or f"see {os.path.join(run['folder'], 'stdout.log')}"
            print(f"{run['status']}: {label(run)}: {reason}")
    if any(read_evals(run["folder"]) for run in runs):
        report(args.sweep_dir)
    return 1 if any(run["status"] in ("failed", "refused") for run in runs) else 0


# ---------------------------------------------------------------- this machine
def run_locally(args, runs):
    """The local backend: --workers runs at once, each a submitit job (a process) of its own, its agent pinned to a
    group of the cores this process may use (envs.divide_cores) that no other running run holds."""
    folder = os.path.join(args.sweep_dir, "submitit")
    executor = submitit.LocalExecutor(folder, max_num_timeout=REQUEUES)
    executor.update_parameters(timeout_min=args.time)
    start = process_start(os.getpid())
    driver = {"pid": os.getpid(), "start": start} if start is not None else None
    free_groups = [None] * args.workers  # where a process cannot be pinned (not Linux)
    if hasattr(os, "sched_setaffinity"):
        free_groups = envs.divide_cores(envs.usable_cores(), args.workers)
    jobs, groups_held, last_report = {}, {}, 0.0
    while True:
        for i, job in list(jobs.items()):
            if job.done():
                try:
                    job.result()
                    runs[i]["status"] = "done" if finished(runs[i]) else "failed"
                except Exception:  # noqa: BLE001 - the job failed (its agent did, or it was killed): the run failed
                    runs[i]["status"] = "failed"
                if runs[i]["status"] == "failed":
                    runs[i]["reason"] = failure(job.job_id, str(job.paths.stderr))
                del jobs[i]
                free_groups.append(groups_held.pop(i))
        for i, run in enumerate(runs):
            if run["status"] == "pending" and len(jobs) < args.workers:
                group = free_groups.pop(0)
                groups_held[i] = group
                jobs[i] = executor.submit(Job(), {**job_spec(run), "cores": group}, args.threads or 1, driver)
                run["status"] = "running"
                on_cores = f" on cores {','.join(map(str, group))}" if group else ""
                print(f"started {label(run)}{on_cores}", flush=True)
        write_state(args.sweep_dir, runs)
        if not jobs:
            return
        if time.time() - last_report > args.progress_every:
            last_report = time.time()
            print(progress(runs, [runs[i] for i in jobs]), flush=True)
        time.sleep(1)


# ---------------------------------------------------------------- SLURM
# the states of a job that ended (squeue shows them for MinJobAge after the end, sacct for ever)
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "REVOKED"}
# the states of a live job that is not running (its run's status is "queued"); any other live state is "running"
WAITING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD", "SUSPENDED",
           "STOPPED"}
# how a job ends when the cluster ended it, not its run: a run that went forward in it is submitted again
CLUSTER_EVENTS = {"PREEMPTED", "NODE_FAIL", "BOOT_FAIL", "TIMEOUT"}
# squeue's reason (%r) of a pending job that no wait will start, and what it means
NEVER_STARTS = {
    "PartitionConfig": "it asks for more than the partition's nodes have or than it allows "
                       "(--cpus-per-run, --mem, --gpus-per-run, --time)",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows",
    "PartitionTimeLimit": "--time is above the partition's time limit",
    "BadConstraints": "no node has what it asks for (--constraint, --cpus-per-run, --mem, --gpus-per-run)",
    "InvalidAccount": "--account is no account of yours",
    "InvalidQOS": "--qos is no QOS of yours",
    "AccountNotAllowed": "the partition takes no job of this account (--account)",
    "QOSNotAllowed": "the partition takes no job of this QOS (--qos)",
}
PER_JOB_LIMIT = re.compile(r"(QOS|Assoc)Max\w*PerJob")  # a per-job limit of the QOS or association, also for ever
SUBMIT_LIMIT = "job submit limit"  # in sbatch's refusal when the user has as many jobs as the QOS or association allows
REQUEUES = 1_000_000  # submitit's limit on a job's requeues after a time limit: the run's budget is the limit instead


def slurm_parameters(args):
    """submitit's parameters for one run as one SLURM job (its name and comment are the run's, given at submission).
    SIGUSR2 comes --signal seconds before the time limit: 90 s, a sixth of the limit for limits under 9 minutes
    (SLURM looks at time limits every 30 s or so, and may send it that much earlier)."""
    params = {"slurm_partition": args.partition, "slurm_account": args.account, "slurm_qos": args.qos,
              "slurm_constraint": args.constraint, "timeout_min": args.time, "mem_gb": args.mem,
              "cpus_per_task": args.cpus_per_run, "nodes": 1, "tasks_per_node": 1,
              "slurm_signal_delay_s": min(90, args.time * 10), "gpus_per_node": args.gpus_per_run or None,
              "slurm_additional_parameters": dict(args.sbatch) or None}
    return {key: value for key, value in params.items() if value is not None}


def make_executor(args, folder):
    executor = submitit.AutoExecutor(folder, cluster="slurm", slurm_max_num_timeout=REQUEUES)
    executor.update_parameters(**slurm_parameters(args))
    return executor


def job_comment(run):
    """The comment of the run's jobs, by which a later sweep.py finds a live job that sweep.jsonl does not name."""
    return f"cleanmisl sweep run {run['folder']}"


def job_log(submitit_dir, job_id):
    return os.path.join(submitit_dir, f"{job_id}_0_log.err")


def slurm(*command):
    """The output of a SLURM command; SweepError with its complaint if it fails."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SweepError(f"{command[0]} failed ({e})") from None
    if proc.returncode:
        raise SweepError(f"{command[0]} failed: {last_line_of(proc.stderr) or f'exit code {proc.returncode}'}")
    return proc.stdout


def last_line_of(text):
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")


def slurm_queue():
    """This user's jobs that SLURM's queue holds, those that ended within MinJobAge too:
    {job id: {"state", "reason", "comment"}}."""
    jobs = {}
    for line in slurm("squeue", "-h", "-t", "all", "-u", str(os.getuid()), "-o", "%i|%T|%r|%k").splitlines():
        fields = line.split("|", 3)
        if len(fields) == 4:
            jobs[fields[0]] = {"state": fields[1], "reason": fields[2], "comment": fields[3]}
    return jobs


def slurm_accounting(job_ids):
    """How jobs that left the queue ended, from sacct: {job id: state}; {} where the cluster keeps no accounting."""
    try:
        text = slurm("sacct", "-n", "-P", "-X", "-j", ",".join(job_ids), "-o", "JobID,State")
    except SweepError:
        return {}
    return {fields[0]: fields[1].split()[0] for fields in (line.split("|") for line in text.splitlines())
            if len(fields) == 2 and fields[1]}


def sbatch_reason(text):
    """sbatch's refusal in one line: its error lines, joined."""
    errors = [line.split("error:", 1)[1].strip() for line in text.splitlines() if "error:" in line]
    return "sbatch: " + "; ".join(errors) if errors else last_line_of(text) or "sbatch refused it"


def submit(executor, run, threads):
    """Submit the run's job: (its id, None), or (None, sbatch's reason for refusing it)."""
    executor.update_parameters(name=label(run), slurm_comment=job_comment(run))
    folder = str(executor.folder)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's complaint; it is quoted instead
            return executor.submit(Job(), job_spec(run), threads).job_id, None
    except (submitit.core.utils.FailedJobError, submitit.core.utils.FailedSubmissionError) as e:
        for name in os.listdir(folder):  # the pickle and script of the job that never was
            if re.fullmatch(r"[0-9a-f]{32}\.pkl|\.submission_file_[0-9a-f]{32}\.sh", name):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(folder, name))
        return None, sbatch_reason(str(e))


def follow_earlier_jobs(runs, queue):
    """Runs whose job an earlier sweep.py submitted and that is still live (found by its comment): followed, not
    submitted again."""
    for run in runs:
        live = sorted((job_id for job_id, job in queue.items()
                       if job["comment"] == job_comment(run) and job["state"] not in ENDED), key=job_number)
        if run["status"] == "done" or not live:
            continue
        if len(live) > 1:
            warn(f"{label(run)} has {len(live)} live jobs ({', '.join(live)}); following {live[-1]}, the latest")
        run["jobs"] = [job_id for job_id in run["jobs"] if job_id not in live] + live
        run["status"], run["progress"] = "queued", env_steps(run)
        print(f"following job {live[-1]} of {label(run)} ({queue[live[-1]]['state'].lower()}), which an earlier "
              "sweep.py submitted", flush=True)


def job_number(job_id):
    return int(re.match(r"\d+", job_id).group())


def follow(runs, queue, submitit_dir):
    """Update the runs whose job is live from SLURM's queue (or, for one that left it, its accounting); True if one
    of those jobs ended. A job that can never start is cancelled, its run failed with SLURM's reason."""
    live = [run for run in runs if run["status"] in ("queued", "running")]
    gone = [run["jobs"][-1] for run in live if run["jobs"][-1] not in queue]
    accounted = slurm_accounting(gone) if gone else {}
    ended = False
    for run in live:
        job_id = run["jobs"][-1]
        job = queue.get(job_id) or {"state": accounted.get(job_id, "GONE"), "reason": ""}
        state, why = job["state"], job["reason"]
        if state in ENDED or state == "GONE":
            end_of_job(run, job_id, state, submitit_dir)
            ended = True
        elif state in WAITING:
            run["status"], run["waits"] = "queued", why
            never = NEVER_STARTS.get(why) or (PER_JOB_LIMIT.match(why) and "a per-job limit of the QOS or account")
            if never:
                subprocess.run(["scancel", job_id], capture_output=True)
                run.update(status="failed", reason=f"job {job_id} can never start: SLURM's reason is {why}, {never}; "
                                                   "cancelled it")
                print(f"cancelled job {job_id} of {label(run)}: it can never start ({why}: {never})", flush=True)
                ended = True
        else:
            run["status"], run["waits"] = "running", None
    return ended


def end_of_job(run, job_id, state, submitit_dir):
    """A run whose job ended: done if it reached its budget; submitted again if the cluster ended the job (a time
    limit it could not requeue itself from, preemption, a node's failure) after the run went forward in it; else
    failed, with the job's reason."""
    if finished(run):
        run.update(status="done", reason=None)
    elif state in CLUSTER_EVENTS and env_steps(run) > run.get("progress", -1):
        run.update(status="pending", reason=f"job {job_id} ended {state}: submitted again")
        print(f"{label(run)}: job {job_id} ended {state}; submitting the run again, from its checkpoint", flush=True)
    else:
        how = "left SLURM's queue (sacct cannot say how it ended)" if state == "GONE" else f"ended {state}"
        run.update(status="failed", reason=failure(job_id, job_log(submitit_dir, job_id), how))


def run_on_slurm(args, runs):
    """The SLURM backend: every run a job of its own, submitted and followed from here. Killing sweep.py stops no
    job: the repeated command follows the live ones (by their comment) instead of submitting them again, and
    sweep.jsonl records every run's job ids and status as they change."""
    submitit_dir = os.path.join(args.sweep_dir, "submitit")
    executor = make_executor(args, submitit_dir)
    threads, poll = args.threads or args.cpus_per_run, min(10.0, args.progress_every)
    try:
        queue = slurm_queue()
    except SweepError as e:
        raise SweepError(f"cannot read SLURM's queue, so cannot tell which runs have a live job ({e})") from None
    follow_earlier_jobs(runs, queue)
    write_state(args.sweep_dir, runs)
    slot_wait, session_jobs, last_report, silent_since = False, 0, 0.0, None
    while True:
        refused = {}
        for run in runs:
            if run["status"] != "pending" or slot_wait:
                continue
            job_id, reason = submit(executor, run, threads)
            news = None
            if job_id:
                run.update(status="queued", reason=None, waits=None, progress=env_steps(run))
                run["jobs"] = [*run["jobs"], job_id]
                session_jobs += 1
                news = f"submitted {label(run)}: job {job_id}"
            elif SUBMIT_LIMIT in reason and any(r["status"] in ("queued", "running") for r in runs):
                run["reason"], slot_wait = f"waiting for a free submit slot: {reason}", True
                news = (f"sbatch refused {label(run)} ({reason}); it and the runs after it are submitted as this "
                        "sweep's jobs end")
            else:
                run.update(status="refused", reason=reason)
                refused.setdefault(reason, []).append(label(run))
            write_state(args.sweep_dir, runs)  # at once: a driver killed now leaves every submitted job recorded
            if news:
                print(news, flush=True)
        live = [run for run in runs if run["status"] in ("queued", "running")]
        if refused and not live and not session_jobs and all(r["status"] in ("done", "refused") for r in runs):
            count, reason = sum(map(len, refused.values())), next(iter(refused))
            raise SweepError(f"sbatch refused {'the run' if count == 1 else f'all {count} runs'}: {reason}")
        for reason, labels in refused.items():
            print(f"sbatch refused {', '.join(labels)}: {reason}", flush=True)
        if not live:
            if slot_wait:  # nothing of this sweep holds a slot any more: one more try each
                slot_wait = False
                continue
            return
        time.sleep(poll)
        try:
            queue, silent_since = slurm_queue(), None
        except SweepError as e:
            silent_since = silent_since or time.time()
            if time.time() - silent_since > 600:
                raise SweepError(f"SLURM's queue has not answered for 10 minutes ({e}); the jobs go on: repeat the "
                                 "command to follow them") from None
            continue
        if follow(runs, queue, submitit_dir):
            slot_wait = False
        write_state(args.sweep_dir, runs)
        if time.time() - last_report > args.progress_every:
            last_report = time.time()
            print(progress(runs, [run for run in runs if run["status"] in ("queued", "running")]), flush=True)


def sweep(args, flags):
    runs = plan(args.agents, args.env_ids, args.seeds, flags, args.sweep_dir, args.variants)
    if not runs:
        raise SweepError("no run left to do: every combination was refused")
    make_folder(args.sweep_dir)
    earlier = {line["folder"]: line for line in read_json_lines(os.path.join(args.sweep_dir, "sweep.jsonl"),
                                                                 SWEEP_LINE)}
    for run in runs:
        make_folder(run["folder"])
        stop_orphaned_agent(run["folder"])
        run["jobs"] = recorded_jobs(earlier.get(os.path.relpath(run["folder"], args.sweep_dir)))
        if finished(run) or reuse_finished_twin(run, args.sweep_dir):
            run["status"] = "done"
    write_state(args.sweep_dir, runs)  # before any run starts: an unreadable sweep.jsonl stops the sweep here
    print(f"sweep in {args.sweep_dir}: {len(runs)} runs, "
          f"{sum(r['status'] == 'done' for r in runs)} already done", flush=True)
    (run_on_slurm if args.backend == "slurm" else run_locally)(args, runs)
    return finish(args, runs)


# ---------------------------------------------------------------- the report
def curves(evals_by_seed):
    """Coverage mean, min and max over seeds at every env-step count that all seeds evaluated."""
    steps = sorted(set.intersection(*(set(e["env_steps"] for e in evals) for evals in evals_by_seed)))
    values = np.array([[next(e["coverage"] for e in evals if e["env_steps"] == s) for s in steps]
                       for evals in evals_by_seed], dtype=float)
    return np.array(steps), values.mean(0), values.min(0), values.max(0)


def goal_and_hierarchical_results(folder):
    """goal_reaching.py's numbers for the run in `folder`: the staying time (r = 3) and final distance, or, where
    the goals are named tasks (Kitchen, Robobin), the task's staying time; and the last "return (past 10)" of every
    hierarchical run started there, by task. A file that cannot be read is skipped with a warning."""
    found = {}
    path = agent_run_file(folder, "goal_reaching.json")
    if path:
        try:
            with open(path) as f:
                mean = json.load(f)["results"]["adaptive"]["mean"]
            if "staying_time_3" in mean:
                found["goal staying time"] = float(mean["staying_time_3"])
                found["goal final distance"] = float(mean["final_distance"])
            else:
                found["goal task staying time"] = float(mean["staying_time"])
        except (OSError, ValueError, LookupError, TypeError):
            warn(f"skipped {path}: it does not hold goal_reaching.py's results")
    for path in sorted(glob.glob(os.path.join(folder, "runs", "*__hierarchical_*", "eval.jsonl"))):
        try:
            evals = read_json_lines(path, HIERARCHICAL_LINE)
        except SweepError as e:
            warn(f"{e}; skipped")
            continue
        if not evals:
            warn(f"skipped {path}: it holds no evaluation")
            continue
        if evals[-1]["return_past10"] is not None:  # None until an evaluation after epoch 0
            found[f"{os.path.basename(os.path.dirname(path)).split('__')[0]} return (past 10)"] = \
                evals[-1]["return_past10"]
    return found


def report(sweep_dir):
    """report.md and report.png of every run the sweep's sweep.jsonl lists."""
    path = os.path.join(sweep_dir, "sweep.jsonl")
    runs = [{**run, "folder": os.path.join(sweep_dir, run["folder"])} for run in read_json_lines(path, SWEEP_LINE)]
    if not runs:
        raise SweepError(f"{path} lists no run: nothing to report")
    groups = {}
    for run in runs:
        evals = read_evals(run["folder"])
        if evals:
            name = f"{run['agent']} {run.get('variant', '')}".strip()
            groups.setdefault((name, run["env_id"]), []).append((run, evals))
    if not groups:
        raise SweepError(f"no run of {sweep_dir} has evaluated yet: nothing to report")
    env_ids = sorted({env_id for _, env_id in groups})
    fig, axes = plt.subplots(1, len(env_ids), figsize=(5 * len(env_ids), 4), squeeze=False)
    results = {run["folder"]: goal_and_hierarchical_results(run["folder"])
               for members in groups.values() for run, _ in members}
    extras = sorted({k for found in results.values() for k in found})
    columns = ["agent", "env", "seeds", "env steps", "coverage, mean (min–max)", *extras]
    rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for (agent, env_id), members in groups.items():  # in sweep.jsonl's order: the command's --agents and --variants
        steps, mean, low, high = curves([evals for _, evals in members])
        if not len(steps):
            warn(f"{agent} on {env_id}: its seeds share no evaluated env-step count; left out of the report")
            continue
        ax = axes[0, env_ids.index(env_id)]
        line, = ax.plot(steps / 1e6, mean, label=agent)
        ax.fill_between(steps / 1e6, low, high, color=line.get_color(), alpha=0.2)
        found = [results[run["folder"]] for run, _ in members]
        cells = [f"{np.mean([r[k] for r in found if k in r]):.3g}" if any(k in r for r in found) else "–"
                 for k in extras]
        unfinished = [f"seed {run['seed']} {run.get('status', 'unknown')}" for run, _ in members
                      if run.get("status") != "done"]
        partial = f" (partial: {', '.join(unfinished)})" if unfinished else ""  # not the budget: steps so far
        cells = [agent, env_id, ", ".join(str(run["seed"]) for run, _ in members), f"{steps[-1]:,}{partial}",
                 f"{mean[-1]:.1f} ({low[-1]:.0f}–{high[-1]:.0f})", *cells]
        rows.append("| " + " | ".join(cells) + " |")
    for ax, env_id in zip(axes[0], env_ids):
        ax.set_title(env_id)
        ax.set_xlabel("env steps (millions)")
        ax.set_ylabel("coverage (mean, min–max over seeds)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        write_atomically(os.path.join(sweep_dir, "report.png"),
                         lambda temporary: fig.savefig(temporary, dpi=100, format="png"))
    finally:
        plt.close(fig)
    commands = sorted({run["command"] for run in runs})
    text = ("# Sweep report\n\nRuns:\n\n" + "\n".join(f"- `{c}`" for c in commands)
            + "\n\nFinal evaluation (the last env-step count every seed reached; \"partial\" where a seed has not "
            "reached its budget: it failed, or is still queued or running); coverage is counted on the 48 "
            "deterministic evaluation rollouts.\n\n" + "\n".join(rows) + "\n\n![coverage](report.png)\n")
    write_text(os.path.join(sweep_dir, "report.md"), text)
    print("\n".join(rows))
    print(f"written to {os.path.join(sweep_dir, 'report.md')} and report.png")


# ---------------------------------------------------------------- the command line
class Parser(argparse.ArgumentParser):
    """argparse whose refusals are one line, without the usage."""

    def error(self, message):
        sys.exit(f"{self.prog}: error: {message}")


def at_least(minimum):
    """An argparse type: an integer no smaller than `minimum`."""
    def integer(text):
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    integer.__name__ = "int"  # argparse's word for a value that is no integer
    return integer


def positive_seconds(text):
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


positive_seconds.__name__ = "float"


# sbatch's options that the sweep sets itself: the flag of sweep.py that sets it, or why none may
SBATCH_SET_BY_THE_SWEEP = {
    "partition": "use --partition", "account": "use --account", "qos": "use --qos", "constraint": "use --constraint",
    "time": "use --time", "mem": "use --mem", "cpus-per-task": "use --cpus-per-run",
    "gpus-per-node": "use --gpus-per-run", "job-name": "each job is named after its run",
    "comment": "the sweep finds a run's live job by its comment", "output": "submitit keeps each job's logs",
    "error": "submitit keeps each job's logs", "open-mode": "submitit keeps each job's logs",
    "signal": "the job's warning of its time limit is set from --time", "nodes": "a run is one task on one node",
    "ntasks-per-node": "a run is one task on one node", "array": "every run is a job of its own",
}


def sbatch_option(text):
    """An argparse type: one sbatch option, NAME=VALUE or NAME (a switch), as (name, value or True)."""
    name, value = text.split("=", 1) if "=" in text else (text, True)
    name = name.removeprefix("--")
    if not re.fullmatch(r"[a-z][a-z0-9-]+", name):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE or NAME with a long sbatch option's name")
    if name in SBATCH_SET_BY_THE_SWEEP:
        raise argparse.ArgumentTypeError(f"{name} is set by the sweep: {SBATCH_SET_BY_THE_SWEEP[name]}")
    return name, value


sbatch_option.__name__ = "sbatch option"


def sets_what_the_sweep_sets(tokens):
    """The first of --env-id, --seed and --resume that `tokens` give (in any spelling tyro reads), else None."""
    for token in tokens:
        name = token.split("=", 1)[0].replace("_", "-")
        if name in SET_BY_THE_SWEEP:
            return name
    return None


def check(parser, args, flags):
    """Refuse, with one line, what would make runs share a folder or fight over the flags the sweep sets."""
    for flag, values in (("--agents", args.agents), ("--env-ids", args.env_ids), ("--seeds", args.seeds),
                         ("--variants", args.variants)):
        repeated = next((value for value in values if values.count(value) > 1), None)
        if repeated is not None:
            parser.error(f"{flag} lists {repeated!r} twice: its runs would share one folder")
    for variant in args.variants:
        try:
            tokens = shlex.split(variant)
        except ValueError as e:
            parser.error(f"--variants {variant!r} cannot be split into flags ({e})")
        if sets_what_the_sweep_sets(tokens):
            parser.error(f"--variants {variant!r} sets {sets_what_the_sweep_sets(tokens)}, which the sweep sets "
                         "itself (--env-ids, --seeds, and --resume to continue a run)")
    slugs = [variant_slug(variant) for variant in args.variants]
    for i, j in itertools.combinations(range(len(slugs)), 2):
        if slugs[i] == slugs[j]:
            parser.error(f"--variants {args.variants[i]!r} and {args.variants[j]!r} would share their run folders")
    if sets_what_the_sweep_sets(flags):
        parser.error(f"the flags after -- set {sets_what_the_sweep_sets(flags)}, which the sweep sets itself "
                     "(--env-ids, --seeds, and --resume to continue a run)")
    missing = next((tool for tool in ("sbatch", "srun", "squeue", "sacct", "scancel") if shutil.which(tool) is None),
                   None)
    if args.backend == "slurm" and missing:
        parser.error(f"--backend slurm needs SLURM's {missing}, which is not on PATH here")
    if args.sweep_dir == "":
        parser.error("--sweep-dir must name a folder")
    if args.sweep_dir and os.path.exists(args.sweep_dir) and not os.path.isdir(args.sweep_dir):
        parser.error(f"--sweep-dir {args.sweep_dir} is a file, not a folder")


def run_command(argv):
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = Parser(prog="sweep.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", nargs="+", default=["csf", "metra"], choices=AGENTS, metavar="AGENT",
                        help=f"agent scripts: {' '.join(AGENTS)}")
    parser.add_argument("--env-ids", nargs="+", default=["Ant"], help="envs of envs.py")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="seeds: one run each")
    parser.add_argument("--variants", nargs="+", default=[""], help='more flags per variant of each agent, one string '
                        'each: --variants "--critic inner" "--critic mlp" (an ablation)')
    parser.add_argument("--sweep-dir", help="the sweep's folder (unset: benchmarks/sweeps/<a name made from the "
                                            "command>, so the same command finds its sweep again)")
    parser.add_argument("--report", metavar="SWEEP_DIR", help="only write the report of an existing sweep")
    parser.add_argument("--backend", choices=["local", "slurm"], default="local",
                        help="local: runs on this machine; slurm: every run a SLURM job (see above)")
    parser.add_argument("--workers", type=at_least(1), default=len(envs.usable_cores()),
                        help="local: runs at once (unset: one per core sweep.py may use); the cores are divided "
                             "among them, each run pinned to its share, which bounds its env workers")
    parser.add_argument("--threads", type=at_least(1),
                        help="torch threads per run (unset: 1 locally, --cpus-per-run on SLURM)")
    parser.add_argument("--partition", help="slurm: the partition (unset: the cluster's default)")
    parser.add_argument("--account", help="slurm: the account the jobs are charged to (unset: your default)")
    parser.add_argument("--qos", help="slurm: the quality of service of the jobs (unset: the account's default)")
    parser.add_argument("--constraint", help="slurm: node features the jobs need, in sbatch's syntax (a100|h100)")
    parser.add_argument("--sbatch", nargs="+", type=sbatch_option, default=[], metavar="OPTION",
                        help="slurm: more sbatch options for every job, NAME=VALUE or NAME, without the dashes: "
                             "--sbatch reservation=maint exclusive")
    parser.add_argument("--gpus-per-run", type=at_least(0), default=0,
                        help="slurm: GPUs per job (0: none, and nothing about GPUs is sent)")
    parser.add_argument("--cpus-per-run", type=at_least(1), default=4, help="slurm: CPUs per job")
    parser.add_argument("--time", type=at_least(1), default=24 * 60,
                        help="minutes a job may take; a run that needs longer goes on in the next job from its "
                             "checkpoint (slurm: the job's time limit; the job requeues itself, warned by SIGUSR2 "
                             "90 s before it, a sixth of the limit under 9 minutes)")
    parser.add_argument("--mem", type=at_least(1), default=32, help="slurm: GB of memory per job")
    parser.add_argument("--progress-every", type=positive_seconds, default=60,
                        help="seconds between progress lines (slurm: the queue is read every 10 s, or this often "
                             "if shorter)")
    args = parser.parse_args(argv)
    if args.report is not None:
        if not args.report or not os.path.isfile(os.path.join(args.report, "sweep.jsonl")):
            parser.error(f"{args.report!r} is not a sweep folder (it has no sweep.jsonl)")
        report(args.report)
        return 0
    check(parser, args, flags)
    if args.sweep_dir is None:
        key = json.dumps([sorted(args.agents), sorted(args.env_ids), sorted(args.seeds), args.variants, flags])
        args.sweep_dir = os.path.join(ROOT, "benchmarks", "sweeps", hashlib.sha1(key.encode()).hexdigest()[:10])
    args.sweep_dir = os.path.abspath(args.sweep_dir)
    return sweep(args, flags)


def main(argv=None):
    """The command line; every failure that is not a bug ends with one line on stderr."""
    try:
        return run_command(sys.argv[1:] if argv is None else list(argv))
    except SweepError as e:
        sys.exit(f"sweep.py: error: {e}")
    except KeyboardInterrupt:
        sys.exit("sweep.py: error: interrupted; repeat the command to continue the sweep")
    except OSError as e:  # a folder or file the checks above could not foresee (removed, unreadable)
        sys.exit(f"sweep.py: error: {f'{e.filename}: ' if e.filename else ''}{e.strerror or e}")


if __name__ == "__main__":
    sys.exit(main())
