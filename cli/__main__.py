"""`python -m mlxd.cli ...`: how supervisord, launchd and the engine runner
start mlxd with an absolute interpreter path."""

import sys

from mlxd.cli.main import main

sys.exit(main())
