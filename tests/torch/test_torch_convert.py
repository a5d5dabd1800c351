"""torch -> JAX views (``torch_bridge._convert``): each address is imported
once, as a view that does not own torch's memory, and reused while a
tensor of the same shape and dtype sits there. The results must always be
those of the tensor passed now: in-place edits, freed and reused memory,
temporaries and other dtypes at the same address are all checked against
float64 oracles (float32 tolerances)."""
from __future__ import annotations

import gc

import numpy as np
import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.torch

import torch  # noqa: E402

import torch_bridge as tb  # noqa: E402
from oracles import boxes as boxes_oracle  # noqa: E402
from torch_bridge import _convert  # noqa: E402

CPU = torch.device("cpu")
TOL = dict(rtol=2e-5, atol=2e-5)


def _boxes(rng, n):
  xy = rng.uniform(0, 50, (n, 2))
  return torch.tensor(np.concatenate([xy, xy + rng.uniform(1, 20, (n, 2))],
                                     -1), dtype=torch.float32)


def _want_iou(a, b):
  return torch.from_numpy(boxes_oracle.pairwise("iou", a.double().numpy(),
                                                b.double().numpy()))


def test_same_tensor_reuses_one_view_and_sees_in_place_edits(rng):
  a, b = _boxes(rng, 37), _boxes(rng, 37)
  _convert.to_jax([b], CPU)  # the first import settles jaxlib's signature
  first, = _convert.to_jax([a], CPU)
  again, = _convert.to_jax([a], CPU)
  assert again is first
  assert first.unsafe_buffer_pointer() == a.data_ptr()
  torch.testing.assert_close(tb.box_iou(a, b).double(), _want_iou(a, b),
                             **TOL)
  a.mul_(1.5)  # the cached view must show the new values
  torch.testing.assert_close(tb.box_iou(a, b).double(), _want_iou(a, b),
                             **TOL)


def test_fresh_tensors_of_one_shape_give_their_own_results(rng):
  # The allocator hands freed addresses to the next same-sized tensors: a
  # view found at an address must read the tensor that lives there now.
  for _ in range(12):
    a, b = _boxes(rng, 29), _boxes(rng, 29)
    torch.testing.assert_close(tb.box_iou(a, b).double(), _want_iou(a, b),
                               **TOL)
    del a, b
    gc.collect()


def test_same_address_other_dtype_or_shape_is_another_view(rng):
  a = _boxes(rng, 16)
  as_float, = _convert.to_jax([a], CPU)
  as_int, = _convert.to_jax([a.view(torch.int32)], CPU)
  flat, = _convert.to_jax([a.view(-1)], CPU)
  assert as_int.dtype == np.int32 and as_float.dtype == np.float32
  assert flat.shape == (64,) and as_float.shape == (16, 4)
  np.testing.assert_array_equal(np.asarray(as_int),
                                a.view(torch.int32).numpy())


def test_temporaries_are_imported_owned_not_cached(rng):
  # A non-contiguous input is copied for the call; caching a view of the
  # copy would read freed memory once the copy is gone.
  a = _boxes(rng, 23).t().contiguous().t()  # [23, 4] column-major
  b = _boxes(rng, 23)
  views = _convert._VIEWS.get(_convert.jax_device_for(CPU))
  before = dict(views.entries) if views else {}
  got = tb.box_iou(a, b)
  views = _convert._VIEWS[_convert.jax_device_for(CPU)]
  added = set(views.entries) - set(before)
  assert added <= {(b.data_ptr(), b.shape, b.dtype)}
  torch.testing.assert_close(got.double(), _want_iou(a, b), **TOL)


def test_gradients_through_cached_views(rng):
  # Inputs and cotangents at reused addresses, forward and backward.
  for _ in range(3):
    a = _boxes(rng, 19).requires_grad_(True)
    b = _boxes(rng, 19)
    loss = tb.giou_loss(a, b, reduction="sum")
    (grad,) = torch.autograd.grad(loss, a)
    want, _ = boxes_oracle.loss_grads("giou", a.detach().double().numpy(),
                                      b.double().numpy(), reduction="sum")
    torch.testing.assert_close(grad.double(), torch.from_numpy(want),
                               rtol=1e-3, atol=1e-4)
