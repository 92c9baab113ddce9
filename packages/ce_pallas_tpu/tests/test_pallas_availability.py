"""Registration and availability: an entry point, listed on TPU, in interpret mode or with a target."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

import ce_core
from ce_core.extend import random_problem


def test_registered_with_the_contract_it_speaks():
    assert "pallas_tpu" in ce_core.installed_backends()
    backend = ce_core.get_backend("pallas_tpu")
    # Version 4: handed the live rows, its kernels skip token blocks with none (issue 43); version 5: the pair
    # statistics of a dense distillation teacher (ce_pallas_tpu.pair).
    assert backend.name == "pallas_tpu" and backend.contract_version == 5
    assert backend.contract_version in ce_core.SUPPORTED_CONTRACT_VERSIONS and backend.takes_live_rows


def test_not_available_on_cpu_without_switches():
    assert jax.default_backend() != "tpu"  # this suite runs without a TPU (see README)
    assert "pallas_tpu" not in ce_core.available_backends()


@pytest.mark.parametrize("name,value", [("CE_PALLAS_TPU_INTERPRET", "1"), ("CE_PALLAS_TPU_TARGET", "v5p")])
def test_available_with_interpret_mode_or_a_target(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert "pallas_tpu" in ce_core.available_backends()
    monkeypatch.delenv(name)
    assert "pallas_tpu" not in ce_core.available_backends()


def test_fallback_chain_moves_past_an_unsupported_call(monkeypatch):
    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "1")
    x, labels, w = random_problem(0, (8,), 16, 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = ce_core.linear_cross_entropy(np.asarray(x, np.float16), labels, np.asarray(w, np.float16),
                                            implementation=("pallas_tpu", "reference"))
    assert np.isfinite(float(loss))
    assert any("float16" in str(item.message) for item in caught)
