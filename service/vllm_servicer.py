"""The gateway's worker protocol, `vllm.grpc.engine.VllmEngine` (its messages from the smg-grpc-proto package),
served beside lmgate.v1 on the same port: the Shepherd Model Gateway (smg) fronts lmgate as it fronts vLLM,
SGLang and TensorRT-LLM workers, and gives it the OpenAI API.

A thin mapping onto the engine's calls, as `InferenceServicer` is; nothing here holds engine state but the ids of
the streams it serves, for `Abort`. A request's `n` samples stream interleaved, each message naming its sample's
index, each sample ending with its own GenerateComplete. Its structured-output `constraint` is the engine's
(`convert.constraint`). What the protocol has and the engine does not serve yet (prompt truncation, stop strings
kept in the output) is INVALID_ARGUMENT naming it, before anything is queued.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import hashlib
import io
import itertools
import json
import os
import time
import uuid
import zipfile
from typing import AsyncIterator, Callable

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm

from lmgate.engine.engine import Engine
from lmgate.engine.errors import EngineError, InvalidRequest
from lmgate.engine.gateway.request import FinishReason, Request, RequestOutput, TokenLogprob
from lmgate.engine.loading.loader import read_generation_defaults
from lmgate.engine.sampling.sampler import MAX_LOGPROBS, SamplingParams

from .kv_events import kv_event_stream
from . import convert
from .relay import OutputRelay
from .servicer import queued_behind
from .status import abort

SERVICE = vllm.DESCRIPTOR.services_by_name["VllmEngine"].full_name
_FINISH = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
    FinishReason.ABORTED: "abort",
}
TOKENIZER_CHUNK_BYTES = 1 << 20  # GetTokenizer's pieces: every message well under a client's 4 MiB


def sampling_params(s: vllm.SamplingParams) -> SamplingParams:
    """vLLM's sampling fields as the engine's, with vLLM's defaults where a field is unset (temperature 1);
    what the engine does not serve yet is refused by name."""
    unserved = [
        name
        for name, asked in (
            ("truncate_prompt_tokens", s.HasField("truncate_prompt_tokens")),
            ("include_stop_str_in_output", s.include_stop_str_in_output),
        )
        if asked
    ]
    if unserved:
        raise InvalidRequest(f"lmgate does not serve {', '.join(unserved)} yet")
    logprobs = s.logprobs if s.HasField("logprobs") else 0
    prompt_logprobs = s.prompt_logprobs if s.HasField("prompt_logprobs") else None
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and value < 0:
            raise InvalidRequest(f"{name} -1 (the whole vocabulary) is not served: at most {MAX_LOGPROBS}")
    return SamplingParams(
        max_new_tokens=s.max_tokens if s.HasField("max_tokens") else 0,
        min_new_tokens=s.min_tokens,
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed % 2**32 if s.HasField("seed") else None,  # an int32 there: its bits as our unsigned seed
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=s.skip_special_tokens,
        n=max(s.n, 1),
        logit_bias=tuple(sorted(s.logit_bias.items())),
        prompt_logprobs=prompt_logprobs,
        constraint=convert.constraint(s),
    )


def default_model_name(path: str) -> str:
    """A model's name to the gateway's clients: its folder's, or its GGUF file's without the extension."""
    return os.path.basename(os.path.normpath(path)).removesuffix(".gguf")


def tokenizer_bundle(engine: Engine) -> bytes:
    """The zip GetTokenizer sends: the engine's tokenizer as Hugging Face files, and the generation defaults."""
    files = engine.tokenizer.hf_files()
    files["generation_config.json"] = json.dumps(read_generation_defaults(engine.model_path))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as bundle:
        for name, text in sorted(files.items()):
            bundle.writestr(name, text)
    return buffer.getvalue()


