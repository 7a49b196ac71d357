"""The engine as a Python library: load a model, start the engine loops, submit, stream, cancel."""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from . import chat
from .block_manager import BlockManager
from .config import EngineConfig
from .engine_loop import EngineLoop
from .config import ModelConfig
from .errors import ContextOverflow, InvalidRequest, Unavailable, UnsupportedModel
from .gateway import Gateway
from .hardware import choose_dtype, cpu_features, matmul_gflops
from .distributed import ThreadComm
from .threads import available_cpus, on_fresh_thread
from .kernels import load_paged_attention
from .kernels.triton import available as triton_available
from .kv_cache import allocate_kv_cache, kv_bytes_per_token
from .loader import Checkpoint, load_checkpoint, read_config
from .memory import keep_freed_memory, release_host_memory
from .model_runner import ModelRunner
from .models import build_model, count_weight_bytes
from .models.llama import LlamaForCausalLM
from .request import Request, RequestKind, RequestOutput
from .sampling import SamplingParams

log = logging.getLogger(__name__)

Prompt = str | list[int] | list[chat.Message]  # text, token ids, or chat messages

SLEEP_TAGS = ("weights", "kv_cache")
SLEEP_GATE = "sleep"
SHAPE_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "attention_bias", "qk_norm")



@dataclass(slots=True)
class EngineInfo:
    model: str
    architecture: str
    max_context_length: int
    vocab_size: int
    engine_loops: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_block_size: int
    kv_cache_bytes: int
    weights_bytes: int
    sleeping_tags: list[str]
    active_sessions: int
    running_sequences: int
    waiting_sequences: int
    queued_requests: int
    preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int


class Stream:
    """The outputs of one request, for a caller on an ordinary thread. Iterating raises the request's error."""

    def __init__(self, engine: "Engine") -> None:
        self._engine = engine
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.request: Request | None = None

    def put(self, output: RequestOutput) -> None:
        self._queue.put(output)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self._queue.get()
            if out.error is not None:
                raise out.error
            yield out
            if out.finished:
                return

    def cancel(self) -> bool:
        return self._engine.cancel(self.request)


