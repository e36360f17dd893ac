"""The quickstart in rollout.mode=partial learns like the sync one (tests/commands/test_quickstart.py): its own
file so that CI's two workers (`pytest -n 2 --dist loadfile`) run the two long learning runs side by side."""
import json

import pytest

from miles_k3.config import compose_config

pytest.importorskip("reasoning_gym")
from test_quickstart import MIN_GAIN  # the sync test's bar

PARTIAL_STEPS = 150
PARTIAL_SEED = 4  # the training seed (`seed` and `rollout.seed`); the eval's own seed is the default's


@pytest.mark.slow
def test_shortened_default_run_in_partial_mode_raises_held_out_accuracy(tmp_path):
    """The first 150 steps (PARTIAL_STEPS) of the default with rollout.mode=partial (48 groups in flight, a step
    trains on the first 32 to finish, max_staleness 1, policy wait; decoupled PPO with token TIS), training seed 4.
    Measured on 2 cores with one thread per run (OMP_NUM_THREADS=1, as CI's workers run;
    benchmarks/results/quickstart_partial_seeds_short.json, 2026-12-07): training seeds 0-4 gained +4.0, +3.3, +3.6,
    +5.1, +5.8 points by step 150, all five above the bar (at step 100: +2.0, +4.2, +3.0, +2.4, +2.8, three below it,
    so 100 steps would not do; at step 200: +5.1, +6.0, +5.6, +6.2, +3.7). Seed 4 was chosen for its margin at step
    150, the largest of the five: 18.4% -> 24.2%, +5.8, 2.8 points above the bar (seed 0, this test's seed when it
    ran 200 steps, cleared it by 2.1 there and by 1.0 at step 150). Seed 4 trained off-policy tokens in 138 of the
    150 steps. Partial mode trains every group that finishes in a step, so it reaches the bar sooner than sync, which
    needs its 200 steps (tests/commands/test_quickstart.py)."""
    from miles_k3.train import train

    cfg = compose_config("train", [f"steps={PARTIAL_STEPS}", f"eval.every_n_steps={PARTIAL_STEPS}",
                                   "trainer.optim.total_steps=1000", f"run_dir={tmp_path}/run", "rollout.mode=partial",
                                   "trainer.loss.tis=token_truncate",
                                   f"seed={PARTIAL_SEED}", f"rollout.seed={PARTIAL_SEED}"])
    s = train(cfg, "").summary
    assert s["accuracy_after"] - s["accuracy_before"] >= MIN_GAIN, s
    assert s["answer_rate_after"] >= 0.9
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    off = [r["rollout/offpolicy_token_frac"] for r in rows if "rollout/offpolicy_token_frac" in r]
    assert len(off) == PARTIAL_STEPS and sum(f > 0 for f in off) >= PARTIAL_STEPS // 2  # it did train across pushes
