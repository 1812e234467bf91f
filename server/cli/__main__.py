"""`python -m jaxserve.server.cli` runs the `jaxserve` console script."""
import sys

from jaxserve.server.cli.main import main

sys.exit(main())
