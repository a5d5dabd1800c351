"""The user guide (docs/) and the README: every Python block runs and
checks what it claims, the backend table matches the kernels' rules, and
the site builds.

Pages run in one namespace each, block after block; docs/torch.md runs in
the torch environment (tests/torch/test_torch_docs.py), docs/tpu.md where
libtpu is installed.
"""
from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# The pages whose blocks run here, and what each must define afterwards.
PAGES = {"attention.md": ("out", "dq"), "int8.md": ("y", "grads"),
         "quantized.md": ("y4", "y8", "grads"),
         "boxes.md": ("loss", "keep", "per_image"),
         "grouped_matmul.md": ("out", "grads"),
         "serving.md": ("out", "windowed", "mla_out")}


def page_blocks(page: str) -> list[str]:
  return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)


def sharding_blocks():
  """docs/sharding.md's examples: (JAX blocks, PyTorch blocks)."""
  blocks = page_blocks("sharding.md")
  torch_blocks = [b for b in blocks if "import torch" in b]
  return [b for b in blocks if b not in torch_blocks], torch_blocks


def _run(page, blocks):
  namespace: dict = {}
  for block in blocks:
    exec(compile(block, str(DOCS / page), "exec"), namespace)  # noqa: S102
  return namespace


def test_every_page_with_code_is_run_by_a_test():
  with_code = {p.name for p in DOCS.glob("*.md") if page_blocks(p.name)}
  assert with_code == set(PAGES) | {"sharding.md", "torch.md", "tpu.md"}


def _check_boxes(boxes):
  count = int(boxes["count"])
  kept = np.asarray(boxes["keep"])
  assert 0 < count <= 200 and np.all(kept[count:] == -1)
  assert np.all(np.diff(np.asarray(boxes["scores"])[kept[:count]]) <= 0)
  assert boxes["per_image"].tolist() == [count, count]  # the same boxes


# Values a page's results must have, beyond its own asserts.
CHECKS = {"boxes.md": _check_boxes}


@pytest.mark.parametrize("page", sorted(PAGES))
def test_page_examples_run(page, capsys):
  namespace = _run(page, page_blocks(page))
  for name in PAGES[page]:
    assert name in namespace, (page, name)
  CHECKS.get(page, lambda _: None)(namespace)


def test_readme_tour_runs(capsys):
  blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(),
                      re.S)
  namespace = _run("README.md", blocks[:1])
  assert namespace["keep"].tolist() == [0, 2, -1]
  assert capsys.readouterr().out.strip().endswith("[0, 2, -1] 2")


@pytest.mark.tpu_aot
def test_tpu_page_compiles():
  pytest.importorskip("libtpu")
  namespace = _run("tpu.md", page_blocks("tpu.md"))
  assert namespace["r"].memory is not None
  assert namespace["t"]["bound"] == "mxu"


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_sharding_examples_run():
  jax_blocks, torch_blocks = sharding_blocks()
  assert len(jax_blocks) == 4 and len(torch_blocks) == 1, \
      "docs/sharding.md lost an example"
  source = "\n".join(jax_blocks)
  if not hasattr(jax, "set_mesh"):  # jax < 0.8
    source = source.replace("jax.set_mesh(", "jax.sharding.use_mesh(")
  *forms, context_parallel = jax_blocks
  assert "sequence_axis" in context_parallel
  for block in forms:
    # Every family in every form.
    for op in ("attention", "int8_matmul", "nms"):
      assert op in block, (op, block[:200])
  namespace = _run("sharding.md", [source])
  assert namespace["out"].shape == (4, 8, 128, 64)
  np.testing.assert_allclose(np.asarray(namespace["y"]), 256.0, rtol=2e-2)
  assert namespace["y"].shape == (16, 512)
  assert namespace["count"].tolist() == [1] * 8
  assert float(namespace["loss"]) == pytest.approx(0.0, abs=1e-6)
  assert namespace["ring_out"].shape == (2, 4, 128, 64)
  assert namespace["ring_grad"].shape == (2, 4, 128, 64)


@pytest.mark.skipif(
    tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 10),
    reason="the page documents the newest jax (Mosaic GPU needs jax >= 0.10)")
def test_backend_table_matches_the_kernels():
  spec = importlib.util.spec_from_file_location("support_table",
                                                DOCS / "support_table.py")
  table = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(table)
  page = table.PAGE.read_text()
  assert table.render(page) == page, (
      "docs/backends.md is stale: run python docs/support_table.py")


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is installed in the newest-jax env only")
def test_guide_builds(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
       str(tmp_path / "site"), "--config-file", str(ROOT / "mkdocs.yml")],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert (tmp_path / "site" / "backends" / "index.html").exists()
