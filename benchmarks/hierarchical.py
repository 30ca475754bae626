"""Hierarchical control benchmark: a high-level policy over trained skills against the same over untrained skills.

    python benchmarks/hierarchical.py --child benchmarks/sweeps/ant_256/csf_Ant_seed1 --task AntMultiGoal \\
        --total-env-steps 1600000 -- --hidden-dim 256

The untrained child is the same agent at the same width and seed after one epoch without a gradient step. Both
hierarchical.py runs go side by side, one torch thread each, with the same flags (those after `--`). The table
(return and "Return (past 10)" at every evaluation, both runs) is printed and written with a plot of the returns
against low-level env steps to benchmarks/results/hierarchical_<task>_<agent>.{md,png}.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HORIZON = 200  # the horizon of every base world of the tasks


def newest_checkpoint(path):
    """The checkpoint named by `path`, or the newest one under the run folder `path`."""
    if os.path.isfile(path):
        return path
    found = glob.glob(os.path.join(path, "**", "checkpoint.pt"), recursive=True)
    if not found:
        sys.exit(f"hierarchical.py: error: no checkpoint under {path}")
    return max(found, key=os.path.getmtime)


def untrained_child(trained):
    """A checkpoint of the trained child's agent, env, width and seed after one epoch with no gradient step."""
    args = trained["args"]
    cwd = tempfile.mkdtemp(prefix="untrained_child_")
    steps = args["num_envs"] * HORIZON
    subprocess.run([sys.executable, os.path.join(ROOT, f"{trained['agent']}.py"), "--env-id", args["env_id"],
                    "--seed", str(args["seed"]), "--hidden-dim", str(args["hidden_dim"]), "--skill-dim",
                    str(args["skill_dim"]), "--total-env-steps", str(steps), "--num-envs", str(args["num_envs"]),
                    "--grad-steps-per-epoch", "0", "--num-eval-skills", "1", "--no-cuda"], cwd=cwd, check=True,
                   capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return glob.glob(os.path.join(cwd, "runs", "*", "checkpoint.pt"))[0]


def main():
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", required=True, help="the trained child's checkpoint, or a folder holding it")
    parser.add_argument("--task", default="AntMultiGoal")
    parser.add_argument("--total-env-steps", type=int, default=1_600_000, help="low-level env steps per run")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    trained_path = os.path.abspath(newest_checkpoint(args.child))
    trained = torch.load(trained_path, map_location="cpu", weights_only=False)
    children = {"trained": trained_path, "untrained": untrained_child(trained)}
    procs, folders = {}, {}
    for label, child in children.items():
        folders[label] = tempfile.mkdtemp(prefix=f"hierarchical_{label}_")
        command = [sys.executable, os.path.join(ROOT, "hierarchical.py"), "--checkpoint", child, "--task", args.task,
                   "--seed", str(args.seed), "--total-env-steps", str(args.total_env_steps), "--no-cuda", *flags]
        print("running:", " ".join(command[1:]), flush=True)
        procs[label] = subprocess.Popen(command, cwd=folders[label], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    evals = {}
    for label, proc in procs.items():
        _, stderr = proc.communicate()
        if proc.returncode != 0:
            sys.exit(f"hierarchical.py: error: the {label} run failed: {stderr.strip().splitlines()[-1:]}")
        (path,) = glob.glob(os.path.join(folders[label], "runs", "*", "eval.jsonl"))
        with open(path) as f:
            evals[label] = [json.loads(line) for line in f]
    env_steps = trained["epoch"] * trained["args"]["num_envs"] * HORIZON
    rows = ["| env steps | return, trained child | return, untrained child | past 10, trained | past 10, untrained |",
            "|---|---|---|---|---|"]

    def past(e):  # None at epoch 0, before any trained evaluation
        return "–" if e["return_past10"] is None else f"{e['return_past10']:.1f}"

    for a, b in zip(evals["trained"], evals["untrained"]):
        rows.append(f"| {a['env_steps']:,} | {a['return']:.1f} | {b['return']:.1f} | {past(a)} | {past(b)} |")
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, lines in evals.items():
        lines = [e for e in lines if e["return_past10"] is not None]  # epoch 0 has no trained evaluation to average
        ax.plot([e["env_steps"] / 1e6 for e in lines], [e["return_past10"] for e in lines], label=f"{label} child")
    ax.set_xlabel("low-level env steps (millions)")
    ax.set_ylabel("return (mean of the last 10 evaluations)")
    ax.set_title(f"{args.task} over {trained['agent']} skills ({env_steps:,} env steps) and untrained ones", fontsize=9)
    ax.legend()
    fig.tight_layout()
    stem = os.path.join(ROOT, "benchmarks", "results", f"hierarchical_{args.task}_{trained['agent']}")
    fig.savefig(stem + ".png", dpi=100)
    command = "python benchmarks/hierarchical.py " + " ".join(sys.argv[1:])
    with open(stem + ".md", "w") as f:
        f.write(f"# {args.task} over {trained['agent']} skills\n\n`{command}`\n\nThe trained child: "
                f"{os.path.relpath(trained_path, ROOT)} ({env_steps:,} env steps, width {trained['args']['hidden_dim']}"
                f"); the untrained child: the same agent, width and seed after one epoch without a gradient step.\n\n"
                + "\n".join(rows) + "\n")
    print("\n".join(rows))
    print(f"written to {stem}.md and .png")


if __name__ == "__main__":
    main()
