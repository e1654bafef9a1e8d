"""Print the requirements of kvci (dependencies + the named extras), one per line, for pip.

`make setup` installs these before building kvci itself, so the native extension compiles
against the torch that vLLM pins.
"""

import sys
import tomllib
from pathlib import Path

pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
project = pyproject["project"]
# [project].dependencies are dynamic (setup.py pins a wheel's torch); their list is [tool.kvci].
requirements = list(pyproject["tool"]["kvci"]["dependencies"])
for extra in sys.argv[1:]:
    if extra not in project["optional-dependencies"]:
        sys.exit(f"unknown extra {extra!r}; known: {sorted(project['optional-dependencies'])}")
    # vLLM first: it pins the torch everything else must build against.
    requirements = project["optional-dependencies"][extra] + requirements
print("\n".join(dict.fromkeys(requirements)))
