"""Package discovery; the rest of the metadata is in pyproject.toml.

The HTTP layer lives in the top-level folder server/ but installs as `jaxserve.server` (DESIGN.md:
no bare `server` module in site-packages). pyproject's static `packages.find` cannot rename what it
finds, so the packages are found here: every package under jaxserve/, and every package under
server/ renamed into jaxserve.server. (`jaxserve/server`, a git-ignored symlink some checkouts
have, is skipped: server/ is its one source.) .ci/wheel_check checks that a built wheel holds
every module of the tree.
"""

from setuptools import find_packages, setup

engine = find_packages(include=["jaxserve", "jaxserve.*"], exclude=["jaxserve.server", "jaxserve.server.*"])
front_ends = ["jaxserve." + name for name in find_packages(include=["server", "server.*"])]

setup(packages=engine + front_ends, package_dir={"jaxserve": "jaxserve", "jaxserve.server": "server"})
