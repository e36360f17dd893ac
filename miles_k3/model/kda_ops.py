"""KDA (Kimi Delta Attention) recurrence ops for K3: a differentiable chunked (WY/UT) form in plain PyTorch,
its one-token decode step, and `KDABackend`, the switch (resolved once at start) between that form, fla-core's
CPU references and fla-core's Triton kernels on CUDA. Per head the fp32 state S [K, V] evolves per token as
S <- S * exp(g_t)[:, None];  S <- S + (beta_t k_t)(v_t - k_t^T S);  o_t = q_t^T S  (q, k unit rows, q scaled).

Shape legend (suffixes on tensor names): B batch, T tokens, H heads (q/k heads; the v heads HV may be a
multiple: GVA), K key dim, V value dim, N chunks, C rows per chunk, X = B*H flattened batch of heads.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange

from miles_k3.model.layers import to_dtype

# benchmarks/bench_kda_cpu.py measures 16 and 32 at the same speed on CPU; 16 keeps every factored decay
# exponent within e^+-37.5 for g >= -5, where 32 needs e^+-77.5 and leaves gradient intermediates ~e^11 of
# room below fp32's overflow.
DEFAULT_CHUNK_SIZE = 16
DEFAULT_GATE_LOWER_BOUND = -5.0
# fp32 overflows past e^88.7; the margin absorbs the K-term sums in the scores and their gradients.
_MAX_SAFE_EXPONENT = 80.0
BACKEND_NAMES = ("auto", "torch_chunk", "naive_recurrent", "naive_chunk", "fla", "fla_fp32")
FLA_BACKENDS = ("fla", "fla_fp32")  # fla's Triton kernels: CUDA only; the engine decodes with kernels.kda_decode


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2, -1) + eps) over the last dim, computed and returned in fp32 (eps as in fla)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _expand_heads(x_BTHK: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """GVA: repeat each q/k head for the v heads that share it ([B, T, H, K] -> [B, T, HV, K])."""
    groups = num_v_heads // x_BTHK.shape[2]
    return x_BTHK if groups == 1 else x_BTHK.repeat_interleave(groups, dim=2)


def _to_chunks(x_BTH_: torch.Tensor, chunk: int) -> torch.Tensor:
    """[B, T, H, *] (any dtype) -> contiguous fp32 [B, H, N, C, *], zero-padding T up to N*C.

    Zero padding is what makes the tail harmless: g = 0 and beta = 0 leave the state unchanged. One copy here,
    so that every later matmul reads its operands in place.
    """
    pad_t = -x_BTH_.shape[1] % chunk
    x = x_BTH_.float()
    if pad_t:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad_t))
    return rearrange(x, "b (n c) h ... -> b h n c ...", c=chunk).contiguous()


def _decay_factors(g_BHNCK: torch.Tensor, G_BHNCK: torch.Tensor, gate_lower_bound: float | None):
    """Split exp(G_r - G_c) = exp(G_r - R) exp(R - G_c), one reference R [B, H, N, 1, K] per chunk, channel.

    g: log-decay; G: its inclusive cumsum within each chunk. R = G_0 - d, where d = (C-1)|bound|/2 is half the
    widest span G can cover, so both factors stay within e^+-d (the bound is gate_lower_bound, or the data's
    min g when None). R reads only the chunk's first gate: no later gate reaches a row's scores, not even
    through rounding. Raises ValueError if an exponent could leave the safe fp32 range.
    Returns fp32 (exp(G - R) [B, H, N, C, K], exp(R - G) [B, H, N, C, K], R [B, H, N, 1, K]).
    """
    chunk = G_BHNCK.shape[-2]
    lo, hi = (t.item() for t in torch.aminmax(g_BHNCK))
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    shift = 0.5 * (chunk - 1) * abs(lo if gate_lower_bound is None else gate_lower_bound)
    worst = max(shift + (chunk - 1) * hi, (chunk - 1) * -lo - shift)  # bounds on G_r - R and R - G_c
    if not math.isfinite(worst) or worst > _MAX_SAFE_EXPONENT:
        raise ValueError(
            f"KDA chunked form: a decay exponent could reach e^{worst:.1f} (fp32 overflows past e^88) with "
            f"chunk_size={chunk}, g in [{lo:.3g}, {hi:.3g}], gate_lower_bound={gate_lower_bound}; keep g "
            f"within [gate_lower_bound, 0] (K3 bounds it at -5: chunk_size <= 32) or pass a smaller "
            f"chunk_size.")
    ref_BHN1K = (G_BHNCK[..., :1, :] - shift).detach()  # cancels exactly in every product: no gradient needed
    # Two exps, not exp and reciprocal: reciprocal's gradient squares its input, which overflows at e^+-44.
    return (G_BHNCK - ref_BHN1K).exp(), (ref_BHN1K - G_BHNCK).exp(), ref_BHN1K


def _intra_chunk_scores(q_up_BHNCK, k_up_BHNCK, k_down_BHNCK, beta_BHNC):
    """Decayed scores inside each chunk from the factored decay: x_up = x exp(G - R), x_down = x exp(R - G).

    Returns fp32 [B, H, N, C, C]: L[r, c] = beta_r k_r.(exp(G_r - G_c) k_c) for c < r (else 0) and
    A[r, c] = q_r.(exp(G_r - G_c) k_c) for c <= r (else 0), q unscaled. Entries above the diagonal may
    overflow; tril overwrites them (it selects, never multiplies), so they reach neither values nor gradients.
    """
    keys_BHNKC = k_down_BHNCK.transpose(-1, -2)
    L_BHNCC = torch.tril(k_up_BHNCK @ keys_BHNKC, diagonal=-1) * beta_BHNC[..., None]
    return L_BHNCC, torch.tril(q_up_BHNCK @ keys_BHNKC)


def _wy_transform(L_BHNCC: torch.Tensor, beta_BHNC: torch.Tensor) -> torch.Tensor:
    """T = (I + L)^-1 Diag(beta), fp32 [B, H, N, C, C]: one batched unit-lower-triangular solve, all chunks.

    Solving against I once (C columns) is cheaper than solving against [K | V] (K + V columns) for C < K + V.
    """
    eye = torch.eye(L_BHNCC.shape[-1], dtype=L_BHNCC.dtype, device=L_BHNCC.device)
    inv_BHNCC = torch.linalg.solve_triangular(eye + L_BHNCC, eye.expand_as(L_BHNCC), upper=False,
                                              unitriangular=True)
    return inv_BHNCC * beta_BHNC[..., None, :]


def _inter_chunk_scan(qg_BHNCK, A_BHNCC, w_BHNCK, u_BHNCV, k_out_BHNCK, decay_BHNK, state_BHKV):
    """The only sequential part: carry the state S across chunks, emitting each chunk's output on the way.

    Per chunk: U' = U - W S;  O = (Q exp(G)) S + A U';  S <- exp(G_C) S + (exp(G_C - G) K)^T U'.
    Returns o fp32 [B, N, C, H, V] (the token-major layout the caller wants) and the final state [B, H, K, V].
    """
    batch, heads, _, chunk, dim_k = w_BHNCK.shape
    # unbind once: indexing x[:, :, n] in the loop makes autograd zero-fill a full-size gradient per chunk.
    per_chunk = [[x_BH_.reshape(batch * heads, *x_BH_.shape[2:]) for x_BH_ in x.unbind(2)]  # views
                 for x in (qg_BHNCK, A_BHNCC, w_BHNCK, u_BHNCV, k_out_BHNCK, decay_BHNK[..., None])]
    state_XKV = state_BHKV.reshape(batch * heads, dim_k, -1)
    outs = []
    for qg_XCK, A_XCC, w_XCK, u_XCV, k_out_XCK, decay_XK1 in zip(*per_chunk):
        u_XCV = torch.baddbmm(u_XCV, w_XCK, state_XKV, alpha=-1)
        o_XCV = torch.baddbmm(A_XCC @ u_XCV, qg_XCK, state_XKV)
        outs.append(o_XCV.view(batch, heads, chunk, -1).transpose(1, 2))
        state_XKV = torch.baddbmm(state_XKV * decay_XK1, k_out_XCK.transpose(1, 2), u_XCV)
    state_BHKV = state_XKV.view(batch, heads, dim_k, -1)
    return torch.stack(outs, dim=1), state_BHKV


def torch_chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    scale: float | None = None, initial_state: torch.Tensor | None = None,
                    output_final_state: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE,
                    gate_lower_bound: float | None = DEFAULT_GATE_LOWER_BOUND):
    """Chunked KDA, the same contract as `fla.ops.kda.naive.naive_chunk_kda`, differentiable end to end.

    q, k [B, T, H, K] already L2-normalised; v [B, T, HV, V] (HV a multiple of H); g [B, T, HV, K] log-decay
    in [gate_lower_bound, 0] (None: unbounded, then the data must suit chunk_size); beta [B, T, HV];
    initial_state [B, HV, K, V]. Any T >= 1 (padded internally). Computes in fp32; scale defaults to K^-0.5.
    Returns (o [B, T, HV, V] in v.dtype, final state [B, HV, K, V] fp32 or None).
    """
    batch, seq, _, dim_k = q.shape
    heads_v, dim_v = v.shape[2:]
    scale = dim_k ** -0.5 if scale is None else scale
    q_BHNCK, k_BHNCK = (_to_chunks(_expand_heads(x, heads_v), chunk_size) for x in (q, k))
    v_BHNCV, g_BHNCK, beta_BHNC = (_to_chunks(x, chunk_size) for x in (v, g, beta))
    G_BHNCK = g_BHNCK.cumsum(dim=-2)
    up_BHNCK, down_BHNCK, ref_BHN1K = _decay_factors(g_BHNCK, G_BHNCK, gate_lower_bound)
    q_up_BHNCK, k_up_BHNCK, k_down_BHNCK = q_BHNCK * up_BHNCK, k_BHNCK * up_BHNCK, k_BHNCK * down_BHNCK
    L_BHNCC, A_BHNCC = _intra_chunk_scores(q_up_BHNCK, k_up_BHNCK, k_down_BHNCK, beta_BHNC)
    T_BHNCC = _wy_transform(L_BHNCC, beta_BHNC)
    # exp(G) = exp(G - R) exp(R), and exp(R) is constant down a chunk: it commutes past the row mixing of T.
    exp_ref_BHN1K = ref_BHN1K.exp()
    w_BHNCK = (T_BHNCC @ k_up_BHNCK) * exp_ref_BHN1K
    u_BHNCV = T_BHNCC @ v_BHNCV
    G_end_BHN1K = G_BHNCK[..., -1:, :]
    k_out_BHNCK = k_down_BHNCK * (G_end_BHN1K - ref_BHN1K).exp()
    state_BHKV = q.new_zeros(batch, heads_v, dim_k, dim_v, dtype=torch.float32)
    if initial_state is not None:
        state_BHKV = initial_state.float()
    o_BNCHV, state_BHKV = _inter_chunk_scan(q_up_BHNCK * (exp_ref_BHN1K * scale), A_BHNCC * scale, w_BHNCK,
                                            u_BHNCV, k_out_BHNCK, G_end_BHN1K[..., 0, :].exp(), state_BHKV)
    o_BTHV = o_BNCHV.reshape(batch, -1, heads_v, dim_v)[:, :seq]
    return o_BTHV.to(v.dtype), (state_BHKV if output_final_state else None)


@torch.no_grad()
def torch_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step for B requests (inference only: runs under no_grad).

    q, k [B, 1, H, K] RAW (L2-normalised here, eps 1e-6); v [B, 1, HV, V]; g [B, 1, HV, K]; beta [B, 1, HV];
    state [B, HV, K, V] (read, never written). Returns o [B, 1, HV, V] in v.dtype and the new fp32 state
    (a new tensor).
    About 2x faster than fla's naive_recurrent_kda at T=1 on CPU (bench_kda_cpu.py): batched matmuls.
    """
    if q.shape[1] != 1:
        raise ValueError(f"decode takes exactly one token per request, got T={q.shape[1]}; use prefill")
    heads_v, dim_k = v.shape[2], q.shape[-1]
    scale = dim_k ** -0.5 if scale is None else scale
    q_BH1K = (l2norm(_expand_heads(q, heads_v)) * scale).transpose(1, 2)
    k_BH1K = l2norm(_expand_heads(k, heads_v)).transpose(1, 2)
    state_BHKV = state.float() * g[:, 0].float().exp()[..., None]  # a new tensor: the caller's state is kept
    delta_BH1V = (v.float().transpose(1, 2) - k_BH1K @ state_BHKV) * beta.float().transpose(1, 2)[..., None]
    state_BHKV.addcmul_(k_BH1K.transpose(-1, -2), delta_BH1V)
    o_BH1V = q_BH1K @ state_BHKV
    return o_BH1V.transpose(1, 2).to(v.dtype), state_BHKV


