"""Every server a test starts, in process or as a child, leaves gRPC off unless the test gives it a port:
the default (8001) is one port for the whole machine."""

import os

os.environ.setdefault("JITSERVE_GRPC_PORT", "0")
