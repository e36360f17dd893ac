"""Multi-turn episodes in rollout.mode=partial with slow environment steps: the engine waiting for each finished
turn's step (`rollout.partial.env_lag_steps=0`) against decoding on while steps run (`--lag`, default 8).

    python benchmarks/bench_env_lag.py [--model k3_tiny] [--step-ms 50] [--lag 8] [--steps 4] [--repeats 3]
                                       [--prompts 8] [--group 4] [--turns 3] [--new 24] [--out bench_env_lag]

A pool of guess-the-number episodes (`env=guess` whose every step sleeps `--step-ms`, as a sandboxed tool call
would), `--prompts` groups of `--group` a step, 1.5x in flight, `--turns` turns of at most `--new` tokens (a quarter of
the vocabulary ends a turn), on the named config at its random init (fp32, CPU, one thread, LoRA rank 2). Each
repeat runs `--steps` collects per mode, the modes alternating (lag 0 first, then `--lag`), a fresh engine and pool
each; a push between collects as the trainer's would. Figures per mode: the median over repeats of the wall seconds
per trained sample and per sampled token, the engine's decode steps, and `perf/env_wait_s` (the time the engine's
run waited for steps) summed over the collects; the ratio of lag 0's seconds per sampled token to the lag's.
Written to benchmarks/results/<--out>.json with the command.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from record import RESULTS, write_result

from miles_k3.envs.env import EnvConfig, Guess
from miles_k3.evals.problems import Problem
from miles_k3.evals.rewards import RewardResult
from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.lora import LoRAConfig, apply_lora, lora_state_dict
from miles_k3.model.tokenizer import small_tokenizer
from miles_k3.rollout.engine import EngineConfig, RolloutEngine
from miles_k3.trainer.partial import PartialRollouts
from miles_k3.trainer.rollouts import PartialConfig, PromptStream, RolloutConfig

LORA = LoRAConfig(rank=2, alpha=4.0, targets=["q_proj", "w1"])


class SlowGuess(Guess):
    """env=guess whose every step sleeps `pause` seconds first."""

    pause = 0.05

    def step(self, turn):
        time.sleep(self.pause)
        return super().step(turn)


def _run(model, args, lag: int) -> dict:
    """`--steps` collects of a fresh pool at env_lag_steps `lag`: wall seconds, samples, sampled tokens, decode
    steps, env_wait_s."""
    tok = small_tokenizer(model.config.vocab_size)
    engine = RolloutEngine(model, EngineConfig(max_context=256, memory_budget_bytes=64 << 20, decode="eager",
                                               eos_token_ids=list(range(0, model.config.vocab_size, 4))), lora=LORA)
    engine.load_lora_adapter_from_tensors("policy", lora_state_dict(model), LORA)
    cfg = RolloutConfig(prompts_per_step=args.prompts, group_size=args.group, template="plain", mode="partial",
                        max_new_tokens=args.new, dynamic_sampling=False,
                        partial=PartialConfig(max_staleness=1, env_lag_steps=lag))
    cfg.validate()
    env_cfg = EnvConfig(name="guess", max_turns=args.turns, step_timeout_s=60.0)
    problems = [Problem(f"g{i}", f"Guess my number from 1 to 9: #{i}", str(1 + i % 9)) for i in range(4096)]
    pool = PartialRollouts(engine, tok, PromptStream(problems, 0), lambda r, g: [
        RewardResult(0.0, False, {}) for _ in r], cfg, "policy", env=(SlowGuess, env_cfg))
    out = {"seconds": 0.0, "samples": 0, "tokens": 0, "env_wait_s": 0.0}
    steps0 = engine.scheduler.timing.decode_steps
    for version in range(args.steps):
        if version:
            engine.update_weights_from_tensor({k: v * 1.01 for k, v in lora_state_dict(model).items()},
                                              lora_name="policy")
        t0 = time.perf_counter()
        samples, m = pool.collect(version)
        out["seconds"] += time.perf_counter() - t0
        out["samples"] += len(samples)
        out["tokens"] += sum(sum(s.loss_mask) if s.loss_mask else len(s.response_ids) for s in samples)
        out["env_wait_s"] += m["perf/env_wait_s"]
    out["decode_steps"] = engine.scheduler.timing.decode_steps - steps0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="k3_tiny")
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--lag", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--out", default="bench_env_lag")
    args = p.parse_args()
    torch.set_num_threads(1)
    SlowGuess.pause = args.step_ms / 1000
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_name(args.model), expert_format="mxfp4").eval().requires_grad_(False)
    apply_lora(model, LORA)
    runs: dict[int, list[dict]] = {0: [], args.lag: []}
    for r in range(args.repeats):
        for lag, xs in runs.items():
            xs.append(_run(model, args, lag))
            x = xs[-1]
            print(f"repeat {r} lag {lag}: {x['seconds']:.2f} s, {x['samples']} samples, {x['tokens']} tokens, "
                  f"{x['decode_steps']} decode steps, env wait {x['env_wait_s']:.2f} s", flush=True)
    figures = {"step_ms": args.step_ms, "modes": {}}
    for lag, xs in runs.items():
        figures["modes"][f"lag_{lag}"] = {
            "s_per_sample_median": statistics.median(x["seconds"] / x["samples"] for x in xs),
            "ms_per_token_median": statistics.median(1000 * x["seconds"] / x["tokens"] for x in xs),
            "env_wait_s_median": statistics.median(x["env_wait_s"] for x in xs),
            "decode_steps_median": statistics.median(x["decode_steps"] for x in xs), "runs": xs}
    a, b = (figures["modes"][f"lag_{k}"]["ms_per_token_median"] for k in runs)
    figures["speedup_per_token"] = a / b
    print(f"lag 0: {a:.2f} ms per sampled token; lag {args.lag}: {b:.2f}; x{a / b:.2f}")
    write_result("bench_env_lag", figures, out=RESULTS / f"{args.out}.json")


if __name__ == "__main__":
    main()
