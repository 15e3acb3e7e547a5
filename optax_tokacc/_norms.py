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
"""The window's norms, in one module: what they are, how they are computed
from each device's share, and how the state stores and reads them.

``window_norms`` (:func:`parse`) asks for none, the two global norms (of
the token-mean gradient ``inner`` receives and of the update it emits),
or each leaf's too. The closing step sums the squares of the window's
sums and of the updates on each device's share (:func:`local_squares`),
then over the mesh axes they are split over in one ``psum`` per set of
axes (:func:`global_norms`); :func:`of_window` scales them by the window's
count. A placement says which axes a leaf is split over and where the
collective runs (``Placement.squares`` and ``Placement.norms``: the typed
form below, or ``_manual``'s). The state stores each norm as
:data:`Stored` (:func:`stored`), read back by :func:`read`.
"""

from collections.abc import Callable
import functools
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from optax_tokacc import _base
from optax_tokacc import _compat
from optax_tokacc import _errors
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing

# How the state stores a norm (``last_grad_norm``, ``last_update_norm``):
# the global norm alone, or with ``window_norms='per_leaf'`` the pair of
# it and a tree like the parameters of each leaf's.
Stored = Union[jax.Array, tuple[jax.Array, Any]]

# The platforms where each leaf's squares of the window's sums are summed
# with its updates' (:func:`squares`).
TOGETHER_ON = ('cuda', 'rocm')


class Norms(NamedTuple):
  """L2 norms of two trees (a window's gradient and its update): ``totals``
  a float32 vector of the two, and, where asked, ``leaves``: per tree, the
  norm of each of its leaves (lists of float32 scalars, in leaf order)."""

  totals: jax.Array
  leaves: tuple = ((), ())


def parse(value: Any) -> tuple[bool, bool]:
  """``window_norms`` (True, False or ``'per_leaf'``) as the two flags of
  :class:`~optax_tokacc._base.Config`: the global norms, and each leaf's too."""
  if isinstance(value, str) and value == 'per_leaf':
    return True, True
  if isinstance(value, (bool, np.bool_)):
    return bool(value), False
  kinds = "True, False or 'per_leaf'"
  raise _errors.refuse(
    'window_norms', kinds, repr(value), _errors.STATIC_ARG_FIX
  )


def squares(
  place: Any,  # a Placement: ``_placement`` imports this module
  grads: _typing.Updates,
  grad_squares: dict,
  updates: _typing.Updates,
  per_leaf: bool,
) -> tuple[dict, dict]:
  """The squares of ``grads`` (the window's sums, or its mean) and of
  ``updates``, each summed on each device's share (``place.squares``), for
  ``place.norms``. On a GPU (:data:`TOGETHER_ON`) each leaf's of both in
  one reduction, which XLA:GPU fuses with ``inner``'s step: that step
  reads the sums and writes the updates, and a reduction of the sums of
  their own would read them once more (3% of an MLP's window). Elsewhere
  ``grad_squares``, taken before ``inner`` runs (the CPU orders them
  before the updates are written into the sums' buffer, and XLA:TPU holds
  more where they are taken with the updates' on a TPU's device-decided
  step), and the updates' apart."""

  def together(args):
    _, grads, updates = args
    return place.squares((grads, updates), per_leaf)

  def apart(args):
    grad_squares, _, updates = args
    return grad_squares, place.squares((updates,), per_leaf)[0]

  branches = dict.fromkeys(TOGETHER_ON, together)
  return jax.lax.platform_dependent(
    (grad_squares, grads, updates), **branches, default=apart
  )


def nan(config: _base.Config, grads: _typing.Updates) -> _base.WindowNorms:
  """The norms of no window: NaN, in the trees ``config`` asks for, each
  its own array (``init``'s state is donated whole: a buffer held twice
  cannot be)."""

  def nan(_=None):
    return jnp.full([], jnp.nan, jnp.float32)

  def leaves():
    return jax.tree.map(nan, grads) if config.leaf_norms else ()

  return _base.WindowNorms(nan(), nan(), leaves(), leaves())


def of_window(
  found: Norms, divisor: jax.Array, grads: _typing.Updates, leaf_norms: bool
) -> _base.WindowNorms:
  """The window's norms from its sums' and its updates' (``found``): the
  sums' over the window's count (``divisor``), as ``inner`` got them; each
  leaf's too, in trees like ``grads``, where ``leaf_norms``."""
  per_token = jnp.stack([1 / divisor.astype(jnp.float32), 1.0])
  totals = found.totals * per_token
  norms = _base.WindowNorms(grad_norm=totals[0], update_norm=totals[1])
  if not leaf_norms:
    return norms
  structure = jax.tree.structure(grads)
  grad_leaves, update_leaves = found.leaves
  return norms._replace(
    grad_norms=structure.unflatten([n * per_token[0] for n in grad_leaves]),
    update_norms=structure.unflatten(update_leaves),
  )


