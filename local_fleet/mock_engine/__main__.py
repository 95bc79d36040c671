"""`python -m local_fleet.mock_engine`: the same flags as `coordinator mock-engine`."""

from __future__ import annotations

import sys

from local_fleet.mock_engine.http import main

sys.exit(main())
