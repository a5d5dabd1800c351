"""The public ops ``torch.ops.pallas_kernels.<name>``: typed schemas built from
the Python functions' signatures, each with one CompositeImplicitAutograd
kernel that calls the function (docs/torch.md, "Public ops").
"""
from __future__ import annotations

import inspect

import torch

from pallas_kernels import _registry

NAMESPACE = "pallas_kernels"

# Schema type of each parameter, by name (``?`` is added where the Python
# default is None).
_TYPES = {
    **dict.fromkeys(
        ("q", "k", "v", "k_cache", "v_cache", "kv_lengths", "x", "w",
         "weight", "w_q", "w_scale", "x_scale", "w_zero", "bias", "sinks",
         "page_table", "k_scale", "v_scale", "boxes1", "boxes2", "pred",
         "target", "boxes", "scores", "class_ids", "q_segment_ids",
         "kv_segment_ids", "lora_a", "lora_b", "lhs", "rhs", "group_sizes",
         "group_offset", "rhs_scale", "kv_pages", "kv_lens", "page_indices",
         "cu_q_lens", "num_seqs"),
        "Tensor"),
    **dict.fromkeys(("causal", "weight_only", "int8_input_grad",
                     "symmetric", "transpose_rhs"), "bool"),
    **dict.fromkeys(("sm_scale", "logit_soft_cap", "eps", "iou_threshold",
                     "score_threshold", "sigma", "lora_scale", "soft_cap",
                     "mask_value"), "float"),
    **dict.fromkeys(("max_output_size", "group_size", "axis",
                     "sliding_window", "num_kv_pages_per_block",
                     "num_queries_per_block", "vmem_limit_bytes",
                     "latent_dim"), "int"),
    **dict.fromkeys(("box_format", "backend", "reduction", "iou_kind",
                     "method", "weight_layout"), "str"),
    **dict.fromkeys(("out_dtype", "dtype", "preferred_element_type"),
                    "ScalarType"),
}
# Per-op exceptions to ``_TYPES`` (``int[1]`` takes an int or a list) and
# outputs, from the op registry.
_OP_TYPES = {op.name: dict(op.torch_types) for op in _registry.torch_ops()}
_RETURNS = {op.name: op.torch_returns for op in _registry.torch_ops()}
# Python parameters that are a pair of tensors: the schema's two arguments.
_PAIRS = {"segment_ids": ("q_segment_ids", "kv_segment_ids"),
          "lora": ("lora_a", "lora_b")}
# Parameters with no schema type: the Python function only.
PYTHON_ONLY = ("mask", "return_lse", "block_sizes", "partition_spec", "mesh")


def _default(value) -> str:
  if isinstance(value, str):
    return '"' + value + '"'
  return repr(value)  # None, True/False, ints, floats


def _argument(op: str, name: str, default) -> str:
  kind = _OP_TYPES.get(op, {}).get(name, _TYPES.get(name))
  if kind is None:
    raise AssertionError(f"{op}: parameter {name} has no schema type")
  if default is inspect.Parameter.empty:
    return f"{kind} {name}"
  if default is None and not kind.endswith("?"):
    kind += "?"
  return f"{kind} {name}={_default(default)}"


def schema(name: str, function) -> str:
  """The schema of ``pallas_kernels::<name>`` (without the name), from the
  signature of its Python ``function``."""
  args, keyword_only = [], False
  for p in inspect.signature(function).parameters.values():
    if p.name in PYTHON_ONLY:
      continue
    if p.kind is p.KEYWORD_ONLY and not keyword_only:
      args.append("*")
      keyword_only = True
    for arg in _PAIRS.get(p.name, (p.name,)):
      args.append(_argument(name, arg, p.default))
  return f"({', '.join(args)}) -> {_RETURNS.get(name, 'Tensor')}"


def _kernel(name: str, function):
  """The op's kernel: schema arguments -> the Python function's call."""
  positional = [p.name for p in inspect.signature(function).parameters
                .values() if p.kind is p.POSITIONAL_OR_KEYWORD]
  int_or_pair = [arg for arg, kind in _OP_TYPES.get(name, {}).items()
                 if kind == "int[1]"]
  returns_list = _RETURNS.get(name) == "Tensor[]"

  def kernel(*args, **kwargs):
    kwargs.update(zip(positional, args))
    for python_name, (first, second) in _PAIRS.items():
      if first in kwargs or second in kwargs:
        pair = (kwargs.pop(first, None), kwargs.pop(second, None))
        if any(t is not None for t in pair):
          kwargs[python_name] = pair
    for arg in int_or_pair:  # [w] -> w, [left, right] -> a tuple
      if kwargs.get(arg) is not None:
        value = kwargs[arg]
        kwargs[arg] = value[0] if len(value) == 1 else tuple(value)
    out = function(**kwargs)
    return list(out) if returns_list else out
  kernel.__name__ = name
  return kernel


_LIBRARY = torch.library.Library(NAMESPACE, "DEF")


def register(functions: dict) -> None:
  """Defines ``torch.ops.pallas_kernels.<name>`` for each Python function
  (``torch_bridge.ops`` passes its public ones when it is imported)."""
  for name, function in functions.items():
    _LIBRARY.define(name + schema(name, function))
    _LIBRARY.impl(name, _kernel(name, function), "CompositeImplicitAutograd")
