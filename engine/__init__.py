"""lmgate's engine: usable as a library on its own (see README.md here for its contract).

Before anything imports torch: OpenMP threads that wait at a barrier sleep instead of spinning, unless the
environment says otherwise. On a 2-core machine with one busy process beside the engine, spinning threads
kept waiting for a thread the neighbour had displaced: batch throughput fell from 152 to 58 tokens/s and a
single stream from 17 to 7; sleeping waiters gave 163 and 127 (25 and 15 for the single stream), with no
loss on an idle machine. libgomp reads the variable once, when torch loads it.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