# ------------------------------------------------------------------------------------------------------------
# Backends. Every prefill takes RAW q, k (the backend L2-normalises them, eps 1e-6, and scales q by K^-0.5).


def _prefill_torch_chunk(q, k, v, g, beta, initial_state=None, output_final_state=False, *,
                         chunk_size: int, gate_lower_bound: float | None):
    return torch_chunk_kda(l2norm(q), l2norm(k), v, g, beta, initial_state=initial_state,
                           output_final_state=output_final_state, chunk_size=chunk_size,
                           gate_lower_bound=gate_lower_bound)


def _prefill_naive_recurrent(q, k, v, g, beta, initial_state=None, output_final_state=False):
    from fla.ops.kda.naive import naive_recurrent_kda
    return naive_recurrent_kda(l2norm(q), l2norm(k), v, g, beta, initial_state=initial_state,
                               output_final_state=output_final_state)


def _prefill_naive_chunk(q, k, v, g, beta, initial_state=None, output_final_state=False, *, chunk_size=64):
    """fla's naive chunked form needs T % 64 == 0: right-pad with zeros (g = 0, beta = 0 keep the state)."""
    from fla.ops.kda.naive import naive_chunk_kda
    seq = q.shape[1]
    pad_t = -seq % chunk_size
    q, k = l2norm(q), l2norm(k)
    q, k, v, g, beta = (F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad_t)) for x in (q, k, v, g, beta))
    o, state = naive_chunk_kda(q, k, v, g, beta, initial_state=initial_state,
                               output_final_state=output_final_state, chunk_size=chunk_size)
    return o[:, :seq], state


