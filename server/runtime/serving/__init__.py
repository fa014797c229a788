"""A request's way through the runtime: the one entry (requests.py), planning and running
(inference.py), dynamic batching, request bodies and inputs, shadow checks of served answers."""
