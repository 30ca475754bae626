"""One GPU check: the CUDA tests, the collection split by phase, 1, 2 and 4 runs on one card, the speed rows.

    python benchmarks/gpu_check.py            # on one H100 or H200, from a fresh machine: at most 9 minutes
    python benchmarks/gpu_check.py --smoke    # tiny sizes on whatever device: checks the plumbing (~5 min on 2 cores)

Without a CUDA GPU (and without --smoke) it stops at once with one line. On a GPU, pixels render with MUJOCO_GL=egl
unless MUJOCO_GL is set. The parts run in this order, each within its share of the budget (--minutes), the speed rows
last in whatever the others leave: a part that runs out of time reports what it finished and says so, and a part
that fails says so in one line while the others still run.

  a. the tests: `python -m pytest -v tests/test_cuda.py`, the compiled test included; passed, failed and skipped,
     and the seconds they took.
  b. the collection split by phase, csf.py on Ant, 8 envs, width 1024: per collection step, the policy
     (actor.sample on the device, eager and, on a GPU, replayed as csf.py's CUDA graph), the copies (observations to
     the device, also through pinned memory on a GPU; actions back), the envs stepped in this process, the envs
     stepped in worker processes (envs.ParallelVectorEnv), and the messages between processes, estimated as the
     parallel step less the busiest process's share of the envs' time (their time in this process × its envs / all
     envs); and the whole step as csf.py collects, with each policy. Medians over 5 repeats of 200 steps. Then,
     while the part has time, the envs alone: Ant in fewer worker processes than the default (1, 2, 4), and
     Humanoid's pixels in this process and in workers (50 steps a repeat).
  c. 1, 2 and 4 csf.py Ant runs side by side on the card (the fast path, the paper's Ant settings, learning from
     the first epoch, evaluated only at the start and the end), each pinned to its share of this process's cores:
     the env steps/s of each run over epochs 10 to 20, from the SPS it prints at epochs 10 and 20 (the first 10
     epochs are the warm-up), and their total.
  d. the speed rows of benchmarks/gpu_speed.py, last, in the time the other parts leave (a real run of the script at
     the paper's settings for the env, one at a time, 2 one-epoch windows after a dropped first): every agent on Ant,
     the default and the fast path (--cudagraphs --buffer-on-device), and csf.py on Humanoid pixels on the fast path
     (also with --bf16), csf.py's Ant and Humanoid rows first, then dads.py's; last, csf.py on Ant with --compile,
     if time allows. A row that would not fit in the time left is not started. Each row gives the paper's run
     projected at its speed, without evaluations and with the paper's (the official schedule: Ant every 500 epochs,
     Humanoid every 125, 48 rollouts each, taken as 6 times the measured evaluation of 8).

Prints each table as it comes and writes them all, with the command, the card, torch and the date, to
benchmarks/results/gpu_check_<card>.md (--smoke: gpu_check_smoke.md, not to be committed).
"""

import argparse
import contextlib
import datetime
import functools
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings

import torch

import gpu_speed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MARGIN_S = 20  # of the budget, left for the start and the end
# each part's share of the budget; a part that ends early leaves its time to the parts after it
SHARES = {"tests": 0.3, "collection": 0.1, "side by side": 0.22, "rows": 0.38}
FAST = gpu_speed.FAST
ROWS = [  # (script, env, flags), in the order they run: csf.py's rows of the paper's runs first (Humanoid on the fast
    # path alone: the default is the path to make fast), dads (never measured on a GPU) next, then the agents measured
    # at 1fe2a8a, --compile last
    ("csf", "Ant", ""), ("csf", "Ant", FAST), ("csf", "Humanoid", FAST), ("csf", "Humanoid", f"--bf16 {FAST}"),
    *[(agent, "Ant", flags) for agent in ("dads", "cic", "visr", "diayn", "metra") for flags in ("", FAST)],
    ("csf", "Ant", f"--compile {FAST}"),
]
ROW_WINDOWS = 2
ROW_GUESS_S = {"Ant": 35, "Humanoid": 60, "compile": 150}  # a row's wall time until one of its kind has run
PAPER_EVAL_EVERY = {"Ant": 500, "Humanoid": 125}  # the official schedule (envs.ENV_SPECS' eval_every)
PAPER_EVAL_ROLLOUTS = 48  # the agents' --num-eval-skills; the rows evaluate 8
NUM_ENVS = 8  # the collection split: 8 envs, medians over 5 repeats of 200 steps
STEPS = 200
REPEATS = 5
SIDE_BY_SIDE = (1, 2, 4)
SIDE_BY_SIDE_WEIGHTS = {1: 1.0, 2: 1.2, 4: 1.8}  # each group's share of part d's time
SIDE_BY_SIDE_EPOCHS = 20  # a run prints its speed every 10 epochs: the window is epochs 10 to 20
PRINTED_SPEED = re.compile(r"^epoch (\d+) \| env steps ([\d,]+) \| SPS (\d+) \|")


