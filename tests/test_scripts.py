"""The GPU scripts' parts a CPU can check, so that a script breaks here and not on the GPU
box: scripts/experts-bounds' source patches still find their places in the experts kernels
and the patched kernels build spill-free, scripts/read-pattern's synthetic kernels
build in every configuration it runs (NVRTC for sm_90a; skipped without NVRTC),
scripts/step-compare runs the bench once a layout (the tiny config, on the CPU),
scripts/gpu-check keeps its limits and deadline, scripts/ncu-sass-mix reads an
Nsight Compute source page, scripts/multi-gpu refuses what a machine cannot run, and the
--watch parts of scripts/read-pattern and scripts/experts-bounds run over a stand-in
nvidia-smi."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import inspect
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from ptxas_check import blocks_per_sm, kernel_usage

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/``name`` (no .py suffix) as a module, its main() not run."""
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), str(SCRIPTS / name))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def nvrtc_or_skip():
    from sparkdecode_cuda import nvrtc

    reason = nvrtc.nvrtc_unavailable()
    if reason is not None:
        pytest.skip(f"NVRTC: {reason}")
    return nvrtc


@pytest.mark.parametrize(
    "patch,defines",
    [
        ("patch_decode", {"EXPERTS_NO_DECODE": 1}),
        ("patch_tail", {"EXPERTS_NO_TAIL": 1}),
        ("patch_packed_loads", {"EXPERTS_PACKED_LOADS": 1}),
        ("patch_packed_loads", {"EXPERTS_PACKED_LOADS": 2}),
    ],
)
def test_experts_bounds_patches_build(monkeypatch, patch, defines):
    """Each patch applies to today's experts.cu / experts_common.cuh (it raises where its
    anchor text is gone), and _half4_early's kernels build under it without spills, as the
    script measures them."""
    nvrtc = nvrtc_or_skip()
    from sparkdecode_cuda import experts as experts_mod

    monkeypatch.setattr(nvrtc, "source", nvrtc.source)  # restored after the test
    script = load_script("experts-bounds")
    before = {name: nvrtc.source(name) for name in ("experts.cu", "experts_common.cuh")}
    getattr(script, patch)()
    after = {name: nvrtc.source(name) for name in before}
    assert after != before
    cls = experts_mod.CudaExpertsNvfp4MarlinV3Half4Early
    usage = kernel_usage(
        experts_mod.SOURCE, {**cls.kernel_defines(4096, 512, 8), **defines}, experts_mod.COMPILE_OPTIONS
    )
    assert set(usage) >= {"experts_up_kernel", "experts_down_kernel"}
    assert all(u.spills == 0 and u.stack == 0 for u in usage.values()), usage


def test_experts_bounds_no_tail_keeps_the_mmas(monkeypatch):
    """``--no-tail``'s down kernel (the registered pin's defines): its MMAs all stay (their
    sums are kept live), its item tails' K reduction and stores go (what is left: one
    guarded store, and the zeros of a launch that holds no expert), and the up kernel is
    unchanged."""
    nvrtc = nvrtc_or_skip()
    from ptxas_check import kernel_ptx, ptx_entry

    from sparkdecode_cuda import experts as experts_mod

    defines = experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpare.kernel_defines(4096, 512, 8)
    options = experts_mod.COMPILE_OPTIONS
    plain = kernel_ptx(experts_mod.SOURCE, defines, options)
    monkeypatch.setattr(nvrtc, "source", nvrtc.source)  # restored after the test
    load_script("experts-bounds").patch_tail()
    bound = kernel_ptx(experts_mod.SOURCE, {**defines, "EXPERTS_NO_TAIL": 1}, options)
    assert ptx_entry(bound, "experts_up_kernel") == ptx_entry(plain, "experts_up_kernel")
    down, down_plain = ptx_entry(bound, "experts_down_kernel"), ptx_entry(plain, "experts_down_kernel")
    assert down.count("mma.sync") == down_plain.count("mma.sync") > 0
    assert down.count("st.global") < down_plain.count("st.global")
    assert down.count("st.shared") < down_plain.count("st.shared")