def stored(
  config: _base.Config, norms: _base.WindowNorms
) -> tuple[Stored, Stored]:
  """The state's ``last_grad_norm`` and ``last_update_norm`` for
  ``norms``: the global norms, each paired with its leaves' tree where
  ``config`` asks for them."""
  if not config.leaf_norms:
    return norms.grad_norm, norms.update_norm
  return (
    (norms.grad_norm, norms.grad_norms),
    (norms.update_norm, norms.update_norms),
  )


def per_leaf(field: Stored) -> bool:
  """Whether a stored norm holds each leaf's too: :data:`Stored`'s pair,
  told from the global norm alone by its type, the one reading of the
  union. (Not by its pytree structure: Flax nnx wraps the global norm in a
  ``Variable``, a pytree node of one child, which a pair is too.)"""
  return isinstance(field, tuple)


def read(field: Stored) -> tuple[jax.Array, Optional[Any]]:
  """A stored norm as the global norm and each leaf's (None where the
  transform computes no per-leaf norms)."""
  if not per_leaf(field):
    return jnp.asarray(field), None
  total, leaves = field
  return jnp.asarray(total), jax.tree.map(jnp.asarray, leaves)


def typed_split_axes(leaves: list, on_shares: bool) -> list[frozenset]:
  """Per leaf, the mesh axes over which :func:`typed_squares` leaves its
  sum of squares split: those its type splits it over, where its partial
  sums are typed (``on_shares``: explicit partial sums; or any leaf's
  type defers a reduction, on jax >= 0.10), else none: the compiler then
  sums a leaf it split, in a scalar all-reduce of its own (jax < 0.10
  cannot type the partial sums unreduced)."""
  over = [_typed_sharding.sharded(x) for x in leaves]
  mesh = next(map(_typed_sharding.mesh_of, leaves), None)
  some_deferred = any(_typed_sharding.deferred(a, mesh) for a in over)
  typed = on_shares or (_typed_sharding.SUPPORTED and some_deferred)
  return over if typed else [frozenset()] * len(over)


def typed_squares(
  trees: tuple, per_leaf: bool, on_shares: bool
) -> tuple[dict, ...]:
  """Each of ``trees``' squares summed on each device's share
  (:func:`local_squares`), partial sums typed unreduced over the axes
  :func:`typed_split_axes` gives, so that :func:`typed_norms` sums them in
  one collective. Trees summed in a manual region and trees summed
  outside one are summed apart."""
  overs = [typed_split_axes(jax.tree.leaves(t), on_shares) for t in trees]
  inside = [on_shares or any(over) for over in overs]
  if len(set(inside)) > 1:
    return tuple(typed_squares((t,), per_leaf, on_shares)[0] for t in trees)
  if not inside[0]:
    return local_squares(trees, overs, per_leaf)
  leaves = [x for t in trees for x in jax.tree.leaves(t)]
  mesh = next(map(_typed_sharding.mesh_of, leaves), None)

  def specs(over):
    split = {tuple(sorted(a)): _typed_sharding.deferred(a, mesh) for a in over}
    return {a: jax.P(unreduced=d) if d else jax.P() for a, d in split.items()}

  def squares(*trees):
    return local_squares(trees, overs, per_leaf)

  return _typed_sharding.local(squares, trees, tuple(map(specs, overs)))


def typed_norms(
  on_each_device: Callable,
  grads: _typing.Updates,
  updates: _typing.Updates,
  squares: tuple[dict, dict],
  on_shares: bool,
) -> Norms:
  """The norms of ``grads`` and ``updates`` from their :func:`typed_squares`
  (``squares``), where types say what is split (one device, ``jax.jit``
  over global arrays, explicit partial sums): in a manual region where a
  sum is split, else ``on_each_device`` (the placement's)."""
  overs = tuple(
    typed_split_axes(jax.tree.leaves(tree), on_shares)
    for tree in (grads, updates)
  )
  norms = functools.partial(global_norms, overs=overs)
  if any(axes for s in squares for axes in s):  # split: in a manual region
    return _typed_sharding.local(norms, squares, jax.P())
  like = jax.eval_shape(norms, *squares)
  return on_each_device(norms, squares, like)


