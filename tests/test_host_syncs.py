"""One eager gradient step never makes the GPU wait for the host: on a CPU with a fake GPU, no agent (and neither
hierarchical SAC nor PPO) reads from the device, puts a host tensor in a device op or copies to the device blocking.
And each env step's actions (an agent's `env_actions`, in collection and in evaluation) copy the observations to the
device through pinned memory without waiting, and wait for the device once: the copy of the actions back. Around them,
an evaluation copies nothing at each step (its skills go to the device once).

Each script's own `main` runs with tiny flags in a subprocess (the fake GPU patches torch process-wide):
  - torch.cuda.is_available() says True, so the script picks "cuda"; FunctionMode turns cuda device arguments into
    "meta", and DispatchMode turns what lands there into FakeCuda: CPU numbers inside, device cuda:0 to Python;
  - `handle` runs each aten op on the CPU numbers and, inside a gradient step, records at the script's file:line:
      D2H read                .item(), bool(t), .cpu(), .tolist(), .numpy(), printing, nonzero, boolean masks
      CPU tensor in device op a host tensor of >= 1 dimension as an index or operand (0-dim: a scalar, fine)
      H2D blocking copy       .to(device), torch.as_tensor(x, device=...), unless non_blocking from pinned memory
      H2D async copy          non_blocking from pinned memory (pin_memory() is emulated): allowed;
  - StepTracer (sys.settrace) finds the gradient steps by these conventions of the scripts; keep them:
      1. the replay buffer is a class of the script with methods `add` and `sample`, and `main` (or a comprehension
         in it) calls `sample`: that call begins a step;
      2. the update is main's nested function `update` (hierarchical.py: `sac_update`): its return ends the step;
      3. PPO: main's nested `ppo_update` loops `for ... in range(args.grad_steps_per_epoch):`; a pass is a step;
      4. eval.jsonl's last line holds `grad_steps`, which must equal the number of steps found;
      5. an agent's actions for the envs come from its function `env_actions`: each call is an env step's actions;
      6. an agent's evaluation is its function `evaluate` (under decorators), which calls `env_actions`.
By hand: `python tests/test_host_syncs.py csf hier-ppo` prints a JSON report per target.
"""

import ast
import collections
import contextlib
import glob
import importlib
import inspect
import io
import json
import linecache
import os
import subprocess
import sys
import tempfile
import traceback
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_DEVICE = ("csf+device", "metra+device", "diayn+device", "visr+device", "cic+device", "dads+device")
TARGETS = ("csf", "metra", "diayn", "visr", "cic", "dads", "hier-sac", "hier-ppo", *ON_DEVICE)  # +device: with
# --buffer-on-device, whose steps copy nothing from the host at all
INJECTED = "csf+inject"  # csf with a .item() and a host index slipped into its φ loss: they must be caught
SHARES = (("csf", "diayn", "cic", "hier-sac", INJECTED, "csf+device", "diayn+device", "cic+device"),
          ("metra", "visr", "dads", "hier-ppo", "metra+device", "visr+device", "dads+device"))  # 2 processes
AGENT_FLAGS = ("--no-parallel-envs", "--num-envs", "2", "--learning-starts", "800", "--grad-steps-per-epoch", "3",
               "--batch-size", "16", "--hidden-dim", "16", "--buffer-size", "4000", "--num-eval-skills", "4",
               "--total-env-steps", "1200")
HIER_FLAGS = ("--no-parallel-envs", "--num-envs", "2", "--batch-size", "16", "--hidden-dim", "16",
              "--num-eval-episodes", "2", "--grad-steps-per-epoch", "3", "--total-env-steps", "1200",
              "--learning-starts", "16")
HIER_TASKS = {"hier-sac": ("AntMultiGoal", "Ant"), "hier-ppo": ("HalfCheetahGoal", "HalfCheetah")}
aten = torch.ops.aten
CUDA, META, CPU = torch.device("cuda", 0), torch.device("meta"), torch.device("cpu")
DATA_DEPENDENT = {aten.nonzero, aten.masked_select, aten._unique2, aten.unique_consecutive, aten.unique_dim,
                  aten.bincount, aten.equal}  # the host reads their output's size (or value) from the device