@pytest.mark.parametrize("blocks", [3, 5])
def test_experts_bounds_down_blocks_build(blocks):
    """``--down-blocks``' variant of the pinned Marlin kernel: the define and the grid's
    blocks an SM at the count asked, and its down kernel built there without spills and
    fitting (48 registers at 5)."""
    script = load_script("experts-bounds")
    from sparkdecode_cuda import experts as experts_mod

    cls = experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpare
    variant = script.with_down_blocks(cls, blocks)
    assert variant.down_blocks == blocks and variant.name != cls.name
    defines = variant.kernel_defines(4096, 512, 8)
    assert defines == {**cls.kernel_defines(4096, 512, 8), "EXPERTS_DOWN_BLOCKS": blocks}
    nvrtc_or_skip()
    usage = kernel_usage(experts_mod.SOURCE, defines, experts_mod.COMPILE_OPTIONS)["experts_down_kernel"]
    assert usage.spills == 0 and usage.stack == 0, usage
    assert blocks_per_sm(usage.registers) >= blocks, usage


def test_experts_bounds_down_blocks_refuses_bad_counts():
    """``--down-blocks`` takes counts 1 to 8, comma-separated; anything else is refused by name."""
    script = load_script("experts-bounds")
    assert script.down_block_counts("") == [] and script.down_block_counts("3,5") == [3, 5]
    for bad in ("0", "9", "3;5", "x"):
        with pytest.raises(SystemExit, match="--down-blocks"):
            script.down_block_counts(bad)


def test_experts_bounds_patch_refuses_a_moved_anchor(monkeypatch):
    """A patch whose anchor is not in the source raises rather than measuring the unpatched
    kernels under the patched name."""
    nvrtc = nvrtc_or_skip()
    original = nvrtc.source
    monkeypatch.setattr(nvrtc, "source", lambda name: original(name).replace("xp += SB * 8;", "xp += 8 * SB;"))
    load_script("experts-bounds").patch_packed_loads()
    with pytest.raises(RuntimeError, match="not where the patch expects it"):
        nvrtc.source("experts.cu")


def compiles(text: str, defines: dict[str, int]) -> str | None:
    """NVRTC's error when ``text`` fails to build for sm_90a under ``defines``, else None."""
    from sparkdecode_cuda import nvrtc

    opts = ["--gpu-architecture=sm_90a", *(f"-D{k}={v}" for k, v in defines.items())]
    try:
        nvrtc._compile("k.cu", text, {}, opts)
    except nvrtc.CompileError as e:
        return str(e)
    return None


def test_read_pattern_kernels_build():
    """Every configuration of every mode of scripts/read-pattern builds."""
    nvrtc_or_skip()
    script = load_script("read-pattern")
    failures = []
    builds = [
        (script.PATTERN, script.pattern_defines(c))
        for c in script.CONFIGS + script.PACKED_CONFIGS + script.ROTATED_CONFIGS + script.KROWS_CONFIGS
    ]
    builds += [
        (script.SPECIALIZED, script.specialized_defines(c)) for c in script.SPECIALIZED_CONFIGS + script.OWN_CONFIGS
    ]
    builds += [(script.BOXES, script.boxes_defines(c)) for c in script.BOXES_CONFIGS]
    builds += [(script.DOWN, script.down_defines(c)) for c in script.DOWN_CONFIGS]
    builds.append((script.AHEAD, {}))
    builds += [(script.AHEAD_LOADS, {"DEPTH": depth}) for _, depth in script.AHEAD_RATE_CONFIGS]
    builds.append((script.STREAM, {}))
    for text, defines in builds:
        if (log := compiles(text, defines)) is not None:
            failures.append((defines, log))
    assert not failures, failures[:2]


