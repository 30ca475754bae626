"""Sweeps of agents × envs × seeds, on this machine or a SLURM cluster, and their report.

    python benchmarks/sweep.py --agents csf metra diayn --env-ids Ant HalfCheetah --seeds 1 2 3 -- --hidden-dim 256
    python benchmarks/sweep.py --agents csf --env-ids Humanoid --seeds 1 2 --backend slurm --partition gpu \\
        --gpus-per-run 1 --time 1440 --mem 64
    python benchmarks/sweep.py --report benchmarks/sweeps/<name>

Flags after `--` go to every run. A combination an agent refuses (an env it does not run on, a flag it does not
have) is skipped with the agent's own one-line reason, before anything starts. Every run works in its own folder,
SWEEP_DIR/<agent>_<env>_seed<S>/ (the agent writes runs/<run_name>/ and its stdout.log there), and SWEEP_DIR/
sweep.jsonl holds one line per run: its command, status (pending, running, done, failed) and folder. Running the
same command again skips the runs that reached their budget and resumes the others from their checkpoints, so an
interrupted sweep (the machine rebooted, the job hit its time limit, sweep.py was killed) is continued by repeating
it. A run that a sibling sweep (another folder of the same parent) has already finished with the same arguments, once
parsed, is not run again: its folder becomes a link to that run (the default variant that several ablation figures
share, written `--xi 5` in one and `--critic inner` in another). Several commands may share one --sweep-dir (one agent
at another budget): sweep.jsonl keeps every command's runs, and the report shows them all.

What is refused, with one line, before anything starts: an agent other than csf metra diayn visr cic dads, an agent,
env, seed or variant listed twice (two runs would share a folder), a variant or flag after `--` that sets what the
sweep sets (--env-id, --seed, --resume), and a run folder whose agent another sweep.py is still running. While a run
goes on, its folder's agent.pid records the agent (pid and start time); an agent outlives neither its job nor, on this
machine, the sweep.py that started it, and one left running by a killed sweep.py is stopped when the sweep is
repeated. A run restarted without a checkpoint first deletes what an earlier start left without one.

Backends, through submitit: `local` (default) runs --workers runs at once on this machine, one torch thread each
unless --threads says otherwise; `slurm` submits every run as its own job (--partition, --gpus-per-run, --time in
minutes, --mem in GB, --cpus-per-run). The agent scripts are the same on both.

The report (written at the end of every sweep, or alone with --report) reads every run's eval.jsonl and writes
SWEEP_DIR/report.md and report.png: coverage against env steps per agent and env (mean, min and max over seeds, the
paper's layout), the final-evaluation table, and, where they exist, goal_reaching.py's numbers (goal_reaching.json
next to a run's checkpoint) and hierarchical.py's (hierarchical runs started from a run's folder).
"""

import argparse
import contextlib
import ctypes
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


def run_job(command, cwd, threads, driver=None):
    """What a submitit job does: run one agent command in its folder, its output to stdout.log; the exit code.
    While the agent runs, agent.pid in the folder records it. The agent does not outlive this process (prctl's
    PR_SET_PDEATHSIG, on Linux), nor the sweep.py that started it: `driver`, {"pid", "start"}, on the local backend."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    prctl = getattr(ctypes.CDLL(None), "prctl", None)  # looked up before the fork: nothing to load in the child
    with open(os.path.join(cwd, "stdout.log"), "a") as log:
        agent = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 preexec_fn=prctl and (lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)))
    record_path, start = os.path.join(cwd, AGENT_RECORD), process_start(agent.pid)
    try:
        if start is not None:  # None: the agent ended already, or this is not Linux
            write_text(record_path, json.dumps({
                "pid": agent.pid, "start": start, "host": socket.gethostname(), "driver_pid": driver and driver["pid"],
                "driver_start": driver and driver["start"], "command": command}) + "\n")
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
    An agent on another machine (a SLURM node) cannot be seen from here."""
    path = os.path.join(folder, AGENT_RECORD)
    records = read_json_lines(path, AGENT_LINE)
    if not records:
        return
    record = records[-1]
    if record["host"] != socket.gethostname() or not alive(record["pid"], record["start"]):
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
    captured = io.StringIO()  # tyro's own refusals are a box on stderr; keep its first line of text
    try:
        with contextlib.redirect_stderr(captured):
            args, _ = importlib.import_module(agent_name).parse_args(argv)
    except SystemExit as refusal:
        if isinstance(refusal.code, str):
            return None, refusal.code
        text = [line.strip("│ ") for line in captured.getvalue().splitlines() if line.startswith("│")]
        return None, next((line for line in text if line), f"{agent_name}.py refused it (exit code {refusal.code})")
    return args, None


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


def write_state(sweep_dir, runs):
    """sweep.jsonl: one line per run, its folder relative to the sweep's, so the file reads the same anywhere. Lines
    of other commands that used the same folder (another agent at another budget) are kept, in their place."""
    path = os.path.join(sweep_dir, "sweep.jsonl")
    lines = {os.path.relpath(run["folder"], sweep_dir): {
        "agent": run["agent"], "variant": run["variant"], "env_id": run["env_id"], "seed": run["seed"],
        "status": run["status"], "folder": os.path.relpath(run["folder"], sweep_dir), "command": run["command"]}
        for run in runs}
    lines = {**{line["folder"]: line for line in read_json_lines(path, SWEEP_LINE)}, **lines}
    write_text(path, "".join(json.dumps(line) + "\n" for line in lines.values()))


