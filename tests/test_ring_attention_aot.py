"""Ring attention compiled by the real TPU compiler for an 8-chip v5e:2x4
topology (no TPU): forward and backward over a ("data", "seq") mesh of 2 x 4
run the Mosaic kernels and move K/V with collective-permutes, never an
all-gather of K/V; each chip's arguments are its shard only. Also with a
sliding window (the ring stops after one step), a chunked-causal mask, and
chunked prefill (q_len < kv_len) with a bias split along its query rows
(never gathered: each chip's arguments stay its shard).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels import _backend, _compat, shard_flash_attention, tpu_aot
from pallas_kernels.attention import masks

pytestmark = pytest.mark.tpu_aot

TOPOLOGY = "v5e:2x4"


def _compile(causal, layout, kv_length=None, bias=False, **kwargs):
  """HLO of the ring's forward and backward on the 2 x 4 mesh; with
  ``bias`` a ``[1, h, Lq, Lk]`` bias too (split along its rows over
  "seq", replicated over "data"), differentiated as well."""
  if TOPOLOGY not in tpu_aot.available_topologies([TOPOLOGY]):
    pytest.skip(f"libtpu lacks {TOPOLOGY}")
  mesh = tpu_aot.topology_mesh(TOPOLOGY, ("data", "seq"), (2, 4))
  b, h, hk, length, d = 2, 8, 2, 2048, 128
  kv_len = length if kv_length is None else kv_length
  qkv = NamedSharding(mesh, P("data", None, "seq", None))
  seg = NamedSharding(mesh, P("data", "seq"))
  specs = [jax.ShapeDtypeStruct((b, h, length, d), jnp.bfloat16, sharding=qkv),
           jax.ShapeDtypeStruct((b, hk, kv_len, d), jnp.bfloat16, sharding=qkv),
           jax.ShapeDtypeStruct((b, hk, kv_len, d), jnp.bfloat16, sharding=qkv),
           jax.ShapeDtypeStruct((b, length), jnp.int32, sharding=seg),
           jax.ShapeDtypeStruct((b, kv_len), jnp.int32, sharding=seg)]
  if bias:
    specs.append(jax.ShapeDtypeStruct(
        (1, h, length, kv_len), jnp.bfloat16,
        sharding=NamedSharding(mesh, P(None, None, "seq", None))))

  def fn(q, k, v, q_ids, kv_ids, *bias):
    def loss(q, k, v, *bias):
      out = shard_flash_attention(
          mesh, q, k, v, batch_axis="data", head_axis=None,
          sequence_axis="seq", sequence_layout=layout, causal=causal,
          segment_ids=(q_ids, kv_ids), bias=bias[0] if bias else None,
          **kwargs)
      return jnp.sum(out.astype(jnp.float32))
    return jax.value_and_grad(loss, argnums=tuple(range(3 + len(bias))))(
        q, k, v, *bias)

  with tpu_aot._captured_stderr(), _compat.mosaic_version_for_aot(), \
      _backend.target_override(tpu_generation="v5e"):
    compiled = jax.jit(fn).lower(*specs).compile()
  # Each chip holds an eighth of q, k, v (bfloat16) and the int32 ids, and
  # a quarter of the bias (its rows).
  local = ((b * h * length * d + 2 * b * hk * kv_len * d) * 2
           + b * (length + kv_len) * 4) // 8
  if bias:
    local += h * length * kv_len * 2 // 4
  assert compiled.memory_analysis().argument_size_in_bytes == local, (
      compiled.memory_analysis().argument_size_in_bytes, local)
  return compiled.as_text()


@pytest.mark.parametrize("causal, layout", [(True, "contiguous"),
                                            (True, "zigzag"),
                                            (False, "contiguous")])
def test_ring_compiles_with_permutes_not_gathers(causal, layout,
                                                 tpu_topologies):
  hlo = _compile(causal, layout)
  assert 'custom_call_target="tpu_custom_call"' in hlo
  assert "all-gather" not in hlo and "all-to-all" not in hlo
  permutes = re.findall(r"collective-permute(?:-start)?\(", hlo)
  assert permutes, "K/V never moved"
  # Forward ring, backward ring (K/V and dK/dV), and for contiguous causal
  # inputs the moves to zig-zag order and back.
  assert len(permutes) >= (4 if layout == "zigzag" or not causal else 8)
  assert _kernel_runs_during_a_permute(hlo), \
      "no kernel runs while a collective-permute is in flight"


@pytest.mark.parametrize("layout, kwargs", [
    ("contiguous", dict(sliding_window=256)),
    # Zig-zag compiles by default in test_ring_compiles_with_permutes_...
    pytest.param("zigzag", dict(mask=masks.ChunkedCausal(1024)),
                 marks=pytest.mark.slow),
])
def test_masked_ring_compiles_with_permutes_not_gathers(layout, kwargs,
                                                        tpu_topologies):
  """A window narrower than a slice (512 tokens a chip) needs only the
  previous chip's slice: forward and backward send K/V once (and dK/dV
  home once). Chunked causal over zig-zag inputs walks the whole ring."""
  hlo = _compile(True, layout, **kwargs)
  assert 'custom_call_target="tpu_custom_call"' in hlo
  assert "all-gather" not in hlo and "all-to-all" not in hlo
  permutes = re.findall(r"collective-permute(?:-start)?\(", hlo)
  assert permutes, "K/V never moved"
  if "sliding_window" in kwargs:
    # No loop: one forward send, one backward send of K/V, one of dK/dV.
    assert "while" not in hlo.split("ENTRY")[1]
  else:
    assert _kernel_runs_during_a_permute(hlo)


@pytest.mark.parametrize("causal, layout", [
    (False, "contiguous"),
    # Causal: about a dozen distinct kernels (pairs cut by the diagonal).
    pytest.param(True, "contiguous", marks=pytest.mark.slow),
    pytest.param(True, "zigzag", marks=pytest.mark.slow)])
def test_prefill_ring_with_bias_compiles_with_permutes_not_gathers(
    causal, layout, tpu_topologies):
  """Chunked prefill (2048 queries against 8192 keys, ends aligned) with a
  bias: the bias is sliced per step on its chip, never gathered."""
  hlo = _compile(causal, layout, kv_length=8192, bias=True)
  assert 'custom_call_target="tpu_custom_call"' in hlo
  assert "all-gather" not in hlo and "all-to-all" not in hlo
  assert re.findall(r"collective-permute(?:-start)?\(", hlo), "K/V never moved"
  assert _kernel_runs_during_a_permute(hlo)


def _computations(hlo):
  """{name: instruction lines} of an HLO module's text."""
  out, name = {}, None
  for line in hlo.splitlines():
    header = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
    if header:
      name = header.group(1)
      out[name] = []
    elif name is not None and line.strip() != "}":
      out[name].append(line)
  return out


def _called(line):
  """The computations an HLO instruction line calls."""
  targets = re.findall(
      r"(?:calls|to_apply|body|branch_computations)=(\{[^}]*\}|%[\w.\-]+)",
      line)
  return {name for t in targets for name in re.findall(r"%([\w.\-]+)", t)}


def _kernel_runs_during_a_permute(hlo):
  """Whether some collective-permute-start is followed, before its done, by
  a Mosaic kernel or an instruction calling a computation that runs one
  (the next slice's send overlapping the current block's kernel)."""
  computations = _computations(hlo)
  runs = {n for n, lines in computations.items()
          if any("tpu_custom_call" in l for l in lines)}
  grew = True
  while grew:
    more = {n for n, lines in computations.items()
            if any(_called(l) & runs for l in lines)} - runs
    runs |= more
    grew = bool(more)
  for lines in computations.values():
    for i, line in enumerate(lines):
      start = re.match(r"\s*%(\S+) = .* collective-permute-start\(", line)
      if not start:
        continue
      for later in lines[i + 1:]:
        if f"collective-permute-done(%{start.group(1)})" in later:
          break
        if "tpu_custom_call" in later or _called(later) & runs:
          return True
  return False
