"""`python -m executor_svc` runs the executor CLI."""

import sys

from executor_svc.cli import main

sys.exit(main())
