"""providers_flashinfer on the CPU: the pack loads and explains itself without
FlashInfer (CI does not install it), says why off Hopper, with another FlashInfer
or at TP 1, a detached rank's all-reduce builds without it, and its page-table cut
for sliding layers (computed on the device in the graph) agrees with the host
formula and never names a released page."""

from __future__ import annotations

import dataclasses
import gc
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from sparkdecode import protocols
from sparkdecode.deployment import detect
from sparkdecode.layout import resolve
from sparkdecode.plugins import discover
from sparkdecode.protocols import BuildContext, KVGroupMetadata, LayerKV
from sparkdecode.reference.kvcache import BLOCK_SIZE, NULL_PAGE, PagedKVCache
from sparkdecode.spec import ModelSpec
from sparkdecode_flashinfer import allreduce, jit_cache, pages, plugin, support
from sparkdecode_flashinfer.allreduce import FlashInferAllReduce
from sparkdecode_flashinfer.prefill import FlashInferFa3, FlashInferPrefill, jit_args, module_name
from sparkdecode_flashinfer.xqa import FlashInferXqa, causal_mask

PROVIDERS = (FlashInferXqa, FlashInferPrefill, FlashInferFa3)


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    """The deployments here pretend to a Hopper GPU with FlashInfer installed, which
    this machine lacks: its import probe answers as it would there."""
    monkeypatch.setattr(support, "import_problem", lambda module: None)


def test_an_install_that_cannot_import_is_a_reason(monkeypatch):
    """FlashInfer installed without its dependencies (``pip install --no-deps``):
    its providers say so rather than fail in their build."""
    problem = "flashinfer is installed but cannot be imported (ModuleNotFoundError: No module named 'tvm_ffi')"
    monkeypatch.setattr(support, "import_problem", lambda module: problem if module == "flashinfer" else None)
    for cls in PROVIDERS:
        assert cls.unsupported(hopper()) == problem
    # The all-reduce imports flashinfer.comm, which needs cuda-python besides.
    comm = "flashinfer.comm is installed but cannot be imported (ModuleNotFoundError: No module named 'cuda')"
    monkeypatch.setattr(support, "import_problem", lambda module: comm if module == "flashinfer.comm" else None)
    assert FlashInferAllReduce.unsupported(hopper(tp=2)) == comm
    assert all(cls.unsupported(hopper()) is None for cls in PROVIDERS)
    d = hopper()
    other = dataclasses.replace(d, libraries={**d.libraries, "flashinfer": "0.7.20"})
    assert "FlashInfer 0.7.20 is installed" in FlashInferXqa.unsupported(other)


def hopper(spec: ModelSpec | None = None, **changes) -> object:
    d = detect(spec or ModelSpec.preset("tiny"), device="cpu")
    libraries = {**d.libraries, "flashinfer": "0.7.2.post1"}
    return dataclasses.replace(d, device="cuda", capability=(9, 0), libraries=libraries, **changes)


def test_pack_imports_without_flashinfer():
    """The plug-in module (and so discovery) never imports FlashInfer."""
    code = "import sys, sparkdecode_flashinfer.plugin; assert 'flashinfer' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert plugin.PROVIDERS == (*PROVIDERS, FlashInferAllReduce)


@pytest.mark.parametrize("cls", PROVIDERS)
def test_unsupported_reasons(cls):
    d = hopper()
    assert cls.unsupported(d) is None
    assert cls.unsupported(detect(ModelSpec.preset("tiny"), device="cpu")) == "needs a CUDA GPU"
    missing = dataclasses.replace(d, libraries={**d.libraries, "flashinfer": None})
    assert cls.unsupported(missing) == "FlashInfer is not installed (pip install flashinfer-python==0.7.2.post1)"
    for capability in ((8, 0), (10, 0)):
        reason = cls.unsupported(dataclasses.replace(d, capability=capability))
        assert "SM90" in reason and f"SM{capability[0]}{capability[1]}" in reason
    other = dataclasses.replace(d, libraries={**d.libraries, "flashinfer": "0.6.1"})
    assert "FlashInfer 0.6.1" in cls.unsupported(other) and "0.7.2.post1" in cls.unsupported(other)
    assert "bf16" in cls.unsupported(dataclasses.replace(d, kv_dtype=torch.float8_e4m3fn))


