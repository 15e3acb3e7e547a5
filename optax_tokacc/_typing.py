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
"""The package's type aliases: trees of arrays and of partition specs.

optax's ``Params``, ``Updates`` and ``OptState`` are ``_typing.ArrayTree``, a
recursive ``Union`` that names itself in strings (``Iterable['ArrayTree']``).
``typing.get_type_hints`` looks such a string up in the module of what it
reads, where the name is not defined (``NameError``). The aliases here are
the same unions, with each string bound to this module.
"""

from collections.abc import Iterable, Mapping
from typing import Any, ForwardRef, Union

import chex
import jax


def _tree(name: str, leaf: Any) -> Any:
  """``leaf``, or containers of trees of this alias, named ``name`` here."""
  tree = ForwardRef(name, module=__name__)
  return Union[leaf, Iterable[tree], Mapping[Any, tree]]


ArrayTree = _tree('ArrayTree', chex.Array)  # chex.ArrayTree
Params = ArrayTree  # optax.Params
Updates = ArrayTree  # optax.Updates
OptState = ArrayTree  # optax.OptState
Specs = _tree('Specs', jax.P)  # a tree of jax.P, as jax.jit's shardings
