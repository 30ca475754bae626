"""A short csf.py run on Kitchen from pixels, sized for a CPU: task coverage at every evaluation, one table.

    python benchmarks/kitchen_short.py                 # about an hour on one CPU core
    python benchmarks/kitchen_short.py --report-only   # rebuild the table from the finished run

The run works in benchmarks/runs/csf_kitchen/ (its runs/ folder and stdout log), with the paper's Kitchen settings
except what a CPU hour allows: width 256 (paper 1024), batch 64 (256), 5 gradient steps per epoch (100), learning
from 2,000 transitions, 16 evaluation rollouts every 20 epochs, 56,000 env steps (paper 4.8M). Coverage is the
number of Kitchen's 6 tasks that some evaluation rollout achieved. The table is printed and written to
benchmarks/results/csf_kitchen_short.md.
"""

import argparse
import glob
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--env-id", "Kitchen", "--hidden-dim", "256", "--batch-size", "64", "--grad-steps-per-epoch", "5",
         "--learning-starts", "2000", "--num-eval-skills", "16", "--eval-every", "20", "--total-env-steps", "56000",
         "--no-cuda"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report-only", action="store_true", help="only rebuild the table from the finished run")
    args = parser.parse_args()
    run_dir = os.path.join(ROOT, "benchmarks", "runs", "csf_kitchen")
    if not args.report_only:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "stdout.log"), "w") as log:
            subprocess.run([sys.executable, os.path.join(ROOT, "csf.py"), *FLAGS], cwd=run_dir, stdout=log,
                           stderr=subprocess.STDOUT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    files = sorted(glob.glob(os.path.join(run_dir, "runs", "*", "eval.jsonl")), key=os.path.getmtime)
    if not files:
        sys.exit(f"kitchen_short.py: error: no eval.jsonl under {os.path.relpath(run_dir, ROOT)}; run it first")
    evals = [json.loads(line) for line in open(files[-1])]
    rows = ["| env steps | gradient steps | wall time (s) | tasks achieved (of 6) | E‖Δφ‖² | logsumexp | α | "
            "ms / grad step | SPS | peak RSS (MB) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in evals:
        rows.append(f"| {e['env_steps']:,} | {e['grad_steps']:,} | {e['wall_time']:.0f} | {e['coverage']} | "
                    + " | ".join(format(e[k], f) if k in e else "–" for k, f in
                                 (("dphi_sq", ".2e"), ("logsumexp", ".3f"), ("alpha", ".2e"),
                                  ("ms_per_grad_step", ".0f"), ("sps", ".0f"), ("peak_rss_mb", ",.0f"))) + " |")
    table = "\n".join(rows)
    out = os.path.join(ROOT, "benchmarks", "results", "csf_kitchen_short.md")
    with open(out, "w") as f:
        f.write(f"# csf.py on Kitchen, a short CPU run\n\n`python benchmarks/kitchen_short.py`, i.e. "
                f"`python csf.py {' '.join(FLAGS)}`\n\n{table}\n")
    print(table)
    print(f"written to {os.path.relpath(out, ROOT)}")


if __name__ == "__main__":
    main()