@torch.no_grad()
def _decode_naive_recurrent(q, k, v, g, beta, state):
    from fla.ops.kda.naive import naive_recurrent_kda
    return naive_recurrent_kda(l2norm(q), l2norm(k), v, g, beta, initial_state=state, output_final_state=True)


def _prefill_fla(q, k, v, g, beta, initial_state=None, output_final_state=False, *, gate_lower_bound,
                 fp32: bool = False):
    """fla chunk_kda (Triton): L2 norm in-kernel; g precomputed (use_gate_in_kernel=False), passed as fp32.

    fla asserts initial_state is fp32; its output comes back in q.dtype, cast here to v.dtype. safe_gate (the
    M=16 TensorCore path) is only valid for gates bounded in [-5, 0): on with such a bound, off otherwise.
    Its dots run in TF32: on an H200, fp32 outputs, states and gradients sit ~2e-3 (relative) off torch_chunk
    (`model.fp32_dots` changes that). fla keeps its intermediates (w, u, the new values, each chunk's state) in
    q/k/v's dtype: with bf16 activations they are rounded to bf16, where the engine's decode step keeps an fp32
    state. `fp32` (backend "fla_fp32") hands fla fp32 q, k, v and beta, so every intermediate is fp32; the
    output is rounded once, to v's dtype, and the gradients come back in the inputs' dtypes.
    The batch goes to fla padded with zero rows to `fla_batch_bucket(B)` rows (`FLA_BATCH_MULTIPLE`); the
    outputs and final states of the padding are dropped, and rows never mix, so the result is the unpadded one.
    """
    from fla.ops.kda import chunk_kda
    safe = gate_lower_bound is not None and -5.0 <= gate_lower_bound < 0.0
    h0 = None if initial_state is None else to_dtype(initial_state, torch.float32)
    out_dtype = v.dtype
    if fp32:
        q, k, v, beta = q.float(), k.float(), v.float(), beta.float()
    rows, padded = q.shape[0], fla_batch_bucket(q.shape[0])
    q, k, v, g, beta, h0 = (pad_batch(x, padded) for x in (q, k, v, g, beta, h0))
    o, state = chunk_kda(q, k, v, to_dtype(g, torch.float32), beta, initial_state=h0,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=True, safe_gate=safe,
                         lower_bound=gate_lower_bound if safe else None)
    return to_dtype(o[:rows], out_dtype), (None if state is None else state[:rows])


