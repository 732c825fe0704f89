"""The split-KV decode attention (kernels/decode_attention.py, kernels/attention_parts.py) and its cluster variant
(kernels/cluster_attention.py) vs the PyTorch reference, and the engine wiring of their switches
(TRITON_INTERPRET=1: the kernels run on CPU)."""

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton not installed")  # conftest sets TRITON_INTERPRET on CPU


# --- decode attention (split-KV, positional mask) ---------------------------------------------------------


@pytest.mark.parametrize("B,H,Hkv,T,S,D", [(1, 4, 2, 1, 40, 16), (2, 4, 1, 5, 70, 32), (1, 6, 2, 16, 33, 16),
                                           (2, 2, 2, 3, 64, 64)])
def test_decode_attention_matches_reference(B, H, Hkv, T, S, D):
    from specpilot.kernels.decode_attention import decode_attention, decode_attention_reference

    g = torch.Generator().manual_seed(B * 100 + T)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    # per row its own positions: consecutive tokens ending anywhere in the pool (some rows short: early exits)
    ends = torch.randint(T - 1, S, (B,), generator=g)
    ends[0] = T - 1  # a row that sees only the first T slots: most slices exit at once
    positions = ends[:, None] - (T - 1) + torch.arange(T)[None]
    want = decode_attention_reference(q, k, v, positions)
    for split, block in ((16, 16), (32, 16), (64, 32)):
        got = decode_attention(q, k, v, positions, split_s=split, block_s=block)
        assert torch.isfinite(got).all()
        assert (got - want).abs().max().item() < 1e-4, (split, block)


@pytest.mark.parametrize("B,H,Hkv,T,S,D", [(1, 4, 2, 1, 40, 16), (2, 4, 1, 5, 70, 32), (1, 6, 2, 16, 33, 16),
                                           (2, 2, 2, 3, 64, 64)])
def test_decode_attention_one_launch_matches_reference_and_resets_its_counters(B, H, Hkv, T, S, D):
    """The last program of each (b, kv head) merges: equal to the two-launch path bit for bit (same merge code), so
    to the reference; the counters end at zero (so a second call, a later layer, a graph replay starts clean)."""
    from specpilot.kernels import decode_attention as da

    g = torch.Generator().manual_seed(B * 100 + T)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    ends = torch.randint(T - 1, S, (B,), generator=g)
    ends[0] = T - 1  # a row that sees only the first T slots: one slice works, the others exit at once
    if B > 1:
        ends[1] = S - 1  # and one that sees the whole pool: every slice works and the merge walks them all
    positions = ends[:, None] - (T - 1) + torch.arange(T)[None]
    want = da.decode_attention_reference(q, k, v, positions)
    for split, block in ((16, 16), (32, 16), (64, 32)):
        two = da.decode_attention(q, k, v, positions, split_s=split, block_s=block)  # held: its memory not reused
        one = da.decode_attention(q, k, v, positions, split_s=split, block_s=block, one_launch=True)
        assert (one - want).abs().max().item() < 1e-4, (split, block)
        assert torch.equal(one, two)
        counters = da._COUNTERS[q.device]
        assert counters.numel() >= B * Hkv and not counters.any()
        again = da.decode_attention(q, k, v, positions, split_s=split, block_s=block, one_launch=True)
        assert torch.equal(again, one) and not counters.any()


@pytest.mark.parametrize("chunk", [0, 4])
@pytest.mark.parametrize("B,H,Hkv,T,S,D", [(2, 12, 2, 1, 140, 16), (2, 4, 1, 5, 70, 32), (1, 8, 8, 1, 33, 16)])
def test_decode_attention_one_launch_single_slice_stores_directly_bit_for_bit(monkeypatch, chunk, B, H, Hkv, T, S,
                                                                                D):
    """SINGLE_DIRECT (EngineConfig.attn_single_direct): where one slice holds every visible key (n_used == 1) its
    program stores the output itself instead of a partial, an arrival and a merge of one: the same bits as the
    merge (serial or chunked), rows of one launch on both paths (one short, one over several slices), no counter
    left raised."""
    from specpilot.kernels import decode_attention as da

    g = torch.Generator().manual_seed(B + H + T + chunk)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    monkeypatch.setattr(da, "MERGE_CHUNK", chunk)
    for split, block in ((16, 16), (32, 16), (64, 32), (256, 64)):
        for end0 in (T - 1, split - 1, split):  # one slice's first slot, its last, the next slice's first
            ends = torch.full((B,), min(end0, S - 1))
            if B > 1:
                ends[1] = S - 1  # every slice works
            positions = ends[:, None] - (T - 1) + torch.arange(T)[None]
            monkeypatch.setattr(da, "SINGLE_DIRECT", False)
            want = da.decode_attention(q, k, v, positions, split_s=split, block_s=block, one_launch=True)
            monkeypatch.setattr(da, "SINGLE_DIRECT", True)
            got = da.decode_attention(q, k, v, positions, split_s=split, block_s=block, one_launch=True)
            assert torch.equal(got, want), (split, block, end0)
            assert not da._COUNTERS[q.device].any()
    ref = da.decode_attention_reference(q, k, v, positions)
    assert (got - ref).abs().max().item() < 1e-4


