"""The package's public surface: every exported name resolves to a function."""
from __future__ import annotations

import importlib
import inspect

import pytest

import pallas_kernels as pk
from pallas_kernels import reference


@pytest.mark.parametrize("name", sorted(pk._EXPORTS))
def test_public_op_is_a_function_with_backend_argument(name):
  for family in pk._SUBMODULES:  # importing families must not shadow ops
    importlib.import_module(f"pallas_kernels.{family}")
  op = getattr(pk, name)
  assert inspect.isfunction(op), f"pallas_kernels.{name} is {op!r}"
  if not name.startswith("shard_"):  # helpers pass backend= through kwargs
    assert "backend" in inspect.signature(op).parameters


@pytest.mark.parametrize("name", dir(reference))
def test_reference_exports_resolve(name):
  assert callable(getattr(reference, name))


def test_unknown_attribute():
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    pk.nope  # noqa: B018
