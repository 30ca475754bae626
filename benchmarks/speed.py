"""Speed benchmark: where an epoch's time goes, and eager against --compile, for every agent and width.

    python benchmarks/speed.py                           # csf and metra on Ant, widths 256 and 1024 (about 15 min, 2 cores)
    python benchmarks/speed.py --baseline-rev 1a2b3c4    # also this checkout's eager path against that revision's (25 min)

Two tables, printed and written to benchmarks/results/speed_<cpu|gpu>_<agents>.md:
  1. Where the time of an eager epoch goes (torch profiler, one thread, nothing else running): collection, replay
     sampling, each step of the update, evaluation (at the paper's Ant period, one evaluation every 500 epochs), and
     the part of the epoch spent in matrix products.
  2. Pairs of runs side by side, one thread each, so that both see the same machine: this checkout's eager path
     against --compile (and against --baseline-rev's eager path). Each run is cut into short windows by its
     evaluations; the first window (first updates, any compilation) is dropped, and the table gives the medians
     over the others of ms per gradient step and of env steps per second end to end (evaluation excluded), with
     the range of the latter, the speed relative to the first run of its pair, and the projected wall time of the
     paper's Ant run (64M env steps, 2M gradient steps) at that speed. This machine is shared and its speed drifts
     by ±20% within minutes: compare ratios within a pair, and trust a ratio only well outside the ranges.
"""

import argparse
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PAPER_ENV_STEPS, STEPS_PER_EPOCH = 64_000_000, 8 * 200  # the paper's Ant run: 40k epochs of 8 × 200 steps
SECTIONS = ("collection", "sampling", "phi step", "model step", "psi step", "qf step", "actor step", "alpha step",
            "evaluation")
MATRIX_PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")  # what an update with the same maths cannot leave out
PAPER_EVAL_EVERY = 500  # epochs between evaluations on Ant
WINDOWS = 6  # measured windows per run


def device_name(cuda):
    if cuda:
        return torch.cuda.get_device_name()
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor() or "CPU")
    return f"{model}, {os.cpu_count()} cores"


def window_flags(width, eval_every):
    """Evaluations every k epochs, WINDOWS + 1 windows: the first holds the first updates (and any compilation), the
    others are measured. Learning starts after the first epoch."""
    return ["--env-id", "Ant", "--hidden-dim", str(width), "--eval-every", str(eval_every), "--learning-starts",
            str(STEPS_PER_EPOCH), "--total-env-steps", str((WINDOWS + 1) * eval_every * STEPS_PER_EPOCH),
            "--num-eval-skills", "8"]


def run_pair(runs, cuda):
    """Start every (label, script, flags) at once, one torch thread each; return each run's medians over its
    measured windows (the machine's load drifts, so a median of short windows beats one long mean)."""
    procs = []
    for label, script, flags in runs:
        cwd = tempfile.mkdtemp(prefix="speed_")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        command = [sys.executable, script, *flags, *([] if cuda else ["--no-cuda"])]
        procs.append((label, cwd, subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.PIPE, text=True)))
    results = []
    for label, cwd, proc in procs:
        _, stderr = proc.communicate()
        if proc.returncode != 0:
            sys.exit(f"speed.py: error: {label} failed: {stderr.strip().splitlines()[-1] if stderr.strip() else ''}")
        (path,) = glob.glob(os.path.join(cwd, "runs", "*", "eval.jsonl"))
        with open(path) as f:
            windows = [json.loads(line) for line in f][2:]  # every window after the first
        results.append({"run": label, "windows": len(windows),
                        "ms_per_grad_step": statistics.median(w["ms_per_grad_step"] for w in windows),
                        "sps": statistics.median(w["sps"] for w in windows),
                        "sps_range": (min(w["sps"] for w in windows), max(w["sps"] for w in windows))})
    return results