def test_engine_sets_the_single_slice_switch_from_the_config(monkeypatch, switch_wired):
    """EngineConfig.attn_single_direct -> decode_attention.SINGLE_DIRECT on CUDA only (off by default); validated, a
    CLI flag, in the loop's layout key; the loop's mechanism searches it with the keys a program."""
    from specpilot.config import EngineConfig
    from specpilot.engine import _apply_program_splits
    from specpilot.kernels import decode_attention as da

    monkeypatch.setattr(da, "SINGLE_DIRECT", False)
    monkeypatch.setattr(da, "ONE_LAUNCH_SPLIT", (128, 64))
    _apply_program_splits(EngineConfig(device="cuda", attn_single_direct=True, attn_split_keys=512))
    assert da.SINGLE_DIRECT is True and da.ONE_LAUNCH_SPLIT == (512, 128)
    _apply_program_splits(EngineConfig(attn_single_direct=True))  # CPU: the default layout
    assert da.SINGLE_DIRECT is False
    switch_wired("attn_single_direct", "--attn-single-direct", "attn_single",
                 {"attn_single_direct": True, "attn_split_keys": 512})


def _merge_case(seed, B, H, Hkv, T, S, D):
    """q, k, v, positions for the one-launch merge's tests (16 keys a slice): batch row 0 has one slice working,
    row 1 every slice (5-9 of them: chunks / groups of 1-4 loop, 8 is partly masked), row 2 six (a group of 4 and a
    partial one), the rest random."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    ends = torch.randint(T - 1, S, (B,), generator=g)
    ends[0] = T - 1
    if B > 1:
        ends[1] = S - 1
    if B > 2:
        ends[2] = 16 * 5 + 3
    return q, k, v, ends[:, None] - (T - 1) + torch.arange(T)[None]


@pytest.mark.parametrize("unroll", [2, 4])
@pytest.mark.parametrize("B,H,Hkv,T,S,D", [(3, 12, 2, 1, 140, 16), (2, 4, 1, 5, 70, 32), (1, 6, 2, 16, 33, 16)])
def test_decode_attention_one_launch_unrolled_merge_is_the_loop_bit_for_bit(monkeypatch, unroll, B, H, Hkv, T, S, D):
    """MERGE_UNROLL (EngineConfig.attn_merge_unroll): the last program issues `unroll` slices' loads before it sums
    them, in the loop's order, so the output is the serial merge's bit for bit: one slice working, a partial last
    group (slices past n_used masked to -inf / 0), several groups (5-9 slices of 16 keys), T = 1 and a verify
    block; the counters end at zero. A merge that skipped or repeated a slice, or summed in another order, fails."""
    from specpilot.kernels import decode_attention as da

    q, k, v, positions = _merge_case(B * 100 + T + unroll, B, H, Hkv, T, S, D)
    monkeypatch.setattr(da, "MERGE_CHUNK", 0)
    monkeypatch.setattr(da, "MERGE_UNROLL", 0)
    serial = da.decode_attention(q, k, v, positions, split_s=16, block_s=16, one_launch=True)
    monkeypatch.setattr(da, "MERGE_UNROLL", unroll)
    got = da.decode_attention(q, k, v, positions, split_s=16, block_s=16, one_launch=True)
    assert torch.equal(got, serial)
    assert (got - da.decode_attention_reference(q, k, v, positions)).abs().max().item() < 1e-4
    assert not da._COUNTERS[q.device].any()


@pytest.mark.parametrize("unroll,block", [(0, 16), (2, 16), (4, 16), (4, 8)])
@pytest.mark.parametrize("B,H,Hkv,T,S,D", [(3, 12, 2, 1, 140, 16), (2, 4, 1, 5, 70, 32)])
def test_decode_attention_loads_first_is_the_same_bits(monkeypatch, unroll, block, B, H, Hkv, T, S, D):
    """LOADS_FIRST (EngineConfig.attn_loads_first): V asked for with K, the merge's first slices with the maxima;
    the same sums in the same order, so the output is the one without it bit for bit (one and several key blocks a
    slice, the serial merge and both unrolls, a partial first group: 1-9 slices working)."""
    from specpilot.kernels import decode_attention as da

    q, k, v, positions = _merge_case(B * 10 + T + unroll + block, B, H, Hkv, T, S, D)
    monkeypatch.setattr(da, "MERGE_CHUNK", 0)
    monkeypatch.setattr(da, "MERGE_UNROLL", unroll)
    monkeypatch.setattr(da, "LOADS_FIRST", False)
    plain = da.decode_attention(q, k, v, positions, split_s=16, block_s=block, one_launch=True)
    monkeypatch.setattr(da, "LOADS_FIRST", True)
    got = da.decode_attention(q, k, v, positions, split_s=16, block_s=block, one_launch=True)
    assert torch.equal(got, plain)
    assert (got - da.decode_attention_reference(q, k, v, positions)).abs().max().item() < 1e-4
    assert not da._COUNTERS[q.device].any()


def test_engine_sets_loads_first_from_the_config(monkeypatch, switch_wired):
    """EngineConfig.attn_loads_first -> decode_attention.LOADS_FIRST on CUDA only (off by default); a bool; a CLI
    flag; in the loop's layout key and proposed by its mechanism on a GPU deployment."""
    from specpilot.config import EngineConfig
    from specpilot.engine import _apply_program_splits
    from specpilot.kernels import decode_attention as da

    monkeypatch.setattr(da, "LOADS_FIRST", False)
    _apply_program_splits(EngineConfig(device="cuda", attn_loads_first=True))
    assert da.LOADS_FIRST is True
    _apply_program_splits(EngineConfig(attn_loads_first=True))  # CPU: the order the CPU tests pin
    assert da.LOADS_FIRST is False
    switch_wired("attn_loads_first", "--attn-loads-first", "attn_loads_first", {"attn_loads_first": True})


