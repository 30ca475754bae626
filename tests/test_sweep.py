"""benchmarks/sweep.py: the report on hand-made runs, a local sweep that finishes and reports, a killed sweep that a
second run resumes, the SLURM parameters through submitit's debug executor, and refused combinations."""

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import submitit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# appended, after the root: benchmarks/goal_reaching.py and hierarchical.py must not hide the scripts
sys.path.append(os.path.join(ROOT, "benchmarks"))
import sweep  # noqa: E402

TINY = ["--num-envs", "2", "--learning-starts", "400", "--grad-steps-per-epoch", "2", "--batch-size", "16",
        "--hidden-dim", "16", "--num-eval-skills", "2", "--eval-every", "1", "--no-cuda"]


def write_run(folder, coverages, steps=(0, 800, 1600)):
    os.makedirs(os.path.join(folder, "runs", "r"))
    with open(os.path.join(folder, "runs", "r", "eval.jsonl"), "w") as f:
        for s, c in zip(steps, coverages):
            f.write(json.dumps({"env_steps": s, "coverage": c}) + "\n")


def test_report_of_hand_made_runs(tmp_path):
    lines = []
    for agent, seed, coverages in (("metra", 1, [5, 7, 9]), ("csf", 1, [4, 10, 30]), ("csf", 2, [4, 20, 50])):
        folder = f"{agent}_Ant_seed{seed}"
        write_run(tmp_path / folder, coverages)
        lines.append({"agent": agent, "env_id": "Ant", "seed": seed, "status": "done", "folder": folder,
                      "command": f"python {agent}.py --env-id Ant --seed {seed}"})
    goal = {"results": {"adaptive": {"mean": {"staying_time_3": 0.25, "final_distance": 12.0}}}}
    (tmp_path / "csf_Ant_seed1" / "runs" / "r" / "goal_reaching.json").write_text(json.dumps(goal))
    (tmp_path / "sweep.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    sweep.report(str(tmp_path))
    text = (tmp_path / "report.md").read_text()
    assert "| csf | Ant | 1, 2 | 1,600 | 40.0 (30–50) | 12 | 0.25 |" in text  # final distance, staying time
    assert "| metra | Ant | 1 | 1,600 | 9.0 (9–9) | – | – |" in text
    assert text.index("| metra |") < text.index("| csf |")  # rows in the order of sweep.jsonl, as the command listed them
    assert (tmp_path / "report.png").stat().st_size > 0
    steps, mean, low, high = sweep.curves([[{"env_steps": 0, "coverage": 4}, {"env_steps": 800, "coverage": 10}],
                                           [{"env_steps": 0, "coverage": 6}]])
    assert steps.tolist() == [0] and (mean[0], low[0], high[0]) == (5, 4, 6)  # only the steps every seed reached


def run_sweep(sweep_dir, *extra, **popen):
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "sweep.py"), "--sweep-dir", str(sweep_dir),
               "--progress-every", "1", *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def test_local_sweep_finishes_reports_and_skips_what_is_done(tmp_path):
    proc = run_sweep(tmp_path, "--agents", "csf", "metra", "--env-ids", "Ant", "--seeds", "1", "2", "--workers", "2",
                     "--", "--total-env-steps", "400", *TINY)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    states = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert [(s["agent"], s["seed"], s["status"]) for s in states] == [
        ("csf", 1, "done"), ("csf", 2, "done"), ("metra", 1, "done"), ("metra", 2, "done")]
    assert "| csf | Ant | 1, 2 | 400 |" in (tmp_path / "report.md").read_text()
    proc = run_sweep(tmp_path, "--agents", "csf", "metra", "--env-ids", "Ant", "--seeds", "1", "2", "--",
                     "--total-env-steps", "400", *TINY)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "4 runs, 4 already done" in out  # the same command again: nothing to run


