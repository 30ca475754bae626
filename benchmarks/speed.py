"""Speed benchmark: where an epoch's time goes, and eager against --compile, for every agent and width.

    python benchmarks/speed.py                           # csf and metra on Ant, widths 256 and 1024 (about 15 min, 2 cores)
    python benchmarks/speed.py --baseline-rev 1a2b3c4    # also this checkout's eager path against that revision's (25 min)

Three tables, printed and written to benchmarks/results/speed_<cpu|gpu>_<agents>.md:
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
  3. The host's part of a gradient step (benchmarks/step_profile.py), with the replay buffer in host memory and
     with --buffer-on-device: the host's ms in sampling (draw, gather, transfers, the launch of the stacking), of
     which the gather, its ms in the update's sections, and the waits for the device per step. On a GPU the waits
     are the CUDA runtime's synchronizing calls and the device's kernel time is added; on a CPU the waits are
     counted on tests/test_host_syncs.py's simulated GPU. The first steps (warm-up) are left out.
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

import step_profile

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
    """Seconds per epoch in each section of an eager run, by the agent's own record_function labels, after its first
    epoch (the warm-up: first updates, cuDNN/cuBLAS autotuning): the host's seconds, and on a GPU the device's
    (kernel time, CUDA activity) as well. Evaluation is spread over PAPER_EVAL_EVERY epochs."""
    agent = step_profile.import_agent(agent_name)
    torch.set_num_threads(1)
    epochs = 5
    flags = ["--env-id", "Ant", "--hidden-dim", str(width), "--learning-starts", "0", "--eval-every", str(epochs),
             "--total-env-steps", str(epochs * STEPS_PER_EPOCH), *([] if cuda else ["--no-cuda"])]
    activities = [torch.profiler.ProfilerActivity.CPU, *([torch.profiler.ProfilerActivity.CUDA] if cuda else [])]
    prof = torch.profiler.profile(activities=activities)
    step_profile.run_in_folder(agent, flags, prof)
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    second_epoch = [e for e in events if e.key == "collection"][1].time_range.start
    measured = [e for e in events if e.time_range.start >= second_epoch]  # and the last evaluation (not the first)
    host = {s: sum(e.cpu_time_total for e in measured if e.key == s) / 1e6 / (epochs - 1) for s in SECTIONS}
    device = {s: sum(e.device_time_total for e in measured if e.key == s) / 1e6 / (epochs - 1) for s in SECTIONS}
    for shares in (host, device):
        shares["evaluation"] *= (epochs - 1) / PAPER_EVAL_EVERY  # one evaluation, over the epochs between two
    products = sum(e.self_cpu_time_total for e in measured if e.key in MATRIX_PRODUCTS) / 1e6 / (epochs - 1)
    return {s: v for s, v in host.items() if v}, ({s: v for s, v in device.items() if v} if cuda else None), products


def host_part(agents, widths, cuda):
    """Table 3's rows: each agent and width, with the buffer on the host and on the device."""
    skip, flags = 10, ["--env-id", "Ant", "--num-envs", "1", "--learning-starts", "200", "--grad-steps-per-epoch",
                       "10", "--total-env-steps", "800", "--eval-every", "4", "--num-eval-skills", "2"]
    targets = [f"{agent}{where}" for agent in agents for where in ("", "+device")]
    simulated = {} if cuda else step_profile.simulated_syncs(targets)
    rows = []
    torch.set_num_threads(1)
    for agent in agents:
        for width in widths:
            for where, extra in (("", []), ("+device", ["--buffer-on-device"])):
                m = step_profile.profile_steps(agent, [*flags, "--hidden-dim", str(width), *extra,
                                                       *([] if cuda else ["--no-cuda"])], skip)
                syncs = m["syncs"] if cuda else simulated[agent + where]
                rows.append(f"| {agent} | {width} | {'device' if where else 'host'} | {m['steps']} | "
                            f"{m['host_ms']:.2f} | {m['gather_ms']:.2f} | {m['update_ms']:.1f} | "
                            + (f"{m['device_ms']:.2f}" if cuda else "–") + f" | {syncs:g} |")
                print(rows[-1], flush=True)
    return rows


def epoch_tables(args, baseline_dir):
    """Tables 1 and 2, as markdown lines."""
    out = ["## Where an eager epoch's time goes (seconds per epoch of 8 × 200 Ant steps, one thread)", "",
           "| agent | width | " + " | ".join(SECTIONS) + " | total | of which matrix products |",
           "|---|---|" + "---|" * (len(SECTIONS) + 2)]
    for agent in args.agents:
        for width in args.widths:
            started = time.time()
            shares, device_shares, matrix_products = profile_epoch(agent, width, args.cuda)
            cells = [f"{shares[s]:.3f}" + (f" ({device_shares.get(s, 0):.3f})" if args.cuda else "")
                     if s in shares else "–" for s in SECTIONS]
            out.append(f"| {agent} | {width} | " + " | ".join(cells) + f" | {sum(shares.values()):.2f}"
                       + (f" ({sum(device_shares.values()):.2f})" if args.cuda else "") + f" | {matrix_products:.2f} |")
            print(out[-1], f"({time.time() - started:.0f} s)", flush=True)
    out += ["", "Sections nest no other section; the update's four steps include their optimizer steps. Evaluation is "
            f"its cost spread over the {PAPER_EVAL_EVERY} epochs between two evaluations on Ant. Matrix products are "
            "the host's time inside every matrix product, most of it the update's. The first epoch (warm-up) is left "
            "out" + ("; in brackets, the device's kernel time of the section (CUDA activity)." if args.cuda else "."),
            "",
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
    return out + [""]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", nargs="+", default=["csf", "metra"], help="agent scripts to measure")
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 1024], help="--hidden-dim values")
    parser.add_argument("--baseline-rev", help="a git revision whose eager path runs beside this checkout's")
    parser.add_argument("--cuda", action="store_true", help="measure on the GPU instead (both runs of a pair share it)")
    parser.add_argument("--host-part-only", action="store_true",
                        help="only table 3, the host's part of a gradient step (a few minutes)")
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

    out = [f"# Speed on {device}", "", f"`python benchmarks/speed.py {' '.join(sys.argv[1:])}`".replace(" `", "`"), ""]
    if not args.host_part_only:
        out += epoch_tables(args, baseline_dir)
    out += ["## The host's part of a gradient step (Ant, batch 256, a buffer of 800 transitions)", "",
            "Medians per gradient step over the steps after the first 10. Host ms: the sampling section (index draw, "
            "gather, pinned copies, the launch of the stacking; on a CPU-only run, the stacking too), then the gather "
            "alone, then the update's sections (on a GPU, launching kernels; on a CPU, the computation). Waits: "
            + ("CUDA runtime calls that synchronize, inside the step." if args.cuda else
               "device->host reads, host tensors in device ops and blocking copies per step, on the simulated GPU "
               "of tests/test_host_syncs.py."), "",
            "| agent | width | replay storage | steps measured | host ms: sampling | of which gather | host ms: update "
            "| device ms | waits / step |", "|---|---|---|---|---|---|---|---|---|",
            *host_part(args.agents, args.widths, args.cuda)]
    name = f"speed_{'gpu' if args.cuda else 'cpu'}_{'_'.join(args.agents)}{'_host' if args.host_part_only else ''}.md"
    path = os.path.join(ROOT, "benchmarks", "results", name)
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
