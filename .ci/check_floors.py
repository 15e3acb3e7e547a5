"""The installed versions are the floors that pyproject.toml declares.

Every requirement of the dependencies and of the extras but ``docs`` (the
site's tools, built at their newest) and ``accelerators`` (the compilers,
pinned exactly with the vendored GPU specs) must read ``name>=floor``; each must be
installed at exactly its floor. The ``floors`` session of ``noxfile.py``
installs them with ``uv pip install --resolution lowest-direct`` and runs
this before the tests, so that a floor that is not the lowest version that
works, or a requirement written another way, fails CI.
"""

import importlib.metadata
import re
import sys
import tomllib


def release(version):  # '2.0' and '2.0.0' are the same version
  parts = version.split('.')
  while len(parts) > 1 and parts[-1] == '0':
    parts.pop()
  return '.'.join(parts)


def main():
  with open('pyproject.toml', 'rb') as f:
    project = tomllib.load(f)['project']
  requirements = list(project['dependencies'])
  for name, extra in project.get('optional-dependencies', {}).items():
    if name not in ('docs', 'accelerators'):
      requirements += extra
  problems = []
  for requirement in requirements:
    m = re.fullmatch(r'\s*([A-Za-z0-9_.-]+)\s*>=\s*([^,;\s]+)\s*', requirement)
    if m is None:
      problems.append(f'{requirement!r} is not of the form name>=floor')
      continue
    name, floor = m.groups()
    installed = importlib.metadata.version(name)
    mark = 'ok' if release(installed) == release(floor) else 'NOT THE FLOOR'
    print(f'  {name}>={floor}: installed {installed} {mark}')
    if mark != 'ok':
      problems.append(f'{name}: declared >={floor}, installed {installed}')
  for problem in problems:
    print(problem, file=sys.stderr)
  return 1 if problems else 0


if __name__ == '__main__':
  sys.exit(main())
