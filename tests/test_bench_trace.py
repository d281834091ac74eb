"""sparkdecode.bench.trace: kernel rows from a trace, cut into layers, and read back from
scripts/profile-step's listing (on the CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkdecode.bench import trace

CUTE = "kernel_cutlass_kernel_sparkdecode_cutegemv_tmaTmaGemv_object_at__CopyAtom_ThrID10_TVLayout"
FA2 = "void flashinfer::BatchPrefillWithPagedKVCacheKernel<true, flashinfer::KernelTraits<(flashi"
RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def test_rows_time_added_after_the_kernels_before():
    # b starts inside a and ends after it; c lies inside b; d starts after a gap
    spans = [(10.0, 15.0, "b"), (0.0, 12.0, "a"), (11.0, 13.0, "c"), (20.0, 21.0, "d")]
    got = trace.rows(spans)
    assert [r.name for r in got] == ["a", "b", "c", "d"]
    assert [r.start_us for r in got] == [0.0, 10.0, 11.0, 20.0]
    assert [r.duration_us for r in got] == [12.0, 5.0, 2.0, 1.0]
    assert [r.after_us for r in got] == [12.0, 3.0, 0.0, 6.0]
    assert trace.rows([]) == []


def test_short_names():
    assert trace.short(CUTE) == "cute:gemv_tmaTmaGemv"
    assert trace.short(FA2) == "flashinfer::BatchPrefillWithPagedKVCacheKernel"
    assert trace.short("boundary_kernel") == "boundary_kernel"
    assert trace.short("void at::native::elementwise_kernel<128, 4>(int)") == "at::native::elementwise_kernel"


def test_by_layer_cuts_at_the_marker_and_numbers_repeats():
    names = ["x", "qkv_front_kernel", CUTE, "boundary_kernel", CUTE, "qkv_front_kernel", CUTE, "qkv_front_kernel"]
    kernel_rows = [trace.KernelRow(10.0 * i, 5.0, 1.0 + i, n) for i, n in enumerate(names)]
    layers = trace.by_layer(kernel_rows, "qkv_front")
    assert [layer.period_us for layer in layers] == [40.0, 20.0]
    assert layers[0].kernels == [
        ("qkv_front_kernel", 2.0),
        ("cute:gemv_tmaTmaGemv", 3.0),
        ("boundary_kernel", 4.0),
        ("cute:gemv_tmaTmaGemv#2", 5.0),
    ]
    assert layers[1].kernels == [("qkv_front_kernel", 6.0), ("cute:gemv_tmaTmaGemv", 7.0)]
    assert trace.by_layer(kernel_rows, "no such kernel") == []
    line = trace.format_layers(layers[1:])
    assert line == "   20.0 us: qkv_front_kernel=6.0 cute:gemv_tmaTmaGemv=7.0"


def test_windows_time_each_kernel_from_the_anchor_end():
    names = ["qkv_front_kernel", "boundary_kernel", CUTE, "routing_kernel", "boundary_kernel", "qkv_front_kernel"]
    starts = [0.0, 10.0, 12.0, 30.0, 40.0, 50.0]
    kernel_rows = [trace.KernelRow(t, 4.0, 0.0, n) for t, n in zip(starts, names)]
    (seg,) = trace.windows(kernel_rows, "qkv_front", "boundary_kernel")
    assert seg == [
        ("qkv_front_kernel", -14.0, -10.0),
        ("boundary_kernel", -4.0, 0.0),
        ("cute:gemv_tmaTmaGemv", -2.0, 2.0),
        ("routing_kernel", 16.0, 20.0),
        ("boundary_kernel#2", 26.0, 30.0),
    ]
    assert trace.windows(kernel_rows, "qkv_front", "boundary_kernel#2")[0][1] == ("boundary_kernel", -34.0, -30.0)
    assert trace.windows(kernel_rows, "qkv_front", "tail_kernel") == []
    assert trace.format_windows([seg[:2]]) == "qkv_front_kernel=-14.0..-10.0 boundary_kernel=-4.0..0.0"


def test_parse_reads_the_listing_back():
    kernel_rows = trace.rows([(0.0, 2.5, "qkv_front_kernel"), (1.0, 9.0, FA2), (8.5, 12.0, CUTE)])
    listing = "\n".join(
        ["step: median 1.0 us", trace.HEADER]
        + [trace.format_row(k) for k in kernel_rows]
        + ["", "by layer (cut at qkv_front): ..."]
    )
    assert trace.parse(listing) == kernel_rows
    with pytest.raises(ValueError, match="header"):
        trace.parse("step: median 1.0 us\n")


def test_parse_a_saved_profile():
    """A listing kept in bench/results (bench/NOTES.md v12's fa2 column) read back: four
    whole NVFP4 layers, 16 kernels each, the first 153.1 us."""
    log = RESULTS / "profile-step-L6-fa2_20261202T0007_7d68b94.log"
    layers = trace.by_layer(trace.parse(log.read_text()), "qkv_front")
    assert len(layers) == 4 and all(len(layer.kernels) == 16 for layer in layers)
    assert layers[0].period_us == pytest.approx(153.1)
    assert dict(layers[1].kernels)["experts_up_kernel"] == pytest.approx(45.0)


def test_profile_step_from_log():
    """scripts/profile-step --from-log: the per-layer lines of a saved listing, no GPU."""
    import subprocess
    import sys

    script = RESULTS.parents[1] / "scripts" / "profile-step"
    log = RESULTS / "profile-step-L6-fa2_20261202T0007_7d68b94.log"
    out = subprocess.run(
        [sys.executable, str(script), "--from-log", str(log), "--by-layer", "qkv_front"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(out) == 4 and out[0].startswith("  153.1 us: qkv_front_kernel=0.9 ")
