"""The request layer of the seeds: Request, RequestQueue, SequenceBinding and the Gateway in front of the engine loops."""