# ---------------------------------------------------------------- what happened inside the gradient steps
class Recorder:
    def __init__(self):
        self.events, self.step, self.in_step = [], 0, False
        self.stage, self.actions = "gradient step", 0  # what runs now; the env steps' actions so far
        self.evaluations, self.evaluating = 0, False

    def begin(self):
        if not self.in_step:
            self.step, self.in_step, self.stage = self.step + 1, True, "gradient step"

    def begin_actions(self):
        self.actions, self.in_step, self.stage = self.actions + 1, True, "actions"

    def begin_evaluation(self):
        self.evaluations, self.evaluating, self.in_step, self.stage = self.evaluations + 1, True, True, "evaluation"

    def end(self):  # inside an evaluation, back to it
        self.in_step, self.stage = self.evaluating, "evaluation" if self.evaluating else self.stage

    def end_evaluation(self):
        self.evaluating = self.in_step = False

    def record(self, kind, detail):
        """An event at the innermost frame of the scripts (or of the syncs injected below), and the one calling it."""
        if self.in_step:
            (path, line), *callers = [(f.f_code.co_filename, n) for f, n in traceback.walk_stack(None)
                                      if os.path.dirname(f.f_code.co_filename) == ROOT
                                      or f.f_code.co_name == "loss_with_syncs"]
            step = {"gradient step": self.step, "actions": self.actions, "evaluation": self.evaluations}[self.stage]
            self.events.append({"stage": self.stage, "step": step, "kind": kind, "where": place(path, line),
                                "detail": detail, "source": linecache.getline(path, line).strip(),
                                "via": place(*callers[0]) if callers else "?"})

    def h2d(self, src, non_blocking):
        if non_blocking and getattr(src, "fake_pinned", False):
            self.record("H2D async copy", describe(src))
        else:
            self.record("H2D blocking copy", describe(src) + (", non_blocking, not pinned" if non_blocking else ""))


REC = Recorder()


def place(path, line):
    return f"{os.path.basename(path)}:{line}"


def describe(t):
    return f"{str(t.dtype).removeprefix('torch.')}[{','.join(map(str, t.shape))}]"


# ---------------------------------------------------------------- the fake GPU
class FakeCuda(torch.Tensor):
    """A tensor on the "GPU": meta to C++ (so nothing reads its memory by accident), cuda:0 to Python, its numbers in
    the CPU tensor `elem`. Every aten op on it goes to `handle`."""

    @staticmethod
    def __new__(cls, elem):
        out = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype,
                                                  storage_offset=elem.storage_offset(), device=META,
                                                  requires_grad=elem.requires_grad)
        out.elem = elem
        return out

    device, is_cuda, is_cpu, is_meta = property(lambda self: CUDA), True, False, False
    __torch_function__ = torch._C._disabled_torch_function_impl
    __torch_dispatch__ = classmethod(lambda cls, func, types, args=(), kwargs=None: handle(func, args, kwargs or {}))

    def tolist(self):
        REC.record("D2H read", f".tolist() of {describe(self)}")
        return self.elem.tolist()

    def numpy(self, *, force=False):  # on a real GPU this raises
        REC.record("D2H read", f".numpy() of {describe(self)}")
        return self.elem.detach().numpy()

    def __repr__(self, *, tensor_contents=None):
        REC.record("D2H read", f"printing {describe(self)}")
        return f"FakeCuda({self.elem!r})"

    def __format__(self, spec):
        return format(self.item(), spec) if self.dim() == 0 else repr(self)


