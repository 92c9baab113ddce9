"""The README's code runs as written (at a small shape), so its examples cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np

README = Path(__file__).resolve().parents[1] / "README.md"
#: The Usage example's Llama-3 shapes, shrunk so the whole README runs in seconds on a CPU.
SMALLER = {"(8, 1024, 4096)": "(8, 16, 64)", "(4096, 128256)": "(64, 512)", "(8, 1024)": "(8, 16)"}


def python_blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    return [b for b in blocks if '"mine"' not in b]  # the backend template (`...` bodies) and its check


def test_readme_examples_run_in_order_on_8_devices():
    assert len(jax.devices()) >= 8
    namespace: dict = {}
    for block in python_blocks():
        for big, small in SMALLER.items():
            block = block.replace(big, small)
        exec(compile(block, str(README), "exec"), namespace)
    # The last example's loss: the mean over tokens of uniform-looking logits (x and w are ones, so
    # every logit is equal and the loss is log V).
    assert np.isclose(float(namespace["loss"]), np.log(512), rtol=1e-2), namespace["loss"]
