"""Files and URLs: opening inputs, exact reads, atomic outputs, the copy engine, CRC."""
