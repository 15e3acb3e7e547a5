"""CI sessions (``nox -l`` lists them; ``.ci/run`` runs them all).

- ``tests-3.11``, ``tests-3.12``, ``tests-3.13``: the README's test command
  (the fast tests, ``-m 'not slow'``), verbatim, in a fresh environment of
  each supported Python, with the newest versions the index serves there
  (jax 0.10.2 on 3.11, the newest jax on 3.12 and 3.13). ``.ci/run`` runs
  ``tests-3.11`` only, and ``tests-3.12`` and ``tests-3.13`` by name: the
  same tests run with the newest versions on 3.12 in ``release``, from the
  installed wheel with the same ``[test]`` extra, and the other sessions
  on 3.13 (slow, accelerators, docs) install the checkout editable as the
  README does (the default run must fit CI's 90 minutes: it took 85 with
  ``tests-3.12`` too).
- ``tests-jax0.11``: the same on Python 3.12 with jax 0.11.2, the JAX of
  the GPU image that ``benchmarks/device_check.py`` runs on (``.ci/run``
  runs it by name only: the default run must fit CI's 90 minutes).
- ``slow``: the slow tests (``-m slow``: the examples, the benchmarks' smoke
  runs, several processes) on the newest Python, in their own session.
- ``floors``: every declared floor (``pyproject.toml``'s ``name>=X``)
  installed exactly, by ``uv pip install --resolution lowest-direct``; the
  installed versions checked against the declared ones; the fast tests.
- ``accelerators``: the accelerator tier (``tests/accelerators/``): the
  training steps compiled on this CPU for H100, H200 and TPU v5e/v6e/v5p
  targets by XLA:GPU and XLA:TPU (the ``accelerators`` extra), and what
  their programs must hold; it fails if a test is skipped or fewer than
  :data:`ACCELERATOR_TESTS` ran.
- ``lint``: ruff, the version pinned here.
- ``docs``: the site built with ``sphinx-build -W`` (its examples run in
  the tests sessions: ``tests/test_docs.py``).
- ``release``: what users install, built and tested as they get it, on
  Python 3.12 (the one supported Python no other default session runs):
  the sdist, a wheel built from the sdist (``python -m build``), ``twine check
  --strict``; the wheel installed in a fresh environment, and the fast
  tests run from the unpacked sdist's ``tests/``, where the checkout is not
  importable; the version checked against the artifacts' names and a tag
  ``vX.Y.Z`` on the commit, where there is one.
"""

import pathlib
import re
import shutil
import subprocess
import tarfile
from xml.etree import ElementTree

import nox

nox.options.error_on_missing_interpreters = True  # a missing one fails
nox.options.default_venv_backend = 'venv'  # with pip, as a user's venv

PYTHONS = ['3.11', '3.12', '3.13']
NEWEST = PYTHONS[-1]
RELEASE_PYTHON = '3.12'  # the fast tests from the wheel: see the docstring
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
  # The longest tests, in the log: the run must fit CI's 90 minutes, and
  # this session is its longest.
  session.run(*PYTEST, '-m', 'slow', '--durations=25')
  _report_versions(session)


ACCELERATOR_TESTS = 30  # at least: the tier never passes by running nothing


@nox.session(python=NEWEST)
def accelerators(session: nox.Session) -> None:
  session.install('--upgrade', 'pip')
  session.install('-e', '.[test,accelerators]')
  report = pathlib.Path(session.create_tmp()).resolve() / 'accelerators.xml'
  # The tier, the docs' examples that compile for an accelerator and the
  # compiled benchmark's figures (the other sessions skip them: they have
  # no compilers).
  session.run(
    *PYTEST, 'tests/accelerators', 'tests/test_docs.py',
    'tests/test_benchmarks.py', '-k',
    'accelerators or checking_steps or ahead_of_time or '
    'compiled_figures_per_target', '--dist', 'loadgroup',
    f'--junitxml={report}', '--durations=10',
    env={'OPTAX_TOKACC_ACCELERATORS': '1', 'JAX_PLATFORMS': 'cpu'},
  )  # fmt: skip
  ran, skipped = _junit_counts(report)
  session.log(f'accelerator tier: {ran} tests ran, {len(skipped)} skipped')
  if skipped or ran < ACCELERATOR_TESTS:
    session.error(
      f'the accelerator tier ran {ran} tests (at least {ACCELERATOR_TESTS}) '
      f'and skipped {skipped}: it must compile for every target'
    )


