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


def sharding_blocks():
  """The Sharding section's examples: (JAX blocks, PyTorch blocks)."""
  blocks = _python_blocks(_section("Sharding"))
  torch_blocks = [b for b in blocks if "import torch" in b]
  return [b for b in blocks if b not in torch_blocks], torch_blocks


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_sharding_examples_run():
  jax_blocks, torch_blocks = sharding_blocks()
  assert len(jax_blocks) == 3 and len(torch_blocks) == 1, \
      "the Sharding section lost an example"
  source = "\n".join(jax_blocks)
  if not hasattr(jax, "set_mesh"):  # jax < 0.8
    source = source.replace("jax.set_mesh(", "jax.sharding.use_mesh(")
  namespace: dict = {}
  for block in jax_blocks:
    # Every family in every form.
    for op in ("attention", "int8_matmul", "nms"):
      assert op in block, (op, block[:200])
  exec(compile(source, str(README), "exec"), namespace)  # noqa: S102
  np = pytest.importorskip("numpy")
  assert namespace["out"].shape == (4, 8, 128, 64)
  np.testing.assert_allclose(np.asarray(namespace["y"]), 256.0, rtol=2e-2)
  assert namespace["y"].shape == (16, 512)
  assert namespace["count"].tolist() == [1] * 8
  assert float(namespace["loss"]) == pytest.approx(0.0, abs=1e-6)