def handle(func, args, kwargs):
    """Run an aten op on the CPU numbers inside its FakeCuda arguments (a factory for the meta device: on the CPU),
    its results made FakeCuda; record what would make the GPU wait."""
    fakes, hosts = [], []

    def unwrap(x):
        if isinstance(x, FakeCuda):
            fakes.append(x)
            return x.elem
        if isinstance(x, torch.Tensor):
            hosts.append(x)
        elif isinstance(x, (list, tuple)):
            return type(x)(map(unwrap, x))
        return x

    uargs, ukwargs = unwrap(args), {key: unwrap(value) for key, value in kwargs.items()}
    target = torch.device(ukwargs["device"]).type if ukwargs.get("device") is not None else None
    if target == "meta":
        ukwargs["device"] = CPU
    if not fakes and target != "meta":
        return func(*uargs, **ukwargs)  # a host op
    if func is aten._to_copy.default and target == "cpu":
        REC.record("D2H read", f".cpu() of {describe(args[0])}")
        return func(*uargs, **ukwargs)
    if func is aten._to_copy.default and not fakes:
        REC.h2d(args[0], kwargs.get("non_blocking", False))
    elif func is aten.copy_.default and not isinstance(args[0], FakeCuda):
        REC.record("D2H read", f"copy_ of {describe(args[1])} to the host")
        return args[0].copy_(args[1].elem)
    elif func is aten.copy_.default and not isinstance(args[1], FakeCuda):
        REC.h2d(args[1], args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    elif func is not aten.copy_.default:  # any other op (a copy_ from FakeCuda to FakeCuda stays on the device)
        op = func.overloadpacket
        if func is aten._local_scalar_dense.default:
            REC.record("D2H read", f".item() (or bool(t), float(t), if t:) of {describe(args[0])}")
        elif op in DATA_DEPENDENT or op in (aten.index, aten.index_put, aten.index_put_) and any(
                isinstance(i, FakeCuda) and i.dtype == torch.bool for i in args[1]):
            REC.record("D2H read", f"aten.{op.__name__}: the size of its output depends on the data")
        for t in hosts:
            if t.dim() > 0:
                REC.record("CPU tensor in device op", f"aten.{op.__name__} with host {describe(t)}")
    return wrap(func(*uargs, **ukwargs))  # (an in-place op's result is its input again: autograd returns `self`)


def wrap(x):
    if isinstance(x, (list, tuple)):
        return type(x)(map(wrap, x))
    return FakeCuda(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeCuda) else x


class DispatchMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return handle(func, args, kwargs or {})


def is_cuda(device):
    return isinstance(device, (str, torch.device)) and str(device).startswith("cuda")


class FunctionMode(TorchFunctionMode):
    """Every cuda device argument becomes the meta device, which DispatchMode turns into FakeCuda."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.device:  # the script must see "cuda"
            return func(*args, **kwargs)
        if func in (torch.tensor, torch.as_tensor, torch.asarray) and is_cuda(kwargs.get("device")):
            requires_grad = kwargs.get("requires_grad", False)  # made on the host, then copied over, as on a GPU
            host = func(*args, **{k: v for k, v in kwargs.items() if k not in ("device", "requires_grad")})
            return host.to(META).requires_grad_(requires_grad)
        if func is torch.Tensor.pin_memory and not isinstance(args[0], FakeCuda):
            pinned = args[0].clone()  # no pinned memory on a CPU-only torch: a copy flagged as pinned
            pinned.fake_pinned = True
            return pinned
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and isinstance(args[0], FakeCuda):
            args = (args[0], device_index(args[1]), *args[2:])
        if func is torch.Tensor.cuda:
            func, args, kwargs = torch.Tensor.to, (args[0], META), {"non_blocking": kwargs.get("non_blocking", False)}
        if is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": META}
        if func is torch.Tensor.to:
            args = tuple(META if is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def device_index(index):
    """The Python lists in an index of a FakeCuda made FakeCuda: on a GPU each is copied from the host."""
    if isinstance(index, tuple):
        return tuple(map(device_index, index))
    if isinstance(index, list):
        REC.record("CPU tensor in device op", f"Python list of {len(index)} as an index")
        return FakeCuda(torch.tensor(index))
    return index


class HostGenerator(torch.Generator):
    """torch.Generator("cuda") made on the host: its draws (device=cuda) land on the fake GPU, as a GPU's do."""

    def __new__(cls, device="cpu"):
        return torch._C.Generator(CPU if is_cuda(device) else device)


@contextlib.contextmanager
def fake_gpu():
    """While active, torch sees one GPU, and tensors put on it are FakeCuda."""
    save = torch.save
    foreach = [importlib.import_module(name)._foreach_supported_types  # Adam runs its foreach kernels, as on a GPU
               for name in ("torch.optim.optimizer", "torch.utils._foreach_utils")]
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"is_available": lambda: True, "device_count": lambda: 1, "get_rng_state_all": lambda: [],
                            "mem_get_info": lambda *a: (64 << 30, 80 << 30), "set_rng_state": lambda *a: None}.items():
            patch.setattr(torch.cuda, name, value)
        patch.setattr(torch, "Generator", HostGenerator)
        patch.setattr(torch, "save", lambda obj, *a, **k: save(
            tree_map(lambda x: x.elem.detach() if isinstance(x, FakeCuda) else x, obj), *a, **k))
        for supported in foreach:
            supported.append(FakeCuda)
        try:
            with DispatchMode(), FunctionMode():
                yield
        finally:
            for supported in foreach:
                supported.remove(FakeCuda)