def test_step_compare_runs_each_layout(tmp_path):
    """scripts/step-compare on the CPU with the tiny config: a bench run a NAME=ARGS pair,
    each run's layout and rows printed, a record and a log a run; a failing run (a pin to
    no provider) sets the exit status and shows its log's end."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("OUT", None)
    run = subprocess.run(
        [
            str(SCRIPTS / "step-compare"),
            "-c",
            "tiny --replays 2 --context 1024",
            "-o",
            str(tmp_path),
            "plain=",
            "ref=--pin attention=reference.attention",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("== ")] == ["plain", "ref"]
    layouts = [line for line in lines if line.startswith("executor layout")]
    assert len(layouts) == 2 and "attention=reference.attention (pinned)" in layouts[1]
    assert sum(line.split()[0] == "1024" for line in lines) == 4  # random and correlated, a run each
    assert len(list((tmp_path / "results").glob("tiny_*.json"))) == 2
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["step-plain.log", "step-ref.log"]
    bad = subprocess.run(
        [str(SCRIPTS / "step-compare"), "-c", "tiny --replays 2", "-o", str(tmp_path), "bad=--pin attention=nope.x"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert bad.returncode == 1 and "== bad rc=" in bad.stdout and "nope.x" in bad.stdout


def test_gpu_check_limits_and_deadline(tmp_path):
    """scripts/gpu-check on two test files of the gpu marker (they need no GPU): a file past
    its -t limit is named as cut; with -d, a file whose share of the deadline is too small
    is listed as not run, and either sets the exit status."""
    import os
    import subprocess
    import sys

    (tmp_path / "test_gpu_quick.py").write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_quick():\n    pass\n")
    (tmp_path / "test_gpu_slow.py").write_text(
        "import time\n\nimport pytest\n\n\n@pytest.mark.gpu\ndef test_slow():\n    time.sleep(60)\n"
    )
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "GPU_CHECK_LOGS": str(tmp_path / "logs"),
        "MIN_SECONDS": "3",
    }

    def check(*args: str) -> subprocess.CompletedProcess:
        files = [str(tmp_path / "test_gpu_quick.py"), str(tmp_path / "test_gpu_slow.py")]
        return subprocess.run(
            [str(SCRIPTS / "gpu-check"), *args, *files],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )

    cut = check("-t", "15")
    lines = cut.stdout.splitlines()
    assert cut.returncode == 1, cut.stdout + cut.stderr
    assert lines[0].startswith("== test_gpu_quick rc=0 ") and "1 passed" in lines[0]
    assert lines[1].startswith("== test_gpu_slow rc=124 ") and "(cut by its 15s limit)" in lines[1]
    late = check("-t", "60", "-d", "6")
    lines = late.stdout.splitlines()
    assert late.returncode == 1, late.stdout + late.stderr
    assert lines[0].startswith("== test_gpu_quick rc=0 ")
    if "not run" in lines[1]:  # the quick file took more than 3 s of the 6
        assert lines[1].startswith("== test_gpu_slow not run: ")
    else:  # it started with what was left of the deadline, not its 60 s
        assert lines[1].startswith("== test_gpu_slow rc=124 ") and "(cut by its " in lines[1], lines[1]
        assert int(lines[1].split("cut by its ")[1].split("s")[0]) <= 6


def test_pytest_part_covers_each_test_once():
    """scripts/pytest_part.py: the N parts of any count are contiguous, cover every item
    once, and differ in size by at most one; a malformed or out-of-range part is refused."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import pytest_part
    finally:
        sys.path.remove(str(SCRIPTS))
    for count in (0, 1, 5, 215):
        for n in (1, 2, 3, 7):
            parts = [list(range(count))[pytest_part.part_slice(count, i, n)] for i in range(1, n + 1)]
            assert sum(parts, []) == list(range(count))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert pytest_part.parse_part("2/3") == (2, 3)
    for bad in ("0/2", "3/2", "1", "a/b", "1/2/3"):
        with pytest.raises(ValueError, match="expected I/N"):
            pytest_part.parse_part(bad)


def test_gpu_check_parts(tmp_path):
    """scripts/gpu-check -p I/N: each part runs its share of a file's tests (after -k), the
    parts together run each test once, each part has its own log, and a bad part is refused."""
    import os
    import subprocess

    (tmp_path / "test_gpu_five.py").write_text(
        "import pytest\n\n\n@pytest.mark.gpu\n@pytest.mark.parametrize('i', range(5))\n"
        "def test_five(i):\n    print(f'ran {i}')\n"
    )
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "GPU_CHECK_LOGS": str(tmp_path / "logs"),
    }

    def check(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(SCRIPTS / "gpu-check"), *args, str(tmp_path / "test_gpu_five.py")],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )

    first, second = check("-p", "1/2"), check("-p", "2/2")
    assert first.returncode == 0 and second.returncode == 0, first.stdout + second.stdout
    assert first.stdout.startswith("== test_gpu_five-part1of2 rc=0 ") and "2 passed, 3 deselected" in first.stdout
    assert second.stdout.startswith("== test_gpu_five-part2of2 rc=0 ") and "3 passed, 2 deselected" in second.stdout
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["test_gpu_five-part1of2.log", "test_gpu_five-part2of2.log"]
    narrowed = check("-k", "not 0", "-p", "2/2")
    assert "2 passed, 3 deselected" in narrowed.stdout, narrowed.stdout
    bad = check("-p", "3/2")
    assert bad.returncode == 2 and "expected I/N" in bad.stderr