def output_logprobs(outputs: list[RequestOutput]) -> vllm.OutputLogProbs | None:
    positions = [lp for o in outputs for lp in o.logprobs]
    if not positions:
        return None
    return vllm.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in positions],
        token_ids=[lp.token_id for lp in positions],
        top_logprobs=[
            vllm.TopLogProbs(values=[v for _, v in lp.top], token_ids=[t for t, _ in lp.top]) for lp in positions
        ],
    )


# A message's most bytes (the gateway's limit on what it receives is 4 MiB), and what the logprobs of one position
# with k alternatives take at most: the token's id and logprob, each alternative's, and the messages around them.
MAX_MESSAGE_BYTES = 3 << 20


def logprob_bytes(alternatives: int) -> int:
    return 10 * (alternatives + 1) + 8


def check_message_sizes(params: SamplingParams, prompt_len: int, stream: bool, default_max_tokens: int) -> None:
    """INVALID_ARGUMENT, before anything is queued, for a request whose log-probabilities would not fit in one
    message: the prompt's all go in one (its first chunk, or its complete), and so do the output's when not
    streaming (its complete)."""
    if params.prompt_logprobs is not None and prompt_len * logprob_bytes(params.prompt_logprobs) > MAX_MESSAGE_BYTES:
        raise InvalidRequest(
            f"prompt_logprobs of {prompt_len} prompt tokens with {params.prompt_logprobs} alternatives each exceed a "
            f"message's {MAX_MESSAGE_BYTES >> 20} MiB: ask for fewer alternatives, or score a shorter prompt"
        )
    most = params.max_new_tokens or default_max_tokens
    if not stream and params.logprobs and most * logprob_bytes(params.logprobs) > MAX_MESSAGE_BYTES:
        raise InvalidRequest(
            f"logprobs of up to {most} tokens with {params.logprobs} alternatives each exceed a message's "
            f"{MAX_MESSAGE_BYTES >> 20} MiB when not streaming: stream them, or ask for fewer"
        )