# ---------------------------------------------------------------- when a gradient step runs
class StepTracer:
    """A sys.settrace hook that calls REC.begin() and REC.end() around each gradient step (see the top)."""

    def __init__(self, module):
        main = module.main.__code__
        nested = {code.co_name: code for code in main.co_consts if isinstance(code, types.CodeType)}
        self.loop = {main} | {code for name, code in nested.items() if name.startswith("<")}  # its comprehensions
        self.samples = {cls.sample.__code__ for cls in vars(module).values() if isinstance(cls, type)
                        and cls.__module__ == module.__name__ and hasattr(cls, "add") and hasattr(cls, "sample")}
        self.updates = {nested[name] for name in ("update", "sac_update") if name in nested}
        self.actions = getattr(getattr(module, "env_actions", None), "__code__", None)
        self.evaluation = inspect.unwrap(module.evaluate).__code__ if self.actions else None
        self.ppo = nested.get("ppo_update")
        if self.ppo:
            (ppo,) = [f for f in ast.walk(ast.parse(inspect.getsource(module)))
                      if isinstance(f, ast.FunctionDef) and f.name == "ppo_update"]
            (loop,) = [f for f in ast.walk(ppo)
                       if isinstance(f, ast.For) and "grad_steps_per_epoch" in ast.unparse(f.iter)]
            self.minibatch_lines = range(loop.body[0].lineno, loop.end_lineno + 1)

    def __call__(self, frame, event, arg):  # called at each function call
        if frame.f_code in self.samples and frame.f_back.f_code in self.loop:
            REC.begin()
        elif frame.f_code in self.updates:
            REC.begin()
            frame.f_trace_lines = False
            return self.end_at_return
        elif frame.f_code is self.ppo:
            return self.ppo_lines
        elif frame.f_code is self.actions:
            REC.begin_actions()
            frame.f_trace_lines = False
            return self.end_at_return
        elif frame.f_code is self.evaluation:
            REC.begin_evaluation()
            frame.f_trace_lines = False
            return self.end_evaluation_at_return
        return None

    def end_at_return(self, frame, event, arg):
        if event == "return":
            REC.end()
        return self.end_at_return

    def end_evaluation_at_return(self, frame, event, arg):
        if event == "return":
            REC.end_evaluation()
        return self.end_evaluation_at_return

    def ppo_lines(self, frame, event, arg):
        if event == "line" and frame.f_lineno in self.minibatch_lines:
            REC.begin()
        elif event in ("line", "return"):  # the loop's header again, or past the loop
            REC.end()
        return self.ppo_lines


