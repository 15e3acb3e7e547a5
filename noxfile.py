"""CI sessions (``nox -l`` lists them; ``.ci/run`` runs them all).

- ``tests-3.11``, ``tests-3.12``, ``tests-3.13``: the README's test command
  (the fast tests, ``-m 'not slow'``), verbatim, in a fresh environment of
  each supported Python, with the newest versions the index serves there
  (jax 0.10.2 on 3.11, the newest jax on 3.12 and 3.13).
- ``tests-jax0.11``: the same on Python 3.12 with jax 0.11.2, the JAX of
  the GPU image that ``benchmarks/device_check.py`` runs on (``.ci/run``
  runs it by name only: the default run must fit CI's 90 minutes).
- ``slow``: the slow tests (``-m slow``: the examples, the benchmarks' smoke
  runs, several processes) on the newest Python, in their own session.
- ``floors``: every declared floor (``pyproject.toml``'s ``name>=X``)
  installed exactly, by ``uv pip install --resolution lowest-direct``; the
  installed versions checked against the declared ones; the fast tests.
- ``lint``: ruff, the version pinned here.
- ``docs``: the site built with ``sphinx-build -W`` (its examples run in
  the tests sessions: ``tests/test_docs.py``).
"""

import pathlib
import re

import nox

nox.options.error_on_missing_interpreters = True  # a missing one fails
nox.options.default_venv_backend = 'venv'  # with pip, as a user's venv

PYTHONS = ['3.11', '3.12', '3.13']
NEWEST = PYTHONS[-1]
RUFF = 'ruff==0.17.6'
PYTEST = ['python', '-m', 'pytest', '-q', '-p', 'no:cacheprovider']


def readme_test_command() -> str:
  """The README's line that installs the test extra and runs pytest."""
  readme = pathlib.Path('README.md').read_text()
  found = re.search(r'^pip install .*\[test\].*pytest.*$', readme, re.M)
  if found is None:
    raise ValueError("README.md has no line 'pip install ...[test]... pytest'")
  return found.group(0)


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
  session.install('--upgrade', 'pip')
  command = f'set -euo pipefail; {readme_test_command()}'
  session.run('bash', '-c', command, external=True)
  _report_versions(session)


@nox.session(name='tests-jax0.11', python='3.12')
def tests_gpu_image(session: nox.Session) -> None:
  session.install('--upgrade', 'pip')
  session.install('jax==0.11.2', 'jaxlib==0.11.2')  # the README keeps them
  tests(session)


@nox.session(python=PYTHONS[0])
def floors(session: nox.Session) -> None:
  python = f'--python={session.virtualenv.location}'
  session.run(
    'uv', 'pip', 'install', python, '--resolution', 'lowest-direct',
    '-e', '.[test]', external=True,
  )  # fmt: skip
  session.run('uv', 'pip', 'check', python, external=True)
  session.run('python', '.ci/check_floors.py')
  session.run(*PYTEST, '-m', 'not slow')


@nox.session(python=NEWEST)
def slow(session: nox.Session) -> None:
  session.install('--upgrade', 'pip')
  session.install('-e', '.[test]')
  session.run(*PYTEST, '-m', 'slow')
  _report_versions(session)


@nox.session(python=NEWEST)
def lint(session: nox.Session) -> None:
  session.install(RUFF)
  session.run('ruff', 'check', '.')
  session.run('ruff', 'format', '--check', '.')


@nox.session(python=NEWEST)
def docs(session: nox.Session) -> None:
  session.install('--upgrade', 'pip')
  session.install('-e', '.[docs]')
  html = pathlib.Path(session.create_tmp()) / 'html'
  session.run('python', '-m', 'sphinx', '-W', '--keep-going', '-q', '-b',
              'html', 'docs', str(html))  # fmt: skip


def _report_versions(session: nox.Session) -> None:
  session.run(
    'python', '-c',
    'import importlib.metadata as m, sys; print(sys.version.split()[0], '
    '*(f"{n}=={m.version(n)}" for n in ("jax", "jaxlib", "optax", "flax", '
    '"orbax-checkpoint", "chex", "numpy")))',
  )  # fmt: skip