def profile_epoch(agent_name, width, cuda):
    """Seconds per epoch in each section of an eager run (after its first updates), by the agent's own
    record_function labels; evaluation is spread over PAPER_EVAL_EVERY epochs."""
    import importlib

    agent = importlib.import_module(agent_name)
    torch.set_num_threads(1)
    epochs = 4
    flags = ["--env-id", "Ant", "--hidden-dim", str(width), "--learning-starts", "0", "--eval-every", str(epochs),
             "--total-env-steps", str(epochs * STEPS_PER_EPOCH), *([] if cuda else ["--no-cuda"])]
    old = os.getcwd()
    os.chdir(tempfile.mkdtemp(prefix="profile_"))
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            agent.main(*agent.parse_args(flags))
    finally:
        os.chdir(old)
    totals = {event.key: event.cpu_time_total / 1e6 for event in prof.key_averages() if event.key in SECTIONS}
    per_epoch = {section: totals[section] / epochs for section in SECTIONS if section in totals}
    per_epoch["evaluation"] = totals["evaluation"] / 2 / PAPER_EVAL_EVERY  # 2 evaluations (epoch 0 and the end)
    matrix_products = sum(event.self_cpu_time_total for event in prof.key_averages() if event.key in MATRIX_PRODUCTS)
    return per_epoch, matrix_products / 1e6 / epochs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", nargs="+", default=["csf", "metra"], help="agent scripts to measure")
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 1024], help="--hidden-dim values")
    parser.add_argument("--baseline-rev", help="a git revision whose eager path runs beside this checkout's")
    parser.add_argument("--cuda", action="store_true", help="measure on the GPU instead (both runs of a pair share it)")
    args = parser.parse_args()
    if args.cuda and not torch.cuda.is_available():
        sys.exit("speed.py: error: --cuda, but torch sees no GPU")
    device = device_name(args.cuda)
    baseline_dir = None
    if args.baseline_rev:
        baseline_dir = tempfile.mkdtemp(prefix="baseline_")
        for file in ("envs.py", *(f"{agent}.py" for agent in args.agents)):
            with open(os.path.join(baseline_dir, file), "w") as f:
                f.write(subprocess.run(["git", "-C", ROOT, "show", f"{args.baseline_rev}:{file}"], check=True,
                                       capture_output=True, text=True).stdout)

    out = [f"# Speed on {device}", "", f"`python benchmarks/speed.py {' '.join(sys.argv[1:])}`".replace(" `", "`"), "",
           "## Where an eager epoch's time goes (seconds per epoch of 8 × 200 Ant steps, one thread)", "",
           "| agent | width | " + " | ".join(SECTIONS) + " | total | of which matrix products |",
           "|---|---|" + "---|" * (len(SECTIONS) + 2)]
    for agent in args.agents:
        for width in args.widths:
            started = time.time()
            shares, matrix_products = profile_epoch(agent, width, args.cuda)
            out.append(f"| {agent} | {width} | " + " | ".join(f"{shares[s]:.3f}" if s in shares else "–" for s in SECTIONS)
                       + f" | {sum(shares.values()):.2f} | {matrix_products:.2f} |")
            print(out[-1], f"({time.time() - started:.0f} s)", flush=True)
    out += ["", "Sections nest no other section; the update's four steps include their optimizer steps. Evaluation is "
            f"its cost spread over the {PAPER_EVAL_EVERY} epochs between two evaluations on Ant. Matrix products are "
            "the time inside every matrix product of the profiled epochs, most of it the update's.", "",
            "## Side by side, one thread each", "",
            f"Medians over {WINDOWS} windows (the first window, with the first updates and any compilation, is not "
            "counted); env steps/s end to end, evaluation excluded.", "",
            "| agent | width | run | window (env steps) | ms / grad step | env steps/s (min–max) | "
            "speed vs first of pair | paper Ant run (64M steps), projected h |", "|---|---|---|---|---|---|---|---|"]
    for agent in args.agents:
        script = os.path.join(ROOT, f"{agent}.py")
        for width in args.widths:
            eval_every = 4 if width <= 256 else 1
            flags = window_flags(width, eval_every)
            pairs = [[("eager", script, flags), ("--compile", script, [*flags, "--compile"])]]
            if baseline_dir:
                pairs.append([(f"eager at {args.baseline_rev}", os.path.join(baseline_dir, f"{agent}.py"), flags),
                              ("eager", script, flags)])
            for pair in pairs:
                results = run_pair(pair, args.cuda)
                for result in results:
                    low, high = result["sps_range"]
                    out.append(f"| {agent} | {width} | {result['run']} | {eval_every * STEPS_PER_EPOCH:,} | "
                               f"{result['ms_per_grad_step']:.1f} | {result['sps']:.0f} ({low:.0f}–{high:.0f}) | "
                               f"{result['sps'] / results[0]['sps']:.2f}× | {PAPER_ENV_STEPS / result['sps'] / 3600:.0f} |")
                    print(out[-1], flush=True)
    path = os.path.join(ROOT, "benchmarks", "results", f"speed_{'gpu' if args.cuda else 'cpu'}_{'_'.join(args.agents)}.md")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