# ---------------------------------------------------------------- one target, in this process
def with_injected_syncs(loss_function):
    """csf's φ loss with two syncs added: what the test must catch (Recorder.record knows this function's name)."""
    def loss_with_syncs(dphi, *args, **kwargs):
        loss, logsumexp = loss_function(dphi, *args, **kwargs)
        loss.item()  # injected: D2H read
        dphi[torch.arange(len(dphi))]  # injected: CPU tensor in device op
        return loss, logsumexp
    return loss_with_syncs


def probe(target, workdir):
    """Run `target`'s main under the fake GPU and the step tracer; return its report (JSON-able)."""
    module = importlib.import_module("hierarchical" if target.startswith("hier") else target.split("+")[0])
    os.makedirs(os.path.join(workdir, target, "child"))
    with contextlib.chdir(os.path.join(workdir, target)), contextlib.redirect_stdout(io.StringIO()), \
            pytest.MonkeyPatch.context() as patch:
        flags = AGENT_FLAGS
        if target in HIER_TASKS:  # a tiny csf child, made on the plain CPU without a gradient step
            task, env_id = HIER_TASKS[target]
            csf = importlib.import_module("csf")
            with contextlib.chdir("child"):
                csf.main(*csf.parse_args(["--env-id", env_id, "--total-env-steps", "400", "--num-envs", "2",
                                          "--grad-steps-per-epoch", "0", "--hidden-dim", "16", "--num-eval-skills", "1",
                                          "--no-cuda"]))
            flags = ("--checkpoint", os.path.abspath(glob.glob("child/runs/*")[0]), "--task", task, *HIER_FLAGS)
        if target in ON_DEVICE:
            flags = (*flags, "--buffer-on-device")
        if target == INJECTED:
            patch.setattr(module, "contrastive_phi_loss", with_injected_syncs(module.contrastive_phi_loss))
        parsed, tracer, error = module.parse_args(list(flags)), StepTracer(module), None
        REC.__init__()
        try:
            with fake_gpu():
                sys.settrace(tracer)
                try:
                    module.main(*parsed)
                finally:
                    sys.settrace(None)
        except BaseException:  # noqa: BLE001 - reported with the target
            error = traceback.format_exc()
        logs = glob.glob("runs/*/eval.jsonl")
        grad_steps = json.loads(open(logs[0]).readlines()[-1])["grad_steps"] if logs else None
        env_steps = json.loads(open(logs[0]).readlines()[-1])["env_steps"] if logs else None
    return {"target": target, "error": error, "steps": REC.step, "grad_steps": grad_steps, "events": REC.events,
            "actions": REC.actions, "env_steps": env_steps, "evaluations": REC.evaluations}


# ---------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Every target probed (even under -k), by two subprocesses at once, each running its share one by one."""
    assert sorted(sum(SHARES, ())) == sorted((*TARGETS, INJECTED))
    cwd = tmp_path_factory.mktemp("host_syncs")
    runs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *share], cwd=cwd, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for share in SHARES]
    found = {}
    for run, share in zip(runs, SHARES):
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
        found.update((report["target"], report) for report in map(json.loads, out.splitlines()[-len(share):]))
    return found


def stalls(report):  # everything in the gradient steps but the allowed copies
    return [e for e in report["events"] if e["kind"] != "H2D async copy" and e["stage"] == "gradient step"]


def explain(report):
    counts = collections.Counter((e["kind"], e["where"], e["source"], e["detail"], e["via"]) for e in stalls(report))
    return f"{report['target']}: the GPU waits for the host in its {report['steps']} gradient steps at\n" + "\n".join(
        f"  {where}: {kind} ×{n}: {source}\n      ({detail}; called from {via})"
        for (kind, where, source, detail, via), n in counts.items())


@pytest.mark.parametrize("target", TARGETS)
def test_a_gradient_step_never_waits_for_the_host(reports, target):
    report = reports[target]
    assert report["error"] is None, report["error"]
    if stalls(report):
        pytest.fail(explain(report), pytrace=False)