def test_ncu_sass_mix_counts_a_page():
    """scripts/ncu-sass-mix on a small source page: the instructions an HMMA, the stall
    shares, the lines grouped by times run; a page without the counters is refused."""
    mix = load_script("ncu-sass-mix")
    header = ['"Address"', '"Source"', f'"{mix.SAMPLES}"', f'"{mix.EXECUTED}"', '"stall_long_sb"', '"stall_math"']
    body = [
        ["0x10", "@P0 LDG.E.128 R8, desc[UR4][R2.64]", "2", "100", "0", "2"],
        ["0x20", "LOP3.LUT R1, R8, 0x81c081c0, RZ, 0xc0, !PT", "6", "100", "6", "0"],
        ["0x30", "HMMA.16816.F32.BF16 R4, R1, R2, R4", "2", "100", "1", "1"],
        ["0x40", "BRA 0x10", "0", "10", "0", "0"],
    ]
    page = '"Kernel Name","k",\n' + ",".join(header) + "\n" + "\n".join(",".join(f'"{v}"' for v in r) for r in body)
    lines = mix.read_page(page)
    assert [line.opcode for line in lines] == ["LDG", "LOP3", "HMMA", "BRA"]
    out = "\n".join(mix.report(lines))
    assert "310 warp instructions executed, 10 samples" in out
    assert "3.1 instructions a HMMA" in out
    assert "long_sb 70.0%, math 30.0%" in out
    assert "x100: 3 lines, 96.8% of the instructions, 100.0% of the samples, 3.0 a HMMA" in out
    assert "global L2 sectors" not in out  # no source counters on this page
    with pytest.raises(ValueError, match="Address"):
        mix.read_page('"Kernel Name","k",\n"a","b"\n')


def test_ncu_sass_mix_counts_excessive_sectors():
    """With the source counters' sector columns, ncu-sass-mix totals the global accesses'
    L2 sectors and lists the lines whose sectors go beyond the bytes used, most first."""
    mix = load_script("ncu-sass-mix")
    header = ["Address", "Source", mix.SAMPLES, mix.EXECUTED, mix.SECTORS, mix.EXCESSIVE]
    body = [
        ["0x10", "LDG.E.128.CONSTANT R12, desc[UR10][R60.64]", "1", "100", "1,600", "0"],
        ["0x20", "@!P2 LDG.E.CONSTANT R2, desc[UR10][R56.64]", "1", "100", "800", "400"],
        ["0x30", "HMMA.16816.F32.BF16 R4, R12, R2, R4", "1", "100", "", ""],
    ]
    page = "\n".join(",".join(f'"{v}"' for v in r) for r in [header, *body])
    lines = mix.read_page(page)
    assert [(line.sectors, line.excessive) for line in lines] == [(1600, 0), (800, 400), (0, 0)]
    out = mix.report(lines)
    i = out.index("global L2 sectors: 2400, 400 (16.7%) beyond the bytes used")
    assert out[i + 1].split()[:3] == ["400", "of", "800"] and "LDG.E.CONSTANT R2" in out[i + 1]
    assert len(out) == i + 2  # lines without excess are not listed


def test_layouts_pin_registered_providers():
    """scripts/layouts.sh's ALLPINS names, for every kind, a provider registered for it."""
    import shlex
    import subprocess

    from sparkdecode.plugins import discover

    out = subprocess.run(
        ["bash", "-c", f"source {SCRIPTS / 'layouts.sh'}; echo $ALLPINS"], capture_output=True, text=True, check=True
    ).stdout
    words = shlex.split(out)
    pins = dict(w.split("=", 1) for flag, w in zip(words[::2], words[1::2]) if flag == "--pin")
    assert len(pins) == 10, pins
    registry = discover()
    for kind, name in pins.items():
        found = registry.find(name)
        assert found is not None and found.block == kind, (kind, name)


