"""Models served and stored: upload admission, the registry, records on disk, the bucket
lifecycle, replicas following a shared store, the store's budget."""
