"""The model of examples/tp_transformer.py: a Llama-style decoder stack under tensor + sequence
parallelism, written as a user would write it, with no ficco_jax call inside.

`Config` and `PRESETS` (the tiny CPU model, one Llama-70B layer's shapes); the parameters with
their Megatron-style shardings (`init_params`, `param_specs`); the blocks (RMSNorm, causal
attention with RoPE and grouped-query heads, SwiGLU MLP) run in one `jax.shard_map` over a
(dp, tp) mesh with sequence-parallel activations [batch/dp, seq/tp, hidden] between blocks; and
the loss (`make_loss`): the embedding outside the shard_map, then in it the blocks, the final norm
and a vocab-parallel LM head with its cross-entropy (`lm_head_loss`).
With `Config.global_view` the same blocks are written on global arrays with explicit shardings
(a mesh of `AxisType.Explicit` axes): `reshard` gathers the sequence and the row-parallel matmuls'
`out_sharding` scatters it; only attention, which communicates nothing, runs in a shard_map over
the heads. tp_transformer.py's docstring tells where the
overlappable collectives are.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, reshard


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    hidden: int = 64
    ffn: int = 128
    heads: int = 8
    kv_heads: int = 4
    layers: int = 2
    seq: int = 64
    batch: int = 2  # sequences per data-parallel replica; global batch = batch * dp
    tp: int = 4
    dtype: str = "auto"  # "auto": bfloat16 on GPU, float32 elsewhere
    lr: float = 3e-3
    steps: int = 3
    remat: bool = False
    overlap: bool = True
    schedule: str = "auto"  # handed to ficco_jax.overlap
    overlap_ops: tuple[str, ...] | None = None  # the site kinds ficco_jax.overlap rewrites (None: every kind)
    attention: str = "xla"  # jax.nn.dot_product_attention implementation: "xla" or "cudnn"
    # Layers as a lax.scan over stacked parameters (True) or a Python loop (False). None: scan, except
    # with cuDNN attention and no remat, whose gradient in a scan body crashes XLA's compiler on 2+ GPUs
    # (SIGSEGV in compile, jax 0.11.2, H200; unrolled or with remat it compiles: RELIABILITY.md).
    scan: bool | None = None
    # A timing reference, not a model: the sequence all-gathers and reduce-scatters become local ops of
    # the same shapes (tile / sum of slices), so the step does all its other work with no communication.
    # Those local ops run on the SMs; an overlap that moves the bytes on copy engines can beat it by their
    # time (Llama-8B layer, 2 x H100: 108.25 ms overlapped, 108.98 communication-free). Its losses are
    # not the model's.
    comm_free: bool = False
    # The model on global arrays with explicit shardings and no shard_map (the mesh's axes are
    # AxisType.Explicit); the partitioner's gathers and scatters are the overlappable collectives.
    global_view: bool = False
    rope_theta: float = 10000.0
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def compute_dtype(self):
        name = self.dtype if self.dtype != "auto" else ("bfloat16" if jax.default_backend() == "gpu" else "float32")
        return jnp.dtype(name)

    @property
    def scans_layers(self) -> bool:
        if self.scan is not None:
            return self.scan
        return not (self.attention == "cudnn" and not self.remat)

    def validate(self, tp: int) -> None:
        problems = []
        if self.hidden % self.heads or self.head_dim % 2:
            problems.append(f"hidden={self.hidden} must split into heads={self.heads} of even head_dim")
        if self.heads % self.kv_heads:
            problems.append(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        for name, value in (("kv_heads", self.kv_heads), ("ffn", self.ffn), ("seq", self.seq), ("hidden", self.hidden)):
            if value % tp:
                problems.append(f"{name}={value} must divide by tp={tp}")
        if self.global_view and self.comm_free:
            problems.append("the communication-free bound replaces the shard_map view's collectives; "
                            "the global view has none written")
        if problems:
            raise ValueError(f"tp_transformer: invalid config: {'; '.join(problems)}")


PRESETS = {
    # 8 virtual CPU devices as dp=2 x tp=4; trains in seconds.
    "tiny": Config(),
    # One Llama-70B decoder layer's shapes, stacked `layers` deep, at tp=4 (4 x H200, dp=1). Per layer and
    # device: 214M parameters -> 2.0 GiB of bf16 params + f32 Adam moments. XLA's attention keeps
    # [16 local heads, 8192, 8192] f32 scores per layer for the backward pass, so activations cost
    # ~15 GiB per layer without --remat. XLA's memory analysis (compiled for 4 CPU devices): 4 layers
    # ~72 GiB per device; 8 layers with --remat ~46 GiB. The step prints the analysis it compiled.
    # The vocabulary is Llama-2's 32000, kept small so that the blocks, not the LM head, fill the step.
    "llama70b-layer": Config(vocab=32000, hidden=8192, ffn=28672, heads=64, kv_heads=8, layers=4, seq=8192,
                             batch=1, tp=4, lr=1e-4, rope_theta=500000.0),
    # One Llama-3-8B decoder layer's shapes, 8 deep. Against the 70B layer, half the hidden size and
    # half the FFN width for the same sequence: the matmuls that hide a sequence gather or scatter are
    # half as long per byte moved, so communication is a larger share of the step (the harder case
    # for overlap). Per layer and device at tp=2: 109M parameters.
    "llama8b-layer": Config(vocab=32000, hidden=4096, ffn=14336, heads=32, kv_heads=8, layers=8, seq=8192,
                            batch=1, tp=2, lr=1e-4, rope_theta=500000.0),
}


# ------------------------------------------------------------------------------------------------
# Parameters
# ------------------------------------------------------------------------------------------------
def init_params(cfg: Config, key):
    """Parameters; layer weights are stacked on a leading `layers` axis for the scan."""
    dt, L, D, F, dh = cfg.compute_dtype, cfg.layers, cfg.hidden, cfg.ffn, cfg.head_dim
    kv, q_per_kv = cfg.kv_heads, cfg.heads // cfg.kv_heads
    keys = jax.random.split(key, 6)

    def normal(k, shape, fan_in, scale=1.0):
        return (jax.random.normal(k, shape, jnp.float32) * scale / math.sqrt(fan_in)).astype(dt)

    residual_scale = 1.0 / math.sqrt(2 * L)  # keeps the residual stream's variance flat in depth
    return {
        "embed": normal(keys[0], (cfg.vocab, D), 1),
        "layers": {
            "attn_norm": jnp.ones((L, D), dt),
            "wqkv": normal(keys[1], (L, D, kv, q_per_kv + 2, dh), D),
            "wo": normal(keys[2], (L, cfg.heads, dh, D), D, residual_scale),
            "mlp_norm": jnp.ones((L, D), dt),
            "w_gate_up": normal(keys[3], (L, D, 2, F), D),
            "w_down": normal(keys[4], (L, F, D), F, residual_scale),
        },
        "final_norm": jnp.ones((D,), dt),
        "head": normal(keys[5], (D, cfg.vocab), D),
    }


def param_specs():
    """Megatron-style: column-parallel QKV / gate-up (over kv heads / ffn), row-parallel O / down."""
    return {
        "embed": P(None, "tp"),
        "layers": {
            "attn_norm": P(),
            "wqkv": P(None, None, "tp", None, None),
            "wo": P(None, "tp", None, None),
            "mlp_norm": P(),
            "w_gate_up": P(None, None, None, "tp"),
            "w_down": P(None, "tp", None),
        },
        "final_norm": P(),
        "head": P(None, "tp"),
    }


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------
def rms_norm(x, weight, eps=1e-6):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope(x, theta):
    """Rotary position embedding of x [batch, seq, heads, head_dim]; positions are 0..seq-1."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs  # [seq, half]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


