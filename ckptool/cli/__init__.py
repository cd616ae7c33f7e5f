"""The ckptool command line: options, commands, and the text they print."""
