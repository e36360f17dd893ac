"""Multi-turn episodes with their state kept in the engine vs re-prefilled every turn: prefill tokens and wall
time per episode on a 10-turn task.

    python benchmarks/bench_sessions.py [--model k3_nano] [--device cpu] [--turns 10] [--episodes 8]
                                        [--prompt 32] [--obs 16] [--new 16] [--repeats 3] [--memory-mib 256]
                                        [--slots N --snapshot-mib M] [--out bench_sessions]

Each episode: a `--prompt`-token prompt, then `--turns` turns of exactly `--new` sampled tokens (no stop token),
each followed by an observation of `--obs` fixed token ids (a tool's or a game's answer, appended as ids), all
episodes' turns batched in one `generate` call per turn as the trainer's episodes run (`trainer/episodes.py`).
`kept`: `generate(keep_state=True, states=...)`, each turn prefilling only its new tokens; `recompute`: every turn
the whole conversation. With `--slots` fewer than `--episodes` the parked states must give way between turns:
`kept` then drops them (their next turn recomputes), and with `--snapshot-mib` a third mode, `snapshot`, copies
their KDA states to the host (`EngineConfig.state_snapshot_bytes`) and back. The model is the named config at its random init (prefill cost does not depend on the
weights). On the CPU (fp32) both modes sample the same tokens (checked: the run stops if they differ); in bf16 on a
GPU a chunked prefill and step decode round differently and the samples drift apart (`same_token_share`), which
changes no shape: every turn samples exactly `--new` tokens either way. Figures, per episode: prefill
tokens (the engine's counter) and the kept-state counters, wall seconds (median of `--repeats`; the modes alternate, after one warm-up round of
each), sampled tokens per second (episodes x turns x new / seconds), and the ratios.
Written to benchmarks/results/<--out>.json with the command.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from record import RESULTS, write_result

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.rollout.engine import EngineConfig, RolloutEngine


def _episodes(engine, args, keep: bool) -> list[list[int]]:
    """Run the episodes; their final token lists."""
    g = torch.Generator().manual_seed(0)
    vocab = engine.cfg.vocab_size
    convs = [torch.randint(0, vocab, (args.prompt,), generator=g).tolist() for _ in range(args.episodes)]
    obs = torch.randint(0, vocab, (args.obs,), generator=g).tolist()
    states = None
    for turn in range(args.turns):
        params = [{"max_new_tokens": args.new, "temperature": 1.0, "sampling_seed": 1000 * i + turn}
                  for i in range(args.episodes)]
        kw = {"keep_state": True, "states": states} if keep else {}
        outs = engine.generate(input_ids=convs, sampling_params=params, **kw)
        bad = next((o for o in outs if "error" in o), None)
        if bad is not None:
            raise RuntimeError(bad["error"])
        convs = [c + o["output_ids"] + (obs if turn + 1 < args.turns else []) for c, o in zip(convs, outs)]
        if keep:
            states = [o["meta_info"]["state_id"] for o in outs]
    if keep:
        engine.release_states(states)
    return convs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="k3_nano")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--obs", type=int, default=16)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory-mib", type=int, default=256, help="the engine's memory_budget_bytes, in MiB")
    ap.add_argument("--slots", type=int, default=None, help="the engine's num_slots (default: planned)")
    ap.add_argument("--snapshot-mib", type=int, default=0,
                    help="host MiB for kept-state snapshots (state_snapshot_bytes) in the snapshot mode; 0: no such mode")
    ap.add_argument("--out", default="bench_sessions", help="the result file's name (benchmarks/results/NAME.json)")
    args = ap.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    with device:
        model = K3ForCausalLM(K3Config.from_name(args.model), expert_format="mxfp4").eval().requires_grad_(False)
    if device.type == "cuda":
        model = model.cast(torch.bfloat16)
    length = args.prompt + args.turns * args.new + (args.turns - 1) * args.obs
    cfg = EngineConfig(memory_budget_bytes=args.memory_mib * 2**20, max_context=length + 8, eos_token_ids=[],
                       decode="graph" if device.type == "cuda" else "eager", num_slots=args.slots,
                       state_snapshot_bytes=args.snapshot_mib * 2**20)
    engine = RolloutEngine(model, cfg)
    out = {"model": args.model, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "torch_threads": torch.get_num_threads(), **{k: getattr(args, k) for k in
                                                        ("turns", "episodes", "prompt", "obs", "new", "repeats",
                                                         "memory_mib", "slots", "snapshot_mib")},
           "episode_tokens": length, "num_slots": engine.runner.num_slots}
    modes = ("kept", "snapshot", "recompute") if args.snapshot_mib else ("kept", "recompute")
    store = engine.runner.kept_states
    tokens, times, prefill, counts = {}, {m: [] for m in modes}, {}, {}
    for r in range(args.repeats + 1):  # the modes alternate (a load that changes over time hits all); 0: warm-up
        for mode in modes:
            store.snapshot_budget = cfg.state_snapshot_bytes if mode == "snapshot" else 0
            before = dict(engine.kept_state_stats)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            tokens[mode] = _episodes(engine, args, mode != "recompute")
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r:
                times[mode].append(time.perf_counter() - t0)
            prefill[mode] = engine.kept_state_stats["prefill_tokens"] - before["prefill_tokens"]
            counts[mode] = {k: engine.kept_state_stats[k] - before[k] for k in ("dropped", "snapshotted", "restored",
                                                                             "recomputed", "continued")}
    for mode in modes:
        out[mode] = {"prefill_tokens_per_episode": prefill[mode] / args.episodes, "sessions": counts[mode],
                     "seconds_per_episode": statistics.median(times[mode]) / args.episodes,
                     "seconds_all": [round(t, 4) for t in times[mode]],
                     "sampled_tokens_per_s": round(args.episodes * args.turns * args.new
                                                   / statistics.median(times[mode]), 1)}
        print(f"{mode:>9}: {prefill[mode] / args.episodes:,.0f} prefill tokens / episode, "
              f"{out[mode]['seconds_per_episode'] * 1e3:.1f} ms / episode, "
              f"{out[mode]['sampled_tokens_per_s']:,.0f} sampled tokens/s", flush=True)
    same = sum(a == b for ka, kb in zip(tokens["kept"], tokens["recompute"]) for a, b in zip(ka, kb))
    out["same_token_share"] = round(same / sum(map(len, tokens["kept"])), 4)
    if device.type == "cpu" and any(tokens[m] != tokens["recompute"] for m in modes):
        raise SystemExit("the modes' episodes sampled different tokens")
    for mode in modes[:-1]:
        suffix = "" if mode == "kept" else f"_{mode}"
        out[f"prefill_ratio{suffix}"] = round(out["recompute"]["prefill_tokens_per_episode"]
                                              / out[mode]["prefill_tokens_per_episode"], 2)
        out[f"time_ratio{suffix}"] = round(out["recompute"]["seconds_per_episode"]
                                           / out[mode]["seconds_per_episode"], 2)
        print(f"recompute / {mode}: {out[f'prefill_ratio{suffix}']}x prefill tokens, "
              f"{out[f'time_ratio{suffix}']}x wall time", flush=True)
    write_result("bench_sessions", out, out=RESULTS / f"{args.out}.json")


if __name__ == "__main__":
    main()
