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
"""What differs between the JAX versions we support (``pyproject.toml``).

The rest of the library calls these functions instead of the JAX APIs that
moved between the declared floor (jax 0.8.2) and the newest release, so that
a version difference is handled in one place:

- ``varying_axes``: JAX 0.8.x and 0.9.x record the mesh axes a value varies
  over in ``aval.vma``; under ``pmap`` a ``jax.ShapeDtypeStruct`` (e.g. from
  ``jax.eval_shape``) holds ``vma=None`` there. JAX 0.10 replaced ``vma`` by
  ``aval.manual_axis_type.varying``.

- ``partitions``: a ``PartitionSpec``'s per-dimension entries are
  ``spec.partitions`` on jax 0.10 (not yet on 0.8.2), ``spec._partitions``
  before.
- ``EXPLICIT_SHARDING``: reduced and unreduced types (explicit sharding,
  the distributed-optimizer layout) are refused below jax 0.10, naming it
  (``_typed_sharding.check_supported``): ``jax.device_put`` of unreduced arrays
  and the rules the library relies on are complete from there.

What JAX changed without a branch here: jax 0.11 gave ``PartitionSpec`` an
``unreduced_kind``, kept by ``P.update`` and refused beside no unreduced
axis, so specs are built with ``P(...)`` (``_typed_sharding.spec``);
it removed the implicit varying-to-unreduced cast of ``shard_map``, which
``_typed_sharding.local`` never needed (``check_vma=False``: its outputs are
described by ``out_specs``); and jax >= 0.11 merges equal constants before
sharding propagation, so unreduced zeros are made replicated, then retyped
(``_typed_sharding.unreduced_zeros``). On every version XLA gives a constant that
``jax.reshard`` types unreduced whole to every device once it is merged with
an equal constant, so a replicated count or loss is put on one device by a
select in a manual region (``_typed_sharding.on_one_device``). ``lax.pcast(x, axes, to='varying')`` and the manual
axes in a value's type (``jax.typeof(x).sharding.mesh.manual_axes``,
``pmap``'s axis included) are the same on every supported version, and are
called directly.
"""

from typing import Union

import jax

EXPLICIT_SHARDING_JAX = (0, 10, 0)
EXPLICIT_SHARDING = jax.__version_info__ >= EXPLICIT_SHARDING_JAX


def partitions(spec: jax.P) -> tuple:
  """The per-dimension entries of a spec (iterating a spec that has
  reduced or unreduced axes is an error in JAX)."""
  return tuple(getattr(spec, 'partitions', spec._partitions))


def varying_axes(
  x: Union[jax.typing.ArrayLike, jax.ShapeDtypeStruct],
) -> frozenset:
  """The manual mesh axes ``x`` varies over inside ``shard_map``.

  Args:
    x: an array or tracer, or a ``jax.ShapeDtypeStruct``.

  Returns:
    A frozenset of axis names; empty where JAX does not track variance (under
    ``pmap``, ``shard_map(check_vma=False)``, or outside any mapped axis).
  """
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  manual_axis_type = getattr(aval, 'manual_axis_type', None)
  if manual_axis_type is not None:  # jax >= 0.10
    return frozenset(manual_axis_type.varying)
  # jax 0.8 / 0.9; `vma` is None on a ShapeDtypeStruct under pmap.
  return frozenset(getattr(aval, 'vma', None) or ())
