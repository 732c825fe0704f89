"""Per-program timelines (kernels/trace.py) and their analysis (scripts/gpu_step_trace.py): the regions' bookkeeping,
the kernels compiled with and without TRACE for sm_90, and the boundary arithmetic on synthetic timelines."""

import sys
from pathlib import Path

import pytest
import torch

from specpilot.kernels import trace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import gpu_step_trace as gst  # noqa: E402


@pytest.fixture
def cpu_trace(monkeypatch):
    """trace.py switched on over a small CPU buffer (enable() itself only takes CUDA devices)."""
    monkeypatch.setattr(trace, "_buf", torch.zeros(3, 4, trace.ROW, dtype=torch.int64))
    monkeypatch.setattr(trace, "_launches", [])
    monkeypatch.setattr(trace, "_on", True)
    return trace._buf


def test_off_gives_the_same_dummy_and_records_nothing(monkeypatch):
    monkeypatch.setattr(trace, "_on", False)
    monkeypatch.setattr(trace, "_launches", [])
    called = []
    a = trace.launch_args(torch.device("cpu"), lambda *x: called.append(x) or "never")
    b = trace.launch_args(torch.device("cpu"), "gemv")
    assert a["TRACE"] is False and b["TRACE"] is False
    assert a["tr_ptr"] is b["tr_ptr"] and a["tr_ptr"].dtype == torch.int64 and a["tr_ptr"].numel() == 1
    assert called == [] and trace._launches == []  # the name is not even formatted


def test_regions_in_launch_order_wrap_and_read(cpu_trace):
    regions = [trace.launch_args(torch.device("cpu"), "k{}".format, i) for i in range(5)]  # 5 launches, 3 regions
    assert all(r["TRACE"] for r in regions)
    assert [r["tr_ptr"].data_ptr() for r in regions[3:]] == [regions[0]["tr_ptr"].data_ptr(),
                                                            regions[1]["tr_ptr"].data_ptr()]
    trace.clear()
    regions[4]["tr_ptr"][0] = torch.tensor([1, 2, 3, 4, 5, 1, 6, 7, 8])  # launch 4 (region 1): one program
    regions[2]["tr_ptr"][1, 3] = 9  # launch 2 (region 2): program 1 only
    got = trace.read()
    assert [(g["index"], g["name"]) for g in got] == [(2, "k2"), (4, "k4")]
    assert got[1]["rows"] == [[1, 2, 3, 4, 5, 1, 6, 7, 8]] and len(got[0]["rows"]) == 1
    trace.clear()
    assert trace.read() == []


