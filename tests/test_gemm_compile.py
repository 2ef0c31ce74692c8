"""Decode GEMM (kernels/gemm.py) on the CPU: validation, the stream-K bookkeeping, and
compile-only checks of the PTX (CUTE_DSL_ARCH=sm_90a, set by conftest.py before cutlass loads).

Compiles ~39 configurations (about 1-8 s each; ~75 s in all on 2 cores); the PTX is shared through a module cache.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from graphc.kernels import gemm, gemm_stream_k
from graphc.kernels.gemm import GemmConfig, check_shape, linear_ptx
from graphc.kernels.smem_pipeline import EVICT_FIRST, SMEM_BUDGET, SMEM_MAX

from gemm_shapes import SPEC_SHAPES  # noqa: E402
from ptxas_tool import run_ptxas  # noqa: E402

# Long unrolled epilogue loops (M = 256) make CuTe DSL suggest unroll_full; compile time is fine.
pytestmark = pytest.mark.filterwarnings("ignore:This static loop has")

_PTX: dict[tuple, str] = {}
# 256-row stream-K tiles at 129-192 rows: two warpgroups of two 64-row halves (consumer_regs).
TILE_256_ROWS = dict(halves=2, row_wgs=2, col_wgs=1, w_blocked=1)


def ptx_of(m: int, k: int, n: int, epilogue: str | None, block_k: int | None = None) -> str:
    key = (m, k, n, epilogue, block_k)
    if key not in _PTX:
        _PTX[key] = linear_ptx(m, k, n, epilogue, block_k=block_k)
    return _PTX[key]


# ------------------------------------------------------------------------------------------------
# Validation.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "m, k, n, epilogue, rule",
    [
        (8, 1000, 1024, None, "multiple of 64"),       # K
        (8, 1024, 1000, None, "multiple of 64"),       # N
        (8, 0, 1024, None, "multiple of 64"),
        (8, 1024, 192, "silu_mul", "multiple of 128"),  # I = 96 is not a multiple of 64
        (0, 1024, 1024, None, "1 <= M <= 256"),
        (257, 1024, 1024, None, "1 <= M <= 256"),
        (8, 1024, 1024, "gelu", "epilogue"),
    ],
)
def test_bad_shapes_are_refused(m, k, n, epilogue, rule):
    with pytest.raises(ValueError, match=re.escape(rule)):
        check_shape(m, k, n, epilogue)
    with pytest.raises(ValueError, match=re.escape(rule)):
        GemmConfig(m, k, n, epilogue)
    with pytest.raises(ValueError, match=re.escape(rule)):
        gemm.compile_linear(m, k, n, epilogue)


def test_bad_block_k_is_refused():
    with pytest.raises(ValueError, match="block_k"):
        GemmConfig(8, 1024, 1024, block_k=32)
    with pytest.raises(ValueError, match="block_k"):
        GemmConfig(8, 192, 1024, block_k=128)      # 128 does not divide K = 192
    assert GemmConfig(8, 192, 1024).block_k == 64


def test_linear_validates_tensors():
    torch = pytest.importorskip("torch")
    bf = torch.bfloat16
    x, w = torch.zeros(4, 1024, dtype=bf), torch.zeros(1024, 1024, dtype=bf)
    with pytest.raises(ValueError, match="multiple of 64"):
        gemm.linear(torch.zeros(4, 1000, dtype=bf), torch.zeros(1024, 1000, dtype=bf),
                    torch.zeros(4, 1024, dtype=bf))
    with pytest.raises(ValueError, match="CUDA device"):
        gemm.linear(x, w, torch.zeros(4, 1024, dtype=bf))
    with pytest.raises(ValueError, match="2-D"):
        gemm.linear(x[0], w, torch.zeros(4, 1024, dtype=bf))
    with pytest.raises(ValueError, match="1 <= M <= 256"):
        gemm.linear(torch.zeros(300, 1024, dtype=bf), w, torch.zeros(300, 1024, dtype=bf))
    with pytest.raises(ValueError, match=r"\[N/64, K/64, 64, 64\] \(or \[N/16, K/64, 16, 64\]\), got \[32, 16, 32, 64\]"):
        gemm.linear(x, torch.zeros(32, 16, 32, 64, dtype=bf), torch.zeros(4, 1024, dtype=bf))
    with pytest.raises(ValueError, match="CUDA device"):     # 16-row blocks pass the shape checks
        gemm.linear(x, torch.zeros(64, 16, 16, 64, dtype=bf), torch.zeros(4, 1024, dtype=bf))


def test_pdl_traits():
    assert gemm.PROLOGUE_INPUTS == ("weight",)
    assert gemm.WAITS is True
    assert gemm.TRIGGER in ("early", "late")


# ------------------------------------------------------------------------------------------------
# Stream-K bookkeeping (the same formulas the kernel evaluates on device values).
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k, n, epilogue", SPEC_SHAPES + [(64, 64, None), (128, 192, None)])
@pytest.mark.parametrize("sms", [132, 114, 7, 1])
@pytest.mark.parametrize("m, row_wgs", [(8, None), (64, None), (64, 1)])
def test_stream_k_partition(k, n, epilogue, sms, m, row_wgs):
    check_partition(GemmConfig(m, k, n, epilogue, sms, row_wgs=row_wgs), sms)


@pytest.mark.parametrize("max_split, ctas", [(4, 117), (5, 132), (8, 132)])
def test_stream_k_partition_max_split(max_split, ctas):
    """qkv's 40 256-row tiles at 192 rows: at most 4 CTAs per tile leaves 15 SMs idle; 5 fill them."""
    cfg = GemmConfig(192, 7168, 10240, None, consumer_regs=232, max_split=max_split, **TILE_256_ROWS)
    assert cfg.ctas == ctas
    check_partition(cfg, 132)
    with pytest.raises(ValueError, match="max_split=1 unsupported"):
        GemmConfig(8, 7168, 10240, max_split=1)


# The split-tile fix-up shared out by warpgroup (fixup_split): qkv at 160 / 192 rows (two late
# CTAs in 52 of 80 tiles), up to three late CTAs per tile (more than the two warpgroups), one
# warpgroup (y held in a stage), silu_mul, and tiles of at most two CTAs (one owner).
FIXUP_CASES = [(192, 7168, 10240, None, {}), (160, 7168, 10240, None, {}), (96, 1024, 4096, None, {}),
               (64, 8192, 7168, None, {"publish_first": 0}), (128, 1024, 5632, "silu_mul", {}),
               (192, 7168, 36864, None, {})]


@pytest.mark.parametrize("m, k, n, epilogue, knobs", FIXUP_CASES)
def test_fixup_split_owners(m, k, n, epilogue, knobs):
    """Every warpgroup part of a split tile has one owner, a CTA whose range ends in the tile
    (its last, so its pipeline is drained there); a warpgroup owns at most one part (one
    phase of its staging mbarrier); the parts' counters and staged parts fit."""
    cfg = GemmConfig(m, k, n, epilogue, fixup_split=1, **knobs)
    check_partition(cfg, 132)
    kb = cfg.k_blocks
    owned: dict[tuple[int, int], int] = {}
    for t in range(cfg.tiles):
        c_lo, c_hi = cfg.cta_of(t * kb), cfg.cta_of(t * kb + kb - 1)
        if c_lo == c_hi:
            continue
        late = cfg.late_ctas(t)
        assert late.start == c_lo
        for c in range(c_lo, c_hi + 1):
            assert (c in late) == (cfg.cta_range(c)[1] <= (t + 1) * kb)
        for w in range(cfg.wgs):
            owner = cfg.part_owner(t, w)
            assert owner in late and (owner, w) not in owned
            owned[(owner, w)] = t
            assert t * cfg.wgs + w < 2 * cfg.tiles          # the part's counter
        assert (c_hi - c_lo) * cfg.part_floats <= cfg.fixup_region_floats
    assert cfg.wgs * 4 * cfg.fixup_region_floats <= cfg.stages * cfg.stage_bytes


def test_fixup_split_shares_qkv_192():
    """At qkv 192 rows the 52 tiles that two CTAs end in get one owner per warpgroup each."""
    cfg = GemmConfig(192, 7168, 10240, None)
    assert cfg.fixup_split == 1                                  # the default from 129 rows
    shared = [t for t in range(cfg.tiles) if cfg.part_owner(t, 0) != cfg.part_owner(t, 1)]
    assert len(shared) == 52


@pytest.mark.parametrize("m, k, n, epilogue, on", [
    (128, 7168, 10240, None, 0), (129, 7168, 10240, None, 1), (192, 7168, 10240, None, 1),
    (200, 7168, 10240, None, 0),                   # does not fit: 208 columns
    (160, 7168, 163840, None, 1), (96, 7168, 163840, None, 0),
    (160, 7168, 36864, "silu_mul", 0),             # two batch warpgroups of 80 columns (tied, §50)
])
def test_fixup_split_default(m, k, n, epilogue, on):
    """On by default with two warpgroups from 129 rows where it fits (measured: §50)."""
    assert GemmConfig(m, k, n, epilogue).fixup_split == on


@pytest.mark.parametrize("m, k, n, knobs, why", [
    (256, 7168, 10240, {}, "fitting"),                 # 128 KB partials: 2 x 128 KB > 192 KB
    (8, 8192, 7168, {}, "publish_first=0"),             # publishes first by default there
    (192, 8192, 7168, {}, "tiles are split"),           # one whole-K unit per CTA
])
def test_fixup_split_refused(m, k, n, knobs, why):
    with pytest.raises(ValueError, match=f"fixup_split=1 unsupported here.*{why}"):
        GemmConfig(m, k, n, None, fixup_split=1, **knobs)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit)")
def test_fixup_split_ptx(tmp_path):
    """The shared fix-up after the PDL wait: per-part release (fence + red) and acquire
    (polling loads), the parts bulk-copied into shared memory (no partial loaded from L2 by
    a thread), warpgroup barriers by register, the parts dropped from L2; no spill, no
    serialized wgmma."""
    ptx = linear_ptx(192, 7168, 10240, None, fixup_split=1)
    wait = ptx.index("griddepcontrol.wait")
    after = ptx[wait:]
    for op in ("fence.acq_rel.gpu", "red.relaxed.gpu.global.add.s32", "ld.acquire.gpu.global",
               "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes", "discard.global.L2",
               "st.global.v4.b32"):
        assert op in after, op
    assert "discard." not in ptx[:wait] and not re.search(r"\sred\.", ptx[:wait])
    assert not re.search(r"ld\.global\.cg", ptx)
    assert re.search(r"bar\.sync\s+%r\d+, 128;", ptx)
    src = tmp_path / "gemm.ptx"
    src.write_text(ptx)
    report = run_ptxas(src, tmp_path / "gemm.cubin", "-v")
    assert "0 bytes spill stores" in report, report
    assert "C7514" not in report, report


