"""Memory: loaded kernels and their weights (the kernel cache), memory-aware admission of
uploads, handing freed memory back."""
