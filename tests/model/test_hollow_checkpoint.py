"""Hollow checkpoints (`miles_k3.model.hollow`, CPU): the published layout by hand on k3_tiny, headers equal
to safetensors' own, round trips through safe_open / inspect_weights / payload_ranges, and, on the full K3
(slow), the public facts of moonshotai/Kimi-K3: tensor and dtype counts, index total_size, per-shard payload
and file sizes, expert contiguity, sparse files. The K3 numbers are published figures, not our own formula."""
import json
import os
import re
import struct
from collections import Counter, defaultdict
from itertools import pairwise

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from miles_k3.model.config import K3Config
from miles_k3.model.hollow import (
    PayloadRange,
    checkpoint_tensors,
    payload_ranges,
    projector_tensors,
    published_layout,
    safetensors_header,
    storage_order,
    vision_tower_tensors,
    write_hollow_checkpoint,
)
from miles_k3.model.weight_files import (
    INDEX_FILE,
    WeightsError,
    config_json,
    inspect_weights,
    open_weights,
)

P = "language_model.model."
DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}
EXPERT = re.compile(r"^language_model\.model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.")


@pytest.fixture(scope="module")
def tiny_cfg() -> K3Config:
    return K3Config.from_name("k3_tiny")


@pytest.fixture(scope="module")
def tiny_dir(tiny_cfg, tmp_path_factory):
    return write_hollow_checkpoint(tiny_cfg, tmp_path_factory.mktemp("hollow") / "tiny")


# ---- the layout by hand (k3_tiny: 9 layers, 16 experts, MLA at 0-based 3, 7, 8; no vision) ----------------
def test_tiny_layout_files_by_hand(tiny_cfg):
    layout = published_layout(tiny_cfg)
    assert list(layout) == [f"model-{i:05d}-of-000010.safetensors" for i in range(1, 11)]
    for i, names in enumerate(list(layout.values())[:9]):
        assert all(n.startswith(f"{P}layers.{i}.") for n in names), i
    assert len(layout["model-00001-of-000010.safetensors"]) == 6 + 14 + 3  # layer 0: KDA + dense MLP
    assert len(layout["model-00002-of-000010.safetensors"]) == 6 + 14 + 8 + 16 * 6  # KDA + MoE
    assert len(layout["model-00004-of-000010.safetensors"]) == 6 + 8 + 8 + 16 * 6  # layer 3: MLA + MoE
    assert layout["model-00010-of-000010.safetensors"] == [
        "language_model.lm_head.weight", f"{P}embed_tokens.weight", f"{P}norm.weight",
        f"{P}output_attn_res_norm.weight", f"{P}output_attn_res_proj.weight"]


def test_tiny_order_within_a_moe_file_by_hand(tiny_cfg):
    """safetensors' order: F32, then BF16, then U8 (the experts), each by name: experts in string order."""
    names = published_layout(tiny_cfg)["model-00002-of-000010.safetensors"]
    layer = f"{P}layers.1."
    f32 = ["block_sparse_moe.gate.e_score_correction_bias", "self_attn.A_log", "self_attn.dt_bias",
           "self_attn.k_conv1d.weight", "self_attn.o_norm.weight", "self_attn.q_conv1d.weight",
           "self_attn.v_conv1d.weight"]
    moe = ["gate.weight", "routed_expert_down_proj.weight", "routed_expert_norm.weight",
           "routed_expert_up_proj.weight", "shared_experts.down_proj.weight",
           "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight"]
    attn = ["b_proj", "f_a_proj", "f_b_proj", "g_proj", "k_proj", "o_proj", "q_proj", "v_proj"]
    bf16 = [f"block_sparse_moe.{n}" for n in moe] + [
        "input_layernorm.weight", "mlp_res_norm.weight", "mlp_res_proj.weight",
        "post_attention_layernorm.weight", "self_attention_res_norm.weight", "self_attention_res_proj.weight",
    ] + [f"self_attn.{n}.weight" for n in attn]
    experts = [0, 1, 10, 11, 12, 13, 14, 15, 2, 3, 4, 5, 6, 7, 8, 9]
    six = [f"w{w}.weight_{kind}" for w in (1, 2, 3) for kind in ("packed", "scale")]
    u8 = [f"block_sparse_moe.experts.{e}.{t}" for e in experts for t in six]
    assert names == [layer + n for n in f32 + bf16 + u8]


