"""The package's import: its top-level names, and the one library warning it drops."""

from __future__ import annotations

import logging

import pytest

import lightning_multilora


def test_top_level_names_resolve_and_a_wrong_one_is_an_attribute_error():
    for name in lightning_multilora.__all__:
        assert getattr(lightning_multilora, name).__name__ == name
    with pytest.raises(AttributeError, match=r"module 'lightning_multilora' has no attribute 'MultiLora'"):
        lightning_multilora.MultiLora  # noqa: B018


def test_bitsandbytes_hub_kernel_warning_alone_is_dropped(caplog):
    """Every fit on a CPU with AVX-512 BF16 began with bitsandbytes' "Failed to load CPU gemm_4bit_forward from
    kernels-community" (PEFT imports it for each export; it then runs its own kernel)."""
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you "
                       "already `pip install kernels` and the kernels >= 0.11.1", "no network")
        logger.warning("Some other bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records] == ["Some other bitsandbytes warning"]
