"""GPU speed: every agent on Ant and csf.py on Humanoid pixels, the default path against the fast path.

    python benchmarks/gpu_speed.py                # on one GPU: about 6 minutes on an H100 after its warm-up
    python benchmarks/gpu_speed.py --smoke        # tiny widths and budgets, on whatever device: checks the plumbing

Each row is one real run of the script at the paper's settings for the env (width 1024, 8 trajectories of 200 steps
and 50 (Ant) or 200 (Humanoid) gradient steps an epoch, batch 256), one run on the machine at a time, cut into
windows of one epoch by its evaluations (8 rollouts each, left out of the speed). The first window (the first gradient steps,
cuDNN's autotuning, any compilation and the CUDA graph's capture) is dropped; the table gives the medians over the
others of ms per gradient step and of env steps per second end to end (collection, replay sampling and gradient
steps; evaluation excluded), and the paper's run projected at that speed (Ant 64M env steps, Humanoid 4.8M).

The fast path: --cudagraphs (the whole gradient step replayed as one CUDA graph) with --buffer-on-device (batches
drawn on the GPU), and for csf.py also with --compile (the whole step compiled into fused kernels). Every row
collects in parallel worker processes (the default) unless it says --no-parallel-envs.

Prints one table and writes it to benchmarks/results/gpu_speed_<card>.md, row by row (a row that fails says so and
the others still run; a row still running after --timeout seconds is stopped and gives the windows it finished).
benchmarks/gpu_check.py runs these rows too, inside its time budget.
"""

import argparse
import glob
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_ENV_STEPS = {"Ant": 64_000_000, "Humanoid": 4_800_000}
STEPS_PER_EPOCH = 8 * 200
WINDOWS = 3  # measured windows of one epoch each, after the dropped first one
FAST = "--cudagraphs --buffer-on-device"
ROWS = [  # (script, env, flags); the first row of each env is the baseline of its "vs" column
    ("csf", "Ant", "--no-parallel-envs"), ("csf", "Ant", ""), ("csf", "Ant", FAST),
    *[(agent, "Ant", flags) for agent in ("metra", "diayn", "visr", "cic", "dads") for flags in ("", FAST)],
    ("csf", "Humanoid", "--no-parallel-envs"), ("csf", "Humanoid", ""), ("csf", "Humanoid", FAST),
    ("csf", "Humanoid", f"--bf16 {FAST}"),
    ("csf", "Ant", f"--compile {FAST}"), ("csf", "Humanoid", f"--compile {FAST}"),  # the compilations take minutes
]


def device_name():
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor() or "CPU")
    return f"{model}, {os.cpu_count()} cores"


def run_flags(env_id, smoke, windows=WINDOWS):
    """The flags of one measured run: learning starts after the first epoch, an evaluation after every epoch."""
    flags = ["--env-id", env_id, "--learning-starts", str(STEPS_PER_EPOCH), "--eval-every", "1",
             "--checkpoint-every", str(10**9), "--num-eval-skills", "8",
             "--total-env-steps", str((windows + 1) * STEPS_PER_EPOCH)]
    if smoke:  # tiny: the plumbing only
        flags += ["--hidden-dim", "16", "--batch-size", "16", "--grad-steps-per-epoch", "4", "--buffer-size",
                  str(4 * STEPS_PER_EPOCH)]
    return flags