def test_engine_sets_the_merge_unroll_from_the_config(monkeypatch, field_wired):
    """EngineConfig.attn_merge_unroll -> decode_attention.MERGE_UNROLL on CUDA only (4 by default since session 40;
    0 is the loop); only 0, 2 or 4 pass validation; a CLI flag; in the loop's layout key and searched by its
    mechanism."""
    from specpilot.config import EngineConfig
    from specpilot.engine import _apply_program_splits
    from specpilot.errors import ConfigError
    from specpilot.kernels import decode_attention as da

    monkeypatch.setattr(da, "MERGE_UNROLL", 0)
    assert EngineConfig().attn_merge_unroll == 4
    _apply_program_splits(EngineConfig(device="cuda"))
    assert da.MERGE_UNROLL == 4
    _apply_program_splits(EngineConfig(device="cuda", attn_merge_unroll=0))
    assert da.MERGE_UNROLL == 0
    _apply_program_splits(EngineConfig(attn_merge_unroll=4))  # CPU: the loop the CPU tests pin
    assert da.MERGE_UNROLL == 0
    for bad in (3, 8, -2, True, "4"):
        with pytest.raises(ConfigError, match="attn_merge_unroll must be 0, 2 or 4"):
            EngineConfig(attn_merge_unroll=bad)
    field_wired("attn_merge_unroll", ["--attn-merge-unroll", "2"], 2, "attn_merge_unroll", {"attn_merge_unroll": 0})


def test_engine_sets_the_block_keys_from_the_config(monkeypatch, field_wired):
    """EngineConfig.attn_block_keys -> decode_attention.ONE_LAUNCH_SPLIT's keys an inner step on CUDA only (0: 128,
    or the whole slice when a program takes fewer keys); 0 or a power of two in [16, 256] at most attn_split_keys;
    a CLI flag; in the loop's layout key; its mechanism proposes 64 and never a block wider than the slice."""
    from specpilot.config import EngineConfig
    from specpilot.engine import _apply_program_splits
    from specpilot.errors import ConfigError
    from specpilot.kernels import decode_attention as da
    from specpilot.loop.registry import REGISTRY

    monkeypatch.setattr(da, "ONE_LAUNCH_SPLIT", (128, 64))
    assert EngineConfig().attn_block_keys == 0
    for fields, want in (({}, (128, 128)), ({"attn_block_keys": 64}, (128, 64)), ({"attn_split_keys": 32}, (32, 32)),
                         ({"attn_split_keys": 512, "attn_block_keys": 256}, (512, 256)),
                         ({"attn_split_keys": 512}, (512, 128)), ({"attn_block_keys": 32}, (128, 32))):
        _apply_program_splits(EngineConfig(device="cuda", **fields))
        assert da.ONE_LAUNCH_SPLIT == want, fields
    _apply_program_splits(EngineConfig(attn_block_keys=128))  # CPU: the layout the CPU tests pin
    assert da.ONE_LAUNCH_SPLIT == (128, 64)
    for bad in (8, 48, 512, True, "64"):
        with pytest.raises(ConfigError, match="attn_block_keys must be 0 or a power of two"):
            EngineConfig(attn_block_keys=bad)
    with pytest.raises(ConfigError, match=r"at most attn_split_keys \(64\)"):
        EngineConfig(attn_split_keys=64, attn_block_keys=128)
    gpu = field_wired("attn_block_keys", ["--attn-block-keys", "64"], 64, "attn_block", {"attn_block_keys": 64})
    narrow = EngineConfig(device="cuda", attn_split_keys=32)
    assert {"attn_block_keys": 64} not in REGISTRY["attn_block"].candidates(narrow, gpu)


def test_decode_attention_one_launch_takes_a_slice_in_one_block():
    """A program's 128 keys in one inner step (attn_block_keys 128) against two of 64: the same attention up to the
    online softmax's fp32 order, and the reference's, at T = 1 and over several slices."""
    from specpilot.kernels import decode_attention as da

    g = torch.Generator().manual_seed(40)
    B, H, Hkv, S, D = 2, 12, 2, 300, 16
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    positions = torch.tensor([[127], [S - 1]])  # one slice's last key; every slice
    want = da.decode_attention_reference(q, k, v, positions)
    two = da.decode_attention(q, k, v, positions, split_s=128, block_s=64, one_launch=True)
    one = da.decode_attention(q, k, v, positions, split_s=128, block_s=128, one_launch=True)
    assert (one - want).abs().max().item() < 1e-4 and (one - two).abs().max().item() < 1e-5
    assert not da._COUNTERS[q.device].any()


