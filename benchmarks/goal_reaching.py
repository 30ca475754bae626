"""Zero-shot goal reaching on Ant: every agent's learning-benchmark checkpoints against untrained ones, one table.

    python benchmarks/goal_reaching.py                                # csf metra diayn visr, seeds 1 2, width 256
    python benchmarks/goal_reaching.py --agents csf metra --seeds 1

For each agent and seed: the last checkpoint of benchmarks/ant_learning.py's run (benchmarks/runs/<agent>_ant_<width>/
seed<S>/), and an untrained checkpoint of the same agent, seed and width (one epoch, no gradient step). goal_reaching.py
evaluates each on the same --num-goals goals (goal seed --goal-seed); the table (staying time within 3 and 1, hit
within 3, final distance, progress = distance at reset minus final distance) is printed and written to
benchmarks/results/goal_reaching_ant_<width>_<agents>_seed<seeds>.md.
"""

import argparse
import glob
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
COLUMNS = [("staying_time_3", "staying time, r = 3", ".3f"), ("staying_time_1", "staying time, r = 1", ".3f"),
           ("hit_3", "hit, r = 3", ".2f"), ("final_distance", "final distance", ".1f"), ("progress", "progress", ".1f")]


def untrained_checkpoint(agent, seed, width):
    """A checkpoint of the agent's networks at initialisation: one epoch of collection, no gradient step."""
    cwd = tempfile.mkdtemp(prefix=f"untrained_{agent}_")
    subprocess.run([sys.executable, os.path.join(ROOT, f"{agent}.py"), "--env-id", "Ant", "--seed", str(seed),
                    "--hidden-dim", str(width), "--total-env-steps", "1600", "--grad-steps-per-epoch", "0",
                    "--num-eval-skills", "1", "--no-cuda"], cwd=cwd, check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    (path,) = glob.glob(os.path.join(cwd, "runs", "*", "checkpoint.pt"))
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", nargs="+", default=["csf", "metra", "diayn", "visr"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="the learning benchmark's seeds")
    parser.add_argument("--hidden-dim", type=int, default=256)
    parser.add_argument("--num-goals", type=int, default=50)
    parser.add_argument("--goal-seed", type=int, default=0)
    args = parser.parse_args()
    import goal_reaching

    rows = ["| agent | seed | checkpoint | env steps | " + " | ".join(c[1] for c in COLUMNS) + " |",
            "|---|---|---|---|" + "---|" * len(COLUMNS)]
    for agent in args.agents:
        for seed in args.seeds:
            trained = glob.glob(os.path.join(ROOT, "benchmarks", "runs", f"{agent}_ant_{args.hidden_dim}",
                                             f"seed{seed}", "runs", "*", "checkpoint.pt"))
            if not trained:
                sys.exit(f"goal_reaching.py: error: no checkpoint of {agent} seed {seed}; run benchmarks/ant_learning.py "
                         f"--agent {agent} --seeds {seed} first")
            for label, path in (("untrained", untrained_checkpoint(agent, seed, args.hidden_dim)),
                                ("trained", trained[0])):
                report = goal_reaching.main(*goal_reaching.parse_args(
                    ["--checkpoint", path, "--num-goals", str(args.num_goals), "--seed", str(args.goal_seed),
                     "--no-cuda"]))
                for variant, result in report["results"].items():
                    what = label if len(report["results"]) == 1 else f"{label} ({variant})"
                    rows.append(f"| {agent} | {seed} | {what} | {report['env_steps']:,} | "
                                + " | ".join(format(result["mean"][key], f) for key, _, f in COLUMNS) + " |")
                    print(rows[-1], flush=True)
    command = "python benchmarks/goal_reaching.py " + " ".join(sys.argv[1:])
    out = os.path.join(ROOT, "benchmarks", "results", f"goal_reaching_ant_{args.hidden_dim}_{'_'.join(args.agents)}_seed"
                       f"{'_'.join(map(str, args.seeds))}.md")
    with open(out, "w") as f:
        f.write(f"# Zero-shot goal reaching on Ant, width {args.hidden_dim}\n\n`{command.strip()}`\n\n"
                f"{args.num_goals} goals (x, y) ~ U(-50, 50)², goal seed {args.goal_seed}, actions sampled from the "
                "policy, 200 steps per goal; means over the goals.\n\n" + "\n".join(rows) + "\n")
    print("\n".join(rows))
    print(f"written to {os.path.relpath(out, ROOT)}")


if __name__ == "__main__":
    main()
