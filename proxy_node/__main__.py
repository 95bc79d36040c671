"""`python -m proxy_node`: one proxy node, the same flags as `coordinator serve`."""

from __future__ import annotations

import sys

from proxy_node import serve
from proxy_node.entry import standalone_main

sys.exit(
    standalone_main(
        "python -m proxy_node",
        "Run one proxy node: service plane and control plane.",
        serve.add_arguments,
        serve.run,
    )
)
