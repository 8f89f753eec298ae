"""``python -m dmuon_server``: the ``dmuon-server`` command."""

import sys

from dmuon_server.cli import main

sys.exit(main())
