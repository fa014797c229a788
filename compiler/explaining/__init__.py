"""Explain reports: where a bucket's time goes, kernel by kernel, and the report page."""