def measure(script, env_id, extra, smoke, timeout, windows=WINDOWS):
    """Run one row, stopped after `timeout` seconds; return its medians over the measured windows it finished (all
    `windows` of them, unless stopped) and the seconds of one evaluation, or the reason it failed."""
    cwd = tempfile.mkdtemp(prefix="gpu_speed_")
    command = [sys.executable, os.path.join(ROOT, f"{script}.py"), *run_flags(env_id, smoke, windows), *extra.split()]
    started = time.time()
    stopped = False
    with open(os.path.join(cwd, "stdout.txt"), "w") as stdout, open(os.path.join(cwd, "stderr.txt"), "w") as stderr:
        # a session of its own: stopping it stops its env workers too
        proc = subprocess.Popen(command, cwd=cwd, stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stopped = True
        finally:  # stopped at the timeout, or by Ctrl-C here
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall = time.time() - started
    if not stopped and proc.returncode != 0:
        with open(os.path.join(cwd, "stderr.txt")) as f:
            lines = f.read().strip().splitlines()
        return {"failed": lines[-1][:200] if lines else f"exit {proc.returncode}"}
    evals = []
    for path in glob.glob(os.path.join(cwd, "runs", "*", "eval.jsonl")):  # written whole at each evaluation
        with open(path) as f:
            evals = [json.loads(line) for line in f]
    windows = evals[2:]  # each evaluation reports the window before it; the first window is dropped
    if not windows:
        return {"failed": f"stopped after {timeout:.0f} s, before a measured window"}
    # an epoch's wall time holds its evaluation and its window: what the window's speed leaves is the evaluation's
    evaluations = [later["wall_time"] - earlier["wall_time"] - STEPS_PER_EPOCH / later["sps"]
                   for earlier, later in zip(evals[1:], windows)]
    return {"ms": statistics.median(w["ms_per_grad_step"] for w in windows),
            "sps": statistics.median(w["sps"] for w in windows),
            "sps_range": (min(w["sps"] for w in windows), max(w["sps"] for w in windows)),
            "eval_s": statistics.median(evaluations), "windows": len(windows), "stopped": stopped, "wall": wall}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny widths and budgets: check the plumbing anywhere")
    parser.add_argument("--only", default="", help="a regular expression: only the rows whose 'script env flags' "
                                                   "match it")
    parser.add_argument("--timeout", type=int, default=200,
                        help="seconds before a row is stopped (its finished windows count)")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("gpu_speed.py: error: torch sees no GPU here; --smoke runs the tiny version on any device")
    card = device_name()
    rows = [row for row in ROWS if re.search(args.only, " ".join(row))]
    name = ("smoke" if args.smoke else re.sub(r"[^A-Za-z0-9]+", "_", card).strip("_")) + ("_part" if args.only else "")
    path = os.path.join(ROOT, "benchmarks", "results", f"gpu_speed_{name}.md")
    out = [f"# GPU speed on {card}, torch {torch.__version__}", "",
           f"`python benchmarks/gpu_speed.py {' '.join(sys.argv[1:])}`".replace(" `", "`"), "",
           f"Width 1024, batch 256, the paper's epochs; medians over {WINDOWS} windows after the first; env steps/s end "
           "to end, evaluation excluded.", "",
           "| script | env | flags | ms / gradient step | env steps/s (min–max) | vs `--no-parallel-envs` | "
           "the paper's run, projected h | wall s |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(out), flush=True)
    baseline = {}  # env: env steps/s of its first row, if measured here
    for script, env_id, flags in rows:
        result = measure(script, env_id, flags, args.smoke, args.timeout)
        label = f"`{flags}`" if flags else "(default)"
        if "failed" in result:
            out.append(f"| {script} | {env_id} | {label} | failed: {result['failed'].replace('|', '/')} | | | | |")
        else:
            if (script, env_id, flags) == next(row for row in ROWS if row[1] == env_id):
                baseline[env_id] = result["sps"]
            low, high = result["sps_range"]
            ratio = f"{result['sps'] / baseline[env_id]:.2f}×" if env_id in baseline else "–"
            stopped = f" (stopped: {result['windows']} windows)" if result["stopped"] else ""
            out.append(f"| {script} | {env_id} | {label} | {result['ms']:.2f} | {result['sps']:,.0f} "
                       f"({low:,.0f}–{high:,.0f}) | {ratio} | "
                       f"{PAPER_ENV_STEPS[env_id] / result['sps'] / 3600:.1f} | {result['wall']:.0f}{stopped} |")
        print(out[-1], flush=True)
        with open(path, "w") as f:
            f.write("\n".join(out) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