ACT_SPEC = P("dp", "tp", None)  # [batch, seq, hidden]: batch over dp, sequence over tp
GATHERED_SPEC = P("dp", None, None)  # the same with the whole sequence on every tp device


def gather_seq(cfg: Config, x):
    """[b, s/tp, D] -> [b, s, D]: the sequence all-gather (with cfg.comm_free, a local tile instead;
    in the global view, a reshard that the partitioner makes an all-gather)."""
    if cfg.global_view:
        return reshard(x, GATHERED_SPEC)
    if cfg.comm_free:
        return jnp.tile(x, (1, jax.lax.axis_size("tp"), 1))
    return jax.lax.all_gather(x, "tp", axis=1, tiled=True)


def project_scatter_seq(cfg: Config, equation: str, a, w):
    """The row-parallel matmul ``einsum(equation, a, w)`` [b, s, D], its partial sums reduce-scattered
    along the sequence -> [b, s/tp, D]. In the global view its out_sharding says so."""
    if cfg.global_view:
        return jnp.einsum(equation, a, w, out_sharding=ACT_SPEC)
    return scatter_seq(cfg, jnp.einsum(equation, a, w))


def scatter_seq(cfg: Config, y):
    """[b, s, D] -> [b, s/tp, D]: the sequence reduce-scatter (with cfg.comm_free, a local sum of slices)."""
    if cfg.comm_free:
        b, s, d = y.shape
        tp = jax.lax.axis_size("tp")
        return y.reshape(b, tp, s // tp, d).sum(axis=1, dtype=y.dtype)
    return jax.lax.psum_scatter(y, "tp", scatter_dimension=1, tiled=True)


def attention_block(cfg: Config, x, p):
    """x [b, s/tp, D] -> [b, s/tp, D]; heads are sharded over tp, the sequence is gathered."""
    g = gather_seq(cfg, rms_norm(x, p["attn_norm"]))  # [b, s, D]
    qkv = jnp.einsum("bsd,dkgh->bskgh", g, p["wqkv"])  # local kv heads, each with its q group, k, v
    b, s, kv, groups, dh = qkv.shape
    q = rope(qkv[:, :, :, :-2].reshape(b, s, kv * (groups - 2), dh), cfg.rope_theta)
    k = rope(qkv[:, :, :, -2], cfg.rope_theta)
    v = qkv[:, :, :, -1]
    return project_scatter_seq(cfg, "bshk,hkd->bsd", attend(cfg, q, k, v), p["wo"])


HEADS_SPEC = P("dp", None, "tp", None)  # [batch, seq, heads, head_dim]: heads over tp


def attend(cfg: Config, q, k, v):
    """Causal attention of each device's own heads. In the global view inside a shard_map over
    the heads: attention needs no communication, and so each device runs the implementation
    (cuDNN's flash attention too) on its local heads exactly as the shard_map view does, rather
    than as the partitioner would place it."""
    def local(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=cfg.attention)

    if cfg.global_view:
        return jax.shard_map(local, in_specs=(HEADS_SPEC,) * 3, out_specs=HEADS_SPEC)(q, k, v)
    return local(q, k, v)


def mlp_block(cfg: Config, x, p):
    g = gather_seq(cfg, rms_norm(x, p["mlp_norm"]))
    gate_up = jnp.einsum("bsd,dcf->bscf", g, p["w_gate_up"])
    h = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]
    return project_scatter_seq(cfg, "bsf,fd->bsd", h, p["w_down"])