def local_squares(
  trees: tuple, overs: tuple, per_leaf: bool = False
) -> tuple[dict, ...]:
  """Per tree of ``trees``, ``{axes: v}``: per set of mesh axes in its
  ``overs`` entry (one entry per leaf: the axes its sum is split over), a
  float32 vector ``v``: the squares of the tree's leaves split over them
  (in float32 or wider) summed on this device, then, where ``per_leaf``,
  each such leaf's. The trees' leaves at one position are summed in one
  reduction (:func:`_leaf_squares`)."""
  found = []
  for squares, over in zip(_leaf_squares(trees), overs):
    sums, each = {}, {}
    for square, axes in zip(squares, over):
      axes = tuple(sorted(axes))
      sums[axes] = sums[axes] + square if axes in sums else square
      each.setdefault(axes, []).append(square)
    found.append(
      {
        axes: jnp.stack([total, *(each[axes] if per_leaf else ())])
        for axes, total in sums.items()
      }
    )
  return tuple(found)


def _leaf_squares(trees: tuple) -> list[list[jax.Array]]:
  """Per tree (one, or two of one structure), each leaf's squares summed,
  in float32 or wider, as float32 scalars; two trees' leaves at one
  position in one reduction where they are typed alike
  (:func:`_square_sums`)."""
  leaves = [jax.tree.leaves(t) for t in trees]
  if len(trees) != 2 or len(leaves[0]) != len(leaves[1]):
    return [[_square_sums(x)[0] for x in each] for each in leaves]
  pairs = [
    _square_sums(a, b)
    if _typed_alike(a) == _typed_alike(b)
    else (_square_sums(a)[0], _square_sums(b)[0])
    for a, b in zip(*leaves)
  ]
  return [list(each) for each in zip(*pairs)]


def _square_sums(*xs: jax.Array) -> tuple[jax.Array, ...]:
  """The squares of ``xs`` (one array, or two typed alike) summed, in
  float32 or wider, as float32 scalars. Two in one reduction, of the
  complex numbers whose real and imaginary parts are their squares (a
  complex sum adds each part as a real sum does): XLA:GPU fuses it with
  what computes them, where a reduction of each would read one of them
  once more (:data:`TOGETHER_ON`); and a compiler partitions a sum of
  one operand into partial sums and an all-reduce, where it all-gathers
  the partial results of a variadic ``reduce``."""
  wide = [
    jnp.abs(x).astype(jnp.promote_types(x.dtype, jnp.float32)) for x in xs
  ]
  squares = [w * w for w in wide]
  if len(squares) == 1:
    return (jnp.sum(squares[0]).astype(jnp.float32),)
  dtype = jnp.promote_types(*(s.dtype for s in squares))
  total = jnp.sum(jax.lax.complex(*(s.astype(dtype) for s in squares)))
  return tuple(part.astype(jnp.float32) for part in (total.real, total.imag))


def _typed_alike(x: jax.Array) -> tuple:
  """What leaves summed in one reduction share: a shape, the manual axes
  they vary over, and the sharding in their type (one reduction's results
  are typed alike)."""
  return x.shape, _compat.varying_axes(x), _typed_sharding.spec(x)


def global_norms(*squares: dict, overs: tuple) -> Norms:
  """The L2 norms of trees given by their :func:`local_squares` and the
  axes of their leaves (``overs``): for each set of axes, all the trees'
  squares in one vector, summed over those axes by ``lax.psum`` (in a
  manual region): one collective per set."""
  totals = [jnp.zeros([], jnp.float32) for _ in squares]
  leaves = [[None] * len(over) for over in overs]
  for axes in sorted({a for s in squares for a in s}):
    parts = [s.get(axes) for s in squares]
    vector = jnp.concatenate([part for part in parts if part is not None])
    summed = jax.lax.psum(vector, axes) if axes else vector
    start = 0
    for tree, part in enumerate(parts):
      if part is None:
        continue
      chunk, start = summed[start : start + len(part)], start + len(part)
      totals[tree] = totals[tree] + chunk[0]
      mine = [i for i, a in enumerate(overs[tree]) if tuple(sorted(a)) == axes]
      for leaf, square in zip(mine, chunk[1:]):
        leaves[tree][leaf] = jnp.sqrt(square)
  per_leaf = all(leaf is not None for tree in leaves for leaf in tree)
  return Norms(
    jnp.sqrt(jnp.stack(totals)),
    tuple(map(tuple, leaves)) if per_leaf else ((), ()),
  )