# Some of chunk_kda's kernels take the batch size as a compile-time constant (fla's chunked cumsums: `B:
# tl.constexpr`, also in their autotune key): every B it has not seen compiles each of their configs again and
# tunes them, seconds each time (14 new Triton cache entries a step in RL runs on an H100).
# RL micro-batches fit their rows to a token budget, so B changes from one to the next; padded to a multiple of 8
# (a power of two up to 8), a run sees a few batch sizes, each tuned once. The padding costs KDA work on up to 7
# zero rows (g = 0, beta = 0: their outputs are 0 and nothing reaches the real rows).
FLA_BATCH_MULTIPLE = 8


def fla_batch_bucket(rows: int) -> int:
    """The batch size fla's chunk_kda is called with for `rows` rows: 1, 2, 4, 8, then multiples of 8."""
    if rows <= FLA_BATCH_MULTIPLE:
        return 1 << max(rows - 1, 0).bit_length()
    return -(-rows // FLA_BATCH_MULTIPLE) * FLA_BATCH_MULTIPLE


def pad_batch(x: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """x with zero rows appended along dim 0 up to `rows` (x itself when it has them; None stays None)."""
    if x is None or x.shape[0] >= rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


@torch.no_grad()
def _decode_fla(q, k, v, g, beta, state):
    """fla fused_recurrent_kda: state read as given (contiguous copy if needed), new fp32 state returned."""
    from fla.ops.kda import fused_recurrent_kda
    return fused_recurrent_kda(q, k, v, g.float(), beta, initial_state=state, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)


def lowerbound_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """KDA's decay gate g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) in fp32 from the raw input f
    [..., H, K], A_log [H], dt_bias [H * K]: fla's `naive_kda_lowerbound_gate`, the same operations in the same
    order (bitwise equal: tests/model/test_kda_ops.py), restated here because importing fla costs seconds on every CPU
    start and the CPU path uses nothing else of it."""
    h = f.shape[-2]
    g = f.float() + dt_bias.view(h, -1)
    g = to_dtype(A_log.view(h, 1), torch.float32).exp() * g
    return to_dtype(lower_bound * torch.sigmoid(g), torch.float32)


@torch.no_grad()
def _decode_into_reference(decode: Callable, q, k, v, f, beta_logit, A_log, dt_bias, lower_bound, pool_NHKV,
                           slots_B):
    """The reference for an in-place decode: the lower-bound gate and sigmoid(beta) in torch (`lowerbound_gate`),
    `decode` on the gathered rows, the new states scattered back."""
    g = lowerbound_gate(f, A_log, dt_bias, lower_bound)
    o, new_BHKV = decode(q, k, v, g, torch.sigmoid(beta_logit.float()), pool_NHKV.index_select(0, slots_B))
    pool_NHKV.index_copy_(0, slots_B, new_BHKV.to(pool_NHKV.dtype))
    return o


@torch.no_grad()
def _decode_into_fla(q, k, v, f, beta_logit, A_log, dt_bias, lower_bound, pool_NHKV, slots_B):
    """fla fused_recurrent_kda in continuous-batching form: request b's state is read from and written back to
    pool_NHKV[slots_B[b]] inside the kernel (ssm_state_indices, in-place final state), and the kernel computes
    the gate lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) and sigmoid(beta_logit) itself: no gathered
    copies, no separate gate kernels."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    if pool_NHKV.dtype != torch.float32 or not pool_NHKV.is_contiguous():
        raise ValueError(f"the KDA state pool must be contiguous fp32, got {pool_NHKV.dtype}")
    q, k, v, f, beta_logit = (x.contiguous() for x in (q, k, v, f, beta_logit))  # the kernel assumes dense rows
    o, _ = fused_recurrent_kda_fwd(q, k, v, f, beta_logit, A_log=A_log, dt_bias=dt_bias, initial_state=pool_NHKV,
                                   inplace_final_state=True, ssm_state_indices=slots_B,
                                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound)
    return o


@dataclass(frozen=True)
class KDABackend:
    """The KDA implementation chosen once at start (`resolve_kda_backend`); logs show `name` and `reason`.

    prefill(q, k, v, g, beta, initial_state=None, output_final_state=False) -> (o, state):
        q, k [B, T, H, K] RAW; v [B, T, HV, V]; g [B, T, HV, K] log-decay (fp32 preferred); beta [B, T, HV];
        initial_state [B, HV, K, V] fp32 or None. Returns o [B, T, HV, V] in v.dtype and the final state
        [B, HV, K, V] fp32 (None unless output_final_state). Differentiable (training uses it).
    decode(q, k, v, g, beta, state) -> (o, new_state): one token, the same tensors with T = 1 and a required
        fp32 state; inference only (no autograd). `state` is not modified; new_state is a new fp32 tensor.
    decode_into(q, k, v, f, beta_logit, A_log, dt_bias, lower_bound, pool_NHKV, slots_B) -> o: one decode
        step for requests whose states are rows slots_B [B] int64 of a fp32 pool [N, HV, K, V], updated in
        place (the rollout engine's slot pool), from the RAW gate input f [B, 1, HV, K] (g = lower_bound *
        sigmoid(exp(A_log) * (f + dt_bias))) and beta logits [B, 1, HV]. Rows of slots_B must be distinct,
        except padding rows that all point at one scratch row.
    """

    name: str
    reason: str
    prefill: Callable = field(repr=False, compare=False)
    decode: Callable = field(repr=False, compare=False)
    decode_into: Callable = field(repr=False, compare=False, default=None)

    def __post_init__(self):
        if self.decode_into is None:
            object.__setattr__(self, "decode_into", partial(_decode_into_reference, self.decode))


def chunk_size_for_bound(gate_lower_bound: float | None) -> int:
    """DEFAULT_CHUNK_SIZE, halved until the factored exponents (C-1)|bound|/2 stay in the safe range."""
    chunk = DEFAULT_CHUNK_SIZE
    bound = 0.0 if gate_lower_bound is None else -gate_lower_bound
    while chunk > 1 and (chunk - 1) * bound / 2 > _MAX_SAFE_EXPONENT:
        chunk //= 2
    return chunk


def resolve_kda_backend(name: str, device: torch.device | str,
                        gate_lower_bound: float | None = DEFAULT_GATE_LOWER_BOUND) -> KDABackend:
    """Pick the KDA implementation by name ("auto", "torch_chunk", "naive_recurrent", "naive_chunk", "fla",
    "fla_fp32").

    "auto" is "fla" on CUDA and "torch_chunk" elsewhere (measured fastest on CPU, forward and backward).
    "fla_fp32" is "fla" with the chunked form (the trainer's forward and backward, the engine's prefill) run on fp32
    inputs, so its intermediates are fp32 as the decode step's state is (`_prefill_fla`).
    gate_lower_bound: the model's bound on g (K3: -5.0), or None for unbounded gates. Raises ValueError for an
    unknown name, or an fla backend off CUDA. The caller logs the choice (once, at start).
    """
    device = torch.device(device)
    auto = name == "auto"
    if auto:
        name = "fla" if device.type == "cuda" else "torch_chunk"
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown KDA backend {name!r}: valid choices are {', '.join(BACKEND_NAMES)} "
                         f"('auto' picks 'fla' on CUDA and 'torch_chunk' on CPU)")
    if name in FLA_BACKENDS and device.type != "cuda":
        raise ValueError(f"KDA backend '{name}' runs Triton kernels and needs a CUDA device, got {device}; "
                         f"use 'auto' or 'torch_chunk' (or 'naive_recurrent'/'naive_chunk') on {device.type}")
    chunk = chunk_size_for_bound(gate_lower_bound)
    impls = {
        "torch_chunk": (partial(_prefill_torch_chunk, chunk_size=chunk, gate_lower_bound=gate_lower_bound),
                        torch_decode_step, f"torch chunked form (chunk {chunk}), torch one-step decode"),
        "naive_recurrent": (_prefill_naive_recurrent, _decode_naive_recurrent, "fla naive_recurrent_kda"),
        "naive_chunk": (_prefill_naive_chunk, _decode_naive_recurrent,
                        "fla naive_chunk_kda prefill, naive_recurrent_kda decode"),
        "fla": (partial(_prefill_fla, gate_lower_bound=gate_lower_bound), _decode_fla,
                "fla chunk_kda/fused_recurrent_kda (Triton); engine decode step kernels.kda_decode"),
        "fla_fp32": (partial(_prefill_fla, gate_lower_bound=gate_lower_bound, fp32=True), _decode_fla,
                     ("fla chunk_kda on fp32 inputs (fp32 intermediates)/fused_recurrent_kda (Triton); engine "
                      "decode step kernels.kda_decode")),
    }
    prefill, decode, what = impls[name]
    if auto and name == "torch_chunk":
        what = "torch chunked form (measured fastest on CPU; fla's Triton kernels are not used on CPU)"
    reason = f"{device.type}: {what}" + ("" if auto else " (requested by name)")
    return KDABackend(name, reason, prefill, decode, _decode_into_kernel if name in FLA_BACKENDS else None)


def _decode_into_kernel(*args):
    """The engine's in-place decode step on CUDA: `kernels.kda_decode.kda_recurrent_step` (same contract and math
    as `_decode_into_fla`; 0.81 vs 1.24 ms per layer at K3 width on the H200, see its KDA_STEP_CONFIG)."""
    from miles_k3.kernels.kda_decode import kda_recurrent_step
    return kda_recurrent_step(*args)