def decoder_stack(cfg: Config, x, layers):
    """Every decoder layer, as a scan over the stacked parameters (or a loop, cfg.scan): the shard_map
    body, or in the global view the global computation."""
    def layer(x, p):
        x = x + attention_block(cfg, x, p)
        return x + mlp_block(cfg, x, p), None

    layer = jax.checkpoint(layer) if cfg.remat else layer
    if cfg.scans_layers:
        return jax.lax.scan(layer, x, layers)[0]
    for i in range(jax.tree.leaves(layers)[0].shape[0]):
        x = layer(x, jax.tree.map(lambda a, i=i: a[i], layers))[0]
    return x


def lm_head_loss(cfg: Config, x, norm, head, targets):
    """Mean next-token cross-entropy with a vocab-parallel LM head (Megatron's), in the shard_map:
    x [b, s/tp, D] is normed and its sequence gathered in front of the head matmul, as in front of
    the blocks' column-parallel matmuls, giving the logits [b, s, V/tp] of this device's slice of
    the vocabulary; the softmax's max, its normaliser and the target's logit are combined over tp.
    targets [b, s]: every position's next token."""
    g = gather_seq(cfg, rms_norm(x, norm))
    logits = jnp.einsum("bsd,dv->bsv", g, head, preferred_element_type=jnp.float32)
    v_local = logits.shape[-1]
    top = jax.lax.pmax(jax.lax.stop_gradient(logits.max(axis=-1)), "tp")  # a shift: no gradient flows
    shifted = logits - top[..., None]
    log_normaliser = jnp.log(jax.lax.psum(jnp.exp(shifted).sum(axis=-1), "tp"))
    local = targets - jax.lax.axis_index("tp") * v_local  # the target's index in this slice
    mine = (local >= 0) & (local < v_local)
    picked = jnp.take_along_axis(shifted, jnp.clip(local, 0, v_local - 1)[..., None], axis=-1)[..., 0]
    target_logit = jax.lax.psum(jnp.where(mine, picked, 0.0), "tp")
    return jax.lax.pmean(jnp.mean(log_normaliser - target_logit), "dp")


def make_loss(cfg: Config, mesh: Mesh):
    if cfg.global_view:
        return _make_global_loss(cfg)
    specs = param_specs()

    def body(x, layers, norm, head, targets):
        return lm_head_loss(cfg, decoder_stack(cfg, x, layers), norm, head, targets)

    model = jax.shard_map(body, mesh=mesh, out_specs=P(),
                          in_specs=(ACT_SPEC, specs["layers"], specs["final_norm"], specs["head"], P("dp", None)))

    def loss(params, inputs, targets):
        x = jax.lax.with_sharding_constraint(params["embed"][inputs], NamedSharding(mesh, ACT_SPEC))
        return model(x, params["layers"], params["final_norm"], params["head"], targets)

    return loss


def _make_global_loss(cfg: Config):
    """The loss on global arrays (explicit mode; run under `jax.set_mesh`): every sharding is in
    the types, the LM head's logits keep the activations' [batch@dp, seq@tp] layout."""
    def loss(params, inputs, targets):
        x = params["embed"].at[inputs].get(out_sharding=ACT_SPEC)
        x = rms_norm(decoder_stack(cfg, x, params["layers"]), params["final_norm"])
        logits = jnp.einsum("bsd,dv->bsv", x, params["head"], preferred_element_type=jnp.float32,
                            out_sharding=ACT_SPEC)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    return loss
