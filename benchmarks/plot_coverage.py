"""Coverage against env steps for the Ant learning benchmarks of several agents, one line per seed.

    python benchmarks/plot_coverage.py --agents csf metra diayn visr cic dads --hidden-dim 256

Reads the tables that benchmarks/ant_learning.py wrote to benchmarks/results/<agent>_ant_<width>.md (so the figure
needs only what is committed; each agent's curves end at its own budget) and writes
benchmarks/results/coverage_ant_<width>.png.
"""

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_table(path):
    """{seed: ([env steps], [coverage])} from the markdown table of an ant_learning.py result file."""
    with open(path) as f:
        lines = [line.strip() for line in f if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    seed_col, steps_col, coverage_col = (header.index(name) for name in ("seed", "env steps", "coverage"))
    curves = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        steps, coverage = curves.setdefault(cells[seed_col], ([], []))
        steps.append(int(cells[steps_col].replace(",", "")))
        coverage.append(int(cells[coverage_col]))
    return curves


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", nargs="+", default=["csf", "metra", "diayn", "visr", "cic", "dads"])
    parser.add_argument("--hidden-dim", type=int, default=256)
    args = parser.parse_args()
    fig, ax = plt.subplots(figsize=(7, 5))
    for color, agent in zip(("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"), args.agents):
        path = os.path.join(ROOT, "benchmarks", "results", f"{agent}_ant_{args.hidden_dim}.md")
        if not os.path.isfile(path):
            raise SystemExit(f"plot_coverage.py: error: no {os.path.relpath(path, ROOT)}; run benchmarks/ant_learning.py "
                             f"--agent {agent} first")
        for i, (seed, (steps, coverage)) in enumerate(read_table(path).items()):
            ax.plot([s / 1e6 for s in steps], coverage, color=color, alpha=0.9 if i == 0 else 0.55,
                    label=f"{agent} seed {seed}")
    ax.axhline(4, color="gray", lw=0.8, ls=":", label="untrained floor (4 cells)")
    ax.set_xlabel("env steps (millions)")
    ax.set_ylabel("coverage (distinct 1×1 cells, 48 rollouts)")
    ax.set_title(f"Ant, width {args.hidden_dim}")
    ax.set_yscale("log")
    ax.set_ylim(bottom=2)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.14))  # below the axes: hides no curve
    fig.tight_layout()
    out = os.path.join(ROOT, "benchmarks", "results", f"coverage_ant_{args.hidden_dim}.png")
    fig.savefig(out, dpi=100)
    print(f"written to {os.path.relpath(out, ROOT)}")


if __name__ == "__main__":
    main()
