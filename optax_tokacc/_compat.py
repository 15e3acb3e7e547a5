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

``lax.pcast(x, axes, to='varying')`` and the manual axes in a value's type
(``jax.typeof(x).sharding.mesh.manual_axes``, ``pmap``'s axis included) are
the same on every supported version, and are called directly.
"""

from typing import Any

import jax


def varying_axes(x: Any) -> frozenset:
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
