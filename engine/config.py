"""Model and engine configuration: fixed inputs, read once at start-up."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import InvalidRequest, UnsupportedModel

DP_BACKENDS = ("thread", "process")
DP_BACKEND_MODES = ("auto", *DP_BACKENDS)
WEIGHT_MODES = ("auto", "quantized", "float")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
OVERLAP_MODES = ("auto", "on", "off")
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a Llama-family decoder, in Hugging Face's terms."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    # Per rotary frequency, what its inverse frequency is divided by: Llama 3.1's and 3.2's scaled RoPE
    # (llama.cpp's rope_freqs factors); empty: plain RoPE.
    rope_freq_factors: tuple[float, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in ARCHITECTURES:
            raise UnsupportedModel(f"architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = cfg.get("rope_parameters") or {}  # transformers >= 5 writes rope_theta and scaling here
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        factors: tuple[float, ...] = ()
        for key, scaling in (("rope_scaling", cfg.get("rope_scaling")), ("rope_parameters", rope)):
            kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
            if kind == "llama3":
                assert scaling is not None  # kind was read from it
                factors = llama3_rope_factors(scaling, theta, head_dim)
            elif kind not in (None, "default"):
                raise UnsupportedModel(f"{key} {scaling!r} is not supported (of scaled RoPE, only llama3)")
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedModel(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        context = cfg.get("max_position_embeddings", 2048)
        if _sliding_window(cfg, arch):  # within the window, full attention is windowed attention: it stops there
            context = min(context, cfg["sliding_window"])
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_position_embeddings=context,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_freq_factors=factors,
        )

    @property
    def num_params(self) -> int:
        """Parameters that take part in a token's matmuls (embedding lookup excluded, LM head included)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
        return self.num_layers * (attn + 3 * h * i) + self.vocab_size * h


