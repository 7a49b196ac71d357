"""The scheduler's batch order on hand-built sequences: the model runner reads the first rows as decodes."""
from __future__ import annotations

from lmgate.engine.block_manager import BlockManager
from lmgate.engine.request import Request, RequestKind
from lmgate.engine.scheduler import Scheduler
from lmgate.engine.sequence import Sequence, SequenceStatus, Session


def running_sequence(prompt_len: int, computed: int) -> Sequence:
    request = Request(RequestKind.GENERATE, 0, lambda out: None, input_ids=list(range(prompt_len)))
    seq = Sequence(request, Session(0), detokenizer=None, max_new_tokens=8, eos_ids=frozenset())
    seq.status, seq.num_computed = SequenceStatus.RUNNING, computed
    return seq


def test_a_one_token_prefill_chunk_goes_after_the_decodes():
    """Two tokens of budget, one decode: the prefill ahead of it in `running` gets a chunk of one token, which
    must come after the decode (it was sorted among the decodes, and its row read as one)."""
    scheduler = Scheduler(BlockManager(16, 16), {}, max_batch_size=8, max_batched_tokens=2)
    prefilling, decoding = running_sequence(40, computed=16), running_sequence(3, computed=2)
    scheduler.running = [prefilling, decoding]
    batch = scheduler.schedule()
    assert batch == [decoding, prefilling]
    assert (decoding.num_scheduled, prefilling.num_scheduled) == (1, 1)