def test_the_tracer_sees_every_gradient_step_and_its_batch_copies(reports):
    for target in TARGETS:
        report = reports[target]
        assert report["steps"] == report["grad_steps"] >= 6, (target, report["steps"], report["grad_steps"])
        copied = {e["step"] for e in report["events"]
                  if e["kind"] == "H2D async copy" and e["stage"] == "gradient step"}
        if target in ON_DEVICE:  # the batch is drawn and gathered on the device
            assert copied == set(), target
        else:
            assert copied == set(range(1, report["steps"] + 1)), target  # each step's batch, sent to the device


@pytest.mark.parametrize("target", [t for t in TARGETS if not t.startswith("hier")])
def test_an_env_steps_actions_copy_the_observations_async_and_wait_once_for_the_actions(reports, target):
    """Each call of env_actions: the observations to the device from pinned memory (an async copy), the actions back
    (the one read), nothing else; for every collection step and every evaluation step."""
    report = reports[target]
    assert report["error"] is None, report["error"]
    epochs = report["env_steps"] // 400  # 2 envs of 200 steps an epoch, evaluated at the first and the last
    assert report["actions"] == (epochs + 2) * 200, (report["actions"], report["env_steps"])
    per_call = collections.defaultdict(collections.Counter)
    for e in report["events"]:
        if e["stage"] == "actions":
            per_call[e["step"]][e["kind"], e["source"]] += 1
    expected = {("H2D async copy", "obs = obs.to(skill.device, non_blocking=True)"): 1,
                ("D2H read", "action = action.cpu().numpy()  # the one wait for the device"): 1}
    assert len(per_call) == report["actions"]
    odd = {step: dict(calls) for step, calls in per_call.items() if calls != expected}
    assert not odd, list(odd.items())[:3]


@pytest.mark.parametrize("target", [t for t in TARGETS if not t.startswith("hier")])
def test_an_evaluation_copies_nothing_at_each_step_but_in_env_actions(reports, target):
    """Around env_actions, an evaluation's copies and reads (its skills, its E‖Δφ‖² batches, its means) are a few,
    none of them once per env step."""
    report = reports[target]
    assert report["error"] is None and report["evaluations"] == 2, (report["error"], report["evaluations"])
    around = collections.Counter((e["step"], e["kind"], e["where"], e["source"]) for e in report["events"]
                                 if e["stage"] == "evaluation")
    assert around, target  # the tracer sees inside evaluate: its means come back to the host
    per_step = {key: n for key, n in around.items() if n >= 200}  # 200 steps an evaluation
    assert not per_step, per_step


def test_an_injected_item_and_cpu_index_are_caught_once_per_step_at_their_line(reports):
    report = reports[INJECTED]
    assert report["error"] is None and report["steps"] == report["grad_steps"] == 6, report
    lines, first = inspect.getsourcelines(with_injected_syncs)
    expected = {(step, kind, f"test_host_syncs.py:{first + i}") for step in range(1, 7)
                for i, text in enumerate(lines) for kind in ("D2H read", "CPU tensor in device op")
                if text.rstrip().endswith(f"# injected: {kind}")}
    found = collections.Counter((e["step"], e["kind"], e["where"]) for e in stalls(report)
                                if e["where"].startswith("test_host_syncs.py:"))  # csf's own: the csf test's
    assert len(expected) == 12 and found == dict.fromkeys(expected, 1), explain(report)
    assert "D2H read ×6: loss.item()" in explain(report) and "called from csf.py:" in explain(report)


if __name__ == "__main__":  # python tests/test_host_syncs.py TARGET...: a JSON report per target, a line each
    sys.path.insert(0, ROOT)
    os.environ.setdefault("MPLBACKEND", "Agg")
    import envs  # noqa: F401 - before anything imports mujoco (see tests/conftest.py)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as workdir:
        for name in sys.argv[1:]:
            print(json.dumps(probe(name, workdir)), flush=True)