def input_logprobs(first_token: int, logprobs: list[TokenLogprob] | None) -> vllm.InputLogProbs | None:
    """The prompt's logprobs as vLLM sends them: one per prompt token, the first without a value."""
    if not logprobs:
        return None
    return vllm.InputLogProbs(
        token_logprobs=[vllm.InputTokenLogProb(), *(vllm.InputTokenLogProb(value=lp.logprob) for lp in logprobs)],
        token_ids=[first_token, *(lp.token_id for lp in logprobs)],
        top_logprobs=[
            vllm.TopLogProbs(),
            *(vllm.TopLogProbs(values=[v for _, v in lp.top], token_ids=[t for t, _ in lp.top]) for lp in logprobs),
        ],
    )


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """On the gRPC event loop; reaches the engine only through its thread-safe calls. `_requests` (request id ->
    engine request, for Abort) is touched only on the event loop."""

    def __init__(self, engine: Engine, served_model_name: str, unhealthy: Callable[[], str | None]) -> None:
        """`unhealthy()`: why the server should get no work (asleep, shutting down, a rank lost), or None."""
        self.engine = engine
        self.served_model_name = served_model_name
        self._unhealthy = unhealthy
        self._requests: dict[str, Request] = {}
        self._relay: OutputRelay | None = None
        self._started = time.time()

    @property
    def busy(self) -> bool:
        """A Generate stream is open."""
        return bool(self._requests)

    async def HealthCheck(
        self, request: vllm.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> vllm.HealthCheckResponse:
        reason = self._unhealthy()
        return vllm.HealthCheckResponse(healthy=reason is None, message=reason or "serving")

    async def GetModelInfo(
        self, request: vllm.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm.GetModelInfoResponse:
        engine, tokenizer = self.engine, self.engine.tokenizer
        path = engine.model_path
        has_tokenizer = os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json"))
        return vllm.GetModelInfoResponse(
            model_path=path,
            is_generation=True,
            max_context_length=engine.max_context_length,
            vocab_size=engine.vocab_size,
            served_model_name=self.served_model_name,
            tokenizer_path=path if has_tokenizer else "",
            model_type=engine.model_config.architecture.removesuffix("ForCausalLM").lower(),
            architectures=[engine.model_config.architecture],
            eos_token_ids=sorted(tokenizer.eos_token_ids),
            bos_token_id=-1 if tokenizer.bos_token_id is None else tokenizer.bos_token_id,
            pad_token_id=-1,
            max_req_input_len=engine.max_context_length - 1,
            default_sampling_params_json=json.dumps(read_generation_defaults(path)),
        )

    async def GetServerInfo(
        self, request: vllm.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm.GetServerInfoResponse:
        engine = self.engine
        info = engine.info()
        return vllm.GetServerInfoResponse(
            active_requests=info.running_sequences + info.waiting_sequences,
            is_paused=bool(info.sleeping_tags) or info.pause_mode is not None,
            uptime_seconds=time.time() - self._started,
            server_type="lmgate",
            data_parallel_size=info.engine_loops,
            kv_cache_dtype=str(engine.kv_dtype).removeprefix("torch."),
            block_size=info.kv_block_size,
            model_dtype=str(engine.dtype),
            max_num_seqs=engine.config.max_batch_size,
            engine_reasoning_parser="",
            constrained_decoding_start="first_token",
        )

    async def GetLoads(self, request: vllm.GetLoadsRequest, context: grpc.aio.ServicerContext) -> vllm.GetLoadsResponse:
        """The engine's figures as one rank's: the gateway's overload veto and least-load policy read them."""
        info = self.engine.info()
        used = info.kv_blocks_total - info.kv_blocks_free
        load = vllm.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=info.running_sequences,
            num_waiting_reqs=info.waiting_sequences + info.queued_requests,
            num_total_reqs=info.running_sequences + info.waiting_sequences + info.queued_requests,
            num_used_tokens=used * info.kv_block_size,
            max_total_num_tokens=info.kv_blocks_total * info.kv_block_size,
            token_usage=used / max(info.kv_blocks_total, 1),
            cache_hit_rate=info.prefix_cache_hit_tokens / max(info.prefix_cache_queried_tokens, 1),
            max_running_requests=self.engine.config.max_batch_size * info.engine_loops,
        )
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        return vllm.GetLoadsResponse(timestamp=now, version="lmgate", dp_rank_count=1, loads=[load])

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        """The tokenizer as the gateway loads it, from the engine's own (a GGUF's included): tokenize and render
        there exactly as here."""
        bundle = tokenizer_bundle(self.engine)
        digest = hashlib.sha256(bundle).hexdigest()
        for start in range(0, len(bundle), TOKENIZER_CHUNK_BYTES):
            last = start + TOKENIZER_CHUNK_BYTES >= len(bundle)
            yield common_pb2.GetTokenizerChunk(
                data=bundle[start : start + TOKENIZER_CHUNK_BYTES], sha256=digest if last else ""
            )

    async def Abort(self, request: vllm.AbortRequest, context: grpc.aio.ServicerContext) -> vllm.AbortResponse:
        """Idempotent: an unknown or finished id is no error (the gateway aborts every stream its client left)."""
        for request_id in request.request_ids:
            running = self._requests.get(request_id)
            if running is not None:
                self.engine.cancel(running)
        return vllm.AbortResponse()

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The prefix cache's block events, for the gateway's cache-aware routing (service/kv_events.py);
        UNIMPLEMENTED without prefix caching, which the gateway takes for "no events here"."""
        if not self.engine.config.prefix_caching:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "prefix caching is off: no KV events")
        events = kv_event_stream(
            self.engine.kv_events, self.engine.config.block_size, request.start_sequence_number, context
        )
        async for batch in events:
            yield batch

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        """Forget the prefix cache at once, with requests in flight or not (`timeout_s` has nothing to wait for):
        what runs keeps its blocks. The gateway's POST /flush_cache sends it to every worker."""
        try:
            await asyncio.to_thread(self.engine.flush_prefix_cache)
        except EngineError as exc:
            return common_pb2.FlushCacheResponse(success=False, message=str(exc))
        return common_pb2.FlushCacheResponse(success=True, message="the prefix cache is empty")

    async def Generate(
        self, request: vllm.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vllm.GenerateResponse]:
        relay = self._relay = self._relay or OutputRelay(asyncio.get_running_loop())
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            params = sampling_params(request.sampling_params)
            if request.HasField("tokenized"):
                prompt = list(request.tokenized.input_ids)
            elif request.text:  # encoded off the event loop: a long text takes a while
                prompt = await asyncio.to_thread(self.engine.encode_prompt, request.text)
            else:
                raise InvalidRequest("no input: set tokenized.input_ids or text")
            check_message_sizes(params, len(prompt), request.stream, self.engine.config.default_max_new_tokens)
            if request_id in self._requests:
                raise InvalidRequest(f"request_id {request_id!r} is already in use by an active request")
            # The gateway reads token ids and detokenizes itself: no text is written that a stop string does not need
            running = self.engine.submit(
                prompt, params, request_id=request_id, on_output=lambda out: relay.put(outputs, out), text=False
            )
        except EngineError as exc:
            await abort(context, exc)
        self._requests[request_id] = running
        prompt_tokens = len(running.input_ids)
        # Per sample: its tokens so far, and (not streaming) its outputs, all sent with its end. Not streaming, the
        # ends go together, in the order of their index: the gateway numbers the choices in the order they come.
        tokens: dict[int, list[int]] = collections.defaultdict(list)
        received: dict[int, list[RequestOutput]] = collections.defaultdict(list)
        ends: dict[int, vllm.GenerateComplete] = {}
        finished = False
        try:
            while not finished:
                batch = queued_behind(await outputs.get(), outputs)
                error = next((o.error for o in batch if o.error is not None), None)
                if error is not None:
                    finished = True
                    await abort(context, error)
                finished = batch[-1].finished
                for index, group in itertools.groupby(batch, key=lambda o: o.index):
                    run = list(group)
                    new = [t for o in run for t in o.token_ids]
                    tokens[index] += new
                    if request.stream and new:
                        chunk = vllm.GenerateStreamChunk(
                            token_ids=new,
                            prompt_tokens=prompt_tokens,
                            completion_tokens=len(new),
                            output_logprobs=output_logprobs(run),
                            input_logprobs=input_logprobs(running.input_ids[0], run[0].prompt_logprobs),
                            index=index,
                        )
                        yield vllm.GenerateResponse(chunk=chunk)
                    elif not request.stream:
                        received[index] += run
                    if run[-1].finish_reason is not None:
                        ends[index] = self._complete(running, run[-1], tokens[index], received[index])
                        if request.stream:
                            yield vllm.GenerateResponse(complete=ends[index])
            if not request.stream:
                for index in sorted(ends):
                    yield vllm.GenerateResponse(complete=ends[index])
        finally:
            if not finished:  # the gateway left (its client did): nothing runs on for nobody
                self.engine.cancel(running)
            del self._requests[request_id]

    def _complete(
        self, running: Request, last: RequestOutput, tokens: list[int], received: list[RequestOutput]
    ) -> vllm.GenerateComplete:
        """The stream's end: why (and the stop token that ended it), the usage; not streaming (`received`: the
        request's outputs), every token with its logprobs."""
        usage = last.usage
        complete = vllm.GenerateComplete(
            finish_reason=_FINISH[last.finish_reason],
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=len(tokens),
            cached_tokens=usage.cached_tokens if usage else 0,
            output_ids=tokens if received else (),
            output_logprobs=output_logprobs(received),
            input_logprobs=input_logprobs(running.input_ids[0], next((o.prompt_logprobs for o in received), None)),
            index=last.index,
        )
        stops = self.engine.tokenizer.eos_token_ids | set(running.params.stop_token_ids)
        if last.stop_string is not None:
            complete.matched_stop_str = last.stop_string
        elif last.finish_reason is FinishReason.STOP and tokens and tokens[-1] in stops:
            complete.matched_token_id = tokens[-1]
        return complete