def slurm_parameters(args):
    """submitit's parameters for one run as one SLURM job."""
    return {"slurm_partition": args.partition, "gpus_per_node": args.gpus_per_run, "timeout_min": args.time,
            "mem_gb": args.mem, "cpus_per_task": args.cpus_per_run, "nodes": 1, "tasks_per_node": 1}


def make_executor(args, folder):
    if args.backend == "local":
        executor = submitit.LocalExecutor(folder)
        executor.update_parameters(timeout_min=args.time)
    else:
        executor = submitit.AutoExecutor(folder, cluster="slurm")
        executor.update_parameters(**slurm_parameters(args))
    return executor


def sweep(args, flags):
    runs = plan(args.agents, args.env_ids, args.seeds, flags, args.sweep_dir, args.variants)
    if not runs:
        raise SweepError("no run left to do: every combination was refused")
    make_folder(args.sweep_dir)
    for run in runs:
        make_folder(run["folder"])
        stop_orphaned_agent(run["folder"])
        if finished(run) or reuse_finished_twin(run, args.sweep_dir):
            run["status"] = "done"
    write_state(args.sweep_dir, runs)  # before any run starts: an unreadable sweep.jsonl stops the sweep here
    print(f"sweep in {args.sweep_dir}: {len(runs)} runs, "
          f"{sum(r['status'] == 'done' for r in runs)} already done", flush=True)
    executor = make_executor(args, os.path.join(args.sweep_dir, "submitit"))
    threads = args.threads if args.threads else (1 if args.backend == "local" else args.cpus_per_run)
    limit = args.workers if args.backend == "local" else len(runs)
    start = process_start(os.getpid())
    driver = {"pid": os.getpid(), "start": start} if args.backend == "local" and start is not None else None
    jobs, last_report = {}, 0.0
    while True:
        for i, job in list(jobs.items()):
            if job.done():
                try:
                    exit_code = job.result()
                except Exception:  # noqa: BLE001 - the job itself failed (killed, timed out): the run failed
                    exit_code = 1
                runs[i]["status"] = "done" if exit_code == 0 and finished(runs[i]) else "failed"
                del jobs[i]
        for i, run in enumerate(runs):
            if run["status"] == "pending" and len(jobs) < limit:
                remove_stale_runs(run["folder"])
                jobs[i] = executor.submit(run_job, command(run), run["folder"], threads, driver)
                run["status"] = "running"
        write_state(args.sweep_dir, runs)
        if not jobs:
            break
        if time.time() - last_report > args.progress_every:
            last_report = time.time()
            counts = {s: sum(r["status"] == s for r in runs) for s in ("done", "running", "failed", "pending")}
            latest = [f"{runs[i]['agent']}/{runs[i]['env_id']}/{runs[i]['seed']} "
                      f"{e[-1]['env_steps']:,} steps, coverage {e[-1]['coverage']}"
                      for i in jobs if (e := read_evals(runs[i]["folder"]))]
            print(" | ".join(f"{n} {s}" for s, n in counts.items()) + (": " + "; ".join(latest) if latest else ""),
                  flush=True)
        time.sleep(1)
    failed = [r for r in runs if r["status"] == "failed"]
    for run in failed:
        print(f"failed: {run['agent']}.py {' '.join(run['argv'])} (see {os.path.join(run['folder'], 'stdout.log')})")
    report(args.sweep_dir)
    return 1 if failed else 0


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
        if evals and evals[-1]["return_past10"] is not None:  # None until an evaluation after epoch 0
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
        cells = [agent, env_id, ", ".join(str(run["seed"]) for run, _ in members), f"{steps[-1]:,}",
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
            + "\n\nFinal evaluation (the last env-step count every seed reached); coverage is counted on the 48 "
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
    if args.backend == "slurm" and shutil.which("sbatch") is None:
        parser.error("--backend slurm needs SLURM's sbatch, which is not on PATH here")
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
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--variants", nargs="+", default=[""], help='more flags per variant of each agent, one string '
                        'each: --variants "--critic inner" "--critic mlp" (an ablation)')
    parser.add_argument("--sweep-dir", help="the sweep's folder (unset: benchmarks/sweeps/<a name made from the "
                                            "command>, so the same command finds its sweep again)")
    parser.add_argument("--report", metavar="SWEEP_DIR", help="only write the report of an existing sweep")
    parser.add_argument("--backend", choices=["local", "slurm"], default="local")
    parser.add_argument("--workers", type=at_least(1), default=os.cpu_count(), help="local: runs at once")
    parser.add_argument("--threads", type=at_least(1),
                        help="torch threads per run (unset: 1 locally, --cpus-per-run on SLURM)")
    parser.add_argument("--partition", help="slurm: the partition")
    parser.add_argument("--gpus-per-run", type=at_least(0), default=0, help="slurm: GPUs per job")
    parser.add_argument("--cpus-per-run", type=at_least(1), default=4, help="slurm: CPUs per job")
    parser.add_argument("--time", type=at_least(1), default=24 * 60,
                        help="minutes a run may take (slurm: the job's limit)")
    parser.add_argument("--mem", type=at_least(1), default=32, help="slurm: GB of memory per job")
    parser.add_argument("--progress-every", type=positive_seconds, default=60, help="seconds between progress lines")
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