def test_vision_only_for_k3_widths(tiny_cfg):
    assert not any(n.startswith(("vision_tower.", "mm_projector.")) for n in checkpoint_tensors(tiny_cfg))
    with pytest.raises(ValueError, match="hidden_size=128"):
        published_layout(tiny_cfg, vision=True)


def test_vision_and_projector_published_sizes():
    """§4.8/§7 of the public reference: 165 tower tensors (802,428,928 B; file 802,448,352 B) and 3 projector
    tensors (92,289,024 B; file 92,289,328 B), all BF16."""
    for specs, count, payload, file_size in ((vision_tower_tensors(), 165, 802_428_928, 802_448_352),
                                             (projector_tensors(), 3, 92_289_024, 92_289_328)):
        header, got = safetensors_header({n: specs[n] for n in storage_order(specs)})
        assert (len(specs), got, 8 + len(header) + got) == (count, payload, file_size)
        assert {s.dtype for s in specs.values()} == {"BF16"}


# ---- round trips on small configs ------------------------------------------------------------------------
def test_headers_equal_safetensors_own(tiny_cfg, tiny_dir):
    """Every file is byte for byte what safetensors writes for zeros of the same tensors, header included."""
    for file, names in published_layout(tiny_cfg).items():
        with safe_open(tiny_dir / file, "pt") as f:
            real = safetensors.torch.save({n: f.get_tensor(n) for n in names})
        assert (tiny_dir / file).read_bytes() == real, file


@pytest.mark.parametrize("name", ["k3_tiny", "k3_nano"])
def test_round_trip(name, tmp_path):
    cfg = K3Config.from_name(name)
    out = write_hollow_checkpoint(cfg, tmp_path / name)
    specs = checkpoint_tensors(cfg)
    layout = published_layout(cfg, specs)
    assert json.loads((out / "config.json").read_text()) == config_json(cfg, "mxfp4")
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["weight_map"] == {n: file for file, names in layout.items() for n in names}
    assert sorted(os.listdir(out)) == sorted(["config.json", INDEX_FILE, *layout])
    for file, names in layout.items():
        with safe_open(out / file, "pt") as f:
            assert list(f.keys()) == sorted(names)
            for n in names:
                piece = f.get_slice(n)
                assert (tuple(piece.get_shape()), piece.get_dtype()) == (specs[n].shape, specs[n].dtype), n
            assert not f.get_tensor(names[-1]).any()  # a hole reads as zeros
    ranges = payload_ranges(out)
    assert index["metadata"]["total_size"] == sum(r.end - r.begin for r in ranges.values())
    assert [list(ranges)[i] for i in range(3)] == layout[next(iter(layout))][:3]  # file, then offset order
    assert len(inspect_weights(out).tensors) == len(specs)


def test_overwrite(tiny_cfg, tmp_path):
    out = write_hollow_checkpoint(tiny_cfg, tmp_path / "c")
    with pytest.raises(WeightsError, match="already exists"):
        write_hollow_checkpoint(tiny_cfg, out)
    (out / "stale").write_text("x")
    write_hollow_checkpoint(tiny_cfg, out, overwrite=True)
    assert not (out / "stale").exists()


