"""jitserve's HTTP layer: thin adapters over :class:`compiler.service.ModelService`."""
