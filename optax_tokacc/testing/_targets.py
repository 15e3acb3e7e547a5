# Copyright 2026 The optax_tokacc Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""Accelerators that are not here: compile-only devices of a named target.

XLA:GPU compiles for an NVIDIA GPU described by a text spec (a
``GpuTargetConfigProto``: SM count, memory bandwidth, caches), XLA:TPU for
a TPU topology through libtpu; both run on a CPU-only machine and give the
optimized program the accelerator's own compiler produces. Nothing runs:
the devices of a :class:`Target` only compile.
"""

import dataclasses
import functools
import importlib.metadata
import importlib.resources
import os
from typing import Optional

import jax
from jax.experimental import mesh_utils
from jax.experimental import topologies
import numpy as np

# The jaxlib whose parser reads the vendored GPU specs (specs/*.txtpb): a
# spec and its jaxlib are upgraded together.
SPEC_JAXLIB = '0.12.0.1'
INSTALL = "pip install 'optax_tokacc[accelerators]'"


@dataclasses.dataclass(frozen=True)
class _Kind:
  """How to make one kind of target's devices."""

  platform: str  # 'gpu' or 'tpu'
  device_kind: str  # what its devices must call themselves
  spec: str = ''  # GPU: the vendored spec's file name
  topology: str = ''  # TPU: libtpu's topology name
  accelerator_type: str = ''  # TPU: what libtpu is told it runs on
  chips: int = 1


_GPUS = {
  'h100': ('h100_sxm.txtpb', 'NVIDIA H100 80GB HBM3'),
  'h200': ('h200.txtpb', 'NVIDIA H200 141GB HBM3e'),
}
_TPUS = {  # name: (libtpu's name, device kind, accelerator type per chip)
  'v5e': ('v5e', 'TPU v5 lite', 'v5litepod'),
  'v6e': ('v6e', 'TPU v6 lite', 'v6e'),
  'v5p': ('v5p', 'TPU v5', 'v5p'),
}
_TPU_TOPOLOGIES = {'v5e': ('1x1', '2x2', '2x4'), 'v6e': ('1x1', '2x4'),
                   'v5p': ('2x2x2',)}  # fmt: skip


def _kinds() -> dict[str, _Kind]:
  kinds = {}
  for name, (spec, device_kind) in _GPUS.items():
    kinds[name] = _Kind('gpu', device_kind, spec=spec)
    kinds[f'{name} x8'] = _Kind('gpu', device_kind, spec=spec, chips=8)
  for name, (libtpu_name, device_kind, accelerator) in _TPUS.items():
    for shape in _TPU_TOPOLOGIES[name]:
      chips = int(np.prod([int(d) for d in shape.split('x')]))
      cores = chips * (2 if name == 'v5p' else 1)  # v5p: megacore
      kinds[f'tpu {name} {shape}'] = _Kind(
        'tpu',
        device_kind,
        topology=f'{libtpu_name}:{shape}',
        accelerator_type=f'{accelerator}-{cores}',
        chips=chips,
      )
  return kinds


KINDS = _kinds()