def test_a_killed_sweep_resumes_from_the_checkpoints(tmp_path):
    flags = ["--agents", "csf", "--env-ids", "Ant", "--seeds", "1", "--", "--total-env-steps", "2000",
             "--checkpoint-every", "1", *TINY]
    proc = run_sweep(tmp_path, *flags, start_new_session=True)
    folder = tmp_path / "csf_Ant_seed1"
    deadline = time.time() + 300
    while not list(folder.glob("runs/*/checkpoint.pt")) and time.time() < deadline:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep, submitit's controller and the agent: the whole group
    proc.wait()
    (run_dir,) = folder.glob("runs/*")
    interrupted = [json.loads(line)["epoch"] for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert interrupted[-1] < 5
    proc = run_sweep(tmp_path, *flags)  # the same command again
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert "resumed" in (folder / "stdout.log").read_text()
    epochs = [json.loads(line)["epoch"] for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert epochs[-1] == 5 and epochs == sorted(set(epochs))  # continued to the budget, no evaluation twice


def test_slurm_parameters_through_the_debug_executor(tmp_path):
    args = SimpleNamespace(partition="gpu", gpus_per_run=1, time=90, mem=16, cpus_per_run=4)
    params = sweep.slurm_parameters(args)
    assert params == {"slurm_partition": "gpu", "gpus_per_node": 1, "timeout_min": 90, "mem_gb": 16,
                      "cpus_per_task": 4, "nodes": 1, "tasks_per_node": 1}
    executor = submitit.AutoExecutor(tmp_path, cluster="debug")
    executor.update_parameters(**params)  # every parameter is one submitit knows
    (tmp_path / "run").mkdir()
    job = executor.submit(sweep.run_job, [sys.executable, "-c", "print('hello from a run')"], str(tmp_path / "run"), 1)
    assert job.result() == 0 and "hello from a run" in (tmp_path / "run" / "stdout.log").read_text()


def test_refused_combinations_are_skipped_with_one_line(tmp_path, capsys):
    runs = sweep.plan(["csf", "metra"], ["Ant", "Hopper"], [1, 2], ["--hidden-dim", "16"], str(tmp_path))
    assert [(r["agent"], r["env_id"], r["seed"]) for r in runs] == [("csf", "Ant", 1), ("csf", "Ant", 2),
                                                                    ("metra", "Ant", 1), ("metra", "Ant", 2)]
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"skipped {a} on Hopper: {a}.py: error: unknown --env-id 'Hopper'; choose one of "
                     + ", ".join(sweep.envs.ENV_SPECS) for a in ("csf", "metra")]
    assert runs[0]["final_env_steps"] == 64_000_000  # the paper's budget, from the agent's own defaults
    runs = sweep.plan(["dads"], ["HalfCheetah", "Quadruped"], [1], [], str(tmp_path))
    assert [r["env_id"] for r in runs] == ["HalfCheetah"]
    assert capsys.readouterr().out.strip() == ("skipped dads on Quadruped: dads.py: error: DADS runs on Ant and "
                                               "HalfCheetah only, as in the paper, not on Quadruped")
    with pytest.raises(SystemExit):
        sweep.main(["--report", str(tmp_path)])  # not a sweep folder


def test_variants_are_runs_of_their_own_and_rows_of_their_own(tmp_path, capsys):
    runs = sweep.plan(["csf"], ["HalfCheetah"], [1], ["--hidden-dim", "16"], str(tmp_path),
                      ["--critic inner", "--critic mlp", "--critic nonsense"])
    assert [(os.path.basename(r["folder"]), r["argv"][4:6]) for r in runs] == [
        ("csf_critic-inner_HalfCheetah_seed1", ["--critic", "inner"]), ("csf_critic-mlp_HalfCheetah_seed1", ["--critic", "mlp"])]
    assert "skipped csf --critic nonsense on HalfCheetah: csf.py: error: --critic must be one of" in capsys.readouterr().out
    for run, coverage in zip(runs, (30, 3)):
        run["status"] = "done"
        write_run(run["folder"], [2, coverage], steps=(0, 1600))
    sweep.write_state(str(tmp_path), runs)
    sweep.report(str(tmp_path))
    text = (tmp_path / "report.md").read_text()
    assert "| csf --critic inner | HalfCheetah | 1 | 1,600 | 30.0 (30–30) |" in text
    assert "| csf --critic mlp | HalfCheetah | 1 | 1,600 | 3.0 (3–3) |" in text


def test_a_run_finished_in_a_sibling_sweep_is_linked_not_run_again(tmp_path):
    flags = ["--total-env-steps", "800", *TINY]  # HalfCheetah with 2 envs: 400 env steps per epoch, 2 epochs
    first = sweep.plan(["csf"], ["HalfCheetah"], [1], flags, str(tmp_path / "critic"), ["", "--critic mlp"])
    for run, coverage in zip(first, (30, 3)):
        run["status"] = "done"
        write_run(run["folder"], [2, coverage], steps=(0, 800))
    sweep.write_state(str(tmp_path / "critic"), first)
    proc = run_sweep(tmp_path / "xi", "--agents", "csf", "--env-ids", "HalfCheetah", "--seeds", "1",
                     "--variants", "--xi 5", "--xi 2", "--", *flags)  # ξ = 5 is the default: the first run again
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert "reused critic/csf_HalfCheetah_seed1 for `python csf.py --env-id HalfCheetah --seed 1 --xi 5 " in out
    assert "2 runs, 1 already done" in out
    assert os.path.islink(tmp_path / "xi" / "csf_xi-5_HalfCheetah_seed1")  # linked to the first sweep's run
    assert not os.path.islink(tmp_path / "xi" / "csf_xi-2_HalfCheetah_seed1")  # another experiment: run here
    assert not os.path.islink(tmp_path / "critic" / "csf_critic-mlp_HalfCheetah_seed1")
    text = (tmp_path / "xi" / "report.md").read_text()
    assert "| csf --xi 5 | HalfCheetah | 1 | 800 | 30.0 (30–30) |" in text
    assert "| csf --xi 2 | HalfCheetah | 1 | 800 |" in text


def test_two_commands_in_one_sweep_folder_keep_each_others_runs(tmp_path):
    three_million = sweep.plan(["csf"], ["Ant"], [1, 2], ["--total-env-steps", "3000000"], str(tmp_path))
    one_million = sweep.plan(["dads"], ["Ant"], [1], ["--total-env-steps", "1000000"], str(tmp_path))
    sweep.write_state(str(tmp_path), three_million)
    sweep.write_state(str(tmp_path), one_million)
    three_million[1]["status"] = "done"
    sweep.write_state(str(tmp_path), three_million)  # the first command again: its lines updated in their place
    states = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert [(s["agent"], s["seed"], s["status"]) for s in states] == [
        ("csf", 1, "pending"), ("csf", 2, "done"), ("dads", 1, "pending")]
    assert states[2]["command"] == "python dads.py --env-id Ant --seed 1 --total-env-steps 1000000"


def test_a_hierarchical_run_started_in_a_run_folder_is_reported_and_not_mistaken_for_the_agent(tmp_path):
    folder = tmp_path / "csf_Ant_seed1"
    write_run(folder, [4, 10, 30])
    (folder / "runs" / "r" / "checkpoint.pt").write_bytes(b"agent")
    high = folder / "runs" / "AntMultiGoal__hierarchical_csf__1__99"  # sorts before "r"
    high.mkdir()
    (high / "eval.jsonl").write_text(json.dumps({"env_steps": 50, "coverage": 0, "return_past10": 21.4}) + "\n")
    (high / "checkpoint.pt").write_bytes(b"high level")
    assert sweep.agent_run_files(str(folder), "eval.jsonl") == [str(folder / "runs" / "r" / "eval.jsonl")]
    assert [e["coverage"] for e in sweep.read_evals(str(folder))] == [4, 10, 30]
    run = {"agent": "csf", "argv": ["--env-id", "Ant"], "folder": str(folder)}
    assert sweep.command(run)[-2:] == ["--resume", str(folder / "runs" / "r" / "checkpoint.pt")]
    assert sweep.goal_and_hierarchical_results(str(folder)) == {"AntMultiGoal return (past 10)": 21.4}