def test_experts_trace_summarizes_blocks_by_sm():
    """experts-trace's summary of a made-up trace: 4 blocks on 2 SMs (3 on SM 7, 1 on SM 9),
    times in ns: the span, each SM's last end and the tail, the busy share, the items an SM,
    the median item time, the last item start and the slowest SM's last item, from the rows
    as experts.cu's EXPERTS_TRACE writes them."""
    trace_mod = load_script("experts-trace")
    stride = trace_mod.TRACE_STRIDE

    def row(sm: int, start: int, end: int, items: list[int]) -> list[int]:
        r = [0] * stride
        r[0], r[1], r[2] = (len(items) << 32) | sm, start, end
        r[3 : 3 + len(items)] = items
        return r

    trace = [
        row(7, 1000, 5000, [1000, 3000]),  # items of 2 and 2 us
        row(9, 1000, 9000, [1000, 5000]),  # 4 and 4 us: SM 9 ends last
        row(7, 2000, 4000, [2000]),  # 2 us
        row(7, 2000, 2000, []),  # no item
    ]
    s = trace_mod.summarize(trace)
    assert s["span_us"] == 8.0 and s["start_spread_us"] == 1.0 and s["sms"] == 2
    assert (s["sm_end_median_us"], s["sm_end_max_us"], s["tail_us"]) == (6.0, 8.0, 2.0)
    assert s["busy"] == (4000 + 8000) / (2 * 8000)
    assert (s["blocks_per_sm_min"], s["blocks_per_sm_max"]) == (1, 3)
    assert (s["items_per_sm_min"], s["items_per_sm_median"], s["items_per_sm_max"]) == (2, 2.5, 3)
    assert s["first_132_max_a_sm"] == 3 and s["item_median_us"] == 2.0
    assert s["t0_ns"] == 1000 and s["first_item_ns"] == 1000 and s["end_ns"] == 9000
    # the last item starts at 5000 ns (SM 9's second), which is also the slowest SM's last
    assert s["last_item_start_us"] == 4.0
    assert (s["slowest_last_item_start_us"], s["slowest_last_item_us"]) == (4.0, 4.0)
    # a slow SM: its last item started before the last claim (SM 2's) and ran 7 us
    s2 = trace_mod.summarize([row(1, 0, 10000, [0, 3000]), row(2, 0, 6000, [0, 5000])])
    assert s2["last_item_start_us"] == 5.0
    assert (s2["slowest_last_item_start_us"], s2["slowest_last_item_us"]) == (3.0, 7.0)
    with pytest.raises(ValueError, match="no end time"):
        trace_mod.summarize([row(1, 5, 0, [])])
    assert "tail 2.0" in trace_mod.report("up", s)