def check_partition(cfg: GemmConfig, sms: int) -> None:
    """Every (tile, k-block) iteration belongs to one CTA, split tiles use distinct workspace
    slots, and the CTAs' ranges are balanced."""
    kb = cfg.k_blocks
    assert 1 <= cfg.ctas <= sms
    segments: dict[int, list[tuple[int, int, int]]] = {}
    for c in range(cfg.ctas):
        begin, end = cfg.cta_range(c)
        assert end > begin, "every CTA gets work"
        assert all(cfg.cta_of(g) == c for g in range(begin, end))
        for t in range(begin // kb, (end - 1) // kb + 1):
            segments.setdefault(t, []).append((c, max(begin - t * kb, 0), min(end - t * kb, kb)))
    assert sorted(segments) == list(range(cfg.tiles))
    used_slots = set()
    for t, segs in segments.items():
        ctas = [c for c, _, _ in segs]
        assert ctas == list(range(cfg.cta_of(t * kb), cfg.cta_of(t * kb + kb - 1) + 1))
        assert len(segs) <= cfg.max_segs <= cfg.max_split
        covered = 0
        for _, lo, hi in sorted(segs, key=lambda s: s[1]):
            assert lo == covered
            covered = hi
        assert covered == kb, "the segments of a tile cover its k-blocks exactly once"
        if len(segs) > 1:
            for c, _, _ in segs:
                slot = cfg.slot_of(c, t)
                assert slot // 2 == c and slot not in used_slots
                used_slots.add(slot)
    assert max(used_slots, default=0) < 2 * cfg.ctas
    # Balance: CTAs differ by at most one k-block of weights.
    lengths = [e - b for b, e in map(cfg.cta_range, range(cfg.ctas))]
    assert max(lengths) - min(lengths) <= 1


def test_config_choices():
    cfg = GemmConfig(1, 7168, 36864, "silu_mul")
    assert (cfg.mma_n, cfg.row_wgs, cfg.col_wgs, cfg.halves, cfg.n_out, cfg.tiles) == (8, 1, 1, 2, 18432, 288)
    assert cfg.stages * cfg.w_stage_bytes >= 64 * 1024, "at least 64 KB of weights in flight"
    cfg = GemmConfig(64, 7168, 36864, "silu_mul")      # 128-row tiles: measured faster
    assert (cfg.mma_n, cfg.row_wgs, cfg.col_wgs, cfg.tiles, cfg.threads) == (64, 1, 1, 288, 160)
    cfg = GemmConfig(64, 7168, 36864, "silu_mul", row_wgs=2)   # the knob: 256-row tiles
    assert (cfg.mma_n, cfg.row_wgs, cfg.col_wgs, cfg.tiles, cfg.threads) == (64, 2, 1, 144, 288)
    assert cfg.stages * cfg.w_stage_bytes >= 64 * 1024
    cfg = GemmConfig(64, 18432, 7168)                  # too few 256-row tiles for 132 SMs
    assert (cfg.mma_n, cfg.row_wgs, cfg.col_wgs, cfg.ctas) == (64, 1, 1, 132)
    assert cfg.stages * cfg.w_stage_bytes >= 64 * 1024
    cfg = GemmConfig(256, 7168, 10240)
    assert (cfg.mma_n, cfg.row_wgs, cfg.col_wgs, cfg.threads) == (128, 1, 2, 288)
    assert cfg.stages * cfg.stage_bytes <= SMEM_BUDGET
    assert GemmConfig(3, 1024, 1024).mma_n == 8
    assert GemmConfig(200, 1024, 1024, halves=2).mma_n == 112         # two batch warpgroups
    # Plain shapes at 65-200 rows: each 64-row half of a tile on its own warpgroup, with
    # every batch column (M = 200: wgmma N = 208); silu_mul and 256 rows keep one unit.
    for m, k, n, e, layout in [(65, 18432, 7168, None, (1, 2, 1, 80)), (128, 18432, 7168, None, (1, 2, 1, 128)),
                               (200, 1024, 1024, None, (1, 2, 1, 208)), (64, 8192, 7168, None, (2, 1, 1, 64)),
                               (65, 8192, 7168, None, (1, 1, 1, 80)),        # one unit per CTA (short K)
                               (256, 7168, 10240, None, (2, 1, 2, 128)),
                               (256, 8192, 7168, None, (1, 1, 1, 256)),      # one unit per CTA
                               (128, 7168, 36864, "silu_mul", (2, 1, 1, 128))]:
        cfg = GemmConfig(m, k, n, e)
        assert (cfg.halves, cfg.row_wgs, cfg.col_wgs, cfg.mma_n) == layout, (m, n, e)
    assert GemmConfig(128, 18432, 7168).tiles == GemmConfig(128, 8192, 7168, halves=2).tiles == 56
    assert GemmConfig(64, 18432, 7168, row_wgs=2).ctas < 132   # the knob still works
    with pytest.raises(ValueError, match="row_wgs"):
        GemmConfig(256, 7168, 10240, row_wgs=2)         # at most two consumer warpgroups


def test_tuning_knobs_round_trip_and_bounds():
    cfg = GemmConfig(64, 7168, 7168, None, 112, stages=6, l2_prefetch=0)
    assert (cfg.ctas, cfg.stages, cfg.l2_prefetch) == (112, 6, 0)
    again = GemmConfig.from_key(cfg.key())
    assert again.key() == cfg.key() and repr(again) == repr(cfg)
    # The default depth fills SMEM_BUDGET; the knob may go up to SMEM_MAX, not beyond.
    assert GemmConfig(64, 7168, 7168).stages == SMEM_BUDGET // GemmConfig(64, 7168, 7168).stage_bytes
    assert GemmConfig(64, 7168, 7168, stages=9).stages == 9
    with pytest.raises(ValueError, match="stages=10"):
        GemmConfig(64, 7168, 7168, stages=10)           # 10 x 24 KB > SMEM_MAX
    with pytest.raises(ValueError, match="stages=1 "):
        GemmConfig(8, 7168, 7168, stages=1)
    early = GemmConfig(8, 7168, 7168, pre_wait_stages=3)
    assert GemmConfig.from_key(early.key()).pre_wait_stages == 3 and "pre_wait_stages=3" in repr(early)
    assert GemmConfig(8, 7168, 7168).pre_wait_stages == GemmConfig(8, 7168, 7168).stages
    with pytest.raises(ValueError, match="pre_wait_stages=12 unsupported: 0..11"):
        GemmConfig(8, 7168, 7168, pre_wait_stages=12)
    late = GemmConfig(8, 7168, 7168, trigger_at=2)
    assert GemmConfig.from_key(late.key()).trigger_at == 2 and "trigger_at=streamed" in repr(late)
    assert GemmConfig(8, 7168, 7168).trigger_at == 0 and "trigger_at" not in repr(GemmConfig(8, 7168, 7168))
    with pytest.raises(ValueError, match=r"trigger_at=4 unsupported: 0..3 \(entry, wait, streamed, exit\)"):
        GemmConfig(8, 7168, 7168, trigger_at=4)
    blocked = GemmConfig(8, 7168, 7168, w_blocked=1)
    assert GemmConfig.from_key(blocked.key()).w_blocked == 1 and "w_blocked=1" in repr(blocked)
    assert GemmConfig(8, 7168, 7168).w_blocked == 0


def test_split_reduction_paths():
    """Which way a split tile's partials reach the reducer: all at once through the drained
    pipeline when the others fit (M <= 128 here), else in rounds of what fits (M > 128)."""
    cfg = GemmConfig(64, 8192, 7168)
    assert cfg.bulk_reduce and (cfg.max_segs - 1) * cfg.slot_bytes <= cfg.stages * cfg.stage_bytes
    cfg = GemmConfig(256, 8192, 7168, halves=2)         # (not one unit per CTA): 192 KB of buffers
    assert (cfg.bulk_reduce, cfg.slot_pieces, cfg.pieces_per_round, cfg.max_segs) == (False, 1, 1, 4)   # 128 KB
    cfg = GemmConfig(129, 1024, 1024)                   # mma_n 80: 80 KB partials
    assert (cfg.bulk_reduce, cfg.slot_pieces, cfg.pieces_per_round) == (False, 1, 2)
    assert cfg.frag % 4 == 0 and cfg.frag % 16 != 0     # the GPU test that caught a 16-wide loop
    # 256-row tiles at 192 rows: a 192 KB partial does not fit 3 x 56 KB of buffers; each
    # warpgroup's halves (48 KB) go apart, three per round.
    cfg = GemmConfig(192, 7168, 10240, None, consumer_regs=232, **TILE_256_ROWS)
    assert (cfg.slot_bytes, cfg.stages * cfg.stage_bytes) == (196608, 172032)
    assert (cfg.bulk_reduce, cfg.slot_pieces, 4 * cfg.piece_floats, cfg.pieces_per_round) == (False, 4, 49152, 3)


def test_one_unit_per_cta_where_64_row_units_fill_the_sms():
    """Plain shapes at 129-256 rows whose 64-row units nearly fill the SMs one per SM (o_proj,
    down: 112 on 132), and at 65-128 rows where K is short (o_proj): one unit per CTA over the
    whole of K, every batch column in one warpgroup, no split tile anywhere."""
    for m, ks in [(65, (8192,)), (96, (8192,)), (128, (8192,)), (129, (8192, 18432)),
                  (160, (8192, 18432)), (208, (8192, 18432)), (256, (8192, 18432))]:
        for k in ks:
            cfg = GemmConfig(m, k, 7168)
            assert cfg.ctas == cfg.tiles == 112 and cfg.max_segs == 1
            assert (cfg.halves, cfg.row_wgs, cfg.col_wgs, cfg.mma_n) == (1, 1, 1, -(-m // 16) * 16)
            assert all(cfg.cta_range(c) == (c * cfg.k_blocks, (c + 1) * cfg.k_blocks) for c in range(cfg.ctas))
            again = GemmConfig.from_key(cfg.key())       # the compile cache rebuilds it from its key
            assert again.key() == cfg.key() and again.max_segs == 1
    assert GemmConfig(160, 8192, 7168).y_places == [("x", 0)]      # y staged in the x buffer
    assert GemmConfig(128, 18432, 7168).ctas == 132                  # down up to 128 rows: split halves
    assert GemmConfig(65, 18432, 7168).ctas == 132
    assert GemmConfig(64, 8192, 7168).ctas == 132                    # o_proj up to 64 rows: split
    assert isinstance(gemm.plan(128, 8192, 7168), GemmConfig)        # the units before the whole-K tiles
    assert isinstance(gemm.plan(128, 18432, 7168), WideGemmConfig)   # (down: no units at 128 rows)
    assert isinstance(gemm.plan(240, 8192, 7168), WideGemmConfig)    # ... which take 231-256 rows
    assert GemmConfig(160, 7168, 10240).max_segs > 1                 # qkv: 160 units > 132 SMs
    assert GemmConfig(160, 1024, 1024).max_segs > 1                  # 16 units on 21 CTAs
    assert GemmConfig(160, 7168, 36864, "silu_mul").max_segs > 1
    assert GemmConfig(160, 8192, 7168, halves=2).max_segs > 1        # explicit knobs win
    assert isinstance(gemm.plan(200, 8192, 7168), GemmConfig)        # below the whole-K tiles' rows


def test_x_shared_in_clusters_only_where_every_cta_has_one_whole_tile():
    cfg = GemmConfig(160, 8192, 7168, cluster=4)
    assert (cfg.cluster, cfg.ctas % 4, cfg.mma_n % 32) == (4, 0, 0)
    assert GemmConfig.from_key(cfg.key()).key() == cfg.key()
    assert GemmConfig(144, 8192, 7168, cluster=2).cluster == 2
    assert GemmConfig(160, 8192, 7168).cluster == 1
    for m, k, n, cluster in [(8, 8192, 7168, 2),        # split tiles: the CTAs stream different k-blocks
                             (144, 8192, 7168, 4),      # 36-row slices: not whole swizzle atoms
                             (160, 7168, 10240, 2),     # qkv: 160 units on 132 SMs, split
                             (160, 8192, 7168, 3)]:
        with pytest.raises(ValueError, match=f"cluster={cluster} unsupported"):
            GemmConfig(m, k, n, cluster=cluster)
    # plan: the knob belongs to both kernels and chooses neither.
    assert isinstance(gemm.plan(160, 8192, 7168, None, 132, cluster=2), GemmConfig)
    assert isinstance(gemm.plan(256, 8192, 7168, None, 132, cluster=2), WideGemmConfig)


@pytest.mark.parametrize("cluster", [2, 4])
def test_ptx_x_multicast_in_clusters(cluster):
    """Every x load multicast into the cluster after the PDL wait (W stays per CTA, before it
    too), every stage released in each CTA of the cluster."""
    cfg = GemmConfig(160, 8192, 7168, cluster=cluster)
    ptx = gemm.linear_ptx(160, 8192, 7168, None, cluster=cluster)
    _check_ptx(ptx, cfg)
    loads = [line for line in ptx.splitlines() if "cp.async.bulk.tensor" in line]
    mcast = [line for line in loads if "multicast::cluster" in line]
    assert mcast and all(ptx.index(line) > ptx.index("griddepcontrol.wait") for line in mcast)
    assert len(loads) - len(mcast) == 2               # W: the prologue's and the steady state's
    assert "mbarrier.arrive.shared::cluster" in ptx and "barrier.cluster.wait" in ptx


def test_x_boxes_trimmed_to_the_rows_that_exist():
    """Where M is 1-8 rows past a multiple of 16 (above 16), one batch warpgroup's x buffer is
    loaded as two boxes, its first mma_n - 16 rows and the 8-row atom after them, so nothing
    past round_up(M, 8) is loaded; the stage barrier expects exactly those bytes."""
    for m, k, n, e in [(120, 8192, 7168, None), (20, 7168, 10240, None), (72, 7168, 36864, "silu_mul"),
                       (136, 18432, 7168, None), (200, 7168, 10240, None)]:
        cfg = GemmConfig(m, k, n, e)
        assert cfg.x_trim == 1 and cfg.col_wgs == 1
        assert cfg.x_boxes == ((cfg.mma_n - 16, 0), (8, cfg.mma_n - 16))
        assert sum(rows for rows, _ in cfg.x_boxes) == -(-m // 8) * 8
        assert cfg.stage_tx_bytes == cfg.w_stage_bytes + (-(-m // 8) * 8) * cfg.block_k * 2
        assert cfg.stage_tx_bytes < cfg.stage_bytes
        assert GemmConfig.from_key(cfg.key()).key() == cfg.key()
        untrimmed = GemmConfig(m, k, n, e, x_trim=0)
        assert untrimmed.x_boxes == ((untrimmed.mma_n, 0),) and untrimmed.stage_tx_bytes == untrimmed.stage_bytes
    # A multiple of 16 (or 9-15 rows past one), 8 rows or fewer, two batch warpgroups, x
    # slices in a cluster, two swizzle atoms of K per row: one box of mma_n rows.
    for m, k, n, tuning in [(128, 8192, 7168, {}), (64, 8192, 7168, {}), (8, 8192, 7168, {}), (3, 8192, 7168, {}),
                            (12, 8192, 7168, {}), (232, 7168, 36864, {}), (72, 8192, 7168, {"block_k": 128}),
                            (152, 8192, 7168, {"cluster": 2})]:
        cfg = GemmConfig(m, k, n, "silu_mul" if n == 36864 else None, **tuning)
        assert cfg.x_trim == 0 and cfg.x_boxes == ((cfg.mma_n, 0),), (m, tuning)
    with pytest.raises(ValueError, match="x_trim=1 unsupported"):
        GemmConfig(128, 8192, 7168, x_trim=1)


@pytest.mark.parametrize("m, k, n, epilogue", [(120, 8192, 7168, None), (20, 7168, 10240, None),
                                               (72, 7168, 36864, "silu_mul")])
def test_ptx_x_boxes_trimmed(m, k, n, epilogue):
    """Two x loads per stage (the prologue's and the steady state's, each as two boxes), all
    after the PDL wait; the untrimmed kernel has one of each."""
    counts = {}
    for x_trim in (0, 1):
        cfg = GemmConfig(m, k, n, epilogue, x_trim=x_trim)
        ptx = gemm.linear_ptx(m, k, n, epilogue, x_trim=x_trim)
        _check_ptx(ptx, cfg)
        loads = [line for line in ptx.splitlines() if "cp.async.bulk.tensor" in line]
        wait = ptx.index("griddepcontrol.wait")
        x_loads = [line for line in loads if ptx.index(line) > wait]
        counts[x_trim] = len(x_loads)
    assert counts[1] == counts[0] + 2        # x: the prologue's and the steady state's, 1 -> 2 boxes each


def test_publish_first_where_ranges_end_in_one_tile():
    """Split tiles publish before arriving at <= 16 batch columns when a CTA's range is
    shorter than a tile (several CTAs end in one tile), arrive first otherwise."""
    for m in (1, 8, 16):
        assert GemmConfig(m, 8192, 7168).publish_first == 1            # o_proj: 54 of 128 k-blocks each
        assert GemmConfig(m, 18432, 7168).publish_first == 1           # down
    assert GemmConfig(32, 8192, 7168).publish_first == 0               # 16 KB partials
    assert GemmConfig(8, 7168, 36864, "silu_mul").publish_first == 0   # gate_up: 2.2 tiles each
    assert GemmConfig(8, 8192, 7168, publish_first=0).publish_first == 0
    with pytest.raises(ValueError, match="publish_first=2"):
        GemmConfig(8, 8192, 7168, publish_first=2)


@pytest.mark.parametrize("publish_first", [0, 1])
def test_ptx_split_tile_protocol(publish_first):
    """Arrive first: a relaxed arrival, a release fence before the ready count, acquire loads
    polling it, bounded by the global timer (trap past REDUCER_SPIN_LIMIT_NS). Publish first:
    no such loop; the arrival is one acquire-release atomic."""
    ptx = gemm.linear_ptx(8, 8192, 7168, None, publish_first=publish_first)
    assert ("ld.acquire.gpu" in ptx) == (not publish_first)
    assert ("trap;" in ptx) == ("%globaltimer" in ptx) == (not publish_first)
    assert ("fence.acq_rel.gpu" in ptx) == (not publish_first)
    assert ("atom.global.acq_rel.add" in ptx) == bool(publish_first)
    assert "discard.global.L2" in ptx


def test_y_staging_places():
    """Where each output half's bf16 tile is staged: the warpgroup's W boxes of the held
    stage, the last half in the stage's x buffer when the W boxes are full; with two batch
    warpgroups no held stage has room (the CTA's last tile uses the drained pipeline)."""
    assert GemmConfig(64, 8192, 7168).y_places == [("w", 0), ("w", 64 * 64)]
    assert GemmConfig(1, 8192, 7168).y_places == [("w", 0), ("w", 8 * 64)]
    assert GemmConfig(64, 7168, 36864, "silu_mul").y_places == [("w", 0)]
    assert GemmConfig(128, 8192, 7168, halves=2).y_places == [("w", 0), ("x", 0)]
    assert GemmConfig(128, 8192, 7168, halves=2, block_k=128).y_places == [("w", 0), ("w", 128 * 64)]
    # A half per warpgroup (the default at 65-200 rows): 16 KB of output per warpgroup, 8 KB
    # of its own W: staged only in the drained pipeline of the CTA's last tile.
    cfg = GemmConfig(128, 18432, 7168)
    assert cfg.y_places is None and cfg.y_staging == 1 and not cfg.y_held
    assert GemmConfig(128, 8192, 7168, halves=1).y_places == [("x", 0)]      # 64 rows of W: 8 KB
    assert GemmConfig(128, 8192, 7168).y_places == [("x", 0)]                # one unit per CTA
    assert GemmConfig(64, 18432, 7168, row_wgs=2).y_places == [("w", 0), ("w", 64 * 64)]
    assert GemmConfig(128, 7168, 36864, "silu_mul", row_wgs=2).y_places == [("w", 0)]
    assert GemmConfig(128, 18432, 7168, row_wgs=2).y_places is None     # x buffer shared
    assert GemmConfig(256, 7168, 10240).y_places is None
    assert GemmConfig(64, 8192, 7168).y_staging == 1 and GemmConfig(64, 8192, 7168).y_held
    assert GemmConfig(8, 8192, 7168).y_staging == 0 and GemmConfig(8, 8192, 7168, y_staging=1).y_held
    assert GemmConfig(64, 8192, 7168, y_staging=0).y_staging == 0
    # Two batch warpgroups: the last tile's output goes through the drained pipeline (64 KB).
    cfg = GemmConfig(256, 7168, 10240)
    assert cfg.y_staging == 1 and not cfg.y_held
    cfg = GemmConfig(256, 1024, 5632, "silu_mul", block_k=128, stages=2)   # 2 x 96 KB stages
    assert cfg.y_staging == 1 and not cfg.y_held


@pytest.mark.parametrize("m, epilogue, staged", [(64, None, True), (8, "silu_mul", True), (8, None, False),
                                                 (64, None, False), (256, None, True)])
def test_ptx_y_stores(m, epilogue, staged):
    """y_staging: bf16 into shared memory, y out as 16-byte vectors, no 2-byte global store
    (M = 256: the last tile only); without it 2-byte stores straight from the fragments."""
    # (qkv at 256 rows: o_proj's 64-row units would be one per CTA there, y held in x's buffer)
    k, n = (7168, 36864) if epilogue else (7168, 10240) if m == 256 else (8192, 7168)
    ptx = gemm.linear_ptx(m, k, n, epilogue, y_staging=int(staged))
    assert ("st.shared.b16" in ptx) == staged
    # M = 256 stages only its last tile; a full tile earlier in the range stores directly.
    assert bool(re.search(r"st\.global\.b16", ptx)) == (not staged or m > 128)
    if staged:
        assert re.search(r"ld\.shared(::cta)?\.v4\.b32", ptx)
        # A held stage goes back to the TMA producer: its generic accesses are fenced first.
        assert ("fence.proxy.async.shared::cta" in ptx) == (m <= 128)


# ------------------------------------------------------------------------------------------------
# Compile-only: the PTX has the structure DESIGN §3-§4 asks for.
# ------------------------------------------------------------------------------------------------
_TMA_LOAD = re.compile(r"cp\.async\.bulk\.tensor\.(\w+)\.[^\[]*\[[^\]]*\],\s*\[[^,\]]+,\s*\{([^}]*)\}\]")


def _tma_loads(ptx: str) -> list[tuple[str, list[str]]]:
    """(dimensionality, coordinate operands) of every cp.async.bulk.tensor load in the PTX."""
    loads = []
    for line in ptx.splitlines():
        if "cp.async.bulk.tensor" in line:
            mt = _TMA_LOAD.search(line)
            assert mt, f"unparsed TMA line: {line}"
            loads.append((mt.group(1), [c.strip() for c in mt.group(2).split(",")]))
    return loads


def _sync_skeleton(ptx: str) -> list[str]:
    """The kernel's TMA / wgmma / barrier / PDL / warp-collective instructions in program
    order, operands and registers stripped: what must not depend on M within one mma_n."""
    keep = ("cp.async.bulk", "wgmma.", "mbarrier.", "griddepcontrol.", "bar.sync", "barrier.",
            "elect.sync", "fence.", "setmaxnreg", "prefetch.tensormap", "trap", "brkpt")
    out = []
    for line in ptx.splitlines():
        op = line.strip().split(" ")[0].split("\t")[0]
        if op.startswith("@"):          # predicated: take the opcode after the guard
            parts = line.strip().split()
            op = parts[1] if len(parts) > 1 else op
        if any(op.startswith(k) for k in keep):
            out.append(op)
    return out


def _check_ptx(ptx: str, cfg: GemmConfig) -> None:
    assert ".target sm_90a" in ptx
    # One trigger, where trigger_at puts it; none where the CTA triggers by exiting.
    assert ptx.count("griddepcontrol.launch_dependents") == (cfg.trigger_at != 3)
    assert "griddepcontrol.wait" in ptx
    assert "cp.async.bulk.tensor.2d" in ptx and "mbarrier::complete_tx::bytes" in ptx
    # x's tensor map is rank 2, and W's too unless w_blocked (rank 4: k and row within an
    # 8 KB block, k block, row block), so every TMA load is .2d with two coordinates or, for
    # blocked W, .4d with four. With a static M = 1 CuTe DSL dropped x's batch mode and emitted
    # a .1d load against the rank-2 x map: an illegal instruction on the GPU (UTMALDG.1D, H200
    # 2026-11-30).
    tma = _tma_loads(ptx)
    assert tma, "no TMA load"
    # (Blocked W with block_k = 128: one 3-D box per half, two blocks deep.)
    allowed = {("2d", 2)} | ({("4d", 4), ("3d", 3)} if cfg.w_blocked else set())
    for dim, coords in tma:
        assert (dim, len(coords)) in allowed, f"TMA load .{dim} with coordinates {coords}"
    assert any(dim != "2d" for dim, _ in tma) == bool(cfg.w_blocked)
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.mma_n}k16.f32.bf16.bf16" in ptx
    # Split-K reduction: an arrival counter; arrive first: release (fence + red) / acquire
    # (polling loads) of the publication; publish first: one acquire-release arrival. Partials
    # stored and loaded (L2 only) as 16-byte vectors. (One unit per CTA never takes that
    # path but keeps it: a compile-time branch around it made ptxas serialize the main loop's
    # wgmma, C7514, and the kernel 1.7x slower; bench/gemm_notes.md §22.)
    if cfg.publish_first:
        assert "atom.global.acq_rel.add" in ptx
    else:
        assert "atom.global" in ptx and re.search(r"red(\.relaxed)?\.gpu\.global\.add", ptx)
        assert "fence.acq_rel.gpu" in ptx
        assert "ld.acquire.gpu" in ptx
    assert re.search(r"ld\.global\.cg\.v4\.b32", ptx) and re.search(r"st\.global\.v4\.b32", ptx)
    assert not re.search(r"ld\.global\.cg\.(f32|b32)", ptx), "scalar partial loads"
    # PDL: the trigger comes first (by default); before the first wait the only global traffic
    # is the weight TMA (with the evict-first hint): no x, no y, no workspace, no counters.
    wait = ptx.index("griddepcontrol.wait")
    first_tma = ptx.index("cp.async.bulk.tensor")
    assert first_tma < wait if cfg.pre_wait_stages else wait < first_tma
    if cfg.trigger_at == 0:
        assert ptx.index("griddepcontrol.launch_dependents") < first_tma
    elif cfg.trigger_at in (1, 2):
        # After the consumers' wait; "streamed": also after the main loop's last wgmma wait.
        trigger = ptx.index("griddepcontrol.launch_dependents")
        assert trigger > wait
        if cfg.trigger_at == 2:
            assert trigger > re.search(r"wgmma\.wait_group\.sync\.aligned\s+0", ptx).start()
    prologue = ptx[:wait]
    # Summed partials leave L2 without a write-back (discard_partials), after the wait.
    assert "discard.global.L2" in ptx[wait:] and "discard." not in prologue
    # The L2 prefetch of the next W tiles (weight traffic, so it belongs before the wait): one
    # instruction per 64 x 64 W box of an iteration, all of them in the prologue.
    prefetches = [i for i, line in enumerate(ptx.splitlines()) if "cp.async.bulk.prefetch.tensor.2d.L2" in line]
    assert len(prefetches) == (cfg.row_wgs * cfg.halves * cfg.block_k // 64 if cfg.l2_prefetch else 0)
    assert all(i < prologue.count("\n") for i in prefetches)
    assert (str(EVICT_FIRST) in prologue) == bool(cfg.pre_wait_stages)
    for op in ("ld.global", "st.global", "atom.", "red."):
        assert not re.search(r"(?<![\w.])" + re.escape(op), prologue), f"{op} before griddepcontrol.wait"
    # Every cp.async.bulk.tensor before the wait uses the W descriptor's hint register.
    hints = re.findall(r"mov\.b64\s+(%rd\d+),\s*(\d+);", prologue)
    w_regs = {r for r, v in hints if int(v) == EVICT_FIRST}
    for line in prologue.splitlines():
        if "cp.async.bulk.tensor" in line:
            assert line.rstrip(";").split(",")[-1].strip() in w_regs, line


@pytest.mark.parametrize("k, n, epilogue", SPEC_SHAPES)
@pytest.mark.parametrize("m", [1, 8, 64])
def test_ptx_spec_shapes(m, k, n, epilogue):
    _check_ptx(ptx_of(m, k, n, epilogue), GemmConfig(m, k, n, epilogue))


@pytest.mark.parametrize(
    "m, k, n, epilogue",
    [
        (3, 1024, 1024, None),            # odd M: masked batch rows
        (200, 1024, 5632, "silu_mul"),    # two batch warpgroups, the second partly padded
        (256, 7168, 10240, None),         # M = 256: 2 x m64n128 per k-step
        (160, 8192, 7168, None),          # one 64-row unit per CTA, m64n160, no split
        (8, 128, 192, None),              # N not a multiple of 128: one 64-row half per tile
    ],
)
def test_ptx_other_shapes(m, k, n, epilogue):
    cfg = GemmConfig(m, k, n, epilogue)
    _check_ptx(ptx_of(m, k, n, epilogue), cfg)


@pytest.mark.parametrize("m, k, n, epilogue, tuning", [
    (64, 7168, 36864, "silu_mul", dict(row_wgs=2)),    # two row warpgroups (256-row tiles)
    (32, 1024, 36864, None, dict(row_wgs=2)),          # two row warpgroups, plain
    (8, 7168, 10240, None, dict(l2_prefetch=0)),       # no L2 prefetch
    (8, 7168, 10240, None, dict(l2_prefetch=16)),
    (8, 7168, 10240, None, dict(pre_wait_stages=4)),   # the other stages' W after the wait
    (8, 7168, 10240, None, dict(pre_wait_stages=0)),   # no weight traffic before it
    (8, 8192, 7168, None, dict(trigger_at=1)),         # the trigger after the wait
    (64, 7168, 36864, "silu_mul", dict(trigger_at=2)),  # ... after the last k-block
    (1, 18432, 7168, None, dict(trigger_at=3)),        # ... at exit (none in the code)
    (8, 8192, 7168, None, dict(w_blocked=1)),          # W in 8 KB blocks: 4-D W boxes
    (64, 7168, 36864, "silu_mul", dict(w_blocked=1)),
    (32, 8192, 7168, None, dict(w_blocked=1, block_k=128)),
])
def test_ptx_tuning_variants(m, k, n, epilogue, tuning):
    cfg = GemmConfig(m, k, n, epilogue, **tuning)
    _check_ptx(gemm.linear_ptx(m, k, n, epilogue, **tuning), cfg)


@pytest.mark.parametrize("m", [1, 2, 5, 7])
def test_small_m_same_code_path_as_m8(m):
    """M = 1..7 pad to mma_n = 8 and must run M = 8's (GPU-verified) code path: the same
    TMA loads (2-D, two coordinates: x's batch mode is not dropped for a size-1 M), wgmma,
    barriers and PDL instructions in the same order; only the epilogue's row mask differs.
    M = 1 used to emit cp.async.bulk.tensor.1d for x (illegal instruction on an H200)."""
    k, n = 1024, 1024
    assert GemmConfig(m, k, n).mma_n == GemmConfig(8, k, n).mma_n == 8
    ptx, ref = ptx_of(m, k, n, None), ptx_of(8, k, n, None)
    _check_ptx(ptx, GemmConfig(m, k, n))
    assert [(d, len(c)) for d, c in _tma_loads(ptx)] == [(d, len(c)) for d, c in _tma_loads(ref)]
    assert _sync_skeleton(ptx) == _sync_skeleton(ref)
    for bad in ("trap;", "brkpt;", "cp.async.bulk.tensor.1d"):
        assert bad not in ptx


@pytest.mark.skipif(shutil.which("ptxas") is None or shutil.which("cuobjdump") is None
                    or shutil.which("nvdisasm") is None,
                    reason="needs ptxas, cuobjdump and nvdisasm (CUDA toolkit)")
def test_sass_m1_tma_loads_are_2d(tmp_path):
    """The SASS of M = 1 (where the GPU reported the illegal instruction at +0xa40, a
    UTMALDG.1D): every TMA load is UTMALDG.2D, as for M = 8."""
    for m in (1, 8):
        src = tmp_path / f"m{m}.ptx"
        src.write_text(ptx_of(m, 1024, 1024, None))
        cubin = tmp_path / f"m{m}.cubin"
        run_ptxas(src, cubin)
        sass = subprocess.run(["cuobjdump", "--dump-sass", str(cubin)], check=True,
                              capture_output=True, text=True).stdout
        loads = re.findall(r"UTMALDG\.(\w+)", sass)
        assert loads and set(loads) == {"2D"}, (m, loads)


@pytest.mark.skipif(shutil.which("ptxas") is None or shutil.which("cuobjdump") is None
                    or shutil.which("nvdisasm") is None,
                    reason="needs ptxas, cuobjdump and nvdisasm (CUDA toolkit)")
@pytest.mark.parametrize("m, k, n", [(256, 7168, 10240), (200, 7168, 10240)])
def test_sass_spills_only_after_the_main_loop(tmp_path, m, k, n):
    """M = 256 and 200 plain spill a little in the split reduction (test_register_spills): no
    local memory access may come before the main loop's last wgmma."""
    src = tmp_path / "gemm.ptx"
    src.write_text(ptx_of(m, k, n, None))
    cubin = tmp_path / "gemm.cubin"
    run_ptxas(src, cubin)
    sass = subprocess.run(["cuobjdump", "--dump-sass", str(cubin)], check=True,
                          capture_output=True, text=True).stdout.splitlines()
    mma = [i for i, line in enumerate(sass) if "HGMMA" in line]
    local = [i for i, line in enumerate(sass) if re.search(r"\b(STL|LDL)\b", line)]
    assert mma and local and min(local) > max(mma), (len(mma), local[:3])


@pytest.mark.parametrize("m, k, n, epilogue", [(8, 7168, 10240, None), (64, 1024, 5632, "silu_mul")])
def test_ptx_block_k_128(m, k, n, epilogue):
    """K = 128 per stage: two 64-wide TMA boxes per 64-row half, 8 wgmma k-steps per half."""
    cfg = GemmConfig(m, k, n, epilogue, block_k=128)
    ptx = ptx_of(m, k, n, epilogue, 128)
    _check_ptx(ptx, cfg)
    assert ptx.count(f"m64n{cfg.mma_n}k16") == 8 * cfg.halves


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit)")
@pytest.mark.parametrize(
    "m, k, n, epilogue, max_spill",
    [
        (64, 18432, 7168, None, 0),          # decode: nothing may spill
        (64, 7168, 36864, "silu_mul", 0),
        # M = 256 with silu_mul holds 128 fp32 accumulators per thread; ptxas spills a few
        # bytes in the split-tile reduction (once per tile, not in the main loop).
        (256, 7168, 36864, "silu_mul", 64),
        # M = 256 plain: the split reduction has two paths (partials staged in rounds, or the
        # register path for a reducer that is not first in CTA order); ptxas spills ~0.5 KB
        # around them, after the main loop (SASS: no local memory access before the last HGMMA).
        (256, 7168, 10240, None, 640),
        # A 64-row half per warpgroup (65-200 rows): none at 128; at 200 (104 accumulators per
        # thread) ~0.5 KB, also after the main loop (test_sass_spills_only_after_the_main_loop).
        (128, 8192, 7168, None, 0),
        (200, 7168, 10240, None, 640),
        (160, 8192, 7168, None, 0),          # one 64-row unit per CTA, 80 accumulators
    ],
)
def test_register_spills(tmp_path, m, k, n, epilogue, max_spill):
    src = tmp_path / "gemm.ptx"
    src.write_text(ptx_of(m, k, n, epilogue))
    report = run_ptxas(src, tmp_path / "gemm.cubin", "-v")
    spill = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    assert spill <= max_spill, report
    # ptxas serializes the main loop's wgmma when other instructions may read the accumulators
    # in flight (C7514): 1.7x slower at 160 rows when it happened (bench/gemm_notes.md §22).
    assert "C7514" not in report, report


def test_compile_cache_reuses(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHC_CACHE_DIR", str(tmp_path))
    cache = gemm_stream_k.compile_cache()
    cache.clear_memory()
    first = gemm.compile_linear(8, 1024, 1024)
    assert gemm.compile_linear(8, 1024, 1024) is first
    assert cache.stats["memory_hits"] >= 1


def test_timeline_instrumentation_still_applies():
    """bench/gemm_timeline.py patches kernels/gemm_stream_k.py at fixed anchors: each must still occur
    exactly once, and the patched source must still be valid Python."""
    import ast
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "bench" / "gemm_timeline.py"
    spec = importlib.util.spec_from_file_location("gemm_timeline", path)
    timeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timeline)
    src = timeline.instrumented_source()
    ast.parse(src)
    assert src.count("globaltimer_lo()") == 12 and 'CompileCache("gemm_timeline"' in src
    # Its workspaces (which hold the timer words) are apart from the shipped kernel's.
    assert '("gemm_timeline", index' in src and '("gemm", index' not in src


# ------------------------------------------------------------------------------------------------
# The whole-K tiles of kernels/gemm_wide.py, and which kernel ``linear`` runs (gemm.plan).
# ------------------------------------------------------------------------------------------------
from graphc.kernels import gemm_wide  # noqa: E402
from graphc.kernels.gemm_wide import WideGemmConfig  # noqa: E402


@pytest.mark.parametrize("m, k, n, tile, ctas, cluster_shares, default", [
    (256, 8192, 7168, (128, 112), 128, "w", True),     # o_proj: cuBLAS's own choice there (ncu)
    (256, 18432, 7168, (128, 112), 128, "w", True),    # down
    (256, 7168, 10240, (128, 160), 128, "w", True),    # qkv
    (128, 8192, 7168, (64, 112), 128, "w", False),     # 128 x 56: an odd number of 8-row atoms; o_proj
                                                       # runs one whole-K unit per CTA (stream-K)
    (128, 18432, 7168, (64, 112), 128, "w", True),     # down
    (128, 7168, 10240, (128, 80), 128, None, True),    # one batch tile, one tile per CTA: no pairs
    (128, 7168, 163840, (128, 256), 132, "x", True),   # lm_head: 640 tiles, 5 waves; pairs share x
    (256, 7168, 163840, (128, 256), 132, "w", True),   # ... 1280 tiles; pairs share W
    (200, 8192, 7168, (128, 112), 128, "w", False),    # the second batch tile 56% padding
    (208, 7168, 10240, (128, 160), 128, "w", True),    # 81% real rows, one wave, stream-K would split
    (208, 8192, 7168, (128, 112), 128, "w", False),    # ... but o_proj's 64-row units go whole
    (208, 7168, 163840, (128, 256), 132, "w", False),  # ... several waves: 90% needed
    (240, 8192, 7168, (128, 112), 128, "w", True),
    (64, 8192, 7168, (64, 64), 112, None, False),      # below WIDE_MIN_M
    (64, 1024, 8384, (64, 64), 131, None, False),      # an odd number of tiles: no pairs
])
def test_wide_tile_choice(m, k, n, tile, ctas, cluster_shares, default):
    cfg = WideGemmConfig(m, k, n, 132)
    assert isinstance(gemm.plan(m, k, n, None, 132), WideGemmConfig) == default
    assert (cfg.batch_tile, cfg.n_tile) == tile and cfg.ctas == ctas
    assert cfg.cluster_shares == cluster_shares and cfg.cluster == (2 if cluster_shares else 1)
    assert (WideGemmConfig.wave_fill(m, n, 132, *tile) >= gemm_wide.WIDE_MIN_FILL) or not default
    # Every tile computed once, by the CTAs in turn.
    done = sorted(t for c in range(cfg.ctas) for t in cfg.tiles_of(c))
    assert done == list(range(cfg.tiles))
    long_k = cfg.k_blocks >= gemm_wide.DEEP_PIPELINE_MIN_K_BLOCKS
    assert cfg.stages * cfg.stage_bytes <= (SMEM_MAX if long_k else SMEM_BUDGET)


@pytest.mark.parametrize("m, k, n, tuning, shares", [
    (256, 8192, 7168, {}, "w"),                                        # the default pairs
    (128, 7168, 163840, {}, "x"),                                      # one batch tile, 5 waves
    (256, 8192, 7168, {"cluster": 4}, "w+x"),
    (256, 7168, 10240, {"cluster": 4, "x_group": 4}, "x"),             # two batch tiles, x in fours
    (192, 7168, 10240, {"batch_tile": 64, "n_tile": 256, "cluster": 4}, "x"),   # cuBLAS's 4 x 1
    (150, 8192, 7168, {"batch_tile": 64, "cluster": 2}, "x"),          # three batch tiles
    (200, 1024, 4096, {"n_tile": 16, "cluster": 4, "x_group": 4}, "x"),  # several tiles per CTA
    (256, 1024, 4096, {"batch_tile": 64, "n_tile": 32, "cluster": 4}, "w+x"),  # four batch tiles
    (150, 8192, 7168, {"batch_tile": 64, "cluster": 1}, None),
    (192, 7168, 10240, {"batch_tile": 64, "n_tile": 256, "cluster": 3, "w_blocked": 1}, "w"),  # W in threes
    (150, 1024, 4096, {"batch_tile": 64, "n_tile": 16, "cluster": 3, "w_blocked": 1}, "w"),    # several per CTA
    (256, 1024, 4096, {"batch_tile": 64, "n_tile": 32, "cluster": 4, "x_group": 1, "w_blocked": 1}, "w"),
])
def test_wide_cluster_tiles(m, k, n, tuning, shares):
    """Every tile computed exactly once, and at every step of the persistent loop the CTAs of a
    cluster compute the group its multicasts assume: ranks sharing W (the same x_rank) one W
    tile, ranks sharing x (the same w_rank) one batch tile, and every CTA of a cluster the
    same number of tiles (each stage is released by all of them)."""
    cfg = WideGemmConfig(m, k, n, 132, **tuning)
    assert cfg.cluster_shares == shares and cfg.cluster == cfg.x_multicast * cfg.w_multicast
    coords = [cfg.tile_coords(t) for t in range(cfg.tiles)]
    assert sorted(coords) == [(w, b) for w in range(cfg.n_tiles) for b in range(cfg.batch_tiles)]
    for first in range(0, cfg.ctas, cfg.cluster):
        ranks = range(cfg.cluster)
        steps = {len(cfg.tiles_of(first + r)) for r in ranks}
        assert len(steps) == 1
        for local in range(steps.pop()):
            tile = {r: coords[cfg.tiles_of(first + r)[local]] for r in ranks}
            for r in ranks:
                w_rank, x_rank = r % cfg.w_multicast, r // cfg.w_multicast
                w_peer = x_rank * cfg.w_multicast            # rank 0 of r's W group
                x_peer = w_rank                              # rank 0 of r's x group
                assert tile[r][0] == tile[w_peer][0] and tile[r][1] == tile[x_peer][1]
                # ... and the group is neighbouring tiles: W tiles x_rank apart, batch tiles w_rank.
                assert tile[r] == (tile[0][0] + x_rank, tile[0][1] + w_rank)


def test_wide_l2_reads():
    """What a configuration reads from L2, by hand: at qkv 192 rows on 64 x 256 tiles (3 x 40
    tiles), W (256 x 7168 bf16 per tile) is read by each of the three batch tiles unless they
    share it, x (64 x 7168 per tile) by each W tile unless a group shares it."""
    w_tile, x_tile = 256 * 7168 * 2, 64 * 7168 * 2
    tiles = dict(batch_tile=64, n_tile=256, w_blocked=1)
    for tuning, w, x in [(dict(cluster=1), 120 * w_tile, 120 * x_tile),
                         (dict(cluster=4), 120 * w_tile, 30 * x_tile),      # x in fours
                         (dict(cluster=3), 40 * w_tile, 120 * x_tile)]:     # W in threes
        cfg = WideGemmConfig(192, 7168, 10240, 132, **tiles, **tuning)
        assert cfg.l2_read_bytes == (w, x), tuning
        assert f"L2 reads W {w / 1e6:.0f} + x {x / 1e6:.0f} MB)" in repr(cfg)
    # The default pairs at o_proj 256 rows: 128 x 112 tiles, W shared by the two batch tiles.
    pairs = WideGemmConfig(256, 8192, 7168, 132)
    assert pairs.l2_read_bytes == (64 * 112 * 8192 * 2, 128 * 2 * 64 * 8192 * 2)


@pytest.mark.parametrize("sms", [132, 114, 78, 120])
def test_wide_default_bounds_what_it_rereads_from_l2(sms):
    """Wave fill alone picks whole-K tiles 16-32 W rows wide for the Kimi shapes on grids other
    than 132 SMs (qkv at 256 rows on an H100 PCIe's 114: 64 x 16, x re-read 4x W's bytes;
    bench/gemm_notes.md §45), and on 132 SMs three 64-row batch tiles each streaming all of W
    (N = 9984 at 173-192 rows, §48): the default is then the stream-K kernel. On 132 SMs the
    Kimi shapes keep the tiles of test_wide_tile_choice; tiny.yaml's toy shapes at 128 and
    205-256 rows (128 x 16 and 64 x 16 tiles of N = 1024) go to stream-K."""
    kimi = [(7168, 10240), (8192, 7168), (18432, 7168), (7168, 163840)]
    for k, n in kimi + [(1024, 1024), (2816, 1024), (1024, 1536), (7168, 9984), (4096, 11008)]:
        for m in range(gemm_wide.WIDE_MIN_M, 257):
            cfg = gemm.plan(m, k, n, None, sms)
            if isinstance(cfg, WideGemmConfig):
                assert cfg.batch_tile <= gemm_wide.WIDE_MAX_X_PER_W * cfg.n_tile, (m, k, n, cfg)
                assert cfg.w_reads <= gemm_wide.WIDE_MAX_W_READS, (m, k, n, cfg)
    assert isinstance(gemm.plan(256, 7168, 10240, None, 114), GemmConfig)
    assert WideGemmConfig.choose_tile(256, 10240, 114) == (64, 16)          # what fill alone picks
    for m, k, n, tile in [(256, 7168, 10240, (128, 160)), (128, 7168, 10240, (128, 80)),
                          (256, 18432, 7168, (128, 112)), (256, 7168, 163840, (128, 256))]:
        wide = gemm.plan(m, k, n, None, 132)
        assert isinstance(wide, WideGemmConfig) and (wide.batch_tile, wide.n_tile) == tile
        assert wide.w_reads == 1                       # one batch tile, or W pairs
    assert isinstance(gemm.plan(256, 1024, 1024, None, 132), GemmConfig)
    assert WideGemmConfig.choose_tile(256, 1024, 132) == (128, 16)
    # N = 9984 at 192 rows: fill alone picks 3 x 208 tiles of 64 x 48, each batch tile reading
    # all of W (429 MB from L2 for W's 143), which ran 1.65x the stream-K kernel.
    assert WideGemmConfig.choose_tile(192, 9984, 132) == (64, 48)
    narrow = WideGemmConfig(192, 7168, 9984, 132)
    assert narrow.w_reads == 3 and narrow.l2_read_bytes[0] == 3 * 9984 * 7168 * 2
    assert isinstance(gemm.plan(192, 7168, 9984, None, 132), GemmConfig)
    # W in threes (a knob) reads it once, as the pairs do.
    assert WideGemmConfig(192, 7168, 10240, 132, batch_tile=64, n_tile=256, cluster=3, w_blocked=1).w_reads == 1
    # A knob still runs any tile it names (bench/gemm.py's variants).
    assert gemm.plan(256, 7168, 10240, None, 114, wide=1).n_tile == 16


def test_wide_ring_depth_fills_more_shared_memory_only_for_a_long_k():
    """down (288 k-blocks) at 256 rows: 7 stages of 30 KB (210 KB, past SMEM_BUDGET); o_proj
    (128 k-blocks) on the same tile keeps 6; the knob still says otherwise, up to SMEM_MAX."""
    down, o_proj = WideGemmConfig(256, 18432, 7168, 132), WideGemmConfig(256, 8192, 7168, 132)
    assert down.stage_bytes == o_proj.stage_bytes == 30 * 1024
    assert (down.stages, o_proj.stages) == (7, 6)
    assert WideGemmConfig(256, 18432, 7168, 132, stages=6).stages == 6
    with pytest.raises(ValueError, match="stages=8"):
        WideGemmConfig(256, 8192, 7168, 132, stages=8)


def test_plan_routes_between_the_two_kernels():
    # Below WIDE_MIN_M, with the fused activation, or with a stream-K knob: the stream-K kernel.
    assert isinstance(gemm.plan(64, 8192, 7168, None, 132), GemmConfig)
    assert isinstance(gemm.plan(127, 8192, 7168, None, 132), GemmConfig)
    # 116-127 rows: the whole-K tiles only as one 128-row batch tile (qkv, lm_head), not as two
    # overlapping 64-row ones (down), nor below 90% real rows.
    assert isinstance(gemm.plan(120, 7168, 10240, None, 132), WideGemmConfig)
    assert gemm.plan(120, 7168, 10240, None, 132).batch_tiles == 1
    assert isinstance(gemm.plan(116, 7168, 163840, None, 132), WideGemmConfig)
    assert isinstance(gemm.plan(120, 18432, 7168, None, 132), GemmConfig)
    assert isinstance(gemm.plan(115, 7168, 10240, None, 132), GemmConfig)
    assert isinstance(gemm.plan(256, 7168, 36864, "silu_mul", 132), GemmConfig)
    assert isinstance(gemm.plan(256, 8192, 7168, None, 132, publish_first=1), GemmConfig)
    assert isinstance(gemm.plan(256, 8192, 7168, None, 132, wide=0), GemmConfig)
    assert isinstance(gemm.plan(8, 8192, 7168, None, 132, wide=1), WideGemmConfig)
    assert gemm.plan(256, 8192, 7168, None, 132).cluster == 2
    assert gemm.plan(256, 8192, 7168, None, 132, cluster=1).cluster == 1
    # One batch tile: pairs of W tiles may share x; by default only over several waves.
    assert gemm.plan(128, 7168, 10240, None, 132, cluster=2).cluster_shares == "x"
    assert gemm.plan(128, 7168, 163840, None, 132, cluster=1).cluster_shares is None
    three = gemm.plan(150, 8192, 7168, None, 132, wide=1, batch_tile=64)   # three batch tiles
    assert three.cluster == 1 and three.batch_tiles == 3
    # ... which no W pair divides, but whose W tiles pair or group in fours to share x.
    assert gemm.plan(150, 8192, 7168, None, 132, wide=1, batch_tile=64, cluster=2).cluster_shares == "x"
    assert gemm.plan(150, 8192, 7168, None, 132, wide=1, batch_tile=64, cluster=4).x_multicast == 4
    with pytest.raises(ValueError, match="cluster=4, x_group=2 unsupported"):
        gemm.plan(150, 8192, 7168, None, 132, wide=1, batch_tile=64, cluster=4, x_group=2)
    with pytest.raises(ValueError, match="cluster=2, x_group=4 unsupported"):
        gemm.plan(256, 8192, 7168, None, 132, wide=1, cluster=2, x_group=4)
    # W shared by three or four batch tiles: whole boxes of W in blocks, each CTA every third.
    with pytest.raises(ValueError, match="cluster=3, x_group=1 unsupported.*needs W in blocks"):
        gemm.plan(192, 7168, 10240, None, 132, wide=1, batch_tile=64, n_tile=256, cluster=3)
    with pytest.raises(ValueError, match="cluster=3, x_group=1 unsupported"):        # two batch tiles
        gemm.plan(256, 7168, 10240, None, 132, wide=1, cluster=3, w_blocked=1)
    with pytest.raises(ValueError, match="cluster=3, x_group=3 unsupported"):
        gemm.plan(192, 7168, 10240, None, 132, wide=1, batch_tile=64, n_tile=256, cluster=3, x_group=3)
    threes = gemm.plan(192, 7168, 10240, None, 132, wide=1, batch_tile=64, n_tile=256, cluster=3, w_blocked=1)
    assert (threes.w_multicast, threes.x_multicast, threes.w_boxes, threes.ctas) == (3, 1, 16, 120)
    wide = gemm.plan(256, 8192, 7168, None, 132, n_tile=224, stages=3)
    assert (wide.n_tile, wide.stages, wide.batch_tile) == (224, 3, 128)
    assert gemm.cache_of(wide) is gemm_wide.compile_cache() and gemm.cache_of(gemm.plan(8, 1024, 1024)) is gemm_stream_k.compile_cache()
    # 81-90% real batch rows: the whole-K tiles only in one wave against a split stream-K.
    assert isinstance(gemm.plan(208, 7168, 10240, None, 132), WideGemmConfig)
    assert isinstance(gemm.plan(204, 7168, 10240, None, 132), GemmConfig)
    assert gemm.plan(208, 8192, 7168, None, 132).max_segs == 1
    # A few tiles on many SMs: the waves would be mostly idle, so stream-K stays.
    assert isinstance(gemm.plan(128, 1024, 1536, None, 132), GemmConfig)
    # silu_mul: the whole-K tiles only as a knob (gemm_wide.default_applies says why), so a
    # build keeps storing gate_up's weight in blocks.
    for m in (128, 192, 256):
        assert isinstance(gemm.plan(m, 7168, 36864, "silu_mul", 132), GemmConfig)
        assert gemm.reads_blocks(m, 7168, 36864, "silu_mul")
    silu = gemm.plan(256, 7168, 36864, "silu_mul", 132, wide=1)
    assert isinstance(silu, WideGemmConfig) and silu.n_out == 18432 and silu.n_tile % 32 == 0
    assert WideGemmConfig.from_key(silu.key()).key() == silu.key() and silu.key() != gemm.plan(
        256, 7168, 36864, None, 132, wide=1, n_tile=silu.n_tile).key()
    with pytest.raises(ValueError, match="n_tile=48 unsupported: a multiple of 32.*gate rows"):
        gemm.plan(256, 7168, 36864, "silu_mul", 132, wide=1, n_tile=48)
    with pytest.raises(ValueError, match="publish_first.*stream-K"):
        gemm.plan(256, 8192, 7168, None, 132, wide=1, publish_first=1)
    with pytest.raises(ValueError, match="n_tile.*wide=1 only"):
        gemm.plan(256, 8192, 7168, None, 132, wide=0, n_tile=112)
    with pytest.raises(ValueError, match="n_tile=120 unsupported"):
        gemm.plan(256, 8192, 7168, None, 132, n_tile=120)
    with pytest.raises(ValueError, match="batch_tile=32 unsupported"):
        gemm.plan(256, 8192, 7168, None, 132, batch_tile=32)
    with pytest.raises(ValueError, match="1 <= M <= 256"):
        gemm.plan(300, 8192, 7168, None, 132, wide=1)
    with pytest.raises(ValueError, match="wide=2 unsupported"):
        gemm.plan(256, 8192, 7168, None, 132, wide=2)
    key = gemm.plan(200, 1024, 4096, None, 132, wide=1, n_tile=16).key()
    assert WideGemmConfig.from_key(key).key() == key


def test_compile_caches_hash_the_shared_pipeline_helpers():
    """The decode GEMMs' objects on disk are keyed by kernels/smem_pipeline.py's source too (it
    generates part of their code) and by kernels/weight_blocks.py's (its block size shapes the
    weight layout they read), so an edit there cannot leave stale kernels behind."""
    from graphc.kernels import smem_pipeline, weight_blocks
    from graphc.kernels.compile_cache import CompileCache

    for cache, module in ((gemm_stream_k.compile_cache(), gemm_stream_k), (gemm_wide.compile_cache(), gemm_wide)):
        key = (8, 1024, 1024)
        assert cache.digest(key) == CompileCache(cache.name, None, (module, smem_pipeline, weight_blocks)).digest(key)
        assert cache.digest(key) != CompileCache(cache.name, None, (module, smem_pipeline)).digest(key)
        assert cache.digest(key) != CompileCache(cache.name, None, module).digest(key)
    assert CompileCache("t", None, ("a", "b")).digest((1,)) != CompileCache("t", None, ("a", "c")).digest((1,))


def test_wide_x_boxes_trimmed_below_48_rows():
    """One batch tile below 48 rows: each warpgroup's x box holds x's rows rounded up to 16
    (TMA zero-fills rows past x); the stage barrier expects only those bytes; the shared
    memory per stage stays a 64-row buffer."""
    for m, rows in ((1, 16), (8, 16), (17, 32), (40, 48), (48, 48)):
        cfg = gemm.plan(m, 7168, 10240, None, 132, wide=1)
        assert (cfg.x_trim, cfg.x_box_rows) == (1, rows)
        assert cfg.stage_tx_bytes == rows * 64 * 2 + cfg.n_tile * 64 * 2
        assert cfg.stage_bytes == 64 * 64 * 2 + cfg.n_tile * 64 * 2
    for m, tuning in ((49, {}), (64, {}), (128, {}), (32, {"cluster": 2}), (8, {"x_trim": 0})):
        cfg = gemm.plan(m, 7168, 10240, None, 132, wide=1, **tuning)
        assert cfg.x_trim == 0 and cfg.x_box_rows == 64 and cfg.stage_tx_bytes == cfg.stage_bytes, (m, tuning)
    with pytest.raises(ValueError, match="x_trim=1 unsupported"):
        gemm.plan(64, 7168, 10240, None, 132, wide=1, x_trim=1)
    with pytest.raises(ValueError, match="x_trim=1 unsupported"):
        gemm.plan(32, 7168, 10240, None, 132, wide=1, cluster=2, x_trim=1)
    # Both kernels take the knob; it implies neither.
    assert isinstance(gemm.plan(120, 8192, 7168, None, 132, x_trim=0), GemmConfig)


@pytest.mark.parametrize("m, k, n, tuning", [
    (256, 8192, 7168, {}),
    (200, 8192, 7168, {"cluster": 1}),
    (128, 7168, 163840, {}),                  # several tiles per CTA
    (3, 2816, 1024, {"n_tile": 64, "batch_tile": 128}),
    (40, 7168, 10240, {}),                    # x boxes of 48 rows (x_trim)
    (64, 8192, 7168, {"cluster": 2}),         # one batch tile: x shared by pairs of W tiles
    (256, 8192, 7168, {"cluster": 4}),        # 2 x 2 tiles: W shared by pairs and x by pairs
    (192, 7168, 10240, {"batch_tile": 64, "n_tile": 256, "cluster": 4}),   # x shared by fours
    (256, 8192, 7168, {"static_stages": 1}),  # both k-block loops unrolled by the stage count
    (64, 8192, 7168, {"cluster": 2, "static_stages": 1}),   # ... with x shared by pairs
    (128, 7168, 163840, {"static_stages": 1}),  # ... over 4-5 tiles per CTA, each 28 rounds of 4
    (256, 8192, 7168, {"wg_release": 1}),     # one release per warpgroup and CTA
    (128, 7168, 163840, {"wg_release": 1, "static_stages": 1}),   # ... x pairs, stages constant
])
def test_wide_ptx(m, k, n, tuning):
    cfg = gemm.plan(m, k, n, None, 132, wide=1, **tuning)
    ptx = _wide_ptx(cfg)
    assert ".target sm_90a" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.n_tile}k16.f32.bf16.bf16" in ptx
    tma = _tma_loads(ptx)
    assert tma and all(dim == "2d" and len(coords) == 2 for dim, coords in tma)
    # PDL: trigger first; before the wait only the W loads, with the evict-first hint.
    trigger, wait = ptx.index("griddepcontrol.launch_dependents"), ptx.index("griddepcontrol.wait")
    assert trigger < ptx.index("cp.async.bulk.tensor") < wait
    prologue = ptx[:wait]
    for op in ("ld.global", "st.global", "atom.", "red."):
        assert not re.search(r"(?<![\w.])" + re.escape(op), prologue), f"{op} before griddepcontrol.wait"
    w_regs = {r for r, v in re.findall(r"mov\.b64\s+(%rd\d+),\s*(\d+);", prologue) if int(v) == EVICT_FIRST}
    loads = [line for line in prologue.splitlines() if "cp.async.bulk.tensor" in line]
    assert loads and all(line.rstrip(";").split(",")[-1].strip() in w_regs for line in loads)
    # No split K: no workspace, no counters, no atomics anywhere.
    assert not re.search(r"(?<![\w.])(atom|red)\.", ptx)
    # y: one 4-byte store per pair of adjacent columns (two bf16 rounded by one cvt).
    assert "st.global.b32" in ptx and "cvt.rn.bf16x2.f32" in ptx and "st.global.b16" not in ptx
    # Clusters: the shared operand (x's or W's loads, both in clusters of four) multicast into
    # the CTAs sharing it, stages released in every CTA of the cluster.
    evict_first = {r for r, v in re.findall(r"mov\.b64\s+(%rd\d+),\s*(\d+);", ptx) if int(v) == EVICT_FIRST}
    multicast = {line.rstrip(";").split(",")[-1].strip() in evict_first     # W's loads carry that hint
                 for line in ptx.splitlines() if "cp.async.bulk.tensor" in line and "multicast::cluster" in line}
    assert multicast == ({"x": {False}, "w": {True}, "w+x": {False, True}, None: set()}[cfg.cluster_shares])
    assert ("mbarrier.arrive.shared::cluster" in ptx) == (cfg.cluster > 1)


@pytest.mark.parametrize("m, tuning, boxes, pair", [
    (256, {}, (96, 2, 96), "w"),                                  # gate box, up box; a pair shares W
    (128, {}, (48, 2, 48), "x"),                                  # ... a pair shares x
    (256, {"w_blocked": 1}, (16, 12, 16), "w"),                   # 16-row pieces of 64-row blocks
    (256, {"w_blocked": 1, "w_block_rows": 16}, (96, 2, 96), "w"),   # one box of whole blocks per half
    (256, {"cluster": 1, "n_tile": 64}, (32, 2, 32), None),
])
def test_wide_silu_mul_ptx(m, tuning, boxes, pair):
    """silu_mul on the whole-K tiles (gate_up, K = 7168, N = 36864): each stage's W is the
    tile's gate rows and its up rows, I = 18432 rows apart, as separate boxes, all loaded before
    the PDL wait; the epilogue computes silu(g) * u in fp32 (ex2, one rounding per value) and
    stores half the tile's columns."""
    cfg = gemm.plan(m, 7168, 36864, "silu_mul", 132, wide=1, **tuning)
    assert (cfg.w_box_rows, cfg.w_boxes, cfg.w_box_step) == boxes and cfg.cluster_shares == pair
    # Box p's first W row: gate boxes from row n_blk * n_tile / 2, up boxes I rows further.
    half = cfg.n_tile // 2
    rows = [cfg.w_box_row(3, p) for p in range(cfg.w_boxes)]
    per_half = cfg.w_boxes // 2
    assert rows == [3 * half + q * cfg.w_box_step for q in range(per_half)] + \
                   [18432 + 3 * half + q * cfg.w_box_step for q in range(per_half)]
    ptx = _wide_ptx(cfg)
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.n_tile}k16.f32.bf16.bf16" in ptx
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("cp.async.bulk.tensor") < wait
    w_dim = "4d" if cfg.w_blocked else "2d"
    assert [dim for dim, _ in _tma_loads(ptx[:wait])] == [w_dim] * cfg.w_boxes
    for op in ("ld.global", "st.global", "atom.", "red."):
        assert not re.search(r"(?<![\w.])" + re.escape(op), ptx[:wait]), f"{op} before griddepcontrol.wait"
    assert "ex2.approx" in ptx and "cvt.rn.bf16x2.f32" in ptx and "st.global.b32" in ptx
    assert not re.search(r"(?<![\w.])(atom|red)\.", ptx)
    assert cfg.stage_tx_bytes == cfg.wgs * cfg.x_box_rows * 128 + cfg.n_tile * 128


@pytest.mark.parametrize("m, k, n, tuning", [
    (256, 8192, 7168, {}),                    # 7 pieces shared by a pair of CTAs
    (128, 7168, 10240, {}),                   # 5 pieces, no pairs
    (200, 1024, 4096, {"n_tile": 16}),        # one piece, shared by a pair
    (128, 7168, 163840, {}),                  # 16 pieces; pairs share x instead
    (192, 7168, 10240, {"batch_tile": 64, "n_tile": 256, "cluster": 3}),   # 16 pieces, W in threes
    (256, 7168, 10240, {"static_stages": 1}),  # 10 pieces shared by a pair, stages constant
])
def test_wide_ptx_w_blocked(m, k, n, tuning):
    """With W in 64 x 64 blocks the whole-K tiles load each stage's W as n_tile / 16 pieces of
    16 rows, each a 4-D box (row and K within a block, block row and column), all before the
    PDL wait in the prologue; x stays 2-D. In a pair sharing W, each piece is multicast."""
    cfg = gemm.plan(m, k, n, None, 132, wide=1, w_blocked=1, **tuning)
    assert (cfg.w_box_rows, cfg.w_boxes) == (16, cfg.n_tile // 16)
    ptx = _wide_ptx(cfg)
    wait = ptx.index("griddepcontrol.wait")
    tma = _tma_loads(ptx)
    prologue = _tma_loads(ptx[:wait])
    # The prologue's loop body and the main loop's (with static_stages, each stage of a round
    # and the k-blocks left over).
    bodies = 1 + (cfg.stages + cfg.k_blocks % cfg.stages if cfg.static_stages else 1)
    assert [dim for dim, _ in prologue] == ["4d"] * cfg.w_boxes
    assert {dim for dim, _ in tma} == {"2d", "4d"} and all(len(c) == int(d[0]) for d, c in tma)
    w_loads = [line for line in ptx.splitlines() if "cp.async.bulk.tensor.4d" in line]
    assert len(w_loads) == bodies * cfg.w_boxes
    assert all(("multicast::cluster" in line) == (cfg.cluster_shares == "w") for line in w_loads)


@pytest.mark.parametrize("m, k, n, rows_kernel, blocks_kernel", [
    (1, 8192, 7168, GemmConfig, GemmConfig),
    (64, 7168, 163840, GemmConfig, GemmConfig),
    (128, 7168, 163840, WideGemmConfig, WideGemmConfig),   # 256-row W tiles: also on blocks
    (256, 7168, 10240, WideGemmConfig, WideGemmConfig),    # 160-row tiles: also on blocks
    (128, 7168, 10240, WideGemmConfig, GemmConfig),        # 80-row tiles: stream-K on blocks
    (256, 8192, 7168, WideGemmConfig, GemmConfig),         # 112-row tiles: stream-K on blocks
    (128, 18432, 7168, WideGemmConfig, GemmConfig),
    (128, 8192, 7168, GemmConfig, GemmConfig),             # one whole-K unit per CTA either way
])
def test_w_blocked_is_a_knob_of_both_kernels(m, k, n, rows_kernel, blocks_kernel):
    """Both kernels read W's blocks wherever N and K are whole blocks; with blocks the whole-K
    tiles stay the default only where their W tile is a multiple of 32 rows (measured, §34),
    and only there does a build store the weight in blocks."""
    rows, blocks = gemm.plan(m, k, n, None, 132), gemm.plan(m, k, n, None, 132, w_blocked=1)
    assert (type(rows), type(blocks)) == (rows_kernel, blocks_kernel)
    assert blocks.w_blocked == 1 and rows.w_blocked == 0
    # A build stores blocks only where they leave the kernel as it is.
    assert gemm.reads_blocks(m, k, n) == (rows_kernel is blocks_kernel)
    if blocks_kernel is WideGemmConfig:
        assert blocks.n_tile % gemm_wide.BLOCKED_N_TILE_MULTIPLE == 0
    # Forced, the whole-K tiles take blocks with any tile.
    assert gemm.plan(m, k, n, None, 132, wide=1, w_blocked=1).w_blocked == 1
    assert not gemm.reads_blocks(8, 1000, 1024)


@pytest.mark.parametrize("m, k, n, epilogue, tuning, wide_boxes", [
    (8, 8192, 7168, None, {}, None),
    (32, 8192, 7168, None, {"block_k": 128}, None),
    (256, 8192, 7168, None, {"wide": 1}, (64, 2, 48)),          # a pair: halves of 7 blocks, overlapping by one
    (256, 7168, 10240, None, {"wide": 1}, (80, 2, 80)),         # a pair: halves of 10 blocks
    (200, 1024, 4096, None, {"wide": 1, "n_tile": 16}, (16, 1, 16)),   # a pair, one block: rank 0 loads it
    (128, 7168, 10240, None, {"wide": 1}, (80, 1, 80)),         # no pair: one box of the tile's blocks
    (256, 1024, 3072, None, {"wide": 1, "n_tile": 48}, (32, 2, 16)),   # halves of 3 blocks
    (256, 1024, 320, None, {"wide": 1, "n_tile": 80}, (16, 5, 16)),    # 3 blocks do not tile 20: pieces
])
def test_ptx_16_row_blocks(m, k, n, epilogue, tuning, wide_boxes):
    """w_block_rows=16: W's loads stay 4-D boxes (a 64-row box spans four 16-row blocks; a
    whole-K tile's stage is one box of its blocks, or in a pair sharing W one box of half of
    them per CTA, multicast), x's stay 2-D."""
    cfg = gemm.plan(m, k, n, epilogue, 132, w_blocked=1, w_block_rows=16, **tuning)
    assert cfg.w_block_rows == 16 and "w_block_rows=16" in repr(cfg)
    if isinstance(cfg, WideGemmConfig):
        ptx = _wide_ptx(cfg)
    else:
        ptx = linear_ptx(m, k, n, epilogue, w_blocked=1, w_block_rows=16, **tuning)
    dims = {dim for dim, _ in _tma_loads(ptx)}
    assert dims == {"2d", "4d"}
    w_loads = [line for line in ptx.splitlines() if "cp.async.bulk.tensor.4d" in line]
    assert w_loads and (wide_boxes is None) == (not isinstance(cfg, WideGemmConfig))
    if wide_boxes is None:
        assert len(w_loads) % cfg.w_boxes == 0
        return
    assert (cfg.w_box_rows, cfg.w_boxes, cfg.w_box_step) == wide_boxes
    assert len(w_loads) == 2 * cfg.w_boxes        # the prologue's and the main loop's
    assert all(("multicast::cluster" in line) == (cfg.w_multicast == 2) for line in w_loads)
    # Each CTA's barrier expects every box of the stage, the overlapping block twice.
    assert cfg.stage_tx_bytes == cfg.wgs * cfg.x_box_rows * 128 + cfg.w_boxes * cfg.w_box_rows * 128


def test_w_block_rows_knob():
    assert gemm.plan(8, 8192, 7168, None, 132).w_block_rows == 64
    for tuning in ({"w_block_rows": 16}, {"w_blocked": 1, "w_block_rows": 32}):
        with pytest.raises(ValueError, match="w_block_rows=.* unsupported"):
            gemm.plan(8, 8192, 7168, None, 132, **tuning)
    key = gemm.plan(256, 8192, 7168, None, 132, wide=1, w_blocked=1, w_block_rows=16).key()
    assert WideGemmConfig.from_key(key).key() == key and WideGemmConfig.from_key(key).w_block_rows == 16


def _wide_ptx(cfg) -> str:
    import tempfile

    with tempfile.TemporaryDirectory() as dump_dir:
        return gemm_wide.compile_wide(cfg, options=f"--keep-ptx --dump-dir {dump_dir}").__ptx__


# ------------------------------------------------------------------------------------------------
# consumer_regs: a producer warpgroup that gives registers to the consumers (setmaxnreg).
# ------------------------------------------------------------------------------------------------


def test_consumer_regs_checks():
    # 192 accumulators per thread need the knob; without it the tile is refused by name.
    with pytest.raises(ValueError, match="at most 128 fp32 accumulators.*consumer_regs allows more"):
        GemmConfig(192, 7168, 10240, None, **TILE_256_ROWS)
    cfg = GemmConfig(192, 7168, 10240, None, consumer_regs=232, **TILE_256_ROWS)
    assert (cfg.threads, cfg.producer_warp, cfg.tiles, cfg.halves * cfg.frag) == (384, 8, 40, 192)
    assert "consumer_regs=232" in repr(cfg)
    assert GemmConfig(192, 7168, 10240, None).threads == 288        # off: one producer warp
    with pytest.raises(ValueError, match="multiple of 8"):
        GemmConfig(192, 7168, 10240, None, consumer_regs=236, **TILE_256_ROWS)
    # Two consumer warps and a producer warp per sub-partition: 2 x 240 + 40 > 512 per thread.
    with pytest.raises(ValueError, match="sub-partition.*at most 232"):
        GemmConfig(192, 7168, 10240, None, consumer_regs=240, **TILE_256_ROWS)
    # 256 batch columns in two halves (256 accumulators) do not fit even so.
    with pytest.raises(ValueError, match="at most 192 fp32 accumulators"):
        GemmConfig(256, 7168, 10240, None, consumer_regs=232, halves=2, row_wgs=2, col_wgs=1)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit)")
def test_consumer_regs_hold_256_row_tiles_without_spills(tmp_path):
    """The producer warpgroup drops to PRODUCER_REGS and the consumers rise to 232 inside their
    own branches (ptxas ignores a setmaxnreg that does not dominate the code: C7507), so 192
    accumulators per thread neither spill nor serialize wgmma (C7511 at the default 168)."""
    ptx = linear_ptx(192, 7168, 10240, None, consumer_regs=232, **TILE_256_ROWS)
    assert re.search(r"\.reqntid 384, 1, 1", ptx)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{gemm_stream_k.PRODUCER_REGS};", ptx)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232;", ptx)
    src = tmp_path / "gemm.ptx"
    src.write_text(ptx)
    report = run_ptxas(src, tmp_path / "gemm.cubin", "-v")
    assert "0 bytes spill stores" in report, report
    for code in ("C7507", "C7511", "C7514"):
        assert code not in report, report


# ------------------------------------------------------------------------------------------------
# static_stages: the whole-K tiles' k-block loops with each stage a constant (bench/gemm_notes.md §55, §56).
# ------------------------------------------------------------------------------------------------


def test_static_stages_only_where_every_tile_starts_at_stage_0():
    cfg = gemm.plan(256, 8192, 7168, None, 132, static_stages=1)
    assert isinstance(cfg, WideGemmConfig) and cfg.static_stages == 1 and cfg.tiles <= cfg.ctas
    assert WideGemmConfig.from_key(cfg.key()).key() == cfg.key()
    assert gemm.plan(256, 8192, 7168, None, 132).static_stages == 0
    # Several tiles per CTA: only with whole rounds per tile (lm_head: 112 k-blocks on 4 stages).
    lm_head = gemm.plan(128, 7168, 163840, None, 132, wide=1, static_stages=1)
    assert lm_head.tiles > lm_head.ctas and lm_head.k_blocks % lm_head.stages == 0 and lm_head.static_stages
    with pytest.raises(ValueError, match=r"static_stages=1 unsupported here \(0, or 1 where every tile starts at "
                                         r"stage 0: one tile per CTA \(384 tiles, 132 CTAs\) or k-blocks a "
                                         r"multiple of the stages \(112 on 5\)\)"):
        gemm.plan(160, 7168, 36864, "silu_mul", 132, wide=1, static_stages=1)


def test_static_stages_ptx_folds_the_stage_arithmetic():
    """With the stage a constant both main loops are unrolled by it: the consumers' body is the
    barrier wait, four wgmma, the waits and the releases, the producer's the wait on the freed
    stage and its loads, one of each per stage of a round plus the k_blocks % stages left over
    (the producer's first round, run once, stays a loop); no per-k-block modulo; the same
    number of wgmma per k-block, the same PDL placement."""
    static = _wide_ptx(gemm.plan(256, 8192, 7168, None, 132, static_stages=1))
    dynamic = _wide_ptx(gemm.plan(256, 8192, 7168, None, 132))
    cfg = gemm.plan(256, 8192, 7168, None, 132)
    assert cfg.cluster_shares == "w" and not cfg.w_split_boxes
    unrolled = cfg.stages + cfg.k_blocks % cfg.stages
    k_steps = 4                                     # 64 of K in wgmma's k16 steps
    loads = 1 + cfg.wgs                             # per k-block: this CTA's half of the W box, an x box per warpgroup
    assert static.count("wgmma.mma_async") == unrolled * k_steps
    assert dynamic.count("wgmma.mma_async") == k_steps
    # One wait per k-block loop body, consumers' and producer's.
    assert static.count("mbarrier.try_wait.parity") == 2 * unrolled
    assert dynamic.count("mbarrier.try_wait.parity") == 2
    # The producer's loads: the first round's two loops (W, x) + rounds' body + leftover;
    # dynamic: its three loops.
    assert static.count("cp.async.bulk.tensor") == (1 + unrolled) * loads
    assert dynamic.count("cp.async.bulk.tensor") == 2 * loads
    # The release's (i - 1) % stages: a 16-bit multiply in the dynamic loop, none unrolled.
    assert "mul.lo.s16" in dynamic and "mul.lo.s16" not in static
    for ptx in (static, dynamic):
        assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait")


def test_static_stages_over_several_tiles_per_cta():
    """lm_head at 128 rows (4-5 tiles per CTA, 112 k-blocks on 4 stages): one round of each
    main loop unrolled, no k-blocks left over; the producer's rounds run over all of the CTA's
    k-blocks, the consumers' per tile, each tile's epilogue once."""
    cfg = gemm.plan(128, 7168, 163840, None, 132, wide=1, static_stages=1)
    static, dynamic = _wide_ptx(cfg), _wide_ptx(gemm.plan(128, 7168, 163840, None, 132, wide=1))
    loads = 1 + cfg.wgs                             # one W box of 256 rows, an x box per warpgroup
    assert static.count("wgmma.mma_async") == cfg.stages * 4
    assert static.count("mbarrier.try_wait.parity") == 2 * cfg.stages
    assert static.count("cp.async.bulk.tensor") == (1 + cfg.stages) * loads     # first round's loops + a round
    assert static.count("st.global.b32") == dynamic.count("st.global.b32")


# ------------------------------------------------------------------------------------------------
# wg_release: a consumer warpgroup frees a stage with one arrival per CTA (bench/gemm_notes.md §57).
# ------------------------------------------------------------------------------------------------


def _empty_barrier_count(ptx: str, stages: int) -> int:
    """The arrival count the empty barriers are initialised with: the init of the second one
    (``[base + 8 * (stages + 1)]``, after the stages' full barriers; the first one's address may
    have a register of its own) names a register set to it."""
    reg = re.search(rf"mbarrier\.init\.shared\.b64\s+\[%r\d+\+{8 * (stages + 1)}\], (%r\d+);", ptx).group(1)
    return int(re.search(rf"mov\.b32\s+{reg}, (\d+);", ptx).group(1))


@pytest.mark.parametrize("m, k, n, epilogue, tuning", [
    (256, 8192, 7168, None, {}),                                           # o_proj: W pairs
    (256, 8192, 7168, None, {"static_stages": 1}),                         # ... release sites unrolled
    (128, 7168, 163840, None, {"wide": 1}),                                # lm_head: x pairs, several tiles
    (256, 7168, 36864, "silu_mul", {"wide": 1, "w_blocked": 1, "cluster": 1}),   # no cluster
])
def test_wg_release_arrives_once_per_warpgroup_and_cta(m, k, n, epilogue, tuning):
    """With wg_release the empty barriers expect a quarter of the arrivals (one per consumer
    warpgroup of each CTA sharing the stage instead of one per warp), and each release site
    issues one arrival (its lane picks the CTA) where the default issues one per CTA; the
    rest of the kernel is the default's (the same wgmma, loads and waits)."""
    default_cfg = gemm.plan(m, k, n, epilogue, 132, **tuning)
    cfg = gemm.plan(m, k, n, epilogue, 132, wg_release=1, **tuning)
    assert cfg.wg_release == 1 and default_cfg.wg_release == 0 and "wg_release=1" in repr(cfg)
    assert WideGemmConfig.from_key(cfg.key()).key() == cfg.key() != default_cfg.key()
    default, ptx = _wide_ptx(default_cfg), _wide_ptx(cfg)
    assert _empty_barrier_count(default, cfg.stages) == 4 * cfg.wgs * cfg.cluster
    assert _empty_barrier_count(ptx, cfg.stages) == cfg.wgs * cfg.cluster
    if cfg.cluster > 1:
        arrive = "mbarrier.arrive.shared::cluster"
        assert default.count(arrive) == cfg.cluster * ptx.count(arrive) > 0
        # The remote address of the default's rank r is a constant r; wg_release's is the lane's.
        assert not re.search(r"mapa\.shared::cluster\.u32\s+%r\d+, %r\d+, %r\d+;", default)
        assert re.search(r"mapa\.shared::cluster\.u32\s+%r\d+, %r\d+, %r\d+;", ptx)
    else:
        arrive = re.compile(r"mbarrier\.arrive(\.release\.cta)?\.shared(::cta)?\.b64")
        assert len(arrive.findall(default)) == len(arrive.findall(ptx)) > 0
    for op in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait.parity", "st.global.b32"):
        assert ptx.count(op) == default.count(op), op


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit)")
@pytest.mark.parametrize("m, k, n, tuning", [
    (256, 8192, 7168, {}),                       # o_proj: 8 k-blocks unrolled per loop
    (256, 7168, 10240, {"w_blocked": 1}),        # qkv: 80 accumulators, 10 W pieces per stage
    (256, 7168, 163840, {"wide": 1}),            # lm_head: 128 accumulators, 9-10 tiles per CTA
])
def test_static_stages_assemble_without_spills_or_serialized_wgmma(tmp_path, m, k, n, tuning):
    """The unrolled loops keep every descriptor and address in registers: ptxas reports no
    spills and no performance advisory (wgmma serialized, C75xx)."""
    cfg = gemm.plan(m, k, n, None, 132, static_stages=1, **tuning)
    src = tmp_path / "gemm.ptx"
    src.write_text(_wide_ptx(cfg))
    report = run_ptxas(src, tmp_path / "gemm.cubin", "-v")
    assert "0 bytes spill stores" in report and "0 bytes spill loads" in report, report
    assert "Performance Loss" not in report and not re.search(r"\(C75\d\d\)", report), report
