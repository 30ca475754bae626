"""A short csf.py run on a manipulation world (Kitchen or Robobin) from pixels, sized for a CPU: the world's
coverage at every evaluation, one table.

    python benchmarks/manipulation_short.py --env-id Kitchen   # about an hour on one CPU core
    python benchmarks/manipulation_short.py --env-id Robobin   # about an hour and a half on one CPU core
    python benchmarks/manipulation_short.py --env-id Kitchen --report-only   # rebuild the table from the finished run

The run works in benchmarks/runs/csf_<world>/ (its runs/ folder and stdout log), with the paper's settings for
the world except what about an hour of a CPU core allows: width 256 (paper 1024), batch 64 (256), 5 gradient steps per epoch
(100), learning from 2,000 transitions, 16 evaluation rollouts, and the budget and evaluation period below
(paper 4.8M env steps). Coverage: Kitchen, how many of its 6 tasks some evaluation rollout achieved; Robobin,
the number of distinct (hand, block, block) positions on a 1 cm grid that the evaluation rollouts visited. The
table is printed and written to benchmarks/results/csf_<world>_short.md.
"""

import argparse
import glob
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["--hidden-dim", "256", "--batch-size", "64", "--grad-steps-per-epoch", "5", "--learning-starts", "2000",
          "--num-eval-skills", "16", "--no-cuda"]
# Kitchen: epochs of 8 × 50 env steps, 140 of them; Robobin: epochs of 10 × 200 env steps, 100 of them
BUDGETS = {"Kitchen": ["--eval-every", "20", "--total-env-steps", "56000"],
           "Robobin": ["--eval-every", "10", "--total-env-steps", "200000"]}
COVERAGE = {"Kitchen": "tasks achieved (of 6)", "Robobin": "distinct states (1 cm)"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env-id", choices=sorted(BUDGETS), required=True, help="the manipulation world")
    parser.add_argument("--report-only", action="store_true", help="only rebuild the table from the finished run")
    args = parser.parse_args()
    flags = ["--env-id", args.env_id, *COMMON, *BUDGETS[args.env_id]]
    run_dir = os.path.join(ROOT, "benchmarks", "runs", f"csf_{args.env_id.lower()}")
    if not args.report_only:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "stdout.log"), "w") as log:
            subprocess.run([sys.executable, os.path.join(ROOT, "csf.py"), *flags], cwd=run_dir, stdout=log,
                           stderr=subprocess.STDOUT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    files = sorted(glob.glob(os.path.join(run_dir, "runs", "*", "eval.jsonl")), key=os.path.getmtime)
    if not files:
        sys.exit(f"manipulation_short.py: error: no eval.jsonl under {os.path.relpath(run_dir, ROOT)}; run it first")
    evals = [json.loads(line) for line in open(files[-1])]
    rows = [f"| env steps | gradient steps | wall time (s) | {COVERAGE[args.env_id]} | E‖Δφ‖² | logsumexp | α | "
            "ms / grad step | SPS | peak RSS (MB) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in evals:
        rows.append(f"| {e['env_steps']:,} | {e['grad_steps']:,} | {e['wall_time']:.0f} | {e['coverage']:,} | "
                    + " | ".join(format(e[k], f) if k in e else "–" for k, f in
                                 (("dphi_sq", ".2e"), ("logsumexp", ".3f"), ("alpha", ".2e"),
                                  ("ms_per_grad_step", ".0f"), ("sps", ".0f"), ("peak_rss_mb", ",.0f"))) + " |")
    table = "\n".join(rows)
    out = os.path.join(ROOT, "benchmarks", "results", f"csf_{args.env_id}_short.md")
    with open(out, "w") as f:
        f.write(f"# csf.py on {args.env_id}, a short CPU run\n\n`python benchmarks/manipulation_short.py --env-id "
                f"{args.env_id}`, i.e. `python csf.py {' '.join(flags)}`\n\n{table}\n")
    print(table)
    print(f"written to {os.path.relpath(out, ROOT)}")


if __name__ == "__main__":
    main()
