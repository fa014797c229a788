"""Shape buckets: axis policies, a request's bucket, pad and cut back, and the padding-safety check."""
