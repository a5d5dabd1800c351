"""The README's Python examples run (so they cannot rot)."""
from __future__ import annotations

import pathlib
import re

import jax
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _section(title):
  text = README.read_text()
  start = text.index(f"## {title}\n")
  end = text.find("\n## ", start + 1)
  return text[start:end if end > 0 else None]


def _python_blocks(section):
  return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_sharding_examples_run():
  blocks = _python_blocks(_section("Sharding"))
  assert blocks, "the Sharding section lost its example"
  source = "\n".join(blocks)
  if not hasattr(jax, "set_mesh"):  # jax < 0.8
    source = source.replace("jax.set_mesh(", "jax.sharding.use_mesh(")
  namespace: dict = {}
  exec(compile(source, str(README), "exec"), namespace)  # noqa: S102
  assert namespace["out"].shape == (4, 8, 128, 64)
  assert float(namespace["loss"]) == pytest.approx(0.0, abs=1e-6)
  assert namespace["y"].shape == (16, 512)
  assert namespace["count"].tolist() == [1] * 8