@pytest.mark.parametrize("chunk", [1, 2, 4, 8])
@pytest.mark.parametrize("B,H,Hkv,T,S,D", [(2, 4, 1, 5, 70, 32), (2, 12, 2, 1, 140, 16), (1, 6, 2, 16, 33, 16)])
def test_decode_attention_one_launch_merges_in_chunks(monkeypatch, chunk, B, H, Hkv, T, S, D):
    """MERGE_CHUNK (EngineConfig.attn_merge_chunk): the last program reads the slices' accumulators `chunk` at a
    time (fewer or more slices working than a chunk holds, the loop over later chunks, a partial last chunk, and
    the merge's rows cut to the group's real ones): the reference's attention, within the fp32 merge's rounding of
    the serial merge, and the counters end at zero."""
    from specpilot.kernels import decode_attention as da

    q, k, v, positions = _merge_case(B * 10 + T + chunk, B, H, Hkv, T, S, D)
    want = da.decode_attention_reference(q, k, v, positions)
    serial = da.decode_attention(q, k, v, positions, split_s=16, block_s=16, one_launch=True)
    monkeypatch.setattr(da, "MERGE_CHUNK", chunk)
    got = da.decode_attention(q, k, v, positions, split_s=16, block_s=16, one_launch=True)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() < 1e-4
    assert (got - serial).abs().max().item() < 1e-5
    assert not da._COUNTERS[q.device].any()


@pytest.mark.parametrize("split,block", [(16, 16), (32, 16), (64, 32), (64, 16)])
@pytest.mark.parametrize("B,H,Hkv,S,D", [(3, 12, 2, 70, 16), (2, 4, 1, 64, 32), (1, 8, 8, 33, 16)])
def test_decode_attention_one_launch_preloads_older_rows_bit_for_bit(monkeypatch, split, block, B, H, Hkv, S, D):
    """KV_PRELOAD (EngineConfig.attn_kv_preload): at T = 1 the one-launch kernel loads its slice's rows below the
    token's slot before the (PDL) wait and slot p's row after it, put in place of slot p in the preloaded tiles:
    the output equals the loop's bit for bit (one order of sums), with p on a slice's first / last key, mid-slice,
    p = 0 and the pool's end, and rows above p holding large stale values (finite, as a pool's are) that both must
    mask; 4 blocks a slice (64 : 16) keeps the loop. (Which load precedes the wait the interpreter cannot show:
    tests/pdl_ptx.py checks that in the sm_90 PTX.)"""
    from specpilot.kernels import decode_attention as da

    g = torch.Generator().manual_seed(S + D + split)
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    ends = [0, split - 1, split, split + 5, S - 1, 2 * split]
    for p in ends:
        if p >= S:
            continue
        positions = torch.tensor([[p]] * B)
        if B > 1:
            positions[1, 0] = min(S - 1, p + block)  # rows of one launch at different positions
        kp, vp = k.clone(), v.clone()
        for b in range(B):  # stale rows above each row's slot: large, so any use of them shows
            kp[b, :, positions[b, 0] + 1:] = 30.0
            vp[b, :, positions[b, 0] + 1:] = -30.0
        monkeypatch.setattr(da, "KV_PRELOAD", False)
        want = da.decode_attention(q, kp, vp, positions, split_s=split, block_s=block, one_launch=True)
        monkeypatch.setattr(da, "KV_PRELOAD", True)
        got = da.decode_attention(q, kp, vp, positions, split_s=split, block_s=block, one_launch=True)
        assert torch.equal(got, want), (p, split, block)
        assert (got - da.decode_attention_reference(q, kp, vp, positions)).abs().max().item() < 1e-4
        assert not da._COUNTERS[q.device].any()
    # T > 1 (a verify block) keeps the loop whatever the switch: the rows of its tokens' slots are all new
    positions = torch.tensor([[5, 6, 7]] * B)
    q3 = torch.randn(B, H, 3, D, generator=g)
    monkeypatch.setattr(da, "KV_PRELOAD", True)
    got = da.decode_attention(q3, k, v, positions, split_s=split, block_s=block, one_launch=True)
    assert (got - da.decode_attention_reference(q3, k, v, positions)).abs().max().item() < 1e-4


