"""The jobs behind the commands: inspect, scan, strip/add-prefix/remap/convert, diff, load_into."""
