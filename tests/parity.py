"""Layer-wise (teacher-forced) parity of a K3 under test against the fp32 CPU reference path.

Why layer-wise: at random init a deep K3 in bf16 is chaotic as a whole. bf16 rounding flips near-tied top-k
routing choices and the next layers amplify the change, so even the same CPU code in bf16 vs fp32 (or bf16
decode vs bf16 prefill) ends up ~100% apart in logits. Kernel parity is therefore checked per sublayer on
identical inputs: every attention and FFN sublayer of the model under test gets the exact input its fp32
reference twin saw in a reference forward pass (cast to the test dtype). Routing is pinned by the
selection-only correction bias, so that a rounding flip cannot hide a real error. Router top-k itself is
tested in test_layers.py.

Compared per sublayer, as relative L2 errors ||got - ref|| / ||ref||:
* the forward output;
* after backward of a fixed random upstream gradient, the input gradient and one weight's gradient;
* for attention, one decode step from the prefill state.
"""
import torch

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.kda import KDAAttention
from miles_k3.model.mla import MLAAttention
from miles_k3.model.moe import LatentMoE


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def reference_model(name: str, seed: int = 0) -> K3ForCausalLM:
    """fp32 CPU reference with non-trivial AttnRes queries and routing pinned to fixed experts per layer."""
    torch.manual_seed(seed)
    cfg = K3Config.from_name(name)
    model = K3ForCausalLM(cfg, kda_backend="torch_chunk")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("_res_proj.weight"):
                p.normal_(0, 0.02)
            elif pname.endswith("e_score_correction_bias"):
                p.zero_()
                p[torch.randperm(p.numel())[: cfg.num_experts_per_token]] = 10.0
    return model


def _weight_for_grad(sub: torch.nn.Module) -> torch.Tensor:
    """The weight whose gradient is compared: q_proj (KDA), kv_b_proj (MLA), experts.w2 (MoE), up_proj (MLP)."""
    if isinstance(sub, LatentMoE):
        return sub.experts.w2
    for name in ("q_proj", "kv_b_proj", "up_proj"):
        if hasattr(sub, name):
            return getattr(sub, name).weight
    raise TypeError(f"no parity weight for {type(sub).__name__}")


def _run(sub, x, kda_backend, grad_out):
    """Forward + backward of one sublayer; returns (output, input grad, weight grad)."""
    x = x.detach().requires_grad_(True)
    weight = _weight_for_grad(sub)
    weight.grad = None
    if isinstance(sub, KDAAttention):
        y = sub(x, kda_backend)[0]
    elif isinstance(sub, MLAAttention):
        y = sub(x)[0]
    else:
        y = sub(x)
    y.backward(grad_out.to(y.device, y.dtype))
    return y.detach(), x.grad, weight.grad


@torch.no_grad()
def _decode(attn, x_BTD, kda_backend):
    """Prefill all but the last token, then one decode step on it."""
    if isinstance(attn, MLAAttention):
        _, state = attn(x_BTD[:, :-1])
        lens = torch.full((x_BTD.shape[0],), x_BTD.shape[1] - 1, device=x_BTD.device)
        return attn.step(x_BTD[:, -1:], state, lens)[0]
    _, state = attn(x_BTD[:, :-1], kda_backend)
    return attn(x_BTD[:, -1:], kda_backend, state, decode=True)[0]


def layerwise_errors(ref: K3ForCausalLM, device: str, dtype: torch.dtype, kda_backend: str,
                     ids_BT: torch.Tensor) -> dict[str, float]:
    """Max relative error over layers, per quantity, of `ref`'s weights run on (device, dtype, kda_backend)."""
    test = K3ForCausalLM(ref.config, kda_backend=kda_backend).to(device).cast(dtype)
    test.load_state_dict(ref.state_dict())
    inputs: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(ref.model.layers):
        for kind, sub in (("attn", layer.self_attn), ("ffn", layer.ffn)):
            hooks.append(sub.register_forward_pre_hook(
                lambda m, args, key=(i, kind): inputs.__setitem__(key, args[0].detach())))
    with torch.no_grad():
        ref(ids_BT)
    for h in hooks:
        h.remove()
    ref_backend, test_backend = ref.kda_backend("cpu"), test.kda_backend(device)
    gen = torch.Generator().manual_seed(1)
    errs: dict[str, float] = {}
    for i, (ref_layer, test_layer) in enumerate(zip(ref.model.layers, test.model.layers)):
        for kind in ("attn", "ffn"):
            x = inputs[(i, kind)]
            ref_sub = ref_layer.self_attn if kind == "attn" else ref_layer.ffn
            test_sub = test_layer.self_attn if kind == "attn" else test_layer.ffn
            grad_out = torch.randn(x.shape, generator=gen)
            want = _run(ref_sub, x, ref_backend, grad_out)
            got = _run(test_sub, x.to(device, dtype), test_backend, grad_out)
            for name, a, b in zip(("out", "dx", "dW"), got, want):
                key = f"{kind}_{name}"
                errs[key] = max(errs.get(key, 0.0), rel(a, b))
            if kind == "attn":
                err = rel(_decode(test_sub, x.to(device, dtype), test_backend), _decode(ref_sub, x, ref_backend))
                errs["attn_decode"] = max(errs.get("attn_decode", 0.0), err)
    return errs
