"""K3 on SGLang (issue 21), on one GPU: SGLang 0.5.17 serves a K3 checkpoint directory with its own
KimiK3ForConditionalGeneration, and this script checks it against our K3 (`miles_k3.model`, loaded from the same
directory, no adapter) and races it against our native engine (`RolloutEngine`), in one process.

On the H200. SGLang JIT-compiles modules with nvcc on first use (the first start and first requests take minutes;
the warm-ups keep that out of the timings), cached under TVM_FFI_CACHE_DIR, FlashInfer's ~/.cache/flashinfer (its
base is FLASHINFER_WORKSPACE_BASE) and TRITON_CACHE_DIR: point all three outside the repository tree, so that no cache
lands in the working copy:

    export TVM_FFI_CACHE_DIR=$HOME/.cache/k3bench/tvm-ffi FLASHINFER_WORKSPACE_BASE=$HOME/.cache/k3bench \\
           TRITON_CACHE_DIR=$HOME/.cache/k3bench/triton
    python -m miles_k3.init_checkpoint model=k3_m2 out=$HOME/k3_m2_mxfp4 format=mxfp4
    python benchmarks/bench_sglang_k3.py --model-dir $HOME/k3_m2_mxfp4 --json $HOME/bench_sglang_k3.json

    [--parts logprobs,race] [--prompts 32] [--tokens 256] [--greedy-tokens 64] [--data FILE.jsonl --template boxed]
    [--no-random] [--batches 1,64,256] [--prompt 32] [--new 64] [--grpo 64x8:512+512|none] [--budget-gib 24]
    [--decode auto] [--attention-backend triton] [--mem-fraction 0.35] [--no-cuda-graph] [--sglang-extra '{"key": value}']
    [--pin-routes DIR] [--no-floor] [--device cuda] [--seed 0]

SGLang is started once, before the native engine takes its memory budget, from `SGLangConfig`'s defaults plus the
flags above; the K3 server arguments come from `server_args` with the checked checkpoint (`k3_checkpoint`: Marlin for
MXFP4 experts, enable_multimodal False, bf16). Every result is one JSON line (`--json OUT`: all of them, rewritten
after each line); a part that fails prints a line with its `error` and the others still run.

* `logprobs` / `prompt_logprobs`: `--prompts` prompts of `--tokens` token ids (seeded, drawn uniformly from the
  vocabulary without the tokenizer's special and stop ids; `--data`: then also the first `--prompts` problems of a
  .jsonl file rendered with `--template`, cut to `--tokens`, each set its own rows; `--no-random`: the data
  alone). SGLang's prompt log-probs (`SGLangEngine.prompt_logprobs`: max_new_tokens=1, logprob_start_len=0,
  input_token_logprobs) against the trainer's (`sequence_logprobs`: bf16 on CUDA). `mean` /
  `max`: |ours - SGLang's| per prompt token, nats/token, over `tokens` positions of all prompts. Expected: bf16 noise,
  ~0.001 nats/token as the HF Qwen3 backend measured (measured: 0.0009-0.0013), max well below 0.1; a kernel that
  computes something else (attention residuals, SiTU, KDA, the MLA output gate) should show as 0.01 and more, judged
  against `floor_mean` / `floor_max`: the same gap between our own model in bf16 and in fp32 (the run's rounding
  floor; `fp32_mean`: SGLang against our fp32). On a random init the floor is no small number: its routers' top-k
  flips under rounding and the flips cascade (bench_rounding_floor.py on a random k3_m2, CPU: 0.453 nats/token ours
  bf16 vs fp32, as large as SGLang's gap), so compare a random init with `--pin-routes`. `push_tolerance` is the push parity check's limit
  (sglang.parity_tolerance): a push whose gap exceeds the base's by more than it is refused. `ours_spread` (mean |log-prob - its mean|) is the
  scale a gap is judged against: a random init predicts near-uniform tokens, so its gaps are small whatever the
  kernels do; a trained checkpoint (sft then quantize, docs/concepts/train-rollout-gap.md) is the sharper test. `argmax_agree`:
  the share of positions where SGLang's top-1 token (input_top_logprobs, top_logprobs_num=1) is our argmax; null when
  SGLang returns no top log-probs.
* `--pin-routes DIR`: the checkpoint copied to DIR with each MoE layer's e_score_correction_bias raised by
  PIN_BIAS at top_k experts (seeded), then both sides load DIR: the bias only selects experts (the weights still come
  from the unbiased sigmoid scores, renormalised) and sigmoid scores lie in (0, 1), so every token of every layer
  takes those experts whatever the rounding; the rest of the model is computed as before (ours bf16 vs fp32 there:
  0.027 nats/token, bench_rounding_floor.py --pin-routes, same checkpoint).
* `logprobs` / `greedy`: temperature 0, `--greedy-tokens` new tokens (0: this check skipped) from each prompt's
  first 32 tokens, our native engine against SGLang (ignore_eos). `prefix_frac`: positions equal before each pair's
  first divergence, over all positions; `overall_frac`: equal positions; `identical`: pairs equal throughout. bf16
  near-ties flip greedy tokens even between our own decode and our full forward (and one flip changes everything
  after it), so low numbers here are no failure: the log-probs are the measure.
* `race`: decode throughput of the native engine (`--decode auto`: CUDA-graph decode, as bench_engine_gpu) and of
  SGLang on the same checkpoint and the same prompts: for each of `--batches`, B prompts of `--prompt` random ids and
  `--new` new tokens; then `--grpo` PxN:prompt+new (P prompts, N samples each). ignore_eos, temperature 1, log-probs
  returned (as rollouts need). Each engine is warmed up once on other prompts of the same shape first (compiles,
  graph captures; SGLang's prefix cache is flushed after; SGLang captures decode graphs at exactly the race's batch
  sizes, `race_graphs`), then timed: `tokens` new tokens generated, `seconds`
  wall time of the generate call (prefill included), `tok_s` = tokens / seconds; the sglang row carries
  `native_over_sglang`.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from logprob_compare import (  # noqa: F401 (PIN_BIAS: re-exported, as the tests read it here)
    PIN_BIAS,
    argmax_agreement,
    greedy_agreement,
    logprob_gap,
    our_argmax,
    pin_routes,
    random_prompts,
    spread,
    top1_ids,
)
from record import write_result

from miles_k3.evals.datasets import DatasetConfig, load_problems
from miles_k3.evals.templates import render_prompt
from miles_k3.model.build import ModelConfig, build_model, build_tokenizer, num_params
from miles_k3.rollout.engine import EngineConfig, RolloutEngine
from miles_k3.rollout.sglang_backend import SGLangConfig, SGLangEngine, server_args
from miles_k3.trainer.step import sequence_logprobs
from miles_k3.utils.runtime import resolve_device, resolve_dtype

log = logging.getLogger("bench_sglang_k3")
PARTS = ("logprobs", "race")
GREEDY_PREFIX = 32
"""Prompt tokens the greedy continuations start from."""


# ---- the workload (pure; checked on the CPU) -----------------------------------------------------------------------
def parse_grpo(spec: str) -> tuple[int, int, int, int] | None:
    """"PxN:prompt+new" -> (P, N, prompt, new); "none" -> None."""
    if spec == "none":
        return None
    try:
        shape, lens = spec.split(":")
        p, n = map(int, shape.split("x"))
        plen, new = map(int, lens.split("+"))
    except ValueError:
        raise ValueError(f"--grpo: '{spec}' is not PxN:prompt+new (e.g. 64x8:512+512) or none") from None
    return p, n, plen, new


# ---- setup --------------------------------------------------------------------------------------------------------
class Bench:
    """What the parts share: our model (built once), the tokenizer, SGLang (started once) and the native engine
    (built on first use). `emit` prints a result line and records it."""

    def __init__(self, args: argparse.Namespace, engine_cls=None):
        self.args, self.rows = args, []
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype("auto", self.device)
        pinned = None
        if args.pin_routes:  # both sides load the pinned copy
            from miles_k3.model.weight_files import inspect_weights
            top_k = inspect_weights(args.model_dir).config.num_experts_per_token
            pinned = pin_routes(args.model_dir, args.pin_routes, top_k, args.seed)
            args.model_dir = str(args.pin_routes)
        self.mcfg = mcfg = ModelConfig(path=args.model_dir, trust_remote_code=args.trust_remote_code)
        self.model = build_model(mcfg, self.device, self.dtype).eval()
        self.tokenizer, stops = build_tokenizer(mcfg)
        self.special = set(self.tokenizer.all_special_ids) | set(stops)
        self.emit({"part": "setup", "model_dir": args.model_dir, "device": str(self.device),
                   "dtype": str(self.dtype).removeprefix("torch."), "params": num_params(self.model),
                   "experts": self.model.expert_format, "vocab_size": self.model.config.vocab_size,
                   "pinned_moe_layers": None if pinned is None else len(pinned)})
        self._native: RolloutEngine | None = None
        self.sgl: SGLangEngine | None = None
        self.sgl_error: str | None = None
        self._start_sglang(engine_cls)

    def emit(self, row: dict) -> None:
        print(json.dumps(row), flush=True)
        self.rows.append(row)
        if self.args.json:
            Path(self.args.json).write_text(json.dumps({"args": vars(self.args), "rows": self.rows}, indent=2))

    def _start_sglang(self, engine_cls) -> None:
        a = self.args
        cfg = SGLangConfig(attention_backend=a.attention_backend, mem_fraction_static=a.mem_fraction,
                           cuda_graph=not a.no_cuda_graph, extra_args=race_graphs(a) | json.loads(a.sglang_extra))
        try:  # no stop ids: every request ends at max_new_tokens, as the native engine's (ignore_eos)
            self.sgl = SGLangEngine(cfg, a.model_dir, seed=a.seed, max_context=context_needed(a),
                                    engine_cls=engine_cls)
        except Exception as e:  # a failed start is a result: the native rows still run
            log.exception("sglang did not start")
            self.sgl_error = f"{type(e).__name__}: {e}"
            self.emit({"part": "setup", "engine": "sglang", "error": self.sgl_error})
            return
        self.emit({"part": "setup", "engine": "sglang", "server_args": {
            k: v for k, v in server_args(cfg, a.model_dir, None, a.seed, self.sgl.k3).items() if k != "model_path"}})

    def sglang(self) -> SGLangEngine:
        if self.sgl is None:
            raise RuntimeError(f"sglang did not start ({self.sgl_error})")
        return self.sgl

    def native(self) -> RolloutEngine:
        if self._native is None:
            a = self.args
            cfg = EngineConfig(memory_budget_bytes=int(a.budget_gib * 2**30), page_size=64,
                               max_context=context_needed(a), prefill_chunk=1024, decode=a.decode)
            self._native = RolloutEngine(self.model, cfg)
            self.emit({"part": "setup", "engine": "native", "decode": self._native.decode_mode,
                       "slots": self._native.num_slots, "max_context": cfg.max_context})
        return self._native

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def close(self) -> None:
        if self.sgl is not None:
            self.sgl.shutdown()


def context_needed(a: argparse.Namespace) -> int:
    """The longest prompt + completion the requested parts send, rounded up to a 64-token page."""
    need = [GREEDY_PREFIX + a.greedy_tokens, a.tokens + 1] if "logprobs" in a.parts else []
    if "race" in a.parts:
        need.append(a.prompt + a.new)
        grpo = parse_grpo(a.grpo)
        if grpo is not None:
            need.append(grpo[2] + grpo[3])
    return 64 * -(-max(need) // 64)


def race_graphs(a: argparse.Namespace) -> dict:
    """SGLang's decode CUDA graphs for the race: exactly its batch sizes (0.5.17's ServerArgs
    cuda_graph_bs_decode / cuda_graph_max_bs_decode), none when no race runs or graphs are off. Its default list
    (1, 2, 4, 8, 12, then 16 .. 256 by 8) stops at 256, so the GRPO workload's 512 would decode eagerly, and
    capturing that list took 6 min 49 s of the H200's first start; --sglang-extra overrides either key."""
    if "race" not in a.parts or a.no_cuda_graph:
        return {}
    sizes = {int(x) for x in a.batches.split(",")}
    grpo = parse_grpo(a.grpo)
    if grpo is not None:
        sizes.add(grpo[0] * grpo[1])
    return {"cuda_graph_bs_decode": sorted(sizes), "cuda_graph_max_bs_decode": max(sizes)}


