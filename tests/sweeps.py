"""Sweeps split between the default suite and ``--runslow``."""
from __future__ import annotations

import pytest


def covering_pairs(values, cases):
  """pytest params ``(value, *case)`` of the cross product: by default case
  i pairs with value i mod len(values), so every case and every value run
  at least once; the other pairs are marked slow."""
  out = []
  for i, case in enumerate(cases):
    for j, value in enumerate(values):
      marks = [] if j == i % len(values) else [pytest.mark.slow]
      out.append(pytest.param(value, *case, marks=marks))
  return out
