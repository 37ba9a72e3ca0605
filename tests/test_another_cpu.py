"""The goldens and the float32 tolerances hold on a CPU of another kind (issue 56: a fresh clone's ``make test`` on
another x86-64 CPU failed on a golden argmax of rounding errors and on a fixed atol that float32 sums exceeded).

The tests that compare against stored values or float32 bounds run again in a fresh interpreter whose torch kernels
take another vector width: ``ATEN_CPU_CAPABILITY=default`` (no AVX2 / AVX-512 kernels), MKL limited to SSE4.2,
oneDNN to SSE4.1, one thread. Their sums then run in another order, as on another CPU: on this AVX-512 machine it
fails the golden of the issue (the self-check's worst parameter, '2.weight' for '0.bias'), and it passes once the
golden holds only what is stable (24 s). It need not reproduce every other CPU's last bits: against the RGP
layer's old atol 1e-6 (1.9e-6 on the reporter's CPU) it measures 7.2e-7 here (9.5e-7 with avx2 kernels), and
passes; the bounds derived from float32 rounding are what make such a test hold anywhere. What it cannot see: a
CPU whose libm or random-number kernels differ, numpy's own SIMD dispatch (float64 there), and GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent
#: the golden comparisons and the tolerances derived from float32 rounding
SELECTED = [
    "test_refactor_identity.py",
    "test_identity_entry_points.py",
    "test_finetune_rgp.py::test_rgp_linear_computes_the_original_linear_and_conv1d",
    "test_stp_geometry.py",
    "test_grads.py",
]
OTHER_CPU = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "OMP_NUM_THREADS": "1",
}


@pytest.mark.slow
def test_goldens_and_float32_tolerances_hold_with_another_vector_width():
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU already runs torch's default (non-vectorized) kernels: no other width to try")
    env = {**os.environ, **OTHER_CPU}
    env.pop("PYTEST_ADDOPTS", None)
    probe = [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"]
    width = subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert width == "DEFAULT", f"ATEN_CPU_CAPABILITY=default did not take: torch runs {width} kernels"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow"]
        + [str(TESTS / s) for s in SELECTED],
        env=env,
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"with {OTHER_CPU}:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    assert " passed" in done.stdout.splitlines()[-1]