@pytest.mark.parametrize("rows_per_program", [16, 32, 64])
def test_decode_attention_row_blocks(monkeypatch, rows_per_program):
    """A verify block's rows (GQA group x tokens: 3 x 13 = 39 here) split over programs of `ROWS_PER_PROGRAM` rows:
    the same attention whatever the split (two launches, one launch, token-major), one counter per row block, all
    back at zero; the positions differ per row so each block's own early exit and merge count are exercised."""
    from specpilot.kernels import decode_attention as da

    monkeypatch.setattr(da, "ROWS_PER_PROGRAM", rows_per_program)
    g = torch.Generator().manual_seed(7)
    B, H, Hkv, T, S, D = 2, 6, 2, 13, 90, 16
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    positions = torch.tensor([[3] * 6 + list(range(4, 11)), list(range(70, 83))])  # a tree-like repeat, a chain
    want = da.decode_attention_reference(q, k, v, positions)
    two = da.decode_attention(q, k, v, positions, split_s=16, block_s=16)
    one = da.decode_attention(q, k, v, positions, split_s=16, block_s=16, one_launch=True)
    tm = da.decode_attention(q, k, v, positions, split_s=16, block_s=16, token_major=True)
    for got in (two, one, tm):
        assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(one, two) and torch.equal(tm, two)
    blocks = -(-3 * T // max(16, min(64, rows_per_program)))
    assert da._COUNTERS[q.device].numel() >= B * Hkv * blocks and not da._COUNTERS[q.device].any()


def test_decode_attention_one_launch_counters_grow_eagerly_only(monkeypatch):
    """One buffer per device, grown (never shrunk) to B * Hkv; growing under CUDA graph capture is an error; a
    counter left non-zero shifts who merges, so the merge really depends on the count (not on program order)."""
    from specpilot.kernels import decode_attention as da
    from specpilot.kernels import scratch

    g = torch.Generator().manual_seed(3)
    q, pos = torch.randn(3, 4, 2, 16, generator=g), torch.tensor([[40, 41], [10, 11], [62, 63]])
    k, v = torch.randn(3, 2, 64, 16, generator=g), torch.randn(3, 2, 64, 16, generator=g)  # GQA: 2 heads a group
    monkeypatch.setattr(da, "_COUNTERS", scratch.DeviceBuffers("test counters", torch.int32))
    want = da.decode_attention_reference(q, k, v, pos)
    got = da.decode_attention(q[:1], k[:1], v[:1], pos[:1], split_s=16, block_s=16, one_launch=True)
    small = da._COUNTERS[q.device]
    assert small.numel() == 2 and (got - want[:1]).abs().max().item() < 1e-4
    monkeypatch.setattr(scratch, "capturing", lambda device: True)
    da.decode_attention(q[:1], k[:1], v[:1], pos[:1], split_s=16, block_s=16, one_launch=True)  # fits: no growth
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        da.decode_attention(q, k, v, pos, split_s=16, block_s=16, one_launch=True)  # 6 counters needed
    monkeypatch.setattr(scratch, "capturing", lambda device: False)
    got = da.decode_attention(q, k, v, pos, split_s=16, block_s=16, one_launch=True)
    assert da._COUNTERS[q.device].numel() == 6 and da._COUNTERS.retired == [small]
    assert (got - want).abs().max().item() < 1e-4 and not da._COUNTERS[q.device].any()
    # as if a slice had already arrived: the second of (b 0, hk 0)'s three slices merges while the third's partial
    # is not written yet (new queries: a partial left in reused memory by the call above would be wrong too)
    da._COUNTERS[q.device][0] = 1
    q2 = torch.randn(q.shape, generator=g)
    bad = da.decode_attention(q2, k, v, pos, split_s=16, block_s=16, one_launch=True)
    want2 = da.decode_attention_reference(q2, k, v, pos)
    assert not torch.allclose(bad[0, :2], want2[0, :2], atol=1e-3)  # query heads 0, 1 share kv head 0
    assert torch.allclose(bad[0, 2:], want2[0, 2:], atol=1e-4) and torch.allclose(bad[1:], want2[1:], atol=1e-4)
    assert da._COUNTERS[q.device].tolist() == [1] + [0] * 5  # the third arrival found 0, not 2: no merge, no reset


def test_decode_attention_reads_strided_queries_and_rejects_bad_shapes():
    from specpilot.kernels.decode_attention import decode_attention, decode_attention_reference

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 3, 4, 16, generator=g).transpose(1, 2)  # [1, 4 heads, 3 tokens, 16], not contiguous
    k, v = torch.randn(1, 2, 20, 16, generator=g), torch.randn(1, 2, 20, 16, generator=g)
    pos = torch.tensor([[10, 11, 12]])
    got = decode_attention(q, k, v, pos, split_s=16, block_s=16)
    assert (got - decode_attention_reference(q, k, v, pos)).abs().max().item() < 1e-4
    with pytest.raises(ValueError):
        decode_attention(torch.randn(1, 4, 17, 16), k, v, torch.zeros(1, 17, dtype=torch.long))  # T > 16
    with pytest.raises(ValueError):
        decode_attention(torch.randn(1, 3, 1, 16), k, v, pos[:, :1])  # 3 heads over 2 KV heads


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_model_with_attention_kernel_matches_sdpa_and_greedy_is_unchanged(
        tiny_model_dir, family, step_outputs_and_greedy):
    """The kernel replaces SDPA only for <= 16-token steps under the positional mask; prefill keeps SDPA."""
    from specpilot.models import load_model

    path = tiny_model_dir(family)
    err, spec = step_outputs_and_greedy(load_model(path), load_model(path).use_attention_kernel(), logits=False)
    assert err < 1e-4
    assert spec.num_target_forwards < len(spec.output_ids) or max(spec.drafted_lengths) > 0


def test_decode_attention_bf16_accumulates_in_fp32():
    from specpilot.kernels.decode_attention import decode_attention, decode_attention_reference

    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 4, 2, 32, generator=g).bfloat16()
    k, v = torch.randn(1, 2, 50, 32, generator=g).bfloat16(), torch.randn(1, 2, 50, 32, generator=g).bfloat16()
    pos = torch.tensor([[30, 31]])
    got = decode_attention(q, k, v, pos, split_s=32, block_s=16)
    assert got.dtype == torch.bfloat16
    assert (got.float() - decode_attention_reference(q, k, v, pos).float()).abs().max().item() < 2e-2


def test_decode_attention_is_one_opaque_op_under_torch_compile():
    """torch.compile must see the kernel as one custom op (its fake gives the shape), not trace into the Triton
    launch: Inductor's own re-compilation of `_split_kernel` failed on the H200 (the loop's compile trial)."""
    from specpilot.kernels.decode_attention import decode_attention_op, decode_attention_reference

    torch.manual_seed(0)
    q = torch.randn(1, 4, 3, 16)
    k, v = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    pos = torch.tensor([[20, 21, 22]])
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda q, k, v, p: decode_attention_op(q, k, v, p) * 2, backend=backend, fullgraph=True)
    out = fn(q, k, v, pos)
    assert torch.allclose(out, 2 * decode_attention_reference(q, k, v, pos), atol=1e-4)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert any("specpilot.decode_attention" in t for t in targets), targets


