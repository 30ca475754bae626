"""benchmarks/gpu_check.py without a GPU: it stops at once with one line; and its arithmetic against cases worked by
hand (the messages' share of a parallel step, the speed between two printed lines, the
paper's run projected).

    python -m pytest -q tests/test_gpu_check.py     # a few seconds
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(ROOT, "benchmarks"))
import gpu_check  # noqa: E402


def test_without_a_gpu_it_stops_at_once_with_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU for torch, even on a machine with one
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1
    assert "no CUDA GPU" in lines[0]


def test_messages_are_the_parallel_step_less_the_busiest_process_share_of_the_envs():
    # 8 envs take 4 ms in one process; the busiest of the parallel processes steps 3 of them: 1.5 ms of envs
    assert gpu_check.messages_ms(2.0, 4.0, 8, 3) == pytest.approx(0.5)
    assert gpu_check.messages_ms(1.0, 4.0, 8, 2) == pytest.approx(0.0)
    assert gpu_check.messages_ms(2.25, 2.0, 8, 1) == pytest.approx(2.0)


def test_the_speed_between_printed_lines():
    # SPS 1600 at 16,000 env steps: 10 s of wall time; SPS 2000 at 32,000: 16 s; between them 16,000 in 6 s
    assert gpu_check.window_speeds([(16_000, 1600), (32_000, 2000)]) == [pytest.approx(16_000 / 6)]
    assert gpu_check.window_speeds([(16_000, 1600), (32_000, 2000), (48_000, 2400)]) == [
        pytest.approx(16_000 / 6), pytest.approx(16_000 / 4)]
    assert gpu_check.window_speeds([(16_000, 1600)]) == []


def test_the_printed_line_is_read():
    line = "epoch 20 | env steps 32,000 | SPS 1893 | 9 h 23 min left | phi_loss -0.1\n"
    match = gpu_check.PRINTED_SPEED.match(line)
    assert (match.group(2), match.group(3)) == ("32,000", "1893")


def test_the_paper_run_is_projected_with_and_without_its_evaluations():
    # Ant: 64M env steps at 3,200/s are 20,000 s; 40,000 epochs, evaluated every 500 and at the end: 81 evaluations
    # of 48 rollouts, each 6 × 0.5 s
    assert gpu_check.paper_hours("Ant", 3200, 0.5) == (pytest.approx(20_000 / 3600),
                                                        pytest.approx((20_000 + 81 * 3) / 3600))
    # Humanoid: 4.8M env steps at 500/s are 9,600 s; 3,000 epochs, every 125: 25 evaluations of 6 × 2 s
    assert gpu_check.paper_hours("Humanoid", 500, 2.0) == (pytest.approx(9600 / 3600),
                                                            pytest.approx((9600 + 25 * 12) / 3600))
