"""The benchmarks that measure on a GPU say so on a machine without one (a CUDA traceback before)."""
import runpy
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
GPU_ONLY = ["ds_db_one_launch", "grad_split", "kernels", "memory_model", "optimizer", "overlap_probe", "padding_mask",
            "profile_lora", "tune_in_context", "weight_grad_probe"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a CUDA GPU is told")
@pytest.mark.parametrize("name", GPU_ONLY)
def test_a_gpu_benchmark_on_a_machine_without_one_exits_naming_what_it_needs(name, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / f"{name}.py"), "--out", str(tmp_path / "out.json")]
                        if name != "profile_lora" else [str(BENCHMARKS / f"{name}.py")])
    monkeypatch.setattr(sys, "path", list(sys.path))  # (some drop their own folder from it)
    with pytest.raises(SystemExit, match=rf"^benchmarks/{name}\.py measures on a CUDA GPU: torch finds none here$"):
        runpy.run_path(str(BENCHMARKS / f"{name}.py"), run_name="__main__")
    assert not (tmp_path / "out.json").exists()