def test_beside_trace_reads_records_and_sharing():
    """beside-trace's figures from made-up records (ns): the records' words as
    gemv_splitk's traced kernels write them, each kernel's spread and the SMs where two of
    its CTAs ran at once, and the pooler's CTAs by what shared their SM."""
    trace_mod = load_script("beside-trace")
    from sparkdecode_cute import gemv_splitk

    assert trace_mod.RECORD_WORDS == gemv_splitk.TRACE_WORDS

    def words(ctas: list[tuple[int, ...]], offset: int) -> list[int]:
        out = [0] * offset
        for sm, *times in ctas:
            out += [sm, 0]
            for t in times + [0] * (5 - len(times)):  # a TMA GEMV leaves the split-K's two times 0
                lo = t & 0xFFFFFFFF
                out += [lo - (1 << 32) if lo >= 1 << 31 else lo, t >> 32]  # int32 words, as read back
        return out

    big = (5 << 32) + 3_000_000_000  # both words used, the low one negative as int32
    pooler = [(1, big + 1000, big + 2000, big + 12000), (2, big + 9000, big + 9000, big + 19000)]
    router = [(2, big + 500, big + 2000, big + 9000), (2, big + 600, big + 2100, big + 8000), (3, big, big, big + 4000)]
    assert trace_mod.records(words(pooler, 8), 2, 8) == pooler
    with pytest.raises(ValueError, match="past the counters"):
        trace_mod.records(words(pooler, 8), 3, 8)
    with pytest.raises(ValueError, match="no end time"):
        trace_mod.records(words([(1, 5, 5, 0)], 0), 1, 0)
    s = trace_mod.summarize(pooler, router)
    assert (s["router"]["ctas"], s["router"]["sms"], s["router"]["sms_two"]) == (3, 2, 1)
    assert s["pooler"]["start"] == [1.0, 9.0] and s["router"]["end"] == [9.0, 8.0, 4.0]
    # SM 1 held no router CTA; SM 2's pooler CTA started as its router CTAs had ended
    assert (s["beside_at_start"], s["after_router"]) == (0, 1)
    assert s["run_shared"] == [] and s["run_alone"] == [10.0, 10.0]
    s2 = trace_mod.summarize([(2, big + 1000, big + 2000, big + 12000)], router)
    assert (s2["beside_at_start"], s2["after_router"], s2["run_shared"]) == (1, 0, [10.0])
    assert "1 of 1 started beside a router CTA" in trace_mod.report(s2)
    # With the o_proj: SM 1's pooler CTA started beside its o_proj CTA; SM 2's as the later
    # of its router CTAs ended; SM 3's router CTA started beside an o_proj CTA
    o_proj = [(1, big - 3000, big - 2000, big + 1500), (3, big - 3000, big - 2000, big + 500)]
    s3 = trace_mod.summarize(pooler, router, o_proj)
    assert (s3["router_beside_o_proj"], s3["pooler_beside_o_proj"]) == (1, 1)
    assert (s3["on_empty_sm"], s3["empty_gap"]) == (1, [0.0])
    assert s3["o_proj"]["end"] == [1.5, 0.5] and s3["pooler"] == s["pooler"]
    text = trace_mod.report(s3)
    assert "o_proj " in text and "1 pooler CTAs started on an SM no o_proj or router CTA held" in text
    # The split-K router's staging and product times, from release to end
    marked = [c + (c[2] + 1000, c[2] + 3000) for c in router]
    assert trace_mod.records(words(marked, 8), 3, 8) == router
    marks = trace_mod.phases(words(marked, 8), 3, 8)
    assert marks == [(c[2] + 1000, c[2] + 3000) for c in router]
    line = trace_mod.router_phases(router, marks)
    assert "release to x staged 1.0 / 1.0" in line and "x staged to products 2.0 / 2.0" in line
    assert "products to end 2.9 / 4.0" in line  # ends 7000, 5900 and 4000 ns after release
    with pytest.raises(ValueError, match="not a traced split-K"):
        trace_mod.phases(words(pooler, 8), 2, 8)


def test_beside_trace_forms_and_resources():
    """beside-trace's forms each change one or two things against ``base`` (the registered
    plan and order, the driver's carveout, the pooler's own ring, the router with PDL, the side
    stream), and an
    unknown form is refused before any GPU is asked for; a kernel not yet loaded has no
    resources to read."""
    import subprocess
    import sys

    trace_mod = load_script("beside-trace")
    base = trace_mod.FORMS["base"]
    assert (base.plan, base.pooler_first, base.carveout, base.pooler_stages, base.router_pdl) == (
        0,
        False,
        None,
        None,
        True,
    )
    assert base.serial is False
    for name, form in trace_mod.FORMS.items():
        changed = [f for f in base._fields if f != "what" and getattr(form, f) != getattr(base, f)]
        assert len(changed) <= 2 and (name == "base") == (not changed), (name, changed)
    assert trace_mod.FORMS["nopdl"].router_pdl is False and trace_mod.FORMS["smallc"].carveout == 100
    serial = {name for name, form in trace_mod.FORMS.items() if form.serial}
    assert serial == {"serial", "serialpf", "serialc", "serialown"} and trace_mod.FORMS["serialown"].plan is None
    assert trace_mod.kernel_resources(object(), 256, 1024) == "not loaded"
    # the DSL's loaded module holds its cubin's cudaLibrary_t in ``cuda_library`` (empty until loaded)
    executor = pytest.importorskip(
        "cutlass.cutlass_dsl.cuda_jit_executor", reason="nvidia-cutlass-dsl is not installed"
    )
    assert "cuda_library" in inspect.signature(executor.CudaDialectJitModule).parameters
    unloaded = SimpleNamespace(jit_module=SimpleNamespace(cuda_library=[]))
    assert trace_mod.kernel_resources(unloaded, 256, 1024) == "not loaded"
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "beside-trace"), "--forms", "base,nope"], capture_output=True, text=True
    )
    assert done.returncode == 2 and "unknown forms ['nope']" in done.stderr


