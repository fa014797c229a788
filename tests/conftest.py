"""Every server a test starts, in process or as a child, leaves gRPC off unless the test gives it a port:
the default (8001) is one port for the whole machine. It also leaves OpenVINO off unless the test turns it
on: its build and timing on every bucket routed would add to every test that compiles."""

import os

os.environ.setdefault("JITSERVE_GRPC_PORT", "0")
os.environ.setdefault("JITSERVE_OPENVINO", "0")