def test_host_planned_cores_refuse_inexact_host_lengths():
    """fa2 and fa3 plan each step from the host's context length; XQA reads it from the
    device: only XQA serves where the host knows it as an upper bound (vLLM's
    asynchronous scheduling)."""
    d = hopper(host_lengths_exact=False)
    assert FlashInferXqa.unsupported(d) is None
    for cls in (FlashInferPrefill, FlashInferFa3):
        reason = cls.unsupported(d)
        assert "--no-async-scheduling" in reason and '"decode_lengths": "sync"' in reason
        assert cls.unsupported(hopper(host_lengths_exact=True)) is None


def test_unsupported_shapes():
    spec = ModelSpec.preset("tiny")
    assert "block size 8" in FlashInferXqa.unsupported(hopper(kv_block_size=8))
    assert "40 rows" in FlashInferXqa.unsupported(hopper(max_rows=40))
    odd = hopper(dataclasses.replace(spec, head_dim=72, hidden_size=1152))
    assert "head_dim 72" in FlashInferXqa.unsupported(odd)
    assert "head_dim 72" in FlashInferPrefill.unsupported(odd)
    assert "head_dim 72" in FlashInferFa3.unsupported(odd)
    assert FlashInferXqa.unsupported(hopper(dataclasses.replace(spec, head_dim=128, hidden_size=2048))) is None


def test_all_reduce_unsupported_reasons():
    d = hopper(ModelSpec.preset("muse-spark-open"), tp=8)
    assert FlashInferAllReduce.unsupported(d) is None
    assert FlashInferAllReduce.unsupported(dataclasses.replace(d, tp=2)) is None
    assert FlashInferAllReduce.unsupported(dataclasses.replace(d, tp=1)) == "TP 1: there is nothing to all-reduce"
    assert "2, 4, 8 or 16 ranks" in FlashInferAllReduce.unsupported(dataclasses.replace(d, tp=3))
    assert FlashInferAllReduce.unsupported(dataclasses.replace(d, device="cpu", capability=None)) == "needs a CUDA GPU"
    missing = dataclasses.replace(d, libraries={**d.libraries, "flashinfer": None})
    assert "FlashInfer is not installed" in FlashInferAllReduce.unsupported(missing)
    assert "SM100" in FlashInferAllReduce.unsupported(dataclasses.replace(d, capability=(10, 0)))
    # The all-reduce reads no KV cache.
    assert FlashInferAllReduce.unsupported(dataclasses.replace(d, kv_dtype=torch.float8_e4m3fn)) is None


def test_all_reduce_widths():
    """The one-shot launch's row widths: 8 bf16 per thread, at most 1024 threads a
    CTA in a power-of-two cluster of at most 8 that divides the row's threads."""
    for width in (512, 1000, 1024, 4096, 8192, 65536):
        assert allreduce.width_unsupported(width) is None
    assert "8 bf16" in allreduce.width_unsupported(1004)
    assert "more than 1024 threads" in allreduce.width_unsupported(8 * 1025)  # odd thread count: cluster 1
    assert "more than 1024 threads" in allreduce.width_unsupported(65536 + 8 * 8)
    spec = dataclasses.replace(ModelSpec.preset("tiny"), moe_hidden_size=1004)
    assert "1004 elements" in FlashInferAllReduce.unsupported(hopper(spec, tp=2))


