"""The request layer of the seeds: `Request`, `RequestQueue`, `SequenceBinding` and the `Gateway` in
front of the engine loops.

Data-parallel pop. Every engine loop calls `Gateway.pop` once per step with its host communicator, and the loops agree through one
AllReduce of `[ready, closed]`: they all step as soon as one has work (TurboMind's `dp_thr`, here 1), all idle
together while none has (waiting on `Gateway._arrivals` for the same arrival count, agreed by an AllReduce MIN),
and all stop at the same round once a queue is closed. A loop that dies aborts the communicator and shuts the
Gateway, so its peers leave their collectives too (`CommAborted`), ending their streams with `Unavailable`. Rank
processes count the same arrivals, each a little later: the server sends every rank a wake for each request sent
to any of them.
"""
