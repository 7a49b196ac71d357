"""Ranks of the engine: engine loops as threads or as processes (data and tensor parallel), nodes; they build engine loops and sit just below `Engine`."""