class Report:
    """The results file, rewritten after each line added, and the same lines printed."""

    def __init__(self, path):
        self.path = path
        self.lines = []

    def add(self, *lines):
        for line in lines:
            print(line, flush=True)
        self.lines += lines
        with open(self.path, "w") as f:
            f.write("\n".join(self.lines) + "\n")


def messages_ms(parallel_ms, serial_ms, num_envs, busiest_share):
    """What a parallel step spends on messages: its time less the busiest process's share of the envs' time, that
    share estimated from the envs' time in one process (serial_ms for num_envs envs; busiest_share of them)."""
    return parallel_ms - serial_ms * busiest_share / num_envs


def window_speeds(printed):
    """Env steps/s between consecutive printed (env steps, SPS) pairs: SPS is env steps over the run's wall time
    so far, so each pair gives that wall time, and two give the speed between them."""
    speeds = []
    for (steps_before, sps_before), (steps_after, sps_after) in zip(printed, printed[1:]):
        seconds = steps_after / sps_after - steps_before / sps_before
        speeds.append((steps_after - steps_before) / seconds)
    return speeds


def paper_hours(env_id, sps, eval_s):
    """The paper's run at `sps`, in hours: without evaluations, and with the official schedule's, each taken as
    PAPER_EVAL_ROLLOUTS / 8 times `eval_s`, the measured evaluation of 8 rollouts."""
    env_steps = gpu_speed.PAPER_ENV_STEPS[env_id]
    without = env_steps / sps
    evaluations = env_steps // gpu_speed.STEPS_PER_EPOCH // PAPER_EVAL_EVERY[env_id] + 1
    with_evaluations = without + evaluations * eval_s * PAPER_EVAL_ROLLOUTS / 8
    return without / 3600, with_evaluations / 3600


def cell(text):
    """Text for a markdown table's cell: no '|', one line, at most 160 characters."""
    return " ".join(str(text).replace("|", "/").split())[:160]


def start(command, folder, cores=None):
    """Start `command` in `folder`, its output in folder/output.txt, in a session of its own (stopping it stops its
    children, the env workers, too); on `cores` alone if given, with as many torch threads."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if cores:
        env["OMP_NUM_THREADS"] = str(len(cores))
    with open(os.path.join(folder, "output.txt"), "w") as output:
        process = subprocess.Popen(command, cwd=folder, stdout=output, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    if cores:
        os.sched_setaffinity(process.pid, cores)  # before it starts a thread or a worker, which inherit it
    return process


def wait_until(process, deadline):
    """The exit code of a started process, or None if it ran past the deadline (then it is stopped)."""
    try:
        return process.wait(timeout=max(0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        stop(process)
        return None


def stop(process):
    """Stop a started process and its children, if it still runs."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def last_line(path):
    with open(path) as f:
        lines = f.read().strip().splitlines()
    return lines[-1] if lines else "no output"


