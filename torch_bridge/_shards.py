"""A torch op's shard specs, from its pallas_kernels sharding rule:
``partition_spec`` names mesh axes for the dims of one lead array (an operand
or the output); each dim's factor is split the same way wherever it appears
(tied factors with it), the rest replicated. docs/design/torch_bridge.md.
"""
from __future__ import annotations

from typing import Sequence

Spec = tuple


def specs(op: str, rule, spec: Spec, arrays: Sequence, names: Sequence[str],
          *, lead: str | tuple[str, str], why: str, what: str | None = None,
          describe: dict[str, str] | None = None, split: str | None = None,
          results: int | None = None) -> tuple[list, list]:
  """``(in_specs, out_specs)`` of ``op`` on ``arrays`` (called ``names``;
  None where absent) for the ``partition_spec`` ``spec``.

  lead: the operand ``spec`` describes, or ``(label, factors)`` of another
    array (the output), whose shape the operands' factor sizes give.
  why: ends the message for an unsplittable dimension.
  what: the lead's dimensions, for the message on a spec of the wrong
    length. describe: factor names that override the rule's.
  split: the factors that may be split, where the bridge allows fewer than
    the rule (default: the rule's).
  results: how many of the rule's results the op returns (default all).
  """
  if len(names) != len(arrays):
    raise AssertionError(f"{op}: {len(arrays)} arrays, {len(names)} names")
  factors = {name: f for name, f in rule.operands}
  sizes: dict[str, int] = {}
  for name, a in zip(names, arrays):
    f = factors.get(name)
    if a is not None and f is not None and len(f) == a.dim():
      for factor, size in zip(f, a.shape):
        sizes.setdefault(factor, size)
  if isinstance(lead, str):
    label, lead_factors = lead, factors[lead]
    shape = tuple(arrays[list(names).index(lead)].shape)
  else:
    label, lead_factors = lead[0], tuple(lead[1].split())
    shape = tuple(sizes.get(f, 1) for f in lead_factors)
  if len(spec) != len(shape):
    what = f" ({what})" if what else ""
    raise ValueError(f"{op}: partition_spec {spec!r} must have one entry per "
                     f"dimension of {label}{what}, shape {shape}")
  allowed = rule.split if split is None else frozenset(split.split())
  owner = label + ("'" if label.endswith("s") else "'s")
  axes = {}
  for dim, (factor, entry) in enumerate(zip(lead_factors, spec)):
    if entry is None:
      continue
    if factor not in allowed:
      name = (describe or {}).get(factor) or rule.describe(factor)
      raise ValueError(f"{op}: partition_spec {spec!r} splits {owner} dim "
                       f"{dim} ({name}) over mesh axis {entry!r}, but {why}")
    axes[factor] = entry
  for group in rule.tied:
    chosen = next((axes[f] for f in group if f in axes), None)
    if chosen is not None:
      axes.update((f, chosen) for f in group)

  def spec_of(f, ndim):
    if f is None or len(f) != ndim:
      # A rule's operand of another rank (a 0-d offset passed as [1]) may
      # carry no split factor: replicated.
      if f is not None and any(x in axes for x in f):
        raise AssertionError(f"{op}: rule factors {f} for rank {ndim}")
      return (None,) * ndim
    return tuple(axes.get(x) for x in f)

  ins = [None if a is None else spec_of(factors.get(name), a.dim())
         for name, a in zip(names, arrays)]
  kept = rule.results[:results]
  for i, over in enumerate(rule.sums[:len(kept)]):
    split_over = [f for f in over if f in axes]
    if split_over:
      raise ValueError(f"{op}: result {i} is a sum over the "
                       f"{rule.describe(split_over[0])} dimension, which "
                       f"partition_spec {spec!r} splits")
  return ins, [tuple(axes.get(x) for x in r) for r in kept]
