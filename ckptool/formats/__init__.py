"""On-disk formats: each module reads a file into a container of lazy references, and writes one back."""