def llama3_rope_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> tuple[float, ...]:
    """Llama 3.1's RoPE scaling as a divisor per frequency: short wavelengths (below the original context over
    high_freq_factor) kept, long ones (beyond it over low_freq_factor) slowed by `factor`, those between
    blended smoothly; as transformers' `llama3` rope type and llama.cpp's rope_freqs."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(float(factor))
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def _sliding_window(cfg: dict[str, Any], arch: str) -> bool:
    """Whether some layer attends only to the last `sliding_window` tokens (Mistral 7B v0.1; Qwen2 with
    use_sliding_window), as transformers decides it."""
    if not cfg.get("sliding_window"):
        return False
    if cfg.get("layer_types"):
        return "sliding_attention" in cfg["layer_types"]
    if arch == "MistralForCausalLM":
        return True
    return bool(cfg.get("use_sliding_window")) and cfg.get("max_window_layers", 0) < cfg["num_hidden_layers"]


@dataclass(slots=True)
class EngineConfig:
    """What an operator chooses: the model, where it runs, and how much memory it may use."""

    model: str | None = None
    dtype: str = "auto"  # hardware.choose_dtype: bfloat16 where the device computes it natively, else float32
    device: str = "cpu"
    kv_cache_tokens: int = 0  # per engine loop; 0: auto (kv_cache.auto_kv_cache_tokens)
    gpu_memory_utilization: float = (
        0.9  # CUDA, auto KV cache: the share of the GPU weights, KV and activations may take
    )
    kv_cache_dtype: str = "auto"  # of KV_CACHE_DTYPES: auto keeps the model's dtype (kv_cache.kv_cache_dtype)
    block_size: int = 16
    max_batch_size: int = 64
    max_batched_tokens: int = 256
    max_context_length: int | None = None
    engine_loops: int = 1  # data-parallel ranks
    dp_backend: str = "auto"  # of DP_BACKEND_MODES: ranks as threads sharing one model, or processes with one each (auto: processes on CUDA)
    tensor_parallel: int = 1  # ranks splitting each data-parallel rank's model (always processes)
    nnodes: int = 1  # machines the ranks are spread over, evenly (more than one: the ranks are processes)
    node_rank: int = 0  # this machine's place: 0 serves and holds the first ranks; others run ranks only
    master_addr: str = "127.0.0.1"  # node 0's address, reachable from every node: its store and sockets
    master_port: int = 0  # node 0's rendezvous (TCPStore) port; 0: any free one, on one node only
    default_max_new_tokens: int = 256
    stream_interval: int = 1  # tokens a stream's output gathers before it is sent (the first and the last go at once)
    max_queued_requests: int = 1024  # per engine loop; a generate beyond it is RESOURCE_EXHAUSTED
    attention_kernel: bool = True  # CPU decode and prefill attention in C++ (built on first use), else torch ops
    weights: str = (
        "auto"  # of WEIGHT_MODES: a GGUF's quantized matrices kept as blocks on the CPU (weights.keep_quantized)
    )
    int8_activations: bool = False  # quantized weights: every step rounds x to int8 (changes the numbers)
    cuda_graphs: bool = (
        True  # CUDA: decode steps replayed from graphs per batch-size bucket (not under tensor parallelism)
    )
    overlap_scheduling: str = (
        "auto"  # of OVERLAP_MODES: launch a step before reading the last one's draws (auto: on CUDA)
    )
    prefix_caching: bool = True  # full KV blocks shared by prompts that start with the same tokens
    threads: int = 0  # torch threads over all engine loops; 0: the CPUs this process may use (threads.py)

    @property
    def world_size(self) -> int:
        """Ranks over all nodes: every data-parallel rank's tensor-parallel ranks."""
        return self.engine_loops * self.tensor_parallel

    @property
    def rank_processes(self) -> bool:
        """Whether the ranks are processes: asked for; by auto on CUDA, where a loop sharing the server's GIL
        waits for it at each of a step's hundreds of launches (the server streams while the GPU computes); or
        needed by tensor parallelism or more nodes."""
        auto = self.dp_backend == "auto" and self.device.startswith("cuda")
        return auto or self.dp_backend == "process" or self.tensor_parallel > 1 or self.nnodes > 1

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "max_batch_size",
            "max_batched_tokens",
            "engine_loops",
            "tensor_parallel",
            "default_max_new_tokens",
            "max_queued_requests",
            "stream_interval",
        ):
            if getattr(self, name) < 1:
                raise InvalidRequest(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.weights not in WEIGHT_MODES:
            raise InvalidRequest(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {self.weights!r}")
        if self.int8_activations and self.weights == "float":
            raise InvalidRequest("int8 activations run on quantized weights: they cannot be had with weights float")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequest(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.overlap_scheduling not in OVERLAP_MODES:
            raise InvalidRequest(
                f"overlap_scheduling must be one of {', '.join(OVERLAP_MODES)}, got {self.overlap_scheduling!r}"
            )
        if self.dp_backend not in DP_BACKEND_MODES:
            raise InvalidRequest(f"dp_backend must be one of {', '.join(DP_BACKEND_MODES)}, got {self.dp_backend!r}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise InvalidRequest(
                f"node_rank must be 0..{self.nnodes - 1} of nnodes {self.nnodes}, got {self.node_rank}"
            )
        if not 0 <= self.master_port <= 65535:
            raise InvalidRequest(f"master_port must be 0..65535, got {self.master_port}")
        if self.nnodes > 1:
            if not self.master_port:
                raise InvalidRequest("more than one node needs a master_port the other nodes can find")
            if self.node_rank == 0 and self.world_size % self.nnodes:  # other nodes take node 0's ranks
                raise InvalidRequest(
                    f"the {self.world_size} ranks (engine_loops x tensor_parallel) do not spread "
                    f"evenly over {self.nnodes} nodes"
                )
        if self.threads < 0:
            raise InvalidRequest(f"threads must be 0 (all available CPUs) or more, got {self.threads}")
        if self.kv_cache_tokens < 0:
            raise InvalidRequest(
                f"kv_cache_tokens must be 0 (auto) or at least {self.block_size}, got {self.kv_cache_tokens}"
            )
        if self.kv_cache_tokens and self.kv_cache_tokens < self.block_size:
            raise InvalidRequest(
                f"kv_cache_tokens ({self.kv_cache_tokens}) must hold one block of {self.block_size} "
                "(0: sized automatically)"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequest(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