# ---- payload_ranges on ordinary checkpoints ----------------------------------------------------------------
def test_payload_ranges_single_file_reads_the_bytes(tmp_path):
    tensors = {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "a": torch.arange(5, dtype=torch.uint8),
               "c": torch.randn(4, dtype=torch.float32).to(torch.bfloat16)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ranges = payload_ranges(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    assert list(ranges) == ["b", "c", "a"]  # F32, BF16, U8: safetensors' order
    dtype_names = {torch.float32: "F32", torch.uint8: "U8", torch.bfloat16: "BF16"}
    for name, t in tensors.items():
        r = ranges[name]
        assert (r.file, r.dtype, r.shape) == (tmp_path / "model.safetensors", dtype_names[t.dtype],
                                              tuple(t.shape))
        assert data[r.begin:r.end] == t.view(torch.uint8).numpy().tobytes()


def test_payload_ranges_sharded_and_missing(tiny_dir, tmp_path):
    save_file({"x": torch.ones(3)}, tmp_path / "s1.safetensors")
    save_file({"y": torch.ones(2, dtype=torch.bfloat16)}, tmp_path / "s2.safetensors")
    weight_map = {"x": "s1.safetensors", "y": "s2.safetensors"}
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 16}, "weight_map": weight_map}))
    header_len = struct.unpack("<Q", (tmp_path / "s2.safetensors").read_bytes()[:8])[0]
    assert payload_ranges(tmp_path)["y"] == PayloadRange(tmp_path / "s2.safetensors", 8 + header_len,
                                                         8 + header_len + 4, "BF16", (2,))
    (tmp_path / "s2.safetensors").unlink()
    with pytest.raises(WeightsError, match="missing"):
        payload_ranges(tmp_path)
    assert list(payload_ranges(tmp_path, missing_ok=True)) == ["x"]


def test_payload_ranges_truncated_file(tmp_path):
    save_file({"x": torch.ones(8)}, tmp_path / "model.safetensors")
    os.truncate(tmp_path / "model.safetensors", os.path.getsize(tmp_path / "model.safetensors") - 1)
    with pytest.raises(WeightsError, match="truncated"):
        payload_ranges(tmp_path)


# ---- the full K3: public facts of moonshotai/Kimi-K3 -------------------------------------------------------
K3_FILES = 96
K3_PAYLOAD = {1: 2_341_213_184, 2: 16_990_092_800, 93: 16_566_684_160, 94: 4_697_663_488, 95: 92_289_024,
              96: 802_428_928}
K3_FILE_SIZE = {2: 16_990_911_504, 93: 16_567_507_176, 94: 4_697_664_072, 95: 92_289_328, 96: 802_448_352}


def k3_file(i: int) -> str:
    return f"model-{i:05d}-of-000096.safetensors"


@pytest.fixture(scope="module")
def k3(hollow_k3):
    """(directory, payload_ranges, seconds to write) of the full hollow K3 (the session's, conftest.py)."""
    out, seconds = hollow_k3
    print(f"hollow K3 written in {seconds:.1f} s")
    return out, payload_ranges(out), seconds


def sparse_files_supported(tmp_path) -> bool:
    probe = tmp_path / "sparse-probe"
    with open(probe, "wb") as f:
        f.truncate(1 << 30)
    used = os.stat(probe).st_blocks * 512
    probe.unlink()
    return used < 1 << 20


@pytest.mark.slow
def test_k3_counts_and_sizes(k3):
    out, ranges, _ = k3
    assert len(ranges) == 497_220
    assert Counter(r.dtype for r in ranges.values()) == {"BF16": 2_122, "F32": 506, "U8": 494_592}
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 1_560_860_324_864
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert files == [k3_file(i) for i in range(1, K3_FILES + 1)]
    payload = Counter()
    for r in ranges.values():
        payload[r.file.name] += r.end - r.begin
    assert {i: payload[k3_file(i)] for i in K3_PAYLOAD} == K3_PAYLOAD
    assert {i: os.path.getsize(out / k3_file(i)) for i in K3_FILE_SIZE} == K3_FILE_SIZE
    assert sum(os.path.getsize(out / f) for f in files) == 1_560_936_091_448  # payload + headers + prefixes