def guarded(b: Bench, row: dict, fn) -> None:
    """Emit `row` updated with fn()'s dict, or with the error fn raised (the run goes on)."""
    try:
        row |= fn()
    except Exception as e:  # one failing result must not stop the others
        log.exception("%s failed", row)
        row["error"] = f"{type(e).__name__}: {e}"
    b.emit(row)


def outputs(records: list[dict]) -> list[list[int]]:
    """The output ids of engine records; RuntimeError naming the first rejected request."""
    bad = [r["error"] for r in records if "error" in r]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(records)} requests failed: {bad[0]}")
    return [list(r["output_ids"]) for r in records]


# ---- part 1: log-probs and greedy agreement -----------------------------------------------------------------------
def logprob_prompts(b: Bench) -> list[tuple[list[list[int]], str]]:
    """The prompt sets of the logprobs part: random ids (unless --no-random), then --data's problems if given."""
    a = b.args
    sets = []
    if a.random:
        sets.append((random_prompts(a.prompts, a.tokens, b.model.config.vocab_size, b.special, a.seed), "random"))
    if a.data is not None:
        problems = load_problems(DatasetConfig(source=a.data, limit=a.prompts))
        ids = [b.tokenizer.encode(render_prompt(a.template, p.problem, b.tokenizer),
                                  add_special_tokens=False)[:a.tokens] for p in problems]
        short = [i for i, p in enumerate(ids) if len(p) < 2]
        if short:
            raise ValueError(f"--data {a.data}: problems {short[:5]} render to fewer than 2 tokens")
        sets.append((ids, f"{a.data} ({a.template})"))
    return sets


