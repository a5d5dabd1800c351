"""Every public op as a sharding case: inputs, how they split, the reference.

Shared by tests/test_sharding.py (8 CPU devices) and the TPU AOT sharded
compiles. A case's ``fn(backend)`` maps its arrays to a tuple of results;
``specs`` give each input's PartitionSpec over a ("data", "model") mesh and
``out_specs`` each result's (a result summed over a split dimension has that
axis absent). ``grad`` lists which inputs the op is differentiable in.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels import _compat

MESH_AXES = ("data", "model")


@dataclasses.dataclass
class Case:
  name: str
  make: Callable[[np.random.Generator], tuple]
  fn: Callable[[str | None], Callable]
  specs: tuple
  out_specs: tuple
  grad: tuple[int, ...] = ()
  atol: float = 1e-5


def _boxes(rng, *shape):
  xy = rng.uniform(0, 50, shape + (2,))
  wh = rng.uniform(1, 30, shape + (2,))
  return jnp.asarray(np.concatenate([xy, xy + wh], -1), jnp.float32)


def _attention_inputs(rng):
  b, h, g, length, d = 4, 8, 4, 40, 32
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  bias = f(1, h, length, length)
  seg = jnp.asarray(np.sort(rng.integers(0, 3, (b, length)), 1), jnp.int32)
  # v's head dim 24 != q's 32 (MLA): the rule keeps them apart
  return f(b, h, length, d), f(b, g, length, d), f(b, g, length, 24), bias, seg


def _attention(backend):
  def fn(q, k, v, bias, seg):
    return (pk.flash_attention(q, k, v, causal=True, bias=bias,
                               segment_ids=(seg, seg), backend=backend),)
  return fn


def _decode_inputs(rng, paged=False):
  """The paged cache is MLA's: v's head_dim (48) is not q's and k's."""
  b, h, g, t, length, d, page = 4, 8, 4, 2, 48, 32, 16
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  lengths = jnp.asarray(rng.integers(t, length + 1, b), jnp.int32)
  if not paged:
    return f(b, h, t, d), f(b, g, length, d), f(b, g, length, d), lengths
  pool = b * length // page + 2
  table = rng.permutation(pool)[:b * length // page].reshape(b, -1)
  return (f(b, h, t, d), f(pool, g, page, d), f(pool, g, page, 48), lengths,
          jnp.asarray(table, jnp.int32))


def _decode(backend):
  def fn(q, k, v, lengths, table=None):
    return (pk.decode_attention(q, k, v, lengths, page_table=table,
                                sliding_window=20, backend=backend),)
  return fn


def _int8_inputs(rng):
  x = jnp.asarray(rng.integers(-127, 128, (16, 64)), jnp.int8)
  w = jnp.asarray(rng.integers(-127, 128, (64, 48)), jnp.int8)
  xs = jnp.asarray(rng.uniform(0.01, 0.1, (16, 1)), jnp.float32)
  ws = jnp.asarray(rng.uniform(0.01, 0.1, (48,)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal(48), jnp.float32)
  return x, w, xs, ws, bias


def _int8(backend):
  def fn(x, w, xs, ws, bias):
    return (pk.int8_matmul(x, w, x_scale=xs, w_scale=ws, bias=bias,
                           out_dtype=jnp.float32, backend=backend),)
  return fn


def _weight_only(backend):
  def fn(x, w, ws):
    return (pk.int8_matmul(x, w, w_scale=ws, weight_only=True,
                           backend=backend),)
  return fn


def _quantize(backend):
  return lambda x: pk.quantize_int8(x, backend=backend)


def _quantized_inputs(rng):
  x = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
  w = jnp.asarray(rng.integers(-8, 8, (64, 48)), jnp.int4)
  ws = jnp.asarray(rng.uniform(0.01, 0.1, (2, 48)), jnp.float32)
  return x, w, ws


def _quantized(backend):
  def fn(x, w, ws):
    return (pk.quantized_matmul(x, w, w_scale=ws, group_size=32,
                                weight_only=True, backend=backend),)
  return fn


def _grouped_inputs(rng):
  lhs = jnp.asarray(rng.standard_normal((24, 32)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((3, 32, 16)), jnp.float32)
  return lhs, rhs, jnp.asarray([7, 0, 15], jnp.int32)


def _grouped(backend):
  return lambda lhs, rhs, sizes: (pk.grouped_matmul(lhs, rhs, sizes,
                                                    backend=backend),)


def _loss(reduction):
  def make_fn(backend):
    return lambda p, t: (pk.giou_loss(p, t, reduction=reduction,
                                      backend=backend),)
  return make_fn


def _pairwise(backend):
  return lambda a, b: (pk.pairwise_giou(a, b, backend=backend),)


def _batched_nms(backend):
  def fn(boxes, scores):
    return pk.batched_nms(boxes, scores, iou_threshold=0.5,
                          max_output_size=12, backend=backend)
  return fn


BOX_SPEC = P(("data", "model"), None)

CASES = [
    Case("flash_attention", _attention_inputs, _attention,
         specs=(P("data", "model"), P("data", "model"), P("data", "model"),
                P(None, "model"), P("data")),
         out_specs=(P("data", "model"),), grad=(0, 1, 2, 3), atol=2e-5),
    Case("decode_attention", _decode_inputs, _decode,
         specs=(P("data", "model"), P("data", "model"), P("data", "model"),
                P("data")),
         out_specs=(P("data", "model"),), grad=(0, 1, 2), atol=2e-5),
    Case("decode_attention_paged",
         lambda rng: _decode_inputs(rng, paged=True), _decode,
         specs=(P("data", "model"), P(None, "model"), P(None, "model"),
                P("data"), P("data")),
         out_specs=(P("data", "model"),), grad=(0, 1, 2), atol=2e-5),
    Case("int8_matmul", _int8_inputs, _int8,
         specs=(P("data"), P(None, "model"), P("data"), P("model"),
                P("model")),
         out_specs=(P("data", "model"),), atol=1e-4),
    Case("int8_matmul_weight_only",
         lambda rng: (jnp.asarray(rng.standard_normal((16, 64)), jnp.float32),
                      _int8_inputs(rng)[1], _int8_inputs(rng)[3]),
         _weight_only, specs=(P("data"), P(None, "model"), P("model")),
         out_specs=(P("data", "model"),), atol=1e-4),
    Case("quantize_int8",
         lambda rng: (jnp.asarray(rng.standard_normal((8, 4, 64)),
                                  jnp.float32),),
         _quantize, specs=(P("data", "model"),),
         out_specs=(P("data", "model"), P("data", "model"))),
    # jax < 0.8 cannot differentiate it on sharded inputs: the frozen-weight
    # JVP's tangent carries the mesh, the partitioned kernel's output none,
    # and custom_jvp's type check rejects the pair (a known defect).
    Case("quantized_matmul", _quantized_inputs, _quantized,
         specs=(P("data"), P(None, "model"), P(None, "model")),
         out_specs=(P("data", "model"),),
         grad=() if _compat.JAX_VERSION < (0, 8) else (0,), atol=1e-4),
    # rows follow their groups: N splits, not M
    Case("grouped_matmul", _grouped_inputs, _grouped,
         specs=(P(), P(None, None, ("data", "model")), P()),
         out_specs=(P(None, ("data", "model")),), grad=(0, 1), atol=1e-4),
    Case("giou_loss_none", lambda rng: (_boxes(rng, 40), _boxes(rng, 40)),
         _loss("none"), specs=(BOX_SPEC, BOX_SPEC),
         out_specs=(P(("data", "model")),), grad=(0, 1)),
    Case("giou_loss_sum", lambda rng: (_boxes(rng, 40), _boxes(rng, 40)),
         _loss("sum"), specs=(BOX_SPEC, BOX_SPEC), out_specs=(P(),),
         grad=(0, 1), atol=1e-4),
    Case("giou_loss_mean", lambda rng: (_boxes(rng, 4096), _boxes(rng, 4096)),
         _loss("mean"), specs=(BOX_SPEC, BOX_SPEC), out_specs=(P(),),
         grad=(0, 1)),
    Case("pairwise_giou",
         lambda rng: (_boxes(rng, 4, 8), _boxes(rng, 4, 12)),
         _pairwise, specs=(P("data"), P("data")),
         out_specs=(P("data"),)),
    Case("batched_nms",
         lambda rng: (_boxes(rng, 4, 32),
                      jnp.asarray(rng.uniform(size=(4, 32)), jnp.float32)),
         _batched_nms, specs=(P("data"), P("data")),
         out_specs=(P("data"), P("data")), atol=0),
]
CASE_NAMES = [c.name for c in CASES]


def use_mesh(mesh):
  """The context that makes ``mesh`` the current mesh (jax.set_mesh)."""
  return (jax.set_mesh(mesh) if hasattr(jax, "set_mesh")
          else jax.sharding.use_mesh(mesh))


def case(name) -> Case:
  return next(c for c in CASES if c.name == name)


def scalar_loss(fn, grad_args):
  """sum of every float result, as a function of the args in ``grad_args``."""
  def loss(*args):
    total = 0.0
    for r in fn(*args):
      if jnp.issubdtype(r.dtype, jnp.floating):
        total = total + jnp.sum(jnp.sin(r.astype(jnp.float32)))
    return total
  return jax.grad(loss, argnums=grad_args)
