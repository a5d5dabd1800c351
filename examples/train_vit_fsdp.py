"""Train a small ViT under PyTorch/XLA FSDPv2 with the bridged Pallas kernels.

The model is the write-up's ViT with ``TPUAttentionBlock`` blocks (pre-norm
attention + MLP, no class token, average pooling), scaled down: 32x32 images,
8x8 patches (16 tokens), dim 64, 4 heads, 2 blocks. Three copies start from
the same weights and see the same batches:

  reference  plain PyTorch attention (SDPA) and nn.Linear
  attention  the bridge's flash_attention, nn.Linear
  int8       the bridge's flash_attention and Int8Linear (int8 forward,
             straight-through backward)

All three are wrapped in ``SpmdFullyShardedDataParallel`` over a 1-D
``("fsdp",)`` mesh of every device (or, with ``--model-axis 2``, a 2-D
``("fsdp", "model")`` mesh whose "model" axis also splits the attention
heads); the kernels run per shard in manual-sharding mode
(``batch_axis="fsdp"``, ``head_axis="model"``). The script checks

  * gradients at the initial weights: "attention" equals "reference" to float
    rounding (the attention math is exact), "int8" is within int8
    quantisation error (cosine similarity of every gradient >= 0.99, norms
    within 2%);
  * losses step by step: "attention" within 1e-4 (relative) of "reference",
    "int8" within 5e-2 (the int8 forward perturbs each step slightly and the
    trajectories drift apart);
  * no recompilation after step 2 and no device-to-host transfer inside the
    training loop (torch_xla metrics ``CompileTime``, ``TransferFromDeviceTime``);
  * every kernel ran sharded (no ``torch_bridge.UnshardedWarning``).

The batch need not be a multiple of the "fsdp" axis: the kernels pad it
inside and return the true shapes, so an odd batch trains like any other.

CPU (default): ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=4`` is set by the script;
kernels run in the Pallas interpreter inside the XLA graph.
TPU: ``--tpu`` uses the attached TPU devices (Mosaic kernels). This path is
written for ``tpu_setup.sh``'s smoke check and has not been run on a TPU by
this project's CI.

FSDPv1 (``--fsdp v1``): ``XlaFullyShardedDataParallel`` with one replica per
device via ``torch_xla.launch``; the kernels run unsharded on each replica's
local batch (no SPMD, nothing to shard manually), and the script compares
the replicas' mean losses with the reference model's. It cannot run on the
CPU PJRT client here: the replicas are threads of one process, and XLA's CPU
collectives abort when they reach a collective more than 10 s apart (the
first compiles take longer than that on 2 cores), even for the plain-PyTorch
model without any bridge op. It is meant for TPU and is unverified.

    python examples/train_vit_fsdp.py [--steps 4] [--batch 16] [--tpu]
                                      [--fsdp v1]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

LOSS_RTOL = {"attention": 1e-4, "int8": 5e-2}
GRAD_COSINE_MIN = {"attention": 0.99999, "int8": 0.99}
GRAD_NORM_RTOL = {"attention": 1e-4, "int8": 2e-2}


def _parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tpu", action="store_true",
                      help="run on the attached TPU (Mosaic kernels)")
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--batch", type=int, default=16,
                      help="global batch; any size: one the 'fsdp' axis "
                      "does not divide is padded inside the kernels")
  parser.add_argument("--devices", type=int, default=4,
                      help="CPU XLA devices (ignored with --tpu)")
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--img", type=int, default=32)
  parser.add_argument("--patch", type=int, default=8)
  parser.add_argument("--lr", type=float, default=0.1)
  parser.add_argument("--variants", default="reference,attention,int8")
  parser.add_argument("--json", help="write the summary here")
  parser.add_argument("--model-axis", type=int, default=1,
                      help="> 1: a 2-D (fsdp, model) mesh; attention heads "
                      "are split over 'model' as well")
  parser.add_argument("--fsdp", choices=("v2", "v1"), default="v2",
                      help="v2: SpmdFullyShardedDataParallel (SPMD, one "
                      "process); v1: XlaFullyShardedDataParallel, one "
                      "replica per device via torch_xla.launch")
  return parser.parse_args(argv)


def _set_platform(args):
  if args.tpu:
    os.environ.setdefault("PJRT_DEVICE", "TPU")
  else:
    os.environ["PJRT_DEVICE"] = "CPU"
    os.environ["CPU_NUM_DEVICES"] = str(args.devices)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))


def build_vit(args, *, use_kernel: bool, int8: bool, batch_axis,
              head_axis=None):
  import torch.nn as nn
  from torch_bridge import modules
  from vit import ViTBlock

  class ViT(nn.Module):
    def __init__(self):
      super().__init__()
      tokens = (args.img // args.patch) ** 2
      self.patch = nn.Conv2d(3, args.dim, args.patch, stride=args.patch)
      self.pos = nn.Parameter(0.02 * torch.randn(1, tokens, args.dim))
      if int8:
        def linear(i, o, bias=True):
          return modules.Int8Linear(i, o, bias=bias, batch_axis=batch_axis)
      else:
        linear = nn.Linear
      self.blocks = nn.Sequential(*[
          ViTBlock(args.dim, args.heads, linear=linear,
                   use_kernel=use_kernel, batch_axis=batch_axis,
                   head_axis=head_axis)
          for _ in range(args.depth)])
      self.norm = nn.LayerNorm(args.dim)
      self.head = nn.Linear(args.dim, 10)

    def forward(self, images):
      x = self.patch(images).flatten(2).transpose(1, 2) + self.pos
      x = self.norm(self.blocks(x))
      return self.head(x.mean(1))

  import torch
  torch.manual_seed(0)
  return ViT()


def _cosine(a, b):
  import torch
  a, b = a.double().flatten(), b.double().flatten()
  denom = a.norm() * b.norm()
  if denom == 0:
    return 1.0 if a.norm() == b.norm() else 0.0
  return float(a @ b / denom)


def _metric(met, name) -> int:
  data = met.metric_data(name)
  return int(data[0]) if data else 0


def _compare_grads(grads, variants):
  checks = {}
  for name in variants:
    if name == "reference":
      continue
    cos = {k: _cosine(g, grads["reference"][k])
           for k, g in grads[name].items()}
    worst = min(cos, key=cos.get)
    checks[f"grad_cosine_min_{name}"] = cos[worst]
    checks[f"grad_cosine_worst_param_{name}"] = worst
    # norms too: a gradient missing part of its cross-shard sum keeps its
    # direction roughly but not its size
    norm_err = {k: abs(float(g.double().norm()) /
                       max(float(grads["reference"][k].double().norm()),
                           1e-30) - 1) for k, g in grads[name].items()}
    checks[f"grad_norm_rel_err_max_{name}"] = max(norm_err.values())
    checks[f"grads_ok_{name}"] = (
        cos[worst] >= GRAD_COSINE_MIN[name] and
        max(norm_err.values()) <= GRAD_NORM_RTOL[name] and
        set(grads[name]) == set(grads["reference"]))
  return checks


def _loss_checks(values, variants):
  """Per kernel variant: max relative loss difference to the plain-torch
  run, and whether it is within LOSS_RTOL with every loss finite."""
  checks = {}
  for name in variants:
    if name == "reference":
      continue
    rel = [abs(a - b) / max(abs(b), 1e-6)
           for a, b in zip(values[name], values["reference"])]
    checks[f"loss_max_rel_diff_{name}"] = max(rel)
    checks[f"losses_ok_{name}"] = (max(rel) <= LOSS_RTOL[name] and
                                   all(math.isfinite(v) for v in values[name]))
  return checks


def main(argv=None):
  args = _parse(argv)
  _set_platform(args)
  if args.fsdp == "v1":
    return main_fsdp_v1(args)
  global torch
  import numpy as np
  import torch
  import torch_xla
  import torch_xla.debug.metrics as met
  import torch_xla.distributed.spmd as xs
  import torch_xla.runtime as xr
  from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
      SpmdFullyShardedDataParallel as FSDPv2)

  xr.use_spmd()
  device = torch_xla.device()
  n = xr.global_runtime_device_count()
  if args.model_axis > 1:  # heads split over "model", batch over "fsdp"
    if n % args.model_axis or args.heads % args.model_axis:
      raise SystemExit("--model-axis must divide the devices and --heads")
    mesh = xs.Mesh(np.arange(n), (n // args.model_axis, args.model_axis),
                   ("fsdp", "model"))
    head_axis = "model"
  else:
    mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
    head_axis = None
  xs.set_global_mesh(mesh)

  variants = args.variants.split(",")
  models, optims = {}, {}
  for name in variants:
    model = build_vit(args, use_kernel=name != "reference",
                      int8=name == "int8", batch_axis="fsdp",
                      head_axis=head_axis).to(device)
    models[name] = FSDPv2(model, mesh=mesh)
    optims[name] = torch.optim.SGD(models[name].parameters(), lr=args.lr)

  gen = torch.Generator().manual_seed(1)
  batches = [(torch.randn(args.batch, 3, args.img, args.img, generator=gen),
              torch.randint(0, 10, (args.batch,), generator=gen))
             for _ in range(args.steps)]

  def put(images, labels):
    images, labels = images.to(device), labels.to(device)
    xs.mark_sharding(images, mesh, ("fsdp", None, None, None))
    xs.mark_sharding(labels, mesh, ("fsdp",))
    return images, labels

  loss_fn = torch.nn.CrossEntropyLoss()
  summary = {"devices": n, "device_type": xr.device_type(),
             "config": vars(args), "variants": variants}

  # Step 0 also fetches the gradients at the shared initial weights; the
  # steps after it must neither compile nor copy anything to the host.
  losses = {name: [] for name in variants}
  compiles_after, step_times, checks = {}, [], {}
  transfers_before = None
  import warnings
  from torch_bridge import UnshardedWarning
  caught = warnings.catch_warnings(record=True)
  unsharded = caught.__enter__()
  warnings.simplefilter("always", UnshardedWarning)
  for step, batch in enumerate(batches):
    t0 = time.perf_counter()
    if step == 1:
      transfers_before = _metric(met, "TransferFromDeviceTime")
    grads = {}
    for name, model in models.items():
      images, labels = put(*batch)
      loss = loss_fn(model(images), labels)
      loss.backward()
      if step == 0:
        torch_xla.sync()
        grads[name] = {k: p.grad.detach().cpu() for k, p in
                       model.named_parameters() if p.grad is not None}
      optims[name].step()
      optims[name].zero_grad(set_to_none=True)
      losses[name].append(loss.detach())
    torch_xla.sync()
    step_times.append(time.perf_counter() - t0)
    compiles_after[step] = _metric(met, "CompileTime")
    if step == 0:
      checks.update(_compare_grads(grads, variants))
  caught.__exit__(None, None, None)
  unsharded = [str(w.message) for w in unsharded
               if issubclass(w.category, UnshardedWarning)]
  transfers_in_loop = (0 if transfers_before is None else
                       _metric(met, "TransferFromDeviceTime")
                       - transfers_before)
  values = {name: [float(v) for v in torch.stack(ls).cpu()]
            for name, ls in losses.items()}

  summary["losses"] = values
  summary["step_times_s"] = step_times
  summary["compiles_after_step"] = compiles_after
  summary["transfers_from_device_in_loop"] = transfers_in_loop
  summary["unsharded_warnings"] = unsharded
  last = max(compiles_after)
  summary["recompiled_after_step_2"] = (
      last >= 2 and compiles_after[last] != compiles_after[1])
  checks.update(_loss_checks(values, variants))
  summary["checks"] = checks
  summary["ok"] = (all(v for k, v in checks.items() if "_ok_" in k)
                   and not summary["recompiled_after_step_2"]
                   and transfers_in_loop == 0 and not unsharded)
  text = json.dumps(summary, indent=1, default=str)
  print(text)
  if args.json:
    with open(args.json, "w") as f:
      f.write(text)
  return summary


def _v1_replica(index, args):
  """One FSDPv1 replica: its slice of each batch, losses averaged at the end."""
  global torch
  import torch
  import torch_xla
  import torch_xla.core.xla_model as xm
  import torch_xla.debug.metrics as met
  import torch_xla.runtime as xr
  from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

  device = torch_xla.device()
  rank, world = xr.global_ordinal(), xr.world_size()
  if args.batch % world:  # equal slices, one per replica
    raise SystemExit(f"--fsdp v1: --batch {args.batch} must be a multiple "
                     f"of the {world} replicas")
  local = args.batch // world
  variants = args.variants.split(",")
  models, optims = {}, {}
  for name in variants:
    model = build_vit(args, use_kernel=name != "reference",
                      int8=name == "int8", batch_axis=None).to(device)
    models[name] = FSDP(model)
    optims[name] = torch.optim.SGD(models[name].parameters(), lr=args.lr)
  gen = torch.Generator().manual_seed(1)
  batches = [(torch.randn(args.batch, 3, args.img, args.img, generator=gen),
              torch.randint(0, 10, (args.batch,), generator=gen))
             for _ in range(args.steps)]
  loss_fn = torch.nn.CrossEntropyLoss()
  losses = {name: [] for name in variants}
  compiles = {}
  for step, (images, labels) in enumerate(batches):
    part = slice(rank * local, (rank + 1) * local)
    for name, model in models.items():
      loss = loss_fn(model(images[part].to(device)), labels[part].to(device))
      loss.backward()
      optims[name].step()  # FSDP already reduce-scattered the gradients
      optims[name].zero_grad(set_to_none=True)
      losses[name].append(loss.detach())
    torch_xla.sync()
    compiles[step] = (met.metric_data("CompileTime") or [0])[0]
  values = {}
  for name, ls in losses.items():
    mean = xm.all_reduce(xm.REDUCE_SUM, torch.stack(ls)) / world
    values[name] = [float(v) for v in mean.cpu()]
  if rank != 0:
    return
  checks = _loss_checks(values, variants)
  summary = {"fsdp": "v1", "devices": world, "losses": values,
             "compiles_after_step": compiles, "checks": checks,
             "ok": all(v for k, v in checks.items() if "_ok_" in k)}
  text = json.dumps(summary, indent=1, default=str)
  print(text)
  if args.json:
    with open(args.json, "w") as f:
      f.write(text)


def main_fsdp_v1(args):
  """FSDPv1: not SPMD; each device runs a replica (a thread per CPU device,
  a process per TPU chip) and the kernels run unsharded on local batches."""
  import torch_xla
  torch_xla.launch(_v1_replica, args=(args,))
  if args.json and os.path.exists(args.json):
    with open(args.json) as f:
      return json.load(f)
  return {"ok": True}


if __name__ == "__main__":
  result = main()
  sys.exit(0 if result["ok"] else 1)