def sglang_top1(sgl: SGLangEngine, ids: list[int]) -> list[int | None] | None:
    """SGLang's top-1 prompt token per position (None first), or None when it returns no input_top_logprobs."""
    out = sgl.engine.generate(input_ids=[list(ids)], sampling_params=[{"max_new_tokens": 1, "temperature": 0.0}],
                              return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
    rows = out[0]["meta_info"].get("input_top_logprobs")
    return top1_ids(rows) if rows else None


def prompt_logprob_gap(b: Bench, prompts: list[list[int]]) -> dict:
    sgl = b.sglang()
    theirs = [sgl.prompt_logprobs(p, None) for p in prompts]
    ours = [sequence_logprobs(b.model, p) for p in prompts]
    row = logprob_gap(ours, theirs) | {"ours_spread": spread(ours),
                                        "push_tolerance": SGLangConfig().parity_tolerance}
    if b.args.floor:  # the rounding floor: our model against itself in fp32 (on the CPU, fp32 both: 0)
        try:
            ref = build_model(b.mcfg, b.device, torch.float32).eval()
            ours32 = [sequence_logprobs(ref, p) for p in prompts]
            del ref
            floor, vs32 = logprob_gap(ours32, ours), logprob_gap(ours32, theirs)
            row |= {"floor_mean": floor["mean"], "floor_max": floor["max"], "fp32_mean": vs32["mean"],
                    "fp32_max": vs32["max"]}
        except Exception as e:  # the gap itself is still the result
            log.exception("the fp32 floor failed")
            row["floor_error"] = f"{type(e).__name__}: {e}"
    first = sglang_top1(sgl, prompts[0])  # None: this SGLang (or double) gives no top log-probs; not asked again
    top = None if first is None else [first] + [sglang_top1(sgl, p) for p in prompts[1:]]
    row["argmax_agree"] = None if top is None or any(t is None for t in top) else \
        argmax_agreement([our_argmax(b.model, p) for p in prompts], top)
    return row


def greedy_continuations(b: Bench, prompts: list[list[int]]) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": b.args.greedy_tokens, "ignore_eos": True}
    prefixes = [p[:GREEDY_PREFIX] for p in prompts]
    ours = outputs(b.native().generate(input_ids=prefixes, sampling_params=params))
    theirs = outputs(b.sglang().generate(input_ids=prefixes, sampling_params=params))
    return greedy_agreement(ours, theirs)


def part_logprobs(b: Bench) -> None:
    try:
        sets = logprob_prompts(b)
    except Exception as e:  # the race still runs
        log.exception("logprobs: no prompts")
        b.emit({"part": "logprobs", "error": f"{type(e).__name__}: {e}"})
        return
    for prompts, source in sets:
        head = {"part": "logprobs", "source": source, "prompts": len(prompts)}
        guarded(b, head | {"check": "prompt_logprobs", "prompt_tokens": max(map(len, prompts))},
                lambda p=prompts: prompt_logprob_gap(b, p))
        if b.args.greedy_tokens:
            guarded(b, head | {"check": "greedy", "prefix_tokens": GREEDY_PREFIX,
                               "new_tokens": b.args.greedy_tokens},
                    lambda p=prompts: greedy_continuations(b, p))


# ---- part 2: the throughput race ----------------------------------------------------------------------------------
def timed_generate(b: Bench, engine, prompts: list[list[int]], params: dict, n: int) -> dict:
    b.sync()
    t0 = time.perf_counter()
    records = engine.generate(input_ids=prompts, sampling_params=params, n=n)
    b.sync()
    seconds = time.perf_counter() - t0
    tokens = sum(map(len, outputs(records)))
    return {"tokens": tokens, "expected_tokens": len(prompts) * n * params["max_new_tokens"], "seconds": seconds,
            "tok_s": tokens / seconds}


def race_one(b: Bench, workload: dict, seed: int) -> None:
    """Native, then SGLang, on the same prompts of `workload` (each warmed up first on other prompts)."""
    p, n, plen, new = (workload[k] for k in ("prompts", "n", "prompt_len", "new"))
    prompts = random_prompts(p, plen, b.model.config.vocab_size, b.special, seed)
    warm = random_prompts(p, plen, b.model.config.vocab_size, b.special, seed + 10_000)
    params = {"temperature": 1.0, "max_new_tokens": new, "ignore_eos": True}
    head = {"part": "race", **workload, "batch": p * n}
    native: dict = {}

    def run_native() -> dict:
        b.native().generate(input_ids=warm, sampling_params=params, n=n)
        native.update(timed_generate(b, b.native(), prompts, params, n))
        return native

    def run_sglang() -> dict:
        sgl = b.sglang()
        sgl.generate(input_ids=warm, sampling_params=params, n=n)
        sgl.flush_cache()  # the timed prompts must not find the warm-up's prefixes cached
        row = timed_generate(b, sgl, prompts, params, n)
        if native.get("tok_s"):
            row["native_over_sglang"] = native["tok_s"] / row["tok_s"]
        return row

    guarded(b, head | {"engine": "native"}, run_native)
    guarded(b, head | {"engine": "sglang"}, run_sglang)


def part_race(b: Bench) -> None:
    a = b.args
    workloads = [{"workload": "decode", "prompts": int(x), "n": 1, "prompt_len": a.prompt, "new": a.new}
                 for x in a.batches.split(",")]
    grpo = parse_grpo(a.grpo)
    if grpo is not None:
        workloads.append(dict(zip(("workload", "prompts", "n", "prompt_len", "new"), ("grpo", *grpo))))
    for i, w in enumerate(workloads):
        race_one(b, w, a.seed + 1 + i)


# ---- entry point --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="K3 checkpoint directory (python -m miles_k3.init_checkpoint "
                                                       "model=k3_m2 out=DIR format=mxfp4)")
    ap.add_argument("--parts", default="logprobs,race", help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every result line here too")
    ap.add_argument("--trust-remote-code", action="store_true", help="run the model directory's tokenizer code")
    ap.add_argument("--prompts", type=int, default=32, help="logprobs: prompts")
    ap.add_argument("--tokens", type=int, default=256, help="logprobs: tokens per prompt")
    ap.add_argument("--greedy-tokens", type=int, default=64, help="logprobs: greedy new tokens per prompt (0: none)")
    ap.add_argument("--data", default=None, help="logprobs: a .jsonl of problems, checked after the random ids")
    ap.add_argument("--no-random", dest="random", action="store_false", help="logprobs: no random-id prompts")
    ap.add_argument("--template", default="boxed", help="logprobs: the prompt template of --data")
    ap.add_argument("--batches", default="1,64,256", help="race: batch sizes of the decode workload")
    ap.add_argument("--prompt", type=int, default=32, help="race: prompt tokens of the decode workload")
    ap.add_argument("--new", type=int, default=64, help="race: new tokens of the decode workload")
    ap.add_argument("--grpo", default="64x8:512+512", help="race: PxN:prompt+new, or none")
    ap.add_argument("--budget-gib", type=float, default=24.0, help="native engine: KDA slots + MLA pages")
    ap.add_argument("--decode", default="auto", help="native engine: auto (graph on CUDA), eager, static, graph")
    ap.add_argument("--attention-backend", default="triton", help="sglang attention backend")
    ap.add_argument("--mem-fraction", type=float, default=0.35, help="sglang mem_fraction_static")
    ap.add_argument("--no-cuda-graph", action="store_true", help="sglang: no decode CUDA graphs")
    ap.add_argument("--sglang-extra", default="{}", help="further sglang.Engine arguments, a JSON object")
    ap.add_argument("--pin-routes", default=None, metavar="DIR",
                    help="serve a copy of the checkpoint written to DIR whose routers always pick the same experts")
    ap.add_argument("--no-floor", dest="floor", action="store_false",
                    help="logprobs: skip our fp32 forward (the rounding floor)")
    args = ap.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in args.parts if p not in PARTS]
    if bad or not args.parts:
        ap.error(f"--parts: {bad or 'none'} not among {', '.join(PARTS)}")
    if "logprobs" in args.parts and not args.random and args.data is None:
        ap.error("--no-random needs --data (the logprobs part would have no prompts)")
    if args.tokens < 2 or args.prompts < 1 or args.greedy_tokens < 0:
        ap.error("--tokens must be >= 2, --prompts >= 1, --greedy-tokens >= 0 (0: no greedy check)")
    if not isinstance(json.loads(args.sglang_extra), dict):
        ap.error("--sglang-extra: must be a JSON object")
    parse_grpo(args.grpo)
    return args


def run(argv: list[str], engine_cls=None) -> list[dict]:
    """Run the parts `argv` asks for; returns the result rows (also printed). `engine_cls` replaces sglang.Engine
    (tests pass a double)."""
    args = parse_args(argv)
    b = Bench(args, engine_cls)
    try:
        for part in args.parts:
            {"logprobs": part_logprobs, "race": part_race}[part](b)
    finally:
        b.close()
    return b.rows


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rows = run(sys.argv[1:])
    write_result("bench_sglang_k3", rows)
    failed = [r for r in rows if "error" in r]
    if failed:
        print(f"{len(failed)} of {len(rows)} results failed", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":  # SGLang's subprocesses re-import this module: nothing may run on import
    main()
