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
"""optax_tokacc: exact, token-weighted gradient accumulation for optax.

With token-level losses, micro-batches count different numbers of tokens,
and averaging their mean losses is not the full-batch loss.
:func:`token_weighted_multistep` wraps an optax optimizer so that it sees,
once per window of micro-batches (on every device), the gradient of the
window's token-mean loss: exactly what full-batch training computes. The
flat namespace also holds the helpers that read its state, lay it out on a
mesh, check its inputs, and compute token-summed losses; ``optax_tokacc.flax``
holds the Flax train states.
"""

from optax import skip_not_finite

from optax_tokacc._base import SavedState
from optax_tokacc._base import TokenWeightedMultiStepState
from optax_tokacc._base import WindowMetrics
from optax_tokacc._checkify import with_input_checks
from optax_tokacc._checkpoint import from_checkpoint
from optax_tokacc._checkpoint import to_checkpoint
from optax_tokacc._checkpoint_target import checkpoint_target
from optax_tokacc._losses import token_cross_entropy
from optax_tokacc._microbatch import microbatched_value_and_grad
from optax_tokacc._multistep import token_weighted_multistep
from optax_tokacc._state import apply_if_updated
from optax_tokacc._state import find_state
from optax_tokacc._state import has_updated
from optax_tokacc._state import window_loss
from optax_tokacc._state import window_metrics
from optax_tokacc._state_layout import init_sharded
from optax_tokacc._state_layout import state_partition_specs
from optax_tokacc._state_layout import state_shardings
from optax_tokacc._update_and_apply import update_and_apply

__version__ = '0.6.0'

__all__ = (
  'SavedState',
  'TokenWeightedMultiStepState',
  'WindowMetrics',
  'apply_if_updated',
  'checkpoint_target',
  'find_state',
  'has_updated',
  'from_checkpoint',
  'init_sharded',
  'microbatched_value_and_grad',
  'skip_not_finite',
  'state_partition_specs',
  'state_shardings',
  'to_checkpoint',
  'token_cross_entropy',
  'token_weighted_multistep',
  'update_and_apply',
  'window_loss',
  'window_metrics',
  'with_input_checks',
)
