"""Coverage against env steps for the Ant learning benchmarks of several agents, one line per seed.

    python benchmarks/plot_coverage.py --agents csf metra --hidden-dim 256

Reads benchmarks/runs/<agent>_ant_<width>/seed*/runs/*/eval.jsonl (written by benchmarks/ant_learning.py)
and writes benchmarks/results/coverage_ant_<width>.png.
"""

import argparse
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", nargs="+", default=["csf", "metra"])
    parser.add_argument("--hidden-dim", type=int, default=256)
    args = parser.parse_args()
    fig, ax = plt.subplots(figsize=(7, 4))
    for color, agent in zip(("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"), args.agents):
        pattern = os.path.join(ROOT, "benchmarks", "runs", f"{agent}_ant_{args.hidden_dim}", "seed*", "runs", "*", "eval.jsonl")
        for i, path in enumerate(sorted(glob.glob(pattern))):
            evals = [json.loads(line) for line in open(path)]
            seed = path.split(os.sep)[-4]
            ax.plot([e["env_steps"] / 1e6 for e in evals], [e["coverage"] for e in evals], color=color,
                    alpha=0.9 if i == 0 else 0.55, label=f"{agent} {seed}")
    ax.axhline(4, color="gray", lw=0.8, ls=":", label="untrained floor (4 cells)")
    ax.set_xlabel("env steps (millions)")
    ax.set_ylabel("coverage (distinct 1×1 cells, 48 rollouts)")
    ax.set_title(f"Ant, width {args.hidden_dim}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = os.path.join(ROOT, "benchmarks", "results", f"coverage_ant_{args.hidden_dim}.png")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"written to {os.path.relpath(out, ROOT)}")


if __name__ == "__main__":
    main()
