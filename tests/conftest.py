"""Shared fixtures: tiny models built from configs, the packing data module, the shared data folder."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors in the interpreter; it must be on before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # workers side by side: one thread of torch's each, and in the processes they start (threads beyond the cores
    # wait on each other: OpenMP's spinning barriers)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*isinstance.treespec, LeafSpec.*")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test's changes to the environment undone after it: a Trainer of a distributed strategy run in the test
    process leaves MASTER_PORT, LOCAL_RANK... (Lightning sets them), which every process started later inherits (an
    adapter-parallel run's launcher, seeing LOCAL_RANK, took its ranks for started by another and never started rank
    1: rank 0 waited for it, then failed; the order of a parallel test run put such a test first)."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture
def triton_backend():
    """The Triton kernels on CPU tensors too (the interpreter), as on CUDA ones; the backend restored after."""
    from lightning_multilora import kernels

    before = kernels.get_backend()
    kernels.set_backend("triton")
    yield
    kernels.set_backend(before)


@pytest.fixture
def exact_fp32():
    """fp32 products in fp32 on the GPU too (tf32 off for matmuls and cuDNN; the Triton kernels then take "ieee"),
    restored afterwards. The switches are properties of module objects, which monkeypatch cannot set."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    prior = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = False
    yield
    matmul.allow_tf32, cudnn.allow_tf32 = prior


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"the shared data folder {SHARED_DATA} is absent (only a project checkout beside shared/ has it)")
    return SHARED_DATA


@pytest.fixture
def tiny_mixtral():
    """A maker of a tiny Mixtral (the byte tokenizer's vocabulary, 4 experts, top 2), seeded: ``make()`` returns its
    router logits and adds ``router_aux_loss_coef`` 0.5 times their load-balancing loss to its loss; ``make(False)``
    returns none."""
    def make(output_router_logits: bool = True) -> torch.nn.Module:
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                               initializer_range=0.1, eos_token_id=257, bos_token_id=None, tie_word_embeddings=False,
                               output_router_logits=output_router_logits, router_aux_loss_coef=0.5)
        torch.manual_seed(0)
        return MixtralForCausalLM(config).float()

    return make


@pytest.fixture
def trainer_kwargs(tmp_path):
    """A quiet CPU Trainer: no sanity check, no progress bar, no checkpoints, logs under tmp_path."""
    return dict(accelerator="cpu", devices=1, max_steps=-1, num_sanity_val_steps=0, enable_progress_bar=False,
                enable_model_summary=False, enable_checkpointing=False, logger=False, default_root_dir=str(tmp_path),
                val_check_interval=10_000, check_val_every_n_epoch=None)
