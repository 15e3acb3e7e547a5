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
"""Opt-in run-time checks of the inputs, with ``jax.experimental.checkify``.

What cannot be refused at trace time (a traced negative or fractional
``num_tokens``, a non-finite ``loss``) is handled by the transform without a
host round trip: an invalid count drops its window. :func:`with_input_checks`
adds ``checkify`` checks that report such inputs with the micro-step where
they occurred, for debugging, at the cost of the checks.
"""

from jax.experimental import checkify
import jax.numpy as jnp
import optax

from optax_tokacc._state import find_state


def with_input_checks(
  tx: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Adds ``checkify`` checks of ``num_tokens``, ``loss`` and token overflow.

  Without checks, :func:`token_weighted_multistep` never raises on traced
  values: a negative ``num_tokens`` or a window whose token count overflows
  drops the window (zero updates, no step, counted in
  ``state.dropped_windows``), and a non-finite ``loss`` only shows in
  :func:`window_loss`. The wrapped transform adds ``checkify.check`` calls
  that name the bad micro-step (``mini_step`` within the window, and
  ``gradient_step``):

  - ``num_tokens`` is negative (or NaN);
  - ``loss`` is not finite;
  - the window that closes at this call was dropped (its token count, summed
    over the window and the devices, does not fit ``token_dtype`` or the
    range a floating one honours, or a count was fractional under the
    int32 counter, or infinite or below that range under a floating one).

  Updates and state are exactly those of ``tx``. As with any
  ``checkify.check``, the train step must be functionalized with
  ``checkify.checkify`` (otherwise JAX raises at trace time).

  Args:
    tx: :func:`token_weighted_multistep`, or a transformation containing it
      once (e.g. ``optax.chain``).

  Returns:
    A ``GradientTransformationExtraArgs`` with the same state as ``tx``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from jax.experimental import checkify
    >>> import optax_tokacc as tokacc
    >>> tx = tokacc.with_input_checks(
    ...     tokacc.token_weighted_multistep(optax.sgd(0.1), every_k_schedule=2))
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> @jax.jit
    ... @checkify.checkify
    ... def step(params, state, num_tokens):
    ...   grads = {'w': jnp.ones(2)}
    ...   return tx.update(grads, state, params, num_tokens=num_tokens)
    >>> err, _ = step(params, state, -3)
    >>> print(err.get().splitlines()[0])  # doctest: +ELLIPSIS
    token_weighted_multistep: num_tokens=-3 is negative ... mini_step=0, ...
  """

  def update_fn(updates, state, params=None, **extra_args):
    before = find_state(state)
    num_tokens, loss = extra_args.get('num_tokens'), extra_args.get('loss')

    def check(ok, message, **values):
      at = dict(mini_step=before.mini_step, gradient_step=before.gradient_step)
      checkify.check(ok, f'token_weighted_multistep: {message}', **values, **at)

    if num_tokens is not None and jnp.shape(num_tokens) == ():
      check(
        jnp.asarray(num_tokens) >= 0,
        'num_tokens={num_tokens} is negative (or NaN) at mini_step={mini_step}'
        ', gradient_step={gradient_step}; without checks this window is '
        'dropped.',
        num_tokens=jnp.asarray(num_tokens),
      )
    if loss is not None and jnp.shape(loss) == ():
      check(
        jnp.isfinite(loss),
        'loss={loss} is not finite at mini_step={mini_step}, '
        'gradient_step={gradient_step}.',
        loss=jnp.asarray(loss),
      )
    new_updates, new_state = tx.update(updates, state, params, **extra_args)
    check(
      find_state(new_state).dropped_windows == before.dropped_windows,
      'the window closed at mini_step={mini_step}, gradient_step='
      '{gradient_step} was dropped: its token count overflows token_dtype (or '
      'the range a floating one honours), or a num_tokens was negative, NaN '
      'or fractional under an integer counter (infinite or below that range '
      'under a floating one).',
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)
