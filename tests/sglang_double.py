"""A recorded-interface test double of `sglang.Engine`. IT IS NOT SGLANG.

It stands in for `sglang.Engine` in CPU tests of the SGLang backend's own logic (server arguments, versioned adapter
names and unloading, result mapping, error paths, the parity check). It has the methods and parameter names of the
sglang.Engine calls the backend makes (SGLang 0.5.17, `python/sglang/srt/entrypoints/engine.py`), and answers in the
shapes SGLang returns: `generate` gives one dict per request with `output_ids` and `meta_info` {finish_reason
{"type": "stop", "matched": id} | {"type": "length", "length": n}, prompt_tokens, completion_tokens, cached_tokens,
output_token_logprobs [(logprob, token_id, None)], input_token_logprobs with logprob_start_len=0 (the first entry's
logprob None)}; adapter loads and unloads report failure in their return value (success, error_message), as
SGLang's do, and a reused adapter name is refused as SGLang refuses it. `test_sglang_signatures_match_installed`
(marked gpu: SGLang is installed on the GPU host only) checks these parameter names against the real sglang.Engine.

With a `model` (an HFCausalLM with LoRA applied, this double's own copy, put in eval mode as an engine serves), it
computes real log-probs and samples: loading an adapter copies its PEFT-named tensors into that model, so a wrong name
or layout shows up as a logprob difference, as with a real engine. A request with lora_path None (or a None entry) is
served by the base, as SGLang serves it: the model with its adapters zeroed.

With a K3 `model` (our K3ForCausalLM, fp32 on the CPU, this double's own copy; LoRA applied when adapters are to be
loaded) it mimics SGLang 0.5.17's KimiK3ForConditionalGeneration, with the faults its source shows (paths under
python/sglang/srt/ of that release):
* `update_weights_from_tensor(named_tensors, flush_cache)` copies each tensor by checkpoint name
  (`language_model.` + our state-dict key) into the model, and SILENTLY SKIPS a name the model lacks, as SGLang's
  load_weights does (`if name not in params_dict: continue`, models/kimi_k3.py:2824-2825, :2846-2847); it returns
  failure while a request is in flight (SGLang's flush after an update asserts an idle scheduler,
  managers/scheduler.py:4137-4160).
* `load_lora_adapter_from_tensors` honours only the MLA targets (q_a_proj, kv_a_proj_with_mqa, q_b_proj,
  kv_b_proj) and SILENTLY DROPS KDA's q_proj / k_proj / v_proj (fused into fused_qkvg_proj in SGLang, so the adapter
  matches no module: lora/mem_pool.py:1015-1070). Starting it with any other lora_target_modules raises, as SGLang
  fails at startup for most of them (lora/utils.py:224-226; o_proj, which SGLang serves without MLA's output gate,
  is refused here too: not modelled).
* server arguments are recorded, not acted on (no multimodal processor, no MoE runner, no CUDA graphs).

Fault injection, not SGLang behaviour: `adapter_scale` (settable at any time) multiplies the lora_B tensors of every
adapter loaded after it is set, so 0.0 is an engine that ignores the pushed adapter and serves the base under its name,
and 0.5 / 2.0 one that applies it at half / double scale (a wrong lora_alpha / rank scaling).
"""
from __future__ import annotations

import torch

from miles_k3.model.adapter import peft_tensors
from miles_k3.model.k3 import CHECKPOINT_PREFIX, K3ForCausalLM

# The sglang.Engine parameters the backend passes (checked against the installed SGLang where it is present).
RECORDED_PARAMS = {
    "generate": ("input_ids", "sampling_params", "return_logprob", "logprob_start_len", "lora_path"),
    "load_lora_adapter_from_tensors": ("lora_name", "tensors", "config_dict"),
    "unload_lora_adapter": ("lora_name",),
    "update_weights_from_tensor": ("named_tensors", "flush_cache"),
    "release_memory_occupation": ("tags",),
    "resume_memory_occupation": ("tags",),
    "flush_cache": (),
    "shutdown": (),
}
# ServerArgs fields the backend sets (sglang.srt.server_args.ServerArgs in 0.5.17).
RECORDED_SERVER_ARGS = ("model_path", "skip_tokenizer_init", "random_seed", "attention_backend", "sampling_backend",
                        "mem_fraction_static", "disable_cuda_graph", "enable_lora",
                        "max_lora_rank", "lora_target_modules", "max_loras_per_batch", "lora_backend",
                        "enable_memory_saver", "enable_weights_cpu_backup", "dtype", "context_length", "log_level",
                        "enable_multimodal", "moe_runner_backend", "cuda_graph_bs_decode", "cuda_graph_max_bs_decode",
                        "enable_fp32_lm_head")
