"""Decoder-only transformers with random weights, for checkpoint benchmarks.

Three architecture families, written here from their published descriptions
(nothing is downloaded), whose ``state_dict`` keys and parameter shapes follow
the layouts the released checkpoints use:

* ``gpt2``  -- learned token and position embeddings, pre-LayerNorm blocks
  with a fused ``c_attn`` projection (d -> 3d), a 4x GELU MLP, and Conv1D-style
  weights stored as ``(in, out)``; the LM head is tied to the token embedding,
  so the checkpoint holds one storage under two keys.
* ``llama`` -- RMSNorm, rotary positions, grouped-query attention
  (``num_kv_heads < num_heads``) with separate q/k/v/o projections, a SwiGLU
  MLP (gate/up/down) and an untied LM head unless the config ties it.
* ``phi3``  -- like ``llama`` but with a fused ``qkv_proj`` and a fused
  ``gate_up_proj``.

``build(name, dtype)`` allocates every parameter with ``torch.empty`` and fills
it once (``normal_(0, 0.02)`` for matrices, ones for norm scales, zeros for
biases); no default ``nn.Linear`` initialisation runs; ``init=False`` leaves
the memory untouched (a job about to restore a checkpoint). ``param_bytes(name,
dtype)`` and ``param_count(name)`` come from the shapes alone. Every function
taking a registry name also takes a ``ModelConfig`` (``fastpersist bench``
builds layer-trimmed stand-ins of large models that way).

The forward passes are real but minimal (no KV cache, no rope scaling, no
dropout): these models exist to be checkpointed.

    >>> m = build("llama-tiny")
    >>> sorted(m.state_dict())[:2]
    ['lm_head.weight', 'model.embed_tokens.weight']
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "CONFIGS", "names", "get_config", "build", "param_shapes",
           "param_count", "param_bytes", "init_weights",
           "GPT2LMHeadModel", "LlamaForCausalLM", "Phi3ForCausalLM"]


# --------------------------------------------------------------------------- configs

@dataclass(frozen=True)
class ModelConfig:
    arch: str                     # "gpt2" | "llama" | "phi3"
    hidden: int                   # d_model
    layers: int
    heads: int
    vocab: int
    ffn: int                      # MLP inner width
    kv_heads: Optional[int] = None  # None: same as heads (no GQA)
    max_positions: int = 1024     # GPT-2 position table; rope models ignore it
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    note: str = ""

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


CONFIGS: Dict[str, ModelConfig] = {
    # GPT-2 family: ffn = 4d, vocab 50257, context 1024, tied head.
    "gpt2": ModelConfig("gpt2", 768, 12, 12, 50257, 3072, tie_embeddings=True,
                        note="GPT-2 small, 124M"),
    "gpt2-medium": ModelConfig("gpt2", 1024, 24, 16, 50257, 4096, tie_embeddings=True,
                               note="GPT-2 medium, 355M"),
    "gpt2-large": ModelConfig("gpt2", 1280, 36, 20, 50257, 5120, tie_embeddings=True,
                              note="GPT-2 large, 774M"),
    "gpt2-xl": ModelConfig("gpt2", 1600, 48, 25, 50257, 6400, tie_embeddings=True,
                           note="GPT-2 XL, 1.5B"),
    # Llama family.
    "llama-tiny": ModelConfig("llama", 512, 8, 8, 32000, 1536, kv_heads=2,
                              note="small Llama-layout model for tests, ~57M"),
    "llama-1b": ModelConfig("llama", 2048, 16, 32, 128256, 8192, kv_heads=8, tie_embeddings=True,
                            rope_theta=500000.0, norm_eps=1e-5, note="Llama-3.2-1B-like, 1.24B"),
    "llama-3b": ModelConfig("llama", 3072, 28, 24, 128256, 8192, kv_heads=8, tie_embeddings=True,
                            rope_theta=500000.0, norm_eps=1e-5, note="Llama-3.2-3B-like, 3.2B"),
    # Phi-3: fused projections, no GQA in mini, untied head.
    "phi3-mini": ModelConfig("phi3", 3072, 32, 32, 32064, 8192, max_positions=4096,
                             norm_eps=1e-5, note="Phi-3-mini, 3.8B"),
}


def names() -> List[str]:
    return list(CONFIGS)


def get_config(name) -> ModelConfig:
    """The registry's config for name; a ModelConfig is returned as it is."""
    if isinstance(name, ModelConfig):
        return name
    try:
        return CONFIGS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(CONFIGS)}") from None


# ------------------------------------------------------------------ shapes w/o building