def check_tests(report, smoke, deadline):
    """Part a: tests/test_cuda.py, its counts and time; on a CPU every test skips."""
    folder = tempfile.mkdtemp(prefix="gpu_check_tests_")
    command = [sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider",
               os.path.join(ROOT, "tests", "test_cuda.py")]
    started = time.time()
    process = start(command, folder)
    try:
        code = wait_until(process, deadline)
    finally:  # Ctrl-C here stops it too
        stop(process)
    seconds = time.time() - started
    with open(os.path.join(folder, "output.txt")) as f:
        output = f.read().splitlines()
    outcomes = {"PASSED": 0, "FAILED": 0, "ERROR": 0, "SKIPPED": 0}
    skip_reasons = set()
    for line in output:
        match = re.match(r"^\S+::\S+ (PASSED|FAILED|ERROR|SKIPPED)", line)
        if match:
            outcomes[match.group(1)] += 1
        if line.startswith("SKIPPED ["):  # the summary's "SKIPPED [2] tests/test_cuda.py:41: needs a GPU"
            skip_reasons.add(line.split(": ", 1)[-1])
    note = f"exit code {code}"
    if code is None:
        note = f"stopped at the part's end, after {seconds:.0f} s: the tests after these did not run"
    if outcomes["SKIPPED"] and outcomes["SKIPPED"] == sum(outcomes.values()):
        note += f"; all skipped: {', '.join(sorted(skip_reasons))}"
    report.add("| command | passed | failed | errors | skipped | s | note |", "|---|---|---|---|---|---|---|",
               f"| `python -m pytest -v tests/test_cuda.py` | {outcomes['PASSED']} | {outcomes['FAILED']} | "
               f"{outcomes['ERROR']} | {outcomes['SKIPPED']} | {seconds:.0f} | {cell(note)} |")
    failures = [line for line in output if line.startswith(("FAILED ", "ERROR "))]
    if failures:
        report.add("", *[f"- {cell(line)}" for line in failures])


def speed_rows(report, smoke, deadline):
    """Part d: gpu_speed.py's rows, in ROWS' order, each started only if it fits in the time left."""
    report.add(f"Width 1024, batch 256, the paper's epochs (--smoke: width 16); medians over {ROW_WINDOWS} one-epoch "
               "windows after the first; env steps/s end to end, evaluation excluded. The paper's run: Ant 64M env "
               "steps, Humanoid 4.8M, without evaluations and with the official schedule's (Ant every 500 epochs, "
               f"Humanoid every 125; {PAPER_EVAL_ROLLOUTS} rollouts each, taken as 6 × the measured 8).", "",
               "| script | env | flags | ms / gradient step | env steps/s (min–max) | vs the default | the paper's "
               "run, h | with its evaluations, h | s / evaluation of 8 | wall s |",
               "|---|---|---|---|---|---|---|---|---|---|")
    defaults = {}  # (script, env): env steps/s of its default row
    expected = dict(ROW_GUESS_S)  # a row's wall time, by kind: the last measured one
    for script, env_id, flags in ROWS:
        label = f"`{flags}`" if flags else "(default)"
        kind = "compile" if "--compile" in flags else env_id
        left = max(0, deadline - time.time())
        if left < expected[kind]:
            report.add(f"| {script} | {env_id} | {label} | not run: {left:.0f} s were left, a row takes about "
                       f"{expected[kind]:.0f} | | | | | | |")
            continue
        result = gpu_speed.measure(script, env_id, flags, smoke, left, ROW_WINDOWS)
        if "failed" in result:
            report.add(f"| {script} | {env_id} | {label} | failed: {cell(result['failed'])} | | | | | | |")
            continue
        expected[kind] = result["wall"]
        if not flags:
            defaults[(script, env_id)] = result["sps"]
        ratio = "–"
        if flags and (script, env_id) in defaults:
            ratio = f"{result['sps'] / defaults[(script, env_id)]:.2f}×"
        hours, hours_with_evaluations = paper_hours(env_id, result["sps"], result["eval_s"])
        low, high = result["sps_range"]
        wall = f"{result['wall']:.0f}"
        if result["stopped"]:
            wall += f" (stopped at the part's end after {result['windows']} of {ROW_WINDOWS} windows)"
        report.add(f"| {script} | {env_id} | {label} | {result['ms']:.2f} | {result['sps']:,.0f} "
                   f"({low:,.0f}–{high:,.0f}) | {ratio} | {hours:.1f} | {hours_with_evaluations:.1f} | "
                   f"{result['eval_s']:.2f} | {wall} |")


def median_ms(step, before=None, steps=STEPS, repeats=REPEATS):
    """The median over `repeats` (after one more, a warm-up) of the mean ms of `steps` calls of step(); before(),
    if given, runs untimed before each repeat."""
    times = []
    for _ in range(repeats + 1):
        if before:
            before()
        started = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - started) / steps * 1000)
    return statistics.median(times[1:])


