"""Sweeps split between the default suite and ``--runslow``."""
from __future__ import annotations

import pytest


def each_case_on_one_topology(topologies, cases):
  """pytest params ``(topology, *case)``: by default case i compiles for
  topology i mod len(topologies), so every case and every topology compile
  at least once; the rest of the cross product is marked slow."""
  out = []
  for i, case in enumerate(cases):
    for j, topology in enumerate(topologies):
      marks = [] if j == i % len(topologies) else [pytest.mark.slow]
      out.append(pytest.param(topology, *case, marks=marks))
  return out