class Engine:
    """Shared read-only weights, one `EngineLoop` thread per data-parallel rank, each with its own KV cache."""

    def __init__(self, config: EngineConfig | None = None, checkpoint: Checkpoint | None = None) -> None:
        self.config = config = config or EngineConfig()
        keep_freed_memory()
        self.device = torch.device(config.device)
        try:
            self.dtype, self.dtype_reason = choose_dtype(config.dtype, self.device)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        self._warn_emulated_bf16()
        ckpt = checkpoint or on_fresh_thread(lambda: load_checkpoint(config.model))
        self.model_path, self.model_config, self.tokenizer = ckpt.path, ckpt.config, ckpt.tokenizer
        self.weights_path = ckpt.path  # where level-2 sleep reloads weights from; follows UpdateWeights
        self.model: LlamaForCausalLM | None = self._build(ckpt)
        self.sleeping: set[str] = set()  # of SLEEP_TAGS; written only under _admin_lock
        self._admin_lock = threading.Lock()  # serializes sleep / wakeup / update_weights; loops never take it
        num_blocks = config.kv_cache_tokens // config.block_size
        self.max_context_length = min(
            config.max_context_length or ckpt.config.max_position_embeddings,
            ckpt.config.max_position_embeddings,
            num_blocks * config.block_size,
        )
        self.kv_bytes_per_token = kv_bytes_per_token(ckpt.config, self.dtype)
        self.gateway = Gateway(config.engine_loops, config.max_queued_requests)
        # Loops step in parallel: sharing the CPUs beats each loop's pool competing for all of them.
        self.num_threads = config.threads or available_cpus()
        self.threads_per_loop = max(1, self.num_threads // config.engine_loops)
        comms = ThreadComm.create_group(config.engine_loops)
        self.loops = on_fresh_thread(lambda: [self._make_loop(comm, num_blocks) for comm in comms])
        self._threads = [
            threading.Thread(target=loop.run, name=f"lmgate-engine-{loop.rank}", daemon=True) for loop in self.loops
        ]
        for t in self._threads:
            t.start()

    def _warn_emulated_bf16(self) -> None:
        """An explicit bf16 on a CPU that only emulates it: say once what it costs here, measured."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or cpu_features().native_bf16:
            return
        fp32, bf16 = on_fresh_thread(lambda: (matmul_gflops(torch.float32), matmul_gflops(torch.bfloat16)))
        log.warning("bfloat16 on %s, which has no bf16 arithmetic in hardware: matmuls measured %.0f GFLOP/s "
                    "against %.0f in float32 (%.1fx slower); --dtype auto would choose float32",
                    cpu_features().name, bf16, fp32, fp32 / max(bf16, 1e-9))
        self.dtype_reason += f", emulated on this CPU ({fp32 / max(bf16, 1e-9):.1f}x slower matmuls than float32)"

    def _make_loop(self, comm: ThreadComm, num_blocks: int) -> EngineLoop:
        c = self.config
        runner = ModelRunner(
            self.model,
            lambda: allocate_kv_cache(self.model_config, num_blocks, c.block_size, self.dtype, self.device),
            c.block_size,
            self.device,
            self._attention_path(),
        )
        return EngineLoop(
            comm.rank, self.gateway, comm, runner, BlockManager(num_blocks, c.block_size, c.prefix_caching), self.tokenizer,
            c.max_batch_size, c.max_batched_tokens, self.max_context_length, c.default_max_new_tokens,
            self.threads_per_loop,
        )

    def _attention_path(self) -> str:
        """Triton on CUDA (torch ops without Triton); on the CPU the C++ decode kernel unless it is off or
        could not be built."""
        if self.device.type == "cuda":
            return "triton" if triton_available() else "torch"
        return "cpu" if self.config.attention_kernel and load_paged_attention() else "torch"

    # requests ----------------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a text, id or chat-messages prompt (messages rendered alone), checked against the
        vocabulary."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif chat.is_chat(prompt):
            ids = chat.render_ids(self.tokenizer, prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise InvalidRequest("the prompt is empty")
        vocab = self.tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        session_id: int = 0,
        request_id: str = "",
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> Stream | Request:
        """Queue a generation. With `on_output`, it runs on the signal thread and the `Request` is returned;
        without, a `Stream` to iterate is returned. Bad input raises here and leaves nothing behind.

        Chat messages in a session are the turn's new messages: the session keeps its conversation and each
        turn renders the whole of it (engine/chat.py)."""
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt)
        self._check_request(ids, params)
        stream = None if on_output else Stream(self)
        request = Request(
            RequestKind.GENERATE, session_id, on_output or stream.put, request_id, ids, params, stateless=not session_id
        )
        if session_id and chat.is_chat(prompt):
            request.messages = [dict(m) for m in prompt]
        self.gateway.push(request)
        if stream is None:
            return request
        stream.request = request
        return stream

    def _check_request(self, ids: list[int], params: SamplingParams) -> None:
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be below the vocabulary size {vocab}")
        total = len(ids) + params.max_new_tokens
        if total > self.max_context_length:
            raise ContextOverflow(
                f"{len(ids)} prompt tokens + {params.max_new_tokens} new tokens exceed the context window "
                f"of {self.max_context_length} tokens"
            )
        if len(ids) >= self.max_context_length:
            raise ContextOverflow(f"{len(ids)} prompt tokens leave no room in the context window of {self.max_context_length} tokens")

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, **kw) -> RequestOutput:
        """Run one request to the end; the merged output (all tokens and text, last finish reason and usage)."""
        merged = None
        for out in self.submit(prompt, params, **kw):
            if merged is None:
                merged = out
            else:
                merged.token_ids += out.token_ids
                merged.text += out.text
                merged.logprobs += out.logprobs
                merged.finish_reason, merged.usage = out.finish_reason, out.usage
        return merged

    def cancel(self, request: Request) -> bool:
        return self.gateway.cancel(request)

    def cancel_session(self, session_id: int) -> bool:
        """Cancel the session's active generation; False if it has none. Unknown session: SessionNotFound."""
        request = self.gateway.binding.active(session_id)
        return request is not None and self.gateway.cancel(request)

    # sessions ----------------------------------------------------------------------------------------------

    def start_session(self, session_id: int = 0) -> int:
        return self.gateway.start_session(session_id)

    def end_session(self, session_id: int, on_done: Callable[[RequestOutput], None] | None = None) -> None:
        """Cancel the session's active generation, free its KV, forget it. Blocks unless `on_done` is given."""
        if on_done is not None:
            self.gateway.kill(session_id, on_done)
            return
        done = threading.Event()
        self.gateway.kill(session_id, lambda _: done.set())
        done.wait()

    # state -------------------------------------------------------------------------------------------------

    def info(self) -> EngineInfo:
        """A snapshot read from other threads without locks: each figure is a single int read, possibly stale."""
        return EngineInfo(
            model=self.model_path,
            architecture=self.model_config.architecture,
            max_context_length=self.max_context_length,
            vocab_size=self.tokenizer.vocab_size,
            engine_loops=len(self.loops),
            kv_blocks_total=sum(l.blocks.num_blocks for l in self.loops),
            kv_blocks_free=sum(l.blocks.num_free for l in self.loops),
            kv_block_size=self.config.block_size,
            kv_cache_bytes=sum(l.runner.kv_cache_bytes for l in self.loops),
            weights_bytes=self.weights_bytes,
            sleeping_tags=sorted(self.sleeping),
            active_sessions=len(self.gateway.binding),
            running_sequences=sum(len(l.scheduler.running) for l in self.loops),
            waiting_sequences=sum(len(l.scheduler.waiting) for l in self.loops),
            queued_requests=sum(q.num_generates for q in self.gateway.queues),
            preemptions=sum(l.scheduler.num_preemptions for l in self.loops),
            prefix_cache_queried_tokens=sum(l.blocks.queried_tokens for l in self.loops),
            prefix_cache_hit_tokens=sum(l.blocks.hit_tokens for l in self.loops),
        )

    # sleep and wake-up -------------------------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Close admission, end every stream (CANCELLED) and session, then free memory: level 1 the KV cache
        (weights kept in host memory), level 2 the weights too. Returns once the memory is released."""
        if level not in (1, 2):
            raise InvalidRequest(f"sleep level must be 1 or 2, got {level}")
        with self._admin_lock:
            self.gateway.close_admission(SLEEP_GATE, "the engine is asleep: call Admin.Wakeup first")
            if "kv_cache" not in self.sleeping:
                self.gateway.control(RequestKind.SLEEP)  # each loop: cancel, end sessions, free its KV
                self.gateway.binding.clear()
                self.sleeping.add("kv_cache")
            if "weights" not in self.sleeping:
                self._offload_weights()
                self.sleeping.add("weights")
            if level == 2 and self.model is not None:
                self._install_model(None)
            release_host_memory()
            log.info("asleep at level %d", 2 if self.model is None else 1)

    def wakeup(self, tags: list[str] | tuple[str, ...] = ()) -> None:
        """Restore the given tags (none: all); admission reopens only once nothing sleeps."""
        unknown = set(tags) - set(SLEEP_TAGS)
        if unknown:
            raise InvalidRequest(f"unknown wake-up tags {sorted(unknown)}; known: {list(SLEEP_TAGS)}")
        with self._admin_lock:
            wanted = set(tags or SLEEP_TAGS) & self.sleeping
            if "weights" in wanted:
                self._restore_weights()
                self.sleeping.discard("weights")
            if "kv_cache" in wanted:
                self.gateway.control(RequestKind.WAKE_KV)
                self.sleeping.discard("kv_cache")
            if not self.sleeping:
                self.gateway.open_admission(SLEEP_GATE)
            log.info("woke %s; still asleep: %s", sorted(wanted), sorted(self.sleeping))

    def update_weights(self, path: str) -> None:
        """Replace the weights with a checkpoint of the same shape; a mismatch is refused, the old ones stay.
        Loops pick the new model up at their next step; a step in flight finishes on the old one."""
        if not path:
            raise InvalidRequest("path is required: a Hugging Face model directory or a .gguf file")
        with self._admin_lock:
            if "weights" in self.sleeping:
                raise Unavailable("the weights are asleep: call Admin.Wakeup with tag 'weights' first")
            _check_same_shape(read_config(path), self.model_config)
            ckpt = on_fresh_thread(lambda: load_checkpoint(path))
            self._install_model(self._build(ckpt))
            self.weights_path = ckpt.path

    def _offload_weights(self) -> None:
        """Level 1 keeps weights in host memory: moved off an accelerator, untouched on the CPU."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def _restore_weights(self) -> None:
        if self.model is None:
            ckpt = on_fresh_thread(lambda: load_checkpoint(self.weights_path))
            self._install_model(self._build(ckpt))
        elif self.device.type != "cpu":
            self.model.to(self.device)

    def _build(self, ckpt: Checkpoint) -> LlamaForCausalLM:
        """Off the calling thread, as loading is: engine/threads.py says why."""
        hint = self.config.max_batched_tokens
        return on_fresh_thread(lambda: build_model(ckpt.config, ckpt.weights, self.dtype, self.device, hint))

    def _install_model(self, model: LlamaForCausalLM | None) -> None:
        self.model = model
        for loop in self.loops:
            loop.runner.model = model
            loop.runner.weights_version += 1

    @property
    def weights_bytes(self) -> int:
        """Bytes of weights on the engine's device (tied tensors once, packed copies included)."""
        if self.model is None or (self.device.type != "cpu" and "weights" in self.sleeping):
            return 0
        return count_weight_bytes(self.model)

    def shutdown(self) -> None:
        """Refuse new work, cancel what runs, join the loops; every stream gets its last output. Then free
        the KV caches and the weights at once, rather than whenever the garbage collector breaks the
        engine's reference cycles."""
        self.gateway.shutdown()
        for t in self._threads:
            t.join()
        self.gateway.stop_signals()
        for loop in self.loops:
            loop.runner.release_kv_cache()
        self._install_model(None)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _check_same_shape(new: ModelConfig, served: ModelConfig) -> None:
    diff = [f"{f}: {getattr(new, f)} != {getattr(served, f)}" for f in SHAPE_FIELDS if getattr(new, f) != getattr(served, f)]
    if diff:
        raise UnsupportedModel(f"checkpoint does not match the served model ({'; '.join(diff)})")
