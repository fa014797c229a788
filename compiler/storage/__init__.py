"""The content-addressed kernel store, its keys and leases, and its budget."""
