"""Measurement: timing engines side by side, the bench, kernel profiles, FLOPs, the tuning plan."""
