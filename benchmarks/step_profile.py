"""What a gradient step costs the host, and on a GPU the device: the measurement behind speed.py's and
pixel_speed.py's "host's part of a gradient step" rows.

`profile_steps(agent_name, flags, skip)` runs one agent in this process under torch.profiler (CUDA activity too when
the run is on a GPU), finds its gradient steps by the agent's own record_function labels (a "sampling" section
starts a step, the update's sections follow it), leaves out the first `skip` steps (the warm-up: cuDNN and cuBLAS
autotuning, the allocator's growth, any compilation) and returns per gradient step, as medians over the others:

  host_ms      the host's time in the sampling section: the index draw, the gather of whole frames, the pinned
               copies to the device and the launch of the stacking; on a CPU-only run the stacking itself too
  gather_ms    of which ReplayBuffer.gather, the host's copy out of the replay storage
  update_ms    the host's time in the update's sections (on a GPU, launching its kernels; on a CPU, the computation)
  device_ms    on a GPU: the time of the kernels the step launched (None on a CPU)
  syncs        on a GPU: the CUDA runtime calls inside the step that make the host wait for the device (None on a CPU)

`flops_per_step(agent_name, flags)` counts the floating-point operations of one gradient step (forward, backward
and optimizer, convolutions included) as the difference of two runs under torch's FlopCounterMode, with and without
gradient steps, which collect and evaluate alike.

`simulated_syncs(targets)` answers the last one on a CPU: it runs tests/test_host_syncs.py, whose simulated GPU
counts every device->host read, host tensor in a device op and blocking copy inside a step.
"""

import contextlib
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.flop_counter import FlopCounterMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UPDATE_SECTIONS = ("phi step", "model step", "psi step", "qf step", "actor step", "alpha step")
# CUDA runtime calls after which the host has waited for the device (a blocking copy, an .item(), a synchronize)
WAITING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                 "cudaMemcpy2D", "cudaMemset")


def device_time_us(event):
    return event.device_time_total


@contextlib.contextmanager
def labelled_gather(agent):
    """The agent's ReplayBuffer.gather inside a record_function("gather"), while the block runs (a buffer that draws
    its batch in `sample` alone, as cic.py's and dads.py's, has no gather to label: its gather_ms is 0)."""
    gather = getattr(agent.ReplayBuffer, "gather", None)
    if gather is None:
        yield
        return

    @functools.wraps(gather)
    def labelled(*args, **kwargs):
        with record_function("gather"):
            return gather(*args, **kwargs)

    agent.ReplayBuffer.gather = labelled
    try:
        yield
    finally:
        agent.ReplayBuffer.gather = gather


def run_in_folder(agent, flags, mode):
    """agent.main with `flags` in a temporary folder, inside the context manager `mode`."""
    args, ckpt = agent.parse_args(flags)
    old = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="step_profile_") as cwd:
        os.chdir(cwd)
        try:
            with mode:
                agent.main(args, ckpt)
        finally:
            os.chdir(old)


def import_agent(agent_name):
    sys.path.insert(0, ROOT)
    return importlib.import_module(agent_name)


def flops_per_step(agent_name, flags, grad_steps=2):
    """FLOPs of one gradient step: a run of `flags` with `grad_steps` steps in each training epoch, less the same run
    with none, over its number of steps. `flags` must make exactly one training epoch."""
    agent = import_agent(agent_name)
    totals = []
    for steps in (grad_steps, 0):
        counter = FlopCounterMode(display=False)
        run_in_folder(agent, [*flags, "--grad-steps-per-epoch", str(steps)], counter)
        totals.append(counter.get_total_flops())
    return (totals[0] - totals[1]) / grad_steps


def profile_steps(agent_name, flags, skip):
    """Run `agent_name`.py with `flags` in a temporary folder under the profiler; its gradient steps after the first
    `skip`, as medians per step (see the top). The flags must give more than `skip` gradient steps."""
    agent = import_agent(agent_name)
    cuda = "--no-cuda" not in flags and torch.cuda.is_available()
    prof = profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])])
    with labelled_gather(agent):
        run_in_folder(agent, flags, prof)
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    steps = []  # each step: its sections, the sampling first
    for event in events:
        if event.name == "sampling":
            steps.append([event])
        elif event.name in UPDATE_SECTIONS and steps:
            steps[-1].append(event)

    def inside(sections, name):  # the events called `name` that start within one of the step's sections
        return [e for e in events if e.name == name and any(
            s.time_range.start <= e.time_range.start <= s.time_range.end for s in sections)]

    measured = steps[skip:]
    if not measured:
        raise ValueError(f"{agent_name} made {len(steps)} gradient steps, not more than the {skip} left out")
    per_step = [{"host_ms": sections[0].cpu_time_total / 1e3,
                 "gather_ms": sum(e.cpu_time_total for e in inside(sections[:1], "gather")) / 1e3,
                 "update_ms": sum(s.cpu_time_total for s in sections[1:]) / 1e3,
                 "device_ms": sum(map(device_time_us, sections)) / 1e3,
                 "syncs": sum(len(inside(sections, name)) for name in WAITING_CALLS)} for sections in measured]
    medians = {key: statistics.median(step[key] for step in per_step) for key in per_step[0]}
    return {**medians, "steps": len(measured), **({} if cuda else {"device_ms": None, "syncs": None})}


def simulated_syncs(targets):
    """{target: waits per gradient step} on tests/test_host_syncs.py's simulated GPU; a target is an agent's name,
    with "+device" for --buffer-on-device."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "test_host_syncs.py"), *targets],
                         capture_output=True, text=True, check=True, cwd=tempfile.gettempdir()).stdout
    reports = [json.loads(line) for line in out.splitlines()[-len(targets):]]
    return {r["target"]: sum(e["kind"] != "H2D async copy" for e in r["events"]) / r["steps"] for r in reports}
