"""Learning benchmark: one agent on Ant, several seeds side by side (one torch thread each), one table.

    python benchmarks/ant_learning.py --agent csf --total-env-steps 3000000 --seeds 1 2   # about an hour on 2 cores
    python benchmarks/ant_learning.py --agent csf --total-env-steps 3000000 --seeds 1 2 --report-only

Each seed runs in benchmarks/runs/<agent>_ant_<width>/seed<S>/ (its runs/ folder and stdout log). The table
(one row per evaluation of every seed: env steps, wall time, SPS, ms per gradient step, coverage, E‖Δφ‖², and
the agent's own diagnostics such as the logsumexp term, α or λ, peak RSS) is printed and written to
benchmarks/results/<agent>_ant_<width>.md; the take-off criterion (coverage ≥ 50 cells at two consecutive
evaluations) is checked per seed at the end. --report-only rebuilds the table from finished runs.

Every run checkpoints at every evaluation. Running this script again starts its seeds afresh; to continue an
interrupted seed instead, resume its run in its folder, then rebuild the table:

    cd benchmarks/runs/csf_ant_256/seed2 && python ../../../../csf.py --resume runs/<run_name>/checkpoint.pt

The same table for seeds that benchmarks/sweep.py ran (in SWEEP_DIR/<agent>_Ant_seed<S>/):

    python benchmarks/ant_learning.py --agent cic --seeds 1 2 --report-only --sweep-dir benchmarks/sweeps/ant_256
"""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (eval.jsonl key, column title, format); a column appears when some evaluation has the key
COLUMNS = [("env_steps", "env steps", ","), ("wall_time", "wall time (s)", ".0f"), ("sps", "SPS", ".0f"),
           ("ms_per_grad_step", "ms / grad step", ".1f"), ("coverage", "coverage", "d"), ("dphi_sq", "E‖Δφ‖²", ".2e"),
           ("logsumexp", "logsumexp", ".3f"), ("lambda", "λ", ".3g"), ("constraint", "constraint", ".3g"),
           ("disc_accuracy", "discriminator accuracy", ".3f"), ("score", "ê(s)ᵀz", ".3f"), ("cpc_loss", "CPC loss", ".3f"),
           ("knn_reward", "kNN reward", ".3f"), ("log_likelihood", "model log-likelihood", ".2f"), ("reward", "reward", ".3g"),
           ("alpha", "α", ".2e"), ("peak_rss_mb", "peak RSS (MB)", ".0f")]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agent", default="csf", help="the agent script to run: csf, metra, diayn, visr, cic, dads")
    parser.add_argument("--total-env-steps", type=int, default=3_000_000, help="budget per seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="seeds, run side by side")
    parser.add_argument("--hidden-dim", type=int, default=256, help="network width (the paper's is 1024)")
    parser.add_argument("--eval-every", type=int, default=50, help="epochs between evaluations (80k env steps)")
    parser.add_argument("--agent-args", default="", help="more flags for the agent, e.g. '--save-repr-stats'")
    parser.add_argument("--report-only", action="store_true", help="only rebuild the table from finished runs")
    parser.add_argument("--sweep-dir", help="with --report-only: take the seeds' runs from this benchmarks/sweep.py folder")
    args = parser.parse_args()
    if args.sweep_dir and not args.report_only:
        parser.error("--sweep-dir only goes with --report-only (benchmarks/sweep.py runs the seeds of a sweep)")
    out_dir = os.path.join(ROOT, "benchmarks", "runs", f"{args.agent}_ant_{args.hidden_dim}")
    seed_dirs = {seed: os.path.join(args.sweep_dir, f"{args.agent}_Ant_seed{seed}") if args.sweep_dir
                 else os.path.join(out_dir, f"seed{seed}") for seed in args.seeds}

    if not args.report_only:
        procs = []
        for seed in args.seeds:
            seed_dir = seed_dirs[seed]
            shutil.rmtree(seed_dir, ignore_errors=True)
            os.makedirs(seed_dir)
            cmd = [sys.executable, os.path.join(ROOT, f"{args.agent}.py"), "--env-id", "Ant", "--seed", str(seed),
                   "--total-env-steps", str(args.total_env_steps), "--hidden-dim", str(args.hidden_dim),
                   "--eval-every", str(args.eval_every), "--checkpoint-every", str(args.eval_every), "--no-cuda", *args.agent_args.split()]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            log = open(os.path.join(seed_dir, "stdout.log"), "w")
            print("running:", " ".join(cmd[1:]), f"(in {os.path.relpath(seed_dir, ROOT)})", flush=True)
            procs.append(subprocess.Popen(cmd, cwd=seed_dir, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait() for p in procs]
        if any(codes):
            sys.exit(f"a run failed (exit codes {codes}); see {out_dir}/seed*/stdout.log")

    runs = {}
    for seed in args.seeds:
        files = glob.glob(os.path.join(seed_dirs[seed], "runs", "*", "eval.jsonl"))
        if not files:
            sys.exit(f"no eval.jsonl for seed {seed} under {seed_dirs[seed]}")
        runs[seed] = [json.loads(line) for line in open(files[0])]
    present = {key for evals in runs.values() for e in evals for key in e}
    columns = [c for c in COLUMNS if c[0] in present]
    rows = ["| seed | " + " | ".join(c[1] for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    verdicts = []
    for seed, evals in runs.items():
        for e in evals:
            rows.append(f"| {seed} | " + " | ".join(format(e[k], f) if k in e else "–" for k, _, f in columns) + " |")
        takeoff = next((b["env_steps"] for a, b in zip(evals, evals[1:]) if a["coverage"] >= 50 and b["coverage"] >= 50), None)
        verdicts.append(f"seed {seed}: " + (f"coverage ≥ 50 at two consecutive evaluations by {takeoff:,} env steps"
                                            if takeoff else "no take-off (coverage never ≥ 50 twice in a row)"))
    table = "\n".join(rows + [""] + verdicts)
    command = (f"python benchmarks/ant_learning.py --agent {args.agent} --total-env-steps {args.total_env_steps} --seeds "
               f"{' '.join(map(str, args.seeds))} --hidden-dim {args.hidden_dim} --eval-every {args.eval_every}"
               + (f" --agent-args='{args.agent_args}'" if args.agent_args else ""))
    source = f"`{command}`"
    if args.sweep_dir:  # the runs' own commands, as the sweep recorded them
        with open(os.path.join(args.sweep_dir, "sweep.jsonl")) as f:
            commands = [run["command"] for run in map(json.loads, f) if run["agent"] == args.agent
                        and run["env_id"] == "Ant" and run["seed"] in args.seeds and not run.get("variant")]
        sweep_dir = os.path.relpath(os.path.abspath(args.sweep_dir), ROOT)
        source = (", ".join(f"`{c}`" for c in commands) + f", run by `benchmarks/sweep.py` in `{sweep_dir}`; table: "
                  f"`{command} --report-only --sweep-dir {sweep_dir}`")
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    result_file = os.path.join(ROOT, "benchmarks", "results", f"{args.agent}_ant_{args.hidden_dim}.md")
    with open(result_file, "w") as f:
        f.write(f"# {args.agent} on Ant, width {args.hidden_dim}\n\n{source}\n\n{table}\n")
    print(table)
    print(f"\nwritten to {os.path.relpath(result_file, ROOT)}")


if __name__ == "__main__":
    main()