def test_experts_trace_rows_are_the_kernels():
    """experts-trace reads rows of experts.cu's TRACE_STRIDE (its TRACE_ITEMS), and the
    registered Marlin providers' kernels (the queues' too) build with EXPERTS_TRACE."""
    import re

    from sparkdecode_cuda import experts as experts_mod

    trace_mod = load_script("experts-trace")
    nvrtc = nvrtc_or_skip()
    source = nvrtc.source(experts_mod.SOURCE)
    assert int(re.search(r"#define TRACE_ITEMS (\d+)", source).group(1)) == trace_mod.TRACE_ITEMS
    for cls in (
        experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUp,
        experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueue,
    ):
        defines = {**cls.kernel_defines(4096, 512, 8), "EXPERTS_TRACE": 1}
        assert nvrtc.compile_cubin(experts_mod.SOURCE, "sm_90a", defines, experts_mod.COMPILE_OPTIONS)


def test_multi_gpu_refuses_what_this_machine_cannot_run():
    """scripts/multi-gpu names what is missing before it runs anything: a TP size it does
    not serve, or fewer GPUs than the part needs (this machine has none visible)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(SCRIPTS / "multi-gpu"), *args], capture_output=True, text=True, env=env)

    for args, message in (
        ((), "usage:"),
        (("bench", "3"), "TP: 2, 4 or 8"),
        (("bench", "8"), "TP 8 needs 8 GPUs, 0 here"),
        (("check",), "needs 2 or more GPUs"),
        (("nope",), "usage:"),
    ):
        done = run(*args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)


def test_sass_loops_reads_opcodes():
    """sass-loops names an instruction by its opcode (for the counts) or with its modifiers
    (for ``--loads``), a predicate in front left out either way."""
    script = load_script("sass-loops")
    for ins, full, short in [
        ("LDG.E.NA.128.CONSTANT R24, desc[UR10][R60.64]", "LDG.E.NA.128.CONSTANT", "LDG"),
        ("@!P0 LDG.E.64.CONSTANT R4, desc[UR8][R40.64+0x1000]", "LDG.E.64.CONSTANT", "LDG"),
        ("@UP1 HMMA.16816.F32.BF16 R44, R16, R2, R44", "HMMA.16816.F32.BF16", "HMMA"),
    ]:
        assert script.full_opcode(ins) == full and script.opcode(ins) == short


class _FakeCuda:
    """The few cupy.cuda calls read-pattern's chain timing makes, each graph launch 1 ms
    (slept, so that a sustained phase lasts as long as it says)."""

    def __init__(self):
        self.launches = 0
        fake = self

        class Stream:
            def __init__(self, non_blocking=False):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def begin_capture(self):
                pass

            def end_capture(self):
                class Graph:
                    def launch(self, stream):
                        time.sleep(1e-3)
                        fake.launches += 1

                return Graph()

        class Event:
            def record(self, stream=None):
                self.at = fake.launches

            def synchronize(self):
                pass

        self.Stream, self.Event = Stream, Event

    def get_elapsed_time(self, start, end) -> float:
        return float(end.at - start.at)


def test_read_pattern_watch_sustains_each_graph(tmp_path, capsys):
    """read-pattern --watch: each chained graph then runs back to back inside a watched
    phase, graph after graph (a stand-in cupy and nvidia-smi)."""
    import types

    import numpy as np
    from fake_smi import fake_smi

    from sparkdecode.bench.clockwatch import ClockWatch

    script = load_script("read-pattern")
    cp = types.SimpleNamespace(cuda=_FakeCuda())
    with ClockWatch(interval_ms=10, smi=fake_smi(tmp_path)) as watch:
        script.WATCH[:] = [watch, 1.2]
        try:
            for _ in range(2):
                assert script.chain_seconds(cp, np, lambda s: None, sets=4) == pytest.approx(1e-3 / 4)
            script.sustained_energy(1e9)  # 1 GB a set of 0.25 ms: 4 TB/s at the stand-in's 698.5 W
        finally:
            script.WATCH[:] = []
    lines = [line for line in capsys.readouterr().out.splitlines() if "sustained" in line]
    assert len(lines) == 3 and all("power cap" in line for line in lines[:2])
    assert lines[2] == "  sustained  4.00 TB/s,  175 pJ/B"
    assert cp.cuda.launches == 2 * (25 + 1200)


def test_read_pattern_own_runs_its_forms_then_the_baselines(monkeypatch):
    """read-pattern --own: the own-copy forms through SPECIALIZED, then the every-lane
    baselines from KROWS_CONFIGS (half rows alone, items and half rows with work 96);
    with --config, that one form alone."""
    import argparse

    script = load_script("read-pattern")
    calls = []
    monkeypatch.setattr(script, "specialized", lambda cp, np, configs: calls.append(("own", configs)))
    monkeypatch.setattr(script, "pattern", lambda cp, np, configs: calls.append(("lanes", configs)))
    modes = dict.fromkeys(("fit", "ahead", "ahead_rate", "boxes", "specialized", "down"), False)
    script.run_mode(None, None, argparse.Namespace(**modes, own=True, config=None), script.OWN_CONFIGS)
    assert calls[0] == ("own", script.OWN_CONFIGS)
    assert all(c[4] in (0, 1) and c[6] == 1 for c in script.OWN_CONFIGS)  # Marlin's or stage layout, SELF 1
    kind, baselines = calls[1]
    assert kind == "lanes" and [(c[0], c[3], c[-1]) for c in baselines] == [(4, 0, 2), (4, 96, 0), (4, 96, 2)]
    calls.clear()
    script.run_mode(None, None, argparse.Namespace(**modes, own=True, config=1), script.OWN_CONFIGS[1:2])
    assert calls == [("own", script.OWN_CONFIGS[1:2])]


def test_read_pattern_watch_baselines_print_the_budget(tmp_path, capsys):
    """read-pattern --watch's baselines: the idle GPU, the 1 GiB copy's rate and energy a
    byte (also above idle), and the energy a byte above idle that 80% of the copy may spend
    at the power limit (a stand-in cupy, each copy 1 ms, and nvidia-smi)."""
    import types

    from fake_smi import fake_smi

    from sparkdecode.bench.clockwatch import ClockWatch

    script = load_script("read-pattern")
    cuda = _FakeCuda()

    def copyto(dst, src):
        time.sleep(1e-3)
        cuda.launches += 1

    gib = types.SimpleNamespace(nbytes=1 << 30)
    cp = types.SimpleNamespace(
        cuda=cuda, uint8="uint8", ones=lambda n, dtype: gib, empty_like=lambda a: gib, copyto=copyto
    )
    with ClockWatch(interval_ms=10, smi=fake_smi(tmp_path)) as watch:
        script.WATCH[:] = [watch, 1.3]
        try:
            script.watch_baselines(cp, 1.3)
        finally:
            script.WATCH[:] = []
    out = capsys.readouterr().out.splitlines()
    # 2 GiB moved a ms: 2.15 TB/s; the stand-in draws 698.5 W in every phase, idle too
    assert out[2] == "copy 1 GiB back to back: 2.15 TB/s (read + write),  325 pJ/B (   0 above idle)"
    assert out[4].startswith("at the 700 W limit, 80% of the copy (1.72 TB/s) may spend at most 1 pJ/B above idle")


def test_experts_bounds_energy_reads_a_settled_phase():
    """experts-bounds --watch's line for a phase: its rate, its energy a byte (W over TB/s)
    and its clocks, the phase's first SETTLE seconds left out."""
    from sparkdecode.bench.clockwatch import ClockWatch, Sample

    script = load_script("experts-bounds")
    watch = ClockWatch.__new__(ClockWatch)
    watch.fields = ("clocks.sm", "clocks.mem", "power.draw.instant")
    # 300 W through the first second (the phase before, averaged in), 700 W after
    watch.samples = [Sample(0.1 * i, 1755.0, 2619.0, 300.0 if i < 10 else 700.0, 700.0, 50.0, 4) for i in range(30)]
    watch.phases = {"up": (0.0, 2.95)}
    line = script.energy(watch, "up", 50e-6, 125e6)  # 125 MB in 50 us: 2.5 TB/s
    assert line.startswith(" 2.50 TB/s  280 pJ/B  ")
    assert "power cap 100%" in line and "SM  1755" in line
    # with the idle GPU watched (125 W), the part above it too
    watch.samples += [Sample(10.0 + 0.1 * i, 1980.0, 2619.0, 125.0, 700.0, 40.0, 0) for i in range(30)]
    watch.phases["idle"] = (10.0, 12.95)
    line = script.energy(watch, "up", 50e-6, 125e6)
    assert line.startswith(" 2.50 TB/s  280 pJ/B ( 230 above idle)  ")