@dataclasses.dataclass(frozen=True)
class Target:
  """Compile-only devices of a named accelerator.

  Attributes:
    name: the target's name (:func:`target`), with its slices.
    platform: ``'gpu'`` or ``'tpu'``.
    devices: its devices, which only compile (``jax.jit(f).lower(...)
      .compile()`` on arguments placed on them).
    num_slices: TPU slices, joined by the data-center network.
  """

  name: str
  platform: str
  devices: tuple[jax.Device, ...]
  num_slices: int = 1

  @property
  def device_kind(self) -> str:
    """What its devices call themselves (``'NVIDIA H100 80GB HBM3'``)."""
    return self.devices[0].device_kind

  def sharding(self) -> jax.sharding.Sharding:
    """The first device alone: a one-device program's placement."""
    return jax.sharding.SingleDeviceSharding(self.devices[0])

  def mesh(
    self,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    axis_types: Optional[tuple[jax.sharding.AxisType, ...]] = None,
  ) -> jax.sharding.Mesh:
    """A mesh of all the target's devices, laid out as the hardware is
    (``mesh_utils``). Across slices the first axis spans them: its size
    is a multiple of ``num_slices``, which the slow network joins."""
    if int(np.prod(shape)) != len(self.devices):
      raise ValueError(
        f'A mesh of shape {shape} needs {int(np.prod(shape))} devices; '
        f'target {self.name!r} has {len(self.devices)}.'
      )
    if self.num_slices == 1:
      devices = mesh_utils.create_device_mesh(shape, list(self.devices))
    else:
      if shape[0] % self.num_slices:
        raise ValueError(
          f'The first axis of shape {shape} spans the {self.num_slices} '
          f'slices of {self.name!r}: its size must be a multiple of them.'
        )
      per_slice = (shape[0] // self.num_slices, *shape[1:])
      across = (self.num_slices,) + (1,) * (len(shape) - 1)
      devices = mesh_utils.create_hybrid_device_mesh(
        per_slice, across, devices=list(self.devices)
      )
    return jax.sharding.Mesh(devices, names, axis_types=axis_types)


def known_targets() -> tuple[str, ...]:
  """The names :func:`target` takes."""
  return tuple(KINDS)


def target(name: str, num_slices: int = 1) -> Target:
  """The compile-only devices of accelerator ``name``.

  Args:
    name: ``'h100'``, ``'h200'`` (one GPU), ``'h100 x8'``, ``'h200 x8'``
      (eight, NVLink), or a TPU slice: ``'tpu v5e 2x4'``, ``'tpu v6e
      1x1'``, ``'tpu v5p 2x2x2'``, ... (:func:`known_targets`).
    num_slices: TPU slices of that shape, joined by the data-center network
      (the first axis of :meth:`Target.mesh` spans them).

  Returns:
    A :class:`Target`. The compilers are the ``accelerators`` extra's (the
    CUDA plugin with a ``ptxas``, libtpu); JAX must run on the CPU
    (``JAX_PLATFORMS=cpu``), where the plugin starts no GPU client.
  """
  key = ' '.join(str(name).lower().split())
  if key not in KINDS:
    raise ValueError(
      f'Unknown accelerator target {name!r}; known targets: {", ".join(KINDS)}.'
    )
  if not isinstance(num_slices, int) or num_slices < 1:
    raise ValueError(f'num_slices must be an int >= 1, got {num_slices!r}.')
  kind = KINDS[key]
  if num_slices > 1 and kind.platform != 'tpu':
    raise ValueError(
      f'num_slices={num_slices} is for TPU slices, not {name!r}.'
    )
  return _target(key, num_slices)


@functools.cache
def _target(key: str, num_slices: int) -> Target:
  kind = KINDS[key]
  if kind.platform == 'gpu':
    devices = _gpu_devices(kind)
  else:
    devices = _tpu_devices(kind, num_slices)
  found = {d.device_kind for d in devices}
  if found != {kind.device_kind}:
    raise RuntimeError(
      f'Target {key!r} should have {kind.device_kind!r} devices; the '
      f'compiler gave {sorted(found)}.'
    )
  label = key if num_slices == 1 else f'{key}, {num_slices} slices'
  return Target(label, kind.platform, tuple(devices), num_slices)


def spec_text(file_name: str) -> str:
  """A vendored GPU spec (``specs/``), checked against this jaxlib."""
  jaxlib = importlib.metadata.version('jaxlib')
  if jaxlib != SPEC_JAXLIB:
    raise RuntimeError(
      f'The vendored GPU spec {file_name} is for jaxlib {SPEC_JAXLIB}, whose '
      f'parser it was taken with; this is jaxlib {jaxlib}. Run '
      f'{INSTALL}, which pins both.'
    )
  return (
    importlib.resources.files(__package__) / 'specs' / file_name
  ).read_text()


def _gpu_devices(kind: _Kind) -> list[jax.Device]:
  text = spec_text(kind.spec)
  try:
    topology = topologies.get_topology_desc(
      platform='cuda', target_config=text, topology=f'1x1x{kind.chips}'
    )
  except Exception as error:  # noqa: BLE001 - re-raised with the cause
    raise RuntimeError(
      f'XLA:GPU could not make {kind.device_kind} devices from {kind.spec} '
      f'({type(error).__name__}: {error}). It needs the CUDA plugin of '
      f'jaxlib {SPEC_JAXLIB} ({INSTALL}) and JAX on the CPU '
      '(JAX_PLATFORMS=cpu before JAX starts).'
    ) from error
  return list(topology.devices)


def _tpu_devices(kind: _Kind, num_slices: int) -> list[jax.Device]:
  # libtpu asks the metadata server where it runs unless told; told, it
  # makes no network connection. It also locks the TPU for one process
  # (/tmp/libtpu_lockfile): none is here to lock, and processes that only
  # compile (pytest's workers) must not wait on each other.
  os.environ.setdefault('TPU_ACCELERATOR_TYPE', kind.accelerator_type)
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  try:
    topology = topologies.get_topology_desc(
      topology_name=kind.topology, platform='tpu', num_slices=num_slices
    )
  except Exception as error:  # noqa: BLE001 - re-raised with the cause
    raise RuntimeError(
      f'XLA:TPU could not make the topology {kind.topology} '
      f'({type(error).__name__}: {error}). It needs libtpu ({INSTALL}).'
    ) from error
  return list(topology.devices)
