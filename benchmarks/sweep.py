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
interrupted sweep (the machine rebooted, the job hit its time limit) is continued by repeating it. A run that a sibling
sweep (another folder of the same parent) has already finished with the same arguments, once parsed, is not run again:
its folder becomes a link to that run (the default variant that several ablation figures share, written `--xi 5` in
one and `--critic inner` in another). Several commands may share one --sweep-dir (one agent at another budget):
sweep.jsonl keeps every command's runs, and the report shows them all.

Backends, through submitit: `local` (default) runs --workers runs at once on this machine, one torch thread each
unless --threads says otherwise; `slurm` submits every run as its own job (--partition, --gpus-per-run, --time in
minutes, --mem in GB, --cpus-per-run). The agent scripts are the same on both.

The report (written at the end of every sweep, or alone with --report) reads every run's eval.jsonl and writes
SWEEP_DIR/report.md and report.png: coverage against env steps per agent and env (mean, min and max over seeds, the
paper's layout), the final-evaluation table, and, where they exist, goal_reaching.py's numbers (goal_reaching.json
next to a run's checkpoint) and hierarchical.py's (hierarchical runs started from a run's folder).
"""

import argparse
import glob
import hashlib
import importlib
import itertools
import json
import os
import re
import shlex
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


def run_job(command, cwd, threads):
    """What a submitit job does: run one agent command in its folder, its output to stdout.log; the exit code."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with open(os.path.join(cwd, "stdout.log"), "a") as log:
        return subprocess.run(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def plan(agents, env_ids, seeds, flags, sweep_dir, variants=("",)):
    """Every run of the sweep: its folder, command and budget (final env steps). A variant is a string of more flags
    (an ablation: "--critic mlp"). A combination the agent refuses is skipped with one line."""
    runs, refused = [], set()
    for agent_name, variant, env_id in itertools.product(agents, variants, env_ids):
        agent = importlib.import_module(agent_name)
        slug = re.sub(r"[^\w.]+", "-", variant).strip("-")  # "--critic mlp" -> "critic-mlp"
        label = f"{agent_name}_{slug}_{env_id}" if slug else f"{agent_name}_{env_id}"
        for seed in seeds:
            argv = ["--env-id", env_id, "--seed", str(seed), *shlex.split(variant), *flags]
            try:
                args, _ = agent.parse_args(argv)
            except SystemExit as refusal:
                if (label, str(refusal.code)) not in refused:  # one line per agent, variant, env and reason
                    refused.add((label, str(refusal.code)))
                    print(f"skipped {' '.join([agent_name, variant]).strip()} on {env_id}: {refusal.code}")
                continue
            steps_per_epoch = args.num_envs * envs.ENV_SPECS[env_id].horizon
            runs.append({"agent": agent_name, "variant": variant, "env_id": env_id, "seed": seed, "argv": argv,
                         "folder": os.path.join(sweep_dir, f"{label}_seed{seed}"),
                         "final_env_steps": args.total_env_steps // steps_per_epoch * steps_per_epoch,
                         "command": f"python {agent_name}.py {' '.join(argv)}", "args": args, "status": "pending"})
    return runs


def agent_run_files(folder, name):
    """The file `name` of the agent's run in `folder`: runs/<run_name>/name, not that of a hierarchical.py run
    started there (runs/<task>__hierarchical_...)."""
    return [p for p in glob.glob(os.path.join(folder, "runs", "*", name)) if "__hierarchical_" not in p]


def read_evals(folder):
    """The eval.jsonl lines of the agent run in `folder`, [] if there is none yet."""
    paths = agent_run_files(folder, "eval.jsonl")
    if not paths:
        return []
    with open(paths[0]) as f:
        return [json.loads(line) for line in f if line.strip()]


def finished(run):
    evals = read_evals(run["folder"])
    return bool(evals) and evals[-1]["env_steps"] >= run["final_env_steps"]


def command(run):
    """The run's command, with --resume when an earlier attempt left a checkpoint."""
    checkpoints = agent_run_files(run["folder"], "checkpoint.pt")
    return [sys.executable, os.path.join(ROOT, f"{run['agent']}.py"), *run["argv"],
            *(["--resume", checkpoints[0]] if checkpoints else [])]


def same_experiment(run, line):
    """Whether a line of another sweep runs the run's agent with the same arguments once parsed, so that
    `--critic inner` (the default written out) is the same experiment as no flag at all."""
    if line["agent"] != run["agent"]:
        return False
    try:
        other, _ = importlib.import_module(run["agent"]).parse_args(shlex.split(line["command"])[2:])
    except SystemExit:
        return False
    return other == run["args"]


def reuse_finished_twin(run, sweep_dir):
    """Link the run's folder to a finished run of the same experiment in a sibling sweep (the default variant that
    several ablation figures share, say), so that it is not run twice. True if it found one."""
    if read_evals(run["folder"]):
        return False
    for state in glob.glob(os.path.join(os.path.dirname(sweep_dir), "*", "sweep.jsonl")):
        other_dir = os.path.dirname(state)
        if other_dir == sweep_dir:
            continue
        with open(state) as f:
            for line in map(json.loads, f):
                twin = {**run, "folder": os.path.join(other_dir, line["folder"])}
                if not os.path.islink(twin["folder"]) and finished(twin) and same_experiment(run, line):
                    os.rmdir(run["folder"])
                    os.symlink(os.path.relpath(twin["folder"], sweep_dir), run["folder"])
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
    if os.path.isfile(path):
        with open(path) as f:
            lines = {**{line["folder"]: line for line in map(json.loads, f)}, **lines}
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines.values())
    os.replace(path + ".tmp", path)


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
        sys.exit("sweep.py: error: no run left to do: every combination was refused")
    for run in runs:
        os.makedirs(run["folder"], exist_ok=True)
        if finished(run) or reuse_finished_twin(run, args.sweep_dir):
            run["status"] = "done"
    print(f"sweep in {args.sweep_dir}: {len(runs)} runs, "
          f"{sum(r['status'] == 'done' for r in runs)} already done", flush=True)
    executor = make_executor(args, os.path.join(args.sweep_dir, "submitit"))
    threads = args.threads if args.threads else (1 if args.backend == "local" else args.cpus_per_run)
    limit = args.workers if args.backend == "local" else len(runs)
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
                jobs[i] = executor.submit(run_job, command(run), run["folder"], threads)
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
    """goal_reaching.py's staying time (r = 3) and final distance for the run in `folder`, and the last
    "return (past 10)" of every hierarchical run started there, by task."""
    found = {}
    for path in agent_run_files(folder, "goal_reaching.json"):
        with open(path) as f:
            mean = json.load(f)["results"]["adaptive"]["mean"]
        found["goal staying time"], found["goal final distance"] = mean["staying_time_3"], mean["final_distance"]
    for path in glob.glob(os.path.join(folder, "runs", "*__hierarchical_*", "eval.jsonl")):
        with open(path) as f:
            last = [json.loads(line) for line in f][-1]
        if last["return_past10"] is not None:  # None until an evaluation after epoch 0
            found[f"{os.path.basename(os.path.dirname(path)).split('__')[0]} return (past 10)"] = last["return_past10"]
    return found


def report(sweep_dir):
    """report.md and report.png of every run the sweep's sweep.jsonl lists."""
    with open(os.path.join(sweep_dir, "sweep.jsonl")) as f:
        runs = [{**run, "folder": os.path.join(sweep_dir, run["folder"])} for run in map(json.loads, f)]
    groups = {}
    for run in runs:
        evals = read_evals(run["folder"])
        if evals:
            name = f"{run['agent']} {run.get('variant', '')}".strip()
            groups.setdefault((name, run["env_id"]), []).append((run, evals))
    env_ids = sorted({env_id for _, env_id in groups})
    fig, axes = plt.subplots(1, max(len(env_ids), 1), figsize=(5 * max(len(env_ids), 1), 4), squeeze=False)
    extras = sorted({k for members in groups.values() for run, _ in members
                     for k in goal_and_hierarchical_results(run["folder"])})
    columns = ["agent", "env", "seeds", "env steps", "coverage, mean (min–max)", *extras]
    rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for (agent, env_id), members in groups.items():  # in sweep.jsonl's order: the command's --agents and --variants
        steps, mean, low, high = curves([evals for _, evals in members])
        ax = axes[0, env_ids.index(env_id)]
        line, = ax.plot(steps / 1e6, mean, label=agent)
        ax.fill_between(steps / 1e6, low, high, color=line.get_color(), alpha=0.2)
        results = [goal_and_hierarchical_results(run["folder"]) for run, _ in members]
        cells = [f"{np.mean([r[k] for r in results if k in r]):.3g}" if any(k in r for r in results) else "–"
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
    fig.savefig(os.path.join(sweep_dir, "report.png"), dpi=100)
    plt.close(fig)
    commands = sorted({run["command"] for run in runs})
    text = ("# Sweep report\n\nRuns:\n\n" + "\n".join(f"- `{c}`" for c in commands)
            + "\n\nFinal evaluation (the last env-step count every seed reached); coverage is counted on the 48 "
            "deterministic evaluation rollouts.\n\n" + "\n".join(rows) + "\n\n![coverage](report.png)\n")
    with open(os.path.join(sweep_dir, "report.md"), "w") as f:
        f.write(text)
    print("\n".join(rows))
    print(f"written to {os.path.join(sweep_dir, 'report.md')} and report.png")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", nargs="+", default=["csf", "metra"], help="agent scripts: csf metra diayn visr")
    parser.add_argument("--env-ids", nargs="+", default=["Ant"], help="envs of envs.py")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--variants", nargs="+", default=[""], help='more flags per variant of each agent, one string '
                        'each: --variants "--critic inner" "--critic mlp" (an ablation)')
    parser.add_argument("--sweep-dir", help="the sweep's folder (unset: benchmarks/sweeps/<a name made from the "
                                            "command>, so the same command finds its sweep again)")
    parser.add_argument("--report", metavar="SWEEP_DIR", help="only write the report of an existing sweep")
    parser.add_argument("--backend", choices=["local", "slurm"], default="local")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="local: runs at once")
    parser.add_argument("--threads", type=int, help="torch threads per run (unset: 1 locally, --cpus-per-run on SLURM)")
    parser.add_argument("--partition", help="slurm: the partition")
    parser.add_argument("--gpus-per-run", type=int, default=0, help="slurm: GPUs per job")
    parser.add_argument("--cpus-per-run", type=int, default=4, help="slurm: CPUs per job")
    parser.add_argument("--time", type=int, default=24 * 60, help="minutes a run may take (slurm: the job's limit)")
    parser.add_argument("--mem", type=int, default=32, help="slurm: GB of memory per job")
    parser.add_argument("--progress-every", type=float, default=60, help="seconds between progress lines")
    args = parser.parse_args(argv)
    if args.report:
        if not os.path.isfile(os.path.join(args.report, "sweep.jsonl")):
            sys.exit(f"sweep.py: error: {args.report} is not a sweep folder (it has no sweep.jsonl)")
        report(args.report)
        return 0
    if args.workers < 1:
        sys.exit(f"sweep.py: error: --workers must be at least 1, got {args.workers}")
    if args.sweep_dir is None:
        key = json.dumps([sorted(args.agents), sorted(args.env_ids), sorted(args.seeds), args.variants, flags])
        args.sweep_dir = os.path.join(ROOT, "benchmarks", "sweeps", hashlib.sha1(key.encode()).hexdigest()[:10])
    args.sweep_dir = os.path.abspath(args.sweep_dir)
    os.makedirs(args.sweep_dir, exist_ok=True)
    return sweep(args, flags)


if __name__ == "__main__":
    sys.exit(main())