def test_decode_attention_one_launch_is_its_own_opaque_op_under_torch_compile():
    from specpilot.kernels.decode_attention import decode_attention_one_op, decode_attention_reference

    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 300, 16), torch.randn(2, 2, 300, 16)
    pos = torch.tensor([[20, 21, 22], [270, 271, 272]])  # the default 128-key slices: 1 and 3 of them at work
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda q, k, v, p: decode_attention_one_op(q, k, v, p) * 2, backend=backend, fullgraph=True)
    assert torch.allclose(fn(q, k, v, pos), 2 * decode_attention_reference(q, k, v, pos), atol=1e-4)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("specpilot.decode_attention_one" in t for t in targets) == 1, targets


def test_decode_attention_token_major_is_the_same_attention_laid_out_by_token():
    """The fused verify step's op: the two-launch kernel's numbers bit for bit, stored as [B, T, H, D] so the
    o_proj input (transpose + reshape) is a view; its fake (torch.compile) has the same strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from specpilot.kernels.decode_attention import decode_attention, decode_attention_token_major_op

    torch.manual_seed(2)
    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    pos = torch.arange(200, 205)[None]
    got = decode_attention_token_major_op(q, k, v, pos)
    assert torch.equal(got, decode_attention(q, k, v, pos))
    assert got.transpose(1, 2).is_contiguous() and got.transpose(1, 2).reshape(5, 64).data_ptr() == got.data_ptr()
    with FakeTensorMode():
        fake = decode_attention_token_major_op(torch.empty(1, 4, 5, 16), torch.empty(1, 2, 300, 16),
                                               torch.empty(1, 2, 300, 16), torch.empty(1, 5, dtype=torch.long))
        assert fake.shape == got.shape and fake.stride() == got.stride()


@pytest.mark.parametrize("B,H,Hkv,T,S,D", [(1, 12, 2, 16, 300, 16), (1, 4, 2, 5, 70, 32), (2, 8, 8, 16, 40, 16)])
def test_verify_one_launch_is_the_pair_bit_for_bit(monkeypatch, B, H, Hkv, T, S, D):
    """VERIFY_ONE_LAUNCH (EngineConfig.verify_one_launch): the verify op runs the one-launch kernel over the pair's
    slices (6 x 16 = 96 rows a KV head: three row blocks, each merged by its own last arrival) -> the two-launch
    numbers bit for bit, laid out token-major the same way; the merge kernel no longer launches and the counters end
    at zero."""
    from specpilot.kernels import decode_attention as da

    g = torch.Generator().manual_seed(T * 10 + H)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    ends = torch.randint(T - 1, S, (B,), generator=g)
    ends[-1] = S - 1  # a row that sees the whole pool: every slice works
    positions = ends[:, None] - (T - 1) + torch.arange(T)[None]
    monkeypatch.setattr(da, "VERIFY_ONE_LAUNCH", False)
    pair = da.decode_attention_token_major_op(q, k, v, positions)
    real, merges = da._combine_kernel, []

    class Spy:
        def __getitem__(self, grid):
            merges.append(grid)
            return real[grid]

    monkeypatch.setattr(da, "_combine_kernel", Spy())
    monkeypatch.setattr(da, "VERIFY_ONE_LAUNCH", True)
    one = da.decode_attention_token_major_op(q, k, v, positions)
    assert not merges and torch.equal(one, pair) and one.stride() == pair.stride()
    assert (one - da.decode_attention_reference(q, k, v, positions)).abs().max().item() < 1e-4
    assert not da._COUNTERS[q.device].any()
    monkeypatch.setattr(da, "VERIFY_ONE_LAUNCH", False)
    da.decode_attention_token_major_op(q, k, v, positions)
    assert len(merges) == 1  # off: the pair again


def test_engine_sets_verify_one_launch_from_the_config(monkeypatch, field_wired):
    """EngineConfig.verify_one_launch -> decode_attention.VERIFY_ONE_LAUNCH on CUDA only, ON by default since session
    52 (so a default CUDA engine's verify attention is one launch, and --no-verify-one-launch gives the pair back);
    only a bool passes validation; in the loop's layout key, and its mechanism proposes turning it off first (and
    verify_l2, which only the pair does, is proposed only with it off)."""
    from specpilot.config import EngineConfig
    from specpilot.engine import _apply_program_splits
    from specpilot.errors import ConfigError
    from specpilot.kernels import decode_attention as da
    from specpilot.loop.registry import REGISTRY

    assert EngineConfig().verify_one_launch is True
    monkeypatch.setattr(da, "VERIFY_ONE_LAUNCH", False)
    _apply_program_splits(EngineConfig(device="cuda"))
    assert da.VERIFY_ONE_LAUNCH is True
    _apply_program_splits(EngineConfig(device="cuda", verify_one_launch=False))
    assert da.VERIFY_ONE_LAUNCH is False
    monkeypatch.setattr(da, "VERIFY_ONE_LAUNCH", True)
    _apply_program_splits(EngineConfig())  # CPU: the pair, as the CPU tests pin
    assert da.VERIFY_ONE_LAUNCH is False
    with pytest.raises(ConfigError, match="verify_one_launch must be true or false"):
        EngineConfig(verify_one_launch="yes")
    gpu = field_wired("verify_one_launch", ["--no-verify-one-launch"], False, "verify_one_launch",
                      {"verify_one_launch": False})
    assert REGISTRY["verify_one_launch"].candidates(gpu.config, gpu)[0] == {"verify_one_launch": False}
    assert not REGISTRY["verify_l2"].applies(gpu, gpu.config)
    assert REGISTRY["verify_l2"].applies(gpu, gpu.config.with_(verify_one_launch=False))

def test_cluster_attention_compiles_for_sm90(sm90_report):
    """tests/cluster_ptx.py compiles the cluster attention for sm_90 (no GPU needed) with each cluster size and
    option: each CTA's partial goes to its own static shared buffer, two cluster barriers (release / acquire)
    surround the distributed-shared-memory reads, and only the cross-cluster path has an atomic and L2 reads."""
    r = sm90_report("cluster_ptx.py")
    assert r["cluster_arrives"] == ["barrier.cluster.arrive.release.aligned"] * 2
    assert r["cluster_waits"] == ["barrier.cluster.wait.acquire.aligned"] * 2
    assert r["mapa"] > 0 and r["dsmem_loads"] >= r["mapa"]  # every peer read is mapped into the cluster window
    assert r["shared_stores"] > 0
    assert r["static_buffers"] == [["spc_part_s", "4352"]] and r["large_buffers"] == [["spc_part_l", "16512"]]
    assert r["atomics"] == ["atom.global.gpu.acq_rel.add.u32"] and r["cg_loads"] > 0
    assert r["griddepcontrol"] == 2  # launch_dependents and wait
    assert all(r["sizes_compile"].values()) and all(r["options_compile"].values())
    # PUSH: a "started" arrival first thing, the partials out as remote stores, one barrier, every read local
    assert r["push_arrives"] == 2 and r["push_remote_stores"] > 0 and r["push_dsmem_loads"] == 0
    assert r["push_buffers"] == [["spc_push_s", "5120"]]
    # aligned as on a GPU, K and V go to shared memory by cp.async; 2 stages take less of it than Triton's 3
    assert all(n > 0 for n in r["staged_cp_async"].values())
    assert r["staged_shared_bytes"]["2"] < r["staged_shared_bytes"]["3"]


def test_engine_sets_the_cluster_from_the_config(monkeypatch, field_wired):
    """EngineConfig.attn_cluster -> kernels/cluster_attention.py CLUSTER on CUDA only (8 by default since session
    42; 0: off); only 0,
    4, 8 or 16 pass validation; a CLI flag; in the loop's layout key and searched by its mechanism; in the engine's
    snapshot of the kernel switches."""
    from specpilot.config import EngineConfig
    from specpilot.engine import _apply_program_splits, kernel_switches
    from specpilot.errors import ConfigError
    from specpilot.kernels import cluster_attention as ca

    monkeypatch.setattr(ca, "CLUSTER", 0)
    assert EngineConfig().attn_cluster == 8
    _apply_program_splits(EngineConfig(device="cuda"))
    assert ca.CLUSTER == 8 and kernel_switches()[ca, "CLUSTER"] == 8
    _apply_program_splits(EngineConfig(device="cuda", attn_cluster=0))
    assert ca.CLUSTER == 0
    _apply_program_splits(EngineConfig(attn_cluster=16))  # CPU: never
    assert ca.CLUSTER == 0
    for bad in (2, 3, 32, -4, True, "8"):
        with pytest.raises(ConfigError, match="attn_cluster must be 0"):
            EngineConfig(attn_cluster=bad)
    field_wired("attn_cluster", ["--attn-cluster", "16"], 16, "attn_cluster", {"attn_cluster": 0})


def test_cluster_attention_applies_only_where_it_can(monkeypatch):
    """The cluster kernel takes a call only when switched on, on CUDA, for one token of one row block with
    G <= 16, D <= 256 and D a multiple of the cluster size; anything else (the CPU tests' calls among them) takes
    decode_attention's kernels, whose output is then unchanged."""
    import torch

    from specpilot.kernels import cluster_attention as ca
    from specpilot.kernels import decode_attention as da

    cpu = torch.device("cpu")
    monkeypatch.setattr(ca, "CLUSTER", 0)
    assert not ca.applies(1, 6, 128, 1, torch.device("cuda"))
    monkeypatch.setattr(ca, "CLUSTER", 8)
    assert not ca.applies(1, 6, 128, 1, cpu)
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    pos = torch.tensor([[40]])
    if da.triton is not None:  # (under the interpreter: the one-launch kernel, never the cluster's)
        out = da.decode_attention(q, k, v, pos, split_s=16, block_s=16, one_launch=True)
        torch.testing.assert_close(out, da.decode_attention_reference(q, k, v, pos), atol=1e-5, rtol=1e-5)


def test_cluster_launch_asks_triton_for_the_cluster(monkeypatch):
    """`_cluster_launch` compiles first (no launch), rewrites the compiled kernel's (num_warps, num_ctas, shared)
    so Triton's launcher asks for clusters of `ctas` (and multiplies grid x by it), then launches grid x / ctas;
    a Triton without that tuple launches nothing, warns once naming the switch, and the one-launch kernel takes
    every later call (the switch is on by default: where it cannot work it must not fail)."""
    import torch

    from specpilot.kernels import cluster_attention as ca

    class Compiled:
        packed_metadata = (4, 1, 40960)

    class Kernel:
        def __init__(self, compiled):
            self.compiled, self.launched = compiled, []

        def warmup(self, *args, grid, **kwargs):
            self.warm_grid = grid
            return self.compiled

        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.launched.append((grid, args, kwargs))

    kernel = Kernel(Compiled())
    assert ca._cluster_launch(kernel, (2 * 8, 3), ("a", 1), {"D": 128}, 8) is True
    assert kernel.compiled.packed_metadata == (4, 8, 40960)
    assert kernel.warm_grid == (2, 3) and kernel.launched == [((2, 3), ("a", 1), {"D": 128})]

    class Bare:
        pass

    monkeypatch.setattr(ca, "_unsupported", False)
    monkeypatch.setattr(ca, "CLUSTER", 8)
    bare = Kernel(Bare())
    with pytest.warns(UserWarning, match="attn_cluster"):
        assert ca._cluster_launch(bare, (8, 1), (), {}, 8) is False
    assert bare.launched == [] and ca._unsupported
    assert not ca.applies(1, 6, 128, 1, torch.device("cuda"))  # from then on: the one-launch kernel


def test_engine_sets_the_cluster_even_switch_from_the_config(monkeypatch, switch_wired):
    """EngineConfig.attn_cluster_even -> kernels/cluster_attention.py EVEN on CUDA only (off by default); a bool; a
    CLI flag; in the loop's layout key and searched by its mechanism (with a cluster)."""
    from specpilot.config import EngineConfig
    from specpilot.engine import _apply_program_splits
    from specpilot.kernels import cluster_attention as ca

    monkeypatch.setattr(ca, "EVEN", False)
    _apply_program_splits(EngineConfig(device="cuda", attn_cluster_even=True))
    assert ca.EVEN is True
    _apply_program_splits(EngineConfig(attn_cluster_even=True))  # CPU: never
    assert ca.EVEN is False
    switch_wired("attn_cluster_even", "--attn-cluster-even", "attn_cluster_even", {"attn_cluster_even": True})


def test_engine_sets_the_cluster_push_switch_from_the_config(monkeypatch, field_wired):
    """EngineConfig.attn_cluster_push -> kernels/cluster_attention.py PUSH on CUDA only, ON by default since session
    49 (so a default CUDA engine pushes, and --no-attn-cluster-push turns it off); only a bool passes validation; in
    the loop's layout key, and its mechanism proposes turning it off first."""
    from specpilot.config import EngineConfig
    from specpilot.engine import _apply_program_splits
    from specpilot.errors import ConfigError
    from specpilot.kernels import cluster_attention as ca
    from specpilot.loop.registry import REGISTRY

    assert EngineConfig().attn_cluster_push is True
    monkeypatch.setattr(ca, "PUSH", False)
    _apply_program_splits(EngineConfig(device="cuda"))
    assert ca.PUSH is True
    _apply_program_splits(EngineConfig(device="cuda", attn_cluster_push=False))
    assert ca.PUSH is False
    monkeypatch.setattr(ca, "PUSH", True)
    _apply_program_splits(EngineConfig())  # CPU: never
    assert ca.PUSH is False
    with pytest.raises(ConfigError, match="attn_cluster_push must be true or false"):
        EngineConfig(attn_cluster_push="yes")
    gpu = field_wired("attn_cluster_push", ["--no-attn-cluster-push"], False, "attn_cluster_push",
                      {"attn_cluster_push": False})
    first = REGISTRY["attn_cluster_push"].candidates(gpu.config, gpu)[0]
    assert first == {"attn_cluster_push": False}


def test_engine_sets_the_attention_stages_from_the_config(monkeypatch, field_wired):
    """EngineConfig.attn_stages -> decode_attention.ONE_LAUNCH_STAGES on CUDA only (0: Triton's default); only 0-4
    pass validation; a CLI flag; in the loop's layout key and searched by its mechanism; and the one-launch call
    hands it to its kernel as num_stages (the same numbers: the interpreter ignores it)."""
    import torch

    from specpilot.config import EngineConfig
    from specpilot.engine import _apply_program_splits
    from specpilot.errors import ConfigError
    from specpilot.kernels import decode_attention as da

    monkeypatch.setattr(da, "ONE_LAUNCH_STAGES", 0)
    assert EngineConfig().attn_stages == 0
    _apply_program_splits(EngineConfig(device="cuda", attn_stages=2))
    assert da.ONE_LAUNCH_STAGES == 2
    _apply_program_splits(EngineConfig(attn_stages=2))  # CPU: never
    assert da.ONE_LAUNCH_STAGES == 0
    for bad in (5, -1, True, "2"):
        with pytest.raises(ConfigError, match="attn_stages must be 0"):
            EngineConfig(attn_stages=bad)
    field_wired("attn_stages", ["--attn-stages", "2"], 2, "attn_stages", {"attn_stages": 2})
    if da.triton is not None:
        q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
        pos = torch.tensor([[40]])
        want = da.decode_attention(q, k, v, pos, split_s=16, block_s=16, one_launch=True)
        monkeypatch.setattr(da, "ONE_LAUNCH_STAGES", 2)
        got = da.decode_attention(q, k, v, pos, split_s=16, block_s=16, one_launch=True)
        assert torch.equal(got, want)
