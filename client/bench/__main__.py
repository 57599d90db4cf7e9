"""`python -m client.bench throughput|serve ...`"""

import sys

from client.bench.cli import main

sys.exit(main())
