"""Building a bucket's kernel: compile options and settings, the target, the thread plan, the
compile child, and compile_bucket (reuse a stored kernel or build one)."""
