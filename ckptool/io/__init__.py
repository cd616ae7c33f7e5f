"""Reading any checkpoint, writing one atomically and checked by content, uploading outputs."""
