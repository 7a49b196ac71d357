"""Ranks of the engine: engine loops as threads (`ThreadRanks`) or as processes (`ProcessRanks`,
`RankProcess`: `dp_backend="process"`, and "auto" on CUDA), tensor parallel groups, nodes. They build
engine loops, and sit just below `Engine`.

The server process keeps the Gateway, the SequenceBinding and the admission gates; each rank process has a
`RankGateway` (the ordinary Gateway, every request routed to its own loop) and agrees with its peers in `pop`
over `GlooComm`. A request is marked active before it leaves (`RemoteQueue.push`, under its lock), so a cancel
from then on is forwarded (`Request.on_cancel`) and the rank's own flag decides who ends the stream, exactly
once. A request arriving at one rank wakes the others' idle loops (`("wake",)`), which the agreement needs. The
rank mirrors the session binding (bound on a session's first turn there, unbound by its kill). Stats travel with
every output message, so `Info` is as fresh as the last output.

Tensor parallelism (`tensor_parallel=N`, always processes): world rank r is tensor-parallel rank r % N of data-
parallel rank r // N. Only the group's first rank (the leader) runs an `EngineLoop` and takes requests; the
leaders agree in `pop` over a `GlooComm` split from the world's. The leader's `ModelRunner` broadcasts each
step's `StepPlan` (kSetup's plain lists) and each KV release / allocation over the group's `GlooComm`; followers
(`RankProcess._follow`) prepare the plan for their own KV heads (kPrepare) and run the same forward. Each rank's
`LocalWeights` holds its shard (`models/tensor_parallel.py`), and its decoder layers sum o_proj's and
down_proj's partial outputs over a `DeviceGroup` (gloo, or NCCL on CUDA). Weight calls go to every rank process.
UpdateWeights on rank processes runs in two phases: every rank loads and stages its weights or shard
(`LocalWeights.load`, keyed by the call's wire id); if any rank fails to load, the others discard theirs and
nothing switches (data-parallel ranks on different weights would answer alike requests differently). Else a lone
rank installs its version at once; a tensor-parallel leader is told the version and installs it at the start of
its next step, broadcasting `install_weights` first (`ModelRunner.install_pending_weights`), so no step mixes
old and new shards. A follower reports whether it could allocate its KV cache at a wake-up (an all-reduce after
`allocate_kv`); if any rank could not, all free theirs and the Wakeup fails. A follower whose leader fails
leaves its broadcast (`CommAborted`) and exits 1.

A dead rank: the receiver sees its process end without the "exited" it sends after a clean close, ends every
request in flight with `Unavailable` (kills and controls answered, weight calls released), closes admission and
calls the failure listeners (the server: NOT_SERVING, stop, exit 1). Its peers in a collective leave it as gloo
sees the closed connection, fail their streams the same way and exit 1; an idle peer waits outside any
collective until `ProcessRanks.shutdown` kills it, or its server's process ends: ranks of a dead server exit
when its process does (they watch its sentinel). With ranks as threads, a loop that stops by itself (an error
outside any step, or a peer's) ends what it holds and has queued with `Unavailable`, not as cancelled (a client
retries elsewhere), returns why from `EngineLoop.run`, and `ThreadRanks` makes the first such reason the failure
and calls the listeners the same way. A listener registered after the failure (a server still being built when a
rank died) is called at once. A local rank that exits during start-up fails the start, even one that had said
ready: it leaves when a peer it waits on in a collective (a remote rank still loading) has died. Leaders stop as
closed when they agree to close, whether or not their own "close" has arrived yet, and stop their followers
(exit 0, streams CANCELLED).

On one node, `ProcessRanks` binds its sockets as files in a fresh 0700 directory (removed at shutdown), and its
TCPStore on `master_addr` alone (`GlooComm.create_store` binds the socket itself: a TCPStore binds every
interface): rank messages are pickles, which must not come from another user. The store and gloo's pairs are
still TCP on loopback, open to the machine's other users (README: a container on a shared host), so what a
`GlooComm` sends is signed with its group's secret (`RankSpec.secret`, from the parent; past node 0 through the
store): a value the secret did not sign aborts the group unread.

More nodes (`nnodes=K`): world ranks spread evenly, node n holding ranks [n·W/K, (n+1)·W/K). Node 0's
`ProcessRanks` binds its sockets and TCPStore on `master_addr`, spawns its own share and publishes each other
node's `RankSpec`s in the store, where `run_node` fetches them. gloo's devices bind to the address on the route
to node 0 (`gloo_comm.local_address`: gloo's default resolves the host name, often to an address other nodes
cannot reach). A request carries its age, not its arrival: monotonic clocks differ between machines. Sentinels
cannot cross machines, so node 0's receiver pings every remote rank each `HEARTBEAT_SECONDS` and each rank says
`("alive",)` as often; `HEARTBEAT_TIMEOUT` of silence is a death on either side (node 0 fails as for a dead
rank; a remote rank exits 1, counting only from node 0's first word, so a slow start elsewhere is not silence).
"""