def collection_split(report, smoke, deadline):
    """Part b: ms per collection step of csf.py on Ant in each phase (see the module's docstring)."""
    # imported here, not at the top: MUJOCO_GL is set first, and the check stops without a GPU before these imports
    import numpy as np

    import csf
    import envs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = device.type.upper()
    width = 16 if smoke else 1024
    steps = 50 if smoke else STEPS
    repeats = 3 if smoke else REPEATS
    make = functools.partial(envs.make_env, "Ant")
    torch.set_float32_matmul_precision("high" if device.type == "cuda" else "highest")  # as csf.py

    serial_envs, serial_eval_envs = envs.make_envs(make, NUM_ENVS, 1, 0, parallel=False)
    space = serial_envs.single_observation_space
    action_dim = serial_envs.single_action_space.shape[0]
    actions = np.random.default_rng(0).uniform(-1, 1, (NUM_ENVS, action_dim)).astype(np.float32)
    serial_ms = median_ms(lambda: serial_envs.step(actions), serial_envs.reset, steps, repeats)
    obs, _ = serial_envs.reset()
    serial_envs.close()
    serial_eval_envs.close()

    actor = csf.Actor(space, action_dim, 2, width).to(device)
    skills = csf.sample_skills(NUM_ENVS, 2).to(device)
    obs_on_device = torch.as_tensor(obs, device=device)
    with torch.no_grad():
        action_on_device = actor.sample(obs_on_device, skills)[0]

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def collection_policy(cudagraphs):
        """csf.py's run.policy, as its fast_path makes it: eager, or replayed as a CUDA graph (--cudagraphs)."""
        run = types.SimpleNamespace()
        flags = types.SimpleNamespace(compile=False, cudagraphs=cudagraphs)
        csf.fast_path(None, actor, run, flags, device)
        return run.policy

    policies = {"eager": collection_policy(False)}
    if device.type == "cuda":
        policies["a CUDA graph (--cudagraphs)"] = collection_policy(True)

    def policy_step(policy):
        with torch.no_grad():
            policy(obs=obs_on_device, skill=skills)
        synchronize()

    def copy_observations():
        torch.as_tensor(obs, device=device)
        synchronize()

    def copy_observations_pinned():  # as csf.env_actions on a GPU
        torch.as_tensor(obs).pin_memory().to(device, non_blocking=True)
        synchronize()

    def copy_actions():
        action_on_device.cpu().numpy()

    phases = []
    for kind, policy in policies.items():
        phases.append((f"policy: actor.sample on the {where}, width {width}, {kind}",
                       median_ms(functools.partial(policy_step, policy), None, steps, repeats)))
    observations_ms = median_ms(copy_observations, None, steps, repeats)
    phases.append((f"copy: observations to the {where}", observations_ms))
    if device.type == "cuda":
        observations_ms = median_ms(copy_observations_pinned, None, steps, repeats)
        phases.append((f"copy: observations to the {where} through pinned memory", observations_ms))
    actions_ms = median_ms(copy_actions, None, steps, repeats)
    phases += [(f"copy: actions back from the {where}", actions_ms), ("envs stepped in this process", serial_ms)]
    header = [f"| phase of one collection step, csf.py on Ant, {NUM_ENVS} envs | ms (median of {repeats} × {steps} "
              "steps) |", "|---|---|"]
    if time.time() > deadline:
        report.add(*header, *[f"| {phase} | {ms:.3f} |" for phase, ms in phases], "",
                   "Stopped at the part's end, before the envs in worker processes.")
        return

    parallel_envs, parallel_eval_envs = envs.make_envs(make, NUM_ENVS, 1, 0, parallel=True)
    busiest_share = max(hi - lo for lo, hi in parallel_envs._slices)  # the envs of the busiest process

    def collection_step(policy):  # as csf.py's loop
        with torch.no_grad():
            parallel_envs.step(csf.env_actions(policy, obs, skills, 0))

    parallel_ms = median_ms(lambda: parallel_envs.step(actions), parallel_envs.reset, steps, repeats)
    phases += [(f"envs stepped with ParallelVectorEnv ({worker_count(parallel_envs.num_workers)}; the busiest process "
                f"steps {busiest_share})", parallel_ms),
               (f"messages between processes: that step less {busiest_share}/{NUM_ENVS} of the envs' time in this "
                "process", messages_ms(parallel_ms, serial_ms, NUM_ENVS, busiest_share))]
    for kind, policy in policies.items():
        whole_ms = median_ms(functools.partial(collection_step, policy), parallel_envs.reset, steps, repeats)
        phases.append((f"the whole step as csf.py collects, the policy {kind} (policy, copies, envs in workers)",
                       whole_ms))
    default_workers = parallel_envs.num_workers
    parallel_envs.close()
    parallel_eval_envs.close()
    parts = phases[len(policies) - 1][1] + observations_ms + actions_ms + parallel_ms
    report.add(*header, *[f"| {phase} | {ms:.3f} |" for phase, ms in phases], "",
               f"The last policy, the last copy of the observations, the actions' copy and the parallel envs add up to "
               f"{parts:.3f} ms, against {whole_ms:.3f} ms measured whole.")

    # the envs alone, while the part has time: fewer workers than the default on Ant, then Humanoid's pixels
    cases = [("Ant", workers) for workers in (1, 2, 4) if workers < default_workers]
    cases += [("Humanoid", 0), ("Humanoid", None)]
    rows = []
    for env_id, workers in cases:
        if time.time() > deadline:
            rows.append(f"| {env_id}, {stepped_where(workers)} | not run: the part's time was up |")
            continue
        ms, workers = envs_step_ms(env_id, workers, steps // 4 if env_id == "Humanoid" else steps, repeats)
        rows.append(f"| {env_id}, {stepped_where(workers)} | {ms:.3f} |")
    report.add("", f"| {NUM_ENVS} envs alone | ms per step |", "|---|---|", *rows)


def stepped_where(num_workers):
    if num_workers == 0:
        return "in this process"
    if num_workers is None:
        return "ParallelVectorEnv, as many workers as the cores allow"
    return f"ParallelVectorEnv with {worker_count(num_workers)}"


def worker_count(num_workers):
    return f"{num_workers} worker{'' if num_workers == 1 else 's'}"


def envs_step_ms(env_id, num_workers, steps, repeats):
    """The median ms of a step of NUM_ENVS envs of env_id with random actions, in a ParallelVectorEnv with
    num_workers workers (0: all in this process; None: as many as the cores allow); and the workers it had."""
    import numpy as np

    import envs  # here, not at the top: see collection_split

    vector = envs.ParallelVectorEnv([functools.partial(envs.make_env, env_id, None)] * NUM_ENVS, num_workers)
    try:
        vector.reset(seed=0)
        shape = (NUM_ENVS, *vector.single_action_space.shape)
        actions = np.random.default_rng(0).uniform(-1, 1, shape).astype(vector.single_action_space.dtype)
        ms = median_ms(lambda: vector.step(actions), lambda: vector.reset(seed=0), steps, repeats)
        return ms, vector.num_workers
    finally:
        vector.close()


def side_by_side_flags(use_gpu, smoke):
    """csf.py on Ant at the paper's settings, SIDE_BY_SIDE_EPOCHS epochs, learning from the first, evaluated only at
    the start and the end; the fast path on a GPU. --smoke: 2 envs, width 16."""
    num_envs = 2 if smoke else 8
    steps_per_epoch = num_envs * 200
    flags = ["--env-id", "Ant", "--num-envs", str(num_envs), "--total-env-steps",
             str(SIDE_BY_SIDE_EPOCHS * steps_per_epoch), "--learning-starts", str(steps_per_epoch), "--eval-every",
             str(10**6), "--checkpoint-every", str(10**9), "--num-eval-skills", str(num_envs)]
    if use_gpu:
        flags += FAST.split()
    if smoke:
        flags += ["--hidden-dim", "16", "--batch-size", "16", "--grad-steps-per-epoch", "4", "--buffer-size",
                  str(SIDE_BY_SIDE_EPOCHS * steps_per_epoch)]
    return flags


def side_by_side(report, smoke, deadline):
    """Part c: 1, 2 and 4 csf.py Ant runs at once, each on its share of the cores; their env steps/s."""
    import envs  # here, not at the top: see collection_split

    cores = envs.usable_cores()
    flags = side_by_side_flags(torch.cuda.is_available(), smoke)
    report.add(f"`python csf.py {' '.join(flags)}`, {len(cores)} cores divided among the runs; env steps/s over "
               "epochs 10 to 20 of each run.", "",
               "| runs side by side | cores each | env steps/s of each run | total env steps/s | total vs 1 run | "
               "wall s | note |", "|---|---|---|---|---|---|---|")
    alone = None
    for runs in SIDE_BY_SIDE:
        weight_left = sum(SIDE_BY_SIDE_WEIGHTS[later] for later in SIDE_BY_SIDE if later >= runs)
        group_deadline = time.time() + (deadline - time.time()) * SIDE_BY_SIDE_WEIGHTS[runs] / weight_left
        groups = envs.divide_cores(cores, runs)
        sizes = "/".join(sorted({str(len(group)) for group in groups}))
        if len(cores) < runs:
            sizes += " (shared)"
        started = time.time()
        processes = []
        folders = []
        try:
            for group in groups:
                folder = tempfile.mkdtemp(prefix=f"gpu_check_{runs}_runs_")
                processes.append(start([sys.executable, os.path.join(ROOT, "csf.py"), *flags], folder, group))
                folders.append(folder)
            codes = [wait_until(process, group_deadline) for process in processes]
        finally:  # Ctrl-C here stops them too
            for process in processes:
                stop(process)
        wall = time.time() - started
        speeds = []
        notes = []
        for code, folder in zip(codes, folders):
            printed = []
            with open(os.path.join(folder, "output.txt")) as f:
                for line in f:
                    match = PRINTED_SPEED.match(line)
                    if match:
                        printed.append((int(match.group(2).replace(",", "")), int(match.group(3))))
            windows = window_speeds(printed)
            if windows:
                speeds.append(statistics.median(windows))
            if code is None:
                notes.append("a run stopped at the part's end")
            elif code != 0:
                notes.append(f"a run failed: {last_line(os.path.join(folder, 'output.txt'))}")
            elif not windows:
                notes.append("a run printed no window")
        each = ", ".join(f"{speed:,.0f}" for speed in speeds) or "–"
        total = "–"
        ratio = "–"
        if len(speeds) == runs:
            total = f"{sum(speeds):,.0f}"
            if runs == 1:
                alone = sum(speeds)
            if alone:
                ratio = f"{sum(speeds) / alone:.2f}×"
        note = "; ".join(sorted(set(notes)))
        report.add(f"| {runs} | {sizes} | {each} | {total} | {ratio} | {wall:.0f} | {cell(note)} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on whatever device: check the plumbing")
    parser.add_argument("--minutes", type=float, default=None,
                        help="the whole check's budget in minutes (unset: 9, and 6 with --smoke)")
    args = parser.parse_args()
    with warnings.catch_warnings():  # a CUDA build of torch without a driver warns: the one line below says it
        warnings.simplefilter("ignore")
        use_gpu = torch.cuda.is_available()
    if not use_gpu and not args.smoke:
        parser.exit(2, "gpu_check.py: error: no CUDA GPU here (torch sees none); run it on an H100 or H200 "
                       "(--smoke checks the plumbing on a CPU)\n")
    minutes = args.minutes
    if minutes is None:
        minutes = 6 if args.smoke else 9
    started = time.time()
    if use_gpu:
        os.environ.setdefault("MUJOCO_GL", "egl")  # before envs.py is imported, here and in every run
    card = gpu_speed.device_name()
    name = "smoke" if args.smoke else re.sub(r"[^A-Za-z0-9]+", "_", card).strip("_")
    path = os.path.join(ROOT, "benchmarks", "results", f"gpu_check_{name}.md")
    report = Report(path)
    command = " ".join(["python benchmarks/gpu_check.py", *sys.argv[1:]])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report.add(f"# GPU check on {card}", "", f"`{command}`", "",
               f"{date}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
               f"{len(os.sched_getaffinity(0))} cores; MUJOCO_GL={os.environ.get('MUJOCO_GL', 'unset')}; "
               f"a budget of {minutes:g} minutes.")
    parts = [("a. tests/test_cuda.py", "tests", check_tests),
             ("b. the collection split by phase", "collection", collection_split),
             ("c. 1, 2 and 4 runs on one card", "side by side", side_by_side), ("d. speed rows", "rows", speed_rows)]
    budget = 60 * minutes - MARGIN_S
    end = started + budget
    for number, (title, _, part) in enumerate(parts):
        later_shares = sum(SHARES[share] for _, share, _ in parts[number + 1:])
        deadline = end - later_shares * budget
        part_started = time.time()
        report.add("", f"## {title}", "")
        try:
            part(report, args.smoke, deadline)
        except Exception as e:  # one line, and the next part runs
            report.add(f"failed: {cell(f'{type(e).__name__}: {e}')}")
        report.add("", f"({time.time() - part_started:.0f} s, of {max(0, deadline - part_started):.0f} s it had)")
    report.add("", f"The whole check: {time.time() - started:.0f} s.")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
