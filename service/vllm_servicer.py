"""The gateway's worker protocol, `vllm.grpc.engine.VllmEngine` (its messages from the smg-grpc-proto package),
served beside lmgate.v1 on the same port: the Shepherd Model Gateway (smg) fronts lmgate as it fronts vLLM,
SGLang and TensorRT-LLM workers, and gives it the OpenAI API.

A thin mapping onto the engine's calls, as `InferenceServicer` is; nothing here holds engine state but the ids of
the streams it serves, for `Abort`. What the protocol has and the engine does not serve yet (`n` above 1, prompt
log-probabilities, a logit bias, structured outputs) is INVALID_ARGUMENT naming it, before anything is queued.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import hashlib
import io
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
from lmgate.engine.gateway.request import FinishReason, Request, RequestOutput
from lmgate.engine.loading.loader import read_generation_defaults
from lmgate.engine.sampling.sampler import MAX_LOGPROBS, SamplingParams

from .relay import OutputRelay
from .servicer import queued_behind
from .status import abort

SERVICE = vllm.DESCRIPTOR.services_by_name["VllmEngine"].full_name
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "abort"}
TOKENIZER_CHUNK_BYTES = 1 << 20  # GetTokenizer's pieces: every message well under a client's 4 MiB


def sampling_params(s: vllm.SamplingParams) -> SamplingParams:
    """vLLM's sampling fields as the engine's, with vLLM's defaults where a field is unset (temperature 1);
    what the engine does not serve yet is refused by name."""
    unserved = [
        name
        for name, asked in (
            ("n > 1", s.n > 1),
            ("prompt_logprobs", s.HasField("prompt_logprobs")),
            ("logit_bias", bool(s.logit_bias)),
            ("truncate_prompt_tokens", s.HasField("truncate_prompt_tokens")),
            ("include_stop_str_in_output", s.include_stop_str_in_output),
            (f"a {s.WhichOneof('constraint')} constraint (structured outputs)", s.WhichOneof("constraint") is not None),
        )
        if asked
    ]
    if unserved:
        raise InvalidRequest(f"lmgate does not serve {', '.join(unserved)} yet")
    logprobs = s.logprobs if s.HasField("logprobs") else 0
    if logprobs < 0:
        raise InvalidRequest(f"logprobs -1 (the whole vocabulary) is not served: at most {MAX_LOGPROBS}")
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
            is_paused=bool(info.sleeping_tags),
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

    async def Generate(
        self, request: vllm.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vllm.GenerateResponse]:
        relay = self._relay = self._relay or OutputRelay(asyncio.get_running_loop())
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            if request_id in self._requests:
                raise InvalidRequest(f"request_id {request_id!r} is already in use by an active request")
            params = sampling_params(request.sampling_params)
            prompt: list[int] | str = (
                list(request.tokenized.input_ids) if request.HasField("tokenized") else request.text
            )
            if not prompt:
                raise InvalidRequest("no input: set tokenized.input_ids or text")
            submit = functools.partial(
                self.engine.submit, prompt, params, request_id=request_id, on_output=lambda out: relay.put(outputs, out)
            )
            running = submit() if isinstance(prompt, list) else await self._encoded(submit)
        except EngineError as exc:
            await abort(context, exc)
        self._requests[request_id] = running
        prompt_tokens = len(prompt) if isinstance(prompt, list) else 0
        received: list[RequestOutput] = []  # all of them where the end carries every token (not streaming)
        tokens: list[int] = []
        finished = False
        try:
            while not finished:
                batch = queued_behind(await outputs.get(), outputs)
                error = next((o.error for o in batch if o.error is not None), None)
                if error is not None:
                    finished = True
                    await abort(context, error)
                new = [t for o in batch for t in o.token_ids]
                tokens += new
                finished = batch[-1].finished
                if request.stream and new:
                    chunk = vllm.GenerateStreamChunk(
                        token_ids=new,
                        prompt_tokens=prompt_tokens,
                        completion_tokens=len(new),
                        output_logprobs=output_logprobs(batch),
                    )
                    yield vllm.GenerateResponse(chunk=chunk)
                elif not request.stream:
                    received += batch
                if finished:
                    yield vllm.GenerateResponse(complete=self._complete(running, batch[-1], tokens, received))
        finally:
            if not finished:  # the gateway left (its client did): nothing runs on for nobody
                self.engine.cancel(running)
            del self._requests[request_id]

    async def _encoded(self, submit: Callable[[], Request]) -> Request:
        """A text prompt is encoded on a worker thread; a caller who leaves meanwhile cancels what it submitted."""
        future = asyncio.get_running_loop().run_in_executor(None, submit)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(lambda f: f.exception() is None and self.engine.cancel(f.result()))
            raise

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
        )
        stops = self.engine.tokenizer.eos_token_ids | set(running.params.stop_token_ids)
        if last.finish_reason is FinishReason.STOP and tokens and tokens[-1] in stops:
            complete.matched_token_id = tokens[-1]
        return complete