K3_LORA = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj")  # what SGLang's K3 LoRA applies
K3_LORA_DROPPED = ("q_proj", "k_proj", "v_proj")  # accepted, silently not applied


class _Output:
    """SGLang's LoRAUpdateOutput: success and error_message."""

    def __init__(self, success: bool, error_message: str | None = None):
        self.success, self.error_message = success, error_message


class FakeSGLangEngine:
    """Not SGLang: see the module docstring. `calls` records (method, kwargs) in order."""

    def __init__(self, model=None, fail_load: str | None = None, adapter_scale: float = 1.0, **server_args):
        unknown = sorted(set(server_args) - set(RECORDED_SERVER_ARGS))
        if unknown:  # SGLang's ServerArgs rejects unknown keywords too
            raise TypeError(f"ServerArgs.__init__() got unexpected keyword arguments {unknown}")
        self.server_args = server_args
        self.model = model.eval() if model is not None else None
        self.k3 = isinstance(model, K3ForCausalLM)
        if self.k3 and "enable_fp32_lm_head" in server_args:  # SGLang's logits in fp32
            self.model.fp32_lm_head = bool(server_args["enable_fp32_lm_head"])
        if self.k3 and server_args.get("enable_lora"):
            crash = sorted(set(server_args.get("lora_target_modules") or ()) - set(K3_LORA) - set(K3_LORA_DROPPED))
            if crash:
                # SGLang's own failure at startup: get_hidden_dim has no LoRA buffer shape for these modules
                raise NotImplementedError(f"get_hidden_dim not implemented for {crash} (as SGLang's "
                                          "lora/utils.py:224-226 raises at LoRA pool init)")
        self.in_flight = 0
        self.fail_load = fail_load
        self.adapter_scale = adapter_scale
        self.calls: list[tuple[str, dict]] = []
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}
        self.released: set[str] = set()
        self.alive = True
        self._active: str | None = "none"

    # ---- sglang.Engine surface -------------------------------------------------------------------------
    def generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, token_ids_logprob=None, lora_path=None,
                 custom_logit_processor=None, return_hidden_states=False, stream=False, bootstrap_host=None,
                 bootstrap_port=None, bootstrap_room=None, data_parallel_rank=None, rid=None):
        self.calls.append(("generate", {"input_ids": input_ids, "sampling_params": sampling_params,
                                        "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
                                        "lora_path": lora_path}))
        if self.released:
            raise RuntimeError(f"memory {sorted(self.released)} released")
        paths = lora_path or [None] * len(input_ids)
        for name in paths:
            if name is not None and name not in self.adapters:
                raise ValueError(f"LoRA adapter {name} is not loaded")
        self.in_flight += len(input_ids)
        try:
            return [self._one(ids, sp, name, return_logprob, logprob_start_len)
                    for ids, sp, name in zip(input_ids, sampling_params, paths)]
        finally:
            self.in_flight -= len(input_ids)

    def load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict=None, load_format=None, pinned=False,
                                       added_tokens_config=None):
        self.calls.append(("load_lora_adapter_from_tensors", {"lora_name": lora_name, "keys": sorted(tensors),
                                                             "config_dict": config_dict}))
        if lora_name in self.adapters:
            return _Output(False, f"LoRA adapter {lora_name} is already loaded")
        if self.fail_load is not None and self.fail_load in lora_name:
            return _Output(False, f"simulated load failure of {lora_name}")
        if self.model is not None:
            missing = sorted(set(peft_tensors(self.model)) - set(tensors))
            if missing:
                return _Output(False, f"LoRA adapter {lora_name}: missing weights {missing[:3]}")
        if self.k3:  # SGLang's K3 LoRA applies the MLA targets only; KDA q/k/v are dropped without a word
            tensors = {k: v for k, v in tensors.items() if k.split(".")[-3] in K3_LORA}
        scales = {k: self.adapter_scale if "lora_B" in k else 1.0 for k in tensors}  # the fault injection
        self.adapters[lora_name] = {k: v.detach().to("cpu", copy=True) * scales[k] for k, v in tensors.items()}
        return _Output(True)

    def unload_lora_adapter(self, lora_name):
        self.calls.append(("unload_lora_adapter", {"lora_name": lora_name}))
        if lora_name not in self.adapters:
            return _Output(False, f"LoRA adapter {lora_name} is not loaded")
        del self.adapters[lora_name]
        return _Output(True)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update_weights_from_tensor", {"names": [n for n, _ in named_tensors],
                                                          "flush_cache": flush_cache}))
        if self.in_flight:
            return False, f"flush_cache failed: {self.in_flight} requests running"
        if self.k3:  # by checkpoint name; a name the model lacks is skipped silently, as SGLang's load_weights does
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, t in named_tensors:
                    key = name.removeprefix(CHECKPOINT_PREFIX)
                    if key in params:
                        params[key].copy_(t)
            return True, "Succeeded to update model weights."
        if self.model is not None:
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, t in named_tensors:
                    params[name].copy_(t)
        return True, "Succeeded to update model weights."

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release_memory_occupation", {"tags": tags}))
        self.released |= set(tags or ("kv_cache", "weights", "cuda_graph"))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume_memory_occupation", {"tags": tags}))
        self.released -= set(tags or ("kv_cache", "weights", "cuda_graph"))

    def flush_cache(self):
        self.calls.append(("flush_cache", {}))

    def shutdown(self):
        self.calls.append(("shutdown", {}))
        self.alive = False

    # ---- internals ---------------------------------------------------------------------------------------
    def calls_of(self, method: str) -> list[dict]:
        return [kw for m, kw in self.calls if m == method]

    def _use(self, name):
        """The double's model with adapter `name` copied in (None: adapters zeroed, i.e. the base)."""
        if name == self._active:
            return
        with torch.no_grad():
            for key, view in peft_tensors(self.model).items():
                if name is None or key not in self.adapters[name]:  # the base, or a K3 target SGLang dropped
                    view.zero_()
                else:
                    view.copy_(self.adapters[name][key])
        self._active = name

    @torch.no_grad()
    def _logprobs(self, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids])
        logits = self.model(x, seq_lens=torch.tensor([len(ids)])).logits.float()
        return torch.log_softmax(logits[0], dim=-1)  # [T, V]

    def _one(self, ids, sp, name, return_logprob, logprob_start_len):
        max_new = int(sp.get("max_new_tokens", 128))
        stops = set(sp.get("stop_token_ids") or [])
        temperature = float(sp.get("temperature", 1.0))
        gen = torch.Generator().manual_seed(int(sp.get("sampling_seed", 0)))
        out, lps, finish = [], [], {"type": "length", "length": max_new}
        if self.model is None:  # no model: seeded token ids, uniform log-probs over a 512-token vocabulary
            out = torch.randint(0, 256, (max_new,), generator=gen).tolist()
            lps = [-6.238] * max_new
        else:
            self._use(name)
            seq = list(ids)
            for _ in range(max_new):
                logp = self._logprobs(seq)[-1]
                if temperature == 0:
                    tok = int(logp.argmax())
                else:
                    tok = int(torch.multinomial(torch.softmax(logp / temperature, -1), 1, generator=gen))
                out.append(tok)
                lps.append(float(torch.log_softmax(logp / (temperature or 1.0), -1)[tok]))
                seq.append(tok)
                if tok in stops:
                    finish = {"type": "stop", "matched": tok}
                    break
        meta = {"finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(out),
                "cached_tokens": 0, "weight_version": "default", "id": "fake"}
        if return_logprob:
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(lps, out)]
            if logprob_start_len == 0 and self.model is not None:
                table = self._logprobs(list(ids))
                meta["input_token_logprobs"] = [(None, ids[0], None)] + [
                    (float(table[i - 1, ids[i]]), ids[i], None) for i in range(1, len(ids))]
        return {"output_ids": out, "meta_info": meta}
