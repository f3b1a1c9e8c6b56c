"""`python -m epd_serve.cli`: the epd-serve command without its console script."""

import sys

from epd_serve.cli.main import main

sys.exit(main())