def _junit_counts(path: pathlib.Path) -> tuple[int, list[str]]:
  """Tests that ran, and the names of those skipped (an expected failure,
  ``xfail``, ran: it is not skipped)."""
  root = ElementTree.parse(path).getroot()
  cases = list(root.iter('testcase'))
  skipped = [
    case.get('name')
    for case in cases
    for mark in case.findall('skipped')
    if mark.get('type') != 'pytest.xfail'
  ]
  return len(cases) - len(skipped), skipped


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


@nox.session(python=RELEASE_PYTHON)
def release(session: nox.Session) -> None:
  tmp = pathlib.Path(session.create_tmp()).resolve()
  dist, unpacked, venv = tmp / 'dist', tmp / 'sdist', tmp / 'venv'
  for path in (dist, unpacked, venv):
    shutil.rmtree(path, ignore_errors=True)
  session.install('--upgrade', 'pip')
  session.install(*RELEASE_TOOLS)
  session.run('python', '-m', 'build', '--outdir', str(dist))  # sdist, then
  session.run('twine', 'check', '--strict', *map(str, dist.iterdir()))
  version = _check_release_names(dist)
  _check_tag(session, version)
  (sdist,) = dist.glob('*.tar.gz')
  with tarfile.open(sdist) as archive:
    archive.extractall(unpacked, filter='data')
  (wheel,) = dist.glob('*.whl')
  python = str(venv / 'bin' / 'python')
  session.run('python', '-m', 'venv', str(venv))
  session.run(python, '-m', 'pip', 'install', '--upgrade', 'pip', silent=True)
  session.run(python, '-m', 'pip', 'install', f'{wheel}[test]')
  with session.chdir(unpacked / f'optax_tokacc-{version}' / 'tests'):
    session.run(python, '-c', INSTALLED_CHECK, version, external=True)
    session.run(python, *PYTEST[1:], '-m', 'not slow', external=True)


RELEASE_TOOLS = ['build==1.3.0', 'twine==6.2.0']
# Run from the unpacked sdist's tests/: the package imported is the wheel's.
INSTALLED_CHECK = """
import pathlib, sys, sysconfig
import optax_tokacc
where = pathlib.Path(optax_tokacc.__file__).resolve()
site = pathlib.Path(sysconfig.get_paths()['purelib']).resolve()
assert site in where.parents, f'optax_tokacc imported from {where}, not {site}'
assert optax_tokacc.__version__ == sys.argv[1], optax_tokacc.__version__
print(f'optax_tokacc {optax_tokacc.__version__} from {where.parent}')
"""


def _check_release_names(dist: pathlib.Path) -> str:
  """The version the artifacts carry, the same in both and in the
  package's one source (``__version__``, read without importing it)."""
  init = pathlib.Path('optax_tokacc/__init__.py').read_text()
  version = re.search(r"^__version__ = '(.+)'$", init, re.M).group(1)
  names = sorted(path.name for path in dist.iterdir())
  expected = [
    f'optax_tokacc-{version}-py3-none-any.whl',
    f'optax_tokacc-{version}.tar.gz',
  ]
  if names != expected:
    raise ValueError(f'built {names}, expected {expected}')
  return version


def _check_tag(session: nox.Session, version: str) -> None:
  """A release tag on this commit must be ``v`` + the version (no tag: a
  commit between releases, nothing to check)."""
  if shutil.which('git') is None:
    session.log('no git here: no release tag to check')
    return
  found = subprocess.run(
    ['git', 'tag', '--points-at', 'HEAD', '--list', 'v*'],
    capture_output=True, text=True, check=False,
  ).stdout.split()  # fmt: skip
  if found and f'v{version}' not in found:
    session.error(f'tags {found} on this commit, but the version is {version}')
  session.log(f'release tags on this commit: {found or "none"}')


def _report_versions(session: nox.Session) -> None:
  session.run(
    'python', '-c',
    'import importlib.metadata as m, sys; print(sys.version.split()[0], '
    '*(f"{n}=={m.version(n)}" for n in ("jax", "jaxlib", "optax", "flax", '
    '"orbax-checkpoint", "chex", "numpy")))',
  )  # fmt: skip