def test_enable_refuses_cpu_and_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        trace.enable("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="interpreter"):
        trace.enable("cuda")


def test_compiled_trace_reads_the_timers_around_the_wait_and_only_when_on(sm90_report):
    """tests/trace_ptx.py: with TRACE off no timer read and no 64-bit store is compiled (the kernels' own stores
    are 16/32-bit); on: four global-timer reads (start before the PDL wait, the next right after it, then the
    loop's end and the program's end; the attention a fifth, its slice's sums, between the wait's and the
    published partial's), two %clock64 reads, one %smid, the row's nine 64-bit stores."""
    report = sm90_report("trace_ptx.py")
    assert set(report) == {"gemv_norm_silu_mul_late", "gemv_residual_l2_next_late", "qkv_rope_late",
                           "qkv_rope_qk_norm_late", "attention_one_launch_early_pos"}
    for name, case in report.items():
        off, on = case["off"], case["on"]
        assert off["globaltimer"] == [] and off["clock64"] == off["smid"] == off["stores_b64"] == 0, name
        t = on["globaltimer"]
        assert len(t) == (5 if name.startswith("attention") else 4), (name, on)
        assert t[0] < on["wait"] < t[1] and t == sorted(t), (name, on)
        assert on["clock64"] == 2 and on["smid"] == 1 and on["stores_b64"] == 9, (name, on)


def _row(start, waited, end, looped=None, sm=0, tag=1, cw=0, ce=None, summed=None):
    looped = waited if looped is None else looped
    return [start, waited, looped, end, sm, tag, cw, (end - waited) * 2 if ce is None else ce,
            looped if summed is None else summed]


def _layer(t, layer):
    """One synthetic layer of five launches from time t (ns): each launch 2 programs on 2 SMs; returns (launches,
    end). The attention's first program passes its wait 1000 ns after qkv's last end, and so on."""
    out = []
    for j, name in enumerate(["qkv_rope N=8 K=4", "attention Hkv=1 splits=2", "gemv N=4 K=4 res",
                              "gemv N=4 K=4 norm silu_mul", "gemv N=4 K=8 res"]):
        release, run = 1000 * (j + 1), 3000
        w0 = t + release
        rows = [_row(t - 500, w0, w0 + run - 1000, sm=0), _row(t - 400, w0 + 200, w0 + run, sm=1)]
        out.append({"index": layer * 5 + j, "name": name, "rows": rows})
        t = w0 + run
    return out, t


def test_boundaries_and_summary_on_a_synthetic_step():
    launches, t = [], 10_000
    for layer in range(3):
        ls, t = _layer(t, layer)
        launches += ls
    launches.append({"index": 15, "name": "gemv N=16 K=4 norm", "rows": [_row(t - 100, t + 700, t + 5700)]})
    b = gst.boundaries(launches)
    assert "release" not in b[0]
    att = b[1]
    assert att["release"] == pytest.approx(2.0) and att["run"] == pytest.approx(3.0)
    assert att["share"] == pytest.approx(5.0) and att["lead"] == pytest.approx(-0.5)
    assert att["spread"] == pytest.approx(0.2) and att["tail"] == pytest.approx(0.5)
    assert att["programs"] == 2 and att["sms"] == 2
    assert att["busy_us"] == pytest.approx(2.4) and att["busy_cycles"] == pytest.approx(4800)
    assert att["att_working"] == 2 and att["att_publish_us"] == pytest.approx(0.0)  # looped = waited here
    assert "att_publish_us" not in b[0] and "att_publish_us" not in b[2]  # the attention's alone
    s = gst.summarize([b, b], 3, {"qkv": 1.0, "o_proj": 0.5, "lm_head": 2.0})
    assert s["offset"] == 0 and s["launches"] == 16
    pl = s["per_layer"]
    assert list(pl) == list(gst.LAYER)
    assert pl["qkv"]["release"] == pytest.approx(1.0)  # layers 1 and 2 (the first qkv has nothing ahead)
    assert pl["down"]["release"] == pytest.approx(5.0) and pl["down"]["share"] == pytest.approx(8.0)
    assert pl["qkv"]["floor_us"] == 1.0 and "floor_us" not in pl["attention"]
    assert s["layer_sum"] == {"release": 15.0, "run": 15.0, "share": 30.0, "floor_us": 1.5}
    (head,) = s["outside_layers"].values()
    assert head["release"] == pytest.approx(0.7) and head["run"] == pytest.approx(5.0) and head["floor_us"] == 2.0
    assert s["traced_span_us"] == pytest.approx((t + 5700 - 9500) / 1e3, abs=0.01)
    with pytest.raises(ValueError, match="different launch"):
        gst.summarize([b, b[:-1]], 3)


def test_attention_chain_splits_publish_and_merge():
    rows = [_row(0, 1000, 1500, tag=0), _row(0, 1000, 5000, looped=4000, summed=2000),
            _row(0, 1200, 9000, looped=5200, summed=3200, tag=2)]
    c = gst.attention_chain(rows)
    assert c == {"att_publish_us": pytest.approx(3.5), "att_slice_us": pytest.approx(1.5),
                 "att_store_us": pytest.approx(2.0), "att_merge_us": pytest.approx(3.8), "att_working": 2}
    assert gst.attention_chain([_row(0, 1000, 1500, tag=0)]) == {}


def test_layer_offset_needs_the_five_launch_layer():
    layer = ["qkv_rope a", "attention b", "gemv c", "gemv d", "gemv e"]
    assert gst.layer_offset(["x"] + layer * 4 + ["head"], 4) == 1
    with pytest.raises(ValueError, match="repeats"):
        gst.layer_offset(layer * 3 + ["head"], 4)
    with pytest.raises(ValueError, match="repeats"):  # a layout without the attention second
        gst.layer_offset(["qkv_rope a", "rope", "attention", "gemv", "gemv", "gemv"] * 2, 2)


def test_timer_granularity_and_sm_clock():
    rows = [_row(0, 32, 3032), _row(64, 96, 4096, cw=10, ce=10 + 4000 * 2)]
    assert gst.timer_granularity_ns([rows]) == 32
    assert gst.timer_granularity_ns([[_row(5, 5, 5, looped=5)]]) == 0
    assert gst.sm_ghz([rows]) == pytest.approx(2.0)
    assert gst.sm_ghz([[_row(0, 10, 20)]]) != gst.sm_ghz([[_row(0, 10, 20)]])  # nan: no program busy >= 2 us


def test_parse_arguments():
    assert gst.parse([]) == (["qwen2.5-1.5b", "qwen3-8b"], {}, 5)
    shapes, fields, replays = gst.parse(["qwen3-8b", "--config=tuned_tiles=true,attn_merge_chunk=8", "--replays=2"])
    assert shapes == ["qwen3-8b"] and fields == {"tuned_tiles": True, "attn_merge_chunk": 8} and replays == 2
    with pytest.raises(SystemExit):
        gst.parse(["--replays=0"])
    with pytest.raises(SystemExit):
        gst.parse(["--bogus"])
    with pytest.raises(ValueError):
        gst.parse(["--config=no_such_field=1"])
