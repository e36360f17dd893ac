"""benchmarks/bench_sft_encode.py: both ways of encoding the recipe's problems give the same ids, the pairs
alternate their order, and the figures are the runs' own."""
from bench_module import load_benchmark

bench = load_benchmark("bench_sft_encode")


def test_both_ways_encode_alike_in_alternating_pairs(capsys):
    figures = bench.measure(size=40, repeats=2)
    assert figures["same_ids"] is True and figures["size"] == 40
    assert [len(s) for s in figures["seconds"].values()] == [2, 2]
    order = [line.split()[2] for line in capsys.readouterr().out.splitlines() if line.startswith("pair")]
    assert order == ["one_at_a_time", "batched", "batched", "one_at_a_time"]
    assert figures["tokens"] > 40 * 79  # every solution has at least 79 tokens (the recipe's lengths)