def test_detached_all_reduce_builds_without_flashinfer():
    """A TP shard with no group leaves its collectives out, as the reference
    transport does, and imports nothing."""
    spec = ModelSpec.preset("tiny")
    d = hopper(spec, tp=2)
    ctx = SimpleNamespace(tp=2, rank=1, group=None, deployment=d, spec=spec, max_rows=8)
    op = FlashInferAllReduce.build(ctx, None)
    x = torch.randn(3, spec.H).to(torch.bfloat16)
    before = x.clone()
    op.run(x)
    assert torch.equal(x, before)
    assert allreduce.capacity(ctx) == 8 * max(spec.H, spec.top_k * spec.P)
    code = (
        "import sys, types; from sparkdecode_flashinfer.allreduce import FlashInferAllReduce as A; "
        "from sparkdecode.spec import ModelSpec; from sparkdecode.deployment import detect; "
        "s = ModelSpec.preset('tiny'); "
        "c = types.SimpleNamespace(tp=2, rank=0, group=None, deployment=detect(s), spec=s, max_rows=8); "
        "A.build(c, None); assert 'flashinfer' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_all_reduce_unsupported_at_tp2_on_the_cpu():
    registry = discover()
    layout = resolve(registry, detect(ModelSpec.preset("tiny"), tp=2, device="cpu"))
    choice = layout.choices["all_reduce"]
    assert choice.chosen.name == "reference.all_reduce"
    assert FlashInferAllReduce.unsupported(detect(ModelSpec.preset("tiny"), tp=2, device="cpu")) == "needs a CUDA GPU"
    assert "all_reduce" not in resolve(registry, detect(ModelSpec.preset("tiny"), device="cpu")).choices


def test_discovered_and_reported_on_the_cpu():
    """Registered through the entry point; on this machine the reference core serves
    and the report says why the pack's do not."""
    registry = discover()
    names = {p.name: p for p in registry.providers}
    assert names["flashinfer.xqa"].pack == "flashinfer"
    assert names["flashinfer.fa2"].block == "attention_core"
    layout = resolve(registry, detect(ModelSpec.preset("tiny"), device="cpu"))
    choice = layout.choices["attention_core"]
    assert choice.chosen.name == "reference.attention_core"
    reasons = {c.name: c.reason for c in choice.candidates}
    assert reasons["flashinfer.xqa"] == reasons["flashinfer.fa2"] == reasons["flashinfer.fa3"] == "needs a CUDA GPU"


def test_fa3_is_the_fa2_core_on_the_sm90_backend():
    """flashinfer.fa3 (registered once its H200 tests passed) changes only the backend."""
    assert FlashInferFa3 in plugin.PROVIDERS and discover().find("flashinfer.fa3") is not None
    assert (FlashInferFa3.block, FlashInferFa3.backend, FlashInferPrefill.backend) == ("attention_core", "fa3", "fa2")


def test_prefill_jit_modules():
    """The one module each backend asks FlashInfer for at build (the plan's own
    arguments: bf16, int32 indices, head_dim 64, the sliding-window build) and its
    name, the archive's member that a prebuilt module is filed under."""
    bf16 = torch.bfloat16
    assert jit_args(64) == (bf16, bf16, bf16, torch.int32, 64, 64, 0, True, False, False)
    base = (
        "batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_"
        "head_dim_qk_64_head_dim_vo_64_posenc_0_use_swa_True_use_logits_cap_False_f16qk_False"
    )
    assert module_name("fa2", 64) == f"{base}_kv_stride_equal"
    assert module_name("fa3", 64) == f"{base}_sm90"
    assert "head_dim_qk_128_head_dim_vo_128" in module_name("fa3", 128)


def test_causal_mask_words():
    words = causal_mask(32).view(torch.uint8).reshape(32, 4)
    for row in range(32):
        bits = [(int(words[row, j // 8]) >> (j % 8)) & 1 for j in range(32)]
        assert bits == [1] * (row + 1) + [0] * (31 - row)


def sliding_spec() -> ModelSpec:
    return dataclasses.replace(ModelSpec.preset("tiny", 2), sliding_window=40)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_visible_pages_follow_the_cache(rows):
    """Over steps that grow the context by 1..rows tokens, cross pages and the window:
    the device cut equals the host formula, names no released page up to the
    shortened length, and keeps every key some query of the step sees."""
    spec = sliding_spec()
    cache = PagedKVCache(spec, 64, 512, 8)
    sliding = cache.layer_kv(0)
    assert sliding.window == 40
    visible = pages.VisiblePages(sliding.group, sliding.window, BLOCK_SIZE)
    g = torch.Generator().manual_seed(rows)
    first = 0
    while first + rows <= 500:
        host = cache.begin_step(first, rows)
        visible.update(rows)
        context = host.context_len
        cut = pages.first_visible_page(context, rows, 40, BLOCK_SIZE)
        assert cut * BLOCK_SIZE <= max(first - 40 + 1, 0)  # every visible key is kept
        length = int(visible.seq_lens)
        assert length == context - cut * BLOCK_SIZE
        used = (length + BLOCK_SIZE - 1) // BLOCK_SIZE
        table = sliding.group.block_table[0]
        assert torch.equal(visible.pages[0, :used], table[cut : cut + used])
        assert (visible.pages[0, :used] != NULL_PAGE).all()
        first += int(torch.randint(1, rows + 1, (1,), generator=g))


def kv_entry(table: torch.Tensor, window: int | None) -> LayerKV:
    group = KVGroupMetadata(table, torch.zeros(1, dtype=torch.int32), torch.zeros(8, dtype=torch.int64))
    return LayerKV(torch.empty(0), torch.empty(0), group, window)


@dataclasses.dataclass
class Context:
    """Stands in for a BuildContext: what ``BuildContext.shared`` reads."""

    buffers: dict
    device: torch.device = torch.device("cpu")
    shared = BuildContext.shared


def test_shared_groups_owner_and_lifetime():
    """The lowest built layer of each group owns it, whatever order prepare_kv comes
    in; the registry is shared by the builds from one set of buffers and lives as
    long as they do."""
    full, sliding = torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32)
    kv = tuple(kv_entry(full if i % 4 == 1 else sliding, None if i % 4 == 1 else 40) for i in range(8))
    ctx = Context({})
    shared = pages.shared_groups(ctx, "flashinfer.test")
    assert pages.shared_groups(ctx, "flashinfer.test") is shared
    assert pages.shared_groups(Context(ctx.buffers), "flashinfer.test") is shared
    assert pages.shared_groups(Context({}), "flashinfer.test") is not shared
    assert pages.shared_groups(ctx, "flashinfer.other") is not shared
    shared.layers.update({2, 3, 5, 6})  # a build of some layers only
    assert [shared.owner(kv, i) for i in (6, 3, 2, 5)] == [2, 2, 2, 5]
    made = []
    first = shared.group(kv[3], lambda: made.append(1) or object())
    assert shared.group(kv[6], lambda: made.append(1) or object()) is first and made == [1]
    assert shared.group(kv[5], object) is not first
    keys = [id(marker) for marker in ctx.buffers.values()]
    assert len(keys) == 2 and all(k in protocols._SHARED for k in keys)
    del ctx
    gc.collect()
    assert not any(k in protocols._SHARED for k in keys)


def test_shared_groups_owner_keys_on_the_window_too():
    """Layers whose caches share a block table but not a window are two groups (the
    key of ``group``), each owned, and so planned, by its own lowest layer."""
    table = torch.zeros(1, 4, dtype=torch.int32)
    kv = tuple(kv_entry(table, None if i % 4 == 1 else 40) for i in range(4))
    shared = pages.shared_groups(Context({}), "flashinfer.test")
    shared.layers.update(range(4))
    assert [shared.owner(kv, i) for i in range(4)] == [0, 1, 0, 0]
    assert shared.group(kv[1], object) is not shared.group(kv[0], object)


def test_check_cache_names_the_problem():
    kvt = torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)
    table = torch.zeros(1, 4, dtype=torch.int32)
    ok = LayerKV(kvt[0], kvt[1], kv_entry(table, None).group, None)
    support.check_cache("x", 0, ok, 2, 64, 16, ok.window)
    with pytest.raises(ValueError, match="not bf16"):
        support.check_cache("x", 0, ok._replace(k=kvt[0].float()), 2, 64, 16, ok.window)
    with pytest.raises(ValueError, match=r"\[pages, 32, 2, 64\]"):
        support.check_cache("x", 0, ok, 2, 64, 32, ok.window)
    page_major = torch.zeros(16, 4, 2, 64, dtype=torch.bfloat16).transpose(0, 1)
    with pytest.raises(ValueError, match="different strides"):
        support.check_cache("x", 0, ok._replace(v=page_major), 2, 64, 16, ok.window)
    strided = torch.zeros(4, 16, 2, 96, dtype=torch.bfloat16)[..., :64]
    with pytest.raises(ValueError, match="strides"):
        support.check_cache("x", 0, ok._replace(k=strided, v=strided), 2, 64, 16, ok.window)
    with pytest.raises(ValueError, match="cache window None, layer 2048"):
        support.check_cache("x", 0, ok, 2, 64, 16, 2048)


def test_jit_cache_round_trip(tmp_path, monkeypatch):
    """Saved modules go into one archive and back into the AOT folder of an install
    with the same key only; a module already there is kept; a later save merges the
    earlier archive's modules; a split archive loads as the whole."""
    jit, aot, out = tmp_path / "cached_ops", tmp_path / "aot", tmp_path / "out"
    for name in ("xqa_a", "trtllm_comm"):
        (jit / name).mkdir(parents=True)
        (jit / name / f"{name}.so").write_bytes(name.encode())
    (jit / "half_built").mkdir()  # a build that never linked
    (jit / "half_built" / "half_built.o").write_bytes(b"")
    key = "0.7.2.post1/90a/cu13.0"
    monkeypatch.setattr(jit_cache, "_paths", lambda cuda=None: (jit, aot, key))
    files, members = jit_cache.save(out)
    assert files == [out / "flashinfer-jit.tar.gz"] and [p.name for p in out.iterdir()] == ["flashinfer-jit.tar.gz"]
    assert members == [f"{key}/trtllm_comm/trtllm_comm.so", f"{key}/xqa_a/xqa_a.so"]
    (aot / "trtllm_comm").mkdir(parents=True)
    (aot / "trtllm_comm" / "trtllm_comm.so").write_bytes(b"shipped")
    assert [p.parent.name for p in jit_cache.load(files[0])] == ["xqa_a"]
    assert (aot / "xqa_a" / "xqa_a.so").read_bytes() == b"xqa_a"
    assert (aot / "trtllm_comm" / "trtllm_comm.so").read_bytes() == b"shipped"
    monkeypatch.setattr(jit_cache, "_paths", lambda cuda=None: (jit, tmp_path / "other", "0.7.3/90a/cu13.0"))
    assert jit_cache.load(files[0]) == []
    assert jit_cache.load(tmp_path / "missing.tar.gz") == []
    # The next machine compiled only fa2 (it loaded the others): a save merging the
    # carried archive keeps them all, in one plain tar, or in parts.
    (jit / "xqa_a" / "xqa_a.so").unlink()
    (jit / "trtllm_comm" / "trtllm_comm.so").unlink()
    (jit / "fa2").mkdir()
    (jit / "fa2" / "fa2.so").write_bytes(bytes(range(256)) * 64)
    monkeypatch.setattr(jit_cache, "_paths", lambda cuda=None: (jit, tmp_path / "aot2", key))
    (merged,), members = jit_cache.save(tmp_path / "next.tar", merge=(files[0], tmp_path / "absent.tar.gz"))
    assert members == [f"{key}/fa2/fa2.so", f"{key}/trtllm_comm/trtllm_comm.so", f"{key}/xqa_a/xqa_a.so"]
    parts, _ = jit_cache.save(tmp_path / "split.tar", merge=(merged,), split_mib=4096 / 2**20)
    assert [p.name for p in parts][:2] == ["split.tar.000", "split.tar.001"] and not (tmp_path / "split.tar").exists()
    assert jit_cache.read_archive(tmp_path / "split.tar") == jit_cache.read_archive(merged)
    loaded = jit_cache.load(tmp_path / "split.tar")
    assert [p.parent.name for p in loaded] == ["fa2", "trtllm_comm", "xqa_a"]
    assert (tmp_path / "aot2" / "fa2" / "fa2.so").read_bytes() == bytes(range(256)) * 64
    # the older folder layout still loads
    legacy = tmp_path / "legacy" / key / "old"
    legacy.mkdir(parents=True)
    (legacy / "old.so").write_bytes(b"old")
    assert [p.parent.name for p in jit_cache.load(tmp_path / "legacy")] == ["old"]


def test_jit_cache_key_without_cuda_torch(tmp_path, monkeypatch):
    """A torch without CUDA gives no key: ``--cuda`` names it, for modules built on a
    CPU machine; the key comes from FlashInfer's release and target arch."""
    root = tmp_path / "fi" / "0.7.2.post1" / "90a"
    env = SimpleNamespace(
        flashinfer_version="0.7.2.post1",
        FLASHINFER_WORKSPACE_DIR=root,
        FLASHINFER_JIT_DIR=root / "cached_ops",
        FLASHINFER_AOT_DIR=tmp_path / "aot",
    )
    flashinfer = ModuleType("flashinfer")
    flashinfer.jit = ModuleType("flashinfer.jit")
    flashinfer.jit.env = env
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer)
    monkeypatch.setitem(sys.modules, "flashinfer.jit", flashinfer.jit)
    monkeypatch.setattr(torch.version, "cuda", None)
    (root / "cached_ops" / "trtllm_comm").mkdir(parents=True)
    (root / "cached_ops" / "trtllm_comm" / "trtllm_comm.so").write_bytes(b"comm")
    out = tmp_path / "out.tar.gz"
    with pytest.raises(ValueError, match="--cuda"):
        jit_cache.save(out)
    assert jit_cache.main(["save", str(out)]) == 2 and not out.exists()
    with pytest.raises(ValueError, match="key"):
        jit_cache.save(out, cuda="13.0/..")
    assert jit_cache.main(["save", str(out), "--cuda", "13.0"]) == 0
    assert list(jit_cache.read_archive(out)) == ["0.7.2.post1/90a/cu13.0/trtllm_comm/trtllm_comm.so"]
    assert jit_cache.load(out, cuda="12.9") == []
    assert jit_cache.main(["load", str(out), "--cuda", "13.0"]) == 0
    assert (tmp_path / "aot" / "trtllm_comm" / "trtllm_comm.so").read_bytes() == b"comm"
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert jit_cache._paths()[2] == "0.7.2.post1/90a/cu13.0"
    env.FLASHINFER_WORKSPACE_DIR = root.parent  # no GPU and no FLASHINFER_CUDA_ARCH_LIST: no arch
    with pytest.raises(ValueError, match="FLASHINFER_CUDA_ARCH_LIST"):
        jit_cache._paths()


def test_jit_cache_archive_members_are_plain_module_paths():
    assert jit_cache.MEMBER.match("0.7.2.post1/90a/cu13.0/xqa/xqa.so")
    for bad in ("0.7.2/90a/cu13.0/../../x.so", "0.7.2/90a/cu13.0/a/b.so", "../90a/cu13.0/a/a.so", "a/b/c/d/d.so"):
        assert not jit_cache.MEMBER.match(bad), bad
    assert jit_cache.archive_path(Path("out")) == Path("out/flashinfer-jit.tar.gz")
    assert jit_cache.archive_path(Path("x.tar.xz")) == Path("x.tar.xz")