@pytest.mark.slow
def test_k3_shard_contents(k3):
    out, ranges, _ = k3
    by_file = defaultdict(list)
    for name, r in ranges.items():
        by_file[r.file.name].append(name)
    assert all(n.startswith(f"{P}layers.0.") for n in by_file[k3_file(1)])
    assert len(by_file[k3_file(1)]) == 23
    assert all(n.startswith(f"{P}layers.1.") for n in by_file[k3_file(2)])
    assert len(by_file[k3_file(2)]) == 5_404
    assert all(n.startswith(f"{P}layers.92.") for n in by_file[k3_file(93)])
    assert len(by_file[k3_file(93)]) == 5_398
    assert sorted(by_file[k3_file(94)]) == ["language_model.lm_head.weight", f"{P}embed_tokens.weight",
                                            f"{P}norm.weight", f"{P}output_attn_res_norm.weight",
                                            f"{P}output_attn_res_proj.weight"]
    assert sorted(by_file[k3_file(95)]) == sorted(["mm_projector.proj.0.weight", "mm_projector.proj.2.weight",
                                                   "mm_projector.post_norm.weight"])
    assert len(by_file[k3_file(96)]) == 165
    assert all(n.startswith("vision_tower.") for n in by_file[k3_file(96)])
    with safe_open(out / k3_file(96), "pt") as f:
        assert f.get_slice("vision_tower.patch_embed.proj.weight").get_shape() == [1024, 3, 14, 14]
        assert f.get_slice("vision_tower.encoder.blocks.26.wqkv.weight").get_shape() == [4608, 1024]
        assert f.get_slice("vision_tower.encoder.blocks.0.wo.weight").get_dtype() == "BF16"
    with safe_open(out / k3_file(95), "pt") as f:
        assert f.get_slice("mm_projector.proj.2.weight").get_shape() == [7168, 4096]


@pytest.mark.slow
def test_k3_experts_contiguous(k3):
    """Each expert's six U8 tensors are one run in one file (17,547,264 B); a layer's 896 experts are back to
    back to the end of its file (15,722,348,544 B)."""
    out, ranges, _ = k3
    runs = defaultdict(list)
    for name, r in ranges.items():
        m = EXPERT.match(name)
        if m:
            runs[int(m[1]), int(m[2])].append(r)
    assert len(runs) == 92 * 896 and {len(v) for v in runs.values()} == {6}
    layer_spans = defaultdict(list)
    for (layer, _), rs in runs.items():
        rs.sort(key=lambda r: r.begin)
        assert len({r.file for r in rs}) == 1 and rs[0].file.name == k3_file(layer + 1)
        assert all(a.end == b.begin for a, b in pairwise(rs))
        assert rs[-1].end - rs[0].begin == 17_547_264
        layer_spans[layer].append((rs[0].begin, rs[-1].end))
    for layer, spans in layer_spans.items():
        spans.sort()
        assert all(a[1] == b[0] for a, b in pairwise(spans)), layer
        assert spans[-1][1] - spans[0][0] == 15_722_348_544
        assert spans[-1][1] == os.path.getsize(out / k3_file(layer + 1))


@pytest.mark.slow
def test_k3_inspect_and_sparse(k3, tmp_path):
    out, _, seconds = k3
    index = open_weights(out)  # by its names (test_read_plan validates a rank's headers of the 94 text files)
    assert (index.expert_format, len(index.locations), len(index.skipped)) == ("mxfp4", 497_220 - 168, 168)
    if not sparse_files_supported(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} does not keep sparse files (a truncated 1 GiB file takes "
                    "disk); the disk-usage check needs one that does")
    used = sum(os.stat(out / f).st_blocks * 512 for f in os.listdir(out))
    assert used < 0.01 * 1_560_860_324_864, used
    assert seconds < 120  # ~10 s on 2 cores; far above means something regressed