def param_shapes(name_or_config) -> List[Tuple[str, Tuple[int, ...]]]:
    """(state_dict key, shape) for every *distinct* parameter, in module order.

    A tied LM head is left out: it shares the token embedding's storage."""
    c = get_config(name_or_config)
    d, out = c.hidden, []
    if c.arch == "gpt2":
        out += [("transformer.wte.weight", (c.vocab, d)), ("transformer.wpe.weight", (c.max_positions, d))]
        for i in range(c.layers):
            p = f"transformer.h.{i}."
            out += [(p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
                    (p + "attn.c_attn.weight", (d, 3 * d)), (p + "attn.c_attn.bias", (3 * d,)),
                    (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
                    (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
                    (p + "mlp.c_fc.weight", (d, c.ffn)), (p + "mlp.c_fc.bias", (c.ffn,)),
                    (p + "mlp.c_proj.weight", (c.ffn, d)), (p + "mlp.c_proj.bias", (d,))]
        out += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]
        if not c.tie_embeddings:
            out.append(("lm_head.weight", (c.vocab, d)))
        return out
    if c.arch not in ("llama", "phi3"):
        raise ValueError(f"unknown architecture {c.arch!r}")
    q, kv = c.heads * c.head_dim, c.num_kv_heads * c.head_dim
    out.append(("model.embed_tokens.weight", (c.vocab, d)))
    for i in range(c.layers):
        p = f"model.layers.{i}."
        if c.arch == "llama":
            out += [(p + "self_attn.q_proj.weight", (q, d)), (p + "self_attn.k_proj.weight", (kv, d)),
                    (p + "self_attn.v_proj.weight", (kv, d)), (p + "self_attn.o_proj.weight", (d, q)),
                    (p + "mlp.gate_proj.weight", (c.ffn, d)), (p + "mlp.up_proj.weight", (c.ffn, d)),
                    (p + "mlp.down_proj.weight", (d, c.ffn))]
        else:
            out += [(p + "self_attn.o_proj.weight", (d, q)),
                    (p + "self_attn.qkv_proj.weight", (q + 2 * kv, d)),
                    (p + "mlp.gate_up_proj.weight", (2 * c.ffn, d)),
                    (p + "mlp.down_proj.weight", (d, c.ffn))]
        out += [(p + "input_layernorm.weight", (d,)), (p + "post_attention_layernorm.weight", (d,))]
    out.append(("model.norm.weight", (d,)))
    if not c.tie_embeddings:
        out.append(("lm_head.weight", (c.vocab, d)))
    return out


def param_count(name) -> int:
    return sum(math.prod(shape) for _, shape in param_shapes(name))


def param_bytes(name, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of distinct parameter storage (tied weights counted once)."""
    return param_count(name) * torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------- layers

def _param(*shape: int, dtype=None, device=None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


class Linear(nn.Module):
    """y = x W^T (+ b), weight stored (out, in); allocated, not initialised."""

    def __init__(self, n_in: int, n_out: int, bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.weight = _param(n_out, n_in, dtype=dtype, device=device)
        self.bias = _param(n_out, dtype=dtype, device=device) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class Conv1D(nn.Module):
    """GPT-2's projection: y = x W + b with the weight stored (in, out)."""

    def __init__(self, n_in: int, n_out: int, dtype=None, device=None):
        super().__init__()
        self.weight = _param(n_in, n_out, dtype=dtype, device=device)
        self.bias = _param(n_out, dtype=dtype, device=device)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class Embedding(nn.Module):
    def __init__(self, n: int, d: int, dtype=None, device=None):
        super().__init__()
        self.weight = _param(n, d, dtype=dtype, device=device)

    def forward(self, ids):
        return F.embedding(ids, self.weight)


class LayerNorm(nn.Module):
    def __init__(self, d: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = _param(d, dtype=dtype, device=device)
        self.bias = _param(d, dtype=dtype, device=device)

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = _param(d, dtype=dtype, device=device)

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _causal_attention(q, k, v):
    """q: (B, H, T, hd); k, v: (B, KV, T, hd), KV dividing H."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _rope(x, positions, theta: float):
    """Rotary embedding in the split-halves convention; x: (B, H, T, hd)."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


# --------------------------------------------------------------------------- GPT-2

class GPT2Attention(nn.Module):
    def __init__(self, c: ModelConfig, **kw):
        super().__init__()
        self.heads = c.heads
        self.c_attn = Conv1D(c.hidden, 3 * c.hidden, **kw)
        self.c_proj = Conv1D(c.hidden, c.hidden, **kw)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.c_attn(x).split(D, dim=-1))
        return self.c_proj(_causal_attention(q, k, v).transpose(1, 2).reshape(B, T, D))


class GPT2MLP(nn.Module):
    def __init__(self, c: ModelConfig, **kw):
        super().__init__()
        self.c_fc = Conv1D(c.hidden, c.ffn, **kw)
        self.c_proj = Conv1D(c.ffn, c.hidden, **kw)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, c: ModelConfig, **kw):
        super().__init__()
        self.ln_1 = LayerNorm(c.hidden, c.norm_eps, **kw)
        self.attn = GPT2Attention(c, **kw)
        self.ln_2 = LayerNorm(c.hidden, c.norm_eps, **kw)
        self.mlp = GPT2MLP(c, **kw)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, c: ModelConfig, **kw):
        super().__init__()
        self.wte = Embedding(c.vocab, c.hidden, **kw)
        self.wpe = Embedding(c.max_positions, c.hidden, **kw)
        self.h = nn.ModuleList(GPT2Block(c, **kw) for _ in range(c.layers))
        self.ln_f = LayerNorm(c.hidden, c.norm_eps, **kw)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, c: ModelConfig, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.config = c
        self.transformer = GPT2Model(c, **kw)
        if c.tie_embeddings:
            self.lm_head = Linear(c.hidden, c.vocab, dtype=dtype, device="meta")
            self.lm_head.weight = self.transformer.wte.weight  # one storage, two keys
        else:
            self.lm_head = Linear(c.hidden, c.vocab, **kw)

    def forward(self, ids):
        return self.lm_head(self.transformer(ids))


# ----------------------------------------------------------------- Llama and Phi-3

class LlamaAttention(nn.Module):
    def __init__(self, c: ModelConfig, **kw):
        super().__init__()
        self.heads, self.kv_heads, self.theta = c.heads, c.num_kv_heads, c.rope_theta
        q, kv = c.heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = Linear(c.hidden, q, **kw)
        self.k_proj = Linear(c.hidden, kv, **kw)
        self.v_proj = Linear(c.hidden, kv, **kw)
        self.o_proj = Linear(q, c.hidden, **kw)

    def qkv(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x, positions):
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        q = _rope(q.view(B, T, self.heads, -1).transpose(1, 2), positions, self.theta)
        k = _rope(k.view(B, T, self.kv_heads, -1).transpose(1, 2), positions, self.theta)
        v = v.view(B, T, self.kv_heads, -1).transpose(1, 2)
        return self.o_proj(_causal_attention(q, k, v).transpose(1, 2).reshape(B, T, -1))


class Phi3Attention(LlamaAttention):
    def __init__(self, c: ModelConfig, **kw):
        nn.Module.__init__(self)
        self.heads, self.kv_heads, self.theta = c.heads, c.num_kv_heads, c.rope_theta
        self.q_size, self.kv_size = c.heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.o_proj = Linear(self.q_size, c.hidden, **kw)
        self.qkv_proj = Linear(c.hidden, self.q_size + 2 * self.kv_size, **kw)

    def qkv(self, x):
        return self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class LlamaMLP(nn.Module):
    def __init__(self, c: ModelConfig, **kw):
        super().__init__()
        self.gate_proj = Linear(c.hidden, c.ffn, **kw)
        self.up_proj = Linear(c.hidden, c.ffn, **kw)
        self.down_proj = Linear(c.ffn, c.hidden, **kw)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Phi3MLP(nn.Module):
    def __init__(self, c: ModelConfig, **kw):
        super().__init__()
        self.gate_up_proj = Linear(c.hidden, 2 * c.ffn, **kw)
        self.down_proj = Linear(c.ffn, c.hidden, **kw)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, fused: bool, **kw):
        super().__init__()
        self.self_attn = (Phi3Attention if fused else LlamaAttention)(c, **kw)
        self.mlp = (Phi3MLP if fused else LlamaMLP)(c, **kw)
        self.input_layernorm = RMSNorm(c.hidden, c.norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.norm_eps, **kw)

    def forward(self, x, positions):
        x = x + self.self_attn(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    def __init__(self, c: ModelConfig, fused: bool, **kw):
        super().__init__()
        self.embed_tokens = Embedding(c.vocab, c.hidden, **kw)
        self.layers = nn.ModuleList(DecoderLayer(c, fused, **kw) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden, c.norm_eps, **kw)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    fused = False

    def __init__(self, c: ModelConfig, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.config = c
        self.model = DecoderStack(c, self.fused, **kw)
        if c.tie_embeddings:
            self.lm_head = Linear(c.hidden, c.vocab, dtype=dtype, device="meta")
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = Linear(c.hidden, c.vocab, **kw)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


class Phi3ForCausalLM(LlamaForCausalLM):
    fused = True


_CLASSES = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM, "phi3": Phi3ForCausalLM}


# --------------------------------------------------------------------------- build

def _unique_params(model: nn.Module) -> Iterator[Tuple[nn.Module, str, nn.Parameter]]:
    seen = set()
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield module, pname, p


@torch.no_grad()
def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """One pass over each distinct parameter: norms 1, biases 0, the rest N(0, std)."""
    for module, pname, p in _unique_params(model):
        if p.is_meta:
            continue
        if isinstance(module, (LayerNorm, RMSNorm)) and pname == "weight":
            p.fill_(1.0)
        elif pname == "bias":
            p.zero_()
        else:
            p.normal_(0.0, std)


def build(name, dtype: torch.dtype = torch.float32, device="cpu",
          seed: Optional[int] = 0, init: bool = True) -> nn.Module:
    """The named model (or a ModelConfig's) with random weights; device="meta"
    gives shapes only; init=False leaves the parameters as torch.empty made them."""
    c = get_config(name)
    if seed is not None and torch.device(device).type != "meta":
        torch.manual_seed(seed)
    model = _CLASSES[c.arch](c, dtype=dtype, device=device)
    if init:
        init_weights(model)
    return model
